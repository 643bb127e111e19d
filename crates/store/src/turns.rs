//! The turn registry and the one-transaction answer to a turn.
//!
//! An agent's answer to a turn — its frames, the conversation's runtime, the turn's completion
//! and the outbox event — commits in one transaction keyed by (conversation, seq, revision), so a
//! turn never gets two answers and a resend of the same answer is idempotent.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use sqlx::Row;
use uuid::Uuid;

use crate::activities::{ACTIVITY_COLUMNS, Activity, Sender, stored_extra};
use crate::{NOTIFY_CHANNEL, Store, StoreError};

/// One frame of an answer, split like a stored activity.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerFrame {
    /// The agent's own frame id, kept when given.
    pub id: Option<String>,
    /// Frame type.
    pub kind: String,
    /// The frame's `data`.
    pub data: Value,
    /// The frame's `metadata`.
    pub metadata: Option<Value>,
    /// Other top-level fields.
    pub extra: Map<String, Value>,
}

/// A runtime written with an answer: `version` is the one the agent read.
#[derive(Debug, Clone, PartialEq)]
pub struct RuntimeWrite {
    /// The version the agent based its answer on.
    pub version: i64,
    /// The new state.
    pub state: Value,
}

/// An agent's answer to one turn.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnAnswer {
    /// Conversation.
    pub conversation_id: Uuid,
    /// The turn's seq.
    pub seq: i64,
    /// The turn's revision.
    pub revision: i32,
    /// The answering agent.
    pub sender: Sender,
    /// The answer's frames, in order.
    pub frames: Vec<AnswerFrame>,
    /// The runtime to write, if any.
    pub runtime: Option<RuntimeWrite>,
    /// Lease mode: the fence of the delivery being answered; an older one is refused.
    pub fence: Option<i64>,
}

impl TurnAnswer {
    /// A stable digest of what the answer says (frames and runtime), so a resend is recognised
    /// and a different answer is a conflict.
    pub fn fingerprint(&self) -> String {
        let frames: Vec<Value> = self
            .frames
            .iter()
            .map(|frame| json!({"id": frame.id, "type": frame.kind, "data": frame.data, "metadata": frame.metadata, "extra": frame.extra}))
            .collect();
        let runtime = self
            .runtime
            .as_ref()
            .map(|runtime| json!({"version": runtime.version, "state": runtime.state}));
        // serde_json maps are ordered by key, so equal answers serialize identically.
        let canonical = json!({"frames": frames, "runtime": runtime}).to_string();
        hex::encode(Sha256::digest(canonical.as_bytes()))
    }
}

/// What became of an answer.
#[derive(Debug, Clone, PartialEq)]
pub enum AnswerOutcome {
    /// Stored now.
    Committed {
        /// The stored frames.
        activities: Vec<Activity>,
        /// When the answer was committed (the ack's timestamp, first time and on resends).
        completed_at: DateTime<Utc>,
    },
    /// The same answer was stored before; nothing new.
    Duplicate {
        /// The stored frames' ids.
        ids: Vec<String>,
        /// Their seqs.
        seqs: Vec<i64>,
        /// When the answer was committed.
        completed_at: DateTime<Utc>,
    },
    /// Another answer is already committed for this turn key.
    Conflict {
        /// The seqs of the committed answer.
        seqs: Vec<i64>,
    },
    /// A newer revision of the turn exists.
    Superseded {
        /// The latest revision.
        latest: i32,
    },
    /// Lease mode: the turn was claimed again since this answer's delivery (its fence is old).
    LeaseLost {
        /// The current fence.
        current: i64,
    },
    /// The runtime moved on since the agent read it.
    StaleRuntime {
        /// The current version.
        current: i64,
    },
    /// No such turn in this conversation.
    NoSuchTurn,
}

