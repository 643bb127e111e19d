//! A channel-scope session: an agent process serving the conversations of one channel, as an
//! observer or as a member of a group (PROTOCOL section 4). Conversation-level frames travel in
//! `{conversationId, frame}` envelopes both ways.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{Message, WebSocket};
use converger_protocol::{
    CloseCode, ErrorCode, ErrorFrame, retry_close_reason, validate_message_frame,
};
use converger_store::bus::{Origin, TransientFrame};
use converger_store::{AnswerFrame, NewActivity, RuntimeWrite, Sender, SenderRole, TurnAnswer};
use futures_util::StreamExt;
use futures_util::stream::SplitStream;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;
use uuid::Uuid;

use super::conversation::{
    Ending, Inbound, binary_refusal, classify, expiry_instant, internal_close, now_ms,
};
use super::handshake::AgentSetup;
use super::outbound::{Outbound, PushError};
use super::rate::TokenBucket;
use super::turn_results::ResultsInFlight;
use converger_cluster::{AgentRecord, Cluster};

use crate::agents::{ActorMessage, Delivery};
use crate::auth::{Claims, Scope};
use crate::hub::{HubEvent, SessionControl};
use crate::state::AppState;

/// Role of agents in `sender.role` and relayed frames.
const AGENT_ROLE: &str = "agent";

/// Deliveries sent together, with one runtime read for the user turns among them.
const DELIVERY_BATCH: usize = 256;

/// Runtime reads tried before a connection gives up on its deliveries.
const RUNTIME_READ_ATTEMPTS: u32 = 3;

/// Wait between runtime reads.
const RUNTIME_READ_BACKOFF: Duration = Duration::from_millis(200);

/// Renews a lease-mode member's claims every third of the lease while the session lives.
struct LeaseRenewal {
    task: tokio::task::JoinHandle<()>,
}

impl LeaseRenewal {
    fn start(state: &AppState, holder: String, lease: Duration) -> LeaseRenewal {
        let store = state.store.clone();
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(lease / 3);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                if let Err(error) = store.renew_leases(&holder, lease).await {
                    tracing::warn!(%error, holder, "leases not renewed");
                }
            }
        });
        LeaseRenewal { task }
    }
}

impl Drop for LeaseRenewal {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Gives a departing lease-mode member's claims up, so the next owner claims them at once.
async fn release_leases(state: &AppState, holder: &str) {
    match state.store.release_leases(holder).await {
        Ok(0) => {}
        Ok(released) => tracing::debug!(holder, released, "leases released"),
        Err(error) => {
            tracing::warn!(%error, holder, "leases not released; they run out by themselves")
        }
    }
}

/// Keeps an agent connection announced in gossip while it lives; withdraws it when dropped, so
/// no way out of the session forgets it.
struct Announced {
    cluster: Cluster,
    record: AgentRecord,
}

impl Announced {
    fn new(cluster: &Cluster, record: AgentRecord) -> Announced {
        cluster.publish(record.clone());
        Announced {
            cluster: cluster.clone(),
            record,
        }
    }
}

impl Drop for Announced {
    fn drop(&mut self) {
        tracing::debug!(connection_id = %self.record.connection_id, "agent connection withdrawn");
        self.cluster
            .withdraw(self.record.channel_id, &self.record.connection_id);
    }
}

struct AgentSession<'a> {
    state: &'a AppState,
    outbound: &'a Outbound,
    claims: Claims,
    channel_id: Uuid,
    connection_id: Uuid,
    sender_id: String,
    /// Conversations checked to belong to the channel.
    known_conversations: HashSet<Uuid>,
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
    let guard = state.hub.register(claims.channel_id, control_sender);
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
        lease,
        inbox: None,
        rate: TokenBucket::new(state.config.limits.max_frames_per_sec, now.into_std()),
        last_inbound: now,
        last_outbound: now,
        results: ResultsInFlight::default(),
    };
    let mut welcome = json!({
        "type": "welcome",
        "data": {
            "protocol": converger_protocol::PROTOCOL_NAME,
            "scope": "channel",
            "channelId": session.channel_id,
            "connectionId": connection_id,
            "since": since_ms,
            "expiresAt": session.claims.exp.saturating_mul(1000),
            "capabilities": {"acks": true, "typing": true, "groups": true, "turnResults": true},
            "limits": state.config.limits.to_wire(true),
        }
    });
    if let Some(group) = &group {
        welcome["data"]["group"] = json!(group);
    }
    if let Some(lease) = lease {
        welcome["data"]["claim"] = json!("lease");
        welcome["data"]["leaseMs"] = json!(lease.as_millis() as u64);
    }
    if let Err(ending) = session.push(&welcome) {
        return ending;
    }
    let (deliveries_sender, mut deliveries) = mpsc::unbounded_channel::<Delivery>();
    // Counted while connected: end users' forwarded frames go to agents only when one is here.
    let _counted = state.hub.agent_connected(session.channel_id);
    let inbox = state
        .actors
        .inbox(session.channel_id, &state.hub, &state.store);
    let _ = inbox.send(ActorMessage::Join {
        connection_id: connection_id.to_string(),
        group: group.clone(),
        since_ms,
        sender_id: session.sender_id.clone(),
        lease,
        deliveries: deliveries_sender,
    });
    let _renewing = lease.map(|lease| LeaseRenewal::start(state, connection_id.to_string(), lease));
    let _announced = Announced::new(
        &state.cluster,
        AgentRecord {
            channel_id: session.channel_id,
            connection_id: connection_id.to_string(),
            group,
            since_ms,
        },
    );
    session.inbox = Some(inbox.clone());
    if let Some(watermarks) = &hello.watermarks {
        for (conversation, watermark) in watermarks {
            let (Ok(conversation_id), Some(watermark)) =
                (Uuid::parse_str(conversation), watermark.as_u64())
            else {
                continue;
            };
            if let Err(ending) = session.replay(conversation_id, watermark).await {
                if lease.is_some() {
                    release_leases(state, &connection_id.to_string()).await;
                }
                let _ = inbox.send(ActorMessage::Leave {
                    connection_id: connection_id.to_string(),
                });
                return ending;
            }
        }
    }
    let ending = session.run(stream, &mut deliveries, &mut controls).await;
    if lease.is_some() {
        release_leases(state, &connection_id.to_string()).await;
    }
    let _ = inbox.send(ActorMessage::Leave {
        connection_id: connection_id.to_string(),
    });
    drop(guard);
    ending
}

