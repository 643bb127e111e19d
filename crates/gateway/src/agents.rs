//! The channel actor: one per node and channel with agents connected. It owns the local agent
//! connections, each group's member view and passed-turn memory, and turns the channel's live
//! events into deliveries: every frame to observers, each user turn to the owner of each group,
//! and, when a member leaves, its unanswered turns to the new owner (ADR 0006).

use std::collections::HashMap;
use std::sync::Arc;

use converger_core::groups::{GroupView, NOBODY, PassedTurns, TakeOver};
use converger_store::{Activity, Claim, Store, Viewer};
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use uuid::Uuid;

use converger_cluster::MembershipEvent;

use crate::hub::{ChannelEvent, Hub, HubEvent};

/// Conversations remembered per group, and turns per conversation.
const MEMORY_CONVERSATIONS: usize = 100_000;
const MEMORY_TURNS_PER_CONVERSATION: usize = 64;

/// How long the actor waits before reading a frame again that the database did not return.
const FRAMES_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Unanswered turns older than this are not handed on when a node starts serving a channel.
const PENDING_TURNS_HORIZON: std::time::Duration = std::time::Duration::from_secs(3_600);

/// The turn a delivery is for (PROTOCOL section 5: `meta.turn`).
#[derive(Debug, Clone, Copy)]
struct TurnRef<'a> {
    seq: i64,
    revision: i32,
    /// `edit` or `regenerate` for revisions above 0.
    reason: Option<&'a str>,
}

impl TurnRef<'_> {
    /// The turn a user frame stands for: an edit is revision + 1 of the turn it replaces,
    /// any other user frame is a new turn at revision 0.
    fn of(activity: &Activity) -> TurnRef<'static> {
        match (activity.turn_seq, activity.turn_revision) {
            (Some(seq), Some(revision)) => TurnRef {
                seq,
                revision,
                reason: Some("edit"),
            },
            _ => TurnRef {
                seq: activity.seq,
                revision: 0,
                reason: None,
            },
        }
    }

    fn to_json(self, conversation_id: Uuid) -> Value {
        let mut turn = json!({
            "seq": self.seq,
            "revision": self.revision,
            "key": format!("{conversation_id}:{}:{}", self.seq, self.revision),
        });
        if let Some(reason) = self.reason {
            turn["reason"] = json!(reason);
        }
        turn
    }
}

/// What the actor is told by agent sessions.
#[derive(Debug)]
pub enum ActorMessage {
    /// An agent connection arrived.
    Join {
        /// Its connection id.
        connection_id: String,
        /// Its group, `None` for an observer.
        group: Option<String>,
        /// Eligibility time (ms).
        since_ms: i64,
        /// The `sender.id` its frames are stored with.
        sender_id: String,
        /// Lease mode: each turn is claimed for this long before it is delivered.
        lease: Option<std::time::Duration>,
        /// Where its deliveries go.
        deliveries: mpsc::UnboundedSender<Delivery>,
    },
    /// Replay, for one agent connection, the frames of a conversation after `watermark` that it
    /// owns (every frame for an observer): `hello.watermarks` and enveloped `sync`.
    Replay {
        /// The agent connection.
        connection_id: String,
        /// Conversation (checked by the session to belong to the channel).
        conversation_id: Uuid,
        /// Frames after this seq.
        watermark: i64,
        /// At most this many frames are read.
        limit: i64,
    },
    /// An agent connection ended.
    Leave {
        /// Its connection id.
        connection_id: String,
    },
    /// A group member of another node appeared in gossip.
    RemoteJoin {
        /// Its connection id.
        connection_id: String,
        /// Its group.
        group: String,
        /// Eligibility time (ms).
        since_ms: i64,
    },
    /// A group member of another node left (withdrawn, or its node died).
    RemoteLeave {
        /// Its connection id.
        connection_id: String,
        /// Its group.
        group: String,
    },
    /// The node drains: its members stop owning turns (their sockets stay open a little longer).
    WithdrawLocal,
    /// Lease mode: another holder's lease on this turn has run out by now; deliver it to the
    /// member if it is still here and the turn still unanswered.
    Redeliver {
        /// The member.
        connection_id: String,
        /// Conversation.
        conversation_id: Uuid,
        /// The turn's seq.
        seq: i64,
    },
    /// A feed event whose frames could not be read the first time; sent by the actor itself.
    Retry(ChannelEvent),
}

