//! A TCP proxy in front of one node: every client connection of the soak goes through it, so a
//! fault can cut live connections the way a broken network does, both sockets closed at once
//! and no WebSocket close frame from either side. The listening address outlives the node's
//! restarts, so clients reconnect to the same URL.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::Context;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

/// Longest wait for the node to accept the proxied connection.
const UPSTREAM_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// Live proxied connections, by id.
type Links = Arc<Mutex<BTreeMap<u64, AbortHandle>>>;

/// The node's address, changed when a restarted node could not get its old port back.
type Upstream = Arc<Mutex<SocketAddr>>;

/// A running proxy; it stops accepting when dropped.
pub struct Proxy {
    addr: SocketAddr,
    upstream: Upstream,
    links: Links,
    accept: JoinHandle<()>,
}

impl Proxy {
    /// Listens on an ephemeral port of 127.0.0.1 and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("bind the proxy")?;
        let addr = listener.local_addr()?;
        let links: Links = Arc::default();
        let upstream: Upstream = Arc::new(Mutex::new(upstream));
        let accept = tokio::spawn(accept_loop(
            listener,
            Arc::clone(&upstream),
            Arc::clone(&links),
        ));
        Ok(Proxy {
            addr,
            upstream,
            links,
            accept,
        })
    }

    /// The proxy's listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Forwards new connections to `upstream` from now on.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        *lock(&self.upstream) = upstream;
    }

    /// The WebSocket endpoint of the node, through this proxy.
    pub fn ws_url(&self) -> String {
        format!("ws://{}/socket/converger/v1", self.addr)
    }

    /// Cuts the `index`-th live connection (modulo their number); false when there is none.
    pub fn cut_one(&self, index: usize) -> bool {
        let mut links = lock(&self.links);
        if links.is_empty() {
            return false;
        }
        let Some(id) = links.keys().nth(index % links.len()).copied() else {
            return false;
        };
        if let Some(link) = links.remove(&id) {
            link.abort();
        }
        true
    }

    /// Cuts every live connection; returns how many.
    pub fn cut_all(&self) -> usize {
        let links = std::mem::take(&mut *lock(&self.links));
        for link in links.values() {
            link.abort();
        }
        links.len()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut_all();
    }
}

/// Every update behind these locks is one assignment, insert or removal, so a poisoned lock
/// still holds consistent data.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn accept_loop(listener: TcpListener, upstream: Upstream, links: Links) {
    let next_id = AtomicU64::new(0);
    loop {
        let client = match listener.accept().await {
            Ok((client, _)) => client,
            Err(error) => {
                // Out of file descriptors and the like: wait rather than spin.
                tracing::warn!(%error, "proxy accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let id = next_id.fetch_add(1, Ordering::Relaxed);
        let upstream = *lock(&upstream);
        // Held across the spawn so the link's own removal cannot run before its insertion.
        let mut registry = lock(&links);
        let link = tokio::spawn(forward(client, upstream, id, Arc::clone(&links)));
        registry.insert(id, link.abort_handle());
    }
}

/// Removes its link from the registry when the forwarding ends, cut or not.
struct Registered {
    id: u64,
    links: Links,
}

impl Drop for Registered {
    fn drop(&mut self) {
        lock(&self.links).remove(&self.id);
    }
}

async fn forward(mut client: TcpStream, upstream: SocketAddr, id: u64, links: Links) {
    let _registered = Registered { id, links };
    let mut node =
        match tokio::time::timeout(UPSTREAM_CONNECT_TIMEOUT, TcpStream::connect(upstream)).await {
            Ok(Ok(node)) => node,
            // The node is down: the client sees its connection end, as with a refused one.
            _ => return,
        };
    let _ = client.set_nodelay(true);
    let _ = node.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut client, &mut node).await;
}
