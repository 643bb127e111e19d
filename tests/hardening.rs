//! What a hostile or careless client can do, over real sockets against a real Postgres: frames
//! storage cannot hold, connections that never authenticate, tokens that try to act as
//! someone else, and the admin surface.

mod support;

use serde_json::{Value, json};
use support::ws::WsClient;
use support::{TestNode, setup};
use uuid::Uuid;

/// Frames with a NUL character in each place one can hide: a value, a key, a top-level field,
/// the type.
fn poisoned_frames() -> Vec<Value> {
    vec![
        json!({"type": "text", "clientId": "p-1", "data": {"text": "a\u{0}b"}}),
        json!({"type": "text", "clientId": "p-2", "data": {"te\u{0}xt": "x", "text": "ok"}}),
        json!({"type": "text", "clientId": "p-3", "data": {"text": "ok"}, "note": "\u{0}"}),
        json!({"type": "text", "clientId": "p-4", "data": {"text": "ok"}, "n\u{0}": 1}),
        json!({"type": "te\u{0}xt", "clientId": "p-5", "data": {}}),
        json!({"type": "event", "clientId": "p-6", "data": {"deep": [{"x": ["\u{0}"]}]}}),
    ]
}

fn assert_refused_as_invalid(error: &Value, client_id: Option<&str>) {
    assert_eq!(error["type"], "error", "{error}");
    assert_eq!(error["data"]["code"], "invalid_message", "{error}");
    assert_eq!(error["data"]["retryable"], false, "{error}");
    if let Some(client_id) = client_id {
        assert_eq!(error["data"]["clientId"], client_id, "{error}");
    }
}

/// The number of stored frames of a conversation.
async fn stored(node: &TestNode, conversation_id: Uuid) -> i64 {
    node.db
        .count(&format!(
            "SELECT count(*) FROM activities WHERE conversation_id = '{conversation_id}'"
        ))
        .await
}

#[tokio::test]
async fn a_nul_character_anywhere_is_refused_on_the_end_user_socket_and_nothing_is_stored() {
    let node = TestNode::start().await;
    let (_, conversation_id, token) = setup(&node).await;
    for profile in [json!({"protocol": "converger/1"}), json!({})] {
        let mut client = WsClient::connect(&node.ws_url("")).await;
        let mut hello = json!({"type": "hello", "token": token});
        for (key, value) in profile.as_object().unwrap() {
            hello[key] = value.clone();
        }
        client.send(hello).await;
        assert_eq!(client.recv_type("welcome").await["type"], "welcome");
        let mekik = profile.get("protocol").is_none();
        for frame in poisoned_frames() {
            client.send_text(&frame.to_string()).await;
            let error = client.recv_type("error").await;
            assert_refused_as_invalid(&error, frame["clientId"].as_str());
            // The widget shows no error: a refused message is followed by a notice it shows.
            if let (true, Some(client_id)) = (mekik, error["data"]["clientId"].as_str()) {
                let notice = client.recv().await;
                assert_eq!(notice["id"], format!("refused-{client_id}"), "{notice}");
            }
        }
    }
    assert_eq!(stored(&node, conversation_id).await, 0);
    // The session is intact: the next honest frame is the conversation's first.
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client.hello(&token, json!({})).await;
    client
        .send(json!({"type": "text", "clientId": "ok", "data": {"text": "fine"}}))
        .await;
    assert_eq!(client.recv_type("ack").await["seq"], 1);
}

#[tokio::test]
async fn a_hello_with_a_nul_character_is_a_bad_request_closed_4400() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let anonymous = node
        .client
        .generate_token(&acme.secret, &converger_client::TokenRequest::default())
        .await
        .unwrap()
        .token;
    for hello in [
        json!({"type": "hello", "protocol": "converger/1", "token": anonymous, "userId": "al\u{0}ice"}),
        json!({"type": "hello", "token": anonymous, "conversationId": "x\u{0}"}),
    ] {
        let mut client = WsClient::connect(&node.ws_url("")).await;
        client.send_text(&hello.to_string()).await;
        let (frames, closed) = client.recv_until_closed().await;
        assert_eq!(frames.len(), 1, "{frames:?}");
        assert_eq!(frames[0]["data"]["code"], "bad_request");
        assert_eq!(closed.code, 4400);
    }
    assert_eq!(node.db.count("SELECT count(*) FROM conversations").await, 0);
}

