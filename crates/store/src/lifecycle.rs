//! Closing and reopening conversations (ADR 0023): one statement changes the status, appends the
//! `conversationUpdate` frame under the next seq, settles the waiting (and stopping) turns of a
//! close, returning them so their agents are told, writes the outbox row and notifies. A write after a close finds the status changed where it
//! allocates its seq, so the close frame is the last frame of a closed conversation.

use serde_json::json;
use uuid::Uuid;

use crate::activities::{ACTIVITY_COLUMNS, Activity};
use crate::conversations::Conversation;
use crate::turns::StoppedTurn;
use crate::{Store, StoreError};

/// Sender id (and role) of the frames the gateway itself writes.
pub const SYSTEM_SENDER: &str = "system";
/// The `type` of the frame a status change appends (the wire owns the name).
pub use converger_protocol::CONVERSATION_UPDATE;
/// Longest `reason` of a status change, in characters.
pub const MAX_REASON_CHARS: usize = 200;

/// A status change of a conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusChange {
    /// `open` → `closed`: writes are refused, waiting turns are settled as closed.
    Close,
    /// `closed` → `open`: writes are taken again.
    Reopen,
}

impl StatusChange {
    /// The status before the change.
    fn from(self) -> &'static str {
        match self {
            StatusChange::Close => "open",
            StatusChange::Reopen => "closed",
        }
    }

    /// The status after the change.
    pub fn to(self) -> &'static str {
        match self {
            StatusChange::Close => "closed",
            StatusChange::Reopen => "open",
        }
    }

    /// The `event` of the `conversationUpdate` frame.
    pub fn event(self) -> &'static str {
        match self {
            StatusChange::Close => "closed",
            StatusChange::Reopen => "reopened",
        }
    }
}

/// What a status change did.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    /// The conversation as it is now.
    pub conversation: Conversation,
    /// The appended `conversationUpdate` frame; `None` when the conversation already had the
    /// status (an idempotent repeat: nothing was written).
    pub frame: Option<Activity>,
    /// The waiting turns a close settled as `closed`.
    pub settled: Vec<StoppedTurn>,
}

/// A close the expiry sweep made: its frame and the turns it settled.
#[derive(Debug, Clone, PartialEq)]
pub struct Expired {
    /// The conversation's channel.
    pub channel_id: Uuid,
    /// The appended `conversationUpdate` frame.
    pub frame: Activity,
    /// The waiting turns it settled as `closed`.
    pub settled: Vec<StoppedTurn>,
}

/// The statement of a status change: $1 conversation, $2 status before, $3 status after,
/// $4 the frame's id, $5 its data. Returns the appended frame; no row when the conversation is
/// missing or did not have status $2.
fn status_change_sql() -> String {
    // Run after the row lock is held (see `change_status`): of two racing closes exactly one
    // finds the status to change, and the settled turns include every turn committed before.
    format!(
        "WITH conv AS (
             UPDATE conversations SET status = $3, last_seq = last_seq + 1, updated_at = now()
             WHERE id = $1 AND status = $2 RETURNING id, last_seq, channel_id
         ), act AS (
             INSERT INTO activities
                 (conversation_id, seq, id, type, sender_id, sender_role, data, created_at)
             SELECT conv.id, conv.last_seq, $4, '{CONVERSATION_UPDATE}', '{SYSTEM_SENDER}',
                    'system', $5, clock_timestamp()
             FROM conv
             RETURNING {ACTIVITY_COLUMNS}
         ), settled AS (
             UPDATE turns SET status = 'closed', completed_at = now()
             WHERE $3 = 'closed' AND status IN ('pending', 'stopping')
               AND conversation_id = (SELECT id FROM conv)
             RETURNING seq, revision, status, created_at
         ), event AS (
             INSERT INTO outbox (conversation_id, seq_from, seq_to)
             SELECT conversation_id, seq, seq FROM act RETURNING id, conversation_id, seq_from
         ), notified AS (
             SELECT converger_notify(
                    json_build_object('k', 'c', 'e', event.id, 'c', event.conversation_id,
                                      's', event.seq_from, 'h', conv.channel_id)::text)::text
             FROM event, conv
         )
         SELECT {ACTIVITY_COLUMNS},
                (SELECT coalesce(jsonb_agg(jsonb_build_object(
                            'seq', s.seq, 'revision', s.revision, 'at', a.created_at,
                            'opened_at', s.created_at)), '[]')
                 FROM settled s
                 JOIN activities a ON a.conversation_id = $1 AND a.seq = s.seq) AS settled,
                (SELECT channel_id FROM conv) AS channel_id
         FROM act WHERE (SELECT count(*) FROM notified) = 1"
    )
}

