//! What the bench's users and agents read of the gateway's messages: the few fields they
//! measure by, deserialized in place. Every other field is skipped without being built, where
//! a `serde_json::Value` would allocate a map per object (serde_json and `Value`'s maps were
//! 16 % of the bench clients' samples; docs/benchmarks.md, sixteenth round). The client crate's
//! readers stay `Value`-based: they keep whole frames for applications.

use std::borrow::Cow;

use converger_client::outgoing::Answering;
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

/// A frame on an end user's connection: an `ack` of the user's send (with its `clientId` and
/// the stored `seq`), or a persistent frame (`seq`, and `from: "bot"` for the agent's answer).
#[derive(Debug, Deserialize)]
pub struct UserFrame<'a> {
    #[serde(rename = "type", borrow)]
    pub kind: Cow<'a, str>,
    #[serde(rename = "clientId", borrow, default)]
    pub client_id: Option<Cow<'a, str>>,
    #[serde(default)]
    pub seq: Option<i64>,
    #[serde(borrow, default)]
    pub from: Option<Cow<'a, str>>,
}

impl UserFrame<'_> {
    /// The ack of the send keyed `client_id`: the stored frame's seq (`None` for another frame).
    pub fn acked_seq(&self, client_id: &str) -> Option<Option<i64>> {
        (self.kind == "ack" && self.client_id.as_deref() == Some(client_id)).then_some(self.seq)
    }

    /// Whether this is an answer stored after `turn_seq`: a persistent frame from the agent.
    pub fn answers(&self, turn_seq: Option<i64>) -> bool {
        self.from.as_deref() == Some("bot") && self.seq > turn_seq
    }
}

/// A message on an agent's connection: unenveloped (`welcome`, whose `data.since` the bench
/// waits for), or enveloped with a conversation and a frame (a delivered turn, an ack, an error).
#[derive(Debug, Deserialize)]
pub struct AgentMessage<'a> {
    #[serde(rename = "type", borrow, default)]
    pub kind: Option<Cow<'a, str>>,
    #[serde(default)]
    pub data: Option<MessageData>,
    #[serde(rename = "conversationId", default)]
    pub conversation_id: Option<Uuid>,
    #[serde(borrow, default)]
    pub frame: Option<EnvelopedFrame<'a>>,
}

/// The fields of a `data` object the bench reads: a welcome's `since`, an error's `code`. Kept
/// as any JSON value, so a delivered frame whose own data has such a field still parses.
#[derive(Debug, Default, Deserialize)]
pub struct MessageData {
    #[serde(default)]
    pub since: Option<Value>,
    #[serde(default)]
    pub code: Option<Value>,
}

/// An enveloped frame: its type, the error data of an `error`, the `meta` of a delivered turn.
#[derive(Debug, Deserialize)]
pub struct EnvelopedFrame<'a> {
    #[serde(rename = "type", borrow)]
    pub kind: Cow<'a, str>,
    #[serde(default)]
    pub data: Option<MessageData>,
    #[serde(default)]
    pub meta: Option<DeliveryMeta>,
}

/// `meta` of a delivered turn (docs/protocol.md §4.2): which turn, and the runtime at delivery.
#[derive(Debug, Deserialize)]
pub struct DeliveryMeta {
    #[serde(default)]
    pub turn: Option<TurnMeta>,
    #[serde(default)]
    pub runtime: Option<RuntimeMeta>,
}

/// `meta.turn`.
#[derive(Debug, Deserialize)]
pub struct TurnMeta {
    pub seq: i64,
    #[serde(default)]
    pub revision: i64,
    #[serde(default)]
    pub fence: Option<i64>,
}

/// `meta.runtime`.
#[derive(Debug, Deserialize)]
pub struct RuntimeMeta {
    #[serde(default)]
    pub version: i64,
    #[serde(default)]
    pub state: Value,
}

