//! The chat frontends (docs/frontends.md, ADR 0030) with their real clients: the `ai` packages
//! 5, 6 and 7 (`DefaultChatTransport` and `readUIMessageStream`, which validate every chunk),
//! `@ag-ui/client`'s `HttpAgent` (its verifier on) in Node, and a React page with
//! `@ai-sdk/react`'s `useChat` in headless Chromium. The scripts live in `tests/frontends/`
//! (installed and bundled by `.ci/test-prerequisites`); each prints what its client saw as JSON.

mod support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use support::browser::Browser;
use support::ws::WsClient;
use support::{TestNode, eventually, next_turn, settle, setup, stream_words, workspace_root};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use uuid::Uuid;

/// How long a client script may run.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(60);

fn quick(config: &mut converger_gateway::Config) {
    config.group_settle_ms = 100;
    config.turns.stop_grace_ms = 300;
}

fn frontends_dir() -> PathBuf {
    workspace_root().join("tests/frontends")
}

/// A client script of `tests/frontends/` against `base`, as `token` in `conversation`.
fn script(base: &str, token: &str, conversation: Uuid, args: &[&str]) -> Command {
    let mut command = Command::new("node");
    command
        .current_dir(frontends_dir())
        .args(args)
        .env("BASE", base)
        .env("TOKEN", token)
        .env("CONVERSATION", conversation.to_string())
        .env("SUPPRESS_TRANSFORMATION_WARNINGS", "true")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

/// Waits for a script and returns the JSON it printed; fails the test on a non-zero exit.
async fn finished(child: Child) -> Value {
    let output = tokio::time::timeout(SCRIPT_TIMEOUT, child.wait_with_output())
        .await
        .expect("the client script finished in time")
        .expect("the client script ran");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "client script failed ({}): {stdout}\n{stderr}",
        output.status
    );
    serde_json::from_str(stdout.trim()).unwrap_or_else(|error| panic!("{error}: {stdout}"))
}

fn chunk_types(chunks: &Value) -> Vec<String> {
    chunks
        .as_array()
        .unwrap()
        .iter()
        .map(|chunk| chunk["type"].as_str().unwrap().to_owned())
        .collect()
}

/// Every `text-delta` of `part`, joined: what the client was shown of it, each delta once.
fn deltas(chunks: &Value, part: &str) -> String {
    chunks
        .as_array()
        .unwrap()
        .iter()
        .filter(|chunk| chunk["type"] == "text-delta" && chunk["id"] == part)
        .map(|chunk| chunk["delta"].as_str().unwrap())
        .collect()
}

