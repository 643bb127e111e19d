//! Turn results in flight on one agent connection.
//!
//! An agent serving many conversations answers many turns at once. Committing each result
//! before reading the next frame would cap a connection at one answer per database round trip,
//! so results of different conversations commit concurrently, up to [`MAX_IN_FLIGHT`] per
//! connection. Each task commits, publishes the answer's frames and returns the ack (or refusal)
//! for the session to write.
//!
//! Architecture invariant: at most one result per conversation is in flight on a connection, and
//! the session finishes every result in flight before it handles any other frame, so an agent's
//! frames commit in the order it sent them within each conversation.

use std::collections::HashMap;
use std::sync::Arc;

use converger_protocol::{Ack, ErrorCode, ErrorFrame, TurnNumber};
use converger_store::bus::Origin;
use converger_store::{AnswerOutcome, StoreError, TurnAnswer};
use serde_json::{Value, json};
use tokio::task::{Id, JoinSet};
use uuid::Uuid;

use crate::publish;
use crate::state::AppState;

/// Results committing at once on one connection; the next one waits for a slot.
pub(super) const MAX_IN_FLIGHT: usize = 64;

/// The results of one connection that are committing now.
#[derive(Default)]
pub(super) struct ResultsInFlight {
    tasks: JoinSet<(Uuid, Value)>,
    /// Which conversation each task answers, so a panicked task still frees its conversation.
    conversations: HashMap<Id, Uuid>,
}

impl ResultsInFlight {
    /// True when nothing is committing.
    pub(super) fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// True when no new result may start before an earlier one finishes: the connection is at
    /// its limit, or this conversation already has a result committing.
    pub(super) fn must_wait(&self, conversation_id: Uuid) -> bool {
        self.tasks.len() >= MAX_IN_FLIGHT
            || self.conversations.values().any(|id| *id == conversation_id)
    }

    /// Starts committing `answer`; its ack or refusal comes out of [`Self::next_reply`].
    pub(super) fn start(
        &mut self,
        state: &AppState,
        channel_id: Uuid,
        client_id: Option<String>,
        answer: TurnAnswer,
        origin: Origin,
    ) {
        let conversation_id = answer.conversation_id;
        let state = state.clone();
        let handle = self.tasks.spawn(async move {
            let outcome = crate::answers::commit(&state, channel_id, &answer, origin).await;
            let reply = reply_to(&state, channel_id, &answer, client_id, outcome);
            (answer.conversation_id, reply)
        });
        self.conversations.insert(handle.id(), conversation_id);
    }

    /// The next finished result's conversation and its ack or refusal; `None` when nothing is
    /// in flight.
    pub(super) async fn next_reply(&mut self) -> Option<(Uuid, Value)> {
        loop {
            let (id, finished) = match self.tasks.join_next_with_id().await? {
                Ok((id, reply)) => (id, Some(reply)),
                Err(error) => (error.id(), None),
            };
            self.conversations.remove(&id);
            match finished {
                Some(reply) => return Some(reply),
                // A panicked commit: its agent resends after no ack (the registry keeps one answer).
                None => tracing::error!("turn result task failed"),
            }
        }
    }

    /// Lets the commits in flight finish without anyone to ack them (the connection is gone):
    /// their frames still reach subscribers, and the agent's resend is answered as a duplicate.
    pub(super) fn detach(&mut self) {
        self.tasks.detach_all();
        self.conversations.clear();
    }
}

/// Publishes a committed answer and returns the frame that answers the result: an ack (also for
/// a resend, marked `duplicate`) or a refusal. One place decides what each outcome answers.
fn reply_to(
    state: &AppState,
    channel_id: Uuid,
    answer: &TurnAnswer,
    client_id: Option<String>,
    outcome: Result<AnswerOutcome, StoreError>,
) -> Value {
    let conversation_id = answer.conversation_id;
    let turn = TurnNumber {
        seq: answer.seq,
        revision: answer.revision,
    };
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(error) => {
            tracing::error!(%error, %conversation_id, "turn result not stored");
            let code = crate::error::write_error_code(&error);
            let message = match code {
                ErrorCode::InvalidMessage => "the result cannot be stored",
                _ => "the result could not be confirmed; retry",
            };
            return ErrorFrame {
                client_id,
                ..crate::error::write_error_frame(&error, message)
            }
            .to_json();
        }
    };
    let (label, answered) = match outcome {
        AnswerOutcome::Committed {
            activities,
            completed_at,
        } => {
            let ids = activities
                .iter()
                .map(|activity| activity.id.clone())
                .collect();
            let seqs = activities.iter().map(|activity| activity.seq).collect();
            publish::committed(
                state,
                channel_id,
                conversation_id,
                activities.into_iter().map(Arc::new),
            );
            ("committed", Ok((ids, seqs, completed_at, false)))
        }
        AnswerOutcome::Duplicate {
            ids,
            seqs,
            completed_at,
        } => ("duplicate", Ok((ids, seqs, completed_at, true))),
        AnswerOutcome::Conflict { seqs } => (
            "conflict",
            Err((
                ErrorCode::TurnConflict,
                "another result is committed for this turn",
                json!({"seqs": seqs}),
            )),
        ),
        AnswerOutcome::Superseded { latest } => (
            "superseded",
            Err((
                ErrorCode::TurnSuperseded,
                "a newer revision of this turn exists",
                json!({"revision": latest}),
            )),
        ),
        AnswerOutcome::LeaseLost { current } => (
            "lease_lost",
            Err((
                ErrorCode::LeaseLost,
                "the turn was claimed again since this delivery",
                json!({"fence": current}),
            )),
        ),
        AnswerOutcome::StaleRuntime { current } => (
            "stale_runtime",
            Err((
                ErrorCode::StaleRuntime,
                "runtime.version is not the current one",
                json!({"version": current}),
            )),
        ),
        AnswerOutcome::Closed => (
            "conversation_closed",
            Err((
                ErrorCode::ConversationClosed,
                "the conversation is closed",
                json!({"turn": {"seq": turn.seq, "revision": turn.revision}}),
            )),
        ),
        AnswerOutcome::Stopped => (
            "turn_stopped",
            Err((
                ErrorCode::TurnStopped,
                "the turn was stopped and settled without this answer",
                json!({"turn": {"seq": turn.seq, "revision": turn.revision}}),
            )),
        ),
        AnswerOutcome::NoSuchTurn => (
            "no_such_turn",
            Err((
                ErrorCode::BadRequest,
                "no such turn",
                json!({"turn": {"seq": turn.seq, "revision": turn.revision}}),
            )),
        ),
    };
    metrics::counter!("converger_turn_results_total", "outcome" => label).increment(1);
    let (ids, seqs, completed_at, duplicate): (Vec<String>, Vec<i64>, _, bool) = match answered {
        Ok(acked) => acked,
        Err((code, message, details)) => {
            return ErrorFrame {
                client_id,
                frame_type: Some("turnResult".into()),
                details: Some(details),
                ..ErrorFrame::new(code, message)
            }
            .to_json();
        }
    };
    // A resend gets the same ack as the first send, plus `duplicate`.
    Ack {
        client_id: client_id.as_deref(),
        turn: Some(turn),
        ids: Some(&ids),
        seqs: Some(&seqs),
        timestamp: Some(completed_at.timestamp_millis()),
        duplicate,
        ..Ack::default()
    }
    .to_value()
}
