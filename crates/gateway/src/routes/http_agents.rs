//! HTTP agent groups of a channel (ADR 0031, docs/agents.md §17): create, list, read, change and
//! delete them, and read, retry or drop their dead letters. The tenant's API key authenticates;
//! another tenant's channel is 404; a URL outside `http_agents.allow` is 403; the secret is
//! never listed back.

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use converger_protocol::{ErrorCode, is_valid_group};
use converger_store::{DeadLetter, HttpAgent, HttpAgentSettings};
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::body::parse_json;
use crate::auth::TenantAuth;
use crate::error::ApiError;
use crate::state::AppState;

/// Defaults of a group created without them.
const DEFAULT_TIMEOUT_MS: i32 = 60_000;
const DEFAULT_MAX_CONCURRENCY: i32 = 16;
const DEFAULT_ATTEMPTS: i32 = 3;
const DEFAULT_BACKOFF_MS: i32 = 500;
/// Bounds of a group's settings.
const MAX_TIMEOUT_MS: i32 = 600_000;
const MAX_CONCURRENCY: i32 = 1_024;
const MAX_ATTEMPTS: i32 = 10;
const MAX_BACKOFF_MS: i32 = 60_000;
/// The longest secret, in bytes.
const MAX_SECRET_BYTES: usize = 256;
/// Dead letters per page.
const MAX_DEAD_LETTERS: i64 = 1_000;

/// `retry` of a create or update body.
#[derive(Deserialize, Default, Clone, Copy)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RetryFields {
    attempts: Option<i32>,
    backoff_ms: Option<i32>,
}

/// A create body; an update body has the same fields, all optional (`secret: null` removes
/// the secret).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GroupFields {
    #[serde(default)]
    group: Option<String>,
    #[serde(default)]
    url: Option<String>,
    #[serde(default, deserialize_with = "present")]
    secret: Option<Option<String>>,
    #[serde(default)]
    timeout_ms: Option<i32>,
    #[serde(default)]
    max_concurrency: Option<i32>,
    #[serde(default)]
    retry: Option<RetryFields>,
}

/// A field that is present, `null` included (`Some(None)`), apart from an absent one (`None`).
fn present<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Option<String>>, D::Error> {
    Option::<String>::deserialize(deserializer).map(Some)
}

impl GroupFields {
    /// The settings these fields make over `base`, checked.
    fn settings(
        &self,
        state: &AppState,
        base: HttpAgentSettings,
    ) -> Result<HttpAgentSettings, ApiError> {
        let retry = self.retry.unwrap_or_default();
        let settings = HttpAgentSettings {
            url: self.url.clone().unwrap_or(base.url),
            secret: self.secret.clone().unwrap_or(base.secret),
            timeout_ms: self.timeout_ms.unwrap_or(base.timeout_ms),
            max_concurrency: self.max_concurrency.unwrap_or(base.max_concurrency),
            retry_attempts: retry.attempts.unwrap_or(base.retry_attempts),
            retry_backoff_ms: retry.backoff_ms.unwrap_or(base.retry_backoff_ms),
        };
        check_http_agent(&state.config.http_agents, &settings)?;
        Ok(settings)
    }
}

/// Checks a group's settings as every way of storing one must: the bounds, the secret's
/// length, and the URL under the operator's `http_agents.allow` (403 otherwise).
pub fn check_http_agent(
    config: &crate::config::HttpAgentsConfig,
    settings: &HttpAgentSettings,
) -> Result<(), ApiError> {
    let within = |value: i32, low: i32, high: i32, name: &str| {
        if (low..=high).contains(&value) {
            Ok(())
        } else {
            Err(ApiError::bad_request(format!(
                "{name} must be between {low} and {high}"
            )))
        }
    };
    within(settings.timeout_ms, 100, MAX_TIMEOUT_MS, "timeoutMs")?;
    within(
        settings.max_concurrency,
        1,
        MAX_CONCURRENCY,
        "maxConcurrency",
    )?;
    within(settings.retry_attempts, 1, MAX_ATTEMPTS, "retry.attempts")?;
    within(
        settings.retry_backoff_ms,
        0,
        MAX_BACKOFF_MS,
        "retry.backoffMs",
    )?;
    if let Some(secret) = &settings.secret
        && (secret.is_empty() || secret.len() > MAX_SECRET_BYTES)
    {
        return Err(ApiError::bad_request(format!(
            "secret must be 1-{MAX_SECRET_BYTES} bytes"
        )));
    }
    if crate::http_agents::url_parts(&settings.url).is_none() {
        return Err(ApiError::bad_request(
            "url must be an http or https URL with a host and no user info",
        ));
    }
    if !crate::http_agents::is_allowed(config, &settings.url) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::Forbidden,
            "url is not under the operator's allowlist (http_agents.allow)",
        ));
    }
    Ok(())
}