impl AgentSession<'_> {
    /// Sends `first` and whatever else the actor has queued (up to [`DELIVERY_BATCH`]), in
    /// order; the user turns among them get their conversations' runtimes, read in one query
    /// just before they go out.
    async fn deliver(
        &mut self,
        first: Delivery,
        queue: &mut mpsc::UnboundedReceiver<Delivery>,
    ) -> Result<(), Ending> {
        // Never more than the outbound queue holds, so a healthy agent is not taken for a slow one.
        let most = DELIVERY_BATCH.min(self.state.config.limits.outbound_queue_frames.max(1));
        let mut batch = vec![first];
        while batch.len() < most {
            let Ok(delivery) = queue.try_recv() else {
                break;
            };
            batch.push(delivery);
        }
        let mut conversations: Vec<Uuid> = batch
            .iter()
            .filter_map(|delivery| match delivery {
                Delivery::Turn {
                    conversation_id, ..
                } => Some(*conversation_id),
                Delivery::Frame(_) => None,
            })
            .collect();
        conversations.sort_unstable();
        conversations.dedup();
        let runtimes = self.read_runtimes(&conversations).await?;
        for delivery in batch {
            let envelope = match delivery {
                Delivery::Frame(envelope) => envelope,
                Delivery::Turn {
                    conversation_id,
                    mut envelope,
                } => {
                    let (version, state) = runtimes
                        .get(&conversation_id)
                        .cloned()
                        .unwrap_or_else(converger_store::initial_runtime);
                    envelope["frame"]["meta"]["runtime"] =
                        json!({"version": version, "state": state});
                    envelope
                }
            };
            self.push(&envelope)?;
        }
        Ok(())
    }

    /// The runtimes of `conversations` (absent: the initial one), tried a few times; if the
    /// database stays unreachable the connection closes, and the turns it was passed are taken
    /// over when it leaves.
    async fn read_runtimes(
        &self,
        conversations: &[Uuid],
    ) -> Result<HashMap<Uuid, (i64, Value)>, Ending> {
        if conversations.is_empty() {
            return Ok(HashMap::new());
        }
        let mut attempt = 1;
        loop {
            match self.state.store.runtimes(conversations).await {
                Ok(runtimes) => return Ok(runtimes),
                Err(error) if attempt < RUNTIME_READ_ATTEMPTS => {
                    tracing::warn!(%error, attempt, "delivery: runtimes unreadable; retrying");
                    tokio::time::sleep(RUNTIME_READ_BACKOFF).await;
                    attempt += 1;
                }
                Err(error) => {
                    tracing::error!(%error, "delivery: runtimes unreadable; closing the connection");
                    return Err(internal_close(self.outbound));
                }
            }
        }
    }

    fn push(&mut self, frame: &Value) -> Result<(), Ending> {
        match self.outbound.push_text(frame.to_string(), false) {
            Ok(()) => {
                self.last_outbound = Instant::now();
                Ok(())
            }
            Err(PushError::Closed) => Err(Ending::Gone),
            Err(PushError::Full) => Err(Ending::CloseNow {
                code: CloseCode::SlowConsumer.number(),
                reason: retry_close_reason(
                    ErrorCode::SlowConsumer,
                    self.state.config.drain.retry_after_ms,
                ),
            }),
        }
    }

    fn push_enveloped(&mut self, conversation_id: Uuid, frame: Value) -> Result<(), Ending> {
        self.push(&json!({"conversationId": conversation_id, "frame": frame}))
    }

    fn enveloped_error(&mut self, conversation_id: Uuid, error: ErrorFrame) -> Result<(), Ending> {
        self.push_enveloped(conversation_id, error.to_json())
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
                control = controls.recv() => match control {
                    None => Ok(()),
                    Some(SessionControl::Drain { retry_after_ms }) => {
                        // Results in flight are acked before the agent is sent away.
                        let _ = self.finish_results().await;
                        let _ = self.push(&ErrorFrame { retry_after_ms: Some(retry_after_ms), ..ErrorFrame::new(ErrorCode::Unavailable, "node is draining; reconnect elsewhere") }.to_json());
                        Err(Ending::Close { code: CloseCode::Draining.number(), reason: retry_close_reason(ErrorCode::Unavailable, retry_after_ms) })
                    }
                    Some(SessionControl::Close { error, code, reason }) => {
                        if let Some(error) = error {
                            let _ = self.push(&error.to_json());
                        }
                        Err(Ending::Close { code, reason })
                    }
                },
                _ = heartbeat.tick() => {
                    self.outbound.push_ping();
                    if self.last_outbound.elapsed() >= heartbeat_every {
                        let frame = json!({"type": "heartbeat", "timestamp": now_ms()});
                        let _ = self.outbound.push_text(frame.to_string(), true);
                    }
                    Ok(())
                }
                _ = tokio::time::sleep_until(idle_deadline) => Err(Ending::Close { code: CloseCode::Idle.number(), reason: "idle".into() }),
                _ = tokio::time::sleep_until(self.token_expires_at) => {
                    let _ = self.push(&ErrorFrame::new(ErrorCode::TokenExpired, "token expired; send auth with a new token").to_json());
                    Err(Ending::Close { code: CloseCode::Auth.number(), reason: "token_expired".into() })
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

    async fn on_message(
        &mut self,
        message: Option<Result<Message, axum::Error>>,
    ) -> Result<(), Ending> {
        let inbound = classify(message)?;
        self.last_inbound = Instant::now();
        let text = match inbound {
            Inbound::Text(text) => text,
            Inbound::Binary => return self.push(&binary_refusal().to_json()),
            Inbound::Control => return Ok(()),
        };
        if let Err(wait) = self.rate.take(std::time::Instant::now()) {
            let error = ErrorFrame {
                retry_after_ms: Some(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1)),
                ..ErrorFrame::new(ErrorCode::RateLimited, "too many frames per second")
            };
            return self.push(&error.to_json());
        }
        if text.len() > self.state.config.limits.max_frame_bytes {
            return self
                .push(&ErrorFrame::new(ErrorCode::PayloadTooLarge, "frame too large").to_json());
        }
        let Ok(Value::Object(object)) = serde_json::from_str::<Value>(text.as_str()) else {
            return self.push(
                &ErrorFrame::new(ErrorCode::InvalidMessage, "a frame must be a JSON object")
                    .to_json(),
            );
        };
        match (object.get("conversationId"), object.get("frame")) {
            (Some(Value::String(conversation)), Some(Value::Object(frame))) => {
                let Ok(conversation_id) = Uuid::parse_str(conversation) else {
                    return self.push(
                        &ErrorFrame::new(ErrorCode::ConversationNotFound, "conversation not found")
                            .to_json(),
                    );
                };
                self.on_enveloped(conversation_id, frame.clone()).await
            }
            _ => self.on_bare(object).await,
        }
    }

    async fn on_bare(&mut self, frame: Map<String, Value>) -> Result<(), Ending> {
        self.finish_results().await?;
        let kind = frame
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        match kind.as_str() {
            "ping" => {
                let mut heartbeat = json!({"type": "heartbeat", "timestamp": now_ms()});
                if let Some(nonce) = frame.get("nonce") {
                    heartbeat["nonce"] = nonce.clone();
                }
                self.push(&heartbeat)
            }
            "auth" => self.on_auth(
                frame
                    .get("token")
                    .and_then(Value::as_str)
                    .unwrap_or_default(),
            ),
            "genui_components" | "skills" => {
                let list_field = if kind == "skills" {
                    "skills"
                } else {
                    "components"
                };
                let catalog = json!({"hash": frame.get("hash").cloned().unwrap_or(Value::Null), list_field: frame.get(list_field).cloned().unwrap_or(Value::Array(vec![]))});
                if let Err(error) = self
                    .state
                    .store
                    .set_channel_catalog(self.channel_id, &kind, &catalog)
                    .await
                {
                    tracing::warn!(%error, "catalog not stored");
                    return self.push(
                        &ErrorFrame::new(ErrorCode::Internal, "catalog not stored; retry")
                            .to_json(),
                    );
                }
                Ok(())
            }
            "" => {
                self.push(&ErrorFrame::new(ErrorCode::InvalidMessage, "type is missing").to_json())
            }
            // hello again, or types this version does not know: ignored.
            _ => Ok(()),
        }
    }

    fn on_auth(&mut self, token: &str) -> Result<(), Ending> {
        let accepted = self.state.tokens.verify(token).ok().filter(|claims| {
            claims.tenant_id == self.claims.tenant_id
                && claims.channel_id == self.channel_id
                && claims.scope() == Scope::Channel
        });
        let Some(claims) = accepted else {
            return self.push(
                &ErrorFrame::new(
                    ErrorCode::Forbidden,
                    "token refused; the current token stays",
                )
                .to_json(),
            );
        };
        self.token_expires_at = expiry_instant(claims.exp);
        let expires_at = claims.exp.saturating_mul(1000);
        self.claims = claims;
        self.push(&json!({"type": "tokenRefreshed", "data": {"expiresAt": expires_at}}))
    }

    /// True when addressing this conversation would exceed `maxConversations`: the number of
    /// distinct conversations this connection has sent frames for (deliveries do not count).
    fn at_conversation_limit(&self, conversation_id: Uuid) -> bool {
        !self.known_conversations.contains(&conversation_id)
            && self.known_conversations.len() >= self.state.config.limits.max_conversations
    }

    /// True when the conversation belongs to this channel (checked once per conversation).
    async fn owns_conversation(&mut self, conversation_id: Uuid) -> Result<bool, Ending> {
        if self.known_conversations.contains(&conversation_id) {
            return Ok(true);
        }
        match self
            .state
            .store
            .conversation_in_channel(conversation_id, self.channel_id)
            .await
        {
            Ok(Some(_)) => {
                self.known_conversations.insert(conversation_id);
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(error) => {
                tracing::error!(%error, "agent: conversation lookup failed");
                Err(internal_close(self.outbound))
            }
        }
    }

    async fn on_enveloped(
        &mut self,
        conversation_id: Uuid,
        frame: Map<String, Value>,
    ) -> Result<(), Ending> {
        if self.at_conversation_limit(conversation_id) {
            let error = ErrorFrame::new(
                ErrorCode::TooManySubscriptions,
                "maxConversations reached for this connection",
            );
            return self.enveloped_error(conversation_id, error);
        }
        if !self.owns_conversation(conversation_id).await? {
            return self.enveloped_error(
                conversation_id,
                ErrorFrame::new(
                    ErrorCode::ConversationNotFound,
                    "conversation not found in this channel",
                ),
            );
        }
        let kind = frame
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        if kind != "turnResult" {
            self.finish_results().await?;
        }
        match kind.as_str() {
            "turnResult" => self.on_turn_result(conversation_id, frame).await,
            "typing" => {
                let is_typing = frame
                    .get("isTyping")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                self.relay(
                    conversation_id,
                    json!({"type": "typing", "isTyping": is_typing}),
                )
                .await;
                Ok(())
            }
            "run" => {
                self.relay(
                    conversation_id,
                    json!({"type": "run", "data": frame.get("data").cloned().unwrap_or(json!({}))}),
                )
                .await;
                Ok(())
            }
            "error" => {
                self.relay(conversation_id, json!({"type": "error", "data": frame.get("data").cloned().unwrap_or(json!({}))})).await;
                Ok(())
            }
            "sync" => match frame.get("watermark").and_then(Value::as_u64) {
                Some(watermark) => self.replay(conversation_id, watermark).await,
                None => self.enveloped_error(
                    conversation_id,
                    ErrorFrame::new(
                        ErrorCode::InvalidMessage,
                        "watermark must be a non-negative integer",
                    ),
                ),
            },
            _ => {
                self.on_proactive(conversation_id, Value::Object(frame))
                    .await
            }
        }
    }

    /// Relays a transient agent frame to the conversation's end users on every node.
    async fn relay(&self, conversation_id: Uuid, frame: Value) {
        let origin = Origin {
            id: self.sender_id.clone(),
            role: AGENT_ROLE.into(),
            connection: self.connection_id.to_string(),
        };
        self.state.hub.publish(
            conversation_id,
            HubEvent::Transient {
                frame: Arc::new(frame.clone()),
                origin: Some(Arc::new(origin.clone())),
            },
        );
        // End users only, as on this node: agents do not receive each other's transient frames.
        let transient = TransientFrame {
            node: self.state.hub.node_id().to_owned(),
            channel_id: None,
            conversation_id,
            frame,
            origin: Some(origin),
            agents_only: false,
        };
        if let Err(error) = self.state.store.publish_transient(&transient).await {
            tracing::warn!(%error, "agent frame not relayed to other nodes");
        }
    }

    /// Asks the actor to replay what this connection owns of a conversation after `watermark`.
    async fn replay(&mut self, conversation_id: Uuid, watermark: u64) -> Result<(), Ending> {
        if self.at_conversation_limit(conversation_id) {
            let error = ErrorFrame::new(
                ErrorCode::TooManySubscriptions,
                "maxConversations reached for this connection",
            );
            return self.enveloped_error(conversation_id, error);
        }
        if !self.owns_conversation(conversation_id).await? {
            let error = ErrorFrame::new(
                ErrorCode::ConversationNotFound,
                "conversation not found in this channel",
            );
            return self.enveloped_error(conversation_id, error);
        }
        if let Some(inbox) = &self.inbox {
            let _ = inbox.send(ActorMessage::Replay {
                connection_id: self.connection_id.to_string(),
                conversation_id,
                watermark: i64::try_from(watermark).unwrap_or(i64::MAX),
                limit: self.state.config.limits.replay_max as i64,
            });
        }
        Ok(())
    }

    fn sender(&self) -> Sender {
        Sender {
            id: self.sender_id.clone(),
            role: SenderRole::Agent,
        }
    }

    async fn on_proactive(&mut self, conversation_id: Uuid, frame: Value) -> Result<(), Ending> {
        let message = match validate_message_frame(&frame, &self.state.config.limits) {
            Ok(message) => message,
            Err(error) => {
                let client_id = frame
                    .get("clientId")
                    .and_then(Value::as_str)
                    .filter(|id| converger_protocol::is_valid_client_id(id))
                    .map(str::to_owned);
                return self.enveloped_error(
                    conversation_id,
                    ErrorFrame {
                        client_id,
                        ..ErrorFrame::new(error.code, error.message)
                    },
                );
            }
        };
        let new = NewActivity {
            conversation_id,
            id: message.id.clone(),
            kind: message.kind.clone(),
            sender: self.sender(),
            data: message.data,
            metadata: message.metadata,
            extra: Some(message.extra),
            client_id: message.client_id.clone(),
        };
        let outcome = match self.state.store.commit_activity(&new).await {
            Ok(outcome) => outcome,
            Err(error) => {
                tracing::warn!(%error, "agent frame not stored");
                return self.enveloped_error(
                    conversation_id,
                    ErrorFrame {
                        client_id: message.client_id,
                        ..ErrorFrame::new(ErrorCode::Internal, "the frame was not stored")
                    },
                );
            }
        };
        let activity = Arc::new(outcome.activity);
        if !outcome.duplicate {
            self.state.hub.publish_to_all(
                self.channel_id,
                conversation_id,
                HubEvent::Committed {
                    seq: activity.seq,
                    activity: Some(Arc::clone(&activity)),
                },
            );
        }
        let Some(client_id) = message.client_id else {
            return Ok(());
        };
        let mut ack = json!({"type": "ack", "clientId": client_id, "id": activity.id, "seq": activity.seq, "timestamp": activity.timestamp_ms()});
        if outcome.duplicate {
            ack["duplicate"] = Value::Bool(true);
        }
        self.push_enveloped(conversation_id, ack)
    }

    async fn on_turn_result(
        &mut self,
        conversation_id: Uuid,
        frame: Map<String, Value>,
    ) -> Result<(), Ending> {
        let client_id = frame
            .get("clientId")
            .and_then(Value::as_str)
            .filter(|id| converger_protocol::is_valid_client_id(id))
            .map(str::to_owned);
        let answer = match self.parse_answer(conversation_id, &frame) {
            Ok(answer) => answer,
            Err(error) => {
                return self.enveloped_error(
                    conversation_id,
                    ErrorFrame {
                        client_id,
                        frame_type: Some("turnResult".into()),
                        ..*error
                    },
                );
            }
        };
        if self.results.must_wait(conversation_id) {
            self.finish_results().await?;
        }
        self.results
            .start(self.state, self.channel_id, client_id, answer);
        Ok(())
    }

    /// Waits for every result in flight and writes its ack or refusal.
    async fn finish_results(&mut self) -> Result<(), Ending> {
        while let Some((conversation_id, reply)) = self.results.next_reply().await {
            self.push_enveloped(conversation_id, reply)?;
        }
        Ok(())
    }

    fn parse_answer(
        &self,
        conversation_id: Uuid,
        frame: &Map<String, Value>,
    ) -> Result<TurnAnswer, Box<ErrorFrame>> {
        let invalid = |message: &str| Box::new(ErrorFrame::new(ErrorCode::InvalidMessage, message));
        let turn = frame
            .get("turn")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid("turn must be an object"))?;
        let seq = turn
            .get("seq")
            .and_then(Value::as_i64)
            .filter(|seq| *seq > 0)
            .ok_or_else(|| invalid("turn.seq must be a positive integer"))?;
        let revision = match turn.get("revision") {
            None | Some(Value::Null) => 0,
            Some(value) => value
                .as_i64()
                .and_then(|revision| i32::try_from(revision).ok())
                .filter(|revision| *revision >= 0)
                .ok_or_else(|| invalid("turn.revision must be a non-negative integer"))?,
        };
        let fence = match turn.get("fence") {
            None | Some(Value::Null) => None,
            Some(value) => Some(
                value
                    .as_i64()
                    .filter(|fence| *fence >= 0)
                    .ok_or_else(|| invalid("turn.fence must be a non-negative integer"))?,
            ),
        };
        if self.lease.is_some() && fence.is_none() {
            return Err(Box::new(ErrorFrame::new(
                ErrorCode::BadRequest,
                "turn.fence is required in lease mode",
            )));
        }
        let frames = frame
            .get("frames")
            .and_then(Value::as_array)
            .ok_or_else(|| invalid("frames must be an array"))?;
        let limits = &self.state.config.limits;
        let mut answer_frames = Vec::with_capacity(frames.len());
        for frame in frames {
            let message = validate_message_frame(frame, limits).map_err(|error| {
                ErrorFrame::new(error.code, format!("frames: {}", error.message))
            })?;
            answer_frames.push(AnswerFrame {
                id: message.id,
                kind: message.kind,
                data: message.data,
                metadata: message.metadata,
                extra: message.extra,
            });
        }
        let runtime = match frame.get("runtime") {
            None | Some(Value::Null) => None,
            Some(Value::Object(runtime)) => {
                let version = runtime
                    .get("version")
                    .and_then(Value::as_i64)
                    .filter(|version| *version >= 0)
                    .ok_or_else(|| invalid("runtime.version must be a non-negative integer"))?;
                let state = runtime
                    .get("state")
                    .filter(|state| state.is_object())
                    .cloned()
                    .ok_or_else(|| invalid("runtime.state must be an object"))?;
                if state.to_string().len() > limits.max_frame_bytes {
                    return Err(Box::new(ErrorFrame::new(
                        ErrorCode::PayloadTooLarge,
                        "runtime.state is too large",
                    )));
                }
                Some(RuntimeWrite { version, state })
            }
            Some(_) => return Err(invalid("runtime must be an object")),
        };
        Ok(TurnAnswer {
            conversation_id,
            seq,
            revision,
            sender: self.sender(),
            frames: answer_frames,
            runtime,
            fence,
        })
    }
}
