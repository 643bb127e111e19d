//! Following the writable host when the database URL names several (ADR 0022).
//!
//! The pool opens connections with the options of one host, the current primary. A connection
//! failure anywhere (a query, a group-commit batch, the `LISTEN` connection) makes the store
//! look again: it probes every host, and when another one is the writable one it points the
//! pool there. Connections opened before the move are dropped the next time they are handed
//! out, and a new connection to a host that turned read-only is refused, so nothing writes to
//! a standby. With one host none of this runs.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};

use crate::hosts::{HostList, HostProbe, choose_host};
use crate::{StoreError, is_connection_failure};

/// How long one host may take to accept a connection and answer the probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the host in use is checked while nothing else reports a failure: a lost host
/// otherwise surfaces only when the pool gives up reconnecting (its acquire timeout).
const WATCH_INTERVAL: Duration = Duration::from_secs(1);
/// How long the watch's check may take before the host counts as failed.
const WATCH_TIMEOUT: Duration = Duration::from_millis(500);

/// True on a server that accepts writes: not a standby, and not read-only by default (as
/// pg_auto_failover fences a promoted standby until the old primary is known gone). The same
/// test as libpq's `target_session_attrs=read-write`.
pub(crate) const WRITABLE: &str =
    "SELECT NOT pg_is_in_recovery() AND NOT current_setting('transaction_read_only')::boolean";
/// Pause between rounds of probes while no host is writable (a promotion in progress).
const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// How long one search goes on before it gives up; the next failure starts another.
const SEARCH_LIMIT: Duration = Duration::from_secs(120);

/// The hosts of the database URL and which of them the pool uses.
#[derive(Debug)]
pub(crate) struct Hosts {
    names: Vec<String>,
    options: Vec<PgConnectOptions>,
    current: AtomicUsize,
    /// When the pool last moved to another host.
    moved_at: Mutex<Option<Instant>>,
    /// A search is running; failures meanwhile add nothing.
    searching: AtomicBool,
    /// How many times the pool moved: connections kept outside the pool (the `LISTEN`
    /// connection, a worker's) are given up when it changes.
    moves: tokio::sync::watch::Sender<u64>,
}

impl Hosts {
    /// The hosts of `list`, each with the options `configure` gives its URL.
    pub(crate) fn new(
        list: &HostList,
        configure: impl Fn(&str) -> Result<PgConnectOptions, StoreError>,
    ) -> Result<Hosts, StoreError> {
        let options = list
            .urls
            .iter()
            .map(|url| configure(url))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Hosts {
            names: list.names.clone(),
            options,
            current: AtomicUsize::new(0),
            moved_at: Mutex::new(None),
            searching: AtomicBool::new(false),
            moves: tokio::sync::watch::Sender::new(0),
        })
    }

    /// True when the URL names more than one host.
    pub(crate) fn several(&self) -> bool {
        self.options.len() > 1
    }

    /// Uses host `index` from the start (before the pool exists).
    pub(crate) fn start_at(&self, index: usize) {
        self.current.store(index, Ordering::Release);
    }

    /// The options of the host in use.
    pub(crate) fn current_options(&self) -> PgConnectOptions {
        self.options[self.current.load(Ordering::Acquire)].clone()
    }

    /// The first writable host, probing all of them at once; `None` when none is.
    pub(crate) async fn find_writable(&self) -> Option<usize> {
        let mut running = tokio::task::JoinSet::new();
        for (index, options) in self.options.iter().enumerate() {
            let options = options.clone();
            running.spawn(async move { (index, probe(&options).await) });
        }
        let mut probes = vec![HostProbe::Unreachable; self.options.len()];
        while let Some(finished) = running.join_next().await {
            if let Ok((index, found)) = finished {
                probes[index] = found;
            }
        }
        tracing::debug!(hosts = ?self.names, ?probes, "database hosts probed");
        choose_host(&probes)
    }

    /// Points the pool at host `index`; connections to the previous host are dropped when
    /// next handed out.
    pub(crate) fn move_to(&self, pool: &PgPool, index: usize) {
        if self.current.swap(index, Ordering::AcqRel) == index {
            return;
        }
        // Stamped first: a connection handed out between the two lines is dropped, not kept.
        *self.moved_at.lock().expect("moved_at lock poisoned") = Some(Instant::now());
        pool.set_connect_options(self.options[index].clone());
        self.moves.send_modify(|moves| *moves += 1);
        metrics::counter!("converger_db_host_moves_total").increment(1);
        tracing::warn!(host = %self.names[index], "database: moved to the writable host");
    }

    /// True when a pooled connection of age `age` was opened before the last move.
    fn opened_before_move(&self, age: Duration) -> bool {
        let moved_at = *self.moved_at.lock().expect("moved_at lock poisoned");
        moved_at.is_some_and(|moved_at| age > moved_at.elapsed())
    }
}

