//! What can go wrong while locating, initialising, starting or stopping the cluster.

use std::io;
use std::path::{Path, PathBuf};

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

pub(crate) fn io_error(
    action: &'static str,
    path: &Path,
) -> impl FnOnce(io::Error) -> EmbeddedError {
    let path = path.to_path_buf();
    move |source| EmbeddedError::Io {
        action,
        path,
        source,
    }
}
