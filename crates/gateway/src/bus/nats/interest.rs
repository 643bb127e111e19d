//! Stream events by interest (ADR 0035). A node subscribes to `<p>.s.<conversation>` while its
//! hub has a feed for the conversation, so a node whose sessions do not follow a conversation
//! receives none of its chunks. A node that begins to follow one mid-stream has missed the
//! stream's start: it asks every other node on `<p>.q` what its agents stream there (every
//! node answers, with nothing when it holds nothing) and hands the answers to its door ahead
//! of the live events, which its subscription buffered meanwhile.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use async_nats::{HeaderMap, HeaderValue};
use converger_cluster::NodeKey;
use converger_core::streams::StreamTurn;
use converger_store::bus::BusEvent;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use uuid::Uuid;

use super::{PUBLISH_TIMEOUT, count_received, hand_on};
use crate::bus::StreamHoldings;
use crate::hub::{FeedChange, lock};

/// Longest wait for the other nodes' holdings; a node that did not answer by then (it is
/// going, or cut off from NATS) is given up, and its streams show from the committed answer.
const HOLDINGS_WAIT: Duration = Duration::from_millis(500);

/// How long after the first answer others are taken, when gossip knows no peer to wait for.
const LATE_ANSWERS: Duration = Duration::from_millis(20);

/// The header naming the answering node.
const NODE_HEADER: &str = "Converger-Node";

/// A question for the other nodes' holdings of a conversation: its open streams, or, for a
/// stop's settlement, what they hold of one stopped turn (`[seq, revision]`).
#[derive(Debug, Serialize, Deserialize)]
struct HoldingsAsked {
    #[serde(rename = "c")]
    conversation_id: Uuid,
    /// `[seq, revision]`.
    #[serde(rename = "t", default, skip_serializing_if = "Option::is_none")]
    stopped_turn: Option<(i64, i32)>,
}

/// The other nodes, as gossip knows them: asking for holdings waits for each of them.
#[derive(Debug, Default)]
pub(super) struct Peers(Mutex<HashSet<NodeKey>>);

impl Peers {
    pub(super) fn changed(&self, node: &NodeKey, up: bool) {
        let mut peers = lock(&self.0);
        if up {
            peers.insert(node.clone());
        } else {
            peers.remove(node);
        }
    }

    fn ids(&self) -> HashSet<String> {
        lock(&self.0)
            .iter()
            .map(|node| node.node_id.clone())
            .collect()
    }
}

/// Where the questions go and the stream subjects are.
#[derive(Clone)]
pub(super) struct Interest {
    pub(super) client: async_nats::Client,
    pub(super) prefix: String,
    pub(super) node_id: String,
    pub(super) peers: Arc<Peers>,
    /// Where gaps in replicas are told, once the node follows streams.
    pub(super) gaps: Arc<OnceLock<mpsc::UnboundedSender<Uuid>>>,
}

/// What a catch-up does with the live events that come while it waits for the holdings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Live {
    /// Handed on at once, and again after the holdings: a viewer present when a stream starts
    /// waits for nothing (the first catch-up of a followed conversation).
    GoesOn,
    /// Held until the holdings are handed on: a replica with a gap resumes in order, its end
    /// included (a catch-up after a lost chunk).
    Waits,
}

/// One followed conversation: its task, and how to ask it to catch up again.
struct Following {
    task: JoinHandle<()>,
    resync: mpsc::UnboundedSender<()>,
}

impl Interest {
    fn question_subject(&self) -> String {
        format!("{}.q", self.prefix)
    }

    /// The subject of one conversation's stream events.
    pub(super) fn stream_subject(prefix: &str, conversation_id: Uuid) -> String {
        format!("{prefix}.s.{conversation_id}")
    }

