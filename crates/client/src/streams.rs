//! Streamed answers (docs/protocol.md §4.9): the agent's writer ([`AnswerStream`]) and the end
//! user's assembly of what arrives ([`StreamAssembly`]).
//!
//! A stream is transient: nothing of it is stored, and it ends in the turn's committed result
//! (whose frames name the stream) or in an abort. The assembly keeps each stream's text by
//! chunk index, so a chunk that arrives twice (a new connection gets the open streams from
//! their first chunk) is applied once: keep one assembly across reconnects.

use std::collections::HashMap;

use serde_json::{Value, json};
use uuid::Uuid;

use crate::ClientError;
use crate::agent::{Agent, ReplyAck, Turn};

/// A chunk of a streamed answer as an end user receives it (converger profile).
#[derive(Debug, Clone, PartialEq)]
pub struct StreamChunk {
    /// The stream.
    pub stream_id: String,
    /// Position in the stream, from 0 (for a coalesced chunk, the last position it covers).
    pub index: u64,
    /// The first position covered: below `index` for a coalesced chunk (a connection catching
    /// up with an open stream gets each run of text chunks joined into one), else `index`.
    pub first_index: u64,
    /// The turn answered (seq, revision).
    pub turn: (i64, i64),
    /// A text delta, when the chunk is text.
    pub text: Option<String>,
    /// A genui chunk object, when the chunk is one.
    pub chunk: Option<Value>,
}

/// The end of a streamed answer.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamEnd {
    /// The stream.
    pub stream_id: String,
    /// True when the committed answer follows (or came); false when aborted.
    pub committed: bool,
    /// Why it was aborted.
    pub reason: Option<String>,
}

pub(crate) fn parse_chunk(frame: &Value) -> Option<StreamChunk> {
    let index = frame["index"].as_u64()?;
    let first_index = frame["firstIndex"].as_u64().unwrap_or(index);
    if first_index > index {
        return None;
    }
    Some(StreamChunk {
        stream_id: frame["streamId"].as_str()?.to_owned(),
        index,
        first_index,
        turn: (
            frame["turn"]["seq"].as_i64()?,
            frame["turn"]["revision"].as_i64().unwrap_or(0),
        ),
        text: frame["text"].as_str().map(str::to_owned),
        chunk: frame.get("chunk").cloned(),
    })
}

pub(crate) fn parse_end(frame: &Value) -> Option<StreamEnd> {
    Some(StreamEnd {
        stream_id: frame["streamId"].as_str()?.to_owned(),
        committed: frame["status"].as_str()? == "committed",
        reason: frame["reason"].as_str().map(str::to_owned),
    })
}

/// One stream as assembled so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AssembledStream {
    /// The text deltas joined.
    pub text: String,
    /// The genui chunks, in order.
    pub chunks: Vec<Value>,
    /// Chunks applied (the next index expected).
    pub next_index: u64,
    /// `Some(true)` committed, `Some(false)` aborted, `None` still open.
    pub ended: Option<bool>,
    /// Per chunk applied: where its text ends in `text`, so a coalesced chunk that overlaps
    /// what was applied adds only the rest.
    text_ends: Vec<usize>,
}

/// The streams of one conversation as an end user's UI would show them.
#[derive(Debug, Clone, Default)]
pub struct StreamAssembly {
    streams: HashMap<String, AssembledStream>,
}

impl StreamAssembly {
    /// Applies a chunk; returns false when it was already applied or is out of order (a chunk
    /// is never applied twice, and a gap is never papered over). A coalesced chunk that covers
    /// chunks applied already adds only the text after them.
    pub fn apply_chunk(&mut self, chunk: &StreamChunk) -> bool {
        let stream = self.streams.entry(chunk.stream_id.clone()).or_default();
        let next = stream.next_index;
        if stream.ended.is_some() || chunk.index < next || chunk.first_index > next {
            return false;
        }
        if let Some(text) = &chunk.text {
            let start_of_run = chunk
                .first_index
                .checked_sub(1)
                .and_then(|before| stream.text_ends.get(before as usize))
                .copied()
                .unwrap_or(0);
            let held = stream.text.len() - start_of_run;
            stream.text.push_str(text.get(held..).unwrap_or(""));
        }
        if let Some(genui) = &chunk.chunk {
            stream.chunks.push(genui.clone());
        }
        let end = stream.text.len();
        stream.text_ends.extend((next..=chunk.index).map(|_| end));
        stream.next_index = chunk.index + 1;
        true
    }

    /// Applies a stream's end.
    pub fn apply_end(&mut self, end: &StreamEnd) {
        let stream = self.streams.entry(end.stream_id.clone()).or_default();
        stream.ended.get_or_insert(end.committed);
    }

    /// A stream, when any of it arrived.
    pub fn get(&self, stream_id: &str) -> Option<&AssembledStream> {
        self.streams.get(stream_id)
    }
}

/// A streamed answer an agent is writing for one delivered turn. Chunks are not acknowledged;
/// the answer becomes durable with [`AnswerStream::finish`], which commits the turn's result
/// and ends the stream for every viewer. If the connection drops meanwhile, the server has
/// aborted the stream: answer the turn with [`Agent::reply`] (or a new stream) after the
/// reconnect.
#[derive(Debug, Clone)]
pub struct AnswerStream {
    conversation_id: Uuid,
    stream_id: String,
    seq: i64,
    revision: i64,
    fence: Option<i64>,
    next_index: u64,
}