impl AgentMessage<'_> {
    /// `data.since` of a `welcome`.
    pub fn welcome_since(&self) -> Option<i64> {
        match self.kind.as_deref() {
            Some("welcome") => self.data.as_ref()?.since.as_ref()?.as_i64(),
            _ => None,
        }
    }

    /// The code of an enveloped `error` (a refused result).
    pub fn refusal_code(&self) -> Option<&str> {
        let frame = self.frame.as_ref()?;
        match frame.kind.as_ref() {
            "error" => frame.data.as_ref()?.code.as_ref()?.as_str(),
            _ => None,
        }
    }

    /// The delivered turn an answer names, with the runtime state it was delivered with; `None`
    /// for anything that is not a delivered turn.
    pub fn delivered_turn(&self) -> Option<(Answering, Option<&Value>)> {
        let meta = self.frame.as_ref()?.meta.as_ref()?;
        let turn = meta.turn.as_ref()?;
        let answering = Answering {
            conversation_id: self.conversation_id?,
            seq: turn.seq,
            revision: turn.revision,
            fence: turn.fence,
            runtime_version: meta.runtime.as_ref().map_or(0, |runtime| runtime.version),
        };
        Some((
            answering,
            meta.runtime.as_ref().map(|runtime| &runtime.state),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CONVERSATION: &str = "0193e0a4-0000-7000-8000-000000000001";

    #[test]
    fn a_user_reads_its_ack_and_the_answer_after_it() {
        let ack = json!({"type": "ack", "clientId": "t-1", "id": "a", "seq": 7, "timestamp": 1,
            "duplicate": false})
        .to_string();
        let ack: UserFrame = serde_json::from_str(&ack).unwrap();
        assert_eq!(ack.acked_seq("t-1"), Some(Some(7)));
        assert_eq!(ack.acked_seq("t-2"), None);
        let answer = json!({"type": "text", "id": "b", "seq": 8, "from": "bot",
            "sender": {"id": "agent", "role": "bot"}, "data": {"text": "ok \"quoted\""},
            "timestamp": 2})
        .to_string();
        let answer: UserFrame = serde_json::from_str(&answer).unwrap();
        assert!(answer.answers(Some(7)));
        assert!(!answer.answers(Some(8)));
        let own = json!({"type": "text", "seq": 9, "from": "user", "clientId": "t-1"}).to_string();
        let own: UserFrame = serde_json::from_str(&own).unwrap();
        assert!(!own.answers(Some(7)));
        assert_eq!(own.acked_seq("t-1"), None);
        // An escaped string cannot be borrowed from the text; it is unescaped into a copy.
        let escaped = json!({"type": "ack", "clientId": "t-\"2\"", "seq": 3}).to_string();
        let escaped: UserFrame = serde_json::from_str(&escaped).unwrap();
        assert_eq!(escaped.acked_seq("t-\"2\""), Some(Some(3)));
    }

    #[test]
    fn an_agent_reads_a_delivered_turn_an_error_and_its_welcome() {
        let delivered = json!({"conversationId": CONVERSATION, "frame": {"type": "text",
            "id": "a", "seq": 18, "from": "user", "data": {"text": "hello", "code": [1]},
            "timestamp": 1,
            "meta": {"channel": {"id": "c"}, "participant": {"id": "alice", "role": "user"},
                "turn": {"seq": 18, "revision": 1, "key": "k", "fence": 4},
                "runtime": {"version": 3, "state": {"count": 3}}}}})
        .to_string();
        let delivered: AgentMessage = serde_json::from_str(&delivered).unwrap();
        let (answering, state) = delivered.delivered_turn().unwrap();
        assert_eq!(answering.conversation_id.to_string(), CONVERSATION);
        assert_eq!((answering.seq, answering.revision), (18, 1));
        assert_eq!((answering.fence, answering.runtime_version), (Some(4), 3));
        assert_eq!(state, Some(&json!({"count": 3})));
        assert_eq!(delivered.refusal_code(), None);

        let refused = json!({"conversationId": CONVERSATION, "frame": {"type": "error",
            "data": {"code": "conflict", "message": "m", "clientId": "r"}}})
        .to_string();
        let refused: AgentMessage = serde_json::from_str(&refused).unwrap();
        assert_eq!(refused.refusal_code(), Some("conflict"));
        assert!(refused.delivered_turn().is_none());

        let welcome = json!({"type": "welcome", "data": {"protocol": "converger/1",
            "since": 1234, "limits": {"maxFrameBytes": 1}}})
        .to_string();
        let welcome: AgentMessage = serde_json::from_str(&welcome).unwrap();
        assert_eq!(welcome.welcome_since(), Some(1234));
        assert!(welcome.delivered_turn().is_none());
        let heartbeat: AgentMessage =
            serde_json::from_str(r#"{"type":"heartbeat","timestamp":5}"#).unwrap();
        assert_eq!(heartbeat.welcome_since(), None);
    }
}
