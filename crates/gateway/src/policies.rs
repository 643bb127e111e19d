//! Double texting (ADR 0029): the turn policy of each channel, and an end user's send under
//! it, the one path sockets and REST share. `enqueue` is the group commit as before; `reject`,
//! `interrupt` and `rollback` commit in a transaction of their own that reads the running turns
//! under the conversation's row lock and performs the core's decision; the turns an interrupt
//! stopped are then announced and settled as any stop (`stops.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use converger_core::policies::{ChannelPolicies, RunningTurn, SendDecision, TurnPolicy};
use converger_protocol::StopReason;
use converger_store::{
    Channel, CommitOutcome, NewActivity, PolicyVerdict, StoppedTurn, Store, StoreError,
};
use uuid::Uuid;

use crate::config::TurnsConfig;
use crate::hub::lock;
use crate::state::AppState;

/// How long a node uses a channel's settings before reading them again: a change reaches
/// every node's sends within this.
const SETTINGS_TTL: Duration = Duration::from_secs(5);

/// Channels whose settings a node remembers; past this it forgets them all at once.
const REMEMBERED_CHANNELS: usize = 10_000;

/// What a channel says about running turns, with the node's defaults applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChannelTurns {
    /// Its policy and the ones a send may ask for.
    pub policies: ChannelPolicies,
    /// Whether the last end-user connection of a conversation leaving cancels its turn.
    pub cancel_on_disconnect: bool,
}

impl ChannelTurns {
    /// The settings of `channel`, the node's defaults where it names none (a stored name is
    /// always valid: the table's constraints hold them to the four).
    pub(crate) fn of(channel: &Channel, defaults: &TurnsConfig) -> ChannelTurns {
        let default = channel
            .turn_policy
            .as_deref()
            .and_then(TurnPolicy::parse)
            .unwrap_or_else(|| defaults.default_policy());
        ChannelTurns {
            policies: ChannelPolicies {
                default,
                overrides: channel
                    .turn_policy_overrides
                    .iter()
                    .filter_map(|name| TurnPolicy::parse(name))
                    .collect(),
            },
            cancel_on_disconnect: channel.on_disconnect.as_deref() == Some("cancel"),
        }
    }
}

/// Each channel's settings as this node last read them.
#[derive(Debug, Default)]
pub(crate) struct ChannelTurnsCache {
    read: Mutex<HashMap<Uuid, (Instant, Arc<ChannelTurns>)>>,
}

impl ChannelTurnsCache {
    /// The channel's settings, read again when older than [`SETTINGS_TTL`];
    /// `ChannelNotFound` when there is no such channel.
    pub(crate) async fn get(
        &self,
        store: &Store,
        defaults: &TurnsConfig,
        channel_id: Uuid,
    ) -> Result<Arc<ChannelTurns>, StoreError> {
        if let Some((at, turns)) = lock(&self.read).get(&channel_id)
            && at.elapsed() < SETTINGS_TTL
        {
            return Ok(Arc::clone(turns));
        }
        // Boxed: read once per TTL, it need not weigh on every send's future.
        let channel = Box::pin(store.channel(channel_id))
            .await?
            .ok_or(StoreError::ChannelNotFound)?;
        let turns = Arc::new(ChannelTurns::of(&channel, defaults));
        self.remember(channel_id, Arc::clone(&turns));
        Ok(turns)
    }

    /// Keeps settings this node just wrote or read.
    pub(crate) fn remember(&self, channel_id: Uuid, turns: Arc<ChannelTurns>) {
        let mut read = lock(&self.read);
        if read.len() >= REMEMBERED_CHANNELS {
            read.clear();
        }
        read.insert(channel_id, (Instant::now(), turns));
    }
}

/// The refusal of a `turnPolicy` that names no policy.
pub(crate) const UNKNOWN_POLICY: &str =
    "turnPolicy must be \"enqueue\", \"reject\", \"interrupt\" or \"rollback\"";

/// Why a send was not stored.
#[derive(Debug)]
pub(crate) enum SendError {
    /// The store's refusal or failure (`turn_in_progress`, `conversation_closed`, …).
    Store(StoreError),
    /// The send asked for a policy its channel does not allow.
    NotAllowed(TurnPolicy),
}

