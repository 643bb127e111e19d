//! Validation of client message frames (the persistent ones: `text`, `event`, …).
//!
//! Used by the REST post and the WebSocket sessions so both refuse the same inputs the same way.

use serde_json::{Map, Value};

use crate::{ErrorCode, Limits};

/// Frame types only the server sends; a client that sends one gets `invalid_message`.
pub const SERVER_ONLY_TYPES: &[&str] = &[
    "welcome",
    "ack",
    "error",
    "heartbeat",
    "replayTruncated",
    "deliveryStatus",
    "presence",
    "tokenRefreshed",
    "conversationUpdate",
    "streamChunk",
    "streamEnd",
    "streamAbort",
    "cancel",
];

/// Control frame types that are never stored as messages.
pub const CONTROL_TYPES: &[&str] = &[
    "hello",
    "sync",
    "ping",
    "typing",
    "read",
    "auth",
    "edit",
    "regenerate",
    "stop",
    "resume",
    "abort",
    "genui_event",
    "client_tools",
    "client_skills",
    "survey",
    "turnResult",
];

/// Top-level fields the server owns or that are never stored with the frame.
const NOT_STORED_FIELDS: &[&str] = &[
    "type",
    "id",
    "seq",
    "from",
    "sender",
    "timestamp",
    "clientId",
    "data",
    "metadata",
    "meta",
    "token",
    "turnPolicy",
];

/// The `meta` an end user's turn carries to agents: the send's `meta` over its connection's
/// hello `meta`, key by key (both objects); `None` when neither has one.
pub fn turn_client_meta(hello: Option<&Value>, send: Option<&Value>) -> Option<Value> {
    let mut merged = match hello {
        Some(Value::Object(hello)) => hello.clone(),
        _ => Map::new(),
    };
    if let Some(Value::Object(send)) = send {
        for (key, value) in send {
            merged.insert(key.clone(), value.clone());
        }
    }
    (!merged.is_empty()).then_some(Value::Object(merged))
}

/// Why a frame was refused: the error code and a human message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameError {
    /// Wire error code.
    pub code: ErrorCode,
    /// Human-readable reason.
    pub message: String,
}

impl FrameError {
    fn new(code: ErrorCode, message: impl Into<String>) -> FrameError {
        FrameError {
            code,
            message: message.into(),
        }
    }
}

/// A client message frame that passed validation, split into what is stored.
#[derive(Debug, Clone, PartialEq)]
pub struct MessageFrame {
    /// The frame's `type`.
    pub kind: String,
    /// The frame's `id`, when the sender gave one.
    pub id: Option<String>,
    /// The frame's explicit `clientId`, when the sender gave one.
    pub client_id: Option<String>,
    /// The frame's `data` object.
    pub data: Value,
    /// The frame's `metadata` object.
    pub metadata: Option<Value>,
    /// The relayed, never stored, `meta` object.
    pub meta: Option<Value>,
    /// The turn policy the send asks for (`turnPolicy`, ADR 0029), never stored; the gateway
    /// checks the name and whether the channel allows it.
    pub turn_policy: Option<String>,
    /// Other top-level fields, kept as given.
    pub extra: Map<String, Value>,
}

impl MessageFrame {
    /// The idempotency key of an end user's frame: `clientId`, or a mekik `id` of the same
    /// shape when `clientId` is absent. (An agent's `id` is the frame id, never a key.)
    pub fn user_idempotency_key(&self) -> Option<&str> {
        self.client_id.as_deref().or_else(|| {
            self.id
                .as_deref()
                .filter(|id| crate::is_valid_client_id(id))
        })
    }
}

