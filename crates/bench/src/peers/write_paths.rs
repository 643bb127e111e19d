//! Issue 35's candidate write paths, prototyped for measurement only (ADR 0036). Each one
//! commits the store-alone loop's writes (a user's turn, then the agent's one-frame answer)
//! through a group commit of its own, so its cost per turn can be set beside the store's in the
//! same run (when they were measured for ADR 0036, the store called the plpgsql function
//! `converger_commit_batch`; it now runs candidate b's statements, ADR 0037):
//!
//! - `statements` (candidate b): `seq` still allocated in Postgres under the conversation's row
//!   lock, but by plain statements with typed array parameters (no plpgsql, no JSON argument or
//!   result): lock the heads and probe the idempotency keys, then one statement writes the
//!   frames, the new turns, the answers' turn status, the heads and the outbox row.
//! - `owner` (candidate a): the writing node owns the conversations, so it allocates `seq` in
//!   memory and keeps the idempotency keys it committed. One statement, with no transaction
//!   block, writes everything; a compare-and-set of each head (`last_seq` as the owner last
//!   wrote it, and an epoch no newer than its own) is the fence, and a failed fence aborts the
//!   whole statement.
//! - `owner_folded`: `owner` with the turn registry folded into the frames: no `turns` row is
//!   written at all; an answer's first frame carries its fingerprint, and a unique index on
//!   (conversation, turn seq, turn revision) over first frames keeps one answer per turn.
//!
//! What the prototypes leave out (the ADR weighs it): runtimes, fences of lease mode, stops,
//! an answer racing a closed or superseded turn (the batch then fails instead of classifying
//! it), and where a prototype owner's idempotency window misses a key, the unique index refuses
//! the batch rather than reporting a duplicate. None of these occurs in the loop measured.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use anyhow::Context;
use serde_json::{Value, json};
use sqlx::{Connection, PgConnection, Row};
use tokio::sync::{Mutex, mpsc, oneshot};
use uuid::Uuid;

/// Writes in one batch at most, as in the store.
const MAX_BATCH: usize = 128;
/// Committing workers, as the store's default.
const WORKERS: usize = 2;
/// Writes queued beyond this wait for room, as in the store.
const QUEUE: usize = 4_096;
/// Idempotency keys an owner remembers per conversation.
const KEY_WINDOW: usize = 256;
/// The epoch the prototype owner holds its conversations under.
const OWNER_EPOCH: i64 = 1;

/// Which candidate commits the writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Candidate {
    /// Sequencing in Postgres, plain set-based statements.
    Statements,
    /// `Statements` with the turn registry folded into the frames.
    StatementsFolded,
    /// Sequencing by the owner, one fenced statement.
    Owner,
    /// `Owner` with the turn registry folded into the frames.
    OwnerFolded,
}

impl Candidate {
    /// How its writes are durable, for the bench's output.
    pub fn durability(self) -> &'static str {
        match self {
            Candidate::Statements => {
                "prototype (b): set-based statements in one transaction per batch, seq under the \
                 conversation's row lock, with the server's synchronous_commit"
            }
            Candidate::StatementsFolded => {
                "prototype (b) with the turn registry folded into the frames, with the server's \
                 synchronous_commit"
            }
            Candidate::Owner => {
                "prototype (a): one fenced statement per batch, seq allocated by the owner, with \
                 the server's synchronous_commit"
            }
            Candidate::OwnerFolded => {
                "prototype (a) with the turn registry folded into the frames, with the server's \
                 synchronous_commit"
            }
        }
    }

    /// Whether each conversation's writes must go to one worker (an owner's in-memory heads).
    fn partitioned(self) -> bool {
        matches!(self, Candidate::Owner | Candidate::OwnerFolded)
    }

    /// Whether no `turns` row is written (an answer's first frame carries its fingerprint).
    pub(super) fn folded(self) -> bool {
        matches!(self, Candidate::StatementsFolded | Candidate::OwnerFolded)
    }
}

