//! `peers --users U --agents A --duration S`: the `turns` round trip over Redis Streams and NATS
//! JetStream, the pgbench single-row insert ceiling, converger's store alone, and optionally
//! converger itself, in one run and one JSON line, so the ratios come from figures measured side
//! by side.

mod jetstream;
mod pgbench;
mod redis_streams;
mod store_alone;
mod write_paths;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Map, Value, json};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::gateway::DEFAULT_DATABASE_URL;
use crate::machine;
use crate::turns::{self, StormArgs, TurnsArgs};
use store_alone::WritePath;
use write_paths::Candidate;

/// The samples every peer's loop collects (defined with their summaries, in `stats`).
pub use crate::stats::Samples;

/// Arguments of `peers`.
#[derive(Debug, Clone, clap::Args)]
pub struct PeersArgs {
    /// End users, each in its own conversation, in closed loop (and pgbench clients).
    #[arg(long, default_value_t = 64)]
    users: usize,
    /// Agents in one group sharing the turns.
    #[arg(long, default_value_t = 4)]
    agents: usize,
    /// Seconds of measurement per system.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Measure only these systems; all by default, except issue 35's write paths (`store_quiet`:
    /// the store without notifications; `store_statements`, `store_statements_folded`,
    /// `store_owner`, `store_owner_folded`: the prototypes of ADR 0036), which run only when
    /// named.
    #[arg(long, value_delimiter = ',', value_parser = ["pgbench", "store", "converger", "converger_nats", "redis", "jetstream", "store_quiet", "store_statements", "store_statements_folded", "store_owner", "store_owner_folded"])]
    only: Vec<String>,
    /// Run Postgres as a primary with a synchronous standby (the failover pair, started from
    /// the machine's server binaries) for pgbench, the store and converger, instead of
    /// `--database-url`.
    #[arg(long)]
    sync_standby: bool,
    /// Postgres server for converger's database and for pgbench.
    #[arg(long, default_value = DEFAULT_DATABASE_URL)]
    database_url: String,
    /// The `converger` binary (default: next to this one).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// Redis server.
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// NATS server with JetStream enabled.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Also append the JSON line to this file (for `plot`).
    #[arg(long)]
    save: Option<PathBuf>,
    /// converger's agents answer every turn with a runtime write (`turns --runtime-writes`).
    #[arg(long)]
    runtime_writes: bool,
}

/// The closed loop every peer runs: U users, A agents, S seconds.
#[derive(Debug, Clone, Copy)]
pub struct LoopSettings {
    /// End users in closed loop.
    pub users: usize,
    /// Agents sharing the turns.
    pub agents: usize,
    /// How long users keep sending.
    pub duration: Duration,
}

/// How long a user waits for the answer to one turn before the run fails.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// Connect and request timeout towards every peer server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// One clock for the users and agents of a run: payloads carry microseconds since its epoch, so
/// the agent's arrival time can be set against the user's send time.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    epoch: Instant,
}

impl Clock {
    /// A clock starting now.
    pub fn start() -> Clock {
        Clock {
            epoch: Instant::now(),
        }
    }

    /// Microseconds since the epoch.
    pub fn now_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// Waits for every user's samples; fails as soon as a user fails or an agent stops (the users
/// would only wait for answers that never come). Dropping the sets, here or when the caller is
/// cancelled, aborts whatever still runs, so nothing writes to a server after its cleanup.
pub async fn finish(
    mut users: JoinSet<anyhow::Result<Samples>>,
    mut agents: JoinSet<anyhow::Result<()>>,
) -> anyhow::Result<Samples> {
    let mut samples = Samples::default();
    loop {
        tokio::select! {
            user = users.join_next() => match user {
                None => return Ok(samples),
                Some(Ok(Ok(user_samples))) => samples.extend(user_samples),
                Some(Ok(Err(error))) => return Err(error.context("user")),
                Some(Err(error)) => return Err(anyhow::Error::from(error).context("user")),
            },
            Some(agent) = agents.join_next() => {
                return Err(match agent {
                    Ok(Ok(())) => anyhow::anyhow!("an agent stopped while users waited"),
                    Ok(Err(error)) => error.context("agent"),
                    Err(error) => anyhow::Error::from(error).context("agent"),
                });
            }
        }
    }
}

/// Milliseconds between two clock readings (zero if `to` is earlier).
pub fn millis_between(from_us: u64, to_us: u64) -> f64 {
    to_us.saturating_sub(from_us) as f64 / 1000.0
}

/// What became of one system in a run.
pub enum Outcome {
    /// The figures.
    Measured(Value),
    /// The server did not answer (not an error).
    Skipped(String),
    /// The measurement failed after the server answered.
    Failed(String),
}

impl Outcome {
    fn to_json(&self) -> Value {
        match self {
            Outcome::Measured(figures) => figures.clone(),
            Outcome::Skipped(reason) => json!({"skipped": reason}),
            Outcome::Failed(reason) => json!({"failed": reason}),
        }
    }

