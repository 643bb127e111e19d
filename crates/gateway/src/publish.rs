//! Publishing what this node committed or relays, the two ways it happens everywhere:
//!
//! - a committed frame goes to this node's hub at once (the conversation's sessions and the
//!   channel's actor); the other nodes hear of it from the commit's own notification (the
//!   `postgres` bus) or from the bus's publication after the commit (`nats`, ADR 0033);
//! - a transient frame (typing, receipts, presence, relayed agent frames, forwarded client
//!   frames) goes to this node's hub and, through the bus, to every other node.

use std::sync::Arc;

use converger_store::bus::{Origin, TransientFrame};
use converger_store::{Activity, CommitOutcome, NewActivity, StoreError};
use serde_json::Value;
use uuid::Uuid;

use crate::hub::{Hub, HubEvent};
use crate::state::AppState;

/// Hands newly committed frames of a conversation to this node's sessions and channel actor,
/// and announces them on the bus (for the buses that do not announce in the commit).
pub(crate) fn committed(
    state: &AppState,
    channel_id: Uuid,
    conversation_id: Uuid,
    activities: impl IntoIterator<Item = Arc<Activity>>,
) {
    let activities: Vec<Arc<Activity>> = activities.into_iter().collect();
    for activity in &activities {
        let event = HubEvent::committed(Arc::clone(activity));
        state.hub.publish_to_all(channel_id, conversation_id, event);
    }
    state.bus.committed(channel_id, &activities);
}

/// Commits a frame and, when it is new (not a repeated idempotency key), publishes it.
pub(crate) async fn commit_frame(
    state: &AppState,
    channel_id: Uuid,
    new: &NewActivity,
) -> Result<(Arc<Activity>, bool), StoreError> {
    let CommitOutcome {
        activity,
        duplicate,
    } = state.store.commit_activity(new).await?;
    let activity = Arc::new(activity);
    if !duplicate {
        committed(
            state,
            channel_id,
            new.conversation_id,
            [Arc::clone(&activity)],
        );
    }
    Ok((activity, duplicate))
}

/// A regenerate opened `revision` of `turn` at `opened_at` (nothing stored but the registry
/// row): this node's agents take it and its sessions see it (a frontend following the old
/// revision ends it), and the other nodes hear it through the bus.
pub(crate) async fn regenerated(
    state: &AppState,
    channel_id: Uuid,
    turn: Arc<Activity>,
    revision: i32,
    opened_at: chrono::DateTime<chrono::Utc>,
) {
    let (conversation_id, seq) = (turn.conversation_id, turn.seq);
    let opened_at_ms = opened_at.timestamp_millis();
    let event = HubEvent::Regenerated {
        turn,
        revision,
        opened_at_ms,
    };
    state.hub.publish_to_all(channel_id, conversation_id, event);
    if let Err(error) = state
        .bus
        .regenerated(channel_id, conversation_id, (seq, revision), opened_at_ms)
        .await
    {
        tracing::warn!(%error, "regenerated turn not published to other nodes");
    }
}

/// Who receives a transient frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Audience {
    /// The conversation's end users and the channel's agents.
    Everyone,
    /// The channel's agents only (a forwarded client frame).
    Agents,
    /// The conversation's end users only (an agent's relayed frame: agents never receive each
    /// other's transient frames).
    EndUsers,
}

/// A frame that is not stored, and where it goes.
#[derive(Debug, Clone)]
pub(crate) struct Transient {
    /// The conversation's channel.
    pub channel_id: Uuid,
    /// The conversation.
    pub conversation_id: Uuid,
    /// The frame.
    pub frame: Value,
    /// Its author, so receivers can skip the author's own connection.
    pub origin: Origin,
    /// Who receives it.
    pub audience: Audience,
}

impl Transient {
    /// Hands the frame to this node's hub.
    pub(crate) fn publish_here(&self, hub: &Hub) {
        let event = HubEvent::Transient {
            frame: Arc::new(self.frame.clone()),
            origin: Some(Arc::new(self.origin.clone())),
        };
        match self.audience {
            Audience::Everyone => hub.publish_to_all(self.channel_id, self.conversation_id, event),
            Audience::Agents => hub.publish_to_agents(self.channel_id, self.conversation_id, event),
            Audience::EndUsers => hub.publish(self.conversation_id, event),
        }
    }

    /// The frame as it travels to the other nodes.
    fn for_other_nodes(self, node: &str) -> TransientFrame {
        TransientFrame {
            node: node.to_owned(),
            channel_id: (self.audience != Audience::EndUsers).then_some(self.channel_id),
            conversation_id: self.conversation_id,
            frame: self.frame,
            origin: Some(self.origin),
            agents_only: self.audience == Audience::Agents,
        }
    }

    /// Hands the frame to this node's hub, then to the other nodes through the bus (a failure
    /// there is logged: transient frames may be lost).
    pub(crate) async fn publish(self, state: &AppState) {
        publish_all(state, [self]).await;
    }
}

/// Hands transient frames to this node's hub, then to the other nodes in one publication (a
/// failure there is logged: transient frames may be lost).
pub(crate) async fn publish_all(state: &AppState, transients: impl IntoIterator<Item = Transient>) {
    let node = state.hub.node_id();
    let frames: Vec<TransientFrame> = transients
        .into_iter()
        .map(|transient| {
            transient.publish_here(&state.hub);
            transient.for_other_nodes(node)
        })
        .collect();
    if frames.is_empty() {
        return;
    }
    if let Err(error) = state.bus.transients(&frames).await {
        tracing::warn!(%error, frames = frames.len(), "transient frames not published to other nodes");
    }
}
