//! The REST surface over real HTTP against a real Postgres, one database per test.

mod support;

use converger_client::{TokenRequest, TokenResponse};
use converger_gateway::tokens::{Claims, Scope};
use reqwest::StatusCode;
use serde_json::{Value, json};
use support::TestNode;
use uuid::Uuid;

/// Sends a request and returns (status, JSON body).
async fn call(request: reqwest::RequestBuilder) -> (StatusCode, Value) {
    let response = request.send().await.expect("request completes");
    let status = response.status();
    let body = response.json::<Value>().await.unwrap_or(Value::Null);
    (status, body)
}

fn error_code(body: &Value) -> &str {
    body["error"]["code"]
        .as_str()
        .unwrap_or_else(|| panic!("no error body in {body}"))
}

fn activities_url(node: &TestNode, conversation_id: impl std::fmt::Display) -> String {
    node.url(&format!(
        "/api/v1/converger/conversations/{conversation_id}/activities"
    ))
}

#[tokio::test]
async fn admin_tenants_require_the_admin_token() {
    let node = TestNode::start().await;
    let url = node.url("/api/v1/admin/tenants");
    let (status, body) = call(node.http.post(&url).json(&json!({"name": "acme"}))).await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::UNAUTHORIZED, "unauthorized")
    );
    let (status, body) = call(
        node.http
            .post(&url)
            .bearer_auth("wrong-token-000000")
            .json(&json!({"name": "acme"})),
    )
    .await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::UNAUTHORIZED, "unauthorized")
    );
    assert_eq!(node.db.count("SELECT count(*) FROM tenants").await, 0);

    let (status, body) = call(
        node.http
            .post(&url)
            .bearer_auth(&node.admin_token)
            .json(&json!({"name": "acme"})),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(body["name"], "acme");
    let api_key = body["apiKey"].as_str().unwrap();
    assert!(api_key.starts_with("cvg_key_"));
    // Only the hash is stored.
    let stored = node
        .db
        .count(&format!(
            "SELECT count(*) FROM tenants WHERE api_key_hash = '{api_key}'"
        ))
        .await;
    assert_eq!(stored, 0);
}

#[tokio::test]
async fn malformed_admin_bodies_are_400_and_write_nothing() {
    let node = TestNode::start().await;
    let url = node.url("/api/v1/admin/tenants");
    let bodies = [
        "{not json",
        "[]",
        "{}",
        "{\"name\": 5}",
        "{\"name\": \"   \"}",
    ];
    for body in bodies {
        let request = node
            .http
            .post(&url)
            .bearer_auth(&node.admin_token)
            .header("content-type", "application/json");
        let (status, answer) = call(request.body(body)).await;
        assert_eq!(
            (status, error_code(&answer)),
            (StatusCode::BAD_REQUEST, "bad_request"),
            "{body}"
        );
    }
    assert_eq!(node.db.count("SELECT count(*) FROM tenants").await, 0);
}

