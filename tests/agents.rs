//! Agents on channel-scope sockets: observers, groups, ownership, takeover and one-transaction
//! turn results, over real sockets against a real Postgres.

mod support;

use std::time::Duration;

use converger_core::groups::GroupView;
use serde_json::{Value, json};
use support::cluster::{eventually, member_connections};
use support::ws::WsClient;
use support::{TenantFixture, TestNode};
use uuid::Uuid;

async fn agent_token(node: &TestNode, fixture: &TenantFixture) -> String {
    node.agent_token(fixture).await
}

async fn agent(node: &TestNode, token: &str, group: Option<&str>) -> (WsClient, Value) {
    node.agent(token, group).await
}

async fn user(node: &TestNode, fixture: &TenantFixture, name: &str) -> (WsClient, Uuid) {
    let (conversation_id, token) = node.conversation(fixture, name).await;
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client.hello(&token, json!({})).await;
    (client, conversation_id)
}

async fn say(client: &mut WsClient, client_id: &str, text: &str) -> i64 {
    client
        .send(json!({"type": "text", "clientId": client_id, "data": {"text": text}}))
        .await;
    client.recv_until("ack").await.last().unwrap()["seq"]
        .as_i64()
        .unwrap()
}

/// Reads enveloped turns until `count` have arrived.
async fn turns(client: &mut WsClient, count: usize) -> Vec<Value> {
    let mut seen = Vec::new();
    while seen.len() < count {
        let envelope = client.recv().await;
        if envelope["frame"]["type"] == "text" {
            seen.push(envelope);
        }
    }
    seen
}

/// The next enveloped frame of `kind` (skipping heartbeats and other types).
async fn delivery(client: &mut WsClient, kind: &str) -> (Uuid, Value) {
    loop {
        let envelope = client.recv().await;
        if let Some(frame) = envelope.get("frame")
            && frame["type"] == kind
        {
            let conversation_id = envelope["conversationId"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap();
            return (conversation_id, frame.clone());
        }
    }
}

/// A conversation, with its bound token, that `owner` owns among `members` (their welcomes),
/// found by the same rendezvous rule the server applies.
async fn conversation_owned_by(
    node: &TestNode,
    fixture: &TenantFixture,
    members: &[&Value],
    owner: &Value,
) -> (Uuid, String) {
    let mut view = GroupView::new();
    for welcome in members {
        view.join(
            welcome["data"]["connectionId"].as_str().unwrap(),
            welcome["data"]["since"].as_i64().unwrap(),
        );
    }
    let owner_id = owner["data"]["connectionId"].as_str().unwrap();
    for n in 0..40 {
        let (conversation_id, token) = node.conversation(fixture, &format!("user-{n}")).await;
        let now = chrono::Utc::now().timestamp_millis();
        if view.owner(&conversation_id.to_string(), now) == Some(owner_id) {
            return (conversation_id, token);
        }
    }
    panic!("no conversation owned by {owner_id} among 40");
}

/// Two settled members of group "bot" and a user connected to a conversation the first owns.
struct TwoMembers {
    node: TestNode,
    token: String,
    first: WsClient,
    second: WsClient,
    client: WsClient,
    conversation_id: Uuid,
    /// The user's conversation-bound token.
    user_token: String,
}

async fn two_members_and_a_user_of_the_first() -> TwoMembers {
    let node = TestNode::start_with(fast_settle).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (first, welcome_first) = agent(&node, &token, Some("bot")).await;
    let (second, welcome_second) = agent(&node, &token, Some("bot")).await;
    support::settle(&welcome_first).await;
    support::settle(&welcome_second).await;
    let members = [&welcome_first, &welcome_second];
    let (conversation_id, user_token) =
        conversation_owned_by(&node, &acme, &members, &welcome_first).await;
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client.hello(&user_token, json!({})).await;
    TwoMembers {
        node,
        token,
        first,
        second,
        client,
        conversation_id,
        user_token,
    }
}

fn turn_result(client_id: &str, seq: i64, text: &str, runtime: Option<Value>) -> Value {
    let mut frame = json!({
        "type": "turnResult",
        "clientId": client_id,
        "turn": {"seq": seq, "revision": 0},
        "frames": [{"type": "text", "data": {"text": text}}],
    });
    if let Some(runtime) = runtime {
        frame["runtime"] = runtime;
    }
    frame
}

fn fast_settle(config: &mut converger_gateway::Config) {
    config.group_settle_ms = 150;
}

/// Channel `acme` on `node` and a settled member of its group `bot`.
async fn settled_bot(node: &TestNode) -> (TenantFixture, WsClient) {
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(node, &acme).await;
    let (bot, welcome) = agent(node, &token, Some("bot")).await;
    support::settle(&welcome).await;
    (acme, bot)
}

/// What this test process's nodes handed on after their agents' feed lagged: first deliveries
/// of turns, and regenerated revisions.
async fn read_back_after_lags(node: &TestNode) -> (u64, u64) {
    let metrics = node.metrics().await;
    let counter = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(0)
    };
    (
        counter("converger_agent_feed_read_back_turns_total"),
        counter("converger_agent_feed_read_back_regenerations_total"),
    )
}

/// A channel's agents whose live feed falls behind its buffer lose the overflow. The turns lost
/// with it are read back at once, not when their conversation gets its next frame: a user who
/// waits for the answer sends none. The feed holds one event here, so bursts of turns, then of
/// edits of those turns, then of regenerates, overflow it. Every turn, edit and regenerate must
/// arrive, once; without the read-back a lost one never does. The bursts go on until read-backs
/// handed on both a turn and a regenerated revision, and at least five ran; a burst of turns
/// comes last, so a revision handed on twice by the last regenerates is seen.
#[tokio::test]
async fn turns_lost_by_a_lagging_agent_feed_are_read_back_without_another_frame() {
    let node = TestNode::start_with(|config| {
        fast_settle(config);
        config.turns.agent_feed_buffer = 1;
    })
    .await;
    let (acme, mut bot) = settled_bot(&node).await;
    for burst in 0..20 {
        let mut users = Vec::new();
        for n in 0..16 {
            users.push(user(&node, &acme, &format!("user-{burst}-{n}")).await);
        }
        for (client, _) in &mut users {
            client
                .send(json!({"type": "text", "clientId": "t-1", "data": {"text": "hello"}}))
                .await;
        }
        expect_each_once(&mut bot, &users, 0).await;
        let (turns, regenerations) = read_back_after_lags(&node).await;
        if burst >= 5 && turns > 0 && regenerations > 0 {
            return;
        }
        let mut seqs = Vec::new();
        for (client, _) in &mut users {
            let seq = client.recv_until("ack").await.last().unwrap()["seq"].clone();
            client
                .send(
                    json!({"type": "edit", "clientId": "e-1", "seq": seq, "data": {"text": "hi"}}),
                )
                .await;
            seqs.push(seq);
        }
        expect_each_once(&mut bot, &users, 1).await;
        // A regenerate stores no frame: only its event, or the read-back, hands it on.
        for ((client, _), seq) in users.iter_mut().zip(&seqs) {
            client
                .send(json!({"type": "regenerate", "clientId": "g-1", "seq": seq}))
                .await;
        }
        expect_each_once(&mut bot, &users, 2).await;
    }
    panic!("the agents' feed did not lose both a turn and a regenerate in 20 bursts");
}

/// Each user's turn at `revision` reaches the agent once, and nothing else of theirs does.
async fn expect_each_once(bot: &mut WsClient, users: &[(WsClient, Uuid)], revision: i64) {
    let mut waiting: std::collections::HashSet<Uuid> = users
        .iter()
        .map(|(_, conversation_id)| *conversation_id)
        .collect();
    while !waiting.is_empty() {
        let (conversation_id, turn) = delivery(bot, "text").await;
        assert_eq!(turn["meta"]["turn"]["revision"], revision, "{turn}");
        assert!(
            waiting.remove(&conversation_id),
            "a turn of {conversation_id} arrived twice"
        );
    }
}