/// A turn as delivered to an agent.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingTurn {
    /// The frame to deliver: the turn's latest edit, or the turn itself.
    pub activity: Activity,
    /// The turn's seq (the original user frame's).
    pub turn_seq: i64,
    /// The latest revision.
    pub revision: i32,
    /// `edit` or `regenerate` for revisions above 0.
    pub reason: Option<String>,
}

impl Store {
    /// Commits an answer to a turn in one transaction (see the module comment).
    /// Its statements share a transaction with other sessions' writes (see `group_commit`).
    pub async fn commit_answer(&self, answer: &TurnAnswer) -> Result<AnswerOutcome, StoreError> {
        // Hashed here, before the write joins a transaction that holds other writes' locks.
        let fingerprint = answer.fingerprint();
        self.group_commit.answer(answer.clone(), fingerprint).await
    }

    /// The conversation's runtime: (version, state).
    pub async fn runtime(&self, conversation_id: Uuid) -> Result<(i64, Value), StoreError> {
        let mut found = self.runtimes(&[conversation_id]).await?;
        Ok(found
            .remove(&conversation_id)
            .unwrap_or_else(initial_runtime))
    }

    /// The runtimes of several conversations in one query; a conversation without a runtime
    /// row is absent (its runtime is [`initial_runtime`]).
    pub async fn runtimes(
        &self,
        conversation_ids: &[Uuid],
    ) -> Result<HashMap<Uuid, (i64, Value)>, StoreError> {
        let rows: Vec<(Uuid, i64, Value)> = self
            .timed("runtimes", async {
                sqlx::query_as(
                    "SELECT conversation_id, version, state FROM conversation_runtime
                     WHERE conversation_id = ANY($1)",
                )
                .bind(conversation_ids)
                .fetch_all(&self.pool)
                .await
            })
            .await?;
        Ok(rows
            .into_iter()
            .map(|(id, version, state)| (id, (version, state)))
            .collect())
    }