    fn figures(&self) -> Option<&Value> {
        match self {
            Outcome::Measured(figures) => Some(figures),
            _ => None,
        }
    }
}

/// Ctrl-C, observed by every phase so that each can undo what it changed on its server.
#[derive(Clone)]
pub struct Interrupt {
    pressed: watch::Receiver<bool>,
}

impl Interrupt {
    fn listen() -> Interrupt {
        let (sender, pressed) = watch::channel(false);
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                let _ = sender.send(true);
            }
        });
        Interrupt { pressed }
    }

    /// An interrupt that never comes (the bench's tests).
    #[cfg(test)]
    pub fn never() -> Interrupt {
        // With its sender gone, `pressed` waits forever.
        let (_, pressed) = watch::channel(false);
        Interrupt { pressed }
    }

    /// Returns once Ctrl-C has been pressed (never if the listener is gone).
    pub async fn pressed(&mut self) {
        if self.pressed.wait_for(|pressed| *pressed).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Issue 35's write paths, measured only when `--only` names them.
const WRITE_PATHS: [(&str, WritePath); 5] = [
    ("store_quiet", WritePath::Store { notify: false }),
    (
        "store_statements",
        WritePath::Prototype(Candidate::Statements),
    ),
    (
        "store_statements_folded",
        WritePath::Prototype(Candidate::StatementsFolded),
    ),
    ("store_owner", WritePath::Prototype(Candidate::Owner)),
    (
        "store_owner_folded",
        WritePath::Prototype(Candidate::OwnerFolded),
    ),
];

/// Runs every system in turn and prints a table and one JSON line.
pub async fn run(mut args: PeersArgs) -> anyhow::Result<()> {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let pair = match args.sync_standby {
        true => {
            let dir =
                std::env::temp_dir().join(format!("converger-peers-pair-{}", std::process::id()));
            let pair = converger_embedded::ReplicatedPair::start(&dir)
                .await
                .context("starting a primary and a synchronous standby")?;
            args.database_url =
                pair.member_url(converger_embedded::PairMember::Primary, "postgres");
            Some(pair)
        }
        false => None,
    };
    let outcome = run_systems(&args).await;
    if let Some(pair) = pair {
        pair.stop()
            .await
            .context("stopping the primary and standby")?;
    }
    outcome
}

async fn run_systems(args: &PeersArgs) -> anyhow::Result<()> {
    let args = args.clone();
    let interrupt = Interrupt::listen();
    let settings = LoopSettings {
        users: args.users,
        agents: args.agents,
        duration: Duration::from_secs(args.duration),
    };
    let machine = machine::describe();
    println!("machine: {}", describe_machine(&machine));
    println!(
        "users {} agents {} duration {} s per system",
        args.users, args.agents, args.duration
    );

    let pgbench = measure_if(
        &args,
        "pgbench",
        format!("pgbench: {} clients, {} s", args.users, args.duration),
        pgbench::measure(
            &args.database_url,
            args.users,
            settings.duration,
            interrupt.clone(),
        ),
    )
    .await;
    stop_if_interrupted(&interrupt)?;
    let store = measure_if(
        &args,
        "store",
        format!("store alone: {} users", args.users),
        store_alone::measure(
            &args.database_url,
            settings,
            WritePath::Store { notify: true },
            interrupt.clone(),
        ),
    )
    .await;
    stop_if_interrupted(&interrupt)?;
    let mut write_paths = Vec::new();
    for (name, path) in WRITE_PATHS {
        let outcome = match args.only.iter().any(|only| only == name) {
            true => {
                eprintln!("{name}: {} users …", args.users);
                store_alone::measure(&args.database_url, settings, path, interrupt.clone()).await
            }
            false => Outcome::Skipped("not named by --only".to_owned()),
        };
        write_paths.push((name, outcome));
        stop_if_interrupted(&interrupt)?;
    }
    let loop_label = format!("{} users, {} agents", args.users, args.agents);
    let converger = measure_if(
        &args,
        "converger",
        format!("converger: {loop_label}"),
        measure_converger(&args, "postgres", interrupt.clone()),
    )
    .await;
    stop_if_interrupted(&interrupt)?;
    let converger_nats = measure_if(
        &args,
        "converger_nats",
        format!("converger on the NATS bus: {loop_label}"),
        measure_converger(&args, "nats", interrupt.clone()),
    )
    .await;
    stop_if_interrupted(&interrupt)?;
    let redis = measure_if(
        &args,
        "redis",
        format!("redis: {loop_label}"),
        redis_streams::measure(&args.redis_url, settings, interrupt.clone()),
    )
    .await;
    stop_if_interrupted(&interrupt)?;
    let jetstream = measure_if(
        &args,
        "jetstream",
        format!("jetstream: {loop_label}"),
        jetstream::measure(&args.nats_url, settings, interrupt.clone()),
    )
    .await;
    stop_if_interrupted(&interrupt)?;

    let systems: Vec<(&str, &Outcome)> = [
        ("converger", &converger),
        ("converger_nats", &converger_nats),
        ("store", &store),
        ("redis", &redis),
        ("jetstream", &jetstream),
    ]
    .into_iter()
    .chain(write_paths.iter().map(|(name, outcome)| (*name, outcome)))
    .collect();
    print_table(&systems, &pgbench, args.users);
    let ratios = ratios(
        &converger,
        &[
            ("converger_nats", &converger_nats),
            ("store", &store),
            ("redis", &redis),
            ("jetstream", &jetstream),
        ],
        &pgbench,
    );
    print_ratios(&ratios);

    // P: the machine CPU (Postgres and pgbench) of one pgbench transaction in this run.
    let p_us = pgbench
        .figures()
        .and_then(|figures| figures["usage_per_turn"]["cpu_us"]["total"].as_f64());
    print_usage(
        &systems
            .iter()
            .copied()
            .chain([("pgbench", &pgbench)])
            .collect::<Vec<_>>(),
        p_us,
    );
    let mut system_figures = Map::new();
    for (name, outcome) in systems.iter().copied().chain([("pgbench", &pgbench)]) {
        let mut figures = outcome.to_json();
        if let Some(p_us) = p_us
            && outcome.figures().is_some()
        {
            figures["usage_per_turn"]["cpu_p"] =
                crate::usage::in_p(&figures["usage_per_turn"], p_us);
        }
        system_figures.insert(name.to_owned(), figures);
    }
    system_figures.insert("p_us".to_owned(), json!(p_us));
    let result = json!({
        "bench": "peers",
        "users": args.users,
        "agents": args.agents,
        "duration_secs": args.duration,
        "sync_standby": args.sync_standby,
        "systems": system_figures,
        "ratios": ratios,
        "limit": format!(
            "issue 7: converger turns/s >= pgbench single-row insert tps at {} clients",
            args.users
        ),
        "machine": machine,
    });
    if let Some(path) = &args.save {
        save_line(path, &result)?;
    }
    println!("{result}");
    let failed: Vec<&str> = systems
        .iter()
        .copied()
        .chain([("pgbench", &pgbench)])
        .filter(|(_, outcome)| matches!(outcome, Outcome::Failed(_)))
        .map(|(name, _)| name)
        .collect();
    if !failed.is_empty() {
        anyhow::bail!("failed: {}", failed.join(", "));
    }
    Ok(())
}

impl PeersArgs {
    /// Whether `--only` leaves `system` in (no `--only`: every system).
    fn selects(&self, system: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|only| only == system)
    }
}

