//! Following one turn's answer for a chat frontend (docs/frontends.md, ADR 0030): the streamed
//! chunks from wherever they are (this node's open streams, then live), each once, then the
//! one committed result (answer, stop settlement or failure) read from the registry, so what a
//! frontend ends with is what a reload shows.
//!
//! The follower only decides what the answer is; an [`AnswerSink`] (the AI SDK's UI message
//! stream, AG-UI) renders it. It is registered like any end-user session: drained with the
//! node, closed by a force-disconnect, ended at token expiry, and counted in presence.

use std::collections::HashMap;
use std::time::Duration;

use converger_core::streams::{ShowChunk, StreamCursor};
use converger_protocol::{ErrorCode, ErrorFrame, StreamContent};
use converger_store::{Activity, Conversation};
use serde_json::Value;
use tokio::sync::{broadcast, mpsc};
use uuid::Uuid;

use crate::hub::{Feed, HubEvent, SessionControl};
use crate::presence::{EndUserSession, SessionSeat};
use crate::state::AppState;
use crate::streams::{PackedChunks, StreamChange, StreamEvent};

/// How often a follower reads the turn's status though nothing told it to: an answer that
/// stored no frame publishes nothing, and a lost notification must cost latency, not the end.
pub(crate) const RECHECK: Duration = Duration::from_secs(2);

/// The client went away (its response body was dropped).
#[derive(Debug)]
pub(crate) struct Gone;

/// A turn at one revision: the store's (seq, revision), what a follower follows.
pub(crate) use converger_store::TurnRevision as TurnKey;

/// The id of the assistant message that answers `turn`, the same live and in the history.
pub(crate) fn answer_id(turn: TurnKey) -> String {
    format!("answer-{}-{}", turn.seq, turn.revision)
}

/// How a followed answer ended.
#[derive(Debug)]
pub(crate) enum RunEnd {
    /// The agent's answer is committed.
    Answered,
    /// The turn was stopped (by a user, a newer turn, a regenerate); what streamed is kept.
    Stopped,
    /// No answer will come (it was refused, or the turn failed).
    Failed(ErrorFrame),
    /// The session ended (token expiry, drain, force-disconnect): nothing more is followed.
    Ended(ErrorFrame),
}

/// What renders an answer.
pub(crate) trait AnswerSink {
    /// Text appended to the text part `part_id`.
    async fn text(&mut self, part_id: &str, delta: &str) -> Result<(), Gone>;
    /// The text part `part_id` is complete.
    async fn text_end(&mut self, part_id: &str) -> Result<(), Gone>;
    /// A generative-UI chunk of a stream.
    async fn ui_chunk(&mut self, part_id: &str, chunk: &Value) -> Result<(), Gone>;
    /// A committed answer frame other than text.
    async fn frame(&mut self, frame: &Activity) -> Result<(), Gone>;
    /// Resolves when the client went away.
    async fn closed(&self);
}

/// One frontend session following a conversation.
pub(crate) struct Follower {
    state: AppState,
    conversation_id: Uuid,
    live: Feed,
    controls: mpsc::Receiver<SessionControl>,
    expires_at: tokio::time::Instant,
    _seat: SessionSeat,
}

/// What a follower has shown of one answer.
#[derive(Default)]
struct Shown {
    seen: StreamCursor,
    /// Text shown per part (stream id), to show only the rest of a committed text.
    texts: HashMap<String, String>,
}

impl Follower {
    /// Subscribes to the conversation (before anything is read, so nothing committed from now
    /// on is missed) and registers the session.
    pub(crate) fn open(state: &AppState, conversation: &Conversation, token_exp: i64) -> Follower {
        let live = state.hub.subscribe(conversation.id);
        let EndUserSession { controls, seat } = EndUserSession::register(state, conversation);
        let remaining = token_exp
            .saturating_sub(chrono::Utc::now().timestamp())
            .max(0);
        Follower {
            state: state.clone(),
            conversation_id: conversation.id,
            live,
            controls,
            expires_at: tokio::time::Instant::now()
                + Duration::from_secs(u64::try_from(remaining).unwrap_or(0)),
            _seat: seat,
        }
    }

    /// The node's state.
    pub(crate) fn state(&self) -> &AppState {
        &self.state
    }

    /// The conversation followed.
    pub(crate) fn conversation_id(&self) -> Uuid {
        self.conversation_id
    }