/// What the prototypes add to the migrated schema. Only the owner candidates need anything.
pub async fn prepare_schema(url: &str, candidate: Candidate) -> anyhow::Result<()> {
    let mut connection = PgConnection::connect(url).await?;
    if candidate.partitioned() {
        sqlx::raw_sql(
            "ALTER TABLE conversations ADD COLUMN owner_epoch bigint NOT NULL DEFAULT 0;
             CREATE FUNCTION converger_prototype_fence_lost() RETURNS boolean
             LANGUAGE plpgsql VOLATILE AS $$
             BEGIN
                 RAISE EXCEPTION 'a head moved under its owner' USING ERRCODE = 'CV035';
             END
             $$;",
        )
        .execute(&mut connection)
        .await
        .context("owner columns")?;
    }
    if candidate.folded() {
        sqlx::raw_sql(
            "ALTER TABLE activities ADD COLUMN answer_fingerprint text;
             CREATE UNIQUE INDEX activities_one_answer
                 ON activities (conversation_id, turn_seq, turn_revision)
              WHERE answer_fingerprint IS NOT NULL;",
        )
        .execute(&mut connection)
        .await
        .context("folded registry")?;
    }
    Ok(())
}

/// One write and where its outcome goes: the seq of the turn, or of the answer's first frame.
struct Write {
    conversation: Uuid,
    kind: WriteKind,
    done: oneshot::Sender<anyhow::Result<i64>>,
}

enum WriteKind {
    /// A user's turn with its idempotency key.
    Turn { client_id: String },
    /// The agent's one-frame answer to the turn at `seq`, revision 0.
    Answer { seq: i64 },
}

/// The queue in front of a candidate's workers; cheap to clone.
#[derive(Clone)]
pub struct Writer {
    queues: Vec<mpsc::Sender<Write>>,
}

impl Writer {
    /// Starts the workers, each on a connection of its own to `url`.
    pub async fn start(url: &str, candidate: Candidate) -> anyhow::Result<Writer> {
        let (shared_sender, shared_receiver) = mpsc::channel::<Write>(QUEUE);
        let shared_receiver = Arc::new(Mutex::new(shared_receiver));
        let mut queues = Vec::new();
        for _ in 0..WORKERS {
            let mut connection = PgConnection::connect(url).await?;
            // As on the store's batch function: the heads' table is small and updated by every
            // batch, so a sequential scan would read every dead version of its rows. A statement
            // the server has not finished in 5 s is cancelled, as the store's are.
            sqlx::raw_sql("SET enable_seqscan = off; SET statement_timeout = '5s'")
                .execute(&mut connection)
                .await?;
            let receiver = match candidate.partitioned() {
                true => {
                    let (sender, receiver) = mpsc::channel(QUEUE);
                    queues.push(sender);
                    Arc::new(Mutex::new(receiver))
                }
                false => shared_receiver.clone(),
            };
            tokio::spawn(work(candidate, connection, receiver));
        }
        if queues.is_empty() {
            queues.push(shared_sender);
        }
        Ok(Writer { queues })
    }

    /// Commits a user's turn; returns its seq.
    pub async fn turn(&self, conversation: Uuid, client_id: String) -> anyhow::Result<i64> {
        self.submit(conversation, WriteKind::Turn { client_id })
            .await
    }

    /// Commits the answer to the turn at `seq`; returns its frame's seq.
    pub async fn answer(&self, conversation: Uuid, seq: i64) -> anyhow::Result<i64> {
        self.submit(conversation, WriteKind::Answer { seq }).await
    }

    async fn submit(&self, conversation: Uuid, kind: WriteKind) -> anyhow::Result<i64> {
        let (done, outcome) = oneshot::channel();
        let queue = &self.queues[worker_of(conversation, self.queues.len())];
        queue
            .send(Write {
                conversation,
                kind,
                done,
            })
            .await
            .map_err(|_| anyhow::anyhow!("the prototype's workers stopped"))?;
        outcome
            .await
            .map_err(|_| anyhow::anyhow!("the prototype's worker dropped a write"))?
    }
}

fn worker_of(conversation: Uuid, workers: usize) -> usize {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    conversation.hash(&mut hasher);
    (hasher.finish() % workers as u64) as usize
}

/// The conversations one owner worker holds: the head as it last wrote it, and the keys.
#[derive(Default)]
struct Owned {
    heads: HashMap<Uuid, OwnedHead>,
}

struct OwnedHead {
    last_seq: i64,
    keys: HashMap<String, i64>,
    key_order: VecDeque<String>,
}

