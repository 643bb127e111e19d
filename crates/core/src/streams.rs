//! Streamed answers (ADR 0019): the open streams one node knows, and what each end-user
//! connection has already been shown of them.
//!
//! A stream belongs to one agent connection and one turn. Its chunks are numbered from 0 and
//! must arrive in order; the node that owns the agent connection decides what is accepted
//! ([`StreamRegistry::append`]), every other node applies the accepted chunks to a replica of the
//! same registry. A stream ends once: committed (the turn's result was stored), or aborted (the
//! agent said so, its connection or node went, a limit was crossed, the result was refused).
//! A stream that ended is remembered for a while, so a late chunk is refused instead of opening
//! it again. Nothing here reads a clock or performs I/O: payloads are opaque values with a size
//! given by the caller.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// Streams remembered after they ended, so late chunks are refused rather than reopening them.
pub const ENDED_MEMORY: usize = 4096;

/// Ended streams one connection remembers (a conversation's streams follow one another).
pub const CURSOR_ENDED_MEMORY: usize = 64;

/// A turn as a stream names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StreamTurn {
    /// The turn's seq.
    pub seq: i64,
    /// The revision answered.
    pub revision: i32,
}

/// The limits a node applies to the streams its agents open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    /// Bytes of chunk payload one stream may hold.
    pub max_stream_bytes: usize,
    /// Streams one agent connection may have open at once.
    pub max_streams_per_owner: usize,
    /// Bytes the open streams of one pool (the agent connections of one channel on a node)
    /// may hold together.
    pub max_pool_bytes: usize,
    /// Bytes every open stream of the registry (a node's, replicas included) may hold
    /// together.
    pub max_total_bytes: usize,
}

impl StreamLimits {
    /// No limit at all (replicas of streams another node accepted under its own limits are
    /// bound only by the node's total, which the caller sets).
    pub const UNBOUNDED: StreamLimits = StreamLimits {
        max_stream_bytes: usize::MAX,
        max_streams_per_owner: usize::MAX,
        max_pool_bytes: usize::MAX,
        max_total_bytes: usize::MAX,
    };
}

/// Which budget a chunk would have taken over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// The bytes of the open streams of the chunk's pool (its channel on this node).
    Pool,
    /// The bytes of every open stream of the node.
    Total,
}

/// Why a chunk was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkRefusal {
    /// The first chunk of a stream (index 0) must name its turn.
    TurnMissing,
    /// The index is not the next one of the stream (`expected`), or a stream that is not open
    /// got a chunk other than its first.
    OutOfOrder {
        /// The index the stream expects.
        expected: u64,
    },
    /// The stream ended (committed or aborted), or another connection owns it.
    Closed,
    /// The connection has `max_streams_per_owner` streams open already.
    TooManyStreams,
    /// The chunk would take the stream over `max_stream_bytes`: the stream was aborted.
    TooLarge,
    /// The chunk would take its pool's or the node's open streams over their budget. A chunk
    /// that would have opened the stream opened nothing; a later chunk aborted the stream
    /// (`aborted`).
    OverBudget {
        /// The budget it would have crossed.
        budget: Budget,
        /// True when an open stream was aborted for it.
        aborted: bool,
    },
}

impl ChunkRefusal {
    /// The reason viewers are told when the refusal aborted an open stream; `None` when the
    /// stream (if any) stays as it was.
    pub fn abort_reason(&self) -> Option<&'static str> {
        match self {
            ChunkRefusal::TooLarge => Some("too_large"),
            ChunkRefusal::OverBudget { aborted: true, .. } => Some("over_budget"),
            _ => None,
        }
    }
}

/// How a stream ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEnding {
    /// The turn's result was committed: the stored frames replace the streamed ones.
    Committed,
    /// Aborted, with a short reason for the UI (`agent`, `disconnected`, `node_down`, …).
    Aborted(String),
}

/// Where an open stream keeps its chunks, in index order: a `Vec` of payloads, or a packed log
/// that spends a few bytes per chunk beyond its content (a stream may hold thousands).
pub trait ChunkLog: Clone {
    /// One chunk as the registry is given it.
    type Chunk;
    /// A log holding only `first` (index 0).
    fn starting_with(first: Self::Chunk) -> Self;
    /// Appends the next chunk.
    fn push(&mut self, chunk: Self::Chunk);
    /// Chunks held.
    fn len(&self) -> usize;
    /// True when no chunk is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<P: Clone> ChunkLog for Vec<P> {
    type Chunk = P;

