//! A cluster of nodes, each running a [`ChannelDecider`] for one channel, driven by random
//! joins, leaves, node deaths, user turns, regenerates, stops, answers and proactive frames,
//! with gossip that tells the other nodes late. The test performs each decision the way the
//! gateway's actor does (reads from a model registry, deliveries recorded per connection) and
//! checks the delivery rules over the whole run.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

const NODES: usize = 3;
/// Eligibility delay of new members; gossip is always faster.
const SETTLE: i64 = 1_000;
const GROUPS: [&str; 2] = ["bot", "auditor"];
/// How much later the other nodes hear of an answer or a proactive frame than its own node.
const ANSWER_LAG: i64 = 20;
/// The longest a notification takes to reach another node: less than gossip takes to tell of a
/// leave (30 ms here), as commit notifications (milliseconds) are faster than failure detection.
const FEED_LAG_MAX: i64 = 29;
/// How long a decider keeps an idle conversation's last seq: longer than any notification
/// takes, short enough that runs forget and revisit conversations often.
const FORGET_AFTER: i64 = 60;

#[derive(Debug, Clone)]
enum Step {
    /// A member of `GROUPS[group]` (or an observer) connects to a node; a member's session
    /// announces it in gossip at once, and its node's channel takes it `lag` ms later.
    Join {
        node: usize,
        group: Option<usize>,
        lag: i64,
    },
    /// The n-th live local connection ends.
    Leave(usize),
    /// Every connection of a node goes at once (kill -9: the others learn it from gossip).
    NodeDies(usize),
    /// The end user of a conversation sends a turn, committed by node `conversation % NODES`;
    /// the other nodes hear of it `lag` ms later (their notification), so a node may see a
    /// later frame of the conversation (its own commit) before this one.
    Turn { conversation: usize, lag: i64 },
    /// A member writes a frame of its own (not an answer) into a conversation.
    Proactive { member: usize, conversation: usize },
    /// The end user stops the conversation's latest unanswered turn (its latest revision);
    /// node `conversation % NODES` stops it (and hears the stop at once), the others `lag` ms
    /// later, in any order with the turn's own commit.
    Stop { conversation: usize, lag: i64 },
    /// The end user regenerates the conversation's latest turn that was answered or stopped: a
    /// new revision, stored as a registry row only. Node `conversation % NODES` opens it (and
    /// hears it at once), the others `lag` ms later, in any order with the answer or the stop.
    Regenerate { conversation: usize, lag: i64 },
    /// Time passes; every member answers what it holds.
    Tick(u8),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => (
            0..NODES,
            proptest::option::weighted(0.8, 0..GROUPS.len()),
            prop_oneof![3 => Just(0i64), 1 => 0i64..1_500],
        )
            .prop_map(|(node, group, lag)| Step::Join { node, group, lag }),
        1 => (0usize..8).prop_map(Step::Leave),
        1 => Just(()).prop_flat_map(|_| 0..NODES).prop_map(Step::NodeDies),
        6 => (0usize..5, prop_oneof![2 => Just(0i64), 1 => 0i64..FEED_LAG_MAX])
            .prop_map(|(conversation, lag)| Step::Turn { conversation, lag }),
        1 => (0usize..8, 0usize..5).prop_map(|(member, conversation)| Step::Proactive { member, conversation }),
        1 => (0usize..5, 0i64..FEED_LAG_MAX)
            .prop_map(|(conversation, lag)| Step::Stop { conversation, lag }),
        1 => (0usize..5, 0i64..FEED_LAG_MAX)
            .prop_map(|(conversation, lag)| Step::Regenerate { conversation, lag }),
        2 => (0u8..200).prop_map(Step::Tick),
    ]
}

/// One stored frame of the model database.
#[derive(Debug, Clone)]
struct Stored {
    conversation: String,
    seq: i64,
    at_ms: i64,
    sender_id: String,
    from_user: bool,
    turn_seq: Option<i64>,
    /// The revision an answer answers.
    turn_revision: Option<i32>,
}

impl Stored {
    fn facts(&self) -> FrameFacts<'_> {
        FrameFacts {
            conversation_id: &self.conversation,
            seq: self.seq,
            at_ms: self.at_ms,
            sender_id: &self.sender_id,
            from_user: self.from_user,
            turn_seq: self.turn_seq,
            turn_revision: self.turn_revision,
        }
    }
}

