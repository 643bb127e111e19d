//! docs/protocol.md §§1–2 over real sockets: the endpoint, credentials, hello and welcome.

mod support;

use converger_client::TokenRequest;
use converger_gateway::tokens::Claims;
use serde_json::json;
use support::ws::WsClient;
use support::{TestNode, seqs, setup};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use uuid::Uuid;

async fn post_text(node: &TestNode, token: &str, conversation_id: Uuid, text: &str) -> i64 {
    let frame = json!({"type": "text", "data": {"text": text}});
    node.client
        .post_activity(token, conversation_id, &frame, None)
        .await
        .expect("post")
        .seq
}

#[tokio::test]
async fn subprotocol_is_selected_when_offered_and_optional() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let offered = WsClient::connect_with(&node.ws_url(""), &["other", "converger.v1"], None).await;
    assert_eq!(offered.subprotocol.as_deref(), Some("converger.v1"));
    let mut none = WsClient::connect_with(&node.ws_url(""), &[], None).await;
    assert_eq!(none.subprotocol, None);
    let welcome = none.hello(&token, json!({})).await;
    assert_eq!(welcome["data"]["protocol"], "converger/1");
}

#[tokio::test]
async fn unsupported_subprotocols_plain_gets_and_draining_nodes_are_refused_over_http() {
    let node = TestNode::start().await;
    let mut request = node.ws_url("").into_client_request().unwrap();
    request
        .headers_mut()
        .insert("sec-websocket-protocol", "graphql-ws".parse().unwrap());
    let refused = tokio_tungstenite::connect_async(request)
        .await
        .expect_err("upgrade refused");
    let tokio_tungstenite::tungstenite::Error::Http(response) = refused else {
        panic!("http error expected: {refused}")
    };
    assert_eq!(response.status(), 400);

    let plain = node
        .http
        .get(node.url("/socket/converger/v1"))
        .send()
        .await
        .unwrap();
    assert_eq!(plain.status(), 426);

    node.server.state().start_draining();
    let refused = tokio_tungstenite::connect_async(node.ws_url(""))
        .await
        .expect_err("upgrade refused");
    let tokio_tungstenite::tungstenite::Error::Http(response) = refused else {
        panic!("http error expected")
    };
    assert_eq!(response.status(), 503);
    assert!(response.headers().get("retry-after").is_some());
}

#[tokio::test]
async fn each_credential_source_works_and_hello_token_wins() {
    let node = TestNode::start().await;
    let (_, conversation_id, token) = setup(&node).await;

    let mut by_query = WsClient::connect(&node.ws_url(&format!("?token={token}"))).await;
    by_query
        .send(json!({"type": "hello", "protocol": "converger/1"}))
        .await;
    assert_eq!(
        by_query.recv_type("welcome").await["data"]["conversationId"],
        conversation_id.to_string()
    );

    let mut by_header =
        WsClient::connect_with(&node.ws_url(""), &["converger.v1"], Some(&token)).await;
    by_header
        .send(json!({"type": "hello", "protocol": "converger/1"}))
        .await;
    assert_eq!(
        by_header.recv_type("welcome").await["data"]["conversationId"],
        conversation_id.to_string()
    );

    // hello.token first, then the query, then the header: a bad query token loses to hello's.
    let mut both = WsClient::connect(&node.ws_url("?token=garbage")).await;
    let welcome = both.hello(&token, json!({})).await;
    assert_eq!(
        welcome["data"]["conversationId"],
        conversation_id.to_string()
    );
}

#[tokio::test]
async fn missing_bad_and_expired_credentials_close_4401_after_the_upgrade() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let claims = node.server.state().tokens.verify(&token).unwrap();
    let expired = node
        .server
        .state()
        .tokens
        .sign(&Claims {
            exp: chrono::Utc::now().timestamp() - 10,
            ..claims
        })
        .unwrap();
    for credential in [None, Some("not-a-token".to_owned()), Some(expired)] {
        let mut client = WsClient::connect(&node.ws_url("")).await;
        let mut hello = json!({"type": "hello", "protocol": "converger/1"});
        if let Some(credential) = &credential {
            hello["token"] = json!(credential);
        }
        client.send(hello).await;
        let (frames, closed) = client.recv_until_closed().await;
        assert_eq!(frames.len(), 1, "{frames:?}");
        assert_eq!(frames[0]["type"], "error");
        assert_eq!(frames[0]["data"]["code"], "unauthorized");
        assert_eq!(frames[0]["data"]["number"], 2000);
        assert_eq!(closed.code, 4401);
    }
}

