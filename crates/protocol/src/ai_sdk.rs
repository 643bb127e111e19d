//! The Vercel AI SDK's UI message stream (docs/frontends.md, ADR 0030): the request body its
//! `DefaultChatTransport` sends, the chunks converger answers with, and the `UIMessage` shape
//! of a chat's history.
//!
//! Only what the `ai` packages 5, 6 and 7 all accept is emitted: early 5.x and 6.x releases
//! validate chunks with strict objects (an unknown key fails the whole stream) and every
//! release rejects an unknown chunk type, so no chunk carries a key beyond the 5.0 schema
//! (`finish` has no `finishReason`, `abort` no `reason`).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `POST /api/v1/ai-sdk/chat`: what `DefaultChatTransport` sends.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChatRequest {
    /// The chat id: the conversation.
    pub id: String,
    /// The client's whole history; only the last user message is read.
    pub messages: Vec<UiMessageIn>,
    /// `submit-message` or `regenerate-message`.
    #[serde(default)]
    pub trigger: Option<String>,
    /// The message the trigger is about (the assistant message to regenerate).
    #[serde(default)]
    pub message_id: Option<String>,
}

/// A message of the request's history.
#[derive(Debug, Deserialize)]
pub struct UiMessageIn {
    /// The client's message id.
    pub id: String,
    /// `user`, `assistant` or `system`.
    pub role: String,
    /// Its parts; only `text` parts are read.
    #[serde(default)]
    pub parts: Vec<UiPartIn>,
}

/// A part of a request message: its text when it is a text part.
#[derive(Debug, Deserialize)]
pub struct UiPartIn {
    /// The part's type.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

impl UiMessageIn {
    /// The message's text parts, joined.
    pub fn text(&self) -> String {
        self.parts
            .iter()
            .filter(|part| part.kind == "text")
            .filter_map(|part| part.text.as_deref())
            .collect()
    }
}

/// One chunk of the UI message stream (the SSE `data:` of one event).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(
    tag = "type",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum UiChunk {
    /// The answer begins: its message id.
    Start {
        /// The assistant message's id.
        message_id: String,
    },
    /// A step begins (one per answer).
    StartStep,
    /// A text part begins.
    TextStart {
        /// The part's id.
        id: String,
    },
    /// Text appended to a part.
    TextDelta {
        /// The part's id.
        id: String,
        /// The text.
        delta: String,
    },
    /// A text part ends.
    TextEnd {
        /// The part's id.
        id: String,
    },
    /// A tool call with its whole input.
    ToolInputAvailable {
        /// The call's id.
        tool_call_id: String,
        /// The tool.
        tool_name: String,
        /// Its input.
        input: Value,
    },
    /// A tool call's output.
    ToolOutputAvailable {
        /// The call's id.
        tool_call_id: String,
        /// The output.
        output: Value,
    },
    /// The step ends.
    FinishStep,
    /// The answer is complete.
    Finish,
    /// The answer was stopped.
    Abort,
    /// The answer failed or the send was refused.
    Error {
        /// Why.
        error_text: String,
    },
    /// A data part (`data-<name>`), see [`DataChunk`]; serialized flat.
    #[serde(untagged)]
    Data(DataChunk),
}

/// A `data-<name>` chunk: the type is built from the frame's type.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DataChunk {
    /// `data-<name>`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The part's id (a later chunk with the same id replaces it).
    pub id: String,
    /// The data.
    pub data: Value,
}

impl DataChunk {
    /// The data part named `name`.
    pub fn new(name: &str, id: &str, data: Value) -> DataChunk {
        DataChunk {
            kind: format!("data-{name}"),
            id: id.to_owned(),
            data,
        }
    }
}

/// A message of a chat's history (`GET …/messages`), as `useChat({messages})` takes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UiMessage {
    /// The message id.
    pub id: String,
    /// `user` or `assistant`.
    pub role: &'static str,
    /// Its parts.
    pub parts: Vec<UiPart>,
}

/// A part of a history message.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(
    tag = "type",
    rename_all = "kebab-case",
    rename_all_fields = "camelCase"
)]
pub enum UiPart {
    /// Text.
    Text {
        /// The text.
        text: String,
    },
    /// A tool call, with its output when one came; serialized flat.
    #[serde(untagged)]
    Tool(ToolPart),
    /// A data part, see [`DataChunk`]; serialized flat.
    #[serde(untagged)]
    Data(DataChunk),
}

/// A tool call part, `tool-<name>`: what the client builds from the live stream's
/// `tool-input-available` and `tool-output-available`, so a reload shows the same part.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ToolPart {
    /// `tool-<name>`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The call's id.
    pub tool_call_id: String,
    /// `input-available` or `output-available`.
    pub state: &'static str,
    /// Its input.
    pub input: Value,
    /// Its output, once available.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<Value>,
}

impl ToolPart {
    /// A call of tool `name` waiting for its output.
    pub fn called(name: &str, call_id: &str, input: Value) -> ToolPart {
        ToolPart {
            kind: format!("tool-{name}"),
            tool_call_id: call_id.to_owned(),
            state: "input-available",
            input,
            output: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chunks_serialize_as_the_five_point_zero_schema_names_them() {
        let cases = [
            (
                UiChunk::Start {
                    message_id: "m".into(),
                },
                json!({"type": "start", "messageId": "m"}),
            ),
            (UiChunk::StartStep, json!({"type": "start-step"})),
            (
                UiChunk::TextDelta {
                    id: "t".into(),
                    delta: "Hi".into(),
                },
                json!({"type": "text-delta", "id": "t", "delta": "Hi"}),
            ),
            (
                UiChunk::ToolInputAvailable {
                    tool_call_id: "c".into(),
                    tool_name: "find".into(),
                    input: json!({}),
                },
                json!({"type": "tool-input-available", "toolCallId": "c", "toolName": "find", "input": {}}),
            ),
            (
                UiChunk::Data(DataChunk::new("genui", "g", json!({"a": 1}))),
                json!({"type": "data-genui", "id": "g", "data": {"a": 1}}),
            ),
            (UiChunk::Finish, json!({"type": "finish"})),
            (UiChunk::Abort, json!({"type": "abort"})),
            (
                UiChunk::Error {
                    error_text: "no".into(),
                },
                json!({"type": "error", "errorText": "no"}),
            ),
        ];
        for (chunk, expected) in cases {
            assert_eq!(serde_json::to_value(&chunk).unwrap(), expected);
        }
    }

    #[test]
    fn a_request_reads_the_text_of_its_last_message() {
        let request: ChatRequest = serde_json::from_value(json!({
            "id": "c", "trigger": "submit-message", "messageId": null,
            "messages": [{"id": "u1", "role": "user", "parts": [
                {"type": "step-start"}, {"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}
            ]}]
        }))
        .unwrap();
        assert_eq!(request.messages[0].text(), "Hello");
    }
}