#[derive(Debug, Clone)]
struct Connection {
    node: usize,
    group: Option<String>,
    sender_id: String,
    joined_at: i64,
    live: bool,
}

#[derive(Default)]
struct Cluster {
    now: i64,
    deciders: Vec<ChannelDecider>,
    connections: BTreeMap<String, Connection>,
    frames: Vec<Stored>,
    next_seq: BTreeMap<String, i64>,
    answered: BTreeSet<(String, i64)>,
    /// Gossip not yet heard: (deliver at, node, event).
    gossip: Vec<(i64, usize, Gossip)>,
    /// Committed frames not yet heard by a node: (at, node, conversation, seq).
    feeds: Vec<(i64, usize, String, i64)>,
    /// Members announced but not yet taken by their node's channel: (at, node, id, agent).
    attaching: Vec<(i64, usize, String, LocalAgent)>,
    /// What each connection was sent: (conversation, seq, revision, first delivery?).
    received: BTreeMap<String, Vec<(String, i64, i32, bool)>>,
    /// Regenerated turns: their latest revision and when it was opened (the registry's rows).
    revisions: BTreeMap<(String, i64), (i32, i64)>,
    /// Regenerates not yet heard by a node.
    regenerates: Vec<(i64, usize, Regenerated)>,
    /// Members a regenerate's event handed its revision to (not takeovers): (conversation, seq,
    /// revision, member).
    regenerated_to: Vec<(String, i64, i32, String)>,
    /// Stops not yet heard by a node.
    stops: Vec<(i64, usize, StopHeard)>,
    /// Stops each node has heard: (node, conversation, seq, revision).
    stops_heard: BTreeSet<(usize, String, i64, i32)>,
    /// The `cancel`s each connection was sent: (conversation, seq, revision).
    cancelled: BTreeMap<String, BTreeSet<(String, i64, i32)>>,
    /// Turn revisions stopped (settled as stopped in the model registry).
    stopped: BTreeSet<(String, i64, i32)>,
    /// Frames each node's decider has been fed, per conversation (the feed stops while a node
    /// has no local agent, as the gateway's bus bridge does).
    fed: Vec<BTreeMap<String, i64>>,
    /// User turns committed, or heard by a node, while a join was still unheard somewhere (or
    /// not yet taken by its own node's channel): then two nodes may each pick a member only
    /// they know as the earliest (the settle delay is what makes this rare).
    racing: BTreeSet<(String, i64)>,
}

/// A regenerate's event: the turn, its new revision and when it was opened.
#[derive(Debug, Clone)]
struct Regenerated {
    conversation: String,
    seq: i64,
    revision: i32,
    opened_at: i64,
}

/// A stop's event: the turn, its revision, the turn's commit time and the revision's opening.
#[derive(Debug, Clone)]
struct StopHeard {
    conversation: String,
    seq: i64,
    revision: i32,
    turn_at: i64,
    opened_at: i64,
}

#[derive(Debug, Clone)]
enum Gossip {
    Joined {
        connection: String,
        group: String,
        since: i64,
    },
    Left {
        connection: String,
        group: String,
    },
}

impl Cluster {
    fn new() -> Cluster {
        Cluster {
            deciders: (0..NODES)
                .map(|_| {
                    ChannelDecider::with_memory(std::iter::empty(), 1_000, 2)
                        .with_follow_margin(3)
                        .with_forget_after(FORGET_AFTER)
                })
                .collect(),
            fed: vec![BTreeMap::new(); NODES],
            ..Cluster::default()
        }
    }

    /// One millisecond passes: each node's channel may forget idle conversations.
    fn pass_time(&mut self) {
        self.now += 1;
        for decider in &mut self.deciders {
            decider.forget_idle(self.now);
        }
    }

    /// True while a join is unheard somewhere, or not yet taken by its own node's channel.
    fn join_in_flight(&self) -> bool {
        self.gossip
            .iter()
            .any(|(_, _, event)| matches!(event, Gossip::Joined { .. }))
            || !self.attaching.is_empty()
    }

    fn has_local_agents(&self, node: usize) -> bool {
        self.connections
            .values()
            .any(|connection| connection.live && connection.node == node)
    }

