//! Test support: one fresh database per test on a real Postgres, and real gateway nodes on
//! ephemeral ports.
//!
//! The Postgres server is `CONVERGER_TEST_DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`); when nothing answers there, the embedded
//! cluster under `target/converger-test-postgres` is started (or reused) instead.
#![allow(dead_code)]

pub mod browser;
pub mod cluster;
pub mod load;
pub mod mekik;
pub mod nats;
pub mod proxy;
pub mod runtimes;
pub mod schemas;
pub mod tab;
pub mod ws;

// The history checker and the effects fixture live in converger-checker, which the soak program
// of converger-bench shares; the tests name them through the support module as before. Most test
// binaries use neither.
#[allow(unused_imports)]
pub use converger_checker::{effects, history};

use std::path::PathBuf;
use std::time::Duration;

use converger_client::{RestClient, TokenRequest};
use converger_embedded::{EmbeddedPostgres, Role};
use converger_gateway::server::Credentials;
use converger_gateway::{Config, Server, ServerHandle};
use converger_store::{Store, StoreOptions};
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tokio::sync::OnceCell;
use uuid::Uuid;

/// Default Postgres server of the test suite.
pub const DEFAULT_TEST_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

static SERVER_URL: OnceCell<String> = OnceCell::const_new();

/// The maintenance URL of the Postgres server the tests use.
pub async fn server_url() -> String {
    SERVER_URL
        .get_or_init(|| async {
            let configured = std::env::var("CONVERGER_TEST_DATABASE_URL")
                .unwrap_or_else(|_| DEFAULT_TEST_DATABASE_URL.to_owned());
            if answers(&configured).await {
                return configured;
            }
            eprintln!("nothing answers at {configured}; starting the embedded test cluster");
            let dir = workspace_root().join("target/converger-test-postgres");
            let embedded = EmbeddedPostgres::start(&dir, Role::Guest)
                .await
                .expect("embedded test cluster starts");
            embedded.url().to_owned()
        })
        .await
        .clone()
}

async fn answers(url: &str) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_secs(5), PgConnection::connect(url)).await,
        Ok(Ok(_))
    )
}

/// The repository root (where `Cargo.toml` of the workspace is).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `url` with its database name replaced.
pub fn with_database(url: &str, database: &str) -> String {
    let mut parsed = reqwest::Url::parse(url).expect("test database url parses");
    parsed.set_path(&format!("/{database}"));
    parsed.to_string()
}

/// A database created for one test and dropped when the value is dropped.
pub struct TestDb {
    /// Database name.
    pub name: String,
    /// Connection URL of this database.
    pub url: String,
    server_url: String,
}

impl TestDb {
    /// Creates an empty database (no migrations applied).
    pub async fn create_empty() -> TestDb {
        let server_url = server_url().await;
        let name = format!("converger_test_{}", Uuid::new_v4().simple());
        let mut admin = PgConnection::connect(&server_url)
            .await
            .expect("connect to the test server");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .expect("create test database");
        let url = with_database(&server_url, &name);
        TestDb {
            name,
            url,
            server_url,
        }
    }

    /// Creates a database with the schema applied.
    pub async fn create() -> TestDb {
        let db = TestDb::create_empty().await;
        let store = db.store().await;
        store.migrate().await.expect("migrations apply");
        store.pool().close().await;
        db
    }

    /// A store connected to this database.
    pub async fn store(&self) -> Store {
        self.store_for(true).await
    }

    /// A store whose committing statements notify, or not (a node on another bus than
    /// `postgres`).
    pub async fn store_for(&self, notify_in_commit: bool) -> Store {
        Store::connect(&StoreOptions {
            url: self.url.clone(),
            max_connections: 4,
            acquire_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(5),
            commit_workers: 2,
            notify_in_commit,
        })
        .await
        .expect("connect to the test database")
    }

    /// A single connection for assertions.
    pub async fn connect(&self) -> PgConnection {
        PgConnection::connect(&self.url)
            .await
            .expect("connect to the test database")
    }

