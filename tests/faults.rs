//! Faults injected at named points (crates/store/src/faults.rs, cargo feature `failpoints`):
//! whatever breaks, no acked frame is lost, none is stored twice, and every subscriber sees each
//! frame once, in order. The points are process-wide, so every test here holds a
//! `FailScenario`, which also runs them one at a time.

mod support;

use std::collections::BTreeSet;

use converger_client::TokenRequest;
use converger_store::faults;
use fail::FailScenario;
use serde_json::{Value, json};
use support::ws::WsClient;
use support::{TestNode, seqs};
use uuid::Uuid;

fn text(client_id: &str, words: &str) -> Value {
    json!({"type": "text", "clientId": client_id, "data": {"text": words}})
}

/// A connected end user of `conversation` (several may share one conversation).
async fn connect(url: &str, token: &str) -> WsClient {
    let mut client = WsClient::connect(url).await;
    client.hello(token, json!({})).await;
    client
}

async fn stored(node: &TestNode, conversation_id: Uuid, client_id: &str) -> i64 {
    node.db
        .count(&format!(
            "SELECT count(*) FROM activities WHERE conversation_id = '{conversation_id}' AND client_id = '{client_id}'"
        ))
        .await
}

#[tokio::test]
async fn a_commit_failing_before_the_database_stores_nothing_and_the_resend_succeeds() {
    let scenario = FailScenario::setup();
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    let mut client = connect(&node.ws_url(""), &token).await;

    fail::cfg(faults::BEFORE_COMMIT, "1*return").unwrap();
    client.send(text("c-1", "first try")).await;
    let error = client.recv_type("error").await;
    assert_eq!(error["data"]["clientId"], "c-1");
    assert_eq!(error["data"]["code"], "internal");
    assert_eq!(error["data"]["retryable"], true);
    assert_eq!(
        stored(&node, conversation_id, "c-1").await,
        0,
        "nothing stored"
    );

    client.send(text("c-1", "first try")).await;
    let ack = client.recv_type("ack").await;
    assert_eq!(ack["clientId"], "c-1");
    assert!(ack.get("duplicate").is_none(), "the first commit");
    assert_eq!(stored(&node, conversation_id, "c-1").await, 1);
    scenario.teardown();
}

#[tokio::test]
async fn a_lost_ack_is_answered_again_by_the_resend_and_the_frame_is_seen_once() {
    let scenario = FailScenario::setup();
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    let mut sender = connect(&node.ws_url(""), &token).await;
    let mut other_tab = connect(&node.ws_url(""), &token).await;

    fail::cfg(faults::ACK_SEND_DROP, "1*return").unwrap();
    sender.send(text("c-1", "hello")).await;
    let seen = other_tab.recv_type("text").await;
    let seq = seen["seq"].as_i64().unwrap();
    assert!(
        sender
            .barrier()
            .await
            .iter()
            .all(|frame| frame["type"] != "ack"),
        "the ack was dropped"
    );

    sender.send(text("c-1", "hello")).await;
    let ack = sender.recv_type("ack").await;
    assert_eq!(ack["seq"], seq);
    assert_eq!(ack["duplicate"], true);
    assert_eq!(stored(&node, conversation_id, "c-1").await, 1);
    assert!(seqs(&other_tab.barrier().await).is_empty(), "seen once");
    scenario.teardown();
}

#[tokio::test]
async fn a_frame_committed_by_a_session_that_dies_at_once_still_reaches_every_subscriber() {
    let scenario = FailScenario::setup();
    let node = TestNode::start().await;
    let peer = node.start_peer().await;
    let peer_url = support::peer_ws_url(&peer);
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    let mut sender = connect(&node.ws_url(""), &token).await;
    let mut same_node = connect(&node.ws_url(""), &token).await;
    let mut other_node = connect(&peer_url, &token).await;

    fail::cfg(faults::AFTER_COMMIT_BEFORE_NOTIFY, "1*return").unwrap();
    sender.send(text("c-1", "committed, then silence")).await;
    // Neither node dispatched it directly: both hear it from the database's notification.
    let on_same = same_node.recv_type("text").await;
    let on_other = other_node.recv_type("text").await;
    assert_eq!(on_same["seq"], on_other["seq"]);
    assert!(
        sender
            .barrier()
            .await
            .iter()
            .all(|frame| frame["type"] != "ack"),
        "no ack from the dead session"
    );

    // The client resends as it must without an ack: the same frame, acked as a duplicate.
    sender.send(text("c-1", "committed, then silence")).await;
    let ack = sender.recv_type("ack").await;
    assert_eq!(ack["duplicate"], true);
    assert_eq!(ack["seq"], on_same["seq"]);
    assert_eq!(stored(&node, conversation_id, "c-1").await, 1);
    assert!(seqs(&same_node.barrier().await).is_empty(), "seen once");
    assert!(seqs(&other_node.barrier().await).is_empty(), "seen once");
    scenario.teardown();
}

