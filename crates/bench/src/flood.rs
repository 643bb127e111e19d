//! `flood`: what a hostile client costs everyone else, in one run against one node.
//!
//! 1. Poison: honest users send paced text frames and time their acks, first alone, then while
//!    poisoners send frames with a NUL character (which storage cannot hold) as fast as their
//!    rate allows. Goal: the honest p99 with poison within 1.5× of the p99 without.
//! 2. Memory: the node's RSS idle, then while slow consumers (sockets that never read) sit in a
//!    conversation a writer floods until the node closes them (4503), then every few seconds
//!    after they are gone. Goal: back within 2× of the idle RSS within `--settle-secs`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use converger_client::{RestClient, TokenRequest};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::sync::Mutex;
use tokio_tungstenite::tungstenite::Message;

use crate::gateway::{DEFAULT_DATABASE_URL, Gateway, bench_channel, default_binary};
use crate::{machine, stats};

/// Arguments of `flood`.
#[derive(Debug, clap::Args)]
pub struct FloodArgs {
    /// Honest users, each in a conversation of its own.
    #[arg(long, default_value_t = 16)]
    honest: usize,
    /// Frames per second each honest user sends.
    #[arg(long, default_value_t = 10.0)]
    honest_rate: f64,
    /// Poisoning connections.
    #[arg(long, default_value_t = 8)]
    poisoners: usize,
    /// Poisoned frames per second each poisoner sends.
    #[arg(long, default_value_t = 40.0)]
    poison_rate: f64,
    /// Seconds of each poison phase (without, then with poison).
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Slow consumers in the flooded conversation.
    #[arg(long, default_value_t = 300)]
    slow_consumers: usize,
    /// Frames the writer floods the conversation with.
    #[arg(long, default_value_t = 1_500)]
    flood_frames: usize,
    /// Bytes of each flood frame's text.
    #[arg(long, default_value_t = 2_048)]
    flood_bytes: usize,
    /// Seconds the RSS is followed after the flood.
    #[arg(long, default_value_t = 60)]
    settle_secs: u64,
    /// Postgres server to create the benchmark database on.
    #[arg(long, default_value = DEFAULT_DATABASE_URL)]
    database_url: String,
    /// The `converger` binary (default: next to this one).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// A label for the binary's allocator, printed with the result.
    #[arg(long, default_value = "default")]
    allocator: String,
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Runs both measurements and prints a table and one JSON line.
pub async fn run(args: FloodArgs) -> anyhow::Result<()> {
    rlimit::increase_nofile_limit(u64::MAX).context("raise the open-file limit")?;
    let binary = args.binary.clone().unwrap_or_else(default_binary);
    let env = [
        // The poisoners are limited by the per-connection rate like anyone; honest users too.
        ("CONVERGER_LIMITS__MAX_FRAMES_PER_SEC", "200".to_owned()),
    ];
    let gateway = Gateway::start(&binary, &args.database_url, &env).await?;
    let outcome = measure(&args, &gateway).await;
    gateway.stop().await?;
    outcome
}

async fn measure(args: &FloodArgs, gateway: &Gateway) -> anyhow::Result<()> {
    let client = RestClient::new(&gateway.base_url)?;
    let (_, token) = bench_channel(&client, "flood", &TokenRequest::default()).await?;

    let clean = honest_round(args, gateway, &token, false).await?;
    let poisoned = honest_round(args, gateway, &token, true).await?;
    let ratio = poisoned.p99_ms / clean.p99_ms.max(0.001);
    let memory = memory_round(args, gateway, &token).await?;

    println!("machine              {}", machine::describe());
    println!("allocator            {}", args.allocator);
    println!(
        "honest acks          {} users at {}/s, {} s per phase",
        args.honest, args.honest_rate, args.duration
    );
    println!(
        "  without poison     p50 {:.1} ms  p99 {:.1} ms  ({} acks)",
        clean.p50_ms, clean.p99_ms, clean.acks
    );
    println!(
        "  with poison        p50 {:.1} ms  p99 {:.1} ms  ({} acks; {} poisoners at {}/s: {} refused, {} internal)",
        poisoned.p50_ms,
        poisoned.p99_ms,
        poisoned.acks,
        args.poisoners,
        args.poison_rate,
        poisoned.refused,
        poisoned.internal
    );
    println!(
        "  p99 ratio          {ratio:.2} (goal ≤ 1.5: {})",
        if ratio <= 1.5 { "met" } else { "not met" }
    );
    println!(
        "RSS                  idle {} KiB, peak {} KiB during the flood ({} slow consumers, {} closed 4503, {} of {} frames read each), {} KiB {} s after",
        memory.idle_kib,
        memory.peak_kib,
        args.slow_consumers,
        memory.closed_slow,
        memory.frames_per_consumer,
        args.flood_frames,
        memory.after_kib,
        args.settle_secs
    );
    let memory_ratio = memory.after_kib as f64 / memory.idle_kib.max(1) as f64;
    println!(
        "  after / idle       {memory_ratio:.2} (goal ≤ 2: {})",
        if memory_ratio <= 2.0 {
            "met"
        } else {
            "not met"
        }
    );
    let result = json!({
        "bench": "flood",
        "allocator": args.allocator,
        "honest": {"users": args.honest, "rate": args.honest_rate, "duration_s": args.duration},
        "without_poison": clean.to_json(),
        "with_poison": poisoned.to_json(),
        "p99_ratio": ratio,
        "poison": {"connections": args.poisoners, "rate": args.poison_rate},
        "rss_kib": {"idle": memory.idle_kib, "peak": memory.peak_kib, "after": memory.after_kib,
                    "samples_after": memory.samples},
        "rss_after_over_idle": memory_ratio,
        "slow_consumers": args.slow_consumers,
        "closed_slow_consumer": memory.closed_slow,
        "frames_per_slow_consumer": memory.frames_per_consumer,
        "machine": machine::describe(),
    });
    println!("{result}");
    Ok(())
}

/// What one honest phase measured.
struct Round {
    acks: usize,
    p50_ms: f64,
    p99_ms: f64,
    /// Poisoned frames refused as `invalid_message`.
    refused: usize,
    /// Poisoned frames answered `internal` (a poison that reached the database).
    internal: usize,
}

impl Round {
    fn to_json(&self) -> Value {
        json!({"acks": self.acks, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
               "poison_refused": self.refused, "poison_internal": self.internal})
    }
}

/// Opens a converger-profile session with `hello` and returns it with its welcome.
async fn connect_with(gateway: &Gateway, hello: Value) -> anyhow::Result<(Socket, Value)> {
    let (mut socket, _) = tokio_tungstenite::connect_async_with_config(
        &gateway.ws_url,
        Some(converger_client::socket_config()),
        false,
    )
    .await?;
    socket.send(Message::Text(hello.to_string().into())).await?;
    while let Some(message) = socket.next().await {
        if let Message::Text(text) = message? {
            let frame: Value = serde_json::from_str(&text)?;
            if frame["type"] == "welcome" {
                return Ok((socket, frame));
            }
        }
    }
    anyhow::bail!("closed before welcome")
}

/// Opens a session in a new conversation with the anonymous `token`.
async fn connect(gateway: &Gateway, token: &str) -> anyhow::Result<Socket> {
    let hello = json!({"type": "hello", "protocol": "converger/1", "token": token});
    Ok(connect_with(gateway, hello).await?.0)
}

async fn honest_round(
    args: &FloodArgs,
    gateway: &Gateway,
    token: &str,
    with_poison: bool,
) -> anyhow::Result<Round> {
    let deadline = Instant::now() + Duration::from_secs(args.duration);
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for user in 0..args.honest {
        let socket = connect(gateway, token).await?;
        let latencies = Arc::clone(&latencies);
        let interval = Duration::from_secs_f64(1.0 / args.honest_rate);
        tasks.push(tokio::spawn(async move {
            honest_user(socket, user, interval, deadline, latencies).await
        }));
    }
    let mut poisoners = Vec::new();
    if with_poison {
        for _ in 0..args.poisoners {
            let socket = connect(gateway, token).await?;
            let interval = Duration::from_secs_f64(1.0 / args.poison_rate);
            poisoners.push(tokio::spawn(poisoner(socket, interval, deadline)));
        }
    }
    for task in tasks {
        task.await??;
    }
    let (mut refused, mut internal) = (0, 0);
    for task in poisoners {
        let (was_refused, was_internal) = task.await??;
        refused += was_refused;
        internal += was_internal;
    }
    let mut latencies = std::mem::take(&mut *latencies.lock().await);
    let acks = latencies.len();
    let summary = stats::percentiles(&mut latencies);
    Ok(Round {
        acks,
        p50_ms: summary["p50"].as_f64().unwrap_or(0.0),
        p99_ms: summary["p99"].as_f64().unwrap_or(0.0),
        refused,
        internal,
    })
}

/// Sends one text frame per interval, one at a time, and records each ack's latency.
async fn honest_user(
    mut socket: Socket,
    user: usize,
    interval: Duration,
    deadline: Instant,
    latencies: Arc<Mutex<Vec<f64>>>,
) -> anyhow::Result<()> {
    let mut next = tokio::time::Instant::now();
    let mut sent = 0usize;
    while Instant::now() < deadline {
        tokio::time::sleep_until(next).await;
        next += interval;
        let client_id = format!("u{user}-{sent}");
        sent += 1;
        let frame = json!({"type": "text", "clientId": client_id, "data": {"text": "honest"}});
        let started = Instant::now();
        socket.send(Message::Text(frame.to_string().into())).await?;
        loop {
            let Some(message) = socket.next().await else {
                anyhow::bail!("an honest session closed");
            };
            let Message::Text(text) = message? else {
                continue;
            };
            let frame: Value = serde_json::from_str(&text)?;
            if frame["type"] == "ack" && frame["clientId"] == client_id.as_str() {
                let elapsed = started.elapsed().as_secs_f64() * 1000.0;
                latencies.lock().await.push(elapsed);
                break;
            }
            if frame["type"] == "error" && frame["data"]["clientId"] == client_id.as_str() {
                break;
            }
        }
    }
    let _ = socket.close(None).await;
    Ok(())
}

/// Sends a frame with a NUL character per interval; counts how the node answered.
async fn poisoner(
    socket: Socket,
    interval: Duration,
    deadline: Instant,
) -> anyhow::Result<(usize, usize)> {
    let (mut sink, mut stream) = socket.split();
    let reader = tokio::spawn(async move {
        let (mut refused, mut internal) = (0, 0);
        while let Some(Ok(message)) = stream.next().await {
            let Message::Text(text) = message else {
                continue;
            };
            let Ok(frame) = serde_json::from_str::<Value>(&text) else {
                continue;
            };
            match frame["data"]["code"].as_str() {
                Some("invalid_message") => refused += 1,
                Some("internal") => internal += 1,
                _ => {}
            }
        }
        (refused, internal)
    });
    let mut next = tokio::time::Instant::now();
    let mut sent = 0usize;
    while Instant::now() < deadline {
        tokio::time::sleep_until(next).await;
        next += interval;
        let frame = json!({"type": "text", "clientId": format!("p-{sent}"), "data": {"text": "poison\u{0}"}});
        sent += 1;
        if sink
            .send(Message::Text(frame.to_string().into()))
            .await
            .is_err()
        {
            break;
        }
    }
    let _ = sink.close().await;
    Ok(reader.await?)
}

/// What the memory phase measured.
struct Memory {
    idle_kib: u64,
    peak_kib: u64,
    after_kib: u64,
    samples: Vec<u64>,
    closed_slow: usize,
    /// Frames a slow consumer read on average before its close (or the end).
    frames_per_consumer: u64,
}

async fn memory_round(args: &FloodArgs, gateway: &Gateway, token: &str) -> anyhow::Result<Memory> {
    let pid = gateway.pid();
    let rss = || machine::rss_kib(pid).context("read the gateway's RSS");
    // The idle baseline: the node after the poison phases, every session gone.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_kib = rss()?;

    // One conversation: a writer's session, and slow consumers joined to it (presenting its
    // anonymous user id) that never read.
    let hello = json!({"type": "hello", "protocol": "converger/1", "token": token});
    let (mut writer, welcome) = connect_with(gateway, hello).await?;
    let join = json!({"type": "hello", "protocol": "converger/1", "token": token,
                      "conversationId": welcome["data"]["conversationId"],
                      "userId": welcome["data"]["userId"]});
    let mut slow = Vec::with_capacity(args.slow_consumers);
    for _ in 0..args.slow_consumers {
        slow.push(connect_with(gateway, join.clone()).await?.0);
    }
    let text = "x".repeat(args.flood_bytes);
    let mut peak_kib = rss()?;
    for n in 0..args.flood_frames {
        let frame = json!({"type": "text", "clientId": format!("f-{n}"), "data": {"text": text}});
        writer.send(Message::Text(frame.to_string().into())).await?;
        // One at a time: read up to this frame's ack (the writer is not a slow consumer).
        loop {
            let Some(message) = writer.next().await else {
                anyhow::bail!("the writer's session closed");
            };
            let Message::Text(reply) = message? else {
                continue;
            };
            if reply.contains("\"ack\"") || reply.contains("\"error\"") {
                break;
            }
        }
        if n % 100 == 0 {
            peak_kib = peak_kib.max(rss()?);
        }
    }
    peak_kib = peak_kib.max(rss()?);
    // Now read what each slow consumer was sent: the node has closed those it gave up on.
    let mut closed_slow = 0;
    let mut received_frames = 0u64;
    for mut socket in slow {
        let outcome = tokio::time::timeout(Duration::from_secs(5), async {
            let mut frames = 0u64;
            while let Some(Ok(message)) = socket.next().await {
                match message {
                    Message::Close(Some(frame)) => return (frames, u16::from(frame.code) == 4503),
                    Message::Text(_) => frames += 1,
                    _ => {}
                }
            }
            (frames, false)
        })
        .await
        .unwrap_or((0, false));
        received_frames += outcome.0;
        closed_slow += usize::from(outcome.1);
    }
    // Between every frame (all closed) and every frame read (none closed): how far behind the
    // node let a consumer fall before giving up on it.
    let frames_per_consumer = received_frames / args.slow_consumers.max(1) as u64;
    let _ = writer.close(None).await;
    drop(writer);
    let mut samples = Vec::new();
    let settle_started = Instant::now();
    while settle_started.elapsed() < Duration::from_secs(args.settle_secs) {
        tokio::time::sleep(Duration::from_secs(5)).await;
        samples.push(rss()?);
    }
    let after_kib = samples.last().copied().unwrap_or(rss()?);
    Ok(Memory {
        idle_kib,
        peak_kib,
        after_kib,
        samples,
        closed_slow,
        frames_per_consumer,
    })
}
