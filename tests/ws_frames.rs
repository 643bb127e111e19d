//! docs/protocol.md §§3 and 7 over real sockets: sends, acks, fan-out, commands, bad input and
//! connection hygiene.

mod support;

use std::time::Duration;

use converger_client::TokenRequest;
use converger_gateway::tokens::Claims;
use serde_json::{Value, json};
use support::ws::WsClient;
use support::{TestNode, setup};

async fn connected(node: &TestNode, token: &str) -> WsClient {
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client.hello(token, json!({})).await;
    client
}

fn text(client_id: &str, body: &str) -> Value {
    json!({"type": "text", "clientId": client_id, "data": {"text": body}})
}

#[tokio::test]
async fn a_send_is_acked_after_commit_and_never_echoed_to_its_connection() {
    let node = TestNode::start().await;
    let (_, conversation_id, token) = setup(&node).await;
    let mut sender = connected(&node, &token).await;
    let mut other_tab = connected(&node, &token).await;

    sender.send(json!({"type": "text", "clientId": "c-1", "data": {"text": "hi"}, "metadata": {"k": 1}, "meta": {"trace": "x"}})).await;
    let ack = sender.recv().await;
    assert_eq!(ack["type"], "ack");
    assert_eq!(ack["clientId"], "c-1");
    assert_eq!(ack["seq"], 1);
    assert!(ack.get("duplicate").is_none());
    let id = ack["id"].as_str().unwrap().to_owned();
    // Committed before the ack: the row is there.
    assert_eq!(
        node.db
            .count("SELECT count(*) FROM activities WHERE seq = 1")
            .await,
        1
    );
    assert!(
        sender.barrier().await.is_empty(),
        "the sending connection never gets its own frame"
    );

    let copy = other_tab.recv().await;
    assert_eq!(copy["id"], id.as_str());
    assert_eq!(copy["seq"], 1);
    assert_eq!(copy["from"], "user");
    assert_eq!(copy["sender"], json!({"id": "alice", "role": "user"}));
    assert_eq!(
        copy["clientId"], "c-1",
        "the author's other connections get the clientId"
    );
    assert_eq!(copy["metadata"], json!({"k": 1}));
    assert!(
        copy.get("meta").is_none(),
        "meta is relayed to agents, never stored"
    );
    assert_eq!(copy["timestamp"], ack["timestamp"]);

    // The live frame and its replay are the same bytes.
    let mut late = WsClient::connect(&node.ws_url("")).await;
    late.hello(&token, json!({"watermark": 0})).await;
    assert_eq!(late.recv().await, copy);
    let listed = node
        .client
        .list_activities(&token, conversation_id, 0, 10)
        .await
        .unwrap();
    assert_eq!(listed.activities[0], copy);
}

#[tokio::test]
async fn agent_frames_read_as_bot_with_no_client_id() {
    let node = TestNode::start().await;
    let (acme, conversation_id, token) = setup(&node).await;
    let mut user = connected(&node, &token).await;
    let agent = node
        .client
        .generate_token(&acme.secret, &TokenRequest::channel_scope())
        .await
        .unwrap()
        .token;
    let frame = json!({"type": "text", "clientId": "agent-1", "data": {"text": "hello"}, "actions": [{"label": "ok"}]});
    node.client
        .post_activity(&agent, conversation_id, &frame, None)
        .await
        .unwrap();
    let received = user.recv().await;
    assert_eq!(received["from"], "bot");
    assert_eq!(received["sender"]["role"], "agent");
    assert_eq!(received["actions"], json!([{"label": "ok"}]));
    assert!(received.get("clientId").is_none());
}

