//! Typed server frames of a conversation-scope (end-user) connection, docs/protocol.md §3.
//!
//! Parsing never fails: a frame whose type is unknown, or a known frame missing a field the
//! contract requires, is kept whole as [`ServerFrame::Unknown`], since receivers must ignore
//! what they do not understand.

use serde_json::Value;
use uuid::Uuid;

/// A participant: the sender of a frame, a typing user, a reader, a presence subject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Participant {
    /// Participant id (user id, agent id).
    pub id: String,
    /// `user`, `bot`, `agent` or `system`.
    pub role: String,
}

impl Participant {
    fn parse(value: &Value) -> Option<Participant> {
        Some(Participant {
            id: value["id"].as_str()?.to_owned(),
            role: value["role"].as_str()?.to_owned(),
        })
    }
}

/// `welcome.data` of a conversation-scope connection.
#[derive(Debug, Clone, PartialEq)]
pub struct Welcome {
    /// `converger/1` (or `mekik/1`).
    pub protocol: String,
    /// The conversation this connection serves.
    pub conversation_id: Option<Uuid>,
    /// The session's end user.
    pub user_id: Option<String>,
    /// A fresh id for this connection.
    pub connection_id: Option<String>,
    /// The conversation head when the session subscribed.
    pub watermark: i64,
    /// Open interrupts, `{id, data}` each, oldest first.
    pub pending: Vec<Value>,
    /// Token expiry, ms since the epoch.
    pub expires_at: Option<i64>,
    /// The whole `data` object (capabilities, limits, …).
    pub data: Value,
}

impl Welcome {
    /// Reads a `welcome` frame; absent fields get empty values.
    pub fn from_frame(frame: &Value) -> Welcome {
        let data = &frame["data"];
        Welcome {
            protocol: data["protocol"].as_str().unwrap_or_default().to_owned(),
            conversation_id: data["conversationId"]
                .as_str()
                .and_then(|id| id.parse().ok()),
            user_id: data["userId"].as_str().map(str::to_owned),
            connection_id: data["connectionId"].as_str().map(str::to_owned),
            watermark: data["watermark"].as_i64().unwrap_or(0),
            pending: data["pending"].as_array().cloned().unwrap_or_default(),
            expires_at: data["expiresAt"].as_i64(),
            data: data.clone(),
        }
    }

    /// `limits.maxInFlight`, when announced.
    pub fn max_in_flight(&self) -> Option<usize> {
        self.data["limits"]["maxInFlight"]
            .as_u64()
            .and_then(|limit| usize::try_from(limit).ok())
    }
}

/// A persistent message frame: anything the server sends with a `seq`.
#[derive(Debug, Clone, PartialEq)]
pub struct MessageFrame {
    /// The message type (`text`, `event`, `interrupt`, `genui`, …).
    pub kind: String,
    /// Activity id (clients de-duplicate by it or by `seq`).
    pub id: Option<String>,
    /// Position in the conversation.
    pub seq: i64,
    /// `user` for the viewing user's own frames, `bot` for everyone else's.
    pub from: Option<String>,
    /// Who sent it.
    pub sender: Option<Participant>,
    /// The payload.
    pub data: Value,
    /// Commit time, ms since the epoch.
    pub timestamp: Option<i64>,
    /// Present on copies of the viewing user's own frames.
    pub client_id: Option<String>,
    /// The whole frame, for top-level fields such as `actions`, `replaces` or `streamId`.
    pub frame: Value,
}

impl MessageFrame {
    /// `data.text`, for `text` frames.
    pub fn text(&self) -> Option<&str> {
        self.data["text"].as_str()
    }
}

/// A seq and revision naming one turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnRef {
    /// The turn's seq.
    pub seq: i64,
    /// The revision (0 for the original, +1 per edit or regenerate).
    pub revision: i64,
}

/// The answer to a keyed send (`text` and other messages, `edit`, `regenerate`).
#[derive(Debug, Clone, PartialEq)]
pub struct Ack {
    /// The send's clientId.
    pub client_id: Option<String>,
    /// The stored frame's id (absent for `regenerate`).
    pub id: Option<String>,
    /// The stored frame's seq (absent for `regenerate`).
    pub seq: Option<i64>,
    /// Commit time, ms since the epoch.
    pub timestamp: Option<i64>,
    /// The revision opened, for `edit` and `regenerate`.
    pub turn: Option<TurnRef>,
    /// True when an earlier send with the same clientId was already stored.
    pub duplicate: bool,
    /// A `stop`'s answer: whether the turn (`turn`) is stopping now.
    pub stopped: Option<bool>,
}

