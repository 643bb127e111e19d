//! Stopped turns (ADR 0028): a stop marks the running turn `stopping` under the conversation's
//! row lock; the gateway settles a turn still `stopping` after the grace period as `stopped`,
//! committing what was streamed through the one-transaction answer of `converger_batch_answer`.
//!
//! `stopping` is not `pending`: no takeover, lease claim or redelivery hands the turn on, while
//! the agent's own answer is still taken (and completes the turn as usual).

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use uuid::Uuid;

use super::answers::{AnswerRow, answer_outcome};
use super::{lock_open, unanswered_turns};
use crate::activities::{Activity, Sender, SenderRole, stored_extra};
use crate::lifecycle::SYSTEM_SENDER;
use crate::{AnswerFrame, AnswerOutcome, Store, StoreError, TurnAnswer};

/// A turn a stop names: the key, the turn frame's commit time (owners are decided at it) and
/// when the revision was opened (a regenerated revision's owners are decided then).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
pub struct StoppedTurn {
    /// The turn's seq.
    pub seq: i64,
    /// Its latest revision.
    pub revision: i32,
    /// The turn frame's commit time.
    pub at: DateTime<Utc>,
    /// When the revision was opened: the turn frame's commit time for revision 0, the edit
    /// frame's or the regenerate's for a later one.
    pub opened_at: DateTime<Utc>,
}

/// What a stop request found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopOutcome {
    /// The turn was running and is now stopping: its owners are told, and it settles once.
    Stopping {
        /// The turn (the latest, for a stop without a seq).
        turn: StoppedTurn,
        /// For a stop without a seq, the earlier turns still waiting, stopping too.
        earlier: Vec<StoppedTurn>,
        /// The conversation's channel.
        channel_id: Uuid,
    },
    /// A stop of this turn was requested before: nothing changed (an idempotent repeat).
    AlreadyStopping {
        /// The turn.
        turn: StoppedTurn,
    },
    /// The turn is answered, stopped or settled by a close: nothing to stop.
    NotRunning {
        /// The turn.
        turn: StoppedTurn,
    },
    /// No turn of the conversation is waiting for an answer or stopping (a stop without a
    /// seq).
    NothingRunning,
    /// The seq names no turn of this conversation.
    NoSuchTurn,
}

impl StopOutcome {
    /// What a stop answers: whether a turn is stopping now, and which turn (the one named, or
    /// the latest found); `None` when the seq names no turn.
    pub fn answer(&self) -> Option<(bool, Option<StoppedTurn>)> {
        match self {
            StopOutcome::Stopping { turn, .. } | StopOutcome::AlreadyStopping { turn } => {
                Some((true, Some(*turn)))
            }
            StopOutcome::NotRunning { turn } => Some((false, Some(*turn))),
            StopOutcome::NothingRunning => Some((false, None)),
            StopOutcome::NoSuchTurn => None,
        }
    }
}

/// A stop whose grace ran out, found by the sweep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverdueStop {
    /// Conversation.
    pub conversation_id: Uuid,
    /// The turn's seq.
    pub seq: i64,
    /// The revision stopping.
    pub revision: i32,
    /// Why it was stopped.
    pub reason: String,
}

/// What a settlement did.
#[derive(Debug, Clone, PartialEq)]
pub enum Settlement {
    /// The turn is `stopped` now, with this frame committed as its result.
    Settled(Box<Activity>),
    /// Nothing was stored: the turn was no longer `stopping` (the agent answered in time,
    /// another node settled it, or a close did), or a newer revision of it exists (it is then
    /// `stopped` without a frame).
    NotStopping,
}

/// The frame a settlement commits: the text streamed so far (empty when nothing was), from the
/// gateway itself, under the stream's id when there was a stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoppedAnswer {
    /// The stream whose text this is, when the turn was streamed.
    pub stream_id: Option<String>,
    /// The text streamed before the stop.
    pub text: String,
    /// Why the turn was stopped (`stopped`, `superseded`, …).
    pub reason: String,
}

