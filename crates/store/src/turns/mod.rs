//! The turn registry: one row per (conversation, seq, revision) of every user turn, its status,
//! its answer's fingerprint and, in lease mode, its claim.
//!
//! - `answers.rs`: the one-transaction answer to a turn, and conversation runtimes;
//! - `pending.rs`: unanswered turns read back (takeovers, a node's first agent, status);
//! - `leases.rs`: claims, renewals and releases (lease mode);
//! - `revisions.rs`: edits and regenerates;
//! - `stops.rs`: stops, and their settlement after the grace period.

mod answers;
mod leases;
mod pending;
mod revisions;
mod stops;

pub use answers::{AnswerFrame, AnswerOutcome, RuntimeWrite, TurnAnswer, initial_runtime};
pub(crate) use answers::{AnswerRow, answer_outcome};
pub use leases::{Claim, StreamableTurn};
pub use pending::{ChannelPendingTurn, PendingTurn};
pub use revisions::{Revision, RevisionRecord};
pub use stops::{OverdueStop, Settlement, StopOutcome, StoppedAnswer, StoppedTurn};
