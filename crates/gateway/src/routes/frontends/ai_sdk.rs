//! The AI SDK's UI message stream (docs/frontends.md §1): `useChat` with
//! `DefaultChatTransport({api: "{base}/api/v1/ai-sdk/chat"})` sends, resumes, stops and loads
//! its history here.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use converger_protocol::ai_sdk::{ChatRequest, DataChunk, ToolPart, UiChunk, UiMessage, UiPart};
use converger_protocol::{
    AnswerPart, ToolCalls, answer_part, is_valid_client_id, validate_message_frame,
};
use converger_store::{Activity, Conversation};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::follow::{AnswerSink, Follower, Gone, RunEnd, TurnKey, answer_id};
use super::{EndUser, EventSender, QUEUE, chat_view_frames, end_user, send_turn, sse_body};
use crate::error::ApiError;
use crate::routes::body::parse_json;
use crate::routes::conversations::frame_error;
use crate::state::AppState;

/// The header that tells the AI SDK which stream protocol this is.
const STREAM_HEADER: HeaderName = HeaderName::from_static("x-vercel-ai-ui-message-stream");
/// The header that keeps proxies (nginx) from buffering the stream.
const NO_BUFFERING: HeaderName = HeaderName::from_static("x-accel-buffering");

/// `POST /api/v1/ai-sdk/chat`: commits the request's last user message (its id the idempotency
/// key, so a retry stores nothing twice) or, for `regenerate-message`, opens a new revision of
/// the latest turn; then streams the answer. Bad input is a 4xx JSON error and stores nothing;
/// a send the conversation refuses (a turn policy, a closed conversation) is an `error` chunk.
pub(crate) async fn chat(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let request: ChatRequest = parse_json(body, false)?;
    let user = end_user(&state, &headers, &request.id).await?;
    let last = request
        .messages
        .iter()
        .rev()
        .find(|message| message.role == "user")
        .ok_or_else(|| ApiError::bad_request("messages holds no user message"))?;
    if !is_valid_client_id(&last.id) {
        return Err(ApiError::bad_request(
            "a message id must be 1-128 characters of A-Za-z0-9._:~-",
        ));
    }
    let regenerate = match request.trigger.as_deref() {
        None | Some("submit-message") => false,
        Some("regenerate-message") => true,
        Some(_) => {
            return Err(ApiError::bad_request(
                "trigger must be submit-message or regenerate-message",
            ));
        }
    };
    // A regenerate's key (regenerate:<seq>:<messageId>) must be a valid key for any seq.
    if regenerate
        && let Some(message_id) = &request.message_id
        && !is_valid_client_id(&format!("regenerate:{}:{message_id}", i64::MAX))
    {
        return Err(ApiError::bad_request(
            "messageId must be an answer's id (A-Za-z0-9._:~-, at most 97 characters)",
        ));
    }
    let send = if regenerate {
        None
    } else {
        let frame = json!({"type": "text", "data": {"text": last.text()}});
        Some(validate_message_frame(&frame, &state.config.limits).map_err(frame_error)?)
    };
    let mut follower = Follower::open(&state, &user.conversation, user.claims.exp);
    let turn = match send {
        Some(message) => send_turn(&state, &user.conversation, message, &last.id).await,
        None => regenerate_turn(&state, &user, &last.id, request.message_id.as_deref()).await,
    };
    let (sender, receiver) = mpsc::channel(QUEUE);
    tokio::spawn(async move {
        let mut sink = UiStream::new(sender);
        let _ = match turn {
            Ok(turn) => sink.run(&mut follower, turn).await,
            Err(refusal) => sink.refused(&refusal).await,
        };
    });
    Ok(stream_response(&state, receiver))
}

/// `GET /api/v1/ai-sdk/chat/{id}/stream` (`useChat({resume: true})`): 204 when no answer is in
/// progress; else that answer from its `start`, then live to its end.
pub(crate) async fn resume(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let user = end_user(&state, &headers, &id).await?;
    // An idle check is no session (no presence): the follower reads the turn's result again
    // after it subscribed, so an answer committed meanwhile is still shown.
    let Some(running) = state.store.running_turn(user.conversation.id).await? else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    let mut follower = Follower::open(&state, &user.conversation, user.claims.exp);
    let turn = running;
    let (sender, receiver) = mpsc::channel(QUEUE);
    tokio::spawn(async move {
        let _ = UiStream::new(sender).run(&mut follower, turn).await;
    });
    Ok(stream_response(&state, receiver))
}

/// `POST /api/v1/ai-sdk/chat/{id}/stop`: stops the running turns (docs/protocol.md §3.9) →
/// `{stopped, seq}`.
pub(crate) async fn stop(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let user = end_user(&state, &headers, &id).await?;
    crate::routes::stops::stop_turns(&state, user.conversation.id, None).await
}