impl StoppedAnswer {
    /// The one frame of the settlement of revision `revision` of turn `seq`.
    fn frame(&self, seq: i64, revision: i32) -> AnswerFrame {
        let mut extra = Map::new();
        if let Some(stream_id) = &self.stream_id {
            extra.insert("streamId".into(), Value::String(stream_id.clone()));
        }
        AnswerFrame {
            id: Some(
                self.stream_id
                    .clone()
                    .unwrap_or_else(|| Uuid::now_v7().to_string()),
            ),
            kind: "text".into(),
            data: serde_json::json!({
                "text": self.text,
                "status": "stopped",
                "reason": self.reason,
                "turn": {"seq": seq, "revision": revision},
            }),
            metadata: None,
            extra,
        }
    }
}

impl Store {
    /// Stops the turn at `seq` (its latest revision), or, without a seq, every turn of the
    /// conversation still waiting for its answer (with `enqueue`, the one being answered and
    /// those queued behind it: a stop button means that nothing more comes), for `reason`.
    /// Under the conversation's row lock, so it orders with sends and a close.
    /// `ConversationNotFound` / `ConversationClosed` when the conversation is missing or closed.
    pub async fn request_stop(
        &self,
        conversation_id: Uuid,
        seq: Option<i64>,
        reason: &str,
    ) -> Result<StopOutcome, StoreError> {
        self.timed("request_stop", async {
            let mut transaction = self.pool.begin().await?;
            let channel_id = match lock_open(&mut transaction, conversation_id).await? {
                Ok(channel_id) => channel_id,
                Err(refused) => return Ok(Err(refused)),
            };
            let outcome = match seq {
                Some(seq) => {
                    let latest: Option<(i32, String, DateTime<Utc>, DateTime<Utc>)> =
                        sqlx::query_as(
                            "SELECT t.revision, t.status, a.created_at, t.created_at
                         FROM turns t
                         JOIN activities a
                           ON a.conversation_id = t.conversation_id AND a.seq = t.seq
                         WHERE t.conversation_id = $1 AND t.seq = $2
                         ORDER BY t.revision DESC
                         LIMIT 1",
                        )
                        .bind(conversation_id)
                        .bind(seq)
                        .fetch_optional(&mut *transaction)
                        .await?;
                    let Some((revision, status, at, opened_at)) = latest else {
                        return Ok(Ok(StopOutcome::NoSuchTurn));
                    };
                    let turn = StoppedTurn {
                        seq,
                        revision,
                        at,
                        opened_at,
                    };
                    match status.as_str() {
                        "pending" => StopOutcome::Stopping {
                            turn,
                            earlier: Vec::new(),
                            channel_id,
                        },
                        "stopping" => StopOutcome::AlreadyStopping { turn },
                        _ => StopOutcome::NotRunning { turn },
                    }
                }
                None => {
                    let unanswered = unanswered_turns(&mut transaction, conversation_id).await?;
                    let (mut running, stopping): (Vec<_>, Vec<_>) = unanswered
                        .into_iter()
                        .partition(|(_, status)| status == "pending");
                    match (running.pop(), stopping.last()) {
                        (Some((turn, _)), _) => StopOutcome::Stopping {
                            turn,
                            earlier: running.into_iter().map(|(turn, _)| turn).collect(),
                            channel_id,
                        },
                        (None, Some((turn, _))) => StopOutcome::AlreadyStopping { turn: *turn },
                        (None, None) => StopOutcome::NothingRunning,
                    }
                }
            };
            if let StopOutcome::Stopping { turn, earlier, .. } = &outcome {
                for stopped in earlier.iter().chain([turn]) {
                    sqlx::query(
                        "UPDATE turns
                         SET status = 'stopping', stop_reason = $4, stop_requested_at = now()
                         WHERE conversation_id = $1 AND seq = $2 AND revision = $3",
                    )
                    .bind(conversation_id)
                    .bind(stopped.seq)
                    .bind(stopped.revision)
                    .bind(reason)
                    .execute(&mut *transaction)
                    .await?;
                }
            }
            transaction.commit().await?;
            Ok(Ok(outcome))
        })
        .await?
    }

