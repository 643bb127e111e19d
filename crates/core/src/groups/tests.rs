//! Unit and property tests of ownership, passed-turn memory and takeover.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeSet;

#[test]
fn an_overflowing_conversation_records_what_fell_out() {
    let mut memory = PassedTurns::new(10, 2);
    memory.remember("c", "m1", (1, 0), 10);
    memory.remember("c", "m1", (2, 0), 20);
    assert!(memory.overflowed().is_empty());
    memory.remember("c", "m2", (3, 0), 30);
    memory.remember("c", "m2", (4, 0), 40);
    assert_eq!(memory.overflowed(), vec![("c".to_owned(), 2)]);
    memory.clear_overflow("c");
    assert!(memory.overflowed().is_empty());
    let kept: Vec<i64> = memory
        .get("c")
        .unwrap()
        .passes
        .iter()
        .map(|pass| pass.seq)
        .collect();
    assert_eq!(kept, [3, 4]);
}

/// Test vectors: these values are part of the contract (ADR 0006).
#[test]
fn hash_test_vectors() {
    assert_eq!(owner_hash("", ""), splitmix64(0xaf63_bd4c_8601_b7df));
    let vectors = [
        ("conv-1", "conn-a"),
        ("conv-1", "conn-b"),
        (
            "01a22950-e27c-70ee-8573-bb2efb3893ae",
            "7766ad75-64f7-404e-9ed5-16a5dd98a336",
        ),
    ];
    let hashes: Vec<u64> = vectors
        .iter()
        .map(|(conversation, connection)| owner_hash(conversation, connection))
        .collect();
    assert_eq!(hashes, vec![EXPECTED[0], EXPECTED[1], EXPECTED[2]]);
    // The separator matters: ("ab", "c") and ("a", "bc") differ.
    assert_ne!(owner_hash("ab", "c"), owner_hash("a", "bc"));
}

const EXPECTED: [u64; 3] = [
    0x7359_ab5a_f7de_ae7c,
    0xbd75_37db_2f81_0133,
    0x445f_1dda_713c_3f46,
];

#[test]
fn owner_prefers_eligible_members_and_falls_back_to_all() {
    let mut view = GroupView::new();
    view.join("a", 100);
    view.join("b", 200);
    assert_eq!(
        view.owner("conv", 150),
        Some("a"),
        "only a is eligible at 150"
    );
    assert_eq!(
        view.owner("conv", 50),
        Some("a"),
        "nobody eligible: the earliest member counts"
    );
    view.join("c", 100);
    let early = view.owner("conv", 50).unwrap();
    assert!(
        early == "a" || early == "c",
        "members sharing the earliest since both count"
    );
    assert_eq!(GroupView::new().owner("conv", 0), None);
}

#[test]
fn memory_is_bounded_oldest_first() {
    let mut passed = PassedTurns::new(2, 2);
    passed.remember("c1", "a", (1, 0), 0);
    passed.remember("c2", "a", (1, 0), 0);
    passed.remember("c3", "b", (1, 0), 0);
    assert!(passed.get("c1").is_none());
    assert_eq!(passed.len(), 2);
    passed.remember("c3", "b", (5, 0), 0);
    passed.remember("c3", "a", (7, 0), 0);
    let kept: Vec<i64> = passed
        .get("c3")
        .unwrap()
        .passes
        .iter()
        .map(|pass| pass.seq)
        .collect();
    assert_eq!(
        kept,
        vec![5, 7],
        "per conversation the most recent passes are kept"
    );
    passed.answered("c3", (5, 0));
    assert_eq!(passed.get("c3").unwrap().passes.len(), 1);
}

