//! Streamed answers (docs/protocol.md §4.9): chunks reach every tab of the conversation once and
//! in order, on every node, a tab that joins or reconnects mid-stream gets the stream so far,
//! the stream ends in the committed result or an abort marker, and the limits hold. What a
//! stream costs the database is measured alone in `stream_cost.rs`.

mod support;

use serde_json::{Value, json};
use support::mekik::Widget;
use support::tab::Tab;
use support::ws::WsClient;
use support::{
    TestNode, next_turn, send_numbered_chunks, setup, stream_chunk as chunk, turn_in_progress,
};

fn fast_settle(config: &mut converger_gateway::Config) {
    config.group_settle_ms = 100;
}

fn result(conversation: &str, seq: i64, stream: &str, text: &str) -> Value {
    json!({"conversationId": conversation, "frame": {
        "type": "turnResult", "clientId": format!("r-{seq}"), "turn": {"seq": seq},
        "frames": [{"type": "text", "streamId": stream, "data": {"text": text}}]}})
}

#[tokio::test]
async fn every_tab_sees_each_chunk_once_in_order_then_the_committed_answer() {
    let node = TestNode::start_with(fast_settle).await;
    let (node, _, token, mut agent, mut first, conversation, seq) = turn_in_progress(node).await;
    let mut first_tab = Tab::default();
    for (index, word) in ["Hel", "lo", " the"].iter().enumerate() {
        agent
            .send(chunk(&conversation, "s-1", index as u64, seq, word))
            .await;
    }
    first_tab
        .read_until(&mut first, |tab| tab.chunks_of("s-1") == 3)
        .await;

    // A second tab joins mid-stream: the stored frames, then the stream so far, then live.
    let mut second = WsClient::connect(&node.ws_url("")).await;
    second.hello(&token, json!({})).await;
    let mut second_tab = Tab::default();
    second_tab
        .read_until(&mut second, |tab| tab.chunks_of("s-1") == 3)
        .await;
    assert_eq!(second_tab.text["s-1"], "Hello the");
    assert_eq!(second_tab.stored.len(), 1, "the question came first");

    for (index, word) in ["re", "!"].iter().enumerate() {
        agent
            .send(chunk(&conversation, "s-1", index as u64 + 3, seq, word))
            .await;
    }
    agent
        .send(result(&conversation, seq, "s-1", "Hello there!"))
        .await;
    for (tab, client) in [(&mut first_tab, &mut first), (&mut second_tab, &mut second)] {
        tab.read_until(client, |tab| {
            tab.ended.contains_key("s-1") && tab.stored.iter().any(|f| f["from"] == "bot")
        })
        .await;
        assert_eq!(tab.text["s-1"], "Hello there!");
        assert_eq!(tab.ended["s-1"], "committed");
        let answer = tab.stored.iter().find(|f| f["from"] == "bot").unwrap();
        assert_eq!(
            answer["id"], "s-1",
            "the stored answer takes the stream's id"
        );
        assert_eq!(answer["streamId"], "s-1");
    }

    // After the commit, a late joiner sees only the stored answer.
    let mut late = WsClient::connect(&node.ws_url("")).await;
    late.hello(&token, json!({})).await;
    let before_barrier = late.barrier().await;
    assert!(
        before_barrier
            .iter()
            .all(|frame| frame["type"] != "streamChunk" && frame["type"] != "streamEnd"),
        "{before_barrier:?}"
    );
    assert_eq!(support::seqs(&before_barrier).len(), 2);
}

