//! Where a turn stands, for a client that follows its answer (the chat frontends, docs/frontends.md):
//! its status and committed answer, the turn still running, and which of a client's message ids
//! a conversation already holds.

use uuid::Uuid;

use crate::{Store, StoreError};

/// A turn revision's status and committed answer.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct TurnProgress {
    /// `pending`, `stopping`, `completed`, `stopped` or `failed`.
    pub status: String,
    /// The seqs of the committed answer (empty until it is committed).
    pub result_seqs: Vec<i64>,
    /// Why it was stopped, when it was.
    pub stop_reason: Option<String>,
}

impl TurnProgress {
    /// True once the turn has its one result (an answer, a stop's settlement, a failure).
    pub fn is_settled(&self) -> bool {
        !matches!(self.status.as_str(), "pending" | "stopping")
    }
}

/// A turn still waiting for its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct RunningTurn {
    /// The turn's seq.
    pub seq: i64,
    /// Its latest revision.
    pub revision: i32,
}

impl Store {
    /// The status and answer of one turn revision; `None` when there is no such revision.
    pub async fn turn_progress(
        &self,
        conversation_id: Uuid,
        seq: i64,
        revision: i32,
    ) -> Result<Option<TurnProgress>, StoreError> {
        self.timed("turn_progress", async {
            sqlx::query_as::<_, TurnProgress>(
                "SELECT status, coalesce(result_seqs, '{}') AS result_seqs, stop_reason
                 FROM turns WHERE conversation_id = $1 AND seq = $2 AND revision = $3",
            )
            .bind(conversation_id)
            .bind(seq)
            .bind(revision)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// The latest turn of the conversation whose latest revision waits for its answer (or for
    /// its stop to settle); `None` when every turn is answered.
    pub async fn running_turn(
        &self,
        conversation_id: Uuid,
    ) -> Result<Option<RunningTurn>, StoreError> {
        self.timed("running_turn", async {
            sqlx::query_as::<_, RunningTurn>(
                "SELECT seq, revision FROM (
                     SELECT DISTINCT ON (seq) seq, revision, status FROM turns
                     WHERE conversation_id = $1
                     ORDER BY seq DESC, revision DESC
                 ) latest
                 WHERE status IN ('pending', 'stopping')
                 ORDER BY seq DESC LIMIT 1",
            )
            .bind(conversation_id)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// Which of `client_ids` the frames of user `user_id` in the conversation already carry.
    pub async fn known_client_ids(
        &self,
        conversation_id: Uuid,
        user_id: &str,
        client_ids: &[String],
    ) -> Result<Vec<String>, StoreError> {
        if client_ids.is_empty() {
            return Ok(Vec::new());
        }
        self.timed("known_client_ids", async {
            sqlx::query_scalar::<_, String>(
                "SELECT client_id FROM activities
                 WHERE conversation_id = $1 AND sender_id = $2 AND client_id = ANY($3)",
            )
            .bind(conversation_id)
            .bind(user_id)
            .bind(client_ids)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }
}
