//! The `converger` binary as a process: admin commands against a real database, and `serve`
//! with the embedded database (start, survive a restart with its data, stop with the gateway).

mod support;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use converger_client::RestClient;
use serde_json::Value;
use support::{TestDb, TestNode, converger_bin, test_config};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

fn command() -> Command {
    let mut command = Command::new(converger_bin());
    for (key, _) in std::env::vars().filter(|(key, _)| key.starts_with("CONVERGER_")) {
        command.env_remove(key);
    }
    command
        .current_dir(support::workspace_root())
        .kill_on_drop(true);
    command
}

async fn admin_json(db: &TestDb, state_dir: &Path, args: &[&str]) -> Value {
    let mut admin = command();
    admin
        .env("CONVERGER_DATABASE_URL", &db.url)
        .env("CONVERGER_SECRET_KEY", test_config().secret_key);
    run_admin(admin, state_dir, args).await
}

/// An admin command on the embedded database of `state_dir` (no database URL): its JSON.
async fn embedded_admin_json(state_dir: &Path, args: &[&str]) -> Value {
    run_admin(command(), state_dir, args).await
}

async fn run_admin(mut admin: Command, state_dir: &Path, args: &[&str]) -> Value {
    let output = admin
        .args(args)
        .env("CONVERGER_STATE_DIR", state_dir)
        .output()
        .await
        .expect("converger runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|error| panic!("{args:?} printed no JSON ({error}): {stdout}"))
}

#[tokio::test]
async fn admin_commands_print_json_and_issue_working_tokens() {
    let db = TestDb::create().await;
    let state_dir = tempfile::tempdir().unwrap();
    let tenant = admin_json(&db, state_dir.path(), &["tenant", "create", "acme"]).await;
    let tenant_id = tenant["id"].as_str().unwrap().to_owned();
    assert!(tenant["apiKey"].as_str().unwrap().starts_with("cvg_key_"));
    let channel = admin_json(
        &db,
        state_dir.path(),
        &["channel", "create", "--tenant", &tenant_id, "web"],
    )
    .await;
    assert_eq!(channel["tenantId"].as_str(), Some(tenant_id.as_str()));
    let channel_id = channel["id"].as_str().unwrap().to_owned();
    let token = admin_json(
        &db,
        state_dir.path(),
        &["token", "issue", "--channel", &channel_id, "--user", "u-7"],
    )
    .await;
    assert!(token["expires_in"].as_i64().unwrap() > 0);
    let agent = admin_json(
        &db,
        state_dir.path(),
        &[
            "token",
            "issue",
            "--channel",
            &channel_id,
            "--scope",
            "channel",
        ],
    )
    .await;

    // A node sharing the secret key accepts the printed tokens and the printed API key.
    let node = TestNode::start_on(db, |_| {}).await;
    let created = node
        .client
        .create_conversation(token["token"].as_str().unwrap())
        .await
        .unwrap();
    assert_eq!(created.user_id, "u-7");
    let page = node
        .client
        .list_activities(
            agent["token"].as_str().unwrap(),
            created.conversation_id,
            0,
            10,
        )
        .await;
    assert!(page.unwrap().activities.is_empty());
    let channels = node
        .client
        .list_channels(tenant["apiKey"].as_str().unwrap())
        .await
        .unwrap();
    assert_eq!(channels.len(), 1);

    // The CLI applies the same rules as the REST endpoint.
    let conversation = created.conversation_id.to_string();
    let output = command()
        .args([
            "token",
            "issue",
            "--channel",
            &channel_id,
            "--scope",
            "channel",
            "--conversation",
            &conversation,
        ])
        .env("CONVERGER_DATABASE_URL", &node.db.url)
        .env("CONVERGER_SECRET_KEY", test_config().secret_key)
        .env("CONVERGER_STATE_DIR", state_dir.path())
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("bad_request"));
    assert!(output.stdout.is_empty(), "nothing printed on failure");

    // A second migrate is a no-op.
    let migrated = admin_json(&node.db, state_dir.path(), &["migrate"]).await;
    assert_eq!(migrated["applied"], serde_json::json!([]));
}

