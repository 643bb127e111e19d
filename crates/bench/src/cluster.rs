//! `cluster --trials N --deaths D`: three `converger serve` processes over one database with real
//! gossip on 127.0.0.1.
//! - membership propagation: an agent joins a group on one node → its member is listed by both
//!   other nodes (`GET /api/v1/admin/cluster`, polled every millisecond), N trials;
//! - node-death takeover: a turn owned by a member on a node that is killed with SIGKILL → the
//!   same turn delivered to a member on a survivor, D trials (a fresh node each time).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use converger_client::agent::Agent;
use converger_client::{RestClient, TokenRequest};
use converger_core::groups::GroupView;
use serde_json::{Value, json};

use crate::gateway::{
    ADMIN_TOKEN, DEFAULT_DATABASE_URL, Gateway, bench_channel, create_database, default_binary,
};
use crate::machine;
use crate::stats::percentiles;

/// Arguments of `cluster`.
#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    /// Membership propagation trials.
    #[arg(long, default_value_t = 200)]
    trials: usize,
    /// Node-death takeover trials.
    #[arg(long, default_value_t = 20)]
    deaths: usize,
    /// Gossip interval of the nodes, in ms.
    #[arg(long, default_value_t = 100)]
    gossip_interval_ms: u64,
    /// Group settle delay of the nodes, in ms (the limit propagation must stay under).
    #[arg(long, default_value_t = 1000)]
    settle_ms: u64,
    /// Postgres server to create the benchmark database on.
    #[arg(long, default_value = DEFAULT_DATABASE_URL)]
    database_url: String,
    /// The `converger` binary (default: next to this one).
    #[arg(long)]
    binary: Option<PathBuf>,
}

/// Runs both measurements and prints a table and one JSON line.
pub async fn run(args: ClusterArgs) -> anyhow::Result<()> {
    let binary = args.binary.clone().unwrap_or_else(default_binary);
    let database = create_database(&args.database_url).await?;
    let env = |name: &str, seeds: &[String]| {
        vec![
            ("CONVERGER_NODE_ID", name.to_owned()),
            ("CONVERGER_SEEDS", seeds.join(",")),
            (
                "CONVERGER_GOSSIP__INTERVAL_MS",
                args.gossip_interval_ms.to_string(),
            ),
            ("CONVERGER_GROUP_SETTLE_MS", args.settle_ms.to_string()),
        ]
    };
    let a = Gateway::start_on(&binary, &args.database_url, &database, &env("a", &[])).await?;
    let seeds = [a
        .gossip_addr
        .clone()
        .context("node a logged no gossip address")?];
    let b = Gateway::start_on(&binary, &args.database_url, &database, &env("b", &seeds)).await?;
    let c = Gateway::start_on(&binary, &args.database_url, &database, &env("c", &seeds)).await?;
    let outcome = async {
        let nodes = [&a, &b, &c];
        for node in nodes {
            wait_for(node, |view| live_nodes(view) >= 3).await?;
        }
        let rest = RestClient::new(&a.base_url)?;
        let (channel, agent_token) =
            bench_channel(&rest, "cluster", &TokenRequest::channel_scope()).await?;
        let propagation = propagation(&nodes, &agent_token, args.trials).await?;
        let deaths = takeover(
            &args,
            &binary,
            &database,
            &a,
            &b,
            &channel.secret,
            &agent_token,
        )
        .await?;
        Ok::<_, anyhow::Error>((propagation, deaths))
    }
    .await;
    b.kill().await;
    c.kill().await;
    a.stop().await?;
    let (mut propagation, mut deaths) = outcome?;
    let joined = percentiles(&mut propagation.joined);
    let left = percentiles(&mut propagation.left);
    let takeover = percentiles(&mut deaths);
    println!(
        "converger cluster (3 nodes on 127.0.0.1, gossip every {} ms)",
        args.gossip_interval_ms
    );
    println!("{:<44} {:>9} {:>9} {:>9}", "", "p50 ms", "p99 ms", "max ms");
    for (name, figures) in [
        ("member joined → listed by both other nodes", &joined),
        ("member left → gone from both other nodes", &left),
        ("kill -9 → first redelivered turn", &takeover),
    ] {
        println!(
            "{name:<44} {:>9.1} {:>9.1} {:>9.1}",
            figures["p50"].as_f64().unwrap_or(0.0),
            figures["p99"].as_f64().unwrap_or(0.0),
            figures["max"].as_f64().unwrap_or(0.0)
        );
    }
    println!(
        "limit: the group settle delay ({} ms) must exceed propagation, or a new member may get a turn twice",
        args.settle_ms
    );
    let report = json!({
        "bench": "cluster",
        "machine": machine::describe(),
        "nodes": 3,
        "gossip_interval_ms": args.gossip_interval_ms,
        "phi_threshold": 8.0,
        "settle_ms": args.settle_ms,
        "propagation_trials": args.trials,
        "member_joined_ms": joined,
        "member_left_ms": left,
        "takeover_trials": args.deaths,
        "takeover_after_kill_ms": takeover,
    });
    println!("{report}");
    Ok(())
}

struct Propagation {
    joined: Vec<f64>,
    left: Vec<f64>,
}

