//! Double texting: what a user turn sent while another turn of the conversation is unanswered
//! means (ADR 0029). A channel has a turn policy, which a send may override where the channel
//! allows it; the shell reads the conversation's running turns under its row lock, asks
//! [`decide_send`], and performs the answer in the same transaction, so the decision holds
//! under any interleaving of sends, stops and answers.

/// A channel's answer to double texting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TurnPolicy {
    /// Every turn is delivered, in order (the default).
    Enqueue,
    /// A send while a turn is running is refused (`turn_in_progress`); nothing is stored.
    Reject,
    /// The running turns are stopped (reason `superseded`), then the new turn is delivered.
    Interrupt,
    /// As `Interrupt`, and the stopped turns leave the chat view with their answers.
    Rollback,
}

impl TurnPolicy {
    /// Every policy, in wire order.
    pub const ALL: [TurnPolicy; 4] = [
        TurnPolicy::Enqueue,
        TurnPolicy::Reject,
        TurnPolicy::Interrupt,
        TurnPolicy::Rollback,
    ];

    /// The wire and stored form.
    pub fn as_str(self) -> &'static str {
        match self {
            TurnPolicy::Enqueue => "enqueue",
            TurnPolicy::Reject => "reject",
            TurnPolicy::Interrupt => "interrupt",
            TurnPolicy::Rollback => "rollback",
        }
    }

    /// The policy a wire or stored name names.
    pub fn parse(name: &str) -> Option<TurnPolicy> {
        TurnPolicy::ALL
            .into_iter()
            .find(|policy| policy.as_str() == name)
    }
}

/// A turn of the conversation waiting for its answer (its latest revision is pending).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct RunningTurn {
    /// The turn's seq.
    pub seq: i64,
    /// Its latest revision.
    pub revision: i32,
}

/// What a send under a policy does, given the running turns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendDecision {
    /// Store the send; first stop these turns (reason `superseded`), marked rolled back when
    /// `rollback`.
    Commit {
        /// The turns to stop.
        stop: Vec<RunningTurn>,
        /// Whether they leave the chat view.
        rollback: bool,
    },
    /// Refuse the send (`turn_in_progress`): this turn is running.
    Refuse {
        /// The latest running turn.
        running: RunningTurn,
    },
}

/// What a send does under `policy` while `running` turns wait for their answer.
pub fn decide_send(policy: TurnPolicy, running: &[RunningTurn]) -> SendDecision {
    let mut running = running.to_vec();
    running.sort();
    match (policy, running.last()) {
        (TurnPolicy::Reject, Some(latest)) => SendDecision::Refuse { running: *latest },
        (TurnPolicy::Enqueue | TurnPolicy::Reject, _) => SendDecision::Commit {
            stop: Vec::new(),
            rollback: false,
        },
        (TurnPolicy::Interrupt, _) => SendDecision::Commit {
            stop: running,
            rollback: false,
        },
        (TurnPolicy::Rollback, _) => SendDecision::Commit {
            stop: running,
            rollback: true,
        },
    }
}

/// A channel's turn policies: its own, and those a send may ask for instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelPolicies {
    /// The policy of a send that names none.
    pub default: TurnPolicy,
    /// The policies a send may name besides the default.
    pub overrides: Vec<TurnPolicy>,
}

impl ChannelPolicies {
    /// The policy a send runs under: the one it asks for, when the channel allows it; `None`
    /// when the channel does not.
    pub fn choose(&self, asked: Option<TurnPolicy>) -> Option<TurnPolicy> {
        match asked {
            None => Some(self.default),
            Some(asked) if asked == self.default || self.overrides.contains(&asked) => Some(asked),
            Some(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn turn(seq: i64) -> RunningTurn {
        RunningTurn { seq, revision: 0 }
    }

    #[test]
    fn names_round_trip() {
        for policy in TurnPolicy::ALL {
            assert_eq!(TurnPolicy::parse(policy.as_str()), Some(policy));
        }
        assert_eq!(TurnPolicy::parse("supersede"), None);
        assert_eq!(TurnPolicy::parse("Enqueue"), None);
    }

    #[test]
    fn each_policy_with_and_without_a_running_turn() {
        let running = [turn(3), turn(1)];
        assert_eq!(
            decide_send(TurnPolicy::Enqueue, &running),
            SendDecision::Commit {
                stop: vec![],
                rollback: false
            }
        );
        assert_eq!(
            decide_send(TurnPolicy::Reject, &running),
            SendDecision::Refuse { running: turn(3) }
        );
        assert_eq!(
            decide_send(TurnPolicy::Reject, &[]),
            SendDecision::Commit {
                stop: vec![],
                rollback: false
            }
        );
        assert_eq!(
            decide_send(TurnPolicy::Interrupt, &running),
            SendDecision::Commit {
                stop: vec![turn(1), turn(3)],
                rollback: false
            }
        );
        assert_eq!(
            decide_send(TurnPolicy::Rollback, &running),
            SendDecision::Commit {
                stop: vec![turn(1), turn(3)],
                rollback: true
            }
        );
    }

    #[test]
    fn a_send_may_ask_only_for_what_the_channel_allows() {
        let policies = ChannelPolicies {
            default: TurnPolicy::Enqueue,
            overrides: vec![TurnPolicy::Interrupt],
        };
        assert_eq!(policies.choose(None), Some(TurnPolicy::Enqueue));
        assert_eq!(
            policies.choose(Some(TurnPolicy::Enqueue)),
            Some(TurnPolicy::Enqueue)
        );
        assert_eq!(
            policies.choose(Some(TurnPolicy::Interrupt)),
            Some(TurnPolicy::Interrupt)
        );
        assert_eq!(policies.choose(Some(TurnPolicy::Rollback)), None);
    }

    /// A turn in the model registry.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Status {
        Pending,
        Stopping,
        Completed,
        Stopped,
    }

    #[derive(Debug, Clone)]
    enum Step {
        /// The user sends under a policy.
        Send(usize),
        /// The user stops the latest running turn.
        Stop,
        /// The agent answers the n-th turn it was given (late answers included).
        Answer(usize),
        /// The grace period of the n-th turn ends: the gateway settles it if still stopping.
        GraceEnds(usize),
        /// The owner dies: the registry's pending turns are delivered to the next member.
        Takeover,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0..TurnPolicy::ALL.len()).prop_map(Step::Send),
            1 => Just(Step::Stop),
            3 => (0usize..12).prop_map(Step::Answer),
            2 => (0usize..12).prop_map(Step::GraceEnds),
            1 => Just(Step::Takeover),
        ]
    }

