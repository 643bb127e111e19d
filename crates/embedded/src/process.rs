//! Running external commands, and the small helpers around them: ports, logs, passwords, URLs.

use std::fmt::Write as _;
use std::io;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::process::Command;

use crate::error::{EmbeddedError, io_error};

/// Superuser created by initdb; every URL connects as this role.
pub(crate) const SUPERUSER: &str = "postgres";
/// The limit of a command that answers at once (`pg_ctl status`, `pg_config`, `kill -0`).
pub(crate) const QUICK_COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `command` to completion under `limit`, killing it if the limit passes.
pub(crate) async fn run_command(
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
pub(crate) fn describe_output(output: &Output) -> String {
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

pub(crate) fn pick_free_port() -> Result<u16, EmbeddedError> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
        .map_err(io_error("bind a probe socket on", Path::new("127.0.0.1:0")))?;
    let port = listener
        .local_addr()
        .map_err(io_error("read the address of", Path::new("127.0.0.1:0")))?
        .port();
    Ok(port)
}

/// Line 4 of postmaster.pid is the port the server listens on.
pub(crate) fn parse_postmaster_port(contents: &str) -> Option<u16> {
    contents.lines().nth(3)?.trim().parse().ok()
}

pub(crate) fn mentions_port_in_use(log: &str) -> bool {
    log.contains("Address already in use") || log.contains("could not bind")
}

pub(crate) fn last_lines(text: &str, count: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(count)..].join("\n")
}

pub(crate) async fn file_length(path: &Path) -> u64 {
    tokio::fs::metadata(path)
        .await
        .map(|metadata| metadata.len())
        .unwrap_or(0)
}

/// The file's contents from `offset` on; empty when unreadable, since it only decorates errors.
pub(crate) async fn read_file_from(path: &Path, offset: u64) -> String {
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

pub(crate) async fn process_is_alive(pid: u32) -> bool {
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
pub(crate) fn generate_password() -> String {
    let bytes: [u8; 16] = rand::random();
    hex::encode(bytes)
}

pub(crate) fn connection_url(password: &str, port: u16, database: &str) -> String {
    format!(
        "postgres://{SUPERUSER}:{password}@127.0.0.1:{port}/{}",
        percent_encode(database)
    )
}

/// Percent-encodes everything but RFC 3986 unreserved characters.
pub(crate) fn percent_encode(value: &str) -> String {
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
