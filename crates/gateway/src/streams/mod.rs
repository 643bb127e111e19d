//! Streamed answers on this node (ADR 0019): the registry of open streams (this node's agents'
//! and replicas of the other nodes'), their fan-out to this node's end-user sessions through the
//! hub, and the relay that carries them to the other nodes in coalesced notifications.
//!
//! Nothing is written to the database per chunk. The relay hands what queued within one window
//! (`streams.relay_window_ms`) to the bus at once: on `postgres`, one statement of `pg_notify`
//! calls, at most one transaction per window and node, whatever the number of chunks. A node
//! that sees a stream start late (it came up mid-stream) cannot show that stream; its sessions
//! get the committed answer. On NATS a node holds replicas only of the conversations it
//! follows, and takes what it missed from the other nodes' holdings (`holdings.rs`).

mod holdings;
mod packed;
mod relay;

use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::ws::Utf8Bytes;
use converger_core::streams::{
    Accepted, ChunkIn, ChunkRefusal, OpenStream, StreamLimits, StreamRegistry, StreamTurn,
};
use converger_protocol::{Profile, StopReason, end_user_chunk};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

pub use self::packed::PackedChunks;
use self::relay::{Backlog, RELAY_TIMEOUT, RelayOrder, RelayedChunk, RelayedEnd, RelayedEvent};
use crate::hub::{Hub, HubEvent, lock};
pub use crate::stream_event::{ChunkBody, StreamChange, StreamEvent};

/// One frame of a catch-up with an open stream, and the chunk indices it covers.
#[derive(Debug)]
pub struct CatchUpFrame {
    /// The first chunk index covered.
    pub first: u64,
    /// The last chunk index covered.
    pub last: u64,
    /// The frame for the session's profile.
    pub frame: Utf8Bytes,
}

/// An open stream from chunk `from` on as a session catching up is shown it (a snapshot read):
/// each run of text chunks coalesced into one chunk frame, each UI chunk as it is.
pub fn catch_up_frames(
    profile: Profile,
    stream_id: &str,
    stream: &OpenStream<PackedChunks>,
    from: u64,
) -> Vec<CatchUpFrame> {
    let Ok(from) = usize::try_from(from) else {
        return Vec::new();
    };
    stream
        .chunks
        .catch_up(from)
        .into_iter()
        .map(|piece| CatchUpFrame {
            first: piece.first,
            last: piece.last,
            frame: end_user_chunk(
                profile,
                stream_id,
                piece.first..=piece.last,
                stream.turn.seq,
                stream.turn.revision,
                &piece.content,
                stream.chunks.from(),
            )
            .into(),
        })
        .collect()
}

/// Another node's chunk as this node's replica of its stream takes it.
struct ReplicaChunk<'a> {
    /// The node whose agent writes the stream.
    node: &'a str,
    stream_id: &'a str,
    index: u64,
    turn: StreamTurn,
    fence: Option<i64>,
    /// The writing connection.
    owner: &'a str,
    body: Arc<ChunkBody>,
}

/// A chunk an agent connection of this node sent.
#[derive(Debug)]
pub struct LocalChunk<'a> {
    /// The conversation.
    pub conversation_id: Uuid,
    /// The stream.
    pub stream_id: &'a str,
    /// Its position.
    pub index: u64,
    /// The turn (index 0).
    pub turn: Option<StreamTurn>,
    /// The delivery's fence (lease mode, index 0).
    pub fence: Option<i64>,
    /// The writing connection.
    pub owner: &'a str,
    /// The writing connection's channel: its streams count against that channel's budget.
    pub channel: &'a str,
    /// The content.
    pub body: ChunkBody,
}

/// The open streams this node knows and the relay to the other nodes.
pub struct LiveStreams {
    node_id: String,
    registry: Mutex<StreamRegistry<Uuid, PackedChunks>>,
    /// The text of streams a stop ended, until their turn is settled (ADR 0028).
    stopped: Mutex<StoppedTexts>,
    relay: mpsc::UnboundedSender<RelayOrder>,
    /// What the relay holds and has not sent yet (part of the node's stream budget).
    relay_backlog: Arc<Backlog>,
    limits: StreamLimits,
    /// Told of a gap in a replica (NATS: the node asks for the holdings again).
    bus: Arc<crate::bus::Bus>,
}

impl std::fmt::Debug for LiveStreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveStreams")
            .field("node_id", &self.node_id)
            .finish_non_exhaustive()
    }
}

