//! The agent of `turns`: a group member that answers every turn as soon as it arrives, without
//! waiting for the previous answer's ack, as an agent serving many conversations at once does.
//! (The client crate's `Agent::reply` waits for each ack, which would measure the agent, not
//! the gateway.)

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use converger_client::outgoing;
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;
use uuid::Uuid;

use crate::frame_views::AgentMessage;

/// When each turn reached an agent, by (conversation, seq).
pub type Arrivals = Arc<Mutex<HashMap<(Uuid, i64), Instant>>>;

/// The agents' results the gateway refused, by error code.
pub type Refusals = Arc<Mutex<BTreeMap<String, u64>>>;

/// Connects as a member of `group`, reports its `since` (ms) from the welcome on `eligible`,
/// and answers every delivered turn with one text frame until the connection ends, with a
/// runtime write when `runtime_writes` (the delivered state's `count` plus one, against the
/// delivered version). Refusals are counted by code on `refusals` (a refused result also
/// shows as a user who never gets an answer).
pub async fn serve(
    url: String,
    token: String,
    group: &str,
    runtime_writes: bool,
    arrivals: Arrivals,
    refusals: Refusals,
    eligible: tokio::sync::oneshot::Sender<i64>,
) -> anyhow::Result<()> {
    let mut eligible = Some(eligible);
    let (mut socket, _) = tokio::time::timeout(
        Duration::from_secs(10),
        tokio_tungstenite::connect_async_with_config(
            url,
            Some(converger_client::socket_config()),
            true,
        ),
    )
    .await
    .context("agent connect timed out")??;
    let hello = json!({"type": "hello", "protocol": "converger/1", "token": token, "group": group});
    socket.send(Message::text(hello.to_string())).await?;
    while let Some(message) = socket.next().await {
        let Message::Text(text) = message? else {
            continue;
        };
        // A message the view cannot read is none the agent acts on (see frame_views).
        let Ok(message) = serde_json::from_str::<AgentMessage>(text.as_str()) else {
            continue;
        };
        if let Some(since) = message.welcome_since()
            && let Some(eligible) = eligible.take()
        {
            let _ = eligible.send(since);
        }
        if let Some(code) = message.refusal_code()
            && let Ok(mut refused) = refusals.lock()
        {
            *refused.entry(code.to_owned()).or_default() += 1;
        }
        let Some((turn, delivered_count)) = message.delivered_turn() else {
            continue;
        };
        if let Ok(mut seen) = arrivals.lock() {
            seen.insert((turn.conversation_id, turn.seq), Instant::now());
        }
        let frames = vec![outgoing::text("ok")];
        let runtime = runtime_writes.then(|| json!({"count": delivered_count.unwrap_or(0) + 1}));
        let result = outgoing::result_envelope(&turn, &turn.result_client_id(), frames, runtime);
        socket.send(Message::text(result.to_string())).await?;
    }
    Ok(())
}
