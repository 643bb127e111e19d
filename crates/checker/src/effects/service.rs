//! The effects ledger as an HTTP service on 127.0.0.1: `POST /effects` with an
//! `idempotency-key` header (and optionally `x-turn`, the turn the caller worked on) performs
//! the effect once per key and answers `{"effect": n, "first": bool}`.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;

use super::{EffectFigures, Ledger};

/// The header carrying the idempotency key (`meta.turn.key`).
pub const KEY_HEADER: &str = "idempotency-key";
/// The optional header naming the turn the caller worked on, for effects per turn.
pub const TURN_HEADER: &str = "x-turn";

/// Why the service could not start.
#[derive(Debug, thiserror::Error)]
pub enum EffectsError {
    /// No port could be bound on 127.0.0.1.
    #[error("the effects service could not listen on 127.0.0.1: {0}")]
    Bind(#[source] std::io::Error),
}

type Shared = Arc<Mutex<Ledger>>;

/// The running service; it stops when dropped.
pub struct Effects {
    /// `http://127.0.0.1:PORT/effects`.
    pub url: String,
    ledger: Shared,
    task: tokio::task::JoinHandle<()>,
}

impl Effects {
    /// Serves on an ephemeral port of 127.0.0.1.
    pub async fn start() -> Result<Effects, EffectsError> {
        let ledger: Shared = Arc::default();
        let app = Router::new()
            .route("/effects", post(perform))
            .with_state(Arc::clone(&ledger));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(EffectsError::Bind)?;
        let addr: SocketAddr = listener.local_addr().map_err(EffectsError::Bind)?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Effects {
            url: format!("http://{addr}/effects"),
            ledger,
            task,
        })
    }

    /// Effects performed (one per distinct key).
    pub fn performed(&self) -> usize {
        lock(&self.ledger).performed()
    }

    /// Calls that repeated a key (answered with the first outcome, no new effect).
    pub fn repeated_calls(&self) -> u64 {
        lock(&self.ledger).repeated_calls()
    }

    /// The keys with an effect.
    pub fn keys(&self) -> Vec<String> {
        lock(&self.ledger).keys()
    }

    /// The ledger's figures so far.
    pub fn figures(&self) -> EffectFigures {
        lock(&self.ledger).figures()
    }
}

impl Drop for Effects {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The ledger stays consistent whatever a panicking holder did: every update is one insert or
/// one increment.
fn lock(ledger: &Shared) -> MutexGuard<'_, Ledger> {
    ledger
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn perform(State(ledger): State<Shared>, headers: HeaderMap) -> Result<String, StatusCode> {
    let header = |name: &str| headers.get(name).and_then(|value| value.to_str().ok());
    let key = header(KEY_HEADER).ok_or(StatusCode::BAD_REQUEST)?;
    let outcome = lock(&ledger).perform(key, header(TURN_HEADER));
    Ok(format!(
        "{{\"effect\":{},\"first\":{}}}",
        outcome.effect, outcome.first
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_service_performs_once_per_key_over_http() {
        let effects = Effects::start().await.expect("the service starts");
        let http = reqwest::Client::new();
        let call = |key: &'static str| {
            http.post(&effects.url)
                .header(KEY_HEADER, key)
                .header(TURN_HEADER, key)
                .send()
        };
        for key in ["a", "b", "a"] {
            let answer = call(key).await.expect("the service answers");
            assert!(answer.status().is_success());
        }
        let missing = http.post(&effects.url).send().await.expect("answers");
        assert_eq!(missing.status(), reqwest::StatusCode::BAD_REQUEST);
        assert_eq!((effects.performed(), effects.repeated_calls()), (2, 1));
        assert_eq!(effects.figures().max_effects_per_turn, 1);
    }
}
