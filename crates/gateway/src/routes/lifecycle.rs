//! Closing and reopening a conversation, and the tenant API over a tenant's conversations
//! (docs/protocol.md §6, ADR 0023).

use std::collections::HashMap;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use chrono::DateTime;
use converger_protocol::ErrorCode;
use converger_store::{
    Conversation, ConversationFilter, MAX_REASON_CHARS, StatusChange, Tenant, Transition,
};
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::body::parse_json;
use super::conversations::authorized_conversation;
use crate::auth::{TenantAuth, TenantOrToken};
use crate::error::ApiError;
use crate::state::AppState;
use crate::tokens::Scope;

/// Largest page of `GET /api/v1/conversations`.
const MAX_PAGE: i64 = 1000;
/// Page size when `limit` is absent.
const DEFAULT_PAGE: i64 = 100;
/// Grace of a replaced API key when the rotation names none (24 h).
const DEFAULT_KEY_GRACE_SECS: u64 = 24 * 3600;
/// Longest grace of a replaced API key (30 days).
const MAX_KEY_GRACE_SECS: u64 = 30 * 24 * 3600;

/// The tenant API's view of a conversation.
pub(crate) fn conversation_json(conversation: &Conversation) -> Value {
    json!({
        "id": conversation.id,
        "channelId": conversation.channel_id,
        "userId": conversation.user_id,
        "status": conversation.status,
        "lastSeq": conversation.last_seq,
        "createdAt": conversation.created_at.timestamp_millis(),
        "updatedAt": conversation.updated_at.timestamp_millis(),
    })
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct StatusRequest {
    #[serde(default)]
    reason: Option<String>,
}

/// `POST …/conversations/{id}/close`.
pub(crate) async fn close(
    state: State<AppState>,
    actor: TenantOrToken,
    id: Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    change(state, actor, id, body, StatusChange::Close).await
}

/// `POST …/conversations/{id}/reopen`.
pub(crate) async fn reopen(
    state: State<AppState>,
    actor: TenantOrToken,
    id: Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    change(state, actor, id, body, StatusChange::Reopen).await
}

/// Closes or reopens: 200 with the conversation and whether this call changed it (a repeat
/// changes nothing and appends no frame).
async fn change(
    State(state): State<AppState>,
    actor: TenantOrToken,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
    change: StatusChange,
) -> Result<Json<Value>, ApiError> {
    let request: StatusRequest = parse_json(body, true)?;
    let (conversation, default_reason) = match &actor {
        TenantOrToken::Tenant(tenant) => {
            (tenant_conversation(&state, tenant, &id).await?, "tenant")
        }
        TenantOrToken::Token(claims) => {
            let reason = match claims.scope() {
                Scope::Conversation => "user",
                Scope::Channel => "agent",
            };
            (authorized_conversation(&state, claims, &id).await?, reason)
        }
    };
    let reason = match request.reason.as_deref().map(str::trim) {
        None => default_reason,
        Some(reason) if reason.is_empty() || reason.chars().count() > MAX_REASON_CHARS => {
            return Err(ApiError::bad_request(format!(
                "reason must be 1-{MAX_REASON_CHARS} characters"
            )));
        }
        Some(reason) => reason,
    };
    let Some(Transition {
        conversation,
        frame,
        ..
    }) = crate::lifecycle::change_status(&state, conversation.id, change, reason).await?
    else {
        return Err(ApiError::conversation_not_found());
    };
    let mut answer = conversation_json(&conversation);
    answer["changed"] = json!(frame.is_some());
    answer["seq"] = json!(frame.map(|frame| frame.seq));
    Ok(Json(answer))
}

/// A conversation of the tenant; a foreign or malformed id answers like a missing one.
pub(super) async fn tenant_conversation(
    state: &AppState,
    tenant: &Tenant,
    raw_id: &str,
) -> Result<Conversation, ApiError> {
    let id = Uuid::parse_str(raw_id).map_err(|_| ApiError::conversation_not_found())?;
    state
        .store
        .conversation(id)
        .await?
        .filter(|conversation| conversation.tenant_id == tenant.id)
        .ok_or_else(ApiError::conversation_not_found)
}

/// `GET /api/v1/conversations/{id}` (API key) → the conversation.
pub(crate) async fn get(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let conversation = tenant_conversation(&state, &tenant, &id).await?;
    Ok(Json(conversation_json(&conversation)))
}

/// `GET /api/v1/conversations?status=&channelId=&userId=&updatedSince=&limit=&cursor=` (API
/// key) → `{conversations, nextCursor}`, by creation order; `nextCursor` is `null` on the last
/// page.
pub(crate) async fn list(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let given = |key: &str| query.get(key).map(String::as_str).filter(|v| !v.is_empty());
    let status = match given("status") {
        None => None,
        Some(status @ ("open" | "closed")) => Some(status.to_owned()),
        Some(_) => return Err(ApiError::bad_request("status must be open or closed")),
    };
    let uuid = |key: &str| -> Result<Option<Uuid>, ApiError> {
        given(key)
            .map(|raw| {
                Uuid::parse_str(raw)
                    .map_err(|_| ApiError::bad_request(format!("{key} must be a UUID")))
            })
            .transpose()
    };
    let channel_id = uuid("channelId")?;
    let after = uuid("cursor")?;
    let user_id = match given("userId") {
        Some(user) if user.len() > 128 || user.contains('\0') => {
            return Err(ApiError::bad_request("userId must be 1-128 bytes"));
        }
        user => user.map(str::to_owned),
    };
    let updated_since = given("updatedSince")
        .map(|raw| {
            raw.parse::<i64>()
                .ok()
                .filter(|ms| *ms >= 0)
                .and_then(DateTime::from_timestamp_millis)
                .ok_or_else(|| {
                    ApiError::bad_request("updatedSince must be a time in ms since the epoch")
                })
        })
        .transpose()?;
    let limit = match given("limit") {
        None => DEFAULT_PAGE,
        Some(raw) => raw
            .parse::<i64>()
            .ok()
            .filter(|limit| (1..=MAX_PAGE).contains(limit))
            .ok_or_else(|| {
                ApiError::bad_request(format!("limit must be between 1 and {MAX_PAGE}"))
            })?,
    };
    let filter = ConversationFilter {
        status,
        channel_id,
        user_id,
        updated_since,
        after,
    };
    // One extra row tells whether another page follows.
    let mut page = state
        .store
        .list_conversations(tenant.id, &filter, limit + 1)
        .await?;
    let more = page.len() as i64 > limit;
    page.truncate(limit as usize);
    let next_cursor = if more {
        page.last().map(|conversation| conversation.id)
    } else {
        None
    };
    let conversations: Vec<Value> = page.iter().map(conversation_json).collect();
    Ok(Json(
        json!({"conversations": conversations, "nextCursor": next_cursor}),
    ))
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RotateRequest {
    #[serde(default)]
    grace_secs: Option<u64>,
}

/// `POST /api/v1/api-keys/rotate` (the current API key) → `{apiKey, previousKeyExpiresAt}`:
/// the new key, shown once; the replaced one works until its grace ends.
pub(crate) async fn rotate_key(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let request: RotateRequest = parse_json(body, true)?;
    let grace_secs = request.grace_secs.unwrap_or(DEFAULT_KEY_GRACE_SECS);
    if grace_secs > MAX_KEY_GRACE_SECS {
        return Err(ApiError::bad_request(format!(
            "graceSecs must be between 0 and {MAX_KEY_GRACE_SECS}"
        )));
    }
    // TenantAuth checked the header is there.
    let presented = headers
        .get("x-api-key")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default();
    let Some((api_key, previous_expires)) = state
        .store
        .rotate_api_key(tenant.id, presented, grace_secs)
        .await?
    else {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::Forbidden,
            "only the current API key rotates; this one is in its grace period",
        ));
    };
    tracing::info!(tenant_id = %tenant.id, grace_secs, "api key rotated");
    Ok(Json(json!({
        "apiKey": api_key,
        "previousKeyExpiresAt": previous_expires.timestamp_millis(),
    })))
}
