//! Delivery across reconnects, nodes and a lost LISTEN connection: every committed frame reaches
//! every subscriber exactly once, in order.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use converger_client::RestClient;
use converger_gateway::ServerHandle;
use serde_json::{Value, json};
use support::ws::WsClient;
use support::{TestNode, eventually};
use uuid::Uuid;

fn seq_of(frame: &Value) -> Option<i64> {
    frame["seq"].as_i64().filter(|_| frame["type"] != "ack")
}

/// Reads until `last` has been seen, returning the persistent seqs in arrival order.
async fn read_until_seq(client: &mut WsClient, last: i64) -> Vec<i64> {
    let mut seen = Vec::new();
    while seen.last().copied() != Some(last) {
        let frame = client.recv().await;
        if let Some(seq) = seq_of(&frame) {
            seen.push(seq);
        }
    }
    seen
}

/// Two nodes sharing a database, and alice's conversation with her session on the peer.
struct AliceOnThePeer {
    node: TestNode,
    peer: ServerHandle,
    conversation_id: Uuid,
    token: String,
    on_peer: WsClient,
}

async fn alice_on_the_peer() -> AliceOnThePeer {
    let node = TestNode::start().await;
    let peer = node.start_peer().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    let mut on_peer = WsClient::connect(&support::peer_ws_url(&peer)).await;
    on_peer.hello(&token, json!({})).await;
    AliceOnThePeer {
        node,
        peer,
        conversation_id,
        token,
        on_peer,
    }
}

#[tokio::test]
async fn a_frame_committed_on_one_node_reaches_a_client_on_another() {
    let AliceOnThePeer {
        node,
        peer,
        conversation_id,
        token,
        mut on_peer,
    } = alice_on_the_peer().await;
    let mut on_node = WsClient::connect(&node.ws_url("")).await;
    on_node.hello(&token, json!({})).await;

    // Over REST on the first node, and over a socket on the first node.
    node.client
        .post_activity(
            &token,
            conversation_id,
            &json!({"type": "text", "data": {"text": "rest"}}),
            None,
        )
        .await
        .unwrap();
    assert_eq!(on_node.recv().await["seq"], 1);
    on_node
        .send(json!({"type": "text", "clientId": "ws-1", "data": {"text": "socket"}}))
        .await;
    assert_eq!(on_node.recv_until("ack").await.last().unwrap()["seq"], 2);
    let first = on_peer.recv().await;
    let second = on_peer.recv().await;
    assert_eq!(
        (first["seq"].as_i64(), first["data"]["text"].as_str()),
        (Some(1), Some("rest"))
    );
    assert_eq!(
        (second["seq"].as_i64(), second["clientId"].as_str()),
        (Some(2), Some("ws-1"))
    );

    // And the other way round: committed on the peer, seen on the first node.
    let peer_client = RestClient::new(peer.base_url()).unwrap();
    peer_client
        .post_activity(
            &token,
            conversation_id,
            &json!({"type": "text", "data": {"text": "peer"}}),
            None,
        )
        .await
        .unwrap();
    let frames = on_node.recv_until("text").await;
    assert_eq!(frames.last().unwrap()["seq"], 3);
    assert!(
        on_peer
            .barrier()
            .await
            .iter()
            .all(|frame| frame["seq"] == 3)
    );
}

#[tokio::test]
async fn a_frame_too_large_for_the_notification_still_reaches_the_other_node() {
    // Notifications carry frames while the payload stays under 7,500 bytes; a larger frame is
    // read back by the receiver.
    let AliceOnThePeer {
        node,
        peer: _peer,
        conversation_id,
        token,
        mut on_peer,
    } = alice_on_the_peer().await;

    // The text is capped below the notification's limit; other data fields are not.
    let large = "x".repeat(12_000);
    // The large frame comes last: no later frame's gap fill can bring it in.
    for padding in ["", large.as_str()] {
        node.client
            .post_activity(
                &token,
                conversation_id,
                &json!({"type": "text", "data": {"text": "hi", "padding": padding}}),
                None,
            )
            .await
            .unwrap();
    }
    let received: Vec<(i64, usize)> = [on_peer.recv().await, on_peer.recv().await]
        .iter()
        .map(|frame| {
            (
                frame["seq"].as_i64().unwrap(),
                frame["data"]["padding"].as_str().unwrap().len(),
            )
        })
        .collect();
    assert_eq!(received, vec![(1, 0), (2, 12_000)]);
}

