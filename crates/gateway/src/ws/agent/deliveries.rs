//! What the channel actor hands this connection, sent in order: frames ready to go, and user
//! turns, which are serialized here with their `meta` and the conversation's runtime (from
//! the node's memory where it knows one new enough, ADR 0039).

use std::collections::HashMap;
use std::time::Duration;

use converger_protocol::{ChannelRef, RuntimeRef, TurnMeta, Viewer, delivered_turn};
use tokio::sync::mpsc;
use uuid::Uuid;

use super::AgentSession;
use crate::actors::Delivery;
use crate::runtimes::{DeliveredAt, Runtime, delivered_at};
use crate::wire;
use crate::ws::session::{Ending, internal_close};

/// Deliveries sent together, with at most one runtime read for the user turns among them.
const DELIVERY_BATCH: usize = 256;

/// Runtime reads tried before a connection gives up on its deliveries.
const RUNTIME_READ_ATTEMPTS: u32 = 3;

/// Wait between runtime reads.
const RUNTIME_READ_BACKOFF: Duration = Duration::from_millis(200);

impl AgentSession<'_> {
    /// Sends `first` and whatever else the actor has queued (up to [`DELIVERY_BATCH`]), in
    /// order; the user turns among them get their conversations' runtimes, as the node knows
    /// them or read in one query, just before they go out.
    pub(super) async fn deliver(
        &mut self,
        first: Delivery,
        queue: &mut mpsc::UnboundedReceiver<Delivery>,
    ) -> Result<(), Ending> {
        // Never more than the outbound queue holds, so a healthy agent is not taken for a slow one.
        let most = DELIVERY_BATCH.min(self.state.config.limits.outbound_queue_frames.max(1));
        let mut batch = vec![first];
        while batch.len() < most {
            let Ok(delivery) = queue.try_recv() else {
                break;
            };
            batch.push(delivery);
        }
        let turns: Vec<DeliveredAt> = batch
            .iter()
            .filter_map(|delivery| match delivery {
                Delivery::Turn { activity, turn } => Some(delivered_at(activity, turn)),
                Delivery::Frame(_) => None,
            })
            .collect();
        self.remember_delivered(turns.iter().map(|turn| turn.conversation_id));
        let runtimes = self.runtimes_of(&turns).await?;
        let channel_id = self.channel_id.to_string();
        for delivery in batch {
            let text = match delivery {
                Delivery::Frame(text) => text,
                Delivery::Turn { activity, turn } => {
                    let Some((version, state)) = runtimes.get(&activity.conversation_id) else {
                        // `runtimes_of` answers for every conversation it is given.
                        return Err(internal_close(self.outbound));
                    };
                    let meta = TurnMeta {
                        channel: ChannelRef { id: &channel_id },
                        participant: wire::sender(&activity),
                        turn: &turn,
                        runtime: Some(RuntimeRef {
                            version: *version,
                            state,
                        }),
                        client: activity.extra.as_ref().and_then(|extra| extra.get("meta")),
                    };
                    let conversation = activity.conversation_id.to_string();
                    let frame = wire::persistent(&activity).view(Viewer::Agent);
                    delivered_turn(&conversation, frame, &meta).into()
                }
            };
            self.push(text)?;
        }
        Ok(())
    }

    /// The runtimes `turns` are delivered with (ADR 0039), from memory where the node knows
    /// them, else read, tried a few times; if the database stays unreachable the connection
    /// closes, and the turns it was passed are taken over when it leaves.
    async fn runtimes_of(&self, turns: &[DeliveredAt]) -> Result<HashMap<Uuid, Runtime>, Ending> {
        if turns.is_empty() {
            return Ok(HashMap::new());
        }
        let mut attempt = 1;
        loop {
            match self
                .state
                .runtimes
                .for_turns(&self.state.store, turns)
                .await
            {
                Ok(runtimes) => return Ok(runtimes),
                Err(error) if attempt < RUNTIME_READ_ATTEMPTS => {
                    tracing::warn!(%error, attempt, "delivery: runtimes unreadable; retrying");
                    tokio::time::sleep(RUNTIME_READ_BACKOFF).await;
                    attempt += 1;
                }
                Err(error) => {
                    tracing::error!(%error, "delivery: runtimes unreadable; closing the connection");
                    return Err(internal_close(self.outbound));
                }
            }
        }
    }
}