#[tokio::test]
async fn a_tab_cut_mid_stream_resumes_it_and_an_agent_that_leaves_aborts_it() {
    let node = TestNode::start_with(fast_settle).await;
    let (node, _, token, mut agent, mut tab, conversation, seq) = turn_in_progress(node).await;
    let mut seen = Tab::default();
    agent
        .send(chunk(&conversation, "s-1", 0, seq, "one "))
        .await;
    agent
        .send(chunk(&conversation, "s-1", 1, seq, "two "))
        .await;
    seen.read_until(&mut tab, |tab| tab.chunks_of("s-1") == 2)
        .await;
    drop(tab);
    agent
        .send(chunk(&conversation, "s-1", 2, seq, "three"))
        .await;

    // The reconnected tab gets the open stream from its start, as one stream.
    let mut again = WsClient::connect(&node.ws_url("")).await;
    again.hello(&token, json!({"watermark": 1})).await;
    let mut resumed = Tab::default();
    resumed
        .read_until(&mut again, |tab| tab.chunks_of("s-1") == 3)
        .await;
    assert_eq!(resumed.text["s-1"], "one two three");

    // The agent goes away mid-stream: the tab is told, so a UI can clear the partial bubble.
    agent.close().await;
    resumed
        .read_until(&mut again, |tab| tab.ended.contains_key("s-1"))
        .await;
    assert_eq!(resumed.ended["s-1"], "aborted");
}

/// The enveloped error answering an agent's frame.
async fn agent_error(agent: &mut WsClient) -> Value {
    loop {
        let frame = agent.recv().await;
        if frame["frame"]["type"] == "error" {
            return frame["frame"]["data"].clone();
        }
    }
}

#[tokio::test]
async fn stream_limits_and_order_are_enforced_with_their_errors() {
    let node = TestNode::start_with(|config| {
        fast_settle(config);
        config.limits.max_stream_bytes = 10;
        config.limits.max_streams_per_connection = 2;
    })
    .await;
    let (node, _, _, mut agent, mut tab, conversation, seq) = turn_in_progress(node).await;
    let observer_token = node
        .agent_token(&node.tenant_with_channel("other").await)
        .await;
    let (_, welcome) = node.agent(&observer_token, None).await;
    assert_eq!(welcome["data"]["limits"]["maxStreamBytes"], 10);
    assert_eq!(welcome["data"]["limits"]["maxStreamsPerConnection"], 2);

    // (frame, the error it gets, whether the schemas accept it: the server's checks go further)
    let refusals = [
        (
            chunk(&conversation, "s-1", 1, seq, "x"),
            "invalid_message",
            true,
        ),
        (
            json!({"conversationId": conversation, "frame": {
                "type": "streamChunk", "streamId": "s-1", "index": 0, "text": "x"}}),
            "invalid_message",
            false,
        ),
        (
            json!({"conversationId": conversation, "frame": {
                "type": "streamChunk", "streamId": "s-1", "index": 0, "text": "x",
                "turn": {"seq": seq + 40}}}),
            "bad_request",
            true,
        ),
        (
            json!({"conversationId": conversation, "frame": {
                "type": "streamAbort", "streamId": "never-opened"}}),
            "stream_closed",
            true,
        ),
    ];
    for (frame, code, conforms) in refusals {
        if conforms {
            agent.send(frame.clone()).await;
        } else {
            agent.send_invalid(frame.clone()).await;
        }
        let error = agent_error(&mut agent).await;
        assert_eq!(error["code"], code, "{frame}");
    }

    agent.send(chunk(&conversation, "a", 0, seq, "12345")).await;
    agent.send(chunk(&conversation, "b", 0, seq, "1")).await;
    agent.send(chunk(&conversation, "c", 0, seq, "1")).await;
    assert_eq!(agent_error(&mut agent).await["code"], "too_many_streams");
    // Over maxStreamBytes: refused, and the stream ends for its viewers.
    agent
        .send(chunk(&conversation, "a", 1, seq, "678901"))
        .await;
    let error = agent_error(&mut agent).await;
    assert_eq!(error["code"], "payload_too_large");
    assert_eq!(error["details"]["streamId"], "a");
    agent.send(chunk(&conversation, "a", 2, seq, "x")).await;
    assert_eq!(agent_error(&mut agent).await["code"], "stream_closed");
    let mut seen = Tab::default();
    seen.read_until(&mut tab, |tab| tab.ended.contains_key("a"))
        .await;
    assert_eq!(seen.ended["a"], "aborted");
    assert_eq!(seen.text["a"], "12345", "the refused chunk was never shown");
    assert!(!seen.indices.contains_key("c"));

    // The agent's own abort, then the answered turn accepts no new stream.
    agent
        .send(json!({"conversationId": conversation, "frame": {
            "type": "streamAbort", "streamId": "b", "reason": "changed my mind"}}))
        .await;
    seen.read_until(&mut tab, |tab| tab.ended.contains_key("b"))
        .await;
    agent.send(result(&conversation, seq, "b", "done")).await;
    loop {
        let frame = agent.recv().await;
        if frame["frame"]["type"] == "ack" {
            break;
        }
    }
    agent.send(chunk(&conversation, "d", 0, seq, "late")).await;
    assert_eq!(agent_error(&mut agent).await["code"], "stream_closed");
}