    fn starting_with(first: P) -> Self {
        vec![first]
    }

    fn push(&mut self, chunk: P) {
        Vec::push(self, chunk);
    }

    fn len(&self) -> usize {
        Vec::len(self)
    }
}

/// One open stream.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenStream<L> {
    /// The agent connection that writes it.
    pub owner: String,
    /// The node that agent connection is on.
    pub node: String,
    /// The budget pool it counts against.
    pub pool: String,
    /// The turn it answers.
    pub turn: StreamTurn,
    /// The lease fence of the delivery it answers (lease mode).
    pub fence: Option<i64>,
    /// The chunks so far, index = position.
    pub chunks: L,
    /// Payload bytes held.
    pub bytes: usize,
}

/// A chunk that was accepted, with whether it opened its stream.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Accepted {
    /// True for the first chunk of the stream.
    pub opened: bool,
    /// Streams of the same turn under an older lease fence, aborted by this one (their
    /// writer lost the lease: its later chunks are refused).
    pub fenced: Vec<String>,
}

/// A chunk as the registry is asked to take it.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkIn<'a, P> {
    /// Writing connection.
    pub owner: &'a str,
    /// Its node.
    pub node: &'a str,
    /// The budget pool of the stream it opens (ignored after index 0).
    pub pool: &'a str,
    /// Index within the stream.
    pub index: u64,
    /// The turn (required at index 0, ignored after).
    pub turn: Option<StreamTurn>,
    /// The delivery's lease fence (lease mode, index 0).
    pub fence: Option<i64>,
    /// The payload.
    pub payload: P,
    /// Its size in bytes.
    pub bytes: usize,
}

/// The open streams one node knows, by conversation `C`, each keeping its chunks in a `L`.
#[derive(Debug, Clone)]
pub struct StreamRegistry<C, L> {
    open: HashMap<C, HashMap<String, OpenStream<L>>>,
    ended: VecDeque<(C, String)>,
    ended_memory: usize,
    /// Payload bytes the open streams hold, per pool and in all.
    held: HeldBytes,
}

/// Payload bytes held by open streams, per budget pool and in all (kept apart from the streams
/// so a chunk is checked against its stream's pool while the stream is borrowed).
#[derive(Debug, Clone, Default)]
struct HeldBytes {
    /// Per pool that holds any.
    per_pool: HashMap<String, usize>,
    total: usize,
}

impl HeldBytes {
    fn pool(&self, pool: &str) -> usize {
        self.per_pool.get(pool).copied().unwrap_or(0)
    }

    /// The budget `bytes` more in `pool` would cross, if any.
    fn over(&self, pool: &str, bytes: usize, limits: &StreamLimits) -> Option<Budget> {
        if self.pool(pool).saturating_add(bytes) > limits.max_pool_bytes {
            return Some(Budget::Pool);
        }
        if self.total.saturating_add(bytes) > limits.max_total_bytes {
            return Some(Budget::Total);
        }
        None
    }

    fn add(&mut self, pool: &str, bytes: usize) {
        self.total += bytes;
        match self.per_pool.get_mut(pool) {
            Some(held) => *held += bytes,
            None => {
                self.per_pool.insert(pool.to_owned(), bytes);
            }
        }
    }

    fn remove(&mut self, pool: &str, bytes: usize) {
        self.total = self.total.saturating_sub(bytes);
        if let Some(held) = self.per_pool.get_mut(pool) {
            *held = held.saturating_sub(bytes);
            if *held == 0 {
                self.per_pool.remove(pool);
            }
        }
    }
}

impl<C: Eq + Hash + Clone, L: ChunkLog> Default for StreamRegistry<C, L> {
    fn default() -> Self {
        StreamRegistry::with_memory(ENDED_MEMORY)
    }
}

impl<C: Eq + Hash + Clone, L: ChunkLog> StreamRegistry<C, L> {
    /// An empty registry that remembers `ended_memory` ended streams.
    pub fn with_memory(ended_memory: usize) -> Self {
        StreamRegistry {
            open: HashMap::new(),
            ended: VecDeque::new(),
            ended_memory,
            held: HeldBytes::default(),
        }
    }

