//! Three `converger serve` processes on 127.0.0.1 over one database, with real gossip: each turn
//! reaches one member of the group across the cluster, answers cross nodes, a killed node's
//! unanswered turns move to a survivor, and a rolling restart under load loses and doubles
//! nothing.

mod support;

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use converger_client::{RestClient, TokenRequest};
use converger_core::groups::GroupView;
use serde_json::{Value, json};
use support::TestDb;
use support::cluster::{
    NodeProcess, eventually, live_nodes, wait_for_live_nodes, wait_for_members,
};
use support::effects::Effects;
use support::load::{
    Channel, Endpoints, Running, answers_and_completed, channel, stored_sends, turn_of,
    turn_result, unanswered,
};
use support::ws::WsClient;
use uuid::Uuid;

async fn three_nodes(db: &TestDb) -> (NodeProcess, NodeProcess, NodeProcess) {
    let a = NodeProcess::start(&db.url, "a", &[]).await;
    let seeds = [a.gossip_addr.clone()];
    let b = NodeProcess::start(&db.url, "b", &seeds).await;
    let c = NodeProcess::start(&db.url, "c", &seeds).await;
    wait_for_live_nodes(&[&a, &b, &c], &["a", "b", "c"]).await;
    (a, b, c)
}

async fn member(node: &NodeProcess, token: &str, group: &str) -> (WsClient, Value) {
    let mut client = WsClient::connect(&node.ws_url()).await;
    let welcome = client.hello(token, json!({"group": group})).await;
    (client, welcome)
}

fn connection_id(welcome: &Value) -> String {
    welcome["data"]["connectionId"].as_str().unwrap().to_owned()
}

/// Members of group "bot" on `a` and on `b`, known to all three nodes and settled, and the
/// group as every node sees it: (member on a, its welcome, member on b, the group).
async fn members_on_a_and_b(
    a: &NodeProcess,
    b: &NodeProcess,
    c: &NodeProcess,
    channel: &Channel,
) -> (WsClient, Value, WsClient, GroupView) {
    let (on_a, welcome_a) = member(a, &channel.agent_token, "bot").await;
    let (on_b, welcome_b) = member(b, &channel.agent_token, "bot").await;
    wait_for_members(
        &[a, b, c],
        &[&connection_id(&welcome_a), &connection_id(&welcome_b)],
    )
    .await;
    support::settle(&welcome_a).await;
    support::settle(&welcome_b).await;
    let mut view = GroupView::new();
    for welcome in [&welcome_a, &welcome_b] {
        view.join(
            &connection_id(welcome),
            welcome["data"]["since"].as_i64().unwrap(),
        );
    }
    (on_a, welcome_a, on_b, view)
}

/// An end user in a new conversation, connected to `node`.
struct User {
    client: WsClient,
    conversation_id: Uuid,
}

async fn user(node: &NodeProcess, channel: &Channel, name: &str) -> User {
    let rest = RestClient::new(&node.base_url).unwrap();
    let token = rest
        .generate_token(&channel.secret, &TokenRequest::for_user(name))
        .await
        .unwrap();
    let created = rest.create_conversation(&token.token).await.unwrap();
    let mut client = WsClient::connect(&node.ws_url()).await;
    client.hello(&created.token, json!({})).await;
    User {
        client,
        conversation_id: created.conversation_id,
    }
}

/// Sends a text turn and returns its ack.
async fn say(client: &mut WsClient, client_id: &str, text: &str) -> Value {
    client
        .send(json!({"type": "text", "clientId": client_id, "data": {"text": text}}))
        .await;
    client.recv_until("ack").await.pop().unwrap()
}

