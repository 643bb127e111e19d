//! The node-local hub: live frames per conversation for the sessions of this node, the registry
//! of open sessions (for draining, channel deactivation and force-disconnect).
//!
//! Committed frames reach the hub twice on the committing node (directly after the commit, and
//! through the bus) and once on the others (through the bus); sessions drop what they already
//! have, so the hub never has to de-duplicate for correctness.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use axum::extract::ws::Utf8Bytes;
use converger_protocol::{ErrorCode, ErrorFrame, Profile, Viewer};
use converger_store::Activity;
use converger_store::bus::{DisconnectOrder, Origin};
use serde_json::Value;
use tokio::sync::{broadcast, mpsc};
use uuid::Uuid;

/// Live events buffered per conversation; a session that falls further behind reads the gap
/// back from the database.
const CONVERSATION_BUFFER: usize = 16;

/// A live event of one conversation.
#[derive(Debug, Clone)]
pub enum HubEvent {
    /// `seq` was committed; `activity` is attached when this node has it at hand.
    Committed {
        /// The committed seq.
        seq: i64,
        /// The frame, when known.
        activity: Option<Arc<Activity>>,
        /// Its renderings for end users, shared by every session of this node.
        views: Arc<EndUserViews>,
    },
    /// A new revision of a turn that stores nothing (regenerate), for the agents.
    Regenerated {
        /// The turn's user frame.
        turn: Arc<Activity>,
        /// The new revision.
        revision: i32,
        /// When it was opened (ms since the epoch, the database clock): its owners are decided
        /// at it.
        opened_at_ms: i64,
    },
    /// A turn was stopped, for the agents: its owners get `cancel` (ADR 0028).
    TurnStopped(Arc<converger_store::bus::TurnStop>),
    /// A chunk or the end of a streamed answer, for end users.
    Stream(Arc<crate::stream_event::StreamEvent>),
    /// A transient frame for end users.
    Transient {
        /// The frame.
        frame: Arc<Value>,
        /// Its author, when any.
        origin: Option<Arc<Origin>>,
    },
}

impl HubEvent {
    /// A committed frame this node has at hand.
    pub fn committed(activity: Arc<Activity>) -> HubEvent {
        HubEvent::Committed {
            seq: activity.seq,
            activity: Some(activity),
            views: Arc::default(),
        }
    }

    /// A committed seq whose frame its receivers read themselves.
    pub fn committed_seq(seq: i64) -> HubEvent {
        HubEvent::Committed {
            seq,
            activity: None,
            views: Arc::default(),
        }
    }
}

/// The renderings of one committed frame for end users, made once for all the sessions of this
/// node that show it: a frame fanned out to many connections costs one serialization, and one
/// buffer that every outbound queue shares, instead of one of each per connection (after a
/// flood to slow consumers, that is the difference between megabytes and gigabytes held).
#[derive(Debug, Default)]
pub struct EndUserViews {
    /// By profile (converger, mekik), then for the frame's author and for everyone else.
    cells: [[OnceLock<Utf8Bytes>; 2]; 2],
}

impl EndUserViews {
    /// `activity` as the end user `user_id` of `profile` sees it.
    pub fn render(&self, activity: &Activity, user_id: &str, profile: Profile) -> Utf8Bytes {
        let frame = crate::wire::persistent(activity);
        // A frame the mekik profile shows as the converger one does shares its bytes.
        let profile = match profile {
            Profile::Mekik if frame.shown_apart_to_mekik() => Profile::Mekik,
            _ => Profile::Converger,
        };
        // An end user's view depends only on that and on whether the viewer is the frame's
        // sender: that decides `from` (with the sender's role) and whether `clientId` is shown.
        let by_profile = match profile {
            Profile::Converger => &self.cells[0],
            Profile::Mekik => &self.cells[1],
        };
        let cell = if activity.sender_id == user_id {
            &by_profile[0]
        } else {
            &by_profile[1]
        };
        cell.get_or_init(|| {
            let rendered = frame.view(Viewer::EndUser { user_id });
            match profile {
                Profile::Converger => rendered.encode(),
                Profile::Mekik => rendered.for_mekik().encode(),
            }
            .into()
        })
        .clone()
    }
}