    /// Follows turn `turn`'s answer into `sink` until it has its one result.
    pub(crate) async fn follow_turn<S: AnswerSink>(
        &mut self,
        turn: TurnKey,
        sink: &mut S,
    ) -> Result<RunEnd, Gone> {
        let mut shown = Shown::default();
        self.catch_up(turn, &mut shown, sink).await?;
        if let Some(end) = self.settled(turn, &mut shown, sink).await? {
            return Ok(end);
        }
        let expiry = tokio::time::sleep_until(self.expires_at);
        tokio::pin!(expiry);
        let mut recheck = tokio::time::interval(RECHECK);
        recheck.tick().await;
        loop {
            let event = tokio::select! {
                () = sink.closed() => return Err(Gone),
                () = &mut expiry => {
                    return Ok(RunEnd::Ended(ErrorFrame::new(ErrorCode::TokenExpired, "token expired")));
                }
                Some(control) = self.controls.recv() => return Ok(RunEnd::Ended(control.error_frame())),
                _ = recheck.tick() => {
                    if let Some(end) = self.settled(turn, &mut shown, sink).await? {
                        return Ok(end);
                    }
                    continue;
                }
                event = self.live.recv() => event,
            };
            let check = match event {
                Ok(HubEvent::Stream(event)) => {
                    self.on_stream(turn, &event, &mut shown, sink).await?;
                    false
                }
                // The answer's frames, an edit of the turn (a newer revision), or a commit heard
                // without its frame: the registry says whether the followed revision is done.
                Ok(HubEvent::Committed { activity, .. }) => activity
                    .as_deref()
                    .is_none_or(|frame| frame.turn_seq == Some(turn.seq)),
                Ok(HubEvent::Transient { frame, .. }) => {
                    let refused = converger_protocol::refused_turn(&frame);
                    if refused.is_some_and(|refused| {
                        refused.seq == turn.seq && refused.revision == turn.revision
                    }) {
                        // An HTTP agent that failed the turn, or an answer refused.
                        let failed = frame["data"]["code"] == ErrorCode::AgentFailed.as_str();
                        return Ok(RunEnd::Failed(if failed {
                            ErrorFrame::new(
                                ErrorCode::AgentFailed,
                                "the agent failed to answer this turn",
                            )
                        } else {
                            ErrorFrame::new(
                                ErrorCode::AnswerRefused,
                                "the agent's answer could not be accepted",
                            )
                        }));
                    }
                    false
                }
                // A newer revision of the turn: the registry ends the one followed.
                Ok(HubEvent::Regenerated {
                    turn: regenerated, ..
                }) => regenerated.seq == turn.seq,
                Ok(HubEvent::TurnStopped(_)) => false,
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    self.catch_up(turn, &mut shown, sink).await?;
                    true
                }
                Err(broadcast::error::RecvError::Closed) => return Err(Gone),
            };
            if check && let Some(end) = self.settled(turn, &mut shown, sink).await? {
                return Ok(end);
            }
        }
    }

    /// Waits for the next live hub event (used between runs); `None` when the session ends.
    pub(crate) async fn next_event<S: AnswerSink>(
        &mut self,
        sink: &S,
    ) -> Result<Option<HubEvent>, Gone> {
        let expiry = tokio::time::sleep_until(self.expires_at);
        tokio::select! {
            () = sink.closed() => Err(Gone),
            () = expiry => Ok(None),
            Some(_) = self.controls.recv() => Ok(None),
            event = self.live.recv() => match event {
                Ok(event) => Ok(Some(event)),
                Err(broadcast::error::RecvError::Lagged(_)) => Ok(Some(HubEvent::committed_seq(0))),
                Err(broadcast::error::RecvError::Closed) => Err(Gone),
            },
        }
    }

    /// Every open stream of the turn, from where the follower is.
    async fn catch_up<S: AnswerSink>(
        &self,
        turn: TurnKey,
        shown: &mut Shown,
        sink: &mut S,
    ) -> Result<(), Gone> {
        for (stream_id, stream) in self.state.streams.snapshot(self.conversation_id) {
            if stream.turn.seq != turn.seq || stream.turn.revision != turn.revision {
                continue;
            }
            show_unseen(&stream_id, &stream.chunks, shown, sink).await?;
        }
        Ok(())
    }

    async fn on_stream<S: AnswerSink>(
        &self,
        turn: TurnKey,
        event: &StreamEvent,
        shown: &mut Shown,
        sink: &mut S,
    ) -> Result<(), Gone> {
        let StreamChange::Chunk {
            stream_id,
            index,
            turn: chunk_turn,
            body,
        } = &event.change
        else {
            // An aborted stream's text stays shown; the committed result closes every part.
            return Ok(());
        };
        if chunk_turn.seq != turn.seq || chunk_turn.revision != turn.revision {
            return Ok(());
        }
        match shown.seen.on_chunk(stream_id, *index) {
            ShowChunk::Show => show(stream_id, *index, &body.content, shown, sink).await,
            ShowChunk::Drop => Ok(()),
            ShowChunk::Gap { .. } => {
                match self.state.streams.stream(self.conversation_id, stream_id) {
                    Some(stream) => show_unseen(stream_id, &stream.chunks, shown, sink).await,
                    None => Ok(()),
                }
            }
        }
    }

    /// When the turn has its result: shows the committed frames not yet shown, closes every
    /// text part and says how it ended; `None` while it runs.
    async fn settled<S: AnswerSink>(
        &self,
        turn: TurnKey,
        shown: &mut Shown,
        sink: &mut S,
    ) -> Result<Option<RunEnd>, Gone> {
        let store = &self.state.store;
        let progress = match store
            .turn_progress(self.conversation_id, turn.seq, turn.revision)
            .await
        {
            Ok(Some(progress)) => progress,
            Ok(None) => {
                return Ok(Some(RunEnd::Failed(ErrorFrame::new(
                    ErrorCode::BadRequest,
                    "no such turn",
                ))));
            }
            Err(error) => {
                // Read again at the next event or recheck.
                tracing::warn!(%error, conversation_id = %self.conversation_id, "frontends: turn status unreadable");
                return Ok(None);
            }
        };
        if !progress.is_settled() {
            // An edit or a regenerate replaced the revision followed: it gets no answer.
            if progress.latest_revision > turn.revision {
                return Ok(Some(RunEnd::Stopped));
            }
            return Ok(None);
        }
        let frames = match self.answer_frames(&progress.result_seqs).await {
            Ok(frames) => frames,
            Err(error) => {
                tracing::warn!(%error, conversation_id = %self.conversation_id, "frontends: answer unreadable");
                return Ok(None);
            }
        };
        for frame in &frames {
            show_committed(frame, shown, sink).await?;
        }
        for part_id in shown.texts.keys() {
            sink.text_end(part_id).await?;
        }
        shown.texts.clear();
        // Settled without an answer of its agent (stopped, or its conversation closed) is a
        // stop to the user: what streamed stays.
        Ok(Some(match progress.status.as_str() {
            "completed" => RunEnd::Answered,
            // Only an HTTP agent group fails a turn (ADR 0031).
            "failed" => RunEnd::Failed(ErrorFrame::new(
                ErrorCode::AgentFailed,
                "the agent failed to answer this turn",
            )),
            _ => RunEnd::Stopped,
        }))
    }

    /// The committed frames at `seqs`, in order.
    async fn answer_frames(
        &self,
        seqs: &[i64],
    ) -> Result<Vec<Activity>, converger_store::StoreError> {
        let (Some(first), Some(last)) = (seqs.iter().min(), seqs.iter().max()) else {
            return Ok(Vec::new());
        };
        let rows = self
            .state
            .store
            .list_activities(self.conversation_id, first - 1, last - first + 1)
            .await?;
        Ok(rows
            .into_iter()
            .filter(|row| seqs.contains(&row.seq))
            .collect())
    }
}

