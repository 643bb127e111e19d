//! One channel's actor: it feeds the channel's events to its `ChannelDecider` and performs the
//! decisions: claims (lease mode), reads (frames, the turn registry) and hands deliveries to
//! the agent connections of this node.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use converger_core::channel::{
    ChannelDecider, CommittedPlan, Decision, LocalAgent, StopTimes, TurnId, TurnReason,
};
use converger_protocol::{Cancel, Envelope, TurnRef, Viewer};
use converger_store::{Activity, Claim, FrameRange, Store};
use tokio::sync::{broadcast, mpsc};
use uuid::Uuid;

use super::{ActorMessage, Delivery};
use crate::hub::{ChannelEvent, HubEvent};
use crate::wire;

/// How long the actor waits before reading a frame again that the database did not return.
const FRAMES_RETRY: Duration = Duration::from_secs(1);

/// Frames read back at most, from a conversation new to this node since it follows the channel.
const READ_SINCE_WINDOW: i64 = 1_000;

/// How often the decider is told the time, to forget conversations idle for
/// `converger_core::channel::FORGET_AFTER_MS`.
const FORGET_TICK: Duration = Duration::from_secs(10);

/// Unanswered turns older than this are not handed on when a node starts serving a channel.
const PENDING_TURNS_HORIZON: Duration = Duration::from_secs(3_600);

/// After a lag, unanswered turns are read back from this long before the newest commit the
/// feed delivered: commits reach the feed out of order by less than that (two commit workers,
/// other nodes' notifications).
const READ_BACK_MARGIN_MS: i64 = 10_000;

/// The frames a plan for the commit of `seq` reads, all up to `seq`: none to skip it, else a
/// hole, the frames since the conversation was followed, or the frame itself (a plan to use
/// the frame reads it when it is not at hand).
fn frames_to_read(conversation_id: Uuid, seq: i64, plan: CommittedPlan) -> Option<FrameRange> {
    let (after_seq, since_ms) = match plan {
        CommittedPlan::Skip => return None,
        CommittedPlan::Use => (seq - 1, None),
        CommittedPlan::Read { after, .. } => (after, None),
        CommittedPlan::ReadSince { since_ms, .. } => (seq - READ_SINCE_WINDOW, Some(since_ms)),
    };
    Some(FrameRange {
        conversation_id,
        after_seq,
        up_to_seq: seq,
        since_ms,
    })
}

/// A local agent connection: where its deliveries go, and its lease duration in lease mode.
struct Link {
    lease: Option<Duration>,
    deliveries: mpsc::UnboundedSender<Delivery>,
}

pub(super) struct ChannelActor {
    channel_id: Uuid,
    /// For retries scheduled by the actor itself; weak so it never keeps itself alive.
    own_inbox: mpsc::WeakUnboundedSender<ActorMessage>,
    store: Store,
    links: HashMap<String, Link>,
    decider: ChannelDecider,
    /// The newest commit time (database clock, ms) of a frame the feed delivered: a lag lost
    /// only commits after it, give or take [`READ_BACK_MARGIN_MS`].
    newest_heard_ms: Option<i64>,
    /// A read-back owed since a lag and not done yet (a failed read waits for its retry): the
    /// commit time (database clock, ms) it reads from, `None` for the whole horizon. A later
    /// lag only moves it earlier; a read that succeeds clears it.
    owed_read_back: Option<Option<i64>>,
    /// Turns handed to a member here for the first time, so a read-back can tell what it found.
    first_deliveries: u64,
}

