//! HTTP agents' decisions (ADR 0031), with time passed in as milliseconds: which URLs the
//! operator allows, how long a turn waits before its next call, and the circuit breaker that
//! stops calling a URL that keeps failing.

/// A URL as its parts, lowercased where case does not matter (the shell parses it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UrlParts {
    /// `http` or `https`.
    pub scheme: String,
    /// The host name or address.
    pub host: String,
    /// The port (the scheme's default when the URL names none).
    pub port: u16,
    /// The path, from its leading `/`.
    pub path: String,
}

/// True when `url` is under one of the `allowed` entries: the same scheme, host and port, and
/// a path equal to the entry's or below it (an entry `/agents` allows `/agents` and
/// `/agents/x`, never `/agentsx`).
pub fn is_allowed(allowed: &[UrlParts], url: &UrlParts) -> bool {
    allowed.iter().any(|entry| {
        entry.scheme == url.scheme
            && entry.host == url.host
            && entry.port == url.port
            && path_is_under(&entry.path, &url.path)
    })
}

fn path_is_under(prefix: &str, path: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    if prefix.is_empty() {
        return true;
    }
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

/// The longest wait between two calls of one turn.
pub const MAX_BACKOFF_MS: u64 = 30_000;

/// The wait before call `attempt` (from 2) of a turn: `first_ms` doubled for each call made
/// after the first, at most [`MAX_BACKOFF_MS`]; the shell spreads it with jitter.
pub fn backoff_ms(first_ms: u64, attempt: u32) -> u64 {
    let doublings = attempt.saturating_sub(2).min(20);
    first_ms.saturating_mul(1 << doublings).min(MAX_BACKOFF_MS)
}

/// What a breaker says about a call about to be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Call.
    Call,
    /// Call: this is the probe of a half-open breaker; its outcome closes or reopens it.
    Probe,
    /// Do not call: the URL failed `threshold` times in a row and the breaker is open (or its
    /// probe is still running).
    Refused,
}

/// A breaker's state, as metrics and the status page show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls are refused until `until_ms`.
    Open {
        /// When one probe may go.
        until_ms: u64,
    },
    /// One probe is running; other calls are refused until it ends.
    HalfOpen,
}

impl BreakerState {
    /// The metric and status form.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open { .. } => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

/// One URL's circuit breaker: open after `threshold` consecutive failures, for `open_ms`; then
/// one call probes (half-open): success closes it, failure opens it again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Breaker {
    threshold: u32,
    open_ms: u64,
    failures: u32,
    state: BreakerState,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(threshold: u32, open_ms: u64) -> Breaker {
        Breaker {
            threshold: threshold.max(1),
            open_ms,
            failures: 0,
            state: BreakerState::Closed,
        }
    }

    /// The state now.
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// Whether a call may be made at `now_ms`.
    pub fn admit(&mut self, now_ms: u64) -> Admission {
        match self.state {
            BreakerState::Closed => Admission::Call,
            BreakerState::Open { until_ms } if now_ms >= until_ms => {
                self.state = BreakerState::HalfOpen;
                Admission::Probe
            }
            BreakerState::Open { .. } | BreakerState::HalfOpen => Admission::Refused,
        }
    }

    /// A call admitted earlier succeeded (the agent answered, rightly or not: it is up).
    pub fn succeeded(&mut self) {
        self.failures = 0;
        self.state = BreakerState::Closed;
    }

    /// A call admitted earlier failed at `now_ms` (no answer, a 5xx, a timeout, a cut stream).
    pub fn failed(&mut self, now_ms: u64) {
        self.failures = self.failures.saturating_add(1);
        let reopen = matches!(self.state, BreakerState::HalfOpen);
        if reopen || self.failures >= self.threshold {
            self.state = BreakerState::Open {
                until_ms: now_ms.saturating_add(self.open_ms),
            };
        }
    }

    /// A probe that ended without an outcome (cancelled): another call may probe.
    pub fn probe_abandoned(&mut self, now_ms: u64) {
        if self.state == BreakerState::HalfOpen {
            self.state = BreakerState::Open { until_ms: now_ms };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(scheme: &str, host: &str, port: u16, path: &str) -> UrlParts {
        UrlParts {
            scheme: scheme.into(),
            host: host.into(),
            port,
            path: path.into(),
        }
    }

    #[test]
    fn allowlist_matches_scheme_host_port_and_path_boundaries() {
        let allowed = [
            url("https", "agents.example", 443, "/"),
            url("http", "127.0.0.1", 8001, "/team"),
        ];
        assert!(is_allowed(
            &allowed,
            &url("https", "agents.example", 443, "/run")
        ));
        assert!(is_allowed(
            &allowed,
            &url("http", "127.0.0.1", 8001, "/team")
        ));
        assert!(is_allowed(
            &allowed,
            &url("http", "127.0.0.1", 8001, "/team/a")
        ));
        assert!(!is_allowed(
            &allowed,
            &url("http", "127.0.0.1", 8001, "/teams")
        ));
        assert!(!is_allowed(
            &allowed,
            &url("http", "127.0.0.1", 8002, "/team")
        ));
        assert!(!is_allowed(
            &allowed,
            &url("http", "agents.example", 443, "/run")
        ));
        assert!(!is_allowed(
            &allowed,
            &url("https", "agents.example.evil", 443, "/")
        ));
        assert!(!is_allowed(&[], &url("https", "agents.example", 443, "/")));
    }

    #[test]
    fn backoff_doubles_from_the_second_call_and_is_capped() {
        assert_eq!(backoff_ms(500, 2), 500);
        assert_eq!(backoff_ms(500, 3), 1_000);
        assert_eq!(backoff_ms(500, 4), 2_000);
        assert_eq!(backoff_ms(500, 40), MAX_BACKOFF_MS);
        assert_eq!(backoff_ms(0, 5), 0);
    }

    #[test]
    fn breaker_opens_after_the_threshold_and_probes_once() {
        let mut breaker = Breaker::new(3, 1_000);
        for now in 0..2 {
            assert_eq!(breaker.admit(now), Admission::Call);
            breaker.failed(now);
        }
        assert_eq!(breaker.state(), BreakerState::Closed);
        breaker.failed(2);
        assert_eq!(breaker.state(), BreakerState::Open { until_ms: 1_002 });
        assert_eq!(breaker.admit(1_001), Admission::Refused);
        assert_eq!(breaker.admit(1_002), Admission::Probe);
        // While the probe runs, nobody else calls.
        assert_eq!(breaker.admit(1_003), Admission::Refused);
        breaker.failed(1_010);
        assert_eq!(breaker.state(), BreakerState::Open { until_ms: 2_010 });
        assert_eq!(breaker.admit(2_010), Admission::Probe);
        breaker.succeeded();
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert_eq!(breaker.admit(2_011), Admission::Call);
        // A success resets the count: two more failures do not open it.
        breaker.failed(2_012);
        breaker.failed(2_013);
        assert_eq!(breaker.state(), BreakerState::Closed);
    }

    #[test]
    fn an_abandoned_probe_lets_the_next_call_probe() {
        let mut breaker = Breaker::new(1, 100);
        breaker.failed(0);
        assert_eq!(breaker.admit(100), Admission::Probe);
        breaker.probe_abandoned(150);
        assert_eq!(breaker.admit(150), Admission::Probe);
    }
}
