//! Migrations on a real, empty database.

mod support;

use support::TestDb;

#[tokio::test]
async fn migrations_apply_on_an_empty_database_then_are_no_ops() {
    let db = TestDb::create_empty().await;
    let store = db.store().await;
    let first = store.migrate().await.expect("first run applies");
    assert!(
        !first.applied.is_empty(),
        "the first run applies every migration"
    );
    let second = store.migrate().await.expect("second run succeeds");
    assert!(
        second.applied.is_empty(),
        "the second run applies nothing: {:?}",
        second.applied
    );
    for table in [
        "tenants",
        "channels",
        "conversations",
        "activities",
        "turns",
        "conversation_runtime",
        "outbox",
    ] {
        let exists = db
            .count(&format!(
                "SELECT count(*) FROM information_schema.tables WHERE table_name = '{table}'"
            ))
            .await;
        assert_eq!(exists, 1, "table {table} exists");
    }
    store.pool().close().await;
}

/// ADR 0040: an operator with a large `activities` table builds the index of id hashes with
/// `CREATE INDEX CONCURRENTLY` before upgrading; the migration then keeps that index and drops
/// the one it replaces.
#[tokio::test]
async fn the_index_of_id_hashes_may_be_built_before_its_migration() {
    let db = TestDb::create_empty().await;
    let store = db.store().await;
    store.migrate().await.expect("first run applies");
    // The database as that operator leaves it: the previous release's index, the new one built
    // beside it, and the migration not yet applied.
    let mut connection = db.connect().await;
    for statement in [
        "CREATE INDEX activities_by_id ON activities (conversation_id, id)",
        "DELETE FROM _sqlx_migrations WHERE version = 20261208000001",
    ] {
        sqlx::query(statement)
            .execute(&mut connection)
            .await
            .expect(statement);
    }
    let report = store.migrate().await.expect("the migration applies");
    assert_eq!(report.applied, vec![20261208000001]);
    let indexes: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE tablename = 'activities' ORDER BY 1",
    )
    .fetch_all(&mut connection)
    .await
    .expect("indexes");
    assert_eq!(
        indexes,
        [
            "activities_by_id_hash",
            "activities_idempotency",
            "activities_pkey"
        ]
    );
    drop(connection);
    store.pool().close().await;
}

#[tokio::test]
async fn the_commit_functions_notify_on_the_stores_channel() {
    let db = TestDb::create().await;
    // The plpgsql functions name the channel themselves; the bus listens on NOTIFY_CHANNEL.
    // `converger_notify` is the one the statements call; `converger_notify_committed` packs a
    // batch's notifications (both skip it under `converger.notify = off`, ADR 0033).
    let expected = format!("'{}'", converger_store::NOTIFY_CHANNEL);
    let mut connection = db.connect().await;
    let bodies_naming_it: Vec<String> = sqlx::query_scalar(
        "SELECT proname::text FROM pg_proc WHERE strpos(prosrc, $1) > 0 ORDER BY proname",
    )
    .bind(&expected)
    .fetch_all(&mut connection)
    .await
    .unwrap();
    assert_eq!(
        bodies_naming_it,
        vec!["converger_notify", "converger_notify_committed"]
    );
}
