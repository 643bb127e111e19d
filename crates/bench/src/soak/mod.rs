//! `soak --nodes 3 --users N --agents M --duration S --fault-every-ms X --seed K`: N end users
//! and M lease-mode agents of one group over three `converger serve` processes (one fresh
//! database, real gossip, every client connection through a per-node proxy) for S seconds, with
//! a random fault every X ms on average: kill an agent, `kill -9` a node and restart it, terminate
//! database backends, cut client sockets without a close frame; with `--failover-every-secs`,
//! also a Postgres failover (kill -9 of the primary, promotion of the synchronous standby) that
//! often. Then the faults stop, the run
//! settles (every committed turn answered, every user caught up with its conversation), and the
//! history checker gives its verdict. Exits non-zero on a breach, so CI fails on it.

mod faults;
mod load;
mod metrics;
mod nats;
mod nodes;
mod proxy;
mod report;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use converger_checker::effects::{EffectFigures, Effects};
use converger_checker::history::Verdict;
use converger_client::{RestClient, TokenRequest};
use converger_core::policies::TurnPolicy;
use converger_embedded::{PairMember, ReplicatedPair};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Value, json};
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tokio::sync::watch;
use tokio::time::Instant;
use uuid::Uuid;

use self::faults::{FailoverPlan, FaultPlan};
use self::load::{Agents, Counters, Load, LoadSettings, Phase};
use self::nats::NatsCluster;
use self::nodes::{Cluster, NodeSettings};
use self::report::{Printed, print_report};
use crate::gateway::{ADMIN_TOKEN, DEFAULT_DATABASE_URL, create_database, default_binary};

/// Longest a checker query may take.
const DB_TIMEOUT: Duration = Duration::from_secs(10);
/// The agents' group.
const GROUP: &str = "soak";

/// Arguments of `soak`.
#[derive(Debug, clap::Args)]
pub struct SoakArgs {
    /// Gateway nodes (processes over one database).
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// End users, each in its own conversation, in closed loop.
    #[arg(long, default_value_t = 8)]
    users: usize,
    /// Agents in one group, in lease mode.
    #[arg(long, default_value_t = 3)]
    agents: usize,
    /// Seconds of load with faults (the settle phase comes after).
    #[arg(long, default_value_t = 60)]
    duration: u64,
    /// Mean pause between faults, in ms (each pause is drawn between half and 1.5 times this).
    #[arg(long, default_value_t = 3000)]
    fault_every_ms: u64,
    /// Seed of the fault sequence and the think times (default: drawn, and printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Longest time a killed node stays down, in ms (at least half of it).
    #[arg(long, default_value_t = 2000)]
    node_down_ms: u64,
    /// The nodes' `lease_ms`: how long a dead node's claims hold its turns.
    #[arg(long, default_value_t = 3000)]
    lease_ms: u64,
    /// Mean pause between an answer and the user's next turn, in ms.
    #[arg(long, default_value_t = 100)]
    think_ms: u64,
    /// Share of turns a user stops right after their ack.
    #[arg(long, default_value_t = 0.1)]
    stop_share: f64,
    /// Share of turns a user follows at once with a second one (a double text) under a random
    /// turn policy: enqueue, reject, interrupt or rollback.
    #[arg(long, default_value_t = 0.1)]
    double_share: f64,
    /// Longest wait, in seconds, for the run to settle after the faults stop.
    #[arg(long, default_value_t = 60)]
    settle_timeout: u64,
    /// Folder for the node logs (default: a new folder under the temp dir).
    #[arg(long)]
    logs_dir: Option<PathBuf>,
    /// Keep the database and the node logs of a green run too (a breach always keeps them).
    #[arg(long)]
    keep: bool,
    /// Postgres server to create the soak database on (unused with `--failover-every-secs`).
    #[arg(long, default_value = DEFAULT_DATABASE_URL)]
    database_url: String,
    /// Seconds between Postgres failovers: the soak then runs on its own primary and
    /// synchronous standby (started from the machine's server binaries), kills the primary
    /// with SIGKILL, promotes the standby and rebuilds the old primary as the new standby.
    /// 0: no failovers, one Postgres (`--database-url`).
    #[arg(long, default_value_t = 0)]
    failover_every_secs: u64,
    /// From the primary's death to the standby's promotion, in ms (failure detection).
    #[arg(long, default_value_t = 1000)]
    promote_after_ms: u64,
    /// The `converger` binary (default: next to this one).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// The nodes' cluster bus: `postgres`, or `nats` (a cluster of `--nats-servers` real
    /// `nats-server` processes, each behind a proxy, and two more fault kinds: a NATS server
    /// killed and restarted, the nodes' connections to one cut).
    #[arg(long, default_value = "postgres")]
    bus: String,
    /// NATS servers in the soak's NATS cluster (`--bus nats`).
    #[arg(long, default_value_t = 3)]
    nats_servers: usize,
}