impl LiveStreams {
    /// The streams of node `node_id`, relaying through `bus` once per `relay_window` at most.
    pub fn start(
        node_id: &str,
        bus: Arc<crate::bus::Bus>,
        limits: StreamLimits,
        relay_window: Duration,
    ) -> Arc<LiveStreams> {
        let (relay, orders) = mpsc::unbounded_channel();
        let relay_backlog = Arc::new(Backlog::default());
        tokio::spawn(relay::run(
            Arc::clone(&bus),
            relay_window,
            Arc::clone(&relay_backlog),
            orders,
        ));
        Arc::new(LiveStreams {
            node_id: node_id.to_owned(),
            registry: Mutex::new(StreamRegistry::default()),
            stopped: Mutex::new(StoppedTexts::default()),
            relay,
            relay_backlog,
            limits,
            bus,
        })
    }

    /// Takes a chunk from an agent connection of this node; an accepted chunk reaches this
    /// node's sessions and the other nodes. Over `maxStreamBytes` the stream is aborted
    /// everywhere.
    pub fn accept(&self, hub: &Hub, chunk: LocalChunk<'_>) -> Result<(), ChunkRefusal> {
        let body = Arc::new(chunk.body);
        let (outcome, turn) = {
            let mut registry = lock(&self.registry);
            // What the node holds is its open streams and what the relay has not sent yet: a
            // relay that falls behind takes from the same budget.
            let limits = StreamLimits {
                max_total_bytes: self.total_budget_left(),
                ..self.limits
            };
            let outcome = registry.append(
                &chunk.conversation_id,
                chunk.stream_id,
                ChunkIn {
                    owner: chunk.owner,
                    node: &self.node_id,
                    pool: chunk.channel,
                    index: chunk.index,
                    turn: chunk.turn,
                    fence: chunk.fence,
                    payload: Arc::clone(&body),
                    bytes: body.content.size(),
                },
                &limits,
            );
            let turn = registry
                .get(&chunk.conversation_id, chunk.stream_id)
                .map(|stream| stream.turn);
            (outcome, turn)
        };
        let Accepted { fenced, .. } = match outcome {
            Ok(accepted) => accepted,
            Err(refusal) => {
                if matches!(refusal, ChunkRefusal::OverBudget { .. }) {
                    metrics::counter!("converger_stream_budget_refusals_total").increment(1);
                }
                // Viewers never keep half a stream without an end.
                if let Some(reason) = refusal.abort_reason() {
                    self.announce_end(hub, chunk.conversation_id, chunk.stream_id, Some(reason));
                }
                return Err(refusal);
            }
        };
        for stream_id in fenced {
            self.announce_end(hub, chunk.conversation_id, &stream_id, Some("fenced"));
        }
        let Some(turn) = turn else {
            return Ok(());
        };
        metrics::counter!("converger_stream_chunks_total").increment(1);
        self.relay_event(&RelayedEvent::Chunk(RelayedChunk {
            c: chunk.conversation_id,
            s: Cow::Borrowed(chunk.stream_id),
            i: chunk.index,
            t: (turn.seq, turn.revision),
            x: chunk.fence,
            o: Cow::Borrowed(chunk.owner),
            b: (&body.content).into(),
            f: Cow::Borrowed(&body.from),
        }));
        hub.publish(
            chunk.conversation_id,
            HubEvent::Stream(StreamEvent::new(StreamChange::Chunk {
                stream_id: chunk.stream_id.to_owned(),
                index: chunk.index,
                turn,
                body,
            })),
        );
        Ok(())
    }

    /// Ends a stream an agent connection of this node owns (`streamAbort`); false when the
    /// connection has no such open stream.
    pub fn abort_own(
        &self,
        hub: &Hub,
        conversation_id: Uuid,
        stream_id: &str,
        owner: &str,
        reason: &str,
    ) -> bool {
        let owned = lock(&self.registry)
            .get(&conversation_id, stream_id)
            .is_some_and(|stream| stream.owner == owner);
        if owned {
            self.announce_end(hub, conversation_id, stream_id, Some(reason));
        }
        owned
    }

    /// True when the stream is open or ended recently (a chunk at index 0 would not open it).
    pub fn is_known(&self, conversation_id: Uuid, stream_id: &str) -> bool {
        lock(&self.registry).is_known(&conversation_id, stream_id)
    }

    /// True when the stream ended recently.
    pub fn has_ended(&self, conversation_id: Uuid, stream_id: &str) -> bool {
        lock(&self.registry).has_ended(&conversation_id, stream_id)
    }

