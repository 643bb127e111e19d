//! Group commit's batch path against a real Postgres: writes queued together commit as one
//! transaction, with the outcomes each would have had alone.
//!
//! `#[tokio::test]` runs on one thread, so the store's commit workers run only when this test
//! waits: writes started with one `join_all` are all queued before a worker takes them, and go
//! out as one batch.

mod support;

use std::time::Duration;

use converger_store::bus::{BusEvent, TransientFrame};
use converger_store::{
    AnswerFrame, AnswerOutcome, CommitOutcome, NewActivity, RuntimeWrite, Sender, SenderRole,
    StatusChange, Store, StoreError, StoreOptions, TurnAnswer,
};
use futures::future::join_all;
use serde_json::{Map, json};
use support::TestDb;
use support::cluster::eventually;
use uuid::Uuid;

fn frame(conversation_id: Uuid, text: &str, client_id: &str) -> NewActivity {
    NewActivity {
        conversation_id,
        id: None,
        kind: "text".into(),
        sender: Sender {
            id: "alice".into(),
            role: SenderRole::User,
        },
        data: json!({"text": text}),
        metadata: Some(json!({"locale": "en"})),
        extra: None,
        client_id: Some(client_id.into()),
    }
}

fn answer(conversation_id: Uuid, seq: i64, runtime: Option<RuntimeWrite>) -> TurnAnswer {
    let mut extra = Map::new();
    extra.insert("replyTo".into(), json!(seq));
    TurnAnswer {
        conversation_id,
        seq,
        revision: 0,
        fence: None,
        sender: Sender {
            id: "bot-1".into(),
            role: SenderRole::Agent,
        },
        frames: vec![
            AnswerFrame {
                id: None,
                kind: "text".into(),
                data: json!({"text": format!("answer to {seq}")}),
                metadata: None,
                extra,
            },
            AnswerFrame {
                id: Some(format!("card-{seq}")),
                kind: "event".into(),
                data: json!({"name": "card"}),
                metadata: Some(json!({"card": true})),
                extra: Map::new(),
            },
        ],
        runtime,
    }
}

/// A tenant and its channel; the channel's id.
async fn web_channel(store: &Store) -> Uuid {
    web_channel_of(store, "acme").await
}

/// A new tenant named `tenant` with its `web` channel; the channel's id.
async fn web_channel_of(store: &Store, tenant: &str) -> Uuid {
    let (tenant, _) = store.create_tenant(tenant).await.unwrap();
    store
        .create_channel(tenant.id, "web", &converger_store::TurnSettings::default())
        .await
        .unwrap()
        .0
        .id
}

/// A new conversation of alice in `channel`; its id.
async fn alice_conversation(store: &Store, channel: Uuid) -> Uuid {
    store
        .create_conversation(channel, "alice")
        .await
        .unwrap()
        .id
}

/// The stored frame with `seq`, read back the way replays read it.
async fn stored(store: &Store, conversation_id: Uuid, seq: i64) -> converger_store::Activity {
    let mut rows = store
        .list_activities(conversation_id, seq - 1, 1)
        .await
        .unwrap();
    rows.pop().expect("the frame is stored")
}

/// Commits `frames` queued together (one batch while the worker is idle), in order.
async fn commit_together(
    store: &Store,
    frames: &[NewActivity],
) -> Vec<Result<CommitOutcome, StoreError>> {
    join_all(frames.iter().map(|new| store.commit_activity(new))).await
}

/// The conversation's last seq, as stored.
async fn head_of(db: &TestDb, conversation_id: Uuid) -> i64 {
    db.count(&format!(
        "SELECT last_seq FROM conversations WHERE id = '{conversation_id}'"
    ))
    .await
}

/// A transaction of its own that holds the conversation's row lock, as a batch would, until it
/// ends.
async fn lock_conversation(db: &TestDb, conversation_id: Uuid) -> sqlx::PgConnection {
    let mut holder = db.connect().await;
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("SELECT 1 FROM conversations WHERE id = $1 FOR NO KEY UPDATE")
        .bind(conversation_id)
        .execute(&mut holder)
        .await
        .unwrap();
    holder
}