/// An `error` frame: the server's own, or one an agent relayed.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorFrame {
    /// Error code (section 7 of the contract).
    pub code: String,
    /// Human-readable message.
    pub message: String,
    /// Error number, when sent.
    pub number: Option<i64>,
    /// Whether resending later can succeed.
    pub retryable: bool,
    /// How long to wait before retrying, when the server says.
    pub retry_after_ms: Option<u64>,
    /// The clientId of the refused send, when known.
    pub client_id: Option<String>,
    /// The type of the refused frame, when known.
    pub frame_type: Option<String>,
    /// Code-specific details (`Null` when absent).
    pub details: Value,
}

/// Another participant's typing state (transient).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Typing {
    /// Typing or stopped.
    pub is_typing: bool,
    /// Who types; absent when an agent relayed it.
    pub sender: Option<Participant>,
}

/// A read receipt: a participant's read position moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryStatus {
    /// Everything up to this seq is read.
    pub up_to_seq: i64,
    /// `read`.
    pub status: String,
    /// The reader.
    pub by: Option<Participant>,
}

/// A participant came online or went offline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presence {
    /// Whose presence changed.
    pub participant: Option<Participant>,
    /// `online` or `offline`.
    pub status: String,
    /// Open connections of that participant (on the sending node).
    pub connections: i64,
}

/// An answer to `ping`, or a keepalive after outbound silence.
#[derive(Debug, Clone, PartialEq)]
pub struct Heartbeat {
    /// Server time, ms since the epoch.
    pub timestamp: Option<i64>,
    /// The ping's nonce, echoed.
    pub nonce: Option<Value>,
    /// The highest seq this connection was sent or knowingly skipped.
    pub head_seq: Option<i64>,
}

/// The replay stopped at `replayMax`; the client fetches the rest (done automatically).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayTruncated {
    /// The last seq sent by the replay.
    pub watermark: i64,
    /// The conversation head.
    pub head_seq: i64,
}

/// A channel catalog sent after `welcome` (`genui_components` or `skills`).
#[derive(Debug, Clone, PartialEq)]
pub struct Catalog {
    /// `genui_components` or `skills`.
    pub kind: String,
    /// The catalog's hash.
    pub hash: String,
    /// True when the client's hash matched: no list follows.
    pub unchanged: bool,
    /// The components or skills, when sent.
    pub items: Option<Vec<Value>>,
}

/// Every frame a conversation-scope connection receives.
///
/// ```
/// use converger_client::ServerFrame;
/// use serde_json::json;
///
/// let frame = ServerFrame::parse(json!({"type": "ack", "clientId": "c-1", "id": "a",
///     "seq": 4, "timestamp": 1, "duplicate": true}));
/// let ServerFrame::Ack(ack) = frame else { panic!("an ack") };
/// assert_eq!((ack.seq, ack.duplicate), (Some(4), true));
/// assert!(matches!(ServerFrame::parse(json!({"type": "future"})), ServerFrame::Unknown(_)));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum ServerFrame {
    /// The handshake answer; from `next_frame` it means the client has just reconnected.
    Welcome(Welcome),
    /// A persistent frame (has a `seq`).
    Message(MessageFrame),
    /// The answer to a keyed send.
    Ack(Ack),
    /// A refusal or an agent's relayed error.
    Error(ErrorFrame),
    /// Someone's typing state.
    Typing(Typing),
    /// A read receipt.
    DeliveryStatus(DeliveryStatus),
    /// A participant's presence.
    Presence(Presence),
    /// Keepalive or `ping` answer.
    Heartbeat(Heartbeat),
    /// The replay was capped.
    ReplayTruncated(ReplayTruncated),
    /// The answer to an accepted `auth`.
    TokenRefreshed {
        /// The new expiry, ms since the epoch.
        expires_at: i64,
    },
    /// An agent's run state (transient), `data` verbatim.
    Run {
        /// The agent's data (`status`, …).
        data: Value,
    },
    /// A channel catalog.
    Catalog(Catalog),
    /// A chunk of a streamed answer (transient).
    StreamChunk(crate::streams::StreamChunk),
    /// The end of a streamed answer.
    StreamEnd(crate::streams::StreamEnd),
    /// A frame of a type this client does not know, or one missing required fields.
    Unknown(Value),
}

impl ServerFrame {
    /// Types the server uses for its own frames; a persistent message never has one of these.
    const CONTROL_TYPES: [&'static str; 8] = [
        "welcome",
        "ack",
        "error",
        "heartbeat",
        "replayTruncated",
        "deliveryStatus",
        "presence",
        "tokenRefreshed",
    ];

