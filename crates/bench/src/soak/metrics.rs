//! The nodes' Prometheus `/metrics`, summed over nodes and over the incarnations of a node: a
//! node killed with SIGKILL starts again from zero, so each incarnation is scraped just before
//! its kill and its counters are kept.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context;

/// Labels of one series, sorted by name.
type Labels = BTreeMap<String, String>;

/// Sums of samples by metric name and label set.
#[derive(Debug, Clone, Default)]
pub struct Totals {
    samples: BTreeMap<(String, Labels), f64>,
}

impl Totals {
    /// Adds the samples of one scrape (Prometheus text exposition format).
    pub fn add_scrape(&mut self, text: &str) {
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let Some((name, labels)) = parse_series(series) else {
                continue;
            };
            *self.samples.entry((name, labels)).or_default() += value;
        }
    }

    /// Adds every sample of `other`.
    pub fn add(&mut self, other: &Totals) {
        for (series, value) in &other.samples {
            *self.samples.entry(series.clone()).or_default() += value;
        }
    }

    /// The sum of `name` over the series whose label `label` is `value` (any series when
    /// `label` is `None`).
    pub fn sum(&self, name: &str, label: Option<(&str, &str)>) -> f64 {
        self.samples
            .iter()
            .filter(|((series, _), _)| series == name)
            .filter(|((_, labels), _)| {
                label.is_none_or(|(key, value)| labels.get(key).is_some_and(|v| v == value))
            })
            .map(|(_, value)| value)
            .sum()
    }

    /// Per value of `label`, the sum of `name`.
    pub fn by_label(&self, name: &str, label: &str) -> BTreeMap<String, f64> {
        let mut sums = BTreeMap::new();
        for ((series, labels), value) in &self.samples {
            if series != name {
                continue;
            }
            if let Some(key) = labels.get(label) {
                *sums.entry(key.clone()).or_default() += value;
            }
        }
        sums
    }

    /// Retry ratio (docs/operations.md): duplicate results among committed and duplicate ones.
    pub fn retry_ratio(&self) -> Option<f64> {
        let name = "converger_turn_results_total";
        let duplicate = self.sum(name, Some(("outcome", "duplicate")));
        let committed = self.sum(name, Some(("outcome", "committed")));
        let all = duplicate + committed;
        (all > 0.0).then(|| duplicate / all)
    }

    /// The `q` quantile of histogram `name` in seconds, interpolated within its bucket like
    /// PromQL's `histogram_quantile`; `None` without observations.
    pub fn quantile(&self, name: &str, q: f64) -> Option<f64> {
        let bucket = format!("{name}_bucket");
        let mut cumulative: BTreeMap<OrderedBound, f64> = BTreeMap::new();
        for ((series, labels), value) in &self.samples {
            if *series != bucket {
                continue;
            }
            let Some(bound) = labels.get("le").and_then(|le| parse_bound(le)) else {
                continue;
            };
            *cumulative.entry(OrderedBound(bound)).or_default() += value;
        }
        quantile_of_buckets(&cumulative, q)
    }

    /// Observations of histogram `name`.
    pub fn count(&self, name: &str) -> f64 {
        self.sum(&format!("{name}_count"), None)
    }
}

