//! What both kinds of session share: how a session ends, how one socket read is sorted, and the
//! few frames and deadlines every session answers the same way.

use std::time::Duration;

use axum::extract::ws::{Message, Utf8Bytes};
use converger_protocol::{CloseCode, ErrorCode, ErrorFrame, Refusal, retry_close_reason};
use tokio::time::Instant;

use super::outbound::{Outbound, PushError};
use super::rate::TokenBucket;

/// Why a session loop ended.
pub(super) enum Ending {
    /// The client closed or the socket failed: nothing more to send.
    Gone,
    /// Close with this code and reason after what is queued.
    Close { code: u16, reason: String },
    /// Drop the backlog and close at once.
    CloseNow { code: u16, reason: String },
}

impl Ending {
    /// The client did not keep up: the backlog is dropped and the close says when to return.
    pub(super) fn slow_consumer(retry_after_ms: u64) -> Ending {
        metrics::counter!("converger_ws_slow_consumer_total").increment(1);
        Ending::CloseNow {
            code: CloseCode::SlowConsumer.number(),
            reason: retry_close_reason(ErrorCode::SlowConsumer, retry_after_ms),
        }
    }

    /// No inbound data within the idle timeout.
    pub(super) fn idle() -> Ending {
        Ending::Close {
            code: CloseCode::Idle.number(),
            reason: "idle".into(),
        }
    }

    /// The node drains: reconnect elsewhere after the hint.
    pub(super) fn draining(retry_after_ms: u64) -> Ending {
        Ending::Close {
            code: CloseCode::Draining.number(),
            reason: retry_close_reason(ErrorCode::Unavailable, retry_after_ms),
        }
    }

    /// The token expired without an `auth`.
    pub(super) fn token_expired() -> Ending {
        Ending::Close {
            code: CloseCode::Auth.number(),
            reason: "token_expired".into(),
        }
    }

    /// The token expired, for a client that cannot send `auth` but reconnects with a fresh
    /// token after any close but 4401 (the mekik profile).
    pub(super) fn token_expired_reconnect() -> Ending {
        Ending::Close {
            code: CloseCode::Normal.number(),
            reason: "token_expired".into(),
        }
    }
}

/// What one read from the socket means for a session.
pub(super) enum Inbound {
    /// A text message to parse.
    Text(Utf8Bytes),
    /// A binary message: refused with `invalid_message`.
    Binary,
    /// Ping or pong: activity, nothing to answer.
    Control,
}

/// Sorts one read: the end of the stream, a close or a read failure end the session.
pub(super) fn classify(message: Option<Result<Message, axum::Error>>) -> Result<Inbound, Ending> {
    match message {
        None | Some(Ok(Message::Close(_))) => Err(Ending::Gone),
        Some(Err(error)) => Err(read_failure(&error)),
        Some(Ok(Message::Text(text))) => Ok(Inbound::Text(text)),
        Some(Ok(Message::Binary(_))) => Ok(Inbound::Binary),
        Some(Ok(Message::Ping(_) | Message::Pong(_))) => Ok(Inbound::Control),
    }
}

/// The answer to a binary message.
pub(super) fn binary_refusal() -> ErrorFrame {
    ErrorFrame::new(
        ErrorCode::InvalidMessage,
        "binary messages are not accepted",
    )
}

/// What an inbound message is once the connection's rate and the size limit have had their say.
pub(super) enum Admitted {
    /// A text to parse.
    Text(Utf8Bytes),
    /// Answer this error; the message is dropped.
    Refused(ErrorFrame),
    /// Over the rate: a token is back after `wait` (the size limit is not checked yet).
    RateLimited {
        /// The text, for a session that holds it until then.
        text: Utf8Bytes,
        /// When a token is back.
        wait: Duration,
    },
    /// Ping or pong: nothing to answer.
    Control,
}

