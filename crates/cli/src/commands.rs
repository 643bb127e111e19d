//! The subcommands.

use anyhow::Context;
use converger_embedded::Role;
use converger_gateway::tokens::TokenKeys;
use converger_gateway::{Config, Server, TokenGrant, issue_for_channel};
use converger_store::{HttpAgentSettings, Store, TurnSettings};
use serde_json::json;
use uuid::Uuid;

use crate::database::Database;

/// `converger serve`: migrate (unless disabled), bind, serve until SIGTERM or Ctrl-C.
pub async fn serve(mut config: Config) -> anyhow::Result<()> {
    if config.node_id.is_empty() {
        config.node_id = format!("node-{}", &Uuid::new_v4().simple().to_string()[..8]);
    }
    crate::descriptors::fit_connection_cap(&mut config);
    let database = Database::open(&config, Role::Owner).await?;
    let outcome = serve_with(config, &database).await;
    let closed = database.close().await;
    outcome.and(closed)
}

async fn serve_with(config: Config, database: &Database) -> anyhow::Result<()> {
    if config.migrate_on_start {
        let report = database
            .store
            .migrate()
            .await
            .context("applying migrations")?;
        tracing::info!(applied = ?report.applied, "migrations checked");
    }
    let credentials = crate::secrets::resolve(&config)?;
    let generated_admin = config.admin_token.is_empty();
    let node_id = config.node_id.clone();
    let server = Server::bind(config.clone(), database.store.clone(), credentials).await?;
    let addr = server.local_addr()?;
    if generated_admin {
        tracing::info!(
            path = %config.state_dir.join(crate::secrets::ADMIN_TOKEN_FILE).display(),
            "admin token not configured; using the generated one"
        );
    }
    tracing::info!(node_id = %node_id, %addr, "converger listening");
    crate::report_allocator();
    server.run(shutdown_signal()).await?;
    tracing::info!("converger stopped");
    Ok(())
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = match signal(SignalKind::terminate()) {
        Ok(stream) => stream,
        Err(error) => {
            tracing::warn!(%error, "cannot listen for SIGTERM; Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = terminate.recv() => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
}

/// `converger migrate`.
pub async fn migrate(config: Config) -> anyhow::Result<()> {
    let database = Database::open(&config, Role::Guest).await?;
    let outcome = database
        .store
        .migrate()
        .await
        .context("applying migrations");
    database.close().await?;
    let report = outcome?;
    print_json(&json!({"applied": report.applied}));
    Ok(())
}

/// `converger tenant create NAME`.
pub async fn create_tenant(config: Config, name: &str) -> anyhow::Result<()> {
    let name = name.to_owned();
    with_store(&config, |store| async move {
        let (tenant, api_key) = store.create_tenant(&name).await?;
        Ok(json!({"id": tenant.id, "name": tenant.name, "apiKey": api_key}))
    })
    .await
}

/// `converger channel create --tenant ID NAME [--turn-policy P] [--allow-turn-policy P]…
/// [--on-disconnect B]` (the names are checked by the argument parser).
pub async fn create_channel(
    config: Config,
    tenant: Uuid,
    name: &str,
    settings: TurnSettings,
) -> anyhow::Result<()> {
    let name = name.to_owned();
    with_store(&config, |store| async move {
        let (channel, secret) = store.create_channel(tenant, &name, &settings).await?;
        Ok(json!({
            "id": channel.id, "tenantId": channel.tenant_id, "name": channel.name,
            "secret": secret, "status": channel.status, "turnPolicy": channel.turn_policy,
            "turnPolicyOverrides": channel.turn_policy_overrides,
            "onDisconnect": channel.on_disconnect.as_deref().unwrap_or("continue"),
        }))
    })
    .await
}

/// `converger token issue --channel ID [--user U] [--conversation C] [--scope S]`: the same
/// rules as `POST /api/v1/converger/tokens/generate`.
pub async fn issue_token(
    config: Config,
    channel_id: Uuid,
    grant: TokenGrant,
) -> anyhow::Result<()> {
    let credentials = crate::secrets::resolve(&config)?;
    let keys = TokenKeys::new(&credentials.secret_key, config.token_ttl_secs)
        .context("invalid secret_key")?;
    with_store(&config, |store| async move {
        let channel = store
            .channel(channel_id)
            .await?
            .context("channel not found")?;
        anyhow::ensure!(channel.is_active(), "channel is inactive");
        let token = issue_for_channel(&store, &keys, &channel, grant)
            .await
            .map_err(|error| anyhow::anyhow!("{}: {}", error.code, error.message))?;
        Ok(json!({"token": token, "expires_in": keys.ttl_secs()}))
    })
    .await
}

/// `converger http-agent create --channel ID --group G --url U [--secret S] …`: the checks of
/// `POST /api/v1/channels/{id}/http-agents`, the allowlist of this configuration included.
pub async fn create_http_agent(
    config: Config,
    channel_id: Uuid,
    group: &str,
    settings: HttpAgentSettings,
) -> anyhow::Result<()> {
    let refused = |error: converger_gateway::error::ApiError| {
        anyhow::anyhow!("{}: {}", error.code, error.message)
    };
    converger_gateway::check_group_name(group).map_err(refused)?;
    converger_gateway::check_http_agent(&config.http_agents, &settings).map_err(refused)?;
    let group = group.to_owned();
    with_store(&config, |store| async move {
        store
            .channel(channel_id)
            .await?
            .context("channel not found")?;
        let agent = store
            .create_http_agent(channel_id, &group, &settings)
            .await?
            .context("the channel already has an HTTP agent group of that name")?;
        Ok(converger_gateway::group_json(&agent))
    })
    .await
}

/// `converger http-agent list --channel ID`.
pub async fn list_http_agents(config: Config, channel_id: Uuid) -> anyhow::Result<()> {
    with_store(&config, |store| async move {
        let agents = store.http_agents(Some(channel_id)).await?;
        let views: Vec<_> = agents.iter().map(converger_gateway::group_json).collect();
        Ok(json!({"httpAgents": views}))
    })
    .await
}

/// `converger http-agent delete --channel ID --group G`.
pub async fn delete_http_agent(
    config: Config,
    channel_id: Uuid,
    group: &str,
) -> anyhow::Result<()> {
    let group = group.to_owned();
    with_store(&config, |store| async move {
        let deleted = store.delete_http_agent(channel_id, &group).await?;
        anyhow::ensure!(deleted, "no such HTTP agent group");
        Ok(json!({"deleted": true}))
    })
    .await
}

/// `converger http-agent dead-letters --channel ID` (the first 1,000).
pub async fn dead_letters(config: Config, channel_id: Uuid) -> anyhow::Result<()> {
    with_store(&config, |store| async move {
        let letters = store.dead_letters(channel_id, 1_000).await?;
        let views: Vec<_> = letters
            .iter()
            .map(converger_gateway::dead_letter_json)
            .collect();
        Ok(json!({"deadLetters": views}))
    })
    .await
}

/// Opens the database as a guest (stops the embedded cluster at the end only when it started it
/// and no `serve` took it over), runs one admin action, closes, and prints the action's JSON.
async fn with_store<F, Fut>(config: &Config, action: F) -> anyhow::Result<()>
where
    F: FnOnce(Store) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<serde_json::Value>>,
{
    let database = Database::open(config, Role::Guest).await?;
    // Admin commands work on a fresh database too.
    let outcome = match database
        .store
        .migrate()
        .await
        .context("applying migrations")
    {
        Ok(_) => action(database.store.clone()).await,
        Err(error) => Err(error),
    };
    database.close().await?;
    print_json(&outcome?);
    Ok(())
}

fn print_json(value: &serde_json::Value) {
    println!("{value}");
}