#[tokio::test]
async fn a_resend_is_acked_as_duplicate_and_not_fanned_out_again() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let mut sender = connected(&node, &token).await;
    let mut other_tab = connected(&node, &token).await;
    sender.send(text("same", "once")).await;
    let first = sender.recv().await;
    sender.send(text("same", "once")).await;
    let second = sender.recv().await;
    assert_eq!(second["duplicate"], true);
    assert_eq!(
        (second["id"].clone(), second["seq"].clone()),
        (first["id"].clone(), first["seq"].clone())
    );
    assert_eq!(other_tab.recv().await["seq"], 1);
    assert!(
        other_tab.barrier().await.is_empty(),
        "the duplicate was not fanned out"
    );
    assert_eq!(node.db.count("SELECT count(*) FROM activities").await, 1);
}

#[tokio::test]
async fn sends_without_an_id_are_stored_but_not_acked_and_mekik_ids_are_keys() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let mut sender = connected(&node, &token).await;
    let mut other_tab = connected(&node, &token).await;
    sender
        .send(json!({"type": "text", "data": {"text": "no id"}}))
        .await;
    assert!(sender.barrier().await.is_empty(), "no ack without an id");
    assert_eq!(other_tab.recv().await["data"]["text"], "no id");

    let mut mekik = WsClient::connect_with(&node.ws_url(""), &[], None).await;
    mekik.send(json!({"type": "hello", "token": token})).await;
    assert_eq!(mekik.recv().await["type"], "welcome");
    assert_eq!(mekik.recv().await["seq"], 1);
    for _ in 0..2 {
        mekik
            .send(json!({"type": "text", "id": "mekik-1", "data": {"text": "from widget"}}))
            .await;
    }
    let copy = other_tab.recv().await;
    assert_eq!(copy["clientId"], "mekik-1");
    assert_eq!(copy["seq"], 2);
    assert!(
        other_tab.barrier().await.is_empty(),
        "the resend with the same id was dropped"
    );
    assert_eq!(node.db.count("SELECT count(*) FROM activities").await, 2);
}

#[tokio::test]
async fn other_message_types_are_stored_whole() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let mut sender = connected(&node, &token).await;
    let mut other_tab = connected(&node, &token).await;
    sender.send(json!({"type": "event", "clientId": "e-1", "data": {"name": "clicked"}, "extra": {"x": 1}})).await;
    assert_eq!(sender.recv().await["type"], "ack");
    let copy = other_tab.recv().await;
    assert_eq!(copy["type"], "event");
    assert_eq!(copy["extra"], json!({"x": 1}));
}

#[tokio::test]
async fn sync_replays_on_the_live_connection() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let mut client = connected(&node, &token).await;
    for n in 1..=3 {
        client.send(text(&format!("c-{n}"), "x")).await;
        client.recv_type("ack").await;
    }
    client.send(json!({"type": "sync", "watermark": 1})).await;
    let replayed = client.barrier().await;
    assert_eq!(
        replayed
            .iter()
            .map(|f| f["seq"].as_i64().unwrap())
            .collect::<Vec<_>>(),
        vec![2, 3]
    );
    client.send(json!({"type": "sync", "watermark": 99})).await;
    assert_eq!(client.recv().await["data"]["code"], "invalid_watermark");
}

#[tokio::test]
async fn ping_is_answered_with_a_heartbeat() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let mut client = connected(&node, &token).await;
    client.send(text("c-1", "x")).await;
    client.recv_type("ack").await;
    client.send(json!({"type": "ping", "nonce": 42})).await;
    let heartbeat = client.recv().await;
    assert_eq!(heartbeat["type"], "heartbeat");
    assert_eq!(heartbeat["nonce"], 42);
    assert_eq!(heartbeat["headSeq"], 1);
    assert!(heartbeat["timestamp"].as_i64().unwrap() > 1_700_000_000_000);
}

#[tokio::test]
async fn typing_never_reaches_the_same_users_connections() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let mut typist = connected(&node, &token).await;
    let mut other_tab = connected(&node, &token).await;
    typist
        .send(json!({"type": "typing", "isTyping": true}))
        .await;
    typist
        .send_invalid(json!({"type": "typing", "isTyping": "yes"}))
        .await;
    assert_eq!(typist.recv().await["data"]["code"], "invalid_message");
    assert!(typist.barrier().await.is_empty());
    assert!(other_tab.barrier().await.is_empty());
}