    /// The turns among `seqs` that are still unanswered at their latest revision, in order.
    pub async fn pending_turns(
        &self,
        conversation_id: Uuid,
        seqs: &[i64],
    ) -> Result<Vec<PendingTurn>, StoreError> {
        // The frame delivered is the latest edit of the turn when there is one, else the turn.
        let columns = ACTIVITY_COLUMNS
            .split(", ")
            .map(|column| format!("shown.{column}"))
            .collect::<Vec<_>>()
            .join(", ");
        let rows = self
            .timed("pending_turns", async {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT {columns}, a.seq AS pending_seq, t.revision AS pending_revision, t.reason AS pending_reason
                     FROM activities a
                     JOIN LATERAL (
                         SELECT revision, status, reason FROM turns
                         WHERE conversation_id = a.conversation_id AND seq = a.seq
                         ORDER BY revision DESC LIMIT 1
                     ) t ON t.status = 'pending'
                     JOIN activities shown ON shown.conversation_id = a.conversation_id AND shown.seq = COALESCE(
                         (SELECT source_seq FROM turns e
                          WHERE e.conversation_id = a.conversation_id AND e.seq = a.seq AND e.reason = 'edit'
                          ORDER BY e.revision DESC LIMIT 1),
                         a.seq)
                     WHERE a.conversation_id = $1 AND a.seq = ANY($2)
                     ORDER BY a.seq"
                )))
                .bind(conversation_id)
                .bind(seqs)
                .fetch_all(&self.pool)
                .await
            })
            .await?;
        rows.into_iter()
            .map(|row| {
                let activity = <Activity as sqlx::FromRow<_>>::from_row(&row)?;
                Ok(PendingTurn {
                    activity,
                    turn_seq: row.try_get("pending_seq")?,
                    revision: row.try_get("pending_revision")?,
                    reason: row.try_get("pending_reason")?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(StoreError::from)
    }
}

/// What claiming a turn for a lease-mode member gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Claimed (or still held by this holder): deliver it with this fence.
    Claimed {
        /// The fencing token the answer must carry.
        fence: i64,
    },
    /// Another holder's lease is live: try again once it has run out.
    Held {
        /// Milliseconds until the lease runs out (measured by the database clock, so node
        /// clocks do not matter).
        remaining_ms: i64,
    },
    /// The turn (revision) is answered, superseded or unknown: nothing to deliver.
    NotPending,
}

impl Store {
    /// Claims a turn's revision for `holder` for `lease`: a short statement, no row lock kept
    /// while the agent works. A new holder bumps the fence; the same holder keeps it.
    pub async fn claim_turn(
        &self,
        conversation_id: Uuid,
        seq: i64,
        revision: i32,
        holder: &str,
        lease: std::time::Duration,
    ) -> Result<Claim, StoreError> {
        let row: Option<(i64, Option<String>, Option<i64>, bool)> = self
            .timed("claim_turn", async {
                sqlx::query_as(
                    "WITH current AS (
                         SELECT status, claimed_by, lease_until FROM turns
                         WHERE conversation_id = $1 AND seq = $2 AND revision = $3
                     ), claimed AS (
                         UPDATE turns t
                         SET fence = CASE WHEN t.claimed_by = $4 AND t.lease_until >= now()
                                          THEN t.fence ELSE t.fence + 1 END,
                             claimed_by = $4,
                             lease_until = now() + make_interval(secs => $5)
                         WHERE t.conversation_id = $1 AND t.seq = $2 AND t.revision = $3
                           AND t.status = 'pending'
                           AND NOT EXISTS (SELECT 1 FROM turns later
                                           WHERE later.conversation_id = $1 AND later.seq = $2
                                             AND later.revision > $3)
                           AND (t.claimed_by IS NULL OR t.claimed_by = $4 OR t.lease_until < now())
                         RETURNING t.fence
                     )
                     SELECT coalesce((SELECT fence FROM claimed), -1),
                            (SELECT claimed_by FROM current),
                            (SELECT ceil(extract(epoch FROM lease_until - now()) * 1000)::bigint FROM current),
                            coalesce((SELECT status = 'pending' FROM current), false)",
                )
                .bind(conversation_id)
                .bind(seq)
                .bind(revision)
                .bind(holder)
                .bind(lease.as_secs_f64())
                .fetch_optional(&self.pool)
                .await
            })
            .await?;
        let Some((fence, holder_then, remaining_ms, pending)) = row else {
            return Ok(Claim::NotPending);
        };
        if fence >= 0 {
            return Ok(Claim::Claimed { fence });
        }
        match (pending, holder_then, remaining_ms) {
            (true, Some(_), Some(remaining_ms)) => Ok(Claim::Held {
                remaining_ms: remaining_ms.max(0),
            }),
            _ => Ok(Claim::NotPending),
        }
    }

    /// Extends every lease `holder` still holds (its member is connected).
    pub async fn renew_leases(
        &self,
        holder: &str,
        lease: std::time::Duration,
    ) -> Result<u64, StoreError> {
        let result = self
            .timed("renew_leases", async {
                sqlx::query(
                    "UPDATE turns SET lease_until = now() + make_interval(secs => $2)
                     WHERE (conversation_id, seq, revision) IN (SELECT conversation_id, seq, revision FROM turns
                         WHERE claimed_by = $1 AND status = 'pending'
                         ORDER BY conversation_id FOR UPDATE)",
                )
                .bind(holder)
                .bind(lease.as_secs_f64())
                .execute(&self.pool)
                .await
            })
            .await?;
        Ok(result.rows_affected())
    }

    /// Gives up every lease `holder` holds (its member left), so the next owner claims at once.
    pub async fn release_leases(&self, holder: &str) -> Result<u64, StoreError> {
        let result = self
            .timed("release_leases", async {
                sqlx::query(
                    "UPDATE turns SET claimed_by = NULL, lease_until = NULL
                     WHERE (conversation_id, seq, revision) IN (SELECT conversation_id, seq, revision FROM turns
                         WHERE claimed_by = $1 AND status = 'pending'
                         ORDER BY conversation_id FOR UPDATE)",
                )
                .bind(holder)
                .execute(&self.pool)
                .await
            })
            .await?;
        Ok(result.rows_affected())
    }
}