/// A `converger serve` process on the embedded database.
struct ServeProcess {
    child: Child,
    base_url: String,
}

async fn start_serve(state_dir: &Path) -> ServeProcess {
    let mut child = command()
        .arg("serve")
        .env("CONVERGER_STATE_DIR", state_dir)
        .env("CONVERGER_HTTP_ADDR", "127.0.0.1:0")
        .env("CONVERGER_LOG_FORMAT", "json")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("serve starts");
    let stderr = child.stderr.take().expect("stderr piped");
    let mut lines = BufReader::new(stderr).lines();
    // Everything serve printed before listening, so a failed start says why.
    let mut seen = Vec::new();
    let find_addr = async {
        while let Some(line) = lines.next_line().await.expect("read serve logs") {
            let entry = serde_json::from_str::<Value>(&line).ok();
            seen.push(line);
            let Some(entry) = entry else {
                continue;
            };
            if entry["fields"]["message"] == "converger listening" {
                return entry["fields"]["addr"].as_str().map(str::to_owned);
            }
        }
        None
    };
    // initdb on first start takes a few seconds on this machine.
    let addr = tokio::time::timeout(Duration::from_secs(120), find_addr)
        .await
        .expect("serve logs its address in time");
    let Some(addr) = addr else {
        let status = child.wait().await.expect("wait on serve");
        panic!(
            "serve exited ({status}) before logging its address; it printed:\n{}",
            seen.join("\n")
        );
    };
    // Keep draining the pipe so the process never blocks on a full stderr.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    ServeProcess {
        child,
        base_url: format!("http://{addr}"),
    }
}

async fn terminate(mut serve: ServeProcess) {
    let pid = serve.child.id().expect("serve still running").to_string();
    let status = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .expect("kill runs");
    assert!(status.success());
    let exit = tokio::time::timeout(Duration::from_secs(60), serve.child.wait())
        .await
        .expect("serve exits after SIGTERM")
        .expect("wait on serve");
    assert!(exit.success(), "serve exited with {exit}");
}

fn embedded_port(state_dir: &Path) -> u16 {
    let text = std::fs::read_to_string(state_dir.join("postgres/port")).expect("port file");
    text.trim().parse().expect("port number")
}

async fn accepts_connections(port: u16) -> bool {
    tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_ok()
}

/// Stops a leftover embedded cluster if the test fails halfway.
struct StopClusterOnDrop(std::path::PathBuf);

impl Drop for StopClusterOnDrop {
    fn drop(&mut self) {
        let dir = self.0.join("postgres");
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                use converger_embedded::{EmbeddedPostgres, Role};
                if let Ok(cluster) = EmbeddedPostgres::start(&dir, Role::Owner).await {
                    let _ = cluster.stop().await;
                }
            });
        })
        .join();
    }
}