#[tokio::test]
async fn read_positions_are_stored_monotonically_and_announced_to_other_connections() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let mut reader = connected(&node, &token).await;
    let mut other_tab = connected(&node, &token).await;
    for n in 1..=3 {
        reader.send(text(&format!("c-{n}"), "x")).await;
        reader.recv_type("ack").await;
    }
    let _ = other_tab.barrier().await;
    reader.send(json!({"type": "read", "watermark": 3})).await;
    let status = other_tab.recv().await;
    assert_eq!(
        status,
        json!({"type": "deliveryStatus", "data": {"upToSeq": 3, "status": "read", "by": {"id": "alice", "role": "user"}}})
    );
    reader.send(json!({"type": "read", "watermark": 2})).await;
    assert!(reader.barrier().await.is_empty());
    assert!(
        other_tab.barrier().await.is_empty(),
        "a lower read position is not announced"
    );
    assert_eq!(
        node.db
            .count("SELECT read_seq FROM conversation_reads")
            .await,
        3
    );
    reader.send(json!({"type": "read", "watermark": 4})).await;
    assert_eq!(reader.recv().await["data"]["code"], "invalid_watermark");
}

#[tokio::test]
async fn auth_refreshes_the_token_and_a_foreign_token_is_forbidden() {
    let node = TestNode::start().await;
    let (acme, _, token) = setup(&node).await;
    let mut client = connected(&node, &token).await;
    let fresh = node.client.refresh_token(&token).await.unwrap().token;
    client.send(json!({"type": "auth", "token": fresh})).await;
    let refreshed = client.recv().await;
    assert_eq!(refreshed["type"], "tokenRefreshed");
    let claims = node.server.state().tokens.verify(&fresh).unwrap();
    assert_eq!(
        refreshed["data"]["expiresAt"].as_i64(),
        Some(claims.exp * 1000)
    );

    let (_, other_conversation_token) = node.conversation(&acme, "alice").await;
    let bob = node
        .client
        .generate_token(&acme.secret, &TokenRequest::for_user("bob"))
        .await
        .unwrap()
        .token;
    for foreign in [other_conversation_token, bob, "garbage".to_owned()] {
        client.send(json!({"type": "auth", "token": foreign})).await;
        assert_eq!(client.recv().await["data"]["code"], "forbidden");
    }
    client.send(text("still", "works")).await;
    assert_eq!(client.recv().await["type"], "ack");
}

#[tokio::test]
async fn forwarded_frames_without_agents_get_bot_unavailable() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let mut client = connected(&node, &token).await;
    for kind in [
        "resume",
        "abort",
        "genui_event",
        "client_tools",
        "client_skills",
        "survey",
    ] {
        client
            .send(json!({"type": kind, "clientId": "f-1", "data": {}}))
            .await;
        let error = client.recv().await;
        assert_eq!(error["data"]["code"], "bot_unavailable", "{kind}");
        assert_eq!(error["data"]["retryable"], true);
        assert_eq!(error["data"]["frameType"], kind);
        assert_eq!(error["data"]["clientId"], "f-1");
    }
}

