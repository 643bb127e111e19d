//! A conversation-scope session: one end user's connection to one conversation.
//!
//! One task per connection owns all session state and handles, one at a time, inbound frames,
//! live events of the conversation, completed commits, timers and orders from the node (drain,
//! channel deactivation). A writer task owns the socket's sending half.

use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{Message, WebSocket};
use converger_core::replay::{LiveDecision, ReplayCursor, ReplayPlan};
use converger_protocol::{
    ClientFrame, CloseCode, ErrorCode, ErrorFrame, MessageFrame, Refusal, parse_client_text,
    retry_close_reason,
};
use converger_store::bus::{Origin, TransientFrame};
use converger_store::faults;
use converger_store::{
    Activity, CommitOutcome, NewActivity, Sender, SenderRole, StoreError, Viewer,
};
use futures_util::StreamExt;
use futures_util::stream::SplitStream;
use serde_json::{Value, json};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use uuid::Uuid;

use super::UpgradeRequest;
use super::handshake::{Established, Profile, Setup, establish};
use super::outbound::{Outbound, PushError};
use super::rate::TokenBucket;
use crate::auth::Claims;
use crate::hub::{HubEvent, SessionControl};
use crate::state::AppState;

/// Frame types a mekik client may receive besides persistent message frames.
const MEKIK_TRANSIENT_TYPES: &[&str] = &[
    "welcome",
    "run",
    "typing",
    "error",
    "genui_components",
    "skills",
];

/// The role of the end user in `sender.role` and presence frames.
const USER_ROLE: &str = "user";

type CommitFuture = Pin<Box<dyn Future<Output = CommitDone> + Send>>;

/// A send waiting for its commit.
struct PendingSend {
    frame: MessageFrame,
}

/// A finished commit.
struct CommitDone {
    client_id: Option<String>,
    frame_type: String,
    result: Result<CommitOutcome, StoreError>,
}

/// Why the session loop ended.
pub(super) enum Ending {
    /// The client closed or the socket failed: nothing more to send.
    Gone,
    /// Close with this code and reason after what is queued.
    Close { code: u16, reason: String },
    /// Drop the backlog and close at once.
    CloseNow { code: u16, reason: String },
}

/// Runs one upgraded connection to its end.
pub(crate) async fn serve(socket: WebSocket, state: AppState, request: UpgradeRequest) {
    let (sink, mut stream) = socket.split();
    let limits = state.config.limits.clone();
    let outbound = Arc::new(Outbound::new(limits.outbound_queue_frames));
    let writer = tokio::spawn(super::writer::run(
        sink,
        Arc::clone(&outbound),
        Duration::from_millis(limits.write_timeout_ms),
    ));
    metrics::counter!("converger_ws_connections_total").increment(1);

    // The stages are boxed so that this task, which lives as long as the connection, holds only
    // the stage it is in: inlined, the largest (the agent session) would size every idle
    // connection's future.
    let ending = match Box::pin(await_hello(&state, &mut stream, &outbound)).await {
        Err(ending) => ending,
        Ok(hello) => match Box::pin(establish(&state, &request, *hello)).await {
            Err(refused) => {
                push_error(&outbound, &refused.error);
                match refused.close {
                    Some(close) => Ending::Close {
                        code: close.number(),
                        reason: refused.error.code.as_str().to_owned(),
                    },
                    None => Ending::Close {
                        code: CloseCode::Protocol.number(),
                        reason: String::new(),
                    },
                }
            }
            Ok(Setup::Conversation(established)) => {
                Box::pin(run_session(&state, established, &mut stream, &outbound)).await
            }
            Ok(Setup::Channel(setup)) => {
                Box::pin(super::agent::run(&state, setup, &mut stream, &outbound)).await
            }
        },
    };
    match ending {
        Ending::Gone => outbound.close_now(CloseCode::Normal.number(), String::new()),
        Ending::Close { code, reason } => outbound.close(code, reason),
        Ending::CloseNow { code, reason } => outbound.close_now(code, reason),
    }
    // Finish the closing handshake: the writer flushes the close frame while the reader waits
    // for the peer's close (a peer that does not answer within the grace period is dropped).
    let closing_handshake = async move {
        let _ = writer.await;
        while let Some(Ok(message)) = stream.next().await {
            if matches!(message, Message::Close(_)) {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), closing_handshake).await;
}

pub(super) fn push_error(outbound: &Outbound, error: &ErrorFrame) {
    let _ = outbound.push_text(error.to_json().to_string(), false);
}

fn refusal_frame(refusal: &Refusal) -> ErrorFrame {
    ErrorFrame {
        client_id: refusal.client_id.clone(),
        frame_type: refusal.frame_type.clone(),
        ..ErrorFrame::new(refusal.error.code, refusal.error.message.clone())
    }
}

/// Reads frames until `hello`; anything else before it is answered with `no_session`.
async fn await_hello(
    state: &AppState,
    stream: &mut SplitStream<WebSocket>,
    outbound: &Outbound,
) -> Result<Box<converger_protocol::Hello>, Ending> {
    let limits = &state.config.limits;
    let idle = Duration::from_millis(limits.idle_timeout_ms);
    loop {
        let message = match tokio::time::timeout(idle, stream.next()).await {
            Err(_) => {
                return Err(Ending::Close {
                    code: CloseCode::Idle.number(),
                    reason: "idle".into(),
                });
            }
            Ok(None) => return Err(Ending::Gone),
            Ok(Some(Err(error))) => return Err(read_failure(&error)),
            Ok(Some(Ok(message))) => message,
        };
        let text = match message {
            Message::Text(text) => text,
            Message::Binary(_) => {
                push_error(
                    outbound,
                    &ErrorFrame::new(
                        ErrorCode::InvalidMessage,
                        "binary messages are not accepted",
                    ),
                );
                continue;
            }
            Message::Close(_) => return Err(Ending::Gone),
            Message::Ping(_) | Message::Pong(_) => continue,
        };
        if text.len() > limits.max_frame_bytes {
            push_error(
                outbound,
                &ErrorFrame::new(ErrorCode::PayloadTooLarge, "frame too large"),
            );
            continue;
        }
        match parse_client_text(text.as_str(), limits) {
            Ok(ClientFrame::Hello(hello)) => return Ok(hello),
            Ok(_) => push_error(
                outbound,
                &ErrorFrame::new(ErrorCode::NoSession, "send hello first"),
            ),
            Err(refusal) => push_error(outbound, &refusal_frame(&refusal)),
        }
    }
}

/// Everything one session knows.
struct Session<'a> {
    state: &'a AppState,
    outbound: &'a Outbound,
    profile: Profile,
    claims: Claims,
    conversation_id: Uuid,
    channel_id: Uuid,
    user_id: String,
    connection_id: Uuid,
    cursor: ReplayCursor,
    /// Seqs this connection sent and had acked, not yet passed by the cursor: never pushed back.
    own_seqs: BTreeSet<i64>,
    sends: VecDeque<PendingSend>,
    in_flight: bool,
    /// `sync` watermarks waiting for the sends before them to be acked, so a replay never
    /// shows this connection a frame of its own before its ack.
    deferred_syncs: VecDeque<u64>,
    rate: TokenBucket,
    last_inbound: Instant,
    last_outbound: Instant,
    typing_relayed: Option<(bool, Instant)>,
    token_expires_at: Instant,
    draining: Option<u64>,
}