/// An order to a session from outside its connection.
#[derive(Debug, Clone)]
pub enum SessionControl {
    /// Send the error (if any) and close with this code and reason.
    Close {
        /// Error frame sent first (boxed: every session's control queue reserves room for
        /// 32 messages, so this enum's size is paid per idle connection).
        error: Option<Box<ErrorFrame>>,
        /// Close code.
        code: u16,
        /// Close reason.
        reason: String,
    },
    /// Stop reading, finish in-flight sends, then close 1012 with this retry hint.
    Drain {
        /// The jittered `retryAfterMs`.
        retry_after_ms: u64,
    },
}

impl SessionControl {
    /// The error a session that is not a WebSocket (no close frame) ends with.
    pub fn error_frame(self) -> ErrorFrame {
        match self {
            SessionControl::Drain { retry_after_ms } => ErrorFrame {
                retry_after_ms: Some(retry_after_ms),
                ..ErrorFrame::new(ErrorCode::Unavailable, "the node is draining; reconnect")
            },
            SessionControl::Close { error, reason, .. } => match error {
                Some(error) => *error,
                None => ErrorFrame::new(ErrorCode::Forbidden, &reason),
            },
        }
    }
}

/// Who a session is, for the orders that pick sessions (deactivation, force-disconnect).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionIdentity {
    /// The tenant.
    pub tenant_id: Uuid,
    /// The channel.
    pub channel_id: Uuid,
    /// An end user's session: (conversation, user); `None` for an agent.
    pub end_user: Option<(Uuid, String)>,
}

impl SessionIdentity {
    /// True when a disconnect order names this session: its tenant, and each of the order's
    /// user, conversation and channel that is set (users and conversations are end users').
    fn matches(&self, order: &DisconnectOrder) -> bool {
        let end_user = self.end_user.as_ref();
        self.tenant_id == order.tenant_id
            && order
                .channel_id
                .is_none_or(|channel| channel == self.channel_id)
            && order
                .conversation_id
                .is_none_or(|conversation| end_user.is_some_and(|(id, _)| *id == conversation))
            && order
                .user_id
                .as_deref()
                .is_none_or(|user| end_user.is_some_and(|(_, id)| id == user))
    }
}

struct SessionEntry {
    identity: SessionIdentity,
    control: mpsc::Sender<SessionControl>,
    /// When it was registered (ms since the epoch).
    registered_ms: i64,
}

/// The live feed of one conversation on this node.
struct Topic {
    sender: broadcast::Sender<HubEvent>,
    /// Highest seq published as committed, so the bus echo of a local commit is not re-read.
    last_committed: i64,
}

/// One follower's live events of a conversation (a session, an SSE stream): a
/// `broadcast::Receiver` that, when dropped as the conversation's last follower on this node,
/// takes the conversation's feed out of the hub. Without that, every conversation a node ever
/// served kept its feed until the next event published to it, which may never come.
pub struct Feed {
    /// `Some` until the feed is dropped, which drops it under the hub's lock.
    receiver: Option<broadcast::Receiver<HubEvent>>,
    hub: Arc<Hub>,
    conversation_id: Uuid,
}

impl std::ops::Deref for Feed {
    type Target = broadcast::Receiver<HubEvent>;

    fn deref(&self) -> &Self::Target {
        self.receiver
            .as_ref()
            .expect("a feed holds its receiver until it is dropped")
    }
}

