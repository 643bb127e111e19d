//! Replay hold-back: splicing a replay from the database onto live frames from the bus so that a
//! subscriber sees every seq exactly once, in order.
//!
//! The session subscribes to live frames first, then reads the head and replays up to it; live
//! frames that arrive meanwhile are held back and judged by [`ReplayCursor::on_live`] once the
//! replay is done. Whatever the bus does (drop, repeat, reorder, deliver late), the cursor's
//! answer is one of: drop it (already sent), send it (the next one), or read the gap from the
//! database first.

/// What to replay from the database: every seq in `after + 1 ..= upto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayPlan {
    /// Exclusive lower bound (the client's watermark).
    pub after: u64,
    /// Inclusive upper bound.
    pub upto: u64,
    /// True when the cap cut the replay short of the head: the session sends `replayTruncated`
    /// with `watermark = upto` and `headSeq = head`, and live frames continue after the head.
    pub truncated: bool,
    /// The head the plan was made against.
    pub head: u64,
}

impl ReplayPlan {
    /// Number of frames to replay.
    pub fn len(&self) -> u64 {
        self.upto.saturating_sub(self.after)
    }

    /// True when nothing is to be replayed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What to do with a live frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LiveDecision {
    /// Already sent (or deliberately skipped): drop it.
    Drop,
    /// The next seq: send it.
    Send,
    /// Seqs `after + 1 ..= upto` are missing: read them from the database and send them in
    /// order (the live frame is the last of them).
    FillGap {
        /// Last seq sent.
        after: u64,
        /// The live frame's seq.
        upto: u64,
    },
}

/// The position of one subscriber in one conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayCursor {
    /// Highest seq the subscriber has (been sent, or knowingly skipped).
    last_sent: u64,
}

/// Plans a replay of `after + 1 ..= head`, cut to `cap` frames when a cap applies.
pub fn plan_replay(after: u64, head: u64, cap: Option<u64>) -> ReplayPlan {
    let wanted = head.saturating_sub(after);
    match cap {
        Some(cap) if wanted > cap => ReplayPlan {
            after,
            upto: after + cap,
            truncated: true,
            head,
        },
        _ => ReplayPlan {
            after,
            upto: head.max(after),
            truncated: false,
            head,
        },
    }
}

impl ReplayCursor {
    /// A cursor for a client at `watermark` (≤ `head`, checked by the caller), with the plan of
    /// the initial replay. After a truncated replay the cursor stands at the head: the skipped
    /// frames are the client's to fetch (`sync` or REST), and live frames continue after it.
    pub fn start(watermark: u64, head: u64, cap: Option<u64>) -> (ReplayCursor, ReplayPlan) {
        let plan = plan_replay(watermark, head, cap);
        (
            ReplayCursor {
                last_sent: head.max(watermark),
            },
            plan,
        )
    }

    /// Highest seq the subscriber has.
    pub fn last_sent(&self) -> u64 {
        self.last_sent
    }

    /// Judges a live frame.
    pub fn on_live(&self, seq: u64) -> LiveDecision {
        if seq <= self.last_sent {
            LiveDecision::Drop
        } else if seq == self.last_sent + 1 {
            LiveDecision::Send
        } else {
            LiveDecision::FillGap {
                after: self.last_sent,
                upto: seq,
            }
        }
    }

    /// Records that `seq` was sent (or is known to the client, like its own acked frames).
    /// Seqs at or below the cursor are ignored, so the cursor never moves backwards.
    pub fn advance_to(&mut self, seq: u64) {
        self.last_sent = self.last_sent.max(seq);
    }

