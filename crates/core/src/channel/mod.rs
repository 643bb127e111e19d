//! The channel decider: everything a node decides about one channel's agent connections, as
//! values. It takes the channel actor's events (a local agent joins or leaves, a member of
//! another node appears or goes, frames commit, a replay is asked, a lease runs out) and returns
//! [`Decision`]s; the actor in the gateway performs them (claims, reads, sends) and feeds what
//! it read back in. Nothing here reads a clock or the database.
//!
//! The rules (ADR 0006):
//! - every frame goes to every local observer;
//! - a user turn goes to the owner of each group ([`GroupView::owner`] at the turn's commit
//!   time), which remembers whom it passed each unanswered turn to ([`PassedTurns`]);
//! - a frame of another party (another group's answer, a proactive frame) goes to the owner of
//!   each group that did not write it: a group never gets its own frames back;
//! - when a member leaves, its remembered unanswered turns go to their new owners, and turns
//!   that fell out of memory are read back from the turn registry;
//! - a replay gives a connection what it owns of a conversation after its watermark.

mod decision;
mod handled;
#[cfg(test)]
mod simulation;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap};

pub use decision::{
    CommittedPlan, Decision, FrameFacts, LocalAgent, PendingFacts, StopTimes, TurnId, TurnReason,
};

pub use handled::FORGET_AFTER_MS;

use crate::groups::{GroupView, NOBODY, PassedTurns};
use crate::recent::Recent;
use handled::HandledSeqs;

/// Conversations remembered per group.
pub const MEMORY_CONVERSATIONS: usize = 100_000;
/// Unanswered turns remembered per conversation.
pub const MEMORY_TURNS_PER_CONVERSATION: usize = 64;
/// Conversations with a stop heard before its turn's commit that a decider remembers; past it
/// they are forgotten at once (such a turn is then delivered, and its answer refused).
pub const MEMORY_STOPPED_AHEAD: usize = 10_000;
/// How long (ms) a frame's commit time may precede its commit becoming visible: a conversation
/// new to a node reads its frames from this long before the node began following the channel.
pub const FOLLOW_MARGIN_MS: i64 = 2_000;

/// A join waiting for a read of the unanswered turns.
#[derive(Debug, Clone)]
struct Joining {
    connection_id: String,
    agent: LocalAgent,
}

/// One node's decisions for one channel.
#[derive(Debug, Clone)]
pub struct ChannelDecider {
    agents: BTreeMap<String, LocalAgent>,
    views: BTreeMap<String, GroupView>,
    memories: BTreeMap<String, PassedTurns>,
    /// Highest seq handled per conversation, for conversations handled lately.
    handled: HandledSeqs,
    /// The newest revision handed on per regenerated turn and group (conversation, seq,
    /// group), for turns regenerated lately: a regenerate stores no frame, so this is how a
    /// read-back after a lag tells a regenerate it missed from one it handled (ADR 0041).
    regenerations: Recent<(String, i64, String), i32>,
    /// Turns whose stop arrived before their commit (the two come by different paths): they
    /// are never delivered. Bounded by [`MEMORY_STOPPED_AHEAD`].
    stopped_ahead: HashMap<String, BTreeSet<i64>>,
    /// A join waiting for the channel's unanswered turns to be read back.
    joining: Option<Joining>,
    /// The database time (ms) of the read of the channel's unanswered turns with which this
    /// node began following the channel: that read covers what committed before.
    following_from_ms: Option<i64>,
    /// [`FOLLOW_MARGIN_MS`], or another value for tests.
    follow_margin_ms: i64,
    memory_conversations: usize,
    memory_turns: usize,
}