#[tokio::test]
async fn channel_welcome_announces_since_group_and_max_conversations_and_bad_groups_close_4400() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let before = chrono::Utc::now().timestamp_millis();
    let (_member, welcome) = agent(&node, &token, Some("support-bot")).await;
    let data = &welcome["data"];
    assert_eq!(data["scope"], "channel");
    assert_eq!(data["channelId"], acme.channel_id.to_string());
    assert_eq!(data["group"], "support-bot");
    let since = data["since"].as_i64().unwrap();
    assert!(
        since >= before + 1000 && since <= chrono::Utc::now().timestamp_millis() + 1000,
        "since = now + settle"
    );
    assert!(data["limits"]["maxConversations"].as_u64().is_some());

    let mut bad = WsClient::connect(&node.ws_url("")).await;
    bad.send_invalid(
        json!({"type": "hello", "protocol": "converger/1", "token": token, "group": "no spaces"}),
    )
    .await;
    let (frames, closed) = bad.recv_until_closed().await;
    assert_eq!(frames[0]["data"]["code"], "bad_request");
    assert_eq!(closed.code, 4400);
}

#[tokio::test]
async fn observers_receive_every_frame_of_the_channel_and_forwarded_client_frames() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (mut observer, _) = agent(&node, &token, None).await;
    let (mut alice, alice_conversation) = user(&node, &acme, "alice").await;
    // Presence and typing of end users reach the agents.
    let (conversation, presence) = delivery(&mut observer, "presence").await;
    assert_eq!(conversation, alice_conversation);
    assert_eq!(
        presence["data"],
        json!({"participant": {"id": "alice", "role": "user"}, "status": "online", "connections": 1})
    );
    alice
        .send(json!({"type": "typing", "isTyping": true}))
        .await;
    let (_, typing) = delivery(&mut observer, "typing").await;
    assert_eq!(typing["isTyping"], true);
    assert_eq!(typing["sender"], json!({"id": "alice", "role": "user"}));
    let (mut bob, bob_conversation) = user(&node, &acme, "bob").await;
    say(&mut alice, "a-1", "from alice").await;
    say(&mut bob, "b-1", "from bob").await;
    let (first_conversation, first) = delivery(&mut observer, "text").await;
    let (second_conversation, second) = delivery(&mut observer, "text").await;
    assert_eq!(
        (first_conversation, first["data"]["text"].as_str()),
        (alice_conversation, Some("from alice"))
    );
    assert_eq!(
        (second_conversation, second["data"]["text"].as_str()),
        (bob_conversation, Some("from bob"))
    );
    assert_eq!(first["from"], "user");
    assert!(
        first.get("meta").is_none(),
        "observers get frames, not turns"
    );

    alice
        .send(json!({"type": "abort", "clientId": "stop-1", "data": {}}))
        .await;
    let (conversation, forwarded) = delivery(&mut observer, "abort").await;
    assert_eq!(conversation, alice_conversation);
    assert_eq!(forwarded["clientId"], "stop-1");
    assert!(
        alice.barrier().await.is_empty(),
        "no bot_unavailable while an agent is connected"
    );
}

#[tokio::test]
async fn a_member_gets_turns_with_meta_and_its_result_commits_and_reaches_the_user() {
    let node = TestNode::start_with(fast_settle).await;
    let (acme, mut bot) = settled_bot(&node).await;
    let (mut alice, conversation_id) = user(&node, &acme, "alice").await;
    let seq = say(&mut alice, "a-1", "hello bot").await;

    let (delivered_conversation, turn) = delivery(&mut bot, "text").await;
    assert_eq!(delivered_conversation, conversation_id);
    let meta = &turn["meta"];
    assert_eq!(meta["channel"]["id"], acme.channel_id.to_string());
    assert_eq!(meta["participant"], json!({"id": "alice", "role": "user"}));
    assert_eq!(meta["turn"]["seq"], seq);
    assert_eq!(meta["turn"]["revision"], 0);
    assert_eq!(meta["turn"]["key"], format!("{conversation_id}:{seq}:0"));
    assert_eq!(meta["runtime"], json!({"version": 0, "state": {}}));

    bot.send(json!({"conversationId": conversation_id, "frame": turn_result("r-1", seq, "hello alice", Some(json!({"version": 0, "state": {"count": 1}})))})).await;
    let (_, ack) = delivery(&mut bot, "ack").await;
    assert_eq!(ack["clientId"], "r-1");
    assert_eq!(ack["turn"], json!({"seq": seq, "revision": 0}));
    assert_eq!(ack["seqs"], json!([seq + 1]));
    let answer = alice.recv_type("text").await;
    assert_eq!(
        (answer["seq"].as_i64(), answer["from"].as_str()),
        (Some(seq + 1), Some("bot"))
    );
    assert_eq!(answer["data"]["text"], "hello alice");

    // The runtime committed with the answer travels with the next turn.
    let next = say(&mut alice, "a-2", "again").await;
    let (_, second) = delivery(&mut bot, "text").await;
    assert_eq!(second["meta"]["turn"]["seq"], next);
    assert_eq!(
        second["meta"]["runtime"],
        json!({"version": 1, "state": {"count": 1}})
    );
    bot.send(json!({"conversationId": conversation_id, "frame": turn_result("r-2", next, "x", Some(json!({"version": 0, "state": {}})))})).await;
    let (_, stale) = delivery(&mut bot, "error").await;
    assert_eq!(stale["data"]["code"], "stale_runtime");
    assert_eq!(stale["data"]["retryable"], true);
}

/// ADR 0039, on the `postgres` bus (`tests/nats_bus.rs` runs it on NATS).
#[tokio::test]
async fn a_runtime_written_on_one_node_travels_with_its_commit_to_the_next_turn_on_another() {
    support::runtimes::travels_with_its_commit(fast_settle).await;
}

/// ADR 0039: an answer without frames moves the runtime and announces nothing, so a
/// regenerated revision is delivered with the runtime read, not the one the node held; and
/// after a `stale_runtime` refusal the node forgets what it held, so the agent's `sync` gets the
/// stored runtime.
#[tokio::test]
async fn a_runtime_moved_without_an_event_is_read_for_a_regenerate_and_after_a_stale_refusal() {
    let node = TestNode::start_with(fast_settle).await;
    let (acme, mut bot) = settled_bot(&node).await;
    let (mut alice, conversation_id) = user(&node, &acme, "alice").await;
    let answer = |client_id: &str, seq: i64, revision: i64, runtime: Value, frames: Value| {
        let mut frame = turn_result(client_id, seq, "noted", Some(runtime));
        frame["turn"]["revision"] = json!(revision);
        frame["frames"] = frames;
        json!({"conversationId": conversation_id, "frame": frame})
    };

    let first = say(&mut alice, "a-1", "hello").await;
    let (_, turn) = delivery(&mut bot, "text").await;
    assert_eq!(turn["meta"]["runtime"], json!({"version": 0, "state": {}}));
    // Each revision is answered without frames, then regenerated.
    for revision in 0..2 {
        let state = json!({"version": revision, "state": {"count": revision + 1}});
        let client_id = format!("r-{revision}");
        bot.send(answer(&client_id, first, revision, state, json!([])))
            .await;
        assert_eq!(delivery(&mut bot, "ack").await.1["turn"]["seq"], first);
        alice
            .send(json!({"type": "regenerate", "clientId": format!("g-{revision}"), "seq": first}))
            .await;
        alice.recv_until("ack").await;
        let (_, regenerated) = delivery(&mut bot, "text").await;
        assert_eq!(regenerated["meta"]["turn"]["revision"], revision + 1);
        assert_eq!(
            regenerated["meta"]["runtime"],
            json!({"version": revision + 1, "state": {"count": revision + 1}})
        );
    }

    // Answered with frames: the next turn gets the new runtime from the answer's event.
    let state = json!({"version": 2, "state": {"count": 2}});
    let frames = json!([{"type": "text", "data": {"text": "again"}}]);
    bot.send(answer("r-2", first, 2, state, frames)).await;
    delivery(&mut bot, "ack").await;
    alice.recv_type("text").await;
    // The stored runtime moves behind the node's back (as a node of the previous release,
    // which does not keep the conversation row's version, would move it).
    let count = json!({"count": 7});
    support::runtimes::overwrite_stored_runtime(&node, conversation_id, Some(7), &count).await;
    let next = say(&mut alice, "a-2", "and again").await;
    let (_, turn) = delivery(&mut bot, "text").await;
    assert_eq!(
        turn["meta"]["runtime"],
        json!({"version": 3, "state": {"count": 2}})
    );
    let state = json!({"version": 3, "state": {"count": 3}});
    bot.send(answer("r-3", next, 0, state, json!([]))).await;
    let (_, refused) = delivery(&mut bot, "error").await;
    assert_eq!(refused["data"]["code"], "stale_runtime");
    bot.send(json!({"conversationId": conversation_id, "frame": {"type": "sync", "watermark": 0}}))
        .await;
    loop {
        let (_, replayed) = delivery(&mut bot, "text").await;
        if replayed["meta"]["turn"]["seq"] == next {
            assert_eq!(
                replayed["meta"]["runtime"],
                json!({"version": 7, "state": {"count": 7}})
            );
            break;
        }
    }
}

