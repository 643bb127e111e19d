//! `turns --users U --agents A --duration S`: end users in closed loop, each in a conversation of
//! its own, and agents of one group answering every turn with `turnResult`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use converger_client::{RestClient, TokenRequest};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use uuid::Uuid;

use crate::gateway::{DEFAULT_DATABASE_URL, Gateway, bench_channel, default_binary};
use crate::machine;
use crate::peers::Samples;
use crate::pipelined_agent::{self, Arrivals};
use crate::stats::percentiles;

/// Arguments of `turns`.
#[derive(Debug, clap::Args)]
pub struct TurnsArgs {
    /// End users, each in its own conversation, in closed loop.
    #[arg(long, default_value_t = 64)]
    pub users: usize,
    /// Agents in one group answering every turn.
    #[arg(long, default_value_t = 4)]
    pub agents: usize,
    /// Seconds of measurement.
    #[arg(long, default_value_t = 10)]
    pub duration: u64,
    /// Postgres server to create the benchmark database on.
    #[arg(long, default_value = DEFAULT_DATABASE_URL)]
    pub database_url: String,
    /// The `converger` binary (default: next to this one).
    #[arg(long)]
    pub binary: Option<PathBuf>,
}

/// What one `turns` measurement found.
pub struct TurnsFigures {
    /// End users in closed loop.
    pub users: usize,
    /// Agents in the group.
    pub agents: usize,
    /// Seconds measured.
    pub duration_secs: f64,
    /// Turns answered (round trips completed).
    pub turns: usize,
    /// Round trips completed per second.
    pub turns_per_sec: f64,
    /// Send → ack percentiles (ms).
    pub ack_ms: Value,
    /// Send → delivered to the agent percentiles (ms).
    pub to_agent_ms: Value,
    /// Send → answer received percentiles (ms).
    pub round_trip_ms: Value,
    /// Gateway resident set size at the end, KiB.
    pub gateway_rss_kib: u64,
    /// Gateway CPU over the measurement, percent of one core.
    pub gateway_cpu_percent: f64,
}

impl TurnsFigures {
    /// The figures as JSON fields (the `turns` line without `bench` and `machine`).
    pub fn to_json(&self) -> Value {
        json!({
            "users": self.users,
            "agents": self.agents,
            "duration_secs": self.duration_secs,
            "turns": self.turns,
            "turns_per_sec": self.turns_per_sec,
            "ack_ms": self.ack_ms,
            "to_agent_ms": self.to_agent_ms,
            "round_trip_ms": self.round_trip_ms,
            "gateway_rss_kib": self.gateway_rss_kib,
            "gateway_cpu_percent": self.gateway_cpu_percent,
        })
    }
}

/// Runs the measurement and prints a table and one JSON line.
pub async fn run(args: TurnsArgs) -> anyhow::Result<()> {
    let figures = figures(&args).await?;
    print(&figures);
    Ok(())
}

/// Starts a gateway on a fresh database, measures, stops it and returns the figures.
pub async fn figures(args: &TurnsArgs) -> anyhow::Result<TurnsFigures> {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let binary = args.binary.clone().unwrap_or_else(default_binary);
    let env = [
        ("CONVERGER_GROUP_SETTLE_MS", "100".to_owned()),
        ("CONVERGER_LIMITS__MAX_FRAMES_PER_SEC", "100000".to_owned()),
        ("CONVERGER_DATABASE__MAX_CONNECTIONS", "32".to_owned()),
    ];
    let gateway = Gateway::start(&binary, &args.database_url, &env).await?;
    let outcome = measure(args, &gateway).await;
    gateway.stop().await?;
    outcome
}

