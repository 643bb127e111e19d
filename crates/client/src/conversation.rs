//! The end-user side: a conversation-scope connection with typed frames, keyed sends kept
//! until acked, and reconnects that resume from the last watermark without showing a frame
//! twice.

use std::collections::VecDeque;
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;
use uuid::Uuid;

use crate::error::ClientError;
use crate::frames::{Ack, ErrorFrame, ServerFrame, Welcome};
use crate::outbox::{Outbox, is_valid_client_id};
use crate::session::{Link, SessionOptions};
use crate::tracking::SeqTracker;

/// Wait before resending after a retryable refusal that names no delay.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How to open a [`Conversation`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConversationOptions {
    /// The conversation to join, for tokens not bound to one (bound tokens ignore it).
    pub conversation_id: Option<Uuid>,
    /// The highest seq already seen (0 = nothing): the server replays what follows.
    pub watermark: i64,
    /// Timeouts and reconnect settings.
    pub session: SessionOptions,
}

/// What the client keeps about its conversation between connections, with no I/O.
#[derive(Debug, Clone)]
pub(crate) struct ConversationState {
    pub(crate) seen: SeqTracker,
    pub(crate) outbox: Outbox,
    pub(crate) conversation_id: Option<Uuid>,
}

/// The verdict on one received frame.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Accepted {
    /// The frame to hand to the caller, unless it was already seen.
    pub(crate) surface: Option<ServerFrame>,
    /// Ask the server to replay everything after this seq (`sync`).
    pub(crate) sync_from: Option<i64>,
}

impl ConversationState {
    pub(crate) fn new(options: &ConversationOptions) -> ConversationState {
        ConversationState {
            seen: SeqTracker::new(options.watermark),
            outbox: Outbox::new(options.session.ack_timeout),
            conversation_id: options.conversation_id,
        }
    }

    /// The `hello` for the next connection: the conversation and the watermark so far.
    pub(crate) fn hello(&self, token: &str) -> Value {
        crate::outgoing::conversation_hello(token, self.seen.watermark(), self.conversation_id)
    }

    /// A connection was (re)established.
    pub(crate) fn on_welcome(&mut self, welcome: &Welcome, now: Instant) {
        let asked = self.conversation_id;
        if asked.is_some() && welcome.conversation_id != asked {
            // Another conversation was opened: its seqs have nothing to do with ours.
            self.seen.reset(0);
        }
        if self.seen.watermark() > welcome.watermark {
            // The server refuses it (invalid_watermark) and continues live after its head.
            self.seen.reset(welcome.watermark);
        }
        if welcome.conversation_id.is_some() {
            self.conversation_id = welcome.conversation_id;
        }
        if let Some(limit) = welcome.max_in_flight() {
            self.outbox.set_max_in_flight(limit);
        }
        self.outbox.requeue_all(now);
    }

    /// Decides what to do with one received frame.
    pub(crate) fn accept(&mut self, frame: ServerFrame, now: Instant) -> Accepted {
        let fresh = match &frame {
            ServerFrame::Message(message) => self.seen.observe(message.seq),
            ServerFrame::Ack(ack) => self.first_ack(ack),
            ServerFrame::Error(error) => {
                self.note_refusal(error, now);
                true
            }
            _ => true,
        };
        if !fresh {
            return Accepted {
                surface: None,
                sync_from: None,
            };
        }
        let sync_from = match &frame {
            ServerFrame::ReplayTruncated(_) => Some(self.seen.watermark()),
            ServerFrame::Heartbeat(_) if self.seen.has_gap() => Some(self.seen.watermark()),
            _ => None,
        };
        Accepted {
            surface: Some(frame),
            sync_from,
        }
    }

    /// Records an ack; true for the first answer to a waiting send.
    fn first_ack(&mut self, ack: &Ack) -> bool {
        if let Some(seq) = ack.seq {
            self.seen.observe(seq);
        }
        // Every keyed send goes through the outbox, so an ack for a clientId not waiting
        // there answers a resend whose first ack was already handed out.
        ack.client_id
            .as_deref()
            .is_none_or(|client_id| self.outbox.settle(client_id))
    }

    /// A refused send is dropped, or resent later when the refusal is retryable.
    fn note_refusal(&mut self, error: &ErrorFrame, now: Instant) {
        let Some(client_id) = error.client_id.as_deref() else {
            return;
        };
        if !error.retryable {
            self.outbox.settle(client_id);
            return;
        }
        let after = error
            .retry_after_ms
            .map_or(DEFAULT_RETRY_AFTER, Duration::from_millis);
        self.outbox.retry_at(client_id, now + after);
    }
}

