//! A conversation over Server-Sent Events (docs/protocol.md §6.1), for end users whose network
//! blocks WebSockets: the frames of the converger profile, `id:` = seq on persistent frames, a
//! resume from `Last-Event-ID` (or `?watermark=`), the same replay hold-back as a socket
//! (`converger_core::replay`), heartbeat comments, and an `error` event at token expiry. Sends
//! go over REST.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::Event;
use converger_core::replay::{LiveDecision, ReplayCursor};
use converger_core::streams::{OpenStream, ShowChunk, StreamCursor};
use converger_protocol::{ErrorCode, ErrorFrame, Profile, USER_ROLE, Viewer};
use converger_store::Activity;
use converger_store::bus::Origin;
use serde_json::Value;
use tokio::sync::{broadcast, mpsc};

use super::conversations::authorized_conversation;
use crate::auth::{bearer, verified_claims};
use crate::error::ApiError;
use crate::hub::{EndUserViews, Feed, HubEvent, SessionControl};
use crate::state::AppState;
use crate::streams::{PackedChunks, StreamChange, StreamEvent, catch_up_frames};
use crate::tokens::Scope;
use crate::wire;

/// The reconnection delay a client's `EventSource` is told (`retry:`).
const RETRY: Duration = Duration::from_secs(2);
/// Events queued for one stream before the producer waits for the client.
const QUEUE: usize = 256;

/// What one stream follows.
struct Follow {
    state: AppState,
    conversation_id: uuid::Uuid,
    user_id: String,
    expires_at: tokio::time::Instant,
    sender: mpsc::Sender<Event>,
}

/// `GET …/conversations/{id}/events` (token by `Authorization: Bearer` or `?token=`).
pub(crate) async fn events(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<axum::response::Response, ApiError> {
    // A draining node opens no session (its drain order went to the sessions it had).
    if state.is_draining() {
        return Err(ApiError::draining(state.config.drain.retry_after_ms));
    }
    let token = bearer(&headers)
        .or_else(|| query.get("token").map(String::as_str))
        .filter(|token| !token.is_empty())
        .ok_or_else(|| ApiError::unauthorized("a token is required (Bearer or ?token=)"))?;
    let claims = verified_claims(&state, token).await?;
    if !matches!(claims.scope(), Scope::Conversation) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::Forbidden,
            "events are for end users: use a conversation-scope token",
        ));
    }
    let conversation = authorized_conversation(&state, &claims, &id).await?;
    // Last-Event-ID wins: it is what the browser's EventSource sends when it reconnects.
    let watermark = match headers.get("last-event-id") {
        Some(value) => Some(value.to_str().unwrap_or("x").to_owned()),
        None => query.get("watermark").cloned(),
    };
    let watermark = match watermark.as_deref() {
        None | Some("") => 0,
        Some(raw) => raw.parse::<u64>().map_err(|_| invalid_watermark())?,
    };
    // Subscribe before reading the head: what commits from now on is in the replay or live.
    let live = state.hub.subscribe(conversation.id);
    let head = state
        .store
        .conversation(conversation.id)
        .await?
        .map_or(0, |conversation| {
            u64::try_from(conversation.last_seq).unwrap_or(0)
        });
    if watermark > head {
        return Err(invalid_watermark());
    }
    let (sender, receiver) = mpsc::channel::<Event>(QUEUE);
    // Registered like a socket: drained with the node, closed by a force-disconnect.
    let crate::presence::EndUserSession { controls, seat } =
        crate::presence::EndUserSession::register(&state, &conversation);
    let follow = Follow {
        state: state.clone(),
        conversation_id: conversation.id,
        user_id: conversation.user_id.clone(),
        expires_at: expiry_instant(claims.exp),
        sender,
    };
    tokio::spawn(follow.run(watermark, head, live, controls, seat));
    Ok(super::sse_body(&state, receiver))
}

/// When a token that expires at `exp` (seconds since the epoch) runs out.
fn expiry_instant(exp: i64) -> tokio::time::Instant {
    let remaining = exp.saturating_sub(chrono::Utc::now().timestamp()).max(0);
    tokio::time::Instant::now() + Duration::from_secs(u64::try_from(remaining).unwrap_or(0))
}

