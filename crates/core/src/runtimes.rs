//! Which runtime a delivered turn may carry without reading it from the database (ADR 0039).
//!
//! A delivered turn carries its conversation's runtime (docs/protocol.md §5.6), and an agent
//! writes against that version. The runtime must be at least as new as the one the turn was
//! committed with; a newer one is as good (the agent would have read it a moment later anyway).
//! Every commit event names the runtime version its conversation had when it committed, read
//! under the conversation's lock, and carries the runtime's state when that commit wrote it.
//! A conversation's commits are serialized by that lock, so the version never decreases as the
//! seq grows: the highest version of the events seen up to seq `S` bounds the version of every
//! turn at or below `S`. A node that holds a runtime at least that new for the conversation
//! hands it out; otherwise it reads, and remembers what it read.
//!
//! Events may arrive late, twice, out of order, or without the version (a catch-up read back
//! from the outbox): an event without the version, for a seq not yet covered, forgets the
//! conversation, and so does an answer refused for a stale runtime; anything this
//! cache does not know is read. Entries live in a [`Recent`] map, and only states of at most
//! `max_state_bytes` are kept, so the memory is bounded.

use std::hash::Hash;

use crate::recent::Recent;

/// What a node holds for one conversation.
#[derive(Debug, Clone)]
struct Entry<S> {
    /// The highest seq this node saw committed (or read the runtime after).
    through_seq: i64,
    /// No turn at or below `through_seq` was committed with a newer runtime version than this.
    required_version: i64,
    /// The newest runtime this node holds, when it holds one.
    known: Option<(i64, S)>,
}

/// The runtime a turn is delivered with, as this node knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup<S> {
    /// The conversation had no runtime written when the turn committed: the initial one.
    Initial,
    /// A runtime at least as new as the turn's.
    Known {
        /// Its version.
        version: i64,
        /// Its state.
        state: S,
    },
    /// Not known here: read it.
    Read,
}

/// The runtimes a node knows, per conversation.
#[derive(Debug, Clone)]
pub struct RuntimeCache<K, S> {
    entries: Recent<K, Entry<S>>,
    max_state_bytes: usize,
}

impl<K: Hash + Eq + Copy, S: Clone> RuntimeCache<K, S> {
    /// At most `capacity` conversations per generation of the underlying [`Recent`] map
    /// (rotated every `period_ms`), and states of at most `max_state_bytes` serialized.
    pub fn new(capacity: usize, period_ms: i64, max_state_bytes: usize) -> RuntimeCache<K, S> {
        RuntimeCache {
            entries: Recent::new(capacity, period_ms),
            max_state_bytes,
        }
    }

    /// A commit of the conversation through `seq` was seen. `version` is the runtime version it
    /// committed with (`None`: the event did not say); `written` is the state and its
    /// serialized size when that commit wrote the runtime (at `version`). An event that does
    /// not say, for a seq already covered, teaches nothing (the versions seen bound it); for a
    /// later seq it makes the conversation forgotten.
    pub fn committed(
        &mut self,
        conversation: K,
        seq: i64,
        version: Option<i64>,
        written: Option<(S, usize)>,
    ) {
        let Some(version) = version else {
            let covered = self
                .entries
                .get(&conversation)
                .is_some_and(|entry| seq <= entry.through_seq);
            if !covered {
                self.forget(conversation);
            }
            return;
        };
        let known = written.and_then(|(state, bytes)| self.keepable(version, state, bytes));
        self.learn(conversation, seq, version, known);
    }

    /// The runtime the conversation's turn at `seq` may be delivered with.
    pub fn lookup(&self, conversation: K, seq: i64) -> Lookup<S> {
        let Some(entry) = self.entries.get(&conversation) else {
            return Lookup::Read;
        };
        if seq > entry.through_seq {
            return Lookup::Read;
        }
        match &entry.known {
            Some((version, state)) if *version >= entry.required_version => Lookup::Known {
                version: *version,
                state: state.clone(),
            },
            _ if entry.required_version == 0 => Lookup::Initial,
            _ => Lookup::Read,
        }
    }

