//! Conversations: one end user's thread in a channel, with its seq head.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{Store, StoreError};

/// A conversation row.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Conversation {
    /// Conversation id.
    pub id: Uuid,
    /// Owning tenant.
    pub tenant_id: Uuid,
    /// Channel the conversation belongs to.
    pub channel_id: Uuid,
    /// The end user of the conversation.
    pub user_id: String,
    /// `open` or `closed`.
    pub status: String,
    /// Highest committed seq (0 = empty).
    pub last_seq: i64,
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

const CONVERSATION_COLUMNS: &str =
    "id, tenant_id, channel_id, user_id, status, last_seq, created_at";

impl Store {
    /// Creates an empty conversation in a channel, with its runtime at version 0.
    pub async fn create_conversation(
        &self,
        channel_id: Uuid,
        user_id: &str,
    ) -> Result<Conversation, StoreError> {
        // One statement: the conversation and its runtime row appear together or not at all.
        let created = self
            .timed("create_conversation", async {
                sqlx::query_as::<_, Conversation>(sqlx::AssertSqlSafe(format!(
                    "WITH conversation AS (
                         INSERT INTO conversations (id, tenant_id, channel_id, user_id)
                         SELECT $1, tenant_id, id, $3 FROM channels WHERE id = $2
                         RETURNING {CONVERSATION_COLUMNS}
                     ), runtime AS (
                         INSERT INTO conversation_runtime (conversation_id) SELECT id FROM conversation
                     )
                     SELECT {CONVERSATION_COLUMNS} FROM conversation"
                )))
                .bind(Uuid::now_v7())
                .bind(channel_id)
                .bind(user_id)
                .fetch_optional(&self.pool)
                .await
            })
            .await?;
        created.ok_or(StoreError::ChannelNotFound)
    }

    /// A conversation by id.
    pub async fn conversation(&self, id: Uuid) -> Result<Option<Conversation>, StoreError> {
        self.timed("conversation", async {
            sqlx::query_as::<_, Conversation>(sqlx::AssertSqlSafe(format!(
                "SELECT {CONVERSATION_COLUMNS} FROM conversations WHERE id = $1"
            )))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }
}
