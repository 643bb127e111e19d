//! The soak's cluster: `converger serve` processes over one fresh database with real gossip,
//! each behind its own [`Proxy`]. A killed node is restarted under the same name on the same
//! HTTP and gossip ports, so its proxy and the other nodes' seeds stay valid (on fresh ports,
//! with the proxy repointed, only when the old ones cannot be had).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::Value;
use tokio::time::Instant;

use super::metrics::{self, Totals};
use super::proxy::Proxy;
use crate::cluster::live_nodes;
use crate::gateway::{ADMIN_TOKEN, Gateway, database_url};

/// How the nodes are configured and where they keep their logs.
pub struct NodeSettings {
    /// The `converger` binary.
    pub binary: PathBuf,
    /// Postgres server URL (any database) the soak database was created on.
    pub server_url: String,
    /// The soak database.
    pub database: String,
    /// Environment common to every node (settle delay, lease, heartbeats, …).
    pub env: Vec<(&'static str, String)>,
    /// Folder for one log file per node incarnation.
    pub logs_dir: PathBuf,
}

/// One node: its name, its addresses (kept across restarts), its current process, its proxy.
struct Node {
    name: String,
    http_addr: SocketAddr,
    gossip_addr: String,
    process: Option<Gateway>,
    proxy: Proxy,
    incarnation: u32,
}

/// The nodes of the soak.
pub struct Cluster {
    settings: NodeSettings,
    nodes: Vec<Node>,
    /// Metrics of killed incarnations, scraped just before each kill.
    departed: Totals,
    http: reqwest::Client,
}

impl Cluster {
    /// Starts `count` nodes named a, b, c, …; every node after the first joins through it.
    pub async fn start(settings: NodeSettings, count: usize) -> anyhow::Result<Cluster> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()?;
        let mut cluster = Cluster {
            settings,
            nodes: Vec::new(),
            departed: Totals::default(),
            http,
        };
        for index in 0..count {
            let name = node_name(index);
            let seeds: Vec<String> = cluster
                .nodes
                .first()
                .map(|first| vec![first.gossip_addr.clone()])
                .unwrap_or_default();
            let env = cluster.node_env(&name, &seeds, None);
            let process = cluster.spawn(&name, 0, &env).await?;
            let http_addr: SocketAddr = process
                .base_url
                .trim_start_matches("http://")
                .parse()
                .context("the node's HTTP address")?;
            let gossip_addr = process
                .gossip_addr
                .clone()
                .with_context(|| format!("node {name} logged no gossip address"))?;
            let proxy = Proxy::start(http_addr).await?;
            cluster.nodes.push(Node {
                name,
                http_addr,
                gossip_addr,
                process: Some(process),
                proxy,
                incarnation: 0,
            });
        }
        cluster.wait_for_live_nodes(Duration::from_secs(60)).await?;
        Ok(cluster)
    }

    /// How many nodes (running or not).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// The node's name.
    pub fn name(&self, index: usize) -> &str {
        &self.nodes[index].name
    }

    /// The WebSocket URL clients use for node `index`: through its proxy.
    pub fn ws_url(&self, index: usize) -> String {
        self.nodes[index].proxy.ws_url()
    }

    /// The node's own HTTP base URL, for REST and admin calls.
    pub fn base_url(&self, index: usize) -> String {
        format!("http://{}", self.nodes[index].http_addr)
    }

    /// The proxy of node `index`.
    pub fn proxy(&self, index: usize) -> &Proxy {
        &self.nodes[index].proxy
    }

    /// Points the checker and the fault injector at another Postgres server (a promoted
    /// standby); the nodes find it by themselves.
    pub fn set_server_url(&mut self, server_url: String) {
        self.settings.server_url = server_url;
    }

    /// URL of the soak database.
    pub fn database_url(&self) -> String {
        database_url(&self.settings.server_url, &self.settings.database)
    }

    /// The soak database's name.
    pub fn database(&self) -> &str {
        &self.settings.database
    }

    /// Where the node logs are.
    pub fn logs_dir(&self) -> &Path {
        &self.settings.logs_dir
    }

    /// Scrapes node `index`'s metrics into the departed totals, then kills it with SIGKILL.
    pub async fn kill(&mut self, index: usize) -> anyhow::Result<()> {
        let Some(process) = self.nodes[index].process.take() else {
            bail!("node {} is not running", self.nodes[index].name);
        };
        match metrics::scrape(&self.http, &process.base_url).await {
            Ok(totals) => self.departed.add(&totals),
            Err(error) => {
                tracing::warn!(node = %self.nodes[index].name, %error, "no metrics before the kill")
            }
        }
        process.kill().await;
        Ok(())
    }