/// Returns once a batch waits for a row lock.
async fn a_batch_waits_for_a_lock(db: &TestDb) {
    eventually(
        "the batch waits for the conversation's lock",
        Duration::from_secs(10),
        || async {
            db.count("SELECT count(*) FROM pg_locks WHERE NOT granted")
                .await
                > 0
        },
    )
    .await;
}

/// Each outcome's (seq, duplicate), `None` for a refused write.
fn seqs_of(outcomes: &[Result<CommitOutcome, StoreError>]) -> Vec<Option<(i64, bool)>> {
    outcomes
        .iter()
        .map(|outcome| {
            outcome
                .as_ref()
                .ok()
                .map(|stored| (stored.activity.seq, stored.duplicate))
        })
        .collect()
}

#[tokio::test]
async fn writes_queued_together_commit_in_one_batch_with_the_outcomes_they_have_alone() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let channel = web_channel(&store).await;
    let a = alice_conversation(&store, channel).await;
    let b = alice_conversation(&store, channel).await;
    let missing = Uuid::new_v4();

    // Frames: two conversations, a key repeated within the batch, a missing conversation.
    let frames = [
        frame(a, "a one", "k1"),
        frame(b, "b one", "k2"),
        frame(a, "a two", "k3"),
        frame(a, "a one, resent", "k1"),
        frame(missing, "nowhere", "k4"),
    ];
    let outcomes = commit_together(&store, &frames).await;
    assert_eq!(
        seqs_of(&outcomes),
        vec![
            Some((1, false)),
            Some((1, false)),
            Some((2, false)),
            Some((1, true)),
            None
        ]
    );
    assert!(matches!(outcomes[4], Err(StoreError::ConversationNotFound)));
    // What the batch returned is what the database holds, timestamps included.
    for (outcome, conversation_id) in outcomes.iter().take(4).zip([a, b, a, a]) {
        let outcome = outcome.as_ref().unwrap();
        assert_eq!(
            outcome.activity,
            stored(&store, conversation_id, outcome.activity.seq).await
        );
    }

    // Answers: a runtime write, the same answer twice in one batch, an unknown turn.
    let answers = [
        answer(
            a,
            1,
            Some(RuntimeWrite {
                version: 0,
                state: json!({"step": 1}),
            }),
        ),
        answer(b, 1, None),
        answer(a, 2, None),
        answer(a, 2, None),
        answer(a, 99, None),
    ];
    let outcomes: Vec<AnswerOutcome> =
        join_all(answers.iter().map(|answer| store.commit_answer(answer)))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
    let AnswerOutcome::Committed { activities, .. } = &outcomes[0] else {
        panic!("the first answer commits: {:?}", outcomes[0]);
    };
    assert_eq!(
        activities.iter().map(|a| a.seq).collect::<Vec<_>>(),
        vec![3, 4]
    );
    for activity in activities {
        assert_eq!(*activity, stored(&store, a, activity.seq).await);
    }
    assert!(
        matches!(&outcomes[1], AnswerOutcome::Committed { activities, .. } if activities.len() == 2)
    );
    let AnswerOutcome::Committed {
        activities: first, ..
    } = &outcomes[2]
    else {
        panic!("the answer to a's second turn commits: {:?}", outcomes[2]);
    };
    let AnswerOutcome::Duplicate { seqs, ids, .. } = &outcomes[3] else {
        panic!("the same answer again is a duplicate: {:?}", outcomes[3]);
    };
    assert_eq!(*seqs, first.iter().map(|a| a.seq).collect::<Vec<_>>());
    assert_eq!(*ids, first.iter().map(|a| a.id.clone()).collect::<Vec<_>>());
    assert_eq!(outcomes[4], AnswerOutcome::NoSuchTurn);
    assert_eq!(store.runtime(a).await.unwrap(), (1, json!({"step": 1})));

    // Both groups of writes went out as batches: each batch wrote one outbox row, naming its
    // conversations, however many frames it held.
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 2);
    assert_eq!(
        db.count("SELECT sum(frames)::bigint FROM outbox").await,
        3 + 6,
        "three new frames, then three answers of two frames each"
    );
}

