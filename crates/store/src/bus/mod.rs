//! The cross-node event bus: `pg_notify` on commit, one `LISTEN` per node, and a catch-up from
//! the outbox whenever the listening connection was lost (notifications sent during the gap are
//! gone, so the outbox is read back over the gap plus a safety margin). Receivers de-duplicate by
//! (conversation, seq) and read gaps from `activities`, so a repeated or lost notification never
//! breaks delivery.
//!
//! - `mod.rs`: the payloads and the events receivers see;
//! - `publish.rs`: what a node sends (one notification, or a reference to an outbox row);
//! - `listener.rs`: the node's `LISTEN`, its recovery and the outbox catch-up.

mod listener;
mod publish;

pub use publish::encode_streams;

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use crate::Activity;

/// Largest payload sent inline by `pg_notify` (Postgres refuses 8,000 bytes and more); larger
/// transient frames travel through the outbox.
const INLINE_PAYLOAD_LIMIT: usize = 7_000;

/// Re-read this much extra outbox history after a lost connection, for commits that were in
/// flight when the connection dropped.
const CATCH_UP_MARGIN: Duration = Duration::from_secs(5);

/// Who a transient frame came from, so receivers can skip its author.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// Participant id.
    pub id: String,
    /// Participant role.
    pub role: String,
    /// The connection it came from.
    pub connection: String,
}

/// A frame that is not stored, as it travels between nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransientFrame {
    /// Node that published it (it dispatched locally already).
    #[serde(rename = "n")]
    pub node: String,
    /// The conversation's channel, so that other nodes' agents receive it too.
    #[serde(rename = "h", default, skip_serializing_if = "Option::is_none")]
    pub channel_id: Option<Uuid>,
    /// Conversation.
    #[serde(rename = "c")]
    pub conversation_id: Uuid,
    /// The frame.
    #[serde(rename = "f")]
    pub frame: Value,
    /// Its author, when it has one.
    #[serde(rename = "o", default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Origin>,
    /// For the channel's agents only (a forwarded client frame), not for end users.
    #[serde(rename = "a", default, skip_serializing_if = "std::ops::Not::not")]
    pub agents_only: bool,
}

/// An order to close every matching socket on every node (`POST /api/v1/admin/disconnect`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisconnectOrder {
    /// The request, under which each node reports what it closed.
    #[serde(rename = "r")]
    pub request_id: Uuid,
    /// The tenant whose sockets are closed.
    #[serde(rename = "t")]
    pub tenant_id: Uuid,
    /// Only end users' sockets of this user.
    #[serde(rename = "u", default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<String>,
    /// Only end users' sockets of this conversation.
    #[serde(rename = "c", default, skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<Uuid>,
    /// Only sockets of this channel (end users' and agents').
    #[serde(rename = "h", default, skip_serializing_if = "Option::is_none")]
    pub channel_id: Option<Uuid>,
    /// Why, as the closed sockets are told.
    #[serde(rename = "w")]
    pub reason: String,
    /// When it was given (ms since the epoch): a session opened later is not closed by it,
    /// when a node carries it out late (from the catch-up after a lost listener).
    #[serde(rename = "at")]
    pub issued_ms: i64,
}

/// A turn was stopped (ADR 0028): its owners are told (`cancel`), its open streams end, and the
/// node that stopped it settles it after the grace period.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnStop {
    /// Node that published it (it dispatched locally already).
    #[serde(rename = "n")]
    pub node: String,
    /// The conversation's channel.
    #[serde(rename = "h")]
    pub channel_id: Uuid,
    /// Conversation.
    #[serde(rename = "c")]
    pub conversation_id: Uuid,
    /// The turn's seq.
    #[serde(rename = "s")]
    pub seq: i64,
    /// The revision stopped.
    #[serde(rename = "r")]
    pub revision: i32,
    /// The turn frame's commit time (ms since the epoch): its owners are decided at it.
    #[serde(rename = "at")]
    pub at_ms: i64,
    /// When the revision was opened (ms since the epoch): a regenerated revision went to the
    /// owners then. Absent from a node of an earlier release, and from the sweep's stops.
    #[serde(rename = "ra", default, skip_serializing_if = "Option::is_none")]
    pub revision_at_ms: Option<i64>,
    /// `stopped`, `superseded` or `conversation_closed`.
    #[serde(rename = "w")]
    pub reason: String,
}