/// An unanswered turn of a channel, for the takeover memory of a node that starts serving it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ChannelPendingTurn {
    /// Conversation.
    pub conversation_id: Uuid,
    /// The turn's seq.
    pub seq: i64,
    /// When its latest revision was opened (database clock, ms).
    pub at_ms: i64,
}

impl Store {
    /// The channel's turns whose latest revision is unanswered and younger than `horizon`,
    /// oldest first, at most `limit`.
    pub async fn pending_turns_of_channel(
        &self,
        channel_id: Uuid,
        horizon: std::time::Duration,
        limit: i64,
    ) -> Result<Vec<ChannelPendingTurn>, StoreError> {
        let rows = self
            .timed("pending_turns_of_channel", async {
                sqlx::query_as::<_, ChannelPendingTurn>(
                    "SELECT t.conversation_id, t.seq,
                            floor(extract(epoch FROM t.created_at) * 1000)::bigint AS at_ms
                     FROM turns t JOIN conversations c ON c.id = t.conversation_id
                     WHERE t.status = 'pending'
                       AND t.created_at > now() - make_interval(secs => $2)
                       AND c.channel_id = $1
                       AND NOT EXISTS (
                           SELECT 1 FROM turns later
                           WHERE later.conversation_id = t.conversation_id
                             AND later.seq = t.seq AND later.revision > t.revision)
                     ORDER BY t.created_at, t.conversation_id, t.seq
                     LIMIT $3",
                )
                .bind(channel_id)
                .bind(horizon.as_secs_f64())
                .bind(limit)
                .fetch_all(&self.pool)
                .await
            })
            .await?;
        Ok(rows)
    }
}

impl Store {
    /// Turns of the last hour still waiting for an answer, cluster-wide (the status page).
    pub async fn unanswered_turns(&self) -> Result<i64, StoreError> {
        let count = self
            .timed("unanswered_turns", async {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM turns t
                     WHERE t.status = 'pending' AND t.created_at > now() - interval '1 hour'
                       AND NOT EXISTS (
                           SELECT 1 FROM turns later
                           WHERE later.conversation_id = t.conversation_id
                             AND later.seq = t.seq AND later.revision > t.revision)",
                )
                .fetch_one(&self.pool)
                .await
            })
            .await?;
        Ok(count)
    }

    /// Frames committed per second over the last `window_secs`, cluster-wide, from the outbox.
    pub async fn committed_per_second(&self, window_secs: u32) -> Result<f64, StoreError> {
        let frames = self
            .timed("committed_per_second", async {
                sqlx::query_scalar::<_, i64>(
                    "SELECT coalesce(sum(seq_to - seq_from + 1), 0)::bigint FROM outbox
                     WHERE seq_to IS NOT NULL AND created_at > now() - make_interval(secs => $1)",
                )
                .bind(f64::from(window_secs))
                .fetch_one(&self.pool)
                .await
            })
            .await?;
        Ok(frames as f64 / f64::from(window_secs.max(1)))
    }

    /// The conversation's turns at or below `up_to` whose latest revision is unanswered.
    pub async fn pending_turns_up_to(
        &self,
        conversation_id: Uuid,
        up_to: i64,
    ) -> Result<Vec<ChannelPendingTurn>, StoreError> {
        let rows = self
            .timed("pending_turns_up_to", async {
                sqlx::query_as::<_, ChannelPendingTurn>(
                    "SELECT t.conversation_id, t.seq,
                            floor(extract(epoch FROM t.created_at) * 1000)::bigint AS at_ms
                     FROM turns t
                     WHERE t.conversation_id = $1 AND t.seq <= $2 AND t.status = 'pending'
                       AND NOT EXISTS (
                           SELECT 1 FROM turns later
                           WHERE later.conversation_id = t.conversation_id
                             AND later.seq = t.seq AND later.revision > t.revision)
                     ORDER BY t.seq",
                )
                .bind(conversation_id)
                .bind(up_to)
                .fetch_all(&self.pool)
                .await
            })
            .await?;
        Ok(rows)
    }
}

