//! A map that keeps what was used lately: what a node remembers per conversation for
//! de-duplication (the door's highest seqs and channels, the NATS link's published seqs) must
//! not grow with every conversation the node ever saw.
//!
//! Entries live in two generations. An insert goes into the current one; every `period` (or when
//! the current one holds `capacity` entries) the previous generation is dropped whole, so its
//! memory returns at once, and the current one takes its place. An entry used within the last
//! period is always found; one idle for two periods is always gone.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// How long an idle entry is kept at least (at most twice this, plus one tick).
pub(crate) const RECENT_PERIOD: Duration = Duration::from_secs(60);

/// How often owners call [`Recent::forget_idle`]: often, so that a rotation forced by the
/// capacity does not delay the next one by up to a period.
pub(crate) const RECENT_TICK: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub(crate) struct Recent<K, V> {
    current: HashMap<K, V>,
    previous: HashMap<K, V>,
    capacity: usize,
    period: Duration,
    current_since: Instant,
}

impl<K: Hash + Eq, V> Recent<K, V> {
    /// Keeps at most `capacity` entries per generation, rotated every `period`.
    pub(crate) fn new(capacity: usize, period: Duration) -> Recent<K, V> {
        Recent {
            current: HashMap::new(),
            previous: HashMap::new(),
            capacity: capacity.max(1),
            period,
            current_since: Instant::now(),
        }
    }

    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.current.get(key).or_else(|| self.previous.get(key))
    }

    /// Sets the key's value, which counts as a use.
    pub(crate) fn insert(&mut self, key: K, value: V) {
        self.previous.remove(&key);
        if self.current.len() >= self.capacity && !self.current.contains_key(&key) {
            self.rotate(Instant::now());
        }
        self.current.insert(key, value);
    }

    /// Drops the previous generation when the current one is a period old.
    pub(crate) fn forget_idle(&mut self, now: Instant) {
        if now.saturating_duration_since(self.current_since) >= self.period {
            self.rotate(now);
        }
    }

    fn rotate(&mut self, now: Instant) {
        self.previous = std::mem::take(&mut self.current);
        self.current_since = now;
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_used_lately_stays_and_an_idle_one_goes_after_two_periods() {
        let period = Duration::from_secs(10);
        let mut recent = Recent::new(100, period);
        // After the map began its first generation.
        let start = Instant::now();
        recent.insert("busy", 1);
        recent.insert("idle", 1);
        recent.forget_idle(start + period);
        assert_eq!(recent.get(&"idle"), Some(&1), "kept one period at least");
        recent.insert("busy", 2);
        recent.forget_idle(start + period * 2);
        assert_eq!(recent.get(&"busy"), Some(&2));
        assert_eq!(recent.get(&"idle"), None);
        recent.forget_idle(start + period * 2 + Duration::from_secs(1));
        assert_eq!(recent.len(), 1, "no rotation before the period is over");
    }

    #[test]
    fn a_full_generation_rotates_at_once() {
        let mut recent = Recent::new(2, Duration::from_secs(3_600));
        recent.insert(1, ());
        recent.insert(2, ());
        recent.insert(3, ());
        assert!(recent.get(&1).is_some() && recent.get(&3).is_some());
        recent.insert(4, ());
        recent.insert(5, ());
        assert!(recent.get(&1).is_none(), "at most two generations are kept");
        assert!(recent.len() <= 4);
    }
}
