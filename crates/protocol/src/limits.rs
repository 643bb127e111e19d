//! Per-connection limits, configured by the operator and announced in `welcome.limits`.

use serde::{Deserialize, Serialize};

/// The largest `max_stream_bytes` a node accepts: a stream's chunk offsets are kept in 32 bits
/// (a node holds every open stream of the cluster), and no answer streams 64 MiB.
pub const MAX_STREAM_BYTES_CEILING: usize = 64 * 1024 * 1024;

/// The limits a node enforces. Serde names are the configuration keys (snake_case);
/// `to_wire` gives the camelCase object of `welcome.data.limits`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest accepted text message or REST body; larger gets `payload_too_large` / 413.
    pub max_frame_bytes: usize,
    /// Above this a WebSocket message closes the connection with 1009.
    pub hard_frame_bytes: usize,
    /// Largest `data.text` of a message frame, in bytes.
    pub max_text_bytes: usize,
    /// Largest serialized `metadata` object, in bytes.
    pub max_metadata_bytes: usize,
    /// Unacked sends allowed per connection.
    pub max_in_flight: usize,
    /// Interval of server pings and `heartbeat` frames.
    pub heartbeat_interval_ms: u64,
    /// No inbound data for this long closes the connection with 4408.
    pub idle_timeout_ms: u64,
    /// `hello` must arrive within this of the upgrade, or the connection closes with 4408 (not
    /// announced: the welcome comes after it).
    pub hello_timeout_ms: u64,
    /// Frames per replay batch.
    pub replay_batch: usize,
    /// Frames replayed at most before `replayTruncated` (converger profile).
    pub replay_max: usize,
    /// Conversations a channel-scope connection may hold at once.
    pub max_conversations: usize,
    /// Inbound frames per second allowed per connection.
    pub max_frames_per_sec: u32,
    /// Frames queued for one connection before it counts as a slow consumer (not announced).
    pub outbound_queue_frames: usize,
    /// A write to a socket that takes longer than this ends the connection (not announced).
    pub write_timeout_ms: u64,
    /// Typing frames of one connection are relayed at most once per this interval unless the
    /// state changes (not announced).
    pub typing_throttle_ms: u64,
    /// Bytes of chunks one streamed answer may hold before it is aborted.
    pub max_stream_bytes: usize,
    /// Streams one agent connection may have open at once.
    pub max_streams_per_connection: usize,
    /// Bytes of chunks the open streams of one channel's agent connections on a node may hold
    /// together; over it a stream is refused (or aborted).
    pub max_stream_bytes_per_channel: usize,
    /// Bytes of chunks every open stream a node holds may hold together (other nodes' streams
    /// it shows included).
    pub max_stream_bytes_per_node: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_bytes: 64 * 1024,
            hard_frame_bytes: 1024 * 1024,
            max_text_bytes: 16 * 1024,
            max_metadata_bytes: 4 * 1024,
            max_in_flight: 32,
            heartbeat_interval_ms: 25_000,
            idle_timeout_ms: 60_000,
            hello_timeout_ms: 10_000,
            replay_batch: 200,
            replay_max: 1_000,
            max_conversations: 10_000,
            max_frames_per_sec: 50,
            outbound_queue_frames: 512,
            write_timeout_ms: 10_000,
            typing_throttle_ms: 1_000,
            max_stream_bytes: 256 * 1024,
            max_streams_per_connection: 64,
            max_stream_bytes_per_channel: 32 * 1024 * 1024,
            max_stream_bytes_per_node: 128 * 1024 * 1024,
        }
    }
}

