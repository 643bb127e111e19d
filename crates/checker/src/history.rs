//! The history checker: tests and load runs record what clients saw (acked sends, frames seen
//! by each subscriber, turns delivered to agents, results acked) and the checker says whether
//! the promises held: no acked turn lost, at most one committed result per turn key, every
//! subscriber saw its conversation's frames once and in order, and how many deliveries to
//! agents were duplicates (allowed, reported). For streamed answers: what each subscriber
//! assembled of a stream is what its agent sent, each chunk once per connection and none
//! skipped, a stream that ended committed for a subscriber is whole there and equals the
//! stored answer it received, and a stopped turn's settled text is a prefix of what each
//! subscriber that saw its stream end was streamed.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

use uuid::Uuid;

/// A turn key: (conversation, seq, revision).
pub type TurnKey = (Uuid, i64, i64);

/// A stream: (conversation, stream id).
pub type StreamKey = (Uuid, String);

/// What one subscriber saw of one stream.
#[derive(Default)]
struct StreamView {
    /// Chunks as they arrived: (connection number, first index, last index, text); a chunk
    /// covers one index, a coalesced catch-up a range.
    arrivals: Vec<(u64, u64, u64, String)>,
    /// How the stream ended for the subscriber: `Some(true)` committed.
    ended: Option<bool>,
    /// The text of the stored frame that replaced the stream, when received.
    stored_text: Option<String>,
    /// The text the gateway settled the stream's stopped turn with, when received.
    settled_text: Option<String>,
}

#[derive(Default)]
struct Records {
    /// Acked user sends: client id → (conversation, seq).
    acked: BTreeMap<String, (Uuid, i64)>,
    /// Per subscriber and conversation: persistent frames received, in arrival order.
    received: BTreeMap<(String, Uuid), Vec<i64>>,
    /// Per subscriber and conversation: seqs it knows from its own acks.
    own: BTreeMap<(String, Uuid), BTreeSet<i64>>,
    /// Deliveries of each turn key to agents.
    deliveries: BTreeMap<TurnKey, usize>,
    /// First-time (not duplicate) result acks per turn key, with the seqs they name.
    results: BTreeMap<TurnKey, Vec<Vec<i64>>>,
    /// Chunks agents sent, per stream, by index.
    streams_sent: BTreeMap<StreamKey, BTreeMap<u64, String>>,
    /// Per subscriber and stream: what it saw.
    streams_seen: BTreeMap<(String, StreamKey), StreamView>,
    /// Per subscriber: its current connection's number (a new connection is shown the open
    /// streams from their first chunk again).
    connections: BTreeMap<String, u64>,
}

/// What the clients of a run saw.
#[derive(Default)]
pub struct History {
    records: Mutex<Records>,
}

/// The checker's findings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Acked user sends.
    pub acked: usize,
    /// Acked sends missing from the database (or stored at another seq).
    pub lost: Vec<String>,
    /// Turn keys with more than one committed result.
    pub duplicate_results: Vec<TurnKey>,
    /// Seqs a subscriber never saw (nor sent) below the highest frame it received.
    pub gaps: usize,
    /// Frames that arrived after a higher seq of the same conversation.
    pub inversions: usize,
    /// Frames a subscriber received twice.
    pub doubles: usize,
    /// Deliveries of turns to agents, and how many of them repeated a turn key.
    pub deliveries: usize,
    /// Repeated deliveries (allowed, reported).
    pub duplicate_deliveries: usize,
    /// Streams agents sent chunks of.
    pub streams: usize,
    /// Chunks subscribers received, over all streams.
    pub stream_chunks_seen: usize,
    /// Streams that ended committed for a subscriber (each subscriber counted).
    pub streams_seen_committed: usize,
    /// Stopped streams a subscriber saw end and then saw settled by the gateway (each
    /// subscriber counted): the settled text must be a prefix of what it was streamed.
    pub stopped_streams_checked: usize,
    /// Breaches of the stream promises, described (a chunk that differs from the one sent or
    /// was never sent, one skipped, one shown twice on one connection, a committed stream not
    /// whole, a stored answer that differs from the assembly).
    pub stream_breaches: Vec<String>,
}

impl Verdict {
    /// True when every promise held (duplicate deliveries are allowed).
    pub fn holds(&self) -> bool {
        self.lost.is_empty()
            && self.duplicate_results.is_empty()
            && self.gaps == 0
            && self.inversions == 0
            && self.doubles == 0
            && self.stream_breaches.is_empty()
    }
}

