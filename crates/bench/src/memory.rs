//! `memory --conversations N`: whether nodes give back what conversations took once they are
//! idle. One or two nodes (users on the last, the agent on the first, so with two nodes every
//! commit crosses the bus), an agent member answering every turn; N conversations are each
//! touched once (a session opens, sends one text, reads its ack and the answer, closes) and
//! left idle. Each node's RSS once idle state was forgotten (a node keeps what it remembers per
//! conversation for one to two minutes, ADR 0034) and the allocator decayed, against its RSS
//! after a warm-up of the same kind; the goal (issue 34) is at most 1.5 times.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use converger_client::{RestClient, TokenRequest};
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio::sync::Semaphore;
use tokio_tungstenite::tungstenite::Message;

use crate::gateway::{DEFAULT_DATABASE_URL, Gateway, bench_channel, default_binary};
use crate::machine;
use crate::pipelined_agent::{self, Arrivals};

/// Arguments of `memory`.
#[derive(Debug, clap::Args)]
pub struct MemoryArgs {
    /// Conversations touched once each.
    #[arg(long, default_value_t = 100_000)]
    conversations: usize,
    /// Conversations touched at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Gateway nodes (1 or 2).
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// The nodes' cluster bus: `postgres` or `nats` (`--nats-url`).
    #[arg(long, default_value = "postgres")]
    bus: String,
    /// NATS server for `--bus nats`.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Postgres server to create the benchmark database on.
    #[arg(long, default_value = DEFAULT_DATABASE_URL)]
    database_url: String,
    /// The `converger` binary (default: next to this one).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// Seconds left idle before the settled RSS is read: past the nodes' forgetting (two
    /// minutes at most, plus the channel actor's 10 s tick) and the allocator's decay.
    #[arg(long, default_value_t = 150)]
    settle_secs: u64,
}

/// Conversations of the warm-up, before the baseline is read.
const WARM_UP: usize = 1_000;

/// jemalloc's default `dirty_decay_ms` (the node keeps it), and a margin.
const ALLOCATOR_SETTLE: Duration = Duration::from_secs(12);

/// Runs the measurement and prints a table and one JSON line.
pub async fn run(args: MemoryArgs) -> anyhow::Result<()> {
    rlimit::increase_nofile_limit(u64::MAX).context("raise the open-file limit")?;
    anyhow::ensure!(args.nodes == 1 || args.nodes == 2, "--nodes must be 1 or 2");
    let binary = args.binary.clone().unwrap_or_else(default_binary);
    let env = vec![
        ("CONVERGER_BUS", args.bus.clone()),
        ("CONVERGER_NATS__SERVERS", args.nats_url.clone()),
        ("CONVERGER_GROUP_SETTLE_MS", "100".to_owned()),
        // One agent answers every conversation's turn, over one connection (which may address
        // only `max_conversations` of them, docs/protocol.md §4.7).
        ("CONVERGER_LIMITS__MAX_FRAMES_PER_SEC", "100000".to_owned()),
        ("CONVERGER_LIMITS__MAX_CONVERSATIONS", "1000000".to_owned()),
        (
            "CONVERGER_RATES__CONVERSATIONS_PER_MINUTE_PER_CHANNEL",
            "100000000".to_owned(),
        ),
        (
            "CONVERGER_RATES__CONVERSATIONS_PER_MINUTE_PER_TENANT",
            "100000000".to_owned(),
        ),
    ];
    let database = crate::gateway::create_database(&args.database_url).await?;
    let log =
        |node: usize| std::env::temp_dir().join(format!("converger-memory-{database}-{node}.log"));
    let first =
        Gateway::start_logged(&binary, &args.database_url, &database, &env, Some(log(1))).await?;
    let mut second = None;
    if args.nodes == 2 {
        let mut with_seed = env.clone();
        with_seed.push((
            "CONVERGER_SEEDS",
            first.gossip_addr.clone().unwrap_or_default(),
        ));
        second = Some(
            Gateway::start_logged(
                &binary,
                &args.database_url,
                &database,
                &with_seed,
                Some(log(2)),
            )
            .await?,
        );
    }
    eprintln!("node logs: {} and {}", log(1).display(), log(2).display());
    let outcome = measure(&args, &first, second.as_ref()).await;
    if let Some(second) = second {
        second.kill().await;
    }
    if outcome.is_err() {
        // Kept for investigation, with the node logs.
        first.kill().await;
        eprintln!("kept database {database}");
        return outcome;
    }
    first.stop().await?;
    outcome
}