struct Agent {
    group: Option<String>,
    sender_id: String,
    lease: Option<std::time::Duration>,
    deliveries: mpsc::UnboundedSender<Delivery>,
}

/// What the channel actor hands an agent connection, in the order to send it.
#[derive(Debug)]
pub enum Delivery {
    /// An enveloped frame, ready to send.
    Frame(Value),
    /// An enveloped user turn whose `frame.meta.runtime` the connection fills in as it sends it:
    /// the runtime is read there, once for all turns it sends at that moment, so no database
    /// read waits in the channel actor, which serves every agent of the channel.
    Turn {
        /// The turn's conversation.
        conversation_id: Uuid,
        /// The envelope, `meta` without `runtime`.
        envelope: Value,
    },
}

/// A group member hosted by another node, as gossip reports it.
#[derive(Debug, Clone)]
struct RemoteMember {
    group: String,
    since_ms: i64,
}

/// The actors and what they are seeded with, under one lock so that a new actor's starting view
/// and the membership events forwarded to it never miss or repeat a change.
#[derive(Default)]
struct Registry {
    inboxes: HashMap<Uuid, mpsc::UnboundedSender<ActorMessage>>,
    /// Group members of other nodes, per channel.
    remote_members: HashMap<Uuid, HashMap<String, RemoteMember>>,
    /// Agent connections of other nodes (observers included), per channel.
    remote_agents: HashMap<Uuid, usize>,
}

/// Per-channel actors of this node.
#[derive(Default)]
pub struct Actors {
    registry: std::sync::Mutex<Registry>,
}

impl std::fmt::Debug for Actors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Actors").finish_non_exhaustive()
    }
}

impl Actors {
    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The inbox of the channel's actor, started on first use with the cluster's current
    /// members of the channel.
    pub fn inbox(
        &self,
        channel_id: Uuid,
        hub: &Arc<Hub>,
        store: &Store,
    ) -> mpsc::UnboundedSender<ActorMessage> {
        let mut registry = self.registry();
        if let Some(inbox) = registry
            .inboxes
            .get(&channel_id)
            .filter(|inbox| !inbox.is_closed())
        {
            return inbox.clone();
        }
        let (sender, receiver) = mpsc::unbounded_channel();
        let feed = hub.subscribe_channel(channel_id);
        let mut views: HashMap<String, GroupView> = HashMap::new();
        for (connection_id, member) in registry
            .remote_members
            .get(&channel_id)
            .into_iter()
            .flatten()
        {
            views
                .entry(member.group.clone())
                .or_default()
                .join(connection_id, member.since_ms);
        }
        let actor = ChannelActor {
            channel_id,
            own_inbox: sender.downgrade(),
            store: store.clone(),
            agents: HashMap::new(),
            views,
            memories: HashMap::new(),
            last_seq: HashMap::new(),
        };
        tokio::spawn(actor.run(receiver, feed));
        registry.inboxes.insert(channel_id, sender.clone());
        sender
    }

