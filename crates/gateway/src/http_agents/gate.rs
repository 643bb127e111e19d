//! What every call to one URL shares on a node: the concurrency cap and the circuit breaker.

use converger_core::http_agents::{Admission, Breaker, BreakerState};
use tokio::sync::{Semaphore, SemaphorePermit};

use super::request::CallError;

/// The gate of one URL.
pub(crate) struct UrlGate {
    calls: Semaphore,
    capacity: usize,
    breaker: std::sync::Mutex<Breaker>,
    /// The URL without its query, as metrics and logs name it.
    label: String,
}

impl UrlGate {
    /// A gate letting `capacity` calls to the URL `label` names run at once.
    pub(crate) fn new(capacity: usize, breaker: Breaker, label: String) -> UrlGate {
        UrlGate {
            calls: Semaphore::new(capacity),
            capacity,
            breaker: std::sync::Mutex::new(breaker),
            label,
        }
    }

    /// The URL without its query, as metrics and logs name it.
    pub(crate) fn label(&self) -> &str {
        &self.label
    }

    /// Calls it lets run at once.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// The breaker's state now.
    pub(crate) fn breaker_state(&self) -> BreakerState {
        self.breaker().state()
    }

    /// Waits for a free slot, then asks the breaker whether the call may go.
    pub(crate) async fn enter(&self) -> Result<Admitted<'_>, CallError> {
        let slot = self
            .calls
            .acquire()
            .await
            .map_err(|_| CallError::Connect("the node is shutting down".into()))?;
        let admission = self.breaker().admit(now_ms());
        if admission == Admission::Refused {
            return Err(CallError::CircuitOpen);
        }
        Ok(Admitted {
            gate: self,
            _slot: slot,
            probe: admission == Admission::Probe,
            settled: false,
        })
    }

    fn breaker(&self) -> std::sync::MutexGuard<'_, Breaker> {
        // A panic while the lock was held leaves a breaker that is still consistent.
        self.breaker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A call admitted by the breaker; a probe that ends without an outcome (its turn cancelled)
/// lets the next call probe.
pub(crate) struct Admitted<'a> {
    gate: &'a UrlGate,
    /// The call's place under the concurrency cap, held while it runs.
    _slot: SemaphorePermit<'a>,
    probe: bool,
    settled: bool,
}

impl Admitted<'_> {
    /// Tells the breaker how the call went (read until its run ended, or failed).
    pub(crate) fn settle(mut self, outcome: &Result<(), CallError>) {
        self.settled = true;
        let mut breaker = self.gate.breaker();
        match outcome {
            Err(error) if error.counts_against_url() => breaker.failed(now_ms()),
            _ => breaker.succeeded(),
        }
        let open = breaker.state() != BreakerState::Closed;
        metrics::gauge!("converger_http_agent_breaker_open", "url" => self.gate.label.clone())
            .set(f64::from(u8::from(open)));
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        if self.probe && !self.settled {
            self.gate.breaker().probe_abandoned(now_ms());
        }
    }
}

fn now_ms() -> u64 {
    u64::try_from(chrono::Utc::now().timestamp_millis()).unwrap_or_default()
}
