//! Parsing of every frame a channel-scope (agent) connection may send (docs/protocol.md §4.5).
//!
//! Like `client_frame.rs`, parsing never panics: a message is a bare command (`ping`, `auth`,
//! a catalog), an enveloped conversation frame, something to ignore, or a refusal. An enveloped
//! frame's own refusal is kept inside it, because the session first checks that the conversation
//! is the connection's to address and only then answers what was wrong with the frame.

use serde_json::{Map, Value};
use uuid::Uuid;

use crate::frame::{FrameError, MessageFrame, validate_agent_message_frame};
use crate::server_frame::Catalog;
use crate::streams::{StreamAbort, StreamChunk, StreamTurnRef};
use crate::{ErrorCode, Limits, Refusal};

/// One parsed agent message.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentFrame {
    /// `{conversationId, frame}`.
    Enveloped {
        /// The conversation addressed.
        conversation_id: Uuid,
        /// What the envelope carries.
        frame: EnvelopedFrame,
    },
    /// `ping {nonce?}`.
    Ping {
        /// Echoed in the heartbeat.
        nonce: Option<Value>,
    },
    /// `auth {token}`; a missing token is an empty one, refused like any bad token.
    Auth {
        /// The new token.
        token: String,
    },
    /// `genui_components` or `skills`: a catalog to store for the channel.
    Catalog {
        /// Which catalog.
        catalog: Catalog,
        /// Its `hash`.
        hash: Value,
        /// Its list.
        list: Value,
    },
    /// `hello` again, or a bare type this version does not know.
    Ignored,
}

/// What an envelope carries.
#[derive(Debug, Clone, PartialEq)]
pub enum EnvelopedFrame {
    /// Refused whatever its type: it holds something storage cannot keep (a NUL character).
    Refused(Refusal),
    /// `turnResult`: the answer to a delivered turn.
    TurnResult(Result<Box<TurnResult>, Refusal>),
    /// `typing {isTyping}`, relayed to the conversation's end users.
    Typing {
        /// Whether the agent is typing.
        is_typing: bool,
    },
    /// `run {data}`, relayed to the conversation's end users.
    Run {
        /// The run status.
        data: Value,
    },
    /// `error {data}`, relayed to the conversation's end users.
    Error {
        /// The error.
        data: Value,
    },
    /// `sync {watermark}`: replay what this connection owns after the watermark.
    Sync(Result<u64, Refusal>),
    /// `streamChunk`: one chunk of a streamed answer (not stored).
    StreamChunk(Result<Box<StreamChunk>, Refusal>),
    /// `streamAbort`: the agent ends a stream without a result.
    StreamAbort(Result<StreamAbort, Refusal>),
    /// Any other type: a proactive frame to store.
    Message(Result<Box<MessageFrame>, Refusal>),
}

/// A parsed `turnResult`.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnResult {
    /// The result's clientId, echoed in its ack.
    pub client_id: Option<String>,
    /// `turn.seq`.
    pub seq: i64,
    /// `turn.revision` (0 when absent).
    pub revision: i32,
    /// `turn.fence` (lease mode).
    pub fence: Option<i64>,
    /// The answer's frames, each a valid message frame.
    pub frames: Vec<MessageFrame>,
    /// The new runtime, when the answer writes one.
    pub runtime: Option<ResultRuntime>,
}

/// `runtime {version, state}` of a result: replaces the state when `version` is current.
#[derive(Debug, Clone, PartialEq)]
pub struct ResultRuntime {
    /// The version the agent read.
    pub version: i64,
    /// The new state object.
    pub state: Value,
}

/// Parses the text of one agent WebSocket message. `fence_required` is true on lease-mode
/// connections, whose results must name the fence of their delivery.
pub fn parse_agent_text(
    text: &str,
    limits: &Limits,
    fence_required: bool,
) -> Result<AgentFrame, Refusal> {
    let Ok(Value::Object(object)) = serde_json::from_str::<Value>(text) else {
        return Err(plain(
            ErrorCode::InvalidMessage,
            "a frame must be a JSON object",
        ));
    };
    if let (Some(Value::String(conversation)), Some(Value::Object(frame))) =
        (object.get("conversationId"), object.get("frame"))
    {
        let Ok(conversation_id) = Uuid::parse_str(conversation) else {
            return Err(plain(
                ErrorCode::ConversationNotFound,
                "conversation not found",
            ));
        };
        return Ok(AgentFrame::Enveloped {
            conversation_id,
            frame: parse_enveloped(frame, limits, fence_required),
        });
    }
    parse_bare(&object)
}

