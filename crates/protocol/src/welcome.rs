//! The `welcome` frames of both scopes (docs/protocol.md §§2 and 4.1).

use serde::Serialize;
use serde_json::Value;

use crate::{Limits, PROTOCOL_NAME, Profile};

/// An interrupt still waiting for the user's `resume`, as `welcome.data.pending` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct PendingInterrupt<'a> {
    /// The interrupt frame's id.
    pub id: &'a str,
    /// Its `data`.
    pub data: &'a Value,
}

/// The `welcome` of an end user's connection.
#[derive(Debug, Clone)]
pub struct ConversationWelcome<'a> {
    /// The dialect the client speaks.
    pub profile: Profile,
    /// The conversation joined.
    pub conversation_id: &'a str,
    /// The end user.
    pub user_id: &'a str,
    /// This connection.
    pub connection_id: &'a str,
    /// The conversation's head when the session started.
    pub watermark: u64,
    /// Interrupts still waiting for an answer.
    pub pending: Vec<PendingInterrupt<'a>>,
    /// Token expiry, milliseconds since the Unix epoch.
    pub expires_at_ms: i64,
    /// The node's limits.
    pub limits: &'a Limits,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ConversationCapabilities {
    acks: bool,
    typing: bool,
    receipts: bool,
    presence: bool,
    edit: bool,
    regenerate: bool,
    /// Streamed answers: `streamChunk`/`streamEnd`, or `genui` chunks in the mekik profile.
    streams: bool,
}

impl ConversationCapabilities {
    /// What a session of `profile` really gets: derived from the same rules that filter its
    /// frames, so the welcome never promises a frame the profile is not sent.
    fn of(profile: Profile) -> ConversationCapabilities {
        ConversationCapabilities {
            acks: profile.is_converger(),
            typing: profile.receives_transient("typing"),
            receipts: profile.receives_transient("deliveryStatus"),
            // Presence frames come only from end users' sessions and never reach the same
            // user, and a conversation has one: no end user is sent one yet.
            presence: false,
            edit: true,
            regenerate: true,
            streams: true,
        }
    }
}

impl ConversationWelcome<'_> {
    /// The frame as JSON text.
    pub fn encode(&self) -> String {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Data<'a> {
            protocol: &'static str,
            compat: [&'static str; 1],
            scope: &'static str,
            conversation_id: &'a str,
            user_id: &'a str,
            connection_id: &'a str,
            watermark: u64,
            pending: &'a [PendingInterrupt<'a>],
            expires_at: i64,
            capabilities: ConversationCapabilities,
            limits: Value,
        }
        crate::encode(&Welcome {
            kind: "welcome",
            data: Data {
                protocol: self.profile.protocol_name(),
                compat: [crate::MEKIK_PROTOCOL_NAME],
                scope: "conversation",
                conversation_id: self.conversation_id,
                user_id: self.user_id,
                connection_id: self.connection_id,
                watermark: self.watermark,
                pending: &self.pending,
                expires_at: self.expires_at_ms,
                capabilities: ConversationCapabilities::of(self.profile),
                limits: self.limits.to_wire(false),
            },
        })
    }
}

/// The `welcome` of an agent's connection.
#[derive(Debug, Clone)]
pub struct ChannelWelcome<'a> {
    /// The channel served.
    pub channel_id: &'a str,
    /// This connection.
    pub connection_id: &'a str,
    /// The member's eligibility time, milliseconds since the Unix epoch.
    pub since_ms: i64,
    /// Token expiry, milliseconds since the Unix epoch.
    pub expires_at_ms: i64,
    /// The group joined; `None` for an observer.
    pub group: Option<&'a str>,
    /// Lease mode: how long each claim lasts.
    pub lease_ms: Option<u64>,
    /// The node's limits.
    pub limits: &'a Limits,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ChannelCapabilities {
    acks: bool,
    typing: bool,
    groups: bool,
    turn_results: bool,
    /// `streamChunk` and `streamAbort` are accepted.
    streams: bool,
}

impl ChannelWelcome<'_> {
    /// The frame as JSON text.
    pub fn encode(&self) -> String {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Data<'a> {
            protocol: &'static str,
            scope: &'static str,
            channel_id: &'a str,
            connection_id: &'a str,
            since: i64,
            expires_at: i64,
            capabilities: ChannelCapabilities,
            limits: Value,
            #[serde(skip_serializing_if = "Option::is_none")]
            group: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            claim: Option<&'static str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            lease_ms: Option<u64>,
        }
        crate::encode(&Welcome {
            kind: "welcome",
            data: Data {
                protocol: PROTOCOL_NAME,
                scope: "channel",
                channel_id: self.channel_id,
                connection_id: self.connection_id,
                since: self.since_ms,
                expires_at: self.expires_at_ms,
                capabilities: ChannelCapabilities {
                    acks: true,
                    typing: true,
                    groups: true,
                    turn_results: true,
                    streams: true,
                },
                limits: self.limits.to_wire(true),
                group: self.group,
                claim: self.lease_ms.map(|_| "lease"),
                lease_ms: self.lease_ms,
            },
        })
    }
}

#[derive(Serialize)]
struct Welcome<D: Serialize> {
    #[serde(rename = "type")]
    kind: &'static str,
    data: D,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn channel_welcome_names_the_lease_only_in_lease_mode() {
        let limits = Limits::default();
        let welcome = ChannelWelcome {
            channel_id: "ch",
            connection_id: "cn",
            since_ms: 5,
            expires_at_ms: 6,
            group: Some("bot"),
            lease_ms: Some(10_000),
            limits: &limits,
        };
        let frame: Value = serde_json::from_str(&welcome.encode()).unwrap();
        assert_eq!(frame["data"]["claim"], "lease");
        assert_eq!(frame["data"]["leaseMs"], 10_000);
        assert_eq!(frame["data"]["group"], "bot");
        let observer = ChannelWelcome {
            group: None,
            lease_ms: None,
            ..welcome
        };
        let frame: Value = serde_json::from_str(&observer.encode()).unwrap();
        assert!(frame["data"].get("claim").is_none());
        assert!(frame["data"].get("group").is_none());
        assert_eq!(frame["data"]["capabilities"]["turnResults"], json!(true));
    }

    #[test]
    fn a_mekik_welcome_promises_only_what_the_profile_is_sent() {
        let limits = Limits::default();
        let welcome = |profile| ConversationWelcome {
            profile,
            conversation_id: "c",
            user_id: "u",
            connection_id: "cn",
            watermark: 0,
            pending: Vec::new(),
            expires_at_ms: 1,
            limits: &limits,
        };
        let mekik: Value = serde_json::from_str(&welcome(Profile::Mekik).encode()).unwrap();
        assert_eq!(
            mekik["data"]["capabilities"],
            json!({"acks": false, "typing": true, "receipts": false, "presence": false,
                   "edit": true, "regenerate": true, "streams": true})
        );
        let converger: Value = serde_json::from_str(&welcome(Profile::Converger).encode()).unwrap();
        assert_eq!(
            converger["data"]["capabilities"],
            json!({"acks": true, "typing": true, "receipts": true, "presence": false,
                   "edit": true, "regenerate": true, "streams": true})
        );
    }
}
