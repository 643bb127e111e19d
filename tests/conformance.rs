//! Conformance to the frame schemas of `docs/protocol/schemas/`. Every frame the integration
//! tests receive is checked by the test support (`support::ws`); this file checks the frames the
//! Rust client (and so its echo-agent example) builds, and that the schemas do refuse what the
//! contract forbids (so the suite-wide check can fail). The Python SDK checks its own frames
//! against the same schemas in its tests.

mod support;

use converger_client::agent::{self, Turn};
use converger_client::outgoing;
use serde_json::{Value, json};
use support::schemas::{Schema, assert_conforms, violations};
use uuid::Uuid;

const CONVERSATION: &str = "01a229f7-6923-72c8-b84e-152340d1c09c";

fn conversation() -> Uuid {
    CONVERSATION.parse().expect("a uuid")
}

/// A turn as the Rust client reads it from a delivery, for the results it builds.
fn delivered_turn(fence: Option<i64>) -> Turn {
    let mut meta = json!({"channel": {"id": CONVERSATION}, "participant": {"id": "u", "role": "user"},
                          "turn": {"seq": 4, "revision": 1, "key": format!("{CONVERSATION}:4:1"), "reason": "edit"},
                          "runtime": {"version": 2, "state": {"count": 1}}});
    if let Some(fence) = fence {
        meta["turn"]["fence"] = json!(fence);
    }
    let envelope = json!({"conversationId": CONVERSATION, "frame": {
        "type": "text", "id": "f", "seq": 5, "from": "user", "sender": {"id": "u", "role": "user"},
        "data": {"text": "hi"}, "timestamp": 1, "meta": meta}});
    Turn::from_envelope(&envelope).expect("a delivered turn")
}

#[test]
fn frames_the_rust_client_sends_end_users_conform() {
    let frames = [
        outgoing::conversation_hello("t", 3, None),
        outgoing::conversation_hello("t", 0, Some(conversation())),
        outgoing::keyed(outgoing::text("hello"), "c-1").expect("an object"),
        outgoing::keyed(json!({"type": "event", "data": {"name": "opened"}}), "c-2")
            .expect("an object"),
        outgoing::keyed(outgoing::stop(Some(4)), "s-1").expect("an object"),
        outgoing::keyed(outgoing::stop(None), "s-2").expect("an object"),
        outgoing::typing(true),
        outgoing::read(4),
        outgoing::sync(0),
    ];
    for frame in &frames {
        assert_conforms(Schema::ClientConversation, frame);
    }
}

#[test]
fn frames_the_rust_client_sends_agents_conform() {
    let frames = [
        outgoing::agent_hello("t", Some("bot"), false, [(conversation(), 2)]),
        outgoing::agent_hello("t", None, false, []),
        outgoing::agent_hello("t", Some("bot"), true, []),
        agent::result_envelope(
            &delivered_turn(None),
            "r-1",
            vec![outgoing::text("answer")],
            Some(json!({"count": 2})),
        ),
        agent::result_envelope(&delivered_turn(Some(3)), "r-2", Vec::new(), None),
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