/// Checks a group name: the group shape of agent connections, and not `dead-letters` (the
/// route of the letters).
pub fn check_group_name(group: &str) -> Result<(), ApiError> {
    if is_valid_group(group) && group != "dead-letters" {
        return Ok(());
    }
    Err(ApiError::bad_request(
        "group is required: 1-64 characters of [A-Za-z0-9._:-], not \"dead-letters\"",
    ))
}

/// The public view of a group: never its secret.
pub fn group_json(agent: &HttpAgent) -> Value {
    json!({
        "channelId": agent.channel_id,
        "group": agent.group_name,
        "url": agent.url,
        "hasSecret": agent.secret.is_some(),
        "timeoutMs": agent.timeout_ms,
        "maxConcurrency": agent.max_concurrency,
        "retry": {"attempts": agent.retry_attempts, "backoffMs": agent.retry_backoff_ms},
        "createdAt": agent.created_at.timestamp_millis(),
        "updatedAt": agent.updated_at.timestamp_millis(),
    })
}

pub fn dead_letter_json(letter: &DeadLetter) -> Value {
    json!({
        "conversationId": letter.conversation_id,
        "seq": letter.seq,
        "revision": letter.revision,
        "group": letter.group_name,
        "url": letter.url,
        "attempts": letter.attempts,
        "error": letter.error,
        "failedAt": letter.failed_at.timestamp_millis(),
    })
}

/// The channel `id` of the authenticated tenant; 404 for any other.
async fn own_channel(state: &AppState, tenant_id: Uuid, id: &str) -> Result<Uuid, ApiError> {
    let channel_id = Uuid::parse_str(id).map_err(|_| ApiError::not_found("channel"))?;
    match state.store.channel(channel_id).await? {
        Some(channel) if channel.tenant_id == tenant_id => Ok(channel_id),
        _ => Err(ApiError::not_found("channel")),
    }
}

/// `POST /api/v1/channels/{id}/http-agents` → 201 with the group; 409 when the channel has an
/// HTTP agent group of that name.
pub(crate) async fn create(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let channel_id = own_channel(&state, tenant.id, &id).await?;
    let fields: GroupFields = parse_json(body, false)?;
    let group = fields.group.clone().unwrap_or_default();
    check_group_name(&group)?;
    if fields.url.is_none() {
        return Err(ApiError::bad_request("url is required"));
    }
    let base = HttpAgentSettings {
        url: String::new(),
        secret: None,
        timeout_ms: DEFAULT_TIMEOUT_MS,
        max_concurrency: DEFAULT_MAX_CONCURRENCY,
        retry_attempts: DEFAULT_ATTEMPTS,
        retry_backoff_ms: DEFAULT_BACKOFF_MS,
    };
    let settings = fields.settings(&state, base)?;
    let agent = state
        .store
        .create_http_agent(channel_id, &group, &settings)
        .await?
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::BadRequest,
                "the channel already has an HTTP agent group of that name",
            )
        })?;
    tracing::info!(%channel_id, group, url = %crate::http_agents::url_label(&agent.url), "http agent group created");
    Ok((StatusCode::CREATED, Json(group_json(&agent))))
}

/// `GET /api/v1/channels/{id}/http-agents` → `{httpAgents: [...]}`.
pub(crate) async fn list(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let channel_id = own_channel(&state, tenant.id, &id).await?;
    let agents = state.store.http_agents(Some(channel_id)).await?;
    let views: Vec<Value> = agents.iter().map(group_json).collect();
    Ok(Json(json!({"httpAgents": views})))
}

