//! A batch as plain statements with typed array parameters, in the caller's transaction
//! (ADR 0036, candidate b): no plpgsql and no JSON argument or result per write.
//!
//! 1. Lock the batch's conversation rows in id order; read their runtimes' versions and the
//!    commit time.
//! 2. Read what the locks protect: the latest revision (locked) of each answered turn with its
//!    conversation's runtime, in a statement of its own, after the locks: its snapshot then
//!    sees what the batch that held a lock before committed.
//! 3. Decide every outcome in Rust (`decide`).
//! 4. One statement writes the heads, the frames, the new turns, the answered turns, the
//!    runtimes and the outbox row, and sends the batch's notifications.
//!
//! Idempotency keys are checked by the write itself (ADR 0038): a resent frame is rare, so the
//! batch first assumes that none of its keys is stored, and the frames' insert fails on a key
//! that is (the unique index's violation). Such a batch rolls back and runs again, this time
//! reading the stored keys under the locks before it decides. So does a batch with a keyed
//! frame for a conversation that is not open, whose outcome depends on the key (a resend is
//! answered with the stored frame even after the conversation closed).
//!
//! Every look-up names a whole key, probed in `LATERAL … LIMIT 1`, and the answered turns are
//! updated by their row's address: plans are cached while the tables are empty, and a
//! set-based join planned then reads whole key ranges once they are large (ADR 0036). For the
//! same reason the store's connections run with `enable_seqscan = off` (ADR 0044).

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use super::decide::{Found, Head, LatestTurn, Plan, Request, decide};
use crate::activities::{ACTIVITY_COLUMNS, Activity};
use crate::bus::batch_payloads;

/// How a batch learns which of its idempotency keys are stored already.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Keys {
    /// Assumed new, and checked by the write (see the module comment).
    CheckedOnWrite,
    /// Read under the locks before the batch decides.
    Read,
}

/// What running a batch's statements came to.
pub(super) enum Written {
    /// Every write was decided and written; the transaction may commit.
    Plan(Plan),
    /// A key assumed new was stored already: the transaction must roll back, and the batch run
    /// again with [`Keys::Read`].
    KeyStoredBefore,
}

/// Runs the batch's statements in the open transaction on `connection`. `node` names the
/// committing node in the notifications (empty: none); `None` sends none (a bus that
/// announces commits itself). Nothing is committed here.
pub(super) async fn write_batch(
    connection: &mut PgConnection,
    requests: &[Request<'_>],
    node: Option<&str>,
    keys: Keys,
) -> Result<Written, sqlx::Error> {
    let mut conversations: Vec<Uuid> = requests.iter().map(Request::conversation_id).collect();
    conversations.sort_unstable();
    conversations.dedup();
    let (heads, now) = lock_heads(connection, &conversations).await?;
    let read_keys = keys == Keys::Read || keyed_frame_for_closed(requests, &heads);
    let stored = if read_keys {
        stored_keys(connection, requests).await?
    } else {
        HashMap::new()
    };
    let (turns, runtimes) = answered_turns(connection, requests).await?;
    let mut plan = decide(
        requests,
        Found {
            heads,
            keys: stored,
            turns,
            runtimes,
            now,
        },
    );
    if plan.writes_nothing() {
        return Ok(Written::Plan(plan));
    }
    let Counts { settled, frames } = match write(connection, &mut plan, now, node).await {
        Ok(counts) => counts,
        // The transaction is aborted; the caller rolls it back and runs the batch again with
        // its keys read. With the keys read under the locks the error stands, and is logged:
        // it names a bug, which the batch's isolation would otherwise hide.
        Err(error) if meets_stored_key(&error) => {
            if !read_keys {
                return Ok(Written::KeyStoredBefore);
            }
            tracing::warn!(%error, "a batch that read its keys under the locks met a stored key");
            return Err(error);
        }
        Err(error) => return Err(error),
    };
    if frames != plan.frames.len() as i64 {
        // Every frame is inserted or the statement fails, so this names a bug, not a race.
        return Err(sqlx::Error::Protocol(format!(
            "a batch stored {frames} of {} frames",
            plan.frames.len()
        )));
    }
    if settled != plan.settled.len() as i64 {
        // The turns were locked in step 2, so this names a bug, not a race.
        return Err(sqlx::Error::Protocol(format!(
            "a batch settled {settled} of {} answered turns",
            plan.settled.len()
        )));
    }
    Ok(Written::Plan(plan))
}

/// Whether `error` is the write's insert meeting an idempotency key that was stored already
/// (ADR 0038, amended): the unique index's violation, which the insert raises instead of
/// skipping the frame.
fn meets_stored_key(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(database)
        if database.constraint() == Some(IDEMPOTENCY_INDEX))
}

