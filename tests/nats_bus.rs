//! The cluster buses other than Postgres (ADR 0033). Over real `nats-server` processes:
//! commits, streams and transient frames cross nodes with no `pg_notify` at all; a NATS server
//! killed and restarted, a node cut off from NATS while the database stays up, and a NATS
//! cluster losing the server a node uses lose no committed frame, and streams work again
//! afterwards. And a node alone on the `local` bus, which publishes nothing.

mod support;

use std::time::Duration;

use converger_gateway::Config;
use converger_gateway::config::BusKind;
use serde_json::{Value, json};
use sqlx::postgres::PgListener;
use support::nats::NatsServer;
use support::proxy::Proxy;
use support::tab::Tab;
use support::ws::WsClient;
use support::{TestNode, send_numbered_chunks, stream_chunk, turn_in_progress};

/// Sweeps far apart: whatever crosses nodes within a test came over NATS.
const NO_SWEEP_MS: u64 = 600_000;

/// Sweeps often: a commit whose publication was lost reaches the other nodes quickly.
const FAST_SWEEP_MS: u64 = 200;

fn on_nats(servers: Vec<String>, sweep_ms: u64) -> impl Fn(&mut Config) + Clone {
    move |config: &mut Config| {
        config.group_settle_ms = 100;
        config.bus = BusKind::Nats;
        config.nats.servers = servers.clone();
        config.nats.sweep_ms = sweep_ms;
        config.nats.connect_timeout_ms = 2_000;
    }
}

fn result(conversation: &str, seq: i64, stream: &str, text: &str) -> Value {
    json!({"conversationId": conversation, "frame": {
        "type": "turnResult", "clientId": format!("r-{seq}-{stream}"), "turn": {"seq": seq},
        "frames": [{"type": "text", "streamId": stream, "data": {"text": text}}]}})
}

/// Streams `count` chunks of `stream` for turn `seq`, then commits `text` as its answer.
async fn stream_and_answer(
    agent: &mut WsClient,
    conversation: &str,
    seq: i64,
    stream: &str,
    count: u64,
    text: &str,
) {
    for index in 0..count {
        agent
            .send(stream_chunk(
                conversation,
                stream,
                index,
                seq,
                &format!("{index} "),
            ))
            .await;
    }
    agent.send(result(conversation, seq, stream, text)).await;
}

/// Reads `client` until `stream` ended and `answer` is among the stored answers; returns how
/// many chunks of it arrived.
async fn read_answer(tab: &mut Tab, client: &mut WsClient, stream: &str, answer: &str) -> usize {
    tab.read_until(client, |tab| {
        tab.answers().iter().any(|text| text == answer)
            && (tab.ended.contains_key(stream) || tab.chunks_of(stream) == 0)
    })
    .await;
    tab.chunks_of(stream)
}

/// Waits until the agent's typing reaches `to` over the bus: both nodes are connected to NATS
/// and subscribed again. Each probe (typing on and off by turns, which no throttle holds back)
/// waits a moment for its echo before the next.
async fn until_typing_crosses(agent: &mut WsClient, conversation: &str, to: &mut WsClient) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut typing = true;
    loop {
        agent
            .send(json!({"conversationId": conversation,
                         "frame": {"type": "typing", "isTyping": typing}}))
            .await;
        typing = !typing;
        while let Some(Ok(frame)) = to.poll_event(Duration::from_millis(300)).await {
            if frame["type"] == "typing" {
                return;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "typing never crossed the NATS bus"
        );
    }
}

/// A tab on `peer` for `token`'s conversation, once the agent's typing reaches it over the bus.
async fn tab_hearing_the_agent(
    peer: &converger_gateway::ServerHandle,
    token: &str,
    agent: &mut WsClient,
    conversation: &str,
) -> WsClient {
    let mut tab = WsClient::connect(&support::peer_ws_url(peer)).await;
    tab.hello(token, json!({})).await;
    until_typing_crosses(agent, conversation, &mut tab).await;
    tab
}

/// A text from `tab`, acked; returns its seq.
async fn say(tab: &mut WsClient, client_id: &str, text: &str) -> i64 {
    tab.send(json!({"type": "text", "clientId": client_id, "data": {"text": text}}))
        .await;
    let ack = tab.skip_to("ack").await;
    ack["seq"].as_i64().expect("an ack with its seq")
}