impl Limits {
    /// The `welcome.data.limits` object (`maxConversations` only for channel scope).
    pub fn to_wire(&self, channel_scope: bool) -> serde_json::Value {
        let mut wire = serde_json::json!({
            "maxFrameBytes": self.max_frame_bytes,
            "maxTextBytes": self.max_text_bytes,
            "maxMetadataBytes": self.max_metadata_bytes,
            "maxInFlight": self.max_in_flight,
            "heartbeatIntervalMs": self.heartbeat_interval_ms,
            "idleTimeoutMs": self.idle_timeout_ms,
            "helloTimeoutMs": self.hello_timeout_ms,
            "replayBatch": self.replay_batch,
            "replayMax": self.replay_max,
            "maxStreamBytes": self.max_stream_bytes,
        });
        if channel_scope {
            wire["maxConversations"] = serde_json::Value::from(self.max_conversations);
            wire["maxStreamsPerConnection"] =
                serde_json::Value::from(self.max_streams_per_connection);
            wire["maxStreamBytesPerChannel"] =
                serde_json::Value::from(self.max_stream_bytes_per_channel);
            wire["maxStreamBytesPerNode"] = serde_json::Value::from(self.max_stream_bytes_per_node);
        }
        wire
    }

    /// Checks the relations between limits; the error names the offending key.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_frame_bytes == 0 {
            return Err("limits.max_frame_bytes must be greater than 0".into());
        }
        if self.hard_frame_bytes < self.max_frame_bytes {
            return Err("limits.hard_frame_bytes must be at least limits.max_frame_bytes".into());
        }
        if self.max_text_bytes > self.max_frame_bytes {
            return Err("limits.max_text_bytes must not exceed limits.max_frame_bytes".into());
        }
        if self.max_metadata_bytes > self.max_frame_bytes {
            return Err("limits.max_metadata_bytes must not exceed limits.max_frame_bytes".into());
        }
        if self.heartbeat_interval_ms == 0 || self.heartbeat_interval_ms * 2 > self.idle_timeout_ms
        {
            return Err(
                "limits.heartbeat_interval_ms must be positive and at most limits.idle_timeout_ms / 2"
                    .into(),
            );
        }
        if self.max_stream_bytes == 0 || self.max_streams_per_connection == 0 {
            return Err(
                "limits.max_stream_bytes and limits.max_streams_per_connection must be greater than 0"
                    .into(),
            );
        }
        if self.max_stream_bytes > MAX_STREAM_BYTES_CEILING {
            return Err("limits.max_stream_bytes must be at most 67108864 (64 MiB)".into());
        }
        if self.max_stream_bytes_per_channel < self.max_stream_bytes
            || self.max_stream_bytes_per_node < self.max_stream_bytes_per_channel
        {
            return Err(
                "limits.max_stream_bytes_per_channel must be at least limits.max_stream_bytes, and limits.max_stream_bytes_per_node at least limits.max_stream_bytes_per_channel"
                    .into(),
            );
        }
        if self.hello_timeout_ms == 0 {
            return Err("limits.hello_timeout_ms must be greater than 0".into());
        }
        if self.replay_batch == 0 || self.replay_max == 0 {
            return Err("limits.replay_batch and limits.replay_max must be greater than 0".into());
        }
        if self.max_in_flight == 0 {
            return Err("limits.max_in_flight must be greater than 0".into());
        }
        if self.max_frames_per_sec == 0 {
            return Err("limits.max_frames_per_sec must be greater than 0".into());
        }
        if self.outbound_queue_frames == 0 || self.write_timeout_ms == 0 {
            return Err(
                "limits.outbound_queue_frames and limits.write_timeout_ms must be greater than 0"
                    .into(),
            );
        }
        if self.max_conversations == 0 {
            return Err("limits.max_conversations must be greater than 0".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_wire_names_are_camel_case() {
        let limits = Limits::default();
        limits.validate().unwrap();
        let wire = limits.to_wire(false);
        assert_eq!(wire["maxFrameBytes"], 64 * 1024);
        assert!(wire.get("heartbeatIntervalMs").is_some());
        assert!(wire.get("maxConversations").is_none());
        assert!(limits.to_wire(true).get("maxConversations").is_some());
    }

    #[test]
    fn heartbeat_above_half_idle_is_refused() {
        let limits = Limits {
            heartbeat_interval_ms: 40_000,
            ..Limits::default()
        };
        let message = limits.validate().unwrap_err();
        assert!(
            message.contains("limits.heartbeat_interval_ms"),
            "{message}"
        );
    }
}
