//! Channels: where agents and end users of one tenant meet, authenticated by a channel secret.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::secrets::{generate_secret, hash_secret};
use crate::{Store, StoreError};

/// Whether a channel accepts connections and tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelStatus {
    /// Accepts tokens and connections.
    Active,
    /// Refuses its tokens; its sockets are closed.
    Inactive,
}

impl ChannelStatus {
    /// The stored and wire form.
    pub fn as_str(self) -> &'static str {
        match self {
            ChannelStatus::Active => "active",
            ChannelStatus::Inactive => "inactive",
        }
    }

    /// Parses the stored and wire form.
    pub fn parse(status: &str) -> Option<ChannelStatus> {
        match status {
            "active" => Some(ChannelStatus::Active),
            "inactive" => Some(ChannelStatus::Inactive),
            _ => None,
        }
    }
}

/// A channel row (never includes the secret).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Channel {
    /// Channel id.
    pub id: Uuid,
    /// Owning tenant.
    pub tenant_id: Uuid,
    /// Display name.
    pub name: String,
    /// `active` or `inactive`.
    pub status: String,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Its turn policy (`enqueue`, `reject`, `interrupt`, `rollback`); `None`: the node's
    /// configured default (ADR 0029).
    pub turn_policy: Option<String>,
    /// The policies a send may ask for instead.
    pub turn_policy_overrides: Vec<String>,
    /// `cancel` when the last end-user connection leaving cancels the running turn; `None`
    /// or `continue`: it never does.
    pub on_disconnect: Option<String>,
}

/// What a channel says about running turns (ADR 0029); `None` fields are left as they are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TurnSettings {
    /// The turn policy; `Some(None)` resets it to the node's default.
    pub turn_policy: Option<Option<String>>,
    /// The policies a send may ask for instead.
    pub turn_policy_overrides: Option<Vec<String>>,
    /// `continue` or `cancel`; `Some(None)` resets it.
    pub on_disconnect: Option<Option<String>>,
}

impl Channel {
    /// True when the channel accepts tokens and connections.
    pub fn is_active(&self) -> bool {
        self.status == ChannelStatus::Active.as_str()
    }
}

pub(crate) const CHANNEL_COLUMNS: &str =
    "id, tenant_id, name, status, created_at, turn_policy, turn_policy_overrides, on_disconnect";

