//! `turns --storm N`: more end users with idle sessions that all close at once partway through
//! (and, with `--storm-reconnect`, all come back at once), and the round trips of the turns
//! sent in the second after, against those sent before.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use super::{ConnectedUser, Socket, TurnTiming, connect_user};
use crate::stats::percentiles;

/// `turns`' storm of disconnects, off by default.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct StormArgs {
    /// More end users, each with an idle session of its own conversation, that all close their
    /// sockets at once `--storm-at` seconds into the measurement (a disconnect storm: a proxy
    /// restarted, a network cut). 0: none.
    #[arg(long = "storm", value_name = "STORM", default_value_t = 0)]
    pub sessions: usize,
    /// The storm's sessions open again right after they closed, all at once, each with a token
    /// bound to its conversation (minted before the clock): a proxy restarted, and its clients
    /// came back.
    #[arg(long = "storm-reconnect")]
    pub reconnect: bool,
    /// Seconds into the measurement at which the storm's sessions close (less than
    /// `--duration`; the sessions are idle until then, so keep it under the gateway's idle
    /// timeout, 60 s by default).
    #[arg(long = "storm-at", value_name = "STORM_AT", default_value_t = 5)]
    pub at_secs: u64,
}

/// How long after the storm a turn's send counts as during the storm.
const STORM_WINDOW: Duration = Duration::from_secs(1);

/// What a storm did: the sessions it closed, and those that came back.
pub(super) struct StormOutcome {
    /// Sessions closed (each now, or the gateway had closed it already: it left either way).
    pub(super) closed: usize,
    /// Each returning session's hello → welcome, ms.
    pub(super) welcome_ms: Vec<f64>,
    /// The returned sessions' sockets, held until every user is done.
    pub(super) returned: Vec<Socket>,
}

/// Closes every session at `at`, all at once, then opens a session with each of `returning`'s
/// tokens, all at once.
pub(super) async fn storm(
    sessions: Vec<ConnectedUser>,
    at: Instant,
    ws_url: String,
    returning: Vec<String>,
) -> anyhow::Result<StormOutcome> {
    tokio::time::sleep_until(at.into()).await;
    let closing = sessions.into_iter().map(|mut session| async move {
        let _ = session.socket.close(None).await;
    });
    let closed = futures_util::future::join_all(closing).await.len();
    let opening = returning.into_iter().map(|token| {
        let ws_url = ws_url.clone();
        async move {
            let asked = Instant::now();
            let session = connect_user(ws_url, token).await?;
            anyhow::Ok((asked.elapsed().as_secs_f64() * 1000.0, session.socket))
        }
    });
    let mut outcome = StormOutcome {
        closed,
        welcome_ms: Vec::new(),
        returned: Vec::new(),
    };
    for opened in futures_util::future::join_all(opening).await {
        let (welcome_ms, socket) = opened.context("a returning session")?;
        outcome.welcome_ms.push(welcome_ms);
        outcome.returned.push(socket);
    }
    Ok(outcome)
}

/// The round trips of the turns sent in the [`STORM_WINDOW`] after the storm's closes, and of
/// those sent before.
pub(super) fn storm_figures(outcome: &StormOutcome, at_secs: u64, timings: &[TurnTiming]) -> Value {
    let at = at_secs as f64;
    let until = at + STORM_WINDOW.as_secs_f64();
    let mut before: Vec<f64> = timings
        .iter()
        .filter(|turn| turn.sent_secs < at)
        .map(|turn| turn.round_trip_ms)
        .collect();
    let mut within: Vec<f64> = timings
        .iter()
        .filter(|turn| (at..until).contains(&turn.sent_secs))
        .map(|turn| turn.round_trip_ms)
        .collect();
    let mut welcome_ms = outcome.welcome_ms.clone();
    json!({
        "sessions": outcome.closed,
        "returned": welcome_ms.len(),
        "welcome_ms": percentiles(&mut welcome_ms),
        "at_secs": at_secs,
        "window_secs": STORM_WINDOW.as_secs_f64(),
        "turns_before": before.len(),
        "round_trip_before_ms": percentiles(&mut before),
        "turns_in_window": within.len(),
        "round_trip_in_window_ms": percentiles(&mut within),
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{SENT, timings};
    use super::*;

    #[test]
    fn a_storms_window_holds_the_turns_sent_in_the_second_after_it() {
        let outcome = StormOutcome {
            closed: 10,
            welcome_ms: Vec::new(),
            returned: Vec::new(),
        };
        let storm = storm_figures(&outcome, 5, &timings(&SENT));
        assert_eq!(storm["turns_before"], 4);
        assert_eq!(storm["turns_in_window"], 1);
        assert_eq!(storm["round_trip_in_window_ms"]["max"], 90.0);
    }
}
