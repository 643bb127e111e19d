//! Reconnects against a scripted in-process WebSocket server: the client resumes from its
//! watermark, resends unacked sends with the same clientId and never hands out a frame twice.

use std::time::Duration;

use converger_client::agent::{Agent, AgentOptions};
use converger_client::{
    Backoff, ClientError, Conversation, ConversationOptions, ServerFrame, SessionOptions,
};
use futures_util::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, timeout};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::{WebSocketStream, accept_async};

const CONVERSATION: &str = "0193e0a4-0000-7000-8000-000000000001";
const LIMIT: Duration = Duration::from_secs(10);

type ServerSocket = WebSocketStream<TcpStream>;

fn fast_session() -> SessionOptions {
    SessionOptions {
        backoff: Backoff {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(200),
            max_attempts: Some(5),
        },
        ..SessionOptions::default()
    }
}

async fn listen() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "ws://{}/socket/converger/v1",
        listener.local_addr().unwrap()
    );
    (listener, url)
}

async fn accept(listener: &TcpListener) -> ServerSocket {
    let (stream, _) = listener.accept().await.unwrap();
    accept_async(stream).await.unwrap()
}

async fn receive(socket: &mut ServerSocket) -> Value {
    loop {
        match socket.next().await {
            Some(Ok(Message::Text(text))) => return serde_json::from_str(text.as_str()).unwrap(),
            Some(Ok(_)) => continue,
            other => panic!("the client went away: {other:?}"),
        }
    }
}

async fn send(socket: &mut ServerSocket, frame: Value) {
    socket
        .send(Message::Text(frame.to_string().into()))
        .await
        .unwrap();
}

fn welcome(head: i64) -> Value {
    json!({"type": "welcome", "data": {"protocol": "converger/1", "scope": "conversation",
        "conversationId": CONVERSATION, "userId": "alice", "connectionId": "c",
        "watermark": head, "pending": [], "expiresAt": 1,
        "limits": {"maxInFlight": 32, "idleTimeoutMs": 60000}}})
}

fn text(seq: i64) -> Value {
    json!({"type": "text", "id": format!("m{seq}"), "seq": seq, "from": "bot",
        "sender": {"id": "agent", "role": "agent"}, "data": {"text": format!("#{seq}")},
        "timestamp": 1})
}

async fn next(conversation: &mut Conversation) -> ServerFrame {
    timeout(LIMIT, conversation.next_frame())
        .await
        .expect("a frame in time")
        .expect("no error")
}

#[tokio::test]
async fn a_conversation_resumes_from_its_watermark_and_resends_unacked_sends() {
    let (listener, url) = listen().await;
    let server = tokio::spawn(async move {
        let mut first = accept(&listener).await;
        let hello = receive(&mut first).await;
        assert_eq!(hello["watermark"], 0);
        assert_eq!(hello.get("conversationId"), None);
        send(&mut first, welcome(0)).await;
        send(&mut first, text(1)).await;
        send(&mut first, text(2)).await;
        let sent = receive(&mut first).await;
        assert_eq!(sent["clientId"], "c-1");
        // The socket dies before the ack is written.
        drop(first);

        let mut second = accept(&listener).await;
        let hello = receive(&mut second).await;
        assert_eq!(hello["watermark"], 2);
        assert_eq!(hello["conversationId"], CONVERSATION);
        send(&mut second, welcome(3)).await;
        send(&mut second, text(2)).await;
        send(&mut second, text(3)).await;
        let resent = receive(&mut second).await;
        assert_eq!(resent, sent, "the same frame with the same clientId");
        let ack = json!({"type": "ack", "clientId": "c-1", "id": "m4", "seq": 4,
            "timestamp": 2, "duplicate": true});
        send(&mut second, ack.clone()).await;
        send(&mut second, ack).await;
        let mut own = text(4);
        own["clientId"] = json!("c-1");
        send(&mut second, own).await;
        send(&mut second, text(5)).await;
        // Keep the socket open until the client is done.
        while second.next().await.is_some() {}
    });

    let options = ConversationOptions {
        session: fast_session(),
        ..ConversationOptions::default()
    };
    let mut conversation = Conversation::connect_with(&url, "token", options)
        .await
        .unwrap();
    assert_eq!(
        conversation.conversation_id().map(|id| id.to_string()),
        Some(CONVERSATION.to_owned())
    );
    assert_eq!(next(&mut conversation).await.seq(), Some(1));
    assert_eq!(next(&mut conversation).await.seq(), Some(2));
    conversation.send_text("c-1", "hi").await.unwrap();
    assert_eq!(conversation.unacked(), ["c-1"]);
    assert!(matches!(
        next(&mut conversation).await,
        ServerFrame::Welcome(welcome) if welcome.watermark == 3
    ));
    assert_eq!(next(&mut conversation).await.seq(), Some(3));
    let ServerFrame::Ack(ack) = next(&mut conversation).await else {
        panic!("the ack of the resend");
    };
    assert_eq!(
        (ack.client_id.as_deref(), ack.seq, ack.duplicate),
        (Some("c-1"), Some(4), true)
    );
    // The second ack and the replayed own frame are not handed out.
    assert_eq!(next(&mut conversation).await.seq(), Some(5));
    assert_eq!(conversation.watermark(), 5);
    assert!(conversation.unacked().is_empty());
    conversation.close().await;
    timeout(LIMIT, server).await.unwrap().unwrap();
}

