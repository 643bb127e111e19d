//! `half-load`: the latency goal of issue 7 in one run. It measures the maximum throughput with
//! closed-loop users (at each `--max-users` count, the best of them), then paces users at half of
//! that rate and reports the round-trip p99 against the 25 ms goal.

use std::path::PathBuf;

use serde_json::{Value, json};

use crate::gateway::DEFAULT_DATABASE_URL;
use crate::machine;
use crate::turns::{self, StormArgs, TurnsArgs, TurnsFigures};

/// The goal: p99 round trip at half the maximum throughput, in milliseconds.
const GOAL_P99_MS: f64 = 25.0;

/// The paced run counts only if it answered at least this share of the requested rate: a
/// gateway that fell behind would otherwise be judged on the turns it managed to answer.
const RATE_REACHED: f64 = 0.95;

/// Arguments of `half-load`.
#[derive(Debug, clap::Args)]
pub struct HalfLoadArgs {
    /// Closed-loop user counts whose best throughput is the maximum.
    #[arg(long, value_delimiter = ',', default_value = "64,1000")]
    max_users: Vec<usize>,
    /// Users that share the paced half-maximum load (default: the largest closed-loop user
    /// count, so the load is spread as the maximum's was). Each user has one turn in flight at
    /// a time: with few users each one's send interval comes close to the round trip, and a
    /// slow turn delays that user's next ones.
    #[arg(long)]
    paced_users: Option<usize>,
    /// Agents in one group answering every turn.
    #[arg(long, default_value_t = 4)]
    agents: usize,
    /// Seconds of measurement per run.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Postgres server to create the benchmark databases on.
    #[arg(long, default_value = DEFAULT_DATABASE_URL)]
    database_url: String,
    /// The `converger` binary (default: next to this one).
    #[arg(long)]
    binary: Option<PathBuf>,
}

/// Runs the closed-loop runs, then the paced one, and prints a table and one JSON line.
pub async fn run(args: HalfLoadArgs) -> anyhow::Result<()> {
    let mut closed_loop = Vec::new();
    for users in &args.max_users {
        eprintln!("closed loop, {users} users, {} s …", args.duration);
        closed_loop.push(turns::figures(&turns_args(&args, *users, None)).await?);
    }
    let maximum = closed_loop
        .iter()
        .map(|figures| figures.turns_per_sec)
        .fold(0.0, f64::max);
    anyhow::ensure!(maximum > 0.0, "no closed-loop run answered a turn");
    let half = maximum / 2.0;
    let Some(most_users) = closed_loop.iter().map(|figures| figures.users).max() else {
        anyhow::bail!("no closed-loop user count given");
    };
    let paced_users = args.paced_users.unwrap_or(most_users);
    eprintln!(
        "paced at {half:.0} turns/s, {paced_users} users, {} s …",
        args.duration
    );
    let paced = turns::figures(&turns_args(&args, paced_users, Some(half))).await?;
    anyhow::ensure!(paced.turns > 0, "the paced run answered no turn");
    print(&closed_loop, maximum, &paced);
    Ok(())
}

fn turns_args(args: &HalfLoadArgs, users: usize, rate: Option<f64>) -> TurnsArgs {
    TurnsArgs {
        users,
        agents: args.agents,
        duration: args.duration,
        database_url: args.database_url.clone(),
        binary: args.binary.clone(),
        rate,
        bus: "postgres".into(),
        nats_url: String::new(),
        runtime_writes: false,
        storm: StormArgs::default(),
    }
}

fn p99(figures: &TurnsFigures) -> f64 {
    figures.round_trip_ms["p99"]
        .as_f64()
        .unwrap_or(f64::INFINITY)
}

fn print(closed_loop: &[TurnsFigures], maximum: f64, paced: &TurnsFigures) {
    println!("run                      turns/s   round trip p50 / p99 ms");
    for figures in closed_loop.iter().chain([paced]) {
        let run = match figures.rate {
            Some(rate) => format!("{} users paced at {rate:.0}", figures.users),
            None => format!("{} users closed loop", figures.users),
        };
        println!(
            "{run:<24} {:>8.0}   {:>8.2} / {:.2}",
            figures.turns_per_sec,
            figures.round_trip_ms["p50"].as_f64().unwrap_or(0.0),
            p99(figures)
        );
    }
    let half = maximum / 2.0;
    let rate_reached = paced.turns_per_sec >= RATE_REACHED * half;
    let met = rate_reached && p99(paced) <= GOAL_P99_MS;
    println!(
        "goal (issue 7): p99 round trip ≤ {GOAL_P99_MS} ms at half the maximum ({half:.0} of \
         {maximum:.0} turns/s; {:.0} answered): {:.2} ms, {}",
        paced.turns_per_sec,
        p99(paced),
        match (met, rate_reached) {
            (true, _) => "met",
            (false, true) => "not met",
            (false, false) => "not met (the paced run fell short of the rate)",
        }
    );
    let result = json!({
        "bench": "half-load",
        "maximum_turns_per_sec": maximum,
        "closed_loop": closed_loop.iter().map(TurnsFigures::to_json).collect::<Vec<Value>>(),
        "paced": paced.to_json(),
        "goal_p99_ms": GOAL_P99_MS,
        "rate_reached": rate_reached,
        "met": met,
        "machine": machine::describe(),
    });
    println!("{result}");
}
