//! The accept loop: every TCP connection is admitted or refused before any request is read, and
//! every connection has a deadline for what it owes the server.
//!
//! - A node holds at most `http.max_connections` places, and at most
//!   `http.max_connections_per_address` from one client address (`admission.rs`): a TCP
//!   connection takes one, and so does every HTTP/2 request beyond the first running at once on
//!   a connection, so the caps count sessions, not sockets. Over either cap the connection (or
//!   the HTTP/2 request) gets `503 Service Unavailable` with `Retry-After`, before any upgrade;
//!   `/health/*` and `/metrics` are still answered.
//! - A connection with no request in progress is closed after `http.header_read_timeout_ms`
//!   (`in_use.rs`): silent sockets, bare HTTP/2 prefaces, headers that never end, idle
//!   keep-alives. A request's body must arrive within `http.body_read_timeout_ms` (a layer of
//!   the router); a WebSocket's `hello` within `limits.hello_timeout_ms` (the session).
//! - A request holds a [`SessionSlot`] (its place and its mark on the connection) until its
//!   response body is done; a WebSocket upgrade takes it into its session, so a socket counts
//!   for as long as it is open.
//! - Accept errors (out of descriptors) back off instead of spinning.

mod admission;
mod in_use;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, Response, StatusCode, Version, header};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tower::ServiceExt as _;

use self::admission::RefusalTurn;
pub(crate) use self::admission::{Admission, ConnectionSlot};
pub(crate) use self::in_use::SessionSlot;
use self::in_use::{HeldBody, InUse};
use crate::config::HttpConfig;

/// The first pause after a failed accept; it doubles up to [`ACCEPT_BACKOFF_MAX`] while
/// accepts keep failing, and starts again after one succeeds.
const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// How long an idle connection told to close may take to say goodbye.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(1);

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
    let mut backoff = ACCEPT_BACKOFF_MIN;
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => {
                    backoff = ACCEPT_BACKOFF_MIN;
                    accepted
                }
                Err(error) => {
                    // Out of descriptors or a reset before accept: keep serving the others, and
                    // give closing connections time to free descriptors before trying again.
                    metrics::counter!("converger_accept_errors_total").increment(1);
                    tracing::warn!(%error, pause_ms = backoff.as_millis() as u64, "accept failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(ACCEPT_BACKOFF_MAX);
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
        let connection = Connection {
            peer,
            router: router.clone(),
            admission: admission.clone(),
            config: config.clone(),
        };
        if let Some(slot) = admission.admit(peer.ip()) {
            tokio::spawn(async move {
                connection.serve_admitted(stream, slot, stopping).await;
                drop(done);
            });
            continue;
        }
        // Over a cap: answered 503 (the oldest refusal gives way when too many are answered).
        let turn = admission.refusal();
        tokio::spawn(async move {
            connection.refuse(stream, turn).await;
            drop(done);
        });
    }
    drop(stop);
    drop(done_guard);
    let _ = done.recv().await;
    Ok(())
}

/// Builds the HTTP/1 and HTTP/2 connection server with the header deadline and the HTTP/2
/// stream cap.
fn builder(config: &HttpConfig) -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(config.header_read_timeout_ms));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(config.max_concurrent_streams)
        .enable_connect_protocol();
    builder
}

/// Why an admitted connection's serving loop stopped.
enum Ending<E> {
    Finished(Result<(), E>),
    Stopping,
    Idle,
}

/// One accepted TCP connection and what serving it needs.
#[derive(Clone)]
struct Connection {
    peer: SocketAddr,
    router: Router,
    admission: Admission,
    config: HttpConfig,
}

