//! Group commit: the frames and answers of many sessions commit in one statement.
//!
//! Every commit calls `pg_notify`, and Postgres serialises notifying transactions on one lock
//! that it holds from just before the commit record until the WAL flush is done. One write per
//! transaction therefore caps a whole cluster at about one commit per disk flush (≈ 2 ms here),
//! however many connections it uses. Grouping writes pays that flush once per batch.
//!
//! Writes queue here; `commit_workers` tasks each take whatever is queued (at least one write, at
//! most [`MAX_BATCH`]) and commit it. There is no timer: an idle worker starts at once, so a
//! lone write waits for nothing, and under load the queue fills while the other workers' flushes
//! are in progress (ADR 0010). A batch, a lone write included, is one call of
//! `converger_commit_batch` (migration 20261130000005) as a statement of its own, so one round
//! trip commits it (ADR 0011).
//!
//! Architecture invariant: a batch's writes run in conversation order (stable for writes of one
//! conversation), so two batches lock conversations in the same order and cannot deadlock; and a
//! batch that fails with a database error runs once more with each write in a subtransaction of
//! its own (`converger_commit_batch_isolated`), so one bad write never fails another session's
//! and costs its batch one statement, not one per write.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;
use sqlx::pool::PoolConnection;
use sqlx::types::Json;
use sqlx::{PgConnection, PgPool, Postgres};
use tokio::sync::{Mutex, mpsc, oneshot};
use uuid::Uuid;

use crate::activities::{Activity, CommitOutcome, NewActivity, stored_extra, stored_id};
use crate::bus::BusEvent;
use crate::primary::Follower;
use crate::turns::{AnswerOutcome, AnswerRow, TurnAnswer, answer_outcome};
use crate::{StoreError, is_connection_failure, is_sqlx_connection_failure, within_deadline};

/// The operation name in metrics and timeouts.
const OPERATION: &str = "group_commit";

/// The operation name of waiting for a pooled connection.
const CONNECTION_OPERATION: &str = "group_commit_connection";

/// Writes in one transaction at most.
pub(crate) const MAX_BATCH: usize = 128;

/// Writes queued beyond this wait for room (backpressure on the sessions).
const QUEUE: usize = 4_096;

/// How long a worker waits for the queue before it takes the queue for idle: the worker that
/// holds it takes what is queued at once, and holds it longer only while nothing is queued.
const QUEUE_LOCK_WAIT: Duration = Duration::from_millis(2);

/// One write, its outcome once its statements ran, and where the outcome goes after commit.
#[expect(
    clippy::large_enum_variant,
    reason = "writes only pass through the queue; boxing would cost an allocation per write"
)]
enum Write {
    Activity {
        new: NewActivity,
        outcome: Option<Result<Option<CommitOutcome>, StoreError>>,
        done: oneshot::Sender<Result<Option<CommitOutcome>, StoreError>>,
    },
    Answer {
        answer: TurnAnswer,
        fingerprint: String,
        outcome: Option<Result<AnswerOutcome, StoreError>>,
        done: oneshot::Sender<Result<AnswerOutcome, StoreError>>,
    },
}

impl Write {
    fn conversation_id(&self) -> uuid::Uuid {
        match self {
            Write::Activity { new, .. } => new.conversation_id,
            Write::Answer { answer, .. } => answer.conversation_id,
        }
    }

