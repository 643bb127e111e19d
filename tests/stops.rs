//! Stopping a running turn (docs/protocol.md §3.9, ADR 0028): a `stop` frame, the mekik `abort`
//! or the REST call; the owner gets `cancel`, the stream ends `stopped`, and the turn settles
//! once: with the agent's answer within the grace period, else with what was streamed, after
//! which an answer is refused with `turn_stopped`.

mod support;

use serde_json::{Value, json};
use std::time::Duration;
use support::mekik::Widget;
use support::ws::WsClient;
use support::{TestNode, next_turn, setup, stream_words, turn_in_progress};
use uuid::Uuid;

fn grace(ms: u64) -> impl FnOnce(&mut converger_gateway::Config) {
    move |config| {
        config.group_settle_ms = 100;
        config.turns.stop_grace_ms = ms;
    }
}

fn result(conversation: &str, seq: i64, text: &str) -> Value {
    json!({"conversationId": conversation, "frame": {
        "type": "turnResult", "clientId": format!("r-{seq}"), "turn": {"seq": seq},
        "frames": [{"type": "text", "streamId": "s-1", "data": {"text": text}}]}})
}

/// `POST …/stop` with `token` and `body`: (status, answer).
async fn rest_stop(node: &TestNode, conversation: Uuid, token: &str, body: Value) -> (u16, Value) {
    let response = node
        .http
        .post(node.url(&format!(
            "/api/v1/converger/conversations/{conversation}/stop"
        )))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .expect("POST stop");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON answer"))
}

/// `POST …/close` with `token`, which must answer 200.
async fn rest_close(node: &TestNode, conversation: Uuid, token: &str) {
    let response = node
        .http
        .post(node.url(&format!(
            "/api/v1/converger/conversations/{conversation}/close"
        )))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
}

/// The stored frames answering turn `seq`, as the database holds them: (sender role, data).
async fn stored_answers(node: &TestNode, conversation: Uuid, seq: i64) -> Vec<(String, Value)> {
    let mut connection = node.db.connect().await;
    sqlx::query_as(
        "SELECT sender_role, data FROM activities
         WHERE conversation_id = $1 AND turn_seq = $2 ORDER BY seq",
    )
    .bind(conversation)
    .bind(seq)
    .fetch_all(&mut connection)
    .await
    .expect("answers readable")
}

async fn turn_status(node: &TestNode, conversation: Uuid, seq: i64) -> String {
    let mut connection = node.db.connect().await;
    sqlx::query_scalar(
        "SELECT status FROM turns WHERE conversation_id = $1 AND seq = $2
         ORDER BY revision DESC LIMIT 1",
    )
    .bind(conversation)
    .bind(seq)
    .fetch_one(&mut connection)
    .await
    .expect("turn readable")
}

#[tokio::test]
async fn a_stop_mid_stream_tells_the_owner_and_its_answer_within_the_grace_period_is_the_result() {
    let node = TestNode::start_with(grace(30_000)).await;
    let (node, conversation_id, _, mut agent, mut tab, conversation, seq) =
        turn_in_progress(node).await;
    let streamed = stream_words(&mut agent, &conversation, "s-1", seq, 0..3).await;

    tab.send(json!({"type": "stop", "clientId": "stop-1"}))
        .await;
    let ack = tab.skip_to("ack").await;
    assert_eq!(ack["clientId"], "stop-1");
    assert_eq!(ack["stopped"], true);
    assert_eq!(ack["turn"]["seq"], seq);

    let cancel = agent.skip_to_enveloped("cancel").await;
    assert_eq!(cancel["reason"], "stopped");
    assert_eq!(cancel["turn"]["seq"], seq);
    assert_eq!(
        cancel["turn"]["key"],
        format!("{conversation}:{seq}:0"),
        "the turn key names the turn"
    );
    let end = tab.skip_to("streamEnd").await;
    assert_eq!(end["status"], "aborted");
    assert_eq!(end["reason"], "stopped");

    // The stream is over: no more chunks, but the answer is taken.
    agent
        .send(support::stream_chunk(&conversation, "s-1", 3, seq, "late"))
        .await;
    let refused = agent.skip_to_enveloped("error").await;
    assert_eq!(refused["data"]["code"], "stream_closed");
    agent.send(result(&conversation, seq, &streamed)).await;
    let acked = agent.skip_to_enveloped("ack").await;
    assert_eq!(acked["turn"]["seq"], seq);

    let stored = tab.skip_to("text").await;
    assert_eq!(stored["data"]["text"], streamed);
    assert_eq!(stored["sender"]["role"], "agent");
    assert_eq!(turn_status(&node, conversation_id, seq).await, "completed");
    // A second stop of the answered turn changes nothing and says so.
    tab.send(json!({"type": "stop", "clientId": "stop-2", "seq": seq}))
        .await;
    let again = tab.skip_to("ack").await;
    assert_eq!(again["stopped"], false);
    assert_eq!(again["turn"]["seq"], seq);
    assert_eq!(stored_answers(&node, conversation_id, seq).await.len(), 1);
}

