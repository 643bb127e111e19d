//! The cluster bus (ADR 0033): how this node tells the other nodes what it committed, the
//! chunks its agents stream and its transient frames, and how it hears theirs. Three
//! transports behind one type:
//!
//! - `postgres`: the committing statements notify, one `LISTEN` per node (`converger_store::bus`);
//! - `nats` (`nats.rs`): the node publishes each commit after it committed, its stream chunks and
//!   transient frames, on core NATS; the outbox, which every commit writes, is read back after a
//!   lost connection and swept every `nats.sweep_ms`, so a lost publication costs latency,
//!   never a frame;
//! - `local`: one node alone, nothing published.
//!
//! Whatever the transport, what the node hears (and its own committed batches) comes out of
//! `listen` as `BusEvent`s, and enters the node's hub through one door (`door.rs`).
//!
//! On NATS a node hears the stream events only of the conversations its hub has a feed for,
//! and asks the other nodes what they stream there when a feed comes (ADR 0035); the other
//! transports hand every node every stream event.

pub(crate) mod door;
mod nats;

use std::sync::{Mutex, Weak};

use converger_core::streams::StreamTurn;
use converger_store::bus::{BusEvent, DisconnectOrder, TransientFrame, TurnStop};
use converger_store::{Activity, Store, StoreError};
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use crate::config::{BusKind, Config};
use crate::hub::Hub;

/// What this node's agents stream in a conversation, as the other nodes are told when they
/// begin to follow it (NATS, ADR 0035). The stream registry answers; the bus moves the text.
pub(crate) trait StreamHoldings: Send + Sync {
    /// The encoded holdings of `conversation_id`: its open streams, or, when `stopped_turn` is
    /// named, what this node holds of that turn's streams for its settlement. `None` when this
    /// node holds nothing of it.
    fn holdings(&self, conversation_id: Uuid, stopped_turn: Option<StreamTurn>) -> Option<String>;
}

/// Why the bus could not start.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// NATS refused or did not answer.
    #[error("nats: {0}")]
    Nats(String),
    /// The store was opened for another bus (its statements notify, or do not).
    #[error("the store's notifications do not match bus = {0:?}")]
    StoreMismatch(BusKind),
}

/// This node's side of the cluster bus.
pub struct Bus {
    node_id: String,
    store: Store,
    transport: Transport,
    /// Events this node hands to itself (its own commits, orders it gave); `listen` returns
    /// their receiver.
    loopback: mpsc::UnboundedSender<BusEvent>,
    receiver: Mutex<Option<mpsc::UnboundedReceiver<BusEvent>>>,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bus")
            .field("node_id", &self.node_id)
            .field("kind", &self.kind())
            .finish_non_exhaustive()
    }
}

enum Transport {
    Postgres,
    /// Boxed: the link is large and there is one per node.
    Nats(Box<nats::Link>),
    Local,
}

impl Bus {
    /// Opens the bus `config.bus` names (connects to NATS, for `nats`).
    pub async fn open(config: &Config, store: Store, node_id: &str) -> Result<Bus, BusError> {
        if store.notifies_in_commit() != config.bus.notifies_in_commit() {
            return Err(BusError::StoreMismatch(config.bus));
        }
        let transport = match config.bus {
            BusKind::Postgres => Transport::Postgres,
            BusKind::Local => Transport::Local,
            BusKind::Nats => {
                Transport::Nats(Box::new(nats::Link::connect(&config.nats, node_id).await?))
            }
        };
        let (loopback, receiver) = mpsc::unbounded_channel();
        Ok(Bus {
            node_id: node_id.to_owned(),
            store,
            transport,
            loopback,
            receiver: Mutex::new(Some(receiver)),
        })
    }

    /// Which transport this is.
    pub fn kind(&self) -> BusKind {
        match self.transport {
            Transport::Postgres => BusKind::Postgres,
            Transport::Nats(_) => BusKind::Nats,
            Transport::Local => BusKind::Local,
        }
    }

