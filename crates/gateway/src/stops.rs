//! Stopping a running turn (ADR 0028), whoever asks (a `stop` frame, the mekik `abort`, REST)
//! and on whichever node: the store marks the turn `stopping` under the conversation's row lock;
//! every node then ends the streams its agents write for it and tells its owners (`cancel`);
//! after `turns.stop_grace_ms` the node that stopped it settles it, unless the agent answered
//! first. A sweep settles the stops of nodes that died within their grace period.

use std::sync::Arc;
use std::time::Duration;

use converger_core::streams::StreamTurn;
use converger_protocol::StopReason;
use converger_store::bus::TurnStop;
use converger_store::{Settlement, StopOutcome, StoppedAnswer, StoppedTurn, StoreError};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::hub::{Hub, HubEvent};
use crate::state::AppState;
use crate::streams::LiveStreams;

/// How much longer than the grace period a stop waits before any node's sweep settles it: the
/// stopping node's own settlement (which holds the streamed text) comes first.
const SWEEP_SLACK: Duration = Duration::from_secs(3);

/// Stops settled per sweep at most.
const SWEEP_BATCH: i64 = 100;

/// Stops the turn at `seq`, or the conversation's latest unanswered one. A turn that was running
/// is stopping when this returns: its owners are being told, and it settles once.
pub(crate) async fn stop(
    state: &AppState,
    conversation_id: Uuid,
    seq: Option<i64>,
    reason: StopReason,
) -> Result<StopOutcome, StoreError> {
    let outcome = state
        .store
        .request_stop(conversation_id, seq, reason.as_str())
        .await?;
    let StopOutcome::Stopping {
        turn,
        earlier,
        channel_id,
    } = &outcome
    else {
        return Ok(outcome);
    };
    for stopped in earlier.iter().chain([turn]) {
        announce(state, *channel_id, conversation_id, *stopped, reason).await;
    }
    Ok(outcome)
}

/// A turn the store just marked stopping: applied here, published to the other nodes, and
/// settled after the grace period unless its agent answers first.
pub(crate) async fn announce(
    state: &AppState,
    channel_id: Uuid,
    conversation_id: Uuid,
    turn: StoppedTurn,
    reason: StopReason,
) {
    metrics::counter!("converger_turns_stopped_total", "reason" => reason.as_str()).increment(1);
    tracing::info!(%conversation_id, seq = turn.seq, revision = turn.revision, reason = reason.as_str(), "turn stopped");
    let stop = turn_stop(state, channel_id, conversation_id, turn, reason);
    spread(state, &stop).await;
    let grace = Duration::from_millis(state.config.turns.stop_grace_ms);
    let state = state.clone();
    tokio::spawn(async move {
        tokio::time::sleep(grace).await;
        settle(&state, &stop).await;
    });
}

/// A close settled a waiting turn (ADR 0023): its agents are told (`cancel`, reason
/// `conversation_closed`) and its streams end, on every node. Nothing is settled here: the
/// close did that, and an answer is refused with `conversation_closed`.
pub(crate) async fn tell_closed(
    state: &AppState,
    channel_id: Uuid,
    conversation_id: Uuid,
    turn: StoppedTurn,
) {
    let stop = turn_stop(
        state,
        channel_id,
        conversation_id,
        turn,
        StopReason::ConversationClosed,
    );
    spread(state, &stop).await;
}

/// Applies a stop this node made here and publishes it to the other nodes. A lost publish
/// leaves their agents untold; the settlement still comes, and ends what is open then.
async fn spread(state: &AppState, stop: &TurnStop) {
    apply(&state.hub, &state.streams, stop);
    if let Err(error) = state.bus.turn_stop(stop).await {
        tracing::warn!(%error, conversation_id = %stop.conversation_id, seq = stop.seq, "stop not announced to the other nodes");
    }
}

/// The bus event of a stop this node made.
fn turn_stop(
    state: &AppState,
    channel_id: Uuid,
    conversation_id: Uuid,
    turn: StoppedTurn,
    reason: StopReason,
) -> TurnStop {
    TurnStop {
        node: state.hub.node_id().to_owned(),
        channel_id,
        conversation_id,
        seq: turn.seq,
        revision: turn.revision,
        at_ms: turn.at.timestamp_millis(),
        revision_at_ms: Some(turn.opened_at.timestamp_millis()),
        reason: reason.as_str().to_owned(),
    }
}

