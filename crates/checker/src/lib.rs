//! The verdict of a converger run: what clients saw, checked against what the promises allow.
//!
//! [`history`] is the history checker: tests and load runs record acked sends, the frames each
//! subscriber received, the turns delivered to agents and the results acked, and
//! [`history::History::verdict`] counts lost turns, duplicate results, gaps, inversions,
//! doubles and duplicate deliveries. [`effects`] is the ledger of an external side-effect
//! service keyed by idempotency key (agents pass `meta.turn.key`), which shows whether a turn
//! delivered several times had its effect once. Both are pure; the `effects` feature adds the
//! ledger as an HTTP service ([`effects::Effects`]) for agents that run in other tasks.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod effects;
pub mod history;