/// The text parts of a `UIMessage`, joined.
fn message_text(message: &Value) -> String {
    message["parts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|part| part["type"] == "text")
        .map(|part| part["text"].as_str().unwrap())
        .collect()
}

/// `GET …/ai-sdk/chat/{id}/messages`: the chat's history as `UIMessage`s.
async fn chat_history(node: &TestNode, conversation_id: Uuid, token: &str) -> Value {
    node.http
        .get(node.url(&format!("/api/v1/ai-sdk/chat/{conversation_id}/messages")))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The `delta`s of every `TEXT_MESSAGE_CONTENT` among AG-UI `events`, joined.
fn contents(events: &[Value]) -> String {
    events
        .iter()
        .filter(|event| event["type"] == "TEXT_MESSAGE_CONTENT")
        .map(|event| event["delta"].as_str().unwrap())
        .collect()
}

/// A ready agent in group `bot` of the fixture's channel.
async fn bot(node: &TestNode, acme: &support::TenantFixture) -> WsClient {
    let token = node.agent_token(acme).await;
    let (agent, welcome) = node.agent(&token, Some("bot")).await;
    settle(&welcome).await;
    agent
}

/// A `turnResult` for `seq` with `frames`, and optionally a new runtime.
fn turn_result(conversation: &str, seq: i64, frames: Value, runtime: Option<Value>) -> Value {
    let mut frame = json!({"type": "turnResult", "clientId": format!("r-{seq}"),
                           "turn": {"seq": seq}, "frames": frames});
    if let Some(runtime) = runtime {
        frame["runtime"] = runtime;
    }
    json!({"conversationId": conversation, "frame": frame})
}

/// A `turnResult` for `seq` whose one frame is the text `stream` streamed.
fn streamed_result(conversation: &str, seq: i64, stream: &str, text: &str) -> Value {
    let frames = json!([{"type": "text", "streamId": stream, "data": {"text": text}}]);
    turn_result(conversation, seq, frames, None)
}

/// A streamed text, a tool call and its result, and a generative-UI frame, committed.
async fn answer_with_everything(
    agent: &mut WsClient,
    conversation: &str,
    seq: i64,
    stream: &str,
) -> String {
    let streamed = stream_words(agent, conversation, stream, seq, 0..3).await;
    let text = format!("{streamed}done");
    let frames = json!([
        {"type": "tool_call", "data": {"name": "find_table", "arguments": {"party": 4}}},
        {"type": "tool_result", "data": {"name": "find_table", "result": {"table": "T4"}}},
        {"type": "genui", "data": {"component": "card", "title": "T4"}},
        {"type": "text", "streamId": stream, "data": {"text": text}},
    ]);
    agent
        .send(turn_result(conversation, seq, frames, None))
        .await;
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ai_sdk_5_6_and_7_parse_a_whole_answer_and_a_stopped_one() {
    let node = TestNode::start_with(quick).await;
    let (acme, conversation_id, token) = setup(&node).await;
    let mut agent = bot(&node, &acme).await;
    let base = node.url("");
    for major in ["5", "6", "7"] {
        let message_id = format!("u-{major}");
        let child = script(
            &base,
            &token,
            conversation_id,
            &["ai-sdk.mjs", major, "send", &message_id, "table for 4"],
        )
        .spawn()
        .unwrap();
        let (conversation, seq, _) = next_turn(&mut agent).await;
        let stream = format!("s-{major}");
        let text = answer_with_everything(&mut agent, &conversation, seq, &stream).await;
        let seen = finished(child).await;
        let types = chunk_types(&seen["chunks"]);
        assert_eq!(
            types.first().map(String::as_str),
            Some("start"),
            "ai@{major}: {types:?}"
        );
        assert_eq!(seen["chunks"][0]["messageId"], format!("answer-{seq}-0"));
        for expected in [
            "text-start",
            "text-delta",
            "tool-input-available",
            "tool-output-available",
            "data-genui",
            "text-end",
            "finish",
        ] {
            assert!(
                types.iter().any(|kind| kind == expected),
                "ai@{major} saw no {expected}: {types:?}"
            );
        }
        assert_eq!(
            deltas(&seen["chunks"], &stream),
            text,
            "ai@{major}: every delta once"
        );
        let message = &seen["message"];
        assert_eq!(message_text(message), text, "ai@{major}");
        let tool = message["parts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|part| {
                part["type"] == "dynamic-tool"
                    || part["type"]
                        .as_str()
                        .is_some_and(|kind| kind.starts_with("tool-"))
            })
            .cloned();
        let tool = tool.unwrap_or_else(|| panic!("ai@{major}: a tool part in {message}"));
        assert_eq!(tool["state"], "output-available", "ai@{major}: {tool}");
        assert_eq!(tool["output"], json!({"table": "T4"}));
        // A retry of the same message stores nothing and shows the same committed answer.
        let again = finished(
            script(
                &base,
                &token,
                conversation_id,
                &["ai-sdk.mjs", major, "send", &message_id, "table for 4"],
            )
            .spawn()
            .unwrap(),
        )
        .await;
        assert_eq!(message_text(&again["message"]), text, "ai@{major} retry");
    }
    let users = node.activities(conversation_id, &token, "").await.1["activities"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|frame| frame["sender"]["role"] == "user")
        .count();
    assert_eq!(users, 3, "each message id stored once");

    // Stopped mid-stream: `abort`, and the history shows what streamed, as the page did.
    for major in ["5", "7"] {
        let mut command = script(
            &base,
            &token,
            conversation_id,
            &[
                "ai-sdk.mjs",
                major,
                "send",
                &format!("stop-{major}"),
                "long story",
            ],
        );
        command.env("STOP_AFTER_CHUNKS", "2");
        let child = command.spawn().unwrap();
        let (conversation, seq, _) = next_turn(&mut agent).await;
        let stream = format!("long-{major}");
        let streamed = stream_words(&mut agent, &conversation, &stream, seq, 0..2).await;
        let cancel = agent.skip_to_enveloped("cancel").await;
        assert_eq!(cancel["turn"]["seq"], seq, "{cancel}");
        let seen = finished(child).await;
        let types = chunk_types(&seen["chunks"]);
        assert_eq!(
            types.last().map(String::as_str),
            Some("abort"),
            "ai@{major}: {types:?}"
        );
        assert_eq!(message_text(&seen["message"]), streamed, "ai@{major}");
        let history = chat_history(&node, conversation_id, &token).await;
        let answer = history
            .as_array()
            .unwrap()
            .iter()
            .find(|message| message["id"] == format!("answer-{seq}-0"))
            .unwrap_or_else(|| panic!("the stopped answer in {history}"));
        assert_eq!(
            message_text(answer),
            streamed,
            "a reload shows what the page showed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regenerate_ends_the_replaced_answer_and_a_retry_shows_the_new_one() {
    let node = TestNode::start_with(quick).await;
    let (acme, conversation_id, token) = setup(&node).await;
    let mut agent = bot(&node, &acme).await;
    let base = node.url("");
    let send = ["ai-sdk.mjs", "7", "send", "r-1", "tell me"];
    let first = script(&base, &token, conversation_id, &send)
        .spawn()
        .unwrap();
    let (conversation, seq, _) = next_turn(&mut agent).await;
    let streamed = stream_words(&mut agent, &conversation, "s-r0", seq, 0..2).await;
    let regenerate = ["ai-sdk.mjs", "7", "regenerate", "r-1", "tell me"];
    let again = script(&base, &token, conversation_id, &regenerate)
        .spawn()
        .unwrap();
    let revision = loop {
        let delivered = agent.recv().await;
        let turn = &delivered["frame"]["meta"]["turn"];
        if turn["seq"] == seq && turn["revision"] == 1 {
            break 1;
        }
    };
    let answer = json!({"conversationId": conversation, "frame": {"type": "turnResult",
        "clientId": "r-again", "turn": {"seq": seq, "revision": revision},
        "frames": [{"type": "text", "data": {"text": "A second answer."}}]}});
    agent.send(answer).await;
    let replaced = finished(first).await;
    assert_eq!(
        chunk_types(&replaced["chunks"]).last().map(String::as_str),
        Some("abort"),
        "the replaced answer's stream ends: {replaced}"
    );
    assert_eq!(message_text(&replaced["message"]), streamed);
    let new = finished(again).await;
    assert_eq!(new["chunks"][0]["messageId"], format!("answer-{seq}-1"));
    assert_eq!(message_text(&new["message"]), "A second answer.");
    // A retry of the first send stores nothing and shows the answer that counts.
    let retry = finished(
        script(&base, &token, conversation_id, &send)
            .spawn()
            .unwrap(),
    )
    .await;
    assert_eq!(message_text(&retry["message"]), "A second answer.");
    let history = chat_history(&node, conversation_id, &token).await;
    let texts: Vec<String> = history
        .as_array()
        .unwrap()
        .iter()
        .map(message_text)
        .collect();
    assert_eq!(texts, vec!["tell me", "A second answer."], "{history}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ag_ui_http_agent_runs_connects_mid_run_stops_and_resumes_an_interrupt() {
    let node = TestNode::start_with(quick).await;
    let (acme, conversation_id, token) = setup(&node).await;
    let mut agent = bot(&node, &acme).await;
    let base = node.url("");

    // A run: the verifier passes, the answer's parts map to events, the runtime is the state,
    // and what the client forwards reaches the agent in the turn's meta.
    let mut command = script(
        &base,
        &token,
        conversation_id,
        &["ag-ui.mjs", "run", "m-1", "table for 4"],
    );
    command.env("FORWARDED_PROPS", r#"{"page":"booking"}"#);
    let child = command.spawn().unwrap();
    let delivered = agent.skip_to_enveloped("text").await;
    let client = &delivered["meta"]["client"]["agUi"];
    assert_eq!(
        client["forwardedProps"],
        json!({"page": "booking"}),
        "{delivered}"
    );
    assert_eq!(client["tools"], json!([]), "{delivered}");
    let conversation = conversation_id.to_string();
    let seq = delivered["meta"]["turn"]["seq"].as_i64().unwrap();
    let streamed = stream_words(&mut agent, &conversation, "s-run", seq, 0..3).await;
    let frames = json!([
        {"type": "tool_call", "data": {"name": "find_table", "arguments": {"party": 4}}},
        {"type": "tool_result", "data": {"name": "find_table", "result": {"table": "T4"}}},
        {"type": "text", "streamId": "s-run", "data": {"text": streamed}},
    ]);
    let runtime = json!({"version": 0, "state": {"table": "T4"}});
    agent
        .send(turn_result(&conversation, seq, frames, Some(runtime)))
        .await;
    let run = finished(child).await;
    let types: Vec<&str> = run["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| event["type"].as_str().unwrap())
        .collect();
    assert_eq!(types.first(), Some(&"RUN_STARTED"), "{types:?}");
    assert_eq!(types.last(), Some(&"RUN_FINISHED"), "{types:?}");
    for expected in [
        "TEXT_MESSAGE_START",
        "TEXT_MESSAGE_CONTENT",
        "TEXT_MESSAGE_END",
        "TOOL_CALL_START",
        "TOOL_CALL_ARGS",
        "TOOL_CALL_END",
        "TOOL_CALL_RESULT",
        "STATE_SNAPSHOT",
    ] {
        assert!(types.contains(&expected), "no {expected}: {types:?}");
    }
    assert_eq!(run["state"], json!({"table": "T4"}));
    let content = contents(run["events"].as_array().unwrap());
    assert_eq!(content, streamed, "each chunk once");

    // A second client connects mid-run: the snapshot, then the run from its start, live.
    let mut tab = WsClient::connect(&node.ws_url("")).await;
    tab.hello(&token, json!({})).await;
    tab.send(json!({"type": "text", "clientId": "q-2", "data": {"text": "and dessert?"}}))
        .await;
    tab.skip_to("ack").await;
    let (_, seq, _) = next_turn(&mut agent).await;
    let first = stream_words(&mut agent, &conversation, "s-mid", seq, 0..2).await;
    let mut command = script(&base, &token, conversation_id, &["ag-ui.mjs", "connect"]);
    command.env("CONNECT_UNTIL_RUNS", "1");
    let mut connect = command.spawn().unwrap();
    let mut lines = BufReader::new(connect.stdout.take().unwrap()).lines();
    let mut events = Vec::new();
    // Once the catch-up shows, the agent goes on live.
    while !events
        .iter()
        .any(|event: &Value| event["type"] == "TEXT_MESSAGE_CONTENT")
    {
        let line = tokio::time::timeout(SCRIPT_TIMEOUT, lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .expect("an event");
        events.push(serde_json::from_str(&line).unwrap());
    }
    let rest = stream_words(&mut agent, &conversation, "s-mid", seq, 2..4).await;
    agent
        .send(streamed_result(
            &conversation,
            seq,
            "s-mid",
            &format!("{first}{rest}"),
        ))
        .await;
    while let Ok(Some(line)) = tokio::time::timeout(SCRIPT_TIMEOUT, lines.next_line())
        .await
        .unwrap()
    {
        events.push(serde_json::from_str(&line).unwrap());
    }
    assert!(
        tokio::time::timeout(SCRIPT_TIMEOUT, connect.wait())
            .await
            .unwrap()
            .unwrap()
            .success()
    );
    assert_eq!(events[0]["type"], "RUN_STARTED", "{events:?}");
    assert_eq!(events[1]["type"], "MESSAGES_SNAPSHOT", "{events:?}");
    let snapshot_texts: Vec<&str> = events[1]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|message| message["content"].as_str())
        .collect();
    assert!(
        snapshot_texts.contains(&"table for 4") && snapshot_texts.contains(&"and dessert?"),
        "{snapshot_texts:?}"
    );
    let live = contents(&events);
    assert_eq!(
        live,
        format!("{first}{rest}"),
        "the catch-up then the live rest, each once"
    );
    assert_eq!(events.last().unwrap()["type"], "RUN_FINISHED");

    // Stop: the agent gets cancel, the run ends cancelled.
    let child = script(
        &base,
        &token,
        conversation_id,
        &["ag-ui.mjs", "run", "m-3", "long story"],
    )
    .spawn()
    .unwrap();
    let (_, seq, _) = next_turn(&mut agent).await;
    stream_words(&mut agent, &conversation, "s-stop", seq, 0..2).await;
    let stopped = finished(
        script(&base, &token, conversation_id, &["ag-ui.mjs", "stop"])
            .spawn()
            .unwrap(),
    )
    .await;
    assert_eq!(stopped["status"], 200, "{stopped}");
    agent.skip_to_enveloped("cancel").await;
    let run = finished(child).await;
    let last = run["events"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["type"], "RUN_FINISHED", "{run}");
    assert_eq!(last["outcome"]["type"], "cancelled", "{last}");

    // An interrupt, answered by the next run's resume[]: a turn of its own.
    let child = script(
        &base,
        &token,
        conversation_id,
        &[
            "ag-ui.mjs",
            "interrupt-roundtrip",
            "m-4",
            "book it",
            r#"{"answer":"yes"}"#,
        ],
    )
    .spawn()
    .unwrap();
    let (_, seq, _) = next_turn(&mut agent).await;
    let interrupt = json!([{"type": "interrupt", "id": "int-1", "data": {"question": "Book T4?"}}]);
    agent
        .send(turn_result(&conversation, seq, interrupt, None))
        .await;
    let resumed = agent.skip_to_enveloped("interrupt_response").await;
    assert_eq!(
        resumed["data"]["resume"][0]["interruptId"], "int-1",
        "{resumed}"
    );
    assert_eq!(
        resumed["data"]["resume"][0]["payload"],
        json!({"answer": "yes"})
    );
    let seq = resumed["meta"]["turn"]["seq"].as_i64().unwrap();
    agent
        .send(turn_result(
            &conversation,
            seq,
            json!([{"type": "text", "data": {"text": "Booked."}}]),
            None,
        ))
        .await;
    let runs = finished(child).await;
    let first_end = runs["runs"][0]["events"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(first_end["outcome"]["type"], "interrupt", "{first_end}");
    assert_eq!(first_end["outcome"]["interrupts"][0]["id"], "int-1");
    let second = contents(runs["runs"][1]["events"].as_array().unwrap());
    assert_eq!(second, "Booked.");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_on_one_node_an_agent_on_another_and_a_resume_on_a_third() {
    let node = TestNode::start_with(quick).await;
    let peer_b = node.start_peer_with(quick).await;
    let peer_c = node.start_peer_with(quick).await;
    let (acme, conversation_id, token) = setup(&node).await;
    let agent_token = node.agent_token(&acme).await;
    let mut agent = WsClient::connect(&support::peer_ws_url(&peer_b)).await;
    let welcome = agent.hello(&agent_token, json!({"group": "bot"})).await;
    settle(&welcome).await;
    let post = script(
        &node.url(""),
        &token,
        conversation_id,
        &["ai-sdk.mjs", "7", "send", "x-1", "hello"],
    )
    .spawn()
    .unwrap();
    let (conversation, seq, _) = next_turn(&mut agent).await;
    let first = stream_words(&mut agent, &conversation, "s-x", seq, 0..2).await;
    let base_c = format!("http://{}", peer_c.addr());
    // The resume on C: the stream from its start, then live (C holds the relayed chunks).
    // The agent goes on once the resume showed what streamed so far (the script says so on
    // stderr as its client reads each chunk).
    let mut command = script(
        &base_c,
        &token,
        conversation_id,
        &["ai-sdk.mjs", "7", "resume"],
    );
    command.env("PROGRESS", "1");
    let mut resume = command.spawn().unwrap();
    let mut progress = BufReader::new(resume.stderr.take().unwrap()).lines();
    loop {
        let line = tokio::time::timeout(SCRIPT_TIMEOUT, progress.next_line())
            .await
            .unwrap()
            .unwrap()
            .expect("the resume streams");
        if line == "chunk text-delta" {
            break;
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = progress.next_line().await {} });
    let rest = stream_words(&mut agent, &conversation, "s-x", seq, 2..4).await;
    let text = format!("{first}{rest}");
    agent
        .send(streamed_result(&conversation, seq, "s-x", &text))
        .await;
    for seen in [finished(post).await, finished(resume).await] {
        assert!(seen["chunks"].is_array(), "{seen}");
        assert_eq!(
            deltas(&seen["chunks"], "s-x"),
            text,
            "every delta once: {seen}"
        );
        assert_eq!(message_text(&seen["message"]), text);
        assert_eq!(
            chunk_types(&seen["chunks"]).last().map(String::as_str),
            Some("finish")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_documented_errors_and_stores_nothing() {
    let node = TestNode::start_with(|config| {
        config.frontends.allow_origins = vec!["http://app.example".into()];
    })
    .await;
    let (acme, conversation_id, token) = setup(&node).await;
    let (other_conversation, _) = node.conversation(&acme, "bob").await;
    let agent_token = node.agent_token(&acme).await;
    let chat = node.url("/api/v1/ai-sdk/chat");
    let message =
        |id: &str| json!({"id": id, "role": "user", "parts": [{"type": "text", "text": "hi"}]});
    let body =
        |id: Value| json!({"id": id, "messages": [message("u-1")], "trigger": "submit-message"});
    let post = |body: Value, token: &str| node.http.post(&chat).bearer_auth(token).json(&body);
    let status_and_code = |response: reqwest::Response| async move {
        let status = response.status().as_u16();
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        (
            status,
            answer["error"]["code"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        )
    };
    let cases: Vec<(&str, reqwest::RequestBuilder, u16, &str)> = vec![
        (
            "malformed",
            node.http
                .post(&chat)
                .bearer_auth(&token)
                .header("content-type", "application/json")
                .body("{nope"),
            400,
            "bad_request",
        ),
        (
            "missing id",
            post(json!({"messages": [message("u-1")]}), &token),
            400,
            "bad_request",
        ),
        (
            "no user message",
            post(json!({"id": conversation_id, "messages": []}), &token),
            400,
            "bad_request",
        ),
        (
            "bad message id",
            post(
                json!({"id": conversation_id, "messages": [message("has space")]}),
                &token,
            ),
            400,
            "bad_request",
        ),
        (
            "unknown conversation",
            post(body(json!(Uuid::new_v4())), &token),
            404,
            "conversation_not_found",
        ),
        (
            "foreign conversation",
            post(body(json!(other_conversation)), &token),
            404,
            "conversation_not_found",
        ),
        (
            "wrong token",
            post(body(json!(conversation_id)), "not-a-token"),
            401,
            "unauthorized",
        ),
        (
            "agent token",
            post(body(json!(conversation_id)), &agent_token),
            403,
            "forbidden",
        ),
        (
            "disallowed origin",
            post(body(json!(conversation_id)), &token).header("origin", "http://evil.example"),
            403,
            "forbidden",
        ),
        (
            "oversized messages",
            post(
                json!({"id": conversation_id, "messages": vec![message("u-1"); 20_000]}),
                &token,
            ),
            413,
            "payload_too_large",
        ),
        (
            "ag-ui malformed",
            node.http
                .post(node.url("/api/v1/ag-ui/run"))
                .bearer_auth(&token)
                .json(&json!({"threadId": conversation_id})),
            400,
            "bad_request",
        ),
        (
            "ag-ui foreign thread",
            node.http
                .post(node.url("/api/v1/ag-ui/run"))
                .bearer_auth(&token)
                .json(&json!({"threadId": other_conversation, "runId": "r", "messages": []})),
            404,
            "conversation_not_found",
        ),
    ];
    for (name, request, status, code) in cases {
        let (got_status, got_code) = status_and_code(request.send().await.unwrap()).await;
        assert_eq!((got_status, got_code.as_str()), (status, code), "{name}");
    }
    let (_, stored) = node.activities(conversation_id, &token, "").await;
    assert_eq!(stored["activities"], json!([]), "nothing stored");

    // A listed origin gets its preflight answered and CORS headers on the answer.
    let preflight = node
        .http
        .request(reqwest::Method::OPTIONS, &chat)
        .header("origin", "http://app.example")
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization, content-type",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(preflight.status().as_u16(), 204);
    let headers = preflight.headers();
    assert_eq!(headers["access-control-allow-origin"], "http://app.example");
    assert!(
        headers["access-control-allow-headers"]
            .to_str()
            .unwrap()
            .contains("authorization")
    );
    let history = node
        .http
        .get(node.url(&format!("/api/v1/ai-sdk/chat/{conversation_id}/messages")))
        .bearer_auth(&token)
        .header("origin", "http://app.example")
        .send()
        .await
        .unwrap();
    assert_eq!(
        history.headers()["access-control-allow-origin"],
        "http://app.example"
    );
    assert_eq!(history.json::<Value>().await.unwrap(), json!([]));
    let idle = node
        .http
        .get(node.url(&format!("/api/v1/ai-sdk/chat/{conversation_id}/stream")))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(idle.status().as_u16(), 204, "no answer in progress");
}

/// Serves `dir` on an ephemeral port (another origin than the node's); its base URL.
async fn serve_directory(dir: PathBuf) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(move |uri: axum::http::Uri| {
        let dir = dir.clone();
        async move {
            let name = uri.path().trim_start_matches('/');
            let content_type = if name.ends_with(".html") {
                "text/html"
            } else {
                "text/javascript"
            };
            let response = axum::response::Response::builder();
            match std::fs::read(dir.join(name)) {
                Ok(bytes) => response
                    .header(axum::http::header::CONTENT_TYPE, content_type)
                    .body(axum::body::Body::from(bytes)),
                Err(_) => response.status(404).body(axum::body::Body::empty()),
            }
            .expect("a plain response")
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{address}")
}

/// The page's assistant text for `answer_id`, as `useChat` holds it.
fn page_answer(id: &str) -> String {
    format!(
        "(window.chatState?.messages ?? []).filter(m => m.id === '{id}').flatMap(m => m.parts).filter(p => p.type === 'text').map(p => p.text).join('')"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn use_chat_in_a_browser_streams_resumes_after_a_reload_and_stops() {
    let pages = serve_directory(frontends_dir().join("dist")).await;
    let node = TestNode::start_with(|config| {
        quick(config);
        config.frontends.allow_origins = vec![pages.clone()];
    })
    .await;
    let (acme, conversation_id, token) = setup(&node).await;
    let mut agent = bot(&node, &acme).await;
    let page = format!(
        "{pages}/chat.html?base={}&token={token}&conversation={conversation_id}",
        node.url("")
    );
    let mut browser = Browser::launch().await;
    browser.navigate(&page).await;
    browser
        .wait_for("window.chatState?.status === 'ready'")
        .await;
    browser
        .evaluate("document.getElementById('input').value = 'Tell me a story'; document.getElementById('send').click(); true")
        .await;
    let (conversation, seq, _) = next_turn(&mut agent).await;
    let first = stream_words(&mut agent, &conversation, "s-page", seq, 0..3).await;
    let answer = format!("answer-{seq}-0");
    browser
        .wait_for(&format!("{} === '{first}'", page_answer(&answer)))
        .await;

    // A reload mid-stream: the history, then the answer in progress from its start, live; and
    // a second tab opened now follows it too.
    browser.navigate(&page).await;
    browser
        .wait_for(&format!("{} === '{first}'", page_answer(&answer)))
        .await;
    let mut second_tab = Browser::launch().await;
    second_tab.navigate(&page).await;
    second_tab
        .wait_for(&format!("{} === '{first}'", page_answer(&answer)))
        .await;
    let rest = stream_words(&mut agent, &conversation, "s-page", seq, 3..6).await;
    let text = format!("{first}{rest}The end.");
    agent
        .send(streamed_result(&conversation, seq, "s-page", &text))
        .await;
    browser
        .wait_for(&format!(
            "{} === '{text}' && window.chatState.status === 'ready'",
            page_answer(&answer)
        ))
        .await;
    second_tab
        .wait_for(&format!(
            "{} === '{text}' && window.chatState.status === 'ready'",
            page_answer(&answer)
        ))
        .await;
    drop(second_tab);
    browser.keep_screenshot("ai-sdk-use-chat.png").await;

    // Stop: the agent is told, the page keeps what streamed, and so does a reload.
    browser
        .evaluate("document.getElementById('input').value = 'Another'; document.getElementById('send').click(); true")
        .await;
    let (_, seq, _) = next_turn(&mut agent).await;
    let streamed = stream_words(&mut agent, &conversation, "s-stop", seq, 0..2).await;
    let answer = format!("answer-{seq}-0");
    browser
        .wait_for(&format!("{} === '{streamed}'", page_answer(&answer)))
        .await;
    browser
        .evaluate("document.getElementById('stop').click(); true")
        .await;
    agent.skip_to_enveloped("cancel").await;
    browser
        .wait_for("window.chatState.status === 'ready'")
        .await;
    eventually("the stop settled", Duration::from_secs(10), || async {
        let history = chat_history(&node, conversation_id, &token).await;
        history
            .as_array()
            .unwrap()
            .iter()
            .any(|message| message["id"] == answer)
    })
    .await;
    browser.navigate(&page).await;
    browser
        .wait_for(&format!("{} === '{streamed}'", page_answer(&answer)))
        .await;
    browser.keep_screenshot("ai-sdk-use-chat-stopped.png").await;
}