impl OwnedHead {
    fn remember(&mut self, client_id: &str, seq: i64) {
        self.keys.insert(client_id.to_owned(), seq);
        self.key_order.push_back(client_id.to_owned());
        if self.key_order.len() > KEY_WINDOW
            && let Some(oldest) = self.key_order.pop_front()
        {
            self.keys.remove(&oldest);
        }
    }
}

async fn work(
    candidate: Candidate,
    mut connection: PgConnection,
    receiver: Arc<Mutex<mpsc::Receiver<Write>>>,
) {
    let mut owned = Owned::default();
    loop {
        let mut batch = {
            let mut receiver = receiver.lock().await;
            let Some(first) = receiver.recv().await else {
                return;
            };
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match receiver.try_recv() {
                    Ok(write) => batch.push(write),
                    Err(_) => break,
                }
            }
            batch
        };
        // Conversation order, so two batches lock heads in one order.
        batch.sort_by_key(|write| write.conversation);
        let outcome = match candidate {
            Candidate::Statements | Candidate::StatementsFolded => {
                commit_statements(&mut connection, candidate, &batch).await
            }
            Candidate::Owner | Candidate::OwnerFolded => {
                commit_owned(&mut connection, &mut owned, candidate, &batch).await
            }
        };
        match outcome {
            Ok(seqs) => {
                for (write, seq) in batch.into_iter().zip(seqs) {
                    let _ = write.done.send(Ok(seq));
                }
            }
            Err(error) => {
                // The heads this worker kept may be wrong now: read them again.
                owned.heads.clear();
                let message = format!("{error:#}");
                for write in batch {
                    let _ = write.done.send(Err(anyhow::anyhow!("{message}")));
                }
            }
        }
    }
}

/// The rows one batch writes, as the array parameters of its statement.
#[derive(Default)]
struct Rows {
    // activities
    conversation: Vec<Uuid>,
    seq: Vec<i64>,
    id: Vec<String>,
    sender: Vec<&'static str>,
    data: Vec<Value>,
    client_id: Vec<Option<String>>,
    turn_seq: Vec<Option<i64>>,
    fingerprint: Vec<Option<String>>,
    // new turns
    turn_conversation: Vec<Uuid>,
    turn_at: Vec<i64>,
    // answers settled
    answer_conversation: Vec<Uuid>,
    answer_turn: Vec<i64>,
    answer_fingerprint: Vec<String>,
    answer_frame: Vec<i32>,
    // heads
    head: Vec<Uuid>,
    head_expected: Vec<i64>,
    head_last: Vec<i64>,
}

impl Rows {
    fn push_frame(&mut self, conversation: Uuid, seq: i64, kind: &WriteKind) {
        self.conversation.push(conversation);
        self.seq.push(seq);
        self.id.push(Uuid::now_v7().to_string());
        match kind {
            WriteKind::Turn { client_id } => {
                self.sender.push("user");
                self.data.push(json!({"text": "hello"}));
                self.client_id.push(Some(client_id.clone()));
                self.turn_seq.push(None);
                self.fingerprint.push(None);
                self.turn_conversation.push(conversation);
                self.turn_at.push(seq);
            }
            WriteKind::Answer { seq: turn } => {
                let fingerprint = format!("answer-{turn}");
                self.sender.push("agent");
                self.data.push(json!({"text": "an answer"}));
                self.client_id.push(None);
                self.turn_seq.push(Some(*turn));
                self.fingerprint.push(Some(fingerprint.clone()));
                self.answer_conversation.push(conversation);
                self.answer_turn.push(*turn);
                self.answer_fingerprint.push(fingerprint);
                // 1-based position of the answer's frame among the batch's frames.
                self.answer_frame.push(self.seq.len() as i32);
            }
        }
    }

    fn push_head(&mut self, conversation: Uuid, expected: i64, last: i64) {
        if last == expected {
            return;
        }
        self.head.push(conversation);
        self.head_expected.push(expected);
        self.head_last.push(last);
    }
}

