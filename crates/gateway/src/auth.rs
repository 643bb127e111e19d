//! Credentials: HS256 tokens, the admin token, tenant API keys and channel secrets.

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;
use converger_protocol::{ErrorCode, TOKEN_TYPE};
use converger_store::{Channel, Tenant, hash_secret};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::ApiError;
use crate::state::AppState;

/// What a token lets its bearer do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// An end user in one conversation.
    #[default]
    Conversation,
    /// An agent process serving every conversation of the channel.
    Channel,
}

/// The claims of a converger token (PROTOCOL section 1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    /// Always `converger`.
    #[serde(rename = "type")]
    pub token_type: String,
    /// Tenant of the channel.
    pub tenant_id: Uuid,
    /// Channel the token is for.
    pub channel_id: Uuid,
    /// Expiry, seconds since the Unix epoch.
    pub exp: i64,
    /// Issue time, seconds since the Unix epoch.
    pub iat: i64,
    /// The one conversation this token may use, when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversation_id: Option<Uuid>,
    /// The verified end-user id, when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_id: Option<String>,
    /// `conversation` (default) or `channel`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<Scope>,
}

impl Claims {
    /// The effective scope (absent means conversation).
    pub fn scope(&self) -> Scope {
        self.scope.unwrap_or_default()
    }
}

/// Why a token was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenRejection {
    /// Malformed, badly signed or not a converger token.
    Invalid,
    /// Well-formed and signed, but past `exp`.
    Expired,
}

/// Signs and verifies tokens with the node's secret key.
#[derive(Clone)]
pub struct TokenKeys {
    encoding: EncodingKey,
    decoding: DecodingKey,
    ttl_secs: i64,
}

impl std::fmt::Debug for TokenKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenKeys")
            .field("ttl_secs", &self.ttl_secs)
            .finish_non_exhaustive()
    }
}

impl TokenKeys {
    /// Keys from the shared secret; `ttl_secs` is the lifetime of issued tokens.
    pub fn new(secret: &[u8], ttl_secs: u64) -> Result<TokenKeys, jsonwebtoken::errors::Error> {
        Ok(TokenKeys {
            encoding: EncodingKey::from_secret(secret)?,
            decoding: DecodingKey::from_secret(secret)?,
            ttl_secs: i64::try_from(ttl_secs).unwrap_or(i64::MAX),
        })
    }

    /// Lifetime of issued tokens, in seconds.
    pub fn ttl_secs(&self) -> i64 {
        self.ttl_secs
    }

    /// Issues a token valid from now for the configured lifetime.
    pub fn issue(
        &self,
        tenant_id: Uuid,
        channel_id: Uuid,
        conversation_id: Option<Uuid>,
        user_id: Option<String>,
        scope: Option<Scope>,
    ) -> Result<String, ApiError> {
        let now = chrono::Utc::now().timestamp();
        let claims = Claims {
            token_type: TOKEN_TYPE.to_owned(),
            tenant_id,
            channel_id,
            exp: now + self.ttl_secs,
            iat: now,
            conversation_id,
            user_id,
            scope,
        };
        self.sign(&claims)
    }

    /// Signs the given claims as they are (tests use it to forge expired tokens).
    pub fn sign(&self, claims: &Claims) -> Result<String, ApiError> {
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), claims, &self.encoding).map_err(
            |error| {
                tracing::error!(%error, "token signing failed");
                ApiError::internal()
            },
        )
    }

    /// Verifies signature, expiry (no leeway) and the `type` claim.
    pub fn verify(&self, token: &str) -> Result<Claims, TokenRejection> {
        let mut validation = Validation::new(Algorithm::HS256);
        validation.leeway = 0;
        validation.set_required_spec_claims(&["exp"]);
        match jsonwebtoken::decode::<Claims>(token, &self.decoding, &validation) {
            Ok(data) if data.claims.token_type == TOKEN_TYPE => Ok(data.claims),
            Ok(_) => Err(TokenRejection::Invalid),
            Err(error)
                if matches!(
                    error.kind(),
                    jsonwebtoken::errors::ErrorKind::ExpiredSignature
                ) =>
            {
                Err(TokenRejection::Expired)
            }
            Err(_) => Err(TokenRejection::Invalid),
        }
    }
}

/// The bearer credential of a request, if any (scheme matched case-insensitively).
pub(crate) fn bearer(headers: &axum::http::HeaderMap) -> Option<&str> {
    let header = headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?;
    let (scheme, value) = header.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| value.trim())
        .filter(|value| !value.is_empty())
}

/// Compares secrets through their hashes so timing reveals nothing about the expected value.
pub(crate) fn secrets_match(given: &str, expected: &str) -> bool {
    hash_secret(given) == hash_secret(expected)
}

/// A request authenticated with the admin token.
#[derive(Debug)]
pub struct AdminAuth;

impl FromRequestParts<AppState> for AdminAuth {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let given =
            bearer(&parts.headers).ok_or_else(|| ApiError::unauthorized("admin token required"))?;
        if secrets_match(given, &state.admin_token) {
            return Ok(AdminAuth);
        }
        Err(ApiError::unauthorized("invalid admin token"))
    }
}

/// A request authenticated with a tenant API key (`x-api-key`).
#[derive(Debug)]
pub struct TenantAuth(pub Tenant);

impl FromRequestParts<AppState> for TenantAuth {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let api_key = parts
            .headers
            .get("x-api-key")
            .and_then(|value| value.to_str().ok())
            .filter(|value| !value.is_empty())
            .ok_or_else(|| ApiError::unauthorized("x-api-key required"))?;
        let tenant = state.store.tenant_by_api_key(api_key).await?;
        tenant
            .map(TenantAuth)
            .ok_or_else(|| ApiError::unauthorized("invalid api key"))
    }
}

/// A request authenticated with an active channel's secret (Bearer).
#[derive(Debug)]
pub struct ChannelSecretAuth(pub Channel);

impl FromRequestParts<AppState> for ChannelSecretAuth {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let secret = bearer(&parts.headers)
            .ok_or_else(|| ApiError::unauthorized("channel secret required"))?;
        let channel = state
            .store
            .channel_by_secret(secret)
            .await?
            .ok_or_else(|| ApiError::unauthorized("invalid channel secret"))?;
        if !channel.is_active() {
            return Err(ApiError::channel_inactive());
        }
        Ok(ChannelSecretAuth(channel))
    }
}

/// A request authenticated with a valid token of an active channel (Bearer).
#[derive(Debug)]
pub struct TokenAuth(pub Claims);

impl FromRequestParts<AppState> for TokenAuth {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let token = bearer(&parts.headers)
            .ok_or_else(|| ApiError::unauthorized("bearer token required"))?;
        let claims = state
            .tokens
            .verify(token)
            .map_err(|rejection| match rejection {
                TokenRejection::Expired => ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    ErrorCode::TokenExpired,
                    "token expired",
                ),
                TokenRejection::Invalid => ApiError::unauthorized("invalid token"),
            })?;
        let channel = state.store.channel(claims.channel_id).await?;
        match channel {
            Some(channel) if channel.tenant_id != claims.tenant_id => {
                Err(ApiError::unauthorized("invalid token"))
            }
            Some(channel) if !channel.is_active() => Err(ApiError::channel_inactive()),
            Some(_) => Ok(TokenAuth(claims)),
            None => Err(ApiError::unauthorized("invalid token")),
        }
    }
}
