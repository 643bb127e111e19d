//! The round trip over NATS JetStream: users publish turns to a work-queue stream (file storage)
//! and wait for the publish ack; agents share one durable pull consumer on it, publish the answer
//! to an answers stream (file storage, one subject per user), wait for that publish ack, then
//! acknowledge the turn (a double ack, confirmed by the server). Each user reads its answers with
//! an ordered pull consumer filtered to its subject, so it only sees answers the stream stored.
//!
//! Takeover is JetStream's own: a turn not acknowledged within `ack_wait` is redelivered to
//! another pull request of the group.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, anyhow, bail};
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::stream::{self, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, Context};
use async_nats::{Client, ConnectOptions};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::task::JoinSet;

use super::{
    ANSWER_TIMEOUT, CONNECT_TIMEOUT, Clock, Interrupt, LoopSettings, Outcome, Samples, finish,
    millis_between,
};
use crate::usage::Usage;

/// A turn not acknowledged for this long is redelivered (to any agent of the group).
const ACK_WAIT: Duration = Duration::from_secs(5);
/// Most turns an agent asks for per pull request and answers together; small enough that turns
/// still spread over the agents.
const AGENT_BATCH: usize = 16;
/// Timeout of each publish ack and of each JetStream API request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
const CONSUMER: &str = "agents";

struct Names {
    turns_stream: String,
    answers_stream: String,
    turns_subject: String,
    answers_prefix: String,
}

impl Names {
    fn for_process() -> Names {
        let pid = std::process::id();
        Names {
            turns_stream: format!("CONVERGER_BENCH_{pid}_TURNS"),
            answers_stream: format!("CONVERGER_BENCH_{pid}_ANSWERS"),
            turns_subject: format!("converger-bench.{pid}.turns"),
            answers_prefix: format!("converger-bench.{pid}.answers"),
        }
    }

    fn answers(&self, user: usize) -> String {
        format!("{}.{user}", self.answers_prefix)
    }
}

/// Measures the loop against `url`; skipped when no server (or no JetStream) answers there.
pub async fn measure(url: &str, settings: LoopSettings, mut interrupt: Interrupt) -> Outcome {
    let client = match connect(url).await {
        Ok(client) => client,
        Err(error) => return Outcome::Skipped(format!("no NATS server at {url}: {error:#}")),
    };
    let server = client.server_info();
    if !server.jetstream {
        return Outcome::Skipped(format!(
            "the NATS server at {url} runs without JetStream (-js)"
        ));
    }
    let server_version = server.version;
    let context = context(client);
    let names = Names::for_process();
    let outcome = tokio::select! {
        outcome = run_loop(url, &context, &names, settings) => outcome,
        () = interrupt.pressed() => Err(anyhow!("interrupted")),
    };
    let cleanup = delete_streams(&context, &names).await;
    let mut figures = match outcome {
        Ok(figures) => figures,
        Err(error) => return Outcome::Failed(format!("{error:#}")),
    };
    if let Err(error) = cleanup {
        return Outcome::Failed(format!("delete the benchmark streams: {error:#}"));
    }
    figures["server_version"] = json!(server_version);
    figures["durability"] = json!(format!(
        "file storage, one replica; ack = JetStream publish ack. nats-server {server_version} \
         writes each message to its file before acking but fsyncs on its sync_interval \
         (default 2 min, server config only), not per message: weaker than Redis \
         appendfsync always and Postgres synchronous_commit"
    ));
    figures["round_trip"] = json!(
        "JetStream publish turn (ack) → work-queue stream → durable pull consumer shared by the \
         agents → JetStream publish answer on the user's subject (acked) → double ack of the \
         turn; user reads its subject with an ordered pull consumer on the answers stream"
    );
    Outcome::Measured(figures)
}

async fn connect(url: &str) -> anyhow::Result<Client> {
    let options = ConnectOptions::new()
        .connection_timeout(CONNECT_TIMEOUT)
        .request_timeout(Some(REQUEST_TIMEOUT));
    // The client's own connection timeout covers the TCP connect; this one covers the handshake.
    let client = tokio::time::timeout(CONNECT_TIMEOUT * 2, options.connect(url))
        .await
        .context("connect timed out")??;
    Ok(client)
}

