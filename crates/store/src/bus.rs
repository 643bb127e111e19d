//! The cross-node event bus: `pg_notify` on commit, one `LISTEN` per node, and a catch-up from
//! the outbox whenever the listening connection was lost (notifications sent during the gap are
//! gone, so the outbox is read back over the gap plus a safety margin). Receivers de-duplicate by
//! (conversation, seq) and read gaps from `activities`, so a repeated or lost notification never
//! breaks delivery.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::postgres::PgListener;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use crate::{Activity, NOTIFY_CHANNEL, Store, StoreError};

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

/// A frame that is not stored, as it travels between nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransientFrame {
    /// Node that published it (it dispatched locally already).
    #[serde(rename = "n")]
    pub node: String,
    /// The conversation's channel, so that other nodes' agents receive it too.
    #[serde(rename = "h", default, skip_serializing_if = "Option::is_none")]
    pub channel_id: Option<Uuid>,
    /// Conversation.
    #[serde(rename = "c")]
    pub conversation_id: Uuid,
    /// The frame.
    #[serde(rename = "f")]
    pub frame: Value,
    /// Its author, when it has one.
    #[serde(rename = "o", default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Origin>,
    /// For the channel's agents only (a forwarded client frame), not for end users.
    #[serde(rename = "a", default, skip_serializing_if = "std::ops::Not::not")]
    pub agents_only: bool,
}