    /// Runs a `SELECT count(*)`-style query returning one bigint.
    pub async fn count(&self, sql: &str) -> i64 {
        let mut connection = self.connect().await;
        sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&mut connection)
            .await
            .expect("count query")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Drop runs outside any async context we could borrow; a short-lived runtime on its own
        // thread drops the database (WITH (FORCE) ends leftover connections).
        let server_url = self.server_url.clone();
        let name = self.name.clone();
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async move {
                let mut admin = PgConnection::connect(&server_url).await?;
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                )))
                .execute(&mut admin)
                .await?;
                Ok::<_, sqlx::Error>(())
            })?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop test database {}", self.name);
        }
    }
}

/// Polls an observable condition until it holds; panics with `what` after `timeout`.
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if condition().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A tenant with a channel, and alice's conversation in it with its bound token.
pub async fn setup(node: &TestNode) -> (TenantFixture, Uuid, String) {
    let acme = node.tenant_with_channel("acme").await;
    let (conversation_id, token) = node.conversation(&acme, "alice").await;
    (acme, conversation_id, token)
}

/// The seqs of the persistent frames (those with a seq) among `frames`, in order.
pub fn seqs(frames: &[serde_json::Value]) -> Vec<i64> {
    frames
        .iter()
        .filter_map(|frame| frame["seq"].as_i64())
        .collect()
}

/// Waits until a group member's `since` (its welcome's) has passed, so it owns the turns that
/// follow: the server's own stated time, not a guess.
pub async fn settle(welcome: &serde_json::Value) {
    let since = welcome["data"]["since"].as_i64().unwrap();
    let wait = since - chrono::Utc::now().timestamp_millis() + 20;
    if wait > 0 {
        tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    }
}

/// The WebSocket endpoint of another node (`TestNode::start_peer`).
pub fn peer_ws_url(peer: &ServerHandle) -> String {
    format!("ws://{}/socket/converger/v1", peer.addr())
}

/// The test configuration: `config/test.toml` over the built-in defaults.
pub fn test_config() -> Config {
    let text = std::fs::read_to_string(workspace_root().join("config/test.toml"))
        .expect("config/test.toml");
    let config: Config = toml::from_str(&text).expect("config/test.toml parses");
    config.validate().expect("config/test.toml is valid");
    config
}

/// A gateway node on an ephemeral port over its own database.
pub struct TestNode {
    /// The running server.
    pub server: ServerHandle,
    /// Its database (dropped after the server).
    pub db: TestDb,
    /// A REST client for it.
    pub client: RestClient,
    /// Admin token of the node.
    pub admin_token: String,
    /// Raw HTTP client for requests the typed client cannot make.
    pub http: reqwest::Client,
}

impl TestNode {
    /// A node with the test configuration.
    pub async fn start() -> TestNode {
        TestNode::start_with(|_| {}).await
    }

    /// A node with the test configuration adjusted by `adjust`.
    pub async fn start_with(adjust: impl FnOnce(&mut Config)) -> TestNode {
        TestNode::start_on(TestDb::create().await, adjust).await
    }

    /// A node over an existing (migrated) database.
    pub async fn start_on(db: TestDb, adjust: impl FnOnce(&mut Config)) -> TestNode {
        let mut config = test_config();
        config.database_url = db.url.clone();
        adjust(&mut config);
        let credentials = Credentials {
            secret_key: config.secret_key.clone().into_bytes(),
            admin_token: config.admin_token.clone(),
        };
        let admin_token = config.admin_token.clone();
        let notify = config.bus.notifies_in_commit();
        let server = Server::bind(config, db.store_for(notify).await, credentials)
            .await
            .expect("bind")
            .spawn()
            .expect("serve");
        let client = RestClient::new(server.base_url()).expect("client");
        TestNode {
            server,
            db,
            client,
            admin_token,
            http: reqwest::Client::new(),
        }
    }

    /// Another node over the same database and secrets (a second gateway instance).
    pub async fn start_peer(&self) -> ServerHandle {
        self.start_peer_with(|_| {}).await
    }

    /// As [`TestNode::start_peer`], with the test configuration adjusted by `adjust`.
    pub async fn start_peer_with(&self, adjust: impl FnOnce(&mut Config)) -> ServerHandle {
        let mut config = test_config();
        config.database_url = self.db.url.clone();
        adjust(&mut config);
        let credentials = Credentials {
            secret_key: config.secret_key.clone().into_bytes(),
            admin_token: config.admin_token.clone(),
        };
        let notify = config.bus.notifies_in_commit();
        Server::bind(config, self.db.store_for(notify).await, credentials)
            .await
            .expect("bind")
            .spawn()
            .expect("serve")
    }