/// An end user's connection to one conversation.
///
/// [`Conversation::next_frame`] drives everything: it reads, reconnects with jittered
/// exponential backoff when the connection ends for a reason a new connection can fix
/// (honouring `retryAfterMs`), sends `hello` again with the last watermark, resends every
/// unacknowledged send with its clientId, and hands out each persistent frame once. Keep
/// calling it (from one task) so pings are answered and acks are read.
///
/// ```no_run
/// use converger_client::{Conversation, ServerFrame};
///
/// # async fn run() -> Result<(), converger_client::ClientError> {
/// let url = "ws://127.0.0.1:8080/socket/converger/v1";
/// let mut conversation = Conversation::connect(url, "<conversation-bound token>", 0).await?;
/// conversation.send_text("c-1", "hello").await?;
/// loop {
///     match conversation.next_frame().await? {
///         ServerFrame::Message(message) => println!("{}: {:?}", message.seq, message.text()),
///         ServerFrame::Ack(ack) => println!("stored as {:?}", ack.seq),
///         ServerFrame::Welcome(_) => println!("reconnected at {}", conversation.watermark()),
///         other => println!("{other:?}"),
///     }
/// }
/// # }
/// ```
pub struct Conversation {
    token: String,
    link: Link,
    state: ConversationState,
    welcome: Welcome,
    inbox: VecDeque<Value>,
}

impl Conversation {
    /// Connects to `ws_url` (…/socket/converger/v1) with a conversation-scope token, having
    /// seen everything up to `watermark`, and waits for `welcome` (one attempt: a failure here
    /// is returned, later ones are reconnected).
    pub async fn connect(
        ws_url: &str,
        token: &str,
        watermark: i64,
    ) -> Result<Conversation, ClientError> {
        let options = ConversationOptions {
            watermark,
            ..ConversationOptions::default()
        };
        Conversation::connect_with(ws_url, token, options).await
    }

    /// Connects with explicit options.
    pub async fn connect_with(
        ws_url: &str,
        token: &str,
        options: ConversationOptions,
    ) -> Result<Conversation, ClientError> {
        let mut state = ConversationState::new(&options);
        let mut link = Link::new(ws_url, options.session);
        let opened = link.connect_once(&state.hello(token)).await?;
        let welcome = Welcome::from_frame(&opened.welcome);
        state.on_welcome(&welcome, Instant::now());
        Ok(Conversation {
            token: token.to_owned(),
            link,
            state,
            welcome,
            inbox: opened.early.into(),
        })
    }

    /// The latest `welcome.data` (replaced on every reconnect).
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// The conversation this client is in.
    pub fn conversation_id(&self) -> Option<Uuid> {
        self.state.conversation_id
    }

    /// The highest seq with nothing missing below it; store it to resume later.
    pub fn watermark(&self) -> i64 {
        self.state.seen.watermark()
    }

    /// ClientIds of the sends still waiting for an ack, in send order.
    pub fn unacked(&self) -> Vec<String> {
        self.state.outbox.client_ids()
    }

    /// Uses `token` for the next reconnects (say, after `token_expired`).
    pub fn set_token(&mut self, token: &str) {
        self.token = token.to_owned();
    }

    /// Sends a `text` message, kept and resent with the same clientId until acked.
    pub async fn send_text(&mut self, client_id: &str, text: &str) -> Result<(), ClientError> {
        self.send_message(client_id, crate::outgoing::text(text))
            .await
    }

    /// Sends any keyed frame the server acks (`text`, `event`, other message types, `edit`,
    /// `regenerate`); its `clientId` is set to `client_id`. The frame is kept and resent with
    /// the same clientId, across reconnects, until the server acks it or refuses it for good;
    /// a frame sent while disconnected goes out after the reconnect.
    pub async fn send_message(&mut self, client_id: &str, frame: Value) -> Result<(), ClientError> {
        if !is_valid_client_id(client_id) {
            return Err(ClientError::InvalidClientId(client_id.to_owned()));
        }
        let Some(frame) = crate::outgoing::keyed(frame, client_id) else {
            return Err(ClientError::InvalidFrame("not a JSON object".into()));
        };
        let text = frame.to_string();
        self.state.outbox.push(client_id, text, Instant::now());
        self.link.send_due(&mut self.state.outbox).await;
        Ok(())
    }

    /// Tells the other participants whether the user types. Transient: false when it could
    /// not be written (disconnected), and it is not sent later.
    pub async fn send_typing(&mut self, is_typing: bool) -> bool {
        let frame = crate::outgoing::typing(is_typing);
        self.link.write(frame.to_string()).await
    }

