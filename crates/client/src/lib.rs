//! A Rust client for converger: the REST surface (PROTOCOL section 6) and the agent side of
//! channel-scope sessions (section 4).
#![forbid(unsafe_code)]

pub mod agent;
mod rest;

pub use rest::{
    ActivitiesPage, ChannelInfo, ClientError, CreatedChannel, CreatedConversation, CreatedTenant,
    Posted, RestClient, TokenRequest, TokenResponse,
};