/// Candidate (b): lock and probe, then one statement, in one transaction.
async fn commit_statements(
    connection: &mut PgConnection,
    candidate: Candidate,
    batch: &[Write],
) -> anyhow::Result<Vec<i64>> {
    let mut conversations: Vec<Uuid> = batch.iter().map(|write| write.conversation).collect();
    conversations.dedup();
    let (key_conversation, key_client, key_ord): (Vec<Uuid>, Vec<String>, Vec<i32>) = batch
        .iter()
        .enumerate()
        .filter_map(|(ord, write)| match &write.kind {
            WriteKind::Turn { client_id } => {
                Some((write.conversation, client_id.clone(), ord as i32))
            }
            WriteKind::Answer { .. } => None,
        })
        .collect();
    let mut transaction = connection.begin().await?;
    // The heads, locked in id order, and the keys stored before, in one statement. The keys are
    // read from the statement's snapshot, taken before the locks were granted: a key a racing
    // batch stored in between makes this batch's insert fail on the unique index (rare: a
    // resend racing its first send). The real path reads the keys in a statement of its own.
    let rows = sqlx::query(
        "WITH heads AS (
             SELECT c.id, c.last_seq FROM conversations c
              WHERE c.id = ANY($1) AND c.status = 'open'
              ORDER BY c.id
                FOR NO KEY UPDATE)
         SELECT heads.id, heads.last_seq AS value, -1 AS ord FROM heads
         UNION ALL
         SELECT k.conversation_id, a.seq, k.ord
           FROM unnest($2::uuid[], $3::text[], $4::integer[]) AS k(conversation_id, client_id, ord)
          CROSS JOIN LATERAL (
                SELECT a.seq FROM activities a
                 WHERE a.conversation_id = k.conversation_id AND a.sender_id = 'user'
                   AND a.client_id = k.client_id AND a.client_id IS NOT NULL
                 LIMIT 1) AS a",
    )
    .bind(&conversations)
    .bind(&key_conversation)
    .bind(&key_client)
    .bind(&key_ord)
    .fetch_all(&mut *transaction)
    .await?;
    let mut heads = HashMap::new();
    let mut stored = HashMap::new();
    for row in rows {
        let ord: i32 = row.try_get("ord")?;
        let conversation: Uuid = row.try_get("id")?;
        let value: i64 = row.try_get("value")?;
        if ord < 0 {
            heads.insert(conversation, (value, value));
        } else {
            stored.insert(ord as usize, value);
        }
    }
    let mut rows = Rows::default();
    let mut seqs = Vec::with_capacity(batch.len());
    for (ord, write) in batch.iter().enumerate() {
        if let Some(seq) = stored.get(&ord) {
            seqs.push(*seq);
            continue;
        }
        let (_, last) = heads
            .get_mut(&write.conversation)
            .context("no such open conversation")?;
        *last += 1;
        rows.push_frame(write.conversation, *last, &write.kind);
        seqs.push(*last);
    }
    for conversation in &conversations {
        if let Some((expected, last)) = heads.get(conversation) {
            rows.push_head(*conversation, *expected, *last);
        }
    }
    let settled = write_rows(&mut transaction, &rows, candidate).await?;
    anyhow::ensure!(
        candidate.folded() || settled == rows.answer_turn.len() as i64,
        "an answer's turn was not pending (not prototyped)"
    );
    transaction.commit().await?;
    Ok(seqs)
}

/// Candidate (a): the owner's heads and keys, then one fenced statement.
async fn commit_owned(
    connection: &mut PgConnection,
    owned: &mut Owned,
    candidate: Candidate,
    batch: &[Write],
) -> anyhow::Result<Vec<i64>> {
    let unknown: Vec<Uuid> = batch
        .iter()
        .map(|write| write.conversation)
        .filter(|conversation| !owned.heads.contains_key(conversation))
        .collect();
    if !unknown.is_empty() {
        // Taking a conversation over: its head as stored (the real design reads the keys too).
        let rows = sqlx::query("SELECT id, last_seq FROM conversations WHERE id = ANY($1)")
            .bind(&unknown)
            .fetch_all(&mut *connection)
            .await?;
        for row in rows {
            owned.heads.insert(
                row.try_get("id")?,
                OwnedHead {
                    last_seq: row.try_get("last_seq")?,
                    keys: HashMap::new(),
                    key_order: VecDeque::new(),
                },
            );
        }
    }
    let mut rows = Rows::default();
    let mut seqs = Vec::with_capacity(batch.len());
    // Per conversation written: (its head as this owner left it, the last seq allocated now).
    let mut allocated: HashMap<Uuid, (i64, i64)> = HashMap::new();
    let mut new_keys = Vec::new();
    for write in batch {
        let head = owned
            .heads
            .get(&write.conversation)
            .context("no such conversation")?;
        if let WriteKind::Turn { client_id } = &write.kind
            && let Some(seq) = head.keys.get(client_id)
        {
            seqs.push(*seq);
            continue;
        }
        let (_, last) = allocated
            .entry(write.conversation)
            .or_insert((head.last_seq, head.last_seq));
        *last += 1;
        rows.push_frame(write.conversation, *last, &write.kind);
        if let WriteKind::Turn { client_id } = &write.kind {
            new_keys.push((write.conversation, client_id.clone(), *last));
        }
        seqs.push(*last);
    }
    let mut conversations: Vec<(&Uuid, &(i64, i64))> = allocated.iter().collect();
    conversations.sort();
    for (conversation, (expected, last)) in conversations {
        rows.push_head(*conversation, *expected, *last);
    }
    let settled = write_rows(connection, &rows, candidate).await?;
    anyhow::ensure!(
        candidate.folded() || settled == rows.answer_turn.len() as i64,
        "an answer's turn was not pending (not prototyped)"
    );
    // Committed: the heads and keys move only now.
    for (conversation, last) in rows.head.iter().zip(&rows.head_last) {
        if let Some(head) = owned.heads.get_mut(conversation) {
            head.last_seq = *last;
        }
    }
    for (conversation, client_id, seq) in new_keys {
        if let Some(head) = owned.heads.get_mut(&conversation) {
            head.remember(&client_id, seq);
        }
    }
    Ok(seqs)
}

