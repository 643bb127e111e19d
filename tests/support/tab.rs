//! What an end user's tab (a conversation-scope socket) assembled: each stream's text, the chunk
//! indices it received (to see doubles and gaps), how each stream ended, the stored frames in
//! order and the error frames.

use std::collections::HashMap;

use serde_json::Value;

use super::ws::WsClient;

#[derive(Default, Debug)]
pub struct Tab {
    pub text: HashMap<String, String>,
    pub indices: HashMap<String, Vec<u64>>,
    pub ended: HashMap<String, String>,
    pub stored: Vec<Value>,
    pub errors: Vec<Value>,
}

impl Tab {
    /// Takes one frame the tab received; fails the test on a chunk out of order or twice, or a
    /// stream ended twice.
    pub fn take(&mut self, frame: &Value) {
        match frame["type"].as_str().unwrap_or_default() {
            "streamChunk" => {
                let stream = frame["streamId"].as_str().unwrap().to_owned();
                let index = frame["index"].as_u64().unwrap();
                // A tab catching up gets the text so far as one coalesced chunk.
                let first = frame["firstIndex"].as_u64().unwrap_or(index);
                let seen = self.indices.entry(stream.clone()).or_default();
                assert_eq!(
                    first,
                    seen.len() as u64,
                    "chunks in order, each once: {frame}"
                );
                seen.extend(first..=index);
                self.text
                    .entry(stream)
                    .or_default()
                    .push_str(frame["text"].as_str().unwrap_or_default());
            }
            "streamEnd" => {
                let stream = frame["streamId"].as_str().unwrap().to_owned();
                let status = frame["status"].as_str().unwrap().to_owned();
                assert!(
                    self.ended.insert(stream, status).is_none(),
                    "one end: {frame}"
                );
            }
            "error" => self.errors.push(frame.clone()),
            // The sender's own message comes back as its ack.
            "ack" => {}
            _ if frame["seq"].is_i64() => self.stored.push(frame.clone()),
            _ => {}
        }
    }

    /// Connects a tab to the socket at `url` as `token`'s user and reads until it has `chunks`
    /// chunks of `stream`.
    pub async fn join(url: &str, token: &str, stream: &str, chunks: usize) -> (WsClient, Tab) {
        let mut client = WsClient::connect(url).await;
        client.hello(token, serde_json::json!({})).await;
        let mut tab = Tab::default();
        tab.read_until(&mut client, |tab| tab.chunks_of(stream) == chunks)
            .await;
        (client, tab)
    }

    /// Reads `client` until `done` holds for this tab.
    pub async fn read_until(&mut self, client: &mut WsClient, done: impl Fn(&Tab) -> bool) {
        while !done(self) {
            let frame = client.recv().await;
            self.take(&frame);
        }
    }

    /// How many chunks of `stream` arrived.
    pub fn chunks_of(&self, stream: &str) -> usize {
        self.indices.get(stream).map_or(0, Vec::len)
    }

    /// The agents' stored texts.
    pub fn answers(&self) -> Vec<String> {
        self.stored
            .iter()
            .filter(|frame| frame["type"] == "text" && frame["sender"]["role"] == "agent")
            .map(|frame| frame["data"]["text"].as_str().unwrap().to_owned())
            .collect()
    }
}
