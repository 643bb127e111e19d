//! Which database host the node talks to. The URL may name several hosts, as libpq, JDBC and
//! most Postgres drivers allow (`postgres://user@h1:5432,h2:5433/db?target_session_attrs=
//! read-write`); the node connects only to the one that accepts writes (ADR 0022). This module
//! is pure: it splits such a URL into one single-host URL per host and decides, from what each
//! host answered, which one to use.

use crate::StoreError;

/// The URL parameter libpq reads to choose among several hosts.
const SESSION_ATTRS_PARAMETER: &str = "target_session_attrs";

/// A database URL split per host, in the order the URL names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostList {
    /// One URL per host: the same user, database and parameters, one host each.
    pub urls: Vec<String>,
    /// `host:port` of each entry, for logs (no credentials).
    pub names: Vec<String>,
}

/// What probing one host found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostProbe {
    /// The host answered and accepts writes (a primary).
    Writable,
    /// The host answered but is read-only (a standby, or a primary set read-only).
    ReadOnly,
    /// The host did not answer in time, refused the connection, or failed the check.
    Unreachable,
}

/// Splits `url` into one URL per host. A URL with one host comes back unchanged, but for
/// `target_session_attrs`.
///
/// `target_session_attrs` may be `any`, `read-write` or `primary`; the node writes, so it picks
/// a writable host whichever of them is given, and removes the parameter (the driver does not
/// know it). `read-only`, `standby` and `prefer-standby` are refused: a node cannot run on a
/// standby.
pub fn split_hosts(url: &str) -> Result<HostList, StoreError> {
    let invalid = |why: &str| StoreError::Config(format!("invalid database url: {why}"));
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| invalid("expected postgres://user@host:port/database"))?;
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path_and_query) = rest.split_at(authority_end);
    let (userinfo, host_list) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, authority),
    };
    let path_and_query = without_session_attrs(path_and_query)?;

    let mut urls = Vec::new();
    let mut names = Vec::new();
    let several = host_list.contains(',');
    for host in host_list.split(',') {
        // One empty host is the driver's default (a local socket); in a list it is a typo.
        if several && host.is_empty() {
            return Err(invalid("an empty host in the host list"));
        }
        let credentials = userinfo.map(|info| format!("{info}@")).unwrap_or_default();
        urls.push(format!("{scheme}://{credentials}{host}{path_and_query}"));
        names.push(host.to_owned());
    }
    Ok(HostList { urls, names })
}

/// The path and query without `target_session_attrs`, after checking its value.
fn without_session_attrs(path_and_query: &str) -> Result<String, StoreError> {
    let Some((path, query)) = path_and_query.split_once('?') else {
        return Ok(path_and_query.to_owned());
    };
    let mut kept = Vec::new();
    for pair in query.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key != SESSION_ATTRS_PARAMETER {
            kept.push(pair);
            continue;
        }
        match value {
            "any" | "read-write" | "primary" => {}
            other => {
                return Err(StoreError::Config(format!(
                    "invalid database url: target_session_attrs={other} is not supported; a node \
                     writes, so it needs any, read-write or primary"
                )));
            }
        }
    }
    if kept.is_empty() {
        return Ok(path.to_owned());
    }
    Ok(format!("{path}?{}", kept.join("&")))
}

/// The host to use: the first writable one in the URL's order, or `None` when no host is.
pub fn choose_host(probes: &[HostProbe]) -> Option<usize> {
    probes
        .iter()
        .position(|probe| *probe == HostProbe::Writable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_host_url_comes_back_unchanged() {
        let url = "postgres://postgres:secret@127.0.0.1:5432/converger?sslmode=disable";
        let hosts = split_hosts(url).unwrap();
        assert_eq!(hosts.urls, vec![url.to_owned()]);
        assert_eq!(hosts.names, vec!["127.0.0.1:5432".to_owned()]);
    }

    #[test]
    fn several_hosts_become_one_url_each_with_the_same_user_database_and_parameters() {
        let hosts = split_hosts(
            "postgres://app:p%40ss@db1:5432,db2:5433,[::1]:5434/chat?target_session_attrs=read-write&sslmode=disable",
        )
        .unwrap();
        assert_eq!(
            hosts.urls,
            vec![
                "postgres://app:p%40ss@db1:5432/chat?sslmode=disable".to_owned(),
                "postgres://app:p%40ss@db2:5433/chat?sslmode=disable".to_owned(),
                "postgres://app:p%40ss@[::1]:5434/chat?sslmode=disable".to_owned(),
            ]
        );
        assert_eq!(hosts.names, vec!["db1:5432", "db2:5433", "[::1]:5434"]);
    }

    #[test]
    fn the_session_attrs_parameter_is_removed_wherever_it_stands() {
        let hosts = split_hosts("postgresql://h1,h2/db?target_session_attrs=primary").unwrap();
        assert_eq!(hosts.urls, vec!["postgresql://h1/db", "postgresql://h2/db"]);
        let hosts = split_hosts("postgres://u@h1,h2?target_session_attrs=any").unwrap();
        assert_eq!(hosts.urls, vec!["postgres://u@h1", "postgres://u@h2"]);
    }

    #[test]
    fn session_attrs_that_would_put_a_node_on_a_standby_are_refused() {
        for value in ["read-only", "standby", "prefer-standby", "bogus"] {
            let url = format!("postgres://h1,h2/db?target_session_attrs={value}");
            assert!(
                matches!(split_hosts(&url), Err(StoreError::Config(_))),
                "{value} accepted"
            );
        }
    }

    #[test]
    fn malformed_host_lists_are_refused() {
        assert!(split_hosts("h1:5432/db").is_err());
        assert!(split_hosts("postgres://u@h1,,h2/db").is_err());
        assert!(split_hosts("postgres://u@h1,/db").is_err());
    }

    #[test]
    fn the_writable_host_is_chosen_and_read_only_ones_refused() {
        use HostProbe::*;
        assert_eq!(choose_host(&[ReadOnly, Writable]), Some(1));
        assert_eq!(choose_host(&[Unreachable, ReadOnly, Writable]), Some(2));
        assert_eq!(choose_host(&[Writable, Writable]), Some(0));
        assert_eq!(choose_host(&[ReadOnly, Unreachable]), None);
        assert_eq!(choose_host(&[]), None);
    }
}
