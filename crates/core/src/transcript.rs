//! The chat view of a transcript: what a client that cannot collapse revisions should be shown
//! of an append-only conversation (ADR 0018).
//!
//! The stored transcript keeps every frame: a user turn, the edits that replaced it (each a
//! frame with `replaces`), and the answers of every revision. A client that renders each frame
//! as a bubble and ignores `replaces` (an unmodified mekik widget) would show an edited
//! question twice and the answers of superseded revisions beside the current one. The chat view
//! leaves those out and shows the latest edit under the original turn's `id`, so every turn
//! reads as one question and, once answered, one answer.

use std::collections::{BTreeMap, HashMap, HashSet};

/// One revision of a turn, as the turn registry holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Revision {
    /// The turn's seq (its original user frame).
    pub seq: i64,
    /// The revision number (0 is the original).
    pub revision: i32,
    /// The seq of the edit frame that opened this revision, for an edit.
    pub edit_seq: Option<i64>,
    /// The seqs of this revision's committed answer.
    pub answer_seqs: Vec<i64>,
    /// The `id` of the turn's original frame.
    pub turn_id: String,
    /// A newer turn rolled this revision back (turn policy `rollback`, ADR 0029).
    pub rolled_back: bool,
}

/// Which frames a chat view leaves out, and which it shows under another id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatView {
    hidden: HashSet<i64>,
    shown_as: HashMap<i64, String>,
}

impl ChatView {
    /// The view of the revisions of every turn that has more than one; turns with only their
    /// original revision need not be given.
    pub fn new(revisions: impl IntoIterator<Item = Revision>) -> ChatView {
        let mut turns: BTreeMap<i64, Vec<Revision>> = BTreeMap::new();
        for revision in revisions {
            turns.entry(revision.seq).or_default().push(revision);
        }
        let mut view = ChatView::default();
        for (seq, mut revisions) in turns {
            revisions.sort_by_key(|revision| revision.revision);
            let Some(latest) = revisions.last().map(|revision| revision.revision) else {
                continue;
            };
            // A turn whose latest revision was rolled back leaves the view whole: its
            // question, every edit and every answer.
            if revisions
                .last()
                .is_some_and(|revision| revision.rolled_back)
            {
                view.hidden.insert(seq);
                for revision in &revisions {
                    view.hidden.extend(revision.edit_seq);
                    view.hidden.extend(&revision.answer_seqs);
                }
                continue;
            }
            // Answers of every superseded revision.
            for revision in revisions.iter().filter(|r| r.revision < latest) {
                view.hidden.extend(&revision.answer_seqs);
            }
            // The latest edit stands for the question, under the original's id; the original
            // and every earlier edit are left out.
            let mut edits = revisions
                .iter()
                .filter_map(|revision| revision.edit_seq.map(|edit| (edit, &revision.turn_id)));
            let Some((mut latest_edit, mut turn_id)) = edits.next() else {
                continue;
            };
            view.hidden.insert(seq);
            for (edit, id) in edits {
                view.hidden.insert(latest_edit);
                (latest_edit, turn_id) = (edit, id);
            }
            view.shown_as.insert(latest_edit, turn_id.clone());
        }
        view
    }

    /// True when the frame at `seq` is left out.
    pub fn hides(&self, seq: i64) -> bool {
        self.hidden.contains(&seq)
    }