    /// The WebSocket endpoint with optional query string (`?token=…`).
    pub fn ws_url(&self, query: &str) -> String {
        format!("ws://{}/socket/converger/v1{query}", self.server.addr())
    }

    /// Absolute URL of a path on this node.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.server.base_url())
    }

    /// The node's `/metrics` page (no metrics token configured).
    pub async fn metrics(&self) -> String {
        self.http
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("/metrics body")
    }

    /// `GET …/conversations/{conversation}/activities{query}` with `token`: (status, body).
    pub async fn activities(
        &self,
        conversation: Uuid,
        token: &str,
        query: &str,
    ) -> (u16, serde_json::Value) {
        let response = self
            .http
            .get(self.url(&format!(
                "/api/v1/converger/conversations/{conversation}/activities{query}"
            )))
            .bearer_auth(token)
            .send()
            .await
            .expect("GET activities");
        let status = response.status().as_u16();
        (status, response.json().await.expect("a JSON page"))
    }

    /// A tenant with one channel: (api key, channel id, channel secret).
    pub async fn tenant_with_channel(&self, name: &str) -> TenantFixture {
        let tenant = self
            .client
            .create_tenant(&self.admin_token, name)
            .await
            .expect("create tenant");
        let channel = self
            .client
            .create_channel(&tenant.api_key, &format!("{name}-web"))
            .await
            .expect("create channel");
        TenantFixture {
            tenant_id: tenant.id,
            api_key: tenant.api_key,
            channel_id: channel.id,
            secret: channel.secret,
        }
    }

    /// A token of the fixture's channel, as `request` asks.
    pub async fn token(&self, fixture: &TenantFixture, request: &TokenRequest) -> String {
        self.client
            .generate_token(&fixture.secret, request)
            .await
            .expect("token")
            .token
    }

    /// A channel-scope (agent) token of the fixture's channel.
    pub async fn agent_token(&self, fixture: &TenantFixture) -> String {
        self.token(fixture, &TokenRequest::channel_scope()).await
    }

    /// An agent connection that said hello (in `group`, or as an observer): (client, welcome).
    pub async fn agent(
        &self,
        token: &str,
        group: Option<&str>,
    ) -> (ws::WsClient, serde_json::Value) {
        let mut client = ws::WsClient::connect(&self.ws_url("")).await;
        let extra = match group {
            Some(group) => serde_json::json!({"group": group}),
            None => serde_json::json!({}),
        };
        let welcome = client.hello(token, extra).await;
        (client, welcome)
    }

    /// A conversation of a user in the fixture's channel: (conversation id, bound token).
    pub async fn conversation(&self, fixture: &TenantFixture, user_id: &str) -> (Uuid, String) {
        let token = self.token(fixture, &TokenRequest::for_user(user_id)).await;
        let created = self
            .client
            .create_conversation(&token)
            .await
            .expect("conversation");
        (created.conversation_id, created.token)
    }
}

/// A tenant and its channel.
pub struct TenantFixture {
    /// Tenant id.
    pub tenant_id: Uuid,
    /// Tenant API key.
    pub api_key: String,
    /// Channel id.
    pub channel_id: Uuid,
    /// Channel secret.
    pub secret: String,
}

/// Path of the `converger` binary built by `cargo test --workspace` (the cli crate's own
/// integration tests make cargo build it before any test runs).
pub fn converger_bin() -> PathBuf {
    if let Ok(explicit) = std::env::var("CONVERGER_BIN") {
        return PathBuf::from(explicit);
    }
    let test_exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>/converger
    let profile_dir = test_exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target profile dir");
    let bin = profile_dir.join("converger");
    assert!(
        bin.exists(),
        "{} is missing: run `cargo test --workspace` or `cargo build -p converger-cli` first",
        bin.display()
    );
    bin
}

