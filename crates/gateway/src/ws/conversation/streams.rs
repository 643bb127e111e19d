//! Streamed answers as one end user's connection shows them (ADR 0019): every chunk once and
//! in order, whether it came live or from the node's registry (a join mid-stream, a live feed
//! that fell behind), then the stream's end. Chunks are never dropped under pressure: a client
//! that cannot keep up with the live chunks is a slow consumer, and its reconnect resumes the
//! stream.
//!
//! What the registry shows (a catch-up) is a finite backlog, not live pressure: each run of text
//! chunks goes out as one coalesced chunk, and the frames wait for queue room like a replay, so
//! joining a stream of any length never trips the slow-consumer rule (ADR 0026).

use std::time::Duration;

use converger_core::streams::{OpenStream, ShowChunk};

use super::Session;
use crate::streams::{PackedChunks, StreamChange, StreamEvent, catch_up_frames};
use crate::ws::session::Ending;

impl Session<'_> {
    pub(super) async fn on_stream(&mut self, event: &StreamEvent) -> Result<(), Ending> {
        match &event.change {
            StreamChange::Chunk {
                stream_id, index, ..
            } => match self.streams_seen.on_chunk(stream_id, *index) {
                ShowChunk::Show => self.push(event.render(self.profile), false),
                ShowChunk::Drop => Ok(()),
                ShowChunk::Gap { .. } => self.show_stream_from_registry(stream_id).await,
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
    pub(super) async fn catch_up_streams(&mut self) -> Result<(), Ending> {
        for (stream_id, stream) in self.state.streams.snapshot(self.conversation_id) {
            self.show_unseen_chunks(&stream_id, &stream).await?;
        }
        Ok(())
    }

    /// Shows the chunks of one stream this connection has not seen yet, as the registry holds
    /// them now; a stream that ended meanwhile shows nothing (its end event follows).
    async fn show_stream_from_registry(&mut self, stream_id: &str) -> Result<(), Ending> {
        match self.state.streams.stream(self.conversation_id, stream_id) {
            Some(stream) => self.show_unseen_chunks(stream_id, &stream).await,
            None => Ok(()),
        }
    }

    async fn show_unseen_chunks(
        &mut self,
        stream_id: &str,
        stream: &OpenStream<PackedChunks>,
    ) -> Result<(), Ending> {
        let from = self.streams_seen.next_index(stream_id);
        let write_timeout = Duration::from_millis(self.state.config.limits.write_timeout_ms);
        for piece in catch_up_frames(self.profile, stream_id, stream, from) {
            if self
                .streams_seen
                .on_chunks(stream_id, piece.first, piece.last)
                != ShowChunk::Show
            {
                continue;
            }
            match self
                .outbound
                .push_text_waiting(piece.frame, write_timeout)
                .await
            {
                Ok(()) => self.last_outbound = tokio::time::Instant::now(),
                Err(error) => return Err(self.push_failed(error)),
            }
        }
        Ok(())
    }
}