    /// True when the turn has open streams (its result then waits for the relay to flush, so
    /// every node sees the chunks before the commit).
    pub fn turn_is_streaming(&self, conversation_id: Uuid, turn: StreamTurn) -> bool {
        lock(&self.registry).has_turn(&conversation_id, turn)
    }

    /// Ends the open streams of a turn whose result was settled: `committed` when it was
    /// stored (or already was), otherwise aborted with `reason`.
    pub fn settle_turn(
        &self,
        hub: &Hub,
        conversation_id: Uuid,
        turn: StreamTurn,
        aborted: Option<&str>,
    ) {
        let ended = lock(&self.registry).end_turn(&conversation_id, turn);
        for stream_id in ended {
            self.relay_end(conversation_id, &stream_id, aborted);
            publish_end(hub, conversation_id, stream_id, aborted.map(str::to_owned));
        }
    }

    /// A turn was stopped: the streams of it that this node's agents write (`any_node`: every
    /// stream of it this node holds) end here, aborted with `reason`, and the end is relayed
    /// after every chunk they had, so every node ends them at the same chunk. Their text is
    /// kept for the settlement.
    pub fn stop_turn(
        &self,
        hub: &Hub,
        conversation_id: Uuid,
        turn: StreamTurn,
        reason: &str,
        any_node: bool,
    ) {
        let ended = lock(&self.registry).end_turn_where(&conversation_id, turn, |stream| {
            any_node || stream.node == self.node_id
        });
        for (stream_id, stream) in ended {
            self.keep_stopped(conversation_id, &stream_id, &stream);
            self.relay_end(conversation_id, &stream_id, Some(reason));
            publish_end(hub, conversation_id, stream_id, Some(reason.to_owned()));
        }
    }

    /// The stream and text a stop ended for the turn, taken once (the settlement's answer).
    pub fn take_stopped(&self, conversation_id: Uuid, turn: StreamTurn) -> Option<StoppedText> {
        lock(&self.stopped).take(conversation_id, turn)
    }

    fn keep_stopped(
        &self,
        conversation_id: Uuid,
        stream_id: &str,
        stream: &OpenStream<PackedChunks>,
    ) {
        lock(&self.stopped).keep(
            conversation_id,
            stream.turn,
            StoppedText {
                stream_id: stream_id.to_owned(),
                text: stream.chunks.text().to_owned(),
            },
        );
    }

    /// Aborts every stream of an agent connection that went away.
    pub fn abort_owner(&self, hub: &Hub, owner: &str) {
        let ids = lock(&self.registry).end_where(|stream| stream.owner == owner);
        for (conversation_id, stream_id) in ids {
            self.relay_end(conversation_id, &stream_id, Some("disconnected"));
            publish_end(hub, conversation_id, stream_id, Some("disconnected".into()));
        }
    }

    /// Waits until every stream event relayed before this call has been sent (or given up).
    pub async fn flush(&self) {
        let (done, flushed) = oneshot::channel();
        if self.relay.send(RelayOrder::Flush(done)).is_ok() {
            let _ = tokio::time::timeout(RELAY_TIMEOUT, flushed).await;
        }
    }

    /// The open streams of a conversation, for a session that joins or fell behind.
    pub fn snapshot(&self, conversation_id: Uuid) -> Vec<(String, OpenStream<PackedChunks>)> {
        lock(&self.registry).snapshot(&conversation_id)
    }

    /// The id of an open stream of the conversation answering the turn at `seq`.
    pub fn open_for_turn_seq(&self, conversation_id: Uuid, seq: i64) -> Option<String> {
        lock(&self.registry)
            .open_for_turn_seq(&conversation_id, seq)
            .map(str::to_owned)
    }

    /// Sets the gauges only a scrape needs (none is touched per chunk).
    pub fn record_metrics(&self) {
        metrics::gauge!("converger_stream_relay_backlog_bytes")
            .set(self.relay_backlog.bytes() as f64);
    }

    /// One open stream, when it is.
    pub fn stream(
        &self,
        conversation_id: Uuid,
        stream_id: &str,
    ) -> Option<OpenStream<PackedChunks>> {
        lock(&self.registry)
            .get(&conversation_id, stream_id)
            .cloned()
    }

    /// The node's stream budget less what the relay holds unsent.
    fn total_budget_left(&self) -> usize {
        self.limits
            .max_total_bytes
            .saturating_sub(self.relay_backlog.bytes())
    }