/// A node, a member of group `bot`, and alice's turn delivered to it (results may come fast).
struct OneTurn {
    node: TestNode,
    bot: WsClient,
    alice: WsClient,
    conversation_id: Uuid,
    seq: i64,
}

async fn one_delivered_turn() -> OneTurn {
    let node = TestNode::start_with(|config| {
        fast_settle(config);
        config.limits.max_frames_per_sec = 1_000;
    })
    .await;
    let (acme, mut bot) = settled_bot(&node).await;
    let (mut alice, conversation_id) = user(&node, &acme, "alice").await;
    let seq = say(&mut alice, "a-1", "hi").await;
    delivery(&mut bot, "text").await;
    OneTurn {
        node,
        bot,
        alice,
        conversation_id,
        seq,
    }
}

#[tokio::test]
async fn resends_are_acked_identically_and_a_different_result_is_a_conflict() {
    let OneTurn {
        node,
        mut bot,
        alice: _alice,
        conversation_id,
        seq,
    } = one_delivered_turn().await;
    let result =
        json!({"conversationId": conversation_id, "frame": turn_result("r-1", seq, "once", None)});
    let mut acks = Vec::new();
    for _ in 0..100 {
        bot.send(result.clone()).await;
        acks.push(delivery(&mut bot, "ack").await.1);
    }
    assert!(acks[0].get("duplicate").is_none());
    assert!(acks[1..].iter().all(|ack| ack["duplicate"] == true
        && ack["seqs"] == acks[0]["seqs"]
        && ack["ids"] == acks[0]["ids"]
        && ack["timestamp"] == acks[0]["timestamp"]));
    assert_eq!(
        node.db
            .count("SELECT count(*) FROM activities WHERE turn_seq IS NOT NULL")
            .await,
        1
    );

    bot.send(json!({"conversationId": conversation_id, "frame": turn_result("r-2", seq, "different", None)})).await;
    let (_, conflict) = delivery(&mut bot, "error").await;
    assert_eq!(conflict["data"]["code"], "turn_conflict");
    assert_eq!(conflict["data"]["details"]["seqs"], acks[0]["seqs"]);
    assert_eq!(
        node.db
            .count("SELECT count(*) FROM activities WHERE turn_seq IS NOT NULL")
            .await,
        1
    );
}

#[tokio::test]
async fn a_burst_of_resends_sent_without_waiting_commits_once_and_is_acked_alike() {
    let OneTurn {
        node,
        mut bot,
        mut alice,
        conversation_id,
        seq,
    } = one_delivered_turn().await;

    // Results are committed concurrently per connection; 100 copies of one must still make one
    // answer, and each copy gets the same ack.
    let result =
        json!({"conversationId": conversation_id, "frame": turn_result("r-1", seq, "once", None)});
    for _ in 0..100 {
        bot.send(result.clone()).await;
    }
    let mut acks = Vec::new();
    for _ in 0..100 {
        acks.push(delivery(&mut bot, "ack").await.1);
    }
    let firsts: Vec<&Value> = acks
        .iter()
        .filter(|ack| ack.get("duplicate").is_none())
        .collect();
    assert_eq!(firsts.len(), 1, "one commit, 99 duplicates");
    assert!(acks.iter().all(|ack| ack["seqs"] == acks[0]["seqs"]
        && ack["ids"] == acks[0]["ids"]
        && ack["timestamp"] == acks[0]["timestamp"]));
    assert_eq!(
        node.db
            .count("SELECT count(*) FROM activities WHERE turn_seq IS NOT NULL")
            .await,
        1
    );
    let answer_seq = acks[0]["seqs"][0].as_i64().unwrap();
    let mut seen = vec![alice.recv_type("text").await];
    seen.extend(alice.barrier().await);
    assert_eq!(
        seen.iter()
            .filter(|frame| frame["seq"] == answer_seq)
            .count(),
        1,
        "the user sees the answer once"
    );
}

