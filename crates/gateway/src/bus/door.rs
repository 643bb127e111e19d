//! The door into the node's hub for everything the bus hands over: other nodes' commits,
//! stream events, transient frames and orders, this node's own committed batches, and what a
//! catch-up or a sweep reads back from the outbox. Every commit teaches the node's runtimes
//! (ADR 0039) before its frames go in.
//!
//! The de-duplication rule, stated once: a commit event whose last seq is at or below the
//! highest seq this door already let in for its conversation is dropped here; anything else
//! goes in, and every receiver (a session's replay cursor, a channel actor's decider, a
//! frontend's follower) drops the frames it already has and reads any gap from `activities`.
//! So a repeated, late, reordered or lost event costs a read or some latency, never a frame.

use std::sync::Arc;

use converger_protocol::{CloseCode, ErrorCode, ErrorFrame};
use converger_store::Store;
use converger_store::bus::BusEvent;
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::hub::{Hub, HubEvent, SessionControl};
use crate::recent::{RECENT_PERIOD_MS, RECENT_TICK, Recent, monotonic_ms};
use crate::runtimes::Runtimes;
use crate::streams::LiveStreams;

/// Most frames one committed event is read back with (a batch commits at most 128 writes, each a
/// frame or an answer of a few frames); a longer range is left to the sessions' gap reads.
const MAX_READ_BACK: i64 = 1_024;

/// Conversations whose channel (and highest seq let in) the door remembers per generation: it
/// keeps those of the last minute or two (`Recent`). A forgotten conversation's repeated events
/// go to the receivers, which drop them; its channel is read again.
const REMEMBERED_CONVERSATIONS: usize = 65_536;

/// Consumes bus events until the bus closes.
pub fn spawn(
    store: Store,
    hub: Arc<Hub>,
    streams: Arc<LiveStreams>,
    runtimes: Arc<Runtimes>,
    mut events: mpsc::UnboundedReceiver<BusEvent>,
) {
    tokio::spawn(async move {
        let mut channels = ChannelsOf::default();
        let mut seen = HighestSeen::default();
        let mut forget = tokio::time::interval(RECENT_TICK);
        loop {
            let mut event = tokio::select! {
                event = events.recv() => match event {
                    Some(event) => event,
                    None => return,
                },
                _ = forget.tick() => {
                    let now_ms = monotonic_ms();
                    channels.looked_up.forget_idle(now_ms);
                    seen.seqs.forget_idle(now_ms);
                    runtimes.forget_idle();
                    continue;
                }
            };
            // Before anything it commits is delivered, repeated events included (they teach
            // nothing new, or forget, which only costs a read).
            if let BusEvent::Committed {
                conversation_id,
                seq,
                runtime,
                ..
            } = &mut event
            {
                runtimes.committed(*conversation_id, *seq, runtime.take());
            }
            match event {
                BusEvent::Streams { node, events } => streams.apply_remote(&hub, &node, events),
                BusEvent::StreamHoldings {
                    conversation_id,
                    replies,
                } => streams.apply_holdings(&hub, conversation_id, replies),
                BusEvent::StreamsUnfollowed { conversation_id } => {
                    streams.unfollowed(conversation_id)
                }
                // Its own node applied it when it stopped the turn.
                BusEvent::TurnStopped(stop) if stop.node == hub.node_id() => {}
                BusEvent::TurnStopped(stop) => crate::stops::apply(&hub, &streams, &stop),
                BusEvent::Committed {
                    conversation_id,
                    seq,
                    ..
                } if seen.already(conversation_id, seq) => {}
                event => dispatch(&store, &hub, &mut channels, &mut seen, event).await,
            }
        }
    });
}

/// The channel of each conversation whose events arrived without it (this node's own commits,
/// catch-ups): a conversation never changes channel, so one read per conversation is enough.
struct ChannelsOf {
    looked_up: Recent<Uuid, Uuid>,
}

