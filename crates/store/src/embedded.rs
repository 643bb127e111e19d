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

use std::ffi::OsString;
use std::fmt::{self, Write as _};
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio::process::Command;
use tracing::{debug, info, warn};

/// Superuser created by initdb; every URL connects as this role.
const SUPERUSER: &str = "postgres";
const INITDB_TIMEOUT: Duration = Duration::from_secs(60);
/// pg_ctl's own wait; the outer timeout is longer so pg_ctl gets to report why it gave up.
const PG_CTL_START_WAIT_SECONDS: u64 = 60;
const START_TIMEOUT: Duration = Duration::from_secs(75);
const PG_CTL_STOP_WAIT_SECONDS: u64 = 30;
const STOP_TIMEOUT: Duration = Duration::from_secs(40);
const QUICK_COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// Long enough for another process to run initdb and start the server while we wait.
const LOCK_TIMEOUT: Duration = Duration::from_secs(180);
const LOCK_POLL_INTERVAL: Duration = Duration::from_millis(100);
const PORT_ATTEMPTS: u32 = 3;
const LOG_TAIL_LINES: usize = 20;
/// The log grows across runs; the tail we report lives in its last few kilobytes.
const LOG_TAIL_BYTES: u64 = 64 * 1024;
/// Accounts that may run the server when we are root, in order of preference.
const SERVER_USER_CANDIDATES: [&str; 2] = ["postgres", "nobody"];

/// Who is asking for the cluster: the owner stops it on exit, a guest never does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The long-running process (`converger serve`) that stops the server on exit.
    Owner,
    /// Admin CLI commands and test processes, which leave the server up for the next run to reuse.
    Guest,
}

/// Failures while locating, initialising, starting or stopping the embedded cluster.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    /// No PostgreSQL server binaries were found on this machine.
    #[error(
        "postgresql server binaries (initdb, pg_ctl) not found via pg_config --bindir, PATH or \
         /usr/lib/postgresql/*/bin; install the postgresql server package (Debian/Ubuntu: \
         `apt install postgresql`, Fedora: `dnf install postgresql-server`, macOS: \
         `brew install postgresql`) or configure a database url"
    )]
    BinariesNotFound,
    /// A file system operation in the cluster directory failed.
    #[error("could not {action} {path}: {source}")]
    Io {
        /// What we were doing, e.g. "create directory".
        action: &'static str,
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// Running as root, but /etc/passwd has no unprivileged account to run the server.
    #[error(
        "running as root and /etc/passwd has neither a `postgres` nor a `nobody` user to run the \
         server as (postgresql refuses to run as root)"
    )]
    NoServerUser,
    /// An ancestor of the cluster directory cannot be entered by the account running the server.
    #[error(
        "directory {directory} is not searchable by user {user}, who runs the embedded postgres \
         server; use a state directory under /tmp (CONVERGER_STATE_DIR) or set CONVERGER_DATABASE_URL"
    )]
    DirectoryNotSearchable {
        /// The first ancestor lacking search permission for `user`.
        directory: PathBuf,
        /// The account the server runs as.
        user: String,
    },
    /// An external command could not be run or exited unsuccessfully.
    #[error("{command} failed: {detail}")]
    CommandFailed {
        /// The command, e.g. "initdb".
        command: String,
        /// Exit status and the command's own error output.
        detail: String,
    },
    /// An external command did not finish in time.
    #[error("{command} did not finish within {seconds} s")]
    Timeout {
        /// The command, e.g. "pg_ctl start".
        command: String,
        /// The limit that was exceeded.
        seconds: u64,
    },
    /// The server did not start; carries the end of its log.
    #[error("embedded postgres did not start: {detail}; last lines of {log}:\n{log_tail}")]
    StartFailed {
        /// What pg_ctl said.
        detail: String,
        /// Path of server.log.
        log: PathBuf,
        /// The last lines of server.log.
        log_tail: String,
    },
    /// The cluster exists but the password needed to connect to it is gone.
    #[error("the cluster in {dir} has no usable password file {path}; remove {dir} to start over")]
    PasswordMissing {
        /// The cluster directory.
        dir: PathBuf,
        /// The missing or empty password file.
        path: PathBuf,
    },
    /// The running server's port could not be determined.
    #[error("cannot read the server port from {path}: {detail}")]
    PortUnknown {
        /// Path of postmaster.pid.
        path: PathBuf,
        /// Why it could not be read.
        detail: String,
    },
    /// Another process held the start lock for too long.
    #[error(
        "timed out waiting for {path}, held by another process starting or stopping the cluster"
    )]
    LockTimeout {
        /// Path of the lock file.
        path: PathBuf,
    },
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
}

