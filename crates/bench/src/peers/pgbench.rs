//! The Postgres ceiling: `pgbench` running single-row INSERT transactions at U clients on a fresh
//! database. Every commit a converger turn needs is at least one such transaction, so this is
//! the rate converger cannot beat on the same server without batching commits.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use serde_json::{Value, json};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};

use super::{CONNECT_TIMEOUT, Interrupt, Outcome};
use crate::stats::percentiles;
use crate::usage::Usage;

const SCRIPT: &str = "insert into t (v) values ('converger-bench');\n";
/// Connections left free below `max_connections` for this program and other sessions.
const CONNECTION_MARGIN: usize = 10;
/// Time pgbench may take beyond `-T` (connecting, reporting) before it is killed.
const GRACE: Duration = Duration::from_secs(60);

/// Runs pgbench against the server of `server_url`; skipped when pgbench or the server is missing.
pub async fn measure(
    server_url: &str,
    clients: usize,
    duration: Duration,
    mut interrupt: Interrupt,
) -> Outcome {
    let version = match pgbench_version().await {
        Ok(version) => version,
        Err(error) => return Outcome::Skipped(format!("pgbench is not available: {error:#}")),
    };
    let connect = PgConnection::connect(server_url);
    let mut admin = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
        Ok(Ok(admin)) => admin,
        Ok(Err(error)) => return Outcome::Skipped(format!("no Postgres at {server_url}: {error}")),
        Err(_) => return Outcome::Skipped(format!("no Postgres at {server_url}: timed out")),
    };
    let database = format!("bench_pgbench_{}", std::process::id());
    let workdir =
        std::env::temp_dir().join(format!("converger-bench-pgbench-{}", std::process::id()));
    let outcome = tokio::select! {
        outcome = run(server_url, &mut admin, &database, &workdir, clients, duration) => outcome,
        () = interrupt.pressed() => Err(anyhow!("interrupted")),
    };
    let dropped = crate::gateway::drop_database(server_url, &database).await;
    let _ = std::fs::remove_dir_all(&workdir);
    let mut figures = match outcome {
        Ok(figures) => figures,
        Err(error) => return Outcome::Failed(format!("{error:#}")),
    };
    if let Err(error) = dropped {
        return Outcome::Failed(format!("drop database {database}: {error:#}"));
    }
    figures["pgbench_version"] = json!(version);
    Outcome::Measured(figures)
}

