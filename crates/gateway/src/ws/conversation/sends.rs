//! Message frames, edits and regenerates: queued (`maxInFlight`), committed one at a time,
//! published to this node, acked.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use converger_core::policies::TurnPolicy;
use converger_protocol::{
    Ack, ErrorCode, ErrorFrame, MessageFrame, Profile, StopReason, TurnNumber, TurnTarget,
};
use converger_store::faults;
use converger_store::{CommitOutcome, NewActivity, Sender, SenderRole, StopOutcome, StoreError};
use serde_json::Value;

use super::Session;
use crate::policies::SendError;
use crate::publish;
use crate::ws::session::Ending;

/// A send's commit; it borrows the node's state, which outlives every session.
pub(super) type CommitFuture<'a> = Pin<Box<dyn Future<Output = CommitDone> + Send + 'a>>;

/// A send waiting for its commit.
pub(super) struct PendingSend {
    pub(super) frame: MessageFrame,
    /// The turn policy it asked for (`turnPolicy`).
    pub(super) policy: Option<TurnPolicy>,
}

/// A finished commit.
pub(super) struct CommitDone {
    client_id: Option<String>,
    frame_type: String,
    result: Result<CommitOutcome, SendError>,
}

impl<'a> Session<'a> {
    pub(super) fn on_send(&mut self, frame: MessageFrame) -> Result<(), Ending> {
        let policy = match frame.turn_policy.as_deref().map(TurnPolicy::parse) {
            None => None,
            Some(Some(policy)) => Some(policy),
            Some(None) => {
                return self.push_error(ErrorFrame {
                    client_id: frame.user_idempotency_key().map(str::to_owned),
                    frame_type: Some(frame.kind.clone()),
                    ..ErrorFrame::new(ErrorCode::InvalidMessage, crate::policies::UNKNOWN_POLICY)
                });
            }
        };
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
        self.sends.push_back(PendingSend { frame, policy });
        Ok(())
    }

