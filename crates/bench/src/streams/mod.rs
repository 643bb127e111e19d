//! `streams`: streamed answers relayed to end users, against the same relay over Redis pub/sub
//! and NATS core pub/sub, in one run.
//!
//! S conversations each get one streamed answer from one agent on the first node; each has a
//! tab on the first node (same node) and a share of them a second tab on the second node (cross
//! node). Phase 1 sends chunks as fast as the agent's socket takes them: chunks delivered per
//! second over all tabs. Phase 2 paces the chunks at half of that: chunk latency (agent send →
//! tab receive) p50/p99, same node and cross node. The peers relay the same chunks publisher →
//! server → one subscriber connection per tab. Chunks carry their send time, so every latency
//! is read off one clock. The last stdout line is one JSON object.
//!
//! `--clients ws,ai-sdk,ag-ui` measures converger once per client the tabs speak (`tabs.rs`),
//! in the same run, each against fresh nodes and database: the chat frontends' SSE routes
//! against the WebSocket path.

mod tabs;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use converger_client::{RestClient, TokenRequest};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::task::JoinSet;
use tokio_tungstenite::tungstenite::Message;

use crate::gateway::{DEFAULT_DATABASE_URL, Gateway, bench_channel, default_binary};
use crate::peers::Clock;
use crate::{machine, stats};

/// Arguments of `streams`.
#[derive(Debug, clap::Args)]
pub struct StreamsArgs {
    /// Concurrent streamed answers (one conversation and one tab each).
    #[arg(long, default_value_t = 1_000)]
    streams: usize,
    /// Bytes of each chunk's text.
    #[arg(long, default_value_t = 32)]
    chunk_bytes: usize,
    /// Phase 2's chunks per second over all streams; 0: half of phase 1's delivered rate.
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
    /// Gateway nodes (1 or 2; with 2, second tabs connect to the second node).
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// Share of the conversations with a second tab on the second node.
    #[arg(long, default_value_t = 0.2)]
    second_tabs: f64,
    /// Seconds of each phase.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// Postgres server to create the benchmark database on.
    #[arg(long, default_value = DEFAULT_DATABASE_URL)]
    database_url: String,
    /// The `converger` binary (default: next to this one).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// Redis server.
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// NATS server.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// The clients converger's tabs speak, each measured in turn (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "ws")]
    clients: Vec<tabs::Client>,
    /// Measure converger only (no Redis or NATS peers).
    #[arg(long)]
    skip_peers: bool,
    /// The cluster buses converger's nodes run on, each measured in turn with the first client
    /// (comma-separated: `postgres`, `nats`; the NATS bus uses `--nats-url`).
    #[arg(long, value_delimiter = ',', default_value = "postgres")]
    buses: Vec<String>,
}

/// The nodes' stream budgets (per channel, per node): 4 GiB.
const STREAM_BUDGET_BYTES: u64 = 4 << 30;

pub(crate) type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// What one tab (or subscriber) saw: chunks per phase, and phase 2's latencies.
#[derive(Debug, Default)]
struct Seen {
    delivered: [u64; 2],
    latencies_ms: Vec<f64>,
}

/// Where a tab sits relative to the publisher.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    SameNode,
    CrossNode,
}

/// The chunk text: phase, send time in µs, padding to `bytes`.
fn chunk_text(phase: u8, sent_us: u64, bytes: usize) -> String {
    let mut text = format!("{phase}{sent_us:020}");
    while text.len() < bytes {
        text.push('.');
    }
    text
}

/// (phase, send time) of a chunk text.
fn read_chunk(text: &str) -> Option<(usize, u64)> {
    let phase = text.get(0..1)?.parse::<usize>().ok()?;
    let sent = text.get(1..21)?.parse().ok()?;
    Some((phase.checked_sub(1)?, sent))
}

/// A shared record of what the tabs saw (a plain mutex, held for a few instructions: the
/// tally must cost the receivers as little as it can, since they share the machine with the
/// systems measured).
#[derive(Default)]
pub(crate) struct Tally {
    same: Mutex<Seen>,
    cross: Mutex<Seen>,
}

