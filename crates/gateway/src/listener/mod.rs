//! The accept loop: every TCP connection is admitted or refused before any request is read, and
//! every connection has a deadline for what it owes the server.
//!
//! - A node holds at most `http.max_connections` connections, and at most
//!   `http.max_connections_per_address` from one client address; over either cap the connection
//!   gets `503 Service Unavailable` with `Retry-After` and is closed, before any upgrade.
//! - A request's headers must arrive within `http.header_read_timeout_ms` (which also bounds an
//!   idle keep-alive connection), and its body within `http.body_read_timeout_ms` (a layer of
//!   the router).
//! - An admitted connection holds its [`ConnectionSlot`] until it closes; a WebSocket upgrade
//!   takes the slot into its session, so a socket counts for as long as it is open.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tower::ServiceExt as _;

use crate::config::HttpConfig;

/// Connections a node holds, per client address and in all.
#[derive(Debug, Default)]
struct Counts {
    per_address: HashMap<IpAddr, usize>,
    total: usize,
}

/// Admission of connections under the node's caps.
#[derive(Debug, Clone)]
pub(crate) struct Admission {
    counts: Arc<Mutex<Counts>>,
    max_total: usize,
    max_per_address: usize,
}

impl Admission {
    /// Admission under `config`'s caps (0: no cap).
    pub(crate) fn new(config: &HttpConfig) -> Admission {
        Admission {
            counts: Arc::default(),
            max_total: config.max_connections,
            max_per_address: config.max_connections_per_address,
        }
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A slot for a connection from `address`, or `None` when a cap is reached.
    pub(crate) fn admit(&self, address: IpAddr) -> Option<ConnectionSlot> {
        let mut counts = self.counts();
        let from_address = counts.per_address.get(&address).copied().unwrap_or(0);
        let over_total = self.max_total > 0 && counts.total >= self.max_total;
        let over_address = self.max_per_address > 0 && from_address >= self.max_per_address;
        if over_total || over_address {
            let cap = if over_total { "node" } else { "address" };
            metrics::counter!("converger_connections_refused_total", "cap" => cap).increment(1);
            return None;
        }
        counts.total += 1;
        *counts.per_address.entry(address).or_insert(0) += 1;
        metrics::gauge!("converger_connections").set(counts.total as f64);
        Some(ConnectionSlot {
            _held: Arc::new(SlotInner {
                admission: self.clone(),
                address,
            }),
        })
    }

    /// Connections held now (all addresses).
    pub(crate) fn held(&self) -> usize {
        self.counts().total
    }
}

/// One admitted connection's place under the caps, given back when the last clone drops.
#[derive(Debug, Clone)]
pub(crate) struct ConnectionSlot {
    _held: Arc<SlotInner>,
}

#[derive(Debug)]
struct SlotInner {
    admission: Admission,
    address: IpAddr,
}

impl Drop for SlotInner {
    fn drop(&mut self) {
        let mut counts = self.admission.counts();
        counts.total = counts.total.saturating_sub(1);
        if let Some(count) = counts.per_address.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                counts.per_address.remove(&self.address);
            }
        }
        metrics::gauge!("converger_connections").set(counts.total as f64);
    }
}

/// Accepts connections until `shutdown` completes, then stops accepting, lets every connection
/// finish its requests (upgraded sockets are the sessions' to close), and returns.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    admission: Admission,
    config: HttpConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (stop, stopping) = watch::channel(());
    // Each connection task holds a clone of `done_guard`; `recv` answers `None` once all are gone.
    let (done_guard, mut done) = mpsc::channel::<()>(1);
    let mut shutdown = pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors or a reset before accept: keep serving the others.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Frames are small and latency-bound: without TCP_NODELAY a second small write waits
        // for the peer's delayed ACK (about 40 ms on Linux).
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "TCP_NODELAY not set");
        }
        let stopping = stopping.clone();
        let done = done_guard.clone();
        match admission.admit(peer.ip()) {
            Some(slot) => {
                let router = router.clone();
                let config = config.clone();
                tokio::spawn(async move {
                    serve_admitted(stream, peer, slot, router, &config, stopping).await;
                    drop(done);
                });
            }
            None => {
                let config = config.clone();
                tokio::spawn(async move {
                    refuse(stream, &config).await;
                    drop(done);
                });
            }
        }
    }
    drop(stop);
    drop(done_guard);
    let _ = done.recv().await;
    Ok(())
}

/// Builds the HTTP/1 and HTTP/2 connection server with the header deadline.
fn builder(config: &HttpConfig) -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(config.header_read_timeout_ms));
    builder
        .http2()
        .timer(TokioTimer::new())
        .enable_connect_protocol();
    builder
}

async fn serve_admitted(
    stream: TcpStream,
    peer: SocketAddr,
    slot: ConnectionSlot,
    router: Router,
    config: &HttpConfig,
    mut stopping: watch::Receiver<()>,
) {
    let service = router.map_request(move |request: Request<Incoming>| {
        let mut request = request.map(Body::new);
        request.extensions_mut().insert(ConnectInfo(peer));
        request.extensions_mut().insert(slot.clone());
        request
    });
    let builder = builder(config);
    let mut connection =
        pin!(builder.serve_connection_with_upgrades(
            TokioIo::new(stream),
            TowerToHyperService::new(service)
        ));
    let finished = tokio::select! {
        result = connection.as_mut() => Some(result),
        // The node stops: requests in flight finish, then the connection closes.
        _ = stopping.changed() => None,
    };
    let result = match finished {
        Some(result) => result,
        None => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(error) = result {
        tracing::debug!(%error, %peer, "connection ended with an error");
    }
}

/// Answers every request of a connection over a cap with 503 and `Retry-After`, then closes.
async fn refuse(stream: TcpStream, config: &HttpConfig) {
    let retry_after = HeaderValue::from(config.retry_after_secs.max(1));
    let service = tower::service_fn(move |_request: Request<Incoming>| {
        let retry_after = retry_after.clone();
        async move {
            let body = r#"{"error":{"code":"unavailable","message":"too many connections"}}"#;
            let mut response = Response::new(Body::from(body));
            *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            let headers = response.headers_mut();
            headers.insert(header::RETRY_AFTER, retry_after);
            headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            Ok::<_, Infallible>(response)
        }
    });
    let builder = builder(config);
    let connection =
        builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
    // A refused client gets one header deadline to read its answer.
    let deadline = Duration::from_millis(config.header_read_timeout_ms);
    let _ = tokio::time::timeout(deadline, connection).await;
}