/// Turn deliveries (`text` envelopes) a member has received so far, after a barrier.
async fn turns_received(member: &mut WsClient) -> Vec<(Uuid, Value)> {
    member
        .barrier()
        .await
        .into_iter()
        .filter(|envelope| envelope["frame"]["type"] == "text")
        .map(|envelope| {
            let conversation_id = envelope["conversationId"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap();
            (conversation_id, envelope["frame"].clone())
        })
        .collect()
}

#[tokio::test]
async fn two_replicas_work_each_turn_once_across_turns_and_conversations_of_one_user() {
    let node = TestNode::start_with(fast_settle).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (mut first, first_welcome) = agent(&node, &token, Some("bot")).await;
    let (mut second, second_welcome) = agent(&node, &token, Some("bot")).await;
    support::settle(&first_welcome).await;
    support::settle(&second_welcome).await;
    let effects = support::effects::Effects::start()
        .await
        .expect("the effects fixture starts");
    // One user, two conversations, two turns in each.
    let mut tabs = Vec::new();
    for _ in 0..2 {
        tabs.push(user(&node, &acme, "alice").await.0);
    }
    for round in 0..2 {
        for (index, tab) in tabs.iter_mut().enumerate() {
            say(tab, &format!("t-{index}-{round}"), "work once").await;
        }
    }

    // Every turn reaches one replica; nothing else is read meanwhile, so none is skipped.
    let mut handed: Vec<(usize, Uuid, Value)> = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while handed.len() < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} of 4 turns delivered",
            handed.len()
        );
        for (index, member) in [&mut first, &mut second].into_iter().enumerate() {
            for (conversation_id, turn) in turns_received(member).await {
                handed.push((index, conversation_id, turn));
            }
        }
    }
    // Each replica performs the effect of what it was handed (keyed by meta.turn.key) and answers.
    let http = reqwest::Client::new();
    for (index, conversation_id, turn) in &handed {
        let member = if *index == 0 { &mut first } else { &mut second };
        let key = turn["meta"]["turn"]["key"].as_str().unwrap();
        http.post(&effects.url)
            .header("idempotency-key", key)
            .header("x-turn", key)
            .send()
            .await
            .unwrap()
            .error_for_status()
            .unwrap();
        let seq = turn["meta"]["turn"]["seq"].as_i64().unwrap();
        member
            .send(json!({"conversationId": conversation_id, "frame": turn_result(&format!("r-{key}"), seq, "done", None)}))
            .await;
        assert_eq!(delivery(member, "ack").await.1["turn"]["seq"], seq);
    }
    let mut handed: Vec<String> = handed
        .iter()
        .map(|(_, _, turn)| turn["meta"]["turn"]["key"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(handed.len(), 4, "four deliveries in all");
    handed.sort();
    handed.dedup();
    assert_eq!(
        handed.len(),
        4,
        "four distinct turn keys, each handed to one replica once"
    );
    assert_eq!(effects.performed(), 4, "one effect per turn key");
    assert_eq!(effects.repeated_calls(), 0, "no turn was worked twice");
    assert_eq!(
        node.db
            .count("SELECT count(*) FROM turns WHERE status = 'completed'")
            .await,
        4
    );
    assert!(turns_received(&mut first).await.is_empty());
    assert!(turns_received(&mut second).await.is_empty());
}

#[tokio::test]
async fn each_conversation_has_one_owner_in_a_group_and_two_groups_each_get_every_turn() {
    let node = TestNode::start_with(fast_settle).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (mut first, welcome_first) = agent(&node, &token, Some("bot")).await;
    let (mut second, welcome_second) = agent(&node, &token, Some("bot")).await;
    let (mut auditor, welcome_auditor) = agent(&node, &token, Some("audit")).await;
    for welcome in [&welcome_first, &welcome_second, &welcome_auditor] {
        support::settle(welcome).await;
    }
    // Conversation ids are random: with 24 of them, all landing on one member of two has a
    // chance of 2^-23 (with 8 it was 1 in 128, and it happened in CI).
    const USERS: usize = 24;
    let mut users = Vec::new();
    for n in 0..USERS {
        users.push(user(&node, &acme, &format!("user-{n}")).await);
    }
    for (client, _) in users.iter_mut() {
        say(client, "t-1", "one").await;
        say(client, "t-2", "two").await;
    }
    // Every turn reaches the single member of "audit"; once the audit member has them all, the
    // actor has handed every turn to "bot" too.
    turns(&mut auditor, 2 * USERS).await;
    let mut first_got = first.barrier().await;
    let mut second_got = second.barrier().await;
    first_got.retain(|envelope| envelope["frame"]["type"] == "text");
    second_got.retain(|envelope| envelope["frame"]["type"] == "text");
    assert_eq!(
        first_got.len() + second_got.len(),
        2 * USERS,
        "each turn once in the bot group"
    );
    assert!(
        auditor.barrier().await.is_empty(),
        "and not twice to the audit group"
    );
    // Affinity: a conversation's two turns went to the same member.
    for (_, conversation_id) in &users {
        let id = conversation_id.to_string();
        let on_first = first_got
            .iter()
            .filter(|envelope| envelope["conversationId"] == id.as_str())
            .count();
        let on_second = second_got
            .iter()
            .filter(|envelope| envelope["conversationId"] == id.as_str())
            .count();
        assert!(
            (on_first, on_second) == (2, 0) || (on_first, on_second) == (0, 2),
            "{id}: {on_first}/{on_second}"
        );
    }
    assert!(
        !first_got.is_empty() && !second_got.is_empty(),
        "{USERS} conversations spread over both members"
    );
}

#[tokio::test]
async fn a_member_joining_during_the_settle_delay_takes_no_turn_of_before() {
    // A settle delay long enough that every turn below lands inside the newcomer's, even on a
    // loaded machine.
    let node = TestNode::start_with(|config| config.group_settle_ms = 3_000).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (mut settled, welcome) = agent(&node, &token, Some("bot")).await;
    support::settle(&welcome).await;
    let (mut newcomer, _) = agent(&node, &token, Some("bot")).await;
    let mut users = Vec::new();
    for n in 0..6 {
        users.push(user(&node, &acme, &format!("user-{n}")).await);
    }
    for (client, _) in users.iter_mut() {
        say(client, "t-1", "during settle").await;
    }
    turns(&mut settled, 6).await;
    assert!(
        newcomer.barrier().await.is_empty(),
        "the newcomer serves nothing before its since"
    );
}

#[tokio::test]
async fn an_unanswered_turn_is_taken_over_when_its_member_leaves_and_an_answered_one_is_not() {
    let TwoMembers {
        node,
        token,
        mut first,
        mut second,
        mut client,
        conversation_id,
        ..
    } = two_members_and_a_user_of_the_first().await;
    let answered_seq = say(&mut client, "t-1", "first turn").await;
    let (_, turn) = delivery(&mut first, "text").await;
    assert_eq!(
        turn["seq"], answered_seq,
        "the owner predicted by the rendezvous hash got the turn"
    );
    // The first member answers the first turn, receives a second one, and leaves without answering.
    first.send(json!({"conversationId": conversation_id, "frame": turn_result("r-1", answered_seq, "answer", None)})).await;
    delivery(&mut first, "ack").await;
    let unanswered = say(&mut client, "t-2", "second turn").await;
    let (_, turn) = delivery(&mut first, "text").await;
    assert_eq!(turn["seq"], unanswered);
    first.close().await;

    let (conversation, taken) = delivery(&mut second, "text").await;
    assert_eq!(conversation, conversation_id);
    assert_eq!(
        taken["seq"], unanswered,
        "the unanswered turn moves to the remaining member"
    );
    assert_eq!(taken["meta"]["turn"]["seq"], unanswered);
    assert!(
        second
            .barrier()
            .await
            .iter()
            .all(|envelope| envelope["frame"]["seq"] != answered_seq),
        "an answered turn is never delivered again"
    );

    // The new owner answers; a late answer from the departed member's process is refused.
    second.send(json!({"conversationId": conversation_id, "frame": turn_result("r-2", unanswered, "taken over", None)})).await;
    delivery(&mut second, "ack").await;
    let (mut returning, _) = agent(&node, &token, Some("bot")).await;
    returning.send(json!({"conversationId": conversation_id, "frame": turn_result("r-late", unanswered, "late", None)})).await;
    let (_, conflict) = delivery(&mut returning, "error").await;
    assert_eq!(conflict["data"]["code"], "turn_conflict");
    assert_eq!(
        node.db
            .count(&format!(
                "SELECT count(*) FROM activities WHERE turn_seq = {unanswered}"
            ))
            .await,
        1,
        "one answer stored"
    );
}

#[tokio::test]
async fn agent_transient_frames_are_relayed_to_the_user_and_proactive_frames_are_acked() {
    let node = TestNode::start_with(fast_settle).await;
    let (acme, mut bot) = settled_bot(&node).await;
    let (mut alice, conversation_id) = user(&node, &acme, "alice").await;
    say(&mut alice, "a-1", "are you there?").await;
    delivery(&mut bot, "text").await;

    bot.send(json!({"conversationId": conversation_id, "frame": {"type": "error", "data": {"code": "busy", "message": "one moment"}}})).await;
    let busy = alice.recv_type("error").await;
    assert_eq!(busy["data"]["code"], "busy");
    bot.send(
        json!({"conversationId": conversation_id, "frame": {"type": "typing", "isTyping": true}}),
    )
    .await;
    assert_eq!(alice.recv_type("typing").await["isTyping"], true);

    bot.send(json!({"conversationId": conversation_id, "frame": {"type": "text", "clientId": "p-1", "data": {"text": "proactive"}}})).await;
    let (_, ack) = delivery(&mut bot, "ack").await;
    assert_eq!(ack["clientId"], "p-1");
    let proactive = alice.recv_type("text").await;
    assert_eq!(
        (
            proactive["data"]["text"].as_str(),
            proactive["from"].as_str()
        ),
        (Some("proactive"), Some("bot"))
    );

    // A conversation outside the channel is refused.
    let globex = node.tenant_with_channel("globex").await;
    let (foreign, _) = node.conversation(&globex, "eve").await;
    bot.send(json!({"conversationId": foreign, "frame": {"type": "text", "clientId": "p-2", "data": {"text": "x"}}})).await;
    let (_, refused) = delivery(&mut bot, "error").await;
    assert_eq!(refused["data"]["code"], "conversation_not_found");
}

#[tokio::test]
async fn hello_watermarks_replay_the_listed_conversations() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (mut alice, conversation_id) = user(&node, &acme, "alice").await;
    for n in 1..=3 {
        say(&mut alice, &format!("a-{n}"), "x").await;
    }
    let token = agent_token(&node, &acme).await;
    let mut observer = WsClient::connect(&node.ws_url("")).await;
    observer
        .hello(
            &token,
            json!({"watermarks": {conversation_id.to_string(): 1}}),
        )
        .await;
    let replayed = turns(&mut observer, 2).await;
    let seqs: Vec<i64> = replayed
        .iter()
        .filter_map(|envelope| envelope["frame"]["seq"].as_i64())
        .collect();
    assert_eq!(seqs, vec![2, 3]);
}