#[tokio::test]
async fn serve_runs_the_embedded_database_keeps_its_data_and_stops_it() {
    // Under /tmp so the unprivileged server user can reach it when the tests run as root.
    let state = tempfile::Builder::new()
        .prefix("converger-serve-")
        .tempdir_in("/tmp")
        .unwrap();
    let _cleanup = StopClusterOnDrop(state.path().to_owned());

    let serve = start_serve(state.path()).await;
    let ready = reqwest::get(format!("{}/health/ready", serve.base_url))
        .await
        .unwrap();
    assert_eq!(ready.status(), reqwest::StatusCode::OK);
    let admin_token = std::fs::read_to_string(state.path().join("admin_token")).unwrap();
    let client = RestClient::new(&serve.base_url).unwrap();
    let tenant = client
        .create_tenant(admin_token.trim(), "acme")
        .await
        .unwrap();
    client.create_channel(&tenant.api_key, "web").await.unwrap();
    let port = embedded_port(state.path());
    assert!(accepts_connections(port).await);

    terminate(serve).await;
    assert!(
        !accepts_connections(port).await,
        "the embedded database stops with the gateway"
    );

    let serve = start_serve(state.path()).await;
    let client = RestClient::new(&serve.base_url).unwrap();
    let channels = client
        .list_channels(&tenant.api_key)
        .await
        .expect("the tenant survived the restart");
    assert_eq!(
        channels.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        vec!["web"]
    );
    let port = embedded_port(state.path());
    // An admin command beside a running serve uses its database and leaves it running.
    let beside = embedded_admin_json(state.path(), &["tenant", "create", "globex"]).await;
    assert!(beside["apiKey"].is_string(), "{beside}");
    assert!(accepts_connections(port).await);
    let still = reqwest::get(format!("{}/health/ready", serve.base_url))
        .await
        .unwrap();
    assert_eq!(still.status(), reqwest::StatusCode::OK);
    terminate(serve).await;
    assert!(
        !accepts_connections(port).await,
        "stopped again after the second run"
    );

    // Alone, an admin command starts the private database for itself and stops it on exit.
    let alone = embedded_admin_json(state.path(), &["tenant", "create", "initech"]).await;
    assert!(alone["apiKey"].is_string(), "{alone}");
    let port = embedded_port(state.path());
    assert!(
        !accepts_connections(port).await,
        "an admin command leaves no database running"
    );
}

#[tokio::test]
async fn http_agent_commands_keep_to_the_allowlist_and_never_print_the_secret() {
    let db = TestDb::create().await;
    let state_dir = tempfile::tempdir().unwrap();
    let tenant = admin_json(&db, state_dir.path(), &["tenant", "create", "acme"]).await;
    let tenant_id = tenant["id"].as_str().unwrap().to_owned();
    let channel = admin_json(
        &db,
        state_dir.path(),
        &["channel", "create", "--tenant", &tenant_id, "web"],
    )
    .await;
    let channel_id = channel["id"].as_str().unwrap().to_owned();
    let create = |url: &str| {
        let mut admin = command();
        admin
            .env("CONVERGER_DATABASE_URL", &db.url)
            .env("CONVERGER_SECRET_KEY", test_config().secret_key)
            .env("CONVERGER_STATE_DIR", state_dir.path())
            .env(
                "CONVERGER_HTTP_AGENTS__ALLOW",
                "https://agents.example/team",
            )
            .env("HTTP_AGENT_SECRET", "s3cret-value")
            .args([
                "http-agent",
                "create",
                "--channel",
                &channel_id,
                "--group",
                "team",
                "--url",
                url,
            ]);
        admin.output()
    };
    let refused = create("https://agents.example/other").await.unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("forbidden"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let created = create("https://agents.example/team/run").await.unwrap();
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let printed = String::from_utf8_lossy(&created.stdout);
    assert!(!printed.contains("s3cret-value"), "{printed}");
    let group: Value = serde_json::from_str(printed.trim()).unwrap();
    assert_eq!(group["hasSecret"], true);
    assert_eq!(group["url"], "https://agents.example/team/run");
    let listed = admin_json(
        &db,
        state_dir.path(),
        &["http-agent", "list", "--channel", &channel_id],
    )
    .await;
    assert_eq!(listed["httpAgents"].as_array().unwrap().len(), 1);
    let letters = admin_json(
        &db,
        state_dir.path(),
        &["http-agent", "dead-letters", "--channel", &channel_id],
    )
    .await;
    assert_eq!(letters["deadLetters"], serde_json::json!([]));
    let deleted = admin_json(
        &db,
        state_dir.path(),
        &[
            "http-agent",
            "delete",
            "--channel",
            &channel_id,
            "--group",
            "team",
        ],
    )
    .await;
    assert_eq!(deleted["deleted"], true);
}