/// Reads `client` until a stored frame with `text` arrived.
async fn until_text(client: &mut WsClient, text: &str) -> Value {
    loop {
        let frame = client.recv().await;
        if frame["data"]["text"] == text && frame["seq"].is_i64() {
            return frame;
        }
    }
}

#[tokio::test]
async fn commits_streams_and_typing_cross_nodes_over_nats_with_no_notification() {
    let nats = NatsServer::start().await;
    let adjust = on_nats(vec![nats.url()], NO_SWEEP_MS);
    let node = TestNode::start_with(adjust.clone()).await;
    let peer = node.start_peer_with(adjust).await;
    let mut notifications = PgListener::connect(&node.db.url).await.unwrap();
    notifications.listen("converger_events").await.unwrap();

    let (node, _, token, mut agent, mut here, conversation, seq) = turn_in_progress(node).await;
    let mut there = tab_hearing_the_agent(&peer, &token, &mut agent, &conversation).await;

    // The agent's node streams; the tab on the other node sees every chunk once, in order,
    // then the committed answer.
    stream_and_answer(&mut agent, &conversation, seq, "s-1", 30, "all thirty").await;
    let mut there_tab = Tab::default();
    let chunks = read_answer(&mut there_tab, &mut there, "s-1", "all thirty").await;
    assert_eq!(chunks, 30, "{there_tab:?}");
    assert_eq!(there_tab.ended["s-1"], "committed");
    let mut here_tab = Tab::default();
    read_answer(&mut here_tab, &mut here, "s-1", "all thirty").await;
    assert_eq!(here_tab.text, there_tab.text);

    // A turn sent on the other node reaches the agent, and its frame the first node's tab.
    let sent = say(&mut there, "q-2", "from the peer").await;
    let (_, delivered, _) = support::next_turn(&mut agent).await;
    assert_eq!(delivered, sent);
    assert_eq!(until_text(&mut here, "from the peer").await["seq"], sent);

    // Nothing went through Postgres's notifications: the first one this listener hears is
    // the marker sent after everything above.
    sqlx::query("SELECT pg_notify('converger_events', 'marker')")
        .execute(&mut node.db.connect().await)
        .await
        .unwrap();
    let first = notifications.recv().await.unwrap();
    assert_eq!(first.payload(), "marker");
    drop((node, peer, nats));
}

/// ADR 0039: the runtime an answer writes travels with its commit over NATS too.
#[tokio::test]
async fn a_runtime_written_on_one_node_travels_with_its_commit_over_nats() {
    let nats = NatsServer::start().await;
    support::runtimes::travels_with_its_commit(on_nats(vec![nats.url()], NO_SWEEP_MS)).await;
    drop(nats);
}

#[tokio::test]
async fn a_nats_server_killed_and_restarted_loses_no_frame_and_streams_resume() {
    let mut nats = NatsServer::start().await;
    let adjust = on_nats(vec![nats.url()], FAST_SWEEP_MS);
    let node = TestNode::start_with(adjust.clone()).await;
    let peer = node.start_peer_with(adjust).await;
    let (node, _, token, mut agent, mut here, conversation, seq) = turn_in_progress(node).await;
    let mut there = tab_hearing_the_agent(&peer, &token, &mut agent, &conversation).await;
    agent
        .send(result(&conversation, seq, "s-0", "before"))
        .await;
    until_text(&mut there, "before").await;

    nats.kill();
    // With NATS down, commits still cross (read back from the outbox): a turn sent on the
    // peer reaches the agent, and the first node's frames the peer's tab.
    let sent = say(&mut there, "down-1", "while nats is down").await;
    let (_, delivered, _) = support::next_turn(&mut agent).await;
    assert_eq!(delivered, sent);
    agent
        .send(result(&conversation, sent, "s-1", "answered while down"))
        .await;
    until_text(&mut there, "answered while down").await;
    let mine = say(&mut here, "down-2", "the first node, while down").await;
    assert_eq!(
        until_text(&mut there, "the first node, while down").await["seq"],
        mine
    );
    let (_, delivered, _) = support::next_turn(&mut agent).await;
    assert_eq!(delivered, mine);

    nats.restart().await;
    until_typing_crosses(&mut agent, &conversation, &mut there).await;
    let sent = say(&mut here, "up-1", "nats is back").await;
    let (_, delivered, _) = support::next_turn(&mut agent).await;
    assert_eq!(delivered, sent);
    stream_and_answer(&mut agent, &conversation, sent, "s-2", 20, "streamed again").await;
    let mut there_tab = Tab::default();
    let chunks = read_answer(&mut there_tab, &mut there, "s-2", "streamed again").await;
    assert_eq!(chunks, 20, "{there_tab:?}");
    assert_eq!(there_tab.ended["s-2"], "committed");
    assert_no_gap(&node, &token).await;
    drop((node, peer, nats));
}

