//! `converger`: run a gateway node, apply migrations, and administer tenants, channels and
//! tokens from the command line. Every admin command prints one JSON object.
#![forbid(unsafe_code)]

mod commands;
mod database;
mod descriptors;
mod load_config;
mod logging;
mod secrets;

// jemalloc gives memory back after a burst, chosen by measurement (ADR 0016).
#[cfg(feature = "jemalloc")]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Lets jemalloc purge freed pages from background threads: an idle node makes no allocator
/// calls, so without them the memory of a burst stays mapped until the next one.
fn purge_in_background() {
    #[cfg(feature = "jemalloc")]
    if let Err(error) = tikv_jemalloc_ctl::background_thread::write(true) {
        tracing::warn!(%error, "jemalloc background purging unavailable");
    }
}

/// How often the allocator's figures are read for `/metrics`.
#[cfg(feature = "jemalloc")]
const ALLOCATOR_REPORT_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Reports jemalloc's live and resident bytes as gauges, so that memory held by the node's data
/// can be told apart from memory the allocator keeps (fragmentation, pages not yet purged).
fn report_allocator() {
    #[cfg(feature = "jemalloc")]
    tokio::spawn(async {
        let mut every = tokio::time::interval(ALLOCATOR_REPORT_EVERY);
        loop {
            every.tick().await;
            if tikv_jemalloc_ctl::epoch::advance().is_err() {
                continue;
            }
            if let Ok(allocated) = tikv_jemalloc_ctl::stats::allocated::read() {
                metrics::gauge!("converger_allocator_allocated_bytes").set(allocated as f64);
            }
            if let Ok(resident) = tikv_jemalloc_ctl::stats::resident::read() {
                metrics::gauge!("converger_allocator_resident_bytes").set(resident as f64);
            }
        }
    });
}

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The converger gateway.
#[derive(Debug, Parser)]
#[command(
    name = "converger",
    version,
    about = "Clustered WebSocket gateway between end users and AI agents"
)]
struct Cli {
    /// Configuration file (default: config/default.toml when it exists).
    #[arg(long, global = true, env = "CONVERGER_CONFIG")]
    config: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a gateway node (applies pending migrations first unless migrate_on_start = false).
    Serve,
    /// Apply pending database migrations and exit.
    Migrate,
    /// Manage tenants.
    Tenant {
        #[command(subcommand)]
        command: TenantCommand,
    },
    /// Manage channels.
    Channel {
        #[command(subcommand)]
        command: ChannelCommand,
    },
    /// Issue tokens.
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
    /// Manage HTTP agent groups (agents behind a URL, docs/agents.md §17).
    HttpAgent {
        #[command(subcommand)]
        command: HttpAgentCommand,
    },
}

#[derive(Debug, Subcommand)]
enum HttpAgentCommand {
    /// Create a channel's HTTP agent group; prints it (never its secret).
    Create {
        /// Channel id.
        #[arg(long)]
        channel: uuid::Uuid,
        /// The group's name.
        #[arg(long)]
        group: String,
        /// Where each turn is posted (under the configured `http_agents.allow`).
        #[arg(long)]
        url: String,
        /// The HMAC-SHA256 key each call is signed with (or HTTP_AGENT_SECRET).
        #[arg(long, env = "HTTP_AGENT_SECRET", hide_env_values = true)]
        secret: Option<String>,
        /// A call's deadline.
        #[arg(long, default_value_t = 60_000)]
        timeout_ms: i32,
        /// Calls in flight at once, per node.
        #[arg(long, default_value_t = 16)]
        max_concurrency: i32,
        /// Calls of one turn before it fails.
        #[arg(long, default_value_t = 3)]
        retry_attempts: i32,
        /// The first wait between calls (doubled each time).
        #[arg(long, default_value_t = 500)]
        retry_backoff_ms: i32,
    },
    /// List a channel's HTTP agent groups.
    List {
        /// Channel id.
        #[arg(long)]
        channel: uuid::Uuid,
    },
    /// Delete a channel's HTTP agent group.
    Delete {
        /// Channel id.
        #[arg(long)]
        channel: uuid::Uuid,
        /// The group's name.
        #[arg(long)]
        group: String,
    },
    /// List a channel's dead letters (turns whose calls all failed), oldest first.
    DeadLetters {
        /// Channel id.
        #[arg(long)]
        channel: uuid::Uuid,
    },
}

