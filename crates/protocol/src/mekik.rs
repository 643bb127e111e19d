//! What the mekik profile shows an unmodified chativa widget (docs/protocol.md §3.7, ADR 0027):
//! the ids, seqs and notices by which converger's streams, closes and refusals become what the
//! widget's mekik connector and engine render.
//!
//! - The engine keys a streamed text bubble `mekik-text-<streamId>-<chunk id>` and drops any
//!   message whose id it has shown: the stored answer of a stream takes that id in this
//!   profile, so it lands on the streamed bubble instead of becoming a second one.
//! - The connector keeps the highest `seq` it saw as its watermark and sends it back in
//!   `hello` when it reconnects. A stream chunk carries `seq` = the turn's seq plus
//!   (chunks shown so far) / 2^20: the reconnecting widget tells the node how much of the
//!   stream it already shows, and is sent only the rest.
//! - The widget renders any frame it does not handle as a text bubble, and shows nothing of
//!   `error` frames: a close or reopen is shown as a text notice, an aborted stream ends with a
//!   notice appended, and a refused send is followed by a notice, so nothing is an empty bubble
//!   and nothing vanishes without a word.

use serde_json::{Value, json};

use crate::ErrorCode;

/// Chunks a stream's `seq` fraction counts: 2^20, so that a seq below 2^33 plus the fraction
/// is exact in a double (53 bits), which is what the widget keeps.
const CHUNK_FRACTION: f64 = 1_048_576.0;
const MAX_FRACTIONAL_SEQ: u64 = 1 << 33;

/// Appended to a stream the widget was shown when it ends without an answer.
pub const ABORT_NOTICE: &str = "\n\n⚠️ The answer was interrupted.";

/// Appended to a stream the widget was shown when its turn was stopped.
pub const STOP_NOTICE: &str = "\n\n⏹️ Stopped.";

/// Shown for a stopped turn whose answer had no text yet.
pub const STOPPED_NOTICE: &str = "⏹️ Stopped.";

/// What the end of an aborted stream appends to its bubble, by the abort's reason.
pub fn abort_notice(reason: &str) -> &'static str {
    match reason {
        "stopped" | "superseded" | "conversation_closed" | "user_disconnected" => STOP_NOTICE,
        _ => ABORT_NOTICE,
    }
}

/// The id the widget's engine gives the text bubble of stream `stream_id` (whose text chunks
/// carry the stream's id as their chunk id).
pub fn stream_bubble_id(stream_id: &str) -> String {
    format!("mekik-text-{stream_id}-{stream_id}")
}

/// The `seq` of a stream chunk answering turn `turn_seq` after which the widget shows
/// `chunks_shown` chunks of it; `None` when the fraction cannot be exact (the chunk is then
/// sent without `seq`, and a reconnect shows the stream from its start).
pub fn chunk_seq(turn_seq: i64, chunks_shown: u64) -> Option<f64> {
    let turn_seq = u64::try_from(turn_seq).ok()?;
    if turn_seq >= MAX_FRACTIONAL_SEQ || chunks_shown == 0 || chunks_shown >= 1 << 20 {
        return None;
    }
    Some(turn_seq as f64 + chunks_shown as f64 / CHUNK_FRACTION)
}

/// How much of a stream a reconnecting widget shows, read from its watermark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamProgress {
    /// The seq of the turn the stream answers.
    pub turn_seq: u64,
    /// Chunks of it the widget shows (indices `0..chunks_shown`).
    pub chunks_shown: u64,
}

/// A `hello.watermark`: the stored frames' watermark (its whole part), and, when it has a
/// fraction [`chunk_seq`] made, the progress of the stream answering that seq. `None` for
/// anything but a non-negative number.
pub fn split_watermark(value: &Value) -> Option<(u64, Option<StreamProgress>)> {
    if let Some(whole) = value.as_u64() {
        return Some((whole, None));
    }
    let number = value.as_f64().filter(|number| *number >= 0.0)?;
    let whole = number.floor();
    if whole >= MAX_FRACTIONAL_SEQ as f64 {
        return Some((whole as u64, None));
    }
    let turn_seq = whole as u64;
    let chunks_shown = ((number - whole) * CHUNK_FRACTION).round() as u64;
    let progress = (chunks_shown > 0).then_some(StreamProgress {
        turn_seq,
        chunks_shown,
    });
    Some((turn_seq, progress))
}

