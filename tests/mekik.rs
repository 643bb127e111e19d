//! Unmodified mekik clients: what a person using the chativa widget sees. Each test drives a
//! client that behaves like the widget (`support::mekik::Widget`) and counts its bubbles.

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::mekik::Widget;
use support::ws::WsClient;
use support::{TestNode, eventually, setup};
use uuid::Uuid;

fn fast_settle(config: &mut converger_gateway::Config) {
    config.group_settle_ms = 100;
}

/// An agent that owns every turn of the channel (the only member of its group).
async fn answering_agent(node: &TestNode, fixture: &support::TenantFixture) -> WsClient {
    let token = node.agent_token(fixture).await;
    let (agent, welcome) = node.agent(&token, Some("bot")).await;
    support::settle(&welcome).await;
    agent
}

/// A node, alice's conversation (id and bound token), an agent owning its turns, and a widget
/// connected to it.
struct Chat {
    node: TestNode,
    conversation_id: Uuid,
    token: String,
    agent: WsClient,
    widget: Widget,
}

async fn chat() -> Chat {
    let node = TestNode::start_with(fast_settle).await;
    let (acme, conversation_id, token) = setup(&node).await;
    let agent = answering_agent(&node, &acme).await;
    let mut widget = Widget::new(&node.ws_url(""), &token);
    widget.connect().await;
    Chat {
        node,
        conversation_id,
        token,
        agent,
        widget,
    }
}

/// `GET …/activities` of the conversation with `query` (`?view=chat`, …): (status, body).
async fn activities(chat: &Chat, query: &str) -> (u16, Value) {
    chat.node
        .activities(chat.conversation_id, &chat.token, query)
        .await
}

/// The next turn delivered to `agent`: (conversation id, seq, revision, the turn's frame).
async fn next_turn(agent: &mut WsClient) -> (String, i64, i64, Value) {
    loop {
        let delivered = agent.recv().await;
        let turn = &delivered["frame"]["meta"]["turn"];
        if let (Some(seq), Some(revision)) = (turn["seq"].as_i64(), turn["revision"].as_i64()) {
            let conversation_id = delivered["conversationId"].as_str().unwrap().to_owned();
            return (conversation_id, seq, revision, delivered["frame"].clone());
        }
    }
}

/// Answers the next turn with `frames` and waits for the result's ack.
async fn answer_next(agent: &mut WsClient, frames: Value) -> (i64, i64) {
    let (conversation_id, seq, revision, _) = next_turn(agent).await;
    let client_id = format!("r-{seq}-{revision}");
    agent
        .send(json!({"conversationId": conversation_id, "frame": {
            "type": "turnResult", "clientId": client_id,
            "turn": {"seq": seq, "revision": revision}, "frames": frames}}))
        .await;
    loop {
        let frame = agent.recv().await;
        if frame["frame"]["type"] == "ack" && frame["frame"]["clientId"] == client_id.as_str() {
            return (seq, revision);
        }
        assert_ne!(
            frame["frame"]["type"], "error",
            "the result was refused: {frame}"
        );
    }
}

fn text(reply: &str) -> Value {
    json!([{"type": "text", "data": {"text": reply}}])
}

