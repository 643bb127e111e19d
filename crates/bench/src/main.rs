//! `converger-bench`: measurements of converger that print their figures, the machine, and the
//! limit they compare against. Programs, never tests: they do not fail a build, except `soak`,
//! whose verdict (the history checker's) fails CI on a breach.
#![forbid(unsafe_code)]

mod cluster;
mod flood;
mod frame_views;
mod gateway;
mod gateway_metrics;
mod half_load;
mod idle;
mod machine;
mod memory;
mod peers;
mod pipelined_agent;
mod plot;
mod soak;
mod stats;
mod streams;
mod turns;
mod usage;

use clap::{Parser, Subcommand};

// The load generator allocates per frame; jemalloc costs its clients less CPU than glibc's
// malloc, and the clients' CPU is part of what `peers` reports per turn.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Benchmarks of converger.
#[derive(Debug, Parser)]
#[command(name = "converger-bench", about = "Measure converger on this machine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// K idle conversation sessions: gateway RSS per connection.
    Idle(idle::IdleArgs),
    /// N conversations touched once each and left idle: the nodes' RSS against idle.
    Memory(memory::MemoryArgs),
    /// U users in closed loop (or paced with `--rate`), A agents answering: turns/s and latencies.
    Turns(turns::TurnsArgs),
    /// The latency goal in one run: the maximum turns/s, then p99 at half of it, paced.
    HalfLoad(half_load::HalfLoadArgs),
    /// What hostile clients cost honest ones: poisoned frames (ack latency without and with
    /// them) and slow-consumer floods (RSS before, during and after).
    Flood(flood::FloodArgs),
    /// Three nodes: membership propagation and node-death takeover times.
    Cluster(cluster::ClusterArgs),
    /// The `turns` round trip over Redis Streams and JetStream, converger's store alone, and the
    /// pgbench ceiling.
    Peers(peers::PeersArgs),
    /// Render docs/benchmarks.png from saved `peers` and `turns` JSON lines.
    Plot(plot::PlotArgs),
    /// Streamed answers to end users, same node and cross node, against Redis and NATS
    /// pub/sub relaying the same chunks.
    Streams(streams::StreamsArgs),
    /// Users and lease-mode agents over three nodes with random faults: the checker's verdict
    /// (exits non-zero on a breach).
    Soak(soak::SoakArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Idle(args) => idle::run(args).await,
        Command::Memory(args) => memory::run(args).await,
        Command::Turns(args) => turns::run(args).await,
        Command::HalfLoad(args) => half_load::run(args).await,
        Command::Flood(args) => flood::run(args).await,
        Command::Cluster(args) => cluster::run(args).await,
        Command::Peers(args) => peers::run(args).await,
        Command::Plot(args) => plot::run(args),
        Command::Soak(args) => soak::run(args).await,
        Command::Streams(args) => streams::run(args).await,
    }
}
