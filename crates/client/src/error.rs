//! The crate's one error type, shared by the REST calls and both WebSocket scopes.

use reqwest::StatusCode;
use serde_json::Value;

/// What a REST call or a WebSocket session can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered a REST call with an error body.
    #[error("{status} {code}: {message}")]
    Api {
        /// HTTP status.
        status: StatusCode,
        /// `error.code` of the body.
        code: String,
        /// `error.message` of the body.
        message: String,
    },
    /// A REST request did not complete or the answer was not the expected JSON.
    #[error("transport error: {0}")]
    Transport(#[from] reqwest::Error),
    /// The WebSocket could not be opened, or failed where no reconnect applies (first connect).
    #[error("connection error: {0}")]
    Connection(String),
    /// The server refused with an `error` frame (during the handshake, or answering a send).
    #[error("{code}: {message}")]
    Refused {
        /// Error code.
        code: String,
        /// Message.
        message: String,
        /// `details`, when any.
        details: Value,
    },
    /// The server closed the socket with a code that reconnecting would not fix (4400, 4401,
    /// 4403, 1009, …).
    #[error("closed by the server with {code}: {reason}")]
    Closed {
        /// WebSocket close code.
        code: u16,
        /// Close reason as sent.
        reason: String,
    },
    /// Reconnecting failed as many times in a row as the backoff allows.
    #[error("gave up reconnecting after {attempts} attempts: {last}")]
    GaveUp {
        /// Consecutive failed attempts.
        attempts: u32,
        /// Why the last attempt failed.
        last: String,
    },
    /// No acknowledgement after every resend.
    #[error("no acknowledgement after {0} attempts")]
    Unacknowledged(u32),
    /// A clientId outside the contract's shape (1–128 characters of `A-Za-z0-9._:~-`).
    #[error("invalid clientId {0:?}: expected 1-128 characters of A-Za-z0-9._:~-")]
    InvalidClientId(String),
    /// The connection is down: a frame sent without resend (a stream chunk) did not go out.
    #[error("not connected: the frame was not sent")]
    NotConnected,
    /// A frame the client refuses to send (not a JSON object).
    #[error("invalid frame: {0}")]
    InvalidFrame(String),
}

impl ClientError {
    /// The error code when the server answered with one (REST body or `error` frame).
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { code, .. } | ClientError::Refused { code, .. } => Some(code),
            _ => None,
        }
    }

    /// The HTTP status when a REST call was answered.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            ClientError::Transport(error) => error.status(),
            _ => None,
        }
    }

    /// A refusal built from an `error` frame's `data`.
    pub(crate) fn refused(data: &Value) -> ClientError {
        ClientError::Refused {
            code: data["code"].as_str().unwrap_or("unknown").to_owned(),
            message: data["message"].as_str().unwrap_or_default().to_owned(),
            details: data["details"].clone(),
        }
    }
}