    /// Takes a chunk of stream `stream_id`, or says why not. Over `max_stream_bytes`, the
    /// stream is aborted here (the caller tells its subscribers with [`StreamEnding::Aborted`]).
    pub fn append(
        &mut self,
        conversation: &C,
        stream_id: &str,
        chunk: ChunkIn<'_, L::Chunk>,
        limits: &StreamLimits,
    ) -> Result<Accepted, ChunkRefusal> {
        if let Some(stream) = self
            .open
            .get_mut(conversation)
            .and_then(|streams| streams.get_mut(stream_id))
        {
            if stream.owner != chunk.owner {
                return Err(ChunkRefusal::Closed);
            }
            let expected = stream.chunks.len() as u64;
            if chunk.index != expected {
                return Err(ChunkRefusal::OutOfOrder { expected });
            }
            let refusal = if stream.bytes + chunk.bytes > limits.max_stream_bytes {
                ChunkRefusal::TooLarge
            } else if let Some(budget) = self.held.over(&stream.pool, chunk.bytes, limits) {
                ChunkRefusal::OverBudget {
                    budget,
                    aborted: true,
                }
            } else {
                self.held.add(&stream.pool, chunk.bytes);
                stream.bytes += chunk.bytes;
                stream.chunks.push(chunk.payload);
                return Ok(Accepted::default());
            };
            self.end(conversation, stream_id);
            return Err(refusal);
        }
        if self.has_ended(conversation, stream_id) {
            return Err(ChunkRefusal::Closed);
        }
        if chunk.index != 0 {
            return Err(ChunkRefusal::OutOfOrder { expected: 0 });
        }
        let Some(turn) = chunk.turn else {
            return Err(ChunkRefusal::TurnMissing);
        };
        let same_turn = || {
            self.open
                .get(conversation)
                .into_iter()
                .flatten()
                .filter(move |(_, stream)| stream.turn == turn)
        };
        if let Some(fence) = chunk.fence
            && same_turn().any(|(_, stream)| stream.fence.is_some_and(|held| held > fence))
        {
            return Err(ChunkRefusal::Closed);
        }
        if self.owned_by(chunk.owner) >= limits.max_streams_per_owner {
            return Err(ChunkRefusal::TooManyStreams);
        }
        let fenced: Vec<String> = match chunk.fence {
            Some(fence) => same_turn()
                .filter(|(_, stream)| stream.fence.is_some_and(|held| held < fence))
                .map(|(id, _)| id.clone())
                .collect(),
            None => Vec::new(),
        };
        for id in &fenced {
            self.end(conversation, id);
        }
        if chunk.bytes > limits.max_stream_bytes {
            self.remember_ended(conversation.clone(), stream_id.to_owned());
            return Err(ChunkRefusal::TooLarge);
        }
        if let Some(budget) = self.held.over(chunk.pool, chunk.bytes, limits) {
            return Err(ChunkRefusal::OverBudget {
                budget,
                aborted: false,
            });
        }
        self.held.add(chunk.pool, chunk.bytes);
        self.open.entry(conversation.clone()).or_default().insert(
            stream_id.to_owned(),
            OpenStream {
                owner: chunk.owner.to_owned(),
                node: chunk.node.to_owned(),
                pool: chunk.pool.to_owned(),
                turn,
                fence: chunk.fence,
                chunks: L::starting_with(chunk.payload),
                bytes: chunk.bytes,
            },
        );
        Ok(Accepted {
            opened: true,
            fenced,
        })
    }

    /// Ends a stream; returns it when it was open.
    pub fn end(&mut self, conversation: &C, stream_id: &str) -> Option<OpenStream<L>> {
        let streams = self.open.get_mut(conversation)?;
        let stream = streams.remove(stream_id)?;
        if streams.is_empty() {
            self.open.remove(conversation);
        }
        self.held.remove(&stream.pool, stream.bytes);
        self.remember_ended(conversation.clone(), stream_id.to_owned());
        Some(stream)
    }

    /// True when the turn has an open stream.
    pub fn has_turn(&self, conversation: &C, turn: StreamTurn) -> bool {
        self.open
            .get(conversation)
            .is_some_and(|streams| streams.values().any(|stream| stream.turn == turn))
    }

    /// True when the stream is open or ended recently: a chunk at index 0 would not open it.
    pub fn is_known(&self, conversation: &C, stream_id: &str) -> bool {
        self.get(conversation, stream_id).is_some() || self.has_ended(conversation, stream_id)
    }

    /// Ends the open streams of a turn; returns their ids.
    pub fn end_turn(&mut self, conversation: &C, turn: StreamTurn) -> Vec<String> {
        self.end_turn_where(conversation, turn, |_| true)
            .into_iter()
            .map(|(id, _)| id)
            .collect()
    }