#[tokio::test]
async fn a_node_cut_off_from_nats_keeps_its_commits_flowing_and_streams_after_it_is_back() {
    let nats = NatsServer::start().await;
    let proxy = Proxy::start(nats.addr).await;
    let node = TestNode::start_with(on_nats(
        vec![format!("nats://{}", proxy.addr)],
        FAST_SWEEP_MS,
    ))
    .await;
    let peer = node
        .start_peer_with(on_nats(vec![nats.url()], FAST_SWEEP_MS))
        .await;
    let (node, _, token, mut agent, _, conversation, seq) = turn_in_progress(node).await;
    let mut there = tab_hearing_the_agent(&peer, &token, &mut agent, &conversation).await;

    proxy.refuse();
    // The agent's node is cut off from NATS, the database is up: its stream cannot reach the
    // other node, but its committed answer does, and the other node's turns reach its agent.
    stream_and_answer(
        &mut agent,
        &conversation,
        seq,
        "s-1",
        10,
        "answered while cut",
    )
    .await;
    let mut cut_tab = Tab::default();
    read_answer(&mut cut_tab, &mut there, "s-1", "answered while cut").await;
    assert_eq!(
        cut_tab.chunks_of("s-1"),
        0,
        "no chunk crossed the cut: {cut_tab:?}"
    );
    let sent = say(&mut there, "cut-1", "sent to a cut node's agent").await;
    let (_, delivered, _) = support::next_turn(&mut agent).await;
    assert_eq!(delivered, sent);

    proxy.admit();
    until_typing_crosses(&mut agent, &conversation, &mut there).await;
    stream_and_answer(&mut agent, &conversation, sent, "s-2", 20, "after the cut").await;
    let mut there_tab = Tab::default();
    let chunks = read_answer(&mut there_tab, &mut there, "s-2", "after the cut").await;
    assert_eq!(chunks, 20, "{there_tab:?}");
    assert_no_gap(&node, &token).await;
    drop((node, peer, proxy, nats));
}

#[tokio::test]
async fn nodes_on_different_servers_of_a_nats_cluster_and_a_lost_server() {
    let mut servers = NatsServer::cluster(3).await;
    // Each node knows one server and learns the others from it.
    let node = TestNode::start_with(on_nats(vec![servers[0].url()], NO_SWEEP_MS)).await;
    let peer = node
        .start_peer_with(on_nats(vec![servers[2].url()], NO_SWEEP_MS))
        .await;
    let (node, _, token, mut agent, mut here, conversation, seq) = turn_in_progress(node).await;
    let mut there = tab_hearing_the_agent(&peer, &token, &mut agent, &conversation).await;
    stream_and_answer(&mut agent, &conversation, seq, "s-1", 20, "across routes").await;
    let mut there_tab = Tab::default();
    let chunks = read_answer(&mut there_tab, &mut there, "s-1", "across routes").await;
    assert_eq!(chunks, 20, "{there_tab:?}");

    // The first node's server dies: it reconnects to another server of the cluster.
    servers[0].kill();
    until_typing_crosses(&mut agent, &conversation, &mut there).await;
    let sent = say(&mut here, "q-2", "after a server died").await;
    let (_, delivered, _) = support::next_turn(&mut agent).await;
    assert_eq!(delivered, sent);
    stream_and_answer(
        &mut agent,
        &conversation,
        sent,
        "s-2",
        20,
        "still streaming",
    )
    .await;
    let chunks = read_answer(&mut there_tab, &mut there, "s-2", "still streaming").await;
    assert_eq!(chunks, 20, "{there_tab:?}");
    assert_no_gap(&node, &token).await;
    drop((node, peer, servers));
}

