//! The soak's load: end users in closed loop, each in its own conversation (the Rust
//! `Conversation` client: reconnects, resumes from its watermark, resends unacked turns), and
//! agents of one group in lease mode (the Rust `Agent` client) that call the effects service
//! with `meta.turn.key` before answering, and stream each answer before committing it. Both
//! record what they saw in the history.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use converger_checker::effects::{KEY_HEADER, TURN_HEADER};
use converger_checker::history::History;
use converger_client::agent::{Agent, AgentOptions, Turn};
use converger_client::frames::MessageFrame;
use converger_client::streams::AnswerStream;
use converger_client::{
    Backoff, ClientError, Conversation, ConversationOptions, ServerFrame, SessionOptions,
};
use converger_core::policies::TurnPolicy;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use uuid::Uuid;

/// A user stops waiting for the answer to an acked turn after this long and sends the next
/// one; the settle phase still requires every turn to be answered.
const ANSWER_WAIT: Duration = Duration::from_secs(20);
/// Pause before trying again after a failed connect or a failed call.
const RETRY_PAUSE: Duration = Duration::from_millis(250);
/// Writes of one reply (`reply_attempts` each) before the agent moves on.
const REPLY_ROUNDS: usize = 3;
/// Share of answers an agent holds back for [`SLOW_ANSWER`], longer than the soak nodes'
/// `turns.stop_grace_ms`.
const SLOW_SHARE: f64 = 0.2;
/// How long a slow answer is held back.
const SLOW_ANSWER: Duration = Duration::from_millis(400);

/// Where the run is: users send while `Running`, finish their turn in flight while
/// `Draining`, and return once `Stopped`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Users send turns.
    Running,
    /// Users send nothing new and wait for their turn in flight.
    Draining,
    /// Users return.
    Stopped,
}

/// Counts kept by the users and agents.
#[derive(Debug, Default)]
pub struct Counters {
    /// Turns users sent (distinct clientIds).
    pub turns_sent: AtomicU64,
    /// Turns acked.
    pub turns_acked: AtomicU64,
    /// Answers users received to their own turns.
    pub answers_received: AtomicU64,
    /// Acked turns a user stopped waiting for (answered later, or never: see the settle).
    pub answers_waited_out: AtomicU64,
    /// Reconnects of end users.
    pub user_reconnects: AtomicU64,
    /// Errors `next_frame` returned to users.
    pub user_errors: AtomicU64,
    /// Users' sends refused as `unavailable` (no database answered; resent by the client).
    pub unavailable_refusals: AtomicU64,
    /// Agent connections opened (first ones and replacements).
    pub agent_connections: AtomicU64,
    /// Answers streamed whole before their result was sent.
    pub streams_sent: AtomicU64,
    /// Results acked as newly committed.
    pub results_committed: AtomicU64,
    /// Results acked as duplicates of a committed one.
    pub results_duplicate: AtomicU64,
    /// Effect calls that failed every attempt.
    pub effect_failures: AtomicU64,
    /// Stops users sent (each for a turn of theirs just acked).
    pub stops_sent: AtomicU64,
    /// Stops acked with `stopped: true` (the turn was still running).
    pub stops_stopping: AtomicU64,
    /// Turns the gateway settled after a stop or an interrupt, as their users saw them.
    pub settlements_seen: AtomicU64,
    /// Second turns users sent while the first was unanswered, by policy.
    double_texts: Mutex<BTreeMap<String, u64>>,
    /// Second turns refused as `turn_in_progress` (policy `reject`).
    pub double_texts_refused: AtomicU64,
    /// Answers the agents held back past the grace period (ignoring `cancel`).
    pub slow_answers: AtomicU64,
    /// Refused results, by error code (`lease_lost`, `turn_conflict`, …).
    refused: Mutex<BTreeMap<String, u64>>,
}

impl Counters {
    /// The value of one counter.
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// Refused results by code.
    pub fn refused(&self) -> BTreeMap<String, u64> {
        lock(&self.refused).clone()
    }

    /// Double texts sent, by policy.
    pub fn double_texts(&self) -> BTreeMap<String, u64> {
        lock(&self.double_texts).clone()
    }

    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn note_refusal(&self, code: &str) {
        *lock(&self.refused).entry(code.to_owned()).or_default() += 1;
    }
}

