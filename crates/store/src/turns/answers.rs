//! An agent's answer to a turn — its frames, the conversation's runtime, the turn's completion
//! and the outbox event — commits in one transaction keyed by (conversation, seq, revision)
//! (the group commit's batch, after a `FOR UPDATE` of the turn's latest revision), so a turn
//! never gets two answers and a resend of the same answer is idempotent.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::activities::{Activity, Sender, stored_extra};
use crate::{Store, StoreError};

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
    /// True when storage can hold every part of the answer (no NUL character anywhere).
    fn is_storable(&self) -> bool {
        use converger_protocol::contains_nul;
        let frame_storable = |frame: &AnswerFrame| {
            !frame.kind.contains('\0')
                && !frame.id.as_deref().is_some_and(|id| id.contains('\0'))
                && !contains_nul(&frame.data)
                && !frame.metadata.as_ref().is_some_and(contains_nul)
                && !frame
                    .extra
                    .iter()
                    .any(|(key, value)| key.contains('\0') || contains_nul(value))
        };
        !self.sender.id.contains('\0')
            && self.frames.iter().all(frame_storable)
            && !self
                .runtime
                .as_ref()
                .is_some_and(|runtime| contains_nul(&runtime.state))
    }

    /// `frame` of this answer as stored with `id` at `seq`.
    pub(crate) fn stored_frame(
        &self,
        frame: &AnswerFrame,
        id: String,
        seq: i64,
        created_at: DateTime<Utc>,
    ) -> Activity {
        Activity {
            conversation_id: self.conversation_id,
            seq,
            id,
            kind: frame.kind.clone(),
            sender_id: self.sender.id.clone(),
            sender_role: self.sender.role.as_str().to_owned(),
            data: frame.data.clone(),
            metadata: frame.metadata.clone(),
            extra: stored_extra(&frame.extra),
            client_id: None,
            created_at,
            turn_seq: Some(self.seq),
            turn_revision: Some(self.revision),
        }
    }

    /// A stable digest of what the answer says (frames and runtime), so a resend is recognised
    /// and a different answer is a conflict.
    pub fn fingerprint(&self) -> String {
        let canonical = CanonicalAnswer {
            frames: self
                .frames
                .iter()
                .map(|frame| CanonicalFrame {
                    data: &frame.data,
                    extra: &frame.extra,
                    id: frame.id.as_deref(),
                    metadata: frame.metadata.as_ref(),
                    kind: &frame.kind,
                })
                .collect(),
            runtime: self.runtime.as_ref().map(|runtime| CanonicalRuntime {
                state: &runtime.state,
                version: runtime.version,
            }),
        };
        let mut hasher = Sha256::new();
        // Writing into a hasher cannot fail, and neither can serializing these types.
        if let Err(error) = serde_json::to_writer(&mut hasher, &canonical) {
            tracing::error!(%error, "answer fingerprint: serialization failed");
        }
        hex::encode(hasher.finalize())
    }
}

/// The digested form of an answer, borrowed from it. Stored fingerprints depend on its bytes:
/// compact JSON with every object's keys in sorted order (serde_json's maps are sorted), absent
/// values as `null`. Fields are declared in that order.
#[derive(Serialize)]
struct CanonicalAnswer<'a> {
    frames: Vec<CanonicalFrame<'a>>,
    runtime: Option<CanonicalRuntime<'a>>,
}

#[derive(Serialize)]
struct CanonicalFrame<'a> {
    data: &'a Value,
    extra: &'a Map<String, Value>,
    id: Option<&'a str>,
    metadata: Option<&'a Value>,
    #[serde(rename = "type")]
    kind: &'a str,
}

#[derive(Serialize)]
struct CanonicalRuntime<'a> {
    state: &'a Value,
    version: i64,
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
    /// The conversation was closed while the turn waited: the turn is settled as closed.
    Closed,
    /// The turn was stopped and the gateway settled it (ADR 0028).
    Stopped,
}

impl Store {
    /// Commits an answer to a turn in one transaction (see the module comment).
    /// Its statements share a transaction with other sessions' writes (see `group_commit`).
    pub async fn commit_answer(&self, answer: &TurnAnswer) -> Result<AnswerOutcome, StoreError> {
        if !answer.is_storable() {
            return Err(StoreError::unstorable());
        }
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
}

/// The runtime of a conversation that has none stored: version 0, state `{}`.
pub fn initial_runtime() -> (i64, Value) {
    (0, serde_json::json!({}))
}

/// What `converger_batch_answer` returns (migration 20261204000001), as a JSON object with the
/// OUT parameters' names: the settlement of a stopped turn commits its answer with it.
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
                .map(|((frame, id), (seq, created_at))| {
                    answer.stored_frame(frame, id, *seq, created_at)
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
        "closed" => AnswerOutcome::Closed,
        "stopped" => AnswerOutcome::Stopped,
        other => {
            return Err(sqlx::Error::Protocol(format!(
                "converger_answer_turn returned an unknown outcome {other:?}"
            )));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The fingerprint as the first version computed it (through a `Value` tree); stored
    /// fingerprints were made this way, so the borrowed form must give the same digest.
    fn fingerprint_through_values(answer: &TurnAnswer) -> String {
        let frames: Vec<Value> = answer
            .frames
            .iter()
            .map(|frame| json!({"id": frame.id, "type": frame.kind, "data": frame.data, "metadata": frame.metadata, "extra": frame.extra}))
            .collect();
        let runtime = answer
            .runtime
            .as_ref()
            .map(|runtime| json!({"version": runtime.version, "state": runtime.state}));
        let canonical = json!({"frames": frames, "runtime": runtime}).to_string();
        hex::encode(Sha256::digest(canonical.as_bytes()))
    }

    fn answer(frames: Vec<AnswerFrame>, runtime: Option<RuntimeWrite>) -> TurnAnswer {
        TurnAnswer {
            conversation_id: Uuid::nil(),
            seq: 1,
            revision: 0,
            fence: None,
            sender: crate::Sender {
                id: "agent-1".into(),
                role: crate::SenderRole::Agent,
            },
            frames,
            runtime,
        }
    }

    #[test]
    fn fingerprints_match_the_first_versions_digests() {
        let mut extra = Map::new();
        extra.insert("zeta".into(), json!([1, "two", null]));
        extra.insert("alpha".into(), json!({"b": 1, "a": "é\"\\\n\u{1}"}));
        let cases = [
            answer(Vec::new(), None),
            answer(
                vec![AnswerFrame {
                    id: None,
                    kind: "text".into(),
                    data: json!({"text": "hello"}),
                    metadata: None,
                    extra: Map::new(),
                }],
                None,
            ),
            answer(
                vec![
                    AnswerFrame {
                        id: Some("f-1".into()),
                        kind: "genui".into(),
                        data: json!({"z": [1.5, -2, 1e300], "a": {"y": true, "x": "\u{2028}"}}),
                        metadata: Some(json!({"model": "m", "tokens": 12})),
                        extra,
                    },
                    AnswerFrame {
                        id: Some("f-2".into()),
                        kind: "text".into(),
                        data: json!("plain"),
                        metadata: Some(Value::Null),
                        extra: Map::new(),
                    },
                ],
                Some(RuntimeWrite {
                    version: 7,
                    state: json!({"step": 3, "notes": ["a", "b"]}),
                }),
            ),
        ];
        for case in &cases {
            assert_eq!(case.fingerprint(), fingerprint_through_values(case));
        }
        assert_ne!(cases[0].fingerprint(), cases[1].fingerprint());
    }
}
