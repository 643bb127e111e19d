//! How an open stream holds its chunks on a node: text deltas appended to one buffer, with one
//! end offset per chunk, and the writer's `from` once per stream. A chunk then costs its text
//! and a word, where a boxed chunk each would cost about a hundred bytes more (a stream may
//! hold thousands of chunks, and every node holds every open stream).

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

    /// The content of chunk `index`, when it is held.
    pub fn content(&self, index: usize) -> Option<StreamContent> {
        let end = *self.ends.get(index)? as usize;
        let position = u32::try_from(index).ok()?;
        if let Ok(found) = self
            .ui_chunks
            .binary_search_by_key(&position, |(at, _)| *at)
        {
            return Some(StreamContent::Chunk(self.ui_chunks[found].1.clone()));
        }
        let start = index
            .checked_sub(1)
            .map_or(0, |before| self.ends[before] as usize);
        Some(StreamContent::Text(self.text.get(start..end)?.to_owned()))
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
    }
}