/// The one writing statement. Returns the answers whose turn it settled.
async fn write_rows(
    connection: &mut PgConnection,
    rows: &Rows,
    candidate: Candidate,
) -> anyhow::Result<i64> {
    let sql = match candidate {
        Candidate::Statements => STATEMENTS_WRITE,
        Candidate::StatementsFolded => STATEMENTS_FOLDED_WRITE,
        Candidate::Owner => OWNER_WRITE,
        Candidate::OwnerFolded => OWNER_FOLDED_WRITE,
    };
    let frames = rows.seq.len() as i64;
    let settled: i64 = sqlx::query_scalar(sql)
        .bind(&rows.conversation)
        .bind(&rows.seq)
        .bind(&rows.id)
        .bind(&rows.sender)
        .bind(&rows.data)
        .bind(&rows.client_id)
        .bind(&rows.turn_seq)
        .bind(&rows.fingerprint)
        .bind(&rows.turn_conversation)
        .bind(&rows.turn_at)
        .bind(&rows.answer_conversation)
        .bind(&rows.answer_turn)
        .bind(&rows.answer_fingerprint)
        .bind(&rows.answer_frame)
        .bind(&rows.head)
        .bind(&rows.head_expected)
        .bind(&rows.head_last)
        .bind(frames)
        .bind(OWNER_EPOCH)
        .fetch_one(&mut *connection)
        .await?;
    Ok(settled)
}

// The statements, from shared pieces (macros, so `concat!` can join them at compile time).
// Parameters: the frames $1–$8, the new turns $9–$10, the answers $11–$14, the heads $15–$17
// (id, expected, last), the frame count $18 and the owner's epoch $19. sqlx sends every
// parameter's type, so a statement may leave some unused.

/// The heads under the lock the transaction's first statement took.
macro_rules! locked_heads {
    () => {
        "
    heads AS (
        UPDATE conversations c SET last_seq = h.last_seq, updated_at = now()
          FROM unnest($15::uuid[], $17::bigint[]) AS h(id, last_seq)
         WHERE c.id = ANY($15::uuid[]) AND c.id = h.id
        RETURNING 1),"
    };
}

/// The fence: each head moves only from where this owner last left it, under an epoch no newer
/// than its own.
macro_rules! fenced_heads {
    () => {
        "
    heads AS (
        UPDATE conversations c
           SET last_seq = h.last_seq, owner_epoch = $19::bigint, updated_at = now()
          FROM unnest($15::uuid[], $16::bigint[], $17::bigint[]) AS h(id, expected, last_seq)
         WHERE c.id = ANY($15::uuid[]) AND c.id = h.id AND c.last_seq = h.expected
           AND c.owner_epoch <= $19::bigint
           AND c.status = 'open'
        RETURNING 1),"
    };
}