    /// Open streams and the bytes they hold (the status page and metrics).
    pub fn usage(&self) -> (usize, usize) {
        let registry = lock(&self.registry);
        (registry.open_count(), registry.open_bytes())
    }

    /// Another node went: its streams are aborted here (nobody will end them).
    pub fn node_down(&self, hub: &Hub, node_id: &str) {
        let ids = lock(&self.registry).end_where(|stream| stream.node == node_id);
        for (conversation_id, stream_id) in ids {
            publish_end(hub, conversation_id, stream_id, Some("node_down".into()));
        }
    }

    /// Applies stream events another node relayed.
    pub fn apply_remote(&self, hub: &Hub, node: &str, events: Vec<Value>) {
        if node == self.node_id {
            return;
        }
        tracing::debug!(
            node,
            events = events.len(),
            "stream events from another node"
        );
        for event in events {
            self.apply_remote_event(hub, node, event);
        }
    }

    fn apply_remote_event(&self, hub: &Hub, node: &str, event: Value) {
        let event = match serde_json::from_value::<RelayedEvent<'static>>(event) {
            Ok(event) => event,
            Err(error) => {
                tracing::warn!(%error, node, "stream event from another node unreadable");
                return;
            }
        };
        let chunk = match event {
            RelayedEvent::Chunk(chunk) => chunk,
            RelayedEvent::End(end) => {
                let (conversation_id, stream_id) = (end.c, end.s.as_ref());
                let aborted = end.e.map(Cow::into_owned);
                let ended = {
                    let mut registry = lock(&self.registry);
                    let ended = registry.end(&conversation_id, stream_id);
                    // A stream whose start this node missed (it began to follow the
                    // conversation mid-stream) must not open from holdings told before its end.
                    if ended.is_none() {
                        registry.forbid(&conversation_id, stream_id);
                    }
                    ended
                };
                if let Some(stream) = ended {
                    if aborted.as_deref().is_some_and(is_stop_reason) {
                        self.keep_stopped(conversation_id, stream_id, &stream);
                    }
                    publish_end(hub, conversation_id, stream_id.to_owned(), aborted);
                }
                return;
            }
        };
        let turn = chunk.turn();
        let RelayedChunk {
            c: conversation_id,
            s: stream_id,
            i: index,
            x: fence,
            o: owner,
            b: content,
            f: from,
            ..
        } = chunk;
        let body = Arc::new(ChunkBody {
            content: content.into(),
            from: Arc::new(from.into_owned()),
        });
        let replica = ReplicaChunk {
            node,
            stream_id: stream_id.as_ref(),
            index,
            turn,
            fence,
            owner: owner.as_ref(),
            body,
        };
        if let Some(event) = self.append_replica(hub, conversation_id, replica) {
            hub.publish(conversation_id, HubEvent::Stream(event));
        }
    }

    /// Takes another node's chunk into this node's replica of its stream; returns the event
    /// that shows it to this node's followers when it was taken.
    fn append_replica(
        &self,
        hub: &Hub,
        conversation_id: Uuid,
        chunk: ReplicaChunk<'_>,
    ) -> Option<Arc<StreamEvent>> {
        let ReplicaChunk {
            node,
            stream_id,
            index,
            turn,
            fence,
            owner,
            body,
        } = chunk;
        // The owner's node applied the stream's own limits; here only the node's budget holds.
        let replica_limits = StreamLimits {
            max_total_bytes: self.total_budget_left(),
            ..StreamLimits::UNBOUNDED
        };
        let outcome = lock(&self.registry).append(
            &conversation_id,
            stream_id,
            ChunkIn {
                owner,
                node,
                pool: node,
                index,
                turn: Some(turn),
                fence,
                payload: Arc::clone(&body),
                bytes: body.content.size(),
            },
            &replica_limits,
        );
        // A replica that missed the stream's start cannot show it: the committed answer will.
        let accepted = match outcome {
            Ok(accepted) => accepted,
            Err(refusal @ ChunkRefusal::OverBudget { aborted: true, .. }) => {
                // This node cannot hold the rest: its viewers get the committed answer.
                metrics::counter!("converger_stream_budget_refusals_total").increment(1);
                let reason = refusal.abort_reason().map(str::to_owned);
                publish_end(hub, conversation_id, stream_id.to_owned(), reason);
                return None;
            }
            Err(refusal) => {
                tracing::debug!(?refusal, %conversation_id, stream_id, index, "replica chunk not applied");
                // A chunk from beyond the next one: a message was lost (or the start is still
                // to come from the holdings). The stream resumes from the holdings.
                if let ChunkRefusal::OutOfOrder { expected } = refusal
                    && index > expected
                {
                    self.bus.stream_gap(conversation_id);
                }
                return None;
            }
        };
        for fenced in accepted.fenced {
            publish_end(hub, conversation_id, fenced, Some("fenced".into()));
        }
        Some(StreamEvent::new(StreamChange::Chunk {
            stream_id: stream_id.to_owned(),
            index,
            turn,
            body,
        }))
    }

    fn announce_end(
        &self,
        hub: &Hub,
        conversation_id: Uuid,
        stream_id: &str,
        aborted: Option<&str>,
    ) {
        // The registry may have ended it already (over the byte limit).
        lock(&self.registry).end(&conversation_id, stream_id);
        self.relay_end(conversation_id, stream_id, aborted);
        publish_end(
            hub,
            conversation_id,
            stream_id.to_owned(),
            aborted.map(str::to_owned),
        );
    }

    fn relay_end(&self, conversation_id: Uuid, stream_id: &str, aborted: Option<&str>) {
        self.relay_event(&RelayedEvent::End(RelayedEnd {
            c: conversation_id,
            s: Cow::Borrowed(stream_id),
            e: aborted.map(Cow::Borrowed),
        }));
    }

    fn relay_event(&self, event: &RelayedEvent<'_>) {
        match serde_json::to_string(event) {
            Ok(text) => {
                // Counted before it is sent, so the relay never takes away what was not added.
                let bytes = text.len();
                self.relay_backlog.add(bytes);
                let order = RelayOrder::Event(event.conversation(), text);
                if self.relay.send(order).is_err() {
                    self.relay_backlog.remove(bytes);
                }
            }
            // Only a map with non-string keys fails to encode, and a chunk holds none.
            Err(error) => tracing::warn!(%error, "stream event not encoded for the relay"),
        }
    }
}

