//! Real `converger serve` processes forming a cluster on 127.0.0.1 over one test database:
//! distinct HTTP and gossip ports (both picked by the node and read from its logs).

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::{converger_bin, test_config};

// The poll loop lives in the support module; cluster tests name it from here as before.
pub use super::eventually;

/// Settle delay of the cluster tests' members: well above gossip propagation (~200 ms).
pub const SETTLE_MS: u64 = 700;

/// One node process.
pub struct NodeProcess {
    /// Its node id.
    pub name: String,
    /// `http://host:port`.
    pub base_url: String,
    /// Its gossip address, for other nodes' seeds.
    pub gossip_addr: String,
    child: Child,
    _state_dir: tempfile::TempDir,
}

impl NodeProcess {
    /// Starts a node named `name` that joins the cluster through `seeds`.
    pub async fn start(database_url: &str, name: &str, seeds: &[String]) -> NodeProcess {
        NodeProcess::start_with(database_url, name, seeds, &[]).await
    }

    /// As [`NodeProcess::start`], with more environment variables (`CONVERGER_*` settings).
    pub async fn start_with(
        database_url: &str,
        name: &str,
        seeds: &[String],
        env: &[(&str, &str)],
    ) -> NodeProcess {
        let config = test_config();
        let state_dir = tempfile::tempdir().expect("state dir");
        let mut child = Command::new(converger_bin())
            .arg("serve")
            .env("CONVERGER_DATABASE_URL", database_url)
            .env("CONVERGER_NODE_ID", name)
            .env("CONVERGER_HTTP_ADDR", "127.0.0.1:0")
            .env("CONVERGER_GOSSIP_ADDR", "127.0.0.1:0")
            .env("CONVERGER_SEEDS", seeds.join(","))
            .env("CONVERGER_SECRET_KEY", &config.secret_key)
            .env("CONVERGER_ADMIN_TOKEN", &config.admin_token)
            .env("CONVERGER_STATE_DIR", state_dir.path())
            .env("CONVERGER_GROUP_SETTLE_MS", SETTLE_MS.to_string())
            .env("CONVERGER_DRAIN__BATCH_INTERVAL_MS", "10")
            .env("CONVERGER_DRAIN__RETRY_AFTER_MS", "50")
            .env("CONVERGER_LOG_FORMAT", "json")
            .env(
                "RUST_LOG",
                std::env::var("NODE_LOG_FILTER")
                    .unwrap_or_else(|_| "info,sqlx=warn,chitchat=warn".into()),
            )
            // The caller's settings last: they win over the test defaults above.
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("serve starts");
        let stderr = child.stderr.take().expect("stderr piped");
        let mut lines = BufReader::new(stderr).lines();
        let mut http_addr = None;
        let mut gossip_addr = None;
        let read_addresses = async {
            while let Some(line) = lines.next_line().await.expect("read node logs") {
                let Ok(entry) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                let fields = &entry["fields"];
                match fields["message"].as_str() {
                    Some("gossip started") => {
                        gossip_addr = fields["gossip_addr"].as_str().map(str::to_owned)
                    }
                    Some("converger listening") => {
                        http_addr = fields["addr"].as_str().map(str::to_owned)
                    }
                    _ => {}
                }
                if http_addr.is_some() && gossip_addr.is_some() {
                    return;
                }
            }
            panic!("node {name} exited before it was listening");
        };
        tokio::time::timeout(Duration::from_secs(60), read_addresses)
            .await
            .expect("node logs its addresses in time");
        // Keep draining the pipe so the process never blocks on a full stderr; with
        // NODE_LOGS_DIR=<dir> the lines are kept there for a failing run.
        let keep = std::env::var_os("NODE_LOGS_DIR").map(|dir| {
            std::path::Path::new(&dir).join(format!("{name}-{}.log", child.id().unwrap_or(0)))
        });
        tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Ok(Some(line)) = lines.next_line().await {
                if keep.is_some() {
                    kept.push(line);
                }
            }
            if let Some(path) = keep {
                let _ = std::fs::write(path, kept.join("\n"));
            }
        });
        NodeProcess {
            name: name.to_owned(),
            base_url: format!("http://{}", http_addr.expect("http address")),
            gossip_addr: gossip_addr.expect("gossip address"),
            child,
            _state_dir: state_dir,
        }
    }

    /// This node's `/metrics` text.
    pub async fn metrics(&self) -> String {
        reqwest::Client::new()
            .get(format!("{}/metrics", self.base_url))
            .send()
            .await
            .expect("metrics request")
            .text()
            .await
            .expect("metrics body")
    }

    /// The WebSocket endpoint.
    pub fn ws_url(&self) -> String {
        format!(
            "{}/socket/converger/v1",
            self.base_url.replacen("http://", "ws://", 1)
        )
    }

    /// `GET /api/v1/admin/cluster` of this node.
    pub async fn cluster_view(&self) -> Value {
        reqwest::Client::new()
            .get(format!("{}/api/v1/admin/cluster", self.base_url))
            .bearer_auth(test_config().admin_token)
            .send()
            .await
            .expect("cluster view request")
            .error_for_status()
            .expect("cluster view status")
            .json()
            .await
            .expect("cluster view body")
    }

    /// Kills the process without warning (SIGKILL) and reaps it.
    pub async fn kill_9(mut self) {
        self.child.start_kill().expect("kill -9");
        let _ = self.child.wait().await;
    }

    /// Sends SIGTERM and waits for a clean exit (draining included).
    pub async fn terminate(mut self) {
        let pid = self.child.id().expect("node still running").to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .await
            .expect("kill runs");
        assert!(status.success());
        let exit = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("node exits after SIGTERM")
            .expect("wait on node");
        assert!(exit.success(), "node {} exited with {exit}", self.name);
    }
}

/// Live node ids (self included) in a node's cluster view.
pub fn live_nodes(view: &Value) -> Vec<String> {
    let mut ids: Vec<String> = view["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|node| node["status"] == "self" || node["status"] == "live")
        .filter_map(|node| node["id"].as_str().map(str::to_owned))
        .collect();
    ids.sort();
    ids
}

/// Connection ids of the members in a node's cluster view.
pub fn member_connections(view: &Value) -> Vec<String> {
    let mut ids: Vec<String> = view["members"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|member| member["connectionId"].as_str().map(str::to_owned))
        .collect();
    ids.sort();
    ids
}

/// Waits until every node sees exactly `expected` as its live nodes.
pub async fn wait_for_live_nodes(nodes: &[&NodeProcess], expected: &[&str]) {
    let mut expected: Vec<String> = expected.iter().map(|id| id.to_string()).collect();
    expected.sort();
    for node in nodes {
        eventually(
            &format!("{} sees live nodes {expected:?}", node.name),
            Duration::from_secs(15),
            || async { live_nodes(&node.cluster_view().await) == expected },
        )
        .await;
    }
}

/// Waits until every node lists exactly these member connections.
pub async fn wait_for_members(nodes: &[&NodeProcess], connections: &[&str]) {
    let mut expected: Vec<String> = connections.iter().map(|id| id.to_string()).collect();
    expected.sort();
    for node in nodes {
        eventually(
            &format!("{} sees members {expected:?}", node.name),
            Duration::from_secs(15),
            || async { member_connections(&node.cluster_view().await) == expected },
        )
        .await;
    }
}