/// The instant at which a token's `exp` (seconds since the epoch) passes.
pub(super) fn expiry_instant(exp: i64) -> Instant {
    let remaining = exp.saturating_sub(chrono::Utc::now().timestamp()).max(0);
    Instant::now() + Duration::from_secs(u64::try_from(remaining).unwrap_or(0))
}

async fn run_session(
    state: &AppState,
    established: Established,
    stream: &mut SplitStream<WebSocket>,
    outbound: &Outbound,
) -> Ending {
    let Established {
        profile,
        claims,
        conversation,
        user_id,
        watermark,
        hello,
    } = established;
    let (control_sender, mut controls) = mpsc::channel::<SessionControl>(8);
    let guard = state.hub.register(conversation.channel_id, control_sender);
    // Subscribe before reading the head: whatever commits from now on is either in the replay
    // or arrives live (and the cursor drops what the replay already sent).
    let mut live = state.hub.subscribe(conversation.id);
    let head = match state.store.conversation(conversation.id).await {
        Ok(Some(current)) => u64::try_from(current.last_seq).unwrap_or(0),
        Ok(None) => return internal_close(outbound),
        Err(error) => {
            tracing::error!(%error, "session: cannot read the head");
            return internal_close(outbound);
        }
    };
    let limits = &state.config.limits;
    let now = Instant::now();
    let invalid_watermark = watermark > head;
    let watermark = if invalid_watermark { head } else { watermark };
    let cap = match profile {
        Profile::Converger => Some(limits.replay_max as u64),
        Profile::Mekik => None,
    };
    let (cursor, plan) = ReplayCursor::start(watermark, head, cap);
    let mut session = Session {
        state,
        outbound,
        profile,
        token_expires_at: expiry_instant(claims.exp),
        claims,
        conversation_id: conversation.id,
        channel_id: conversation.channel_id,
        user_id,
        connection_id: guard.connection_id(),
        cursor,
        own_seqs: BTreeSet::new(),
        sends: VecDeque::new(),
        in_flight: false,
        deferred_syncs: VecDeque::new(),
        rate: TokenBucket::new(limits.max_frames_per_sec, now.into_std()),
        last_inbound: now,
        last_outbound: now,
        typing_relayed: None,
        draining: None,
    };
    // Boxed, and the hello and conversation dropped, so the idle session's future and heap keep
    // only what the session loop needs (memory per idle connection, docs/benchmarks.md).
    if let Err(ending) = Box::pin(session.welcome(head, &hello, invalid_watermark, plan)).await {
        return ending;
    }
    drop(hello);
    drop(conversation);
    session.presence_changed(true);
    let ending = session.run(stream, &mut live, &mut controls).await;
    session.presence_changed(false);
    drop(guard);
    ending
}

pub(super) fn internal_close(outbound: &Outbound) -> Ending {
    push_error(
        outbound,
        &ErrorFrame::new(ErrorCode::Internal, "internal error"),
    );
    Ending::Close {
        code: CloseCode::Internal.number(),
        reason: "internal".into(),
    }
}

