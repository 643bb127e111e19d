//! Fuzzes the parsing of client WebSocket text frames (`converger_protocol::parse_client_text`).
//!
//! Every input that is valid UTF-8 is parsed under the default limits and under tiny limits,
//! and the result is checked against invariants the gateway relies on. Any panic, in the
//! protocol crate or in an assertion here, is a bug.
#![no_main]

use converger_protocol::{
    CONTROL_TYPES, ClientFrame, ErrorCode, FORWARDED_TYPES, Limits, MessageFrame, Refusal,
    SERVER_ONLY_TYPES, TurnTarget, is_valid_client_id, parse_client_frame, parse_client_text,
    contains_nul, validate_message_frame,
};
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value};

/// Top-level fields a stored message never keeps in `extra` (mirrors `frame.rs`).
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
];

fn tiny_limits() -> Limits {
    Limits {
        max_text_bytes: 8,
        max_metadata_bytes: 8,
        max_frame_bytes: 64,
        ..Limits::default()
    }
}

fn serialized_len(value: &Value) -> usize {
    serde_json::to_vec(value).expect("a Value serializes").len()
}

fn is_known_type(kind: &str) -> bool {
    CONTROL_TYPES.contains(&kind)
        || SERVER_ONLY_TYPES.contains(&kind)
        || FORWARDED_TYPES.contains(&kind)
        || kind == "turnResult"
}

fn check_client_id(client_id: &Option<String>, what: &str) {
    if let Some(id) = client_id {
        assert!(is_valid_client_id(id), "{what}: invalid clientId {id:?}");
    }
}

fn check_target(target: &TurnTarget) {
    if let Some(seq) = target.seq {
        assert!(seq > 0, "turn target seq must be positive, got {seq}");
    }
    if let Some(id) = &target.message_id {
        assert!(
            !id.is_empty() && id.len() <= 128,
            "turn target messageId must be 1-128 bytes, got {} bytes",
            id.len()
        );
    }
}

/// Invariants of a message accepted for storage.
fn check_message(message: &MessageFrame, object: &Map<String, Value>, limits: &Limits) {
    let kind = message.kind.as_str();
    // Storable: Postgres refuses a NUL character in text and jsonb, anywhere.
    assert!(
        !contains_nul(&Value::Object(object.clone())),
        "a message holding a NUL character was accepted"
    );
    assert!(!kind.is_empty(), "message kind is empty");
    assert!(kind.len() <= 64, "message kind is {} bytes", kind.len());
    assert!(!is_known_type(kind), "{kind} was accepted as a message");
    assert_eq!(object.get("type"), Some(&Value::String(message.kind.clone())));
    check_client_id(&message.client_id, "message");
    assert!(message.data.is_object(), "message data is not an object");
    if kind == "text" {
        match message.data.get("text") {
            Some(Value::String(text)) => assert!(
                text.len() <= limits.max_text_bytes,
                "data.text is {} bytes, limit {}",
                text.len(),
                limits.max_text_bytes
            ),
            other => panic!("text message without string data.text: {other:?}"),
        }
    }
    if let Some(metadata) = &message.metadata {
        assert!(metadata.is_object(), "metadata is not an object");
        let len = serialized_len(metadata);
        assert!(
            len <= limits.max_metadata_bytes,
            "metadata is {len} bytes, limit {}",
            limits.max_metadata_bytes
        );
    }
    if let Some(meta) = &message.meta {
        assert!(meta.is_object(), "meta is not an object");
    }
    if let Some(id) = &message.id {
        assert!(
            !id.is_empty() && id.len() <= 128,
            "id is {} bytes",
            id.len()
        );
    }
    for (key, value) in &message.extra {
        assert!(
            !NOT_STORED_FIELDS.contains(&key.as_str()),
            "extra keeps the not-stored field {key}"
        );
        assert_eq!(object.get(key), Some(value), "extra.{key} differs from the frame");
    }

    // Rebuilt from its stored parts, the message validates to itself.
    let mut rebuilt = message.extra.clone();
    rebuilt.insert("type".into(), Value::String(message.kind.clone()));
    rebuilt.insert("data".into(), message.data.clone());
    if let Some(metadata) = &message.metadata {
        rebuilt.insert("metadata".into(), metadata.clone());
    }
    if let Some(meta) = &message.meta {
        rebuilt.insert("meta".into(), meta.clone());
    }
    if let Some(id) = &message.id {
        rebuilt.insert("id".into(), Value::String(id.clone()));
    }
    if let Some(client_id) = &message.client_id {
        rebuilt.insert("clientId".into(), Value::String(client_id.clone()));
    }
    let rebuilt = Value::Object(rebuilt);
    assert_eq!(
        validate_message_frame(&rebuilt, limits).as_ref(),
        Ok(message),
        "rebuilt message does not validate to itself"
    );
    assert_eq!(
        parse_client_frame(&rebuilt, limits),
        Ok(ClientFrame::Message(Box::new(message.clone()))),
        "rebuilt message does not parse to itself"
    );
}

