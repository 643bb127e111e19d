//! The HTTP and WebSocket surface of converger: routes, credentials, sessions, the channel
//! actors, metrics, and the server lifecycle (bind, serve, shut down).
#![forbid(unsafe_code)]

pub mod actors;
mod agent_url;
mod answers;
pub mod auth;
pub mod bus;
mod chat_history;
pub mod config;
pub mod error;
mod http_agents;
pub mod hub;
mod lifecycle;
mod listener;
pub mod metrics;
mod policies;
mod presence;
mod publish;
mod recent;
mod routes;
mod runtimes;
pub mod server;
pub mod state;
mod status_rates;
mod stops;
pub mod stream_event;
pub mod streams;
mod throttle;
pub mod tokens;
mod wire;
mod ws;

pub use config::{Config, DatabaseConfig, DrainConfig, LogFormat};

pub use routes::http_agents::{check_group_name, check_http_agent, dead_letter_json, group_json};
pub use routes::tokens::{TokenGrant, issue_for_channel};
pub use server::{Credentials, GatewayError, Server, ServerHandle};
pub use state::AppState;
