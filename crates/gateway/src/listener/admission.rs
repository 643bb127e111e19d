//! Places under the node's connection caps: per client address and in all. A place is held by a
//! TCP connection and, on HTTP/2, by every request beyond the first that runs on it at once, so
//! the caps count sessions (WebSocket, Server-Sent Events), not sockets.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::config::HttpConfig;

/// Places a node holds, per client address and in all.
#[derive(Debug, Default)]
struct Counts {
    per_address: HashMap<IpAddr, usize>,
    total: usize,
    /// Connections being answered 503 right now, oldest first, each with the signal that ends
    /// it early (each holds a descriptor until it is answered).
    refusing: VecDeque<(u64, Arc<Notify>)>,
    /// The number of the next refusal.
    next_refusal: u64,
}

/// Admission of connections and sessions under the node's caps.
#[derive(Debug, Clone)]
pub(crate) struct Admission {
    counts: Arc<Mutex<Counts>>,
    max_total: usize,
    max_per_address: usize,
}

/// Connections answered 503 at once at most, so refusals cannot use up the descriptors kept
/// free below the cap. A new refusal beyond them ends the oldest: a client that sends its
/// request at once (a load balancer's health check) is answered even while silent sockets
/// flood the node, and a silent one is cut short.
pub(crate) const MAX_REFUSING: usize = 128;

impl Admission {
    /// Admission under `config`'s caps (0: no cap).
    pub(crate) fn new(config: &HttpConfig) -> Admission {
        Admission {
            counts: Arc::default(),
            max_total: config.max_connections,
            max_per_address: config.max_connections_per_address,
        }
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A place for a connection or session from `address`, or `None` when a cap is reached.
    pub(crate) fn admit(&self, address: IpAddr) -> Option<ConnectionSlot> {
        let mut counts = self.counts();
        let from_address = counts.per_address.get(&address).copied().unwrap_or(0);
        let over_total = self.max_total > 0 && counts.total >= self.max_total;
        let over_address = self.max_per_address > 0 && from_address >= self.max_per_address;
        if over_total || over_address {
            let cap = if over_total { "node" } else { "address" };
            metrics::counter!("converger_connections_refused_total", "cap" => cap).increment(1);
            return None;
        }
        counts.total += 1;
        *counts.per_address.entry(address).or_insert(0) += 1;
        metrics::gauge!("converger_connections").set(counts.total as f64);
        Some(ConnectionSlot {
            _held: Arc::new(SlotInner {
                admission: self.clone(),
                address,
            }),
        })
    }

    /// A turn at answering a refused connection with 503; when [`MAX_REFUSING`] are being
    /// answered already, the oldest of them is told to end ([`RefusalTurn::evicted`]).
    pub(crate) fn refusal(&self) -> RefusalTurn {
        let mut counts = self.counts();
        if counts.refusing.len() >= MAX_REFUSING
            && let Some((_, oldest)) = counts.refusing.pop_front()
        {
            metrics::counter!("converger_connections_refused_total", "cap" => "refusing")
                .increment(1);
            oldest.notify_one();
        }
        let id = counts.next_refusal;
        counts.next_refusal += 1;
        let evicted = Arc::new(Notify::new());
        counts.refusing.push_back((id, Arc::clone(&evicted)));
        RefusalTurn {
            admission: self.clone(),
            id,
            evicted,
        }
    }

    /// Places held now (all addresses).
    pub(crate) fn held(&self) -> usize {
        self.counts().total
    }
}

/// One admitted connection's or session's place under the caps, given back when the last clone
/// drops.
#[derive(Debug, Clone)]
pub(crate) struct ConnectionSlot {
    _held: Arc<SlotInner>,
}

#[derive(Debug)]
struct SlotInner {
    admission: Admission,
    address: IpAddr,
}

impl Drop for SlotInner {
    fn drop(&mut self) {
        let mut counts = self.admission.counts();
        counts.total = counts.total.saturating_sub(1);
        if let Some(count) = counts.per_address.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                counts.per_address.remove(&self.address);
            }
        }
        metrics::gauge!("converger_connections").set(counts.total as f64);
    }
}

/// A refused connection being answered; its turn is given back on drop.
#[derive(Debug)]
pub(crate) struct RefusalTurn {
    admission: Admission,
    id: u64,
    evicted: Arc<Notify>,
}

impl RefusalTurn {
    /// Completes when a newer refusal took this one's turn.
    pub(crate) async fn evicted(&self) {
        self.evicted.notified().await;
    }
}

impl Drop for RefusalTurn {
    fn drop(&mut self) {
        let mut counts = self.admission.counts();
        counts.refusing.retain(|(id, _)| *id != self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(max_total: usize, max_per_address: usize) -> Admission {
        Admission::new(&HttpConfig {
            max_connections: max_total,
            max_connections_per_address: max_per_address,
            ..HttpConfig::default()
        })
    }

    #[test]
    fn places_are_counted_per_address_and_given_back() {
        let admission = admission(3, 2);
        let first: IpAddr = "127.0.0.1".parse().unwrap();
        let second: IpAddr = "127.0.0.2".parse().unwrap();
        let a = admission.admit(first).unwrap();
        let _b = admission.admit(first).unwrap();
        assert!(admission.admit(first).is_none(), "per-address cap");
        let _c = admission.admit(second).unwrap();
        assert!(admission.admit(second).is_none(), "node cap");
        drop(a);
        assert!(
            admission.admit(second).is_some(),
            "a dropped place is free again"
        );
    }

    #[tokio::test]
    async fn a_refusal_beyond_the_cap_ends_the_oldest() {
        let admission = admission(1, 1);
        let turns: Vec<_> = (0..MAX_REFUSING).map(|_| admission.refusal()).collect();
        let newest = admission.refusal();
        // The oldest was told to end; the others were not.
        tokio::time::timeout(std::time::Duration::from_secs(1), turns[0].evicted())
            .await
            .expect("the oldest refusal is evicted");
        let second = tokio::time::timeout(std::time::Duration::from_millis(50), turns[1].evicted());
        assert!(second.await.is_err(), "only the oldest");
        assert_eq!(admission.counts().refusing.len(), MAX_REFUSING);
        drop(turns);
        assert_eq!(admission.counts().refusing.len(), 1);
        drop(newest);
        assert!(admission.counts().refusing.is_empty());
    }
}