impl Store {
    /// Creates a channel of a tenant, with its turn settings, and returns it with its secret,
    /// shown only this once.
    pub async fn create_channel(
        &self,
        tenant_id: Uuid,
        name: &str,
        turns: &TurnSettings,
    ) -> Result<(Channel, String), StoreError> {
        let secret = generate_secret("cvg_sec_");
        let created = self
            .timed("create_channel", async {
                sqlx::query_as::<_, Channel>(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO channels (id, tenant_id, name, secret_hash, turn_policy,
                                           turn_policy_overrides, on_disconnect)
                     SELECT $1, id, $3, $4, $5, coalesce($6, '{{}}'), $7
                     FROM tenants WHERE id = $2
                     RETURNING {CHANNEL_COLUMNS}"
                )))
                .bind(Uuid::now_v7())
                .bind(tenant_id)
                .bind(name)
                .bind(hash_secret(&secret))
                .bind(turns.turn_policy.clone().flatten())
                .bind(turns.turn_policy_overrides.clone())
                .bind(turns.on_disconnect.clone().flatten())
                .fetch_optional(&self.pool)
                .await
            })
            .await?;
        let channel = created.ok_or(StoreError::TenantNotFound)?;
        Ok((channel, secret))
    }

    /// The channels of one tenant, oldest first.
    pub async fn list_channels(&self, tenant_id: Uuid) -> Result<Vec<Channel>, StoreError> {
        self.timed("list_channels", async {
            sqlx::query_as::<_, Channel>(sqlx::AssertSqlSafe(format!(
                "SELECT {CHANNEL_COLUMNS} FROM channels WHERE tenant_id = $1 ORDER BY created_at, id"
            )))
            .bind(tenant_id)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }

    /// Sets a channel's status; `None` when the tenant has no such channel.
    pub async fn set_channel_status(
        &self,
        tenant_id: Uuid,
        channel_id: Uuid,
        status: ChannelStatus,
    ) -> Result<Option<Channel>, StoreError> {
        self.timed("set_channel_status", async {
            sqlx::query_as::<_, Channel>(sqlx::AssertSqlSafe(format!(
                "UPDATE channels SET status = $3, updated_at = now()
                 WHERE id = $1 AND tenant_id = $2
                 RETURNING {CHANNEL_COLUMNS}"
            )))
            .bind(channel_id)
            .bind(tenant_id)
            .bind(status.as_str())
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// Changes what a channel says about running turns; `None` when the tenant has no such
    /// channel. The values are checked by the caller (and by the table's constraints).
    pub async fn set_turn_settings(
        &self,
        tenant_id: Uuid,
        channel_id: Uuid,
        settings: &TurnSettings,
    ) -> Result<Option<Channel>, StoreError> {
        self.timed("set_turn_settings", async {
            sqlx::query_as::<_, Channel>(sqlx::AssertSqlSafe(format!(
                "UPDATE channels
                 SET turn_policy = CASE WHEN $3 THEN $4 ELSE turn_policy END,
                     turn_policy_overrides = coalesce($5, turn_policy_overrides),
                     on_disconnect = CASE WHEN $6 THEN $7 ELSE on_disconnect END,
                     updated_at = now()
                 WHERE id = $1 AND tenant_id = $2
                 RETURNING {CHANNEL_COLUMNS}"
            )))
            .bind(channel_id)
            .bind(tenant_id)
            .bind(settings.turn_policy.is_some())
            .bind(settings.turn_policy.clone().flatten())
            .bind(settings.turn_policy_overrides.clone())
            .bind(settings.on_disconnect.is_some())
            .bind(settings.on_disconnect.clone().flatten())
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// The channel a secret belongs to, whatever its status.
    pub async fn channel_by_secret(&self, secret: &str) -> Result<Option<Channel>, StoreError> {
        self.timed("channel_by_secret", async {
            sqlx::query_as::<_, Channel>(sqlx::AssertSqlSafe(format!(
                "SELECT {CHANNEL_COLUMNS} FROM channels WHERE secret_hash = $1"
            )))
            .bind(hash_secret(secret))
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// A channel by id, whatever its status.
    pub async fn channel(&self, channel_id: Uuid) -> Result<Option<Channel>, StoreError> {
        self.timed("channel", async {
            sqlx::query_as::<_, Channel>(sqlx::AssertSqlSafe(format!(
                "SELECT {CHANNEL_COLUMNS} FROM channels WHERE id = $1"
            )))
            .bind(channel_id)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }

    /// Stores a catalog an agent published (`genui_components` or `skills`); the latest wins.
    pub async fn set_channel_catalog(
        &self,
        channel_id: Uuid,
        kind: &str,
        catalog: &serde_json::Value,
    ) -> Result<(), StoreError> {
        self.timed("set_channel_catalog", async {
            sqlx::query(
                "UPDATE channels SET settings = jsonb_set(settings, ARRAY[$2], $3), updated_at = now() WHERE id = $1",
            )
            .bind(channel_id)
            .bind(kind)
            .bind(catalog)
            .execute(&self.pool)
            .await
        })
        .await?;
        Ok(())
    }
}

impl Store {
    /// The oldest channel named `channel_name` of the oldest tenant named `tenant_name` (the
    /// development demo's channel), when there is one.
    pub async fn channel_by_names(
        &self,
        tenant_name: &str,
        channel_name: &str,
    ) -> Result<Option<Channel>, StoreError> {
        self.timed("channel_by_names", async {
            sqlx::query_as::<_, Channel>(
                "SELECT c.id, c.tenant_id, c.name, c.status, c.created_at, c.turn_policy,
                        c.turn_policy_overrides, c.on_disconnect
                 FROM channels c JOIN tenants t ON t.id = c.tenant_id
                 WHERE t.name = $1 AND c.name = $2
                 ORDER BY t.created_at, c.created_at LIMIT 1",
            )
            .bind(tenant_name)
            .bind(channel_name)
            .fetch_optional(&self.pool)
            .await
        })
        .await
    }
}
