//! The store's error type.

/// Everything a store call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or failed the query.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A migration could not be applied.
    #[error("migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    /// The query did not finish before its deadline.
    #[error("database operation {operation} timed out")]
    Timeout {
        /// Name of the timed-out operation.
        operation: &'static str,
    },
    /// The options given to the store are unusable.
    #[error("{0}")]
    Config(String),
    /// The conversation does not exist.
    #[error("conversation not found")]
    ConversationNotFound,
    /// The conversation exists but accepts no more frames.
    #[error("conversation closed")]
    ConversationClosed,
    /// The tenant does not exist.
    #[error("tenant not found")]
    TenantNotFound,
    /// The channel does not exist.
    #[error("channel not found")]
    ChannelNotFound,
    /// The shared transaction this write was part of failed; its fate may be unknown, so the
    /// writer resends with its idempotency key.
    #[error("group commit failed: {0}")]
    GroupCommit(String),
    /// A test switched a failpoint on here (`failpoints` builds only).
    #[error("fault injected at {0}")]
    Injected(&'static str),
}

impl StoreError {
    /// True for a unique-constraint violation, which callers turn into an idempotent answer.
    pub(crate) fn is_unique_violation(&self) -> bool {
        match self {
            StoreError::Database(sqlx::Error::Database(db)) => db.is_unique_violation(),
            _ => false,
        }
    }
}