/// The abort reasons of a stopped turn's streams (`StopReason`'s wire forms).
fn is_stop_reason(reason: &str) -> bool {
    [
        StopReason::Stopped,
        StopReason::Superseded,
        StopReason::ConversationClosed,
        StopReason::Disconnected,
    ]
    .iter()
    .any(|known| known.as_str() == reason)
}

/// What a stop ended of a turn's stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoppedText {
    /// The stream.
    pub stream_id: String,
    /// Its text deltas, joined.
    pub text: String,
}

/// Bytes of stopped streams' text a node keeps for settlements; past it the oldest go (their
/// turns then settle with an empty answer). A settlement comes a grace period after the stop.
const STOPPED_TEXT_BYTES: usize = 8 << 20;

/// The texts of stopped streams, oldest first, bounded by [`STOPPED_TEXT_BYTES`].
#[derive(Debug, Default)]
struct StoppedTexts {
    kept: std::collections::VecDeque<(Uuid, StreamTurn, StoppedText)>,
    bytes: usize,
}

impl StoppedTexts {
    fn keep(&mut self, conversation_id: Uuid, turn: StreamTurn, text: StoppedText) {
        self.bytes += text.text.len();
        self.kept.push_back((conversation_id, turn, text));
        while self.bytes > STOPPED_TEXT_BYTES {
            let Some((_, _, oldest)) = self.kept.pop_front() else {
                break;
            };
            self.bytes -= oldest.text.len();
        }
    }

    /// The stopped streams of a conversation, with their turns (copies).
    fn of_conversation(&self, conversation_id: Uuid) -> Vec<(StreamTurn, StoppedText)> {
        self.kept
            .iter()
            .filter(|(conversation, _, _)| *conversation == conversation_id)
            .map(|(_, turn, text)| (*turn, text.clone()))
            .collect()
    }

    fn take(&mut self, conversation_id: Uuid, turn: StreamTurn) -> Option<StoppedText> {
        let position = self.kept.iter().position(|(conversation, kept_turn, _)| {
            *conversation == conversation_id && *kept_turn == turn
        })?;
        let (_, _, text) = self.kept.remove(position)?;
        self.bytes -= text.text.len();
        Some(text)
    }
}

fn publish_end(hub: &Hub, conversation_id: Uuid, stream_id: String, aborted: Option<String>) {
    metrics::counter!("converger_streams_ended_total", "status" => if aborted.is_some() { "aborted" } else { "committed" }).increment(1);
    hub.publish(
        conversation_id,
        HubEvent::Stream(StreamEvent::new(StreamChange::End { stream_id, aborted })),
    );
}
