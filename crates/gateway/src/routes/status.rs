//! `GET /`: the operator's status page. Server-rendered HTML without scripts or a build step:
//! nodes, channels with their groups and members, this node's connections and rates. It
//! refreshes itself every few seconds.
//!
//! A browser cannot send a bearer header on a plain navigation, so the login form posts the admin
//! token to `POST /`, which sets an HttpOnly, same-site cookie and redirects to `/`; the page then
//! reads the cookie. A bearer header works too (curl). Failed attempts count against the client
//! address's admin throttle; every page forbids scripts, framing and referrers.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use std::net::SocketAddr;

use axum::Form;
use axum::extract::rejection::FormRejection;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use converger_cluster::{ClusterStatus, MemberStatus};
use serde::Deserialize;
use uuid::Uuid;

use crate::auth::{bearer, check_admin};
use crate::state::AppState;
use crate::status_rates::Counters;

/// Seconds between automatic refreshes of the page.
const REFRESH_SECS: u64 = 5;
/// Name of the cookie that carries the admin token.
const COOKIE: &str = "converger_admin";

/// The login form's body.
#[derive(Deserialize)]
pub(crate) struct LoginForm {
    token: String,
}

/// Headers every status page response carries: no script, no framing, no referrer, no cache.
fn page_headers() -> [(header::HeaderName, &'static str); 6] {
    [
        (header::CONTENT_TYPE, "text/html; charset=utf-8"),
        (header::CACHE_CONTROL, "no-store"),
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    ]
}

/// `GET /`: the page, for the admin token as a bearer header or the cookie; else the login form.
pub(crate) async fn page(
    State(state): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> Response {
    let given = bearer(&headers).or_else(|| cookie_value(&headers, COOKIE));
    if given.is_none() {
        return login(
            StatusCode::UNAUTHORIZED,
            "The status page needs the admin token.",
        );
    }
    match check_admin(&state, peer.ip(), given) {
        Ok(()) => {}
        Err(error) if error.status == StatusCode::TOO_MANY_REQUESTS => {
            return throttled(error);
        }
        Err(_) => {
            return login(
                StatusCode::UNAUTHORIZED,
                "The status page needs the admin token.",
            );
        }
    }
    let html = render(&state).await;
    (page_headers(), html).into_response()
}

/// `POST /` (the login form): the token becomes an HttpOnly, same-site cookie (`Secure` over
/// TLS), then a redirect to the page. The token never travels in a URL.
pub(crate) async fn log_in(
    State(state): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    form: Result<Form<LoginForm>, FormRejection>,
) -> Response {
    let Ok(Form(form)) = form else {
        return login(StatusCode::BAD_REQUEST, "Send the admin token in the form.");
    };
    match check_admin(&state, peer.ip(), Some(&form.token)) {
        Ok(()) => {}
        Err(error) if error.status == StatusCode::TOO_MANY_REQUESTS => {
            return throttled(error);
        }
        Err(_) => return login(StatusCode::UNAUTHORIZED, "That is not the admin token."),
    }
    let over_tls = headers
        .get("x-forwarded-proto")
        .and_then(|value| value.to_str().ok())
        .is_some_and(|proto| proto.eq_ignore_ascii_case("https"));
    let secure = if state.config.status.secure_cookie || over_tls {
        "; Secure"
    } else {
        ""
    };
    let cookie = format!(
        "{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/{secure}",
        form.token
    );
    (
        StatusCode::SEE_OTHER,
        [
            (header::LOCATION, "/".to_owned()),
            (header::SET_COOKIE, cookie),
            (header::CACHE_CONTROL, "no-store".to_owned()),
        ],
    )
        .into_response()
}

/// The 429 of a throttled address, as a page.
fn throttled(error: crate::error::ApiError) -> Response {
    let mut response = login(
        StatusCode::TOO_MANY_REQUESTS,
        "Too many failed attempts from this address; try again later.",
    );
    if let Some(seconds) = error.retry_after_secs {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, seconds.into());
    }
    response
}

fn cookie_value<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

fn login(status: StatusCode, message: &str) -> Response {
    let body = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>converger</title>{STYLE}</head>\
         <body><h1>converger</h1><p>{}</p><form method=\"post\" action=\"/\">\
         <label>Admin token <input type=\"password\" name=\"token\" autocomplete=\"off\"></label> \
         <button type=\"submit\">Open</button></form></body></html>",
        escape(message)
    );
    (status, page_headers(), body).into_response()
}

