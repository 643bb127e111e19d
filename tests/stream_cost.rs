//! A 1,000-chunk stream costs the database no transaction per chunk (docs/protocol.md §4.9).
//! Alone in its test binary: the measure is the cluster's transaction-id counter, which every
//! writing or notifying transaction advances, and no other test runs beside this one.

mod support;

use serde_json::{Value, json};
use support::ws::WsClient;
use support::{TestNode, setup};

/// The next transaction id the cluster will assign (reading it assigns none).
async fn next_xid(node: &TestNode) -> i64 {
    let mut db = node.db.connect().await;
    let (xid,): (String,) = sqlx::query_as("SELECT pg_snapshot_xmax(pg_current_snapshot())::text")
        .fetch_one(&mut db)
        .await
        .unwrap();
    xid.parse().unwrap()
}

#[tokio::test]
async fn a_thousand_chunks_cost_no_transaction_each() {
    let node = TestNode::start_with(|config| {
        config.group_settle_ms = 100;
        config.limits.max_frames_per_sec = 100_000;
        config.limits.outbound_queue_frames = 4_096;
        config.limits.max_stream_bytes = 1 << 20;
    })
    .await;
    let (acme, _, token) = setup(&node).await;
    let agent_token = node.agent_token(&acme).await;
    let (mut agent, welcome) = node.agent(&agent_token, Some("bot")).await;
    support::settle(&welcome).await;
    let mut tab = WsClient::connect(&node.ws_url("")).await;
    tab.hello(&token, json!({})).await;
    tab.send(json!({"type": "text", "clientId": "q-1", "data": {"text": "hi"}}))
        .await;
    tab.recv_type("ack").await;
    let (conversation, seq) = loop {
        let delivered = agent.recv().await;
        if let Some(seq) = delivered["frame"]["meta"]["turn"]["seq"].as_i64() {
            break (delivered["conversationId"].clone(), seq);
        }
    };

    let before = next_xid(&node).await;
    let reading = tokio::spawn(async move {
        let mut text = String::new();
        let mut chunks = 0;
        while chunks < 1_000 {
            let frame = tab.recv().await;
            if frame["type"] == "streamChunk" {
                // A live feed that fell behind catches up with the chunks it missed coalesced.
                let index = frame["index"].as_u64().unwrap();
                let first = frame["firstIndex"].as_u64().unwrap_or(index);
                assert_eq!(first, chunks, "in order, each once");
                text.push_str(frame["text"].as_str().unwrap());
                chunks = index + 1;
            }
        }
        text
    });
    for index in 0..1_000u64 {
        agent
            .send(support::stream_chunk(
                conversation.as_str().unwrap(),
                "s-1",
                index,
                seq,
                "w ",
            ))
            .await;
    }
    assert_eq!(reading.await.unwrap().len(), 2_000);
    // The result waits for the relay to flush what came before it, so once it is acked every
    // relay statement of the stream has run.
    agent
        .send(json!({"conversationId": conversation, "frame": {
            "type": "turnResult", "clientId": "r-1", "turn": {"seq": seq},
            "frames": [{"type": "text", "streamId": "s-1", "data": {"text": "done"}}]}}))
        .await;
    loop {
        let frame: Value = agent.recv().await;
        if frame["frame"]["type"] == "ack" {
            break;
        }
        assert_ne!(frame["frame"]["type"], "error", "{frame}");
    }
    let spent = next_xid(&node).await - before;
    // The relay sends one statement per 5 ms window: a burst of 1,000 chunks costs a few dozen
    // transactions with the result's commit; one per chunk would be over 1,000.
    assert!(spent < 200, "{spent} transactions for 1,000 chunks");
    println!("1,000 chunks and their result: {spent} transactions");
}
