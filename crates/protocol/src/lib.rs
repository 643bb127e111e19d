//! The converger/1 wire contract: what clients may send (parsed and validated here), what the
//! server sends (built and serialized here, once per frame), error and close codes, and limits.
//! No I/O lives here.
#![forbid(unsafe_code)]

pub mod ag_ui;
mod agent_frame;
pub mod ai_sdk;
mod answer_parts;
mod client_frame;
mod delivery;
mod error_code;
mod frame;
mod ids;
mod limits;
pub mod mekik;
mod persistent;
mod profile;
mod server_frame;
mod storable;
mod streams;
mod turn_meta;
mod welcome;

pub use agent_frame::{AgentFrame, EnvelopedFrame, ResultRuntime, TurnResult, parse_agent_text};
pub use answer_parts::{AnswerPart, ToolCalls, answer_part};
pub use client_frame::{
    ClientFrame, FORWARDED_TYPES, Hello, Refusal, TurnTarget, parse_client_frame, parse_client_text,
};
pub use delivery::{Cancel, Envelope, StopReason, delivered_turn};
pub use error_code::{CloseCode, ErrorCode};
pub use frame::{
    CONTROL_TYPES, FrameError, MessageFrame, SERVER_ONLY_TYPES, turn_client_meta,
    validate_agent_message_frame, validate_message_frame,
};
pub use ids::{MAX_USER_ID_BYTES, is_valid_client_id, is_valid_group, is_valid_user_id};
pub use limits::{Limits, MAX_STREAM_BYTES_CEILING};
pub use persistent::{CONVERSATION_UPDATE, PersistentFrame, RenderedFrame, USER_ROLE, Viewer};
pub use profile::{MEKIK_PROTOCOL_NAME, Profile};
pub use server_frame::{
    Ack, Catalog, ErrorFrame, Heartbeat, TurnNumber, agent_failed, answer_refused, presence,
    read_receipt, refused_turn, relayed_error, replay_truncated, retry_close_reason, run_status,
    token_refreshed, typing,
};
pub use storable::{NUL_REFUSED, contains_nul};
pub use streams::{
    StreamAbort, StreamChunk, StreamContent, StreamTurnRef, end_user_chunk, end_user_stream_end,
};
pub use turn_meta::{ChannelRef, Participant, RuntimeRef, TurnMeta, TurnRef, turn_key};
pub use welcome::{ChannelWelcome, ConversationWelcome, PendingInterrupt};

/// Protocol identifier a client sends in `hello.protocol` to select the converger profile.
pub const PROTOCOL_NAME: &str = "converger/1";

/// WebSocket subprotocol selected when a client offers it.
pub const SUBPROTOCOL: &str = "converger.v1";

/// The `type` claim every converger token carries.
pub const TOKEN_TYPE: &str = "converger";

/// A server frame as JSON text.
fn encode<T: serde::Serialize + ?Sized>(frame: &T) -> String {
    // The frames are plain structs, strings, numbers and JSON values: nothing in them can fail
    // to serialize (no map with non-string keys, no custom error).
    serde_json::to_string(frame).expect("server frames always serialize")
}

/// A server frame as a JSON value (frames that travel between nodes as values).
fn to_value<T: serde::Serialize + ?Sized>(frame: &T) -> serde_json::Value {
    serde_json::to_value(frame).expect("server frames always serialize")
}
