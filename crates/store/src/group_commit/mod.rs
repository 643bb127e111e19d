//! Group commit: the frames and answers of many sessions commit in one transaction.
//!
//! Every commit calls `pg_notify`, and Postgres serialises notifying transactions on one lock
//! that it holds from just before the commit record until the WAL flush is done. One write per
//! transaction therefore caps a whole cluster at about one commit per disk flush (≈ 2 ms here),
//! however many connections it uses. Grouping writes pays that flush once per batch.
//!
//! Writes queue here; `commit_workers` tasks each take whatever is queued (at least one write, at
//! most [`MAX_BATCH`]) and commit it. There is no timer: a worker starts at once when no batch is
//! in flight, so a lone write waits for nothing, and under load the queue fills while the other
//! workers' flushes are in progress (ADR 0010). Beside a batch in flight, a worker starts only
//! once [`OVERLAP_AFTER_WRITES`] writes wait or [`OVERLAP_WAIT_AT_MOST`] passed; fewer join the
//! next batch (ADR 0042). A batch, a lone write included, is one transaction of plain
//! statements (`statements`), whose outcomes are decided in Rust (`decide`, ADR 0037).
//!
//! Architecture invariant: a batch locks its conversations in id order, so two batches cannot
//! deadlock; and a batch that fails with a database error commits again write by write, so one
//! bad write never fails another session's.

mod decide;
mod statements;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres};
use tokio::sync::{Mutex, mpsc, oneshot, watch};

use crate::activities::{CommitOutcome, NewActivity};
use crate::bus::BusEvent;
use crate::primary::Follower;
use crate::turns::{AnswerOutcome, TurnAnswer};
use crate::{StoreError, is_connection_failure, is_sqlx_connection_failure, within_deadline};
use decide::{Decided, Plan, Request};
use statements::{Keys, Written};

/// The operation name in metrics and timeouts.
const OPERATION: &str = "group_commit";

/// The operation name of waiting for a pooled connection.
const CONNECTION_OPERATION: &str = "group_commit_connection";

/// Writes in one transaction at most.
pub(crate) const MAX_BATCH: usize = 128;

/// Writes that must be waiting before a worker starts a batch beside one in flight; fewer wait
/// for that batch to finish and join the next (ADR 0042).
const OVERLAP_AFTER_WRITES: usize = 32;

/// How long writes beside a batch in flight wait for it at most: a batch stuck on a row lock
/// (another transaction holds a conversation) holds up the writes of other conversations no
/// longer than this (ADR 0042). A batch commits in a few ms here.
const OVERLAP_WAIT_AT_MOST: Duration = Duration::from_millis(25);

/// Writes queued beyond this wait for room (backpressure on the sessions).
const QUEUE: usize = 4_096;

/// How long a worker keeps its connection while no write is queued for it. Between two batches
/// under load the queue is often empty for a moment; a connection given back to the pool then
/// costs the next batch the pool's check, one round trip more. An idle worker gives it back
/// after waiting this long for the queue or, holding the queue, this long for a write: a
/// closing pool waits at most twice this for it.
const KEEP_WHILE_IDLE: Duration = Duration::from_millis(50);

/// One write and where its outcome goes after commit.
enum Write {
    Activity {
        new: NewActivity,
        done: oneshot::Sender<Result<Option<CommitOutcome>, StoreError>>,
    },
    Answer {
        answer: TurnAnswer,
        fingerprint: String,
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

    fn request(&self) -> Request<'_> {
        match self {
            Write::Activity { new, .. } => Request::Frame(new),
            Write::Answer {
                answer,
                fingerprint,
                ..
            } => Request::Answer {
                answer,
                fingerprint,
            },
        }
    }

