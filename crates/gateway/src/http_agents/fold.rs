//! One call's AG-UI events folded into what converger keeps (pure: no I/O): text deltas to
//! stream as they come, and at `RUN_FINISHED` the answer's frames and the state to commit as the
//! conversation's runtime. An agent's JSON answer (`{messages, state}`) folds into the same.

use std::collections::HashMap;

use converger_protocol::ag_ui::{Event, Message, RunOutcome, json_text};
use converger_store::AnswerFrame;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::request::CallError;

/// What one event asks of the caller.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Step {
    /// Nothing to show yet.
    Nothing,
    /// Text to stream to every tab: the `index`-th text message of the run.
    Text {
        /// The message's position among the run's text messages (its stream).
        message: usize,
        /// The delta.
        delta: String,
    },
    /// `RUN_FINISHED`: commit [`RunFold::answer`].
    Finished,
    /// `RUN_ERROR`: the call failed.
    Failed(String),
}

/// One part of the answer, in the order the agent produced it.
#[derive(Debug, Clone, PartialEq)]
enum Part {
    Text {
        message_id: String,
        text: String,
        /// Its position among the run's text messages.
        index: usize,
    },
    ToolCall {
        call_id: String,
        name: String,
        arguments: String,
    },
    ToolResult {
        call_id: String,
        content: String,
    },
    Custom {
        name: String,
        value: Value,
    },
    Interrupt {
        id: String,
        reason: String,
        message: Option<String>,
    },
}

/// A run's events so far.
#[derive(Debug, Clone)]
pub(super) struct RunFold {
    parts: Vec<Part>,
    texts: HashMap<String, usize>,
    calls: HashMap<String, usize>,
    /// The last message or call a chunk event named (chunks may leave the id out after it).
    last_text: Option<String>,
    last_call: Option<String>,
    /// Messages of a role other than `assistant`, whose text is not the agent's answer.
    not_assistant: std::collections::HashSet<String>,
    /// The state: the runtime given at the start, changed by snapshots and deltas.
    state: Value,
    state_changed: bool,
    /// The largest state a delta may build, in bytes (a delta can grow it exponentially).
    max_state_bytes: usize,
    finished: bool,
}

/// An agent's `application/json` answer.
#[derive(Debug, Deserialize)]
pub(super) struct JsonAnswer {
    /// The answer's messages (assistant texts and tool calls, tool results).
    #[serde(default)]
    pub messages: Vec<Message>,
    /// The new state, if it changed.
    #[serde(default)]
    pub state: Option<Value>,
}

impl RunFold {
    /// A run that starts from the conversation's runtime `state`, whose state may not grow
    /// past `max_state_bytes`.
    pub(super) fn new(state: Value, max_state_bytes: usize) -> RunFold {
        RunFold {
            parts: Vec::new(),
            texts: HashMap::new(),
            calls: HashMap::new(),
            last_text: None,
            last_call: None,
            not_assistant: std::collections::HashSet::new(),
            state,
            state_changed: false,
            max_state_bytes,
            finished: false,
        }
    }

    /// True once `RUN_FINISHED` was read.
    pub(super) fn is_finished(&self) -> bool {
        self.finished
    }