impl ChannelDecider {
    /// A decider seeded with the members of other nodes: (connection, group, since).
    pub fn new<'a>(remote_members: impl IntoIterator<Item = (&'a str, &'a str, i64)>) -> Self {
        ChannelDecider::with_memory(
            remote_members,
            MEMORY_CONVERSATIONS,
            MEMORY_TURNS_PER_CONVERSATION,
        )
    }

    /// As [`ChannelDecider::new`], with the memory bounded as given (tests).
    pub fn with_memory<'a>(
        remote_members: impl IntoIterator<Item = (&'a str, &'a str, i64)>,
        conversations: usize,
        turns_per_conversation: usize,
    ) -> Self {
        let mut views: BTreeMap<String, GroupView> = BTreeMap::new();
        for (connection_id, group, since_ms) in remote_members {
            views
                .entry(group.to_owned())
                .or_default()
                .join(connection_id, since_ms);
        }
        ChannelDecider {
            agents: BTreeMap::new(),
            views,
            memories: BTreeMap::new(),
            handled: HandledSeqs::new(FORGET_AFTER_MS),
            regenerations: Recent::new(conversations, FORGET_AFTER_MS),
            stopped_ahead: HashMap::new(),
            joining: None,
            following_from_ms: None,
            follow_margin_ms: FOLLOW_MARGIN_MS,
            memory_conversations: conversations,
            memory_turns: turns_per_conversation,
        }
    }

    /// The same decider with another follow margin (simulations, whose clock is in steps).
    pub fn with_follow_margin(mut self, margin_ms: i64) -> Self {
        self.follow_margin_ms = margin_ms;
        self
    }

    /// The same decider forgetting idle conversations after another time (simulations).
    pub fn with_forget_after(mut self, forget_after_ms: i64) -> Self {
        self.handled = HandledSeqs::new(forget_after_ms);
        self.regenerations = Recent::new(self.memory_conversations, forget_after_ms);
        self
    }

    /// Time passed (`now_ms`, any clock that moves forward): conversations handled more than
    /// [`FORGET_AFTER_MS`] ago may be forgotten, so a long-lived channel's memory follows its
    /// recent conversations rather than every conversation it ever saw. A forgotten
    /// conversation's next frame reads back only what committed after the newest frame
    /// forgotten (ADR 0034).
    pub fn forget_idle(&mut self, now_ms: i64) {
        self.handled.forget_idle(now_ms);
        let _ = self.regenerations.forget_idle(now_ms);
    }

    /// The local agent connection, if it is here.
    pub fn agent(&self, connection_id: &str) -> Option<&LocalAgent> {
        self.agents.get(connection_id)
    }

    /// A local agent connection arrived. When it is the channel's first here, this node did not
    /// follow the channel's commits meanwhile; when its group is new here, no turn was ever
    /// remembered for that group. Either way the unanswered turns are read back first
    /// ([`Decision::ReadPendingOfChannel`]) so that turns of members gone meanwhile, or of
    /// nobody, are handed on from here too.
    pub fn join(&mut self, connection_id: &str, agent: LocalAgent) -> Vec<Decision> {
        let first_here = self.agents.is_empty();
        let new_group = agent
            .group
            .as_ref()
            .filter(|group| !self.views.contains_key(*group))
            .cloned();
        if self.joining.is_some() || !(first_here || new_group.is_some()) {
            return self.finish_join(connection_id.to_owned(), agent);
        }
        if let Some(group) = &agent.group {
            self.views.entry(group.clone()).or_default();
        }
        let group = if first_here { None } else { new_group };
        self.joining = Some(Joining {
            connection_id: connection_id.to_owned(),
            agent,
        });
        vec![Decision::ReadPendingOfChannel { group }]
    }

    /// The channel's unanswered turns, read back for [`Decision::ReadPendingOfChannel`] by a
    /// read that began at `read_at_ms` (the database's clock); `None` when the read failed
    /// (then `pending` is empty and only new turns are remembered). Completes a waiting join.
    pub fn pending_read(
        &mut self,
        group: Option<&str>,
        pending: &[PendingFacts],
        read_at_ms: Option<i64>,
    ) -> Vec<Decision> {
        if group.is_none() {
            // The registry is the whole truth now: holes in what this node followed before need
            // no reading back (that would hand turns out a second time, as if they were new).
            self.handled.clear();
            self.following_from_ms = read_at_ms;
        }
        for turn in pending {
            for (view_group, view) in &self.views {
                if group.is_some_and(|group| group != view_group) {
                    continue;
                }
                let owner = view
                    .owner(&turn.conversation_id, turn.at_ms)
                    .unwrap_or(NOBODY);
                memory(
                    &mut self.memories,
                    view_group,
                    self.memory_conversations,
                    self.memory_turns,
                )
                .remember(
                    &turn.conversation_id,
                    owner,
                    (turn.seq, turn.revision),
                    turn.at_ms,
                );
            }
        }
        match self.joining.take() {
            Some(joining) => self.finish_join(joining.connection_id, joining.agent),
            None => Vec::new(),
        }
    }

    fn finish_join(&mut self, connection_id: String, agent: LocalAgent) -> Vec<Decision> {
        let group = agent.group.clone();
        if let Some(group) = &group {
            self.views
                .entry(group.clone())
                .or_default()
                .join(&connection_id, agent.since_ms);
        }
        let Some(group) = group else {
            self.agents.insert(connection_id, agent);
            return Vec::new();
        };
        // Turns decided here while the joiner was unknown here but known elsewhere went to a
        // member whose node gave them to the joiner: this node delivers them now.
        let mut decisions = Vec::new();
        if let (Some(view), Some(memory)) = (self.views.get(&group), self.memories.get_mut(&group))
        {
            let agents = &self.agents;
            for decision in
                memory.hand_to_joiner(view, &connection_id, |owner| agents.contains_key(owner))
            {
                decisions.push(Decision::DeliverPending {
                    to: decision.new_owner,
                    conversation_id: decision.conversation_id,
                    seqs: decision.seqs,
                });
            }
        }
        self.agents.insert(connection_id, agent);
        // Turns passed to nobody (or to members gone meanwhile) wait for the next member.
        decisions.extend(self.take_over(&group));
        decisions
    }

    /// A local agent connection ended: its leases go, and its unanswered turns move on.
    pub fn leave(&mut self, connection_id: &str) -> Vec<Decision> {
        let Some(agent) = self.agents.remove(connection_id) else {
            return Vec::new();
        };
        let mut decisions = Vec::new();
        // The session released its leases before leaving (so other nodes' takeovers claim at
        // once), but this actor may have claimed a turn for it since.
        if agent.leased {
            decisions.push(Decision::ReleaseLeases {
                holder: connection_id.to_owned(),
            });
        }
        let Some(group) = agent.group else {
            return decisions;
        };
        if let Some(view) = self.views.get_mut(&group) {
            view.leave(connection_id);
        }
        decisions.extend(self.take_over(&group));
        decisions
    }

    /// A group member of another node appeared in gossip. A group new here, on a node that
    /// serves agents, has its unanswered turns read back, so this node can hand them on when the
    /// remote member leaves.
    pub fn remote_join(
        &mut self,
        connection_id: &str,
        group: &str,
        since_ms: i64,
    ) -> Vec<Decision> {
        let new_group = !self.views.contains_key(group);
        self.views
            .entry(group.to_owned())
            .or_default()
            .join(connection_id, since_ms);
        if new_group && !self.agents.is_empty() {
            return vec![Decision::ReadPendingOfChannel {
                group: Some(group.to_owned()),
            }];
        }
        Vec::new()
    }

    /// A group member of another node left (withdrawn, or its node died).
    pub fn remote_leave(&mut self, connection_id: &str, group: &str) -> Vec<Decision> {
        let left = self
            .views
            .get_mut(group)
            .is_some_and(|view| view.leave(connection_id));
        if left {
            self.take_over(group)
        } else {
            Vec::new()
        }
    }

    /// The node drains: its members stop owning turns (their sockets stay open a little longer)
    /// and give up their claims, so a late answer carries an old fence and is refused.
    pub fn withdraw_local(&mut self) -> Vec<Decision> {
        let mut decisions = Vec::new();
        let mut groups = BTreeSet::new();
        for (connection_id, agent) in &self.agents {
            let Some(group) = &agent.group else {
                continue;
            };
            if let Some(view) = self.views.get_mut(group) {
                view.leave(connection_id);
            }
            groups.insert(group.clone());
            if agent.leased {
                decisions.push(Decision::ReleaseLeases {
                    holder: connection_id.clone(),
                });
            }
        }
        for group in groups {
            decisions.extend(self.take_over(&group));
        }
        decisions
    }

    /// Lease mode: another holder's lease on a turn ran out; the turn goes to the member if it is
    /// still here and still a member (not withdrawn by a drain).
    pub fn redeliver(&self, connection_id: &str, conversation_id: &str, seq: i64) -> Vec<Decision> {
        let member = self
            .agents
            .get(connection_id)
            .and_then(|agent| agent.group.as_ref())
            .and_then(|group| self.views.get(group))
            .is_some_and(|view| view.contains(connection_id));
        if !member {
            return Vec::new();
        }
        vec![Decision::DeliverPending {
            to: connection_id.to_owned(),
            conversation_id: conversation_id.to_owned(),
            seqs: vec![seq],
        }]
    }

    /// How to handle a committed event of `seq`, with its frame's commit time when the frame
    /// is at hand.
    pub fn plan_committed(
        &self,
        conversation_id: &str,
        seq: i64,
        frame_at_ms: Option<i64>,
    ) -> CommittedPlan {
        let last = self.handled.get(conversation_id);
        if last.is_some_and(|last| seq <= last) {
            return CommittedPlan::Skip;
        }
        // A known conversation with a hole is read back from the hole on.
        if let Some(after) = last.filter(|last| *last < seq - 1) {
            return CommittedPlan::Read {
                after,
                count: seq - after,
            };
        }
        // A conversation new here since this node follows the channel (or forgotten since): an
        // earlier frame of it committed since then may be on its way still (another node's
        // commit arrives after this node's own), and would be skipped once this one is handled.
        // Read them all now; a forgotten conversation's frames up to the newest frame forgotten
        // were handled, so they are left out.
        if let Some(since_ms) = self.following_from_ms.map(|from_ms| {
            let following = from_ms - self.follow_margin_ms;
            match self.handled.forgotten_up_to_ms() {
                Some(forgotten_ms) => following.max(forgotten_ms + 1),
                None => following,
            }
        }) && last.is_none()
            && seq > 1
            && frame_at_ms.is_none_or(|at_ms| at_ms >= since_ms)
        {
            return CommittedPlan::ReadSince {
                since_ms,
                upto: seq,
            };
        }
        match frame_at_ms {
            Some(at_ms) if self.forgotten(last, at_ms) => CommittedPlan::Skip,
            Some(_) => CommittedPlan::Use,
            None => CommittedPlan::Read {
                after: seq - 1,
                count: 1,
            },
        }
    }

    /// The frames of a committed event, up to `seq`, in order: decides each.
    pub fn committed(
        &mut self,
        conversation_id: &str,
        seq: i64,
        frames: &[FrameFacts<'_>],
    ) -> Vec<Decision> {
        let last = self.handled.get(conversation_id);
        let newest_at_ms = frames.iter().map(|frame| frame.at_ms).max();
        self.handled.record(conversation_id, seq, newest_at_ms);
        let mut decisions = Vec::new();
        for (index, frame) in frames.iter().enumerate() {
            if self.forgotten(last, frame.at_ms) {
                continue;
            }
            self.decide_committed(index, frame, &mut decisions);
        }
        decisions
    }

    /// True for a frame of a conversation not remembered (`last` is `None`) that committed at or
    /// before the newest frame forgotten: it was handled before and is heard again (a catch-up
    /// after a long bus outage reads minutes back), or it is later than forgetting allows for
    /// (ADR 0034). Either way it is not decided again.
    fn forgotten(&self, last: Option<i64>, at_ms: i64) -> bool {
        last.is_none()
            && self
                .handled
                .forgotten_up_to_ms()
                .is_some_and(|forgotten_ms| at_ms <= forgotten_ms)
    }

    fn decide_committed(
        &mut self,
        index: usize,
        frame: &FrameFacts<'_>,
        decisions: &mut Vec<Decision>,
    ) {
        for (connection_id, agent) in &self.agents {
            if agent.group.is_none() {
                decisions.push(Decision::SendFrame {
                    to: connection_id.clone(),
                    frame: index,
                });
            }
        }
        if !frame.from_user {
            // An answer completes the turn for every group (the registry keeps one status per
            // turn): nothing is left to hand on, so the memory keeps only unanswered turns.
            if let Some(turn_seq) = frame.turn_seq {
                // A frame that names no revision (stored before answers named theirs) answers
                // whichever is latest.
                let revision = frame.turn_revision.unwrap_or(i32::MAX);
                for memory in self.memories.values_mut() {
                    memory.answered(frame.conversation_id, (turn_seq, revision));
                }
            }
            self.decide_other_party(index, frame, decisions);
            return;
        }
        let turn = TurnId::of(frame);
        if self.was_stopped_ahead(frame.conversation_id, turn.seq) {
            return;
        }
        // A turn committed before the read that began this node's following of the channel may
        // be in that read or not (its commit may have become visible after the read began), and
        // may be answered already: it is handed on only after a check of the registry (as a
        // takeover is), never as a first delivery. A later turn is in the read only if it
        // committed before the read's snapshot, and then the memory has it.
        let uncertain = self
            .following_from_ms
            .is_some_and(|from_ms| frame.at_ms < from_ms);
        for (group, view) in &self.views {
            // A turn the read of the registry already handed on is not handed on twice.
            if turn.revision == 0
                && self
                    .memories
                    .get(group)
                    .is_some_and(|memory| memory.contains(frame.conversation_id, turn.seq))
            {
                continue;
            }
            let owner = view
                .owner(frame.conversation_id, frame.at_ms)
                .unwrap_or(NOBODY);
            memory(
                &mut self.memories,
                group,
                self.memory_conversations,
                self.memory_turns,
            )
            .remember(
                frame.conversation_id,
                owner,
                (turn.seq, turn.revision),
                frame.at_ms,
            );
            if !self.agents.contains_key(owner) {
                continue;
            }
            if uncertain {
                decisions.push(Decision::DeliverPending {
                    to: owner.to_owned(),
                    conversation_id: frame.conversation_id.to_owned(),
                    seqs: vec![turn.seq],
                });
            } else {
                decisions.push(Decision::DeliverTurn {
                    to: owner.to_owned(),
                    frame: index,
                    turn,
                    first: true,
                });
            }
        }
    }

    /// True (once) when the turn's stop arrived before its commit.
    fn was_stopped_ahead(&mut self, conversation_id: &str, seq: i64) -> bool {
        let Some(stopped) = self.stopped_ahead.get_mut(conversation_id) else {
            return false;
        };
        let was = stopped.remove(&seq);
        if stopped.is_empty() {
            self.stopped_ahead.remove(conversation_id);
        }
        was
    }

    /// A frame of another party goes to the owner of each group whose members did not write
    /// it (named like the sender, or one of its local members wrote it).
    fn decide_other_party(
        &self,
        index: usize,
        frame: &FrameFacts<'_>,
        decisions: &mut Vec<Decision>,
    ) {
        for (group, view) in &self.views {
            let written_by_group = group == frame.sender_id
                || self.agents.values().any(|agent| {
                    agent.group.as_deref() == Some(group.as_str())
                        && agent.sender_id == frame.sender_id
                });
            if written_by_group {
                continue;
            }
            let Some(owner) = view.owner(frame.conversation_id, frame.at_ms) else {
                continue;
            };
            let Some(agent) = self.agents.get(owner) else {
                continue;
            };
            if agent.sender_id != frame.sender_id {
                decisions.push(Decision::SendFrame {
                    to: owner.to_owned(),
                    frame: index,
                });
            }
        }
    }

    /// What a connection owns among `frames` of one conversation read for its replay: every
    /// frame for an observer; a member's own user turns (as turns) and the frames of other
    /// parties it owns.
    pub fn replay(&self, connection_id: &str, frames: &[FrameFacts<'_>]) -> Vec<Decision> {
        let Some(agent) = self.agents.get(connection_id) else {
            return Vec::new();
        };
        let view = agent.group.as_ref().and_then(|group| self.views.get(group));
        let mut decisions = Vec::new();
        for (index, frame) in frames.iter().enumerate() {
            let to = connection_id.to_owned();
            let Some(view) = view else {
                decisions.push(Decision::SendFrame { to, frame: index });
                continue;
            };
            if view.owner(frame.conversation_id, frame.at_ms) != Some(connection_id) {
                continue;
            }
            if frame.from_user {
                decisions.push(Decision::DeliverTurn {
                    to,
                    frame: index,
                    turn: TurnId::of(frame),
                    first: false,
                });
            } else if frame.sender_id != agent.sender_id {
                decisions.push(Decision::SendFrame { to, frame: index });
            }
        }
        decisions
    }

    /// A regenerate opened a revision (`turn`) at `at_ms` (its registry row's `created_at`),
    /// heard on the feed or found unanswered by a read-back after a lag: each group
    /// remembers the turn as passed to its owner then, here or not, so that when that owner
    /// leaves the takeover hands the revision on, on whichever node the next owner is (as for
    /// a committed turn). Returns the local owners to hand it to now
    /// ([`ChannelDecider::regeneration_owners`]).
    pub fn regeneration_opened(
        &mut self,
        conversation_id: &str,
        turn: (i64, i32),
        at_ms: i64,
    ) -> Vec<String> {
        for (group, view) in &self.views {
            let owner = view.owner(conversation_id, at_ms).unwrap_or(NOBODY);
            memory(
                &mut self.memories,
                group,
                self.memory_conversations,
                self.memory_turns,
            )
            .remember(conversation_id, owner, turn, at_ms);
        }
        self.regeneration_owners(conversation_id, turn, at_ms)
    }

    /// A regenerate opened `revision` of the turn `seq`, heard on the feed or found unanswered
    /// by a read-back after a lag: the local members that own the conversation at `at_ms` (one
    /// per group at most) answer it again, except in the groups it was handed on in already
    /// ([`ChannelDecider::note_regeneration`]), so neither its event nor a read-back hands a
    /// revision on twice. A revision is remembered for at least [`FORGET_AFTER_MS`] after it was
    /// noted; a read-back that finds it still unanswered later hands it on again (agents
    /// de-duplicate by the turn's key).
    pub fn regeneration_owners(
        &self,
        conversation_id: &str,
        turn: (i64, i32),
        at_ms: i64,
    ) -> Vec<String> {
        let (seq, revision) = turn;
        self.views
            .iter()
            .filter_map(|(group, view)| {
                let owner = view.owner(conversation_id, at_ms)?;
                if !self.agents.contains_key(owner) {
                    return None;
                }
                let key = (conversation_id.to_owned(), seq, group.clone());
                (!self.regeneration_noted(&key, revision)).then(|| owner.to_owned())
            })
            .collect()
    }

    /// Remembers that `revision` of the regenerated turn `seq` was handed to the local member
    /// `to` (after its event, a read-back or a takeover), for `to`'s group; false when it or a
    /// newer revision was handed on in that group already, or `to` is not a member here. The
    /// actor notes a revision once its frame was read, so a failed read is tried again. (Who
    /// holds the revision is the memory of passes': a stop and a takeover read it there.)
    pub fn note_regeneration(&mut self, conversation_id: &str, turn: (i64, i32), to: &str) -> bool {
        let (seq, revision) = turn;
        let Some(group) = self.agents.get(to).and_then(|agent| agent.group.clone()) else {
            return false;
        };
        let key = (conversation_id.to_owned(), seq, group);
        if self.regeneration_noted(&key, revision) {
            return false;
        }
        let _ = self.regenerations.insert(key, revision);
        true
    }

    /// True when `revision` or a newer one of the turn was handed on in the group `key` names.
    fn regeneration_noted(&self, key: &(String, i64, String), revision: i32) -> bool {
        self.regenerations
            .get(key)
            .is_some_and(|noted| *noted >= revision)
    }

    /// A turn's revision was stopped (ADR 0028): it is forgotten, so no takeover hands it on,
    /// and its owner in each group, when that member is here, is told. The owner is the member
    /// the revision was passed to (a takeover moves the pass; when it is not remembered, the
    /// owner when the revision was opened: the turn's commit time for revision 0) and the owner
    /// now.
    pub fn stopped(
        &mut self,
        conversation_id: &str,
        turn: (i64, i32),
        reason: &str,
        times: StopTimes,
    ) -> Vec<Decision> {
        let (seq, revision) = turn;
        // Revision 0 was opened with its turn; a stop from a node of an earlier release does
        // not say when a later one was, and its turn's time stands in.
        let opened_at_ms = times
            .revision_at_ms
            .filter(|_| revision > 0)
            .unwrap_or(times.turn_at_ms);
        let mut told = BTreeSet::new();
        for (group, view) in &self.views {
            // The pass of this revision only: a regenerate heard before an older revision's
            // stop has replaced that revision's pass.
            let passed_to = self
                .memories
                .get(group)
                .and_then(|memory| memory.holder(conversation_id, turn))
                .or_else(|| view.owner(conversation_id, opened_at_ms));
            let owner_now = view.owner(conversation_id, times.now_ms);
            for owner in passed_to.into_iter().chain(owner_now) {
                if self.agents.contains_key(owner) {
                    told.insert(owner.to_owned());
                }
            }
            // Opened before any member was eligible, the turn (or revision) went to the
            // earliest member this node knew then, which need not be the earliest now; once the
            // memory of its pass is gone, only telling every local member of the group reaches
            // the holder. A member that does not hold the turn ignores the cancel
            // (docs/protocol.md 4.10).
            if view.none_eligible_at(opened_at_ms) {
                told.extend(
                    self.agents
                        .iter()
                        .filter(|(_, agent)| agent.group.as_deref() == Some(group.as_str()))
                        .map(|(id, _)| id.clone()),
                );
            }
        }
        for memory in self.memories.values_mut() {
            memory.answered(conversation_id, turn);
        }
        let handled = self
            .handled
            .get(conversation_id)
            .is_some_and(|last| seq <= last)
            || self
                .handled
                .forgotten_up_to_ms()
                .is_some_and(|forgotten_ms| times.turn_at_ms <= forgotten_ms);
        if !handled {
            if self.stopped_ahead.len() >= MEMORY_STOPPED_AHEAD {
                self.stopped_ahead.clear();
            }
            self.stopped_ahead
                .entry(conversation_id.to_owned())
                .or_default()
                .insert(seq);
        }
        told.into_iter()
            .map(|to| Decision::Cancel {
                to,
                conversation_id: conversation_id.to_owned(),
                seq,
                revision,
                reason: reason.to_owned(),
            })
            .collect()
    }

    /// Who receives a transient frame of the conversation (a forwarded client frame, typing,
    /// receipts, presence): every local observer and the current owner of each group.
    pub fn transient_targets(&self, conversation_id: &str, now_ms: i64) -> Vec<String> {
        let owners: Vec<&str> = self
            .views
            .values()
            .filter_map(|view| view.owner(conversation_id, now_ms))
            .collect();
        self.agents
            .iter()
            .filter(|(connection_id, agent)| {
                agent.group.is_none() || owners.contains(&connection_id.as_str())
            })
            .map(|(connection_id, _)| connection_id.clone())
            .collect()
    }

    /// Hands the unanswered turns of departed members of `group` to their new owners here.
    fn take_over(&mut self, group: &str) -> Vec<Decision> {
        let mut decisions = Vec::new();
        let (Some(view), Some(memory)) = (self.views.get(group), self.memories.get_mut(group))
        else {
            return decisions;
        };
        for decision in memory.take_over(view) {
            if self.agents.contains_key(&decision.new_owner) {
                decisions.push(Decision::DeliverPending {
                    to: decision.new_owner,
                    conversation_id: decision.conversation_id,
                    seqs: decision.seqs,
                });
            }
        }
        // Turns that fell out of a conversation's memory are read back from the registry.
        for (conversation_id, up_to) in memory.overflowed() {
            decisions.push(Decision::ReadPendingUpTo {
                group: group.to_owned(),
                conversation_id,
                up_to,
            });
        }
        decisions
    }

    /// A conversation's unanswered turns up to the seq that fell out of `group`'s memory, read
    /// back at a takeover: each goes to the owner the view gives at its (latest revision's)
    /// opening time when that owner is here. Without the memory this node cannot tell whether a
    /// live member already has one, so a turn may be delivered twice; the registry still takes
    /// one answer.
    pub fn pending_up_to_read(
        &mut self,
        group: &str,
        conversation_id: &str,
        pending: &[PendingFacts],
    ) -> Vec<Decision> {
        if pending.is_empty() {
            if let Some(memory) = self.memories.get_mut(group) {
                memory.clear_overflow(conversation_id);
            }
            return Vec::new();
        }
        let Some(view) = self.views.get(group) else {
            return Vec::new();
        };
        let mut by_owner: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for turn in pending {
            if let Some(owner) = view.owner(conversation_id, turn.at_ms)
                && self.agents.contains_key(owner)
            {
                by_owner.entry(owner.to_owned()).or_default().push(turn.seq);
            }
        }
        by_owner
            .into_iter()
            .map(|(to, seqs)| Decision::DeliverPending {
                to,
                conversation_id: conversation_id.to_owned(),
                seqs,
            })
            .collect()
    }
}

/// The group's memory, created on first use.
fn memory<'a>(
    memories: &'a mut BTreeMap<String, PassedTurns>,
    group: &str,
    conversations: usize,
    turns: usize,
) -> &'a mut PassedTurns {
    memories
        .entry(group.to_owned())
        .or_insert_with(|| PassedTurns::new(conversations, turns))
}
