//! The shell around chitchat: one task owns the gossip server, applies this node's publications,
//! and turns every change of the live node set into membership events.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use chitchat::{ChitchatConfig, ChitchatHandle, ChitchatId, FailureDetectorConfig, NodeState};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};
use uuid::Uuid;

use crate::ClusterError;
use crate::members::{self, AgentRecord, HTTP_KEY, LiveView, MembershipEvent, NodeKey, agent_key};
use crate::sealed::{GossipKeys, GossipTransport};

/// How long tombstones of withdrawn keys are kept, so a peer that missed a deletion still sees it.
const TOMBSTONE_GRACE: Duration = Duration::from_secs(600);

/// Settings of the gossip node.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Stable node name.
    pub node_id: String,
    /// Nodes only gossip with nodes of the same cluster id.
    pub cluster_id: String,
    /// UDP address to bind; port 0 picks a free port.
    pub gossip_addr: SocketAddr,
    /// Address peers use to reach this node; `None` uses the bound address.
    pub advertise_addr: Option<SocketAddr>,
    /// Gossip addresses of other nodes (`host:port`).
    pub seeds: Vec<String>,
    /// One gossip round per interval.
    pub gossip_interval: Duration,
    /// Phi above which the failure detector declares a node dead.
    pub phi_threshold: f64,
    /// A dead node's state is forgotten after this long.
    pub dead_node_grace: Duration,
    /// This node's HTTP address, published for operators.
    pub http_addr: SocketAddr,
    /// The cluster keys; `None` gossips in the clear (a private, loopback-only cluster).
    pub keys: Option<GossipKeys>,
}

/// One node as `GET /api/v1/admin/cluster` shows it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// Node id.
    pub id: String,
    /// Incarnation (start time, ms).
    pub generation: u64,
    /// Gossip address.
    pub gossip_addr: String,
    /// HTTP address, when it has published one.
    pub http_addr: Option<String>,
    /// `self`, `live` or `dead`.
    pub status: &'static str,
    /// Milliseconds since its heartbeat last advanced, as seen from this node.
    pub last_heartbeat_age_ms: Option<u64>,
}

/// One agent connection as `GET /api/v1/admin/cluster` shows it.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MemberStatus {
    /// Channel.
    pub channel_id: Uuid,
    /// Group, `None` for an observer.
    pub group: Option<String>,
    /// Connection id.
    pub connection_id: String,
    /// Node hosting it.
    pub node: String,
    /// Eligibility time (ms).
    pub since: i64,
}

/// The cluster as this node sees it.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterStatus {
    /// Every node known (live, dead and this one).
    pub nodes: Vec<NodeStatus>,
    /// This node's agent connections and the other live nodes' as membership events reported them.
    pub members: Vec<MemberStatus>,
}

/// What the membership task is asked to do.
enum Command {
    Publish(AgentRecord),
    Withdraw {
        channel_id: Uuid,
        connection_id: String,
    },
    WithdrawAll {
        done: oneshot::Sender<usize>,
    },
    Status {
        reply: oneshot::Sender<ClusterStatus>,
    },
}

/// A running gossip node; cheap to clone. Dropping every clone stops it.
#[derive(Clone, Debug)]
pub struct Cluster {
    commands: mpsc::UnboundedSender<Command>,
    node: NodeKey,
    gossip_addr: SocketAddr,
}

