//! The agent side: a channel-scope connection in a group, a stream of typed turns, and replies
//! that are resent with the same clientId until the server acknowledges them, across
//! reconnects.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;
use uuid::Uuid;

use crate::error::ClientError;
use crate::outbox::Outbox;
use crate::outgoing;
use crate::session::{Link, SessionOptions};
use crate::tracking::{ChannelTracker, REMEMBERED_CONVERSATIONS};

/// The error type of the agent side: the crate's one error type, under its first name.
pub type AgentError = ClientError;

/// Wait before resending a result the server failed to store (`internal`) without a delay.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Refusals of a result that say nothing about the result itself: it is resent (as the Python
/// SDK does).
const RESENT_CODES: [&str; 4] = [
    "internal",
    "unavailable",
    "rate_limited",
    "too_many_in_flight",
];

/// One user turn delivered to this agent.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// Conversation.
    pub conversation_id: Uuid,
    /// The turn's seq.
    pub seq: i64,
    /// The turn's revision.
    pub revision: i64,
    /// Stable key for external tools' idempotency (`meta.turn.key`).
    pub key: String,
    /// `edit` or `regenerate` for revisions above 0.
    pub reason: Option<String>,
    /// The conversation's runtime version when delivered.
    pub runtime_version: i64,
    /// The conversation's runtime state when delivered.
    pub runtime_state: Value,
    /// The whole delivered frame (with `meta`).
    pub frame: Value,
    /// Lease mode: the fencing token of this delivery (`meta.turn.fence`), sent back with the
    /// reply.
    pub fence: Option<i64>,
    /// Set when the end user stops the turn (a `cancel`, docs/protocol.md §4.10).
    pub cancellation: Cancellation,
}

/// A turn's cancellation: set once the agent reads the turn's `cancel` (while it reads, in
/// [`Agent::next_turn`] or [`Agent::reply`]). An agent that stops work on it may still answer
/// within the grace period; one that does not loses only the race (the gateway settles it).
#[derive(Debug, Clone)]
pub struct Cancellation {
    reason: tokio::sync::watch::Receiver<Option<String>>,
}

impl Cancellation {
    /// A cancellation that is not set, with the sender that sets it.
    fn new() -> (tokio::sync::watch::Sender<Option<String>>, Cancellation) {
        let (sender, reason) = tokio::sync::watch::channel(None);
        (sender, Cancellation { reason })
    }

    /// True once the turn was cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.reason.borrow().is_some()
    }

    /// Why (`stopped`, `superseded`, …), once cancelled.
    pub fn reason(&self) -> Option<String> {
        self.reason.borrow().clone()
    }

    /// Resolves when the turn is cancelled (never, if the agent is dropped first).
    pub async fn cancelled(&mut self) -> String {
        match self.reason.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or_default(),
            Err(_) => std::future::pending().await,
        }
    }
}

/// Two turns' cancellations are equal when they are the same one.
impl PartialEq for Cancellation {
    fn eq(&self, other: &Self) -> bool {
        self.reason.same_channel(&other.reason)
    }
}

/// Turns whose cancellation an agent can still set: the most recent deliveries.
const CANCELLABLE_TURNS: usize = 4_096;

impl Turn {
    /// What an answer to this turn names.
    pub fn answering(&self) -> outgoing::Answering {
        outgoing::Answering {
            conversation_id: self.conversation_id,
            seq: self.seq,
            revision: self.revision,
            fence: self.fence,
            runtime_version: self.runtime_version,
        }
    }

    /// The user's text, for `text` turns.
    pub fn text(&self) -> Option<&str> {
        self.frame["data"]["text"].as_str()
    }

    /// Reads a delivered envelope; `None` for anything that is not a user turn with `meta`.
    pub fn from_envelope(envelope: &Value) -> Option<Turn> {
        let frame = envelope.get("frame")?;
        let turn = frame.get("meta")?.get("turn")?;
        Some(Turn {
            conversation_id: envelope["conversationId"].as_str()?.parse().ok()?,
            seq: turn["seq"].as_i64()?,
            revision: turn["revision"].as_i64().unwrap_or(0),
            key: turn["key"].as_str()?.to_owned(),
            reason: turn["reason"].as_str().map(str::to_owned),
            runtime_version: frame["meta"]["runtime"]["version"].as_i64().unwrap_or(0),
            runtime_state: frame["meta"]["runtime"]["state"].clone(),
            frame: frame.clone(),
            fence: turn["fence"].as_i64(),
            cancellation: Cancellation::new().1,
        })
    }
}

