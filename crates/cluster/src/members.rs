//! The pure part of membership: how an agent connection is written into gossip, how a node's
//! key-values are read back, and how two successive live views differ. No I/O, no clock.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Prefix of the gossip keys that announce agent connections.
const AGENT_PREFIX: &str = "agent:";

/// The gossip key holding a node's HTTP address.
pub const HTTP_KEY: &str = "http";

/// One agent connection as gossip carries it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AgentRecord {
    /// The channel it serves.
    pub channel_id: Uuid,
    /// Its connection id (unique in the cluster: a UUID given by its node).
    pub connection_id: String,
    /// Its group, `None` for an observer.
    pub group: Option<String>,
    /// Eligibility time (ms since the epoch, the hosting node's clock).
    pub since_ms: i64,
}

/// The value part of an agent key, kept short: gossip packets have an MTU.
#[derive(Debug, Serialize, Deserialize)]
struct AgentValue {
    #[serde(rename = "g", default, skip_serializing_if = "Option::is_none")]
    group: Option<String>,
    #[serde(rename = "s")]
    since_ms: i64,
}

impl AgentRecord {
    /// The gossip key: `agent:<channel>:<connection>`.
    pub fn key(&self) -> String {
        agent_key(self.channel_id, &self.connection_id)
    }

    /// The gossip value: `{"g": group, "s": since}`.
    pub fn value(&self) -> String {
        let value = AgentValue {
            group: self.group.clone(),
            since_ms: self.since_ms,
        };
        // Serializing a struct of a string and an integer cannot fail.
        serde_json::to_string(&value).unwrap_or_default()
    }

    /// Reads a gossip key-value back; `None` for other keys and for malformed ones.
    pub fn parse(key: &str, value: &str) -> Option<AgentRecord> {
        let rest = key.strip_prefix(AGENT_PREFIX)?;
        let (channel, connection_id) = rest.split_once(':')?;
        let channel_id = Uuid::parse_str(channel).ok()?;
        if connection_id.is_empty() {
            return None;
        }
        let value: AgentValue = serde_json::from_str(value).ok()?;
        Some(AgentRecord {
            channel_id,
            connection_id: connection_id.to_owned(),
            group: value.group,
            since_ms: value.since_ms,
        })
    }
}

/// The gossip key of an agent connection.
pub fn agent_key(channel_id: Uuid, connection_id: &str) -> String {
    format!("{AGENT_PREFIX}{channel_id}:{connection_id}")
}

/// One incarnation of a node: a restarted node has a new generation, so it is a new key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct NodeKey {
    /// The configured (or generated) node id.
    pub node_id: String,
    /// The start time of this incarnation (ms).
    pub generation: u64,
}

/// The agent connections of one node, by (channel, connection id).
pub type NodeAgents = BTreeMap<(Uuid, String), AgentRecord>;

/// Reads a node's agent connections out of its key-values; other keys are ignored.
pub fn node_agents<'a>(key_values: impl Iterator<Item = (&'a str, &'a str)>) -> NodeAgents {
    key_values
        .filter_map(|(key, value)| AgentRecord::parse(key, value))
        .map(|record| ((record.channel_id, record.connection_id.clone()), record))
        .collect()
}

/// The live view of the other nodes: each live node with its agent connections.
pub type LiveView = BTreeMap<NodeKey, NodeAgents>;

/// Why an agent connection left the view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaveReason {
    /// Its node withdrew it (the connection closed, or the node drains).
    Withdrawn,
    /// Its node was declared dead by the failure detector.
    NodeDown,
}

/// A change between two live views, in the order it should be applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MembershipEvent {
    /// A node became live.
    NodeUp(NodeKey),
    /// An agent connection appeared on a live node.
    Joined(NodeKey, AgentRecord),
    /// An agent connection disappeared.
    Left(NodeKey, AgentRecord, LeaveReason),
    /// A node stopped being live (its connections were reported `Left` just before).
    NodeDown(NodeKey),
}

/// The events that turn `before` into `after`: departures first (so a takeover never picks a
/// member that is also leaving in the same step), then arrivals.
pub fn diff(before: &LiveView, after: &LiveView) -> Vec<MembershipEvent> {
    let mut departures = Vec::new();
    let mut arrivals = Vec::new();
    for (node, agents) in before {
        match after.get(node) {
            None => {
                for record in agents.values() {
                    departures.push(MembershipEvent::Left(
                        node.clone(),
                        record.clone(),
                        LeaveReason::NodeDown,
                    ));
                }
                departures.push(MembershipEvent::NodeDown(node.clone()));
            }
            Some(now) => {
                for (key, record) in agents {
                    if now.get(key) != Some(record) {
                        departures.push(MembershipEvent::Left(
                            node.clone(),
                            record.clone(),
                            LeaveReason::Withdrawn,
                        ));
                    }
                }
            }
        }
    }
    for (node, agents) in after {
        let previous = before.get(node);
        if previous.is_none() {
            arrivals.push(MembershipEvent::NodeUp(node.clone()));
        }
        for (key, record) in agents {
            if previous.and_then(|agents| agents.get(key)) != Some(record) {
                arrivals.push(MembershipEvent::Joined(node.clone(), record.clone()));
            }
        }
    }
    departures.extend(arrivals);
    departures
}

