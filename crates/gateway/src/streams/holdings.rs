//! Holdings (NATS, ADR 0035): what this node's agents stream in a conversation, told to a node
//! that begins to follow it, and the other nodes' holdings taken into this node's replicas.

use std::borrow::Cow;
use std::sync::Arc;

use converger_core::streams::{ChunkLog, StreamTurn};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

use super::relay::RelayedContent;
use super::{ChunkBody, LiveStreams, ReplicaChunk, StoppedText};
use crate::bus::StreamHoldings;
use crate::hub::{Hub, HubEvent, lock};

/// What one node's agents stream in a conversation, as it answers a node that began to
/// follow the conversation (its open streams there), or the node that settles a stop (what it
/// holds of the stopped turn: the text a stop ended, or a stream still open).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Holdings<'a> {
    /// The answering node.
    n: Cow<'a, str>,
    /// Its agents' open streams.
    s: Vec<HeldStream<'a>>,
    /// The streams a stop ended.
    x: Vec<HeldStop<'a>>,
}

/// One open stream in a node's holdings: what its first chunk told, and every chunk's content
/// from index 0.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct HeldStream<'a> {
    /// The stream.
    s: Cow<'a, str>,
    /// The turn, as `[seq, revision]`.
    t: (i64, i32),
    /// The delivery's lease fence, when any.
    x: Option<i64>,
    /// The writing connection.
    o: Cow<'a, str>,
    /// The writing agent as `{id, role}`.
    f: Cow<'a, Value>,
    /// The chunks' contents, index = position.
    b: Vec<RelayedContent<'a>>,
}

/// A stream a stop ended, as a node holds it for the turn's settlement.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct HeldStop<'a> {
    /// The turn, as `[seq, revision]`.
    t: (i64, i32),
    /// The stream.
    s: Cow<'a, str>,
    /// Its text deltas, joined.
    x: Cow<'a, str>,
}

impl StreamHoldings for LiveStreams {
    fn holdings(&self, conversation_id: Uuid, stopped_turn: Option<StreamTurn>) -> Option<String> {
        let of_turn = |turn: StreamTurn| stopped_turn.is_none_or(|stopped| stopped == turn);
        let own: Vec<_> = {
            let registry = lock(&self.registry);
            registry.snapshot_where(&conversation_id, |stream| {
                stream.node == self.node_id && of_turn(stream.turn)
            })
        };
        // Stopped texts only for a settlement: a new follower is shown open streams.
        let stopped = match stopped_turn {
            Some(_) => lock(&self.stopped).of_conversation(conversation_id),
            None => Vec::new(),
        };
        let stopped: Vec<_> = stopped
            .into_iter()
            .filter(|(turn, _)| of_turn(*turn))
            .collect();
        if own.is_empty() && stopped.is_empty() {
            return None;
        }
        let streams = own
            .iter()
            .map(|(stream_id, stream)| HeldStream {
                s: Cow::Borrowed(stream_id),
                t: (stream.turn.seq, stream.turn.revision),
                x: stream.fence,
                o: Cow::Borrowed(&stream.owner),
                f: Cow::Borrowed(stream.chunks.from()),
                b: (0..stream.chunks.len())
                    .map_while(|index| stream.chunks.content(index).map(Into::into))
                    .collect(),
            })
            .collect();
        let stops = stopped
            .iter()
            .map(|(turn, text)| HeldStop {
                t: (turn.seq, turn.revision),
                s: Cow::Borrowed(&text.stream_id),
                x: Cow::Borrowed(&text.text),
            })
            .collect();
        let held = Holdings {
            n: Cow::Borrowed(&self.node_id),
            s: streams,
            x: stops,
        };
        match serde_json::to_string(&held) {
            Ok(text) => Some(text),
            // Only a map with non-string keys fails to encode, and holdings hold none.
            Err(error) => {
                tracing::warn!(%error, "stream holdings not encoded");
                None
            }
        }
    }
}