#[tokio::test]
async fn channels_are_isolated_between_tenants() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let globex = node.tenant_with_channel("globex").await;

    let acme_channels = node.client.list_channels(&acme.api_key).await.unwrap();
    assert_eq!(
        acme_channels.iter().map(|c| c.id).collect::<Vec<_>>(),
        vec![acme.channel_id]
    );
    let globex_channels = node.client.list_channels(&globex.api_key).await.unwrap();
    assert_eq!(
        globex_channels.iter().map(|c| c.id).collect::<Vec<_>>(),
        vec![globex.channel_id]
    );

    // Another tenant's channel answers exactly like a missing one.
    let foreign = node
        .client
        .set_channel_status(&acme.api_key, globex.channel_id, "inactive")
        .await
        .unwrap_err();
    let missing = node
        .client
        .set_channel_status(&acme.api_key, Uuid::new_v4(), "inactive")
        .await
        .unwrap_err();
    assert_eq!(foreign.status(), Some(StatusCode::NOT_FOUND));
    assert_eq!(foreign.code(), missing.code());
    assert_eq!(
        node.db
            .count("SELECT count(*) FROM channels WHERE status = 'inactive'")
            .await,
        0
    );

    let (status, body) = call(
        node.http
            .get(node.url("/api/v1/channels"))
            .header("x-api-key", "cvg_key_nope"),
    )
    .await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::UNAUTHORIZED, "unauthorized")
    );
    let (status, _) = call(node.http.get(node.url("/api/v1/channels"))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);

    // A channel secret is not an API key, and an API key is not a channel secret.
    let (status, _) = call(
        node.http
            .get(node.url("/api/v1/channels"))
            .header("x-api-key", &acme.secret),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let generate = node.url("/api/v1/converger/tokens/generate");
    let (status, _) = call(node.http.post(&generate).bearer_auth(&acme.api_key)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn channel_update_refuses_bad_status_without_writing() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let url = node.url(&format!("/api/v1/channels/{}", acme.channel_id));
    for body in [json!({"status": "paused"}), json!({}), json!({"status": 1})] {
        let (status, answer) = call(
            node.http
                .patch(&url)
                .header("x-api-key", &acme.api_key)
                .json(&body),
        )
        .await;
        assert_eq!(
            (status, error_code(&answer)),
            (StatusCode::BAD_REQUEST, "bad_request"),
            "{body}"
        );
    }
    let (status, _) = call(
        node.http
            .patch(node.url("/api/v1/channels/not-a-uuid"))
            .header("x-api-key", &acme.api_key)
            .json(&json!({"status": "inactive"})),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        node.db
            .count("SELECT count(*) FROM channels WHERE status = 'active'")
            .await,
        1
    );
}

fn claims_of(node: &TestNode, token: &str) -> Claims {
    node.server
        .state()
        .tokens
        .verify(token)
        .expect("token verifies")
}

#[tokio::test]
async fn generated_tokens_carry_the_documented_claims() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let before = chrono::Utc::now().timestamp();

    let user_token = node
        .client
        .generate_token(&acme.secret, &TokenRequest::for_user("u-1"))
        .await
        .unwrap();
    assert_eq!(user_token.expires_in, 600);
    let claims = claims_of(&node, &user_token.token);
    assert_eq!(claims.token_type, "converger");
    assert_eq!(claims.tenant_id, acme.tenant_id);
    assert_eq!(claims.channel_id, acme.channel_id);
    assert_eq!(claims.user_id.as_deref(), Some("u-1"));
    assert_eq!(claims.scope(), Scope::Conversation);
    assert_eq!(claims.conversation_id, None);
    assert!(
        (before + 600..=before + 602).contains(&claims.exp),
        "exp {}",
        claims.exp
    );

    let agent_token = node
        .client
        .generate_token(&acme.secret, &TokenRequest::channel_scope())
        .await
        .unwrap();
    assert_eq!(
        claims_of(&node, &agent_token.token).scope,
        Some(Scope::Channel)
    );

    // A token bound to a conversation of this channel.
    let (conversation_id, _) = node.conversation(&acme, "u-1").await;
    let bound = TokenRequest {
        conversation_id: Some(conversation_id),
        ..TokenRequest::for_user("u-1")
    };
    let bound_token = node
        .client
        .generate_token(&acme.secret, &bound)
        .await
        .unwrap();
    assert_eq!(
        claims_of(&node, &bound_token.token).conversation_id,
        Some(conversation_id)
    );

    // ... but not for another user's conversation, and not for another channel's.
    let wrong_user = TokenRequest {
        conversation_id: Some(conversation_id),
        ..TokenRequest::for_user("u-2")
    };
    let refused = node
        .client
        .generate_token(&acme.secret, &wrong_user)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some("forbidden"));
    let globex = node.tenant_with_channel("globex").await;
    let foreign = TokenRequest {
        conversation_id: Some(conversation_id),
        ..TokenRequest::default()
    };
    let refused = node
        .client
        .generate_token(&globex.secret, &foreign)
        .await
        .unwrap_err();
    assert_eq!(
        (refused.status(), refused.code()),
        (Some(StatusCode::NOT_FOUND), Some("conversation_not_found"))
    );

    let bad_scope = TokenRequest {
        scope: Some("everything".into()),
        ..TokenRequest::default()
    };
    let refused = node
        .client
        .generate_token(&acme.secret, &bad_scope)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some("bad_request"));
    let channel_with_conversation = TokenRequest {
        conversation_id: Some(conversation_id),
        ..TokenRequest::channel_scope()
    };
    let refused = node
        .client
        .generate_token(&acme.secret, &channel_with_conversation)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some("bad_request"));
}

