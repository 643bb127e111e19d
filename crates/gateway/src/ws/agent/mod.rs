//! A channel-scope session: an agent process serving the conversations of one channel, as an
//! observer or as a member of a group (docs/protocol.md §4). Conversation-level frames travel in
//! `{conversationId, frame}` envelopes both ways.
//!
//! - `mod.rs`: the session's start (welcome, join the channel's actor, announce in gossip,
//!   replay `hello.watermarks`) and its main loop;
//! - `frames.rs`: what the agent sends, as `converger_protocol::AgentFrame` parses it;
//! - `deliveries.rs`: what the channel actor hands the connection, serialized as it is sent;
//! - `results.rs`: turn results committing concurrently, one per conversation at a time;
//! - `streams.rs`: streamed answers (`streamChunk`, `streamAbort`);
//! - `membership.rs`: the gossip announcement and, in lease mode, lease renewal and release.

mod deliveries;
mod frames;
pub(crate) mod membership;
mod results;
mod streams;

use std::collections::HashSet;
use std::time::Duration;

use axum::extract::ws::{Message, Utf8Bytes, WebSocket};
use converger_cluster::AgentRecord;
use converger_protocol::{ChannelWelcome, ErrorCode, ErrorFrame, parse_agent_text};
use futures_util::StreamExt;
use futures_util::stream::SplitStream;
use tokio::sync::mpsc;
use tokio::time::Instant;
use uuid::Uuid;

use super::handshake::AgentSetup;
use super::outbound::Outbound;
use super::rate::TokenBucket;
use super::session::{
    Admitted, Ending, admit, classify, draining_error, expiry_instant, now_ms, ordered_close,
    push_failed, rate_limited,
};
use crate::actors::{ActorMessage, Delivery};
use crate::hub::{SessionControl, SessionIdentity};
use crate::recent::{RECENT_PERIOD_MS, Recent, monotonic_ms};
use crate::state::AppState;
use crate::tokens::Claims;

use membership::{Announced, LeaseRenewal, release_leases};
use results::ResultsInFlight;

/// Role of agents in `sender.role` and relayed frames.
const AGENT_ROLE: &str = "agent";

/// Conversations delivered to a connection that it remembers per generation (two generations
/// are kept): an answer to a turn delivered longer ago, or past this many, costs one lookup of
/// the conversation's channel.
const DELIVERED_REMEMBERED: usize = 4_096;

struct AgentSession<'a> {
    state: &'a AppState,
    outbound: &'a Outbound,
    claims: Claims,
    channel_id: Uuid,
    connection_id: Uuid,
    sender_id: String,
    /// Conversations checked to belong to the channel.
    known_conversations: HashSet<Uuid>,
    /// Conversations whose turns the channel actor handed this connection lately: they belong
    /// to the channel, so answering them needs no lookup (they count towards
    /// `maxConversations` only once the agent sends for them). Read and written only through
    /// `remember_delivered` and `was_delivered`, which tell it the time: an entry idle for a
    /// minute or two is dropped while turns are delivered or new conversations addressed; at
    /// most twice [`DELIVERED_REMEMBERED`] are held.
    delivered_conversations: Recent<Uuid, ()>,
    /// Lease mode: how long each claim lasts (answers must carry the delivery's fence).
    lease: Option<Duration>,
    /// The channel actor (set once joined).
    inbox: Option<mpsc::UnboundedSender<ActorMessage>>,
    rate: TokenBucket,
    last_inbound: Instant,
    last_outbound: Instant,
    token_expires_at: Instant,
    /// Turn results committing now.
    results: ResultsInFlight,
    /// `from` of this connection's stream chunks, made at the first chunk.
    stream_from: Option<std::sync::Arc<serde_json::Value>>,
}

