//! One turn's calls to an HTTP agent (ADR 0031): each attempt posts the turn, streams the text
//! it reads to every tab and commits the run's answer keyed by (conversation, seq, revision);
//! failures are retried with backoff under the same idempotency key, and a turn whose calls all
//! failed settles as `failed`, with a dead letter and an `agent_failed` error to its end users.

use std::sync::Arc;
use std::time::Duration;

use converger_core::http_agents::{Admission, Breaker, BreakerState, backoff_ms};
use converger_core::streams::StreamTurn;
use converger_protocol::ag_ui::RunAgentInput;
use converger_protocol::{StreamContent, TurnNumber, TurnRef, agent_failed};
use converger_store::bus::Origin;
use converger_store::{
    Activity, AnswerOutcome, DeadLetter, HttpAgent, RuntimeWrite, Sender, SenderRole, TurnAnswer,
};
use futures_util::StreamExt;
use rand::RngExt;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use uuid::Uuid;

use super::fold::{RunFold, Step};
use super::request::{Answer, CallError, CallRequest};
use crate::publish::{self, Audience, Transient};
use crate::state::AppState;
use crate::streams::{ChunkBody, LocalChunk};

/// What every call to one URL shares on a node: the concurrency cap and the circuit breaker.
pub(crate) struct UrlGate {
    calls: Semaphore,
    capacity: usize,
    breaker: std::sync::Mutex<Breaker>,
    /// The URL without its query, as metrics and logs name it.
    label: String,
}

impl UrlGate {
    /// A gate letting `capacity` calls to the URL `label` names run at once.
    pub(crate) fn new(capacity: usize, breaker: Breaker, label: String) -> UrlGate {
        UrlGate {
            calls: Semaphore::new(capacity),
            capacity,
            breaker: std::sync::Mutex::new(breaker),
            label,
        }
    }

    /// Calls it lets run at once.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }

    /// The breaker's state now.
    pub(crate) fn breaker_state(&self) -> BreakerState {
        self.breaker().state()
    }

    fn breaker(&self) -> std::sync::MutexGuard<'_, Breaker> {
        // A panic while the lock was held leaves a breaker that is still consistent.
        self.breaker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A call admitted by the breaker; a probe that ends without an outcome (its turn cancelled)
/// lets the next call probe.
struct Admitted<'a> {
    gate: &'a UrlGate,
    probe: bool,
    settled: bool,
}

impl Admitted<'_> {
    fn settle(mut self, outcome: &Result<(), CallError>) {
        self.settled = true;
        let mut breaker = self.gate.breaker();
        match outcome {
            Err(error) if error.counts_against_url() => breaker.failed(now_ms()),
            _ => breaker.succeeded(),
        }
        let open = breaker.state() != BreakerState::Closed;
        metrics::gauge!("converger_http_agent_breaker_open", "url" => self.gate.label.clone())
            .set(f64::from(u8::from(open)));
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        if self.probe && !self.settled {
            self.gate.breaker().probe_abandoned(now_ms());
        }
    }
}

fn now_ms() -> u64 {
    u64::try_from(chrono::Utc::now().timestamp_millis()).unwrap_or_default()
}

/// A turn delivered to an HTTP agent group's member on this node.
pub(crate) struct DeliveredTurn {
    /// The turn's frame (its latest edit).
    pub activity: Arc<Activity>,
    /// `meta.turn`: seq, revision, key.
    pub turn: TurnRef,
}

/// What a member's calls share.
pub(crate) struct Caller {
    pub state: AppState,
    pub agent: Arc<HttpAgent>,
    pub gate: Arc<UrlGate>,
    pub client: reqwest::Client,
    /// The member's connection id (the origin of what it publishes).
    pub connection: String,
    /// `{id: <group>, role: "agent"}`, shared by every chunk.
    pub from: Arc<Value>,
}