/// The runtime of a conversation that has none stored: version 0, state `{}`.
pub fn initial_runtime() -> (i64, Value) {
    (0, json!({}))
}

/// What `converger_answer_turn` returns (migration 20261130000003), as `converger_commit_batch`
/// returns it (a JSON object with the OUT parameters' names).
#[derive(Deserialize)]
pub(crate) struct AnswerRow {
    o_outcome: String,
    o_number: Option<i64>,
    o_ids: Option<Vec<String>>,
    o_seqs: Option<Vec<i64>>,
    o_created: Option<Vec<DateTime<Utc>>>,
    o_completed: Option<DateTime<Utc>>,
}

/// Reads `converger_answer_turn`'s row as the outcome of `answer`.
pub(crate) fn answer_outcome(
    answer: &TurnAnswer,
    row: AnswerRow,
) -> Result<AnswerOutcome, sqlx::Error> {
    let number = row.o_number.unwrap_or(0);
    let seqs = row.o_seqs.unwrap_or_default();
    Ok(match row.o_outcome.as_str() {
        "committed" => {
            let created = row.o_created.unwrap_or_default();
            let stored_ids = row.o_ids.unwrap_or_default();
            let activities = answer
                .frames
                .iter()
                .zip(stored_ids)
                .zip(seqs.iter().zip(created))
                .map(|((frame, id), (seq, created_at))| Activity {
                    conversation_id: answer.conversation_id,
                    seq: *seq,
                    id,
                    kind: frame.kind.clone(),
                    sender_id: answer.sender.id.clone(),
                    sender_role: answer.sender.role.as_str().to_owned(),
                    data: frame.data.clone(),
                    metadata: frame.metadata.clone(),
                    extra: stored_extra(&frame.extra),
                    client_id: None,
                    created_at,
                    turn_seq: Some(answer.seq),
                    turn_revision: Some(answer.revision),
                })
                .collect();
            AnswerOutcome::Committed {
                activities,
                completed_at: row.o_completed.unwrap_or_else(Utc::now),
            }
        }
        "duplicate" => AnswerOutcome::Duplicate {
            ids: row.o_ids.unwrap_or_default(),
            seqs,
            completed_at: row.o_completed.unwrap_or_else(Utc::now),
        },
        "conflict" => AnswerOutcome::Conflict { seqs },
        "superseded" => AnswerOutcome::Superseded {
            latest: i32::try_from(number).unwrap_or(i32::MAX),
        },
        "lease_lost" => AnswerOutcome::LeaseLost { current: number },
        "stale_runtime" => AnswerOutcome::StaleRuntime { current: number },
        "no_such_turn" => AnswerOutcome::NoSuchTurn,
        other => {
            return Err(sqlx::Error::Protocol(format!(
                "converger_answer_turn returned an unknown outcome {other:?}"
            )));
        }
    })
}

/// A new revision of a turn (edit or regenerate).
#[derive(Debug, Clone, PartialEq)]
pub struct Revision {
    /// The turn's seq.
    pub turn_seq: i64,
    /// The new revision.
    pub revision: i32,
    /// For an edit: the stored edit frame (its own seq); `None` for a regenerate.
    pub edit: Option<Activity>,
    /// True when the idempotency key matched an earlier edit (nothing new).
    pub duplicate: bool,
}

