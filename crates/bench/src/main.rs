//! `converger-bench`: measurements of converger that print their figures, the machine, and the
//! limit they compare against. Programs, never tests: they do not fail a build.
#![forbid(unsafe_code)]

mod cluster;
mod gateway;
mod idle;
mod machine;
mod stats;
mod turns;

use clap::{Parser, Subcommand};

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
    /// U users in closed loop, A agents answering: turns/s and latencies.
    Turns(turns::TurnsArgs),
    /// Three nodes: membership propagation and node-death takeover times.
    Cluster(cluster::ClusterArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Idle(args) => idle::run(args).await,
        Command::Turns(args) => turns::run(args).await,
        Command::Cluster(args) => cluster::run(args).await,
    }
}