#[tokio::test]
async fn a_silent_member_is_dropped_at_the_idle_timeout_and_its_turn_taken_over() {
    let node = TestNode::start_with(|config| {
        fast_settle(config);
        // Long enough that the alive member, which answers pings only while the test reads it,
        // survives the setup on a loaded machine; short enough to keep the test quick.
        config.limits.heartbeat_interval_ms = 500;
        config.limits.idle_timeout_ms = 2_000;
    })
    .await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (mut silent, welcome_silent) = agent(&node, &token, Some("bot")).await;
    let (mut alive, welcome_alive) = agent(&node, &token, Some("bot")).await;
    support::settle(&welcome_silent).await;
    support::settle(&welcome_alive).await;
    let (conversation_id, user_token) = conversation_owned_by(
        &node,
        &acme,
        &[&welcome_silent, &welcome_alive],
        &welcome_silent,
    )
    .await;
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client.hello(&user_token, json!({})).await;
    let seq = say(&mut client, "t-1", "anyone?").await;
    // The silent member's socket stays open but it never reads or answers pings; the alive
    // member keeps answering (its client replies to pings while it waits here).
    let (conversation, taken) = delivery(&mut alive, "text").await;
    assert_eq!(
        (conversation, taken["seq"].as_i64()),
        (conversation_id, Some(seq))
    );
    let (_, closed) = silent.recv_until_closed().await;
    assert_eq!(closed.code, 4408);
}

#[tokio::test]
async fn edit_and_regenerate_open_new_revisions_for_the_current_owner() {
    let node = TestNode::start_with(fast_settle).await;
    let (acme, mut bot) = settled_bot(&node).await;
    let (conversation_id, user_token) = node.conversation(&acme, "alice").await;
    let mut alice = WsClient::connect(&node.ws_url("")).await;
    alice.hello(&user_token, json!({})).await;
    let mut other_tab = WsClient::connect(&node.ws_url("")).await;
    other_tab.hello(&user_token, json!({})).await;
    let original = say(&mut alice, "q-1", "what is 2+2").await;
    delivery(&mut bot, "text").await;

    alice.send(json!({"type": "edit", "clientId": "e-1", "seq": original, "data": {"text": "what is 3+3"}})).await;
    let ack = alice.recv_until("ack").await.pop().unwrap();
    assert_eq!(ack["turn"], json!({"seq": original, "revision": 1}));
    let edit_seq = ack["seq"].as_i64().unwrap();
    let (_, edited) = delivery(&mut bot, "text").await;
    assert_eq!(edited["seq"], edit_seq, "frame.seq is the edit's own seq");
    assert_eq!(edited["replaces"], original);
    assert_eq!(edited["meta"]["turn"]["seq"], original);
    assert_eq!(edited["meta"]["turn"]["revision"], 1);
    assert_eq!(edited["meta"]["turn"]["reason"], "edit");
    let copies: Vec<Value> = other_tab
        .barrier()
        .await
        .into_iter()
        .filter(|frame| frame["seq"] == edit_seq)
        .collect();
    assert_eq!(copies.len(), 1, "the other tab sees the edit");
    assert!(
        alice
            .barrier()
            .await
            .iter()
            .all(|frame| frame["seq"] != edit_seq),
        "not echoed to the sender"
    );

    // An answer to revision 0 is superseded; revision 1 is answered.
    bot.send(json!({"conversationId": conversation_id, "frame": turn_result("r-0", original, "4", None)})).await;
    assert_eq!(
        delivery(&mut bot, "error").await.1["data"]["code"],
        "turn_superseded"
    );
    let mut answer = turn_result("r-1", original, "6", None);
    answer["turn"]["revision"] = json!(1);
    bot.send(json!({"conversationId": conversation_id, "frame": answer}))
        .await;
    assert_eq!(delivery(&mut bot, "ack").await.1["turn"]["revision"], 1);

    let stored_before = node.db.count("SELECT count(*) FROM activities").await;
    alice
        .send(json!({"type": "regenerate", "clientId": "g-1", "seq": original}))
        .await;
    let ack = alice.recv_until("ack").await.pop().unwrap();
    assert_eq!(ack["turn"], json!({"seq": original, "revision": 2}));
    let (_, regenerated) = delivery(&mut bot, "text").await;
    // The turn as it reads now: its latest edit, as a takeover would deliver it.
    assert_eq!(regenerated["seq"], edit_seq);
    assert_eq!(regenerated["data"]["text"], "what is 3+3");
    assert_eq!(regenerated["meta"]["turn"]["seq"], original);
    assert_eq!(regenerated["meta"]["turn"]["revision"], 2);
    assert_eq!(regenerated["meta"]["turn"]["reason"], "regenerate");
    assert_eq!(
        node.db.count("SELECT count(*) FROM activities").await,
        stored_before,
        "nothing stored until the answer"
    );

    // A resend of the regenerate is the same revision, not a new one.
    alice
        .send(json!({"type": "regenerate", "clientId": "g-1", "seq": original}))
        .await;
    let again = alice.recv_until("ack").await.pop().unwrap();
    assert_eq!(
        (again["turn"].clone(), again["duplicate"].clone()),
        (json!({"seq": original, "revision": 2}), json!(true))
    );
    assert!(
        bot.barrier()
            .await
            .iter()
            .all(|envelope| envelope["frame"]["type"] != "text"),
        "no second delivery"
    );

    // Only the user's own turns can be revised; an unknown target falls back to the latest turn.
    alice
        .send(json!({"type": "regenerate", "clientId": "g-2", "messageId": "no-such-id"}))
        .await;
    let ack = alice.recv_until("ack").await.pop().unwrap();
    assert_eq!(ack["turn"]["seq"], original);
}

#[tokio::test]
async fn the_rust_agent_client_answers_turns_and_resends_idempotently() {
    use converger_client::agent::Agent;
    let node = TestNode::start_with(fast_settle).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let mut echo = Agent::connect(&node.ws_url(""), &token, Some("echo"))
        .await
        .unwrap();
    let since = echo.welcome()["since"].as_i64().unwrap();
    support::settle(&json!({"data": {"since": since}})).await;
    let (mut alice, conversation_id) = user(&node, &acme, "alice").await;
    for n in 1..=2 {
        say(&mut alice, &format!("a-{n}"), &format!("ping {n}")).await;
        let turn = echo.next_turn().await.unwrap();
        assert_eq!(turn.conversation_id, conversation_id);
        assert_eq!(turn.text(), Some(format!("ping {n}").as_str()));
        assert_eq!(turn.runtime_version, n - 1);
        let count = turn.runtime_state["count"].as_i64().unwrap_or(0) + 1;
        let frames = vec![json!({"type": "text", "data": {"text": format!("echo {n}")}})];
        let ack = echo
            .reply(&turn, frames.clone(), Some(json!({"count": count})))
            .await
            .unwrap();
        assert!(!ack.duplicate);
        let again = echo
            .reply(&turn, frames, Some(json!({"count": count})))
            .await
            .unwrap();
        assert_eq!((again.duplicate, again.seqs), (true, ack.seqs));
        let answer = alice.recv_type("text").await;
        assert_eq!(answer["data"]["text"], format!("echo {n}"));
    }
    let runtime: serde_json::Value = {
        let mut db = node.db.connect().await;
        sqlx::query_scalar("SELECT state FROM conversation_runtime")
            .fetch_one(&mut db)
            .await
            .unwrap()
    };
    assert_eq!(runtime, json!({"count": 2}));
}