    /// Starts hearing: the events of other nodes and this node's own committed batches, until
    /// the receiver is dropped. The oneshot fires once the node hears other nodes (at once for
    /// `local`). Called once; a second call gets a receiver that never yields.
    pub fn listen(&self) -> (mpsc::UnboundedReceiver<BusEvent>, oneshot::Receiver<()>) {
        let Some(receiver) = self.receiver.lock().ok().and_then(|mut held| held.take()) else {
            let (_, never) = mpsc::unbounded_channel();
            let (_, ready) = oneshot::channel();
            return (never, ready);
        };
        match &self.transport {
            Transport::Postgres => self.store.spawn_bus_listener(&self.node_id),
            Transport::Local => {
                self.store
                    .hand_commits_to(&self.node_id, self.loopback.clone());
                let (listening, ready) = oneshot::channel();
                let _ = listening.send(());
                (receiver, ready)
            }
            Transport::Nats(link) => {
                let (commits, own_commits) = mpsc::unbounded_channel();
                self.store.hand_commits_to(&self.node_id, commits);
                let ready = link.listen(self.store.clone(), self.loopback.clone(), own_commits);
                (receiver, ready)
            }
        }
    }

    /// Shares stream events by interest (NATS): from now on this node hears the stream events
    /// only of the conversations `hub` has a feed for, asking the other nodes for what they
    /// stream there when a feed comes, and answers their questions from `holdings`. Called
    /// once, after `listen`; nothing to do on the other transports.
    pub(crate) fn share_streams_by_interest(&self, hub: &Hub, holdings: Weak<dyn StreamHoldings>) {
        let Transport::Nats(link) = &self.transport else {
            return;
        };
        link.answer_holdings(holdings);
        hub.report_feed_changes(link.follow_streams(self.loopback.clone()));
    }

    /// What the other nodes hold of a stopped turn's streams, each answering node's holdings
    /// (NATS); empty on the other transports, where every node holds every stream.
    pub(crate) async fn ask_stopped_stream(
        &self,
        conversation_id: Uuid,
        turn: StreamTurn,
    ) -> Vec<String> {
        match &self.transport {
            Transport::Nats(link) => link.ask_holdings(conversation_id, Some(turn)).await,
            Transport::Postgres | Transport::Local => Vec::new(),
        }
    }

    /// A replica of the conversation's stream missed a chunk: on NATS the node asks for the
    /// holdings again, and the stream resumes from them; elsewhere nothing is done (every
    /// node hears every stream event, and a lost one shows as the committed answer).
    pub(crate) fn stream_gap(&self, conversation_id: Uuid) {
        if let Transport::Nats(link) = &self.transport {
            link.stream_gap(conversation_id);
        }
    }

    /// Another node came up in gossip (or went): asking for holdings waits for its answer.
    pub(crate) fn peer_changed(&self, node: &converger_cluster::NodeKey, up: bool) {
        if let Transport::Nats(link) = &self.transport {
            link.peer_changed(node, up);
        }
    }

    /// Announces frames this node committed outside the group-commit workers (which announce
    /// theirs), once they committed: for `nats`, published unless published before; for
    /// `postgres`, the committing statement notified already.
    pub(crate) fn committed(&self, channel_id: Uuid, activities: &[std::sync::Arc<Activity>]) {
        let Transport::Nats(link) = &self.transport else {
            return;
        };
        let (Some(first), Some(last)) = (activities.first(), activities.last()) else {
            return;
        };
        link.publish_committed(BusEvent::Committed {
            conversation_id: last.conversation_id,
            first_seq: first.seq,
            seq: last.seq,
            channel_id: Some(channel_id),
            frames: activities.iter().map(|frame| (**frame).clone()).collect(),
            // Not read with the conversation's lock: receivers read the runtime.
            runtime: None,
        });
    }

