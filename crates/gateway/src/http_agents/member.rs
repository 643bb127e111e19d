//! An HTTP agent group's member on this node: it joins the channel's actor and gossip like an
//! agent connection, so the owner of each turn is chosen by the same rendezvous over the live
//! members with their eligibility times, one member per node; each turn it owns is called in
//! a task of its own, aborted by the turn's `cancel` and when the member leaves.

use std::collections::HashMap;
use std::sync::Arc;

use converger_cluster::AgentRecord;
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, Id, JoinSet};
use uuid::Uuid;

use super::call::{Caller, DeliveredTurn};
use crate::actors::{ActorMessage, Delivery};
use crate::ws::agent::membership::Announced;

/// A turn revision of a conversation.
type TurnKey = (Uuid, i64, i32);

/// The member's task; dropping it leaves the group (and aborts the calls in flight, whose
/// turns pass to the next owner).
pub(super) struct Member {
    task: tokio::task::JoinHandle<()>,
}

impl Member {
    /// Joins the group and serves the turns it is handed.
    pub(super) fn start(caller: Caller) -> Member {
        Member {
            task: tokio::spawn(serve(Arc::new(caller))),
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sends the actor a leave when the member's task ends, however it ends.
struct Joined {
    inbox: mpsc::UnboundedSender<ActorMessage>,
    connection_id: String,
}

impl Drop for Joined {
    fn drop(&mut self) {
        let _ = self.inbox.send(ActorMessage::Leave {
            connection_id: self.connection_id.clone(),
        });
    }
}

async fn serve(caller: Arc<Caller>) {
    let state = &caller.state;
    let agent = &caller.agent;
    let since_ms = chrono::Utc::now().timestamp_millis()
        + i64::try_from(state.config.group_settle_ms).unwrap_or(i64::MAX);
    let (deliveries_sender, mut deliveries) = mpsc::unbounded_channel::<Delivery>();
    // Counted as an agent of the channel here: other nodes' commits of the channel are read
    // for this node's actor only while one is.
    let _counted = state.hub.agent_connected(agent.channel_id);
    let inbox = state
        .actors
        .inbox(agent.channel_id, &state.hub, &state.store);
    let _ = inbox.send(ActorMessage::Join {
        connection_id: caller.connection.clone(),
        group: Some(agent.group_name.clone()),
        since_ms,
        sender_id: agent.group_name.clone(),
        lease: None,
        deliveries: deliveries_sender,
    });
    let _joined = Joined {
        inbox,
        connection_id: caller.connection.clone(),
    };
    let _announced = Announced::new(
        &state.cluster,
        AgentRecord {
            channel_id: agent.channel_id,
            connection_id: caller.connection.clone(),
            group: Some(agent.group_name.clone()),
            since_ms,
        },
    );
    tracing::info!(
        channel_id = %agent.channel_id,
        group = %agent.group_name,
        url = %super::url_label(&agent.url),
        "http agent member joined"
    );
    let mut calls = Calls::default();
    loop {
        tokio::select! {
            delivery = deliveries.recv() => match delivery {
                Some(Delivery::Turn { activity, turn }) => {
                    let key = (activity.conversation_id, turn.seq, turn.revision);
                    calls.start(key, caller.clone().serve(DeliveredTurn { activity, turn }));
                }
                Some(Delivery::Frame(text)) => {
                    if let Some(key) = cancelled_turn(text.as_str()) {
                        calls.cancel(key);
                    }
                }
                None => return,
            },
            Some(finished) = calls.tasks.join_next_with_id(), if !calls.tasks.is_empty() => {
                let id = match finished {
                    Ok((id, ())) => id,
                    Err(error) => error.id(),
                };
                calls.finished(id);
            }
        }
    }
}

/// The calls in flight, by turn.
#[derive(Default)]
struct Calls {
    tasks: JoinSet<()>,
    by_turn: HashMap<TurnKey, AbortHandle>,
    turns: HashMap<Id, TurnKey>,
}

impl Calls {
    fn start(&mut self, key: TurnKey, call: impl Future<Output = ()> + Send + 'static) {
        // A turn handed over twice (a redelivery) is called once.
        if self.by_turn.contains_key(&key) {
            return;
        }
        let handle = self.tasks.spawn(call);
        self.turns.insert(handle.id(), key);
        self.by_turn.insert(key, handle);
    }

    /// The turn was stopped: its call ends here (the stop settles the turn once, with what was
    /// streamed).
    fn cancel(&mut self, key: TurnKey) {
        if let Some(handle) = self.by_turn.remove(&key) {
            self.turns.remove(&handle.id());
            handle.abort();
        }
    }

    fn finished(&mut self, id: Id) {
        if let Some(key) = self.turns.remove(&id) {
            self.by_turn.remove(&key);
        }
    }
}

/// The turn of an enveloped `cancel` (docs/protocol.md §4.10); `None` for any other frame.
fn cancelled_turn(text: &str) -> Option<TurnKey> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Envelope {
        conversation_id: Uuid,
        frame: Cancel,
    }
    #[derive(Deserialize)]
    struct Cancel {
        #[serde(rename = "type")]
        kind: String,
        turn: Turn,
    }
    #[derive(Deserialize)]
    struct Turn {
        seq: i64,
        #[serde(default)]
        revision: i32,
    }
    let envelope: Envelope = serde_json::from_str(text).ok()?;
    (envelope.frame.kind == "cancel").then_some((
        envelope.conversation_id,
        envelope.frame.turn.seq,
        envelope.frame.turn.revision,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancel_names_its_turn() {
        let id = Uuid::now_v7();
        let cancel = format!(
            r#"{{"conversationId":"{id}","frame":{{"type":"cancel","turn":{{"seq":7,"revision":1,"key":"k"}},"reason":"stopped"}}}}"#
        );
        assert_eq!(cancelled_turn(&cancel), Some((id, 7, 1)));
        let other = format!(r#"{{"conversationId":"{id}","frame":{{"type":"text","data":{{}}}}}}"#);
        assert_eq!(cancelled_turn(&other), None);
    }
}
