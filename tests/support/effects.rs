//! An external side-effect service for agents under test: `POST /effects` with an
//! `idempotency-key` header (agents pass `meta.turn.key`) performs an effect once per key and
//! answers every repeat with the first outcome, counting the calls, so a test can check one
//! effect per turn key however often a turn was delivered.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;

#[derive(Default)]
struct Ledger {
    /// Key → (effect number, calls).
    effects: BTreeMap<String, (u64, u64)>,
}

/// The running fixture.
pub struct Effects {
    /// `http://127.0.0.1:PORT/effects`.
    pub url: String,
    ledger: Arc<Mutex<Ledger>>,
    task: tokio::task::JoinHandle<()>,
}

impl Effects {
    /// Serves on an ephemeral port.
    pub async fn start() -> Effects {
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let app = Router::new()
            .route("/effects", post(perform))
            .with_state(Arc::clone(&ledger));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Effects {
            url: format!("http://{addr}/effects"),
            ledger,
            task,
        }
    }

    /// Effects performed (one per distinct key).
    pub fn performed(&self) -> usize {
        self.ledger.lock().unwrap().effects.len()
    }

    /// Calls that repeated a key (answered with the first outcome, no new effect).
    pub fn repeated_calls(&self) -> u64 {
        self.ledger
            .lock()
            .unwrap()
            .effects
            .values()
            .map(|(_, calls)| calls - 1)
            .sum()
    }

    /// The keys with an effect.
    pub fn keys(&self) -> Vec<String> {
        self.ledger
            .lock()
            .unwrap()
            .effects
            .keys()
            .cloned()
            .collect()
    }
}

impl Drop for Effects {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn perform(
    State(ledger): State<Arc<Mutex<Ledger>>>,
    headers: HeaderMap,
) -> Result<String, StatusCode> {
    let key = headers
        .get("idempotency-key")
        .and_then(|value| value.to_str().ok())
        .ok_or(StatusCode::BAD_REQUEST)?
        .to_owned();
    let mut ledger = ledger.lock().unwrap();
    let next = ledger.effects.len() as u64 + 1;
    let entry = ledger.effects.entry(key).or_insert((next, 0));
    entry.1 += 1;
    Ok(format!(
        "{{\"effect\":{},\"first\":{}}}",
        entry.0,
        entry.1 == 1
    ))
}
