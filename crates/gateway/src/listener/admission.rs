//! Places under the node's connection caps: per client address and in all. A place is held by a
//! TCP connection and, on HTTP/2, by every request beyond the first that runs on it at once, so
//! the caps count sessions (WebSocket, Server-Sent Events), not sockets.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use crate::config::HttpConfig;

/// Places a node holds, per client address and in all.
#[derive(Debug, Default)]
struct Counts {
    per_address: HashMap<IpAddr, usize>,
    total: usize,
    /// Connections being answered 503 right now (each holds a descriptor until it is answered).
    refusing: usize,
}

/// Admission of connections and sessions under the node's caps.
#[derive(Debug, Clone)]
pub(crate) struct Admission {
    counts: Arc<Mutex<Counts>>,
    max_total: usize,
    max_per_address: usize,
}

/// Connections answered 503 at once at most; beyond them a connection over a cap is closed at
/// accept without an answer, so refusals cannot use up the descriptors kept free below the cap.
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

    /// A turn at answering a refused connection with 503, or `None` when [`MAX_REFUSING`] are
    /// being answered already (the connection is then closed at once).
    pub(crate) fn refusal(&self) -> Option<RefusalTurn> {
        let mut counts = self.counts();
        if counts.refusing >= MAX_REFUSING {
            metrics::counter!("converger_connections_refused_total", "cap" => "refusing")
                .increment(1);
            return None;
        }
        counts.refusing += 1;
        Some(RefusalTurn {
            admission: self.clone(),
        })
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
}

impl Drop for RefusalTurn {
    fn drop(&mut self) {
        let mut counts = self.admission.counts();
        counts.refusing = counts.refusing.saturating_sub(1);
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

    #[test]
    fn refusals_have_a_cap_of_their_own() {
        let admission = admission(1, 1);
        let turns: Vec<_> = (0..MAX_REFUSING)
            .map(|_| admission.refusal().unwrap())
            .collect();
        assert!(admission.refusal().is_none());
        drop(turns);
        assert!(admission.refusal().is_some());
    }
}
