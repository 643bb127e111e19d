//! What a node publishes on the bus: one `pg_notify` per event, or, for stream events, as few
//! notifications as their size allows in one statement; a payload too large for a
//! notification goes through an outbox row that the notification names.

use std::time::Duration;

use serde_json::Value;
use uuid::Uuid;

use super::{DisconnectOrder, INLINE_PAYLOAD_LIMIT, Payload, TransientFrame, TurnStop};
use crate::{NOTIFY_CHANNEL, Store, StoreError};

impl Store {
    /// Publishes a regenerated turn, opened at `opened_at_ms`, to every node (this one
    /// included; it skips its own).
    pub async fn publish_regenerated(
        &self,
        node: &str,
        channel_id: Uuid,
        conversation_id: Uuid,
        turn: (i64, i32),
        opened_at_ms: i64,
    ) -> Result<(), StoreError> {
        let (seq, revision) = turn;
        let payload = Payload::Regenerated {
            node: node.to_owned(),
            channel_id,
            conversation_id,
            seq,
            revision,
            opened_at_ms: Some(opened_at_ms),
        };
        let text = serde_json::to_string(&payload)
            .map_err(|error| StoreError::Config(error.to_string()))?;
        self.notify(&text).await
    }

    /// Publishes a stopped turn to every node (this one included; it skips its own).
    pub async fn publish_turn_stop(&self, stop: &TurnStop) -> Result<(), StoreError> {
        let text = serde_json::to_string(&Payload::TurnStopped(stop.clone()))
            .map_err(|error| StoreError::Config(error.to_string()))?;
        self.notify(&text).await
    }

    /// Publishes transient frames to every node (this one included; it skips its own): those
    /// that fit a notification with one statement, each larger one through an outbox row.
    pub async fn publish_transients(
        &self,
        transients: &[TransientFrame],
    ) -> Result<(), StoreError> {
        let mut inline = Vec::new();
        for transient in transients {
            let payload = Payload::Transient(transient.clone());
            let text = serde_json::to_string(&payload)
                .map_err(|error| StoreError::Config(error.to_string()))?;
            if text.len() <= INLINE_PAYLOAD_LIMIT {
                inline.push(text);
                continue;
            }
            // The frames before it go first: transient frames keep their order.
            self.notify_all(std::mem::take(&mut inline)).await?;
            self.publish_transient_through_outbox(transient.conversation_id, &payload)
                .await?;
        }
        if let [text] = inline.as_slice() {
            return self.notify(text).await;
        }
        self.notify_all(inline).await
    }