    /// Ends the open streams of a turn that `matches`; returns them with their ids.
    pub fn end_turn_where(
        &mut self,
        conversation: &C,
        turn: StreamTurn,
        matches: impl Fn(&OpenStream<L>) -> bool,
    ) -> Vec<(String, OpenStream<L>)> {
        let ids: Vec<String> = self
            .open
            .get(conversation)
            .into_iter()
            .flatten()
            .filter(|(_, stream)| stream.turn == turn && matches(stream))
            .map(|(id, _)| id.clone())
            .collect();
        ids.into_iter()
            .filter_map(|id| {
                let stream = self.end(conversation, &id)?;
                Some((id, stream))
            })
            .collect()
    }

    /// Ends every stream that `matches`; returns (conversation, stream id) of each.
    pub fn end_where(&mut self, matches: impl Fn(&OpenStream<L>) -> bool) -> Vec<(C, String)> {
        let found: Vec<(C, String)> = self
            .open
            .iter()
            .flat_map(|(conversation, streams)| {
                streams
                    .iter()
                    .filter(|(_, stream)| matches(stream))
                    .map(move |(id, _)| (conversation.clone(), id.clone()))
            })
            .collect();
        for (conversation, id) in &found {
            self.end(conversation, id);
        }
        found
    }

    /// Remembers a stream that is not open as ended: a chunk at index 0 will not open it.
    pub fn forbid(&mut self, conversation: &C, stream_id: &str) {
        if self.get(conversation, stream_id).is_none() && !self.has_ended(conversation, stream_id) {
            self.remember_ended(conversation.clone(), stream_id.to_owned());
        }
    }

    /// Drops the open streams of a conversation that `matches` without remembering them as
    /// ended (a replica this node stops receiving: it may take them again from index 0);
    /// returns how many went.
    pub fn forget_where(
        &mut self,
        conversation: &C,
        matches: impl Fn(&OpenStream<L>) -> bool,
    ) -> usize {
        let Some(streams) = self.open.get_mut(conversation) else {
            return 0;
        };
        let mut forgotten = Vec::new();
        streams.retain(|_, stream| {
            let keep = !matches(stream);
            if !keep {
                forgotten.push((stream.pool.clone(), stream.bytes));
            }
            keep
        });
        if streams.is_empty() {
            self.open.remove(conversation);
        }
        for (pool, bytes) in &forgotten {
            self.held.remove(pool, *bytes);
        }
        forgotten.len()
    }

    /// The open streams of a conversation (for a connection that joins mid-stream).
    pub fn snapshot(&self, conversation: &C) -> Vec<(String, OpenStream<L>)> {
        self.snapshot_where(conversation, |_| true)
    }

    /// The open streams of a conversation that `matches` (copies).
    pub fn snapshot_where(
        &self,
        conversation: &C,
        matches: impl Fn(&OpenStream<L>) -> bool,
    ) -> Vec<(String, OpenStream<L>)> {
        self.open
            .get(conversation)
            .into_iter()
            .flatten()
            .filter(|(_, stream)| matches(stream))
            .map(|(id, stream)| (id.clone(), stream.clone()))
            .collect()
    }

    /// The open stream, when it is.
    pub fn get(&self, conversation: &C, stream_id: &str) -> Option<&OpenStream<L>> {
        self.open.get(conversation)?.get(stream_id)
    }

    /// True when the stream ended recently (within the remembered window).
    pub fn has_ended(&self, conversation: &C, stream_id: &str) -> bool {
        self.ended
            .iter()
            .any(|(ended_in, id)| ended_in == conversation && id == stream_id)
    }

    /// Open streams in all.
    pub fn open_count(&self) -> usize {
        self.open.values().map(HashMap::len).sum()
    }

    /// Payload bytes held by all open streams.
    pub fn open_bytes(&self) -> usize {
        self.held.total
    }

    /// Payload bytes held by the open streams of `pool`.
    pub fn pool_bytes(&self, pool: &str) -> usize {
        self.held.pool(pool)
    }

    /// An open stream of the conversation answering the turn at `seq`, when there is one.
    pub fn open_for_turn_seq(&self, conversation: &C, seq: i64) -> Option<&str> {
        self.open
            .get(conversation)?
            .iter()
            .find(|(_, stream)| stream.turn.seq == seq)
            .map(|(id, _)| id.as_str())
    }