impl Session<'_> {
    fn is_converger(&self) -> bool {
        self.profile == Profile::Converger
    }

    /// Queues a frame for this client, applying the mekik filter; a full queue of persistent
    /// frames means the client cannot keep up.
    fn push(&mut self, frame: &Value, transient: bool) -> Result<(), Ending> {
        if self.profile == Profile::Mekik && transient {
            let kind = frame
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if !MEKIK_TRANSIENT_TYPES.contains(&kind) {
                return Ok(());
            }
        }
        match self.outbound.push_text(frame.to_string(), transient) {
            Ok(()) => {
                self.last_outbound = Instant::now();
                Ok(())
            }
            Err(PushError::Closed) => Err(Ending::Gone),
            Err(PushError::Full) => Err(self.slow_consumer()),
        }
    }

    fn slow_consumer(&self) -> Ending {
        metrics::counter!("converger_ws_slow_consumer_total").increment(1);
        tracing::info!(connection_id = %self.connection_id, "slow consumer: closing");
        Ending::CloseNow {
            code: CloseCode::SlowConsumer.number(),
            reason: retry_close_reason(
                ErrorCode::SlowConsumer,
                self.state.config.drain.retry_after_ms,
            ),
        }
    }

    /// Errors are never dropped under pressure: a client may be waiting on one for its send.
    fn push_error(&mut self, error: ErrorFrame) -> Result<(), Ending> {
        self.push(&error.to_json(), false)
    }

    fn viewer(&self) -> Viewer<'_> {
        Viewer::EndUser {
            user_id: &self.user_id,
            include_client_id: true,
        }
    }

    /// Sends welcome, the catalogs, then the replay.
    async fn welcome(
        &mut self,
        head: u64,
        hello: &converger_protocol::Hello,
        invalid_watermark: bool,
        plan: ReplayPlan,
    ) -> Result<(), Ending> {
        let store = &self.state.store;
        let pending = store
            .pending_interrupts(self.conversation_id)
            .await
            .map_err(|error| {
                tracing::error!(%error, "session: cannot read interrupts");
                internal_close(self.outbound)
            })?;
        let pending: Vec<Value> = pending
            .into_iter()
            .map(|interrupt| json!({"id": interrupt.id, "data": interrupt.data}))
            .collect();
        let protocol = match self.profile {
            Profile::Converger => converger_protocol::PROTOCOL_NAME,
            Profile::Mekik => "mekik/1",
        };
        let welcome = json!({
            "type": "welcome",
            "data": {
                "protocol": protocol,
                "compat": ["mekik/1"],
                "scope": "conversation",
                "conversationId": self.conversation_id,
                "userId": self.user_id,
                "connectionId": self.connection_id,
                "watermark": head,
                "pending": pending,
                "expiresAt": self.claims.exp.saturating_mul(1000),
                "capabilities": {"acks": true, "typing": true, "receipts": true, "presence": true, "edit": true, "regenerate": true},
                "limits": self.state.config.limits.to_wire(false),
            }
        });
        self.push(&welcome, false)?;
        let catalogs = store
            .channel_catalogs(self.channel_id)
            .await
            .map_err(|_| internal_close(self.outbound))?;
        if let Some(components) = catalogs.components {
            let frame = catalog_frame(
                "genui_components",
                "components",
                &components,
                hello.components_hash.as_deref(),
            );
            self.push(&frame, false)?;
        }
        if let Some(skills) = catalogs.skills {
            let frame = catalog_frame("skills", "skills", &skills, hello.skills_hash.as_deref());
            self.push(&frame, false)?;
        }
        if invalid_watermark {
            self.push_error(ErrorFrame::new(
                ErrorCode::InvalidWatermark,
                "watermark is above the conversation head",
            ))?;
        }
        self.replay(plan).await
    }

    /// Replays a plan from the database in batches, then `replayTruncated` when it was cut.
    async fn replay(&mut self, plan: ReplayPlan) -> Result<(), Ending> {
        self.push_range(plan.after, plan.upto, false).await?;
        if plan.truncated && self.is_converger() {
            let frame = json!({"type": "replayTruncated", "data": {"watermark": plan.upto, "headSeq": plan.head}});
            self.push(&frame, false)?;
        }
        Ok(())
    }

    /// Pushes the stored frames `after + 1 ..= upto`, skipping this connection's own sends when
    /// `skip_own`. Waits for queue space instead of failing: a replay is a known, finite backlog.
    async fn push_range(&mut self, after: u64, upto: u64, skip_own: bool) -> Result<(), Ending> {
        let batch = self.state.config.limits.replay_batch as i64;
        let mut next_after = after as i64;
        let upto = upto as i64;
        let write_timeout = Duration::from_millis(self.state.config.limits.write_timeout_ms);
        while next_after < upto {
            let limit = batch.min(upto - next_after);
            let rows = self
                .state
                .store
                .list_activities(self.conversation_id, next_after, limit)
                .await
                .map_err(|error| {
                    tracing::error!(%error, conversation_id = %self.conversation_id, "replay read failed");
                    internal_close(self.outbound)
                })?;
            let Some(last) = rows.last().map(|row| row.seq) else {
                break;
            };
            for row in rows {
                if skip_own && self.own_seqs.contains(&row.seq) {
                    continue;
                }
                let text = row.to_frame(self.viewer()).to_string();
                match self.outbound.push_text_waiting(text, write_timeout).await {
                    Ok(()) => self.last_outbound = Instant::now(),
                    Err(PushError::Closed) => return Err(Ending::Gone),
                    Err(PushError::Full) => return Err(self.slow_consumer()),
                }
            }
            next_after = last;
        }
        Ok(())
    }

    /// The main loop.
    async fn run(
        &mut self,
        stream: &mut SplitStream<WebSocket>,
        live: &mut broadcast::Receiver<HubEvent>,
        controls: &mut mpsc::Receiver<SessionControl>,
    ) -> Ending {
        let limits = self.state.config.limits.clone();
        let heartbeat_every = Duration::from_millis(limits.heartbeat_interval_ms);
        let idle_after = Duration::from_millis(limits.idle_timeout_ms);
        let mut heartbeat =
            tokio::time::interval_at(Instant::now() + heartbeat_every, heartbeat_every);
        let mut in_flight: Option<CommitFuture> = None;
        loop {
            // Live frames already waiting go first, so a client that keeps sending still sees
            // the conversation.
            if in_flight.is_none()
                && live.is_empty()
                && let Some(next) = self.sends.pop_front()
            {
                in_flight = Some(self.start_commit(next));
                self.in_flight = true;
            }
            if in_flight.is_none()
                && self.sends.is_empty()
                && let Some(watermark) = self.deferred_syncs.pop_front()
            {
                if let Err(ending) = self.on_sync(watermark).await {
                    return ending;
                }
                continue;
            }
            if let Some(retry_after_ms) = self.draining
                && in_flight.is_none()
                && self.sends.is_empty()
            {
                let _ = self.push_error(ErrorFrame {
                    retry_after_ms: Some(retry_after_ms),
                    ..ErrorFrame::new(
                        ErrorCode::Unavailable,
                        "node is draining; reconnect elsewhere",
                    )
                });
                return Ending::Close {
                    code: CloseCode::Draining.number(),
                    reason: retry_close_reason(ErrorCode::Unavailable, retry_after_ms),
                };
            }
            let reading =
                self.draining.is_none() && self.sends.len() < limits.max_in_flight.max(1) + 1;
            let idle_deadline = self.last_inbound + idle_after;
            let outcome = tokio::select! {
                message = stream.next(), if reading => self.on_message(message).await,
                // While this connection's own send commits, live frames wait: the commit's bus
                // echo must not arrive before the seq is known to be this connection's own.
                event = live.recv(), if in_flight.is_none() => self.on_live(event).await,
                control = controls.recv() => self.on_control(control),
                done = async { match in_flight.as_mut() { Some(commit) => commit.await, None => std::future::pending().await } } => {
                    in_flight = None;
                    self.in_flight = false;
                    self.on_commit(done)
                }
                _ = heartbeat.tick() => self.on_heartbeat(heartbeat_every),
                _ = tokio::time::sleep_until(idle_deadline) => Err(Ending::Close { code: CloseCode::Idle.number(), reason: "idle".into() }),
                _ = tokio::time::sleep_until(self.token_expires_at) => Err(self.on_token_expired()),
            };
            if let Err(ending) = outcome {
                return ending;
            }
        }
    }

    fn on_token_expired(&mut self) -> Ending {
        let error = match self.profile {
            Profile::Converger => ErrorFrame::new(
                ErrorCode::TokenExpired,
                "token expired; send auth with a new token",
            ),
            Profile::Mekik => ErrorFrame {
                details: Some(json!({"reason": "token_expired"})),
                ..ErrorFrame::new(ErrorCode::Unauthorized, "token expired")
            },
        };
        let _ = self.push_error(error);
        Ending::Close {
            code: CloseCode::Auth.number(),
            reason: "token_expired".into(),
        }
    }

    fn on_heartbeat(&mut self, every: Duration) -> Result<(), Ending> {
        self.outbound.push_ping();
        if self.is_converger() && self.last_outbound.elapsed() >= every {
            let frame = json!({"type": "heartbeat", "timestamp": now_ms(), "headSeq": self.cursor.last_sent()});
            self.push(&frame, true)?;
        }
        Ok(())
    }

    fn on_control(&mut self, control: Option<SessionControl>) -> Result<(), Ending> {
        match control {
            None => Ok(()),
            Some(SessionControl::Drain { retry_after_ms }) => {
                self.draining = Some(retry_after_ms);
                Ok(())
            }
            Some(SessionControl::Close {
                error,
                code,
                reason,
            }) => {
                if let Some(error) = error {
                    let _ = self.push_error(*error);
                }
                Err(Ending::Close { code, reason })
            }
        }
    }

    async fn on_message(
        &mut self,
        message: Option<Result<Message, axum::Error>>,
    ) -> Result<(), Ending> {
        let inbound = classify(message)?;
        self.last_inbound = Instant::now();
        let text = match inbound {
            Inbound::Text(text) => text,
            Inbound::Binary => return self.push_error(binary_refusal()),
            Inbound::Control => return Ok(()),
        };
        if let Err(wait) = self.rate.take(std::time::Instant::now()) {
            match self.profile {
                // A mekik client cannot handle rate_limited: hold the socket instead.
                Profile::Mekik => tokio::time::sleep(wait).await,
                Profile::Converger => {
                    return self.push_error(ErrorFrame {
                        retry_after_ms: Some(
                            u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1),
                        ),
                        ..ErrorFrame::new(ErrorCode::RateLimited, "too many frames per second")
                    });
                }
            }
        }
        let limits = &self.state.config.limits;
        if text.len() > limits.max_frame_bytes {
            return self.push_error(ErrorFrame::new(
                ErrorCode::PayloadTooLarge,
                "frame too large",
            ));
        }
        match parse_client_text(text.as_str(), limits) {
            Err(refusal) => self.push_error(refusal_frame(&refusal)),
            Ok(frame) => self.on_frame(frame).await,
        }
    }

    async fn on_frame(&mut self, frame: ClientFrame) -> Result<(), Ending> {
        match frame {
            // A second hello is ignored.
            ClientFrame::Hello(_) | ClientFrame::Unknown { .. } => Ok(()),
            ClientFrame::Message(message) => self.on_send(*message),
            ClientFrame::Sync { watermark } if self.in_flight || !self.sends.is_empty() => {
                self.deferred_syncs.push_back(watermark);
                Ok(())
            }
            ClientFrame::Sync { watermark } => self.on_sync(watermark).await,
            ClientFrame::Ping { nonce } => {
                if !self.is_converger() {
                    return Ok(());
                }
                let mut frame = json!({"type": "heartbeat", "timestamp": now_ms(), "headSeq": self.cursor.last_sent()});
                if let Some(nonce) = nonce {
                    frame["nonce"] = nonce;
                }
                self.push(&frame, true)
            }
            ClientFrame::Typing { is_typing } => self.on_typing(is_typing).await,
            ClientFrame::Read { watermark } => self.on_read(watermark).await,
            ClientFrame::Auth { token } => self.on_auth(&token),
            ClientFrame::Edit {
                target,
                client_id,
                data,
            } => self.on_revision(target, client_id, Some(data)).await,
            ClientFrame::Regenerate { target, client_id } => {
                self.on_revision(target, client_id, None).await
            }
            ClientFrame::Forwarded { kind, frame } => {
                let local = self.state.hub.has_agents(self.channel_id);
                if local || self.state.actors.has_remote_agents(self.channel_id) {
                    self.forward_to_agents(Value::Object(frame)).await;
                    return Ok(());
                }
                let client_id = frame
                    .get("clientId")
                    .and_then(Value::as_str)
                    .filter(|id| converger_protocol::is_valid_client_id(id))
                    .map(str::to_owned);
                self.push_error(ErrorFrame {
                    client_id,
                    frame_type: Some(kind),
                    ..ErrorFrame::new(
                        ErrorCode::BotUnavailable,
                        "no agent is connected to this conversation",
                    )
                })
            }
        }
    }

    /// `edit` (with `data`) or `regenerate`: revision + 1 of the targeted turn of this user.
    async fn on_revision(
        &mut self,
        target: converger_protocol::TurnTarget,
        client_id: Option<String>,
        data: Option<Value>,
    ) -> Result<(), Ending> {
        let frame_type = if data.is_some() { "edit" } else { "regenerate" };
        let refuse = |code: ErrorCode, message: &str| ErrorFrame {
            client_id: client_id.clone(),
            frame_type: Some(frame_type.into()),
            ..ErrorFrame::new(code, message)
        };
        let seq = target.seq.and_then(|seq| i64::try_from(seq).ok());
        let store = &self.state.store;
        let turn = match store
            .resolve_turn(
                self.conversation_id,
                &self.user_id,
                seq,
                target.message_id.as_deref(),
            )
            .await
        {
            Ok(Some(turn)) => turn,
            Ok(None) => {
                return self
                    .push_error(refuse(ErrorCode::BadRequest, "no turn of yours to revise"));
            }
            Err(error) => {
                tracing::warn!(%error, "revision target unreadable");
                return self.push_error(refuse(ErrorCode::Internal, "try again"));
            }
        };
        let edit = data
            .as_ref()
            .map(|data| (turn.kind.as_str(), data, client_id.as_deref()));
        let regenerate_key = if data.is_none() {
            client_id.as_deref()
        } else {
            None
        };
        let revision = match store.open_revision(&turn, edit, regenerate_key).await {
            Ok(revision) => revision,
            Err(StoreError::ConversationClosed) => {
                return self.push_error(refuse(
                    ErrorCode::ConversationClosed,
                    "conversation is closed",
                ));
            }
            Err(error) => {
                tracing::warn!(%error, "revision not stored");
                return self.push_error(refuse(ErrorCode::Internal, "the revision was not stored"));
            }
        };
        let mut ack = json!({"type": "ack", "clientId": client_id, "turn": {"seq": revision.turn_seq, "revision": revision.revision}});
        match revision.edit {
            Some(stored) => {
                let stored = Arc::new(stored);
                ack["id"] = json!(stored.id);
                ack["seq"] = json!(stored.seq);
                ack["timestamp"] = json!(stored.timestamp_ms());
                if revision.duplicate {
                    ack["duplicate"] = Value::Bool(true);
                } else {
                    // The edit is a persistent frame: everyone but this connection sees it.
                    self.own_seqs.insert(stored.seq);
                    let event = HubEvent::Committed {
                        seq: stored.seq,
                        activity: Some(stored),
                    };
                    self.state
                        .hub
                        .publish_to_all(self.channel_id, self.conversation_id, event);
                }
            }
            None if revision.duplicate => ack["duplicate"] = Value::Bool(true),
            None => {
                let event = HubEvent::Regenerated {
                    turn: Arc::new(turn),
                    revision: revision.revision,
                };
                self.state
                    .hub
                    .publish_to_agents(self.channel_id, self.conversation_id, event);
                if let Err(error) = self
                    .state
                    .store
                    .publish_regenerated(
                        self.state.hub.node_id(),
                        self.channel_id,
                        self.conversation_id,
                        revision.turn_seq,
                        revision.revision,
                    )
                    .await
                {
                    tracing::warn!(%error, "regenerated turn not published to other nodes");
                }
            }
        }
        if client_id.is_none() || !self.is_converger() {
            return Ok(());
        }
        self.push(&ack, false)
    }

    fn on_send(&mut self, frame: MessageFrame) -> Result<(), Ending> {
        if self.is_converger()
            && self.sends.len() + usize::from(self.in_flight)
                >= self.state.config.limits.max_in_flight
        {
            return self.push_error(ErrorFrame {
                client_id: frame.user_idempotency_key().map(str::to_owned),
                frame_type: Some(frame.kind.clone()),
                retry_after_ms: Some(100),
                ..ErrorFrame::new(ErrorCode::TooManyInFlight, "too many unacknowledged sends")
            });
        }
        self.sends.push_back(PendingSend { frame });
        Ok(())
    }

    fn start_commit(&self, send: PendingSend) -> CommitFuture {
        let store = self.state.store.clone();
        let frame = send.frame;
        let client_id = frame.user_idempotency_key().map(str::to_owned);
        let new = NewActivity {
            conversation_id: self.conversation_id,
            // A user's `id` is its idempotency key (mekik), never the stored frame id.
            id: None,
            kind: frame.kind.clone(),
            sender: Sender {
                id: self.user_id.clone(),
                role: SenderRole::User,
            },
            data: frame.data,
            metadata: frame.metadata,
            extra: Some(frame.extra),
            client_id: client_id.clone(),
        };
        let frame_type = frame.kind;
        Box::pin(async move {
            let result = store.commit_activity(&new).await;
            CommitDone {
                client_id,
                frame_type,
                result,
            }
        })
    }

    fn on_commit(&mut self, done: CommitDone) -> Result<(), Ending> {
        let CommitDone {
            client_id,
            frame_type,
            result,
        } = done;
        let outcome = match result {
            Ok(outcome) => outcome,
            Err(error) => {
                let code = match error {
                    StoreError::ConversationClosed => ErrorCode::ConversationClosed,
                    StoreError::ConversationNotFound => ErrorCode::ConversationNotFound,
                    _ => ErrorCode::Internal,
                };
                if code == ErrorCode::Internal {
                    tracing::error!(%error, conversation_id = %self.conversation_id, "send failed");
                }
                return self.push_error(ErrorFrame {
                    client_id,
                    frame_type: Some(frame_type),
                    ..ErrorFrame::new(code, "the frame was not stored")
                });
            }
        };
        if faults::injected(faults::AFTER_COMMIT_BEFORE_NOTIFY) {
            // As if the node died right after the commit: other nodes hear of it from the
            // database; this session neither dispatches nor acks.
            return Ok(());
        }
        let activity = Arc::new(outcome.activity);
        if !outcome.duplicate {
            metrics::counter!("converger_frames_committed_total").increment(1);
            self.own_seqs.insert(activity.seq);
            // The committing node dispatches at once; other nodes learn it from the bus.
            self.state.hub.publish_to_all(
                self.channel_id,
                self.conversation_id,
                HubEvent::Committed {
                    seq: activity.seq,
                    activity: Some(Arc::clone(&activity)),
                },
            );
        }
        let (Some(client_id), true) = (client_id, self.is_converger()) else {
            return Ok(());
        };
        let mut ack = json!({
            "type": "ack",
            "clientId": client_id,
            "id": activity.id,
            "seq": activity.seq,
            "timestamp": activity.timestamp_ms(),
        });
        if outcome.duplicate {
            ack["duplicate"] = Value::Bool(true);
        }
        if faults::injected(faults::ACK_SEND_DROP) {
            return Ok(());
        }
        self.push(&ack, false)
    }

    async fn on_live(
        &mut self,
        event: Result<HubEvent, broadcast::error::RecvError>,
    ) -> Result<(), Ending> {
        match event {
            Ok(HubEvent::Committed { seq, activity }) => self.on_committed(seq, activity).await,
            Ok(HubEvent::Regenerated { .. }) => Ok(()),
            Ok(HubEvent::Transient { frame, origin }) => {
                self.on_transient(&frame, origin.as_deref())
            }
            // Fell behind the hub's buffer: whatever was missed is read back from the database.
            Err(broadcast::error::RecvError::Lagged(_)) => {
                let head = match self.state.store.conversation(self.conversation_id).await {
                    Ok(Some(conversation)) => conversation.last_seq,
                    _ => return Ok(()),
                };
                self.on_committed(head, None).await
            }
            Err(broadcast::error::RecvError::Closed) => Err(Ending::Gone),
        }
    }

    async fn on_committed(
        &mut self,
        seq: i64,
        activity: Option<Arc<Activity>>,
    ) -> Result<(), Ending> {
        let Ok(seq_u) = u64::try_from(seq) else {
            return Ok(());
        };
        match self.cursor.on_live(seq_u) {
            LiveDecision::Drop => {}
            LiveDecision::Send => {
                if !self.own_seqs.contains(&seq) {
                    match activity {
                        Some(activity) => {
                            let frame = activity.to_frame(self.viewer());
                            self.push(&frame, false)?;
                        }
                        None => self.push_range(seq_u - 1, seq_u, true).await?,
                    }
                }
                self.cursor.advance_to(seq_u);
            }
            LiveDecision::FillGap { after, upto } => {
                self.push_range(after, upto, true).await?;
                self.cursor.advance_to(upto);
            }
        }
        let passed = self.cursor.last_sent() as i64;
        self.own_seqs.retain(|own| *own > passed);
        Ok(())
    }

    fn on_transient(&mut self, frame: &Value, origin: Option<&Origin>) -> Result<(), Ending> {
        if let Some(origin) = origin {
            if origin.connection == self.connection_id.to_string() {
                return Ok(());
            }
            let kind = frame
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or_default();
            // Typing and presence are for the other participants, never the author's own tabs
            // (a mekik client shows any typing as the bot typing).
            if matches!(kind, "typing" | "presence")
                && origin.id == self.user_id
                && origin.role == USER_ROLE
            {
                return Ok(());
            }
        }
        // Errors relayed from agents answer the user's frame: never dropped under pressure.
        let droppable = frame.get("type").and_then(Value::as_str) != Some("error");
        self.push(frame, droppable)
    }

    async fn on_sync(&mut self, watermark: u64) -> Result<(), Ending> {
        let head = match self.state.store.conversation(self.conversation_id).await {
            Ok(Some(conversation)) => u64::try_from(conversation.last_seq).unwrap_or(0),
            Ok(None) => return Err(internal_close(self.outbound)),
            Err(error) => {
                tracing::warn!(%error, "sync: cannot read the head");
                return self.push_error(ErrorFrame::new(ErrorCode::Internal, "try again"));
            }
        };
        if watermark > head {
            return self.push_error(ErrorFrame::new(
                ErrorCode::InvalidWatermark,
                "watermark is above the conversation head",
            ));
        }
        let cap = self
            .is_converger()
            .then_some(self.state.config.limits.replay_max as u64);
        let plan = self.cursor.plan_sync(watermark, head, cap);
        self.push_range(plan.after, plan.upto, false).await?;
        self.cursor.advance_to(plan.upto);
        if plan.truncated && self.is_converger() {
            let frame = json!({"type": "replayTruncated", "data": {"watermark": plan.upto, "headSeq": plan.head}});
            self.push(&frame, false)?;
        }
        Ok(())
    }

    fn origin(&self) -> Origin {
        Origin {
            id: self.user_id.clone(),
            role: USER_ROLE.into(),
            connection: self.connection_id.to_string(),
        }
    }

    /// Hands a client frame the gateway does not interpret to the channel's agents, on this node
    /// and (when agents are connected there) the others.
    async fn forward_to_agents(&self, frame: Value) {
        let remote = self.state.actors.has_remote_agents(self.channel_id);
        self.publish(frame, true, remote).await;
    }

    /// Publishes a transient frame to this node's sessions and agents and to the other nodes.
    async fn publish_transient(&self, frame: Value) {
        self.publish(frame, false, true).await;
    }

    /// Hands a transient frame of this user to this node (its agents only, or its sessions and
    /// agents), then, when `to_other_nodes`, to the other nodes through the bus.
    async fn publish(&self, frame: Value, agents_only: bool, to_other_nodes: bool) {
        let origin = self.origin();
        let event = HubEvent::Transient {
            frame: Arc::new(frame.clone()),
            origin: Some(Arc::new(origin.clone())),
        };
        if agents_only {
            self.state
                .hub
                .publish_to_agents(self.channel_id, self.conversation_id, event);
        } else {
            self.state
                .hub
                .publish_to_all(self.channel_id, self.conversation_id, event);
        }
        if !to_other_nodes {
            return;
        }
        let transient = TransientFrame {
            node: self.state.hub.node_id().to_owned(),
            channel_id: Some(self.channel_id),
            conversation_id: self.conversation_id,
            frame,
            origin: Some(origin),
            agents_only,
        };
        if let Err(error) = self.state.store.publish_transient(&transient).await {
            tracing::warn!(%error, agents_only, "transient frame not published to other nodes");
        }
    }

    async fn on_typing(&mut self, is_typing: bool) -> Result<(), Ending> {
        let throttle = Duration::from_millis(self.state.config.limits.typing_throttle_ms);
        let now = Instant::now();
        if let Some((last_state, at)) = self.typing_relayed
            && last_state == is_typing
            && now.duration_since(at) < throttle
        {
            return Ok(());
        }
        self.typing_relayed = Some((is_typing, now));
        let frame = json!({"type": "typing", "isTyping": is_typing, "sender": {"id": self.user_id, "role": USER_ROLE}});
        self.publish_transient(frame).await;
        Ok(())
    }

    async fn on_read(&mut self, watermark: u64) -> Result<(), Ending> {
        if watermark > self.cursor.last_sent() {
            return self.push_error(ErrorFrame::new(
                ErrorCode::InvalidWatermark,
                "watermark is above what this connection has seen",
            ));
        }
        let seq = i64::try_from(watermark).unwrap_or(i64::MAX);
        let moved = match self
            .state
            .store
            .record_read(self.conversation_id, &self.user_id, USER_ROLE, seq)
            .await
        {
            Ok(moved) => moved,
            Err(error) => {
                tracing::warn!(%error, "read position not stored");
                return self.push_error(ErrorFrame::new(
                    ErrorCode::Internal,
                    "read position not stored; retry",
                ));
            }
        };
        if let Some(up_to) = moved {
            let frame = json!({
                "type": "deliveryStatus",
                "data": {"upToSeq": up_to, "status": "read", "by": {"id": self.user_id, "role": USER_ROLE}}
            });
            self.publish_transient(frame).await;
        }
        Ok(())
    }

    fn on_auth(&mut self, token: &str) -> Result<(), Ending> {
        let accepted = self.state.tokens.verify(token).ok().filter(|claims| {
            claims.tenant_id == self.claims.tenant_id
                && claims.channel_id == self.channel_id
                && claims.scope() == self.claims.scope()
                && claims
                    .conversation_id
                    .is_none_or(|id| id == self.conversation_id)
                && claims
                    .user_id
                    .as_ref()
                    .is_none_or(|user| *user == self.user_id)
        });
        let Some(claims) = accepted else {
            return self.push_error(ErrorFrame::new(
                ErrorCode::Forbidden,
                "token refused; the current token stays",
            ));
        };
        self.token_expires_at = expiry_instant(claims.exp);
        let expires_at = claims.exp.saturating_mul(1000);
        self.claims = claims;
        if !self.is_converger() {
            return Ok(());
        }
        self.push(
            &json!({"type": "tokenRefreshed", "data": {"expiresAt": expires_at}}),
            false,
        )
    }

    /// Announces this participant's first connection or the close of its last one.
    fn presence_changed(&mut self, joined: bool) {
        let hub = &self.state.hub;
        let connections = if joined {
            hub.presence_join(self.conversation_id, &self.user_id)
        } else {
            hub.presence_leave(self.conversation_id, &self.user_id)
        };
        let announce = if joined {
            connections == 1
        } else {
            connections == 0
        };
        if !announce {
            return;
        }
        let frame = json!({
            "type": "presence",
            "data": {
                "participant": {"id": self.user_id, "role": USER_ROLE},
                "status": if joined { "online" } else { "offline" },
                "connections": connections,
            }
        });
        let state = self.state.clone();
        let conversation_id = self.conversation_id;
        let origin = self.origin();
        state.hub.publish_to_all(
            self.channel_id,
            conversation_id,
            HubEvent::Transient {
                frame: Arc::new(frame.clone()),
                origin: Some(Arc::new(origin.clone())),
            },
        );
        let transient = TransientFrame {
            node: state.hub.node_id().to_owned(),
            channel_id: Some(self.channel_id),
            conversation_id,
            frame,
            origin: Some(origin),
            agents_only: false,
        };
        // Off the session's path: an offline notice is published after the session ended.
        tokio::spawn(async move {
            if let Err(error) = state.store.publish_transient(&transient).await {
                tracing::warn!(%error, "presence not published to other nodes");
            }
        });
    }
}

