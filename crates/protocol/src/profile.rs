//! The two dialects of the conversation scope (docs/protocol.md §3.7).
//!
//! A `hello` with `protocol: "converger/1"` selects the converger profile: acks, heartbeats,
//! presence, receipts and every other server frame. A `hello` without `protocol` is an unmodified
//! mekik/1 client (the chativa widget's mekik connector): it gets its stored frames and the few
//! transient frames it renders, and nothing it would show as an empty bubble.

use crate::{ErrorCode, PROTOCOL_NAME};

/// The `protocol` a mekik-profile `welcome` names.
pub const MEKIK_PROTOCOL_NAME: &str = "mekik/1";

/// Transient frame types a mekik client renders; every other transient frame is not sent to it.
const MEKIK_TRANSIENT_TYPES: &[&str] = &[
    "welcome",
    "run",
    "typing",
    "error",
    "genui_components",
    "skills",
];

/// Which dialect a conversation-scope client speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// `hello.protocol: "converger/1"`.
    Converger,
    /// `hello` without `protocol`: an unmodified mekik/1 client.
    Mekik,
}

impl Profile {
    /// The profile `hello.protocol` selects; another protocol name is refused.
    pub fn from_hello(protocol: Option<&str>) -> Result<Profile, ErrorCode> {
        match protocol {
            None => Ok(Profile::Mekik),
            Some(PROTOCOL_NAME) => Ok(Profile::Converger),
            Some(_) => Err(ErrorCode::UnsupportedProtocol),
        }
    }

    /// The `protocol` its `welcome` names.
    pub fn protocol_name(self) -> &'static str {
        match self {
            Profile::Converger => PROTOCOL_NAME,
            Profile::Mekik => MEKIK_PROTOCOL_NAME,
        }
    }

    /// True when a transient frame of type `kind` is sent to this profile (persistent frames
    /// always are).
    pub fn receives_transient(self, kind: &str) -> bool {
        match self {
            Profile::Converger => true,
            Profile::Mekik => MEKIK_TRANSIENT_TYPES.contains(&kind),
        }
    }

    /// True for the converger profile: acks, heartbeats and the other converger-only frames.
    pub fn is_converger(self) -> bool {
        self == Profile::Converger
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_protocol_selects_the_profile() {
        assert_eq!(Profile::from_hello(None), Ok(Profile::Mekik));
        assert_eq!(
            Profile::from_hello(Some("converger/1")),
            Ok(Profile::Converger)
        );
        assert_eq!(
            Profile::from_hello(Some("converger/2")),
            Err(ErrorCode::UnsupportedProtocol)
        );
    }

    #[test]
    fn mekik_clients_get_only_what_they_render() {
        assert!(Profile::Mekik.receives_transient("typing"));
        assert!(!Profile::Mekik.receives_transient("presence"));
        assert!(!Profile::Mekik.receives_transient("heartbeat"));
        assert!(Profile::Converger.receives_transient("presence"));
    }
}