/// What every node does with a stop (this one at once, the others from the bus): the streams
/// its agents write for the turn end (`stopped`), and its channel actor tells the owners.
pub(crate) fn apply(hub: &Hub, streams: &LiveStreams, stop: &TurnStop) {
    let turn = StreamTurn {
        seq: stop.seq,
        revision: stop.revision,
    };
    streams.stop_turn(hub, stop.conversation_id, turn, &stop.reason, false);
    hub.publish_to_agents(
        stop.channel_id,
        stop.conversation_id,
        HubEvent::TurnStopped(Arc::new(stop.clone())),
    );
}

/// Settles a stopped turn that no answer completed: the text its stream had when it was
/// stopped (as this node holds it), else an empty answer, committed as the turn's result with
/// status `stopped`.
async fn settle(state: &AppState, stop: &TurnStop) {
    let (store, streams) = (&state.store, &state.streams);
    let turn = StreamTurn {
        seq: stop.seq,
        revision: stop.revision,
    };
    // A stream its agent opened as the stop committed (it passed the opening check before)
    // is still open: it ends now, here and on every node, with what it had.
    streams.stop_turn(&state.hub, stop.conversation_id, turn, &stop.reason, true);
    let streamed = match streams.take_stopped(stop.conversation_id, turn) {
        Some(streamed) => Some(streamed),
        // On NATS this node holds only the streams of conversations it follows: the node whose
        // agent streamed kept the text.
        None => {
            let replies = state
                .bus
                .ask_stopped_stream(stop.conversation_id, turn)
                .await;
            LiveStreams::stopped_in(&replies, turn)
        }
    };
    let answer = StoppedAnswer {
        stream_id: streamed.as_ref().map(|text| text.stream_id.clone()),
        text: streamed.map(|text| text.text).unwrap_or_default(),
        reason: stop.reason.clone(),
    };
    match store
        .settle_stop(stop.conversation_id, stop.seq, stop.revision, &answer)
        .await
    {
        Ok(Settlement::Settled(activity)) => {
            metrics::counter!("converger_stops_settled_total").increment(1);
            tracing::info!(conversation_id = %stop.conversation_id, seq = stop.seq, chars = answer.text.len(), "stopped turn settled by the gateway");
            crate::publish::committed(
                state,
                stop.channel_id,
                stop.conversation_id,
                [Arc::new(*activity)],
            );
        }
        // The agent answered within the grace period, or another node settled it.
        Ok(Settlement::NotStopping) => {}
        // The sweep settles it later, on this node or another.
        Err(error) => {
            tracing::warn!(%error, conversation_id = %stop.conversation_id, seq = stop.seq, "stopped turn not settled; the sweep will")
        }
    }
}

/// Starts the sweep that settles the stops whose node did not (it died within the grace
/// period): every grace period, those older than it plus a margin, with what this node holds
/// of their streams.
pub(crate) fn spawn_sweep(state: AppState) -> JoinHandle<()> {
    let grace = Duration::from_millis(state.config.turns.stop_grace_ms);
    let every = grace.max(Duration::from_secs(1));
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let overdue = match state
                .store
                .overdue_stops(grace + SWEEP_SLACK, SWEEP_BATCH)
                .await
            {
                Ok(overdue) => overdue,
                Err(error) => {
                    tracing::debug!(%error, "stop sweep: overdue stops unreadable");
                    continue;
                }
            };
            for overdue in overdue {
                let channel_id = match state.store.conversation(overdue.conversation_id).await {
                    Ok(Some(conversation)) => conversation.channel_id,
                    Ok(None) => continue,
                    Err(error) => {
                        tracing::debug!(%error, "stop sweep: conversation unreadable");
                        continue;
                    }
                };
                let stop = TurnStop {
                    node: state.hub.node_id().to_owned(),
                    channel_id,
                    conversation_id: overdue.conversation_id,
                    seq: overdue.seq,
                    revision: overdue.revision,
                    at_ms: 0,
                    revision_at_ms: None,
                    reason: overdue.reason,
                };
                settle(&state, &stop).await;
            }
        }
    })
}
