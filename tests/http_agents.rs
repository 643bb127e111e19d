//! Agents behind a URL (ADR 0031, docs/agents.md §17) with real AG-UI servers started here: a
//! Pydantic AI agent (`AGUIAdapter` over a `FunctionModel` that calls a tool and streams its
//! answer, behind a check of converger's signature) and a fault server built on the
//! `ag-ui-protocol` package's encoder (`tests/http_agents/`). Each turn has one caller node, its
//! text streams to every tab on every node, and it ends in one committed result or one failure.

mod support;

use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use support::tab::Tab;
use support::ws::WsClient;
use support::{TenantFixture, TestNode, eventually, workspace_root};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use uuid::Uuid;

const SECRET: &str = "test-signing-secret";

/// An AG-UI server of `tests/http_agents/`, stopped when dropped.
struct AgentServer {
    _child: Child,
    base: String,
}

impl AgentServer {
    async fn start(script: &str) -> AgentServer {
        let mut child = Command::new("python3")
            .arg(workspace_root().join("tests/http_agents").join(script))
            .env("AGENT_SECRET", SECRET)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 starts");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the agent server started in time")
            .expect("its stdout")
            .expect("a READY line");
        let port = ready
            .strip_prefix("READY ")
            .unwrap_or_else(|| panic!("unexpected first line {ready:?}"));
        AgentServer {
            _child: child,
            base: format!("http://127.0.0.1:{port}"),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The calls it received, as it recorded them.
    async fn calls(&self) -> Vec<Value> {
        let calls: Value = reqwest::get(self.url("/calls"))
            .await
            .expect("GET /calls")
            .json()
            .await
            .expect("calls JSON");
        calls.as_array().cloned().unwrap_or_default()
    }
}

/// A node that may call `server` and re-reads the groups often.
fn calling(server: &AgentServer) -> impl Fn(&mut converger_gateway::Config) + use<> {
    let allow = format!("{}/", server.base);
    move |config| {
        config.group_settle_ms = 100;
        config.turns.stop_grace_ms = 300;
        config.http_agents.allow = vec![allow.clone()];
        config.http_agents.reload_ms = 100;
        config.http_agents.max_response_bytes = 65_536;
        // Only the breaker's own test lets it open.
        config.http_agents.breaker_failures = 100;
        config.http_agents.breaker_open_ms = 600;
    }
}

async fn post_json(node: &TestNode, api_key: &str, path: &str, body: Value) -> (u16, Value) {
    let response = node
        .http
        .post(node.url(path))
        .header("x-api-key", api_key)
        .json(&body)
        .send()
        .await
        .expect("POST");
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body)
}