/// `GET /api/v1/ai-sdk/chat/{id}/messages`: the chat view as `UIMessage[]`.
pub(crate) async fn messages(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Json<Vec<UiMessage>>, ApiError> {
    let user = end_user(&state, &headers, &id).await?;
    let frames = chat_view_frames(&state, &user.conversation).await?;
    Ok(Json(ui_messages(&frames)))
}

/// A new revision of the user's turn `message_id` (else the latest), published to the agents.
/// Its idempotency key is the answer it replaces: `replaced_answer` when the client names it (the AI
/// SDK sends it for `regenerate({messageId})`), else the turn's latest revision's, so a retry
/// of the same regenerate opens nothing new while a later regenerate does.
async fn regenerate_turn(
    state: &AppState,
    user: &EndUser,
    message_id: &str,
    replaced_answer: Option<&str>,
) -> Result<TurnKey, ApiError> {
    let conversation: &Conversation = &user.conversation;
    let turn = state
        .store
        .resolve_turn(
            conversation.id,
            &conversation.user_id,
            None,
            Some(message_id),
        )
        .await?
        .ok_or_else(|| ApiError::bad_request("no turn of yours to regenerate"))?;
    let replaced = match replaced_answer {
        Some(replaced) => replaced.to_owned(),
        None => {
            let latest = state
                .store
                .latest_revision(conversation.id, turn.seq)
                .await?
                .unwrap_or(0);
            answer_id(TurnKey {
                seq: turn.seq,
                revision: latest,
            })
        }
    };
    // Per turn: a foreign or stale answer id names no other turn's revision. `chat` checked
    // that a given id makes a valid key for any seq; a derived one always does.
    let key = format!("regenerate:{}:{replaced}", turn.seq);
    let revision = state.store.open_revision(&turn, None, Some(&key)).await?;
    if revision.duplicate {
        // A retry: the answer that counts now (a later regenerate may have replaced it).
        let latest = state
            .store
            .latest_revision(conversation.id, revision.turn_seq)
            .await?
            .unwrap_or(revision.revision);
        return Ok(TurnKey {
            seq: revision.turn_seq,
            revision: latest,
        });
    }
    crate::publish::regenerated(
        state,
        conversation.channel_id,
        Arc::new(turn),
        revision.revision,
        revision.opened_at,
    )
    .await;
    Ok(TurnKey {
        seq: revision.turn_seq,
        revision: revision.revision,
    })
}

/// The response headers of a UI message stream (`sse_body` sets its type and `no-cache`).
fn stream_response(
    state: &AppState,
    receiver: mpsc::Receiver<axum::response::sse::Event>,
) -> Response {
    let mut response = sse_body(state, receiver);
    let headers = response.headers_mut();
    headers.insert(STREAM_HEADER, HeaderValue::from_static("v1"));
    headers.insert(NO_BUFFERING, HeaderValue::from_static("no"));
    response
}

/// One answer as UI message chunks.
struct UiStream {
    events: EventSender,
    /// Text parts started and not ended.
    open_texts: Vec<String>,
    calls: ToolCalls,
}

impl UiStream {
    fn new(sender: mpsc::Sender<axum::response::sse::Event>) -> UiStream {
        UiStream {
            events: EventSender::new(sender),
            open_texts: Vec::new(),
            calls: ToolCalls::default(),
        }
    }

    async fn send(&mut self, chunk: UiChunk) -> Result<(), Gone> {
        self.events.send_json(&chunk).await
    }

    /// `start`, the answer, and its end: `finish`, `abort` when stopped, `error` when none came.
    async fn run(&mut self, follower: &mut Follower, turn: TurnKey) -> Result<(), Gone> {
        self.send(UiChunk::Start {
            message_id: answer_id(turn),
        })
        .await?;
        self.send(UiChunk::StartStep).await?;
        let end = follower.follow_turn(turn, self).await?;
        for part_id in std::mem::take(&mut self.open_texts) {
            self.send(UiChunk::TextEnd { id: part_id }).await?;
        }
        self.send(UiChunk::FinishStep).await?;
        match end {
            RunEnd::Answered => self.send(UiChunk::Finish).await?,
            RunEnd::Stopped => self.send(UiChunk::Abort).await?,
            RunEnd::Failed(error) | RunEnd::Ended(error) => {
                self.send(UiChunk::Error {
                    error_text: format!("{}: {}", error.code.as_str(), error.message),
                })
                .await?
            }
        }
        self.events.send_data("[DONE]".into()).await
    }

    /// A send the conversation refused: one `error` chunk.
    async fn refused(&mut self, refusal: &ApiError) -> Result<(), Gone> {
        self.send(UiChunk::Error {
            error_text: format!("{}: {}", refusal.code, refusal.message),
        })
        .await?;
        self.events.send_data("[DONE]".into()).await
    }
}

impl AnswerSink for UiStream {
    async fn text(&mut self, part_id: &str, delta: &str) -> Result<(), Gone> {
        if !self.open_texts.iter().any(|open| open == part_id) {
            self.open_texts.push(part_id.to_owned());
            self.send(UiChunk::TextStart {
                id: part_id.to_owned(),
            })
            .await?;
        }
        if delta.is_empty() {
            return Ok(());
        }
        self.send(UiChunk::TextDelta {
            id: part_id.to_owned(),
            delta: delta.to_owned(),
        })
        .await
    }

    async fn text_end(&mut self, part_id: &str) -> Result<(), Gone> {
        let Some(position) = self.open_texts.iter().position(|open| open == part_id) else {
            return Ok(());
        };
        self.open_texts.remove(position);
        self.send(UiChunk::TextEnd {
            id: part_id.to_owned(),
        })
        .await
    }

    async fn ui_chunk(&mut self, part_id: &str, chunk: &Value) -> Result<(), Gone> {
        self.send(UiChunk::Data(DataChunk::new(
            "genui",
            part_id,
            chunk.clone(),
        )))
        .await
    }

    async fn frame(&mut self, frame: &Activity) -> Result<(), Gone> {
        let chunk = match answer_part(&frame.kind, &frame.id, &frame.data) {
            AnswerPart::Text(_) => return Ok(()),
            AnswerPart::ToolCall {
                call_id,
                name,
                input,
            } => {
                self.calls.called(call_id, name);
                UiChunk::ToolInputAvailable {
                    tool_call_id: call_id.to_owned(),
                    tool_name: name.to_owned(),
                    input: input.clone(),
                }
            }
            AnswerPart::ToolResult {
                call_id,
                name,
                output,
            } => match self.calls.answered(call_id, name) {
                Some(call_id) => UiChunk::ToolOutputAvailable {
                    tool_call_id: call_id,
                    output: output.clone(),
                },
                None => UiChunk::Data(DataChunk::new("tool_result", &frame.id, frame.data.clone())),
            },
            AnswerPart::Interrupt { .. } | AnswerPart::Data { .. } => {
                UiChunk::Data(DataChunk::new(&frame.kind, &frame.id, frame.data.clone()))
            }
        };
        self.send(chunk).await
    }

    async fn closed(&self) {
        self.events.closed().await;
    }
}

/// The chat view's frames as `UIMessage`s: each user frame one message (under the id its
/// client gave), each turn's answer one assistant message (`answer-<seq>-<revision>`, the
/// `start` chunk's id), each proactive agent frame its own message. Lifecycle frames
/// (`conversationUpdate`) are not chat messages.
fn ui_messages(frames: &[Activity]) -> Vec<UiMessage> {
    let mut messages: Vec<UiMessage> = Vec::new();
    let mut calls = ToolCalls::default();
    for frame in frames {
        if frame.kind == converger_protocol::CONVERSATION_UPDATE {
            continue;
        }
        if frame.sender_role == converger_protocol::USER_ROLE {
            let part = match answer_part(&frame.kind, &frame.id, &frame.data) {
                AnswerPart::Text(text) => UiPart::Text { text: text.into() },
                _ => UiPart::Data(DataChunk::new(&frame.kind, &frame.id, frame.data.clone())),
            };
            messages.push(UiMessage {
                id: crate::chat_history::client_message_id(frame).to_owned(),
                role: "user",
                parts: vec![part],
            });
            continue;
        }
        let id = match (frame.turn_seq, frame.turn_revision) {
            (Some(seq), Some(revision)) => answer_id(TurnKey { seq, revision }),
            _ => frame.id.clone(),
        };
        if messages.last().is_none_or(|last| last.id != id) {
            calls = ToolCalls::default();
            messages.push(UiMessage {
                id,
                role: "assistant",
                parts: Vec::new(),
            });
        }
        let Some(message) = messages.last_mut() else {
            continue;
        };
        add_part(&mut message.parts, &mut calls, frame);
    }
    messages
}

/// One answer frame as a part of its assistant message: a tool result fills its call's part.
fn add_part(parts: &mut Vec<UiPart>, calls: &mut ToolCalls, frame: &Activity) {
    match answer_part(&frame.kind, &frame.id, &frame.data) {
        AnswerPart::Text(text) => parts.push(UiPart::Text { text: text.into() }),
        AnswerPart::ToolCall {
            call_id,
            name,
            input,
        } => {
            calls.called(call_id, name);
            parts.push(UiPart::Tool(ToolPart::called(name, call_id, input.clone())));
        }
        AnswerPart::ToolResult {
            call_id,
            name,
            output,
        } => {
            let answered = calls.answered(call_id, name);
            let call = parts.iter_mut().find_map(|part| match part {
                UiPart::Tool(tool) if Some(&tool.tool_call_id) == answered.as_ref() => Some(tool),
                _ => None,
            });
            match call {
                Some(tool) => {
                    tool.state = "output-available";
                    tool.output = Some(output.clone());
                }
                None => parts.push(UiPart::Data(DataChunk::new(
                    "tool_result",
                    &frame.id,
                    frame.data.clone(),
                ))),
            }
        }
        AnswerPart::Interrupt { .. } | AnswerPart::Data { .. } => parts.push(UiPart::Data(
            DataChunk::new(&frame.kind, &frame.id, frame.data.clone()),
        )),
    }
}