impl std::ops::DerefMut for Feed {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.receiver
            .as_mut()
            .expect("a feed holds its receiver until it is dropped")
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        let mut conversations = lock(&self.hub.conversations);
        // While this receiver lives the topic in the map is its own: a topic is removed only
        // when it has no receiver (here, or in `publish`). The receiver goes under the lock, so
        // of two feeds dropped at once the second sees the first gone, and the topic goes
        // with the last; a subscriber that comes meanwhile waits for the lock and then finds
        // no topic, so it makes a new one.
        drop(self.receiver.take());
        let last = conversations
            .get(&self.conversation_id)
            .is_some_and(|topic| topic.sender.receiver_count() == 0);
        if last {
            conversations.remove(&self.conversation_id);
            self.hub
                .tell_feed_change(FeedChange::Unfollowed(self.conversation_id));
        }
    }
}

/// A conversation's feed came or went on this node: the NATS bus follows the stream events of
/// exactly the conversations this node has a feed for (ADR 0035). Told under the hub's lock,
/// so the changes of one conversation arrive in the order they happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedChange {
    /// The conversation's first follower on this node came.
    Followed(Uuid),
    /// Its last follower went.
    Unfollowed(Uuid),
}

/// A live event of a channel: every event of its conversations, for the channel's agents.
#[derive(Debug, Clone)]
pub struct ChannelEvent {
    /// The conversation the event belongs to.
    pub conversation_id: Uuid,
    /// The event.
    pub event: HubEvent,
}

/// Node-local fan-out and session registry.
pub struct Hub {
    node_id: String,
    /// Live events buffered per channel for its agent actor (`turns.agent_feed_buffer`).
    agent_feed_buffer: usize,
    channels: Mutex<HashMap<Uuid, broadcast::Sender<ChannelEvent>>>,
    agents_connected: Mutex<HashMap<Uuid, usize>>,
    conversations: Mutex<HashMap<Uuid, Topic>>,
    sessions: Mutex<HashMap<Uuid, SessionEntry>>,
    sessions_closed: tokio::sync::Notify,
    /// Who is told of feeds coming and going, when anyone is (the NATS bus).
    feed_changes: OnceLock<mpsc::UnboundedSender<FeedChange>>,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

/// Recovers the data of a poisoned lock: every critical section here leaves maps consistent.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Hub {
    /// An empty hub for node `node_id`, buffering `agent_feed_buffer` events per channel for its
    /// agents (`turns.agent_feed_buffer`).
    pub fn new(node_id: impl Into<String>, agent_feed_buffer: usize) -> Hub {
        Hub {
            node_id: node_id.into(),
            // A broadcast channel of capacity 0 panics; the configuration never asks for it.
            agent_feed_buffer: agent_feed_buffer.max(1),
            channels: Mutex::new(HashMap::new()),
            agents_connected: Mutex::new(HashMap::new()),
            conversations: Mutex::new(HashMap::new()),
            sessions: Mutex::new(HashMap::new()),
            sessions_closed: tokio::sync::Notify::new(),
            feed_changes: OnceLock::new(),
        }
    }

    /// Tells `changes` from now on of every conversation feed that comes or goes (set once).
    pub fn report_feed_changes(&self, changes: mpsc::UnboundedSender<FeedChange>) {
        if self.feed_changes.set(changes).is_err() {
            tracing::warn!("hub: feed changes are reported to someone already");
        }
    }

    /// Called with the conversations' lock held.
    fn tell_feed_change(&self, change: FeedChange) {
        if let Some(changes) = self.feed_changes.get() {
            let _ = changes.send(change);
        }
    }

    /// This node's id.
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Live events of a conversation from now on; the conversation's feed is forgotten when
    /// its last follower's [`Feed`] is dropped.
    pub fn subscribe(self: &Arc<Self>, conversation_id: Uuid) -> Feed {
        let mut conversations = lock(&self.conversations);
        let receiver = conversations
            .entry(conversation_id)
            .or_insert_with(|| {
                self.tell_feed_change(FeedChange::Followed(conversation_id));
                Topic {
                    sender: broadcast::channel(CONVERSATION_BUFFER).0,
                    last_committed: 0,
                }
            })
            .sender
            .subscribe();
        Feed {
            receiver: Some(receiver),
            hub: Arc::clone(self),
            conversation_id,
        }
    }

