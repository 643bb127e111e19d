//! Conversations and their activities over REST.

use std::collections::HashMap;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use converger_core::policies::TurnPolicy;
use converger_protocol::Viewer;
use converger_protocol::{
    ErrorCode, FrameError, MessageFrame, is_valid_client_id, validate_agent_message_frame,
    validate_message_frame,
};
use converger_store::{Activity, Conversation, NewActivity, Sender, SenderRole};
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::body::{parse_json, parse_value};
use super::tokens::{checked_user_id, token_json};
use crate::auth::TokenAuth;
use crate::error::ApiError;
use crate::policies::SendError;
use crate::state::AppState;
use crate::tokens::{Claims, Scope, anonymous_user_id};

/// Largest page of `GET …/activities`.
pub const MAX_PAGE: i64 = 1000;
/// Page size when `limit` is absent.
const DEFAULT_PAGE: i64 = 100;
/// Sender id of channel-scope posts whose token names no user.
const DEFAULT_AGENT_ID: &str = "agent";

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct CreateRequest {
    #[serde(default)]
    user_id: Option<String>,
}

/// `POST /api/v1/converger/conversations` → `{conversationId, userId, token, expires_in}`.
pub(crate) async fn create(
    State(state): State<AppState>,
    TokenAuth(claims): TokenAuth,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let request: CreateRequest = parse_json(body, true)?;
    if claims.conversation_id.is_some() {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::Forbidden,
            "this token is bound to one conversation",
        ));
    }
    // A verified user id wins over an asserted one; with neither, the user is anonymous.
    // A channel-scope token's user_id names the agent, not an end user.
    let verified_user = match claims.scope() {
        Scope::Conversation => claims.user_id.clone(),
        Scope::Channel => None,
    };
    // The identity rule (ADR 0013): an end user's token never creates a conversation for a user
    // it does not name; a channel-scope token (a trusted backend) may name any user.
    let user_id = match (verified_user, request.user_id, claims.scope()) {
        (Some(verified), _, _) => verified,
        (None, Some(asserted), Scope::Channel) => checked_user_id(&asserted)?,
        (None, Some(_), Scope::Conversation) => {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                ErrorCode::Forbidden,
                "this token names no user; it cannot create a conversation for one",
            ));
        }
        (None, None, _) => anonymous_user_id(),
    };
    state
        .throttles
        .conversation(claims.tenant_id, claims.channel_id)
        .map_err(|over| {
            ApiError::rate_limited(
                format!("too many conversations created for this {}", over.scope),
                over.retry_after,
            )
        })?;
    let conversation = state
        .store
        .create_conversation(claims.channel_id, &user_id)
        .await?;
    let token = state.tokens.issue(
        claims.tenant_id,
        claims.channel_id,
        Some(conversation.id),
        Some(user_id.clone()),
        Some(Scope::Conversation),
    )?;
    let mut answer = token_json(&state, token);
    answer["conversationId"] = json!(conversation.id);
    answer["userId"] = json!(user_id);
    Ok((StatusCode::CREATED, Json(answer)))
}

/// Loads a conversation the token may use; anything else is 404 so existence never leaks.
pub(crate) async fn authorized_conversation(
    state: &AppState,
    claims: &Claims,
    raw_id: &str,
) -> Result<Conversation, ApiError> {
    let id = Uuid::parse_str(raw_id).map_err(|_| ApiError::conversation_not_found())?;
    let conversation = state
        .store
        .conversation(id)
        .await?
        .ok_or_else(ApiError::conversation_not_found)?;
    if conversation.channel_id != claims.channel_id || conversation.tenant_id != claims.tenant_id {
        return Err(ApiError::conversation_not_found());
    }
    let allowed = match claims.scope() {
        Scope::Channel => true,
        // Over REST no anonymous user id is presented: an anonymous conversation is reached with
        // the bound token its creation answered.
        Scope::Conversation => claims.may_use(conversation.id, &conversation.user_id, None),
    };
    if !allowed {
        return Err(ApiError::conversation_not_found());
    }
    Ok(conversation)
}

fn parse_non_negative(
    query: &HashMap<String, String>,
    key: &str,
    default: i64,
) -> Result<i64, ApiError> {
    match query.get(key) {
        None => Ok(default),
        Some(raw) if raw.is_empty() => Ok(default),
        Some(raw) => raw
            .parse::<i64>()
            .ok()
            .filter(|value| *value >= 0)
            .ok_or_else(|| ApiError::bad_request(format!("{key} must be a non-negative integer"))),
    }
}