/// What a user last reported: how far its conversation is seen, and whether a turn is open.
#[derive(Debug, Clone, Copy, Default)]
pub struct UserStatus {
    /// Its conversation.
    pub conversation_id: Uuid,
    /// The client's watermark: the highest seq with nothing missing below it.
    pub watermark: i64,
    /// A turn sent and not yet answered (nor waited out).
    pub in_flight: bool,
}

/// What every user and agent task shares.
pub struct Load {
    /// The records for the checker.
    pub history: History,
    /// Counts of the run.
    pub counters: Counters,
    ws_urls: Vec<String>,
    agent_token: String,
    group: String,
    effects_url: String,
    seed: u64,
    think_ms: u64,
    stop_share: f64,
    double_share: f64,
    http: reqwest::Client,
    phase: watch::Receiver<Phase>,
    users: Mutex<Vec<UserStatus>>,
}

/// How to build a [`Load`].
pub struct LoadSettings {
    /// Client endpoints, one per node (through the proxies).
    pub ws_urls: Vec<String>,
    /// Channel-scope token of the agents.
    pub agent_token: String,
    /// The agents' group.
    pub group: String,
    /// The effects service.
    pub effects_url: String,
    /// Seed of the users' think times.
    pub seed: u64,
    /// Mean pause between an answer and the user's next turn.
    pub think_ms: u64,
    /// Share of turns a user stops right after their ack.
    pub stop_share: f64,
    /// Share of turns a user follows at once with a second one, under a random turn policy.
    pub double_share: f64,
}

impl Load {
    /// The shared state; `phase` tells users when to stop.
    pub fn new(settings: LoadSettings, phase: watch::Receiver<Phase>) -> anyhow::Result<Load> {
        Ok(Load {
            history: History::default(),
            counters: Counters::default(),
            ws_urls: settings.ws_urls,
            agent_token: settings.agent_token,
            group: settings.group,
            effects_url: settings.effects_url,
            seed: settings.seed,
            think_ms: settings.think_ms,
            stop_share: settings.stop_share,
            double_share: settings.double_share,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()?,
            phase,
            users: Mutex::new(Vec::new()),
        })
    }

    /// The last status of every user.
    pub fn user_statuses(&self) -> Vec<UserStatus> {
        lock(&self.users).clone()
    }

    fn report(&self, index: usize, status: UserStatus) {
        let mut users = lock(&self.users);
        if users.len() <= index {
            users.resize(index + 1, UserStatus::default());
        }
        users[index] = status;
    }
}

/// Every update behind these locks is one assignment or one increment, so a poisoned lock still
/// holds consistent data.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Reconnect quickly and never give up: a node is down for seconds, not minutes.
fn session_options() -> SessionOptions {
    SessionOptions {
        backoff: Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
            max_attempts: None,
        },
        connect_timeout: Duration::from_secs(5),
        write_timeout: Duration::from_secs(5),
        ..SessionOptions::default()
    }
}

/// A turn sent and not answered yet.
struct InFlight {
    client_id: String,
    seq: Option<i64>,
    sent: Instant,
    /// A second turn sent while the first was unanswered.
    double: bool,
}

