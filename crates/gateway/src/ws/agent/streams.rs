//! An agent's streamed answers (docs/protocol.md §4.9, ADR 0019): `streamChunk` opens a stream
//! for a delivered turn (checked once against the turn registry) and appends to it;
//! `streamAbort` ends it; the turn's result, or the connection's end, ends it otherwise.

use converger_core::streams::{Budget, ChunkRefusal, StreamTurn};
use converger_protocol::{ErrorCode, ErrorFrame, StreamAbort, StreamChunk};
use serde_json::json;
use uuid::Uuid;

use super::AgentSession;
use crate::streams::{ChunkBody, LocalChunk};
use crate::ws::session::Ending;

impl AgentSession<'_> {
    pub(super) async fn on_stream_chunk(
        &mut self,
        conversation_id: Uuid,
        chunk: StreamChunk,
    ) -> Result<(), Ending> {
        let opening = chunk.index == 0
            && !self
                .state
                .streams
                .is_known(conversation_id, &chunk.stream_id);
        if opening && let Some(refusal) = self.refuse_opening(conversation_id, &chunk).await {
            return self.enveloped_error(conversation_id, refusal);
        }
        // The ids as text on the stack: a chunk costs no allocation for them.
        let (mut connection, mut channel) = (Uuid::encode_buffer(), Uuid::encode_buffer());
        let connection = &*self
            .connection_id
            .hyphenated()
            .encode_lower(&mut connection);
        let channel = &*self.channel_id.hyphenated().encode_lower(&mut channel);
        let accepted = self.state.streams.accept(
            &self.state.hub,
            LocalChunk {
                conversation_id,
                stream_id: &chunk.stream_id,
                index: chunk.index,
                turn: chunk.turn.map(|turn| StreamTurn {
                    seq: turn.seq,
                    revision: turn.revision,
                }),
                fence: chunk.turn.and_then(|turn| turn.fence),
                owner: connection,
                channel,
                body: ChunkBody {
                    content: chunk.content,
                    from: self.sender_ref(),
                },
            },
        );
        match accepted {
            Ok(()) => Ok(()),
            Err(refusal) => {
                let error = chunk_refused(refusal, &chunk.stream_id, chunk.index);
                self.enveloped_error(conversation_id, error)
            }
        }
    }

    pub(super) fn on_stream_abort(
        &mut self,
        conversation_id: Uuid,
        abort: &StreamAbort,
    ) -> Result<(), Ending> {
        let connection = self.connection_id.to_string();
        let streams = &self.state.streams;
        if streams.abort_own(
            &self.state.hub,
            conversation_id,
            &abort.stream_id,
            &connection,
            &abort.reason,
        ) || streams.has_ended(conversation_id, &abort.stream_id)
        {
            return Ok(());
        }
        let error = ErrorFrame {
            frame_type: Some("streamAbort".into()),
            details: Some(json!({"streamId": abort.stream_id})),
            ..ErrorFrame::new(
                ErrorCode::StreamClosed,
                "no open stream of this connection has that streamId",
            )
        };
        self.enveloped_error(conversation_id, error)
    }

    /// Why a stream may not open for the turn its first chunk names, when it may not: the turn
    /// must be a pending revision, the latest one, and in lease mode held under the fence given.
    async fn refuse_opening(
        &self,
        conversation_id: Uuid,
        chunk: &StreamChunk,
    ) -> Option<ErrorFrame> {
        // Without a turn, the registry refuses the chunk itself.
        let turn = chunk.turn?;
        let refuse = |code: ErrorCode, message: &str, details: serde_json::Value| ErrorFrame {
            frame_type: Some("streamChunk".into()),
            details: Some(details),
            ..crate::error::error_frame(code, message)
        };
        let stream = json!({"streamId": chunk.stream_id, "index": chunk.index,
                            "turn": {"seq": turn.seq, "revision": turn.revision}});
        if self.lease.is_some() && turn.fence.is_none() {
            return Some(refuse(
                ErrorCode::BadRequest,
                "turn.fence is required in lease mode",
                stream,
            ));
        }
        let found = self
            .state
            .store
            .streamable_turn(conversation_id, turn.seq, turn.revision)
            .await;
        let state = match found {
            Ok(Some(state)) => state,
            Ok(None) => return Some(refuse(ErrorCode::BadRequest, "no such turn", stream)),
            Err(error) => {
                tracing::warn!(%error, %conversation_id, "stream: turn unreadable");
                return Some(refuse(
                    crate::error::failure_code(&error),
                    "the turn cannot be checked now; retry",
                    stream,
                ));
            }
        };
        if state.latest_revision > turn.revision {
            return Some(refuse(
                ErrorCode::TurnSuperseded,
                "a newer revision of this turn exists",
                json!({"streamId": chunk.stream_id, "revision": state.latest_revision}),
            ));
        }
        if !state.pending {
            return Some(refuse(
                ErrorCode::StreamClosed,
                "the turn is answered or stopped already",
                stream,
            ));
        }
        if let Some(fence) = turn.fence
            && self.lease.is_some()
            && fence != state.fence
        {
            return Some(refuse(
                ErrorCode::LeaseLost,
                "the turn was claimed again since this delivery",
                json!({"streamId": chunk.stream_id, "fence": state.fence}),
            ));
        }
        None
    }
}

/// The error an agent gets for a chunk the registry refused.
fn chunk_refused(refusal: ChunkRefusal, stream_id: &str, index: u64) -> ErrorFrame {
    let mut details = json!({"streamId": stream_id, "index": index});
    let (code, message) = match refusal {
        ChunkRefusal::TurnMissing => (
            ErrorCode::InvalidMessage,
            "the first chunk of a stream (index 0) must name its turn",
        ),
        ChunkRefusal::OutOfOrder { expected } => {
            details["expected"] = json!(expected);
            (
                ErrorCode::InvalidMessage,
                "index must be the next one of the stream",
            )
        }
        ChunkRefusal::Closed => (
            ErrorCode::StreamClosed,
            "the stream has ended, or another connection writes it",
        ),
        ChunkRefusal::TooManyStreams => (
            ErrorCode::TooManyStreams,
            "maxStreamsPerConnection streams are open on this connection",
        ),
        ChunkRefusal::TooLarge => (
            ErrorCode::PayloadTooLarge,
            "the stream would exceed maxStreamBytes; it was aborted",
        ),
        ChunkRefusal::OverBudget { budget, aborted } => {
            details["budget"] = json!(match budget {
                Budget::Pool => "channel",
                Budget::Total => "node",
            });
            if aborted {
                (
                    ErrorCode::PayloadTooLarge,
                    "the open streams would exceed maxStreamBytesPerChannel or maxStreamBytesPerNode; the stream was aborted",
                )
            } else {
                (
                    ErrorCode::TooManyStreams,
                    "the open streams hold maxStreamBytesPerChannel or maxStreamBytesPerNode; answer without streaming, or stream after one ends",
                )
            }
        }
    };
    ErrorFrame {
        frame_type: Some("streamChunk".into()),
        details: Some(details),
        ..ErrorFrame::new(code, message)
    }
}