#[test]
fn take_over_moves_only_the_departed_members_conversations() {
    let mut view = GroupView::new();
    for member in ["a", "b", "c"] {
        view.join(member, 0);
    }
    let mut passed = PassedTurns::new(100, 16);
    for n in 0..30 {
        let conversation = format!("conv-{n}");
        let owner = view.owner(&conversation, 10).unwrap().to_owned();
        passed.remember(&conversation, &owner, (3, 0), 10);
    }
    let departed = "b";
    let before: Vec<(String, String)> = (0..30)
        .map(|n| format!("conv-{n}"))
        .map(|conversation| {
            (
                conversation.clone(),
                passed.get(&conversation).unwrap().passes[0].owner.clone(),
            )
        })
        .collect();
    view.leave(departed);
    let decisions = passed.take_over(&view);
    let moved: BTreeSet<String> = decisions
        .iter()
        .map(|decision| decision.conversation_id.clone())
        .collect();
    for (conversation, owner) in before {
        assert_eq!(
            moved.contains(&conversation),
            owner == departed,
            "{conversation}"
        );
    }
    assert!(
        decisions
            .iter()
            .all(|decision| decision.new_owner != departed && decision.seqs == vec![3])
    );
}

/// One event of the simulated world.
#[derive(Debug, Clone)]
enum Event {
    Join,
    Leave(usize),
    Turn(usize),
    Tick(u8),
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        1 => Just(Event::Join),
        1 => (0usize..8).prop_map(Event::Leave),
        5 => (0usize..6).prop_map(Event::Turn),
        2 => (0u8..200).prop_map(Event::Tick),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1_000))]

    /// Rendezvous: a member joining (eligible for every turn) takes only conversations it
    /// now wins, and a member leaving moves only the conversations it had.
    #[test]
    fn ownership_moves_only_with_the_member_that_came_or_went(
        members in proptest::collection::btree_set("[a-z0-9]{1,12}", 2..8),
        newcomer in "[A-Z]{1,12}",
    ) {
        let mut view = GroupView::new();
        for member in &members {
            view.join(member, 0);
        }
        let conversations: Vec<String> = (0..200).map(|n| format!("conversation-{n}")).collect();
        let before: Vec<String> = conversations.iter().map(|c| view.owner(c, 10).unwrap().to_owned()).collect();
        let mut joined = view.clone();
        joined.join(&newcomer, 0);
        for (conversation, owner) in conversations.iter().zip(&before) {
            let now = joined.owner(conversation, 10).unwrap();
            prop_assert!(now == owner || now == newcomer);
        }
        let departed = members.iter().next().unwrap().clone();
        let mut left = view.clone();
        left.leave(&departed);
        for (conversation, owner) in conversations.iter().zip(&before) {
            let now = left.owner(conversation, 10).unwrap();
            prop_assert!(now == owner || *owner == departed);
        }
    }

    /// Nodes learn joins and leaves late (by less than the settle delay) and each decides
    /// alone. Checked: a turn is delivered by exactly one node at commit time (no duplicate),
    /// and after any leave every unanswered turn of the departed member has a live owner that
    /// receives it (none delivered to nobody).
    #[test]
    fn every_turn_has_one_owner_and_no_turn_is_stranded(
        events in proptest::collection::vec(event(), 1..80),
        lag_a in 0i64..400,
        lag_b in 0i64..400,
    ) {
        const SETTLE: i64 = 1_000;
        let mut now = 0i64;
        let mut next_member = 0usize;
        // Ground truth and two nodes' views, each learning a join `lag` ms late.
        let mut truth = GroupView::new();
        let mut pending_joins: Vec<(i64, String, i64)> = Vec::new();
        let mut views = [GroupView::new(), GroupView::new()];
        let lags = [lag_a, lag_b];
        let mut memories = [PassedTurns::new(1_000, 1_000), PassedTurns::new(1_000, 1_000)];
        // Which node hosts each member: members alternate between the two nodes.
        fn host(member: &str) -> usize {
            member.trim_start_matches('m').parse::<usize>().unwrap_or(0) % 2
        }
        // A node performs the takeovers that name one of its own members.
        fn apply(
            node: usize,
            decisions: Vec<TakeOver>,
            delivered: &mut BTreeMap<(String, i64), String>,
            answered: &BTreeSet<(String, i64)>,
        ) {
            for decision in decisions {
                if host(&decision.new_owner) != node {
                    continue;
                }
                for seq in decision.seqs {
                    let key = (decision.conversation_id.clone(), seq);
                    if answered.contains(&key) {
                        continue;
                    }
                    if let Some(owner) = delivered.get_mut(&key) {
                        *owner = decision.new_owner.clone();
                    } else {
                        // Passed to nobody at the time: delivered now by the takeover.
                        delivered.insert(key, decision.new_owner.clone());
                    }
                }
            }
        }
        let mut answered: BTreeSet<(String, i64)> = BTreeSet::new();
        let mut delivered: BTreeMap<(String, i64), String> = BTreeMap::new();
        let mut seq_of: BTreeMap<String, i64> = BTreeMap::new();
        for event in events {
            now += 1;
            // Joins become visible to each node after its lag; a node that sees a join hands
            // it turns stranded by members that left an empty group.
            for node in 0..2 {
                let mut joined = false;
                for (at, member, since) in &pending_joins {
                    if now >= at + lags[node] && !views[node].contains(member) && truth.contains(member) {
                        views[node].join(member, *since);
                        joined = true;
                    }
                }
                if joined {
                    let decisions = memories[node].take_over(&views[node]);
                    apply(node, decisions, &mut delivered, &answered);
                }
            }
            match event {
                Event::Join => {
                    let member = format!("m{next_member}");
                    next_member += 1;
                    let since = now + SETTLE;
                    truth.join(&member, since);
                    pending_joins.push((now, member, since));
                }
                Event::Leave(index) => {
                    let Some(member) = truth.members().map(|(member, _)| member.to_owned()).nth(index) else { continue };
                    truth.leave(&member);
                    // Leaves are seen by every node (node death / socket close) before
                    // takeover runs; each node runs its own takeover.
                    for node in 0..2 {
                        views[node].leave(&member);
                        let decisions = memories[node].take_over(&views[node]);
                        apply(node, decisions, &mut delivered, &answered);
                    }
                }
                Event::Turn(conversation_index) => {
                    if truth.is_empty() {
                        continue;
                    }
                    let conversation = format!("c{conversation_index}");
                    let seq = seq_of.entry(conversation.clone()).or_insert(0);
                    *seq += 1;
                    let seq = *seq;
                    let mut deliverers = Vec::new();
                    for node in 0..2 {
                        // A node that knows no member yet still remembers the turn, passed to
                        // nobody, so the member it hears of next takes it over.
                        let owner = views[node].owner(&conversation, now).unwrap_or(NOBODY).to_owned();
                        memories[node].remember(&conversation, &owner, (seq, 0), now);
                        if owner != NOBODY && host(&owner) == node {
                            deliverers.push(owner);
                        }
                    }
                    prop_assert!(deliverers.len() <= 1, "delivered twice: {deliverers:?}");
                    if let Some(owner) = deliverers.pop() {
                        delivered.insert((conversation, seq), owner);
                    }
                }
                Event::Tick(ms) => {
                    now += i64::from(ms);
                    // Owners answer everything they hold at each tick.
                    for (key, owner) in &delivered {
                        if truth.contains(owner) {
                            answered.insert(key.clone());
                        }
                    }
                }
            }
        }
        // Let every join propagate, then check: nothing unanswered sits with a member that
        // is gone.
        for node in 0..2 {
            let mut joined = false;
            for (_, member, since) in &pending_joins {
                if !views[node].contains(member) && truth.contains(member) {
                    views[node].join(member, *since);
                    joined = true;
                }
            }
            if joined {
                let decisions = memories[node].take_over(&views[node]);
                apply(node, decisions, &mut delivered, &answered);
            }
        }
        for (key, owner) in &delivered {
            if !answered.contains(key) && !truth.is_empty() {
                prop_assert!(truth.contains(owner), "turn {key:?} stranded with departed {owner}");
            }
        }
    }
}

