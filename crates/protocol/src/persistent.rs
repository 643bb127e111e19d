//! A stored frame as clients see it (docs/protocol.md §3.1): the same bytes for live delivery,
//! replay and REST, whoever renders it.
//!
//! The server-owned fields (`type`, `id`, `seq`, `from`, `sender`, `data`, `timestamp`,
//! `metadata`, `clientId`, `meta`) always win over any top-level field the sender stored with
//! the frame, so a client can never forge them.

use std::borrow::Cow;

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{Map, Value};

use crate::turn_meta::{Participant, TurnMeta};

/// Whose view a frame is rendered for, which decides `from` and `clientId`.
#[derive(Debug, Clone, Copy)]
pub enum Viewer<'a> {
    /// The conversation's end user (any of its connections, or REST).
    EndUser {
        /// The viewing user's id.
        user_id: &'a str,
    },
    /// An agent or observer: `from` is relative to the conversation's end user.
    Agent,
}

/// The role of the end user in `sender.role`.
pub const USER_ROLE: &str = "user";

/// The type of the frame a close or a reopen appends (docs/protocol.md §3.8).
pub const CONVERSATION_UPDATE: &str = "conversationUpdate";

/// Top-level names the server writes itself; stored extra fields never override them.
const SERVER_FIELDS: &[&str] = &[
    "type",
    "id",
    "seq",
    "from",
    "sender",
    "data",
    "timestamp",
    "metadata",
    "clientId",
    "meta",
];

/// The parts of a stored frame a client sees, borrowed from wherever it is kept.
#[derive(Debug, Clone, Copy)]
pub struct PersistentFrame<'a> {
    /// `type`.
    pub kind: &'a str,
    /// `id`.
    pub id: &'a str,
    /// `seq`.
    pub seq: i64,
    /// `sender.id`.
    pub sender_id: &'a str,
    /// `sender.role` (`user`, `bot`, `agent`, `system`).
    pub sender_role: &'a str,
    /// `data`.
    pub data: &'a Value,
    /// `metadata`, when stored.
    pub metadata: Option<&'a Value>,
    /// Other top-level fields, as the sender gave them.
    pub extra: Option<&'a Map<String, Value>>,
    /// The author's idempotency key.
    pub client_id: Option<&'a str>,
    /// Commit time in milliseconds since the Unix epoch.
    pub timestamp_ms: i64,
}

impl<'a> PersistentFrame<'a> {
    /// The frame as `viewer` sees it.
    pub fn view(self, viewer: Viewer<'a>) -> RenderedFrame<'a> {
        RenderedFrame {
            frame: self,
            viewer,
            meta: None,
            mekik: false,
        }
    }

    /// The stream an agent's stored text answer replaced (its `streamId`), when it is one.
    pub fn answered_stream(&self) -> Option<&'a str> {
        if self.kind != "text" || self.sender_role == USER_ROLE {
            return None;
        }
        self.extra?.get("streamId")?.as_str()
    }

    /// Whether the mekik profile shows this frame otherwise than the converger profile (a
    /// streamed answer, a close or reopen); every other frame is the same bytes in both.
    pub fn shown_apart_to_mekik(&self) -> bool {
        self.mekik_notice().is_some() || self.answered_stream().is_some()
    }

    /// The text the mekik profile shows for a frame that has none of its own to show: a close
    /// or reopen, or a stopped turn settled before any text (the widget shows no empty bubble).
    fn mekik_notice(&self) -> Option<&'static str> {
        if self.kind == CONVERSATION_UPDATE {
            return Some(crate::mekik::conversation_update_notice(self.data));
        }
        let stopped_empty = self.sender_role == "system"
            && self.data.get("status").and_then(Value::as_str) == Some("stopped")
            && self.data.get("text").and_then(Value::as_str) == Some("");
        stopped_empty.then_some(crate::mekik::STOPPED_NOTICE)
    }

    fn written_by_user(&self, user_id: &str) -> bool {
        self.sender_role == USER_ROLE && self.sender_id == user_id
    }
}