#[tokio::test]
async fn a_nul_character_from_an_agent_is_refused_enveloped_and_nothing_is_stored() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, _) = node.conversation(&acme, "alice").await;
    let token = node.agent_token(&acme).await;
    let (mut agent, _) = node.agent(&token, None).await;
    let mut sent = poisoned_frames();
    sent.push(
        json!({"type": "turnResult", "clientId": "r-1", "turn": {"seq": 1},
                     "frames": [{"type": "text", "data": {"text": "\u{0}"}}]}),
    );
    sent.push(json!({"type": "typing", "isTyping": true, "x": "\u{0}"}));
    for frame in sent {
        let envelope = json!({"conversationId": conversation_id, "frame": frame});
        agent.send_text(&envelope.to_string()).await;
        let reply = loop {
            let reply = agent.recv().await;
            if reply["frame"]["type"] == "error" {
                break reply;
            }
        };
        assert_eq!(reply["conversationId"], json!(conversation_id));
        assert_refused_as_invalid(&reply["frame"], frame["clientId"].as_str());
    }
    // A bare frame with a NUL: refused, unenveloped.
    agent
        .send_text(&json!({"type": "ping", "nonce": "\u{0}"}).to_string())
        .await;
    assert_refused_as_invalid(&agent.recv_type("error").await, None);
    assert_eq!(stored(&node, conversation_id).await, 0);
}

#[tokio::test]
async fn a_nul_character_over_rest_is_a_400_and_nothing_is_stored() {
    let node = TestNode::start().await;
    let (fixture, conversation_id, token) = setup(&node).await;
    for frame in poisoned_frames() {
        let response = node
            .http
            .post(node.url(&format!(
                "/api/v1/converger/conversations/{conversation_id}/activities"
            )))
            .bearer_auth(&token)
            .json(&frame)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "{frame}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid_message", "{frame}");
    }
    assert_eq!(stored(&node, conversation_id).await, 0);
    let refused = [
        (
            "/api/v1/admin/tenants",
            json!({"name": "a\u{0}"}),
            Some(node.admin_token.clone()),
        ),
        (
            "/api/v1/converger/tokens/generate",
            json!({"user": {"id": "b\u{0}b"}}),
            Some(fixture.secret.clone()),
        ),
    ];
    for (path, body, bearer) in refused {
        let mut request = node.http.post(node.url(path)).json(&body);
        if let Some(bearer) = bearer {
            request = request.bearer_auth(bearer);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 400, "{path}");
    }
    let response = node
        .http
        .post(node.url("/api/v1/channels"))
        .header("x-api-key", &fixture.api_key)
        .json(&json!({"name": "web\u{0}"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    assert_eq!(node.db.count("SELECT count(*) FROM tenants").await, 1);
    assert_eq!(node.db.count("SELECT count(*) FROM channels").await, 1);
}

#[tokio::test]
async fn a_connection_without_hello_is_closed_at_the_hello_deadline_whatever_it_sends() {
    let node = TestNode::start_with(|config| {
        config.limits.hello_timeout_ms = 600;
        config.limits.idle_timeout_ms = 60_000;
        config.limits.heartbeat_interval_ms = 30_000;
    })
    .await;
    let mut client = WsClient::connect(&node.ws_url("")).await;
    let started = tokio::time::Instant::now();
    let mut answered = Vec::new();
    let closed = loop {
        // Activity that used to restart the wait: pings and frames that are not hello.
        client.send_ping().await;
        client
            .send_text(&json!({"type": "whatever"}).to_string())
            .await;
        match client
            .poll_event(std::time::Duration::from_millis(100))
            .await
        {
            Some(Err(closed)) => break closed,
            Some(Ok(frame)) => answered.push(frame),
            None => {}
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "no close after 10 s"
        );
    };
    assert_eq!(closed.code, 4408);
    assert!(started.elapsed() >= std::time::Duration::from_millis(550));
    assert!(
        answered
            .iter()
            .all(|frame| frame["data"]["code"] == "no_session"),
        "{answered:?}"
    );
}

/// Reads from a raw TCP connection until the server closes it; what it sent meanwhile.
async fn read_until_closed(stream: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(read) => received.extend_from_slice(&buffer[..read]),
            }
        }
    })
    .await
    .expect("the server closes the connection");
    String::from_utf8_lossy(&received).into_owned()
}