    pub(super) fn start_commit(&self, send: PendingSend) -> CommitFuture<'a> {
        let state = self.state;
        let channel_id = self.channel_id;
        let policy = send.policy;
        let frame = send.frame;
        let client_id = frame.user_idempotency_key().map(str::to_owned);
        // A mekik client knows its frames only by the `id` it chose and de-duplicates by it, so
        // that id is the stored one; the converger profile keys frames by `clientId` and gets
        // a server id (ADR 0017).
        let id = match self.profile {
            Profile::Mekik => frame.id.clone(),
            Profile::Converger => None,
        };
        // The turn's meta for agents is kept with the frame (never shown to end users).
        let mut extra = frame.extra;
        let meta =
            converger_protocol::turn_client_meta(self.hello_meta.as_deref(), frame.meta.as_ref());
        if let Some(meta) = meta {
            extra.insert("meta".into(), meta);
        }
        let new = NewActivity {
            conversation_id: self.conversation_id,
            id,
            kind: frame.kind.clone(),
            sender: Sender {
                id: self.user_id.clone(),
                role: SenderRole::User,
            },
            data: frame.data,
            metadata: frame.metadata,
            extra: Some(extra),
            client_id: client_id.clone(),
        };
        let frame_type = frame.kind;
        Box::pin(async move {
            let result = crate::policies::commit_send(state, channel_id, &new, policy).await;
            CommitDone {
                client_id,
                frame_type,
                result,
            }
        })
    }

    pub(super) fn on_commit(&mut self, done: CommitDone) -> Result<(), Ending> {
        let CommitDone {
            client_id,
            frame_type,
            result,
        } = done;
        let outcome = match result {
            Ok(outcome) => outcome,
            Err(SendError::NotAllowed(policy)) => {
                return self.push_error(ErrorFrame {
                    client_id,
                    frame_type: Some(frame_type),
                    ..ErrorFrame::new(
                        ErrorCode::BadRequest,
                        format!(
                            "turnPolicy {} is not allowed on this channel",
                            policy.as_str()
                        ),
                    )
                });
            }
            Err(SendError::Store(StoreError::TurnInProgress { seq })) => {
                return self.push_error(ErrorFrame {
                    client_id,
                    frame_type: Some(frame_type),
                    details: Some(serde_json::json!({"turn": {"seq": seq}})),
                    ..ErrorFrame::new(
                        ErrorCode::TurnInProgress,
                        "a turn of this conversation is being answered; nothing was stored",
                    )
                });
            }
            Err(SendError::Store(error)) => {
                let code = crate::error::write_error_code(&error);
                if code == ErrorCode::Internal {
                    tracing::error!(%error, conversation_id = %self.conversation_id, "send failed");
                }
                return self.push_error(ErrorFrame {
                    client_id,
                    frame_type: Some(frame_type),
                    ..crate::error::write_error_frame(&error, "the frame was not stored")
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
            publish::committed(
                self.state,
                self.channel_id,
                self.conversation_id,
                [Arc::clone(&activity)],
            );
        }
        let (Some(client_id), true) = (client_id, self.is_converger()) else {
            return Ok(());
        };
        if faults::injected(faults::ACK_SEND_DROP) {
            return Ok(());
        }
        let ack = Ack::stored(
            &client_id,
            &activity.id,
            activity.seq,
            activity.timestamp_ms(),
            outcome.duplicate,
        );
        self.push(ack.encode(), false)
    }

    /// `edit` (with `data`) or `regenerate`: revision + 1 of the targeted turn of this user.
    pub(super) async fn on_revision(
        &mut self,
        target: TurnTarget,
        client_id: Option<String>,
        data: Option<Value>,
    ) -> Result<(), Ending> {
        let frame_type = if data.is_some() { "edit" } else { "regenerate" };
        let refuse = |code: ErrorCode, message: &str| ErrorFrame {
            client_id: client_id.clone(),
            frame_type: Some(frame_type.into()),
            ..crate::error::error_frame(code, message)
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
                return self.push_error(refuse(crate::error::failure_code(&error), "try again"));
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
                return self.push_error(refuse(
                    crate::error::failure_code(&error),
                    "the revision was not stored",
                ));
            }
        };
        let mut ack = Ack {
            client_id: client_id.as_deref(),
            turn: Some(TurnNumber {
                seq: revision.turn_seq,
                revision: revision.revision,
            }),
            duplicate: revision.duplicate,
            ..Ack::default()
        };
        let stored = revision.edit.map(Arc::new);
        match &stored {
            Some(stored) => {
                ack.id = Some(&stored.id);
                ack.seq = Some(stored.seq);
                ack.timestamp = Some(stored.timestamp_ms());
                if !revision.duplicate {
                    // The edit is a persistent frame: everyone but this connection sees it.
                    self.own_seqs.insert(stored.seq);
                    publish::committed(
                        self.state,
                        self.channel_id,
                        self.conversation_id,
                        [Arc::clone(stored)],
                    );
                }
            }
            None if revision.duplicate => {}
            None => {
                publish::regenerated(
                    self.state,
                    self.channel_id,
                    Arc::new(turn),
                    revision.revision,
                    revision.opened_at,
                )
                .await;
            }
        }
        if client_id.is_none() || !self.is_converger() {
            return Ok(());
        }
        let ack = ack.encode();
        self.push(ack, false)
    }

    /// The mekik `abort`: stops the latest unanswered turn, and answers nothing (the widget
    /// reads no acks, and an abort with nothing running is not an error to it).
    pub(super) async fn on_abort(&mut self) {
        if let Err(error) =
            crate::stops::stop(self.state, self.conversation_id, None, StopReason::Stopped).await
        {
            tracing::debug!(%error, "abort: stop not stored");
        }
    }

    /// `stop`: stops the turn at `seq`, or the latest unanswered one (ADR 0028). Answered, in the converger profile and with a `clientId`, by an ack saying
    /// whether a turn is stopping and which.
    pub(super) async fn on_stop(
        &mut self,
        client_id: Option<String>,
        seq: Option<u64>,
    ) -> Result<(), Ending> {
        let refuse = |code: ErrorCode, message: &str| ErrorFrame {
            client_id: client_id.clone(),
            frame_type: Some("stop".into()),
            ..crate::error::error_frame(code, message)
        };
        let seq = match seq.map(i64::try_from) {
            None => None,
            Some(Ok(seq)) => Some(seq),
            // Beyond any seq there can be: no such turn (never "the latest").
            Some(Err(_)) => return self.push_error(refuse(ErrorCode::BadRequest, "no such turn")),
        };
        let outcome =
            crate::stops::stop(self.state, self.conversation_id, seq, StopReason::Stopped).await;
        let (stopped, turn) = match outcome.as_ref().map(StopOutcome::answer) {
            Ok(Some(answer)) => answer,
            Ok(None) => return self.push_error(refuse(ErrorCode::BadRequest, "no such turn")),
            Err(StoreError::ConversationClosed) => {
                return self.push_error(refuse(
                    ErrorCode::ConversationClosed,
                    "conversation is closed",
                ));
            }
            Err(error) => {
                tracing::warn!(%error, "stop not stored");
                return self.push_error(refuse(
                    crate::error::failure_code(error),
                    "the stop was not stored",
                ));
            }
        };
        if client_id.is_none() || !self.is_converger() {
            return Ok(());
        }
        let ack = Ack {
            client_id: client_id.as_deref(),
            turn: turn.map(|turn| TurnNumber {
                seq: turn.seq,
                revision: turn.revision,
            }),
            stopped: Some(stopped),
            ..Ack::default()
        };
        self.push(ack.encode(), false)
    }
}