/// A new tab replays the whole conversation: seqs 1..=n, each once.
async fn assert_no_gap(node: &TestNode, token: &str) {
    let mut fresh = WsClient::connect(&node.ws_url("")).await;
    fresh.hello(token, json!({})).await;
    let seqs: Vec<i64> = fresh
        .barrier()
        .await
        .iter()
        .filter_map(|frame| frame["seq"].as_i64())
        .collect();
    let expected: Vec<i64> = (1..=seqs.len() as i64).collect();
    assert_eq!(seqs, expected);
}

#[tokio::test]
async fn a_node_alone_on_the_local_bus_serves_turns_and_streams_with_no_notification() {
    let node = TestNode::start_with(|config| {
        config.group_settle_ms = 100;
        config.bus = BusKind::Local;
    })
    .await;
    let mut notifications = PgListener::connect(&node.db.url).await.unwrap();
    notifications.listen("converger_events").await.unwrap();
    let (node, _, token, mut agent, mut here, conversation, seq) = turn_in_progress(node).await;
    let mut second_tab = WsClient::connect(&node.ws_url("")).await;
    second_tab.hello(&token, json!({})).await;
    stream_and_answer(&mut agent, &conversation, seq, "s-1", 10, "alone").await;
    for tab in [&mut here, &mut second_tab] {
        let mut seen = Tab::default();
        assert_eq!(read_answer(&mut seen, tab, "s-1", "alone").await, 10);
    }
    let sent = say(&mut second_tab, "q-2", "again").await;
    let (_, delivered, _) = support::next_turn(&mut agent).await;
    assert_eq!(delivered, sent);
    assert_eq!(until_text(&mut here, "again").await["seq"], sent);
    sqlx::query("SELECT pg_notify('converger_events', 'marker')")
        .execute(&mut node.db.connect().await)
        .await
        .unwrap();
    assert_eq!(notifications.recv().await.unwrap().payload(), "marker");
}

/// A node whose subscription overflows (a slow consumer: the NATS client drops what does not
/// fit) reads the outbox back, so every tab on it gets every commit once, long before a sweep.
/// Each conversation gets one frame, so a dropped message is the conversation's last one and
/// no later frame would reveal the gap to the tab.
#[tokio::test]
async fn a_slow_consumer_reads_back_what_its_subscription_dropped() {
    const CONVERSATIONS: usize = 40;
    let nats = NatsServer::start().await;
    let adjust = on_nats(vec![nats.url()], NO_SWEEP_MS);
    let node = TestNode::start_with(adjust.clone()).await;
    let peer = node
        .start_peer_with(move |config| {
            adjust(config);
            config.nats.subscription_capacity = 1;
        })
        .await;
    let acme = node.tenant_with_channel("acme").await;
    let mut writers = Vec::new();
    let mut tabs = Vec::new();
    for index in 0..CONVERSATIONS {
        let (_, token) = node.conversation(&acme, &format!("user-{index}")).await;
        let mut tab = WsClient::connect(&support::peer_ws_url(&peer)).await;
        tab.hello(&token, json!({})).await;
        tabs.push(tab);
        let mut writer = WsClient::connect(&node.ws_url("")).await;
        writer.hello(&token, json!({})).await;
        writers.push(writer);
    }
    let slow_consumers_before = slow_consumers(&node).await;

    // All at once, so the commits reach the peer in bursts its one-message buffer cannot hold.
    for (index, writer) in writers.iter_mut().enumerate() {
        writer
            .send(json!({"type": "text", "clientId": format!("burst-{index}"),
                         "data": {"text": format!("burst {index}")}}))
            .await;
    }
    for writer in &mut writers {
        writer.skip_to("ack").await;
    }
    for (index, tab) in tabs.iter_mut().enumerate() {
        let text = format!("burst {index}");
        let frame = tokio::time::timeout(Duration::from_secs(20), until_text(tab, &text))
            .await
            .unwrap_or_else(|_| panic!("{text} never reached the slow node's tab"));
        assert_eq!(frame["seq"], 1);
        // Once: nothing else of the conversation follows.
        while let Some(Ok(extra)) = tab.poll_event(Duration::from_millis(50)).await {
            assert!(
                extra["seq"].is_null(),
                "{text}: a frame came twice: {extra}"
            );
        }
    }
    assert!(
        slow_consumers(&node).await > slow_consumers_before,
        "the subscription never overflowed: the test proved nothing"
    );
}