impl Store {
    /// The user turn an `edit` or `regenerate` targets: `seq` if given; else `message_id`
    /// matched against a frame id, then against the user's clientIds; else the latest turn.
    /// Only the user's own turns (revision-0 rows of the registry) qualify.
    pub async fn resolve_turn(
        &self,
        conversation_id: Uuid,
        user_id: &str,
        seq: Option<i64>,
        message_id: Option<&str>,
    ) -> Result<Option<Activity>, StoreError> {
        let columns = ACTIVITY_COLUMNS
            .split(", ")
            .map(|column| format!("a.{column}"))
            .collect::<Vec<_>>()
            .join(", ");
        let found = self
            .timed("resolve_turn", async {
                sqlx::query_as::<_, Activity>(sqlx::AssertSqlSafe(format!(
                    "SELECT {columns} FROM activities a
                     JOIN turns t ON t.conversation_id = a.conversation_id AND t.seq = a.seq AND t.revision = 0
                     WHERE a.conversation_id = $1 AND a.sender_role = 'user' AND a.sender_id = $2
                       AND ($3::bigint IS NULL OR a.seq = $3)
                       AND ($3::bigint IS NOT NULL OR $4::text IS NULL OR a.id = $4 OR a.client_id = $4)
                     ORDER BY CASE WHEN a.id = $4 THEN 0 ELSE 1 END, a.seq DESC
                     LIMIT 1"
                )))
                .bind(conversation_id)
                .bind(user_id)
                .bind(seq)
                .bind(message_id)
                .fetch_optional(&self.pool)
                .await
            })
            .await?;
        // An unknown messageId falls back to the latest turn.
        if found.is_none() && seq.is_none() && message_id.is_some() {
            return Box::pin(self.resolve_turn(conversation_id, user_id, None, None)).await;
        }
        Ok(found)
    }

    /// Opens revision + 1 of a turn. With `edit` = (type, data, clientId) the edit is stored as
    /// a new persistent frame (`replaces: <seq>`) in the same statement; without, nothing is
    /// stored but the registry row (regenerate).
    pub async fn open_revision(
        &self,
        target: &Activity,
        edit: Option<(&str, &Value, Option<&str>)>,
        regenerate_key: Option<&str>,
    ) -> Result<Revision, StoreError> {
        let Some((kind, data, client_id)) = edit else {
            return self.regenerate(target, regenerate_key).await;
        };
        if let Some(client_id) = client_id {
            let existing = self
                .timed("edit_by_client_id", async {
                    sqlx::query_as::<_, Activity>(sqlx::AssertSqlSafe(format!(
                        "SELECT {ACTIVITY_COLUMNS} FROM activities WHERE conversation_id = $1 AND sender_id = $2 AND client_id = $3"
                    )))
                    .bind(target.conversation_id)
                    .bind(&target.sender_id)
                    .bind(client_id)
                    .fetch_optional(&self.pool)
                    .await
                })
                .await?;
            if let Some(existing) = existing {
                let revision = existing.turn_revision.unwrap_or(0);
                return Ok(Revision {
                    turn_seq: target.seq,
                    revision,
                    edit: Some(existing),
                    duplicate: true,
                });
            }
        }
        let extra = json!({"replaces": target.seq});
        let sql = format!(
            "WITH revision AS (
                 SELECT max(revision) + 1 AS next FROM turns WHERE conversation_id = $1 AND seq = $2
             ), conv AS (
                 UPDATE conversations SET last_seq = last_seq + 1, updated_at = now()
                 WHERE id = $1 AND status = 'open' RETURNING id, last_seq, channel_id
             ), act AS (
                 INSERT INTO activities
                     (conversation_id, seq, id, type, sender_id, sender_role, data, extra, client_id, turn_seq, turn_revision, created_at)
                 SELECT conv.id, conv.last_seq, $3, $4, $5, 'user', $6, $7, $8, $2, revision.next, clock_timestamp() FROM conv, revision
                 RETURNING {ACTIVITY_COLUMNS}
             ), turn AS (
                 INSERT INTO turns (conversation_id, seq, revision, status, reason, source_seq)
                 SELECT conversation_id, turn_seq, turn_revision, 'pending', 'edit', seq FROM act
             ), event AS (
                 INSERT INTO outbox (conversation_id, seq_from, seq_to)
                 SELECT conversation_id, seq, seq FROM act RETURNING id, conversation_id, seq_from
             ), notified AS (
                 SELECT pg_notify('{NOTIFY_CHANNEL}',
                        json_build_object('k', 'c', 'e', event.id, 'c', event.conversation_id, 's', event.seq_from, 'h', conv.channel_id)::text)::text
                 FROM event, conv
             )
             SELECT {ACTIVITY_COLUMNS} FROM act WHERE (SELECT count(*) FROM notified) = 1"
        );
        let stored = self
            .timed("edit", async {
                sqlx::query_as::<_, Activity>(sqlx::AssertSqlSafe(sql))
                    .bind(target.conversation_id)
                    .bind(target.seq)
                    .bind(Uuid::now_v7().to_string())
                    .bind(kind)
                    .bind(&target.sender_id)
                    .bind(data)
                    .bind(extra)
                    .bind(client_id)
                    .fetch_optional(&self.pool)
                    .await
            })
            .await?
            .ok_or(StoreError::ConversationClosed)?;
        let revision = stored.turn_revision.unwrap_or(0);
        Ok(Revision {
            turn_seq: target.seq,
            revision,
            edit: Some(stored),
            duplicate: false,
        })
    }
}

