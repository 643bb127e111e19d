//! The runtimes this node hands out with delivered turns (ADR 0039). Every commit event that
//! enters the node through the bus door teaches the cache the runtime version its conversation
//! committed with, and the state when the commit wrote it; a delivered turn gets a runtime at
//! least as new as its own from memory, and only what the node does not know is read, in one
//! query for a whole delivery batch. The rule is `converger_core::runtimes`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use converger_core::runtimes::{Lookup, RuntimeCache};
use converger_protocol::TurnRef;
use converger_store::bus::{CommittedRuntime, serialized_len};
use converger_store::{Activity, Store, StoreError};
use serde_json::Value;
use uuid::Uuid;

use crate::recent::{RECENT_PERIOD_MS, monotonic_ms};

/// Conversations remembered per generation of the cache (two generations are kept).
const REMEMBERED_CONVERSATIONS: usize = 4_096;

/// Largest state (serialized) kept in memory: with the count above, the cache holds at most
/// 2 × 4,096 × 8 KiB = 64 MiB of states. A larger state is read for every delivery.
const KEPT_STATE_BYTES: usize = 8_192;

/// A runtime as a delivered turn carries it: its version and its state.
pub(crate) type Runtime = (i64, Arc<Value>);

/// What a delivery asks [`Runtimes::for_turns`] about.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeliveredAt {
    /// The conversation.
    pub(crate) conversation_id: Uuid,
    /// The delivered frame's seq (committed: a read now is at least as new as its runtime).
    pub(crate) seq: i64,
    /// A revision above 0. Revision 0 was opened by its frame's commit; a later one after it
    /// (a regenerate commits no frame), and the runtime may have moved since without an event
    /// (an answer without frames announces none): it is read.
    pub(crate) reopened: bool,
}

/// What delivering `activity` as `turn` asks [`Runtimes::for_turns`] about.
pub(crate) fn delivered_at(activity: &Activity, turn: &TurnRef) -> DeliveredAt {
    DeliveredAt {
        conversation_id: activity.conversation_id,
        seq: activity.seq,
        reopened: turn.revision > 0,
    }
}

/// The node's runtimes, shared by the bus door (which teaches them) and the connections that
/// deliver turns.
pub(crate) struct Runtimes {
    cache: Mutex<RuntimeCache<Uuid, Arc<Value>>>,
    initial: Arc<Value>,
}

impl Default for Runtimes {
    fn default() -> Self {
        Runtimes {
            cache: Mutex::new(RuntimeCache::new(
                REMEMBERED_CONVERSATIONS,
                RECENT_PERIOD_MS,
                KEPT_STATE_BYTES,
            )),
            initial: Arc::new(Value::Object(serde_json::Map::new())),
        }
    }
}

impl Runtimes {
    /// A commit of the conversation through `seq` entered the node, with what it said of the
    /// runtime (nothing: the conversation is forgotten, and its next turn read).
    pub(crate) fn committed(
        &self,
        conversation_id: Uuid,
        seq: i64,
        runtime: Option<CommittedRuntime>,
    ) {
        let (version, written) = match runtime {
            Some(CommittedRuntime { version, state }) => {
                let written = state.map(|state| {
                    let bytes = serialized_len(&state);
                    (Arc::new(state), bytes)
                });
                (Some(version), written)
            }
            None => (None, None),
        };
        self.lock()
            .committed(conversation_id, seq, version, written);
    }

    /// Forgets the conversation: its next turn is read.
    pub(crate) fn forget(&self, conversation_id: Uuid) {
        self.lock().forget(conversation_id);
    }

    /// Drops the conversations idle for a while.
    pub(crate) fn forget_idle(&self) {
        self.lock().forget_idle(monotonic_ms());
    }

    /// The runtime each of `turns` is delivered with, per conversation: from memory when the
    /// node knows one at least as new as the turn's, else read, in one query for all
    /// conversations this node does not know (and those with a reopened revision).
    pub(crate) async fn for_turns(
        &self,
        store: &Store,
        turns: &[DeliveredAt],
    ) -> Result<HashMap<Uuid, Runtime>, StoreError> {
        // Per conversation: its highest delivered seq, and whether a revision was reopened.
        let mut latest: HashMap<Uuid, (i64, bool)> = HashMap::new();
        for turn in turns {
            let entry = latest
                .entry(turn.conversation_id)
                .or_insert((turn.seq, turn.reopened));
            *entry = (entry.0.max(turn.seq), entry.1 || turn.reopened);
        }
        let mut runtimes = HashMap::with_capacity(latest.len());
        let mut unknown = Vec::new();
        {
            let cache = self.lock();
            for (&conversation_id, &(seq, reopened)) in &latest {
                if reopened {
                    unknown.push(conversation_id);
                    continue;
                }
                match cache.lookup(conversation_id, seq) {
                    Lookup::Initial => {
                        runtimes.insert(conversation_id, (0, Arc::clone(&self.initial)));
                    }
                    Lookup::Known { version, state } => {
                        runtimes.insert(conversation_id, (version, state));
                    }
                    Lookup::Read => unknown.push(conversation_id),
                }
            }
        }
        metrics::counter!("converger_delivery_runtimes_total", "source" => "memory")
            .increment(runtimes.len() as u64);
        if unknown.is_empty() {
            return Ok(runtimes);
        }
        metrics::counter!("converger_delivery_runtimes_total", "source" => "database")
            .increment(unknown.len() as u64);
        let mut read = store.runtimes(&unknown).await?;
        let mut cache = self.lock();
        for conversation_id in unknown {
            let (version, state) = read
                .remove(&conversation_id)
                .unwrap_or_else(converger_store::initial_runtime);
            let bytes = serialized_len(&state);
            let state = Arc::new(state);
            // Read after every one of these frames committed: at least as new as theirs.
            let seq = latest.get(&conversation_id).map_or(0, |&(seq, _)| seq);
            cache.read(conversation_id, seq, version, Arc::clone(&state), bytes);
            runtimes.insert(conversation_id, (version, state));
        }
        Ok(runtimes)
    }

    /// The cache, even after a panic elsewhere while it was held: every change to it is one
    /// call that leaves it consistent.
    fn lock(&self) -> MutexGuard<'_, RuntimeCache<Uuid, Arc<Value>>> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
