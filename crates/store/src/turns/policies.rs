//! A user's send under a turn policy other than `enqueue` (ADR 0029): one transaction that
//! locks the conversation row, reads the turns still waiting for their answer, asks the caller
//! what the policy makes of them, and then either refuses the send or stops those turns
//! (`stopping`, reason `superseded`, marked rolled back for `rollback`) and commits the frame
//! with the group commit's statements, in this transaction. Under the row lock no other send, stop or close of the
//! conversation interleaves, so the decision holds.

use uuid::Uuid;

use super::stops::StoppedTurn;
use super::{lock_open, unanswered_turns};
use crate::activities::{ACTIVITY_COLUMNS, Activity, CommitOutcome, NewActivity};
use crate::{Store, StoreError};

/// What the caller decided for the running turns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyVerdict {
    /// Commit the send, stopping these turns first.
    Commit {
        /// The turns to stop, from the ones given.
        stop: Vec<StoppedTurn>,
        /// Whether they leave the chat view (`rollback`).
        rollback: bool,
    },
    /// Refuse the send: this turn is running.
    Refuse {
        /// The running turn's seq.
        seq: i64,
    },
}

/// A send committed under a policy.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyCommit {
    /// The frame, or the earlier one with the same key (`duplicate`).
    pub outcome: CommitOutcome,
    /// The turns it stopped (none for a duplicate).
    pub stopped: Vec<StoppedTurn>,
    /// The conversation's channel.
    pub channel_id: Uuid,
}

impl Store {
    /// Commits a user's frame after `decide` judged the conversation's running turns (see the
    /// module comment). `TurnInProgress` for a refusal, `ConversationClosed` /
    /// `ConversationNotFound` as for any send; a resend of a stored key is its duplicate.
    pub async fn commit_with_policy(
        &self,
        new: &NewActivity,
        decide: impl FnOnce(&[StoppedTurn]) -> PolicyVerdict + Send,
    ) -> Result<PolicyCommit, StoreError> {
        if !new.is_storable() {
            return Err(StoreError::unstorable());
        }
        self.timed("commit_with_policy", async {
            let mut transaction = self.pool.begin().await?;
            let channel_id = match lock_open(&mut transaction, new.conversation_id).await? {
                Ok(channel_id) => channel_id,
                Err(refused) => return Ok(Err(refused)),
            };
            // A resend is answered as before, whatever runs now.
            if let Some(client_id) = &new.client_id {
                let earlier: Option<Activity> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                    "SELECT {ACTIVITY_COLUMNS} FROM activities
                             WHERE conversation_id = $1 AND sender_id = $2 AND client_id = $3"
                )))
                .bind(new.conversation_id)
                .bind(&new.sender.id)
                .bind(client_id)
                .fetch_optional(&mut *transaction)
                .await?;
                if let Some(activity) = earlier {
                    return Ok(Ok(PolicyCommit {
                        outcome: CommitOutcome {
                            activity,
                            duplicate: true,
                        },
                        stopped: Vec::new(),
                        channel_id,
                    }));
                }
            }
            // A turn being stopped is not running: it settles by itself.
            let running: Vec<StoppedTurn> = unanswered_turns(&mut transaction, new.conversation_id)
                .await?
                .into_iter()
                .filter(|(_, status)| status == "pending")
                .map(|(turn, _)| turn)
                .collect();
            let (stop, rollback) = match decide(&running) {
                PolicyVerdict::Refuse { seq } => {
                    return Ok(Err(StoreError::TurnInProgress { seq }));
                }
                PolicyVerdict::Commit { stop, rollback } => (stop, rollback),
            };
            for turn in &stop {
                sqlx::query(
                    "UPDATE turns
                         SET status = 'stopping', stop_reason = 'superseded',
                             stop_requested_at = now(), rolled_back = $4
                         WHERE conversation_id = $1 AND seq = $2 AND revision = $3
                           AND status = 'pending'",
                )
                .bind(new.conversation_id)
                .bind(turn.seq)
                .bind(turn.revision)
                .bind(rollback)
                .execute(&mut *transaction)
                .await?;
            }
            let stored =
                crate::group_commit::frame_in_transaction(&mut transaction, new.clone()).await?;
            let outcome = match stored {
                Ok(Some(outcome)) => outcome,
                Ok(None) => return Ok(Err(StoreError::ConversationClosed)),
                Err(error) => return Ok(Err(error)),
            };
            transaction.commit().await?;
            Ok(Ok(PolicyCommit {
                outcome,
                stopped: stop,
                channel_id,
            }))
        })
        .await?
    }
}
