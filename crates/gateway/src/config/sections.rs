//! The sections of the node's configuration (`[database]`, `[drain]`, `[gossip]`, `[http]`,
//! `[admin]`, `[status]`, `[rates]`), each with its defaults.

use serde::{Deserialize, Serialize};

/// Gossip (cluster membership) tuning; the defaults suit nodes on one LAN.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GossipConfig {
    /// Address other nodes use to reach this node's gossip port; empty: `gossip_addr`.
    pub advertise_addr: String,
    /// One gossip round per interval, in milliseconds.
    pub interval_ms: u64,
    /// Phi accrual threshold above which a silent node is declared dead.
    pub phi_threshold: f64,
    /// A dead node's state is forgotten after this many seconds.
    pub dead_node_grace_secs: u64,
    /// The cluster key (64 hexadecimal digits): every datagram is sealed with it; a node
    /// without it cannot join, publish or read membership. Empty: gossip in the clear, which is
    /// allowed only on loopback (or with `allow_unauthenticated`).
    pub key: String,
    /// Another key also accepted (not used to seal), while the cluster rotates keys.
    pub accept_key: String,
    /// Gossip in the clear on a non-loopback address (a network where only the nodes can send
    /// UDP to the gossip port).
    pub allow_unauthenticated: bool,
}

impl Default for GossipConfig {
    fn default() -> Self {
        GossipConfig {
            advertise_addr: String::new(),
            interval_ms: 100,
            phi_threshold: 8.0,
            dead_node_grace_secs: 600,
            key: String::new(),
            accept_key: String::new(),
            allow_unauthenticated: false,
        }
    }
}

/// Draining: sockets are closed in batches with 1012 and a jittered retry hint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DrainConfig {
    /// Sockets closed per batch.
    pub batch_size: usize,
    /// Pause between batches, in milliseconds.
    pub batch_interval_ms: u64,
    /// Base `retryAfterMs` told to clients (jittered up to twice this); also `Retry-After`.
    pub retry_after_ms: u64,
    /// Longest wait for sessions to finish their in-flight sends and close, in milliseconds.
    pub timeout_ms: u64,
    /// After withdrawing its group members from gossip, the node waits this long (for the
    /// other nodes to see it) before it closes sockets, in milliseconds.
    pub withdraw_wait_ms: u64,
}

impl Default for DrainConfig {
    fn default() -> Self {
        DrainConfig {
            batch_size: 100,
            batch_interval_ms: 100,
            retry_after_ms: 2_000,
            timeout_ms: 10_000,
            withdraw_wait_ms: 500,
        }
    }
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Human,
    /// One JSON object per line.
    Json,
}

/// Database pool settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatabaseConfig {
    /// Upper bound of pooled connections.
    pub max_connections: u32,
    /// Longest wait for a pooled connection, in milliseconds.
    pub acquire_timeout_ms: u64,
    /// Server-side statement timeout and client-side query deadline, in milliseconds.
    pub statement_timeout_ms: u64,
    /// Group-commit batches in progress at once (ADR 0020).
    pub commit_workers: usize,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            max_connections: 16,
            acquire_timeout_ms: 5_000,
            statement_timeout_ms: 5_000,
            commit_workers: 2,
        }
    }
}

/// The HTTP listener's deadlines and connection caps (0: no cap).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// A connection with no request in progress is closed after this, in milliseconds: its
    /// first request's complete headers must arrive within it (whatever the connection sends
    /// meanwhile: nothing, an HTTP/2 preface, partial headers), and so must the next request's
    /// after each response.
    pub header_read_timeout_ms: u64,
    /// A request's body must arrive within this, in milliseconds.
    pub body_read_timeout_ms: u64,
    /// Connections a node holds at once, WebSocket sessions included.
    pub max_connections: usize,
    /// Connections a node holds at once from one client address.
    pub max_connections_per_address: usize,
    /// `Retry-After` of a connection refused over a cap, in seconds.
    pub retry_after_secs: u64,
    /// Requests (streams) one HTTP/2 connection may run at once; each beyond the first also
    /// takes a place under the connection caps.
    pub max_concurrent_streams: u32,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            max_connections: 50_000,
            max_connections_per_address: 1_000,
            retry_after_secs: 5,
            max_concurrent_streams: 10,
        }
    }
}

/// The admin surface: throttling of failed authentications.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// Failed admin authentications one client address may make in a burst; beyond them its
    /// admin requests get 429 until the bucket refills.
    pub failures_burst: u32,
    /// Failed admin authentications per minute one client address regains.
    pub failures_per_minute: u32,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            failures_burst: 10,
            failures_per_minute: 6,
        }
    }
}

/// The status page.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StatusConfig {
    /// Mark the login cookie `Secure` (set it when a TLS proxy is in front; a request with
    /// `X-Forwarded-Proto: https` gets it anyway).
    pub secure_cookie: bool,
}

/// Creation rates per channel and per tenant on one node (bursts of a minute's worth; 0: no
/// limit). Over a rate: 429 with `Retry-After`, or `rate_limited` at hello.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RatesConfig {
    /// Conversations created per minute per channel.
    pub conversations_per_minute_per_channel: u32,
    /// Conversations created per minute per tenant.
    pub conversations_per_minute_per_tenant: u32,
    /// Tokens issued (generate, refresh) per minute per channel.
    pub tokens_per_minute_per_channel: u32,
    /// Tokens issued (generate, refresh) per minute per tenant.
    pub tokens_per_minute_per_tenant: u32,
}

impl Default for RatesConfig {
    fn default() -> Self {
        RatesConfig {
            conversations_per_minute_per_channel: 600,
            conversations_per_minute_per_tenant: 1_200,
            tokens_per_minute_per_channel: 1_200,
            tokens_per_minute_per_tenant: 2_400,
        }
    }
}