/// Reads turns from several members until `count` have arrived in all; returns who got what.
async fn collect_turns(members: &mut [&mut WsClient], count: usize) -> Vec<Vec<(Uuid, i64)>> {
    let mut got: Vec<Vec<(Uuid, i64)>> = vec![Vec::new(); members.len()];
    let read = async {
        while got.iter().map(Vec::len).sum::<usize>() < count {
            let reads = members
                .iter_mut()
                .map(|member| Box::pin(member.next_event(Duration::from_secs(30))));
            let (event, index, _) = futures::future::select_all(reads).await;
            let envelope = event.expect("member connection stays open");
            if let Some(turn) = turn_of(&envelope) {
                got[index].push(turn);
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("every turn is delivered in time");
    // Whatever else was queued for the members arrives before their barrier.
    for (index, member) in members.iter_mut().enumerate() {
        got[index].extend(member.barrier().await.iter().filter_map(turn_of));
    }
    got
}

/// Answers each turn and waits for the acks.
async fn answer(member: &mut WsClient, turns: &[(Uuid, i64)]) {
    for (conversation_id, seq) in turns {
        let text = format!("answer {conversation_id} {seq}");
        member
            .send(json!({"conversationId": conversation_id, "frame": turn_result(&format!("r-{seq}-{conversation_id}"), *seq, &text)}))
            .await;
        loop {
            let envelope = member.recv().await;
            if envelope["frame"]["type"] == "ack" {
                assert_eq!(envelope["conversationId"], json!(conversation_id));
                break;
            }
            assert_ne!(envelope["frame"]["type"], "error", "{envelope}");
        }
    }
}

/// Reads until the answer to turn `seq` of the user's conversation arrives.
async fn answer_reaches(user: &mut User, seq: i64) -> Value {
    let expected = format!("answer {} {seq}", user.conversation_id);
    loop {
        let frame = user.client.recv().await;
        if frame["type"] == "text" && frame["sender"]["role"] == "agent" {
            assert_eq!(frame["data"]["text"], json!(expected), "{frame}");
            return frame;
        }
    }
}

async fn terminate_listen_backends(db: &TestDb) -> usize {
    let mut connection = db.connect().await;
    let listeners: Vec<i32> = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE 'LISTEN%'",
    )
    .fetch_all(&mut connection)
    .await
    .unwrap();
    for pid in &listeners {
        let _: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(&mut connection)
            .await
            .unwrap();
    }
    listeners.len()
}

/// Sends one turn per user, checks each reached exactly one member, has the member answer, and
/// checks each answer reaches its user. Returns how many turns each member got.
async fn round(users: &mut [User], members: &mut [&mut WsClient], label: &str) -> Vec<usize> {
    let mut expected = BTreeSet::new();
    for (n, user) in users.iter_mut().enumerate() {
        let ack = say(&mut user.client, &format!("{label}-{n}"), label).await;
        expected.insert((user.conversation_id, ack["seq"].as_i64().unwrap()));
    }
    let got = collect_turns(members, expected.len()).await;
    let delivered: Vec<(Uuid, i64)> = got.iter().flatten().copied().collect();
    let unique: BTreeSet<(Uuid, i64)> = delivered.iter().copied().collect();
    assert_eq!(unique, expected, "every turn delivered, none foreign");
    assert_eq!(delivered.len(), expected.len(), "no turn delivered twice");
    for (member, turns) in members.iter_mut().zip(&got) {
        answer(member, turns).await;
    }
    let seqs: HashMap<Uuid, i64> = expected.into_iter().collect();
    for user in users.iter_mut() {
        let seq = seqs[&user.conversation_id];
        answer_reaches(user, seq).await;
    }
    got.iter().map(Vec::len).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_reach_one_member_across_three_nodes_and_answers_cross_nodes() {
    let db = TestDb::create().await;
    let (a, b, c) = three_nodes(&db).await;
    let channel = channel(&a).await;
    let (mut on_a, welcome_a) = member(&a, &channel.agent_token, "bot").await;
    let (mut on_b, welcome_b) = member(&b, &channel.agent_token, "bot").await;
    wait_for_members(
        &[&a, &b, &c],
        &[&connection_id(&welcome_a), &connection_id(&welcome_b)],
    )
    .await;
    let view = c.cluster_view().await;
    assert_eq!(live_nodes(&view), ["a", "b", "c"]);
    assert!(
        view["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|node| node["httpAddr"].is_string())
    );
    support::settle(&welcome_a).await;
    support::settle(&welcome_b).await;

    let mut users = Vec::new();
    for n in 0..24 {
        users.push(user(&c, &channel, &format!("user-{n}")).await);
    }
    let spread = round(&mut users, &mut [&mut on_a, &mut on_b], "first").await;
    assert!(
        spread.iter().all(|count| *count > 0),
        "turns spread over both nodes: {spread:?}"
    );

    // Every node's LISTEN connection dies; commits right after it still reach everyone.
    assert_eq!(
        terminate_listen_backends(&db).await,
        3,
        "one LISTEN per node"
    );
    round(&mut users, &mut [&mut on_a, &mut on_b], "second").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_on_a_third_node_during_the_settle_delay_causes_no_duplicate() {
    let db = TestDb::create().await;
    let (a, b, c) = three_nodes(&db).await;
    let channel = channel(&a).await;
    let (mut on_a, welcome_a) = member(&a, &channel.agent_token, "bot").await;
    wait_for_members(&[&a, &b, &c], &[&connection_id(&welcome_a)]).await;
    support::settle(&welcome_a).await;
    let mut users = Vec::new();
    for n in 0..16 {
        users.push(user(&b, &channel, &format!("user-{n}")).await);
    }

    let (mut on_c, welcome_c) = member(&c, &channel.agent_token, "bot").await;
    let since_c = welcome_c["data"]["since"].as_i64().unwrap();
    let mut expected = BTreeSet::new();
    for (n, user) in users.iter_mut().enumerate() {
        let ack = say(&mut user.client, &format!("early-{n}"), "early").await;
        assert!(
            ack["timestamp"].as_i64().unwrap() < since_c,
            "sent within the settle delay"
        );
        expected.insert((user.conversation_id, ack["seq"].as_i64().unwrap()));
    }
    let got = collect_turns(&mut [&mut on_a, &mut on_c], expected.len()).await;
    assert!(
        got[1].is_empty(),
        "the settling member got turns of before: {:?}",
        got[1]
    );
    assert_eq!(got[0].iter().copied().collect::<BTreeSet<_>>(), expected);
    assert_eq!(got[0].len(), expected.len(), "no turn delivered twice");
    answer(&mut on_a, &got[0]).await;
    for user in users.iter_mut() {
        user.client.recv_until("text").await;
    }

    // After its since, the new member takes its share and still nothing is doubled.
    support::settle(&welcome_c).await;
    let spread = round(&mut users, &mut [&mut on_a, &mut on_c], "late").await;
    assert!(
        spread[1] > 0,
        "the settled member owns some conversations: {spread:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_unanswered_turns_reach_a_member_on_a_survivor() {
    let db = TestDb::create().await;
    let (a, b, c) = three_nodes(&db).await;
    let channel = channel(&b).await;
    let (mut on_a, welcome_a, mut on_b, view) = members_on_a_and_b(&a, &b, &c, &channel).await;
    // Conversations owned by the member on `a`, found by the rule every node applies.
    let mut users = Vec::new();
    for n in 0..40 {
        let candidate = user(&c, &channel, &format!("user-{n}")).await;
        let now = chrono::Utc::now().timestamp_millis();
        if view.owner(&candidate.conversation_id.to_string(), now)
            == Some(&connection_id(&welcome_a))
        {
            users.push(candidate);
        }
        if users.len() == 3 {
            break;
        }
    }
    assert_eq!(
        users.len(),
        3,
        "three conversations owned by the member on a"
    );
    let mut expected = BTreeSet::new();
    for (n, user) in users.iter_mut().enumerate() {
        let ack = say(&mut user.client, &format!("t-{n}"), "who answers?").await;
        expected.insert((user.conversation_id, ack["seq"].as_i64().unwrap()));
    }
    let got = collect_turns(&mut [&mut on_a, &mut on_b], expected.len()).await;
    assert_eq!(got[0].iter().copied().collect::<BTreeSet<_>>(), expected);
    assert!(got[1].is_empty());

    // kill -9 of `a`: its member never answers; the survivor's member gets the turns.
    a.kill_9().await;
    let taken_over = collect_turns(&mut [&mut on_b], expected.len()).await;
    assert_eq!(
        taken_over[0].iter().copied().collect::<BTreeSet<_>>(),
        expected
    );
    assert_eq!(taken_over[0].len(), expected.len(), "each taken over once");
    answer(&mut on_b, &taken_over[0]).await;
    let seqs: HashMap<Uuid, i64> = expected.into_iter().collect();
    for user in users.iter_mut() {
        let seq = seqs[&user.conversation_id];
        answer_reaches(user, seq).await;
    }
    wait_for_live_nodes(&[&b, &c], &["b", "c"]).await;
    drop(on_a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_stream_is_aborted_for_viewers_and_the_takeover_streams_afresh() {
    let db = TestDb::create().await;
    let (a, b, c) = three_nodes(&db).await;
    let channel = channel(&b).await;
    let (mut on_a, welcome_a, mut on_b, view) = members_on_a_and_b(&a, &b, &c, &channel).await;
    let mut owned_by_a = None;
    for n in 0..40 {
        let candidate = user(&c, &channel, &format!("viewer-{n}")).await;
        let now = chrono::Utc::now().timestamp_millis();
        if view.owner(&candidate.conversation_id.to_string(), now)
            == Some(&connection_id(&welcome_a))
        {
            owned_by_a = Some(candidate);
            break;
        }
    }
    let mut viewer = owned_by_a.expect("a conversation owned by the member on a");
    let ack = say(&mut viewer.client, "q-1", "stream to me").await;
    let seq = ack["seq"].as_i64().unwrap();
    let got = collect_turns(&mut [&mut on_a], 1).await;
    assert_eq!(got[0], vec![(viewer.conversation_id, seq)]);

    // The owner on `a` streams; the viewer on `c` sees the chunks.
    for (index, word) in ["half ", "an "].iter().enumerate() {
        on_a.send(support::stream_chunk(
            &viewer.conversation_id.to_string(),
            "s-a",
            index as u64,
            seq,
            word,
        ))
        .await;
    }
    let mut shown = Vec::new();
    while shown.len() < 2 {
        let frame = viewer.client.recv().await;
        if frame["type"] == "streamChunk" {
            assert_eq!(frame["index"], shown.len());
            shown.push(frame["text"].as_str().unwrap().to_owned());
        }
    }

    // kill -9 of `a`: the viewer is told the stream is gone, then the survivor streams afresh.
    a.kill_9().await;
    let aborted = loop {
        let frame = viewer.client.recv().await;
        if frame["type"] == "streamEnd" {
            break frame;
        }
        assert_ne!(
            frame["type"], "streamChunk",
            "no chunk after the owner died"
        );
    };
    assert_eq!(aborted["streamId"], "s-a");
    assert_eq!(aborted["status"], "aborted");
    assert_eq!(aborted["reason"], "node_down");
    let taken_over = collect_turns(&mut [&mut on_b], 1).await;
    assert_eq!(taken_over[0], vec![(viewer.conversation_id, seq)]);
    on_b.send(support::stream_chunk(
        &viewer.conversation_id.to_string(),
        "s-b",
        0,
        seq,
        "whole answer",
    ))
    .await;
    answer(&mut on_b, &taken_over[0]).await;
    let mut fresh = Vec::new();
    loop {
        let frame = viewer.client.recv().await;
        if frame["type"] == "streamChunk" {
            assert_eq!(frame["streamId"], "s-b");
            fresh.push(frame["text"].as_str().unwrap().to_owned());
        }
        if frame["type"] == "text" && frame["sender"]["role"] == "agent" {
            assert_eq!(
                frame["data"]["text"],
                json!(format!("answer {} {seq}", viewer.conversation_id))
            );
            break;
        }
    }
    assert_eq!(fresh, vec!["whole answer".to_owned()]);
    let answers = db
        .count(&format!(
            "SELECT count(*) FROM activities WHERE conversation_id = '{}' AND sender_role = 'agent'",
            viewer.conversation_id
        ))
        .await;
    assert_eq!(answers, 1, "one committed result");
    drop(on_a);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_load_loses_no_acked_turn_and_answers_none_twice() {
    let db = TestDb::create().await;
    let (a, b, c) = three_nodes(&db).await;
    let channel = channel(&a).await;
    let effects = Effects::start().await.expect("the effects fixture starts");
    let endpoints: Endpoints = Arc::new(Mutex::new(vec![a.ws_url(), b.ws_url(), c.ws_url()]));
    let mut running = Running::start(&a, &channel, &endpoints, &effects.url, (2, 6)).await;
    eventually("load is flowing", Duration::from_secs(20), || async {
        running.acked() >= 20
    })
    .await;

    // Restart each node in turn: SIGTERM (drain), then a new process under the same name.
    let mut nodes = vec![a, b, c];
    for index in 0..nodes.len() {
        let old = nodes.remove(index);
        let name = old.name.clone();
        endpoints.lock().unwrap().retain(|url| *url != old.ws_url());
        let before = running.acked();
        old.terminate().await;
        let seeds: Vec<String> = nodes.iter().map(|node| node.gossip_addr.clone()).collect();
        let new = NodeProcess::start(&db.url, &name, &seeds).await;
        endpoints.lock().unwrap().push(new.ws_url());
        nodes.insert(index, new);
        let all: Vec<&NodeProcess> = nodes.iter().collect();
        wait_for_live_nodes(&all, &["a", "b", "c"]).await;
        eventually(
            "load goes on after the restart",
            Duration::from_secs(20),
            || async { running.acked() >= before + 10 },
        )
        .await;
    }
    running.stop_users().await;
    // The agents go on until every acked turn has its answer: none was lost on the way.
    let acked = running.history.acked_sends();
    let answered = tokio::time::timeout(Duration::from_secs(30), async {
        while unanswered(&mut db.connect().await, &acked).await > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        answered.is_ok(),
        "{} acked turns never answered",
        unanswered(&mut db.connect().await, &acked).await
    );
    running.stop_agents().await;

    // The checker: nothing acked lost, no turn key with two results, every user saw its
    // conversation once and in order; duplicate deliveries are counted.
    let mut connection = db.connect().await;
    let stored = stored_sends(&mut connection, None).await;
    let verdict = running.history.verdict(&stored);
    println!("rolling restart: {verdict:?}");
    assert!(verdict.holds(), "{verdict:?}");
    // The registry agrees: one stored answer per completed turn.
    let (answers, completed) = answers_and_completed(&mut connection).await;
    assert_eq!(answers, completed, "one stored answer per completed turn");
    // One external effect per turn key, however often a turn was delivered.
    assert_eq!(
        effects.performed() as i64,
        completed,
        "one effect per answered turn"
    );
    println!(
        "rolling restart: {} effects, {} repeated calls answered by the idempotency key",
        effects.performed(),
        effects.repeated_calls()
    );
}

/// A gossip key (64 hex digits) made of one repeated byte.
fn gossip_key(byte: &str) -> String {
    byte.repeat(32)
}

/// `converger_gossip_rejected_total` of a node, all reasons.
async fn gossip_rejected(node: &NodeProcess) -> f64 {
    node.metrics()
        .await
        .lines()
        .filter(|line| line.starts_with("converger_gossip_rejected_total"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn a_node_without_the_cluster_key_never_joins_and_cannot_take_turns() {
    let db = TestDb::create().await;
    let key = gossip_key("a1");
    let keyed = [("CONVERGER_GOSSIP__KEY", key.as_str())];
    let a = NodeProcess::start_with(&db.url, "a", &[], &keyed).await;
    let b =
        NodeProcess::start_with(&db.url, "b", std::slice::from_ref(&a.gossip_addr), &keyed).await;
    wait_for_live_nodes(&[&a, &b], &["a", "b"]).await;

    let acme = channel(&a).await;
    let (mut on_b, welcome) = member(&b, &acme.agent_token, "bot").await;
    let on_b_connection = connection_id(&welcome);
    wait_for_members(&[&a, &b], &[on_b_connection.as_str()]).await;

    // A rogue with its own database, secrets and key, seeded with a's address, serving a copy of
    // acme's channel (same ids, same secret): in the clear, its member of group "bot" would own
    // some of acme's conversations.
    let rogue_db = TestDb::create().await;
    let mut source = db.connect().await;
    let mut target = rogue_db.connect().await;
    for table in ["tenants", "channels"] {
        let rows: Vec<Value> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT to_jsonb(t) FROM {table} t"
        )))
        .fetch_all(&mut source)
        .await
        .unwrap();
        for row in rows {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table} SELECT * FROM jsonb_populate_record(NULL::{table}, $1)"
            )))
            .bind(row)
            .execute(&mut target)
            .await
            .unwrap();
        }
    }
    let rogue_key = gossip_key("b2");
    let rogue = NodeProcess::start_with(
        &rogue_db.url,
        "rogue",
        std::slice::from_ref(&a.gossip_addr),
        &[
            ("CONVERGER_GOSSIP__KEY", rogue_key.as_str()),
            (
                "CONVERGER_SECRET_KEY",
                "rogue-secret-key-0123456789abcdef0123456789",
            ),
        ],
    )
    .await;
    let rogue_token = RestClient::new(&rogue.base_url)
        .unwrap()
        .generate_token(&acme.secret, &TokenRequest::channel_scope())
        .await
        .unwrap()
        .token;
    let (_rogue_member, _) = member(&rogue, &rogue_token, "bot").await;

    // The rogue's datagrams reach a and are dropped there, counted.
    eventually(
        "a drops the rogue's gossip",
        Duration::from_secs(10),
        || async { gossip_rejected(&a).await >= 3.0 },
    )
    .await;
    for node in [&a, &b] {
        let view = node.cluster_view().await;
        assert!(
            !live_nodes(&view).contains(&"rogue".to_owned()),
            "{} lists the rogue: {view}",
            node.name
        );
        let members = support::cluster::member_connections(&view);
        assert_eq!(members, vec![on_b_connection.clone()], "only b's member");
    }

    // Every turn reaches the one real member; none is stranded with the rogue's.
    let mut alice = user(&a, &acme, "alice").await;
    support::settle(&welcome).await;
    let mut seqs = Vec::new();
    for n in 0..30 {
        let ack = say(&mut alice.client, &format!("t-{n}"), "hello").await;
        seqs.push(ack["seq"].as_i64().unwrap());
    }
    let got = collect_turns(&mut [&mut on_b], seqs.len()).await;
    let delivered: Vec<i64> = got[0].iter().map(|(_, seq)| *seq).collect();
    assert_eq!(delivered, seqs);
    drop(rogue);
}
