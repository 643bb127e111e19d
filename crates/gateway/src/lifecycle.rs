//! Closing and reopening conversations (ADR 0023): the store changes the status and appends
//! the `conversationUpdate` frame in one statement; this node publishes the frame to its own
//! sessions and agents at once, the others hear it from the commit's notification. The expiry
//! sweep closes idle conversations, one node at a time; every node (this one too) hears those
//! closes from their notifications.

use std::sync::Arc;
use std::time::Duration;

use converger_store::{EXPIRED_REASON, StatusChange, StoreError, Transition};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::state::AppState;

/// Closes or reopens a conversation and publishes the appended frame; `None` when there is no
/// such conversation. A repeat (the status is already the asked one) writes nothing.
pub(crate) async fn change_status(
    state: &AppState,
    conversation_id: Uuid,
    change: StatusChange,
    reason: &str,
) -> Result<Option<Transition>, StoreError> {
    let transition = state
        .store
        .change_status(conversation_id, change, reason)
        .await?;
    if let Some(Transition {
        conversation,
        frame: Some(frame),
        settled,
    }) = &transition
    {
        tracing::info!(%conversation_id, status = change.to(), reason, "conversation status changed");
        crate::publish::committed(
            state,
            conversation.channel_id,
            conversation_id,
            [Arc::new(frame.clone())],
        );
        for turn in settled {
            crate::stops::tell_closed(state, conversation.channel_id, conversation_id, *turn).await;
        }
    }
    Ok(transition)
}

/// Starts the sweep that closes idle conversations, unless `conversations.idle_close_secs` is 0.
pub(crate) fn spawn_expiry(state: AppState) -> Option<JoinHandle<()>> {
    let settings = state.config.conversations.clone();
    if settings.idle_close_secs == 0 {
        return None;
    }
    Some(tokio::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(settings.expiry_sweep_secs));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            metrics::counter!("converger_expiry_sweeps_total").increment(1);
            // Batch after batch while full ones come back: a backlog drains in one sweep.
            loop {
                let batch = i64::from(settings.expiry_batch);
                let closed = match state
                    .store
                    .expire_idle(settings.idle_close_secs, batch)
                    .await
                {
                    Ok(closed) => closed,
                    Err(error) => {
                        tracing::warn!(%error, "expiry sweep failed");
                        break;
                    }
                };
                // Every node, this one included, hears the closes from their notifications;
                // the agents of the turns they settled are told here.
                for expired in &closed {
                    for turn in &expired.settled {
                        crate::stops::tell_closed(
                            &state,
                            expired.channel_id,
                            expired.frame.conversation_id,
                            *turn,
                        )
                        .await;
                    }
                }
                let count = closed.len();
                if count > 0 {
                    metrics::counter!("converger_conversations_expired_total")
                        .increment(count as u64);
                    tracing::info!(
                        closed = count,
                        reason = EXPIRED_REASON,
                        "idle conversations closed"
                    );
                }
                if (count as i64) < batch {
                    break;
                }
            }
        }
    }))
}
