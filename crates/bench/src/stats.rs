//! Summaries of measured samples.

use serde_json::{Value, json};

/// Sorts `values` and returns their p50, p95, p99 and max (nearest rank; zeros when empty).
pub fn percentiles(values: &mut [f64]) -> Value {
    values.sort_by(f64::total_cmp);
    let at = |q: f64| -> f64 {
        if values.is_empty() {
            return 0.0;
        }
        let index = ((values.len() as f64 - 1.0) * q).round() as usize;
        values[index.min(values.len() - 1)]
    };
    json!({
        "p50": at(0.50),
        "p95": at(0.95),
        "p99": at(0.99),
        "max": values.last().copied().unwrap_or(0.0),
    })
}

/// Latency samples of one closed loop, in milliseconds.
#[derive(Default)]
pub struct Samples {
    /// Send → durably accepted.
    pub ack: Vec<f64>,
    /// Send → an agent received the turn.
    pub to_agent: Vec<f64>,
    /// Send → the user received the answer.
    pub round_trip: Vec<f64>,
}

impl Samples {
    /// Adds another user's samples.
    pub fn extend(&mut self, other: Samples) {
        self.ack.extend(other.ack);
        self.to_agent.extend(other.to_agent);
        self.round_trip.extend(other.round_trip);
    }

    /// Turns, turns/s and the three latency summaries over `elapsed` seconds.
    pub fn figures(mut self, elapsed: f64) -> Value {
        let turns = self.round_trip.len();
        json!({
            "duration_secs": elapsed,
            "turns": turns,
            "turns_per_sec": turns as f64 / elapsed,
            "ack_ms": percentiles(&mut self.ack),
            "to_agent_ms": percentiles(&mut self.to_agent),
            "round_trip_ms": percentiles(&mut self.round_trip),
        })
    }
}