#[tokio::test]
async fn requests_whose_headers_or_body_never_finish_are_cut_off() {
    use tokio::io::AsyncWriteExt;
    let node = TestNode::start_with(|config| {
        config.http.header_read_timeout_ms = 300;
        config.http.body_read_timeout_ms = 300;
    })
    .await;
    let addr = node.server.addr();

    // Headers that never end.
    let started = tokio::time::Instant::now();
    let mut slow_headers = tokio::net::TcpStream::connect(addr).await.unwrap();
    slow_headers
        .write_all(b"GET /health/live HTTP/1.1\r\nHost: converger\r\n")
        .await
        .unwrap();
    read_until_closed(&mut slow_headers).await;
    assert!(started.elapsed() < std::time::Duration::from_secs(5));

    // A body that never arrives: answered (not served) and closed.
    let (_, conversation_id, token) = setup(&node).await;
    let mut slow_body = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /api/v1/converger/conversations/{conversation_id}/activities HTTP/1.1\r\n\
         Host: converger\r\nAuthorization: Bearer {token}\r\ncontent-type: application/json\r\n\
         content-length: 100\r\n\r\n{{\"type\":"
    );
    slow_body.write_all(request.as_bytes()).await.unwrap();
    let answer = read_until_closed(&mut slow_body).await;
    assert!(
        answer.starts_with("HTTP/1.1 4"),
        "a client error answers a body that never came: {answer}"
    );
    assert_eq!(stored(&node, conversation_id).await, 0);
}

#[tokio::test]
async fn connections_over_the_per_address_cap_get_503_before_any_upgrade() {
    let node = TestNode::start_with(|config| {
        config.http.max_connections_per_address = 3;
        config.http.retry_after_secs = 7;
    })
    .await;
    let (_, _, token) = setup(&node).await;
    // The REST client of the setup may still hold a keep-alive connection, which counts too:
    // sockets open until the cap refuses one.
    let mut sockets = Vec::new();
    loop {
        match WsClient::try_connect(&node.ws_url("")).await {
            Ok(mut client) => {
                client.hello(&token, json!({})).await;
                sockets.push(client);
            }
            Err(refused) => {
                assert!(refused.contains("503"), "{refused}");
                break;
            }
        }
        assert!(sockets.len() <= 3, "more sockets than the cap");
    }
    assert!(!sockets.is_empty());
    // Over the cap anything but the health checks and metrics gets 503 (connections.rs checks
    // those, and the node's own cap).
    let over = reqwest::Client::new()
        .get(node.url("/api/v1/conversations"))
        .send()
        .await
        .unwrap();
    assert_eq!(over.status(), 503);
    assert_eq!(over.headers()["retry-after"], "7");
    // A closed socket gives its place back: the request is served again (401: no key).
    sockets.pop().unwrap().close().await;
    support::eventually(
        "a connection is admitted again",
        std::time::Duration::from_secs(5),
        || async {
            reqwest::Client::new()
                .get(node.url("/api/v1/conversations"))
                .send()
                .await
                .is_ok_and(|response| response.status() == 401)
        },
    )
    .await;
}

#[tokio::test]
async fn failed_admin_authentications_are_throttled_per_address() {
    let node = TestNode::start_with(|config| {
        config.admin.failures_burst = 3;
        config.admin.failures_per_minute = 1;
    })
    .await;
    let cluster = |token: &str| {
        node.http
            .get(node.url("/api/v1/admin/cluster"))
            .bearer_auth(token.to_owned())
            .send()
    };
    for _ in 0..3 {
        assert_eq!(cluster("wrong-token").await.unwrap().status(), 401);
    }
    // The address is throttled now, even with the right token, and the page's form too.
    let throttled = cluster(&node.admin_token).await.unwrap();
    assert_eq!(throttled.status(), 429);
    let retry_after: u64 = throttled.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    let form = node
        .http
        .post(node.url("/"))
        .form(&[("token", node.admin_token.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(form.status(), 429);
    assert!(
        node.metrics()
            .await
            .lines()
            .any(|line| line.starts_with("converger_admin_auth_failures_total"))
    );
}

#[tokio::test]
async fn conversation_creation_and_token_issue_have_per_channel_rates() {
    let node = TestNode::start_with(|config| {
        config.rates.conversations_per_minute_per_channel = 2;
        config.rates.tokens_per_minute_per_channel = 3;
    })
    .await;
    let acme = node.tenant_with_channel("acme").await;
    let anonymous = node
        .client
        .generate_token(&acme.secret, &converger_client::TokenRequest::default())
        .await
        .unwrap()
        .token;
    for _ in 0..2 {
        node.client.create_conversation(&anonymous).await.unwrap();
    }
    let over = node
        .http
        .post(node.url("/api/v1/converger/conversations"))
        .bearer_auth(&anonymous)
        .send()
        .await
        .unwrap();
    assert_eq!(over.status(), 429);
    assert!(over.headers().contains_key("retry-after"));
    // A hello that would open a conversation: rate_limited, then 1012 with the retry hint.
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client
        .send(json!({"type": "hello", "protocol": "converger/1", "token": anonymous}))
        .await;
    let (frames, closed) = client.recv_until_closed().await;
    assert_eq!(frames[0]["data"]["code"], "rate_limited");
    assert!(frames[0]["data"]["retryAfterMs"].as_u64().unwrap() >= 1);
    assert_eq!(closed.code, 1012);
    let reason: Value = serde_json::from_str(&closed.reason).unwrap();
    assert_eq!(reason["reason"], "rate_limited");
    assert_eq!(node.db.count("SELECT count(*) FROM conversations").await, 2);
    // Tokens: the one above and two more, then 429.
    for _ in 0..2 {
        node.client
            .generate_token(&acme.secret, &converger_client::TokenRequest::default())
            .await
            .unwrap();
    }
    let over = node
        .http
        .post(node.url("/api/v1/converger/tokens/generate"))
        .bearer_auth(&acme.secret)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(over.status(), 429);
}

#[tokio::test]
async fn a_token_that_names_nobody_never_acts_as_another_user() {
    let node = TestNode::start().await;
    let (acme, alice_conversation, alice_token) = setup(&node).await;
    let mut alice = WsClient::connect(&node.ws_url("")).await;
    alice.hello(&alice_token, json!({})).await;
    alice
        .send(json!({"type": "text", "clientId": "secret", "data": {"text": "my secret"}}))
        .await;
    alice.recv_type("ack").await;
    let anonymous = node
        .client
        .generate_token(&acme.secret, &converger_client::TokenRequest::default())
        .await
        .unwrap()
        .token;

    // Over WebSocket: alice's conversation id (and her user id) asserted in hello.
    let mut mallory = WsClient::connect(&node.ws_url("")).await;
    let welcome = mallory
        .hello(
            &anonymous,
            json!({"conversationId": alice_conversation, "userId": "alice"}),
        )
        .await;
    assert_ne!(welcome["data"]["conversationId"], json!(alice_conversation));
    assert_ne!(welcome["data"]["userId"], "alice");
    let replayed = mallory.barrier().await;
    assert!(
        replayed
            .iter()
            .all(|frame| frame["data"]["text"] != "my secret"),
        "alice's history is not replayed: {replayed:?}"
    );
    mallory
        .send(json!({"type": "text", "clientId": "m-1", "data": {"text": "as alice?"}}))
        .await;
    mallory.recv_type("ack").await;
    assert_eq!(stored(&node, alice_conversation).await, 1);

    // Over REST: the same token on alice's conversation is 404, to read and to write.
    let list = node
        .http
        .get(node.url(&format!(
            "/api/v1/converger/conversations/{alice_conversation}/activities"
        )))
        .bearer_auth(&anonymous)
        .send()
        .await
        .unwrap();
    assert_eq!(list.status(), 404);
    let post = node
        .http
        .post(node.url(&format!(
            "/api/v1/converger/conversations/{alice_conversation}/activities"
        )))
        .bearer_auth(&anonymous)
        .json(&json!({"type": "text", "data": {"text": "x"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(post.status(), 404);
    assert_eq!(stored(&node, alice_conversation).await, 1);
}