    /// The write as an element of `converger_commit_batch`'s argument.
    fn batch_entry(&self) -> BatchEntry<'_> {
        match self {
            Write::Activity { new, .. } => BatchEntry::Frame {
                conversation: new.conversation_id,
                id: new.stored_id(),
                kind: &new.kind,
                sender_id: &new.sender.id,
                sender_role: new.sender.role.as_str(),
                data: &new.data,
                metadata: new.metadata.as_ref(),
                extra: new.stored_extra(),
                client_id: new.client_id.as_deref(),
                is_turn: new.is_turn(),
            },
            Write::Answer {
                answer,
                fingerprint,
                ..
            } => BatchEntry::Answer {
                conversation: answer.conversation_id,
                seq: answer.seq,
                revision: answer.revision,
                fence: answer.fence,
                fingerprint,
                sender_id: &answer.sender.id,
                sender_role: answer.sender.role.as_str(),
                has_runtime: answer.runtime.is_some(),
                runtime_version: answer.runtime.as_ref().map_or(0, |runtime| runtime.version),
                runtime_state: answer.runtime.as_ref().map(|runtime| &runtime.state),
                frames: answer
                    .frames
                    .iter()
                    .map(|frame| BatchFrame {
                        id: stored_id(frame.id.as_ref()),
                        kind: &frame.kind,
                        data: &frame.data,
                        metadata: frame.metadata.as_ref(),
                        extra: stored_extra(&frame.extra),
                    })
                    .collect(),
            },
        }
    }

    /// Keeps the write's element of the batch function's result until the commit: its outcome,
    /// or (isolated batches only) the database's refusal of this write alone. The element is
    /// read straight into its types, never through a `Value` tree.
    fn keep_batch_outcome(&mut self, element: &RawValue) -> Result<(), sqlx::Error> {
        let decode_error = |error: serde_json::Error| sqlx::Error::Decode(Box::new(error));
        let text = element.get();
        // A missing or closed conversation's frame is `null`; anything else is an object.
        let head: Option<ElementHead> = serde_json::from_str(text).map_err(decode_error)?;
        let (refused, duplicate) = match head {
            Some(ElementHead {
                failed: Some(failed),
                ..
            }) => (Some(failed.into_error()), false),
            Some(ElementHead { duplicate, .. }) => (None, duplicate),
            None => (None, false),
        };
        match self {
            Write::Activity { outcome, .. } => {
                *outcome = Some(match refused {
                    Some(error) => Err(error),
                    None => {
                        let activity: Option<Activity> =
                            serde_json::from_str(text).map_err(decode_error)?;
                        Ok(activity.map(|activity| CommitOutcome {
                            activity,
                            duplicate,
                        }))
                    }
                });
            }
            Write::Answer {
                answer, outcome, ..
            } => {
                *outcome = Some(match refused {
                    Some(error) => Err(error),
                    None => {
                        let row: AnswerRow = serde_json::from_str(text).map_err(decode_error)?;
                        Ok(answer_outcome(answer, row)?)
                    }
                });
            }
        }
        Ok(())
    }

    /// The frames this write stored (none for a duplicate, a refusal or an answer that did not
    /// commit), once its statements ran.
    fn stored_frames(&self) -> &[Activity] {
        match self {
            Write::Activity {
                outcome: Some(Ok(Some(outcome))),
                ..
            } if !outcome.duplicate => std::slice::from_ref(&outcome.activity),
            Write::Answer {
                outcome: Some(Ok(AnswerOutcome::Committed { activities, .. })),
                ..
            } => activities,
            _ => &[],
        }
    }

    /// Hands the kept outcome to the writer (the transaction committed).
    fn committed(self) {
        match self {
            Write::Activity { outcome, done, .. } => {
                let _ = done.send(outcome.unwrap_or_else(|| Err(never_ran())));
            }
            Write::Answer { outcome, done, .. } => {
                let _ = done.send(outcome.unwrap_or_else(|| Err(never_ran())));
            }
        }
    }

    /// Hands `error` to the writer.
    fn failed(self, error: StoreError) {
        match self {
            Write::Activity { done, .. } => {
                let _ = done.send(Err(error));
            }
            Write::Answer { done, .. } => {
                let _ = done.send(Err(error));
            }
        }
    }
}

/// What is read of an outcome element before its type: the refusal an isolated batch reports
/// for one write (`{"failed": {"sqlstate", "message"}}`), and a frame's `duplicate` flag. One
/// pass that skips the rest of the object: cheaper than `#[serde(flatten)]`, which buffers it.
#[derive(Deserialize)]
struct ElementHead {
    failed: Option<Failed>,
    #[serde(default)]
    duplicate: bool,
}

/// A write the database refused.
#[derive(Deserialize)]
struct Failed {
    #[serde(default)]
    sqlstate: String,
    #[serde(default)]
    message: String,
}

impl Failed {
    fn into_error(self) -> StoreError {
        StoreError::Refused {
            sqlstate: self.sqlstate,
            message: self.message,
        }
    }
}

