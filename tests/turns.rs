//! The turn registry and one-transaction answers against a real Postgres.

mod support;

use converger_store::{
    AnswerFrame, AnswerOutcome, NewActivity, RuntimeWrite, Sender, SenderRole, Store, TurnAnswer,
};
use serde_json::{Map, json};
use support::TestDb;
use uuid::Uuid;

async fn conversation(store: &Store) -> Uuid {
    let (tenant, _) = store.create_tenant("acme").await.unwrap();
    let (channel, _) = store
        .create_channel(tenant.id, "web", &converger_store::TurnSettings::default())
        .await
        .unwrap();
    store
        .create_conversation(channel.id, "alice")
        .await
        .unwrap()
        .id
}

async fn user_turn(store: &Store, conversation_id: Uuid, text: &str) -> i64 {
    let new = NewActivity {
        conversation_id,
        id: None,
        kind: "text".into(),
        sender: Sender {
            id: "alice".into(),
            role: SenderRole::User,
        },
        data: json!({"text": text}),
        metadata: None,
        extra: None,
        client_id: None,
    };
    store.commit_activity(&new).await.unwrap().activity.seq
}

fn answer(
    conversation_id: Uuid,
    seq: i64,
    text: &str,
    runtime: Option<(i64, serde_json::Value)>,
) -> TurnAnswer {
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
                data: json!({"text": text}),
                metadata: None,
                extra: Map::new(),
            },
            AnswerFrame {
                id: Some("evt-1".into()),
                kind: "event".into(),
                data: json!({"done": true}),
                metadata: None,
                extra: Map::new(),
            },
        ],
        runtime: runtime.map(|(version, state)| RuntimeWrite { version, state }),
    }
}

#[tokio::test]
async fn an_answer_commits_frames_runtime_and_completion_together_and_resends_are_idempotent() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let conversation_id = conversation(&store).await;
    let turn = user_turn(&store, conversation_id, "hi").await;
    let reply = answer(
        conversation_id,
        turn,
        "hello",
        Some((0, json!({"count": 1}))),
    );

    let AnswerOutcome::Committed { activities, .. } = store.commit_answer(&reply).await.unwrap()
    else {
        panic!("first answer commits");
    };
    let seqs: Vec<i64> = activities.iter().map(|activity| activity.seq).collect();
    assert_eq!(seqs, vec![2, 3]);
    assert_eq!(activities[1].id, "evt-1", "an agent's frame id is kept");
    assert_eq!(
        store.runtime(conversation_id).await.unwrap(),
        (1, json!({"count": 1}))
    );
    assert_eq!(
        db.count("SELECT count(*) FROM turns WHERE status = 'completed'")
            .await,
        1
    );
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM outbox
             WHERE conversations = ARRAY['{conversation_id}']::uuid[] AND last_seqs = '{{3}}'
               AND frames = 2"
        ))
        .await,
        1,
        "the answer's batch announced both frames in one outbox row"
    );

    for _ in 0..100 {
        match store.commit_answer(&reply).await.unwrap() {
            AnswerOutcome::Duplicate {
                ids, seqs: again, ..
            } => {
                assert_eq!(again, seqs);
                assert_eq!(ids.len(), 2);
            }
            other => panic!("a resend is a duplicate, got {other:?}"),
        }
    }
    assert_eq!(
        db.count("SELECT count(*) FROM activities").await,
        3,
        "one logical commit"
    );
    assert_eq!(store.runtime(conversation_id).await.unwrap().0, 1);

    let different = answer(conversation_id, turn, "something else", None);
    assert_eq!(
        store.commit_answer(&different).await.unwrap(),
        AnswerOutcome::Conflict { seqs }
    );
    assert_eq!(db.count("SELECT count(*) FROM activities").await, 3);
}

#[tokio::test]
async fn stale_runtime_superseded_revisions_and_unknown_turns_store_nothing() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let conversation_id = conversation(&store).await;
    let first = user_turn(&store, conversation_id, "one").await;
    let second = user_turn(&store, conversation_id, "two").await;
    let committed = store
        .commit_answer(&answer(
            conversation_id,
            first,
            "a",
            Some((0, json!({"n": 1}))),
        ))
        .await
        .unwrap();
    assert!(matches!(committed, AnswerOutcome::Committed { .. }));

    // The second answer read version 0, but the first answer moved it to 1.
    let stale = store
        .commit_answer(&answer(
            conversation_id,
            second,
            "b",
            Some((0, json!({"n": 2}))),
        ))
        .await
        .unwrap();
    assert_eq!(stale, AnswerOutcome::StaleRuntime { current: 1 });
    // A newer revision of the second turn exists: the answer to revision 0 is superseded.
    let mut connection = db.connect().await;
    sqlx::query("INSERT INTO turns (conversation_id, seq, revision, status, reason) VALUES ($1, $2, 1, 'pending', 'regenerate')")
        .bind(conversation_id)
        .bind(second)
        .execute(&mut connection)
        .await
        .unwrap();
    let superseded = store
        .commit_answer(&answer(conversation_id, second, "b", Some((1, json!({})))))
        .await
        .unwrap();
    assert_eq!(superseded, AnswerOutcome::Superseded { latest: 1 });
    assert_eq!(
        store
            .commit_answer(&answer(conversation_id, 99, "x", None))
            .await
            .unwrap(),
        AnswerOutcome::NoSuchTurn
    );
    assert_eq!(
        db.count("SELECT count(*) FROM activities").await,
        4,
        "two turns and one two-frame answer"
    );
    assert_eq!(store.runtime(conversation_id).await.unwrap().0, 1);

    // Revision 1 is pending; the answered first turn is not.
    let pending = store
        .pending_turns(conversation_id, &[first, second])
        .await
        .unwrap();
    assert_eq!(
        pending
            .iter()
            .map(|turn| (turn.turn_seq, turn.revision))
            .collect::<Vec<_>>(),
        vec![(second, 1)]
    );
}

#[tokio::test]
async fn racing_answers_to_one_turn_commit_exactly_one() {
    let db = TestDb::create().await;
    let store = db.store().await;
    let conversation_id = conversation(&store).await;
    let turn = user_turn(&store, conversation_id, "race").await;
    let racers = (0..8).map(|n| {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .commit_answer(&answer(conversation_id, turn, &format!("answer {n}"), None))
                .await
        })
    });
    let outcomes: Vec<AnswerOutcome> = futures::future::join_all(racers)
        .await
        .into_iter()
        .map(|joined| joined.unwrap().unwrap())
        .collect();
    let committed = outcomes
        .iter()
        .filter(|outcome| matches!(outcome, AnswerOutcome::Committed { .. }))
        .count();
    let conflicts = outcomes
        .iter()
        .filter(|outcome| matches!(outcome, AnswerOutcome::Conflict { .. }))
        .count();
    assert_eq!((committed, conflicts), (1, 7));
    assert_eq!(
        db.count("SELECT count(*) FROM activities WHERE turn_seq IS NOT NULL")
            .await,
        2
    );
}