fn parse_bare(object: &Map<String, Value>) -> Result<AgentFrame, Refusal> {
    if map_contains_nul(object) {
        return Err(plain(ErrorCode::InvalidMessage, crate::NUL_REFUSED));
    }
    let kind = object
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let catalog = match kind {
        "ping" => {
            return Ok(AgentFrame::Ping {
                nonce: object.get("nonce").cloned(),
            });
        }
        "auth" => {
            let token = object
                .get("token")
                .and_then(Value::as_str)
                .unwrap_or_default();
            return Ok(AgentFrame::Auth {
                token: token.to_owned(),
            });
        }
        "genui_components" => Catalog::Components,
        "skills" => Catalog::Skills,
        "" => return Err(plain(ErrorCode::InvalidMessage, "type is missing")),
        _ => return Ok(AgentFrame::Ignored),
    };
    Ok(AgentFrame::Catalog {
        catalog,
        hash: object.get("hash").cloned().unwrap_or(Value::Null),
        list: object
            .get(catalog.list_field())
            .cloned()
            .unwrap_or_else(|| Value::Array(Vec::new())),
    })
}

fn parse_enveloped(
    frame: &Map<String, Value>,
    limits: &Limits,
    fence_required: bool,
) -> EnvelopedFrame {
    let kind = frame
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if map_contains_nul(frame) {
        return EnvelopedFrame::Refused(Refusal {
            error: FrameError {
                code: ErrorCode::InvalidMessage,
                message: crate::NUL_REFUSED.to_owned(),
            },
            client_id: valid_client_id(frame),
            frame_type: (!kind.is_empty() && !kind.contains('\0'))
                .then(|| kind.chars().take(64).collect()),
        });
    }
    let data_or_empty = || {
        frame
            .get("data")
            .cloned()
            .unwrap_or_else(|| Value::Object(Map::new()))
    };
    match kind {
        "turnResult" => EnvelopedFrame::TurnResult(
            parse_turn_result(frame, limits, fence_required).map(Box::new),
        ),
        "typing" => EnvelopedFrame::Typing {
            is_typing: frame
                .get("isTyping")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        },
        "run" => EnvelopedFrame::Run {
            data: data_or_empty(),
        },
        "error" => EnvelopedFrame::Error {
            data: data_or_empty(),
        },
        "streamChunk" => EnvelopedFrame::StreamChunk(
            crate::streams::parse_stream_chunk(frame, limits).map(Box::new),
        ),
        "streamAbort" => EnvelopedFrame::StreamAbort(crate::streams::parse_stream_abort(frame)),
        "sync" => EnvelopedFrame::Sync(frame.get("watermark").and_then(Value::as_u64).ok_or_else(
            || {
                plain(
                    ErrorCode::InvalidMessage,
                    "watermark must be a non-negative integer",
                )
            },
        )),
        _ => EnvelopedFrame::Message(
            validate_agent_message_frame(&Value::Object(frame.clone()), limits)
                .map(Box::new)
                .map_err(|error| Refusal {
                    error,
                    client_id: valid_client_id(frame),
                    frame_type: None,
                }),
        ),
    }
}

fn parse_turn_result(
    frame: &Map<String, Value>,
    limits: &Limits,
    fence_required: bool,
) -> Result<TurnResult, Refusal> {
    let client_id = valid_client_id(frame);
    let refuse = |code: ErrorCode, message: String| Refusal {
        error: FrameError { code, message },
        client_id: client_id.clone(),
        frame_type: Some("turnResult".into()),
    };
    let invalid = |message: &str| refuse(ErrorCode::InvalidMessage, message.to_owned());
    let turn = frame
        .get("turn")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid("turn must be an object"))?;
    let StreamTurnRef {
        seq,
        revision,
        fence,
    } = crate::streams::parse_turn(turn).map_err(invalid)?;
    if fence_required && fence.is_none() {
        return Err(refuse(
            ErrorCode::BadRequest,
            "turn.fence is required in lease mode".into(),
        ));
    }
    let listed = frame
        .get("frames")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("frames must be an array"))?;
    let mut frames = Vec::with_capacity(listed.len());
    for answer_frame in listed {
        let message = validate_agent_message_frame(answer_frame, limits)
            .map_err(|error| refuse(error.code, format!("frames: {}", error.message)))?;
        frames.push(message);
    }
    let runtime = match frame.get("runtime") {
        None | Some(Value::Null) => None,
        Some(Value::Object(runtime)) => {
            let version = runtime
                .get("version")
                .and_then(Value::as_i64)
                .filter(|version| *version >= 0)
                .ok_or_else(|| invalid("runtime.version must be a non-negative integer"))?;
            let state = runtime
                .get("state")
                .filter(|state| state.is_object())
                .cloned()
                .ok_or_else(|| invalid("runtime.state must be an object"))?;
            if state.to_string().len() > limits.max_frame_bytes {
                return Err(refuse(
                    ErrorCode::PayloadTooLarge,
                    "runtime.state is too large".into(),
                ));
            }
            Some(ResultRuntime { version, state })
        }
        Some(_) => return Err(invalid("runtime must be an object")),
    };
    Ok(TurnResult {
        client_id,
        seq,
        revision,
        fence,
        frames,
        runtime,
    })
}