    /// Reads one server frame; never fails (see [`ServerFrame::Unknown`]).
    pub fn parse(frame: Value) -> ServerFrame {
        match ServerFrame::typed(&frame) {
            Some(typed) => typed,
            None => ServerFrame::Unknown(frame),
        }
    }

    /// The `seq` of a persistent frame.
    pub fn seq(&self) -> Option<i64> {
        match self {
            ServerFrame::Message(message) => Some(message.seq),
            _ => None,
        }
    }

    fn typed(frame: &Value) -> Option<ServerFrame> {
        let kind = frame["type"].as_str()?;
        let is_control = ServerFrame::CONTROL_TYPES.contains(&kind);
        // Agents may persist any non-control type (even `typing` or `skills`), so `seq` decides.
        if !is_control && frame.get("seq").is_some() {
            return message(kind, frame).map(ServerFrame::Message);
        }
        let data = &frame["data"];
        let typed = match kind {
            "welcome" if data.is_object() => ServerFrame::Welcome(Welcome::from_frame(frame)),
            "ack" => ServerFrame::Ack(ack(frame)?),
            "error" => ServerFrame::Error(error(data)?),
            "heartbeat" => ServerFrame::Heartbeat(Heartbeat {
                timestamp: frame["timestamp"].as_i64(),
                nonce: frame.get("nonce").cloned(),
                head_seq: frame["headSeq"].as_i64(),
            }),
            "replayTruncated" => ServerFrame::ReplayTruncated(ReplayTruncated {
                watermark: data["watermark"].as_i64()?,
                head_seq: data["headSeq"].as_i64()?,
            }),
            "deliveryStatus" => ServerFrame::DeliveryStatus(DeliveryStatus {
                up_to_seq: data["upToSeq"].as_i64()?,
                status: data["status"].as_str().unwrap_or("read").to_owned(),
                by: Participant::parse(&data["by"]),
            }),
            "presence" => ServerFrame::Presence(Presence {
                participant: Participant::parse(&data["participant"]),
                status: data["status"].as_str()?.to_owned(),
                connections: data["connections"].as_i64().unwrap_or(0),
            }),
            "streamChunk" => ServerFrame::StreamChunk(crate::streams::parse_chunk(frame)?),
            "streamEnd" => ServerFrame::StreamEnd(crate::streams::parse_end(frame)?),
            "tokenRefreshed" => ServerFrame::TokenRefreshed {
                expires_at: data["expiresAt"].as_i64()?,
            },
            "typing" => ServerFrame::Typing(Typing {
                is_typing: frame["isTyping"].as_bool()?,
                sender: Participant::parse(&frame["sender"]),
            }),
            "run" => ServerFrame::Run { data: data.clone() },
            "genui_components" => ServerFrame::Catalog(catalog(kind, "components", frame)?),
            "skills" => ServerFrame::Catalog(catalog(kind, "skills", frame)?),
            _ => return None,
        };
        Some(typed)
    }
}

fn message(kind: &str, frame: &Value) -> Option<MessageFrame> {
    Some(MessageFrame {
        kind: kind.to_owned(),
        id: frame["id"].as_str().map(str::to_owned),
        seq: frame["seq"].as_i64()?,
        from: frame["from"].as_str().map(str::to_owned),
        sender: Participant::parse(&frame["sender"]),
        data: frame["data"].clone(),
        timestamp: frame["timestamp"].as_i64(),
        client_id: frame["clientId"].as_str().map(str::to_owned),
        frame: frame.clone(),
    })
}

fn ack(frame: &Value) -> Option<Ack> {
    let turn = &frame["turn"];
    let turn = turn["seq"].as_i64().map(|seq| TurnRef {
        seq,
        revision: turn["revision"].as_i64().unwrap_or(0),
    });
    let seq = frame["seq"].as_i64();
    let stopped = frame["stopped"].as_bool();
    // An ack answers a stored frame (seq), a regenerate (turn) or a stop (stopped); none of
    // them is no ack.
    if seq.is_none() && turn.is_none() && stopped.is_none() {
        return None;
    }
    Some(Ack {
        client_id: frame["clientId"].as_str().map(str::to_owned),
        id: frame["id"].as_str().map(str::to_owned),
        seq,
        timestamp: frame["timestamp"].as_i64(),
        turn,
        duplicate: frame["duplicate"] == true,
        stopped,
    })
}

/// Reads an error frame's `data`; shared with the agent side.
pub(crate) fn error(data: &Value) -> Option<ErrorFrame> {
    Some(ErrorFrame {
        code: data["code"].as_str()?.to_owned(),
        message: data["message"].as_str().unwrap_or_default().to_owned(),
        number: data["number"].as_i64(),
        retryable: data["retryable"] == true,
        retry_after_ms: data["retryAfterMs"].as_u64(),
        client_id: data["clientId"].as_str().map(str::to_owned),
        frame_type: data["frameType"].as_str().map(str::to_owned),
        details: data["details"].clone(),
    })
}