    /// Starts node `index` again under its name and on its ports, seeded with the other nodes.
    pub async fn restart(&mut self, index: usize) -> anyhow::Result<()> {
        let node = &self.nodes[index];
        if node.process.is_some() {
            bail!("node {} is running", node.name);
        }
        let name = node.name.clone();
        let incarnation = node.incarnation + 1;
        let seeds: Vec<String> = self
            .nodes
            .iter()
            .filter(|other| other.name != name)
            .map(|other| other.gossip_addr.clone())
            .collect();
        let same_ports = self.node_env(&name, &seeds, Some(node));
        let fresh_ports = self.node_env(&name, &seeds, None);
        // The ports were just freed by the kill; a few tries cover a slow release. Should an
        // outgoing connection have taken the HTTP port meanwhile, fresh ports and a repointed
        // proxy keep the run going (clients never see the node's own address).
        let mut last_error = None;
        for env in [&same_ports, &same_ports, &same_ports, &fresh_ports] {
            match self.spawn(&name, incarnation, env).await {
                Ok(process) => return self.adopt(index, process, incarnation),
                Err(error) => {
                    tracing::warn!(node = %name, %error, "restart failed; trying again");
                    last_error = Some(error);
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        Err(last_error.unwrap_or_else(|| anyhow::anyhow!("node {name} did not restart")))
    }

    /// Records the new incarnation of node `index`, following it to new ports if it moved.
    fn adopt(&mut self, index: usize, process: Gateway, incarnation: u32) -> anyhow::Result<()> {
        let http_addr: SocketAddr = process
            .base_url
            .trim_start_matches("http://")
            .parse()
            .context("the node's HTTP address")?;
        let node = &mut self.nodes[index];
        if http_addr != node.http_addr {
            tracing::warn!(node = %node.name, %http_addr, "restarted on new ports");
            node.proxy.set_upstream(http_addr);
            node.http_addr = http_addr;
        }
        if let Some(gossip_addr) = &process.gossip_addr {
            node.gossip_addr = gossip_addr.clone();
        }
        node.process = Some(process);
        node.incarnation = incarnation;
        Ok(())
    }

    /// Waits until every node's cluster view shows all nodes live.
    pub async fn wait_for_live_nodes(&self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        for index in 0..self.nodes.len() {
            loop {
                let live = self.cluster_view(index).await.map(|view| live_nodes(&view));
                if matches!(live, Ok(count) if count >= self.nodes.len()) {
                    break;
                }
                if Instant::now() > deadline {
                    bail!(
                        "node {} never saw {} live nodes (last: {live:?})",
                        self.nodes[index].name,
                        self.nodes.len()
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }

    /// Waits until every node lists at least `count` group members.
    pub async fn wait_for_members(&self, count: usize, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        for index in 0..self.nodes.len() {
            loop {
                let members = self.cluster_view(index).await.map(|view| {
                    view["members"]
                        .as_array()
                        .map(|members| members.len())
                        .unwrap_or(0)
                });
                if matches!(members, Ok(listed) if listed >= count) {
                    break;
                }
                if Instant::now() > deadline {
                    bail!(
                        "node {} never listed {count} members (last: {members:?})",
                        self.nodes[index].name
                    );
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }

    /// The metrics of every incarnation so far: the running nodes scraped now, plus the
    /// killed ones as scraped before their kill.
    pub async fn metrics(&self) -> anyhow::Result<Totals> {
        let mut totals = self.departed.clone();
        for node in &self.nodes {
            let Some(process) = &node.process else {
                continue;
            };
            totals.add(&metrics::scrape(&self.http, &process.base_url).await?);
        }
        Ok(totals)
    }

    /// Kills every node; drops the database unless `keep_database`.
    pub async fn shutdown(mut self, keep_database: bool) -> anyhow::Result<()> {
        for node in &mut self.nodes {
            if let Some(process) = node.process.take() {
                process.kill().await;
            }
        }
        if keep_database {
            return Ok(());
        }
        crate::gateway::drop_database(&self.settings.server_url, &self.settings.database).await
    }

    async fn cluster_view(&self, index: usize) -> anyhow::Result<Value> {
        Ok(self
            .http
            .get(format!("{}/api/v1/admin/cluster", self.base_url(index)))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    fn node_env(
        &self,
        name: &str,
        seeds: &[String],
        previous: Option<&Node>,
    ) -> Vec<(&'static str, String)> {
        let mut env = self.settings.env.clone();
        env.push(("CONVERGER_NODE_ID", name.to_owned()));
        env.push(("CONVERGER_SEEDS", seeds.join(",")));
        if let Some(node) = previous {
            env.push(("CONVERGER_HTTP_ADDR", node.http_addr.to_string()));
            env.push(("CONVERGER_GOSSIP_ADDR", node.gossip_addr.clone()));
        }
        env
    }

    async fn spawn(
        &self,
        name: &str,
        incarnation: u32,
        env: &[(&'static str, String)],
    ) -> anyhow::Result<Gateway> {
        let log_file = self
            .settings
            .logs_dir
            .join(format!("{name}-{incarnation}.log"));
        let env: Vec<(&str, String)> = env.to_vec();
        Gateway::start_logged(
            &self.settings.binary,
            &self.settings.server_url,
            &self.settings.database,
            &env,
            Some(log_file),
        )
        .await
    }
}

/// a, b, c, … (then n26, n27, … for larger clusters).
fn node_name(index: usize) -> String {
    match u8::try_from(index) {
        Ok(small) if small < 26 => char::from(b'a' + small).to_string(),
        _ => format!("n{index}"),
    }
}
