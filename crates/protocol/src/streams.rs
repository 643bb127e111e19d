//! Streamed answers on the wire (docs/protocol.md §4.9, ADR 0019): the agent's `streamChunk`
//! and `streamAbort`, and what end users receive of them, `streamChunk` / `streamEnd` in the
//! converger profile and `genui {streamId, chunk, done}` in the mekik profile.

use std::ops::RangeInclusive;

use serde_json::{Map, Value, json};

use crate::frame::FrameError;
use crate::{ErrorCode, Limits, Profile, Refusal};

/// What one chunk carries.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamContent {
    /// `text`: a text delta appended to the streamed bubble.
    Text(String),
    /// `chunk`: a generative-UI chunk object, shown as the mekik `genui` chunk it is.
    Chunk(Value),
}

impl StreamContent {
    /// Bytes this content counts against `maxStreamBytes`.
    pub fn size(&self) -> usize {
        match self {
            StreamContent::Text(text) => text.len(),
            StreamContent::Chunk(chunk) => chunk.to_string().len(),
        }
    }
}

/// The turn a stream's first chunk names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamTurnRef {
    /// `turn.seq`.
    pub seq: i64,
    /// `turn.revision` (0 when absent).
    pub revision: i32,
    /// `turn.fence` (lease mode).
    pub fence: Option<i64>,
}

/// A parsed `streamChunk`.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamChunk {
    /// The stream's id (clientId shape), unique within the conversation.
    pub stream_id: String,
    /// Position in the stream, from 0.
    pub index: u64,
    /// The turn answered: required on index 0, ignored after.
    pub turn: Option<StreamTurnRef>,
    /// The delta.
    pub content: StreamContent,
}

/// A parsed `streamAbort`.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamAbort {
    /// The stream ended.
    pub stream_id: String,
    /// Why, for the UI (at most 64 characters kept).
    pub reason: String,
}

/// Parses an enveloped `streamChunk` frame.
pub(crate) fn parse_stream_chunk(
    frame: &Map<String, Value>,
    limits: &Limits,
) -> Result<StreamChunk, Refusal> {
    let stream_id = stream_id(frame, "streamChunk")?;
    let refuse = |code: ErrorCode, message: &str| refusal(code, message, "streamChunk");
    let index = frame.get("index").and_then(Value::as_u64).ok_or_else(|| {
        refuse(
            ErrorCode::InvalidMessage,
            "index must be a non-negative integer",
        )
    })?;
    let turn = match frame.get("turn") {
        None | Some(Value::Null) => None,
        Some(Value::Object(turn)) => {
            Some(parse_turn(turn).map_err(|message| refuse(ErrorCode::InvalidMessage, message))?)
        }
        Some(_) => return Err(refuse(ErrorCode::InvalidMessage, "turn must be an object")),
    };
    let content = match (frame.get("text"), frame.get("chunk")) {
        (Some(Value::String(text)), None) => StreamContent::Text(text.clone()),
        (None, Some(chunk @ Value::Object(_))) => StreamContent::Chunk(chunk.clone()),
        _ => {
            return Err(refuse(
                ErrorCode::InvalidMessage,
                "a chunk carries either text (a string) or chunk (an object)",
            ));
        }
    };
    if content.size() > limits.max_frame_bytes {
        return Err(refuse(ErrorCode::PayloadTooLarge, "the chunk is too large"));
    }
    Ok(StreamChunk {
        stream_id,
        index,
        turn,
        content,
    })
}

/// Parses an enveloped `streamAbort` frame.
pub(crate) fn parse_stream_abort(frame: &Map<String, Value>) -> Result<StreamAbort, Refusal> {
    let stream_id = stream_id(frame, "streamAbort")?;
    let reason = frame
        .get("reason")
        .and_then(Value::as_str)
        .unwrap_or("agent")
        .chars()
        .take(64)
        .collect();
    Ok(StreamAbort { stream_id, reason })
}

