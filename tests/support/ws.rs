//! A raw WebSocket client for the tests: JSON frames in and out, close codes, and a ping
//! barrier to prove that nothing else was sent.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use super::schemas::{Schema, assert_conforms, violations};

/// How long a test waits for an expected frame.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(10);

/// One client connection.
pub struct WsClient {
    stream: WebSocketStream<MaybeTlsStream<TcpStream>>,
    /// The subprotocol the server selected.
    pub subprotocol: Option<String>,
    nonce: u64,
    /// The scope its welcome announced; until then a frame may be of either.
    scope: Option<Schema>,
}

/// What ended a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    /// Close code (1005 when the frame had none, 1006 when there was no close frame).
    pub code: u16,
    /// Close reason.
    pub reason: String,
}

impl WsClient {
    /// Connects to `url` (ws://…), offering `subprotocols` and sending `bearer` as Authorization.
    pub async fn connect_with(url: &str, subprotocols: &[&str], bearer: Option<&str>) -> WsClient {
        let mut request = url.into_client_request().expect("ws request");
        if !subprotocols.is_empty() {
            let offered = HeaderValue::from_str(&subprotocols.join(", ")).unwrap();
            request
                .headers_mut()
                .insert("sec-websocket-protocol", offered);
        }
        if let Some(token) = bearer {
            request.headers_mut().insert(
                "authorization",
                HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
            );
        }
        let (stream, response) = tokio_tungstenite::connect_async(request)
            .await
            .expect("websocket connects");
        let subprotocol = response
            .headers()
            .get("sec-websocket-protocol")
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        WsClient {
            stream,
            subprotocol,
            nonce: 0,
            scope: None,
        }
    }

    /// Connects offering `converger.v1`.
    pub async fn connect(url: &str) -> WsClient {
        WsClient::connect_with(url, &["converger.v1"], None).await
    }

    /// Connects offering `converger.v1`, or says why it could not (a node going away).
    pub async fn try_connect(url: &str) -> Result<WsClient, String> {
        let mut request = url
            .into_client_request()
            .map_err(|error| error.to_string())?;
        request.headers_mut().insert(
            "sec-websocket-protocol",
            HeaderValue::from_static("converger.v1"),
        );
        let connecting = tokio_tungstenite::connect_async(request);
        let (stream, _) = tokio::time::timeout(FRAME_TIMEOUT, connecting)
            .await
            .map_err(|_| "connect timed out".to_owned())?
            .map_err(|error| error.to_string())?;
        Ok(WsClient {
            stream,
            subprotocol: Some("converger.v1".into()),
            nonce: 0,
            scope: None,
        })
    }

    /// Sends a JSON frame; false when the connection is gone.
    pub async fn try_send(&mut self, frame: Value) -> bool {
        self.stream
            .send(Message::Text(frame.to_string().into()))
            .await
            .is_ok()
    }

    /// Sends a JSON frame, which must conform to the client schema of the connection's scope.
    pub async fn send(&mut self, frame: Value) {
        let problems = self.client_violations(&frame);
        assert!(
            problems.is_empty(),
            "the test sends a frame outside the schemas (use send_invalid for a deliberate one): {frame}\n{}",
            problems.join("\n")
        );
        self.send_text(&frame.to_string()).await;
    }

    /// Sends a frame the contract forbids, to test the server's refusal; the schemas must refuse
    /// it too.
    pub async fn send_invalid(&mut self, frame: Value) {
        assert!(
            !self.client_violations(&frame).is_empty(),
            "send_invalid with a frame the schemas accept: {frame}"
        );
        self.send_text(&frame.to_string()).await;
    }

    /// What the client schema of this connection's scope says against `frame` (before the
    /// welcome, a frame may be of either scope, except a hello naming agent-only fields, which
    /// is checked as an agent's: the end-user hello leaves unknown fields open).
    fn client_violations(&self, frame: &Value) -> Vec<String> {
        let agent_hello = frame["type"] == "hello"
            && (frame.get("group").is_some() || frame.get("claim").is_some());
        match self.scope {
            Some(Schema::ServerChannel) => violations(Schema::ClientChannel, frame),
            Some(_) => violations(Schema::ClientConversation, frame),
            None if agent_hello => violations(Schema::ClientChannel, frame),
            None => {
                let as_conversation = violations(Schema::ClientConversation, frame);
                if as_conversation.is_empty() {
                    return as_conversation;
                }
                violations(Schema::ClientChannel, frame)
            }
        }
    }

    /// Sends raw text.
    pub async fn send_text(&mut self, text: &str) {
        self.stream
            .send(Message::Text(text.into()))
            .await
            .expect("send frame");
    }

    /// Sends a WebSocket ping control frame.
    pub async fn send_ping(&mut self) -> bool {
        self.stream
            .send(Message::Ping(Vec::new().into()))
            .await
            .is_ok()
    }

    /// Sends a binary message.
    pub async fn send_binary(&mut self, bytes: Vec<u8>) {
        self.stream
            .send(Message::Binary(bytes.into()))
            .await
            .expect("send binary");
    }

