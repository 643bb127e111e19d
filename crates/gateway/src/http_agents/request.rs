//! One HTTP call to an agent: the signed POST of a `RunAgentInput`, and its response read as
//! AG-UI events (`text/event-stream`) or as one JSON answer, under the response size cap.

use std::time::Duration;

use converger_protocol::ag_ui::Event;
use eventsource_stream::Eventsource;
use futures_util::{Stream, StreamExt};
use hmac::{Hmac, Mac};
use reqwest::header::{ACCEPT, CONTENT_TYPE, HeaderValue};
use sha2::Sha256;

use super::fold::JsonAnswer;

/// The header that carries a call's signature.
pub(crate) const SIGNATURE_HEADER: &str = "x-converger-signature";

/// Why a call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum CallError {
    /// No connection, or the request could not be sent.
    #[error("connect: {0}")]
    Connect(String),
    /// The agent answered with a status other than 2xx.
    #[error("status {0}")]
    Status(u16),
    /// The call ran past the group's `timeoutMs`.
    #[error("timed out")]
    Timeout,
    /// The response ended before `RUN_FINISHED`, or broke off.
    #[error("the response ended before RUN_FINISHED")]
    Cut,
    /// The response grew past `http_agents.max_response_bytes`.
    #[error("the response is larger than {0} bytes")]
    TooLarge(usize),
    /// The response is not AG-UI: an unparsable event, a contradiction, an unknown content
    /// type, an answer that cannot be stored.
    #[error("invalid response: {0}")]
    Invalid(String),
    /// `RUN_ERROR`.
    #[error("{0}")]
    RunError(String),
    /// The URL's circuit breaker is open: no call was made.
    #[error("circuit open")]
    CircuitOpen,
    /// The URL is no longer under `http_agents.allow`.
    #[error("the url is not allowed")]
    NotAllowed,
    /// The database did not answer (reading the turn's history, committing the answer).
    #[error("database: {0}")]
    Store(String),
}

impl CallError {
    /// True when another call of the same turn may fare better (a 4xx other than 408 and 429
    /// says the request itself is wrong; a URL that is not allowed stays so).
    pub(crate) fn is_retryable(&self) -> bool {
        match self {
            CallError::Status(status) => *status >= 500 || *status == 408 || *status == 429,
            // The same agent answers the same turn alike: too large again.
            CallError::NotAllowed | CallError::TooLarge(_) => false,
            _ => true,
        }
    }

    /// True when the failure says the agent is down or broken, which the breaker counts; a 4xx
    /// or an answer converger refused came from an agent that is up.
    pub(crate) fn counts_against_url(&self) -> bool {
        match self {
            CallError::Status(status) => *status >= 500 || *status == 408 || *status == 429,
            CallError::Connect(_) | CallError::Timeout | CallError::Cut => true,
            CallError::TooLarge(_)
            | CallError::Invalid(_)
            | CallError::RunError(_)
            | CallError::CircuitOpen
            | CallError::NotAllowed
            | CallError::Store(_) => false,
        }
    }

    /// The `outcome` label of the calls metric.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            CallError::Connect(_) => "connect",
            CallError::Status(status) if *status >= 500 => "status_5xx",
            CallError::Status(_) => "status_other",
            CallError::Timeout => "timeout",
            CallError::Cut => "cut",
            CallError::TooLarge(_) => "too_large",
            CallError::Invalid(_) => "invalid",
            CallError::RunError(_) => "run_error",
            CallError::CircuitOpen => "circuit_open",
            CallError::NotAllowed => "not_allowed",
            CallError::Store(_) => "database",
        }
    }
}

fn from_reqwest(error: &reqwest::Error) -> CallError {
    if error.is_timeout() {
        CallError::Timeout
    } else if error.is_connect() || error.is_request() || error.is_builder() {
        CallError::Connect(error.without_url_message())
    } else {
        CallError::Cut
    }
}

trait WithoutUrl {
    fn without_url_message(&self) -> String;
}

impl WithoutUrl for reqwest::Error {
    /// The error's text without its URL: the dead letter names the URL once, and the text does
    /// not end up twice in logs.
    fn without_url_message(&self) -> String {
        let mut message = self.to_string();
        if let Some(url) = self.url() {
            message = message.replace(&format!(" ({url})"), "");
        }
        message
    }
}

