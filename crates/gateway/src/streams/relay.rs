//! The relay of stream events to the other nodes: each event is encoded once, as the compact
//! JSON text the notification carries, and what queued within one window goes out in one
//! statement of `pg_notify` calls, so a node costs at most one transaction per window however
//! many chunks it relays.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use converger_core::streams::StreamTurn;
use converger_protocol::StreamContent;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

/// Longest wait for one relay notification before its events are given up (transient).
pub(super) const RELAY_TIMEOUT: Duration = Duration::from_secs(5);

/// Stream events sent in one relay flush at most.
const RELAY_BATCH: usize = 1024;

/// An order to the relay task.
pub(super) enum RelayOrder {
    /// One stream event of a conversation, encoded.
    Event(Uuid, String),
    /// Answer once every event queued before has been sent (or given up).
    Flush(oneshot::Sender<()>),
}

/// A stream event as it travels between nodes: the one type the sending node encodes (borrowing
/// what it relays) and the receiving nodes decode (owned).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub(super) enum RelayedEvent<'a> {
    /// A chunk (tried first: an end has none of its `i`, `t`, `o`, `b`, `f`).
    Chunk(RelayedChunk<'a>),
    /// A stream's end.
    End(RelayedEnd<'a>),
}

/// A chunk as the other nodes receive it.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct RelayedChunk<'a> {
    /// The conversation.
    pub c: Uuid,
    /// The stream.
    pub s: Cow<'a, str>,
    /// The chunk's index.
    pub i: u64,
    /// The turn, as `[seq, revision]`.
    pub t: (i64, i32),
    /// The delivery's lease fence, when any.
    pub x: Option<i64>,
    /// The writing connection.
    pub o: Cow<'a, str>,
    /// The content.
    pub b: RelayedContent<'a>,
    /// The writing agent as `{id, role}`.
    pub f: Cow<'a, Value>,
}

impl RelayedEvent<'_> {
    /// The conversation the event belongs to.
    pub(super) fn conversation(&self) -> Uuid {
        match self {
            RelayedEvent::Chunk(chunk) => chunk.c,
            RelayedEvent::End(end) => end.c,
        }
    }
}

impl RelayedChunk<'_> {
    /// The turn the chunk answers.
    pub(super) fn turn(&self) -> StreamTurn {
        StreamTurn {
            seq: self.t.0,
            revision: self.t.1,
        }
    }
}

/// A chunk's content on the relay: `{"text": …}` or `{"chunk": …}`.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum RelayedContent<'a> {
    /// A text delta.
    Text(Cow<'a, str>),
    /// A UI chunk.
    Chunk(Cow<'a, Value>),
}

impl<'a> From<&'a StreamContent> for RelayedContent<'a> {
    fn from(content: &'a StreamContent) -> Self {
        match content {
            StreamContent::Text(text) => RelayedContent::Text(Cow::Borrowed(text)),
            StreamContent::Chunk(chunk) => RelayedContent::Chunk(Cow::Borrowed(chunk)),
        }
    }
}

impl From<StreamContent> for RelayedContent<'static> {
    fn from(content: StreamContent) -> Self {
        match content {
            StreamContent::Text(text) => RelayedContent::Text(Cow::Owned(text)),
            StreamContent::Chunk(chunk) => RelayedContent::Chunk(Cow::Owned(chunk)),
        }
    }
}

impl From<RelayedContent<'_>> for StreamContent {
    fn from(content: RelayedContent<'_>) -> Self {
        match content {
            RelayedContent::Text(text) => StreamContent::Text(text.into_owned()),
            RelayedContent::Chunk(chunk) => StreamContent::Chunk(chunk.into_owned()),
        }
    }
}

/// A stream's end on the relay: `e` is the abort reason, `null` when committed.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
pub(super) struct RelayedEnd<'a> {
    /// The conversation.
    pub c: Uuid,
    /// The stream.
    pub s: Cow<'a, str>,
    /// Why it was aborted; `None` when committed.
    pub e: Option<Cow<'a, str>>,
}

