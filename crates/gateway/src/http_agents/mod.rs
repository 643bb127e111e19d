//! Agents behind a URL (ADR 0031, docs/agents.md §17): a channel's HTTP agent group is
//! served by every node, each a member of the group, so each turn has one caller, chosen like
//! any group member; the caller POSTs the turn as AG-UI `RunAgentInput` and commits the run's
//! answer once.
//!
//! - `mod.rs`: the supervisor, which keeps this node's members in step with the groups stored
//!   (re-read every `http_agents.reload_ms`), and the operator's allowlist;
//! - `member.rs`: one group's member on this node;
//! - `call.rs`: one turn's calls, retries, commit and failure;
//! - `gate.rs`: each URL's concurrency cap and circuit breaker;
//! - `streams.rs`: a call's text streamed to every tab;
//! - `request.rs`: one HTTP call and its response;
//! - `fold.rs`: AG-UI events folded into streams and an answer (pure).

mod call;
mod fold;
mod gate;
mod member;
mod request;
mod streams;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use converger_core::http_agents::{Breaker, BreakerState, UrlParts};
use converger_store::HttpAgent;
use uuid::Uuid;

pub(crate) use crate::agent_url::{url_label, url_parts};
use crate::config::HttpAgentsConfig;
use crate::state::AppState;
use call::Caller;
use gate::UrlGate;
use member::Member;

/// True when the operator's `http_agents.allow` covers `url`.
pub(crate) fn is_allowed(config: &HttpAgentsConfig, url: &str) -> bool {
    let Some(url) = url_parts(url) else {
        return false;
    };
    let allowed: Vec<UrlParts> = config
        .allow
        .iter()
        .filter_map(|entry| url_parts(entry))
        .collect();
    converger_core::http_agents::is_allowed(&allowed, &url)
}

/// This node's members and the gates of the URLs they call, as the status page shows them.
#[derive(Default)]
pub(crate) struct HttpAgents {
    gates: std::sync::Mutex<HashMap<String, Arc<UrlGate>>>,
    /// The client of every call, made when the supervisor starts.
    client: std::sync::OnceLock<reqwest::Client>,
}

impl HttpAgents {
    /// The breaker state of each URL this node calls.
    pub(crate) fn breakers(&self) -> Vec<(String, BreakerState)> {
        let gates = self.lock();
        let mut states: Vec<(String, BreakerState)> = gates
            .iter()
            .map(|(url, gate)| (url.clone(), gate.breaker_state()))
            .collect();
        states.sort_by(|a, b| a.0.cmp(&b.0));
        states
    }

    /// The gate of `url` (its query aside), new when none lets `capacity` calls through (the
    /// breaker then starts closed).
    fn gate(&self, config: &HttpAgentsConfig, url: &str, capacity: usize) -> Arc<UrlGate> {
        let label = url_label(url);
        let mut gates = self.lock();
        if let Some(gate) = gates.get(&label).filter(|gate| gate.capacity() == capacity) {
            return Arc::clone(gate);
        }
        let breaker = Breaker::new(config.breaker_failures, config.breaker_open_ms);
        let gate = Arc::new(UrlGate::new(capacity, breaker, label.clone()));
        gates.insert(label, Arc::clone(&gate));
        gate
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<UrlGate>>> {
        self.gates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Keeps this node's members in step with the stored groups until the node drains; then the
/// members leave (their calls are aborted and their turns pass to the other nodes).
pub(crate) fn spawn(state: AppState) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let config = &state.config.http_agents;
        let client = match request::client(Duration::from_millis(config.connect_timeout_ms)) {
            Ok(client) => state.http_agents.client.get_or_init(|| client).clone(),
            Err(error) => {
                tracing::error!(%error, "http agents: no HTTP client; HTTP agent groups are not served");
                return;
            }
        };
        let mut members: HashMap<(Uuid, String), (HttpAgent, Member)> = HashMap::new();
        let mut ticks = tokio::time::interval(Duration::from_millis(config.reload_ms.max(1)));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if state.is_draining() {
                members.clear();
                return;
            }
            match state.store.http_agents(None).await {
                Ok(agents) => reconcile(&state, &client, &mut members, agents),
                Err(error) => {
                    tracing::warn!(%error, "http agents: groups not read; keeping the members as they are")
                }
            }
        }
    })
}

