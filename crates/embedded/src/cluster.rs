//! One cluster directory and the server binaries run on it: initdb, pg_ctl start, status and
//! stop, and the small files kept beside the data directory.

use std::ffi::OsString;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::process::Command;
use tracing::{info, warn};

use crate::error::{EmbeddedError, io_error};
use crate::process::{
    QUICK_COMMAND_TIMEOUT, SUPERUSER, describe_output, file_length, generate_password, last_lines,
    mentions_port_in_use, parse_postmaster_port, pick_free_port, process_is_alive, read_file_from,
    run_command,
};
use crate::server_user::{ServerUser, chown_to, write_private_file};

const INITDB_TIMEOUT: Duration = Duration::from_secs(60);
/// pg_ctl's own wait; the outer timeout is longer so pg_ctl gets to report why it gave up.
const PG_CTL_START_WAIT_SECONDS: u64 = 60;
const START_TIMEOUT: Duration = Duration::from_secs(75);
const PG_CTL_STOP_WAIT_SECONDS: u64 = 30;
const STOP_TIMEOUT: Duration = Duration::from_secs(40);
const PORT_ATTEMPTS: u32 = 3;
pub(crate) const LOG_TAIL_LINES: usize = 20;
/// The log grows across runs; the tail we report lives in its last few kilobytes.
const LOG_TAIL_BYTES: u64 = 64 * 1024;

/// Where the server binaries live.
#[derive(Debug, Clone)]
pub(crate) struct ServerBinaries {
    pub(crate) bindir: PathBuf,
}

impl ServerBinaries {
    pub(crate) fn initdb(&self) -> PathBuf {
        self.bindir.join("initdb")
    }

    pub(crate) fn pg_ctl(&self) -> PathBuf {
        self.bindir.join("pg_ctl")
    }
}

/// One cluster directory plus how to run its binaries.
#[derive(Debug, Clone)]
pub(crate) struct Cluster {
    pub(crate) dir: PathBuf,
    pub(crate) binaries: ServerBinaries,
    /// `None` when we are not root and run the binaries as ourselves.
    pub(crate) run_as: Option<ServerUser>,
}