/// A stored frame rendered for one viewer, optionally with a delivery's `meta`.
#[derive(Debug, Clone, Copy)]
pub struct RenderedFrame<'a> {
    frame: PersistentFrame<'a>,
    viewer: Viewer<'a>,
    meta: Option<&'a TurnMeta<'a>>,
    /// Shown as the mekik profile shows it to the chativa widget (`mekik.rs`).
    mekik: bool,
}

impl<'a> RenderedFrame<'a> {
    /// The same frame carrying a delivered turn's `meta` (channel scope).
    pub fn with_meta(self, meta: &'a TurnMeta<'a>) -> RenderedFrame<'a> {
        RenderedFrame {
            meta: Some(meta),
            ..self
        }
    }

    /// The frame as the mekik profile shows it: a streamed answer under its stream's bubble id,
    /// a `conversationUpdate` as a text notice (docs/protocol.md §3.7).
    pub fn for_mekik(self) -> RenderedFrame<'a> {
        RenderedFrame {
            mekik: true,
            ..self
        }
    }

    /// The id shown: a streamed text answer's, in the mekik profile, is its stream's bubble.
    fn shown_id(&self) -> Cow<'a, str> {
        match self.frame.answered_stream() {
            Some(stream_id) if self.mekik => Cow::Owned(crate::mekik::stream_bubble_id(stream_id)),
            _ => Cow::Borrowed(self.frame.id),
        }
    }

    /// A frame with a notice ([`PersistentFrame::mekik_notice`]) shown to the mekik profile as
    /// text: its data with `text` set to the notice.
    fn mekik_notice(&self) -> Option<Value> {
        if !self.mekik {
            return None;
        }
        let notice = self.frame.mekik_notice()?;
        let mut data = match self.frame.data {
            Value::Object(fields) => fields.clone(),
            _ => Map::new(),
        };
        data.insert("text".into(), Value::from(notice));
        Some(Value::Object(data))
    }

    /// `from`: `user` for the conversation's end user's own frames, else `bot`.
    fn from(&self) -> &'static str {
        let from_user = match self.viewer {
            Viewer::EndUser { user_id } => self.frame.written_by_user(user_id),
            Viewer::Agent => self.frame.sender_role == USER_ROLE,
        };
        if from_user { "user" } else { "bot" }
    }

    /// `clientId` goes back to its author only (the author's other connections, or REST).
    fn client_id(&self) -> Option<&'a str> {
        match self.viewer {
            Viewer::EndUser { user_id } if self.frame.sender_id == user_id => self.frame.client_id,
            _ => None,
        }
    }

    /// The frame as JSON text.
    pub fn encode(&self) -> String {
        crate::encode(self)
    }

    /// The frame as a JSON value.
    pub fn to_value(&self) -> Value {
        crate::to_value(self)
    }
}

