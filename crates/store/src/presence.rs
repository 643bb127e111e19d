//! Presence counted across the cluster (ADR 0024): each node incarnation's open connections per
//! (conversation, participant), changed under an advisory lock on that pair so the total read
//! back is the cluster's and one change alone sees it cross between 0 and 1.

use uuid::Uuid;

use crate::{Store, StoreError};

/// Pairs forgotten per transaction when a node incarnation is gone (each holds a lock).
const FORGET_BATCH: i64 = 100;

/// A node incarnation: its id and its start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incarnation<'a> {
    /// The node id.
    pub node_id: &'a str,
    /// Its generation (start time, ms).
    pub generation: i64,
}

/// Whose connections [`Store::forget_presence`] removes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone<'a> {
    /// One incarnation (a dead node).
    Exactly(Incarnation<'a>),
    /// Every incarnation of the node but this one (at start: what a killed predecessor left).
    AllBut(Incarnation<'a>),
}

/// One connection of a participant counted in (`joined`) or out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PresenceChange {
    /// Conversation.
    pub conversation_id: Uuid,
    /// Participant.
    pub participant_id: String,
    /// In (opened) or out (closed).
    pub joined: bool,
}

/// A participant's connections over the cluster after a change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PresenceTotal {
    /// Conversation.
    pub conversation_id: Uuid,
    /// The conversation's channel.
    pub channel_id: Uuid,
    /// Participant.
    pub participant_id: String,
    /// Open connections on every node.
    pub connections: i64,
}

impl Store {
    /// Counts connections in or out on `node`, each change in the order given and under its
    /// pair's lock, in one round trip; returns each change's participant's connections over
    /// the cluster right after that change, as if it had been made alone. An empty batch costs
    /// nothing.
    pub async fn change_presence(
        &self,
        changes: &[PresenceChange],
        node: Incarnation<'_>,
    ) -> Result<Vec<i64>, StoreError> {
        if changes.is_empty() {
            return Ok(Vec::new());
        }
        let conversations: Vec<Uuid> = changes.iter().map(|c| c.conversation_id).collect();
        let participants: Vec<&str> = changes.iter().map(|c| c.participant_id.as_str()).collect();
        let joined: Vec<bool> = changes.iter().map(|c| c.joined).collect();
        let totals: Vec<i64> = self
            .timed("change_presence", async {
                sqlx::query_scalar("SELECT converger_change_presence($1, $2, $3, $4, $5)")
                    .bind(&conversations)
                    .bind(&participants)
                    .bind(&joined)
                    .bind(node.node_id)
                    .bind(node.generation)
                    .fetch_one(&self.pool)
                    .await
            })
            .await?;
        if totals.len() != changes.len() {
            return Err(StoreError::Database(sqlx::Error::Protocol(format!(
                "converger_change_presence returned {} totals for {} changes",
                totals.len(),
                changes.len()
            ))));
        }
        Ok(totals)
    }

    /// Removes the connections of gone node incarnations; returns, for each participant they
    /// counted, its connections over the cluster after the removal. Another node doing the same
    /// at once finds nothing left and returns nothing, so each is announced once.
    pub async fn forget_presence(&self, gone: Gone<'_>) -> Result<Vec<PresenceTotal>, StoreError> {
        let (node, exact) = match gone {
            Gone::Exactly(node) => (node, true),
            Gone::AllBut(node) => (node, false),
        };
        let mut totals = Vec::new();
        loop {
            let batch = self.forget_batch(node, exact).await?;
            let done = (batch.len() as i64) < FORGET_BATCH;
            totals.extend(batch);
            if done {
                return Ok(totals);
            }
        }
    }

    /// One transaction of [`Store::forget_presence`]: up to [`FORGET_BATCH`] pairs, locked in
    /// (conversation, participant) order, the order in which a batch of changes takes its
    /// pairs' locks too (ADR 0043), so no cycle forms.
    async fn forget_batch(
        &self,
        node: Incarnation<'_>,
        exact: bool,
    ) -> Result<Vec<PresenceTotal>, StoreError> {
        const GONE: &str = "node_id = $1 AND (generation = $2) = $3";
        self.timed("forget_presence", async {
            let mut transaction = self.pool.begin().await?;
            let pairs: Vec<(Uuid, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT DISTINCT conversation_id, participant_id FROM presence_connections
                 WHERE {GONE} ORDER BY conversation_id, participant_id LIMIT $4"
            )))
            .bind(node.node_id)
            .bind(node.generation)
            .bind(exact)
            .bind(FORGET_BATCH)
            .fetch_all(&mut *transaction)
            .await?;
            if pairs.is_empty() {
                return Ok(Vec::new());
            }
            let (conversations, participants): (Vec<Uuid>, Vec<String>) = pairs.into_iter().unzip();
            sqlx::query(
                "SELECT pg_advisory_xact_lock(hashtextextended(k.c::text || '/' || k.p, 0))
                 FROM unnest($1::uuid[], $2::text[]) WITH ORDINALITY AS k(c, p, n) ORDER BY k.n",
            )
            .bind(&conversations)
            .bind(&participants)
            .execute(&mut *transaction)
            .await?;
            // Only what this transaction deleted is announced: another node removing the same
            // incarnation at once waited for the locks and finds nothing left.
            let deleted: Vec<(Uuid, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "DELETE FROM presence_connections
                 USING unnest($4::uuid[], $5::text[]) AS k(c, p)
                 WHERE {GONE} AND conversation_id = k.c AND participant_id = k.p
                 RETURNING conversation_id, participant_id"
            )))
            .bind(node.node_id)
            .bind(node.generation)
            .bind(exact)
            .bind(&conversations)
            .bind(&participants)
            .fetch_all(&mut *transaction)
            .await?;
            let deleted: std::collections::BTreeSet<(Uuid, String)> = deleted.into_iter().collect();
            let (conversations, participants): (Vec<Uuid>, Vec<String>) =
                deleted.into_iter().unzip();
            // With each conversation's channel, whose agents the caller tells; a conversation
            // gone meanwhile drops out.
            let totals: Vec<(Uuid, Uuid, String, i64)> = sqlx::query_as(
                "SELECT k.c, c.channel_id, k.p,
                        coalesce((SELECT sum(x.connections) FROM presence_connections x
                                  WHERE x.conversation_id = k.c AND x.participant_id = k.p),
                                 0)::bigint
                 FROM unnest($1::uuid[], $2::text[]) AS k(c, p)
                 JOIN conversations c ON c.id = k.c",
            )
            .bind(&conversations)
            .bind(&participants)
            .fetch_all(&mut *transaction)
            .await?;
            transaction.commit().await?;
            Ok(totals
                .into_iter()
                .map(
                    |(conversation_id, channel_id, participant_id, connections)| PresenceTotal {
                        conversation_id,
                        channel_id,
                        participant_id,
                        connections,
                    },
                )
                .collect())
        })
        .await
    }
}

impl Store {
    /// End users' connections to the conversation over the cluster, as presence counts them.
    pub async fn conversation_connections(&self, conversation_id: Uuid) -> Result<i64, StoreError> {
        self.timed("conversation_connections", async {
            sqlx::query_scalar(
                "SELECT coalesce(sum(connections), 0)::bigint FROM presence_connections
                 WHERE conversation_id = $1",
            )
            .bind(conversation_id)
            .fetch_one(&self.pool)
            .await
        })
        .await
    }
}