impl Caller {
    /// Calls until the turn has its one result or the group's attempts are spent.
    pub(crate) async fn serve(self: Arc<Self>, delivered: DeliveredTurn) {
        let attempts = u32::try_from(self.agent.retry_attempts.max(1)).unwrap_or(1);
        let first_backoff = u64::try_from(self.agent.retry_backoff_ms).unwrap_or(0);
        let mut last_error = None;
        for attempt in 1..=attempts {
            if attempt > 1 {
                metrics::counter!("converger_http_agent_retries_total").increment(1);
                let wait = backoff_ms(first_backoff, attempt) as f64;
                let spread = rand::rng().random_range(0.5..1.5);
                tokio::time::sleep(Duration::from_millis((wait * spread) as u64)).await;
            }
            match self.still_waiting(&delivered).await {
                Ok(true) => {}
                Ok(false) => return,
                Err(error) => {
                    last_error = Some(error);
                    continue;
                }
            }
            let started = std::time::Instant::now();
            let outcome = self.attempt(&delivered).await;
            let label = match &outcome {
                Ok(()) => "answered",
                Err(error) => error.label(),
            };
            metrics::counter!("converger_http_agent_calls_total", "outcome" => label).increment(1);
            metrics::histogram!("converger_http_agent_call_seconds")
                .record(started.elapsed().as_secs_f64());
            match outcome {
                Ok(()) => return,
                Err(error) => {
                    tracing::warn!(
                        group = %self.agent.group_name,
                        url = %self.gate.label,
                        conversation_id = %delivered.activity.conversation_id,
                        seq = delivered.turn.seq,
                        revision = delivered.turn.revision,
                        attempt,
                        %error,
                        "http agent call failed"
                    );
                    let retryable = error.is_retryable();
                    last_error = Some(error);
                    if !retryable {
                        break;
                    }
                }
            }
        }
        let error = last_error.map_or_else(|| "no call made".to_owned(), |error| error.to_string());
        self.fail(&delivered, attempts, error).await;
    }

    /// True while the turn revision still waits for an answer (a takeover, another group, a
    /// stop or an edit may have settled or replaced it since the delivery).
    async fn still_waiting(&self, delivered: &DeliveredTurn) -> Result<bool, CallError> {
        let turn = &delivered.turn;
        let found = self
            .state
            .store
            .streamable_turn(delivered.activity.conversation_id, turn.seq, turn.revision)
            .await
            .map_err(|error| CallError::Store(error.to_string()))?;
        Ok(found.is_some_and(|found| found.pending && found.latest_revision == turn.revision))
    }

    /// One call: admitted by the breaker, under the concurrency cap, bounded by `timeoutMs`
    /// until the run is read; then the commit.
    async fn attempt(&self, delivered: &DeliveredTurn) -> Result<(), CallError> {
        if !super::is_allowed(&self.state.config.http_agents, &self.agent.url) {
            return Err(CallError::NotAllowed);
        }
        let _slot = self
            .gate
            .calls
            .acquire()
            .await
            .map_err(|_| CallError::Connect("the node is shutting down".into()))?;
        let admission = self.gate.breaker().admit(now_ms());
        let admitted = match admission {
            Admission::Refused => return Err(CallError::CircuitOpen),
            Admission::Call | Admission::Probe => Admitted {
                gate: &self.gate,
                probe: admission == Admission::Probe,
                settled: false,
            },
        };
        let mut streams =
            AttemptStreams::new(&self.state, delivered, self.agent.channel_id, &self.from);
        let timeout = Duration::from_millis(u64::try_from(self.agent.timeout_ms).unwrap_or(1));
        let run = tokio::time::timeout(timeout, self.run(delivered, &mut streams))
            .await
            .unwrap_or(Err(CallError::Timeout));
        let read = run.as_ref().map(|_| ()).map_err(Clone::clone);
        admitted.settle(&read);
        let (fold, runtime_version) = run?;
        let (frames, new_state) = fold.answer(|index| streams.id_of(index));
        check_answer(&self.state.config.limits, &frames, new_state.as_ref())?;
        let answer = TurnAnswer {
            conversation_id: delivered.activity.conversation_id,
            seq: delivered.turn.seq,
            revision: delivered.turn.revision,
            sender: Sender {
                id: self.agent.group_name.clone(),
                role: SenderRole::Agent,
            },
            frames,
            runtime: new_state.map(|state| RuntimeWrite {
                version: runtime_version,
                state,
            }),
            fence: None,
        };
        let outcome =
            crate::answers::commit(&self.state, self.agent.channel_id, &answer, self.origin())
                .await;
        // The commit settled the turn's streams (or left them to the retry, which aborts them).
        streams.keep();
        match outcome {
            Ok(AnswerOutcome::Committed { activities, .. }) => {
                publish::committed(
                    &self.state.hub,
                    self.agent.channel_id,
                    answer.conversation_id,
                    activities.into_iter().map(Arc::new),
                );
                Ok(())
            }
            // Another call, node or group settled it, or the turn moved on: nothing to retry.
            Ok(
                AnswerOutcome::Duplicate { .. }
                | AnswerOutcome::Conflict { .. }
                | AnswerOutcome::Superseded { .. }
                | AnswerOutcome::LeaseLost { .. }
                | AnswerOutcome::NoSuchTurn
                | AnswerOutcome::Closed
                | AnswerOutcome::Stopped,
            ) => Ok(()),
            Ok(AnswerOutcome::StaleRuntime { .. }) => Err(CallError::Invalid(
                "the runtime changed during the call; calling again with the new one".into(),
            )),
            Err(error) if error.is_refused_input() => Err(CallError::Invalid(
                "the answer cannot be stored (a NUL character)".into(),
            )),
            Err(error) => Err(CallError::Store(error.to_string())),
        }
    }

