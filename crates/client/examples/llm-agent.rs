//! A streaming "LLM" agent with no model: a fake generator produces an answer word by word with
//! a realistic delay, the agent streams each word to the conversation's end users, then commits
//! the whole answer as the turn's result (docs/protocol.md §4.9).
//!
//! ```sh
//! CONVERGER_WS_URL=ws://127.0.0.1:8080/socket/converger/v1 \
//! CONVERGER_AGENT_TOKEN=<channel-scope token> \
//! cargo run -p converger-client --example llm-agent
//! ```
//!
//! Without `CONVERGER_AGENT_TOKEN`, on the development setup (a node started with
//! `cargo run -p converger-cli -- serve` in the repository root), it answers the demo page's
//! channel: it reads the generated admin token from `.converger/admin_token` and asks
//! `POST /demo/api/agent-token` for a token (see http://127.0.0.1:8080/demo).

use std::time::Duration;

use converger_client::AnswerStream;
use converger_client::agent::Agent;
use serde_json::json;

/// What the fake model says to `prompt`, one word at a time.
fn generate(prompt: &str) -> Vec<String> {
    let answer = format!(
        "You said \"{prompt}\". Here is a considered answer, written one word at a time so that \
         you can watch it arrive: streaming keeps the wait short, and the stored answer stays \
         exactly what you saw."
    );
    answer.split_inclusive(' ').map(str::to_owned).collect()
}

/// A token of the demo page's channel, asked for with the development node's admin token.
async fn demo_agent_token(ws_url: &str) -> Result<String, Box<dyn std::error::Error>> {
    let admin = std::fs::read_to_string(".converger/admin_token").map_err(|error| {
        format!("no CONVERGER_AGENT_TOKEN and no .converger/admin_token: {error}")
    })?;
    let base = ws_url
        .replacen("ws://", "http://", 1)
        .replacen("wss://", "https://", 1)
        .replace("/socket/converger/v1", "");
    let answer: serde_json::Value = reqwest::Client::new()
        .post(format!("{base}/demo/api/agent-token"))
        .bearer_auth(admin.trim())
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let token = answer["token"].as_str().ok_or("no token in the answer")?;
    Ok(token.to_owned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("CONVERGER_WS_URL")
        .unwrap_or_else(|_| "ws://127.0.0.1:8080/socket/converger/v1".into());
    let token = match std::env::var("CONVERGER_AGENT_TOKEN") {
        Ok(token) => token,
        Err(_) => demo_agent_token(&url).await?,
    };
    let group = std::env::var("CONVERGER_AGENT_GROUP").unwrap_or_else(|_| "llm".into());
    let delay = Duration::from_millis(
        std::env::var("CONVERGER_WORD_DELAY_MS")
            .ok()
            .and_then(|value| value.parse().ok())
            .unwrap_or(60),
    );
    let mut agent = Agent::connect(&url, &token, Some(&group)).await?;
    eprintln!("llm-agent joined group {group}");
    loop {
        let turn = agent.next_turn().await?;
        let words = generate(turn.text().unwrap_or(""));
        let stream_id = format!("llm-{}-{}", turn.seq, turn.revision);
        let mut stream = AnswerStream::open(&turn, &stream_id);
        for word in &words {
            tokio::time::sleep(delay).await;
            stream.text(&mut agent, word).await?;
        }
        let frames = vec![json!({"type": "text", "data": {"text": words.concat()}})];
        let ack = stream.finish(&mut agent, &turn, frames, None).await?;
        eprintln!(
            "streamed {} words for {}, stored as {:?}",
            words.len(),
            turn.key,
            ack.seqs
        );
    }
}