    /// Folds one event.
    pub(super) fn apply(&mut self, event: Event) -> Result<Step, CallError> {
        if self.finished {
            return Ok(Step::Nothing);
        }
        match event {
            Event::TextMessageStart { message_id, role } => {
                if role == "assistant" {
                    self.text(&message_id);
                } else {
                    self.not_assistant.insert(message_id);
                }
                Ok(Step::Nothing)
            }
            Event::TextMessageContent { message_id, .. }
                if self.not_assistant.contains(&message_id) =>
            {
                Ok(Step::Nothing)
            }
            Event::TextMessageContent { message_id, delta } => {
                let Some(&at) = self.texts.get(&message_id) else {
                    return Err(CallError::Invalid(format!(
                        "TEXT_MESSAGE_CONTENT of message {message_id:?}, which never started"
                    )));
                };
                Ok(self.append_text(at, delta))
            }
            Event::TextMessageChunk { message_id, delta } => {
                let id = message_id
                    .or_else(|| self.last_text.clone())
                    .ok_or_else(|| invalid("TEXT_MESSAGE_CHUNK without a messageId"))?;
                let at = self.text(&id);
                Ok(self.append_text(at, delta.unwrap_or_default()))
            }
            Event::TextMessageEnd { .. } | Event::ToolCallEnd { .. } => Ok(Step::Nothing),
            Event::ToolCallStart {
                tool_call_id,
                tool_call_name,
                ..
            } => {
                self.call(&tool_call_id, tool_call_name);
                Ok(Step::Nothing)
            }
            Event::ToolCallArgs {
                tool_call_id,
                delta,
            } => {
                let at = *self.calls.get(&tool_call_id).ok_or_else(|| {
                    CallError::Invalid(format!(
                        "TOOL_CALL_ARGS of call {tool_call_id:?}, which never started"
                    ))
                })?;
                self.append_arguments(at, &delta);
                Ok(Step::Nothing)
            }
            Event::ToolCallChunk {
                tool_call_id,
                tool_call_name,
                delta,
            } => {
                let id = tool_call_id
                    .or_else(|| self.last_call.clone())
                    .ok_or_else(|| invalid("TOOL_CALL_CHUNK without a toolCallId"))?;
                let at = match self.calls.get(&id) {
                    Some(&at) => at,
                    None => {
                        let name = tool_call_name.ok_or_else(|| {
                            invalid("TOOL_CALL_CHUNK opening a call without a name")
                        })?;
                        self.call(&id, name)
                    }
                };
                self.append_arguments(at, &delta.unwrap_or_default());
                Ok(Step::Nothing)
            }
            Event::ToolCallResult {
                tool_call_id,
                content,
                ..
            } => {
                self.parts.push(Part::ToolResult {
                    call_id: tool_call_id,
                    content: json_text(&content),
                });
                Ok(Step::Nothing)
            }
            Event::StateSnapshot { snapshot } => {
                self.state = snapshot;
                self.state_changed = true;
                Ok(Step::Nothing)
            }
            Event::StateDelta { delta } => {
                let patch: json_patch::Patch = serde_json::from_value(delta)
                    .map_err(|error| CallError::Invalid(format!("STATE_DELTA: {error}")))?;
                // One operation at a time, each held to the size limit: a few `copy`
                // operations can double the state each.
                for operation in patch.0 {
                    json_patch::patch(&mut self.state, &[operation])
                        .map_err(|error| CallError::Invalid(format!("STATE_DELTA: {error}")))?;
                    if self.state.to_string().len() > self.max_state_bytes {
                        return Err(CallError::Invalid(format!(
                            "STATE_DELTA: the state grew past {} bytes",
                            self.max_state_bytes
                        )));
                    }
                }
                self.state_changed = true;
                Ok(Step::Nothing)
            }
            Event::Custom { name, value } => {
                self.parts.push(Part::Custom { name, value });
                Ok(Step::Nothing)
            }
            Event::RunFinished { outcome, .. } => {
                match outcome {
                    Some(RunOutcome::Cancelled) => {
                        return Ok(Step::Failed(
                            "RUN_FINISHED: the agent cancelled the run".into(),
                        ));
                    }
                    // The answer waits for the user: its interrupts are `interrupt` frames, as a
                    // WebSocket agent sends them.
                    Some(RunOutcome::Interrupt { interrupts }) => {
                        for interrupt in interrupts {
                            self.parts.push(Part::Interrupt {
                                id: interrupt.id,
                                reason: interrupt.reason,
                                message: interrupt.message,
                            });
                        }
                    }
                    Some(RunOutcome::Success | RunOutcome::Other) | None => {}
                }
                self.finished = true;
                Ok(Step::Finished)
            }
            Event::RunError { message, code } => Ok(Step::Failed(match code {
                Some(code) => format!("RUN_ERROR {code}: {message}"),
                None => format!("RUN_ERROR: {message}"),
            })),
            // Steps, thinking, raw events and the agent's own snapshot of the messages say
            // nothing converger keeps: the answer is what the events above built.
            Event::RunStarted { .. } | Event::MessagesSnapshot { .. } | Event::Other => {
                Ok(Step::Nothing)
            }
        }
    }