#[tokio::test]
async fn a_draining_node_is_left_for_at_least_its_retry_after() {
    let (listener, url) = listen().await;
    let server = tokio::spawn(async move {
        let mut first = accept(&listener).await;
        receive(&mut first).await;
        send(&mut first, welcome(0)).await;
        send(
            &mut first,
            json!({"type": "error", "data": {"code": "unavailable", "message": "draining",
                "number": 9001, "retryable": true, "retryAfterMs": 300}}),
        )
        .await;
        let reason = r#"{"reason":"unavailable","retryAfterMs":300}"#;
        first
            .close(Some(CloseFrame {
                code: CloseCode::Restart,
                reason: reason.into(),
            }))
            .await
            .unwrap();
        let closed_at = Instant::now();
        let mut second = accept(&listener).await;
        let waited = closed_at.elapsed();
        receive(&mut second).await;
        send(&mut second, welcome(0)).await;
        while second.next().await.is_some() {}
        waited
    });

    let options = ConversationOptions {
        session: fast_session(),
        ..ConversationOptions::default()
    };
    let mut conversation = Conversation::connect_with(&url, "token", options)
        .await
        .unwrap();
    let ServerFrame::Error(error) = next(&mut conversation).await else {
        panic!("the drain notice");
    };
    assert_eq!(
        (error.code.as_str(), error.retry_after_ms),
        ("unavailable", Some(300))
    );
    assert!(matches!(
        next(&mut conversation).await,
        ServerFrame::Welcome(_)
    ));
    conversation.close().await;
    let waited = timeout(LIMIT, server).await.unwrap().unwrap();
    assert!(
        waited >= Duration::from_millis(250),
        "waited only {waited:?}"
    );
}

#[tokio::test]
async fn an_auth_close_ends_the_session_instead_of_reconnecting() {
    let (listener, url) = listen().await;
    let server = tokio::spawn(async move {
        let mut first = accept(&listener).await;
        receive(&mut first).await;
        send(&mut first, welcome(0)).await;
        send(
            &mut first,
            json!({"type": "error", "data": {"code": "token_expired", "message": "expired",
                "number": 2001, "retryable": true}}),
        )
        .await;
        first
            .close(Some(CloseFrame {
                code: CloseCode::from(4401),
                reason: "token_expired".into(),
            }))
            .await
            .unwrap();
    });
    let mut conversation = Conversation::connect(&url, "token", 0).await.unwrap();
    assert!(matches!(
        next(&mut conversation).await,
        ServerFrame::Error(error) if error.code == "token_expired"
    ));
    let ending = timeout(LIMIT, conversation.next_frame()).await.unwrap();
    assert!(
        matches!(&ending, Err(ClientError::Closed { code: 4401, reason }) if reason == "token_expired"),
        "{ending:?}"
    );
    timeout(LIMIT, server).await.unwrap().unwrap();
}

#[tokio::test]
async fn a_refused_hello_is_returned_by_connect() {
    let (listener, url) = listen().await;
    let server = tokio::spawn(async move {
        let mut first = accept(&listener).await;
        receive(&mut first).await;
        send(
            &mut first,
            json!({"type": "error", "data": {"code": "unauthorized", "message": "bad token",
                "number": 2000, "retryable": false}}),
        )
        .await;
        let _ = first
            .close(Some(CloseFrame {
                code: CloseCode::from(4401),
                reason: "unauthorized".into(),
            }))
            .await;
    });
    let refused = Conversation::connect(&url, "bad", 0).await;
    assert!(matches!(refused, Err(ClientError::Refused { code, .. }) if code == "unauthorized"));
    timeout(LIMIT, server).await.unwrap().unwrap();
}

fn agent_welcome() -> Value {
    json!({"type": "welcome", "data": {"protocol": "converger/1", "scope": "channel",
        "channelId": "ch", "connectionId": "9b2e", "group": "echo", "since": 1,
        "expiresAt": 1, "limits": {"maxInFlight": 32, "idleTimeoutMs": 60000}}})
}

