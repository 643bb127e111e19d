//! Secrets a node needs but the operator did not configure: generated once into the state
//! folder (mode 0600) and reused, so a single-node setup works with zero configuration.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::Context;
use converger_gateway::{Config, Credentials};

/// File names under `state_dir`.
pub const SECRET_KEY_FILE: &str = "secret_key";
/// File holding the generated admin token.
pub const ADMIN_TOKEN_FILE: &str = "admin_token";

/// The configured secrets, or those stored (or now generated) under `state_dir`.
pub fn resolve(config: &Config) -> anyhow::Result<Credentials> {
    let secret_key = if config.secret_key.is_empty() {
        read_or_generate(&config.state_dir.join(SECRET_KEY_FILE))?
    } else {
        config.secret_key.clone()
    };
    let admin_token = if config.admin_token.is_empty() {
        read_or_generate(&config.state_dir.join(ADMIN_TOKEN_FILE))?
    } else {
        config.admin_token.clone()
    };
    Ok(Credentials {
        secret_key: secret_key.into_bytes(),
        admin_token,
    })
}

fn read_or_generate(path: &Path) -> anyhow::Result<String> {
    match std::fs::read_to_string(path) {
        Ok(existing) if !existing.trim().is_empty() => return Ok(existing.trim().to_owned()),
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error).with_context(|| format!("cannot read {}", path.display())),
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    let value = converger_store::generate_secret("");
    // create_new: if two processes race, one loses and reads the winner's value.
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path);
    match created {
        Ok(mut file) => {
            file.write_all(value.as_bytes())
                .with_context(|| format!("cannot write {}", path.display()))?;
            tracing::info!(path = %path.display(), "generated a secret");
            Ok(value)
        }
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {
            let existing = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            Ok(existing.trim().to_owned())
        }
        Err(error) => Err(error).with_context(|| format!("cannot create {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_once_then_reused() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            state_dir: dir.path().to_owned(),
            ..Config::default()
        };
        let first = resolve(&config).unwrap();
        let second = resolve(&config).unwrap();
        assert_eq!(first.secret_key, second.secret_key);
        assert_eq!(first.admin_token, second.admin_token);
        assert!(first.secret_key.len() >= 32);
        let mode = std::fs::metadata(dir.path().join(SECRET_KEY_FILE))
            .unwrap()
            .permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
    }

    #[test]
    fn configured_values_win() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config {
            state_dir: dir.path().to_owned(),
            secret_key: "k".repeat(40),
            admin_token: "a".repeat(20),
            ..Config::default()
        };
        let credentials = resolve(&config).unwrap();
        assert_eq!(credentials.admin_token, "a".repeat(20));
        assert!(!dir.path().join(SECRET_KEY_FILE).exists());
    }
}