    /// The id the frame at `seq` is shown under, when it is not its own.
    pub fn shown_as(&self, seq: i64) -> Option<&str> {
        self.shown_as.get(&seq).map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn revision(seq: i64, revision: i32, edit_seq: Option<i64>, answers: &[i64]) -> Revision {
        Revision {
            seq,
            revision,
            edit_seq,
            answer_seqs: answers.to_vec(),
            turn_id: format!("turn-{seq}"),
            rolled_back: false,
        }
    }

    #[test]
    fn a_rolled_back_turn_leaves_the_view_with_its_answer() {
        // 1 question, 2 partial answer (rolled back by the turn at 3), 4 answer of 3.
        let rolled = Revision {
            rolled_back: true,
            ..revision(1, 0, None, &[2])
        };
        let view = ChatView::new([rolled, revision(3, 0, None, &[4])]);
        assert!(view.hides(1) && view.hides(2));
        assert!(!view.hides(3) && !view.hides(4));
    }

    #[test]
    fn an_edit_and_two_regenerations_read_as_one_question_and_one_answer() {
        // 1 question, 2 answer; 3 edit (rev 1), 4 answer; rev 2 regenerate, 5 answer;
        // rev 3 regenerate, 6 answer.
        let view = ChatView::new([
            revision(1, 0, None, &[2]),
            revision(1, 1, Some(3), &[4]),
            revision(1, 2, None, &[5]),
            revision(1, 3, None, &[6]),
        ]);
        let shown: Vec<i64> = (1..=6).filter(|seq| !view.hides(*seq)).collect();
        assert_eq!(shown, vec![3, 6]);
        assert_eq!(view.shown_as(3), Some("turn-1"));
        assert_eq!(view.shown_as(6), None);
    }

    #[test]
    fn a_regeneration_hides_only_the_old_answers() {
        let view = ChatView::new([revision(7, 0, None, &[8, 9]), revision(7, 1, None, &[10])]);
        assert!(!view.hides(7));
        assert!(view.hides(8) && view.hides(9));
        assert!(!view.hides(10));
        assert_eq!(view.shown_as(7), None);
    }

    #[test]
    fn only_the_latest_of_several_edits_is_shown() {
        let view = ChatView::new([
            revision(1, 2, Some(5), &[]),
            revision(1, 0, None, &[2]),
            revision(1, 1, Some(3), &[4]),
        ]);
        assert!(view.hides(1) && view.hides(2) && view.hides(3) && view.hides(4));
        assert!(!view.hides(5));
        assert_eq!(view.shown_as(5), Some("turn-1"));
    }

    #[test]
    fn a_turn_with_one_revision_is_untouched() {
        let view = ChatView::new([revision(1, 0, None, &[2])]);
        assert!(!view.hides(1) && !view.hides(2));
    }

    proptest! {
        /// Whatever the history, each turn shows exactly one user frame, under the turn's id,
        /// and only the answer frames of its latest revision.
        #[test]
        fn each_turn_shows_one_question_and_only_its_latest_answer(
            turns in prop::collection::vec(
                prop::collection::vec((any::<bool>(), 0usize..3), 1..6), 1..6),
        ) {
            // Lay the turns out as a transcript: question, then each revision's edit frame (if
            // any) and answer frames, in order.
            let mut seqs = 1i64..;
            let mut revisions = Vec::new();
            let mut user_frames: Vec<(i64, Vec<i64>)> = Vec::new();
            let mut latest_answers: Vec<Vec<i64>> = Vec::new();
            let mut all_answers: Vec<Vec<i64>> = Vec::new();
            for history in &turns {
                let seq = seqs.next().unwrap();
                let mut frames = vec![seq];
                let mut answers_of_turn = Vec::new();
                let mut last = Vec::new();
                for (number, (edit, answers)) in history.iter().enumerate() {
                    let edit_seq = (number > 0 && *edit).then(|| seqs.next().unwrap());
                    frames.extend(edit_seq);
                    let answer_seqs: Vec<i64> =
                        (0..*answers).map(|_| seqs.next().unwrap()).collect();
                    answers_of_turn.extend(answer_seqs.iter().copied());
                    last = answer_seqs.clone();
                    revisions.push(Revision {
                        seq,
                        revision: number as i32,
                        edit_seq,
                        answer_seqs,
                        turn_id: format!("turn-{seq}"),
                        rolled_back: false,
                    });
                }
                user_frames.push((seq, frames));
                latest_answers.push(last);
                all_answers.push(answers_of_turn);
            }
            let view = ChatView::new(revisions);
            for (((seq, frames), latest), answers) in
                user_frames.iter().zip(&latest_answers).zip(&all_answers)
            {
                let shown: Vec<i64> = frames.iter().copied().filter(|f| !view.hides(*f)).collect();
                prop_assert_eq!(shown.len(), 1, "one question for turn {}", seq);
                let turn_id = format!("turn-{seq}");
                let shown_id = view.shown_as(shown[0]).map(str::to_owned)
                    .unwrap_or_else(|| format!("turn-{}", shown[0]));
                prop_assert_eq!(shown_id, turn_id);
                for answer in answers {
                    prop_assert_eq!(view.hides(*answer), !latest.contains(answer));
                }
            }
        }
    }
}
