//! The ledger of an external side-effect service keyed by idempotency key: the first call with a
//! key performs the effect, every repeat is answered with the first outcome and only counted.
//! Agents pass `meta.turn.key` as the key and, beside it, the turn they worked on, so the
//! figures show both how often the key saved a second effect (calls per key) and whether one
//! turn ever reached the service under two keys (effects per turn, which must stay at one).

use std::collections::{BTreeMap, BTreeSet};

#[cfg(feature = "effects")]
mod service;

#[cfg(feature = "effects")]
pub use service::{Effects, EffectsError, KEY_HEADER, TURN_HEADER};

/// What one call was answered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The effect's number (1 for the first key ever seen, and so on).
    pub effect: u64,
    /// True when this call performed the effect, false for a repeat of its key.
    pub first: bool,
}

#[derive(Debug, Default)]
struct Entry {
    effect: u64,
    calls: u64,
    /// The turns the callers named with this key.
    turns: BTreeSet<String>,
}

/// Effects performed, by idempotency key.
#[derive(Debug, Default)]
pub struct Ledger {
    entries: BTreeMap<String, Entry>,
}

/// A summary of a ledger.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EffectFigures {
    /// Effects performed: one per distinct key.
    pub effects: usize,
    /// Calls, repeats included.
    pub calls: u64,
    /// Most calls any one key got.
    pub max_calls_per_key: u64,
    /// Keys called more than once (repeats answered from the ledger, no new effect).
    pub keys_called_again: usize,
    /// Most effects (distinct keys) any one named turn got; 1 when keys are stable per turn.
    pub max_effects_per_turn: usize,
    /// Named turns with more than one effect: breaches of one effect per turn.
    pub turns_with_several_effects: usize,
    /// Keys named with more than one turn: one key covering distinct turns.
    pub keys_with_several_turns: usize,
}

impl EffectFigures {
    /// True when no turn had two effects and no key covered two turns.
    pub fn holds(&self) -> bool {
        self.turns_with_several_effects == 0 && self.keys_with_several_turns == 0
    }
}

impl Ledger {
    /// Performs the effect for `key` once; `turn` names the turn the caller worked on, if any.
    pub fn perform(&mut self, key: &str, turn: Option<&str>) -> Outcome {
        let next = self.entries.len() as u64 + 1;
        let entry = self.entries.entry(key.to_owned()).or_insert_with(|| Entry {
            effect: next,
            ..Entry::default()
        });
        entry.calls += 1;
        if let Some(turn) = turn {
            entry.turns.insert(turn.to_owned());
        }
        Outcome {
            effect: entry.effect,
            first: entry.calls == 1,
        }
    }

    /// Effects performed (one per distinct key).
    pub fn performed(&self) -> usize {
        self.entries.len()
    }

    /// Calls that repeated a key (answered with the first outcome, no new effect).
    pub fn repeated_calls(&self) -> u64 {
        self.entries.values().map(|entry| entry.calls - 1).sum()
    }

    /// The keys with an effect.
    pub fn keys(&self) -> Vec<String> {
        self.entries.keys().cloned().collect()
    }

    /// The figures of the ledger so far.
    pub fn figures(&self) -> EffectFigures {
        let mut keys_per_turn: BTreeMap<&str, usize> = BTreeMap::new();
        for entry in self.entries.values() {
            for turn in &entry.turns {
                *keys_per_turn.entry(turn).or_default() += 1;
            }
        }
        EffectFigures {
            effects: self.entries.len(),
            calls: self.entries.values().map(|entry| entry.calls).sum(),
            max_calls_per_key: self
                .entries
                .values()
                .map(|entry| entry.calls)
                .max()
                .unwrap_or(0),
            keys_called_again: self
                .entries
                .values()
                .filter(|entry| entry.calls > 1)
                .count(),
            max_effects_per_turn: keys_per_turn.values().copied().max().unwrap_or(0),
            turns_with_several_effects: keys_per_turn.values().filter(|keys| **keys > 1).count(),
            keys_with_several_turns: self
                .entries
                .values()
                .filter(|entry| entry.turns.len() > 1)
                .count(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_call_with_a_key_performs_the_effect_and_repeats_get_its_outcome() {
        let mut ledger = Ledger::default();
        assert_eq!(
            ledger.perform("k1", None),
            Outcome {
                effect: 1,
                first: true
            }
        );
        assert_eq!(
            ledger.perform("k2", None),
            Outcome {
                effect: 2,
                first: true
            }
        );
        assert_eq!(
            ledger.perform("k1", None),
            Outcome {
                effect: 1,
                first: false
            }
        );
        assert_eq!(ledger.performed(), 2);
        assert_eq!(ledger.repeated_calls(), 1);
        assert_eq!(ledger.keys(), ["k1", "k2"]);
    }

    #[test]
    fn figures_count_repeats_per_key_and_effects_per_turn() {
        let mut ledger = Ledger::default();
        for _ in 0..3 {
            ledger.perform("c:1:0", Some("c/1/0"));
        }
        ledger.perform("c:2:0", Some("c/2/0"));
        let figures = ledger.figures();
        assert_eq!(
            figures,
            EffectFigures {
                effects: 2,
                calls: 4,
                max_calls_per_key: 3,
                keys_called_again: 1,
                max_effects_per_turn: 1,
                turns_with_several_effects: 0,
                keys_with_several_turns: 0,
            }
        );
        assert!(figures.holds());
    }

    #[test]
    fn a_turn_reaching_the_service_under_two_keys_breaks_one_effect_per_turn() {
        let mut ledger = Ledger::default();
        ledger.perform("c:1:0", Some("c/1/0"));
        ledger.perform("c:1:0-again", Some("c/1/0"));
        let figures = ledger.figures();
        assert_eq!(
            (
                figures.max_effects_per_turn,
                figures.turns_with_several_effects
            ),
            (2, 1)
        );
        assert!(!figures.holds());
    }

    #[test]
    fn one_key_for_two_turns_is_reported() {
        let mut ledger = Ledger::default();
        ledger.perform("k", Some("c/1/0"));
        ledger.perform("k", Some("c/2/0"));
        assert_eq!(ledger.figures().keys_with_several_turns, 1);
        assert!(!ledger.figures().holds());
    }
}
