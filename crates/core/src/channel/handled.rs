//! The highest seq a decider handled per conversation, kept for conversations active lately.
//!
//! A node serving a channel for weeks sees millions of conversations; remembering each one's
//! last seq forever is memory that never comes back. Conversations are kept in two
//! generations: what is handled goes into the current one, and every `forget_after_ms` the
//! previous generation is dropped whole (its memory returns at once) and the current one takes
//! its place. A conversation is therefore remembered for at least `forget_after_ms` after it was
//! last handled, and at most twice that.
//!
//! Forgetting must not make a frame new again. Every frame handled into a dropped generation
//! committed at or before that generation's newest commit time, so the decider keeps the highest
//! such time (`forgotten_up_to_ms`): a conversation it does not know reads back only the frames
//! committed after it. The price is stated in ADR 0034: a frame that reaches the node more than
//! about `forget_after_ms` after its commit, for a conversation the node does not remember and
//! whose later frame arrived first, is not delivered as new (as for frames older than the start
//! of the node's following today); the turn stays unanswered in the registry, where takeovers
//! and replays find it.

use std::collections::HashMap;

/// How long (ms) an idle conversation's last seq is kept at least.
pub const FORGET_AFTER_MS: i64 = 60_000;

/// Last seqs per conversation, in two generations.
#[derive(Debug, Clone)]
pub(super) struct HandledSeqs {
    current: Generation,
    previous: Generation,
    /// Every frame of a forgotten conversation committed at or before this time.
    forgotten_up_to_ms: Option<i64>,
    /// When (the caller's clock) the current generation began.
    current_since_ms: Option<i64>,
    forget_after_ms: i64,
}

#[derive(Debug, Clone, Default)]
struct Generation {
    last_seqs: HashMap<String, i64>,
    /// The newest commit time among the frames handled into this generation.
    newest_at_ms: Option<i64>,
}

impl HandledSeqs {
    pub(super) fn new(forget_after_ms: i64) -> HandledSeqs {
        HandledSeqs {
            current: Generation::default(),
            previous: Generation::default(),
            forgotten_up_to_ms: None,
            current_since_ms: None,
            forget_after_ms,
        }
    }

    /// The highest seq handled of the conversation, if it is remembered.
    pub(super) fn get(&self, conversation_id: &str) -> Option<i64> {
        self.current
            .last_seqs
            .get(conversation_id)
            .or_else(|| self.previous.last_seqs.get(conversation_id))
            .copied()
    }

    /// The conversation was handled up to `seq`; its frames committed up to `newest_at_ms`.
    pub(super) fn record(&mut self, conversation_id: &str, seq: i64, newest_at_ms: Option<i64>) {
        self.previous.last_seqs.remove(conversation_id);
        match self.current.last_seqs.get_mut(conversation_id) {
            Some(last) => *last = seq,
            None => {
                self.current
                    .last_seqs
                    .insert(conversation_id.to_owned(), seq);
            }
        }
        if let Some(at_ms) = newest_at_ms {
            self.current.newest_at_ms = self.current.newest_at_ms.max(Some(at_ms));
        }
    }

    /// Forgets everything (the turn registry was read whole: it is the truth from now on).
    pub(super) fn clear(&mut self) {
        *self = HandledSeqs::new(self.forget_after_ms);
    }

    /// Every frame of a conversation no longer remembered committed at or before this time.
    pub(super) fn forgotten_up_to_ms(&self) -> Option<i64> {
        self.forgotten_up_to_ms
    }

    /// Drops the previous generation when the current one is `forget_after_ms` old by `now_ms`
    /// (any clock that moves forward; only the generations' age is read from it).
    pub(super) fn forget_idle(&mut self, now_ms: i64) {
        let Some(since_ms) = self.current_since_ms else {
            self.current_since_ms = Some(now_ms);
            return;
        };
        if now_ms - since_ms < self.forget_after_ms {
            return;
        }
        let dropped = std::mem::replace(&mut self.previous, std::mem::take(&mut self.current));
        if !dropped.last_seqs.is_empty() {
            self.forgotten_up_to_ms = self.forgotten_up_to_ms.max(dropped.newest_at_ms);
        }
        self.current_since_ms = Some(now_ms);
    }

    /// Conversations remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.current.last_seqs.len() + self.previous.last_seqs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conversation_handled_lately_is_kept_and_an_idle_one_is_forgotten() {
        let mut handled = HandledSeqs::new(100);
        handled.forget_idle(0);
        handled.record("busy", 1, Some(10));
        handled.record("idle", 4, Some(20));
        handled.forget_idle(100);
        assert_eq!(handled.get("idle"), Some(4), "kept for one period at least");
        handled.record("busy", 2, Some(150));
        handled.forget_idle(200);
        assert_eq!(handled.get("busy"), Some(2));
        assert_eq!(handled.get("idle"), None);
        assert_eq!(handled.len(), 1);
        assert_eq!(handled.forgotten_up_to_ms(), Some(20));
    }

    #[test]
    fn the_forgotten_time_covers_every_frame_of_a_dropped_generation_and_never_goes_back() {
        let mut handled = HandledSeqs::new(10);
        handled.forget_idle(0);
        handled.record("a", 3, Some(500));
        handled.record("b", 1, Some(7));
        handled.forget_idle(10);
        handled.forget_idle(20);
        assert_eq!(handled.forgotten_up_to_ms(), Some(500));
        handled.record("c", 1, Some(30));
        handled.forget_idle(30);
        handled.forget_idle(40);
        assert_eq!(handled.forgotten_up_to_ms(), Some(500));
    }

    #[test]
    fn nothing_is_forgotten_before_the_clock_is_first_read() {
        let mut handled = HandledSeqs::new(10);
        handled.record("a", 3, Some(5));
        handled.forget_idle(1_000);
        handled.forget_idle(1_005);
        assert_eq!(handled.get("a"), Some(3));
        assert_eq!(handled.forgotten_up_to_ms(), None);
    }

    #[test]
    fn clearing_forgets_the_forgotten_time_too() {
        let mut handled = HandledSeqs::new(10);
        handled.forget_idle(0);
        handled.record("a", 3, Some(5));
        handled.forget_idle(10);
        handled.forget_idle(20);
        handled.clear();
        assert_eq!(handled.forgotten_up_to_ms(), None);
        assert_eq!(handled.get("a"), None);
    }
}
