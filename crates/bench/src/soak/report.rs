//! The soak's printed report: a table per section, then one JSON line.

use std::collections::BTreeMap;

use converger_checker::effects::EffectFigures;
use converger_checker::history::Verdict;
use serde_json::json;

use super::faults::FaultCounts;
use super::load::{Counters, Load};
use super::metrics::Totals;
use super::{DatabaseFigures, Settled, SoakArgs};
use crate::machine;

/// Everything the report prints.
pub(super) struct Printed<'a> {
    pub(super) args: &'a SoakArgs,
    pub(super) seed: u64,
    pub(super) loaded_secs: f64,
    pub(super) settle_secs: f64,
    pub(super) faults: &'a FaultCounts,
    pub(super) load: &'a Load,
    pub(super) verdict: &'a Verdict,
    pub(super) effects: &'a EffectFigures,
    pub(super) database: &'a DatabaseFigures,
    pub(super) settled: &'a Settled,
    pub(super) totals: &'a Totals,
    pub(super) breaches: &'a [String],
}

pub(super) fn print_report(printed: &Printed<'_>) {
    let Printed {
        args,
        seed,
        loaded_secs,
        settle_secs,
        faults,
        load,
        verdict,
        effects,
        database,
        settled,
        totals,
        breaches,
    } = printed;
    let counters = &load.counters;
    let sent = Counters::get(&counters.turns_sent);
    let answered = verdict.acked.saturating_sub(database.unanswered_acked);
    let retry_ratio = totals.retry_ratio();
    let claim_wait_p95_ms = totals
        .quantile("converger_claim_wait_seconds", 0.95)
        .map(|seconds| seconds * 1000.0);
    let commit_to_delivery_p99_ms = totals
        .quantile("converger_commit_to_delivery_seconds", 0.99)
        .map(|seconds| seconds * 1000.0);
    let results = totals.by_label("converger_turn_results_total", "outcome");
    let deliveries = totals.by_label("converger_deliveries_total", "kind");
    let refused = counters.refused();
    let optional = |value: Option<f64>, digits: usize| {
        value.map_or_else(|| "–".to_owned(), |value| format!("{value:.digits$}"))
    };

    println!(
        "converger soak: {} nodes on the {} bus, {} users, {} agents (lease mode, lease {} ms), {:.0} s of faults every ~{} ms, seed {seed}",
        args.nodes,
        args.bus,
        args.users,
        args.agents,
        args.lease_ms,
        loaded_secs,
        args.fault_every_ms
    );
    println!(
        "settle: {} in {settle_secs:.1} s (pending turns {}, users behind {}, users waiting {})",
        if settled.complete {
            "complete"
        } else {
            "TIMED OUT"
        },
        settled.pending_turns,
        settled.users_behind,
        settled.users_waiting
    );
    println!("{:<34} {:>10}", "turns", "");
    for (name, value) in [
        ("  sent", sent),
        ("  acked", verdict.acked as u64),
        ("  answered (completed or stopped)", answered as u64),
        (
            "  answers seen by their user",
            Counters::get(&counters.answers_received),
        ),
        (
            "  user reconnects",
            Counters::get(&counters.user_reconnects),
        ),
        (
            "  agent connections",
            Counters::get(&counters.agent_connections),
        ),
        ("  stops sent", Counters::get(&counters.stops_sent)),
        (
            "    of running turns",
            Counters::get(&counters.stops_stopping),
        ),
        (
            "  settled by the gateway (seen)",
            Counters::get(&counters.settlements_seen),
        ),
        ("  stopped in the db", database.stopped_turns as u64),
        (
            "  double texts refused (reject)",
            Counters::get(&counters.double_texts_refused),
        ),
        (
            "  slow answers (past the grace)",
            Counters::get(&counters.slow_answers),
        ),
    ] {
        println!("{name:<34} {value:>10}");
    }
    for (policy, count) in counters.double_texts() {
        println!("{:<34} {count:>10}", format!("  double texts, {policy}"));
    }
    println!("{:<34} {:>10}", "faults", faults.total());
    for (name, value) in [
        ("  kill an agent", faults.agents_killed),
        ("  kill -9 a node (and restart)", faults.nodes_killed),
        ("  terminate backends", faults.backend_terminations),
        ("    backends terminated", faults.backends_terminated),
        ("    of them LISTEN", faults.listen_backends_terminated),
        ("  drop sockets", faults.socket_drops),
        ("    connections cut", faults.sockets_dropped),
        ("  kill -9 a NATS server", faults.nats_killed),
        ("  cut NATS connections", faults.nats_cuts),
        ("  Postgres failovers", faults.failovers.len() as u64),
        ("  failed to inject", faults.failed),
    ] {
        println!("{name:<34} {value:>10}");
    }
    if !faults.failovers.is_empty() {
        let mut waits: Vec<u128> = faults
            .failovers
            .iter()
            .map(|failover| failover.to_first_ack.as_millis())
            .collect();
        waits.sort_unstable();
        let refused: Vec<u64> = faults
            .failovers
            .iter()
            .map(|failover| failover.refused_unavailable)
            .collect();
        println!(
            "{:<34} {:>10}",
            "    death to first ack, p50 / max",
            format!("{} / {} ms", waits[waits.len() / 2], waits[waits.len() - 1])
        );
        println!("{:<34} {refused:?}", "    sends refused unavailable");
    }
    println!("{:<34} {:>10}", "checker", "");
    for (name, value) in [
        ("  lost", verdict.lost.len()),
        ("  duplicate results", verdict.duplicate_results.len()),
        ("  gaps", verdict.gaps),
        ("  inversions", verdict.inversions),
        ("  doubles", verdict.doubles),
        ("  deliveries to agents", verdict.deliveries),
        ("  duplicate deliveries", verdict.duplicate_deliveries),
        ("  acked turns never answered", database.unanswered_acked),
        ("  streams (chunks sent)", verdict.streams),
        (
            "  — streamed whole",
            Counters::get(&counters.streams_sent) as usize,
        ),
        ("  — chunks seen by users", verdict.stream_chunks_seen),
        ("  — seen ending committed", verdict.streams_seen_committed),
        ("  — stream breaches", verdict.stream_breaches.len()),
    ] {
        println!("{name:<34} {value:>10}");
    }
    for breach in verdict.stream_breaches.iter().take(10) {
        println!("    {breach}");
    }
    println!("{:<34} {:>10}", "effects", effects.effects);
    for (name, value) in [
        ("  calls", effects.calls as usize),
        (
            "  max calls per turn key",
            effects.max_calls_per_key as usize,
        ),
        ("  keys called more than once", effects.keys_called_again),
        ("  max effects per turn", effects.max_effects_per_turn),
        (
            "  turns with several effects",
            effects.turns_with_several_effects,
        ),
    ] {
        println!("{name:<34} {value:>10}");
    }
    println!("{:<34} {:>10}", "nodes' metrics (all incarnations)", "");
    println!("{:<34} {:>10}", "  retry ratio", optional(retry_ratio, 4));
    println!(
        "{:<34} {:>10}",
        "  claim wait p95 ms",
        optional(claim_wait_p95_ms, 2)
    );
    println!(
        "{:<34} {:>10}",
        "  commit-to-delivery p99 ms",
        optional(commit_to_delivery_p99_ms, 2)
    );
    println!(
        "{:<34} {:>10}",
        "  turn results by outcome",
        format_counts(&results)
    );
    println!(
        "{:<34} {:>10}",
        "  deliveries by kind",
        format_counts(&deliveries)
    );
    println!(
        "{:<34} {:>10}",
        "  duplicate deliveries (registry)",
        totals.sum("converger_duplicate_deliveries_total", None)
    );
    if !refused.is_empty() {
        let refused: BTreeMap<String, f64> = refused
            .iter()
            .map(|(code, count)| (code.clone(), *count as f64))
            .collect();
        println!(
            "{:<34} {:>10}",
            "agents' refused results",
            format_counts(&refused)
        );
    }
    if !database.open_turns.is_empty() {
        println!("turns not completed (first 20):");
        for turn in &database.open_turns {
            println!("  {turn}");
        }
    }
    if !verdict.lost.is_empty() {
        println!(
            "lost (first 20): {:?}",
            &verdict.lost[..verdict.lost.len().min(20)]
        );
    }
    if !verdict.duplicate_results.is_empty() {
        let shown = &verdict.duplicate_results[..verdict.duplicate_results.len().min(20)];
        println!("duplicate results (first 20): {shown:?}");
    }
    println!(
        "verdict: {}",
        if breaches.is_empty() {
            "every promise held".to_owned()
        } else {
            format!("BREACH: {}", breaches.join(", "))
        }
    );
    let report = json!({
        "bench": "soak",
        "machine": machine::describe(),
        "nodes": args.nodes,
        "bus": args.bus,
        "users": args.users,
        "agents": args.agents,
        "duration_secs": loaded_secs,
        "fault_every_ms": args.fault_every_ms,
        "node_down_ms": args.node_down_ms,
        "lease_ms": args.lease_ms,
        "seed": seed,
        "settle": {
            "complete": settled.complete,
            "secs": settle_secs,
            "pending_turns": settled.pending_turns,
            "users_behind": settled.users_behind,
            "users_waiting": settled.users_waiting,
        },
        "turns": {
            "sent": sent,
            "acked": verdict.acked,
            "answered": answered,
            "answers_seen_by_users": Counters::get(&counters.answers_received),
            "answers_waited_out": Counters::get(&counters.answers_waited_out),
            "user_reconnects": Counters::get(&counters.user_reconnects),
            "user_errors": Counters::get(&counters.user_errors),
            "agent_connections": Counters::get(&counters.agent_connections),
            "stops_sent": Counters::get(&counters.stops_sent),
            "stops_of_running_turns": Counters::get(&counters.stops_stopping),
            "settlements_seen": Counters::get(&counters.settlements_seen),
            "double_texts": counters.double_texts(),
            "double_texts_refused": Counters::get(&counters.double_texts_refused),
            "slow_answers": Counters::get(&counters.slow_answers),
        },
        "faults": faults.to_json(),
        "checker": {
            "acked": verdict.acked,
            "lost": verdict.lost.len(),
            "duplicate_results": verdict.duplicate_results.len(),
            "gaps": verdict.gaps,
            "inversions": verdict.inversions,
            "doubles": verdict.doubles,
            "deliveries": verdict.deliveries,
            "duplicate_deliveries": verdict.duplicate_deliveries,
            "unanswered": database.unanswered_acked,
            "streams": verdict.streams,
            "streams_sent_whole": Counters::get(&counters.streams_sent),
            "stream_chunks_seen": verdict.stream_chunks_seen,
            "streams_seen_committed": verdict.streams_seen_committed,
            "stream_breaches": verdict.stream_breaches.len(),
            "stopped_streams_checked": verdict.stopped_streams_checked,
            "turns_with_two_results": database.double_results,
        },
        "effects": {
            "performed": effects.effects,
            "calls": effects.calls,
            "max_calls_per_key": effects.max_calls_per_key,
            "keys_called_more_than_once": effects.keys_called_again,
            "max_effects_per_turn": effects.max_effects_per_turn,
            "turns_with_several_effects": effects.turns_with_several_effects,
            "keys_with_several_turns": effects.keys_with_several_turns,
            "failed_calls": Counters::get(&counters.effect_failures),
        },
        "agents_results": {
            "committed": Counters::get(&counters.results_committed),
            "duplicate": Counters::get(&counters.results_duplicate),
            "refused": refused,
        },
        "database": {
            "completed_turns": database.completed_turns,
            "stopped_turns": database.stopped_turns,
            "agent_frames": database.agent_frames,
        },
        "metrics": {
            "retry_ratio": retry_ratio,
            "claim_wait_p95_ms": claim_wait_p95_ms,
            "claim_waits": totals.count("converger_claim_wait_seconds"),
            "commit_to_delivery_p99_ms": commit_to_delivery_p99_ms,
            "commit_to_deliveries": totals.count("converger_commit_to_delivery_seconds"),
            "turn_results": results,
            "deliveries": deliveries,
            "duplicate_deliveries": totals.sum("converger_duplicate_deliveries_total", None),
        },
        "breaches": breaches,
    });
    println!("{report}");
}

fn format_counts(counts: &BTreeMap<String, f64>) -> String {
    counts
        .iter()
        .map(|(name, count)| format!("{name} {count:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}
