//! Streamed answers as one end user's connection shows them (ADR 0019): every chunk once and
//! in order, whether it came live or from the node's registry (a join mid-stream, a live feed
//! that fell behind), then the stream's end. Chunks are never dropped under pressure: a client
//! that cannot keep up with the live chunks is a slow consumer, and its reconnect resumes the
//! stream.
//!
//! What the registry shows (a catch-up) is a finite backlog, not live pressure: each run of text
//! chunks goes out as one coalesced chunk, and the frames wait for queue room like a replay, so
//! joining a stream of any length never trips the slow-consumer rule (ADR 0026).
//!
//! A mekik widget cannot de-duplicate chunks (its `genui` frames carry no index), so it tells
//! how much of a stream it shows through its watermark (`converger_protocol::mekik`): after a
//! cut socket it is sent only the rest; when the stream ended while it was away, its partial
//! bubble is closed and the stored answer is shown apart (ADR 0027).

use std::time::Duration;

use axum::extract::ws::Utf8Bytes;
use converger_core::streams::{OpenStream, ShowChunk};
use converger_protocol::mekik::StreamProgress;
use converger_protocol::{PersistentFrame, Profile, end_user_stream_end};

use super::Session;
use crate::streams::{PackedChunks, StreamChange, StreamEvent, catch_up_frames};
use crate::ws::session::Ending;

impl Session<'_> {
    pub(super) async fn on_stream(&mut self, event: &StreamEvent) -> Result<(), Ending> {
        match &event.change {
            StreamChange::Chunk {
                stream_id,
                index,
                turn,
                ..
            } => {
                self.resume_late_stream(stream_id, turn.seq);
                match self.streams_seen.on_chunk(stream_id, *index) {
                    ShowChunk::Show => self.push(event.render(self.profile), false),
                    ShowChunk::Drop => Ok(()),
                    ShowChunk::Gap { .. } => self.show_stream_from_registry(stream_id).await,
                }
            }
            StreamChange::End { stream_id, .. } => {
                if self.streams_seen.on_end(stream_id) {
                    self.push(event.render(self.profile), false)?;
                }
                Ok(())
            }
        }
    }

    /// Takes a reconnecting mekik widget's progress: the open stream answering its turn is
    /// shown from where the widget is; if none is open, the stream ended while it was away.
    pub(super) fn resume_stream(&mut self, progress: StreamProgress) {
        let open = i64::try_from(progress.turn_seq).ok().and_then(|seq| {
            self.state
                .streams
                .open_for_turn_seq(self.conversation_id, seq)
        });
        match open {
            Some(stream_id) => {
                let shown = progress.chunks_shown.saturating_sub(1);
                self.streams_seen.on_chunks(&stream_id, 0, shown);
            }
            None => self.stream_ended_away = Some(progress),
        }
    }

    /// A widget's stream taken for ended while it was away may only have been unknown here:
    /// on NATS a node that begins to follow a conversation learns its open streams a moment
    /// later (ADR 0035). When a chunk of that turn's stream comes, the widget resumes from
    /// where it is instead of being shown the stream again.
    fn resume_late_stream(&mut self, stream_id: &str, turn_seq: i64) {
        let Some(progress) = &self.stream_ended_away else {
            return;
        };
        let same_turn = i64::try_from(progress.turn_seq).is_ok_and(|seq| seq == turn_seq);
        if !same_turn || self.streams_seen.is_showing(stream_id) {
            return;
        }
        if let Some(progress) = self.stream_ended_away.take() {
            let shown = progress.chunks_shown.saturating_sub(1);
            self.streams_seen.on_chunks(stream_id, 0, shown);
        }
    }

    /// A stored frame as this connection shows it in a replay. For a mekik widget whose stream
    /// ended while it was away, the stream's answer is shown as a bubble of its own, after the
    /// end that stops the partial one (which the widget cannot replace).
    pub(super) async fn replayed(&mut self, frame: PersistentFrame<'_>) -> Result<String, Ending> {
        if self.is_converger() {
            return Ok(frame.view(self.viewer()).encode());
        }
        let ended_away = match frame.answered_stream() {
            Some(stream_id) if self.stream_ended_away.take().is_some() => Some(stream_id),
            _ => None,
        };
        let Some(stream_id) = ended_away else {
            return Ok(frame.view(self.viewer()).for_mekik().encode());
        };
        let end = end_user_stream_end(Profile::Mekik, stream_id, None).to_string();
        self.push_waiting(end).await?;
        Ok(frame.view(self.viewer()).encode())
    }

    /// Queues a frame, waiting for room like a replay.
    pub(super) async fn push_waiting(&mut self, text: impl Into<Utf8Bytes>) -> Result<(), Ending> {
        let write_timeout = Duration::from_millis(self.state.config.limits.write_timeout_ms);
        match self.outbound.push_text_waiting(text, write_timeout).await {
            Ok(()) => {
                self.last_outbound = tokio::time::Instant::now();
                Ok(())
            }
            Err(error) => Err(self.push_failed(error)),
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
        for piece in catch_up_frames(self.profile, stream_id, stream, from) {
            if self
                .streams_seen
                .on_chunks(stream_id, piece.first, piece.last)
                != ShowChunk::Show
            {
                continue;
            }
            self.push_waiting(piece.frame).await?;
        }
        Ok(())
    }
}