#[tokio::test]
async fn a_batch_that_meets_a_stored_key_runs_again_and_answers_the_resend_with_the_stored_frame() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let channel = web_channel(&store).await;
    let open = alice_conversation(&store, channel).await;
    let closing = alice_conversation(&store, channel).await;
    let first = store
        .commit_activity(&frame(open, "one", "k1"))
        .await
        .unwrap();
    let before_close = store
        .commit_activity(&frame(closing, "before the close", "k2"))
        .await
        .unwrap();
    store
        .change_status(closing, StatusChange::Close, "done")
        .await
        .unwrap()
        .expect("the conversation exists");
    let outbox_before = db.count("SELECT count(*) FROM outbox").await;
    let closing_head = head_of(&db, closing).await;

    // One batch of new frames around a resend whose key it assumed new: its first run rolls
    // back, and its second reads the keys.
    let frames = [
        frame(open, "two", "k3"),
        frame(open, "one, resent", "k1"),
        frame(open, "three", "k4"),
    ];
    let outcomes = commit_together(&store, &frames).await;
    assert_eq!(
        seqs_of(&outcomes),
        vec![Some((2, false)), Some((1, true)), Some((3, false))]
    );
    for (index, seq) in [(0, 2), (2, 3)] {
        let outcome = outcomes[index].as_ref().unwrap();
        assert_eq!(outcome.activity, stored(&store, open, seq).await);
    }
    assert_eq!(outcomes[1].as_ref().unwrap().activity, first.activity);

    // A batch for the closed conversation reads its keys at once: a resend is answered with the
    // stored frame, a new frame is refused.
    let frames = [
        frame(closing, "before the close, resent", "k2"),
        frame(closing, "after the close", "k5"),
    ];
    let closed_outcomes = commit_together(&store, &frames).await;
    assert_eq!(
        seqs_of(&closed_outcomes),
        vec![Some((before_close.activity.seq, true)), None]
    );
    assert_eq!(
        closed_outcomes[0].as_ref().unwrap().activity,
        before_close.activity
    );
    assert!(
        matches!(closed_outcomes[1], Err(StoreError::ConversationClosed)),
        "{:?}",
        closed_outcomes[1]
    );

    // Gap-free and stored once: the open conversation holds seqs 1 to 3 and nothing else; the
    // closed one did not move; the rolled-back run left no outbox row, and the closed
    // conversation's batch wrote nothing.
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM activities WHERE conversation_id = '{open}'"
        ))
        .await,
        3
    );
    assert_eq!(head_of(&db, open).await, 3);
    assert_eq!(head_of(&db, closing).await, closing_head);
    assert_eq!(
        db.count("SELECT count(*) FROM outbox").await,
        outbox_before + 1
    );
}

