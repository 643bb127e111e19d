//! Which database a command uses: the configured URL, or the embedded cluster.

use anyhow::Context;
use converger_gateway::Config;
use converger_store::embedded::{EmbeddedPostgres, Role};
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
            let dir = config.state_dir.join("postgres");
            let embedded = EmbeddedPostgres::start(&dir, role)
                .await
                .with_context(|| format!("embedded database in {}", dir.display()))?;
            (embedded.url().to_owned(), Some(embedded))
        } else {
            (config.database_url.clone(), None)
        };
        let options = StoreOptions {
            url,
            max_connections: config.database.max_connections,
            acquire_timeout: Duration::from_millis(config.database.acquire_timeout_ms),
            statement_timeout: Duration::from_millis(config.database.statement_timeout_ms),
        };
        let store = match Store::connect(&options).await {
            Ok(store) => store,
            Err(error) => {
                if let Some(embedded) = embedded {
                    let _ = embedded.stop().await;
                }
                return Err(error).context("cannot connect to the database");
            }
        };
        Ok(Database { store, embedded })
    }

    /// Closes the pool, then stops the embedded cluster if this process owns it.
    pub async fn close(self) -> anyhow::Result<()> {
        self.store.pool().close().await;
        if let Some(embedded) = self.embedded {
            embedded
                .stop()
                .await
                .context("stopping the embedded database")?;
        }
        Ok(())
    }
}
