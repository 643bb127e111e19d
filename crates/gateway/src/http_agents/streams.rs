//! The streams of one call: each text message of a run streams to every tab on every node.

use std::sync::Arc;

use converger_core::streams::StreamTurn;
use converger_protocol::StreamContent;
use serde_json::Value;
use uuid::Uuid;

use super::call::DeliveredTurn;
use crate::state::AppState;
use crate::streams::{ChunkBody, LocalChunk};

/// The streams of one call: one per text message, owned by the call alone, so that a failed
/// call's streams end (aborted) when it is dropped and a retry opens new ones.
pub(super) struct AttemptStreams<'a> {
    state: &'a AppState,
    conversation_id: Uuid,
    turn: StreamTurn,
    owner: String,
    channel: String,
    from: &'a Arc<Value>,
    /// Per text message: its stream.
    streams: Vec<MessageStream>,
    kept: bool,
}

impl<'a> AttemptStreams<'a> {
    pub(super) fn new(
        state: &'a AppState,
        delivered: &DeliveredTurn,
        channel_id: Uuid,
        from: &'a Arc<Value>,
    ) -> Self {
        AttemptStreams {
            state,
            conversation_id: delivered.activity.conversation_id,
            turn: StreamTurn {
                seq: delivered.turn.seq,
                revision: delivered.turn.revision,
            },
            owner: format!("http:{}", Uuid::new_v4()),
            channel: channel_id.to_string(),
            from,
            streams: Vec::new(),
            kept: false,
        }
    }

    /// Streams `delta` of the run's `message`-th text message.
    pub(super) fn push(&mut self, message: usize, delta: String) {
        while self.streams.len() <= message {
            // Unique within the conversation across calls, nodes and retries.
            let id = format!(
                "http-{}-{}-{}-{}",
                self.turn.seq,
                self.turn.revision,
                &self.owner[5..13],
                self.streams.len()
            );
            self.streams.push(MessageStream {
                id,
                next: 0,
                refused: false,
            });
        }
        let stream = &mut self.streams[message];
        if stream.refused {
            return;
        }
        let accepted = self.state.streams.accept(
            &self.state.hub,
            LocalChunk {
                conversation_id: self.conversation_id,
                stream_id: &stream.id,
                index: stream.next,
                turn: Some(self.turn),
                fence: None,
                owner: &self.owner,
                channel: &self.channel,
                body: ChunkBody {
                    content: StreamContent::Text(delta),
                    from: Arc::clone(self.from),
                },
            },
        );
        match accepted {
            Ok(()) => stream.next += 1,
            Err(refusal) => {
                // The answer still commits; only the live view of this message stops.
                tracing::debug!(?refusal, stream_id = %stream.id, "http agent: chunk refused");
                stream.refused = true;
            }
        }
    }

    /// The stream id of the `index`-th text message, when it was streamed.
    pub(super) fn id_of(&self, index: usize) -> Option<String> {
        self.streams
            .get(index)
            .filter(|stream| stream.next > 0)
            .map(|stream| stream.id.clone())
    }

    /// The commit decides how the streams end.
    pub(super) fn keep(&mut self) {
        self.kept = true;
    }
}

/// The stream of one text message of a call.
struct MessageStream {
    id: String,
    /// The next chunk's index (the chunks accepted so far).
    next: u64,
    /// Set when the registry refused a chunk: the rest of the message is not streamed.
    refused: bool,
}

impl Drop for AttemptStreams<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.state.streams.abort_owner(&self.state.hub, &self.owner);
        }
    }
}