impl Cluster {
    /// Starts the gossip node; membership events of the other nodes arrive on the receiver.
    pub async fn start(
        config: ClusterConfig,
    ) -> Result<(Cluster, mpsc::UnboundedReceiver<MembershipEvent>), ClusterError> {
        let listen_addr = resolve_port(config.gossip_addr)?;
        let advertise_addr = config.advertise_addr.unwrap_or(listen_addr);
        let generation = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|elapsed| elapsed.as_millis() as u64)
            .unwrap_or_default();
        let self_id = ChitchatId::new(config.node_id.clone(), generation, advertise_addr);
        let failure_detector_config = FailureDetectorConfig {
            phi_threshold: config.phi_threshold,
            // Equal to the gossip interval: the default (5 s) slows early detection 2-3x.
            initial_interval: config.gossip_interval,
            dead_node_grace_period: config.dead_node_grace,
            ..FailureDetectorConfig::default()
        };
        let chitchat_config = ChitchatConfig {
            chitchat_id: self_id.clone(),
            cluster_id: config.cluster_id.clone(),
            gossip_interval: config.gossip_interval,
            listen_addr,
            seed_nodes: config.seeds.clone(),
            failure_detector_config,
            marked_for_deletion_grace_period: TOMBSTONE_GRACE,
            catchup_callback: None,
            extra_liveness_predicate: None,
        };
        let initial = vec![(HTTP_KEY.to_owned(), config.http_addr.to_string())];
        let transport = GossipTransport::new(config.keys.as_ref(), &config.cluster_id);
        let handle = chitchat::spawn_chitchat(chitchat_config, initial, &transport)
            .await
            .map_err(|error| ClusterError::Bind {
                addr: listen_addr,
                reason: error.to_string(),
            })?;
        let watcher = handle.chitchat().lock().await.live_nodes_watcher();
        let (commands, command_receiver) = mpsc::unbounded_channel();
        let (events, event_receiver) = mpsc::unbounded_channel();
        let node = NodeKey {
            node_id: config.node_id.clone(),
            generation,
        };
        tracing::info!(node_id = %config.node_id, gossip_addr = %advertise_addr, seeds = ?config.seeds, sealed = config.keys.is_some(), "gossip started");
        let task = MembershipTask {
            handle,
            self_id,
            events,
            known: LiveView::new(),
            heartbeats: HashMap::new(),
        };
        tokio::spawn(task.run(command_receiver, watcher, config.gossip_interval));
        Ok((
            Cluster {
                commands,
                node,
                gossip_addr: advertise_addr,
            },
            event_receiver,
        ))
    }

    /// This node's incarnation.
    pub fn node(&self) -> &NodeKey {
        &self.node
    }

    /// The gossip address peers use for this node.
    pub fn gossip_addr(&self) -> SocketAddr {
        self.gossip_addr
    }

    /// Announces an agent connection of this node to the cluster.
    pub fn publish(&self, record: AgentRecord) {
        let _ = self.commands.send(Command::Publish(record));
    }

    /// Withdraws an agent connection of this node.
    pub fn withdraw(&self, channel_id: Uuid, connection_id: &str) {
        let _ = self.commands.send(Command::Withdraw {
            channel_id,
            connection_id: connection_id.to_owned(),
        });
    }

    /// Withdraws every agent connection of this node (draining); returns how many there were.
    pub async fn withdraw_all(&self) -> Result<usize, ClusterError> {
        let (done, withdrawn) = oneshot::channel();
        self.commands
            .send(Command::WithdrawAll { done })
            .map_err(|_| ClusterError::Stopped)?;
        withdrawn.await.map_err(|_| ClusterError::Stopped)
    }

    /// The nodes and members this node knows of.
    pub async fn status(&self) -> Result<ClusterStatus, ClusterError> {
        let (reply, status) = oneshot::channel();
        self.commands
            .send(Command::Status { reply })
            .map_err(|_| ClusterError::Stopped)?;
        status.await.map_err(|_| ClusterError::Stopped)
    }
}

/// Port 0 picks a free port here, because chitchat must advertise the port it binds.
fn resolve_port(addr: SocketAddr) -> Result<SocketAddr, ClusterError> {
    if addr.port() != 0 {
        return Ok(addr);
    }
    let probe = std::net::UdpSocket::bind(addr).map_err(|error| ClusterError::Bind {
        addr,
        reason: error.to_string(),
    })?;
    probe.local_addr().map_err(|error| ClusterError::Bind {
        addr,
        reason: error.to_string(),
    })
}

struct MembershipTask {
    handle: ChitchatHandle,
    self_id: ChitchatId,
    events: mpsc::UnboundedSender<MembershipEvent>,
    /// The live view already reported as events.
    known: LiveView,
    /// Per node: the last heartbeat value seen and when it changed.
    heartbeats: HashMap<ChitchatId, (u64, Instant)>,
}