async fn measure(
    args: &MemoryArgs,
    first: &Gateway,
    second: Option<&Gateway>,
) -> anyhow::Result<()> {
    let users_node = second.unwrap_or(first);
    let rest = RestClient::new(&first.base_url)?;
    let (channel, agent_token) =
        bench_channel(&rest, "memory", &TokenRequest::channel_scope()).await?;
    let user_token = rest
        .generate_token(&channel.secret, &TokenRequest::default())
        .await?
        .token;
    let arrivals: Arrivals = Arc::new(Mutex::new(HashMap::new()));
    let (eligible, since) = tokio::sync::oneshot::channel();
    let agent = tokio::spawn(pipelined_agent::serve(
        first.ws_url.clone(),
        agent_token,
        "bench",
        false,
        Arc::clone(&arrivals),
        Arc::default(),
        eligible,
    ));
    tokio::time::timeout(Duration::from_secs(10), since)
        .await
        .context("the agent's welcome did not come")??;
    // Past the settle delay, so the member owns every turn.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let users_rest = RestClient::new(&users_node.base_url)?;
    let pids: Vec<(&str, u32)> = match second {
        Some(second) => vec![("node_1", first.pid()), ("node_2", second.pid())],
        None => vec![("node_1", first.pid())],
    };
    let base_urls: Vec<&str> = match second {
        Some(second) => vec![&first.base_url, &second.base_url],
        None => vec![&first.base_url],
    };

    touch(args, users_node, &users_rest, &user_token, WARM_UP).await?;
    arrivals.lock().map(|mut seen| seen.clear()).ok();
    tokio::time::sleep(ALLOCATOR_SETTLE).await;
    let idle: Vec<u64> = pids
        .iter()
        .map(|(_, pid)| machine::rss_kib(*pid).unwrap_or(0))
        .collect();
    let idle_allocator = allocator(&base_urls).await;
    let started = Instant::now();
    touch(
        args,
        users_node,
        &users_rest,
        &user_token,
        args.conversations,
    )
    .await?;
    let touch_secs = started.elapsed().as_secs_f64();
    arrivals.lock().map(|mut seen| seen.clear()).ok();
    let right_after: Vec<u64> = pids
        .iter()
        .map(|(_, pid)| machine::rss_kib(*pid).unwrap_or(0))
        .collect();
    tokio::time::sleep(ALLOCATOR_SETTLE).await;
    let decayed: Vec<u64> = pids
        .iter()
        .map(|(_, pid)| machine::rss_kib(*pid).unwrap_or(0))
        .collect();
    tokio::time::sleep(Duration::from_secs(args.settle_secs).saturating_sub(ALLOCATOR_SETTLE))
        .await;
    let settled: Vec<u64> = pids
        .iter()
        .map(|(_, pid)| machine::rss_kib(*pid).unwrap_or(0))
        .collect();
    let settled_allocator = allocator(&base_urls).await;
    agent.abort();

    println!(
        "{} conversations touched once in {touch_secs:.1} s ({:.0}/s), bus {}, {} node(s)",
        args.conversations,
        args.conversations as f64 / touch_secs,
        args.bus,
        args.nodes
    );
    let mut nodes = serde_json::Map::new();
    for (index, (name, _)) in pids.iter().enumerate() {
        let ratio = settled[index] as f64 / idle[index].max(1) as f64;
        println!(
            "{name}: RSS idle {} KiB, right after {} KiB, {} s later {} KiB, {} s later {} KiB: {ratio:.2}× idle (goal ≤ 1.5×)",
            idle[index],
            right_after[index],
            ALLOCATOR_SETTLE.as_secs(),
            decayed[index],
            args.settle_secs,
            settled[index]
        );
        let (live_idle, live_settled) = (idle_allocator[index], settled_allocator[index]);
        println!(
            "{name}: allocator live/resident idle {} / {} KiB, settled {} / {} KiB",
            live_idle.0, live_idle.1, live_settled.0, live_settled.1
        );
        nodes.insert(
            (*name).to_owned(),
            json!({"idle_kib": idle[index], "right_after_kib": right_after[index],
                   "decayed_kib": decayed[index], "settled_kib": settled[index],
                   "settled_to_idle": ratio,
                   "allocated_kib": {"idle": live_idle.0, "settled": live_settled.0},
                   "allocator_resident_kib": {"idle": live_idle.1, "settled": live_settled.1}}),
        );
    }
    let line = json!({
        "bench": "memory",
        "machine": machine::describe(),
        "settings": {"conversations": args.conversations, "nodes": args.nodes, "bus": args.bus,
                     "warm_up": WARM_UP, "concurrency": args.concurrency,
                     "settle_secs": args.settle_secs},
        "touch_secs": touch_secs,
        "nodes": nodes,
        "goal_settled_to_idle": 1.5,
    });
    println!("{line}");
    Ok(())
}