    #[derive(Default)]
    struct Conversation {
        status: Vec<Status>,
        results: Vec<u32>,
        rolled_back: Vec<bool>,
        /// Deliveries, in order: (turn, status at delivery).
        delivered: Vec<(usize, Status)>,
    }

    impl Conversation {
        fn running(&self) -> Vec<RunningTurn> {
            (0..self.status.len())
                .filter(|index| self.status[*index] == Status::Pending)
                .map(|index| turn(index as i64))
                .collect()
        }

        fn settle(&mut self, index: usize, to: Status) {
            self.status[index] = to;
            self.results[index] += 1;
        }
    }

    proptest! {
        /// Under any interleaving of sends under every policy, stops, answers (late ones too),
        /// grace periods and takeovers: a turn gets at most one result, a stopped turn settles
        /// once, a rejected send stores nothing while a turn runs, an interrupting send leaves
        /// no earlier turn running, and no turn is delivered once it stopped.
        #[test]
        fn one_result_per_turn_under_any_interleaving(steps in proptest::collection::vec(step(), 1..80)) {
            let mut conversation = Conversation::default();
            for step in steps {
                match step {
                    Step::Send(policy) => {
                        let policy = TurnPolicy::ALL[policy];
                        let running = conversation.running();
                        match decide_send(policy, &running) {
                            SendDecision::Refuse { running: latest } => {
                                prop_assert_eq!(policy, TurnPolicy::Reject);
                                prop_assert!(running.contains(&latest));
                            }
                            SendDecision::Commit { stop, rollback } => {
                                prop_assert!(policy != TurnPolicy::Reject || running.is_empty());
                                for stopped in stop {
                                    let index = stopped.seq as usize;
                                    prop_assert_eq!(conversation.status[index], Status::Pending);
                                    conversation.status[index] = Status::Stopping;
                                    conversation.rolled_back[index] = rollback;
                                }
                                if matches!(policy, TurnPolicy::Interrupt | TurnPolicy::Rollback) {
                                    prop_assert!(conversation.running().is_empty());
                                }
                                conversation.status.push(Status::Pending);
                                conversation.results.push(0);
                                conversation.rolled_back.push(false);
                                let index = conversation.status.len() - 1;
                                conversation.delivered.push((index, Status::Pending));
                            }
                        }
                    }
                    Step::Stop => {
                        if let Some(latest) = conversation.running().last() {
                            conversation.status[latest.seq as usize] = Status::Stopping;
                        }
                    }
                    Step::Answer(nth) => {
                        let Some(&(index, _)) = conversation.delivered.get(nth) else { continue };
                        // The registry takes an answer to a pending or stopping turn only.
                        if matches!(conversation.status[index], Status::Pending | Status::Stopping) {
                            conversation.settle(index, Status::Completed);
                        }
                    }
                    Step::GraceEnds(index) => {
                        if conversation.status.get(index) == Some(&Status::Stopping) {
                            conversation.settle(index, Status::Stopped);
                        }
                    }
                    Step::Takeover => {
                        for running in conversation.running() {
                            let index = running.seq as usize;
                            conversation.delivered.push((index, conversation.status[index]));
                        }
                    }
                }
            }
            // Every grace period ends.
            for index in 0..conversation.status.len() {
                if conversation.status[index] == Status::Stopping {
                    conversation.settle(index, Status::Stopped);
                }
            }
            for (index, results) in conversation.results.iter().enumerate() {
                prop_assert!(*results <= 1, "turn {} has {} results", index, results);
                if conversation.status[index] != Status::Pending {
                    prop_assert_eq!(*results, 1, "turn {} settled without a result", index);
                }
                if conversation.rolled_back[index] {
                    prop_assert!(matches!(conversation.status[index], Status::Completed | Status::Stopped));
                }
            }
            for (index, status) in &conversation.delivered {
                prop_assert_eq!(*status, Status::Pending, "turn {} delivered when {:?}", index, status);
            }
        }
    }
}