    /// Performs decisions as the gateway's actor does; follow-ups of a read go first.
    fn perform(&mut self, node: usize, decisions: Vec<Decision>, frames: &[Stored]) {
        let mut queue: std::collections::VecDeque<Decision> = decisions.into();
        while let Some(decision) = queue.pop_front() {
            match decision {
                Decision::SendFrame { to, frame } => {
                    let frame = &frames[frame];
                    self.deliver(&to, &frame.conversation, (frame.seq, 0), false);
                }
                Decision::DeliverTurn {
                    to, frame, first, ..
                } => {
                    let frame = &frames[frame];
                    self.deliver(&to, &frame.conversation, (frame.seq, 0), first);
                }
                Decision::DeliverPending {
                    to,
                    conversation_id,
                    seqs,
                } => {
                    // As the actor does: the turn's latest revision, noted when regenerated.
                    for seq in seqs {
                        if self.answered.contains(&(conversation_id.clone(), seq)) {
                            continue;
                        }
                        let (revision, _) = self.latest_revision(&conversation_id, seq);
                        if revision > 0 {
                            self.deciders[node].note_regeneration(
                                &conversation_id,
                                (seq, revision),
                                &to,
                            );
                        }
                        self.deliver(&to, &conversation_id, (seq, revision), false);
                    }
                }
                Decision::ReadPendingOfChannel { group } => {
                    let pending = self.pending(|_| true);
                    let follow = self.deciders[node].pending_read(
                        group.as_deref(),
                        &pending,
                        Some(self.now),
                    );
                    prepend(&mut queue, follow);
                }
                Decision::ReadPendingUpTo {
                    group,
                    conversation_id,
                    up_to,
                } => {
                    let pending = self.pending(|turn| {
                        turn.conversation_id == conversation_id && turn.seq <= up_to
                    });
                    let follow =
                        self.deciders[node].pending_up_to_read(&group, &conversation_id, &pending);
                    prepend(&mut queue, follow);
                }
                Decision::Cancel {
                    to,
                    conversation_id,
                    seq,
                    revision,
                    ..
                } => {
                    self.cancelled
                        .entry(to)
                        .or_default()
                        .insert((conversation_id, seq, revision));
                }
                Decision::ReleaseLeases { .. } => {}
            }
        }
    }

    fn pending(&self, keep: impl Fn(&PendingFacts) -> bool) -> Vec<PendingFacts> {
        self.frames
            .iter()
            .filter(|frame| frame.from_user)
            .filter(|frame| {
                !self
                    .answered
                    .contains(&(frame.conversation.clone(), frame.seq))
            })
            .map(|frame| {
                let revision = self.revisions.get(&(frame.conversation.clone(), frame.seq));
                let (revision, at_ms) = revision.copied().unwrap_or((0, frame.at_ms));
                PendingFacts {
                    conversation_id: frame.conversation.clone(),
                    seq: frame.seq,
                    revision,
                    at_ms,
                }
            })
            .filter(|turn| keep(turn))
            .collect()
    }

    /// When `node` hears of something that happened now on node `origin`: at once there, `lag`
    /// ms later elsewhere.
    fn heard_at(&self, node: usize, origin: usize, lag: i64) -> i64 {
        if node == origin {
            self.now
        } else {
            self.now + lag
        }
    }

    /// A turn's latest revision and when it was opened (revision 0: its commit time).
    fn latest_revision(&self, conversation: &str, seq: i64) -> (i32, i64) {
        if let Some(latest) = self.revisions.get(&(conversation.to_owned(), seq)) {
            return *latest;
        }
        let frame = self
            .frames
            .iter()
            .find(|frame| frame.conversation == conversation && frame.seq == seq)
            .expect("a turn is a stored frame");
        (0, frame.at_ms)
    }

    fn deliver(&mut self, to: &str, conversation: &str, turn: (i64, i32), first: bool) {
        let (seq, revision) = turn;
        let live = self
            .connections
            .get(to)
            .is_some_and(|connection| connection.live);
        assert!(live, "a decision named {to}, which is gone");
        // Observers get every frame, the turn's included; members get turns.
        let member = &self.connections[to];
        let node = member.node;
        assert!(
            member.group.is_none()
                || !self
                    .stops_heard
                    .contains(&(node, conversation.to_owned(), seq, revision)),
            "turn {conversation}:{seq}:{revision} delivered to {to} after node {node} heard its stop"
        );
        self.received.entry(to.to_owned()).or_default().push((
            conversation.to_owned(),
            seq,
            revision,
            first,
        ));
    }

