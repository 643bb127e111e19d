//! Agent groups: who owns a conversation's turns, what a node remembers about turns it passed
//! on, and who takes over when a member leaves.
//!
//! Every node computes the same owner with no coordination: the owner of a turn is the member,
//! among those whose eligibility time (`since`) is at or before the turn's commit time, with the
//! highest [`owner_hash`] of (conversation, connection); when no member is eligible yet, the
//! members with the earliest `since` count (ADR 0006). A member joining only changes the owner
//! of turns committed after its `since`
//! (so a turn already delivered is never delivered again to the newcomer), and rendezvous hashing
//! only moves the conversations whose winner came or went.

use std::collections::{BTreeMap, HashMap, VecDeque};

/// 64-bit FNV-1a offset basis.
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// 64-bit FNV-1a prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// The fixed, portable rendezvous hash: FNV-1a over the UTF-8 bytes of the conversation id, a
/// zero byte, and the connection id, finished with the SplitMix64 mixer so that similar ids
/// spread evenly. Documented with test vectors in `docs/adr/0006-ownership-and-takeover.md`;
/// changing it would move every conversation at once during a rolling upgrade.
pub fn owner_hash(conversation_id: &str, connection_id: &str) -> u64 {
    let mut hash = FNV_OFFSET;
    let bytes = conversation_id
        .as_bytes()
        .iter()
        .chain(std::iter::once(&0u8))
        .chain(connection_id.as_bytes());
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    splitmix64(hash)
}

fn splitmix64(mut value: u64) -> u64 {
    value = value.wrapping_add(0x9e37_79b9_7f4a_7c15);
    value = (value ^ (value >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    value ^ (value >> 31)
}

/// The members of one group: connection id → eligibility time (ms since the epoch).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupView {
    members: BTreeMap<String, i64>,
}

impl GroupView {
    /// An empty group.
    pub fn new() -> GroupView {
        GroupView::default()
    }

    /// Adds (or re-times) a member.
    pub fn join(&mut self, connection_id: &str, since_ms: i64) {
        self.members.insert(connection_id.to_owned(), since_ms);
    }

    /// Removes a member; true when it was there.
    pub fn leave(&mut self, connection_id: &str) -> bool {
        self.members.remove(connection_id).is_some()
    }

    /// True when the group has no member.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// True when the connection is a member.
    pub fn contains(&self, connection_id: &str) -> bool {
        self.members.contains_key(connection_id)
    }

    /// Members and their `since`.
    pub fn members(&self) -> impl Iterator<Item = (&str, i64)> {
        self.members
            .iter()
            .map(|(connection, since)| (connection.as_str(), *since))
    }

    /// The owner of a frame of `conversation_id` committed at `at_ms`.
    ///
    /// When no member is eligible yet, the earliest members count (those with the smallest
    /// `since`), not all of them: a node that has not yet heard of a later joiner still picks
    /// the same owner, since a later joiner always has a later `since` (ADR 0006).
    pub fn owner(&self, conversation_id: &str, at_ms: i64) -> Option<&str> {
        let earliest = self.members.values().copied().min()?;
        let effective = at_ms.max(earliest);
        let eligible = self
            .members
            .iter()
            .filter(|(_, since)| **since <= effective);
        best(conversation_id, eligible)
    }
}

/// Highest hash wins; equal hashes (never seen in practice) break on the larger connection id.
fn best<'a>(
    conversation_id: &str,
    candidates: impl Iterator<Item = (&'a String, &'a i64)>,
) -> Option<&'a str> {
    candidates
        .map(|(connection, _)| (owner_hash(conversation_id, connection), connection.as_str()))
        .max()
        .map(|(_, connection)| connection)
}

/// The owner recorded for turns that reached a node while it knew no member of the group; no
/// connection id is empty, so a takeover always moves them on.
pub const NOBODY: &str = "";

/// Turns of one conversation passed on, each with the member it went to (oldest first).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Passed {
    /// Each remembered pass, oldest first.
    pub passes: VecDeque<Pass>,
    /// The highest seq that fell out of memory because the conversation had more unanswered
    /// turns than fit: the shell reads those back from the turn registry at a takeover.
    pub evicted_up_to: Option<i64>,
}

