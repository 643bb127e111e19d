//! The `meta` an agent's delivered turn carries (docs/protocol.md §4.2) and the references it is
//! built from: which turn, whose, which channel, which runtime. Below both the stored frame's
//! rendering (`persistent`) and the agent envelopes (`delivery`), which use them.

use serde::Serialize;
use serde_json::Value;

/// The turn key of docs/protocol.md §5: `conversation:seq:revision`, stable across deliveries.
pub fn turn_key(conversation_id: &str, seq: i64, revision: i32) -> String {
    format!("{conversation_id}:{seq}:{revision}")
}

/// `meta.turn`: which turn a delivery is, and under which fence (lease mode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TurnRef {
    /// The turn's seq.
    pub seq: i64,
    /// Its revision.
    pub revision: i32,
    /// The turn key.
    pub key: String,
    /// `edit` or `regenerate` for revisions above 0.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<&'static str>,
    /// Lease mode: the fence the answer must carry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fence: Option<i64>,
}

impl TurnRef {
    /// The reference of revision `revision` of turn `seq` of a conversation.
    pub fn new(
        conversation_id: &str,
        seq: i64,
        revision: i32,
        reason: Option<&'static str>,
    ) -> TurnRef {
        TurnRef {
            seq,
            revision,
            key: turn_key(conversation_id, seq, revision),
            reason,
            fence: None,
        }
    }
}

/// `meta.runtime`: the conversation's runtime state at delivery.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RuntimeRef<'a> {
    /// The version an answer must name to replace it.
    pub version: i64,
    /// The state object.
    pub state: &'a Value,
}

/// `{id}` of a channel.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ChannelRef<'a> {
    /// Channel id.
    pub id: &'a str,
}

/// `meta` of a delivered turn.
#[derive(Debug, Clone, Serialize)]
pub struct TurnMeta<'a> {
    /// `{id}` of the channel.
    pub channel: ChannelRef<'a>,
    /// Who wrote the turn.
    pub participant: Participant<'a>,
    /// Which turn.
    pub turn: &'a TurnRef,
    /// The runtime at delivery.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime: Option<RuntimeRef<'a>>,
    /// The end user's `meta` for this turn (the send's over its connection's hello's), kept
    /// with the frame and shown to agents only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client: Option<&'a Value>,
}

/// `{id, role}` of a frame's author or a participant.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Participant<'a> {
    /// Participant id.
    pub id: &'a str,
    /// Participant role.
    pub role: &'a str,
}
