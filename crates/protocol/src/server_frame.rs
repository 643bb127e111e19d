//! The frames only the server sends, each built by one type and serialized once (docs/protocol.md
//! §§2, 3 and 7). Welcome frames live in `welcome.rs`, stored frames in `persistent.rs`
//! and agent deliveries in `delivery.rs`.

use serde::Serialize;
use serde_json::{Value, json};

use crate::ErrorCode;
use crate::turn_meta::Participant;

/// An `error` frame (docs/protocol.md §7).
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorFrame {
    /// The code.
    pub code: ErrorCode,
    /// Human-readable reason.
    pub message: String,
    /// The clientId of the refused frame.
    pub client_id: Option<String>,
    /// The type of the refused frame.
    pub frame_type: Option<String>,
    /// Suggested wait before retrying.
    pub retry_after_ms: Option<u64>,
    /// Code-specific details.
    pub details: Option<Value>,
}

impl ErrorFrame {
    /// An error with only a code and a message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ErrorFrame {
        ErrorFrame {
            code,
            message: message.into(),
            client_id: None,
            frame_type: None,
            retry_after_ms: None,
            details: None,
        }
    }

    /// The frame as JSON.
    pub fn to_json(&self) -> Value {
        crate::to_value(self)
    }

    /// The frame as JSON text.
    pub fn encode(&self) -> String {
        crate::encode(self)
    }
}

impl Serialize for ErrorFrame {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Data<'a> {
            code: &'static str,
            message: &'a str,
            number: u16,
            retryable: bool,
            #[serde(skip_serializing_if = "Option::is_none")]
            client_id: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            frame_type: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            retry_after_ms: Option<u64>,
            #[serde(skip_serializing_if = "Option::is_none")]
            details: Option<&'a Value>,
        }
        Typed {
            kind: "error",
            body: DataField {
                data: Data {
                    code: self.code.as_str(),
                    message: &self.message,
                    number: self.code.number(),
                    retryable: self.code.retryable(),
                    client_id: self.client_id.as_deref(),
                    frame_type: self.frame_type.as_deref(),
                    retry_after_ms: self.retry_after_ms,
                    details: self.details.as_ref(),
                },
            },
        }
        .serialize(serializer)
    }
}

/// The JSON reason of closes 1012 and 4503: `{"reason":"unavailable","retryAfterMs":N}`.
pub fn retry_close_reason(code: ErrorCode, retry_after_ms: u64) -> String {
    json!({"reason": code.as_str(), "retryAfterMs": retry_after_ms}).to_string()
}

/// `{type, ...body}`: every server frame is its type next to its own fields.
#[derive(Serialize)]
struct Typed<B: Serialize> {
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(flatten)]
    body: B,
}

/// A body that is only `data`.
#[derive(Serialize)]
struct DataField<D: Serialize> {
    data: D,
}

/// `turn: {seq, revision}` of an ack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TurnNumber {
    /// The turn's seq.
    pub seq: i64,
    /// Its revision.
    pub revision: i32,
}

/// An `ack` (docs/protocol.md §3.3): of a stored frame, of an edit or regenerate, or of a turn
/// result. A resend gets the same ack as the first send, plus `duplicate`.
#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Ack<'a> {
    /// The acked frame's clientId.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_id: Option<&'a str>,
    /// Edits, regenerates and results: the turn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn: Option<TurnNumber>,
    /// The stored frame's id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<&'a str>,
    /// The stored frame's seq.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<i64>,
    /// Results: the stored frames' ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ids: Option<&'a [String]>,
    /// Results: the stored frames' seqs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seqs: Option<&'a [i64]>,
    /// Commit time, milliseconds since the Unix epoch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<i64>,
    /// True when the key was used before and nothing new was stored.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub duplicate: bool,
    /// A `stop`'s answer: whether the turn (`turn`) is stopping now (ADR 0028).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<bool>,
}

impl<'a> Ack<'a> {
    /// The ack of a stored frame.
    pub fn stored(
        client_id: &'a str,
        id: &'a str,
        seq: i64,
        timestamp: i64,
        duplicate: bool,
    ) -> Ack<'a> {
        Ack {
            client_id: Some(client_id),
            id: Some(id),
            seq: Some(seq),
            timestamp: Some(timestamp),
            duplicate,
            ..Ack::default()
        }
    }

    /// The frame as JSON text.
    pub fn encode(&self) -> String {
        crate::encode(&Typed {
            kind: "ack",
            body: self,
        })
    }

    /// The frame as JSON.
    pub fn to_value(&self) -> Value {
        crate::to_value(&Typed {
            kind: "ack",
            body: self,
        })
    }
}

/// A `heartbeat`: the answer to `ping`, and what a silent converger connection receives.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Heartbeat<'a> {
    /// Server time, milliseconds since the Unix epoch.
    pub timestamp: i64,
    /// Conversation scope: the highest seq this connection was sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head_seq: Option<u64>,
    /// The `ping`'s nonce, echoed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nonce: Option<&'a Value>,
}