fn turn(seq: i64, revision: i64) -> Value {
    json!({"conversationId": CONVERSATION, "frame": {"type": "text", "id": format!("m{seq}"),
        "seq": seq, "from": "user", "sender": {"id": "alice", "role": "user"},
        "data": {"text": "ping"}, "timestamp": 1,
        "meta": {"channel": {"id": "ch"}, "participant": {"id": "alice", "role": "user"},
            "turn": {"seq": seq, "revision": revision,
                "key": format!("{CONVERSATION}:{seq}:{revision}")},
            "runtime": {"version": 0, "state": {}}}}})
}

#[tokio::test]
async fn an_agent_resumes_with_watermarks_and_resends_its_reply() {
    let (listener, url) = listen().await;
    let server = tokio::spawn(async move {
        let mut first = accept(&listener).await;
        let hello = receive(&mut first).await;
        assert_eq!(hello["group"], "echo");
        assert_eq!(hello.get("watermarks"), None);
        send(&mut first, agent_welcome()).await;
        send(&mut first, turn(5, 0)).await;
        let result = receive(&mut first).await;
        assert_eq!(result["frame"]["type"], "turnResult");
        drop(first);

        let mut second = accept(&listener).await;
        let hello = receive(&mut second).await;
        assert_eq!(hello["group"], "echo");
        assert_eq!(hello["watermarks"], json!({CONVERSATION: 5}));
        send(&mut second, agent_welcome()).await;
        // The replay repeats the turn already handed out.
        send(&mut second, turn(5, 0)).await;
        let resent = receive(&mut second).await;
        assert_eq!(resent, result, "the same result with the same clientId");
        let client_id = resent["frame"]["clientId"].clone();
        send(
            &mut second,
            json!({"conversationId": CONVERSATION, "frame": {"type": "ack",
                "clientId": client_id, "turn": {"seq": 5, "revision": 0}, "ids": ["a6"],
                "seqs": [6], "timestamp": 2, "duplicate": true}}),
        )
        .await;
        // A regeneration: the same seq, a new revision.
        send(&mut second, turn(5, 1)).await;
        while second.next().await.is_some() {}
    });

    let options = AgentOptions {
        group: Some("echo".into()),
        session: fast_session(),
        ..AgentOptions::default()
    };
    let mut agent = Agent::connect_with(&url, "token", options).await.unwrap();
    assert_eq!(agent.welcome()["connectionId"], "9b2e");
    let first = timeout(LIMIT, agent.next_turn()).await.unwrap().unwrap();
    assert_eq!((first.seq, first.revision), (5, 0));
    let frames = vec![json!({"type": "text", "data": {"text": "pong"}})];
    let ack = timeout(LIMIT, agent.reply(&first, frames, None))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((ack.seqs, ack.duplicate), (vec![6], true));
    let again = timeout(LIMIT, agent.next_turn()).await.unwrap().unwrap();
    assert_eq!((again.seq, again.revision), (5, 1));
    assert_eq!(agent.watermarks().get(&first.conversation_id), Some(&5));
    agent.close().await;
    timeout(LIMIT, server).await.unwrap().unwrap();
}

#[tokio::test]
async fn a_reply_refused_as_unavailable_is_resent_after_its_retry_after() {
    let (listener, url) = listen().await;
    let server = tokio::spawn(async move {
        let mut socket = accept(&listener).await;
        receive(&mut socket).await;
        send(&mut socket, agent_welcome()).await;
        send(&mut socket, turn(5, 0)).await;
        let result = receive(&mut socket).await;
        let client_id = result["frame"]["clientId"].clone();
        // No database answers (a failover): refused, retryable, with a hint.
        send(
            &mut socket,
            json!({"conversationId": CONVERSATION, "frame": {"type": "error", "data": {
                "code": "unavailable", "message": "database unavailable; retry", "number": 9001,
                "retryable": true, "retryAfterMs": 50, "clientId": client_id}}}),
        )
        .await;
        let refused_at = Instant::now();
        let resent = receive(&mut socket).await;
        assert!(
            refused_at.elapsed() >= Duration::from_millis(50),
            "not before the hint"
        );
        assert_eq!(resent, result, "the same result with the same clientId");
        send(
            &mut socket,
            json!({"conversationId": CONVERSATION, "frame": {"type": "ack",
                "clientId": client_id, "turn": {"seq": 5, "revision": 0}, "ids": ["a6"],
                "seqs": [6], "timestamp": 2}}),
        )
        .await;
        while socket.next().await.is_some() {}
    });

    let options = AgentOptions {
        session: fast_session(),
        ..AgentOptions::default()
    };
    let mut agent = Agent::connect_with(&url, "token", options).await.unwrap();
    let turn = timeout(LIMIT, agent.next_turn()).await.unwrap().unwrap();
    let frames = vec![json!({"type": "text", "data": {"text": "pong"}})];
    let ack = timeout(LIMIT, agent.reply(&turn, frames, None))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((ack.seqs, ack.duplicate), (vec![6], false));
    agent.close().await;
    timeout(LIMIT, server).await.unwrap().unwrap();
}
