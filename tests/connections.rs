//! Connections before a session exists (docs/operations.md §9): a socket that never sends a
//! byte, a bare HTTP/2 preface, HTTP/2 headers that never end are each closed at the header
//! deadline; over HTTP/2 every request running beside others takes its own place under the
//! per-address cap; a node at its cap still answers its health checks.

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::TestNode;
use support::ws::WsClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The header deadline the tests run with, and how long after it a close may take at most.
const DEADLINE_MS: u64 = 300;
const GRACE: Duration = Duration::from_secs(3);

/// Reads until the server closes the socket (or resets it); fails after `GRACE` past the
/// deadline.
async fn wait_until_closed(stream: &mut TcpStream) {
    let mut buffer = [0u8; 1024];
    tokio::time::timeout(Duration::from_millis(DEADLINE_MS) + GRACE, async {
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .expect("the server closes a connection with nothing in progress");
}

/// An HTTP/2 frame header and payload: `length`, `kind`, `flags`, stream id.
fn h2_frame(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let length = payload.len() as u32;
    let mut frame = vec![
        (length >> 16) as u8,
        (length >> 8) as u8,
        length as u8,
        kind,
        flags,
    ];
    frame.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const SETTINGS: u8 = 0x4;
const HEADERS: u8 = 0x1;

/// A connection that sent the HTTP/2 preface and an empty SETTINGS frame.
async fn h2_connection(addr: std::net::SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(H2_PREFACE).await.unwrap();
    stream
        .write_all(&h2_frame(SETTINGS, 0, 0, &[]))
        .await
        .unwrap();
    stream
}

#[tokio::test]
async fn connections_that_never_finish_a_request_are_closed_at_the_header_deadline() {
    let node = TestNode::start_with(|config| {
        config.http.header_read_timeout_ms = DEADLINE_MS;
    })
    .await;
    let addr = node.server.addr();

    // A socket that sends nothing at all.
    let started = Instant::now();
    let mut silent = TcpStream::connect(addr).await.unwrap();
    wait_until_closed(&mut silent).await;
    assert!(started.elapsed() >= Duration::from_millis(DEADLINE_MS - 50));

    // An HTTP/2 preface and SETTINGS, then nothing.
    let mut preface = h2_connection(addr).await;
    wait_until_closed(&mut preface).await;

    // HTTP/2 HEADERS without END_HEADERS: the header block never ends.
    let mut unfinished = h2_connection(addr).await;
    // 0x82: `:method: GET` from the static table; flags 0: neither END_HEADERS nor END_STREAM.
    unfinished
        .write_all(&h2_frame(HEADERS, 0, 1, &[0x82]))
        .await
        .unwrap();
    wait_until_closed(&mut unfinished).await;

    // HTTP/1 keep-alive: one request answered, then idle until the deadline.
    let mut keep_alive = TcpStream::connect(addr).await.unwrap();
    keep_alive
        .write_all(b"GET /health/live HTTP/1.1\r\nHost: converger\r\n\r\n")
        .await
        .unwrap();
    wait_until_closed(&mut keep_alive).await;

    let metrics = node.metrics().await;
    assert!(
        metrics.contains("converger_connections_idle_closed_total"),
        "idle closes are counted"
    );
    // None of them holds a place any more.
    support::eventually(
        "every closed connection gave its place back",
        Duration::from_secs(5),
        || async { node.server.state().connections_held() == 0 },
    )
    .await;
}

/// An HTTP/2 client (prior knowledge, one connection for all its requests).
fn h2_client() -> reqwest::Client {
    reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .expect("HTTP/2 client")
}

#[tokio::test]
async fn http2_requests_running_at_once_each_take_a_place_under_the_per_address_cap() {
    let node = TestNode::start_with(|config| {
        // Short, so the setup's idle HTTP/1 connections are gone soon.
        config.http.header_read_timeout_ms = 1_000;
        config.http.max_connections_per_address = 4;
        config.http.max_concurrent_streams = 10;
        config.http.retry_after_secs = 7;
    })
    .await;
    let (_, conversation_id, token) = support::setup(&node).await;
    // The setup's own HTTP/1 connections go idle and close; wait for the count to be clean.
    support::eventually("no connection held", Duration::from_secs(20), || async {
        node.server.state().connections_held() == 0
    })
    .await;
    let events = node.url(&format!(
        "/api/v1/converger/conversations/{conversation_id}/events"
    ));
    let client = h2_client();
    let mut open = Vec::new();
    let refused = loop {
        let response = client
            .get(&events)
            .bearer_auth(&token)
            .send()
            .await
            .expect("an HTTP/2 answer");
        assert_eq!(response.version(), reqwest::Version::HTTP_2);
        if response.status() != 200 {
            break response;
        }
        open.push(response);
        assert!(
            open.len() <= 4,
            "more event streams than the per-address cap"
        );
    };
    assert_eq!(
        open.len(),
        4,
        "one place per event stream, the first on the connection's"
    );
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "7");
    assert_eq!(
        refused.json::<serde_json::Value>().await.unwrap()["error"]["code"],
        "unavailable"
    );
    // The health checks are still answered on the same connection.
    let health = client.get(node.url("/health/ready")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    // A closed stream gives its place back.
    drop(open.pop());
    support::eventually(
        "an event stream is admitted again",
        Duration::from_secs(5),
        || async {
            client
                .get(&events)
                .bearer_auth(&token)
                .send()
                .await
                .is_ok_and(|response| response.status() == 200)
        },
    )
    .await;
}

#[tokio::test]
async fn a_node_at_its_connection_cap_still_answers_its_health_checks() {
    let node = TestNode::start_with(|config| config.http.max_connections = 3).await;
    let (_, _, token) = support::setup(&node).await;
    let mut held = Vec::new();
    while let Ok(mut client) = WsClient::try_connect(&node.ws_url("")).await {
        client.hello(&token, json!({})).await;
        held.push(client);
        assert!(held.len() <= 3, "more sockets than the node's cap");
    }
    let fresh = reqwest::Client::new;
    let refused = fresh()
        .get(node.url("/api/v1/conversations"))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 503);
    for path in ["/health/ready", "/health/live", "/metrics"] {
        let answer = fresh().get(node.url(path)).send().await.unwrap();
        assert_eq!(answer.status(), 200, "{path} at the cap");
    }
    // Silent sockets over the cap, more than the node answers at once, do not shut the health
    // checks out: each new refusal ends the oldest.
    let mut silent = Vec::new();
    for _ in 0..200 {
        silent.push(TcpStream::connect(node.server.addr()).await.unwrap());
    }
    let answer = fresh().get(node.url("/health/ready")).send().await.unwrap();
    assert_eq!(
        answer.status(),
        200,
        "health beside a flood of silent sockets"
    );
    drop(silent);
    // The setup's REST client may still hold a keep-alive connection, which counts too.
    assert!(!held.is_empty());
}
