//! REST errors: `{"error":{"code","message"}}` with an HTTP status.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use converger_protocol::{ErrorCode, ErrorFrame};
use converger_store::StoreError;
use serde_json::json;

/// How long a client is asked to wait before it resends a write refused as `unavailable`: a
/// Postgres failover takes seconds, and a resend with the same key is harmless.
pub const UNAVAILABLE_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// The wire code of a failed write: what the client can act on. A write the database refused
/// for what it holds is the client's (`invalid_message`, not retryable); a timeout, a lost
/// database connection or a read-only database is `unavailable`; only what remains is
/// `internal`.
pub fn write_error_code(error: &StoreError) -> ErrorCode {
    match error {
        StoreError::ConversationClosed => ErrorCode::ConversationClosed,
        StoreError::ConversationNotFound => ErrorCode::ConversationNotFound,
        StoreError::TurnInProgress { .. } => ErrorCode::TurnInProgress,
        unavailable if unavailable.is_unavailable() => ErrorCode::Unavailable,
        refused if refused.is_refused_input() => ErrorCode::InvalidMessage,
        _ => ErrorCode::Internal,
    }
}

/// The error frame of a failed write: its code, and for `unavailable` when to resend.
pub fn write_error_frame(error: &StoreError, message: &str) -> ErrorFrame {
    error_frame(write_error_code(error), message)
}

/// An error frame with `code`, carrying when to resend for `unavailable` (the one place that
/// hint is attached).
pub fn error_frame(code: ErrorCode, message: &str) -> ErrorFrame {
    ErrorFrame {
        retry_after_ms: (code == ErrorCode::Unavailable).then(unavailable_retry_ms),
        ..ErrorFrame::new(code, message)
    }
}

/// The code of a store failure that is not the client's doing: `unavailable` when no writable
/// database answers (it may be failing over), else `internal`.
pub fn failure_code(error: &StoreError) -> ErrorCode {
    if error.is_unavailable() {
        ErrorCode::Unavailable
    } else {
        ErrorCode::Internal
    }
}

/// [`UNAVAILABLE_RETRY_AFTER`] in milliseconds, as `retryAfterMs` carries it.
pub fn unavailable_retry_ms() -> u64 {
    u64::try_from(UNAVAILABLE_RETRY_AFTER.as_millis()).unwrap_or(u64::MAX)
}

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
    /// `Retry-After`, in seconds, for 429 and 503 answers.
    pub retry_after_secs: Option<u64>,
}

impl ApiError {
    /// An error with a protocol code.
    pub fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError::with_code(status, code.as_str(), message)
    }

    /// An error with a code of its own (`not_found`, `method_not_allowed`, `upgrade_required`).
    pub fn with_code(
        status: StatusCode,
        code: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            retry_after_secs: None,
        }
    }

    /// 429 `rate_limited` with `Retry-After`.
    pub fn rate_limited(message: impl Into<String>, retry_after: std::time::Duration) -> ApiError {
        ApiError {
            retry_after_secs: Some(retry_after.as_secs_f64().ceil().max(1.0) as u64),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                ErrorCode::RateLimited,
                message,
            )
        }
    }

    /// 400 `bad_request`.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, ErrorCode::BadRequest, message)
    }

    /// 503 `unavailable` from a draining node, with `Retry-After` (`retry_after_ms`, rounded
    /// up to whole seconds).
    pub fn draining(retry_after_ms: u64) -> ApiError {
        ApiError {
            retry_after_secs: Some(retry_after_ms.div_ceil(1000).max(1)),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::Unavailable,
                "node is draining",
            )
        }
    }

    /// 401 `unauthorized`.
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, ErrorCode::Unauthorized, message)
    }

    /// 404 `not_found` for a resource that is missing or belongs to someone else.
    pub fn not_found(what: &str) -> ApiError {
        ApiError::with_code(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("{what} not found"),
        )
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
        let mut response = (self.status, Json(body)).into_response();
        if let Some(seconds) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, seconds.into());
        }
        response
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
            StoreError::TurnInProgress { seq } => ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::TurnInProgress,
                format!("turn {seq} is in progress"),
            ),
            StoreError::ChannelNotFound => ApiError::not_found("channel"),
            StoreError::TenantNotFound => ApiError::not_found("tenant"),
            refused if refused.is_refused_input() => {
                tracing::warn!(error = %refused, "write refused by the database");
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    ErrorCode::InvalidMessage,
                    "the database cannot store this frame",
                )
            }
            unavailable if unavailable.is_unavailable() => {
                tracing::warn!(error = %unavailable, "database unavailable");
                ApiError {
                    retry_after_secs: Some(UNAVAILABLE_RETRY_AFTER.as_secs()),
                    ..ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        ErrorCode::Unavailable,
                        "database unavailable; retry",
                    )
                }
            }
            other => {
                tracing::error!(error = %other, "store error");
                ApiError::internal()
            }
        }
    }
}
