//! Committing an agent's answer to a turn, the same for a WebSocket agent's `turnResult` and an
//! HTTP agent's run: the turn's open streams are flushed to every node first and ended by the
//! outcome, and end users are told when the answer itself was refused. The caller publishes
//! the committed frames and answers the agent.

use converger_core::streams::StreamTurn;
use converger_protocol::{ErrorCode, TurnNumber, answer_refused};
use converger_store::bus::Origin;
use converger_store::{AnswerOutcome, StoreError, TurnAnswer};
use uuid::Uuid;

use crate::publish::{Audience, Transient};
use crate::state::AppState;

/// Commits `answer` (conversation, seq, revision: one result per turn) and settles the turn's
/// open streams by the outcome.
pub(crate) async fn commit(
    state: &AppState,
    channel_id: Uuid,
    answer: &TurnAnswer,
    origin: Origin,
) -> Result<AnswerOutcome, StoreError> {
    let conversation_id = answer.conversation_id;
    let streamed = StreamTurn {
        seq: answer.seq,
        revision: answer.revision,
    };
    let streaming = state.streams.turn_is_streaming(conversation_id, streamed);
    if streaming {
        // Every node sees the chunks before the commit that ends them.
        state.streams.flush().await;
    }
    let outcome = state.store.commit_answer(answer).await;
    if matches!(outcome, Ok(AnswerOutcome::StaleRuntime { .. })) {
        // The runtime moved without this node hearing of it (an answer without frames
        // announces nothing): the agent's next delivery or `sync` reads it (ADR 0039).
        state.runtimes.forget(conversation_id);
    }
    let refused_input = matches!(&outcome, Err(error) if error.is_refused_input());
    let settled = stream_settlement(&outcome);
    if streaming && let Some(aborted) = settled {
        state
            .streams
            .settle_turn(&state.hub, conversation_id, streamed, aborted);
    }
    if refused_input {
        // No valid answer follows a refused one by itself: the end users are told.
        let turn = TurnNumber {
            seq: answer.seq,
            revision: answer.revision,
        };
        Transient {
            channel_id,
            conversation_id,
            frame: answer_refused(ErrorCode::InvalidMessage, "turnResult", Some(turn)),
            origin,
            audience: Audience::EndUsers,
        }
        .publish(state)
        .await;
    }
    outcome
}

/// How a result's outcome ends the turn's open streams: `Some(None)` committed, `Some(reason)`
/// aborted, `None` left open (the agent may retry: a stale runtime, an unconfirmed commit).
pub(crate) fn stream_settlement(
    outcome: &Result<AnswerOutcome, StoreError>,
) -> Option<Option<&'static str>> {
    match outcome {
        Ok(AnswerOutcome::Committed { .. } | AnswerOutcome::Duplicate { .. }) => Some(None),
        Ok(AnswerOutcome::Conflict { .. }) => Some(Some("conflict")),
        Ok(AnswerOutcome::Superseded { .. }) => Some(Some("superseded")),
        Ok(AnswerOutcome::LeaseLost { .. }) => Some(Some("lease_lost")),
        Ok(AnswerOutcome::NoSuchTurn) => Some(Some("no_such_turn")),
        Ok(AnswerOutcome::Closed) => Some(Some("conversation_closed")),
        Ok(AnswerOutcome::Stopped) => Some(Some("stopped")),
        Ok(AnswerOutcome::StaleRuntime { .. }) => None,
        Err(error) if error.is_refused_input() => Some(Some("refused")),
        Err(_) => None,
    }
}
