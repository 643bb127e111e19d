//! `turns --users U --agents A --duration S`: end users, each in a conversation of its own, and
//! agents of one group answering every turn with `turnResult`. The users run in closed loop, or
//! with `--rate R` paced: together they send R turns per second, each on a fixed schedule.
//! With `--storm N`, N more end users hold idle sessions and all close them at once partway
//! through (and, with `--storm-reconnect`, all come back at once), and the turns sent in the
//! second after that are reported separately.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use converger_client::{RestClient, TokenRequest};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use uuid::Uuid;

use crate::frame_views::UserFrame;
use crate::gateway::{DEFAULT_DATABASE_URL, Gateway, bench_channel, default_binary};
use crate::pipelined_agent::{self, Arrivals, Refusals};
use crate::stats::{Samples, percentiles};
use crate::usage::Usage;
use crate::{gateway_metrics, machine};

mod storm;
pub use storm::StormArgs;
use storm::{storm, storm_figures};

/// Arguments of `turns`.
#[derive(Debug, clap::Args)]
pub struct TurnsArgs {
    /// End users, each in its own conversation (closed loop unless paced with `--rate`).
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
    /// Pace the users: together they send this many turns per second, each user on a fixed
    /// schedule, and latency counts from the scheduled send (a late send is not forgiven).
    /// Without it, each user sends its next turn as soon as the last one is answered.
    #[arg(long, value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// The node's cluster bus: `postgres` (commits notify) or `nats` (commits published on
    /// `--nats-url` after they committed; ADR 0033).
    #[arg(long, default_value = "postgres")]
    pub bus: String,
    /// NATS server for `--bus nats`.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// The agents answer every turn with a runtime write (how many turns of the conversation
    /// they answered), against the version the turn was delivered with.
    #[arg(long)]
    pub runtime_writes: bool,
    /// A storm of disconnects (and reconnects) partway through; none by default.
    #[command(flatten)]
    pub storm: StormArgs,
}

/// `--rate`: a finite rate of at least 0.01 turns per second.
fn parse_rate(text: &str) -> Result<f64, String> {
    let rate: f64 = text.parse().map_err(|error| format!("{error}"))?;
    if !rate.is_finite() || rate < 0.01 {
        return Err(format!("{rate} is not a rate of at least 0.01 turns/s"));
    }
    Ok(rate)
}

/// What one `turns` measurement found.
pub struct TurnsFigures {
    /// End users (closed loop, or paced at `rate`).
    pub users: usize,
    /// Agents in the group.
    pub agents: usize,
    /// Turns per second the paced users were asked to send (none: closed loop).
    pub rate: Option<f64>,
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
    /// Wall-clock time the window started, ms since the epoch (to line the timeline up with
    /// the server's logs).
    pub started_at_ms: i64,
    /// Per second of the window: the turns sent in it and their round trip p99 and max.
    pub timeline: Value,
    /// With `--storm`: the sessions closed, and send → answer received percentiles (ms) of the
    /// turns sent in the second after they closed and of those sent before.
    pub storm: Option<Value>,
    /// Gateway resident set size at the end, KiB.
    pub gateway_rss_kib: u64,
    /// Gateway CPU over the measurement, percent of one core.
    pub gateway_cpu_percent: f64,
    /// CPU per process group and WAL, per turn (`usage::Usage::per_turn`).
    pub usage_per_turn: Value,
    /// The gateway's group commit over the measurement ([`gateway_metrics::group_commit`]).
    pub group_commit: Value,
    /// The agents' results the gateway refused, by error code.
    pub agent_refusals: BTreeMap<String, u64>,
}

