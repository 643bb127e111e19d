//! Parsing of every frame a conversation-scope client may send (docs/protocol.md §§2–3).
//!
//! Parsing never panics and never fails on unknown fields: a frame is either one of the known
//! commands, a message to store, a frame to forward to agents, an unknown type (ignored), or a
//! refusal carrying its error code.

use serde_json::{Map, Value};

use crate::frame::{FrameError, MessageFrame, SERVER_ONLY_TYPES, validate_message_frame};
use crate::{ErrorCode, Limits};

/// Client frames relayed, transient, to the owning agent of each group.
pub const FORWARDED_TYPES: &[&str] = &[
    "resume",
    "abort",
    "genui_event",
    "client_tools",
    "client_skills",
    "survey",
];

/// Fields of `hello` (absent or wrongly typed fields are `None`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hello {
    /// `protocol`: `Some("converger/1")` selects the converger profile; `None` the mekik one.
    pub protocol: Option<String>,
    /// Asserted conversation.
    pub conversation_id: Option<String>,
    /// Asserted user.
    pub user_id: Option<String>,
    /// Highest seq the client has.
    pub watermark: Option<u64>,
    /// How much of the stream answering `watermark`'s turn the client shows, from a fractional
    /// watermark (the mekik profile's stream chunks carry such seqs, `mekik.rs`).
    pub stream_progress: Option<crate::mekik::StreamProgress>,
    /// Credential.
    pub token: Option<String>,
    /// Channel scope: the agent group to join.
    pub group: Option<Value>,
    /// Channel scope: per-conversation watermarks.
    pub watermarks: Option<Map<String, Value>>,
    /// Relayed to agents with this connection's turns.
    pub meta: Option<Value>,
    /// Forwarded to agents as `client_tools`.
    pub tools: Option<Value>,
    /// Forwarded to agents as `client_skills`.
    pub skills: Option<Value>,
    /// Hash of the components catalog the client already has.
    pub components_hash: Option<String>,
    /// Hash of the skills catalog the client already has.
    pub skills_hash: Option<String>,
    /// Channel scope: `lease` asks for lease mode.
    pub claim: Option<String>,
    /// The whole frame, for fields read by later features.
    pub raw: Map<String, Value>,
}

/// Which turn an `edit` or `regenerate` targets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TurnTarget {
    /// Explicit seq.
    pub seq: Option<u64>,
    /// A frame id or one of the sender's clientIds.
    pub message_id: Option<String>,
}

/// One parsed client frame.
#[derive(Debug, Clone, PartialEq)]
pub enum ClientFrame {
    /// `hello`.
    Hello(Box<Hello>),
    /// A persistent message (`text`, `event`, …) to store.
    Message(Box<MessageFrame>),
    /// `sync {watermark}`.
    Sync {
        /// Replay frames after this seq.
        watermark: u64,
    },
    /// `ping {nonce?}`.
    Ping {
        /// Echoed in the heartbeat.
        nonce: Option<Value>,
    },
    /// `typing {isTyping}`.
    Typing {
        /// Whether the participant is typing.
        is_typing: bool,
    },
    /// `read {watermark}`.
    Read {
        /// Highest seq read.
        watermark: u64,
    },
    /// `auth {token}`.
    Auth {
        /// The new token.
        token: String,
    },
    /// `edit {messageId?, seq?, clientId?, data}`.
    Edit {
        /// The turn edited.
        target: TurnTarget,
        /// Idempotency key of the edit.
        client_id: Option<String>,
        /// The new `data`.
        data: Value,
    },
    /// `regenerate {messageId?, seq?, clientId?}`.
    Regenerate {
        /// The turn to answer again.
        target: TurnTarget,
        /// Idempotency key.
        client_id: Option<String>,
    },
    /// `stop {clientId?, seq?}`, and the mekik `abort` (also forwarded to agents as sent): stop
    /// the turn at `seq`, or the latest unanswered one (ADR 0028).
    Stop {
        /// Echoed in the answer (an ack with `stopped`), which is sent only when given; never
        /// for an `abort`, which is not answered.
        client_id: Option<String>,
        /// The turn to stop.
        seq: Option<u64>,
        /// The frame as sent, when it is also forwarded to agents (`abort`).
        forwarded: Option<Map<String, Value>>,
    },
    /// `resume`, `abort`, `genui_event`, `client_tools`, `client_skills`, `survey`.
    Forwarded {
        /// The frame type.
        kind: String,
        /// The whole frame as sent.
        frame: Map<String, Value>,
    },
    /// A type this version does not know: ignored (docs/protocol.md, general rules).
    Unknown {
        /// The unknown type.
        kind: String,
    },
}