#[tokio::test]
async fn refresh_keeps_the_claims_and_expired_tokens_are_refused() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "u-1").await;
    let original = claims_of(&node, &token);

    let refreshed: TokenResponse = node.client.refresh_token(&token).await.unwrap();
    let renewed = claims_of(&node, &refreshed.token);
    assert_eq!(
        Claims {
            exp: 0,
            iat: 0,
            ..renewed.clone()
        },
        Claims {
            exp: 0,
            iat: 0,
            ..original.clone()
        }
    );
    assert!(renewed.exp >= original.exp);

    let expired = node
        .server
        .state()
        .tokens
        .sign(&Claims {
            exp: chrono::Utc::now().timestamp() - 5,
            ..original.clone()
        })
        .unwrap();
    for request in [
        node.http
            .post(node.url("/api/v1/converger/tokens/refresh"))
            .bearer_auth(&expired),
        node.http
            .get(activities_url(&node, conversation_id))
            .bearer_auth(&expired),
        node.http
            .post(activities_url(&node, conversation_id))
            .bearer_auth(&expired)
            .json(&json!({"type": "text", "data": {"text": "x"}})),
    ] {
        let (status, body) = call(request).await;
        assert_eq!(
            (status, error_code(&body)),
            (StatusCode::UNAUTHORIZED, "token_expired")
        );
    }

    // Signed with another key, or not a converger token: unauthorized.
    let other_keys =
        converger_gateway::tokens::TokenKeys::new(b"another-secret-key-0123456789abcdef", 60)
            .unwrap();
    let forged = other_keys.sign(&original).unwrap();
    let not_converger = node
        .server
        .state()
        .tokens
        .sign(&Claims {
            token_type: "other".into(),
            ..original
        })
        .unwrap();
    for bad in [forged.as_str(), not_converger.as_str(), "garbage"] {
        let (status, body) = call(
            node.http
                .get(activities_url(&node, conversation_id))
                .bearer_auth(bad),
        )
        .await;
        assert_eq!(
            (status, error_code(&body)),
            (StatusCode::UNAUTHORIZED, "unauthorized")
        );
    }
    assert_eq!(node.db.count("SELECT count(*) FROM activities").await, 0);
}

#[tokio::test]
async fn deactivated_channel_refuses_its_secret_and_tokens_until_reactivated() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "u-1").await;
    let frame = json!({"type": "text", "data": {"text": "hello"}});
    node.client
        .post_activity(&token, conversation_id, &frame, None)
        .await
        .unwrap();

    let updated = node
        .client
        .set_channel_status(&acme.api_key, acme.channel_id, "inactive")
        .await
        .unwrap();
    assert_eq!(updated.status, "inactive");

    let refused = node
        .client
        .generate_token(&acme.secret, &TokenRequest::default())
        .await
        .unwrap_err();
    assert_eq!(
        (refused.status(), refused.code()),
        (Some(StatusCode::FORBIDDEN), Some("channel_inactive"))
    );
    let refused = node
        .client
        .post_activity(&token, conversation_id, &frame, None)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some("channel_inactive"));
    let refused = node
        .client
        .list_activities(&token, conversation_id, 0, 10)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Some("channel_inactive"));
    let refused = node.client.refresh_token(&token).await.unwrap_err();
    assert_eq!(refused.code(), Some("channel_inactive"));
    let refused = node.client.create_conversation(&token).await.unwrap_err();
    assert_eq!(refused.code(), Some("channel_inactive"));
    assert_eq!(node.db.count("SELECT count(*) FROM activities").await, 1);

    node.client
        .set_channel_status(&acme.api_key, acme.channel_id, "active")
        .await
        .unwrap();
    let posted = node
        .client
        .post_activity(&token, conversation_id, &frame, None)
        .await
        .unwrap();
    assert_eq!(posted.seq, 2);
}