async fn get_json(node: &TestNode, api_key: &str, path: &str) -> (u16, Value) {
    let response = node
        .http
        .get(node.url(path))
        .header("x-api-key", api_key)
        .send()
        .await
        .expect("GET");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// Creates the group and waits until each of `nodes` serves it with an eligible member.
async fn create_group(node: &TestNode, fixture: &TenantFixture, body: Value, nodes: usize) {
    let group = body["group"].as_str().unwrap().to_owned();
    let (status, created) = post_json(
        node,
        &fixture.api_key,
        &format!("/api/v1/channels/{}/http-agents", fixture.channel_id),
        body,
    )
    .await;
    assert_eq!(status, 201, "{created}");
    assert!(created.get("secret").is_none(), "never listed back");
    let members = group_members(node, fixture.channel_id, &group, nodes).await;
    let since = members.values().copied().max().unwrap();
    let wait = since - chrono::Utc::now().timestamp_millis() + 20;
    if wait > 0 {
        tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    }
}

/// Waits until the cluster lists `count` members of `group`: connection id → since.
async fn group_members(
    node: &TestNode,
    channel: Uuid,
    group: &str,
    count: usize,
) -> HashMap<String, i64> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let view: Value = node
            .http
            .get(node.url("/api/v1/admin/cluster"))
            .bearer_auth(&node.admin_token)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let members: HashMap<String, i64> = view["members"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|member| member["channelId"] == channel.to_string() && member["group"] == group)
            .map(|member| {
                (
                    member["connectionId"].as_str().unwrap().to_owned(),
                    member["since"].as_i64().unwrap(),
                )
            })
            .collect();
        if members.len() == count {
            return members;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{count} members of {group} never joined: {view}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn tab(url: &str, token: &str) -> WsClient {
    let mut tab = WsClient::connect(url).await;
    tab.hello(token, json!({})).await;
    tab
}

async fn send_text(tab: &mut WsClient, client_id: &str, text: &str) {
    tab.send(json!({"type": "text", "clientId": client_id, "data": {"text": text}}))
        .await;
}

/// The conversation's runtime state.
async fn runtime(node: &TestNode, conversation: Uuid) -> Value {
    let mut connection = node.db.connect().await;
    sqlx::query_scalar::<_, Value>(
        "SELECT state FROM conversation_runtime WHERE conversation_id = $1",
    )
    .bind(conversation)
    .fetch_optional(&mut connection)
    .await
    .unwrap()
    .unwrap_or(Value::Null)
}

/// The latest revision's status of turn `seq`.
async fn turn_status(node: &TestNode, conversation: Uuid, seq: i64) -> String {
    let mut connection = node.db.connect().await;
    sqlx::query_scalar::<_, String>(
        "SELECT status FROM turns WHERE conversation_id = $1 AND seq = $2 ORDER BY revision DESC LIMIT 1",
    )
    .bind(conversation)
    .bind(seq)
    .fetch_one(&mut connection)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_pydantic_ai_agent_streams_to_tabs_on_two_nodes_and_its_state_round_trips() {
    let agent = AgentServer::start("pydantic_agent.py").await;
    let node = TestNode::start_with(calling(&agent)).await;
    // The peer gossips with the first node: the two agree on the group's members.
    let seed = node.server.state().cluster.gossip_addr().to_string();
    let adjust = calling(&agent);
    let peer = node
        .start_peer_with(move |config| {
            adjust(config);
            config.seeds = vec![seed];
        })
        .await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation, token) = node.conversation(&acme, "alice").await;
    create_group(
        &node,
        &acme,
        json!({"group": "pydantic", "url": agent.url("/agent"), "secret": SECRET,
               "retry": {"attempts": 2, "backoffMs": 50}}),
        2,
    )
    .await;
    let mut here = tab(&node.ws_url(""), &token).await;
    let mut there = tab(&support::peer_ws_url(&peer), &token).await;
    send_text(&mut here, "q-1", "hello there world").await;
    let (mut here_tab, mut there_tab) = (Tab::default(), Tab::default());
    let answered = |tab: &Tab| {
        !tab.answers().is_empty() && !tab.text.is_empty() && tab.ended.len() == tab.text.len()
    };
    here_tab.read_until(&mut here, answered).await;
    there_tab.read_until(&mut there, answered).await;
    for tab in [&here_tab, &there_tab] {
        assert_eq!(tab.answers(), ["echo: hello there world"]);
        // The text streamed to both nodes' tabs, then ended in the commit.
        let (stream, text) = tab.text.iter().next().expect("a stream");
        assert_eq!(text, "echo: hello there world");
        assert_eq!(tab.ended[stream], "committed");
        let answer = tab
            .stored
            .iter()
            .find(|f| f["sender"]["role"] == "agent" && f["type"] == "text")
            .unwrap();
        assert_eq!(
            answer["id"],
            stream.as_str(),
            "the answer is stored under its stream's id"
        );
        let kinds: Vec<&str> = tab
            .stored
            .iter()
            .filter_map(|f| f["type"].as_str())
            .collect();
        assert_eq!(
            kinds[kinds.len() - 3..],
            ["tool_call", "tool_result", "text"]
        );
    }
    assert_eq!(
        runtime(&node, conversation).await,
        json!({"turns": 1, "last": "hello there world"})
    );
    // The state the agent wrote is the state of the next turn's input.
    send_text(&mut here, "q-2", "again").await;
    here_tab
        .read_until(&mut here, |tab| tab.answers().len() == 2)
        .await;
    assert_eq!(
        runtime(&node, conversation).await,
        json!({"turns": 2, "last": "again"})
    );
    // One signed call per turn, keyed by the turn.
    let calls = agent.calls().await;
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(calls.iter().all(|call| call["signed"] == true), "{calls:?}");
    let keys: Vec<&str> = calls
        .iter()
        .map(|call| call["key"].as_str().unwrap())
        .collect();
    assert_ne!(keys[0], keys[1]);
    let (_, page) = node.activities(conversation, &token, "").await;
    let stored_answers = page["activities"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|frame| frame["type"] == "text" && frame["sender"]["role"] == "agent")
        .count();
    assert_eq!(stored_answers, 2, "one answer per turn: {page}");
    drop(peer);
}

/// A node and a channel whose HTTP agent group calls `path` of the fault server.
async fn fault_setup(server: &AgentServer, path: &str) -> (TestNode, TenantFixture, Uuid, String) {
    let node = TestNode::start_with(calling(server)).await;
    fault_group(node, server, path).await
}

/// A channel of `node` whose HTTP agent group calls `path` of the fault server.
async fn fault_group(
    node: TestNode,
    server: &AgentServer,
    path: &str,
) -> (TestNode, TenantFixture, Uuid, String) {
    let acme = node.tenant_with_channel("acme").await;
    let (conversation, token) = node.conversation(&acme, "alice").await;
    let body = json!({"group": "faulty", "url": server.url(path),
                      "timeoutMs": 1500, "retry": {"attempts": 3, "backoffMs": 50}});
    create_group(&node, &acme, body, 1).await;
    (node, acme, conversation, token)
}

#[tokio::test]
async fn failed_calls_are_retried_under_one_key_and_the_turn_is_answered_once() {
    let server = AgentServer::start("fault_server.py").await;
    for (path, attempts) in [("/fail-first/2", 3), ("/cut-first", 2), ("/hang-first", 2)] {
        let (node, _, conversation, token) = fault_setup(&server, path).await;
        let mut user = tab(&node.ws_url(""), &token).await;
        send_text(&mut user, "q-1", "hi").await;
        let mut seen = Tab::default();
        seen.read_until(&mut user, |tab| {
            !tab.answers().is_empty() && tab.ended.len() == tab.text.len()
        })
        .await;
        assert_eq!(seen.answers(), ["fault server: hi"], "{path}");
        assert_eq!(
            runtime(&node, conversation).await,
            json!({"mode": "ok", "attempt": attempts}),
            "{path}: the answer of the call that finished"
        );
        let calls: Vec<Value> = server
            .calls()
            .await
            .into_iter()
            .filter(|call| call["path"] == path)
            .collect();
        assert_eq!(calls.len(), attempts as usize, "{path}: {calls:?}");
        assert!(
            calls.iter().all(|call| call["key"] == calls[0]["key"]),
            "{path}: one key"
        );
        if path == "/cut-first" {
            // The cut call's stream ended aborted; the retry's committed.
            let mut statuses: Vec<&str> = seen.ended.values().map(String::as_str).collect();
            statuses.sort_unstable();
            assert_eq!(statuses, ["aborted", "committed"], "{seen:?}");
        }
    }
}

#[tokio::test]
async fn a_turn_whose_calls_all_fail_is_failed_dead_lettered_and_retried_by_an_operator() {
    let server = AgentServer::start("fault_server.py").await;
    for path in ["/run-error", "/invalid", "/big"] {
        let (node, acme, conversation, token) = fault_setup(&server, path).await;
        let mut user = tab(&node.ws_url(""), &token).await;
        send_text(&mut user, "q-1", "hi").await;
        let mut seen = Tab::default();
        seen.read_until(&mut user, |tab| !tab.errors.is_empty())
            .await;
        let error = &seen.errors[0]["data"];
        assert_eq!(error["code"], "agent_failed", "{path}: {error}");
        assert_eq!(error["number"], 5006);
        assert_eq!(error["details"]["group"], "faulty");
        assert_eq!(error["details"]["turn"]["seq"], 1);
        assert_eq!(
            turn_status(&node, conversation, 1).await,
            "failed",
            "{path}"
        );
        let (status, letters) = get_json(
            &node,
            &acme.api_key,
            &format!(
                "/api/v1/channels/{}/http-agents/dead-letters",
                acme.channel_id
            ),
        )
        .await;
        assert_eq!(status, 200);
        let letter = &letters["deadLetters"][0];
        assert_eq!(
            letter["conversationId"],
            conversation.to_string(),
            "{letters}"
        );
        assert_eq!(letter["group"], "faulty");
        // Too large is not retried: the same agent answers the same turn alike.
        let attempts = if path == "/big" { 1 } else { 3 };
        assert_eq!(letter["attempts"], attempts, "{letter}");
    }

    // An agent that recovers: the operator's retry answers the turn, once however often it is
    // posted.
    let (node, acme, conversation, token) = fault_setup(&server, "/toggle").await;
    let health = reqwest::Client::new();
    health
        .post(server.url("/health"))
        .json(&json!({"healthy": false}))
        .send()
        .await
        .unwrap();
    let mut user = tab(&node.ws_url(""), &token).await;
    send_text(&mut user, "q-1", "hi").await;
    let mut seen = Tab::default();
    seen.read_until(&mut user, |tab| !tab.errors.is_empty())
        .await;
    health
        .post(server.url("/health"))
        .json(&json!({"healthy": true}))
        .send()
        .await
        .unwrap();
    let retry = json!({"conversationId": conversation, "seq": 1, "revision": 0, "group": "faulty"});
    let path = format!(
        "/api/v1/channels/{}/http-agents/dead-letters/retry",
        acme.channel_id
    );
    let (first, second) = tokio::join!(
        post_json(&node, &acme.api_key, &path, retry.clone()),
        post_json(&node, &acme.api_key, &path, retry.clone()),
    );
    let mut statuses = [first.0, second.0];
    statuses.sort_unstable();
    assert_eq!(
        statuses,
        [202, 404],
        "one retry takes the letter: {first:?} {second:?}"
    );
    seen.read_until(&mut user, |tab| !tab.answers().is_empty())
        .await;
    assert_eq!(seen.answers(), ["fault server: hi"]);
    assert_eq!(turn_status(&node, conversation, 1).await, "completed");
    let (_, letters) = get_json(
        &node,
        &acme.api_key,
        &format!(
            "/api/v1/channels/{}/http-agents/dead-letters",
            acme.channel_id
        ),
    )
    .await;
    assert_eq!(letters["deadLetters"], json!([]));
}

#[tokio::test]
async fn json_answers_and_state_deltas_are_committed_as_the_runtime() {
    let server = AgentServer::start("fault_server.py").await;
    for (path, text, state) in [
        ("/json", "json: hi", json!({"json": true})),
        ("/delta", "delta", json!({"count": 2, "items": ["x"]})),
    ] {
        let (node, _, conversation, token) = fault_setup(&server, path).await;
        let mut user = tab(&node.ws_url(""), &token).await;
        send_text(&mut user, "q-1", "hi").await;
        let mut seen = Tab::default();
        seen.read_until(&mut user, |tab| !tab.answers().is_empty())
            .await;
        assert_eq!(seen.answers(), [text], "{path}");
        assert_eq!(runtime(&node, conversation).await, state, "{path}");
    }
}

#[tokio::test]
async fn the_breaker_opens_after_consecutive_failures_and_a_probe_closes_it() {
    let server = AgentServer::start("fault_server.py").await;
    let adjust = calling(&server);
    let node = TestNode::start_with(move |config| {
        adjust(config);
        config.http_agents.breaker_failures = 2;
        // Far above the third call's backoff, so that call meets the open breaker however
        // slow the machine is.
        config.http_agents.breaker_open_ms = 3_000;
    })
    .await;
    let (node, _, conversation, token) = fault_group(node, &server, "/toggle").await;
    let health = reqwest::Client::new();
    let set_healthy = |healthy: bool| {
        health
            .post(server.url("/health"))
            .json(&json!({"healthy": healthy}))
            .send()
    };
    set_healthy(false).await.unwrap();
    let mut user = tab(&node.ws_url(""), &token).await;
    send_text(&mut user, "q-1", "one").await;
    let mut seen = Tab::default();
    seen.read_until(&mut user, |tab| !tab.errors.is_empty())
        .await;
    // Two failures opened the breaker (breaker_failures = 2): the third attempt made no call.
    let toggles = |calls: Vec<Value>| {
        calls
            .iter()
            .filter(|call| call["path"] == "/toggle")
            .count()
    };
    assert_eq!(toggles(server.calls().await), 2);
    assert_eq!(turn_status(&node, conversation, 1).await, "failed");
    let metrics = node.metrics().await;
    assert!(
        metrics.contains("converger_http_agent_calls_total{outcome=\"circuit_open\"} 1"),
        "{metrics}"
    );
    let gauge = format!(
        "converger_http_agent_breaker_open{{url=\"{}\"}}",
        server.url("/toggle")
    );
    assert!(metrics.contains(&format!("{gauge} 1")), "{metrics}");
    // Recovered, and past the open time (what the breaker waits for): the next call probes,
    // succeeds and closes it.
    set_healthy(true).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3_100)).await;
    send_text(&mut user, "q-2", "two").await;
    seen.read_until(&mut user, |tab| !tab.answers().is_empty())
        .await;
    assert_eq!(seen.answers(), ["fault server: two"]);
    assert!(node.metrics().await.contains(&format!("{gauge} 0")));
    send_text(&mut user, "q-3", "three").await;
    seen.read_until(&mut user, |tab| tab.answers().len() == 2)
        .await;
    assert_eq!(toggles(server.calls().await), 4);
}