/// Checks a message frame against the contract and the limits.
///
/// Nothing in it may hold a NUL character; `data` must be an object; a `text` frame needs `data.text` as a string within
/// `max_text_bytes`; `metadata`, when present, must be an object within `max_metadata_bytes`;
/// `clientId`, when present, must have the clientId shape.
pub fn validate_message_frame(frame: &Value, limits: &Limits) -> Result<MessageFrame, FrameError> {
    let Some(object) = frame.as_object() else {
        return Err(FrameError::new(
            ErrorCode::InvalidMessage,
            "a frame must be a JSON object",
        ));
    };
    if crate::contains_nul(frame) {
        return Err(FrameError::new(
            ErrorCode::InvalidMessage,
            crate::NUL_REFUSED,
        ));
    }
    let kind = match object.get("type") {
        Some(Value::String(kind)) if !kind.is_empty() => kind.clone(),
        Some(_) => {
            return Err(FrameError::new(
                ErrorCode::InvalidMessage,
                "type must be a non-empty string",
            ));
        }
        None => {
            return Err(FrameError::new(
                ErrorCode::InvalidMessage,
                "type is missing",
            ));
        }
    };
    if kind.len() > 64 {
        return Err(FrameError::new(
            ErrorCode::InvalidMessage,
            "type is longer than 64 bytes",
        ));
    }
    if SERVER_ONLY_TYPES.contains(&kind.as_str()) {
        return Err(FrameError::new(
            ErrorCode::InvalidMessage,
            format!("{kind} is sent only by the server"),
        ));
    }
    if CONTROL_TYPES.contains(&kind.as_str()) {
        return Err(FrameError::new(
            ErrorCode::InvalidMessage,
            format!("{kind} is not a message type"),
        ));
    }
    let data = match object.get("data") {
        Some(Value::Object(data)) => Value::Object(data.clone()),
        Some(_) => {
            return Err(FrameError::new(
                ErrorCode::InvalidMessage,
                "data must be an object",
            ));
        }
        None => {
            return Err(FrameError::new(
                ErrorCode::InvalidMessage,
                "data is missing",
            ));
        }
    };
    if kind == "text" {
        match data.get("text") {
            Some(Value::String(text)) if text.len() > limits.max_text_bytes => {
                return Err(FrameError::new(
                    ErrorCode::PayloadTooLarge,
                    format!("data.text is larger than {} bytes", limits.max_text_bytes),
                ));
            }
            Some(Value::String(_)) => {}
            _ => {
                return Err(FrameError::new(
                    ErrorCode::InvalidMessage,
                    "data.text must be a string",
                ));
            }
        }
    }
    let metadata = optional_object(object, "metadata")?;
    if let Some(metadata) = &metadata
        && serialized_len(metadata) > limits.max_metadata_bytes
    {
        return Err(FrameError::new(
            ErrorCode::PayloadTooLarge,
            format!(
                "metadata is larger than {} bytes",
                limits.max_metadata_bytes
            ),
        ));
    }
    let meta = optional_object(object, "meta")?;
    let id = optional_string(object, "id")?;
    let client_id = match optional_string(object, "clientId")? {
        Some(client_id) if crate::is_valid_client_id(&client_id) => Some(client_id),
        Some(_) => {
            return Err(FrameError::new(
                ErrorCode::InvalidMessage,
                "clientId must be 1-128 characters of A-Za-z0-9._:~-",
            ));
        }
        None => None,
    };
    if let Some(id) = &id
        && (id.is_empty() || id.len() > 128)
    {
        return Err(FrameError::new(
            ErrorCode::InvalidMessage,
            "id must be 1-128 bytes",
        ));
    }
    let turn_policy = optional_string(object, "turnPolicy")?;
    let extra: Map<String, Value> = object
        .iter()
        .filter(|(key, _)| !NOT_STORED_FIELDS.contains(&key.as_str()))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    Ok(MessageFrame {
        kind,
        id,
        client_id,
        data,
        metadata,
        meta,
        turn_policy,
        extra,
    })
}

/// Checks a message frame an agent sends (over its socket, in a `turnResult`, or over REST with
/// a channel-scope token) by the mekik frame rules: `data` is required only where the type needs
/// it (`text`); any other type without `data` (a `genui` chunk with `streamId`, `chunk` and
/// `done` at the top level, a `tool_call`, an `interrupt`, …) is stored as given, with
/// `data: {}`. Everything else is as [`validate_message_frame`].
pub fn validate_agent_message_frame(
    frame: &Value,
    limits: &Limits,
) -> Result<MessageFrame, FrameError> {
    let data_absent = frame
        .as_object()
        .is_some_and(|object| matches!(object.get("data"), None | Some(Value::Null)));
    let is_text = frame.get("type").and_then(Value::as_str) == Some("text");
    if !data_absent || is_text {
        return validate_message_frame(frame, limits);
    }
    let mut with_data = frame.clone();
    with_data["data"] = Value::Object(Map::new());
    validate_message_frame(&with_data, limits)
}

fn optional_object(object: &Map<String, Value>, field: &str) -> Result<Option<Value>, FrameError> {
    match object.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(inner)) => Ok(Some(Value::Object(inner.clone()))),
        Some(_) => Err(FrameError::new(
            ErrorCode::InvalidMessage,
            format!("{field} must be an object"),
        )),
    }
}

