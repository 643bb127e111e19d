//! The cross-node event bus: `pg_notify` on commit, one `LISTEN` per node, and a catch-up from
//! the outbox whenever the listening connection was lost (notifications sent during the gap are
//! gone, so the outbox is read back over the gap plus a safety margin). Receivers de-duplicate by
//! (conversation, seq) and read gaps from `activities`, so a repeated or lost notification never
//! breaks delivery.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::postgres::PgListener;
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::{NOTIFY_CHANNEL, Store, StoreError};

/// Largest payload sent inline by `pg_notify` (Postgres refuses 8,000 bytes and more); larger
/// transient frames travel through the outbox.
const INLINE_PAYLOAD_LIMIT: usize = 7_000;

/// Re-read this much extra outbox history after a lost connection, for commits that were in
/// flight when the connection dropped.
const CATCH_UP_MARGIN: Duration = Duration::from_secs(5);

/// Who a transient frame came from, so receivers can skip its author.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// Participant id.
    pub id: String,
    /// Participant role.
    pub role: String,
    /// The connection it came from.
    pub connection: String,
}

/// One event on the bus, as receivers see it.
#[derive(Debug, Clone, PartialEq)]
pub enum BusEvent {
    /// `seq` of a conversation was committed.
    Committed {
        /// Conversation.
        conversation_id: Uuid,
        /// The committed seq (the last of a batch).
        seq: i64,
    },
    /// A transient frame (typing, receipts, presence, relayed agent frames).
    Transient {
        /// Node that published it (it dispatched locally already).
        node: String,
        /// Conversation.
        conversation_id: Uuid,
        /// The frame as end users receive it.
        frame: Value,
        /// Its author, when it has one.
        origin: Option<Origin>,
    },
    /// A channel changed status.
    ChannelStatus {
        /// Node that published it.
        node: String,
        /// Channel.
        channel_id: Uuid,
        /// `active` or `inactive`.
        status: String,
    },
}

/// The JSON payloads of `pg_notify`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "k")]
enum Payload {
    #[serde(rename = "c")]
    Committed {
        #[serde(rename = "c")]
        conversation_id: Uuid,
        #[serde(rename = "s")]
        seq: i64,
    },
    #[serde(rename = "t")]
    Transient {
        #[serde(rename = "n")]
        node: String,
        #[serde(rename = "c")]
        conversation_id: Uuid,
        #[serde(rename = "f")]
        frame: Value,
        #[serde(rename = "o", default, skip_serializing_if = "Option::is_none")]
        origin: Option<Origin>,
    },
    /// A transient frame too large for a notification: its payload is in the outbox row.
    #[serde(rename = "tr")]
    TransientRef {
        #[serde(rename = "e")]
        outbox_id: i64,
    },
    #[serde(rename = "ch")]
    ChannelStatus {
        #[serde(rename = "n")]
        node: String,
        #[serde(rename = "ch")]
        channel_id: Uuid,
        #[serde(rename = "st")]
        status: String,
    },
}

impl Store {
    /// Publishes a transient frame to every node (this one included; it skips its own).
    pub async fn publish_transient(
        &self,
        node: &str,
        conversation_id: Uuid,
        frame: &Value,
        origin: Option<&Origin>,
    ) -> Result<(), StoreError> {
        let payload = Payload::Transient {
            node: node.to_owned(),
            conversation_id,
            frame: frame.clone(),
            origin: origin.cloned(),
        };
        let text = serde_json::to_string(&payload)
            .map_err(|error| StoreError::Config(error.to_string()))?;
        if text.len() <= INLINE_PAYLOAD_LIMIT {
            return self.notify(&text).await;
        }
        let stored = serde_json::to_value(&payload)
            .map_err(|error| StoreError::Config(error.to_string()))?;
        self.timed("publish_transient_ref", async {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "WITH event AS (
                     INSERT INTO outbox (conversation_id, payload) VALUES ($1, $2) RETURNING id
                 )
                 SELECT pg_notify('{NOTIFY_CHANNEL}', json_build_object('k', 'tr', 'e', id)::text)::text FROM event"
            )))
            .bind(conversation_id)
            .bind(stored)
            .execute(&self.pool)
            .await
        })
        .await?;
        Ok(())
    }

    /// Publishes a channel status change to every node.
    pub async fn publish_channel_status(
        &self,
        node: &str,
        channel_id: Uuid,
        status: &str,
    ) -> Result<(), StoreError> {
        let payload = Payload::ChannelStatus {
            node: node.to_owned(),
            channel_id,
            status: status.to_owned(),
        };
        let text = serde_json::to_string(&payload)
            .map_err(|error| StoreError::Config(error.to_string()))?;
        self.notify(&text).await
    }

    async fn notify(&self, payload: &str) -> Result<(), StoreError> {
        self.timed("notify", async {
            sqlx::query("SELECT pg_notify($1, $2)::text")
                .bind(NOTIFY_CHANNEL)
                .bind(payload)
                .execute(&self.pool)
                .await
        })
        .await?;
        Ok(())
    }

    /// Deletes outbox rows older than `retention`; returns how many.
    pub async fn prune_outbox(&self, retention: Duration) -> Result<u64, StoreError> {
        let result = self
            .timed("prune_outbox", async {
                sqlx::query(
                    "DELETE FROM outbox WHERE created_at < now() - make_interval(secs => $1)",
                )
                .bind(retention.as_secs_f64())
                .execute(&self.pool)
                .await
            })
            .await?;
        Ok(result.rows_affected())
    }

    /// Committed events of the last `window` (by the database clock), for a catch-up.
    async fn committed_since(&self, window: Duration) -> Result<Vec<BusEvent>, StoreError> {
        let rows: Vec<(Uuid, i64)> = self
            .timed("outbox_catch_up", async {
                sqlx::query_as(
                    "SELECT conversation_id, max(seq_to) FROM outbox
                     WHERE seq_to IS NOT NULL AND created_at >= now() - make_interval(secs => $1)
                     GROUP BY conversation_id",
                )
                .bind(window.as_secs_f64())
                .fetch_all(&self.pool)
                .await
            })
            .await?;
        Ok(rows
            .into_iter()
            .map(|(conversation_id, seq)| BusEvent::Committed {
                conversation_id,
                seq,
            })
            .collect())
    }

    async fn transient_by_ref(&self, outbox_id: i64) -> Result<Option<Payload>, StoreError> {
        let payload: Option<Value> = self
            .timed("outbox_payload", async {
                sqlx::query_scalar("SELECT payload FROM outbox WHERE id = $1")
                    .bind(outbox_id)
                    .fetch_optional(&self.pool)
                    .await
            })
            .await?
            .flatten();
        Ok(payload.and_then(|payload| serde_json::from_value(payload).ok()))
    }

    /// Starts this node's listener; events arrive on the returned channel until it is dropped.
    pub fn spawn_bus_listener(&self) -> mpsc::UnboundedReceiver<BusEvent> {
        let (events, receiver) = mpsc::unbounded_channel();
        tokio::spawn(run_listener(self.clone(), events));
        receiver
    }
}

