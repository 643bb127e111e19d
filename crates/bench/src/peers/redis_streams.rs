//! The round trip over Redis Streams: users XADD turns to one stream, agents of one consumer group
//! XREADGROUP them, XADD the answer to the user's reply stream and XACK the turn; users XREAD
//! (BLOCK) their reply stream. Agents also run XAUTOCLAIM, the takeover path of a group. Like the
//! agent of `turns`, an agent answers every turn it has in hand at once (one pipeline per read)
//! rather than one turn per round trip.
//!
//! Redis is made durable for the run (`appendonly yes`, `appendfsync always`: every write is in
//! the fsynced AOF before its reply), and its previous settings are restored afterwards.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use redis::aio::MultiplexedConnection;
use redis::streams::{
    StreamAutoClaimOptions, StreamAutoClaimReply, StreamId, StreamReadOptions, StreamReadReply,
};
use redis::{AsyncCommands, AsyncConnectionConfig, Client};
use serde_json::json;
use tokio::task::JoinSet;

use super::{
    ANSWER_TIMEOUT, CONNECT_TIMEOUT, Clock, Interrupt, LoopSettings, Outcome, Samples, finish,
    millis_between,
};
use crate::usage::Usage;

/// How long a blocking read waits on the server before it returns empty.
const BLOCK: Duration = Duration::from_millis(1000);
/// A pending turn idle this long is taken over by another agent.
const CLAIM_MIN_IDLE: Duration = Duration::from_secs(5);
/// How often each agent looks for turns to take over.
const CLAIM_EVERY: Duration = Duration::from_secs(1);
/// Most turns an agent takes per read (it answers them together); small enough that turns
/// still spread over the agents.
const AGENT_BATCH: usize = 16;
const GROUP: &str = "agents";

struct Keys {
    turns: String,
    prefix: String,
}

impl Keys {
    fn replies(&self, user: usize) -> String {
        format!("{}:replies:{user}", self.prefix)
    }
}

/// Measures the loop against `url`; skipped when no server answers there.
pub async fn measure(url: &str, settings: LoopSettings, mut interrupt: Interrupt) -> Outcome {
    let client = match Client::open(url) {
        Ok(client) => client,
        Err(error) => return Outcome::Failed(format!("bad Redis URL {url}: {error}")),
    };
    let mut control = match connect(&client, CONNECT_TIMEOUT).await {
        Ok(connection) => connection,
        Err(error) => return Outcome::Skipped(format!("no Redis server at {url}: {error:#}")),
    };
    let previous = match read_config(&mut control).await {
        Ok(previous) => previous,
        Err(error) => return Outcome::Failed(format!("{error:#}")),
    };
    if let Err(error) = make_durable(&mut control).await {
        // One setting may have changed before the failure.
        let _ = restore(&mut control, &previous).await;
        return Outcome::Failed(format!("{error:#}"));
    }
    let prefix = format!("converger-bench:{}", std::process::id());
    let keys = Keys {
        turns: format!("{prefix}:turns"),
        prefix,
    };
    let outcome = tokio::select! {
        outcome = run_loop(&client, &mut control, &keys, settings) => outcome,
        () = interrupt.pressed() => Err(anyhow!("interrupted")),
    };
    let cleanup = delete_keys(&mut control, &keys, settings.users).await;
    let restored = restore(&mut control, &previous).await;
    if let Err(error) = &restored {
        eprintln!(
            "redis: could not restore appendonly {} / appendfsync {}: {error:#}",
            previous.appendonly, previous.appendfsync
        );
    }
    let mut figures = match outcome {
        Ok(figures) => figures,
        Err(error) => return Outcome::Failed(format!("{error:#}")),
    };
    if let Err(error) = cleanup {
        return Outcome::Failed(format!("delete the benchmark keys: {error:#}"));
    }
    figures["durability"] = json!(format!(
        "CONFIG SET appendonly yes, appendfsync always for the run (was appendonly {}, \
         appendfsync {}; {})",
        previous.appendonly,
        previous.appendfsync,
        if restored.is_ok() {
            "restored"
        } else {
            "NOT restored"
        }
    ));
    figures["round_trip"] = json!(
        "XADD turn (ack = reply after AOF fsync) → agent XREADGROUP → XADD answer to the \
         user's reply stream → XACK; user XREAD BLOCK on its reply stream"
    );
    Outcome::Measured(figures)
}

/// A connection whose replies may take `response_timeout` (a blocking read needs BLOCK + margin).
async fn connect(
    client: &Client,
    response_timeout: Duration,
) -> anyhow::Result<MultiplexedConnection> {
    let config = AsyncConnectionConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(response_timeout));
    let mut connection = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    redis::cmd("PING")
        .query_async::<String>(&mut connection)
        .await?;
    Ok(connection)
}

