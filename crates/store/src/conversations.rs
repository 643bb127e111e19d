//! Conversations: one end user's thread in a channel, with its seq head.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::channels::CHANNEL_COLUMNS;
use crate::{Channel, Store, StoreError};

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
    /// Time of the latest frame (or of the creation).
    pub updated_at: DateTime<Utc>,
}

pub(crate) const CONVERSATION_COLUMNS: &str =
    "id, tenant_id, channel_id, user_id, status, last_seq, created_at, updated_at";

/// Which of a tenant's conversations a page lists, and from where.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConversationFilter {
    /// Only this status (`open` or `closed`).
    pub status: Option<String>,
    /// Only this channel.
    pub channel_id: Option<Uuid>,
    /// Only this end user.
    pub user_id: Option<String>,
    /// Only conversations with a frame (or created) at or after this time.
    pub updated_since: Option<DateTime<Utc>>,
    /// The keyset cursor: only ids after this one (ids are uuid v7, so creation order).
    pub after: Option<Uuid>,
}

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

impl Store {
    /// Up to `limit` of a tenant's conversations matching `filter`, by id (creation order). A
    /// conversation created while a client pages appears on a later page, never twice, and no
    /// earlier one is skipped: the cursor is the last id returned.
    pub async fn list_conversations(
        &self,
        tenant_id: Uuid,
        filter: &ConversationFilter,
        limit: i64,
    ) -> Result<Vec<Conversation>, StoreError> {
        self.timed("list_conversations", async {
            sqlx::query_as::<_, Conversation>(sqlx::AssertSqlSafe(format!(
                "SELECT {CONVERSATION_COLUMNS} FROM conversations
                 WHERE tenant_id = $1
                   AND ($2::uuid IS NULL OR id > $2)
                   AND ($3::text IS NULL OR status = $3)
                   AND ($4::uuid IS NULL OR channel_id = $4)
                   AND ($5::text IS NULL OR user_id = $5)
                   AND ($6::timestamptz IS NULL OR updated_at >= $6)
                 ORDER BY id
                 LIMIT $7"
            )))
            .bind(tenant_id)
            .bind(filter.after)
            .bind(filter.status.as_deref())
            .bind(filter.channel_id)
            .bind(filter.user_id.as_deref())
            .bind(filter.updated_since)
            .bind(limit)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }
}

/// An open interrupt: a persistent `interrupt` with no later `interrupt_resolved` of its id.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingInterrupt {
    /// The interrupt id.
    pub id: String,
    /// Its `data`.
    pub data: serde_json::Value,
}

/// The catalogs an agent published for a channel (latest wins).
#[derive(Debug, Clone, PartialEq)]
pub struct ChannelCatalogs {
    /// `{hash, components}` of the latest `genui_components`.
    pub components: Option<serde_json::Value>,
    /// `{hash, skills}` of the latest `skills`.
    pub skills: Option<serde_json::Value>,
}

/// What a session's welcome reads of its conversation, in one statement: a reconnect storm
/// brings every client's hello at once (ADR 0044).
#[derive(Debug, Clone, PartialEq)]
pub struct WelcomeReads {
    /// The conversation's head: its highest committed seq (0 = empty).
    pub head: i64,
    /// Its open interrupts, oldest first.
    pub pending_interrupts: Vec<PendingInterrupt>,
    /// Its channel's latest published catalogs.
    pub catalogs: ChannelCatalogs,
}

impl Store {
    /// The head, the open interrupts and the channel's catalogs of a conversation; `None` when
    /// there is no such conversation.
    pub async fn welcome_reads(
        &self,
        conversation_id: Uuid,
    ) -> Result<Option<WelcomeReads>, StoreError> {
        type Row = (
            i64,
            Option<serde_json::Value>,
            Option<serde_json::Value>,
            Vec<String>,
            Vec<serde_json::Value>,
        );
        // Interrupts are found through their partial index, and each one's resolution through
        // the index of id hashes (ADR 0040), the id compared too.
        let row: Option<Row> = self
            .timed("welcome_reads", async {
                sqlx::query_as(
                    "SELECT c.last_seq,
                            channel.settings -> 'genui_components',
                            channel.settings -> 'skills',
                            coalesce(pending.ids, '{}'),
                            coalesce(pending.data, '{}')
                     FROM conversations c
                     LEFT JOIN channels channel ON channel.id = c.channel_id
                     LEFT JOIN LATERAL (
                         SELECT array_agg(asked.id ORDER BY asked.seq) AS ids,
                                array_agg(asked.data ORDER BY asked.seq) AS data
                         FROM activities asked
                         WHERE asked.conversation_id = c.id AND asked.type = 'interrupt'
                           AND NOT EXISTS (
                               SELECT 1 FROM activities resolved
                               WHERE resolved.conversation_id = asked.conversation_id
                                 AND hashtextextended(resolved.id, 0) = hashtextextended(asked.id, 0)
                                 AND resolved.id = asked.id
                                 AND resolved.type = 'interrupt_resolved'
                                 AND resolved.seq > asked.seq)
                     ) pending ON true
                     WHERE c.id = $1",
                )
                .bind(conversation_id)
                .fetch_optional(&self.pool)
                .await
            })
            .await?;
        Ok(
            row.map(|(head, components, skills, ids, data)| WelcomeReads {
                head,
                pending_interrupts: ids
                    .into_iter()
                    .zip(data)
                    .map(|(id, data)| PendingInterrupt { id, data })
                    .collect(),
                catalogs: ChannelCatalogs { components, skills },
            }),
        )
    }

