//! What agent connections receive (docs/protocol.md §4): envelopes, and user turns delivered
//! with their `meta`.

use serde::Serialize;

use crate::persistent::RenderedFrame;
use crate::turn_meta::{TurnMeta, TurnRef};

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
    use crate::turn_meta::{ChannelRef, Participant, RuntimeRef};
    use serde_json::Value;
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