impl Default for ChannelsOf {
    fn default() -> Self {
        ChannelsOf {
            looked_up: Recent::new(REMEMBERED_CONVERSATIONS, RECENT_PERIOD_MS),
        }
    }
}

impl ChannelsOf {
    /// `named` when the event named it, else the one looked up before, else the stored one.
    async fn channel(
        &mut self,
        store: &Store,
        conversation_id: Uuid,
        named: Option<Uuid>,
    ) -> Option<Uuid> {
        if let Some(channel_id) = named.or_else(|| self.looked_up.get(&conversation_id).copied()) {
            return Some(channel_id);
        }
        let channel_id = store
            .conversation(conversation_id)
            .await
            .ok()
            .flatten()
            .map(|conversation| conversation.channel_id)?;
        // A generation dropped when full is simply forgotten.
        let _ = self.looked_up.insert(conversation_id, channel_id);
        Some(channel_id)
    }
}

/// The highest seq the door let in per conversation (kept as the channels are).
struct HighestSeen {
    seqs: Recent<Uuid, i64>,
}

impl Default for HighestSeen {
    fn default() -> Self {
        HighestSeen {
            seqs: Recent::new(REMEMBERED_CONVERSATIONS, RECENT_PERIOD_MS),
        }
    }
}

impl HighestSeen {
    /// True when `seq` of `conversation_id` was let in before.
    fn already(&self, conversation_id: Uuid, seq: i64) -> bool {
        self.seqs
            .get(&conversation_id)
            .is_some_and(|&highest| highest >= seq)
    }

    fn let_in(&mut self, conversation_id: Uuid, seq: i64) {
        let highest = self.seqs.get(&conversation_id).copied().unwrap_or(seq);
        let _ = self.seqs.insert(conversation_id, highest.max(seq));
    }
}