/// `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>`.
pub(crate) fn signature(secret: &str, unix_seconds: i64, body: &[u8]) -> String {
    // HMAC takes a key of any length; `new_from_slice` cannot fail for it.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes())
        .expect("HMAC-SHA256 accepts keys of any length");
    mac.update(unix_seconds.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let digest = hex::encode(mac.finalize().into_bytes());
    format!("t={unix_seconds},v1={digest}")
}

/// What an agent answered with.
pub(crate) enum Answer {
    /// AG-UI events, as they arrive.
    Events(std::pin::Pin<Box<dyn Stream<Item = Result<Event, CallError>> + Send>>),
    /// One JSON answer.
    Json(JsonAnswer),
}

/// One call's request.
pub(crate) struct CallRequest<'a> {
    /// The client (connect timeout, no redirects).
    pub client: &'a reqwest::Client,
    /// The agent's URL.
    pub url: &'a str,
    /// The serialized `RunAgentInput`.
    pub body: Vec<u8>,
    /// The turn key (`Idempotency-Key`).
    pub key: &'a str,
    /// The group's signing key.
    pub secret: Option<&'a str>,
    /// The response size cap.
    pub max_response_bytes: usize,
}

impl CallRequest<'_> {
    /// Posts the input and returns the response's reading; the caller bounds the whole call
    /// with the group's `timeoutMs`.
    pub(crate) async fn send(self) -> Result<Answer, CallError> {
        let mut request = self
            .client
            .post(self.url)
            .header(CONTENT_TYPE, "application/json")
            .header(ACCEPT, "text/event-stream, application/json;q=0.9")
            .header("idempotency-key", self.key);
        if let Some(secret) = self.secret {
            let now = chrono::Utc::now().timestamp();
            request = request.header(SIGNATURE_HEADER, signature(secret, now, &self.body));
        }
        let response = request
            .body(self.body)
            .send()
            .await
            .map_err(|error| from_reqwest(&error))?;
        let status = response.status();
        if !status.is_success() {
            return Err(CallError::Status(status.as_u16()));
        }
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|value: &HeaderValue| value.to_str().ok())
            .unwrap_or_default()
            .to_ascii_lowercase();
        let cap = self.max_response_bytes;
        let mut read = 0usize;
        let bytes = response.bytes_stream().map(move |chunk| {
            let chunk = chunk.map_err(|error| from_reqwest(&error))?;
            read = read.saturating_add(chunk.len());
            if read > cap {
                return Err(CallError::TooLarge(cap));
            }
            Ok(chunk)
        });
        if content_type.starts_with("application/json") {
            let body = collect(bytes).await?;
            let answer = serde_json::from_slice(&body)
                .map_err(|error| CallError::Invalid(format!("JSON answer: {error}")))?;
            return Ok(Answer::Json(answer));
        }
        if !content_type.starts_with("text/event-stream") {
            return Err(CallError::Invalid(format!(
                "content type {content_type:?} is neither text/event-stream nor application/json"
            )));
        }
        let events = bytes.eventsource().map(|event| match event {
            Ok(event) => serde_json::from_str::<Event>(&event.data)
                .map_err(|error| CallError::Invalid(format!("event: {error}"))),
            Err(eventsource_stream::EventStreamError::Transport(error)) => Err(error),
            Err(error) => Err(CallError::Invalid(format!("event stream: {error}"))),
        });
        Ok(Answer::Events(Box::pin(events)))
    }
}

async fn collect(
    mut bytes: impl Stream<Item = Result<axum::body::Bytes, CallError>> + Unpin,
) -> Result<Vec<u8>, CallError> {
    let mut body = Vec::new();
    while let Some(chunk) = bytes.next().await {
        body.extend_from_slice(&chunk?);
    }
    Ok(body)
}

/// The client every call of a node uses: the operator's connect timeout, no redirects (a
/// redirect could lead a call to an address the allowlist does not name), and no proxy from
/// the environment (a call goes to the address the allowlist names, and the node's
/// configuration is its files and `CONVERGER_*` variables only).
pub(crate) fn client(connect_timeout: Duration) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .connect_timeout(connect_timeout)
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .user_agent(concat!("converger/", env!("CARGO_PKG_VERSION")))
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_hmac_sha256_of_the_timestamp_and_body() {
        // The digest from an independent implementation: Python's
        // hmac.new(b"s3cret", b"1700000000.{}", hashlib.sha256).hexdigest().
        assert_eq!(
            signature("s3cret", 1_700_000_000, b"{}"),
            "t=1700000000,v1=97926816e98fbb41ccb1673225ff29a2f35369099990e1b1561651e7bd097ebf"
        );
    }

    #[test]
    fn only_failures_of_a_broken_agent_are_retried_and_counted() {
        assert!(CallError::Status(503).is_retryable());
        assert!(CallError::Status(429).is_retryable());
        assert!(!CallError::Status(401).is_retryable());
        assert!(!CallError::Status(401).counts_against_url());
        assert!(CallError::Timeout.counts_against_url());
        assert!(!CallError::Invalid("x".into()).counts_against_url());
        assert!(CallError::Invalid("x".into()).is_retryable());
    }
}