    fn owned_by(&self, owner: &str) -> usize {
        self.open
            .values()
            .flat_map(HashMap::values)
            .filter(|stream| stream.owner == owner)
            .count()
    }

    fn remember_ended(&mut self, conversation: C, stream_id: String) {
        if self.ended_memory == 0 {
            return;
        }
        if self.ended.len() >= self.ended_memory {
            self.ended.pop_front();
        }
        self.ended.push_back((conversation, stream_id));
    }
}

/// What one end-user connection was shown of each stream, so a chunk reaching it twice (the live
/// feed and a snapshot overlap) is shown once, and a gap is noticed.
#[derive(Debug, Clone, Default)]
pub struct StreamCursor {
    next: HashMap<String, u64>,
    ended: VecDeque<String>,
}

/// What to do with a chunk that reached a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShowChunk {
    /// Show it: it is the next one.
    Show,
    /// Already shown, or the stream ended for this connection.
    Drop,
    /// Chunks before it were missed: show the stream from `from` (the snapshot has them).
    Gap {
        /// The first index not shown yet.
        from: u64,
    },
}

impl StreamCursor {
    /// Decides about chunk `index` of `stream_id`; `Show` advances the cursor.
    pub fn on_chunk(&mut self, stream_id: &str, index: u64) -> ShowChunk {
        self.on_chunks(stream_id, index, index)
    }

    /// Decides about chunks `first..=last` of `stream_id` shown as one (a connection catching
    /// up with an open stream gets its text so far coalesced): shown when `first` is the next
    /// index and `last` is not before it; `Show` advances the cursor past `last`.
    pub fn on_chunks(&mut self, stream_id: &str, first: u64, last: u64) -> ShowChunk {
        if self.ended.iter().any(|id| id == stream_id) {
            return ShowChunk::Drop;
        }
        let shown = self.next.get_mut(stream_id);
        let next = shown.as_deref().copied().unwrap_or(0);
        if first < next || last < first {
            return ShowChunk::Drop;
        }
        if first > next {
            return ShowChunk::Gap { from: next };
        }
        // The stream's id is copied once, at its first chunk, not at every chunk.
        match shown {
            Some(shown) => *shown = last + 1,
            None => {
                self.next.insert(stream_id.to_owned(), last + 1);
            }
        }
        ShowChunk::Show
    }

    /// The first index of `stream_id` not shown yet.
    pub fn next_index(&self, stream_id: &str) -> u64 {
        self.next.get(stream_id).copied().unwrap_or(0)
    }

    /// True when the connection saw at least one chunk of the stream and not its end.
    pub fn is_showing(&self, stream_id: &str) -> bool {
        self.next.contains_key(stream_id)
    }

    /// Forgets a stream that ended; returns true when this connection had shown any of it (so
    /// its end is worth telling).
    pub fn on_end(&mut self, stream_id: &str) -> bool {
        if self.ended.iter().any(|id| id == stream_id) {
            return false;
        }
        if self.ended.len() >= CURSOR_ENDED_MEMORY {
            self.ended.pop_front();
        }
        self.ended.push_back(stream_id.to_owned());
        self.next.remove(stream_id).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const LIMITS: StreamLimits = StreamLimits {
        max_stream_bytes: 100,
        max_streams_per_owner: 2,
        max_pool_bytes: usize::MAX,
        max_total_bytes: usize::MAX,
    };
    const TURN: StreamTurn = StreamTurn {
        seq: 3,
        revision: 0,
    };

    fn chunk(owner: &str, index: u64, bytes: usize) -> ChunkIn<'_, u64> {
        ChunkIn {
            owner,
            node: "n1",
            pool: "p",
            index,
            turn: (index == 0).then_some(TURN),
            fence: None,
            payload: index,
            bytes,
        }
    }