#[tokio::test]
async fn conversations_bind_tokens_and_verified_users_win() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;

    let verified = node
        .client
        .generate_token(&acme.secret, &TokenRequest::for_user("alice"))
        .await
        .unwrap();
    let request = node
        .http
        .post(node.url("/api/v1/converger/conversations"))
        .bearer_auth(&verified.token);
    let (status, body) = call(request.json(&json!({"userId": "mallory"}))).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(body["userId"], "alice");
    let conversation_id: Uuid = body["conversationId"].as_str().unwrap().parse().unwrap();
    let bound = claims_of(&node, body["token"].as_str().unwrap());
    assert_eq!(bound.conversation_id, Some(conversation_id));
    assert_eq!(bound.user_id.as_deref(), Some("alice"));

    // A token naming no user cannot create a conversation for one (ADR 0013); with nothing
    // asserted the user is anonymous.
    let anonymous = node
        .client
        .generate_token(&acme.secret, &TokenRequest::default())
        .await
        .unwrap();
    let request = node
        .http
        .post(node.url("/api/v1/converger/conversations"))
        .bearer_auth(&anonymous.token);
    let (status, body) = call(request.json(&json!({"userId": "bob"}))).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(body["error"]["code"], "forbidden");
    let created = node
        .client
        .create_conversation(&anonymous.token)
        .await
        .unwrap();
    assert!(created.user_id.starts_with("anon-"));

    // A channel-scope token's user id names the agent, never the conversation's end user.
    let agent_request = TokenRequest {
        user: Some(json!({"id": "bot-1"})),
        ..TokenRequest::channel_scope()
    };
    let agent = node
        .client
        .generate_token(&acme.secret, &agent_request)
        .await
        .unwrap();
    let request = node
        .http
        .post(node.url("/api/v1/converger/conversations"))
        .bearer_auth(&agent.token);
    let (status, on_behalf) = call(request.json(&json!({"userId": "carol"}))).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(on_behalf["userId"], "carol");

    // A token bound to one conversation cannot open others.
    let refused = node
        .client
        .create_conversation(&created.token)
        .await
        .unwrap_err();
    assert_eq!(
        (refused.status(), refused.code()),
        (Some(StatusCode::FORBIDDEN), Some("forbidden"))
    );
    assert_eq!(node.db.count("SELECT count(*) FROM conversations").await, 3);
    assert_eq!(
        node.db
            .count("SELECT count(*) FROM conversation_runtime WHERE version = 0")
            .await,
        3
    );
}

#[tokio::test]
async fn posted_frames_are_listed_with_server_fields_and_paged() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    for n in 1..=5 {
        let frame = json!({"type": "text", "data": {"text": format!("m{n}")}, "metadata": {"n": n}, "actions": [n], "seq": 999, "from": "bot"});
        let posted = node
            .client
            .post_activity(&token, conversation_id, &frame, Some(&format!("c-{n}")))
            .await
            .unwrap();
        assert_eq!(posted.seq, n);
    }
    let page = node
        .client
        .list_activities(&token, conversation_id, 0, 2)
        .await
        .unwrap();
    assert_eq!(page.activities.len(), 2);
    assert!(page.has_more);
    assert_eq!(page.watermark, 2);
    let first = &page.activities[0];
    assert_eq!(first["type"], "text");
    assert_eq!(first["seq"], 1);
    assert_eq!(first["from"], "user");
    assert_eq!(first["sender"], json!({"id": "alice", "role": "user"}));
    assert_eq!(first["data"], json!({"text": "m1"}));
    assert_eq!(first["metadata"], json!({"n": 1}));
    assert_eq!(first["actions"], json!([1]));
    assert_eq!(first["clientId"], "c-1");
    assert!(first["timestamp"].as_i64().unwrap() > 1_700_000_000_000);
    assert!(first["id"].as_str().unwrap().parse::<Uuid>().is_ok());

    let rest = node
        .client
        .list_activities(&token, conversation_id, page.watermark, 1000)
        .await
        .unwrap();
    assert_eq!(
        rest.activities
            .iter()
            .map(|f| f["seq"].as_i64().unwrap())
            .collect::<Vec<_>>(),
        vec![3, 4, 5]
    );
    assert!(!rest.has_more);
    let empty = node
        .client
        .list_activities(&token, conversation_id, 5, 10)
        .await
        .unwrap();
    assert!(empty.activities.is_empty());
    assert_eq!(empty.watermark, 5);

    // An agent sees the end user's frames as "user" and no clientId.
    let agent = node
        .client
        .generate_token(&acme.secret, &TokenRequest::channel_scope())
        .await
        .unwrap();
    let agent_view = node
        .client
        .list_activities(&agent.token, conversation_id, 0, 1)
        .await
        .unwrap();
    assert_eq!(agent_view.activities[0]["from"], "user");
    assert!(agent_view.activities[0].get("clientId").is_none());

    // Every user frame opened a pending turn at revision 0.
    let turns = node
        .db
        .count("SELECT count(*) FROM turns WHERE status = 'pending' AND revision = 0")
        .await;
    assert_eq!(turns, 5);
    assert_eq!(node.db.count("SELECT count(*) FROM outbox").await, 5);
}

