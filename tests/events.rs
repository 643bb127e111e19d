//! A conversation over Server-Sent Events, over real HTTP against real nodes on one database:
//! frames from another node, resume by Last-Event-ID after a cut with no gap and no double,
//! heartbeats, `retry:`, token expiry, force-disconnect and refusals.

mod support;

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use support::TestNode;

/// One server-sent event.
#[derive(Debug, Default, Clone)]
struct SseEvent {
    id: Option<String>,
    event: Option<String>,
    data: String,
    retry: Option<u64>,
    comments: Vec<String>,
}

/// Reads events off a streaming response.
struct SseReader {
    response: reqwest::Response,
    buffer: String,
}

impl SseReader {
    async fn open(url: &str, token: Option<&str>, last_event_id: Option<&str>) -> SseReader {
        let mut request = reqwest::Client::new().get(url);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(id) = last_event_id {
            request = request.header("last-event-id", id);
        }
        let response = request.send().await.expect("GET events");
        assert_eq!(response.status(), StatusCode::OK);
        assert!(
            response.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/event-stream")
        );
        SseReader {
            response,
            buffer: String::new(),
        }
    }

    /// The next event; `None` when the stream ended.
    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let mut event = SseEvent::default();
                for line in block.lines() {
                    if let Some(comment) = line.strip_prefix(':') {
                        event.comments.push(comment.trim().to_owned());
                    } else if let Some((field, value)) = line.split_once(':') {
                        let value = value.strip_prefix(' ').unwrap_or(value);
                        match field {
                            "id" => event.id = Some(value.to_owned()),
                            "event" => event.event = Some(value.to_owned()),
                            "data" => event.data.push_str(value),
                            "retry" => event.retry = value.parse().ok(),
                            _ => {}
                        }
                    }
                }
                return Some(event);
            }
            let chunk = tokio::time::timeout(Duration::from_secs(10), self.response.chunk())
                .await
                .expect("an event in time")
                .expect("stream readable")?;
            self.buffer
                .push_str(std::str::from_utf8(&chunk).expect("utf-8"));
        }
    }

    /// The next event that carries data (skipping comments and the `retry` preamble).
    async fn next_data(&mut self) -> Option<SseEvent> {
        loop {
            let event = self.next().await?;
            if !event.data.is_empty() {
                return Some(event);
            }
        }
    }
}