    /// Raises a participant's read position; `Some(seq)` when it moved, `None` when it was
    /// already at or beyond `seq`.
    pub async fn record_read(
        &self,
        conversation_id: Uuid,
        participant_id: &str,
        participant_role: &str,
        seq: i64,
    ) -> Result<Option<i64>, StoreError> {
        self.timed("record_read", async {
            sqlx::query_scalar::<_, i64>(
                "INSERT INTO conversation_reads (conversation_id, participant_id, participant_role, read_seq)
                 VALUES ($1, $2, $3, $4)
                 ON CONFLICT (conversation_id, participant_id)
                 DO UPDATE SET read_seq = EXCLUDED.read_seq, updated_at = now()
                 WHERE conversation_reads.read_seq < EXCLUDED.read_seq
                 RETURNING read_seq",
            )
            .bind(conversation_id)
            .bind(participant_id)
            .bind(participant_role)
            .bind(seq)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// A channel, whatever its status, and the conversation `conversation_id` names when it
    /// belongs to that channel, in one statement: a hello needs both before it is answered.
    /// `None` when there is no such channel. The conversation is found by its key alone, in a
    /// subquery the planner keeps apart (`LIMIT 1`): joined on the channel too, a plan made
    /// while the table was empty read 180,158 index entries in the plan test of
    /// tests/group_commit.rs once the channel had 30,000 conversations (ADR 0044).
    pub async fn channel_with_conversation(
        &self,
        channel_id: Uuid,
        conversation_id: Option<Uuid>,
    ) -> Result<Option<(Channel, Option<Conversation>)>, StoreError> {
        let row = self
            .timed("channel_with_conversation", async {
                sqlx::query_as::<_, ChannelWithConversationRow>(sqlx::AssertSqlSafe(format!(
                    "SELECT {CHANNEL_COLUMNS}, c.*
                       FROM channels
                       LEFT JOIN (SELECT id AS conversation_id,
                                         tenant_id AS conversation_tenant_id,
                                         channel_id AS conversation_channel_id,
                                         user_id AS conversation_user_id,
                                         status AS conversation_status,
                                         last_seq AS conversation_last_seq,
                                         created_at AS conversation_created_at,
                                         updated_at AS conversation_updated_at
                                    FROM conversations WHERE id = $2 LIMIT 1) AS c
                              ON c.conversation_channel_id = channels.id
                      WHERE channels.id = $1"
                )))
                .bind(channel_id)
                .bind(conversation_id)
                .fetch_optional(&self.pool)
                .await
            })
            .await?;
        Ok(row.map(ChannelWithConversationRow::split))
    }

    /// The conversations of a channel whose id is given, if the conversation belongs to it.
    pub async fn conversation_in_channel(
        &self,
        conversation_id: Uuid,
        channel_id: Uuid,
    ) -> Result<Option<Conversation>, StoreError> {
        Ok(self
            .conversation(conversation_id)
            .await?
            .filter(|conversation| conversation.channel_id == channel_id))
    }
}

/// A channel's row and, from the `LEFT JOIN`, a conversation's columns under prefixed names
/// (the two tables share column names); every conversation column is null when none matched.
#[derive(sqlx::FromRow)]
struct ChannelWithConversationRow {
    #[sqlx(flatten)]
    channel: Channel,
    conversation_id: Option<Uuid>,
    conversation_tenant_id: Option<Uuid>,
    conversation_channel_id: Option<Uuid>,
    conversation_user_id: Option<String>,
    conversation_status: Option<String>,
    conversation_last_seq: Option<i64>,
    conversation_created_at: Option<DateTime<Utc>>,
    conversation_updated_at: Option<DateTime<Utc>>,
}

impl ChannelWithConversationRow {
    fn split(self) -> (Channel, Option<Conversation>) {
        let conversation = self.conversation();
        (self.channel, conversation)
    }

    /// The joined conversation; its columns are all null or, being `NOT NULL` in the table,
    /// all present.
    fn conversation(&self) -> Option<Conversation> {
        Some(Conversation {
            id: self.conversation_id?,
            tenant_id: self.conversation_tenant_id?,
            channel_id: self.conversation_channel_id?,
            user_id: self.conversation_user_id.clone()?,
            status: self.conversation_status.clone()?,
            last_seq: self.conversation_last_seq?,
            created_at: self.conversation_created_at?,
            updated_at: self.conversation_updated_at?,
        })
    }
}
