//! A map that keeps what was used lately. What a node remembers per conversation (the channel
//! decider's last seqs, the bus door's highest seqs and channels, the NATS publisher's seqs)
//! must not grow with every conversation the node ever saw (ADR 0034).
//!
//! Entries live in two generations. An insert goes into the current one; when the current one
//! is `period_ms` old (or holds `capacity` entries) the previous generation is dropped whole, so
//! its memory returns at once, and the current one takes its place. Unless the capacity forced a
//! rotation, an entry used within the last period is always found, and one idle for two periods
//! and a tick is always gone. The dropped generation is handed back, for owners that must know
//! what they forgot. Time is whatever millisecond clock the owner passes; only its progress is
//! read.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;

/// Entries kept for about a period after their last use.
#[derive(Debug, Clone)]
pub struct Recent<K, V> {
    current: HashMap<K, V>,
    previous: HashMap<K, V>,
    capacity: usize,
    period_ms: i64,
    /// When the current generation began; `None` until the clock is first read.
    current_since_ms: Option<i64>,
}

impl<K: Hash + Eq, V> Recent<K, V> {
    /// At most `capacity` entries per generation, rotated every `period_ms`.
    pub fn new(capacity: usize, period_ms: i64) -> Recent<K, V> {
        Recent {
            current: HashMap::new(),
            previous: HashMap::new(),
            capacity: capacity.max(1),
            period_ms,
            current_since_ms: None,
        }
    }

    /// The key's value, if it was used lately.
    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.current.get(key).or_else(|| self.previous.get(key))
    }

    /// Sets the key's value, which counts as a use. Returns the generation dropped when the
    /// current one was full.
    pub fn insert(&mut self, key: K, value: V) -> Option<HashMap<K, V>> {
        self.previous.remove(&key);
        let mut dropped = None;
        if self.current.len() >= self.capacity && !self.current.contains_key(&key) {
            dropped = Some(self.rotate());
        }
        self.current.insert(key, value);
        dropped
    }

    /// Drops the previous generation when the current one is a period old by `now_ms`, and
    /// returns it.
    pub fn forget_idle(&mut self, now_ms: i64) -> Option<HashMap<K, V>> {
        let Some(since_ms) = self.current_since_ms else {
            self.current_since_ms = Some(now_ms);
            return None;
        };
        if now_ms - since_ms < self.period_ms {
            return None;
        }
        self.current_since_ms = Some(now_ms);
        Some(self.rotate())
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.current = HashMap::new();
        self.previous = HashMap::new();
        self.current_since_ms = None;
    }

    /// Entries kept.
    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    /// True when nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.current.is_empty() && self.previous.is_empty()
    }

    fn rotate(&mut self) -> HashMap<K, V> {
        std::mem::replace(&mut self.previous, std::mem::take(&mut self.current))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_used_lately_stays_and_an_idle_one_goes_after_two_periods() {
        let mut recent = Recent::new(100, 10);
        recent.forget_idle(0);
        recent.insert("busy", 1);
        recent.insert("idle", 1);
        assert!(
            recent
                .forget_idle(10)
                .is_some_and(|dropped| dropped.is_empty())
        );
        assert_eq!(recent.get(&"idle"), Some(&1), "kept one period at least");
        recent.insert("busy", 2);
        let dropped = recent.forget_idle(20).expect("a period passed");
        assert_eq!(
            dropped.get("idle"),
            Some(&1),
            "the idle entry is handed back"
        );
        assert_eq!(recent.get(&"busy"), Some(&2));
        assert_eq!(recent.get(&"idle"), None);
        assert!(
            recent.forget_idle(21).is_none(),
            "no rotation within a period"
        );
        assert_eq!(recent.len(), 1);
    }

    #[test]
    fn nothing_is_forgotten_before_the_clock_is_first_read() {
        let mut recent = Recent::new(100, 10);
        recent.insert("a", 3);
        assert!(recent.forget_idle(1_000).is_none());
        recent.forget_idle(1_005);
        assert_eq!(recent.get(&"a"), Some(&3));
    }

    #[test]
    fn a_full_generation_rotates_at_once() {
        let mut recent = Recent::new(2, 3_600_000);
        recent.insert(1, ());
        recent.insert(2, ());
        assert!(
            recent
                .insert(3, ())
                .is_some_and(|dropped| dropped.is_empty())
        );
        assert!(recent.get(&1).is_some() && recent.get(&3).is_some());
        recent.insert(4, ());
        let dropped = recent.insert(5, ()).expect("full again");
        assert_eq!(dropped.len(), 2, "the oldest generation goes whole");
        assert!(recent.get(&1).is_none());
        assert!(recent.len() <= 4);
    }
}
