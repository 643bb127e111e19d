//! The gateway's use of `converger_core::recent::Recent`: how long its de-duplication maps keep
//! an idle conversation, how often they are told the time, and the clock they are told.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub(crate) use converger_core::recent::Recent;

/// How long (ms) an idle entry is kept at least (at most twice this, plus one tick).
pub(crate) const RECENT_PERIOD_MS: i64 = 60_000;

/// How often owners call [`Recent::forget_idle`]: often, so that a rotation forced by the
/// capacity does not delay the next one by up to a period.
pub(crate) const RECENT_TICK: Duration = Duration::from_secs(10);

/// Milliseconds on a monotonic clock that starts with the process: `Recent` reads only its
/// progress.
pub(crate) fn monotonic_ms() -> i64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let elapsed = START.get_or_init(Instant::now).elapsed().as_millis();
    i64::try_from(elapsed).unwrap_or(i64::MAX)
}