#[tokio::test]
async fn a_stop_aborts_the_call_and_settles_the_turn_once() {
    let server = AgentServer::start("fault_server.py").await;
    let (node, _, conversation, token) = fault_setup(&server, "/slow").await;
    let mut user = tab(&node.ws_url(""), &token).await;
    send_text(&mut user, "q-1", "hi").await;
    let mut seen = Tab::default();
    seen.read_until(&mut user, |tab| {
        tab.text.values().any(|text| text.contains("w1"))
    })
    .await;
    user.send(json!({"type": "stop"})).await;
    eventually("the turn is stopped", Duration::from_secs(5), || async {
        turn_status(&node, conversation, 1).await == "stopped"
    })
    .await;
    // The call was aborted: the agent saw its caller go away mid-run, and its full answer (ten
    // words) was never committed.
    eventually(
        "the agent saw the call end early",
        Duration::from_secs(5),
        || async {
            let calls = server.calls().await;
            calls.len() == 1 && calls[0]["ended"] == "disconnected"
        },
    )
    .await;
    let (_, page) = node.activities(conversation, &token, "").await;
    let texts: Vec<&str> = page["activities"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|frame| frame["data"]["text"].as_str())
        .collect();
    assert!(!texts.iter().any(|text| text.contains("w9")), "{texts:?}");
}

