//! Everything a session relays or answers without storing a frame: typing, read receipts,
//! presence, forwarded client frames, `auth`, heartbeats, and the node's orders.

use std::time::Duration;

use converger_protocol::{
    ErrorCode, ErrorFrame, Heartbeat, Participant, USER_ROLE, read_receipt, token_refreshed, typing,
};
use serde_json::{Map, Value, json};
use tokio::time::Instant;

use super::Session;
use crate::hub::SessionControl;
use crate::publish::{Audience, Transient};
use crate::ws::session::{Ending, now_ms, ordered_close, token_refused};

impl Session<'_> {
    fn me(&self) -> Participant<'_> {
        Participant {
            id: &self.user_id,
            role: USER_ROLE,
        }
    }

    fn transient(&self, frame: Value, audience: Audience) -> Transient {
        Transient {
            channel_id: self.channel_id,
            conversation_id: self.conversation_id,
            frame,
            origin: self.origin(),
            audience,
        }
    }

    pub(super) async fn on_typing(&mut self, is_typing: bool) -> Result<(), Ending> {
        let throttle = Duration::from_millis(self.state.config.limits.typing_throttle_ms);
        let now = Instant::now();
        if let Some((last_state, at)) = self.typing_relayed
            && last_state == is_typing
            && now.duration_since(at) < throttle
        {
            return Ok(());
        }
        self.typing_relayed = Some((is_typing, now));
        let frame = typing(is_typing, Some(self.me()));
        self.transient(frame, Audience::Everyone)
            .publish(self.state)
            .await;
        Ok(())
    }

    pub(super) async fn on_read(&mut self, watermark: u64) -> Result<(), Ending> {
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
                return self.push_error(crate::error::write_error_frame(
                    &error,
                    "read position not stored; retry",
                ));
            }
        };
        if let Some(up_to) = moved {
            let frame = read_receipt(up_to, self.me());
            self.transient(frame, Audience::Everyone)
                .publish(self.state)
                .await;
        }
        Ok(())
    }

    /// A client frame the gateway does not interpret goes to the channel's agents, on this node
    /// and (when agents are connected there) the others; with no agent anywhere the client
    /// learns it at once.
    pub(super) async fn on_forwarded(
        &mut self,
        kind: String,
        frame: Map<String, Value>,
    ) -> Result<(), Ending> {
        let local = self.state.hub.has_agents(self.channel_id);
        let remote = self.state.actors.has_remote_agents(self.channel_id);
        if local || remote {
            let transient = self.transient(Value::Object(frame), Audience::Agents);
            if remote {
                transient.publish(self.state).await;
            } else {
                transient.publish_here(&self.state.hub);
            }
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

    /// The hello's `tools` and `skills`, handed to the channel's agents as the `client_tools`
    /// and `client_skills` frames a client may also send (`{"data": {"tools": …}}`); with no
    /// agent connected anywhere, nothing (the client asked for no answer).
    pub(super) async fn relay_hello_catalogs(&mut self, hello: &converger_protocol::Hello) {
        let catalogs = [
            ("client_tools", "tools", &hello.tools),
            ("client_skills", "skills", &hello.skills),
        ];
        for (kind, key, value) in catalogs {
            let Some(value) = value else {
                continue;
            };
            let remote = self.state.actors.has_remote_agents(self.channel_id);
            if !remote && !self.state.hub.has_agents(self.channel_id) {
                continue;
            }
            let frame = serde_json::json!({"type": kind, "data": {key: value}});
            let transient = self.transient(frame, Audience::Agents);
            if remote {
                transient.publish(self.state).await;
            } else {
                transient.publish_here(&self.state.hub);
            }
        }
    }

    pub(super) fn on_auth(&mut self, token: &str) -> Result<(), Ending> {
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
            return self.push_error(token_refused());
        };
        self.token_expires_at = crate::ws::session::expiry_instant(claims.exp);
        let expires_at = claims.exp.saturating_mul(1000);
        self.claims = claims;
        if !self.is_converger() {
            return Ok(());
        }
        self.push(token_refreshed(expires_at), false)
    }

    /// This session's presence, as the cluster counts it.
    pub(super) fn presence(&self) -> crate::presence::Presence {
        crate::presence::Presence {
            channel_id: self.channel_id,
            conversation_id: self.conversation_id,
            user_id: self.user_id.clone(),
            connection_id: self.connection_id,
        }
    }

    pub(super) fn on_ping(&mut self, nonce: Option<&Value>) -> Result<(), Ending> {
        if !self.is_converger() {
            return Ok(());
        }
        let heartbeat = Heartbeat {
            timestamp: now_ms(),
            head_seq: Some(self.cursor.last_sent()),
            nonce,
        };
        self.push_transient("heartbeat", heartbeat.encode())
    }

    pub(super) fn on_heartbeat(&mut self, every: Duration) -> Result<(), Ending> {
        self.outbound.push_ping();
        if self.is_converger() && self.last_outbound.elapsed() >= every {
            let heartbeat = Heartbeat {
                timestamp: now_ms(),
                head_seq: Some(self.cursor.last_sent()),
                nonce: None,
            };
            self.push_transient("heartbeat", heartbeat.encode())?;
        }
        Ok(())
    }

    pub(super) fn on_token_expired(&mut self) -> Ending {
        if self.is_converger() {
            let _ = self.push_error(ErrorFrame::new(
                ErrorCode::TokenExpired,
                "token expired; send auth with a new token",
            ));
            return Ending::token_expired();
        }
        // The chativa connector gives up for good on `unauthorized` and 4401 (a refused
        // credential), but reconnects on any other close, asking its token function for a
        // fresh token first: an expiry is told as one, so the widget carries on (ADR 0027).
        let _ = self.push_error(ErrorFrame {
            details: Some(json!({"reason": "token_expired"})),
            ..ErrorFrame::new(
                ErrorCode::TokenExpired,
                "token expired; reconnect with a new token",
            )
        });
        Ending::token_expired_reconnect()
    }

    pub(super) fn on_control(&mut self, control: Option<SessionControl>) -> Result<(), Ending> {
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
            }) => Err(ordered_close(self.outbound, error, code, reason)),
        }
    }
}