    /// How many conversations have a live feed on this node.
    #[cfg(test)]
    fn followed_conversations(&self) -> usize {
        lock(&self.conversations).len()
    }

    /// True when a session of this node follows the conversation and `seq` was not published
    /// as committed yet: the bus bridge then reads the frame and publishes it.
    pub fn wants_committed(&self, conversation_id: Uuid, seq: i64) -> bool {
        lock(&self.conversations)
            .get(&conversation_id)
            .is_some_and(|topic| topic.sender.receiver_count() > 0 && seq > topic.last_committed)
    }

    /// True when a session of this node follows the conversation.
    pub fn has_followers(&self, conversation_id: Uuid) -> bool {
        lock(&self.conversations)
            .get(&conversation_id)
            .is_some_and(|topic| topic.sender.receiver_count() > 0)
    }

    /// Hands an event to the conversation's sessions on this node.
    pub fn publish(&self, conversation_id: Uuid, event: HubEvent) {
        let mut conversations = lock(&self.conversations);
        let Some(topic) = conversations.get_mut(&conversation_id) else {
            return;
        };
        if let HubEvent::Committed { seq, .. } = &event {
            topic.last_committed = topic.last_committed.max(*seq);
        }
        if topic.sender.send(event).is_err() {
            // Nobody listens any more: forget the conversation.
            conversations.remove(&conversation_id);
            self.tell_feed_change(FeedChange::Unfollowed(conversation_id));
        }
    }

    /// Live events of every conversation of a channel from now on (the agent actor's feed).
    pub fn subscribe_channel(&self, channel_id: Uuid) -> broadcast::Receiver<ChannelEvent> {
        lock(&self.channels)
            .entry(channel_id)
            .or_insert_with(|| broadcast::channel(self.agent_feed_buffer).0)
            .subscribe()
    }

    /// True when agents of the channel are connected to this node.
    pub fn has_agents(&self, channel_id: Uuid) -> bool {
        lock(&self.agents_connected)
            .get(&channel_id)
            .is_some_and(|count| *count > 0)
    }

    /// Counts an agent connection of a channel while the guard lives.
    pub fn agent_connected(self: &Arc<Self>, channel_id: Uuid) -> AgentGuard {
        *lock(&self.agents_connected).entry(channel_id).or_insert(0) += 1;
        AgentGuard {
            hub: Arc::clone(self),
            channel_id,
        }
    }

    /// Hands an event to the channel's agents on this node only (forwarded client frames).
    pub fn publish_to_agents(&self, channel_id: Uuid, conversation_id: Uuid, event: HubEvent) {
        self.publish_to_channel(channel_id, conversation_id, &event);
    }

    /// Hands an event to the channel's actor, if it has one here; a channel whose actor ended
    /// (its last agent left) loses its feed, so the map follows the channels served now.
    fn publish_to_channel(&self, channel_id: Uuid, conversation_id: Uuid, event: &HubEvent) {
        let mut channels = lock(&self.channels);
        let Some(sender) = channels.get(&channel_id) else {
            return;
        };
        let event = ChannelEvent {
            conversation_id,
            event: event.clone(),
        };
        if sender.send(event).is_err() {
            channels.remove(&channel_id);
        }
    }

    /// Hands an event to the conversation's sessions and to its channel's agents on this node.
    pub fn publish_to_all(&self, channel_id: Uuid, conversation_id: Uuid, event: HubEvent) {
        self.publish_to_channel(channel_id, conversation_id, &event);
        self.publish(conversation_id, event);
    }

