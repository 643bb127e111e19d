//! A conversation-scope session: one end user's connection to one conversation.
//!
//! One task per connection owns all session state and handles, one at a time, inbound frames,
//! live events of the conversation, completed commits, timers and orders from the node (drain,
//! channel deactivation). A writer task owns the socket's sending half.
//!
//! - `mod.rs`: the session's state, its start (subscribe, then read the head, then welcome and
//!   replay) and its main loop;
//! - `sends.rs`: message frames, edits and regenerates: queue, commit, publish, ack;
//! - `live.rs`: live events of the conversation, replays and `sync`;
//! - `signals.rs`: typing, receipts, presence, `auth`, forwarded frames, heartbeats, orders;
//! - `streams.rs`: streamed answers: the open streams at welcome, then each chunk once.
//!
//! Architecture invariant: while this connection's own send commits, live events wait, so the
//! bus echo of its own frame is known to be its own when it arrives and is never pushed back.

mod live;
mod sends;
mod signals;
mod streams;

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use axum::extract::ws::{Message, Utf8Bytes, WebSocket};
use converger_core::replay::{ReplayCursor, ReplayPlan};
use converger_core::streams::StreamCursor;
use converger_protocol::mekik::{self, StreamProgress};
use converger_protocol::{
    Catalog, ClientFrame, ConversationWelcome, ErrorCode, ErrorFrame, Hello, PendingInterrupt,
    Profile, USER_ROLE, Viewer, parse_client_text,
};
use converger_store::WelcomeReads;
use converger_store::bus::Origin;
use futures_util::StreamExt;
use futures_util::stream::SplitStream;
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;
use uuid::Uuid;

use super::handshake::Established;
use super::outbound::{Outbound, PushError};
use super::rate::TokenBucket;
use super::session::{
    Admitted, Ending, admit, classify, expiry_instant, internal_close, push_failed, rate_limited,
    refusal_frame, too_large, within_size,
};
use crate::hub::{HubEvent, SessionControl, SessionIdentity};
use crate::state::AppState;
use crate::tokens::Claims;

use sends::{CommitFuture, PendingSend};

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
    /// What this connection was shown of each streamed answer.
    streams_seen: StreamCursor,
    /// A reconnecting mekik widget's progress in a stream that ended while it was away: the
    /// replay shows that stream's answer apart (`streams.rs`).
    stream_ended_away: Option<StreamProgress>,
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
    /// The hello's `meta`, relayed to agents with every turn of this connection.
    hello_meta: Option<Box<serde_json::Value>>,
    token_expires_at: Instant,
    draining: Option<u64>,
}

/// Runs an end user's session after its hello.
pub(super) async fn run(
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
    let identity = SessionIdentity {
        tenant_id: conversation.tenant_id,
        channel_id: conversation.channel_id,
        end_user: Some((conversation.id, user_id.clone())),
    };
    let guard = state.hub.register(identity, control_sender);
    // Subscribe before reading the head: whatever commits from now on is either in the replay
    // or arrives live (and the cursor drops what the replay already sent).
    let mut live = state.hub.subscribe(conversation.id);
    let reads = match state.store.welcome_reads(conversation.id).await {
        Ok(Some(reads)) => reads,
        Ok(None) => return internal_close(outbound),
        Err(error) => {
            tracing::error!(%error, "session: cannot read the welcome");
            return internal_close(outbound);
        }
    };
    let head = u64::try_from(reads.head).unwrap_or(0);
    let limits = &state.config.limits;
    let now = Instant::now();
    let invalid_watermark = watermark > head;
    let watermark = if invalid_watermark { head } else { watermark };
    let (cursor, plan) = ReplayCursor::start(watermark, head, replay_cap(state, profile));
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
        streams_seen: StreamCursor::default(),
        stream_ended_away: None,
        own_seqs: BTreeSet::new(),
        sends: VecDeque::new(),
        in_flight: false,
        deferred_syncs: VecDeque::new(),
        rate: TokenBucket::new(limits.max_frames_per_sec, now.into_std()),
        last_inbound: now,
        last_outbound: now,
        typing_relayed: None,
        hello_meta: hello.meta.clone().map(Box::new),
        draining: None,
    };
    // Boxed, and the hello and conversation dropped, so the idle session's future and heap keep
    // only what the session loop needs (memory per idle connection, docs/benchmarks.md).
    if let Err(ending) = Box::pin(session.welcome(reads, &hello, invalid_watermark, plan)).await {
        // A client that sent a frame and left while its replay was written: the frame is in
        // the socket, and a mekik client never sends it again.
        session.finish(&ending, stream, None).await;
        return ending;
    }
    session.relay_hello_catalogs(&hello).await;
    drop(hello);
    drop(conversation);
    // Off the session's path, and the count out only after the count in.
    let presence = session.presence();
    let counted = tokio::spawn(crate::presence::change(
        state.clone(),
        presence.clone(),
        true,
    ));
    let ending = session.run(stream, &mut live, &mut controls).await;
    let state = state.clone();
    tokio::spawn(async move {
        if counted.await.unwrap_or(false) {
            crate::presence::change(state, presence, false).await;
        }
    });
    drop(guard);
    ending
}