    /// Settles a turn still `stopping` as `stopped`, committing `answer` as its result in one
    /// transaction (the conversation's row lock first, as every writer takes it), announced
    /// like any commit.
    pub async fn settle_stop(
        &self,
        conversation_id: Uuid,
        seq: i64,
        revision: i32,
        answer: &StoppedAnswer,
    ) -> Result<Settlement, StoreError> {
        let settled = TurnAnswer {
            conversation_id,
            seq,
            revision,
            sender: Sender {
                id: SYSTEM_SENDER.into(),
                role: SenderRole::System,
            },
            frames: vec![answer.frame(seq, revision)],
            runtime: None,
            fence: None,
        };
        let fingerprint = settled.fingerprint();
        let frame = &settled.frames[0];
        let row = self
            .timed("settle_stop", async {
                let mut transaction = self.pool.begin().await?;
                sqlx::query("SELECT 1 FROM conversations WHERE id = $1 FOR NO KEY UPDATE")
                    .bind(conversation_id)
                    .execute(&mut *transaction)
                    .await?;
                let status: Option<String> = sqlx::query_scalar(
                    "SELECT status FROM turns
                     WHERE conversation_id = $1 AND seq = $2 AND revision = $3
                     FOR UPDATE",
                )
                .bind(conversation_id)
                .bind(seq)
                .bind(revision)
                .fetch_optional(&mut *transaction)
                .await?;
                if status.as_deref() != Some("stopping") {
                    return Ok(None);
                }
                // The answer's own checks (revision, runtime, frames under the row lock) and
                // its frames: as an agent's answer commits.
                let row: sqlx::types::Json<AnswerRow> = sqlx::query_scalar(
                    "SELECT to_jsonb(answer) FROM converger_batch_answer(
                         $1, $2, $3, NULL, $4, $5, 'system', false, 0, NULL,
                         ARRAY[$6], ARRAY[$7], ARRAY[$8::jsonb], ARRAY[NULL::jsonb],
                         ARRAY[$9::jsonb]) AS answer",
                )
                .bind(conversation_id)
                .bind(seq)
                .bind(revision)
                .bind(&fingerprint)
                .bind(SYSTEM_SENDER)
                .bind(frame.id.as_deref())
                .bind(&frame.kind)
                .bind(&frame.data)
                .bind(stored_extra(&frame.extra))
                .fetch_one(&mut *transaction)
                .await?;
                let outcome = answer_outcome(&settled, row.0)?;
                // Superseded by a newer revision meanwhile (an edit or a regenerate after the
                // stop): that revision runs on, and this one is settled without a frame.
                let activities = match outcome {
                    AnswerOutcome::Committed { activities, .. } => activities,
                    _ => Vec::new(),
                };
                sqlx::query(
                    "UPDATE turns SET status = 'stopped', completed_at = now()
                     WHERE conversation_id = $1 AND seq = $2 AND revision = $3",
                )
                .bind(conversation_id)
                .bind(seq)
                .bind(revision)
                .execute(&mut *transaction)
                .await?;
                let Some(activity) = activities.into_iter().next() else {
                    transaction.commit().await?;
                    return Ok(None);
                };
                sqlx::query(
                    "WITH event AS (
                         INSERT INTO outbox (conversation_id, seq_from, seq_to)
                         VALUES ($1, $2, $2) RETURNING id
                     )
                     SELECT converger_notify(
                            json_build_object('k', 'c', 'e', event.id, 'c', $1::uuid,
                                              's', $2::bigint)::text)
                     FROM event",
                )
                .bind(conversation_id)
                .bind(activity.seq)
                .execute(&mut *transaction)
                .await?;
                transaction.commit().await?;
                Ok(Some(activity))
            })
            .await?;
        Ok(match row {
            Some(activity) => Settlement::Settled(Box::new(activity)),
            None => Settlement::NotStopping,
        })
    }

    /// Turns `stopping` for longer than `overdue` (their stopping node did not settle them),
    /// at most `limit`.
    pub async fn overdue_stops(
        &self,
        overdue: std::time::Duration,
        limit: i64,
    ) -> Result<Vec<OverdueStop>, StoreError> {
        let rows: Vec<(Uuid, i64, i32, Option<String>)> = self
            .timed("overdue_stops", async {
                sqlx::query_as(
                    "SELECT conversation_id, seq, revision, stop_reason FROM turns
                     WHERE status = 'stopping'
                       AND stop_requested_at < now() - make_interval(secs => $1)
                     ORDER BY stop_requested_at
                     LIMIT $2",
                )
                .bind(overdue.as_secs_f64())
                .bind(limit)
                .fetch_all(&self.pool)
                .await
            })
            .await?;
        Ok(rows
            .into_iter()
            .map(|(conversation_id, seq, revision, reason)| OverdueStop {
                conversation_id,
                seq,
                revision,
                reason: reason.unwrap_or_default(),
            })
            .collect())
    }
}
