//! What a batch does, decided from what its first statements read under its locks: which
//! frames are stored at which seqs, which are duplicates, and what becomes of each answer. Pure:
//! no I/O, no clock (the batch's commit time is read with the locks and given here).
//!
//! The rules are those of one write at a time, in the batch's order, with every frame before
//! every answer:
//! - a frame whose idempotency key was stored before, or by an earlier write of the batch, is
//!   that frame again (`duplicate`); a frame of a missing or closed conversation is not stored;
//! - an answer goes down the ladder no such turn, superseded, duplicate (same fingerprint),
//!   closed, stopped, lease lost (an old fence), conflict (another answer), stale runtime, and
//!   otherwise commits; a later answer of the batch sees what an earlier one did to its turn and
//!   its conversation's runtime.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use crate::activities::{Activity, CommitOutcome, NewActivity, stored_id};
use crate::bus::{BusEvent, CommittedRuntime};
use crate::turns::{AnswerOutcome, TurnAnswer};

/// One write of a batch, as the decision reads it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Request<'a> {
    /// A frame (a user's turn when the end user wrote it).
    Frame(&'a NewActivity),
    /// An answer to a turn, with its fingerprint.
    Answer {
        answer: &'a TurnAnswer,
        fingerprint: &'a str,
    },
}

impl Request<'_> {
    pub(super) fn conversation_id(&self) -> Uuid {
        match self {
            Request::Frame(new) => new.conversation_id,
            Request::Answer { answer, .. } => answer.conversation_id,
        }
    }
}

/// A conversation's head, as the batch locked it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Head {
    pub(super) last_seq: i64,
    pub(super) open: bool,
    pub(super) channel_id: Uuid,
    /// The conversation's runtime version (0 without one), read under the lock.
    pub(super) runtime_version: i64,
}

/// The latest revision of a turn an answer names, as the batch locked it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct LatestTurn {
    pub(super) revision: i32,
    pub(super) status: String,
    pub(super) fingerprint: Option<String>,
    pub(super) result_ids: Vec<String>,
    pub(super) result_seqs: Vec<i64>,
    pub(super) completed_at: Option<DateTime<Utc>>,
    pub(super) fence: i64,
}

/// An idempotency key: (conversation, sender, clientId).
pub(super) type IdempotencyKey = (Uuid, String, String);

/// What the batch's reads found under its locks.
#[derive(Debug, Clone)]
pub(super) struct Found {
    /// The heads of the batch's conversations that exist.
    pub(super) heads: HashMap<Uuid, Head>,
    /// The frames stored before under the batch's keys.
    pub(super) keys: HashMap<IdempotencyKey, Activity>,
    /// The latest revision of each turn the batch's answers name, when the turn exists.
    pub(super) turns: HashMap<(Uuid, i64), LatestTurn>,
    /// The runtime version of each conversation an answer writes a runtime to (absent: 0).
    pub(super) runtimes: HashMap<Uuid, i64>,
    /// The batch's commit time, read once its locks were held.
    pub(super) now: DateTime<Utc>,
}

/// The outcome of one write.
#[derive(Debug, Clone, PartialEq)]
#[expect(
    clippy::large_enum_variant,
    reason = "outcomes only pass from the decision to their writers; boxing would cost an allocation per write"
)]
pub(super) enum Decided {
    /// A frame: stored now or before, or `None` for a missing or closed conversation.
    Frame(Option<CommitOutcome>),
    /// An answer.
    Answer(AnswerOutcome),
}

/// A turn an answer completes: its result is the frames at `first ..= first + count - 1`
/// (1-based) of [`Plan::frames`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SettledTurn {
    pub(super) conversation_id: Uuid,
    pub(super) seq: i64,
    pub(super) revision: i32,
    pub(super) fingerprint: String,
    pub(super) first: i32,
    pub(super) count: i32,
}

/// A conversation's runtime as the batch leaves it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct RuntimeRow {
    pub(super) conversation_id: Uuid,
    pub(super) version: i64,
    pub(super) state: Value,
}