impl TurnsFigures {
    /// The figures as JSON fields (the `turns` line without `bench` and `machine`).
    pub fn to_json(&self) -> Value {
        json!({
            "users": self.users,
            "agents": self.agents,
            "rate": self.rate,
            "duration_secs": self.duration_secs,
            "turns": self.turns,
            "turns_per_sec": self.turns_per_sec,
            "ack_ms": self.ack_ms,
            "to_agent_ms": self.to_agent_ms,
            "round_trip_ms": self.round_trip_ms,
            "started_at_ms": self.started_at_ms,
            "timeline": self.timeline,
            "storm": self.storm,
            "gateway_rss_kib": self.gateway_rss_kib,
            "gateway_cpu_percent": self.gateway_cpu_percent,
            "usage_per_turn": self.usage_per_turn,
            "group_commit": self.group_commit,
            "agent_refusals": self.agent_refusals,
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
    if args.storm.sessions > 0 && args.storm.at_secs >= args.duration {
        anyhow::bail!(
            "--storm-at {} is not within --duration {}",
            args.storm.at_secs,
            args.duration
        );
    }
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let binary = args.binary.clone().unwrap_or_else(default_binary);
    let env = [
        ("CONVERGER_GROUP_SETTLE_MS", "100".to_owned()),
        ("CONVERGER_LIMITS__MAX_FRAMES_PER_SEC", "100000".to_owned()),
        ("CONVERGER_DATABASE__MAX_CONNECTIONS", "32".to_owned()),
        ("CONVERGER_BUS", args.bus.clone()),
        ("CONVERGER_NATS__SERVERS", args.nats_url.clone()),
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
    let refusals: Refusals = Arc::default();
    let mut agents = Vec::new();
    let mut eligibility = Vec::new();
    for _ in 0..args.agents {
        let (eligible, since) = tokio::sync::oneshot::channel();
        eligibility.push(since);
        let serving = pipelined_agent::serve(
            gateway.ws_url.clone(),
            agent_token.clone(),
            "bench",
            args.runtime_writes,
            Arc::clone(&arrivals),
            Arc::clone(&refusals),
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

    // The storm's sessions open first, so that counting them present is over by the clock.
    let storm_sessions = connect_users(
        &client,
        &channel.secret,
        &gateway.ws_url,
        args.storm.sessions,
    )
    .await?;
    let connected = connect_users(&client, &channel.secret, &gateway.ws_url, args.users).await?;
    let mut returning = Vec::new();
    if args.storm.reconnect {
        for session in &storm_sessions {
            let bound = TokenRequest {
                conversation_id: Some(session.conversation_id),
                ..TokenRequest::default()
            };
            returning.push(client.generate_token(&channel.secret, &bound).await?.token);
        }
    }

    let metrics_before = gateway_metrics::scrape(&gateway.base_url).await;
    let cpu_before = machine::cpu_ticks(gateway.pid()).unwrap_or(0);
    let usage_before = Usage::take(Some(&args.database_url)).await;
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.duration);
    let started_at_ms = crate::cluster::now_ms();
    let closing = (!storm_sessions.is_empty()).then(|| {
        let storm_at = started + Duration::from_secs(args.storm.at_secs);
        tokio::spawn(storm(
            storm_sessions,
            storm_at,
            gateway.ws_url.clone(),
            returning,
        ))
    });
    let mut users = Vec::new();
    for (index, user) in connected.into_iter().enumerate() {
        let schedule = pace(args, started, index);
        let arrivals = Arc::clone(&arrivals);
        users.push(tokio::spawn(user_loop(
            user, started, deadline, schedule, arrivals,
        )));
    }
    let mut samples = Samples::default();
    let mut timings = Vec::new();
    // Sockets stay open until every user is done: a user that finished early and disconnected
    // would make the gateway record its departure (presence) while the others' last turns are
    // still in flight, and the window measures turns, not sessions closing.
    let mut sockets = Vec::new();
    for user in users {
        let outcome = user.await?.context("user loop")?;
        samples.extend(outcome.samples);
        timings.extend(outcome.timings);
        sockets.push(outcome.socket);
    }
    let storm = match closing {
        Some(closing) => {
            let outcome = closing.await??;
            let figures = storm_figures(&outcome, args.storm.at_secs, &timings);
            sockets.extend(outcome.returned);
            Some(figures)
        }
        None => None,
    };
    let timeline = timeline(&timings);
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_after = machine::cpu_ticks(gateway.pid()).unwrap_or(0);
    let usage_after = Usage::take(Some(&args.database_url)).await;
    let rss = machine::rss_kib(gateway.pid()).unwrap_or(0);
    let metrics_after = gateway_metrics::scrape(&gateway.base_url).await;
    for agent in agents {
        agent.abort();
    }
    drop(sockets);
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
        rate: args.rate,
        duration_secs: elapsed,
        turns,
        turns_per_sec,
        ack_ms: ack,
        to_agent_ms: to_agent,
        round_trip_ms: round_trip,
        started_at_ms,
        timeline,
        storm,
        gateway_rss_kib: rss,
        gateway_cpu_percent: cpu_percent,
        usage_per_turn: usage_before.per_turn(&usage_after, turns as f64),
        // A failed scrape leaves the gateway's view out rather than failing the measurement.
        group_commit: match (metrics_before, metrics_after) {
            (Ok(before), Ok(after)) => gateway_metrics::group_commit(&before, &after),
            (Err(error), _) | (_, Err(error)) => {
                eprintln!("no group-commit view: /metrics: {error:#}");
                Value::Null
            }
        },
        agent_refusals: refusals
            .lock()
            .map(|refused| refused.clone())
            .unwrap_or_default(),
    })
}

fn print(figures: &TurnsFigures) {
    let pacing = match figures.rate {
        Some(rate) => format!("paced at {rate:.0} turns/s"),
        None => "closed loop".to_owned(),
    };
    println!(
        "users {} agents {} duration {:.1} s, {pacing}",
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
    let slowest = figures.timeline.as_array().and_then(|seconds| {
        seconds.iter().max_by(|a, b| {
            a["p99_ms"]
                .as_f64()
                .unwrap_or(0.0)
                .total_cmp(&b["p99_ms"].as_f64().unwrap_or(0.0))
        })
    });
    if let Some(slowest) = slowest {
        println!(
            "slowest second by send time: {} s in, round trip p99 {:.2} ms of {} turns",
            slowest["second"],
            slowest["p99_ms"].as_f64().unwrap_or(0.0),
            slowest["turns"]
        );
    }
    if let Some(storm) = &figures.storm {
        let p99 = |key: &str| storm[key]["p99"].as_f64().unwrap_or(0.0);
        println!(
            "storm: {} sessions closed at {} s; round trip p99 {:.2} ms of {} turns sent before, \
             {:.2} ms of {} sent in the second after",
            storm["sessions"],
            storm["at_secs"],
            p99("round_trip_before_ms"),
            storm["turns_before"],
            p99("round_trip_in_window_ms"),
            storm["turns_in_window"],
        );
        if storm["returned"].as_u64().unwrap_or(0) > 0 {
            println!(
                "storm: {} sessions came back; hello → welcome p50 {:.2} ms, p99 {:.2} ms",
                storm["returned"],
                storm["welcome_ms"]["p50"].as_f64().unwrap_or(0.0),
                p99("welcome_ms"),
            );
        }
    }
    println!(
        "gateway RSS {} KiB, CPU {:.0}% of one core",
        figures.gateway_rss_kib, figures.gateway_cpu_percent
    );
    let group_commit = &figures.group_commit;
    if !group_commit.is_null() {
        println!(
            "group commit: {:.0} batches, {:.1} writes per batch, statement mean {:.2} ms",
            group_commit["batches"].as_f64().unwrap_or(0.0),
            group_commit["writes_per_batch"].as_f64().unwrap_or(0.0),
            group_commit["statement_ms_mean"].as_f64().unwrap_or(0.0)
        );
    }
    match figures.rate {
        Some(_) => println!(
            "goal (issue 7): p99 round trip ≤ 25 ms at half the maximum turns/s (`half-load` \
             measures both in one run)"
        ),
        None => println!(
            "goal (issue 7): turns/s ≥ the pgbench single-row insert ceiling at {} clients",
            figures.users
        ),
    }
    let mut result = figures.to_json();
    result["bench"] = json!("turns");
    result["machine"] = machine::describe();
    println!("{result}");
}

/// When a paced user sends: its first turn at `first`, then one every `every`.
#[derive(Debug, Clone, Copy)]
struct Schedule {
    first: Instant,
    every: Duration,
}

/// User `user`'s schedule under `--rate`: the users' first sends are spread evenly over one
/// interval so that the load is smooth rather than in bursts of U turns.
fn pace(args: &TurnsArgs, started: Instant, user: usize) -> Option<Schedule> {
    let rate = args.rate.filter(|rate| *rate > 0.0)?;
    let every = Duration::from_secs_f64(args.users as f64 / rate);
    let first = started + every.mul_f64(user as f64 / args.users as f64);
    Some(Schedule { first, every })
}

/// Connects every user and waits for each welcome, before the clock starts, so the window
/// measures turns only (1,000 hellos, each creating a conversation, take a second or two here).
async fn connect_users(
    client: &RestClient,
    channel_secret: &str,
    ws_url: &str,
    users: usize,
) -> anyhow::Result<Vec<ConnectedUser>> {
    let mut connecting = Vec::new();
    for _ in 0..users {
        let token = client
            .generate_token(channel_secret, &TokenRequest::default())
            .await?
            .token;
        connecting.push(tokio::spawn(connect_user(ws_url.to_owned(), token)));
    }
    let mut connected = Vec::new();
    for user in connecting {
        connected.push(user.await?.context("user connect")?);
    }
    Ok(connected)
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A user's open session: its socket and its conversation.
struct ConnectedUser {
    socket: Socket,
    conversation_id: Uuid,
}

/// Opens a user's session (hello → welcome).
async fn connect_user(url: String, token: String) -> anyhow::Result<ConnectedUser> {
    let (mut socket, _) = tokio_tungstenite::connect_async_with_config(
        url,
        Some(converger_client::socket_config()),
        true,
    )
    .await?;
    let hello = json!({"type": "hello", "protocol": "converger/1", "token": token});
    socket.send(Message::Text(hello.to_string().into())).await?;
    while let Some(message) = socket.next().await {
        if let Message::Text(text) = message? {
            let frame: Value = serde_json::from_str(text.as_str())?;
            if frame["type"] == "welcome" {
                let conversation_id = frame["data"]["conversationId"]
                    .as_str()
                    .unwrap_or_default()
                    .parse()?;
                return Ok(ConnectedUser {
                    socket,
                    conversation_id,
                });
            }
        }
    }
    anyhow::bail!("closed before the welcome")
}

/// What one user's loop measured, and its socket (closed once every user is done).
struct UserOutcome {
    samples: Samples,
    /// Each answered turn's send time and latencies.
    timings: Vec<TurnTiming>,
    socket: Socket,
}

/// One answered turn: when it was sent and how long its legs took.
#[derive(Debug, Clone, Copy)]
struct TurnTiming {
    /// Seconds into the window (the scheduled time, when paced).
    sent_secs: f64,
    /// Send → ack, ms.
    ack_ms: f64,
    /// Send → answer, ms.
    round_trip_ms: f64,
}

/// Per whole second of the window, by send time: turns, round trip p99 and max, and ack p99
/// (ms), which tells a slow commit from a slow answer.
fn timeline(timings: &[TurnTiming]) -> Value {
    let mut by_second: BTreeMap<u64, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    for turn in timings {
        let (round_trips, acks) = by_second.entry(turn.sent_secs.max(0.0) as u64).or_default();
        round_trips.push(turn.round_trip_ms);
        acks.push(turn.ack_ms);
    }
    let seconds: Vec<Value> = by_second
        .into_iter()
        .map(|(second, (mut round_trips, mut acks))| {
            let round_trip = percentiles(&mut round_trips);
            json!({
                "second": second,
                "turns": round_trips.len(),
                "p99_ms": round_trip["p99"],
                "max_ms": round_trip["max"],
                "ack_p99_ms": percentiles(&mut acks)["p99"],
            })
        })
        .collect();
    Value::Array(seconds)
}

async fn user_loop(
    user: ConnectedUser,
    started: Instant,
    deadline: Instant,
    schedule: Option<Schedule>,
    arrivals: Arrivals,
) -> anyhow::Result<UserOutcome> {
    let ConnectedUser {
        mut socket,
        conversation_id,
    } = user;
    let mut samples = Samples::default();
    let mut timings = Vec::new();
    let mut n = 0u64;
    loop {
        // Paced: every turn scheduled before the deadline is sent, late if the previous one was
        // slow, and its latency counts from the schedule (no coordinated omission).
        let sent = match schedule {
            Some(schedule) => {
                let scheduled = schedule.first + schedule.every.mul_f64(n as f64);
                if scheduled >= deadline {
                    break;
                }
                tokio::time::sleep_until(scheduled.into()).await;
                scheduled
            }
            None if Instant::now() >= deadline => break,
            None => Instant::now(),
        };
        n += 1;
        let client_id = format!("t-{n}");
        let turn = json!({"type": "text", "clientId": client_id, "data": {"text": "hello"}});
        socket.send(Message::Text(turn.to_string().into())).await?;
        let (mut seq, mut ack_ms) = (None, 0.0);
        // The ack, then the agent's answer (a persistent frame from the bot).
        loop {
            let Some(message) = socket.next().await else {
                anyhow::bail!("closed")
            };
            let Message::Text(text) = message? else {
                continue;
            };
            // A frame the view cannot read is none the user waits for (see frame_views).
            let Ok(frame) = serde_json::from_str::<UserFrame>(text.as_str()) else {
                continue;
            };
            if frame.is_ack_of(&client_id) {
                ack_ms = sent.elapsed().as_secs_f64() * 1000.0;
                samples.ack.push(ack_ms);
                seq = frame.seq();
                continue;
            }
            if frame.answers(seq) {
                let round_trip = sent.elapsed().as_secs_f64() * 1000.0;
                samples.round_trip.push(round_trip);
                timings.push(TurnTiming {
                    sent_secs: sent.saturating_duration_since(started).as_secs_f64(),
                    ack_ms,
                    round_trip_ms: round_trip,
                });
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
    Ok(UserOutcome {
        samples,
        timings,
        socket,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(users: usize, rate: Option<f64>) -> TurnsArgs {
        TurnsArgs {
            users,
            agents: 1,
            duration: 1,
            database_url: String::new(),
            binary: None,
            rate,
            bus: "postgres".into(),
            nats_url: String::new(),
            runtime_writes: false,
            storm: StormArgs::default(),
        }
    }

    /// Turns sent at these seconds with these round trips (the ack took half).
    pub(super) fn timings(sent_and_round_trips: &[(f64, f64)]) -> Vec<TurnTiming> {
        sent_and_round_trips
            .iter()
            .map(|&(sent_secs, round_trip_ms)| TurnTiming {
                sent_secs,
                ack_ms: round_trip_ms / 2.0,
                round_trip_ms,
            })
            .collect()
    }

    /// Sends (seconds into the window) and round trips (ms) of five turns.
    pub(super) const SENT: [(f64, f64); 5] = [
        (0.2, 5.0),
        (0.9, 7.0),
        (1.0, 40.0),
        (4.5, 3.0),
        (5.99, 90.0),
    ];

    #[test]
    fn turns_are_summed_up_by_the_second_they_were_sent_in() {
        let timings = timings(&SENT);
        let seconds = timeline(&timings);
        let summary: Vec<(u64, u64, f64)> = seconds
            .as_array()
            .unwrap()
            .iter()
            .map(|second| {
                (
                    second["second"].as_u64().unwrap(),
                    second["turns"].as_u64().unwrap(),
                    second["max_ms"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![(0, 2, 7.0), (1, 1, 40.0), (4, 1, 3.0), (5, 1, 90.0)]
        );
        assert_eq!(seconds[1]["ack_p99_ms"], 20.0);
    }

    #[test]
    fn paced_users_share_the_rate_and_start_spread_over_one_interval() {
        let started = Instant::now();
        let args = args(4, Some(100.0));
        let schedules: Vec<Schedule> = (0..4)
            .map(|user| pace(&args, started, user).unwrap())
            .collect();
        for (user, schedule) in schedules.iter().enumerate() {
            assert_eq!(schedule.every, Duration::from_millis(40));
            let offset = schedule.first - started;
            let expected = Duration::from_millis(10 * user as u64);
            assert!(
                offset.abs_diff(expected) < Duration::from_micros(1),
                "user {user} starts after {offset:?}"
            );
        }
    }

    #[test]
    fn a_rate_is_finite_and_positive() {
        assert_eq!(parse_rate("1206.5"), Ok(1206.5));
        for refused in ["inf", "NaN", "0", "-5", "1e-20", "fast"] {
            assert!(parse_rate(refused).is_err(), "{refused} was accepted");
        }
    }

    #[test]
    fn without_a_rate_the_users_run_in_closed_loop() {
        assert!(pace(&args(4, None), Instant::now(), 0).is_none());
        assert!(pace(&args(4, Some(0.0)), Instant::now(), 0).is_none());
    }
}
