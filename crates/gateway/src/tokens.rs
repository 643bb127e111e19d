//! Converger tokens: HS256 JWTs naming a tenant, a channel and, optionally, a conversation and a
//! verified user (docs/protocol.md §1). Signing and verification only; the request extractors
//! that use them are in `auth.rs`.

use converger_protocol::TOKEN_TYPE;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::error::ApiError;

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

/// The claims of a converger token (docs/protocol.md §1).
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

    /// The identity rule of conversation-scope tokens (ADR 0013): whether this token may join,
    /// read and write the conversation of `conversation_id`, whose user is `conversation_user`.
    /// A token bound to a conversation uses that one; a token naming a user uses that user's;
    /// a token naming nobody uses only an anonymous conversation, and only when the client
    /// presents its anonymous user id (`presented_user`, 122 random bits the server gave it).
    /// No token ever acts as a user it does not name.
    pub fn may_use(
        &self,
        conversation_id: Uuid,
        conversation_user: &str,
        presented_user: Option<&str>,
    ) -> bool {
        match (self.conversation_id, self.user_id.as_deref()) {
            (Some(bound), user) => {
                bound == conversation_id && user.is_none_or(|user| user == conversation_user)
            }
            (None, Some(user)) => user == conversation_user,
            (None, None) => {
                is_anonymous_user(conversation_user) && presented_user == Some(conversation_user)
            }
        }
    }
}

/// Prefix of the user ids the server gives end users whose token names none.
const ANONYMOUS_PREFIX: &str = "anon-";

/// A fresh anonymous user id: `anon-` and 32 hex digits of a random UUID.
pub fn anonymous_user_id() -> String {
    format!("{ANONYMOUS_PREFIX}{}", Uuid::new_v4().simple())
}

/// True for a user id the server gave an anonymous end user.
pub fn is_anonymous_user(user_id: &str) -> bool {
    user_id.starts_with(ANONYMOUS_PREFIX)
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
