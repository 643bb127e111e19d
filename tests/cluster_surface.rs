//! The cluster-wide conversation surface over real `converger serve` processes and gossip:
//! force-disconnect closes every matching socket on every node and counts them; presence counts
//! a user's connections over every node, goes online and offline once, and a killed node's
//! connections leave the count.

mod support;

use std::time::Duration;

use converger_client::{RestClient, TokenRequest};
use reqwest::StatusCode;
use serde_json::{Value, json};
use support::TestDb;
use support::cluster::{NodeProcess, wait_for_live_nodes};
use support::ws::WsClient;
use uuid::Uuid;

/// A tenant with one channel: (tenant id, channel id, channel secret).
async fn tenant(node: &NodeProcess, name: &str) -> (Uuid, Uuid, String) {
    let rest = RestClient::new(&node.base_url).unwrap();
    let admin = support::test_config().admin_token;
    let tenant = rest.create_tenant(&admin, name).await.unwrap();
    let channel = rest
        .create_channel(&tenant.api_key, &format!("{name}-web"))
        .await
        .unwrap();
    (tenant.id, channel.id, channel.secret)
}

/// A user's new conversation: (conversation id, bound token).
async fn conversation(node: &NodeProcess, secret: &str, user: &str) -> (Uuid, String) {
    let rest = RestClient::new(&node.base_url).unwrap();
    let token = rest
        .generate_token(secret, &TokenRequest::for_user(user))
        .await
        .unwrap();
    let created = rest.create_conversation(&token.token).await.unwrap();
    (created.conversation_id, created.token)
}

async fn connect(node: &NodeProcess, token: &str) -> WsClient {
    let mut client = WsClient::connect(&node.ws_url()).await;
    client.hello(token, json!({})).await;
    client
}

async fn observer(node: &NodeProcess, secret: &str) -> WsClient {
    let rest = RestClient::new(&node.base_url).unwrap();
    let token = rest
        .generate_token(secret, &TokenRequest::channel_scope())
        .await
        .unwrap()
        .token;
    connect(node, &token).await
}

async fn two_nodes(db: &TestDb) -> (NodeProcess, NodeProcess) {
    let a = NodeProcess::start(&db.url, "a", &[]).await;
    let b = NodeProcess::start(&db.url, "b", std::slice::from_ref(&a.gossip_addr)).await;
    wait_for_live_nodes(&[&a, &b], &["a", "b"]).await;
    (a, b)
}

async fn disconnect(node: &NodeProcess, body: Value) -> (StatusCode, Value) {
    let admin = support::test_config().admin_token;
    let response = reqwest::Client::new()
        .post(format!("{}/api/v1/admin/disconnect", node.base_url))
        .bearer_auth(admin)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Reads until the socket closes: the error frame it was sent last, and the close.
async fn closed_with(client: &mut WsClient) -> (Value, support::ws::Closed) {
    let (frames, closed) = client.recv_until_closed().await;
    let error = frames
        .into_iter()
        .rev()
        .find(|frame| frame["type"] == "error")
        .unwrap_or(Value::Null);
    (error, closed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnect_closes_every_matching_socket_on_every_node_and_counts_them() {
    let db = TestDb::create().await;
    let (a, b) = two_nodes(&db).await;
    let (acme, acme_channel, secret) = tenant(&a, "acme").await;
    let (other, _, other_secret) = tenant(&a, "other").await;
    let (_, alice_token) = conversation(&a, &secret, "alice").await;
    let (bob_conversation, bob_token) = conversation(&a, &secret, "bob").await;
    let (_, carol_token) = conversation(&b, &other_secret, "alice").await;
    let mut alice_on_a = connect(&a, &alice_token).await;
    let mut alice_on_b = connect(&b, &alice_token).await;
    let mut bob_on_a = connect(&a, &bob_token).await;
    let mut agent_on_b = observer(&b, &secret).await;
    // The other tenant's user has the same user id: a disconnect names a tenant's user.
    let mut other_alice = connect(&b, &carol_token).await;

    let (status, answer) = disconnect(
        &a,
        json!({"tenantId": acme, "userId": "alice", "reason": "account suspended"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["closed"], 2, "{answer}");
    assert_eq!(answer["missing"], json!([]));
    assert_eq!(answer["nodes"].as_array().unwrap().len(), 2);
    for client in [&mut alice_on_a, &mut alice_on_b] {
        let (error, closed) = closed_with(client).await;
        assert_eq!(closed.code, 4403);
        assert_eq!(closed.reason, "disconnected: account suspended");
        assert_eq!(error["data"]["code"], "forbidden");
        assert_eq!(error["data"]["message"], "account suspended");
    }
    // Everyone else is still connected.
    for client in [&mut bob_on_a, &mut agent_on_b, &mut other_alice] {
        client.barrier().await;
    }

    // Another tenant's disconnect never reaches this tenant's sockets.
    let (status, answer) = disconnect(
        &b,
        json!({"tenantId": other, "conversationId": bob_conversation}),
    )
    .await;
    assert_eq!((status, &answer["closed"]), (StatusCode::OK, &json!(0)));
    bob_on_a.barrier().await;

    // By channel: the end users and the agents of the channel, on both nodes.
    let (status, answer) =
        disconnect(&b, json!({"tenantId": acme, "channelId": acme_channel})).await;
    assert_eq!(
        (status, &answer["closed"]),
        (StatusCode::OK, &json!(2)),
        "{answer}"
    );
    for client in [&mut bob_on_a, &mut agent_on_b] {
        let (_, closed) = closed_with(client).await;
        assert_eq!(
            (closed.code, closed.reason.as_str()),
            (4403, "disconnected: disconnected by an operator")
        );
    }
    other_alice.barrier().await;

    // Bad orders change nothing.
    let unknown = Uuid::now_v7();
    let refusals = [
        (json!({"tenantId": acme}), StatusCode::BAD_REQUEST),
        (
            json!({"tenantId": "nope", "userId": "x"}),
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"tenantId": acme, "userId": ""}),
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"tenantId": acme, "userId": "x", "reason": ""}),
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"tenantId": acme, "userId": "x", "extra": 1}),
            StatusCode::BAD_REQUEST,
        ),
        (
            json!({"tenantId": unknown, "userId": "x"}),
            StatusCode::NOT_FOUND,
        ),
    ];
    for (body, expected) in refusals {
        let (status, _) = disconnect(&a, body.clone()).await;
        assert_eq!(status, expected, "{body}");
    }
    let anonymous = reqwest::Client::new()
        .post(format!("{}/api/v1/admin/disconnect", a.base_url))
        .json(&json!({"tenantId": acme, "userId": "alice"}))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED);
    other_alice.barrier().await;
}

