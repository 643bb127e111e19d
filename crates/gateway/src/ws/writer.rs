//! The writer task: the only owner of the socket's sending half.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, WebSocket};
use futures_util::SinkExt;
use futures_util::stream::SplitSink;

use super::outbound::{Outbound, Outgoing};

/// Frames taken from the queue per wake-up. They are encoded into the socket's write buffer and
/// reach the kernel in one write (or a few, past the buffer's size): a turn fans out as several
/// frames to the same connection, and each write is a system call and a TCP segment.
const FRAMES_PER_WRITE: usize = 32;

/// Writes queued frames until a close frame is written or the socket fails. A write that does
/// not finish within `write_timeout` ends the connection (the peer stopped reading).
pub(crate) async fn run(
    mut sink: SplitSink<WebSocket, Message>,
    outbound: Arc<Outbound>,
    write_timeout: Duration,
) {
    let mut items = Vec::with_capacity(FRAMES_PER_WRITE);
    'socket: loop {
        outbound.next_batch(&mut items, FRAMES_PER_WRITE).await;
        let mut last = false;
        for item in items.drain(..) {
            let message = match item {
                Outgoing::Text { text, .. } => Message::Text(text),
                Outgoing::Ping => Message::Ping(Default::default()),
                Outgoing::Close { code, reason } => {
                    last = true;
                    Message::Close(Some(CloseFrame {
                        code,
                        reason: reason.into(),
                    }))
                }
            };
            if !within(write_timeout, sink.feed(message), &outbound).await {
                break 'socket;
            }
            if last {
                break;
            }
        }
        if !within(write_timeout, sink.flush(), &outbound).await || last {
            break;
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), sink.close()).await;
}

/// Runs one socket operation under the write deadline; false when the socket is done for.
async fn within(
    write_timeout: Duration,
    operation: impl Future<Output = Result<(), axum::Error>>,
    outbound: &Outbound,
) -> bool {
    match tokio::time::timeout(write_timeout, operation).await {
        Ok(Ok(())) => true,
        Ok(Err(_)) | Err(_) => {
            // Nothing more can be written; make sure producers stop queueing.
            outbound.close_now(1006, String::new());
            false
        }
    }
}
