//! Cluster membership: a chitchat (UDP gossip) node per gateway that publishes this node's agent
//! connections (channel, group, connection id → `since`) and its HTTP address, and turns the
//! other nodes' gossip state into membership events (joined, left, node up, node down).
//!
//! The pure part (`members`) parses gossip key-values and diffs successive live views; the shell
//! (`node`) owns the chitchat server; `sealed` seals every datagram under the cluster key.

#![forbid(unsafe_code)]

pub mod members;
mod node;
mod sealed;

pub use members::{AgentRecord, LeaveReason, MembershipEvent, NodeKey};
pub use node::{Cluster, ClusterConfig, ClusterStatus, MemberStatus, NodeStatus};
pub use sealed::{GossipKey, GossipKeys, MAX_SKEW};

/// Errors of the cluster node.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The gossip socket could not be opened.
    #[error("cannot open gossip socket {addr}: {reason}")]
    Bind {
        /// Requested address.
        addr: std::net::SocketAddr,
        /// Cause.
        reason: String,
    },
    /// The membership task has stopped (the node is shutting down).
    #[error("cluster membership stopped")]
    Stopped,
}