/// Runs the soak, prints a table and one JSON line, and fails on a breach.
pub async fn run(args: SoakArgs) -> anyhow::Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SOAK_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=error")),
        )
        .try_init();
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    if args.nodes == 0 || args.agents == 0 || args.users == 0 {
        bail!("--nodes, --agents and --users must be at least 1");
    }
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|elapsed| elapsed.as_nanos() as u64)
            .unwrap_or_default()
    });
    let binary = args.binary.clone().unwrap_or_else(default_binary);
    let mut pair = if args.failover_every_secs > 0 {
        let dir = std::env::temp_dir().join(format!("converger-soak-pair-{seed}"));
        Some(
            ReplicatedPair::start(&dir)
                .await
                .context("starting a primary and a standby")?,
        )
    } else {
        None
    };
    let server_url = match &pair {
        Some(pair) => pair.member_url(PairMember::Primary, "postgres"),
        None => args.database_url.clone(),
    };
    let database = create_database(&server_url).await?;
    let logs_dir = args
        .logs_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("converger-soak-{database}")));
    std::fs::create_dir_all(&logs_dir).with_context(|| format!("create {}", logs_dir.display()))?;
    tracing::info!(seed, database = %database, logs = %logs_dir.display(), "soak starting");
    let token_ttl_secs = (args.duration + 3600).min(2_592_000);
    let mut env = vec![
        ("CONVERGER_LEASE_MS", args.lease_ms.to_string()),
        // Shorter than the agents' slow answers: some stopped turns are settled by the gateway.
        ("CONVERGER_TURNS__STOP_GRACE_MS", "250".to_owned()),
        // Users read a frame at least this often, so they notice when to stop waiting.
        ("CONVERGER_LIMITS__HEARTBEAT_INTERVAL_MS", "2000".to_owned()),
        // Each answer is streamed in three chunks before its result: an agent that takes over
        // a dead one's users sends more frames than the default 50 a second.
        ("CONVERGER_LIMITS__MAX_FRAMES_PER_SEC", "1000".to_owned()),
        ("CONVERGER_TOKEN_TTL_SECS", token_ttl_secs.to_string()),
    ];
    if let Some(pair) = &pair {
        // Both hosts: the nodes follow the promotions by themselves.
        env.push(("CONVERGER_DATABASE_URL", pair.url_for(&database)));
    }
    let mut nats = match args.bus.as_str() {
        "postgres" => None,
        "nats" => {
            let servers = NatsCluster::start(args.nats_servers.max(1), &logs_dir).await?;
            env.push(("CONVERGER_BUS", "nats".to_owned()));
            env.push(("CONVERGER_NATS__SERVERS", servers.urls()));
            Some(servers)
        }
        other => bail!("--bus {other}: postgres or nats"),
    };
    let settings = NodeSettings {
        binary,
        server_url: server_url.clone(),
        database: database.clone(),
        env,
        logs_dir: logs_dir.clone(),
    };
    let mut cluster = match Cluster::start(settings, args.nodes).await {
        Ok(cluster) => cluster,
        Err(error) => {
            let _ = crate::gateway::drop_database(&server_url, &database).await;
            return Err(error.context("starting the nodes"));
        }
    };
    let outcome = soak(&args, seed, &mut cluster, pair.as_mut(), nats.as_mut()).await;
    let keep = args.keep || !matches!(&outcome, Ok(report) if report.breaches.is_empty());
    let logs = cluster.logs_dir().to_owned();
    let database_url = cluster.database_url();
    cluster.shutdown(keep).await?;
    if let Some(pair) = pair
        && !keep
    {
        pair.stop().await?;
    }
    let kept = || {
        print_node_warnings(&logs);
        eprintln!(
            "kept for investigation: database {database_url}, node logs in {}",
            logs.display()
        );
    };
    let report = match outcome {
        Ok(report) => report,
        Err(error) => {
            kept();
            return Err(error);
        }
    };
    if report.breaches.is_empty() {
        // A folder the caller named is theirs to remove.
        if !keep && args.logs_dir.is_none() {
            let _ = std::fs::remove_dir_all(&logs);
        }
        return Ok(());
    }
    kept();
    bail!("the checker found breaches: {}", report.breaches.join(", "))
}