#[tokio::test]
async fn frames_before_hello_get_no_session_and_the_connection_stays() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client.send(json!({"type": "ping"})).await;
    let error = client.recv().await;
    assert_eq!(error["data"]["code"], "no_session");
    client
        .send(json!({"type": "text", "clientId": "early", "data": {"text": "x"}}))
        .await;
    assert_eq!(client.recv().await["data"]["code"], "no_session");
    let welcome = client.hello(&token, json!({})).await;
    assert_eq!(welcome["data"]["watermark"], 0);
    assert_eq!(node.db.count("SELECT count(*) FROM activities").await, 0);
}

#[tokio::test]
async fn frames_sent_right_after_hello_are_processed_in_order_after_welcome() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client
        .send(json!({"type": "hello", "protocol": "converger/1", "token": token}))
        .await;
    client
        .send(json!({"type": "text", "clientId": "a", "data": {"text": "1"}}))
        .await;
    client
        .send(json!({"type": "text", "clientId": "b", "data": {"text": "2"}}))
        .await;
    client
        .send(json!({"type": "hello", "protocol": "converger/1", "token": "ignored"}))
        .await;
    let frames = client.recv_until("ack").await;
    assert_eq!(frames[0]["type"], "welcome");
    assert_eq!(frames.last().unwrap()["clientId"], "a");
    let second = client.recv_type("ack").await;
    assert_eq!(
        (second["clientId"].as_str(), second["seq"].as_i64()),
        (Some("b"), Some(2))
    );
    // The second hello was ignored: the session still answers.
    assert!(client.barrier().await.is_empty());
}

#[tokio::test]
async fn protocol_field_selects_the_profile() {
    let node = TestNode::start().await;
    let (_, _, token) = setup(&node).await;
    let mut mekik = WsClient::connect_with(&node.ws_url(""), &[], None).await;
    mekik.send(json!({"type": "hello", "token": token})).await;
    let welcome = mekik.recv().await;
    assert_eq!(welcome["data"]["protocol"], "mekik/1");

    // A wrongly typed protocol is absent: mekik again.
    let mut typed = WsClient::connect(&node.ws_url("")).await;
    typed
        .send_invalid(json!({"type": "hello", "protocol": 1, "token": token}))
        .await;
    assert_eq!(typed.recv().await["data"]["protocol"], "mekik/1");

    let mut unknown = WsClient::connect(&node.ws_url("")).await;
    unknown
        .send_invalid(json!({"type": "hello", "protocol": "converger/9", "token": token}))
        .await;
    let (frames, closed) = unknown.recv_until_closed().await;
    assert_eq!(frames[0]["data"]["code"], "unsupported_protocol");
    assert_eq!(closed.code, 4400);
}

#[tokio::test]
async fn bound_tokens_pin_the_conversation_and_asserted_ids_are_ignored() {
    let node = TestNode::start().await;
    let (acme, conversation_id, token) = setup(&node).await;
    let (other_conversation, _) = node.conversation(&acme, "alice").await;
    let mut client = WsClient::connect(&node.ws_url("")).await;
    let welcome = client
        .hello(
            &token,
            json!({"conversationId": other_conversation.to_string(), "userId": "mallory"}),
        )
        .await;
    assert_eq!(
        welcome["data"]["conversationId"],
        conversation_id.to_string()
    );
    assert_eq!(welcome["data"]["userId"], "alice");
}

#[tokio::test]
async fn a_watermark_asserted_for_another_conversation_is_reset() {
    let node = TestNode::start().await;
    let (acme, conversation_id, token) = setup(&node).await;
    let (other_conversation, _) = node.conversation(&acme, "alice").await;
    post_text(&node, &token, conversation_id, "m1").await;
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client
        .hello(
            &token,
            json!({"conversationId": other_conversation.to_string(), "watermark": 1}),
        )
        .await;
    assert_eq!(
        seqs(&client.barrier().await),
        vec![1],
        "replayed from 0 in the bound conversation"
    );
}