/// An agent's enveloped `streamChunk` of `stream`, answering turn `seq` (named at index 0).
pub fn stream_chunk(
    conversation: &str,
    stream: &str,
    index: u64,
    seq: i64,
    text: &str,
) -> serde_json::Value {
    let mut frame = serde_json::json!({"type": "streamChunk", "streamId": stream, "index": index,
                                       "text": text});
    if index == 0 {
        frame["turn"] = serde_json::json!({"seq": seq});
    }
    serde_json::json!({"conversationId": conversation, "frame": frame})
}

/// Sends chunks `indices` of stream "s-1" answering turn `seq`, each holding its own index as
/// text (`"<index> "`).
pub async fn send_numbered_chunks(
    agent: &mut ws::WsClient,
    conversation: &str,
    seq: i64,
    indices: std::ops::Range<u64>,
) {
    for index in indices {
        agent
            .send(stream_chunk(
                conversation,
                "s-1",
                index,
                seq,
                &format!("{index} "),
            ))
            .await;
    }
}

/// Streams chunks `indices` of `stream` (texts `w<index> `) answering turn `seq`, then waits
/// until the node took every one ([`wait_until_taken`]). Returns the text sent. The agent's
/// `limits.max_frames_per_sec` must allow the burst.
pub async fn stream_words(
    agent: &mut ws::WsClient,
    conversation: &str,
    stream: &str,
    seq: i64,
    indices: std::ops::Range<u64>,
) -> String {
    let mut text = String::new();
    let next = indices.end;
    for index in indices {
        let word = format!("w{index} ");
        agent
            .send(stream_chunk(conversation, stream, index, seq, &word))
            .await;
        text.push_str(&word);
    }
    wait_until_taken(agent, conversation, stream, seq, next).await;
    text
}

/// Waits until the node took the chunks of `stream` before index `next`: the first chunk sent
/// again is refused with the index the stream expects next, which the node tells only after
/// every chunk before it.
pub async fn wait_until_taken(
    agent: &mut ws::WsClient,
    conversation: &str,
    stream: &str,
    seq: i64,
    next: u64,
) {
    agent
        .send(stream_chunk(conversation, stream, 0, seq, "again"))
        .await;
    loop {
        let frame = agent.recv().await;
        if frame["frame"]["type"] != "error" {
            continue;
        }
        let details = &frame["frame"]["data"]["details"];
        assert_eq!(details["streamId"], stream, "{frame}");
        assert_eq!(details["expected"], next, "every chunk was taken: {frame}");
        return;
    }
}

/// The next delivered turn of an agent, past any other frame: (conversation id, seq, fence).
pub async fn next_turn(agent: &mut ws::WsClient) -> (String, i64, Option<i64>) {
    loop {
        let delivered = agent.recv().await;
        let turn = &delivered["frame"]["meta"]["turn"];
        if let Some(seq) = turn["seq"].as_i64() {
            let conversation = delivered["conversationId"].as_str().unwrap().to_owned();
            return (conversation, seq, turn["fence"].as_i64());
        }
    }
}

/// A node, alice's conversation and token, a settled agent (group `bot`) owning its turns, and
/// alice's first tab, which has sent "hi" and read its ack (the agent has the turn): (node,
/// conversation, token, agent, tab, the enveloped conversation id, the turn's seq).
pub async fn turn_in_progress(
    node: TestNode,
) -> (
    TestNode,
    Uuid,
    String,
    ws::WsClient,
    ws::WsClient,
    String,
    i64,
) {
    let (acme, conversation_id, token) = setup(&node).await;
    let agent_token = node.agent_token(&acme).await;
    let (mut agent, welcome) = node.agent(&agent_token, Some("bot")).await;
    settle(&welcome).await;
    let mut tab = ws::WsClient::connect(&node.ws_url("")).await;
    tab.hello(&token, serde_json::json!({})).await;
    tab.send(serde_json::json!({"type": "text", "clientId": "q-1", "data": {"text": "hi"}}))
        .await;
    tab.recv_type("ack").await;
    let (conversation, seq, _) = next_turn(&mut agent).await;
    (node, conversation_id, token, agent, tab, conversation, seq)
}

/// The `data.text` of each frame of an activities page (`""` for frames without one).
pub fn page_texts(page: &serde_json::Value) -> Vec<String> {
    page["activities"]
        .as_array()
        .expect("a page has activities")
        .iter()
        .map(|frame| {
            frame["data"]["text"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect()
}
