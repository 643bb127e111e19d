//! The socket plumbing both scopes share: handshake, reads with a liveness deadline, writes
//! with a timeout, and reconnecting with backoff when the connection ends for a reason a new
//! connection can fix.

use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use crate::backoff::Backoff;
use crate::error::ClientError;
use crate::outbox::Outbox;

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Liveness deadline before the server announces `idleTimeoutMs`.
const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Timeouts and reconnect settings shared by both scopes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionOptions {
    /// Delays between reconnect attempts.
    pub backoff: Backoff,
    /// Limit for one connection attempt: TCP, upgrade, `hello` and `welcome`.
    pub connect_timeout: Duration,
    /// Limit for writing one frame.
    pub write_timeout: Duration,
    /// How long a keyed send waits for its ack before it is written again.
    pub ack_timeout: Duration,
}

impl Default for SessionOptions {
    /// Default backoff, 10 s to connect, 10 s per write, resend after 5 s without an ack.
    fn default() -> SessionOptions {
        SessionOptions {
            backoff: Backoff::default(),
            connect_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(10),
            ack_timeout: Duration::from_secs(5),
        }
    }
}

/// What to do after the server closed the socket or refused the upgrade.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CloseAction {
    /// Connect again, no sooner than `after` when the server said so.
    Reconnect { after: Option<Duration> },
    /// A new connection would be refused the same way.
    Stop,
}

/// Close codes after which reconnecting with the same token and frames cannot succeed:
/// protocol errors, auth or expiry, an inactive channel, a frame above the hard cap (it would
/// be resent), and the generic WebSocket protocol/policy/data errors.
const FINAL_CLOSE_CODES: [u16; 8] = [1002, 1003, 1007, 1008, 1009, 4400, 4401, 4403];

/// Decides on a close frame; 1012 (draining) and 4503 (slow consumer) carry their delay in a
/// JSON reason.
pub(crate) fn close_action(code: u16, reason: &str) -> CloseAction {
    if FINAL_CLOSE_CODES.contains(&code) {
        return CloseAction::Stop;
    }
    CloseAction::Reconnect {
        after: retry_after_in_reason(reason),
    }
}

/// `retryAfterMs` of a JSON close reason such as `{"reason":"unavailable","retryAfterMs":1500}`.
pub(crate) fn retry_after_in_reason(reason: &str) -> Option<Duration> {
    let reason: Value = serde_json::from_str(reason).ok()?;
    reason["retryAfterMs"].as_u64().map(Duration::from_millis)
}