    fn join(&mut self, node: usize, group: Option<&str>, lag: i64) {
        let id = format!("n{node}-a{}", self.connections.len());
        let since = self.now + SETTLE;
        let sender_id = group.unwrap_or("agent").to_owned();
        self.connections.insert(
            id.clone(),
            Connection {
                node,
                group: group.map(str::to_owned),
                sender_id: sender_id.clone(),
                joined_at: self.now,
                live: true,
            },
        );
        let agent = LocalAgent {
            group: group.map(str::to_owned),
            since_ms: since,
            sender_id,
            leased: false,
        };
        let Some(group) = group else {
            // Observers are checked from their join on: their channel takes them at once.
            self.attach(node, &id, agent);
            return;
        };
        for other in (0..NODES).filter(|other| *other != node) {
            let gossip_lag = 50 + 100 * other as i64;
            self.gossip.push((
                self.now + gossip_lag,
                other,
                Gossip::Joined {
                    connection: id.clone(),
                    group: group.to_owned(),
                    since,
                },
            ));
        }
        self.attaching.push((self.now + lag, node, id, agent));
    }

    fn attach(&mut self, node: usize, id: &str, agent: LocalAgent) {
        let decisions = self.deciders[node].join(id, agent);
        self.perform(node, decisions, &[]);
    }

    /// Hands announced members to their node's channel once their lag is over (all: now).
    fn attach_due(&mut self, all: bool) {
        let now = self.now;
        let due = take_due(&mut self.attaching, now, all, |(at, ..)| *at);
        for (_, node, id, agent) in due {
            if self.connections.get(&id).is_some_and(|c| c.live) {
                self.attach(node, &id, agent);
            }
        }
    }

    fn leave(&mut self, id: &str) {
        let Some(connection) = self.connections.get_mut(id).filter(|c| c.live) else {
            return;
        };
        connection.live = false;
        let node = connection.node;
        let group = connection.group.clone();
        let decisions = self.deciders[node].leave(id);
        self.perform(node, decisions, &[]);
        if let Some(group) = group {
            for other in (0..NODES).filter(|other| *other != node) {
                self.gossip.push((
                    self.now + 30,
                    other,
                    Gossip::Left {
                        connection: id.to_owned(),
                        group: group.clone(),
                    },
                ));
            }
        }
    }

    fn hear_gossip(&mut self, all: bool) {
        let now = self.now;
        let due = take_due(&mut self.gossip, now, all, |(at, ..)| *at);
        for (_, node, event) in due {
            match event {
                Gossip::Joined {
                    connection,
                    group,
                    since,
                } => {
                    let live = self.connections.get(&connection).is_some_and(|c| c.live);
                    if live {
                        let decisions = self.deciders[node].remote_join(&connection, &group, since);
                        self.perform(node, decisions, &[]);
                    }
                }
                Gossip::Left { connection, group } => {
                    let decisions = self.deciders[node].remote_leave(&connection, &group);
                    self.perform(node, decisions, &[]);
                }
            }
        }
    }

    /// Commits a frame (an answer names its turn and revision); node `origin` hears of it at
    /// once, the others `lag` ms later.
    fn commit(
        &mut self,
        conversation: &str,
        sender_id: &str,
        from_user: bool,
        answers: Option<(i64, i32)>,
        origin: usize,
        lag: i64,
    ) {
        let seq = {
            let next = self.next_seq.entry(conversation.to_owned()).or_insert(0);
            *next += 1;
            *next
        };
        if from_user && self.join_in_flight() {
            self.racing.insert((conversation.to_owned(), seq));
        }
        self.frames.push(Stored {
            conversation: conversation.to_owned(),
            seq,
            at_ms: self.now,
            sender_id: sender_id.to_owned(),
            from_user,
            turn_seq: answers.map(|(seq, _)| seq),
            turn_revision: answers.map(|(_, revision)| revision),
        });
        for node in 0..NODES {
            let at = self.heard_at(node, origin, lag);
            self.feeds.push((at, node, conversation.to_owned(), seq));
        }
        self.hear_feeds(false);
    }