impl MembershipTask {
    async fn run(
        mut self,
        mut commands: mpsc::UnboundedReceiver<Command>,
        mut watcher: watch::Receiver<std::collections::BTreeMap<ChitchatId, NodeState>>,
        interval: Duration,
    ) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    Some(command) => self.on_command(command).await,
                    None => break,
                },
                changed = watcher.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let live = watcher.borrow_and_update().clone();
                    self.on_live_nodes(&live);
                }
                _ = ticker.tick() => self.record_heartbeats().await,
            }
        }
        if let Err(error) = self.handle.shutdown().await {
            tracing::warn!(%error, "gossip did not stop cleanly");
        }
    }

    fn on_live_nodes(&mut self, live: &std::collections::BTreeMap<ChitchatId, NodeState>) {
        let view: LiveView = live
            .iter()
            .filter(|(id, _)| **id != self.self_id)
            .map(|(id, state)| (node_key(id), members::node_agents(state.key_values())))
            .collect();
        for event in members::diff(&self.known, &view) {
            match &event {
                MembershipEvent::NodeUp(node) => {
                    tracing::info!(node_id = %node.node_id, generation = node.generation, "node up")
                }
                MembershipEvent::NodeDown(node) => {
                    tracing::warn!(node_id = %node.node_id, generation = node.generation, "node down")
                }
                _ => {}
            }
            let _ = self.events.send(event);
        }
        self.known = view;
    }

    async fn on_command(&mut self, command: Command) {
        match command {
            Command::Publish(record) => {
                tracing::debug!(channel_id = %record.channel_id, connection_id = %record.connection_id, "publishing in gossip");
                let peers = {
                    let chitchat = self.handle.chitchat();
                    let mut chitchat = chitchat.lock().await;
                    chitchat.self_node_state().set(record.key(), record.value());
                    self.live_peers(&chitchat)
                };
                self.push_to(peers);
            }
            Command::Withdraw {
                channel_id,
                connection_id,
            } => {
                tracing::debug!(%channel_id, %connection_id, "withdrawing from gossip");
                let peers = {
                    let chitchat = self.handle.chitchat();
                    let mut chitchat = chitchat.lock().await;
                    chitchat
                        .self_node_state()
                        .delete(&agent_key(channel_id, &connection_id));
                    self.live_peers(&chitchat)
                };
                self.push_to(peers);
            }
            Command::WithdrawAll { done } => {
                let (withdrawn, peers) = {
                    let chitchat = self.handle.chitchat();
                    let mut chitchat = chitchat.lock().await;
                    let state = chitchat.self_node_state();
                    let keys: Vec<String> = state
                        .key_values()
                        .filter(|(key, value)| AgentRecord::parse(key, value).is_some())
                        .map(|(key, _)| key.to_owned())
                        .collect();
                    for key in &keys {
                        state.delete(key);
                    }
                    (keys.len(), self.live_peers(&chitchat))
                };
                self.push_to(peers);
                let _ = done.send(withdrawn);
            }
            Command::Status { reply } => {
                let status = self.status().await;
                let _ = reply.send(status);
            }
        }
    }

    fn live_peers(&self, chitchat: &chitchat::Chitchat) -> Vec<SocketAddr> {
        chitchat
            .live_nodes()
            .filter(|id| **id != self.self_id)
            .map(|id| id.gossip_advertise_addr)
            .collect()
    }

    /// A gossip round with each peer right away, instead of waiting for the next interval.
    fn push_to(&self, peers: Vec<SocketAddr>) {
        for peer in peers {
            if let Err(error) = self.handle.gossip(peer) {
                tracing::debug!(%error, %peer, "gossip push not sent");
            }
        }
    }

    async fn record_heartbeats(&mut self) {
        let chitchat = self.handle.chitchat();
        let chitchat = chitchat.lock().await;
        let now = Instant::now();
        for (id, state) in chitchat.node_states() {
            let beat = heartbeat_value(state);
            let entry = self.heartbeats.entry(id.clone()).or_insert((beat, now));
            if entry.0 != beat {
                *entry = (beat, now);
            }
        }
        self.heartbeats
            .retain(|id, _| chitchat.node_states().contains_key(id));
    }

    async fn status(&self) -> ClusterStatus {
        let chitchat = self.handle.chitchat();
        let chitchat = chitchat.lock().await;
        let live: std::collections::HashSet<&ChitchatId> = chitchat.live_nodes().collect();
        let now = Instant::now();
        let mut nodes = Vec::new();
        let mut members = Vec::new();
        for (id, state) in chitchat.node_states() {
            let status = if *id == self.self_id {
                "self"
            } else if live.contains(id) {
                "live"
            } else {
                "dead"
            };
            let last_heartbeat_age_ms = if *id == self.self_id {
                Some(0)
            } else {
                self.heartbeats
                    .get(id)
                    .map(|(_, at)| now.duration_since(*at).as_millis() as u64)
            };
            nodes.push(NodeStatus {
                id: id.node_id.to_string(),
                generation: id.generation_id,
                gossip_addr: id.gossip_advertise_addr.to_string(),
                http_addr: state.get(HTTP_KEY).map(str::to_owned),
                status,
                last_heartbeat_age_ms,
            });
            // This node's own connections, as published; the others' as the actors know them
            // (the reported view, which trails gossip by up to one round).
            if *id != self.self_id {
                continue;
            }
            for record in members::node_agents(state.key_values()).into_values() {
                members.push(member_status(&id.node_id, record));
            }
        }
        for (node, agents) in &self.known {
            for record in agents.values() {
                members.push(member_status(&node.node_id, record.clone()));
            }
        }
        ClusterStatus { nodes, members }
    }
}

fn member_status(node: &str, record: AgentRecord) -> MemberStatus {
    MemberStatus {
        channel_id: record.channel_id,
        group: record.group,
        connection_id: record.connection_id,
        node: node.to_owned(),
        since: record.since_ms,
    }
}

fn node_key(id: &ChitchatId) -> NodeKey {
    NodeKey {
        node_id: id.node_id.to_string(),
        generation: id.generation_id,
    }
}

fn heartbeat_value(state: &NodeState) -> u64 {
    u64::from(state.heartbeat())
}