/// Where the server binaries live.
#[derive(Debug, Clone)]
struct ServerBinaries {
    bindir: PathBuf,
}

impl ServerBinaries {
    fn initdb(&self) -> PathBuf {
        self.bindir.join("initdb")
    }

    fn pg_ctl(&self) -> PathBuf {
        self.bindir.join("pg_ctl")
    }
}

/// An account from /etc/passwd that runs the server when we are root.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ServerUser {
    name: String,
    uid: u32,
    gid: u32,
    home: PathBuf,
}

/// One cluster directory plus how to run its binaries.
#[derive(Debug, Clone)]
struct Cluster {
    dir: PathBuf,
    binaries: ServerBinaries,
    /// `None` when we are not root and run the binaries as ourselves.
    run_as: Option<ServerUser>,
}

impl Cluster {
    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log_file(&self) -> PathBuf {
        self.dir.join("server.log")
    }

    fn password_file(&self) -> PathBuf {
        self.dir.join("password")
    }

    fn port_file(&self) -> PathBuf {
        self.dir.join("port")
    }

    fn owner_pid_file(&self) -> PathBuf {
        self.dir.join("owner.pid")
    }

    fn postmaster_pid_file(&self) -> PathBuf {
        self.data_dir().join("postmaster.pid")
    }

