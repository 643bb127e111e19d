//! A private PostgreSQL cluster for development and tests.
//!
//! With no database URL configured, `converger serve` and the test suite start (or reuse) a
//! cluster under a directory of their choosing, using the machine's PostgreSQL server binaries.
//! Layout under that directory:
//!
//! - `data/`: the cluster
//! - `server.log`: the server's log
//! - `password`: the `postgres` superuser's password (mode 0600)
//! - `port`: the loopback port the server was last started on
//! - `owner.pid`: pid of the [`Role::Owner`] process that stops the server on exit
//! - `start.lock`: serialises starts and stops across processes sharing the directory
//!
//! The server listens on 127.0.0.1 only and has no unix socket, so socket directory permissions
//! never matter. PostgreSQL refuses to run as root, so a root process runs the server as the
//! `postgres` user (or `nobody`).
//!
//! [`ReplicatedPair`] starts a primary and a synchronous standby the same way, for failover
//! tests.
//!
//! The crate is a process manager: it runs the machine's `initdb`, `pg_ctl` and
//! `pg_basebackup` and speaks no SQL.
#![forbid(unsafe_code)]

mod binaries;
mod cluster;
mod error;
mod lock;
mod process;
mod replication;
mod server_user;
#[cfg(test)]
mod tests;

pub use error::EmbeddedError;
pub use replication::{PairMember, ReplicatedPair};

use std::fmt;
use std::path::Path;

use tracing::{debug, info};

use crate::binaries::locate_server_binaries;
use crate::cluster::Cluster;
use crate::error::io_error;
use crate::lock::StartLock;
use crate::process::connection_url;
use crate::server_user::{create_private_dir, effective_uid, prepare_server_user};

/// Who is asking for the cluster: the owner stops it on exit, a guest never does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The long-running process (`converger serve`) that stops the server on exit.
    Owner,
    /// Admin CLI commands and test processes, which leave the server up for the next run to reuse.
    Guest,
}

/// Handle to a running embedded cluster; call [`EmbeddedPostgres::stop`] when done.
pub struct EmbeddedPostgres {
    cluster: Cluster,
    port: u16,
    password: String,
    url: String,
    started_here: bool,
    owns_server: bool,
}

impl fmt::Debug for EmbeddedPostgres {
    // Hand-written so the password (also inside the URL) never reaches a log line.
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("EmbeddedPostgres")
            .field("dir", &self.cluster.dir)
            .field("port", &self.port)
            .field("started_here", &self.started_here)
            .field("owns_server", &self.owns_server)
            .finish_non_exhaustive()
    }
}

impl EmbeddedPostgres {
    /// Starts the cluster in `dir` (initdb on first use), or reuses one that is already running there.
    pub async fn start(dir: &Path, role: Role) -> Result<EmbeddedPostgres, EmbeddedError> {
        let binaries = locate_server_binaries().await?;
        create_private_dir(dir).await?;
        let dir = tokio::fs::canonicalize(dir)
            .await
            .map_err(io_error("resolve", dir))?;
        let _start_lock = StartLock::acquire(&dir).await?;

        let run_as = if effective_uid(&dir).await? == 0 {
            Some(prepare_server_user(&dir).await?)
        } else {
            None
        };
        let cluster = Cluster {
            dir,
            binaries,
            run_as,
        };

        if !cluster.is_initialized().await? {
            cluster.initialize().await?;
        }
        let password = cluster.read_password().await?;

        if cluster.is_running().await? {
            let port = cluster.running_port().await?;
            // A previous owner killed with -9 leaves its server behind; the next owner takes
            // over stopping it so it does not run forever.
            let adopts = role == Role::Owner && !cluster.owner_is_alive().await;
            if adopts {
                cluster.write_owner_pid().await?;
                info!(
                    port,
                    dir = %cluster.dir.display(),
                    "embedded postgres adopted from a previous owner"
                );
            } else {
                info!(port, dir = %cluster.dir.display(), ?role, "embedded postgres reused");
            }
            return Ok(Self::new(cluster, port, password, false, adopts));
        }

        let port = cluster.start_server().await?;
        let owns_server = role == Role::Owner;
        if owns_server {
            cluster.write_owner_pid().await?;
        } else {
            // Any owner.pid names a process whose server is gone; a later owner must adopt.
            cluster.remove_owner_pid().await?;
        }
        info!(port, dir = %cluster.dir.display(), ?role, "embedded postgres started");
        Ok(Self::new(cluster, port, password, true, owns_server))
    }

    fn new(
        cluster: Cluster,
        port: u16,
        password: String,
        started_here: bool,
        owns_server: bool,
    ) -> Self {
        let url = connection_url(&password, port, "postgres");
        Self {
            cluster,
            port,
            password,
            url,
            started_here,
            owns_server,
        }
    }

    /// Connection URL for the `postgres` database (e.g. postgres://postgres:PASSWORD@127.0.0.1:PORT/postgres).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// URL for another database name on the same server.
    pub fn url_for(&self, database: &str) -> String {
        connection_url(&self.password, self.port, database)
    }

    /// True when this process started the server (and, as owner, will stop it).
    pub fn started_here(&self) -> bool {
        self.started_here
    }

    /// Stops the server if this handle owns it; a guest handle does nothing.
    pub async fn stop(self) -> Result<(), EmbeddedError> {
        if !self.owns_server {
            debug!(
                port = self.port,
                dir = %self.cluster.dir.display(),
                "embedded postgres left running"
            );
            return Ok(());
        }
        let _start_lock = StartLock::acquire(&self.cluster.dir).await?;
        self.cluster.stop_server().await?;
        self.cluster.remove_owner_pid().await?;
        info!(port = self.port, dir = %self.cluster.dir.display(), "embedded postgres stopped");
        Ok(())
    }

    /// Stops the server of a handle that started it as a guest (a short-lived command), unless
    /// an owner claimed it meanwhile (a `serve` that reused it adopted it, under the same start
    /// lock, so this never stops a server another process relies on as its owner). An owner's
    /// handle stops as [`EmbeddedPostgres::stop`]; a handle that found the server running does
    /// nothing.
    pub async fn stop_if_unclaimed(self) -> Result<(), EmbeddedError> {
        if self.owns_server {
            return self.stop().await;
        }
        if !self.started_here {
            return Ok(());
        }
        let _start_lock = StartLock::acquire(&self.cluster.dir).await?;
        if self.cluster.owner_is_alive().await {
            debug!(port = self.port, dir = %self.cluster.dir.display(), "embedded postgres claimed by an owner; left running");
            return Ok(());
        }
        self.cluster.stop_server().await?;
        self.cluster.remove_owner_pid().await?;
        info!(port = self.port, dir = %self.cluster.dir.display(), "embedded postgres stopped");
        Ok(())
    }
}
