//! Load for cluster and failover tests: a tenant and channel, end users that send turns one
//! after another and agents that answer every turn, both reconnecting to another node and
//! resending with the same client id whatever breaks, and recording what they saw in a
//! `History` for the checker.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use converger_client::{RestClient, TokenRequest};
use serde_json::{Value, json};
use sqlx::postgres::PgConnection;
use uuid::Uuid;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::cluster::NodeProcess;
use super::history::History;
use super::ws::WsClient;

/// A tenant and channel created through one node, and an agent token for the channel.
pub struct Channel {
    /// The channel secret, for user tokens.
    pub secret: String,
    /// A channel-scope token for agents.
    pub agent_token: String,
}

/// Creates tenant `acme` and channel `acme-web` through `node`.
pub async fn channel(node: &NodeProcess) -> Channel {
    let client = RestClient::new(&node.base_url).unwrap();
    let admin = super::test_config().admin_token;
    let tenant = client.create_tenant(&admin, "acme").await.unwrap();
    let channel = client
        .create_channel(&tenant.api_key, "acme-web")
        .await
        .unwrap();
    let agent_token = client
        .generate_token(&channel.secret, &TokenRequest::channel_scope())
        .await
        .unwrap()
        .token;
    Channel {
        secret: channel.secret,
        agent_token,
    }
}

/// A delivered turn: (conversation, seq).
pub fn turn_of(envelope: &Value) -> Option<(Uuid, i64)> {
    let frame = envelope.get("frame")?;
    if frame["type"] != "text" || frame["meta"]["turn"].is_null() {
        return None;
    }
    let conversation_id = envelope["conversationId"].as_str()?.parse().ok()?;
    Some((conversation_id, frame["meta"]["turn"]["seq"].as_i64()?))
}

/// A `turnResult` answering revision 0 of turn `seq` with one text frame.
pub fn turn_result(client_id: &str, seq: i64, text: &str) -> Value {
    json!({
        "type": "turnResult",
        "clientId": client_id,
        "turn": {"seq": seq, "revision": 0},
        "frames": [{"type": "text", "data": {"text": text}}],
    })
}

/// The nodes clients may connect to right now.
pub type Endpoints = Arc<Mutex<Vec<String>>>;

pub fn pick(endpoints: &Endpoints, n: usize) -> String {
    let endpoints = endpoints.lock().unwrap();
    endpoints[n % endpoints.len()].clone()
}

/// An agent of group "bot" that answers every turn after performing its side effect (keyed by
/// `meta.turn.key`), resends unacked results now and then (a rate limit or a lost connection
/// drops them), and reconnects to another node when its node goes away, until `stop`.
pub async fn answering_agent(
    endpoints: Endpoints,
    token: String,
    effects_url: String,
    history: Arc<History>,
    stop: tokio::sync::watch::Receiver<bool>,
    offset: usize,
) {
    let http = reqwest::Client::new();
    let mut attempt = offset;
    // Results sent and not acked yet, with when they were last sent.
    let mut unacked: BTreeMap<String, (tokio::time::Instant, Value)> = BTreeMap::new();
    'connect: while !*stop.borrow() {
        attempt += 1;
        let Ok(mut client) = WsClient::try_connect(&pick(&endpoints, attempt)).await else {
            continue;
        };
        let hello =
            json!({"type": "hello", "protocol": "converger/1", "token": token, "group": "bot"});
        if !client.try_send(hello).await {
            continue;
        }
        let mut last_resend = tokio::time::Instant::now();
        while !*stop.borrow() {
            if last_resend.elapsed() > Duration::from_millis(300) {
                last_resend = tokio::time::Instant::now();
                // A few at a time: a burst would run into the frame rate limit again.
                let due: Vec<String> = unacked
                    .iter()
                    .filter(|(_, (sent, _))| sent.elapsed() > Duration::from_secs(1))
                    .map(|(client_id, _)| client_id.clone())
                    .take(10)
                    .collect();
                for client_id in due {
                    let Some((sent, answer)) = unacked.get_mut(&client_id) else {
                        continue;
                    };
                    *sent = tokio::time::Instant::now();
                    if !client.try_send(answer.clone()).await {
                        continue 'connect;
                    }
                }
            }
            let envelope = match client.poll_event(Duration::from_millis(100)).await {
                None => continue,
                Some(Err(_closed)) => continue 'connect,
                Some(Ok(envelope)) => envelope,
            };
            let frame = &envelope["frame"];
            if frame["type"] == "ack" && frame["turn"].is_object() {
                let conversation_id: Uuid = envelope["conversationId"]
                    .as_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                let key = (
                    conversation_id,
                    frame["turn"]["seq"].as_i64().unwrap(),
                    frame["turn"]["revision"].as_i64().unwrap_or(0),
                );
                if frame["duplicate"] != true {
                    let seqs = frame["seqs"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .filter_map(Value::as_i64)
                        .collect();
                    history.result_committed(key, seqs);
                }
                if let Some(client_id) = frame["clientId"].as_str() {
                    unacked.remove(client_id);
                }
                continue;
            }
            if frame["type"] == "error" {
                // Refused for good (another member answered first): done; otherwise resent.
                if let Some(client_id) = frame["data"]["clientId"].as_str()
                    && frame["data"]["retryable"] != true
                {
                    unacked.remove(client_id);
                }
                continue;
            }
            let Some((conversation_id, seq)) = turn_of(&envelope) else {
                continue;
            };
            let revision = frame["meta"]["turn"]["revision"].as_i64().unwrap_or(0);
            history.delivered((conversation_id, seq, revision));
            let key = frame["meta"]["turn"]["key"].as_str().unwrap().to_owned();
            let effect = http
                .post(&effects_url)
                .header("idempotency-key", &key)
                .send()
                .await;
            assert!(
                effect.is_ok_and(|answer| answer.status().is_success()),
                "the effect service answers"
            );
            let client_id = format!("r-{conversation_id}-{seq}");
            let result = turn_result(&client_id, seq, "done");
            let answer = json!({"conversationId": conversation_id, "frame": result});
            unacked.insert(client_id, (tokio::time::Instant::now(), answer.clone()));
            if !client.try_send(answer).await {
                continue 'connect;
            }
        }
    }
}

