//! New revisions of a turn: an `edit` (a new frame) or a `regenerate` (a registry row only).

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::activities::{ACTIVITY_COLUMNS, Activity};
use crate::{Store, StoreError};

/// A new revision of a turn (edit or regenerate).
#[derive(Debug, Clone, PartialEq)]
pub struct Revision {
    /// The turn's seq.
    pub turn_seq: i64,
    /// The new revision.
    pub revision: i32,
    /// When it was opened, the time its owners are decided at: the edit frame's commit time,
    /// or the regenerate's registry row's `created_at`.
    pub opened_at: DateTime<Utc>,
    /// For an edit: the stored edit frame (its own seq); `None` for a regenerate.
    pub edit: Option<Activity>,
    /// True when the idempotency key matched an earlier edit (nothing new).
    pub duplicate: bool,
}

/// One revision of a turn that was revised (edited or regenerated), as the chat view reads it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct RevisionRecord {
    /// The turn's seq.
    pub seq: i64,
    /// The revision.
    pub revision: i32,
    /// For an edit, the seq of its frame.
    pub edit_seq: Option<i64>,
    /// The seqs of the revision's committed answer.
    pub answer_seqs: Vec<i64>,
    /// The `id` of the turn's original frame.
    pub turn_id: String,
    /// A newer turn rolled this revision back (ADR 0029).
    pub rolled_back: bool,
}

impl Store {
    /// Every revision of every turn of the conversation that has more than one or was rolled
    /// back, by seq and revision (other turns are not listed).
    pub async fn revised_turns(
        &self,
        conversation_id: Uuid,
    ) -> Result<Vec<RevisionRecord>, StoreError> {
        self.timed("revised_turns", async {
            sqlx::query_as::<_, RevisionRecord>(
                "SELECT t.seq, t.revision,
                        CASE WHEN t.reason = 'edit' THEN t.source_seq END AS edit_seq,
                        coalesce(t.result_seqs, '{}') AS answer_seqs, a.id AS turn_id,
                        t.rolled_back
                 FROM turns t
                 JOIN activities a ON a.conversation_id = t.conversation_id AND a.seq = t.seq
                 WHERE t.conversation_id = $1
                   AND EXISTS (SELECT 1 FROM turns other
                               WHERE other.conversation_id = t.conversation_id
                                 AND other.seq = t.seq
                                 AND (other.revision > 0 OR other.rolled_back))
                 ORDER BY t.seq, t.revision",
            )
            .bind(conversation_id)
            .fetch_all(&self.pool)
            .await
        })
        .await
    }

    /// The user turn an `edit` or `regenerate` targets: `seq` if given; else `message_id`
    /// matched against a frame id, then against the user's clientIds; else the latest turn.
    /// Only the user's own turns (revision-0 rows of the registry) qualify.
    pub async fn resolve_turn(
        &self,
        conversation_id: Uuid,
        user_id: &str,
        seq: Option<i64>,
        message_id: Option<&str>,
    ) -> Result<Option<Activity>, StoreError> {
        let columns = ACTIVITY_COLUMNS
            .split(", ")
            .map(|column| format!("a.{column}"))
            .collect::<Vec<_>>()
            .join(", ");
        // A message id is found through the index of id hashes (ADR 0040), the id compared too.
        let found = self
            .timed("resolve_turn", async {
                sqlx::query_as::<_, Activity>(sqlx::AssertSqlSafe(format!(
                    "SELECT {columns} FROM activities a
                     JOIN turns t ON t.conversation_id = a.conversation_id AND t.seq = a.seq AND t.revision = 0
                     WHERE a.conversation_id = $1 AND a.sender_role = 'user' AND a.sender_id = $2
                       AND ($3::bigint IS NULL OR a.seq = $3)
                       AND ($3::bigint IS NOT NULL OR $4::text IS NULL OR (hashtextextended(a.id, 0) = hashtextextended($4, 0) AND a.id = $4) OR a.client_id = $4)
                     ORDER BY CASE WHEN a.id = $4 THEN 0 ELSE 1 END, a.seq DESC
                     LIMIT 1"
                )))
                .bind(conversation_id)
                .bind(user_id)
                .bind(seq)
                .bind(message_id)
                .fetch_optional(&self.pool)
                .await
            })
            .await?;
        // An unknown messageId falls back to the latest turn.
        if found.is_none() && seq.is_none() && message_id.is_some() {
            return Box::pin(self.resolve_turn(conversation_id, user_id, None, None)).await;
        }
        Ok(found)
    }