/// Streamed answers (ADR 0019).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StreamsConfig {
    /// Stream events are relayed to the other nodes in one notification statement per window
    /// at most (ms): the cross-node cost is one transaction per window, not per chunk.
    pub relay_window_ms: u64,
}

impl Default for StreamsConfig {
    fn default() -> Self {
        StreamsConfig { relay_window_ms: 5 }
    }
}

/// Conversation lifecycle (ADR 0023).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConversationsConfig {
    /// An open conversation with no frame for this long (seconds) is closed with reason
    /// `expired`; 0 never expires one.
    pub idle_close_secs: u64,
    /// How often a node looks for idle conversations (seconds).
    pub expiry_sweep_secs: u64,
    /// Conversations closed per sweep transaction at most.
    pub expiry_batch: u32,
}

impl Default for ConversationsConfig {
    fn default() -> Self {
        ConversationsConfig {
            idle_close_secs: 24 * 3600,
            expiry_sweep_secs: 60,
            expiry_batch: 100,
        }
    }
}

/// Running turns: stops and double texting (ADR 0028).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TurnsConfig {
    /// How long (ms) a stopped turn waits for its agent's own answer before the gateway
    /// settles it with what was streamed.
    pub stop_grace_ms: u64,
    /// The turn policy of channels that set none: `enqueue`, `reject`, `interrupt` or
    /// `rollback` (ADR 0029).
    pub default_policy: String,
    /// On a channel with `on_disconnect = "cancel"`: how long (ms) a conversation stays without
    /// an end-user connection before its running turn is cancelled.
    pub disconnect_cancel_ms: u64,
    /// Live events a node buffers per channel for its agents. A channel's agents that fall
    /// further behind lose the overflow, and the node reads the channel's unanswered turns back
    /// from the database instead.
    pub agent_feed_buffer: usize,
}

impl Default for TurnsConfig {
    fn default() -> Self {
        TurnsConfig {
            stop_grace_ms: 2_000,
            default_policy: "enqueue".into(),
            disconnect_cancel_ms: 5_000,
            agent_feed_buffer: 1_024,
        }
    }
}

impl TurnsConfig {
    /// `default_policy` as a policy (`enqueue` when it names none, which validation refuses).
    pub fn default_policy(&self) -> converger_core::policies::TurnPolicy {
        converger_core::policies::TurnPolicy::parse(&self.default_policy)
            .unwrap_or(converger_core::policies::TurnPolicy::Enqueue)
    }
}

/// The chat frontends' routes (docs/frontends.md): the AI SDK's `useChat` and AG-UI clients.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FrontendsConfig {
    /// Browser origins (`scheme://host[:port]`) whose pages may call the frontends' routes
    /// (CORS); same-origin pages and clients that send no `Origin` always may.
    #[serde(deserialize_with = "super::list_or_comma_separated")]
    pub allow_origins: Vec<String>,
    /// A chat's history (`…/messages`, AG-UI's `MESSAGES_SNAPSHOT`) holds at most this many of
    /// the conversation's latest frames.
    pub max_history_frames: i64,
    /// The largest request body these routes read, in bytes: both clients post the whole chat
    /// history with every message, so it is larger than `limits.max_frame_bytes` (each message
    /// committed is still held to the frame limits).
    pub max_request_bytes: usize,
}

impl Default for FrontendsConfig {
    fn default() -> Self {
        FrontendsConfig {
            allow_origins: Vec::new(),
            max_history_frames: 1_000,
            max_request_bytes: 1_048_576,
        }
    }
}

/// Agents behind a URL (docs/agents.md, ADR 0031): where nodes may call, and the limits of
/// every call. A group's own limits (`timeoutMs`, `maxConcurrency`, `retry`) are set with the
/// group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpAgentsConfig {
    /// URL prefixes (`http[s]://host[:port][/path]`) an HTTP agent group may be given: a
    /// group's URL must have the same scheme, host and port and a path at or below the entry's.
    /// Empty (the default): no HTTP agent group can be created or called.
    #[serde(deserialize_with = "super::list_or_comma_separated")]
    pub allow: Vec<String>,
    /// How long a call waits for its connection.
    pub connect_timeout_ms: u64,
    /// The largest response read from an agent, in bytes; a larger one fails the call.
    pub max_response_bytes: usize,
    /// The history posted with a turn holds at most this many of the conversation's frames up
    /// to the turn.
    pub max_history_frames: i64,
    /// Consecutive failed calls to one URL (on one node) that open its circuit breaker.
    pub breaker_failures: u32,
    /// How long an open breaker refuses calls before one probes.
    pub breaker_open_ms: u64,
    /// How often a node re-reads the groups (a group created, changed or deleted on another
    /// node is served here within this time).
    pub reload_ms: u64,
}

impl Default for HttpAgentsConfig {
    fn default() -> Self {
        HttpAgentsConfig {
            allow: Vec::new(),
            connect_timeout_ms: 5_000,
            max_response_bytes: 4_194_304,
            max_history_frames: 200,
            breaker_failures: 5,
            breaker_open_ms: 30_000,
            reload_ms: 2_000,
        }
    }
}

/// Whether the node serves the demo chat page (`GET /demo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum DemoPage {
    /// Served only on the development setup: the embedded database (no `database_url`).
    #[default]
    Auto,
    /// Always served.
    On,
    /// Never served.
    Off,
}

/// The demo chat page (a development aid: it hands out conversations of a demo channel).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DemoConfig {
    /// `auto`, `on` or `off`.
    pub page: DemoPage,
}
