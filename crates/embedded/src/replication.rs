//! A primary and a synchronous standby on loopback, started from the machine's server binaries,
//! for failover tests and the soak's failover fault: kill -9 the primary, promote the standby,
//! and rebuild the dead one as the new primary's standby on its old port.
//!
//! Layout under the pair's directory: `a/` and `b/`, each laid out as an embedded cluster
//! (`data/`, `server.log`, `password`, `port`). The pair is always created afresh; `a` starts
//! as the primary.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tracing::info;

use crate::binaries::locate_server_binaries;
use crate::cluster::Cluster;
use crate::error::{EmbeddedError, io_error};
use crate::process::{SUPERUSER, connection_url, describe_output, run_command};
use crate::server_user::{
    chown_to, create_private_dir, effective_uid, prepare_server_user, write_private_file,
};

const BASE_BACKUP_TIMEOUT: Duration = Duration::from_secs(120);
const PROMOTE_TIMEOUT: Duration = Duration::from_secs(70);
const KILL_TIMEOUT: Duration = Duration::from_secs(10);

/// The primary waits for any standby to confirm each commit, so an ack survives its death.
const SYNCHRONOUS: &str = "-c synchronous_standby_names='*'";

/// A server of the pair, by its current role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairMember {
    /// The one that accepts writes (after a promotion, the promoted one).
    Primary,
    /// The other one: the standby, or the killed former primary.
    Standby,
}

/// A running primary and synchronous standby; stop with [`ReplicatedPair::stop`].
pub struct ReplicatedPair {
    members: [Cluster; 2],
    ports: [u16; 2],
    /// Index of the current primary in `members`.
    primary: usize,
    password: String,
    /// The postmasters' pids, killed on drop if `stop` was not reached (a failing test).
    pids: [Option<String>; 2],
}

impl std::fmt::Debug for ReplicatedPair {
    // Hand-written so the password never reaches a log line.
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ReplicatedPair")
            .field("ports", &self.ports)
            .field("primary", &self.primary)
            .finish_non_exhaustive()
    }
}

impl ReplicatedPair {
    /// Creates both clusters under `dir` (removing what was there) and starts them.
    pub async fn start(dir: &Path) -> Result<ReplicatedPair, EmbeddedError> {
        let binaries = locate_server_binaries().await?;
        if tokio::fs::try_exists(dir).await.unwrap_or(false) {
            tokio::fs::remove_dir_all(dir)
                .await
                .map_err(io_error("remove", dir))?;
        }
        create_private_dir(dir).await?;
        let dir = tokio::fs::canonicalize(dir)
            .await
            .map_err(io_error("resolve", dir))?;
        let run_as = if effective_uid(&dir).await? == 0 {
            Some(prepare_server_user(&dir).await?)
        } else {
            None
        };
        let member = |name: &str| Cluster {
            dir: dir.join(name),
            binaries: binaries.clone(),
            run_as: run_as.clone(),
        };
        let members = [member("a"), member("b")];
        for cluster in &members {
            create_private_dir(&cluster.dir).await?;
            if let Some(user) = &run_as {
                chown_to(&cluster.dir, user)?;
            }
        }

        members[0].initialize().await?;
        let password = members[0].read_password().await?;
        let primary_port = members[0].start_server_with(SYNCHRONOUS).await?;
        let mut pair = ReplicatedPair {
            members,
            ports: [primary_port, 0],
            primary: 0,
            password,
            pids: [None, None],
        };
        pair.pids[0] = Some(postmaster_pid(&pair.members[0]).await?);
        pair.start_standby(None).await?;
        info!(ports = ?pair.ports, dir = %dir.display(), "replicated pair started");
        Ok(pair)
    }

    /// A multi-host URL naming both servers (the first one started first) for `database`.
    pub fn url_for(&self, database: &str) -> String {
        let first = connection_url(&self.password, self.ports[0], database);
        let (before_path, path) = first
            .rsplit_once('/')
            .expect("connection_url always has a path");
        format!(
            "{before_path},127.0.0.1:{}/{path}?target_session_attrs=read-write",
            self.ports[1]
        )
    }