    #[test]
    fn chunks_are_taken_in_order_from_their_owner() {
        let mut registry = StreamRegistry::<u8, Vec<u64>>::default();
        assert_eq!(
            registry.append(&1, "s", chunk("a", 1, 1), &LIMITS),
            Err(ChunkRefusal::OutOfOrder { expected: 0 })
        );
        assert_eq!(
            registry.append(&1, "s", chunk("a", 0, 1), &LIMITS),
            Ok(Accepted {
                opened: true,
                fenced: vec![]
            })
        );
        assert_eq!(
            registry.append(&1, "s", chunk("a", 0, 1), &LIMITS),
            Err(ChunkRefusal::OutOfOrder { expected: 1 })
        );
        assert_eq!(
            registry.append(&1, "s", chunk("b", 1, 1), &LIMITS),
            Err(ChunkRefusal::Closed)
        );
        assert_eq!(
            registry.append(&1, "s", chunk("a", 1, 1), &LIMITS),
            Ok(Accepted::default())
        );
        assert_eq!(
            registry.get(&1, "s").map(|s| s.chunks.clone()),
            Some(vec![0, 1])
        );
        let mut no_turn = chunk("a", 0, 1);
        no_turn.turn = None;
        assert_eq!(
            registry.append(&1, "t", no_turn, &LIMITS),
            Err(ChunkRefusal::TurnMissing)
        );
    }

    #[test]
    fn an_ended_stream_stays_closed() {
        let mut registry = StreamRegistry::<u8, Vec<u64>>::default();
        registry.append(&1, "s", chunk("a", 0, 1), &LIMITS).unwrap();
        assert!(registry.has_turn(&1, TURN) && registry.is_known(&1, "s"));
        assert_eq!(registry.end_turn(&1, TURN), vec!["s".to_owned()]);
        assert!(!registry.has_turn(&1, TURN) && registry.is_known(&1, "s"));
        assert!(registry.has_ended(&1, "s"));
        assert_eq!(
            registry.append(&1, "s", chunk("a", 0, 1), &LIMITS),
            Err(ChunkRefusal::Closed)
        );
        assert_eq!(
            registry.append(&1, "s", chunk("a", 1, 1), &LIMITS),
            Err(ChunkRefusal::Closed)
        );
        assert_eq!(registry.open_count(), 0);
    }

    #[test]
    fn a_forgotten_replica_is_taken_again_from_index_zero_and_frees_its_bytes() {
        let mut registry = StreamRegistry::<u8, Vec<u64>>::default();
        registry.append(&1, "s", chunk("a", 0, 5), &LIMITS).unwrap();
        registry.append(&1, "s", chunk("a", 1, 5), &LIMITS).unwrap();
        registry.append(&1, "t", chunk("b", 0, 3), &LIMITS).unwrap();
        assert_eq!(registry.forget_where(&1, |stream| stream.owner == "a"), 1);
        assert_eq!(registry.forget_where(&2, |_| true), 0);
        assert!(
            !registry.is_known(&1, "s"),
            "a forgotten stream is not ended"
        );
        assert_eq!((registry.open_count(), registry.open_bytes()), (1, 3));
        registry.append(&1, "s", chunk("a", 0, 5), &LIMITS).unwrap();
        assert_eq!(registry.open_bytes(), 8);
        assert_eq!(registry.forget_where(&1, |_| true), 2);
        assert_eq!((registry.open_count(), registry.open_bytes()), (0, 0));
        assert_eq!(registry.pool_bytes("p"), 0);
        registry.forbid(&1, "u");
        assert_eq!(
            registry.append(&1, "u", chunk("a", 0, 1), &LIMITS),
            Err(ChunkRefusal::Closed),
            "a stream whose end came first does not open"
        );
    }

    #[test]
    fn limits_close_or_refuse() {
        let mut registry = StreamRegistry::<u8, Vec<u64>>::default();
        registry
            .append(&1, "s", chunk("a", 0, 60), &LIMITS)
            .unwrap();
        assert_eq!(
            registry.append(&1, "s", chunk("a", 1, 60), &LIMITS),
            Err(ChunkRefusal::TooLarge)
        );
        assert!(registry.get(&1, "s").is_none(), "aborted over the limit");
        registry.append(&1, "t", chunk("a", 0, 1), &LIMITS).unwrap();
        registry.append(&2, "u", chunk("a", 0, 1), &LIMITS).unwrap();
        assert_eq!(
            registry.append(&3, "v", chunk("a", 0, 1), &LIMITS),
            Err(ChunkRefusal::TooManyStreams)
        );
        assert!(registry.append(&3, "v", chunk("b", 0, 1), &LIMITS).is_ok());
        let gone = registry.end_where(|stream| stream.owner == "a");
        assert_eq!(gone.len(), 2);
        assert_eq!(registry.open_count(), 1);
        assert_eq!(registry.open_bytes(), 1);
    }

    fn in_pool<'a>(pool: &'a str, owner: &'a str, index: u64, bytes: usize) -> ChunkIn<'a, u64> {
        ChunkIn {
            pool,
            ..chunk(owner, index, bytes)
        }
    }

