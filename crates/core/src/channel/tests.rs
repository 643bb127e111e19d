//! The decider's memories, step by step: the forgetting of idle conversations (ADR 0034), and
//! the regenerations it handed on, which a read-back after a lag consults (ADR 0041).

use super::*;

fn frame(conversation_id: &str, seq: i64, at_ms: i64) -> FrameFacts<'_> {
    FrameFacts {
        conversation_id,
        seq,
        at_ms,
        sender_id: "user-1",
        from_user: true,
        turn_seq: None,
        turn_revision: None,
    }
}

/// An observer's decider following the channel from time 0, forgetting after 100 ms, with
/// conversation `x` handled up to seq 1 (committed at 10) and then forgotten.
fn with_x_forgotten() -> ChannelDecider {
    let mut decider = ChannelDecider::new(std::iter::empty())
        .with_follow_margin(0)
        .with_forget_after(100);
    let observer = LocalAgent {
        group: None,
        since_ms: 0,
        sender_id: "observer".into(),
        leased: false,
    };
    let read = decider.join("o-1", observer);
    assert_eq!(read, vec![Decision::ReadPendingOfChannel { group: None }]);
    assert!(decider.pending_read(None, &[], Some(0)).is_empty());
    decider.forget_idle(0);
    let sent = decider.committed("x", 1, &[frame("x", 1, 10)]);
    assert_eq!(sent.len(), 1, "the observer gets the frame");
    decider.forget_idle(100);
    assert_eq!(
        decider.plan_committed("x", 1, Some(10)),
        CommittedPlan::Skip
    );
    decider.forget_idle(200);
    decider
}

#[test]
fn a_forgotten_conversations_frame_heard_again_is_not_decided_again() {
    let mut decider = with_x_forgotten();
    assert_eq!(
        decider.plan_committed("x", 1, Some(10)),
        CommittedPlan::Skip
    );
    assert_eq!(
        decider.plan_committed("x", 1, None),
        CommittedPlan::Read { after: 0, count: 1 },
        "a frame not at hand is read"
    );
    assert!(
        decider.committed("x", 1, &[frame("x", 1, 10)]).is_empty(),
        "and, read, it is not sent twice"
    );
}

#[test]
fn a_forgotten_conversation_reads_back_only_what_committed_after_the_newest_forgotten_frame() {
    let decider = with_x_forgotten();
    assert_eq!(
        decider.plan_committed("x", 3, Some(250)),
        CommittedPlan::ReadSince {
            since_ms: 11,
            upto: 3
        }
    );
    assert_eq!(
        decider.plan_committed("y", 1, Some(250)),
        CommittedPlan::Use,
        "a new conversation's first frame"
    );
}

#[test]
fn a_stop_of_a_forgotten_conversations_turn_is_not_kept_for_a_commit_to_come() {
    let mut decider = with_x_forgotten();
    decider.stopped("x", (1, 0), "stopped", times(10, 250));
    let sent = decider.committed("x", 2, &[frame("x", 2, 260)]);
    assert_eq!(sent.len(), 1, "later frames flow as before");
    assert!(
        decider.stopped_ahead.is_empty(),
        "the stop of a handled turn is not remembered"
    );
}

/// A local member of `group`, eligible from time 0.
fn member_of(group: &str) -> LocalAgent {
    LocalAgent {
        group: Some(group.into()),
        since_ms: 0,
        sender_id: group.into(),
        leased: false,
    }
}

/// A decider with local members `m-1` of group `bot` and `c-1` of group `critic`, forgetting
/// after 100 ms.
fn with_two_groups() -> ChannelDecider {
    let mut decider = ChannelDecider::new(std::iter::empty())
        .with_follow_margin(0)
        .with_forget_after(100);
    decider.join("m-1", member_of("bot"));
    decider.pending_read(None, &[], Some(0));
    decider.join("c-1", member_of("critic"));
    decider.pending_read(Some("critic"), &[], Some(0));
    decider.forget_idle(0);
    decider
}

/// What the channel actor does with a regeneration: asks whom it goes to, and notes it for
/// each member it hands it to.
fn hand_on(decider: &mut ChannelDecider, turn: (i64, i32), at_ms: i64) -> Vec<String> {
    let owners = decider.regeneration_owners("x", turn, at_ms);
    for owner in &owners {
        assert!(decider.note_regeneration("x", turn, owner));
    }
    owners
}