/// Fetches `base_url/metrics` (5 s at most).
pub async fn scrape(http: &reqwest::Client, base_url: &str) -> anyhow::Result<Totals> {
    let text = http
        .get(format!("{base_url}/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .with_context(|| format!("scrape {base_url}/metrics"))?
        .error_for_status()?
        .text()
        .await?;
    let mut totals = Totals::default();
    totals.add_scrape(&text);
    Ok(totals)
}

/// A bucket bound with a total order (`+Inf` last), to key the cumulative counts.
#[derive(Debug, Clone, Copy, PartialEq)]
struct OrderedBound(f64);

impl Eq for OrderedBound {}

impl PartialOrd for OrderedBound {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for OrderedBound {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

fn parse_bound(le: &str) -> Option<f64> {
    if le == "+Inf" {
        return Some(f64::INFINITY);
    }
    le.parse().ok()
}

fn quantile_of_buckets(cumulative: &BTreeMap<OrderedBound, f64>, q: f64) -> Option<f64> {
    let total = cumulative.values().copied().fold(0.0, f64::max);
    if total <= 0.0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total;
    let mut lower = 0.0;
    let mut below = 0.0;
    for (OrderedBound(upper), count) in cumulative {
        if *count >= rank {
            if upper.is_infinite() {
                // Above the highest finite bound: that bound is all that can be said.
                return Some(lower);
            }
            if *count <= below {
                return Some(*upper);
            }
            return Some(lower + (upper - lower) * (rank - below) / (count - below));
        }
        lower = *upper;
        below = *count;
    }
    Some(lower)
}

/// Splits `name{a="x",b="y"}` into the name and its labels.
fn parse_series(series: &str) -> Option<(String, Labels)> {
    let Some((name, rest)) = series.split_once('{') else {
        return Some((series.to_owned(), Labels::new()));
    };
    let body = rest.strip_suffix('}')?;
    let mut labels = Labels::new();
    let mut chars = body.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        let key = key.trim().trim_start_matches(',').trim().to_owned();
        if key.is_empty() {
            break;
        }
        if chars.next() != Some('"') {
            return None;
        }
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(escaped) => value.push(escaped),
                    None => return None,
                },
                '"' => break,
                other => value.push(other),
            }
        }
        labels.insert(key, value);
    }
    Some((name.to_owned(), labels))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = r#"# TYPE converger_turn_results_total counter
converger_turn_results_total{outcome="committed"} 90
converger_turn_results_total{outcome="duplicate"} 10
converger_turn_results_total{outcome="lease_lost"} 3
# TYPE converger_claim_wait_seconds histogram
converger_claim_wait_seconds_bucket{le="0.001"} 50
converger_claim_wait_seconds_bucket{le="0.005"} 90
converger_claim_wait_seconds_bucket{le="0.01"} 100
converger_claim_wait_seconds_bucket{le="+Inf"} 100
converger_claim_wait_seconds_sum 0.3
converger_claim_wait_seconds_count 100
converger_http_requests_total{method="GET",route="/a,\"b\"",status="200"} 2
"#;

    #[test]
    fn scrapes_add_up_and_give_the_retry_ratio() {
        let mut totals = Totals::default();
        totals.add_scrape(SCRAPE);
        let mut restarted = Totals::default();
        restarted.add_scrape(SCRAPE);
        totals.add(&restarted);
        assert_eq!(totals.sum("converger_turn_results_total", None), 206.0);
        assert_eq!(totals.retry_ratio(), Some(0.1));
        assert_eq!(
            totals.by_label("converger_turn_results_total", "outcome")["lease_lost"],
            6.0
        );
        assert_eq!(
            totals.sum("converger_http_requests_total", Some(("route", "/a,\"b\""))),
            4.0
        );
    }

    #[test]
    fn a_quantile_is_interpolated_within_its_bucket() {
        let mut totals = Totals::default();
        totals.add_scrape(SCRAPE);
        let p50 = totals
            .quantile("converger_claim_wait_seconds", 0.5)
            .unwrap();
        assert!((p50 - 0.001).abs() < 1e-9, "{p50}");
        let p95 = totals
            .quantile("converger_claim_wait_seconds", 0.95)
            .unwrap();
        assert!((p95 - 0.0075).abs() < 1e-9, "{p95}");
        assert_eq!(
            totals.quantile("converger_commit_to_delivery_seconds", 0.99),
            None
        );
        assert_eq!(totals.count("converger_claim_wait_seconds"), 100.0);
    }

    #[test]
    fn observations_above_the_highest_bound_give_that_bound() {
        let mut totals = Totals::default();
        totals.add_scrape("h_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 10\n");
        assert_eq!(totals.quantile("h", 0.99), Some(1.0));
    }
}
