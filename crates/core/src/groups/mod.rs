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

    /// True when no member is eligible at `at_ms` (every `since` is later, or there is no
    /// member): the owner is then the earliest member, which depends on the members known when
    /// it is asked. On a joiner's own node a later `since` may be taken before an earlier one
    /// (a member's `since` is fixed when its session starts, and its node's channel takes it a
    /// moment later), so a turn decided then may have gone to a member that is not the earliest
    /// now. This assumes the node takes a member before its `since` (`group_settle_ms` after
    /// its hello); a channel backed up for longer could take it later still.
    pub fn none_eligible_at(&self, at_ms: i64) -> bool {
        self.members.values().all(|since| *since > at_ms)
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
    /// Its revision passed on: an answer to an older one (heard late) leaves the pass.
    pub revision: i32,
    /// The turn's (or the revision's) commit time: takeovers re-decide at this time, so every
    /// node picks the same new owner whenever it learns of the leave.
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
    /// Each conversation with something to remember, with its place in `order`.
    entries: HashMap<String, (u64, Passed)>,
    /// Conversations by the order they were first remembered in (oldest first).
    order: BTreeMap<u64, String>,
    next_place: u64,
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
            order: BTreeMap::new(),
            next_place: 0,
        }
    }

    /// Records that a turn (seq, revision) of a conversation, committed (or opened) at `at_ms`,
    /// went to `owner` (or to [`NOBODY`]); a pass of a newer revision of the turn stays.
    pub fn remember(&mut self, conversation_id: &str, owner: &str, turn: (i64, i32), at_ms: i64) {
        let (seq, revision) = turn;
        if !self.entries.contains_key(conversation_id) {
            if self.entries.len() >= self.conversations
                && let Some((_, oldest)) = self.order.pop_first()
            {
                self.entries.remove(&oldest);
            }
            let place = self.next_place;
            self.next_place += 1;
            self.entries
                .insert(conversation_id.to_owned(), (place, Passed::default()));
            self.order.insert(place, conversation_id.to_owned());
        }
        let Some((_, entry)) = self.entries.get_mut(conversation_id) else {
            return;
        };
        let newer_passed = entry
            .passes
            .iter()
            .any(|pass| pass.seq == seq && pass.revision > revision);
        if newer_passed {
            return;
        }
        entry.passes.retain(|pass| pass.seq != seq);
        entry.passes.push_back(Pass {
            seq,
            revision,
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
            .filter_map(|(conversation_id, (_, passed))| {
                Some((conversation_id.clone(), passed.evicted_up_to?))
            })
            .collect();
        overflowed.sort();
        overflowed
    }

    /// Forgets an overflow once nothing at or below its seq is unanswered any more.
    pub fn clear_overflow(&mut self, conversation_id: &str) {
        if let Some((_, entry)) = self.entries.get_mut(conversation_id) {
            entry.evicted_up_to = None;
        }
        self.forget_if_empty(conversation_id);
    }

    /// Forgets a turn answered (or stopped) at a revision: it is never taken over. A pass of a
    /// newer revision stays (the answer to an older one may be heard after a regenerate).
    pub fn answered(&mut self, conversation_id: &str, turn: (i64, i32)) {
        let (seq, revision) = turn;
        if let Some((_, entry)) = self.entries.get_mut(conversation_id) {
            entry
                .passes
                .retain(|pass| pass.seq != seq || pass.revision > revision);
        }
        self.forget_if_empty(conversation_id);
    }

    /// A conversation with no unanswered pass and no overflow is forgotten: it holds nothing a
    /// takeover could need, and a channel sees far more answered conversations than open ones.
    fn forget_if_empty(&mut self, conversation_id: &str) {
        let empty = self
            .entries
            .get(conversation_id)
            .is_some_and(|(_, passed)| passed.passes.is_empty() && passed.evicted_up_to.is_none());
        if !empty {
            return;
        }
        if let Some((place, _)) = self.entries.remove(conversation_id) {
            self.order.remove(&place);
        }
    }

    /// True when turn `seq` of the conversation is remembered (passed on and, as far as this
    /// node heard, unanswered).
    pub fn contains(&self, conversation_id: &str, seq: i64) -> bool {
        self.entries
            .get(conversation_id)
            .is_some_and(|(_, passed)| passed.passes.iter().any(|pass| pass.seq == seq))
    }

    /// The member revision `turn.1` of turn `turn.0` was passed to, while it is remembered (a
    /// takeover moves the pass; a pass of another revision names another holder).
    pub fn holder(&self, conversation_id: &str, turn: (i64, i32)) -> Option<&str> {
        let (seq, revision) = turn;
        self.get(conversation_id)?
            .passes
            .iter()
            .find(|pass| pass.seq == seq && pass.revision == revision)
            .map(|pass| pass.owner.as_str())
    }

    /// What is remembered of a conversation.
    pub fn get(&self, conversation_id: &str) -> Option<&Passed> {
        self.entries.get(conversation_id).map(|(_, passed)| passed)
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
    /// own commit time (a regenerated revision's opening time), and the memory moves to it.
    /// Called after a leave, and after a join (turns passed to nobody wait for the next member).
    /// Deciding at the turn's time, not at the time of the leave, makes nodes that learn of the
    /// leave at different moments agree.
    pub fn take_over(&mut self, view: &GroupView) -> Vec<TakeOver> {
        self.redecide(view, |pass, _| !view.contains(&pass.owner))
    }

    /// Re-decides every remembered turn that `joiner`, just added to `view`, owns now but that
    /// was passed to another member. A node decides without its own joining member until that
    /// member's join completes, while other nodes may already count it (gossip announces it
    /// first): such a turn went, here, to a member whose node gave it to the joiner. Only the
    /// joiner's node can deliver it, so it does so now. A turn passed to a member of this node
    /// (`here`) stays with it: that member has it.
    pub fn hand_to_joiner(
        &mut self,
        view: &GroupView,
        joiner: &str,
        here: impl Fn(&str) -> bool,
    ) -> Vec<TakeOver> {
        self.redecide(view, |pass, owner| {
            owner == joiner && pass.owner != joiner && !here(&pass.owner)
        })
    }

    /// Moves each remembered turn for which `moves(pass, owner now)` holds to its owner now.
    fn redecide(&mut self, view: &GroupView, moves: impl Fn(&Pass, &str) -> bool) -> Vec<TakeOver> {
        let mut decisions: BTreeMap<(String, String), Vec<i64>> = BTreeMap::new();
        for (conversation_id, (_, passed)) in self.entries.iter_mut() {
            for pass in passed.passes.iter_mut() {
                let Some(new_owner) = view.owner(conversation_id, pass.at_ms) else {
                    continue;
                };
                if !moves(pass, new_owner) {
                    continue;
                }
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
mod tests;
