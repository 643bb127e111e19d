//! The fault injector: every `fault_every_ms` (jittered between half and one and a half
//! times), one fault drawn from a seeded RNG, so a seed replays the same sequence of fault
//! kinds, targets and pauses (what the load does meanwhile still depends on timing).

use std::time::Duration;

use anyhow::Context;
use rand::RngExt;
use rand::rngs::StdRng;
use serde_json::{Value, json};
use sqlx::Connection;
use sqlx::postgres::PgConnection;
use tokio::time::Instant;

use converger_embedded::{PairMember, ReplicatedPair};

use super::load::{Agents, Counters, Load};
use super::nats::NatsCluster;
use super::nodes::Cluster;

/// Longest a database call of the injector may take.
const DB_TIMEOUT: Duration = Duration::from_secs(5);

/// The kinds of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Abort an agent's task (its socket goes without a close frame) and start a new agent.
    KillAgent,
    /// SIGKILL a node, wait, start it again on the same ports.
    KillNode,
    /// `pg_terminate_backend` some or all of the soak database's backends, LISTEN ones too.
    TerminateBackends,
    /// Cut one or all live client connections of a node's proxy (no close frame).
    DropSockets,
    /// `--bus nats`: SIGKILL a NATS server, wait, start it again on the same ports.
    KillNats,
    /// `--bus nats`: cut every node connection through one NATS server's proxy.
    CutNats,
}

const FAULTS: [Fault; 4] = [
    Fault::KillAgent,
    Fault::KillNode,
    Fault::TerminateBackends,
    Fault::DropSockets,
];

/// The faults of a soak on the NATS bus.
const FAULTS_WITH_NATS: [Fault; 6] = [
    Fault::KillAgent,
    Fault::KillNode,
    Fault::TerminateBackends,
    Fault::DropSockets,
    Fault::KillNats,
    Fault::CutNats,
];

/// How often and how hard.
pub struct FaultPlan {
    /// Mean pause between faults.
    pub every: Duration,
    /// A killed node stays down between half of this and all of it.
    pub node_down: Duration,
    /// Postgres failovers, when the soak runs on a primary and a standby.
    pub failover: Option<FailoverPlan>,
}

/// A failover: kill -9 the primary, promote the standby after `promote_after` (what failure
/// detection takes in a real deployment), rebuild the old primary as the new standby.
pub struct FailoverPlan {
    /// Time between failovers.
    pub every: Duration,
    /// From the primary's death to the standby's promotion.
    pub promote_after: Duration,
}

/// What one failover cost the users.
#[derive(Debug, Clone, Copy)]
pub struct FailoverFigures {
    /// From the primary's death to the first turn acked after the promotion.
    pub to_first_ack: Duration,
    /// Sends the users saw refused as `unavailable` from the kill to the first ack.
    pub refused_unavailable: u64,
}

/// Faults injected, by kind, and what they hit.
#[derive(Debug, Clone, Default)]
pub struct FaultCounts {
    /// Agents killed (and replaced).
    pub agents_killed: u64,
    /// Nodes killed with SIGKILL (and restarted).
    pub nodes_killed: u64,
    /// Times backends were terminated.
    pub backend_terminations: u64,
    /// Backends terminated in all.
    pub backends_terminated: u64,
    /// Of them, `LISTEN` backends (the nodes' event bus).
    pub listen_backends_terminated: u64,
    /// Times sockets were cut.
    pub socket_drops: u64,
    /// Client connections cut in all.
    pub sockets_dropped: u64,
    /// NATS servers killed (and restarted).
    pub nats_killed: u64,
    /// Times the nodes' connections to a NATS server were cut.
    pub nats_cuts: u64,
    /// Postgres failovers, in order.
    pub failovers: Vec<FailoverFigures>,
    /// Faults that could not be carried out (logged).
    pub failed: u64,
}

impl FaultCounts {
    /// Faults injected, all kinds.
    pub fn total(&self) -> u64 {
        self.agents_killed
            + self.nodes_killed
            + self.backend_terminations
            + self.socket_drops
            + self.nats_killed
            + self.nats_cuts
            + self.failovers.len() as u64
    }

    /// The counts as JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "total": self.total(),
            "kill_agent": self.agents_killed,
            "kill_node": self.nodes_killed,
            "terminate_backends": self.backend_terminations,
            "backends_terminated": self.backends_terminated,
            "listen_backends_terminated": self.listen_backends_terminated,
            "drop_sockets": self.socket_drops,
            "sockets_dropped": self.sockets_dropped,
            "kill_nats": self.nats_killed,
            "cut_nats": self.nats_cuts,
            "failovers": self.failovers.len(),
            "failover_to_first_ack_ms": self
                .failovers
                .iter()
                .map(|failover| failover.to_first_ack.as_millis() as u64)
                .collect::<Vec<_>>(),
            "failover_refused_unavailable": self
                .failovers
                .iter()
                .map(|failover| failover.refused_unavailable)
                .collect::<Vec<_>>(),
            "failed": self.failed,
        })
    }
}