async fn post(node_url: &str, conversation: &uuid::Uuid, token: &str, text: &str) -> i64 {
    let response = reqwest::Client::new()
        .post(format!(
            "{node_url}/api/v1/converger/conversations/{conversation}/activities"
        ))
        .bearer_auth(token)
        .json(&json!({"type": "text", "data": {"text": text}}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    response.json::<Value>().await.unwrap()["seq"]
        .as_i64()
        .unwrap()
}

fn quick_heartbeats(config: &mut converger_gateway::Config) {
    config.limits.heartbeat_interval_ms = 200;
}

#[tokio::test]
async fn events_follow_the_other_nodes_frames_and_resume_by_last_event_id_without_gap_or_double() {
    let node = TestNode::start_with(quick_heartbeats).await;
    let peer = node.start_peer().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation, token) = node.conversation(&acme, "alice").await;
    let url = node.url(&format!(
        "/api/v1/converger/conversations/{conversation}/events"
    ));
    let mut events = SseReader::open(&url, Some(&token), None).await;
    let first = events.next().await.unwrap();
    assert_eq!(first.retry, Some(2000), "{first:?}");

    // Frames committed on the other node arrive, each with its seq as the event id.
    for n in 1..=3 {
        post(&peer.base_url(), &conversation, &token, &format!("m{n}")).await;
    }
    let mut ids = Vec::new();
    let mut heartbeats = 0;
    while ids.len() < 3 {
        let event = events.next().await.unwrap();
        heartbeats += event.comments.iter().filter(|c| *c == "heartbeat").count();
        if event.data.is_empty() {
            continue;
        }
        let frame: Value = serde_json::from_str(&event.data).unwrap();
        assert_eq!(frame["type"], "text");
        assert_eq!(event.id.as_deref(), Some(frame["seq"].to_string().as_str()));
        assert_eq!(frame["from"], "user");
        ids.push(frame["seq"].as_i64().unwrap());
    }
    assert_eq!(ids, vec![1, 2, 3]);
    // Idle: heartbeat comments keep the stream alive.
    while heartbeats == 0 {
        let event = events.next().await.unwrap();
        heartbeats += event.comments.iter().filter(|c| *c == "heartbeat").count();
    }

    // Cut after seq 2 was seen (as if 3 was lost on the way); more frames commit meanwhile.
    drop(events);
    post(&peer.base_url(), &conversation, &token, "m4").await;
    post(&node.server.base_url(), &conversation, &token, "m5").await;
    // Last-Event-ID wins over ?watermark= (which would replay everything).
    let resumed_url = format!("{url}?watermark=0&token={token}");
    let mut resumed = SseReader::open(&resumed_url, None, Some("2")).await;
    let mut seqs = Vec::new();
    while seqs.len() < 3 {
        let event = resumed.next_data().await.unwrap();
        seqs.push(event.id.unwrap().parse::<i64>().unwrap());
    }
    assert_eq!(seqs, vec![3, 4, 5], "no gap, no double");
    post(&peer.base_url(), &conversation, &token, "m6").await;
    let live = resumed.next_data().await.unwrap();
    assert_eq!(live.id.as_deref(), Some("6"));

    // A close reaches the stream as the persistent frame it is.
    let closed = reqwest::Client::new()
        .post(format!(
            "{}/api/v1/converger/conversations/{conversation}/close",
            peer.base_url()
        ))
        .bearer_auth(&token)
        .send()
        .await
        .unwrap();
    assert_eq!(closed.status(), StatusCode::OK);
    let update = resumed.next_data().await.unwrap();
    let frame: Value = serde_json::from_str(&update.data).unwrap();
    assert_eq!(
        (frame["type"].as_str(), update.id.as_deref()),
        (Some("conversationUpdate"), Some("7"))
    );
}

#[tokio::test]
async fn a_stream_ends_with_an_error_event_at_token_expiry_and_at_a_force_disconnect() {
    let node = TestNode::start_with(|config| config.token_ttl_secs = 2).await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation, token) = node.conversation(&acme, "alice").await;
    let url = node.url(&format!(
        "/api/v1/converger/conversations/{conversation}/events"
    ));
    let mut events = SseReader::open(&url, Some(&token), None).await;
    let error = loop {
        let event = events.next().await.expect("an error event before the end");
        if event.event.as_deref() == Some("error") {
            break event;
        }
    };
    let frame: Value = serde_json::from_str(&error.data).unwrap();
    assert_eq!(frame["data"]["code"], "token_expired");
    assert!(events.next().await.is_none(), "the stream ends");

    // An operator's disconnect ends a stream too, and counts it.
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation, token) = node.conversation(&acme, "alice").await;
    let url = node.url(&format!(
        "/api/v1/converger/conversations/{conversation}/events"
    ));
    let mut events = SseReader::open(&url, Some(&token), None).await;
    events.next().await.unwrap();
    let answer: Value = reqwest::Client::new()
        .post(node.url("/api/v1/admin/disconnect"))
        .bearer_auth(&node.admin_token)
        .json(&json!({"tenantId": acme.tenant_id, "conversationId": conversation, "reason": "bye"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["closed"], 1, "{answer}");
    let error = events.next_data().await.unwrap();
    assert_eq!(error.event.as_deref(), Some("error"));
    let frame: Value = serde_json::from_str(&error.data).unwrap();
    assert_eq!(frame["data"]["message"], "bye");
    assert!(events.next().await.is_none());
}

#[tokio::test]
async fn events_refuse_strangers_bad_watermarks_and_agents() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (conversation, token) = node.conversation(&acme, "alice").await;
    let (_, bob) = node.conversation(&acme, "bob").await;
    let agent = node.agent_token(&acme).await;
    let url = node.url(&format!(
        "/api/v1/converger/conversations/{conversation}/events"
    ));
    let client = reqwest::Client::new();
    let cases: Vec<(reqwest::RequestBuilder, StatusCode, &str)> = vec![
        (client.get(&url), StatusCode::UNAUTHORIZED, "unauthorized"),
        (
            client.get(format!("{url}?token=nonsense")),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            client.get(&url).bearer_auth(&bob),
            StatusCode::NOT_FOUND,
            "conversation_not_found",
        ),
        (
            client.get(&url).bearer_auth(&agent),
            StatusCode::FORBIDDEN,
            "forbidden",
        ),
        (
            client.get(format!("{url}?watermark=9")).bearer_auth(&token),
            StatusCode::BAD_REQUEST,
            "invalid_watermark",
        ),
        (
            client
                .get(&url)
                .bearer_auth(&token)
                .header("last-event-id", "x"),
            StatusCode::BAD_REQUEST,
            "invalid_watermark",
        ),
        (
            client
                .get(format!("{url}?watermark=-1"))
                .bearer_auth(&token),
            StatusCode::BAD_REQUEST,
            "invalid_watermark",
        ),
    ];
    for (request, status, code) in cases {
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), status);
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], code);
    }
}

