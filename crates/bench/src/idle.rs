//! `idle --connections K`: the gateway's memory per idle conversation session.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use converger_client::{RestClient, TokenRequest};
use futures_util::SinkExt;
use futures_util::StreamExt;
use serde_json::json;
use tokio::sync::Semaphore;
use tokio_tungstenite::tungstenite::Message;

use crate::gateway::{DEFAULT_DATABASE_URL, Gateway, bench_channel, default_binary};
use crate::machine;

/// Arguments of `idle`.
#[derive(Debug, clap::Args)]
pub struct IdleArgs {
    /// Idle sessions to open.
    #[arg(long, default_value_t = 10_000)]
    connections: usize,
    /// Postgres server to create the benchmark database on.
    #[arg(long, default_value = DEFAULT_DATABASE_URL)]
    database_url: String,
    /// The `converger` binary (default: next to this one).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// Sessions opened at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// The goal compared against, KiB per connection.
    #[arg(long, default_value_t = 16)]
    goal_kib: u64,
}

/// Runs the measurement and prints a table and one JSON line.
pub async fn run(args: IdleArgs) -> anyhow::Result<()> {
    // One socket per session on both sides: raise the descriptor limit (inherited by the gateway).
    let limit = rlimit::increase_nofile_limit(u64::MAX).context("raise the open-file limit")?;
    anyhow::ensure!(
        limit as usize > args.connections + 256,
        "open-file limit {limit} is too low"
    );
    let binary = args.binary.clone().unwrap_or_else(default_binary);
    let env = [
        // Idle means idle: no pings or heartbeats while measuring.
        ("CONVERGER_LIMITS__IDLE_TIMEOUT_MS", "3600000".to_owned()),
        (
            "CONVERGER_LIMITS__HEARTBEAT_INTERVAL_MS",
            "1800000".to_owned(),
        ),
        ("CONVERGER_DATABASE__MAX_CONNECTIONS", "16".to_owned()),
    ];
    let gateway = Gateway::start(&binary, &args.database_url, &env).await?;
    let outcome = measure(&args, &gateway).await;
    gateway.stop().await?;
    outcome
}

async fn measure(args: &IdleArgs, gateway: &Gateway) -> anyhow::Result<()> {
    let client = RestClient::new(&gateway.base_url)?;
    let (_, token) = bench_channel(&client, "idle", &TokenRequest::default()).await?;

    // Warm up allocator and pools with a few sessions so the baseline is not an empty process.
    let mut sockets = open_sessions(gateway, &token, 100, args.concurrency).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = machine::rss_kib(gateway.pid()).context("read gateway RSS")?;
    let started = Instant::now();
    sockets.extend(open_sessions(gateway, &token, args.connections, args.concurrency).await?);
    let open_secs = started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = machine::rss_kib(gateway.pid()).context("read gateway RSS")?;
    let per_connection = (after.saturating_sub(before)) as f64 / args.connections as f64;
    let total_per_connection = after as f64 / sockets.len() as f64;

    println!("idle sessions        {}", args.connections);
    println!("opened in            {open_secs:.1} s");
    println!("gateway RSS before   {before} KiB (100 warm-up sessions)");
    println!("gateway RSS after    {after} KiB");
    println!(
        "RSS per connection   {per_connection:.1} KiB (goal ≤ {} KiB)",
        args.goal_kib
    );
    let result = json!({
        "bench": "idle",
        "connections": args.connections,
        "open_secs": open_secs,
        "rss_before_kib": before,
        "rss_after_kib": after,
        "rss_per_connection_kib": per_connection,
        "rss_total_per_connection_kib": total_per_connection,
        "goal_kib": args.goal_kib,
        "machine": machine::describe(),
    });
    println!("{result}");
    drop(sockets);
    Ok(())
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Opens `count` sessions (hello → welcome), each in a conversation of its own.
async fn open_sessions(
    gateway: &Gateway,
    token: &str,
    count: usize,
    concurrency: usize,
) -> anyhow::Result<Vec<Socket>> {
    let permits = Arc::new(Semaphore::new(concurrency));
    let mut tasks = Vec::with_capacity(count);
    for _ in 0..count {
        let permit = Arc::clone(&permits).acquire_owned().await?;
        let url = gateway.ws_url.clone();
        let hello = json!({"type": "hello", "protocol": "converger/1", "token": token}).to_string();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let (mut socket, _) = tokio_tungstenite::connect_async_with_config(
                url,
                Some(converger_client::socket_config()),
                false,
            )
            .await?;
            socket.send(Message::Text(hello.into())).await?;
            while let Some(message) = socket.next().await {
                if let Message::Text(text) = message?
                    && text.contains("\"welcome\"")
                {
                    return Ok::<_, anyhow::Error>(socket);
                }
            }
            anyhow::bail!("closed before welcome")
        }));
    }
    let mut sockets = Vec::with_capacity(count);
    for task in tasks {
        sockets.push(task.await??);
    }
    Ok(sockets)
}