impl AgentSession<'_> {
    /// Notes that the channel actor handed this connection turns of these conversations (the
    /// clock is read once per delivery batch, not per turn).
    fn remember_delivered(&mut self, conversations: impl IntoIterator<Item = Uuid>) {
        let _ = self.delivered_conversations.forget_idle(monotonic_ms());
        for conversation_id in conversations {
            let _ = self.delivered_conversations.insert(conversation_id, ());
        }
    }

    /// Whether a turn of the conversation was handed to this connection lately.
    fn was_delivered(&mut self, conversation_id: Uuid) -> bool {
        let _ = self.delivered_conversations.forget_idle(monotonic_ms());
        self.delivered_conversations.get(&conversation_id).is_some()
    }
}

/// Runs an agent connection after its hello.
pub(super) async fn run(
    state: &AppState,
    setup: AgentSetup,
    stream: &mut SplitStream<WebSocket>,
    outbound: &Outbound,
) -> Ending {
    let AgentSetup {
        claims,
        group,
        lease,
        hello,
    } = setup;
    let lease = lease.then(|| Duration::from_millis(state.config.lease_ms));
    let (control_sender, mut controls) = mpsc::channel::<SessionControl>(8);
    let identity = SessionIdentity {
        tenant_id: claims.tenant_id,
        channel_id: claims.channel_id,
        end_user: None,
    };
    let guard = state.hub.register(identity, control_sender);
    let connection_id = guard.connection_id();
    let since_ms = now_ms() + i64::try_from(state.config.group_settle_ms).unwrap_or(i64::MAX);
    let now = Instant::now();
    let mut session = AgentSession {
        state,
        outbound,
        sender_id: claims
            .user_id
            .clone()
            .or_else(|| group.clone())
            .unwrap_or_else(|| AGENT_ROLE.to_owned()),
        token_expires_at: expiry_instant(claims.exp),
        channel_id: claims.channel_id,
        claims,
        connection_id,
        known_conversations: HashSet::new(),
        delivered_conversations: Recent::new(DELIVERED_REMEMBERED, RECENT_PERIOD_MS),
        lease,
        inbox: None,
        rate: TokenBucket::new(state.config.limits.max_frames_per_sec, now.into_std()),
        last_inbound: now,
        last_outbound: now,
        results: ResultsInFlight::default(),
        stream_from: None,
    };
    let channel_id = session.channel_id.to_string();
    let connection = connection_id.to_string();
    let welcome = ChannelWelcome {
        channel_id: &channel_id,
        connection_id: &connection,
        since_ms,
        expires_at_ms: session.claims.exp.saturating_mul(1000),
        group: group.as_deref(),
        lease_ms: lease.map(|lease| lease.as_millis() as u64),
        limits: &state.config.limits,
    }
    .encode();
    if let Err(ending) = session.push(welcome) {
        return ending;
    }
    let (deliveries_sender, mut deliveries) = mpsc::unbounded_channel::<Delivery>();
    // Counted while connected: end users' forwarded frames go to agents only when one is here.
    let _counted = state.hub.agent_connected(session.channel_id);
    let inbox = state
        .actors
        .inbox(session.channel_id, &state.hub, &state.store);
    let _ = inbox.send(ActorMessage::Join {
        connection_id: connection.clone(),
        group: group.clone(),
        since_ms,
        sender_id: session.sender_id.clone(),
        lease,
        deliveries: deliveries_sender,
    });
    let _renewing = lease.map(|lease| LeaseRenewal::start(state, connection.clone(), lease));
    let _announced = Announced::new(
        &state.cluster,
        AgentRecord {
            channel_id: session.channel_id,
            connection_id: connection.clone(),
            group,
            since_ms,
        },
    );
    session.inbox = Some(inbox.clone());
    let mut ending = None;
    if let Some(watermarks) = &hello.watermarks {
        for (conversation, watermark) in watermarks {
            let (Ok(conversation_id), Some(watermark)) =
                (Uuid::parse_str(conversation), watermark.as_u64())
            else {
                continue;
            };
            if let Err(end) = session.replay(conversation_id, watermark).await {
                ending = Some(end);
                break;
            }
        }
    }
    let ending = match ending {
        Some(ending) => ending,
        None => session.run(stream, &mut deliveries, &mut controls).await,
    };
    // The streams this connection was writing end with it (the takeover streams afresh).
    state.streams.abort_owner(&state.hub, &connection);
    if lease.is_some() {
        release_leases(state, &connection).await;
    }
    let _ = inbox.send(ActorMessage::Leave {
        connection_id: connection,
    });
    drop(guard);
    ending
}