#[tokio::test]
async fn one_groups_answers_reach_the_other_groups_owner_but_not_its_own() {
    let node = TestNode::start_with(fast_settle).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (mut bot, welcome_bot) = agent(&node, &token, Some("bot")).await;
    let (mut console, welcome_console) = agent(&node, &token, Some("console")).await;
    support::settle(&welcome_bot).await;
    support::settle(&welcome_console).await;
    let (mut alice, conversation_id) = user(&node, &acme, "alice").await;
    let seq = say(&mut alice, "a-1", "help").await;
    delivery(&mut bot, "text").await;
    delivery(&mut console, "text").await;
    bot.send(json!({"conversationId": conversation_id, "frame": turn_result("r-1", seq, "bot answer", None)})).await;
    delivery(&mut bot, "ack").await;
    let (_, seen) = delivery(&mut console, "text").await;
    assert_eq!(seen["data"]["text"], "bot answer");
    assert_eq!(seen["sender"], json!({"id": "bot", "role": "agent"}));
    assert!(
        seen.get("meta").is_none(),
        "another party's frame is not a turn"
    );
    assert!(
        bot.barrier()
            .await
            .iter()
            .all(|envelope| envelope["frame"]["type"] != "text"),
        "the bot does not get its own answer back"
    );
}

#[tokio::test]
async fn an_agent_addresses_at_most_max_conversations() {
    let node = TestNode::start_with(|config| config.limits.max_conversations = 2).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (mut observer, welcome) = agent(&node, &token, None).await;
    assert_eq!(welcome["data"]["limits"]["maxConversations"], 2);
    let mut conversations = Vec::new();
    for n in 0..3 {
        conversations.push(node.conversation(&acme, &format!("user-{n}")).await.0);
    }
    for (n, conversation_id) in conversations.iter().enumerate() {
        observer.send(json!({"conversationId": conversation_id, "frame": {"type": "sync", "watermark": 0}})).await;
        let answered = observer.barrier().await;
        if n < 2 {
            assert!(answered.is_empty(), "{answered:?}");
        } else {
            assert_eq!(
                answered[0]["frame"]["data"]["code"],
                "too_many_subscriptions"
            );
        }
    }
}

#[tokio::test]
async fn watermark_replay_gives_a_member_only_the_turns_it_owns() {
    let node = TestNode::start_with(fast_settle).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (mut serving, welcome) = agent(&node, &token, Some("bot")).await;
    support::settle(&welcome).await;
    let (mut alice, conversation_id) = user(&node, &acme, "alice").await;
    for n in 1..=2 {
        say(&mut alice, &format!("a-{n}"), "x").await;
    }
    turns(&mut serving, 2).await;
    // A newcomer, not eligible when those turns were committed, owns none of them.
    let mut newcomer = WsClient::connect(&node.ws_url("")).await;
    newcomer
        .hello(
            &token,
            json!({"group": "bot", "watermarks": {conversation_id.to_string(): 0}}),
        )
        .await;
    newcomer
        .send(json!({"conversationId": conversation_id, "frame": {"type": "sync", "watermark": 0}}))
        .await;
    let _ = newcomer.barrier().await;
    // The serving member replays its own turns, with their meta; the actor handles requests in
    // order, so by now the newcomer's replays were handled too.
    serving
        .send(json!({"conversationId": conversation_id, "frame": {"type": "sync", "watermark": 0}}))
        .await;
    let replayed = turns(&mut serving, 2).await;
    assert_eq!(replayed[0]["frame"]["meta"]["turn"]["seq"], 1);
    assert!(newcomer.barrier().await.iter().all(|envelope| {
        envelope
            .get("frame")
            .is_none_or(|frame| frame["type"] == "error")
    }));
}

#[tokio::test]
async fn a_taken_over_edited_turn_carries_the_edit() {
    let TwoMembers {
        node: _node,
        token: _,
        mut first,
        mut second,
        mut client,
        ..
    } = two_members_and_a_user_of_the_first().await;
    let original = say(&mut client, "t-1", "first words").await;
    delivery(&mut first, "text").await;
    client.send(json!({"type": "edit", "clientId": "e-1", "seq": original, "data": {"text": "better words"}})).await;
    let edit_seq = client.recv_until("ack").await.pop().unwrap()["seq"]
        .as_i64()
        .unwrap();
    let (_, edited) = delivery(&mut first, "text").await;
    assert_eq!(edited["seq"], edit_seq);
    first.close().await;
    let (_, taken) = delivery(&mut second, "text").await;
    assert_eq!(
        taken["seq"], edit_seq,
        "the new owner gets the edit, not the original"
    );
    assert_eq!(taken["data"]["text"], "better words");
    assert_eq!(taken["meta"]["turn"]["seq"], original);
    assert_eq!(taken["meta"]["turn"]["revision"], 1);
    assert_eq!(taken["meta"]["turn"]["reason"], "edit");
}

