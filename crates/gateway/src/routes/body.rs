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