    /// The runtime was read from the database after the conversation's turn at `through_seq`
    /// committed: it is at least as new as that turn's.
    pub fn read(
        &mut self,
        conversation: K,
        through_seq: i64,
        version: i64,
        state: S,
        bytes: usize,
    ) {
        let known = self.keepable(version, state, bytes);
        self.learn(conversation, through_seq, version, known);
    }

    /// Forgets the conversation (its next turn is read).
    pub fn forget(&mut self, conversation: K) {
        if self.entries.get(&conversation).is_some() {
            // `Recent` has no removal: an entry that covers no seq is never used.
            let _ = self.entries.insert(conversation, Entry::unknown());
        }
    }

    /// Drops the conversations idle for a while (see [`Recent::forget_idle`]).
    pub fn forget_idle(&mut self, now_ms: i64) {
        let _ = self.entries.forget_idle(now_ms);
    }

    fn keepable(&self, version: i64, state: S, bytes: usize) -> Option<(i64, S)> {
        (bytes <= self.max_state_bytes).then_some((version, state))
    }

    /// Folds what a commit or a read taught into the conversation's entry: the seq and the
    /// version only grow, and the newest state held wins.
    fn learn(&mut self, conversation: K, seq: i64, version: i64, known: Option<(i64, S)>) {
        let mut entry = self
            .entries
            .get(&conversation)
            .cloned()
            .unwrap_or_else(Entry::unknown);
        entry.through_seq = entry.through_seq.max(seq);
        entry.required_version = entry.required_version.max(version);
        if let Some((version, state)) = known
            && entry.known.as_ref().is_none_or(|(held, _)| *held < version)
        {
            entry.known = Some((version, state));
        }
        let _ = self.entries.insert(conversation, entry);
    }
}