    /// Answers the other nodes' questions from `holdings` until it is gone.
    pub(super) fn answer(&self, holdings: Weak<dyn StreamHoldings>) {
        let interest = self.clone();
        tokio::spawn(async move {
            let subject = interest.question_subject();
            let mut questions = match interest.client.subscribe(subject.clone()).await {
                Ok(questions) => questions,
                Err(error) => {
                    tracing::error!(%error, subject, "nats bus: cannot subscribe to questions");
                    return;
                }
            };
            // Checked once: a node id with a line break cannot name the answers.
            let node: HeaderValue = match interest.node_id.parse() {
                Ok(node) => node,
                Err(error) => {
                    tracing::error!(%error, "nats bus: the node id cannot be a header; no holdings are told");
                    return;
                }
            };
            while let Some(question) = questions.next().await {
                let Some(holdings) = holdings.upgrade() else {
                    return;
                };
                let (Some(reply), Ok(asked)) = (
                    question.reply,
                    serde_json::from_slice::<HoldingsAsked>(&question.payload),
                ) else {
                    tracing::debug!("nats bus: unreadable question");
                    continue;
                };
                let stopped_turn = asked
                    .stopped_turn
                    .map(|(seq, revision)| StreamTurn { seq, revision });
                let body = holdings
                    .holdings(asked.conversation_id, stopped_turn)
                    .unwrap_or_default();
                let mut headers = HeaderMap::new();
                headers.insert(NODE_HEADER, node.clone());
                let bytes = body.len();
                let sent = interest
                    .client
                    .publish_with_headers(reply, headers, body.into());
                match tokio::time::timeout(PUBLISH_TIMEOUT, sent).await {
                    Ok(Ok(())) => {}
                    // Larger than the server's max_payload, or the connection is down: the
                    // asking node's viewers get the committed answer.
                    Ok(Err(error)) => {
                        tracing::warn!(%error, bytes, conversation_id = %asked.conversation_id, "nats bus: holdings not answered");
                    }
                    Err(_) => tracing::warn!(bytes, "nats bus: holdings not answered in time"),
                }
            }
        });
    }

    /// Every other node's holdings of `conversation_id` (those holding nothing answer empty,
    /// and are left out); waits for each peer gossip knows, at most `HOLDINGS_WAIT`. When
    /// gossip knows no peer (it has not converged, or the cluster runs without it), the answers
    /// that come within `LATE_ANSWERS` of the first are taken: a viewer waits that long for the
    /// start of a stream, so the wait must stay short.
    pub(super) async fn ask(
        &self,
        conversation_id: Uuid,
        stopped_turn: Option<StreamTurn>,
    ) -> Vec<String> {
        let mut waiting = self.peers.ids();
        let peers_unknown = waiting.is_empty();
        let asked = HoldingsAsked {
            conversation_id,
            stopped_turn: stopped_turn.map(|turn| (turn.seq, turn.revision)),
        };
        let question = match serde_json::to_vec(&asked) {
            Ok(question) => question,
            Err(error) => {
                tracing::warn!(%error, "nats bus: question not encoded");
                return Vec::new();
            }
        };
        let inbox = self.client.new_inbox();
        let mut answers = match self.client.subscribe(inbox.clone()).await {
            Ok(answers) => answers,
            Err(error) => {
                tracing::warn!(%error, "nats bus: cannot subscribe for holdings");
                return Vec::new();
            }
        };
        let asked = self
            .client
            .publish_with_reply(self.question_subject(), inbox, question.into());
        if !matches!(
            tokio::time::timeout(PUBLISH_TIMEOUT, asked).await,
            Ok(Ok(()))
        ) {
            tracing::warn!(%conversation_id, "nats bus: holdings not asked for");
            return Vec::new();
        }
        let mut deadline = tokio::time::Instant::now() + HOLDINGS_WAIT;
        let mut held = Vec::new();
        while peers_unknown || !waiting.is_empty() {
            let Ok(Some(answer)) = tokio::time::timeout_at(deadline, answers.next()).await else {
                if !waiting.is_empty() {
                    tracing::info!(%conversation_id, unanswered = ?waiting, "nats bus: nodes did not tell their holdings");
                }
                break;
            };
            let answering = answer
                .headers
                .as_ref()
                .and_then(|headers| headers.get(NODE_HEADER));
            if let Some(node) = answering {
                waiting.remove(node.as_str());
            }
            if peers_unknown {
                deadline = deadline.min(tokio::time::Instant::now() + LATE_ANSWERS);
            }
            if !answer.payload.is_empty()
                && let Ok(text) = String::from_utf8(answer.payload.to_vec())
            {
                held.push(text);
            }
        }
        held
    }

    /// A replica of the conversation's stream missed a chunk: the conversation's task asks for
    /// the holdings again.
    pub(super) fn gap(&self, conversation_id: Uuid) {
        if let Some(gaps) = self.gaps.get() {
            let _ = gaps.send(conversation_id);
        }
    }

