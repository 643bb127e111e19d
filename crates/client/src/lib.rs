//! A Rust client for converger. Today it speaks the REST surface (PROTOCOL section 6); the
//! WebSocket sessions for end users and agents come with their issues.
#![forbid(unsafe_code)]

mod rest;

pub use rest::{
    ActivitiesPage, ChannelInfo, ClientError, CreatedChannel, CreatedConversation, CreatedTenant,
    Posted, RestClient, TokenRequest, TokenResponse,
};
