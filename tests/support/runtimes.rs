//! The runtime a delivered turn carries, across nodes (ADR 0039): shared by the `postgres`
//! bus's tests and the NATS bus's.

use converger_gateway::Config;
use serde_json::{Value, json};
use uuid::Uuid;

use super::TestNode;
use super::ws::WsClient;

/// The next user turn delivered to an agent: the frame (other parties' frames, which carry no
/// `meta`, are skipped).
async fn user_turn(agent: &mut WsClient) -> Value {
    loop {
        let envelope = agent.recv().await;
        if envelope["frame"].get("meta").is_some() {
            return envelope["frame"].clone();
        }
    }
}

/// Changes the stored runtime behind the gateways' backs (its state, and its version when
/// given; never the conversation row's copy): a delivery that reads the runtime shows the
/// change, one from the commit event does not.
pub async fn overwrite_stored_runtime(
    node: &TestNode,
    conversation_id: Uuid,
    version: Option<i64>,
    state: &Value,
) {
    let mut db = node.db.connect().await;
    sqlx::query(
        "UPDATE conversation_runtime SET state = $2, version = coalesce($3, version)
          WHERE conversation_id = $1",
    )
    .bind(conversation_id)
    .bind(state)
    .bind(version)
    .execute(&mut db)
    .await
    .unwrap();
}

/// Two nodes configured by `adjust`; a `writer` member on the first answers each turn with a
/// runtime, a `reader` member on the second only reads. The runtime an answer writes travels
/// with its commit event, and the next turn is delivered with it on both nodes without reading
/// it (the stored state, overwritten behind their backs, is not what they deliver); a state
/// too large to travel is read (the overwritten one is what they deliver).
pub async fn travels_with_its_commit(adjust: impl Fn(&mut Config) + Clone) {
    let node = TestNode::start_with(adjust.clone()).await;
    let peer = node.start_peer_with(adjust).await;
    let acme = node.tenant_with_channel("acme").await;
    let token = node.agent_token(&acme).await;
    let (mut writer, welcome) = node.agent(&token, Some("writer")).await;
    super::settle(&welcome).await;
    let mut reader = WsClient::connect(&super::peer_ws_url(&peer)).await;
    let welcome = reader.hello(&token, json!({"group": "reader"})).await;
    super::settle(&welcome).await;
    let (conversation_id, user_token) = node.conversation(&acme, "alice").await;
    let mut alice = WsClient::connect(&node.ws_url("")).await;
    alice.hello(&user_token, json!({})).await;

    let small = json!({"count": 1});
    let large = json!({"notes": "n".repeat(6_000)});
    let overwritten = json!({"read": "from the database"});
    let mut expected = json!({"version": 0, "state": {}});
    for (round, written) in [(1, &small), (2, &large)] {
        let seq = say(&mut alice, round).await;
        for (who, agent) in [("writer", &mut writer), ("reader", &mut reader)] {
            let turn = user_turn(agent).await;
            assert_eq!(turn["meta"]["turn"]["seq"], seq, "{who}, round {round}");
            assert_eq!(turn["meta"]["runtime"], expected, "{who}, round {round}");
        }
        writer
            .send(json!({"conversationId": conversation_id, "frame": {
                "type": "turnResult", "clientId": format!("r-{round}"),
                "turn": {"seq": seq, "revision": 0},
                "frames": [{"type": "text", "data": {"text": "noted"}}],
                "runtime": {"version": round - 1, "state": written}}}))
            .await;
        let ack = enveloped(&mut writer, "ack").await;
        assert_eq!(ack["turn"]["seq"], seq, "{ack}");
        alice.recv_type("text").await;
        overwrite_stored_runtime(&node, conversation_id, None, &overwritten).await;
        let delivered = if round == 1 { written } else { &overwritten };
        expected = json!({"version": round, "state": delivered});
    }
    let seq = say(&mut alice, 3).await;
    for (who, agent) in [("writer", &mut writer), ("reader", &mut reader)] {
        let turn = user_turn(agent).await;
        assert_eq!(turn["meta"]["turn"]["seq"], seq, "{who}, round 3");
        assert_eq!(turn["meta"]["runtime"], expected, "{who}, round 3");
    }
    drop((node, peer));
}

/// Alice's text of `round`; its seq once acked.
async fn say(alice: &mut WsClient, round: i64) -> i64 {
    alice
        .send(json!({"type": "text", "clientId": format!("a-{round}"), "data": {"text": "hello"}}))
        .await;
    let frames = alice.recv_until("ack").await;
    frames
        .last()
        .and_then(|ack| ack["seq"].as_i64())
        .expect("an acked seq")
}

/// The next enveloped frame of `kind` an agent receives.
async fn enveloped(agent: &mut WsClient, kind: &str) -> Value {
    loop {
        let envelope = agent.recv().await;
        if envelope["frame"]["type"] == kind {
            return envelope["frame"].clone();
        }
    }
}