fn stream_id(frame: &Map<String, Value>, frame_type: &str) -> Result<String, Refusal> {
    frame
        .get("streamId")
        .and_then(Value::as_str)
        .filter(|id| crate::is_valid_client_id(id))
        .map(str::to_owned)
        .ok_or_else(|| {
            refusal(
                ErrorCode::InvalidMessage,
                "streamId must be 1 to 128 characters of [A-Za-z0-9._:~-]",
                frame_type,
            )
        })
}

/// Reads a turn key `{seq, revision?, fence?}` (of a stream's first chunk or a `turnResult`).
pub(crate) fn parse_turn(turn: &Map<String, Value>) -> Result<StreamTurnRef, &'static str> {
    let seq = turn
        .get("seq")
        .and_then(Value::as_i64)
        .filter(|seq| *seq > 0)
        .ok_or("turn.seq must be a positive integer")?;
    let revision = match turn.get("revision") {
        None | Some(Value::Null) => 0,
        Some(value) => value
            .as_i64()
            .and_then(|revision| i32::try_from(revision).ok())
            .filter(|revision| *revision >= 0)
            .ok_or("turn.revision must be a non-negative integer")?,
    };
    let fence = match turn.get("fence") {
        None | Some(Value::Null) => None,
        Some(value) => Some(
            value
                .as_i64()
                .filter(|fence| *fence >= 0)
                .ok_or("turn.fence must be a non-negative integer")?,
        ),
    };
    Ok(StreamTurnRef {
        seq,
        revision,
        fence,
    })
}

fn refusal(code: ErrorCode, message: &str, frame_type: &str) -> Refusal {
    Refusal {
        error: FrameError {
            code,
            message: message.to_owned(),
        },
        client_id: None,
        frame_type: Some(frame_type.to_owned()),
    }
}

/// A chunk as an end user of `profile` receives it, encoded. `from` is the writing agent's
/// `{id, role}`. It is written straight to text (no `Value` tree): a chunk is rendered once per
/// profile and node, but every chunk of every stream is.
///
/// `indices` is the chunk's index, or for a coalesced chunk (a connection catching up with an
/// open stream) the range whose texts it joins, which the converger profile names with
/// `firstIndex`.
pub fn end_user_chunk(
    profile: Profile,
    stream_id: &str,
    indices: RangeInclusive<u64>,
    seq: i64,
    revision: i32,
    content: &StreamContent,
    from: &Value,
) -> String {
    let (first_index, index) = indices.into_inner();
    let encoded = match profile {
        Profile::Converger => {
            let (text, chunk) = match content {
                StreamContent::Text(text) => (Some(text.as_str()), None),
                StreamContent::Chunk(chunk) => (None, Some(chunk)),
            };
            serde_json::to_string(&ConvergerChunk {
                kind: "streamChunk",
                stream_id,
                first_index: (first_index < index).then_some(first_index),
                index,
                turn: ChunkTurn { seq, revision },
                from,
                text,
                chunk,
            })
        }
        Profile::Mekik => {
            let chunk = match content {
                StreamContent::Text(text) => MekikChunkBody::Text {
                    kind: "text",
                    content: text,
                    id: stream_id,
                },
                StreamContent::Chunk(chunk) => MekikChunkBody::Chunk(chunk),
            };
            serde_json::to_string(&MekikChunk {
                kind: "genui",
                stream_id,
                seq: crate::mekik::chunk_seq(seq, index + 1),
                chunk,
                done: false,
            })
        }
    };
    // Strings, numbers and a `Value` (whose map keys are strings) always encode.
    encoded.unwrap_or_default()
}

#[derive(serde::Serialize)]
struct ConvergerChunk<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(rename = "streamId")]
    stream_id: &'a str,
    #[serde(rename = "firstIndex", skip_serializing_if = "Option::is_none")]
    first_index: Option<u64>,
    index: u64,
    turn: ChunkTurn,
    from: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chunk: Option<&'a Value>,
}