/// The converger profile's replay is capped at `replayMax` (then `replayTruncated`); a mekik
/// client gets everything it asks for.
fn replay_cap(state: &AppState, profile: Profile) -> Option<u64> {
    profile
        .is_converger()
        .then_some(state.config.limits.replay_max as u64)
}

impl<'a> Session<'a> {
    fn is_converger(&self) -> bool {
        self.profile.is_converger()
    }

    /// Queues a persistent frame or one of the frames every profile gets; a full queue of
    /// persistent frames means the client cannot keep up.
    fn push(&mut self, text: impl Into<Utf8Bytes>, transient: bool) -> Result<(), Ending> {
        match self.outbound.push_text(text, transient) {
            Ok(()) => {
                self.last_outbound = Instant::now();
                Ok(())
            }
            Err(error) => Err(self.push_failed(error)),
        }
    }

    /// Queues a transient frame of type `kind`, unless the profile does not take it.
    fn push_transient(&mut self, kind: &str, text: impl Into<Utf8Bytes>) -> Result<(), Ending> {
        if !self.profile.receives_transient(kind) {
            return Ok(());
        }
        self.push(text, true)
    }

    fn push_failed(&self, error: PushError) -> Ending {
        if error == PushError::Full {
            tracing::info!(connection_id = %self.connection_id, "slow consumer: closing");
        }
        push_failed(error, self.state.config.drain.retry_after_ms)
    }

    /// Errors are never dropped under pressure: a client may be waiting on one for its send.
    /// A mekik widget shows no `error` frame, so a refused message is followed by a notice it
    /// shows (docs/protocol.md §3.7).
    fn push_error(&mut self, error: ErrorFrame) -> Result<(), Ending> {
        self.push(error.encode(), false)?;
        if self.is_converger() {
            return Ok(());
        }
        let refused_message = error
            .client_id
            .as_deref()
            .filter(|_| error.frame_type.as_deref().is_none_or(mekik::shows_refusal));
        match refused_message {
            Some(client_id) => {
                let notice = mekik::refusal_notice(client_id, error.code, &error.message);
                self.push(notice, false)
            }
            None => Ok(()),
        }
    }