async fn dispatch(
    store: &Store,
    hub: &Hub,
    channels: &mut ChannelsOf,
    seen: &mut HighestSeen,
    event: BusEvent,
) {
    match event {
        // Handled by the caller, which holds the streams.
        BusEvent::Streams { .. }
        | BusEvent::StreamHoldings { .. }
        | BusEvent::StreamsUnfollowed { .. }
        | BusEvent::TurnStopped(_) => {}
        BusEvent::Committed {
            conversation_id,
            first_seq,
            seq,
            channel_id,
            frames,
            ..
        } => {
            let channel_id = channels.channel(store, conversation_id, channel_id).await;
            // Let in only with its channel known: without it the channel's agents miss it, and
            // a later event of the same commit must still reach them.
            if channel_id.is_some() {
                seen.let_in(conversation_id, seq);
            }
            let for_agents = channel_id.is_some_and(|channel_id| hub.has_agents(channel_id));
            if !for_agents && !hub.wants_committed(conversation_id, seq) {
                return;
            }
            let frames = if frames.last().is_some_and(|last| last.seq == seq) {
                frames.into_iter().map(Arc::new).collect()
            } else {
                // Too large for the notification: one read per node and commit, shared by the
                // sessions and agents.
                let count = (seq - first_seq + 1).clamp(1, MAX_READ_BACK);
                match store
                    .list_activities(conversation_id, first_seq - 1, count)
                    .await
                {
                    Ok(rows) => rows
                        .into_iter()
                        .filter(|row| (first_seq..=seq).contains(&row.seq))
                        .map(Arc::new)
                        .collect(),
                    Err(error) => {
                        tracing::warn!(%error, %conversation_id, seq, "bus: committed frame unreadable; sessions will read it");
                        Vec::new()
                    }
                }
            };
            let mut events: Vec<HubEvent> = frames.into_iter().map(HubEvent::committed).collect();
            if events.is_empty() {
                events.push(HubEvent::committed_seq(seq));
            }
            for event in events {
                match channel_id {
                    Some(channel_id) => hub.publish_to_all(channel_id, conversation_id, event),
                    None => hub.publish(conversation_id, event),
                }
            }
        }
        BusEvent::Transient(transient) => {
            if transient.node == hub.node_id() {
                return;
            }
            let conversation_id = transient.conversation_id;
            let event = HubEvent::Transient {
                frame: Arc::new(transient.frame),
                origin: transient.origin.map(Arc::new),
            };
            match transient.channel_id {
                Some(channel_id) if transient.agents_only => {
                    hub.publish_to_agents(channel_id, conversation_id, event)
                }
                Some(channel_id) => hub.publish_to_all(channel_id, conversation_id, event),
                None => hub.publish(conversation_id, event),
            }
        }
        BusEvent::Regenerated {
            node,
            channel_id,
            conversation_id,
            seq,
            revision,
            opened_at_ms,
        } => {
            // Agents take the new revision; frontends following the old one end it (ADR 0030).
            let wanted = hub.has_agents(channel_id) || hub.has_followers(conversation_id);
            if node == hub.node_id() || !wanted {
                return;
            }
            let turn = match store.list_activities(conversation_id, seq - 1, 1).await {
                Ok(mut rows) => rows.pop().filter(|row| row.seq == seq),
                Err(error) => {
                    tracing::warn!(%error, %conversation_id, seq, "bus: regenerated turn unreadable");
                    None
                }
            };
            let Some(turn) = turn else { return };
            // A node of an earlier release does not say when: decided at hearing it, as then.
            let opened_at_ms =
                opened_at_ms.unwrap_or_else(|| chrono::Utc::now().timestamp_millis());
            let event = HubEvent::Regenerated {
                turn: Arc::new(turn),
                revision,
                opened_at_ms,
            };
            hub.publish_to_all(channel_id, conversation_id, event);
        }
        BusEvent::ChannelStatus {
            channel_id, status, ..
        } => {
            if status == "inactive" {
                hub.close_channel(channel_id, channel_inactive_close());
            }
        }
        BusEvent::Disconnect(order) => {
            let closed = hub.disconnect(&order, disconnect_close(&order.reason));
            tracing::info!(request_id = %order.request_id, closed, "disconnect order carried out");
            // Off the bus's path: the report is a write, the next events need not wait for it.
            let (store, node) = (store.clone(), hub.node_id().to_owned());
            tokio::spawn(async move {
                if let Err(error) = store
                    .report_disconnect(order.request_id, &node, closed)
                    .await
                {
                    tracing::warn!(%error, request_id = %order.request_id, "disconnect not reported");
                }
            });
        }
    }
}

/// Longest close reason a WebSocket close frame carries, in bytes.
const MAX_CLOSE_REASON_BYTES: usize = 123;

/// The close every socket a disconnect order names receives: an error `forbidden` with the
/// operator's reason, then 4403 with `disconnected: <reason>` (cut to fit a close frame).
pub fn disconnect_close(reason: &str) -> SessionControl {
    let mut close_reason = format!("disconnected: {reason}");
    if close_reason.len() > MAX_CLOSE_REASON_BYTES {
        let mut end = MAX_CLOSE_REASON_BYTES;
        while !close_reason.is_char_boundary(end) {
            end -= 1;
        }
        close_reason.truncate(end);
    }
    SessionControl::Close {
        error: Some(Box::new(ErrorFrame {
            details: Some(serde_json::json!({"reason": "disconnected"})),
            ..ErrorFrame::new(ErrorCode::Forbidden, reason)
        })),
        code: CloseCode::ChannelInactive.number(),
        reason: close_reason,
    }
}

/// The close every session of a deactivated channel receives.
pub fn channel_inactive_close() -> SessionControl {
    SessionControl::Close {
        error: Some(Box::new(ErrorFrame::new(
            ErrorCode::ChannelInactive,
            "channel is inactive",
        ))),
        code: CloseCode::ChannelInactive.number(),
        reason: ErrorCode::ChannelInactive.as_str().to_owned(),
    }
}