impl History {
    fn records(&self) -> std::sync::MutexGuard<'_, Records> {
        self.records
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A user send was acked with `seq`; the subscriber `who` knows its own frame from it.
    pub fn acked(&self, who: &str, client_id: &str, conversation: Uuid, seq: i64) {
        let mut records = self.records();
        records
            .acked
            .insert(client_id.to_owned(), (conversation, seq));
        records
            .own
            .entry((who.to_owned(), conversation))
            .or_default()
            .insert(seq);
    }

    /// The subscriber `who` received persistent frame `seq` of `conversation`.
    pub fn received(&self, who: &str, conversation: Uuid, seq: i64) {
        self.records()
            .received
            .entry((who.to_owned(), conversation))
            .or_default()
            .push(seq);
    }

    /// A turn was delivered to an agent.
    pub fn delivered(&self, key: TurnKey) {
        *self.records().deliveries.entry(key).or_default() += 1;
    }

    /// A result was acked for the first time (not as a duplicate) with these seqs.
    pub fn result_committed(&self, key: TurnKey, seqs: Vec<i64>) {
        self.records().results.entry(key).or_default().push(seqs);
    }

    /// An agent sent chunk `index` of a stream (recorded before it is sent).
    pub fn stream_chunk_sent(&self, stream: StreamKey, index: u64, text: &str) {
        self.records()
            .streams_sent
            .entry(stream)
            .or_default()
            .insert(index, text.to_owned());
    }

    /// The subscriber `who` opened a new connection (it may be shown open streams again).
    pub fn connected(&self, who: &str) {
        *self
            .records()
            .connections
            .entry(who.to_owned())
            .or_default() += 1;
    }

    /// The subscriber `who` received chunk `index` of a stream.
    pub fn stream_chunk_seen(&self, who: &str, stream: StreamKey, index: u64, text: &str) {
        self.stream_chunks_seen(who, stream, index, index, text);
    }

    /// The subscriber `who` received chunks `first..=last` of a stream as one (a catch-up's
    /// coalesced text).
    pub fn stream_chunks_seen(
        &self,
        who: &str,
        stream: StreamKey,
        first: u64,
        last: u64,
        text: &str,
    ) {
        let mut records = self.records();
        let connection = records.connections.get(who).copied().unwrap_or_default();
        records
            .streams_seen
            .entry((who.to_owned(), stream))
            .or_default()
            .arrivals
            .push((connection, first, last, text.to_owned()));
    }

    /// The subscriber `who` received a stream's end.
    pub fn stream_end_seen(&self, who: &str, stream: StreamKey, committed: bool) {
        self.records()
            .streams_seen
            .entry((who.to_owned(), stream))
            .or_default()
            .ended
            .get_or_insert(committed);
    }

    /// The subscriber `who` received the stored frame whose id is the stream's (the answer
    /// that replaces the streamed one).
    pub fn stream_answer_seen(&self, who: &str, stream: StreamKey, text: &str) {
        self.on_sent_stream(who, stream, |view| view.stored_text = Some(text.to_owned()));
    }

    /// Subscriber `who` received the gateway's settlement of a stopped turn that was streamed
    /// as `stream` (the settlement carries the stream's id), with `text`.
    pub fn stop_settled_seen(&self, who: &str, stream: StreamKey, text: &str) {
        self.on_sent_stream(who, stream, |view| {
            view.settled_text = Some(text.to_owned())
        });
    }

    /// Changes what `who` saw of `stream`, when an agent sent that stream (a frame whose id
    /// merely looks like a stream's is not one).
    fn on_sent_stream(&self, who: &str, stream: StreamKey, change: impl FnOnce(&mut StreamView)) {
        let mut records = self.records();
        if !records.streams_sent.contains_key(&stream) {
            return;
        }
        change(
            records
                .streams_seen
                .entry((who.to_owned(), stream))
                .or_default(),
        );
    }

    /// Acked sends recorded so far.
    pub fn acked_sends(&self) -> BTreeMap<String, (Uuid, i64)> {
        self.records().acked.clone()
    }