/// A refused frame: the error to answer and the clientId / type to echo when known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Error code and message.
    pub error: FrameError,
    /// The frame's clientId, echoed in `error.data.clientId`.
    pub client_id: Option<String>,
    /// The frame's type, echoed in `error.data.frameType`.
    pub frame_type: Option<String>,
}

fn refuse(
    code: ErrorCode,
    message: impl Into<String>,
    object: Option<&Map<String, Value>>,
) -> Refusal {
    let client_id = object
        .and_then(|object| object.get("clientId"))
        .and_then(Value::as_str)
        .filter(|id| crate::is_valid_client_id(id))
        .map(str::to_owned);
    let frame_type = object
        .and_then(|object| object.get("type"))
        .and_then(Value::as_str)
        .filter(|kind| !kind.contains('\0'))
        .map(|kind| kind.chars().take(64).collect());
    Refusal {
        error: FrameError {
            code,
            message: message.into(),
        },
        client_id,
        frame_type,
    }
}

/// Parses the text of one WebSocket message.
pub fn parse_client_text(text: &str, limits: &Limits) -> Result<ClientFrame, Refusal> {
    let value: Value = serde_json::from_str(text).map_err(|error| {
        refuse(
            ErrorCode::InvalidMessage,
            format!("malformed JSON: {error}"),
            None,
        )
    })?;
    parse_client_frame(&value, limits)
}

/// Parses one client frame already decoded as JSON.
pub fn parse_client_frame(value: &Value, limits: &Limits) -> Result<ClientFrame, Refusal> {
    let Some(object) = value.as_object() else {
        return Err(refuse(
            ErrorCode::InvalidMessage,
            "a frame must be a JSON object",
            None,
        ));
    };
    if crate::contains_nul(value) {
        // A hello that cannot be stored is a bad handshake (closed 4400), anything else a bad
        // frame of an open session.
        let code = match object.get("type").and_then(Value::as_str) {
            Some("hello") => ErrorCode::BadRequest,
            _ => ErrorCode::InvalidMessage,
        };
        return Err(refuse(code, crate::NUL_REFUSED, Some(object)));
    }
    let kind = match object.get("type") {
        Some(Value::String(kind)) if !kind.is_empty() => kind.as_str(),
        Some(_) => {
            return Err(refuse(
                ErrorCode::InvalidMessage,
                "type must be a non-empty string",
                Some(object),
            ));
        }
        None => {
            return Err(refuse(
                ErrorCode::InvalidMessage,
                "type is missing",
                Some(object),
            ));
        }
    };
    match kind {
        "hello" => Ok(ClientFrame::Hello(Box::new(parse_hello(object)))),
        "sync" => Ok(ClientFrame::Sync {
            watermark: required_seq(object, "watermark")?,
        }),
        "ping" => Ok(ClientFrame::Ping {
            nonce: object.get("nonce").cloned(),
        }),
        "typing" => match object.get("isTyping") {
            Some(Value::Bool(is_typing)) => Ok(ClientFrame::Typing {
                is_typing: *is_typing,
            }),
            _ => Err(refuse(
                ErrorCode::InvalidMessage,
                "isTyping must be a boolean",
                Some(object),
            )),
        },
        "read" => Ok(ClientFrame::Read {
            watermark: required_seq(object, "watermark")?,
        }),
        "auth" => match object.get("token") {
            Some(Value::String(token)) if !token.is_empty() => Ok(ClientFrame::Auth {
                token: token.clone(),
            }),
            _ => Err(refuse(
                ErrorCode::InvalidMessage,
                "token must be a non-empty string",
                Some(object),
            )),
        },
        "edit" => {
            let data = match object.get("data") {
                Some(Value::Object(data)) => Value::Object(data.clone()),
                _ => {
                    return Err(refuse(
                        ErrorCode::InvalidMessage,
                        "data must be an object",
                        Some(object),
                    ));
                }
            };
            if serde_json::to_vec(&data).map_or(usize::MAX, |bytes| bytes.len())
                > limits.max_frame_bytes
            {
                return Err(refuse(
                    ErrorCode::PayloadTooLarge,
                    "data is too large",
                    Some(object),
                ));
            }
            if let Some(Value::String(text)) = data.get("text")
                && text.len() > limits.max_text_bytes
            {
                return Err(refuse(
                    ErrorCode::PayloadTooLarge,
                    "data.text is too large",
                    Some(object),
                ));
            }
            Ok(ClientFrame::Edit {
                target: turn_target(object)?,
                client_id: client_id(object)?,
                data,
            })
        }
        "regenerate" => Ok(ClientFrame::Regenerate {
            target: turn_target(object)?,
            client_id: client_id(object)?,
        }),
        "stop" => Ok(ClientFrame::Stop {
            client_id: client_id(object)?,
            seq: turn_target(object)?.seq,
            forwarded: None,
        }),
        // The mekik client's stop button; agents that read it still get it.
        "abort" => Ok(ClientFrame::Stop {
            client_id: None,
            seq: None,
            forwarded: Some(object.clone()),
        }),
        kind if FORWARDED_TYPES.contains(&kind) => Ok(ClientFrame::Forwarded {
            kind: kind.to_owned(),
            frame: object.clone(),
        }),
        kind if SERVER_ONLY_TYPES.contains(&kind) || kind == "turnResult" => Err(refuse(
            ErrorCode::InvalidMessage,
            format!("{kind} is not sent by end users"),
            Some(object),
        )),
        _ if object.contains_key("data") => validate_message_frame(value, limits)
            .map(|message| ClientFrame::Message(Box::new(message)))
            .map_err(|error| Refusal {
                error,
                ..refuse(ErrorCode::InvalidMessage, "", Some(object))
            }),
        kind => Ok(ClientFrame::Unknown {
            kind: kind.chars().take(64).collect(),
        }),
    }
}

