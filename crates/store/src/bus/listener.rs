//! The node's `LISTEN` on the bus: notifications become events; after a lost connection the
//! outbox is read back over the gap.

use std::time::{Duration, Instant};

use serde_json::Value;
use sqlx::postgres::PgListener;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use super::{BusEvent, CATCH_UP_MARGIN, Payload, to_events};
use crate::group_commit::LocalCommits;
use crate::{NOTIFY_CHANNEL, Store, StoreError};

impl Store {
    /// Events of the last `window` (by the database clock) that a catch-up replays: the
    /// highest committed seq per conversation, channel status changes and disconnect orders,
    /// read from the outbox (which every commit writes, whatever the bus).
    pub async fn events_since(&self, window: Duration) -> Result<Vec<BusEvent>, StoreError> {
        let rows: Vec<(Option<Uuid>, Option<i64>, Option<Value>)> = self
            .timed("outbox_catch_up", async {
                sqlx::query_as(
                    "SELECT committed.conversation_id, max(committed.seq), NULL::jsonb
                     FROM (
                         SELECT conversation_id, seq_to AS seq FROM outbox
                         WHERE seq_to IS NOT NULL AND created_at >= now() - make_interval(secs => $1)
                         UNION ALL
                         SELECT batch.conversation_id, batch.seq
                         FROM outbox, unnest(outbox.conversations, outbox.last_seqs)
                                      AS batch(conversation_id, seq)
                         WHERE outbox.conversations IS NOT NULL
                           AND outbox.created_at >= now() - make_interval(secs => $1)
                     ) AS committed
                     GROUP BY committed.conversation_id
                     UNION ALL
                     SELECT NULL, NULL, payload FROM outbox
                     WHERE payload ->> 'k' IN ('ch', 'dc')
                       AND created_at >= now() - make_interval(secs => $1)",
                )
                .bind(window.as_secs_f64())
                .fetch_all(&self.pool)
                .await
            })
            .await?;
        let events = rows.into_iter().flat_map(|row| match row {
            (Some(conversation_id), Some(seq), _) => vec![BusEvent::Committed {
                conversation_id,
                first_seq: seq,
                seq,
                channel_id: None,
                frames: Vec::new(),
                runtime: None,
            }],
            (_, _, Some(payload)) => serde_json::from_value::<Payload>(payload)
                .map(to_events)
                .unwrap_or_default(),
            _ => Vec::new(),
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

    /// Hands every batch this store's workers commit to `events`, as node `node_id`'s, before
    /// its writers hear the outcome: for a bus that publishes commits itself (ADR 0033). False
    /// when commits were handed elsewhere before (the first stays).
    pub fn hand_commits_to(&self, node_id: &str, events: mpsc::UnboundedSender<BusEvent>) -> bool {
        self.group_commit.announce_locally(LocalCommits {
            node: node_id.to_owned(),
            events,
        })
    }

    /// Starts node `node_id`'s listener; events arrive on the returned channel until it is
    /// dropped. The oneshot fires once the first LISTEN is in place.
    ///
    /// The first listener of a store also receives that store's own committed batches, from
    /// the committing worker, before their writers hear of them; the batches' notifications
    /// then name `node_id`, and this listener skips them without decoding them. It always
    /// skips the node's own stream events the same way: the node showed them before relaying.
    pub fn spawn_bus_listener(
        &self,
        node_id: &str,
    ) -> (mpsc::UnboundedReceiver<BusEvent>, oneshot::Receiver<()>) {
        let (events, receiver) = mpsc::unbounded_channel();
        let (listening, ready) = oneshot::channel();
        let local = LocalCommits {
            node: node_id.to_owned(),
            events: events.clone(),
        };
        let mut own_echo = vec![own_streams_prefix(node_id)];
        if self.group_commit.announce_locally(local) {
            own_echo.push(own_echo_prefix(node_id));
        }
        tokio::spawn(run_listener(self.clone(), events, listening, own_echo));
        (receiver, ready)
    }
}

/// How the notifications of batches this node committed begin.
fn own_echo_prefix(node_id: &str) -> String {
    super::batch_payload_head(node_id)
}

/// How the notifications of this node's stream events begin (`publish_streams`).
pub(super) fn own_streams_prefix(node_id: &str) -> String {
    let node = serde_json::Value::from(node_id);
    format!(r#"{{"k":"st","n":{node},"#)
}

async fn run_listener(
    store: Store,
    events: mpsc::UnboundedSender<BusEvent>,
    listening: oneshot::Sender<()>,
    own_echo: Vec<String>,
) {
    let mut backoff = Duration::from_millis(100);
    // Set when the connection was (or may have been) lost; the catch-up covers since then.
    let mut trouble_since: Option<Instant> = None;
    let Some(mut listener) = listen_until_connected(&store, &events, &mut backoff).await else {
        return;
    };
    tracing::info!(channel = NOTIFY_CHANNEL, "event bus listening");
    let _ = listening.send(());
    let mut moves = store.host_moves();
    let mut moves_open = true;
    loop {
        if events.is_closed() {
            return;
        }
        if crate::faults::injected(crate::faults::LISTENER_DROP) {
            tracing::warn!("event bus: listener dropped by a failpoint");
            trouble_since.get_or_insert_with(Instant::now);
            drop(listener);
            tokio::time::sleep(Duration::from_millis(500)).await;
            listener = match listen_until_connected(&store, &events, &mut backoff).await {
                Some(listener) => listener,
                None => return,
            };
            recover(&store, &events, &mut trouble_since).await;
        }
        let received = tokio::select! {
            received = listener.try_recv() => received,
            moved = moves.changed(), if moves_open => {
                if moved.is_err() {
                    moves_open = false;
                    continue;
                }
                // The pool moved to another host, but this connection may still be on the old
                // one, which no longer hears the commits: listen anew, and read back the gap.
                tracing::warn!("event bus: the database host changed; listening again");
                trouble_since.get_or_insert_with(Instant::now);
                drop(listener);
                listener = match listen_until_connected(&store, &events, &mut backoff).await {
                    Some(listener) => listener,
                    None => return,
                };
                recover(&store, &events, &mut trouble_since).await;
                continue;
            }
        };
        match received {
            Ok(Some(notification)) => {
                backoff = Duration::from_millis(100);
                let payload = notification.payload();
                // This node's own batches were handed over by their worker already, and its
                // stream events shown before they were relayed.
                let own = own_echo.iter().any(|prefix| payload.starts_with(prefix));
                let decoded = if own {
                    Vec::new()
                } else {
                    decode(&store, payload).await
                };
                for event in decoded {
                    if events.send(event).is_err() {
                        return;
                    }
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
                store.listener_failed(&error);
                tracing::warn!(%error, "event bus: listener error");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                // A new listener, now rather than at the next notification, so the catch-up
                // below is not delayed until traffic resumes. Not UNLISTEN and LISTEN on the old
                // one: a LISTEN that fails leaves the channel out of its list, and it would
                // reconnect to hear nothing.
                drop(listener);
                listener = match listen_until_connected(&store, &events, &mut backoff).await {
                    Some(listener) => listener,
                    None => return,
                };
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
    // The listener hears of a lost connection only once the pool gave up reconnecting it, so
    // the window reaches back over that wait too: a commit made just before the loss (whose
    // notification never came) is inside it.
    let window = since.elapsed() + CATCH_UP_MARGIN + store.failure_notice_lag();
    match catch_up(store, events, window).await {
        Ok(()) => *trouble_since = None,
        Err(error) => {
            tracing::warn!(%error, "event bus: catch-up failed; retrying after the next event")
        }
    }
}

/// A listening connection, retried with backoff; `None` when the store or the bridge closed.
async fn listen_until_connected(
    store: &Store,
    events: &mpsc::UnboundedSender<BusEvent>,
    backoff: &mut Duration,
) -> Option<PgListener> {
    loop {
        match connect_listener(store).await {
            Ok(listener) => return Some(listener),
            Err(StoreError::Database(sqlx::Error::PoolClosed)) => return None,
            Err(error) => {
                store.failed_with(&error);
                tracing::warn!(%error, "event bus: cannot listen yet");
                if events.is_closed() {
                    return None;
                }
                tokio::time::sleep(*backoff).await;
                *backoff = (*backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Turns a notification payload into its events (reading large transient payloads back).
async fn decode(store: &Store, text: &str) -> Vec<BusEvent> {
    let Ok(payload) = serde_json::from_str::<Payload>(text) else {
        tracing::warn!(payload = text, "event bus: unreadable notification");
        return Vec::new();
    };
    let payload = match payload {
        Payload::TransientRef { outbox_id } => match store.transient_by_ref(outbox_id).await {
            Ok(Some(payload)) => payload,
            Ok(None) => return Vec::new(),
            Err(error) => {
                tracing::warn!(%error, outbox_id, "event bus: transient payload unreadable");
                return Vec::new();
            }
        },
        payload => payload,
    };
    to_events(payload)
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
