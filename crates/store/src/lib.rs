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
pub mod hosts;
mod http_agents;
mod lifecycle;
mod presence;
mod primary;
mod secrets;
mod tenants;
mod turns;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

pub use activities::{Activity, CommitOutcome, FrameRange, NewActivity, Sender, SenderRole};
pub use channels::{Channel, ChannelStatus, TurnSettings};
pub use conversations::{
    ChannelCatalogs, Conversation, ConversationFilter, PendingInterrupt, WelcomeReads,
};
pub use error::StoreError;
pub(crate) use error::{is_connection_failure, is_sqlx_connection_failure};
pub use http_agents::{DeadLetter, HttpAgent, HttpAgentSettings};
pub use lifecycle::{
    CONVERSATION_UPDATE, EXPIRED_REASON, Expired, MAX_REASON_CHARS, SYSTEM_SENDER, StatusChange,
    Transition,
};
pub use presence::{Gone, Incarnation, PresenceChange, PresenceTotal};
pub use secrets::{generate_secret, hash_secret};
pub use tenants::Tenant;
pub use turns::{
    AnswerFrame, AnswerOutcome, ChannelPendingTurn, Claim, OverdueStop, PendingTurn, PolicyCommit,
    PolicyVerdict, Revision, RevisionRecord, RuntimeWrite, Settlement, StopOutcome, StoppedAnswer,
    StoppedTurn, StreamableTurn, TurnAnswer, TurnProgress, TurnRevision, initial_runtime,
};

/// Postgres channel every commit notifies; payloads are small JSON ids, never bodies.
pub const NOTIFY_CHANNEL: &str = "converger_events";

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// How to reach the database and how long to wait for it.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Postgres connection URL; it may name several hosts (`postgres://u@h1:5432,h2:5432/db`),
    /// of which the store uses the writable one.
    pub url: String,
    /// Upper bound of pooled connections.
    pub max_connections: u32,
    /// Longest wait for a free pooled connection.
    pub acquire_timeout: Duration,
    /// Server-side limit for one statement, and the client-side deadline of one query.
    pub statement_timeout: Duration,
    /// Group-commit batches in progress at once (at least 1).
    pub commit_workers: usize,
    /// Whether committing statements announce their commits with `pg_notify` (the `postgres`
    /// bus). Off for a node whose bus publishes its commits itself after they committed: its
    /// connections carry `converger.notify = off` (ADR 0033).
    pub notify_in_commit: bool,
}

/// Handle to the database; cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    pool: PgPool,
    query_deadline: Duration,
    /// Frames and answers, committed many to a transaction.
    group_commit: group_commit::GroupCommit,
    /// Which database host the pool uses, and the search for another after a failure.
    follower: primary::Follower,
    /// Whether committing statements notify (`StoreOptions::notify_in_commit`).
    notify_in_commit: bool,
}

/// What `Store::migrate` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    /// Versions applied by this call (empty when the schema was already current).
    pub applied: Vec<i64>,
}

impl Store {
    /// Whether committing statements announce their commits with `pg_notify`.
    pub fn notifies_in_commit(&self) -> bool {
        self.notify_in_commit
    }

    /// The database's clock now, in ms since the epoch (commit times are on this clock).
    pub async fn database_now_ms(&self) -> Result<i64, StoreError> {
        self.timed("database_now", async {
            sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
                .fetch_one(&self.pool)
                .await
        })
        .await
    }

