//! The bounded outbound queue of one connection.
//!
//! Persistent frames must never be lost silently, transient ones may be: when the queue is full
//! a transient frame is dropped (the newest, or an older one to make room for a persistent
//! frame); when it is full of persistent frames the client is too slow and the connection is
//! closed with 4503 by the caller.

use std::collections::VecDeque;
use std::sync::Mutex;

use axum::extract::ws::Utf8Bytes;
use tokio::sync::Notify;

/// One item for the writer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outgoing {
    /// A JSON text frame.
    Text {
        /// The serialized frame (shared, not copied, when it goes to several connections).
        text: Utf8Bytes,
        /// True for frames that may be dropped under pressure.
        transient: bool,
    },
    /// A WebSocket ping control frame.
    Ping,
    /// A close frame; the writer stops after it.
    Close {
        /// Close code.
        code: u16,
        /// Close reason (≤ 123 bytes).
        reason: String,
    },
}

/// Why a frame was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushError {
    /// Full of persistent frames: the client does not keep up.
    Full,
    /// The connection is closing; nothing more is sent.
    Closed,
}

struct State {
    queue: VecDeque<Outgoing>,
    closing: bool,
}

/// A queue shared by the session (producer) and the writer task (consumer).
pub struct Outbound {
    capacity: usize,
    state: Mutex<State>,
    ready: Notify,
    space: Notify,
}

impl Outbound {
    /// A queue of at most `capacity` frames (control frames excepted).
    pub fn new(capacity: usize) -> Outbound {
        Outbound {
            capacity: capacity.max(1),
            state: Mutex::new(State {
                queue: VecDeque::new(),
                closing: false,
            }),
            ready: Notify::new(),
            space: Notify::new(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues a text frame under the drop policy described above.
    pub fn push_text(&self, text: impl Into<Utf8Bytes>, transient: bool) -> Result<(), PushError> {
        let mut state = self.state();
        if state.closing {
            return Err(PushError::Closed);
        }
        if state.queue.len() >= self.capacity {
            if transient {
                metrics::counter!("converger_ws_transient_dropped_total").increment(1);
                return Ok(());
            }
            let victim = state.queue.iter().position(|item| {
                matches!(
                    item,
                    Outgoing::Text {
                        transient: true,
                        ..
                    }
                )
            });
            match victim {
                Some(index) => {
                    state.queue.remove(index);
                    metrics::counter!("converger_ws_transient_dropped_total").increment(1);
                }
                None => return Err(PushError::Full),
            }
        }
        state.queue.push_back(Outgoing::Text {
            text: text.into(),
            transient,
        });
        drop(state);
        self.ready.notify_one();
        Ok(())
    }

    /// Queues a persistent frame, waiting up to `timeout` for room (replays: a finite backlog
    /// the client is expected to drain); `Full` when the client did not make room in time.
    pub async fn push_text_waiting(
        &self,
        text: impl Into<Utf8Bytes>,
        timeout: std::time::Duration,
    ) -> Result<(), PushError> {
        let text = text.into();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let space = self.space.notified();
            {
                let mut state = self.state();
                if state.closing {
                    return Err(PushError::Closed);
                }
                if state.queue.len() < self.capacity {
                    state.queue.push_back(Outgoing::Text {
                        text: text.clone(),
                        transient: false,
                    });
                    drop(state);
                    self.ready.notify_one();
                    return Ok(());
                }
            }
            if tokio::time::timeout_at(deadline, space).await.is_err() {
                return Err(PushError::Full);
            }
        }
    }

    /// Queues a ping unless the connection is closing.
    pub fn push_ping(&self) {
        let mut state = self.state();
        if !state.closing {
            state.queue.push_back(Outgoing::Ping);
            drop(state);
            self.ready.notify_one();
        }
    }

    /// Queues the close frame after what is queued; nothing can be queued after it.
    pub fn close(&self, code: u16, reason: String) {
        let mut state = self.state();
        if state.closing {
            return;
        }
        state.closing = true;
        state.queue.push_back(Outgoing::Close { code, reason });
        drop(state);
        self.ready.notify_one();
    }

    /// Drops whatever is queued and queues the close frame alone (slow consumer, hard errors).
    pub fn close_now(&self, code: u16, reason: String) {
        let mut state = self.state();
        state.queue.clear();
        state.closing = true;
        state.queue.push_back(Outgoing::Close { code, reason });
        drop(state);
        self.ready.notify_one();
    }

    /// Waits for the next item.
    #[cfg(test)]
    pub async fn next(&self) -> Outgoing {
        let mut items = Vec::with_capacity(1);
        self.next_batch(&mut items, 1).await;
        items.pop().expect("next_batch takes at least one item")
    }

    /// Waits until something is queued, then moves up to `max` items, oldest first, into
    /// `items`: the writer sends them with one socket write.
    pub async fn next_batch(&self, items: &mut Vec<Outgoing>, max: usize) {
        loop {
            // Register interest before looking, so a push between the look and the wait is seen.
            let notified = self.ready.notified();
            {
                let mut state = self.state();
                let take = state.queue.len().min(max.max(1));
                items.extend(state.queue.drain(..take));
            }
            if !items.is_empty() {
                // Every waiting replay may find room now.
                self.space.notify_waiters();
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(value: &'static str, transient: bool) -> Outgoing {
        Outgoing::Text {
            text: Utf8Bytes::from_static(value),
            transient,
        }
    }

    #[tokio::test]
    async fn transient_frames_give_way_to_persistent_ones() {
        let queue = Outbound::new(2);
        queue.push_text("t1", true).unwrap();
        queue.push_text("p1", false).unwrap();
        // Full: a new transient frame is dropped, a persistent one evicts the transient.
        queue.push_text("t2", true).unwrap();
        queue.push_text("p2", false).unwrap();
        assert_eq!(queue.push_text("p3", false), Err(PushError::Full));
        assert_eq!(queue.next().await, text("p1", false));
        assert_eq!(queue.next().await, text("p2", false));
    }

    #[tokio::test]
    async fn close_now_discards_the_backlog() {
        let queue = Outbound::new(4);
        queue.push_text("p1", false).unwrap();
        queue.close_now(4503, "slow".into());
        assert_eq!(queue.push_text("p2", false), Err(PushError::Closed));
        assert_eq!(
            queue.next().await,
            Outgoing::Close {
                code: 4503,
                reason: "slow".into()
            }
        );
    }

    #[tokio::test]
    async fn close_keeps_what_was_queued() {
        let queue = Outbound::new(4);
        queue.push_text("p1", false).unwrap();
        queue.close(1000, String::new());
        assert_eq!(queue.next().await, text("p1", false));
        assert!(matches!(
            queue.next().await,
            Outgoing::Close { code: 1000, .. }
        ));
    }
}
