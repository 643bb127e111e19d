//! The Python example agent (`docs/examples/agent.py`) as a real process against a real node:
//! it joins a group, answers an end user's turn sent over WebSocket, and keeps its counter in
//! the conversation's runtime state, so a second process carries on from where the first
//! stopped. Needs `python3` with the `websockets` package (`pip install websockets`).

mod support;

use std::process::Stdio;
use std::time::Duration;

use converger_client::TokenRequest;
use serde_json::{Value, json};
use support::ws::WsClient;
use support::{TestNode, workspace_root};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::oneshot;
use uuid::Uuid;

/// Python's start, the connection and the hello, with room for a loaded CI machine.
const AGENT_TIMEOUT: Duration = Duration::from_secs(30);

/// Fails (never skips) when the example cannot run, naming the fix.
fn require_python_websockets() {
    let found = std::process::Command::new("python3")
        .args(["-c", "import websockets.asyncio.client"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    assert!(
        found.is_ok_and(|status| status.success()),
        "docs/examples/agent.py needs python3 (3.11+) with the websockets package (13 or newer): \
         run `pip install websockets`"
    );
}

/// Starts `agent.py --once` in group `python` and returns once it has printed that it joined
/// (its `welcome` arrived, so the turns committed from now on are delivered to it).
async fn start_agent(node: &TestNode, token: &str) -> Child {
    let mut child = Command::new("python3")
        .args(["docs/examples/agent.py", "--once"])
        .current_dir(workspace_root())
        .env("CONVERGER_WS_URL", node.ws_url(""))
        .env("CONVERGER_AGENT_TOKEN", token)
        .env("CONVERGER_AGENT_GROUP", "python")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("python3 starts");
    // Both streams are read to their end, so the agent never blocks on a full pipe, and shown
    // with the test's output when it fails.
    let stderr = child.stderr.take().expect("piped stderr");
    tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("agent.py: {line}");
        }
    });
    let stdout = child.stdout.take().expect("piped stdout");
    let (joined_sender, joined) = oneshot::channel::<String>();
    tokio::spawn(async move {
        let mut joined_sender = Some(joined_sender);
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            eprintln!("agent.py: {line}");
            if line.starts_with("joined group python ")
                && let Some(sender) = joined_sender.take()
            {
                let _ = sender.send(line);
            }
        }
    });
    match tokio::time::timeout(AGENT_TIMEOUT, joined).await {
        Ok(Ok(_line)) => child,
        Ok(Err(_)) => panic!("agent.py exited without joining its group (see its output above)"),
        Err(_) => panic!("agent.py did not join its group within {AGENT_TIMEOUT:?}"),
    }
}

/// The conversation's committed runtime: (version, state).
async fn runtime(node: &TestNode, conversation_id: Uuid) -> (i64, Value) {
    let mut db = node.db.connect().await;
    sqlx::query_as::<_, (i64, Value)>(
        "SELECT version, state FROM conversation_runtime WHERE conversation_id = $1",
    )
    .bind(conversation_id)
    .fetch_one(&mut db)
    .await
    .expect("the conversation has a runtime row")
}

#[tokio::test]
async fn the_python_example_agent_answers_turns_and_counts_them_in_the_runtime() {
    require_python_websockets();
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let agent_token = node
        .client
        .generate_token(&acme.secret, &TokenRequest::channel_scope())
        .await
        .expect("channel-scope token")
        .token;
    let (conversation_id, user_token) = node.conversation(&acme, "alice").await;
    let mut alice = WsClient::connect(&node.ws_url("")).await;
    alice.hello(&user_token, json!({})).await;

    // One process per turn: the second one knows the count only from `meta.runtime`, so the
    // counter proves the state travels through the server, not through the agent's memory.
    for n in 1..=2_i64 {
        let mut agent = start_agent(&node, &agent_token).await;
        let text = format!("hello {n}");
        alice
            .send(json!({"type": "text", "clientId": format!("a-{n}"), "data": {"text": text}}))
            .await;
        let ack = alice.recv_until("ack").await.pop().unwrap();
        let turn_seq = ack["seq"].as_i64().expect("ack seq");

        let answer = alice.recv_type("text").await;
        assert_eq!(answer["data"]["text"], format!("echo {n}: {text}"));
        assert_eq!(answer["from"], "bot");
        assert_eq!(
            answer["sender"],
            json!({"id": "python", "role": "agent"}),
            "an agent without user_id writes as its group"
        );
        assert_eq!(answer["seq"], turn_seq + 1, "the answer follows its turn");

        // --once: the process exits 0 as soon as its result is acknowledged.
        let status = tokio::time::timeout(AGENT_TIMEOUT, agent.wait())
            .await
            .expect("agent.py --once exits after its first acked result")
            .expect("wait for agent.py");
        assert!(status.success(), "agent.py --once exited with {status}");

        assert_eq!(
            runtime(&node, conversation_id).await,
            (n, json!({"count": n})),
            "one runtime write per answered turn"
        );
    }
}