    /// Stores the user's read position, at most what this connection has been sent. Transient:
    /// false when it could not be written (disconnected), and it is not sent later.
    pub async fn send_read(&mut self, watermark: i64) -> bool {
        let frame = crate::outgoing::read(watermark);
        self.link.write(frame.to_string()).await
    }

    /// The next frame, each persistent frame once; reconnects as needed.
    ///
    /// Besides frames from the server, a [`ServerFrame::Welcome`] here means the connection was
    /// re-established (the replay and the resends follow). Acks are handed out once per send;
    /// errors are handed out as they come, and a retryable refusal of a queued send (say
    /// `too_many_in_flight`) is resent after its `retryAfterMs` without the caller's help. A
    /// `replayTruncated` makes the client `sync` the rest. Errors: [`ClientError::Closed`] when
    /// the server ended the session for good (auth, inactive channel, …),
    /// [`ClientError::GaveUp`] when reconnecting failed every time the backoff allows, or a
    /// refused handshake; calling again starts reconnecting afresh.
    pub async fn next_frame(&mut self) -> Result<ServerFrame, ClientError> {
        loop {
            if let Some(raw) = self.inbox.pop_front() {
                if let Some(frame) = self.admit(raw).await {
                    return Ok(frame);
                }
                continue;
            }
            if !self.link.is_connected() {
                let hello = self.state.hello(&self.token);
                let opened = self.link.reconnect(&hello).await?;
                let welcome = Welcome::from_frame(&opened.welcome);
                self.state.on_welcome(&welcome, Instant::now());
                self.welcome = welcome.clone();
                self.inbox.extend(opened.early);
                return Ok(ServerFrame::Welcome(welcome));
            }
            let Some(raw) = self.link.read(&mut self.state.outbox).await? else {
                continue;
            };
            if let Some(frame) = self.admit(raw).await {
                return Ok(frame);
            }
        }
    }

    /// Closes the connection (close 1000); unacked sends are dropped with the client.
    pub async fn close(mut self) {
        self.link.close().await;
    }