/// Largest runtime state (serialized) a commit event carries; a larger one is read by the
/// nodes that deliver the conversation's next turn.
const RUNTIME_CARRIED_BYTES: usize = 4_096;

/// A conversation's runtime as a commit left it (ADR 0039): the version it committed with,
/// read under the conversation's lock, and the state when the commit wrote it (and it is
/// small enough to travel).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommittedRuntime {
    /// The runtime version (0: none written yet).
    #[serde(rename = "v")]
    pub version: i64,
    /// The state at `version`, when the commit wrote it.
    #[serde(rename = "s", default, skip_serializing_if = "Option::is_none")]
    pub state: Option<Value>,
}

impl CommittedRuntime {
    /// The runtime a commit wrote: its state travels when it is small enough.
    pub(crate) fn written(version: i64, state: &Value) -> CommittedRuntime {
        let state = (serialized_len(state) <= RUNTIME_CARRIED_BYTES).then(|| state.clone());
        CommittedRuntime { version, state }
    }
}

/// The length of `value` serialized as JSON, counted without keeping the text.
pub fn serialized_len(value: &Value) -> usize {
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    // Writing a JSON value into a counter cannot fail; were it to, the size would read as
    // unbounded and the state would not be kept.
    match serde_json::to_writer(&mut counter, value) {
        Ok(()) => counter.0,
        Err(_) => usize::MAX,
    }
}

/// One event on the bus, as receivers see it.
#[derive(Debug, Clone, PartialEq)]
pub enum BusEvent {
    /// Stream events (chunks, ends) of streamed answers, opaque to the store, from one node.
    Streams {
        /// Node that published them (it dispatched locally already).
        node: String,
        /// The events, in order.
        events: Vec<Value>,
    },
    /// `seq` of a conversation was committed.
    Committed {
        /// Conversation.
        conversation_id: Uuid,
        /// The first seq the event announces (`seq` when it announces one, or for catch-ups,
        /// whose receivers find gaps themselves).
        first_seq: i64,
        /// The committed seq (the last of a batch).
        seq: i64,
        /// The conversation's channel, when the event names it (catch-ups do not).
        channel_id: Option<Uuid>,
        /// The committed frames, in seq order, when the notification carried them (small
        /// enough); empty otherwise, and receivers read them.
        frames: Vec<Activity>,
        /// The conversation's runtime as the commit left it, when the event says (catch-ups
        /// and commits made outside the group-commit batches do not).
        runtime: Option<CommittedRuntime>,
    },
    /// A transient frame (typing, receipts, presence, relayed agent frames).
    Transient(TransientFrame),
    /// A turn was opened again for a new answer (regenerate), for the channel's agents.
    Regenerated {
        /// Node that published it (it dispatched locally already).
        node: String,
        /// The conversation's channel.
        channel_id: Uuid,
        /// Conversation.
        conversation_id: Uuid,
        /// The turn's seq.
        seq: i64,
        /// The new revision.
        revision: i32,
        /// When it was opened (ms since the epoch, the registry row's `created_at`): its owners
        /// are decided at it. `None` from a node of an earlier release.
        opened_at_ms: Option<i64>,
    },
    /// A channel changed status.
    ChannelStatus {
        /// Node that published it.
        node: String,
        /// Channel.
        channel_id: Uuid,
        /// `active` or `inactive`.
        status: String,
    },
    /// Close the matching sockets and report how many.
    Disconnect(DisconnectOrder),
    /// A turn was stopped.
    TurnStopped(TurnStop),
    /// What the other nodes' agents stream in a conversation this node began to follow, as
    /// each node answered (NATS, ADR 0035): handed by the node's bus to its own door, never
    /// encoded, and ahead of the live stream events of that conversation.
    StreamHoldings {
        /// The conversation.
        conversation_id: Uuid,
        /// Each answering node's holdings, as it encoded them (opaque to the store).
        replies: Vec<String>,
    },
    /// This node stopped following the conversation's stream events (NATS, ADR 0035): its
    /// replicas of other nodes' streams there are dropped. Never encoded.
    StreamsUnfollowed {
        /// The conversation.
        conversation_id: Uuid,
    },
}