fn invalid_watermark() -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        ErrorCode::InvalidWatermark,
        "Last-Event-ID or watermark must be a seq at or below the conversation's head",
    )
}

/// The stream stopped following: the client went away, or it was ended (expiry, drain,
/// disconnect, an unreadable replay).
struct Stop;

impl Follow {
    async fn run(
        self,
        watermark: u64,
        head: u64,
        mut live: Feed,
        mut controls: mpsc::Receiver<SessionControl>,
        seat: crate::presence::SessionSeat,
    ) {
        let _ = self.follow(watermark, head, &mut live, &mut controls).await;
        drop(seat);
    }

    async fn follow(
        &self,
        watermark: u64,
        head: u64,
        live: &mut broadcast::Receiver<HubEvent>,
        controls: &mut mpsc::Receiver<SessionControl>,
    ) -> Result<(), Stop> {
        self.send(Event::default().retry(RETRY).comment("converger"))
            .await?;
        let (mut cursor, plan) = ReplayCursor::start(watermark, head, None);
        self.send_range(plan.after, plan.upto).await?;
        // After the stored frames, the answers streaming now, as on a socket.
        let mut seen = StreamCursor::default();
        self.catch_up_streams(&mut seen).await?;
        let expiry = tokio::time::sleep_until(self.expires_at);
        tokio::pin!(expiry);
        loop {
            let event = tokio::select! {
                () = &mut expiry => return self.expired().await,
                () = self.sender.closed() => return Err(Stop),
                Some(control) = controls.recv() => return self.on_control(control).await,
                event = live.recv() => event,
            };
            match event {
                Ok(HubEvent::Committed {
                    seq,
                    activity,
                    views,
                }) => {
                    self.on_committed(&mut cursor, seq, activity, &views)
                        .await?
                }
                Ok(HubEvent::Transient { frame, origin }) => {
                    self.on_transient(&frame, origin.as_deref()).await?
                }
                Ok(HubEvent::Stream(event)) => self.on_stream(&mut seen, &event).await?,
                Ok(HubEvent::Regenerated { .. } | HubEvent::TurnStopped(_)) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    self.catch_up_streams(&mut seen).await?;
                    let head = match self.state.store.conversation(self.conversation_id).await {
                        Ok(Some(conversation)) => conversation.last_seq,
                        _ => continue,
                    };
                    self.on_committed(&mut cursor, head, None, &EndUserViews::default())
                        .await?;
                }
                Err(broadcast::error::RecvError::Closed) => return Err(Stop),
            }
        }
    }

    async fn on_committed(
        &self,
        cursor: &mut ReplayCursor,
        seq: i64,
        activity: Option<Arc<Activity>>,
        views: &EndUserViews,
    ) -> Result<(), Stop> {
        let Ok(seq) = u64::try_from(seq) else {
            return Ok(());
        };
        match cursor.on_live(seq) {
            LiveDecision::Drop => {}
            LiveDecision::Send => {
                match activity {
                    Some(activity) => {
                        let text = views.render(&activity, &self.user_id, Profile::Converger);
                        self.send(frame_event(seq, text.as_str())).await?;
                    }
                    None => self.send_range(seq - 1, seq).await?,
                }
                cursor.advance_to(seq);
            }
            LiveDecision::FillGap { after, upto } => {
                self.send_range(after, upto).await?;
                cursor.advance_to(upto);
            }
        }
        Ok(())
    }

    /// Sends the stored frames `after + 1 ..= upto` from the database, in batches.
    async fn send_range(&self, after: u64, upto: u64) -> Result<(), Stop> {
        let batch = self.state.config.limits.replay_batch as i64;
        let mut next_after = after as i64;
        let upto = upto as i64;
        let viewer = Viewer::EndUser {
            user_id: &self.user_id,
        };
        while next_after < upto {
            let limit = batch.min(upto - next_after);
            let rows = match self
                .state
                .store
                .list_activities(self.conversation_id, next_after, limit)
                .await
            {
                Ok(rows) => rows,
                Err(error) => {
                    // The client reconnects with its Last-Event-ID: nothing is skipped.
                    tracing::warn!(%error, conversation_id = %self.conversation_id, "events: replay read failed");
                    return Err(Stop);
                }
            };
            let Some(last) = rows.last().map(|row| row.seq) else {
                break;
            };
            for row in &rows {
                let text = wire::persistent(row).view(viewer).encode();
                self.send(frame_event(row.seq as u64, &text)).await?;
            }
            next_after = last;
        }
        Ok(())
    }

    async fn on_transient(&self, frame: &Value, origin: Option<&Origin>) -> Result<(), Stop> {
        let kind = frame
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        // Typing and presence are the other participants' (as on a socket).
        let own =
            origin.is_some_and(|origin| origin.id == self.user_id && origin.role == USER_ROLE);
        if own && matches!(kind, "typing" | "presence") {
            return Ok(());
        }
        if !Profile::Converger.receives_transient(kind) {
            return Ok(());
        }
        self.send(Event::default().data(frame.to_string())).await
    }

    /// A streamed answer's chunk or end, each chunk once and in order (ADR 0019), as a socket
    /// of the converger profile shows it.
    async fn on_stream(&self, seen: &mut StreamCursor, event: &StreamEvent) -> Result<(), Stop> {
        match &event.change {
            StreamChange::Chunk {
                stream_id, index, ..
            } => match seen.on_chunk(stream_id, *index) {
                ShowChunk::Show => {
                    let text = event.render(Profile::Converger);
                    self.send(Event::default().data(text.as_str())).await
                }
                ShowChunk::Drop => Ok(()),
                ShowChunk::Gap { .. } => {
                    match self.state.streams.stream(self.conversation_id, stream_id) {
                        Some(stream) => self.send_unseen_chunks(seen, stream_id, &stream).await,
                        None => Ok(()),
                    }
                }
            },
            StreamChange::End { stream_id, .. } => {
                if seen.on_end(stream_id) {
                    let text = event.render(Profile::Converger);
                    self.send(Event::default().data(text.as_str())).await?;
                }
                Ok(())
            }
        }
    }

    /// Every open stream of the conversation, from where this stream is.
    async fn catch_up_streams(&self, seen: &mut StreamCursor) -> Result<(), Stop> {
        for (stream_id, stream) in self.state.streams.snapshot(self.conversation_id) {
            self.send_unseen_chunks(seen, &stream_id, &stream).await?;
        }
        Ok(())
    }

    async fn send_unseen_chunks(
        &self,
        seen: &mut StreamCursor,
        stream_id: &str,
        stream: &OpenStream<PackedChunks>,
    ) -> Result<(), Stop> {
        let from = seen.next_index(stream_id);
        for piece in catch_up_frames(Profile::Converger, stream_id, stream, from) {
            if seen.on_chunks(stream_id, piece.first, piece.last) != ShowChunk::Show {
                continue;
            }
            self.send(Event::default().data(piece.frame.as_str()))
                .await?;
        }
        Ok(())
    }

    /// The token ran out: an `error` event, then the stream ends (the client gets a new token
    /// and reconnects with its Last-Event-ID).
    async fn expired(&self) -> Result<(), Stop> {
        let error = ErrorFrame::new(ErrorCode::TokenExpired, "token expired").encode();
        self.send(Event::default().event("error").data(error))
            .await?;
        Err(Stop)
    }

    /// The node drains, or an operator disconnects the user: an `error` event, then the end.
    async fn on_control(&self, control: SessionControl) -> Result<(), Stop> {
        let error = control.error_frame();
        self.send(Event::default().event("error").data(error.encode()))
            .await?;
        Err(Stop)
    }

    async fn send(&self, event: Event) -> Result<(), Stop> {
        self.sender.send(event).await.map_err(|_| Stop)
    }
}

/// A persistent frame as an event: `id:` its seq.
fn frame_event(seq: u64, text: &str) -> Event {
    Event::default().id(seq.to_string()).data(text)
}
