//! The agent side: a channel-scope connection in a group, a stream of typed turns, and replies
//! that are resent with the same clientId until the server acknowledges them.

use std::collections::VecDeque;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use uuid::Uuid;

/// What the agent side can fail with.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The socket failed or closed.
    #[error("connection error: {0}")]
    Connection(String),
    /// The server refused (error frame).
    #[error("{code}: {message}")]
    Refused {
        /// Error code.
        code: String,
        /// Message.
        message: String,
        /// `details`, when any.
        details: Value,
    },
    /// No acknowledgement after every resend.
    #[error("no acknowledgement after {0} attempts")]
    Unacknowledged(u32),
}

/// One user turn delivered to this agent.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// Conversation.
    pub conversation_id: Uuid,
    /// The turn's seq.
    pub seq: i64,
    /// The turn's revision.
    pub revision: i64,
    /// Stable key for external tools' idempotency (`meta.turn.key`).
    pub key: String,
    /// `edit` or `regenerate` for revisions above 0.
    pub reason: Option<String>,
    /// The conversation's runtime version when delivered.
    pub runtime_version: i64,
    /// The conversation's runtime state when delivered.
    pub runtime_state: Value,
    /// The whole delivered frame (with `meta`).
    pub frame: Value,
}

impl Turn {
    /// The user's text, for `text` turns.
    pub fn text(&self) -> Option<&str> {
        self.frame["data"]["text"].as_str()
    }

    fn from_envelope(envelope: &Value) -> Option<Turn> {
        let frame = envelope.get("frame")?;
        let turn = frame.get("meta")?.get("turn")?;
        Some(Turn {
            conversation_id: envelope["conversationId"].as_str()?.parse().ok()?,
            seq: turn["seq"].as_i64()?,
            revision: turn["revision"].as_i64().unwrap_or(0),
            key: turn["key"].as_str()?.to_owned(),
            reason: turn["reason"].as_str().map(str::to_owned),
            runtime_version: frame["meta"]["runtime"]["version"].as_i64().unwrap_or(0),
            runtime_state: frame["meta"]["runtime"]["state"].clone(),
            frame: frame.clone(),
        })
    }
}

/// The server's acknowledgement of a reply.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplyAck {
    /// The stored frames' seqs.
    pub seqs: Vec<i64>,
    /// True when an earlier send of the same reply was already stored.
    pub duplicate: bool,
}

/// A connected agent.
pub struct Agent {
    socket: WebSocketStream<MaybeTlsStream<TcpStream>>,
    welcome: Value,
    pending: VecDeque<Value>,
    ack_timeout: Duration,
    attempts: u32,
}

impl Agent {
    /// Connects to `ws_url` (…/socket/converger/v1) with a channel-scope token, joining `group`
    /// (`None` observes), and waits for `welcome`.
    pub async fn connect(
        ws_url: &str,
        token: &str,
        group: Option<&str>,
    ) -> Result<Agent, AgentError> {
        let (mut socket, _) = tokio_tungstenite::connect_async(ws_url)
            .await
            .map_err(|error| AgentError::Connection(error.to_string()))?;
        let mut hello = json!({"type": "hello", "protocol": "converger/1", "token": token});
        if let Some(group) = group {
            hello["group"] = json!(group);
        }
        socket
            .send(Message::Text(hello.to_string().into()))
            .await
            .map_err(|error| AgentError::Connection(error.to_string()))?;
        let mut agent = Agent {
            socket,
            welcome: Value::Null,
            pending: VecDeque::new(),
            ack_timeout: Duration::from_secs(5),
            attempts: 5,
        };
        loop {
            let frame = agent.read().await?;
            match frame["type"].as_str() {
                Some("welcome") => {
                    agent.welcome = frame;
                    return Ok(agent);
                }
                Some("error") => return Err(refusal(&frame)),
                _ => agent.pending.push_back(frame),
            }
        }
    }

    /// The `welcome.data` object (connectionId, since, group, limits).
    pub fn welcome(&self) -> &Value {
        &self.welcome["data"]
    }

    /// The next turn delivered to this agent; other frames are skipped.
    pub async fn next_turn(&mut self) -> Result<Turn, AgentError> {
        loop {
            let frame = match self.pending.pop_front() {
                Some(frame) => frame,
                None => self.read().await?,
            };
            if let Some(turn) = Turn::from_envelope(&frame) {
                return Ok(turn);
            }
        }
    }

    /// Answers a turn with `frames` (whole frame objects) and, optionally, the new runtime
    /// state (written against the version the turn was delivered with). The same clientId is
    /// resent until the server acknowledges, so a lost ack never produces a second answer.
    pub async fn reply(
        &mut self,
        turn: &Turn,
        frames: Vec<Value>,
        runtime_state: Option<Value>,
    ) -> Result<ReplyAck, AgentError> {
        let client_id = format!(
            "result-{}-{}-{}",
            turn.conversation_id.simple(),
            turn.seq,
            turn.revision
        );
        let mut result = json!({
            "type": "turnResult",
            "clientId": client_id,
            "turn": {"seq": turn.seq, "revision": turn.revision},
            "frames": frames,
        });
        if let Some(state) = runtime_state {
            result["runtime"] = json!({"version": turn.runtime_version, "state": state});
        }
        let envelope = json!({"conversationId": turn.conversation_id, "frame": result}).to_string();
        for _ in 0..self.attempts {
            self.socket
                .send(Message::Text(envelope.clone().into()))
                .await
                .map_err(|error| AgentError::Connection(error.to_string()))?;
            let deadline = tokio::time::Instant::now() + self.ack_timeout;
            while let Ok(frame) = tokio::time::timeout_at(deadline, self.read()).await {
                let frame = frame?;
                let inner = &frame["frame"];
                let answers_us = inner["clientId"] == client_id.as_str()
                    || inner["data"]["clientId"] == client_id.as_str();
                if !answers_us {
                    self.pending.push_back(frame);
                    continue;
                }
                if inner["type"] == "error" {
                    return Err(refusal(inner));
                }
                let seqs = inner["seqs"]
                    .as_array()
                    .map(|seqs| seqs.iter().filter_map(Value::as_i64).collect())
                    .unwrap_or_default();
                return Ok(ReplyAck {
                    seqs,
                    duplicate: inner["duplicate"] == true,
                });
            }
        }
        Err(AgentError::Unacknowledged(self.attempts))
    }

    async fn read(&mut self) -> Result<Value, AgentError> {
        loop {
            match self.socket.next().await {
                Some(Ok(Message::Text(text))) => {
                    return serde_json::from_str(text.as_str())
                        .map_err(|error| AgentError::Connection(error.to_string()));
                }
                Some(Ok(Message::Close(frame))) => {
                    return Err(AgentError::Connection(format!("closed: {frame:?}")));
                }
                Some(Ok(_)) => continue,
                Some(Err(error)) => return Err(AgentError::Connection(error.to_string())),
                None => return Err(AgentError::Connection("closed".into())),
            }
        }
    }
}

fn refusal(frame: &Value) -> AgentError {
    AgentError::Refused {
        code: frame["data"]["code"]
            .as_str()
            .unwrap_or("unknown")
            .to_owned(),
        message: frame["data"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        details: frame["data"]["details"].clone(),
    }
}
