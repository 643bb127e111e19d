//! converger's store alone: the same closed loop without gateway, WebSocket or agents. Each user
//! commits its turn through `Store::commit_activity` and then the answer through
//! `Store::commit_answer`, so both go through the real group commit and SQL functions. Nothing
//! else runs on the machine, so this is the rate converger's storage design reaches on this
//! server: the figure to set the pgbench ceiling against.
//!
//! The same loop also drives issue 35's prototyped write paths (`write_paths`), on a database
//! of their own, so their cost per turn sits beside the store's in one run.

use std::time::{Duration, Instant};

use anyhow::Context;
use converger_store::{
    AnswerFrame, AnswerOutcome, NewActivity, Sender, SenderRole, Store, StoreOptions, TurnAnswer,
};
use serde_json::{Map, json};
use sqlx::Connection;
use tokio::task::JoinSet;
use uuid::Uuid;

use super::write_paths::{Candidate, Writer};
use super::{Interrupt, LoopSettings, Outcome, Samples};
use crate::gateway::{create_database, database_url, drop_database};
use crate::usage::Usage;

/// Pooled connections, as `turns` gives the gateway.
const MAX_CONNECTIONS: u32 = 32;
/// Server-side limit of one statement (and the client's deadline, plus a second).
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);

/// What commits the loop's writes.
#[derive(Debug, Clone, Copy)]
pub enum WritePath {
    /// The store: its group commit (ADR 0037). Without `notify`, its
    /// connections set `converger.notify = off`, as under the NATS bus.
    Store { notify: bool },
    /// A prototype of issue 35 (no notification: its node would publish the commit itself).
    Prototype(Candidate),
}

/// Runs the loop on a fresh database of `server_url`; skipped when the server does not answer.
pub async fn measure(
    server_url: &str,
    settings: LoopSettings,
    path: WritePath,
    mut interrupt: Interrupt,
) -> Outcome {
    let database = match create_database(server_url).await {
        Ok(database) => database,
        Err(error) => return Outcome::Skipped(format!("no Postgres at {server_url}: {error:#}")),
    };
    let url = database_url(server_url, &database);
    let outcome = tokio::select! {
        outcome = run(&url, settings, path) => outcome,
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

async fn run(
    url: &str,
    settings: LoopSettings,
    path: WritePath,
) -> anyhow::Result<serde_json::Value> {
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
        notify_in_commit: matches!(path, WritePath::Store { notify: true }),
    })
    .await?;
    store.migrate().await?;
    let committer = match path {
        WritePath::Store { .. } => Committer::Store(store.clone()),
        WritePath::Prototype(candidate) => {
            super::write_paths::prepare_schema(url, candidate).await?;
            Committer::Prototype(Writer::start(url, candidate).await?)
        }
    };
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
        users.spawn(user_loop(committer.clone(), conversation_id, deadline));
    }
    let mut samples = Samples::default();
    while let Some(user) = users.join_next().await {
        samples.extend(user.context("user task")??);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let usage_after = Usage::take(Some(url)).await;
    let turns = samples.round_trip.len() as f64;
    verify(url, path, samples.round_trip.len())
        .await
        .context("the writes do not check out")?;
    let mut figures = samples.figures(elapsed);
    figures["usage_per_turn"] = usage_before.per_turn(&usage_after, turns);
    // Nothing is delivered to an agent here, so there is no such latency to report.
    if let Some(figures) = figures.as_object_mut() {
        figures.remove("to_agent_ms");
    }
    figures["durability"] = json!(match path {
        WritePath::Store { .. } => {
            "every turn and every answer committed by the store's group commit, with the \
             server's synchronous_commit, as in the gateway"
        }
        WritePath::Prototype(candidate) => candidate.durability(),
    });
    Ok(figures)
}