    /// Applies a membership change of another node, and forwards it to the channel's actor.
    pub fn on_membership(&self, event: &MembershipEvent) {
        let mut registry = self.registry();
        let (record, joined) = match event {
            MembershipEvent::Joined(_, record) => (record, true),
            MembershipEvent::Left(_, record, _) => (record, false),
            MembershipEvent::NodeUp(_) | MembershipEvent::NodeDown(_) => return,
        };
        let channel_id = record.channel_id;
        let count = registry.remote_agents.entry(channel_id).or_insert(0);
        if joined {
            *count += 1;
        } else {
            *count = count.saturating_sub(1);
            if *count == 0 {
                registry.remote_agents.remove(&channel_id);
            }
        }
        let Some(group) = record.group.clone() else {
            return;
        };
        let connection_id = record.connection_id.clone();
        let message = if joined {
            registry
                .remote_members
                .entry(channel_id)
                .or_default()
                .insert(
                    connection_id.clone(),
                    RemoteMember {
                        group: group.clone(),
                        since_ms: record.since_ms,
                    },
                );
            ActorMessage::RemoteJoin {
                connection_id,
                group,
                since_ms: record.since_ms,
            }
        } else {
            if let Some(members) = registry.remote_members.get_mut(&channel_id) {
                members.remove(&connection_id);
                if members.is_empty() {
                    registry.remote_members.remove(&channel_id);
                }
            }
            ActorMessage::RemoteLeave {
                connection_id,
                group,
            }
        };
        if let Some(inbox) = registry.inboxes.get(&channel_id) {
            let _ = inbox.send(message);
        }
    }

    /// True when another node hosts an agent connection of the channel.
    pub fn has_remote_agents(&self, channel_id: Uuid) -> bool {
        self.registry().remote_agents.contains_key(&channel_id)
    }

    /// Tells every actor that this node's members stop owning turns (draining).
    pub fn withdraw_local(&self) {
        for inbox in self.registry().inboxes.values() {
            let _ = inbox.send(ActorMessage::WithdrawLocal);
        }
    }
}

struct ChannelActor {
    channel_id: Uuid,
    /// For lease retries scheduled by the actor itself; weak so it never keeps itself alive.
    own_inbox: mpsc::WeakUnboundedSender<ActorMessage>,
    store: Store,
    agents: HashMap<String, Agent>,
    views: HashMap<String, GroupView>,
    memories: HashMap<String, PassedTurns>,
    /// Highest seq handled per conversation (local commits arrive twice: directly and via bus).
    last_seq: HashMap<Uuid, i64>,
}

