//! The history checker of the test support finds each kind of breach it is meant to find.

mod support;

use std::collections::BTreeMap;

use support::history::History;
use uuid::Uuid;

#[test]
fn the_checker_finds_each_kind_of_breach() {
    let history = History::default();
    let conversation = Uuid::nil();
    history.acked("u", "c-1", conversation, 1);
    history.received("u", conversation, 2);
    history.received("u", conversation, 4);
    history.received("u", conversation, 3);
    history.received("u", conversation, 4);
    history.delivered((conversation, 1, 0));
    history.delivered((conversation, 1, 0));
    history.result_committed((conversation, 1, 0), vec![2]);
    history.result_committed((conversation, 1, 0), vec![5]);
    let verdict = history.verdict(&BTreeMap::new());
    assert_eq!(verdict.lost, ["c-1"]);
    assert_eq!(verdict.duplicate_results, [(conversation, 1, 0)]);
    assert_eq!(
        (verdict.inversions, verdict.doubles, verdict.gaps),
        (1, 1, 0)
    );
    assert_eq!((verdict.deliveries, verdict.duplicate_deliveries), (2, 1));
    assert!(!verdict.holds());
}