impl Heartbeat<'_> {
    /// The frame as JSON text.
    pub fn encode(&self) -> String {
        crate::encode(&Typed {
            kind: "heartbeat",
            body: self,
        })
    }
}

/// `tokenRefreshed {data: {expiresAt}}`: an `auth` frame was accepted.
pub fn token_refreshed(expires_at_ms: i64) -> String {
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Data {
        expires_at: i64,
    }
    crate::encode(&Typed {
        kind: "tokenRefreshed",
        body: DataField {
            data: Data {
                expires_at: expires_at_ms,
            },
        },
    })
}

/// `replayTruncated {data: {watermark, headSeq}}`: the replay stopped at `watermark`.
pub fn replay_truncated(watermark: u64, head_seq: u64) -> String {
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Data {
        watermark: u64,
        head_seq: u64,
    }
    crate::encode(&Typed {
        kind: "replayTruncated",
        body: DataField {
            data: Data {
                watermark,
                head_seq,
            },
        },
    })
}

/// `presence`: a participant's first connection opened, or its last one closed.
pub fn presence(participant: Participant<'_>, online: bool, connections: usize) -> Value {
    #[derive(Serialize)]
    struct Data<'a> {
        participant: Participant<'a>,
        status: &'static str,
        connections: usize,
    }
    crate::to_value(&Typed {
        kind: "presence",
        body: DataField {
            data: Data {
                participant,
                status: if online { "online" } else { "offline" },
                connections,
            },
        },
    })
}

/// `deliveryStatus`: `by` has read the conversation up to `up_to_seq`.
pub fn read_receipt(up_to_seq: i64, by: Participant<'_>) -> Value {
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Data<'a> {
        up_to_seq: i64,
        status: &'static str,
        by: Participant<'a>,
    }
    crate::to_value(&Typed {
        kind: "deliveryStatus",
        body: DataField {
            data: Data {
                up_to_seq,
                status: "read",
                by,
            },
        },
    })
}

/// `typing`, from an end user (with `sender`) or relayed from an agent (without).
pub fn typing(is_typing: bool, sender: Option<Participant<'_>>) -> Value {
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Body<'a> {
        is_typing: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        sender: Option<Participant<'a>>,
    }
    crate::to_value(&Typed {
        kind: "typing",
        body: Body { is_typing, sender },
    })
}

/// An agent's `run` status, relayed to end users with its `data`.
pub fn run_status(data: &Value) -> Value {
    crate::to_value(&Typed {
        kind: "run",
        body: DataField { data },
    })
}

/// What end users are told when the gateway refused what an agent sent while answering: the
/// `answer_refused` error, with the refusal's code as `details.reason`, the refused frame's type
/// and, when known, the turn. Without it a user would wait on a turn whose answer never comes.
pub fn answer_refused(reason: ErrorCode, frame_type: &str, turn: Option<TurnNumber>) -> Value {
    let mut details = serde_json::json!({"reason": reason.as_str()});
    if let Some(turn) = turn {
        details["turn"] = serde_json::json!({"seq": turn.seq, "revision": turn.revision});
    }
    ErrorFrame {
        frame_type: Some(frame_type.to_owned()),
        details: Some(details),
        ..ErrorFrame::new(
            ErrorCode::AnswerRefused,
            "the agent's answer could not be accepted",
        )
    }
    .to_json()
}

/// `error` `agent_failed` to end users: every call an HTTP agent group made for their turn
/// failed, and the turn settled as `failed` (ADR 0031); `details.group` names the group.
pub fn agent_failed(group: &str, turn: TurnNumber) -> Value {
    ErrorFrame {
        details: Some(serde_json::json!({
            "group": group,
            "turn": {"seq": turn.seq, "revision": turn.revision},
        })),
        ..ErrorFrame::new(
            ErrorCode::AgentFailed,
            "the agent failed to answer this turn",
        )
    }
    .to_json()
}

/// The turn an [`answer_refused`] or [`agent_failed`] frame names, read back from the frame (a
/// transient that crossed the hub as JSON); `None` for any other frame.
pub fn refused_turn(frame: &serde_json::Value) -> Option<TurnNumber> {
    let data = &frame["data"];
    let code = &data["code"];
    if code != ErrorCode::AnswerRefused.as_str() && code != ErrorCode::AgentFailed.as_str() {
        return None;
    }
    let turn = &data["details"]["turn"];
    Some(TurnNumber {
        seq: turn["seq"].as_i64()?,
        revision: i32::try_from(turn["revision"].as_i64()?).ok()?,
    })
}

/// An agent's `error`, relayed to end users with its `data`.
pub fn relayed_error(data: &Value) -> Value {
    crate::to_value(&Typed {
        kind: "error",
        body: DataField { data },
    })
}

