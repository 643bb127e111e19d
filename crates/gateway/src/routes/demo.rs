//! The demo chat page (`[demo] page`, docs/operations.md): a development aid that talks the
//! converger profile to show streamed answers. `GET /demo` is the page; `POST
//! /demo/api/conversation` gives the browser an anonymous conversation of the demo channel;
//! `POST /demo/api/agent-token` (admin token) gives a local agent a token of that channel.

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use converger_store::{Channel, TurnSettings};
use serde_json::{Value, json};

use super::tokens::token_json;
use crate::auth::AdminAuth;
use crate::error::ApiError;
use crate::state::AppState;
use crate::tokens::{Scope, anonymous_user_id};

/// The demo's tenant and channel names.
const DEMO_TENANT: &str = "converger-demo";
const DEMO_CHANNEL: &str = "demo";

/// The page: its glue script inline, the client from [`SDK_BUNDLE`] (the CSP allows nothing else).
const PAGE: &str = include_str!("demo.html");

/// The TypeScript SDK (`sdk/typescript`) bundled for browsers as the global `Converger`, written
/// by `npm run bundle-demo` there; its tests check that this copy is the current build.
const SDK_BUNDLE: &str = include_str!("demo-converger.js");

/// `GET /demo`.
pub(crate) async fn page(State(state): State<AppState>) -> Response {
    if !state.config.serves_demo() {
        return ApiError::not_found("page").into_response();
    }
    let headers = [
        (header::CONTENT_TYPE, "text/html; charset=utf-8"),
        (header::CACHE_CONTROL, "no-store"),
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'unsafe-inline'; \
             connect-src 'self' ws: wss:; frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
    ];
    (headers, PAGE).into_response()
}

/// `GET /demo/converger.js`: the SDK the page runs on.
pub(crate) async fn sdk_bundle(State(state): State<AppState>) -> Response {
    if !state.config.serves_demo() {
        return ApiError::not_found("page").into_response();
    }
    let headers = [
        (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
        (header::CACHE_CONTROL, "no-store"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    ];
    (headers, SDK_BUNDLE).into_response()
}

/// `POST /demo/api/conversation` → `{conversationId, userId, token, expires_in}`.
pub(crate) async fn conversation(
    State(state): State<AppState>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    if !state.config.serves_demo() {
        return Err(ApiError::not_found("page"));
    }
    let channel = demo_channel(&state).await?;
    state
        .throttles
        .conversation(channel.tenant_id, channel.id)
        .map_err(|over| {
            ApiError::rate_limited(
                format!("too many conversations for this {}", over.scope),
                over.retry_after,
            )
        })?;
    let user_id = anonymous_user_id();
    let conversation = state
        .store
        .create_conversation(channel.id, &user_id)
        .await?;
    let token = state.tokens.issue(
        channel.tenant_id,
        channel.id,
        Some(conversation.id),
        Some(user_id.clone()),
        Some(Scope::Conversation),
    )?;
    let mut body = token_json(&state, token);
    body["conversationId"] = json!(conversation.id);
    body["userId"] = json!(user_id);
    Ok((StatusCode::CREATED, Json(body)))
}

/// `POST /demo/api/agent-token` (admin token) → `{token, expires_in}` of the demo channel.
pub(crate) async fn agent_token(
    State(state): State<AppState>,
    _admin: AdminAuth,
) -> Result<Json<Value>, ApiError> {
    if !state.config.serves_demo() {
        return Err(ApiError::not_found("page"));
    }
    let channel = demo_channel(&state).await?;
    let token = state.tokens.issue(
        channel.tenant_id,
        channel.id,
        None,
        None,
        Some(Scope::Channel),
    )?;
    Ok(Json(token_json(&state, token)))
}

/// The demo channel, created on first use. Two first requests at once may create two; the
/// oldest wins from then on.
async fn demo_channel(state: &AppState) -> Result<Channel, ApiError> {
    if let Some(channel) = state
        .store
        .channel_by_names(DEMO_TENANT, DEMO_CHANNEL)
        .await?
    {
        return Ok(channel);
    }
    let (tenant, _) = state.store.create_tenant(DEMO_TENANT).await?;
    state
        .store
        .create_channel(tenant.id, DEMO_CHANNEL, &TurnSettings::default())
        .await?;
    state
        .store
        .channel_by_names(DEMO_TENANT, DEMO_CHANNEL)
        .await?
        .ok_or_else(ApiError::internal)
}
