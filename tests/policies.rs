//! Double texting (docs/protocol.md §3.10, ADR 0029): a channel's turn policy, a send's
//! override where the channel allows it, and the opt-in cancel when the last tab leaves; over
//! real sockets, on one node and with the owner on another.

mod support;

use serde_json::{Value, json};
use support::ws::WsClient;
use support::{TenantFixture, TestNode, setup, stream_words};
use uuid::Uuid;

fn fast(config: &mut converger_gateway::Config) {
    config.group_settle_ms = 100;
    config.turns.stop_grace_ms = 300;
    config.turns.disconnect_cancel_ms = 200;
}

/// `PATCH /api/v1/channels/{id}` with `body`: (status, answer).
async fn patch_channel(node: &TestNode, fixture: &TenantFixture, body: Value) -> (u16, Value) {
    let response = node
        .http
        .patch(node.url(&format!("/api/v1/channels/{}", fixture.channel_id)))
        .header("x-api-key", &fixture.api_key)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// The next delivered turn of an agent: (conversation id, seq); `cancel`s on the way are
/// returned too, in the order they came.
async fn next_turn(agent: &mut WsClient, cancels: &mut Vec<Value>) -> (String, i64) {
    loop {
        let envelope = agent.recv().await;
        if envelope["frame"]["type"] == "cancel" {
            cancels.push(envelope["frame"].clone());
            continue;
        }
        if let Some(seq) = envelope["frame"]["meta"]["turn"]["seq"].as_i64() {
            let conversation = envelope["conversationId"].as_str().unwrap().to_owned();
            return (conversation, seq);
        }
    }
}

fn text(client_id: &str, words: &str) -> Value {
    json!({"type": "text", "clientId": client_id, "data": {"text": words}})
}

/// A settled member of group `bot` on `agent_url`, and alice's tab on the node: (fixture,
/// conversation, agent, tab, alice's token).
async fn agent_and_tab(
    node: &TestNode,
    agent_url: &str,
) -> (TenantFixture, Uuid, WsClient, WsClient, String) {
    let (acme, conversation_id, token) = setup(node).await;
    let agent_token = node.agent_token(&acme).await;
    let mut agent = WsClient::connect(agent_url).await;
    let welcome = agent.hello(&agent_token, json!({"group": "bot"})).await;
    support::settle(&welcome).await;
    let mut tab = WsClient::connect(&node.ws_url("")).await;
    tab.hello(&token, json!({})).await;
    (acme, conversation_id, agent, tab, token)
}

async fn user_frames(node: &TestNode, conversation: Uuid) -> i64 {
    node.db
        .count(&format!(
            "SELECT count(*) FROM activities WHERE conversation_id = '{conversation}' AND sender_role = 'user'"
        ))
        .await
}

#[tokio::test]
async fn reject_refuses_a_send_while_a_turn_runs_and_stores_nothing() {
    let node = TestNode::start_with(fast).await;
    let (acme, conversation_id, mut agent, mut tab, _) =
        agent_and_tab(&node, &node.ws_url("")).await;
    let (status, channel) = patch_channel(&node, &acme, json!({"turnPolicy": "reject"})).await;
    assert_eq!(status, 200, "{channel}");
    assert_eq!(channel["turnPolicy"], "reject");

    for (id, words) in [("q-1", "first"), ("q-2", "second"), ("q-3", "third")] {
        tab.send(text(id, words)).await;
    }
    let ack = tab.skip_to("ack").await;
    assert_eq!(ack["clientId"], "q-1");
    for refused_id in ["q-2", "q-3"] {
        let error = tab.skip_to("error").await;
        assert_eq!(error["data"]["code"], "turn_in_progress");
        assert_eq!(error["data"]["clientId"], refused_id);
        assert_eq!(error["data"]["details"]["turn"]["seq"], ack["seq"]);
    }
    assert_eq!(
        user_frames(&node, conversation_id).await,
        1,
        "nothing stored"
    );

    // Once the turn is answered, the next send is taken.
    let (conversation, seq) = next_turn(&mut agent, &mut Vec::new()).await;
    agent
        .send(json!({"conversationId": conversation, "frame": {"type": "turnResult", "clientId": "r-1",
            "turn": {"seq": seq}, "frames": [{"type": "text", "data": {"text": "done"}}]}}))
        .await;
    agent.skip_to_enveloped("ack").await;
    tab.send(text("q-4", "fourth")).await;
    let ack = tab.skip_to("ack").await;
    assert_eq!(ack["clientId"], "q-4");
    // A resend of a refused key after that is a new send; of a stored one, its duplicate.
    tab.send(text("q-1", "first")).await;
    let again = tab.skip_to("ack").await;
    assert_eq!(
        (again["clientId"].as_str(), again["duplicate"].as_bool()),
        (Some("q-1"), Some(true))
    );
}

#[tokio::test]
async fn interrupt_stops_the_running_turn_with_the_owner_on_another_node_then_delivers_the_new_one()
{
    let node = TestNode::start_with(fast).await;
    let peer = node.start_peer_with(fast).await;
    let (acme, conversation_id, mut agent, mut tab, _) =
        agent_and_tab(&node, &support::peer_ws_url(&peer)).await;
    // The channel enqueues; a send may ask to interrupt.
    let (status, _) =
        patch_channel(&node, &acme, json!({"turnPolicyOverrides": ["interrupt"]})).await;
    assert_eq!(status, 200);

    tab.send(text("q-1", "tell me a story")).await;
    let mut cancels = Vec::new();
    let (conversation, first) = next_turn(&mut agent, &mut cancels).await;
    let streamed = stream_words(&mut agent, &conversation, "s-1", first, 0..3).await;
    // The tab's node settles the stopped turn with its own copy of the stream, relayed from
    // the agent's node: the tab has every chunk before it interrupts.
    let mut seen = String::new();
    while seen.len() < streamed.len() {
        let frame = tab.recv().await;
        if frame["type"] == "streamChunk" {
            seen.push_str(frame["text"].as_str().unwrap());
        }
    }
    assert_eq!(seen, streamed);
    // Two quick sends that interrupt: each stops what runs, the last one runs.
    for (id, words) in [("q-2", "no, a poem"), ("q-3", "no, a song")] {
        let mut frame = text(id, words);
        frame["turnPolicy"] = json!("interrupt");
        tab.send(frame).await;
    }
    let (_, second) = next_turn(&mut agent, &mut cancels).await;
    let (_, third) = next_turn(&mut agent, &mut cancels).await;
    while cancels.len() < 2 {
        cancels.push(agent.skip_to_enveloped("cancel").await);
    }
    let stopped: Vec<(i64, &str)> = cancels
        .iter()
        .map(|cancel| {
            (
                cancel["turn"]["seq"].as_i64().unwrap(),
                cancel["reason"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(stopped, vec![(first, "superseded"), (second, "superseded")]);
    let end = tab.skip_to("streamEnd").await;
    assert_eq!(
        (end["status"].as_str(), end["reason"].as_str()),
        (Some("aborted"), Some("superseded"))
    );

    // The first two turns settle, the first with what was streamed; the third is answered.
    let mut settled: Vec<Value> = Vec::new();
    while settled.len() < 2 {
        let frame = tab.skip_to("text").await;
        if frame["sender"]["role"] == "system" {
            settled.push(frame);
        }
    }
    settled.sort_by_key(|frame| frame["data"]["turn"]["seq"].as_i64());
    assert_eq!(settled[0]["data"]["turn"]["seq"], first);
    assert_eq!(settled[0]["data"]["text"], streamed);
    assert_eq!(settled[1]["data"]["turn"]["seq"], second);
    assert_eq!(
        settled[1]["data"]["text"], "",
        "nothing was streamed for it"
    );
    for frame in &settled {
        assert_eq!(frame["data"]["reason"], "superseded");
    }
    agent
        .send(json!({"conversationId": conversation, "frame": {"type": "turnResult", "clientId": "r-3",
            "turn": {"seq": third}, "frames": [{"type": "text", "data": {"text": "la la"}}]}}))
        .await;
    agent.skip_to_enveloped("ack").await;
    let statuses = node
        .db
        .count(&format!(
            "SELECT count(*) FROM turns WHERE conversation_id = '{conversation_id}' AND status = 'stopped'"
        ))
        .await;
    assert_eq!(statuses, 2, "the first two turns were stopped and settled");
}

#[tokio::test]
async fn rollback_takes_the_interrupted_turn_and_its_partial_answer_out_of_the_chat_view() {
    let node = TestNode::start_with(fast).await;
    let (acme, conversation_id, mut agent, mut tab, token) =
        agent_and_tab(&node, &node.ws_url("")).await;
    let (status, _) = patch_channel(&node, &acme, json!({"turnPolicy": "rollback"})).await;
    assert_eq!(status, 200);
    tab.send(text("q-1", "tell me a story")).await;
    let mut cancels = Vec::new();
    let (conversation, first) = next_turn(&mut agent, &mut cancels).await;
    stream_words(&mut agent, &conversation, "s-1", first, 0..2).await;
    tab.send(text("q-2", "actually, a poem")).await;
    let (_, second) = next_turn(&mut agent, &mut cancels).await;
    // The stopped turn settles (after the grace period) before the chat view is read.
    loop {
        let frame = tab.skip_to("text").await;
        if frame["sender"]["role"] == "system" {
            break;
        }
    }
    agent
        .send(json!({"conversationId": conversation, "frame": {"type": "turnResult", "clientId": "r-2",
            "turn": {"seq": second}, "frames": [{"type": "text", "data": {"text": "roses are red"}}]}}))
        .await;
    agent.skip_to_enveloped("ack").await;

    let page = |view: &'static str| {
        let (node, token) = (&node, &token);
        async move { support::page_texts(&node.activities(conversation_id, token, view).await.1) }
    };
    assert_eq!(
        page("?view=chat").await,
        vec!["actually, a poem", "roses are red"]
    );
    let all = page("").await;
    assert_eq!(all.len(), 4, "the transcript keeps everything: {all:?}");
    assert_eq!(all[0], "tell me a story");
}

#[tokio::test]
async fn a_policy_the_channel_does_not_allow_or_does_not_know_is_refused() {
    let node = TestNode::start_with(fast).await;
    let (acme, conversation_id, _agent, mut tab, _) = agent_and_tab(&node, &node.ws_url("")).await;
    let (status, _) =
        patch_channel(&node, &acme, json!({"turnPolicyOverrides": ["interrupt"]})).await;
    assert_eq!(status, 200);
    let mut frame = text("q-1", "hi");
    frame["turnPolicy"] = json!("rollback");
    tab.send(frame).await;
    let error = tab.skip_to("error").await;
    assert_eq!(error["data"]["code"], "bad_request");
    assert_eq!(error["data"]["clientId"], "q-1");
    let mut frame = text("q-2", "hi");
    frame["turnPolicy"] = json!("supersede");
    tab.send_invalid(frame).await;
    let error = tab.skip_to("error").await;
    assert_eq!(error["data"]["code"], "invalid_message");
    assert_eq!(user_frames(&node, conversation_id).await, 0);

    for body in [
        json!({"turnPolicy": "supersede"}),
        json!({"turnPolicyOverrides": ["reject", "throw"]}),
        json!({"onDisconnect": "maybe"}),
        json!({}),
    ] {
        let (status, answer) = patch_channel(&node, &acme, body.clone()).await;
        assert_eq!(status, 400, "{body}: {answer}");
    }
    // The channel is as it was.
    let (_, channel) = patch_channel(&node, &acme, json!({"status": "active"})).await;
    assert_eq!(channel["turnPolicy"], Value::Null);
    assert_eq!(channel["turnPolicyOverrides"], json!(["interrupt"]));
    assert_eq!(channel["onDisconnect"], "continue");
}

#[tokio::test]
async fn the_last_tab_leaving_cancels_the_turn_only_where_the_channel_asks_for_it() {
    let node = TestNode::start_with(fast).await;
    let (acme, _, mut agent, mut tab, _) = agent_and_tab(&node, &node.ws_url("")).await;
    let (status, channel) = patch_channel(&node, &acme, json!({"onDisconnect": "cancel"})).await;
    assert_eq!(
        (status, channel["onDisconnect"].as_str()),
        (200, Some("cancel"))
    );
    tab.send(text("q-1", "hi")).await;
    tab.skip_to("ack").await;
    let (_, seq) = next_turn(&mut agent, &mut Vec::new()).await;
    tab.close().await;
    let cancel = agent.skip_to_enveloped("cancel").await;
    assert_eq!(cancel["reason"], "user_disconnected");
    assert_eq!(cancel["turn"]["seq"], seq);

    // On a channel that continues (the default), a closed tab never stops a turn: the answer
    // sent after the tab left, and after a cancelling channel's delay, is taken.
    let other = node.tenant_with_channel("other").await;
    let (_, bob_token) = node.conversation(&other, "bob").await;
    let other_agent_token = node.agent_token(&other).await;
    let (mut other_agent, welcome) = node.agent(&other_agent_token, Some("bot")).await;
    support::settle(&welcome).await;
    let mut bob = WsClient::connect(&node.ws_url("")).await;
    bob.hello(&bob_token, json!({})).await;
    bob.send(text("b-1", "hello")).await;
    bob.skip_to("ack").await;
    let (conversation, bob_seq) = next_turn(&mut other_agent, &mut Vec::new()).await;
    bob.close().await;
    // A cancelling conversation closed after bob's is cancelled: bob's delay has passed too.
    let (_, carol_token) = node.conversation(&acme, "carol").await;
    let mut carol = WsClient::connect(&node.ws_url("")).await;
    carol.hello(&carol_token, json!({})).await;
    carol.send(text("c-1", "hello")).await;
    carol.skip_to("ack").await;
    next_turn(&mut agent, &mut Vec::new()).await;
    carol.close().await;
    agent.skip_to_enveloped("cancel").await;
    other_agent
        .send(json!({"conversationId": conversation, "frame": {"type": "turnResult", "clientId": "r-b",
            "turn": {"seq": bob_seq}, "frames": [{"type": "text", "data": {"text": "hi bob"}}]}}))
        .await;
    let ack = other_agent.skip_to_enveloped("ack").await;
    assert_eq!(ack["turn"]["seq"], bob_seq);
    let stopped = node
        .db
        .count(&format!(
            "SELECT count(*) FROM turns WHERE conversation_id = '{conversation}' AND stop_reason IS NOT NULL"
        ))
        .await;
    assert_eq!(stopped, 0, "bob's closed tab stopped nothing");
}