impl From<StoreError> for SendError {
    fn from(error: StoreError) -> SendError {
        SendError::Store(error)
    }
}

/// Commits an end user's send under its channel's policy, or the one it `asked` for; the turns
/// an interrupt stopped are announced (and their settlement scheduled) before this returns.
/// The new turn's own notification committed with it, so other nodes may deliver it before
/// they hear the stop.
pub(crate) async fn commit_send(
    state: &AppState,
    channel_id: Uuid,
    new: &NewActivity,
    asked: Option<TurnPolicy>,
) -> Result<CommitOutcome, SendError> {
    let settings = state
        .channel_turns
        .get(&state.store, &state.config.turns, channel_id)
        .await?;
    let policy = settings
        .policies
        .choose(asked)
        .ok_or(SendError::NotAllowed(asked.unwrap_or(TurnPolicy::Enqueue)))?;
    if policy == TurnPolicy::Enqueue {
        return Ok(state.store.commit_activity(new).await?);
    }
    metrics::counter!("converger_policy_sends_total", "policy" => policy.as_str()).increment(1);
    // Boxed: a policy's transaction is a large future, and every send's future would carry
    // its size (moved into a box per send) if it were inline.
    let committed = Box::pin(
        state
            .store
            .commit_with_policy(new, |running| verdict(policy, running)),
    )
    .await?;
    for turn in &committed.stopped {
        Box::pin(crate::stops::announce(
            state,
            committed.channel_id,
            new.conversation_id,
            *turn,
            StopReason::Superseded,
        ))
        .await;
    }
    Ok(committed.outcome)
}

/// The core's decision for the running turns the store read, in the store's terms.
fn verdict(policy: TurnPolicy, running: &[StoppedTurn]) -> PolicyVerdict {
    let as_core: Vec<RunningTurn> = running
        .iter()
        .map(|turn| RunningTurn {
            seq: turn.seq,
            revision: turn.revision,
        })
        .collect();
    match converger_core::policies::decide_send(policy, &as_core) {
        SendDecision::Refuse { running } => PolicyVerdict::Refuse { seq: running.seq },
        SendDecision::Commit { stop, rollback } => PolicyVerdict::Commit {
            stop: running
                .iter()
                .filter(|turn| {
                    stop.iter()
                        .any(|stopped| stopped.seq == turn.seq && stopped.revision == turn.revision)
                })
                .copied()
                .collect(),
            rollback,
        },
    }
}

/// The last end-user connection of a conversation left (on any node; this node saw the count
/// reach 0). On a channel with `onDisconnect: "cancel"`, the running turn is stopped (reason
/// `user_disconnected`) once `turns.disconnect_cancel_ms` passed with nobody back. A closed tab is
/// never a stop on any other channel. Best effort: a node that dies meanwhile cancels nothing,
/// and the turn is answered.
pub(crate) fn on_last_disconnect(state: &AppState, channel_id: Uuid, conversation_id: Uuid) {
    let state = state.clone();
    tokio::spawn(async move {
        let settings = match state
            .channel_turns
            .get(&state.store, &state.config.turns, channel_id)
            .await
        {
            Ok(settings) => settings,
            Err(error) => {
                tracing::debug!(%error, %channel_id, "disconnect: channel settings unreadable");
                return;
            }
        };
        if !settings.cancel_on_disconnect {
            return;
        }
        tokio::time::sleep(Duration::from_millis(
            state.config.turns.disconnect_cancel_ms,
        ))
        .await;
        match state.store.conversation_connections(conversation_id).await {
            Ok(0) => {}
            Ok(_) => return,
            Err(error) => {
                tracing::warn!(%error, %conversation_id, "disconnect: connections unreadable; nothing cancelled");
                return;
            }
        }
        if let Err(error) =
            crate::stops::stop(&state, conversation_id, None, StopReason::Disconnected).await
        {
            tracing::debug!(%error, %conversation_id, "disconnect: nothing cancelled");
        }
    });
}