fn catalog(kind: &str, list_field: &str, frame: &Value) -> Option<Catalog> {
    Some(Catalog {
        kind: kind.to_owned(),
        hash: frame["hash"].as_str()?.to_owned(),
        unchanged: frame["unchanged"] == true,
        items: frame[list_field].as_array().cloned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_welcome_is_read_with_its_data() {
        let frame = json!({"type": "welcome", "data": {"protocol": "converger/1",
            "compat": ["mekik/1"], "scope": "conversation",
            "conversationId": "0193e0a4-0000-7000-8000-000000000001", "userId": "alice",
            "connectionId": "6f1c", "watermark": 17, "pending": [{"id": "int-2", "data": {}}],
            "expiresAt": 1_767_225_600_000_i64, "capabilities": {"acks": true},
            "limits": {"maxInFlight": 32, "idleTimeoutMs": 60000}}});
        let ServerFrame::Welcome(welcome) = ServerFrame::parse(frame) else {
            panic!("a welcome");
        };
        assert_eq!(
            welcome.conversation_id,
            Some("0193e0a4-0000-7000-8000-000000000001".parse().unwrap())
        );
        assert_eq!(welcome.user_id.as_deref(), Some("alice"));
        assert_eq!(welcome.watermark, 17);
        assert_eq!(welcome.pending.len(), 1);
        assert_eq!(welcome.expires_at, Some(1_767_225_600_000));
        assert_eq!(welcome.max_in_flight(), Some(32));
    }

    #[test]
    fn a_persistent_frame_of_any_type_is_a_message() {
        let frame = json!({"type": "text", "id": "0193e0a5", "seq": 18, "from": "bot",
            "sender": {"id": "agent", "role": "agent"}, "data": {"text": "Hi"},
            "timestamp": 1_767_222_000_123_i64, "actions": [{"label": "ok"}]});
        let ServerFrame::Message(message) = ServerFrame::parse(frame.clone()) else {
            panic!("a message");
        };
        assert_eq!(message.kind, "text");
        assert_eq!(message.seq, 18);
        assert_eq!(message.text(), Some("Hi"));
        assert_eq!(message.from.as_deref(), Some("bot"));
        assert_eq!(
            message.sender,
            Some(Participant {
                id: "agent".into(),
                role: "agent".into()
            })
        );
        assert_eq!(message.client_id, None);
        assert_eq!(message.frame["actions"][0]["label"], "ok");

        // A stored frame whose type is also a transient type stays a message: seq decides.
        let stored_typing = json!({"type": "typing", "id": "x", "seq": 3, "data": {}});
        assert_eq!(ServerFrame::parse(stored_typing).seq(), Some(3));
        let custom = json!({"type": "tool_call", "id": "y", "seq": 4, "data": {"name": "f"}});
        assert!(
            matches!(ServerFrame::parse(custom), ServerFrame::Message(m) if m.kind == "tool_call")
        );
    }

    #[test]
    fn acks_of_sends_edits_and_regenerates() {
        let send = json!({"type": "ack", "clientId": "c-17", "id": "a", "seq": 18,
            "timestamp": 5});
        assert_eq!(
            ServerFrame::parse(send),
            ServerFrame::Ack(Ack {
                client_id: Some("c-17".into()),
                id: Some("a".into()),
                seq: Some(18),
                timestamp: Some(5),
                turn: None,
                duplicate: false,
                stopped: None,
            })
        );
        let regenerate = json!({"type": "ack", "clientId": "g-1",
            "turn": {"seq": 18, "revision": 2}, "duplicate": true});
        let ServerFrame::Ack(ack) = ServerFrame::parse(regenerate) else {
            panic!("an ack");
        };
        assert_eq!(
            ack.turn,
            Some(TurnRef {
                seq: 18,
                revision: 2
            })
        );
        assert_eq!((ack.seq, ack.duplicate), (None, true));
        let hollow = json!({"type": "ack", "clientId": "c"});
        assert!(matches!(
            ServerFrame::parse(hollow),
            ServerFrame::Unknown(_)
        ));
        // A stop with nothing running: no seq, no turn.
        let stop = json!({"type": "ack", "clientId": "s-1", "stopped": false});
        let ServerFrame::Ack(ack) = ServerFrame::parse(stop) else {
            panic!("an ack");
        };
        assert_eq!((ack.stopped, ack.turn), (Some(false), None));
    }

    #[test]
    fn errors_keep_retry_hints_and_the_refused_send() {
        let frame = json!({"type": "error", "data": {"code": "too_many_in_flight",
            "message": "slow down", "number": 3002, "retryable": true, "retryAfterMs": 100,
            "clientId": "c-9", "frameType": "text"}});
        let ServerFrame::Error(error) = ServerFrame::parse(frame) else {
            panic!("an error");
        };
        assert_eq!(error.code, "too_many_in_flight");
        assert_eq!(error.number, Some(3002));
        assert!(error.retryable);
        assert_eq!(error.retry_after_ms, Some(100));
        assert_eq!(error.client_id.as_deref(), Some("c-9"));
        assert_eq!(error.frame_type.as_deref(), Some("text"));
        assert_eq!(error.details, Value::Null);

        // An agent's relayed error may carry only a code.
        let relayed = json!({"type": "error", "data": {"code": "busy"}});
        let ServerFrame::Error(error) = ServerFrame::parse(relayed) else {
            panic!("an error");
        };
        assert_eq!((error.retryable, error.message.as_str()), (false, ""));
    }

    #[test]
    fn transient_frames_are_typed() {
        let cases = [
            (
                json!({"type": "typing", "isTyping": true, "sender": {"id": "bob", "role": "user"}}),
                ServerFrame::Typing(Typing {
                    is_typing: true,
                    sender: Some(Participant {
                        id: "bob".into(),
                        role: "user".into(),
                    }),
                }),
            ),
            (
                json!({"type": "deliveryStatus", "data": {"upToSeq": 3, "status": "read",
                    "by": {"id": "alice", "role": "user"}}}),
                ServerFrame::DeliveryStatus(DeliveryStatus {
                    up_to_seq: 3,
                    status: "read".into(),
                    by: Some(Participant {
                        id: "alice".into(),
                        role: "user".into(),
                    }),
                }),
            ),
            (
                json!({"type": "presence", "data": {"participant": {"id": "alice", "role": "user"},
                    "status": "online", "connections": 1}}),
                ServerFrame::Presence(Presence {
                    participant: Some(Participant {
                        id: "alice".into(),
                        role: "user".into(),
                    }),
                    status: "online".into(),
                    connections: 1,
                }),
            ),
            (
                json!({"type": "heartbeat", "timestamp": 9, "nonce": {"n": 1}, "headSeq": 4}),
                ServerFrame::Heartbeat(Heartbeat {
                    timestamp: Some(9),
                    nonce: Some(json!({"n": 1})),
                    head_seq: Some(4),
                }),
            ),
            (
                json!({"type": "replayTruncated", "data": {"watermark": 1000, "headSeq": 1500}}),
                ServerFrame::ReplayTruncated(ReplayTruncated {
                    watermark: 1000,
                    head_seq: 1500,
                }),
            ),
            (
                json!({"type": "tokenRefreshed", "data": {"expiresAt": 77}}),
                ServerFrame::TokenRefreshed { expires_at: 77 },
            ),
            (
                json!({"type": "run", "data": {"status": "thinking"}}),
                ServerFrame::Run {
                    data: json!({"status": "thinking"}),
                },
            ),
            (
                json!({"type": "skills", "hash": "s1", "unchanged": true}),
                ServerFrame::Catalog(Catalog {
                    kind: "skills".into(),
                    hash: "s1".into(),
                    unchanged: true,
                    items: None,
                }),
            ),
            (
                json!({"type": "genui_components", "hash": "h1", "components": [{"n": 1}]}),
                ServerFrame::Catalog(Catalog {
                    kind: "genui_components".into(),
                    hash: "h1".into(),
                    unchanged: false,
                    items: Some(vec![json!({"n": 1})]),
                }),
            ),
        ];
        for (raw, expected) in cases {
            assert_eq!(ServerFrame::parse(raw.clone()), expected, "{raw}");
        }
    }

    #[test]
    fn unknown_and_malformed_frames_are_kept_raw() {
        let raws = [
            json!({"type": "conversationUpdate", "data": {}}),
            json!({"type": "somethingNew", "x": 1}),
            json!({"no": "type"}),
            json!({"type": "typing", "isTyping": "yes"}),
            json!({"type": "error", "data": {}}),
            json!({"type": "replayTruncated", "data": {"watermark": 1}}),
            json!({"type": "text", "seq": "eighteen", "data": {}}),
            json!([1, 2]),
        ];
        for raw in raws {
            assert_eq!(
                ServerFrame::parse(raw.clone()),
                ServerFrame::Unknown(raw.clone())
            );
        }
    }
}
