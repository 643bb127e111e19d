//! Lease mode: a claim in the registry before each delivery, and the fence an answer must
//! carry (ADR 0009).

use uuid::Uuid;

use crate::{Store, StoreError};

/// What claiming a turn for a lease-mode member gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Claimed (or still held by this holder): deliver it with this fence.
    Claimed {
        /// The fencing token the answer must carry.
        fence: i64,
    },
    /// Another holder's lease is live: try again once it has run out.
    Held {
        /// Milliseconds until the lease runs out (measured by the database clock, so node
        /// clocks do not matter).
        remaining_ms: i64,
    },
    /// The turn (revision) is answered, superseded or unknown: nothing to deliver.
    NotPending,
}

impl Store {
    /// Claims a turn's revision for `holder` for `lease`: a short statement, no row lock kept
    /// while the agent works. A new holder bumps the fence; the same holder keeps it.
    pub async fn claim_turn(
        &self,
        conversation_id: Uuid,
        seq: i64,
        revision: i32,
        holder: &str,
        lease: std::time::Duration,
    ) -> Result<Claim, StoreError> {
        let row: Option<(i64, Option<String>, Option<i64>, bool)> = self
            .timed("claim_turn", async {
                sqlx::query_as(
                    "WITH current AS (
                         SELECT status, claimed_by, lease_until FROM turns
                         WHERE conversation_id = $1 AND seq = $2 AND revision = $3
                     ), claimed AS (
                         UPDATE turns t
                         SET fence = CASE WHEN t.claimed_by = $4 AND t.lease_until >= now()
                                          THEN t.fence ELSE t.fence + 1 END,
                             claimed_by = $4,
                             lease_until = now() + make_interval(secs => $5)
                         WHERE t.conversation_id = $1 AND t.seq = $2 AND t.revision = $3
                           AND t.status = 'pending'
                           AND NOT EXISTS (SELECT 1 FROM turns later
                                           WHERE later.conversation_id = $1 AND later.seq = $2
                                             AND later.revision > $3)
                           AND (t.claimed_by IS NULL OR t.claimed_by = $4 OR t.lease_until < now())
                         RETURNING t.fence
                     )
                     SELECT coalesce((SELECT fence FROM claimed), -1),
                            (SELECT claimed_by FROM current),
                            (SELECT ceil(extract(epoch FROM lease_until - now()) * 1000)::bigint FROM current),
                            coalesce((SELECT status = 'pending' FROM current), false)",
                )
                .bind(conversation_id)
                .bind(seq)
                .bind(revision)
                .bind(holder)
                .bind(lease.as_secs_f64())
                .fetch_optional(&self.pool)
                .await
            })
            .await?;
        let Some((fence, holder_then, remaining_ms, pending)) = row else {
            return Ok(Claim::NotPending);
        };
        if fence >= 0 {
            return Ok(Claim::Claimed { fence });
        }
        match (pending, holder_then, remaining_ms) {
            (true, Some(_), Some(remaining_ms)) => Ok(Claim::Held {
                remaining_ms: remaining_ms.max(0),
            }),
            _ => Ok(Claim::NotPending),
        }
    }

    /// Extends every lease `holder` still holds (its member is connected).
    pub async fn renew_leases(
        &self,
        holder: &str,
        lease: std::time::Duration,
    ) -> Result<u64, StoreError> {
        let result = self
            .timed("renew_leases", async {
                sqlx::query(
                    "UPDATE turns SET lease_until = now() + make_interval(secs => $2)
                     WHERE (conversation_id, seq, revision) IN (SELECT conversation_id, seq, revision FROM turns
                         WHERE claimed_by = $1 AND status = 'pending'
                         ORDER BY conversation_id FOR UPDATE)",
                )
                .bind(holder)
                .bind(lease.as_secs_f64())
                .execute(&self.pool)
                .await
            })
            .await?;
        Ok(result.rows_affected())
    }

    /// Gives up every lease `holder` holds (its member left), so the next owner claims at once.
    pub async fn release_leases(&self, holder: &str) -> Result<u64, StoreError> {
        let result = self
            .timed("release_leases", async {
                sqlx::query(
                    "UPDATE turns SET claimed_by = NULL, lease_until = NULL
                     WHERE (conversation_id, seq, revision) IN (SELECT conversation_id, seq, revision FROM turns
                         WHERE claimed_by = $1 AND status = 'pending'
                         ORDER BY conversation_id FOR UPDATE)",
                )
                .bind(holder)
                .execute(&self.pool)
                .await
            })
            .await?;
        Ok(result.rows_affected())
    }
}

/// A turn's revision as a stream opening checks it (ADR 0019).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamableTurn {
    /// True while the revision waits for its result.
    pub pending: bool,
    /// The revision's current lease fence.
    pub fence: i64,
    /// The latest revision of the turn (above the asked one when it was superseded).
    pub latest_revision: i32,
}

impl Store {
    /// The state of a turn's revision, read once when a stream for it opens; `None` when the
    /// conversation has no such turn revision.
    pub async fn streamable_turn(
        &self,
        conversation_id: Uuid,
        seq: i64,
        revision: i32,
    ) -> Result<Option<StreamableTurn>, StoreError> {
        let row: Option<(bool, i64, i32)> = self
            .timed("streamable_turn", async {
                sqlx::query_as(
                    "SELECT t.status = 'pending', t.fence,
                            (SELECT max(revision) FROM turns later
                             WHERE later.conversation_id = $1 AND later.seq = $2)
                     FROM turns t
                     WHERE t.conversation_id = $1 AND t.seq = $2 AND t.revision = $3",
                )
                .bind(conversation_id)
                .bind(seq)
                .bind(revision)
                .fetch_optional(&self.pool)
                .await
            })
            .await?;
        Ok(row.map(|(pending, fence, latest_revision)| StreamableTurn {
            pending,
            fence,
            latest_revision,
        }))
    }
}
