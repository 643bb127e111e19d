//! Group commit's batch path against a real Postgres: writes queued together commit as one call
//! of `converger_commit_batch`, with the outcomes each would have had alone.
//!
//! `#[tokio::test]` runs on one thread, so the store's commit workers run only when this test
//! waits: writes started with one `join_all` are all queued before a worker takes them, and go
//! out as one batch.

mod support;

use std::time::Duration;

use converger_store::{
    AnswerFrame, AnswerOutcome, CommitOutcome, NewActivity, RuntimeWrite, Sender, SenderRole,
    Store, StoreError, TurnAnswer,
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

/// The stored frame with `seq`, read back the way replays read it.
async fn stored(store: &Store, conversation_id: Uuid, seq: i64) -> converger_store::Activity {
    let mut rows = store
        .list_activities(conversation_id, seq - 1, 1)
        .await
        .unwrap();
    rows.pop().expect("the frame is stored")
}

/// Calls of the batch function counted by Postgres so far (the pool's backends report theirs
/// when they exit).
async fn batch_calls(db: &TestDb) -> i64 {
    db.count(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_user_functions
         WHERE funcname = 'converger_commit_batch'",
    )
    .await
}

#[tokio::test]
async fn writes_queued_together_commit_in_one_batch_with_the_outcomes_they_have_alone() {
    let db = TestDb::create().await;
    // Postgres counts calls of plpgsql functions only when asked to.
    let mut admin = db.connect().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {} SET track_functions = 'pl'",
        db.name
    )))
    .execute(&mut admin)
    .await
    .unwrap();
    let store = db.store().await;
    let (tenant, _) = store.create_tenant("acme").await.unwrap();
    let (channel, _) = store.create_channel(tenant.id, "web").await.unwrap();
    let a = store
        .create_conversation(channel.id, "alice")
        .await
        .unwrap()
        .id;
    let b = store
        .create_conversation(channel.id, "alice")
        .await
        .unwrap()
        .id;
    let missing = Uuid::new_v4();

    // Frames: two conversations, a key repeated within the batch, a missing conversation.
    let frames = [
        frame(a, "a one", "k1"),
        frame(b, "b one", "k2"),
        frame(a, "a two", "k3"),
        frame(a, "a one, resent", "k1"),
        frame(missing, "nowhere", "k4"),
    ];
    let outcomes: Vec<Result<CommitOutcome, StoreError>> =
        join_all(frames.iter().map(|new| store.commit_activity(new))).await;
    let seqs: Vec<Option<(i64, bool)>> = outcomes
        .iter()
        .map(|outcome| {
            outcome
                .as_ref()
                .ok()
                .map(|stored| (stored.activity.seq, stored.duplicate))
        })
        .collect();
    assert_eq!(
        seqs,
        vec![
            Some((1, false)),
            Some((1, false)),
            Some((2, false)),
            Some((1, true)),
            None
        ]
    );
    assert!(matches!(outcomes[4], Err(StoreError::ConversationNotFound)));
    // What the batch returned as JSON is what the database holds, timestamps included.
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

    // Both groups of writes went out as batches.
    store.pool().close().await;
    eventually(
        "two batch calls counted",
        Duration::from_secs(10),
        || async { batch_calls(&db).await >= 2 },
    )
    .await;
    assert_eq!(batch_calls(&db).await, 2);
}

/// Calls of the isolated batch function (the fallback after a refused batch) counted so far.
async fn isolated_calls(db: &TestDb) -> i64 {
    db.count(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_user_functions
         WHERE funcname = 'converger_commit_batch_isolated'",
    )
    .await
}

#[tokio::test]
async fn a_write_the_database_refuses_costs_its_batch_one_more_statement() {
    let db = TestDb::create().await;
    let mut admin = db.connect().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE {} SET track_functions = 'pl'",
        db.name
    )))
    .execute(&mut admin)
    .await
    .unwrap();
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
    let (tenant, _) = store.create_tenant("acme").await.unwrap();
    let (channel, _) = store.create_channel(tenant.id, "web").await.unwrap();
    let conversation = store
        .create_conversation(channel.id, "alice")
        .await
        .unwrap()
        .id;

    // Fifty honest frames with the poisoned one among them, queued together (one batch), and
    // a frame with a NUL character, which Postgres could not even parse as the batch's
    // argument: the store refuses that one before it joins any batch.
    let mut frames: Vec<NewActivity> = (0..50)
        .map(|n| frame(conversation, &format!("honest {n}"), &format!("h-{n}")))
        .collect();
    frames.insert(25, frame(conversation, "poison", "poison"));
    frames.push(frame(conversation, "nul \u{0}", "nul"));
    let outcomes: Vec<Result<CommitOutcome, StoreError>> =
        join_all(frames.iter().map(|new| store.commit_activity(new))).await;

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

    // One refused batch, committed again in one isolated statement, not write by write.
    store.pool().close().await;
    eventually(
        "the isolated batch call counted",
        Duration::from_secs(10),
        || async { isolated_calls(&db).await >= 1 },
    )
    .await;
    assert_eq!(isolated_calls(&db).await, 1);
}
