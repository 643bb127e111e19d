//! What agent connections receive (docs/protocol.md §4): envelopes, and user turns delivered
//! with their `meta`.

use serde::Serialize;
use serde_json::Value;

use crate::persistent::{Participant, RenderedFrame};

/// The turn key of docs/protocol.md §5: `conversation:seq:revision`, stable across deliveries.
pub fn turn_key(conversation_id: &str, seq: i64, revision: i32) -> String {
    format!("{conversation_id}:{seq}:{revision}")
}

/// `{conversationId, frame}`: every conversation-level frame on a channel-scope connection.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Envelope<'a, F: Serialize> {
    /// The frame's conversation.
    pub conversation_id: &'a str,
    /// The frame itself.
    pub frame: F,
}

impl<F: Serialize> Envelope<'_, F> {
    /// The envelope as JSON text.
    pub fn encode(&self) -> String {
        crate::encode(self)
    }
}

/// `meta.turn`: which turn a delivery is, and under which fence (lease mode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TurnRef {
    /// The turn's seq.
    pub seq: i64,
    /// Its revision.
    pub revision: i32,
    /// The turn key.
    pub key: String,
    /// `edit` or `regenerate` for revisions above 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'static str>,
    /// Lease mode: the fence the answer must carry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fence: Option<i64>,
}

impl TurnRef {
    /// The reference of revision `revision` of turn `seq` of a conversation.
    pub fn new(
        conversation_id: &str,
        seq: i64,
        revision: i32,
        reason: Option<&'static str>,
    ) -> TurnRef {
        TurnRef {
            seq,
            revision,
            key: turn_key(conversation_id, seq, revision),
            reason,
            fence: None,
        }
    }
}

/// Why a turn was stopped, as `cancel.reason` and the registry's `stop_reason` say it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// An end user stopped it (`stop`, `abort`, REST).
    Stopped,
    /// A newer turn of the conversation interrupted it (`turnPolicy` `interrupt`, `rollback`).
    Superseded,
    /// Its conversation was closed.
    ConversationClosed,
    /// The last end-user connection of its conversation left (`on_disconnect = "cancel"`).
    Disconnected,
}

impl StopReason {
    /// The wire form.
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Stopped => "stopped",
            StopReason::Superseded => "superseded",
            StopReason::ConversationClosed => "conversation_closed",
            // Not `disconnected`: that is the abort reason of an agent's stream whose connection
            // ended.
            StopReason::Disconnected => "user_disconnected",
        }
    }
}

/// `cancel`: a turn the agent was delivered is stopped; its answer is taken until the grace
/// period ends, then the gateway settles the turn (docs/protocol.md §4.10).
#[derive(Debug, Clone, Serialize)]
pub struct Cancel<'a> {
    /// Always `cancel`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The turn stopped.
    pub turn: &'a TurnRef,
    /// Why.
    pub reason: &'a str,
}

impl<'a> Cancel<'a> {
    /// The `cancel` of `turn` for `reason`.
    pub fn new(turn: &'a TurnRef, reason: &'a str) -> Cancel<'a> {
        Cancel {
            kind: "cancel",
            turn,
            reason,
        }
    }
}

/// `meta.runtime`: the conversation's runtime state at delivery.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuntimeRef<'a> {
    /// The version an answer must name to replace it.
    pub version: i64,
    /// The state object.
    pub state: &'a Value,
}

/// `meta` of a delivered turn.
#[derive(Debug, Clone, Serialize)]
pub struct TurnMeta<'a> {
    /// `{id}` of the channel.
    pub channel: ChannelRef<'a>,
    /// Who wrote the turn.
    pub participant: Participant<'a>,
    /// Which turn.
    pub turn: &'a TurnRef,
    /// The runtime at delivery.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeRef<'a>>,
    /// The end user's `meta` for this turn (the send's over its connection's hello's), kept
    /// with the frame and shown to agents only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client: Option<&'a Value>,
}

/// `{id}` of a channel.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ChannelRef<'a> {
    /// Channel id.
    pub id: &'a str,
}

/// A user turn as an agent receives it: the enveloped frame with its `meta`.
pub fn delivered_turn(
    conversation_id: &str,
    frame: RenderedFrame<'_>,
    meta: &TurnMeta<'_>,
) -> String {
    Envelope {
        conversation_id,
        frame: frame.with_meta(meta),
    }
    .encode()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persistent::{PersistentFrame, Viewer};
    use serde_json::json;

    #[test]
    fn a_delivered_turn_carries_its_meta_once() {
        let data = json!({"text": "hi"});
        let frame = PersistentFrame {
            kind: "text",
            id: "f-1",
            seq: 4,
            sender_id: "alice",
            sender_role: "user",
            data: &data,
            metadata: None,
            extra: None,
            client_id: Some("c-1"),
            timestamp_ms: 5,
        };
        let mut turn = TurnRef::new("conv", 4, 1, Some("edit"));
        turn.fence = Some(2);
        let state = json!({"n": 1});
        let client = json!({"locale": "fr"});
        let meta = TurnMeta {
            channel: ChannelRef { id: "chan" },
            participant: Participant {
                id: "alice",
                role: "user",
            },
            turn: &turn,
            runtime: Some(RuntimeRef {
                version: 3,
                state: &state,
            }),
            client: Some(&client),
        };
        let text = delivered_turn("conv", frame.view(Viewer::Agent), &meta);
        let value: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["conversationId"], "conv");
        assert_eq!(value["frame"]["seq"], 4);
        assert!(value["frame"].get("clientId").is_none());
        assert_eq!(
            value["frame"]["meta"],
            json!({"channel": {"id": "chan"}, "participant": {"id": "alice", "role": "user"},
                   "turn": {"seq": 4, "revision": 1, "key": "conv:4:1", "reason": "edit", "fence": 2},
                   "runtime": {"version": 3, "state": {"n": 1}}, "client": {"locale": "fr"}})
        );
    }
}