/// The server's acknowledgement of a reply.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplyAck {
    /// The stored frames' seqs.
    pub seqs: Vec<i64>,
    /// True when an earlier send of the same reply was already stored.
    pub duplicate: bool,
}

/// How to open an [`Agent`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentOptions {
    /// The group to join (`None` observes).
    pub group: Option<String>,
    /// Per conversation, the highest seq already seen: replayed after the first `welcome`.
    pub watermarks: HashMap<Uuid, i64>,
    /// Writes of one reply without an ack before [`ClientError::Unacknowledged`].
    pub reply_attempts: u32,
    /// Lease mode (`hello.claim: "lease"`, needs a group): each turn comes with a fence that the
    /// reply carries back.
    pub lease: bool,
    /// At most this many conversations (the most recently active) in `hello.watermarks`
    /// on reconnect, which keeps the hello far below `maxFrameBytes`.
    pub hello_watermarks: usize,
    /// Timeouts and reconnect settings; `ack_timeout` is the wait between reply writes.
    pub session: SessionOptions,
}

impl Default for AgentOptions {
    /// An observer, no watermarks, 5 writes of a reply 5 s apart, 500 conversations in hello.
    fn default() -> AgentOptions {
        AgentOptions {
            group: None,
            watermarks: HashMap::new(),
            reply_attempts: 5,
            lease: false,
            hello_watermarks: 500,
            session: SessionOptions::default(),
        }
    }
}

/// A connected agent.
///
/// When the connection ends for a reason a new connection can fix, the next call reconnects
/// with jittered exponential backoff (honouring `retryAfterMs`), sends `hello.watermarks` with
/// the highest seq seen per conversation, and resends every unacknowledged reply with its
/// clientId (the server answers a resend with the first ack plus `duplicate: true`). A turn is
/// handed out once per `(conversation, seq, revision)`. A reconnected agent is a new group
/// member (new `connectionId` and `since`); [`Agent::welcome`] shows the latest.
///
/// ```no_run
/// use converger_client::agent::Agent;
/// use serde_json::json;
///
/// # async fn run() -> Result<(), converger_client::ClientError> {
/// let url = "ws://127.0.0.1:8080/socket/converger/v1";
/// let mut agent = Agent::connect(url, "<channel-scope token>", Some("echo")).await?;
/// println!("member {}", agent.welcome()["connectionId"]);
/// loop {
///     let turn = agent.next_turn().await?;
///     let text = format!("echo: {}", turn.text().unwrap_or(""));
///     let frames = vec![json!({"type": "text", "data": {"text": text}})];
///     let ack = agent.reply(&turn, frames, None).await?;
///     println!("answered {} with seqs {:?}", turn.key, ack.seqs);
/// }
/// # }
/// ```
pub struct Agent {
    token: String,
    group: Option<String>,
    link: Link,
    welcome: Value,
    pending: VecDeque<Value>,
    outbox: Outbox,
    seen: ChannelTracker,
    reply_attempts: u32,
    lease: bool,
    hello_watermarks: usize,
    /// The cancellations of recent turns, by turn key, oldest first.
    cancellable: VecDeque<(String, tokio::sync::watch::Sender<Option<String>>)>,
}

impl Agent {
    /// Connects to `ws_url` (…/socket/converger/v1) with a channel-scope token, joining `group`
    /// (`None` observes), and waits for `welcome` (one attempt: a failure here is returned,
    /// later ones are reconnected).
    pub async fn connect(
        ws_url: &str,
        token: &str,
        group: Option<&str>,
    ) -> Result<Agent, ClientError> {
        let options = AgentOptions {
            group: group.map(str::to_owned),
            ..AgentOptions::default()
        };
        Agent::connect_with(ws_url, token, options).await
    }