#[tokio::test]
async fn asserted_conversations_are_adopted_only_within_channel_and_user() {
    let node = TestNode::start().await;
    let (acme, alice_conversation, _) = setup(&node).await;
    let alice = node.token(&acme, &TokenRequest::for_user("alice")).await;
    let bob = node.token(&acme, &TokenRequest::for_user("bob")).await;
    let anonymous = node.token(&acme, &TokenRequest::default()).await;
    let asserted = json!({"conversationId": alice_conversation.to_string(), "userId": "eve"});

    let mut as_alice = WsClient::connect(&node.ws_url("")).await;
    let welcome = as_alice.hello(&alice, asserted.clone()).await;
    assert_eq!(
        welcome["data"]["conversationId"],
        alice_conversation.to_string()
    );
    assert_eq!(welcome["data"]["userId"], "alice");

    // Another verified user gets a new conversation of their own.
    let mut as_bob = WsClient::connect(&node.ws_url("")).await;
    let welcome = as_bob.hello(&bob, asserted.clone()).await;
    assert_ne!(
        welcome["data"]["conversationId"],
        alice_conversation.to_string()
    );
    assert_eq!(welcome["data"]["userId"], "bob");

    // A token naming no user never joins a named user's conversation (ADR 0013), whatever it
    // asserts: it gets a new anonymous conversation, and the asserted user is not taken.
    let mut anonymous_client = WsClient::connect(&node.ws_url("")).await;
    let welcome = anonymous_client.hello(&anonymous, asserted.clone()).await;
    assert_ne!(
        welcome["data"]["conversationId"],
        alice_conversation.to_string()
    );
    let anonymous_user = welcome["data"]["userId"].as_str().unwrap().to_owned();
    assert!(anonymous_user.starts_with("anon-"), "{anonymous_user}");
    let anonymous_conversation = welcome["data"]["conversationId"].clone();
    assert!(replayed_nothing_of_alice(&mut anonymous_client).await);

    // It rejoins its own anonymous conversation by presenting the anonymous id it was given;
    // another anonymous token guessing the conversation without that id gets a new one.
    let rejoin = json!({"conversationId": anonymous_conversation, "userId": anonymous_user});
    let mut again = WsClient::connect(&node.ws_url("")).await;
    let welcome = again.hello(&anonymous, rejoin).await;
    assert_eq!(welcome["data"]["conversationId"], anonymous_conversation);
    assert_eq!(welcome["data"]["userId"], anonymous_user.as_str());
    let mut guesser = WsClient::connect(&node.ws_url("")).await;
    let welcome = guesser
        .hello(
            &anonymous,
            json!({"conversationId": anonymous_conversation}),
        )
        .await;
    assert_ne!(welcome["data"]["conversationId"], anonymous_conversation);

    // Another channel's conversation is never adopted, and the asserted user is not taken.
    let globex = node.tenant_with_channel("globex").await;
    let foreign = node.token(&globex, &TokenRequest::default()).await;
    let mut outsider = WsClient::connect(&node.ws_url("")).await;
    let welcome = outsider
        .hello(
            &foreign,
            json!({"conversationId": alice_conversation.to_string(), "userId": "eve"}),
        )
        .await;
    assert_ne!(
        welcome["data"]["conversationId"],
        alice_conversation.to_string()
    );
    assert!(
        welcome["data"]["userId"]
            .as_str()
            .unwrap()
            .starts_with("anon-")
    );
    // Not even by a token of that other channel naming the same user.
    let foreign_alice = node.token(&globex, &TokenRequest::for_user("alice")).await;
    let mut namesake = WsClient::connect(&node.ws_url("")).await;
    let welcome = namesake
        .hello(
            &foreign_alice,
            json!({"conversationId": alice_conversation.to_string()}),
        )
        .await;
    assert_ne!(
        welcome["data"]["conversationId"],
        alice_conversation.to_string()
    );
    assert_eq!(welcome["data"]["userId"], "alice");
    // Alice's conversation still has only alice's frames, and nobody else wrote into it.
    assert_eq!(
        node.db
            .count(&format!(
                "SELECT count(*) FROM activities WHERE conversation_id = '{alice_conversation}' AND sender_id <> 'alice'"
            ))
            .await,
        0
    );
}