    async fn publish_transient_through_outbox(
        &self,
        conversation_id: Uuid,
        payload: &Payload,
    ) -> Result<(), StoreError> {
        let stored =
            serde_json::to_value(payload).map_err(|error| StoreError::Config(error.to_string()))?;
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

    /// Publishes stream events to every node (this one included; it skips its own) with one
    /// statement: the events are packed into as few notifications as their size allows, all
    /// sent by one `pg_notify` over an array, so a flush costs one transaction however many
    /// chunks it carries. Each event is one JSON text; one too large for a notification travels
    /// through the outbox.
    pub async fn publish_streams(
        &self,
        node: &str,
        events: &[impl AsRef<str> + Sync],
    ) -> Result<(), StoreError> {
        let mut inline = Vec::new();
        for payload in pack_stream_events(node, events)? {
            match payload {
                Packed::Inline(text) => inline.push(text),
                Packed::Outbox(text) => {
                    self.notify_all(std::mem::take(&mut inline)).await?;
                    self.publish_through_outbox(&text).await?;
                }
            }
        }
        self.notify_all(inline).await
    }

    async fn notify_all(&self, payloads: Vec<String>) -> Result<(), StoreError> {
        if payloads.is_empty() {
            return Ok(());
        }
        self.timed("notify_many", async {
            sqlx::query("SELECT count(pg_notify($1, payload)) FROM unnest($2::text[]) AS payload")
                .bind(NOTIFY_CHANNEL)
                .bind(payloads)
                .execute(&self.pool)
                .await
        })
        .await?;
        Ok(())
    }

    async fn publish_through_outbox(&self, text: &str) -> Result<(), StoreError> {
        let stored: Value =
            serde_json::from_str(text).map_err(|error| StoreError::Config(error.to_string()))?;
        self.timed("publish_streams_ref", async {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "WITH event AS (INSERT INTO outbox (payload) VALUES ($1) RETURNING id)
                 SELECT pg_notify('{NOTIFY_CHANNEL}', json_build_object('k', 'tr', 'e', id)::text)::text FROM event"
            )))
            .bind(stored)
            .execute(&self.pool)
            .await
        })
        .await?;
        Ok(())
    }

    /// Publishes a channel status change to every node. It is kept in the outbox as well, so a
    /// node whose listener was down at that moment still learns it from the catch-up.
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
        self.publish_kept("publish_channel_status", &payload).await
    }

    /// Publishes a disconnect order to every node (this one included: its listener hears it
    /// too). Kept in the outbox, so a node whose listener was down then still carries it out.
    pub async fn publish_disconnect(&self, order: &DisconnectOrder) -> Result<(), StoreError> {
        self.publish_kept("publish_disconnect", &Payload::Disconnect(order.clone()))
            .await
    }

    /// Notifies every node of `payload` and keeps it in the outbox, for the catch-up of a node
    /// whose listener was down.
    async fn publish_kept(
        &self,
        operation: &'static str,
        payload: &Payload,
    ) -> Result<(), StoreError> {
        let stored =
            serde_json::to_value(payload).map_err(|error| StoreError::Config(error.to_string()))?;
        self.timed(operation, async {
            sqlx::query(
                "WITH event AS (INSERT INTO outbox (payload) VALUES ($1) RETURNING payload)
                 SELECT converger_notify(payload::text)::text FROM event",
            )
            .bind(stored)
            .execute(&self.pool)
            .await
        })
        .await?;
        Ok(())
    }

    /// Records how many sockets `node_id` closed for a disconnect order (once per node: a
    /// repeated order, from a catch-up, keeps the first report).
    pub async fn report_disconnect(
        &self,
        request_id: Uuid,
        node_id: &str,
        closed: usize,
    ) -> Result<(), StoreError> {
        let closed = i32::try_from(closed).unwrap_or(i32::MAX);
        self.timed("report_disconnect", async {
            sqlx::query(
                "INSERT INTO disconnect_reports (request_id, node_id, closed) VALUES ($1, $2, $3)
                 ON CONFLICT (request_id, node_id) DO NOTHING",
            )
            .bind(request_id)
            .bind(node_id)
            .bind(closed)
            .execute(&self.pool)
            .await
        })
        .await?;
        Ok(())
    }

    /// The reports of a disconnect order so far: (node, sockets closed).
    pub async fn disconnect_reports(
        &self,
        request_id: Uuid,
    ) -> Result<Vec<(String, i32)>, StoreError> {
        self.timed("disconnect_reports", async {
            sqlx::query_as(
                "SELECT node_id, closed FROM disconnect_reports WHERE request_id = $1
                 ORDER BY node_id",
            )
            .bind(request_id)
            .fetch_all(&self.pool)
            .await
        })
        .await
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
                // Disconnect reports are read only while their request waits: as short-lived.
                sqlx::query(
                    "WITH reports AS (
                         DELETE FROM disconnect_reports
                         WHERE reported_at < now() - make_interval(secs => $1)
                     )
                     DELETE FROM outbox WHERE created_at < now() - make_interval(secs => $1)",
                )
                .bind(retention.as_secs_f64())
                .execute(&self.pool)
                .await
            })
            .await?;
        Ok(result.rows_affected())
    }
}

/// A stream payload, small enough for a notification or not.
#[derive(Debug, PartialEq)]
enum Packed {
    Inline(String),
    Outbox(String),
}