    #[test]
    fn budgets_refuse_an_opening_and_abort_a_growing_stream() {
        let limits = StreamLimits {
            max_stream_bytes: 100,
            max_streams_per_owner: 10,
            max_pool_bytes: 50,
            max_total_bytes: 80,
        };
        let mut registry = StreamRegistry::<u8, Vec<u64>>::default();
        registry
            .append(&1, "a", in_pool("p", "x", 0, 30), &limits)
            .unwrap();
        assert_eq!(
            registry.append(&1, "b", in_pool("p", "y", 0, 30), &limits),
            Err(ChunkRefusal::OverBudget {
                budget: Budget::Pool,
                aborted: false
            })
        );
        assert!(
            !registry.is_known(&1, "b"),
            "a refused opening opens nothing and may come again"
        );
        registry
            .append(&1, "c", in_pool("q", "y", 0, 40), &limits)
            .unwrap();
        registry
            .append(&1, "d", in_pool("r", "z", 0, 5), &limits)
            .unwrap();
        // Pool q would hold 48 of its 50, but the node 83 of its 80.
        assert_eq!(
            registry.append(&1, "c", in_pool("q", "y", 1, 8), &limits),
            Err(ChunkRefusal::OverBudget {
                budget: Budget::Total,
                aborted: true
            })
        );
        assert!(registry.get(&1, "c").is_none() && registry.has_ended(&1, "c"));
        assert_eq!(
            (registry.pool_bytes("p"), registry.pool_bytes("q")),
            (30, 0)
        );
        assert_eq!(registry.open_bytes(), 35);
        registry.end(&1, "a");
        registry.end(&1, "d");
        assert!(
            registry
                .append(&1, "b", in_pool("p", "y", 0, 50), &limits)
                .is_ok()
        );
    }

    #[test]
    fn a_newer_fence_takes_the_turn_over() {
        let mut registry = StreamRegistry::<u8, Vec<u64>>::default();
        let fenced = |owner, fence| ChunkIn {
            fence: Some(fence),
            ..chunk(owner, 0, 1)
        };
        registry.append(&1, "old", fenced("a", 1), &LIMITS).unwrap();
        let taken = registry.append(&1, "new", fenced("b", 2), &LIMITS).unwrap();
        assert_eq!(taken.fenced, vec!["old".to_owned()]);
        assert_eq!(
            registry.append(&1, "old", chunk("a", 1, 1), &LIMITS),
            Err(ChunkRefusal::Closed),
            "the fenced writer's late chunk"
        );
        assert_eq!(
            registry.append(&1, "older", fenced("a", 1), &LIMITS),
            Err(ChunkRefusal::Closed),
            "a stream under an older fence cannot open"
        );
    }

    #[test]
    fn ended_memory_is_bounded() {
        let mut registry = StreamRegistry::<u8, Vec<u64>>::with_memory(2);
        for id in ["a", "b", "c"] {
            registry.append(&1, id, chunk("o", 0, 1), &LIMITS).unwrap();
            registry.end(&1, id);
        }
        assert!(!registry.has_ended(&1, "a"));
        assert!(registry.has_ended(&1, "c"));
    }

    #[test]
    fn a_cursor_shows_each_chunk_once_and_notices_gaps() {
        let mut cursor = StreamCursor::default();
        assert_eq!(cursor.on_chunk("s", 0), ShowChunk::Show);
        assert_eq!(cursor.on_chunk("s", 0), ShowChunk::Drop);
        assert_eq!(cursor.on_chunk("s", 2), ShowChunk::Gap { from: 1 });
        assert_eq!(cursor.on_chunk("s", 1), ShowChunk::Show);
        assert!(cursor.on_end("s"));
        assert_eq!(cursor.on_chunk("s", 2), ShowChunk::Drop);
        assert!(!cursor.on_end("s"));
        assert!(!cursor.on_end("never-shown"));
    }

    #[test]
    fn a_coalesced_run_is_shown_from_the_next_index_and_advances_past_its_end() {
        let mut cursor = StreamCursor::default();
        assert_eq!(cursor.on_chunks("s", 1, 9), ShowChunk::Gap { from: 0 });
        assert_eq!(cursor.on_chunks("s", 0, 9), ShowChunk::Show);
        assert_eq!(cursor.next_index("s"), 10);
        assert_eq!(
            cursor.on_chunk("s", 9),
            ShowChunk::Drop,
            "covered by the run"
        );
        assert_eq!(
            cursor.on_chunks("s", 5, 12),
            ShowChunk::Drop,
            "overlaps what was shown"
        );
        assert_eq!(cursor.on_chunk("s", 10), ShowChunk::Show);
    }

