//! Keyed sends waiting for their ack, resent with the same clientId until one arrives.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// In-flight limit before the server announces its own (`limits.maxInFlight`).
const DEFAULT_MAX_IN_FLIGHT: usize = 32;

#[derive(Debug, Clone)]
struct PendingSend {
    client_id: String,
    text: String,
    /// Written on the current connection and not answered yet.
    in_flight: bool,
    /// In flight: when to resend on the same connection; otherwise: when it may be sent.
    due: Instant,
    sends: u32,
}

/// Unacknowledged sends in send order.
///
/// At most `max_in_flight` are written on a connection at a time (the server refuses more
/// with `too_many_in_flight`); an in-flight send without an answer after `resend_after` is
/// written again, and after a reconnect every send is written again in order. The server keys
/// idempotency on the clientId, so a resend is answered with the first ack plus
/// `duplicate: true` and never stored twice.
#[derive(Debug, Clone)]
pub(crate) struct Outbox {
    entries: VecDeque<PendingSend>,
    resend_after: Duration,
    max_in_flight: usize,
}

impl Outbox {
    /// An empty outbox resending unanswered sends after `resend_after`.
    pub(crate) fn new(resend_after: Duration) -> Outbox {
        Outbox {
            entries: VecDeque::new(),
            resend_after,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
        }
    }

    /// Applies the server's `maxInFlight`.
    pub(crate) fn set_max_in_flight(&mut self, limit: usize) {
        self.max_in_flight = limit.max(1);
    }

    /// Queues a send, due at once. An existing send with the same clientId keeps its place and
    /// takes the new text (the server answers by clientId, so this is still the same send).
    pub(crate) fn push(&mut self, client_id: &str, text: String, now: Instant) {
        if let Some(entry) = self.find_mut(client_id) {
            entry.text = text;
            return;
        }
        self.entries.push_back(PendingSend {
            client_id: client_id.to_owned(),
            text,
            in_flight: false,
            due: now,
            sends: 0,
        });
    }

    /// The clientIds waiting for an ack, in send order.
    pub(crate) fn client_ids(&self) -> Vec<String> {
        self.entries
            .iter()
            .map(|entry| entry.client_id.clone())
            .collect()
    }

    /// Removes a send that was answered (ack or final refusal); false when it was not waiting.
    pub(crate) fn settle(&mut self, client_id: &str) -> bool {
        let before = self.entries.len();
        self.entries.retain(|entry| entry.client_id != client_id);
        self.entries.len() != before
    }

    /// True once a send was written `attempts` times and its last wait ran out.
    pub(crate) fn exhausted(&self, client_id: &str, attempts: u32, now: Instant) -> bool {
        self.entries.iter().any(|entry| {
            entry.client_id == client_id
                && entry.in_flight
                && entry.sends >= attempts
                && entry.due <= now
        })
    }

    /// The texts to write now, in order; marks them written.
    pub(crate) fn take_due(&mut self, now: Instant) -> Vec<String> {
        let mut in_flight = self.entries.iter().filter(|entry| entry.in_flight).count();
        let mut texts = Vec::new();
        for entry in self.entries.iter_mut() {
            if entry.due > now {
                continue;
            }
            if !entry.in_flight {
                if in_flight >= self.max_in_flight {
                    continue;
                }
                entry.in_flight = true;
                in_flight += 1;
            }
            entry.due = now + self.resend_after;
            entry.sends = entry.sends.saturating_add(1);
            texts.push(entry.text.clone());
        }
        texts
    }

    /// When `take_due` will next have something to write (sends held back by the in-flight
    /// limit wait for an ack, which wakes the reader anyway).
    pub(crate) fn next_due(&self) -> Option<Instant> {
        let in_flight = self.entries.iter().filter(|entry| entry.in_flight).count();
        let free_slots = self.max_in_flight.saturating_sub(in_flight);
        let resends = self
            .entries
            .iter()
            .filter(|entry| entry.in_flight)
            .map(|entry| entry.due);
        let first_sends = self
            .entries
            .iter()
            .filter(|entry| !entry.in_flight)
            .take(free_slots)
            .map(|entry| entry.due);
        resends.chain(first_sends).min()
    }

    /// The server dropped this send (a retryable refusal): write it again at `at`.
    pub(crate) fn retry_at(&mut self, client_id: &str, at: Instant) {
        if let Some(entry) = self.find_mut(client_id) {
            entry.in_flight = false;
            entry.due = at;
        }
    }

    /// A new connection: nothing is in flight on it, every send is due in order.
    pub(crate) fn requeue_all(&mut self, now: Instant) {
        for entry in self.entries.iter_mut() {
            entry.in_flight = false;
            entry.due = now;
        }
    }

    fn find_mut(&mut self, client_id: &str) -> Option<&mut PendingSend> {
        self.entries
            .iter_mut()
            .find(|entry| entry.client_id == client_id)
    }
}

