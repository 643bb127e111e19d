//! Postgres failover under load: a primary and a synchronous standby (real server processes on
//! loopback, from the machine's PostgreSQL binaries), two nodes on the multi-host URL, end users
//! and agents on both. The primary is killed with SIGKILL and the standby promoted; the nodes
//! find the new primary by themselves. Afterwards every acked frame is stored exactly once, no
//! turn has two results, every user saw its conversation in order, a send during the outage
//! was refused as `unavailable` on a socket that stayed open (and over REST with 503 and
//! `Retry-After`), and readiness went 503 and back,
//! as it does for a primary fenced read-only.

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use converger_client::{RestClient, TokenRequest};
use converger_embedded::{EmbeddedError, PairMember, ReplicatedPair};
use serde_json::{Value, json};
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use support::cluster::{NodeProcess, eventually, wait_for_live_nodes};
use support::effects::Effects;
use support::load::{Endpoints, Running, answers_and_completed, channel, stored_sends, unanswered};
use support::ws::WsClient;
use uuid::Uuid;

/// Polls `/health/ready` of `base_url` until `stop`, recording every status in order.
async fn watch_readiness(
    base_url: String,
    statuses: Arc<Mutex<Vec<u16>>>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    while !*stop.borrow() {
        if let Ok(response) = http.get(format!("{base_url}/health/ready")).send().await {
            statuses.lock().unwrap().push(response.status().as_u16());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A connected end user of a new conversation on `node`: (socket, conversation, token).
async fn probe_user(node: &NodeProcess, secret: &str) -> (WsClient, Uuid, String) {
    let rest = RestClient::new(&node.base_url).unwrap();
    let token = rest
        .generate_token(secret, &TokenRequest::for_user("probe"))
        .await
        .unwrap();
    let created = rest.create_conversation(&token.token).await.unwrap();
    let mut client = WsClient::connect(&node.ws_url()).await;
    client.hello(&created.token, json!({})).await;
    (client, created.conversation_id, created.token)
}

fn text(client_id: &str) -> Value {
    json!({"type": "text", "clientId": client_id, "data": {"text": "during the failover"}})
}

/// The answer to the probe's send of `client_id`: its `ack` or its `error`.
async fn answer_to(client: &mut WsClient, client_id: &str) -> Value {
    loop {
        let frame = client
            .poll_event(Duration::from_secs(30))
            .await
            .expect("an answer in time")
            .expect("the socket stays open");
        let ack = frame["type"] == "ack" && frame["clientId"] == client_id;
        let error = frame["type"] == "error" && frame["data"]["clientId"] == client_id;
        if ack || error {
            return frame;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_under_load_and_its_promoted_standby_lose_no_acked_frame() {
    let dir = tempfile::tempdir().expect("pair directory");
    let mut pair = match ReplicatedPair::start(&dir.path().join("pair")).await {
        Ok(pair) => pair,
        Err(EmbeddedError::BinariesNotFound) => {
            eprintln!(
                "skipped: no PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup) on this machine"
            );
            return;
        }
        Err(error) => panic!("the primary and its standby start: {error}"),
    };
    let mut admin = PgConnection::connect(&pair.member_url(PairMember::Primary, "postgres"))
        .await
        .unwrap();
    sqlx::query("CREATE DATABASE converger")
        .execute(&mut admin)
        .await
        .unwrap();
    drop(admin);
    let url = pair.url_for("converger");
    let a = NodeProcess::start(&url, "a", &[]).await;
    let b = NodeProcess::start(&url, "b", std::slice::from_ref(&a.gossip_addr)).await;
    wait_for_live_nodes(&[&a, &b], &["a", "b"]).await;

    let channel = channel(&a).await;
    let effects = Effects::start().await.expect("the effects fixture starts");
    let endpoints: Endpoints = Arc::new(Mutex::new(vec![a.ws_url(), b.ws_url()]));
    let mut running = Running::start(&a, &channel, &endpoints, &effects.url, (2, 4)).await;
    let (mut probe, probe_conversation, probe_token) = probe_user(&b, &channel.secret).await;
    let readiness = Arc::new(Mutex::new(Vec::new()));
    let (stop_watch, watch_stopped) = tokio::sync::watch::channel(false);
    let watcher = tokio::spawn(watch_readiness(
        a.base_url.clone(),
        readiness.clone(),
        watch_stopped,
    ));
    eventually("load is flowing", Duration::from_secs(30), || async {
        running.acked() >= 20
    })
    .await;

    // A primary fenced read-only (as pg_auto_failover fences a promoted standby) is not
    // writable: readiness says so, and says when it is writable again.
    let fence = |setting: &'static str| {
        let url = pair.member_url(PairMember::Primary, "postgres");
        async move {
            let mut primary = PgConnection::connect(&url).await.unwrap();
            sqlx::query(setting).execute(&mut primary).await.unwrap();
            sqlx::query("SELECT pg_reload_conf()")
                .execute(&mut primary)
                .await
                .unwrap();
        }
    };
    fence("ALTER SYSTEM SET default_transaction_read_only = on").await;
    eventually(
        "readiness answers 503 on a read-only primary",
        Duration::from_secs(30),
        || async { readiness.lock().unwrap().contains(&503) },
    )
    .await;
    fence("ALTER SYSTEM RESET default_transaction_read_only").await;
    eventually(
        "readiness answers 200 once it is writable again",
        Duration::from_secs(30),
        || async { readiness.lock().unwrap().last() == Some(&200) },
    )
    .await;
    readiness.lock().unwrap().clear();

    pair.kill_primary().await.unwrap();
    let at_kill = running.acked();
    eventually(
        "readiness answers 503 without a primary",
        Duration::from_secs(30),
        || async { readiness.lock().unwrap().contains(&503) },
    )
    .await;
    // No primary: a send is refused as retryable, and the socket stays open.
    probe.send(text("during-1")).await;
    let refused = answer_to(&mut probe, "during-1").await;
    assert_eq!(refused["type"], "error", "{refused}");
    assert_eq!(refused["data"]["code"], "unavailable", "{refused}");
    assert_eq!(refused["data"]["retryable"], true, "{refused}");
    assert!(
        refused["data"]["retryAfterMs"].as_u64().is_some(),
        "{refused}"
    );

    // And over REST: 503 with a Retry-After.
    let over_rest = reqwest::Client::new()
        .post(format!(
            "{}/api/v1/converger/conversations/{probe_conversation}/activities",
            b.base_url
        ))
        .bearer_auth(&probe_token)
        .json(&json!({"type": "text", "data": {"text": "over REST"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(over_rest.status(), 503);
    assert!(over_rest.headers().contains_key("retry-after"));
    let body: Value = over_rest.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unavailable", "{body}");

    pair.promote_standby().await.unwrap();
    eventually(
        "load goes on on the new primary",
        Duration::from_secs(60),
        || async { running.acked() >= at_kill + 20 },
    )
    .await;
    // The refused send, sent again with its client id once its node writes again, commits
    // once.
    let http = reqwest::Client::new();
    eventually(
        "the probe's node is ready again",
        Duration::from_secs(30),
        || async {
            http.get(format!("{}/health/ready", b.base_url))
                .send()
                .await
                .is_ok_and(|response| response.status() == 200)
        },
    )
    .await;
    probe.send(text("during-1")).await;
    let acked = answer_to(&mut probe, "during-1").await;
    assert_eq!(acked["type"], "ack", "{acked}");
    eventually(
        "readiness is back to 200",
        Duration::from_secs(30),
        || async {
            let statuses = readiness.lock().unwrap();
            let outage = statuses.iter().position(|status| *status == 503);
            outage.is_some_and(|at| statuses[at..].contains(&200))
        },
    )
    .await;
    stop_watch.send(true).unwrap();
    watcher.await.unwrap();

    running.stop_users().await;
    let mut new_primary = PgConnection::connect(&pair.member_url(PairMember::Primary, "converger"))
        .await
        .unwrap();
    let acked = running.history.acked_sends();
    let stored = stored_sends(&mut new_primary, Some(probe_conversation)).await;
    let verdict = running.history.verdict(&stored);
    println!(
        "failover: {verdict:?}; {at_kill} acked before the kill, {} after",
        acked.len() - at_kill
    );
    assert!(verdict.holds(), "{verdict:?}");
    let answered = tokio::time::timeout(Duration::from_secs(60), async {
        while unanswered(&mut new_primary, &acked).await > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        answered.is_ok(),
        "{} acked turns never answered",
        unanswered(&mut new_primary, &acked).await
    );
    running.stop_agents().await;
    let probe_sends: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM activities WHERE conversation_id = $1 AND client_id = 'during-1'",
    )
    .bind(probe_conversation)
    .fetch_one(&mut new_primary)
    .await
    .unwrap();
    assert_eq!(probe_sends, 1, "the refused send is stored once");
    let (answers, completed) = answers_and_completed(&mut new_primary).await;
    assert_eq!(answers, completed, "one stored answer per completed turn");
    drop(new_primary);
    drop((a, b));
    pair.stop().await.unwrap();
}