    async fn admit(&mut self, raw: Value) -> Option<ServerFrame> {
        let accepted = self.state.accept(ServerFrame::parse(raw), Instant::now());
        if let Some(watermark) = accepted.sync_from {
            // Lost with the connection, it is not needed: the next hello carries the watermark.
            let sync = crate::outgoing::sync(watermark);
            self.link.write(sync.to_string()).await;
        }
        accepted.surface
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn state(watermark: i64) -> ConversationState {
        ConversationState::new(&ConversationOptions {
            watermark,
            ..ConversationOptions::default()
        })
    }

    fn message(seq: i64) -> ServerFrame {
        ServerFrame::parse(json!({"type": "text", "id": format!("m{seq}"), "seq": seq,
            "from": "bot", "sender": {"id": "agent", "role": "agent"},
            "data": {"text": format!("#{seq}")}, "timestamp": 1}))
    }

    fn welcome(conversation: &str, head: i64) -> Welcome {
        Welcome::from_frame(&json!({"type": "welcome", "data": {
            "conversationId": conversation, "watermark": head,
            "limits": {"maxInFlight": 2, "idleTimeoutMs": 60000}}}))
    }

    const CONVERSATION: &str = "0193e0a4-0000-7000-8000-000000000001";

    #[test]
    fn the_hello_carries_the_conversation_and_the_watermark() {
        let mut state = state(12);
        assert_eq!(
            state.hello("t"),
            json!({"type": "hello", "protocol": "converger/1", "token": "t", "watermark": 12})
        );
        state.on_welcome(&welcome(CONVERSATION, 20), Instant::now());
        state.accept(message(13), Instant::now());
        let hello = state.hello("t2");
        assert_eq!(hello["conversationId"], CONVERSATION);
        assert_eq!(hello["watermark"], 13);
        assert_eq!(hello["token"], "t2");
    }

    #[test]
    fn a_replay_after_a_reconnect_surfaces_only_new_frames() {
        let now = Instant::now();
        let mut state = state(0);
        state.on_welcome(&welcome(CONVERSATION, 0), now);
        for seq in 1..=3 {
            assert!(state.accept(message(seq), now).surface.is_some());
        }
        // The server may repeat frames (sync, a replay overlapping live frames).
        let surfaced: Vec<i64> = [2, 3, 4, 4, 5]
            .into_iter()
            .filter_map(|seq| state.accept(message(seq), now).surface)
            .filter_map(|frame| frame.seq())
            .collect();
        assert_eq!(surfaced, [4, 5]);
        assert_eq!(state.hello("t")["watermark"], 5);
    }

    #[test]
    fn an_ack_is_surfaced_once_and_counts_as_seen() {
        let now = Instant::now();
        let mut state = state(0);
        state.on_welcome(&welcome(CONVERSATION, 0), now);
        state.outbox.push("c-1", "{}".into(), now);
        let ack = |duplicate: bool| {
            ServerFrame::parse(
                json!({"type": "ack", "clientId": "c-1", "id": "a", "seq": 1,
                "timestamp": 2, "duplicate": duplicate}),
            )
        };
        assert!(state.accept(ack(true), now).surface.is_some());
        assert!(state.outbox.client_ids().is_empty());
        assert_eq!(state.accept(ack(true), now).surface, None);
        // The user's own frame, replayed with its clientId, is not shown again.
        assert_eq!(state.accept(message(1), now).surface, None);
        assert_eq!(state.seen.watermark(), 1);
    }

    #[test]
    fn refusals_drop_or_reschedule_the_send() {
        let now = Instant::now();
        let mut state = state(0);
        state.on_welcome(&welcome(CONVERSATION, 0), now);
        state.outbox.push("c-1", "one".into(), now);
        state.outbox.push("c-2", "two".into(), now);
        state.outbox.take_due(now);
        let busy = ServerFrame::parse(json!({"type": "error", "data": {
            "code": "too_many_in_flight", "retryable": true, "retryAfterMs": 100,
            "clientId": "c-1"}}));
        assert!(state.accept(busy, now).surface.is_some());
        assert!(state.outbox.take_due(now).is_empty());
        assert_eq!(
            state.outbox.take_due(now + Duration::from_millis(100)),
            ["one"]
        );
        let refused = ServerFrame::parse(json!({"type": "error", "data": {
            "code": "payload_too_large", "retryable": false, "clientId": "c-2"}}));
        assert!(state.accept(refused, now).surface.is_some());
        assert_eq!(state.outbox.client_ids(), ["c-1"]);
    }

    #[test]
    fn a_truncated_replay_asks_for_the_rest_and_holds_the_watermark() {
        let now = Instant::now();
        let mut state = state(0);
        state.on_welcome(&welcome(CONVERSATION, 1500), now);
        for seq in 1..=1000 {
            state.accept(message(seq), now);
        }
        let truncated = ServerFrame::parse(
            json!({"type": "replayTruncated", "data": {"watermark": 1000, "headSeq": 1500}}),
        );
        assert_eq!(state.accept(truncated, now).sync_from, Some(1000));
        // A live frame after the head arrives before the sync's replay.
        assert!(state.accept(message(1501), now).surface.is_some());
        assert_eq!(state.hello("t")["watermark"], 1000);
        let heartbeat =
            ServerFrame::parse(json!({"type": "heartbeat", "timestamp": 1, "headSeq": 1501}));
        assert_eq!(state.accept(heartbeat.clone(), now).sync_from, Some(1000));
        let replayed = (1001..=1501)
            .filter(|seq| state.accept(message(*seq), now).surface.is_some())
            .count();
        assert_eq!(replayed, 500);
        assert_eq!(state.accept(heartbeat, now).sync_from, None);
        assert_eq!(state.hello("t")["watermark"], 1501);
    }

    #[test]
    fn a_watermark_above_the_head_or_another_conversation_starts_over() {
        let now = Instant::now();
        let mut state = state(40);
        state.on_welcome(&welcome(CONVERSATION, 7), now);
        assert_eq!(state.seen.watermark(), 7);
        assert!(state.accept(message(8), now).surface.is_some());

        let other = "0193e0a4-0000-7000-8000-000000000002";
        state.on_welcome(&welcome(other, 3), now);
        assert_eq!(state.conversation_id, Some(other.parse().unwrap()));
        assert_eq!(state.seen.watermark(), 0);
        assert!(state.accept(message(1), now).surface.is_some());
    }

    #[test]
    fn a_welcome_requeues_unacked_sends_within_the_announced_limit() {
        let now = Instant::now();
        let mut state = state(0);
        for client_id in ["c-1", "c-2", "c-3"] {
            state.outbox.push(client_id, client_id.into(), now);
        }
        state.outbox.take_due(now);
        state.on_welcome(&welcome(CONVERSATION, 0), now);
        // maxInFlight 2 from the welcome.
        assert_eq!(state.outbox.take_due(now), ["c-1", "c-2"]);
    }
}