    /// Connects a pool; fails fast when the database does not answer. With several hosts, it
    /// connects to the writable one (a primary), and fails fast when none is.
    pub async fn connect(options: &StoreOptions) -> Result<Store, StoreError> {
        let statement_timeout_ms = options.statement_timeout.as_millis().to_string();
        let configure = |url: &str| {
            url.parse::<PgConnectOptions>()
                .map_err(|source| StoreError::Config(format!("invalid database url: {source}")))
                .map(|parsed| {
                    // No plan reads a whole table where an index serves: a connection
                    // caches plans made while a table was empty (a new database, a new
                    // deployment), and until an ANALYZE of that table, a look-up by key
                    // would keep scanning the table as it grows (ADR 0044).
                    let parsed = parsed.application_name("converger").options([
                        ("statement_timeout", statement_timeout_ms.as_str()),
                        ("enable_seqscan", "off"),
                    ]);
                    if options.notify_in_commit {
                        parsed
                    } else {
                        parsed.options([("converger.notify", "off")])
                    }
                })
        };
        let host_list = hosts::split_hosts(&options.url)?;
        let hosts = Arc::new(primary::Hosts::new(&host_list, configure)?);
        if hosts.several() {
            let Some(writable) = hosts.find_writable().await else {
                return Err(StoreError::Unavailable(format!(
                    "no writable host among {}",
                    host_list.names.join(", ")
                )));
            };
            hosts.start_at(writable);
        }
        let pool_options = PgPoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout);
        let pool = primary::Follower::pool_options(&hosts, pool_options)
            .connect_with(hosts.current_options())
            .await?;
        let follower = primary::Follower::new(hosts, pool.clone());
        // The server cancels a statement at statement_timeout; the client deadline adds slack
        // for the network so both rarely race.
        let query_deadline = options.statement_timeout + Duration::from_secs(1);
        Ok(Store {
            group_commit: group_commit::GroupCommit::start(
                pool.clone(),
                query_deadline,
                options.commit_workers.max(1),
                follower.clone(),
                options.notify_in_commit,
            ),
            pool,
            query_deadline,
            follower,
            notify_in_commit: options.notify_in_commit,
        })
    }

    /// The underlying pool, for the event bus listener and tests.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies pending migrations; a no-op when the schema is current.
    pub async fn migrate(&self) -> Result<MigrationReport, StoreError> {
        let before = self.applied_versions().await?;
        // A migration may change every row of a table, which a scan serves best: migrations
        // run with `enable_seqscan` back on, on a connection that then leaves the pool, so no
        // look-up runs with it later (ADR 0044).
        let mut connection = self.pool.acquire().await?;
        connection.close_on_drop();
        sqlx::query("SET enable_seqscan = on")
            .execute(&mut *connection)
            .await?;
        MIGRATOR.run(&mut *connection).await?;
        drop(connection);
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

    /// One round trip to the database, which must accept writes (not a standby, not
    /// read-only); readiness uses it.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let writable: bool = self
            .timed("ping", async {
                sqlx::query_scalar(primary::WRITABLE)
                    .fetch_one(&self.pool)
                    .await
            })
            .await?;
        if !writable {
            let error = StoreError::Unavailable("the database is read-only".into());
            self.follower.saw(&error);
            return Err(error);
        }
        Ok(())
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
        let outcome = match within_deadline(self.query_deadline, operation, query).await {
            Some(result) => result.map_err(StoreError::from),
            None => Err(StoreError::Timeout { operation }),
        };
        if let Err(error) = &outcome {
            self.follower.saw(error);
        }
        outcome
    }

    /// The longest a caller can wait before a lost connection surfaces as an error: the pool's
    /// acquire timeout (it retries a refused connection until then), then a query's deadline.
    pub(crate) fn failure_notice_lag(&self) -> Duration {
        self.pool.options().get_acquire_timeout() + self.query_deadline
    }

    /// Looks for the writable host when `error` says the current one failed.
    pub(crate) fn failed_with(&self, error: &StoreError) {
        self.follower.saw(error);
    }

    /// Changes whenever the pool moves to another database host.
    pub(crate) fn host_moves(&self) -> tokio::sync::watch::Receiver<u64> {
        self.follower.watch_moves()
    }

    /// Looks for the writable host after the `LISTEN` connection failed with `error`.
    pub(crate) fn listener_failed(&self, error: &sqlx::Error) {
        if is_sqlx_connection_failure(error) {
            self.follower.host_failed();
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
