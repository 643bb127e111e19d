//! `hello` → an end user's session in one conversation, an agent's session on the channel, or
//! the documented refusal.

use converger_protocol::{
    CloseCode, ErrorCode, ErrorFrame, Hello, Profile, is_valid_user_id, retry_close_reason,
};
use converger_store::Conversation;
use serde_json::json;
use uuid::Uuid;

use super::UpgradeRequest;
use crate::state::AppState;
use crate::tokens::{Claims, Scope, TokenRejection, anonymous_user_id};

/// What a hello establishes.
#[derive(Debug)]
pub(crate) enum Setup {
    /// An end user in one conversation.
    Conversation(Established),
    /// An agent serving the channel.
    Channel(AgentSetup),
}

/// A channel-scope session ready to start.
#[derive(Debug)]
pub(crate) struct AgentSetup {
    pub claims: Claims,
    /// The group joined, `None` for an observer.
    pub group: Option<String>,
    /// `hello.claim: "lease"`: each turn is claimed before delivery, answers carry its fence.
    pub lease: bool,
    pub hello: Hello,
}

/// A session ready to start.
#[derive(Debug)]
pub(crate) struct Established {
    pub profile: Profile,
    pub claims: Claims,
    pub conversation: Conversation,
    pub user_id: String,
    /// The client's watermark (0 when a new conversation was created for it).
    pub watermark: u64,
    pub hello: Hello,
}

/// A refused hello: the error to send and the close that follows, if any.
#[derive(Debug)]
pub(crate) struct Refused {
    pub error: ErrorFrame,
    pub close: Option<CloseCode>,
    /// The close reason, when not the error's code.
    pub reason: Option<String>,
}

impl Refused {
    fn new(code: ErrorCode, message: &str) -> Refused {
        Refused {
            error: ErrorFrame::new(code, message),
            close: code.close_code(),
            reason: None,
        }
    }

    fn closing(code: ErrorCode, message: &str, close: CloseCode) -> Refused {
        Refused {
            error: ErrorFrame::new(code, message),
            close: Some(close),
            reason: None,
        }
    }
}