#[tokio::test]
async fn groups_are_managed_over_rest_within_the_operators_allowlist() {
    let server = AgentServer::start("fault_server.py").await;
    let node = TestNode::start_with(calling(&server)).await;
    let acme = node.tenant_with_channel("acme").await;
    let other = node.tenant_with_channel("other").await;
    let base = format!("/api/v1/channels/{}/http-agents", acme.channel_id);
    let create = |body: Value| post_json(&node, &acme.api_key, &base, body);
    // Outside the allowlist: another port, another host, a redirect-free scheme trick.
    for url in [
        "http://127.0.0.1:1/agent".to_owned(),
        "http://169.254.169.254/latest/meta-data".to_owned(),
        server.url("/ok").replace("http://", "http://user@"),
        server.url("/ok/..%2f..%2fadmin"),
    ] {
        let (status, body) = create(json!({"group": "g", "url": url})).await;
        assert!(status == 403 || status == 400, "{url}: {status} {body}");
    }
    let (status, body) = create(json!({"group": "g", "url": "ftp://127.0.0.1/"})).await;
    assert_eq!(status, 400, "{body}");
    for bad in [
        json!({"group": "bad group", "url": server.url("/ok")}),
        json!({"group": "dead-letters", "url": server.url("/ok")}),
        json!({"group": "g", "url": server.url("/ok"), "timeoutMs": 0}),
        json!({"group": "g", "url": server.url("/ok"), "retry": {"attempts": 0}}),
        json!({"group": "g", "url": server.url("/ok"), "unknown": 1}),
    ] {
        let (status, body) = create(bad.clone()).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let (status, created) =
        create(json!({"group": "g", "url": server.url("/ok"), "secret": "s"})).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["hasSecret"], true);
    assert_eq!(created["retry"], json!({"attempts": 3, "backoffMs": 500}));
    let (status, _) = create(json!({"group": "g", "url": server.url("/ok")})).await;
    assert_eq!(status, 409);
    // Another tenant sees nothing of it.
    let (status, _) = get_json(&node, &other.api_key, &base).await;
    assert_eq!(status, 404);
    let (status, listed) = get_json(&node, &acme.api_key, &base).await;
    assert_eq!(status, 200);
    assert_eq!(listed["httpAgents"].as_array().unwrap().len(), 1);
    assert!(!listed.to_string().contains("\"secret\""), "{listed}");
    let patched = node
        .http
        .patch(node.url(&format!("{base}/g")))
        .header("x-api-key", &acme.api_key)
        .json(&json!({"secret": null, "timeoutMs": 2000}))
        .send()
        .await
        .unwrap();
    assert_eq!(patched.status(), 200);
    let patched: Value = patched.json().await.unwrap();
    assert_eq!(patched["hasSecret"], false);
    assert_eq!(patched["timeoutMs"], 2000);
    let deleted = node
        .http
        .delete(node.url(&format!("{base}/g")))
        .header("x-api-key", &acme.api_key)
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 204);
    let (status, _) = get_json(&node, &acme.api_key, &format!("{base}/g")).await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn a_dead_callers_turn_is_called_again_by_exactly_one_survivor() {
    use converger_client::{RestClient, TokenRequest};
    use support::cluster::{NodeProcess, wait_for_live_nodes};

    let server = AgentServer::start("fault_server.py").await;
    let db = support::TestDb::create().await;
    let allow = format!("{}/", server.base);
    let env = [
        ("CONVERGER_HTTP_AGENTS__ALLOW", allow.as_str()),
        ("CONVERGER_HTTP_AGENTS__RELOAD_MS", "100"),
    ];
    let a = NodeProcess::start_with(&db.url, "a", &[], &env).await;
    let b = NodeProcess::start_with(&db.url, "b", std::slice::from_ref(&a.gossip_addr), &env).await;
    wait_for_live_nodes(&[&a, &b], &["a", "b"]).await;
    let rest = RestClient::new(&a.base_url).unwrap();
    let admin = support::test_config().admin_token;
    let tenant = rest.create_tenant(&admin, "acme").await.unwrap();
    let channel = rest
        .create_channel(&tenant.api_key, "acme-web")
        .await
        .unwrap();
    // The first call of each turn hangs (well within the timeout): only the caller's death
    // ends it.
    let created = reqwest::Client::new()
        .post(format!(
            "{}/api/v1/channels/{}/http-agents",
            a.base_url, channel.id
        ))
        .header("x-api-key", &tenant.api_key)
        .json(
            &json!({"group": "faulty", "url": server.url("/hang-first"), "timeoutMs": 60000,
                      "retry": {"attempts": 3, "backoffMs": 50}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 201);
    // Both nodes serve the group, and each knows both members.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let members = loop {
        let (view_a, view_b) = (a.cluster_view().await, b.cluster_view().await);
        let members = faulty_members(&view_a);
        if members.len() == 2 && members == faulty_members(&view_b) {
            break members;
        }
        assert!(tokio::time::Instant::now() < deadline, "{view_a} {view_b}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let since = members.iter().map(|member| member.2).max().unwrap();
    let wait = since - chrono::Utc::now().timestamp_millis() + 20;
    if wait > 0 {
        tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    }
    let user = rest
        .generate_token(&channel.secret, &TokenRequest::for_user("alice"))
        .await
        .unwrap();
    let conversation = rest.create_conversation(&user.token).await.unwrap();
    let conversation_id = conversation.conversation_id.to_string();
    // The owner, as every node computes it: rendezvous over the two eligible members.
    let owner = members
        .iter()
        .max_by_key(|member| converger_core::groups::owner_hash(&conversation_id, &member.0))
        .map(|member| member.1.clone())
        .unwrap();
    let (caller, survivor) = if owner == "a" { (a, b) } else { (b, a) };
    let mut user_tab = tab(&survivor.ws_url(), &conversation.token).await;
    send_text(&mut user_tab, "q-1", "hi").await;
    let hanging = || async { server.calls().await.len() };
    eventually(
        "the owner made its call",
        Duration::from_secs(10),
        || async {
            let calls = hanging().await;
            assert!(calls <= 1, "one caller");
            calls == 1
        },
    )
    .await;
    caller.kill_9().await;
    // The survivor takes the turn over and calls again under the same key; the turn is
    // answered once.
    let mut seen = Tab::default();
    while seen.answers().is_empty() {
        match user_tab.poll_event(Duration::from_secs(30)).await {
            Some(Ok(frame)) => seen.take(&frame),
            other => panic!("no answer after the caller died: {other:?}"),
        }
    }
    assert_eq!(seen.answers(), ["fault server: hi"]);
    let calls = server.calls().await;
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert_eq!(calls[0]["key"], calls[1]["key"]);
    assert_eq!(calls[1]["attempt"], 2);
    drop(survivor);
}

/// The members of group `faulty` in a cluster view: (connection, node, since), sorted.
fn faulty_members(view: &Value) -> Vec<(String, String, i64)> {
    let mut listed: Vec<(String, String, i64)> = view["members"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|member| member["group"] == "faulty")
        .map(|member| {
            (
                member["connectionId"].as_str().unwrap().to_owned(),
                member["node"].as_str().unwrap().to_owned(),
                member["since"].as_i64().unwrap(),
            )
        })
        .collect();
    listed.sort();
    listed
}
