//! Jittered exponential backoff between reconnect attempts.

use std::time::Duration;

/// Server hints above this are treated as this, so a bad `retryAfterMs` cannot park a client.
const LONGEST_SERVER_HINT: Duration = Duration::from_secs(300);

/// How long to wait before each reconnect attempt.
///
/// Attempt `n` (0-based, counting consecutive failures) waits a random delay in
/// `[ceiling / 2, ceiling]` with `ceiling = min(initial × 2ⁿ, max)` ("equal jitter"): the half
/// that is fixed keeps a client from hammering a node, the random half spreads the clients of a
/// drained node over time. A `retryAfterMs` from the server is a floor for the delay.
///
/// ```
/// use std::time::Duration;
/// use converger_client::Backoff;
///
/// let backoff = Backoff::default();
/// assert_eq!(backoff.ceiling(0), Duration::from_millis(250));
/// assert_eq!(backoff.ceiling(30), Duration::from_secs(30));
/// let delay = backoff.delay(2, 0.5);
/// assert!(delay >= Duration::from_millis(500) && delay <= Duration::from_secs(1));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backoff {
    /// Ceiling of the first attempt's delay.
    pub initial: Duration,
    /// Largest ceiling any attempt reaches.
    pub max: Duration,
    /// Consecutive failed attempts after which reconnecting stops (`None`: never stops).
    pub max_attempts: Option<u32>,
}

impl Default for Backoff {
    /// 250 ms doubling up to 30 s; gives up after 12 failures in a row (about 1.5–3 minutes).
    fn default() -> Backoff {
        Backoff {
            initial: Duration::from_millis(250),
            max: Duration::from_secs(30),
            max_attempts: Some(12),
        }
    }
}

impl Backoff {
    /// The ceiling of attempt `attempt`: `initial × 2^attempt`, capped at `max`.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt).unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.max)
    }

    /// The delay of attempt `attempt` for `unit`, a random number in `[0, 1]` (clamped).
    pub fn delay(&self, attempt: u32, unit: f64) -> Duration {
        let ceiling = self.ceiling(attempt);
        let fixed = ceiling / 2;
        let unit = if unit.is_finite() {
            unit.clamp(0.0, 1.0)
        } else {
            0.0
        };
        fixed + (ceiling - fixed).mul_f64(unit)
    }

    /// The delay of attempt `attempt`, never shorter than the server's `retry_after` hint.
    pub fn delay_with_hint(
        &self,
        attempt: u32,
        unit: f64,
        retry_after: Option<Duration>,
    ) -> Duration {
        let delay = self.delay(attempt, unit);
        match retry_after {
            Some(hint) => delay.max(hint.min(LONGEST_SERVER_HINT)),
            None => delay,
        }
    }

    /// Whether `failures` consecutive failures exhaust the attempts.
    pub fn exhausted(&self, failures: u32) -> bool {
        self.max_attempts.is_some_and(|max| failures >= max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoff() -> Backoff {
        Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(10),
            max_attempts: Some(5),
        }
    }

    #[test]
    fn the_ceiling_doubles_until_the_cap() {
        let backoff = backoff();
        let ceilings: Vec<u128> = (0..10).map(|n| backoff.ceiling(n).as_millis()).collect();
        assert_eq!(
            ceilings,
            [100, 200, 400, 800, 1600, 3200, 6400, 10_000, 10_000, 10_000]
        );
    }

    #[test]
    fn huge_attempt_numbers_stay_at_the_cap() {
        let backoff = backoff();
        for attempt in [31, 32, 33, 64, u32::MAX] {
            assert_eq!(backoff.ceiling(attempt), Duration::from_secs(10));
            assert!(backoff.delay(attempt, 1.0) <= Duration::from_secs(10));
        }
    }

    #[test]
    fn the_delay_lies_between_half_the_ceiling_and_the_ceiling() {
        let backoff = backoff();
        for attempt in 0..40 {
            let ceiling = backoff.ceiling(attempt);
            for step in 0..=100 {
                let unit = f64::from(step) / 100.0;
                let delay = backoff.delay(attempt, unit);
                assert!(
                    delay >= ceiling / 2,
                    "attempt {attempt} unit {unit}: {delay:?}"
                );
                assert!(delay <= ceiling, "attempt {attempt} unit {unit}: {delay:?}");
            }
            assert_eq!(backoff.delay(attempt, 0.0), ceiling / 2);
            assert_eq!(backoff.delay(attempt, 1.0), ceiling);
        }
    }

    #[test]
    fn the_jitter_is_spread_over_the_whole_upper_half() {
        let backoff = backoff();
        let low = backoff.delay(3, 0.1);
        let high = backoff.delay(3, 0.9);
        assert!(high - low >= Duration::from_millis(300));
    }

    #[test]
    fn out_of_range_random_numbers_are_clamped() {
        let backoff = backoff();
        let ceiling = backoff.ceiling(2);
        assert_eq!(backoff.delay(2, -3.0), ceiling / 2);
        assert_eq!(backoff.delay(2, 7.0), ceiling);
        assert_eq!(backoff.delay(2, f64::NAN), ceiling / 2);
        assert_eq!(backoff.delay(2, f64::INFINITY), ceiling / 2);
    }

    #[test]
    fn a_server_hint_is_a_floor_but_bounded() {
        let backoff = backoff();
        let hinted = backoff.delay_with_hint(0, 0.0, Some(Duration::from_millis(1500)));
        assert_eq!(hinted, Duration::from_millis(1500));
        let small_hint = backoff.delay_with_hint(6, 1.0, Some(Duration::from_millis(10)));
        assert_eq!(small_hint, backoff.ceiling(6));
        let absurd = backoff.delay_with_hint(0, 0.0, Some(Duration::from_secs(86_400)));
        assert_eq!(absurd, Duration::from_secs(300));
        assert_eq!(backoff.delay_with_hint(1, 0.5, None), backoff.delay(1, 0.5));
    }

    #[test]
    fn attempts_run_out_only_when_bounded() {
        let backoff = backoff();
        assert!(!backoff.exhausted(4));
        assert!(backoff.exhausted(5));
        let endless = Backoff {
            max_attempts: None,
            ..backoff
        };
        assert!(!endless.exhausted(u32::MAX));
    }
}
