//! Presence over the cluster (ADR 0024): a participant goes `online` when its first connection
//! on any node opens and `offline` when its last one on any node closes, each announced once,
//! by the node that saw the count cross; `connections` is the count over every node. A dead
//! node's connections are taken out by the first node that sees it dead in gossip.

use std::collections::BTreeSet;
use std::time::Duration;

use converger_protocol::{Participant, USER_ROLE, presence};
use converger_store::bus::Origin;
use converger_store::{Gone, Incarnation, PresenceChange, PresenceTotal};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::publish::{Audience, Transient};
use crate::state::AppState;

/// An end user's session outside a WebSocket (Server-Sent Events, the chat frontends),
/// registered with the hub like a socket: drained with the node, closed by a force-disconnect
/// (through `controls`), and counted present while its seat is held.
pub(crate) struct EndUserSession {
    /// Drain and force-disconnect orders.
    pub controls: tokio::sync::mpsc::Receiver<crate::hub::SessionControl>,
    /// Held while the session lasts; dropped, it leaves presence and the hub.
    pub seat: SessionSeat,
}

/// A registered end-user session's place in the hub and in presence.
pub(crate) struct SessionSeat {
    _guard: crate::hub::SessionGuard,
    state: AppState,
    presence: Presence,
    /// The change that counted the session in (its leave waits for it).
    joined: Option<JoinHandle<bool>>,
}

impl Drop for SessionSeat {
    /// The session leaves presence, once its arrival was counted (off the caller's path).
    fn drop(&mut self) {
        let Some(joined) = self.joined.take() else {
            return;
        };
        let (state, presence) = (self.state.clone(), self.presence.clone());
        tokio::spawn(async move {
            if joined.await.unwrap_or(false) {
                change(state, presence, false).await;
            }
        });
    }
}

impl EndUserSession {
    /// Registers an end-user session of `conversation` on this node and counts it present.
    pub(crate) fn register(
        state: &AppState,
        conversation: &converger_store::Conversation,
    ) -> EndUserSession {
        let (control_sender, controls) = tokio::sync::mpsc::channel(8);
        let guard = state.hub.register(
            crate::hub::SessionIdentity {
                tenant_id: conversation.tenant_id,
                channel_id: conversation.channel_id,
                end_user: Some((conversation.id, conversation.user_id.clone())),
            },
            control_sender,
        );
        let presence = Presence {
            channel_id: conversation.channel_id,
            conversation_id: conversation.id,
            user_id: conversation.user_id.clone(),
            connection_id: guard.connection_id(),
        };
        let joined = tokio::spawn(change(state.clone(), presence.clone(), true));
        EndUserSession {
            controls,
            seat: SessionSeat {
                _guard: guard,
                state: state.clone(),
                presence,
                joined: Some(joined),
            },
        }
    }
}

/// How often a node looks for dead nodes whose connections still count.
const REAP_EVERY: Duration = Duration::from_secs(1);

/// One end user's presence in one conversation, as a session announces it.
#[derive(Debug, Clone)]
pub(crate) struct Presence {
    /// The conversation's channel (its agents are told).
    pub channel_id: Uuid,
    /// The conversation.
    pub conversation_id: Uuid,
    /// The end user.
    pub user_id: String,
    /// The session's connection, so the user's own connections are not told.
    pub connection_id: Uuid,
}

impl Presence {
    fn origin(&self) -> Origin {
        Origin {
            id: self.user_id.clone(),
            role: USER_ROLE.into(),
            connection: self.connection_id.to_string(),
        }
    }
}

/// This node's incarnation, as presence rows name it.
fn this_node(state: &AppState) -> Incarnation<'_> {
    Incarnation {
        node_id: state.hub.node_id(),
        generation: i64::try_from(state.cluster.node().generation).unwrap_or(i64::MAX),
    }
}