#[tokio::test]
async fn list_parameters_are_checked() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    for query in [
        "limit=0",
        "limit=1001",
        "limit=abc",
        "watermark=-1",
        "watermark=1.5",
    ] {
        let url = format!("{}?{query}", activities_url(&node, conversation_id));
        let (status, body) = call(node.http.get(url).bearer_auth(&token)).await;
        assert_eq!(
            (status, error_code(&body)),
            (StatusCode::BAD_REQUEST, "bad_request"),
            "{query}"
        );
    }
    let url = format!("{}?limit=1000", activities_url(&node, conversation_id));
    let (status, _) = call(node.http.get(url).bearer_auth(&token)).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn agent_posts_are_not_turns_and_read_as_bot() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, user_token) = node.conversation(&acme, "alice").await;
    let agent = node
        .client
        .generate_token(&acme.secret, &TokenRequest::channel_scope())
        .await
        .unwrap();
    let frame = json!({"type": "interrupt", "id": "int-1", "data": {"question": "ok?"}});
    let posted = node
        .client
        .post_activity(&agent.token, conversation_id, &frame, Some("a-1"))
        .await
        .unwrap();
    assert_eq!(posted.id, "int-1");
    let page = node
        .client
        .list_activities(&user_token, conversation_id, 0, 10)
        .await
        .unwrap();
    assert_eq!(page.activities[0]["from"], "bot");
    assert_eq!(
        page.activities[0]["sender"],
        json!({"id": "agent", "role": "agent"})
    );
    assert_eq!(node.db.count("SELECT count(*) FROM turns").await, 0);
}

#[tokio::test]
async fn idempotent_post_returns_the_original_and_stores_once() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    let url = activities_url(&node, conversation_id);
    let frame = json!({"type": "text", "data": {"text": "once"}});
    let first = node
        .http
        .post(&url)
        .bearer_auth(&token)
        .header("x-idempotency-key", "key-1")
        .json(&frame);
    let (status_first, body_first) = call(first).await;
    let second = node
        .http
        .post(&url)
        .bearer_auth(&token)
        .header("x-idempotency-key", "key-1")
        .json(&json!({"type": "text", "data": {"text": "changed"}}));
    let (status_second, body_second) = call(second).await;
    assert_eq!(status_first, StatusCode::CREATED);
    assert_eq!(status_second, StatusCode::OK);
    assert_eq!(body_first, body_second);
    assert_eq!(node.db.count("SELECT count(*) FROM activities").await, 1);
    assert_eq!(node.db.count("SELECT last_seq FROM conversations").await, 1);

    // The key is per sender: the same key from an agent is a different frame.
    let agent = node
        .client
        .generate_token(&acme.secret, &TokenRequest::channel_scope())
        .await
        .unwrap();
    let posted = node
        .client
        .post_activity(&agent.token, conversation_id, &frame, Some("key-1"))
        .await
        .unwrap();
    assert_eq!(posted.seq, 2);
}

#[tokio::test]
async fn concurrent_same_key_posts_store_one_frame_and_burn_no_seq() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    let frame = json!({"type": "text", "data": {"text": "race"}});
    let posts = (0..20).map(|_| {
        node.client
            .post_activity(&token, conversation_id, &frame, Some("same-key"))
    });
    let answers = futures::future::join_all(posts).await;
    let answers: Vec<_> = answers
        .into_iter()
        .map(|answer| answer.expect("every racer gets an answer"))
        .collect();
    assert!(answers.iter().all(|answer| *answer == answers[0]));
    assert_eq!(answers[0].seq, 1);
    let next = node
        .client
        .post_activity(&token, conversation_id, &frame, None)
        .await
        .unwrap();
    assert_eq!(next.seq, 2, "no seq was burned by the losers");
}