#[tokio::test]
async fn an_agent_that_ignores_cancel_loses_the_race_and_its_late_answer_is_refused() {
    // The repeated stop below must come within the grace period.
    let node = TestNode::start_with(grace(2_000)).await;
    let (node, conversation_id, token, mut agent, mut tab, conversation, seq) =
        turn_in_progress(node).await;
    let streamed = stream_words(&mut agent, &conversation, "s-1", seq, 0..4).await;

    let (status, answer) = rest_stop(&node, conversation_id, &token, json!({})).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer, json!({"stopped": true, "seq": seq}));
    // Idempotent while it settles.
    let (_, again) = rest_stop(&node, conversation_id, &token, json!({"seq": seq})).await;
    assert_eq!(again, json!({"stopped": true, "seq": seq}));
    agent.skip_to_enveloped("cancel").await;

    // The gateway settles it with the text streamed, under the stream's id.
    let settled = tab.skip_to("text").await;
    assert_eq!(settled["data"]["text"], streamed);
    assert_eq!(settled["data"]["status"], "stopped");
    assert_eq!(settled["data"]["reason"], "stopped");
    assert_eq!(settled["id"], "s-1");
    assert_eq!(settled["streamId"], "s-1");
    assert_eq!(settled["sender"]["role"], "system");
    assert_eq!(turn_status(&node, conversation_id, seq).await, "stopped");

    agent
        .send(result(&conversation, seq, "the whole story"))
        .await;
    let refused = agent.skip_to_enveloped("error").await;
    assert_eq!(refused["data"]["code"], "turn_stopped");
    assert_eq!(refused["data"]["details"]["turn"]["seq"], seq);
    let answers = stored_answers(&node, conversation_id, seq).await;
    assert_eq!(answers.len(), 1, "one result per turn: {answers:?}");

    // Nothing runs any more.
    let (_, answered) = rest_stop(&node, conversation_id, &token, json!({"seq": seq})).await;
    assert_eq!(answered, json!({"stopped": false, "seq": seq}));
    let (_, idle) = rest_stop(&node, conversation_id, &token, json!({})).await;
    assert_eq!(idle, json!({"stopped": false, "seq": null}));
}

#[tokio::test]
async fn bad_stops_are_refused_and_change_nothing() {
    let node = TestNode::start_with(grace(300)).await;
    let (node, conversation_id, token, _agent, mut tab, _, seq) = turn_in_progress(node).await;
    let acme = node.tenant_with_channel("other").await;
    let (other_conversation, other_token) = node.conversation(&acme, "bob").await;

    for (body, code) in [
        (json!({"seq": seq + 100}), "bad_request"),
        (json!({"seq": 0}), "bad_request"),
        (json!({"seq": "one"}), "bad_request"),
        (json!({"turn": seq}), "bad_request"),
    ] {
        let (status, answer) = rest_stop(&node, conversation_id, &token, body.clone()).await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert_eq!(answer["error"]["code"], code, "{body}: {answer}");
    }
    // Another user's conversation, or none: 404 like a missing one.
    let (status, _) = rest_stop(&node, other_conversation, &token, json!({})).await;
    assert_eq!(status, 404);
    let (status, _) = rest_stop(&node, conversation_id, &other_token, json!({})).await;
    assert_eq!(status, 404);
    let (status, _) = rest_stop(&node, Uuid::now_v7(), &token, json!({})).await;
    assert_eq!(status, 404);
    // Over the socket: a seq that is no turn of this conversation.
    tab.send(json!({"type": "stop", "clientId": "s-9", "seq": seq + 100}))
        .await;
    let error = tab.skip_to("error").await;
    assert_eq!(error["data"]["code"], "bad_request");
    assert_eq!(error["data"]["clientId"], "s-9");
    tab.send_invalid(json!({"type": "stop", "seq": -1})).await;
    let error = tab.skip_to("error").await;
    assert_eq!(error["data"]["code"], "invalid_message");
    assert_eq!(turn_status(&node, conversation_id, seq).await, "pending");

    // A closed conversation: 409, and its turn was settled by the close.
    rest_close(&node, conversation_id, &token).await;
    let (status, answer) = rest_stop(&node, conversation_id, &token, json!({})).await;
    assert_eq!(status, 409, "{answer}");
    assert_eq!(answer["error"]["code"], "conversation_closed");
    assert_eq!(turn_status(&node, conversation_id, seq).await, "closed");
}

