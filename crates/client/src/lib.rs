//! A Rust client for converger: the REST surface (docs/protocol.md §6), the end-user side of
//! conversation-scope sessions ([`Conversation`], section 3) and the agent side of
//! channel-scope sessions ([`agent::Agent`], section 4).
//!
//! Both WebSocket clients reconnect on their own with jittered exponential backoff, resume
//! from the last watermark, resend unacknowledged sends with the same clientId (the server's
//! idempotency key) and never hand out a frame twice.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod agent;
mod backoff;
mod conversation;
mod error;
pub mod frames;
mod outbox;
pub mod outgoing;
mod rest;
mod session;
pub mod streams;
mod tracking;

pub use backoff::Backoff;
pub use conversation::{Conversation, ConversationOptions};
pub use error::ClientError;
pub use frames::{ServerFrame, Welcome};
pub use rest::{
    ActivitiesPage, ChannelInfo, CreatedChannel, CreatedConversation, CreatedTenant, Posted,
    RestClient, TokenRequest, TokenResponse,
};
pub use session::{SessionOptions, socket_config};
pub use streams::{AnswerStream, StreamAssembly};