/// The JSON payloads of `pg_notify`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "k")]
enum Payload {
    /// One commit (edits still announce theirs alone).
    #[serde(rename = "c")]
    Committed(CommittedEvent),
    /// The commits of one group-commit batch, one event per conversation (ADR 0020).
    #[serde(rename = "cb")]
    CommittedBatch {
        #[serde(rename = "v")]
        events: Vec<CommittedEvent>,
    },
    #[serde(rename = "t")]
    Transient(TransientFrame),
    #[serde(rename = "rg")]
    Regenerated {
        #[serde(rename = "n")]
        node: String,
        #[serde(rename = "h")]
        channel_id: Uuid,
        #[serde(rename = "c")]
        conversation_id: Uuid,
        #[serde(rename = "s")]
        seq: i64,
        #[serde(rename = "r")]
        revision: i32,
        #[serde(rename = "ra", default, skip_serializing_if = "Option::is_none")]
        opened_at_ms: Option<i64>,
    },
    /// A transient frame too large for a notification: its payload is in the outbox row.
    #[serde(rename = "tr")]
    TransientRef {
        #[serde(rename = "e")]
        outbox_id: i64,
    },
    /// Stream events of one node, in the order it accepted them (ADR 0019).
    #[serde(rename = "st")]
    Streams {
        #[serde(rename = "n")]
        node: String,
        #[serde(rename = "e")]
        events: Vec<Value>,
    },
    #[serde(rename = "ch")]
    ChannelStatus {
        #[serde(rename = "n")]
        node: String,
        #[serde(rename = "ch")]
        channel_id: Uuid,
        #[serde(rename = "st")]
        status: String,
    },
    #[serde(rename = "dc")]
    Disconnect(DisconnectOrder),
    #[serde(rename = "ts")]
    TurnStopped(TurnStop),
}

/// One conversation's commit, alone or within a batch notification.
#[derive(Debug, Serialize, Deserialize)]
struct CommittedEvent {
    #[serde(rename = "c")]
    conversation_id: Uuid,
    /// Absent in single commits; the carried frames then tell.
    #[serde(rename = "a", default)]
    first_seq: Option<i64>,
    #[serde(rename = "s")]
    seq: i64,
    #[serde(rename = "h", default)]
    channel_id: Option<Uuid>,
    #[serde(
        rename = "f",
        default,
        deserialize_with = "frames_or_none",
        skip_serializing_if = "Vec::is_empty"
    )]
    frames: Vec<Activity>,
    #[serde(rename = "r", default, skip_serializing_if = "Option::is_none")]
    runtime: Option<CommittedRuntime>,
}

/// The frames a notification carries, or none when any of them does not read as a frame: the
/// receiver then reads them back, instead of losing the whole notification.
fn frames_or_none<'de, D>(deserializer: D) -> Result<Vec<Activity>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let raw = Vec::<Value>::deserialize(deserializer)?;
    let frames: Result<Vec<Activity>, _> = raw.into_iter().map(serde_json::from_value).collect();
    match frames {
        Ok(frames) => Ok(frames),
        Err(error) => {
            tracing::warn!(%error, "event bus: carried frames unreadable; reading them back");
            Ok(Vec::new())
        }
    }
}

/// The events of one payload: one, or one per conversation of a batch, or none (a reference to
/// a payload read elsewhere).
fn to_events(payload: Payload) -> Vec<BusEvent> {
    let event = match payload {
        Payload::CommittedBatch { events } => return events.into_iter().map(committed).collect(),
        Payload::TransientRef { .. } => return Vec::new(),
        Payload::Committed(event) => committed(event),
        Payload::Transient(transient) => BusEvent::Transient(transient),
        Payload::Regenerated {
            node,
            channel_id,
            conversation_id,
            seq,
            revision,
            opened_at_ms,
        } => BusEvent::Regenerated {
            node,
            channel_id,
            conversation_id,
            seq,
            revision,
            opened_at_ms,
        },
        Payload::ChannelStatus {
            node,
            channel_id,
            status,
        } => BusEvent::ChannelStatus {
            node,
            channel_id,
            status,
        },
        Payload::Streams { node, events } => BusEvent::Streams { node, events },
        Payload::Disconnect(order) => BusEvent::Disconnect(order),
        Payload::TurnStopped(stop) => BusEvent::TurnStopped(stop),
    };
    vec![event]
}

/// The event of one conversation's commit; its first seq is the one it names, else its first
/// carried frame's, else its last seq.
fn committed(event: CommittedEvent) -> BusEvent {
    let first_seq = event
        .first_seq
        .or_else(|| event.frames.first().map(|first| first.seq))
        .map_or(event.seq, |first| first.min(event.seq));
    BusEvent::Committed {
        conversation_id: event.conversation_id,
        first_seq,
        seq: event.seq,
        channel_id: event.channel_id,
        frames: event.frames,
        runtime: event.runtime,
    }
}

