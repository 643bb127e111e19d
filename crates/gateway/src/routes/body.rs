//! JSON request bodies parsed with the documented error codes instead of axum's defaults.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use converger_protocol::ErrorCode;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ApiError;

/// Parses a JSON body; an empty body counts as `{}` when `empty_is_object`. Nothing in it may
/// hold a NUL character (storage cannot keep one).
pub(crate) fn parse_json<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    empty_is_object: bool,
) -> Result<T, ApiError> {
    let value: Value = parse_value(body, empty_is_object)?;
    if converger_protocol::contains_nul(&value) {
        return Err(ApiError::bad_request(converger_protocol::NUL_REFUSED));
    }
    serde_json::from_value(value)
        .map_err(|error| ApiError::bad_request(format!("invalid JSON body: {error}")))
}

/// Parses a JSON body as a value, leaving its checks to the caller (a frame is validated by
/// `validate_message_frame`, which answers `invalid_message`).
pub(crate) fn parse_value(
    body: Result<Bytes, BytesRejection>,
    empty_is_object: bool,
) -> Result<Value, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorCode::PayloadTooLarge,
                "request body too large",
            )
        } else {
            ApiError::bad_request(format!("unreadable body: {rejection}"))
        }
    })?;
    let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) && empty_is_object {
        b"{}"
    } else {
        &bytes
    };
    serde_json::from_slice(bytes)
        .map_err(|error| ApiError::bad_request(format!("invalid JSON body: {error}")))
}

/// A request refused before its body was read (an extractor's 401, 403 or 429) leaves the body
/// unread, and the server then closes the HTTP/1.1 connection after the answer. Saying
/// `Connection: close` on such answers keeps a client from sending its next request on a
/// connection that is about to go (httpx and others otherwise see "disconnected without a
/// response"). Any client error to a request with a body gets it: a new connection is cheap.
pub(crate) async fn close_after_refused_body(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::http::{HeaderValue, Version, header};
    let has_body = request.headers().contains_key(header::TRANSFER_ENCODING)
        || request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|length| length.to_str().ok())
            .and_then(|length| length.parse::<u64>().ok())
            .is_some_and(|length| length > 0);
    let http1 = request.version() <= Version::HTTP_11;
    let mut response = next.run(request).await;
    if has_body && http1 && response.status().is_client_error() {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}
