//! The chat frontends people already use, served unchanged (docs/frontends.md, ADR 0030): the
//! Vercel AI SDK's UI message stream (`useChat`) and AG-UI over Server-Sent Events.
//!
//! - `follow.rs`: follows one turn's answer (streams, then the committed result) for a sink;
//! - `ai_sdk.rs`: the AI SDK routes and their chunk sink;
//! - `ag_ui.rs`: the AG-UI routes and their event sink;
//! - `cors.rs`: the origin allowlist these browser-facing routes answer.

mod ag_ui;
mod ai_sdk;
mod cors;
mod follow;

use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::Event;
use axum::routing::{get, post};
use converger_protocol::ErrorCode;
use converger_store::{Activity, Conversation};
use tokio::sync::mpsc;

use super::conversations::authorized_conversation;
use super::sse_body;
use crate::auth::{bearer, verified_claims};
use crate::error::ApiError;
use crate::state::AppState;
use crate::tokens::{Claims, Scope};

/// Events queued for one response before the follower waits for the client.
const QUEUE: usize = 256;
/// How long the follower waits for a client that reads nothing before it ends the response
/// (a slow consumer; the client resumes): meanwhile no drain, disconnect or expiry is seen.
const SLOW_CLIENT: Duration = Duration::from_secs(10);

/// The frontends' routes, behind their CORS allowlist.
pub(super) fn router(state: AppState) -> Router<AppState> {
    // Each route also takes OPTIONS, so that a browser's preflight reaches the CORS layer.
    let preflight = || async { StatusCode::NO_CONTENT };
    Router::new()
        .route("/api/v1/ai-sdk/chat", post(ai_sdk::chat).options(preflight))
        .route(
            "/api/v1/ai-sdk/chat/{id}/stream",
            get(ai_sdk::resume).options(preflight),
        )
        .route(
            "/api/v1/ai-sdk/chat/{id}/stop",
            post(ai_sdk::stop).options(preflight),
        )
        .route(
            "/api/v1/ai-sdk/chat/{id}/messages",
            get(ai_sdk::messages).options(preflight),
        )
        .route("/api/v1/ag-ui/run", post(ag_ui::run).options(preflight))
        .route(
            "/api/v1/ag-ui/connect",
            post(ag_ui::connect).options(preflight),
        )
        .route("/api/v1/ag-ui/stop", post(ag_ui::stop).options(preflight))
        .layer(DefaultBodyLimit::max(
            state.config.frontends.max_request_bytes,
        ))
        .layer(axum::middleware::from_fn_with_state(state, cors::allow))
}

/// An end user and the conversation they may use.
struct EndUser {
    claims: Claims,
    conversation: Conversation,
}

/// The bearer token's end user, for conversation `raw_id`: 401 without a valid token, 403 for a
/// token that is not an end user's, 404 for a conversation the token may not use.
async fn end_user(
    state: &AppState,
    headers: &HeaderMap,
    raw_id: &str,
) -> Result<EndUser, ApiError> {
    // A draining node opens no session (its drain order went to the sessions it had).
    if state.is_draining() {
        return Err(ApiError::draining(state.config.drain.retry_after_ms));
    }
    let token = bearer(headers)
        .filter(|token| !token.is_empty())
        .ok_or_else(|| ApiError::unauthorized("a bearer token is required"))?;
    let claims = verified_claims(state, token).await?;
    if !matches!(claims.scope(), Scope::Conversation) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::Forbidden,
            "chat frontends are for end users: use a conversation-scope token",
        ));
    }
    let conversation = authorized_conversation(state, &claims, raw_id).await?;
    Ok(EndUser {
        claims,
        conversation,
    })
}

/// Commits an end user's message (`message_id` its idempotency key) and names the turn to
/// follow: a new turn's revision 0, or for a retry (the id already stored) the turn's latest
/// revision, so a retry after a regenerate or an edit shows the answer that counts.
async fn send_turn(
    state: &AppState,
    conversation: &Conversation,
    message: converger_protocol::MessageFrame,
    message_id: &str,
) -> Result<follow::TurnKey, ApiError> {
    let (frame, duplicate) = super::conversations::commit_user_message(
        state,
        conversation,
        message,
        Some(message_id.to_owned()),
    )
    .await?;
    if !duplicate {
        return Ok(follow::TurnKey {
            seq: frame.seq,
            revision: 0,
        });
    }
    // The id may be an edit's: its turn is the one it edited.
    let seq = frame.turn_seq.unwrap_or(frame.seq);
    let revision = state
        .store
        .latest_revision(conversation.id, seq)
        .await?
        .unwrap_or(0);
    Ok(follow::TurnKey { seq, revision })
}

/// The conversation's latest `frontends.max_history_frames` frames as the chat view shows
/// them (ADR 0018).
async fn chat_view_frames(
    state: &AppState,
    conversation: &Conversation,
) -> Result<Vec<Activity>, ApiError> {
    let store = &state.store;
    // Read now, not as the authorization read it: `connect` reads the snapshot after it
    // subscribed, so a frame committed before that is in the snapshot.
    let head = store
        .conversation(conversation.id)
        .await?
        .map_or(0, |conversation| conversation.last_seq);
    let limit = state.config.frontends.max_history_frames;
    Ok(crate::chat_history::chat_view_frames(store, conversation.id, head, limit).await?)
}

/// Numbers one response's events (`id:`), and knows when its client went away.
struct EventSender {
    sender: mpsc::Sender<Event>,
    next_id: u64,
}

impl EventSender {
    fn new(sender: mpsc::Sender<Event>) -> EventSender {
        EventSender { sender, next_id: 0 }
    }

    /// Sends `data` as the next event.
    async fn send_data(&mut self, data: String) -> Result<(), follow::Gone> {
        self.next_id += 1;
        let event = Event::default().id(self.next_id.to_string()).data(data);
        match tokio::time::timeout(SLOW_CLIENT, self.sender.send(event)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) | Err(_) => Err(follow::Gone),
        }
    }

    /// Sends a JSON value as the next event.
    async fn send_json<T: serde::Serialize>(&mut self, value: &T) -> Result<(), follow::Gone> {
        // The wire types are plain structs and JSON values: they always serialize.
        let text = serde_json::to_string(value).unwrap_or_default();
        self.send_data(text).await
    }

    async fn closed(&self) {
        self.sender.closed().await;
    }
}