/// One end user: sends a turn, waits for its ack and its answer, thinks, sends the next, until
/// the phase says otherwise. It connects to node `index % nodes`.
pub async fn user(load: Arc<Load>, index: usize, conversation_id: Uuid, token: String) {
    let name = format!("user-{index}");
    let url = load.ws_urls[index % load.ws_urls.len()].clone();
    let mut phase = load.phase.clone();
    let mut rng = StdRng::seed_from_u64(load.seed ^ (index as u64).rotate_left(32));
    let options = ConversationOptions {
        conversation_id: Some(conversation_id),
        watermark: 0,
        session: session_options(),
    };
    let mut conversation = loop {
        match Conversation::connect_with(&url, &token, options.clone()).await {
            Ok(conversation) => {
                load.history.connected(&name);
                break conversation;
            }
            Err(error) => {
                tracing::warn!(user = %name, %error, "connect failed; trying again");
                if *phase.borrow() == Phase::Stopped {
                    return;
                }
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
    };
    let mut next = 0u64;
    let mut stops = 0u64;
    let mut stop_on_chunk: Option<i64> = None;
    let mut flights: Vec<InFlight> = Vec::new();
    // Seqs of turns whose answer (or settlement) arrived: after a reconnect the replayed
    // answer can come before the resent turn's ack.
    let mut answered: BTreeSet<i64> = BTreeSet::new();
    loop {
        let now = *phase.borrow();
        if now == Phase::Stopped {
            return;
        }
        if flights.is_empty() && now == Phase::Running {
            let client_id = format!("u{index}-{next}");
            next += 1;
            if let Err(error) = conversation.send_text(&client_id, "turn").await {
                tracing::warn!(user = %name, %error, "send refused by the client");
                continue;
            }
            Counters::bump(&load.counters.turns_sent);
            flights.push(InFlight {
                client_id,
                seq: None,
                sent: Instant::now(),
                double: false,
            });
        }
        load.report(
            index,
            UserStatus {
                conversation_id,
                watermark: conversation.watermark(),
                in_flight: !flights.is_empty(),
            },
        );
        // Cancelling `next_frame` is safe (reads are cancel-safe; a send interrupted mid-way
        // is resent from the outbox), and happens once, at the end.
        let frame = tokio::select! {
            frame = conversation.next_frame() => frame,
            _ = phase.wait_for(|phase| *phase == Phase::Stopped) => return,
        };
        match frame {
            Ok(ServerFrame::Ack(ack)) => {
                if ack.stopped == Some(true) {
                    Counters::bump(&load.counters.stops_stopping);
                }
                let flight = flights.iter_mut().find(|flight| {
                    flight.seq.is_none() && ack.client_id.as_deref() == Some(&flight.client_id)
                });
                if let (Some(flight), Some(seq)) = (flight, ack.seq) {
                    load.history
                        .acked(&name, &flight.client_id, conversation_id, seq);
                    Counters::bump(&load.counters.turns_acked);
                    flight.seq = Some(seq);
                    // The first turn of a round may be stopped, or followed at once by a
                    // second one under a random policy.
                    if !flight.double && now == Phase::Running {
                        let roll: f64 = rng.random();
                        if roll < load.stop_share / 2.0 {
                            stops += 1;
                            send_stop(&load, &mut conversation, index, stops, seq).await;
                        } else if roll < load.stop_share {
                            // Stopped mid-stream: once its first chunk is seen.
                            stop_on_chunk = Some(seq);
                        } else if roll < load.stop_share + load.double_share {
                            let policies = TurnPolicy::ALL;
                            let policy = policies[rng.random_range(0..policies.len())].as_str();
                            let client_id = format!("u{index}-{next}");
                            next += 1;
                            let frame = json!({"type": "text", "data": {"text": "again"},
                                               "turnPolicy": policy});
                            if conversation.send_message(&client_id, frame).await.is_ok() {
                                Counters::bump(&load.counters.turns_sent);
                                *lock(&load.counters.double_texts)
                                    .entry(policy.to_owned())
                                    .or_default() += 1;
                                flights.push(InFlight {
                                    client_id,
                                    seq: None,
                                    sent: Instant::now(),
                                    double: true,
                                });
                            }
                        }
                    }
                }
            }
            Ok(ServerFrame::Message(message)) => {
                load.history.received(&name, conversation_id, message.seq);
                if let Some((seq, text)) = settled_turn(&message) {
                    answered.insert(seq);
                    Counters::bump(&load.counters.settlements_seen);
                    if let Some(id) = &message.id {
                        load.history
                            .stop_settled_seen(&name, (conversation_id, id.clone()), text);
                    }
                } else if let (Some(id), Some(text)) = (&message.id, message.text()) {
                    load.history
                        .stream_answer_seen(&name, (conversation_id, id.clone()), text);
                }
                if let Some(seq) = answer_to(&message) {
                    answered.insert(seq);
                }
            }
            Ok(ServerFrame::StreamChunk(chunk)) => {
                load.history.stream_chunks_seen(
                    &name,
                    (conversation_id, chunk.stream_id.clone()),
                    chunk.first_index,
                    chunk.index,
                    chunk.text.as_deref().unwrap_or_default(),
                );
                if stop_on_chunk == Some(chunk.turn.0) {
                    stop_on_chunk = None;
                    stops += 1;
                    send_stop(&load, &mut conversation, index, stops, chunk.turn.0).await;
                }
            }
            Ok(ServerFrame::StreamEnd(end)) => {
                load.history.stream_end_seen(
                    &name,
                    (conversation_id, end.stream_id),
                    end.committed,
                );
            }
            Ok(ServerFrame::Welcome(_)) => {
                load.history.connected(&name);
                Counters::bump(&load.counters.user_reconnects);
            }
            Ok(ServerFrame::Error(error)) if error.code == "unavailable" => {
                Counters::bump(&load.counters.unavailable_refusals);
            }
            Ok(ServerFrame::Error(error)) if error.code == "turn_in_progress" => {
                // A double text under `reject`: nothing was stored, nothing to wait for.
                Counters::bump(&load.counters.double_texts_refused);
                flights.retain(|flight| error.client_id.as_deref() != Some(&flight.client_id));
            }
            Ok(_) => {}
            Err(error) => {
                Counters::bump(&load.counters.user_errors);
                tracing::warn!(user = %name, %error, "the conversation failed; reconnecting");
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
        let waiting = flights.len();
        flights.retain(|flight| match flight.seq {
            Some(seq) if answered.contains(&seq) => {
                Counters::bump(&load.counters.answers_received);
                false
            }
            Some(seq) if flight.sent.elapsed() > ANSWER_WAIT => {
                Counters::bump(&load.counters.answers_waited_out);
                tracing::warn!(user = %name, seq, "no answer yet; sending the next turn");
                false
            }
            _ => true,
        });
        if waiting > 0 && flights.is_empty() {
            let think = load.think_ms / 2 + rng.random_range(0..=load.think_ms);
            tokio::time::sleep(Duration::from_millis(think)).await;
        }
    }
}

/// Sends a `stop` of the user's turn `seq`, keyed `s<user>-<n>`.
async fn send_stop(
    load: &Load,
    conversation: &mut Conversation,
    index: usize,
    stops: u64,
    seq: i64,
) {
    let stop = converger_client::outgoing::stop(Some(seq));
    if conversation
        .send_message(&format!("s{index}-{stops}"), stop)
        .await
        .is_ok()
    {
        Counters::bump(&load.counters.stops_sent);
    }
}

/// The turn the gateway settled after a stop (`data.status: "stopped"`, `data.turn.seq`) and
/// the text it settled with.
fn settled_turn(message: &MessageFrame) -> Option<(i64, &str)> {
    let from_gateway = message
        .sender
        .as_ref()
        .is_some_and(|sender| sender.role == "system");
    if !from_gateway || message.data["status"] != "stopped" {
        return None;
    }
    Some((message.data["turn"]["seq"].as_i64()?, message.text()?))
}

/// The seq of the user turn an agent's frame answers (`answer <seq>`).
fn answer_to(message: &MessageFrame) -> Option<i64> {
    let from_agent = message
        .sender
        .as_ref()
        .is_some_and(|sender| sender.role == "agent");
    if !from_agent {
        return None;
    }
    message.text()?.strip_prefix("answer ")?.parse().ok()
}

/// The agents, one task per slot; a killed agent is replaced by the slot's next generation.
pub struct Agents {
    load: Arc<Load>,
    slots: Vec<(usize, JoinHandle<()>)>,
}

impl Agents {
    /// Starts `count` agents.
    pub fn start(load: Arc<Load>, count: usize) -> Agents {
        let slots = (0..count)
            .map(|slot| (0, tokio::spawn(agent(Arc::clone(&load), slot, 0))))
            .collect();
        Agents { load, slots }
    }

    /// How many agent slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Kills the agent of `slot` (its task and socket go at once, no close frame) and starts a
    /// new one in its place, on the next node.
    pub fn replace(&mut self, slot: usize) {
        let Some((generation, task)) = self.slots.get_mut(slot) else {
            return;
        };
        task.abort();
        *generation += 1;
        *task = tokio::spawn(agent(Arc::clone(&self.load), slot, *generation));
    }

    /// Kills every agent.
    pub fn stop(self) {
        for (_, task) in self.slots {
            task.abort();
        }
    }
}

/// One agent of the group in lease mode: for each turn, the effect (keyed by `meta.turn.key`),
/// then the answer `answer <seq>`. Runs until its task is aborted.
async fn agent(load: Arc<Load>, slot: usize, generation: usize) {
    let name = format!("agent-{slot}.{generation}");
    let url = load.ws_urls[(slot + generation) % load.ws_urls.len()].clone();
    let options = AgentOptions {
        group: Some(load.group.clone()),
        lease: true,
        session: session_options(),
        ..AgentOptions::default()
    };
    let mut agent = loop {
        match Agent::connect_with(&url, &load.agent_token, options.clone()).await {
            Ok(agent) => break agent,
            Err(error) => {
                tracing::debug!(agent = %name, %error, "connect failed; trying again");
                tokio::time::sleep(RETRY_PAUSE).await;
            }
        }
    };
    Counters::bump(&load.counters.agent_connections);
    tracing::debug!(agent = %name, connection = %agent.welcome()["connectionId"], "agent joined");
    let mut rng = StdRng::seed_from_u64(load.seed ^ ((slot as u64) << 48) ^ generation as u64);
    let mut streams_opened = 0u64;
    loop {
        let turn = match agent.next_turn().await {
            Ok(turn) => turn,
            Err(error) => {
                tracing::warn!(agent = %name, %error, "the agent session failed; reconnecting");
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        load.history
            .delivered((turn.conversation_id, turn.seq, turn.revision));
        perform_effect(&load, &turn).await;
        streams_opened += 1;
        let stream_id = format!("{name}.{streams_opened}");
        let streamed = stream_answer(&load, &mut agent, &turn, &stream_id).await;
        // Some answers come after the grace period of a stop: the gateway settles those turns
        // and the answer is refused (`turn_stopped`); the rest win the race.
        if rng.random::<f64>() < SLOW_SHARE {
            Counters::bump(&load.counters.slow_answers);
            tokio::time::sleep(SLOW_ANSWER).await;
        }
        answer(
            &load,
            &mut agent,
            &turn,
            &name,
            streamed.then_some(stream_id),
        )
        .await;
    }
}

/// The answer's text deltas: `answer <seq>` in three chunks.
fn answer_chunks(seq: i64) -> [String; 3] {
    ["answer".to_owned(), " ".to_owned(), seq.to_string()]
}

/// Streams the answer's chunks under `stream_id`, each recorded before it is sent; false when
/// a chunk could not be sent (the server then aborts the stream, and the answer is committed
/// without it).
async fn stream_answer(load: &Load, agent: &mut Agent, turn: &Turn, stream_id: &str) -> bool {
    let mut stream = AnswerStream::open(turn, stream_id);
    for (index, delta) in answer_chunks(turn.seq).iter().enumerate() {
        load.history.stream_chunk_sent(
            (turn.conversation_id, stream_id.to_owned()),
            index as u64,
            delta,
        );
        if let Err(error) = stream.text(agent, delta).await {
            tracing::debug!(%error, stream_id, "stream chunk not sent");
            return false;
        }
    }
    Counters::bump(&load.counters.streams_sent);
    true
}

/// Calls the effects service for the turn, retrying a failed call a few times.
async fn perform_effect(load: &Load, turn: &Turn) {
    let turn_name = format!("{}/{}/{}", turn.conversation_id, turn.seq, turn.revision);
    for _ in 0..20 {
        let call = load
            .http
            .post(&load.effects_url)
            .header(KEY_HEADER, &turn.key)
            .header(TURN_HEADER, &turn_name)
            .send()
            .await;
        match call {
            Ok(answer) if answer.status().is_success() => return,
            Ok(answer) => tracing::warn!(status = %answer.status(), "the effects service refused"),
            Err(error) => tracing::warn!(%error, "the effects service did not answer"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Counters::bump(&load.counters.effect_failures);
}

/// Replies to the turn and records a newly committed result in the history. With a stream,
/// the stored frame takes the stream's id (it replaces the streamed answer).
async fn answer(load: &Load, agent: &mut Agent, turn: &Turn, name: &str, stream: Option<String>) {
    let mut frame = json!({"type": "text", "data": {"text": answer_chunks(turn.seq).concat()}});
    if let Some(stream_id) = stream {
        frame["streamId"] = json!(stream_id);
    }
    let frames: Vec<Value> = vec![frame];
    for _ in 0..REPLY_ROUNDS {
        match agent.reply(turn, frames.clone(), None).await {
            Ok(ack) if ack.duplicate => {
                Counters::bump(&load.counters.results_duplicate);
                return;
            }
            Ok(ack) => {
                Counters::bump(&load.counters.results_committed);
                load.history
                    .result_committed((turn.conversation_id, turn.seq, turn.revision), ack.seqs);
                return;
            }
            Err(ClientError::Refused { code, .. }) => {
                tracing::debug!(agent = %name, code = %code, seq = turn.seq, "result refused");
                load.counters.note_refusal(&code);
                return;
            }
            // The same clientId again: a late ack of an earlier write still counts once.
            Err(ClientError::Unacknowledged(_)) => continue,
            Err(error) => {
                // The result stays queued in the client and goes out after the reconnect.
                tracing::warn!(agent = %name, %error, seq = turn.seq, "reply interrupted");
                return;
            }
        }
    }
}
