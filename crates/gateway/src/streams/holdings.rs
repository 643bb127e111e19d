//! Holdings (NATS, ADR 0035): what this node's agents stream in a conversation, told to a node
//! that begins to follow it, and the other nodes' holdings taken into this node's replicas.

use std::borrow::Cow;
use std::sync::Arc;

use converger_core::streams::{ChunkLog, StreamTurn};
use uuid::Uuid;

use super::relay::{HeldStop, HeldStream, Holdings};
use super::{ChunkBody, LiveStreams, ReplicaChunk, StoppedText};
use crate::bus::StreamHoldings;
use crate::hub::{Hub, HubEvent, lock};

impl StreamHoldings for LiveStreams {
    fn holdings(&self, conversation_id: Uuid) -> Option<String> {
        let own: Vec<_> = lock(&self.registry)
            .snapshot(&conversation_id)
            .into_iter()
            .filter(|(_, stream)| stream.node == self.node_id)
            .collect();
        let stopped = lock(&self.stopped).of_conversation(conversation_id);
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
                if let Some(event) = last {
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

    /// The text a stop ended of the turn's stream, as another node's holdings tell it.
    pub fn stopped_in(replies: &[String], turn: StreamTurn) -> Option<StoppedText> {
        replies
            .iter()
            .filter_map(|reply| serde_json::from_str::<Holdings<'_>>(reply).ok())
            .flat_map(|held| held.x)
            .find(|stop| stop.t == (turn.seq, turn.revision))
            .map(|stop| StoppedText {
                stream_id: stop.s.into_owned(),
                text: stop.x.into_owned(),
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
        assert_eq!(stopped(4, 0), None, "an open stream is no stopped text");
    }
}