async fn measure(args: &TurnsArgs, gateway: &Gateway) -> anyhow::Result<TurnsFigures> {
    let client = RestClient::new(&gateway.base_url)?;
    let (channel, agent_token) =
        bench_channel(&client, "turns", &TokenRequest::channel_scope()).await?;
    let arrivals: Arrivals = Arc::new(Mutex::new(HashMap::new()));
    let mut agents = Vec::new();
    let mut eligibility = Vec::new();
    for _ in 0..args.agents {
        let (eligible, since) = tokio::sync::oneshot::channel();
        eligibility.push(since);
        let serving = pipelined_agent::serve(
            gateway.ws_url.clone(),
            agent_token.clone(),
            "bench",
            Arc::clone(&arrivals),
            eligible,
        );
        agents.push(tokio::spawn(async move {
            if let Err(error) = serving.await {
                eprintln!("agent stopped: {error:#}");
            }
        }));
    }
    // Members own turns committed at or after their `since` (the welcome's, after the settle
    // delay); the users start once every member is eligible.
    let mut latest_since = 0;
    for since in eligibility {
        let since = tokio::time::timeout(Duration::from_secs(10), since)
            .await
            .context("an agent's welcome did not come")?
            .context("an agent stopped before its welcome")?;
        latest_since = latest_since.max(since);
    }
    let wait_ms = latest_since - crate::cluster::now_ms() + 5;
    if let Ok(wait_ms) = u64::try_from(wait_ms) {
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
    }

    let cpu_before = machine::cpu_ticks(gateway.pid()).unwrap_or(0);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.duration);
    let mut users = Vec::new();
    for _ in 0..args.users {
        let token = client
            .generate_token(&channel.secret, &TokenRequest::default())
            .await?
            .token;
        let url = gateway.ws_url.clone();
        let arrivals = Arc::clone(&arrivals);
        users.push(tokio::spawn(async move {
            user_loop(url, token, deadline, arrivals).await
        }));
    }
    let mut samples = Samples::default();
    for user in users {
        samples.extend(user.await?.context("user loop")?);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_after = machine::cpu_ticks(gateway.pid()).unwrap_or(0);
    let rss = machine::rss_kib(gateway.pid()).unwrap_or(0);
    for agent in agents {
        agent.abort();
    }
    let turns = samples.round_trip.len();
    let turns_per_sec = turns as f64 / elapsed;
    let cpu_percent =
        (cpu_after.saturating_sub(cpu_before)) as f64 / machine::ticks_per_second() / elapsed
            * 100.0;
    let ack = percentiles(&mut samples.ack);
    let to_agent = percentiles(&mut samples.to_agent);
    let round_trip = percentiles(&mut samples.round_trip);
    Ok(TurnsFigures {
        users: args.users,
        agents: args.agents,
        duration_secs: elapsed,
        turns,
        turns_per_sec,
        ack_ms: ack,
        to_agent_ms: to_agent,
        round_trip_ms: round_trip,
        gateway_rss_kib: rss,
        gateway_cpu_percent: cpu_percent,
    })
}

fn print(figures: &TurnsFigures) {
    println!(
        "users {} agents {} duration {:.1} s",
        figures.users, figures.agents, figures.duration_secs
    );
    println!(
        "turns {} → {:.0} turns/s",
        figures.turns, figures.turns_per_sec
    );
    println!("               p50      p95      p99  (ms)");
    for (name, percentiles) in [
        ("ack", &figures.ack_ms),
        ("to_agent", &figures.to_agent_ms),
        ("round_trip", &figures.round_trip_ms),
    ] {
        let at = |q: &str| percentiles[q].as_f64().unwrap_or(0.0);
        println!(
            "{name:<10} {:>8.2} {:>8.2} {:>8.2}",
            at("p50"),
            at("p95"),
            at("p99")
        );
    }
    println!(
        "gateway RSS {} KiB, CPU {:.0}% of one core",
        figures.gateway_rss_kib, figures.gateway_cpu_percent
    );
    println!(
        "goal (issue 7): turns/s ≥ the pgbench single-row insert ceiling at {} clients",
        figures.users
    );
    let mut result = figures.to_json();
    result["bench"] = json!("turns");
    result["machine"] = machine::describe();
    println!("{result}");
}

async fn user_loop(
    url: String,
    token: String,
    deadline: Instant,
    arrivals: Arrivals,
) -> anyhow::Result<Samples> {
    let (mut socket, _) = tokio_tungstenite::connect_async_with_config(url, None, true).await?;
    let hello = json!({"type": "hello", "protocol": "converger/1", "token": token});
    socket.send(Message::Text(hello.to_string().into())).await?;
    let mut conversation_id = Uuid::nil();
    while let Some(message) = socket.next().await {
        if let Message::Text(text) = message? {
            let frame: Value = serde_json::from_str(text.as_str())?;
            if frame["type"] == "welcome" {
                conversation_id = frame["data"]["conversationId"]
                    .as_str()
                    .unwrap_or_default()
                    .parse()?;
                break;
            }
        }
    }
    let mut samples = Samples::default();
    let mut n = 0u64;
    while Instant::now() < deadline {
        n += 1;
        let client_id = format!("t-{n}");
        let sent = Instant::now();
        let turn = json!({"type": "text", "clientId": client_id, "data": {"text": "hello"}});
        socket.send(Message::Text(turn.to_string().into())).await?;
        let mut seq = None;
        // The ack, then the agent's answer (a persistent frame from the bot).
        loop {
            let Some(message) = socket.next().await else {
                anyhow::bail!("closed")
            };
            let Message::Text(text) = message? else {
                continue;
            };
            let frame: Value = serde_json::from_str(text.as_str())?;
            if frame["type"] == "ack" && frame["clientId"] == client_id.as_str() {
                samples.ack.push(sent.elapsed().as_secs_f64() * 1000.0);
                seq = frame["seq"].as_i64();
                continue;
            }
            if frame["from"] == "bot" && frame["seq"].as_i64() > seq {
                samples
                    .round_trip
                    .push(sent.elapsed().as_secs_f64() * 1000.0);
                let arrived = seq.and_then(|seq| {
                    arrivals
                        .lock()
                        .ok()
                        .and_then(|seen| seen.get(&(conversation_id, seq)).copied())
                });
                if let Some(arrived) = arrived {
                    samples
                        .to_agent
                        .push(arrived.saturating_duration_since(sent).as_secs_f64() * 1000.0);
                }
                break;
            }
        }
    }
    Ok(samples)
}