async fn stored_user_frames(node: &TestNode, conversation_id: Uuid) -> (i64, i64) {
    let mut db = node.db.connect().await;
    sqlx::query_as(
        "SELECT count(*), count(DISTINCT client_id) FROM activities
         WHERE conversation_id = $1 AND sender_role = 'user'",
    )
    .bind(conversation_id)
    .fetch_one(&mut db)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_frame_sent_right_before_the_socket_closes_is_stored_once_in_both_profiles() {
    let node = TestNode::start().await;
    let (_, conversation_id, token) = setup(&node).await;
    for (round, converger) in [(0, false), (1, true)] {
        for n in 0..100 {
            // Open, hello, send, close at once: what a tab closed right after Enter does.
            let subprotocols: &[&str] = if converger { &["converger.v1"] } else { &[] };
            let mut socket = WsClient::connect_with(&node.ws_url(""), subprotocols, None).await;
            let mut hello = json!({"type": "hello", "token": token});
            let mut frame = json!({"type": "text", "data": {"text": format!("{round}-{n}")}});
            let key = format!("close-{round}-{n}");
            if converger {
                hello["protocol"] = json!("converger/1");
                frame["clientId"] = json!(key);
            } else {
                frame["id"] = json!(key);
            }
            socket.send(hello).await;
            socket.send(frame).await;
            socket.close().await;
        }
        let expected = 100 * (round + 1);
        eventually(
            &format!("{expected} frames stored"),
            Duration::from_secs(20),
            || async { stored_user_frames(&node, conversation_id).await.0 >= expected },
        )
        .await;
        assert_eq!(
            stored_user_frames(&node, conversation_id).await,
            (expected, expected),
            "each frame stored once"
        );
    }
}

#[tokio::test]
async fn a_cut_socket_right_after_a_send_shows_one_bubble() {
    let mut chat = chat().await;
    let id = chat.widget.send_text("hello?").await;
    chat.widget.cut();
    answer_next(&mut chat.agent, text("hi!")).await;
    // The reconnect replays from the watermark: the stored turn comes back under its own id.
    let widget = &mut chat.widget;
    widget.connect().await;
    widget.read_until(|frame| frame["from"] == "bot").await;
    let mine = widget.bubbles_from("user");
    assert_eq!(
        mine.len(),
        1,
        "one bubble for the message: {:?}",
        widget.bubbles
    );
    assert_eq!(mine[0].id, id);
    assert_eq!(widget.bubbles_from("bot").len(), 1);
    // Every copy carries the widget's id, for other tabs and REST too.
    let (_, page) = activities(&chat, "").await;
    assert_eq!(page["activities"][0]["id"], id.as_str());
}

#[tokio::test]
async fn a_reload_after_an_edit_and_two_regenerations_shows_one_question_and_one_answer_per_turn() {
    let mut chat = chat().await;
    let (widget, agent) = (&mut chat.widget, &mut chat.agent);
    let first = widget.send_text("what is 2+2?").await;
    answer_next(agent, text("5")).await;
    widget.send_text("and 3+3?").await;
    answer_next(agent, text("6")).await;
    widget
        .send(
            json!({"type": "edit", "messageId": first, "data": {"text": "what is 2+2, exactly?"}}),
        )
        .await;
    answer_next(agent, text("4, I think")).await;
    for reply in ["4", "four"] {
        widget
            .send(json!({"type": "regenerate", "messageId": first}))
            .await;
        answer_next(agent, text(reply)).await;
    }
    let head = chat
        .node
        .db
        .count(&format!(
            "SELECT last_seq FROM conversations WHERE id = '{}'",
            chat.conversation_id
        ))
        .await;

    // A reload: a fresh widget replays from 0.
    let mut reloaded = chat.widget.reloaded();
    reloaded.connect().await;
    reloaded.read_through(head).await;
    let shown: Vec<(&str, &str)> = reloaded
        .bubbles
        .iter()
        .map(|bubble| (bubble.from.as_str(), bubble.text.as_str()))
        .collect();
    let chat_view = [
        ("user", "and 3+3?"),
        ("bot", "6"),
        ("user", "what is 2+2, exactly?"),
        ("bot", "four"),
    ];
    assert_eq!(shown, chat_view, "one question and one answer per turn");
    assert_eq!(
        reloaded.bubbles[2].id, first,
        "the latest edit under the original turn's id"
    );

    // REST keeps the whole transcript, and shows the chat on request.
    let texts = support::page_texts;
    let (_, page) = activities(&chat, "?view=chat").await;
    let expected: Vec<String> = chat_view.iter().map(|(_, text)| text.to_string()).collect();
    assert_eq!(texts(&page), expected);
    let (_, page) = activities(&chat, "?view=transcript").await;
    assert_eq!(texts(&page).len(), 8);
    let (status, _) = activities(&chat, "?view=pretty").await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn mekik_shaped_genui_chunks_from_an_agent_reach_the_widget_in_order() {
    // The node stays bound: a field left out of the pattern would be dropped (and stopped) here.
    let Chat {
        node: _node,
        mut agent,
        mut widget,
        ..
    } = chat().await;
    widget.send_text("draw me a card").await;

    let (conversation_id, seq, revision, _) = next_turn(&mut agent).await;
    for (n, content) in ["Hel", "lo ", "there"].iter().enumerate() {
        agent
            .send(json!({"conversationId": conversation_id, "frame": {
                "type": "genui", "streamId": "s-14", "clientId": format!("chunk-{n}"),
                "chunk": {"type": "text", "content": content, "id": "run-1"},
                "done": false}}))
            .await;
    }
    agent
        .send(json!({"conversationId": conversation_id, "frame": {
            "type": "turnResult", "clientId": "r-1", "turn": {"seq": seq, "revision": revision},
            "frames": [{"type": "genui", "streamId": "s-14", "chunk": {}, "done": true}]}}))
        .await;
    let mut acked = Vec::new();
    while acked.len() < 4 {
        let frame = agent.recv().await;
        assert_ne!(frame["frame"]["type"], "error", "refused: {frame}");
        if frame["frame"]["type"] == "ack" {
            acked.push(frame["frame"]["clientId"].as_str().unwrap().to_owned());
        }
    }
    assert_eq!(acked, ["chunk-0", "chunk-1", "chunk-2", "r-1"]);

    widget
        .read_until(|frame| frame["type"] == "genui" && frame["done"] == true)
        .await;
    let chunks: Vec<&Value> = widget
        .received
        .iter()
        .filter(|frame| frame["type"] == "genui")
        .collect();
    assert_eq!(chunks.len(), 4);
    assert!(
        chunks
            .windows(2)
            .all(|pair| pair[0]["seq"].as_i64() < pair[1]["seq"].as_i64())
    );
    // One text run (one chunk id) grows one bubble, keyed as chativa's engine keys it.
    let stream = widget
        .bubbles
        .iter()
        .find(|bubble| bubble.id == "mekik-text-s-14-run-1")
        .expect("one bubble for the stream");
    assert_eq!(
        (stream.text.as_str(), stream.streaming),
        ("Hello there", false)
    );
}

#[tokio::test]
async fn the_welcome_capabilities_match_what_each_profile_receives() {
    let node = TestNode::start_with(fast_settle).await;
    let (acme, conversation_id, token) = setup(&node).await;
    let mut agent = answering_agent(&node, &acme).await;

    for converger in [false, true] {
        let subprotocols: &[&str] = if converger { &["converger.v1"] } else { &[] };
        let mut client = WsClient::connect_with(&node.ws_url(""), subprotocols, None).await;
        let head = node
            .db
            .count(&format!(
                "SELECT last_seq FROM conversations WHERE id = '{conversation_id}'"
            ))
            .await;
        let mut hello = json!({"type": "hello", "token": token, "watermark": head});
        if converger {
            hello["protocol"] = json!("converger/1");
        }
        client.send(hello).await;
        let welcome = client.recv().await;
        let capabilities = welcome["data"]["capabilities"].clone();
        // Every feature once: a keyed send (acks), another tab that comes and reads (presence,
        // receipts), the agent typing (typing), then the agent's answer marks the end. Nothing
        // in a conversation sends its one user presence yet, so neither profile promises it.
        client
            .send(
                json!({"type": "text", "clientId": format!("caps-{converger}"),
                         "data": {"text": "features?"}}),
            )
            .await;
        let (conversation, seq, revision, _) = next_turn(&mut agent).await;
        let mut other_tab = WsClient::connect(&node.ws_url("")).await;
        other_tab.hello(&token, json!({"watermark": seq})).await;
        other_tab
            .send(json!({"type": "read", "watermark": seq}))
            .await;
        other_tab.barrier().await;
        agent
            .send(json!({"conversationId": conversation, "frame": {"type": "typing", "isTyping": true}}))
            .await;
        agent
            .send(json!({"conversationId": conversation, "frame": {
                "type": "turnResult", "turn": {"seq": seq, "revision": revision},
                "frames": [{"type": "text", "data": {"text": "all of them"}}]}}))
            .await;
        let mut received = Vec::new();
        loop {
            let frame = client.recv().await;
            let done = frame["type"] == "text" && frame["from"] == "bot";
            received.push(frame);
            if done {
                break;
            }
        }
        let got = |kind: &str| received.iter().any(|frame| frame["type"] == kind);
        assert_eq!(
            capabilities["acks"],
            got("ack"),
            "acks ({converger}): {received:?}"
        );
        assert_eq!(
            capabilities["presence"],
            got("presence"),
            "presence ({converger})"
        );
        assert_eq!(
            capabilities["receipts"],
            got("deliveryStatus"),
            "receipts ({converger})"
        );
        assert_eq!(
            capabilities["typing"],
            got("typing"),
            "typing ({converger})"
        );
        assert_eq!(capabilities["acks"], converger);
        assert_eq!(capabilities["receipts"], converger);
        assert_eq!(capabilities["typing"], true);
        assert_eq!(conversation, conversation_id.to_string());
        other_tab.close().await;
    }
}

#[tokio::test]
async fn an_answer_the_gateway_refuses_is_told_to_the_end_user_in_both_profiles() {
    let Chat {
        node,
        token,
        mut agent,
        mut widget,
        ..
    } = chat().await;
    let mut converger = WsClient::connect(&node.ws_url("")).await;
    converger.hello(&token, json!({})).await;
    widget.send_text("are you there?").await;

    let (conversation_id, seq, revision, _) = next_turn(&mut agent).await;
    // A text without its text: refused, and nothing else will answer the turn by itself.
    agent
        .send_invalid(json!({"conversationId": conversation_id, "frame": {
            "type": "turnResult", "clientId": "bad-1", "turn": {"seq": seq, "revision": revision},
            "frames": [{"type": "text", "data": {"text": 5}}]}}))
        .await;
    let refusal = loop {
        let frame = agent.recv().await;
        if frame["frame"]["type"] == "error" {
            break frame;
        }
    };
    assert_eq!(refusal["frame"]["data"]["code"], "invalid_message");

    widget.read_until(|frame| frame["type"] == "error").await;
    let told = widget.received.last().unwrap().clone();
    assert_eq!(told["data"]["code"], "answer_refused");
    assert_eq!(told["data"]["details"]["reason"], "invalid_message");
    assert_eq!(told["data"]["frameType"], "turnResult");
    let mut seen = Vec::new();
    loop {
        let frame = converger.recv().await;
        if frame["type"] == "error" {
            seen.push(frame);
            break;
        }
    }
    assert_eq!(seen[0]["data"]["code"], "answer_refused");
    assert_eq!(seen[0]["data"]["retryable"], false);
}

/// The words `w<from> ` … `w<to - 1> ` joined.
fn words(from: u64, to: u64) -> String {
    (from..to).map(|n| format!("w{n} ")).collect()
}

/// `POST …/conversations/{id}/{change}` (`close`, `reopen`) with `token`: the status.
async fn lifecycle(node: &TestNode, conversation_id: Uuid, token: &str, change: &str) -> u16 {
    node.http
        .post(node.url(&format!(
            "/api/v1/converger/conversations/{conversation_id}/{change}"
        )))
        .bearer_auth(token)
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// The widget's bot bubbles, and none of them empty.
fn bot_bubbles(widget: &Widget) -> Vec<&support::mekik::Bubble> {
    let bot = widget.bubbles_from("bot");
    assert!(
        bot.iter().all(|bubble| !bubble.text.is_empty()),
        "no empty bubble: {:?}",
        widget.bubbles
    );
    bot
}

/// A chat whose widget asked, and shows the first three words of the answer streaming:
/// (node, agent, widget, conversation id, the turn's seq).
async fn three_words_shown() -> (TestNode, WsClient, Widget, String, i64) {
    let Chat {
        node,
        mut agent,
        mut widget,
        ..
    } = chat().await;
    widget.send_text("count for me").await;
    let (conversation_id, seq, _, _) = next_turn(&mut agent).await;
    support::stream_words(&mut agent, &conversation_id, "s-1", seq, 0..3).await;
    while bot_bubbles(&widget).first().map(|b| b.text.as_str()) != Some(&words(0, 3)) {
        widget.read_until(|frame| frame["type"] == "genui").await;
    }
    (node, agent, widget, conversation_id, seq)
}

/// The result that commits stream `s-1` as `answer`.
fn stream_result(conversation_id: &str, seq: i64, answer: &str) -> Value {
    json!({"conversationId": conversation_id, "frame": {
        "type": "turnResult", "clientId": "r-1", "turn": {"seq": seq},
        "frames": [{"type": "text", "streamId": "s-1", "data": {"text": answer}}]}})
}

#[tokio::test]
async fn a_streamed_answer_is_one_bubble_that_ends_as_the_answer_even_across_a_cut_socket() {
    let (_node, mut agent, mut widget, conversation_id, seq) = three_words_shown().await;

    // The socket is cut at chunk 3 of 12; the rest streams meanwhile; the widget reconnects.
    widget.cut();
    support::stream_words(&mut agent, &conversation_id, "s-1", seq, 3..9).await;
    widget.connect().await;
    let expected = words(0, 9);
    while bot_bubbles(&widget)[0].text.len() < expected.len() {
        widget.read_until(|frame| frame["type"] == "genui").await;
    }
    assert_eq!(bot_bubbles(&widget)[0].text, expected, "no text twice");
    support::stream_words(&mut agent, &conversation_id, "s-1", seq, 9..12).await;
    let answer = words(0, 12);
    agent
        .send(stream_result(&conversation_id, seq, &answer))
        .await;
    // The stored answer and the stream's end may come in either order.
    let ended_and_stored = |widget: &Widget| {
        let received = &widget.received;
        received
            .iter()
            .any(|f| f["type"] == "genui" && f["done"] == true)
            && received.iter().any(|f| f["seq"].as_i64() == Some(seq + 1))
    };
    while !ended_and_stored(&widget) {
        widget.read_until(|_| true).await;
    }
    let bot = bot_bubbles(&widget);
    assert_eq!(bot.len(), 1, "one bubble: {:?}", widget.bubbles);
    assert_eq!(
        (bot[0].text.as_str(), bot[0].streaming),
        (answer.as_str(), false)
    );

    // A reload shows the stored answer, once.
    let mut reloaded = widget.reloaded();
    reloaded.connect().await;
    reloaded.read_through(seq + 1).await;
    assert_eq!(bot_bubbles(&reloaded).len(), 1);
    assert_eq!(bot_bubbles(&reloaded)[0].text, answer);
}

#[tokio::test]
async fn a_stream_that_ends_while_the_socket_is_cut_shows_the_answer_and_stops_the_partial_one() {
    let (_node, mut agent, mut widget, conversation_id, seq) = three_words_shown().await;
    widget.cut();
    support::stream_words(&mut agent, &conversation_id, "s-1", seq, 3..6).await;
    let answer = words(0, 6);
    agent
        .send(stream_result(&conversation_id, seq, &answer))
        .await;
    loop {
        let frame = agent.recv().await;
        if frame["frame"]["type"] == "ack" && frame["frame"]["clientId"] == "r-1" {
            break;
        }
    }
    widget.connect().await;
    widget.read_through(seq + 1).await;
    let bot = bot_bubbles(&widget);
    assert!(
        bot.iter().all(|bubble| !bubble.streaming),
        "nothing left streaming: {bot:?}"
    );
    assert_eq!(
        bot.last().unwrap().text,
        answer,
        "the answer is shown whole"
    );
}

#[tokio::test]
async fn an_aborted_stream_says_so_and_a_close_and_a_refused_send_are_shown_as_text() {
    let Chat {
        node,
        conversation_id,
        token,
        mut agent,
        mut widget,
    } = chat().await;
    widget.send_text("tell me").await;
    let (conversation, seq, _, _) = next_turn(&mut agent).await;
    support::stream_words(&mut agent, &conversation, "s-1", seq, 0..2).await;
    agent
        .send(json!({"conversationId": conversation, "frame": {
            "type": "streamAbort", "streamId": "s-1", "reason": "tool failed"}}))
        .await;
    widget
        .read_until(|frame| frame["type"] == "genui" && frame["done"] == true)
        .await;
    let aborted = bot_bubbles(&widget)[0].clone();
    assert_eq!(
        aborted.text,
        format!("{}{}", words(0, 2), converger_protocol::mekik::ABORT_NOTICE)
    );
    assert!(!aborted.streaming);

    // The user closes the conversation: a text, not an empty bubble; a send then is refused
    // with a notice the widget shows.
    assert_eq!(
        lifecycle(&node, conversation_id, &token, "close").await,
        200
    );
    widget
        .read_until(|frame| frame["data"]["event"] == "closed")
        .await;
    widget.send_text("hello?").await;
    widget
        .read_until(|frame| {
            frame["id"]
                .as_str()
                .is_some_and(|id| id.starts_with("refused-"))
        })
        .await;
    assert_eq!(
        lifecycle(&node, conversation_id, &token, "reopen").await,
        200
    );
    widget
        .read_until(|frame| frame["data"]["event"] == "reopened")
        .await;
    let texts: Vec<&str> = bot_bubbles(&widget)
        .iter()
        .map(|bubble| bubble.text.as_str())
        .collect();
    assert_eq!(
        texts[1..],
        [
            "This conversation was closed.",
            "⚠️ This conversation is closed; your message was not delivered.",
            "This conversation was reopened.",
        ]
    );
    // A reload shows the close and the reopen as the same texts.
    let mut reloaded = widget.reloaded();
    reloaded.connect().await;
    reloaded
        .read_until(|frame| frame["data"]["event"] == "reopened")
        .await;
    let again: Vec<&str> = bot_bubbles(&reloaded)
        .iter()
        .map(|bubble| bubble.text.as_str())
        .collect();
    assert_eq!(
        again[again.len() - 2..],
        [
            "This conversation was closed.",
            "This conversation was reopened."
        ]
    );
}