impl Cluster {
    pub(crate) fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub(crate) fn log_file(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    pub(crate) fn password_file(&self) -> PathBuf {
        self.dir.join("password")
    }

    pub(crate) fn port_file(&self) -> PathBuf {
        self.dir.join("port")
    }

    pub(crate) fn owner_pid_file(&self) -> PathBuf {
        self.dir.join("owner.pid")
    }

    pub(crate) fn postmaster_pid_file(&self) -> PathBuf {
        self.data_dir().join("postmaster.pid")
    }

    /// A command for a server binary, run as the server user when we are root.
    pub(crate) fn std_command(&self, program: &Path) -> std::process::Command {
        let mut command = std::process::Command::new(program);
        // Our own working directory may be unreadable for the server user (e.g. /root).
        command.current_dir(&self.dir);
        // Stray client settings from the caller's environment must not redirect the binaries.
        for variable in ["PGDATA", "PGPORT", "PGHOST", "PGUSER", "PGDATABASE"] {
            command.env_remove(variable);
        }
        if let Some(user) = &self.run_as {
            command.uid(user.uid).gid(user.gid).env("HOME", &user.home);
        }
        command
    }

    pub(crate) fn command(&self, program: &Path) -> Command {
        Command::from(self.std_command(program))
    }

    pub(crate) async fn is_initialized(&self) -> Result<bool, EmbeddedError> {
        let version_file = self.data_dir().join("PG_VERSION");
        tokio::fs::try_exists(&version_file)
            .await
            .map_err(io_error("inspect", &version_file))
    }

    /// Runs initdb; the password file is written first so a cluster never exists without it.
    pub(crate) async fn initialize(&self) -> Result<(), EmbeddedError> {
        let data_dir = self.data_dir();
        if tokio::fs::try_exists(&data_dir).await.unwrap_or(false) {
            // initdb refuses a non-empty directory, and one without PG_VERSION is what an
            // interrupted initdb leaves behind.
            warn!(data_dir = %data_dir.display(), "removing incomplete cluster directory");
            tokio::fs::remove_dir_all(&data_dir)
                .await
                .map_err(io_error("remove", &data_dir))?;
        }

        let password = generate_password();
        write_private_file(&self.password_file(), &password, None).await?;
        // initdb runs as the server user, who must be able to read the password it sets.
        let pwfile = self.dir.join("initdb-pwfile");
        write_private_file(&pwfile, &password, self.run_as.as_ref()).await?;

        let mut pwfile_argument = OsString::from("--pwfile=");
        pwfile_argument.push(&pwfile);
        let mut command = self.command(&self.binaries.initdb());
        command
            .arg("-D")
            .arg(&data_dir)
            .arg("--auth-local=trust")
            .arg("--auth-host=scram-sha-256")
            .arg(format!("--username={SUPERUSER}"))
            .arg(pwfile_argument)
            .args(["-E", "UTF8", "--locale=C"]);
        let outcome = run_command(command, "initdb", INITDB_TIMEOUT).await;
        // The password must not linger in a file the server user can read.
        if let Err(error) = tokio::fs::remove_file(&pwfile).await {
            warn!(path = %pwfile.display(), %error, "could not remove initdb password file");
        }
        let output = outcome?;
        if !output.status.success() {
            return Err(EmbeddedError::CommandFailed {
                command: "initdb".to_owned(),
                detail: describe_output(&output),
            });
        }
        info!(dir = %self.dir.display(), "embedded postgres cluster initialised");
        Ok(())
    }

    pub(crate) async fn read_password(&self) -> Result<String, EmbeddedError> {
        let path = self.password_file();
        let missing = || EmbeddedError::PasswordMissing {
            dir: self.dir.clone(),
            path: path.clone(),
        };
        let contents = match tokio::fs::read_to_string(&path).await {
            Ok(contents) => contents,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Err(missing()),
            Err(error) => return Err(io_error("read", &path)(error)),
        };
        let password = contents.trim();
        if password.is_empty() {
            return Err(missing());
        }
        Ok(password.to_owned())
    }

    pub(crate) async fn is_running(&self) -> Result<bool, EmbeddedError> {
        if !self.is_initialized().await? {
            return Ok(false);
        }
        let mut command = self.command(&self.binaries.pg_ctl());
        command.arg("-D").arg(self.data_dir()).arg("status");
        let output = run_command(command, "pg_ctl status", QUICK_COMMAND_TIMEOUT).await?;
        // pg_ctl status: 0 running, 3 not running, 4 no accessible data directory.
        match output.status.code() {
            Some(0) => Ok(true),
            Some(3 | 4) => Ok(false),
            _ => Err(EmbeddedError::CommandFailed {
                command: "pg_ctl status".to_owned(),
                detail: describe_output(&output),
            }),
        }
    }

    pub(crate) async fn running_port(&self) -> Result<u16, EmbeddedError> {
        let path = self.postmaster_pid_file();
        let contents = tokio::fs::read_to_string(&path)
            .await
            .map_err(io_error("read", &path))?;
        parse_postmaster_port(&contents).ok_or_else(|| EmbeddedError::PortUnknown {
            path,
            detail: "line 4 is not a port number".to_owned(),
        })
    }

    /// Starts the server on a free loopback port and returns that port.
    pub(crate) async fn start_server(&self) -> Result<u16, EmbeddedError> {
        self.start_server_with("").await
    }

    /// As [`Cluster::start_server`], with more server options (`-c name=value ...`).
    pub(crate) async fn start_server_with(&self, options: &str) -> Result<u16, EmbeddedError> {
        self.start_server_at(None, options).await
    }

    /// Starts the server on `port`, or on a free port when `None`, and returns the port.
    pub(crate) async fn start_server_at(
        &self,
        requested: Option<u16>,
        options: &str,
    ) -> Result<u16, EmbeddedError> {
        let log_file = self.log_file();
        self.prepare_log_file().await?;
        let data_dir = self.data_dir();
        if let Some(user) = &self.run_as {
            chown_to(&data_dir, user)?;
        }

        let mut attempt = 1;
        loop {
            let port = match requested {
                Some(port) => port,
                None => pick_free_port()?,
            };
            let log_offset = file_length(&log_file).await;
            let server_options = format!(
                "-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' {options}"
            );
            let mut command = self.command(&self.binaries.pg_ctl());
            command
                .arg("-D")
                .arg(&data_dir)
                .arg("-l")
                .arg(&log_file)
                .arg("-w")
                .arg("-t")
                .arg(PG_CTL_START_WAIT_SECONDS.to_string())
                .arg("-o")
                .arg(server_options)
                .arg("start");
            let output = run_command(command, "pg_ctl start", START_TIMEOUT).await?;
            if output.status.success() {
                self.write_port(port).await?;
                return Ok(port);
            }

            // The port was free when we probed it, but another process may bind it first.
            let new_log = read_file_from(&log_file, log_offset).await;
            if requested.is_none() && attempt < PORT_ATTEMPTS && mentions_port_in_use(&new_log) {
                warn!(
                    port,
                    attempt,
                    "port taken before the server could bind it; retrying with another port"
                );
                attempt += 1;
                continue;
            }
            let log_length = file_length(&log_file).await;
            let recent_log =
                read_file_from(&log_file, log_length.saturating_sub(LOG_TAIL_BYTES)).await;
            return Err(EmbeddedError::StartFailed {
                detail: describe_output(&output),
                log: log_file,
                log_tail: last_lines(&recent_log, LOG_TAIL_LINES),
            });
        }
    }

    /// Creates server.log up front so that, as root, it can be handed to the server user.
    pub(crate) async fn prepare_log_file(&self) -> Result<(), EmbeddedError> {
        let log_file = self.log_file();
        tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&log_file)
            .await
            .map_err(io_error("create", &log_file))?;
        if let Some(user) = &self.run_as {
            chown_to(&log_file, user)?;
        }
        Ok(())
    }