async fn render(state: &AppState) -> String {
    let cluster = state.cluster.status().await.ok();
    let counters = read_counters(&state.metrics.render());
    let rates = state.status_rates.rates(counters);
    let cluster_rate = state.store.committed_per_second(60).await.ok();
    let unanswered = state.store.unanswered_turns().await.ok();
    let mut html = String::with_capacity(8 * 1024);
    let _ = write!(
        html,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"refresh\" content=\"{REFRESH_SECS}\"><title>converger · {node}</title>{STYLE}</head><body>\
         <h1>converger <small>node {node}{draining}</small></h1>",
        node = escape(state.hub.node_id()),
        draining = if state.is_draining() {
            " · draining"
        } else {
            ""
        },
    );
    html.push_str("<section><h2>This node</h2><table><tbody>");
    let _ = write!(
        html,
        "<tr><th>Open WebSocket sessions</th><td id=\"sessions\">{}</td></tr>\
         <tr><th>Open connections</th><td id=\"connections\">{}</td></tr>",
        state.hub.session_count(),
        state.connections_held()
    );
    let rate = |value: Option<f64>| value.map_or("–".to_owned(), |value| format!("{value:.1}/s"));
    let _ = write!(
        html,
        "<tr><th>Frames committed here</th><td>{}</td></tr>\
         <tr><th>Turn results here</th><td>{}</td></tr>\
         <tr><th>Turns delivered to agents here</th><td>{}</td></tr>\
         <tr><th>Frames committed, whole cluster (last minute)</th><td>{}</td></tr>\
         <tr><th>Unanswered turns (last hour)</th><td id=\"unanswered\">{}</td></tr>",
        rate(rates.map(|rates| rates.frames_committed)),
        rate(rates.map(|rates| rates.turn_results)),
        rate(rates.map(|rates| rates.deliveries)),
        rate(cluster_rate),
        unanswered.map_or("–".to_owned(), |count| count.to_string()),
    );
    html.push_str("</tbody></table></section>");
    match cluster {
        Some(cluster) => {
            render_nodes(&mut html, &cluster);
            render_channels(&mut html, state, &cluster).await;
        }
        None => html.push_str("<p>Cluster membership is not available.</p>"),
    }
    render_http_agents(&mut html, state).await;
    let _ = write!(
        html,
        "<footer>Refreshes every {REFRESH_SECS} s · {}</footer></body></html>",
        chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC")
    );
    html
}

fn render_nodes(html: &mut String, cluster: &ClusterStatus) {
    html.push_str(
        "<section><h2>Nodes</h2><table id=\"nodes\"><thead><tr><th>Node</th><th>Status</th>\
         <th>HTTP</th><th>Gossip</th><th>Last heartbeat</th></tr></thead><tbody>",
    );
    for node in &cluster.nodes {
        let age = node
            .last_heartbeat_age_ms
            .map_or("–".to_owned(), |age| format!("{age} ms ago"));
        let _ = write!(
            html,
            "<tr class=\"{status}\"><td>{id}</td><td>{status}</td><td>{http}</td><td>{gossip}</td><td>{age}</td></tr>",
            status = node.status,
            id = escape(&node.id),
            http = escape(node.http_addr.as_deref().unwrap_or("–")),
            gossip = escape(&node.gossip_addr),
        );
    }
    html.push_str("</tbody></table></section>");
}

async fn render_channels(html: &mut String, state: &AppState, cluster: &ClusterStatus) {
    // channel → group ("" for observers) → members
    let mut channels: BTreeMap<Uuid, BTreeMap<String, Vec<&MemberStatus>>> = BTreeMap::new();
    for member in &cluster.members {
        channels
            .entry(member.channel_id)
            .or_default()
            .entry(member.group.clone().unwrap_or_default())
            .or_default()
            .push(member);
    }
    html.push_str("<section><h2>Channels with agents</h2>");
    if channels.is_empty() {
        html.push_str("<p id=\"no-agents\">No agent is connected anywhere in the cluster.</p>");
    }
    for (channel_id, groups) in channels {
        let name = match state.store.channel(channel_id).await {
            Ok(Some(channel)) => channel.name,
            _ => channel_id.to_string(),
        };
        let _ = write!(
            html,
            "<h3>{} <small>{channel_id}</small></h3><table class=\"channel\"><thead><tr><th>Group</th>\
             <th>Connection</th><th>Node</th><th>Eligible since</th></tr></thead><tbody>",
            escape(&name)
        );
        for (group, members) in groups {
            let group = if group.is_empty() {
                "(observers)".to_owned()
            } else {
                group
            };
            for member in members {
                let since = chrono::DateTime::from_timestamp_millis(member.since)
                    .map_or("–".to_owned(), |at| at.format("%H:%M:%S%.3f").to_string());
                let _ = write!(
                    html,
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td>{since}</td></tr>",
                    escape(&group),
                    escape(&member.connection_id),
                    escape(&member.node),
                );
            }
        }
        html.push_str("</tbody></table>");
    }
    html.push_str("</section>");
}

