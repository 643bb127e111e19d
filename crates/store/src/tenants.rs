//! Tenants: the unit of isolation, authenticated by an API key.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::secrets::{generate_secret, hash_secret};
use crate::{Store, StoreError};

/// A tenant row (never includes the API key).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Tenant {
    /// Tenant id.
    pub id: Uuid,
    /// Display name.
    pub name: String,
    /// `active` or `inactive`.
    pub status: String,
    /// Creation time.
    pub created_at: DateTime<Utc>,
}

impl Store {
    /// Creates a tenant and returns it with its API key, which is not stored and never shown again.
    pub async fn create_tenant(&self, name: &str) -> Result<(Tenant, String), StoreError> {
        let api_key = generate_secret("cvg_key_");
        let tenant = self
            .timed("create_tenant", async {
                sqlx::query_as::<_, Tenant>(
                    "INSERT INTO tenants (id, name, api_key_hash) VALUES ($1, $2, $3)
                     RETURNING id, name, status, created_at",
                )
                .bind(Uuid::now_v7())
                .bind(name)
                .bind(hash_secret(&api_key))
                .fetch_one(&self.pool)
                .await
            })
            .await?;
        Ok((tenant, api_key))
    }

    /// The active tenant an API key belongs to: its current key, or the one it replaced while
    /// that key's grace lasts.
    pub async fn tenant_by_api_key(&self, api_key: &str) -> Result<Option<Tenant>, StoreError> {
        self.timed("tenant_by_api_key", async {
            sqlx::query_as::<_, Tenant>(
                "SELECT id, name, status, created_at FROM tenants
                 WHERE status = 'active'
                   AND (api_key_hash = $1
                        OR (previous_api_key_hash = $1 AND previous_key_expires_at > now()))",
            )
            .bind(hash_secret(api_key))
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// A tenant by id.
    pub async fn tenant(&self, id: Uuid) -> Result<Option<Tenant>, StoreError> {
        self.timed("tenant", async {
            sqlx::query_as::<_, Tenant>(
                "SELECT id, name, status, created_at FROM tenants WHERE id = $1",
            )
            .bind(id)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// Replaces a tenant's API key, which must be `current_key` (not a key in its grace): the
    /// new key (shown once) and when the replaced one stops working. `None` when `current_key`
    /// is not the tenant's current key.
    pub async fn rotate_api_key(
        &self,
        tenant_id: Uuid,
        current_key: &str,
        grace_secs: u64,
    ) -> Result<Option<(String, DateTime<Utc>)>, StoreError> {
        let api_key = generate_secret("cvg_key_");
        let grace = grace_secs as f64;
        let expires: Option<DateTime<Utc>> = self
            .timed("rotate_api_key", async {
                sqlx::query_scalar(
                    "UPDATE tenants
                     SET previous_api_key_hash = api_key_hash,
                         previous_key_expires_at = now() + make_interval(secs => $4),
                         api_key_hash = $3
                     WHERE id = $1 AND api_key_hash = $2
                     RETURNING previous_key_expires_at",
                )
                .bind(tenant_id)
                .bind(hash_secret(current_key))
                .bind(hash_secret(&api_key))
                .bind(grace)
                .fetch_optional(&self.pool)
                .await
            })
            .await?;
        Ok(expires.map(|expires| (api_key, expires)))
    }
}
