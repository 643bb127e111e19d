//! AG-UI over Server-Sent Events (docs/frontends.md, ADR 0030): the `RunAgentInput` a client
//! posts and the events converger answers with, as `@ag-ui/client` 1.0 validates them; and the
//! same types the other way round, for HTTP agents (ADR 0031): the input a node posts to an
//! agent's URL and the events it reads back.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `POST /api/v1/ag-ui/run` and `…/connect`: what `HttpAgent` sends; and what a node posts
/// to an HTTP agent (which always carries `state`, `tools`, `context` and `forwardedProps`,
/// as AG-UI's own servers require them).
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunAgentInput {
    /// The thread: the conversation.
    pub thread_id: String,
    /// The client's run id.
    pub run_id: String,
    /// The client's whole history.
    #[serde(default)]
    pub messages: Vec<Message>,
    /// The client's state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<Value>,
    /// Tools the client offers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Value>,
    /// Context entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<Value>,
    /// Anything else the client forwards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forwarded_props: Option<Value>,
    /// Answers to the interrupts the last run ended with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Vec<ResumeEntry>>,
}

impl Message {
    /// The message's text: the string content, or its text parts joined.
    pub fn text(&self) -> String {
        match &self.content {
            Some(Value::String(text)) => text.clone(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter(|part| part.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .collect(),
            _ => String::new(),
        }
    }
}

/// An answer to one interrupt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResumeEntry {
    /// The interrupt answered (the agent's `interrupt` frame id).
    pub interrupt_id: String,
    /// `resolved` or `cancelled`.
    pub status: String,
    /// The answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<Value>,
}

/// One AG-UI event (the SSE `data:` of one event). Read back from HTTP agents, an event of a
/// type converger has no use for (steps, thinking, raw, activity) is [`Event::Other`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    tag = "type",
    rename_all = "SCREAMING_SNAKE_CASE",
    rename_all_fields = "camelCase"
)]
pub enum Event {
    /// A run begins.
    RunStarted {
        /// The thread.
        thread_id: String,
        /// The run.
        run_id: String,
    },
    /// A run ends without failing.
    RunFinished {
        /// The thread.
        thread_id: String,
        /// The run.
        run_id: String,
        /// Why, when not plain success.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        outcome: Option<RunOutcome>,
        /// An agent's result (read back, never sent).
        #[serde(default, skip_serializing)]
        result: Option<Value>,
    },
    /// A run failed.
    RunError {
        /// Why.
        message: String,
        /// A converger error code.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        code: Option<String>,
    },
    /// An assistant message begins.
    TextMessageStart {
        /// Its id.
        message_id: String,
        /// Always `assistant` when converger sends it.
        #[serde(default = "assistant_role")]
        role: String,
    },
    /// Text appended to it (never empty).
    TextMessageContent {
        /// The message.
        message_id: String,
        /// The text.
        delta: String,
    },
    /// The message ends.
    TextMessageEnd {
        /// The message.
        message_id: String,
    },
    /// A message's start, text and end in one (read back: AG-UI's convenience form).
    TextMessageChunk {
        /// The message (AG-UI requires it on the first chunk of a message).
        #[serde(default)]
        message_id: Option<String>,
        /// The text.
        #[serde(default)]
        delta: Option<String>,
    },
    /// A tool call begins.
    ToolCallStart {
        /// The call.
        tool_call_id: String,
        /// The tool.
        tool_call_name: String,
        /// The assistant message it belongs to.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent_message_id: Option<String>,
    },
    /// The call's arguments (JSON text).
    ToolCallArgs {
        /// The call.
        tool_call_id: String,
        /// Arguments text.
        delta: String,
    },
    /// The call's arguments are complete.
    ToolCallEnd {
        /// The call.
        tool_call_id: String,
    },
    /// A call's start, arguments and end in one (read back: AG-UI's convenience form).
    ToolCallChunk {
        /// The call (required on its first chunk).
        #[serde(default)]
        tool_call_id: Option<String>,
        /// The tool (required on its first chunk).
        #[serde(default)]
        tool_call_name: Option<String>,
        /// Arguments text.
        #[serde(default)]
        delta: Option<String>,
    },
    /// A tool's result.
    ToolCallResult {
        /// The result message's id.
        message_id: String,
        /// The call.
        tool_call_id: String,
        /// The result as text (JSON for anything but a string); read back, also AG-UI's list of
        /// content parts.
        content: Value,
        /// Always `tool`.
        #[serde(default = "tool_role")]
        role: String,
    },
    /// The conversation's committed runtime state.
    StateSnapshot {
        /// The state.
        snapshot: Value,
    },
    /// A change of the state as a JSON Patch (RFC 6902), read back from an agent.
    StateDelta {
        /// The operations.
        delta: Value,
    },
    /// The thread's chat view.
    MessagesSnapshot {
        /// Its messages.
        messages: Vec<Message>,
    },
    /// A frame of a type AG-UI has no event for.
    Custom {
        /// The frame's type.
        name: String,
        /// Its `data`.
        #[serde(default)]
        value: Value,
    },
    /// Read back: any event type converger does not use (never sent).
    #[serde(other, skip_serializing)]
    Other,
}

