//! The turn registry: one row per (conversation, seq, revision) of every user turn, its status,
//! its answer's fingerprint and, in lease mode, its claim.
//!
//! - `answers.rs`: the one-transaction answer to a turn, and conversation runtimes;
//! - `pending.rs`: unanswered turns read back (takeovers, a node's first agent, status);
//! - `leases.rs`: claims, renewals and releases (lease mode);
//! - `policies.rs`: a send under a turn policy (reject, interrupt, rollback);
//! - `progress.rs`: where a turn stands, for clients following its answer;
//! - `revisions.rs`: edits and regenerates;
//! - `stops.rs`: stops, and their settlement after the grace period.

mod answers;
mod leases;
mod pending;
mod policies;
mod progress;
mod revisions;
mod stops;

pub use answers::{AnswerFrame, AnswerOutcome, RuntimeWrite, TurnAnswer, initial_runtime};
pub use leases::{Claim, StreamableTurn};
pub use pending::{ChannelPendingTurn, PendingTurn};
pub use policies::{PolicyCommit, PolicyVerdict};
pub use progress::{TurnProgress, TurnRevision};
pub use revisions::{Revision, RevisionRecord};
pub use stops::{OverdueStop, Settlement, StopOutcome, StoppedAnswer, StoppedTurn};

/// Locks an open conversation's row as every writer does (`FOR NO KEY UPDATE`) in `connection`'s
/// transaction; its channel, or `ConversationNotFound` / `ConversationClosed`.
async fn lock_open(
    connection: &mut sqlx::PgConnection,
    conversation_id: uuid::Uuid,
) -> Result<Result<uuid::Uuid, crate::StoreError>, sqlx::Error> {
    let conversation: Option<(String, uuid::Uuid)> = sqlx::query_as(
        "SELECT status, channel_id FROM conversations WHERE id = $1 FOR NO KEY UPDATE",
    )
    .bind(conversation_id)
    .fetch_optional(&mut *connection)
    .await?;
    Ok(match conversation {
        None => Err(crate::StoreError::ConversationNotFound),
        Some((status, _)) if status != "open" => Err(crate::StoreError::ConversationClosed),
        Some((_, channel_id)) => Ok(channel_id),
    })
}

/// The latest revision of each turn of the conversation that waits for its answer (`pending`)
/// or is being stopped (`stopping`), with its status and the turn frame's commit time, oldest
/// first. Read under the conversation's row lock, which every writer of a turn's status holds.
async fn unanswered_turns(
    connection: &mut sqlx::PgConnection,
    conversation_id: uuid::Uuid,
) -> Result<Vec<(StoppedTurn, String)>, sqlx::Error> {
    type Row = (
        i64,
        i32,
        String,
        chrono::DateTime<chrono::Utc>,
        chrono::DateTime<chrono::Utc>,
    );
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT t.seq, t.revision, t.status, a.created_at, t.created_at
         FROM turns t
         JOIN activities a ON a.conversation_id = t.conversation_id AND a.seq = t.seq
         WHERE t.conversation_id = $1 AND t.status IN ('pending', 'stopping')
           AND NOT EXISTS (SELECT 1 FROM turns later
                           WHERE later.conversation_id = t.conversation_id
                             AND later.seq = t.seq AND later.revision > t.revision)
         ORDER BY t.seq",
    )
    .bind(conversation_id)
    .fetch_all(&mut *connection)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(seq, revision, status, at, opened_at)| {
            let turn = StoppedTurn {
                seq,
                revision,
                at,
                opened_at,
            };
            (turn, status)
        })
        .collect())
}
