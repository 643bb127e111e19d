//! The converger/1 wire contract: error codes, close codes, limits and the validation rules
//! that both the gateway and clients share. No I/O lives here.
#![forbid(unsafe_code)]

mod client_frame;
mod error_code;
mod frame;
mod ids;
mod limits;
mod server_frame;

pub use client_frame::{
    ClientFrame, FORWARDED_TYPES, Hello, Refusal, TurnTarget, parse_client_frame, parse_client_text,
};
pub use error_code::{CloseCode, ErrorCode};
pub use frame::{
    CONTROL_TYPES, FrameError, MessageFrame, SERVER_ONLY_TYPES, validate_message_frame,
};
pub use ids::{is_valid_client_id, is_valid_group};
pub use limits::Limits;
pub use server_frame::{ErrorFrame, retry_close_reason};

/// Protocol identifier a client sends in `hello.protocol` to select the converger profile.
pub const PROTOCOL_NAME: &str = "converger/1";

/// WebSocket subprotocol selected when a client offers it.
pub const SUBPROTOCOL: &str = "converger.v1";

/// The `type` claim every converger token carries.
pub const TOKEN_TYPE: &str = "converger";
