//! HTTP agent groups (ADR 0031): which group of which channel is served by calling a URL, with
//! what limits; and the dead letters, the turns whose calls all failed.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{Store, StoreError};

/// An HTTP agent group as stored (the secret included: every node signs with it).
#[derive(Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct HttpAgent {
    /// The channel.
    pub channel_id: Uuid,
    /// The group's name.
    pub group_name: String,
    /// Where each turn is posted.
    pub url: String,
    /// The HMAC-SHA256 key the calls are signed with, if any.
    pub secret: Option<String>,
    /// A call's whole deadline (connect, response and stream).
    pub timeout_ms: i32,
    /// Calls to this group in flight at once, per node.
    pub max_concurrency: i32,
    /// Calls of one turn before it fails.
    pub retry_attempts: i32,
    /// The first wait between calls (doubled each time).
    pub retry_backoff_ms: i32,
    /// Created.
    pub created_at: DateTime<Utc>,
    /// Last changed.
    pub updated_at: DateTime<Utc>,
}

/// Never prints the secret (a group is logged and shown in errors).
impl std::fmt::Debug for HttpAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpAgent")
            .field("channel_id", &self.channel_id)
            .field("group_name", &self.group_name)
            .field("url", &self.url)
            .field("has_secret", &self.secret.is_some())
            .field("timeout_ms", &self.timeout_ms)
            .field("max_concurrency", &self.max_concurrency)
            .field("retry_attempts", &self.retry_attempts)
            .field("retry_backoff_ms", &self.retry_backoff_ms)
            .finish_non_exhaustive()
    }
}

/// What a create or an update writes.
#[derive(Clone, PartialEq, Eq)]
pub struct HttpAgentSettings {
    /// Where each turn is posted (checked against the operator's allowlist by the caller).
    pub url: String,
    /// The signing key, if any.
    pub secret: Option<String>,
    /// A call's whole deadline.
    pub timeout_ms: i32,
    /// Calls in flight at once, per node.
    pub max_concurrency: i32,
    /// Calls of one turn before it fails.
    pub retry_attempts: i32,
    /// The first wait between calls.
    pub retry_backoff_ms: i32,
}

/// A turn whose calls all failed.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct DeadLetter {
    /// Conversation.
    pub conversation_id: Uuid,
    /// The turn's seq.
    pub seq: i64,
    /// Its revision.
    pub revision: i32,
    /// The channel.
    pub channel_id: Uuid,
    /// The group that failed it.
    pub group_name: String,
    /// The URL called.
    pub url: String,
    /// Attempts made (a call an open circuit breaker refused counts as one).
    pub attempts: i32,
    /// The last call's failure.
    pub error: String,
    /// When the turn failed.
    pub failed_at: DateTime<Utc>,
}

const COLUMNS: &str = "channel_id, group_name, url, secret, timeout_ms, max_concurrency, \
                       retry_attempts, retry_backoff_ms, created_at, updated_at";

impl Store {
    /// Creates an HTTP agent group; `None` when the channel already has a group of that name
    /// served over HTTP.
    pub async fn create_http_agent(
        &self,
        channel_id: Uuid,
        group: &str,
        settings: &HttpAgentSettings,
    ) -> Result<Option<HttpAgent>, StoreError> {
        let sql = format!(
            "INSERT INTO http_agents (channel_id, group_name, url, secret, timeout_ms,
                                      max_concurrency, retry_attempts, retry_backoff_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (channel_id, group_name) DO NOTHING
             RETURNING {COLUMNS}"
        );
        self.write_http_agent("create_http_agent", sql, channel_id, group, settings)
            .await
    }