#[tokio::test]
async fn a_mekik_widget_renders_the_stream_as_one_genui_bubble() {
    let node = TestNode::start_with(fast_settle).await;
    let (acme, _, token) = setup(&node).await;
    let agent_token = node.agent_token(&acme).await;
    let (mut agent, welcome) = node.agent(&agent_token, Some("bot")).await;
    support::settle(&welcome).await;
    let mut widget = Widget::new(&node.ws_url(""), &token);
    let widget_welcome = widget.connect().await;
    assert_eq!(widget_welcome["data"]["capabilities"]["streams"], true);
    widget.send_text("hello?").await;
    let (conversation, seq, _) = next_turn(&mut agent).await;
    for (index, word) in ["Hello", " there"].iter().enumerate() {
        agent
            .send(chunk(&conversation, "s-9", index as u64, seq, word))
            .await;
    }
    agent
        .send(result(&conversation, seq, "s-9", "Hello there"))
        .await;
    widget.read_through(2).await;
    widget.read_until(|frame| frame["done"] == true).await;
    let chunks: Vec<&Value> = widget
        .received
        .iter()
        .filter(|frame| frame["type"] == "genui")
        .collect();
    assert_eq!(chunks.len(), 3, "two chunks and the end: {chunks:?}");
    assert_eq!(
        chunks[0]["chunk"],
        json!({"type": "text", "content": "Hello", "id": "s-9"})
    );
    assert_eq!(chunks[0]["done"], false);
    assert_eq!(chunks[2]["done"], true);
    let bot: Vec<_> = widget.bubbles_from("bot");
    assert_eq!(bot.len(), 1, "{:?}", widget.bubbles);
    assert_eq!(bot[0].text, "Hello there");
}

#[tokio::test]
async fn a_fenced_member_cannot_stream_and_its_stream_ends_when_its_result_is_refused() {
    let node = TestNode::start_with(fast_settle).await;
    let (acme, conversation_id, token) = setup(&node).await;
    let agent_token = node.agent_token(&acme).await;
    let mut agent = WsClient::connect(&node.ws_url("")).await;
    let welcome = agent
        .hello(&agent_token, json!({"group": "bot", "claim": "lease"}))
        .await;
    support::settle(&welcome).await;
    let mut tab = WsClient::connect(&node.ws_url("")).await;
    tab.hello(&token, json!({})).await;
    tab.send(json!({"type": "text", "clientId": "q-1", "data": {"text": "hi"}}))
        .await;
    let (conversation, seq, fence) = next_turn(&mut agent).await;
    let fence = fence.expect("lease mode delivers a fence");
    let fenced_chunk = |stream: &str, index: u64, fence: i64| {
        let mut frame = chunk(&conversation, stream, index, seq, "x");
        if index == 0 {
            frame["frame"]["turn"]["fence"] = json!(fence);
        }
        frame
    };
    agent.send(fenced_chunk("s-1", 0, fence)).await;
    let mut seen = Tab::default();
    seen.read_until(&mut tab, |tab| tab.chunks_of("s-1") == 1)
        .await;

    // Another holder claims the turn (what a lease that ran out and a new claim do).
    let mut db = node.db.connect().await;
    sqlx::query(
        "UPDATE turns SET fence = fence + 1, claimed_by = 'elsewhere'
         WHERE conversation_id = $1 AND seq = $2",
    )
    .bind(conversation_id)
    .bind(seq)
    .execute(&mut db)
    .await
    .unwrap();
    agent.send(fenced_chunk("s-2", 0, fence)).await;
    assert_eq!(agent_error(&mut agent).await["code"], "lease_lost");
    agent
        .send(json!({"conversationId": conversation, "frame": {
            "type": "turnResult", "clientId": "r-1", "turn": {"seq": seq, "fence": fence},
            "frames": [{"type": "text", "streamId": "s-1", "data": {"text": "x"}}]}}))
        .await;
    assert_eq!(agent_error(&mut agent).await["code"], "lease_lost");
    seen.read_until(&mut tab, |tab| tab.ended.contains_key("s-1"))
        .await;
    assert_eq!(seen.ended["s-1"], "aborted");
    agent.send(fenced_chunk("s-1", 1, fence)).await;
    assert_eq!(agent_error(&mut agent).await["code"], "stream_closed");
    let shown = tab.barrier().await;
    assert!(
        shown.iter().all(|frame| frame["type"] != "streamChunk"),
        "the late chunk was never shown: {shown:?}"
    );
}

