//! Error codes of docs/protocol.md §7, with their numbers, retry hints and close codes.

use serde::{Deserialize, Serialize};

/// Every error code of the wire contract. The string forms are part of the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    BadRequest,
    NoSession,
    UnsupportedProtocol,
    InvalidWatermark,
    InvalidMessage,
    Unauthorized,
    TokenExpired,
    Forbidden,
    ChannelInactive,
    RateLimited,
    PayloadTooLarge,
    TooManyInFlight,
    TooManySubscriptions,
    SlowConsumer,
    TooManyStreams,
    ConversationClosed,
    ConversationNotFound,
    TurnConflict,
    TurnSuperseded,
    StaleRuntime,
    LeaseLost,
    StreamClosed,
    TurnStopped,
    TurnInProgress,
    Busy,
    Interrupted,
    NotInterrupted,
    IncompleteResume,
    BotUnavailable,
    AnswerRefused,
    AgentFailed,
    Internal,
    Unavailable,
}

/// WebSocket close codes the gateway uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CloseCode {
    Normal,
    MessageTooBig,
    Internal,
    Draining,
    Protocol,
    Auth,
    ChannelInactive,
    Idle,
    SlowConsumer,
}

impl CloseCode {
    /// The numeric close code sent on the wire.
    pub fn number(self) -> u16 {
        match self {
            CloseCode::Normal => 1000,
            CloseCode::MessageTooBig => 1009,
            CloseCode::Internal => 1011,
            CloseCode::Draining => 1012,
            CloseCode::Protocol => 4400,
            CloseCode::Auth => 4401,
            CloseCode::ChannelInactive => 4403,
            CloseCode::Idle => 4408,
            CloseCode::SlowConsumer => 4503,
        }
    }
}

impl ErrorCode {
    /// All codes, in table order.
    pub const ALL: [ErrorCode; 33] = [
        ErrorCode::BadRequest,
        ErrorCode::NoSession,
        ErrorCode::UnsupportedProtocol,
        ErrorCode::InvalidWatermark,
        ErrorCode::InvalidMessage,
        ErrorCode::Unauthorized,
        ErrorCode::TokenExpired,
        ErrorCode::Forbidden,
        ErrorCode::ChannelInactive,
        ErrorCode::RateLimited,
        ErrorCode::PayloadTooLarge,
        ErrorCode::TooManyInFlight,
        ErrorCode::TooManySubscriptions,
        ErrorCode::SlowConsumer,
        ErrorCode::TooManyStreams,
        ErrorCode::ConversationClosed,
        ErrorCode::ConversationNotFound,
        ErrorCode::TurnConflict,
        ErrorCode::TurnSuperseded,
        ErrorCode::StaleRuntime,
        ErrorCode::LeaseLost,
        ErrorCode::StreamClosed,
        ErrorCode::TurnStopped,
        ErrorCode::TurnInProgress,
        ErrorCode::Busy,
        ErrorCode::Interrupted,
        ErrorCode::NotInterrupted,
        ErrorCode::IncompleteResume,
        ErrorCode::BotUnavailable,
        ErrorCode::AnswerRefused,
        ErrorCode::AgentFailed,
        ErrorCode::Internal,
        ErrorCode::Unavailable,
    ];