impl<S> Entry<S> {
    /// An entry that covers no seq (seqs start at 1).
    fn unknown() -> Entry<S> {
        Entry {
            through_seq: 0,
            required_version: 0,
            known: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cache() -> RuntimeCache<u8, String> {
        RuntimeCache::new(64, 60_000, 100)
    }

    #[test]
    fn an_unseen_conversation_is_read() {
        assert_eq!(cache().lookup(1, 1), Lookup::Read);
    }

    #[test]
    fn a_turn_committed_before_any_runtime_write_gets_the_initial_one() {
        let mut cache = cache();
        cache.committed(1, 3, Some(0), None);
        assert_eq!(cache.lookup(1, 3), Lookup::Initial);
        assert_eq!(cache.lookup(1, 2), Lookup::Initial);
        // A later turn was not seen yet.
        assert_eq!(cache.lookup(1, 4), Lookup::Read);
    }

    #[test]
    fn a_written_runtime_is_handed_out_to_the_turns_after_it() {
        let mut cache = cache();
        cache.committed(1, 2, Some(1), Some(("one".into(), 3)));
        cache.committed(1, 3, Some(1), None);
        assert_eq!(
            cache.lookup(1, 3),
            Lookup::Known {
                version: 1,
                state: "one".into()
            }
        );
    }

    #[test]
    fn a_version_written_elsewhere_without_its_state_is_read() {
        let mut cache = cache();
        cache.committed(1, 2, Some(1), Some(("one".into(), 3)));
        // An answer without frames wrote version 2 elsewhere; the next turn says so.
        cache.committed(1, 3, Some(2), None);
        assert_eq!(cache.lookup(1, 3), Lookup::Read);
        cache.read(1, 3, 2, "two".into(), 3);
        assert_eq!(
            cache.lookup(1, 3),
            Lookup::Known {
                version: 2,
                state: "two".into()
            }
        );
    }

    #[test]
    fn an_event_without_the_version_forgets_the_conversation_unless_it_is_covered() {
        let mut cache = cache();
        cache.committed(1, 2, Some(0), None);
        // A catch-up of a seq already seen teaches nothing.
        cache.committed(1, 2, None, None);
        assert_eq!(cache.lookup(1, 2), Lookup::Initial);
        cache.committed(1, 3, None, None);
        assert_eq!(cache.lookup(1, 2), Lookup::Read);
        assert_eq!(cache.lookup(1, 3), Lookup::Read);
    }

    #[test]
    fn an_older_read_never_replaces_a_newer_state() {
        let mut cache = cache();
        cache.committed(1, 4, Some(3), Some(("three".into(), 5)));
        cache.read(1, 4, 2, "two".into(), 3);
        assert_eq!(
            cache.lookup(1, 4),
            Lookup::Known {
                version: 3,
                state: "three".into()
            }
        );
    }

    #[test]
    fn a_state_over_the_size_limit_is_not_kept() {
        let mut cache = cache();
        cache.committed(1, 2, Some(1), Some(("big".into(), 101)));
        assert_eq!(cache.lookup(1, 2), Lookup::Read);
        cache.read(1, 2, 1, "big".into(), 101);
        assert_eq!(cache.lookup(1, 2), Lookup::Read);
    }

    /// One step of a simulated conversation seen by one node.
    #[derive(Debug, Clone)]
    enum Step {
        /// The next commit: a user turn, or an answer that writes the runtime.
        Commit { writes_runtime: bool },
        /// The event of commit `index` (modulo those made) arrives, with or without the
        /// version and the written state.
        Event {
            index: usize,
            with_version: bool,
            with_state: bool,
        },
        /// The node reads the runtime now, after the commit `index` (modulo those made).
        Read { index: usize },
        /// The node delivers the turn of commit `index` (modulo those made).
        Deliver { index: usize },
        /// Time passes: idle entries are dropped.
        Idle,
        /// An answer was refused for a stale runtime: the node forgets the conversation.
        Forget,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            any::<bool>().prop_map(|writes_runtime| Step::Commit { writes_runtime }),
            (any::<usize>(), any::<bool>(), any::<bool>()).prop_map(
                |(index, with_version, with_state)| Step::Event {
                    index,
                    with_version: with_version || index % 7 != 0,
                    with_state,
                }
            ),
            any::<usize>().prop_map(|index| Step::Read { index }),
            any::<usize>().prop_map(|index| Step::Deliver { index }),
            Just(Step::Idle),
            Just(Step::Forget),
        ]
    }

    fn state_of(version: i64) -> String {
        format!("state {version}")
    }

    proptest! {
        /// Whatever order, repetition or loss the events suffer, a delivered turn never gets a
        /// runtime older than the one it was committed with, newer than the stored one, or a
        /// state that is not its version's.
        #[test]
        fn a_turn_never_gets_a_runtime_older_than_its_commit(
            steps in proptest::collection::vec(step(), 1..120)
        ) {
            let mut cache: RuntimeCache<u8, String> = RuntimeCache::new(8, 10, 1_000);
            // versions[i]: the runtime version commit i (seq i + 1) committed with.
            let mut versions: Vec<i64> = Vec::new();
            let mut writes: Vec<bool> = Vec::new();
            let mut now_ms = 0;
            for step in steps {
                let stored = versions.last().copied().unwrap_or(0);
                match step {
                    Step::Commit { writes_runtime } => {
                        versions.push(stored + i64::from(writes_runtime));
                        writes.push(writes_runtime);
                    }
                    Step::Event { index, with_version, with_state } if !versions.is_empty() => {
                        let index = index % versions.len();
                        let version = versions[index];
                        let written = (with_state && writes[index])
                            .then(|| (state_of(version), 8));
                        cache.committed(7, index as i64 + 1, with_version.then_some(version), written);
                    }
                    Step::Read { index } if !versions.is_empty() => {
                        let index = index % versions.len();
                        cache.read(7, index as i64 + 1, stored, state_of(stored), 8);
                    }
                    Step::Deliver { index } if !versions.is_empty() => {
                        let index = index % versions.len();
                        match cache.lookup(7, index as i64 + 1) {
                            Lookup::Initial => prop_assert_eq!(versions[index], 0),
                            Lookup::Known { version, state } => {
                                prop_assert!(version >= versions[index]);
                                prop_assert!(version <= stored);
                                prop_assert_eq!(state, state_of(version));
                            }
                            Lookup::Read => {}
                        }
                    }
                    Step::Idle => {
                        now_ms += 7;
                        cache.forget_idle(now_ms);
                    }
                    Step::Forget => cache.forget(7),
                    _ => {}
                }
            }
        }
    }
}