/// Everything the batch writes, and each write's outcome.
#[derive(Debug, Clone, Default)]
pub(super) struct Plan {
    /// One per write, in the batch's order.
    pub(super) outcomes: Vec<Decided>,
    /// The new frames; one conversation's in seq order, an answer's together.
    pub(super) frames: Vec<Activity>,
    /// Indexes in `frames` of the frames that open a turn.
    pub(super) new_turns: Vec<usize>,
    /// The turns answered now.
    pub(super) settled: Vec<SettledTurn>,
    /// The runtimes written, one per conversation.
    pub(super) runtimes: Vec<RuntimeRow>,
    /// What the batch announces: one `Committed` event per conversation with new frames, in
    /// conversation order, its channel named and its frames attached.
    pub(super) events: Vec<BusEvent>,
}

impl Plan {
    /// True when the batch stores nothing (every write a duplicate or refused).
    pub(super) fn writes_nothing(&self) -> bool {
        self.frames.is_empty() && self.settled.is_empty() && self.runtimes.is_empty()
    }

    /// The heads that moved: (conversation, new last seq, the runtime version it commits
    /// with), in conversation order. A head moves exactly when its conversation got new frames,
    /// so the events name them all.
    pub(super) fn moved_heads(&self) -> Vec<(Uuid, i64, Option<i64>)> {
        self.events
            .iter()
            .filter_map(|event| match event {
                BusEvent::Committed {
                    conversation_id,
                    seq,
                    runtime,
                    ..
                } => Some((
                    *conversation_id,
                    *seq,
                    runtime.as_ref().map(|runtime| runtime.version),
                )),
                _ => None,
            })
            .collect()
    }

    /// The runtimes written in conversations whose head did not move (an answer without
    /// frames): their rows still take the new version (ADR 0039).
    pub(super) fn runtimes_without_frames(&self) -> impl Iterator<Item = &RuntimeRow> {
        self.runtimes.iter().filter(|row| {
            !self.events.iter().any(|event| {
                matches!(event, BusEvent::Committed { conversation_id, .. }
                    if *conversation_id == row.conversation_id)
            })
        })
    }
}

