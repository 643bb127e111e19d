//! Builders for the frames only the server sends, so their shapes live in one place.

use serde_json::{Value, json};

use crate::ErrorCode;

/// An `error` frame (PROTOCOL section 7).
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorFrame {
    /// The code.
    pub code: ErrorCode,
    /// Human-readable reason.
    pub message: String,
    /// The clientId of the refused frame.
    pub client_id: Option<String>,
    /// The type of the refused frame.
    pub frame_type: Option<String>,
    /// Suggested wait before retrying.
    pub retry_after_ms: Option<u64>,
    /// Code-specific details.
    pub details: Option<Value>,
}

impl ErrorFrame {
    /// An error with only a code and a message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ErrorFrame {
        ErrorFrame {
            code,
            message: message.into(),
            client_id: None,
            frame_type: None,
            retry_after_ms: None,
            details: None,
        }
    }

    /// The frame as JSON.
    pub fn to_json(&self) -> Value {
        let mut data = json!({
            "code": self.code.as_str(),
            "message": self.message,
            "number": self.code.number(),
            "retryable": self.code.retryable(),
        });
        if let Some(client_id) = &self.client_id {
            data["clientId"] = json!(client_id);
        }
        if let Some(frame_type) = &self.frame_type {
            data["frameType"] = json!(frame_type);
        }
        if let Some(retry_after_ms) = self.retry_after_ms {
            data["retryAfterMs"] = json!(retry_after_ms);
        }
        if let Some(details) = &self.details {
            data["details"] = details.clone();
        }
        json!({"type": "error", "data": data})
    }
}

/// The JSON reason of closes 1012 and 4503: `{"reason":"unavailable","retryAfterMs":N}`.
pub fn retry_close_reason(code: ErrorCode, retry_after_ms: u64) -> String {
    json!({"reason": code.as_str(), "retryAfterMs": retry_after_ms}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_frame_shape() {
        let frame = ErrorFrame {
            client_id: Some("c-1".into()),
            frame_type: Some("text".into()),
            ..ErrorFrame::new(ErrorCode::TooManyInFlight, "slow down")
        }
        .to_json();
        assert_eq!(frame["type"], "error");
        assert_eq!(frame["data"]["code"], "too_many_in_flight");
        assert_eq!(frame["data"]["number"], 3002);
        assert_eq!(frame["data"]["retryable"], true);
        assert_eq!(frame["data"]["clientId"], "c-1");
        assert_eq!(frame["data"]["frameType"], "text");
        assert!(frame["data"].get("details").is_none());
    }

    #[test]
    fn close_reason_is_json() {
        let reason: Value =
            serde_json::from_str(&retry_close_reason(ErrorCode::Unavailable, 1500)).unwrap();
        assert_eq!(
            reason,
            json!({"reason": "unavailable", "retryAfterMs": 1500})
        );
    }
}