    /// Checks the records against `stored`: client id → (conversation, seq) as the database has
    /// the user frames.
    pub fn verdict(&self, stored: &BTreeMap<String, (Uuid, i64)>) -> Verdict {
        let records = self.records();
        let lost = records
            .acked
            .iter()
            .filter(|(client_id, at)| stored.get(*client_id) != Some(*at))
            .map(|(client_id, _)| client_id.clone())
            .collect();
        let duplicate_results = records
            .results
            .iter()
            .filter(|(_, commits)| commits.iter().collect::<BTreeSet<_>>().len() > 1)
            .map(|(key, _)| *key)
            .collect();
        let mut verdict = Verdict {
            acked: records.acked.len(),
            lost,
            duplicate_results,
            ..Verdict::default()
        };
        for (subscriber, seqs) in &records.received {
            let mut highest = 0;
            let mut once = BTreeSet::new();
            for seq in seqs {
                if !once.insert(*seq) {
                    verdict.doubles += 1;
                } else if *seq < highest {
                    verdict.inversions += 1;
                }
                highest = highest.max(*seq);
            }
            // Below the highest frame received, every seq was received or is the subscriber's
            // own (acked). Above it frames may still have been in flight when the run stopped.
            let own = records.own.get(subscriber).cloned().unwrap_or_default();
            verdict.gaps += (1..=highest)
                .filter(|seq| !once.contains(seq) && !own.contains(seq))
                .count();
        }
        verdict.streams = records.streams_sent.len();
        for ((who, stream), view) in &records.streams_seen {
            let sent = records.streams_sent.get(stream);
            check_stream(&mut verdict, who, stream, view, sent);
        }
        verdict.deliveries = records.deliveries.values().sum();
        verdict.duplicate_deliveries = records
            .deliveries
            .values()
            .map(|count| count.saturating_sub(1))
            .sum();
        verdict
    }
}