/// `GET /api/v1/channels/{id}/http-agents/{group}`.
pub(crate) async fn get(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    Path((id, group)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let channel_id = own_channel(&state, tenant.id, &id).await?;
    let agent = state
        .store
        .http_agent(channel_id, &group)
        .await?
        .ok_or_else(|| ApiError::not_found("HTTP agent group"))?;
    Ok(Json(group_json(&agent)))
}

/// `PATCH /api/v1/channels/{id}/http-agents/{group}`: the fields given change (`group` may not).
pub(crate) async fn update(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    Path((id, group)): Path<(String, String)>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let channel_id = own_channel(&state, tenant.id, &id).await?;
    let fields: GroupFields = parse_json(body, false)?;
    if fields.group.as_ref().is_some_and(|name| *name != group) {
        return Err(ApiError::bad_request("a group cannot be renamed"));
    }
    let current = state
        .store
        .http_agent(channel_id, &group)
        .await?
        .ok_or_else(|| ApiError::not_found("HTTP agent group"))?;
    let base = HttpAgentSettings {
        url: current.url,
        secret: current.secret,
        timeout_ms: current.timeout_ms,
        max_concurrency: current.max_concurrency,
        retry_attempts: current.retry_attempts,
        retry_backoff_ms: current.retry_backoff_ms,
    };
    let settings = fields.settings(&state, base)?;
    let agent = state
        .store
        .update_http_agent(channel_id, &group, &settings)
        .await?
        .ok_or_else(|| ApiError::not_found("HTTP agent group"))?;
    tracing::info!(%channel_id, group, url = %crate::http_agents::url_label(&agent.url), "http agent group updated");
    Ok(Json(group_json(&agent)))
}

/// `DELETE /api/v1/channels/{id}/http-agents/{group}` → 204.
pub(crate) async fn delete(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    Path((id, group)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    let channel_id = own_channel(&state, tenant.id, &id).await?;
    if !state.store.delete_http_agent(channel_id, &group).await? {
        return Err(ApiError::not_found("HTTP agent group"));
    }
    tracing::info!(%channel_id, group, "http agent group deleted");
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
pub(crate) struct DeadLetterPage {
    #[serde(default)]
    limit: Option<i64>,
}

/// `GET /api/v1/channels/{id}/http-agents/dead-letters?limit=` → `{deadLetters: [...]}`,
/// oldest first.
pub(crate) async fn dead_letters(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    Path(id): Path<String>,
    query: Result<Query<DeadLetterPage>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let channel_id = own_channel(&state, tenant.id, &id).await?;
    let Query(page) = query.map_err(|_| ApiError::bad_request("limit must be a number"))?;
    let limit = page.limit.unwrap_or(100);
    if !(1..=MAX_DEAD_LETTERS).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "limit must be between 1 and {MAX_DEAD_LETTERS}"
        )));
    }
    let letters = state.store.dead_letters(channel_id, limit).await?;
    let views: Vec<Value> = letters.iter().map(dead_letter_json).collect();
    Ok(Json(json!({"deadLetters": views})))
}

/// Which dead letter a retry or a drop names.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct LetterKey {
    conversation_id: Uuid,
    seq: i64,
    #[serde(default)]
    revision: i32,
    group: String,
}

/// The tenant's channel `id` and the dead letter the body names.
async fn letter_key(
    state: &AppState,
    tenant_id: Uuid,
    id: &str,
    body: Result<Bytes, BytesRejection>,
) -> Result<(Uuid, LetterKey), ApiError> {
    let channel_id = own_channel(state, tenant_id, id).await?;
    let key = parse_json(body, false)?;
    Ok((channel_id, key))
}

/// `POST /api/v1/channels/{id}/http-agents/dead-letters/retry` `{conversationId, seq, revision,
/// group}` → 202: the turn is pending again and this node calls the group once more (one call
/// however many retries are posted at once); 404 when there is no such letter.
pub(crate) async fn retry(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let (channel_id, key) = letter_key(&state, tenant.id, &id, body).await?;
    let agent = state
        .store
        .http_agent(channel_id, &key.group)
        .await?
        .ok_or_else(|| ApiError::not_found("HTTP agent group"))?;
    if !crate::http_agents::is_allowed(&state.config.http_agents, &agent.url) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::Forbidden,
            "the group's url is no longer under the operator's allowlist (http_agents.allow)",
        ));
    }
    if !crate::http_agents::calls_out(&state) {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Unavailable,
            "this node does not call HTTP agents",
        ));
    }
    let letter = state
        .store
        .take_dead_letter(
            channel_id,
            key.conversation_id,
            key.seq,
            key.revision,
            &key.group,
        )
        .await?
        .ok_or_else(|| ApiError::not_found("dead letter"))?;
    tracing::info!(%channel_id, group = key.group, conversation_id = %key.conversation_id, seq = key.seq, "dead letter retried");
    if let Err(error) = crate::http_agents::retry(&state, agent, &letter).await {
        // Nothing will call: the turn fails again and its letter is back.
        if let Err(restore) = state.store.fail_turn(&letter).await {
            tracing::error!(%restore, "dead letter not restored after a failed retry");
        }
        return Err(error);
    }
    Ok((StatusCode::ACCEPTED, Json(dead_letter_json(&letter))))
}

/// `POST /api/v1/channels/{id}/http-agents/dead-letters/drop` `{conversationId, seq, revision,
/// group}` → 204: the letter goes, the turn stays `failed`.
pub(crate) async fn drop_letter(
    State(state): State<AppState>,
    TenantAuth(tenant): TenantAuth,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, ApiError> {
    let (channel_id, key) = letter_key(&state, tenant.id, &id, body).await?;
    let dropped = state
        .store
        .drop_dead_letter(
            channel_id,
            key.conversation_id,
            key.seq,
            key.revision,
            &key.group,
        )
        .await?;
    if !dropped {
        return Err(ApiError::not_found("dead letter"));
    }
    Ok(StatusCode::NO_CONTENT)
}
