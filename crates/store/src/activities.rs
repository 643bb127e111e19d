//! Activities: the persistent frames of a conversation, each with a gap-free seq.
//!
//! A commit is one SQL statement (one round trip): it allocates the seq under the conversation
//! row lock, inserts the activity, the turn row for user frames, the outbox row, and calls
//! `pg_notify`, which Postgres delivers only if the transaction commits. Statements of many
//! sessions share one transaction (`group_commit`).

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::{NOTIFY_CHANNEL, Store, StoreError};

/// Who wrote a frame, as seen in `sender.role`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SenderRole {
    /// The conversation's end user.
    User,
    /// A bot (agent answers shown as the bot).
    Bot,
    /// An agent process or human agent.
    Agent,
    /// The system itself.
    System,
}

impl SenderRole {
    /// The stored and wire form.
    pub fn as_str(self) -> &'static str {
        match self {
            SenderRole::User => "user",
            SenderRole::Bot => "bot",
            SenderRole::Agent => "agent",
            SenderRole::System => "system",
        }
    }
}

/// The author of a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sender {
    /// Participant id (user id, agent id).
    pub id: String,
    /// Participant role.
    pub role: SenderRole,
}

/// A frame to commit.
#[derive(Debug, Clone)]
pub struct NewActivity {
    /// Target conversation.
    pub conversation_id: Uuid,
    /// The frame's `id`: kept when the sender supplied one, else a fresh uuid v7.
    pub id: Option<String>,
    /// The frame's `type` (`text`, `event`, …).
    pub kind: String,
    /// Author.
    pub sender: Sender,
    /// The frame's `data`.
    pub data: Value,
    /// The frame's `metadata`, when present.
    pub metadata: Option<Value>,
    /// Other top-level fields of the frame, kept as given.
    pub extra: Option<Map<String, Value>>,
    /// Idempotency key, unique per (conversation, sender).
    pub client_id: Option<String>,
}

/// A committed frame.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Activity {
    /// Conversation.
    pub conversation_id: Uuid,
    /// Position in the conversation.
    pub seq: i64,
    /// Frame id.
    pub id: String,
    /// Frame type.
    #[sqlx(rename = "type")]
    pub kind: String,
    /// Author id.
    pub sender_id: String,
    /// Author role (`user`, `bot`, `agent`, `system`).
    pub sender_role: String,
    /// The frame's `data`.
    pub data: Value,
    /// The frame's `metadata`.
    pub metadata: Option<Value>,
    /// Other top-level fields as given.
    pub extra: Option<Value>,
    /// The author's idempotency key.
    pub client_id: Option<String>,
    /// Commit time (database clock).
    pub created_at: DateTime<Utc>,
    /// The turn this frame belongs to: the answered turn for agent results, the edited turn
    /// for an edit.
    pub turn_seq: Option<i64>,
    /// The revision of that turn.
    pub turn_revision: Option<i32>,
}

/// The result of a commit: the stored frame and whether it already existed.
#[derive(Debug, Clone, PartialEq)]
pub struct CommitOutcome {
    /// The stored frame (the original one for a duplicate).
    pub activity: Activity,
    /// True when the idempotency key matched an earlier commit; nothing new was stored.
    pub duplicate: bool,
}

/// Whose view a frame is rendered for, which decides `from` and `clientId`.
#[derive(Debug, Clone, Copy)]
pub enum Viewer<'a> {
    /// The conversation's end user; `author_copy` is true on the author's other connections.
    EndUser {
        /// The viewing user's id.
        user_id: &'a str,
        /// Include `clientId` (a copy for the author's other connections or REST).
        include_client_id: bool,
    },
    /// An agent or observer: `from` is relative to the conversation's end user.
    Agent,
}

pub(crate) const ACTIVITY_COLUMNS: &str = "conversation_id, seq, id, type, sender_id, sender_role, data, metadata, extra, client_id, created_at, turn_seq, turn_revision";