/// Runs `measure` when `--only` selects `system` (the future is not polled otherwise).
async fn measure_if(
    args: &PeersArgs,
    system: &str,
    what: String,
    measure: impl std::future::Future<Output = Outcome>,
) -> Outcome {
    if !args.selects(system) {
        return Outcome::Skipped("not selected by --only".to_owned());
    }
    eprintln!("{what} …");
    measure.await
}

fn stop_if_interrupted(interrupt: &Interrupt) -> anyhow::Result<()> {
    if *interrupt.pressed.borrow() {
        anyhow::bail!("interrupted");
    }
    Ok(())
}

/// converger end to end on `bus` (`converger_nats`: the same on the NATS bus, `--nats-url`).
async fn measure_converger(args: &PeersArgs, bus: &str, mut interrupt: Interrupt) -> Outcome {
    let turns_args = TurnsArgs {
        users: args.users,
        agents: args.agents,
        duration: args.duration,
        database_url: args.database_url.clone(),
        binary: args.binary.clone(),
        rate: None,
        bus: bus.to_owned(),
        nats_url: args.nats_url.clone(),
        runtime_writes: args.runtime_writes,
        storm: StormArgs::default(),
    };
    let figures = tokio::select! {
        figures = turns::figures(&turns_args) => figures,
        () = interrupt.pressed() => return Outcome::Failed("interrupted".to_owned()),
    };
    match figures {
        Ok(figures) => {
            let mut json = figures.to_json();
            json["round_trip"] = json!(
                "WebSocket send → ack (committed in Postgres) → agent turnResult committed → \
                 answer pushed to the user"
            );
            Outcome::Measured(json)
        }
        Err(error) => Outcome::Failed(format!("{error:#}")),
    }
}

