//! What the bench's users and agents read of the gateway's messages: the few fields they
//! measure by, deserialized in place. Every other field is skipped without being built, where
//! a `serde_json::Value` would allocate a map per object (serde_json and `Value`'s maps were
//! 16 % of the bench clients' samples; docs/benchmarks.md, sixteenth round). The client crate's
//! readers stay `Value`-based: they keep whole frames for applications.
//!
//! A message these views cannot read (a field of another JSON type than the one named here,
//! such as a `streamChunk`'s `from` object) is one the bench does not wait for: its readers
//! skip it, as indexing a `Value` that did not match skipped it before.

use std::borrow::Cow;

use converger_client::outgoing::Answering;
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

/// A string field, borrowed from the message text unless it holds an escape. (Serde borrows a
/// `Cow` only when the field itself is one: inside an `Option` it would always copy.)
#[derive(Debug, Deserialize)]
struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

impl Text<'_> {
    fn is(text: &Option<Text<'_>>, expected: &str) -> bool {
        text.as_ref().is_some_and(|text| text.0 == expected)
    }
}

/// A frame on an end user's connection: an `ack` of the user's send (with its `clientId` and
/// the stored `seq`), or a persistent frame (`seq`, and `from: "bot"` for the agent's answer).
#[derive(Debug, Deserialize)]
pub struct UserFrame<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(rename = "clientId", borrow, default)]
    client_id: Option<Text<'a>>,
    #[serde(default)]
    seq: Option<i64>,
    #[serde(borrow, default)]
    from: Option<Text<'a>>,
}

impl UserFrame<'_> {
    /// Whether this is the ack of the send keyed `client_id`.
    pub fn is_ack_of(&self, client_id: &str) -> bool {
        self.kind == "ack" && Text::is(&self.client_id, client_id)
    }

    /// The frame's `seq`: an ack's is the stored frame's.
    pub fn seq(&self) -> Option<i64> {
        self.seq
    }

    /// Whether this is an answer stored after `turn_seq`: a persistent frame from the agent.
    pub fn answers(&self, turn_seq: Option<i64>) -> bool {
        Text::is(&self.from, "bot") && self.seq > turn_seq
    }
}

/// A message on an agent's connection: unenveloped (`welcome`, whose `data.since` the bench
/// waits for), or enveloped with a conversation and a frame (a delivered turn, an ack, an error).
#[derive(Debug, Deserialize)]
pub struct AgentMessage<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Text<'a>>,
    #[serde(default)]
    data: Option<MessageData>,
    #[serde(rename = "conversationId", default)]
    conversation_id: Option<Uuid>,
    #[serde(borrow, default)]
    frame: Option<EnvelopedFrame<'a>>,
}

/// The fields of a `data` object the bench reads: a welcome's `since`, an error's `code`. Kept
/// as any JSON value, so a forwarded frame whose own data has such a field still parses.
#[derive(Debug, Default, Deserialize)]
struct MessageData {
    #[serde(default)]
    since: Option<Value>,
    #[serde(default)]
    code: Option<Value>,
}

/// An enveloped frame: its type, the error data of an `error`, the `meta` of a delivered turn.
#[derive(Debug, Deserialize)]
struct EnvelopedFrame<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(default)]
    data: Option<MessageData>,
    #[serde(default)]
    meta: Option<DeliveryMeta>,
}

/// `meta` of a delivered turn (docs/protocol.md §4.2): which turn, and the runtime at delivery.
#[derive(Debug, Deserialize)]
struct DeliveryMeta {
    #[serde(default)]
    turn: Option<TurnMeta>,
    #[serde(default)]
    runtime: Option<RuntimeMeta>,
}

/// `meta.turn`: the delivered turn's seq and revision, and in lease mode its fence.
#[derive(Debug, Deserialize)]
struct TurnMeta {
    seq: i64,
    #[serde(default)]
    revision: i64,
    #[serde(default)]
    fence: Option<i64>,
}

/// `meta.runtime`: the conversation's runtime version at delivery, and of its state the one
/// field the bench's agents write (`turns --runtime-writes`).
#[derive(Debug, Deserialize)]
struct RuntimeMeta {
    #[serde(default)]
    version: i64,
    #[serde(default)]
    state: Option<BenchState>,
}

/// The runtime state the bench's agents write: how many turns of the conversation they answered.
#[derive(Debug, Deserialize)]
struct BenchState {
    #[serde(default)]
    count: Option<i64>,
}