/// Chunks of an open stream the follower has not shown, text runs coalesced.
async fn show_unseen<S: AnswerSink>(
    stream_id: &str,
    chunks: &PackedChunks,
    shown: &mut Shown,
    sink: &mut S,
) -> Result<(), Gone> {
    let Ok(from) = usize::try_from(shown.seen.next_index(stream_id)) else {
        return Ok(());
    };
    for piece in chunks.catch_up(from) {
        if shown.seen.on_chunks(stream_id, piece.first, piece.last) != ShowChunk::Show {
            continue;
        }
        show(stream_id, piece.first, &piece.content, shown, sink).await?;
    }
    Ok(())
}

async fn show<S: AnswerSink>(
    stream_id: &str,
    index: u64,
    content: &StreamContent,
    shown: &mut Shown,
    sink: &mut S,
) -> Result<(), Gone> {
    match content {
        StreamContent::Text(text) => {
            shown
                .texts
                .entry(stream_id.to_owned())
                .or_default()
                .push_str(text);
            sink.text(stream_id, text).await
        }
        StreamContent::Chunk(chunk) => sink.ui_chunk(&format!("{stream_id}-{index}"), chunk).await,
    }
}

/// One committed answer frame: a text shows what its stream did not (the whole text when it
/// was not streamed, or when it differs from what streamed); anything else goes to the sink.
async fn show_committed<S: AnswerSink>(
    frame: &Activity,
    shown: &mut Shown,
    sink: &mut S,
) -> Result<(), Gone> {
    if frame.kind != "text" {
        return sink.frame(frame).await;
    }
    let text = frame
        .data
        .get("text")
        .and_then(Value::as_str)
        .unwrap_or_default();
    // A streamed answer names its stream; a stop's settlement has the stream's id as its own.
    let stream_id = frame
        .extra
        .as_ref()
        .and_then(|extra| extra.get("streamId"))
        .and_then(Value::as_str)
        .unwrap_or(&frame.id);
    if let Some(streamed) = shown.texts.get(stream_id)
        && let Some(rest) = text.strip_prefix(streamed.as_str())
    {
        let rest = rest.to_owned();
        shown
            .texts
            .entry(stream_id.to_owned())
            .or_default()
            .push_str(&rest);
        return sink.text(stream_id, &rest).await;
    }
    // Not streamed, or committed with other text than streamed: a part of its own (the live
    // view then shows both; the history, the committed text only).
    let part_id = match shown.texts.contains_key(&frame.id) {
        true => format!("{}-committed", frame.id),
        false => frame.id.clone(),
    };
    sink.text(&part_id, text).await?;
    sink.text_end(&part_id).await
}