#[tokio::test]
async fn fifty_concurrent_posts_get_seqs_one_to_fifty() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    let posts = (0..50).map(|n| {
        let frame = json!({"type": "text", "data": {"text": format!("m{n}")}});
        let client = node.client.clone();
        let token = token.clone();
        tokio::spawn(async move {
            client
                .post_activity(&token, conversation_id, &frame, Some(&format!("k-{n}")))
                .await
        })
    });
    let mut seqs: Vec<i64> = Vec::new();
    for joined in futures::future::join_all(posts).await {
        seqs.push(joined.unwrap().expect("post succeeds").seq);
    }
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=50).collect::<Vec<i64>>());
    let listed = node
        .client
        .list_activities(&token, conversation_id, 0, 1000)
        .await
        .unwrap();
    let listed_seqs: Vec<i64> = listed
        .activities
        .iter()
        .map(|f| f["seq"].as_i64().unwrap())
        .collect();
    assert_eq!(listed_seqs, (1..=50).collect::<Vec<i64>>());
}

#[tokio::test]
async fn conversations_are_isolated_across_channels_tenants_and_users() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let globex = node.tenant_with_channel("globex").await;
    let (alice_conversation, alice_token) = node.conversation(&acme, "alice").await;
    let (_, bob_token) = node.conversation(&acme, "bob").await;
    node.client
        .post_activity(
            &alice_token,
            alice_conversation,
            &json!({"type": "text", "data": {"text": "private"}}),
            None,
        )
        .await
        .unwrap();

    let globex_agent = node
        .client
        .generate_token(&globex.secret, &TokenRequest::channel_scope())
        .await
        .unwrap();
    let bob_user_wide = node
        .client
        .generate_token(&acme.secret, &TokenRequest::for_user("bob"))
        .await
        .unwrap();
    let alice_user_wide = node
        .client
        .generate_token(&acme.secret, &TokenRequest::for_user("alice"))
        .await
        .unwrap();
    let frame = json!({"type": "text", "data": {"text": "intrusion"}});
    for outsider in [&globex_agent.token, &bob_token, &bob_user_wide.token] {
        let listed = node
            .client
            .list_activities(outsider, alice_conversation, 0, 10)
            .await
            .unwrap_err();
        assert_eq!(
            (listed.status(), listed.code()),
            (Some(StatusCode::NOT_FOUND), Some("conversation_not_found"))
        );
        let posted = node
            .client
            .post_activity(outsider, alice_conversation, &frame, None)
            .await
            .unwrap_err();
        assert_eq!(posted.code(), Some("conversation_not_found"));
    }
    // A missing conversation looks the same as a foreign one.
    let missing = node
        .client
        .list_activities(&bob_token, Uuid::new_v4(), 0, 10)
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Some("conversation_not_found"));
    assert_eq!(node.db.count("SELECT count(*) FROM activities").await, 1);

    // Alice's user-wide token reads her own conversation.
    let page = node
        .client
        .list_activities(&alice_user_wide.token, alice_conversation, 0, 10)
        .await
        .unwrap();
    assert_eq!(page.activities.len(), 1);
}