/// What the status change's statement returns: the appended frame, and the turns a close
/// settled (their agents are told, ADR 0028).
#[derive(sqlx::FromRow)]
struct Changed {
    #[sqlx(flatten)]
    frame: Activity,
    settled: sqlx::types::Json<Vec<StoppedTurn>>,
    channel_id: Uuid,
}

/// The status change's statement with its parameters bound.
fn status_change(
    sql: &str,
    conversation_id: Uuid,
    change: StatusChange,
    reason: &str,
) -> sqlx::query::QueryAs<'static, sqlx::Postgres, Changed, sqlx::postgres::PgArguments> {
    let data = json!({"event": change.event(), "status": change.to(), "reason": reason});
    sqlx::query_as::<_, Changed>(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(conversation_id)
        .bind(change.from())
        .bind(change.to())
        .bind(Uuid::now_v7().to_string())
        .bind(data)
}

impl Store {
    /// Closes or reopens a conversation with `reason`; `None` when there is no such
    /// conversation.
    pub async fn change_status(
        &self,
        conversation_id: Uuid,
        change: StatusChange,
        reason: &str,
    ) -> Result<Option<Transition>, StoreError> {
        let sql = status_change_sql();
        let frame = self
            .timed("change_status", async {
                // The row lock first, in a statement of its own: the change then runs with a
                // snapshot taken after every writer that held the row committed, so the turns
                // they added are settled too, and no write can follow the close.
                let mut transaction = self.pool.begin().await?;
                sqlx::query("SELECT 1 FROM conversations WHERE id = $1 FOR UPDATE")
                    .bind(conversation_id)
                    .execute(&mut *transaction)
                    .await?;
                let changed = status_change(&sql, conversation_id, change, reason)
                    .fetch_optional(&mut *transaction)
                    .await?;
                transaction.commit().await?;
                Ok(changed.map(|changed| (changed.frame, changed.settled.0)))
            })
            .await?;
        let Some(conversation) = self.conversation(conversation_id).await? else {
            return Ok(None);
        };
        let (frame, settled) = match frame {
            Some((frame, settled)) => (Some(frame), settled),
            None => (None, Vec::new()),
        };
        Ok(Some(Transition {
            conversation,
            frame,
            settled,
        }))
    }

    /// Closes, with reason `expired`, up to `batch` open conversations that had no frame for
    /// `idle_secs`, in one transaction that holds an advisory lock, so one node sweeps at a
    /// time: the appended frames. Empty when another node is sweeping or nothing is idle.
    pub async fn expire_idle(
        &self,
        idle_secs: u64,
        batch: i64,
    ) -> Result<Vec<Expired>, StoreError> {
        let idle_secs = idle_secs as f64;
        let sql = status_change_sql();
        self.timed("expire_idle", async {
            let mut transaction = self.pool.begin().await?;
            let sweeping: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)")
                .bind(EXPIRY_LOCK)
                .fetch_one(&mut *transaction)
                .await?;
            if !sweeping {
                return Ok(Vec::new());
            }
            // No index serves this look-up (one on `updated_at` would make every head update a
            // non-HOT one), so it reads the table: by a scan, not by a whole index and a heap
            // fetch per row, which the connection's `enable_seqscan = off` would pick (ADR 0044).
            sqlx::query("SET LOCAL enable_seqscan = on")
                .execute(&mut *transaction)
                .await?;
            // A conversation being written now is skipped: it is not idle.
            let idle: Vec<Uuid> = sqlx::query_scalar(
                "SELECT id FROM conversations
                 WHERE status = 'open'
                   AND updated_at < now() - make_interval(secs => $1)
                 ORDER BY updated_at
                 LIMIT $2
                 FOR UPDATE SKIP LOCKED",
            )
            .bind(idle_secs)
            .bind(batch)
            .fetch_all(&mut *transaction)
            .await?;
            let mut closed = Vec::with_capacity(idle.len());
            for conversation_id in idle {
                let changed =
                    status_change(&sql, conversation_id, StatusChange::Close, EXPIRED_REASON)
                        .fetch_optional(&mut *transaction)
                        .await?;
                closed.extend(changed.map(|changed| Expired {
                    channel_id: changed.channel_id,
                    frame: changed.frame,
                    settled: changed.settled.0,
                }));
            }
            transaction.commit().await?;
            Ok(closed)
        })
        .await
    }
}

/// The `reason` of a close by expiry.
pub const EXPIRED_REASON: &str = "expired";

/// The advisory lock key of the expiry sweep (a constant used for nothing else).
const EXPIRY_LOCK: i64 = 0x636f_6e76_6578_7031;
