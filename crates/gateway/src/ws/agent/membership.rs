//! An agent connection's place in the cluster while it lives: announced in gossip, and in lease
//! mode its claims renewed, then released when it goes.

use std::time::Duration;

use converger_cluster::{AgentRecord, Cluster};

use crate::state::AppState;

/// Renews a lease-mode member's claims every third of the lease while the session lives.
pub(super) struct LeaseRenewal {
    task: tokio::task::JoinHandle<()>,
}

impl LeaseRenewal {
    /// Starts renewing `holder`'s claims.
    pub(super) fn start(state: &AppState, holder: String, lease: Duration) -> LeaseRenewal {
        let store = state.store.clone();
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(lease / 3);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                if let Err(error) = store.renew_leases(&holder, lease).await {
                    tracing::warn!(%error, holder, "leases not renewed");
                }
            }
        });
        LeaseRenewal { task }
    }
}

impl Drop for LeaseRenewal {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Gives a departing lease-mode member's claims up, so the next owner claims them at once.
pub(super) async fn release_leases(state: &AppState, holder: &str) {
    match state.store.release_leases(holder).await {
        Ok(0) => {}
        Ok(released) => tracing::debug!(holder, released, "leases released"),
        Err(error) => {
            tracing::warn!(%error, holder, "leases not released; they run out by themselves")
        }
    }
}

/// Keeps an agent connection announced in gossip while it lives; withdraws it when dropped, so
/// no way out of the session forgets it.
pub(crate) struct Announced {
    cluster: Cluster,
    record: AgentRecord,
}

impl Announced {
    /// Publishes the connection in gossip.
    pub(crate) fn new(cluster: &Cluster, record: AgentRecord) -> Announced {
        cluster.publish(record.clone());
        Announced {
            cluster: cluster.clone(),
            record,
        }
    }
}

impl Drop for Announced {
    fn drop(&mut self) {
        tracing::debug!(connection_id = %self.record.connection_id, "agent connection withdrawn");
        self.cluster
            .withdraw(self.record.channel_id, &self.record.connection_id);
    }
}
