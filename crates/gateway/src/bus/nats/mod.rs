//! The NATS transport (ADR 0033): core NATS, no persistence in NATS; Postgres stays the log.
//!
//! Subjects, under `nats.subject_prefix` (`<p>`):
//! - `<p>.c.<conversation>`: a commit (`{conversation, seq range, channel, frames}`), published
//!   by the committing node after its transaction committed;
//! - `<p>.s.<conversation>`: one conversation's stream events from one node, in the order it
//!   accepted them, packed; only nodes following the conversation subscribe (`interest.rs`);
//! - `<p>.q`: a node asking the others what their agents stream in a conversation;
//! - `<p>.e`: transient frames, regenerated and stopped turns, channel status, disconnects.
//!
//! The connection uses `no_echo`, so a node never hears its own publications. Publishing goes
//! through one task per node, in order, each publication bounded by a timeout; a message that
//! cannot go out is dropped (counted), because the outbox has it: every node reads the outbox
//! back after its own connection was lost or its subscription overflowed (from the moment of
//! the trouble), and sweeps the last moments of it every `nats.sweep_ms`, for a node that died
//! between its commit and its publish.

mod interest;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use async_nats::{ConnectOptions, Event, ServerAddr};
use converger_store::Store;
use converger_store::bus::{BusEvent, CommittedRuntime, encode, encode_streams};
use futures_util::StreamExt;
use tokio::sync::{Notify, mpsc, oneshot};
use uuid::Uuid;

use self::interest::{Interest, Peers};
use super::{BusError, StreamHoldings};
use crate::config::NatsConfig;
use crate::hub::FeedChange;
use crate::recent::{RECENT_PERIOD_MS, RECENT_TICK, Recent, monotonic_ms};

/// Publications waiting for the publishing task at most; past this they are dropped (the
/// outbox has every commit, and transient frames may be lost).
const OUTGOING_QUEUE: usize = 65_536;

/// Longest wait for one publication to enter the client's buffer.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(1);

/// Largest message this node publishes (NATS servers accept 1 MiB by default); stream events
/// are packed up to it.
const MESSAGE_LIMIT: usize = 256 * 1024;

/// Extra history read back after trouble, for commits in flight when it began.
const CATCH_UP_MARGIN: Duration = Duration::from_secs(5);

/// Conversations whose last published seq a node remembers per generation: those of the last
/// minute or two (`Recent`); a repeated publication costs a message, never a frame.
const REMEMBERED_CONVERSATIONS: usize = 65_536;

/// One publication: a subject and its payload.
struct Outgoing {
    subject: String,
    payload: bytes::Bytes,
}

/// This node's NATS connection and its publishing queue.
pub(super) struct Link {
    sweep: Duration,
    outgoing: mpsc::Sender<Outgoing>,
    /// Set by the connection's events when it was lost or a subscription overflowed; the
    /// catch-up task reads the outbox back since then.
    trouble: Arc<Trouble>,
    /// What this node published of each conversation.
    published: Arc<Published>,
    /// The connection and the subject prefix; the stream subjects this node follows, and the
    /// questions it asks and answers.
    interest: Interest,
}

/// The highest seq published per conversation, and whether that publication named the runtime
/// version, so a commit announced both by its worker and by its session goes out once; twice
/// only when the session's announcement, which cannot name the version, went first (receivers
/// learn the runtime from the second, ADR 0039, and drop its frames).
struct Published(std::sync::Mutex<Recent<uuid::Uuid, (i64, bool)>>);

impl Default for Published {
    fn default() -> Self {
        Published(std::sync::Mutex::new(Recent::new(
            REMEMBERED_CONVERSATIONS,
            RECENT_PERIOD_MS,
        )))
    }
}

impl Published {
    /// Forgets conversations not published lately.
    fn forget_idle(&self) {
        if let Ok(mut published) = self.0.lock() {
            published.forget_idle(monotonic_ms());
        }
    }

    /// True when the commit ending at `seq` of `conversation_id` was not published yet, or was
    /// published without the runtime version this one names (it now counts as published).
    fn claim(&self, event: &BusEvent) -> bool {
        let BusEvent::Committed {
            conversation_id,
            seq,
            runtime,
            ..
        } = event
        else {
            return true;
        };
        let Ok(mut published) = self.0.lock() else {
            return true;
        };
        let versioned = runtime.is_some();
        let published_before =
            published
                .get(conversation_id)
                .is_some_and(|&(last, last_versioned)| {
                    last > *seq || (last == *seq && (last_versioned || !versioned))
                });
        if published_before {
            return false;
        }
        let _ = published.insert(*conversation_id, (*seq, versioned));
        true
    }
}

/// Trouble on the connection, and when it began.
#[derive(Default)]
struct Trouble {
    pending: AtomicBool,
    since: std::sync::Mutex<Option<Instant>>,
    wake: Notify,
}