fn describe_machine(machine: &Value) -> String {
    let memory_gib = machine["memory_kib"].as_f64().unwrap_or(0.0) / 1024.0 / 1024.0;
    format!(
        "{} CPUs ({}), {:.1} GiB, Linux {}",
        machine["cpus"],
        machine["cpu_model"].as_str().unwrap_or("?"),
        memory_gib,
        machine["kernel"].as_str().unwrap_or("?"),
    )
}

fn percentile(figures: &Value, field: &str, quantile: &str) -> f64 {
    figures[field][quantile].as_f64().unwrap_or(0.0)
}

fn print_table(systems: &[(&str, &Outcome)], pgbench: &Outcome, users: usize) {
    println!();
    println!(
        "{:<10} {:>9}  {:>23}  {:>17}  {:>23}",
        "system", "turns/s", "ack p50/p95/p99 ms", "to_agent p50/p99", "round trip p50/p95/p99"
    );
    for (name, outcome) in systems {
        match outcome {
            Outcome::Measured(figures) => println!(
                "{name:<10} {:>9.0}  {:>23}  {:>17}  {:>23}",
                figures["turns_per_sec"].as_f64().unwrap_or(0.0),
                format!(
                    "{:.1} / {:.1} / {:.1}",
                    percentile(figures, "ack_ms", "p50"),
                    percentile(figures, "ack_ms", "p95"),
                    percentile(figures, "ack_ms", "p99")
                ),
                if figures["to_agent_ms"].is_null() {
                    "–".to_owned()
                } else {
                    format!(
                        "{:.1} / {:.1}",
                        percentile(figures, "to_agent_ms", "p50"),
                        percentile(figures, "to_agent_ms", "p99")
                    )
                },
                format!(
                    "{:.1} / {:.1} / {:.1}",
                    percentile(figures, "round_trip_ms", "p50"),
                    percentile(figures, "round_trip_ms", "p95"),
                    percentile(figures, "round_trip_ms", "p99")
                ),
            ),
            Outcome::Skipped(reason) => println!("{name:<10} skipped: {reason}"),
            Outcome::Failed(reason) => println!("{name:<10} FAILED: {reason}"),
        }
    }
    match pgbench {
        Outcome::Measured(figures) => println!(
            "{:<10} {:>9.0}  insert latency p50/p95/p99 {:.1} / {:.1} / {:.1} ms ({} clients{})",
            "pgbench",
            figures["tps"].as_f64().unwrap_or(0.0),
            percentile(figures, "latency_ms", "p50"),
            percentile(figures, "latency_ms", "p95"),
            percentile(figures, "latency_ms", "p99"),
            figures["clients"],
            if figures["clients"] == figures["requested_clients"] {
                String::new()
            } else {
                format!(", capped by max_connections {}", figures["max_connections"])
            },
        ),
        Outcome::Skipped(reason) => println!("{:<10} skipped: {reason}", "pgbench"),
        Outcome::Failed(reason) => println!("{:<10} FAILED: {reason}", "pgbench"),
    }
    println!();
    println!("durability:");
    for (name, outcome) in systems.iter().chain([("pgbench", pgbench)].iter()) {
        if let Some(durability) = outcome.figures().and_then(|f| f["durability"].as_str()) {
            println!("  {name}: {durability}");
        }
    }
    println!(
        "limit (issue 7): converger turns/s ≥ the pgbench single-row insert ceiling at {users} \
         clients"
    );
}

