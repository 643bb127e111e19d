//! The Postgres store: migrations and the transactions behind every observable write. Every
//! query is runtime-checked (`sqlx::query_as`) and runs under both a client-side deadline and a
//! server-side `statement_timeout`.
#![forbid(unsafe_code)]

mod activities;
pub mod bus;
mod channels;
mod conversations;
mod error;
pub mod faults;
mod group_commit;
mod secrets;
mod tenants;
mod turns;

use std::future::Future;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

pub use activities::{Activity, CommitOutcome, NewActivity, Sender, SenderRole};
pub use channels::{Channel, ChannelStatus};
pub use conversations::{ChannelCatalogs, Conversation, PendingInterrupt};
pub use error::StoreError;
pub use secrets::{generate_secret, hash_secret};
pub use tenants::Tenant;
pub use turns::{
    AnswerFrame, AnswerOutcome, ChannelPendingTurn, Claim, PendingTurn, Revision, RevisionRecord,
    RuntimeWrite, StreamableTurn, TurnAnswer, initial_runtime,
};

/// Postgres channel every commit notifies; payloads are small JSON ids, never bodies.
pub const NOTIFY_CHANNEL: &str = "converger_events";

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// How to reach the database and how long to wait for it.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Postgres connection URL.
    pub url: String,
    /// Upper bound of pooled connections.
    pub max_connections: u32,
    /// Longest wait for a free pooled connection.
    pub acquire_timeout: Duration,
    /// Server-side limit for one statement, and the client-side deadline of one query.
    pub statement_timeout: Duration,
    /// Group-commit batches in progress at once (at least 1).
    pub commit_workers: usize,
}

/// Handle to the database; cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    pool: PgPool,
    query_deadline: Duration,
    /// Frames and answers, committed many to a transaction.
    group_commit: group_commit::GroupCommit,
}

/// What `Store::migrate` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    /// Versions applied by this call (empty when the schema was already current).
    pub applied: Vec<i64>,
}

impl Store {
    /// Connects a pool; fails fast when the database does not answer.
    pub async fn connect(options: &StoreOptions) -> Result<Store, StoreError> {
        let statement_timeout_ms = options.statement_timeout.as_millis().to_string();
        let connect_options: PgConnectOptions = options
            .url
            .parse::<PgConnectOptions>()
            .map_err(|source| StoreError::Config(format!("invalid database url: {source}")))?
            .application_name("converger")
            .options([("statement_timeout", statement_timeout_ms.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout)
            .connect_with(connect_options)
            .await?;
        // The server cancels a statement at statement_timeout; the client deadline adds slack
        // for the network so both rarely race.
        let query_deadline = options.statement_timeout + Duration::from_secs(1);
        Ok(Store {
            group_commit: group_commit::GroupCommit::start(
                pool.clone(),
                query_deadline,
                options.commit_workers.max(1),
            ),
            pool,
            query_deadline,
        })
    }

    /// The underlying pool, for the event bus listener and tests.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies pending migrations; a no-op when the schema is current.
    pub async fn migrate(&self) -> Result<MigrationReport, StoreError> {
        let before = self.applied_versions().await?;
        MIGRATOR.run(&self.pool).await?;
        let after = self.applied_versions().await?;
        let applied = after
            .into_iter()
            .filter(|version| !before.contains(version))
            .collect();
        Ok(MigrationReport { applied })
    }

    async fn applied_versions(&self) -> Result<Vec<i64>, StoreError> {
        let table_exists: bool = self
            .timed("migrations_table_exists", async {
                sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
                    .fetch_one(&self.pool)
                    .await
            })
            .await?;
        if !table_exists {
            return Ok(Vec::new());
        }
        self.timed("applied_versions", async {
            sqlx::query_scalar(
                "SELECT version FROM _sqlx_migrations WHERE success ORDER BY version",
            )
            .fetch_all(&self.pool)
            .await
        })
        .await
    }

    /// One round trip to the database; readiness uses it.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.timed("ping", async {
            sqlx::query("SELECT 1").execute(&self.pool).await
        })
        .await
        .map(|_| ())
    }

    /// Publishes pool gauges; called when metrics are scraped.
    pub fn record_pool_metrics(&self) {
        let size = self.pool.size();
        let idle = self.pool.num_idle() as u32;
        metrics::gauge!("converger_db_pool_connections").set(f64::from(size));
        metrics::gauge!("converger_db_pool_idle_connections").set(f64::from(idle));
        metrics::gauge!("converger_db_pool_in_use_connections")
            .set(f64::from(size.saturating_sub(idle)));
    }

    /// Runs one database operation under the client deadline and records its latency.
    async fn timed<T>(
        &self,
        operation: &'static str,
        query: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, StoreError> {
        match within_deadline(self.query_deadline, operation, query).await {
            Some(result) => result.map_err(StoreError::from),
            None => Err(StoreError::Timeout { operation }),
        }
    }
}

/// Runs `query` under `deadline` and records its latency in `converger_db_query_seconds`;
/// `None` when the deadline passed first.
pub(crate) async fn within_deadline<T, E>(
    deadline: Duration,
    operation: &'static str,
    query: impl Future<Output = Result<T, E>>,
) -> Option<Result<T, E>> {
    let started = Instant::now();
    let outcome = tokio::time::timeout(deadline, query).await.ok();
    let status = if matches!(outcome, Some(Ok(_))) {
        "ok"
    } else {
        "error"
    };
    metrics::histogram!("converger_db_query_seconds", "operation" => operation, "status" => status)
        .record(started.elapsed().as_secs_f64());
    outcome
}