    /// Follows the stream events of the conversations the hub's feed changes name, handing
    /// them to `events`; returns where the hub tells the changes.
    pub(super) fn follow(
        &self,
        events: mpsc::UnboundedSender<BusEvent>,
    ) -> mpsc::UnboundedSender<FeedChange> {
        let (changes, mut told) = mpsc::unbounded_channel();
        let (gaps, mut gaps_told) = mpsc::unbounded_channel();
        if self.gaps.set(gaps).is_err() {
            tracing::warn!("nats bus: streams are followed already");
        }
        let interest = self.clone();
        tokio::spawn(async move {
            let mut following: HashMap<Uuid, Following> = HashMap::new();
            loop {
                let change = tokio::select! {
                    change = told.recv() => match change {
                        Some(change) => change,
                        None => return,
                    },
                    Some(conversation_id) = gaps_told.recv() => {
                        if let Some(followed) = following.get(&conversation_id) {
                            let _ = followed.resync.send(());
                        }
                        continue;
                    }
                };
                let conversation_id = match change {
                    FeedChange::Followed(conversation_id)
                    | FeedChange::Unfollowed(conversation_id) => conversation_id,
                };
                // Awaited once aborted: nothing of the old subscription reaches the door after
                // what follows.
                if let Some(old) = following.remove(&conversation_id) {
                    old.task.abort();
                    let _ = old.task.await;
                }
                let sent = match change {
                    FeedChange::Followed(_) => {
                        let (resync, resync_asked) = mpsc::unbounded_channel();
                        let task = tokio::spawn(interest.clone().follow_one(
                            conversation_id,
                            events.clone(),
                            resync_asked,
                        ));
                        following.insert(conversation_id, Following { task, resync });
                        Ok(())
                    }
                    FeedChange::Unfollowed(_) => {
                        events.send(BusEvent::StreamsUnfollowed { conversation_id })
                    }
                };
                if sent.is_err() {
                    return;
                }
            }
        });
        changes
    }

    /// Subscribes to one conversation's stream events and catches up with what was streamed
    /// before; then hands the live events on, catching up again whenever a replica there
    /// missed a chunk.
    async fn follow_one(
        self,
        conversation_id: Uuid,
        events: mpsc::UnboundedSender<BusEvent>,
        mut resync_asked: mpsc::UnboundedReceiver<()>,
    ) {
        let subject = Interest::stream_subject(&self.prefix, conversation_id);
        let mut live = match self.client.subscribe(subject.clone()).await {
            Ok(live) => live,
            Err(error) => {
                tracing::warn!(%error, subject, "nats bus: cannot follow a conversation's streams");
                return;
            }
        };
        // The server takes this subscription before the question that follows it on the same
        // connection (and tells its routes in that order): a chunk a node publishes after it
        // answered comes live, one it published before is in its answer.
        if !self
            .catch_up(conversation_id, &mut live, &events, Live::GoesOn)
            .await
        {
            return;
        }
        // Chunks refused before the holdings came told gaps the catch-up has filled.
        while resync_asked.try_recv().is_ok() {}
        loop {
            tokio::select! {
                message = live.next() => {
                    let Some(message) = message else { return };
                    count_received();
                    if !hand_on(&events, &message.payload) {
                        return;
                    }
                }
                asked = resync_asked.recv() => {
                    if asked.is_none() {
                        return;
                    }
                    metrics::counter!("converger_stream_resyncs_total").increment(1);
                    if !self.catch_up(conversation_id, &mut live, &events, Live::Waits).await {
                        return;
                    }
                    // One catch-up answers every gap told while it ran.
                    while resync_asked.try_recv().is_ok() {}
                }
            }
        }
    }

    /// Asks for the holdings of the conversation; once they come they are handed on, followed
    /// by what came live meanwhile: a chunk refused for want of its stream's start (or of a
    /// lost chunk) now follows it, and a repeat is refused. With [`Live::GoesOn`] the live
    /// events are also handed on at once, before the holdings. False once the subscription or
    /// the door is gone.
    async fn catch_up(
        &self,
        conversation_id: Uuid,
        live: &mut async_nats::Subscriber,
        events: &mpsc::UnboundedSender<BusEvent>,
        meanwhile: Live,
    ) -> bool {
        let asking = self.ask(conversation_id, None);
        tokio::pin!(asking);
        let mut heard_meanwhile = Vec::new();
        let replies = loop {
            tokio::select! {
                replies = &mut asking => break replies,
                message = live.next() => {
                    let Some(message) = message else { return false };
                    count_received();
                    if meanwhile == Live::GoesOn && !hand_on(events, &message.payload) {
                        return false;
                    }
                    heard_meanwhile.push(message.payload);
                }
            }
        };
        if !replies.is_empty() {
            let holdings = BusEvent::StreamHoldings {
                conversation_id,
                replies,
            };
            if events.send(holdings).is_err() {
                return false;
            }
        } else if meanwhile == Live::GoesOn {
            // No holdings go ahead of the live events, and every one of them went on already.
            return true;
        }
        heard_meanwhile
            .iter()
            .all(|payload| hand_on(events, payload))
    }
}
