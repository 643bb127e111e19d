//! The node's rates for the status page: counters sampled at each page view.

use std::sync::Mutex;
use std::time::Instant;

/// Counters of this node sampled at the previous page view, to show rates.
#[derive(Debug, Default)]
pub struct RateSampler {
    previous: Mutex<Option<(Instant, Counters)>>,
}

/// Totals read from this node's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Counters {
    pub(crate) frames_committed: f64,
    pub(crate) turn_results: f64,
    pub(crate) deliveries: f64,
}

impl RateSampler {
    /// Per-second rates since the previous sample (`None` on the first view).
    pub(crate) fn rates(&self, now: Counters) -> Option<Counters> {
        let mut previous = self
            .previous
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let at = Instant::now();
        let rates = previous.and_then(|(then, before)| {
            let seconds = at.duration_since(then).as_secs_f64();
            (seconds > 0.0).then(|| Counters {
                frames_committed: (now.frames_committed - before.frames_committed) / seconds,
                turn_results: (now.turn_results - before.turn_results) / seconds,
                deliveries: (now.deliveries - before.deliveries) / seconds,
            })
        });
        *previous = Some((at, now));
        rates
    }
}