    /// A single-host URL of one member, by role, for `database`.
    pub fn member_url(&self, member: PairMember, database: &str) -> String {
        connection_url(&self.password, self.port(member), database)
    }

    /// The loopback port of one member, by role.
    pub fn port(&self, member: PairMember) -> u16 {
        self.ports[self.index(member)]
    }

    fn index(&self, member: PairMember) -> usize {
        match member {
            PairMember::Primary => self.primary,
            PairMember::Standby => 1 - self.primary,
        }
    }

    /// Kills the primary's postmaster with SIGKILL, as a crash or a power cut would.
    pub async fn kill_primary(&mut self) -> Result<(), EmbeddedError> {
        let Some(pid) = self.pids[self.primary].take() else {
            return Ok(());
        };
        let mut command = tokio::process::Command::new("kill");
        command.arg("-KILL").arg(&pid);
        let output = run_command(command, "kill -KILL", KILL_TIMEOUT).await?;
        if !output.status.success() {
            return Err(EmbeddedError::CommandFailed {
                command: format!("kill -KILL {pid}"),
                detail: describe_output(&output),
            });
        }
        info!(pid, port = self.ports[self.primary], "primary killed");
        Ok(())
    }

    /// Promotes the standby and waits until it accepts writes; it is the primary from then on.
    pub async fn promote_standby(&mut self) -> Result<(), EmbeddedError> {
        let standby = &self.members[1 - self.primary];
        let mut command = standby.command(&standby.binaries.pg_ctl());
        command
            .arg("-D")
            .arg(standby.data_dir())
            .args(["-w", "-t", "60"])
            .arg("promote");
        let output = run_command(command, "pg_ctl promote", PROMOTE_TIMEOUT).await?;
        if !output.status.success() {
            return Err(EmbeddedError::CommandFailed {
                command: "pg_ctl promote".to_owned(),
                detail: describe_output(&output),
            });
        }
        self.primary = 1 - self.primary;
        info!(port = self.ports[self.primary], "standby promoted");
        Ok(())
    }

    /// Rebuilds the killed former primary as a standby of the current primary, on its old
    /// port, then makes the primary wait for it again (synchronous replication).
    pub async fn rebuild_standby(&mut self) -> Result<(), EmbeddedError> {
        let standby = 1 - self.primary;
        if self.pids[standby].is_some() {
            return Ok(());
        }
        let data_dir = self.members[standby].data_dir();
        if tokio::fs::try_exists(&data_dir).await.unwrap_or(false) {
            tokio::fs::remove_dir_all(&data_dir)
                .await
                .map_err(io_error("remove", &data_dir))?;
        }
        self.start_standby(Some(self.ports[standby])).await?;
        let primary = &self.members[self.primary];
        let settings = primary.data_dir().join("postgresql.auto.conf");
        let mut file = tokio::fs::OpenOptions::new()
            .append(true)
            .open(&settings)
            .await
            .map_err(io_error("open", &settings))?;
        file.write_all(b"synchronous_standby_names = '*'\n")
            .await
            .map_err(io_error("write", &settings))?;
        let mut command = primary.command(&primary.binaries.pg_ctl());
        command.arg("-D").arg(primary.data_dir()).arg("reload");
        let output = run_command(command, "pg_ctl reload", KILL_TIMEOUT).await?;
        if !output.status.success() {
            return Err(EmbeddedError::CommandFailed {
                command: "pg_ctl reload".to_owned(),
                detail: describe_output(&output),
            });
        }
        info!(port = self.ports[standby], "standby rebuilt");
        Ok(())
    }

    /// Where a member's server log is, by role, for a failing test to print.
    pub fn log_file(&self, member: PairMember) -> PathBuf {
        self.members[self.index(member)].log_file()
    }

