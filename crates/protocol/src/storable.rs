//! What storage can hold: Postgres refuses a NUL character in `text` and in `jsonb` strings, so
//! a frame carrying one anywhere (a value or a key, at any depth) is refused before any commit.
//! Otherwise the database refuses the write, and a client that resends what it was told is a
//! retryable failure would poison every batch it joins.

use serde_json::Value;

/// The message of every refusal for a NUL character.
pub const NUL_REFUSED: &str = "NUL characters (\\u0000) cannot be stored";

/// True when a string or a key anywhere in `value` holds a NUL character.
pub fn contains_nul(value: &Value) -> bool {
    match value {
        Value::String(text) => text.contains('\0'),
        Value::Array(items) => items.iter().any(contains_nul),
        Value::Object(fields) => fields
            .iter()
            .any(|(key, value)| key.contains('\0') || contains_nul(value)),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn nul_is_found_in_values_and_keys_at_any_depth() {
        assert!(!contains_nul(&json!({"a": [1, "b", {"c": null}]})));
        assert!(contains_nul(&json!("x\u{0}")));
        assert!(contains_nul(&json!({"data": {"deep": ["ok", "n\u{0}"]}})));
        assert!(contains_nul(&json!({"data": {"k\u{0}": 1}})));
    }
}
