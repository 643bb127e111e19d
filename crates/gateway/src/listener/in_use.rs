//! Whether a connection has a request in progress, and what a request holds while it runs.
//!
//! A connection with no request in progress is closed after `http.header_read_timeout_ms`:
//! one that never sends a byte, one that sent only an HTTP/2 preface and settings, one whose
//! headers never end (HTTP/1 or an HTTP/2 HEADERS frame without END_HEADERS), and one idle
//! between requests. A request is in progress from its complete headers until its response
//! body is done, or, for a WebSocket, until the session ends.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use http_body::{Frame, SizeHint};
use tokio::sync::watch;

use super::admission::ConnectionSlot;

/// The number of requests in progress on one connection.
#[derive(Debug)]
pub(crate) struct InUse {
    requests: watch::Sender<usize>,
}

impl InUse {
    pub(crate) fn new() -> Arc<InUse> {
        Arc::new(InUse {
            requests: watch::Sender::new(0),
        })
    }

    /// Marks a request in progress until the hold drops; returns how many were in progress
    /// before it.
    pub(crate) fn begin(self: &Arc<Self>) -> (usize, RequestHold) {
        let mut before = 0;
        self.requests.send_modify(|requests| {
            before = *requests;
            *requests += 1;
        });
        let hold = RequestHold {
            in_use: Arc::clone(self),
        };
        (before, hold)
    }

    /// Completes once no request has been in progress for `idle`.
    pub(crate) async fn idle_for(&self, idle: Duration) {
        let mut requests = self.requests.subscribe();
        loop {
            // The sender lives in `self`: these waits end only by a change.
            if requests
                .wait_for(|in_progress| *in_progress == 0)
                .await
                .is_err()
            {
                return;
            }
            let busy_again = requests.wait_for(|in_progress| *in_progress > 0);
            if tokio::time::timeout(idle, busy_again).await.is_err() {
                return;
            }
        }
    }
}

/// One request in progress; dropping it ends that.
#[derive(Debug)]
pub(crate) struct RequestHold {
    in_use: Arc<InUse>,
}

impl Drop for RequestHold {
    fn drop(&mut self) {
        self.in_use
            .requests
            .send_modify(|requests| *requests = requests.saturating_sub(1));
    }
}

/// What a request holds for as long as it lives: its place under the connection caps and its
/// mark on the connection. Its response body holds it, and a WebSocket session takes it along,
/// so a socket counts, and keeps its connection in use, for as long as it is open.
#[derive(Debug, Clone)]
pub(crate) struct SessionSlot {
    _place: ConnectionSlot,
    _hold: Arc<RequestHold>,
}

impl SessionSlot {
    pub(crate) fn new(place: ConnectionSlot, hold: RequestHold) -> SessionSlot {
        SessionSlot {
            _place: place,
            _hold: Arc::new(hold),
        }
    }
}

/// A response body that holds its request's [`SessionSlot`] until it is done or dropped.
pub(crate) struct HeldBody {
    inner: Body,
    _slot: SessionSlot,
}

impl HeldBody {
    pub(crate) fn new(inner: Body, slot: SessionSlot) -> HeldBody {
        HeldBody { inner, _slot: slot }
    }
}

impl http_body::Body for HeldBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(context)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_idle_only_while_no_request_is_in_progress() {
        let in_use = InUse::new();
        let (before, hold) = in_use.begin();
        assert_eq!(before, 0);
        let (before, second) = in_use.begin();
        assert_eq!(before, 1);
        let idle = tokio::spawn({
            let in_use = Arc::clone(&in_use);
            async move { in_use.idle_for(Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!idle.is_finished(), "requests in progress: not idle");
        drop(hold);
        drop(second);
        tokio::time::sleep(Duration::from_secs(5)).await;
        let (_, again) = in_use.begin();
        tokio::time::sleep(Duration::from_secs(8)).await;
        drop(again);
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(
            !idle.is_finished(),
            "the idle clock restarts after each request"
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        idle.await.unwrap();
    }
}