/// Both members, in the order of their groups.
fn both() -> Vec<String> {
    vec!["m-1".to_owned(), "c-1".to_owned()]
}

#[test]
fn a_regenerated_revision_is_handed_on_once_whether_its_event_or_a_read_back_comes_first() {
    let mut decider = with_two_groups();
    assert_eq!(hand_on(&mut decider, (1, 1), 10), both());
    assert!(
        hand_on(&mut decider, (1, 1), 20).is_empty(),
        "the read-back after a lag finds the revision its event handed on"
    );
    assert!(
        hand_on(&mut decider, (1, 0), 20).is_empty(),
        "an older revision is superseded"
    );
    assert_eq!(
        hand_on(&mut decider, (1, 2), 30),
        both(),
        "a newer revision is handed on"
    );
    assert_eq!(
        hand_on(&mut decider, (3, 1), 30),
        both(),
        "another turn of the conversation is another regeneration"
    );
}

#[test]
fn a_regeneration_a_takeover_handed_to_one_group_still_goes_to_the_other() {
    let mut decider = with_two_groups();
    assert!(decider.note_regeneration("x", (1, 1), "c-1"));
    assert!(!decider.note_regeneration("x", (1, 1), "c-1"));
    assert_eq!(
        decider.regeneration_owners("x", (1, 1), 10),
        vec!["m-1".to_owned()]
    );
    assert!(
        !decider.note_regeneration("x", (1, 1), "nobody-here"),
        "only a member here is noted"
    );
}

#[test]
fn a_regeneration_goes_to_the_owners_when_it_was_opened() {
    let mut decider = with_two_groups();
    let late = LocalAgent {
        since_ms: 50,
        ..member_of("bot")
    };
    decider.join("m-2", late);
    // A conversation the late member owns from its eligibility on.
    let conversation = (0..100)
        .map(|n| format!("x-{n}"))
        .find(|conversation| {
            decider
                .regeneration_owners(conversation, (1, 1), 60)
                .contains(&"m-2".to_owned())
        })
        .expect("the late member owns some conversation");
    assert_eq!(
        decider.regeneration_owners(&conversation, (1, 1), 10),
        both(),
        "a regenerate opened before the late member was eligible goes to the owner then"
    );
}

#[test]
fn a_regeneration_idle_for_two_periods_is_forgotten_and_handed_on_again() {
    let mut decider = with_two_groups();
    assert_eq!(hand_on(&mut decider, (1, 1), 10), both());
    decider.forget_idle(100);
    assert!(
        hand_on(&mut decider, (1, 1), 110).is_empty(),
        "kept for a period at least"
    );
    decider.forget_idle(200);
    assert_eq!(
        hand_on(&mut decider, (1, 1), 210),
        both(),
        "forgotten: a read-back then hands it on again, and the agent de-duplicates by its key"
    );
}

/// Joins a local member of `group` and completes its join with an empty read-back.
fn join_member(decider: &mut ChannelDecider, id: &str, group: &str, since_ms: i64) {
    let member = LocalAgent {
        group: Some(group.into()),
        since_ms,
        sender_id: group.into(),
        leased: false,
    };
    for decision in decider.join(id, member) {
        let Decision::ReadPendingOfChannel { group } = decision else {
            panic!("a join reads the channel's pending turns, not {decision:?}");
        };
        decider.pending_read(group.as_deref(), &[], Some(0));
    }
}

fn cancelled(decisions: &[Decision]) -> Vec<&str> {
    let mut told: Vec<&str> = decisions
        .iter()
        .map(|decision| match decision {
            Decision::Cancel { to, .. } => to.as_str(),
            other => panic!("a stop decides cancels only, not {other:?}"),
        })
        .collect();
    told.sort_unstable();
    told
}

/// A turn committed before any member was eligible went to the earliest member its node knew
/// then; a member with an earlier `since` taken since may be the owner now, so the stop reaches
/// every local member of the group (ADR 0028, amended). A turn committed once members were
/// eligible has one owner, and only it is told.
#[test]
fn a_stop_of_a_turn_committed_before_anyone_was_eligible_tells_every_local_member() {
    let mut decider = ChannelDecider::new(std::iter::empty());
    join_member(&mut decider, "later-since", "bot", 2_000);
    join_member(&mut decider, "earlier-since", "bot", 1_500);
    join_member(&mut decider, "other-group", "auditor", 1_500);

    let before_anyone = decider.stopped("c", (1, 0), "stopped", times(10, 20));
    assert_eq!(
        cancelled(&before_anyone),
        vec!["earlier-since", "later-since", "other-group"]
    );

    let mut bot = GroupView::new();
    bot.join("later-since", 2_000);
    bot.join("earlier-since", 1_500);
    let owner = bot.owner("c", 3_000).expect("the group has members");
    let once_eligible = decider.stopped("c", (2, 0), "stopped", times(3_000, 3_000));
    let mut expected = vec![owner, "other-group"];
    expected.sort_unstable();
    assert_eq!(cancelled(&once_eligible), expected, "one owner per group");
}

