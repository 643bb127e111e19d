//! Admin API: tenants, the cluster view, force-disconnect.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use std::collections::BTreeSet;

use converger_store::bus::DisconnectOrder;
use serde::Deserialize;
use serde_json::{Value, json};
use uuid::Uuid;

use super::body::parse_json;
use crate::auth::AdminAuth;
use crate::error::ApiError;
use crate::state::AppState;

#[derive(Deserialize)]
struct CreateTenant {
    name: String,
}

/// `POST /api/v1/admin/tenants` → `{id, name, apiKey}`; the key is shown only here.
pub(crate) async fn create_tenant(
    State(state): State<AppState>,
    _admin: AdminAuth,
    body: Result<Bytes, BytesRejection>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let request: CreateTenant = parse_json(body, false)?;
    let name = super::channels::checked_name(&request.name)?;
    let (tenant, api_key) = state.store.create_tenant(name).await?;
    tracing::info!(tenant_id = %tenant.id, "tenant created");
    Ok((
        StatusCode::CREATED,
        Json(json!({"id": tenant.id, "name": tenant.name, "apiKey": api_key})),
    ))
}

/// `GET /api/v1/admin/cluster` → the nodes and agent connections this node knows of, with the
/// node's own id so that operators can tell which view they are reading.
pub(crate) async fn cluster(
    State(state): State<AppState>,
    _admin: AdminAuth,
) -> Result<Json<Value>, ApiError> {
    let status = state.cluster.status().await.map_err(|error| {
        tracing::error!(%error, "cluster status unavailable");
        ApiError::internal()
    })?;
    Ok(Json(json!({
        "node": {"id": state.hub.node_id(), "generation": state.cluster.node().generation},
        "nodes": status.nodes,
        "members": status.members,
    })))
}

/// Longest reason of a disconnect, in characters.
const MAX_DISCONNECT_REASON_CHARS: usize = 100;
/// How long a disconnect waits for every live node's report.
const DISCONNECT_REPORT_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct DisconnectRequest {
    tenant_id: Uuid,
    #[serde(default)]
    user_id: Option<String>,
    #[serde(default)]
    conversation_id: Option<Uuid>,
    #[serde(default)]
    channel_id: Option<Uuid>,
    #[serde(default)]
    reason: Option<String>,
}

/// `POST /api/v1/admin/disconnect` `{tenantId, userId?, conversationId?, channelId?, reason?}`
/// → `{requestId, closed, nodes: [{node, closed}], missing}`: every matching socket on every
/// node is closed with 4403; `missing` names the live nodes that did not report in time.
pub(crate) async fn disconnect(
    State(state): State<AppState>,
    _admin: AdminAuth,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let request: DisconnectRequest = parse_json(body, false)?;
    if request.user_id.is_none()
        && request.conversation_id.is_none()
        && request.channel_id.is_none()
    {
        return Err(ApiError::bad_request(
            "name a userId, a conversationId or a channelId",
        ));
    }
    if let Some(user_id) = &request.user_id {
        super::tokens::checked_user_id(user_id)?;
    }
    let reason = match request.reason.as_deref().map(str::trim) {
        None => "disconnected by an operator".to_owned(),
        Some(reason)
            if reason.is_empty() || reason.chars().count() > MAX_DISCONNECT_REASON_CHARS =>
        {
            return Err(ApiError::bad_request(format!(
                "reason must be 1-{MAX_DISCONNECT_REASON_CHARS} characters"
            )));
        }
        Some(reason) => reason.to_owned(),
    };
    if state.store.tenant(request.tenant_id).await?.is_none() {
        return Err(ApiError::not_found("tenant"));
    }
    let status = state.cluster.status().await.map_err(|error| {
        tracing::error!(%error, "cluster status unavailable");
        ApiError::internal()
    })?;
    let expected: BTreeSet<String> = status
        .nodes
        .iter()
        .filter(|node| node.status != "dead")
        .map(|node| node.id.clone())
        .collect();
    let order = DisconnectOrder {
        request_id: Uuid::now_v7(),
        tenant_id: request.tenant_id,
        user_id: request.user_id,
        conversation_id: request.conversation_id,
        channel_id: request.channel_id,
        reason,
        issued_ms: chrono::Utc::now().timestamp_millis(),
    };
    // Every node, this one included, carries the order out when its bus hands it over.
    state.bus.disconnect(&order).await?;
    tracing::info!(request_id = %order.request_id, tenant_id = %order.tenant_id, "disconnect ordered");
    let deadline = tokio::time::Instant::now() + DISCONNECT_REPORT_WAIT;
    let reports = loop {
        let reports = state.store.disconnect_reports(order.request_id).await?;
        let reported: BTreeSet<&str> = reports.iter().map(|(node, _)| node.as_str()).collect();
        let complete = expected.iter().all(|node| reported.contains(node.as_str()));
        if complete || tokio::time::Instant::now() >= deadline {
            break reports;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    };
    let closed: i64 = reports.iter().map(|(_, closed)| i64::from(*closed)).sum();
    let missing: Vec<&String> = expected
        .iter()
        .filter(|node| !reports.iter().any(|(reported, _)| reported == *node))
        .collect();
    let nodes: Vec<Value> = reports
        .iter()
        .map(|(node, closed)| json!({"node": node, "closed": closed}))
        .collect();
    Ok(Json(json!({
        "requestId": order.request_id,
        "closed": closed,
        "nodes": nodes,
        "missing": missing,
    })))
}