/// Joins a member on each node in turn and times until both others list it, then leaves.
async fn propagation(
    nodes: &[&Gateway; 3],
    agent_token: &str,
    trials: usize,
) -> anyhow::Result<Propagation> {
    let mut figures = Propagation {
        joined: Vec::new(),
        left: Vec::new(),
    };
    for trial in 0..trials {
        let home = nodes[trial % 3];
        let others: Vec<&Gateway> = nodes
            .iter()
            .copied()
            .filter(|node| node.base_url != home.base_url)
            .collect();
        let agent = Agent::connect(&home.ws_url, agent_token, Some("bench")).await?;
        let started = Instant::now();
        let connection = agent.welcome()["connectionId"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        for node in &others {
            wait_for(node, |view| lists(view, &connection)).await?;
        }
        figures
            .joined
            .push(started.elapsed().as_secs_f64() * 1000.0);
        drop(agent);
        let started = Instant::now();
        for node in &others {
            wait_for(node, |view| !lists(view, &connection)).await?;
        }
        figures.left.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(figures)
}

/// Kills a fresh node whose member owns a waiting turn, and times until a member on a survivor
/// receives that turn.
async fn takeover(
    args: &ClusterArgs,
    binary: &PathBuf,
    database: &str,
    a: &Gateway,
    b: &Gateway,
    channel_secret: &str,
    agent_token: &str,
) -> anyhow::Result<Vec<f64>> {
    let rest = RestClient::new(&b.base_url)?;
    let mut survivor = Agent::connect(&a.ws_url, agent_token, Some("death")).await?;
    let survivor_welcome = survivor.welcome().clone();
    let seeds = [a
        .gossip_addr
        .clone()
        .context("node a logged no gossip address")?];
    let mut figures = Vec::new();
    for trial in 0..args.deaths {
        let env = vec![
            ("CONVERGER_NODE_ID", format!("doomed-{trial}")),
            ("CONVERGER_SEEDS", seeds.join(",")),
            (
                "CONVERGER_GOSSIP__INTERVAL_MS",
                args.gossip_interval_ms.to_string(),
            ),
            ("CONVERGER_GROUP_SETTLE_MS", args.settle_ms.to_string()),
        ];
        let doomed = Gateway::start_on(binary, &args.database_url, database, &env).await?;
        let mut victim = Agent::connect(&doomed.ws_url, agent_token, Some("death")).await?;
        let victim_welcome = victim.welcome().clone();
        let victim_id = victim_welcome["connectionId"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let survivor_id = survivor_welcome["connectionId"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        wait_for(a, |view| lists(view, &victim_id)).await?;
        wait_for(&doomed, |view| lists(view, &survivor_id)).await?;
        let since = victim_welcome["since"].as_i64().unwrap_or_default();
        let wait = since - now_ms() + 20;
        if wait > 0 {
            tokio::time::sleep(Duration::from_millis(wait as u64)).await;
        }
        let mut view = GroupView::new();
        for welcome in [&victim_welcome, &survivor_welcome] {
            view.join(
                welcome["connectionId"].as_str().unwrap_or_default(),
                welcome["since"].as_i64().unwrap_or_default(),
            );
        }
        // A conversation the victim owns, by the rule every node applies.
        let (conversation_token, conversation_id) = loop {
            let token = rest
                .generate_token(channel_secret, &TokenRequest::default())
                .await?
                .token;
            let created = rest.create_conversation(&token).await?;
            let id = created.conversation_id.to_string();
            if view.owner(&id, now_ms()) == Some(victim_id.as_str()) {
                break (created.token, created.conversation_id);
            }
        };
        let frame = json!({"type": "text", "data": {"text": "who answers?"}});
        let posted = rest
            .post_activity(&conversation_token, conversation_id, &frame, None)
            .await?;
        let turn = tokio::time::timeout(Duration::from_secs(10), victim.next_turn())
            .await
            .context("the victim got no turn")??;
        if turn.seq != posted.seq {
            bail!("the victim got seq {} instead of {}", turn.seq, posted.seq);
        }
        let killed = Instant::now();
        drop(victim);
        doomed.kill().await;
        let taken = loop {
            let turn = tokio::time::timeout(Duration::from_secs(30), survivor.next_turn())
                .await
                .context("the survivor got no turn")??;
            if turn.conversation_id == conversation_id && turn.seq == posted.seq {
                break turn;
            }
        };
        figures.push(killed.elapsed().as_secs_f64() * 1000.0);
        let frames = vec![json!({"type": "text", "data": {"text": "taken over"}})];
        survivor.reply(&taken, frames, None).await?;
        wait_for(a, |view| !lists(view, &victim_id)).await?;
    }
    Ok(figures)
}

/// Wall-clock milliseconds since the Unix epoch (the clock `since` is stated in).
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_millis() as i64)
        .unwrap_or_default()
}

/// How many nodes a cluster view (`GET /api/v1/admin/cluster`) shows live, itself included.
pub(crate) fn live_nodes(view: &Value) -> usize {
    view["nodes"]
        .as_array()
        .map(|nodes| {
            nodes
                .iter()
                .filter(|node| node["status"] == "self" || node["status"] == "live")
                .count()
        })
        .unwrap_or(0)
}

fn lists(view: &Value, connection_id: &str) -> bool {
    view["members"].as_array().is_some_and(|members| {
        members
            .iter()
            .any(|member| member["connectionId"] == connection_id)
    })
}

/// Polls a node's cluster view every millisecond until `condition` holds (10 s at most).
async fn wait_for(node: &Gateway, condition: impl Fn(&Value) -> bool) -> anyhow::Result<()> {
    let client = http_client();
    let url = format!("{}/api/v1/admin/cluster", node.base_url);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let view: Value = client
            .get(&url)
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        if condition(&view) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{} never reached the expected cluster view: {view}",
                node.base_url
            );
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// One pooled (keep-alive) client for every poll.
fn http_client() -> &'static reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT.get_or_init(reqwest::Client::new)
}