impl AgentSession<'_> {
    fn push(&mut self, text: impl Into<Utf8Bytes>) -> Result<(), Ending> {
        match self.outbound.push_text(text, false) {
            Ok(()) => {
                self.last_outbound = Instant::now();
                Ok(())
            }
            Err(error) => Err(push_failed(error, self.state.config.drain.retry_after_ms)),
        }
    }

    fn push_error(&mut self, error: ErrorFrame) -> Result<(), Ending> {
        self.push(error.encode())
    }

    async fn run(
        &mut self,
        stream: &mut SplitStream<WebSocket>,
        deliveries: &mut mpsc::UnboundedReceiver<Delivery>,
        controls: &mut mpsc::Receiver<SessionControl>,
    ) -> Ending {
        let limits = self.state.config.limits.clone();
        let heartbeat_every = Duration::from_millis(limits.heartbeat_interval_ms);
        let idle_after = Duration::from_millis(limits.idle_timeout_ms);
        let mut heartbeat =
            tokio::time::interval_at(Instant::now() + heartbeat_every, heartbeat_every);
        loop {
            let idle_deadline = self.last_inbound + idle_after;
            // Deliveries first: what the actor handed over is sent before the next inbound frame
            // is handled, so a ping answered later proves earlier deliveries were sent.
            let outcome = tokio::select! {
                biased;
                delivery = deliveries.recv() => match delivery {
                    Some(delivery) => self.deliver(delivery, deliveries).await,
                    None => Err(Ending::Gone),
                },
                Some((conversation_id, reply)) = self.results.next_reply(), if !self.results.is_empty() => self.push_enveloped(conversation_id, reply),
                message = stream.next() => self.on_message(message).await,
                control = controls.recv() => self.on_control(control).await,
                _ = heartbeat.tick() => self.on_heartbeat(heartbeat_every),
                _ = tokio::time::sleep_until(idle_deadline) => Err(Ending::idle()),
                _ = tokio::time::sleep_until(self.token_expires_at) => {
                    let _ = self.push_error(ErrorFrame::new(ErrorCode::TokenExpired, "token expired; send auth with a new token"));
                    Err(Ending::token_expired())
                }
            };
            let Err(ending) = outcome else {
                continue;
            };
            if matches!(ending, Ending::Gone) {
                self.results.detach();
            } else {
                // Acks of the results in flight go out before the close frame.
                let _ = self.finish_results().await;
            }
            return ending;
        }
    }

    async fn on_control(&mut self, control: Option<SessionControl>) -> Result<(), Ending> {
        match control {
            None => Ok(()),
            Some(SessionControl::Drain { retry_after_ms }) => {
                // Results in flight are acked before the agent is sent away.
                let _ = self.finish_results().await;
                let _ = self.push_error(draining_error(retry_after_ms));
                Err(Ending::draining(retry_after_ms))
            }
            Some(SessionControl::Close {
                error,
                code,
                reason,
            }) => Err(ordered_close(self.outbound, error, code, reason)),
        }
    }

    fn on_heartbeat(&mut self, every: Duration) -> Result<(), Ending> {
        self.outbound.push_ping();
        if self.last_outbound.elapsed() >= every {
            let heartbeat = converger_protocol::Heartbeat {
                timestamp: now_ms(),
                head_seq: None,
                nonce: None,
            };
            let _ = self.outbound.push_text(heartbeat.encode(), true);
        }
        Ok(())
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
            Admitted::RateLimited { wait, .. } => return self.push_error(rate_limited(wait)),
            Admitted::Control => return Ok(()),
        };
        let limits = &self.state.config.limits;
        match parse_agent_text(text.as_str(), limits, self.lease.is_some()) {
            Ok(frame) => self.on_frame(frame).await,
            Err(refusal) => {
                self.push_error(ErrorFrame::new(refusal.error.code, refusal.error.message))
            }
        }
    }
}
