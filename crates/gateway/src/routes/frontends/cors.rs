//! CORS for the frontends' routes: a browser page on another origin may call them only when the
//! operator listed that origin (`frontends.allow_origins`). A request from any other origin is
//! refused with 403 before anything runs (a browser would hide the answer anyway; refusing
//! keeps a page from making the node do work it cannot read). Requests without `Origin`
//! (servers, Node) and same-origin requests pass. Credentials (cookies) are never allowed:
//! tokens travel in `Authorization`, so no wildcard is ever paired with credentials.

use axum::extract::{Request, State};
use axum::http::header::{
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN,
    ACCESS_CONTROL_EXPOSE_HEADERS, ACCESS_CONTROL_MAX_AGE, ACCESS_CONTROL_REQUEST_METHOD, HOST,
    ORIGIN, VARY,
};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use converger_protocol::ErrorCode;

use crate::error::ApiError;
use crate::state::AppState;

/// How long a browser may cache a preflight's answer, in seconds.
const PREFLIGHT_MAX_AGE: &str = "600";
/// What the routes read from a request.
const ALLOWED_HEADERS: &str = "authorization, content-type, accept, last-event-id";
/// The headers a page may read from an answer.
const EXPOSED_HEADERS: &str = "x-vercel-ai-ui-message-stream";

/// The CORS middleware of the frontends' routes.
pub(super) async fn allow(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(origin) = request.headers().get(ORIGIN).cloned() else {
        return vary_on_origin(next.run(request).await);
    };
    // HTTP/2 carries the host in the URI's authority, not a Host header.
    let host = request.headers().get(HOST).cloned().or_else(|| {
        request
            .uri()
            .authority()
            .and_then(|authority| HeaderValue::from_str(authority.as_str()).ok())
    });
    let same_origin = same_origin(&origin, host.as_ref());
    let listed = origin.to_str().is_ok_and(|origin| {
        state
            .config
            .frontends
            .allow_origins
            .iter()
            .any(|allowed| allowed == origin)
    });
    if !same_origin && !listed {
        return vary_on_origin(
            ApiError::new(
                StatusCode::FORBIDDEN,
                ErrorCode::Forbidden,
                "this origin is not allowed (frontends.allow_origins)",
            )
            .into_response(),
        );
    }
    let preflight = request.method() == Method::OPTIONS
        && request
            .headers()
            .contains_key(ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = if preflight {
        let mut response = StatusCode::NO_CONTENT.into_response();
        let headers = response.headers_mut();
        headers.insert(
            ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        headers.insert(
            ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static(ALLOWED_HEADERS),
        );
        headers.insert(
            ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static(PREFLIGHT_MAX_AGE),
        );
        response
    } else {
        next.run(request).await
    };
    let headers = response.headers_mut();
    headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    headers.insert(
        ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static(EXPOSED_HEADERS),
    );
    vary_on_origin(response)
}

/// Every answer depends on `Origin` (a cache must not serve one origin's to another).
fn vary_on_origin(mut response: Response) -> Response {
    response
        .headers_mut()
        .append(VARY, HeaderValue::from_static("origin"));
    response
}

/// True when `origin` (`scheme://host[:port]`) names the host the request was sent to.
fn same_origin(origin: &HeaderValue, host: Option<&HeaderValue>) -> bool {
    let (Ok(origin), Some(Ok(host))) = (origin.to_str(), host.map(HeaderValue::to_str)) else {
        return false;
    };
    origin
        .split_once("://")
        .is_some_and(|(_, authority)| authority.eq_ignore_ascii_case(host))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_origin_is_the_same_only_for_the_same_host_and_port() {
        let host = HeaderValue::from_static("127.0.0.1:8080");
        let same = HeaderValue::from_static("http://127.0.0.1:8080");
        let other_port = HeaderValue::from_static("http://127.0.0.1:9000");
        let opaque = HeaderValue::from_static("null");
        assert!(same_origin(&same, Some(&host)));
        assert!(!same_origin(&other_port, Some(&host)));
        assert!(!same_origin(&opaque, Some(&host)));
        assert!(!same_origin(&same, None));
    }
}