/// Counts a connection in or out and announces a crossing. False when the count could not be
/// changed (the database failed, or the node is stopping): a join that was not counted must not
/// be counted out.
pub(crate) async fn change(state: AppState, who: Presence, joined: bool) -> bool {
    let (done, counted) = tokio::sync::oneshot::channel();
    let pending = PendingChange { who, joined, done };
    if state.presence_writer.send(pending).is_err() {
        return false;
    }
    counted.await.unwrap_or(false)
}

/// Changes applied in one round trip at most: each holds its pair's lock until the batch
/// commits, so a batch stays short.
const MAX_BATCH: usize = 256;

/// A change waiting for the writer, and who waits for its outcome.
pub(crate) struct PendingChange {
    who: Presence,
    joined: bool,
    done: tokio::sync::oneshot::Sender<bool>,
}

/// The queue of presence changes that [`spawn_writer`] applies.
pub(crate) type PresenceWriter = tokio::sync::mpsc::UnboundedSender<PendingChange>;

/// The writer's end of the queue, taken once by [`spawn_writer`].
pub(crate) type PresenceChanges = tokio::sync::mpsc::UnboundedReceiver<PendingChange>;

/// How long a stopping node lets its writer apply what is queued.
const FINISH_AT_MOST: Duration = Duration::from_secs(5);

/// A stopping writer stops taking changes once none has arrived for this long: the drained
/// sessions' counts out arrive as their counts in are answered.
const QUIET_BEFORE_STOPPING: Duration = Duration::from_millis(100);

/// The running writer, until the node stops.
pub(crate) struct WriterTask {
    stop: tokio::sync::oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl WriterTask {
    /// Lets the writer apply and announce the changes that arrive until the queue stays quiet,
    /// for at most [`FINISH_AT_MOST`], then stops it. Changes never applied leave rows that the
    /// reaper removes and announces; a batch cut short could commit without its crossings
    /// announced, and no reaper would announce them (its rows are gone), hence the wait.
    pub(crate) async fn finish(self) {
        let WriterTask { stop, mut task } = self;
        let _ = stop.send(());
        if tokio::time::timeout(FINISH_AT_MOST, &mut task)
            .await
            .is_err()
        {
            tracing::warn!(
                "presence writer stopped while still applying: some changes were not applied, \
                 and the batch in flight may go unannounced"
            );
            task.abort();
        }
    }
}

/// Starts the task that applies presence changes: all those waiting, up to [`MAX_BATCH`], in
/// one round trip, then every crossing among them announced together (ADR 0043). A storm of
/// closing sockets thus costs a few transactions rather than one per socket, which stalled
/// other users' turns.
pub(crate) fn spawn_writer(state: AppState, mut changes: PresenceChanges) -> WriterTask {
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        loop {
            // Only the wait for changes is ever cut short, never a batch being applied.
            tokio::select! {
                _ = &mut stopped => break,
                received = changes.recv_many(&mut batch, MAX_BATCH) => {
                    // Never 0 while the node runs: its state holds a sender.
                    if received == 0 {
                        return;
                    }
                    apply(&state, std::mem::take(&mut batch)).await;
                }
            }
        }
        // Stopping: changes are applied until none arrives for a while, then the queue is
        // closed, what is left in it applied, and a change sent later is not counted.
        while let Ok(received) = tokio::time::timeout(
            QUIET_BEFORE_STOPPING,
            changes.recv_many(&mut batch, MAX_BATCH),
        )
        .await
        {
            if received == 0 {
                return;
            }
            apply(&state, std::mem::take(&mut batch)).await;
        }
        changes.close();
        while changes.recv_many(&mut batch, MAX_BATCH).await > 0 {
            apply(&state, std::mem::take(&mut batch)).await;
        }
    });
    WriterTask { stop, task }
}

