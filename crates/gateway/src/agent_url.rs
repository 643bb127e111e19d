//! An HTTP agent's URL as the allowlist, metrics and logs see it (ADR 0031): its parts, and the
//! label that names it without its query or user info. Below both the configuration, which
//! checks the allowlist's entries, and the HTTP agents, which call the URLs.

use converger_core::http_agents::UrlParts;

/// The parts of an `http` or `https` URL with a host and no user info; `None` otherwise.
pub(crate) fn url_parts(url: &str) -> Option<UrlParts> {
    let url = reqwest::Url::parse(url).ok()?;
    // Encoded dots and slashes: a server that decodes them could route a path under an allowed
    // prefix somewhere else (`/agents/..%2fadmin`).
    let path = url.path().to_ascii_lowercase();
    let encoded_separator = ["%2e", "%2f", "%5c"]
        .iter()
        .any(|encoded| path.contains(encoded));
    if !matches!(url.scheme(), "http" | "https")
        || !url.username().is_empty()
        || url.password().is_some()
        || encoded_separator
    {
        return None;
    }
    Some(UrlParts {
        scheme: url.scheme().to_owned(),
        host: url.host_str()?.to_ascii_lowercase(),
        port: url.port_or_known_default()?,
        path: url.path().to_owned(),
    })
}

/// `url` without its query or user info (`scheme://host:port/path`), as metrics and logs name
/// it: a query may carry a credential.
pub(crate) fn url_label(url: &str) -> String {
    url_parts(url).map_or_else(
        || "(invalid url)".to_owned(),
        |parts| {
            format!(
                "{}://{}:{}{}",
                parts.scheme, parts.host, parts.port, parts.path
            )
        },
    )
}
