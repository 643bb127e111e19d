//! AG-UI over Server-Sent Events (docs/frontends.md §2): `HttpAgent({url: "{base}/api/v1/ag-ui/run"})`
//! runs a turn here; `…/connect` shows a thread's history and follows its runs live; `…/stop`
//! stops.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use axum::response::Response;
use converger_protocol::ag_ui::{Event, Interrupt, Message, RunAgentInput, RunOutcome, json_text};
use converger_protocol::{
    AnswerPart, MessageFrame, ToolCalls, answer_part, is_valid_client_id, validate_message_frame,
};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::follow::{AnswerSink, Follower, Gone, RECHECK, RunEnd, TurnKey, answer_id};
use super::{EndUser, EventSender, QUEUE, chat_view_frames, end_user, send_turn, sse_body};
use crate::error::ApiError;
use crate::hub::HubEvent;
use crate::routes::body::parse_json;
use crate::routes::conversations::frame_error;
use crate::state::AppState;

/// The frame type a run's `resume[]` is committed as: a user turn its agent answers.
const RESUME_TYPE: &str = "interrupt_response";

/// `POST /api/v1/ag-ui/run`: commits the user messages of `messages` the conversation has not
/// seen (each a turn; the last carries `state`, `tools`, `context` and `forwardedProps` to its
/// agent in the turn's meta, `agUi`) and, with `resume[]`, one `interrupt_response` turn; then streams the last turn's
/// answer as one run. With nothing new, it follows the running turn, if any.
pub(crate) async fn run(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let input: RunAgentInput = parse_json(body, false)?;
    let user = end_user(&state, &headers, &input.thread_id).await?;
    let sends = new_sends(&state, &user, &input).await?;
    let mut follower = Follower::open(&state, &user.conversation, user.claims.exp);
    let mut followed = None;
    let mut refusal = None;
    for (message, key) in sends {
        match send_turn(&state, &user.conversation, message, &key).await {
            Ok(turn) => followed = Some(turn),
            Err(error) => {
                refusal = Some(error);
                break;
            }
        }
    }
    if followed.is_none() && refusal.is_none() {
        followed = state.store.running_turn(user.conversation.id).await?;
    }
    let (sender, receiver) = mpsc::channel(QUEUE);
    let mut sink = RunStream::new(sender, input.thread_id, input.run_id);
    tokio::spawn(async move {
        let _ = match refusal {
            Some(refusal) => sink.refused(&refusal).await,
            None => sink.run(&mut follower, followed).await.map(|_| ()),
        };
    });
    Ok(sse_body(&state, receiver))
}