fn seen(place: &Mutex<Seen>) -> MutexGuard<'_, Seen> {
    place
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Tally {
    pub(crate) fn take(&self, place: Place, text: &str, clock: &Clock) {
        let Some((phase, sent)) = read_chunk(text) else {
            return;
        };
        let latency = crate::peers::millis_between(sent, clock.now_us());
        let mut seen = match place {
            Place::SameNode => seen(&self.same),
            Place::CrossNode => seen(&self.cross),
        };
        if let Some(count) = seen.delivered.get_mut(phase) {
            *count += 1;
        }
        if phase == 1 {
            seen.latencies_ms.push(latency);
        }
    }

    /// Chunks delivered in `phase`, over both places.
    fn delivered_in(&self, phase: usize) -> u64 {
        seen(&self.same).delivered[phase] + seen(&self.cross).delivered[phase]
    }

    /// Chunks delivered so far, over both places and phases.
    fn total(&self) -> u64 {
        let same = seen(&self.same).delivered.iter().sum::<u64>();
        let cross = seen(&self.cross).delivered.iter().sum::<u64>();
        same + cross
    }

    /// Waits until no chunk has arrived for 500 ms (the relays' backlog is drained), at most
    /// 60 s.
    async fn settle(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = self.total();
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let now = self.total();
            if now == last {
                return;
            }
            last = now;
        }
    }

    fn figures(&self, phase_secs: [f64; 2]) -> Value {
        let mut same = seen(&self.same);
        let mut cross = seen(&self.cross);
        let delivered = |phase: usize| {
            (same.delivered[phase] + cross.delivered[phase]) as f64 / phase_secs[phase].max(1e-9)
        };
        json!({
            "delivered": {"same_node": same.delivered, "cross_node": cross.delivered},
            "chunks_per_sec": delivered(0),
            "paced_chunks_per_sec": delivered(1),
            "same_node_ms": stats::percentiles(&mut same.latencies_ms),
            "cross_node_ms": stats::percentiles(&mut cross.latencies_ms),
        })
    }
}

/// CPU time that processes spent over phase 1 (as fast as possible), per chunk delivered:
/// what each part of the relay costs, the bench's own clients included (they share the two
/// cores with the system measured).
struct CpuMeter {
    processes: Vec<(String, u32, u64)>,
}

impl CpuMeter {
    fn start(processes: Vec<(String, u32)>) -> CpuMeter {
        CpuMeter {
            processes: processes
                .into_iter()
                .map(|(name, pid)| {
                    let ticks = machine::cpu_ticks(pid).unwrap_or(0);
                    (name, pid, ticks)
                })
                .collect(),
        }
    }

    /// `{name: CPU µs per chunk}` for `chunks` delivered since the start.
    fn per_chunk_us(&self, chunks: u64) -> Value {
        let mut figures = serde_json::Map::new();
        for (name, pid, before) in &self.processes {
            let spent = machine::cpu_ticks(*pid)
                .unwrap_or(0)
                .saturating_sub(*before);
            let micros = spent as f64 / machine::ticks_per_second() * 1e6;
            figures.insert(name.clone(), json!(micros / chunks.max(1) as f64));
        }
        Value::Object(figures)
    }
}

/// The pid of the first process whose command name is `command` (a peer's server).
fn pid_of(command: &str) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            (machine::process_times(pid)?.command == command).then_some(pid)
        })
}

/// The bench itself and, when found, the peer's server.
fn peer_processes(server: &str) -> Vec<(String, u32)> {
    let mut processes = vec![("bench_clients".to_owned(), std::process::id())];
    if let Some(pid) = pid_of(server) {
        processes.push((server.to_owned(), pid));
    }
    processes
}

/// The pace of one phase: chunks round robin over the streams until the deadline, as fast as
/// possible when the rate is 0, else at the rate (from the phase's start, so a late chunk does
/// not push the later ones back).
struct Pacer {
    started: Instant,
    deadline: Instant,
    rate: f64,
    sent: u64,
}

