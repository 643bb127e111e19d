//! Tests against the machine's real PostgreSQL server binaries.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

use super::*;
use crate::binaries::*;
use crate::cluster::{Cluster, LOG_TAIL_LINES};
use crate::process::*;
use crate::server_user::*;

/// Stops the server with an immediate shutdown when a test ends, even by panicking.
struct StopOnDrop {
    cluster: Cluster,
}

impl StopOnDrop {
    fn new(handle: &EmbeddedPostgres) -> Self {
        Self {
            cluster: handle.cluster.clone(),
        }
    }
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let mut command = self.cluster.std_command(&self.cluster.binaries.pg_ctl());
        command
            .arg("-D")
            .arg(self.cluster.data_dir())
            .args(["-m", "immediate", "-w", "stop"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // Usually the test already stopped it; then this fails harmlessly.
        let _ = command.status();
    }
}

fn cluster_tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("converger-embedded-")
        .tempdir_in("/tmp")
        .expect("create a tempdir under /tmp")
}

async fn assert_accepting_connections(handle: &EmbeddedPostgres) {
    tokio::time::timeout(
        Duration::from_secs(10),
        tokio::net::TcpStream::connect(("127.0.0.1", handle.port)),
    )
    .await
    .expect("tcp connect in time")
    .expect("tcp connect to the server");

    let mut command = Command::new(handle.cluster.binaries.bindir.join("pg_isready"));
    command.arg("-d").arg(handle.url());
    let output = run_command(command, "pg_isready", Duration::from_secs(10))
        .await
        .expect("run pg_isready");
    assert!(
        output.status.success(),
        "pg_isready: {}",
        describe_output(&output)
    );
}