#[tokio::test]
async fn the_widgets_abort_stops_the_turn_and_shows_that_it_stopped() {
    let node = TestNode::start_with(grace(200)).await;
    let (acme, _, token) = setup(&node).await;
    let agent_token = node.agent_token(&acme).await;
    let (mut agent, welcome) = node.agent(&agent_token, Some("bot")).await;
    support::settle(&welcome).await;
    let mut widget = Widget::new(&node.ws_url(""), &token);
    widget.connect().await;
    widget.send_text("write me a poem").await;
    let (conversation, seq, _) = next_turn(&mut agent).await;
    let streamed = stream_words(&mut agent, &conversation, "s-1", seq, 0..2).await;
    widget
        .read_until(|frame| frame["type"] == "genui" && frame["chunk"]["content"] == "w1 ")
        .await;

    widget.send(json!({"type": "abort"})).await;
    // Agents that read the mekik abort still get it, and the owner gets cancel.
    let forwarded = agent.skip_to_enveloped("abort").await;
    assert_eq!(forwarded["type"], "abort");
    let cancel = agent.skip_to_enveloped("cancel").await;
    assert_eq!(cancel["turn"]["seq"], seq);
    widget.read_until(|frame| frame["done"] == true).await;
    let bubble = widget
        .bubbles_from("bot")
        .into_iter()
        .find(|bubble| bubble.id.contains("s-1"))
        .cloned()
        .expect("the streamed bubble");
    assert_eq!(
        bubble.text,
        format!("{streamed}{}", converger_protocol::mekik::STOP_NOTICE)
    );
    assert!(!bubble.streaming);

    // A turn stopped before any text: the settlement shows as a notice, never an empty bubble.
    widget.send_text("never mind, another one").await;
    let (_, second, _) = next_turn(&mut agent).await;
    widget.send(json!({"type": "abort"})).await;
    widget
        .read_until(|frame| {
            frame["data"]["text"] == converger_protocol::mekik::STOPPED_NOTICE
                && frame["seq"].as_i64() > Some(second)
        })
        .await;
    let notice = widget.bubbles_from("bot").last().cloned().cloned().unwrap();
    assert_eq!(notice.text, converger_protocol::mekik::STOPPED_NOTICE);
}