/// Injects faults until `until`. A node killed here is running again when this returns; an
/// error means the cluster could not be brought back (a node failed to restart).
pub async fn inject(
    cluster: &mut Cluster,
    agents: &mut Agents,
    (mut pair, mut nats): (Option<&mut ReplicatedPair>, Option<&mut NatsCluster>),
    load: &Load,
    plan: &FaultPlan,
    rng: &mut StdRng,
    until: Instant,
) -> anyhow::Result<FaultCounts> {
    let mut counts = FaultCounts::default();
    let every_ms = plan.every.as_millis().max(1) as u64;
    let mut next_failover = plan
        .failover
        .as_ref()
        .map(|failover| Instant::now() + failover.every);
    // Drawn ahead, so a failover due first leaves the sequence of other faults as the seed
    // gives it.
    let mut next_fault = Instant::now() + pause_between(every_ms, rng);
    loop {
        let failover_first = next_failover.filter(|due| *due < next_fault);
        let wake = failover_first.unwrap_or(next_fault);
        if wake >= until {
            return Ok(counts);
        }
        tokio::time::sleep_until(wake).await;
        if let (Some(_), Some(failover), Some(pair)) =
            (failover_first, &plan.failover, pair.as_deref_mut())
        {
            let figures = fail_over(cluster, pair, load, failover).await?;
            counts.failovers.push(figures);
            next_failover = Some(Instant::now() + failover.every);
            next_fault = next_fault.max(Instant::now());
            continue;
        }
        next_fault = Instant::now() + pause_between(every_ms, rng);
        let kinds: &[Fault] = match nats {
            Some(_) => &FAULTS_WITH_NATS,
            None => &FAULTS,
        };
        let fault = kinds[rng.random_range(0..kinds.len())];
        match fault {
            Fault::KillAgent => {
                if agents.len() == 0 {
                    continue;
                }
                let slot = rng.random_range(0..agents.len());
                tracing::info!(fault = "kill_agent", slot, "killing an agent");
                agents.replace(slot);
                counts.agents_killed += 1;
            }
            Fault::KillNats => {
                let Some(nats) = nats.as_deref_mut() else {
                    continue;
                };
                let index = rng.random_range(0..nats.len());
                let node_down_ms = plan.node_down.as_millis().max(2) as u64;
                let down = Duration::from_millis(
                    node_down_ms / 2 + rng.random_range(0..=node_down_ms / 2),
                );
                tracing::info!(
                    fault = "kill_nats",
                    server = index,
                    down_ms = down.as_millis() as u64,
                    "kill -9 a NATS server"
                );
                nats.kill(index).await;
                counts.nats_killed += 1;
                tokio::time::sleep(down).await;
                nats.restart(index)
                    .await
                    .with_context(|| format!("restart NATS server {index}"))?;
            }
            Fault::CutNats => {
                let Some(nats) = nats.as_deref_mut() else {
                    continue;
                };
                let index = rng.random_range(0..nats.len());
                let cut = nats.cut(index);
                tracing::info!(
                    fault = "cut_nats",
                    server = index,
                    cut,
                    "NATS connections cut"
                );
                counts.nats_cuts += 1;
            }
            Fault::KillNode => {
                let index = rng.random_range(0..cluster.len());
                let node_down_ms = plan.node_down.as_millis().max(2) as u64;
                let down = Duration::from_millis(
                    node_down_ms / 2 + rng.random_range(0..=node_down_ms / 2),
                );
                tracing::info!(fault = "kill_node", node = %cluster.name(index), down_ms = down.as_millis() as u64, "kill -9");
                cluster.kill(index).await?;
                counts.nodes_killed += 1;
                tokio::time::sleep(down).await;
                cluster
                    .restart(index)
                    .await
                    .with_context(|| format!("restart node {}", cluster.name(index)))?;
                tracing::info!(node = %cluster.name(index), "node restarted");
            }
            Fault::TerminateBackends => {
                let all = rng.random_bool(0.3);
                let pick = rng.random::<u64>();
                match terminate_backends(&cluster.database_url(), cluster.database(), all, pick)
                    .await
                {
                    Ok((terminated, listening)) => {
                        tracing::info!(
                            fault = "terminate_backends",
                            all,
                            terminated,
                            listening,
                            "backends terminated"
                        );
                        counts.backend_terminations += 1;
                        counts.backends_terminated += terminated;
                        counts.listen_backends_terminated += listening;
                    }
                    Err(error) => {
                        tracing::warn!(fault = "terminate_backends", %error, "fault failed");
                        counts.failed += 1;
                    }
                }
            }
            Fault::DropSockets => {
                let everywhere = rng.random_bool(0.2);
                let all = rng.random_bool(0.3);
                let pick = rng.random_range(0..usize::MAX);
                let chosen = rng.random_range(0..cluster.len());
                let nodes: Vec<usize> = if everywhere {
                    (0..cluster.len()).collect()
                } else {
                    vec![chosen]
                };
                let mut dropped = 0u64;
                for index in nodes {
                    let proxy = cluster.proxy(index);
                    if all {
                        dropped += proxy.cut_all() as u64;
                    } else if proxy.cut_one(pick) {
                        dropped += 1;
                    }
                }
                tracing::info!(
                    fault = "drop_sockets",
                    everywhere,
                    all,
                    dropped,
                    "sockets cut"
                );
                counts.socket_drops += 1;
                counts.sockets_dropped += dropped;
            }
        }
    }
}

