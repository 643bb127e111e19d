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
    /// A send under the `reject` turn policy while this turn is running: nothing was stored.
    #[error("turn {seq} is in progress")]
    TurnInProgress {
        /// The running turn's seq.
        seq: i64,
    },
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
    /// No writable database answered (it is down, or failing over), so this write did not
    /// commit, or its fate is unknown: the writer resends with its idempotency key later.
    #[error("database unavailable: {0}")]
    Unavailable(String),
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

    /// True when the database could not be reached, dropped the connection, or is read-only
    /// (a standby): the client may retry once a primary answers.
    pub fn is_unavailable(&self) -> bool {
        is_connection_failure(self)
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

/// SQLSTATEs of a server that went away or cannot take writes: connection exceptions (class
/// 08), an administrator's or a crash's shutdown, a server starting up or in recovery, and a
/// write sent to a read-only server.
const UNAVAILABLE_SQLSTATES: [&str; 4] = ["57P01", "57P02", "57P03", "25006"];

/// True when `error` says the database host failed, rather than the query.
pub(crate) fn is_connection_failure(error: &StoreError) -> bool {
    match error {
        StoreError::Timeout { .. } | StoreError::Unavailable(_) => true,
        StoreError::Database(error) => is_sqlx_connection_failure(error),
        _ => false,
    }
}

/// As [`is_connection_failure`], for a driver error.
pub(crate) fn is_sqlx_connection_failure(error: &sqlx::Error) -> bool {
    match error {
        // Not `Protocol`: the store raises it for its own broken invariants, which a retry
        // does not mend.
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(database) => database.code().is_some_and(|code| {
            code.starts_with("08") || UNAVAILABLE_SQLSTATES.contains(&code.as_ref())
        }),
        _ => false,
    }
}
