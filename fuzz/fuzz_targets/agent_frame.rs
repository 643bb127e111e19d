//! Fuzzes the parsing of agent WebSocket text frames (`converger_protocol::parse_agent_text`).
//!
//! Every UTF-8 input is parsed with and without lease mode, under the default and tiny limits.
//! Any panic is a bug; so is an accepted frame that storage could not hold (a NUL character
//! anywhere in what would be stored), or an accepted message that does not validate to itself.
#![no_main]

use converger_protocol::{
    AgentFrame, EnvelopedFrame, ErrorCode, Limits, MessageFrame, Refusal, StreamContent,
    TurnResult,
    contains_nul, is_valid_client_id, parse_agent_text, validate_message_frame,
};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn tiny_limits() -> Limits {
    Limits {
        max_text_bytes: 8,
        max_metadata_bytes: 8,
        max_frame_bytes: 64,
        ..Limits::default()
    }
}

/// What is stored of a message frame holds no NUL, and the frame validates to itself.
fn check_storable_message(message: &MessageFrame, limits: &Limits) {
    assert!(!message.kind.contains('\0'), "a type with NUL was accepted");
    assert!(!contains_nul(&message.data), "data with NUL was accepted");
    if let Some(metadata) = &message.metadata {
        assert!(!contains_nul(metadata), "metadata with NUL was accepted");
    }
    for (key, value) in &message.extra {
        assert!(!key.contains('\0') && !contains_nul(value), "extra with NUL was accepted");
    }
    if let Some(id) = &message.id {
        assert!(!id.contains('\0') && (1..=128).contains(&id.len()), "bad id {id:?}");
    }
    if let Some(client_id) = &message.client_id {
        assert!(is_valid_client_id(client_id), "bad clientId {client_id:?}");
    }
    assert!(message.kind.len() <= 64, "type is {} bytes", message.kind.len());
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
    assert_eq!(
        validate_message_frame(&Value::Object(rebuilt), limits).as_ref(),
        Ok(message),
        "a stored message does not validate to itself"
    );
}

fn check_result(result: &TurnResult, limits: &Limits, fence_required: bool) {
    assert!(result.seq > 0, "turn.seq {} accepted", result.seq);
    assert!(result.revision >= 0, "turn.revision {} accepted", result.revision);
    if fence_required {
        assert!(result.fence.is_some(), "a lease-mode result without its fence");
    }
    if let Some(fence) = result.fence {
        assert!(fence >= 0, "turn.fence {fence} accepted");
    }
    if let Some(client_id) = &result.client_id {
        assert!(is_valid_client_id(client_id), "bad clientId {client_id:?}");
    }
    for frame in &result.frames {
        check_storable_message(frame, limits);
    }
    if let Some(runtime) = &result.runtime {
        assert!(runtime.version >= 0, "runtime.version {} accepted", runtime.version);
        assert!(runtime.state.is_object(), "runtime.state is not an object");
        assert!(!contains_nul(&runtime.state), "runtime.state with NUL was accepted");
        let len = runtime.state.to_string().len();
        assert!(len <= limits.max_frame_bytes, "runtime.state is {len} bytes");
    }
}

fn check_refusal(refusal: &Refusal) {
    assert!(!refusal.error.message.is_empty(), "a refusal without a message");
    assert_ne!(refusal.error.code, ErrorCode::Internal, "a client input refused as internal");
    if let Some(client_id) = &refusal.client_id {
        assert!(is_valid_client_id(client_id), "a refusal echoes a bad clientId");
    }
    if let Some(kind) = &refusal.frame_type {
        assert!(!kind.contains('\0') && kind.chars().count() <= 64, "bad frameType echoed");
    }
}

fn check(frame: &Result<AgentFrame, Refusal>, limits: &Limits, fence_required: bool) {
    let frame = match frame {
        Ok(frame) => frame,
        Err(refusal) => return check_refusal(refusal),
    };
    match frame {
        AgentFrame::Enveloped { frame, .. } => match frame {
            EnvelopedFrame::Refused(refusal)
            | EnvelopedFrame::TurnResult(Err(refusal))
            | EnvelopedFrame::Sync(Err(refusal))
            | EnvelopedFrame::Message(Err(refusal)) => check_refusal(refusal),
            EnvelopedFrame::TurnResult(Ok(result)) => check_result(result, limits, fence_required),
            EnvelopedFrame::Message(Ok(message)) => check_storable_message(message, limits),
            EnvelopedFrame::Run { data } | EnvelopedFrame::Error { data } => {
                assert!(!contains_nul(data), "a relayed frame with NUL was accepted");
            }
            EnvelopedFrame::StreamChunk(Err(refusal))
            | EnvelopedFrame::StreamAbort(Err(refusal)) => check_refusal(refusal),
            EnvelopedFrame::StreamChunk(Ok(chunk)) => {
                assert!(is_valid_client_id(&chunk.stream_id), "a chunk with a bad stream id");
                let content = match &chunk.content {
                    StreamContent::Text(text) => text.clone(),
                    StreamContent::Chunk(value) => value.to_string(),
                };
                assert!(!content.contains('\0'), "a chunk with NUL was accepted");
            }
            EnvelopedFrame::StreamAbort(Ok(abort)) => {
                assert!(is_valid_client_id(&abort.stream_id), "an abort with a bad stream id");
                assert!(abort.reason.chars().count() <= 64, "an abort reason over 64 characters");
                assert!(!abort.reason.contains('\0'), "an abort reason with NUL");
            }
            EnvelopedFrame::Typing { .. } | EnvelopedFrame::Sync(Ok(_)) => {}
        },
        AgentFrame::Catalog { hash, list, .. } => {
            assert!(!contains_nul(hash) && !contains_nul(list), "a catalog with NUL was accepted");
        }
        AgentFrame::Auth { token } => assert!(!token.contains('\0'), "a token with NUL"),
        AgentFrame::Ping { .. } | AgentFrame::Ignored => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for limits in [Limits::default(), tiny_limits()] {
        for fence_required in [false, true] {
            let parsed = parse_agent_text(text, &limits, fence_required);
            check(&parsed, &limits, fence_required);
        }
    }
    // Tighter limits only ever refuse more.
    if let Ok(frame) = parse_agent_text(text, &tiny_limits(), false)
        && !matches!(
            &frame,
            AgentFrame::Enveloped { frame: EnvelopedFrame::Refused(_) | EnvelopedFrame::TurnResult(Err(_)) | EnvelopedFrame::Sync(Err(_)) | EnvelopedFrame::Message(Err(_)), .. }
        )
    {
        assert_eq!(
            parse_agent_text(text, &Limits::default(), false).as_ref(),
            Ok(&frame),
            "accepted under tiny limits but not identically under the defaults"
        );
    }
});
