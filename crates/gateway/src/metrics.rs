//! Prometheus metrics: the process-wide recorder and the HTTP request middleware.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request};
use axum::middleware::Next;
use axum::response::Response;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Latency buckets in seconds, from sub-millisecond commits to slow requests.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Writes per group-commit batch: powers of two up to the batch limit, so the size mix (lone
/// writes against full batches) shows, which latency buckets would hide.
const BATCH_SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the global recorder once per process and returns its render handle. Several
/// servers in one process (tests) share it.
pub fn install_recorder() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets(LATENCY_BUCKETS)
                .and_then(|builder| {
                    builder.set_buckets_for_metric(
                        Matcher::Full("converger_group_commit_writes".to_owned()),
                        BATCH_SIZE_BUCKETS,
                    )
                })
                .map(PrometheusBuilder::build_recorder);
            let handle = match recorder {
                Ok(recorder) => {
                    let handle = recorder.handle();
                    if metrics::set_global_recorder(recorder).is_err() {
                        tracing::warn!(
                            "a metrics recorder was already installed; /metrics shows only ours"
                        );
                    }
                    handle
                }
                Err(error) => {
                    tracing::warn!(%error, "metrics buckets refused; using defaults");
                    let recorder = PrometheusBuilder::new().build_recorder();
                    let handle = recorder.handle();
                    let _ = metrics::set_global_recorder(recorder);
                    handle
                }
            };
            keep_up(handle.clone());
            handle
        })
        .clone()
}

/// How often recorded histogram samples are folded into their buckets.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// A recorder built by hand (not installed by the exporter) keeps every histogram sample until
/// something drains it, which a scrape does: a node nobody scrapes grew by every request and
/// every database statement it ever timed (about 250 bytes per conversation in the memory
/// bench). A thread of its own drains them, whatever runtime the servers of the process use.
fn keep_up(handle: PrometheusHandle) {
    let started = std::thread::Builder::new()
        .name("metrics-upkeep".to_owned())
        .spawn(move || {
            loop {
                std::thread::sleep(UPKEEP_EVERY);
                handle.run_upkeep();
            }
        });
    if let Err(error) = started {
        tracing::warn!(%error, "metrics upkeep thread not started; histograms drain on scrapes only");
    }
}

/// Counts requests and records their latency by method, route template and status.
pub async fn track_http(request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().as_str().to_owned();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|path| path.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let response = next.run(request).await;
    let status = response.status().as_u16().to_string();
    let labels = [("method", method), ("route", route), ("status", status)];
    metrics::counter!("converger_http_requests_total", &labels).increment(1);
    metrics::histogram!("converger_http_request_duration_seconds", &labels)
        .record(started.elapsed().as_secs_f64());
    response
}
