//! `--bus nats`: the soak's NATS cluster (ADR 0033), real `nats-server` processes joined by
//! routes, each behind a TCP proxy through which the nodes reach it, so a fault can kill a
//! server (and start it again on the same ports) or cut the nodes' connections to one.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

use super::proxy::Proxy;

/// One server: its ports, its arguments (to start it again) and its process.
struct Server {
    addr: SocketAddr,
    args: Vec<String>,
    log: std::path::PathBuf,
    process: Option<Child>,
}

/// The NATS cluster of the soak; its servers are killed when it is dropped.
pub struct NatsCluster {
    servers: Vec<Server>,
    proxies: Vec<Proxy>,
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn binary() -> String {
    std::env::var("CONVERGER_NATS_SERVER").unwrap_or_else(|_| "nats-server".into())
}

impl NatsCluster {
    /// `count` servers routed to each other, logging under `logs_dir`.
    pub async fn start(count: usize, logs_dir: &Path) -> anyhow::Result<NatsCluster> {
        let route_ports = (0..count)
            .map(|_| free_port())
            .collect::<anyhow::Result<Vec<_>>>()?;
        let routes = route_ports
            .iter()
            .map(|port| format!("nats://127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = NatsCluster {
            servers: Vec::new(),
            proxies: Vec::new(),
        };
        for (index, route_port) in route_ports.iter().enumerate() {
            let port = free_port()?;
            let args = vec![
                "-a".into(),
                "127.0.0.1".into(),
                "-p".into(),
                port.to_string(),
                "--cluster_name".into(),
                "converger-soak".into(),
                "--cluster".into(),
                format!("nats://127.0.0.1:{route_port}"),
                "--routes".into(),
                routes.clone(),
            ];
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            cluster.servers.push(Server {
                addr,
                args,
                log: logs_dir.join(format!("nats-{index}.log")),
                process: None,
            });
            cluster.restart(index).await?;
            cluster.proxies.push(Proxy::start(addr).await?);
        }
        Ok(cluster)
    }

    /// The servers as the nodes reach them (through the proxies), for `nats.servers`.
    pub fn urls(&self) -> String {
        self.proxies
            .iter()
            .map(|proxy| format!("nats://{}", proxy.addr()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// How many servers.
    pub fn len(&self) -> usize {
        self.servers.len()
    }

    /// SIGKILLs server `index`.
    pub async fn kill(&mut self, index: usize) {
        if let Some(mut process) = self.servers[index].process.take() {
            let _ = process.kill().await;
        }
    }

    /// Cuts every connection through server `index`'s proxy; returns how many.
    pub fn cut(&self, index: usize) -> usize {
        self.proxies[index].cut_all()
    }

    /// Starts server `index` (again, on its ports) and waits until it greets a client.
    pub async fn restart(&mut self, index: usize) -> anyhow::Result<()> {
        self.kill(index).await;
        let server = &mut self.servers[index];
        let log = std::fs::File::create(&server.log)
            .with_context(|| format!("create {}", server.log.display()))?;
        let process = Command::new(binary())
            .args(&server.args)
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("start {} (see .ci/test-prerequisites)", binary()))?;
        server.process = Some(process);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while tokio::time::Instant::now() < deadline {
            if let Ok(mut stream) = tokio::net::TcpStream::connect(server.addr).await {
                let mut greeting = [0u8; 4];
                let read =
                    tokio::time::timeout(Duration::from_secs(2), stream.read_exact(&mut greeting))
                        .await;
                if matches!(read, Ok(Ok(_))) && &greeting == b"INFO" {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bail!("nats-server on {} did not start", server.addr)
    }
}