    /// A command for a server binary, run as the server user when we are root.
    fn std_command(&self, program: &Path) -> std::process::Command {
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

    fn command(&self, program: &Path) -> Command {
        Command::from(self.std_command(program))
    }

    async fn is_initialized(&self) -> Result<bool, EmbeddedError> {
        let version_file = self.data_dir().join("PG_VERSION");
        tokio::fs::try_exists(&version_file)
            .await
            .map_err(io_error("inspect", &version_file))
    }

    /// Runs initdb; the password file is written first so a cluster never exists without it.
    async fn initialize(&self) -> Result<(), EmbeddedError> {
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

    async fn read_password(&self) -> Result<String, EmbeddedError> {
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

    async fn is_running(&self) -> Result<bool, EmbeddedError> {
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

    async fn running_port(&self) -> Result<u16, EmbeddedError> {
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
    async fn start_server(&self) -> Result<u16, EmbeddedError> {
        let log_file = self.log_file();
        self.prepare_log_file().await?;
        let data_dir = self.data_dir();
        if let Some(user) = &self.run_as {
            chown_to(&data_dir, user)?;
        }

        let mut attempt = 1;
        loop {
            let port = pick_free_port()?;
            let log_offset = file_length(&log_file).await;
            let server_options =
                format!("-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories=''");
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
            if attempt < PORT_ATTEMPTS && mentions_port_in_use(&new_log) {
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
    async fn prepare_log_file(&self) -> Result<(), EmbeddedError> {
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

    async fn write_port(&self, port: u16) -> Result<(), EmbeddedError> {
        let path = self.port_file();
        tokio::fs::write(&path, format!("{port}\n"))
            .await
            .map_err(io_error("write", &path))
    }

    async fn stop_server(&self) -> Result<(), EmbeddedError> {
        let mut command = self.command(&self.binaries.pg_ctl());
        command
            .arg("-D")
            .arg(self.data_dir())
            .args(["-m", "fast", "-w", "-t"])
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

    async fn owner_is_alive(&self) -> bool {
        let Ok(contents) = tokio::fs::read_to_string(self.owner_pid_file()).await else {
            return false;
        };
        let Ok(pid) = contents.trim().parse::<u32>() else {
            return false;
        };
        process_is_alive(pid).await
    }

    async fn write_owner_pid(&self) -> Result<(), EmbeddedError> {
        let path = self.owner_pid_file();
        tokio::fs::write(&path, format!("{}\n", std::process::id()))
            .await
            .map_err(io_error("write", &path))
    }

    async fn remove_owner_pid(&self) -> Result<(), EmbeddedError> {
        let path = self.owner_pid_file();
        match tokio::fs::remove_file(&path).await {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(error) => Err(io_error("remove", &path)(error)),
        }
    }
}

/// Exclusive lock on `start.lock`, held while starting or stopping so concurrent processes
/// never run initdb or pg_ctl on the same cluster at once; released when dropped.
struct StartLock {
    _file: std::fs::File,
}

impl StartLock {
    async fn acquire(dir: &Path) -> Result<StartLock, EmbeddedError> {
        let path = dir.join("start.lock");
        let file = tokio::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .await
            .map_err(io_error("open", &path))?
            .into_std()
            .await;
        let deadline = Instant::now() + LOCK_TIMEOUT;
        let mut announced = false;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(StartLock { _file: file }),
                Err(std::fs::TryLockError::WouldBlock) => {}
                Err(std::fs::TryLockError::Error(error))
                    if error.kind() == io::ErrorKind::Unsupported =>
                {
                    // Some network file systems cannot lock; racing starts there are unlikely.
                    warn!(
                        lock = %path.display(),
                        "file locking unsupported; starting without the lock"
                    );
                    return Ok(StartLock { _file: file });
                }
                Err(std::fs::TryLockError::Error(error)) => {
                    return Err(io_error("lock", &path)(error));
                }
            }
            if Instant::now() >= deadline {
                return Err(EmbeddedError::LockTimeout { path });
            }
            if !announced {
                info!(
                    lock = %path.display(),
                    "waiting for another process starting or stopping embedded postgres"
                );
                announced = true;
            }
            tokio::time::sleep(LOCK_POLL_INTERVAL).await;
        }
    }
}

/// Finds initdb and pg_ctl: pg_config's bindir, then PATH, then the newest Debian-style install.
async fn locate_server_binaries() -> Result<ServerBinaries, EmbeddedError> {
    let mut candidates = Vec::new();
    candidates.extend(pg_config_bindir().await);
    candidates.extend(path_bindirs().await);
    candidates.extend(debian_bindirs().await);
    select_server_binaries(&candidates).await
}

/// The first candidate directory holding both initdb and pg_ctl.
async fn select_server_binaries(candidates: &[PathBuf]) -> Result<ServerBinaries, EmbeddedError> {
    for bindir in candidates {
        if is_executable(&bindir.join("initdb")).await
            && is_executable(&bindir.join("pg_ctl")).await
        {
            debug!(bindir = %bindir.display(), "postgresql server binaries found");
            return Ok(ServerBinaries {
                bindir: bindir.clone(),
            });
        }
    }
    debug!(
        ?candidates,
        "no postgresql server binaries in any candidate directory"
    );
    Err(EmbeddedError::BinariesNotFound)
}

async fn pg_config_bindir() -> Option<PathBuf> {
    let mut command = Command::new("pg_config");
    command.arg("--bindir");
    // A missing pg_config is normal (client-only or Fedora installs); other sources follow.
    let output = run_command(command, "pg_config --bindir", QUICK_COMMAND_TIMEOUT)
        .await
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let bindir = String::from_utf8(output.stdout).ok()?;
    let bindir = bindir.trim();
    if bindir.is_empty() {
        return None;
    }
    Some(PathBuf::from(bindir))
}

async fn path_bindirs() -> Vec<PathBuf> {
    let Some(path) = std::env::var_os("PATH") else {
        return Vec::new();
    };
    let mut bindirs = Vec::new();
    for entry in std::env::split_paths(&path) {
        let initdb = entry.join("initdb");
        if !is_executable(&initdb).await {
            continue;
        }
        // initdb on PATH is often a symlink into the real bindir, where pg_ctl is sure to be.
        if let Ok(real_initdb) = tokio::fs::canonicalize(&initdb).await
            && let Some(real_bindir) = real_initdb.parent()
        {
            bindirs.push(real_bindir.to_path_buf());
        }
        bindirs.push(entry);
    }
    bindirs
}

/// `/usr/lib/postgresql/*/bin`, highest version first.
async fn debian_bindirs() -> Vec<PathBuf> {
    let Ok(mut entries) = tokio::fs::read_dir("/usr/lib/postgresql").await else {
        return Vec::new();
    };
    let mut versions = Vec::new();
    while let Ok(Some(entry)) = entries.next_entry().await {
        let name = entry.file_name();
        let Some(version) = name.to_str().and_then(parse_version) else {
            continue;
        };
        versions.push((version, entry.path().join("bin")));
    }
    versions.sort_by(|left, right| right.0.cmp(&left.0));
    versions.into_iter().map(|(_, bindir)| bindir).collect()
}

/// "15" → [15], "9.6" → [9, 6]; anything else is not a version directory.
fn parse_version(name: &str) -> Option<Vec<u32>> {
    name.split('.').map(|part| part.parse().ok()).collect()
}

async fn is_executable(path: &Path) -> bool {
    match tokio::fs::metadata(path).await {
        Ok(metadata) => metadata.is_file() && metadata.mode() & 0o111 != 0,
        Err(_) => false,
    }
}

/// Creates `dir` (mode 0700) and its parents; an existing directory is left as it is.
async fn create_private_dir(dir: &Path) -> Result<(), EmbeddedError> {
    if let Some(parent) = dir.parent()
        && !parent.as_os_str().is_empty()
    {
        // Parents get the default mode: the server user may need to traverse them.
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(io_error("create directory", parent))?;
    }
    match tokio::fs::DirBuilder::new().mode(0o700).create(dir).await {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(error) => Err(io_error("create directory", dir)(error)),
    }
}

/// Our effective uid, read without unsafe code.
async fn effective_uid(dir: &Path) -> Result<u32, EmbeddedError> {
    if let Ok(metadata) = tokio::fs::metadata("/proc/self").await {
        return Ok(metadata.uid());
    }
    // Without procfs (macOS), a file we create is owned by our effective uid.
    let probe = dir.join(format!(".uid-probe-{}", std::process::id()));
    tokio::fs::write(&probe, b"")
        .await
        .map_err(io_error("create", &probe))?;
    let metadata = tokio::fs::metadata(&probe)
        .await
        .map_err(io_error("inspect", &probe));
    if let Err(error) = tokio::fs::remove_file(&probe).await {
        warn!(path = %probe.display(), %error, "could not remove uid probe file");
    }
    Ok(metadata?.uid())
}

/// As root: picks the account to run the server, checks it can reach `dir`, and hands it `dir`.
async fn prepare_server_user(dir: &Path) -> Result<ServerUser, EmbeddedError> {
    let passwd = tokio::fs::read_to_string("/etc/passwd")
        .await
        .map_err(io_error("read", Path::new("/etc/passwd")))?;
    let users = parse_passwd(&passwd);
    let data_dir = dir.join("data");
    // An existing cluster keeps running as the account that owns its files.
    let data_owner = match tokio::fs::metadata(&data_dir).await {
        Ok(metadata) if metadata.uid() != 0 => Some(metadata.uid()),
        _ => None,
    };
    let mut user = data_owner
        .and_then(|uid| users.iter().find(|user| user.uid == uid).cloned())
        .or_else(|| pick_server_user(&users))
        .ok_or(EmbeddedError::NoServerUser)?;
    if !tokio::fs::try_exists(&user.home).await.unwrap_or(false) {
        // `nobody` has /nonexistent as home; tools that look at HOME get something real.
        user.home = dir.to_path_buf();
    }

    if let Some(directory) = first_unsearchable_ancestor(dir, &user).await? {
        return Err(EmbeddedError::DirectoryNotSearchable {
            directory,
            user: user.name,
        });
    }
    chown_to(dir, &user)?;
    if tokio::fs::try_exists(&data_dir).await.unwrap_or(false) {
        chown_to(&data_dir, &user)?;
    }
    debug!(
        user = %user.name,
        uid = user.uid,
        dir = %dir.display(),
        "running embedded postgres as an unprivileged user"
    );
    Ok(user)
}

/// Parses /etc/passwd lines (`name:password:uid:gid:gecos:home:shell`), skipping malformed ones.
fn parse_passwd(contents: &str) -> Vec<ServerUser> {
    contents
        .lines()
        .filter(|line| !line.trim_start().starts_with('#'))
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() < 7 {
                return None;
            }
            Some(ServerUser {
                name: fields[0].to_owned(),
                uid: fields[2].parse().ok()?,
                gid: fields[3].parse().ok()?,
                home: PathBuf::from(fields[5]),
            })
        })
        .collect()
}

/// `postgres` if present, else `nobody`; never a uid-0 account.
fn pick_server_user(users: &[ServerUser]) -> Option<ServerUser> {
    SERVER_USER_CANDIDATES.iter().find_map(|name| {
        users
            .iter()
            .find(|user| user.name == *name && user.uid != 0)
            .cloned()
    })
}

/// The first ancestor of `dir` (which must be absolute) that `user` cannot enter.
async fn first_unsearchable_ancestor(
    dir: &Path,
    user: &ServerUser,
) -> Result<Option<PathBuf>, EmbeddedError> {
    for ancestor in dir.ancestors().skip(1) {
        let metadata = tokio::fs::metadata(ancestor)
            .await
            .map_err(io_error("inspect", ancestor))?;
        if !is_searchable_by(metadata.mode(), metadata.uid(), metadata.gid(), user) {
            return Ok(Some(ancestor.to_path_buf()));
        }
    }
    Ok(None)
}

/// Whether `user` may traverse a directory; supplementary groups are ignored because they are
/// dropped when the binaries are spawned with only the user's uid and primary gid.
fn is_searchable_by(mode: u32, owner_uid: u32, owner_gid: u32, user: &ServerUser) -> bool {
    if owner_uid == user.uid {
        return mode & 0o100 != 0;
    }
    if owner_gid == user.gid {
        return mode & 0o010 != 0;
    }
    mode & 0o001 != 0
}

fn chown_to(path: &Path, user: &ServerUser) -> Result<(), EmbeddedError> {
    std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid))
        .map_err(io_error("change owner of", path))
}

/// Writes a 0600 file, optionally handing it to `owner`.
async fn write_private_file(
    path: &Path,
    contents: &str,
    owner: Option<&ServerUser>,
) -> Result<(), EmbeddedError> {
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .await
        .map_err(io_error("create", path))?;
    // The mode above only applies to new files; an older file may be more permissive.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))
        .await
        .map_err(io_error("restrict permissions of", path))?;
    file.write_all(contents.as_bytes())
        .await
        .map_err(io_error("write", path))?;
    file.flush().await.map_err(io_error("write", path))?;
    if let Some(owner) = owner {
        chown_to(path, owner)?;
    }
    Ok(())
}

/// Runs `command` to completion under `limit`, killing it if the limit passes.
async fn run_command(
    mut command: Command,
    description: &str,
    limit: Duration,
) -> Result<Output, EmbeddedError> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    match tokio::time::timeout(limit, command.output()).await {
        Ok(Ok(output)) => Ok(output),
        Ok(Err(error)) => Err(EmbeddedError::CommandFailed {
            command: description.to_owned(),
            detail: format!("could not run it: {error}"),
        }),
        Err(_) => Err(EmbeddedError::Timeout {
            command: description.to_owned(),
            seconds: limit.as_secs(),
        }),
    }
}

/// Exit status plus whatever the command printed, for error messages.
fn describe_output(output: &Output) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let printed = if stderr.trim().is_empty() {
        stdout.trim()
    } else {
        stderr.trim()
    };
    if printed.is_empty() {
        return output.status.to_string();
    }
    format!("{}: {printed}", output.status)
}

fn pick_free_port() -> Result<u16, EmbeddedError> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
        .map_err(io_error("bind a probe socket on", Path::new("127.0.0.1:0")))?;
    let port = listener
        .local_addr()
        .map_err(io_error("read the address of", Path::new("127.0.0.1:0")))?
        .port();
    Ok(port)
}

/// Line 4 of postmaster.pid is the port the server listens on.
fn parse_postmaster_port(contents: &str) -> Option<u16> {
    contents.lines().nth(3)?.trim().parse().ok()
}

fn mentions_port_in_use(log: &str) -> bool {
    log.contains("Address already in use") || log.contains("could not bind")
}

fn last_lines(text: &str, count: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(count)..].join("\n")
}

