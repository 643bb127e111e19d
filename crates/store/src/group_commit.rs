//! Group commit: the frames and answers of many sessions commit in one transaction.
//!
//! Every commit calls `pg_notify`, and Postgres serialises notifying transactions on one lock
//! that it holds from just before the commit record until the WAL flush is done. One write per
//! transaction therefore caps a whole cluster at about one commit per disk flush (≈ 2 ms here),
//! however many connections it uses. Grouping writes pays that flush once per batch.
//!
//! Writes queue here; [`WORKERS`] tasks each take whatever is queued (at least one write, at
//! most [`MAX_BATCH`]) and run it as one transaction. There is no timer: an idle worker starts
//! at once, so a lone write waits for nothing, and under load the queue fills while the other
//! worker's flush is in progress (ADR 0010).
//!
//! Architecture invariant: a batch's statements run in conversation order (stable for writes of
//! one conversation), so two batches lock conversations in the same order and cannot deadlock;
//! and a batch whose statements fail is retried write by write, each in its own transaction, so
//! one bad write never fails another session's.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::activities::{CommitOutcome, NewActivity, insert_activity};
use crate::turns::{AnswerOutcome, TurnAnswer, answer_turn};
use crate::{StoreError, within_deadline};

/// The operation name in metrics and timeouts.
const OPERATION: &str = "group_commit";

/// Writes in one transaction at most.
pub(crate) const MAX_BATCH: usize = 128;

/// Transactions in progress at once: while one waits for its flush, the others run their
/// statements. Measured with `converger-bench turns` at 64 users: 2, 4, 8 and 16 workers gave
/// 1,002, 1,076, 915 and 770 turns/s (more workers, smaller batches, more lock waits).
pub(crate) const WORKERS: usize = 4;

/// Writes queued beyond this wait for room (backpressure on the sessions).
const QUEUE: usize = 4_096;

/// One write, its outcome once its statements ran, and where the outcome goes after commit.
#[expect(
    clippy::large_enum_variant,
    reason = "writes only pass through the queue; boxing would cost an allocation per write"
)]
enum Write {
    Activity {
        new: NewActivity,
        outcome: Option<Option<CommitOutcome>>,
        done: oneshot::Sender<Result<Option<CommitOutcome>, StoreError>>,
    },
    Answer {
        answer: TurnAnswer,
        fingerprint: String,
        outcome: Option<AnswerOutcome>,
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

    /// Runs the write's statements on `connection` and keeps their outcome until the commit.
    async fn execute(&mut self, connection: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        match self {
            Write::Activity { new, outcome, .. } => {
                *outcome = Some(insert_activity(connection, new).await?);
            }
            Write::Answer {
                answer,
                fingerprint,
                outcome,
                ..
            } => {
                *outcome = Some(answer_turn(connection, answer, fingerprint).await?);
            }
        }
        Ok(())
    }

    /// Hands the kept outcome to the writer (the transaction committed).
    fn committed(self) {
        match self {
            Write::Activity { outcome, done, .. } => {
                let _ = done.send(outcome.ok_or_else(never_ran));
            }
            Write::Answer { outcome, done, .. } => {
                let _ = done.send(outcome.ok_or_else(never_ran));
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

/// A committed write always ran its statements first; this error would name the bug.
fn never_ran() -> StoreError {
    StoreError::GroupCommit("write committed without running".into())
}

/// The queue in front of the committing workers; cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct GroupCommit {
    queue: mpsc::Sender<Write>,
    deadline: Duration,
}

impl GroupCommit {
    /// Starts the workers on `pool`; they stop when the last handle is dropped.
    pub(crate) fn start(pool: PgPool, deadline: Duration) -> GroupCommit {
        let (queue, receiver) = mpsc::channel(QUEUE);
        let receiver = Arc::new(Mutex::new(receiver));
        for _ in 0..WORKERS {
            tokio::spawn(work(pool.clone(), Arc::clone(&receiver), deadline));
        }
        GroupCommit { queue, deadline }
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

/// One worker: takes what is queued and commits it as one transaction, until the queue closes.
async fn work(pool: PgPool, receiver: Arc<Mutex<mpsc::Receiver<Write>>>, deadline: Duration) {
    loop {
        let mut batch = Vec::new();
        {
            let mut receiver = receiver.lock().await;
            if receiver.recv_many(&mut batch, MAX_BATCH).await == 0 {
                return;
            }
        }
        metrics::histogram!("converger_group_commit_writes").record(batch.len() as f64);
        commit_batch(&pool, batch, deadline).await;
    }
}

/// Runs `batch` as one transaction; when its statements fail, runs each write on its own.
async fn commit_batch(pool: &PgPool, mut batch: Vec<Write>, deadline: Duration) {
    batch.sort_by_key(Write::conversation_id);
    let attempt = within_deadline(deadline, OPERATION, run_together(pool, &mut batch)).await;
    match attempt {
        Some(Ok(())) => batch.into_iter().for_each(Write::committed),
        // A statement failed (a racing idempotency key, say): nothing of the batch is stored,
        // so each write is tried again alone and gets its own outcome.
        Some(Err(BatchError::Statement(_))) if batch.len() > 1 => {
            for mut write in batch {
                match within_deadline(deadline, OPERATION, run_alone(pool, &mut write)).await {
                    Some(Ok(())) => write.committed(),
                    Some(Err(error)) => write.failed(StoreError::from(error)),
                    None => write.failed(timed_out()),
                }
            }
        }
        // A write alone keeps its own error (a unique violation is answered as a duplicate).
        Some(Err(BatchError::Statement(error) | BatchError::Commit(error))) if batch.len() == 1 => {
            if let Some(write) = batch.pop() {
                write.failed(StoreError::Database(error));
            }
        }
        // The commit itself failed: whether it landed is unknown, so every writer hears the
        // error and resends with its idempotency key.
        Some(Err(BatchError::Statement(error) | BatchError::Commit(error))) => {
            let message = error.to_string();
            for write in batch {
                write.failed(StoreError::GroupCommit(message.clone()));
            }
        }
        None => batch
            .into_iter()
            .for_each(|write| write.failed(timed_out())),
    }
}

fn timed_out() -> StoreError {
    StoreError::Timeout {
        operation: OPERATION,
    }
}

/// Why a batch did not commit.
enum BatchError {
    /// Before the commit was sent: nothing was stored.
    Statement(sqlx::Error),
    /// The commit (or the begin) failed: its fate may be unknown.
    Commit(sqlx::Error),
}

async fn run_together(pool: &PgPool, batch: &mut [Write]) -> Result<(), BatchError> {
    let mut tx = pool.begin().await.map_err(BatchError::Commit)?;
    for write in batch.iter_mut() {
        write
            .execute(&mut tx)
            .await
            .map_err(BatchError::Statement)?;
    }
    tx.commit().await.map_err(BatchError::Commit)
}

async fn run_alone(pool: &PgPool, write: &mut Write) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    write.execute(&mut tx).await?;
    tx.commit().await
}