impl Pacer {
    fn new(rate: f64, duration: Duration) -> Pacer {
        let started = Instant::now();
        Pacer {
            started,
            deadline: started + duration,
            rate,
            sent: 0,
        }
    }

    /// Waits until the next chunk is due; `None` once the phase is over, else its stream.
    async fn next(&mut self, streams: usize) -> Option<usize> {
        if Instant::now() >= self.deadline {
            return None;
        }
        if self.rate > 0.0 {
            let due = self.started + Duration::from_secs_f64(self.sent as f64 / self.rate);
            tokio::time::sleep_until(due.into()).await;
        }
        self.sent += 1;
        Some((self.sent - 1) as usize % streams)
    }

    /// True when the chunk just due should be flushed now (each one when paced).
    fn flush_now(&self) -> bool {
        self.rate > 0.0 || self.sent.is_multiple_of(64)
    }

    fn elapsed_secs(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }
}

/// Runs converger and the peers, prints a table and one JSON line.
pub async fn run(args: StreamsArgs) -> anyhow::Result<()> {
    rlimit::increase_nofile_limit(u64::MAX).context("raise the open-file limit")?;
    if args.nodes == 0 || args.nodes > 2 {
        bail!("--nodes must be 1 or 2");
    }
    let Some(&first_client) = args.clients.first() else {
        bail!("--clients names no client");
    };
    // Phase 2 paces every client at the first one's rate (half its phase 1, unless --rate), so
    // their latencies are read under the same load.
    let Some(first_bus) = args.buses.first().cloned() else {
        bail!("--buses names no bus");
    };
    let mut by_client: Vec<(tabs::Client, Value)> = Vec::new();
    for &client in &args.clients {
        let paced = by_client
            .first()
            .and_then(|(_, first)| first["settings_paced_rate"].as_f64());
        by_client.push((
            client,
            measure_converger(&args, client, &first_bus, paced).await?,
        ));
    }
    let converger = by_client[0].1.clone();
    // The other buses, with the first client, paced as the first.
    let mut by_bus: Vec<(String, Value)> = vec![(first_bus.clone(), converger.clone())];
    for bus in args.buses.iter().skip(1) {
        let paced = converger["settings_paced_rate"].as_f64();
        by_bus.push((
            bus.clone(),
            measure_converger(&args, first_client, bus, paced).await?,
        ));
    }
    let half = converger["chunks_per_sec"].as_f64().unwrap_or(0.0) / 2.0;
    let rate = if args.rate > 0.0 { args.rate } else { half };
    let skipped = || json!({"failed": "skipped (--skip-peers)"});
    let redis = match args.skip_peers {
        true => skipped(),
        false => measure_redis(&args, rate)
            .await
            .unwrap_or_else(|error| json!({"failed": format!("{error:#}")})),
    };
    let nats = match args.skip_peers {
        true => skipped(),
        false => measure_nats(&args, rate)
            .await
            .unwrap_or_else(|error| json!({"failed": format!("{error:#}")})),
    };
    let faster_peer = [&redis, &nats]
        .iter()
        .filter_map(|figures| figures["chunks_per_sec"].as_f64())
        .fold(0.0, f64::max);
    let ratio = match faster_peer > 0.0 {
        true => json!(converger["chunks_per_sec"].as_f64().unwrap_or(0.0) / faster_peer),
        false => Value::Null,
    };
    let ratios_by_bus: serde_json::Map<String, Value> = by_bus
        .iter()
        .map(|(bus, figures)| {
            let ratio = match faster_peer > 0.0 {
                true => json!(figures["chunks_per_sec"].as_f64().unwrap_or(0.0) / faster_peer),
                false => Value::Null,
            };
            (bus.clone(), ratio)
        })
        .collect();
    let mut rows: Vec<(String, &Value)> = by_client
        .iter()
        .map(|(client, figures)| (format!("converger/{}", client.name()), figures))
        .collect();
    for (bus, figures) in by_bus.iter().skip(1) {
        rows.push((format!("converger/{}@{bus}", first_client.name()), figures));
    }
    rows.push(("redis".into(), &redis));
    rows.push(("nats".into(), &nats));
    println!("system              chunks/s   paced/s   same p50/p99 ms   cross p50/p99 ms");
    for (name, figures) in &rows {
        println!(
            "{name:<19} {:>9.0} {:>9.0}   {:>6.2} / {:>6.2}   {:>6.2} / {:>6.2}",
            figures["chunks_per_sec"].as_f64().unwrap_or(0.0),
            figures["paced_chunks_per_sec"].as_f64().unwrap_or(0.0),
            figures["same_node_ms"]["p50"].as_f64().unwrap_or(0.0),
            figures["same_node_ms"]["p99"].as_f64().unwrap_or(0.0),
            figures["cross_node_ms"]["p50"].as_f64().unwrap_or(0.0),
            figures["cross_node_ms"]["p99"].as_f64().unwrap_or(0.0),
        );
    }
    println!("CPU µs per chunk delivered at full speed, by process:");
    for (name, figures) in &rows {
        let parts: Vec<String> = figures["cpu_us_per_chunk_at_full_speed"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(process, micros)| format!("{process} {:.1}", micros.as_f64().unwrap_or(0.0)))
            .collect();
        println!("  {name:<19} {}", parts.join(", "));
    }
    // Each client against the first (the WebSocket path by default), in this run.
    let mut clients = serde_json::Map::new();
    let mut ratios = serde_json::Map::new();
    let of = |figures: &Value, pointer: &str| figures.pointer(pointer).and_then(Value::as_f64);
    for (client, figures) in &by_client {
        clients.insert(client.name().into(), figures.clone());
        let ratio = |pointer: &str| match (of(figures, pointer), of(&converger, pointer)) {
            (Some(value), Some(base)) if base > 0.0 => json!(value / base),
            _ => Value::Null,
        };
        ratios.insert(
            client.name().into(),
            json!({"chunks_per_sec": ratio("/chunks_per_sec"),
                   "same_node_p99": ratio("/same_node_ms/p99"),
                   "cross_node_p99": ratio("/cross_node_ms/p99")}),
        );
    }
    let mut line = converger.clone();
    line["bench"] = json!("streams");
    line["machine"] = machine::describe();
    line["settings"] = json!({
        "streams": args.streams, "chunk_bytes": args.chunk_bytes, "paced_rate": rate,
        "nodes": args.nodes, "second_tabs": args.second_tabs, "duration_secs": args.duration,
        "clients": args.clients.iter().map(|client| client.name()).collect::<Vec<_>>(),
    });
    line["durability"] = json!(
        "all three relay transient chunks in memory: converger writes no chunk to Postgres; \
         Redis pub/sub and NATS core keep nothing"
    );
    line["ratio_to_faster_peer"] = ratio;
    line["bus"] = json!(first_bus);
    line["buses"] = Value::Object(by_bus.iter().cloned().collect());
    line["ratio_to_faster_peer_by_bus"] = Value::Object(ratios_by_bus);
    line["client"] = json!(first_client.name());
    line["clients"] = Value::Object(clients);
    line["ratio_to_first_client"] = Value::Object(ratios);
    line["peers"] = json!({"redis": redis, "nats": nats});
    println!("{line}");
    Ok(())
}