impl ChannelActor {
    async fn run(
        mut self,
        mut inbox: mpsc::UnboundedReceiver<ActorMessage>,
        mut feed: broadcast::Receiver<ChannelEvent>,
    ) {
        loop {
            tokio::select! {
                message = inbox.recv() => match message {
                    Some(message) => self.on_message(message).await,
                    None => return,
                },
                event = feed.recv() => match event {
                    Ok(event) => self.on_event(event).await,
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        tracing::warn!(channel_id = %self.channel_id, missed, "agents: channel feed lagged; gaps are read back on the next frame");
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            }
        }
    }

    async fn on_message(&mut self, message: ActorMessage) {
        match message {
            ActorMessage::Join {
                connection_id,
                group,
                since_ms,
                sender_id,
                lease,
                deliveries,
            } => {
                // While no agent of the channel was here, this node skipped the channel's
                // commits: read the unanswered turns back before the newcomer joins the view, so
                // turns of members gone meanwhile (or of nobody) are handed to it below.
                if self.agents.is_empty() {
                    if let Some(group) = &group {
                        self.views.entry(group.clone()).or_default();
                    }
                    self.remember_pending_turns().await;
                }
                if let Some(group) = &group {
                    self.views
                        .entry(group.clone())
                        .or_default()
                        .join(&connection_id, since_ms);
                }
                self.agents.insert(
                    connection_id,
                    Agent {
                        group: group.clone(),
                        sender_id,
                        lease,
                        deliveries,
                    },
                );
                // Turns passed to nobody (or to members gone meanwhile) wait for the next member.
                if let Some(group) = group {
                    self.take_over(&group).await;
                }
            }
            ActorMessage::Replay {
                connection_id,
                conversation_id,
                watermark,
                limit,
            } => {
                self.replay(&connection_id, conversation_id, watermark, limit)
                    .await
            }
            ActorMessage::Leave { connection_id } => {
                let Some(agent) = self.agents.remove(&connection_id) else {
                    return;
                };
                // The session released its leases before sending `Leave` (so other nodes'
                // takeovers claim at once), but this actor may have claimed a turn for it since;
                // released again now that no claim for it can follow.
                if agent.lease.is_some() {
                    self.release_leases(&connection_id).await;
                }
                let Some(group) = agent.group else { return };
                if let Some(view) = self.views.get_mut(&group) {
                    view.leave(&connection_id);
                }
                self.take_over(&group).await;
            }
            ActorMessage::RemoteJoin {
                connection_id,
                group,
                since_ms,
            } => {
                self.views
                    .entry(group)
                    .or_default()
                    .join(&connection_id, since_ms);
            }
            ActorMessage::RemoteLeave {
                connection_id,
                group,
            } => {
                let left = self
                    .views
                    .get_mut(&group)
                    .is_some_and(|view| view.leave(&connection_id));
                if left {
                    self.take_over(&group).await;
                }
            }
            ActorMessage::Retry(event) => self.on_event(event).await,
            ActorMessage::Redeliver {
                connection_id,
                conversation_id,
                seq,
            } => {
                // Still here and still a member (not withdrawn by a drain).
                let member = self
                    .agents
                    .get(&connection_id)
                    .and_then(|agent| agent.group.as_ref())
                    .and_then(|group| self.views.get(group))
                    .is_some_and(|view| view.contains(&connection_id));
                if member {
                    self.deliver_pending(conversation_id, &connection_id, &[seq])
                        .await;
                }
            }
            ActorMessage::WithdrawLocal => {
                let local: Vec<(String, String)> = self
                    .agents
                    .iter()
                    .filter_map(|(connection_id, agent)| {
                        Some((connection_id.clone(), agent.group.clone()?))
                    })
                    .collect();
                for (connection_id, group) in &local {
                    if let Some(view) = self.views.get_mut(group) {
                        view.leave(connection_id);
                    }
                }
                // Their claims go too, so the members taking over claim at once; a late answer
                // from a withdrawn member then carries an old fence and is refused.
                let holders: Vec<String> = self
                    .agents
                    .iter()
                    .filter(|(_, agent)| agent.lease.is_some())
                    .map(|(connection_id, _)| connection_id.clone())
                    .collect();
                for holder in holders {
                    if let Err(error) = self.store.release_leases(&holder).await {
                        tracing::warn!(%error, holder, "leases not released at drain");
                    }
                }
                let groups: std::collections::BTreeSet<String> =
                    local.into_iter().map(|(_, group)| group).collect();
                for group in groups {
                    self.take_over(&group).await;
                }
            }
        }
    }

    /// A node whose first agent of the channel arrives (or returns) did not see the turns passed
    /// meanwhile; it reads the channel's unanswered turns back and remembers whom they were
    /// passed to, so that a later departure hands them on from here too (every node decides
    /// alike).
    async fn remember_pending_turns(&mut self) {
        let pending = match self
            .store
            .pending_turns_of_channel(
                self.channel_id,
                PENDING_TURNS_HORIZON,
                MEMORY_CONVERSATIONS as i64,
            )
            .await
        {
            Ok(pending) => pending,
            Err(error) => {
                tracing::warn!(%error, channel_id = %self.channel_id, "pending turns unreadable; only new turns are remembered");
                return;
            }
        };
        tracing::debug!(channel_id = %self.channel_id, turns = pending.len(), "pending turns read back");
        for turn in pending {
            let conversation = turn.conversation_id.to_string();
            for (group, view) in &self.views {
                let owner = view.owner(&conversation, turn.at_ms).unwrap_or(NOBODY);
                self.memories
                    .entry(group.clone())
                    .or_insert_with(|| {
                        PassedTurns::new(MEMORY_CONVERSATIONS, MEMORY_TURNS_PER_CONVERSATION)
                    })
                    .remember(&conversation, owner, turn.seq, turn.at_ms);
            }
        }
    }

    /// Hands the unanswered turns of departed members to their new owners on this node.
    async fn take_over(&mut self, group: &str) {
        self.take_over_remembered(group).await;
        self.take_over_evicted(group).await;
    }

    /// Turns that fell out of a conversation's memory (more unanswered turns than it keeps) are
    /// read back from the registry and go to the owner the view gives at their commit time when
    /// that owner is here. Without the memory this node cannot tell whether a live member already
    /// has one, so this may deliver a turn twice; the registry still takes one answer.
    async fn take_over_evicted(&mut self, group: &str) {
        let Some(memory) = self.memories.get(group) else {
            return;
        };
        for (conversation, up_to) in memory.overflowed() {
            let Ok(conversation_id) = Uuid::parse_str(&conversation) else {
                continue;
            };
            let pending = match self.store.pending_turns_up_to(conversation_id, up_to).await {
                Ok(pending) => pending,
                Err(error) => {
                    tracing::error!(%error, %conversation_id, "takeover: evicted turns unreadable");
                    continue;
                }
            };
            if pending.is_empty() {
                if let Some(memory) = self.memories.get_mut(group) {
                    memory.clear_overflow(&conversation);
                }
                continue;
            }
            let Some(view) = self.views.get(group) else {
                return;
            };
            let mut by_owner: HashMap<String, Vec<i64>> = HashMap::new();
            for turn in &pending {
                if let Some(owner) = view.owner(&conversation, turn.at_ms)
                    && self.agents.contains_key(owner)
                {
                    by_owner.entry(owner.to_owned()).or_default().push(turn.seq);
                }
            }
            for (owner, seqs) in by_owner {
                self.deliver_pending(conversation_id, &owner, &seqs).await;
            }
        }
    }

    /// Delivers those of `seqs` still unanswered to a local member, as taken over.
    async fn deliver_pending(&self, conversation_id: Uuid, owner: &str, seqs: &[i64]) {
        let pending = match self.store.pending_turns(conversation_id, seqs).await {
            Ok(pending) => pending,
            Err(error) => {
                tracing::error!(%error, %conversation_id, "takeover: pending turns unreadable");
                return;
            }
        };
        for turn in pending {
            metrics::counter!("converger_deliveries_total", "kind" => "takeover").increment(1);
            let turn_ref = TurnRef {
                seq: turn.turn_seq,
                revision: turn.revision,
                reason: turn.reason.as_deref(),
            };
            self.deliver_turn(owner, &turn.activity, turn_ref).await;
        }
    }

    /// Hands the remembered turns of departed members to their new owners on this node.
    async fn take_over_remembered(&mut self, group: &str) {
        let (Some(view), Some(memory)) = (self.views.get(group), self.memories.get_mut(group))
        else {
            return;
        };
        let decisions: Vec<TakeOver> = memory.take_over(view);
        for decision in decisions {
            tracing::debug!(conversation_id = %decision.conversation_id, new_owner = %decision.new_owner, seqs = ?decision.seqs, local = self.agents.contains_key(&decision.new_owner), "takeover");
            if !self.agents.contains_key(&decision.new_owner) {
                continue;
            }
            let Ok(conversation_id) = Uuid::parse_str(&decision.conversation_id) else {
                continue;
            };
            self.deliver_pending(conversation_id, &decision.new_owner, &decision.seqs)
                .await;
        }
    }

    async fn on_event(&mut self, event: ChannelEvent) {
        let ChannelEvent {
            conversation_id,
            event,
        } = event;
        match event {
            HubEvent::Committed { seq, activity } => {
                let last = self.last_seq.get(&conversation_id).copied();
                if last.is_some_and(|last| seq <= last) {
                    return;
                }
                // A known conversation with a hole (a lagged feed) is read back from the hole on;
                // otherwise the event's own frame is enough (read when it came without one).
                let missed_from = last.filter(|last| *last < seq - 1);
                let frames = match (missed_from, activity) {
                    (None, Some(activity)) => vec![activity],
                    (from, _) => {
                        let from = from.unwrap_or(seq - 1);
                        match self
                            .store
                            .list_activities(conversation_id, from, seq - from)
                            .await
                        {
                            Ok(rows) => rows.into_iter().map(Arc::new).collect(),
                            Err(error) => {
                                // Not marked as handled: the retry (or the conversation's next
                                // frame) reads from the same place, so no turn is skipped.
                                tracing::warn!(%error, %conversation_id, seq, "agents: frames unreadable; retrying");
                                let event = ChannelEvent {
                                    conversation_id,
                                    event: HubEvent::Committed {
                                        seq,
                                        activity: None,
                                    },
                                };
                                self.retry_after(event, FRAMES_RETRY);
                                return;
                            }
                        }
                    }
                };
                self.last_seq.insert(conversation_id, seq);
                for frame in frames {
                    self.on_committed(&frame).await;
                }
            }
            HubEvent::Regenerated { turn, revision } => {
                // Answered again by the conversation's current owner in each group, when that
                // owner is here.
                let now = chrono::Utc::now().timestamp_millis();
                let owners: Vec<String> = self
                    .views
                    .values()
                    .filter_map(|view| view.owner(&conversation_id.to_string(), now))
                    .filter(|owner| self.agents.contains_key(*owner))
                    .map(str::to_owned)
                    .collect();
                if owners.is_empty() {
                    return;
                }
                let Some(frame) = self.regenerated_frame(&turn, revision).await else {
                    return;
                };
                for owner in owners {
                    let turn_ref = TurnRef {
                        seq: turn.seq,
                        revision,
                        reason: Some("regenerate"),
                    };
                    self.deliver_turn(&owner, &frame, turn_ref).await;
                }
            }
            HubEvent::Transient { frame, .. } => {
                // Forwarded client frames, typing, receipts and presence: to every observer and
                // to the current owner of each group.
                let envelope = json!({"conversationId": conversation_id, "frame": *frame});
                let now = chrono::Utc::now().timestamp_millis();
                let owners: Vec<String> = self
                    .views
                    .values()
                    .filter_map(|view| {
                        view.owner(&conversation_id.to_string(), now)
                            .map(str::to_owned)
                    })
                    .collect();
                for (connection_id, agent) in &self.agents {
                    if agent.group.is_none() || owners.contains(connection_id) {
                        let _ = agent.deliveries.send(Delivery::Frame(envelope.clone()));
                    }
                }
            }
        }
    }

    async fn on_committed(&mut self, activity: &Activity) {
        let envelope = json!({"conversationId": activity.conversation_id, "frame": activity.to_frame(Viewer::Agent)});
        for agent in self.agents.values().filter(|agent| agent.group.is_none()) {
            let _ = agent.deliveries.send(Delivery::Frame(envelope.clone()));
        }
        if activity.sender_role != "user" {
            // An answer completes the turn for every group (the registry keeps one status per
            // turn): nothing is left to hand on, so the memory keeps only unanswered turns.
            if let Some(turn_seq) = activity.turn_seq {
                let conversation = activity.conversation_id.to_string();
                for memory in self.memories.values_mut() {
                    memory.answered(&conversation, turn_seq);
                }
            }
            self.deliver_other_party(activity, &envelope);
            return;
        }
        // An edit is revision + 1 of the turn it replaces; other user frames are new turns.
        let turn = TurnRef::of(activity);
        let conversation = activity.conversation_id.to_string();
        let at = activity.timestamp_ms();
        let groups: Vec<String> = self.views.keys().cloned().collect();
        let mut local_owners = Vec::new();
        for group in groups {
            let owner = self
                .views
                .get(&group)
                .and_then(|view| view.owner(&conversation, at))
                .unwrap_or(NOBODY)
                .to_owned();
            self.memories
                .entry(group.clone())
                .or_insert_with(|| {
                    PassedTurns::new(MEMORY_CONVERSATIONS, MEMORY_TURNS_PER_CONVERSATION)
                })
                .remember(&conversation, &owner, turn.seq, at);
            tracing::debug!(conversation_id = %conversation, seq = turn.seq, owner = %owner, local = self.agents.contains_key(&owner), "turn passed");
            if self.agents.contains_key(&owner) {
                local_owners.push(owner);
            }
        }
        if local_owners.is_empty() {
            return;
        }
        let envelope = turn_envelope(self.channel_id, activity, turn);
        for owner in local_owners {
            let mut delivery = envelope.clone();
            if !self
                .claim_for(&owner, activity.conversation_id, turn, &mut delivery)
                .await
            {
                continue;
            }
            metrics::counter!("converger_deliveries_total", "kind" => "first").increment(1);
            // Commit (database clock) to hand-off to the member's connection on this node, which
            // adds the runtime and queues the frame for its socket writer.
            let waited_ms = chrono::Utc::now().timestamp_millis() - activity.timestamp_ms();
            metrics::histogram!("converger_commit_to_delivery_seconds")
                .record(waited_ms.max(0) as f64 / 1000.0);
            self.send_turn(&owner, activity.conversation_id, delivery);
        }
    }

    /// The frame a regenerated turn is delivered with: its latest edit when it has one (as a
    /// takeover would deliver it), else the turn itself; `None` when that revision is no longer
    /// pending (answered, or superseded by a newer revision, which has its own event).
    async fn regenerated_frame(&self, turn: &Activity, revision: i32) -> Option<Arc<Activity>> {
        match self
            .store
            .pending_turns(turn.conversation_id, &[turn.seq])
            .await
        {
            Ok(pending) => pending
                .into_iter()
                .find(|pending| pending.revision == revision)
                .map(|pending| Arc::new(pending.activity)),
            Err(error) => {
                tracing::warn!(%error, conversation_id = %turn.conversation_id, seq = turn.seq, "regenerate: latest edit unreadable; delivering the turn as sent");
                Some(Arc::new(turn.clone()))
            }
        }
    }

    /// Replays to one connection what it owns of a conversation after `watermark`.
    async fn replay(&self, connection_id: &str, conversation_id: Uuid, watermark: i64, limit: i64) {
        let Some(agent) = self.agents.get(connection_id) else {
            return;
        };
        let frames = match self
            .store
            .list_activities(conversation_id, watermark, limit)
            .await
        {
            Ok(frames) => frames,
            Err(error) => {
                tracing::warn!(%error, %conversation_id, "agent replay unreadable");
                return;
            }
        };
        let conversation = conversation_id.to_string();
        let view = agent.group.as_ref().and_then(|group| self.views.get(group));
        for activity in frames {
            let Some(view) = view else {
                // Observers own everything.
                let envelope = json!({"conversationId": conversation_id, "frame": activity.to_frame(Viewer::Agent)});
                let _ = agent.deliveries.send(Delivery::Frame(envelope));
                continue;
            };
            if view.owner(&conversation, activity.timestamp_ms()) != Some(connection_id) {
                continue;
            }
            if activity.sender_role == "user" {
                let turn = TurnRef::of(&activity);
                self.deliver_turn(connection_id, &activity, turn).await;
            } else if activity.sender_id != agent.sender_id {
                let envelope = json!({"conversationId": conversation_id, "frame": activity.to_frame(Viewer::Agent)});
                let _ = agent.deliveries.send(Delivery::Frame(envelope));
            }
        }
    }

    /// Frames of other parties (another group's answers, proactive frames): to the owner of each
    /// group whose members did not write it. A group never gets its own frames back.
    fn deliver_other_party(&self, activity: &Activity, envelope: &Value) {
        let conversation = activity.conversation_id.to_string();
        let at = activity.timestamp_ms();
        for (group, view) in &self.views {
            // The writer's own group: named like the sender, or one of its members wrote it.
            let written_by_group = *group == activity.sender_id
                || self.agents.values().any(|agent| {
                    agent.group.as_deref() == Some(group.as_str())
                        && agent.sender_id == activity.sender_id
                });
            if written_by_group {
                continue;
            }
            let Some(owner) = view.owner(&conversation, at) else {
                continue;
            };
            let Some(agent) = self.agents.get(owner) else {
                continue;
            };
            if agent.sender_id != activity.sender_id {
                let _ = agent.deliveries.send(Delivery::Frame(envelope.clone()));
            }
        }
    }

    /// Sends a user turn to a member with its `meta` (PROTOCOL section 4), claimed first for a
    /// lease-mode member.
    async fn deliver_turn(&self, connection_id: &str, activity: &Activity, turn: TurnRef<'_>) {
        let mut envelope = turn_envelope(self.channel_id, activity, turn);
        if self
            .claim_for(connection_id, activity.conversation_id, turn, &mut envelope)
            .await
        {
            self.send_turn(connection_id, activity.conversation_id, envelope);
        }
    }

    /// For a lease-mode member, claims the turn and writes the fence into the delivery; false
    /// when it must not be delivered now (held by another member: retried when that lease runs
    /// out; or no longer pending). Other members need no claim.
    async fn claim_for(
        &self,
        connection_id: &str,
        conversation_id: Uuid,
        turn: TurnRef<'_>,
        envelope: &mut Value,
    ) -> bool {
        let Some(lease) = self.agents.get(connection_id).and_then(|agent| agent.lease) else {
            return true;
        };
        let started = std::time::Instant::now();
        let claim = self
            .store
            .claim_turn(
                conversation_id,
                turn.seq,
                turn.revision,
                connection_id,
                lease,
            )
            .await;
        metrics::histogram!("converger_claim_wait_seconds").record(started.elapsed().as_secs_f64());
        match claim {
            Ok(Claim::Claimed { fence }) => {
                // A claim that does not continue a live lease of the same connection raises the
                // fence, so above 1 the registry says the turn was handed out before, on any node.
                if fence > 1 {
                    metrics::counter!("converger_duplicate_deliveries_total").increment(1);
                }
                envelope["frame"]["meta"]["turn"]["fence"] = json!(fence);
                true
            }
            Ok(Claim::Held { remaining_ms }) => {
                self.redeliver_after(connection_id, conversation_id, turn.seq, remaining_ms);
                false
            }
            Ok(Claim::NotPending) => false,
            Err(error) => {
                tracing::error!(%error, %conversation_id, seq = turn.seq, "claim failed; retrying");
                self.redeliver_after(connection_id, conversation_id, turn.seq, 1_000);
                false
            }
        }
    }

    /// Gives up the claims a departed lease-mode member still holds, so the next owner claims
    /// them at once.
    async fn release_leases(&self, holder: &str) {
        match self.store.release_leases(holder).await {
            Ok(0) => {}
            Ok(released) => {
                tracing::debug!(
                    holder,
                    released,
                    "leases claimed after the session's release released"
                )
            }
            Err(error) => {
                tracing::warn!(%error, holder, "leases not released; they run out by themselves")
            }
        }
    }

    /// Asks this actor to try the delivery again after `delay_ms` (a lease's remaining time).
    fn redeliver_after(&self, connection_id: &str, conversation_id: Uuid, seq: i64, delay_ms: i64) {
        let Some(inbox) = self.own_inbox.upgrade() else {
            return;
        };
        let wait_ms = u64::try_from(delay_ms).unwrap_or(0) + 20;
        let message = ActorMessage::Redeliver {
            connection_id: connection_id.to_owned(),
            conversation_id,
            seq,
        };
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(wait_ms)).await;
            let _ = inbox.send(message);
        });
    }

    /// Hands `event` back to this actor after `delay` (its frames could not be read).
    fn retry_after(&self, event: ChannelEvent, delay: std::time::Duration) {
        let Some(inbox) = self.own_inbox.upgrade() else {
            return;
        };
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = inbox.send(ActorMessage::Retry(event));
        });
    }

    fn send_turn(&self, connection_id: &str, conversation_id: Uuid, envelope: Value) {
        if let Some(agent) = self.agents.get(connection_id) {
            let _ = agent.deliveries.send(Delivery::Turn {
                conversation_id,
                envelope,
            });
        }
    }
}

/// A user turn enveloped with its `meta` (PROTOCOL section 4), all but the runtime, which the
/// agent's connection adds as it sends it (see [`Delivery::Turn`]).
fn turn_envelope(channel_id: Uuid, activity: &Activity, turn: TurnRef<'_>) -> Value {
    let mut frame = activity.to_frame(Viewer::Agent);
    frame["meta"] = json!({
        "channel": {"id": channel_id},
        "participant": {"id": activity.sender_id, "role": activity.sender_role},
        "turn": turn.to_json(activity.conversation_id),
    });
    json!({"conversationId": activity.conversation_id, "frame": frame})
}
