//! A per-connection token bucket for inbound frames.

use std::time::{Duration, Instant};

/// Allows `rate` frames per second with bursts of the same size.
#[derive(Debug, Clone)]
pub(crate) struct TokenBucket {
    rate: f64,
    tokens: f64,
    refilled: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub(crate) fn new(rate_per_sec: u32, now: Instant) -> TokenBucket {
        let rate = f64::from(rate_per_sec.max(1));
        TokenBucket {
            rate,
            tokens: rate,
            refilled: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.rate);
        self.refilled = now;
    }

    /// Takes a token, or says how long until one is available.
    pub(crate) fn take(&mut self, now: Instant) -> Result<(), Duration> {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            return Ok(());
        }
        Err(Duration::from_secs_f64((1.0 - self.tokens) / self.rate))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_then_refills() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(5, start);
        for _ in 0..5 {
            assert!(bucket.take(start).is_ok());
        }
        let wait = bucket.take(start).unwrap_err();
        assert!(wait <= Duration::from_millis(200) && wait > Duration::ZERO);
        assert!(bucket.take(start + Duration::from_millis(200)).is_ok());
    }
}
