//! What a client has already seen, so a replay after a reconnect never surfaces a frame twice.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use uuid::Uuid;

/// The seqs one end user has seen in one conversation.
///
/// An end-user connection is sent every seq of its conversation (its own sends through their
/// acks), so the watermark is the highest seq below which nothing is missing. Seqs above a gap
/// (live frames after a truncated replay) are remembered one by one until the gap is filled,
/// and the watermark sent on reconnect stays below the gap so the replay fills it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct SeqTracker {
    contiguous: i64,
    above: BTreeSet<i64>,
}

impl SeqTracker {
    /// A tracker that has seen everything up to `watermark`.
    pub(crate) fn new(watermark: i64) -> SeqTracker {
        SeqTracker {
            contiguous: watermark.max(0),
            above: BTreeSet::new(),
        }
    }

    /// The highest seq with nothing missing below it: what `hello` and `sync` send.
    pub(crate) fn watermark(&self) -> i64 {
        self.contiguous
    }

    /// Whether some seq between the watermark and the highest seen is missing.
    pub(crate) fn has_gap(&self) -> bool {
        !self.above.is_empty()
    }

    /// Records `seq`; true when it had not been seen before.
    pub(crate) fn observe(&mut self, seq: i64) -> bool {
        if seq <= self.contiguous || !self.above.insert(seq) {
            return false;
        }
        while self.above.remove(&(self.contiguous + 1)) {
            self.contiguous += 1;
        }
        true
    }

    /// Forgets everything and starts over at `watermark` (another conversation, or the server
    /// refused a watermark above its head).
    pub(crate) fn reset(&mut self, watermark: i64) {
        *self = SeqTracker::new(watermark);
    }
}

/// Turn revisions remembered per conversation; older turns are forgotten first.
const TURNS_PER_CONVERSATION: usize = 64;

/// Conversations remembered by an agent; the least recently active are forgotten first.
pub(crate) const REMEMBERED_CONVERSATIONS: usize = 10_000;

#[derive(Debug, Clone, Default)]
struct ConversationSeen {
    highest_seq: i64,
    /// Turn seq → highest (revision, fence) already handed to the caller.
    turns: BTreeMap<i64, (i64, i64)>,
    touched: u64,
}

/// What an agent has seen, per conversation: the highest seq (its `hello.watermarks`) and the
/// turn revisions already handed out.
///
/// Agents receive only the frames they own, so seqs have gaps and a turn can legitimately
/// arrive below the watermark (a takeover, a regeneration): turns are de-duplicated by
/// `(conversation, seq, revision)`, never by the watermark.
#[derive(Debug, Clone)]
pub(crate) struct ChannelTracker {
    conversations: HashMap<Uuid, ConversationSeen>,
    clock: u64,
    capacity: usize,
}

impl ChannelTracker {
    /// A tracker remembering at most `capacity` conversations, seeded with known watermarks.
    pub(crate) fn new(capacity: usize, watermarks: &HashMap<Uuid, i64>) -> ChannelTracker {
        let mut tracker = ChannelTracker {
            conversations: HashMap::new(),
            clock: 0,
            capacity: capacity.max(1),
        };
        for (conversation, watermark) in watermarks {
            tracker.observe_seq(*conversation, *watermark);
        }
        tracker
    }

    /// Records a persistent frame's seq.
    pub(crate) fn observe_seq(&mut self, conversation: Uuid, seq: i64) {
        let seen = self.touch(conversation);
        seen.highest_seq = seen.highest_seq.max(seq);
    }

    /// Records a delivered turn; true when this revision (or a later one) was not handed out.
    pub(crate) fn first_delivery(
        &mut self,
        conversation: Uuid,
        seq: i64,
        revision: i64,
        fence: Option<i64>,
    ) -> bool {
        let seen = self.touch(conversation);
        // A lease-mode redelivery of the same revision under a newer claim (higher fence) is new.
        let delivery = (revision, fence.unwrap_or(-1));
        if seen.turns.get(&seq).is_some_and(|known| *known >= delivery) {
            return false;
        }
        seen.turns.insert(seq, delivery);
        while seen.turns.len() > TURNS_PER_CONVERSATION {
            seen.turns.pop_first();
        }
        true
    }

    /// The watermark of each conversation, the `limit` most recently active first.
    pub(crate) fn watermarks(&self, limit: usize) -> Vec<(Uuid, i64)> {
        let mut recent: Vec<(&Uuid, &ConversationSeen)> = self
            .conversations
            .iter()
            .filter(|(_, seen)| seen.highest_seq > 0)
            .collect();
        recent.sort_by_key(|(_, seen)| std::cmp::Reverse(seen.touched));
        recent
            .into_iter()
            .take(limit)
            .map(|(conversation, seen)| (*conversation, seen.highest_seq))
            .collect()
    }

    fn touch(&mut self, conversation: Uuid) -> &mut ConversationSeen {
        self.clock += 1;
        if !self.conversations.contains_key(&conversation) {
            self.make_room();
        }
        let seen = self.conversations.entry(conversation).or_default();
        seen.touched = self.clock;
        seen
    }