    /// Hands the write's decided outcome to the writer (the transaction committed).
    fn committed(self, decided: Decided) {
        match (self, decided) {
            (Write::Activity { done, .. }, Decided::Frame(outcome)) => {
                let _ = done.send(Ok(outcome));
            }
            (Write::Answer { done, .. }, Decided::Answer(outcome)) => {
                let _ = done.send(Ok(outcome));
            }
            (write, _) => write.failed(StoreError::GroupCommit(
                "a write's outcome is of another kind".into(),
            )),
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
    /// its statements (`database.commit_workers`, chosen by measurement in ADR 0020). With
    /// `notify`, each batch announces itself with `pg_notify` (the `postgres` bus).
    pub(crate) fn start(
        pool: PgPool,
        deadline: Duration,
        workers: usize,
        follower: Follower,
        notify: bool,
    ) -> GroupCommit {
        let (queue, receiver) = mpsc::channel(QUEUE);
        let receiver = Arc::new(Mutex::new(receiver));
        let local = LocalCommitsCell::default();
        let in_flight = Arc::new(watch::Sender::new(0));
        for _ in 0..workers {
            let batches = Batches {
                pool: pool.clone(),
                deadline,
                local: Arc::clone(&local),
                kept: None,
                follower: follower.clone(),
                notify,
            };
            tokio::spawn(work(batches, Arc::clone(&receiver), Arc::clone(&in_flight)));
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
        self.submit(Write::Activity { new, done }, outcome).await
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
    /// Whether batches announce themselves with `pg_notify`.
    notify: bool,
}

/// One worker: takes what is queued and commits it as one transaction, until the queue closes.
/// `in_flight` counts the workers' batches being committed.
async fn work(
    mut batches: Batches,
    receiver: Arc<Mutex<mpsc::Receiver<Write>>>,
    in_flight: Arc<watch::Sender<usize>>,
) {
    loop {
        let mut batch = Vec::new();
        let _committing = {
            // The worker that holds the queue takes what is queued at once, and holds it longer
            // only while nothing is queued.
            let mut receiver = match tokio::time::timeout(KEEP_WHILE_IDLE, receiver.lock()).await {
                Ok(receiver) => receiver,
                Err(_) => {
                    batches.kept = None;
                    receiver.lock().await
                }
            };
            // `recv_many` is cancel safe: a timed-out wait took nothing from the queue.
            let received = match tokio::time::timeout(
                KEEP_WHILE_IDLE,
                receiver.recv_many(&mut batch, MAX_BATCH),
            )
            .await
            {
                Ok(received) => received,
                Err(_) => {
                    // Idle: the connection goes back to the pool (which checks it when it hands
                    // it out again), so a closing pool never waits for a worker that waits.
                    batches.kept = None;
                    receiver.recv_many(&mut batch, MAX_BATCH).await
                }
            };
            if received == 0 {
                return;
            }
            join_the_next_batch(&mut receiver, &mut batch, &in_flight).await;
            // Counted before the queue is let go, so the next worker sees this batch.
            InFlight::count(&in_flight)
        };
        metrics::histogram!("converger_group_commit_writes").record(batch.len() as f64);
        batches.commit(batch).await;
    }
}

/// Beside a batch in flight, the writes taken wait for it to finish (at most
/// [`OVERLAP_WAIT_AT_MOST`]), taking what arrives meanwhile, unless [`OVERLAP_AFTER_WRITES`]
/// writes are taken: one flush for many writes costs less
/// Postgres and gateway CPU than two flushes for half as many each, and the batch in flight
/// holds the flush the waiting writes would otherwise pay for alone (ADR 0042). A closed queue
/// ends the wait; what was taken is still committed.
async fn join_the_next_batch(
    receiver: &mut mpsc::Receiver<Write>,
    batch: &mut Vec<Write>,
    in_flight: &watch::Sender<usize>,
) {
    let mut committing = in_flight.subscribe();
    let waited_enough = tokio::time::sleep(OVERLAP_WAIT_AT_MOST);
    tokio::pin!(waited_enough);
    while *committing.borrow_and_update() > 0 && batch.len() < OVERLAP_AFTER_WRITES {
        tokio::select! {
            () = &mut waited_enough => return,
            changed = committing.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            // Cancel safe: a wait that ends because the batch in flight finished took nothing.
            received = receiver.recv_many(batch, MAX_BATCH - batch.len()) => {
                if received == 0 {
                    return;
                }
            }
        }
    }
}

/// One batch being committed, counted while it lives.
struct InFlight<'a>(&'a watch::Sender<usize>);

impl<'a> InFlight<'a> {
    fn count(in_flight: &'a watch::Sender<usize>) -> InFlight<'a> {
        in_flight.send_modify(|batches| *batches += 1);
        InFlight(in_flight)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|batches| *batches -= 1);
    }
}

impl Batches {
    /// Runs `batch` as one transaction on the kept connection or one from the pool, and keeps
    /// the connection when it committed. After any failure the connection goes back to the
    /// pool (before a retry asks it for another), which checks it before it is used again.
    /// `Err` when no connection came in time; `Ok(None)` when the server stopped answering.
    async fn run(
        &mut self,
        batch: &[Write],
    ) -> Result<Option<Result<Plan, BatchError>>, StoreError> {
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
        let node = match (self.notify, self.local.get()) {
            (false, _) => None,
            (true, Some(local)) => Some(local.node.as_str()),
            (true, None) => Some(""),
        };
        let requests: Vec<Request<'_>> = batch.iter().map(Write::request).collect();
        let attempt = within_deadline(
            self.deadline,
            OPERATION,
            commit_transaction(&mut connection, &requests, node),
        )
        .await;
        match &attempt {
            Some(Ok(_)) => self.kept = Some((connection, moves)),
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
    fn committed(&self, batch: Vec<Write>, plan: Plan) {
        if let Some(local) = self.local.get() {
            for event in plan.events {
                let _ = local.events.send(event);
            }
        }
        for (write, decided) in batch.into_iter().zip(plan.outcomes) {
            write.committed(decided);
        }
    }

    /// Commits `batch` as one transaction; when the database refuses it, commits each write
    /// alone.
    async fn commit(&mut self, mut batch: Vec<Write>) {
        // Conversation order (stable within a conversation): the locks are taken in this order.
        batch.sort_by_key(Write::conversation_id);
        match self.run(&batch).await {
            Err(error) => fail_all(batch, &error),
            Ok(Some(Ok(plan))) => self.committed(batch, plan),
            // A statement failed (a value a column cannot hold, say): nothing of the batch is
            // stored, so each write commits alone, and gets its own outcome.
            Ok(Some(Err(BatchError::Statement(error)))) if batch.len() > 1 => {
                tracing::debug!(%error, writes = batch.len(), "batch refused; committing each write alone");
                metrics::counter!("converger_group_commit_isolated_total").increment(1);
                for write in batch {
                    Box::pin(self.commit(vec![write])).await;
                }
            }
            // A lone write's own refusal, or a batch whose fate is unknown: every writer hears
            // the error and resends with its idempotency key.
            Ok(Some(Err(BatchError::Statement(error) | BatchError::Commit(error)))) => {
                fail_all(batch, &StoreError::Database(error));
            }
            // The server stopped answering: the fate is unknown too.
            Ok(None) => batch
                .into_iter()
                .for_each(|write| write.failed(timed_out())),
        }
    }
}

/// Every writer of `batch` hears that it did not commit, or that its fate is unknown:
/// `unavailable` when the database host failed rather than the batch.
fn fail_all(batch: Vec<Write>, error: &StoreError) {
    let unavailable = is_connection_failure(error);
    let lone = batch.len() == 1;
    let message = error.to_string();
    for write in batch {
        let error = match (unavailable, lone, error) {
            (true, _, _) => StoreError::Unavailable(message.clone()),
            // A lone write's own refusal keeps its SQLSTATE (a duplicate key, a bad value).
            (false, true, StoreError::Database(sqlx::Error::Database(database))) => {
                StoreError::Refused {
                    sqlstate: database
                        .code()
                        .map(|code| code.into_owned())
                        .unwrap_or_default(),
                    message: database.message().to_owned(),
                }
            }
            (false, _, _) => StoreError::GroupCommit(message.clone()),
        };
        write.failed(error);
    }
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

/// Why a batch did not commit.
enum BatchError {
    /// The database refused a statement: nothing of the batch was stored.
    Statement(sqlx::Error),
    /// The connection failed, or the outcome could not be read: its fate may be unknown.
    Commit(sqlx::Error),
}

impl BatchError {
    /// An error the server reports means the transaction rolled back; anything else (a lost
    /// connection, say) leaves its fate unknown.
    fn classify(error: sqlx::Error) -> BatchError {
        match error {
            sqlx::Error::Database(_) => BatchError::Statement(error),
            other => BatchError::Commit(other),
        }
    }
}

/// One batch as one transaction: its statements, then the commit. A batch that met a key it
/// assumed new runs again, reading its keys first (`statements`).
async fn commit_transaction(
    connection: &mut PgConnection,
    requests: &[Request<'_>],
    node: Option<&str>,
) -> Result<Plan, BatchError> {
    if let Some(plan) = transaction(connection, requests, node, Keys::CheckedOnWrite).await? {
        return Ok(plan);
    }
    metrics::counter!("converger_group_commit_key_rereads_total").increment(1);
    transaction(connection, requests, node, Keys::Read)
        .await?
        .ok_or_else(|| {
            BatchError::Commit(sqlx::Error::Protocol(
                "a batch that read its keys met a stored key".into(),
            ))
        })
}

/// The batch's statements in one transaction, committed; `None` when it rolled back because a
/// key assumed new was stored.
async fn transaction(
    connection: &mut PgConnection,
    requests: &[Request<'_>],
    node: Option<&str>,
    keys: Keys,
) -> Result<Option<Plan>, BatchError> {
    let mut transaction = connection.begin().await.map_err(BatchError::classify)?;
    let written = statements::write_batch(&mut transaction, requests, node, keys)
        .await
        .map_err(BatchError::classify)?;
    match written {
        Written::Plan(plan) => {
            transaction.commit().await.map_err(BatchError::classify)?;
            Ok(Some(plan))
        }
        Written::KeyStoredBefore => {
            transaction.rollback().await.map_err(BatchError::classify)?;
            Ok(None)
        }
    }
}

/// Commits one frame in the caller's transaction (a send under a turn policy,
/// `turns/policies.rs`). Its notification names no node, so every node, this one too, hears
/// it from the bus.
pub(crate) async fn frame_in_transaction(
    connection: &mut PgConnection,
    new: NewActivity,
) -> Result<Result<Option<CommitOutcome>, StoreError>, sqlx::Error> {
    // The caller's transaction cannot be run again, so the key is read before the write.
    let written =
        statements::write_batch(connection, &[Request::Frame(&new)], Some(""), Keys::Read).await?;
    let Written::Plan(plan) = written else {
        return Err(sqlx::Error::Protocol(
            "a frame write that read its key met a stored key".into(),
        ));
    };
    match plan.outcomes.into_iter().next() {
        Some(Decided::Frame(outcome)) => Ok(Ok(outcome)),
        _ => Err(sqlx::Error::Protocol(
            "a frame write had no frame outcome".into(),
        )),
    }
}