/// Applies one batch and announces its crossings before any of its callers hears the outcome,
/// so that a session's count out (which waits for its count in) is announced after it.
async fn apply(state: &AppState, batch: Vec<PendingChange>) {
    let changes: Vec<PresenceChange> = batch
        .iter()
        .map(|pending| PresenceChange {
            conversation_id: pending.who.conversation_id,
            participant_id: pending.who.user_id.clone(),
            joined: pending.joined,
        })
        .collect();
    let totals = match state
        .store
        .change_presence(&changes, this_node(state))
        .await
    {
        Ok(totals) => totals,
        Err(error) => {
            tracing::warn!(%error, changes = batch.len(), "presence not counted");
            for pending in batch {
                let _ = pending.done.send(false);
            }
            return;
        }
    };
    let mut announcements = Vec::new();
    for (pending, total) in batch.iter().zip(totals) {
        let crossed = if pending.joined {
            total == 1
        } else {
            total == 0
        };
        if !crossed {
            continue;
        }
        let who = &pending.who;
        if !pending.joined {
            crate::policies::on_last_disconnect(state, who.channel_id, who.conversation_id);
        }
        announcements.push(announcement(
            who.channel_id,
            who.conversation_id,
            who.origin(),
            pending.joined,
            total,
        ));
    }
    crate::publish::publish_all(state, announcements).await;
    for pending in batch {
        let _ = pending.done.send(true);
    }
}

/// A presence frame for every node's agents of the conversation.
fn announcement(
    channel_id: Uuid,
    conversation_id: Uuid,
    origin: Origin,
    online: bool,
    connections: i64,
) -> Transient {
    let participant = Participant {
        id: &origin.id,
        role: USER_ROLE,
    };
    let frame = presence(
        participant,
        online,
        usize::try_from(connections).unwrap_or(0),
    );
    Transient {
        channel_id,
        conversation_id,
        frame,
        origin,
        audience: Audience::Everyone,
    }
}

/// Starts the task that takes dead nodes' connections out of the counts (and, once, what an
/// earlier incarnation of this node left behind).
pub(crate) fn spawn_reaper(state: AppState) -> JoinHandle<()> {
    tokio::spawn(async move {
        let node = this_node(&state);
        let earlier = state.store.forget_presence(Gone::AllBut(node)).await;
        announce_offline(&state, earlier).await;
        let mut forgotten: BTreeSet<(String, u64)> = BTreeSet::new();
        let mut every = tokio::time::interval(REAP_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let Ok(status) = state.cluster.status().await else {
                continue;
            };
            for dead in status.nodes.iter().filter(|node| node.status == "dead") {
                let key = (dead.id.clone(), dead.generation);
                if forgotten.contains(&key) {
                    continue;
                }
                let gone = Gone::Exactly(Incarnation {
                    node_id: &dead.id,
                    generation: i64::try_from(dead.generation).unwrap_or(i64::MAX),
                });
                let totals = state.store.forget_presence(gone).await;
                if totals.is_ok() {
                    forgotten.insert(key);
                }
                announce_offline(&state, totals).await;
            }
        }
    })
}

/// Announces `offline` for each participant a removal left with no connection.
async fn announce_offline(
    state: &AppState,
    totals: Result<Vec<PresenceTotal>, converger_store::StoreError>,
) {
    let totals = match totals {
        Ok(totals) => totals,
        Err(error) => {
            tracing::warn!(%error, "presence of a gone node not removed; retrying");
            return;
        }
    };
    let mut announcements = Vec::new();
    for total in totals.into_iter().filter(|total| total.connections == 0) {
        crate::policies::on_last_disconnect(state, total.channel_id, total.conversation_id);
        // No connection of the user is left, so no own-connection filter is needed: a nil one.
        let origin = Origin {
            id: total.participant_id,
            role: USER_ROLE.into(),
            connection: Uuid::nil().to_string(),
        };
        announcements.push(announcement(
            total.channel_id,
            total.conversation_id,
            origin,
            false,
            0,
        ));
    }
    crate::publish::publish_all(state, announcements).await;
}