#[tokio::test]
async fn frames_committed_while_the_listener_is_down_reach_the_other_node_in_order() {
    let scenario = FailScenario::setup();
    let node = TestNode::start().await;
    let peer = node.start_peer().await;
    let peer_url = support::peer_ws_url(&peer);
    let acme = node.tenant_with_channel("acme").await;
    let (_, token) = node.conversation(&acme, "alice").await;
    let mut sender = connect(&node.ws_url(""), &token).await;
    let mut watcher = connect(&peer_url, &token).await;

    // Both nodes drop their LISTEN connection for half a second after the next notification.
    fail::cfg(faults::LISTENER_DROP, "2*return").unwrap();
    let mut acked = Vec::new();
    for n in 0..4 {
        sender.send(text(&format!("c-{n}"), "while deaf")).await;
        acked.push(sender.recv_type("ack").await["seq"].as_i64().unwrap());
    }
    let mut seen = Vec::new();
    while seen.len() < acked.len() {
        let frame = watcher.recv().await;
        if let Some(seq) = frame["seq"].as_i64() {
            seen.push(seq);
        }
    }
    assert_eq!(seen, acked, "every frame, once, in order");
    let unique: BTreeSet<i64> = seen.iter().copied().collect();
    assert_eq!(unique.len(), seen.len());
    assert!(seqs(&watcher.barrier().await).is_empty(), "nothing twice");
    scenario.teardown();
}

#[tokio::test]
async fn a_turn_whose_frame_cannot_be_read_reaches_its_member_when_the_read_is_retried() {
    let scenario = FailScenario::setup();
    let node = TestNode::start().await;
    let peer = node.start_peer().await;
    let acme = node.tenant_with_channel("acme").await;
    let token = node
        .client
        .generate_token(&acme.secret, &TokenRequest::channel_scope())
        .await
        .unwrap()
        .token;
    let mut member = connect_agent(&support::peer_ws_url(&peer), &token).await;
    let (conversation_id, user_token) = node.conversation(&acme, "alice").await;

    // Too large for the notification, so the peer reads it back: its bus bridge's read fails,
    // then its channel actor's; the actor tries again a second later.
    fail::cfg(faults::LIST_ACTIVITIES, "2*return").unwrap();
    let padding = "x".repeat(12_000);
    node.client
        .post_activity(
            &user_token,
            conversation_id,
            &json!({"type": "text", "data": {"text": "hello", "padding": padding}}),
            None,
        )
        .await
        .unwrap();
    let turn = loop {
        let envelope = member.recv().await;
        if envelope["frame"]["type"] == "text" {
            break envelope;
        }
    };
    assert_eq!(turn["conversationId"], conversation_id.to_string());
    assert_eq!(turn["frame"]["data"]["text"], "hello");
    assert_eq!(turn["frame"]["meta"]["turn"]["seq"], 1);
    assert!(turn["frame"]["meta"]["runtime"].is_object());
    scenario.teardown();
}

#[tokio::test]
async fn an_agent_answers_a_turn_it_was_handed_without_looking_up_the_conversation() {
    let scenario = FailScenario::setup();
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let agent_token = node.agent_token(&acme).await;
    let mut agent = connect_agent(&node.ws_url(""), &agent_token).await;
    let (alice_conversation, alice_token) = node.conversation(&acme, "alice").await;
    let (bob_conversation, _) = node.conversation(&acme, "bob").await;
    let mut alice = connect(&node.ws_url(""), &alice_token).await;
    alice.send(text("a-1", "hello")).await;
    alice.recv_type("ack").await;
    let (conversation, seq, _) = support::next_turn(&mut agent).await;
    assert_eq!(conversation, alice_conversation.to_string());

    // From here every lookup of a conversation's channel by an agent connection fails.
    fail::cfg(faults::AGENT_CONVERSATION_LOOKUP, "return").unwrap();
    let answer = json!({
        "type": "turnResult",
        "clientId": "r-1",
        "turn": {"seq": seq, "revision": 0},
        "frames": [{"type": "text", "data": {"text": "answered"}}],
    });
    agent
        .send(json!({"conversationId": alice_conversation, "frame": answer}))
        .await;
    let answered = alice.recv_type("text").await;
    assert_eq!(answered["from"], "bot");
    assert_eq!(answered["data"]["text"], "answered");

    // A conversation the agent was never handed is looked up, and the point fires.
    agent
        .send(json!({"conversationId": bob_conversation, "frame": text("p-1", "proactive")}))
        .await;
    let (frames, closed) = agent.recv_until_closed().await;
    assert_eq!(closed.code, 1011, "{frames:?}");
    scenario.teardown();
}

/// A group member on `url`, once its `since` has passed (it owns the turns that follow).
async fn connect_agent(url: &str, token: &str) -> WsClient {
    let mut client = WsClient::connect(url).await;
    let welcome = client.hello(token, json!({"group": "bots"})).await;
    support::settle(&welcome).await;
    client
}