/// `GET …/conversations/{id}/activities?watermark=&limit=` → `{activities, watermark, hasMore}`.
pub(crate) async fn list_activities(
    State(state): State<AppState>,
    TokenAuth(claims): TokenAuth,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let conversation = authorized_conversation(&state, &claims, &id).await?;
    let watermark = parse_non_negative(&query, "watermark", 0)?;
    let limit = parse_non_negative(&query, "limit", DEFAULT_PAGE)?;
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "limit must be between 1 and {MAX_PAGE}"
        )));
    }
    // `view=chat`: the chat view of ADR 0018 (superseded questions and answers left out).
    let chat_view = match query.get("view").map(String::as_str) {
        None | Some("") | Some("transcript") => None,
        Some("chat") => Some(crate::wire::chat_view(
            state.store.revised_turns(conversation.id).await?,
        )),
        Some(_) => {
            return Err(ApiError::bad_request(
                "view must be transcript (the default) or chat",
            ));
        }
    };
    // One extra row tells whether another page follows.
    let mut activities = state
        .store
        .list_activities(conversation.id, watermark, limit + 1)
        .await?;
    let has_more = activities.len() as i64 > limit;
    activities.truncate(limit as usize);
    let viewer = match claims.scope() {
        Scope::Channel => Viewer::Agent,
        Scope::Conversation => Viewer::EndUser {
            user_id: &conversation.user_id,
        },
    };
    let next_watermark = activities.last().map_or(watermark, |activity| activity.seq);
    // The page's watermark is the last frame read, shown or not, so pages never overlap.
    let frames: Vec<Value> = activities
        .iter()
        .filter_map(|activity| match &chat_view {
            Some(view) => crate::wire::in_chat_view(activity, view),
            None => Some(crate::wire::persistent(activity)),
        })
        .map(|frame| frame.view(viewer).to_value())
        .collect();
    Ok(Json(
        json!({"activities": frames, "watermark": next_watermark, "hasMore": has_more}),
    ))
}

pub(crate) fn frame_error(error: FrameError) -> ApiError {
    let status = match error.code {
        ErrorCode::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::BAD_REQUEST,
    };
    ApiError::new(status, error.code, error.message)
}

/// `POST …/conversations/{id}/activities` (`x-idempotency-key`) → `{id, seq}`; 201 when stored,
/// 200 with the original `{id, seq}` for a repeated key.
pub(crate) async fn post_activity(
    State(state): State<AppState>,
    TokenAuth(claims): TokenAuth,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let conversation = authorized_conversation(&state, &claims, &id).await?;
    let frame = parse_value(body, false)?;
    let limits = &state.config.limits;
    let message = match claims.scope() {
        Scope::Channel => validate_agent_message_frame(&frame, limits),
        Scope::Conversation => validate_message_frame(&frame, limits),
    }
    .map_err(frame_error)?;
    let idempotency_key = match headers.get("x-idempotency-key") {
        None => None,
        Some(value) => {
            let key = value
                .to_str()
                .ok()
                .filter(|key| is_valid_client_id(key))
                .ok_or_else(|| {
                    ApiError::bad_request(
                        "x-idempotency-key must be 1-128 characters of A-Za-z0-9._:~-",
                    )
                })?;
            Some(key.to_owned())
        }
    };
    let (activity, duplicate) = match claims.scope() {
        Scope::Conversation => {
            let key = idempotency_key.or_else(|| message.user_idempotency_key().map(str::to_owned));
            commit_user_message(&state, &conversation, message, key).await?
        }
        Scope::Channel => {
            let agent_id = claims
                .user_id
                .clone()
                .unwrap_or_else(|| DEFAULT_AGENT_ID.to_owned());
            let new = NewActivity {
                conversation_id: conversation.id,
                id: message.id.clone(),
                sender: Sender {
                    id: agent_id,
                    role: SenderRole::Agent,
                },
                client_id: idempotency_key.or_else(|| message.client_id.clone()),
                kind: message.kind,
                data: message.data,
                metadata: message.metadata,
                extra: Some(message.extra),
            };
            crate::publish::commit_frame(&state, conversation.channel_id, &new).await?
        }
    };
    let status = if duplicate {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    Ok((
        status,
        Json(json!({"id": activity.id, "seq": activity.seq})),
    ))
}

/// Commits an end user's message frame as the conversation's user (a turn), under its channel's
/// turn policy or the one the frame asks for, and publishes it when new: `(frame, duplicate)`.
/// REST sends and the chat frontends' posts (docs/frontends.md) share it.
pub(crate) async fn commit_user_message(
    state: &AppState,
    conversation: &Conversation,
    message: MessageFrame,
    client_id: Option<String>,
) -> Result<(Arc<Activity>, bool), ApiError> {
    let asked = match message.turn_policy.as_deref() {
        None => None,
        Some(name) => Some(TurnPolicy::parse(name).ok_or_else(|| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                ErrorCode::InvalidMessage,
                crate::policies::UNKNOWN_POLICY,
            )
        })?),
    };
    // The turn's meta for agents is kept with the frame (never shown to end users).
    let mut extra = message.extra;
    if let Some(meta) = converger_protocol::turn_client_meta(None, message.meta.as_ref()) {
        extra.insert("meta".into(), meta);
    }
    let new = NewActivity {
        conversation_id: conversation.id,
        id: None,
        kind: message.kind,
        sender: Sender {
            id: conversation.user_id.clone(),
            role: SenderRole::User,
        },
        data: message.data,
        metadata: message.metadata,
        extra: Some(extra),
        client_id,
    };
    let outcome = crate::policies::commit_send(state, conversation.channel_id, &new, asked)
        .await
        .map_err(|error| match error {
            SendError::Store(error) => ApiError::from(error),
            SendError::NotAllowed(policy) => ApiError::bad_request(format!(
                "turnPolicy {} is not allowed on this channel",
                policy.as_str()
            )),
        })?;
    let activity = Arc::new(outcome.activity);
    if !outcome.duplicate {
        crate::publish::committed(
            state,
            conversation.channel_id,
            conversation.id,
            [Arc::clone(&activity)],
        );
    }
    Ok((activity, outcome.duplicate))
}