/// A pause drawn between half and one and a half times `every_ms`.
fn pause_between(every_ms: u64, rng: &mut StdRng) -> Duration {
    Duration::from_millis(every_ms / 2 + rng.random_range(0..=every_ms))
}

/// Kills the primary, promotes the standby after the plan's delay, points the checker at it,
/// waits for the first ack after the promotion, then rebuilds the old primary as the standby.
async fn fail_over(
    cluster: &mut Cluster,
    pair: &mut ReplicatedPair,
    load: &Load,
    plan: &FailoverPlan,
) -> anyhow::Result<FailoverFigures> {
    let refused_before = Counters::get(&load.counters.unavailable_refusals);
    tracing::info!(
        fault = "failover",
        port = pair.port(PairMember::Primary),
        "kill -9 the primary"
    );
    pair.kill_primary().await?;
    let killed = Instant::now();
    tokio::time::sleep(plan.promote_after).await;
    pair.promote_standby().await?;
    cluster.set_server_url(pair.member_url(PairMember::Primary, "postgres"));
    let acked_at_promotion = Counters::get(&load.counters.turns_acked);
    let first_ack = async {
        while Counters::get(&load.counters.turns_acked) == acked_at_promotion {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), first_ack)
        .await
        .context("no turn acked within 60 s of the promotion")?;
    let to_first_ack = killed.elapsed();
    let refused_unavailable = Counters::get(&load.counters.unavailable_refusals) - refused_before;
    tracing::info!(
        fault = "failover",
        to_first_ack_ms = to_first_ack.as_millis() as u64,
        refused_unavailable,
        "the new primary acks"
    );
    pair.rebuild_standby().await?;
    Ok(FailoverFigures {
        to_first_ack,
        refused_unavailable,
    })
}

/// Terminates the backends of `database` other than our own: all of them, or each with even
/// odds as drawn from `pick`'s bits (at least one). Returns (terminated, of which LISTEN).
async fn terminate_backends(
    url: &str,
    database: &str,
    all: bool,
    pick: u64,
) -> anyhow::Result<(u64, u64)> {
    let work = async {
        let mut connection = PgConnection::connect(url).await?;
        let backends: Vec<(i32, bool)> = sqlx::query_as(
            "SELECT pid, coalesce(query ILIKE 'LISTEN%', false) FROM pg_stat_activity \
             WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(database)
        .fetch_all(&mut connection)
        .await?;
        let chosen: Vec<(i32, bool)> = if all {
            backends
        } else {
            let mut some: Vec<(i32, bool)> = backends
                .iter()
                .enumerate()
                .filter(|(n, _)| pick.rotate_right(*n as u32) & 1 == 1)
                .map(|(_, backend)| *backend)
                .collect();
            if some.is_empty()
                && let Some(first) = backends.get(pick as usize % backends.len().max(1))
            {
                some.push(*first);
            }
            some
        };
        let pids: Vec<i32> = chosen.iter().map(|(pid, _)| *pid).collect();
        // Only the chosen pids reach pg_terminate_backend: never another database's backend.
        let terminated: Vec<i32> = sqlx::query_scalar(
            "SELECT pid FROM unnest($1::int4[]) AS pid WHERE pg_terminate_backend(pid)",
        )
        .bind(&pids)
        .fetch_all(&mut connection)
        .await?;
        let listening = chosen
            .iter()
            .filter(|(pid, listening)| *listening && terminated.contains(pid))
            .count();
        let _ = connection.close().await;
        Ok::<_, sqlx::Error>((terminated.len() as u64, listening as u64))
    };
    Ok(tokio::time::timeout(DB_TIMEOUT, work)
        .await
        .context("terminating backends timed out")??)
}