    proptest! {
        /// Whatever order and repetition chunks reach a connection in (live feed and snapshot
        /// overlapping), filling gaps from the registry shows exactly the stream, in order.
        #[test]
        fn a_subscriber_assembles_exactly_the_stream(
            deliveries in proptest::collection::vec(0u64..20, 0..80),
            length in 1u64..20,
        ) {
            let mut registry = StreamRegistry::<u8, Vec<u64>>::default();
            let limits = StreamLimits { max_streams_per_owner: 1, ..StreamLimits::UNBOUNDED };
            for index in 0..length {
                registry.append(&1, "s", chunk("a", index, 1), &limits).unwrap();
            }
            let mut cursor = StreamCursor::default();
            let mut shown = Vec::new();
            for index in deliveries.into_iter().filter(|index| *index < length) {
                match cursor.on_chunk("s", index) {
                    ShowChunk::Show => shown.push(index),
                    ShowChunk::Drop => {}
                    ShowChunk::Gap { from } => {
                        let stream = registry.get(&1, "s").unwrap();
                        for missed in from..=index {
                            prop_assert_eq!(cursor.on_chunk("s", missed), ShowChunk::Show);
                            shown.push(stream.chunks[missed as usize]);
                        }
                    }
                }
            }
            let expected: Vec<u64> = (0..shown.len() as u64).collect();
            prop_assert_eq!(shown, expected);
        }

        /// Whatever is appended and ended, the bytes counted per pool and in all equal the
        /// bytes of the open streams, and never pass a budget.
        #[test]
        fn budgets_count_exactly_what_is_open(
            steps in proptest::collection::vec((0u8..4, 0u64..4, 0usize..40, 0u8..2, proptest::bool::ANY), 0..120),
        ) {
            let limits = StreamLimits {
                max_stream_bytes: 90,
                max_streams_per_owner: 3,
                max_pool_bytes: 100,
                max_total_bytes: 150,
            };
            let mut registry = StreamRegistry::<u8, Vec<u64>>::with_memory(0);
            let pools = ["p0", "p1"];
            for (stream, index, bytes, pool, end) in steps {
                let id = format!("s{stream}");
                if end {
                    registry.end(&1, &id);
                    continue;
                }
                let pool = pools[pool as usize];
                let _ = registry.append(&1, &id, in_pool(pool, pool, index, bytes), &limits);
                let open = registry.snapshot(&1);
                let total: usize = open.iter().map(|(_, stream)| stream.bytes).sum();
                prop_assert_eq!(registry.open_bytes(), total);
                prop_assert!(total <= limits.max_total_bytes);
                for pool in pools {
                    let held: usize = open
                        .iter()
                        .filter(|(_, stream)| stream.pool == pool)
                        .map(|(_, stream)| stream.bytes)
                        .sum();
                    prop_assert_eq!(registry.pool_bytes(pool), held);
                    prop_assert!(held <= limits.max_pool_bytes);
                }
            }
        }

        /// Chunks accepted by the owner's node, applied in order to a replica, leave the
        /// replica equal to the original.
        #[test]
        fn a_replica_equals_the_original(
            sends in proptest::collection::vec((0u8..3, 0u64..6, 0usize..40), 0..60),
        ) {
            let mut original = StreamRegistry::<u8, Vec<u64>>::default();
            let mut replica = StreamRegistry::<u8, Vec<u64>>::default();
            for (stream, index, bytes) in sends {
                let id = format!("s{stream}");
                let accepted = original.append(&1, &id, chunk("a", index, bytes), &LIMITS);
                if accepted.is_ok() {
                    let relaxed = StreamLimits::UNBOUNDED;
                    prop_assert!(replica.append(&1, &id, chunk("a", index, bytes), &relaxed).is_ok());
                } else if accepted == Err(ChunkRefusal::TooLarge) {
                    replica.end(&1, &id);
                }
            }
            let mut left = original.snapshot(&1);
            let mut right = replica.snapshot(&1);
            left.sort_by(|a, b| a.0.cmp(&b.0));
            right.sort_by(|a, b| a.0.cmp(&b.0));
            prop_assert_eq!(left, right);
        }
    }
}
