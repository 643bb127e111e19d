//! How an open stream holds its chunks on a node: text deltas appended to one buffer, with one
//! end offset per chunk, and the writer's `from` once per stream. A chunk then costs its text
//! and a word, where a boxed chunk each would cost about a hundred bytes more (a stream may
//! hold thousands of chunks, and on the `postgres` bus every node holds every open stream).

use std::sync::Arc;

use converger_core::streams::ChunkLog;
use converger_protocol::StreamContent;
use serde_json::Value;

use super::ChunkBody;

/// The chunks of one open stream, in index order.
#[derive(Debug, Clone)]
pub struct PackedChunks {
    /// The writing agent as `{id, role}`, as its first chunk named it.
    from: Arc<Value>,
    /// Every text delta, one after the other.
    text: String,
    /// Per chunk: where its text ends in `text` (a UI chunk adds no text). 32 bits suffice:
    /// `limits.max_stream_bytes` is at most 64 MiB on every node.
    ends: Vec<u32>,
    /// The UI (`genui`) chunks, by index, in index order.
    ui_chunks: Vec<(u32, Value)>,
}

impl PackedChunks {
    /// The writing agent as `{id, role}`.
    pub fn from(&self) -> &Value {
        &self.from
    }

    /// Every text delta of the stream, joined (UI chunks add none).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The content of chunk `index`, when it is held.
    pub fn content(&self, index: usize) -> Option<StreamContent> {
        let end = *self.ends.get(index)? as usize;
        if let Some(ui) = self.ui_chunk(index) {
            return Some(StreamContent::Chunk(ui.clone()));
        }
        let start = self.text_start(index);
        Some(StreamContent::Text(self.text.get(start..end)?.to_owned()))
    }
}

/// A part of an open stream as a connection catching up is shown it: a run of consecutive text
/// chunks as one text, or one UI chunk.
#[derive(Debug, Clone, PartialEq)]
pub struct CatchUpPiece {
    /// The first chunk index it covers.
    pub first: u64,
    /// The last chunk index it covers.
    pub last: u64,
    /// The texts of `first..=last` joined, or the UI chunk at `first` (= `last`).
    pub content: StreamContent,
}

impl PackedChunks {
    /// The chunks from index `from` on, with each run of text chunks joined into one piece: a
    /// stream of thousands of text chunks is caught up with one frame.
    pub fn catch_up(&self, from: usize) -> Vec<CatchUpPiece> {
        let mut pieces = Vec::new();
        let mut index = from;
        while index < self.ends.len() {
            if let Some(ui) = self.ui_chunk(index) {
                pieces.push(CatchUpPiece {
                    first: index as u64,
                    last: index as u64,
                    content: StreamContent::Chunk(ui.clone()),
                });
                index += 1;
                continue;
            }
            let run_start = index;
            while index < self.ends.len() && self.ui_chunk(index).is_none() {
                index += 1;
            }
            let start = self.text_start(run_start);
            let end = self.ends[index - 1] as usize;
            pieces.push(CatchUpPiece {
                first: run_start as u64,
                last: (index - 1) as u64,
                content: StreamContent::Text(self.text.get(start..end).unwrap_or("").to_owned()),
            });
        }
        pieces
    }

    fn ui_chunk(&self, index: usize) -> Option<&Value> {
        let position = u32::try_from(index).ok()?;
        let found = self
            .ui_chunks
            .binary_search_by_key(&position, |(at, _)| *at)
            .ok()?;
        Some(&self.ui_chunks[found].1)
    }

    /// Where chunk `index`'s text starts in `text`.
    fn text_start(&self, index: usize) -> usize {
        index
            .checked_sub(1)
            .map_or(0, |before| self.ends[before] as usize)
    }
}

impl ChunkLog for PackedChunks {
    type Chunk = Arc<ChunkBody>;

    fn starting_with(first: Arc<ChunkBody>) -> Self {
        let mut log = PackedChunks {
            from: Arc::clone(&first.from),
            text: String::new(),
            ends: Vec::new(),
            ui_chunks: Vec::new(),
        };
        log.push(first);
        log
    }

    fn push(&mut self, chunk: Arc<ChunkBody>) {
        let position = offset(self.ends.len());
        match &chunk.content {
            StreamContent::Text(text) => self.text.push_str(text),
            StreamContent::Chunk(value) => self.ui_chunks.push((position, value.clone())),
        }
        self.ends.push(offset(self.text.len()));
    }

    fn len(&self) -> usize {
        self.ends.len()
    }
}

/// A length as an offset. It cannot pass 4 GiB, since the stream byte limit is at most 64 MiB;
/// saturating keeps `content` from panicking even so (it slices with `get`).
fn offset(length: usize) -> u32 {
    u32::try_from(length).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(content: StreamContent) -> Arc<ChunkBody> {
        Arc::new(ChunkBody {
            content,
            from: Arc::new(json!({"id": "bot", "role": "agent"})),
        })
    }

    #[test]
    fn every_chunk_reads_back_as_it_was_pushed() {
        let pushed = [
            StreamContent::Text("Hel".into()),
            StreamContent::Text(String::new()),
            StreamContent::Chunk(json!({"type": "card", "title": "x"})),
            StreamContent::Text("lo".into()),
            StreamContent::Chunk(json!({"type": "text", "content": "!"})),
        ];
        let mut log = PackedChunks::starting_with(body(pushed[0].clone()));
        for content in &pushed[1..] {
            log.push(body(content.clone()));
        }
        assert_eq!(log.len(), pushed.len());
        for (index, content) in pushed.iter().enumerate() {
            assert_eq!(log.content(index).as_ref(), Some(content), "chunk {index}");
        }
        assert_eq!(log.content(pushed.len()), None);
        assert_eq!(log.from(), &json!({"id": "bot", "role": "agent"}));
        let text = |first, last, text: &str| CatchUpPiece {
            first,
            last,
            content: StreamContent::Text(text.into()),
        };
        assert_eq!(
            log.catch_up(0),
            vec![
                text(0, 1, "Hel"),
                CatchUpPiece {
                    first: 2,
                    last: 2,
                    content: pushed[2].clone()
                },
                text(3, 3, "lo"),
                CatchUpPiece {
                    first: 4,
                    last: 4,
                    content: pushed[4].clone()
                },
            ]
        );
        assert_eq!(log.catch_up(1)[0], text(1, 1, ""));
        assert!(log.catch_up(5).is_empty());
    }
}
