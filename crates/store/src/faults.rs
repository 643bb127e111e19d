//! Fault injection for tests (cargo feature `failpoints`; release builds leave it off). Named
//! points in the commit path, the event bus and the sessions fire when a test switches them on
//! with `fail::cfg`, or, in a node process, through the `FAILPOINTS` environment variable
//! (`FAILPOINTS="ack_send_drop=1*return"`, read at start).

/// The user frame's commit fails before it is sent to the database (nothing stored).
pub const BEFORE_COMMIT: &str = "before_commit";
/// The frame is committed (and the database notifies the other nodes), then the session stops
/// as if its node died: no dispatch on this node, no ack.
pub const AFTER_COMMIT_BEFORE_NOTIFY: &str = "after_commit_before_notify";
/// The event bus loses its LISTEN connection for half a second (notifications of that window
/// are gone; the catch-up must cover them).
pub const LISTENER_DROP: &str = "listener_drop";
/// The frame is committed and dispatched, but its ack is never sent.
pub const ACK_SEND_DROP: &str = "ack_send_drop";
/// Reading frames back (`Store::list_activities`) fails before it reaches the database.
pub const LIST_ACTIVITIES: &str = "list_activities";
/// An agent connection's lookup of the channel of a conversation it addresses fails before it
/// reaches the database (a conversation whose turn it was handed needs no lookup).
pub const AGENT_CONVERSATION_LOOKUP: &str = "agent_conversation_lookup";

/// True when the named point fires now; always false without the `failpoints` feature.
pub fn injected(name: &str) -> bool {
    if !cfg!(feature = "failpoints") {
        return false;
    }
    fail::eval(name, |_| ()).is_some()
}

/// In a node process: switches on the points listed in `FAILPOINTS` for the process's life.
pub fn setup_from_env() {
    if !cfg!(feature = "failpoints") || std::env::var_os("FAILPOINTS").is_none() {
        return;
    }
    let scenario = fail::FailScenario::setup();
    // The scenario would switch the points off when dropped; a node keeps them to the end.
    std::mem::forget(scenario);
    tracing::warn!(failpoints = ?fail::list(), "fault injection is on");
}
