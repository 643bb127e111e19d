//! The gateway's own view of a measurement window, from its `/metrics` before and after: how
//! many group-commit batches ran, how full they were and how long their statements took.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use serde_json::{Value, json};

/// Prometheus samples by series (name and labels as printed).
pub type Scrape = HashMap<String, f64>;

/// Reads the gateway's `/metrics`.
pub async fn scrape(base_url: &str) -> anyhow::Result<Scrape> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let text = client
        .get(format!("{base_url}/metrics"))
        .send()
        .await?
        .error_for_status()?
        .text()
        .await
        .context("read /metrics")?;
    Ok(parse(&text))
}

/// The samples of a Prometheus text page (comments and unreadable lines skipped).
fn parse(text: &str) -> Scrape {
    let mut samples = Scrape::new();
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        if let Ok(value) = value.parse::<f64>() {
            samples.insert(series.to_owned(), value);
        }
    }
    samples
}

/// Group commit over the window between two scrapes: batches, writes per batch, and the
/// statement time (mean, and how many statements finished within each bucket bound).
pub fn group_commit(before: &Scrape, after: &Scrape) -> Value {
    let grew = |series: &str| {
        after.get(series).copied().unwrap_or(0.0) - before.get(series).copied().unwrap_or(0.0)
    };
    let batches = grew("converger_group_commit_writes_count");
    let writes = grew("converger_group_commit_writes_sum");
    let statement = r#"operation="group_commit",status="ok""#;
    let statements = grew(&format!("converger_db_query_seconds_count{{{statement}}}"));
    let statement_seconds = grew(&format!("converger_db_query_seconds_sum{{{statement}}}"));
    let mut within_ms = Vec::new();
    let bucket_prefix = format!("converger_db_query_seconds_bucket{{{statement},le=\"");
    for series in after.keys() {
        let Some(bound) = series.strip_prefix(&bucket_prefix) else {
            continue;
        };
        let Some(Ok(bound)) = bound.strip_suffix("\"}").map(str::parse::<f64>) else {
            continue;
        };
        if bound.is_infinite() {
            continue;
        }
        within_ms.push((bound * 1000.0, grew(series)));
    }
    within_ms.sort_by(|a, b| a.0.total_cmp(&b.0));
    json!({
        "batches": batches,
        "writes_per_batch": if batches > 0.0 { writes / batches } else { 0.0 },
        "statement_ms_mean": if statements > 0.0 { statement_seconds / statements * 1000.0 } else { 0.0 },
        "statements_within_ms": within_ms
            .iter()
            .map(|(bound, count)| json!([bound, count]))
            .collect::<Vec<Value>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = r#"# TYPE converger_group_commit_writes histogram
converger_group_commit_writes_sum 10
converger_group_commit_writes_count 10
converger_db_query_seconds_bucket{operation="group_commit",status="ok",le="0.001"} 4
converger_db_query_seconds_bucket{operation="group_commit",status="ok",le="0.0025"} 10
converger_db_query_seconds_bucket{operation="group_commit",status="ok",le="+Inf"} 10
converger_db_query_seconds_sum{operation="group_commit",status="ok"} 0.01
converger_db_query_seconds_count{operation="group_commit",status="ok"} 10
"#;

    const AFTER: &str = r#"converger_group_commit_writes_sum 50
converger_group_commit_writes_count 20
converger_db_query_seconds_bucket{operation="group_commit",status="ok",le="0.001"} 4
converger_db_query_seconds_bucket{operation="group_commit",status="ok",le="0.0025"} 18
converger_db_query_seconds_bucket{operation="group_commit",status="ok",le="+Inf"} 20
converger_db_query_seconds_sum{operation="group_commit",status="ok"} 0.04
converger_db_query_seconds_count{operation="group_commit",status="ok"} 20
converger_db_query_seconds_count{operation="group_commit",status="error"} 3
"#;

    #[test]
    fn the_window_is_the_difference_of_the_two_scrapes() {
        let view = group_commit(&parse(BEFORE), &parse(AFTER));
        assert_eq!(view["batches"], 10.0);
        assert_eq!(view["writes_per_batch"], 4.0);
        let mean = view["statement_ms_mean"].as_f64().unwrap();
        assert!((mean - 3.0).abs() < 1e-9, "mean {mean}");
        assert_eq!(
            view["statements_within_ms"],
            json!([[1.0, 0.0], [2.5, 8.0]])
        );
    }

    #[test]
    fn an_empty_window_reports_zeros() {
        let view = group_commit(&parse(BEFORE), &parse(BEFORE));
        assert_eq!(view["batches"], 0.0);
        assert_eq!(view["writes_per_batch"], 0.0);
        assert_eq!(view["statement_ms_mean"], 0.0);
    }
}