/// True when the connection's replay holds no frame (a new conversation).
async fn replayed_nothing_of_alice(client: &mut WsClient) -> bool {
    seqs(&client.barrier().await).is_empty()
}

#[tokio::test]
async fn query_fields_are_used_and_hello_fields_win() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let anonymous = node.token(&acme, &TokenRequest::default()).await;
    // An anonymous conversation, and its anonymous user id, as a widget would have kept them.
    let mut first = WsClient::connect(&node.ws_url("")).await;
    let welcome = first.hello(&anonymous, json!({})).await;
    let conversation_id: Uuid = welcome["data"]["conversationId"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let user_id = welcome["data"]["userId"].as_str().unwrap().to_owned();
    for n in 1..=3 {
        first
            .send(json!({"type": "text", "clientId": format!("m{n}"), "data": {"text": format!("m{n}")}}))
            .await;
        first.recv_type("ack").await;
    }
    let query =
        format!("?token={anonymous}&conversationId={conversation_id}&userId={user_id}&watermark=1");
    let mut from_query = WsClient::connect(&node.ws_url(&query)).await;
    from_query
        .send(json!({"type": "hello", "protocol": "converger/1"}))
        .await;
    let frames = from_query.recv_until("welcome").await;
    assert_eq!(
        frames.last().unwrap()["data"]["conversationId"],
        conversation_id.to_string()
    );
    assert_eq!(seqs(&from_query.barrier().await), vec![2, 3]);

    let mut hello_wins = WsClient::connect(&node.ws_url(&query)).await;
    hello_wins
        .send(json!({"type": "hello", "protocol": "converger/1", "watermark": 2}))
        .await;
    hello_wins.recv_type("welcome").await;
    assert_eq!(seqs(&hello_wins.barrier().await), vec![3]);
}

#[tokio::test]
async fn welcome_announces_the_head_limits_and_expiry_then_replays_after_the_watermark() {
    let node = TestNode::start_with(|config| config.limits.replay_max = 1000).await;
    let (_, conversation_id, token) = setup(&node).await;
    for n in 1..=5 {
        post_text(&node, &token, conversation_id, &format!("m{n}")).await;
    }
    let mut client = WsClient::connect(&node.ws_url("")).await;
    let welcome = client.hello(&token, json!({"watermark": 2})).await;
    let data = &welcome["data"];
    assert_eq!(data["scope"], "conversation");
    assert_eq!(data["compat"], json!(["mekik/1"]));
    assert_eq!(data["watermark"], 5);
    assert_eq!(data["pending"], json!([]));
    assert!(
        data["connectionId"]
            .as_str()
            .unwrap()
            .parse::<Uuid>()
            .is_ok()
    );
    let claims = node.server.state().tokens.verify(&token).unwrap();
    assert_eq!(data["expiresAt"].as_i64(), Some(claims.exp * 1000));
    let limits = &node.server.state().config.limits;
    assert_eq!(
        data["limits"]["maxFrameBytes"].as_u64(),
        Some(limits.max_frame_bytes as u64)
    );
    assert_eq!(data["limits"]["replayMax"], 1000);
    assert_eq!(data["limits"]["helloTimeoutMs"], 10_000);
    assert!(data["limits"].get("maxConversations").is_none());
    for capability in ["acks", "typing", "receipts"] {
        assert_eq!(data["capabilities"][capability], true, "{capability}");
    }
    // Nothing sends a conversation's one user presence yet (tests/mekik.rs).
    assert_eq!(data["capabilities"]["presence"], false);
    let replayed = client.barrier().await;
    assert_eq!(seqs(&replayed), vec![3, 4, 5]);
    assert!(replayed.iter().all(|frame| frame["from"] == "user"));
}

#[tokio::test]
async fn watermark_above_the_head_is_refused_without_replay_and_the_session_stays() {
    let node = TestNode::start().await;
    let (_, conversation_id, token) = setup(&node).await;
    post_text(&node, &token, conversation_id, "m1").await;
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client.hello(&token, json!({"watermark": 9})).await;
    let after_welcome = client.barrier().await;
    assert_eq!(after_welcome.len(), 1, "{after_welcome:?}");
    assert_eq!(after_welcome[0]["data"]["code"], "invalid_watermark");
    // Live frames continue after the head.
    post_text(&node, &token, conversation_id, "m2").await;
    assert_eq!(client.recv().await["seq"], 2);
}