    /// Folds a JSON answer: its assistant texts, tool calls and tool results, and its state.
    pub(super) fn apply_json(&mut self, answer: JsonAnswer) {
        for message in answer.messages {
            match message.role.as_str() {
                "assistant" => {
                    let text = message.text();
                    if !text.is_empty() {
                        let at = self.text(&message.id);
                        self.append_text(at, text);
                    }
                    for call in message.tool_calls {
                        let at = self.call(&call.id, call.function.name);
                        self.append_arguments(at, &call.function.arguments);
                    }
                }
                "tool" => self.parts.push(Part::ToolResult {
                    call_id: message.tool_call_id.unwrap_or_default(),
                    content: message.content.as_ref().map(json_text).unwrap_or_default(),
                }),
                _ => {}
            }
        }
        if let Some(state) = answer.state {
            self.state = state;
            self.state_changed = true;
        }
        self.finished = true;
    }

    /// The answer's frames: texts (under their stream's id, `stream_id(index)`, when they were
    /// streamed), tool calls, tool results and custom events (`event` frames); and the state,
    /// when the run changed it.
    pub(super) fn answer(
        &self,
        stream_id: impl Fn(usize) -> Option<String>,
    ) -> (Vec<AnswerFrame>, Option<Value>) {
        // A message that only parents tool calls (Pydantic AI opens one) has no text to keep.
        let frames = self
            .parts
            .iter()
            .filter(|part| !matches!(part, Part::Text { text, .. } if text.is_empty()))
            .map(|part| match part {
                Part::Text {
                    message_id,
                    text,
                    index,
                } => {
                    let mut extra = Map::new();
                    let stream = stream_id(*index);
                    if let Some(stream) = &stream {
                        extra.insert("streamId".into(), Value::String(stream.clone()));
                    }
                    AnswerFrame {
                        id: stream,
                        kind: "text".into(),
                        data: json!({"text": text}),
                        metadata: Some(json!({"agUi": {"messageId": message_id}})),
                        extra,
                    }
                }
                Part::ToolCall {
                    call_id,
                    name,
                    arguments,
                } => frame(
                    "tool_call",
                    json!({"toolCallId": call_id, "name": name, "arguments": parsed(arguments)}),
                ),
                Part::ToolResult { call_id, content } => frame(
                    "tool_result",
                    json!({"toolCallId": call_id, "result": parsed(content)}),
                ),
                Part::Custom { name, value } => {
                    frame("event", json!({"name": name, "value": value}))
                }
                Part::Interrupt {
                    id,
                    reason,
                    message,
                } => {
                    let mut data = json!({"reason": if reason.is_empty() { "input_required" } else { reason }});
                    if let Some(message) = message {
                        data["message"] = Value::String(message.clone());
                    }
                    AnswerFrame {
                        id: (!id.is_empty()).then(|| id.clone()),
                        ..frame("interrupt", data)
                    }
                }
            })
            .collect();
        (frames, self.state_changed.then(|| self.state.clone()))
    }

    /// The text message `id`'s part, opened when new.
    fn text(&mut self, id: &str) -> usize {
        self.last_text = Some(id.to_owned());
        if let Some(&at) = self.texts.get(id) {
            return at;
        }
        let index = self.texts.len();
        self.parts.push(Part::Text {
            message_id: id.to_owned(),
            text: String::new(),
            index,
        });
        let at = self.parts.len() - 1;
        self.texts.insert(id.to_owned(), at);
        at
    }

    fn append_text(&mut self, at: usize, delta: String) -> Step {
        let Some(Part::Text { text, index, .. }) = self.parts.get_mut(at) else {
            return Step::Nothing;
        };
        if delta.is_empty() {
            return Step::Nothing;
        }
        text.push_str(&delta);
        Step::Text {
            message: *index,
            delta,
        }
    }

    fn call(&mut self, id: &str, name: String) -> usize {
        self.last_call = Some(id.to_owned());
        if let Some(&at) = self.calls.get(id) {
            return at;
        }
        self.parts.push(Part::ToolCall {
            call_id: id.to_owned(),
            name,
            arguments: String::new(),
        });
        let at = self.parts.len() - 1;
        self.calls.insert(id.to_owned(), at);
        at
    }

    fn append_arguments(&mut self, at: usize, delta: &str) {
        if let Some(Part::ToolCall { arguments, .. }) = self.parts.get_mut(at) {
            arguments.push_str(delta);
        }
    }
}

