//! The values the channel decider takes and returns.

/// What the decider needs to know of a committed frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameFacts<'a> {
    /// Its conversation.
    pub conversation_id: &'a str,
    /// Its seq.
    pub seq: i64,
    /// Its commit time, ms since the epoch (the database clock).
    pub at_ms: i64,
    /// `sender.id`.
    pub sender_id: &'a str,
    /// True when the conversation's end user wrote it (`sender.role` is `user`).
    pub from_user: bool,
    /// The turn the frame belongs to: the answered turn of an agent's result, the edited turn of
    /// an edit (with `revision`).
    pub turn_seq: Option<i64>,
    /// The revision an edit opened, or the one an agent's result answers.
    pub turn_revision: Option<i32>,
}

/// An unanswered turn read back from the turn registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingFacts {
    /// Its conversation.
    pub conversation_id: String,
    /// The turn's seq.
    pub seq: i64,
    /// Its latest revision, the one unanswered.
    pub revision: i32,
    /// When that revision was opened (the turn's commit time for revision 0), ms since the
    /// epoch.
    pub at_ms: i64,
}

/// The times a stop's owners are decided at, ms since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopTimes {
    /// The turn frame's commit time (the database clock): revision 0 went to its owners then.
    pub turn_at_ms: i64,
    /// When the stopped revision was opened (the database clock), when the stop says: a
    /// regenerated revision went to the owners then.
    pub revision_at_ms: Option<i64>,
    /// Now, on this node's clock.
    pub now_ms: i64,
}

/// Which turn a delivery is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnId {
    /// The turn's seq.
    pub seq: i64,
    /// Its revision.
    pub revision: i32,
    /// Why a revision above 0 exists.
    pub reason: Option<TurnReason>,
}

/// Why a turn has a revision above 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnReason {
    /// The user edited the turn's frame.
    Edit,
    /// The user asked for another answer.
    Regenerate,
}

impl TurnReason {
    /// The wire and stored form: `edit` or `regenerate`.
    pub fn as_str(self) -> &'static str {
        match self {
            TurnReason::Edit => "edit",
            TurnReason::Regenerate => "regenerate",
        }
    }

    /// The reason a stored `turns.reason` names.
    pub fn parse(reason: &str) -> Option<TurnReason> {
        match reason {
            "edit" => Some(TurnReason::Edit),
            "regenerate" => Some(TurnReason::Regenerate),
            _ => None,
        }
    }
}

impl TurnId {
    /// The turn a user frame stands for: an edit is the revision it opened of the turn it
    /// replaces; any other user frame is a new turn at revision 0.
    pub fn of(frame: &FrameFacts<'_>) -> TurnId {
        match (frame.turn_seq, frame.turn_revision) {
            (Some(seq), Some(revision)) => TurnId {
                seq,
                revision,
                reason: Some(TurnReason::Edit),
            },
            _ => TurnId {
                seq: frame.seq,
                revision: 0,
                reason: None,
            },
        }
    }
}

/// What the actor does next. Frames are named by their index in the slice the decision was
/// made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Send the frame, as agents see it, to one connection.
    SendFrame {
        /// The connection.
        to: String,
        /// The frame's index.
        frame: usize,
    },
    /// Deliver a user turn with its `meta` (claimed first for a lease-mode member).
    DeliverTurn {
        /// The member.
        to: String,
        /// The turn's frame.
        frame: usize,
        /// Which turn.
        turn: TurnId,
        /// True for a turn's first delivery (not a replay).
        first: bool,
    },
    /// Read these turns from the registry and deliver those still unanswered, at their latest
    /// revision, to one member: they were taken over.
    DeliverPending {
        /// The member.
        to: String,
        /// The conversation.
        conversation_id: String,
        /// The turns' seqs, ascending.
        seqs: Vec<i64>,
    },
    /// Read the channel's unanswered turns and hand them to [`super::ChannelDecider::pending_read`].
    ReadPendingOfChannel {
        /// Remember them for this group only; `None`: for every group.
        group: Option<String>,
    },
    /// Read a conversation's unanswered turns up to `up_to` (they fell out of a group's
    /// memory) and hand them to [`super::ChannelDecider::pending_up_to_read`].
    ReadPendingUpTo {
        /// The group whose memory overflowed.
        group: String,
        /// The conversation.
        conversation_id: String,
        /// The highest seq that fell out.
        up_to: i64,
    },
    /// Tell a member that a turn it was given is stopped (`cancel`, ADR 0028).
    Cancel {
        /// The member.
        to: String,
        /// The conversation.
        conversation_id: String,
        /// The turn's seq.
        seq: i64,
        /// The revision stopped.
        revision: i32,
        /// Why (`stopped`, `superseded`, …), as the agent is told.
        reason: String,
    },
    /// Give up the turn claims a lease-mode member holds, so the next owner claims at once.
    ReleaseLeases {
        /// The member.
        holder: String,
    },
}

/// How to handle a committed event for a conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommittedPlan {
    /// Handled already (a local commit arrives directly and again through the bus).
    Skip,
    /// The event's own frame is all that is new.
    Use,
    /// Frames are missing (a lagged feed, or an event without its frame): read `count` frames
    /// after `after`, then hand them to [`super::ChannelDecider::committed`].
    Read {
        /// Read frames after this seq.
        after: i64,
        /// How many.
        count: i64,
    },
    /// The conversation is new to this node since it began following the channel, and frames
    /// of it committed since then may still be on their way (another node's commits arrive
    /// later than this node's own): read its frames committed at or after `since_ms` up to
    /// `upto`, in order, then hand them to [`super::ChannelDecider::committed`].
    ReadSince {
        /// Commit time (ms, the database clock) from which this node follows the channel.
        since_ms: i64,
        /// The event's seq.
        upto: i64,
    },
}

/// A local agent connection, as the decider knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalAgent {
    /// Its group; `None` for an observer.
    pub group: Option<String>,
    /// Eligibility time (ms).
    pub since_ms: i64,
    /// The `sender.id` its frames are stored with.
    pub sender_id: String,
    /// Lease mode: its turns are claimed before delivery.
    pub leased: bool,
}