    /// Connects with explicit options.
    pub async fn connect_with(
        ws_url: &str,
        token: &str,
        options: AgentOptions,
    ) -> Result<Agent, ClientError> {
        let mut agent = Agent {
            token: token.to_owned(),
            group: options.group,
            outbox: Outbox::new(options.session.ack_timeout),
            link: Link::new(ws_url, options.session),
            welcome: Value::Null,
            pending: VecDeque::new(),
            seen: ChannelTracker::new(REMEMBERED_CONVERSATIONS, &options.watermarks),
            reply_attempts: options.reply_attempts.max(1),
            lease: options.lease,
            hello_watermarks: options.hello_watermarks,
            cancellable: VecDeque::new(),
        };
        let opened = agent.link.connect_once(&agent.hello()).await?;
        agent.on_welcome(opened.welcome, opened.early);
        Ok(agent)
    }

    /// The latest `welcome.data` object (connectionId, since, group, limits).
    pub fn welcome(&self) -> &Value {
        &self.welcome["data"]
    }

    /// Per conversation, the highest seq seen (what the next `hello.watermarks` is built from).
    pub fn watermarks(&self) -> HashMap<Uuid, i64> {
        self.seen.watermarks(usize::MAX).into_iter().collect()
    }

    /// Uses `token` for the next reconnects (say, after `token_expired`).
    pub fn set_token(&mut self, token: &str) {
        self.token = token.to_owned();
    }

    /// The next turn delivered to this agent, each `(conversation, seq, revision)` once; other
    /// frames are skipped. Reconnects as needed (see [`Agent`]).
    pub async fn next_turn(&mut self) -> Result<Turn, ClientError> {
        loop {
            let envelope = match self.pending.pop_front() {
                Some(envelope) => envelope,
                None => match self.step().await? {
                    Some(envelope) => envelope,
                    None => continue,
                },
            };
            if let Some(client_id) = answered_client_id(&envelope) {
                // The answer to a reply whose caller stopped waiting (a cancelled future).
                self.outbox.settle(client_id);
                continue;
            }
            if self.cancel(&envelope) {
                continue;
            }
            let Some(mut turn) = Turn::from_envelope(&envelope) else {
                continue;
            };
            if self
                .seen
                .first_delivery(turn.conversation_id, turn.seq, turn.revision, turn.fence)
            {
                let (sender, cancellation) = Cancellation::new();
                turn.cancellation = cancellation;
                if self.cancellable.len() >= CANCELLABLE_TURNS {
                    self.cancellable.pop_front();
                }
                self.cancellable.push_back((turn.key.clone(), sender));
                return Ok(turn);
            }
        }
    }

    /// Answers a turn with `frames` (whole frame objects) and, optionally, the new runtime
    /// state (written against the version the turn was delivered with). The same clientId is
    /// resent until the server acknowledges, on this connection every `ack_timeout` and after
    /// every reconnect, so a lost ack never produces a second answer. A refusal is returned as
    /// [`ClientError::Refused`] (`turn_conflict`, `stale_runtime`, …), except the server's own
    /// failures and pacing (`internal`, `unavailable`, `rate_limited`, `too_many_in_flight`),
    /// which are resent after their `retryAfterMs`. When the session itself fails ([`ClientError::GaveUp`], [`ClientError::Closed`])
    /// the result stays queued and goes out again after the next successful reconnect.
    pub async fn reply(
        &mut self,
        turn: &Turn,
        frames: Vec<Value>,
        runtime_state: Option<Value>,
    ) -> Result<ReplyAck, ClientError> {
        let client_id = result_client_id(turn);
        let envelope = result_envelope(turn, &client_id, frames, runtime_state);
        self.outbox
            .push(&client_id, envelope.to_string(), Instant::now());
        loop {
            if self
                .outbox
                .exhausted(&client_id, self.reply_attempts, Instant::now())
            {
                self.outbox.settle(&client_id);
                return Err(ClientError::Unacknowledged(self.reply_attempts));
            }
            let Some(envelope) = self.step().await? else {
                continue;
            };
            if self.cancel(&envelope) {
                continue;
            }
            let Some(answered) = answered_client_id(&envelope) else {
                self.pending.push_back(envelope);
                continue;
            };
            if answered != client_id {
                self.outbox.settle(answered);
                continue;
            }
            let frame = &envelope["frame"];
            if frame["type"] == "ack" {
                self.outbox.settle(&client_id);
                return Ok(reply_ack(frame));
            }
            let data = &frame["data"];
            if data["code"]
                .as_str()
                .is_some_and(|code| RESENT_CODES.contains(&code))
            {
                let after = data["retryAfterMs"]
                    .as_u64()
                    .map_or(DEFAULT_RETRY_AFTER, Duration::from_millis);
                self.outbox.retry_at(&client_id, Instant::now() + after);
                continue;
            }
            self.outbox.settle(&client_id);
            return Err(ClientError::refused(data));
        }
    }

