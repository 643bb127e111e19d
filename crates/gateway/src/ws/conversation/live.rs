//! Live events of the conversation, and the replays that fill what the connection has not
//! seen: at welcome, on `sync`, and over a gap the live feed left (the replay hold-back of
//! `converger_core::replay`).

use std::sync::Arc;

use converger_core::replay::{LiveDecision, ReplayPlan};
use converger_core::transcript::ChatView;
use converger_protocol::{ErrorCode, ErrorFrame, USER_ROLE, replay_truncated};
use converger_store::Activity;
use converger_store::bus::Origin;
use serde_json::Value;
use tokio::sync::broadcast;

use super::Session;
use crate::hub::{EndUserViews, HubEvent};
use crate::wire;
use crate::ws::session::{Ending, internal_close};

impl Session<'_> {
    /// Replays a plan from the database in batches, then `replayTruncated` when it was cut.
    pub(super) async fn replay(&mut self, plan: ReplayPlan) -> Result<(), Ending> {
        self.push_replay(plan.after, plan.upto).await?;
        if plan.truncated && self.is_converger() {
            self.push(replay_truncated(plan.upto, plan.head), false)?;
        }
        Ok(())
    }

    /// A replay the client asked for (welcome, `sync`): the chat view for a mekik client, which
    /// cannot collapse revisions (ADR 0018), the whole transcript for the converger profile.
    async fn push_replay(&mut self, after: u64, upto: u64) -> Result<(), Ending> {
        if after >= upto || self.is_converger() {
            return self.push_range(after, upto, false, None).await;
        }
        let view = match self.state.store.revised_turns(self.conversation_id).await {
            Ok(records) => wire::chat_view(records),
            Err(error) => {
                tracing::error!(%error, conversation_id = %self.conversation_id, "replay read failed");
                return Err(internal_close(self.outbound));
            }
        };
        self.push_range(after, upto, false, Some(&view)).await
    }

    /// Pushes the stored frames `after + 1 ..= upto`, skipping this connection's own sends when
    /// `skip_own`, and showing them as `view` shows them when given. Waits for queue space
    /// instead of failing: a replay is a known, finite backlog.
    async fn push_range(
        &mut self,
        after: u64,
        upto: u64,
        skip_own: bool,
        view: Option<&ChatView>,
    ) -> Result<(), Ending> {
        let batch = self.state.config.limits.replay_batch as i64;
        let mut next_after = after as i64;
        let upto = upto as i64;
        while next_after < upto {
            let limit = batch.min(upto - next_after);
            let rows = self
                .state
                .store
                .list_activities(self.conversation_id, next_after, limit)
                .await
                .map_err(|error| {
                    tracing::error!(%error, conversation_id = %self.conversation_id, "replay read failed");
                    internal_close(self.outbound)
                })?;
            let Some(last) = rows.last().map(|row| row.seq) else {
                break;
            };
            for row in rows {
                if skip_own && self.own_seqs.contains(&row.seq) {
                    continue;
                }
                let frame = match view {
                    Some(view) => match wire::in_chat_view(&row, view) {
                        Some(frame) => frame,
                        None => continue,
                    },
                    None => wire::persistent(&row),
                };
                let text = self.replayed(frame).await?;
                self.push_waiting(text).await?;
            }
            next_after = last;
        }
        Ok(())
    }

    pub(super) async fn on_live(
        &mut self,
        event: Result<HubEvent, broadcast::error::RecvError>,
    ) -> Result<(), Ending> {
        match event {
            Ok(HubEvent::Committed {
                seq,
                activity,
                views,
            }) => self.on_committed(seq, activity, &views).await,
            Ok(HubEvent::Regenerated { .. } | HubEvent::TurnStopped(_)) => Ok(()),
            Ok(HubEvent::Stream(event)) => self.on_stream(&event).await,
            Ok(HubEvent::Transient { frame, origin }) => {
                self.on_transient(&frame, origin.as_deref())
            }
            // Fell behind the hub's buffer: whatever was missed is read back from the database.
            Err(broadcast::error::RecvError::Lagged(_)) => {
                // Streams first: their chunks are in this node's memory, not the database.
                self.catch_up_streams().await?;
                let head = match self.state.store.conversation(self.conversation_id).await {
                    Ok(Some(conversation)) => conversation.last_seq,
                    _ => return Ok(()),
                };
                self.on_committed(head, None, &EndUserViews::default())
                    .await
            }
            Err(broadcast::error::RecvError::Closed) => Err(Ending::Gone),
        }
    }

    async fn on_committed(
        &mut self,
        seq: i64,
        activity: Option<Arc<Activity>>,
        views: &EndUserViews,
    ) -> Result<(), Ending> {
        let Ok(seq_u) = u64::try_from(seq) else {
            return Ok(());
        };
        match self.cursor.on_live(seq_u) {
            LiveDecision::Drop => {}
            LiveDecision::Send => {
                if !self.own_seqs.contains(&seq) {
                    match activity {
                        Some(activity) => {
                            let text = views.render(&activity, &self.user_id, self.profile);
                            self.push(text, false)?;
                        }
                        None => self.push_range(seq_u - 1, seq_u, true, None).await?,
                    }
                }
                self.cursor.advance_to(seq_u);
            }
            LiveDecision::FillGap { after, upto } => {
                self.push_range(after, upto, true, None).await?;
                self.cursor.advance_to(upto);
            }
        }
        let passed = self.cursor.last_sent() as i64;
        self.own_seqs.retain(|own| *own > passed);
        Ok(())
    }

    fn on_transient(&mut self, frame: &Value, origin: Option<&Origin>) -> Result<(), Ending> {
        let kind = frame
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if let Some(origin) = origin {
            if origin.connection == self.connection_id.to_string() {
                return Ok(());
            }
            // Typing and presence are for the other participants, never the author's own tabs
            // (a mekik client shows any typing as the bot typing).
            if matches!(kind, "typing" | "presence")
                && origin.id == self.user_id
                && origin.role == USER_ROLE
            {
                return Ok(());
            }
        }
        if !self.profile.receives_transient(kind) {
            return Ok(());
        }
        // Errors relayed from agents answer the user's frame: never dropped under pressure.
        let droppable = kind != "error";
        self.push(frame.to_string(), droppable)
    }

    pub(super) async fn on_sync(&mut self, watermark: u64) -> Result<(), Ending> {
        let head = match self.state.store.conversation(self.conversation_id).await {
            Ok(Some(conversation)) => u64::try_from(conversation.last_seq).unwrap_or(0),
            Ok(None) => return Err(internal_close(self.outbound)),
            Err(error) => {
                tracing::warn!(%error, "sync: cannot read the head");
                return self.push_error(crate::error::error_frame(
                    crate::error::failure_code(&error),
                    "try again",
                ));
            }
        };
        if watermark > head {
            return self.push_error(ErrorFrame::new(
                ErrorCode::InvalidWatermark,
                "watermark is above the conversation head",
            ));
        }
        let cap = super::replay_cap(self.state, self.profile);
        let plan = self.cursor.plan_sync(watermark, head, cap);
        self.push_replay(plan.after, plan.upto).await?;
        self.cursor.advance_to(plan.upto);
        if plan.truncated && self.is_converger() {
            self.push(replay_truncated(plan.upto, plan.head), false)?;
        }
        Ok(())
    }
}