fn check_ok(frame: &ClientFrame, value: &Value, limits: &Limits) {
    let object = value.as_object().expect("an accepted frame is a JSON object");
    assert!(!contains_nul(value), "a frame holding a NUL character was accepted");
    match frame {
        ClientFrame::Hello(hello) => {
            assert_eq!(&hello.raw, object, "hello.raw is not the frame");
            if let Some(token) = &hello.token {
                assert!(!token.is_empty(), "hello token is empty");
            }
            if let Some(meta) = &hello.meta {
                assert!(meta.is_object(), "hello meta is not an object");
            }
            for field in [&hello.tools, &hello.skills].into_iter().flatten() {
                assert!(field.is_array() || field.is_object());
            }
        }
        ClientFrame::Message(message) => {
            check_message(message, object, limits);
            assert_eq!(
                validate_message_frame(value, limits).as_ref(),
                Ok(message.as_ref()),
                "validate_message_frame disagrees with parse_client_text"
            );
        }
        ClientFrame::Sync { watermark } | ClientFrame::Read { watermark } => {
            assert_eq!(
                object.get("watermark").and_then(Value::as_u64),
                Some(*watermark)
            );
        }
        ClientFrame::Ping { nonce } => assert_eq!(nonce.as_ref(), object.get("nonce")),
        ClientFrame::Typing { is_typing } => {
            assert_eq!(object.get("isTyping"), Some(&Value::Bool(*is_typing)));
        }
        ClientFrame::Auth { token } => assert!(!token.is_empty(), "auth token is empty"),
        ClientFrame::Edit {
            target,
            client_id,
            data,
        } => {
            check_target(target);
            check_client_id(client_id, "edit");
            assert!(data.is_object(), "edit data is not an object");
            let len = serialized_len(data);
            assert!(
                len <= limits.max_frame_bytes,
                "edit data is {len} bytes, limit {}",
                limits.max_frame_bytes
            );
            if let Some(Value::String(text)) = data.get("text") {
                assert!(
                    text.len() <= limits.max_text_bytes,
                    "edit data.text is {} bytes, limit {}",
                    text.len(),
                    limits.max_text_bytes
                );
            }
        }
        ClientFrame::Regenerate { target, client_id } => {
            check_target(target);
            check_client_id(client_id, "regenerate");
        }
        ClientFrame::Forwarded { kind, frame } => {
            assert!(FORWARDED_TYPES.contains(&kind.as_str()), "{kind} forwarded");
            assert_eq!(frame, object, "forwarded frame is not the frame");
        }
        ClientFrame::Unknown { kind } => {
            assert!(!kind.is_empty(), "unknown kind is empty");
            assert!(kind.chars().count() <= 64, "unknown kind is not truncated");
            assert!(!is_known_type(kind), "known type {kind} reported as unknown");
            assert!(
                !object.contains_key("data"),
                "a frame with data was ignored as unknown"
            );
            let sent = object.get("type").and_then(Value::as_str).unwrap_or("");
            assert!(sent.starts_with(kind.as_str()), "unknown kind is not the sent type");
        }
    }
}

fn check_refusal(refusal: &Refusal, value: Option<&Value>) {
    check_client_id(&refusal.client_id, "refusal");
    assert!(
        matches!(
            refusal.error.code,
            ErrorCode::InvalidMessage | ErrorCode::PayloadTooLarge | ErrorCode::BadRequest
        ),
        "unexpected refusal code {:?}",
        refusal.error.code
    );
    assert!(!refusal.error.message.is_empty(), "refusal without a message");
    if let Some(kind) = &refusal.frame_type {
        assert!(kind.chars().count() <= 64, "refusal frame_type is not truncated");
    }
    let object = value.and_then(Value::as_object);
    if let Some(client_id) = &refusal.client_id {
        assert_eq!(
            object.and_then(|object| object.get("clientId")),
            Some(&Value::String(client_id.clone())),
            "refusal echoes a clientId the frame did not carry"
        );
    }
}

/// Parses `text` under `limits`, checks the invariants and returns the result.
fn parse_and_check(text: &str, value: Option<&Value>, limits: &Limits) -> Result<ClientFrame, Refusal> {
    let result = parse_client_text(text, limits);
    match value {
        Some(value) => assert_eq!(
            parse_client_frame(value, limits),
            result,
            "parse_client_text and parse_client_frame disagree"
        ),
        None => {
            let refusal = result.as_ref().expect_err("malformed JSON was accepted");
            assert_eq!(refusal.error.code, ErrorCode::InvalidMessage);
            assert_eq!(refusal.client_id, None);
            assert_eq!(refusal.frame_type, None);
        }
    }
    match &result {
        Ok(frame) => check_ok(frame, value.expect("accepted frames are JSON"), limits),
        Err(refusal) => check_refusal(refusal, value),
    }
    result
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let value: Option<Value> = serde_json::from_str(text).ok();

    let default = parse_and_check(text, value.as_ref(), &Limits::default());
    let tiny = parse_and_check(text, value.as_ref(), &tiny_limits());

    // Tighter limits only ever refuse more: whatever they accept, the defaults accept alike.
    if let Ok(frame) = &tiny {
        assert_eq!(
            default.as_ref(),
            Ok(frame),
            "accepted under tiny limits but not identically under the defaults"
        );
    }
});
