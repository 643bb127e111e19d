//! Streamed answers as one end user's connection shows them (ADR 0019): every chunk once and
//! in order, whether it came live or from the node's registry (a join mid-stream, a live feed
//! that fell behind), then the stream's end. Chunks are never dropped under pressure: a client
//! that cannot keep up is a slow consumer, and its reconnect resumes the stream.

use converger_core::streams::{ChunkLog, OpenStream, ShowChunk};

use super::Session;
use crate::streams::{PackedChunks, StreamChange, StreamEvent, chunk_frame};
use crate::ws::session::Ending;

impl Session<'_> {
    pub(super) fn on_stream(&mut self, event: &StreamEvent) -> Result<(), Ending> {
        match &event.change {
            StreamChange::Chunk {
                stream_id, index, ..
            } => match self.streams_seen.on_chunk(stream_id, *index) {
                ShowChunk::Show => self.push(event.render(self.profile), false),
                ShowChunk::Drop => Ok(()),
                ShowChunk::Gap { .. } => self.show_stream_from_registry(stream_id),
            },
            StreamChange::End { stream_id, .. } => {
                if self.streams_seen.on_end(stream_id) {
                    self.push(event.render(self.profile), false)?;
                }
                Ok(())
            }
        }
    }

    /// Shows every open stream of the conversation from where this connection is.
    pub(super) fn catch_up_streams(&mut self) -> Result<(), Ending> {
        for (stream_id, stream) in self.state.streams.snapshot(self.conversation_id) {
            self.show_unseen_chunks(&stream_id, &stream)?;
        }
        Ok(())
    }

    /// Shows the chunks of one stream this connection has not seen yet, as the registry holds
    /// them now; a stream that ended meanwhile shows nothing (its end event follows).
    fn show_stream_from_registry(&mut self, stream_id: &str) -> Result<(), Ending> {
        match self.state.streams.stream(self.conversation_id, stream_id) {
            Some(stream) => self.show_unseen_chunks(stream_id, &stream),
            None => Ok(()),
        }
    }

    fn show_unseen_chunks(
        &mut self,
        stream_id: &str,
        stream: &OpenStream<PackedChunks>,
    ) -> Result<(), Ending> {
        let from = self.streams_seen.next_index(stream_id);
        for index in from..stream.chunks.len() as u64 {
            if self.streams_seen.on_chunk(stream_id, index) != ShowChunk::Show {
                continue;
            }
            if let Some(frame) = chunk_frame(self.profile, stream_id, index, stream) {
                self.push(frame, false)?;
            }
        }
        Ok(())
    }
}