async fn blocking_connection(client: &Client) -> anyhow::Result<MultiplexedConnection> {
    // A blocking read holds its connection until it returns, so each reader has its own.
    connect(client, BLOCK + CONNECT_TIMEOUT).await
}

struct PreviousConfig {
    appendonly: String,
    appendfsync: String,
}

async fn config_get(connection: &mut MultiplexedConnection, name: &str) -> anyhow::Result<String> {
    let pair: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg(name)
        .query_async(connection)
        .await?;
    pair.get(1)
        .cloned()
        .with_context(|| format!("CONFIG GET {name} answered {pair:?}"))
}

async fn config_set(
    connection: &mut MultiplexedConnection,
    name: &str,
    value: &str,
) -> anyhow::Result<()> {
    redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query_async::<()>(connection)
        .await
        .with_context(|| format!("CONFIG SET {name} {value}"))
}

async fn read_config(connection: &mut MultiplexedConnection) -> anyhow::Result<PreviousConfig> {
    Ok(PreviousConfig {
        appendonly: config_get(connection, "appendonly").await?,
        appendfsync: config_get(connection, "appendfsync").await?,
    })
}

async fn make_durable(connection: &mut MultiplexedConnection) -> anyhow::Result<()> {
    config_set(connection, "appendfsync", "always").await?;
    config_set(connection, "appendonly", "yes").await?;
    // Switching the AOF on starts a rewrite; measuring during it would measure the rewrite.
    let started = Instant::now();
    loop {
        let info: String = redis::cmd("INFO")
            .arg("persistence")
            .query_async(connection)
            .await?;
        let busy = info.lines().any(|line| {
            line.trim() == "aof_rewrite_in_progress:1" || line.trim() == "aof_rewrite_scheduled:1"
        });
        if !busy {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("the AOF rewrite did not finish in 60 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn restore(
    connection: &mut MultiplexedConnection,
    previous: &PreviousConfig,
) -> anyhow::Result<()> {
    config_set(connection, "appendonly", &previous.appendonly).await?;
    config_set(connection, "appendfsync", &previous.appendfsync).await
}

async fn delete_keys(
    connection: &mut MultiplexedConnection,
    keys: &Keys,
    users: usize,
) -> anyhow::Result<()> {
    let mut names = vec![keys.turns.clone()];
    names.extend((0..users).map(|user| keys.replies(user)));
    // In slices, so that one DEL never carries thousands of keys.
    for chunk in names.chunks(256) {
        connection.del::<_, ()>(chunk).await?;
    }
    Ok(())
}

async fn run_loop(
    client: &Client,
    control: &mut MultiplexedConnection,
    keys: &Keys,
    settings: LoopSettings,
) -> anyhow::Result<serde_json::Value> {
    // A leftover stream of an earlier run with the same pid would carry stale turns.
    control.del::<_, ()>(&keys.turns).await?;
    control
        .xgroup_create_mkstream::<_, _, _, ()>(&keys.turns, GROUP, "$")
        .await?;
    let clock = Clock::start();
    let claimed = Arc::new(AtomicU64::new(0));
    let mut agents = JoinSet::new();
    for agent in 0..settings.agents {
        let connection = blocking_connection(client).await?;
        let turns = keys.turns.clone();
        let prefix = keys.prefix.clone();
        let claimed = Arc::clone(&claimed);
        agents.spawn(agent_loop(connection, agent, turns, prefix, clock, claimed));
    }
    let mut connections = Vec::with_capacity(settings.users);
    for _ in 0..settings.users {
        connections.push(blocking_connection(client).await?);
    }
    let usage_before = Usage::take(None).await;
    let started = Instant::now();
    let deadline = started + settings.duration;
    let mut users = JoinSet::new();
    for (user, connection) in connections.into_iter().enumerate() {
        let turns = keys.turns.clone();
        let replies = keys.replies(user);
        users.spawn(user_loop(connection, user, turns, replies, deadline, clock));
    }
    let samples = finish(users, agents).await?;
    let elapsed = started.elapsed().as_secs_f64();
    let usage_after = Usage::take(None).await;
    let turns = samples.round_trip.len() as f64;
    let mut figures = samples.figures(elapsed);
    figures["usage_per_turn"] = usage_before.per_turn(&usage_after, turns);
    figures["agents"] = json!(settings.agents);
    figures["users"] = json!(settings.users);
    figures["taken_over"] = json!(claimed.load(Ordering::Relaxed));
    figures["claim_min_idle_ms"] = json!(CLAIM_MIN_IDLE.as_millis() as u64);
    Ok(figures)
}

async fn user_loop(
    mut connection: MultiplexedConnection,
    user: usize,
    turns: String,
    replies: String,
    deadline: Instant,
    clock: Clock,
) -> anyhow::Result<Samples> {
    let mut samples = Samples::default();
    let read = StreamReadOptions::default()
        .block(BLOCK.as_millis() as usize)
        .count(16);
    let mut last_reply = "0-0".to_owned();
    let mut n = 0u64;
    while Instant::now() < deadline {
        n += 1;
        let sent_us = clock.now_us();
        let fields = [
            ("user", user.to_string()),
            ("n", n.to_string()),
            ("sent_us", sent_us.to_string()),
        ];
        let _: String = connection.xadd(&turns, "*", &fields).await?;
        samples.ack.push(millis_between(sent_us, clock.now_us()));
        let waiting_since = Instant::now();
        let arrived_us = 'answer: loop {
            if waiting_since.elapsed() > ANSWER_TIMEOUT {
                bail!("user {user}: no answer to turn {n} in {ANSWER_TIMEOUT:?}");
            }
            let reply: Option<StreamReadReply> = connection
                .xread_options(&[&replies], &[&last_reply], &read)
                .await?;
            let entries = reply.into_iter().flat_map(|reply| reply.keys);
            for entry in entries.flat_map(|key| key.ids) {
                last_reply.clone_from(&entry.id);
                if entry.get::<u64>("n") == Some(n) {
                    break 'answer entry.get::<u64>("arrived_us").unwrap_or(sent_us);
                }
            }
        };
        samples
            .round_trip
            .push(millis_between(sent_us, clock.now_us()));
        samples.to_agent.push(millis_between(sent_us, arrived_us));
    }
    Ok(samples)
}

async fn agent_loop(
    mut connection: MultiplexedConnection,
    agent: usize,
    turns: String,
    prefix: String,
    clock: Clock,
    claimed: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let consumer = format!("agent-{agent}");
    let read = StreamReadOptions::default()
        .group(GROUP, &consumer)
        .block(BLOCK.as_millis() as usize)
        .count(AGENT_BATCH);
    let mut last_claim = Instant::now();
    loop {
        if last_claim.elapsed() >= CLAIM_EVERY {
            last_claim = Instant::now();
            // Turns another agent read but never acknowledged (it died): answer them here.
            let reply: StreamAutoClaimReply = connection
                .xautoclaim_options(
                    &turns,
                    GROUP,
                    &consumer,
                    CLAIM_MIN_IDLE.as_millis() as u64,
                    "0-0",
                    StreamAutoClaimOptions::default().count(AGENT_BATCH),
                )
                .await?;
            claimed.fetch_add(reply.claimed.len() as u64, Ordering::Relaxed);
            answer(
                &mut connection,
                &turns,
                &prefix,
                &reply.claimed,
                clock.now_us(),
            )
            .await?;
        }
        let reply: Option<StreamReadReply> =
            connection.xread_options(&[&turns], &[">"], &read).await?;
        let arrived_us = clock.now_us();
        let entries: Vec<StreamId> = reply
            .into_iter()
            .flat_map(|reply| reply.keys)
            .flat_map(|key| key.ids)
            .collect();
        answer(&mut connection, &turns, &prefix, &entries, arrived_us).await?;
    }
}

/// Publishes the answers to the users' reply streams, then acknowledges the turns, in one
/// pipeline: Redis applies and logs commands in order, so an XACK is never in the AOF without
/// the answer before it, and the reply comes after the fsync of both.
async fn answer(
    connection: &mut MultiplexedConnection,
    turns: &str,
    prefix: &str,
    entries: &[StreamId],
    arrived_us: u64,
) -> anyhow::Result<()> {
    if entries.is_empty() {
        return Ok(());
    }
    let mut pipeline = redis::pipe();
    for entry in entries {
        let user: u64 = entry.get("user").context("turn without user")?;
        let n: u64 = entry.get("n").context("turn without n")?;
        let fields = [("n", n.to_string()), ("arrived_us", arrived_us.to_string())];
        pipeline
            .xadd(format!("{prefix}:replies:{user}"), "*", &fields)
            .ignore();
    }
    let ids: Vec<&str> = entries.iter().map(|entry| entry.id.as_str()).collect();
    pipeline.xack(turns, GROUP, &ids).ignore();
    pipeline.query_async::<()>(connection).await?;
    Ok(())
}
