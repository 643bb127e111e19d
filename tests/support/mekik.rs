//! A mekik client that behaves like the chativa widget's mekik connector and chat engine, as far
//! as what a person sees goes (read from chativa's `connector-mekik` and `ChatEngine`):
//! `hello` without `protocol`, its own `<ms>-<7 base36>` ids on what it sends, the highest
//! `seq` of any frame as its watermark (a number, sent back as is), no application pings.
//! - `welcome`, `error`, `run`, `typing`, `interrupt_resolved`, `tool_call`, `genui_components`
//!   and `skills` frames show nothing; every other frame is a bubble of its `data.text` (empty
//!   when it has none), de-duplicated by `id` alone (a frame without one counts as the id
//!   `undefined`); `replaces` is ignored.
//! - A `genui` text chunk appends to its stream's open text run when the chunk's `id` is the
//!   run's; otherwise it adds the bubble `mekik-text-<streamId>-<chunk id>` (dropped when that
//!   id was shown, though the run then continues on it); `done` ends the run.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use serde_json::{Value, json};
use uuid::Uuid;

use super::ws::{Closed, FRAME_TIMEOUT, WsClient};

/// What the widget shows for one frame (or one `genui` stream).
#[derive(Debug, Clone, PartialEq)]
pub struct Bubble {
    /// The frame's `id` (the stream's for `genui`).
    pub id: String,
    /// `user` or `bot`, as the frame's `from` says.
    pub from: String,
    /// The frame's type.
    pub kind: String,
    /// `data.text`, or the gathered `genui` chunk contents.
    pub text: String,
    /// True while a stream's run still grows it (the widget shows a caret).
    pub streaming: bool,
}

/// One widget: its bubbles live across reconnects, not across reloads.
pub struct Widget {
    socket: Option<WsClient>,
    url: String,
    token: String,
    /// The conversation, from the first welcome.
    pub conversation_id: Option<Uuid>,
    /// The user, from the first welcome (what the widget sends back to rejoin).
    pub user_id: Option<String>,
    /// The highest seq received (a stream chunk's seq has a fraction).
    pub watermark: f64,
    seen_ids: HashSet<String>,
    /// Per stream: its open text run, as (bubble id, chunk id).
    text_runs: HashMap<String, (String, String)>,
    /// Every bubble shown, in order.
    pub bubbles: Vec<Bubble>,
    /// Every frame received, in order (bubbles or not).
    pub received: Vec<Value>,
    sent: u64,
}

impl Widget {
    /// A widget for `token` on the node at `url` (ws://…/socket/converger/v1), not connected.
    pub fn new(url: &str, token: &str) -> Widget {
        Widget {
            socket: None,
            url: url.to_owned(),
            token: token.to_owned(),
            conversation_id: None,
            user_id: None,
            watermark: 0.0,
            seen_ids: HashSet::new(),
            text_runs: HashMap::new(),
            bubbles: Vec::new(),
            received: Vec::new(),
            sent: 0,
        }
    }

    /// The same conversation after a page reload: nothing shown, watermark 0.
    pub fn reloaded(&self) -> Widget {
        Widget {
            conversation_id: self.conversation_id,
            user_id: self.user_id.clone(),
            ..Widget::new(&self.url, &self.token)
        }
    }

    /// Connects and says hello (rejoining its conversation from its watermark once it has one);
    /// returns the welcome.
    pub async fn connect(&mut self) -> Value {
        let mut socket = WsClient::connect_with(&self.url, &[], None).await;
        // JavaScript writes a whole number without a fraction.
        let watermark = if self.watermark.fract() == 0.0 {
            json!(self.watermark as u64)
        } else {
            json!(self.watermark)
        };
        let mut hello = json!({"type": "hello", "token": self.token, "watermark": watermark});
        if let Some(conversation_id) = self.conversation_id {
            hello["conversationId"] = json!(conversation_id.to_string());
        }
        if let Some(user_id) = &self.user_id {
            hello["userId"] = json!(user_id);
        }
        socket.send(hello).await;
        let welcome = socket.recv().await;
        assert_eq!(welcome["type"], "welcome", "{welcome}");
        let data = &welcome["data"];
        self.conversation_id = data["conversationId"]
            .as_str()
            .and_then(|id| id.parse().ok());
        self.user_id = data["userId"].as_str().map(str::to_owned);
        self.socket = Some(socket);
        welcome
    }

    fn socket(&mut self) -> &mut WsClient {
        self.socket.as_mut().expect("the widget is connected")
    }