    /// Registers a session; the guard unregisters it when dropped.
    pub fn register(
        self: &Arc<Self>,
        identity: SessionIdentity,
        control: mpsc::Sender<SessionControl>,
    ) -> SessionGuard {
        let connection_id = Uuid::new_v4();
        let registered_ms = chrono::Utc::now().timestamp_millis();
        lock(&self.sessions).insert(
            connection_id,
            SessionEntry {
                identity,
                control,
                registered_ms,
            },
        );
        metrics::gauge!("converger_ws_sessions").increment(1.0);
        SessionGuard {
            hub: Arc::clone(self),
            connection_id,
        }
    }

    /// Number of open sessions on this node.
    pub fn session_count(&self) -> usize {
        lock(&self.sessions).len()
    }

    /// Waits until no session is open or the deadline passes; returns the sessions left.
    pub async fn wait_for_no_sessions(&self, deadline: tokio::time::Instant) -> usize {
        loop {
            let closed = self.sessions_closed.notified();
            let open = self.session_count();
            if open == 0 {
                return 0;
            }
            if tokio::time::timeout_at(deadline, closed).await.is_err() {
                return self.session_count();
            }
        }
    }

    /// The control senders of every open session (for draining).
    pub fn session_controls(&self) -> Vec<mpsc::Sender<SessionControl>> {
        lock(&self.sessions)
            .values()
            .map(|entry| entry.control.clone())
            .collect()
    }

    /// Tells every session of a channel to close.
    pub fn close_channel(&self, channel_id: Uuid, control: SessionControl) {
        self.tell(|entry| entry.identity.channel_id == channel_id, control);
    }

    /// Tells every session the order names, opened before it was given, to close; returns how
    /// many were told.
    pub fn disconnect(&self, order: &DisconnectOrder, control: SessionControl) -> usize {
        self.tell(
            |entry| entry.registered_ms <= order.issued_ms && entry.identity.matches(order),
            control,
        )
    }

    /// Sends `control` to every session `picked` selects; returns how many.
    fn tell(&self, picked: impl Fn(&SessionEntry) -> bool, control: SessionControl) -> usize {
        let targets: Vec<_> = lock(&self.sessions)
            .values()
            .filter(|entry| picked(entry))
            .map(|entry| entry.control.clone())
            .collect();
        for target in &targets {
            // A full control queue means the session is already being told to close.
            let _ = target.try_send(control.clone());
        }
        targets.len()
    }
}

/// Keeps a session registered while alive.
pub struct SessionGuard {
    hub: Arc<Hub>,
    connection_id: Uuid,
}

impl SessionGuard {
    /// The connection id given to the session.
    pub fn connection_id(&self) -> Uuid {
        self.connection_id
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        lock(&self.hub.sessions).remove(&self.connection_id);
        metrics::gauge!("converger_ws_sessions").decrement(1.0);
        self.hub.sessions_closed.notify_waiters();
    }
}

/// Keeps an agent connection counted while alive.
pub struct AgentGuard {
    hub: Arc<Hub>,
    channel_id: Uuid,
}

impl Drop for AgentGuard {
    fn drop(&mut self) {
        let mut counts = lock(&self.hub.agents_connected);
        if let Some(count) = counts.get_mut(&self.channel_id) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                counts.remove(&self.channel_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conversations_feed_goes_with_its_last_follower() {
        let hub = Arc::new(Hub::new("node", 1_024));
        let conversation = Uuid::new_v4();
        let first = hub.subscribe(conversation);
        let second = hub.subscribe(conversation);
        assert_eq!(hub.followed_conversations(), 1);
        drop(first);
        assert!(hub.has_followers(conversation), "one follower is left");
        drop(second);
        assert_eq!(hub.followed_conversations(), 0);
        assert!(!hub.has_followers(conversation));

        // A follower that comes back gets a new feed, and what is published reaches it.
        let mut again = hub.subscribe(conversation);
        hub.publish(
            conversation,
            HubEvent::Transient {
                frame: Arc::new(serde_json::json!({"type": "typing"})),
                origin: None,
            },
        );
        assert!(matches!(again.try_recv(), Ok(HubEvent::Transient { .. })));
    }
}