/// The unique index of the frames' idempotency keys (conversation, sender, clientId).
const IDEMPOTENCY_INDEX: &str = "activities_idempotency";

/// Whether a frame with an idempotency key is for a conversation that is missing or not open:
/// its outcome is the stored frame if the key is stored, and nothing otherwise, so the write
/// cannot check the key.
fn keyed_frame_for_closed(requests: &[Request<'_>], heads: &HashMap<Uuid, Head>) -> bool {
    requests.iter().any(|request| match request {
        Request::Frame(new) if new.client_id.is_some() => !heads
            .get(&new.conversation_id)
            .is_some_and(|head| head.open),
        _ => false,
    })
}

/// The heads of `conversations` (sorted), locked in that order so that two batches cannot
/// deadlock, and the commit time, read once every lock is held: a conversation's next batch
/// reads a later one.
async fn lock_heads(
    connection: &mut PgConnection,
    conversations: &[Uuid],
) -> Result<(HashMap<Uuid, Head>, DateTime<Utc>), sqlx::Error> {
    // The runtime's version is on the locked row, so it is read as the last batch that held
    // the lock left it: the version this batch commits with (ADR 0039).
    let rows: Vec<(Uuid, i64, bool, Uuid, i64, DateTime<Utc>)> = sqlx::query_as(
        "SELECT c.id, c.last_seq, c.status = 'open', c.channel_id, c.runtime_version,
                clock_timestamp()
           FROM unnest($1::uuid[]) WITH ORDINALITY AS k(id, ord)
          CROSS JOIN LATERAL (
                SELECT c.id, c.last_seq, c.status, c.channel_id, c.runtime_version
                  FROM conversations c
                 WHERE c.id = k.id
                   FOR NO KEY UPDATE) AS c
          ORDER BY k.ord",
    )
    .bind(conversations)
    .fetch_all(&mut *connection)
    .await?;
    // Each row's clock is read after its own lock; the last is after all of them.
    let now = rows.last().map_or_else(Utc::now, |row| row.5);
    let heads = rows
        .into_iter()
        .map(|(id, last_seq, open, channel_id, runtime_version, _)| {
            (
                id,
                Head {
                    last_seq,
                    open,
                    channel_id,
                    runtime_version,
                },
            )
        })
        .collect();
    Ok((heads, now))
}

/// The frames stored before under the idempotency keys of the batch's frames.
async fn stored_keys(
    connection: &mut PgConnection,
    requests: &[Request<'_>],
) -> Result<HashMap<(Uuid, String, String), Activity>, sqlx::Error> {
    let mut conversation_ids = Vec::new();
    let mut sender_ids = Vec::new();
    let mut client_ids = Vec::new();
    for request in requests {
        if let Request::Frame(new) = request
            && let Some(client_id) = &new.client_id
        {
            conversation_ids.push(new.conversation_id);
            sender_ids.push(new.sender.id.as_str());
            client_ids.push(client_id.as_str());
        }
    }
    if conversation_ids.is_empty() {
        return Ok(HashMap::new());
    }
    // Planned afresh every time (not a prepared statement): `activities` has three indexes led
    // by `conversation_id`, and a plan cached while the table was small may probe one that reads
    // every frame of the conversation instead of the key's (seen: 1 ms a batch instead of 60 µs).
    let rows: Vec<Activity> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT a.* FROM unnest($1::uuid[], $2::text[], $3::text[])
                          AS k(conversation_id, sender_id, client_id)
          CROSS JOIN LATERAL (
                SELECT {ACTIVITY_COLUMNS} FROM activities a
                 WHERE a.conversation_id = k.conversation_id AND a.sender_id = k.sender_id
                   AND a.client_id = k.client_id AND a.client_id IS NOT NULL
                 LIMIT 1) AS a"
    )))
    .bind(&conversation_ids)
    .bind(&sender_ids)
    .bind(&client_ids)
    .persistent(false)
    .fetch_all(&mut *connection)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|activity| {
            let client_id = activity.client_id.clone()?;
            Some((
                (
                    activity.conversation_id,
                    activity.sender_id.clone(),
                    client_id,
                ),
                activity,
            ))
        })
        .collect())
}