/// The frame's `clientId` when it has the clientId shape (echoed in refusals and acks).
fn valid_client_id(frame: &Map<String, Value>) -> Option<String> {
    frame
        .get("clientId")
        .and_then(Value::as_str)
        .filter(|id| crate::is_valid_client_id(id))
        .map(str::to_owned)
}

/// True when a key or a value of the object holds a NUL character.
fn map_contains_nul(object: &Map<String, Value>) -> bool {
    object
        .iter()
        .any(|(key, value)| key.contains('\0') || crate::contains_nul(value))
}

/// A refusal that echoes nothing of the frame.
fn plain(code: ErrorCode, message: &str) -> Refusal {
    Refusal {
        error: FrameError {
            code,
            message: message.to_owned(),
        },
        client_id: None,
        frame_type: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    const CONVERSATION: &str = "01a229f7-6923-72c8-b84e-152340d1c09c";

    fn parse(frame: Value) -> Result<AgentFrame, Refusal> {
        parse_agent_text(&frame.to_string(), &Limits::default(), false)
    }

    fn enveloped(frame: Value) -> EnvelopedFrame {
        match parse(json!({"conversationId": CONVERSATION, "frame": frame})) {
            Ok(AgentFrame::Enveloped { frame, .. }) => frame,
            other => panic!("not enveloped: {other:?}"),
        }
    }

    #[test]
    fn bare_commands_parse() {
        assert_eq!(
            parse(json!({"type": "ping", "nonce": 3})),
            Ok(AgentFrame::Ping {
                nonce: Some(json!(3))
            })
        );
        assert_eq!(
            parse(json!({"type": "auth"})),
            Ok(AgentFrame::Auth { token: "".into() })
        );
        assert_eq!(parse(json!({"type": "hello"})), Ok(AgentFrame::Ignored));
        assert_eq!(
            parse(json!({"type": "skills", "hash": "h"})),
            Ok(AgentFrame::Catalog {
                catalog: Catalog::Skills,
                hash: json!("h"),
                list: json!([])
            })
        );
        let missing = parse(json!({"clientId": "c"})).unwrap_err();
        assert_eq!(missing.error.code, ErrorCode::InvalidMessage);
        assert_eq!(missing.client_id, None);
        assert!(parse_agent_text("[1]", &Limits::default(), false).is_err());
    }

    #[test]
    fn an_envelope_needs_a_uuid() {
        let refused =
            parse(json!({"conversationId": "nope", "frame": {"type": "typing"}})).unwrap_err();
        assert_eq!(refused.error.code, ErrorCode::ConversationNotFound);
        // Not an envelope at all (no frame object): a bare frame.
        assert_eq!(
            parse(json!({"conversationId": CONVERSATION, "type": "ping"})),
            Ok(AgentFrame::Ping { nonce: None })
        );
    }

    #[test]
    fn turn_results_parse_and_refuse_with_their_client_id() {
        let EnvelopedFrame::TurnResult(Ok(result)) = enveloped(json!({
            "type": "turnResult", "clientId": "r-1", "turn": {"seq": 2, "revision": 1, "fence": 4},
            "frames": [{"type": "text", "data": {"text": "a"}}],
            "runtime": {"version": 0, "state": {"n": 1}}}))
        else {
            panic!("result parses");
        };
        assert_eq!((result.seq, result.revision, result.fence), (2, 1, Some(4)));
        assert_eq!(result.frames.len(), 1);
        assert_eq!(result.runtime.unwrap().state, json!({"n": 1}));

        let EnvelopedFrame::TurnResult(Err(refused)) = enveloped(json!({
            "type": "turnResult", "clientId": "r-2", "turn": {"seq": 2},
            "frames": [{"type": "text", "data": {"text": 5}}]}))
        else {
            panic!("result refused");
        };
        assert_eq!(refused.error.code, ErrorCode::InvalidMessage);
        assert!(refused.error.message.starts_with("frames: "));
        assert_eq!(refused.client_id.as_deref(), Some("r-2"));
        assert_eq!(refused.frame_type.as_deref(), Some("turnResult"));
    }

    #[test]
    fn lease_mode_requires_the_fence() {
        let text = json!({"conversationId": CONVERSATION, "frame": {
            "type": "turnResult", "turn": {"seq": 2}, "frames": []}})
        .to_string();
        let Ok(AgentFrame::Enveloped {
            frame: EnvelopedFrame::TurnResult(Err(refused)),
            ..
        }) = parse_agent_text(&text, &Limits::default(), true)
        else {
            panic!("refused in lease mode");
        };
        assert_eq!(refused.error.code, ErrorCode::BadRequest);
    }

    #[test]
    fn relayed_and_proactive_frames() {
        assert_eq!(
            enveloped(json!({"type": "typing", "isTyping": true})),
            EnvelopedFrame::Typing { is_typing: true }
        );
        assert_eq!(
            enveloped(json!({"type": "run"})),
            EnvelopedFrame::Run { data: json!({}) }
        );
        assert!(matches!(
            enveloped(json!({"type": "sync", "watermark": -1})),
            EnvelopedFrame::Sync(Err(_))
        ));
        assert!(matches!(
            enveloped(json!({"type": "text", "data": {"text": "hi"}})),
            EnvelopedFrame::Message(Ok(_))
        ));
        let EnvelopedFrame::Message(Err(refused)) =
            enveloped(json!({"type": "text", "clientId": "p-1", "data": {"text": 1}}))
        else {
            panic!("refused");
        };
        assert_eq!(refused.client_id.as_deref(), Some("p-1"));
    }

    #[test]
    fn agent_frames_need_data_only_where_the_type_does() {
        let chunk = json!({"type": "genui", "streamId": "s-14",
                           "chunk": {"type": "text", "content": "he"}, "done": false});
        let EnvelopedFrame::Message(Ok(message)) = enveloped(chunk) else {
            panic!("a mekik-shaped genui chunk is a message");
        };
        assert_eq!(message.data, json!({}));
        assert_eq!(message.extra["streamId"], "s-14");
        assert_eq!(message.extra["done"], false);
        for kind in [
            "tool_call",
            "interrupt",
            "interrupt_resolved",
            "skill",
            "card",
        ] {
            assert!(
                matches!(
                    enveloped(json!({"type": kind, "id": "x"})),
                    EnvelopedFrame::Message(Ok(_))
                ),
                "{kind} without data"
            );
        }
        // A text still needs its text, and data given must still be an object.
        assert!(matches!(
            enveloped(json!({"type": "text"})),
            EnvelopedFrame::Message(Err(_))
        ));
        assert!(matches!(
            enveloped(json!({"type": "genui", "data": "s"})),
            EnvelopedFrame::Message(Err(_))
        ));
        let result = parse(json!({"conversationId": CONVERSATION, "frame": {
            "type": "turnResult", "turn": {"seq": 2},
            "frames": [{"type": "genui", "streamId": "s", "chunk": {}, "done": true}]}}));
        let Ok(AgentFrame::Enveloped {
            frame: EnvelopedFrame::TurnResult(Ok(result)),
            ..
        }) = result
        else {
            panic!("a turnResult of mekik-shaped frames is accepted");
        };
        assert_eq!(result.frames[0].data, json!({}));
    }

    #[test]
    fn nul_characters_are_refused_anywhere() {
        let refused = parse(json!({"type": "ping\u{0}"})).unwrap_err();
        assert_eq!(refused.error.code, ErrorCode::InvalidMessage);
        for frame in [
            json!({"type": "turnResult", "clientId": "r-1", "turn": {"seq": 1}, "frames": [{"type": "text", "data": {"text": "a\u{0}"}}]}),
            json!({"type": "typing", "isTyping": true, "x\u{0}": 1}),
            json!({"type": "text", "data": {"text": "ok"}, "extra": "\u{0}"}),
        ] {
            let EnvelopedFrame::Refused(refused) = enveloped(frame.clone()) else {
                panic!("not refused: {frame}");
            };
            assert_eq!(refused.error.code, ErrorCode::InvalidMessage);
        }
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in ".{0,200}", fence in any::<bool>()) {
            let _ = parse_agent_text(&text, &Limits::default(), fence);
        }

        #[test]
        fn arbitrary_envelopes_never_panic(kind in "[a-zA-Z_]{0,12}", field in "[a-zA-Z]{1,10}", n in any::<i64>(), s in ".{0,20}") {
            let frames = [
                json!({"conversationId": CONVERSATION, "frame": {"type": kind.clone(), field.clone(): n}}),
                json!({"conversationId": CONVERSATION, "frame": {"type": "turnResult", "turn": {"seq": n, "revision": s.clone()}, "frames": [{"type": kind.clone(), "data": {field.clone(): n}}]}}),
                json!({"conversationId": s.clone(), "frame": {}}),
                json!({"type": kind.clone(), field.clone(): s.clone()}),
            ];
            for frame in frames {
                let _ = parse(frame);
            }
        }
    }
}