#[derive(Debug, Subcommand)]
enum TenantCommand {
    /// Create a tenant; prints {id, name, apiKey}.
    Create {
        /// Display name.
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum ChannelCommand {
    /// Create a channel; prints {id, name, secret, status, tenantId}.
    Create {
        /// Owning tenant id.
        #[arg(long)]
        tenant: uuid::Uuid,
        /// Display name.
        name: String,
        /// What a send means while a turn is unanswered (default: the node's
        /// `turns.default_policy`).
        #[arg(long, value_parser = ["enqueue", "reject", "interrupt", "rollback"])]
        turn_policy: Option<String>,
        /// A policy a send may ask for instead (repeatable).
        #[arg(long = "allow-turn-policy", value_parser = ["enqueue", "reject", "interrupt", "rollback"])]
        allow_turn_policy: Vec<String>,
        /// `cancel`: the last end-user connection leaving cancels the running turn.
        #[arg(long, value_parser = ["continue", "cancel"])]
        on_disconnect: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
enum TokenCommand {
    /// Issue a token for a channel; prints {token, expires_in}.
    Issue {
        /// Channel id.
        #[arg(long)]
        channel: uuid::Uuid,
        /// Verified end-user id.
        #[arg(long)]
        user: Option<String>,
        /// Bind the token to one conversation.
        #[arg(long)]
        conversation: Option<uuid::Uuid>,
        /// `conversation` (default) or `channel`.
        #[arg(long, value_parser = ["conversation", "channel"])]
        scope: Option<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match load_config::load(cli.config.as_deref()) {
        Ok(config) => config,
        Err(message) => {
            eprintln!("converger: invalid configuration: {message}");
            return ExitCode::from(2);
        }
    };
    logging::init(config.log_format);
    purge_in_background();
    // Test builds only (feature `failpoints`): faults named in FAILPOINTS are switched on.
    converger_store::faults::setup_from_env();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("converger: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async move {
        match cli.command {
            Command::Serve => commands::serve(config).await,
            Command::Migrate => commands::migrate(config).await,
            Command::Tenant {
                command: TenantCommand::Create { name },
            } => commands::create_tenant(config, &name).await,
            Command::Channel {
                command:
                    ChannelCommand::Create {
                        tenant,
                        name,
                        turn_policy,
                        allow_turn_policy,
                        on_disconnect,
                    },
            } => {
                let settings = converger_store::TurnSettings {
                    turn_policy: turn_policy.map(Some),
                    turn_policy_overrides: Some(allow_turn_policy),
                    on_disconnect: on_disconnect.map(Some),
                };
                commands::create_channel(config, tenant, &name, settings).await
            }
            Command::Token {
                command:
                    TokenCommand::Issue {
                        channel,
                        user,
                        conversation,
                        scope,
                    },
            } => {
                let grant = converger_gateway::TokenGrant {
                    user_id: user,
                    scope,
                    conversation_id: conversation.map(|id| id.to_string()),
                };
                commands::issue_token(config, channel, grant).await
            }
            Command::HttpAgent { command } => match command {
                HttpAgentCommand::Create {
                    channel,
                    group,
                    url,
                    secret,
                    timeout_ms,
                    max_concurrency,
                    retry_attempts,
                    retry_backoff_ms,
                } => {
                    let settings = converger_store::HttpAgentSettings {
                        url,
                        secret,
                        timeout_ms,
                        max_concurrency,
                        retry_attempts,
                        retry_backoff_ms,
                    };
                    commands::create_http_agent(config, channel, &group, settings).await
                }
                HttpAgentCommand::List { channel } => {
                    commands::list_http_agents(config, channel).await
                }
                HttpAgentCommand::Delete { channel, group } => {
                    commands::delete_http_agent(config, channel, &group).await
                }
                HttpAgentCommand::DeadLetters { channel } => {
                    commands::dead_letters(config, channel).await
                }
            },
        }
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("converger: {error:#}");
            ExitCode::FAILURE
        }
    }
}
