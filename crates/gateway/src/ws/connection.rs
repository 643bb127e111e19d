//! One upgraded connection, whichever its scope: the writer task, the wait for `hello`, the
//! handshake, then the end user's or the agent's session, and the closing handshake.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{Message, WebSocket};
use converger_protocol::{ClientFrame, CloseCode, ErrorCode, ErrorFrame, Hello, parse_client_text};
use futures_util::StreamExt;
use futures_util::stream::SplitStream;

use super::UpgradeRequest;
use super::handshake::{Setup, establish};
use super::outbound::Outbound;
use super::session::{Ending, binary_refusal, push_error, read_failure, refusal_frame, too_large};
use crate::state::AppState;

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
                let close = refused.close.unwrap_or(CloseCode::Protocol);
                let reason = match (refused.reason, refused.close) {
                    (Some(reason), _) => reason,
                    (None, Some(_)) => refused.error.code.as_str().to_owned(),
                    (None, None) => String::new(),
                };
                Ending::Close {
                    code: close.number(),
                    reason,
                }
            }
            Ok(Setup::Conversation(established)) => {
                Box::pin(super::conversation::run(
                    &state,
                    established,
                    &mut stream,
                    &outbound,
                ))
                .await
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

/// Reads frames until `hello`; anything else before it is answered with `no_session`. The
/// `hello` must arrive within `limits.hello_timeout_ms` of the upgrade, whatever comes before it
/// (pings included): an unauthenticated connection never lives longer.
async fn await_hello(
    state: &AppState,
    stream: &mut SplitStream<WebSocket>,
    outbound: &Outbound,
) -> Result<Box<Hello>, Ending> {
    let limits = &state.config.limits;
    let deadline = tokio::time::Instant::now() + Duration::from_millis(limits.hello_timeout_ms);
    loop {
        let message = match tokio::time::timeout_at(deadline, stream.next()).await {
            Err(_) => {
                metrics::counter!("converger_ws_hello_timeouts_total").increment(1);
                push_error(
                    outbound,
                    &ErrorFrame::new(ErrorCode::NoSession, "no hello in time"),
                );
                return Err(Ending::idle());
            }
            Ok(None) => return Err(Ending::Gone),
            Ok(Some(Err(error))) => return Err(read_failure(&error)),
            Ok(Some(Ok(message))) => message,
        };
        let text = match message {
            Message::Text(text) => text,
            Message::Binary(_) => {
                push_error(outbound, &binary_refusal());
                continue;
            }
            Message::Close(_) => return Err(Ending::Gone),
            Message::Ping(_) | Message::Pong(_) => continue,
        };
        if text.len() > limits.max_frame_bytes {
            push_error(outbound, &too_large());
            continue;
        }
        match parse_client_text(text.as_str(), limits) {
            Ok(ClientFrame::Hello(hello)) => return Ok(hello),
            Ok(_) => push_error(
                outbound,
                &ErrorFrame::new(ErrorCode::NoSession, "send hello first"),
            ),
            // A hello refused as such (say, with a NUL character) ends the handshake.
            Err(refusal) if refusal.frame_type.as_deref() == Some("hello") => {
                push_error(outbound, &refusal_frame(&refusal));
                return Err(Ending::Close {
                    code: CloseCode::Protocol.number(),
                    reason: refusal.error.code.as_str().to_owned(),
                });
            }
            Err(refusal) => push_error(outbound, &refusal_frame(&refusal)),
        }
    }
}