impl Serialize for RenderedFrame<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let frame = &self.frame;
        let mut map = serializer.serialize_map(None)?;
        if let Some(extra) = frame.extra {
            for (key, value) in extra {
                if !SERVER_FIELDS.contains(&key.as_str()) {
                    map.serialize_entry(key, value)?;
                }
            }
        }
        let notice = self.mekik_notice();
        let kind = if notice.is_some() { "text" } else { frame.kind };
        map.serialize_entry("type", kind)?;
        map.serialize_entry("id", &self.shown_id())?;
        map.serialize_entry("seq", &frame.seq)?;
        map.serialize_entry("from", self.from())?;
        map.serialize_entry(
            "sender",
            &Participant {
                id: frame.sender_id,
                role: frame.sender_role,
            },
        )?;
        map.serialize_entry("data", notice.as_ref().unwrap_or(frame.data))?;
        map.serialize_entry("timestamp", &frame.timestamp_ms)?;
        if let Some(metadata) = frame.metadata {
            map.serialize_entry("metadata", metadata)?;
        }
        if let Some(client_id) = self.client_id() {
            map.serialize_entry("clientId", client_id)?;
        }
        if let Some(meta) = self.meta {
            map.serialize_entry("meta", meta)?;
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored<'a>(data: &'a Value, extra: &'a Map<String, Value>) -> PersistentFrame<'a> {
        PersistentFrame {
            kind: "text",
            id: "f-1",
            seq: 3,
            sender_id: "alice",
            sender_role: "user",
            data,
            metadata: None,
            extra: Some(extra),
            client_id: Some("c-1"),
            timestamp_ms: 1_700_000_000_000,
        }
    }

    #[test]
    fn server_fields_win_over_stored_extras() {
        let data = json!({"text": "hi"});
        let Value::Object(extra) = json!({"seq": 99, "from": "bot", "actions": [1]}) else {
            unreachable!()
        };
        let frame = stored(&data, &extra)
            .view(Viewer::EndUser { user_id: "alice" })
            .to_value();
        assert_eq!(frame["seq"], 3);
        assert_eq!(frame["from"], "user");
        assert_eq!(frame["actions"], json!([1]));
        assert_eq!(frame["clientId"], "c-1");
        assert_eq!(frame["sender"], json!({"id": "alice", "role": "user"}));
    }

    #[test]
    fn client_id_goes_to_its_author_only() {
        let data = json!({"text": "hi"});
        let extra = Map::new();
        let for_bob = stored(&data, &extra)
            .view(Viewer::EndUser { user_id: "bob" })
            .to_value();
        assert!(for_bob.get("clientId").is_none());
        assert_eq!(for_bob["from"], "bot");
        let for_agent = stored(&data, &extra).view(Viewer::Agent).to_value();
        assert!(for_agent.get("clientId").is_none());
        assert_eq!(for_agent["from"], "user");
    }

    #[test]
    fn the_mekik_profile_shows_a_streamed_answer_on_its_bubble_and_a_close_as_text() {
        let data = json!({"text": "Hello"});
        let Value::Object(extra) = json!({"streamId": "s-1"}) else {
            unreachable!()
        };
        let answer = PersistentFrame {
            sender_id: "bot-1",
            sender_role: "agent",
            ..stored(&data, &extra)
        };
        let viewer = Viewer::EndUser { user_id: "alice" };
        assert_eq!(answer.view(viewer).to_value()["id"], "f-1");
        let mekik = answer.view(viewer).for_mekik().to_value();
        assert_eq!(mekik["id"], "mekik-text-s-1-s-1");
        assert_eq!(mekik["data"], data, "only the id changes");

        let update = json!({"event": "closed", "status": "closed", "reason": null});
        let empty = Map::new();
        let close = PersistentFrame {
            kind: CONVERSATION_UPDATE,
            sender_id: "system",
            sender_role: "system",
            ..stored(&update, &empty)
        };
        assert_eq!(close.view(viewer).to_value()["type"], CONVERSATION_UPDATE);
        let shown = close.view(viewer).for_mekik().to_value();
        assert_eq!(
            (shown["type"].as_str(), shown["data"]["text"].as_str()),
            (Some("text"), Some("This conversation was closed."))
        );
        assert_eq!(shown["data"]["event"], "closed", "its fields stay");
        // A user's own frame keeps its id, stream or not.
        assert_eq!(
            stored(&data, &extra).view(viewer).for_mekik().to_value()["id"],
            "f-1"
        );
    }

    #[test]
    fn a_stopped_turn_settled_without_text_shows_a_notice_to_the_mekik_profile() {
        let settled = json!({"text": "", "status": "stopped", "reason": "stopped"});
        let empty = Map::new();
        let frame = PersistentFrame {
            sender_id: "system",
            sender_role: "system",
            ..stored(&settled, &empty)
        };
        let viewer = Viewer::EndUser { user_id: "alice" };
        assert_eq!(frame.view(viewer).to_value()["data"], settled);
        let shown = frame.view(viewer).for_mekik().to_value();
        assert_eq!(shown["data"]["text"], crate::mekik::STOPPED_NOTICE);
        assert_eq!(shown["data"]["status"], "stopped");
        // With text, the text is the answer.
        let partial = json!({"text": "Once upon", "status": "stopped"});
        let frame = PersistentFrame {
            sender_role: "system",
            ..stored(&partial, &empty)
        };
        assert_eq!(frame.view(viewer).for_mekik().to_value()["data"], partial);
    }
}