impl Store {
    /// A regenerate: the registry row of revision + 1, idempotent by the client's key.
    async fn regenerate(
        &self,
        target: &Activity,
        client_id: Option<&str>,
    ) -> Result<Revision, StoreError> {
        if let Some(existing) = self
            .regenerate_by_key(target.conversation_id, client_id)
            .await?
        {
            return Ok(existing);
        }
        let inserted = self
            .timed("regenerate", async {
                sqlx::query_scalar::<_, i32>(
                    "INSERT INTO turns (conversation_id, seq, revision, status, reason, client_id)
                     SELECT $1, $2, max(revision) + 1, 'pending', 'regenerate', $3 FROM turns
                     WHERE conversation_id = $1 AND seq = $2
                     RETURNING revision",
                )
                .bind(target.conversation_id)
                .bind(target.seq)
                .bind(client_id)
                .fetch_one(&self.pool)
                .await
            })
            .await;
        match inserted {
            Ok(revision) => Ok(Revision {
                turn_seq: target.seq,
                revision,
                edit: None,
                duplicate: false,
            }),
            // A racing resend with the same key, or a racing revision of the same turn: the
            // key's row answers the first, and the second is retried once.
            Err(error) if error.is_unique_violation() => match self
                .regenerate_by_key(target.conversation_id, client_id)
                .await?
            {
                Some(existing) => Ok(existing),
                None => Box::pin(self.regenerate(target, client_id)).await,
            },
            Err(error) => Err(error),
        }
    }

    async fn regenerate_by_key(
        &self,
        conversation_id: Uuid,
        client_id: Option<&str>,
    ) -> Result<Option<Revision>, StoreError> {
        let Some(client_id) = client_id else {
            return Ok(None);
        };
        let row: Option<(i64, i32)> = self
            .timed("regenerate_by_key", async {
                sqlx::query_as(
                    "SELECT seq, revision FROM turns WHERE conversation_id = $1 AND client_id = $2",
                )
                .bind(conversation_id)
                .bind(client_id)
                .fetch_optional(&self.pool)
                .await
            })
            .await?;
        Ok(row.map(|(turn_seq, revision)| Revision {
            turn_seq,
            revision,
            edit: None,
            duplicate: true,
        }))
    }
}
