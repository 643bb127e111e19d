//! Unanswered turns read back from the registry: for takeovers, for a node that starts serving
//! a channel, and for the status page.

use sqlx::Row;
use uuid::Uuid;

use crate::activities::{ACTIVITY_COLUMNS, Activity};
use crate::{Store, StoreError};

/// The seq of the newest frame of the turn that `$turn` (an SQL alias with `conversation_id`
/// and `seq`) names: its latest edit's, or the turn's own. The frame a pending turn is
/// delivered as.
macro_rules! newest_frame_seq {
    ($turn:literal) => {
        concat!(
            "coalesce((SELECT e.source_seq FROM turns e WHERE e.conversation_id = ",
            $turn,
            ".conversation_id AND e.seq = ",
            $turn,
            ".seq AND e.reason = 'edit' ORDER BY e.revision DESC LIMIT 1), ",
            $turn,
            ".seq)"
        )
    };
}

/// A turn as delivered to an agent.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingTurn {
    /// The frame to deliver: the turn's latest edit, or the turn itself.
    pub activity: Activity,
    /// The turn's seq (the original user frame's).
    pub turn_seq: i64,
    /// The latest revision.
    pub revision: i32,
    /// `edit` or `regenerate` for revisions above 0.
    pub reason: Option<String>,
}

