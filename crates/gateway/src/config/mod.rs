//! The node's configuration: one struct, deserialized from `config/*.toml` and `CONVERGER_*`
//! environment variables by the binary, validated before anything starts. The sections are in
//! `sections.rs`.

mod bus;
mod sections;

pub use bus::{BusKind, NatsConfig};

pub use sections::{
    AdminConfig, ConversationsConfig, DatabaseConfig, DemoConfig, DemoPage, DrainConfig,
    FrontendsConfig, GossipConfig, HttpAgentsConfig, HttpConfig, LogFormat, RatesConfig,
    StatusConfig, StreamsConfig, TurnsConfig,
};

use std::net::SocketAddr;
use std::path::PathBuf;

use std::time::Duration;

use converger_cluster::{ClusterConfig, GossipKey, GossipKeys};
use converger_protocol::Limits;
use serde::{Deserialize, Deserializer, Serialize};

/// Every setting of a node. Field names are the TOML keys; `CONVERGER_<KEY>` overrides them
/// (nested keys with `__`, e.g. `CONVERGER_LIMITS__MAX_FRAME_BYTES`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Stable name of this node in the cluster; empty picks `node-<random>` at start.
    pub node_id: String,
    /// Address the HTTP and WebSocket listener binds.
    pub http_addr: SocketAddr,
    /// Address of the gossip (UDP) listener.
    pub gossip_addr: SocketAddr,
    /// Gossip addresses of other nodes to join.
    #[serde(deserialize_with = "list_or_comma_separated")]
    pub seeds: Vec<String>,
    /// Nodes only gossip with nodes of the same cluster id.
    pub cluster_id: String,
    /// Postgres URL; empty starts the embedded database under `state_dir/postgres`.
    pub database_url: String,
    /// Folder for local state: the embedded database and generated secrets.
    pub state_dir: PathBuf,
    /// Apply pending migrations when `serve` starts.
    pub migrate_on_start: bool,
    /// HS256 signing key of tokens (at least 32 bytes); empty uses `state_dir/secret_key`.
    pub secret_key: String,
    /// Bearer token of the admin API; empty uses `state_dir/admin_token`.
    pub admin_token: String,
    /// When set, `GET /metrics` requires this bearer token.
    pub metrics_token: String,
    /// Delay before a new group member becomes eligible to own turns.
    pub group_settle_ms: u64,
    /// Lifetime of issued tokens, in seconds.
    pub token_ttl_secs: u64,
    /// `human` or `json`.
    pub log_format: LogFormat,
    /// Database pool and timeouts.
    pub database: DatabaseConfig,
    /// Per-connection limits, announced in `welcome.limits`.
    pub limits: Limits,
    /// How a node drains on SIGTERM.
    pub drain: DrainConfig,
    /// Outbox rows (the bus's catch-up history) are kept this long, in seconds.
    pub outbox_retention_secs: u64,
    /// Gossip timing and failure detection.
    pub gossip: GossipConfig,
    /// Lease mode: how long a claim on a turn lasts without renewal, in milliseconds (a
    /// connected member's node renews it every third of this).
    pub lease_ms: u64,
    /// The HTTP listener's deadlines and connection caps.
    pub http: HttpConfig,
    /// The admin surface.
    pub admin: AdminConfig,
    /// The status page.
    pub status: StatusConfig,
    /// Creation rates per channel and tenant.
    pub rates: RatesConfig,
    /// Streamed answers.
    pub streams: StreamsConfig,
    /// Closing idle conversations.
    pub conversations: ConversationsConfig,
    /// Stops and double texting.
    pub turns: TurnsConfig,
    /// The chat frontends' routes (AI SDK, AG-UI).
    pub frontends: FrontendsConfig,
    /// Agents behind a URL: the operator's allowlist and the calls' limits.
    pub http_agents: HttpAgentsConfig,
    /// The demo chat page.
    pub demo: DemoConfig,
    /// Which bus carries events between nodes: `postgres`, `nats` or `local` (ADR 0033).
    pub bus: BusKind,
    /// The NATS servers, when `bus = "nats"`.
    pub nats: NatsConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            node_id: String::new(),
            http_addr: SocketAddr::from(([127, 0, 0, 1], 8080)),
            gossip_addr: SocketAddr::from(([127, 0, 0, 1], 7946)),
            seeds: Vec::new(),
            cluster_id: "converger".into(),
            database_url: String::new(),
            state_dir: PathBuf::from(".converger"),
            migrate_on_start: true,
            secret_key: String::new(),
            admin_token: String::new(),
            metrics_token: String::new(),
            group_settle_ms: 1_000,
            token_ttl_secs: 3_600,
            log_format: LogFormat::Human,
            database: DatabaseConfig::default(),
            limits: Limits::default(),
            drain: DrainConfig::default(),
            outbox_retention_secs: 600,
            gossip: GossipConfig::default(),
            lease_ms: 10_000,
            http: HttpConfig::default(),
            admin: AdminConfig::default(),
            status: StatusConfig::default(),
            rates: RatesConfig::default(),
            streams: StreamsConfig::default(),
            conversations: ConversationsConfig::default(),
            turns: TurnsConfig::default(),
            frontends: FrontendsConfig::default(),
            http_agents: HttpAgentsConfig::default(),
            demo: DemoConfig::default(),
            bus: BusKind::default(),
            nats: NatsConfig::default(),
        }
    }
}