fn assistant_role() -> String {
    "assistant".into()
}

fn tool_role() -> String {
    "tool".into()
}

/// How a run ended (`RUN_FINISHED.outcome`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RunOutcome {
    /// Plain success (read back from agents; converger leaves the outcome out for it).
    #[serde(skip_serializing)]
    Success,
    /// The answer waits for the user.
    Interrupt {
        /// What it waits for.
        interrupts: Vec<Interrupt>,
    },
    /// The run was stopped.
    Cancelled,
    /// Read back: an outcome of a later AG-UI version (never sent).
    #[serde(other, skip_serializing)]
    Other,
}

/// One interrupt of an answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Interrupt {
    /// The agent's `interrupt` frame id.
    #[serde(default)]
    pub id: String,
    /// Why.
    #[serde(default)]
    pub reason: String,
    /// What to show the user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// An AG-UI message: of a `MESSAGES_SNAPSHOT`, of a client's history, of the history a node
/// posts to an HTTP agent, and of an agent's JSON answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Message {
    /// Its id.
    pub id: String,
    /// `user`, `assistant`, `system`, `tool`, …
    pub role: String,
    /// Text content (absent on an assistant message that only calls tools): a string, or (user
    /// messages) an array of input parts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Value>,
    /// An assistant message's tool calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool message's call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// A tool call of an assistant message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    /// The call.
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

/// The function of a tool call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The tool.
    pub name: String,
    /// Its arguments as JSON text.
    pub arguments: String,
}

/// A JSON value as the text AG-UI carries arguments and results in.
pub fn json_text(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn events_serialize_with_their_ag_ui_names() {
        let started = Event::RunStarted {
            thread_id: "t".into(),
            run_id: "r".into(),
        };
        assert_eq!(
            serde_json::to_value(started).unwrap(),
            json!({"type": "RUN_STARTED", "threadId": "t", "runId": "r"})
        );
        let finished = Event::RunFinished {
            thread_id: "t".into(),
            run_id: "r".into(),
            outcome: Some(RunOutcome::Cancelled),
            result: None,
        };
        assert_eq!(
            serde_json::to_value(finished).unwrap(),
            json!({"type": "RUN_FINISHED", "threadId": "t", "runId": "r", "outcome": {"type": "cancelled"}})
        );
        let call = Event::ToolCallStart {
            tool_call_id: "c".into(),
            tool_call_name: "find".into(),
            parent_message_id: Some("m".into()),
        };
        assert_eq!(
            serde_json::to_value(call).unwrap(),
            json!({"type": "TOOL_CALL_START", "toolCallId": "c", "toolCallName": "find", "parentMessageId": "m"})
        );
    }

    #[test]
    fn input_text_reads_strings_and_text_parts() {
        let input: RunAgentInput = serde_json::from_value(json!({
            "threadId": "t", "runId": "r", "messages": [
                {"id": "1", "role": "user", "content": "Hi"},
                {"id": "2", "role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]}
            ]
        }))
        .unwrap();
        assert_eq!(input.messages[0].text(), "Hi");
        assert_eq!(input.messages[1].text(), "ab");
    }
}
