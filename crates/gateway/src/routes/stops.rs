//! `POST /api/v1/converger/conversations/{id}/stop`: stops the conversation's running turns
//! (ADR 0028), for an end user's token (or any token that may use the conversation, or the
//! tenant's API key). Idempotent: a repeat answers the same.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use converger_protocol::StopReason;
use serde::Deserialize;
use serde_json::{Value, json};

use super::body::parse_json;
use super::conversations::authorized_conversation;
use super::lifecycle::tenant_conversation;
use crate::auth::TenantOrToken;
use crate::error::ApiError;
use crate::state::AppState;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct StopRequest {
    /// The turn to stop; absent: every unanswered one.
    #[serde(default)]
    seq: Option<i64>,
}

/// Stops the turn: 200 `{stopped, seq}`; `seq` is the turn named, or the latest found (`null`
/// when none is running or stopping), `stopped` whether it is stopping now.
pub(crate) async fn stop(
    State(state): State<AppState>,
    actor: TenantOrToken,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let request: StopRequest = parse_json(body, true)?;
    if request.seq.is_some_and(|seq| seq < 1) {
        return Err(ApiError::bad_request("seq must be a positive integer"));
    }
    let conversation = match &actor {
        TenantOrToken::Tenant(tenant) => tenant_conversation(&state, tenant, &id).await?,
        TenantOrToken::Token(claims) => authorized_conversation(&state, claims, &id).await?,
    };
    stop_turns(&state, conversation.id, request.seq).await
}

/// Stops the conversation's turn at `seq`, or every unanswered one, as the REST answer
/// `{stopped, seq}` (shared with the chat frontends' stop routes).
pub(crate) async fn stop_turns(
    state: &AppState,
    conversation_id: uuid::Uuid,
    seq: Option<i64>,
) -> Result<Json<Value>, ApiError> {
    let outcome = crate::stops::stop(state, conversation_id, seq, StopReason::Stopped).await?;
    let (stopped, turn) = outcome
        .answer()
        .ok_or_else(|| ApiError::bad_request("no such turn"))?;
    Ok(Json(
        json!({"stopped": stopped, "seq": turn.map(|turn| turn.seq)}),
    ))
}