#[tokio::test]
async fn a_batch_notifies_in_as_few_payloads_as_fit_under_the_limit() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let channel = web_channel(&store).await;
    let mut conversations = Vec::new();
    for _ in 0..6 {
        conversations.push(alice_conversation(&store, channel).await);
    }
    let mut listener = sqlx::postgres::PgListener::connect_with(store.pool())
        .await
        .unwrap();
    listener
        .listen(converger_store::NOTIFY_CHANNEL)
        .await
        .unwrap();

    // Six conversations' frames in one batch: five of 2 KB, which need more than one
    // notification between them, and one of 9 KB, which fits none and travels without its frame.
    let frames: Vec<NewActivity> = conversations
        .iter()
        .enumerate()
        .map(|(index, conversation)| {
            let size = if index == 5 { 9_000 } else { 2_000 };
            frame(*conversation, &"x".repeat(size), &format!("k{index}"))
        })
        .collect();
    let outcomes = commit_together(&store, &frames).await;
    assert!(outcomes.iter().all(Result::is_ok), "{outcomes:?}");

    let mut events = Vec::new();
    let mut notifications = 0;
    while events.len() < conversations.len() {
        let notification = tokio::time::timeout(Duration::from_secs(10), listener.recv())
            .await
            .expect("a notification in time")
            .unwrap();
        let payload = notification.payload();
        assert!(payload.len() < 7_500, "{} bytes", payload.len());
        let payload: serde_json::Value = serde_json::from_str(payload).unwrap();
        assert_eq!(payload["k"], "cb");
        notifications += 1;
        events.extend(payload["v"].as_array().unwrap().clone());
    }
    assert!(
        (2..=4).contains(&notifications),
        "{notifications} notifications"
    );
    for (index, conversation) in conversations.iter().enumerate() {
        let event = events
            .iter()
            .find(|event| event["c"] == json!(conversation))
            .expect("every conversation's commit is announced");
        assert_eq!(event["s"], 1);
        assert_eq!(event["h"], json!(channel));
        let carried = event
            .get("f")
            .map_or(0, |frames| frames.as_array().unwrap().len());
        assert_eq!(carried, usize::from(index != 5), "conversation {index}");
    }
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 1);
    // The listener holds a pooled connection, which the pool waits for when it closes.
    drop(listener);
    store.pool().close().await;
}

#[tokio::test]
async fn a_write_the_database_refuses_is_refused_alone_and_the_rest_of_its_batch_commits() {
    let db = TestDb::create().await;
    let mut admin = db.connect().await;
    // A real refusal by the database for one write: a trigger raises for one idempotency key.
    for statement in [
        "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.client_id = 'poison' THEN
                 RAISE EXCEPTION 'poisoned frame' USING ERRCODE = '22023';
             END IF;
             RETURN NEW;
         END $$",
        "CREATE TRIGGER refuse_poison BEFORE INSERT ON activities
         FOR EACH ROW EXECUTE FUNCTION refuse_poison()",
    ] {
        sqlx::query(statement).execute(&mut admin).await.unwrap();
    }
    let store = db.store().await;
    let channel = web_channel(&store).await;
    let conversation = alice_conversation(&store, channel).await;

    // Fifty honest frames with the poisoned one among them, queued together (one batch), and
    // a frame with a NUL character, which Postgres cannot store: the store refuses that one
    // before it joins any batch.
    let mut frames: Vec<NewActivity> = (0..50)
        .map(|n| frame(conversation, &format!("honest {n}"), &format!("h-{n}")))
        .collect();
    frames.insert(25, frame(conversation, "poison", "poison"));
    frames.push(frame(conversation, "nul \u{0}", "nul"));
    let outcomes = commit_together(&store, &frames).await;

    for index in [25, 51] {
        let refused = outcomes[index]
            .as_ref()
            .expect_err("a poisoned frame is refused");
        assert!(refused.is_refused_input(), "{refused}");
    }
    let mut seqs: Vec<i64> = outcomes
        .iter()
        .enumerate()
        .filter(|(index, _)| ![25, 51].contains(index))
        .map(|(_, outcome)| {
            let stored = outcome.as_ref().expect("an honest frame commits");
            assert!(!stored.duplicate);
            stored.activity.seq
        })
        .collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (1..=50).collect::<Vec<_>>(), "gap-free, each once");
    let stored = store.list_activities(conversation, 0, 100).await.unwrap();
    assert_eq!(stored.len(), 50);

    // The refused batch stored nothing; its writes then committed one by one, each with its own
    // outbox row.
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 50);
    store.pool().close().await;
}

/// Sequential scans, index scans and index entries read of the tables a batch reads, as
/// Postgres counts them.
async fn scans(db: &TestDb) -> (i64, i64, i64) {
    let mut connection = db.connect().await;
    sqlx::query_as(
        "SELECT coalesce(sum(seq_scan), 0)::bigint, coalesce(sum(idx_scan), 0)::bigint,
                (SELECT coalesce(sum(idx_tup_read), 0)::bigint FROM pg_stat_user_indexes
                 WHERE relname IN ('conversations', 'activities', 'turns', 'conversation_runtime'))
         FROM pg_stat_user_tables
         WHERE relname IN ('conversations', 'activities', 'turns', 'conversation_runtime')",
    )
    .fetch_one(&mut connection)
    .await
    .unwrap()
}