/// An end user that sends turns one after another, reconnecting to another node when its node
/// goes away: it resumes from the highest seq it knows (hello `watermark`) and resends its
/// unacked turn with the same client id, until `stop`. It records what it saw in `history`.
pub async fn steady_user(
    endpoints: Endpoints,
    conversation: (Uuid, String),
    name: String,
    history: Arc<History>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let (conversation_id, token) = conversation;
    let mut attempt = name.len();
    let mut next = 0usize;
    // Seqs seen (received or acked) above `known`, the highest with nothing missing below it:
    // resuming from a higher seq could skip a frame still in flight when the socket broke.
    let mut known = 0i64;
    let mut above: BTreeSet<i64> = BTreeSet::new();
    'connect: while !*stop.borrow() {
        attempt += 1;
        let Ok(mut client) = WsClient::try_connect(&pick(&endpoints, attempt)).await else {
            continue;
        };
        let hello =
            json!({"type": "hello", "protocol": "converger/1", "token": token, "watermark": known});
        if !client.try_send(hello).await {
            continue;
        }
        while !*stop.borrow() {
            let client_id = format!("{name}-{next}");
            let turn = json!({"type": "text", "clientId": client_id, "data": {"text": "load"}});
            if !client.try_send(turn).await {
                continue 'connect;
            }
            loop {
                let frame = match client.poll_event(Duration::from_secs(5)).await {
                    None | Some(Err(_)) => continue 'connect,
                    Some(Ok(frame)) => frame,
                };
                if frame["type"] == "ack" && frame["clientId"] == client_id.as_str() {
                    let seq = frame["seq"].as_i64().expect("ack seq");
                    history.acked(&name, &client_id, conversation_id, seq);
                    advance(&mut known, &mut above, seq);
                    next += 1;
                    break;
                }
                if frame["type"] == "error" && frame["data"]["clientId"] == client_id.as_str() {
                    continue 'connect;
                }
                if frame["type"] != "ack"
                    && let Some(seq) = frame["seq"].as_i64()
                {
                    history.received(&name, conversation_id, seq);
                    advance(&mut known, &mut above, seq);
                }
            }
            // A steady pace, well under the agents' frame rate limit.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Records `seq` as seen and moves `known` up over every contiguous seq.
pub fn advance(known: &mut i64, above: &mut BTreeSet<i64>, seq: i64) {
    if seq > *known {
        above.insert(seq);
    }
    while above.remove(&(*known + 1)) {
        *known += 1;
    }
}

/// Turns among `acked` whose latest revision is not completed yet.
pub async fn unanswered(
    connection: &mut PgConnection,
    acked: &BTreeMap<String, (Uuid, i64)>,
) -> usize {
    let completed: Vec<(Uuid, i64)> =
        sqlx::query_as("SELECT conversation_id, seq FROM turns WHERE status = 'completed'")
            .fetch_all(connection)
            .await
            .unwrap();
    let completed: BTreeSet<(Uuid, i64)> = completed.into_iter().collect();
    acked
        .values()
        .filter(|turn| !completed.contains(turn))
        .count()
}

/// Answering agents and steady end users (each in a conversation of its own), running until
/// stopped, all recording into one history.
pub struct Running {
    /// What the users and agents saw.
    pub history: Arc<History>,
    agents: Vec<JoinHandle<()>>,
    users: Vec<JoinHandle<()>>,
    stop_agents: watch::Sender<bool>,
    stop_users: watch::Sender<bool>,
}

impl Running {
    /// Starts `agents` agents of group "bot" and `users` users of `channel`, whose
    /// conversations are created through `node`, all connecting to `endpoints`.
    pub async fn start(
        node: &NodeProcess,
        channel: &Channel,
        endpoints: &Endpoints,
        effects_url: &str,
        (agents, users): (usize, usize),
    ) -> Running {
        let history = Arc::new(History::default());
        let (stop_agents, agents_stopped) = watch::channel(false);
        let (stop_users, users_stopped) = watch::channel(false);
        let agents = (0..agents)
            .map(|offset| {
                tokio::spawn(answering_agent(
                    endpoints.clone(),
                    channel.agent_token.clone(),
                    effects_url.to_owned(),
                    history.clone(),
                    agents_stopped.clone(),
                    offset,
                ))
            })
            .collect();
        let rest = RestClient::new(&node.base_url).unwrap();
        let mut started = Vec::new();
        for n in 0..users {
            let name = format!("user-{n}");
            let token = rest
                .generate_token(&channel.secret, &TokenRequest::for_user(&name))
                .await
                .unwrap();
            let created = rest.create_conversation(&token.token).await.unwrap();
            started.push(tokio::spawn(steady_user(
                endpoints.clone(),
                (created.conversation_id, created.token),
                name,
                history.clone(),
                users_stopped.clone(),
            )));
        }
        Running {
            history,
            agents,
            users: started,
            stop_agents,
            stop_users,
        }
    }

    /// Turns acked so far.
    pub fn acked(&self) -> usize {
        self.history.acked_sends().len()
    }

    /// Stops the users and waits for them.
    pub async fn stop_users(&mut self) {
        self.stop_users.send(true).unwrap();
        for user in self.users.drain(..) {
            user.await.unwrap();
        }
    }

    /// Stops the agents and waits for them.
    pub async fn stop_agents(&mut self) {
        self.stop_agents.send(true).unwrap();
        for agent in self.agents.drain(..) {
            agent.await.unwrap();
        }
    }
}

/// Users' frames in the database by client id, (conversation, seq); `except` leaves one
/// conversation out.
pub async fn stored_sends(
    connection: &mut PgConnection,
    except: Option<Uuid>,
) -> BTreeMap<String, (Uuid, i64)> {
    let stored: Vec<(String, Uuid, i64)> = sqlx::query_as(
        "SELECT client_id, conversation_id, seq FROM activities
         WHERE sender_role = 'user' AND client_id IS NOT NULL
           AND conversation_id IS DISTINCT FROM $1",
    )
    .bind(except)
    .fetch_all(connection)
    .await
    .unwrap();
    stored
        .into_iter()
        .map(|(client_id, conversation_id, seq)| (client_id, (conversation_id, seq)))
        .collect()
}

/// (stored agent answers, completed turns): equal when each completed turn has one answer.
pub async fn answers_and_completed(connection: &mut PgConnection) -> (i64, i64) {
    let answers: i64 =
        sqlx::query_scalar("SELECT count(*) FROM activities WHERE sender_role = 'agent'")
            .fetch_one(&mut *connection)
            .await
            .unwrap();
    let completed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM turns WHERE status = 'completed'")
            .fetch_one(&mut *connection)
            .await
            .unwrap();
    (answers, completed)
}