#[tokio::test]
async fn tabs_on_three_nodes_see_the_same_chunks_in_the_same_order() {
    let node = TestNode::start_with(fast_settle).await;
    let second_node = node.start_peer().await;
    let third_node = node.start_peer().await;
    let (node, _, token, mut agent, mut here, conversation, seq) = turn_in_progress(node).await;
    let mut there = WsClient::connect(&support::peer_ws_url(&second_node)).await;
    there.hello(&token, json!({})).await;
    let mut here_tab = Tab::default();
    let mut there_tab = Tab::default();
    send_numbered_chunks(&mut agent, &conversation, seq, 0..20).await;
    here_tab
        .read_until(&mut here, |tab| tab.chunks_of("s-1") == 20)
        .await;
    there_tab
        .read_until(&mut there, |tab| tab.chunks_of("s-1") == 20)
        .await;
    assert_eq!(here_tab.text, there_tab.text);

    // A tab that connects mid-stream on a third node gets every chunk once.
    let (mut third, mut third_tab) =
        Tab::join(&support::peer_ws_url(&third_node), &token, "s-1", 20).await;
    send_numbered_chunks(&mut agent, &conversation, seq, 20..30).await;
    agent.send(result(&conversation, seq, "s-1", "all")).await;
    for (tab, client) in [
        (&mut here_tab, &mut here),
        (&mut there_tab, &mut there),
        (&mut third_tab, &mut third),
    ] {
        tab.read_until(client, |tab| {
            tab.ended.contains_key("s-1") && tab.stored.iter().any(|f| f["from"] == "bot")
        })
        .await;
        assert_eq!(tab.chunks_of("s-1"), 30);
        assert_eq!(tab.ended["s-1"], "committed");
    }
    assert_eq!(here_tab.text, third_tab.text);
    drop((node, second_node, third_node));
}

#[tokio::test]
async fn the_rust_client_streams_an_answer_and_assembles_it_across_a_reconnect() {
    use converger_client::agent::Agent;
    use converger_client::{AnswerStream, ServerFrame, StreamAssembly};

    let node = TestNode::start_with(fast_settle).await;
    let (acme, _, token) = setup(&node).await;
    let agent_token = node.agent_token(&acme).await;
    let mut agent = Agent::connect(&node.ws_url(""), &agent_token, Some("bot"))
        .await
        .unwrap();
    support::settle(&json!({"data": agent.welcome()})).await;
    let mut tab = WsClient::connect(&node.ws_url("")).await;
    tab.hello(&token, json!({})).await;
    tab.send(json!({"type": "text", "clientId": "q-1", "data": {"text": "hi"}}))
        .await;
    let turn = agent.next_turn().await.unwrap();
    let mut stream = AnswerStream::open(&turn, "rust-1");
    stream.text(&mut agent, "Hello ").await.unwrap();

    let mut assembly = StreamAssembly::default();
    let read_until = async |tab: &mut WsClient,
                            assembly: &mut StreamAssembly,
                            done: &dyn Fn(&StreamAssembly) -> bool| {
        while !done(assembly) {
            match ServerFrame::parse(tab.recv().await) {
                ServerFrame::StreamChunk(chunk) => {
                    assembly.apply_chunk(&chunk);
                }
                ServerFrame::StreamEnd(end) => assembly.apply_end(&end),
                _ => {}
            }
        }
    };
    read_until(&mut tab, &mut assembly, &|a| a.get("rust-1").is_some()).await;
    // The tab reconnects: the open stream comes again from its start and nothing doubles.
    drop(tab);
    stream.text(&mut agent, "world").await.unwrap();
    let mut tab = WsClient::connect(&node.ws_url("")).await;
    tab.hello(&token, json!({})).await;
    read_until(&mut tab, &mut assembly, &|a| {
        a.get("rust-1").is_some_and(|s| s.next_index == 2)
    })
    .await;
    let frames = vec![json!({"type": "text", "data": {"text": "Hello world"}})];
    let ack = stream
        .finish(&mut agent, &turn, frames, None)
        .await
        .unwrap();
    assert_eq!(ack.seqs.len(), 1);
    read_until(&mut tab, &mut assembly, &|a| {
        a.get("rust-1").is_some_and(|s| s.ended.is_some())
    })
    .await;
    let assembled = assembly.get("rust-1").unwrap();
    assert_eq!(assembled.text, "Hello world");
    assert_eq!(assembled.ended, Some(true));
}