/// Bytes of encoded events queued for the relay and not sent (or given up) yet: they count
/// against the node's stream budget, so a relay that falls behind refuses chunks instead of
/// growing without bound.
#[derive(Debug, Default)]
pub(super) struct Backlog(AtomicUsize);

impl Backlog {
    pub(super) fn add(&self, bytes: usize) {
        self.0.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(super) fn remove(&self, bytes: usize) {
        // Saturating: every removal follows its own addition, but never wrap whatever happens.
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |held| {
                Some(held.saturating_sub(bytes))
            });
    }

    pub(super) fn bytes(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

/// Sends queued stream events to the other nodes: from the first event queued, whatever else
/// comes within `window` (or until a flush is asked for) goes in the same statement.
pub(super) async fn run(
    bus: Arc<crate::bus::Bus>,
    window: Duration,
    backlog: Arc<Backlog>,
    mut orders: mpsc::UnboundedReceiver<RelayOrder>,
) {
    while let Some(first) = orders.recv().await {
        let mut events = Vec::new();
        let mut flushed = Vec::new();
        let deadline = tokio::time::Instant::now() + window;
        let mut next = Some(first);
        while let Some(order) = next.take() {
            match order {
                RelayOrder::Event(conversation_id, event) => events.push((conversation_id, event)),
                RelayOrder::Flush(done) => flushed.push(done),
            }
            if events.len() >= RELAY_BATCH || !flushed.is_empty() {
                break;
            }
            next = tokio::time::timeout_at(deadline, orders.recv())
                .await
                .ok()
                .flatten();
        }
        if !events.is_empty() {
            let sent = tokio::time::timeout(RELAY_TIMEOUT, bus.streams(&events)).await;
            match sent {
                Ok(Ok(())) => {
                    metrics::counter!("converger_stream_relay_flushes_total").increment(1)
                }
                Ok(Err(error)) => tracing::warn!(
                    %error,
                    events = events.len(),
                    "stream events not relayed to other nodes"
                ),
                Err(_) => tracing::warn!(events = events.len(), "stream relay timed out"),
            }
            backlog.remove(events.iter().map(|(_, event)| event.len()).sum());
        }
        for done in flushed {
            let _ = done.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn relayed_events_read_back_as_the_receiver_parses_them() {
        let conversation = Uuid::now_v7();
        let from = json!({"id": "bot", "role": "agent"});
        let content = StreamContent::Text("Hel\"lo".into());
        let chunk = RelayedEvent::Chunk(RelayedChunk {
            c: conversation,
            s: Cow::Borrowed("s-1"),
            i: 3,
            t: (7, 1),
            x: None,
            o: Cow::Borrowed("conn-1"),
            b: (&content).into(),
            f: Cow::Borrowed(&from),
        });
        let wire: Value = serde_json::from_str(&serde_json::to_string(&chunk).unwrap()).unwrap();
        let back: RelayedEvent<'static> = serde_json::from_value(wire).unwrap();
        assert_eq!(back, chunk);
        let RelayedEvent::Chunk(back) = back else {
            panic!("a chunk reads back as a chunk");
        };
        assert_eq!(
            back.turn(),
            StreamTurn {
                seq: 7,
                revision: 1
            }
        );
        assert_eq!(StreamContent::from(back.b), content);
        let ui = StreamContent::Chunk(json!({"type": "card"}));
        let wire = serde_json::to_value(RelayedContent::from(&ui)).unwrap();
        let back: RelayedContent<'static> = serde_json::from_value(wire).unwrap();
        assert_eq!(StreamContent::from(back), ui);
        for aborted in [None, Some(Cow::Borrowed("stopped"))] {
            let end = RelayedEvent::End(RelayedEnd {
                c: conversation,
                s: Cow::Borrowed("s-1"),
                e: aborted,
            });
            let wire = serde_json::to_value(&end).unwrap();
            assert!(wire.get("e").is_some(), "an end always names its reason");
            let back: RelayedEvent<'static> = serde_json::from_value(wire).unwrap();
            assert_eq!(back, end);
        }
    }
}