#[tokio::test]
async fn bad_frames_get_their_codes_and_store_nothing() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    let url = activities_url(&node, conversation_id);
    let big_text = "x".repeat(5_000);
    let oversized_body = format!(
        "{{\"type\":\"text\",\"data\":{{\"text\":\"{}\"}}}}",
        "y".repeat(20_000)
    );
    let cases: Vec<(String, StatusCode, &str)> = vec![
        ("{broken".into(), StatusCode::BAD_REQUEST, "bad_request"),
        ("[1,2]".into(), StatusCode::BAD_REQUEST, "invalid_message"),
        (
            "{\"data\":{\"text\":\"x\"}}".into(),
            StatusCode::BAD_REQUEST,
            "invalid_message",
        ),
        (
            "{\"type\":\"ack\",\"data\":{}}".into(),
            StatusCode::BAD_REQUEST,
            "invalid_message",
        ),
        (
            "{\"type\":\"text\",\"data\":\"x\"}".into(),
            StatusCode::BAD_REQUEST,
            "invalid_message",
        ),
        (
            "{\"type\":\"text\",\"data\":{\"text\":7}}".into(),
            StatusCode::BAD_REQUEST,
            "invalid_message",
        ),
        (
            "{\"type\":\"text\",\"data\":{\"text\":\"x\"},\"clientId\":\"bad id\"}".into(),
            StatusCode::BAD_REQUEST,
            "invalid_message",
        ),
        (
            format!("{{\"type\":\"text\",\"data\":{{\"text\":\"{big_text}\"}}}}"),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        (
            format!(
                "{{\"type\":\"text\",\"data\":{{\"text\":\"x\"}},\"metadata\":{{\"k\":\"{}\"}}}}",
                "m".repeat(2_000)
            ),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        (
            oversized_body,
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
    ];
    for (body, expected_status, expected_code) in cases {
        let request = node
            .http
            .post(&url)
            .bearer_auth(&token)
            .header("content-type", "application/json")
            .body(body.clone());
        let (status, answer) = call(request).await;
        let shown: String = body.chars().take(60).collect();
        assert_eq!(
            (status, error_code(&answer)),
            (expected_status, expected_code),
            "{shown}"
        );
    }
    let request = node
        .http
        .post(&url)
        .bearer_auth(&token)
        .header("x-idempotency-key", "spaces are bad");
    let (status, answer) =
        call(request.json(&json!({"type": "text", "data": {"text": "x"}}))).await;
    assert_eq!(
        (status, error_code(&answer)),
        (StatusCode::BAD_REQUEST, "bad_request")
    );

    assert_eq!(node.db.count("SELECT count(*) FROM activities").await, 0);
    assert_eq!(node.db.count("SELECT last_seq FROM conversations").await, 0);
    assert_eq!(node.db.count("SELECT count(*) FROM outbox").await, 0);
}

#[tokio::test]
async fn group_commit_batch_sizes_are_counted_in_writes_not_seconds() {
    let node = TestNode::start().await;
    let fixture = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&fixture, "u1").await;
    let (status, _) = call(
        node.http
            .post(activities_url(&node, conversation_id))
            .bearer_auth(&token)
            .json(&json!({"type": "text", "data": {"text": "x"}})),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED);
    let metrics = node.metrics().await;
    let buckets: Vec<&str> = metrics
        .lines()
        .filter(|line| line.starts_with("converger_group_commit_writes_bucket"))
        .collect();
    for bound in ["1", "2", "16", "128"] {
        let series = format!("le=\"{bound}\"");
        assert!(
            buckets.iter().any(|line| line.contains(&series)),
            "no {series} bucket in {buckets:?}"
        );
    }
    assert!(
        !buckets.iter().any(|line| line.contains("le=\"0.0005\"")),
        "batch sizes got the latency buckets: {buckets:?}"
    );
}

#[tokio::test]
async fn health_metrics_and_unknown_routes() {
    let node = TestNode::start().await;
    let (status, body) = call(node.http.get(node.url("/health/live"))).await;
    assert_eq!(
        (status, body["status"].as_str()),
        (StatusCode::OK, Some("ok"))
    );
    let (status, _) = call(node.http.get(node.url("/health/ready"))).await;
    assert_eq!(status, StatusCode::OK);
    let (status, body) = call(node.http.get(node.url("/no/such/route"))).await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::NOT_FOUND, "not_found")
    );
    let (status, body) = call(node.http.delete(node.url("/api/v1/channels"))).await;
    assert_eq!(
        (status, error_code(&body)),
        (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed")
    );

    node.tenant_with_channel("acme").await;
    let metrics = node.metrics().await;
    for family in [
        "converger_http_requests_total",
        "converger_http_request_duration_seconds",
        "converger_db_query_seconds",
        "converger_db_pool_connections",
    ] {
        assert!(metrics.contains(family), "{family} missing from /metrics");
    }
    assert!(
        metrics.contains("route=\"/api/v1/channels\""),
        "requests are labelled by route template"
    );

    node.server.state().start_draining();
    let (status, body) = call(node.http.get(node.url("/health/ready"))).await;
    assert_eq!(
        (status, body["status"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("draining"))
    );
}

#[tokio::test]
async fn metrics_token_is_required_when_configured() {
    let node = TestNode::start_with(|config| config.metrics_token = "scrape-secret".into()).await;
    let (status, _) = call(node.http.get(node.url("/metrics"))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let response = node
        .http
        .get(node.url("/metrics"))
        .bearer_auth("scrape-secret")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
}

#[tokio::test]
async fn readiness_fails_without_the_database() {
    let node = TestNode::start().await;
    let (status, _) = call(node.http.get(node.url("/health/ready"))).await;
    assert_eq!(status, StatusCode::OK);
    node.server.state().store.pool().close().await;
    let (status, body) = call(node.http.get(node.url("/health/ready"))).await;
    assert_eq!(
        (status, body["status"].as_str()),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Some("database unavailable")
        )
    );
}