#[tokio::test]
async fn sends_beyond_max_in_flight_are_refused_and_not_stored() {
    let node = TestNode::start_with(|config| {
        config.limits.max_in_flight = 1;
        config.limits.max_frames_per_sec = 1000;
    })
    .await;
    let (_, _, token) = setup(&node).await;
    let mut client = connected(&node, &token).await;
    for n in 0..30 {
        client.send(text(&format!("burst-{n}"), "x")).await;
    }
    let mut acked = 0;
    let mut refused = Vec::new();
    while acked + refused.len() < 30 {
        let frame = client.recv().await;
        match frame["type"].as_str() {
            Some("ack") => acked += 1,
            Some("error") => {
                assert_eq!(frame["data"]["code"], "too_many_in_flight");
                assert_eq!(frame["data"]["retryable"], true);
                refused.push(frame["data"]["clientId"].as_str().unwrap().to_owned());
            }
            _ => panic!("unexpected {frame}"),
        }
    }
    assert!(
        !refused.is_empty(),
        "a burst of 30 over a limit of 1 is refused in part"
    );
    assert_eq!(
        node.db.count("SELECT count(*) FROM activities").await,
        acked as i64
    );
    let stored_refused = node
        .db
        .count(&format!(
            "SELECT count(*) FROM activities WHERE client_id IN ('{}')",
            refused.join("','")
        ))
        .await;
    assert_eq!(stored_refused, 0);
}

#[tokio::test]
async fn bad_frames_get_their_codes_store_nothing_and_the_connection_keeps_working() {
    let node = TestNode::start_with(|config| config.limits.max_frames_per_sec = 1000).await;
    let (_, _, token) = setup(&node).await;
    let mut client = connected(&node, &token).await;
    let long_text = "x".repeat(5_000);
    let cases: Vec<(String, &str)> = vec![
        ("{not json".into(), "invalid_message"),
        ("[1, 2]".into(), "invalid_message"),
        ("\"text\"".into(), "invalid_message"),
        (json!({"data": {"text": "x"}}).to_string(), "invalid_message"),
        (json!({"type": 7, "data": {}}).to_string(), "invalid_message"),
        (json!({"type": "ack", "clientId": "c", "seq": 1}).to_string(), "invalid_message"),
        (json!({"type": "welcome", "data": {}}).to_string(), "invalid_message"),
        (json!({"type": "text", "clientId": "c-1", "data": "hi"}).to_string(), "invalid_message"),
        (json!({"type": "text", "clientId": "c-2", "data": {"text": 5}}).to_string(), "invalid_message"),
        (json!({"type": "text", "clientId": "c 3", "data": {"text": "x"}}).to_string(), "invalid_message"),
        (json!({"type": "text", "clientId": "c-4", "data": {"text": long_text}}).to_string(), "payload_too_large"),
        (json!({"type": "text", "clientId": "c-5", "data": {"text": "x"}, "metadata": {"m": "y".repeat(2_000)}}).to_string(), "payload_too_large"),
        (json!({"type": "sync", "watermark": "3"}).to_string(), "invalid_message"),
        (json!({"type": "text", "clientId": "c-6", "data": {"text": "x"}, "metadata": [1]}).to_string(), "invalid_message"),
    ];
    for (frame, code) in &cases {
        client.send_text(frame).await;
        let error = client.recv().await;
        assert_eq!(error["type"], "error", "{frame}");
        assert_eq!(error["data"]["code"], *code, "{frame}");
    }
    let refused = client.recv_error_after_binary().await;
    assert_eq!(refused["data"]["code"], "invalid_message");
    // A refused text frame echoes its clientId and type.
    client
        .send_invalid(json!({"type": "text", "clientId": "echo-me", "data": {"text": 5}}))
        .await;
    let error = client.recv().await;
    assert_eq!(
        (
            error["data"]["clientId"].as_str(),
            error["data"]["frameType"].as_str()
        ),
        (Some("echo-me"), Some("text"))
    );
    assert!(
        client.barrier().await.is_empty(),
        "the connection keeps working"
    );
    assert_eq!(node.db.count("SELECT count(*) FROM activities").await, 0);
}

trait BinaryProbe {
    async fn recv_error_after_binary(&mut self) -> Value;
}

impl BinaryProbe for WsClient {
    async fn recv_error_after_binary(&mut self) -> Value {
        self.send_binary(vec![1, 2, 3]).await;
        self.recv().await
    }
}

