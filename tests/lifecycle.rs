//! Conversation lifecycle (close, reopen, expiry) and the tenant API over a tenant's
//! conversations, over real sockets and HTTP against a real Postgres, on one and two nodes.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use support::ws::WsClient;
use support::{TenantFixture, TestNode, eventually};
use uuid::Uuid;

fn fast_settle(config: &mut converger_gateway::Config) {
    config.group_settle_ms = 150;
}

async fn post(node: &TestNode, path: &str, auth: (&str, &str), body: Value) -> (StatusCode, Value) {
    let response = node
        .http
        .post(node.url(path))
        .header(auth.0, auth.1)
        .json(&body)
        .send()
        .await
        .expect("POST");
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn get(node: &TestNode, path: &str, api_key: &str) -> (StatusCode, Value) {
    let response = node
        .http
        .get(node.url(path))
        .header("x-api-key", api_key)
        .send()
        .await
        .expect("GET");
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn bearer(token: &str) -> (&'static str, String) {
    ("authorization", format!("Bearer {token}"))
}

/// The next frame of `kind` on an end user's socket, skipping the others.
async fn next_of(client: &mut WsClient, kind: &str) -> Value {
    loop {
        let frame = client.recv().await;
        if frame["type"] == kind {
            return frame;
        }
    }
}

/// The next enveloped frame of `kind` on an agent socket.
async fn delivery(agent: &mut WsClient, kind: &str) -> Value {
    loop {
        let envelope = agent.recv().await;
        if envelope["frame"]["type"] == kind {
            return envelope["frame"].clone();
        }
    }
}

#[tokio::test]
async fn a_close_reaches_every_subscriber_refuses_every_write_and_a_reopen_takes_them_again() {
    let node = TestNode::start_with(fast_settle).await;
    let acme = node.tenant_with_channel("acme").await;
    let agent_token = node.agent_token(&acme).await;
    let (mut bot, welcome) = node.agent(&agent_token, Some("bot")).await;
    support::settle(&welcome).await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    let mut alice = WsClient::connect(&node.ws_url("")).await;
    alice.hello(&token, json!({})).await;
    let mut second_tab = WsClient::connect(&node.ws_url("")).await;
    second_tab.hello(&token, json!({})).await;

    alice
        .send(json!({"type": "text", "clientId": "a-1", "data": {"text": "hi"}}))
        .await;
    let turn_seq = alice.recv_until("ack").await.last().unwrap()["seq"]
        .as_i64()
        .unwrap();
    let turn = delivery(&mut bot, "text").await;
    assert_eq!(turn["seq"], turn_seq);

    let close_path = format!("/api/v1/converger/conversations/{conversation_id}/close");
    let (auth_name, auth_value) = bearer(&token);
    let (status, closed) = post(&node, &close_path, (auth_name, &auth_value), json!({})).await;
    assert_eq!(status, StatusCode::OK, "{closed}");
    assert_eq!(closed["status"], "closed");
    assert_eq!(closed["changed"], true);
    assert_eq!(closed["seq"], turn_seq + 1);

    // Every subscriber, the agent included, gets the close as a persistent frame.
    let expected = json!({"event": "closed", "status": "closed", "reason": "user"});
    for client in [&mut alice, &mut second_tab] {
        let update = next_of(client, "conversationUpdate").await;
        assert_eq!(update["seq"], turn_seq + 1);
        assert_eq!(update["data"], expected);
        assert_eq!(update["sender"], json!({"id": "system", "role": "system"}));
    }
    let update = delivery(&mut bot, "conversationUpdate").await;
    assert_eq!(update["data"], expected);

    // A repeat changes nothing.
    let (status, again) = post(&node, &close_path, (auth_name, &auth_value), json!({})).await;
    assert_eq!(
        (status, &again["changed"], &again["seq"]),
        (StatusCode::OK, &json!(false), &Value::Null)
    );

    // Writes are refused: a send, an edit, a regenerate, a REST post and the agent's answer.
    alice
        .send(json!({"type": "text", "clientId": "a-2", "data": {"text": "still there?"}}))
        .await;
    assert_eq!(
        alice.recv_type("error").await["data"]["code"],
        "conversation_closed"
    );
    alice
        .send(
            json!({"type": "edit", "clientId": "e-1", "seq": turn_seq, "data": {"text": "edited"}}),
        )
        .await;
    assert_eq!(
        alice.recv_type("error").await["data"]["code"],
        "conversation_closed"
    );
    alice
        .send(json!({"type": "regenerate", "clientId": "g-1", "seq": turn_seq}))
        .await;
    assert_eq!(
        alice.recv_type("error").await["data"]["code"],
        "conversation_closed"
    );
    let activities = format!("/api/v1/converger/conversations/{conversation_id}/activities");
    let (status, refused) = post(
        &node,
        &activities,
        (auth_name, &auth_value),
        json!({"type": "text", "data": {"text": "rest"}}),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(refused["error"]["code"], "conversation_closed");
    bot.send(json!({"conversationId": conversation_id, "frame": {
        "type": "turnResult", "clientId": "r-1", "turn": {"seq": turn_seq, "revision": 0},
        "frames": [{"type": "text", "data": {"text": "too late"}}]}}))
        .await;
    let refusal = delivery(&mut bot, "error").await;
    assert_eq!(refusal["data"]["code"], "conversation_closed");
    assert_eq!(refusal["data"]["clientId"], "r-1");

    // Nothing was stored after the close, and the waiting turn is settled, not pending.
    let stored = node
        .db
        .count(&format!(
            "SELECT count(*) FROM activities WHERE conversation_id = '{conversation_id}'"
        ))
        .await;
    assert_eq!(stored, turn_seq + 1);
    let last = node
        .db
        .count(&format!("SELECT max(seq) FROM activities WHERE conversation_id = '{conversation_id}' AND type = 'conversationUpdate'"))
        .await;
    assert_eq!(last, turn_seq + 1, "the close is the last frame");
    let pending = node
        .db
        .count(&format!("SELECT count(*) FROM turns WHERE conversation_id = '{conversation_id}' AND status = 'pending'"))
        .await;
    assert_eq!(pending, 0);

    // The tenant reopens it; writes are taken again.
    let reopen_path = format!("/api/v1/converger/conversations/{conversation_id}/reopen");
    let (status, reopened) = post(
        &node,
        &reopen_path,
        ("x-api-key", &acme.api_key),
        json!({"reason": "customer came back"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{reopened}");
    assert_eq!(
        (&reopened["status"], &reopened["changed"]),
        (&json!("open"), &json!(true))
    );
    let update = alice.recv_type("conversationUpdate").await;
    assert_eq!(
        update["data"],
        json!({"event": "reopened", "status": "open", "reason": "customer came back"})
    );
    let (status, _) = post(&node, &reopen_path, ("x-api-key", &acme.api_key), json!({})).await;
    assert_eq!(status, StatusCode::OK);
    alice
        .send(json!({"type": "text", "clientId": "a-3", "data": {"text": "back"}}))
        .await;
    let ack = alice.recv_until("ack").await.pop().unwrap();
    assert_eq!(ack["seq"], turn_seq + 3);
}

#[tokio::test]
async fn close_and_reopen_refuse_bad_input_and_strangers_and_change_nothing() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let other = node.tenant_with_channel("other").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    let (_, bob_token) = node.conversation(&acme, "bob").await;
    let path = format!("/api/v1/converger/conversations/{conversation_id}/close");
    let (name, alice_auth) = bearer(&token);
    let (_, bob_auth) = bearer(&bob_token);
    let cases: Vec<((&str, &str), Value, StatusCode, &str)> = vec![
        (
            (name, &bob_auth),
            json!({}),
            StatusCode::NOT_FOUND,
            "conversation_not_found",
        ),
        (
            ("x-api-key", &other.api_key),
            json!({}),
            StatusCode::NOT_FOUND,
            "conversation_not_found",
        ),
        (
            ("x-api-key", "cvg_key_wrong"),
            json!({}),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            (name, &alice_auth),
            json!({"reason": ""}),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            (name, &alice_auth),
            json!({"reason": "x".repeat(201)}),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            (name, &alice_auth),
            json!({"reason": 7}),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            (name, &alice_auth),
            json!({"surprise": true}),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
        (
            (name, &alice_auth),
            json!({"reason": "a\u{0}b"}),
            StatusCode::BAD_REQUEST,
            "bad_request",
        ),
    ];
    for (auth, body, status, code) in cases {
        let (got, answer) = post(&node, &path, auth, body.clone()).await;
        assert_eq!(
            (got, answer["error"]["code"].as_str()),
            (status, Some(code)),
            "{body}"
        );
    }
    let (status, answer) = post(
        &node,
        "/api/v1/converger/conversations/not-a-uuid/close",
        ("x-api-key", &acme.api_key),
        json!({}),
    )
    .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("conversation_not_found"))
    );
    let stored = node.db.count("SELECT count(*) FROM activities").await;
    assert_eq!(stored, 0);
    let open = node
        .db
        .count("SELECT count(*) FROM conversations WHERE status = 'open'")
        .await;
    assert_eq!(open, 2);
}

#[tokio::test]
async fn idle_conversations_expire_once_with_two_nodes_sweeping_and_active_ones_stay_open() {
    let expiring = |config: &mut converger_gateway::Config| {
        config.conversations.idle_close_secs = 3600;
        config.conversations.expiry_sweep_secs = 1;
        config.conversations.expiry_batch = 5;
    };
    let node = TestNode::start_with(expiring).await;
    let _peer = node.start_peer_with(expiring).await;
    let acme = node.tenant_with_channel("acme").await;
    let mut idle = Vec::new();
    for n in 0..23 {
        idle.push(node.conversation(&acme, &format!("idle-{n}")).await.0);
    }
    let (active, active_token) = node.conversation(&acme, "active").await;
    let mut watcher = WsClient::connect(&node.ws_url("")).await;
    let (idle_watched, idle_token) = node.conversation(&acme, "watched").await;
    idle.push(idle_watched);
    watcher.hello(&idle_token, json!({})).await;
    let ids: Vec<String> = idle.iter().map(Uuid::to_string).collect();
    let mut connection = node.db.connect().await;
    sqlx::query(
        "UPDATE conversations SET updated_at = now() - interval '2 hours' WHERE id::text = ANY($1)",
    )
    .bind(&ids)
    .execute(&mut connection)
    .await
    .unwrap();

    let update = watcher.recv_type("conversationUpdate").await;
    assert_eq!(
        update["data"],
        json!({"event": "closed", "status": "closed", "reason": "expired"})
    );
    eventually(
        "every idle conversation closed",
        Duration::from_secs(30),
        || async {
            node.db
                .count("SELECT count(*) FROM conversations WHERE status = 'closed'")
                .await
                == idle.len() as i64
        },
    )
    .await;
    // Both nodes keep sweeping: wait for two more sweeps' worth of time, seen as an expiry of
    // a conversation made idle after the first ones closed.
    let (late, _) = node.conversation(&acme, "late").await;
    sqlx::query("UPDATE conversations SET updated_at = now() - interval '2 hours' WHERE id = $1")
        .bind(late)
        .execute(&mut connection)
        .await
        .unwrap();
    eventually(
        "the late idle conversation closed",
        Duration::from_secs(30),
        || async {
            node.db
                .count(&format!(
                    "SELECT count(*) FROM conversations WHERE id = '{late}' AND status = 'closed'"
                ))
                .await
                == 1
        },
    )
    .await;
    let frames = node
        .db
        .count("SELECT count(*) FROM activities WHERE type = 'conversationUpdate'")
        .await;
    assert_eq!(
        frames,
        idle.len() as i64 + 1,
        "each idle conversation closed once"
    );
    let twice = node
        .db
        .count("SELECT count(*) FROM (SELECT conversation_id FROM activities WHERE type = 'conversationUpdate' GROUP BY conversation_id HAVING count(*) > 1) AS twice")
        .await;
    assert_eq!(twice, 0);
    let open: String = sqlx::query_scalar("SELECT status FROM conversations WHERE id = $1")
        .bind(active)
        .fetch_one(&mut connection)
        .await
        .unwrap();
    assert_eq!(open, "open");
    // The active one still takes writes.
    let (name, auth) = bearer(&active_token);
    let (status, _) = post(
        &node,
        &format!("/api/v1/converger/conversations/{active}/activities"),
        (name, &auth),
        json!({"type": "text", "data": {"text": "still here"}}),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
}

async fn page_ids(node: &TestNode, fixture: &TenantFixture, query: &str) -> (Vec<Uuid>, Value) {
    let (status, page) = get(
        node,
        &format!("/api/v1/conversations?{query}"),
        &fixture.api_key,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{page}");
    let ids = page["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|conversation| conversation["id"].as_str().unwrap().parse().unwrap())
        .collect();
    (ids, page["nextCursor"].clone())
}

#[tokio::test]
async fn the_tenant_api_pages_stably_under_concurrent_inserts_and_filters_and_gets_one() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let other = node.tenant_with_channel("other").await;
    node.conversation(&other, "stranger").await;
    let mut before = BTreeSet::new();
    for n in 0..17 {
        before.insert(node.conversation(&acme, &format!("user-{}", n % 3)).await.0);
    }
    // Page through while conversations keep being created between the pages.
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut created_meanwhile = BTreeSet::new();
    loop {
        let query = match &cursor {
            Some(cursor) => format!("limit=4&cursor={cursor}"),
            None => "limit=4".to_owned(),
        };
        let (ids, next) = page_ids(&node, &acme, &query).await;
        seen.extend(ids);
        let Some(next) = next.as_str() else {
            break;
        };
        cursor = Some(next.to_owned());
        if created_meanwhile.len() < 6 {
            created_meanwhile.insert(node.conversation(&acme, "late").await.0);
        }
    }
    assert!(
        seen.windows(2).all(|pair| pair[0] < pair[1]),
        "in order, none twice"
    );
    let seen_set: BTreeSet<Uuid> = seen.iter().copied().collect();
    assert!(
        before.is_subset(&seen_set),
        "nothing created before paging is skipped"
    );
    assert!(
        created_meanwhile.is_subset(&seen_set),
        "those created meanwhile come on later pages"
    );
    assert_eq!(
        seen_set.len(),
        before.len() + created_meanwhile.len(),
        "only this tenant's"
    );

    // Filters: user, status, channel, updated since.
    let (of_user, _) = page_ids(&node, &acme, "userId=user-1&limit=1000").await;
    assert_eq!(of_user.len(), 6);
    let closing = of_user[0];
    let (status, _) = post(
        &node,
        &format!("/api/v1/converger/conversations/{closing}/close"),
        ("x-api-key", &acme.api_key),
        json!({}),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (closed, _) = page_ids(&node, &acme, "status=closed").await;
    assert_eq!(closed, vec![closing]);
    let (in_channel, _) = page_ids(
        &node,
        &acme,
        &format!("channelId={}&limit=1000", acme.channel_id),
    )
    .await;
    assert_eq!(in_channel.len(), seen.len());
    let (_, one) = get(
        &node,
        &format!("/api/v1/conversations/{closing}"),
        &acme.api_key,
    )
    .await;
    assert_eq!(one["status"], "closed");
    let since = one["updatedAt"].as_i64().unwrap();
    let (recent, _) = page_ids(&node, &acme, &format!("updatedSince={since}")).await;
    assert!(recent.contains(&closing));
    assert!(recent.len() < seen.len());

    // Another tenant's conversation, or a bad query, gets the documented answers.
    let (status, _) = get(
        &node,
        &format!("/api/v1/conversations/{closing}"),
        &other.api_key,
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    for query in [
        "limit=0",
        "limit=1001",
        "status=gone",
        "cursor=nope",
        "channelId=1",
        "updatedSince=-1",
        "updatedSince=soon",
    ] {
        let (status, answer) = get(
            &node,
            &format!("/api/v1/conversations?{query}"),
            &acme.api_key,
        )
        .await;
        assert_eq!(
            (status, answer["error"]["code"].as_str()),
            (StatusCode::BAD_REQUEST, Some("bad_request")),
            "{query}"
        );
    }
}

#[tokio::test]
async fn a_rotated_api_key_keeps_working_for_its_grace_and_only_the_current_key_rotates() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (status, rotated) = post(
        &node,
        "/api/v1/api-keys/rotate",
        ("x-api-key", &acme.api_key),
        json!({}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{rotated}");
    let new_key = rotated["apiKey"].as_str().unwrap().to_owned();
    let grace_ends = rotated["previousKeyExpiresAt"].as_i64().unwrap();
    let day_ms = 24 * 3600 * 1000;
    let now = chrono::Utc::now().timestamp_millis();
    assert!(
        (grace_ends - now - day_ms).abs() < 60_000,
        "default grace is 24 h"
    );
    // Both keys work during the grace.
    for key in [&acme.api_key, &new_key] {
        let (status, _) = get(&node, "/api/v1/conversations", key).await;
        assert_eq!(status, StatusCode::OK);
    }
    // The old key cannot rotate again.
    let (status, answer) = post(
        &node,
        "/api/v1/api-keys/rotate",
        ("x-api-key", &acme.api_key),
        json!({}),
    )
    .await;
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (StatusCode::FORBIDDEN, Some("forbidden"))
    );
    // A rotation without grace ends the replaced key at once; the key before it is gone too.
    let (status, answer) = post(
        &node,
        "/api/v1/api-keys/rotate",
        ("x-api-key", &new_key),
        json!({"graceSecs": 0}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let newest = answer["apiKey"].as_str().unwrap().to_owned();
    for (key, expected) in [
        (&acme.api_key, StatusCode::UNAUTHORIZED),
        (&new_key, StatusCode::UNAUTHORIZED),
        (&newest, StatusCode::OK),
    ] {
        let (status, _) = get(&node, "/api/v1/conversations", key).await;
        assert_eq!(status, expected);
    }
    let (status, _) = post(
        &node,
        "/api/v1/api-keys/rotate",
        ("x-api-key", &newest),
        json!({"graceSecs": 2_592_001}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}
