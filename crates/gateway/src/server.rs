//! Server lifecycle: bind a listener, serve until told to stop, stop cleanly.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use converger_store::Store;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::hub::{Hub, SessionControl};
use crate::state::AppState;
use crate::tokens::TokenKeys;

/// Secrets resolved by the binary (configured, or generated into the state folder).
#[derive(Clone)]
pub struct Credentials {
    /// HS256 signing key.
    pub secret_key: Vec<u8>,
    /// Bearer token of the admin API.
    pub admin_token: String,
}

/// Errors of the server lifecycle.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The listener could not be bound.
    #[error("cannot bind {addr}: {source}")]
    Bind {
        /// Requested address.
        addr: SocketAddr,
        /// Cause.
        source: std::io::Error,
    },
    /// The signing key is unusable.
    #[error("invalid secret_key: {0}")]
    SecretKey(#[from] jsonwebtoken::errors::Error),
    /// Serving failed.
    #[error("server failed: {0}")]
    Serve(#[from] std::io::Error),
    /// Gossip could not start.
    #[error("cluster membership: {0}")]
    Cluster(#[from] converger_cluster::ClusterError),
    /// The cluster bus could not start.
    #[error("cluster bus: {0}")]
    Bus(#[from] crate::bus::BusError),
}

/// A bound, not yet serving, node.
pub struct Server {
    state: AppState,
    listener: TcpListener,
    /// The presence changes the writer applies once the node serves.
    presence_changes: crate::presence::PresenceChanges,
}

/// Connections the kernel holds for the gateway to accept. A proxy that restarts, or a network
/// that comes back, brings every client back at once; a connection beyond this queue loses its
/// SYN, and its client tries again only after a second (then three). Tokio binds with 128, as
/// the standard library does, which 1,000 clients reconnecting at once overflowed
/// (docs/benchmarks.md, fifteenth round).
/// The kernel caps the queue at `net.core.somaxconn` (4,096 on current kernels;
/// docs/operations.md).
const LISTEN_BACKLOG: u32 = 65_535;

/// Binds `addr` for accepting connections, as `TcpListener::bind` does (with `SO_REUSEADDR`), with
/// the longest accept queue the kernel allows.
fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

impl Server {
    /// Binds `config.http_addr` (port 0 picks a free port).
    pub async fn bind(
        config: Config,
        store: Store,
        credentials: Credentials,
    ) -> Result<Server, GatewayError> {
        let addr = config.http_addr;
        let tokens = TokenKeys::new(&credentials.secret_key, config.token_ttl_secs)?;
        let node_id = if config.node_id.is_empty() {
            format!("node-{}", &uuid::Uuid::new_v4().simple().to_string()[..8])
        } else {
            config.node_id.clone()
        };
        let listener = listen(addr).map_err(|source| GatewayError::Bind { addr, source })?;
        let http_addr = listener.local_addr()?;
        let (cluster, membership) =
            converger_cluster::Cluster::start(config.cluster_config(&node_id, http_addr)).await?;
        let actors = Arc::new(crate::actors::Actors::default());
        let (config_rates, config_admin, config_http) = (
            config.rates.clone(),
            config.admin.clone(),
            config.http.clone(),
        );
        let hub = Arc::new(Hub::new(node_id.clone(), config.turns.agent_feed_buffer));
        let bus = Arc::new(crate::bus::Bus::open(&config, store.clone(), &node_id).await?);
        let streams = crate::streams::LiveStreams::start(
            &node_id,
            Arc::clone(&bus),
            converger_core::streams::StreamLimits {
                max_stream_bytes: config.limits.max_stream_bytes,
                max_streams_per_owner: config.limits.max_streams_per_connection,
                max_pool_bytes: config.limits.max_stream_bytes_per_channel,
                max_total_bytes: config.limits.max_stream_bytes_per_node,
            },
            std::time::Duration::from_millis(config.streams.relay_window_ms),
        );
        spawn_membership_dispatch(
            Arc::clone(&actors),
            Arc::clone(&hub),
            Arc::clone(&bus),
            Arc::clone(&streams),
            membership,
        );
        let (presence_writer, presence_changes) = tokio::sync::mpsc::unbounded_channel();
        let state = AppState {
            tokens,
            admin_token: Arc::from(credentials.admin_token.as_str()),
            store,
            config: Arc::new(config),
            metrics: crate::metrics::install_recorder(),
            draining: Arc::new(AtomicBool::new(false)),
            hub,
            bus,
            streams,
            actors,
            cluster,
            status_rates: Arc::default(),
            throttles: Arc::new(crate::throttle::Throttles::new(
                &config_rates,
                &config_admin,
            )),
            admission: crate::listener::Admission::new(&config_http),
            channel_turns: Arc::default(),
            http_agents: Arc::default(),
            runtimes: Arc::default(),
            presence_writer,
        };
        Ok(Server {
            state,
            listener,
            presence_changes,
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> Result<SocketAddr, GatewayError> {
        Ok(self.listener.local_addr()?)
    }

    /// Shared state (tests use it to sign tokens).
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until `shutdown` completes, then drains: readiness and upgrades answer 503, open
    /// sockets finish their in-flight sends and close with 1012 in batches, in-flight requests
    /// finish.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), GatewayError> {
        let app = crate::routes::router(self.state.clone());
        let (events, listening) = self.state.bus.listen();
        // Serve once this node hears other nodes' commits (or give up waiting and let the
        // catch-up cover the start).
        if tokio::time::timeout(std::time::Duration::from_secs(5), listening)
            .await
            .is_err()
        {
            tracing::warn!("event bus not listening yet; serving anyway");
        }
        let holdings: std::sync::Weak<dyn crate::bus::StreamHoldings> =
            Arc::downgrade(&self.state.streams) as _;
        self.state
            .bus
            .share_streams_by_interest(&self.state.hub, holdings);
        crate::bus::door::spawn(
            self.state.store.clone(),
            Arc::clone(&self.state.hub),
            Arc::clone(&self.state.streams),
            Arc::clone(&self.state.runtimes),
            events,
        );
        let pruner = spawn_outbox_pruner(self.state.clone());
        let expiry = crate::lifecycle::spawn_expiry(self.state.clone());
        let reaper = crate::presence::spawn_reaper(self.state.clone());
        let presence_writer =
            crate::presence::spawn_writer(self.state.clone(), self.presence_changes);
        let stop_sweep = crate::stops::spawn_sweep(self.state.clone());
        let http_agents = crate::http_agents::spawn(self.state.clone());
        let draining_state = self.state.clone();
        let shutdown = async move {
            shutdown.await;
            draining_state.start_draining();
            drain_sessions(&draining_state).await;
            tracing::info!("shutting down: finishing in-flight requests");
        };
        let served = crate::listener::serve(
            self.listener,
            app,
            self.state.admission.clone(),
            self.state.config.http.clone(),
            shutdown,
        )
        .await;
        pruner.abort();
        reaper.abort();
        stop_sweep.abort();
        http_agents.abort();
        if let Some(expiry) = expiry {
            expiry.abort();
        }
        // After the drain: the drained sessions' counts out are queued by now.
        presence_writer.finish().await;
        served?;
        Ok(())
    }

    /// Serves in a background task; the handle stops it.
    pub fn spawn(self) -> Result<ServerHandle, GatewayError> {
        let addr = self.local_addr()?;
        let state = self.state.clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(self.run(async move {
            let _ = stopped.await;
        }));
        Ok(ServerHandle {
            addr,
            state,
            stop: Some(stop),
            task,
        })
    }
}

/// Hands the other nodes' membership changes to the channel actors.
fn spawn_membership_dispatch(
    actors: Arc<crate::actors::Actors>,
    hub: Arc<Hub>,
    bus: Arc<crate::bus::Bus>,
    streams: Arc<crate::streams::LiveStreams>,
    mut membership: tokio::sync::mpsc::UnboundedReceiver<converger_cluster::MembershipEvent>,
) {
    use converger_cluster::MembershipEvent;
    tokio::spawn(async move {
        while let Some(event) = membership.recv().await {
            match &event {
                MembershipEvent::NodeDown(node) => {
                    bus.peer_changed(node, false);
                    streams.node_down(&hub, &node.node_id);
                }
                MembershipEvent::NodeUp(node) => bus.peer_changed(node, true),
                MembershipEvent::Joined(..) | MembershipEvent::Left(..) => {}
            }
            actors.on_membership(&event);
        }
    });
}

/// Withdraws this node's group members (here and in gossip) and waits for the other nodes to
/// see it, so that their conversations move before any socket closes.
async fn withdraw_members(state: &AppState) {
    state.actors.withdraw_local();
    match state.cluster.withdraw_all().await {
        Ok(0) => return,
        Ok(withdrawn) => tracing::info!(withdrawn, "agent connections withdrawn from the cluster"),
        Err(error) => tracing::warn!(%error, "agent connections not withdrawn from gossip"),
    }
    let wait = std::time::Duration::from_millis(state.config.drain.withdraw_wait_ms);
    tokio::time::sleep(wait).await;
}

/// Closes every open session in batches, each after its in-flight sends, then waits for them.
async fn drain_sessions(state: &AppState) {
    use rand::RngExt;
    withdraw_members(state).await;
    let drain = &state.config.drain;
    let controls = state.hub.session_controls();
    tracing::info!(sessions = controls.len(), "draining sessions");
    for batch in controls.chunks(drain.batch_size) {
        for control in batch {
            // Jitter spreads the reconnects of many clients over time.
            let retry_after_ms =
                rand::rng().random_range(drain.retry_after_ms..=drain.retry_after_ms * 2);
            let order = control.send(SessionControl::Drain { retry_after_ms });
            let _ = tokio::time::timeout(std::time::Duration::from_millis(100), order).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(drain.batch_interval_ms)).await;
    }
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(drain.timeout_ms);
    let left = state.hub.wait_for_no_sessions(deadline).await;
    if left > 0 {
        tracing::warn!(
            sessions = left,
            "drain timed out; closing the rest with the process"
        );
    }
}

/// Deletes old outbox rows once a minute.
fn spawn_outbox_pruner(state: AppState) -> JoinHandle<()> {
    tokio::spawn(async move {
        let retention = std::time::Duration::from_secs(state.config.outbox_retention_secs);
        let mut every_minute = tokio::time::interval(std::time::Duration::from_secs(60));
        loop {
            every_minute.tick().await;
            match state.store.prune_outbox(retention).await {
                Ok(0) => {}
                Ok(pruned) => tracing::debug!(pruned, "outbox pruned"),
                Err(error) => tracing::warn!(%error, "outbox pruning failed"),
            }
        }
    })
}

/// A node serving in the background.
pub struct ServerHandle {
    addr: SocketAddr,
    state: AppState,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), GatewayError>>,
}

impl ServerHandle {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Base URL, e.g. `http://127.0.0.1:41234`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Shared state.
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Stops serving and waits for in-flight requests.
    pub async fn shutdown(mut self) -> Result<(), GatewayError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.task).await {
            Ok(result) => result,
            Err(join_error) => Err(GatewayError::Serve(std::io::Error::other(join_error))),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if self.stop.is_some() {
            self.task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::listen;

    /// A burst of clients that the gateway has not accepted yet, more than tokio's queue of
    /// 128 held, all wait in the kernel's queue: none of their SYNs is dropped, to be sent
    /// again a second later and dropped again while the queue stays full. (It needs
    /// `net.core.somaxconn` of at least 300, the default being 4,096 since Linux 5.4.)
    #[tokio::test]
    async fn a_burst_of_connections_waits_in_the_accept_queue() {
        let listener = listen("127.0.0.1:0".parse().expect("an address")).expect("bind");
        let addr = listener.local_addr().expect("the bound address");
        let connects = (0..300).map(|_| tokio::net::TcpStream::connect(addr));
        let connected = tokio::time::timeout(
            Duration::from_secs(5),
            futures_util::future::join_all(connects),
        )
        .await
        .expect("every client is queued while none is accepted");
        assert!(connected.iter().all(Result::is_ok));
    }
}
