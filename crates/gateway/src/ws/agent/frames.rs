//! What an agent sends, as `converger_protocol::parse_agent_text` parsed it: bare commands,
//! and enveloped frames for one conversation (results, relayed frames, `sync`, proactive
//! frames).

use converger_protocol::{
    AgentFrame, Catalog, Envelope, EnvelopedFrame, ErrorCode, ErrorFrame, Heartbeat, MessageFrame,
    TurnResult, answer_refused, relayed_error, run_status, token_refreshed, typing,
};
use converger_store::bus::Origin;
use converger_store::{
    AnswerFrame, NewActivity, RuntimeWrite, Sender, SenderRole, StoreError, TurnAnswer, faults,
};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use super::{AGENT_ROLE, AgentSession};
use crate::actors::ActorMessage;
use crate::publish::{self, Audience, Transient};
use crate::tokens::Scope;
use crate::ws::session::{
    Ending, expiry_instant, internal_close, now_ms, refusal_frame, token_refused,
};

impl AgentSession<'_> {
    pub(super) async fn on_frame(&mut self, frame: AgentFrame) -> Result<(), Ending> {
        let (conversation_id, frame) = match frame {
            AgentFrame::Enveloped {
                conversation_id,
                frame,
            } => (conversation_id, frame),
            bare => {
                self.finish_results().await?;
                return self.on_bare(bare).await;
            }
        };
        if !self.may_address(conversation_id).await? {
            return Ok(());
        }
        // A result commits before the agent's next frame of any kind is handled, except chunks:
        // they are not stored, and waiting would stall every stream behind one commit.
        if !matches!(
            frame,
            EnvelopedFrame::TurnResult(_) | EnvelopedFrame::StreamChunk(_)
        ) {
            self.finish_results().await?;
        }
        match frame {
            EnvelopedFrame::TurnResult(Ok(result)) => {
                self.on_turn_result(conversation_id, *result).await
            }
            // A refused answer or frame: the agent is told, and so are the end users, who
            // would otherwise wait on a turn whose answer never comes.
            EnvelopedFrame::TurnResult(Err(refusal)) | EnvelopedFrame::Message(Err(refusal)) => {
                let frame_type = refusal.frame_type.as_deref().unwrap_or("message");
                self.relay(
                    conversation_id,
                    answer_refused(refusal.error.code, frame_type, None),
                )
                .await;
                self.enveloped_error(conversation_id, refusal_frame(&refusal))
            }
            EnvelopedFrame::StreamChunk(Ok(chunk)) => {
                self.on_stream_chunk(conversation_id, *chunk).await
            }
            EnvelopedFrame::StreamAbort(Ok(abort)) => self.on_stream_abort(conversation_id, &abort),
            EnvelopedFrame::Refused(refusal)
            | EnvelopedFrame::Sync(Err(refusal))
            | EnvelopedFrame::StreamChunk(Err(refusal))
            | EnvelopedFrame::StreamAbort(Err(refusal)) => {
                self.enveloped_error(conversation_id, refusal_frame(&refusal))
            }
            EnvelopedFrame::Typing { is_typing } => {
                self.relay(conversation_id, typing(is_typing, None)).await;
                Ok(())
            }
            EnvelopedFrame::Run { data } => {
                self.relay(conversation_id, run_status(&data)).await;
                Ok(())
            }
            EnvelopedFrame::Error { data } => {
                self.relay(conversation_id, relayed_error(&data)).await;
                Ok(())
            }
            EnvelopedFrame::Sync(Ok(watermark)) => self.replay(conversation_id, watermark).await,
            EnvelopedFrame::Message(Ok(message)) => {
                self.on_proactive(conversation_id, *message).await
            }
        }
    }

    async fn on_bare(&mut self, frame: AgentFrame) -> Result<(), Ending> {
        match frame {
            AgentFrame::Ping { nonce } => {
                let heartbeat = Heartbeat {
                    timestamp: now_ms(),
                    head_seq: None,
                    nonce: nonce.as_ref(),
                };
                self.push(heartbeat.encode())
            }
            AgentFrame::Auth { token } => self.on_auth(&token),
            AgentFrame::Catalog {
                catalog,
                hash,
                list,
            } => self.on_catalog(catalog, &hash, &list).await,
            AgentFrame::Ignored | AgentFrame::Enveloped { .. } => Ok(()),
        }
    }

    async fn on_catalog(
        &mut self,
        catalog: Catalog,
        hash: &Value,
        list: &Value,
    ) -> Result<(), Ending> {
        let stored = catalog.stored(hash, list);
        if let Err(error) = self
            .state
            .store
            .set_channel_catalog(self.channel_id, catalog.kind(), &stored)
            .await
        {
            tracing::warn!(%error, "catalog not stored");
            return self.push_error(crate::error::write_error_frame(
                &error,
                "catalog not stored; retry",
            ));
        }
        Ok(())
    }

    fn on_auth(&mut self, token: &str) -> Result<(), Ending> {
        let accepted = self.state.tokens.verify(token).ok().filter(|claims| {
            claims.tenant_id == self.claims.tenant_id
                && claims.channel_id == self.channel_id
                && claims.scope() == Scope::Channel
        });
        let Some(claims) = accepted else {
            return self.push_error(token_refused());
        };
        self.token_expires_at = expiry_instant(claims.exp);
        let expires_at = claims.exp.saturating_mul(1000);
        self.claims = claims;
        self.push(token_refreshed(expires_at))
    }

    pub(super) fn push_enveloped(
        &mut self,
        conversation_id: Uuid,
        frame: impl Serialize,
    ) -> Result<(), Ending> {
        let conversation = conversation_id.to_string();
        let text = Envelope {
            conversation_id: &conversation,
            frame,
        }
        .encode();
        self.push(text)
    }

    pub(super) fn enveloped_error(
        &mut self,
        conversation_id: Uuid,
        error: ErrorFrame,
    ) -> Result<(), Ending> {
        self.push_enveloped(conversation_id, &error)
    }

    /// True when this connection may address the conversation; otherwise the refusal is sent
    /// (over `maxConversations`, or not a conversation of the channel).
    async fn may_address(&mut self, conversation_id: Uuid) -> Result<bool, Ending> {
        if self.at_conversation_limit(conversation_id) {
            let error = ErrorFrame::new(
                ErrorCode::TooManySubscriptions,
                "maxConversations reached for this connection",
            );
            self.enveloped_error(conversation_id, error)?;
            return Ok(false);
        }
        if !self.owns_conversation(conversation_id).await? {
            self.enveloped_error(conversation_id, not_in_channel())?;
            return Ok(false);
        }
        Ok(true)
    }

    /// True when addressing this conversation would exceed `maxConversations`: the number of
    /// distinct conversations this connection has sent frames for (deliveries do not count).
    fn at_conversation_limit(&self, conversation_id: Uuid) -> bool {
        !self.known_conversations.contains(&conversation_id)
            && self.known_conversations.len() >= self.state.config.limits.max_conversations
    }

    /// True when the conversation belongs to this channel (checked once per conversation). A
    /// conversation whose turn this connection was handed is the channel's: the channel actor
    /// delivers only its own channel's turns. Any other is looked up; the lookup is awaited
    /// here and holds back this connection's later frames (one per new conversation made
    /// every first answer wait for it).
    async fn owns_conversation(&mut self, conversation_id: Uuid) -> Result<bool, Ending> {
        if self.known_conversations.contains(&conversation_id) {
            return Ok(true);
        }
        if self.was_delivered(conversation_id) {
            self.known_conversations.insert(conversation_id);
            return Ok(true);
        }
        let lookup = if faults::injected(faults::AGENT_CONVERSATION_LOOKUP) {
            Err(StoreError::Injected(faults::AGENT_CONVERSATION_LOOKUP))
        } else {
            self.state
                .store
                .conversation_in_channel(conversation_id, self.channel_id)
                .await
        };
        match lookup {
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

    /// Relays a transient agent frame to the conversation's end users on every node (agents do
    /// not receive each other's transient frames).
    async fn relay(&self, conversation_id: Uuid, frame: Value) {
        Transient {
            channel_id: self.channel_id,
            conversation_id,
            frame,
            origin: self.origin(),
            audience: Audience::EndUsers,
        }
        .publish(self.state)
        .await;
    }

    /// This connection as the author of transient frames.
    fn origin(&self) -> Origin {
        Origin {
            id: self.sender_id.clone(),
            role: AGENT_ROLE.into(),
            connection: self.connection_id.to_string(),
        }
    }

    /// Asks the actor to replay what this connection owns of a conversation after `watermark`.
    pub(super) async fn replay(
        &mut self,
        conversation_id: Uuid,
        watermark: u64,
    ) -> Result<(), Ending> {
        if !self.may_address(conversation_id).await? {
            return Ok(());
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

    /// This connection as the `from` of its stream chunks (made once, shared by all).
    pub(super) fn sender_ref(&mut self) -> std::sync::Arc<Value> {
        let sender_id = &self.sender_id;
        std::sync::Arc::clone(self.stream_from.get_or_insert_with(|| {
            std::sync::Arc::new(serde_json::json!({"id": sender_id, "role": AGENT_ROLE}))
        }))
    }

    fn sender(&self) -> Sender {
        Sender {
            id: self.sender_id.clone(),
            role: SenderRole::Agent,
        }
    }

    async fn on_proactive(
        &mut self,
        conversation_id: Uuid,
        message: MessageFrame,
    ) -> Result<(), Ending> {
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
        let (activity, duplicate) =
            match publish::commit_frame(self.state, self.channel_id, &new).await {
                Ok(committed) => committed,
                Err(error) => {
                    tracing::warn!(%error, "agent frame not stored");
                    let code = crate::error::write_error_code(&error);
                    if code == ErrorCode::InvalidMessage {
                        let notice = answer_refused(code, &message.kind, None);
                        self.relay(conversation_id, notice).await;
                    }
                    let error = ErrorFrame {
                        client_id: message.client_id,
                        ..crate::error::write_error_frame(&error, "the frame was not stored")
                    };
                    return self.enveloped_error(conversation_id, error);
                }
            };
        let Some(client_id) = message.client_id else {
            return Ok(());
        };
        let ack = converger_protocol::Ack::stored(
            &client_id,
            &activity.id,
            activity.seq,
            activity.timestamp_ms(),
            duplicate,
        );
        let text = ack.to_value();
        self.push_enveloped(conversation_id, text)
    }

    async fn on_turn_result(
        &mut self,
        conversation_id: Uuid,
        result: TurnResult,
    ) -> Result<(), Ending> {
        if self.results.must_wait(conversation_id) {
            self.finish_results().await?;
        }
        let client_id = result.client_id.clone();
        let answer = self.answer(conversation_id, result);
        self.results.start(
            self.state,
            self.channel_id,
            client_id,
            answer,
            self.origin(),
        );
        Ok(())
    }

    /// A parsed result as the store commits it.
    fn answer(&self, conversation_id: Uuid, result: TurnResult) -> TurnAnswer {
        TurnAnswer {
            conversation_id,
            seq: result.seq,
            revision: result.revision,
            sender: self.sender(),
            frames: result
                .frames
                .into_iter()
                .map(|frame| AnswerFrame {
                    // A frame that names the stream it completes takes the stream's id, so a
                    // client that keyed the streamed bubble by it replaces that bubble.
                    id: frame.id.or_else(|| {
                        frame
                            .extra
                            .get("streamId")
                            .and_then(Value::as_str)
                            .filter(|id| converger_protocol::is_valid_client_id(id))
                            .map(str::to_owned)
                    }),
                    kind: frame.kind,
                    data: frame.data,
                    metadata: frame.metadata,
                    extra: frame.extra,
                })
                .collect(),
            runtime: result.runtime.map(|runtime| RuntimeWrite {
                version: runtime.version,
                state: runtime.state,
            }),
            fence: result.fence,
        }
    }

    /// Waits for every result in flight and writes its ack or refusal.
    pub(super) async fn finish_results(&mut self) -> Result<(), Ending> {
        while let Some((conversation_id, reply)) = self.results.next_reply().await {
            self.push_enveloped(conversation_id, reply)?;
        }
        Ok(())
    }
}

fn not_in_channel() -> ErrorFrame {
    ErrorFrame::new(
        ErrorCode::ConversationNotFound,
        "conversation not found in this channel",
    )
}