/// Closes the store's pool and waits until its backends are gone: a backend reports its table
/// statistics when it exits.
async fn close_and_report(db: &TestDb, store: Store) {
    store.pool().close().await;
    reported(db, "converger").await;
}

/// Waits until no backend of `db` named `application` is left.
async fn reported(db: &TestDb, application: &str) {
    let gone = format!(
        "SELECT count(*) FROM pg_stat_activity
         WHERE datname = '{}' AND application_name = '{application}'",
        db.name
    );
    eventually(
        "the store's backends exited",
        Duration::from_secs(20),
        || async { db.count(&gone).await == 0 },
    )
    .await;
}

/// Eight frames of `conversation` and their answers, in batches of `together` writes.
async fn frames_and_answers(store: &Store, conversation: Uuid, round: usize, together: usize) {
    let frames: Vec<NewActivity> = (0..8)
        .map(|n| {
            frame(
                conversation,
                &format!("round {round}, {n}"),
                &format!("r{round}-{n}"),
            )
        })
        .collect();
    for group in frames.chunks(together) {
        let outcomes = join_all(group.iter().map(|new| store.commit_activity(new))).await;
        let answers: Vec<TurnAnswer> = outcomes
            .iter()
            .map(|outcome| answer(conversation, outcome.as_ref().unwrap().activity.seq, None))
            .collect();
        for outcome in join_all(answers.iter().map(|answer| store.commit_answer(answer))).await {
            assert!(
                matches!(outcome, Ok(AnswerOutcome::Committed { .. })),
                "{outcome:?}"
            );
        }
    }
}

/// Has the store's one backend report its counts now, and waits until they show `at_least`
/// index scans in all.
async fn report_now(db: &TestDb, store: &Store, at_least: i64) -> (i64, i64, i64) {
    sqlx::query("SELECT pg_stat_force_next_flush()")
        .execute(store.pool())
        .await
        .unwrap();
    eventually(
        "the backend's counts reported",
        Duration::from_secs(20),
        || async { scans(db).await.1 >= at_least },
    )
    .await;
    scans(db).await
}

/// What a session's welcome reads (its handshake; the head, the pending interrupts and the
/// catalogs; the replay), six times over: a connection keeps a generic plan after five runs.
async fn welcome_reads(store: &Store, conversation: Uuid, channel: Uuid) {
    for _ in 0..6 {
        let (_, found) = store
            .channel_with_conversation(channel, Some(conversation))
            .await
            .unwrap()
            .expect("the channel");
        assert_eq!(found.expect("the conversation").id, conversation);
        let (_, none) = store
            .channel_with_conversation(channel, Some(Uuid::now_v7()))
            .await
            .unwrap()
            .expect("the channel");
        assert_eq!(none, None, "a conversation that does not exist");
        store
            .welcome_reads(conversation)
            .await
            .unwrap()
            .expect("the conversation");
        store.list_activities(conversation, 0, 20).await.unwrap();
    }
}

/// The handshake's one read (ADR 0044): a channel comes with the conversation named only when
/// that conversation is the channel's own.
#[tokio::test]
async fn a_channel_is_read_with_the_conversation_named_only_when_it_is_the_channels() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let channel = web_channel(&store).await;
    let conversation = alice_conversation(&store, channel).await;
    let other_channel = web_channel_of(&store, "globex").await;

    let (read_channel, read_conversation) = store
        .channel_with_conversation(channel, Some(conversation))
        .await
        .unwrap()
        .expect("the channel");
    assert_eq!(read_channel.id, channel);
    let read_conversation = read_conversation.expect("its own conversation");
    assert_eq!(
        (read_conversation.id, read_conversation.channel_id),
        (conversation, channel)
    );
    assert_eq!(read_conversation.user_id, "alice");

    let (read_channel, foreign) = store
        .channel_with_conversation(other_channel, Some(conversation))
        .await
        .unwrap()
        .expect("the other channel");
    assert_eq!(read_channel.id, other_channel);
    assert_eq!(foreign, None, "another channel's conversation");

    let (_, unnamed) = store
        .channel_with_conversation(channel, None)
        .await
        .unwrap()
        .expect("the channel");
    assert_eq!(unnamed, None);
    assert!(
        store
            .channel_with_conversation(Uuid::now_v7(), Some(conversation))
            .await
            .unwrap()
            .is_none(),
        "no such channel"
    );
    store.pool().close().await;
}