/// A row per HTTP agent group (ADR 0031), with the circuit breaker of its URL on this node.
async fn render_http_agents(html: &mut String, state: &AppState) {
    let Ok(agents) = state.store.http_agents(None).await else {
        return;
    };
    if agents.is_empty() {
        return;
    }
    let breakers: BTreeMap<String, &'static str> = state
        .http_agents
        .breakers()
        .into_iter()
        .map(|(url, breaker)| (url, breaker.as_str()))
        .collect();
    html.push_str(
        "<section><h2>HTTP agent groups</h2><table id=\"http-agents\"><thead><tr><th>Channel</th>\
         <th>Group</th><th>URL</th><th>Timeout</th><th>Concurrency</th><th>Breaker here</th>\
         </tr></thead><tbody>",
    );
    for agent in &agents {
        let _ = write!(
            html,
            "<tr><td>{channel}</td><td>{group}</td><td>{url}</td><td>{timeout} ms</td><td>{concurrency}</td><td>{breaker}</td></tr>",
            channel = agent.channel_id,
            group = escape(&agent.group_name),
            url = escape(&crate::http_agents::url_label(&agent.url)),
            timeout = agent.timeout_ms,
            concurrency = agent.max_concurrency,
            breaker = breakers
                .get(&crate::http_agents::url_label(&agent.url))
                .copied()
                .unwrap_or("closed"),
        );
    }
    html.push_str("</tbody></table></section>");
}

/// Sums the samples of a Prometheus counter in `text` (every label set).
fn counter_total(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter_map(|line| line.rsplit_once(' '))
        .filter_map(|(_, value)| value.trim().parse::<f64>().ok())
        .sum()
}

fn read_counters(text: &str) -> Counters {
    Counters {
        frames_committed: counter_total(text, "converger_frames_committed_total"),
        turn_results: counter_total(text, "converger_turn_results_total"),
        deliveries: counter_total(text, "converger_deliveries_total"),
    }
}

/// Escapes text for HTML element content and attribute values.
fn escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for character in text.chars() {
        match character {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&#39;"),
            other => escaped.push(other),
        }
    }
    escaped
}

const STYLE: &str = "<style>\
body{font:14px/1.4 system-ui,sans-serif;margin:2rem;color:#1d2330;background:#fafbfc}\
h1 small,h3 small{color:#6b7280;font-weight:normal;font-size:.7em}\
section{margin-bottom:1.5rem}table{border-collapse:collapse;min-width:40rem;background:#fff}\
th,td{border:1px solid #d8dde6;padding:.3rem .6rem;text-align:left}\
thead th{background:#eef1f6}tr.dead td{color:#b42318}tr.self td{font-weight:600}\
footer{color:#6b7280;margin-top:2rem}</style>";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sum_every_label_set_and_skip_other_names() {
        let text = "# TYPE converger_deliveries_total counter\n\
                    converger_deliveries_total{kind=\"first\"} 7\n\
                    converger_deliveries_total{kind=\"takeover\"} 2\n\
                    converger_deliveries_total_other 100\n\
                    converger_frames_committed_total 3\n";
        assert_eq!(counter_total(text, "converger_deliveries_total"), 9.0);
        assert_eq!(counter_total(text, "converger_frames_committed_total"), 3.0);
        assert_eq!(counter_total(text, "converger_turn_results_total"), 0.0);
    }

    #[test]
    fn html_is_escaped() {
        assert_eq!(
            escape("<b a=\"1\">&'</b>"),
            "&lt;b a=&quot;1&quot;&gt;&amp;&#39;&lt;/b&gt;"
        );
    }

    #[test]
    fn the_admin_cookie_is_found_among_others() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            "theme=dark; converger_admin=secret-token".parse().unwrap(),
        );
        assert_eq!(cookie_value(&headers, COOKIE), Some("secret-token"));
        assert_eq!(cookie_value(&headers, "missing"), None);
    }
}
