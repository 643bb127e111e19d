//! Starting a `converger serve` process on a fresh database for a measurement.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// Default Postgres server of measurements (the same as the test suite's).
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
/// Admin token the measured gateway is started with.
pub const ADMIN_TOKEN: &str = "bench-admin-token-0123456789";
const SECRET_KEY: &str = "bench-secret-key-0123456789abcdef0123456789";

/// A running gateway process and the database created for it.
pub struct Gateway {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base_url: String,
    /// `ws://127.0.0.1:PORT/socket/converger/v1`.
    pub ws_url: String,
    server_url: String,
    database: String,
    /// The gossip address it logged.
    pub gossip_addr: Option<String>,
}

/// The `converger` binary next to this one (build both with `--release`).
pub fn default_binary() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("converger")))
        .unwrap_or_else(|| PathBuf::from("converger"))
}

impl Gateway {
    /// Creates a database on `server_url` and starts `binary serve` on it with `env` added.
    pub async fn start(
        binary: &PathBuf,
        server_url: &str,
        env: &[(&str, String)],
    ) -> anyhow::Result<Gateway> {
        let database = create_database(server_url).await?;
        Gateway::start_on(binary, server_url, &database, env).await
    }

    /// Starts `binary serve` on an existing database of `server_url` (another node of a
    /// cluster), with `env` added.
    pub async fn start_on(
        binary: &PathBuf,
        server_url: &str,
        database: &str,
        env: &[(&str, String)],
    ) -> anyhow::Result<Gateway> {
        Gateway::start_logged(binary, server_url, database, env, None).await
    }

    /// Like [`Gateway::start_on`], and appends every line the node logs to `log_file`.
    pub async fn start_logged(
        binary: &PathBuf,
        server_url: &str,
        database: &str,
        env: &[(&str, String)],
        log_file: Option<PathBuf>,
    ) -> anyhow::Result<Gateway> {
        let database = database.to_owned();
        let url = database_url(server_url, &database);
        let mut command = Command::new(binary);
        command
            .arg("serve")
            .env("CONVERGER_DATABASE_URL", &url)
            .env("CONVERGER_HTTP_ADDR", "127.0.0.1:0")
            .env("CONVERGER_LOG_FORMAT", "json")
            .env("CONVERGER_SECRET_KEY", SECRET_KEY)
            .env("CONVERGER_ADMIN_TOKEN", ADMIN_TOKEN)
            // `turns` reads `/metrics` without a token.
            .env_remove("CONVERGER_METRICS_TOKEN")
            .env("CONVERGER_GOSSIP_ADDR", "127.0.0.1:0")
            // Every benchmark client comes from one address and opens users by the thousand:
            // the node's connection caps and creation rates are lifted (the data path is what
            // is measured).
            .env("CONVERGER_HTTP__MAX_CONNECTIONS", "0")
            .env("CONVERGER_HTTP__MAX_CONNECTIONS_PER_ADDRESS", "0")
            .env("CONVERGER_RATES__CONVERSATIONS_PER_MINUTE_PER_CHANNEL", "0")
            .env("CONVERGER_RATES__CONVERSATIONS_PER_MINUTE_PER_TENANT", "0")
            .env("CONVERGER_RATES__TOKENS_PER_MINUTE_PER_CHANNEL", "0")
            .env("CONVERGER_RATES__TOKENS_PER_MINUTE_PER_TENANT", "0")
            .env(
                "CONVERGER_STATE_DIR",
                std::env::temp_dir().join(format!("{database}-{}", uuid::Uuid::new_v4().simple())),
            )
            .env(
                "RUST_LOG",
                std::env::var("BENCH_NODE_RUST_LOG")
                    .unwrap_or_else(|_| "warn,converger=info,converger_gateway=info".into()),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("start {}", binary.display()))?;
        let stderr = child.stderr.take().context("stderr")?;
        let mut lines = BufReader::new(stderr).lines();
        let mut gossip_addr = None;
        let addr = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await? {
                let Ok(entry) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                let fields = &entry["fields"];
                if fields["message"] == "gossip started" {
                    gossip_addr = fields["gossip_addr"].as_str().map(str::to_owned);
                }
                if fields["message"] == "converger listening" {
                    return Ok(fields["addr"].as_str().map(str::to_owned));
                }
            }
            Ok::<_, std::io::Error>(None)
        })
        .await
        .context("the gateway did not start in time")??;
        let Some(addr) = addr else {
            bail!("the gateway exited before listening")
        };
        // BENCH_NODE_LOGS=1 echoes the node's logs (a run that fails tells why).
        let echo = std::env::var_os("BENCH_NODE_LOGS").is_some();
        let mut kept = match log_file {
            Some(path) => Some(
                tokio::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .await
                    .with_context(|| format!("open {}", path.display()))?,
            ),
            None => None,
        };
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if echo {
                    eprintln!("{line}");
                }
                if let Some(file) = kept.as_mut()
                    && file
                        .write_all(format!("{line}\n").as_bytes())
                        .await
                        .is_err()
                {
                    kept = None;
                }
            }
        });
        Ok(Gateway {
            child,
            base_url: format!("http://{addr}"),
            ws_url: format!("ws://{addr}/socket/converger/v1"),
            server_url: server_url.to_owned(),
            database,
            gossip_addr,
        })
    }

    /// Kills the process (SIGKILL) and keeps the database for the other nodes.
    pub async fn kill(mut self) {
        let _ = self.child.kill().await;
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id().unwrap_or(0)
    }

    /// The database created for this node (other nodes of a cluster start on it).
    pub fn database_name(&self) -> &str {
        &self.database
    }

    /// Stops the process and drops its database (and with it every other node's).
    pub async fn stop(mut self) -> anyhow::Result<()> {
        let _ = self.child.kill().await;
        drop_database(&self.server_url, &self.database).await
    }
}