/// Largest `pg_notify` payload a committed batch sends (Postgres refuses 8,000 bytes and more).
const BATCH_PAYLOAD_LIMIT: usize = 7_500;

/// Room left in a batch payload for the outbox id the committing statement writes into it.
const OUTBOX_ID_ROOM: usize = 20;

/// How the `pg_notify` payloads of a committed batch begin: the kind, and the committing node
/// when it has one. A node's listener skips the payloads that begin with its own.
pub(crate) fn batch_payload_head(node: &str) -> String {
    if node.is_empty() {
        return r#"{"k":"cb","#.to_owned();
    }
    let node = Value::from(node);
    format!(r#"{{"k":"cb","n":{node},"#)
}

/// The `pg_notify` payloads announcing a batch's `events` (its `Committed` events, one per
/// conversation): each is `prefix`, then the batch's outbox id, then one of `rests`, so the
/// statement that writes the outbox row completes them. As few payloads as fit under the limit;
/// an event too large for any travels without its frames, which receivers then read. The events
/// are borrowed mutably only to lend their frames to the payload, not copy them; they come
/// back as they were.
pub(crate) fn batch_payloads(node: &str, events: &mut [BusEvent]) -> (String, Vec<String>) {
    let prefix = format!(r#"{}"e":"#, batch_payload_head(node));
    let room = BATCH_PAYLOAD_LIMIT.saturating_sub(prefix.len() + OUTBOX_ID_ROOM);
    let mut rests = Vec::new();
    let mut pending = String::new();
    for event in events.iter_mut() {
        let BusEvent::Committed {
            conversation_id,
            first_seq,
            seq,
            channel_id,
            frames,
            runtime,
        } = event
        else {
            continue;
        };
        let mut announced = CommittedEvent {
            conversation_id: *conversation_id,
            first_seq: Some(*first_seq),
            seq: *seq,
            channel_id: *channel_id,
            frames: std::mem::take(frames),
            runtime: runtime.take(),
        };
        let full = serde_json::to_string(&announced);
        let fits = matches!(&full, Ok(piece) if piece.len() + r#","v":[]}"#.len() <= room);
        *frames = std::mem::take(&mut announced.frames);
        let piece = if fits {
            full
        } else {
            // Too large: the frames and the runtime's state stay behind (receivers read them);
            // the runtime's version goes.
            let state = announced.runtime.as_mut().and_then(|r| r.state.take());
            let bare = serde_json::to_string(&announced);
            if let Some(runtime) = announced.runtime.as_mut() {
                runtime.state = state;
            }
            bare
        };
        *runtime = announced.runtime.take();
        // Serializing ids, numbers and JSON values cannot fail; an event that did anyway is
        // left out, and receivers read its frames at the next commit's gap.
        let Ok(piece) = piece else {
            continue;
        };
        if !pending.is_empty() && pending.len() + piece.len() + r#","v":[,]}"#.len() > room {
            rests.push(format!(r#","v":[{pending}]}}"#));
            pending.clear();
        }
        if !pending.is_empty() {
            pending.push(',');
        }
        pending.push_str(&piece);
    }
    if !pending.is_empty() {
        rests.push(format!(r#","v":[{pending}]}}"#));
    }
    (prefix, rests)
}

/// The text of `event` as it travels on a bus other than Postgres (NATS, ADR 0033); `None` for
/// stream events, which travel packed (`encode_streams`), and for what a node's bus hands only
/// to itself. Commits name their range and carry
/// their frames when they have them.
pub fn encode(event: BusEvent) -> Option<String> {
    let payload = match event {
        BusEvent::Streams { .. }
        | BusEvent::StreamHoldings { .. }
        | BusEvent::StreamsUnfollowed { .. } => return None,
        BusEvent::Committed {
            conversation_id,
            first_seq,
            seq,
            channel_id,
            frames,
            runtime,
        } => Payload::Committed(CommittedEvent {
            conversation_id,
            first_seq: Some(first_seq),
            seq,
            channel_id,
            frames,
            runtime,
        }),
        BusEvent::Transient(transient) => Payload::Transient(transient),
        BusEvent::Regenerated {
            node,
            channel_id,
            conversation_id,
            seq,
            revision,
            opened_at_ms,
        } => Payload::Regenerated {
            node,
            channel_id,
            conversation_id,
            seq,
            revision,
            opened_at_ms,
        },
        BusEvent::ChannelStatus {
            node,
            channel_id,
            status,
        } => Payload::ChannelStatus {
            node,
            channel_id,
            status,
        },
        BusEvent::Disconnect(order) => Payload::Disconnect(order),
        BusEvent::TurnStopped(stop) => Payload::TurnStopped(stop),
    };
    serde_json::to_string(&payload).ok()
}

/// The events of a text `encode` or `encode_streams` wrote; none when it does not read (it is
/// logged), or when it refers to an outbox row (only the `postgres` bus writes those).
pub fn decode(text: &[u8]) -> Vec<BusEvent> {
    match serde_json::from_slice::<Payload>(text) {
        Ok(payload) => to_events(payload),
        Err(error) => {
            tracing::warn!(%error, "event bus: unreadable message");
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip() {
        let conversation_id = Uuid::nil();
        let committed: Payload = serde_json::from_str(&format!(
            r#"{{"k":"c","e":7,"c":"{conversation_id}","s":3}}"#
        ))
        .unwrap();
        assert_eq!(
            to_events(committed).pop(),
            Some(BusEvent::Committed {
                conversation_id,
                first_seq: 3,
                seq: 3,
                channel_id: None,
                frames: Vec::new(),
                runtime: None,
            })
        );
        // As converger_committed_payload writes it, with the frame.
        let carried: Payload = serde_json::from_str(&format!(
            r#"{{"k":"c","e":8,"c":"{conversation_id}","s":4,"h":"{conversation_id}","f":[{{"id":"f4","seq":4,"data":{{"text":"hi"}},"type":"text","extra":null,"metadata":null,"turn_seq":null,"client_id":"c4","sender_id":"u","created_at":"2026-11-30T06:51:21.903868+00:00","sender_role":"user","turn_revision":null,"conversation_id":"{conversation_id}"}}]}}"#
        ))
        .unwrap();
        let Some(BusEvent::Committed { frames, .. }) = to_events(carried).pop() else {
            panic!("a committed event");
        };
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].seq, 4);
        assert_eq!(frames[0].kind, "text");
        assert_eq!(frames[0].client_id.as_deref(), Some("c4"));
        assert_eq!(frames[0].created_at.timestamp_micros() % 1_000_000, 903_868);
        // A batch announces each conversation once, with the range it committed; an event
        // without its frames (too large) is read back from `a` to `s`.
        let batch: Payload = serde_json::from_str(&format!(
            r#"{{"k":"cb","e":10,"v":[{{"c":"{conversation_id}","a":2,"s":3,"h":"{conversation_id}"}},{{"c":"{conversation_id}","a":4,"s":4}}]}}"#
        ))
        .unwrap();
        let events = to_events(batch);
        assert_eq!(events.len(), 2);
        assert!(matches!(
            &events[0],
            BusEvent::Committed { first_seq: 2, seq: 3, channel_id: Some(_), frames, .. } if frames.is_empty()
        ));
        assert!(matches!(
            &events[1],
            BusEvent::Committed {
                first_seq: 4,
                seq: 4,
                channel_id: None,
                ..
            }
        ));
        // A frame that does not read leaves the event without frames, not unreadable.
        let odd: Payload = serde_json::from_str(&format!(
            r#"{{"k":"c","e":9,"c":"{conversation_id}","s":5,"f":[{{"seq":"five"}}]}}"#
        ))
        .unwrap();
        assert!(matches!(
            to_events(odd).pop(),
            Some(BusEvent::Committed { seq: 5, ref frames, .. }) if frames.is_empty()
        ));
        let transient = TransientFrame {
            node: "n1".into(),
            channel_id: Some(conversation_id),
            conversation_id,
            frame: serde_json::json!({"type": "typing"}),
            origin: None,
            agents_only: true,
        };
        let text = serde_json::to_string(&Payload::Transient(transient.clone())).unwrap();
        assert!(text.contains(r#""k":"t""#));
        let back: Payload = serde_json::from_str(&text).unwrap();
        assert_eq!(to_events(back).pop(), Some(BusEvent::Transient(transient)));
        let regenerated = Payload::Regenerated {
            node: "n1".into(),
            channel_id: conversation_id,
            conversation_id,
            seq: 4,
            revision: 2,
            opened_at_ms: Some(3_000),
        };
        let text = serde_json::to_string(&regenerated).unwrap();
        let back: Payload = serde_json::from_str(&text).unwrap();
        assert!(matches!(
            to_events(back).pop(),
            Some(BusEvent::Regenerated {
                seq: 4,
                revision: 2,
                opened_at_ms: Some(3_000),
                ..
            })
        ));
        // A node of an earlier release sends no opening time.
        let earlier: Payload = serde_json::from_str(&text.replace(r#","ra":3000"#, "")).unwrap();
        assert!(matches!(
            to_events(earlier).pop(),
            Some(BusEvent::Regenerated {
                opened_at_ms: None,
                ..
            })
        ));
        let stop = TurnStop {
            node: "n1".into(),
            channel_id: conversation_id,
            conversation_id,
            seq: 4,
            revision: 2,
            at_ms: 1_000,
            revision_at_ms: Some(2_000),
            reason: "stopped".into(),
        };
        let text = serde_json::to_string(&Payload::TurnStopped(stop.clone())).unwrap();
        assert!(text.contains(r#""ra":2000"#));
        let back: Payload = serde_json::from_str(&text).unwrap();
        assert_eq!(
            to_events(back).pop(),
            Some(BusEvent::TurnStopped(stop.clone()))
        );
        // A node of an earlier release sends no revision time.
        let earlier: Payload = serde_json::from_str(&text.replace(r#","ra":2000"#, "")).unwrap();
        let expected = TurnStop {
            revision_at_ms: None,
            ..stop
        };
        assert_eq!(
            to_events(earlier).pop(),
            Some(BusEvent::TurnStopped(expected))
        );
    }

    fn frame(conversation_id: Uuid, seq: i64, text: &str) -> Activity {
        Activity {
            conversation_id,
            seq,
            id: format!("f{seq}"),
            kind: "text".into(),
            sender_id: "alice".into(),
            sender_role: "user".into(),
            data: serde_json::json!({ "text": text }),
            metadata: None,
            extra: None,
            client_id: None,
            created_at: chrono::DateTime::from_timestamp(1_800_000_000, 654_321_000)
                .expect("a valid time"),
            turn_seq: None,
            turn_revision: None,
        }
    }

    #[test]
    fn batch_payloads_begin_with_their_node_fit_the_limit_and_read_back_as_the_events() {
        let channel = Some(Uuid::from_u128(7));
        let events: Vec<BusEvent> = (1..=6u128)
            .map(|n| {
                let conversation_id = Uuid::from_u128(n);
                let size = if n == 6 { 9_000 } else { 2_000 };
                BusEvent::Committed {
                    conversation_id,
                    first_seq: 3,
                    seq: 4,
                    channel_id: channel,
                    frames: vec![
                        frame(conversation_id, 3, &"x".repeat(size)),
                        frame(conversation_id, 4, "y"),
                    ],
                    runtime: Some(CommittedRuntime {
                        version: n as i64,
                        state: Some(serde_json::json!({ "n": n as i64 })),
                    }),
                }
            })
            .collect();
        let mut lent = events.clone();
        let (prefix, rests) = batch_payloads("node-a", &mut lent);
        assert_eq!(lent, events, "the frames come back");
        assert!(prefix.starts_with(&batch_payload_head("node-a")));
        assert!((2..=4).contains(&rests.len()), "{} payloads", rests.len());
        let mut heard = Vec::new();
        for rest in &rests {
            let payload = format!("{prefix}{}{rest}", i64::MAX);
            assert!(payload.len() < 7_500, "{} bytes", payload.len());
            heard.extend(decode(payload.as_bytes()));
        }
        // Every event as it was, but the one too large for any payload, which goes without its
        // frames and its runtime's state (receivers read them), with its runtime's version.
        assert_eq!(heard.len(), events.len());
        for (heard, sent) in heard.iter().zip(&events) {
            let (BusEvent::Committed { frames: got, .. }, BusEvent::Committed { frames, .. }) =
                (heard, sent)
            else {
                panic!("commits");
            };
            if frames[0].data["text"].as_str().map_or(0, str::len) > 5_000 {
                assert!(got.is_empty());
                let mut bare = sent.clone();
                if let BusEvent::Committed {
                    frames, runtime, ..
                } = &mut bare
                {
                    frames.clear();
                    if let Some(runtime) = runtime {
                        runtime.state = None;
                    }
                }
                assert_eq!(*heard, bare);
            } else {
                assert_eq!(heard, sent);
            }
        }
        // Without a node, no node is named.
        let (prefix, _) = batch_payloads("", &mut lent[..1]);
        assert_eq!(prefix, r#"{"k":"cb","e":"#);
    }
}