#[test]
fn a_joiner_takes_the_turns_it_owns_that_went_to_another_member_before_it_was_known() {
    // Node view without the joiner: "b" owns everything. With the joiner "a" (earlier since,
    // both not yet eligible at the turns' time), "a" owns every conversation.
    let mut view = GroupView::new();
    view.join("b", 2_000);
    let mut passed = PassedTurns::new(100, 16);
    for n in 0..10 {
        passed.remember(&format!("conv-{n}"), "b", (1, 0), 10);
    }
    view.join("a", 1_000);
    let decisions = passed.hand_to_joiner(&view, "a", |_| false);
    let moved: usize = decisions.iter().map(|decision| decision.seqs.len()).sum();
    assert_eq!(moved, 10);
    assert!(decisions.iter().all(|decision| decision.new_owner == "a"));
    // Remembered under the joiner now: a second call moves nothing, nor does a takeover.
    assert!(passed.hand_to_joiner(&view, "a", |_| false).is_empty());
    assert!(passed.take_over(&view).is_empty());
}

#[test]
fn a_joiner_takes_nothing_another_member_still_owns() {
    let mut view = GroupView::new();
    for member in ["b", "c"] {
        view.join(member, 0);
    }
    let mut passed = PassedTurns::new(100, 16);
    for n in 0..30 {
        let conversation = format!("conv-{n}");
        let owner = view.owner(&conversation, 10).unwrap().to_owned();
        passed.remember(&conversation, &owner, (1, 0), 10);
    }
    // Eligible only after the turns: it owns none of them.
    view.join("a", 20);
    assert!(passed.hand_to_joiner(&view, "a", |_| false).is_empty());
}

