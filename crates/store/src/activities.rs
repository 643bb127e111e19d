//! Activities: the persistent frames of a conversation, each with a gap-free seq.
//!
//! A frame commits in a batch of the group commit (`group_commit`): its seq is allocated under the
//! conversation row lock, and the batch's transaction inserts the activity, the turn row for
//! user frames and the outbox row, and calls `pg_notify`, which Postgres delivers only if the
//! transaction commits.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::{Store, StoreError};

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
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, Serialize, Deserialize)]
pub struct Activity {
    /// Conversation.
    pub conversation_id: Uuid,
    /// Position in the conversation.
    pub seq: i64,
    /// Frame id.
    pub id: String,
    /// Frame type.
    #[sqlx(rename = "type")]
    #[serde(rename = "type")]
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

pub(crate) const ACTIVITY_COLUMNS: &str = "conversation_id, seq, id, type, sender_id, sender_role, data, metadata, extra, client_id, created_at, turn_seq, turn_revision";

/// Frames of one conversation to read: after `after_seq`, up to `up_to_seq`, and committed at
/// or after `since_ms` (ms since the epoch) when that is named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameRange {
    /// The conversation.
    pub conversation_id: Uuid,
    /// Frames after this seq.
    pub after_seq: i64,
    /// Frames up to this seq.
    pub up_to_seq: i64,
    /// Frames committed at or after this time, when named.
    pub since_ms: Option<i64>,
}

impl Activity {
    /// Commit time in milliseconds since the Unix epoch, as sent on the wire.
    pub fn timestamp_ms(&self) -> i64 {
        self.created_at.timestamp_millis()
    }
}

/// The id to store for a frame, a user's or an agent's: the sender's own, else a fresh uuid v7.
pub(crate) fn stored_id(id: Option<&String>) -> String {
    id.cloned().unwrap_or_else(|| Uuid::now_v7().to_string())
}

/// A frame's other top-level fields as stored: `NULL` when there are none.
pub(crate) fn stored_extra(extra: &Map<String, Value>) -> Option<Value> {
    (!extra.is_empty()).then(|| Value::Object(extra.clone()))
}

impl NewActivity {
    /// The id to store: the sender's, else a fresh uuid v7.
    pub(crate) fn stored_id(&self) -> String {
        stored_id(self.id.as_ref())
    }

    /// The other top-level fields to store: `NULL` when there are none.
    pub(crate) fn stored_extra(&self) -> Option<Value> {
        self.extra.as_ref().and_then(stored_extra)
    }

    /// True when storage can hold every part of the frame (no NUL character anywhere).
    pub(crate) fn is_storable(&self) -> bool {
        let texts = [
            Some(self.kind.as_str()),
            self.id.as_deref(),
            Some(self.sender.id.as_str()),
            self.client_id.as_deref(),
        ];
        !texts.into_iter().flatten().any(|text| text.contains('\0'))
            && !converger_protocol::contains_nul(&self.data)
            && !self
                .metadata
                .as_ref()
                .is_some_and(converger_protocol::contains_nul)
            && !self.extra.as_ref().is_some_and(|extra| {
                extra.iter().any(|(key, value)| {
                    key.contains('\0') || converger_protocol::contains_nul(value)
                })
            })
    }

    /// True when the frame opens a turn (the end user wrote it).
    pub(crate) fn is_turn(&self) -> bool {
        self.sender.role == SenderRole::User
    }
}

impl Store {
    /// Commits one frame (a user turn when the sender is the end user) in a single statement,
    /// grouped with other sessions' writes into one transaction (see `group_commit`).
    /// A repeated idempotency key returns the original frame with `duplicate: true`.
    pub async fn commit_activity(&self, new: &NewActivity) -> Result<CommitOutcome, StoreError> {
        if crate::faults::injected(crate::faults::BEFORE_COMMIT) {
            return Err(StoreError::Injected(crate::faults::BEFORE_COMMIT));
        }
        // A frame Postgres cannot parse would fail the whole batch's argument, before any
        // isolation could help: it is refused here, alone.
        if !new.is_storable() {
            return Err(StoreError::unstorable());
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

    /// The frames of one or several conversations in one read, in order of conversation and
    /// seq: what a channel actor's plans need, for one commit it heard or for the holes a
    /// read-back after a lag finds in many conversations at once (ADR 0041).
    pub async fn activities_in_ranges(
        &self,
        ranges: &[FrameRange],
    ) -> Result<Vec<Activity>, StoreError> {
        if crate::faults::injected(crate::faults::LIST_ACTIVITIES) {
            return Err(StoreError::Injected(crate::faults::LIST_ACTIVITIES));
        }
        let conversations: Vec<Uuid> = ranges.iter().map(|range| range.conversation_id).collect();
        let afters: Vec<i64> = ranges.iter().map(|range| range.after_seq).collect();
        let up_tos: Vec<i64> = ranges.iter().map(|range| range.up_to_seq).collect();
        let sinces: Vec<Option<f64>> = ranges
            .iter()
            .map(|range| range.since_ms.map(|ms| ms as f64))
            .collect();
        // One probe of the primary key per range (a join could read whole conversations).
        self.timed("activities_in_ranges", async {
            sqlx::query_as::<_, Activity>(sqlx::AssertSqlSafe(format!(
                "SELECT frame.* FROM unnest($1::uuid[], $2::bigint[], $3::bigint[],
                                            $4::double precision[])
                      AS range(range_conversation, after_seq, up_to_seq, since_ms)
                 CROSS JOIN LATERAL (
                     SELECT {ACTIVITY_COLUMNS} FROM activities
                     WHERE conversation_id = range.range_conversation
                       AND seq > range.after_seq AND seq <= range.up_to_seq
                       AND (range.since_ms IS NULL
                            OR created_at >= to_timestamp(range.since_ms / 1000))
                     ORDER BY seq) frame
                 ORDER BY frame.conversation_id, frame.seq"
            )))
            .bind(&conversations)
            .bind(&afters)
            .bind(&up_tos)
            .bind(&sinces)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }

    /// Frames with `seq` > `after_seq`, in order, at most `limit`.
    pub async fn list_activities(
        &self,
        conversation_id: Uuid,
        after_seq: i64,
        limit: i64,
    ) -> Result<Vec<Activity>, StoreError> {
        if crate::faults::injected(crate::faults::LIST_ACTIVITIES) {
            return Err(StoreError::Injected(crate::faults::LIST_ACTIVITIES));
        }
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
