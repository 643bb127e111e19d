//! Store rows as the wire contract (`converger-protocol`) and the pure core (`converger-core`)
//! see them: the one place that maps a stored frame's columns onto both.

use converger_core::channel::{FrameFacts, PendingFacts};
use converger_core::transcript::{ChatView, Revision};
use converger_protocol::{Participant, PersistentFrame};
use converger_store::{Activity, ChannelPendingTurn, RevisionRecord};
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

/// The chat view (ADR 0018) of a conversation's revised turns.
pub(crate) fn chat_view(records: Vec<RevisionRecord>) -> ChatView {
    ChatView::new(records.into_iter().map(|record| Revision {
        seq: record.seq,
        revision: record.revision,
        edit_seq: record.edit_seq,
        answer_seqs: record.answer_seqs,
        turn_id: record.turn_id,
        rolled_back: record.rolled_back,
    }))
}

/// A stored frame as the chat view shows it: `None` when left out, else under the id the view
/// gives it.
pub(crate) fn in_chat_view<'a>(
    activity: &'a Activity,
    view: &'a ChatView,
) -> Option<PersistentFrame<'a>> {
    if view.hides(activity.seq) {
        return None;
    }
    let mut frame = persistent(activity);
    if let Some(id) = view.shown_as(activity.seq) {
        frame.id = id;
    }
    Some(frame)
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
        revision: turn.revision,
        at_ms: turn.at_ms,
    }
}