    /// The next JSON text frame; panics on timeout or close.
    pub async fn recv(&mut self) -> Value {
        match self.next_event(FRAME_TIMEOUT).await {
            Ok(frame) => frame,
            Err(closed) => panic!("connection closed while a frame was expected: {closed:?}"),
        }
    }

    /// The next text frame, or how the connection ended; panics when nothing came in time.
    pub async fn next_event(&mut self, timeout: Duration) -> Result<Value, Closed> {
        match self.poll_event(timeout).await {
            Some(event) => event,
            None => panic!("no frame within {timeout:?}"),
        }
    }

    /// Like `next_event`, but `None` when nothing came within `timeout`.
    pub async fn poll_event(&mut self, timeout: Duration) -> Option<Result<Value, Closed>> {
        let deadline = tokio::time::Instant::now() + timeout;
        Some(loop {
            let Ok(next) = tokio::time::timeout_at(deadline, self.stream.next()).await else {
                return None;
            };
            match next {
                Some(Ok(Message::Text(text))) => {
                    let frame: Value =
                        serde_json::from_str(text.as_str()).expect("server sends JSON");
                    self.check_conformance(&frame);
                    break Ok(frame);
                }
                Some(Ok(Message::Close(frame))) => {
                    break Err(frame.map_or(
                        Closed {
                            code: 1005,
                            reason: String::new(),
                        },
                        |frame| Closed {
                            code: frame.code.into(),
                            reason: frame.reason.to_string(),
                        },
                    ));
                }
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => {
                    break Err(Closed {
                        code: 1006,
                        reason: String::new(),
                    });
                }
            }
        })
    }

    /// Every received frame must conform to the server schema of the connection's scope
    /// (`docs/protocol/schemas/`), learnt from its welcome.
    fn check_conformance(&mut self, frame: &Value) {
        if frame["type"] == "welcome" {
            self.scope = match frame["data"]["scope"].as_str() {
                Some("channel") => Some(Schema::ServerChannel),
                _ => Some(Schema::ServerConversation),
            };
        }
        match self.scope {
            Some(schema) => assert_conforms(schema, frame),
            None => {
                let as_conversation = violations(Schema::ServerConversation, frame);
                if !as_conversation.is_empty() {
                    assert_conforms(Schema::ServerChannel, frame);
                }
            }
        }
    }

    /// Frames until one of type `kind` (returned last).
    pub async fn recv_until(&mut self, kind: &str) -> Vec<Value> {
        let mut seen = Vec::new();
        loop {
            let frame = self.recv().await;
            let done = frame["type"] == kind;
            seen.push(frame);
            if done {
                return seen;
            }
        }
    }

    /// The next frame of type `kind`, past any other ([`WsClient::recv_until`]'s last).
    pub async fn skip_to(&mut self, kind: &str) -> Value {
        let mut frames = self.recv_until(kind).await;
        frames
            .pop()
            .expect("recv_until ends with the frame it waited for")
    }

    /// The `frame` of the next envelope whose frame has type `kind` (an agent's connection),
    /// past any other.
    pub async fn skip_to_enveloped(&mut self, kind: &str) -> Value {
        loop {
            let envelope = self.recv().await;
            if envelope["frame"]["type"] == kind {
                return envelope["frame"].clone();
            }
        }
    }

    /// Frames of type `kind`, skipping heartbeats.
    pub async fn recv_type(&mut self, kind: &str) -> Value {
        loop {
            let frame = self.recv().await;
            if frame["type"] == kind {
                return frame;
            }
            assert_eq!(frame["type"], "heartbeat", "expected {kind}, got {frame}");
        }
    }

    /// Sends `ping` with a fresh nonce and returns every frame received before its heartbeat:
    /// the server handles frames in order, so anything it was going to send for earlier frames
    /// (or had queued) is in this list.
    pub async fn barrier(&mut self) -> Vec<Value> {
        self.nonce += 1;
        let nonce = format!("barrier-{}", self.nonce);
        self.send(json!({"type": "ping", "nonce": nonce})).await;
        let mut before = Vec::new();
        loop {
            let frame = self.recv().await;
            if frame["type"] == "heartbeat" && frame["nonce"] == nonce.as_str() {
                return before;
            }
            before.push(frame);
        }
    }

    /// Reads until the connection closes; returns the frames read before and the close.
    pub async fn recv_until_closed(&mut self) -> (Vec<Value>, Closed) {
        let mut frames = Vec::new();
        loop {
            match self.next_event(FRAME_TIMEOUT).await {
                Ok(frame) => frames.push(frame),
                Err(closed) => return (frames, closed),
            }
        }
    }

    /// Sends a converger hello with `token` plus `extra` fields; returns the welcome.
    pub async fn hello(&mut self, token: &str, extra: Value) -> Value {
        let mut hello = json!({"type": "hello", "protocol": "converger/1", "token": token});
        if let Value::Object(fields) = extra {
            for (key, value) in fields {
                hello[key] = value;
            }
        }
        self.send(hello).await;
        self.recv_type("welcome").await
    }

    /// Closes the connection from the client side.
    pub async fn close(mut self) {
        let _ = self.stream.close(None).await;
    }
}
