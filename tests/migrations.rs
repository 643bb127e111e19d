//! Migrations, and the functions they define, on a real database.

mod support;

use converger_store::{Gone, Incarnation, PresenceChange, Store};
use support::TestDb;
use uuid::Uuid;

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
            "activities_interrupts",
            "activities_pkey"
        ]
    );
    drop(connection);
    store.pool().close().await;
}

#[tokio::test]
async fn the_notify_function_notifies_on_the_stores_channel() {
    let db = TestDb::create().await;
    // The plpgsql function names the channel itself; the bus listens on NOTIFY_CHANNEL.
    // `converger_notify` is the one the statements call (it sends nothing under
    // `converger.notify = off`, ADR 0033); `converger_notify_committed`, which packed the
    // batch function's notifications, went with that function (migration 20261211000001).
    let expected = format!("'{}'", converger_store::NOTIFY_CHANNEL);
    let mut connection = db.connect().await;
    let bodies_naming_it: Vec<String> = sqlx::query_scalar(
        "SELECT proname::text FROM pg_proc WHERE strpos(prosrc, $1) > 0 ORDER BY proname",
    )
    .bind(&expected)
    .fetch_all(&mut connection)
    .await
    .unwrap();
    assert_eq!(bodies_naming_it, vec!["converger_notify"]);
}

#[tokio::test]
async fn the_batch_functions_the_statements_replaced_are_gone() {
    let db = TestDb::create().await;
    let mut connection = db.connect().await;
    // `DROP FUNCTION IF EXISTS` with a signature that matches nothing drops nothing, silently.
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT proname::text FROM pg_proc
          WHERE proname IN ('converger_commit_batch', 'converger_commit_batch_isolated',
                            'converger_notify_committed', 'converger_batch_answer')
          ORDER BY proname",
    )
    .fetch_all(&mut connection)
    .await
    .unwrap();
    // The settlement of a stopped turn still commits through `converger_batch_answer`.
    assert_eq!(left, vec!["converger_batch_answer"]);
}

fn presence_change(conversation_id: Uuid, participant: &str, joined: bool) -> PresenceChange {
    PresenceChange {
        conversation_id,
        participant_id: participant.to_owned(),
        joined,
    }
}

/// A node incarnation of these tests.
fn node(node_id: &'static str, generation: i64) -> Incarnation<'static> {
    Incarnation {
        node_id,
        generation,
    }
}

/// Each change's total after one batch of (conversation, participant, joined) on `node`.
async fn totals(store: &Store, on: Incarnation<'_>, changes: &[(Uuid, &str, bool)]) -> Vec<i64> {
    let changes: Vec<PresenceChange> = changes
        .iter()
        .map(|(conversation, participant, joined)| {
            presence_change(*conversation, participant, *joined)
        })
        .collect();
    store.change_presence(&changes, on).await.unwrap()
}

/// One connection in of each of eight new users, each in a conversation of its own.
fn joins_of_new_users(round: usize) -> Vec<PresenceChange> {
    (0..8)
        .map(|n| presence_change(Uuid::new_v4(), &format!("user-{round}-{n}"), true))
        .collect()
}

#[tokio::test]
async fn a_batch_of_presence_changes_gives_each_change_the_total_it_left() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let (alice, bob) = (Uuid::new_v4(), Uuid::new_v4());
    let (node_a, node_b) = (node("node-a", 1), node("node-b", 7));
    let batch = [
        (alice, "alice", true),
        (alice, "alice", true),
        (bob, "bob", true),
        (alice, "alice", false),
    ];
    assert_eq!(
        totals(&store, node_a, &batch).await,
        vec![1, 2, 1, 1],
        "in order, each as if alone"
    );
    // Another node's changes count with these: the totals are the cluster's.
    let batch = [(alice, "alice", true), (alice, "alice", false)];
    assert_eq!(totals(&store, node_b, &batch).await, vec![2, 1]);
    let batch = [(bob, "bob", false), (alice, "alice", false)];
    assert_eq!(totals(&store, node_a, &batch).await, vec![0, 0]);
    assert_eq!(
        db.count("SELECT count(*) FROM presence_connections").await,
        0
    );
    assert!(totals(&store, node_a, &[]).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_naming_the_same_users_in_opposite_orders_never_deadlock() {
    let db = TestDb::create().await;
    let store = db.store().await;
    for round in 0..20 {
        let forward = joins_of_new_users(round);
        let backward: Vec<PresenceChange> = forward.iter().rev().cloned().collect();
        let (node_a, node_b) = (node("node-a", 1), node("node-b", 1));
        // Each change locks its user for the whole batch; locked in the order given, these two
        // would wait on each other (Postgres would fail one with a deadlock).
        let (first, second) = tokio::join!(
            store.change_presence(&forward, node_a),
            store.change_presence(&backward, node_b)
        );
        let (first, mut second) = (first.unwrap(), second.unwrap());
        second.reverse();
        for (user, (in_first, in_second)) in first.iter().zip(&second).enumerate() {
            let mut seen = [*in_first, *in_second];
            seen.sort_unstable();
            assert_eq!(
                seen,
                [1, 2],
                "round {round}, user {user}: one change saw it cross"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_and_a_dead_nodes_removal_over_the_same_users_never_deadlock() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let (dead, live) = (node("node-dead", 1), node("node-live", 1));
    for round in 0..20 {
        let joins = joins_of_new_users(round);
        store.change_presence(&joins, dead).await.unwrap();
        // The removal locks the users in order; the batch names them in the opposite one.
        let backward: Vec<PresenceChange> = joins.iter().rev().cloned().collect();
        let (removed, joined) = tokio::join!(
            store.forget_presence(Gone::Exactly(dead)),
            store.change_presence(&backward, live)
        );
        let (removed, joined) = (removed.unwrap(), joined.unwrap());
        assert_eq!(
            removed.len(),
            0,
            "the users have no conversation rows to name"
        );
        assert!(
            joined.iter().all(|total| [1, 2].contains(total)),
            "{joined:?}"
        );
    }
    let left: i64 = db
        .count("SELECT coalesce(sum(connections), 0) FROM presence_connections")
        .await;
    assert_eq!(left, 20 * 8, "only the live node's connections are left");
}
