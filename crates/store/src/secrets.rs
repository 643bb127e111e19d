//! Secrets shown once and stored hashed.
//!
//! API keys and channel secrets are 256 random bits, so a plain SHA-256 is enough to make a
//! stolen table useless (no dictionary to attack) and lets the secret be looked up by its hash.

use rand::Rng;
use sha2::{Digest, Sha256};

/// A new random 256-bit secret in hex after a readable prefix (`cvg_key_…`, `cvg_sec_…`).
pub fn generate_secret(prefix: &str) -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("{prefix}{}", hex::encode(bytes))
}

/// Hex SHA-256 of a secret, as stored in the database.
pub fn hash_secret(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_distinct_and_prefixed() {
        let first = generate_secret("cvg_key_");
        let second = generate_secret("cvg_key_");
        assert_ne!(first, second);
        assert!(first.starts_with("cvg_key_"));
        assert_eq!(first.len(), "cvg_key_".len() + 64);
    }

    #[test]
    fn hash_is_stable_sha256() {
        assert_eq!(
            hash_secret("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
