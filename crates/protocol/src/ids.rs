//! Shape rules for client-chosen identifiers.

/// A clientId is 1–128 characters of `A-Za-z0-9._:~-`.
pub fn is_valid_client_id(candidate: &str) -> bool {
    (1..=128).contains(&candidate.len())
        && candidate
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'~' | b'-'))
}

/// Longest accepted user id, in bytes (tokens, `hello.userId`, REST).
pub const MAX_USER_ID_BYTES: usize = 128;

/// A user id is 1–128 bytes, without a NUL character.
pub fn is_valid_user_id(candidate: &str) -> bool {
    (1..=MAX_USER_ID_BYTES).contains(&candidate.len()) && !candidate.contains('\0')
}

/// A group name is 1–64 characters of `A-Za-z0-9._:-`.
pub fn is_valid_group(candidate: &str) -> bool {
    (1..=64).contains(&candidate.len())
        && candidate
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn client_id_edges() {
        assert!(is_valid_client_id("c-17"));
        assert!(is_valid_client_id("a.b_c:d~e-f"));
        assert!(is_valid_client_id(&"x".repeat(128)));
        assert!(!is_valid_client_id(""));
        assert!(!is_valid_client_id(&"x".repeat(129)));
        assert!(!is_valid_client_id("has space"));
        assert!(!is_valid_client_id("ünïcode"));
        assert!(!is_valid_client_id("slash/"));
    }

    #[test]
    fn group_edges() {
        assert!(is_valid_group("support-bot"));
        assert!(!is_valid_group("tilde~"));
        assert!(!is_valid_group(&"g".repeat(65)));
        assert!(!is_valid_group(""));
    }

    proptest! {
        #[test]
        fn valid_groups_are_valid_client_ids(group in "[A-Za-z0-9._:-]{1,64}") {
            prop_assert!(is_valid_group(&group));
            prop_assert!(is_valid_client_id(&group));
        }

        #[test]
        fn any_forbidden_byte_is_rejected(prefix in "[a-z]{0,10}", bad in "[^A-Za-z0-9._:~-]", suffix in "[a-z]{0,10}") {
            let candidate = format!("{prefix}{bad}{suffix}");
            prop_assert!(!is_valid_client_id(&candidate));
        }
    }
}
