//! A TCP proxy in front of a node, for network faults a real client must survive: `cut` drops
//! every proxied connection at once (no close frame, like a lost network), and
//! `hold_downstream` keeps what the node writes from reaching the client (an ack lost on the
//! way) until `release_downstream` or the cut; `refuse` cuts and keeps refusing new
//! connections (a network partition) until `admit`.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What every proxied connection follows: the cut generation and whether downstream is held.
#[derive(Default)]
struct Faults {
    cuts: u64,
    downstream_held: bool,
    refusing: bool,
}

/// The proxy; stops accepting (and drops its connections) when dropped.
pub struct Proxy {
    pub addr: SocketAddr,
    faults: watch::Sender<Faults>,
    acceptor: JoinHandle<()>,
}

impl Proxy {
    /// Listens on an ephemeral port and forwards every connection to `target`.
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy binds");
        let addr = listener.local_addr().expect("proxy address");
        let (faults, _) = watch::channel(Faults::default());
        let watcher = faults.clone();
        let acceptor = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if watcher.borrow().refusing {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                tokio::spawn(forward(client, server, watcher.subscribe()));
            }
        });
        Proxy {
            addr,
            faults,
            acceptor,
        }
    }

    /// `http://` base URL of the proxy.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Drops every connection open now; new ones are forwarded again.
    pub fn cut(&self) {
        self.faults.send_modify(|faults| faults.cuts += 1);
    }

    /// Drops every connection open now and every new one until [`Proxy::admit`].
    pub fn refuse(&self) {
        self.faults.send_modify(|faults| {
            faults.cuts += 1;
            faults.refusing = true;
        });
    }

    /// Forwards new connections again after [`Proxy::refuse`].
    pub fn admit(&self) {
        self.faults.send_modify(|faults| faults.refusing = false);
    }

    /// From now on, bytes from the node wait in the proxy instead of reaching the client.
    pub fn hold_downstream(&self) {
        self.faults
            .send_modify(|faults| faults.downstream_held = true);
    }

    /// Lets the node's bytes through again.
    pub fn release_downstream(&self) {
        self.faults
            .send_modify(|faults| faults.downstream_held = false);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.acceptor.abort();
        self.cut();
    }
}

/// Copies both ways until either side closes or the connection is cut.
async fn forward(client: TcpStream, server: TcpStream, mut faults: watch::Receiver<Faults>) {
    let born = faults.borrow().cuts;
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            let read = client_read.read(&mut buffer).await?;
            if read == 0 {
                return Ok::<(), std::io::Error>(());
            }
            server_write.write_all(&buffer[..read]).await?;
        }
    };
    let mut downstream_faults = faults.clone();
    let downstream = async {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            let read = server_read.read(&mut buffer).await?;
            if read == 0 {
                return Ok::<(), std::io::Error>(());
            }
            // Held bytes are delivered after the release, or lost with the cut.
            if downstream_faults
                .wait_for(|faults| !faults.downstream_held)
                .await
                .is_err()
            {
                return Ok(());
            }
            client_write.write_all(&buffer[..read]).await?;
        }
    };
    let cut = faults.wait_for(|faults| faults.cuts != born);
    tokio::select! {
        _ = upstream => {}
        _ = downstream => {}
        _ = cut => {}
    }
}
