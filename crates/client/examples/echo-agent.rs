//! A runnable agent: joins a group and answers every turn with an echo, counting turns in the
//! conversation's runtime state. With `CONVERGER_STREAM=1` it streams the echo word by word
//! before committing it (docs/protocol.md §4.9).
//!
//! ```sh
//! CONVERGER_WS_URL=ws://127.0.0.1:8080/socket/converger/v1 \
//! CONVERGER_AGENT_TOKEN=<channel-scope token> \
//! cargo run -p converger-client --example echo-agent
//! ```

use converger_client::AnswerStream;
use converger_client::agent::Agent;
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("CONVERGER_WS_URL")
        .unwrap_or_else(|_| "ws://127.0.0.1:8080/socket/converger/v1".into());
    let token = std::env::var("CONVERGER_AGENT_TOKEN")?;
    let group = std::env::var("CONVERGER_AGENT_GROUP").unwrap_or_else(|_| "echo".into());
    let streaming = std::env::var("CONVERGER_STREAM").is_ok_and(|value| value == "1");
    let mut agent = Agent::connect(&url, &token, Some(&group)).await?;
    eprintln!("echo-agent joined group {group}: {}", agent.welcome());
    loop {
        let turn = agent.next_turn().await?;
        let count = turn.runtime_state["count"].as_i64().unwrap_or(0) + 1;
        let text = format!("echo: {}", turn.text().unwrap_or(""));
        let frames = vec![json!({"type": "text", "data": {"text": text}})];
        let runtime = Some(json!({"count": count}));
        let ack = if streaming {
            let mut stream =
                AnswerStream::open(&turn, &format!("echo-{}-{}", turn.seq, turn.revision));
            for word in text.split_inclusive(' ') {
                stream.text(&mut agent, word).await?;
            }
            stream.finish(&mut agent, &turn, frames, runtime).await?
        } else {
            agent.reply(&turn, frames, runtime).await?
        };
        eprintln!("answered {} with seqs {:?}", turn.key, ack.seqs);
    }
}