impl Activity {
    /// Commit time in milliseconds since the Unix epoch, as sent on the wire.
    pub fn timestamp_ms(&self) -> i64 {
        self.created_at.timestamp_millis()
    }

    /// The persistent frame as a client sees it. Server-owned fields overwrite any the sender
    /// tried to set, so the result is the same for live delivery, replay and REST.
    pub fn to_frame(&self, viewer: Viewer<'_>) -> Value {
        let mut frame = match &self.extra {
            Some(Value::Object(extra)) => extra.clone(),
            _ => Map::new(),
        };
        let from_user = match viewer {
            Viewer::EndUser { user_id, .. } => {
                self.sender_role == "user" && self.sender_id == user_id
            }
            Viewer::Agent => self.sender_role == "user",
        };
        frame.insert("type".into(), Value::String(self.kind.clone()));
        frame.insert("id".into(), Value::String(self.id.clone()));
        frame.insert("seq".into(), Value::from(self.seq));
        frame.insert(
            "from".into(),
            Value::String(if from_user { "user" } else { "bot" }.into()),
        );
        frame.insert(
            "sender".into(),
            serde_json::json!({"id": self.sender_id, "role": self.sender_role}),
        );
        frame.insert("data".into(), self.data.clone());
        frame.insert("timestamp".into(), Value::from(self.timestamp_ms()));
        if let Some(metadata) = &self.metadata {
            frame.insert("metadata".into(), metadata.clone());
        }
        let include_client_id = matches!(
            viewer,
            Viewer::EndUser { include_client_id: true, user_id } if user_id == self.sender_id
        );
        if let (true, Some(client_id)) = (include_client_id, &self.client_id) {
            frame.insert("clientId".into(), Value::String(client_id.clone()));
        }
        Value::Object(frame)
    }
}

/// The one statement that commits a frame: `None` when the conversation is missing or closed.
/// `existing` and `conv` read one snapshot; a racing insert with the same key is caught by the
/// unique index instead, which aborts the statement (and its transaction) as a whole. The
/// timestamp is read after the row lock is held, so within a conversation it never goes
/// backwards as seq grows (ownership compares it with members' `since`).
pub(crate) async fn insert_activity(
    connection: &mut PgConnection,
    new: &NewActivity,
) -> Result<Option<CommitOutcome>, sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "WITH existing AS (
                 SELECT {ACTIVITY_COLUMNS} FROM activities
                 WHERE conversation_id = $1 AND sender_id = $4 AND client_id = $9
             ), conv AS (
                 UPDATE conversations SET last_seq = last_seq + 1, updated_at = now()
                 WHERE id = $1 AND status = 'open' AND NOT EXISTS (SELECT 1 FROM existing)
                 RETURNING id, last_seq, channel_id
             ), act AS (
                 INSERT INTO activities
                     (conversation_id, seq, id, type, sender_id, sender_role, data, metadata, extra, client_id, created_at)
                 SELECT conv.id, conv.last_seq, $2, $3, $4, $5, $6, $7, $8, $9, clock_timestamp() FROM conv
                 RETURNING {ACTIVITY_COLUMNS}
             ), turn AS (
                 INSERT INTO turns (conversation_id, seq, revision, status, created_at)
                 SELECT conversation_id, seq, 0, 'pending', created_at FROM act WHERE $10
             ), event AS (
                 INSERT INTO outbox (conversation_id, seq_from, seq_to)
                 SELECT conversation_id, seq, seq FROM act
                 RETURNING id, conversation_id, seq_from
             ), notified AS (
                 SELECT pg_notify('{NOTIFY_CHANNEL}',
                        json_build_object('k', 'c', 'e', event.id, 'c', event.conversation_id, 's', event.seq_from, 'h', conv.channel_id)::text)::text AS done
                 FROM event, conv
             )
             SELECT {ACTIVITY_COLUMNS}, false AS duplicate FROM act WHERE (SELECT count(*) FROM notified) = 1
             UNION ALL
             SELECT {ACTIVITY_COLUMNS}, true AS duplicate FROM existing"
        )
    });
    let id = new.id.clone().unwrap_or_else(|| Uuid::now_v7().to_string());
    let is_user_turn = new.sender.role == SenderRole::User;
    let extra = new
        .extra
        .as_ref()
        .filter(|map| !map.is_empty())
        .map(|map| Value::Object(map.clone()));
    let row = sqlx::query_as::<_, ActivityWithFlag>(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(new.conversation_id)
        .bind(&id)
        .bind(&new.kind)
        .bind(&new.sender.id)
        .bind(new.sender.role.as_str())
        .bind(&new.data)
        .bind(&new.metadata)
        .bind(&extra)
        .bind(&new.client_id)
        .bind(is_user_turn)
        .fetch_optional(connection)
        .await?;
    Ok(row.map(|row| CommitOutcome {
        activity: row.activity,
        duplicate: row.duplicate,
    }))
}

