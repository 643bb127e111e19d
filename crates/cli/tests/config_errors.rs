//! The binary refuses invalid configuration before doing anything, naming the key.

use std::process::{Command, Output};

fn converger(args: &[&str], env: &[(&str, &str)]) -> Output {
    let workdir = tempfile::tempdir().expect("temp dir");
    let mut command = Command::new(env!("CARGO_BIN_EXE_converger"));
    command.args(args).current_dir(workdir.path());
    for (key, _) in std::env::vars().filter(|(key, _)| key.starts_with("CONVERGER_")) {
        command.env_remove(key);
    }
    // A database URL that is never contacted: configuration fails first.
    command.env(
        "CONVERGER_DATABASE_URL",
        "postgres://nobody@127.0.0.1:1/none",
    );
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().expect("converger runs")
}

fn assert_config_error(env: &[(&str, &str)], names: &str) {
    let output = converger(&["migrate"], env);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{env:?}: {stderr}");
    assert!(stderr.contains("invalid configuration"), "{stderr}");
    assert!(
        stderr.contains(names),
        "{env:?} should name {names}: {stderr}"
    );
}

#[test]
fn wrong_types_name_the_key() {
    assert_config_error(&[("CONVERGER_HTTP_ADDR", "not-an-address")], "http_addr");
    assert_config_error(
        &[("CONVERGER_LIMITS__MAX_IN_FLIGHT", "many")],
        "limits.max_in_flight",
    );
    assert_config_error(&[("CONVERGER_LOG_FORMAT", "xml")], "log_format");
}

#[test]
fn invalid_values_name_the_key() {
    assert_config_error(&[("CONVERGER_SECRET_KEY", "too-short")], "secret_key");
    assert_config_error(&[("CONVERGER_DATABASE_URL", "mysql://x")], "database_url");
    assert_config_error(
        &[("CONVERGER_LIMITS__HEARTBEAT_INTERVAL_MS", "50000")],
        "limits.heartbeat_interval_ms",
    );
}

#[test]
fn unknown_keys_are_refused_by_name() {
    assert_config_error(&[("CONVERGER_HTTP_ADRESS", "127.0.0.1:1")], "http_adress");
}

#[test]
fn missing_config_file_is_reported() {
    let output = converger(&["--config", "/nonexistent/converger.toml", "migrate"], &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr.contains("/nonexistent/converger.toml"), "{stderr}");
}

#[test]
fn help_lists_the_commands() {
    let output = converger(&["--help"], &[]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    for command in ["serve", "migrate", "tenant", "channel", "token"] {
        assert!(
            stdout.contains(command),
            "{command} missing from --help: {stdout}"
        );
    }
}