/// A committed write always ran its statements first; this error would name the bug.
fn never_ran() -> StoreError {
    StoreError::GroupCommit("write committed without running".into())
}

/// Where a node's committed batches go on that node, at once, before any writer hears its
/// outcome: the node's own notifications then carry its id and it skips them undecoded.
#[derive(Debug)]
pub(crate) struct LocalCommits {
    /// The node id the batch statements name (`converger.node`).
    pub(crate) node: String,
    /// The node's bus events, where the listener's events go too.
    pub(crate) events: mpsc::UnboundedSender<BusEvent>,
}

/// Set once, when the node's bus listener starts; shared by every worker and store clone.
pub(crate) type LocalCommitsCell = Arc<OnceLock<LocalCommits>>;

/// The queue in front of the committing workers; cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct GroupCommit {
    queue: mpsc::Sender<Write>,
    deadline: Duration,
    local: LocalCommitsCell,
}

impl GroupCommit {
    /// Starts the workers on `pool`; they stop when the last handle is dropped.
    /// `workers` batches are in progress at once: while one waits for its flush, another runs
    /// its statement (`database.commit_workers`, chosen by measurement in ADR 0020).
    pub(crate) fn start(
        pool: PgPool,
        deadline: Duration,
        workers: usize,
        follower: Follower,
    ) -> GroupCommit {
        let (queue, receiver) = mpsc::channel(QUEUE);
        let receiver = Arc::new(Mutex::new(receiver));
        let local = LocalCommitsCell::default();
        for _ in 0..workers {
            let batches = Batches {
                pool: pool.clone(),
                deadline,
                local: Arc::clone(&local),
                kept: None,
                follower: follower.clone(),
            };
            tokio::spawn(work(batches, Arc::clone(&receiver)));
        }
        GroupCommit {
            queue,
            deadline,
            local,
        }
    }

    /// From now on, every committed batch goes to `local` first; false when a node was set
    /// before (the first stays).
    pub(crate) fn announce_locally(&self, local: LocalCommits) -> bool {
        self.local.set(local).is_ok()
    }

    /// Commits a frame; `None` when its conversation is missing or closed.
    pub(crate) async fn activity(
        &self,
        new: NewActivity,
    ) -> Result<Option<CommitOutcome>, StoreError> {
        let (done, outcome) = oneshot::channel();
        self.submit(
            Write::Activity {
                new,
                outcome: None,
                done,
            },
            outcome,
        )
        .await
    }

    /// Commits an answer to a turn.
    pub(crate) async fn answer(
        &self,
        answer: TurnAnswer,
        fingerprint: String,
    ) -> Result<AnswerOutcome, StoreError> {
        let (done, outcome) = oneshot::channel();
        self.submit(
            Write::Answer {
                answer,
                fingerprint,
                outcome: None,
                done,
            },
            outcome,
        )
        .await
    }

    async fn submit<T>(
        &self,
        write: Write,
        outcome: oneshot::Receiver<Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let operation = OPERATION;
        // Queueing and the batch each have their own deadline, so a caller waits at most twice.
        let queued = tokio::time::timeout(self.deadline, self.queue.send(write)).await;
        match queued {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(StoreError::Database(sqlx::Error::PoolClosed)),
            Err(_) => return Err(StoreError::Timeout { operation }),
        }
        match tokio::time::timeout(self.deadline * 2, outcome).await {
            Ok(Ok(result)) => result,
            // The worker went away with the write (the store is shutting down).
            Ok(Err(_)) => Err(StoreError::Database(sqlx::Error::PoolClosed)),
            Err(_) => Err(StoreError::Timeout { operation }),
        }
    }
}

/// What a worker commits with.
struct Batches {
    pool: PgPool,
    deadline: Duration,
    local: LocalCommitsCell,
    /// The connection of the last batch, kept while writes are queued: the pool checks every
    /// connection it hands out with a round trip (`test_before_acquire`), which a busy worker
    /// would otherwise pay once per batch.
    /// With the pool's move count when it was taken: a connection from before a move is
    /// given up.
    kept: Option<(PoolConnection<Postgres>, u64)>,
    /// Told when the database host fails, so the pool can move to the writable one.
    follower: Follower,
}

