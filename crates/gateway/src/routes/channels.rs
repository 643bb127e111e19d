//! Channels of the authenticated tenant.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use converger_core::policies::TurnPolicy;
use converger_store::{Channel, ChannelStatus, TurnSettings};
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
        "turnPolicy": channel.turn_policy,
        "turnPolicyOverrides": channel.turn_policy_overrides,
        "onDisconnect": channel.on_disconnect.as_deref().unwrap_or("continue"),
    })
}

/// The turn settings of a create or update body (ADR 0029): `turnPolicy` (a policy, or `null`
/// for the node's default), `turnPolicyOverrides` (the policies a send may ask for instead),
/// `onDisconnect` (`continue` or `cancel`). Absent fields are left as they are.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct TurnFields {
    #[serde(default, deserialize_with = "present")]
    turn_policy: Option<Option<String>>,
    #[serde(default)]
    turn_policy_overrides: Option<Vec<String>>,
    #[serde(default)]
    on_disconnect: Option<String>,
}

/// A field that is present, `null` included (`Some(None)`), apart from an absent one (`None`).
fn present<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(deserializer).map(Some)
}

impl TurnFields {
    fn is_empty(&self) -> bool {
        self.turn_policy.is_none()
            && self.turn_policy_overrides.is_none()
            && self.on_disconnect.is_none()
    }

    /// The checked settings; 400 for a name that is no policy or disconnect behaviour.
    fn settings(&self) -> Result<TurnSettings, ApiError> {
        let policy = |name: &String| {
            TurnPolicy::parse(name)
                .map(|policy| policy.as_str().to_owned())
                .ok_or_else(|| ApiError::bad_request(crate::policies::UNKNOWN_POLICY))
        };
        let turn_policy = match &self.turn_policy {
            None => None,
            Some(None) => Some(None),
            Some(Some(name)) => Some(Some(policy(name)?)),
        };
        let turn_policy_overrides = match &self.turn_policy_overrides {
            None => None,
            Some(names) => {
                let mut checked = names.iter().map(policy).collect::<Result<Vec<_>, _>>()?;
                checked.sort();
                checked.dedup();
                Some(checked)
            }
        };
        let on_disconnect = match self.on_disconnect.as_deref() {
            None => None,
            Some(behaviour @ ("continue" | "cancel")) => Some(Some(behaviour.to_owned())),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "onDisconnect must be \"continue\" or \"cancel\"",
                ));
            }
        };
        Ok(TurnSettings {
            turn_policy,
            turn_policy_overrides,
            on_disconnect,
        })
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct CreateChannel {
    name: String,
    #[serde(flatten)]
    turns: TurnFields,
}

/// `POST /api/v1/channels` → `{id, name, secret, status}`; the secret is shown only here.
pub(crate) async fn create(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let request: CreateChannel = parse_json(body, false)?;
    let name = checked_name(&request.name)?;
    let settings = request.turns.settings()?;
    let (channel, secret) = state
        .store
        .create_channel(tenant.id, name, &settings)
        .await?;
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
#[serde(rename_all = "camelCase")]
struct UpdateChannel {
    #[serde(default)]
    status: Option<String>,
    #[serde(flatten)]
    turns: TurnFields,
}

/// `PATCH /api/v1/channels/{id}` `{status?, turnPolicy?, turnPolicyOverrides?, onDisconnect?}`
/// (at least one); another tenant's channel is 404.
pub(crate) async fn update(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let channel_id = Uuid::parse_str(&id).map_err(|_| ApiError::not_found("channel"))?;
    let request: UpdateChannel = parse_json(body, false)?;
    if request.status.is_none() && request.turns.is_empty() {
        return Err(ApiError::bad_request(
            "nothing to change: give status, turnPolicy, turnPolicyOverrides or onDisconnect",
        ));
    }
    let status =
        match request.status.as_deref() {
            None => None,
            Some(status) => Some(ChannelStatus::parse(status).ok_or_else(|| {
                ApiError::bad_request("status must be \"active\" or \"inactive\"")
            })?),
        };
    let settings = request.turns.settings()?;
    let mut channel = None;
    if !request.turns.is_empty() {
        channel = state
            .store
            .set_turn_settings(tenant.id, channel_id, &settings)
            .await?;
    }
    if let Some(status) = status {
        channel = state
            .store
            .set_channel_status(tenant.id, channel_id, status)
            .await?;
    }
    let channel = channel.ok_or_else(|| ApiError::not_found("channel"))?;
    state.channel_turns.remember(
        channel.id,
        std::sync::Arc::new(crate::policies::ChannelTurns::of(
            &channel,
            &state.config.turns,
        )),
    );
    tracing::info!(tenant_id = %tenant.id, channel_id = %channel.id, status = %channel.status, "channel updated");
    if status == Some(ChannelStatus::Inactive) {
        // Close this node's sockets now; the other nodes hear it from the bus.
        state
            .hub
            .close_channel(channel.id, crate::bus::door::channel_inactive_close());
        if let Err(error) = state.bus.channel_status(channel.id, &channel.status).await {
            tracing::warn!(%error, channel_id = %channel.id, "channel deactivation not published to other nodes");
        }
    }
    Ok(Json(channel_json(&channel)))
}