/// Prints the last warnings and errors of each node log to stderr: of a CI run, only its output
/// is read.
fn print_node_warnings(logs: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(logs) else {
        return;
    };
    let mut files: Vec<PathBuf> = entries.flatten().map(|entry| entry.path()).collect();
    files.sort();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let warnings: Vec<&str> = text
            .lines()
            .filter(|line| {
                line.contains("\"level\":\"WARN\"") || line.contains("\"level\":\"ERROR\"")
            })
            .collect();
        eprintln!(
            "{}: {} warnings and errors, the last ones:",
            file.display(),
            warnings.len()
        );
        for line in &warnings[warnings.len().saturating_sub(20)..] {
            eprintln!("  {line}");
        }
    }
}

/// What `soak` found, for the exit code.
struct Report {
    breaches: Vec<String>,
}

async fn soak(
    args: &SoakArgs,
    seed: u64,
    cluster: &mut Cluster,
    pair: Option<&mut ReplicatedPair>,
    nats: Option<&mut NatsCluster>,
) -> anyhow::Result<Report> {
    let effects = Effects::start().await?;
    let rest = RestClient::new(cluster.base_url(0))?;
    let (channel, agent_token) = soak_channel(&rest, &cluster.base_url(0)).await?;
    let (phase_tx, phase) = watch::channel(Phase::Running);
    let load = Arc::new(Load::new(
        LoadSettings {
            ws_urls: (0..cluster.len())
                .map(|index| cluster.ws_url(index))
                .collect(),
            agent_token,
            group: GROUP.to_owned(),
            effects_url: effects.url.clone(),
            seed,
            think_ms: args.think_ms,
            stop_share: args.stop_share,
            double_share: args.double_share,
        },
        phase,
    )?);
    let mut agents = Agents::start(Arc::clone(&load), args.agents);
    cluster
        .wait_for_members(args.agents, Duration::from_secs(30))
        .await?;
    let mut users = Vec::new();
    for index in 0..args.users {
        let token = rest
            .generate_token(
                &channel.secret,
                &TokenRequest::for_user(&format!("user-{index}")),
            )
            .await?
            .token;
        let created = rest.create_conversation(&token).await?;
        users.push(tokio::spawn(load::user(
            Arc::clone(&load),
            index,
            created.conversation_id,
            created.token,
        )));
    }

    let started = Instant::now();
    let progress = tokio::spawn(report_progress(Arc::clone(&load)));
    let plan = FaultPlan {
        every: Duration::from_millis(args.fault_every_ms),
        node_down: Duration::from_millis(args.node_down_ms),
        failover: (args.failover_every_secs > 0).then(|| FailoverPlan {
            every: Duration::from_secs(args.failover_every_secs),
            promote_after: Duration::from_millis(args.promote_after_ms),
        }),
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let until = started + Duration::from_secs(args.duration);
    let injected = faults::inject(
        cluster,
        &mut agents,
        (pair, nats),
        &load,
        &plan,
        &mut rng,
        until,
    )
    .await;
    progress.abort();
    let faults = match injected {
        Ok(faults) => faults,
        Err(error) => {
            agents.stop();
            let _ = phase_tx.send(Phase::Stopped);
            return Err(error.context("injecting faults"));
        }
    };
    tokio::time::sleep_until(until).await;
    let loaded_secs = started.elapsed().as_secs_f64();

    // Settle: no new turns, every node sees the others, every committed turn answered and
    // every user caught up with its conversation, or the timeout.
    let _ = phase_tx.send(Phase::Draining);
    let settling = Instant::now();
    cluster.wait_for_live_nodes(Duration::from_secs(60)).await?;
    let settled = settle(
        &cluster.database_url(),
        &load,
        Duration::from_secs(args.settle_timeout),
    )
    .await?;
    let settle_secs = settling.elapsed().as_secs_f64();
    let _ = phase_tx.send(Phase::Stopped);
    for user in users {
        if tokio::time::timeout(Duration::from_secs(10), user)
            .await
            .is_err()
        {
            tracing::warn!("a user did not stop in time");
        }
    }
    agents.stop();

    let totals = cluster.metrics().await?;
    let database = DatabaseFigures::read(&cluster.database_url(), &load).await?;
    let verdict = load.history.verdict(&database.stored);
    let effect_figures = effects.figures();
    let breaches = breaches(&verdict, &effect_figures, &database, &settled);
    print_report(&Printed {
        args,
        seed,
        loaded_secs,
        settle_secs,
        faults: &faults,
        load: &load,
        verdict: &verdict,
        effects: &effect_figures,
        database: &database,
        settled: &settled,
        totals: &totals,
        breaches: &breaches,
    });
    Ok(Report { breaches })
}

/// The soak's channel, on which a send may ask for any turn policy (the double texts do), and
/// its agents' token.
async fn soak_channel(
    rest: &RestClient,
    base_url: &str,
) -> anyhow::Result<(converger_client::CreatedChannel, String)> {
    let tenant = rest.create_tenant(ADMIN_TOKEN, "bench").await?;
    let channel = rest.create_channel(&tenant.api_key, "soak").await?;
    reqwest::Client::new()
        .patch(format!("{base_url}/api/v1/channels/{}", channel.id))
        .header("x-api-key", &tenant.api_key)
        .json(&json!({"turnPolicyOverrides": TurnPolicy::ALL.map(TurnPolicy::as_str)}))
        .timeout(Duration::from_secs(10))
        .send()
        .await?
        .error_for_status()?;
    let token = rest
        .generate_token(&channel.secret, &TokenRequest::channel_scope())
        .await?
        .token;
    Ok((channel, token))
}

/// Logs the load's progress every 10 s while the faults run.
async fn report_progress(load: Arc<Load>) {
    let started = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_secs(10)).await;
        let counters = &load.counters;
        tracing::info!(
            elapsed_secs = started.elapsed().as_secs(),
            sent = Counters::get(&counters.turns_sent),
            acked = Counters::get(&counters.turns_acked),
            answered = Counters::get(&counters.answers_received),
            reconnects = Counters::get(&counters.user_reconnects),
            "progress"
        );
    }
}