impl LiveStreams {
    /// Takes the other nodes' holdings of a conversation this node began to follow: each open
    /// stream into a replica, then one event for its last chunk, so that a follower sees a gap
    /// and shows the stream from the registry, each run of text as one frame.
    pub fn apply_holdings(&self, hub: &Hub, conversation_id: Uuid, replies: Vec<String>) {
        for reply in replies {
            let held = match serde_json::from_str::<Holdings<'_>>(&reply) {
                Ok(held) => held,
                Err(error) => {
                    tracing::warn!(%error, "stream holdings of another node unreadable");
                    continue;
                }
            };
            if held.n == self.node_id {
                continue;
            }
            for stream in held.s {
                let from = Arc::new(stream.f.into_owned());
                let turn = StreamTurn {
                    seq: stream.t.0,
                    revision: stream.t.1,
                };
                let mut last = None;
                for (index, content) in (0u64..).zip(stream.b) {
                    let body = Arc::new(ChunkBody {
                        content: content.into(),
                        from: Arc::clone(&from),
                    });
                    let replica = ReplicaChunk {
                        node: &held.n,
                        stream_id: &stream.s,
                        index,
                        turn,
                        fence: stream.x,
                        owner: &stream.o,
                        body,
                    };
                    last = self.append_replica(hub, conversation_id, replica).or(last);
                }
                // A stream the node's budget aborted partway ended for its followers already.
                let open = lock(&self.registry)
                    .get(&conversation_id, &stream.s)
                    .is_some();
                if let Some(event) = last.filter(|_| open) {
                    hub.publish(conversation_id, HubEvent::Stream(event));
                }
            }
        }
    }

    /// This node no longer follows the conversation: its replicas of other nodes' streams
    /// there go (nobody here shows them, and their later chunks no longer come).
    pub fn unfollowed(&self, conversation_id: Uuid) {
        lock(&self.registry).forget_where(&conversation_id, |stream| stream.node != self.node_id);
    }

    /// The text a stop ended of the turn's stream, as another node's holdings tell it; when
    /// that node had not ended the stream yet, the text its open stream holds.
    pub fn stopped_in(replies: &[String], turn: StreamTurn) -> Option<StoppedText> {
        let held: Vec<Holdings<'_>> = replies
            .iter()
            .filter_map(|reply| serde_json::from_str(reply).ok())
            .collect();
        let asked = (turn.seq, turn.revision);
        let stopped = held
            .iter()
            .flat_map(|held| &held.x)
            .find(|stop| stop.t == asked)
            .map(|stop| StoppedText {
                stream_id: stop.s.clone().into_owned(),
                text: stop.x.clone().into_owned(),
            });
        stopped.or_else(|| {
            let open = held
                .iter()
                .flat_map(|held| &held.s)
                .find(|stream| stream.t == asked)?;
            let text = open
                .b
                .iter()
                .filter_map(|content| match content {
                    RelayedContent::Text(text) => Some(text.as_ref()),
                    RelayedContent::Chunk(_) => None,
                })
                .collect();
            Some(StoppedText {
                stream_id: open.s.clone().into_owned(),
                text,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use converger_protocol::StreamContent;
    use serde_json::json;

    #[test]
    fn holdings_read_back_and_name_the_stopped_text_of_a_turn() {
        let from = json!({"id": "bot", "role": "agent"});
        let held = Holdings {
            n: Cow::Borrowed("node-a"),
            s: vec![HeldStream {
                s: Cow::Borrowed("s-1"),
                t: (4, 0),
                x: Some(2),
                o: Cow::Borrowed("conn-1"),
                f: Cow::Borrowed(&from),
                b: vec![
                    StreamContent::Text("Hel".into()).into(),
                    StreamContent::Chunk(json!({"type": "card"})).into(),
                ],
            }],
            x: vec![HeldStop {
                t: (3, 1),
                s: Cow::Borrowed("s-0"),
                x: Cow::Borrowed("so far"),
            }],
        };
        let text = serde_json::to_string(&held).unwrap();
        assert_eq!(serde_json::from_str::<Holdings<'_>>(&text).unwrap(), held);
        let replies = ["not holdings".to_owned(), text];
        let stopped =
            |seq, revision| LiveStreams::stopped_in(&replies, StreamTurn { seq, revision });
        assert_eq!(
            stopped(3, 1),
            Some(StoppedText {
                stream_id: "s-0".into(),
                text: "so far".into()
            })
        );
        assert_eq!(stopped(3, 0), None, "another revision of the turn");
        assert_eq!(
            stopped(4, 0),
            Some(StoppedText {
                stream_id: "s-1".into(),
                text: "Hel".into()
            }),
            "a stream still open tells its text so far (UI chunks hold none)"
        );
    }
}