impl AnswerStream {
    /// A stream `stream_id` (clientId shape, unique in the conversation) answering `turn`.
    pub fn open(turn: &Turn, stream_id: &str) -> AnswerStream {
        AnswerStream {
            conversation_id: turn.conversation_id,
            stream_id: stream_id.to_owned(),
            seq: turn.seq,
            revision: turn.revision,
            fence: turn.fence,
            next_index: 0,
        }
    }

    /// The stream's id.
    pub fn id(&self) -> &str {
        &self.stream_id
    }

    /// Sends a text delta.
    pub async fn text(&mut self, agent: &mut Agent, delta: &str) -> Result<(), ClientError> {
        self.send(agent, "text", json!(delta)).await
    }

    /// Sends a genui chunk object.
    pub async fn chunk(&mut self, agent: &mut Agent, chunk: Value) -> Result<(), ClientError> {
        self.send(agent, "chunk", chunk).await
    }

    /// Commits the answer: `frames` (each frame without an id or `streamId` is given the
    /// stream's) and the runtime, resent until acknowledged like [`Agent::reply`].
    pub async fn finish(
        self,
        agent: &mut Agent,
        turn: &Turn,
        mut frames: Vec<Value>,
        runtime_state: Option<Value>,
    ) -> Result<ReplyAck, ClientError> {
        for frame in &mut frames {
            if frame.get("streamId").is_none() && frame.get("id").is_none() {
                frame["streamId"] = json!(self.stream_id);
            }
        }
        agent.reply(turn, frames, runtime_state).await
    }

    /// Ends the stream without an answer.
    pub async fn abort(self, agent: &mut Agent, reason: &str) -> Result<(), ClientError> {
        let frame = json!({"type": "streamAbort", "streamId": self.stream_id, "reason": reason});
        agent.send_enveloped(self.conversation_id, frame).await
    }

    async fn send(
        &mut self,
        agent: &mut Agent,
        field: &str,
        content: Value,
    ) -> Result<(), ClientError> {
        let mut frame = json!({
            "type": "streamChunk",
            "streamId": self.stream_id,
            "index": self.next_index,
        });
        frame[field] = content;
        if self.next_index == 0 {
            frame["turn"] = json!({"seq": self.seq, "revision": self.revision});
            if let Some(fence) = self.fence {
                frame["turn"]["fence"] = json!(fence);
            }
        }
        agent.send_enveloped(self.conversation_id, frame).await?;
        self.next_index += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(index: u64, text: &str) -> StreamChunk {
        StreamChunk {
            stream_id: "s".into(),
            index,
            first_index: index,
            turn: (1, 0),
            text: Some(text.into()),
            chunk: None,
        }
    }

    fn coalesced(first_index: u64, index: u64, text: &str) -> StreamChunk {
        StreamChunk {
            first_index,
            ..chunk(index, text)
        }
    }

    #[test]
    fn a_coalesced_chunk_adds_only_what_was_not_applied() {
        let mut assembly = StreamAssembly::default();
        assert!(assembly.apply_chunk(&chunk(0, "w0 ")));
        assert!(assembly.apply_chunk(&chunk(1, "w1 ")));
        // A reconnect catches up with the whole run so far: only "w2 w3 " is new.
        assert!(assembly.apply_chunk(&coalesced(0, 3, "w0 w1 w2 w3 ")));
        assert_eq!(assembly.get("s").unwrap().text, "w0 w1 w2 w3 ");
        assert!(!assembly.apply_chunk(&coalesced(0, 3, "w0 w1 w2 w3 ")));
        assert!(!assembly.apply_chunk(&coalesced(5, 6, "w5 w6 ")), "a gap");
        assert!(assembly.apply_chunk(&chunk(4, "w4")));
        assert_eq!(assembly.get("s").unwrap().next_index, 5);
        // A new assembly takes the run as it is.
        let mut fresh = StreamAssembly::default();
        assert!(fresh.apply_chunk(&coalesced(0, 3, "w0 w1 w2 w3 ")));
        assert_eq!(fresh.get("s").unwrap().text, "w0 w1 w2 w3 ");
    }

    #[test]
    fn each_chunk_is_applied_once_in_order() {
        let mut assembly = StreamAssembly::default();
        assert!(assembly.apply_chunk(&chunk(0, "Hel")));
        assert!(!assembly.apply_chunk(&chunk(0, "Hel")));
        assert!(!assembly.apply_chunk(&chunk(2, "!")));
        assert!(assembly.apply_chunk(&chunk(1, "lo")));
        assert_eq!(assembly.get("s").unwrap().text, "Hello");
        // A reconnect sends the open stream again from its first chunk: nothing doubles.
        for (index, text) in ["Hel", "lo"].iter().enumerate() {
            assert!(!assembly.apply_chunk(&chunk(index as u64, text)));
        }
        assert_eq!(assembly.get("s").unwrap().text, "Hello");
        assembly.apply_end(&StreamEnd {
            stream_id: "s".into(),
            committed: true,
            reason: None,
        });
        assert!(!assembly.apply_chunk(&chunk(2, "late")));
        assert_eq!(assembly.get("s").unwrap().ended, Some(true));
    }
}