fn catalog_frame(
    kind: &str,
    list_field: &str,
    catalog: &Value,
    client_hash: Option<&str>,
) -> Value {
    let hash = catalog.get("hash").cloned().unwrap_or(Value::Null);
    if client_hash.is_some() && hash.as_str() == client_hash {
        return json!({"type": kind, "hash": hash, "unchanged": true});
    }
    json!({"type": kind, "hash": hash, list_field: catalog.get(list_field).cloned().unwrap_or(Value::Array(vec![]))})
}

/// What one read from the socket means for a session.
pub(super) enum Inbound {
    /// A text message to parse.
    Text(axum::extract::ws::Utf8Bytes),
    /// A binary message: refused with `invalid_message`.
    Binary,
    /// Ping or pong: activity, nothing to answer.
    Control,
}

/// Sorts one read: the end of the stream, a close or a read failure end the session.
pub(super) fn classify(message: Option<Result<Message, axum::Error>>) -> Result<Inbound, Ending> {
    match message {
        None | Some(Ok(Message::Close(_))) => Err(Ending::Gone),
        Some(Err(error)) => Err(read_failure(&error)),
        Some(Ok(Message::Text(text))) => Ok(Inbound::Text(text)),
        Some(Ok(Message::Binary(_))) => Ok(Inbound::Binary),
        Some(Ok(Message::Ping(_) | Message::Pong(_))) => Ok(Inbound::Control),
    }
}

/// The answer to a binary message.
pub(super) fn binary_refusal() -> ErrorFrame {
    ErrorFrame::new(
        ErrorCode::InvalidMessage,
        "binary messages are not accepted",
    )
}

/// A read error: above the hard cap the connection closes with 1009, anything else ends it.
pub(super) fn read_failure(error: &axum::Error) -> Ending {
    let text = error.to_string();
    if text.contains("too long") || text.contains("Space limit") || text.contains("capacity") {
        return Ending::CloseNow {
            code: CloseCode::MessageTooBig.number(),
            reason: "message too big".into(),
        };
    }
    Ending::Gone
}

pub(super) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