#[tokio::test]
async fn killing_the_listen_backend_loses_no_frame() {
    let AliceOnThePeer {
        node,
        peer: _peer,
        conversation_id,
        token,
        mut on_peer,
    } = alice_on_the_peer().await;

    let mut db = node.db.connect().await;
    // The counter is process-wide (every node of this test binary shares the recorder): this
    // test counts its own two reconnects from here.
    let before = bus_reconnects(&node).await;
    let listeners: Vec<i32> = sqlx::query_scalar(LISTENERS)
        .fetch_all(&mut db)
        .await
        .unwrap();
    assert_eq!(listeners.len(), 2, "one LISTEN connection per node");
    for pid in &listeners {
        let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(&mut db)
            .await
            .unwrap();
        assert!(terminated);
    }
    // Commits right after the kill: some of their notifications are sent while nobody listens.
    let frame = json!({"type": "text", "data": {"text": "during"}});
    for _ in 0..10 {
        node.client
            .post_activity(&token, conversation_id, &frame, None)
            .await
            .unwrap();
    }
    assert_eq!(
        read_until_seq(&mut on_peer, 10).await,
        (1..=10).collect::<Vec<_>>()
    );
    // Both listeners notice the loss, come back and read the outbox over the gap.
    eventually(
        "both listeners count a reconnect",
        Duration::from_secs(10),
        || async { bus_reconnects(&node).await >= before + 2.0 },
    )
    .await;
    eventually(
        "both listeners are back",
        Duration::from_secs(10),
        || async {
            let mut db = node.db.connect().await;
            let listening: Vec<i32> = sqlx::query_scalar(LISTENERS)
                .fetch_all(&mut db)
                .await
                .unwrap();
            listening.len() == 2
        },
    )
    .await;
}

/// The LISTEN connections of the test's database.
const LISTENERS: &str =
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND query ILIKE 'LISTEN%'";