impl Store {
    /// Commits one frame (a user turn when the sender is the end user) in a single statement,
    /// grouped with other sessions' writes into one transaction (see `group_commit`).
    /// A repeated idempotency key returns the original frame with `duplicate: true`.
    pub async fn commit_activity(&self, new: &NewActivity) -> Result<CommitOutcome, StoreError> {
        if crate::faults::injected(crate::faults::BEFORE_COMMIT) {
            return Err(StoreError::Injected(crate::faults::BEFORE_COMMIT));
        }
        match self.group_commit.activity(new.clone()).await {
            Ok(Some(outcome)) => return Ok(outcome),
            Ok(None) => return Err(self.why_not_committed(new.conversation_id).await),
            // Two concurrent sends with one key: the loser's whole statement rolled back (no seq
            // was burned), and the winner's row is now visible.
            Err(error) if error.is_unique_violation() => {}
            Err(error) => return Err(error),
        }
        let original = self.find_by_client_id(new).await?;
        original
            .map(|activity| CommitOutcome {
                activity,
                duplicate: true,
            })
            .ok_or_else(|| StoreError::Config("idempotency key conflict without a row".into()))
    }

    async fn find_by_client_id(&self, new: &NewActivity) -> Result<Option<Activity>, StoreError> {
        self.timed("find_by_client_id", async {
            sqlx::query_as::<_, Activity>(sqlx::AssertSqlSafe(format!(
                "SELECT {ACTIVITY_COLUMNS} FROM activities
                 WHERE conversation_id = $1 AND sender_id = $2 AND client_id = $3"
            )))
            .bind(new.conversation_id)
            .bind(&new.sender.id)
            .bind(&new.client_id)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// Explains an empty commit: the conversation is missing or closed.
    async fn why_not_committed(&self, conversation_id: Uuid) -> StoreError {
        match self.conversation(conversation_id).await {
            Ok(Some(_)) => StoreError::ConversationClosed,
            Ok(None) => StoreError::ConversationNotFound,
            Err(error) => error,
        }
    }

    /// Frames with `seq` > `after_seq`, in order, at most `limit`.
    pub async fn list_activities(
        &self,
        conversation_id: Uuid,
        after_seq: i64,
        limit: i64,
    ) -> Result<Vec<Activity>, StoreError> {
        self.timed("list_activities", async {
            sqlx::query_as::<_, Activity>(sqlx::AssertSqlSafe(format!(
                "SELECT {ACTIVITY_COLUMNS} FROM activities
                 WHERE conversation_id = $1 AND seq > $2 ORDER BY seq LIMIT $3"
            )))
            .bind(conversation_id)
            .bind(after_seq)
            .bind(limit)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }
}

#[derive(sqlx::FromRow)]
struct ActivityWithFlag {
    #[sqlx(flatten)]
    activity: Activity,
    duplicate: bool,
}