fn parse_hello(object: &Map<String, Value>) -> Hello {
    let string = |field: &str| object.get(field).and_then(Value::as_str).map(str::to_owned);
    let object_field = |field: &str| object.get(field).filter(|value| value.is_object()).cloned();
    let watermark = object
        .get("watermark")
        .and_then(crate::mekik::split_watermark);
    Hello {
        protocol: string("protocol"),
        conversation_id: string("conversationId"),
        user_id: string("userId"),
        watermark: watermark.map(|(whole, _)| whole),
        stream_progress: watermark.and_then(|(_, progress)| progress),
        token: string("token").filter(|token| !token.is_empty()),
        group: object.get("group").cloned(),
        watermarks: object.get("watermarks").and_then(Value::as_object).cloned(),
        meta: object_field("meta"),
        tools: object
            .get("tools")
            .filter(|value| value.is_array() || value.is_object())
            .cloned(),
        skills: object
            .get("skills")
            .filter(|value| value.is_array() || value.is_object())
            .cloned(),
        components_hash: string("componentsHash"),
        skills_hash: string("skillsHash"),
        claim: string("claim"),
        raw: object.clone(),
    }
}

fn required_seq(object: &Map<String, Value>, field: &str) -> Result<u64, Refusal> {
    object.get(field).and_then(Value::as_u64).ok_or_else(|| {
        refuse(
            ErrorCode::InvalidMessage,
            format!("{field} must be a non-negative integer"),
            Some(object),
        )
    })
}

fn client_id(object: &Map<String, Value>) -> Result<Option<String>, Refusal> {
    match object.get("clientId") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(id)) if crate::is_valid_client_id(id) => Ok(Some(id.clone())),
        Some(_) => Err(refuse(
            ErrorCode::InvalidMessage,
            "clientId must be 1-128 characters of A-Za-z0-9._:~-",
            Some(object),
        )),
    }
}