impl Connection {
    /// Serves an admitted connection until it closes, goes idle, or the node stops.
    async fn serve_admitted(
        self,
        stream: TcpStream,
        slot: ConnectionSlot,
        mut stopping: watch::Receiver<()>,
    ) {
        let peer = self.peer;
        let idle_deadline = Duration::from_millis(self.config.header_read_timeout_ms);
        let builder = builder(&self.config);
        let in_use = InUse::new();
        let service = {
            let in_use = Arc::clone(&in_use);
            tower::service_fn(move |request: Request<Incoming>| {
                let connection = self.clone();
                let (before, hold) = in_use.begin();
                // The connection's own place covers its first request; an HTTP/2 request that
                // runs beside others takes a place of its own.
                let place = if before == 0 {
                    Some(slot.clone())
                } else {
                    connection.admission.admit(peer.ip())
                };
                async move {
                    let response = match place {
                        Some(place) => {
                            connection
                                .handle(request, SessionSlot::new(place, hold))
                                .await
                        }
                        None => connection.over_cap(request).await,
                    };
                    Ok::<_, Infallible>(response)
                }
            })
        };
        let mut connection = pin!(builder.serve_connection_with_upgrades(
            TokioIo::new(stream),
            TowerToHyperService::new(service)
        ));
        let ending = tokio::select! {
            result = connection.as_mut() => Ending::Finished(result),
            // The node stops: requests in flight finish, then the connection closes.
            _ = stopping.changed() => Ending::Stopping,
            // Nothing in progress for a header deadline: a silent socket, a bare HTTP/2 preface,
            // headers that never end, or an idle keep-alive.
            () = in_use.idle_for(idle_deadline) => Ending::Idle,
        };
        let result = match ending {
            Ending::Finished(result) => result,
            Ending::Stopping => {
                connection.as_mut().graceful_shutdown();
                connection.await
            }
            Ending::Idle => {
                metrics::counter!("converger_connections_idle_closed_total").increment(1);
                connection.as_mut().graceful_shutdown();
                tokio::time::timeout(IDLE_CLOSE_GRACE, connection)
                    .await
                    .unwrap_or(Ok(()))
            }
        };
        if let Err(error) = result {
            tracing::debug!(%error, %peer, "connection ended with an error");
        }
    }

    /// Serves one admitted request; its response body holds `slot`.
    async fn handle(&self, request: Request<Incoming>, slot: SessionSlot) -> Response<Body> {
        let mut request = request.map(Body::new);
        request.extensions_mut().insert(ConnectInfo(self.peer));
        request.extensions_mut().insert(slot.clone());
        let response = match self.router.clone().oneshot(request).await {
            Ok(response) => response,
            Err(infallible) => match infallible {},
        };
        response.map(|body| Body::new(HeldBody::new(body, slot)))
    }

    /// A request over a cap: the health checks and metrics are answered (a load balancer and
    /// a scraper must still see the node), anything else gets 503 with `Retry-After`.
    async fn over_cap(&self, request: Request<Incoming>) -> Response<Body> {
        let path = request.uri().path();
        if path.starts_with("/health/") || path == "/metrics" {
            let mut request = request.map(Body::new);
            request.extensions_mut().insert(ConnectInfo(self.peer));
            return match self.router.clone().oneshot(request).await {
                Ok(response) => response,
                Err(infallible) => match infallible {},
            };
        }
        let retry_after = HeaderValue::from(self.config.retry_after_secs.max(1));
        let body = r#"{"error":{"code":"unavailable","message":"too many connections"}}"#;
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        let headers = response.headers_mut();
        headers.insert(header::RETRY_AFTER, retry_after);
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }

    /// Answers the requests of a connection over a cap (see [`Connection::over_cap`]) for one
    /// header deadline at most, or until a newer refusal needs its turn, then closes it.
    async fn refuse(self, stream: TcpStream, turn: RefusalTurn) {
        let deadline = Duration::from_millis(self.config.header_read_timeout_ms);
        let builder = builder(&self.config);
        let service = tower::service_fn(move |request: Request<Incoming>| {
            let connection = self.clone();
            async move {
                // HTTP/2 has no `Connection` header (hyper would strip it with a warning).
                let http1 = request.version() < Version::HTTP_2;
                let mut response = connection.over_cap(request).await;
                if http1 {
                    response
                        .headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                Ok::<_, Infallible>(response)
            }
        });
        let connection =
            builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        tokio::select! {
            _ = tokio::time::timeout(deadline, connection) => {}
            () = turn.evicted() => {}
        }
    }
}
