//! State shared by every request handler.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use converger_store::Store;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::actors::Actors;
use crate::config::Config;
use crate::hub::Hub;
use crate::listener::Admission;
use crate::status_rates::RateSampler;
use crate::streams::LiveStreams;
use crate::throttle::Throttles;
use crate::tokens::TokenKeys;

/// Everything a handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    /// The database.
    pub store: Store,
    /// The validated configuration.
    pub config: Arc<Config>,
    /// Token signing and verification.
    pub tokens: TokenKeys,
    /// The resolved admin token (configured or generated).
    pub admin_token: Arc<str>,
    /// Renders `/metrics`.
    pub metrics: PrometheusHandle,
    /// Set when the node drains: readiness and new upgrades answer 503.
    pub draining: Arc<AtomicBool>,
    /// Live frames and open sessions of this node.
    pub hub: Arc<Hub>,
    /// The cluster bus (ADR 0033).
    pub bus: Arc<crate::bus::Bus>,
    /// Streamed answers open on this node and replicated from the others.
    pub streams: Arc<LiveStreams>,
    /// The channel actors of this node (agent groups).
    pub actors: Arc<Actors>,
    /// This node's gossip membership.
    pub cluster: converger_cluster::Cluster,
    /// Counters sampled by the status page, for its rates.
    pub(crate) status_rates: Arc<RateSampler>,
    /// Creation rates and failed admin authentications, per key.
    pub(crate) throttles: Arc<Throttles>,
    /// The connection caps of the listener.
    pub(crate) admission: Admission,
    /// Each channel's turn policy and disconnect setting, as this node last read them.
    pub(crate) channel_turns: Arc<crate::policies::ChannelTurnsCache>,
    /// The URLs this node calls for HTTP agent groups (concurrency caps, breakers).
    pub(crate) http_agents: Arc<crate::http_agents::HttpAgents>,
    /// The conversations' runtimes this node knows, handed out with delivered turns.
    pub(crate) runtimes: Arc<crate::runtimes::Runtimes>,
    /// Presence changes of this node's sessions, applied in batches (ADR 0043).
    pub(crate) presence_writer: crate::presence::PresenceWriter,
}

impl AppState {
    /// True once the node has started draining.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Marks the node as draining.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Places held under the connection caps now: connections, and HTTP/2 requests running
    /// beside others on theirs (the status page shows it; tests wait on it).
    pub fn connections_held(&self) -> usize {
        self.admission.held()
    }
}