/// The batch's statements, and the welcome's look-ups (ADR 0044): a plan made while a table
/// was empty still reads through an index once the table is large.
#[tokio::test]
async fn a_batch_and_a_welcome_read_through_indexes_on_an_empty_and_on_a_large_table() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let channel = web_channel(&store).await;
    let conversation = alice_conversation(&store, channel).await;
    close_and_report(&db, store).await;
    // Before any plan is cached: an ALTER TABLE later would invalidate the cached plans.
    let mut admin = db.connect().await;
    for table in ["conversations", "activities", "turns"] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE {table} SET (autovacuum_enabled = false)"
        )))
        .execute(&mut admin)
        .await
        .unwrap();
    }
    sqlx::Connection::close(admin).await.unwrap();
    let (seq_empty, index_empty, _) = scans(&db).await;

    // One backend for every batch, so the plans it caches while the tables are empty (plpgsql
    // keeps a generic plan after five runs) are the ones it uses once they are large.
    let store = Store::connect(&StoreOptions {
        url: db.url.clone(),
        max_connections: 1,
        acquire_timeout: Duration::from_secs(5),
        statement_timeout: Duration::from_secs(5),
        commit_workers: 1,
        notify_in_commit: true,
    })
    .await
    .unwrap();
    frames_and_answers(&store, conversation, 0, 1).await;
    welcome_reads(&store, conversation, channel).await;
    let (seq, _, _) = report_now(&db, &store, index_empty + 16).await;
    assert_eq!(seq, seq_empty, "no sequential scan on the empty tables");

    // 30,000 conversations and 80,000 frames and 60,000 turns more, with no new statistics
    // (autovacuum off) and nothing that invalidates the cached plans: they were made for
    // empty tables.
    let mut loader = db.connect().await;
    for statement in [
        "SET application_name = 'bulk'",
        "INSERT INTO conversations (id, tenant_id, channel_id, user_id, last_seq)
         SELECT gen_random_uuid(), c.tenant_id, c.channel_id, 'u' || n, 2
         FROM conversations c, generate_series(1, 30000) AS n",
        "INSERT INTO activities (conversation_id, seq, id, type, sender_id, sender_role, data, client_id)
         SELECT c.id, s, c.id || '-' || s, 'text', c.user_id, 'user', '{}', 'k' || s
         FROM conversations c, generate_series(1, 2) AS s WHERE c.user_id <> 'alice'",
        "INSERT INTO turns (conversation_id, seq, revision, status)
         SELECT conversation_id, seq, 0, 'pending' FROM activities WHERE sender_id <> 'alice'",
        // A long history in alice's own conversation too (far above her head), which a
        // look-up by conversation alone would read through.
        "INSERT INTO activities (conversation_id, seq, id, type, sender_id, sender_role, data, client_id)
         SELECT c.id, 1000000 + s, 'old-' || s, 'text', 'alice', 'user', '{}', 'old-' || s
         FROM conversations c, generate_series(1, 20000) AS s WHERE c.user_id = 'alice'",
    ] {
        sqlx::query(statement).execute(&mut loader).await.unwrap();
    }
    sqlx::Connection::close(loader).await.unwrap();
    reported(&db, "bulk").await;
    let (seq_large, index_large, read_large) = scans(&db).await;

    frames_and_answers(&store, conversation, 1, 8).await;
    welcome_reads(&store, conversation, channel).await;
    let (seq, _, read) = report_now(&db, &store, index_large + 16).await;
    assert_eq!(seq, seq_large, "no sequential scan on the large tables");
    let entries_read = read - read_large;
    assert!(
        entries_read < 1_000,
        "the batches and welcomes read {entries_read} index entries of the large tables: whole indexes, not their keys"
    );
    store.pool().close().await;
}