/// Which catalog an agent publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Catalog {
    /// `genui_components {hash, components}`.
    Components,
    /// `skills {hash, skills}`.
    Skills,
}

impl Catalog {
    /// The frame type.
    pub fn kind(self) -> &'static str {
        match self {
            Catalog::Components => "genui_components",
            Catalog::Skills => "skills",
        }
    }

    /// The field that holds the list.
    pub fn list_field(self) -> &'static str {
        match self {
            Catalog::Components => "components",
            Catalog::Skills => "skills",
        }
    }

    /// The catalog as stored: `{hash, <list field>: list}`.
    pub fn stored(self, hash: &Value, list: &Value) -> Value {
        let mut stored = serde_json::Map::new();
        stored.insert("hash".into(), hash.clone());
        stored.insert(self.list_field().into(), list.clone());
        Value::Object(stored)
    }

    /// The frame an end user gets after `welcome`: the list, or `unchanged` when the client
    /// already has the catalog with this hash.
    pub fn frame(self, stored: &Value, client_hash: Option<&str>) -> String {
        let hash = stored.get("hash").unwrap_or(&Value::Null);
        let mut frame = serde_json::Map::new();
        frame.insert("type".into(), Value::from(self.kind()));
        frame.insert("hash".into(), hash.clone());
        if client_hash.is_some() && hash.as_str() == client_hash {
            frame.insert("unchanged".into(), Value::Bool(true));
        } else {
            let list = stored
                .get(self.list_field())
                .cloned()
                .unwrap_or_else(|| Value::Array(Vec::new()));
            frame.insert(self.list_field().into(), list);
        }
        Value::Object(frame).to_string()
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn an_answer_refused_frame_names_its_turn_back() {
        let turn = TurnNumber {
            seq: 7,
            revision: 2,
        };
        let frame = answer_refused(ErrorCode::InvalidMessage, "turnResult", Some(turn));
        assert_eq!(refused_turn(&frame), Some(turn));
        assert_eq!(
            refused_turn(&answer_refused(ErrorCode::InvalidMessage, "x", None)),
            None
        );
        assert_eq!(refused_turn(&serde_json::json!({"type": "typing"})), None);
    }

    use super::*;

    fn decode(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn error_frame_shape() {
        let frame = ErrorFrame {
            client_id: Some("c-1".into()),
            frame_type: Some("text".into()),
            ..ErrorFrame::new(ErrorCode::TooManyInFlight, "slow down")
        }
        .to_json();
        assert_eq!(frame["type"], "error");
        assert_eq!(frame["data"]["code"], "too_many_in_flight");
        assert_eq!(frame["data"]["number"], 3002);
        assert_eq!(frame["data"]["retryable"], true);
        assert_eq!(frame["data"]["clientId"], "c-1");
        assert_eq!(frame["data"]["frameType"], "text");
        assert!(frame["data"].get("details").is_none());
    }

    #[test]
    fn close_reason_is_json() {
        let reason = decode(&retry_close_reason(ErrorCode::Unavailable, 1500));
        assert_eq!(
            reason,
            json!({"reason": "unavailable", "retryAfterMs": 1500})
        );
    }

    #[test]
    fn acks_name_only_what_they_ack() {
        let ack = decode(&Ack::stored("c-1", "f-1", 7, 100, false).encode());
        assert_eq!(
            ack,
            json!({"type": "ack", "clientId": "c-1", "id": "f-1", "seq": 7, "timestamp": 100})
        );
        let ids = vec!["a".to_owned()];
        let result = decode(
            &Ack {
                turn: Some(TurnNumber {
                    seq: 2,
                    revision: 0,
                }),
                ids: Some(&ids),
                seqs: Some(&[3]),
                timestamp: Some(9),
                duplicate: true,
                ..Ack::default()
            }
            .encode(),
        );
        assert_eq!(
            result,
            json!({"type": "ack", "turn": {"seq": 2, "revision": 0}, "ids": ["a"], "seqs": [3],
                   "timestamp": 9, "duplicate": true})
        );
    }

    #[test]
    fn catalogs_say_unchanged_for_a_known_hash() {
        let stored = Catalog::Skills.stored(&json!("h1"), &json!([{"name": "s"}]));
        assert_eq!(
            decode(&Catalog::Skills.frame(&stored, Some("h1"))),
            json!({"type": "skills", "hash": "h1", "unchanged": true})
        );
        assert_eq!(
            decode(&Catalog::Skills.frame(&stored, Some("h0"))),
            json!({"type": "skills", "hash": "h1", "skills": [{"name": "s"}]})
        );
    }

    #[test]
    fn relayed_and_user_typing() {
        assert_eq!(
            typing(true, None),
            json!({"type": "typing", "isTyping": true})
        );
        assert_eq!(
            typing(
                false,
                Some(Participant {
                    id: "u",
                    role: "user"
                })
            ),
            json!({"type": "typing", "isTyping": false, "sender": {"id": "u", "role": "user"}})
        );
    }
}