    /// Opens revision + 1 of a turn. With `edit` = (type, data, clientId) the edit is stored as
    /// a new persistent frame (`replaces: <seq>`) in the same statement; without, nothing is
    /// stored but the registry row (regenerate).
    pub async fn open_revision(
        &self,
        target: &Activity,
        edit: Option<(&str, &Value, Option<&str>)>,
        regenerate_key: Option<&str>,
    ) -> Result<Revision, StoreError> {
        let Some((kind, data, client_id)) = edit else {
            return self.regenerate(target, regenerate_key).await;
        };
        if let Some(client_id) = client_id {
            let existing = self
                .timed("edit_by_client_id", async {
                    sqlx::query_as::<_, Activity>(sqlx::AssertSqlSafe(format!(
                        "SELECT {ACTIVITY_COLUMNS} FROM activities WHERE conversation_id = $1 AND sender_id = $2 AND client_id = $3"
                    )))
                    .bind(target.conversation_id)
                    .bind(&target.sender_id)
                    .bind(client_id)
                    .fetch_optional(&self.pool)
                    .await
                })
                .await?;
            if let Some(existing) = existing {
                let revision = existing.turn_revision.unwrap_or(0);
                return Ok(Revision {
                    turn_seq: target.seq,
                    revision,
                    opened_at: existing.created_at,
                    edit: Some(existing),
                    duplicate: true,
                });
            }
        }
        let extra = json!({"replaces": target.seq});
        let sql = format!(
            "WITH revision AS (
                 SELECT max(revision) + 1 AS next FROM turns WHERE conversation_id = $1 AND seq = $2
             ), conv AS (
                 UPDATE conversations SET last_seq = last_seq + 1, updated_at = now()
                 WHERE id = $1 AND status = 'open' RETURNING id, last_seq, channel_id
             ), act AS (
                 INSERT INTO activities
                     (conversation_id, seq, id, type, sender_id, sender_role, data, extra, client_id, turn_seq, turn_revision, created_at)
                 SELECT conv.id, conv.last_seq, $3, $4, $5, 'user', $6, $7, $8, $2, revision.next, clock_timestamp() FROM conv, revision
                 RETURNING {ACTIVITY_COLUMNS}
             ), turn AS (
                 -- Opened when the edit frame was committed: its owners are decided then.
                 INSERT INTO turns
                     (conversation_id, seq, revision, status, reason, source_seq, created_at)
                 SELECT conversation_id, turn_seq, turn_revision, 'pending', 'edit', seq, created_at
                 FROM act
             ), event AS (
                 INSERT INTO outbox (conversation_id, seq_from, seq_to)
                 SELECT conversation_id, seq, seq FROM act RETURNING id, conversation_id, seq_from
             ), notified AS (
                 SELECT converger_notify(
                        json_build_object('k', 'c', 'e', event.id, 'c', event.conversation_id, 's', event.seq_from, 'h', conv.channel_id)::text)::text
                 FROM event, conv
             )
             SELECT {ACTIVITY_COLUMNS} FROM act WHERE (SELECT count(*) FROM notified) = 1"
        );
        let stored = self
            .timed("edit", async {
                sqlx::query_as::<_, Activity>(sqlx::AssertSqlSafe(sql))
                    .bind(target.conversation_id)
                    .bind(target.seq)
                    .bind(Uuid::now_v7().to_string())
                    .bind(kind)
                    .bind(&target.sender_id)
                    .bind(data)
                    .bind(extra)
                    .bind(client_id)
                    .fetch_optional(&self.pool)
                    .await
            })
            .await?
            .ok_or(StoreError::ConversationClosed)?;
        let revision = stored.turn_revision.unwrap_or(0);
        Ok(Revision {
            turn_seq: target.seq,
            revision,
            opened_at: stored.created_at,
            edit: Some(stored),
            duplicate: false,
        })
    }
}

impl Store {
    /// A regenerate: the registry row of revision + 1, idempotent by the client's key.
    async fn regenerate(
        &self,
        target: &Activity,
        client_id: Option<&str>,
    ) -> Result<Revision, StoreError> {
        if let Some(existing) = self
            .regenerate_by_key(target.conversation_id, client_id)
            .await?
        {
            return Ok(existing);
        }
        let inserted = self
            .timed("regenerate", async {
                sqlx::query_as::<_, (i32, DateTime<Utc>)>(
                    // The conversation row's share lock waits for a close in progress (then the
                    // status is read again and found closed), and a close that comes after
                    // waits for this revision, which its settling then sees.
                    "WITH open AS (
                         SELECT 1 FROM conversations WHERE id = $1 AND status = 'open' FOR SHARE
                     )
                     INSERT INTO turns (conversation_id, seq, revision, status, reason, client_id)
                     SELECT $1, $2, max(revision) + 1, 'pending', 'regenerate', $3 FROM turns
                     WHERE conversation_id = $1 AND seq = $2 AND EXISTS (SELECT 1 FROM open)
                     HAVING count(*) > 0
                     RETURNING revision, created_at",
                )
                .bind(target.conversation_id)
                .bind(target.seq)
                .bind(client_id)
                .fetch_optional(&self.pool)
                .await
            })
            .await;
        match inserted {
            Ok(None) => Err(StoreError::ConversationClosed),
            Ok(Some((revision, opened_at))) => Ok(Revision {
                turn_seq: target.seq,
                revision,
                opened_at,
                edit: None,
                duplicate: false,
            }),
            // A racing resend with the same key, or a racing revision of the same turn: the
            // key's row answers the first, and the second is retried once.
            Err(error) if error.is_unique_violation() => match self
                .regenerate_by_key(target.conversation_id, client_id)
                .await?
            {
                Some(existing) => Ok(existing),
                None => Box::pin(self.regenerate(target, client_id)).await,
            },
            Err(error) => Err(error),
        }
    }

    async fn regenerate_by_key(
        &self,
        conversation_id: Uuid,
        client_id: Option<&str>,
    ) -> Result<Option<Revision>, StoreError> {
        let Some(client_id) = client_id else {
            return Ok(None);
        };
        let row: Option<(i64, i32, DateTime<Utc>)> = self
            .timed("regenerate_by_key", async {
                sqlx::query_as(
                    "SELECT seq, revision, created_at FROM turns
                     WHERE conversation_id = $1 AND client_id = $2",
                )
                .bind(conversation_id)
                .bind(client_id)
                .fetch_optional(&self.pool)
                .await
            })
            .await?;
        Ok(row.map(|(turn_seq, revision, opened_at)| Revision {
            turn_seq,
            revision,
            opened_at,
            edit: None,
            duplicate: true,
        }))
    }
}