/// Each node's allocator gauges (live bytes, resident bytes) in KiB; 0 when unreadable. The
/// gauges are refreshed every 10 s, so they are read after one more refresh.
async fn allocator(base_urls: &[&str]) -> Vec<(u64, u64)> {
    tokio::time::sleep(Duration::from_secs(11)).await;
    let mut figures = Vec::new();
    for base_url in base_urls {
        let scrape = crate::gateway_metrics::scrape(base_url)
            .await
            .unwrap_or_default();
        let kib = |name: &str| scrape.get(name).copied().unwrap_or(0.0) as u64 / 1024;
        figures.push((
            kib("converger_allocator_allocated_bytes"),
            kib("converger_allocator_resident_bytes"),
        ));
    }
    figures
}

/// Touches `count` new conversations, `concurrency` at once: each gets a session on
/// `gateway` that sends one text and waits for its ack and the agent's answer, then closes.
async fn touch(
    args: &MemoryArgs,
    gateway: &Gateway,
    rest: &RestClient,
    user_token: &str,
    count: usize,
) -> anyhow::Result<()> {
    let permits = Arc::new(Semaphore::new(args.concurrency));
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..count {
        let permit = Arc::clone(&permits).acquire_owned().await?;
        let (rest, user_token) = (rest.clone(), user_token.to_owned());
        let url = gateway.ws_url.clone();
        tasks.spawn(async move {
            let _permit = permit;
            let created = rest.create_conversation(&user_token).await?;
            let seen = Arc::new(Mutex::new(Vec::new()));
            let touched = once(url, created.token, index, Arc::clone(&seen));
            match tokio::time::timeout(Duration::from_secs(30), touched).await {
                Ok(outcome) => outcome,
                Err(_) => anyhow::bail!(
                    "touching conversation {} took over 30 s; it received {:?}",
                    created.conversation_id,
                    seen.lock().map(|seen| seen.clone()).unwrap_or_default()
                ),
            }
        });
        while let Some(done) = tasks.try_join_next() {
            done??;
        }
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(())
}

/// One session: hello, one text, its ack and the answer, close.
async fn once(
    url: String,
    token: String,
    index: usize,
    seen: Arc<Mutex<Vec<String>>>,
) -> anyhow::Result<()> {
    let (mut socket, _) = tokio_tungstenite::connect_async_with_config(
        url,
        Some(converger_client::socket_config()),
        false,
    )
    .await?;
    let hello = json!({"type": "hello", "protocol": "converger/1", "token": token});
    socket.send(Message::text(hello.to_string())).await?;
    let text = json!({"type": "text", "clientId": format!("m-{index}"), "data": {"text": "hi"}});
    let mut sent = false;
    let mut acked = false;
    while let Some(message) = socket.next().await {
        let Message::Text(frame) = message? else {
            continue;
        };
        let frame: serde_json::Value = serde_json::from_str(frame.as_str())?;
        if let Ok(mut seen) = seen.lock() {
            seen.push(frame["type"].as_str().unwrap_or_default().to_owned());
        }
        match frame["type"].as_str() {
            Some("welcome") if !sent => {
                socket.send(Message::text(text.to_string())).await?;
                sent = true;
            }
            Some("ack") => acked = true,
            Some("text") if acked && frame["sender"]["role"] == "agent" => {
                // The server closes the TCP connection first (RFC 6455), so the TIME_WAIT is
                // its own: 100,000 touches would exhaust the bench's ephemeral ports.
                socket.close(None).await?;
                while let Some(Ok(_)) = socket.next().await {}
                return Ok(());
            }
            _ => {}
        }
    }
    anyhow::bail!("closed before the answer")
}