/// One event on the bus, as receivers see it.
#[derive(Debug, Clone, PartialEq)]
pub enum BusEvent {
    /// Stream events (chunks, ends) of streamed answers, opaque to the store, from one node.
    Streams {
        /// Node that published them (it dispatched locally already).
        node: String,
        /// The events, in order.
        events: Vec<Value>,
    },
    /// `seq` of a conversation was committed.
    Committed {
        /// Conversation.
        conversation_id: Uuid,
        /// The committed seq (the last of a batch).
        seq: i64,
        /// The conversation's channel, when the event names it (catch-ups do not).
        channel_id: Option<Uuid>,
        /// The committed frames, in seq order, when the notification carried them (small
        /// enough); empty otherwise, and receivers read them.
        frames: Vec<Activity>,
    },
    /// A transient frame (typing, receipts, presence, relayed agent frames).
    Transient(TransientFrame),
    /// A turn was opened again for a new answer (regenerate), for the channel's agents.
    Regenerated {
        /// Node that published it (it dispatched locally already).
        node: String,
        /// The conversation's channel.
        channel_id: Uuid,
        /// Conversation.
        conversation_id: Uuid,
        /// The turn's seq.
        seq: i64,
        /// The new revision.
        revision: i32,
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
        #[serde(rename = "h", default)]
        channel_id: Option<Uuid>,
        #[serde(rename = "f", default, deserialize_with = "frames_or_none")]
        frames: Vec<Activity>,
    },
    #[serde(rename = "t")]
    Transient(TransientFrame),
    #[serde(rename = "rg")]
    Regenerated {
        #[serde(rename = "n")]
        node: String,
        #[serde(rename = "h")]
        channel_id: Uuid,
        #[serde(rename = "c")]
        conversation_id: Uuid,
        #[serde(rename = "s")]
        seq: i64,
        #[serde(rename = "r")]
        revision: i32,
    },
    /// A transient frame too large for a notification: its payload is in the outbox row.
    #[serde(rename = "tr")]
    TransientRef {
        #[serde(rename = "e")]
        outbox_id: i64,
    },
    /// Stream events of one node, in the order it accepted them (ADR 0019).
    #[serde(rename = "st")]
    Streams {
        #[serde(rename = "n")]
        node: String,
        #[serde(rename = "e")]
        events: Vec<Value>,
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
    /// Publishes a regenerated turn to every node (this one included; it skips its own).
    pub async fn publish_regenerated(
        &self,
        node: &str,
        channel_id: Uuid,
        conversation_id: Uuid,
        seq: i64,
        revision: i32,
    ) -> Result<(), StoreError> {
        let payload = Payload::Regenerated {
            node: node.to_owned(),
            channel_id,
            conversation_id,
            seq,
            revision,
        };
        let text = serde_json::to_string(&payload)
            .map_err(|error| StoreError::Config(error.to_string()))?;
        self.notify(&text).await
    }

    /// Publishes a transient frame to every node (this one included; it skips its own).
    pub async fn publish_transient(&self, transient: &TransientFrame) -> Result<(), StoreError> {
        let conversation_id = transient.conversation_id;
        let payload = Payload::Transient(transient.clone());
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

    /// Publishes stream events to every node (this one included; it skips its own) with one
    /// statement: the events are packed into as few notifications as their size allows, all
    /// sent by one `pg_notify` over an array, so a flush costs one transaction however many
    /// chunks it carries. An event too large for a notification travels through the outbox.
    pub async fn publish_streams(&self, node: &str, events: &[Value]) -> Result<(), StoreError> {
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
        self.timed("notify_streams", async {
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
        let stored = serde_json::to_value(&payload)
            .map_err(|error| StoreError::Config(error.to_string()))?;
        self.timed("publish_channel_status", async {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "WITH event AS (INSERT INTO outbox (payload) VALUES ($1) RETURNING payload)
                 SELECT pg_notify('{NOTIFY_CHANNEL}', payload::text)::text FROM event"
            )))
            .bind(stored)
            .execute(&self.pool)
            .await
        })
        .await?;
        Ok(())
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

    /// Events of the last `window` (by the database clock) that a catch-up replays: the
    /// highest committed seq per conversation, and channel status changes.
    async fn events_since(&self, window: Duration) -> Result<Vec<BusEvent>, StoreError> {
        let rows: Vec<(Option<Uuid>, Option<i64>, Option<Value>)> = self
            .timed("outbox_catch_up", async {
                sqlx::query_as(
                    "SELECT conversation_id, max(seq_to), NULL::jsonb FROM outbox
                     WHERE seq_to IS NOT NULL AND created_at >= now() - make_interval(secs => $1)
                     GROUP BY conversation_id
                     UNION ALL
                     SELECT NULL, NULL, payload FROM outbox
                     WHERE payload ->> 'k' = 'ch' AND created_at >= now() - make_interval(secs => $1)",
                )
                .bind(window.as_secs_f64())
                .fetch_all(&self.pool)
                .await
            })
            .await?;
        let events = rows.into_iter().filter_map(|row| match row {
            (Some(conversation_id), Some(seq), _) => Some(BusEvent::Committed {
                conversation_id,
                seq,
                channel_id: None,
                frames: Vec::new(),
            }),
            (_, _, Some(payload)) => serde_json::from_value::<Payload>(payload)
                .ok()
                .and_then(to_event),
            _ => None,
        });
        Ok(events.collect())
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
    /// The oneshot fires once the first LISTEN is in place.
    pub fn spawn_bus_listener(&self) -> (mpsc::UnboundedReceiver<BusEvent>, oneshot::Receiver<()>) {
        let (events, receiver) = mpsc::unbounded_channel();
        let (listening, ready) = oneshot::channel();
        tokio::spawn(run_listener(self.clone(), events, listening));
        (receiver, ready)
    }
}

/// The frames a notification carries, or none when any of them does not read as a frame: the
/// receiver then reads them back, instead of losing the whole notification.
/// A stream payload, small enough for a notification or not.
#[derive(Debug, PartialEq)]
enum Packed {
    Inline(String),
    Outbox(String),
}

/// Packs stream events, in order, into as few `Payload::Streams` texts as the notification
/// size allows; each event is serialized once.
fn pack_stream_events(node: &str, events: &[Value]) -> Result<Vec<Packed>, StoreError> {
    let node_json =
        serde_json::to_string(node).map_err(|error| StoreError::Config(error.to_string()))?;
    let head = format!(r#"{{"k":"st","n":{node_json},"e":["#);
    let tail = "]}";
    let fits = |body: usize| head.len() + body + tail.len() <= INLINE_PAYLOAD_LIMIT;
    let mut packed = Vec::new();
    let mut current = String::new();
    for event in events {
        let text = event.to_string();
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
        current.push_str(&text);
    }
    if !current.is_empty() {
        packed.push(Packed::Inline(format!("{head}{current}{tail}")));
    }
    Ok(packed)
}

fn frames_or_none<'de, D>(deserializer: D) -> Result<Vec<Activity>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let raw = Vec::<Value>::deserialize(deserializer)?;
    let frames: Result<Vec<Activity>, _> = raw.into_iter().map(serde_json::from_value).collect();
    match frames {
        Ok(frames) => Ok(frames),
        Err(error) => {
            tracing::warn!(%error, "event bus: carried frames unreadable; reading them back");
            Ok(Vec::new())
        }
    }
}

fn to_event(payload: Payload) -> Option<BusEvent> {
    match payload {
        Payload::Committed {
            conversation_id,
            seq,
            channel_id,
            frames,
        } => Some(BusEvent::Committed {
            conversation_id,
            seq,
            channel_id,
            frames,
        }),
        Payload::Transient(transient) => Some(BusEvent::Transient(transient)),
        Payload::Regenerated {
            node,
            channel_id,
            conversation_id,
            seq,
            revision,
        } => Some(BusEvent::Regenerated {
            node,
            channel_id,
            conversation_id,
            seq,
            revision,
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
        Payload::Streams { node, events } => Some(BusEvent::Streams { node, events }),
        Payload::TransientRef { .. } => None,
    }
}

async fn run_listener(
    store: Store,
    events: mpsc::UnboundedSender<BusEvent>,
    listening: oneshot::Sender<()>,
) {
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
    let _ = listening.send(());
    loop {
        if events.is_closed() {
            return;
        }
        if crate::faults::injected(crate::faults::LISTENER_DROP) {
            tracing::warn!("event bus: listener dropped by a failpoint");
            trouble_since.get_or_insert_with(Instant::now);
            drop(listener);
            tokio::time::sleep(Duration::from_millis(500)).await;
            listener = loop {
                match connect_listener(&store).await {
                    Ok(listener) => break listener,
                    Err(error) => {
                        tracing::warn!(%error, "event bus: cannot listen again yet");
                        tokio::time::sleep(backoff).await;
                    }
                }
            };
            recover(&store, &events, &mut trouble_since).await;
        }
        match listener.try_recv().await {
            Ok(Some(notification)) => {
                backoff = Duration::from_millis(100);
                if let Some(event) = decode(&store, notification.payload()).await
                    && events.send(event).is_err()
                {
                    return;
                }
            }
            // The connection was lost and (eagerly) re-established with LISTEN issued again.
            Ok(None) => {
                trouble_since.get_or_insert_with(Instant::now);
                metrics::counter!("converger_bus_reconnects_total").increment(1);
                tracing::warn!("event bus: listener connection was lost and re-established");
            }
            // The store is shutting down: release the connection so the pool can close.
            Err(sqlx::Error::PoolClosed) => return,
            Err(error) => {
                trouble_since.get_or_insert_with(Instant::now);
                tracing::warn!(%error, "event bus: listener error");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                // Reconnect now rather than at the next notification, so the catch-up below is
                // not delayed until traffic resumes.
                if let Err(error) = relisten(&mut listener).await {
                    tracing::warn!(%error, "event bus: cannot listen again yet");
                    continue;
                }
                metrics::counter!("converger_bus_reconnects_total").increment(1);
            }
        }
        recover(&store, &events, &mut trouble_since).await;
    }
}

/// Listening again after trouble: reads back whatever was notified in between.
async fn recover(
    store: &Store,
    events: &mpsc::UnboundedSender<BusEvent>,
    trouble_since: &mut Option<Instant>,
) {
    let Some(since) = *trouble_since else {
        return;
    };
    match catch_up(store, events, since.elapsed() + CATCH_UP_MARGIN).await {
        Ok(()) => *trouble_since = None,
        Err(error) => {
            tracing::warn!(%error, "event bus: catch-up failed; retrying after the next event")
        }
    }
}

/// Re-establishes the connection (if it is gone) and the LISTEN.
async fn relisten(listener: &mut PgListener) -> Result<(), sqlx::Error> {
    listener.unlisten(NOTIFY_CHANNEL).await?;
    listener.listen(NOTIFY_CHANNEL).await
}

/// Turns a notification payload into an event (reading large transient payloads back).
async fn decode(store: &Store, text: &str) -> Option<BusEvent> {
    let Ok(payload) = serde_json::from_str::<Payload>(text) else {
        tracing::warn!(payload = text, "event bus: unreadable notification");
        return None;
    };
    let payload = match payload {
        Payload::TransientRef { outbox_id } => match store.transient_by_ref(outbox_id).await {
            Ok(payload) => payload?,
            Err(error) => {
                tracing::warn!(%error, outbox_id, "event bus: transient payload unreadable");
                return None;
            }
        },
        payload => payload,
    };
    to_event(payload)
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
    for event in store.events_since(window).await? {
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
    fn stream_events_pack_in_order_within_the_notification_size() {
        let events: Vec<Value> = (0..500)
            .map(|index| serde_json::json!({"s": "s-1", "i": index, "b": {"text": "word "}}))
            .chain([serde_json::json!({"s": "s-1", "i": 500, "b": {"text": "x".repeat(9_000)}})])
            .chain([serde_json::json!({"s": "s-1", "i": 501})])
            .collect();
        let packed = pack_stream_events("node-\"1\"", &events).unwrap();
        assert!(packed.len() > 2, "split over several notifications");
        let mut seen = Vec::new();
        for payload in &packed {
            let (Packed::Inline(text) | Packed::Outbox(text)) = payload;
            if matches!(payload, Packed::Inline(_)) {
                assert!(text.len() <= INLINE_PAYLOAD_LIMIT);
            }
            let Some(BusEvent::Streams { node, events }) =
                to_event(serde_json::from_str::<Payload>(text).unwrap())
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
                seq: 3,
                channel_id: None,
                frames: Vec::new(),
            })
        );
        // As converger_committed_payload writes it, with the frame.
        let carried: Payload = serde_json::from_str(&format!(
            r#"{{"k":"c","e":8,"c":"{conversation_id}","s":4,"h":"{conversation_id}","f":[{{"id":"f4","seq":4,"data":{{"text":"hi"}},"type":"text","extra":null,"metadata":null,"turn_seq":null,"client_id":"c4","sender_id":"u","created_at":"2026-11-30T06:51:21.903868+00:00","sender_role":"user","turn_revision":null,"conversation_id":"{conversation_id}"}}]}}"#
        ))
        .unwrap();
        let Some(BusEvent::Committed { frames, .. }) = to_event(carried) else {
            panic!("a committed event");
        };
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].seq, 4);
        assert_eq!(frames[0].kind, "text");
        assert_eq!(frames[0].client_id.as_deref(), Some("c4"));
        assert_eq!(frames[0].created_at.timestamp_micros() % 1_000_000, 903_868);
        // A frame that does not read leaves the event without frames, not unreadable.
        let odd: Payload = serde_json::from_str(&format!(
            r#"{{"k":"c","e":9,"c":"{conversation_id}","s":5,"f":[{{"seq":"five"}}]}}"#
        ))
        .unwrap();
        assert!(matches!(
            to_event(odd),
            Some(BusEvent::Committed { seq: 5, ref frames, .. }) if frames.is_empty()
        ));
        let transient = TransientFrame {
            node: "n1".into(),
            channel_id: Some(conversation_id),
            conversation_id,
            frame: serde_json::json!({"type": "typing"}),
            origin: None,
            agents_only: true,
        };
        let text = serde_json::to_string(&Payload::Transient(transient.clone())).unwrap();
        assert!(text.contains(r#""k":"t""#));
        let back: Payload = serde_json::from_str(&text).unwrap();
        assert_eq!(to_event(back), Some(BusEvent::Transient(transient)));
        let regenerated = Payload::Regenerated {
            node: "n1".into(),
            channel_id: conversation_id,
            conversation_id,
            seq: 4,
            revision: 2,
        };
        let text = serde_json::to_string(&regenerated).unwrap();
        let back: Payload = serde_json::from_str(&text).unwrap();
        assert!(matches!(
            to_event(back),
            Some(BusEvent::Regenerated {
                seq: 4,
                revision: 2,
                ..
            })
        ));
    }
}
