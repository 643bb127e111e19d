//! Conformance to the frame schemas of `docs/protocol/schemas/`. Every frame the integration
//! tests receive is checked by the test support (`support::ws`); this file checks the frames
//! clients send as the tests and the example agents build them, and that the schemas do refuse
//! what the contract forbids (so the suite-wide check can fail).

mod support;

use serde_json::{Value, json};
use support::schemas::{Schema, assert_conforms, violations};

const CONVERSATION: &str = "01a229f7-6923-72c8-b84e-152340d1c09c";

#[test]
fn frames_end_users_send_conform() {
    let frames = [
        json!({"type": "hello", "protocol": "converger/1", "token": "t", "watermark": 3}),
        json!({"type": "text", "clientId": "c-1", "data": {"text": "hello"}}),
        json!({"type": "event", "clientId": "c-2", "data": {"name": "opened"}}),
        json!({"type": "typing", "isTyping": true}),
        json!({"type": "read", "watermark": 4}),
        json!({"type": "sync", "watermark": 0}),
        json!({"type": "ping", "nonce": "n-1"}),
        json!({"type": "edit", "clientId": "e-1", "target": {"seq": 1}, "data": {"text": "better"}}),
        json!({"type": "regenerate", "clientId": "g-1", "target": {"seq": 1}}),
        json!({"type": "auth", "token": "t2"}),
    ];
    for frame in &frames {
        assert_conforms(Schema::ClientConversation, frame);
    }
}

#[test]
fn frames_agents_send_conform() {
    let frames = [
        json!({"type": "hello", "protocol": "converger/1", "token": "t", "group": "bot",
               "watermarks": {CONVERSATION: 2}}),
        json!({"type": "ping", "nonce": "n"}),
        json!({"conversationId": CONVERSATION, "frame": {
            "type": "turnResult", "clientId": "r-1", "turn": {"seq": 1, "revision": 0},
            "frames": [{"type": "text", "data": {"text": "answer"}}],
            "runtime": {"version": 0, "state": {"count": 1}}}}),
        json!({"conversationId": CONVERSATION, "frame": {"type": "text", "clientId": "p-1", "data": {"text": "proactive"}}}),
        json!({"conversationId": CONVERSATION, "frame": {"type": "typing", "isTyping": true}}),
        json!({"conversationId": CONVERSATION, "frame": {"type": "sync", "watermark": 0}}),
    ];
    for frame in &frames {
        assert_conforms(Schema::ClientChannel, frame);
    }
}

#[test]
fn the_schemas_refuse_what_the_contract_forbids() {
    let refused: [(Schema, Value); 6] = [
        // A persistent frame without its seq.
        (
            Schema::ServerConversation,
            json!({"type": "text", "id": "x", "data": {"text": "t"}, "sender": {"id": "u", "role": "user"}, "timestamp": 1}),
        ),
        // An error code that is not in the table of section 7.
        (
            Schema::ServerConversation,
            json!({"type": "error", "data": {"code": "made_up", "message": "m", "number": 1, "retryable": false}}),
        ),
        // A welcome without its connection id.
        (
            Schema::ServerChannel,
            json!({"type": "welcome", "data": {"protocol": "converger/1", "scope": "channel"}}),
        ),
        // A send whose client id is empty.
        (
            Schema::ClientConversation,
            json!({"type": "text", "clientId": "", "data": {"text": "t"}}),
        ),
        // A turn result without its turn.
        (
            Schema::ClientChannel,
            json!({"conversationId": CONVERSATION, "frame": {"type": "turnResult", "clientId": "r", "frames": []}}),
        ),
        // An envelope whose conversation id is not a UUID.
        (
            Schema::ClientChannel,
            json!({"conversationId": "nope", "frame": {"type": "typing", "isTyping": true}}),
        ),
    ];
    for (schema, frame) in &refused {
        assert!(
            !violations(*schema, frame).is_empty(),
            "{schema:?} accepted {frame}"
        );
    }
}