/// Events of `events` up to the transient frame `marker` published after them: notifications
/// arrive in commit order, so whatever a commit before the marker notified has arrived by then.
async fn bus_events_until(
    events: &mut tokio::sync::mpsc::UnboundedReceiver<BusEvent>,
    marker: &str,
) -> Vec<BusEvent> {
    let mut seen = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(10), events.recv())
            .await
            .expect("bus events keep coming")
            .expect("the bus stays open");
        if matches!(&event, BusEvent::Transient(transient) if transient.node == marker) {
            return seen;
        }
        seen.push(event);
    }
}

#[tokio::test]
async fn a_node_hears_its_own_batch_once_from_its_worker_and_other_nodes_from_the_notification() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let other_node = db.store().await;
    let channel = web_channel(&store).await;
    let conversation = alice_conversation(&store, channel).await;
    let (mut own_events, listening) = store.spawn_bus_listener("node-a");
    listening.await.unwrap();
    let (mut other_events, listening) = other_node.spawn_bus_listener("node-b");
    listening.await.unwrap();

    let committed = store
        .commit_activity(&frame(conversation, "hello", "c-1"))
        .await
        .unwrap();
    let seq = committed.activity.seq;
    other_node
        .publish_transients(&[TransientFrame {
            node: "marker".into(),
            channel_id: None,
            conversation_id: conversation,
            frame: json!({"type": "typing"}),
            origin: None,
            agents_only: false,
        }])
        .await
        .unwrap();

    let committed_events = |events: Vec<BusEvent>| -> Vec<BusEvent> {
        events
            .into_iter()
            .filter(|event| matches!(event, BusEvent::Committed { .. }))
            .collect()
    };
    // The committing node: once, from its worker, frame attached and the channel named (the
    // batch read it with its lock, so the node need not look it up); its own notification is
    // skipped.
    let own = committed_events(bus_events_until(&mut own_events, "marker").await);
    assert_eq!(
        own.len(),
        1,
        "one event for the commit, not its echo too: {own:?}"
    );
    assert!(matches!(
        &own[0],
        BusEvent::Committed { first_seq, seq: last, channel_id: Some(named), frames, .. }
            if *first_seq == seq && *last == seq && *named == channel && frames.len() == 1
                && frames[0].seq == seq
    ));
    // Another node decodes the notification, which names the channel.
    let other = committed_events(bus_events_until(&mut other_events, "marker").await);
    assert_eq!(other.len(), 1, "{other:?}");
    assert!(matches!(
        &other[0],
        BusEvent::Committed { seq: last, channel_id: Some(named), frames, .. }
            if *last == seq && *named == channel && frames.len() == 1
    ));
}

/// The runtime versions the `Committed` events of `events` name, by last seq, up to `marker`.
async fn runtime_versions_until(
    events: &mut tokio::sync::mpsc::UnboundedReceiver<BusEvent>,
    marker: &str,
) -> Vec<(i64, Option<i64>)> {
    bus_events_until(events, marker)
        .await
        .into_iter()
        .filter_map(|event| match event {
            BusEvent::Committed { seq, runtime, .. } => {
                Some((seq, runtime.map(|runtime| runtime.version)))
            }
            _ => None,
        })
        .collect()
}

