//! The end users' side of `streams`: a tab that follows a conversation through one of the
//! clients converger serves, and tallies the answer's chunks as they arrive.
//!
//! - `ws`: a converger/1 WebSocket (hello, then the `text` send; `streamChunk` frames);
//! - `ai-sdk`: the AI SDK's UI message stream (`POST /api/v1/ai-sdk/chat` sends and reads the
//!   answer; a second tab resumes it with `GET …/{id}/stream`; `text-delta` chunks);
//! - `ag-ui`: AG-UI (`POST /api/v1/ag-ui/run` sends and reads; a second tab `POST …/connect`;
//!   `TEXT_MESSAGE_CONTENT` events).
//!
//! The SSE tabs read `data:` lines themselves: this measures the node, and a client library
//! would cost the bench's share of the two cores more than the few lines here (the clients'
//! compatibility is proven by tests/frontends.rs with the real packages).

use std::sync::Arc;

use anyhow::{Context, bail};
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;

use super::{Place, Socket, Tally, connect, hello};
use crate::gateway::Gateway;
use crate::peers::Clock;

/// The client the tabs speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Client {
    /// converger/1 over WebSocket.
    Ws,
    /// The AI SDK's UI message stream over SSE.
    AiSdk,
    /// AG-UI over SSE.
    AgUi,
}

impl Client {
    /// The name the output uses.
    pub fn name(self) -> &'static str {
        match self {
            Client::Ws => "ws",
            Client::AiSdk => "ai-sdk",
            Client::AgUi => "ag-ui",
        }
    }
}

/// An open tab.
pub enum Tab {
    /// A WebSocket.
    Ws(Box<Socket>),
    /// A streaming HTTP response.
    Sse(reqwest::Response),
}

/// Conversation `conversation`'s first tab, on `node`, which sends its one turn ("go").
pub async fn open_first(
    client: Client,
    node: &Gateway,
    http: &reqwest::Client,
    conversation: &str,
    token: &str,
) -> anyhow::Result<Tab> {
    match client {
        Client::Ws => {
            let mut socket = ws_tab(node, token).await?;
            socket
                .send(Message::text(
                    json!({"type": "text", "clientId": "q", "data": {"text": "go"}}).to_string(),
                ))
                .await?;
            Ok(Tab::Ws(Box::new(socket)))
        }
        Client::AiSdk => {
            let body = json!({"id": conversation, "trigger": "submit-message", "messages": [
                {"id": "q", "role": "user", "parts": [{"type": "text", "text": "go"}]}]});
            sse(http, node, "/api/v1/ai-sdk/chat", token, Some(body)).await
        }
        Client::AgUi => {
            let body = json!({"threadId": conversation, "runId": "r",
                              "messages": [{"id": "q", "role": "user", "content": "go"}]});
            sse(http, node, "/api/v1/ag-ui/run", token, Some(body)).await
        }
    }
}

/// A second tab of `conversation` on `node`, once its turn exists: a WebSocket hello, the AI
/// SDK's resume, or an AG-UI connect.
pub async fn open_second(
    client: Client,
    node: &Gateway,
    http: &reqwest::Client,
    conversation: &str,
    token: &str,
) -> anyhow::Result<Tab> {
    match client {
        Client::Ws => Ok(Tab::Ws(Box::new(ws_tab(node, token).await?))),
        Client::AiSdk => {
            let path = format!("/api/v1/ai-sdk/chat/{conversation}/stream");
            sse(http, node, &path, token, None).await
        }
        Client::AgUi => {
            let body = json!({"threadId": conversation, "runId": "c", "messages": []});
            sse(http, node, "/api/v1/ag-ui/connect", token, Some(body)).await
        }
    }
}

/// An end user's socket on `node` that said hello.
async fn ws_tab(node: &Gateway, token: &str) -> anyhow::Result<Socket> {
    let mut socket = connect(&node.ws_url).await?;
    hello(
        &mut socket,
        json!({"type": "hello", "protocol": "converger/1", "token": token}),
    )
    .await?;
    Ok(socket)
}

/// A POST (with `body`) or GET of `path` on `node` whose answer must be a 200 event stream.
async fn sse(
    http: &reqwest::Client,
    node: &Gateway,
    path: &str,
    token: &str,
    body: Option<serde_json::Value>,
) -> anyhow::Result<Tab> {
    let url = &format!("{}{path}", node.base_url);
    let request = match body {
        Some(body) => http.post(url).json(&body),
        None => http.get(url),
    };
    let response = request
        .bearer_auth(token)
        .send()
        .await
        .with_context(|| format!("request {url}"))?;
    if response.status() != reqwest::StatusCode::OK {
        bail!("{url} answered {}", response.status());
    }
    Ok(Tab::Sse(response))
}

/// The two fields of a frame, chunk or event the tab reads (the rest is skipped, not built).
#[derive(serde::Deserialize)]
struct ChunkView<'a> {
    #[serde(rename = "type", borrow)]
    kind: &'a str,
    /// A `streamChunk`'s text.
    #[serde(default, borrow)]
    text: Option<&'a str>,
    /// A `text-delta`'s or `TEXT_MESSAGE_CONTENT`'s text.
    #[serde(default, borrow)]
    delta: Option<&'a str>,
}

impl ChunkView<'_> {
    /// The chunk text this frame carries, if it is a chunk.
    fn chunk(&self) -> Option<&str> {
        match self.kind {
            "streamChunk" => self.text,
            "text-delta" | "TEXT_MESSAGE_CONTENT" => self.delta,
            _ => None,
        }
    }
}

/// Reads a tab until it closes, tallying the chunks.
pub async fn read(tab: Tab, place: Place, tally: Arc<Tally>, clock: Clock) {
    let take = |payload: &str| {
        if let Ok(view) = serde_json::from_str::<ChunkView<'_>>(payload)
            && let Some(text) = view.chunk()
        {
            tally.take(place, text, &clock);
        }
    };
    match tab {
        Tab::Ws(mut socket) => {
            while let Some(Ok(message)) = socket.next().await {
                if let Message::Text(text) = message {
                    take(text.as_str());
                }
            }
        }
        Tab::Sse(mut response) => {
            let mut pending = Vec::new();
            while let Ok(Some(bytes)) = response.chunk().await {
                pending.extend_from_slice(&bytes);
                // Whole lines only; an event's `data:` line is one JSON object.
                let Some(last_newline) = pending.iter().rposition(|byte| *byte == b'\n') else {
                    continue;
                };
                for line in pending[..last_newline].split(|byte| *byte == b'\n') {
                    if let Some(data) = line.strip_prefix(b"data: ")
                        && let Ok(data) = std::str::from_utf8(data)
                    {
                        take(data);
                    }
                }
                pending.drain(..=last_newline);
            }
        }
    }
}