async fn measure_converger(
    args: &StreamsArgs,
    client: tabs::Client,
    bus: &str,
    paced: Option<f64>,
) -> anyhow::Result<Value> {
    let binary = args.binary.clone().unwrap_or_else(default_binary);
    let env = [
        ("CONVERGER_BUS", bus.to_owned()),
        ("CONVERGER_NATS__SERVERS", args.nats_url.clone()),
        ("CONVERGER_LIMITS__MAX_FRAMES_PER_SEC", "1000000".to_owned()),
        (
            "CONVERGER_LIMITS__MAX_STREAMS_PER_CONNECTION",
            args.streams.to_string(),
        ),
        (
            "CONVERGER_LIMITS__MAX_STREAM_BYTES",
            converger_protocol::MAX_STREAM_BYTES_CEILING.to_string(),
        ),
        // The streams' budgets must hold every chunk of the run (they stay open throughout),
        // and the node refuses a per-stream limit above them.
        (
            "CONVERGER_LIMITS__MAX_STREAM_BYTES_PER_CHANNEL",
            STREAM_BUDGET_BYTES.to_string(),
        ),
        (
            "CONVERGER_LIMITS__MAX_STREAM_BYTES_PER_NODE",
            STREAM_BUDGET_BYTES.to_string(),
        ),
        ("CONVERGER_LIMITS__OUTBOUND_QUEUE_FRAMES", "8192".to_owned()),
        ("CONVERGER_GROUP_SETTLE_MS", "100".to_owned()),
    ];
    let first = Gateway::start(&binary, &args.database_url, &env).await?;
    let mut second = None;
    if args.nodes == 2 {
        let mut with_seed = env.to_vec();
        with_seed.push((
            "CONVERGER_SEEDS",
            first.gossip_addr.clone().unwrap_or_default(),
        ));
        let database = first.database_name().to_owned();
        second = Some(Gateway::start_on(&binary, &args.database_url, &database, &with_seed).await?);
    }
    // The NATS server's CPU is part of converger's cost on that bus (Postgres's is not counted
    // on either).
    let bus_processes = match bus {
        "nats" => pid_of("nats-server")
            .map(|pid| vec![("nats-server".to_owned(), pid)])
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    let nodes = (&first, second.as_ref());
    let outcome = converger_phases(args, client, paced, nodes, bus_processes).await;
    if let Some(second) = second {
        second.kill().await;
    }
    first.stop().await?;
    outcome
}

pub(crate) async fn connect(url: &str) -> anyhow::Result<Socket> {
    let (socket, _) = tokio::time::timeout(
        Duration::from_secs(10),
        tokio_tungstenite::connect_async_with_config(
            url,
            Some(converger_client::socket_config()),
            false,
        ),
    )
    .await
    .context("connect timed out")??;
    Ok(socket)
}

pub(crate) async fn hello(socket: &mut Socket, hello: Value) -> anyhow::Result<Value> {
    socket.send(Message::text(hello.to_string())).await?;
    loop {
        let Some(message) = socket.next().await else {
            bail!("closed before welcome");
        };
        if let Message::Text(text) = message? {
            let frame: Value = serde_json::from_str(text.as_str())?;
            if frame["type"] == "welcome" {
                return Ok(frame);
            }
            if frame["type"] == "error" {
                bail!("refused: {frame}");
            }
        }
    }
}

async fn converger_phases(
    args: &StreamsArgs,
    client: tabs::Client,
    paced: Option<f64>,
    (first, second): (&Gateway, Option<&Gateway>),
    bus_processes: Vec<(String, u32)>,
) -> anyhow::Result<Value> {
    let rest = RestClient::new(&first.base_url)?;
    let (channel, agent_token) =
        bench_channel(&rest, "streams", &TokenRequest::channel_scope()).await?;
    let mut agent = connect(&first.ws_url).await?;
    let welcome = hello(
        &mut agent,
        json!({"type": "hello", "protocol": "converger/1", "token": agent_token, "group": "bench"}),
    )
    .await?;
    let since = welcome["data"]["since"].as_i64().unwrap_or(0);
    let wait = since - chrono_now_ms() + 20;
    if wait > 0 {
        tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    }
    let clock = Clock::start();
    let tally = Arc::new(Tally::default());
    let mut tabs = JoinSet::new();
    let second_every = if args.second_tabs > 0.0 && second.is_some() {
        (1.0 / args.second_tabs).round().max(1.0) as usize
    } else {
        usize::MAX
    };
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()?;
    let mut seconds = Vec::new();
    for n in 0..args.streams {
        let user = rest
            .generate_token(&channel.secret, &TokenRequest::for_user(&format!("u{n}")))
            .await?;
        let created = rest.create_conversation(&user.token).await?;
        let conversation = created.conversation_id.to_string();
        let tab = tabs::open_first(client, first, &http, &conversation, &created.token).await?;
        tabs.spawn(tabs::read(tab, Place::SameNode, Arc::clone(&tally), clock));
        if second.is_some() && n % second_every == 0 {
            seconds.push((conversation, created.token));
        }
    }
    // The agent's turns: one per conversation.
    let mut turns: Vec<(String, i64)> = Vec::with_capacity(args.streams);
    let collect = async {
        while turns.len() < args.streams {
            let Some(message) = agent.next().await else {
                bail!("agent closed");
            };
            if let Message::Text(text) = message? {
                let envelope: Value = serde_json::from_str(text.as_str())?;
                if let Some(seq) = envelope["frame"]["meta"]["turn"]["seq"].as_i64() {
                    let conversation = envelope["conversationId"].as_str().unwrap_or_default();
                    turns.push((conversation.to_owned(), seq));
                }
            }
        }
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(120), collect)
        .await
        .context("the agent did not get every turn")??;
    // Second tabs once every turn exists (an SSE resume or connect follows a running turn).
    if let Some(second) = second {
        for (conversation, token) in &seconds {
            let tab = tabs::open_second(client, second, &http, conversation, token).await?;
            tabs.spawn(tabs::read(tab, Place::CrossNode, Arc::clone(&tally), clock));
        }
    }
    let (mut writer, mut reader) = agent.split();
    // Refusals would show up here; the reader keeps the socket drained.
    let refused = Arc::new(AtomicU64::new(0));
    let counting = Arc::clone(&refused);
    let drain = tokio::spawn(async move {
        while let Some(Ok(message)) = reader.next().await {
            if let Message::Text(text) = message
                && text.as_str().contains("\"type\":\"error\"")
            {
                counting.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    let rss_before = machine::rss_kib(first.pid()).unwrap_or(0);
    let mut indices = vec![0u64; args.streams];
    let mut phase_secs = [0.0; 2];
    let mut rss_open = 0;
    let mut rss_after_burst = 0;
    let mut buffered = 0u64;
    let mut phase_rate = 0.0;
    let mut processes = vec![
        ("bench_clients".to_owned(), std::process::id()),
        ("node_1".to_owned(), first.pid()),
    ];
    if let Some(second) = second {
        processes.push(("node_2".to_owned(), second.pid()));
    }
    processes.extend(bus_processes);
    let mut cpu = Value::Null;
    let mut paced_rate = 0.0;
    for phase in 0..2u8 {
        let meter = CpuMeter::start(processes.clone());
        let rate = match (phase, paced) {
            (0, _) => 0.0,
            (_, Some(paced)) => paced,
            _ if args.rate > 0.0 => args.rate,
            _ => phase_rate / 2.0,
        };
        if phase == 1 {
            paced_rate = rate;
        }
        let mut pacer = Pacer::new(rate, Duration::from_secs(args.duration));
        while let Some(stream) = pacer.next(args.streams).await {
            let (conversation, seq) = &turns[stream];
            let index = indices[stream];
            indices[stream] += 1;
            let mut frame = json!({"type": "streamChunk", "streamId": format!("s-{stream}"),
                "index": index, "text": chunk_text(phase + 1, clock.now_us(), args.chunk_bytes)});
            if index == 0 {
                frame["turn"] = json!({"seq": seq});
            }
            let envelope = json!({"conversationId": conversation, "frame": frame}).to_string();
            if pacer.flush_now() {
                writer.send(Message::text(envelope)).await?;
            } else {
                writer.feed(Message::text(envelope)).await?;
            }
        }
        writer.flush().await?;
        let sent = pacer.sent;
        // Delivered chunks are counted until the last one arrived (the settle's quiet 500 ms
        // excluded), so a relay that falls behind is not credited with its backlog.
        tally.settle().await;
        phase_secs[usize::from(phase)] = pacer.elapsed_secs() - 0.5;
        if phase == 0 {
            cpu = meter.per_chunk_us(tally.delivered_in(0));
            rss_after_burst = machine::rss_kib(first.pid()).unwrap_or(0);
            rss_open = settled_rss_kib(first.pid()).await;
            // Every chunk of an open stream is held until the stream ends.
            buffered = indices.iter().sum::<u64>() * args.chunk_bytes as u64;
            phase_rate = tally.figures(phase_secs)["chunks_per_sec"]
                .as_f64()
                .unwrap_or(0.0);
        }
        eprintln!("phase {}: {sent} chunks sent", phase + 1);
    }
    drain.abort();
    tabs.abort_all();
    let mut figures = tally.figures(phase_secs);
    figures["refused"] = json!(refused.load(Ordering::Relaxed));
    figures["settings_paced_rate"] = json!(paced_rate);
    figures["cpu_us_per_chunk_at_full_speed"] = cpu;
    figures["rss_kib"] = json!({"before": rss_before, "streams_open": rss_open,
        "right_after_the_burst": rss_after_burst});
    figures["buffered_bytes"] = json!(buffered);
    let per_stream = |rss: u64| {
        ((rss.saturating_sub(rss_before) * 1024) as f64 - buffered as f64).max(0.0)
            / args.streams as f64
    };
    figures["rss_per_stream_bytes_over_buffered"] = json!(per_stream(rss_open));
    figures["rss_per_stream_bytes_over_buffered_right_after_the_burst"] =
        json!(per_stream(rss_after_burst));
    figures["round_trip"] = json!(
        "agent streamChunk on node 1 → gateway registry → hub → tab socket (same node); → \
         the cluster bus (coalesced pg_notify, or packed NATS messages) → node 2 → tab \
         socket (cross node)"
    );
    Ok(figures)
}

/// The node's RSS once the allocator has returned what the burst freed: jemalloc purges freed
/// pages over its decay time (10 s by default), so RSS right after a burst still counts the
/// burst's drained queues. Measured after waiting out that decay time.
async fn settled_rss_kib(pid: u32) -> u64 {
    tokio::time::sleep(ALLOCATOR_DECAY + Duration::from_secs(2)).await;
    machine::rss_kib(pid).unwrap_or(0)
}

/// jemalloc's default `dirty_decay_ms`, which the node keeps.
const ALLOCATOR_DECAY: Duration = Duration::from_secs(10);

fn chrono_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_millis() as i64)
        .unwrap_or(0)
}

/// How many subscribers (tabs) the peers get: one per stream, plus the second tabs.
fn subscribers(args: &StreamsArgs) -> Vec<(usize, Place)> {
    let second_every = if args.second_tabs > 0.0 && args.nodes == 2 {
        (1.0 / args.second_tabs).round().max(1.0) as usize
    } else {
        usize::MAX
    };
    let mut all: Vec<(usize, Place)> = (0..args.streams).map(|n| (n, Place::SameNode)).collect();
    all.extend(
        (0..args.streams)
            .filter(|n| n % second_every == 0)
            .map(|n| (n, Place::CrossNode)),
    );
    all
}

async fn measure_redis(args: &StreamsArgs, paced: f64) -> anyhow::Result<Value> {
    use redis::AsyncCommands;
    let client = redis::Client::open(args.redis_url.as_str())?;
    let prefix = format!("converger-bench-streams:{}", std::process::id());
    let clock = Clock::start();
    let tally = Arc::new(Tally::default());
    let mut tasks = JoinSet::new();
    for (stream, place) in subscribers(args) {
        let mut pubsub = tokio::time::timeout(Duration::from_secs(5), client.get_async_pubsub())
            .await
            .context("redis connect timed out")??;
        pubsub.subscribe(format!("{prefix}:{stream}")).await?;
        let tally = Arc::clone(&tally);
        tasks.spawn(async move {
            let mut messages = pubsub.into_on_message();
            while let Some(message) = messages.next().await {
                if let Ok(text) = message.get_payload::<String>() {
                    tally.take(place, &text, &clock);
                }
            }
        });
    }
    let publisher = client.get_multiplexed_async_connection().await?;
    let mut phase_secs = [0.0; 2];
    let mut cpu = Value::Null;
    for phase in 0..2u8 {
        let meter = CpuMeter::start(peer_processes("redis-server"));
        let rate = if phase == 0 { 0.0 } else { paced };
        let mut pacer = Pacer::new(rate, Duration::from_secs(args.duration));
        // Publishes pipeline on the multiplexed connection: up to 256 in flight.
        let mut in_flight = futures_util::stream::FuturesUnordered::new();
        while let Some(stream) = pacer.next(args.streams).await {
            let mut connection = publisher.clone();
            let channel = format!("{prefix}:{stream}");
            let text = chunk_text(phase + 1, clock.now_us(), args.chunk_bytes);
            in_flight.push(async move {
                let _: redis::RedisResult<i64> = connection.publish(channel, text).await;
            });
            if in_flight.len() >= 256 {
                in_flight.next().await;
            }
        }
        while in_flight.next().await.is_some() {}
        tally.settle().await;
        phase_secs[usize::from(phase)] = pacer.elapsed_secs() - 0.5;
        if phase == 0 {
            cpu = meter.per_chunk_us(tally.delivered_in(0));
        }
    }
    tasks.abort_all();
    let mut figures = tally.figures(phase_secs);
    figures["cpu_us_per_chunk_at_full_speed"] = cpu;
    figures["round_trip"] =
        json!("PUBLISH (256 in flight) → Redis → one SUBSCRIBE connection per tab");
    Ok(figures)
}

async fn measure_nats(args: &StreamsArgs, paced: f64) -> anyhow::Result<Value> {
    let client = tokio::time::timeout(Duration::from_secs(5), async_nats::connect(&args.nats_url))
        .await
        .context("nats connect timed out")??;
    let prefix = format!("converger-bench-streams.{}", std::process::id());
    let clock = Clock::start();
    let tally = Arc::new(Tally::default());
    let mut tasks = JoinSet::new();
    let mut subscriber_clients = Vec::new();
    for (stream, place) in subscribers(args) {
        let subscriber_client = async_nats::connect(&args.nats_url).await?;
        let mut subscription = subscriber_client
            .subscribe(format!("{prefix}.{stream}"))
            .await?;
        subscriber_clients.push(subscriber_client);
        let tally = Arc::clone(&tally);
        tasks.spawn(async move {
            while let Some(message) = subscription.next().await {
                if let Ok(text) = std::str::from_utf8(&message.payload) {
                    tally.take(place, text, &clock);
                }
            }
        });
    }
    for subscriber_client in &subscriber_clients {
        subscriber_client.flush().await?;
    }
    let mut phase_secs = [0.0; 2];
    let mut cpu = Value::Null;
    for phase in 0..2u8 {
        let meter = CpuMeter::start(peer_processes("nats-server"));
        let rate = if phase == 0 { 0.0 } else { paced };
        let mut pacer = Pacer::new(rate, Duration::from_secs(args.duration));
        while let Some(stream) = pacer.next(args.streams).await {
            let subject = format!("{prefix}.{stream}");
            let text = chunk_text(phase + 1, clock.now_us(), args.chunk_bytes);
            client.publish(subject, text.into()).await?;
            if pacer.flush_now() {
                client.flush().await?;
            }
        }
        client.flush().await?;
        tally.settle().await;
        phase_secs[usize::from(phase)] = pacer.elapsed_secs() - 0.5;
        if phase == 0 {
            cpu = meter.per_chunk_us(tally.delivered_in(0));
        }
    }
    tasks.abort_all();
    let mut figures = tally.figures(phase_secs);
    figures["cpu_us_per_chunk_at_full_speed"] = cpu;
    figures["round_trip"] =
        json!("publish (flushed every 64, or each when paced) → NATS → one connection per tab");
    Ok(figures)
}
