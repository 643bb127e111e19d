//! Request credentials: the admin token, tenant API keys, channel secrets and converger tokens,
//! as axum extractors that answer the documented 401/403 when they do not hold.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::StatusCode;
use axum::http::request::Parts;
use converger_protocol::ErrorCode;
use converger_store::{Channel, Tenant, hash_secret};

use crate::error::ApiError;
use crate::state::AppState;
use crate::tokens::{Claims, TokenRejection};

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

/// The client address of a request (the TCP peer; a proxy in front is the client).
pub(crate) fn client_address(parts: &Parts) -> IpAddr {
    parts
        .extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |info| info.0.ip())
}

/// Checks an admin credential from `address`: 429 while the address is throttled for earlier
/// failures, 401 (counted and logged) when `given` is not the admin token.
pub(crate) fn check_admin(
    state: &AppState,
    address: IpAddr,
    given: Option<&str>,
) -> Result<(), ApiError> {
    if let Some(wait) = state.throttles.admin_throttled(address) {
        return Err(ApiError::rate_limited(
            "too many failed admin authentications from this address",
            wait,
        ));
    }
    match given {
        Some(given) if secrets_match(given, &state.admin_token) => Ok(()),
        Some(_) => {
            state.throttles.admin_failed(address, "invalid admin token");
            Err(ApiError::unauthorized("invalid admin token"))
        }
        None => {
            state.throttles.admin_failed(address, "no admin token");
            Err(ApiError::unauthorized("admin token required"))
        }
    }
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
        check_admin(state, client_address(parts), bearer(&parts.headers))?;
        Ok(AdminAuth)
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
        verified_claims(state, token).await.map(TokenAuth)
    }
}

/// The claims of a valid token of an active channel of its tenant, or the documented refusal.
pub(crate) async fn verified_claims(state: &AppState, token: &str) -> Result<Claims, ApiError> {
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
        Some(_) => Ok(claims),
        None => Err(ApiError::unauthorized("invalid token")),
    }
}

/// A request authenticated with a tenant API key (`x-api-key`, when present) or else a token
/// (Bearer): the routes both a tenant's backend and an end user may call.
#[derive(Debug)]
pub enum TenantOrToken {
    /// The tenant's API key.
    Tenant(Tenant),
    /// A token, checked as [`TokenAuth`] does.
    Token(Claims),
}

impl FromRequestParts<AppState> for TenantOrToken {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        if parts.headers.contains_key("x-api-key") {
            let TenantAuth(tenant) = TenantAuth::from_request_parts(parts, state).await?;
            return Ok(TenantOrToken::Tenant(tenant));
        }
        let TokenAuth(claims) = TokenAuth::from_request_parts(parts, state).await?;
        Ok(TenantOrToken::Token(claims))
    }
}
