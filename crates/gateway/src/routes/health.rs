//! Liveness, readiness and metrics.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::auth::{bearer, secrets_match};
use crate::error::ApiError;
use crate::state::AppState;

/// `GET /health/live`: the process answers.
pub(crate) async fn live() -> Json<serde_json::Value> {
    Json(json!({"status": "ok"}))
}

/// Longest a readiness check waits for the database.
const READINESS_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

/// `GET /health/ready`: 200 when the database answers and accepts writes and the node is not
/// draining.
pub(crate) async fn ready(State(state): State<AppState>) -> Response {
    if state.is_draining() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining"})),
        )
            .into_response();
    }
    // A load balancer's check has a deadline of its own: answer 503 before it, rather than
    // wait for the pool's acquire timeout on a database that went away.
    let ping = tokio::time::timeout(READINESS_DEADLINE, state.store.ping()).await;
    match ping.unwrap_or(Err(converger_store::StoreError::Timeout {
        operation: "ping",
    })) {
        Ok(()) => Json(json!({"status": "ready"})).into_response(),
        Err(error) => {
            tracing::warn!(%error, "readiness: database unavailable");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({"status": "database unavailable"})),
            )
                .into_response()
        }
    }
}

/// `GET /metrics`: Prometheus text, behind `metrics_token` when configured.
pub(crate) async fn metrics(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let required = &state.config.metrics_token;
    if !required.is_empty() {
        let given = bearer(&headers).unwrap_or_default();
        if !secrets_match(given, required) {
            return Err(ApiError::unauthorized("metrics token required"));
        }
    }
    state.store.record_pool_metrics();
    state.streams.record_metrics();
    let body = state.metrics.render();
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response())
}

/// Any other path.
pub(crate) async fn not_found() -> ApiError {
    ApiError::not_found("route")
}

/// A known path with a method it does not serve.
pub(crate) async fn method_not_allowed() -> ApiError {
    ApiError::with_code(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "method not allowed",
    )
}