    fn viewer(&self) -> Viewer<'_> {
        Viewer::EndUser {
            user_id: &self.user_id,
        }
    }

    /// This user as the author of transient frames, so receivers can skip its own tabs.
    fn origin(&self) -> Origin {
        Origin {
            id: self.user_id.clone(),
            role: USER_ROLE.into(),
            connection: self.connection_id.to_string(),
        }
    }

    /// Sends welcome (at the head the replay's plan was made against), the catalogs, then the
    /// replay.
    async fn welcome(
        &mut self,
        reads: WelcomeReads,
        hello: &Hello,
        invalid_watermark: bool,
        plan: ReplayPlan,
    ) -> Result<(), Ending> {
        let WelcomeReads {
            pending_interrupts,
            catalogs,
            ..
        } = reads;
        let conversation_id = self.conversation_id.to_string();
        let connection_id = self.connection_id.to_string();
        let welcome = ConversationWelcome {
            profile: self.profile,
            conversation_id: &conversation_id,
            user_id: &self.user_id,
            connection_id: &connection_id,
            watermark: plan.head,
            pending: pending_interrupts
                .iter()
                .map(|interrupt| PendingInterrupt {
                    id: &interrupt.id,
                    data: &interrupt.data,
                })
                .collect(),
            expires_at_ms: self.claims.exp.saturating_mul(1000),
            limits: &self.state.config.limits,
        }
        .encode();
        self.push(welcome, false)?;
        if let Some(components) = catalogs.components {
            let frame = Catalog::Components.frame(&components, hello.components_hash.as_deref());
            self.push(frame, false)?;
        }
        if let Some(skills) = catalogs.skills {
            let frame = Catalog::Skills.frame(&skills, hello.skills_hash.as_deref());
            self.push(frame, false)?;
        }
        if invalid_watermark {
            self.push_error(ErrorFrame::new(
                ErrorCode::InvalidWatermark,
                "watermark is above the conversation head",
            ))?;
        }
        // A mekik widget back from a cut socket says how much of a stream it shows.
        let progress = hello
            .stream_progress
            .filter(|progress| !self.is_converger() && progress.turn_seq == plan.after);
        if let Some(progress) = progress {
            self.resume_stream(progress);
        }
        self.replay(plan).await?;
        // After the stored frames, the answers streaming now: what was sent so far, then the
        // live rest (the cursor drops chunks the live feed repeats).
        self.catch_up_streams().await
    }

    /// The main loop, then the sends it read and did not commit yet.
    async fn run(
        &mut self,
        stream: &mut SplitStream<WebSocket>,
        live: &mut broadcast::Receiver<HubEvent>,
        controls: &mut mpsc::Receiver<SessionControl>,
    ) -> Ending {
        let mut in_flight: Option<CommitFuture<'a>> = None;
        let ending = self.serve(stream, live, controls, &mut in_flight).await;
        self.finish(&ending, stream, in_flight).await;
        ending
    }

    /// What a session does once something ended it: when the client left, the frames it sent
    /// before leaving are still in the socket and are read; then every send read commits.
    async fn finish(
        &mut self,
        ending: &Ending,
        stream: &mut SplitStream<WebSocket>,
        in_flight: Option<CommitFuture<'a>>,
    ) {
        if matches!(ending, Ending::Gone) {
            self.read_what_is_left(stream).await;
        }
        self.finish_sends(in_flight).await;
    }

    /// Reads the messages a departed client sent before its close, queueing its message
    /// frames (anything else needs an answer nobody will read). Bounded by
    /// `limits.write_timeout_ms`.
    async fn read_what_is_left(&mut self, stream: &mut SplitStream<WebSocket>) {
        let limits = &self.state.config.limits;
        let deadline = Instant::now() + Duration::from_millis(limits.write_timeout_ms);
        while let Ok(Some(Ok(message))) = tokio::time::timeout_at(deadline, stream.next()).await {
            let Message::Text(text) = message else {
                if matches!(message, Message::Close(_)) {
                    break;
                }
                continue;
            };
            if text.len() > limits.max_frame_bytes {
                continue;
            }
            if let Ok(ClientFrame::Message(frame)) = parse_client_text(text.as_str(), limits) {
                // An unknown policy name is refused with the send, as it would have been.
                let policy = match frame.turn_policy.as_deref() {
                    None => None,
                    Some(name) => match converger_core::policies::TurnPolicy::parse(name) {
                        Some(policy) => Some(policy),
                        None => continue,
                    },
                };
                self.sends.push_back(PendingSend {
                    frame: *frame,
                    policy,
                });
            }
        }
    }

    /// Commits every send this session read, whatever ended it (a tab closed right after Enter,
    /// a cut socket, a slow-consumer close): the node received those frames, and a mekik client
    /// never resends. Acks go out while the socket still takes them. Bounded by
    /// `limits.write_timeout_ms`; only a node crash loses what was read.
    async fn finish_sends(&mut self, in_flight: Option<CommitFuture<'a>>) {
        if in_flight.is_none() && self.sends.is_empty() {
            return;
        }
        let within = Duration::from_millis(self.state.config.limits.write_timeout_ms);
        let finishing = async {
            let mut next = in_flight;
            loop {
                let commit = match next.take() {
                    Some(commit) => commit,
                    None => match self.sends.pop_front() {
                        Some(send) => self.start_commit(send),
                        None => break,
                    },
                };
                // The connection may be gone: a refused ack or error changes nothing stored.
                let _ = self.on_commit(commit.await);
            }
        };
        if tokio::time::timeout(within, finishing).await.is_err() {
            tracing::warn!(
                connection_id = %self.connection_id,
                unsent = self.sends.len(),
                "session ended before the sends it read could commit"
            );
        }
    }

    /// Serves the connection until something ends it; a commit may still be in flight then.
    async fn serve(
        &mut self,
        stream: &mut SplitStream<WebSocket>,
        live: &mut broadcast::Receiver<HubEvent>,
        controls: &mut mpsc::Receiver<SessionControl>,
        in_flight: &mut Option<CommitFuture<'a>>,
    ) -> Ending {
        let limits = self.state.config.limits.clone();
        let heartbeat_every = Duration::from_millis(limits.heartbeat_interval_ms);
        let idle_after = Duration::from_millis(limits.idle_timeout_ms);
        let mut heartbeat =
            tokio::time::interval_at(Instant::now() + heartbeat_every, heartbeat_every);
        loop {
            // Live frames already waiting go first, so a client that keeps sending still sees
            // the conversation.
            if in_flight.is_none()
                && live.is_empty()
                && let Some(next) = self.sends.pop_front()
            {
                *in_flight = Some(self.start_commit(next));
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
                let _ = self.push_error(super::session::draining_error(retry_after_ms));
                return Ending::draining(retry_after_ms);
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
                    *in_flight = None;
                    self.in_flight = false;
                    self.on_commit(done)
                }
                _ = heartbeat.tick() => self.on_heartbeat(heartbeat_every),
                _ = tokio::time::sleep_until(idle_deadline) => Err(Ending::idle()),
                _ = tokio::time::sleep_until(self.token_expires_at) => Err(self.on_token_expired()),
            };
            if let Err(ending) = outcome {
                return ending;
            }
        }
    }

    async fn on_message(
        &mut self,
        message: Option<Result<Message, axum::Error>>,
    ) -> Result<(), Ending> {
        let inbound = classify(message)?;
        self.last_inbound = Instant::now();
        let limits = &self.state.config.limits;
        let text = match admit(inbound, &mut self.rate, limits.max_frame_bytes) {
            Admitted::Text(text) => text,
            Admitted::Refused(error) => return self.push_error(error),
            Admitted::RateLimited { text, wait } => match self.profile {
                // A mekik client cannot handle rate_limited: hold the socket instead.
                Profile::Mekik => {
                    tokio::time::sleep(wait).await;
                    match within_size(text, limits.max_frame_bytes) {
                        Some(text) => text,
                        None => return self.push_error(too_large()),
                    }
                }
                Profile::Converger => return self.push_error(rate_limited(wait)),
            },
            Admitted::Control => return Ok(()),
        };
        let limits = &self.state.config.limits;
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
            ClientFrame::Ping { nonce } => self.on_ping(nonce.as_ref()),
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
            ClientFrame::Forwarded { kind, frame } => self.on_forwarded(kind, frame).await,
            ClientFrame::Stop {
                client_id,
                seq,
                forwarded,
            } => {
                // The mekik `abort` still reaches agents that read it, and is never answered.
                let Some(frame) = forwarded else {
                    return self.on_stop(client_id, seq).await;
                };
                self.on_forwarded("abort".into(), frame).await?;
                self.on_abort().await;
                Ok(())
            }
        }
    }
}