/// Decides `requests` against what `found` holds.
pub(super) fn decide(requests: &[Request<'_>], found: Found) -> Plan {
    let mut batch = Batch {
        heads: found
            .heads
            .iter()
            .map(|(id, head)| (*id, head.last_seq))
            .collect(),
        turns: found.turns,
        runtimes: found.runtimes,
        written_runtimes: BTreeMap::new(),
        now: found.now,
        plan: Plan::default(),
    };
    let mut outcomes: Vec<Option<Decided>> = vec![None; requests.len()];
    let mut first_of_key: HashMap<IdempotencyKey, usize> = HashMap::new();
    for (index, request) in requests.iter().enumerate() {
        let Request::Frame(new) = request else {
            continue;
        };
        let key = new.client_id.as_ref().map(|client_id| {
            (
                new.conversation_id,
                new.sender.id.clone(),
                client_id.clone(),
            )
        });
        if let Some(key) = key {
            if let Some(stored) = found.keys.get(&key) {
                outcomes[index] = Some(Decided::Frame(Some(duplicate_of(stored))));
                continue;
            }
            if let Some(&first) = first_of_key.get(&key) {
                let earlier = match &outcomes[first] {
                    Some(Decided::Frame(Some(outcome))) => Some(duplicate_of(&outcome.activity)),
                    _ => None,
                };
                outcomes[index] = Some(Decided::Frame(earlier));
                continue;
            }
            first_of_key.insert(key, index);
        }
        let open = found
            .heads
            .get(&new.conversation_id)
            .is_some_and(|head| head.open);
        outcomes[index] = Some(Decided::Frame(open.then(|| batch.store_frame(new))));
    }
    for (index, request) in requests.iter().enumerate() {
        if let Request::Answer {
            answer,
            fingerprint,
        } = request
        {
            outcomes[index] = Some(Decided::Answer(batch.answer(answer, fingerprint)));
        }
    }
    let Batch {
        written_runtimes,
        mut plan,
        ..
    } = batch;
    plan.outcomes = outcomes
        .into_iter()
        .map(|outcome| outcome.unwrap_or(Decided::Frame(None)))
        .collect();
    plan.runtimes = written_runtimes
        .into_iter()
        .map(|(conversation_id, (version, state))| RuntimeRow {
            conversation_id,
            version,
            state,
        })
        .collect();
    plan.events = events(&plan.frames, &found.heads, &plan.runtimes);
    plan
}

/// The state a batch's decisions change as they go.
struct Batch {
    /// Each conversation's last seq so far.
    heads: HashMap<Uuid, i64>,
    turns: HashMap<(Uuid, i64), LatestTurn>,
    /// Each conversation's runtime version so far.
    runtimes: HashMap<Uuid, i64>,
    /// The runtimes written so far: (version, state) per conversation.
    written_runtimes: BTreeMap<Uuid, (i64, Value)>,
    now: DateTime<Utc>,
    plan: Plan,
}

impl Batch {
    /// The next seq of `conversation_id`, whose head the caller checked.
    fn next_seq(&mut self, conversation_id: Uuid) -> i64 {
        let last = self.heads.entry(conversation_id).or_default();
        *last += 1;
        *last
    }

    fn store_frame(&mut self, new: &NewActivity) -> CommitOutcome {
        let activity = Activity {
            conversation_id: new.conversation_id,
            seq: self.next_seq(new.conversation_id),
            id: new.stored_id(),
            kind: new.kind.clone(),
            sender_id: new.sender.id.clone(),
            sender_role: new.sender.role.as_str().to_owned(),
            data: new.data.clone(),
            metadata: new.metadata.clone(),
            extra: new.stored_extra(),
            client_id: new.client_id.clone(),
            created_at: self.now,
            turn_seq: None,
            turn_revision: None,
        };
        if new.is_turn() {
            self.plan.new_turns.push(self.plan.frames.len());
        }
        self.plan.frames.push(activity.clone());
        CommitOutcome {
            activity,
            duplicate: false,
        }
    }

    fn answer(&mut self, answer: &TurnAnswer, fingerprint: &str) -> AnswerOutcome {
        let conversation_id = answer.conversation_id;
        let Some(latest) = self.turns.get(&(conversation_id, answer.seq)).cloned() else {
            return AnswerOutcome::NoSuchTurn;
        };
        if answer.revision > latest.revision || !self.heads.contains_key(&conversation_id) {
            return AnswerOutcome::NoSuchTurn;
        }
        if answer.revision < latest.revision {
            return AnswerOutcome::Superseded {
                latest: latest.revision,
            };
        }
        let completed = latest.status == "completed";
        if completed && latest.fingerprint.as_deref() == Some(fingerprint) {
            return AnswerOutcome::Duplicate {
                ids: latest.result_ids.clone(),
                seqs: latest.result_seqs.clone(),
                completed_at: latest.completed_at.unwrap_or(self.now),
            };
        }
        // A turn of a conversation closed while it waited is settled as closed.
        if latest.status == "closed" {
            return AnswerOutcome::Closed;
        }
        // A turn the gateway settled after a stop.
        if latest.status == "stopped" {
            return AnswerOutcome::Stopped;
        }
        // Lease mode: a delivery older than the latest claim no longer holds the turn.
        if let Some(fence) = answer.fence
            && fence != latest.fence
        {
            return AnswerOutcome::LeaseLost {
                current: latest.fence,
            };
        }
        if completed {
            return AnswerOutcome::Conflict {
                seqs: latest.result_seqs.clone(),
            };
        }
        let current = self.runtimes.get(&conversation_id).copied().unwrap_or(0);
        if let Some(runtime) = &answer.runtime {
            if runtime.version != current {
                return AnswerOutcome::StaleRuntime { current };
            }
            self.runtimes.insert(conversation_id, current + 1);
            self.written_runtimes
                .insert(conversation_id, (current + 1, runtime.state.clone()));
        }
        let first = self.plan.frames.len();
        for frame in &answer.frames {
            let seq = self.next_seq(conversation_id);
            let activity = answer.stored_frame(frame, stored_id(frame.id.as_ref()), seq, self.now);
            self.plan.frames.push(activity);
        }
        let activities = self.plan.frames[first..].to_vec();
        let settled = LatestTurn {
            revision: answer.revision,
            status: "completed".into(),
            fingerprint: Some(fingerprint.to_owned()),
            result_ids: activities.iter().map(|frame| frame.id.clone()).collect(),
            result_seqs: activities.iter().map(|frame| frame.seq).collect(),
            completed_at: Some(self.now),
            fence: latest.fence,
        };
        self.turns.insert((conversation_id, answer.seq), settled);
        // Positions in SQL arrays: 1-based, and an answer holds far fewer than 2^31 frames.
        self.plan.settled.push(SettledTurn {
            conversation_id,
            seq: answer.seq,
            revision: answer.revision,
            fingerprint: fingerprint.to_owned(),
            first: i32::try_from(first + 1).unwrap_or(i32::MAX),
            count: i32::try_from(activities.len()).unwrap_or(i32::MAX),
        });
        AnswerOutcome::Committed {
            activities,
            completed_at: self.now,
        }
    }
}

fn duplicate_of(stored: &Activity) -> CommitOutcome {
    CommitOutcome {
        activity: stored.clone(),
        duplicate: true,
    }
}

/// One `Committed` event per conversation with new frames, in conversation order. A
/// conversation's frames are allocated in seq order, so they stay in it. Each names the
/// runtime version its conversation commits with, and carries the runtime's state when the
/// batch writes it (ADR 0039).
fn events(
    frames: &[Activity],
    heads: &HashMap<Uuid, Head>,
    written: &[RuntimeRow],
) -> Vec<BusEvent> {
    let mut by_conversation: BTreeMap<Uuid, Vec<Activity>> = BTreeMap::new();
    for frame in frames {
        by_conversation
            .entry(frame.conversation_id)
            .or_default()
            .push(frame.clone());
    }
    by_conversation
        .into_iter()
        .filter_map(|(conversation_id, frames)| {
            let first_seq = frames.first()?.seq;
            let seq = frames.last()?.seq;
            let head = heads.get(&conversation_id);
            let runtime = match written
                .iter()
                .find(|row| row.conversation_id == conversation_id)
            {
                Some(row) => CommittedRuntime::written(row.version, &row.state),
                None => CommittedRuntime {
                    version: head.map_or(0, |head| head.runtime_version),
                    state: None,
                },
            };
            Some(BusEvent::Committed {
                conversation_id,
                first_seq,
                seq,
                channel_id: head.map(|head| head.channel_id),
                frames,
                runtime: Some(runtime),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activities::{Sender, SenderRole};
    use crate::turns::{AnswerFrame, RuntimeWrite};
    use serde_json::{Map, json};

    fn at() -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 123_456_000).expect("a valid time")
    }

    fn conversation(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    fn frame(conversation_id: Uuid, client_id: Option<&str>) -> NewActivity {
        NewActivity {
            conversation_id,
            id: None,
            kind: "text".into(),
            sender: Sender {
                id: "alice".into(),
                role: SenderRole::User,
            },
            data: json!({"text": "hi"}),
            metadata: None,
            extra: None,
            client_id: client_id.map(str::to_owned),
        }
    }

    fn answer(conversation_id: Uuid, seq: i64, frames: usize) -> TurnAnswer {
        TurnAnswer {
            conversation_id,
            seq,
            revision: 0,
            sender: Sender {
                id: "bot".into(),
                role: SenderRole::Agent,
            },
            frames: (0..frames)
                .map(|n| AnswerFrame {
                    id: Some(format!("f{n}")),
                    kind: "text".into(),
                    data: json!({"text": n}),
                    metadata: None,
                    extra: Map::new(),
                })
                .collect(),
            runtime: None,
            fence: None,
        }
    }

    fn pending(revision: i32) -> LatestTurn {
        LatestTurn {
            revision,
            status: "pending".into(),
            fingerprint: None,
            result_ids: Vec::new(),
            result_seqs: Vec::new(),
            completed_at: None,
            fence: 0,
        }
    }

    fn found(heads: &[(Uuid, i64, bool)]) -> Found {
        Found {
            heads: heads
                .iter()
                .map(|(id, last_seq, open)| {
                    (
                        *id,
                        Head {
                            last_seq: *last_seq,
                            open: *open,
                            channel_id: conversation(99),
                            runtime_version: 0,
                        },
                    )
                })
                .collect(),
            keys: HashMap::new(),
            turns: HashMap::new(),
            runtimes: HashMap::new(),
            now: at(),
        }
    }

    fn frame_seq(decided: &Decided) -> Option<(i64, bool)> {
        match decided {
            Decided::Frame(Some(outcome)) => Some((outcome.activity.seq, outcome.duplicate)),
            _ => None,
        }
    }

    #[test]
    fn frames_take_the_next_seqs_of_open_conversations_only() {
        let (a, b, closed, missing) = (
            conversation(1),
            conversation(2),
            conversation(3),
            conversation(4),
        );
        let writes = [
            frame(a, Some("k1")),
            frame(b, None),
            frame(a, None),
            frame(closed, Some("k2")),
            frame(missing, None),
        ];
        let requests: Vec<Request<'_>> = writes.iter().map(Request::Frame).collect();
        let plan = decide(
            &requests,
            found(&[(a, 4, true), (b, 0, true), (closed, 7, false)]),
        );
        let seqs: Vec<_> = plan.outcomes.iter().map(frame_seq).collect();
        assert_eq!(
            seqs,
            vec![
                Some((5, false)),
                Some((1, false)),
                Some((6, false)),
                None,
                None
            ]
        );
        assert_eq!(plan.moved_heads(), vec![(a, 6, Some(0)), (b, 1, Some(0))]);
        assert_eq!(plan.new_turns, vec![0, 1, 2]);
        assert!(plan.frames.iter().all(|frame| frame.created_at == at()));
        // One event per conversation, its range and its channel named.
        let ranges: Vec<_> = plan
            .events
            .iter()
            .map(|event| match event {
                BusEvent::Committed {
                    conversation_id,
                    first_seq,
                    seq,
                    channel_id,
                    frames,
                    ..
                } => (
                    *conversation_id,
                    *first_seq,
                    *seq,
                    channel_id.is_some(),
                    frames.len(),
                ),
                other => panic!("not a commit: {other:?}"),
            })
            .collect();
        assert_eq!(ranges, vec![(a, 5, 6, true, 2), (b, 1, 1, true, 1)]);
    }

    #[test]
    fn a_repeated_key_is_the_first_frame_again_within_the_batch_and_after_it() {
        let a = conversation(1);
        let writes = [
            frame(a, Some("new")),
            frame(a, Some("old")),
            frame(a, Some("new")),
        ];
        let requests: Vec<Request<'_>> = writes.iter().map(Request::Frame).collect();
        let mut found = found(&[(a, 3, false)]);
        let old = Activity {
            conversation_id: a,
            seq: 2,
            id: "stored".into(),
            kind: "text".into(),
            sender_id: "alice".into(),
            sender_role: "user".into(),
            data: json!({}),
            metadata: None,
            extra: None,
            client_id: Some("old".into()),
            created_at: at(),
            turn_seq: None,
            turn_revision: None,
        };
        found
            .keys
            .insert((a, "alice".into(), "old".into()), old.clone());
        // Closed since: a stored key is still its frame; a new one is refused, twice.
        let plan = decide(&requests, found.clone());
        assert_eq!(plan.outcomes[0], Decided::Frame(None));
        assert_eq!(plan.outcomes[1], Decided::Frame(Some(duplicate_of(&old))));
        assert_eq!(plan.outcomes[2], Decided::Frame(None));
        assert!(plan.writes_nothing());
        // Open: the repeat within the batch is the first one's frame.
        found.heads.get_mut(&a).expect("head").open = true;
        let plan = decide(&requests, found);
        let seqs: Vec<_> = plan.outcomes.iter().map(frame_seq).collect();
        assert_eq!(
            seqs,
            vec![Some((4, false)), Some((2, true)), Some((4, true))]
        );
        assert_eq!(plan.frames.len(), 1);
    }

    #[test]
    fn answers_follow_the_batchs_frames_and_settle_their_turns() {
        let a = conversation(1);
        let user = frame(a, Some("k"));
        let reply = answer(a, 2, 2);
        let requests = [
            Request::Answer {
                answer: &reply,
                fingerprint: "fp",
            },
            Request::Frame(&user),
        ];
        let mut found = found(&[(a, 2, true)]);
        found.turns.insert((a, 2), pending(0));
        let plan = decide(&requests, found);
        assert_eq!(frame_seq(&plan.outcomes[1]), Some((3, false)));
        let Decided::Answer(AnswerOutcome::Committed { activities, .. }) = &plan.outcomes[0] else {
            panic!("committed: {:?}", plan.outcomes[0]);
        };
        assert_eq!(
            activities.iter().map(|a| a.seq).collect::<Vec<_>>(),
            vec![4, 5]
        );
        assert!(
            activities
                .iter()
                .all(|a| a.turn_seq == Some(2) && a.client_id.is_none())
        );
        assert_eq!(
            plan.settled,
            vec![SettledTurn {
                conversation_id: a,
                seq: 2,
                revision: 0,
                fingerprint: "fp".into(),
                first: 2,
                count: 2,
            }]
        );
        assert_eq!(plan.moved_heads(), vec![(a, 5, Some(0))]);
        assert_eq!(plan.new_turns, vec![0]);
    }

    #[test]
    fn a_second_answer_to_a_turn_sees_the_first() {
        let a = conversation(1);
        let reply = answer(a, 1, 1);
        let other = answer(a, 1, 2);
        let requests = [
            Request::Answer {
                answer: &reply,
                fingerprint: "one",
            },
            Request::Answer {
                answer: &reply,
                fingerprint: "one",
            },
            Request::Answer {
                answer: &other,
                fingerprint: "two",
            },
        ];
        let mut found = found(&[(a, 1, true)]);
        found.turns.insert((a, 1), pending(0));
        let plan = decide(&requests, found);
        assert!(matches!(
            plan.outcomes[0],
            Decided::Answer(AnswerOutcome::Committed { .. })
        ));
        assert_eq!(
            plan.outcomes[1],
            Decided::Answer(AnswerOutcome::Duplicate {
                ids: vec!["f0".into()],
                seqs: vec![2],
                completed_at: at(),
            })
        );
        assert_eq!(
            plan.outcomes[2],
            Decided::Answer(AnswerOutcome::Conflict { seqs: vec![2] })
        );
        assert_eq!(plan.settled.len(), 1);
        assert_eq!(plan.moved_heads(), vec![(a, 2, Some(0))]);
    }

    #[test]
    fn the_answer_ladder_in_its_order() {
        let a = conversation(1);
        let with =
            |status: &str, revision: i32, fence: i64, fingerprint: Option<&str>| LatestTurn {
                revision,
                status: status.into(),
                fingerprint: fingerprint.map(str::to_owned),
                result_ids: vec!["x".into()],
                result_seqs: vec![9],
                completed_at: Some(at()),
                fence,
            };
        let mut fenced = answer(a, 1, 1);
        fenced.fence = Some(3);
        let cases = [
            (None, AnswerOutcome::NoSuchTurn),
            (
                Some(with("pending", 1, 0, None)),
                AnswerOutcome::Superseded { latest: 1 },
            ),
            (
                Some(with("completed", 0, 5, Some("fp"))),
                AnswerOutcome::Duplicate {
                    ids: vec!["x".into()],
                    seqs: vec![9],
                    completed_at: at(),
                },
            ),
            (Some(with("closed", 0, 5, None)), AnswerOutcome::Closed),
            (Some(with("stopped", 0, 5, None)), AnswerOutcome::Stopped),
            (
                Some(with("pending", 0, 5, None)),
                AnswerOutcome::LeaseLost { current: 5 },
            ),
            (
                Some(with("completed", 0, 3, Some("other"))),
                AnswerOutcome::Conflict { seqs: vec![9] },
            ),
        ];
        for (latest, expected) in cases {
            let mut found = found(&[(a, 1, true)]);
            if let Some(latest) = latest {
                found.turns.insert((a, 1), latest);
            }
            let requests = [Request::Answer {
                answer: &fenced,
                fingerprint: "fp",
            }];
            let plan = decide(&requests, found);
            assert_eq!(plan.outcomes, vec![Decided::Answer(expected)]);
            assert!(plan.writes_nothing());
        }
        // A revision beyond the latest is no such turn.
        let mut ahead = answer(a, 1, 1);
        ahead.revision = 2;
        let mut found = found(&[(a, 1, true)]);
        found.turns.insert((a, 1), pending(1));
        let requests = [Request::Answer {
            answer: &ahead,
            fingerprint: "fp",
        }];
        let plan = decide(&requests, found);
        assert_eq!(
            plan.outcomes,
            vec![Decided::Answer(AnswerOutcome::NoSuchTurn)]
        );
    }

    #[test]
    fn runtimes_move_one_version_per_answer_and_are_written_once() {
        let (a, b) = (conversation(1), conversation(2));
        let mut first = answer(a, 1, 0);
        first.runtime = Some(RuntimeWrite {
            version: 4,
            state: json!({"step": 1}),
        });
        let mut second = answer(a, 3, 1);
        second.runtime = Some(RuntimeWrite {
            version: 5,
            state: json!({"step": 2}),
        });
        let mut stale = answer(b, 1, 1);
        stale.runtime = Some(RuntimeWrite {
            version: 1,
            state: json!({}),
        });
        let requests = [
            Request::Answer {
                answer: &first,
                fingerprint: "a1",
            },
            Request::Answer {
                answer: &second,
                fingerprint: "a3",
            },
            Request::Answer {
                answer: &stale,
                fingerprint: "b1",
            },
        ];
        let mut found = found(&[(a, 3, true), (b, 1, true)]);
        found.turns.insert((a, 1), pending(0));
        found.turns.insert((a, 3), pending(0));
        found.turns.insert((b, 1), pending(0));
        found.runtimes.insert(a, 4);
        let plan = decide(&requests, found);
        // An answer without frames settles its turn with an empty result.
        assert!(matches!(
            &plan.outcomes[0],
            Decided::Answer(AnswerOutcome::Committed { activities, .. }) if activities.is_empty()
        ));
        assert!(matches!(
            plan.outcomes[1],
            Decided::Answer(AnswerOutcome::Committed { .. })
        ));
        assert_eq!(
            plan.outcomes[2],
            Decided::Answer(AnswerOutcome::StaleRuntime { current: 0 })
        );
        assert_eq!(
            plan.runtimes,
            vec![RuntimeRow {
                conversation_id: a,
                version: 6,
                state: json!({"step": 2}),
            }]
        );
        assert_eq!(plan.settled[0].count, 0);
        assert_eq!(plan.moved_heads(), vec![(a, 4, Some(6))]);
    }

    #[test]
    fn each_event_names_the_runtime_its_conversation_commits_with() {
        let (a, b) = (conversation(1), conversation(2));
        let mut written = answer(a, 2, 1);
        written.runtime = Some(RuntimeWrite {
            version: 4,
            state: json!({"step": 1}),
        });
        let text = frame(b, None);
        let requests = [
            Request::Frame(&text),
            Request::Answer {
                answer: &written,
                fingerprint: "a2",
            },
        ];
        let mut found = found(&[(a, 2, true), (b, 7, true)]);
        for (id, version) in [(a, 4), (b, 3)] {
            if let Some(head) = found.heads.get_mut(&id) {
                head.runtime_version = version;
            }
        }
        found.turns.insert((a, 2), pending(0));
        found.runtimes.insert(a, 4);
        let plan = decide(&requests, found);
        let runtimes: Vec<_> = plan
            .events
            .iter()
            .map(|event| match event {
                BusEvent::Committed {
                    conversation_id,
                    runtime,
                    ..
                } => (*conversation_id, runtime.clone()),
                other => panic!("a commit event, not {other:?}"),
            })
            .collect();
        assert_eq!(
            runtimes,
            vec![
                // Written by the batch: the new version and its state.
                (
                    a,
                    Some(CommittedRuntime {
                        version: 5,
                        state: Some(json!({"step": 1})),
                    })
                ),
                // Untouched: the version read under the lock, no state.
                (
                    b,
                    Some(CommittedRuntime {
                        version: 3,
                        state: None,
                    })
                ),
            ]
        );
        // A state too large to travel stays behind; its version goes.
        let large = json!({"notes": "n".repeat(5_000)});
        assert_eq!(CommittedRuntime::written(9, &large).state, None);
        assert_eq!(CommittedRuntime::written(9, &large).version, 9);
    }
}