    /// Feeds each node the frames it hears by now (all: every one left), as the bus bridge
    /// does: only to a node with agents of the channel.
    fn hear_feeds(&mut self, all: bool) {
        let now = self.now;
        let due = take_due(&mut self.feeds, now, all, |(at, ..)| *at);
        for (_, node, conversation, seq) in due {
            self.feed(node, &conversation, seq);
        }
    }

    fn feed(&mut self, node: usize, conversation: &str, seq: i64) {
        if !self.has_local_agents(node) {
            return;
        }
        // Decided while a join is still unheard somewhere: two nodes may each pick a member
        // only they know as the earliest, as for a turn committed then.
        if self.join_in_flight() {
            self.racing.insert((conversation.to_owned(), seq));
        }
        let of_conversation = |frame: &&Stored| frame.conversation == conversation;
        let at_ms = self
            .frames
            .iter()
            .find(|frame| frame.conversation == conversation && frame.seq == seq)
            .map(|frame| frame.at_ms);
        let plan = self.deciders[node].plan_committed(conversation, seq, at_ms);
        let frames: Vec<Stored> = match plan {
            CommittedPlan::Skip => return,
            CommittedPlan::Use => self
                .frames
                .iter()
                .filter(of_conversation)
                .filter(|frame| frame.seq == seq)
                .cloned()
                .collect(),
            CommittedPlan::Read { after, count } => self
                .frames
                .iter()
                .filter(of_conversation)
                .filter(|frame| frame.seq > after && frame.seq <= after + count)
                .cloned()
                .collect(),
            CommittedPlan::ReadSince { since_ms, upto } => self
                .frames
                .iter()
                .filter(of_conversation)
                .filter(|frame| frame.seq <= upto && frame.at_ms >= since_ms)
                .cloned()
                .collect(),
        };
        let facts: Vec<FrameFacts<'_>> = frames.iter().map(Stored::facts).collect();
        let decisions = self.deciders[node].committed(conversation, seq, &facts);
        self.fed[node].insert(conversation.to_owned(), seq);
        self.perform(node, decisions, &frames);
    }

    /// Stops the conversation's latest unanswered turn, if any (its latest revision): the
    /// registry settles it at once (the grace period is the agent's; no answer of it is
    /// modelled), and node `origin` hears the stop now, the others `lag` ms later.
    fn stop(&mut self, conversation: &str, origin: usize, lag: i64) {
        let latest = self
            .frames
            .iter()
            .rev()
            .filter(|frame| frame.conversation == conversation && frame.from_user)
            .find(|frame| {
                !self
                    .answered
                    .contains(&(conversation.to_owned(), frame.seq))
            })
            .map(|frame| (frame.seq, frame.at_ms));
        let Some((seq, turn_at)) = latest else {
            return;
        };
        let (revision, opened_at) = self.latest_revision(conversation, seq);
        self.answered.insert((conversation.to_owned(), seq));
        self.stopped
            .insert((conversation.to_owned(), seq, revision));
        let stop = StopHeard {
            conversation: conversation.to_owned(),
            seq,
            revision,
            turn_at,
            opened_at,
        };
        for node in 0..NODES {
            let at = self.heard_at(node, origin, lag);
            self.stops.push((at, node, stop.clone()));
        }
        self.hear_stops(false);
    }

    /// Hands each node the stops it hears by now (all: every one left), as the bus bridge
    /// does: only to a node with agents of the channel.
    fn hear_stops(&mut self, all: bool) {
        let now = self.now;
        let due = take_due(&mut self.stops, now, all, |(at, ..)| *at);
        for (_, node, stop) in due {
            if !self.has_local_agents(node) {
                continue;
            }
            let StopHeard {
                conversation,
                seq,
                revision,
                turn_at,
                opened_at,
            } = stop;
            self.stops_heard
                .insert((node, conversation.clone(), seq, revision));
            let times = StopTimes {
                turn_at_ms: turn_at,
                revision_at_ms: Some(opened_at),
                now_ms: now,
            };
            let decisions =
                self.deciders[node].stopped(&conversation, (seq, revision), "stopped", times);
            self.perform(node, decisions, &[]);
        }
    }