    /// Replaces a group's settings; `None` when there is no such group.
    pub async fn update_http_agent(
        &self,
        channel_id: Uuid,
        group: &str,
        settings: &HttpAgentSettings,
    ) -> Result<Option<HttpAgent>, StoreError> {
        let sql = format!(
            "UPDATE http_agents
                SET url = $3, secret = $4, timeout_ms = $5, max_concurrency = $6,
                    retry_attempts = $7, retry_backoff_ms = $8, updated_at = now()
              WHERE channel_id = $1 AND group_name = $2
             RETURNING {COLUMNS}"
        );
        self.write_http_agent("update_http_agent", sql, channel_id, group, settings)
            .await
    }

    /// Runs `sql`, which takes the channel ($1), the group ($2) and the settings in the order of
    /// the table's columns ($3 to $8), and returns the row it wrote, if any.
    async fn write_http_agent(
        &self,
        operation: &'static str,
        sql: String,
        channel_id: Uuid,
        group: &str,
        settings: &HttpAgentSettings,
    ) -> Result<Option<HttpAgent>, StoreError> {
        self.timed(operation, async {
            sqlx::query_as::<_, HttpAgent>(sqlx::AssertSqlSafe(sql))
                .bind(channel_id)
                .bind(group)
                .bind(&settings.url)
                .bind(&settings.secret)
                .bind(settings.timeout_ms)
                .bind(settings.max_concurrency)
                .bind(settings.retry_attempts)
                .bind(settings.retry_backoff_ms)
                .fetch_optional(&self.pool)
                .await
        })
        .await
    }

    /// Deletes a group; false when there was none.
    pub async fn delete_http_agent(
        &self,
        channel_id: Uuid,
        group: &str,
    ) -> Result<bool, StoreError> {
        self.timed("delete_http_agent", async {
            sqlx::query("DELETE FROM http_agents WHERE channel_id = $1 AND group_name = $2")
                .bind(channel_id)
                .bind(group)
                .execute(&self.pool)
                .await
                .map(|done| done.rows_affected() > 0)
        })
        .await
    }