/// CPU per turn per process group (µs, and in P when pgbench ran) and WAL per turn.
fn print_usage(systems: &[(&str, &Outcome)], p_us: Option<f64>) {
    println!();
    match p_us {
        Some(p_us) => println!(
            "CPU per turn, µs (and in P = {p_us:.0} µs, one pgbench transaction's Postgres + pgbench CPU in this run):"
        ),
        None => println!("CPU per turn, µs (no pgbench in this run, so no P):"),
    }
    for (name, outcome) in systems {
        let Some(usage) = outcome.figures().map(|figures| &figures["usage_per_turn"]) else {
            continue;
        };
        let Some(cpu) = usage["cpu_us"].as_object() else {
            continue;
        };
        let in_p = p_us.map_or(Value::Null, |p_us| crate::usage::in_p(usage, p_us));
        let parts: Vec<String> = cpu
            .iter()
            .map(|(group, micros)| {
                let micros = micros.as_f64().unwrap_or(0.0);
                match in_p[group].as_f64() {
                    Some(in_p) => format!("{group} {micros:.0} ({in_p:.2}P)"),
                    None => format!("{group} {micros:.0}"),
                }
            })
            .collect();
        let wal = if usage["wal"].is_null() {
            "no WAL".to_owned()
        } else {
            format!(
                "WAL {:.0} B, {:.1} records",
                usage["wal"]["bytes"].as_f64().unwrap_or(0.0),
                usage["wal"]["records"].as_f64().unwrap_or(0.0)
            )
        };
        println!("  {name:<10} {}; {wal}", parts.join(", "));
    }
}

/// Converger's figures divided by each peer's and by the pgbench ceiling, and the store's alone
/// divided by the ceiling.
fn ratios(converger: &Outcome, peers: &[(&str, &Outcome)], pgbench: &Outcome) -> Value {
    let mut ratios = Map::new();
    let rate = |figures: &Value| figures["turns_per_sec"].as_f64().unwrap_or(0.0);
    let ceiling_tps = pgbench
        .figures()
        .map(|ceiling| ceiling["tps"].as_f64().unwrap_or(0.0));
    // How far the storage design alone is from the ceiling, whatever the gateway does.
    let store = peers
        .iter()
        .find(|(name, _)| *name == "store")
        .and_then(|(_, outcome)| outcome.figures());
    if let (Some(store), Some(ceiling_tps)) = (store, ceiling_tps) {
        ratios.insert(
            "store/pgbench".to_owned(),
            json!({"turns_per_sec": divide(rate(store), ceiling_tps)}),
        );
    }
    let Some(ours) = converger.figures() else {
        return Value::Object(ratios);
    };
    let our_p99 = percentile(ours, "round_trip_ms", "p99");
    for (name, outcome) in peers {
        let Some(theirs) = outcome.figures() else {
            continue;
        };
        ratios.insert(
            format!("converger/{name}"),
            json!({
                "turns_per_sec": divide(rate(ours), rate(theirs)),
                "round_trip_p99": divide(our_p99, percentile(theirs, "round_trip_ms", "p99")),
            }),
        );
    }
    if let Some(ceiling_tps) = ceiling_tps {
        ratios.insert(
            "converger/pgbench".to_owned(),
            json!({"turns_per_sec": divide(rate(ours), ceiling_tps)}),
        );
    }
    Value::Object(ratios)
}

fn divide(numerator: f64, denominator: f64) -> Option<f64> {
    (denominator > 0.0).then(|| numerator / denominator)
}

fn print_ratios(ratios: &Value) {
    let Some(ratios) = ratios.as_object() else {
        return;
    };
    if ratios.is_empty() {
        println!("ratios: none (no pair of systems measured)");
        return;
    }
    for (pair, figures) in ratios {
        let rate = figures["turns_per_sec"].as_f64().unwrap_or(f64::NAN);
        match figures["round_trip_p99"].as_f64() {
            Some(p99) => println!("{pair}: turns/s ×{rate:.3}, round trip p99 ×{p99:.2}"),
            None => println!("{pair}: turns/s ×{rate:.3}"),
        }
    }
}

fn save_line(path: &PathBuf, result: &Value) -> anyhow::Result<()> {
    use std::io::Write;
    if let Some(parent) = path
        .parent()
        .filter(|parent| !parent.as_os_str().is_empty())
    {
        std::fs::create_dir_all(parent)?;
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("open {}", path.display()))?;
    writeln!(file, "{result}")?;
    Ok(())
}
