//! A conversation's history as the chat view shows it (ADR 0018), read from the store, and as
//! AG-UI messages: what a chat frontend's snapshot shows and what an HTTP agent is posted.

use converger_protocol::ag_ui::{FunctionCall, Message, ToolCall, json_text};
use converger_protocol::{AnswerPart, ToolCalls, answer_part};
use converger_store::{Activity, Store, StoreError};
use serde_json::Value;
use uuid::Uuid;

/// Frames read per page.
const PAGE: i64 = 1_000;

/// The chat view of a conversation's last `limit` frames up to seq `head` (superseded
/// questions and answers left out, an edit under its turn's id).
pub(crate) async fn chat_view_frames(
    store: &Store,
    conversation_id: Uuid,
    head: i64,
    limit: i64,
) -> Result<Vec<Activity>, StoreError> {
    let view = crate::wire::chat_view(store.revised_turns(conversation_id).await?);
    let mut after = head.saturating_sub(limit).max(0);
    let mut frames = Vec::new();
    while after < head {
        let page = store.list_activities(conversation_id, after, PAGE).await?;
        let Some(last) = page.last().map(|frame| frame.seq) else {
            break;
        };
        after = last;
        for mut frame in page {
            if frame.seq > head {
                break;
            }
            if view.hides(frame.seq) {
                continue;
            }
            if let Some(id) = view.shown_as(frame.seq) {
                frame.id = id.to_owned();
            }
            frames.push(frame);
        }
    }
    Ok(frames)
}

/// The id a client knows one of its user's frames by: the id its client gave (the commit's
/// idempotency key), else the frame's.
pub(crate) fn client_message_id(frame: &Activity) -> &str {
    match (&frame.client_id, frame.sender_role.as_str()) {
        (Some(client_id), converger_protocol::USER_ROLE) => client_id,
        _ => &frame.id,
    }
}

/// The chat view's frames as AG-UI messages: user texts, assistant texts, tool calls (on an
/// assistant message) and tool results; other frames have no AG-UI message.
pub(crate) fn ag_ui_messages(frames: &[converger_store::Activity]) -> Vec<Message> {
    let mut messages = Vec::new();
    let mut calls = ToolCalls::default();
    for frame in frames {
        let message = |role: &str, content: Option<String>| Message {
            id: client_message_id(frame).to_owned(),
            role: role.into(),
            content: content.map(Value::String),
            tool_calls: Vec::new(),
            tool_call_id: None,
        };
        let user = frame.sender_role == converger_protocol::USER_ROLE;
        if user {
            // A result pairs with a call of the same answer, as live.
            calls = ToolCalls::default();
        }
        match answer_part(&frame.kind, &frame.id, &frame.data) {
            AnswerPart::Text(text) if user => messages.push(message("user", Some(text.into()))),
            AnswerPart::Text(text) => messages.push(message("assistant", Some(text.into()))),
            AnswerPart::ToolCall {
                call_id,
                name,
                input,
            } if !user => {
                calls.called(call_id, name);
                messages.push(Message {
                    tool_calls: vec![ToolCall {
                        id: call_id.into(),
                        kind: "function".into(),
                        function: FunctionCall {
                            name: name.into(),
                            arguments: json_text(input),
                        },
                    }],
                    ..message("assistant", None)
                });
            }
            AnswerPart::ToolResult {
                call_id,
                name,
                output,
            } if !user => {
                if let Some(call_id) = calls.answered(call_id, name) {
                    messages.push(Message {
                        tool_call_id: Some(call_id),
                        ..message("tool", Some(json_text(output)))
                    });
                }
            }
            _ => {}
        }
    }
    messages
}
