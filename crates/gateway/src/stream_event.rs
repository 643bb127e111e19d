//! What a node's end-user sessions receive of a streamed answer (ADR 0019): one change of a
//! stream, rendered at most once per profile and shared by every session. Below both the hub,
//! which carries it, and the stream registry (`streams`), which makes it.

use std::sync::{Arc, OnceLock};

use axum::extract::ws::Utf8Bytes;
use converger_core::streams::StreamTurn;
use converger_protocol::{Profile, StreamContent, end_user_chunk, end_user_stream_end};
use serde_json::Value;

/// What a chunk carries besides its position: shared by its live event and every session that
/// renders it (the registry packs a copy of the content, [`PackedChunks`]).
#[derive(Debug)]
pub struct ChunkBody {
    /// The delta.
    pub content: StreamContent,
    /// The writing agent as `{id, role}`, shared by all its chunks.
    pub from: Arc<Value>,
}

/// One change of a stream, as this node's sessions receive it.
#[derive(Debug)]
pub enum StreamChange {
    /// Chunk `index` was accepted.
    Chunk {
        /// The stream.
        stream_id: String,
        /// Its position.
        index: u64,
        /// The turn answered.
        turn: StreamTurn,
        /// The content.
        body: Arc<ChunkBody>,
    },
    /// The stream ended: `aborted` holds the reason, `None` means committed.
    End {
        /// The stream.
        stream_id: String,
        /// Why it was aborted, when it was.
        aborted: Option<String>,
    },
}

/// A stream change with its renderings for the two end-user profiles, made once per node.
#[derive(Debug)]
pub struct StreamEvent {
    /// The change.
    pub change: StreamChange,
    rendered: [OnceLock<Utf8Bytes>; 2],
}

impl StreamEvent {
    pub(crate) fn new(change: StreamChange) -> Arc<StreamEvent> {
        Arc::new(StreamEvent {
            change,
            rendered: [OnceLock::new(), OnceLock::new()],
        })
    }

    /// The frame an end user of `profile` receives.
    pub fn render(&self, profile: Profile) -> Utf8Bytes {
        let slot = match profile {
            Profile::Converger => &self.rendered[0],
            Profile::Mekik => &self.rendered[1],
        };
        slot.get_or_init(|| render(profile, &self.change).into())
            .clone()
    }
}

fn render(profile: Profile, change: &StreamChange) -> String {
    match change {
        StreamChange::Chunk {
            stream_id,
            index,
            turn,
            body,
        } => end_user_chunk(
            profile,
            stream_id,
            *index..=*index,
            turn.seq,
            turn.revision,
            &body.content,
            &body.from,
        ),
        StreamChange::End { stream_id, aborted } => {
            end_user_stream_end(profile, stream_id, aborted.as_deref()).to_string()
        }
    }
}