#[tokio::test]
async fn a_stop_on_one_node_cancels_the_owner_on_another_and_settles_with_its_stream() {
    let node = TestNode::start_with(grace(500)).await;
    let peer = node
        .start_peer_with(|config| {
            config.group_settle_ms = 100;
            config.turns.stop_grace_ms = 500;
        })
        .await;
    let (acme, conversation_id, token) = setup(&node).await;
    // The agent is on the peer; alice and her stop are on the first node.
    let agent_token = node.agent_token(&acme).await;
    let mut agent = WsClient::connect(&support::peer_ws_url(&peer)).await;
    let welcome = agent.hello(&agent_token, json!({"group": "bot"})).await;
    support::settle(&welcome).await;
    let mut tab = WsClient::connect(&node.ws_url("")).await;
    tab.hello(&token, json!({})).await;
    tab.send(json!({"type": "text", "clientId": "q-1", "data": {"text": "hi"}}))
        .await;
    tab.recv_type("ack").await;
    let (conversation, seq, _) = next_turn(&mut agent).await;
    let streamed = stream_words(&mut agent, &conversation, "s-1", seq, 0..5).await;
    // The tab has every chunk before it stops.
    let mut seen = String::new();
    while seen != streamed {
        let frame = tab.recv().await;
        if frame["type"] == "streamChunk" {
            seen.push_str(frame["text"].as_str().unwrap());
        }
    }

    tab.send(json!({"type": "stop", "clientId": "stop-1"}))
        .await;
    assert_eq!(tab.skip_to("ack").await["stopped"], true);
    let cancel = agent.skip_to_enveloped("cancel").await;
    assert_eq!(cancel["turn"]["seq"], seq);
    let end = tab.skip_to("streamEnd").await;
    assert_eq!(end["reason"], "stopped");
    let settled = tab.skip_to("text").await;
    assert_eq!(
        settled["data"]["text"], streamed,
        "what the tab was streamed"
    );
    assert_eq!(settled["data"]["status"], "stopped");
    assert_eq!(
        stored_answers(&node, conversation_id, seq).await.len(),
        1,
        "one result"
    );
    tokio::time::timeout(Duration::from_secs(5), async {
        agent.send(result(&conversation, seq, "late")).await;
        let refused = agent.skip_to_enveloped("error").await;
        assert_eq!(refused["data"]["code"], "turn_stopped");
    })
    .await
    .expect("the late answer is refused");
}

#[tokio::test]
async fn the_rust_clients_turn_is_cancelled_and_may_still_answer_in_the_grace_period() {
    let node = TestNode::start_with(grace(30_000)).await;
    let (acme, conversation_id, token) = setup(&node).await;
    let agent_token = node.agent_token(&acme).await;
    let mut agent =
        converger_client::agent::Agent::connect(&node.ws_url(""), &agent_token, Some("bot"))
            .await
            .expect("agent connects");
    let since = agent.welcome()["since"].as_i64().unwrap();
    support::settle(&json!({"data": {"since": since}})).await;
    let mut tab = WsClient::connect(&node.ws_url("")).await;
    tab.hello(&token, json!({})).await;
    tab.send(json!({"type": "text", "clientId": "q-1", "data": {"text": "hi"}}))
        .await;
    let mut turn = agent.next_turn().await.expect("a turn");
    assert!(!turn.cancellation.is_cancelled());

    let (status, _) = rest_stop(&node, conversation_id, &token, json!({})).await;
    assert_eq!(status, 200);
    // The cancel is read while the agent reads; the turn's token resolves.
    let reason = tokio::select! {
        reason = turn.cancellation.cancelled() => reason,
        next = agent.next_turn() => panic!("no other turn: {next:?}"),
    };
    assert_eq!(reason, "stopped");
    assert!(turn.cancellation.is_cancelled());
    let ack = agent
        .reply(
            &turn,
            vec![json!({"type": "text", "data": {"text": "stopped early"}})],
            None,
        )
        .await
        .expect("an answer within the grace period is taken");
    assert_eq!(ack.seqs.len(), 1);
    assert_eq!(
        turn_status(&node, conversation_id, turn.seq).await,
        "completed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_whose_node_is_killed_before_its_grace_ends_is_settled_by_another_node() {
    use support::cluster::{NodeProcess, wait_for_live_nodes};
    let db = support::TestDb::create().await;
    let grace = [("CONVERGER_TURNS__STOP_GRACE_MS", "500")];
    let a = NodeProcess::start_with(&db.url, "a", &[], &grace).await;
    let b =
        NodeProcess::start_with(&db.url, "b", std::slice::from_ref(&a.gossip_addr), &grace).await;
    wait_for_live_nodes(&[&a, &b], &["a", "b"]).await;
    let rest = converger_client::RestClient::new(&b.base_url).unwrap();
    let admin = support::test_config().admin_token;
    let tenant = rest.create_tenant(&admin, "acme").await.unwrap();
    let channel = rest
        .create_channel(&tenant.api_key, "acme-web")
        .await
        .unwrap();
    let user_token = rest
        .generate_token(
            &channel.secret,
            &converger_client::TokenRequest::for_user("alice"),
        )
        .await
        .unwrap();
    let created = rest.create_conversation(&user_token.token).await.unwrap();
    let agent_token = rest
        .generate_token(
            &channel.secret,
            &converger_client::TokenRequest::channel_scope(),
        )
        .await
        .unwrap()
        .token;
    // The agent and alice's tab are on b; the stop goes to a, which dies at once.
    let mut agent = WsClient::connect(&b.ws_url()).await;
    let welcome = agent.hello(&agent_token, json!({"group": "bot"})).await;
    support::settle(&welcome).await;
    let mut tab = WsClient::connect(&b.ws_url()).await;
    tab.hello(&created.token, json!({})).await;
    tab.send(json!({"type": "text", "clientId": "q-1", "data": {"text": "hi"}}))
        .await;
    let (conversation, seq, _) = next_turn(&mut agent).await;
    let streamed = stream_words(&mut agent, &conversation, "s-1", seq, 0..3).await;
    let response = reqwest::Client::new()
        .post(format!(
            "{}/api/v1/converger/conversations/{}/stop",
            a.base_url, created.conversation_id
        ))
        .bearer_auth(&created.token)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    a.kill_9().await;

    // b's sweep settles it with the stream b holds, once.
    agent.skip_to_enveloped("cancel").await;
    let settled = tab.skip_to("text").await;
    assert_eq!(settled["data"]["text"], streamed);
    assert_eq!(settled["data"]["status"], "stopped");
    let mut connection = db.connect().await;
    let results: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM activities WHERE conversation_id = $1 AND turn_seq = $2",
    )
    .bind(created.conversation_id)
    .bind(seq)
    .fetch_one(&mut connection)
    .await
    .unwrap();
    assert_eq!(results, 1);
    b.terminate().await;
}