#[tokio::test]
async fn frames_above_the_limit_get_an_error_and_above_the_hard_cap_close_1009() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let limits = node.server.state().config.limits.clone();
    let mut client = connected(&node, &token).await;
    let big = json!({"type": "text", "clientId": "big", "data": {"text": "x"}, "pad": "p".repeat(limits.max_frame_bytes)});
    client.send(big).await;
    assert_eq!(client.recv().await["data"]["code"], "payload_too_large");
    assert!(client.barrier().await.is_empty());
    let huge = json!({"type": "text", "data": {"text": "x"}, "pad": "p".repeat(limits.hard_frame_bytes + 1)});
    client.send(huge).await;
    let (_, closed) = client.recv_until_closed().await;
    assert_eq!(closed.code, 1009);
    assert_eq!(node.db.count("SELECT count(*) FROM activities").await, 0);
}

#[tokio::test]
async fn frames_above_the_rate_are_refused_with_a_retry_hint() {
    let node = TestNode::start_with(|config| config.limits.max_frames_per_sec = 5).await;
    let (_, _, token) = setup(&node).await;
    let mut client = connected(&node, &token).await;
    for n in 0..20 {
        client.send(json!({"type": "ping", "nonce": n})).await;
    }
    let mut limited = 0;
    let mut answered = 0;
    while limited + answered < 20 {
        let frame = client.recv().await;
        if frame["type"] == "error" {
            assert_eq!(frame["data"]["code"], "rate_limited");
            assert!(frame["data"]["retryAfterMs"].as_u64().unwrap() > 0);
            limited += 1;
        } else {
            assert_eq!(frame["type"], "heartbeat");
            answered += 1;
        }
    }
    assert!(
        limited >= 10,
        "20 frames at once against 5/s: most are refused ({limited})"
    );
    assert!(answered >= 5);
}

#[tokio::test]
async fn heartbeats_follow_outbound_silence_for_converger_clients_only() {
    let node = TestNode::start_with(|config| {
        config.limits.heartbeat_interval_ms = 100;
        config.limits.idle_timeout_ms = 10_000;
    })
    .await;
    let (_, _, token) = setup(&node).await;
    let mut client = connected(&node, &token).await;
    let heartbeat = client.recv().await;
    assert_eq!(heartbeat["type"], "heartbeat");
    assert!(heartbeat.get("nonce").is_none());

    let mut mekik = WsClient::connect_with(&node.ws_url(""), &[], None).await;
    mekik.send(json!({"type": "hello", "token": token})).await;
    assert_eq!(mekik.recv().await["type"], "welcome");
    // The converger client gets several heartbeats meanwhile; the mekik one gets none.
    for _ in 0..3 {
        assert_eq!(client.recv().await["type"], "heartbeat");
    }
    mekik
        .send(json!({"type": "text", "id": "m-1", "data": {"text": "x"}}))
        .await;
    let frames = client.recv_until("text").await;
    assert_eq!(frames.last().unwrap()["clientId"], "m-1");
    // A frame from the converger tab marks the end: everything the mekik socket was sent in
    // the meantime arrives before it, and none of it may be a heartbeat.
    client.send(text("c-2", "y")).await;
    let received = mekik.recv_until("text").await;
    assert_eq!(
        received
            .iter()
            .map(|frame| frame["type"].as_str())
            .collect::<Vec<_>>(),
        vec![Some("text")],
        "the mekik client was sent only the converger tab's text: {received:?}"
    );
    assert_eq!(received[0]["data"]["text"], "y");
}

#[tokio::test]
async fn silent_connections_are_closed_4408() {
    let node = TestNode::start_with(|config| {
        config.limits.heartbeat_interval_ms = 150;
        config.limits.idle_timeout_ms = 400;
    })
    .await;
    let (_, _, token) = setup(&node).await;
    let mut client = connected(&node, &token).await;
    // The stimulus is silence: not reading means not answering the server's pings either. It
    // lasts well past the idle timeout, as reading would answer a ping the server sends after.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let (_, closed) = client.recv_until_closed().await;
    assert_eq!(closed.code, 4408);
}