/// `POST /api/v1/ag-ui/connect`: the thread's chat view as a `MESSAGES_SNAPSHOT` (in a run that
/// also follows the running turn, if any), then every later turn as its own run, live, until
/// the client goes away or the session ends.
pub(crate) async fn connect(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let input: RunAgentInput = parse_json(body, false)?;
    let user = end_user(&state, &headers, &input.thread_id).await?;
    let mut follower = Follower::open(&state, &user.conversation, user.claims.exp);
    // The latest and the running turn are read before the snapshot, so a turn that commits or
    // is answered in between is shown as a run (perhaps also in the snapshot), never in
    // neither.
    let latest = state.store.latest_turn(user.conversation.id).await?;
    let running = state.store.running_turn(user.conversation.id).await?;
    let snapshot =
        crate::chat_history::ag_ui_messages(&chat_view_frames(&state, &user.conversation).await?);
    let (sender, receiver) = mpsc::channel(QUEUE);
    let mut sink = RunStream::new(sender, input.thread_id, input.run_id);
    tokio::spawn(async move {
        let first = running;
        let after_snapshot = latest.unwrap_or(TurnKey {
            seq: 0,
            revision: 0,
        });
        let _ = sink
            .follow_thread(&mut follower, snapshot, first, after_snapshot)
            .await;
    });
    Ok(sse_body(&state, receiver))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StopRequest {
    thread_id: String,
}

/// `POST /api/v1/ag-ui/stop` `{threadId}`: stops the thread's running turns →
/// `{stopped, seq}`.
pub(crate) async fn stop(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, ApiError> {
    let request: StopRequest = parse_json(body, false)?;
    let user = end_user(&state, &headers, &request.thread_id).await?;
    crate::routes::stops::stop_turns(&state, user.conversation.id, None).await
}

/// The frames a run commits, each validated (nothing is stored when one is bad) with its
/// idempotency key: the user messages whose ids the conversation has not seen, then the
/// `resume[]` answers.
async fn new_sends(
    state: &AppState,
    user: &EndUser,
    input: &RunAgentInput,
) -> Result<Vec<(MessageFrame, String)>, ApiError> {
    let users: Vec<_> = input
        .messages
        .iter()
        .filter(|message| message.role == "user")
        .collect();
    let ids: Vec<String> = users.iter().map(|message| message.id.clone()).collect();
    let known = state
        .store
        .known_message_ids(user.conversation.id, &user.conversation.user_id, &ids)
        .await?;
    let new: Vec<_> = users
        .into_iter()
        .filter(|message| !known.contains(&message.id))
        .collect();
    // Only a new message's id becomes a key: a history may hold ids of frames stored under
    // another shape (a mekik client's own ids).
    if let Some(bad) = new.iter().find(|message| !is_valid_client_id(&message.id)) {
        return Err(ApiError::bad_request(format!(
            "message id {:?} must be 1-128 characters of A-Za-z0-9._:~-",
            bad.id
        )));
    }
    let limits = &state.config.limits;
    // A frame is held to the size a socket's frame may have, its meta included.
    let checked = |frame: &Value| -> Result<MessageFrame, ApiError> {
        if frame.to_string().len() > limits.max_frame_bytes {
            return Err(ApiError::new(
                axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                converger_protocol::ErrorCode::PayloadTooLarge,
                "a committed message (with state, tools, context and forwardedProps) is larger than maxFrameBytes",
            ));
        }
        validate_message_frame(frame, limits).map_err(frame_error)
    };
    let mut sends = Vec::new();
    let resume = input.resume.as_ref().filter(|resume| !resume.is_empty());
    for (position, message) in new.iter().enumerate() {
        let mut frame = json!({"type": "text", "data": {"text": message.text()}});
        if position + 1 == new.len() && resume.is_none() {
            frame["meta"] = json!({"agUi": forwarded(input)});
        }
        sends.push((checked(&frame)?, message.id.clone()));
    }
    if let Some(resume) = resume {
        let key = format!("resume:{}", input.run_id);
        if input.run_id.is_empty() || !is_valid_client_id(&key) {
            return Err(ApiError::bad_request(
                "to resume, runId must be 1-121 characters of A-Za-z0-9._:~-",
            ));
        }
        let frame = json!({"type": RESUME_TYPE, "data": {"resume": resume}, "meta": {"agUi": forwarded(input)}});
        sends.push((checked(&frame)?, key));
    }
    Ok(sends)
}

/// What the run hands its agent besides the messages, in the turn's meta (`meta.client.agUi`
/// of the delivered turn, docs/protocol.md §4.4): `state`, `tools`, `context`,
/// `forwardedProps`, as the client sent them.
fn forwarded(input: &RunAgentInput) -> Value {
    let mut forwarded = Map::new();
    let fields = [
        ("state", &input.state),
        ("tools", &input.tools),
        ("context", &input.context),
        ("forwardedProps", &input.forwarded_props),
    ];
    for (name, value) in fields {
        if let Some(value) = value {
            forwarded.insert(name.into(), value.clone());
        }
    }
    Value::Object(forwarded)
}

/// One response's AG-UI events.
struct RunStream {
    events: EventSender,
    thread_id: String,
    run_id: String,
    /// The assistant text message open, if any.
    open_text: Option<String>,
    /// The current answer's message id (tool calls' parent).
    answer_id: String,
    calls: ToolCalls,
    interrupts: Vec<Interrupt>,
}

impl RunStream {
    fn new(
        sender: mpsc::Sender<axum::response::sse::Event>,
        thread_id: String,
        run_id: String,
    ) -> RunStream {
        RunStream {
            events: EventSender::new(sender),
            thread_id,
            run_id,
            open_text: None,
            answer_id: String::new(),
            calls: ToolCalls::default(),
            interrupts: Vec::new(),
        }
    }

    async fn send(&mut self, event: Event) -> Result<(), Gone> {
        self.events.send_json(&event).await
    }

    fn started(&self) -> Event {
        Event::RunStarted {
            thread_id: self.thread_id.clone(),
            run_id: self.run_id.clone(),
        }
    }

    /// One run: `RUN_STARTED`, the answer of `turn` (nothing when there is none), its end;
    /// false when the session ended meanwhile (expiry, drain, force-disconnect).
    async fn run(&mut self, follower: &mut Follower, turn: Option<TurnKey>) -> Result<bool, Gone> {
        self.send(self.started()).await?;
        self.answer(follower, turn).await
    }

    /// The answer of `turn` within the open run, then `RUN_FINISHED` or `RUN_ERROR`; false when
    /// the session ended meanwhile.
    async fn answer(
        &mut self,
        follower: &mut Follower,
        turn: Option<TurnKey>,
    ) -> Result<bool, Gone> {
        let end = match turn {
            Some(turn) => {
                self.answer_id = answer_id(turn);
                self.calls = ToolCalls::default();
                self.interrupts.clear();
                follower.follow_turn(turn, self).await?
            }
            None => RunEnd::Answered,
        };
        self.close_text().await?;
        let outcome = match end {
            RunEnd::Failed(error) => return self.run_error(error, true).await,
            RunEnd::Ended(error) => return self.run_error(error, false).await,
            RunEnd::Stopped => Some(RunOutcome::Cancelled),
            RunEnd::Answered if !self.interrupts.is_empty() => Some(RunOutcome::Interrupt {
                interrupts: std::mem::take(&mut self.interrupts),
            }),
            RunEnd::Answered => None,
        };
        match follower
            .state()
            .store
            .runtime(follower.conversation_id())
            .await
        {
            Ok((_, state)) => self.send(Event::StateSnapshot { snapshot: state }).await?,
            Err(error) => tracing::warn!(%error, "ag-ui: runtime unreadable; no state snapshot"),
        }
        self.send(Event::RunFinished {
            thread_id: self.thread_id.clone(),
            run_id: self.run_id.clone(),
            outcome,
            result: None,
        })
        .await?;
        Ok(true)
    }

    /// `RUN_ERROR`; `goes_on` is what [`Self::answer`] answers (false when the session ended).
    async fn run_error(
        &mut self,
        error: converger_protocol::ErrorFrame,
        goes_on: bool,
    ) -> Result<bool, Gone> {
        self.send(Event::RunError {
            message: error.message,
            code: Some(error.code.as_str().to_owned()),
        })
        .await?;
        Ok(goes_on)
    }

    /// A send the conversation refused: `RUN_STARTED`, `RUN_ERROR`.
    async fn refused(&mut self, refusal: &ApiError) -> Result<(), Gone> {
        self.send(self.started()).await?;
        self.send(Event::RunError {
            message: refusal.message.clone(),
            code: Some(refusal.code.to_owned()),
        })
        .await
    }

    /// `connect`: the snapshot (and the running turn) in a first run, then each later turn as
    /// a run of its own (`turn-<seq>-<revision>`); `after_snapshot` is the latest turn the
    /// snapshot holds.
    async fn follow_thread(
        &mut self,
        follower: &mut Follower,
        snapshot: Vec<Message>,
        first: Option<TurnKey>,
        after_snapshot: TurnKey,
    ) -> Result<(), Gone> {
        self.send(self.started()).await?;
        self.send(Event::MessagesSnapshot { messages: snapshot })
            .await?;
        if !self.answer(follower, first).await? {
            return Ok(());
        }
        let mut shown = first.unwrap_or(after_snapshot);
        while let Some(turn) = self.next_turn(follower, shown).await? {
            self.run_id = format!("turn-{}-{}", turn.seq, turn.revision);
            if !self.run(follower, Some(turn)).await? {
                return Ok(());
            }
            shown = turn;
        }
        Ok(())
    }

    /// The next turn after `shown` to show as a run, from the registry (a turn that began and
    /// was answered while another run was followed is shown too); waits for a user's frame, a
    /// regenerate or another node's commit when there is none yet. `None` when the session
    /// ends.
    async fn next_turn(
        &self,
        follower: &mut Follower,
        shown: TurnKey,
    ) -> Result<Option<TurnKey>, Gone> {
        loop {
            let conversation_id = follower.conversation_id();
            match follower
                .state()
                .store
                .next_turn_after(conversation_id, shown)
                .await
            {
                Ok(Some(next)) => return Ok(Some(next)),
                Ok(None) => {}
                Err(error) => tracing::warn!(%error, "ag-ui: turns unreadable"),
            }
            loop {
                // A lost notification costs at most a recheck's wait, never the turn.
                let Ok(event) = tokio::time::timeout(RECHECK, follower.next_event(self)).await
                else {
                    break;
                };
                let Some(event) = event? else {
                    return Ok(None);
                };
                let wakes = match event {
                    HubEvent::Committed { activity, .. } => activity
                        .as_deref()
                        .is_none_or(|frame| frame.sender_role == converger_protocol::USER_ROLE),
                    HubEvent::Regenerated { .. } => true,
                    _ => false,
                };
                if wakes {
                    break;
                }
            }
        }
    }

    async fn close_text(&mut self) -> Result<(), Gone> {
        let Some(message_id) = self.open_text.take() else {
            return Ok(());
        };
        self.send(Event::TextMessageEnd { message_id }).await
    }
}

impl AnswerSink for RunStream {
    async fn text(&mut self, part_id: &str, delta: &str) -> Result<(), Gone> {
        // AG-UI refuses empty content; a part opens with its first text.
        if delta.is_empty() {
            return Ok(());
        }
        if self.open_text.as_deref() != Some(part_id) {
            self.close_text().await?;
            self.open_text = Some(part_id.to_owned());
            self.send(Event::TextMessageStart {
                message_id: part_id.to_owned(),
                role: "assistant".into(),
            })
            .await?;
        }
        self.send(Event::TextMessageContent {
            message_id: part_id.to_owned(),
            delta: delta.to_owned(),
        })
        .await
    }

    async fn text_end(&mut self, part_id: &str) -> Result<(), Gone> {
        if self.open_text.as_deref() == Some(part_id) {
            self.close_text().await?;
        }
        Ok(())
    }

    async fn ui_chunk(&mut self, _part_id: &str, chunk: &Value) -> Result<(), Gone> {
        self.close_text().await?;
        self.send(Event::Custom {
            name: "genui".into(),
            value: chunk.clone(),
        })
        .await
    }

    async fn frame(&mut self, frame: &converger_store::Activity) -> Result<(), Gone> {
        self.close_text().await?;
        match answer_part(&frame.kind, &frame.id, &frame.data) {
            AnswerPart::Text(_) => Ok(()),
            AnswerPart::ToolCall {
                call_id,
                name,
                input,
            } => {
                self.calls.called(call_id, name);
                self.send(Event::ToolCallStart {
                    tool_call_id: call_id.into(),
                    tool_call_name: name.into(),
                    parent_message_id: Some(self.answer_id.clone()),
                })
                .await?;
                self.send(Event::ToolCallArgs {
                    tool_call_id: call_id.into(),
                    delta: json_text(input),
                })
                .await?;
                self.send(Event::ToolCallEnd {
                    tool_call_id: call_id.into(),
                })
                .await
            }
            AnswerPart::ToolResult {
                call_id,
                name,
                output,
            } => match self.calls.answered(call_id, name) {
                Some(call_id) => {
                    self.send(Event::ToolCallResult {
                        message_id: frame.id.clone(),
                        tool_call_id: call_id,
                        content: Value::String(json_text(output)),
                        role: "tool".into(),
                    })
                    .await
                }
                None => {
                    self.send(Event::Custom {
                        name: frame.kind.clone(),
                        value: frame.data.clone(),
                    })
                    .await
                }
            },
            AnswerPart::Interrupt {
                id,
                reason,
                message,
            } => {
                self.interrupts.push(Interrupt {
                    id: id.into(),
                    reason: reason.into(),
                    message: message.map(str::to_owned),
                });
                Ok(())
            }
            AnswerPart::Data { kind, data } => {
                self.send(Event::Custom {
                    name: kind.into(),
                    value: data.clone(),
                })
                .await
            }
        }
    }

    async fn closed(&self) {
        self.events.closed().await;
    }
}