    pub(crate) async fn write_port(&self, port: u16) -> Result<(), EmbeddedError> {
        let path = self.port_file();
        tokio::fs::write(&path, format!("{port}\n"))
            .await
            .map_err(io_error("write", &path))
    }

    pub(crate) async fn stop_server(&self) -> Result<(), EmbeddedError> {
        self.stop_server_in_mode("fast").await
    }

    /// Stops the server without a shutdown checkpoint, for clusters nobody reuses.
    pub(crate) async fn stop_server_immediately(&self) -> Result<(), EmbeddedError> {
        self.stop_server_in_mode("immediate").await
    }

    async fn stop_server_in_mode(&self, mode: &str) -> Result<(), EmbeddedError> {
        let mut command = self.command(&self.binaries.pg_ctl());
        command
            .arg("-D")
            .arg(self.data_dir())
            .args(["-m", mode, "-w", "-t"])
            .arg(PG_CTL_STOP_WAIT_SECONDS.to_string())
            .arg("stop");
        let output = run_command(command, "pg_ctl stop", STOP_TIMEOUT).await?;
        if output.status.success() {
            return Ok(());
        }
        // Someone else stopping it first is fine: a stopped server is what we wanted.
        if !self.is_running().await? {
            return Ok(());
        }
        Err(EmbeddedError::CommandFailed {
            command: "pg_ctl stop".to_owned(),
            detail: describe_output(&output),
        })
    }

    pub(crate) async fn owner_is_alive(&self) -> bool {
        let Ok(contents) = tokio::fs::read_to_string(self.owner_pid_file()).await else {
            return false;
        };
        let Ok(pid) = contents.trim().parse::<u32>() else {
            return false;
        };
        process_is_alive(pid).await
    }

    pub(crate) async fn write_owner_pid(&self) -> Result<(), EmbeddedError> {
        let path = self.owner_pid_file();
        tokio::fs::write(&path, format!("{}\n", std::process::id()))
            .await
            .map_err(io_error("write", &path))
    }

    pub(crate) async fn remove_owner_pid(&self) -> Result<(), EmbeddedError> {
        let path = self.owner_pid_file();
        match tokio::fs::remove_file(&path).await {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(error) => Err(io_error("remove", &path)(error)),
        }
    }
}