/// The next enveloped frame an agent gets of `kind`, with every enveloped frame before it.
async fn until_enveloped(agent: &mut WsClient, kind: &str, timeout: Duration) -> Vec<Value> {
    let mut seen = Vec::new();
    loop {
        let frame = agent.next_event(timeout).await.expect("agent connected");
        let Some(inner) = frame.get("frame") else {
            continue;
        };
        let done = inner["type"] == kind;
        seen.push(inner.clone());
        if done {
            return seen;
        }
    }
}

fn presence_of(frames: &[Value]) -> Vec<(String, i64)> {
    frames
        .iter()
        .filter(|frame| frame["type"] == "presence")
        .map(|frame| {
            (
                frame["data"]["status"].as_str().unwrap().to_owned(),
                frame["data"]["connections"].as_i64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_counts_connections_over_every_node_and_a_killed_nodes_leave_the_count() {
    let db = TestDb::create().await;
    let (a, b) = two_nodes(&db).await;
    let (_, _, secret) = tenant(&a, "acme").await;
    let mut agent = observer(&a, &secret).await;
    let (_, token) = conversation(&a, &secret, "alice").await;

    // The first connection anywhere: online, counted 1.
    let on_a = connect(&a, &token).await;
    let seen = until_enveloped(&mut agent, "presence", Duration::from_secs(10)).await;
    assert_eq!(presence_of(&seen), vec![("online".to_owned(), 1)]);

    // Two more on the other node, then the first one closes: the user never went offline, and
    // no second online came (the text sent after is the barrier, it crosses the bus last).
    let mut on_b = connect(&b, &token).await;
    let _also_on_b = connect(&b, &token).await;
    on_a.close().await;
    on_b.send(json!({"type": "text", "clientId": "t-1", "data": {"text": "still here"}}))
        .await;
    let seen = until_enveloped(&mut agent, "text", Duration::from_secs(10)).await;
    assert_eq!(presence_of(&seen), vec![], "{seen:?}");

    // kill -9 of b: its two connections leave the count once gossip says b is dead.
    b.kill_9().await;
    let seen = until_enveloped(&mut agent, "presence", Duration::from_secs(60)).await;
    assert_eq!(presence_of(&seen), vec![("offline".to_owned(), 0)]);
    let left: i64 = db.count("SELECT count(*) FROM presence_connections").await;
    assert_eq!(left, 0);

    // Back on a: online again, counted 1 (nothing of b's is left in the count).
    let on_a = connect(&a, &token).await;
    let seen = until_enveloped(&mut agent, "presence", Duration::from_secs(10)).await;
    assert_eq!(presence_of(&seen), vec![("online".to_owned(), 1)]);
    // Its close is the last connection's: offline once.
    on_a.close().await;
    let seen = until_enveloped(&mut agent, "presence", Duration::from_secs(10)).await;
    assert_eq!(presence_of(&seen), vec![("offline".to_owned(), 0)]);
}