#[tokio::test]
async fn a_regenerated_revision_whose_member_leaves_is_taken_over() {
    let TwoMembers {
        node: _node,
        token: _,
        mut first,
        mut second,
        mut client,
        conversation_id,
        ..
    } = two_members_and_a_user_of_the_first().await;
    let original = say(&mut client, "t-1", "a question").await;
    delivery(&mut first, "text").await;
    first.send(json!({"conversationId": conversation_id, "frame": turn_result("r-0", original, "an answer", None)})).await;
    delivery(&mut first, "ack").await;
    client
        .send(json!({"type": "regenerate", "clientId": "g-1", "seq": original}))
        .await;
    let (_, regenerated) = delivery(&mut first, "text").await;
    assert_eq!(regenerated["meta"]["turn"]["revision"], 1);
    first.close().await;

    let (_, taken) = delivery(&mut second, "text").await;
    assert_eq!(
        (
            taken["meta"]["turn"]["seq"].as_i64(),
            taken["meta"]["turn"]["revision"].as_i64(),
            taken["meta"]["turn"]["reason"].as_str()
        ),
        (Some(original), Some(1), Some("regenerate")),
        "the remaining member takes the regenerated revision over"
    );
    let mut answer = turn_result("r-1", original, "another answer", None);
    answer["turn"]["revision"] = json!(1);
    second
        .send(json!({"conversationId": conversation_id, "frame": answer}))
        .await;
    assert_eq!(delivery(&mut second, "ack").await.1["turn"]["revision"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_closing_at_once_each_go_offline_once_and_leave_no_count() {
    const USERS: usize = 40;
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (mut observer, _) = agent(&node, &token, None).await;
    let mut users = Vec::new();
    for n in 0..USERS {
        users.push(user(&node, &acme, &format!("user-{n}")).await);
    }
    let mut online = std::collections::HashSet::new();
    while online.len() < USERS {
        let (conversation, presence) = delivery(&mut observer, "presence").await;
        assert_eq!(presence["data"]["status"], "online", "{presence}");
        assert_eq!(presence["data"]["connections"], 1, "{presence}");
        assert!(
            online.insert(conversation),
            "one online per user: {presence}"
        );
    }
    // Every socket closes at once: the node counts them out in batches (ADR 0043).
    futures::future::join_all(users.into_iter().map(|(client, _)| client.close())).await;
    let mut offline = std::collections::HashSet::new();
    while offline.len() < USERS {
        let (conversation, presence) = delivery(&mut observer, "presence").await;
        assert_eq!(presence["data"]["status"], "offline", "{presence}");
        assert_eq!(presence["data"]["connections"], 0, "{presence}");
        assert!(online.contains(&conversation), "{presence}");
        assert!(
            offline.insert(conversation),
            "one offline per user: {presence}"
        );
    }
    let left = node
        .db
        .count("SELECT count(*) FROM presence_connections")
        .await;
    assert_eq!(left, 0);
}

#[tokio::test]
async fn typing_is_throttled_per_connection_unless_it_changes() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (mut observer, _) = agent(&node, &token, None).await;
    let (mut alice, _) = user(&node, &acme, "alice").await;
    delivery(&mut observer, "presence").await;
    for is_typing in [true, true, true, false] {
        alice
            .send(json!({"type": "typing", "isTyping": is_typing}))
            .await;
    }
    // A marker frame after the typing frames: everything relayed before it has arrived.
    alice
        .send(json!({"type": "abort", "clientId": "marker", "data": {}}))
        .await;
    let mut relayed = Vec::new();
    loop {
        let envelope = observer.recv().await;
        match envelope["frame"]["type"].as_str() {
            Some("typing") => relayed.push(envelope["frame"]["isTyping"].as_bool().unwrap()),
            Some("abort") => break,
            _ => {}
        }
    }
    assert_eq!(
        relayed,
        vec![true, false],
        "repeats within the throttle window are dropped, a change is not"
    );
}

#[tokio::test]
async fn more_unanswered_turns_than_the_memory_keeps_are_all_taken_over() {
    let TwoMembers {
        node,
        mut first,
        mut second,
        conversation_id,
        user_token,
        ..
    } = two_members_and_a_user_of_the_first().await;
    // The takeover memory keeps 64 turns per conversation; 70 unanswered ones overflow it.
    // Posted over REST: a socket would run into its frame rate limit.
    let mut seqs = Vec::new();
    for n in 0..70 {
        let frame = json!({"type": "text", "data": {"text": format!("piling up {n}")}});
        let posted = node
            .client
            .post_activity(&user_token, conversation_id, &frame, None)
            .await
            .unwrap();
        seqs.push(posted.seq);
    }
    let delivered = turns(&mut first, seqs.len()).await;
    assert_eq!(delivered.len(), 70);
    first.close().await;

    let taken = turns(&mut second, seqs.len()).await;
    let mut taken_seqs: Vec<i64> = taken
        .iter()
        .map(|envelope| envelope["frame"]["meta"]["turn"]["seq"].as_i64().unwrap())
        .collect();
    taken_seqs.sort_unstable();
    taken_seqs.dedup();
    assert_eq!(
        taken_seqs, seqs,
        "every unanswered turn moves, the evicted ones included"
    );
    drop(node);
}

#[tokio::test]
async fn a_member_whose_socket_drops_without_a_close_frame_leaves_at_once() {
    let node = TestNode::start_with(fast_settle).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let client = converger_client::agent::Agent::connect(&node.ws_url(""), &token, Some("bot"))
        .await
        .unwrap();
    let connection = client.welcome()["connectionId"]
        .as_str()
        .unwrap()
        .to_owned();
    let listed = || {
        let request = node
            .http
            .get(node.url("/api/v1/admin/cluster"))
            .bearer_auth(&node.admin_token);
        let connection = connection.clone();
        async move {
            let view: Value = request.send().await.unwrap().json().await.unwrap();
            member_connections(&view).contains(&connection)
        }
    };
    eventually("the member is announced", Duration::from_secs(5), listed).await;
    drop(client);
    eventually(
        "the member is withdrawn within 5 s of its socket dropping",
        Duration::from_secs(5),
        || {
            let listed = listed();
            async move { !listed.await }
        },
    )
    .await;
}

async fn lease_member(node: &TestNode, token: &str) -> (WsClient, Value) {
    let mut client = WsClient::connect(&node.ws_url("")).await;
    let welcome = client
        .hello(token, json!({"group": "bot", "claim": "lease"}))
        .await;
    (client, welcome)
}

fn fenced_result(client_id: &str, seq: i64, fence: Option<i64>, text: &str) -> Value {
    let mut result = turn_result(client_id, seq, text, None);
    if let Some(fence) = fence {
        result["turn"]["fence"] = json!(fence);
    }
    result
}

#[tokio::test]
async fn a_lease_member_gets_each_turn_with_a_fence_and_must_answer_with_it() {
    let node = TestNode::start_with(fast_settle).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (mut member, welcome) = lease_member(&node, &token).await;
    assert_eq!(welcome["data"]["claim"], "lease");
    assert_eq!(welcome["data"]["leaseMs"], 10_000);
    support::settle(&welcome).await;
    let (mut client, conversation_id) = user(&node, &acme, "alice").await;
    let seq = say(&mut client, "t-1", "hello").await;
    let (_, turn) = delivery(&mut member, "text").await;
    assert_eq!(turn["meta"]["turn"]["seq"], seq);
    let fence = turn["meta"]["turn"]["fence"]
        .as_i64()
        .expect("a lease delivery has a fence");
    assert_eq!(fence, 1, "the first claim of a turn key");

    // No fence: refused in lease mode. An older fence: lease_lost. Nothing stored either way.
    member.send(json!({"conversationId": conversation_id, "frame": fenced_result("r-1", seq, None, "a")})).await;
    let (_, refused) = delivery(&mut member, "error").await;
    assert_eq!(refused["data"]["code"], "bad_request");
    member.send(json!({"conversationId": conversation_id, "frame": fenced_result("r-1", seq, Some(fence - 1), "a")})).await;
    let (_, lost) = delivery(&mut member, "error").await;
    assert_eq!(lost["data"]["code"], "lease_lost");
    assert_eq!(lost["data"]["number"], 4103);
    assert_eq!(lost["data"]["retryable"], false);
    let stored = format!(
        "SELECT count(*) FROM activities WHERE conversation_id = '{conversation_id}' AND sender_role = 'agent'"
    );
    assert_eq!(node.db.count(&stored).await, 0, "nothing stored");

    member.send(json!({"conversationId": conversation_id, "frame": fenced_result("r-1", seq, Some(fence), "answer")})).await;
    let (_, ack) = delivery(&mut member, "ack").await;
    assert_eq!(ack["clientId"], "r-1");
    assert_eq!(node.db.count(&stored).await, 1);
    let holder = welcome["data"]["connectionId"].as_str().unwrap();
    assert_eq!(
        node.db
            .count(&format!("SELECT count(*) FROM turns WHERE conversation_id = '{conversation_id}' AND seq = {seq} AND status = 'completed' AND claimed_by = '{holder}' AND fence = 1"))
            .await,
        1
    );
}

#[tokio::test]
async fn a_departed_lease_holders_late_answer_is_refused_and_the_new_holder_answers() {
    let node = TestNode::start_with(fast_settle).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let (first, welcome_first) = lease_member(&node, &token).await;
    let (mut second, welcome_second) = lease_member(&node, &token).await;
    support::settle(&welcome_first).await;
    support::settle(&welcome_second).await;
    let members = [&welcome_first, &welcome_second];
    let (conversation_id, user_token) =
        conversation_owned_by(&node, &acme, &members, &welcome_first).await;
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client.hello(&user_token, json!({})).await;
    let mut first = first;
    let seq = say(&mut client, "t-1", "who holds it?").await;
    let (_, turn) = delivery(&mut first, "text").await;
    let old_fence = turn["meta"]["turn"]["fence"].as_i64().unwrap();

    // The holder leaves: its lease is released and the takeover claims the turn again.
    first.close().await;
    let (_, taken) = delivery(&mut second, "text").await;
    assert_eq!(taken["meta"]["turn"]["seq"], seq);
    let new_fence = taken["meta"]["turn"]["fence"].as_i64().unwrap();
    assert!(new_fence > old_fence, "a new claim has a higher fence");

    // The departed process comes back and answers with its old fence: lease_lost.
    let (mut returning, _) = lease_member(&node, &token).await;
    returning.send(json!({"conversationId": conversation_id, "frame": fenced_result("late", seq, Some(old_fence), "late")})).await;
    let (_, lost) = delivery(&mut returning, "error").await;
    assert_eq!(lost["data"]["code"], "lease_lost");
    second.send(json!({"conversationId": conversation_id, "frame": fenced_result("r-2", seq, Some(new_fence), "taken over")})).await;
    delivery(&mut second, "ack").await;
    assert_eq!(
        node.db
            .count(&format!("SELECT count(*) FROM activities WHERE turn_seq = {seq} AND conversation_id = '{conversation_id}'"))
            .await,
        1,
        "one answer stored"
    );
}

#[tokio::test]
async fn a_turn_held_under_a_live_lease_is_delivered_when_the_lease_runs_out() {
    let node = TestNode::start_with(|config| {
        fast_settle(config);
        config.lease_ms = 600;
    })
    .await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    // A turn sent while no agent is connected, then held by a holder that is gone (its node
    // died): the lease runs out by itself.
    let (mut client, conversation_id) = user(&node, &acme, "alice").await;
    let seq = say(&mut client, "t-1", "anyone?").await;
    let mut db = node.db.connect().await;
    // Taken before the statement: its now() is no earlier, so the lease ends 800 ms after this
    // at the soonest, however long the update takes to commit.
    let held_at = std::time::Instant::now();
    sqlx::query(
        "UPDATE turns SET claimed_by = 'ghost', fence = 1, lease_until = now() + interval '800 milliseconds'
         WHERE conversation_id = $1 AND seq = $2",
    )
    .bind(conversation_id)
    .bind(seq)
    .execute(&mut db)
    .await
    .unwrap();
    let (mut member, _) = lease_member(&node, &token).await;
    let (_, turn) = delivery(&mut member, "text").await;
    assert!(
        held_at.elapsed() >= Duration::from_millis(700),
        "delivered only once the ghost's lease ran out ({:?})",
        held_at.elapsed()
    );
    assert_eq!(turn["meta"]["turn"]["seq"], seq);
    assert_eq!(turn["meta"]["turn"]["fence"], 2);
}

#[tokio::test]
async fn a_lease_claim_without_a_group_or_of_an_unknown_kind_closes_4400() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    for extra in [
        json!({"claim": "lease"}),
        json!({"group": "bot", "claim": "exclusive"}),
    ] {
        let mut bad = WsClient::connect(&node.ws_url("")).await;
        let mut hello = json!({"type": "hello", "protocol": "converger/1", "token": token});
        for (key, value) in extra.as_object().unwrap() {
            hello[key] = value.clone();
        }
        bad.send_invalid(hello).await;
        let (frames, closed) = bad.recv_until_closed().await;
        assert_eq!(frames[0]["data"]["code"], "bad_request", "{extra}");
        assert_eq!(closed.code, 4400, "{extra}");
    }
}

#[tokio::test]
async fn the_rust_agent_client_answers_in_lease_mode_with_the_fence() {
    let node = TestNode::start_with(fast_settle).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let options = converger_client::agent::AgentOptions {
        group: Some("bot".into()),
        lease: true,
        ..Default::default()
    };
    let mut agent = converger_client::agent::Agent::connect_with(&node.ws_url(""), &token, options)
        .await
        .unwrap();
    assert_eq!(agent.welcome()["claim"], "lease");
    support::settle(&json!({"data": agent.welcome().clone()})).await;
    let (mut client, _) = user(&node, &acme, "alice").await;
    let seq = say(&mut client, "t-1", "fenced").await;
    let turn = agent.next_turn().await.unwrap();
    assert_eq!(turn.seq, seq);
    assert_eq!(turn.fence, Some(1));
    let ack = agent
        .reply(
            &turn,
            vec![json!({"type": "text", "data": {"text": "done"}})],
            None,
        )
        .await
        .unwrap();
    assert_eq!(ack.seqs.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_meta_and_hello_tools_reach_agents_and_are_never_shown_to_users() {
    let node = TestNode::start_with(|config| config.group_settle_ms = 100).await;
    let (acme, conversation_id, token) = support::setup(&node).await;
    let token_for_agents = agent_token(&node, &acme).await;
    let (mut bot, welcome) = agent(&node, &token_for_agents, Some("bot")).await;
    support::settle(&welcome).await;
    let mut tab = WsClient::connect(&node.ws_url("")).await;
    let hello = json!({"meta": {"locale": "fr", "page": "/a"}, "tools": [{"name": "pick_date"}]});
    tab.hello(&token, hello).await;
    let tools = bot.skip_to_enveloped("client_tools").await;
    assert_eq!(
        tools["data"]["tools"],
        json!([{"name": "pick_date"}]),
        "{tools}"
    );

    // The send's meta over the hello's, key by key, in the delivered turn's meta.client.
    tab.send(
        json!({"type": "text", "clientId": "q-1", "data": {"text": "hi"},
                    "meta": {"page": "/b"}}),
    )
    .await;
    tab.skip_to("ack").await;
    let delivered = bot.skip_to_enveloped("text").await;
    assert_eq!(
        delivered["meta"]["client"],
        json!({"locale": "fr", "page": "/b"}),
        "{delivered}"
    );

    // Over REST: the body's meta alone.
    let response = node
        .http
        .post(node.url(&format!(
            "/api/v1/converger/conversations/{conversation_id}/activities"
        )))
        .bearer_auth(&token)
        .json(&json!({"type": "text", "data": {"text": "again"}, "meta": {"via": "rest"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 201);
    let delivered = bot.skip_to_enveloped("text").await;
    assert_eq!(delivered["meta"]["client"], json!({"via": "rest"}));

    // Users never see it: not in the history, not in a replay.
    let (_, page) = node.activities(conversation_id, &token, "").await;
    for frame in page["activities"].as_array().unwrap() {
        assert!(frame.get("meta").is_none(), "{frame}");
    }
    let mut other = WsClient::connect(&node.ws_url("")).await;
    other.hello(&token, json!({})).await;
    let replayed = other.recv_type("text").await;
    assert!(replayed.get("meta").is_none(), "{replayed}");
}

/// A channel's actor lives while agents of the channel are connected here: it ends with the
/// last one, and the next agent starts a new actor, which hands it the turn sent meanwhile and
/// the turns after.
#[tokio::test]
async fn a_channels_actor_ends_with_its_last_agent_and_the_next_agent_gets_what_came_meanwhile() {
    let node = TestNode::start_with(fast_settle).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = agent_token(&node, &acme).await;
    let actors = &node.server.state().actors;
    let (mut bot, welcome) = agent(&node, &token, Some("bot")).await;
    support::settle(&welcome).await;
    assert_eq!(actors.running(), 1);
    let (mut alice, conversation_id) = user(&node, &acme, "alice").await;
    let first = say(&mut alice, "a-1", "hello").await;
    let (_, turn) = delivery(&mut bot, "text").await;
    assert_eq!(turn["meta"]["turn"]["seq"], first);

    bot.close().await;
    eventually(
        "the channel's actor ends",
        Duration::from_secs(10),
        || async { actors.running() == 0 },
    )
    .await;
    let meanwhile = say(&mut alice, "a-2", "anyone?").await;

    let (mut next_bot, welcome) = agent(&node, &token, Some("bot")).await;
    assert_eq!(actors.running(), 1);
    let (delivered_conversation, turn) = delivery(&mut next_bot, "text").await;
    assert_eq!(delivered_conversation, conversation_id);
    assert_eq!(
        turn["meta"]["turn"]["seq"], first,
        "the unanswered turn of the first agent is handed on"
    );
    let (_, turn) = delivery(&mut next_bot, "text").await;
    assert_eq!(turn["meta"]["turn"]["seq"], meanwhile);
    support::settle(&welcome).await;
    let after = say(&mut alice, "a-3", "and now?").await;
    let (_, turn) = delivery(&mut next_bot, "text").await;
    assert_eq!(turn["meta"]["turn"]["seq"], after);
}