fn to_event(payload: Payload) -> Option<BusEvent> {
    match payload {
        Payload::Committed {
            conversation_id,
            seq,
        } => Some(BusEvent::Committed {
            conversation_id,
            seq,
        }),
        Payload::Transient {
            node,
            conversation_id,
            frame,
            origin,
        } => Some(BusEvent::Transient {
            node,
            conversation_id,
            frame,
            origin,
        }),
        Payload::ChannelStatus {
            node,
            channel_id,
            status,
        } => Some(BusEvent::ChannelStatus {
            node,
            channel_id,
            status,
        }),
        Payload::TransientRef { .. } => None,
    }
}

async fn run_listener(store: Store, events: mpsc::UnboundedSender<BusEvent>) {
    let mut backoff = Duration::from_millis(100);
    // Set when the connection was (or may have been) lost; the catch-up covers since then.
    let mut trouble_since: Option<Instant> = None;
    let mut listener = loop {
        match connect_listener(&store).await {
            Ok(listener) => break listener,
            Err(StoreError::Database(sqlx::Error::PoolClosed)) => return,
            Err(error) => {
                tracing::warn!(%error, "event bus: cannot listen yet");
                if events.is_closed() {
                    return;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    };
    tracing::info!(channel = NOTIFY_CHANNEL, "event bus listening");
    loop {
        if events.is_closed() {
            return;
        }
        match listener.try_recv().await {
            Ok(Some(notification)) => {
                backoff = Duration::from_millis(100);
                let Ok(payload) = serde_json::from_str::<Payload>(notification.payload()) else {
                    tracing::warn!(
                        payload = notification.payload(),
                        "event bus: unreadable notification"
                    );
                    continue;
                };
                let payload = match payload {
                    Payload::TransientRef { outbox_id } => {
                        match store.transient_by_ref(outbox_id).await {
                            Ok(Some(payload)) => payload,
                            Ok(None) => continue,
                            Err(error) => {
                                tracing::warn!(%error, outbox_id, "event bus: transient payload unreadable");
                                continue;
                            }
                        }
                    }
                    payload => payload,
                };
                if let Some(event) = to_event(payload)
                    && events.send(event).is_err()
                {
                    return;
                }
            }
            // The connection was lost and (eagerly) re-established with LISTEN issued again:
            // whatever was notified in between is read back from the outbox.
            Ok(None) => {
                let since = trouble_since.take().unwrap_or_else(Instant::now);
                tracing::warn!(
                    "event bus: listener connection was lost; catching up from the outbox"
                );
                metrics::counter!("converger_bus_reconnects_total").increment(1);
                if let Err(error) =
                    catch_up(&store, &events, since.elapsed() + CATCH_UP_MARGIN).await
                {
                    tracing::warn!(%error, "event bus: catch-up failed; will retry");
                    trouble_since = Some(since);
                }
            }
            // The store is shutting down: release the connection so the pool can close.
            Err(sqlx::Error::PoolClosed) => return,
            Err(error) => {
                trouble_since.get_or_insert_with(Instant::now);
                tracing::warn!(%error, "event bus: listener error");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

async fn connect_listener(store: &Store) -> Result<PgListener, StoreError> {
    let mut listener = PgListener::connect_with(store.pool()).await?;
    listener.listen(NOTIFY_CHANNEL).await?;
    Ok(listener)
}

async fn catch_up(
    store: &Store,
    events: &mpsc::UnboundedSender<BusEvent>,
    window: Duration,
) -> Result<(), StoreError> {
    for event in store.committed_since(window).await? {
        if events.send(event).is_err() {
            break;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_round_trip() {
        let conversation_id = Uuid::nil();
        let committed: Payload = serde_json::from_str(&format!(
            r#"{{"k":"c","e":7,"c":"{conversation_id}","s":3}}"#
        ))
        .unwrap();
        assert_eq!(
            to_event(committed),
            Some(BusEvent::Committed {
                conversation_id,
                seq: 3
            })
        );
        let transient = Payload::Transient {
            node: "n1".into(),
            conversation_id,
            frame: serde_json::json!({"type": "typing"}),
            origin: None,
        };
        let text = serde_json::to_string(&transient).unwrap();
        assert!(text.contains(r#""k":"t""#));
        let back: Payload = serde_json::from_str(&text).unwrap();
        assert!(matches!(to_event(back), Some(BusEvent::Transient { .. })));
    }
}