    /// Posts the turn and folds the run's events, streaming its text; returns the fold and
    /// the runtime version the input carried.
    async fn run(
        &self,
        delivered: &DeliveredTurn,
        streams: &mut AttemptStreams<'_>,
    ) -> Result<(RunFold, i64), CallError> {
        let conversation_id = delivered.activity.conversation_id;
        let store = &self.state.store;
        let store_error = |error: converger_store::StoreError| CallError::Store(error.to_string());
        let runtimes = store
            .runtimes(&[conversation_id])
            .await
            .map_err(store_error)?;
        let (version, runtime) = runtimes
            .get(&conversation_id)
            .cloned()
            .unwrap_or_else(converger_store::initial_runtime);
        let limit = self.state.config.http_agents.max_history_frames;
        let history = crate::chat_history::chat_view_frames(
            store,
            conversation_id,
            delivered.activity.seq,
            limit,
        )
        .await
        .map_err(store_error)?;
        let client = delivered
            .activity
            .extra
            .as_ref()
            .and_then(|extra| extra.get("meta"))
            .and_then(|meta| meta.get("agUi"));
        let from_client = |name: &str, empty: Value| {
            client
                .and_then(|client| client.get(name))
                .cloned()
                .unwrap_or(empty)
        };
        let input = RunAgentInput {
            thread_id: conversation_id.to_string(),
            run_id: delivered.turn.key.clone(),
            messages: crate::chat_history::ag_ui_messages(&history),
            state: Some(runtime.clone()),
            tools: Some(from_client("tools", json!([]))),
            context: Some(from_client("context", json!([]))),
            forwarded_props: Some(from_client("forwardedProps", json!({}))),
            resume: None,
        };
        let body = serde_json::to_vec(&input)
            .map_err(|error| CallError::Invalid(format!("input: {error}")))?;
        let answer = CallRequest {
            client: &self.client,
            url: &self.agent.url,
            body,
            key: &delivered.turn.key,
            secret: self.agent.secret.as_deref(),
            max_response_bytes: self.state.config.http_agents.max_response_bytes,
        }
        .send()
        .await?;
        let mut fold = RunFold::new(runtime);
        match answer {
            Answer::Json(answer) => fold.apply_json(answer),
            Answer::Events(mut events) => {
                while let Some(event) = events.next().await {
                    let step = fold
                        .apply(event?)
                        .map_err(|error| CallError::Invalid(error.to_string()))?;
                    match step {
                        Step::Nothing => {}
                        Step::Text { message, delta } => streams.push(message, delta),
                        Step::Finished => break,
                        Step::Failed(message) => return Err(CallError::RunError(message)),
                    }
                }
            }
        }
        if !fold.is_finished() {
            return Err(CallError::Cut);
        }
        Ok((fold, version))
    }

    /// Settles a turn whose calls all failed: `failed`, a dead letter, and `agent_failed` to
    /// its end users on every node.
    async fn fail(&self, delivered: &DeliveredTurn, attempts: u32, error: String) {
        let conversation_id = delivered.activity.conversation_id;
        let letter = DeadLetter {
            conversation_id,
            seq: delivered.turn.seq,
            revision: delivered.turn.revision,
            channel_id: self.agent.channel_id,
            group_name: self.agent.group_name.clone(),
            url: self.agent.url.clone(),
            attempts: i32::try_from(attempts).unwrap_or(i32::MAX),
            error,
            failed_at: chrono::Utc::now(),
        };
        match self.state.store.fail_turn(&letter).await {
            Ok(true) => {}
            // Answered, stopped or replaced meanwhile: it has its result.
            Ok(false) => return,
            Err(error) => {
                // The turn stays pending: a later takeover or redelivery calls again.
                tracing::error!(%error, %conversation_id, "http agent: failed turn not recorded");
                return;
            }
        }
        metrics::counter!("converger_http_agent_failed_turns_total").increment(1);
        tracing::warn!(
            group = %letter.group_name,
            %conversation_id,
            seq = letter.seq,
            revision = letter.revision,
            attempts,
            error = %letter.error,
            "http agent: turn failed; dead letter written"
        );
        let turn = TurnNumber {
            seq: letter.seq,
            revision: letter.revision,
        };
        Transient {
            channel_id: self.agent.channel_id,
            conversation_id,
            frame: agent_failed(&letter.group_name, turn),
            origin: self.origin(),
            audience: Audience::EndUsers,
        }
        .publish(&self.state)
        .await;
    }