/// One turn passed to a member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pass {
    /// The turn's seq.
    pub seq: i64,
    /// The turn's commit time: takeovers re-decide at this time, so every node picks the same
    /// new owner whenever it learns of the leave.
    pub at_ms: i64,
    /// The member it went to.
    pub owner: String,
}

/// Bounded memory of passed turns: per conversation the most recent passes, and at most
/// `conversations` conversations, oldest dropped first. A turn is forgotten once it is answered.
#[derive(Debug, Clone)]
pub struct PassedTurns {
    conversations: usize,
    per_conversation: usize,
    entries: HashMap<String, Passed>,
    order: VecDeque<String>,
}

/// A decision for the async shell: hand these turns of a conversation, if still unanswered in
/// the turn registry, to `new_owner`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakeOver {
    /// Conversation.
    pub conversation_id: String,
    /// The member that takes the turns.
    pub new_owner: String,
    /// The seqs it takes over, ascending.
    pub seqs: Vec<i64>,
}

impl PassedTurns {
    /// A memory of at most `conversations` conversations and `per_conversation` turns each.
    pub fn new(conversations: usize, per_conversation: usize) -> PassedTurns {
        PassedTurns {
            conversations: conversations.max(1),
            per_conversation: per_conversation.max(1),
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Records that turn `seq` of a conversation, committed at `at_ms`, went to `owner` (or to
    /// [`NOBODY`]).
    pub fn remember(&mut self, conversation_id: &str, owner: &str, seq: i64, at_ms: i64) {
        if !self.entries.contains_key(conversation_id) {
            if self.entries.len() >= self.conversations
                && let Some(oldest) = self.order.pop_front()
            {
                self.entries.remove(&oldest);
            }
            self.entries
                .insert(conversation_id.to_owned(), Passed::default());
            self.order.push_back(conversation_id.to_owned());
        }
        let Some(entry) = self.entries.get_mut(conversation_id) else {
            return;
        };
        entry.passes.retain(|pass| pass.seq != seq);
        entry.passes.push_back(Pass {
            seq,
            at_ms,
            owner: owner.to_owned(),
        });
        while entry.passes.len() > self.per_conversation {
            if let Some(evicted) = entry.passes.pop_front() {
                entry.evicted_up_to =
                    Some(entry.evicted_up_to.unwrap_or(i64::MIN).max(evicted.seq));
            }
        }
    }

    /// Conversations whose memory overflowed, with the highest seq that fell out.
    pub fn overflowed(&self) -> Vec<(String, i64)> {
        let mut overflowed: Vec<(String, i64)> = self
            .entries
            .iter()
            .filter_map(|(conversation_id, passed)| {
                Some((conversation_id.clone(), passed.evicted_up_to?))
            })
            .collect();
        overflowed.sort();
        overflowed
    }

    /// Forgets an overflow once nothing at or below its seq is unanswered any more.
    pub fn clear_overflow(&mut self, conversation_id: &str) {
        if let Some(entry) = self.entries.get_mut(conversation_id) {
            entry.evicted_up_to = None;
        }
    }

    /// Forgets an answered turn: it is never taken over.
    pub fn answered(&mut self, conversation_id: &str, seq: i64) {
        if let Some(entry) = self.entries.get_mut(conversation_id) {
            entry.passes.retain(|pass| pass.seq != seq);
        }
    }

    /// What is remembered of a conversation.
    pub fn get(&self, conversation_id: &str) -> Option<&Passed> {
        self.entries.get(conversation_id)
    }

    /// Number of conversations remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Re-decides every remembered turn passed to a member that is no longer in `view` (it left,
    /// its node died, or nobody was known): each goes to the owner the view gives for the turn's
    /// own commit time, and the memory moves to it. Called after a leave, and after a join (turns
    /// passed to nobody wait for the next member). Deciding at the turn's time, not at the time
    /// of the leave, makes nodes that learn of the leave at different moments agree.
    pub fn take_over(&mut self, view: &GroupView) -> Vec<TakeOver> {
        let mut decisions: BTreeMap<(String, String), Vec<i64>> = BTreeMap::new();
        for (conversation_id, passed) in self.entries.iter_mut() {
            for pass in passed.passes.iter_mut() {
                if view.contains(&pass.owner) {
                    continue;
                }
                let Some(new_owner) = view.owner(conversation_id, pass.at_ms) else {
                    continue;
                };
                pass.owner = new_owner.to_owned();
                decisions
                    .entry((conversation_id.clone(), new_owner.to_owned()))
                    .or_default()
                    .push(pass.seq);
            }
        }
        decisions
            .into_iter()
            .map(|((conversation_id, new_owner), mut seqs)| {
                seqs.sort_unstable();
                TakeOver {
                    conversation_id,
                    new_owner,
                    seqs,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn an_overflowing_conversation_records_what_fell_out() {
        let mut memory = PassedTurns::new(10, 2);
        memory.remember("c", "m1", 1, 10);
        memory.remember("c", "m1", 2, 20);
        assert!(memory.overflowed().is_empty());
        memory.remember("c", "m2", 3, 30);
        memory.remember("c", "m2", 4, 40);
        assert_eq!(memory.overflowed(), vec![("c".to_owned(), 2)]);
        memory.clear_overflow("c");
        assert!(memory.overflowed().is_empty());
        let kept: Vec<i64> = memory
            .get("c")
            .unwrap()
            .passes
            .iter()
            .map(|pass| pass.seq)
            .collect();
        assert_eq!(kept, [3, 4]);
    }

    /// Test vectors: these values are part of the contract (ADR 0006).
    #[test]
    fn hash_test_vectors() {
        assert_eq!(owner_hash("", ""), splitmix64(0xaf63_bd4c_8601_b7df));
        let vectors = [
            ("conv-1", "conn-a"),
            ("conv-1", "conn-b"),
            (
                "01a22950-e27c-70ee-8573-bb2efb3893ae",
                "7766ad75-64f7-404e-9ed5-16a5dd98a336",
            ),
        ];
        let hashes: Vec<u64> = vectors
            .iter()
            .map(|(conversation, connection)| owner_hash(conversation, connection))
            .collect();
        assert_eq!(hashes, vec![EXPECTED[0], EXPECTED[1], EXPECTED[2]]);
        // The separator matters: ("ab", "c") and ("a", "bc") differ.
        assert_ne!(owner_hash("ab", "c"), owner_hash("a", "bc"));
    }

    const EXPECTED: [u64; 3] = [
        0x7359_ab5a_f7de_ae7c,
        0xbd75_37db_2f81_0133,
        0x445f_1dda_713c_3f46,
    ];

    #[test]
    fn owner_prefers_eligible_members_and_falls_back_to_all() {
        let mut view = GroupView::new();
        view.join("a", 100);
        view.join("b", 200);
        assert_eq!(
            view.owner("conv", 150),
            Some("a"),
            "only a is eligible at 150"
        );
        assert_eq!(
            view.owner("conv", 50),
            Some("a"),
            "nobody eligible: the earliest member counts"
        );
        view.join("c", 100);
        let early = view.owner("conv", 50).unwrap();
        assert!(
            early == "a" || early == "c",
            "members sharing the earliest since both count"
        );
        assert_eq!(GroupView::new().owner("conv", 0), None);
    }

    #[test]
    fn memory_is_bounded_oldest_first() {
        let mut passed = PassedTurns::new(2, 2);
        passed.remember("c1", "a", 1, 0);
        passed.remember("c2", "a", 1, 0);
        passed.remember("c3", "b", 1, 0);
        assert!(passed.get("c1").is_none());
        assert_eq!(passed.len(), 2);
        passed.remember("c3", "b", 5, 0);
        passed.remember("c3", "a", 7, 0);
        let kept: Vec<i64> = passed
            .get("c3")
            .unwrap()
            .passes
            .iter()
            .map(|pass| pass.seq)
            .collect();
        assert_eq!(
            kept,
            vec![5, 7],
            "per conversation the most recent passes are kept"
        );
        passed.answered("c3", 5);
        assert_eq!(passed.get("c3").unwrap().passes.len(), 1);
    }

    #[test]
    fn take_over_moves_only_the_departed_members_conversations() {
        let mut view = GroupView::new();
        for member in ["a", "b", "c"] {
            view.join(member, 0);
        }
        let mut passed = PassedTurns::new(100, 16);
        for n in 0..30 {
            let conversation = format!("conv-{n}");
            let owner = view.owner(&conversation, 10).unwrap().to_owned();
            passed.remember(&conversation, &owner, 3, 10);
        }
        let departed = "b";
        let before: Vec<(String, String)> = (0..30)
            .map(|n| format!("conv-{n}"))
            .map(|conversation| {
                (
                    conversation.clone(),
                    passed.get(&conversation).unwrap().passes[0].owner.clone(),
                )
            })
            .collect();
        view.leave(departed);
        let decisions = passed.take_over(&view);
        let moved: BTreeSet<String> = decisions
            .iter()
            .map(|decision| decision.conversation_id.clone())
            .collect();
        for (conversation, owner) in before {
            assert_eq!(
                moved.contains(&conversation),
                owner == departed,
                "{conversation}"
            );
        }
        assert!(
            decisions
                .iter()
                .all(|decision| decision.new_owner != departed && decision.seqs == vec![3])
        );
    }

    /// One event of the simulated world.
    #[derive(Debug, Clone)]
    enum Event {
        Join,
        Leave(usize),
        Turn(usize),
        Tick(u8),
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![
            1 => Just(Event::Join),
            1 => (0usize..8).prop_map(Event::Leave),
            5 => (0usize..6).prop_map(Event::Turn),
            2 => (0u8..200).prop_map(Event::Tick),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1_000))]

        /// Rendezvous: a member joining (eligible for every turn) takes only conversations it
        /// now wins, and a member leaving moves only the conversations it had.
        #[test]
        fn ownership_moves_only_with_the_member_that_came_or_went(
            members in proptest::collection::btree_set("[a-z0-9]{1,12}", 2..8),
            newcomer in "[A-Z]{1,12}",
        ) {
            let mut view = GroupView::new();
            for member in &members {
                view.join(member, 0);
            }
            let conversations: Vec<String> = (0..200).map(|n| format!("conversation-{n}")).collect();
            let before: Vec<String> = conversations.iter().map(|c| view.owner(c, 10).unwrap().to_owned()).collect();
            let mut joined = view.clone();
            joined.join(&newcomer, 0);
            for (conversation, owner) in conversations.iter().zip(&before) {
                let now = joined.owner(conversation, 10).unwrap();
                prop_assert!(now == owner || now == newcomer);
            }
            let departed = members.iter().next().unwrap().clone();
            let mut left = view.clone();
            left.leave(&departed);
            for (conversation, owner) in conversations.iter().zip(&before) {
                let now = left.owner(conversation, 10).unwrap();
                prop_assert!(now == owner || *owner == departed);
            }
        }

        /// Nodes learn joins and leaves late (by less than the settle delay) and each decides
        /// alone. Checked: a turn is delivered by exactly one node at commit time (no duplicate),
        /// and after any leave every unanswered turn of the departed member has a live owner that
        /// receives it (none delivered to nobody).
        #[test]
        fn every_turn_has_one_owner_and_no_turn_is_stranded(
            events in proptest::collection::vec(event(), 1..80),
            lag_a in 0i64..400,
            lag_b in 0i64..400,
        ) {
            const SETTLE: i64 = 1_000;
            let mut now = 0i64;
            let mut next_member = 0usize;
            // Ground truth and two nodes' views, each learning a join `lag` ms late.
            let mut truth = GroupView::new();
            let mut pending_joins: Vec<(i64, String, i64)> = Vec::new();
            let mut views = [GroupView::new(), GroupView::new()];
            let lags = [lag_a, lag_b];
            let mut memories = [PassedTurns::new(1_000, 1_000), PassedTurns::new(1_000, 1_000)];
            // Which node hosts each member: members alternate between the two nodes.
            fn host(member: &str) -> usize {
                member.trim_start_matches('m').parse::<usize>().unwrap_or(0) % 2
            }
            // A node performs the takeovers that name one of its own members.
            fn apply(
                node: usize,
                decisions: Vec<TakeOver>,
                delivered: &mut BTreeMap<(String, i64), String>,
                answered: &BTreeSet<(String, i64)>,
            ) {
                for decision in decisions {
                    if host(&decision.new_owner) != node {
                        continue;
                    }
                    for seq in decision.seqs {
                        let key = (decision.conversation_id.clone(), seq);
                        if answered.contains(&key) {
                            continue;
                        }
                        if let Some(owner) = delivered.get_mut(&key) {
                            *owner = decision.new_owner.clone();
                        } else {
                            // Passed to nobody at the time: delivered now by the takeover.
                            delivered.insert(key, decision.new_owner.clone());
                        }
                    }
                }
            }
            let mut answered: BTreeSet<(String, i64)> = BTreeSet::new();
            let mut delivered: BTreeMap<(String, i64), String> = BTreeMap::new();
            let mut seq_of: BTreeMap<String, i64> = BTreeMap::new();
            for event in events {
                now += 1;
                // Joins become visible to each node after its lag; a node that sees a join hands
                // it turns stranded by members that left an empty group.
                for node in 0..2 {
                    let mut joined = false;
                    for (at, member, since) in &pending_joins {
                        if now >= at + lags[node] && !views[node].contains(member) && truth.contains(member) {
                            views[node].join(member, *since);
                            joined = true;
                        }
                    }
                    if joined {
                        let decisions = memories[node].take_over(&views[node]);
                        apply(node, decisions, &mut delivered, &answered);
                    }
                }
                match event {
                    Event::Join => {
                        let member = format!("m{next_member}");
                        next_member += 1;
                        let since = now + SETTLE;
                        truth.join(&member, since);
                        pending_joins.push((now, member, since));
                    }
                    Event::Leave(index) => {
                        let Some(member) = truth.members().map(|(member, _)| member.to_owned()).nth(index) else { continue };
                        truth.leave(&member);
                        // Leaves are seen by every node (node death / socket close) before
                        // takeover runs; each node runs its own takeover.
                        for node in 0..2 {
                            views[node].leave(&member);
                            let decisions = memories[node].take_over(&views[node]);
                            apply(node, decisions, &mut delivered, &answered);
                        }
                    }
                    Event::Turn(conversation_index) => {
                        if truth.is_empty() {
                            continue;
                        }
                        let conversation = format!("c{conversation_index}");
                        let seq = seq_of.entry(conversation.clone()).or_insert(0);
                        *seq += 1;
                        let seq = *seq;
                        let mut deliverers = Vec::new();
                        for node in 0..2 {
                            // A node that knows no member yet still remembers the turn, passed to
                            // nobody, so the member it hears of next takes it over.
                            let owner = views[node].owner(&conversation, now).unwrap_or(NOBODY).to_owned();
                            memories[node].remember(&conversation, &owner, seq, now);
                            if owner != NOBODY && host(&owner) == node {
                                deliverers.push(owner);
                            }
                        }
                        prop_assert!(deliverers.len() <= 1, "delivered twice: {deliverers:?}");
                        if let Some(owner) = deliverers.pop() {
                            delivered.insert((conversation, seq), owner);
                        }
                    }
                    Event::Tick(ms) => {
                        now += i64::from(ms);
                        // Owners answer everything they hold at each tick.
                        for (key, owner) in &delivered {
                            if truth.contains(owner) {
                                answered.insert(key.clone());
                            }
                        }
                    }
                }
            }
            // Let every join propagate, then check: nothing unanswered sits with a member that
            // is gone.
            for node in 0..2 {
                let mut joined = false;
                for (_, member, since) in &pending_joins {
                    if !views[node].contains(member) && truth.contains(member) {
                        views[node].join(member, *since);
                        joined = true;
                    }
                }
                if joined {
                    let decisions = memories[node].take_over(&views[node]);
                    apply(node, decisions, &mut delivered, &answered);
                }
            }
            for (key, owner) in &delivered {
                if !answered.contains(key) && !truth.is_empty() {
                    prop_assert!(truth.contains(owner), "turn {key:?} stranded with departed {owner}");
                }
            }
        }
    }
}