    /// The string form used in `error.data.code` and REST error bodies.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::NoSession => "no_session",
            ErrorCode::UnsupportedProtocol => "unsupported_protocol",
            ErrorCode::InvalidWatermark => "invalid_watermark",
            ErrorCode::InvalidMessage => "invalid_message",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::TokenExpired => "token_expired",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::ChannelInactive => "channel_inactive",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::TooManyInFlight => "too_many_in_flight",
            ErrorCode::TooManySubscriptions => "too_many_subscriptions",
            ErrorCode::SlowConsumer => "slow_consumer",
            ErrorCode::TooManyStreams => "too_many_streams",
            ErrorCode::ConversationClosed => "conversation_closed",
            ErrorCode::ConversationNotFound => "conversation_not_found",
            ErrorCode::TurnConflict => "turn_conflict",
            ErrorCode::TurnSuperseded => "turn_superseded",
            ErrorCode::StaleRuntime => "stale_runtime",
            ErrorCode::LeaseLost => "lease_lost",
            ErrorCode::StreamClosed => "stream_closed",
            ErrorCode::TurnStopped => "turn_stopped",
            ErrorCode::TurnInProgress => "turn_in_progress",
            ErrorCode::Busy => "busy",
            ErrorCode::Interrupted => "interrupted",
            ErrorCode::NotInterrupted => "not_interrupted",
            ErrorCode::IncompleteResume => "incomplete_resume",
            ErrorCode::BotUnavailable => "bot_unavailable",
            ErrorCode::AnswerRefused => "answer_refused",
            ErrorCode::AgentFailed => "agent_failed",
            ErrorCode::Internal => "internal",
            ErrorCode::Unavailable => "unavailable",
        }
    }

    /// The numeric code of the table in docs/protocol.md §7.
    pub fn number(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 1000,
            ErrorCode::NoSession => 1001,
            ErrorCode::UnsupportedProtocol => 1002,
            ErrorCode::InvalidWatermark => 1003,
            ErrorCode::InvalidMessage => 1004,
            ErrorCode::Unauthorized => 2000,
            ErrorCode::TokenExpired => 2001,
            ErrorCode::Forbidden => 2002,
            ErrorCode::ChannelInactive => 2003,
            ErrorCode::RateLimited => 3000,
            ErrorCode::PayloadTooLarge => 3001,
            ErrorCode::TooManyInFlight => 3002,
            ErrorCode::TooManySubscriptions => 3003,
            ErrorCode::SlowConsumer => 3004,
            ErrorCode::TooManyStreams => 3005,
            ErrorCode::ConversationClosed => 4000,
            ErrorCode::ConversationNotFound => 4001,
            ErrorCode::TurnConflict => 4100,
            ErrorCode::TurnSuperseded => 4101,
            ErrorCode::StaleRuntime => 4102,
            ErrorCode::LeaseLost => 4103,
            ErrorCode::StreamClosed => 4104,
            ErrorCode::TurnStopped => 4105,
            ErrorCode::TurnInProgress => 4106,
            ErrorCode::Busy => 5000,
            ErrorCode::Interrupted => 5001,
            ErrorCode::NotInterrupted => 5002,
            ErrorCode::IncompleteResume => 5003,
            ErrorCode::BotUnavailable => 5004,
            ErrorCode::AnswerRefused => 5005,
            ErrorCode::AgentFailed => 5006,
            ErrorCode::Internal => 9000,
            ErrorCode::Unavailable => 9001,
        }
    }

    /// Whether a client may retry the same request unchanged.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::TokenExpired
                | ErrorCode::RateLimited
                | ErrorCode::TooManyInFlight
                | ErrorCode::SlowConsumer
                | ErrorCode::StaleRuntime
                | ErrorCode::Busy
                | ErrorCode::BotUnavailable
                | ErrorCode::Internal
                | ErrorCode::Unavailable
        )
    }

    /// The close code that follows this error on a WebSocket, when the table names one.
    pub fn close_code(self) -> Option<CloseCode> {
        match self {
            ErrorCode::UnsupportedProtocol => Some(CloseCode::Protocol),
            ErrorCode::Unauthorized | ErrorCode::TokenExpired => Some(CloseCode::Auth),
            ErrorCode::ChannelInactive => Some(CloseCode::ChannelInactive),
            ErrorCode::SlowConsumer => Some(CloseCode::SlowConsumer),
            ErrorCode::Unavailable => Some(CloseCode::Draining),
            _ => None,
        }
    }

    /// Parses the string form; `None` for codes this version does not know.
    pub fn parse(code: &str) -> Option<ErrorCode> {
        ErrorCode::ALL
            .into_iter()
            .find(|known| known.as_str() == code)
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_form_matches_as_str() {
        for code in ErrorCode::ALL {
            let json = serde_json::to_value(code).unwrap();
            assert_eq!(json, serde_json::Value::String(code.as_str().to_owned()));
            assert_eq!(ErrorCode::parse(code.as_str()), Some(code));
        }
    }

    #[test]
    fn numbers_are_unique() {
        let mut numbers: Vec<u16> = ErrorCode::ALL.iter().map(|c| c.number()).collect();
        numbers.sort_unstable();
        numbers.dedup();
        assert_eq!(numbers.len(), ErrorCode::ALL.len());
    }

    #[test]
    fn table_rows_spot_check() {
        assert_eq!(ErrorCode::LeaseLost.number(), 4103);
        assert!(!ErrorCode::LeaseLost.retryable());
        assert_eq!(
            ErrorCode::SlowConsumer.close_code().map(CloseCode::number),
            Some(4503)
        );
        assert_eq!(
            ErrorCode::Unavailable.close_code().map(CloseCode::number),
            Some(1012)
        );
        assert_eq!(ErrorCode::PayloadTooLarge.close_code(), None);
        assert!(ErrorCode::StaleRuntime.retryable());
    }
}