    fn origin(&self) -> Origin {
        Origin {
            id: self.agent.group_name.clone(),
            role: "agent".into(),
            connection: self.connection.clone(),
        }
    }
}

/// Holds an HTTP agent's answer to the limits a WebSocket agent's `turnResult` is held to: each
/// frame as `validate_agent_message_frame` checks it, the state an object within
/// `limits.max_frame_bytes`.
fn check_answer(
    limits: &converger_protocol::Limits,
    frames: &[converger_store::AnswerFrame],
    state: Option<&Value>,
) -> Result<(), CallError> {
    for frame in frames {
        let mut object = frame.extra.clone();
        object.insert("type".into(), Value::String(frame.kind.clone()));
        object.insert("data".into(), frame.data.clone());
        if let Some(id) = &frame.id {
            object.insert("id".into(), Value::String(id.clone()));
        }
        if let Some(metadata) = &frame.metadata {
            object.insert("metadata".into(), metadata.clone());
        }
        converger_protocol::validate_agent_message_frame(&Value::Object(object), limits)
            .map_err(|error| CallError::Invalid(format!("answer frame: {}", error.message)))?;
    }
    if let Some(state) = state {
        if !state.is_object() {
            return Err(CallError::Invalid("the state must be a JSON object".into()));
        }
        if state.to_string().len() > limits.max_frame_bytes {
            return Err(CallError::Invalid(format!(
                "the state is larger than limits.max_frame_bytes ({})",
                limits.max_frame_bytes
            )));
        }
    }
    Ok(())
}

/// The streams of one call: one per text message, owned by the call alone, so that a failed
/// call's streams end (aborted) when it is dropped and a retry opens new ones.
struct AttemptStreams<'a> {
    state: &'a AppState,
    conversation_id: Uuid,
    turn: StreamTurn,
    owner: String,
    channel: String,
    from: &'a Arc<Value>,
    /// Per text message: its stream.
    streams: Vec<MessageStream>,
    kept: bool,
}

impl<'a> AttemptStreams<'a> {
    fn new(
        state: &'a AppState,
        delivered: &DeliveredTurn,
        channel_id: Uuid,
        from: &'a Arc<Value>,
    ) -> Self {
        AttemptStreams {
            state,
            conversation_id: delivered.activity.conversation_id,
            turn: StreamTurn {
                seq: delivered.turn.seq,
                revision: delivered.turn.revision,
            },
            owner: format!("http:{}", Uuid::new_v4()),
            channel: channel_id.to_string(),
            from,
            streams: Vec::new(),
            kept: false,
        }
    }

    /// Streams `delta` of the run's `message`-th text message.
    fn push(&mut self, message: usize, delta: String) {
        while self.streams.len() <= message {
            // Unique within the conversation across calls, nodes and retries.
            let id = format!(
                "http-{}-{}-{}-{}",
                self.turn.seq,
                self.turn.revision,
                &self.owner[5..13],
                self.streams.len()
            );
            self.streams.push(MessageStream {
                id,
                next: 0,
                refused: false,
            });
        }
        let stream = &mut self.streams[message];
        if stream.refused {
            return;
        }
        let accepted = self.state.streams.accept(
            &self.state.hub,
            LocalChunk {
                conversation_id: self.conversation_id,
                stream_id: &stream.id,
                index: stream.next,
                turn: Some(self.turn),
                fence: None,
                owner: &self.owner,
                channel: &self.channel,
                body: ChunkBody {
                    content: StreamContent::Text(delta),
                    from: Arc::clone(self.from),
                },
            },
        );
        match accepted {
            Ok(()) => stream.next += 1,
            Err(refusal) => {
                // The answer still commits; only the live view of this message stops.
                tracing::debug!(?refusal, stream_id = %stream.id, "http agent: chunk refused");
                stream.refused = true;
            }
        }
    }

    /// The stream id of the `index`-th text message, when it was streamed.
    fn id_of(&self, index: usize) -> Option<String> {
        self.streams
            .get(index)
            .filter(|stream| stream.next > 0)
            .map(|stream| stream.id.clone())
    }

    /// The commit decides how the streams end.
    fn keep(&mut self) {
        self.kept = true;
    }
}

/// The stream of one text message of a call.
struct MessageStream {
    id: String,
    /// The next chunk's index (the chunks accepted so far).
    next: u64,
    /// Set when the registry refused a chunk: the rest of the message is not streamed.
    refused: bool,
}

impl Drop for AttemptStreams<'_> {
    fn drop(&mut self) {
        if !self.kept {
            self.state.streams.abort_owner(&self.state.hub, &self.owner);
        }
    }
}