#[tokio::test]
async fn a_close_tells_the_running_turns_agent_and_settles_a_stopping_turn_as_closed() {
    let node = TestNode::start_with(grace(30_000)).await;
    let (node, conversation_id, token, mut agent, mut tab, conversation, seq) =
        turn_in_progress(node).await;
    stream_words(&mut agent, &conversation, "s-1", seq, 0..2).await;
    // A second turn, stopped: it is stopping when the conversation closes.
    tab.send(json!({"type": "text", "clientId": "q-2", "data": {"text": "and another"}}))
        .await;
    let second = tab.skip_to("ack").await["seq"].as_i64().unwrap();
    let (_, stopping) = rest_stop(&node, conversation_id, &token, json!({"seq": second})).await;
    assert_eq!(stopping["stopped"], true);

    rest_close(&node, conversation_id, &token).await;
    let mut reasons = Vec::new();
    while !reasons.contains(&(seq, "conversation_closed".to_owned())) {
        let cancel = agent.skip_to_enveloped("cancel").await;
        reasons.push((
            cancel["turn"]["seq"].as_i64().unwrap(),
            cancel["reason"].as_str().unwrap().to_owned(),
        ));
    }
    let end = tab.skip_to("streamEnd").await;
    assert_eq!(end["reason"], "conversation_closed");
    // Both turns are settled by the close: the stopping one will not be settled again (the
    // close is the last frame of a closed conversation).
    assert_eq!(turn_status(&node, conversation_id, seq).await, "closed");
    assert_eq!(turn_status(&node, conversation_id, second).await, "closed");
    agent.send(result(&conversation, seq, "too late")).await;
    let refused = agent.skip_to_enveloped("error").await;
    assert_eq!(refused["data"]["code"], "conversation_closed");
}