    /// Stops whichever servers still run (immediate shutdown: nothing here is kept).
    pub async fn stop(mut self) -> Result<(), EmbeddedError> {
        for cluster in &self.members {
            if cluster.is_running().await? {
                cluster.stop_server_immediately().await?;
            }
        }
        self.pids = [None, None];
        Ok(())
    }

    /// Copies the primary into the standby's (empty) data directory and starts it there, on
    /// `port` or a free one.
    async fn start_standby(&mut self, port: Option<u16>) -> Result<(), EmbeddedError> {
        let standby = 1 - self.primary;
        let cluster = &self.members[standby];
        write_private_file(&cluster.password_file(), &self.password, None).await?;
        base_backup(
            &self.members[self.primary],
            self.ports[self.primary],
            cluster,
            &self.password,
        )
        .await?;
        // The copy carries the primary's settings; a standby promoted later must not wait for a
        // standby it does not have yet (rebuild_standby turns the wait on again).
        without_synchronous_standbys(cluster).await?;
        self.ports[standby] = cluster.start_server_at(port, "").await?;
        self.pids[standby] = Some(postmaster_pid(cluster).await?);
        Ok(())
    }
}

impl Drop for ReplicatedPair {
    // A test that fails before `stop` must not leave servers running on a deleted directory.
    // Spawned, not waited for: a drop cannot await.
    fn drop(&mut self) {
        for pid in self.pids.iter().flatten() {
            let _ = std::process::Command::new("kill")
                .arg("-KILL")
                .arg(pid)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn();
        }
    }
}

/// The pid of a running cluster's postmaster (line 1 of postmaster.pid).
async fn postmaster_pid(cluster: &Cluster) -> Result<String, EmbeddedError> {
    let pid_file = cluster.postmaster_pid_file();
    let contents = tokio::fs::read_to_string(&pid_file)
        .await
        .map_err(io_error("read", &pid_file))?;
    Ok(contents
        .lines()
        .next()
        .map(str::trim)
        .unwrap_or_default()
        .to_owned())
}

/// Removes `synchronous_standby_names` from a cluster's `postgresql.auto.conf`.
async fn without_synchronous_standbys(cluster: &Cluster) -> Result<(), EmbeddedError> {
    let settings = cluster.data_dir().join("postgresql.auto.conf");
    let contents = tokio::fs::read_to_string(&settings)
        .await
        .map_err(io_error("read", &settings))?;
    let kept: String = contents
        .lines()
        .filter(|line| !line.trim_start().starts_with("synchronous_standby_names"))
        .map(|line| format!("{line}\n"))
        .collect();
    // Written in place, so the file keeps its owner (the server user) and mode.
    tokio::fs::write(&settings, kept)
        .await
        .map_err(io_error("write", &settings))
}

/// Copies the running primary into the standby's data directory and configures it to follow.
async fn base_backup(
    primary: &Cluster,
    primary_port: u16,
    standby: &Cluster,
    password: &str,
) -> Result<(), EmbeddedError> {
    let pg_basebackup = primary.binaries.bindir.join("pg_basebackup");
    let mut command = standby.command(&pg_basebackup);
    command
        .arg("-D")
        .arg(standby.data_dir())
        .args(["-h", "127.0.0.1", "-p"])
        .arg(primary_port.to_string())
        .args(["-U", SUPERUSER])
        // -R writes primary_conninfo (with the password, in the standby's private data
        // directory) and standby.signal.
        .args(["-R", "-X", "stream", "--checkpoint=fast"])
        .env("PGPASSWORD", password);
    let output = run_command(command, "pg_basebackup", BASE_BACKUP_TIMEOUT).await?;
    if !output.status.success() {
        return Err(EmbeddedError::CommandFailed {
            command: "pg_basebackup".to_owned(),
            detail: describe_output(&output),
        });
    }
    Ok(())
}
