//! Who a node is: its stable name and what its agent announces when it joins. The leaf every
//! other module of the crate (errors, membership, plans, rendezvous) names nodes through.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A node's stable name (e.g. its hostname). Nodes are ordered by it wherever order matters.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub String);

impl NodeId {
    /// A node id from any string.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for NodeId {
    fn from(id: &str) -> Self {
        Self(id.into())
    }
}

impl From<String> for NodeId {
    fn from(id: String) -> Self {
        Self(id)
    }
}

/// What a node's agent announces when it joins.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// The node's name.
    pub id: NodeId,
    /// Stage workers the node can run (e.g. its GPUs); at least 1.
    pub slots: usize,
    /// Where its agent listens (`host:port`); opaque to this crate.
    pub addr: String,
}

impl NodeInfo {
    /// A node description.
    pub fn new(id: impl Into<NodeId>, slots: usize, addr: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            slots,
            addr: addr.into(),
        }
    }
}