#[tokio::test]
async fn a_stopped_turn_is_never_handed_on_to_the_next_lease_mode_member() {
    // A long grace: the turn is still stopping when its member leaves and another joins.
    let node = TestNode::start_with(grace(30_000)).await;
    let (acme, conversation_id, token) = setup(&node).await;
    let agent_token = node.agent_token(&acme).await;
    let lease = json!({"group": "bot", "claim": "lease"});
    let mut first = WsClient::connect(&node.ws_url("")).await;
    let welcome = first.hello(&agent_token, lease.clone()).await;
    support::settle(&welcome).await;
    let mut tab = WsClient::connect(&node.ws_url("")).await;
    tab.hello(&token, json!({})).await;
    tab.send(json!({"type": "text", "clientId": "q-1", "data": {"text": "one"}}))
        .await;
    tab.skip_to("ack").await;
    let (_, stopped, _) = next_turn(&mut first).await;
    let (_, answer) = rest_stop(&node, conversation_id, &token, json!({})).await;
    assert_eq!(answer, json!({"stopped": true, "seq": stopped}));
    first.skip_to_enveloped("cancel").await;
    first.close().await;

    // The next member is handed what is pending, which the stopped turn is not: its first
    // delivery is the turn sent after it joined.
    let mut second = WsClient::connect(&node.ws_url("")).await;
    let welcome = second.hello(&agent_token, lease).await;
    support::settle(&welcome).await;
    tab.send(json!({"type": "text", "clientId": "q-2", "data": {"text": "two"}}))
        .await;
    let sent = tab.skip_to("ack").await["seq"].as_i64().unwrap();
    let (_, delivered, _) = next_turn(&mut second).await;
    assert_eq!(delivered, sent, "the stopped turn {stopped} was handed on");
    assert_eq!(
        turn_status(&node, conversation_id, stopped).await,
        "stopping"
    );
}

#[tokio::test]
async fn a_stop_without_a_seq_stops_every_waiting_turn_and_a_regenerate_after_a_stop_runs_on() {
    // The repeated stop and the regenerate below must come within the grace period.
    let node = TestNode::start_with(grace(2_000)).await;
    let (node, conversation_id, token, mut agent, mut tab, _, first) = turn_in_progress(node).await;
    // A second turn queued behind the first (enqueue): a stop button stops both.
    tab.send(json!({"type": "text", "clientId": "q-2", "data": {"text": "and then?"}}))
        .await;
    let second = tab.skip_to("ack").await["seq"].as_i64().unwrap();
    next_turn(&mut agent).await;
    let (_, answer) = rest_stop(&node, conversation_id, &token, json!({})).await;
    assert_eq!(answer, json!({"stopped": true, "seq": second}));
    let mut cancelled = vec![
        agent.skip_to_enveloped("cancel").await["turn"]["seq"].as_i64(),
        agent.skip_to_enveloped("cancel").await["turn"]["seq"].as_i64(),
    ];
    cancelled.sort();
    assert_eq!(cancelled, vec![Some(first), Some(second)]);
    // A repeat names the turn still stopping.
    let (_, again) = rest_stop(&node, conversation_id, &token, json!({})).await;
    assert_eq!(again, json!({"stopped": true, "seq": second}));

    // Regenerated within the grace period: the new revision runs on, the stopped one is
    // settled without a frame and is never picked up again.
    tab.send(json!({"type": "regenerate", "clientId": "g-1", "seq": second}))
        .await;
    let regenerated = tab.skip_to("ack").await;
    assert_eq!(regenerated["turn"]["revision"], 1);
    let delivered = loop {
        let envelope = agent.recv().await;
        if envelope["frame"]["meta"]["turn"]["revision"] == 1 {
            break envelope;
        }
    };
    assert_eq!(delivered["frame"]["meta"]["turn"]["seq"], second);
    support::eventually(
        "the stopped revision settled",
        Duration::from_secs(10),
        || {
            let node = &node;
            async move {
                node.db
                    .count(&format!(
                        "SELECT count(*) FROM turns WHERE conversation_id = '{conversation_id}'
                     AND seq = {second} AND revision = 0 AND status = 'stopped'"
                    ))
                    .await
                    == 1
            }
        },
    )
    .await;
    assert_eq!(turn_status(&node, conversation_id, second).await, "pending");
    // A seq beyond any there can be is no turn, never "the latest".
    tab.send(json!({"type": "stop", "clientId": "s-big", "seq": u64::MAX}))
        .await;
    let error = tab.skip_to("error").await;
    assert_eq!(error["data"]["code"], "bad_request");
    assert_eq!(turn_status(&node, conversation_id, second).await, "pending");

    // A stop of the regenerated revision: its member's cancel names the revision.
    let (_, answer) = rest_stop(&node, conversation_id, &token, json!({"seq": second})).await;
    assert_eq!(answer, json!({"stopped": true, "seq": second}));
    let cancel = agent.skip_to_enveloped("cancel").await;
    assert_eq!(
        (
            cancel["turn"]["seq"].as_i64(),
            cancel["turn"]["revision"].as_i64()
        ),
        (Some(second), Some(1))
    );
}