    /// One group.
    pub async fn http_agent(
        &self,
        channel_id: Uuid,
        group: &str,
    ) -> Result<Option<HttpAgent>, StoreError> {
        self.timed("http_agent", async {
            sqlx::query_as::<_, HttpAgent>(sqlx::AssertSqlSafe(format!(
                "SELECT {COLUMNS} FROM http_agents WHERE channel_id = $1 AND group_name = $2"
            )))
            .bind(channel_id)
            .bind(group)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// A channel's groups (`Some`), or every active channel's (`None`), by channel and name.
    pub async fn http_agents(
        &self,
        channel_id: Option<Uuid>,
    ) -> Result<Vec<HttpAgent>, StoreError> {
        self.timed("http_agents", async {
            sqlx::query_as::<_, HttpAgent>(sqlx::AssertSqlSafe(format!(
                "SELECT {COLUMNS} FROM http_agents a
                  WHERE ($1::uuid IS NULL AND EXISTS (SELECT 1 FROM channels c
                                                      WHERE c.id = a.channel_id
                                                        AND c.status = 'active'))
                     OR a.channel_id = $1
                  ORDER BY channel_id, group_name"
            )))
            .bind(channel_id)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }

    /// Settles a turn revision whose calls all failed: `failed` in the registry and a dead
    /// letter, in one transaction. False (nothing written) when the turn is no longer waiting
    /// for an answer: answered, stopped, closed, or replaced by a newer revision.
    pub async fn fail_turn(&self, letter: &DeadLetter) -> Result<bool, StoreError> {
        self.timed("fail_turn", async {
            sqlx::query_scalar::<_, bool>(
                "WITH failed AS (
                     UPDATE turns t SET status = 'failed', completed_at = now()
                      WHERE t.conversation_id = $1 AND t.seq = $2 AND t.revision = $3
                        AND t.status = 'pending'
                        AND t.revision = (SELECT max(revision) FROM turns
                                           WHERE conversation_id = $1 AND seq = $2)
                     RETURNING 1
                 ), letter AS (
                     INSERT INTO http_agent_dead_letters
                         (conversation_id, seq, revision, channel_id, group_name, url,
                          attempts, error)
                     SELECT $1, $2, $3, $4, $5, $6, $7, $8 FROM failed
                     ON CONFLICT (conversation_id, seq, revision, group_name) DO UPDATE
                        SET attempts = EXCLUDED.attempts, error = EXCLUDED.error,
                            failed_at = now()
                     RETURNING 1
                 )
                 SELECT EXISTS (SELECT 1 FROM failed)",
            )
            .bind(letter.conversation_id)
            .bind(letter.seq)
            .bind(letter.revision)
            .bind(letter.channel_id)
            .bind(&letter.group_name)
            .bind(&letter.url)
            .bind(letter.attempts)
            .bind(&letter.error)
            .fetch_one(&self.pool)
            .await
        })
        .await
    }

    /// A channel's dead letters, oldest first, at most `limit`.
    pub async fn dead_letters(
        &self,
        channel_id: Uuid,
        limit: i64,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        self.timed("dead_letters", async {
            sqlx::query_as::<_, DeadLetter>(
                "SELECT conversation_id, seq, revision, channel_id, group_name, url, attempts,
                        error, failed_at
                   FROM http_agent_dead_letters WHERE channel_id = $1
                  ORDER BY failed_at, conversation_id, seq LIMIT $2",
            )
            .bind(channel_id)
            .bind(limit)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }

    /// Takes a dead letter for a retry: removes it and, when the turn revision is still the
    /// failed latest one of an open conversation, makes it `pending` again, in one statement
    /// under the conversation's row lock (as every writer of a turn's status takes it), so two
    /// retries of one letter make one call. `None` when there was no such letter.
    pub async fn take_dead_letter(
        &self,
        channel_id: Uuid,
        conversation_id: Uuid,
        seq: i64,
        revision: i32,
        group: &str,
    ) -> Result<Option<DeadLetter>, StoreError> {
        self.timed("take_dead_letter", async {
            sqlx::query_as::<_, DeadLetter>(
                "WITH open_conversation AS (
                     SELECT id FROM conversations
                      WHERE id = $2 AND status = 'open'
                        FOR NO KEY UPDATE
                 ), taken AS (
                     DELETE FROM http_agent_dead_letters
                      WHERE channel_id = $1 AND conversation_id = $2 AND seq = $3
                        AND revision = $4 AND group_name = $5
                     RETURNING *
                 ), reopened AS (
                     UPDATE turns t SET status = 'pending', completed_at = NULL
                       FROM taken, open_conversation
                      WHERE t.conversation_id = taken.conversation_id AND t.seq = taken.seq
                        AND t.revision = taken.revision AND t.status = 'failed'
                        AND t.revision = (SELECT max(revision) FROM turns
                                           WHERE conversation_id = $2 AND seq = $3)
                     RETURNING 1
                 )
                 SELECT conversation_id, seq, revision, channel_id, group_name, url, attempts,
                        error, failed_at FROM taken",
            )
            .bind(channel_id)
            .bind(conversation_id)
            .bind(seq)
            .bind(revision)
            .bind(group)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// Drops a dead letter without a retry (the turn stays `failed`); false when there was none.
    pub async fn drop_dead_letter(
        &self,
        channel_id: Uuid,
        conversation_id: Uuid,
        seq: i64,
        revision: i32,
        group: &str,
    ) -> Result<bool, StoreError> {
        self.timed("drop_dead_letter", async {
            sqlx::query(
                "DELETE FROM http_agent_dead_letters
                  WHERE channel_id = $1 AND conversation_id = $2 AND seq = $3
                    AND revision = $4 AND group_name = $5",
            )
            .bind(channel_id)
            .bind(conversation_id)
            .bind(seq)
            .bind(revision)
            .bind(group)
            .execute(&self.pool)
            .await
            .map(|done| done.rows_affected() > 0)
        })
        .await
    }
}
