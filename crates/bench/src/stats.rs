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