/// Checks what the run stored, so that no write path is measured doing less than the others:
/// every conversation's frames are exactly seqs 1 to its head, each of the `turns` turns has
/// one answer frame and is settled once, and the outbox counts every frame.
async fn verify(url: &str, path: WritePath, turns: usize) -> anyhow::Result<()> {
    let mut connection = sqlx::PgConnection::connect(url).await?;
    let (broken_heads, user_frames, answer_frames, frames, logged): (i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM conversations c
                      WHERE c.last_seq <> (SELECT count(*) FROM activities a
                                            WHERE a.conversation_id = c.id)
                         OR c.last_seq <> (SELECT coalesce(max(a.seq), 0) FROM activities a
                                            WHERE a.conversation_id = c.id)),
                    (SELECT count(*) FROM activities WHERE sender_id = 'user'),
                    (SELECT count(*) FROM activities WHERE sender_id = 'agent'),
                    (SELECT count(*) FROM activities),
                    (SELECT coalesce(sum(frames), 0)::bigint FROM outbox)",
        )
        .fetch_one(&mut connection)
        .await?;
    let settled: i64 = match path {
        WritePath::Prototype(candidate) if candidate.folded() => {
            sqlx::query_scalar(
                "SELECT count(DISTINCT (conversation_id, turn_seq)) FROM activities
                  WHERE answer_fingerprint IS NOT NULL",
            )
            .fetch_one(&mut connection)
            .await?
        }
        _ => {
            sqlx::query_scalar("SELECT count(*) FROM turns WHERE status = 'completed'")
                .fetch_one(&mut connection)
                .await?
        }
    };
    let turns = turns as i64;
    anyhow::ensure!(broken_heads == 0, "{broken_heads} conversations have gaps");
    anyhow::ensure!(
        user_frames == turns && answer_frames == turns && settled == turns,
        "{turns} turns answered, but {user_frames} turn frames, {answer_frames} answer frames \
         and {settled} turns settled stored"
    );
    anyhow::ensure!(
        logged == frames,
        "{frames} frames stored, {logged} in the outbox"
    );
    Ok(())
}

/// What a user's loop commits through.
#[derive(Clone)]
enum Committer {
    Store(Store),
    Prototype(Writer),
}

impl Committer {
    /// Commits the user's `n`th turn; returns its seq.
    async fn turn(&self, conversation_id: Uuid, n: u64) -> anyhow::Result<i64> {
        let client_id = format!("t-{n}");
        let store = match self {
            Committer::Store(store) => store,
            Committer::Prototype(writer) => return writer.turn(conversation_id, client_id).await,
        };
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
            client_id: Some(client_id),
        };
        Ok(store.commit_activity(&turn).await?.activity.seq)
    }

    /// Commits the agent's one-frame answer to the turn at `seq`.
    async fn answer(&self, conversation_id: Uuid, seq: i64) -> anyhow::Result<()> {
        let store = match self {
            Committer::Store(store) => store,
            Committer::Prototype(writer) => {
                writer.answer(conversation_id, seq).await?;
                return Ok(());
            }
        };
        let answer = TurnAnswer {
            conversation_id,
            seq,
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
        Ok(())
    }
}

/// One user: its turn, then the answer to it, until the deadline. `ack` is the turn's commit,
/// `round_trip` both commits.
async fn user_loop(
    committer: Committer,
    conversation_id: Uuid,
    deadline: Instant,
) -> anyhow::Result<Samples> {
    let mut samples = Samples::default();
    let mut n = 0u64;
    while Instant::now() < deadline {
        n += 1;
        let sent = Instant::now();
        let seq = committer.turn(conversation_id, n).await?;
        samples.ack.push(sent.elapsed().as_secs_f64() * 1000.0);
        committer.answer(conversation_id, seq).await?;
        samples
            .round_trip
            .push(sent.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peers::write_paths::Candidate;

    /// Every write path stores what the loop asked for (`verify` runs inside `measure`).
    #[tokio::test]
    async fn every_write_path_stores_the_loops_turns_gap_free_and_answered_once() {
        let server = crate::gateway::test_server_url().await;
        let settings = LoopSettings {
            users: 6,
            agents: 1,
            duration: Duration::from_millis(600),
        };
        for path in [
            WritePath::Store { notify: false },
            WritePath::Prototype(Candidate::Statements),
            WritePath::Prototype(Candidate::StatementsFolded),
            WritePath::Prototype(Candidate::Owner),
            WritePath::Prototype(Candidate::OwnerFolded),
        ] {
            match measure(&server, settings, path, Interrupt::never()).await {
                Outcome::Measured(figures) => {
                    assert!(
                        figures["turns"].as_u64().unwrap_or(0) > 0,
                        "{path:?}: {figures}"
                    )
                }
                Outcome::Skipped(reason) | Outcome::Failed(reason) => panic!("{path:?}: {reason}"),
            }
        }
    }
}