/// The latest revision of a turn an answer names, with its conversation's runtime version when
/// the answer writes one.
#[derive(sqlx::FromRow)]
struct AnsweredTurnRow {
    conversation_id: Uuid,
    seq: i64,
    revision: i32,
    status: String,
    result_fingerprint: Option<String>,
    result_ids: Option<Vec<String>>,
    result_seqs: Option<Vec<i64>>,
    completed_at: Option<DateTime<Utc>>,
    fence: i64,
    runtime_version: Option<i64>,
}

type AnsweredTurns = (HashMap<(Uuid, i64), LatestTurn>, HashMap<Uuid, i64>);

/// The latest revisions of the turns the batch's answers name, locked (concurrent answers to
/// one turn queue here), and the runtimes they write, locked too. The runtime's version is read
/// from `conversation_runtime`, not taken from the locked head: a node of a release before
/// ADR 0039 writes runtimes without moving the head's version, and this read is what refuses an
/// answer written against the runtime it replaced (the regenerate test in `tests/agents.rs`).
async fn answered_turns(
    connection: &mut PgConnection,
    requests: &[Request<'_>],
) -> Result<AnsweredTurns, sqlx::Error> {
    let mut conversation_ids = Vec::new();
    let mut seqs = Vec::new();
    let mut with_runtime = Vec::new();
    for request in requests {
        if let Request::Answer { answer, .. } = request {
            conversation_ids.push(answer.conversation_id);
            seqs.push(answer.seq);
            with_runtime.push(answer.runtime.is_some());
        }
    }
    if conversation_ids.is_empty() {
        return Ok((HashMap::new(), HashMap::new()));
    }
    let rows: Vec<AnsweredTurnRow> = sqlx::query_as(
        "SELECT k.conversation_id, k.seq, t.revision, t.status, t.result_fingerprint,
                t.result_ids, t.result_seqs, t.completed_at, t.fence,
                r.version AS runtime_version
           FROM unnest($1::uuid[], $2::bigint[], $3::boolean[])
                AS k(conversation_id, seq, with_runtime)
          CROSS JOIN LATERAL (
                SELECT t.revision, t.status, t.result_fingerprint, t.result_ids,
                       t.result_seqs, t.completed_at, t.fence
                  FROM turns t
                 WHERE t.conversation_id = k.conversation_id AND t.seq = k.seq
                 ORDER BY t.revision DESC
                 LIMIT 1
                   FOR UPDATE) AS t
           LEFT JOIN LATERAL (
                SELECT r.version FROM conversation_runtime r
                 WHERE k.with_runtime AND r.conversation_id = k.conversation_id
                   FOR UPDATE) AS r ON true",
    )
    .bind(&conversation_ids)
    .bind(&seqs)
    .bind(&with_runtime)
    .fetch_all(&mut *connection)
    .await?;
    let mut turns = HashMap::new();
    let mut runtimes = HashMap::new();
    for row in rows {
        if let Some(version) = row.runtime_version {
            runtimes.insert(row.conversation_id, version);
        }
        turns.insert(
            (row.conversation_id, row.seq),
            LatestTurn {
                revision: row.revision,
                status: row.status,
                fingerprint: row.result_fingerprint,
                result_ids: row.result_ids.unwrap_or_default(),
                result_seqs: row.result_seqs.unwrap_or_default(),
                completed_at: row.completed_at,
                fence: row.fence,
            },
        );
    }
    Ok((turns, runtimes))
}

/// The plan's rows as the write statement's array parameters.
#[derive(Default)]
struct Columns<'a> {
    // activities
    conversation_ids: Vec<Uuid>,
    seqs: Vec<i64>,
    ids: Vec<&'a str>,
    kinds: Vec<&'a str>,
    sender_ids: Vec<&'a str>,
    sender_roles: Vec<&'a str>,
    data: Vec<&'a Value>,
    metadata: Vec<Option<&'a Value>>,
    extra: Vec<Option<&'a Value>>,
    client_ids: Vec<Option<&'a str>>,
    turn_seqs: Vec<Option<i64>>,
    turn_revisions: Vec<Option<i32>>,
    // new turns
    new_turn_conversations: Vec<Uuid>,
    new_turn_seqs: Vec<i64>,
    // settled turns
    settled_conversations: Vec<Uuid>,
    settled_seqs: Vec<i64>,
    settled_revisions: Vec<i32>,
    settled_fingerprints: Vec<&'a str>,
    settled_first: Vec<i32>,
    settled_count: Vec<i32>,
    // runtimes
    runtime_conversations: Vec<Uuid>,
    runtime_versions: Vec<i64>,
    runtime_states: Vec<&'a Value>,
    // heads
    head_ids: Vec<Uuid>,
    head_last: Vec<i64>,
    head_runtime_versions: Vec<Option<i64>>,
    // runtimes written without frames: their heads' versions
    unmoved_ids: Vec<Uuid>,
    unmoved_runtime_versions: Vec<i64>,
}

