//! The node's connection cap kept below its file-descriptor limit: a node at the limit can
//! accept nothing, not even a health check, so the cap must bite first.

use converger_gateway::Config;

/// Descriptors kept free for what is not an admitted client connection: connections being
/// answered 503 (at most 128 at once), the database pool, gossip, the embedded database's
/// pipes, log files and the listener itself.
const RESERVED_BEYOND_POOL: u64 = 256;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, then lowers `http.max_connections` (0 means
/// no cap) to fit below it with [`RESERVED_BEYOND_POOL`] plus the pool's connections free.
pub fn fit_connection_cap(config: &mut Config) {
    let limit = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(error) => {
            tracing::warn!(%error, "file-descriptor limit not read; http.max_connections kept as configured");
            return;
        }
    };
    let reserved = RESERVED_BEYOND_POOL + u64::from(config.database.max_connections);
    let fitting = usize::try_from(limit.saturating_sub(reserved).max(1)).unwrap_or(usize::MAX);
    let configured = config.http.max_connections;
    if configured != 0 && configured <= fitting {
        tracing::debug!(
            limit,
            max_connections = configured,
            "connection cap fits the descriptor limit"
        );
        return;
    }
    tracing::warn!(
        descriptor_limit = limit,
        configured,
        max_connections = fitting,
        "http.max_connections lowered to stay below the file-descriptor limit"
    );
    config.http.max_connections = fitting;
}