impl Store {
    /// The turns among `seqs` that are still unanswered at their latest revision, in order.
    pub async fn pending_turns(
        &self,
        conversation_id: Uuid,
        seqs: &[i64],
    ) -> Result<Vec<PendingTurn>, StoreError> {
        // The frame delivered is the latest edit of the turn when there is one, else the turn.
        let columns = ACTIVITY_COLUMNS
            .split(", ")
            .map(|column| format!("shown.{column}"))
            .collect::<Vec<_>>()
            .join(", ");
        let rows = self
            .timed("pending_turns", async {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    concat!(
                        "SELECT {columns}, a.seq AS pending_seq, t.revision AS pending_revision, t.reason AS pending_reason
                     FROM activities a
                     JOIN LATERAL (
                         SELECT revision, status, reason FROM turns
                         WHERE conversation_id = a.conversation_id AND seq = a.seq
                         ORDER BY revision DESC LIMIT 1
                     ) t ON t.status = 'pending'
                     JOIN activities shown ON shown.conversation_id = a.conversation_id
                      AND shown.seq = ",
                        newest_frame_seq!("a"),
                        "
                     WHERE a.conversation_id = $1 AND a.seq = ANY($2)
                     ORDER BY a.seq"
                    ),
                    columns = columns
                )))
                .bind(conversation_id)
                .bind(seqs)
                .fetch_all(&self.pool)
                .await
            })
            .await?;
        rows.into_iter()
            .map(|row| {
                let activity = <Activity as sqlx::FromRow<_>>::from_row(&row)?;
                Ok(PendingTurn {
                    activity,
                    turn_seq: row.try_get("pending_seq")?,
                    revision: row.try_get("pending_revision")?,
                    reason: row.try_get("pending_reason")?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(StoreError::from)
    }
}

/// An unanswered turn of a channel, for the takeover memory of a node that starts serving it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct ChannelPendingTurn {
    /// Conversation.
    pub conversation_id: Uuid,
    /// The turn's seq.
    pub seq: i64,
    /// The seq of the turn's newest frame: its latest edit's, or the turn's own.
    pub frame_seq: i64,
    /// The turn's latest revision.
    pub revision: i32,
    /// Why that revision exists (`edit` or `regenerate`), above revision 0.
    pub reason: Option<String>,
    /// When its latest revision was opened (database clock, ms).
    pub at_ms: i64,
}

impl Store {
    /// The channel's turns whose latest revision is unanswered and younger than `horizon`, and
    /// opened after `opened_after_ms` when that is named (database clock, ms), oldest first, at
    /// most `limit`.
    pub async fn pending_turns_of_channel(
        &self,
        channel_id: Uuid,
        horizon: std::time::Duration,
        opened_after_ms: Option<i64>,
        limit: i64,
    ) -> Result<Vec<ChannelPendingTurn>, StoreError> {
        let rows = self
            .timed("pending_turns_of_channel", async {
                sqlx::query_as::<_, ChannelPendingTurn>(concat!(
                    "SELECT t.conversation_id, t.seq, ",
                    newest_frame_seq!("t"),
                    " AS frame_seq, t.revision, t.reason,
                            floor(extract(epoch FROM t.created_at) * 1000)::bigint AS at_ms
                     FROM turns t JOIN conversations c ON c.id = t.conversation_id
                     WHERE t.status = 'pending'
                       AND t.created_at > now() - make_interval(secs => $2)
                       AND ($4::bigint IS NULL
                            OR t.created_at > to_timestamp($4::bigint / 1000.0))
                       AND c.channel_id = $1
                       AND NOT EXISTS (
                           SELECT 1 FROM turns later
                           WHERE later.conversation_id = t.conversation_id
                             AND later.seq = t.seq AND later.revision > t.revision)
                     ORDER BY t.created_at, t.conversation_id, t.seq
                     LIMIT $3"
                ))
                .bind(channel_id)
                .bind(horizon.as_secs_f64())
                .bind(limit)
                .bind(opened_after_ms)
                .fetch_all(&self.pool)
                .await
            })
            .await?;
        Ok(rows)
    }
}

impl Store {
    /// Turns of the last hour still waiting for an answer, cluster-wide (the status page).
    pub async fn unanswered_turns(&self) -> Result<i64, StoreError> {
        let count = self
            .timed("unanswered_turns", async {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM turns t
                     WHERE t.status = 'pending' AND t.created_at > now() - interval '1 hour'
                       AND NOT EXISTS (
                           SELECT 1 FROM turns later
                           WHERE later.conversation_id = t.conversation_id
                             AND later.seq = t.seq AND later.revision > t.revision)",
                )
                .fetch_one(&self.pool)
                .await
            })
            .await?;
        Ok(count)
    }

    /// Frames committed per second over the last `window_secs`, cluster-wide, from the outbox.
    pub async fn committed_per_second(&self, window_secs: u32) -> Result<f64, StoreError> {
        let frames = self
            .timed("committed_per_second", async {
                sqlx::query_scalar::<_, i64>(
                    "SELECT coalesce(sum(coalesce(frames, seq_to - seq_from + 1)), 0)::bigint FROM outbox
                     WHERE (seq_to IS NOT NULL OR frames IS NOT NULL)
                       AND created_at > now() - make_interval(secs => $1)",
                )
                .bind(f64::from(window_secs))
                .fetch_one(&self.pool)
                .await
            })
            .await?;
        Ok(frames as f64 / f64::from(window_secs.max(1)))
    }

    /// The conversation's turns at or below `up_to` whose latest revision is unanswered.
    pub async fn pending_turns_up_to(
        &self,
        conversation_id: Uuid,
        up_to: i64,
    ) -> Result<Vec<ChannelPendingTurn>, StoreError> {
        let rows = self
            .timed("pending_turns_up_to", async {
                sqlx::query_as::<_, ChannelPendingTurn>(concat!(
                    "SELECT t.conversation_id, t.seq, ",
                    newest_frame_seq!("t"),
                    " AS frame_seq, t.revision, t.reason,
                            floor(extract(epoch FROM t.created_at) * 1000)::bigint AS at_ms
                     FROM turns t
                     WHERE t.conversation_id = $1 AND t.seq <= $2 AND t.status = 'pending'
                       AND NOT EXISTS (
                           SELECT 1 FROM turns later
                           WHERE later.conversation_id = t.conversation_id
                             AND later.seq = t.seq AND later.revision > t.revision)
                     ORDER BY t.seq"
                ))
                .bind(conversation_id)
                .bind(up_to)
                .fetch_all(&self.pool)
                .await
            })
            .await?;
        Ok(rows)
    }
}