/// Checks what subscriber `who` saw of one stream against what was sent.
fn check_stream(
    verdict: &mut Verdict,
    who: &str,
    stream: &StreamKey,
    view: &StreamView,
    sent: Option<&BTreeMap<u64, String>>,
) {
    let name = format!("{who} on {}/{}", stream.0, stream.1);
    let empty = BTreeMap::new();
    let sent = sent.unwrap_or(&empty);
    // Per connection: the next index a chunk may have (shown again from 0 on a new one).
    let mut connection = None;
    let mut next_on_connection = 0;
    let mut assembled: BTreeMap<u64, &str> = BTreeMap::new();
    for (on, first, last, text) in &view.arrivals {
        verdict.stream_chunks_seen += usize::try_from(last - first + 1).unwrap_or(usize::MAX);
        if connection != Some(*on) {
            connection = Some(*on);
            next_on_connection = 0;
        }
        let covered: Option<Vec<&str>> = (*first..=*last)
            .map(|index| sent.get(&index).map(String::as_str))
            .collect();
        match &covered {
            Some(texts) if texts.concat() == *text => {
                for (index, sent_text) in (*first..=*last).zip(texts) {
                    assembled.insert(index, sent_text);
                }
            }
            _ => {
                verdict.stream_breaches.push(format!(
                    "{name}: chunks {first}..={last} are not the ones sent"
                ));
                assembled.insert(*first, text);
            }
        }
        // A connection is shown a stream from its first chunk, each chunk once, in order.
        if *first < next_on_connection {
            verdict.stream_breaches.push(format!(
                "{name}: chunk {first} shown twice on one connection"
            ));
        } else if *first > next_on_connection {
            verdict.stream_breaches.push(format!(
                "{name}: chunk {first} came before chunk {next_on_connection}"
            ));
        }
        next_on_connection = next_on_connection.max(last + 1);
    }
    // A stopped stream that ended for the subscriber: it was shown every chunk the stream's
    // node took before the stop, and the gateway settles the turn with those.
    if let (Some(settled), Some(false)) = (&view.settled_text, view.ended) {
        verdict.stopped_streams_checked += 1;
        let streamed: String = assembled.values().copied().collect();
        if !streamed.starts_with(settled.as_str()) {
            verdict.stream_breaches.push(format!(
                "{name}: the stopped turn settled with {settled:?}, not a prefix of what was streamed, {streamed:?}"
            ));
        }
    }
    if view.ended != Some(true) {
        return;
    }
    verdict.streams_seen_committed += 1;
    if assembled.len() != sent.len() {
        verdict.stream_breaches.push(format!(
            "{name}: ended committed with {} of its {} chunks",
            assembled.len(),
            sent.len()
        ));
    }
    let text: String = assembled.values().copied().collect();
    if let Some(stored) = &view.stored_text
        && *stored != text
    {
        verdict.stream_breaches.push(format!(
            "{name}: assembled {text:?}, the stored answer is {stored:?}"
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONVERSATION: Uuid = Uuid::from_u128(1);

    fn stored(entries: &[(&str, i64)]) -> BTreeMap<String, (Uuid, i64)> {
        entries
            .iter()
            .map(|(client_id, seq)| ((*client_id).to_owned(), (CONVERSATION, *seq)))
            .collect()
    }

    #[test]
    fn a_clean_history_holds() {
        let history = History::default();
        history.acked("u", "c-1", CONVERSATION, 1);
        history.received("u", CONVERSATION, 2);
        history.acked("u", "c-2", CONVERSATION, 3);
        history.received("u", CONVERSATION, 4);
        history.delivered((CONVERSATION, 1, 0));
        history.result_committed((CONVERSATION, 1, 0), vec![2]);
        let verdict = history.verdict(&stored(&[("c-1", 1), ("c-2", 3)]));
        assert!(verdict.holds(), "{verdict:?}");
        assert_eq!(verdict.acked, 2);
        assert_eq!((verdict.deliveries, verdict.duplicate_deliveries), (1, 0));
    }

    #[test]
    fn an_acked_send_missing_or_stored_elsewhere_is_lost() {
        let history = History::default();
        history.acked("u", "c-1", CONVERSATION, 1);
        history.acked("u", "c-2", CONVERSATION, 2);
        history.acked("u", "c-3", CONVERSATION, 3);
        let verdict = history.verdict(&stored(&[("c-1", 1), ("c-2", 5)]));
        assert_eq!(verdict.lost, ["c-2", "c-3"]);
        assert!(!verdict.holds());
    }

    #[test]
    fn two_different_results_for_one_turn_key_are_a_duplicate_result() {
        let history = History::default();
        let key = (CONVERSATION, 1, 0);
        history.result_committed(key, vec![2]);
        // The same commit reported twice (two acks naming the same seqs) is one result.
        history.result_committed(key, vec![2]);
        assert!(history.verdict(&BTreeMap::new()).holds());
        history.result_committed(key, vec![3]);
        assert_eq!(history.verdict(&BTreeMap::new()).duplicate_results, [key]);
    }

    #[test]
    fn a_missing_seq_below_the_highest_received_is_a_gap_unless_it_is_the_subscribers_own() {
        let history = History::default();
        history.acked("u", "c-1", CONVERSATION, 1);
        history.received("u", CONVERSATION, 2);
        history.received("u", CONVERSATION, 5);
        // 3 and 4 missing: two gaps; another subscriber's history is checked on its own.
        history.received("v", CONVERSATION, 1);
        let verdict = history.verdict(&stored(&[("c-1", 1)]));
        assert_eq!(
            (verdict.gaps, verdict.inversions, verdict.doubles),
            (2, 0, 0)
        );
    }

    #[test]
    fn a_late_lower_seq_is_an_inversion_and_a_repeat_is_a_double() {
        let history = History::default();
        for seq in [1, 3, 2, 3] {
            history.received("u", CONVERSATION, seq);
        }
        let verdict = history.verdict(&BTreeMap::new());
        assert_eq!(
            (verdict.gaps, verdict.inversions, verdict.doubles),
            (0, 1, 1)
        );
        assert!(!verdict.holds());
    }

    fn stream() -> StreamKey {
        (CONVERSATION, "s-1".to_owned())
    }

    fn sent(history: &History, chunks: &[&str]) {
        for (index, text) in chunks.iter().enumerate() {
            history.stream_chunk_sent(stream(), index as u64, text);
        }
    }

    #[test]
    fn a_stream_shown_again_to_a_new_connection_and_committed_whole_holds() {
        let history = History::default();
        sent(&history, &["answer", " ", "7"]);
        history.connected("u");
        history.stream_chunk_seen("u", stream(), 0, "answer");
        history.stream_chunk_seen("u", stream(), 1, " ");
        // A reconnect: the open stream is shown from its first chunk again.
        history.connected("u");
        for (index, text) in ["answer", " ", "7"].iter().enumerate() {
            history.stream_chunk_seen("u", stream(), index as u64, text);
        }
        history.stream_end_seen("u", stream(), true);
        history.stream_answer_seen("u", stream(), "answer 7");
        // Another subscriber saw a prefix, then the abort: allowed.
        history.stream_chunk_seen("v", stream(), 0, "answer");
        history.stream_end_seen("v", stream(), false);
        let verdict = history.verdict(&BTreeMap::new());
        assert!(verdict.holds(), "{verdict:?}");
        assert_eq!((verdict.streams, verdict.stream_chunks_seen), (1, 6));
        assert_eq!(verdict.streams_seen_committed, 1);
    }

    #[test]
    fn a_coalesced_catch_up_holds_when_it_joins_exactly_the_chunks_it_covers() {
        let history = History::default();
        sent(&history, &["a", "b", "c", "d"]);
        history.connected("joined");
        history.stream_chunks_seen("joined", stream(), 0, 2, "abc");
        history.stream_chunk_seen("joined", stream(), 3, "d");
        history.stream_end_seen("joined", stream(), true);
        history.stream_answer_seen("joined", stream(), "abcd");
        history.stream_chunks_seen("wrong", stream(), 0, 1, "ax");
        history.stream_chunks_seen("overlapping", stream(), 0, 1, "ab");
        history.stream_chunks_seen("overlapping", stream(), 1, 2, "bc");
        let verdict = history.verdict(&BTreeMap::new());
        assert_eq!(
            verdict.stream_breaches.len(),
            2,
            "{:?}",
            verdict.stream_breaches
        );
        assert_eq!(verdict.streams_seen_committed, 1);
    }

    #[test]
    fn a_stream_chunk_changed_skipped_or_doubled_is_a_breach() {
        let history = History::default();
        sent(&history, &["a", "b", "c"]);
        history.stream_chunk_seen("changed", stream(), 0, "x");
        history.stream_chunk_seen("skipped", stream(), 0, "a");
        history.stream_chunk_seen("skipped", stream(), 2, "c");
        history.stream_chunk_seen("doubled", stream(), 0, "a");
        history.stream_chunk_seen("doubled", stream(), 0, "a");
        let verdict = history.verdict(&BTreeMap::new());
        assert_eq!(
            verdict.stream_breaches.len(),
            3,
            "{:?}",
            verdict.stream_breaches
        );
        assert!(!verdict.holds());
    }

    #[test]
    fn a_committed_stream_must_be_whole_and_equal_the_stored_answer() {
        let history = History::default();
        sent(&history, &["a", "b"]);
        history.stream_chunk_seen("short", stream(), 0, "a");
        history.stream_end_seen("short", stream(), true);
        history.stream_chunk_seen("other", stream(), 0, "a");
        history.stream_chunk_seen("other", stream(), 1, "b");
        history.stream_end_seen("other", stream(), true);
        history.stream_answer_seen("other", stream(), "ab!");
        let verdict = history.verdict(&BTreeMap::new());
        assert_eq!(
            verdict.stream_breaches.len(),
            2,
            "{:?}",
            verdict.stream_breaches
        );
    }

    #[test]
    fn a_stopped_turn_must_settle_with_a_prefix_of_what_was_streamed() {
        let history = History::default();
        sent(&history, &["Once ", "upon ", "a time"]);
        for who in ["saw-two", "saw-one"] {
            history.stream_chunk_seen(who, stream(), 0, "Once ");
        }
        history.stream_chunk_seen("saw-two", stream(), 1, "upon ");
        history.stream_end_seen("saw-two", stream(), false);
        history.stop_settled_seen("saw-two", stream(), "Once upon ");
        history.stream_end_seen("saw-one", stream(), false);
        history.stop_settled_seen("saw-one", stream(), "Once upon ");
        let verdict = history.verdict(&BTreeMap::new());
        assert_eq!(verdict.stopped_streams_checked, 2);
        assert_eq!(
            verdict.stream_breaches.len(),
            1,
            "{:?}",
            verdict.stream_breaches
        );
        assert!(verdict.stream_breaches[0].starts_with("saw-one"));
    }

    #[test]
    fn repeated_deliveries_are_reported_but_allowed() {
        let history = History::default();
        for _ in 0..3 {
            history.delivered((CONVERSATION, 1, 0));
        }
        history.delivered((CONVERSATION, 2, 0));
        let verdict = history.verdict(&BTreeMap::new());
        assert_eq!((verdict.deliveries, verdict.duplicate_deliveries), (4, 2));
        assert!(verdict.holds());
    }
}
