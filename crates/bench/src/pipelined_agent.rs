//! The agent of `turns`: a group member that answers every turn as soon as it arrives, without
//! waiting for the previous answer's ack, as an agent serving many conversations at once does.
//! (The client crate's `Agent::reply` waits for each ack, which would measure the agent, not
//! the gateway.)

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use converger_client::agent::{Turn, result_client_id, result_envelope};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use uuid::Uuid;

/// When each turn reached an agent, by (conversation, seq).
pub type Arrivals = Arc<Mutex<HashMap<(Uuid, i64), Instant>>>;

/// Connects as a member of `group`, reports its `since` (ms) from the welcome on `eligible`,
/// and answers every delivered turn with one text frame until the connection ends. Acks and
/// refusals are only counted: a refusal would show up as a user who never gets an answer.
pub async fn serve(
    url: String,
    token: String,
    group: &str,
    arrivals: Arrivals,
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
        let envelope: Value = serde_json::from_str(text.as_str())?;
        if envelope["type"] == "welcome"
            && let (Some(since), Some(eligible)) =
                (envelope["data"]["since"].as_i64(), eligible.take())
        {
            let _ = eligible.send(since);
        }
        let Some(turn) = Turn::from_envelope(&envelope) else {
            continue;
        };
        if let Ok(mut seen) = arrivals.lock() {
            seen.insert((turn.conversation_id, turn.seq), Instant::now());
        }
        let frames = vec![json!({"type": "text", "data": {"text": "ok"}})];
        let result = result_envelope(&turn, &result_client_id(&turn), frames, None);
        socket.send(Message::text(result.to_string())).await?;
    }
    Ok(())
}