/// The frames; `$fingerprint_column` and `$fingerprint` carry an answer's fingerprint on its
/// first frame where the registry is folded.
macro_rules! frames {
    ($fingerprint_column:literal, $fingerprint:literal) => {
        concat!(
            "
    frames AS (
        INSERT INTO activities AS a
            (conversation_id, seq, id, type, sender_id, sender_role, data, client_id,
             turn_seq, turn_revision, created_at",
            $fingerprint_column,
            ")
        SELECT f.conversation_id, f.seq, f.id, 'text', f.sender, f.sender, f.data, f.client_id,
               f.turn_seq, CASE WHEN f.turn_seq IS NOT NULL THEN 0 END, clock_timestamp()",
            $fingerprint,
            "
          FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::text[], $5::jsonb[],
                      $6::text[], $7::bigint[], $8::text[])
               AS f(conversation_id, seq, id, sender, data, client_id, turn_seq, fingerprint)),"
        )
    };
}

/// The turn registry: new turns pending, answered turns completed. Plans are cached while the
/// tables are empty, and a set-based join of `turns` with the answers, planned then, read a
/// conversation's whole key range for every batch once the table had grown. So each answered
/// turn is found by a probe of the whole primary key (the only index it can use; `LIMIT 1`
/// keeps the planner from turning the probe back into a join), and updated by its row's
/// address. The status test names both states an answer may settle: with
/// `pending` alone, the planner may scan that state's partial index instead, whose dead entries
/// grow with every settled turn. (A concurrent update of a turn between the probe and the
/// update would drop it from the count, and the batch would fail: no other writer of turns
/// runs here.)
macro_rules! registry {
    () => {
        "
    new_turns AS (
        INSERT INTO turns (conversation_id, seq, revision, status, created_at)
        SELECT t.conversation_id, t.seq, 0, 'pending', now()
          FROM unnest($9::uuid[], $10::bigint[]) AS t(conversation_id, seq)),
    targets AS (
        SELECT s.fingerprint, s.frame, found.address
          FROM unnest($11::uuid[], $12::bigint[], $13::text[], $14::integer[])
               AS s(conversation_id, seq, fingerprint, frame)
         CROSS JOIN LATERAL (
               SELECT t.ctid AS address FROM turns t
                WHERE t.conversation_id = s.conversation_id AND t.seq = s.seq
                  AND t.revision = 0 AND t.status IN ('pending', 'stopping')
                LIMIT 1) AS found),
    settled AS (
        UPDATE turns t
           SET status = 'completed', result_fingerprint = targets.fingerprint,
               result_ids = ($3::text[])[targets.frame:targets.frame],
               result_seqs = ($2::bigint[])[targets.frame:targets.frame],
               completed_at = now()
          FROM targets
         WHERE t.ctid = ANY(ARRAY(SELECT targets.address FROM targets))
           AND t.ctid = targets.address
        RETURNING 1),"
    };
}

/// The batch's outbox row.
macro_rules! outbox {
    () => {
        "
    logged AS (
        INSERT INTO outbox (conversations, last_seqs, frames)
        SELECT $15::uuid[], $17::bigint[], $18::bigint WHERE $18::bigint > 0)"
    };
}

/// A fenced statement fails as a whole when a head was not where its owner left it.
macro_rules! fence_checked {
    ($settled:literal) => {
        concat!(
            "
    SELECT CASE WHEN (SELECT count(*) FROM heads) = cardinality($15::uuid[])
                THEN ",
            $settled,
            "
                ELSE converger_prototype_fence_lost()::integer END"
        )
    };
}

const STATEMENTS_WRITE: &str = concat!(
    "WITH",
    locked_heads!(),
    frames!("", ""),
    registry!(),
    outbox!(),
    "
    SELECT count(*) FROM settled"
);

const STATEMENTS_FOLDED_WRITE: &str = concat!(
    "WITH",
    locked_heads!(),
    frames!(", answer_fingerprint", ", f.fingerprint"),
    outbox!(),
    "
    SELECT 0::bigint"
);

const OWNER_WRITE: &str = concat!(
    "WITH",
    fenced_heads!(),
    frames!("", ""),
    registry!(),
    outbox!(),
    fence_checked!("(SELECT count(*) FROM settled)")
);

const OWNER_FOLDED_WRITE: &str = concat!(
    "WITH",
    fenced_heads!(),
    frames!(", answer_fingerprint", ", f.fingerprint"),
    outbox!(),
    fence_checked!("0::bigint")
);