/// The URL of `database` on the server of `server_url` (a URL naming any database).
pub fn database_url(server_url: &str, database: &str) -> String {
    let base = server_url
        .rsplit_once('/')
        .map(|(base, _)| base)
        .unwrap_or_default();
    format!("{base}/{database}")
}

/// Drops a benchmark database, ending the connections still open to it.
pub async fn drop_database(server_url: &str, database: &str) -> anyhow::Result<()> {
    let drop = async {
        let mut admin = PgConnection::connect(server_url).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {database} WITH (FORCE)"
        )))
        .execute(&mut admin)
        .await?;
        Ok::<_, sqlx::Error>(())
    };
    tokio::time::timeout(Duration::from_secs(30), drop)
        .await
        .context("dropping the benchmark database timed out")??;
    Ok(())
}

/// Creates a fresh benchmark database on `server_url`; returns its name.
pub async fn create_database(server_url: &str) -> anyhow::Result<String> {
    let database = format!("converger_bench_{}", uuid::Uuid::new_v4().simple());
    let mut admin = PgConnection::connect(server_url)
        .await
        .context("connect to the benchmark database server")?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&mut admin)
        .await?;
    Ok(database)
}

/// A tenant with one channel named `name` on the gateway `rest` speaks to, and a token of the
/// kind `request` asks for: what every measurement sets up first.
pub async fn bench_channel(
    rest: &converger_client::RestClient,
    name: &str,
    request: &converger_client::TokenRequest,
) -> anyhow::Result<(converger_client::CreatedChannel, String)> {
    let tenant = rest.create_tenant(ADMIN_TOKEN, "bench").await?;
    let channel = rest.create_channel(&tenant.api_key, name).await?;
    let token = rest.generate_token(&channel.secret, request).await?.token;
    Ok((channel, token))
}

/// The Postgres server of the bench's own tests, as the workspace's tests choose it:
/// `CONVERGER_TEST_DATABASE_URL` (default [`DEFAULT_DATABASE_URL`]), or, when nothing answers
/// there, the embedded cluster under `target/converger-test-postgres`, started or reused.
#[cfg(test)]
pub async fn test_server_url() -> String {
    let configured = std::env::var("CONVERGER_TEST_DATABASE_URL")
        .unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned());
    let answers = matches!(
        tokio::time::timeout(Duration::from_secs(5), PgConnection::connect(&configured)).await,
        Ok(Ok(_))
    );
    if answers {
        return configured;
    }
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/converger-test-postgres");
    let embedded =
        converger_embedded::EmbeddedPostgres::start(&dir, converger_embedded::Role::Guest)
            .await
            .expect("the embedded test cluster starts");
    embedded.url().to_owned()
}