async fn pgbench_version() -> anyhow::Result<String> {
    let output = tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::process::Command::new("pgbench")
            .arg("--version")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .context("pgbench --version timed out")??;
    if !output.status.success() {
        bail!("pgbench --version exited with {}", output.status);
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

async fn show(connection: &mut PgConnection, setting: &str) -> anyhow::Result<String> {
    let query = sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(format!("SHOW {setting}")));
    Ok(tokio::time::timeout(CONNECT_TIMEOUT, query.fetch_one(connection)).await??)
}

async fn run(
    server_url: &str,
    admin: &mut PgConnection,
    database: &str,
    workdir: &Path,
    clients: usize,
    duration: Duration,
) -> anyhow::Result<Value> {
    let synchronous_commit = show(admin, "synchronous_commit").await?;
    let fsync = show(admin, "fsync").await?;
    let max_connections: usize = show(admin, "max_connections").await?.parse()?;
    let reserved: usize = show(admin, "superuser_reserved_connections")
        .await?
        .parse()?;
    // More clients than the server admits fail at connect; the ceiling is then what the
    // server's connection limit allows (leaving room for this program and other sessions).
    let requested_clients = clients;
    let clients = clients
        .min(max_connections.saturating_sub(reserved + CONNECTION_MARGIN))
        .max(1);
    crate::gateway::drop_database(server_url, database).await?;
    let create = sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")));
    tokio::time::timeout(Duration::from_secs(30), create.execute(&mut *admin)).await??;
    let options = PgConnectOptions::from_str(server_url)?.database(database);
    let mut bench =
        tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options)).await??;
    let table = sqlx::query("create table t (id bigserial primary key, v text not null)");
    tokio::time::timeout(CONNECT_TIMEOUT, table.execute(&mut bench)).await??;
    bench.close().await?;

    std::fs::create_dir_all(workdir)?;
    let script = workdir.join("insert.sql");
    std::fs::write(&script, SCRIPT)?;
    // pgbench refuses more threads than clients.
    let threads = clients.clamp(1, 2);
    let log_prefix = workdir.join("txn");
    let mut command = tokio::process::Command::new("pgbench");
    // A server with passwords (the failover pair of `--sync-standby`): pgbench reads it here.
    if let Some(password) = reqwest::Url::parse(server_url)
        .ok()
        .and_then(|url| url.password().map(str::to_owned))
    {
        command.env("PGPASSWORD", password);
    }
    command
        .arg("-n")
        .args(["-h", options.get_host()])
        .args(["-p", &options.get_port().to_string()])
        .args(["-U", options.get_username()])
        .args(["-c", &clients.to_string()])
        .args(["-j", &threads.to_string()])
        .args(["-T", &duration.as_secs().max(1).to_string()])
        .arg("-f")
        .arg(&script)
        .arg("--log")
        .arg(format!("--log-prefix={}", log_prefix.display()))
        .arg(database)
        .current_dir(workdir)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let usage_before = Usage::take(Some(server_url)).await;
    let output = tokio::time::timeout(duration + GRACE, command.output())
        .await
        .context("pgbench did not finish in time")??;
    // pgbench's backends exit after it does; their time reaches the postmaster once reaped.
    wait_for_backends_gone(admin, database).await;
    let usage_after = Usage::take(Some(server_url)).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "pgbench exited with {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let tps = field_after(&stdout, "tps = ").context("no `tps = ` in pgbench's output")?;
    let transactions = field_after(&stdout, "number of transactions actually processed: ");
    let mut latencies = read_latencies(workdir, "txn")?;
    let per_transaction = usage_before.per_turn(&usage_after, transactions.unwrap_or(0.0));
    Ok(json!({
        "usage_per_turn": per_transaction,
        "clients": clients,
        "requested_clients": requested_clients,
        "max_connections": max_connections,
        "threads": threads,
        "tps": tps,
        "transactions": transactions,
        "latency_ms": percentiles(&mut latencies),
        "script": SCRIPT.trim(),
        "synchronous_commit": synchronous_commit,
        "fsync": fsync,
        "durability": format!(
            "each INSERT is its own transaction; synchronous_commit = {synchronous_commit}, \
             fsync = {fsync}"
        ),
    }))
}

/// Waits (at most 5 s) until no backend serves `database`.
async fn wait_for_backends_gone(admin: &mut PgConnection, database: &str) {
    let started = std::time::Instant::now();
    while started.elapsed() < Duration::from_secs(5) {
        let left: Result<i64, _> =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE datname = $1")
                .bind(database)
                .fetch_one(&mut *admin)
                .await;
        if left.map_or(true, |left| left == 0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The number that follows `label` on its line of pgbench's report.
fn field_after(report: &str, label: &str) -> Option<f64> {
    let line = report.lines().find(|line| line.starts_with(label))?;
    line[label.len()..].split_whitespace().next()?.parse().ok()
}

/// Per-transaction latencies (ms) from pgbench's `--log` files (`client txn latency_us …`).
fn read_latencies(workdir: &Path, prefix: &str) -> anyhow::Result<Vec<f64>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(workdir)?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with(prefix))
        })
        .collect();
    files.sort();
    let mut latencies = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file)?;
        for line in text.lines() {
            if let Some(micros) = line
                .split_whitespace()
                .nth(2)
                .and_then(|field| field.parse::<f64>().ok())
            {
                latencies.push(micros / 1000.0);
            }
        }
    }
    Ok(latencies)
}
