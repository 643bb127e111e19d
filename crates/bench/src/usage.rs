//! CPU time per process group and WAL written over a measurement window, so `peers` can give
//! each system's cost per turn, in microseconds and as a multiple of one pgbench transaction
//! measured in the same run.
//!
//! CPU comes from `/proc`: a process's own user and system time, plus, for the postmaster and
//! for this process, the time of their children that exited (a Postgres backend that closed, the
//! pgbench child), which the kernel adds to the parent once it reaped them. WAL bytes come from
//! the server's insert position (exact), WAL records from `pg_stat_wal`, which backends report
//! up to a second late (so the records are approximate over a short window). When the server
//! preloads `pg_stat_statements` (see docs/benchmarks.md, "Sixth round"), the window also gives
//! each statement's calls and execution time per turn, nested statements of the batch function
//! included under `pg_stat_statements.track = all`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};
use sqlx::{Connection, PgConnection};

use crate::machine;

/// The process groups a window is split into.
const GROUPS: [&str; 5] = ["postgres", "gateway", "bench", "redis", "nats"];

/// CPU ticks per group and the WAL position at one moment.
#[derive(Debug, Clone, Default)]
pub struct Usage {
    ticks: BTreeMap<&'static str, u64>,
    wal: Option<Wal>,
    statements: Option<BTreeMap<(i64, bool), Statement>>,
}

/// One statement's totals in `pg_stat_statements`.
#[derive(Debug, Clone, sqlx::FromRow)]
struct Statement {
    queryid: i64,
    toplevel: bool,
    query: String,
    calls: i64,
    total_exec_time: f64,
    rows: i64,
}

/// Statements listed per window, by execution time.
const TOP_STATEMENTS: usize = 12;

/// The server's WAL insert position and record count.
#[derive(Debug, Clone, Copy)]
struct Wal {
    bytes: i64,
    records: i64,
}

impl Usage {
    /// Reads every process's CPU time now, and the WAL position of `database_url` if given.
    pub async fn take(database_url: Option<&str>) -> Usage {
        let (wal, statements) = match database_url {
            Some(url) => (wal_position(url).await, statements(url).await),
            None => (None, None),
        };
        Usage {
            ticks: group_ticks(),
            wal,
            statements,
        }
    }

    /// The window from `self` to `later`, divided by `turns`: µs of CPU per group and in total,
    /// and WAL bytes and records per turn.
    pub fn per_turn(&self, later: &Usage, turns: f64) -> Value {
        let turns = turns.max(1.0);
        let mut cpu = serde_json::Map::new();
        let mut total = 0.0;
        for group in GROUPS {
            let before = self.ticks.get(group).copied().unwrap_or(0);
            let after = later.ticks.get(group).copied().unwrap_or(0);
            let micros = after.saturating_sub(before) as f64 / machine::ticks_per_second() * 1e6;
            if micros > 0.0 {
                cpu.insert(group.to_owned(), json!(micros / turns));
                total += micros / turns;
            }
        }
        cpu.insert("total".to_owned(), json!(total));
        let wal = match (self.wal, later.wal) {
            (Some(before), Some(after)) => json!({
                "bytes": (after.bytes - before.bytes) as f64 / turns,
                "records": (after.records - before.records) as f64 / turns,
            }),
            _ => Value::Null,
        };
        let statements = match (&self.statements, &later.statements) {
            (Some(before), Some(after)) => statements_per_turn(before, after, turns),
            _ => Value::Null,
        };
        json!({"cpu_us": cpu, "wal": wal, "statements": statements})
    }
}

/// The statements that took the most execution time between two snapshots: per turn, calls,
/// µs and rows, and each one's share of the top-level statements' time.
fn statements_per_turn(
    before: &BTreeMap<(i64, bool), Statement>,
    after: &BTreeMap<(i64, bool), Statement>,
    turns: f64,
) -> Value {
    let mut deltas: Vec<(&Statement, i64, f64, i64)> = after
        .iter()
        .map(|(key, now)| {
            let (calls, ms, rows) = before.get(key).map_or((0, 0.0, 0), |then| {
                (then.calls, then.total_exec_time, then.rows)
            });
            (
                now,
                now.calls - calls,
                now.total_exec_time - ms,
                now.rows - rows,
            )
        })
        .filter(|(_, calls, _, _)| *calls > 0)
        .collect();
    let top_level_ms: f64 = deltas
        .iter()
        .filter(|(statement, ..)| statement.toplevel)
        .map(|(_, _, ms, _)| ms)
        .sum();
    deltas.sort_by(|a, b| b.2.total_cmp(&a.2));
    let listed: Vec<Value> = deltas
        .into_iter()
        .take(TOP_STATEMENTS)
        .map(|(statement, calls, ms, rows)| {
            let query: String = statement
                .query
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .chars()
                .take(100)
                .collect();
            json!({
                "query": query,
                "top_level": statement.toplevel,
                "calls_per_turn": calls as f64 / turns,
                "exec_us_per_turn": ms * 1_000.0 / turns,
                "rows_per_turn": rows as f64 / turns,
                "share_of_top_level_time": if top_level_ms > 0.0 { ms / top_level_ms } else { 0.0 },
            })
        })
        .collect();
    json!({"top_level_exec_us_per_turn": top_level_ms * 1_000.0 / turns, "top": listed})
}