    /// Regenerates the conversation's latest turn that is answered or stopped: the registry opens
    /// its next revision, unanswered, and node `origin` hears it now, the others `lag` ms later
    /// (in any order with the answer or the stop before it).
    fn regenerate(&mut self, conversation: &str, origin: usize, lag: i64) {
        let latest = self
            .frames
            .iter()
            .rev()
            .filter(|frame| frame.conversation == conversation && frame.from_user)
            .map(|frame| frame.seq)
            .find(|seq| self.answered.contains(&(conversation.to_owned(), *seq)));
        let Some(seq) = latest else {
            return;
        };
        let (revision, _) = self.latest_revision(conversation, seq);
        let revision = revision + 1;
        self.revisions
            .insert((conversation.to_owned(), seq), (revision, self.now));
        self.answered.remove(&(conversation.to_owned(), seq));
        if self.join_in_flight() {
            self.racing.insert((conversation.to_owned(), seq));
        }
        let regenerated = Regenerated {
            conversation: conversation.to_owned(),
            seq,
            revision,
            opened_at: self.now,
        };
        for node in 0..NODES {
            let at = self.heard_at(node, origin, lag);
            self.regenerates.push((at, node, regenerated.clone()));
        }
        self.hear_regenerates(false);
    }

    /// Hands each node the regenerates it hears by now (all: every one left), as the actor
    /// does: every group remembers the revision as passed to its owner when it was opened, and
    /// the local owners get it while it is still the turn's unanswered revision.
    fn hear_regenerates(&mut self, all: bool) {
        let now = self.now;
        let due = take_due(&mut self.regenerates, now, all, |(at, ..)| *at);
        for (_, node, event) in due {
            if !self.has_local_agents(node) {
                continue;
            }
            let Regenerated {
                conversation,
                seq,
                revision,
                opened_at,
            } = event;
            if self.join_in_flight() {
                self.racing.insert((conversation.clone(), seq));
            }
            let turn = (seq, revision);
            let owners = self.deciders[node].regeneration_opened(&conversation, turn, opened_at);
            let unanswered = !self.answered.contains(&(conversation.clone(), seq))
                && self.latest_revision(&conversation, seq).0 == revision;
            if !unanswered {
                continue;
            }
            for owner in owners {
                self.deciders[node].note_regeneration(&conversation, turn, &owner);
                self.regenerated_to
                    .push((conversation.clone(), seq, revision, owner.clone()));
                self.deliver(&owner, &conversation, turn, false);
            }
        }
    }

    /// Every live member answers the unanswered turns it was sent.
    fn answer_everything(&mut self) {
        let mut answers = Vec::new();
        for (id, connection) in &self.connections {
            if !connection.live || connection.group.is_none() {
                continue;
            }
            for (conversation, seq, revision, _) in self.received.get(id).into_iter().flatten() {
                let is_turn = self
                    .frames
                    .iter()
                    .any(|f| f.conversation == *conversation && f.seq == *seq && f.from_user);
                if is_turn && !self.answered.contains(&(conversation.clone(), *seq)) {
                    answers.push((
                        conversation.clone(),
                        (*seq, *revision),
                        connection.sender_id.clone(),
                        connection.node,
                    ));
                }
            }
        }
        for (conversation, (seq, revision), sender_id, node) in answers {
            // An answer to a revision a regenerate replaced is refused (superseded).
            if self.latest_revision(&conversation, seq).0 != revision {
                continue;
            }
            if self.answered.insert((conversation.clone(), seq)) {
                self.commit(
                    &conversation,
                    &sender_id,
                    false,
                    Some((seq, revision)),
                    node,
                    ANSWER_LAG,
                );
            }
        }
    }

    fn live_members(&self, group: &str) -> Vec<&String> {
        self.connections
            .iter()
            .filter(|(_, c)| c.live && c.group.as_deref() == Some(group))
            .map(|(id, _)| id)
            .collect()
    }
}

/// Takes out of `queue` what is due by `now` (all: everything), in the order it was queued.
fn take_due<T>(queue: &mut Vec<T>, now: i64, all: bool, at: impl Fn(&T) -> i64) -> Vec<T> {
    let (due, later) = std::mem::take(queue)
        .into_iter()
        .partition(|event| all || at(event) <= now);
    *queue = later;
    due
}

