//! Admin API: tenants.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

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
