//! The WebSocket endpoint `GET /socket/converger/v1` (docs/protocol.md §§1–4).
//!
//! The upgrade itself never fails for credential reasons: credentials are checked when `hello`
//! arrives so every client can read the reason (error frame, then close 4401).
//!
//! Layout, top down: `connection.rs` runs an upgraded socket (writer task, `hello`, handshake)
//! and hands it to the end user's session (`conversation/`) or the agent's (`agent/`); both
//! build on `session.rs` (how a session ends, socket reads, shared answers), `outbound.rs` (the
//! bounded queue), `writer.rs` and `rate.rs`.

pub(crate) mod agent;
mod connection;
mod conversation;
mod handshake;
pub(crate) mod outbound;
mod rate;
mod session;
mod writer;

use std::collections::HashMap;

use axum::extract::ws::{WebSocketUpgrade, rejection::WebSocketUpgradeRejection};
use axum::extract::{Extension, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use converger_protocol::SUBPROTOCOL;

use crate::error::ApiError;
use crate::listener::SessionSlot;
use crate::state::AppState;

/// Initial read buffer of a socket.
const READ_BUFFER_BYTES: usize = 1024;

/// Bytes the writer encodes before they go to the kernel: the frames of one wake-up leave in
/// one write. The buffer is allocated on first use and stays, so it is kept small.
const WRITE_BUFFER_BYTES: usize = 8 * 1024;

/// What the upgrade request carried besides the socket.
#[derive(Debug, Clone, Default)]
pub(crate) struct UpgradeRequest {
    /// `?token=`.
    pub query_token: Option<String>,
    /// `Authorization: Bearer`.
    pub header_token: Option<String>,
    /// `?conversationId=`.
    pub conversation_id: Option<String>,
    /// `?userId=`.
    pub user_id: Option<String>,
    /// `?watermark=`.
    pub watermark: Option<u64>,
}

/// `GET /socket/converger/v1`.
pub(crate) async fn upgrade(
    State(state): State<AppState>,
    slot: Option<Extension<SessionSlot>>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    if state.is_draining() {
        return ApiError::draining(state.config.drain.retry_after_ms).into_response();
    }
    let upgrade = match upgrade {
        Ok(upgrade) => upgrade,
        Err(rejection) => return refuse_upgrade(rejection),
    };
    let offered: Vec<String> = upgrade
        .requested_protocols()
        .filter_map(|value| value.to_str().ok())
        .map(str::to_owned)
        .collect();
    let upgrade = if offered.is_empty() {
        upgrade
    } else if offered.iter().any(|protocol| protocol == SUBPROTOCOL) {
        upgrade.protocols([SUBPROTOCOL])
    } else {
        return ApiError::bad_request(format!(
            "unsupported subprotocol; offer {SUBPROTOCOL} or none"
        ))
        .into_response();
    };
    let request = UpgradeRequest {
        query_token: query
            .get("token")
            .filter(|token| !token.is_empty())
            .cloned(),
        header_token: crate::auth::bearer(&headers).map(str::to_owned),
        conversation_id: query.get("conversationId").cloned(),
        user_id: query.get("userId").cloned(),
        watermark: query.get("watermark").and_then(|raw| raw.parse().ok()),
    };
    let limits = &state.config.limits;
    // Small buffers: an idle session should cost kilobytes, not the 128 KiB defaults. Reads
    // grow the buffer as needed; the writer flushes once per wake-up (`writer.rs`).
    upgrade
        .read_buffer_size(READ_BUFFER_BYTES)
        .write_buffer_size(WRITE_BUFFER_BYTES)
        .max_message_size(limits.hard_frame_bytes)
        .max_frame_size(limits.hard_frame_bytes)
        .on_upgrade(move |socket| async move {
            // The socket keeps its place under the connection caps until the session ends.
            let _slot = slot;
            connection::serve(socket, state, request).await;
        })
}

fn refuse_upgrade(rejection: WebSocketUpgradeRejection) -> Response {
    match rejection {
        WebSocketUpgradeRejection::InvalidConnectionHeader(_)
        | WebSocketUpgradeRejection::InvalidUpgradeHeader(_)
        | WebSocketUpgradeRejection::ConnectionNotUpgradable(_) => {
            let mut response = ApiError::with_code(
                StatusCode::UPGRADE_REQUIRED,
                "upgrade_required",
                "this endpoint speaks WebSocket only",
            )
            .into_response();
            response
                .headers_mut()
                .insert(header::UPGRADE, HeaderValue::from_static("websocket"));
            response
        }
        other => ApiError::bad_request(other.body_text()).into_response(),
    }
}