/// ADR 0039: every commit names the runtime version its conversation commits with: the one an
/// answer without frames wrote, and the one a batch that held the conversation's lock left,
/// even when that batch committed while this one waited for the lock (a row of another table
/// read with the lock would still show the version from before the wait).
#[tokio::test]
async fn a_commit_names_the_runtime_version_left_by_the_batch_it_waited_for() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let channel = web_channel(&store).await;
    let conversation = alice_conversation(&store, channel).await;
    let (mut events, listening) = store.spawn_bus_listener("node-a");
    listening.await.unwrap();
    let marker = |name: &str| TransientFrame {
        node: name.into(),
        channel_id: None,
        conversation_id: conversation,
        frame: json!({"type": "typing"}),
        origin: None,
        agents_only: false,
    };
    let version_on_row =
        format!("SELECT runtime_version FROM conversations WHERE id = '{conversation}'");

    let first = store
        .commit_activity(&frame(conversation, "one", "c-1"))
        .await
        .unwrap();
    let mut runtime_only = answer(
        conversation,
        first.activity.seq,
        Some(RuntimeWrite {
            version: 0,
            state: json!({"step": 1}),
        }),
    );
    runtime_only.frames.clear();
    let answered = store.commit_answer(&runtime_only).await.unwrap();
    assert!(
        matches!(answered, AnswerOutcome::Committed { .. }),
        "{answered:?}"
    );
    assert_eq!(db.count(&version_on_row).await, 1);
    store.publish_transients(&[marker("first")]).await.unwrap();
    assert_eq!(
        runtime_versions_until(&mut events, "first").await,
        vec![(first.activity.seq, Some(0))],
        "the answer without frames announces nothing"
    );

    // Another transaction holds the conversation's lock and moves the runtime, as a batch
    // would, while the next frame's batch waits for the lock.
    let mut holder = lock_conversation(&db, conversation).await;
    let writer = store.clone();
    let second = tokio::spawn(async move {
        writer
            .commit_activity(&frame(conversation, "two", "c-2"))
            .await
    });
    a_batch_waits_for_a_lock(&db).await;
    sqlx::query(
        "UPDATE conversation_runtime SET version = 2, state = '{\"step\": 2}'
          WHERE conversation_id = $1",
    )
    .bind(conversation)
    .execute(&mut holder)
    .await
    .unwrap();
    sqlx::query("UPDATE conversations SET runtime_version = 2 WHERE id = $1")
        .bind(conversation)
        .execute(&mut holder)
        .await
        .unwrap();
    sqlx::query("COMMIT").execute(&mut holder).await.unwrap();
    let second = second.await.unwrap().unwrap();
    store.publish_transients(&[marker("second")]).await.unwrap();
    assert_eq!(
        runtime_versions_until(&mut events, "second").await,
        vec![(second.activity.seq, Some(2))]
    );
}

#[tokio::test]
async fn a_batch_stuck_on_a_lock_holds_up_the_writes_beside_it_only_briefly() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let channel = web_channel(&store).await;
    let stuck = alice_conversation(&store, channel).await;
    let other = alice_conversation(&store, channel).await;

    // Another transaction holds the first conversation's lock: its batch stays in flight.
    let mut holder = lock_conversation(&db, stuck).await;
    let writer = store.clone();
    let waiting =
        tokio::spawn(async move { writer.commit_activity(&frame(stuck, "stuck", "s-1")).await });
    a_batch_waits_for_a_lock(&db).await;

    // Writes beside it wait for it only a moment (ADR 0042), then start a batch of their own:
    // a single one, and a batch's worth. Both sooner than the stuck batch's statement times out
    // (5 s), which would also free them.
    for count in [1, 32] {
        let frames: Vec<NewActivity> = (0..count)
            .map(|n| frame(other, "beside", &format!("b-{count}-{n}")))
            .collect();
        let outcomes =
            tokio::time::timeout(Duration::from_secs(4), commit_together(&store, &frames))
                .await
                .expect("writes beside the stuck batch commit");
        let seqs: Vec<_> = seqs_of(&outcomes).into_iter().flatten().collect();
        assert_eq!(seqs.len(), count, "{outcomes:?}");
        assert!(!waiting.is_finished(), "the first batch still waits");
    }

    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    let stored = waiting.await.unwrap().unwrap();
    assert_eq!(stored.activity.seq, 1);
}