    /// Sends one enveloped frame as it is, with no resend (stream chunks and aborts); fails
    /// with [`ClientError::Closed`] when the connection is down.
    pub async fn send_enveloped(
        &mut self,
        conversation_id: Uuid,
        frame: Value,
    ) -> Result<(), ClientError> {
        let envelope = serde_json::json!({"conversationId": conversation_id, "frame": frame});
        if self.link.write(envelope.to_string()).await {
            Ok(())
        } else {
            Err(ClientError::NotConnected)
        }
    }

    /// Closes the connection (close 1000), so the member leaves its group at once.
    pub async fn close(mut self) {
        self.link.close().await;
    }

    fn hello(&self) -> Value {
        outgoing::agent_hello(
            &self.token,
            self.group.as_deref(),
            self.lease,
            self.seen.watermarks(self.hello_watermarks),
        )
    }

    fn on_welcome(&mut self, welcome: Value, early: Vec<Value>) {
        for envelope in &early {
            self.observe(envelope);
        }
        self.pending.extend(early);
        if let Some(limit) = welcome["data"]["limits"]["maxInFlight"].as_u64() {
            self.outbox
                .set_max_in_flight(usize::try_from(limit).unwrap_or(usize::MAX));
        }
        self.outbox.requeue_all(Instant::now());
        self.welcome = welcome;
    }

    /// One step: reconnect, or read one envelope (`None` for a timer or control frame).
    async fn step(&mut self) -> Result<Option<Value>, ClientError> {
        if !self.link.is_connected() {
            let opened = self.link.reconnect(&self.hello()).await?;
            self.on_welcome(opened.welcome, opened.early);
            return Ok(None);
        }
        let Some(envelope) = self.link.read(&mut self.outbox).await? else {
            return Ok(None);
        };
        self.observe(&envelope);
        Ok(Some(envelope))
    }

    /// Sets the cancellation of the turn a `cancel` names; false for any other frame.
    fn cancel(&mut self, envelope: &Value) -> bool {
        let frame = &envelope["frame"];
        if frame["type"] != "cancel" {
            return false;
        }
        let key = frame["turn"]["key"].as_str().unwrap_or_default();
        let reason = frame["reason"].as_str().unwrap_or("stopped").to_owned();
        if let Some(position) = self.cancellable.iter().position(|(turn, _)| turn == key)
            && let Some((_, sender)) = self.cancellable.remove(position)
        {
            let _ = sender.send(Some(reason));
        }
        true
    }

    /// Raises the conversation's watermark for a delivered persistent frame.
    fn observe(&mut self, envelope: &Value) {
        let frame = &envelope["frame"];
        // A proactive ack's seq is this agent's own frame; replays never send it back, so it
        // must not hide a lower seq that is still on its way.
        if frame["type"] == "ack" || frame["type"] == "error" {
            return;
        }
        let conversation = envelope["conversationId"]
            .as_str()
            .and_then(|id| id.parse::<Uuid>().ok());
        if let (Some(conversation), Some(seq)) = (conversation, frame["seq"].as_i64()) {
            self.seen.observe_seq(conversation, seq);
        }
    }
}

/// The clientId of a turn's result: `result-<conversation as 32 hex digits>-<seq>-<revision>`,
/// the same for every resend of that answer.
pub fn result_client_id(turn: &Turn) -> String {
    turn.answering().result_client_id()
}