    /// Plans the replay a `sync {watermark}` asks for: frames after the client's watermark up to
    /// what this connection has been sent, or up to `head` when that is further, cut to `cap`.
    pub fn plan_sync(&self, watermark: u64, head: u64, cap: Option<u64>) -> ReplayPlan {
        plan_replay(watermark, head.max(self.last_sent), cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn plan_caps_and_truncates() {
        assert_eq!(
            plan_replay(3, 10, None),
            ReplayPlan {
                after: 3,
                upto: 10,
                truncated: false,
                head: 10
            }
        );
        assert_eq!(
            plan_replay(3, 10, Some(4)),
            ReplayPlan {
                after: 3,
                upto: 7,
                truncated: true,
                head: 10
            }
        );
        assert_eq!(
            plan_replay(3, 7, Some(4)),
            ReplayPlan {
                after: 3,
                upto: 7,
                truncated: false,
                head: 7
            }
        );
        assert!(plan_replay(10, 10, Some(4)).is_empty());
    }

    #[test]
    fn live_decisions() {
        let (cursor, _) = ReplayCursor::start(0, 5, None);
        assert_eq!(cursor.on_live(5), LiveDecision::Drop);
        assert_eq!(cursor.on_live(6), LiveDecision::Send);
        assert_eq!(
            cursor.on_live(9),
            LiveDecision::FillGap { after: 5, upto: 9 }
        );
    }

    #[test]
    fn truncated_start_continues_after_the_head() {
        let (cursor, plan) = ReplayCursor::start(0, 100, Some(10));
        assert!(plan.truncated);
        assert_eq!(plan.upto, 10);
        assert_eq!(cursor.last_sent(), 100);
        assert_eq!(cursor.on_live(101), LiveDecision::Send);
    }

    /// One step of the world around a subscriber.
    #[derive(Debug, Clone)]
    enum Step {
        /// A writer commits the next seq; the bus delivers it `copies` times (0 = lost).
        Commit { copies: u8 },
        /// The bus delivers an old notification again.
        Redeliver { back: u8 },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0u8..3).prop_map(|copies| Step::Commit { copies }),
            1 => (0u8..20).prop_map(|back| Step::Redeliver { back }),
        ]
    }

    /// Simulates subscribe → read head → replay → live with a lossy, repeating bus and a
    /// writer that keeps committing during the replay, then checks what the client received.
    fn simulate(
        watermark_back: u64,
        before: u64,
        during_replay: &[Step],
        after: &[Step],
    ) -> Vec<u64> {
        let mut head = before;
        let mut held_back: Vec<u64> = Vec::new();
        let mut received: Vec<u64> = Vec::new();
        let watermark = before.saturating_sub(watermark_back);
        // The subscriber is subscribed from here on; the head is read now.
        let (mut cursor, plan) = ReplayCursor::start(watermark, head, None);
        let world = |step: &Step, head: &mut u64, out: &mut Vec<u64>| match step {
            Step::Commit { copies } => {
                *head += 1;
                for _ in 0..*copies {
                    out.push(*head);
                }
            }
            Step::Redeliver { back } => {
                if *head > 0 {
                    out.push(head.saturating_sub(u64::from(*back)).max(1));
                }
            }
        };
        // Commits during the replay are held back.
        for step in during_replay {
            world(step, &mut head, &mut held_back);
        }
        received.extend(plan.after + 1..=plan.upto);
        let deliver = |seq: u64, cursor: &mut ReplayCursor, received: &mut Vec<u64>| match cursor
            .on_live(seq)
        {
            LiveDecision::Drop => {}
            LiveDecision::Send => {
                received.push(seq);
                cursor.advance_to(seq);
            }
            LiveDecision::FillGap { after, upto } => {
                received.extend(after + 1..=upto);
                cursor.advance_to(upto);
            }
        };
        for seq in held_back {
            deliver(seq, &mut cursor, &mut received);
        }
        let mut live = Vec::new();
        for step in after {
            world(step, &mut head, &mut live);
        }
        // A final commit that the bus does deliver, as every real conversation eventually has.
        head += 1;
        live.push(head);
        for seq in live {
            deliver(seq, &mut cursor, &mut received);
        }
        received
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        #[test]
        fn every_seq_once_in_order(
            before in 0u64..30,
            watermark_back in 0u64..30,
            during in proptest::collection::vec(step(), 0..20),
            after in proptest::collection::vec(step(), 0..40),
        ) {
            let watermark = before.saturating_sub(watermark_back);
            let received = simulate(watermark_back, before, &during, &after);
            let expected_last = *received.last().unwrap();
            let expected: Vec<u64> = (watermark + 1..=expected_last).collect();
            prop_assert_eq!(&received, &expected, "no gap, no double, no inversion");
            let distinct: BTreeSet<u64> = received.iter().copied().collect();
            prop_assert_eq!(distinct.len(), received.len());
        }

        #[test]
        fn truncation_never_resends_and_never_goes_backwards(watermark in 0u64..100, extra in 0u64..300, cap in 1u64..50) {
            let head = watermark + extra;
            let (cursor, plan) = ReplayCursor::start(watermark, head, Some(cap));
            prop_assert!(plan.len() <= cap);
            prop_assert_eq!(plan.truncated, extra > cap);
            prop_assert_eq!(cursor.last_sent(), head);
            prop_assert_eq!(cursor.on_live(head + 1), LiveDecision::Send);
            let mut moved = cursor.clone();
            moved.advance_to(watermark);
            prop_assert_eq!(moved.last_sent(), head);
        }
    }
}
