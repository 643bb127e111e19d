//! The writer task: the only owner of the socket's sending half.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures_util::SinkExt;
use futures_util::stream::SplitSink;

use super::outbound::{Outbound, Outgoing};

/// Writes queued frames until a close frame is written or the socket fails. A write that does
/// not finish within `write_timeout` ends the connection (the peer stopped reading).
pub(crate) async fn run(
    mut sink: SplitSink<WebSocket, Message>,
    outbound: Arc<Outbound>,
    write_timeout: Duration,
) {
    loop {
        let item = outbound.next().await;
        let (message, last) = match item {
            Outgoing::Text { text, .. } => (Message::Text(text), false),
            Outgoing::Ping => (Message::Ping(Default::default()), false),
            Outgoing::Close { code, reason } => (
                Message::Close(Some(CloseFrame {
                    code,
                    reason: reason.into(),
                })),
                true,
            ),
        };
        match tokio::time::timeout(write_timeout, sink.send(message)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => {
                // Nothing more can be written; make sure producers stop queueing.
                outbound.close_now(1006, String::new());
                break;
            }
        }
        if last {
            break;
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), sink.close()).await;
}