#[derive(serde::Serialize)]
struct ChunkTurn {
    seq: i64,
    revision: i32,
}

#[derive(serde::Serialize)]
struct MekikChunk<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(rename = "streamId")]
    stream_id: &'a str,
    /// The widget's watermark after this chunk: how much of the stream it shows (`mekik.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    seq: Option<f64>,
    chunk: MekikChunkBody<'a>,
    done: bool,
}

#[derive(serde::Serialize)]
#[serde(untagged)]
enum MekikChunkBody<'a> {
    Text {
        #[serde(rename = "type")]
        kind: &'static str,
        content: &'a str,
        id: &'a str,
    },
    Chunk(&'a Value),
}

/// The end of a stream as an end user of `profile` receives it: `committed` when the stored
/// answer follows (or came already), otherwise `aborted` with its reason.
pub fn end_user_stream_end(profile: Profile, stream_id: &str, aborted: Option<&str>) -> Value {
    let status = if aborted.is_some() {
        "aborted"
    } else {
        "committed"
    };
    match profile {
        Profile::Converger => {
            let mut frame = json!({"type": "streamEnd", "streamId": stream_id, "status": status});
            if let Some(reason) = aborted {
                frame["reason"] = json!(reason);
            }
            frame
        }
        Profile::Mekik => {
            // An abort appends its notice to the bubble (the widget reads no status), so the
            // partial text does not pass for the answer.
            let content = aborted.map_or("", crate::mekik::abort_notice);
            let mut frame = json!({
                "type": "genui",
                "streamId": stream_id,
                "chunk": {"type": "text", "content": content, "id": stream_id},
                "done": true,
            });
            if let Some(reason) = aborted {
                frame["status"] = json!(status);
                frame["reason"] = json!(reason);
            }
            frame
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunk of stream `s` by the agent `bot`, as an end user of `profile` receives it.
    fn chunk_value(
        profile: Profile,
        indices: RangeInclusive<u64>,
        seq: i64,
        revision: i32,
        content: &StreamContent,
    ) -> Value {
        let from = json!({"id": "bot", "role": "agent"});
        let encoded = end_user_chunk(profile, "s", indices, seq, revision, content, &from);
        serde_json::from_str(&encoded).unwrap()
    }

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(object) => object,
            _ => unreachable!("test frames are objects"),
        }
    }

    #[test]
    fn chunks_parse() {
        let chunk = parse_stream_chunk(
            &object(json!({"type": "streamChunk", "streamId": "s-1", "index": 0,
                           "turn": {"seq": 4, "fence": 2}, "text": "Hel"})),
            &Limits::default(),
        )
        .unwrap();
        assert_eq!(chunk.stream_id, "s-1");
        assert_eq!(
            chunk.turn,
            Some(StreamTurnRef {
                seq: 4,
                revision: 0,
                fence: Some(2)
            })
        );
        assert_eq!(chunk.content, StreamContent::Text("Hel".into()));
        let genui = parse_stream_chunk(
            &object(json!({"streamId": "s-1", "index": 3, "chunk": {"type": "card"}})),
            &Limits::default(),
        )
        .unwrap();
        assert_eq!(genui.turn, None);
        assert!(matches!(genui.content, StreamContent::Chunk(_)));
    }

    #[test]
    fn bad_chunks_are_refused() {
        for frame in [
            json!({"index": 0, "text": "a"}),
            json!({"streamId": "has space", "index": 0, "text": "a"}),
            json!({"streamId": "s", "index": -1, "text": "a"}),
            json!({"streamId": "s", "index": 0}),
            json!({"streamId": "s", "index": 0, "text": "a", "chunk": {}}),
            json!({"streamId": "s", "index": 0, "chunk": "a"}),
            json!({"streamId": "s", "index": 0, "text": "a", "turn": {"seq": 0}}),
            json!({"streamId": "s", "index": 0, "text": "a", "turn": 3}),
        ] {
            let refused = parse_stream_chunk(&object(frame.clone()), &Limits::default());
            let refused = refused.expect_err(&frame.to_string());
            assert_eq!(refused.error.code, ErrorCode::InvalidMessage, "{frame}");
            assert_eq!(refused.frame_type.as_deref(), Some("streamChunk"));
        }
        let limits = Limits {
            max_frame_bytes: 4,
            ..Limits::default()
        };
        let refused = parse_stream_chunk(
            &object(json!({"streamId": "s", "index": 0, "text": "12345"})),
            &limits,
        )
        .unwrap_err();
        assert_eq!(refused.error.code, ErrorCode::PayloadTooLarge);
    }

    #[test]
    fn aborts_keep_a_short_reason() {
        let abort =
            parse_stream_abort(&object(json!({"streamId": "s", "reason": "x".repeat(100)})))
                .unwrap();
        assert_eq!(abort.reason.len(), 64);
        let abort = parse_stream_abort(&object(json!({"streamId": "s"}))).unwrap();
        assert_eq!(abort.reason, "agent");
        assert!(parse_stream_abort(&object(json!({}))).is_err());
    }

    #[test]
    fn end_users_see_their_profile_shape() {
        let from = json!({"id": "bot", "role": "agent"});
        let text = StreamContent::Text("he".into());
        let encoded = |profile| -> Value { chunk_value(profile, 2..=2, 5, 1, &text) };
        let converger = encoded(Profile::Converger);
        assert_eq!(converger["index"], 2);
        assert_eq!(
            converger.get("firstIndex"),
            None,
            "one chunk names no range"
        );
        assert_eq!(converger["from"], from);
        assert_eq!(converger.get("chunk"), None);
        assert_eq!(converger["type"], "streamChunk");
        assert_eq!(converger["turn"], json!({"seq": 5, "revision": 1}));
        assert_eq!(converger["text"], "he");
        let mekik = encoded(Profile::Mekik);
        assert_eq!(
            mekik,
            json!({"type": "genui", "streamId": "s", "done": false,
                   "seq": 5.0 + 3.0 / 1_048_576.0,
                   "chunk": {"type": "text", "content": "he", "id": "s"}})
        );
        assert_eq!(
            end_user_stream_end(Profile::Converger, "s", Some("agent")),
            json!({"type": "streamEnd", "streamId": "s", "status": "aborted", "reason": "agent"})
        );
        assert_eq!(end_user_stream_end(Profile::Mekik, "s", None)["done"], true);
        assert_eq!(
            end_user_stream_end(Profile::Mekik, "s", Some("agent"))["chunk"]["content"],
            crate::mekik::ABORT_NOTICE,
            "an abort is shown as one, not as a finished answer"
        );
        let card = json!({"type": "card", "title": "x"});
        let ui = StreamContent::Chunk(card.clone());
        let converger: Value = chunk_value(Profile::Converger, 0..=0, 5, 0, &ui);
        assert_eq!(
            (converger["chunk"].clone(), converger.get("text")),
            (card.clone(), None)
        );
        let mekik: Value = chunk_value(Profile::Mekik, 0..=0, 5, 0, &ui);
        assert_eq!(mekik["chunk"], card);
    }

    #[test]
    fn a_coalesced_chunk_names_the_range_it_covers_for_the_converger_profile() {
        let text = StreamContent::Text("hello world".into());
        let converger: Value = chunk_value(Profile::Converger, 0..=3, 5, 0, &text);
        assert_eq!(
            (converger["firstIndex"].clone(), converger["index"].clone()),
            (json!(0), json!(3))
        );
        let mekik: Value = chunk_value(Profile::Mekik, 0..=3, 5, 0, &text);
        assert_eq!(mekik["chunk"]["content"], "hello world");
    }
}
