//! Channels of the authenticated tenant.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use converger_store::{Channel, ChannelStatus};
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::body::parse_json;
use crate::auth::TenantAuth;
use crate::error::ApiError;
use crate::state::AppState;

/// Longest tenant or channel name, in characters.
const MAX_NAME_CHARS: usize = 200;

/// Trims a display name and checks its length.
pub(crate) fn checked_name(name: &str) -> Result<&str, ApiError> {
    let name = name.trim();
    if name.is_empty() || name.chars().count() > MAX_NAME_CHARS || name.contains('\0') {
        return Err(ApiError::bad_request(format!(
            "name must be 1-{MAX_NAME_CHARS} characters"
        )));
    }
    Ok(name)
}

/// The public view of a channel.
pub(crate) fn channel_json(channel: &Channel) -> Value {
    json!({
        "id": channel.id,
        "name": channel.name,
        "status": channel.status,
        "createdAt": channel.created_at.timestamp_millis(),
    })
}

#[derive(Deserialize)]
struct CreateChannel {
    name: String,
}

/// `POST /api/v1/channels` → `{id, name, secret, status}`; the secret is shown only here.
pub(crate) async fn create(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let request: CreateChannel = parse_json(body, false)?;
    let name = checked_name(&request.name)?;
    let (channel, secret) = state.store.create_channel(tenant.id, name).await?;
    tracing::info!(tenant_id = %tenant.id, channel_id = %channel.id, "channel created");
    let mut view = channel_json(&channel);
    view["secret"] = Value::String(secret);
    Ok((StatusCode::CREATED, Json(view)))
}

/// `GET /api/v1/channels` → `{channels: [...]}` of this tenant only.
pub(crate) async fn list(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
) -> Result<Json<Value>, ApiError> {
    let channels = state.store.list_channels(tenant.id).await?;
    let views: Vec<Value> = channels.iter().map(channel_json).collect();
    Ok(Json(json!({"channels": views})))
}

#[derive(Deserialize)]
struct UpdateChannel {
    status: String,
}

/// `PATCH /api/v1/channels/{id}` `{status}`; another tenant's channel is 404.
pub(crate) async fn update(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let channel_id = Uuid::parse_str(&id).map_err(|_| ApiError::not_found("channel"))?;
    let request: UpdateChannel = parse_json(body, false)?;
    let status = ChannelStatus::parse(&request.status)
        .ok_or_else(|| ApiError::bad_request("status must be \"active\" or \"inactive\""))?;
    let channel = state
        .store
        .set_channel_status(tenant.id, channel_id, status)
        .await?
        .ok_or_else(|| ApiError::not_found("channel"))?;
    tracing::info!(tenant_id = %tenant.id, channel_id = %channel.id, status = status.as_str(), "channel updated");
    if status == ChannelStatus::Inactive {
        // Close this node's sockets now; the other nodes hear it from the bus.
        state
            .hub
            .close_channel(channel.id, crate::bus_bridge::channel_inactive_close());
        if let Err(error) = state
            .store
            .publish_channel_status(state.hub.node_id(), channel.id, status.as_str())
            .await
        {
            tracing::warn!(%error, channel_id = %channel.id, "channel deactivation not published to other nodes");
        }
    }
    Ok(Json(channel_json(&channel)))
}