/// Checks the profile, the credential and the channel, then adopts or creates the conversation.
pub(crate) async fn establish(
    state: &AppState,
    request: &UpgradeRequest,
    hello: Hello,
) -> Result<Setup, Refused> {
    let profile = Profile::from_hello(hello.protocol.as_deref())
        .map_err(|code| Refused::new(code, "unsupported protocol; use converger/1"))?;
    // First found wins: hello.token, ?token=, Authorization: Bearer.
    let token = hello
        .token
        .clone()
        .or_else(|| request.query_token.clone())
        .or_else(|| request.header_token.clone());
    let Some(token) = token else {
        return Err(Refused::new(ErrorCode::Unauthorized, "a token is required"));
    };
    let claims = match state.tokens.verify(&token) {
        Ok(claims) => claims,
        Err(rejection) => {
            let mut refused = Refused::new(ErrorCode::Unauthorized, "invalid or expired token");
            if rejection == TokenRejection::Expired {
                refused.error.details = Some(json!({"reason": "token_expired"}));
            }
            return Err(refused);
        }
    };
    // The conversation the hello asserts, parsed once: `Some(None)` when its id is malformed.
    let asserted_conversation = hello
        .conversation_id
        .as_deref()
        .or(request.conversation_id.as_deref())
        .map(|raw| Uuid::parse_str(raw).ok());
    // The conversation an end user's hello names, read with the channel in one statement: the
    // token's, else the one asserted (adopted below if the token may use it).
    let named_id = match claims.scope() {
        Scope::Channel => None,
        Scope::Conversation => claims.conversation_id.or(asserted_conversation.flatten()),
    };
    let found = state
        .store
        .channel_with_conversation(claims.channel_id, named_id)
        .await
        .map_err(internal)?;
    let named_conversation = match found {
        Some((channel, conversation))
            if channel.tenant_id == claims.tenant_id && channel.is_active() =>
        {
            conversation
        }
        Some((channel, _)) if channel.tenant_id == claims.tenant_id => {
            return Err(Refused::new(
                ErrorCode::ChannelInactive,
                "channel is inactive",
            ));
        }
        _ => return Err(Refused::new(ErrorCode::Unauthorized, "invalid token")),
    };
    if claims.scope() == Scope::Channel {
        let group = match &hello.group {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(group)) if converger_protocol::is_valid_group(group) => {
                Some(group.clone())
            }
            Some(_) => {
                return Err(Refused::closing(
                    ErrorCode::BadRequest,
                    "group must be 1-64 characters of A-Za-z0-9._:-",
                    CloseCode::Protocol,
                ));
            }
        };
        let lease = match hello.claim.as_deref() {
            None => false,
            Some("lease") if group.is_some() => true,
            Some("lease") => {
                return Err(Refused::closing(
                    ErrorCode::BadRequest,
                    "claim \"lease\" needs a group: observers own no turns",
                    CloseCode::Protocol,
                ));
            }
            Some(_) => {
                return Err(Refused::closing(
                    ErrorCode::BadRequest,
                    "claim must be \"lease\" or absent",
                    CloseCode::Protocol,
                ));
            }
        };
        return Ok(Setup::Channel(AgentSetup {
            claims,
            group,
            lease,
            hello,
        }));
    }
    let asserted_watermark = hello.watermark.or(request.watermark).unwrap_or(0);
    let asserted_user = hello
        .user_id
        .clone()
        .or_else(|| request.user_id.clone())
        .filter(|user| is_valid_user_id(user));

    if claims.conversation_id.is_some() {
        let conversation = named_conversation.ok_or_else(|| {
            Refused::closing(
                ErrorCode::ConversationNotFound,
                "conversation not found",
                CloseCode::Protocol,
            )
        })?;
        let user_id = claims
            .user_id
            .clone()
            .unwrap_or_else(|| conversation.user_id.clone());
        if user_id != conversation.user_id {
            return Err(Refused::closing(
                ErrorCode::Forbidden,
                "the token's user does not own this conversation",
                CloseCode::Auth,
            ));
        }
        // A watermark asserted for another conversation means nothing in this one.
        let asked_for_another =
            asserted_conversation.is_some_and(|asked| asked != Some(conversation.id));
        let watermark = if asked_for_another {
            0
        } else {
            asserted_watermark
        };
        return Ok(Setup::Conversation(Established {
            profile,
            claims,
            conversation,
            user_id,
            watermark,
            hello,
        }));
    }

    // The asserted conversation, when it belongs to the token's channel (it was read with the
    // channel) and the identity rule lets the token use it.
    let adopted = named_conversation.filter(|conversation| {
        claims.may_use(
            conversation.id,
            &conversation.user_id,
            asserted_user.as_deref(),
        )
    });
    if let Some(adopted) = adopted {
        let user_id = adopted.user_id.clone();
        return Ok(Setup::Conversation(Established {
            profile,
            claims,
            conversation: adopted,
            user_id,
            watermark: asserted_watermark,
            hello,
        }));
    }

    // The token's user, else a new anonymous one: an asserted userId never names the user
    // (a mekik widget sends the one it was configured with; it cannot read a refusal).
    let user_id = claims.user_id.clone().unwrap_or_else(anonymous_user_id);
    if let Err(over) = state
        .throttles
        .conversation(claims.tenant_id, claims.channel_id)
    {
        // Not the client's fault: it may come back after the hint (1012, like a drain).
        let retry_after_ms = u64::try_from(over.retry_after.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        return Err(Refused {
            error: ErrorFrame {
                retry_after_ms: Some(retry_after_ms),
                ..ErrorFrame::new(
                    ErrorCode::RateLimited,
                    format!("too many conversations created for this {}", over.scope),
                )
            },
            close: Some(CloseCode::Draining),
            reason: Some(converger_protocol::retry_close_reason(
                ErrorCode::RateLimited,
                retry_after_ms,
            )),
        });
    }
    let conversation = state
        .store
        .create_conversation(claims.channel_id, &user_id)
        .await
        .map_err(internal)?;
    // The client asked for another conversation (or none): its watermark means nothing here.
    Ok(Setup::Conversation(Established {
        profile,
        claims,
        conversation,
        user_id,
        watermark: 0,
        hello,
    }))
}

/// A store failure during the handshake: `unavailable` with a hint and close 1012 when no
/// database answers (it may be failing over), else `internal` and close 1011.
fn internal(error: converger_store::StoreError) -> Refused {
    if error.is_unavailable() {
        tracing::warn!(%error, "handshake: database unavailable");
        return Refused {
            error: crate::error::error_frame(ErrorCode::Unavailable, "database unavailable; retry"),
            close: Some(CloseCode::Draining),
            reason: Some(retry_close_reason(
                ErrorCode::Unavailable,
                crate::error::unavailable_retry_ms(),
            )),
        };
    }
    tracing::error!(%error, "handshake: store error");
    Refused::closing(ErrorCode::Internal, "internal error", CloseCode::Internal)
}
