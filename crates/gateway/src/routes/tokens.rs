//! Token issue and refresh.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use converger_protocol::ErrorCode;
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::body::parse_json;
use crate::auth::{ChannelSecretAuth, Scope, TokenAuth};
use crate::error::ApiError;
use crate::state::AppState;

/// Longest accepted user id, in bytes.
pub(crate) const MAX_USER_ID_BYTES: usize = 128;

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
    if user_id.is_empty() || user_id.len() > MAX_USER_ID_BYTES {
        return Err(ApiError::bad_request(format!(
            "user id must be 1-{MAX_USER_ID_BYTES} bytes"
        )));
    }
    Ok(user_id.to_owned())
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
    let scope = match request.scope.as_deref() {
        None => None,
        Some("conversation") => Some(Scope::Conversation),
        Some("channel") => Some(Scope::Channel),
        Some(_) => {
            return Err(ApiError::bad_request(
                "scope must be \"conversation\" or \"channel\"",
            ));
        }
    };
    let user_id = request
        .user
        .map(|user| checked_user_id(&user.id))
        .transpose()?;
    let conversation_id = match request.conversation_id {
        None => None,
        Some(_) if scope == Some(Scope::Channel) => {
            return Err(ApiError::bad_request(
                "a channel-scope token cannot name a conversation",
            ));
        }
        Some(raw) => {
            let id = Uuid::parse_str(&raw).map_err(|_| ApiError::conversation_not_found())?;
            let conversation = state.store.conversation(id).await?;
            let conversation = conversation
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
    let token = state.tokens.issue(
        channel.tenant_id,
        channel.id,
        conversation_id,
        user_id,
        scope,
    )?;
    Ok(Json(token_json(&state, token)))
}

/// `POST /api/v1/converger/tokens/refresh` (Bearer token): the same claims, a new expiry.
pub(crate) async fn refresh(
    State(state): State<AppState>,
    TokenAuth(claims): TokenAuth,
) -> Result<Json<Value>, ApiError> {
    let token = state.tokens.issue(
        claims.tenant_id,
        claims.channel_id,
        claims.conversation_id,
        claims.user_id,
        claims.scope,
    )?;
    Ok(Json(token_json(&state, token)))
}