/// One worker: takes what is queued and commits it as one transaction, until the queue closes.
async fn work(mut batches: Batches, receiver: Arc<Mutex<mpsc::Receiver<Write>>>) {
    loop {
        let mut batch = Vec::new();
        {
            let mut receiver = match tokio::time::timeout(QUEUE_LOCK_WAIT, receiver.lock()).await {
                Ok(receiver) => receiver,
                // Another worker holds the queue while it waits for writes: nothing is queued.
                Err(_) => {
                    batches.kept = None;
                    receiver.lock().await
                }
            };
            if receiver.is_empty() {
                // Idle: the connection goes back to the pool (which checks it when it hands it
                // out again), so a closing pool never waits for a worker that waits for writes.
                batches.kept = None;
            }
            if receiver.recv_many(&mut batch, MAX_BATCH).await == 0 {
                return;
            }
        }
        metrics::histogram!("converger_group_commit_writes").record(batch.len() as f64);
        batches.commit(batch).await;
    }
}

impl Batches {
    /// Runs `statement` over `batch` on the kept connection or one from the pool, and keeps the
    /// connection when the batch committed. After any failure the connection goes back to the
    /// pool (before a retry asks it for another), which checks it before it is used again.
    /// `Err` when no connection came in time.
    async fn run(
        &mut self,
        batch: &mut [Write],
        statement: &'static str,
    ) -> Result<Option<Result<(), BatchError>>, StoreError> {
        let moves = self.follower.moves();
        let mut connection = match self.kept.take() {
            Some((connection, taken_at)) if taken_at == moves => connection,
            _ => match connection(&self.pool, self.deadline).await {
                Ok(connection) => connection,
                Err(error) => {
                    self.follower.saw(&error);
                    return Err(error);
                }
            },
        };
        let node = self.local.get().map_or("", |local| local.node.as_str());
        let attempt = within_deadline(
            self.deadline,
            OPERATION,
            run_batch(&mut connection, batch, statement, node),
        )
        .await;
        match &attempt {
            Some(Ok(())) => self.kept = Some((connection, moves)),
            Some(Err(BatchError::Statement(error) | BatchError::Commit(error))) => {
                if is_sqlx_connection_failure(error) {
                    self.follower.host_failed();
                }
            }
            None => self.follower.host_failed(),
        }
        Ok(attempt)
    }

    /// Hands what `batch` stored to this node (the transaction committed), then each write's
    /// outcome to its writer.
    fn committed(&self, batch: Vec<Write>) {
        if let Some(local) = self.local.get() {
            for event in local_events(&batch) {
                let _ = local.events.send(event);
            }
        }
        batch.into_iter().for_each(Write::committed);
    }

    /// Commits `batch` as one statement; when the database refuses it, commits each write
    /// alone.
    async fn commit(&mut self, mut batch: Vec<Write>) {
        if batch.len() == 1 {
            if let Some(write) = batch.pop() {
                self.commit_alone(write).await;
            }
            return;
        }
        batch.sort_by_key(Write::conversation_id);
        match self.run(&mut batch, BATCH).await {
            Err(error) => fail_all(batch, &error),
            Ok(Some(Ok(()))) => self.committed(batch),
            // A statement failed (a racing idempotency key, say): nothing of the batch is
            // stored, so the batch runs once more with each write isolated, and each gets its
            // own outcome.
            Ok(Some(Err(BatchError::Statement(error)))) => {
                tracing::debug!(%error, writes = batch.len(), "batch refused; committing it again with each write isolated");
                self.commit_isolated(batch).await;
            }
            // Whether the batch landed is unknown, so every writer hears the error and resends
            // with its idempotency key.
            Ok(Some(Err(BatchError::Commit(error)))) => {
                fail_all(batch, &StoreError::Database(error));
            }
            // The server stopped answering: the fate is unknown too.
            Ok(None) => batch
                .into_iter()
                .for_each(|write| write.failed(timed_out())),
        }
    }