/// Decides on an HTTP answer to the upgrade: 503 while draining (with `Retry-After` in
/// seconds) and other server-side failures are worth retrying, client-side refusals are not.
pub(crate) fn http_action(status: u16, retry_after_header: Option<&str>) -> CloseAction {
    if status < 500 && status != 429 {
        return CloseAction::Stop;
    }
    let after = retry_after_header
        .and_then(|value| value.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    CloseAction::Reconnect { after }
}

/// Why a connection attempt or a connection ended.
#[derive(Debug)]
enum Failure {
    /// A new connection may succeed.
    Retry {
        after: Option<Duration>,
        why: String,
    },
    /// A new connection would fail the same way.
    Final(ClientError),
}

/// One received WebSocket message, as far as the session cares.
enum Received {
    Frame(Value),
    Activity,
    End(Failure),
}

/// A successful handshake.
#[derive(Debug)]
pub(crate) struct Opened {
    /// The whole `welcome` frame.
    pub(crate) welcome: Value,
    /// Frames that arrived before `welcome`, in order.
    pub(crate) early: Vec<Value>,
}

/// One logical session over successive sockets.
pub(crate) struct Link {
    url: String,
    options: SessionOptions,
    socket: Option<Socket>,
    failures: u32,
    retry_hint: Option<Duration>,
    last_failure: String,
    last_inbound: Instant,
    idle_timeout: Duration,
}

impl Link {
    /// A session for `url`, not connected yet.
    pub(crate) fn new(url: &str, options: SessionOptions) -> Link {
        Link {
            url: url.to_owned(),
            options,
            socket: None,
            failures: 0,
            retry_hint: None,
            last_failure: String::new(),
            last_inbound: Instant::now(),
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }

    /// Whether a socket is open.
    pub(crate) fn is_connected(&self) -> bool {
        self.socket.is_some()
    }

    /// The first connection: one attempt, any failure is the caller's.
    pub(crate) async fn connect_once(&mut self, hello: &Value) -> Result<Opened, ClientError> {
        match self.attempt(hello).await {
            Ok(opened) => Ok(opened),
            Err(Failure::Retry { why, .. }) => Err(ClientError::Connection(why)),
            Err(Failure::Final(error)) => Err(error),
        }
    }

    /// Connects again, waiting the backoff delay before each attempt.
    pub(crate) async fn reconnect(&mut self, hello: &Value) -> Result<Opened, ClientError> {
        loop {
            if self.options.backoff.exhausted(self.failures) {
                let attempts = self.failures;
                // A caller that keeps going starts a fresh series of attempts.
                self.failures = 0;
                return Err(ClientError::GaveUp {
                    attempts,
                    last: std::mem::take(&mut self.last_failure),
                });
            }
            let delay = self.options.backoff.delay_with_hint(
                self.failures,
                rand::random::<f64>(),
                self.retry_hint,
            );
            tokio::time::sleep(delay).await;
            // Counted before the attempt, so a caller that cancels mid-attempt still backs off.
            self.failures += 1;
            match self.attempt(hello).await {
                Ok(opened) => return Ok(opened),
                Err(Failure::Retry { after, why }) => {
                    self.retry_hint = after;
                    self.last_failure = why;
                }
                Err(Failure::Final(error)) => {
                    self.last_failure = error.to_string();
                    return Err(error);
                }
            }
        }
    }

    async fn attempt(&mut self, hello: &Value) -> Result<Opened, Failure> {
        let timeout = self.options.connect_timeout;
        let (socket, opened) =
            match tokio::time::timeout(timeout, handshake(&self.url, hello)).await {
                Ok(result) => result?,
                Err(_) => {
                    return Err(Failure::Retry {
                        after: None,
                        why: format!("no welcome within {timeout:?}"),
                    });
                }
            };
        self.socket = Some(socket);
        self.failures = 0;
        self.retry_hint = None;
        self.last_inbound = Instant::now();
        self.idle_timeout = opened.welcome["data"]["limits"]["idleTimeoutMs"]
            .as_u64()
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_IDLE_TIMEOUT);
        Ok(opened)
    }

    /// Writes the outbox's due sends. A failed write drops the socket; the sends stay queued.
    pub(crate) async fn send_due(&mut self, outbox: &mut Outbox) {
        if !self.is_connected() {
            return;
        }
        for text in outbox.take_due(Instant::now()) {
            if !self.write(text).await {
                return;
            }
        }
    }

    /// Writes one frame now; false when there is no socket or the write failed (which drops
    /// the socket).
    pub(crate) async fn write(&mut self, text: String) -> bool {
        let Some(socket) = self.socket.as_mut() else {
            return false;
        };
        let sent = tokio::time::timeout(
            self.options.write_timeout,
            socket.send(Message::Text(text.into())),
        )
        .await;
        match sent {
            Ok(Ok(())) => true,
            Ok(Err(error)) => {
                self.drop_socket(None, format!("write failed: {error}"));
                false
            }
            Err(_) => {
                self.drop_socket(None, "write timed out".into());
                false
            }
        }
    }

    /// Writes due sends, then waits for one frame until the next resend time or the liveness
    /// deadline. `Ok(None)`: nothing to hand out this time (a control frame, a timer, or the
    /// connection ended and the caller should reconnect).
    pub(crate) async fn read(&mut self, outbox: &mut Outbox) -> Result<Option<Value>, ClientError> {
        self.send_due(outbox).await;
        let idle_deadline = self.last_inbound + self.idle_timeout;
        let wake = outbox
            .next_due()
            .map_or(idle_deadline, |due| due.min(idle_deadline));
        let Some(socket) = self.socket.as_mut() else {
            return Ok(None);
        };
        let received = match tokio::time::timeout_at(wake, receive(socket)).await {
            Ok(received) => received,
            Err(_) => {
                if Instant::now() >= idle_deadline {
                    let silence = self.idle_timeout;
                    self.drop_socket(None, format!("nothing received for {silence:?}"));
                }
                return Ok(None);
            }
        };
        match received {
            Received::Frame(frame) => {
                self.last_inbound = Instant::now();
                self.note_drain_hint(&frame);
                Ok(Some(frame))
            }
            Received::Activity => {
                self.last_inbound = Instant::now();
                Ok(None)
            }
            Received::End(Failure::Retry { after, why }) => {
                self.drop_socket(after, why);
                Ok(None)
            }
            Received::End(Failure::Final(error)) => {
                self.socket = None;
                self.last_failure = error.to_string();
                Err(error)
            }
        }
    }

    /// Closes the socket politely (close 1000), within the write timeout.
    pub(crate) async fn close(&mut self) {
        let Some(mut socket) = self.socket.take() else {
            return;
        };
        let _ = tokio::time::timeout(self.options.write_timeout, socket.close(None)).await;
    }

    fn drop_socket(&mut self, retry_after: Option<Duration>, why: String) {
        self.socket = None;
        if retry_after.is_some() {
            self.retry_hint = retry_after;
        }
        self.last_failure = why;
    }

    /// A draining node says `error unavailable` with `retryAfterMs` before it closes 1012.
    fn note_drain_hint(&mut self, frame: &Value) {
        let data = &frame["data"];
        if frame["type"] != "error" || data["code"] != "unavailable" {
            return;
        }
        if let Some(after) = data["retryAfterMs"].as_u64() {
            self.retry_hint = Some(Duration::from_millis(after));
        }
    }
}

/// Initial read buffer of a client socket; reads grow it when a message is larger.
const READ_BUFFER_BYTES: usize = 8 * 1024;

/// The socket settings of every client connection. tungstenite zeroes its whole read buffer
/// before each read, so its 128 KiB default cost a 128 KiB `memset` per read: about a fifth of
/// a benchmark client's CPU. The gateway keeps its own buffers small for the same reason.
pub fn socket_config() -> WebSocketConfig {
    WebSocketConfig::default().read_buffer_size(READ_BUFFER_BYTES)
}

async fn handshake(url: &str, hello: &Value) -> Result<(Socket, Opened), Failure> {
    // TCP_NODELAY: frames are small and each waits for an answer.
    let (mut socket, _) =
        tokio_tungstenite::connect_async_with_config(url, Some(socket_config()), true)
            .await
            .map_err(upgrade_failure)?;
    socket
        .send(Message::Text(hello.to_string().into()))
        .await
        .map_err(|error| Failure::Retry {
            after: None,
            why: format!("hello not sent: {error}"),
        })?;
    let mut early = Vec::new();
    loop {
        match receive(&mut socket).await {
            Received::Frame(frame) => match frame["type"].as_str() {
                Some("welcome") => {
                    let opened = Opened {
                        welcome: frame,
                        early,
                    };
                    return Ok((socket, opened));
                }
                Some("error") => return Err(handshake_refusal(&frame["data"])),
                _ => early.push(frame),
            },
            Received::Activity => continue,
            Received::End(failure) => return Err(failure),
        }
    }
}

/// An error before `welcome`: retryable ones (`internal`, `unavailable`) are worth another
/// connection, the others (`unauthorized`, `channel_inactive`, …) are final.
fn handshake_refusal(data: &Value) -> Failure {
    if data["retryable"] == true {
        return Failure::Retry {
            after: data["retryAfterMs"].as_u64().map(Duration::from_millis),
            why: format!(
                "refused at hello: {}",
                data["code"].as_str().unwrap_or("unknown")
            ),
        };
    }
    Failure::Final(ClientError::refused(data))
}

fn upgrade_failure(error: tungstenite::Error) -> Failure {
    match error {
        tungstenite::Error::Http(response) => {
            let status = response.status().as_u16();
            let retry_after = response
                .headers()
                .get("retry-after")
                .and_then(|value| value.to_str().ok());
            match http_action(status, retry_after) {
                CloseAction::Reconnect { after } => Failure::Retry {
                    after,
                    why: format!("upgrade answered http {status}"),
                },
                CloseAction::Stop => Failure::Final(ClientError::Connection(format!(
                    "upgrade refused with http {status}"
                ))),
            }
        }
        tungstenite::Error::Url(error) => {
            Failure::Final(ClientError::Connection(format!("bad url: {error}")))
        }
        other => Failure::Retry {
            after: None,
            why: format!("connect failed: {other}"),
        },
    }
}

async fn receive(socket: &mut Socket) -> Received {
    match socket.next().await {
        Some(Ok(Message::Text(text))) => match serde_json::from_str::<Value>(text.as_str()) {
            Ok(frame) if frame.is_object() => Received::Frame(frame),
            // Receivers ignore what they do not understand.
            _ => Received::Activity,
        },
        Some(Ok(Message::Close(frame))) => Received::End(closed(frame)),
        Some(Ok(_)) => Received::Activity,
        Some(Err(error)) => Received::End(Failure::Retry {
            after: None,
            why: format!("socket failed: {error}"),
        }),
        None => Received::End(Failure::Retry {
            after: None,
            why: "socket ended".into(),
        }),
    }
}

fn closed(frame: Option<CloseFrame>) -> Failure {
    let Some(frame) = frame else {
        return Failure::Retry {
            after: None,
            why: "closed without a code".into(),
        };
    };
    let code = u16::from(frame.code);
    let reason = frame.reason.as_str().to_owned();
    match close_action(code, &reason) {
        CloseAction::Reconnect { after } => Failure::Retry {
            after,
            why: format!("closed with {code} {reason}"),
        },
        CloseAction::Stop => Failure::Final(ClientError::Closed { code, reason }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn final_close_codes_stop_and_the_others_reconnect() {
        for code in [4400, 4401, 4403, 1009, 1002, 1008] {
            assert_eq!(close_action(code, ""), CloseAction::Stop, "{code}");
        }
        for code in [1000, 1001, 1006, 1011, 1012, 4408, 4503] {
            assert!(
                matches!(close_action(code, ""), CloseAction::Reconnect { .. }),
                "{code}"
            );
        }
    }

    #[test]
    fn the_json_close_reason_gives_the_delay() {
        let draining = r#"{"reason":"unavailable","retryAfterMs":1500}"#;
        assert_eq!(
            close_action(1012, draining),
            CloseAction::Reconnect {
                after: Some(Duration::from_millis(1500))
            }
        );
        let slow = r#"{"reason":"slow_consumer","retryAfterMs":1000}"#;
        assert_eq!(
            close_action(4503, slow),
            CloseAction::Reconnect {
                after: Some(Duration::from_secs(1))
            }
        );
        assert_eq!(
            close_action(4408, "idle"),
            CloseAction::Reconnect { after: None }
        );
        assert_eq!(retry_after_in_reason(r#"{"retryAfterMs":-1}"#), None);
        assert_eq!(retry_after_in_reason("token_expired"), None);
    }

    #[test]
    fn upgrade_refusals_retry_only_for_server_side_trouble() {
        assert_eq!(
            http_action(503, Some("2")),
            CloseAction::Reconnect {
                after: Some(Duration::from_secs(2))
            }
        );
        assert_eq!(
            http_action(502, None),
            CloseAction::Reconnect { after: None }
        );
        assert_eq!(
            http_action(503, Some("Wed, 21 Oct 2015 07:28:00 GMT")),
            CloseAction::Reconnect { after: None }
        );
        assert!(matches!(
            http_action(429, None),
            CloseAction::Reconnect { .. }
        ));
        for status in [400, 401, 404, 426] {
            assert_eq!(http_action(status, Some("3")), CloseAction::Stop);
        }
    }

    #[test]
    fn handshake_errors_are_final_unless_retryable() {
        let unauthorized = serde_json::json!({"code": "unauthorized", "message": "bad token",
            "retryable": false});
        assert!(matches!(
            handshake_refusal(&unauthorized),
            Failure::Final(ClientError::Refused { code, .. }) if code == "unauthorized"
        ));
        let internal = serde_json::json!({"code": "internal", "retryable": true,
            "retryAfterMs": 250});
        assert!(matches!(
            handshake_refusal(&internal),
            Failure::Retry { after: Some(after), .. } if after == Duration::from_millis(250)
        ));
    }
}
