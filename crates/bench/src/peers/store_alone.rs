//! converger's store alone: the same closed loop without gateway, WebSocket or agents. Each user
//! commits its turn through `Store::commit_activity` and then the answer through
//! `Store::commit_answer`, so both go through the real group commit and SQL functions. Nothing
//! else runs on the machine, so this is the rate converger's storage design reaches on this
//! server: the figure to set the pgbench ceiling against.

use std::time::{Duration, Instant};

use anyhow::Context;
use converger_store::{
    AnswerFrame, AnswerOutcome, NewActivity, Sender, SenderRole, Store, StoreOptions, TurnAnswer,
};
use serde_json::{Map, json};
use tokio::task::JoinSet;
use uuid::Uuid;

use super::{Interrupt, LoopSettings, Outcome, Samples};
use crate::gateway::{create_database, database_url, drop_database};
use crate::usage::Usage;

/// Pooled connections, as `turns` gives the gateway.
const MAX_CONNECTIONS: u32 = 32;
/// Server-side limit of one statement (and the client's deadline, plus a second).
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs the loop on a fresh database of `server_url`; skipped when the server does not answer.
pub async fn measure(
    server_url: &str,
    settings: LoopSettings,
    mut interrupt: Interrupt,
) -> Outcome {
    let database = match create_database(server_url).await {
        Ok(database) => database,
        Err(error) => return Outcome::Skipped(format!("no Postgres at {server_url}: {error:#}")),
    };
    let url = database_url(server_url, &database);
    let outcome = tokio::select! {
        outcome = run(&url, settings) => outcome,
        () = interrupt.pressed() => Err(anyhow::anyhow!("interrupted")),
    };
    let dropped = drop_database(server_url, &database).await;
    match (outcome, dropped) {
        (Ok(figures), Ok(())) => Outcome::Measured(figures),
        (Err(error), Ok(())) => Outcome::Failed(format!("{error:#}")),
        (Ok(_), Err(error)) => Outcome::Failed(format!("drop database {database}: {error:#}")),
        (Err(error), Err(drop_error)) => Outcome::Failed(format!(
            "{error:#}; then drop database {database}: {drop_error:#}"
        )),
    }
}

async fn run(url: &str, settings: LoopSettings) -> anyhow::Result<serde_json::Value> {
    let store = Store::connect(&StoreOptions {
        url: url.to_owned(),
        max_connections: MAX_CONNECTIONS,
        acquire_timeout: STATEMENT_TIMEOUT,
        statement_timeout: STATEMENT_TIMEOUT,
        // As the gateway would be configured by the same environment.
        commit_workers: std::env::var("CONVERGER_DATABASE__COMMIT_WORKERS")
            .ok()
            .and_then(|workers| workers.parse().ok())
            .unwrap_or(2),
        notify_in_commit: true,
    })
    .await?;
    store.migrate().await?;
    let (tenant, _) = store.create_tenant("bench").await?;
    let (channel, _) = store
        .create_channel(
            tenant.id,
            "store",
            &converger_store::TurnSettings::default(),
        )
        .await?;
    let mut conversations = Vec::new();
    for user in 0..settings.users {
        let conversation = store
            .create_conversation(channel.id, &format!("user-{user}"))
            .await?;
        conversations.push(conversation.id);
    }
    let usage_before = Usage::take(Some(url)).await;
    let started = Instant::now();
    let deadline = started + settings.duration;
    let mut users = JoinSet::new();
    for conversation_id in conversations {
        users.spawn(user_loop(store.clone(), conversation_id, deadline));
    }
    let mut samples = Samples::default();
    while let Some(user) = users.join_next().await {
        samples.extend(user.context("user task")??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let usage_after = Usage::take(Some(url)).await;
    let turns = samples.round_trip.len() as f64;
    let mut figures = samples.figures(elapsed);
    figures["usage_per_turn"] = usage_before.per_turn(&usage_after, turns);
    // Nothing is delivered to an agent here, so there is no such latency to report.
    if let Some(figures) = figures.as_object_mut() {
        figures.remove("to_agent_ms");
    }
    figures["durability"] = json!(
        "every turn and every answer committed by the store's group commit, with the server's \
         synchronous_commit, as in the gateway"
    );
    Ok(figures)
}

/// One user: its turn, then the answer to it, until the deadline. `ack` is the turn's commit,
/// `round_trip` both commits.
async fn user_loop(
    store: Store,
    conversation_id: Uuid,
    deadline: Instant,
) -> anyhow::Result<Samples> {
    let mut samples = Samples::default();
    let mut n = 0u64;
    while Instant::now() < deadline {
        n += 1;
        let sent = Instant::now();
        let turn = NewActivity {
            conversation_id,
            id: None,
            kind: "text".to_owned(),
            sender: Sender {
                id: "user".to_owned(),
                role: SenderRole::User,
            },
            data: json!({"text": "hello"}),
            metadata: None,
            extra: None,
            client_id: Some(format!("t-{n}")),
        };
        let committed = store.commit_activity(&turn).await?;
        samples.ack.push(sent.elapsed().as_secs_f64() * 1000.0);
        let answer = TurnAnswer {
            conversation_id,
            seq: committed.activity.seq,
            revision: 0,
            sender: Sender {
                id: "agent".to_owned(),
                role: SenderRole::Agent,
            },
            frames: vec![AnswerFrame {
                id: None,
                kind: "text".to_owned(),
                data: json!({"text": "an answer"}),
                metadata: None,
                extra: Map::new(),
            }],
            runtime: None,
            fence: None,
        };
        let outcome = store.commit_answer(&answer).await?;
        anyhow::ensure!(
            matches!(outcome, AnswerOutcome::Committed { .. }),
            "answer not committed: {outcome:?}"
        );
        samples
            .round_trip
            .push(sent.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(samples)
}