    fn make_room(&mut self) {
        if self.conversations.len() < self.capacity {
            return;
        }
        // Evict a tenth at once so the scan is paid rarely, not on every new conversation.
        let mut by_age: Vec<(u64, Uuid)> = self
            .conversations
            .iter()
            .map(|(conversation, seen)| (seen.touched, *conversation))
            .collect();
        by_age.sort_unstable();
        let evict = (self.capacity / 10).max(1);
        for (_, conversation) in by_age.into_iter().take(evict) {
            self.conversations.remove(&conversation);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_in_order_advance_the_watermark_once_each() {
        let mut seen = SeqTracker::new(0);
        assert!(seen.observe(1));
        assert!(seen.observe(2));
        assert!(!seen.observe(2));
        assert!(!seen.observe(1));
        assert_eq!(seen.watermark(), 2);
        assert!(!seen.has_gap());
    }

    #[test]
    fn a_replay_below_the_starting_watermark_is_suppressed() {
        let mut seen = SeqTracker::new(12);
        assert!((1..=12).all(|seq| !seen.observe(seq)));
        assert!(seen.observe(13));
        assert_eq!(seen.watermark(), 13);
        assert!(!seen.observe(0));
        assert!(!seen.observe(-4));
    }

    #[test]
    fn a_gap_holds_the_watermark_until_it_is_filled() {
        // Replay truncated at 1000, live frames continue after the head (1500).
        let mut seen = SeqTracker::new(1000);
        assert!(seen.observe(1501));
        assert!(seen.observe(1502));
        assert!(seen.has_gap());
        assert_eq!(seen.watermark(), 1000);
        // The sync replays 1001..=1502; the two live frames come again and are suppressed.
        let surfaced: Vec<i64> = (1001..=1502).filter(|seq| seen.observe(*seq)).collect();
        assert_eq!(surfaced.len(), 500);
        assert_eq!(surfaced.last(), Some(&1500));
        assert_eq!(seen.watermark(), 1502);
        assert!(!seen.has_gap());
    }

    #[test]
    fn reset_starts_over() {
        let mut seen = SeqTracker::new(0);
        seen.observe(1);
        seen.observe(5);
        seen.reset(3);
        assert_eq!(seen.watermark(), 3);
        assert!(!seen.has_gap());
        assert!(seen.observe(4));
        assert!(seen.observe(5));
        assert_eq!(SeqTracker::new(-7).watermark(), 0);
    }

    fn conversation(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    #[test]
    fn a_turn_is_handed_out_once_per_revision() {
        let mut seen = ChannelTracker::new(10, &HashMap::new());
        let a = conversation(1);
        assert!(seen.first_delivery(a, 18, 0, None));
        assert!(!seen.first_delivery(a, 18, 0, None));
        // A regeneration or an edit is a new revision of the same seq.
        assert!(seen.first_delivery(a, 18, 1, None));
        assert!(!seen.first_delivery(a, 18, 0, None));
        // Lease mode: the same revision claimed again by a new holder (a higher fence) is new;
        // the same claim delivered twice is not.
        assert!(seen.first_delivery(a, 19, 0, Some(1)));
        assert!(!seen.first_delivery(a, 19, 0, Some(1)));
        assert!(seen.first_delivery(a, 19, 0, Some(2)));
        // A takeover delivers an older turn, below the highest seq seen: still new.
        seen.observe_seq(a, 30);
        assert!(seen.first_delivery(a, 17, 0, None));
        // Another conversation has its own turns.
        assert!(seen.first_delivery(conversation(2), 18, 0, None));
    }

    #[test]
    fn old_turn_revisions_are_forgotten_beyond_the_bound() {
        let mut seen = ChannelTracker::new(10, &HashMap::new());
        let a = conversation(1);
        let total = TURNS_PER_CONVERSATION as i64 + 5;
        for seq in 1..=total {
            assert!(seen.first_delivery(a, seq, 0, None));
        }
        assert!(!seen.first_delivery(a, total, 0, None));
        // The oldest were dropped, so they would be handed out again (the registry decides).
        assert!(seen.first_delivery(a, 1, 0, None));
    }

    #[test]
    fn watermarks_are_the_highest_seq_most_recent_first() {
        let mut initial = HashMap::new();
        initial.insert(conversation(9), 40);
        let mut seen = ChannelTracker::new(10, &initial);
        seen.observe_seq(conversation(1), 5);
        seen.observe_seq(conversation(1), 3);
        seen.observe_seq(conversation(2), 7);
        assert_eq!(
            seen.watermarks(10),
            vec![
                (conversation(2), 7),
                (conversation(1), 5),
                (conversation(9), 40)
            ]
        );
        assert_eq!(seen.watermarks(1), vec![(conversation(2), 7)]);
        // A conversation known only by its turns has no watermark to send.
        seen.first_delivery(conversation(3), 1, 0, None);
        assert_eq!(seen.watermarks(10).len(), 3);
    }

    #[test]
    fn the_least_recently_active_conversations_are_evicted() {
        let mut seen = ChannelTracker::new(10, &HashMap::new());
        for n in 1..=10 {
            seen.observe_seq(conversation(n), 1);
        }
        seen.observe_seq(conversation(1), 2);
        seen.observe_seq(conversation(11), 1);
        let kept: Vec<Uuid> = seen.watermarks(100).into_iter().map(|(c, _)| c).collect();
        assert_eq!(kept.len(), 10);
        assert!(kept.contains(&conversation(1)));
        assert!(kept.contains(&conversation(11)));
        assert!(!kept.contains(&conversation(2)));
    }
}
