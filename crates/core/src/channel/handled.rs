//! The highest seq a decider handled per conversation, kept for conversations active lately.
//!
//! A node serving a channel for weeks sees millions of conversations; remembering each one's
//! last seq forever is memory that never comes back. The last seqs live in a
//! [`Recent`](crate::recent::Recent) map: a conversation is remembered for at least
//! `forget_after_ms` after it was last handled, and at most twice that.
//!
//! Forgetting must not make a frame new again. Each entry keeps the newest commit time of its
//! conversation's frames handled, and the decider keeps the highest such time among forgotten
//! entries (`forgotten_up_to_ms`): a conversation it does not know reads back only the frames
//! committed after it, and skips a frame committed before. The price is stated in ADR 0034: a
//! frame that reaches the node more than about `forget_after_ms` after its commit, for a
//! conversation the node does not remember, is not delivered as new; the turn stays unanswered
//! in the registry, where takeovers and replays find it.

use crate::recent::Recent;

/// How long (ms) an idle conversation's last seq is kept at least.
pub const FORGET_AFTER_MS: i64 = 60_000;

/// Last seqs per conversation, for the conversations handled lately.
#[derive(Debug, Clone)]
pub(super) struct HandledSeqs {
    /// Per conversation: the highest seq handled, and the newest commit time of its frames
    /// handled.
    handled: Recent<String, (i64, i64)>,
    /// Every frame of a forgotten conversation committed at or before this time.
    forgotten_up_to_ms: Option<i64>,
}

impl HandledSeqs {
    pub(super) fn new(forget_after_ms: i64) -> HandledSeqs {
        HandledSeqs {
            handled: Recent::new(usize::MAX, forget_after_ms),
            forgotten_up_to_ms: None,
        }
    }

    /// The highest seq handled of the conversation, if it is remembered.
    pub(super) fn get(&self, conversation_id: &str) -> Option<i64> {
        self.handled.get(conversation_id).map(|(seq, _)| *seq)
    }

    /// The conversation was handled up to `seq`; its frames committed up to `newest_at_ms`.
    pub(super) fn record(&mut self, conversation_id: &str, seq: i64, newest_at_ms: Option<i64>) {
        let before_ms = self.handled.get(conversation_id).map(|(_, at_ms)| *at_ms);
        let at_ms = before_ms.max(newest_at_ms).unwrap_or(i64::MIN);
        // Unbounded capacity: no generation is dropped here.
        let _ = self
            .handled
            .insert(conversation_id.to_owned(), (seq, at_ms));
    }

    /// Forgets everything (the turn registry was read whole: it is the truth from now on).
    pub(super) fn clear(&mut self) {
        self.handled.clear();
        self.forgotten_up_to_ms = None;
    }

    /// Every frame of a conversation no longer remembered committed at or before this time.
    pub(super) fn forgotten_up_to_ms(&self) -> Option<i64> {
        self.forgotten_up_to_ms
    }

    /// Drops the conversations idle for `forget_after_ms` by `now_ms` (any clock that moves
    /// forward), keeping the newest commit time of their frames.
    pub(super) fn forget_idle(&mut self, now_ms: i64) {
        let Some(dropped) = self.handled.forget_idle(now_ms) else {
            return;
        };
        let newest_ms = dropped.values().map(|(_, at_ms)| *at_ms).max();
        self.forgotten_up_to_ms = self.forgotten_up_to_ms.max(newest_ms);
    }

    /// Conversations remembered.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.handled.len()
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