/// A node whose agents may stream fast (the chunk rate is the agent connection's frame rate).
fn fast_agents(config: &mut converger_gateway::Config) {
    fast_settle(config);
    config.limits.max_frames_per_sec = 100_000;
}

#[tokio::test]
async fn tabs_of_both_profiles_joining_a_ten_thousand_chunk_stream_get_it_once_and_stay() {
    let node = TestNode::start_with(fast_agents).await;
    let (node, _, token, mut agent, tab, conversation, seq) = turn_in_progress(node).await;
    // The asking tab leaves: what matters here is who joins after the chunks.
    drop(tab);
    let so_far = support::stream_words(&mut agent, &conversation, "s-1", seq, 0..10_000).await;

    // A converger tab joins: the question, then the stream so far (coalesced), not a 4503.
    let mut joiner = WsClient::connect(&node.ws_url("")).await;
    joiner.hello(&token, json!({})).await;
    let mut seen = Tab::default();
    seen.read_until(&mut joiner, |tab| tab.chunks_of("s-1") == 10_000)
        .await;
    assert_eq!(seen.text["s-1"], so_far);
    assert_eq!(seen.stored.len(), 1, "the question came first");

    // A mekik widget joins: one bubble holding the text so far.
    let mut widget = Widget::new(&node.ws_url(""), &token);
    widget.connect().await;
    let mut shown = String::new();
    while shown != so_far {
        widget.read_until(|frame| frame["type"] == "genui").await;
        shown = widget
            .bubbles
            .iter()
            .find(|bubble| bubble.id == "mekik-text-s-1-s-1")
            .map(|bubble| bubble.text.clone())
            .unwrap_or_default();
        assert!(so_far.starts_with(&shown), "no text twice: {shown:?}");
    }

    // The live rest reaches both once, then the committed answer ends the stream.
    agent
        .send(chunk(&conversation, "s-1", 10_000, seq, "end"))
        .await;
    let full = format!("{so_far}end");
    // The stored answer is short (the test's frame limit is 16 KiB); it replaces the stream.
    agent
        .send(result(&conversation, seq, "s-1", "a long answer"))
        .await;
    seen.read_until(&mut joiner, |tab| tab.ended.contains_key("s-1"))
        .await;
    assert_eq!(
        (seen.text["s-1"].as_str(), seen.ended["s-1"].as_str()),
        (full.as_str(), "committed")
    );
    widget.read_until(|frame| frame["done"] == true).await;
    let bot = widget.bubbles_from("bot");
    assert_eq!(bot.len(), 1, "one bubble: {:?}", widget.bubbles.len());
    assert_eq!(bot[0].text, full);
}