fn prepend(queue: &mut std::collections::VecDeque<Decision>, follow: Vec<Decision>) {
    for decision in follow.into_iter().rev() {
        queue.push_front(decision);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(600))]

    /// Over a random run: a turn's first delivery happens once per group at most, and so does
    /// a regenerated revision's; no group receives its own frames; observers receive every
    /// frame committed while they were connected, once and in order; no unanswered turn (its
    /// latest revision) is left with nobody alive to answer it; every member holding a
    /// stopped revision is told; and a member's replay gives it exactly the user turns it owns.
    #[test]
    fn the_channel_rules_hold_across_nodes(steps in proptest::collection::vec(step(), 1..120)) {
        let mut cluster = Cluster::new();
        for step in steps {
            cluster.pass_time();
            cluster.hear_feeds(false);
            cluster.hear_regenerates(false);
            cluster.hear_stops(false);
            cluster.hear_gossip(false);
            cluster.attach_due(false);
            match step {
                Step::Join { node, group, lag } => cluster.join(node, group.map(|g| GROUPS[g]), lag),
                Step::Leave(index) => {
                    let id = cluster.connections.iter().filter(|(_, c)| c.live).map(|(id, _)| id.clone()).nth(index);
                    if let Some(id) = id {
                        cluster.leave(&id);
                    }
                }
                Step::NodeDies(node) => {
                    let ids: Vec<String> = cluster.connections.iter().filter(|(_, c)| c.live && c.node == node).map(|(id, _)| id.clone()).collect();
                    for id in ids {
                        cluster.leave(&id);
                    }
                }
                Step::Turn { conversation, lag } => cluster.commit(&format!("c{conversation}"), "user-1", true, None, conversation % NODES, lag),
                Step::Proactive { member, conversation } => {
                    let writer = cluster.connections.values().filter(|c| c.live && c.group.is_some()).nth(member).map(|c| (c.sender_id.clone(), c.node));
                    if let Some((sender_id, node)) = writer {
                        cluster.commit(&format!("c{conversation}"), &sender_id, false, None, node, ANSWER_LAG);
                    }
                }
                Step::Stop { conversation, lag } => cluster.stop(&format!("c{conversation}"), conversation % NODES, lag),
                Step::Regenerate { conversation, lag } => cluster.regenerate(&format!("c{conversation}"), conversation % NODES, lag),
                Step::Tick(ms) => {
                    // A millisecond at a time, so that what is due earlier is heard earlier.
                    for _ in 0..ms {
                        cluster.pass_time();
                        cluster.hear_feeds(false);
                        cluster.hear_regenerates(false);
                        cluster.hear_stops(false);
                        cluster.hear_gossip(false);
                        cluster.attach_due(false);
                    }
                    cluster.answer_everything();
                }
            }
        }
        cluster.now += SETTLE;
        cluster.hear_feeds(true);
        cluster.hear_regenerates(true);
        cluster.hear_stops(true);
        cluster.hear_gossip(true);
        cluster.attach_due(true);
        cluster.hear_feeds(true);

        // A stopped turn's holders are told: every live member that was given the stopped
        // revision, on a node that heard the stop, got a `cancel` (unless a join was still
        // unheard somewhere).
        for (id, received) in &cluster.received {
            let connection = &cluster.connections[id];
            if !connection.live || connection.group.is_none() {
                continue;
            }
            for (conversation, seq, revision, _) in received {
                let turn = (conversation.clone(), *seq, *revision);
                if !cluster.stopped.contains(&turn) || cluster.racing.contains(&(conversation.clone(), *seq)) {
                    continue;
                }
                if !cluster.stops_heard.contains(&(connection.node, conversation.clone(), *seq, *revision)) {
                    continue;
                }
                let told = cluster.cancelled.get(id).is_some_and(|told| told.contains(&turn));
                prop_assert!(told, "{} holds stopped turn {:?} and was not told", id, turn);
            }
        }

        // A regenerated revision's event hands it to one member per group, the same on every
        // node (unless a join was still unheard somewhere).
        let mut handed: BTreeMap<(String, i64, i32, String), BTreeSet<&String>> = BTreeMap::new();
        for (conversation, seq, revision, member) in &cluster.regenerated_to {
            if cluster.racing.contains(&(conversation.clone(), *seq)) {
                continue;
            }
            let group = cluster.connections[member].group.clone().expect("members have a group");
            handed.entry((conversation.clone(), *seq, *revision, group)).or_default().insert(member);
        }
        for (revision, members) in &handed {
            prop_assert_eq!(members.len(), 1, "revision {:?} handed to {:?}", revision, members);
        }

        // A turn's first delivery: once per group at most (unless a join was still unheard).
        let mut first: BTreeMap<(String, i64, String), usize> = BTreeMap::new();
        for (id, received) in &cluster.received {
            let Some(group) = cluster.connections[id].group.clone() else { continue };
            for (conversation, seq, _, is_first) in received {
                if *is_first && !cluster.racing.contains(&(conversation.clone(), *seq)) {
                    *first.entry((conversation.clone(), *seq, group.clone())).or_default() += 1;
                }
            }
        }
        for (turn, count) in &first {
            prop_assert_eq!(*count, 1, "turn {:?} first-delivered {} times: {:?}", turn, count, cluster.received);
        }

        // No group receives a frame its own members wrote.
        for (id, received) in &cluster.received {
            let connection = &cluster.connections[id];
            let Some(group) = &connection.group else { continue };
            for (conversation, seq, _, _) in received {
                let frame = cluster.frames.iter().find(|f| f.conversation == *conversation && f.seq == *seq).expect("sent frames exist");
                prop_assert!(frame.from_user || frame.sender_id != *group, "{} got its group's own frame {:?}", id, frame);
            }
        }

        // Observers: every frame committed while connected, once, in order per conversation.
        for (id, connection) in cluster.connections.iter().filter(|(_, c)| c.group.is_none()) {
            let received: Vec<(String, i64)> = cluster.received.get(id).into_iter().flatten().map(|(c, s, _, _)| (c.clone(), *s)).collect();
            let mut by_conversation: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
            for (conversation, seq) in &received {
                by_conversation.entry(conversation).or_default().push(*seq);
            }
            for seqs in by_conversation.values() {
                prop_assert!(seqs.windows(2).all(|pair| pair[0] < pair[1]), "{} out of order or twice: {:?}", id, seqs);
            }
            if connection.live {
                for frame in cluster.frames.iter().filter(|f| f.at_ms > connection.joined_at) {
                    prop_assert!(received.contains(&(frame.conversation.clone(), frame.seq)), "observer {} missed {:?}", id, frame);
                }
            }
        }

        // Nothing unanswered is stranded: each group with live members has every unanswered turn
        // (its latest revision) with one of them.
        for group in GROUPS {
            let members = cluster.live_members(group);
            if members.is_empty() {
                continue;
            }
            for turn in cluster.pending(|_| true) {
                let held = members.iter().any(|member| {
                    cluster.received.get(*member).is_some_and(|received| {
                        received.iter().any(|(c, s, r, _)| {
                            *c == turn.conversation_id && *s == turn.seq && *r == turn.revision
                        })
                    })
                });
                prop_assert!(held, "group {} left turn {:?} with nobody", group, turn);
            }
        }

        // A replay gives a member exactly the user turns it owns (by its node's view, which
        // agrees with every other node's once gossip settled).
        for (id, connection) in cluster.connections.iter().filter(|(_, c)| c.live && c.group.is_some()) {
            let decider = &cluster.deciders[connection.node];
            for conversation in (0..5).map(|n| format!("c{n}")) {
                let frames: Vec<Stored> = cluster.frames.iter().filter(|f| f.conversation == conversation).cloned().collect();
                let facts: Vec<FrameFacts<'_>> = frames.iter().map(Stored::facts).collect();
                let replayed: BTreeSet<i64> = decider.replay(id, &facts).into_iter().filter_map(|decision| match decision {
                    Decision::DeliverTurn { frame, .. } => Some(frames[frame].seq),
                    _ => None,
                }).collect();
                let group = connection.group.as_deref().expect("members have a group");
                let mut view = GroupView::new();
                for (member, other) in cluster.connections.iter().filter(|(_, c)| c.live && c.group.as_deref() == Some(group)) {
                    view.join(member, other.joined_at + SETTLE);
                }
                let owned: BTreeSet<i64> = frames.iter().filter(|f| f.from_user && view.owner(&conversation, f.at_ms) == Some(id.as_str())).map(|f| f.seq).collect();
                prop_assert_eq!(replayed, owned, "replay of {} for {}", conversation, id);
            }
        }
    }
}