#[tokio::test]
async fn token_expiry_without_auth_closes_4401_and_a_mekik_widget_is_told_to_reconnect() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let claims = node.server.state().tokens.verify(&token).unwrap();
    let short = node
        .server
        .state()
        .tokens
        .sign(&Claims {
            exp: chrono::Utc::now().timestamp() + 2,
            ..claims
        })
        .unwrap();
    let mut converger = connected(&node, &short).await;
    let mut mekik = WsClient::connect_with(&node.ws_url(""), &[], None).await;
    mekik.send(json!({"type": "hello", "token": short})).await;
    assert_eq!(mekik.recv().await["type"], "welcome");

    let (frames, closed) = converger.recv_until_closed().await;
    let error = frames
        .iter()
        .find(|frame| frame["type"] == "error")
        .expect("an error before the close");
    assert_eq!(error["data"]["code"], "token_expired");
    assert_eq!(error["data"]["retryable"], true);
    assert_eq!(closed.code, 4401);

    // The chativa connector gives up for good on `unauthorized` or 4401; any other close makes
    // it reconnect with a fresh token from its token function.
    let (frames, closed) = mekik.recv_until_closed().await;
    assert_eq!(frames.last().unwrap()["data"]["code"], "token_expired");
    assert_eq!(
        frames.last().unwrap()["data"]["details"]["reason"],
        "token_expired"
    );
    assert_eq!(
        (closed.code, closed.reason.as_str()),
        (1000, "token_expired")
    );
}

#[tokio::test]
async fn deactivating_the_channel_closes_its_sockets_4403() {
    let node = TestNode::start().await;
    let (acme, _, token) = setup(&node).await;
    let mut client = connected(&node, &token).await;
    node.client
        .set_channel_status(&acme.api_key, acme.channel_id, "inactive")
        .await
        .unwrap();
    let (frames, closed) = client.recv_until_closed().await;
    assert_eq!(frames.last().unwrap()["data"]["code"], "channel_inactive");
    assert_eq!(closed.code, 4403);

    // Its tokens are refused at hello too.
    let mut again = WsClient::connect(&node.ws_url("")).await;
    again
        .send(json!({"type": "hello", "protocol": "converger/1", "token": token}))
        .await;
    let (frames, closed) = again.recv_until_closed().await;
    assert_eq!(frames[0]["data"]["code"], "channel_inactive");
    assert_eq!(closed.code, 4403);
}

#[tokio::test]
async fn a_client_that_does_not_read_is_closed_4503_as_a_slow_consumer() {
    let node = TestNode::start_with(|config| {
        config.limits.outbound_queue_frames = 4;
        config.limits.max_frame_bytes = 16_384;
    })
    .await;
    let (acme, conversation_id, token) = setup(&node).await;
    let agent = node
        .client
        .generate_token(&acme.secret, &TokenRequest::channel_scope())
        .await
        .unwrap()
        .token;
    let mut client = connected(&node, &token).await;
    let pad = "p".repeat(12_000);
    let mut posted = 0;
    // The client reads nothing while the agent writes: socket buffers fill, then the queue.
    while node.server.state().hub.session_count() > 0 {
        assert!(
            posted < 5_000,
            "the session should have been closed as a slow consumer"
        );
        let frame = json!({"type": "text", "data": {"text": "x"}, "pad": pad});
        node.client
            .post_activity(&agent, conversation_id, &frame, None)
            .await
            .unwrap();
        posted += 1;
    }
    let (_, closed) = client.recv_until_closed().await;
    assert_eq!(closed.code, 4503);
    let reason: Value = serde_json::from_str(&closed.reason).unwrap();
    assert_eq!(reason["reason"], "slow_consumer");
    assert!(reason["retryAfterMs"].as_u64().unwrap() > 0);
}
