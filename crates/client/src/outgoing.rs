//! Every frame the client sends, built in one place (and checked against the protocol's
//! schemas by the integration tests' conformance suite).

use serde_json::{Map, Value, json};
use uuid::Uuid;

/// The protocol a converger client names in `hello.protocol`.
const PROTOCOL: &str = "converger/1";

/// An end user's `hello`: the token, the watermark so far and, when known, the conversation.
pub fn conversation_hello(token: &str, watermark: i64, conversation_id: Option<Uuid>) -> Value {
    let mut hello = json!({
        "type": "hello",
        "protocol": PROTOCOL,
        "token": token,
        "watermark": watermark,
    });
    if let Some(conversation_id) = conversation_id {
        hello["conversationId"] = json!(conversation_id);
    }
    hello
}

/// An agent's `hello`: its group (none for an observer), lease mode, and the per-conversation
/// watermarks it resumes from.
pub fn agent_hello(
    token: &str,
    group: Option<&str>,
    lease: bool,
    watermarks: impl IntoIterator<Item = (Uuid, i64)>,
) -> Value {
    let mut hello = json!({"type": "hello", "protocol": PROTOCOL, "token": token});
    if let Some(group) = group {
        hello["group"] = json!(group);
    }
    if lease {
        hello["claim"] = json!("lease");
    }
    let watermarks: Map<String, Value> = watermarks
        .into_iter()
        .map(|(conversation, seq)| (conversation.to_string(), json!(seq)))
        .collect();
    if !watermarks.is_empty() {
        hello["watermarks"] = Value::Object(watermarks);
    }
    hello
}

/// A `text` message without its clientId (see [`keyed`]).
pub fn text(text: &str) -> Value {
    json!({"type": "text", "data": {"text": text}})
}

/// A `stop` of the turn at `seq`, or of the latest unanswered one (docs/protocol.md §3.9);
/// keyed with [`keyed`], it is answered by an ack with `stopped`.
pub fn stop(seq: Option<i64>) -> Value {
    match seq {
        Some(seq) => json!({"type": "stop", "seq": seq}),
        None => json!({"type": "stop"}),
    }
}

/// `frame` with its `clientId` set; `None` when `frame` is not a JSON object.
pub fn keyed(frame: Value, client_id: &str) -> Option<Value> {
    let Value::Object(mut fields) = frame else {
        return None;
    };
    fields.insert("clientId".into(), json!(client_id));
    Some(Value::Object(fields))
}

/// `typing {isTyping}`.
pub fn typing(is_typing: bool) -> Value {
    json!({"type": "typing", "isTyping": is_typing})
}

/// `read {watermark}`.
pub fn read(watermark: i64) -> Value {
    json!({"type": "read", "watermark": watermark})
}

/// `sync {watermark}`.
pub fn sync(watermark: i64) -> Value {
    json!({"type": "sync", "watermark": watermark})
}

/// The turn an answer names: what of a delivered turn its `turnResult` repeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answering {
    /// Conversation.
    pub conversation_id: Uuid,
    /// The turn's seq.
    pub seq: i64,
    /// The turn's revision.
    pub revision: i64,
    /// Lease mode: the delivery's fencing token.
    pub fence: Option<i64>,
    /// The runtime version the turn was delivered with, which a written runtime names.
    pub runtime_version: i64,
}

impl Answering {
    /// The clientId of the `turnResult` answering this turn revision: the same on every retry,
    /// so a resent answer is recognized as a duplicate.
    pub fn result_client_id(&self) -> String {
        format!(
            "result-{}-{}-{}",
            self.conversation_id.simple(),
            self.seq,
            self.revision
        )
    }
}

/// The enveloped `turnResult` answering `turn` with `frames` (and the runtime written against
/// the version the turn was delivered with), for agents that write frames themselves.
pub fn result_envelope(
    turn: &Answering,
    client_id: &str,
    frames: Vec<Value>,
    runtime_state: Option<Value>,
) -> Value {
    let mut result = json!({
        "type": "turnResult",
        "clientId": client_id,
        "turn": {"seq": turn.seq, "revision": turn.revision},
        "frames": frames,
    });
    if let Some(fence) = turn.fence {
        result["turn"]["fence"] = json!(fence);
    }
    if let Some(state) = runtime_state {
        result["runtime"] = json!({"version": turn.runtime_version, "state": state});
    }
    json!({"conversationId": turn.conversation_id, "frame": result})
}