impl<'a> Columns<'a> {
    fn of(plan: &'a Plan) -> Columns<'a> {
        let mut columns = Columns::default();
        for frame in &plan.frames {
            columns.conversation_ids.push(frame.conversation_id);
            columns.seqs.push(frame.seq);
            columns.ids.push(&frame.id);
            columns.kinds.push(&frame.kind);
            columns.sender_ids.push(&frame.sender_id);
            columns.sender_roles.push(&frame.sender_role);
            columns.data.push(&frame.data);
            columns.metadata.push(frame.metadata.as_ref());
            columns.extra.push(frame.extra.as_ref());
            columns.client_ids.push(frame.client_id.as_deref());
            columns.turn_seqs.push(frame.turn_seq);
            columns.turn_revisions.push(frame.turn_revision);
        }
        for index in &plan.new_turns {
            let frame = &plan.frames[*index];
            columns.new_turn_conversations.push(frame.conversation_id);
            columns.new_turn_seqs.push(frame.seq);
        }
        for settled in &plan.settled {
            columns.settled_conversations.push(settled.conversation_id);
            columns.settled_seqs.push(settled.seq);
            columns.settled_revisions.push(settled.revision);
            columns.settled_fingerprints.push(&settled.fingerprint);
            columns.settled_first.push(settled.first);
            columns.settled_count.push(settled.count);
        }
        for runtime in &plan.runtimes {
            columns.runtime_conversations.push(runtime.conversation_id);
            columns.runtime_versions.push(runtime.version);
            columns.runtime_states.push(&runtime.state);
        }
        for (id, last_seq, runtime_version) in plan.moved_heads() {
            columns.head_ids.push(id);
            columns.head_last.push(last_seq);
            columns.head_runtime_versions.push(runtime_version);
        }
        for runtime in plan.runtimes_without_frames() {
            columns.unmoved_ids.push(runtime.conversation_id);
            columns.unmoved_runtime_versions.push(runtime.version);
        }
        columns
    }
}

/// What the write statement stored.
struct Counts {
    /// Answered turns settled.
    settled: i64,
    /// Frames inserted.
    frames: i64,
}

/// The write statement.
async fn write(
    connection: &mut PgConnection,
    plan: &mut Plan,
    now: DateTime<Utc>,
    node: Option<&str>,
) -> Result<Counts, sqlx::Error> {
    let (prefix, payloads) = match node {
        Some(node) if !plan.events.is_empty() => batch_payloads(node, &mut plan.events),
        _ => (String::new(), Vec::new()),
    };
    let plan = &*plan;
    let columns = Columns::of(plan);
    let frame_count = plan.frames.len() as i64;
    let (settled, frames, _notified): (i64, i64, i64) = sqlx::query_as(WRITE)
        .bind(&columns.head_ids)
        .bind(&columns.head_last)
        .bind(&columns.conversation_ids)
        .bind(&columns.seqs)
        .bind(&columns.ids)
        .bind(&columns.kinds)
        .bind(&columns.sender_ids)
        .bind(&columns.sender_roles)
        .bind(&columns.data)
        .bind(&columns.metadata)
        .bind(&columns.extra)
        .bind(&columns.client_ids)
        .bind(&columns.turn_seqs)
        .bind(&columns.turn_revisions)
        .bind(now)
        .bind(&columns.new_turn_conversations)
        .bind(&columns.new_turn_seqs)
        .bind(&columns.settled_conversations)
        .bind(&columns.settled_seqs)
        .bind(&columns.settled_revisions)
        .bind(&columns.settled_fingerprints)
        .bind(&columns.settled_first)
        .bind(&columns.settled_count)
        .bind(&columns.runtime_conversations)
        .bind(&columns.runtime_versions)
        .bind(&columns.runtime_states)
        .bind(frame_count)
        .bind(prefix)
        .bind(&payloads)
        .bind(&columns.head_runtime_versions)
        .bind(&columns.unmoved_ids)
        .bind(&columns.unmoved_runtime_versions)
        .fetch_one(&mut *connection)
        .await?;
    Ok(Counts { settled, frames })
}

/// The batch's writes in one statement. Parameters: the moved heads $1–$2; the frames $3–$14
/// and the commit time $15; the new turns $16–$17; the settled turns $18–$23 (conversation,
/// seq, revision, fingerprint, first frame, frame count); the runtimes $24–$26; the frame count
/// $27; the notification prefix $28 and rests $29 (each notification is the prefix, the outbox
/// id and a rest); the moved heads' runtime versions $30 (with $1); the heads that did not move
/// but whose runtime was written, $31, and their versions $32 (ADR 0039). Every
/// data-modifying `WITH` runs to its end whether or not it is read; the notifications are sent
/// from a materialized `WITH`, read once. A frame whose idempotency key is stored already
/// fails the statement with the unique index's violation (`meets_stored_key`): an insert that
/// could skip it instead (`ON CONFLICT … DO NOTHING`) probes the index once more per frame and
/// writes one more WAL record per frame (ADR 0038, amended).
const WRITE: &str = "
WITH heads AS (
    UPDATE conversations c
       SET last_seq = h.last_seq, updated_at = now(),
           runtime_version = coalesce(h.runtime_version, c.runtime_version)
      FROM unnest($1::uuid[], $2::bigint[], $30::bigint[]) AS h(id, last_seq, runtime_version)
     WHERE c.id = ANY($1::uuid[]) AND c.id = h.id
    RETURNING 1),
unmoved_heads AS (
    UPDATE conversations c SET runtime_version = h.runtime_version
      FROM unnest($31::uuid[], $32::bigint[]) AS h(id, runtime_version)
     WHERE c.id = ANY($31::uuid[]) AND c.id = h.id
    RETURNING 1),
frames AS (
    INSERT INTO activities
        (conversation_id, seq, id, type, sender_id, sender_role, data, metadata, extra,
         client_id, turn_seq, turn_revision, created_at)
    SELECT f.*, $15::timestamptz
      FROM unnest($3::uuid[], $4::bigint[], $5::text[], $6::text[], $7::text[], $8::text[],
                  $9::jsonb[], $10::jsonb[], $11::jsonb[], $12::text[], $13::bigint[],
                  $14::integer[])
        AS f(conversation_id, seq, id, type, sender_id, sender_role, data, metadata, extra,
             client_id, turn_seq, turn_revision)
    RETURNING 1),
new_turns AS (
    INSERT INTO turns (conversation_id, seq, revision, status, created_at)
    SELECT t.conversation_id, t.seq, 0, 'pending', $15::timestamptz
      FROM unnest($16::uuid[], $17::bigint[]) AS t(conversation_id, seq)
    RETURNING 1),
targets AS (
    SELECT s.fingerprint, s.first, s.count, found.address
      FROM unnest($18::uuid[], $19::bigint[], $20::integer[], $21::text[], $22::integer[],
                  $23::integer[]) AS s(conversation_id, seq, revision, fingerprint, first, count)
     CROSS JOIN LATERAL (
           SELECT t.ctid AS address FROM turns t
            WHERE t.conversation_id = s.conversation_id AND t.seq = s.seq
              AND t.revision = s.revision
            LIMIT 1) AS found),
settled AS (
    UPDATE turns t
       SET status = 'completed', result_fingerprint = targets.fingerprint,
           result_ids = ($5::text[])[targets.first:targets.first + targets.count - 1],
           result_seqs = ($4::bigint[])[targets.first:targets.first + targets.count - 1],
           completed_at = $15::timestamptz
      FROM targets
     WHERE t.ctid = ANY(ARRAY(SELECT targets.address FROM targets))
       AND t.ctid = targets.address
    RETURNING 1),
runtimes AS (
    INSERT INTO conversation_runtime (conversation_id, version, state)
    SELECT * FROM unnest($24::uuid[], $25::bigint[], $26::jsonb[])
    ON CONFLICT (conversation_id) DO UPDATE
       SET version = EXCLUDED.version, state = EXCLUDED.state, updated_at = now()
    RETURNING 1),
logged AS (
    INSERT INTO outbox (conversations, last_seqs, frames)
    SELECT $1::uuid[], $2::bigint[], $27::integer WHERE $27::integer > 0
    RETURNING id),
notified AS MATERIALIZED (
    SELECT converger_notify($28::text || logged.id::text || rest)
      FROM logged, unnest($29::text[]) AS rest)
SELECT (SELECT count(*) FROM settled),
       (SELECT count(*) FROM frames),
       (SELECT count(*) FROM notified)";