impl ChannelActor {
    pub(super) fn new<'a>(
        channel_id: Uuid,
        inbox: &mpsc::UnboundedSender<ActorMessage>,
        store: Store,
        remote_members: impl IntoIterator<Item = (&'a str, &'a str, i64)>,
    ) -> ChannelActor {
        ChannelActor {
            channel_id,
            own_inbox: inbox.downgrade(),
            store,
            links: HashMap::new(),
            decider: ChannelDecider::new(remote_members),
            newest_heard_ms: None,
            owed_read_back: None,
            first_deliveries: 0,
        }
    }

    pub(super) async fn run(
        mut self,
        mut inbox: mpsc::UnboundedReceiver<ActorMessage>,
        mut feed: broadcast::Receiver<ChannelEvent>,
    ) {
        let mut forget = tokio::time::interval(FORGET_TICK);
        loop {
            tokio::select! {
                // Ends when the last agent connection of the channel here let go of its inbox
                // (the registry keeps a weak one): the next one starts a new actor, which reads
                // the channel's unanswered turns back first.
                message = inbox.recv() => match message {
                    Some(message) => self.on_message(message).await,
                    None => return,
                },
                _ = forget.tick() => self.decider.forget_idle(crate::recent::monotonic_ms()),
                event = feed.recv() => match event {
                    Ok(event) => self.on_event(event).await,
                    // A lost turn's conversation may never get another frame (its user waits
                    // for the answer), so the turns are read back now, not at the next frame.
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        tracing::warn!(channel_id = %self.channel_id, missed, "agents: channel feed lagged; the channel's unanswered turns are read back");
                        metrics::counter!("converger_agent_feed_lagged_total").increment(1);
                        if self.owe_read_back() {
                            self.read_back_unanswered().await;
                        }
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            }
        }
    }

    async fn on_message(&mut self, message: ActorMessage) {
        let decisions = match message {
            ActorMessage::Join {
                connection_id,
                group,
                since_ms,
                sender_id,
                lease,
                deliveries,
            } => {
                self.links
                    .insert(connection_id.clone(), Link { lease, deliveries });
                let agent = LocalAgent {
                    group,
                    since_ms,
                    sender_id,
                    leased: lease.is_some(),
                };
                self.decider.join(&connection_id, agent)
            }
            ActorMessage::Replay {
                connection_id,
                conversation_id,
                watermark,
                limit,
            } => {
                return self
                    .replay(&connection_id, conversation_id, watermark, limit)
                    .await;
            }
            ActorMessage::Leave { connection_id } => {
                self.links.remove(&connection_id);
                self.decider.leave(&connection_id)
            }
            ActorMessage::RemoteJoin {
                connection_id,
                group,
                since_ms,
            } => self.decider.remote_join(&connection_id, &group, since_ms),
            ActorMessage::RemoteLeave {
                connection_id,
                group,
            } => self.decider.remote_leave(&connection_id, &group),
            ActorMessage::Retry(event) => return self.on_event(event).await,
            ActorMessage::ReadBackUnanswered => return self.read_back_unanswered().await,
            ActorMessage::Redeliver {
                connection_id,
                conversation_id,
                seq,
            } => self
                .decider
                .redeliver(&connection_id, &conversation_id.to_string(), seq),
            ActorMessage::WithdrawLocal => self.decider.withdraw_local(),
        };
        self.perform(decisions, &[]).await;
    }

    async fn on_event(&mut self, event: ChannelEvent) {
        let ChannelEvent {
            conversation_id,
            event,
        } = event;
        let conversation = conversation_id.to_string();
        match event {
            HubEvent::Committed { seq, activity, .. } => {
                let frame_at_ms = activity.as_ref().map(|activity| activity.timestamp_ms());
                if let Some(at_ms) = frame_at_ms {
                    self.newest_heard_ms =
                        Some(self.newest_heard_ms.map_or(at_ms, |ms| ms.max(at_ms)));
                }
                let plan = self.decider.plan_committed(&conversation, seq, frame_at_ms);
                let read = match (frames_to_read(conversation_id, seq, plan), activity) {
                    (None, _) => return,
                    (Some(_), Some(activity)) if plan == CommittedPlan::Use => Ok(vec![activity]),
                    (Some(range), _) => self
                        .store
                        .activities_in_ranges(&[range])
                        .await
                        .map(|rows| rows.into_iter().map(Arc::new).collect()),
                };
                let frames: Vec<Arc<Activity>> = match read {
                    Ok(frames) => frames,
                    Err(error) => {
                        // Not marked as handled: the retry (or the conversation's next frame)
                        // reads from the same place, so no turn is skipped.
                        tracing::warn!(%error, %conversation_id, seq, "agents: frames unreadable; retrying");
                        let event = ChannelEvent {
                            conversation_id,
                            event: HubEvent::committed_seq(seq),
                        };
                        self.retry_after(event, FRAMES_RETRY);
                        return;
                    }
                };
                self.decide_committed(&conversation, seq, &frames).await;
            }
            HubEvent::Regenerated {
                turn,
                revision,
                opened_at_ms,
            } => {
                // A frame unreadable here is delivered as the turn was sent, never held back.
                // The owners are those when it was opened, on every node (as a read-back after
                // a lag and a stop decide them).
                let _ = self
                    .hand_on_regenerated(
                        conversation_id,
                        (turn.seq, revision),
                        opened_at_ms,
                        Some(&*turn),
                    )
                    .await;
            }
            HubEvent::TurnStopped(stop) => {
                let now = chrono::Utc::now().timestamp_millis();
                let decisions = self.decider.stopped(
                    &conversation,
                    (stop.seq, stop.revision),
                    &stop.reason,
                    StopTimes {
                        turn_at_ms: stop.at_ms,
                        revision_at_ms: stop.revision_at_ms,
                        now_ms: now,
                    },
                );
                self.perform(decisions, &[]).await;
            }
            // Streams go to end users only; agents never publish to the channel feed anyway.
            HubEvent::Stream(_) => {}
            HubEvent::Transient { frame, .. } => {
                // Forwarded client frames, typing, receipts and presence: to every observer and
                // to the current owner of each group.
                let now = chrono::Utc::now().timestamp_millis();
                let targets = self.decider.transient_targets(&conversation, now);
                if targets.is_empty() {
                    return;
                }
                let envelope = Envelope {
                    conversation_id: &conversation,
                    frame: &*frame,
                }
                .encode();
                self.send_to(&targets, envelope);
            }
        }
    }

    /// Performs decisions in order; what a read decides comes before the decisions after it.
    /// Frames are named by their index in `frames`.
    async fn perform(&mut self, decisions: Vec<Decision>, frames: &[Arc<Activity>]) {
        let mut queue: VecDeque<Decision> = decisions.into();
        // Each frame is serialized once for all the connections it goes to.
        let mut encoded: HashMap<usize, axum::extract::ws::Utf8Bytes> = HashMap::new();
        while let Some(decision) = queue.pop_front() {
            match decision {
                Decision::SendFrame { to, frame } => {
                    let text = encoded
                        .entry(frame)
                        .or_insert_with(|| agent_envelope(&frames[frame]))
                        .clone();
                    self.send(&to, Delivery::Frame(text));
                }
                Decision::DeliverTurn {
                    to,
                    frame,
                    turn,
                    first,
                } => {
                    let activity = &frames[frame];
                    if self.deliver_turn(&to, activity, turn).await && first {
                        self.first_deliveries += 1;
                        metrics::counter!("converger_deliveries_total", "kind" => "first")
                            .increment(1);
                        // Commit (database clock) to hand-off to the member's connection on this
                        // node, which adds the runtime and queues the frame for its socket writer.
                        let waited_ms =
                            chrono::Utc::now().timestamp_millis() - activity.timestamp_ms();
                        metrics::histogram!("converger_commit_to_delivery_seconds")
                            .record(waited_ms.max(0) as f64 / 1000.0);
                    }
                }
                Decision::DeliverPending {
                    to,
                    conversation_id,
                    seqs,
                } => self.deliver_pending(&conversation_id, &to, &seqs).await,
                Decision::ReadPendingOfChannel { group } => {
                    let (pending, read_at_ms) = match self.pending_of_channel().await {
                        Some((pending, read_at_ms)) => (pending, Some(read_at_ms)),
                        None => (Vec::new(), None),
                    };
                    let follow = self
                        .decider
                        .pending_read(group.as_deref(), &pending, read_at_ms);
                    prepend(&mut queue, follow);
                }
                Decision::ReadPendingUpTo {
                    group,
                    conversation_id,
                    up_to,
                } => {
                    let Ok(id) = Uuid::parse_str(&conversation_id) else {
                        continue;
                    };
                    let pending = match self.store.pending_turns_up_to(id, up_to).await {
                        Ok(pending) => pending,
                        Err(error) => {
                            tracing::error!(%error, conversation_id = %id, "takeover: evicted turns unreadable");
                            continue;
                        }
                    };
                    let pending: Vec<_> = pending.iter().map(wire::pending_facts).collect();
                    let follow =
                        self.decider
                            .pending_up_to_read(&group, &conversation_id, &pending);
                    prepend(&mut queue, follow);
                }
                Decision::Cancel {
                    to,
                    conversation_id,
                    seq,
                    revision,
                    reason,
                } => {
                    let turn = TurnRef::new(&conversation_id, seq, revision, None);
                    let envelope = Envelope {
                        conversation_id: &conversation_id,
                        frame: Cancel::new(&turn, &reason),
                    }
                    .encode();
                    self.send(&to, Delivery::Frame(envelope.into()));
                }
                Decision::ReleaseLeases { holder } => self.release_leases(&holder).await,
            }
        }
    }

    /// Records the read-back a lag owes: from [`READ_BACK_MARGIN_MS`] before the newest commit
    /// the feed delivered (the lag lost only later ones), or the whole horizon before any.
    /// True when no read-back was owed already; else the one owed, whose retry is scheduled,
    /// now reads from the earlier of the two starts.
    fn owe_read_back(&mut self) -> bool {
        let from_ms = self
            .newest_heard_ms
            .map(|newest_ms| newest_ms - READ_BACK_MARGIN_MS);
        match self.owed_read_back {
            None => {
                self.owed_read_back = Some(from_ms);
                true
            }
            Some(owed) => {
                self.owed_read_back = Some(owed.zip(from_ms).map(|(a, b)| a.min(b)));
                false
            }
        }
    }

    /// The read-back a lag owes: each unanswered turn of the channel opened since its start
    /// ([`ChannelActor::owe_read_back`]) is planned as if its commit had just arrived, at the
    /// seq of its newest frame (an edit's, for an edited turn). The decider skips what it
    /// handled already, reads back the holes of the conversations it knows and hands each turn
    /// to its owner when that owner is here, as it does for a commit it heard. A failed read
    /// stays owed and is tried again. The start is a commit time on the database's clock, read
    /// by the database: this node's clock plays no part.
    async fn read_back_unanswered(&mut self) {
        let Some(opened_after_ms) = self.owed_read_back else {
            return;
        };
        let limit = converger_core::channel::MEMORY_CONVERSATIONS as i64;
        let pending = match self
            .store
            .pending_turns_of_channel(
                self.channel_id,
                PENDING_TURNS_HORIZON,
                opened_after_ms,
                limit,
            )
            .await
        {
            Ok(pending) => pending,
            Err(error) => {
                tracing::warn!(%error, channel_id = %self.channel_id, "agents: unanswered turns unreadable after a lag; retrying");
                self.send_to_self_after(ActorMessage::ReadBackUnanswered, FRAMES_RETRY);
                return;
            }
        };
        self.owed_read_back = None;
        let delivered_before = self.first_deliveries;
        let mut unreadable = !self.read_back_frames(&pending).await;
        let mut regenerations = 0;
        for turn in pending {
            // A regenerate stores no frame, so the commit planned above is one this actor may
            // have handled; the regeneration itself is handed on unless it was already.
            if turn.reason.as_deref() != Some(TurnReason::Regenerate.as_str()) {
                continue;
            }
            let regenerated = (turn.seq, turn.revision);
            match self
                .hand_on_regenerated(turn.conversation_id, regenerated, turn.at_ms, None)
                .await
            {
                Ok(handed_on) => regenerations += handed_on,
                Err(error) => {
                    // Not noted as handed on: the retry reads it again (and skips what this
                    // read-back handed on).
                    tracing::warn!(%error, conversation_id = %turn.conversation_id, seq = turn.seq, "agents: a regenerated turn unreadable after a lag; retrying");
                    unreadable = true;
                }
            }
        }
        if unreadable {
            self.owed_read_back = Some(opened_after_ms);
            self.send_to_self_after(ActorMessage::ReadBackUnanswered, FRAMES_RETRY);
        }
        let handed_on = self.first_deliveries - delivered_before;
        metrics::counter!("converger_agent_feed_read_back_turns_total").increment(handed_on);
        metrics::counter!("converger_agent_feed_read_back_regenerations_total")
            .increment(regenerations);
        tracing::info!(channel_id = %self.channel_id, handed_on, regenerations, "agents: unanswered turns read back after a lag");
    }

    /// Plans each conversation of `pending` as if the commit of its newest unanswered turn's
    /// newest frame had just arrived, and reads the frames those plans need (the holes, the
    /// lost turns among them; a conversation new here or forgotten, its frames since it was
    /// followed) in one query: a lag under load loses the turns of hundreds of conversations,
    /// and a read for each kept the actor so long behind its feed that the feed lagged again
    /// while it read. False when the read failed.
    async fn read_back_frames(&mut self, pending: &[converger_store::ChannelPendingTurn]) -> bool {
        let mut newest: HashMap<Uuid, i64> = HashMap::new();
        for turn in pending {
            let seq = newest.entry(turn.conversation_id).or_insert(turn.frame_seq);
            *seq = (*seq).max(turn.frame_seq);
        }
        let ranges: Vec<FrameRange> = newest
            .into_iter()
            .filter_map(|(conversation_id, frame_seq)| {
                let plan =
                    self.decider
                        .plan_committed(&conversation_id.to_string(), frame_seq, None);
                frames_to_read(conversation_id, frame_seq, plan)
            })
            .collect();
        if ranges.is_empty() {
            return true;
        }
        let frames = match self.store.activities_in_ranges(&ranges).await {
            Ok(frames) => frames,
            Err(error) => {
                tracing::warn!(%error, channel_id = %self.channel_id, conversations = ranges.len(), "agents: frames unreadable after a lag; retrying");
                return false;
            }
        };
        let mut by_conversation: HashMap<Uuid, Vec<Arc<Activity>>> = HashMap::new();
        for frame in frames {
            by_conversation
                .entry(frame.conversation_id)
                .or_default()
                .push(Arc::new(frame));
        }
        for range in ranges {
            let frames = by_conversation
                .remove(&range.conversation_id)
                .unwrap_or_default();
            let conversation = range.conversation_id.to_string();
            self.decide_committed(&conversation, range.up_to_seq, &frames)
                .await;
        }
        true
    }

    /// Decides the frames of a commit through `seq` (read or at hand, in order) and carries
    /// the decisions out: for a commit heard and for a read-back after a lag alike.
    async fn decide_committed(&mut self, conversation: &str, seq: i64, frames: &[Arc<Activity>]) {
        let facts: Vec<_> = frames
            .iter()
            .map(|frame| wire::facts(frame, conversation))
            .collect();
        let decisions = self.decider.committed(conversation, seq, &facts);
        self.perform(decisions, frames).await;
    }

    /// Hands a regenerated revision of a turn to the conversation's owner at `at_ms` (when it
    /// was opened) in each group when that owner is here, unless it was handed on in that group
    /// already (its event and a read-back after a lag may both find it), and returns how many
    /// members got it. When its frame is unreadable it is delivered as `sent` (the turn as its
    /// event carried it) when that is at hand; else the error is returned and nothing is noted,
    /// so a retry hands it on.
    async fn hand_on_regenerated(
        &mut self,
        conversation_id: Uuid,
        regenerated: (i64, i32),
        at_ms: i64,
        sent: Option<&Activity>,
    ) -> Result<u64, converger_store::StoreError> {
        let (seq, revision) = regenerated;
        let conversation = conversation_id.to_string();
        let owners = self
            .decider
            .regeneration_opened(&conversation, regenerated, at_ms);
        if owners.is_empty() {
            return Ok(0);
        }
        let frame = match (
            self.regenerated_frame(conversation_id, regenerated).await,
            sent,
        ) {
            (Ok(Some(frame)), _) => frame,
            // Answered, or superseded by a newer revision, which is handed on by itself.
            (Ok(None), _) => return Ok(0),
            (Err(error), Some(sent)) => {
                tracing::warn!(%error, %conversation_id, seq, "regenerate: latest edit unreadable; delivering the turn as sent");
                Arc::new(sent.clone())
            }
            (Err(error), None) => return Err(error),
        };
        let turn = TurnId {
            seq,
            revision,
            reason: Some(TurnReason::Regenerate),
        };
        let mut handed_on = 0;
        for owner in owners {
            self.decider
                .note_regeneration(&conversation, regenerated, &owner);
            if self.deliver_turn(&owner, &frame, turn).await {
                handed_on += 1;
            }
        }
        Ok(handed_on)
    }

    /// The channel's unanswered turns, for a node that starts serving it (or a group new here),
    /// with the database's time as the read began; `None` when unreadable, and then only new
    /// turns are remembered.
    async fn pending_of_channel(
        &self,
    ) -> Option<(Vec<converger_core::channel::PendingFacts>, i64)> {
        let limit = converger_core::channel::MEMORY_CONVERSATIONS as i64;
        let read = async {
            let read_at_ms = self.store.database_now_ms().await?;
            let pending = self
                .store
                .pending_turns_of_channel(self.channel_id, PENDING_TURNS_HORIZON, None, limit)
                .await?;
            Ok::<_, converger_store::StoreError>((pending, read_at_ms))
        };
        match read.await {
            Ok((pending, read_at_ms)) => {
                tracing::debug!(channel_id = %self.channel_id, turns = pending.len(), "pending turns read back");
                Some((
                    pending.iter().map(wire::pending_facts).collect(),
                    read_at_ms,
                ))
            }
            Err(error) => {
                tracing::warn!(%error, channel_id = %self.channel_id, "pending turns unreadable; only new turns are remembered");
                None
            }
        }
    }

    /// Replays to one connection what it owns of a conversation after `watermark`.
    async fn replay(
        &mut self,
        connection_id: &str,
        conversation_id: Uuid,
        watermark: i64,
        limit: i64,
    ) {
        if self.decider.agent(connection_id).is_none() {
            return;
        }
        let frames = match self
            .store
            .list_activities(conversation_id, watermark, limit)
            .await
        {
            Ok(frames) => frames.into_iter().map(Arc::new).collect::<Vec<_>>(),
            Err(error) => {
                tracing::warn!(%error, %conversation_id, "agent replay unreadable");
                return;
            }
        };
        let conversation = conversation_id.to_string();
        let facts: Vec<_> = frames
            .iter()
            .map(|frame| wire::facts(frame, &conversation))
            .collect();
        let decisions = self.decider.replay(connection_id, &facts);
        self.perform(decisions, &frames).await;
    }

    /// The frame a regenerated turn is delivered with: its latest edit when it has one (as a
    /// takeover would deliver it), else the turn itself; `None` when that revision is no longer
    /// pending (answered, or superseded by a newer revision, which has its own event).
    async fn regenerated_frame(
        &self,
        conversation_id: Uuid,
        regenerated: (i64, i32),
    ) -> Result<Option<Arc<Activity>>, converger_store::StoreError> {
        let (seq, revision) = regenerated;
        let pending = self.store.pending_turns(conversation_id, &[seq]).await?;
        Ok(pending
            .into_iter()
            .find(|pending| pending.revision == revision)
            .map(|pending| Arc::new(pending.activity)))
    }

    /// Delivers those of `seqs` still unanswered to a local member, as taken over.
    async fn deliver_pending(&mut self, conversation_id: &str, owner: &str, seqs: &[i64]) {
        let Ok(id) = Uuid::parse_str(conversation_id) else {
            return;
        };
        let pending = match self.store.pending_turns(id, seqs).await {
            Ok(pending) => pending,
            Err(error) => {
                tracing::error!(%error, conversation_id = %id, "takeover: pending turns unreadable");
                return;
            }
        };
        for turn in pending {
            metrics::counter!("converger_deliveries_total", "kind" => "takeover").increment(1);
            let turn_id = TurnId {
                seq: turn.turn_seq,
                revision: turn.revision,
                reason: turn.reason.as_deref().and_then(TurnReason::parse),
            };
            // A read-back after a lag must not hand this revision on a second time.
            if turn_id.reason == Some(TurnReason::Regenerate) {
                self.decider.note_regeneration(
                    conversation_id,
                    (turn_id.seq, turn_id.revision),
                    owner,
                );
            }
            self.deliver_turn(owner, &Arc::new(turn.activity), turn_id)
                .await;
        }
    }

    /// Sends a user turn to a member, claimed first for a lease-mode member; false when it was
    /// not sent now.
    async fn deliver_turn(
        &self,
        connection_id: &str,
        activity: &Arc<Activity>,
        turn: TurnId,
    ) -> bool {
        let conversation = activity.conversation_id.to_string();
        let mut turn = TurnRef::new(
            &conversation,
            turn.seq,
            turn.revision,
            turn.reason.map(TurnReason::as_str),
        );
        if !self
            .claim_for(connection_id, activity.conversation_id, &mut turn)
            .await
        {
            return false;
        }
        self.send(
            connection_id,
            Delivery::Turn {
                activity: Arc::clone(activity),
                turn,
            },
        );
        true
    }

    /// For a lease-mode member, claims the turn and sets the delivery's fence; false when it
    /// must not be delivered now (held by another member: retried when that lease runs out; or
    /// no longer pending). Other members need no claim.
    async fn claim_for(
        &self,
        connection_id: &str,
        conversation_id: Uuid,
        turn: &mut TurnRef,
    ) -> bool {
        let Some(lease) = self.links.get(connection_id).and_then(|link| link.lease) else {
            return true;
        };
        let started = std::time::Instant::now();
        let claim = self
            .store
            .claim_turn(
                conversation_id,
                turn.seq,
                turn.revision,
                connection_id,
                lease,
            )
            .await;
        metrics::histogram!("converger_claim_wait_seconds").record(started.elapsed().as_secs_f64());
        match claim {
            Ok(Claim::Claimed { fence }) => {
                // A claim that does not continue a live lease of the same connection raises the
                // fence, so above 1 the registry says the turn was handed out before, on any node.
                if fence > 1 {
                    metrics::counter!("converger_duplicate_deliveries_total").increment(1);
                }
                turn.fence = Some(fence);
                true
            }
            Ok(Claim::Held { remaining_ms }) => {
                self.redeliver_after(connection_id, conversation_id, turn.seq, remaining_ms);
                false
            }
            Ok(Claim::NotPending) => false,
            Err(error) => {
                tracing::error!(%error, %conversation_id, seq = turn.seq, "claim failed; retrying");
                self.redeliver_after(connection_id, conversation_id, turn.seq, 1_000);
                false
            }
        }
    }

    /// Gives up the claims a departed lease-mode member still holds, so the next owner claims
    /// them at once.
    async fn release_leases(&self, holder: &str) {
        match self.store.release_leases(holder).await {
            Ok(0) => {}
            Ok(released) => {
                tracing::debug!(holder, released, "leases released by the channel actor")
            }
            Err(error) => {
                tracing::warn!(%error, holder, "leases not released; they run out by themselves")
            }
        }
    }

    /// Asks this actor to try the delivery again after `delay_ms` (a lease's remaining time).
    fn redeliver_after(&self, connection_id: &str, conversation_id: Uuid, seq: i64, delay_ms: i64) {
        let wait = Duration::from_millis(u64::try_from(delay_ms).unwrap_or(0) + 20);
        let message = ActorMessage::Redeliver {
            connection_id: connection_id.to_owned(),
            conversation_id,
            seq,
        };
        self.send_to_self_after(message, wait);
    }

    /// Hands `event` back to this actor after `delay` (its frames could not be read).
    fn retry_after(&self, event: ChannelEvent, delay: Duration) {
        self.send_to_self_after(ActorMessage::Retry(event), delay);
    }

    fn send_to_self_after(&self, message: ActorMessage, delay: Duration) {
        let Some(inbox) = self.own_inbox.upgrade() else {
            return;
        };
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = inbox.send(message);
        });
    }

    fn send(&self, connection_id: &str, delivery: Delivery) {
        if let Some(link) = self.links.get(connection_id) {
            let _ = link.deliveries.send(delivery);
        }
    }

    fn send_to(&self, connection_ids: &[String], text: String) {
        let text = axum::extract::ws::Utf8Bytes::from(text);
        for connection_id in connection_ids {
            self.send(connection_id, Delivery::Frame(text.clone()));
        }
    }
}

/// A stored frame enveloped as agents see it.
fn agent_envelope(activity: &Activity) -> axum::extract::ws::Utf8Bytes {
    let conversation = activity.conversation_id.to_string();
    Envelope {
        conversation_id: &conversation,
        frame: wire::persistent(activity).view(Viewer::Agent),
    }
    .encode()
    .into()
}

fn prepend(queue: &mut VecDeque<Decision>, follow: Vec<Decision>) {
    for decision in follow.into_iter().rev() {
        queue.push_front(decision);
    }
}
