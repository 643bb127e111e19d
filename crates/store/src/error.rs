//! The store's error type.

/// SQLSTATE of a unique-constraint violation.
const UNIQUE_VIOLATION: &str = "23505";

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
    /// The database refused this write alone; the rest of its batch committed without it.
    #[error("database refused the write ({sqlstate}): {message}")]
    Refused {
        /// The SQLSTATE of the refusal.
        sqlstate: String,
        /// The database's message.
        message: String,
    },
    /// A test switched a failpoint on here (`failpoints` builds only).
    #[error("fault injected at {0}")]
    Injected(&'static str),
}

impl StoreError {
    /// A write holding a NUL character, refused before it reaches the database (SQLSTATE
    /// 22P05, what Postgres would answer).
    pub(crate) fn unstorable() -> StoreError {
        StoreError::Refused {
            sqlstate: "22P05".into(),
            message: converger_protocol::NUL_REFUSED.into(),
        }
    }

    /// True for a unique-constraint violation, which callers turn into an idempotent answer.
    pub(crate) fn is_unique_violation(&self) -> bool {
        match self {
            StoreError::Database(sqlx::Error::Database(db)) => db.is_unique_violation(),
            StoreError::Refused { sqlstate, .. } => sqlstate == UNIQUE_VIOLATION,
            _ => false,
        }
    }

    /// True when the database refused the write for what it holds (a data exception or a
    /// program limit: SQLSTATE classes 22 and 54): sending it again cannot succeed.
    pub fn is_refused_input(&self) -> bool {
        let sqlstate = match self {
            StoreError::Refused { sqlstate, .. } => sqlstate.as_str(),
            StoreError::Database(sqlx::Error::Database(db)) => match db.code() {
                Some(code) => return code.starts_with("22") || code.starts_with("54"),
                None => return false,
            },
            _ => return false,
        };
        sqlstate.starts_with("22") || sqlstate.starts_with("54")
    }
}