/// Whether `client_id` has the contract's clientId shape: 1–128 characters of
/// `A-Za-z0-9._:~-`.
pub(crate) fn is_valid_client_id(client_id: &str) -> bool {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '~' | '-');
    (1..=128).contains(&client_id.len()) && client_id.chars().all(allowed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RESEND: Duration = Duration::from_secs(5);

    fn outbox_with(client_ids: &[&str], now: Instant) -> Outbox {
        let mut outbox = Outbox::new(RESEND);
        for client_id in client_ids {
            outbox.push(client_id, format!("frame {client_id}"), now);
        }
        outbox
    }

    #[test]
    fn sends_go_out_once_in_order_until_the_resend_time() {
        let now = Instant::now();
        let mut outbox = outbox_with(&["c-1", "c-2"], now);
        assert_eq!(outbox.take_due(now), ["frame c-1", "frame c-2"]);
        assert!(outbox.take_due(now).is_empty());
        assert_eq!(outbox.next_due(), Some(now + RESEND));
        assert!(outbox.take_due(now + RESEND / 2).is_empty());
        assert_eq!(outbox.take_due(now + RESEND), ["frame c-1", "frame c-2"]);
    }

    #[test]
    fn an_ack_removes_the_send_and_a_second_ack_finds_nothing() {
        let now = Instant::now();
        let mut outbox = outbox_with(&["c-1", "c-2"], now);
        outbox.take_due(now);
        assert!(outbox.settle("c-1"));
        assert!(!outbox.settle("c-1"));
        assert_eq!(outbox.client_ids(), ["c-2"]);
        assert_eq!(outbox.take_due(now + RESEND), ["frame c-2"]);
    }

    #[test]
    fn a_reconnect_resends_everything_unanswered_in_order() {
        let now = Instant::now();
        let mut outbox = outbox_with(&["c-1", "c-2", "c-3"], now);
        outbox.take_due(now);
        outbox.settle("c-2");
        let later = now + Duration::from_millis(300);
        outbox.requeue_all(later);
        assert_eq!(outbox.next_due(), Some(later));
        assert_eq!(outbox.take_due(later), ["frame c-1", "frame c-3"]);
    }

    #[test]
    fn the_in_flight_limit_holds_back_later_sends_until_an_ack() {
        let now = Instant::now();
        let mut outbox = outbox_with(&["c-1", "c-2", "c-3"], now);
        outbox.set_max_in_flight(2);
        assert_eq!(outbox.take_due(now), ["frame c-1", "frame c-2"]);
        // Held back sends are not a reason to wake up: only the resend time is.
        assert_eq!(outbox.next_due(), Some(now + RESEND));
        outbox.settle("c-1");
        assert_eq!(outbox.next_due(), Some(now));
        assert_eq!(outbox.take_due(now), ["frame c-3"]);
    }

    #[test]
    fn a_retryable_refusal_resends_at_the_given_time() {
        let now = Instant::now();
        let mut outbox = outbox_with(&["c-1"], now);
        outbox.take_due(now);
        let at = now + Duration::from_millis(100);
        outbox.retry_at("c-1", at);
        assert!(outbox.take_due(now).is_empty());
        assert_eq!(outbox.next_due(), Some(at));
        assert_eq!(outbox.take_due(at), ["frame c-1"]);
    }

    #[test]
    fn pushing_a_known_client_id_keeps_its_place_and_takes_the_new_text() {
        let now = Instant::now();
        let mut outbox = outbox_with(&["c-1", "c-2"], now);
        outbox.push("c-1", "new body".into(), now);
        assert_eq!(outbox.client_ids(), ["c-1", "c-2"]);
        assert_eq!(outbox.take_due(now), ["new body", "frame c-2"]);
    }

    #[test]
    fn a_send_is_exhausted_after_its_attempts_and_last_wait() {
        let now = Instant::now();
        let mut outbox = outbox_with(&["r-1"], now);
        let mut at = now;
        for _ in 0..3 {
            assert!(!outbox.exhausted("r-1", 3, at));
            assert_eq!(outbox.take_due(at).len(), 1);
            at += RESEND;
        }
        assert!(!outbox.exhausted("r-1", 3, at - Duration::from_millis(1)));
        assert!(outbox.exhausted("r-1", 3, at));
        assert!(!outbox.exhausted("unknown", 3, at));
    }

    #[test]
    fn client_ids_follow_the_contract_shape() {
        for valid in ["c-1", "a", "A.b_c:d~e-f", &"x".repeat(128)] {
            assert!(is_valid_client_id(valid), "{valid}");
        }
        for invalid in ["", "has space", "ümlaut", "a/b", &"x".repeat(129)] {
            assert!(!is_valid_client_id(invalid), "{invalid}");
        }
    }
}
