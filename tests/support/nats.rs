//! Real `nats-server` processes for the NATS bus tests (ADR 0033): one server, or a cluster of
//! servers joined by routes, on ephemeral loopback ports. `.ci/test-prerequisites` installs the
//! server; `CONVERGER_NATS_SERVER` names another binary.

use std::collections::{BTreeSet, HashMap};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::AsyncReadExt;

/// Longest wait for a subscription to show on the monitoring endpoint.
const SUBSCRIPTIONS_WAIT: Duration = Duration::from_secs(10);

/// One server; killed when dropped.
pub struct NatsServer {
    /// The client port.
    pub addr: SocketAddr,
    /// The monitoring port (`/connz`).
    monitor: u16,
    args: Vec<String>,
    child: Option<Child>,
}

fn binary() -> String {
    std::env::var("CONVERGER_NATS_SERVER").unwrap_or_else(|_| "nats-server".into())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port()
}

impl NatsServer {
    /// A server alone.
    pub async fn start() -> NatsServer {
        NatsServer::launch(free_port(), Vec::new()).await
    }

    /// `size` servers joined in one NATS cluster (every server routes to every other).
    pub async fn cluster(size: usize) -> Vec<NatsServer> {
        let route_ports: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let routes = route_ports
            .iter()
            .map(|port| format!("nats://127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut servers = Vec::new();
        for port in &route_ports {
            let args = vec![
                "--cluster_name".into(),
                "converger-test".into(),
                "--cluster".into(),
                format!("nats://127.0.0.1:{port}"),
                "--routes".into(),
                routes.clone(),
            ];
            servers.push(NatsServer::launch(free_port(), args).await);
        }
        servers
    }

    async fn launch(port: u16, mut args: Vec<String>) -> NatsServer {
        let monitor = free_port();
        args.splice(
            0..0,
            [
                "-a".into(),
                "127.0.0.1".into(),
                "-p".into(),
                port.to_string(),
                "-m".into(),
                monitor.to_string(),
            ],
        );
        let mut server = NatsServer {
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            monitor,
            args,
            child: None,
        };
        server.restart().await;
        server
    }

    /// The server's URL for `nats.servers`.
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// The subjects each client connection subscribes to, by connection name, as the server's
    /// monitoring endpoint (`/connz?subs=1`) lists them.
    pub async fn subscriptions(&self) -> HashMap<String, BTreeSet<String>> {
        let url = format!("http://127.0.0.1:{}/connz?subs=1", self.monitor);
        let connz: serde_json::Value = reqwest::get(url)
            .await
            .expect("connz answers")
            .json()
            .await
            .expect("connz is JSON");
        let connections = connz["connections"].as_array().cloned().unwrap_or_default();
        connections
            .iter()
            .map(|connection| {
                let name = connection["name"].as_str().unwrap_or_default().to_owned();
                let subjects = connection["subscriptions_list"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|subject| subject.as_str().map(str::to_owned))
                    .collect();
                (name, subjects)
            })
            .collect()
    }

    /// Waits until exactly the connections named `names` subscribe to `subject`.
    pub async fn until_subscribers(&self, subject: &str, names: &[&str]) {
        let expected: BTreeSet<&str> = names.iter().copied().collect();
        let what = format!("exactly {expected:?} subscribing to {subject}");
        super::eventually(&what, SUBSCRIPTIONS_WAIT, || async {
            let subscriptions = self.subscriptions().await;
            let subscribers: BTreeSet<&str> = subscriptions
                .iter()
                .filter(|(_, subjects)| subjects.contains(subject))
                .map(|(name, _)| name.as_str())
                .collect();
            subscribers == expected
        })
        .await;
    }

    /// Waits until the connection named `name` subscribes to exactly `subjects`.
    pub async fn until_subjects(&self, name: &str, subjects: &[&str]) {
        let expected: BTreeSet<String> = subjects.iter().map(|s| (*s).to_owned()).collect();
        let what = format!("{name} subscribing to exactly {expected:?}");
        super::eventually(&what, SUBSCRIPTIONS_WAIT, || async {
            self.subscriptions().await.get(name) == Some(&expected)
        })
        .await;
    }

    /// Kills the server at once (no lame duck, no goodbye to clients).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server (again, on the same ports) and waits until it greets a client.
    pub async fn restart(&mut self) {
        self.kill();
        let child = Command::new(binary())
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "cannot start {} (install it with .ci/test-prerequisites): {error}",
                    binary()
                )
            });
        self.child = Some(child);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut stream) = tokio::net::TcpStream::connect(self.addr).await {
                let mut greeting = [0u8; 4];
                let read =
                    tokio::time::timeout(Duration::from_secs(2), stream.read_exact(&mut greeting))
                        .await;
                if matches!(read, Ok(Ok(_))) && &greeting == b"INFO" {
                    return;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "nats-server on {} did not start",
                self.addr
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}
