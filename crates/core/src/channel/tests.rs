//! The decider's forgetting of idle conversations (ADR 0034), step by step.

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
    decider.stopped("x", (1, 0), "stopped", 10, 250);
    let sent = decider.committed("x", 2, &[frame("x", 2, 260)]);
    assert_eq!(sent.len(), 1, "later frames flow as before");
    assert!(
        decider.stopped_ahead.is_empty(),
        "the stop of a handled turn is not remembered"
    );
}