impl Config {
    /// True when the node serves `GET /demo`: `demo.page = "on"`, or `"auto"` on the
    /// development setup (the embedded database, no `database_url`).
    pub fn serves_demo(&self) -> bool {
        match self.demo.page {
            DemoPage::On => true,
            DemoPage::Off => false,
            DemoPage::Auto => self.database_url.is_empty(),
        }
    }
}

/// Smallest accepted signing key, in bytes (HS256 wants at least the hash size).
pub const MIN_SECRET_KEY_BYTES: usize = 32;

impl Config {
    /// The gossip node's settings; `http_addr` is the address actually bound.
    pub fn cluster_config(&self, node_id: &str, http_addr: SocketAddr) -> ClusterConfig {
        ClusterConfig {
            node_id: node_id.to_owned(),
            cluster_id: self.cluster_id.clone(),
            gossip_addr: self.gossip_addr,
            advertise_addr: self.gossip.advertise_addr.parse().ok(),
            seeds: self.seeds.clone(),
            gossip_interval: Duration::from_millis(self.gossip.interval_ms),
            phi_threshold: self.gossip.phi_threshold,
            dead_node_grace: Duration::from_secs(self.gossip.dead_node_grace_secs),
            http_addr,
            keys: self.gossip_keys().ok().flatten(),
        }
    }

    /// The cluster keys, when a key is configured (`validate` has checked their form).
    pub fn gossip_keys(&self) -> Result<Option<GossipKeys>, String> {
        if self.gossip.key.is_empty() {
            return Ok(None);
        }
        let seal = GossipKey::from_hex(&self.gossip.key)
            .map_err(|error| format!("gossip.key: {error}"))?;
        let accept = match self.gossip.accept_key.as_str() {
            "" => None,
            hex_digits => Some(
                GossipKey::from_hex(hex_digits)
                    .map_err(|error| format!("gossip.accept_key: {error}"))?,
            ),
        };
        Ok(Some(GossipKeys { seal, accept }))
    }