/// True when this node calls HTTP agents (its client was made): a dead letter's retry is
/// taken only then.
pub(crate) fn calls_out(state: &AppState) -> bool {
    state.http_agents.client.get().is_some()
}

/// Calls `agent` once more for the turn of a dead letter an operator took for a retry (its
/// turn is pending again): this node calls, with the group's retries, whoever owns the turn.
pub(crate) async fn retry(
    state: &AppState,
    agent: HttpAgent,
    letter: &converger_store::DeadLetter,
) -> Result<(), crate::error::ApiError> {
    let Some(client) = state.http_agents.client.get().cloned() else {
        return Err(crate::error::ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            converger_protocol::ErrorCode::Unavailable,
            "this node does not call HTTP agents",
        ));
    };
    let turns = state
        .store
        .pending_turns(letter.conversation_id, &[letter.seq])
        .await?;
    let Some(pending) = turns
        .into_iter()
        .find(|turn| turn.revision == letter.revision)
    else {
        // Settled meanwhile (a newer revision, a stop, a close): nothing to call.
        return Ok(());
    };
    let reason = match pending.reason.as_deref() {
        Some("edit") => Some("edit"),
        Some("regenerate") => Some("regenerate"),
        _ => None,
    };
    let turn = converger_protocol::TurnRef::new(
        &letter.conversation_id.to_string(),
        pending.turn_seq,
        pending.revision,
        reason,
    );
    let capacity = usize::try_from(agent.max_concurrency.max(1)).unwrap_or(1);
    let caller = Caller {
        state: state.clone(),
        gate: state
            .http_agents
            .gate(&state.config.http_agents, &agent.url, capacity),
        client,
        connection: Uuid::new_v4().to_string(),
        from: Arc::new(serde_json::json!({"id": agent.group_name, "role": "agent"})),
        agent: Arc::new(agent),
    };
    tokio::spawn(Arc::new(caller).serve(call::DeliveredTurn {
        activity: Arc::new(pending.activity),
        turn,
    }));
    Ok(())
}

/// True when two versions of a group call alike (their times aside).
fn same_calls(a: &HttpAgent, b: &HttpAgent) -> bool {
    a.url == b.url
        && a.secret == b.secret
        && a.timeout_ms == b.timeout_ms
        && a.max_concurrency == b.max_concurrency
        && a.retry_attempts == b.retry_attempts
        && a.retry_backoff_ms == b.retry_backoff_ms
}

/// Starts a member for each new or changed group, stops those of groups gone.
fn reconcile(
    state: &AppState,
    client: &reqwest::Client,
    members: &mut HashMap<(Uuid, String), (HttpAgent, Member)>,
    agents: Vec<HttpAgent>,
) {
    let config = &state.config.http_agents;
    let mut wanted: HashMap<(Uuid, String), HttpAgent> = HashMap::new();
    for agent in agents {
        if !is_allowed(config, &agent.url) {
            // Stored while allowed; the operator has since removed it from the allowlist.
            continue;
        }
        wanted.insert((agent.channel_id, agent.group_name.clone()), agent);
    }
    // A member re-joins (aborting its calls) only when what it calls with changed.
    members.retain(|key, (agent, _)| {
        wanted
            .get(key)
            .is_some_and(|wanted| same_calls(wanted, agent))
    });
    for (key, agent) in wanted {
        if members.contains_key(&key) {
            continue;
        }
        let capacity = usize::try_from(agent.max_concurrency.max(1)).unwrap_or(1);
        let caller = Caller {
            state: state.clone(),
            gate: state.http_agents.gate(config, &agent.url, capacity),
            client: client.clone(),
            connection: Uuid::new_v4().to_string(),
            from: Arc::new(serde_json::json!({"id": agent.group_name, "role": "agent"})),
            agent: Arc::new(agent.clone()),
        };
        members.insert(key, (agent, Member::start(caller)));
    }
}