#[tokio::test]
async fn a_new_conversation_ignores_the_asserted_watermark() {
    let node = TestNode::start().await;
    let (acme, _, _) = setup(&node).await;
    let bob = node.token(&acme, &TokenRequest::for_user("bob")).await;
    let mut client = WsClient::connect(&node.ws_url("")).await;
    let welcome = client
        .hello(
            &bob,
            json!({"conversationId": Uuid::new_v4().to_string(), "watermark": 40}),
        )
        .await;
    assert_eq!(welcome["data"]["watermark"], 0);
    assert!(
        client.barrier().await.is_empty(),
        "no invalid_watermark for a watermark that was reset"
    );
}

#[tokio::test]
async fn replay_is_capped_by_replay_max_with_replay_truncated_but_not_for_mekik() {
    let node = TestNode::start_with(|config| {
        config.limits.replay_max = 3;
        config.limits.replay_batch = 2;
    })
    .await;
    let (_, conversation_id, token) = setup(&node).await;
    for n in 1..=7 {
        post_text(&node, &token, conversation_id, &format!("m{n}")).await;
    }
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client.hello(&token, json!({"watermark": 1})).await;
    let frames = client.barrier().await;
    assert_eq!(seqs(&frames), vec![2, 3, 4]);
    let truncated = frames.last().unwrap();
    assert_eq!(truncated["type"], "replayTruncated");
    assert_eq!(truncated["data"], json!({"watermark": 4, "headSeq": 7}));
    // Live frames continue after the head; the client fetches 5..=7 with sync.
    post_text(&node, &token, conversation_id, "m8").await;
    assert_eq!(client.recv().await["seq"], 8);
    client.send(json!({"type": "sync", "watermark": 4})).await;
    assert_eq!(seqs(&client.barrier().await), vec![5, 6, 7]);

    let mut mekik = WsClient::connect_with(&node.ws_url(""), &[], None).await;
    mekik
        .send(json!({"type": "hello", "token": token, "watermark": 1}))
        .await;
    assert_eq!(mekik.recv().await["type"], "welcome");
    let mut replayed = Vec::new();
    while replayed.len() < 7 {
        replayed.push(mekik.recv().await["seq"].as_i64().unwrap());
    }
    assert_eq!(replayed, vec![2, 3, 4, 5, 6, 7, 8]);
}

#[tokio::test]
async fn welcome_lists_open_interrupts_and_sends_the_channel_catalogs() {
    let node = TestNode::start().await;
    let (acme, conversation_id, token) = setup(&node).await;
    let agent = node.agent_token(&acme).await;
    for frame in [
        json!({"type": "interrupt", "id": "int-1", "data": {"question": "a?"}}),
        json!({"type": "interrupt", "id": "int-2", "data": {"question": "b?"}}),
        json!({"type": "interrupt_resolved", "id": "int-1", "data": {"answer": "yes"}}),
        json!({"type": "interrupt", "id": "int-0", "data": {"question": "c?"}}),
    ] {
        node.client
            .post_activity(&agent, conversation_id, &frame, None)
            .await
            .unwrap();
    }
    let mut db = node.db.connect().await;
    sqlx::query(
        "UPDATE channels SET settings = jsonb_build_object(
             'genui_components', jsonb_build_object('hash', 'h1', 'components', jsonb_build_array('card')),
             'skills', jsonb_build_object('hash', 's1', 'skills', jsonb_build_array('search')))",
    )
    .execute(&mut db)
    .await
    .unwrap();

    let mut client = WsClient::connect(&node.ws_url("")).await;
    let welcome = client
        .hello(&token, json!({"watermark": 4, "skillsHash": "s1"}))
        .await;
    // Oldest first, by seq: not by id.
    assert_eq!(
        welcome["data"]["pending"],
        json!([
            {"id": "int-2", "data": {"question": "b?"}},
            {"id": "int-0", "data": {"question": "c?"}}
        ])
    );
    let after = client.barrier().await;
    assert_eq!(
        after[0],
        json!({"type": "genui_components", "hash": "h1", "components": ["card"]})
    );
    assert_eq!(
        after[1],
        json!({"type": "skills", "hash": "s1", "unchanged": true})
    );
    assert_eq!(after.len(), 2);
}
