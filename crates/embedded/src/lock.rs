//! The start lock: one process at a time runs initdb or pg_ctl on a cluster directory.

use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::error::{EmbeddedError, io_error};

/// Long enough for another process to run initdb and start the server while we wait.
const LOCK_TIMEOUT: Duration = Duration::from_secs(180);
const LOCK_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Exclusive lock on `start.lock`, held while starting or stopping so concurrent processes
/// never run initdb or pg_ctl on the same cluster at once; released when dropped.
pub(crate) struct StartLock {
    _file: std::fs::File,
}

impl StartLock {
    pub(crate) async fn acquire(dir: &Path) -> Result<StartLock, EmbeddedError> {
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
