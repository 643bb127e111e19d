//! Rates kept per key on this node: conversations created and tokens issued per channel and per
//! tenant, and failed admin authentications per client address. Each key has a token bucket
//! holding a minute's worth of its rate.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::config::{AdminConfig, RatesConfig};

/// Keys kept before full (idle) buckets are forgotten.
const PRUNE_ABOVE: usize = 10_000;

/// One token bucket per key.
#[derive(Debug)]
pub(crate) struct Buckets<K> {
    capacity: f64,
    per_sec: f64,
    entries: Mutex<HashMap<K, (f64, Instant)>>,
}

impl<K: Hash + Eq + Copy> Buckets<K> {
    /// Buckets of `burst` tokens refilled at `per_minute`; `per_minute` 0 means unlimited.
    pub(crate) fn new(burst: u32, per_minute: u32) -> Buckets<K> {
        Buckets {
            capacity: f64::from(burst),
            per_sec: f64::from(per_minute) / 60.0,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// Buckets of a minute's worth of `per_minute`.
    pub(crate) fn per_minute(per_minute: u32) -> Buckets<K> {
        Buckets::new(per_minute, per_minute)
    }

    fn unlimited(&self) -> bool {
        self.per_sec == 0.0
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<K, (f64, Instant)>> {
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The key's tokens now, after refilling.
    fn refilled(&self, entry: (f64, Instant), now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(entry.1).as_secs_f64();
        (entry.0 + elapsed * self.per_sec).min(self.capacity)
    }

    fn wait_for_one(&self, tokens: f64) -> Duration {
        Duration::from_secs_f64(((1.0 - tokens) / self.per_sec).max(0.001))
    }

    /// Takes a token for `key`, or says how long until one is back.
    pub(crate) fn take(&self, key: K, now: Instant) -> Result<(), Duration> {
        if self.unlimited() {
            return Ok(());
        }
        let mut entries = self.entries();
        if entries.len() > PRUNE_ABOVE {
            entries.retain(|_, entry| {
                let elapsed = now.saturating_duration_since(entry.1).as_secs_f64();
                entry.0 + elapsed * self.per_sec < self.capacity
            });
        }
        let entry = entries.entry(key).or_insert((self.capacity, now));
        let tokens = self.refilled(*entry, now);
        if tokens < 1.0 {
            *entry = (tokens, now);
            return Err(self.wait_for_one(tokens));
        }
        *entry = (tokens - 1.0, now);
        Ok(())
    }

    /// How long until `key` has a token again, when it has none now.
    pub(crate) fn empty_for(&self, key: K, now: Instant) -> Option<Duration> {
        if self.unlimited() {
            return None;
        }
        let entries = self.entries();
        let tokens = self.refilled(*entries.get(&key)?, now);
        (tokens < 1.0).then(|| self.wait_for_one(tokens))
    }
}

/// What a rate refusal says: which rate, and when to come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OverRate {
    /// `channel` or `tenant`.
    pub scope: &'static str,
    /// When a token is back.
    pub retry_after: Duration,
}

/// The node's rates.
#[derive(Debug)]
pub(crate) struct Throttles {
    conversations_per_channel: Buckets<Uuid>,
    conversations_per_tenant: Buckets<Uuid>,
    tokens_per_channel: Buckets<Uuid>,
    tokens_per_tenant: Buckets<Uuid>,
    admin_failures: Buckets<IpAddr>,
    /// When a failed admin authentication from an address was last logged.
    admin_logged: Mutex<HashMap<IpAddr, Instant>>,
}

fn count_limited(rate: &'static str) {
    metrics::counter!("converger_rate_limited_total", "rate" => rate).increment(1);
}

/// Failed admin authentications from one address are logged at most once per this.
const ADMIN_LOG_EVERY: Duration = Duration::from_secs(60);

impl Throttles {
    /// The rates of `rates` and `admin`.
    pub(crate) fn new(rates: &RatesConfig, admin: &AdminConfig) -> Throttles {
        Throttles {
            conversations_per_channel: Buckets::per_minute(
                rates.conversations_per_minute_per_channel,
            ),
            conversations_per_tenant: Buckets::per_minute(
                rates.conversations_per_minute_per_tenant,
            ),
            tokens_per_channel: Buckets::per_minute(rates.tokens_per_minute_per_channel),
            tokens_per_tenant: Buckets::per_minute(rates.tokens_per_minute_per_tenant),
            admin_failures: Buckets::new(admin.failures_burst, admin.failures_per_minute),
            admin_logged: Mutex::new(HashMap::new()),
        }
    }

    /// Counts a conversation about to be created in a channel of a tenant.
    pub(crate) fn conversation(&self, tenant_id: Uuid, channel_id: Uuid) -> Result<(), OverRate> {
        take_both(
            &self.conversations_per_channel,
            channel_id,
            &self.conversations_per_tenant,
            tenant_id,
        )
        .inspect_err(|_| count_limited("conversations"))
    }

    /// Counts a token about to be issued for a channel of a tenant.
    pub(crate) fn token(&self, tenant_id: Uuid, channel_id: Uuid) -> Result<(), OverRate> {
        take_both(
            &self.tokens_per_channel,
            channel_id,
            &self.tokens_per_tenant,
            tenant_id,
        )
        .inspect_err(|_| count_limited("tokens"))
    }

    /// When this address may try an admin credential again, when it may not now.
    pub(crate) fn admin_throttled(&self, address: IpAddr) -> Option<Duration> {
        self.admin_failures.empty_for(address, Instant::now())
    }

    /// Counts a failed admin authentication from `address`, logging it at most once a minute.
    pub(crate) fn admin_failed(&self, address: IpAddr, what: &'static str) {
        let now = Instant::now();
        let throttled = self.admin_failures.take(address, now).is_err();
        metrics::counter!("converger_admin_auth_failures_total").increment(1);
        let mut logged = self
            .admin_logged
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if logged.len() > PRUNE_ABOVE {
            logged.retain(|_, at| now.duration_since(*at) < ADMIN_LOG_EVERY);
        }
        let due = logged
            .get(&address)
            .is_none_or(|at| now.duration_since(*at) >= ADMIN_LOG_EVERY);
        if due {
            logged.insert(address, now);
            tracing::warn!(%address, what, throttled, "admin authentication failed");
        }
    }
}

/// Takes from the channel's bucket and then the tenant's; a refusal by the tenant gives the
/// channel's token back, so neither counts a creation that did not happen.
fn take_both(
    per_channel: &Buckets<Uuid>,
    channel_id: Uuid,
    per_tenant: &Buckets<Uuid>,
    tenant_id: Uuid,
) -> Result<(), OverRate> {
    let now = Instant::now();
    per_channel
        .take(channel_id, now)
        .map_err(|retry_after| OverRate {
            scope: "channel",
            retry_after,
        })?;
    if let Err(retry_after) = per_tenant.take(tenant_id, now) {
        per_channel.give_back(channel_id);
        return Err(OverRate {
            scope: "tenant",
            retry_after,
        });
    }
    Ok(())
}

impl<K: Hash + Eq + Copy> Buckets<K> {
    /// Returns a token taken for an action that did not happen.
    fn give_back(&self, key: K) {
        if self.unlimited() {
            return;
        }
        if let Some(entry) = self.entries().get_mut(&key) {
            entry.0 = (entry.0 + 1.0).min(self.capacity);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_holds_a_burst_then_refills_at_its_rate() {
        let buckets: Buckets<u8> = Buckets::new(3, 60);
        let start = Instant::now();
        for _ in 0..3 {
            assert!(buckets.take(1, start).is_ok());
        }
        let wait = buckets.take(1, start).unwrap_err();
        assert!(wait <= Duration::from_secs(1), "{wait:?}");
        assert!(buckets.empty_for(1, start).is_some());
        assert!(buckets.take(2, start).is_ok(), "keys are independent");
        assert!(buckets.take(1, start + Duration::from_secs(1)).is_ok());
    }

    #[test]
    fn zero_is_unlimited() {
        let buckets: Buckets<u8> = Buckets::per_minute(0);
        let now = Instant::now();
        for _ in 0..1_000 {
            assert!(buckets.take(1, now).is_ok());
        }
        assert_eq!(buckets.empty_for(1, now), None);
    }
}