fn turn_target(object: &Map<String, Value>) -> Result<TurnTarget, Refusal> {
    let seq = match object.get("seq") {
        None | Some(Value::Null) => None,
        Some(value) => Some(value.as_u64().filter(|seq| *seq > 0).ok_or_else(|| {
            refuse(
                ErrorCode::InvalidMessage,
                "seq must be a positive integer",
                Some(object),
            )
        })?),
    };
    let message_id = match object.get("messageId") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) if !id.is_empty() && id.len() <= 128 => Some(id.clone()),
        Some(_) => {
            return Err(refuse(
                ErrorCode::InvalidMessage,
                "messageId must be a string",
                Some(object),
            ));
        }
    };
    Ok(TurnTarget { seq, message_id })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn parse(value: Value) -> Result<ClientFrame, Refusal> {
        parse_client_frame(&value, &Limits::default())
    }

    #[test]
    fn commands_parse() {
        assert_eq!(
            parse(json!({"type": "sync", "watermark": 3})),
            Ok(ClientFrame::Sync { watermark: 3 })
        );
        assert_eq!(
            parse(json!({"type": "ping"})),
            Ok(ClientFrame::Ping { nonce: None })
        );
        assert_eq!(
            parse(json!({"type": "typing", "isTyping": true})),
            Ok(ClientFrame::Typing { is_typing: true })
        );
        assert_eq!(
            parse(json!({"type": "read", "watermark": 0})),
            Ok(ClientFrame::Read { watermark: 0 })
        );
        assert!(matches!(
            parse(json!({"type": "resume", "data": {}})),
            Ok(ClientFrame::Forwarded { .. })
        ));
        assert!(matches!(
            parse(json!({"type": "whatever"})),
            Ok(ClientFrame::Unknown { .. })
        ));
        assert!(matches!(
            parse(json!({"type": "text", "data": {"text": "x"}})),
            Ok(ClientFrame::Message(_))
        ));
    }

    #[test]
    fn wrongly_typed_hello_fields_are_absent() {
        let Ok(ClientFrame::Hello(hello)) = parse(
            json!({"type": "hello", "protocol": 1, "watermark": "12", "conversationId": ["x"], "token": ""}),
        ) else {
            panic!("hello parses");
        };
        assert_eq!(hello.protocol, None);
        assert_eq!(hello.watermark, None);
        assert_eq!(hello.conversation_id, None);
        assert_eq!(hello.token, None);
    }

    #[test]
    fn refusals_echo_client_id_and_type() {
        let refused =
            parse(json!({"type": "text", "clientId": "c-1", "data": {"text": 5}})).unwrap_err();
        assert_eq!(refused.error.code, ErrorCode::InvalidMessage);
        assert_eq!(refused.client_id.as_deref(), Some("c-1"));
        assert_eq!(refused.frame_type.as_deref(), Some("text"));
        let refused = parse(json!({"type": "welcome", "data": {}})).unwrap_err();
        assert_eq!(refused.error.code, ErrorCode::InvalidMessage);
        let refused = parse(json!({"type": "sync", "watermark": -1})).unwrap_err();
        assert_eq!(refused.error.code, ErrorCode::InvalidMessage);
        assert!(parse_client_text("{nope", &Limits::default()).is_err());
        assert!(parse_client_text("[]", &Limits::default()).is_err());
    }

    #[test]
    fn edit_targets() {
        let Ok(ClientFrame::Edit {
            target, client_id, ..
        }) = parse(json!({"type": "edit", "seq": 4, "clientId": "e-1", "data": {"text": "new"}}))
        else {
            panic!("edit parses");
        };
        assert_eq!(target.seq, Some(4));
        assert_eq!(client_id.as_deref(), Some("e-1"));
        assert!(parse(json!({"type": "edit", "seq": 0, "data": {}})).is_err());
        assert!(parse(json!({"type": "edit", "seq": 2})).is_err());
    }

    #[test]
    fn nul_characters_are_refused_anywhere() {
        for frame in [
            json!({"type": "text", "data": {"text": "a\u{0}b"}}),
            json!({"type": "text", "data": {"k\u{0}": "v"}}),
            json!({"type": "text", "data": {"text": "x"}, "extra": ["\u{0}"]}),
            json!({"type": "te\u{0}xt", "data": {}}),
            json!({"type": "typing", "isTyping": true, "x": "\u{0}"}),
        ] {
            let refused = parse(frame.clone()).expect_err(&frame.to_string());
            assert_eq!(refused.error.code, ErrorCode::InvalidMessage, "{frame}");
            assert!(
                refused
                    .frame_type
                    .as_deref()
                    .is_none_or(|kind| !kind.contains('\0'))
            );
        }
        let hello = parse(json!({"type": "hello", "userId": "al\u{0}ice"})).unwrap_err();
        assert_eq!(hello.error.code, ErrorCode::BadRequest);
        assert_eq!(hello.frame_type.as_deref(), Some("hello"));
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in ".{0,200}") {
            let _ = parse_client_text(&text, &Limits::default());
        }

        #[test]
        fn arbitrary_objects_never_panic(kind in "[a-zA-Z_]{0,12}", field in "[a-zA-Z]{1,10}", n in any::<i64>(), s in ".{0,20}") {
            let frames = [
                json!({"type": kind.clone(), field.clone(): n}),
                json!({"type": kind.clone(), field.clone(): s.clone(), "data": {field.clone(): n}}),
                json!({"type": kind.clone(), "data": s.clone(), "clientId": s.clone()}),
            ];
            for frame in frames {
                let _ = parse(frame);
            }
        }
    }
}