#[tokio::test]
async fn a_streamed_answer_reaches_the_event_stream_chunk_by_chunk_then_commits() {
    let node = TestNode::start_with(|config| config.group_settle_ms = 100).await;
    let acme = node.tenant_with_channel("acme").await;
    let agent_token = node.agent_token(&acme).await;
    let (mut bot, welcome) = node.agent(&agent_token, Some("bot")).await;
    support::settle(&welcome).await;
    let (conversation, token) = node.conversation(&acme, "alice").await;
    let url = node.url(&format!(
        "/api/v1/converger/conversations/{conversation}/events"
    ));
    let mut events = SseReader::open(&url, Some(&token), None).await;
    events.next().await.unwrap();
    let seq = post(&node.server.base_url(), &conversation, &token, "tell me").await;
    let turn = events.next_data().await.unwrap();
    assert_eq!(turn.id.as_deref(), Some(seq.to_string().as_str()));
    // The member gets the turn and streams its answer in three chunks, then commits it.
    loop {
        let delivered = bot.recv().await;
        if delivered["frame"]["meta"]["turn"]["seq"] == seq {
            break;
        }
    }
    let id = conversation.to_string();
    for (index, text) in ["once ", "upon ", "a time"].into_iter().enumerate() {
        bot.send(support::stream_chunk(&id, "s-1", index as u64, seq, text))
            .await;
    }
    bot.send(json!({"conversationId": id, "frame": {
        "type": "turnResult", "clientId": "r-1", "turn": {"seq": seq},
        "frames": [{"type": "text", "streamId": "s-1", "data": {"text": "once upon a time"}}]}}))
        .await;
    let mut chunks = Vec::new();
    let answer = loop {
        let event = events.next_data().await.unwrap();
        let frame: Value = serde_json::from_str(&event.data).unwrap();
        match frame["type"].as_str() {
            Some("streamChunk") => {
                assert!(event.id.is_none(), "chunks are transient: {event:?}");
                chunks.push((
                    frame["index"].as_u64().unwrap(),
                    frame["text"].as_str().unwrap().to_owned(),
                ));
            }
            Some("streamEnd") => assert_eq!(frame["status"], "committed"),
            _ if frame["seq"].is_i64() => break (event, frame),
            _ => {}
        }
    };
    assert_eq!(
        chunks,
        vec![
            (0, "once ".to_owned()),
            (1, "upon ".to_owned()),
            (2, "a time".to_owned())
        ]
    );
    let (event, frame) = answer;
    assert_eq!(event.id.as_deref(), Some((seq + 1).to_string().as_str()));
    assert_eq!(
        (frame["streamId"].as_str(), frame["data"]["text"].as_str()),
        (Some("s-1"), Some("once upon a time"))
    );
}

#[tokio::test]
async fn an_event_stream_joining_a_ten_thousand_chunk_stream_gets_it_once() {
    let node = TestNode::start_with(|config| {
        config.group_settle_ms = 100;
        config.limits.max_frames_per_sec = 100_000;
    })
    .await;
    let acme = node.tenant_with_channel("acme").await;
    let agent_token = node.agent_token(&acme).await;
    let (mut bot, welcome) = node.agent(&agent_token, Some("bot")).await;
    support::settle(&welcome).await;
    let (conversation, token) = node.conversation(&acme, "alice").await;
    let seq = post(&node.server.base_url(), &conversation, &token, "tell me").await;
    loop {
        let delivered = bot.recv().await;
        if delivered["frame"]["meta"]["turn"]["seq"] == seq {
            break;
        }
    }
    let id = conversation.to_string();
    let so_far = support::stream_words(&mut bot, &id, "s-1", seq, 0..10_000).await;

    let url = node.url(&format!(
        "/api/v1/converger/conversations/{conversation}/events"
    ));
    let mut events = SseReader::open(&url, Some(&token), None).await;
    let mut text = String::new();
    let mut next_index = 0;
    while next_index < 10_000 {
        let event = events.next_data().await.expect("the stream goes on");
        let frame: Value = serde_json::from_str(&event.data).unwrap();
        if frame["type"] != "streamChunk" {
            continue;
        }
        let index = frame["index"].as_u64().unwrap();
        let first = frame["firstIndex"].as_u64().unwrap_or(index);
        assert_eq!(first, next_index, "each chunk once, in order: {frame}");
        text.push_str(frame["text"].as_str().unwrap());
        next_index = index + 1;
    }
    assert_eq!(text, so_far);
    // The live rest follows.
    bot.send(support::stream_chunk(&id, "s-1", 10_000, seq, "end"))
        .await;
    let live = loop {
        let event = events.next_data().await.unwrap();
        let frame: Value = serde_json::from_str(&event.data).unwrap();
        if frame["type"] == "streamChunk" {
            break frame;
        }
    };
    assert_eq!(
        (live["index"].as_u64(), live.get("firstIndex")),
        (Some(10_000), None)
    );
}