    /// Sends a text as the widget does (its own id, shown at once); returns the id.
    pub async fn send_text(&mut self, text: &str) -> String {
        self.sent += 1;
        let id = format!(
            "{}-{:0>7}",
            chrono::Utc::now().timestamp_millis(),
            base36(self.sent * 7_919 + 1_000_003)
        );
        self.seen_ids.insert(id.clone());
        self.bubbles.push(Bubble {
            id: id.clone(),
            from: "user".into(),
            kind: "text".into(),
            text: text.to_owned(),
            streaming: false,
        });
        let frame = json!({"type": "text", "id": id, "data": {"text": text}});
        self.socket().send(frame).await;
        id
    }

    /// Sends any frame as is.
    pub async fn send(&mut self, frame: Value) {
        self.socket().send(frame).await;
    }

    /// The socket drops (a network change): no close frame, nothing more read.
    pub fn cut(&mut self) {
        self.socket = None;
    }

    /// Closes the socket from the widget's side (the tab is closed).
    pub async fn close(&mut self) {
        if let Some(socket) = self.socket.take() {
            socket.close().await;
        }
    }

    /// Receives frames, showing them, until `done` holds for the last one received.
    pub async fn read_until(&mut self, mut done: impl FnMut(&Value) -> bool) {
        loop {
            let frame = match self.socket().next_event(FRAME_TIMEOUT).await {
                Ok(frame) => frame,
                Err(closed) => panic!("the widget's socket closed: {closed:?}"),
            };
            self.show(&frame);
            if done(&frame) {
                return;
            }
        }
    }

    /// Receives frames until the one at `seq` (a replay up to the head).
    pub async fn read_through(&mut self, seq: i64) {
        self.read_until(|frame| frame["seq"].as_i64() == Some(seq))
            .await;
    }

    /// Receives until the connection ends.
    pub async fn read_until_closed(&mut self) -> Closed {
        loop {
            match self.socket().next_event(Duration::from_secs(20)).await {
                Ok(frame) => self.show(&frame),
                Err(closed) => return closed,
            }
        }
    }

    /// What the widget does with one frame.
    fn show(&mut self, frame: &Value) {
        self.received.push(frame.clone());
        if let Some(seq) = frame["seq"].as_f64() {
            self.watermark = self.watermark.max(seq);
        }
        let kind = frame["type"].as_str().unwrap_or_default().to_owned();
        match kind.as_str() {
            "welcome" | "error" | "run" | "typing" | "interrupt_resolved" | "tool_call"
            | "genui_components" | "skills" => return,
            "genui" => return self.show_genui(frame),
            _ => {}
        }
        let id = frame["id"].as_str().unwrap_or("undefined").to_owned();
        if !self.seen_ids.insert(id.clone()) {
            return;
        }
        self.bubbles.push(Bubble {
            id,
            from: frame["from"].as_str().unwrap_or("bot").to_owned(),
            kind,
            text: frame["data"]["text"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            streaming: false,
        });
    }

    /// A `genui` frame: text chunks grow the stream's run, `done` ends it.
    fn show_genui(&mut self, frame: &Value) {
        let (Some(stream), Some(chunk)) = (frame["streamId"].as_str(), frame["chunk"].as_object())
        else {
            return;
        };
        if chunk.get("type").and_then(Value::as_str) == Some("text") {
            let chunk_id = chunk.get("id").and_then(Value::as_str).unwrap_or_default();
            let content = chunk
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or_default();
            match self.text_runs.get(stream) {
                Some((bubble_id, run)) if run == chunk_id => {
                    let bubble_id = bubble_id.clone();
                    if let Some(bubble) = self.bubbles.iter_mut().find(|b| b.id == bubble_id) {
                        bubble.text.push_str(content);
                        bubble.streaming = true;
                    }
                }
                _ => {
                    let bubble_id = format!("mekik-text-{stream}-{chunk_id}");
                    if self.seen_ids.insert(bubble_id.clone()) {
                        self.bubbles.push(Bubble {
                            id: bubble_id.clone(),
                            from: "bot".into(),
                            kind: "text".into(),
                            text: content.to_owned(),
                            streaming: true,
                        });
                    }
                    self.text_runs
                        .insert(stream.to_owned(), (bubble_id, chunk_id.to_owned()));
                }
            }
        }
        if frame["done"] == true
            && let Some((bubble_id, _)) = self.text_runs.remove(stream)
            && let Some(bubble) = self.bubbles.iter_mut().find(|b| b.id == bubble_id)
        {
            bubble.streaming = false;
        }
    }

    /// The bubbles from `from` (`user` or `bot`).
    pub fn bubbles_from(&self, from: &str) -> Vec<&Bubble> {
        self.bubbles
            .iter()
            .filter(|bubble| bubble.from == from)
            .collect()
    }
}

fn base36(mut value: u64) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut digits = Vec::new();
    while value > 0 {
        digits.push(DIGITS[(value % 36) as usize]);
        value /= 36;
    }
    digits.reverse();
    String::from_utf8(digits).expect("ascii digits")
}