/// Every statement's totals, when the server preloads `pg_stat_statements` (the extension is
/// created in the database if it is missing); `None` otherwise.
async fn statements(url: &str) -> Option<BTreeMap<(i64, bool), Statement>> {
    let query = async {
        let mut connection = PgConnection::connect(url).await.ok()?;
        let loaded: bool = sqlx::query_scalar(
            "SELECT current_setting('shared_preload_libraries') LIKE '%pg_stat_statements%'",
        )
        .fetch_one(&mut connection)
        .await
        .ok()?;
        if !loaded {
            return None;
        }
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&mut connection)
            .await
            .ok()?;
        let rows: Vec<Statement> = sqlx::query_as(
            "SELECT queryid, toplevel, query, calls, total_exec_time, rows
               FROM pg_stat_statements WHERE queryid IS NOT NULL",
        )
        .fetch_all(&mut connection)
        .await
        .ok()?;
        let _ = connection.close().await;
        Some(
            rows.into_iter()
                .map(|row| ((row.queryid, row.toplevel), row))
                .collect(),
        )
    };
    tokio::time::timeout(Duration::from_secs(5), query)
        .await
        .ok()
        .flatten()
}

/// Which group a process belongs to, by its command name (at most 15 characters in `/proc`).
fn group_of(pid: u32, command: &str) -> Option<&'static str> {
    if pid == std::process::id() {
        return Some("bench");
    }
    match command {
        "postgres" => Some("postgres"),
        "converger" => Some("gateway"),
        "redis-server" => Some("redis"),
        "nats-server" => Some("nats"),
        _ => None,
    }
}

/// CPU ticks of every process, summed per group; the postmaster and this process count their
/// reaped children too.
fn group_ticks() -> BTreeMap<&'static str, u64> {
    let mut ticks = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return ticks;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<u32>().ok())
        else {
            continue;
        };
        let Some(stat) = machine::process_times(pid) else {
            continue;
        };
        let Some(group) = group_of(pid, &stat.command) else {
            continue;
        };
        // Only the postmaster (a postgres process whose parent is not postgres) and this
        // process reap the children whose time is counted here; a backend's own children are
        // none.
        let is_postmaster = group == "postgres"
            && machine::process_times(stat.parent)
                .is_none_or(|parent| parent.command != "postgres");
        let reaped = if is_postmaster || group == "bench" {
            stat.children_ticks
        } else {
            0
        };
        *ticks.entry(group).or_insert(0) += stat.own_ticks + reaped;
    }
    ticks
}

async fn wal_position(url: &str) -> Option<Wal> {
    let query = async {
        let mut connection = PgConnection::connect(url).await.ok()?;
        let row: (i64, i64) = sqlx::query_as(
            "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint,
                    (SELECT wal_records FROM pg_stat_wal)",
        )
        .fetch_one(&mut connection)
        .await
        .ok()?;
        let _ = connection.close().await;
        Some(Wal {
            bytes: row.0,
            records: row.1,
        })
    };
    tokio::time::timeout(Duration::from_secs(3), query)
        .await
        .ok()
        .flatten()
}

/// `per_turn`'s CPU figures again as multiples of `p_us`, the machine CPU of one pgbench
/// transaction.
pub fn in_p(per_turn: &Value, p_us: f64) -> Value {
    let Some(cpu) = per_turn["cpu_us"].as_object() else {
        return Value::Null;
    };
    if p_us <= 0.0 {
        return Value::Null;
    }
    let scaled: serde_json::Map<String, Value> = cpu
        .iter()
        .filter_map(|(group, micros)| Some((group.clone(), json!(micros.as_f64()? / p_us))))
        .collect();
    Value::Object(scaled)
}