/// Applies events to a view (what a consumer of the events ends up knowing).
pub fn apply(view: &mut LiveView, events: &[MembershipEvent]) {
    for event in events {
        match event {
            MembershipEvent::NodeUp(node) => {
                view.entry(node.clone()).or_default();
            }
            MembershipEvent::Joined(node, record) => {
                view.entry(node.clone()).or_default().insert(
                    (record.channel_id, record.connection_id.clone()),
                    record.clone(),
                );
            }
            MembershipEvent::Left(node, record, _) => {
                if let Some(agents) = view.get_mut(node) {
                    agents.remove(&(record.channel_id, record.connection_id.clone()));
                }
            }
            MembershipEvent::NodeDown(node) => {
                view.remove(node);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn channel(n: u8) -> Uuid {
        Uuid::from_bytes([n; 16])
    }

    fn record(channel_n: u8, connection: &str, group: Option<&str>, since_ms: i64) -> AgentRecord {
        AgentRecord {
            channel_id: channel(channel_n),
            connection_id: connection.to_owned(),
            group: group.map(str::to_owned),
            since_ms,
        }
    }

    fn node(id: &str, generation: u64) -> NodeKey {
        NodeKey {
            node_id: id.to_owned(),
            generation,
        }
    }

    #[test]
    fn a_record_survives_its_gossip_form() {
        for original in [
            record(1, "c-1", Some("writers"), 1_700_000_000_000),
            record(2, "c-2", None, 5),
        ] {
            let parsed = AgentRecord::parse(&original.key(), &original.value());
            assert_eq!(parsed, Some(original));
        }
    }

    #[test]
    fn foreign_and_malformed_keys_are_ignored() {
        let good = record(1, "c", Some("g"), 1);
        assert_eq!(AgentRecord::parse(HTTP_KEY, "127.0.0.1:8080"), None);
        assert_eq!(
            AgentRecord::parse("agent:not-a-uuid:c", &good.value()),
            None
        );
        assert_eq!(
            AgentRecord::parse(&agent_key(channel(1), ""), &good.value()),
            None
        );
        assert_eq!(AgentRecord::parse(&good.key(), "{\"g\":\"g\"}"), None);
        let agents = node_agents(
            [
                (HTTP_KEY, "127.0.0.1:1"),
                (good.key().as_str(), good.value().as_str()),
            ]
            .into_iter(),
        );
        assert_eq!(agents.len(), 1);
    }

    #[test]
    fn a_dead_node_takes_its_members_with_it() {
        let a = node("a", 1);
        let mut before = LiveView::new();
        let member = record(1, "c-1", Some("g"), 10);
        before.entry(a.clone()).or_default().insert(
            (member.channel_id, member.connection_id.clone()),
            member.clone(),
        );
        let events = diff(&before, &LiveView::new());
        assert_eq!(
            events,
            vec![
                MembershipEvent::Left(a.clone(), member, LeaveReason::NodeDown),
                MembershipEvent::NodeDown(a),
            ]
        );
    }

    #[test]
    fn a_restarted_node_is_a_new_incarnation() {
        let old = node("a", 1);
        let new = node("a", 2);
        let before = LiveView::from([(old.clone(), NodeAgents::new())]);
        let after = LiveView::from([(new.clone(), NodeAgents::new())]);
        assert_eq!(
            diff(&before, &after),
            vec![MembershipEvent::NodeDown(old), MembershipEvent::NodeUp(new)]
        );
    }

    #[test]
    fn departures_come_before_arrivals() {
        let a = node("a", 1);
        let leaving = record(1, "old", Some("g"), 1);
        let joining = record(1, "new", Some("g"), 2);
        let before = LiveView::from([(
            a.clone(),
            NodeAgents::from([(
                (leaving.channel_id, leaving.connection_id.clone()),
                leaving.clone(),
            )]),
        )]);
        let after = LiveView::from([(
            a.clone(),
            NodeAgents::from([(
                (joining.channel_id, joining.connection_id.clone()),
                joining.clone(),
            )]),
        )]);
        assert_eq!(
            diff(&before, &after),
            vec![
                MembershipEvent::Left(a.clone(), leaving, LeaveReason::Withdrawn),
                MembershipEvent::Joined(a, joining),
            ]
        );
    }

    fn view_strategy() -> impl Strategy<Value = LiveView> {
        let agent = (0u8..3, 0u8..6, prop::option::of(0u8..2), 0i64..4).prop_map(
            |(c, conn, group, since)| {
                record(
                    c,
                    &format!("c{conn}"),
                    group.map(|g| ["g0", "g1"][g as usize]),
                    since,
                )
            },
        );
        let agents = prop::collection::vec(agent, 0..6).prop_map(|records| {
            records
                .into_iter()
                .map(|r| ((r.channel_id, r.connection_id.clone()), r))
                .collect::<NodeAgents>()
        });
        let node_key = (0u8..3, 0u64..2).prop_map(|(n, g)| node(&format!("n{n}"), g));
        prop::collection::btree_map(node_key, agents, 0..4)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// A consumer that applies the events of every step knows exactly the live view.
        #[test]
        fn applying_the_diff_reproduces_the_view(steps in prop::collection::vec(view_strategy(), 1..8)) {
            let mut known = LiveView::new();
            let mut previous = LiveView::new();
            for view in steps {
                let events = diff(&previous, &view);
                apply(&mut known, &events);
                prop_assert_eq!(&known, &view);
                previous = view;
            }
        }

        /// No event is emitted for an unchanged view, and no member leaves twice or joins twice.
        #[test]
        fn events_are_minimal(before in view_strategy(), after in view_strategy()) {
            prop_assert!(diff(&before, &before).is_empty());
            let events = diff(&before, &after);
            let mut seen = std::collections::HashSet::new();
            for event in &events {
                let unique = match event {
                    MembershipEvent::Left(n, r, _) => seen.insert(("left", n.clone(), r.connection_id.clone(), r.channel_id)),
                    MembershipEvent::Joined(n, r) => seen.insert(("joined", n.clone(), r.connection_id.clone(), r.channel_id)),
                    _ => true,
                };
                prop_assert!(unique, "repeated event {:?}", event);
            }
        }
    }
}