impl AgentMessage<'_> {
    /// `data.since` of a `welcome`.
    pub fn welcome_since(&self) -> Option<i64> {
        if !Text::is(&self.kind, "welcome") {
            return None;
        }
        self.data.as_ref()?.since.as_ref()?.as_i64()
    }

    /// The code of an enveloped `error` (a refused result).
    pub fn refusal_code(&self) -> Option<&str> {
        let frame = self.frame.as_ref()?;
        if frame.kind != "error" {
            return None;
        }
        frame.data.as_ref()?.code.as_ref()?.as_str()
    }

    /// The delivered turn an answer names, with the `count` of the runtime state it was
    /// delivered with; `None` for anything that is not a delivered turn.
    pub fn delivered_turn(&self) -> Option<(Answering, Option<i64>)> {
        let meta = self.frame.as_ref()?.meta.as_ref()?;
        let turn = meta.turn.as_ref()?;
        let answering = Answering {
            conversation_id: self.conversation_id?,
            seq: turn.seq,
            revision: turn.revision,
            fence: turn.fence,
            runtime_version: meta.runtime.as_ref().map_or(0, |runtime| runtime.version),
        };
        let count = meta
            .runtime
            .as_ref()
            .and_then(|runtime| runtime.state.as_ref()?.count);
        Some((answering, count))
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
        assert!(ack.is_ack_of("t-1"));
        assert!(!ack.is_ack_of("t-2"));
        assert_eq!(ack.seq(), Some(7));
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
        assert!(!own.is_ack_of("t-1"));
        let typing: UserFrame =
            serde_json::from_str(r#"{"type":"typing","isTyping":true}"#).unwrap();
        assert!(!typing.answers(None));
        assert!(!typing.is_ack_of("t-1"));
    }

    #[test]
    fn strings_are_borrowed_unless_they_hold_an_escape() {
        let ack = r#"{"type":"ack","clientId":"t-1","seq":3,"from":"bot"}"#;
        let ack: UserFrame = serde_json::from_str(ack).unwrap();
        assert!(matches!(ack.kind, Cow::Borrowed(_)));
        assert!(matches!(ack.client_id, Some(Text(Cow::Borrowed(_)))));
        assert!(matches!(ack.from, Some(Text(Cow::Borrowed(_)))));
        let escaped = json!({"type": "ack", "clientId": "t-\"2\"", "seq": 3}).to_string();
        let escaped: UserFrame = serde_json::from_str(&escaped).unwrap();
        assert!(matches!(escaped.client_id, Some(Text(Cow::Owned(_)))));
        assert!(escaped.is_ack_of("t-\"2\""));
    }

    #[test]
    fn a_message_of_another_shape_is_not_read() {
        // A converger-profile stream chunk names its writer as an object.
        let chunk = json!({"type": "streamChunk", "streamId": "s", "index": 0, "text": "t",
            "from": {"id": "bot", "role": "bot"}})
        .to_string();
        assert!(serde_json::from_str::<UserFrame>(&chunk).is_err());
        let forwarded = json!({"conversationId": CONVERSATION,
            "frame": {"type": "event", "data": "not an object"}})
        .to_string();
        assert!(serde_json::from_str::<AgentMessage>(&forwarded).is_err());
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
        let (answering, count) = delivered.delivered_turn().unwrap();
        assert_eq!(answering.conversation_id.to_string(), CONVERSATION);
        assert_eq!((answering.seq, answering.revision), (18, 1));
        assert_eq!((answering.fence, answering.runtime_version), (Some(4), 3));
        assert_eq!(count, Some(3));
        assert_eq!(delivered.refusal_code(), None);
        assert_eq!(delivered.welcome_since(), None);

        let plain = json!({"conversationId": CONVERSATION, "frame": {"type": "text", "seq": 2,
            "meta": {"turn": {"seq": 2}}}})
        .to_string();
        let plain: AgentMessage = serde_json::from_str(&plain).unwrap();
        let (answering, count) = plain.delivered_turn().unwrap();
        assert_eq!((answering.revision, answering.fence), (0, None));
        assert_eq!((answering.runtime_version, count), (0, None));

        let acked = json!({"conversationId": CONVERSATION, "frame": {"type": "ack",
            "clientId": "r", "seqs": [3], "turn": {"seq": 2, "revision": 0}}})
        .to_string();
        let acked: AgentMessage = serde_json::from_str(&acked).unwrap();
        assert!(acked.delivered_turn().is_none());
        assert_eq!(acked.refusal_code(), None);

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