/// Sorts an inbound message: binary is refused, text is rate limited, then size limited.
pub(super) fn admit(inbound: Inbound, rate: &mut TokenBucket, max_frame_bytes: usize) -> Admitted {
    let text = match inbound {
        Inbound::Text(text) => text,
        Inbound::Binary => return Admitted::Refused(binary_refusal()),
        Inbound::Control => return Admitted::Control,
    };
    if let Err(wait) = rate.take(std::time::Instant::now()) {
        return Admitted::RateLimited { text, wait };
    }
    match within_size(text, max_frame_bytes) {
        Some(text) => Admitted::Text(text),
        None => Admitted::Refused(too_large()),
    }
}

/// The text when it is within `max_frame_bytes` (else [`too_large`] answers it).
pub(super) fn within_size(text: Utf8Bytes, max_frame_bytes: usize) -> Option<Utf8Bytes> {
    (text.len() <= max_frame_bytes).then_some(text)
}

/// An order to close from outside the connection: its error first, then the close.
pub(super) fn ordered_close(
    outbound: &Outbound,
    error: Option<Box<ErrorFrame>>,
    code: u16,
    reason: String,
) -> Ending {
    if let Some(error) = error {
        push_error(outbound, &error);
    }
    Ending::Close { code, reason }
}

/// The answer to a text message above `limits.max_frame_bytes`.
pub(super) fn too_large() -> ErrorFrame {
    ErrorFrame::new(ErrorCode::PayloadTooLarge, "frame too large")
}

/// The answer to a frame over the per-connection rate: retry once a token is back.
pub(super) fn rate_limited(wait: Duration) -> ErrorFrame {
    ErrorFrame {
        retry_after_ms: Some(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1)),
        ..ErrorFrame::new(ErrorCode::RateLimited, "too many frames per second")
    }
}

/// The answer to a refused `auth`.
pub(super) fn token_refused() -> ErrorFrame {
    ErrorFrame::new(
        ErrorCode::Forbidden,
        "token refused; the current token stays",
    )
}

/// The error a drain sends before its close.
pub(super) fn draining_error(retry_after_ms: u64) -> ErrorFrame {
    ErrorFrame {
        retry_after_ms: Some(retry_after_ms),
        ..ErrorFrame::new(
            ErrorCode::Unavailable,
            "node is draining; reconnect elsewhere",
        )
    }
}

/// A refused client frame as an error frame echoing its clientId and type.
pub(super) fn refusal_frame(refusal: &Refusal) -> ErrorFrame {
    ErrorFrame {
        client_id: refusal.client_id.clone(),
        frame_type: refusal.frame_type.clone(),
        ..ErrorFrame::new(refusal.error.code, refusal.error.message.clone())
    }
}

/// A read error: above the hard cap the connection closes with 1009, anything else ends it.
pub(super) fn read_failure(error: &axum::Error) -> Ending {
    let text = error.to_string();
    if text.contains("too long") || text.contains("Space limit") || text.contains("capacity") {
        return Ending::CloseNow {
            code: CloseCode::MessageTooBig.number(),
            reason: "message too big".into(),
        };
    }
    Ending::Gone
}

/// Queues an error frame; errors are never dropped under pressure (a client may be waiting on
/// one for its send), and a failure to queue is the session's end, noticed at the next push.
pub(super) fn push_error(outbound: &Outbound, error: &ErrorFrame) {
    let _ = outbound.push_text(error.encode(), false);
}

/// A database failure the session cannot continue after: `internal`, then close 1011.
pub(super) fn internal_close(outbound: &Outbound) -> Ending {
    push_error(
        outbound,
        &ErrorFrame::new(ErrorCode::Internal, "internal error"),
    );
    Ending::Close {
        code: CloseCode::Internal.number(),
        reason: "internal".into(),
    }
}

/// Maps a failed push onto the session's end.
pub(super) fn push_failed(error: PushError, retry_after_ms: u64) -> Ending {
    match error {
        PushError::Closed => Ending::Gone,
        PushError::Full => Ending::slow_consumer(retry_after_ms),
    }
}

/// The instant at which a token's `exp` (seconds since the epoch) passes.
pub(super) fn expiry_instant(exp: i64) -> Instant {
    let remaining = exp.saturating_sub(chrono::Utc::now().timestamp()).max(0);
    Instant::now() + Duration::from_secs(u64::try_from(remaining).unwrap_or(0))
}

/// The node's clock in milliseconds since the Unix epoch.
pub(super) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