async fn file_length(path: &Path) -> u64 {
    tokio::fs::metadata(path)
        .await
        .map(|metadata| metadata.len())
        .unwrap_or(0)
}

/// The file's contents from `offset` on; empty when unreadable, since it only decorates errors.
async fn read_file_from(path: &Path, offset: u64) -> String {
    let Ok(mut file) = tokio::fs::File::open(path).await else {
        return String::new();
    };
    if file.seek(io::SeekFrom::Start(offset)).await.is_err() {
        return String::new();
    }
    let mut bytes = Vec::new();
    if file.read_to_end(&mut bytes).await.is_err() {
        return String::new();
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

async fn process_is_alive(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    if tokio::fs::try_exists("/proc/self").await.unwrap_or(false) {
        return tokio::fs::try_exists(format!("/proc/{pid}"))
            .await
            .unwrap_or(false);
    }
    // Without procfs (macOS), `kill -0` checks for the process without signalling it.
    let mut command = Command::new("kill");
    command.arg("-0").arg(pid.to_string());
    run_command(command, "kill -0", QUICK_COMMAND_TIMEOUT)
        .await
        .map(|output| output.status.success())
        .unwrap_or(false)
}

/// 32 random hex characters.
fn generate_password() -> String {
    let bytes: [u8; 16] = rand::random();
    hex::encode(bytes)
}

fn connection_url(password: &str, port: u16, database: &str) -> String {
    format!(
        "postgres://{SUPERUSER}:{password}@127.0.0.1:{port}/{}",
        percent_encode(database)
    )
}

/// Percent-encodes everything but RFC 3986 unreserved characters.
fn percent_encode(value: &str) -> String {
    let mut encoded = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            encoded.push(char::from(byte));
        } else {
            // Writing to a String cannot fail.
            let _ = write!(encoded, "%{byte:02X}");
        }
    }
    encoded
}

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> EmbeddedError {
    let path = path.to_path_buf();
    move |source| EmbeddedError::Io {
        action,
        path,
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stops the server with an immediate shutdown when a test ends, even by panicking.
    struct StopOnDrop {
        cluster: Cluster,
    }

    impl StopOnDrop {
        fn new(handle: &EmbeddedPostgres) -> Self {
            Self {
                cluster: handle.cluster.clone(),
            }
        }
    }

    impl Drop for StopOnDrop {
        fn drop(&mut self) {
            let mut command = self.cluster.std_command(&self.cluster.binaries.pg_ctl());
            command
                .arg("-D")
                .arg(self.cluster.data_dir())
                .args(["-m", "immediate", "-w", "stop"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            // Usually the test already stopped it; then this fails harmlessly.
            let _ = command.status();
        }
    }

    fn cluster_tempdir() -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix("converger-embedded-")
            .tempdir_in("/tmp")
            .expect("create a tempdir under /tmp")
    }

    async fn assert_accepting_connections(handle: &EmbeddedPostgres) {
        tokio::time::timeout(
            Duration::from_secs(10),
            tokio::net::TcpStream::connect(("127.0.0.1", handle.port)),
        )
        .await
        .expect("tcp connect in time")
        .expect("tcp connect to the server");

        let mut command = Command::new(handle.cluster.binaries.bindir.join("pg_isready"));
        command.arg("-d").arg(handle.url());
        let output = run_command(command, "pg_isready", Duration::from_secs(10))
            .await
            .expect("run pg_isready");
        assert!(
            output.status.success(),
            "pg_isready: {}",
            describe_output(&output)
        );
    }

    async fn psql(handle: &EmbeddedPostgres, sql: &str) -> String {
        let mut command = Command::new(handle.cluster.binaries.bindir.join("psql"));
        command
            .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d"])
            .arg(handle.url())
            .arg("-c")
            .arg(sql);
        let output = run_command(command, "psql", Duration::from_secs(30))
            .await
            .expect("run psql");
        assert!(
            output.status.success(),
            "psql: {}",
            describe_output(&output)
        );
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    async fn owner_pid_contents(cluster: &Cluster) -> Option<String> {
        tokio::fs::read_to_string(cluster.owner_pid_file())
            .await
            .ok()
            .map(|contents| contents.trim().to_owned())
    }

    #[tokio::test]
    async fn owner_starts_guest_reuses_and_owner_stop_stops_the_server() {
        let tempdir = cluster_tempdir();
        let owner = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
            .await
            .expect("owner starts the cluster");
        let _stop_on_drop = StopOnDrop::new(&owner);
        let cluster = owner.cluster.clone();

        assert!(owner.started_here());
        assert!(owner.url().starts_with("postgres://postgres:"));
        assert!(
            owner
                .url()
                .ends_with(&format!("@127.0.0.1:{}/postgres", owner.port))
        );
        assert_accepting_connections(&owner).await;

        let password_metadata = std::fs::metadata(cluster.password_file()).expect("password file");
        assert_eq!(password_metadata.mode() & 0o777, 0o600);
        assert_eq!(owner.password.len(), 32);
        assert!(owner.password.chars().all(|c| c.is_ascii_hexdigit()));
        let port_file = std::fs::read_to_string(cluster.port_file()).expect("port file");
        assert_eq!(port_file.trim(), owner.port.to_string());
        assert_eq!(
            owner_pid_contents(&cluster).await,
            Some(std::process::id().to_string())
        );
        assert!(!cluster.dir.join("initdb-pwfile").exists());

        let guest = EmbeddedPostgres::start(tempdir.path(), Role::Guest)
            .await
            .expect("guest reuses the cluster");
        assert!(!guest.started_here());
        assert_eq!(guest.port, owner.port);
        assert_eq!(guest.url(), owner.url());
        guest.stop().await.expect("guest stop is a no-op");
        assert_accepting_connections(&owner).await;

        // The first owner is alive (it is this process), so a second owner must not take over.
        let second_owner = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
            .await
            .expect("second owner reuses the cluster");
        assert!(!second_owner.started_here());
        assert!(!second_owner.owns_server);
        second_owner
            .stop()
            .await
            .expect("non-owning stop is a no-op");
        assert_accepting_connections(&owner).await;

        owner.stop().await.expect("owner stops the cluster");
        assert!(!cluster.is_running().await.expect("pg_ctl status"));
        assert_eq!(owner_pid_contents(&cluster).await, None);
    }

    #[tokio::test]
    async fn restart_keeps_data() {
        let tempdir = cluster_tempdir();
        let first = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
            .await
            .expect("first start");
        let _stop_on_drop = StopOnDrop::new(&first);
        psql(
            &first,
            "CREATE TABLE survivors (id integer); INSERT INTO survivors VALUES (42);",
        )
        .await;
        let cluster = first.cluster.clone();
        first.stop().await.expect("first stop");
        assert!(!cluster.is_running().await.expect("pg_ctl status"));

        let second = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
            .await
            .expect("second start");
        assert!(second.started_here());
        assert_eq!(psql(&second, "SELECT id FROM survivors").await, "42");
        let database_url = second.url_for("postgres");
        assert_eq!(database_url, second.url());
        second.stop().await.expect("second stop");
        assert!(!cluster.is_running().await.expect("pg_ctl status"));
    }

    #[tokio::test]
    async fn owner_adopts_a_server_without_a_live_owner() {
        let tempdir = cluster_tempdir();
        let guest = EmbeddedPostgres::start(tempdir.path(), Role::Guest)
            .await
            .expect("guest starts the cluster");
        let _stop_on_drop = StopOnDrop::new(&guest);
        let cluster = guest.cluster.clone();
        assert!(guest.started_here());
        assert_eq!(owner_pid_contents(&cluster).await, None);
        let guest_port = guest.port;
        guest.stop().await.expect("guest stop is a no-op");
        assert!(cluster.is_running().await.expect("pg_ctl status"));

        let owner = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
            .await
            .expect("owner adopts the cluster");
        assert!(!owner.started_here());
        assert!(owner.owns_server);
        assert_eq!(owner.port, guest_port);
        assert_eq!(
            owner_pid_contents(&cluster).await,
            Some(std::process::id().to_string())
        );
        assert_accepting_connections(&owner).await;

        owner
            .stop()
            .await
            .expect("adopting owner stops the cluster");
        assert!(!cluster.is_running().await.expect("pg_ctl status"));
    }

    #[tokio::test]
    async fn owner_adopts_when_the_recorded_owner_is_dead() {
        let tempdir = cluster_tempdir();
        let guest = EmbeddedPostgres::start(tempdir.path(), Role::Guest)
            .await
            .expect("guest starts the cluster");
        let _stop_on_drop = StopOnDrop::new(&guest);
        let cluster = guest.cluster.clone();
        // Stands in for an owner killed with -9: pid_max on Linux is at most 2^22.
        std::fs::write(cluster.owner_pid_file(), "4194305\n").expect("write stale owner.pid");

        let owner = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
            .await
            .expect("owner adopts the cluster");
        assert!(owner.owns_server);
        owner.stop().await.expect("owner stops the cluster");
        assert!(!cluster.is_running().await.expect("pg_ctl status"));
    }

    #[tokio::test]
    async fn concurrent_guests_share_one_server() {
        let tempdir = cluster_tempdir();
        let (first, second, third) = tokio::join!(
            EmbeddedPostgres::start(tempdir.path(), Role::Guest),
            EmbeddedPostgres::start(tempdir.path(), Role::Guest),
            EmbeddedPostgres::start(tempdir.path(), Role::Guest),
        );
        let guests: Vec<EmbeddedPostgres> = [first, second, third]
            .into_iter()
            .map(|result| result.expect("guest start"))
            .collect();
        let _stop_on_drop = StopOnDrop::new(&guests[0]);
        let cluster = guests[0].cluster.clone();

        let starters = guests.iter().filter(|guest| guest.started_here()).count();
        assert_eq!(
            starters, 1,
            "exactly one guest runs initdb and starts the server"
        );
        assert!(guests.iter().all(|guest| guest.port == guests[0].port));
        for guest in guests {
            guest.stop().await.expect("guest stop is a no-op");
        }
        assert!(cluster.is_running().await.expect("pg_ctl status"));

        let owner = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
            .await
            .expect("owner adopts the cluster");
        owner.stop().await.expect("owner stops the cluster");
        assert!(!cluster.is_running().await.expect("pg_ctl status"));
    }

    #[tokio::test]
    async fn failed_start_reports_the_log_tail() {
        let tempdir = cluster_tempdir();
        let first = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
            .await
            .expect("first start");
        let _stop_on_drop = StopOnDrop::new(&first);
        let cluster = first.cluster.clone();
        first.stop().await.expect("first stop");

        let config = cluster.data_dir().join("postgresql.conf");
        let mut contents = std::fs::read_to_string(&config).expect("read postgresql.conf");
        contents.push_str("this line is not a setting\n");
        std::fs::write(&config, contents).expect("break postgresql.conf");

        let error = match EmbeddedPostgres::start(tempdir.path(), Role::Owner).await {
            Ok(handle) => {
                let _stop_again = StopOnDrop::new(&handle);
                panic!("a broken postgresql.conf should stop the server from starting");
            }
            Err(error) => error,
        };
        let message = error.to_string();
        let EmbeddedError::StartFailed { log_tail, .. } = error else {
            panic!("unexpected error: {message}");
        };
        assert!(log_tail.contains("postgresql.conf"), "{message}");
        assert!(log_tail.lines().count() <= LOG_TAIL_LINES, "{message}");
    }

    #[tokio::test]
    async fn missing_binaries_name_the_packages_to_install() {
        let error = select_server_binaries(&[])
            .await
            .expect_err("no candidates, no binaries");
        let message = error.to_string();
        assert!(matches!(error, EmbeddedError::BinariesNotFound));
        assert!(message.contains("apt install postgresql"), "{message}");
        assert!(message.contains("postgresql-server"), "{message}");
        assert!(message.contains("brew install postgresql"), "{message}");

        let empty = tempfile::tempdir().expect("tempdir");
        let error = select_server_binaries(&[empty.path().to_path_buf()])
            .await
            .expect_err("empty directory holds no binaries");
        assert!(matches!(error, EmbeddedError::BinariesNotFound));
    }

    #[tokio::test]
    async fn binaries_are_found_on_this_machine() {
        let binaries = locate_server_binaries().await.expect("server binaries");
        assert!(binaries.initdb().is_file());
        assert!(binaries.pg_ctl().is_file());
    }

    #[tokio::test]
    async fn unsearchable_ancestor_is_reported_when_root() {
        let tempdir = cluster_tempdir();
        if effective_uid(tempdir.path()).await.expect("uid") != 0 {
            return;
        }
        // Root-owned and 0700: the server user cannot pass through it.
        std::fs::set_permissions(tempdir.path(), std::fs::Permissions::from_mode(0o700))
            .expect("restrict tempdir");
        let nested = tempdir.path().join("nested").join("postgres");
        let error = match EmbeddedPostgres::start(&nested, Role::Guest).await {
            Ok(handle) => {
                let _stop_on_drop = StopOnDrop::new(&handle);
                panic!("server user should not reach {}", nested.display());
            }
            Err(error) => error,
        };
        let message = error.to_string();
        match error {
            EmbeddedError::DirectoryNotSearchable { directory, .. } => {
                assert_eq!(directory, tempdir.path().canonicalize().expect("canonical"));
            }
            other => panic!("unexpected error: {other}"),
        }
        assert!(message.contains("CONVERGER_STATE_DIR"), "{message}");
    }

    #[test]
    fn passwd_parsing_and_user_choice() {
        let passwd = "\
root:x:0:0:root:/root:/bin/bash
# a comment
broken line
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
postgres:x:101:104:PostgreSQL administrator,,,:/var/lib/postgresql:/bin/bash
";
        let users = parse_passwd(passwd);
        assert_eq!(users.len(), 3);
        let chosen = pick_server_user(&users).expect("a server user");
        assert_eq!(
            chosen,
            ServerUser {
                name: "postgres".to_owned(),
                uid: 101,
                gid: 104,
                home: PathBuf::from("/var/lib/postgresql"),
            }
        );

        let without_postgres = parse_passwd("nobody:x:65534:65534::/nonexistent:/bin/false\n");
        assert_eq!(
            pick_server_user(&without_postgres).map(|user| user.name),
            Some("nobody".to_owned())
        );
        assert_eq!(
            pick_server_user(&parse_passwd("root:x:0:0::/root:/bin/sh\n")),
            None
        );
    }

    #[test]
    fn searchability_follows_mode_bits() {
        let user = ServerUser {
            name: "postgres".to_owned(),
            uid: 101,
            gid: 104,
            home: PathBuf::from("/var/lib/postgresql"),
        };
        assert!(is_searchable_by(0o755, 0, 0, &user));
        assert!(is_searchable_by(0o1777, 0, 0, &user));
        assert!(!is_searchable_by(0o700, 0, 0, &user));
        assert!(is_searchable_by(0o700, 101, 0, &user));
        assert!(is_searchable_by(0o710, 0, 104, &user));
        assert!(!is_searchable_by(0o701, 0, 104, &user));
        assert!(!is_searchable_by(0o077, 101, 0, &user));
    }

    #[test]
    fn postmaster_pid_port_and_log_helpers() {
        let postmaster_pid =
            "1234\n/tmp/x/data\n1700000000\n54321\n\n127.0.0.1\n  5432001  0\nready   \n";
        assert_eq!(parse_postmaster_port(postmaster_pid), Some(54321));
        assert_eq!(parse_postmaster_port("1234\n/tmp/x/data\n"), None);

        assert!(mentions_port_in_use(
            "LOG:  could not bind IPv4 address \"127.0.0.1\": Address already in use"
        ));
        assert!(!mentions_port_in_use("LOG:  database system is ready"));

        assert_eq!(last_lines("a\nb\nc\n", 2), "b\nc");
        assert_eq!(last_lines("a", 20), "a");
        assert_eq!(parse_version("15"), Some(vec![15]));
        assert_eq!(parse_version("9.6"), Some(vec![9, 6]));
        assert_eq!(parse_version("common"), None);
    }

    #[test]
    fn urls_encode_database_names() {
        assert_eq!(
            connection_url("abc", 5432, "postgres"),
            "postgres://postgres:abc@127.0.0.1:5432/postgres"
        );
        assert_eq!(
            connection_url("abc", 5432, "my db/1"),
            "postgres://postgres:abc@127.0.0.1:5432/my%20db%2F1"
        );
        assert_eq!(generate_password().len(), 32);
    }
}
