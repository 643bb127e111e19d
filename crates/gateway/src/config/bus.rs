//! `bus` and `[nats]`: how nodes tell each other of commits, stream chunks and transient frames
//! (ADR 0033).

use serde::{Deserialize, Serialize};

/// Which bus carries events between nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum BusKind {
    /// `pg_notify` from the committing statement and one `LISTEN` per node: nothing to run
    /// beside Postgres (the default).
    #[default]
    Postgres,
    /// Core NATS (`[nats]`): each node publishes its commits after they committed, and its
    /// stream chunks and transient frames, on per-conversation subjects.
    Nats,
    /// One node alone: nothing is published; the node hands its commits to its own sessions.
    /// A second node over the same database would hear nothing of this one.
    Local,
}

impl BusKind {
    /// True when the committing statements notify (`converger.notify` is not `off`).
    pub fn notifies_in_commit(self) -> bool {
        self == BusKind::Postgres
    }
}

/// The NATS servers and how a node authenticates to them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsConfig {
    /// Server URLs (`nats://host:4222`, `tls://host:4222`); a node connects to one and learns
    /// the rest of a NATS cluster from it.
    #[serde(deserialize_with = "super::list_or_comma_separated")]
    pub servers: Vec<String>,
    /// User and password, when the servers ask for them.
    pub user: String,
    /// The user's password (a secret: never logged).
    pub password: String,
    /// A token, when the servers authenticate by token (a secret: never logged).
    pub token: String,
    /// Refuse a server that does not offer TLS.
    pub require_tls: bool,
    /// Every subject starts with this (several deployments can share one NATS).
    pub subject_prefix: String,
    /// How often a node reads the outbox back over the last moments, for commits whose
    /// publication was lost (a node that died between its commit and its publish).
    pub sweep_ms: u64,
    /// Longest wait for a server at start and for one request.
    pub connect_timeout_ms: u64,
    /// Messages the node's subscription holds before the client drops them (a slow consumer,
    /// after which the node reads the outbox back).
    pub subscription_capacity: usize,
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            servers: vec!["nats://127.0.0.1:4222".into()],
            user: String::new(),
            password: String::new(),
            token: String::new(),
            require_tls: false,
            subject_prefix: "converger".into(),
            sweep_ms: 1_000,
            connect_timeout_ms: 5_000,
            subscription_capacity: 262_144,
        }
    }
}

impl NatsConfig {
    /// Checks what deserializes but cannot work; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        if self.servers.is_empty() {
            return Err("nats.servers must name at least one server".into());
        }
        let valid_token = |part: &str| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        };
        if !self.subject_prefix.split('.').all(valid_token) {
            return Err(
                "nats.subject_prefix must be dot-separated tokens of letters, digits, - and _"
                    .into(),
            );
        }
        if self.sweep_ms == 0 || self.sweep_ms > 60_000 {
            return Err("nats.sweep_ms must be between 1 and 60000".into());
        }
        if self.subscription_capacity == 0 {
            return Err("nats.subscription_capacity must be at least 1".into());
        }
        if !self.user.is_empty() && !self.token.is_empty() {
            return Err("nats.user and nats.token are exclusive".into());
        }
        Ok(())
    }
}
