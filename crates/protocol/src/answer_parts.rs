//! A stored answer frame as the parts chat frontends show (docs/frontends.md): the one mapping
//! that the AI SDK's UI message stream and AG-UI both render, so the two agree on what a
//! `tool_call`, a `tool_result` or an `interrupt` frame is.

use serde_json::Value;

/// What one answer frame is, for a frontend.
#[derive(Debug, Clone, PartialEq)]
pub enum AnswerPart<'a> {
    /// `text`: `data.text`.
    Text(&'a str),
    /// `tool_call`: the agent called a tool.
    ToolCall {
        /// `data.toolCallId`, else the frame's id.
        call_id: &'a str,
        /// `data.name` (or `data.toolName`), else `"tool"`.
        name: &'a str,
        /// `data.arguments` (or `data.input`), else `{}`.
        input: &'a Value,
    },
    /// `tool_result`: a tool's output.
    ToolResult {
        /// `data.toolCallId`, when the agent named the call.
        call_id: Option<&'a str>,
        /// `data.name`, used to find the call when no id is given.
        name: Option<&'a str>,
        /// `data.result` (or `data.output`), else `null`.
        output: &'a Value,
    },
    /// `interrupt`: the agent waits for the user (AG-UI's interrupt outcome).
    Interrupt {
        /// The frame's id (what a resume names).
        id: &'a str,
        /// `data.reason`, else `"input_required"`.
        reason: &'a str,
        /// `data.message`, else `data.question`.
        message: Option<&'a str>,
    },
    /// Any other type (`genui`, `event`, rich types): shown as data named by its type.
    Data {
        /// The frame's type.
        kind: &'a str,
        /// Its `data`.
        data: &'a Value,
    },
}

static NULL: Value = Value::Null;
static EMPTY_OBJECT: std::sync::LazyLock<Value> =
    std::sync::LazyLock::new(|| Value::Object(serde_json::Map::new()));

/// The part a stored frame of type `kind`, id `id` and `data` is.
pub fn answer_part<'a>(kind: &'a str, id: &'a str, data: &'a Value) -> AnswerPart<'a> {
    let text_field = |key: &str| data.get(key).and_then(Value::as_str);
    match kind {
        "text" => AnswerPart::Text(text_field("text").unwrap_or_default()),
        "tool_call" => AnswerPart::ToolCall {
            call_id: text_field("toolCallId").unwrap_or(id),
            name: text_field("name")
                .or_else(|| text_field("toolName"))
                .unwrap_or("tool"),
            input: data
                .get("arguments")
                .or_else(|| data.get("input"))
                .unwrap_or(&EMPTY_OBJECT),
        },
        "tool_result" => AnswerPart::ToolResult {
            call_id: text_field("toolCallId"),
            name: text_field("name").or_else(|| text_field("toolName")),
            output: data
                .get("result")
                .or_else(|| data.get("output"))
                .unwrap_or(&NULL),
        },
        "interrupt" => AnswerPart::Interrupt {
            id,
            reason: text_field("reason").unwrap_or("input_required"),
            message: text_field("message").or_else(|| text_field("question")),
        },
        _ => AnswerPart::Data { kind, data },
    }
}

/// Pairs tool results with their calls within one answer: a result that names no call id
/// belongs to the latest call of the same tool name (else the latest call) before it.
#[derive(Debug, Default)]
pub struct ToolCalls {
    calls: Vec<(String, String)>,
}

impl ToolCalls {
    /// Remembers a call.
    pub fn called(&mut self, call_id: &str, name: &str) {
        self.calls.push((call_id.to_owned(), name.to_owned()));
    }

    /// The call a result answers; `None` when it names a call this answer did not make, or
    /// the answer made none (the result is then shown as data: a client refuses the output of
    /// a call it never saw).
    pub fn answered(&self, call_id: Option<&str>, name: Option<&str>) -> Option<String> {
        if let Some(call_id) = call_id {
            return self
                .calls
                .iter()
                .any(|(id, _)| id == call_id)
                .then(|| call_id.to_owned());
        }
        let by_name = name.and_then(|name| {
            self.calls
                .iter()
                .rev()
                .find(|(_, called)| called == name)
                .map(|(id, _)| id.clone())
        });
        by_name.or_else(|| self.calls.last().map(|(id, _)| id.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_python_sdk_tool_agent_frames_map_to_a_call_and_its_result() {
        let call = json!({"name": "find_table", "arguments": {"party": 4}});
        let AnswerPart::ToolCall {
            call_id,
            name,
            input,
        } = answer_part("tool_call", "f-1", &call)
        else {
            panic!("a tool call");
        };
        assert_eq!((call_id, name), ("f-1", "find_table"));
        assert_eq!(input, &json!({"party": 4}));
        let mut calls = ToolCalls::default();
        calls.called(call_id, name);
        let result = json!({"name": "find_table", "result": {"table": "T4"}});
        let AnswerPart::ToolResult {
            call_id,
            name,
            output,
        } = answer_part("tool_result", "f-2", &result)
        else {
            panic!("a tool result");
        };
        assert_eq!(calls.answered(call_id, name).as_deref(), Some("f-1"));
        assert_eq!(output, &json!({"table": "T4"}));
    }

    #[test]
    fn a_result_without_a_call_is_unpaired_and_other_types_are_data() {
        assert_eq!(ToolCalls::default().answered(None, Some("x")), None);
        let mut calls = ToolCalls::default();
        calls.called("c-1", "find");
        assert_eq!(
            calls.answered(Some("c-9"), None),
            None,
            "a call it never made"
        );
        assert_eq!(calls.answered(Some("c-1"), None).as_deref(), Some("c-1"));
        let data = json!({"component": "card"});
        assert_eq!(
            answer_part("genui", "g", &data),
            AnswerPart::Data {
                kind: "genui",
                data: &data
            }
        );
        let interrupt = json!({"question": "Book it?"});
        assert_eq!(
            answer_part("interrupt", "int-1", &interrupt),
            AnswerPart::Interrupt {
                id: "int-1",
                reason: "input_required",
                message: Some("Book it?")
            }
        );
    }
}