/// A stop's times without the revision's opening (as from a node of an earlier release).
fn times(turn_at_ms: i64, now_ms: i64) -> StopTimes {
    StopTimes {
        turn_at_ms,
        revision_at_ms: None,
        now_ms,
    }
}

/// A stop's times from a node that says when the stopped revision was opened.
fn times_opened(turn_at_ms: i64, revision_at_ms: i64, now_ms: i64) -> StopTimes {
    StopTimes {
        revision_at_ms: Some(revision_at_ms),
        ..times(turn_at_ms, now_ms)
    }
}

/// Members `first`, `second` and `third` of `bot`, eligible from 0, 100 and 200, and a
/// conversation each later member takes over from the ones before.
fn three_successive_owners() -> (ChannelDecider, String) {
    let mut decider = ChannelDecider::new(std::iter::empty());
    join_member(&mut decider, "first", "bot", 0);
    join_member(&mut decider, "second", "bot", 100);
    join_member(&mut decider, "third", "bot", 200);
    let conversation = (0..1_000)
        .map(|n| format!("x-{n}"))
        .find(|conversation| {
            decider.regeneration_owners(conversation, (1, 1), 150) == ["second"]
                && decider.regeneration_owners(conversation, (1, 1), 250) == ["third"]
        })
        .expect("some conversation is owned by each later member in turn");
    (decider, conversation)
}

/// A regenerated revision went to the owner when it was opened; a member eligible later may
/// own the conversation by the time the revision is stopped, and the turn's first owner need
/// not hold the revision either: the stop reaches the member the revision's pass names, which
/// a takeover moves.
#[test]
fn a_stop_of_a_regenerated_revision_reaches_the_member_it_was_handed_to() {
    let (mut decider, conversation) = three_successive_owners();
    let regenerated = (1, 1);
    let handed_to = decider.regeneration_opened(&conversation, regenerated, 150);
    assert_eq!(handed_to, ["second"]);
    assert!(decider.note_regeneration(&conversation, regenerated, "second"));

    // The turn was committed at 50 (owner: first); the stop comes at 250 (owner: third), from
    // a node that does not say when the revision was opened.
    let stop = decider
        .clone()
        .stopped(&conversation, regenerated, "stopped", times(50, 250));
    assert_eq!(cancelled(&stop), vec!["second", "third"]);

    // A stop of an older revision does not reach the newer revision's holder.
    let stop = decider.stopped(&conversation, (1, 0), "stopped", times(50, 250));
    assert_eq!(cancelled(&stop), vec!["first", "third"]);

    // A takeover that hands the revision to another member moves its holder.
    decider.leave("second");
    let stop = decider.stopped(&conversation, regenerated, "stopped", times(50, 250));
    assert_eq!(
        cancelled(&stop),
        vec!["first", "third"],
        "second no longer holds it"
    );
}

/// A node that does not remember handing the revision on (its memory forgot it, or another
/// node handed it on) finds its owner at the revision's opening time, as the hand-on did.
#[test]
fn a_stop_of_a_regenerated_revision_reaches_its_owner_when_it_was_opened() {
    let (mut decider, conversation) = three_successive_owners();
    let opened_at = times_opened(50, 150, 250);
    let stop = decider.stopped(&conversation, (1, 1), "stopped", opened_at);
    assert_eq!(
        cancelled(&stop),
        vec!["second", "third"],
        "the owner then and the owner now; the turn's first owner holds no revision 1"
    );

    // Revision 0 was opened with its turn: the time is not asked.
    let stop = decider.stopped(&conversation, (1, 0), "stopped", opened_at);
    assert_eq!(cancelled(&stop), vec!["first", "third"]);
}