/// Probes one host: does it answer, and does it accept writes?
async fn probe(options: &PgConnectOptions) -> HostProbe {
    let attempt = async {
        let mut connection = options.connect().await?;
        let writable: bool = sqlx::query_scalar(WRITABLE)
            .fetch_one(&mut connection)
            .await?;
        let _ = connection.close().await;
        Ok::<bool, sqlx::Error>(writable)
    };
    match tokio::time::timeout(PROBE_TIMEOUT, attempt).await {
        Ok(Ok(true)) => HostProbe::Writable,
        Ok(Ok(false)) => HostProbe::ReadOnly,
        Ok(Err(_)) | Err(_) => HostProbe::Unreachable,
    }
}

/// The pool's view of the hosts: which one to use, and a search for the writable one after a
/// failure. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Follower {
    hosts: Arc<Hosts>,
    pool: PgPool,
}

impl Follower {
    /// Pool options that refuse a connection to a read-only host and drop connections opened
    /// before a move, when there are several hosts.
    pub(crate) fn pool_options(hosts: &Arc<Hosts>, options: PgPoolOptions) -> PgPoolOptions {
        if !hosts.several() {
            return options;
        }
        let on_acquire = Arc::clone(hosts);
        options
            .after_connect(|connection, _| {
                Box::pin(async move {
                    let writable: bool = sqlx::query_scalar(WRITABLE)
                        .fetch_one(&mut *connection)
                        .await?;
                    if !writable {
                        return Err(sqlx::Error::Protocol(READ_ONLY_HOST.to_owned()));
                    }
                    Ok(())
                })
            })
            .before_acquire(move |_, metadata| {
                let keep = !on_acquire.opened_before_move(metadata.age);
                Box::pin(async move { Ok(keep) })
            })
    }

    /// Follows `hosts` for `pool`; with several hosts, also watches the one in use until the
    /// pool closes.
    pub(crate) fn new(hosts: Arc<Hosts>, pool: PgPool) -> Follower {
        let follower = Follower { hosts, pool };
        if follower.hosts.several() {
            tokio::spawn(follower.clone().watch());
        }
        follower
    }

    /// Checks the host in use every second: one pooled query, which also catches a host that
    /// turned read-only.
    async fn watch(self) {
        let mut ticks = tokio::time::interval(WATCH_INTERVAL);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if self.pool.is_closed() {
                return;
            }
            let check = sqlx::query_scalar::<_, bool>(WRITABLE).fetch_one(&self.pool);
            match tokio::time::timeout(WATCH_TIMEOUT, check).await {
                Ok(Ok(true)) => {}
                Ok(Err(sqlx::Error::PoolClosed)) => return,
                Ok(Ok(false)) => self.host_failed(),
                // A busy pool is slow too: only a host that fails a probe of its own counts.
                Ok(Err(_)) | Err(_) => {
                    if probe(&self.hosts.current_options()).await != HostProbe::Writable {
                        self.host_failed();
                    }
                }
            }
        }
    }

    /// Looks for the writable host when `error` says the current one failed; at most one
    /// search runs at a time, in the background.
    pub(crate) fn saw(&self, error: &StoreError) {
        if is_connection_failure(error) {
            self.host_failed();
        }
    }

    /// Looks for the writable host: the current one failed.
    pub(crate) fn host_failed(&self) {
        if !self.hosts.several() || self.hosts.searching.swap(true, Ordering::AcqRel) {
            return;
        }
        let follower = self.clone();
        tokio::spawn(async move {
            // Reset however the search ends, so a later failure can start another.
            let _searching = SearchFlag(Arc::clone(&follower.hosts));
            follower.search().await;
        });
    }

    /// How many times the pool moved so far.
    pub(crate) fn moves(&self) -> u64 {
        *self.hosts.moves.borrow()
    }

    /// Changes whenever the pool moves to another host.
    pub(crate) fn watch_moves(&self) -> tokio::sync::watch::Receiver<u64> {
        self.hosts.moves.subscribe()
    }

    async fn search(&self) {
        let started = Instant::now();
        loop {
            if let Some(index) = self.hosts.find_writable().await {
                self.hosts.move_to(&self.pool, index);
                return;
            }
            if started.elapsed() > SEARCH_LIMIT || self.pool.is_closed() {
                tracing::warn!(hosts = ?self.hosts.names, "database: no writable host found");
                return;
            }
            tokio::time::sleep(RETRY_PAUSE).await;
        }
    }
}

/// Clears `Hosts::searching` when dropped.
struct SearchFlag(Arc<Hosts>);

impl Drop for SearchFlag {
    fn drop(&mut self) {
        self.0.searching.store(false, Ordering::Release);
    }
}

/// The refusal of a connection to a read-only host.
pub(crate) const READ_ONLY_HOST: &str = "the database host is read-only (a standby)";