/// How the settle phase ended.
struct Settled {
    /// Every condition held before the timeout.
    complete: bool,
    /// Turns still pending when it ended.
    pending_turns: i64,
    /// Users whose client had not seen their conversation up to its head.
    users_behind: usize,
    /// Users still waiting for an answer.
    users_waiting: usize,
}

/// Waits until no turn is pending and every user has seen its conversation up to the head and
/// waits for nothing, or `timeout`.
async fn settle(url: &str, load: &Load, timeout: Duration) -> anyhow::Result<Settled> {
    let deadline = Instant::now() + timeout;
    loop {
        let (pending_turns, heads) = within("settle check", async {
            let mut connection = PgConnection::connect(url).await?;
            let pending: i64 =
                sqlx::query_scalar("SELECT count(*) FROM turns WHERE status = 'pending'")
                    .fetch_one(&mut connection)
                    .await?;
            let heads: Vec<(Uuid, i64)> = sqlx::query_as("SELECT id, last_seq FROM conversations")
                .fetch_all(&mut connection)
                .await?;
            let _ = connection.close().await;
            Ok((pending, heads.into_iter().collect::<BTreeMap<Uuid, i64>>()))
        })
        .await?;
        let statuses = load.user_statuses();
        let users_behind = statuses
            .iter()
            .filter(|user| user.watermark < heads.get(&user.conversation_id).copied().unwrap_or(0))
            .count();
        let users_waiting = statuses.iter().filter(|user| user.in_flight).count();
        let complete = pending_turns == 0 && users_behind == 0 && users_waiting == 0;
        if complete || Instant::now() > deadline {
            return Ok(Settled {
                complete,
                pending_turns,
                users_behind,
                users_waiting,
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// What the database says after the run.
struct DatabaseFigures {
    /// User frames as stored: clientId → (conversation, seq).
    stored: BTreeMap<String, (Uuid, i64)>,
    /// Turns completed (answered by an agent).
    completed_turns: i64,
    /// Turns stopped and settled by the gateway.
    stopped_turns: i64,
    /// Turns with more than one result (an agent's and a settlement, or two settlements).
    double_results: i64,
    /// Turns not completed.
    open_turns: Vec<Value>,
    /// Frames stored from agents (one per committed answer).
    agent_frames: i64,
    /// Acked turns that were never completed.
    unanswered_acked: usize,
}

impl DatabaseFigures {
    async fn read(url: &str, load: &Load) -> anyhow::Result<DatabaseFigures> {
        let (stored, completed, stopped, double_results, open, agent_frames) =
            within("checker queries", async {
            let mut connection = PgConnection::connect(url).await?;
            let stored: Vec<(String, Uuid, i64)> = sqlx::query_as(
                "SELECT client_id, conversation_id, seq FROM activities \
                 WHERE sender_role = 'user' AND client_id IS NOT NULL",
            )
            .fetch_all(&mut connection)
            .await?;
            let completed: Vec<(Uuid, i64)> =
                sqlx::query_as("SELECT conversation_id, seq FROM turns WHERE status = 'completed'")
                    .fetch_all(&mut connection)
                    .await?;
            let stopped: Vec<(Uuid, i64)> =
                sqlx::query_as("SELECT conversation_id, seq FROM turns WHERE status = 'stopped'")
                    .fetch_all(&mut connection)
                    .await?;
            // A turn answered twice: frames of two senders (an agent and the gateway's
            // settlement), or two settlements.
            let double_results: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM (
                     SELECT 1 FROM activities WHERE turn_seq IS NOT NULL
                     GROUP BY conversation_id, turn_seq, turn_revision
                     HAVING count(DISTINCT sender_role) > 1
                         OR count(*) FILTER (WHERE sender_role = 'system') > 1) AS doubled",
            )
            .fetch_one(&mut connection)
            .await?;
            let open: Vec<(Uuid, i64, i32, String, i64, Option<String>)> = sqlx::query_as(
                "SELECT conversation_id, seq, revision, status, fence, claimed_by FROM turns \
                 WHERE status NOT IN ('completed', 'stopped') ORDER BY conversation_id, seq LIMIT 20",
            )
            .fetch_all(&mut connection)
            .await?;
            let agent_frames: i64 =
                sqlx::query_scalar("SELECT count(*) FROM activities WHERE sender_role = 'agent'")
                    .fetch_one(&mut connection)
                    .await?;
            let _ = connection.close().await;
            Ok((stored, completed, stopped, double_results, open, agent_frames))
        })
        .await?;
        let stored: BTreeMap<String, (Uuid, i64)> = stored
            .into_iter()
            .map(|(client_id, conversation, seq)| (client_id, (conversation, seq)))
            .collect();
        let completed: BTreeSet<(Uuid, i64)> = completed.into_iter().collect();
        let stopped: BTreeSet<(Uuid, i64)> = stopped.into_iter().collect();
        let unanswered_acked = load
            .history
            .acked_sends()
            .values()
            .filter(|turn| !completed.contains(turn) && !stopped.contains(turn))
            .count();
        let open_turns = open
            .into_iter()
            .map(|(conversation, seq, revision, status, fence, holder)| {
                json!({"conversation": conversation, "seq": seq, "revision": revision,
                    "status": status, "fence": fence, "claimed_by": holder})
            })
            .collect();
        Ok(DatabaseFigures {
            stored,
            completed_turns: completed.len() as i64,
            stopped_turns: stopped.len() as i64,
            double_results,
            open_turns,
            agent_frames,
            unanswered_acked,
        })
    }
}

/// Runs a database step within [`DB_TIMEOUT`].
async fn within<T>(
    what: &str,
    step: impl std::future::Future<Output = Result<T, sqlx::Error>>,
) -> anyhow::Result<T> {
    tokio::time::timeout(DB_TIMEOUT, step)
        .await
        .with_context(|| format!("{what} timed out"))?
        .with_context(|| format!("{what} failed"))
}

/// The promises the run broke, by name.
fn breaches(
    verdict: &Verdict,
    effects: &EffectFigures,
    database: &DatabaseFigures,
    settled: &Settled,
) -> Vec<String> {
    let mut breaches = Vec::new();
    let mut breach = |holds: bool, name: &str| {
        if !holds {
            breaches.push(name.to_owned());
        }
    };
    breach(verdict.lost.is_empty(), "lost");
    breach(verdict.duplicate_results.is_empty(), "duplicate_results");
    breach(verdict.gaps == 0, "gaps");
    breach(verdict.inversions == 0, "inversions");
    breach(verdict.doubles == 0, "doubles");
    breach(verdict.stream_breaches.is_empty(), "streams");
    breach(effects.holds(), "effects_per_turn");
    breach(
        database.unanswered_acked == 0 && settled.pending_turns == 0,
        "unanswered",
    );
    breach(settled.users_behind == 0, "not_delivered");
    // One stored answer frame per completed turn: a second commit for a turn would show here.
    breach(
        database.agent_frames == database.completed_turns,
        "stored_answers",
    );
    // Every answered turn had its effect; a stopped one may have been settled before its
    // agent got to it.
    breach(
        !settled.complete
            || (database.completed_turns..=database.completed_turns + database.stopped_turns)
                .contains(&(effects.effects as i64)),
        "effects_vs_answers",
    );
    breach(database.double_results == 0, "one_result_per_turn");
    breaches
}