    /// Commits a refused batch again with each write in a subtransaction of its own: the
    /// writes the database accepts commit together, each refused one gets its own error.
    async fn commit_isolated(&mut self, mut batch: Vec<Write>) {
        metrics::counter!("converger_group_commit_isolated_total").increment(1);
        match self.run(&mut batch, ISOLATED_BATCH).await {
            Err(error) => fail_all(batch, &error),
            Ok(Some(Ok(()))) => self.committed(batch),
            Ok(Some(Err(BatchError::Statement(error) | BatchError::Commit(error)))) => {
                fail_all(batch, &StoreError::Database(error));
            }
            Ok(None) => batch
                .into_iter()
                .for_each(|write| write.failed(timed_out())),
        }
    }

    /// Commits one write as a statement of its own; the writer gets its own error (a unique
    /// violation is answered as a duplicate).
    async fn commit_alone(&mut self, mut write: Write) {
        match self.run(std::slice::from_mut(&mut write), BATCH).await {
            Err(error) => write.failed(error),
            Ok(Some(Ok(()))) => self.committed(vec![write]),
            Ok(Some(Err(BatchError::Statement(error) | BatchError::Commit(error)))) => {
                write.failed(StoreError::Database(error));
            }
            Ok(None) => write.failed(timed_out()),
        }
    }
}

/// Every writer of `batch` hears that it did not commit, or that its fate is unknown:
/// `unavailable` when the database host failed rather than the batch.
fn fail_all(batch: Vec<Write>, error: &StoreError) {
    let unavailable = is_connection_failure(error);
    let message = error.to_string();
    for write in batch {
        let error = if unavailable {
            StoreError::Unavailable(message.clone())
        } else {
            StoreError::GroupCommit(message.clone())
        };
        write.failed(error);
    }
}

/// What a committed batch stored, as this node's bus events: one per run of consecutive seqs of
/// one conversation (the batch runs in conversation order, frames before answers), the frames
/// attached, the channel left to the receiver.
fn local_events(batch: &[Write]) -> Vec<BusEvent> {
    let mut events: Vec<BusEvent> = Vec::new();
    for frame in batch.iter().flat_map(Write::stored_frames) {
        if let Some(BusEvent::Committed {
            conversation_id,
            seq,
            frames,
            ..
        }) = events.last_mut()
            && *conversation_id == frame.conversation_id
            && *seq + 1 == frame.seq
        {
            *seq = frame.seq;
            frames.push(frame.clone());
            continue;
        }
        events.push(BusEvent::Committed {
            conversation_id: frame.conversation_id,
            first_seq: frame.seq,
            seq: frame.seq,
            channel_id: None,
            frames: vec![frame.clone()],
        });
    }
    events
}

/// A pooled connection, waited for under its own deadline. The statement then gets a whole
/// deadline of its own, which the server's `statement_timeout` undercuts: a statement that runs
/// too long is cancelled by the server (rolled back, reported as a database error) before the
/// client stops waiting, so the client gives up, with the fate unknown, only on a server that
/// stopped answering.
async fn connection(
    pool: &PgPool,
    deadline: Duration,
) -> Result<PoolConnection<Postgres>, StoreError> {
    match within_deadline(deadline, CONNECTION_OPERATION, pool.acquire()).await {
        Some(Ok(connection)) => Ok(connection),
        Some(Err(error)) => Err(StoreError::Database(error)),
        None => Err(StoreError::Timeout {
            operation: CONNECTION_OPERATION,
        }),
    }
}

fn timed_out() -> StoreError {
    StoreError::Timeout {
        operation: OPERATION,
    }
}

/// One write as `converger_commit_batch` reads it; `None` fields are left out (SQL `NULL`).
#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum BatchEntry<'a> {
    Frame {
        conversation: Uuid,
        id: String,
        #[serde(rename = "type")]
        kind: &'a str,
        sender_id: &'a str,
        sender_role: &'a str,
        data: &'a Value,
        #[serde(skip_serializing_if = "Option::is_none")]
        metadata: Option<&'a Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        extra: Option<Value>,
        #[serde(skip_serializing_if = "Option::is_none")]
        client_id: Option<&'a str>,
        is_turn: bool,
    },
    Answer {
        conversation: Uuid,
        seq: i64,
        revision: i32,
        #[serde(skip_serializing_if = "Option::is_none")]
        fence: Option<i64>,
        fingerprint: &'a str,
        sender_id: &'a str,
        sender_role: &'a str,
        has_runtime: bool,
        runtime_version: i64,
        #[serde(skip_serializing_if = "Option::is_none")]
        runtime_state: Option<&'a Value>,
        frames: Vec<BatchFrame<'a>>,
    },
}