    /// Checks values that deserialize but make no sense; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        if !self.secret_key.is_empty() && self.secret_key.len() < MIN_SECRET_KEY_BYTES {
            return Err(format!(
                "secret_key must be at least {MIN_SECRET_KEY_BYTES} bytes"
            ));
        }
        if !self.admin_token.is_empty() && self.admin_token.len() < 16 {
            return Err("admin_token must be at least 16 bytes".into());
        }
        if self.bus == BusKind::Nats {
            self.nats.validate()?;
        }
        if self.cluster_id.is_empty() {
            return Err("cluster_id must not be empty".into());
        }
        if self.streams.relay_window_ms > 1_000 {
            return Err("streams.relay_window_ms must be at most 1000".into());
        }
        if self.conversations.expiry_sweep_secs == 0 || self.conversations.expiry_batch == 0 {
            return Err(
                "conversations.expiry_sweep_secs and conversations.expiry_batch must be greater than 0"
                    .into(),
            );
        }
        if self.turns.stop_grace_ms > 600_000 || self.turns.disconnect_cancel_ms > 3_600_000 {
            return Err(
                "turns.stop_grace_ms must be at most 600000 and turns.disconnect_cancel_ms at most 3600000"
                    .into(),
            );
        }
        if !(1..=1_048_576).contains(&self.turns.agent_feed_buffer) {
            return Err("turns.agent_feed_buffer must be between 1 and 1048576".into());
        }
        if converger_core::policies::TurnPolicy::parse(&self.turns.default_policy).is_none() {
            return Err(
                "turns.default_policy must be \"enqueue\", \"reject\", \"interrupt\" or \"rollback\""
                    .into(),
            );
        }
        if self.token_ttl_secs == 0 || self.token_ttl_secs > 30 * 24 * 3600 {
            return Err("token_ttl_secs must be between 1 and 2592000".into());
        }
        if self.database.max_connections == 0 {
            return Err("database.max_connections must be greater than 0".into());
        }
        if self.database.commit_workers == 0
            || self.database.commit_workers as u64 >= u64::from(self.database.max_connections)
        {
            return Err(
                "database.commit_workers must be at least 1 and below database.max_connections"
                    .into(),
            );
        }
        if self.database.acquire_timeout_ms == 0 || self.database.statement_timeout_ms == 0 {
            return Err("database.acquire_timeout_ms and database.statement_timeout_ms must be greater than 0".into());
        }
        let url = &self.database_url;
        let is_postgres_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
        if !url.is_empty() && !is_postgres_url {
            return Err("database_url must start with postgres:// or postgresql://".into());
        }
        if self
            .seeds
            .iter()
            .any(|seed| seed.parse::<SocketAddr>().is_err() && !seed.contains(':'))
        {
            return Err("seeds must be host:port gossip addresses".into());
        }
        if self.drain.batch_size == 0 || self.drain.retry_after_ms == 0 {
            return Err("drain.batch_size and drain.retry_after_ms must be greater than 0".into());
        }
        if !self.gossip.advertise_addr.is_empty()
            && self.gossip.advertise_addr.parse::<SocketAddr>().is_err()
        {
            return Err("gossip.advertise_addr must be an ip:port address".into());
        }
        if self.gossip.interval_ms == 0 || self.gossip.interval_ms > 10_000 {
            return Err("gossip.interval_ms must be between 1 and 10000".into());
        }
        if self.gossip.phi_threshold.is_nan() || self.gossip.phi_threshold <= 0.0 {
            return Err("gossip.phi_threshold must be greater than 0".into());
        }
        self.gossip_keys()?;
        if self.gossip.key.is_empty() && !self.gossip.accept_key.is_empty() {
            return Err("gossip.accept_key needs gossip.key".into());
        }
        if self.gossip.key.is_empty()
            && !self.gossip.allow_unauthenticated
            && !self.gossip_addr.ip().is_loopback()
        {
            return Err(
                "gossip.key is required when gossip_addr is not a loopback address (anyone who \
                 can send it UDP would join the cluster); set gossip.allow_unauthenticated = true \
                 only on a network where nobody else can"
                    .into(),
            );
        }
        if self.lease_ms < 300 {
            return Err("lease_ms must be at least 300".into());
        }
        if self.outbox_retention_secs < 60 {
            return Err("outbox_retention_secs must be at least 60".into());
        }
        if self.http.header_read_timeout_ms == 0 || self.http.body_read_timeout_ms == 0 {
            return Err(
                "http.header_read_timeout_ms and http.body_read_timeout_ms must be greater than 0"
                    .into(),
            );
        }
        if self.http.max_concurrent_streams == 0 {
            return Err("http.max_concurrent_streams must be greater than 0".into());
        }
        // An origin is `scheme://host[:port]`: a wildcard (or a path) would never match, and a
        // wildcard is what CORS must never pair with credentials.
        if let Some(origin) =
            self.frontends.allow_origins.iter().find(|origin| {
                !origin.contains("://") || origin.contains('*') || origin.ends_with('/')
            })
        {
            return Err(format!(
                "frontends.allow_origins: {origin:?} is not an origin (scheme://host[:port], no wildcard, no path)"
            ));
        }
        if self.frontends.max_history_frames < 1 || self.frontends.max_request_bytes == 0 {
            return Err(
                "frontends.max_history_frames and frontends.max_request_bytes must be greater than 0"
                    .into(),
            );
        }
        if let Some(entry) = self.http_agents.allow.iter().find(|entry| {
            crate::agent_url::url_parts(entry).is_none() || entry.contains(['?', '#', '*'])
        }) {
            return Err(format!(
                "http_agents.allow: {entry:?} is not a URL prefix (http[s]://host[:port][/path], no user, query or wildcard)"
            ));
        }
        let agents = &self.http_agents;
        if agents.max_history_frames < 1
            || agents.max_response_bytes == 0
            || agents.connect_timeout_ms == 0
            || agents.breaker_failures == 0
            || agents.reload_ms == 0
        {
            return Err("http_agents: max_history_frames, max_response_bytes, connect_timeout_ms, breaker_failures and reload_ms must be greater than 0".into());
        }
        if self.admin.failures_burst == 0 || self.admin.failures_per_minute == 0 {
            return Err(
                "admin.failures_burst and admin.failures_per_minute must be greater than 0".into(),
            );
        }
        self.limits.validate()
    }
}

/// Accepts `["a:1", "b:2"]` from TOML or `"a:1,b:2"` from the environment.
pub(crate) fn list_or_comma_separated<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ListOrString {
        List(Vec<String>),
        String(String),
    }
    Ok(match ListOrString::deserialize(deserializer)? {
        ListOrString::List(list) => list,
        ListOrString::String(joined) => joined
            .split(',')
            .map(str::trim)
            .filter(|seed| !seed.is_empty())
            .map(str::to_owned)
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        Config::default().validate().unwrap();
    }

    #[test]
    fn short_secret_key_names_the_key() {
        let config = Config {
            secret_key: "short".into(),
            ..Config::default()
        };
        assert!(config.validate().unwrap_err().starts_with("secret_key"));
    }

    #[test]
    fn bad_limits_name_the_key() {
        let mut config = Config::default();
        config.limits.max_frame_bytes = 0;
        assert!(
            config
                .validate()
                .unwrap_err()
                .contains("limits.max_frame_bytes")
        );
    }
}