/// The clientId an enveloped `ack` or `error` answers.
fn answered_client_id(envelope: &Value) -> Option<&str> {
    let frame = envelope.get("frame")?;
    match frame["type"].as_str()? {
        "ack" => frame["clientId"].as_str(),
        "error" => frame["data"]["clientId"].as_str(),
        _ => None,
    }
}

fn reply_ack(frame: &Value) -> ReplyAck {
    let seqs = frame["seqs"]
        .as_array()
        .map(|seqs| seqs.iter().filter_map(Value::as_i64).collect())
        .unwrap_or_default();
    ReplyAck {
        seqs,
        duplicate: frame["duplicate"] == true,
    }
}

/// The enveloped `turnResult` answering `turn` (see [`outgoing::result_envelope`]).
pub fn result_envelope(
    turn: &Turn,
    client_id: &str,
    frames: Vec<Value>,
    runtime_state: Option<Value>,
) -> Value {
    outgoing::result_envelope(&turn.answering(), client_id, frames, runtime_state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CONVERSATION: &str = "0193e0a4-0000-7000-8000-000000000001";

    fn delivered(seq: i64, revision: i64) -> Value {
        json!({"conversationId": CONVERSATION, "frame": {"type": "text", "id": "a", "seq": seq,
            "from": "user", "sender": {"id": "alice", "role": "user"},
            "data": {"text": "hello"}, "timestamp": 1,
            "meta": {"channel": {"id": "c"}, "participant": {"id": "alice", "role": "user"},
                "turn": {"seq": seq, "revision": revision,
                    "key": format!("{CONVERSATION}:{seq}:{revision}")},
                "runtime": {"version": 3, "state": {"count": 3}}}}})
    }

    #[test]
    fn a_delivered_turn_is_read_from_its_envelope() {
        let turn = Turn::from_envelope(&delivered(18, 1)).unwrap();
        assert_eq!(turn.conversation_id.to_string(), CONVERSATION);
        assert_eq!((turn.seq, turn.revision), (18, 1));
        assert_eq!(turn.key, format!("{CONVERSATION}:18:1"));
        assert_eq!(turn.text(), Some("hello"));
        assert_eq!(turn.runtime_version, 3);
        assert_eq!(turn.runtime_state, json!({"count": 3}));
        let plain = json!({"conversationId": CONVERSATION, "frame": {"type": "text", "seq": 2}});
        assert_eq!(Turn::from_envelope(&plain), None);
    }

    #[test]
    fn the_result_client_id_is_stable_per_turn_and_revision() {
        let turn = Turn::from_envelope(&delivered(18, 1)).unwrap();
        assert_eq!(
            result_client_id(&turn),
            "result-0193e0a4000070008000000000000001-18-1"
        );
        let envelope = result_envelope(&turn, "r", vec![json!({"type": "text"})], None);
        assert_eq!(envelope["frame"]["turn"], json!({"seq": 18, "revision": 1}));
        assert_eq!(envelope["frame"].get("runtime"), None);
        let with_state = result_envelope(&turn, "r", Vec::new(), Some(json!({"n": 1})));
        assert_eq!(
            with_state["frame"]["runtime"],
            json!({"version": 3, "state": {"n": 1}})
        );
    }

    #[test]
    fn acks_and_errors_name_the_reply_they_answer() {
        let ack = json!({"conversationId": CONVERSATION, "frame": {"type": "ack",
            "clientId": "r-1", "turn": {"seq": 1, "revision": 0}, "ids": ["x"], "seqs": [2, 3],
            "timestamp": 1, "duplicate": true}});
        assert_eq!(answered_client_id(&ack), Some("r-1"));
        assert_eq!(
            reply_ack(&ack["frame"]),
            ReplyAck {
                seqs: vec![2, 3],
                duplicate: true
            }
        );
        let error = json!({"conversationId": CONVERSATION, "frame": {"type": "error",
            "data": {"code": "turn_conflict", "clientId": "r-2", "details": {"seqs": [4]}}}});
        assert_eq!(answered_client_id(&error), Some("r-2"));
        assert_eq!(answered_client_id(&delivered(1, 0)), None);
        let bare = json!({"type": "error", "data": {"code": "rate_limited", "clientId": "r-3"}});
        assert_eq!(answered_client_id(&bare), None);
    }
}