#[tokio::test]
async fn stream_budgets_per_channel_and_per_node_refuse_with_their_codes() {
    let node = TestNode::start_with(|config| {
        fast_settle(config);
        config.limits.max_stream_bytes = 800;
        config.limits.max_stream_bytes_per_channel = 1_000;
        config.limits.max_stream_bytes_per_node = 1_500;
    })
    .await;
    let (node, _, _, mut agent, mut tab, conversation, seq) = turn_in_progress(node).await;
    let limits = &agent_welcome_limits(&node).await;
    assert_eq!(
        (
            &limits["maxStreamBytesPerChannel"],
            &limits["maxStreamBytesPerNode"]
        ),
        (&json!(1_000), &json!(1_500))
    );
    let words = |bytes: usize| "x".repeat(bytes);
    agent
        .send(chunk(&conversation, "a", 0, seq, &words(600)))
        .await;
    // A second stream of the channel would take it over its budget: not opened.
    agent
        .send(chunk(&conversation, "b", 0, seq, &words(600)))
        .await;
    let refused = agent_error(&mut agent).await;
    assert_eq!(refused["code"], "too_many_streams");
    assert_eq!(
        (
            &refused["details"]["budget"],
            &refused["details"]["streamId"]
        ),
        (&json!("channel"), &json!("b"))
    );
    // Growing an open one past the budget (not past its own limit) aborts it, and its viewers
    // are told. (What the relay has not sent yet counts against the node's budget: each step
    // waits until it is sent.)
    relay_drained(&node).await;
    agent
        .send(chunk(&conversation, "e", 0, seq, &words(300)))
        .await;
    agent
        .send(chunk(&conversation, "a", 1, seq, &words(150)))
        .await;
    let aborted = agent_error(&mut agent).await;
    assert_eq!(
        (&aborted["code"], &aborted["details"]["budget"]),
        (&json!("payload_too_large"), &json!("channel"))
    );
    let mut seen = Tab::default();
    seen.read_until(&mut tab, |tab| tab.ended.contains_key("a"))
        .await;
    assert_eq!(seen.ended["a"], "aborted");
    assert_eq!(seen.chunks_of("b"), 0, "a refused opening shows nothing");

    // Another channel's agent on the same node: the node's budget holds across channels.
    let other = node.tenant_with_channel("globex").await;
    let other_token = node.agent_token(&other).await;
    let (mut other_agent, welcome) = node.agent(&other_token, Some("bot")).await;
    support::settle(&welcome).await;
    let (other_conversation, other_user) = node.conversation(&other, "bob").await;
    let mut other_tab = WsClient::connect(&node.ws_url("")).await;
    other_tab.hello(&other_user, json!({})).await;
    other_tab
        .send(json!({"type": "text", "clientId": "q-1", "data": {"text": "hi"}}))
        .await;
    let (other_conversation_id, other_seq, _) = next_turn(&mut other_agent).await;
    assert_eq!(other_conversation_id, other_conversation.to_string());
    relay_drained(&node).await;
    agent
        .send(chunk(&conversation, "c", 0, seq, &words(700)))
        .await;
    support::wait_until_taken(&mut agent, &conversation, "c", seq, 1).await;
    relay_drained(&node).await;
    other_agent
        .send(chunk(
            &other_conversation_id,
            "d",
            0,
            other_seq,
            &words(600),
        ))
        .await;
    let over_node = agent_error(&mut other_agent).await;
    assert_eq!(
        (&over_node["code"], &over_node["details"]["budget"]),
        (&json!("too_many_streams"), &json!("node"))
    );
}

/// Waits until the node's relay has sent every stream event to the other nodes.
async fn relay_drained(node: &TestNode) {
    support::eventually(
        "the stream relay has nothing left to send",
        std::time::Duration::from_secs(10),
        || async {
            node.metrics()
                .await
                .lines()
                .any(|line| line == "converger_stream_relay_backlog_bytes 0")
        },
    )
    .await;
}

/// The `limits` a fresh agent connection of a new channel is told at welcome.
async fn agent_welcome_limits(node: &TestNode) -> Value {
    let fixture = node.tenant_with_channel("limits").await;
    let token = node.agent_token(&fixture).await;
    let (_, welcome) = node.agent(&token, None).await;
    welcome["data"]["limits"].clone()
}