fn invalid(message: &str) -> CallError {
    CallError::Invalid(message.to_owned())
}

fn frame(kind: &str, data: Value) -> AnswerFrame {
    AnswerFrame {
        id: None,
        kind: kind.into(),
        data,
        metadata: None,
        extra: Map::new(),
    }
}

/// AG-UI carries arguments and results as text; JSON text is kept as the JSON it is.
fn parsed(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(value: Value) -> Event {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn a_streamed_run_folds_into_texts_tools_and_state() {
        let mut fold = RunFold::new(json!({"turns": 1, "items": []}), 10_000);
        let events = [
            json!({"type": "RUN_STARTED", "threadId": "t", "runId": "r"}),
            json!({"type": "TEXT_MESSAGE_START", "messageId": "parent", "role": "assistant"}),
            json!({"type": "TEXT_MESSAGE_END", "messageId": "parent"}),
            json!({"type": "STEP_STARTED", "stepName": "think"}),
            json!({"type": "TOOL_CALL_START", "toolCallId": "c1", "toolCallName": "remember"}),
            json!({"type": "TOOL_CALL_ARGS", "toolCallId": "c1", "delta": "{\"text\":"}),
            json!({"type": "TOOL_CALL_ARGS", "toolCallId": "c1", "delta": "\"hi\"}"}),
            json!({"type": "TOOL_CALL_END", "toolCallId": "c1"}),
            json!({"type": "TOOL_CALL_RESULT", "messageId": "m0", "toolCallId": "c1", "content": "ok"}),
            json!({"type": "STATE_DELTA", "delta": [{"op": "replace", "path": "/turns", "value": 2}, {"op": "add", "path": "/items/-", "value": "x"}]}),
            json!({"type": "TEXT_MESSAGE_START", "messageId": "m1", "role": "assistant"}),
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": "echo: "}),
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": "hi"}),
            json!({"type": "TEXT_MESSAGE_END", "messageId": "m1"}),
        ];
        let mut streamed = String::new();
        for value in events {
            match fold.apply(event(value)).unwrap() {
                Step::Text { message, delta } => {
                    assert_eq!(message, 1);
                    streamed.push_str(&delta);
                }
                step => assert_eq!(step, Step::Nothing),
            }
        }
        assert_eq!(streamed, "echo: hi");
        assert!(!fold.is_finished());
        let finished = json!({"type": "RUN_FINISHED", "threadId": "t", "runId": "r", "result": 1});
        assert_eq!(fold.apply(event(finished)).unwrap(), Step::Finished);
        let (frames, state) = fold.answer(|index| Some(format!("s-{index}")));
        // The empty message that only parented the call is left out.
        let kinds: Vec<&str> = frames.iter().map(|frame| frame.kind.as_str()).collect();
        assert_eq!(kinds, ["tool_call", "tool_result", "text"]);
        assert_eq!(frames[0].data["arguments"], json!({"text": "hi"}));
        assert_eq!(frames[1].data["result"], json!("ok"));
        assert_eq!(frames[2].data["text"], "echo: hi");
        assert_eq!(frames[2].id.as_deref(), Some("s-1"));
        assert_eq!(frames[2].extra["streamId"], "s-1");
        assert_eq!(state, Some(json!({"turns": 2, "items": ["x"]})));
    }

    #[test]
    fn chunk_events_open_their_message_and_call() {
        let mut fold = RunFold::new(json!({}), 10_000);
        let chunk = json!({"type": "TEXT_MESSAGE_CHUNK", "messageId": "m", "delta": "a"});
        assert_eq!(
            fold.apply(event(chunk)).unwrap(),
            Step::Text {
                message: 0,
                delta: "a".into()
            }
        );
        let more = json!({"type": "TEXT_MESSAGE_CHUNK", "delta": "b"});
        fold.apply(event(more)).unwrap();
        let call = json!({"type": "TOOL_CALL_CHUNK", "toolCallId": "c", "toolCallName": "f", "delta": "{}"});
        fold.apply(event(call)).unwrap();
        let (frames, state) = fold.answer(|_| None);
        assert_eq!(frames[0].data["text"], "ab");
        assert_eq!(frames[0].id, None);
        assert_eq!(
            frames[1].data,
            json!({"toolCallId": "c", "name": "f", "arguments": {}})
        );
        assert_eq!(
            state, None,
            "no snapshot or delta: the runtime is not written"
        );
    }

    #[test]
    fn contradictions_and_errors_fail_the_call() {
        let mut fold = RunFold::new(json!({}), 10_000);
        let orphan = json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "x", "delta": "a"});
        assert!(fold.apply(event(orphan)).is_err());
        let bad_patch = json!({"type": "STATE_DELTA", "delta": [{"op": "replace", "path": "/missing", "value": 1}]});
        assert!(fold.apply(event(bad_patch)).is_err());
        let error = json!({"type": "RUN_ERROR", "message": "boom", "code": "x"});
        assert_eq!(
            fold.apply(event(error)).unwrap(),
            Step::Failed("RUN_ERROR x: boom".into())
        );
    }

    #[test]
    fn a_delta_that_grows_the_state_past_its_limit_fails_the_call() {
        let mut fold = RunFold::new(json!({"a": "x".repeat(100)}), 1_000);
        let copies: Vec<Value> = (0..40)
            .map(|n| json!({"op": "copy", "from": "", "path": format!("/c{n}")}))
            .collect();
        let delta = json!({"type": "STATE_DELTA", "delta": copies});
        assert!(fold.apply(event(delta)).is_err());
    }

    #[test]
    fn interrupts_become_interrupt_frames_and_other_roles_are_not_the_answer() {
        let mut fold = RunFold::new(json!({}), 10_000);
        for value in [
            json!({"type": "TEXT_MESSAGE_START", "messageId": "u", "role": "user"}),
            json!({"type": "TEXT_MESSAGE_CONTENT", "messageId": "u", "delta": "not mine"}),
            json!({"type": "TOOL_CALL_RESULT", "messageId": "r", "toolCallId": "c", "content": [{"type": "text", "text": "parts"}]}),
        ] {
            assert_eq!(fold.apply(event(value)).unwrap(), Step::Nothing);
        }
        let finished = json!({"type": "RUN_FINISHED", "threadId": "t", "runId": "r",
            "outcome": {"type": "interrupt", "interrupts": [{"id": "i-1", "reason": "approval", "message": "Book it?"}]}});
        assert_eq!(fold.apply(event(finished)).unwrap(), Step::Finished);
        let (frames, _) = fold.answer(|_| None);
        let kinds: Vec<&str> = frames.iter().map(|frame| frame.kind.as_str()).collect();
        assert_eq!(kinds, ["tool_result", "interrupt"]);
        assert_eq!(frames[1].id.as_deref(), Some("i-1"));
        assert_eq!(
            frames[1].data,
            json!({"reason": "approval", "message": "Book it?"})
        );
        let cancelled = json!({"type": "RUN_FINISHED", "threadId": "t", "runId": "r", "outcome": {"type": "cancelled"}});
        assert!(matches!(
            RunFold::new(json!({}), 10).apply(event(cancelled)).unwrap(),
            Step::Failed(_)
        ));
    }

    #[test]
    fn unknown_events_are_ignored() {
        let mut fold = RunFold::new(json!({}), 10_000);
        for value in [
            json!({"type": "THINKING_START"}),
            json!({"type": "RAW", "event": {}}),
            json!({"type": "MESSAGES_SNAPSHOT", "messages": []}),
        ] {
            assert_eq!(fold.apply(event(value)).unwrap(), Step::Nothing);
        }
    }

    #[test]
    fn a_json_answer_folds_like_the_events() {
        let mut fold = RunFold::new(json!({"a": 1}), 10_000);
        let answer: JsonAnswer = serde_json::from_value(json!({
            "messages": [
                {"id": "j", "role": "assistant", "content": "json: hi",
                 "toolCalls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"q\":1}"}}]},
                {"id": "t", "role": "tool", "toolCallId": "c", "content": "42"}
            ],
            "state": {"json": true}
        }))
        .unwrap();
        fold.apply_json(answer);
        assert!(fold.is_finished());
        let (frames, state) = fold.answer(|_| None);
        let kinds: Vec<&str> = frames.iter().map(|frame| frame.kind.as_str()).collect();
        assert_eq!(kinds, ["text", "tool_call", "tool_result"]);
        assert_eq!(frames[2].data["result"], json!(42));
        assert_eq!(state, Some(json!({"json": true})));
    }
}