fn context(client: Client) -> Context {
    let mut context = jetstream::new(client);
    context.set_timeout(REQUEST_TIMEOUT);
    context
}

async fn delete_streams(context: &Context, names: &Names) -> anyhow::Result<()> {
    for name in [&names.turns_stream, &names.answers_stream] {
        match tokio::time::timeout(REQUEST_TIMEOUT, context.delete_stream(name)).await {
            Ok(Ok(_)) => {}
            // Not created (the run failed early) is not a failure of the cleanup.
            Ok(Err(error)) if error.to_string().contains("not found") => {}
            Ok(Err(error)) => return Err(anyhow!("delete stream {name}: {error}")),
            Err(_) => bail!("delete stream {name}: timed out"),
        }
    }
    Ok(())
}

async fn run_loop(
    url: &str,
    context: &Context,
    names: &Names,
    settings: LoopSettings,
) -> anyhow::Result<Value> {
    // A leftover of an earlier run with the same pid would carry stale turns.
    delete_streams(context, names).await?;
    let turns = context
        .create_stream(stream::Config {
            name: names.turns_stream.clone(),
            subjects: vec![names.turns_subject.clone()],
            retention: RetentionPolicy::WorkQueue,
            storage: StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|error| anyhow!("create the turns stream: {error}"))?;
    context
        .create_stream(stream::Config {
            name: names.answers_stream.clone(),
            subjects: vec![format!("{}.*", names.answers_prefix)],
            storage: StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|error| anyhow!("create the answers stream: {error}"))?;
    turns
        .create_consumer(pull::Config {
            durable_name: Some(CONSUMER.to_owned()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: ACK_WAIT,
            // Every user may have a turn in flight; the server default (1,000) would cap U.
            max_ack_pending: i64::try_from(settings.users.max(1) * 2).unwrap_or(i64::MAX),
            ..Default::default()
        })
        .await
        .map_err(|error| anyhow!("create the agents' consumer: {error}"))?;

    let clock = Clock::start();
    let redelivered = Arc::new(AtomicU64::new(0));
    let mut agents = JoinSet::new();
    for _ in 0..settings.agents {
        // Each agent and each user is its own process in real life: its own connection.
        let agent_context = context_for(url).await?;
        let consumer: PullConsumer = agent_context
            .get_stream(&names.turns_stream)
            .await
            .map_err(|error| anyhow!("get the turns stream: {error}"))?
            .get_consumer(CONSUMER)
            .await
            .map_err(|error| anyhow!("get the agents' consumer: {error}"))?;
        let answers_prefix = names.answers_prefix.clone();
        let redelivered = Arc::clone(&redelivered);
        agents.spawn(agent_loop(
            agent_context,
            consumer,
            answers_prefix,
            clock,
            redelivered,
        ));
    }
    let mut user_setups = Vec::new();
    for user in 0..settings.users {
        let user_context = context_for(url).await?;
        let answers = user_context
            .get_stream(&names.answers_stream)
            .await
            .map_err(|error| anyhow!("get the answers stream: {error}"))?
            .create_consumer(pull::OrderedConfig {
                filter_subject: names.answers(user),
                deliver_policy: DeliverPolicy::All,
                ..Default::default()
            })
            .await
            .map_err(|error| anyhow!("create user {user}'s answers consumer: {error}"))?
            .messages()
            .await
            .map_err(|error| anyhow!("read user {user}'s answers: {error}"))?;
        user_setups.push((user_context, answers));
    }
    let usage_before = Usage::take(None).await;
    let started = Instant::now();
    let deadline = started + settings.duration;
    let mut users = JoinSet::new();
    for (user, (user_context, answers)) in user_setups.into_iter().enumerate() {
        let subject = names.turns_subject.clone();
        users.spawn(user_loop(
            user_context,
            answers,
            user,
            subject,
            deadline,
            clock,
        ));
    }
    let samples = finish(users, agents).await?;
    let elapsed = started.elapsed().as_secs_f64();
    let usage_after = Usage::take(None).await;
    let turns = samples.round_trip.len() as f64;
    let mut figures = samples.figures(elapsed);
    figures["usage_per_turn"] = usage_before.per_turn(&usage_after, turns);
    figures["agents"] = json!(settings.agents);
    figures["users"] = json!(settings.users);
    figures["taken_over"] = json!(redelivered.load(Ordering::Relaxed));
    figures["ack_wait_ms"] = json!(ACK_WAIT.as_millis() as u64);
    Ok(figures)
}

async fn context_for(url: &str) -> anyhow::Result<Context> {
    Ok(context(connect(url).await?))
}

/// Publishes to a stream and waits for the server's ack (the message is stored).
async fn publish_acked(context: &Context, subject: String, payload: Vec<u8>) -> anyhow::Result<()> {
    let stored = async {
        let ack = context.publish(subject, payload.into()).await?;
        ack.await?;
        Ok::<_, async_nats::Error>(())
    };
    tokio::time::timeout(REQUEST_TIMEOUT, stored)
        .await
        .context("publish ack timed out")?
        .map_err(|error| anyhow!("publish: {error}"))
}

async fn user_loop(
    context: Context,
    mut answers: pull::Ordered,
    user: usize,
    subject: String,
    deadline: Instant,
    clock: Clock,
) -> anyhow::Result<Samples> {
    let mut samples = Samples::default();
    let mut n = 0u64;
    while Instant::now() < deadline {
        n += 1;
        let sent_us = clock.now_us();
        let turn = json!({"user": user, "n": n, "sent_us": sent_us});
        publish_acked(&context, subject.clone(), turn.to_string().into_bytes()).await?;
        samples.ack.push(millis_between(sent_us, clock.now_us()));
        let waiting_since = Instant::now();
        let arrived_us = loop {
            let left = ANSWER_TIMEOUT.saturating_sub(waiting_since.elapsed());
            let next = tokio::time::timeout(left, answers.next()).await;
            let Ok(next) = next else {
                bail!("user {user}: no answer to turn {n} in {ANSWER_TIMEOUT:?}");
            };
            let message = next
                .context("the answers consumer ended")?
                .map_err(|error| anyhow!("user {user}: read answers: {error}"))?;
            let answer: Value = serde_json::from_slice(&message.payload)?;
            if answer["n"].as_u64() == Some(n) {
                break answer["arrived_us"].as_u64().unwrap_or(sent_us);
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
    context: Context,
    consumer: PullConsumer,
    answers_prefix: String,
    clock: Clock,
    redelivered: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let turns = consumer
        .stream()
        .max_messages_per_batch(AGENT_BATCH)
        .messages()
        .await
        .map_err(|error| anyhow!("pull turns: {error}"))?;
    // Like the agent of `turns`, answer every turn in hand at once rather than one per round
    // trip. A long-lived pull: the client's heartbeats end it with an error if the server goes.
    let mut in_hand = turns.ready_chunks(AGENT_BATCH);
    while let Some(messages) = in_hand.next().await {
        let arrived_us = clock.now_us();
        let messages = messages
            .into_iter()
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| anyhow!("pull turns: {error}"))?;
        let mut answers = Vec::with_capacity(messages.len());
        for message in &messages {
            if message.info().is_ok_and(|info| info.delivered > 1) {
                redelivered.fetch_add(1, Ordering::Relaxed);
            }
            let turn: Value = serde_json::from_slice(&message.payload)?;
            let user = turn["user"].as_u64().context("turn without user")?;
            let n = turn["n"].as_u64().context("turn without n")?;
            let answer = json!({"n": n, "arrived_us": arrived_us});
            answers.push(publish_acked(
                &context,
                format!("{answers_prefix}.{user}"),
                answer.to_string().into_bytes(),
            ));
        }
        // Every answer is stored before any of its turns is acknowledged.
        futures_util::future::try_join_all(answers).await?;
        let acks = messages.iter().map(|message| async move {
            tokio::time::timeout(REQUEST_TIMEOUT, message.double_ack())
                .await
                .context("turn ack timed out")?
                .map_err(|error| anyhow!("ack the turn: {error}"))
        });
        futures_util::future::try_join_all(acks).await?;
    }
    Ok(())
}
