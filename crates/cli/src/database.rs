//! Which database a command uses: the configured URL, or the embedded cluster.

use anyhow::Context;
use converger_embedded::{EmbeddedError, EmbeddedPostgres, Role};
use converger_gateway::Config;
use converger_store::{Store, StoreOptions};
use std::time::Duration;

/// A connected store and, when embedded, the cluster behind it.
pub struct Database {
    /// The store.
    pub store: Store,
    /// The embedded cluster, when no URL was configured.
    pub embedded: Option<EmbeddedPostgres>,
}

impl Database {
    /// Connects to `database_url`, or starts/reuses the embedded cluster (as `role`).
    pub async fn open(config: &Config, role: Role) -> anyhow::Result<Database> {
        let (url, embedded) = if config.database_url.is_empty() {
            let embedded = start_embedded(config, role).await?;
            (embedded.url().to_owned(), Some(embedded))
        } else {
            (config.database_url.clone(), None)
        };
        let options = StoreOptions {
            url,
            max_connections: config.database.max_connections,
            acquire_timeout: Duration::from_millis(config.database.acquire_timeout_ms),
            statement_timeout: Duration::from_millis(config.database.statement_timeout_ms),
            commit_workers: config.database.commit_workers,
            notify_in_commit: config.bus.notifies_in_commit(),
        };
        let store = match Store::connect(&options).await {
            Ok(store) => store,
            Err(error) => {
                if let Some(embedded) = embedded {
                    let _ = embedded.stop_if_unclaimed().await;
                }
                return Err(error).context("cannot connect to the database");
            }
        };
        Ok(Database { store, embedded })
    }

    /// Closes the pool, then stops the embedded cluster if this process owns it, or started it as
    /// a guest (an admin command) and no `serve` claimed it meanwhile: nothing is left running
    /// that nobody will stop.
    pub async fn close(self) -> anyhow::Result<()> {
        self.store.pool().close().await;
        if let Some(embedded) = self.embedded {
            embedded
                .stop_if_unclaimed()
                .await
                .context("stopping the embedded database")?;
        }
        Ok(())
    }
}

/// Starts the embedded cluster under `state_dir/postgres`. When running as root inside a folder
/// the unprivileged server user cannot enter (a clone under /root, say), falls back to a
/// per-checkout folder under /var/tmp so the first README command still works.
async fn start_embedded(config: &Config, role: Role) -> anyhow::Result<EmbeddedPostgres> {
    let dir = config.state_dir.join("postgres");
    match EmbeddedPostgres::start(&dir, role).await {
        Ok(embedded) => Ok(embedded),
        Err(EmbeddedError::DirectoryNotSearchable { directory, user }) => {
            let fallback = fallback_dir(&dir);
            tracing::warn!(
                unreachable = %directory.display(),
                %user,
                fallback = %fallback.display(),
                "the embedded database's server user cannot enter the state folder; using a folder under /var/tmp"
            );
            EmbeddedPostgres::start(&fallback, role)
                .await
                .with_context(|| format!("embedded database in {}", fallback.display()))
        }
        Err(error) => Err(error).with_context(|| format!("embedded database in {}", dir.display())),
    }
}

/// A stable folder per absolute state path, so restarts find the same cluster.
fn fallback_dir(dir: &std::path::Path) -> std::path::PathBuf {
    let absolute = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
    let digest = converger_store::hash_secret(&absolute.to_string_lossy());
    std::path::PathBuf::from("/var/tmp").join(format!("converger-postgres-{}", &digest[..16]))
}
