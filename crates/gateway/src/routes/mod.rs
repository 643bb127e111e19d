//! The HTTP routes of docs/protocol.md §6.

mod admin;
mod body;
mod channels;
mod conversations;
mod demo;
mod events;
mod frontends;
mod health;
pub(crate) mod http_agents;
mod lifecycle;
pub mod status;
mod stops;
pub(crate) mod tokens;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, patch, post};
use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use tokio::sync::mpsc;
use tower_http::timeout::RequestBodyTimeoutLayer;

use crate::state::AppState;

/// An SSE response of the events `receiver` yields, with heartbeat comments.
pub(crate) fn sse_body(state: &AppState, mut receiver: mpsc::Receiver<Event>) -> Response {
    let stream = futures_util::stream::poll_fn(move |context| {
        receiver
            .poll_recv(context)
            .map(|event| event.map(Ok::<Event, Infallible>))
    });
    let heartbeat = Duration::from_millis(state.config.limits.heartbeat_interval_ms);
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(heartbeat).text("heartbeat"))
        .into_response()
}

/// The REST surface, with body limit and request metrics applied.
pub(crate) fn router(state: AppState) -> Router {
    let body_limit = state.config.limits.max_frame_bytes;
    Router::new()
        .route("/", get(status::page).post(status::log_in))
        .route("/api/v1/admin/tenants", post(admin::create_tenant))
        .route("/api/v1/admin/cluster", get(admin::cluster))
        .route("/api/v1/admin/disconnect", post(admin::disconnect))
        .route(
            "/api/v1/channels",
            post(channels::create).get(channels::list),
        )
        .route("/api/v1/channels/{id}", patch(channels::update))
        .route(
            "/api/v1/channels/{id}/http-agents",
            post(http_agents::create).get(http_agents::list),
        )
        .route(
            "/api/v1/channels/{id}/http-agents/dead-letters",
            get(http_agents::dead_letters),
        )
        .route(
            "/api/v1/channels/{id}/http-agents/dead-letters/retry",
            post(http_agents::retry),
        )
        .route(
            "/api/v1/channels/{id}/http-agents/dead-letters/drop",
            post(http_agents::drop_letter),
        )
        .route(
            "/api/v1/channels/{id}/http-agents/{group}",
            get(http_agents::get)
                .patch(http_agents::update)
                .delete(http_agents::delete),
        )
        .route("/api/v1/conversations", get(lifecycle::list))
        .route("/api/v1/conversations/{id}", get(lifecycle::get))
        .route("/api/v1/api-keys/rotate", post(lifecycle::rotate_key))
        .route("/api/v1/converger/tokens/generate", post(tokens::generate))
        .route("/api/v1/converger/tokens/refresh", post(tokens::refresh))
        .route(
            "/api/v1/converger/conversations",
            post(conversations::create),
        )
        .route(
            "/api/v1/converger/conversations/{id}/activities",
            get(conversations::list_activities).post(conversations::post_activity),
        )
        .route(
            "/api/v1/converger/conversations/{id}/events",
            get(events::events),
        )
        .route(
            "/api/v1/converger/conversations/{id}/close",
            post(lifecycle::close),
        )
        .route(
            "/api/v1/converger/conversations/{id}/reopen",
            post(lifecycle::reopen),
        )
        .route(
            "/api/v1/converger/conversations/{id}/stop",
            post(stops::stop),
        )
        .merge(frontends::router(state.clone()))
        .route("/demo", get(demo::page))
        .route("/demo/converger.js", get(demo::sdk_bundle))
        .route("/demo/api/conversation", post(demo::conversation))
        .route("/demo/api/agent-token", post(demo::agent_token))
        .route("/socket/converger/v1", get(crate::ws::upgrade))
        .route("/health/live", get(health::live))
        .route("/health/ready", get(health::ready))
        .route("/metrics", get(health::metrics))
        .fallback(health::not_found)
        .method_not_allowed_fallback(health::method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(RequestBodyTimeoutLayer::new(Duration::from_millis(
            state.config.http.body_read_timeout_ms,
        )))
        .layer(axum::middleware::from_fn(body::close_after_refused_body))
        .layer(axum::middleware::from_fn(crate::metrics::track_http))
        .with_state(state)
}