#[test]
fn a_joiner_leaves_a_turn_with_a_member_of_its_own_node() {
    let mut view = GroupView::new();
    view.join("b", 2_000);
    let mut passed = PassedTurns::new(100, 16);
    passed.remember("conv-1", "b", (1, 0), 10);
    view.join("a", 1_000);
    assert!(
        passed
            .hand_to_joiner(&view, "a", |owner| owner == "b")
            .is_empty()
    );
}

#[test]
fn an_answered_conversation_is_forgotten_and_the_oldest_open_one_goes_first() {
    let mut passed = PassedTurns::new(2, 4);
    passed.remember("c1", "a", (1, 0), 0);
    passed.remember("c2", "a", (1, 0), 0);
    passed.answered("c1", (1, 0));
    assert!(passed.get("c1").is_none(), "nothing left to take over");
    assert_eq!(passed.len(), 1);
    passed.remember("c3", "a", (1, 0), 0);
    assert_eq!(passed.len(), 2, "the forgotten conversation made room");
    assert!(passed.get("c2").is_some());
    passed.remember("c4", "a", (1, 0), 0);
    assert!(
        passed.get("c2").is_none(),
        "the oldest open conversation goes first"
    );
    assert!(passed.get("c3").is_some() && passed.get("c4").is_some());
}

#[test]
fn an_overflowed_conversation_is_kept_until_its_overflow_is_cleared() {
    let mut passed = PassedTurns::new(10, 1);
    passed.remember("c1", "a", (1, 0), 0);
    passed.remember("c1", "a", (2, 0), 0);
    passed.answered("c1", (2, 0));
    assert_eq!(passed.overflowed(), vec![("c1".to_owned(), 1)]);
    passed.clear_overflow("c1");
    assert!(passed.is_empty());
}

/// The answer to revision 0 may be heard after the regenerate that opened revision 1 (they come
/// from different nodes): it leaves revision 1's pass, which only its own answer or stop ends;
/// an older revision heard late does not replace a newer pass.
#[test]
fn a_pass_of_a_newer_revision_outlives_an_older_revisions_answer() {
    let mut passed = PassedTurns::new(10, 4);
    passed.remember("c1", "a", (1, 1), 50);
    passed.answered("c1", (1, 0));
    assert!(passed.contains("c1", 1), "revision 1 is still unanswered");
    passed.remember("c1", "b", (1, 0), 10);
    let pass = &passed.get("c1").expect("remembered").passes[0];
    assert_eq!(
        (pass.revision, pass.owner.as_str(), pass.at_ms),
        (1, "a", 50)
    );
    passed.answered("c1", (1, 1));
    assert!(!passed.contains("c1", 1));
}