async fn psql(handle: &EmbeddedPostgres, sql: &str) -> String {
    let mut command = Command::new(handle.cluster.binaries.bindir.join("psql"));
    command
        .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d"])
        .arg(handle.url())
        .arg("-c")
        .arg(sql);
    let output = run_command(command, "psql", Duration::from_secs(30))
        .await
        .expect("run psql");
    assert!(
        output.status.success(),
        "psql: {}",
        describe_output(&output)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

async fn owner_pid_contents(cluster: &Cluster) -> Option<String> {
    tokio::fs::read_to_string(cluster.owner_pid_file())
        .await
        .ok()
        .map(|contents| contents.trim().to_owned())
}

#[tokio::test]
async fn owner_starts_guest_reuses_and_owner_stop_stops_the_server() {
    let tempdir = cluster_tempdir();
    let owner = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
        .await
        .expect("owner starts the cluster");
    let _stop_on_drop = StopOnDrop::new(&owner);
    let cluster = owner.cluster.clone();

    assert!(owner.started_here());
    assert!(owner.url().starts_with("postgres://postgres:"));
    assert!(
        owner
            .url()
            .ends_with(&format!("@127.0.0.1:{}/postgres", owner.port))
    );
    assert_accepting_connections(&owner).await;

    let password_metadata = std::fs::metadata(cluster.password_file()).expect("password file");
    assert_eq!(password_metadata.mode() & 0o777, 0o600);
    assert_eq!(owner.password.len(), 32);
    assert!(owner.password.chars().all(|c| c.is_ascii_hexdigit()));
    let port_file = std::fs::read_to_string(cluster.port_file()).expect("port file");
    assert_eq!(port_file.trim(), owner.port.to_string());
    assert_eq!(
        owner_pid_contents(&cluster).await,
        Some(std::process::id().to_string())
    );
    assert!(!cluster.dir.join("initdb-pwfile").exists());

    let guest = EmbeddedPostgres::start(tempdir.path(), Role::Guest)
        .await
        .expect("guest reuses the cluster");
    assert!(!guest.started_here());
    assert_eq!(guest.port, owner.port);
    assert_eq!(guest.url(), owner.url());
    guest.stop().await.expect("guest stop is a no-op");
    assert_accepting_connections(&owner).await;

    // The first owner is alive (it is this process), so a second owner must not take over.
    let second_owner = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
        .await
        .expect("second owner reuses the cluster");
    assert!(!second_owner.started_here());
    assert!(!second_owner.owns_server);
    second_owner
        .stop()
        .await
        .expect("non-owning stop is a no-op");
    assert_accepting_connections(&owner).await;

    owner.stop().await.expect("owner stops the cluster");
    assert!(!cluster.is_running().await.expect("pg_ctl status"));
    assert_eq!(owner_pid_contents(&cluster).await, None);
}

#[tokio::test]
async fn restart_keeps_data() {
    let tempdir = cluster_tempdir();
    let first = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
        .await
        .expect("first start");
    let _stop_on_drop = StopOnDrop::new(&first);
    psql(
        &first,
        "CREATE TABLE survivors (id integer); INSERT INTO survivors VALUES (42);",
    )
    .await;
    let cluster = first.cluster.clone();
    first.stop().await.expect("first stop");
    assert!(!cluster.is_running().await.expect("pg_ctl status"));

    let second = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
        .await
        .expect("second start");
    assert!(second.started_here());
    assert_eq!(psql(&second, "SELECT id FROM survivors").await, "42");
    let database_url = second.url_for("postgres");
    assert_eq!(database_url, second.url());
    second.stop().await.expect("second stop");
    assert!(!cluster.is_running().await.expect("pg_ctl status"));
}

#[tokio::test]
async fn owner_adopts_a_server_without_a_live_owner() {
    let tempdir = cluster_tempdir();
    let guest = EmbeddedPostgres::start(tempdir.path(), Role::Guest)
        .await
        .expect("guest starts the cluster");
    let _stop_on_drop = StopOnDrop::new(&guest);
    let cluster = guest.cluster.clone();
    assert!(guest.started_here());
    assert_eq!(owner_pid_contents(&cluster).await, None);
    let guest_port = guest.port;
    guest.stop().await.expect("guest stop is a no-op");
    assert!(cluster.is_running().await.expect("pg_ctl status"));

    let owner = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
        .await
        .expect("owner adopts the cluster");
    assert!(!owner.started_here());
    assert!(owner.owns_server);
    assert_eq!(owner.port, guest_port);
    assert_eq!(
        owner_pid_contents(&cluster).await,
        Some(std::process::id().to_string())
    );
    assert_accepting_connections(&owner).await;

    owner
        .stop()
        .await
        .expect("adopting owner stops the cluster");
    assert!(!cluster.is_running().await.expect("pg_ctl status"));
}

#[tokio::test]
async fn owner_adopts_when_the_recorded_owner_is_dead() {
    let tempdir = cluster_tempdir();
    let guest = EmbeddedPostgres::start(tempdir.path(), Role::Guest)
        .await
        .expect("guest starts the cluster");
    let _stop_on_drop = StopOnDrop::new(&guest);
    let cluster = guest.cluster.clone();
    // Stands in for an owner killed with -9: pid_max on Linux is at most 2^22.
    std::fs::write(cluster.owner_pid_file(), "4194305\n").expect("write stale owner.pid");

    let owner = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
        .await
        .expect("owner adopts the cluster");
    assert!(owner.owns_server);
    owner.stop().await.expect("owner stops the cluster");
    assert!(!cluster.is_running().await.expect("pg_ctl status"));
}

#[tokio::test]
async fn concurrent_guests_share_one_server() {
    let tempdir = cluster_tempdir();
    let (first, second, third) = tokio::join!(
        EmbeddedPostgres::start(tempdir.path(), Role::Guest),
        EmbeddedPostgres::start(tempdir.path(), Role::Guest),
        EmbeddedPostgres::start(tempdir.path(), Role::Guest),
    );
    let guests: Vec<EmbeddedPostgres> = [first, second, third]
        .into_iter()
        .map(|result| result.expect("guest start"))
        .collect();
    let _stop_on_drop = StopOnDrop::new(&guests[0]);
    let cluster = guests[0].cluster.clone();

    let starters = guests.iter().filter(|guest| guest.started_here()).count();
    assert_eq!(
        starters, 1,
        "exactly one guest runs initdb and starts the server"
    );
    assert!(guests.iter().all(|guest| guest.port == guests[0].port));
    for guest in guests {
        guest.stop().await.expect("guest stop is a no-op");
    }
    assert!(cluster.is_running().await.expect("pg_ctl status"));

    let owner = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
        .await
        .expect("owner adopts the cluster");
    owner.stop().await.expect("owner stops the cluster");
    assert!(!cluster.is_running().await.expect("pg_ctl status"));
}

#[tokio::test]
async fn failed_start_reports_the_log_tail() {
    let tempdir = cluster_tempdir();
    let first = EmbeddedPostgres::start(tempdir.path(), Role::Owner)
        .await
        .expect("first start");
    let _stop_on_drop = StopOnDrop::new(&first);
    let cluster = first.cluster.clone();
    first.stop().await.expect("first stop");

    let config = cluster.data_dir().join("postgresql.conf");
    let mut contents = std::fs::read_to_string(&config).expect("read postgresql.conf");
    contents.push_str("this line is not a setting\n");
    std::fs::write(&config, contents).expect("break postgresql.conf");

    let error = match EmbeddedPostgres::start(tempdir.path(), Role::Owner).await {
        Ok(handle) => {
            let _stop_again = StopOnDrop::new(&handle);
            panic!("a broken postgresql.conf should stop the server from starting");
        }
        Err(error) => error,
    };
    let message = error.to_string();
    let EmbeddedError::StartFailed { log_tail, .. } = error else {
        panic!("unexpected error: {message}");
    };
    assert!(log_tail.contains("postgresql.conf"), "{message}");
    assert!(log_tail.lines().count() <= LOG_TAIL_LINES, "{message}");
}

#[tokio::test]
async fn missing_binaries_name_the_packages_to_install() {
    let error = select_server_binaries(&[])
        .await
        .expect_err("no candidates, no binaries");
    let message = error.to_string();
    assert!(matches!(error, EmbeddedError::BinariesNotFound));
    assert!(message.contains("apt install postgresql"), "{message}");
    assert!(message.contains("postgresql-server"), "{message}");
    assert!(message.contains("brew install postgresql"), "{message}");

    let empty = tempfile::tempdir().expect("tempdir");
    let error = select_server_binaries(&[empty.path().to_path_buf()])
        .await
        .expect_err("empty directory holds no binaries");
    assert!(matches!(error, EmbeddedError::BinariesNotFound));
}

#[tokio::test]
async fn binaries_are_found_on_this_machine() {
    let binaries = locate_server_binaries().await.expect("server binaries");
    assert!(binaries.initdb().is_file());
    assert!(binaries.pg_ctl().is_file());
}

#[tokio::test]
async fn unsearchable_ancestor_is_reported_when_root() {
    let tempdir = cluster_tempdir();
    if effective_uid(tempdir.path()).await.expect("uid") != 0 {
        return;
    }
    // Root-owned and 0700: the server user cannot pass through it.
    std::fs::set_permissions(tempdir.path(), std::fs::Permissions::from_mode(0o700))
        .expect("restrict tempdir");
    let nested = tempdir.path().join("nested").join("postgres");
    let error = match EmbeddedPostgres::start(&nested, Role::Guest).await {
        Ok(handle) => {
            let _stop_on_drop = StopOnDrop::new(&handle);
            panic!("server user should not reach {}", nested.display());
        }
        Err(error) => error,
    };
    let message = error.to_string();
    match error {
        EmbeddedError::DirectoryNotSearchable { directory, .. } => {
            assert_eq!(directory, tempdir.path().canonicalize().expect("canonical"));
        }
        other => panic!("unexpected error: {other}"),
    }
    assert!(message.contains("CONVERGER_STATE_DIR"), "{message}");
}

#[test]
fn passwd_parsing_and_user_choice() {
    let passwd = "\
root:x:0:0:root:/root:/bin/bash
# a comment
broken line
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
postgres:x:101:104:PostgreSQL administrator,,,:/var/lib/postgresql:/bin/bash
";
    let users = parse_passwd(passwd);
    assert_eq!(users.len(), 3);
    let chosen = pick_server_user(&users).expect("a server user");
    assert_eq!(
        chosen,
        ServerUser {
            name: "postgres".to_owned(),
            uid: 101,
            gid: 104,
            home: PathBuf::from("/var/lib/postgresql"),
        }
    );

    let without_postgres = parse_passwd("nobody:x:65534:65534::/nonexistent:/bin/false\n");
    assert_eq!(
        pick_server_user(&without_postgres).map(|user| user.name),
        Some("nobody".to_owned())
    );
    assert_eq!(
        pick_server_user(&parse_passwd("root:x:0:0::/root:/bin/sh\n")),
        None
    );
}

#[test]
fn searchability_follows_mode_bits() {
    let user = ServerUser {
        name: "postgres".to_owned(),
        uid: 101,
        gid: 104,
        home: PathBuf::from("/var/lib/postgresql"),
    };
    assert!(is_searchable_by(0o755, 0, 0, &user));
    assert!(is_searchable_by(0o1777, 0, 0, &user));
    assert!(!is_searchable_by(0o700, 0, 0, &user));
    assert!(is_searchable_by(0o700, 101, 0, &user));
    assert!(is_searchable_by(0o710, 0, 104, &user));
    assert!(!is_searchable_by(0o701, 0, 104, &user));
    assert!(!is_searchable_by(0o077, 101, 0, &user));
}

#[test]
fn postmaster_pid_port_and_log_helpers() {
    let postmaster_pid =
        "1234\n/tmp/x/data\n1700000000\n54321\n\n127.0.0.1\n  5432001  0\nready   \n";
    assert_eq!(parse_postmaster_port(postmaster_pid), Some(54321));
    assert_eq!(parse_postmaster_port("1234\n/tmp/x/data\n"), None);

    assert!(mentions_port_in_use(
        "LOG:  could not bind IPv4 address \"127.0.0.1\": Address already in use"
    ));
    assert!(!mentions_port_in_use("LOG:  database system is ready"));

    assert_eq!(last_lines("a\nb\nc\n", 2), "b\nc");
    assert_eq!(last_lines("a", 20), "a");
    assert_eq!(parse_version("15"), Some(vec![15]));
    assert_eq!(parse_version("9.6"), Some(vec![9, 6]));
    assert_eq!(parse_version("common"), None);
}

#[test]
fn urls_encode_database_names() {
    assert_eq!(
        connection_url("abc", 5432, "postgres"),
        "postgres://postgres:abc@127.0.0.1:5432/postgres"
    );
    assert_eq!(
        connection_url("abc", 5432, "my db/1"),
        "postgres://postgres:abc@127.0.0.1:5432/my%20db%2F1"
    );
    assert_eq!(generate_password().len(), 32);
}