/// For a revision, "before any member was eligible" is judged when the revision was opened: a
/// regenerate of a turn committed before the members' `since` went to one owner, who alone is
/// told; without the opening time (a node of an earlier release), every local member is.
#[test]
fn a_revision_opened_once_members_were_eligible_is_cancelled_to_its_owner_only() {
    let mut decider = ChannelDecider::new(std::iter::empty());
    join_member(&mut decider, "later-since", "bot", 2_000);
    join_member(&mut decider, "earlier-since", "bot", 1_500);
    let mut bot = GroupView::new();
    bot.join("later-since", 2_000);
    bot.join("earlier-since", 1_500);
    // A conversation the earlier member owns once both are eligible; the turn, committed
    // before either was, went to it too (the earliest member).
    let conversation = (0..100)
        .map(|n| format!("c-{n}"))
        .find(|conversation| bot.owner(conversation, 3_000) == Some("earlier-since"))
        .expect("the earlier member owns some conversation");

    let opened_at = times_opened(10, 3_000, 3_500);
    let stop = decider.stopped(&conversation, (1, 1), "stopped", opened_at);
    assert_eq!(cancelled(&stop), vec!["earlier-since"]);

    let stop = decider.stopped(&conversation, (1, 1), "stopped", times(10, 3_500));
    assert_eq!(cancelled(&stop), vec!["earlier-since", "later-since"]);
}

/// A regenerated revision is remembered as passed to its owner in every group, on a node where
/// that owner is not: when the owner leaves, the member that owns the conversation next takes
/// the revision over (a `DeliverPending` of the turn, which reads its latest revision), on
/// whichever node that member is.
#[test]
fn a_regenerated_revision_whose_holder_leaves_is_taken_over() {
    let (mut here, conversation) = three_successive_owners();
    assert_eq!(
        here.regeneration_opened(&conversation, (1, 1), 150),
        ["second"]
    );
    assert!(here.note_regeneration(&conversation, (1, 1), "second"));

    let decisions = here.leave("second");
    let delivered: Vec<(&str, &[i64])> = decisions
        .iter()
        .filter_map(|decision| match decision {
            Decision::DeliverPending { to, seqs, .. } => Some((to.as_str(), seqs.as_slice())),
            _ => None,
        })
        .collect();
    let mut view = GroupView::new();
    for (member, since) in [("first", 0), ("third", 200)] {
        view.join(member, since);
    }
    let next = view.owner(&conversation, 150).expect("members remain");
    assert_eq!(delivered, [(next, &[1][..])]);

    // A node where the holder is not remembers the pass too, and takes over when gossip tells
    // it that the holder left.
    let mut elsewhere = ChannelDecider::new(std::iter::empty());
    join_member(&mut elsewhere, "next", "bot", 0);
    elsewhere.remote_join("holder", "bot", 0);
    let conversation = (0..1_000)
        .map(|n| format!("y-{n}"))
        .find(|conversation| {
            elsewhere
                .regeneration_owners(conversation, (1, 1), 10)
                .is_empty()
        })
        .expect("the remote member owns some conversation");
    let handed_here = elsewhere.regeneration_opened(&conversation, (1, 1), 10);
    assert!(handed_here.is_empty(), "the holder is on another node");
    let decisions = elsewhere.remote_leave("holder", "bot");
    assert!(
        decisions.iter().any(|decision| matches!(
            decision,
            Decision::DeliverPending { to, seqs, .. } if to == "next" && seqs == &[1]
        )),
        "{decisions:?}"
    );
}

/// A regenerate heard before the stop of the revision it replaced (they come from different
/// nodes) replaces that revision's pass; the stop still reaches the member that holds the
/// stopped revision: the owner when it was opened.
#[test]
fn a_stop_heard_after_the_next_revisions_regenerate_reaches_the_stopped_revisions_holder() {
    let (mut decider, conversation) = three_successive_owners();
    // Revision 0 of turn 1, committed at 50, went to `first`; revision 1, opened at 150, to
    // `second`, and this node heard that first.
    assert_eq!(
        decider.regeneration_opened(&conversation, (1, 1), 150),
        ["second"]
    );
    let stop_of_revision_0 = times_opened(50, 50, 250);
    let stop = decider.stopped(&conversation, (1, 0), "stopped", stop_of_revision_0);
    assert_eq!(cancelled(&stop), vec!["first", "third"]);
    assert!(
        decider
            .memories
            .get("bot")
            .is_some_and(|memory| memory.contains(&conversation, 1)),
        "revision 1 is still remembered for a takeover"
    );
}