    /// Sends transient frames to the other nodes (this node dispatched them already): for
    /// `postgres`, those that fit a notification in one statement.
    pub(crate) async fn transients(&self, transients: &[TransientFrame]) -> Result<(), StoreError> {
        match &self.transport {
            Transport::Postgres => self.store.publish_transients(transients).await,
            Transport::Nats(link) => {
                for transient in transients {
                    link.publish_event(BusEvent::Transient(transient.clone()));
                }
                Ok(())
            }
            Transport::Local => Ok(()),
        }
    }

    /// Tells the other nodes that a turn was opened again at `opened_at_ms` (this node
    /// dispatched it already).
    pub(crate) async fn regenerated(
        &self,
        channel_id: Uuid,
        conversation_id: Uuid,
        turn: (i64, i32),
        opened_at_ms: i64,
    ) -> Result<(), StoreError> {
        match &self.transport {
            Transport::Postgres => {
                self.store
                    .publish_regenerated(
                        &self.node_id,
                        channel_id,
                        conversation_id,
                        turn,
                        opened_at_ms,
                    )
                    .await
            }
            Transport::Nats(link) => {
                let (seq, revision) = turn;
                link.publish_event(BusEvent::Regenerated {
                    node: self.node_id.clone(),
                    channel_id,
                    conversation_id,
                    seq,
                    revision,
                    opened_at_ms: Some(opened_at_ms),
                });
                Ok(())
            }
            Transport::Local => Ok(()),
        }
    }

    /// Tells the other nodes that a turn was stopped (this node applied it already).
    pub(crate) async fn turn_stop(&self, stop: &TurnStop) -> Result<(), StoreError> {
        match &self.transport {
            Transport::Postgres => self.store.publish_turn_stop(stop).await,
            Transport::Nats(link) => {
                link.publish_event(BusEvent::TurnStopped(stop.clone()));
                Ok(())
            }
            Transport::Local => Ok(()),
        }
    }

    /// Tells every node, this one included, that a channel changed status; kept in the outbox
    /// for a node that hears it late.
    pub(crate) async fn channel_status(
        &self,
        channel_id: Uuid,
        status: &str,
    ) -> Result<(), StoreError> {
        self.store
            .publish_channel_status(&self.node_id, channel_id, status)
            .await?;
        let event = BusEvent::ChannelStatus {
            node: self.node_id.clone(),
            channel_id,
            status: status.to_owned(),
        };
        self.beyond_postgres(event);
        Ok(())
    }

    /// Gives a disconnect order to every node, this one included; kept in the outbox for a node
    /// that hears it late.
    pub(crate) async fn disconnect(&self, order: &DisconnectOrder) -> Result<(), StoreError> {
        self.store.publish_disconnect(order).await?;
        self.beyond_postgres(BusEvent::Disconnect(order.clone()));
        Ok(())
    }

    /// An event the outbox keeps (and `postgres` notifies with it): on the other transports it
    /// goes to this node at once, and on NATS to the others too.
    fn beyond_postgres(&self, event: BusEvent) {
        match &self.transport {
            Transport::Postgres => {}
            Transport::Nats(link) => {
                link.publish_event(event.clone());
                let _ = self.loopback.send(event);
            }
            Transport::Local => {
                let _ = self.loopback.send(event);
            }
        }
    }

    /// Relays stream events (each one encoded JSON text, with its conversation) to the other
    /// nodes.
    pub(crate) async fn streams(&self, events: &[(Uuid, String)]) -> Result<(), StoreError> {
        match &self.transport {
            Transport::Postgres => {
                let texts: Vec<&str> = events.iter().map(|(_, text)| text.as_str()).collect();
                self.store.publish_streams(&self.node_id, &texts).await
            }
            Transport::Nats(link) => {
                link.publish_streams(&self.node_id, events).await;
                Ok(())
            }
            Transport::Local => Ok(()),
        }
    }
}