/// `converger_bus_slow_consumers_total` as the process's metrics report it (every in-process
/// node shares one recorder).
async fn slow_consumers(node: &TestNode) -> f64 {
    let text = node
        .http
        .get(node.url("/metrics"))
        .send()
        .await
        .expect("metrics answer")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .filter(|line| line.starts_with("converger_bus_slow_consumers_total"))
        .filter_map(|line| line.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}

/// The NATS connection name of a node.
fn connection_name(node: &converger_gateway::ServerHandle) -> String {
    format!("converger {}", node.state().hub.node_id())
}

/// The text of chunks `0..count` as `send_numbered_chunks` sends them.
fn chunk_text(count: u64) -> String {
    (0..count).map(|index| format!("{index} ")).collect()
}

/// Waits until the node holds no open stream (its replicas went).
async fn until_no_open_stream(node: &converger_gateway::ServerHandle) {
    support::eventually(
        "the node dropping its replica of a stream it no longer follows",
        Duration::from_secs(10),
        || async { node.state().streams.usage().0 == 0 },
    )
    .await;
}

/// On NATS a node hears the stream events only of the conversations its tabs follow (ADR
/// 0035). A tab joining mid-stream on another node is shown what was streamed before it came,
/// then the rest, each chunk once; when its last tab goes the node drops its subscription and
/// its replica, and a tab coming back is shown the start again.
#[tokio::test]
async fn a_node_hears_only_the_streams_its_tabs_follow_and_a_late_tab_sees_the_start() {
    let nats = NatsServer::start().await;
    let adjust = on_nats(vec![nats.url()], NO_SWEEP_MS);
    let node = TestNode::start_with(adjust.clone()).await;
    let peer = node.start_peer_with(adjust).await;
    let (node, _, token, mut agent, mut here, conversation, seq) = turn_in_progress(node).await;
    let subject = format!("converger.s.{conversation}");
    let (node_name, peer_name) = (connection_name(&node.server), connection_name(&peer));

    send_numbered_chunks(&mut agent, &conversation, seq, 0..6).await;
    let mut here_tab = Tab::default();
    here_tab
        .read_until(&mut here, |tab| tab.chunks_of("s-1") == 6)
        .await;
    // Only the node with a tab subscribes to the conversation's streams; the peer's
    // subscriptions cover no stream subject, and it holds no replica.
    nats.until_subscribers(&subject, &[&node_name]).await;
    nats.until_subjects(&peer_name, &["converger.c.>", "converger.e", "converger.q"])
        .await;
    assert_eq!(
        peer.state().streams.usage().0,
        0,
        "the peer holds a replica"
    );

    // A tab on the peer mid-stream: the six chunks so far, then the rest.
    let (there, there_tab) = Tab::join(&support::peer_ws_url(&peer), &token, "s-1", 6).await;
    assert_eq!(there_tab.text["s-1"], chunk_text(6));
    nats.until_subscribers(&subject, &[&node_name, &peer_name])
        .await;

    // Its last tab gone, the peer unsubscribes and drops the replica.
    drop(there);
    nats.until_subscribers(&subject, &[&node_name]).await;
    until_no_open_stream(&peer).await;

    // Chunks sent meanwhile reach a new tab on the peer with the start; the rest follow live,
    // once each, then the end and the answer.
    send_numbered_chunks(&mut agent, &conversation, seq, 6..8).await;
    here_tab
        .read_until(&mut here, |tab| tab.chunks_of("s-1") == 8)
        .await;
    let (mut again, mut again_tab) =
        Tab::join(&support::peer_ws_url(&peer), &token, "s-1", 8).await;
    send_numbered_chunks(&mut agent, &conversation, seq, 8..10).await;
    agent.send(result(&conversation, seq, "s-1", "ten")).await;
    read_answer(&mut again_tab, &mut again, "s-1", "ten").await;
    assert_eq!(again_tab.chunks_of("s-1"), 10, "{again_tab:?}");
    assert_eq!(again_tab.text["s-1"], chunk_text(10));
    assert_eq!(again_tab.ended["s-1"], "committed");
    read_answer(&mut here_tab, &mut here, "s-1", "ten").await;
    assert_eq!(here_tab.text["s-1"], chunk_text(10));
}

/// A stop asked on a node that follows nothing of the conversation settles the turn with the
/// text the agent's node streamed, which that node kept (ADR 0035).
#[tokio::test]
async fn a_stop_on_a_node_without_the_stream_settles_with_the_text_the_agents_node_kept() {
    let nats = NatsServer::start().await;
    let on_nats_with_grace = {
        let adjust = on_nats(vec![nats.url()], NO_SWEEP_MS);
        move |config: &mut Config| {
            adjust(config);
            config.turns.stop_grace_ms = 300;
        }
    };
    let node = TestNode::start_with(on_nats_with_grace.clone()).await;
    let peer = node.start_peer_with(on_nats_with_grace).await;
    let (node, conversation_id, token, mut agent, mut here, conversation, seq) =
        turn_in_progress(node).await;
    send_numbered_chunks(&mut agent, &conversation, seq, 0..5).await;
    let mut here_tab = Tab::default();
    here_tab
        .read_until(&mut here, |tab| tab.chunks_of("s-1") == 5)
        .await;
    assert_eq!(
        peer.state().streams.usage().0,
        0,
        "the peer holds a replica"
    );

    let stopped = node
        .http
        .post(format!(
            "{}/api/v1/converger/conversations/{conversation_id}/stop",
            peer.base_url()
        ))
        .bearer_auth(&token)
        .json(&json!({}))
        .send()
        .await
        .expect("POST stop");
    assert_eq!(stopped.status().as_u16(), 200);
    let cancel = agent.skip_to_enveloped("cancel").await;
    assert_eq!(cancel["turn"]["seq"], seq);
    let end = here.skip_to("streamEnd").await;
    assert_eq!(end["reason"], "stopped");
    let settled = here.skip_to("text").await;
    assert_eq!(settled["data"]["status"], "stopped");
    assert_eq!(settled["data"]["text"], chunk_text(5), "what was streamed");
}

/// A node cut off from NATS mid-stream misses chunks; once it is back, the next chunk shows
/// the gap and the stream resumes from the agent's node's holdings, every chunk once and in
/// order (ADR 0035).
#[tokio::test]
async fn a_stream_that_lost_chunks_while_its_viewers_node_was_cut_off_resumes_from_the_holdings() {
    let nats = NatsServer::start().await;
    let proxy = Proxy::start(nats.addr).await;
    let node = TestNode::start_with(on_nats(vec![nats.url()], NO_SWEEP_MS)).await;
    let peer = node
        .start_peer_with(on_nats(vec![format!("nats://{}", proxy.addr)], NO_SWEEP_MS))
        .await;
    let (node, _, token, mut agent, mut here, conversation, seq) = turn_in_progress(node).await;
    let mut there = tab_hearing_the_agent(&peer, &token, &mut agent, &conversation).await;
    let (mut here_tab, mut there_tab) = (Tab::default(), Tab::default());
    send_numbered_chunks(&mut agent, &conversation, seq, 0..3).await;
    there_tab
        .read_until(&mut there, |tab| tab.chunks_of("s-1") == 3)
        .await;

    // Chunks 3 to 5 go out while the viewer's node is cut off: they never reach it.
    proxy.refuse();
    send_numbered_chunks(&mut agent, &conversation, seq, 3..6).await;
    here_tab
        .read_until(&mut here, |tab| tab.chunks_of("s-1") == 6)
        .await;
    node.server.state().streams.flush().await;

    proxy.admit();
    until_typing_crosses(&mut agent, &conversation, &mut there).await;
    send_numbered_chunks(&mut agent, &conversation, seq, 6..10).await;
    there_tab
        .read_until(&mut there, |tab| {
            tab.chunks_of("s-1") == 10 || tab.ended.contains_key("s-1")
        })
        .await;
    assert_eq!(there_tab.chunks_of("s-1"), 10, "{there_tab:?}");
    agent.send(result(&conversation, seq, "s-1", "ten")).await;
    read_answer(&mut there_tab, &mut there, "s-1", "ten").await;
    assert_eq!(there_tab.text["s-1"], chunk_text(10));
    assert_eq!(there_tab.ended["s-1"], "committed");
    drop((node, peer, proxy, nats));
}
