//! REST errors: `{"error":{"code","message"}}` with an HTTP status.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use converger_protocol::ErrorCode;
use converger_store::StoreError;
use serde_json::json;

/// An error answered over HTTP.
#[derive(Debug, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Wire code: a docs/protocol.md §7 code, or `not_found` for resources that are not
    /// conversations.
    pub code: &'static str,
    /// Human-readable reason.
    pub message: String,
}

impl ApiError {
    /// An error with a protocol code.
    pub fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code: code.as_str(),
            message: message.into(),
        }
    }

    /// 400 `bad_request`.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, ErrorCode::BadRequest, message)
    }

    /// 401 `unauthorized`.
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, ErrorCode::Unauthorized, message)
    }

    /// 404 `not_found` for a resource that is missing or belongs to someone else.
    pub fn not_found(what: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            code: "not_found",
            message: format!("{what} not found"),
        }
    }

    /// 404 `conversation_not_found`.
    pub fn conversation_not_found() -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::ConversationNotFound,
            "conversation not found",
        )
    }

    /// 403 `channel_inactive`.
    pub fn channel_inactive() -> ApiError {
        ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::ChannelInactive,
            "channel is inactive",
        )
    }

    /// 500 `internal`; the cause is logged, not shown.
    pub fn internal() -> ApiError {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Internal,
            "internal error",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.code, "message": self.message}});
        (self.status, Json(body)).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> ApiError {
        match error {
            StoreError::ConversationNotFound => ApiError::conversation_not_found(),
            StoreError::ConversationClosed => ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::ConversationClosed,
                "conversation is closed",
            ),
            StoreError::ChannelNotFound => ApiError::not_found("channel"),
            StoreError::TenantNotFound => ApiError::not_found("tenant"),
            StoreError::Timeout { operation } => {
                tracing::warn!(operation, "database timeout");
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    ErrorCode::Unavailable,
                    "database timeout",
                )
            }
            other => {
                tracing::error!(error = %other, "store error");
                ApiError::internal()
            }
        }
    }
}
