//! Token issue and refresh.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use converger_protocol::{ErrorCode, MAX_USER_ID_BYTES};
use converger_store::{Channel, Store};
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::body::parse_json;
use crate::auth::{ChannelSecretAuth, TokenAuth};
use crate::error::ApiError;
use crate::state::AppState;
use crate::tokens::{Scope, TokenKeys};

#[derive(Deserialize, Default)]
struct UserRef {
    id: String,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct GenerateRequest {
    #[serde(default)]
    user: Option<UserRef>,
    #[serde(default)]
    scope: Option<String>,
    #[serde(default)]
    conversation_id: Option<String>,
}

/// Checks a user id's length.
pub(crate) fn checked_user_id(user_id: &str) -> Result<String, ApiError> {
    if !converger_protocol::is_valid_user_id(user_id) {
        return Err(ApiError::bad_request(format!(
            "user id must be 1-{MAX_USER_ID_BYTES} bytes"
        )));
    }
    Ok(user_id.to_owned())
}

/// Counts a token about to be issued against the channel's and the tenant's rates.
fn count_token(state: &AppState, tenant_id: Uuid, channel_id: Uuid) -> Result<(), ApiError> {
    state
        .throttles
        .token(tenant_id, channel_id)
        .map_err(|over| {
            ApiError::rate_limited(
                format!("too many tokens issued for this {}", over.scope),
                over.retry_after,
            )
        })
}

/// The `{token, expires_in}` answer.
pub(crate) fn token_json(state: &AppState, token: String) -> Value {
    json!({"token": token, "expires_in": state.tokens.ttl_secs()})
}

/// `POST /api/v1/converger/tokens/generate` (Bearer channel secret).
pub(crate) async fn generate(
    State(state): State<AppState>,
    ChannelSecretAuth(channel): ChannelSecretAuth,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let request: GenerateRequest = parse_json(body, true)?;
    count_token(&state, channel.tenant_id, channel.id)?;
    let grant = TokenGrant {
        user_id: request.user.map(|user| user.id),
        scope: request.scope,
        conversation_id: request.conversation_id,
    };
    let token = issue_for_channel(&state.store, &state.tokens, &channel, grant).await?;
    Ok(Json(token_json(&state, token)))
}

/// What a channel-secret holder (REST) or an operator (CLI) asks a token for.
#[derive(Debug, Clone, Default)]
pub struct TokenGrant {
    /// Verified end-user id.
    pub user_id: Option<String>,
    /// `conversation` (default) or `channel`.
    pub scope: Option<String>,
    /// Bind the token to this conversation of the channel.
    pub conversation_id: Option<String>,
}

/// Checks a grant against the channel and signs the token: the one rule set behind
/// `tokens/generate` and `converger token issue`.
pub async fn issue_for_channel(
    store: &Store,
    keys: &TokenKeys,
    channel: &Channel,
    grant: TokenGrant,
) -> Result<String, ApiError> {
    let scope = match grant.scope.as_deref() {
        None => None,
        Some("conversation") => Some(Scope::Conversation),
        Some("channel") => Some(Scope::Channel),
        Some(_) => {
            return Err(ApiError::bad_request(
                "scope must be \"conversation\" or \"channel\"",
            ));
        }
    };
    let user_id = grant.user_id.as_deref().map(checked_user_id).transpose()?;
    let conversation_id = match grant.conversation_id {
        None => None,
        Some(_) if scope == Some(Scope::Channel) => {
            return Err(ApiError::bad_request(
                "a channel-scope token cannot name a conversation",
            ));
        }
        Some(raw) => {
            let id = Uuid::parse_str(&raw).map_err(|_| ApiError::conversation_not_found())?;
            let conversation = store
                .conversation(id)
                .await?
                .filter(|conversation| conversation.channel_id == channel.id)
                .ok_or_else(ApiError::conversation_not_found)?;
            if user_id
                .as_ref()
                .is_some_and(|user| *user != conversation.user_id)
            {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    ErrorCode::Forbidden,
                    "the conversation belongs to another user",
                ));
            }
            Some(conversation.id)
        }
    };
    keys.issue(
        channel.tenant_id,
        channel.id,
        conversation_id,
        user_id,
        scope,
    )
}

/// `POST /api/v1/converger/tokens/refresh` (Bearer token): the same claims, a new expiry.
pub(crate) async fn refresh(
    State(state): State<AppState>,
    TokenAuth(claims): TokenAuth,
) -> Result<Json<Value>, ApiError> {
    count_token(&state, claims.tenant_id, claims.channel_id)?;
    let token = state.tokens.issue(
        claims.tenant_id,
        claims.channel_id,
        claims.conversation_id,
        claims.user_id,
        claims.scope,
    )?;
    Ok(Json(token_json(&state, token)))
}
