//! Finding the machine's PostgreSQL server binaries.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use tokio::process::Command;
use tracing::debug;

use crate::cluster::ServerBinaries;
use crate::error::EmbeddedError;
use crate::process::{QUICK_COMMAND_TIMEOUT, run_command};

/// Finds initdb and pg_ctl: pg_config's bindir, then PATH, then the newest Debian-style install.
pub(crate) async fn locate_server_binaries() -> Result<ServerBinaries, EmbeddedError> {
    let mut candidates = Vec::new();
    candidates.extend(pg_config_bindir().await);
    candidates.extend(path_bindirs().await);
    candidates.extend(debian_bindirs().await);
    select_server_binaries(&candidates).await
}

/// The first candidate directory holding both initdb and pg_ctl.
pub(crate) async fn select_server_binaries(
    candidates: &[PathBuf],
) -> Result<ServerBinaries, EmbeddedError> {
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

pub(crate) async fn pg_config_bindir() -> Option<PathBuf> {
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

pub(crate) async fn path_bindirs() -> Vec<PathBuf> {
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
pub(crate) async fn debian_bindirs() -> Vec<PathBuf> {
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
pub(crate) fn parse_version(name: &str) -> Option<Vec<u32>> {
    name.split('.').map(|part| part.parse().ok()).collect()
}

pub(crate) async fn is_executable(path: &Path) -> bool {
    match tokio::fs::metadata(path).await {
        Ok(metadata) => metadata.is_file() && metadata.mode() & 0o111 != 0,
        Err(_) => false,
    }
}
