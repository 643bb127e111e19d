//! Where a turn stands, for a client that follows its answer (the chat frontends, docs/frontends.md):
//! its status and committed answer, its latest revision, the turn still running, and which of a
//! client's message ids a conversation already holds.

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
    /// The turn's latest revision (above this one's when an edit or a regenerate replaced it).
    pub latest_revision: i32,
}

impl TurnProgress {
    /// True once the turn has its one result (an answer, a stop's settlement, a failure).
    pub fn is_settled(&self) -> bool {
        !matches!(self.status.as_str(), "pending" | "stopping")
    }
}

/// A turn at one revision (a turn still waiting for its answer, where a query says so).
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct TurnRevision {
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
                "SELECT status, coalesce(result_seqs, '{}') AS result_seqs, stop_reason,
                        (SELECT max(revision) FROM turns
                         WHERE conversation_id = $1 AND seq = $2) AS latest_revision
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

    /// The first turn revision after `after` (a later turn, or a later revision of the same
    /// turn), as its latest revision: what a client following every turn shows next. `None`
    /// when there is none yet.
    pub async fn next_turn_after(
        &self,
        conversation_id: Uuid,
        after: TurnRevision,
    ) -> Result<Option<TurnRevision>, StoreError> {
        self.timed("next_turn_after", async {
            sqlx::query_as::<_, TurnRevision>(
                "SELECT seq, max(revision) AS revision FROM turns
                 WHERE conversation_id = $1 AND seq >= $2
                 GROUP BY seq
                 HAVING seq > $2 OR max(revision) > $3
                 ORDER BY seq LIMIT 1",
            )
            .bind(conversation_id)
            .bind(after.seq)
            .bind(after.revision)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// The conversation's latest turn, at its latest revision, answered or not.
    pub async fn latest_turn(
        &self,
        conversation_id: Uuid,
    ) -> Result<Option<TurnRevision>, StoreError> {
        self.timed("latest_turn", async {
            sqlx::query_as::<_, TurnRevision>(
                "SELECT seq, revision FROM turns WHERE conversation_id = $1
                 ORDER BY seq DESC, revision DESC LIMIT 1",
            )
            .bind(conversation_id)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// The earliest turn of the conversation whose latest revision waits for its answer (the
    /// one streaming now when turns queue behind each other), else the earliest whose stop is
    /// settling; `None` when every turn is answered.
    pub async fn running_turn(
        &self,
        conversation_id: Uuid,
    ) -> Result<Option<TurnRevision>, StoreError> {
        self.timed("running_turn", async {
            sqlx::query_as::<_, TurnRevision>(
                "SELECT seq, revision FROM (
                     SELECT DISTINCT ON (seq) seq, revision, status FROM turns
                     WHERE conversation_id = $1
                     ORDER BY seq, revision DESC
                 ) latest
                 WHERE status IN ('pending', 'stopping')
                 ORDER BY status = 'stopping', seq LIMIT 1",
            )
            .bind(conversation_id)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// The latest revision of the turn at `seq`; `None` when there is no such turn.
    pub async fn latest_revision(
        &self,
        conversation_id: Uuid,
        seq: i64,
    ) -> Result<Option<i32>, StoreError> {
        self.timed("latest_revision", async {
            sqlx::query_scalar::<_, i32>(
                "SELECT max(revision) FROM turns WHERE conversation_id = $1 AND seq = $2
                 HAVING count(*) > 0",
            )
            .bind(conversation_id)
            .bind(seq)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// Which of `ids` the frames of user `user_id` in the conversation already carry, as their
    /// idempotency key (`clientId`) or as their own id (a frame sent without a key is known to
    /// clients by its id).
    pub async fn known_message_ids(
        &self,
        conversation_id: Uuid,
        user_id: &str,
        ids: &[String],
    ) -> Result<Vec<String>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        // Ids are found through the index of their hashes (ADR 0040), compared themselves too.
        self.timed("known_message_ids", async {
            sqlx::query_scalar::<_, String>(
                "SELECT client_id FROM activities
                 WHERE conversation_id = $1 AND sender_id = $2 AND client_id = ANY($3)
                 UNION
                 SELECT id FROM activities
                 WHERE conversation_id = $1
                   AND hashtextextended(id, 0) = ANY(ARRAY(SELECT hashtextextended(asked, 0) FROM unnest($3::text[]) AS asked))
                   AND id = ANY($3) AND sender_id = $2",
            )
            .bind(conversation_id)
            .bind(user_id)
            .bind(ids)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }
}