/// Stream events (each a JSON text), in order, packed into as few texts of at most `limit`
/// bytes as fit (an event larger than `limit` alone), for a bus other than Postgres.
pub fn encode_streams(node: &str, events: &[impl AsRef<str>], limit: usize) -> Vec<String> {
    pack_stream_events_within(node, events, limit)
        .unwrap_or_default()
        .into_iter()
        .map(|(Packed::Inline(text) | Packed::Outbox(text))| text)
        .collect()
}

/// Packs stream events (each a JSON text), in order, into as few `Payload::Streams` texts as
/// the notification size allows.
fn pack_stream_events(node: &str, events: &[impl AsRef<str>]) -> Result<Vec<Packed>, StoreError> {
    pack_stream_events_within(node, events, INLINE_PAYLOAD_LIMIT)
}

fn pack_stream_events_within(
    node: &str,
    events: &[impl AsRef<str>],
    limit: usize,
) -> Result<Vec<Packed>, StoreError> {
    let node_json =
        serde_json::to_string(node).map_err(|error| StoreError::Config(error.to_string()))?;
    let head = format!(r#"{{"k":"st","n":{node_json},"e":["#);
    let tail = "]}";
    let fits = |body: usize| head.len() + body + tail.len() <= limit;
    let mut packed = Vec::new();
    let mut current = String::new();
    for text in events {
        let text = text.as_ref();
        if !fits(text.len()) {
            if !current.is_empty() {
                packed.push(Packed::Inline(format!("{head}{current}{tail}")));
                current.clear();
            }
            packed.push(Packed::Outbox(format!("{head}{text}{tail}")));
            continue;
        }
        if !current.is_empty() && !fits(current.len() + 1 + text.len()) {
            packed.push(Packed::Inline(format!("{head}{current}{tail}")));
            current.clear();
        }
        if !current.is_empty() {
            current.push(',');
        }
        current.push_str(text);
    }
    if !current.is_empty() {
        packed.push(Packed::Inline(format!("{head}{current}{tail}")));
    }
    Ok(packed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::{BusEvent, to_events};

    #[test]
    fn stream_events_pack_in_order_within_the_notification_size() {
        let events: Vec<Value> = (0..500)
            .map(|index| serde_json::json!({"s": "s-1", "i": index, "b": {"text": "word "}}))
            .chain([serde_json::json!({"s": "s-1", "i": 500, "b": {"text": "x".repeat(9_000)}})])
            .chain([serde_json::json!({"s": "s-1", "i": 501})])
            .collect();
        let texts: Vec<String> = events.iter().map(Value::to_string).collect();
        let packed = pack_stream_events("node-\"1\"", &texts).unwrap();
        assert!(packed.len() > 2, "split over several notifications");
        let mut seen = Vec::new();
        for payload in &packed {
            let (Packed::Inline(text) | Packed::Outbox(text)) = payload;
            if matches!(payload, Packed::Inline(_)) {
                assert!(text.len() <= INLINE_PAYLOAD_LIMIT);
            }
            let Some(BusEvent::Streams { node, events }) =
                to_events(serde_json::from_str::<Payload>(text).unwrap()).pop()
            else {
                panic!("a streams payload");
            };
            assert_eq!(node, "node-\"1\"");
            seen.extend(events);
        }
        assert_eq!(seen, events, "every event once, in order");
        assert!(matches!(packed[packed.len() - 2], Packed::Outbox(_)));
    }

    #[test]
    fn a_nodes_own_stream_notifications_are_known_by_their_start() {
        let texts = vec![serde_json::json!({"s": "s-1", "i": 0}).to_string()];
        for node in ["a", "node-\"1\""] {
            let Packed::Inline(text) = &pack_stream_events(node, &texts).unwrap()[0] else {
                panic!("a small event is inline");
            };
            assert!(text.starts_with(&super::super::listener::own_streams_prefix(node)));
            assert!(!text.starts_with(&super::super::listener::own_streams_prefix("b")));
        }
    }
}
