//! The status page at `GET /`: admin token required, then nodes, channels with their groups and
//! members, and this node's figures, server-rendered. Checked over HTTP and in headless Chromium
//! (Debian's `chromium`, installed by `.ci/test-prerequisites`), whose screenshot is kept in
//! `target/test-artifacts/status-page.png`.

mod support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use converger_client::TokenRequest;
use serde_json::json;
use support::TestNode;
use support::ws::WsClient;

/// Flags that keep headless Chromium off the network and quiet on this machine.
const CHROMIUM_FLAGS: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,900",
];

fn chromium() -> PathBuf {
    let path =
        PathBuf::from(std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into()));
    assert!(
        path.exists(),
        "{} is missing: install Debian's chromium package (`apt-get install chromium`; .ci/test-prerequisites does)",
        path.display()
    );
    path
}

/// Runs headless Chromium on `url` with `extra` flags; returns its stdout.
async fn run_chromium(url: &str, extra: &[String]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let output = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(chromium())
            .args(CHROMIUM_FLAGS)
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(extra)
            .arg(url)
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("chromium finishes in time")
    .expect("chromium runs");
    assert!(
        output.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test]
async fn the_status_page_needs_the_admin_token_and_shows_the_cluster() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let agent_token = node
        .client
        .generate_token(&acme.secret, &TokenRequest::channel_scope())
        .await
        .unwrap()
        .token;
    let mut member = WsClient::connect(&node.ws_url("")).await;
    let welcome = member
        .hello(&agent_token, json!({"group": "support-bots"}))
        .await;
    let connection_id = welcome["data"]["connectionId"].as_str().unwrap().to_owned();
    let no_redirects = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();

    // Without the token: 401 and a form asking for it; a wrong token is refused the same way.
    let refused = no_redirects.get(node.url("/")).send().await.unwrap();
    assert_eq!(refused.status(), 401);
    assert!(refused.text().await.unwrap().contains("name=\"token\""));
    let wrong = no_redirects
        .get(node.url("/?token=not-the-token"))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);

    // The token in the query becomes an HttpOnly cookie, then the page renders from it.
    let login = no_redirects
        .get(node.url(&format!("/?token={}", node.admin_token)))
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), 303);
    let cookie = login.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"));
    let page = no_redirects
        .get(node.url("/"))
        .header("cookie", cookie.split(';').next().unwrap())
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    assert!(
        page.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    let html = page.text().await.unwrap();
    for expected in [
        node.server.state().hub.node_id(),
        "acme-web",
        "support-bots",
        connection_id.as_str(),
        "http-equiv=\"refresh\"",
    ] {
        assert!(html.contains(expected), "the page shows {expected}");
    }
    // A bearer header works as well (curl).
    let with_bearer = reqwest::Client::new()
        .get(node.url("/"))
        .bearer_auth(&node.admin_token)
        .send()
        .await
        .unwrap();
    assert_eq!(with_bearer.status(), 200);

    // In a real browser: the query token logs in, the redirect keeps the cookie, and the DOM
    // holds the cluster; the screenshot is kept for people to look at.
    let login_url = node.url(&format!("/?token={}", node.admin_token));
    let dom = run_chromium(&login_url, &["--dump-dom".to_owned()]).await;
    assert!(
        dom.contains("<table id=\"nodes\">"),
        "nodes table rendered: {dom}"
    );
    assert!(dom.contains("support-bots") && dom.contains(&connection_id));
    assert!(
        dom.contains("class=\"self\""),
        "this node is marked as self"
    );
    let artifacts = support::workspace_root().join("target/test-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let screenshot = artifacts.join("status-page.png");
    let _ = std::fs::remove_file(&screenshot);
    run_chromium(
        &login_url,
        &[format!("--screenshot={}", screenshot.display())],
    )
    .await;
    let png = std::fs::read(&screenshot).expect("chromium wrote the screenshot");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "a real picture"
    );
    member.close().await;
}
