//! The channel actors of this node: one per channel with agents connected here, started on
//! first use and ended when the channel's last agent connection here lets go of its inbox, and
//! the registry that seeds each with the members other nodes gossip.
//!
//! Every decision an actor makes (who owns a turn, what a departed member's turns become, what
//! a replay holds) is taken by `converger_core::channel::ChannelDecider`; the actor
//! (`channel.rs`) performs them: it claims, reads and sends (ADR 0006).

mod channel;

use std::collections::HashMap;
use std::sync::Arc;

use converger_cluster::MembershipEvent;
use converger_protocol::TurnRef;
use converger_store::{Activity, Store};
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::hub::{ChannelEvent, Hub};

/// What a channel actor is told by agent sessions, the membership dispatch and itself.
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
    /// Try again the read-back a lag owes (the channel's unanswered turns, handed on where no
    /// member here was given them) after a read that failed; sent by the actor itself.
    ReadBackUnanswered,
}

/// What the channel actor hands an agent connection, in the order to send it.
#[derive(Debug, Clone)]
pub enum Delivery {
    /// An enveloped frame, serialized once for every connection it goes to.
    Frame(axum::extract::ws::Utf8Bytes),
    /// A user turn, which the connection serializes with its `meta` as it sends it: the runtime
    /// is read there, once for all turns it sends at that moment, so no database read waits in
    /// the channel actor, which serves every agent of the channel.
    Turn {
        /// The turn's frame (its latest edit, for an edited turn).
        activity: Arc<Activity>,
        /// `meta.turn`, with the fence of a lease-mode claim.
        turn: TurnRef,
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
    /// Weak, so that an actor ends with its channel's last agent connection here.
    inboxes: HashMap<Uuid, mpsc::WeakUnboundedSender<ActorMessage>>,
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
            .and_then(mpsc::WeakUnboundedSender::upgrade)
            .filter(|inbox| !inbox.is_closed())
        {
            return inbox;
        }
        let (sender, receiver) = mpsc::unbounded_channel();
        let feed = hub.subscribe_channel(channel_id);
        let remote_members = registry
            .remote_members
            .get(&channel_id)
            .into_iter()
            .flatten()
            .map(|(connection_id, member)| {
                (
                    connection_id.as_str(),
                    member.group.as_str(),
                    member.since_ms,
                )
            });
        let actor = channel::ChannelActor::new(channel_id, &sender, store.clone(), remote_members);
        tokio::spawn(actor.run(receiver, feed));
        // Actors start rarely: each start also forgets the channels whose actors ended.
        registry.inboxes.retain(|_, inbox| inbox.strong_count() > 0);
        registry.inboxes.insert(channel_id, sender.downgrade());
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
        match registry
            .inboxes
            .get(&channel_id)
            .map(|inbox| inbox.upgrade())
        {
            Some(Some(inbox)) => {
                let _ = inbox.send(message);
            }
            // The actor ended: a new one is seeded from the registry.
            Some(None) => {
                registry.inboxes.remove(&channel_id);
            }
            None => {}
        }
    }

    /// Channel actors running on this node (one per channel with an agent connected here).
    pub fn running(&self) -> usize {
        self.registry()
            .inboxes
            .values()
            .filter(|inbox| inbox.strong_count() > 0)
            .count()
    }

    /// True when another node hosts an agent connection of the channel.
    pub fn has_remote_agents(&self, channel_id: Uuid) -> bool {
        self.registry().remote_agents.contains_key(&channel_id)
    }

    /// Tells every actor that this node's members stop owning turns (draining).
    pub fn withdraw_local(&self) {
        let mut registry = self.registry();
        registry.inboxes.retain(|_, inbox| match inbox.upgrade() {
            Some(inbox) => {
                let _ = inbox.send(ActorMessage::WithdrawLocal);
                true
            }
            None => false,
        });
    }
}