/// The text a `conversationUpdate` frame shows as (its `data.event`).
pub fn conversation_update_notice(data: &Value) -> &'static str {
    match data.get("event").and_then(Value::as_str) {
        Some("reopened") => "This conversation was reopened.",
        _ => "This conversation was closed.",
    }
}

/// Whether a refused frame of `frame_type` is a message the user typed (not a control frame or
/// one forwarded to agents), whose refusal the widget must show.
pub fn shows_refusal(frame_type: &str) -> bool {
    !crate::CONTROL_TYPES.contains(&frame_type) && !crate::FORWARDED_TYPES.contains(&frame_type)
}

/// The transient text frame that follows the `error` refusing the widget's send `client_id`:
/// the widget shows no `error` frame, so without it the message would vanish without a word.
pub fn refusal_notice(client_id: &str, code: ErrorCode, message: &str) -> String {
    let text = match code {
        ErrorCode::ConversationClosed => {
            "⚠️ This conversation is closed; your message was not delivered.".to_owned()
        }
        _ => format!(
            "⚠️ Your message was not delivered: {}.",
            message.trim_end_matches('.')
        ),
    };
    crate::encode(&json!({
        "type": "text",
        "id": format!("refused-{client_id}"),
        "from": "bot",
        "data": {"text": text},
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chunk_seq_reads_back_as_the_stream_progress_it_names() {
        for (turn, shown) in [
            (1_i64, 1_u64),
            (7, 600),
            (123_456, 10_000),
            (8_589_934_591, 1_048_575),
        ] {
            let seq = chunk_seq(turn, shown).expect("representable");
            // The widget keeps a double and writes it back as JSON.
            let written: Value =
                serde_json::from_str(&serde_json::to_string(&seq).unwrap()).unwrap();
            assert_eq!(
                split_watermark(&written),
                Some((
                    turn as u64,
                    Some(StreamProgress {
                        turn_seq: turn as u64,
                        chunks_shown: shown
                    })
                )),
                "turn {turn}, {shown} shown"
            );
        }
    }

    #[test]
    fn seqs_that_cannot_be_exact_carry_no_fraction() {
        assert_eq!(chunk_seq(1 << 33, 1), None);
        assert_eq!(chunk_seq(5, 1 << 20), None);
        assert_eq!(chunk_seq(-1, 1), None);
        assert_eq!(chunk_seq(5, 0), None);
    }

    #[test]
    fn watermarks_are_split_into_the_stored_part_and_the_stream_part() {
        assert_eq!(split_watermark(&json!(12)), Some((12, None)));
        assert_eq!(split_watermark(&json!(12.0)), Some((12, None)));
        assert_eq!(split_watermark(&json!(-1)), None);
        assert_eq!(split_watermark(&json!("12")), None);
        assert_eq!(split_watermark(&json!(1e300)), Some((u64::MAX, None)));
    }

    #[test]
    fn notices_say_what_happened() {
        assert_eq!(
            conversation_update_notice(&json!({"event": "reopened"})),
            "This conversation was reopened."
        );
        let notice: Value = serde_json::from_str(&refusal_notice(
            "c-1",
            ErrorCode::ConversationClosed,
            "closed",
        ))
        .unwrap();
        assert_eq!(notice["id"], "refused-c-1");
        assert!(notice["data"]["text"].as_str().unwrap().contains("closed"));
        assert_eq!(notice.get("seq"), None, "a notice is not stored");
        assert!(shows_refusal("text") && shows_refusal("event"));
        assert!(!shows_refusal("edit") && !shows_refusal("abort"));
    }
}