/// One frame of an answer in a batch.
#[derive(Serialize)]
struct BatchFrame<'a> {
    id: String,
    #[serde(rename = "type")]
    kind: &'a str,
    data: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata: Option<&'a Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    extra: Option<Value>,
}

/// Why a batch did not commit.
enum BatchError {
    /// The database refused the statement: nothing of it was stored.
    Statement(sqlx::Error),
    /// The connection failed, or the outcome could not be read: its fate may be unknown.
    Commit(sqlx::Error),
}

impl BatchError {
    /// A statement runs as its own transaction, so an error the server reports means it rolled
    /// back; anything else (a lost connection, say) leaves its fate unknown.
    fn classify(error: sqlx::Error) -> BatchError {
        match error {
            sqlx::Error::Database(_) => BatchError::Statement(error),
            other => BatchError::Commit(other),
        }
    }
}

/// The batch statement, naming the committing node (`$2`) for its notifications. The setting is
/// made in a `FROM` subquery, which runs before the batch function: Postgres does not pull a
/// subquery with a volatile function into its parent.
const BATCH: &str = "SELECT converger_commit_batch($1) \
     FROM (SELECT set_config('converger.node', $2, true)) AS node";

/// The batch statement with each write in a subtransaction of its own (after `BATCH` failed).
const ISOLATED_BATCH: &str = "SELECT converger_commit_batch_isolated($1) \
     FROM (SELECT set_config('converger.node', $2, true)) AS node";

/// Commits one frame with `converger_commit_batch` in the caller's transaction (a send under
/// a turn policy, `turns/policies.rs`). Its notification names no node, so every node, this one
/// too, hears it from the bus.
pub(crate) async fn frame_in_transaction(
    connection: &mut PgConnection,
    new: NewActivity,
) -> Result<Result<Option<CommitOutcome>, StoreError>, sqlx::Error> {
    let (done, _) = oneshot::channel();
    let mut write = Write::Activity {
        new,
        outcome: None,
        done,
    };
    let Json(outcomes): Json<Vec<Box<RawValue>>> =
        sqlx::query_scalar("SELECT converger_commit_batch($1)")
            .bind(Json([write.batch_entry()]))
            .fetch_one(&mut *connection)
            .await?;
    let Some(element) = outcomes.first() else {
        return Err(sqlx::Error::Protocol(
            "converger_commit_batch returned no outcome".into(),
        ));
    };
    write.keep_batch_outcome(element)?;
    match write {
        Write::Activity { outcome, .. } => Ok(outcome.unwrap_or_else(|| Err(never_ran()))),
        Write::Answer { .. } => Err(sqlx::Error::Protocol(
            "a frame write became an answer".into(),
        )),
    }
}

/// Runs `statement` over the batch and keeps each write's outcome.
async fn run_batch(
    connection: &mut PgConnection,
    batch: &mut [Write],
    statement: &'static str,
    node: &str,
) -> Result<(), BatchError> {
    let entries: Vec<BatchEntry<'_>> = batch.iter().map(Write::batch_entry).collect();
    let Json(outcomes): Json<Vec<Box<RawValue>>> = sqlx::query_scalar(statement)
        .bind(Json(&entries))
        .bind(node)
        .fetch_one(&mut *connection)
        .await
        .map_err(BatchError::classify)?;
    if outcomes.len() != batch.len() {
        return Err(BatchError::Commit(sqlx::Error::Protocol(format!(
            "converger_commit_batch returned {} outcomes for {} writes",
            outcomes.len(),
            batch.len()
        ))));
    }
    for (write, outcome) in batch.iter_mut().zip(outcomes) {
        write
            .keep_batch_outcome(&outcome)
            .map_err(BatchError::Commit)?;
    }
    Ok(())
}