impl Trouble {
    fn begin(&self) {
        if let Ok(mut since) = self.since.lock() {
            since.get_or_insert_with(Instant::now);
        }
    }

    /// The connection is back (or never left): read back from when the trouble began.
    fn recovered(&self) {
        self.pending.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// How far back to read after trouble, when the connection recovered from it.
    fn window(&self) -> Option<Duration> {
        if !self.pending.swap(false, Ordering::AcqRel) {
            return None;
        }
        let began = self.since.lock().ok().and_then(|since| *since)?;
        Some(began.elapsed() + CATCH_UP_MARGIN)
    }

    /// The read back over the trouble succeeded.
    fn settled(&self) {
        if let Ok(mut since) = self.since.lock() {
            *since = None;
        }
    }

    /// The read back failed: the next tick tries again over the same trouble.
    fn retry(&self) {
        self.pending.store(true, Ordering::Release);
    }
}

impl Link {
    /// Connects to one of `config.servers` (failing after `connect_timeout_ms`), as `node_id`.
    pub(super) async fn connect(config: &NatsConfig, node_id: &str) -> Result<Link, BusError> {
        let servers = config
            .servers
            .iter()
            .map(|server| {
                server
                    .parse::<ServerAddr>()
                    .map_err(|error| BusError::Nats(format!("server {server}: {error}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let trouble = Arc::new(Trouble::default());
        let events = Arc::clone(&trouble);
        let mut options = ConnectOptions::new()
            .name(format!("converger {node_id}"))
            .no_echo()
            .require_tls(config.require_tls)
            .connection_timeout(Duration::from_millis(config.connect_timeout_ms))
            .subscription_capacity(config.subscription_capacity)
            // Replies (holdings, ADR 0035) come under the prefix too, so one permission covers
            // every subject the node uses.
            .custom_inbox_prefix(format!("{}.i", config.subject_prefix))
            .event_callback(move |event| {
                let trouble = Arc::clone(&events);
                async move { on_event(&trouble, event) }
            });
        if !config.user.is_empty() {
            options = options.user_and_password(config.user.clone(), config.password.clone());
        }
        if !config.token.is_empty() {
            options = options.token(config.token.clone());
        }
        let wait = Duration::from_millis(config.connect_timeout_ms);
        let client = tokio::time::timeout(wait, options.connect(servers))
            .await
            .map_err(|_| BusError::Nats(format!("no server answered within {wait:?}")))?
            .map_err(|error| BusError::Nats(error.to_string()))?;
        let (outgoing, queue) = mpsc::channel(OUTGOING_QUEUE);
        tokio::spawn(publish_in_order(client.clone(), queue));
        Ok(Link {
            interest: Interest {
                client,
                prefix: config.subject_prefix.clone(),
                node_id: node_id.to_owned(),
                peers: Arc::new(Peers::default()),
                gaps: Arc::default(),
            },
            sweep: Duration::from_millis(config.sweep_ms),
            outgoing,
            trouble,
            published: Arc::default(),
        })
    }

    /// Subscribes to the commits and the events (not the streams: `follow_streams`) and starts
    /// the catch-up and the sweep; the node's own committed batches (`own_commits`) are
    /// published and handed on. Every event goes to `events`. The oneshot fires once the
    /// subscriptions are in place.
    pub(super) fn listen(
        &self,
        store: Store,
        events: mpsc::UnboundedSender<BusEvent>,
        mut own_commits: mpsc::UnboundedReceiver<BusEvent>,
    ) -> oneshot::Receiver<()> {
        let (listening, ready) = oneshot::channel();
        let (client, prefix) = (self.interest.client.clone(), &self.interest.prefix);
        let subjects = [format!("{prefix}.c.>"), format!("{prefix}.e")];
        let heard = events.clone();
        tokio::spawn(async move {
            let (commits, others) = match (
                client.subscribe(subjects[0].clone()).await,
                client.subscribe(subjects[1].clone()).await,
            ) {
                (Ok(commits), Ok(others)) => (commits, others),
                (Err(error), _) | (_, Err(error)) => {
                    tracing::error!(%error, ?subjects, "nats bus: cannot subscribe");
                    return;
                }
            };
            let mut subscription = futures_util::stream::select(commits, others);
            // The subscriptions go out to the server before the node says it listens.
            if let Err(error) = client.flush().await {
                tracing::warn!(%error, "nats bus: flush after subscribe failed");
            }
            tracing::info!(?subjects, "nats bus listening");
            let _ = listening.send(());
            while let Some(message) = subscription.next().await {
                count_received();
                if !hand_on(&heard, &message.payload) {
                    return;
                }
            }
        });
        let (outgoing, prefix) = (self.outgoing.clone(), self.interest.prefix.clone());
        let published = Arc::clone(&self.published);
        let own = events.clone();
        tokio::spawn(async move {
            let mut forget = tokio::time::interval(RECENT_TICK);
            loop {
                let event = tokio::select! {
                    event = own_commits.recv() => match event {
                        Some(event) => event,
                        None => return,
                    },
                    _ = forget.tick() => {
                        published.forget_idle();
                        continue;
                    }
                };
                // The door needs the event too: the copy is made only when it is published.
                if published.claim(&event)
                    && let Some(message) = committed_message(&prefix, event.clone())
                {
                    enqueue(&outgoing, message);
                }
                if own.send(event).is_err() {
                    return;
                }
            }
        });
        tokio::spawn(read_back(
            store,
            events,
            Arc::clone(&self.trouble),
            self.sweep,
        ));
        ready
    }

    /// Publishes a commit on its conversation's subject, unless it was published before.
    pub(super) fn publish_committed(&self, event: BusEvent) {
        if !self.published.claim(&event) {
            return;
        }
        if let Some(outgoing) = committed_message(&self.interest.prefix, event) {
            enqueue(&self.outgoing, outgoing);
        }
    }

    /// Publishes an event on the events subject.
    pub(super) fn publish_event(&self, event: BusEvent) {
        let Some(text) = encode(event) else { return };
        enqueue(
            &self.outgoing,
            Outgoing {
                subject: format!("{}.e", self.interest.prefix),
                payload: text.into(),
            },
        );
    }

    /// Publishes this node's stream events on their conversations' subjects, each
    /// conversation's in order, packed into as few messages as fit. They go to the client
    /// directly, not through the publishing queue: there is about one message per chunk (one
    /// per conversation and relay window), the relay is their one sender and waits (its
    /// backlog counts against the node's stream budget), and a commit published after them
    /// still follows them on the connection.
    pub(super) async fn publish_streams(&self, node_id: &str, events: &[(Uuid, String)]) {
        let client = &self.interest.client;
        if client.connection_state() != async_nats::connection::State::Connected {
            // A chunk that arrives late is of no use to a viewer.
            metrics::counter!("converger_bus_publications_dropped_total").increment(1);
            return;
        }
        // A stable sort keeps each conversation's events in the order they were accepted.
        let mut sorted: Vec<&(Uuid, String)> = events.iter().collect();
        sorted.sort_by_key(|(conversation_id, _)| *conversation_id);
        let (mut published, mut dropped) = (0u64, 0u64);
        for group in sorted.chunk_by(|a, b| a.0 == b.0) {
            let Some((conversation_id, _)) = group.first() else {
                continue;
            };
            let subject = Interest::stream_subject(&self.interest.prefix, *conversation_id);
            let texts: Vec<&str> = group.iter().map(|(_, text)| text.as_str()).collect();
            for text in encode_streams(node_id, &texts, MESSAGE_LIMIT) {
                match client.publish(subject.clone(), text.into()).await {
                    Ok(()) => published += 1,
                    Err(_) => dropped += 1,
                }
            }
        }
        metrics::counter!("converger_bus_messages_published_total").increment(published);
        if dropped > 0 {
            metrics::counter!("converger_bus_publications_dropped_total").increment(dropped);
        }
    }

    /// Answers the other nodes' questions about this node's streams from `holdings`.
    pub(super) fn answer_holdings(&self, holdings: Weak<dyn StreamHoldings>) {
        self.interest.answer(holdings);
    }

    /// Follows the stream events of the conversations the hub follows, handing them to
    /// `events`; returns where the hub tells its feed changes.
    pub(super) fn follow_streams(
        &self,
        events: mpsc::UnboundedSender<BusEvent>,
    ) -> mpsc::UnboundedSender<FeedChange> {
        self.interest.follow(events)
    }

    /// A replica of the conversation's stream missed a chunk: its holdings are asked again.
    pub(super) fn stream_gap(&self, conversation_id: Uuid) {
        self.interest.gap(conversation_id);
    }

    /// The other nodes' holdings of a conversation (of one stopped turn, when named).
    pub(super) async fn ask_holdings(
        &self,
        conversation_id: Uuid,
        stopped_turn: Option<converger_core::streams::StreamTurn>,
    ) -> Vec<String> {
        self.interest.ask(conversation_id, stopped_turn).await
    }

    /// A peer node came up or went, in gossip.
    pub(super) fn peer_changed(&self, node: &converger_cluster::NodeKey, up: bool) {
        self.interest.peers.changed(node, up);
    }
}

/// The commit's message on `<prefix>.c.<conversation>`; `None` for any other event. A commit
/// too large to carry its frames goes without them: receivers read them back.
fn committed_message(prefix: &str, event: BusEvent) -> Option<Outgoing> {
    let BusEvent::Committed {
        conversation_id,
        first_seq,
        seq,
        channel_id,
        frames,
        runtime,
    } = event
    else {
        return None;
    };
    let with = |frames, runtime| BusEvent::Committed {
        conversation_id,
        first_seq,
        seq,
        channel_id,
        frames,
        runtime,
    };
    // The runtime's version always goes; its state only with the frames.
    let version_only = runtime.as_ref().map(|runtime| CommittedRuntime {
        version: runtime.version,
        state: None,
    });
    let mut text = encode(with(frames, runtime))?;
    if text.len() > MESSAGE_LIMIT {
        text = encode(with(Vec::new(), version_only))?;
    }
    Some(Outgoing {
        subject: format!("{prefix}.c.{conversation_id}"),
        payload: text.into(),
    })
}

/// Counts one message heard from NATS.
fn count_received() {
    metrics::counter!("converger_bus_messages_received_total").increment(1);
}

/// Hands one message's events on; false once nobody takes them.
fn hand_on(events: &mpsc::UnboundedSender<BusEvent>, payload: &[u8]) -> bool {
    converger_store::bus::decode(payload)
        .into_iter()
        .all(|event| events.send(event).is_ok())
}

/// Queues a publication; when the queue is full (NATS away for long) it is dropped.
fn enqueue(outgoing: &mpsc::Sender<Outgoing>, message: Outgoing) {
    if outgoing.try_send(message).is_err() {
        metrics::counter!("converger_bus_publications_dropped_total").increment(1);
    }
}

/// Publishes queued messages in order. While the connection is down, and for a message that
/// cannot enter the client's buffer in time, the message is dropped at once: the outbox has
/// the commits, and a stream chunk that arrives late is of no use to a viewer.
async fn publish_in_order(client: async_nats::Client, mut queue: mpsc::Receiver<Outgoing>) {
    let mut dropping = false;
    while let Some(Outgoing { subject, payload }) = queue.recv().await {
        let sent = if client.connection_state() == async_nats::connection::State::Connected {
            tokio::time::timeout(PUBLISH_TIMEOUT, client.publish(subject, payload))
                .await
                .map_err(|_| ())
                .and_then(|published| published.map_err(|_| ()))
        } else {
            Err(())
        };
        match sent {
            Ok(()) => {
                metrics::counter!("converger_bus_messages_published_total").increment(1);
                if dropping {
                    tracing::info!("nats bus: publishing again");
                    dropping = false;
                }
            }
            Err(()) => {
                metrics::counter!("converger_bus_publications_dropped_total").increment(1);
                if !dropping {
                    tracing::warn!("nats bus: publications dropped (the outbox keeps the commits)");
                    dropping = true;
                }
            }
        }
    }
}

/// What the connection's events mean for the catch-up.
fn on_event(trouble: &Trouble, event: Event) {
    match event {
        Event::Disconnected => {
            tracing::warn!("nats bus: disconnected");
            metrics::gauge!("converger_bus_connected").set(0.0);
            metrics::counter!("converger_bus_reconnects_total").increment(1);
            trouble.begin();
        }
        Event::Connected => {
            tracing::info!("nats bus: connected");
            metrics::gauge!("converger_bus_connected").set(1.0);
            trouble.recovered();
        }
        Event::SlowConsumer(_) => {
            // Messages were dropped just now: read back what they announced.
            tracing::warn!("nats bus: slow consumer; reading the outbox back");
            metrics::counter!("converger_bus_slow_consumers_total").increment(1);
            trouble.begin();
            trouble.recovered();
        }
        Event::LameDuckMode => tracing::info!("nats bus: server entering lame duck mode"),
        other => tracing::debug!(event = %other, "nats bus event"),
    }
}

/// Reads the outbox back: over the trouble once the connection recovered, and over the last
/// moments every `sweep` (commits only: the orders were carried out when first heard).
async fn read_back(
    store: Store,
    events: mpsc::UnboundedSender<BusEvent>,
    trouble: Arc<Trouble>,
    sweep: Duration,
) {
    let mut ticks = tokio::time::interval(sweep);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let window = tokio::select! {
            _ = ticks.tick() => trouble.window(),
            () = trouble.wake.notified() => trouble.window(),
        };
        if events.is_closed() {
            return;
        }
        let (window, sweeping) = match window {
            Some(window) => (window, false),
            None => (sweep * 2 + CATCH_UP_MARGIN, true),
        };
        let read = match store.events_since(window).await {
            Ok(read) => read,
            Err(error) => {
                tracing::warn!(%error, "nats bus: outbox read back failed");
                if !sweeping {
                    trouble.retry();
                }
                continue;
            }
        };
        if !sweeping {
            trouble.settled();
        }
        for event in read {
            if sweeping && !matches!(event, BusEvent::Committed { .. }) {
                continue;
            }
            if events.send(event).is_err() {
                return;
            }
        }
    }
}
