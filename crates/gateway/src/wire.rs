//! Store rows as the wire contract (`converger-protocol`) and the pure core (`converger-core`)
//! see them: the one place that maps a stored frame's columns onto both.

use converger_core::channel::{FrameFacts, PendingFacts};
use converger_protocol::{Participant, PersistentFrame};
use converger_store::{Activity, ChannelPendingTurn};
use serde_json::Value;

/// A stored frame as clients see it (rendered for a viewer by the caller).
pub(crate) fn persistent(activity: &Activity) -> PersistentFrame<'_> {
    PersistentFrame {
        kind: &activity.kind,
        id: &activity.id,
        seq: activity.seq,
        sender_id: &activity.sender_id,
        sender_role: &activity.sender_role,
        data: &activity.data,
        metadata: activity.metadata.as_ref(),
        extra: activity.extra.as_ref().and_then(Value::as_object),
        client_id: activity.client_id.as_deref(),
        timestamp_ms: activity.timestamp_ms(),
    }
}

/// The frame's author as `{id, role}`.
pub(crate) fn sender(activity: &Activity) -> Participant<'_> {
    Participant {
        id: &activity.sender_id,
        role: &activity.sender_role,
    }
}

/// What the channel decider needs of a stored frame; `conversation_id` is the frame's
/// conversation in its text form (the one ownership is hashed over).
pub(crate) fn facts<'a>(activity: &'a Activity, conversation_id: &'a str) -> FrameFacts<'a> {
    FrameFacts {
        conversation_id,
        seq: activity.seq,
        at_ms: activity.timestamp_ms(),
        sender_id: &activity.sender_id,
        from_user: activity.sender_role == converger_protocol::USER_ROLE,
        turn_seq: activity.turn_seq,
        turn_revision: activity.turn_revision,
    }
}

/// An unanswered turn read back from the registry, as the decider takes it.
pub(crate) fn pending_facts(turn: &ChannelPendingTurn) -> PendingFacts {
    PendingFacts {
        conversation_id: turn.conversation_id.to_string(),
        seq: turn.seq,
        at_ms: turn.at_ms,
    }
}
