//! One turn's calls to an HTTP agent (ADR 0031): each attempt posts the turn, streams the text
//! it reads to every tab and commits the run's answer keyed by (conversation, seq, revision);
//! failures are retried with backoff under the same idempotency key, and a turn whose calls all
//! failed settles as `failed`, with a dead letter and an `agent_failed` error to its end users.

use std::sync::Arc;
use std::time::Duration;

use converger_core::http_agents::backoff_ms;
use converger_protocol::ag_ui::RunAgentInput;
use converger_protocol::{TurnNumber, TurnRef, agent_failed};
use converger_store::bus::Origin;
use converger_store::{
    Activity, AnswerOutcome, DeadLetter, HttpAgent, RuntimeWrite, Sender, SenderRole, TurnAnswer,
};
use futures_util::StreamExt;
use rand::RngExt;
use serde_json::{Value, json};

use super::fold::{RunFold, Step};
use super::gate::UrlGate;
use super::request::{Answer, CallError, CallRequest};
use super::streams::AttemptStreams;
use crate::publish::{self, Audience, Transient};
use crate::state::AppState;

/// A turn delivered to an HTTP agent group's member on this node.
pub(crate) struct DeliveredTurn {
    /// The turn's frame (its latest edit).
    pub activity: Arc<Activity>,
    /// `meta.turn`: seq, revision, key.
    pub turn: TurnRef,
}

/// The longest failure text a dead letter keeps, in bytes.
const MAX_ERROR_BYTES: usize = 1_000;
/// Writes of a failed turn's settlement before it is left pending.
const FAIL_TRIES: u32 = 3;

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
        let mut calls_made = 0;
        for attempt in 1..=attempts {
            if attempt > 1 {
                let wait = backoff_ms(first_backoff, attempt) as f64;
                let spread = rand::rng().random_range(0.5..1.5);
                tokio::time::sleep(Duration::from_millis((wait * spread) as u64)).await;
            }
            match self.still_waiting(&delivered).await {
                Ok(true) if attempt > 1 => {
                    metrics::counter!("converger_http_agent_retries_total").increment(1);
                }
                Ok(true) => {}
                Ok(false) => return,
                Err(error) => {
                    last_error = Some(error);
                    continue;
                }
            }
            let started = std::time::Instant::now();
            calls_made = attempt;
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
                        url = %self.gate.label(),
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
        let mut error =
            last_error.map_or_else(|| "no call made".to_owned(), |error| error.to_string());
        // An agent's RUN_ERROR message can be as long as its response: the letter keeps the
        // start.
        if error.len() > MAX_ERROR_BYTES {
            let mut end = MAX_ERROR_BYTES;
            while !error.is_char_boundary(end) {
                end -= 1;
            }
            error.truncate(end);
        }
        self.fail(&delivered, calls_made, error).await;
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
        let admitted = self.gate.enter().await?;
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
        // In a task of its own: a stop that aborts this call does not cut the commit and the
        // publication of what it committed apart.
        let committing = tokio::spawn(commit_and_publish(
            self.state.clone(),
            self.agent.channel_id,
            answer,
            self.origin(),
        ));
        let (outcome, settled) = committing.await.unwrap_or_else(|_| {
            (
                Err(CallError::Store("the commit task failed".into())),
                false,
            )
        });
        if settled {
            // The commit ended the turn's streams; otherwise they end with this call (aborted)
            // and the next call streams afresh.
            streams.keep();
        }
        outcome
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
        let runtimes = self
            .state
            .runtimes
            .for_turns(
                store,
                &[crate::runtimes::delivered_at(
                    &delivered.activity,
                    &delivered.turn,
                )],
            )
            .await
            .map_err(store_error)?;
        let (version, runtime) = runtimes
            .get(&conversation_id)
            .map(|(version, state)| (*version, Value::clone(state)))
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
        let mut fold = RunFold::new(runtime, self.state.config.limits.max_frame_bytes);
        match answer {
            Answer::Json(answer) => fold.apply_json(answer),
            Answer::Events(mut events) => {
                while let Some(event) = events.next().await {
                    let step = fold.apply(event?)?;
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

    /// Settles a turn whose calls all failed after `attempts` (a call an open breaker refused
    /// counts): `failed`, a dead letter, and `agent_failed` to
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
        let mut tries = 0;
        loop {
            tries += 1;
            match self.state.store.fail_turn(&letter).await {
                Ok(true) => break,
                // Answered, stopped or replaced meanwhile: it has its result.
                Ok(false) => return,
                Err(error) if tries < FAIL_TRIES => {
                    tracing::warn!(%error, %conversation_id, "http agent: failed turn not recorded yet; retrying");
                    tokio::time::sleep(Duration::from_millis(500 * u64::from(tries))).await;
                }
                Err(error) => {
                    // The turn stays pending: a takeover calls again.
                    tracing::error!(%error, %conversation_id, "http agent: failed turn not recorded");
                    return;
                }
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

/// Commits a run's answer and publishes what it committed; the second value says whether the
/// outcome ended the turn's streams.
async fn commit_and_publish(
    state: AppState,
    channel_id: uuid::Uuid,
    answer: TurnAnswer,
    origin: Origin,
) -> (Result<(), CallError>, bool) {
    let outcome = crate::answers::commit(&state, channel_id, &answer, origin).await;
    let settled = crate::answers::stream_settlement(&outcome).is_some();
    let result = match outcome {
        Ok(AnswerOutcome::Committed { activities, .. }) => {
            publish::committed(
                &state,
                channel_id,
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
    };
    (result, settled)
}

/// Holds an HTTP agent's answer to the limits a WebSocket agent's `turnResult` is held to: each
/// frame as `validate_agent_message_frame` checks it, all of them within
/// `limits.hard_frame_bytes`, the state an object within `limits.max_frame_bytes`.
fn check_answer(
    limits: &converger_protocol::Limits,
    frames: &[converger_store::AnswerFrame],
    state: Option<&Value>,
) -> Result<(), CallError> {
    let mut total = 0usize;
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
        let object = Value::Object(object);
        converger_protocol::validate_agent_message_frame(&object, limits)
            .map_err(|error| CallError::Invalid(format!("answer frame: {}", error.message)))?;
        total = total.saturating_add(object.to_string().len());
    }
    // A WebSocket agent's whole `turnResult` is one frame of at most `hard_frame_bytes`.
    if total > limits.hard_frame_bytes {
        return Err(CallError::TooLarge(limits.hard_frame_bytes));
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
