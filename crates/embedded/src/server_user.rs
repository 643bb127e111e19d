//! Who runs the server: ourselves, or, when we are root (PostgreSQL refuses to run as root), an
//! unprivileged account that must be able to reach the cluster directory.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::io::AsyncWriteExt;
use tracing::{debug, warn};

use crate::error::{EmbeddedError, io_error};

/// Accounts that may run the server when we are root, in order of preference.
const SERVER_USER_CANDIDATES: [&str; 2] = ["postgres", "nobody"];

/// An account from /etc/passwd that runs the server when we are root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServerUser {
    pub(crate) name: String,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    pub(crate) home: PathBuf,
}

/// Creates `dir` (mode 0700) and its parents; an existing directory is left as it is.
pub(crate) async fn create_private_dir(dir: &Path) -> Result<(), EmbeddedError> {
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
pub(crate) async fn effective_uid(dir: &Path) -> Result<u32, EmbeddedError> {
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
pub(crate) async fn prepare_server_user(dir: &Path) -> Result<ServerUser, EmbeddedError> {
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
pub(crate) fn parse_passwd(contents: &str) -> Vec<ServerUser> {
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
pub(crate) fn pick_server_user(users: &[ServerUser]) -> Option<ServerUser> {
    SERVER_USER_CANDIDATES.iter().find_map(|name| {
        users
            .iter()
            .find(|user| user.name == *name && user.uid != 0)
            .cloned()
    })
}

/// The first ancestor of `dir` (which must be absolute) that `user` cannot enter.
pub(crate) async fn first_unsearchable_ancestor(
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
pub(crate) fn is_searchable_by(
    mode: u32,
    owner_uid: u32,
    owner_gid: u32,
    user: &ServerUser,
) -> bool {
    if owner_uid == user.uid {
        return mode & 0o100 != 0;
    }
    if owner_gid == user.gid {
        return mode & 0o010 != 0;
    }
    mode & 0o001 != 0
}

pub(crate) fn chown_to(path: &Path, user: &ServerUser) -> Result<(), EmbeddedError> {
    std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid))
        .map_err(io_error("change owner of", path))
}

/// Writes a 0600 file, optionally handing it to `owner`.
pub(crate) async fn write_private_file(
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