/// `converger_bus_reconnects_total` of this process.
async fn bus_reconnects(node: &TestNode) -> f64 {
    node.metrics()
        .await
        .lines()
        .find(|line| line.starts_with("converger_bus_reconnects_total"))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn a_client_reconnecting_twenty_times_during_ten_writers_sees_every_seq_once_in_order() {
    let node = TestNode::start_with(|config| config.limits.max_frames_per_sec = 1_000).await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    const WRITERS: usize = 10;
    const PER_WRITER: usize = 30;
    let total = (WRITERS * PER_WRITER) as i64;

    let writers: Vec<_> = (0..WRITERS)
        .map(|writer| {
            let client = node.client.clone();
            let token = token.clone();
            tokio::spawn(async move {
                for n in 0..PER_WRITER {
                    let frame = json!({"type": "text", "data": {"text": format!("w{writer}-{n}")}});
                    let key = format!("w{writer}-{n}");
                    client
                        .post_activity(&token, conversation_id, &frame, Some(&key))
                        .await
                        .expect("post");
                }
            })
        })
        .collect();

    let mut received: Vec<i64> = Vec::new();
    let mut watermark = 0;
    for _ in 0..20 {
        let mut client = WsClient::connect(&node.ws_url("")).await;
        client.hello(&token, json!({"watermark": watermark})).await;
        // Take a few frames on this connection, then drop it abruptly or politely.
        for _ in 0..5 {
            match client.next_event(Duration::from_secs(10)).await {
                Ok(frame) => {
                    if let Some(seq) = seq_of(&frame) {
                        received.push(seq);
                        watermark = seq;
                    }
                }
                Err(closed) => panic!("unexpected close {closed:?}"),
            }
            if watermark == total {
                break;
            }
        }
        client.close().await;
    }
    for writer in writers {
        writer.await.unwrap();
    }
    let mut client = WsClient::connect(&node.ws_url("")).await;
    client.hello(&token, json!({"watermark": watermark})).await;
    if watermark < total {
        received.extend(read_until_seq(&mut client, total).await);
    }
    assert_eq!(
        received,
        (1..=total).collect::<Vec<_>>(),
        "every seq exactly once, in order"
    );
    let distinct: BTreeSet<i64> = received.iter().copied().collect();
    assert_eq!(distinct.len() as i64, total);
}

#[tokio::test]
async fn draining_finishes_in_flight_sends_then_closes_1012_with_a_jittered_retry_hint() {
    let node = TestNode::start_with(|config| {
        config.drain.retry_after_ms = 1_000;
        config.drain.batch_size = 1;
        config.drain.batch_interval_ms = 10;
    })
    .await;
    let acme = node.tenant_with_channel("acme").await;
    let mut clients = Vec::new();
    for user in ["alice", "bob", "carol"] {
        let (_, token) = node.conversation(&acme, user).await;
        let mut client = WsClient::connect(&node.ws_url("")).await;
        client.hello(&token, json!({})).await;
        clients.push(client);
    }
    // A burst the server is still reading and committing when the drain starts.
    for n in 0..5 {
        clients[0]
            .send(json!({"type": "text", "clientId": format!("last-{n}"), "data": {"text": "bye"}}))
            .await;
    }
    let TestNode { server, db, .. } = node;
    let stopping = tokio::spawn(server.shutdown());
    let mut acked: Vec<String> = Vec::new();
    for (index, client) in clients.iter_mut().enumerate() {
        let (frames, closed) = client.recv_until_closed().await;
        if index == 0 {
            acked = frames
                .iter()
                .filter(|frame| frame["type"] == "ack")
                .map(|frame| frame["clientId"].as_str().unwrap().to_owned())
                .collect();
        }
        let error = frames.last().unwrap();
        assert_eq!(error["data"]["code"], "unavailable");
        assert_eq!(closed.code, 1012);
        let reason: Value = serde_json::from_str(&closed.reason).unwrap();
        assert_eq!(reason["reason"], "unavailable");
        let retry = reason["retryAfterMs"].as_u64().unwrap();
        assert!(
            (1_000..=2_000).contains(&retry),
            "jittered between the base and twice it: {retry}"
        );
    }
    stopping.await.unwrap().unwrap();
    // Every send the server took was committed and acked before the close; none is half done.
    let mut connection = db.connect().await;
    let mut stored: Vec<String> = sqlx::query_scalar(
        "SELECT client_id FROM activities WHERE client_id LIKE 'last-%' ORDER BY seq",
    )
    .fetch_all(&mut connection)
    .await
    .unwrap();
    stored.sort();
    acked.sort();
    assert_eq!(stored, acked);
}

#[tokio::test]
async fn a_repeated_notification_shows_no_frame_twice() {
    let AliceOnThePeer {
        node,
        peer: _peer,
        conversation_id,
        token,
        mut on_peer,
    } = alice_on_the_peer().await;
    let post = |text: &'static str| {
        let node = &node;
        let token = token.clone();
        async move {
            node.client
                .post_activity(
                    &token,
                    conversation_id,
                    &json!({"type": "text", "data": {"text": text}}),
                    None,
                )
                .await
                .unwrap();
        }
    };
    // Listen alongside the nodes, so the repeats below are the server's own notification.
    let mut listener = sqlx::postgres::PgListener::connect(&node.db.url)
        .await
        .unwrap();
    listener.listen("converger_events").await.unwrap();
    post("reply").await;
    assert_eq!(read_until_seq(&mut on_peer, 1).await, vec![1]);
    let notified = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let notification = listener.recv().await.unwrap();
            let payload: Value = serde_json::from_str(notification.payload()).unwrap();
            let announces_seq_1 = payload["k"] == "cb"
                && payload["v"]
                    .as_array()
                    .is_some_and(|events| events.iter().any(|event| event["s"] == 1));
            if announces_seq_1 {
                return notification;
            }
        }
    })
    .await
    .expect("the commit is notified");

    // The same notification twice more, as a duplicating transport would bring it.
    let mut db = node.db.connect().await;
    for _ in 0..2 {
        sqlx::query("SELECT pg_notify('converger_events', $1)")
            .bind(notified.payload())
            .execute(&mut db)
            .await
            .unwrap();
    }
    // Notifications reach the peer in order on its one LISTEN connection, so by the time the
    // next frame arrives the repeats have been handled: nothing came before it.
    post("next").await;
    assert_eq!(read_until_seq(&mut on_peer, 2).await, vec![2]);
}