fn optional_string(object: &Map<String, Value>, field: &str) -> Result<Option<String>, FrameError> {
    match object.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(value)) => Ok(Some(value.clone())),
        Some(_) => Err(FrameError::new(
            ErrorCode::InvalidMessage,
            format!("{field} must be a string"),
        )),
    }
}

fn serialized_len(value: &Value) -> usize {
    serde_json::to_vec(value)
        .map(|bytes| bytes.len())
        .unwrap_or(usize::MAX)
}

#[cfg(test)]
mod meta_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_send_s_meta_overrides_the_hello_s_key_by_key() {
        let hello = json!({"locale": "fr", "page": "/a"});
        let send = json!({"page": "/b"});
        assert_eq!(
            turn_client_meta(Some(&hello), Some(&send)),
            Some(json!({"locale": "fr", "page": "/b"}))
        );
        assert_eq!(turn_client_meta(None, None), None);
        assert_eq!(turn_client_meta(Some(&json!({})), None), None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn check(frame: Value) -> Result<MessageFrame, FrameError> {
        validate_message_frame(&frame, &Limits::default())
    }

    #[test]
    fn text_frame_splits_into_stored_parts() {
        let frame = check(json!({
            "type": "text", "clientId": "c-1", "data": {"text": "hi"},
            "metadata": {"k": 1}, "meta": {"m": true}, "actions": [1], "seq": 99, "sender": "x"
        }))
        .unwrap();
        assert_eq!(frame.kind, "text");
        assert_eq!(frame.client_id.as_deref(), Some("c-1"));
        assert_eq!(frame.metadata, Some(json!({"k": 1})));
        assert_eq!(frame.meta, Some(json!({"m": true})));
        assert_eq!(Value::Object(frame.extra), json!({"actions": [1]}));
    }

    #[test]
    fn mekik_id_counts_as_client_id() {
        let frame = check(json!({"type": "text", "id": "m-1", "data": {"text": "hi"}})).unwrap();
        assert_eq!(frame.client_id, None, "an id is not an explicit clientId");
        assert_eq!(frame.user_idempotency_key(), Some("m-1"));
        let frame =
            check(json!({"type": "text", "id": "not valid!", "data": {"text": "hi"}})).unwrap();
        assert_eq!(frame.user_idempotency_key(), None);
        let frame =
            check(json!({"type": "text", "id": "m-1", "clientId": "c-1", "data": {"text": "hi"}}))
                .unwrap();
        assert_eq!(frame.user_idempotency_key(), Some("c-1"));
    }

    #[test]
    fn refusals_carry_the_documented_codes() {
        let cases = [
            (json!([1]), ErrorCode::InvalidMessage),
            (json!({"data": {}}), ErrorCode::InvalidMessage),
            (json!({"type": 3, "data": {}}), ErrorCode::InvalidMessage),
            (
                json!({"type": "ack", "data": {}}),
                ErrorCode::InvalidMessage,
            ),
            (
                json!({"type": "hello", "data": {}}),
                ErrorCode::InvalidMessage,
            ),
            (
                json!({"type": "text", "data": "hi"}),
                ErrorCode::InvalidMessage,
            ),
            (
                json!({"type": "text", "data": {"text": 5}}),
                ErrorCode::InvalidMessage,
            ),
            (
                json!({"type": "text", "data": {"text": "x".repeat(20_000)}}),
                ErrorCode::PayloadTooLarge,
            ),
            (
                json!({"type": "text", "data": {"text": "x"}, "metadata": []}),
                ErrorCode::InvalidMessage,
            ),
            (
                json!({"type": "text", "data": {"text": "x"}, "metadata": {"k": "v".repeat(5000)}}),
                ErrorCode::PayloadTooLarge,
            ),
            (
                json!({"type": "text", "data": {"text": "x"}, "clientId": "bad id"}),
                ErrorCode::InvalidMessage,
            ),
            (
                json!({"type": "text", "data": {"text": "x"}, "clientId": 7}),
                ErrorCode::InvalidMessage,
            ),
        ];
        for (frame, code) in cases {
            let refused = check(frame.clone()).expect_err(&frame.to_string());
            assert_eq!(refused.code, code, "{frame}");
        }
    }

    proptest! {
        #[test]
        fn arbitrary_json_never_panics(text in ".{0,40}", n in any::<i64>(), key in "[a-zA-Z]{1,8}") {
            let frames = [
                json!({"type": text.clone(), "data": {key.clone(): n}}),
                json!({"type": "text", "data": {"text": text.clone()}, key.clone(): n}),
                json!({key.clone(): text.clone()}),
                json!(text.clone()),
            ];
            for frame in frames {
                let _ = check(frame);
            }
        }
    }
}
