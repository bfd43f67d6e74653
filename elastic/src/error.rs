//! The crate's one error type.

use crate::node::NodeId;

/// Everything the elastic core can refuse.
///
/// Each message says what was refused, for which node or key, and what to do instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ElasticError {
    /// An `[elastic]` config value is out of range or inconsistent with another.
    #[error("invalid value for `{key}`: {message}")]
    InvalidConfig {
        /// The full key, e.g. `elastic.dead_after_s`.
        key: &'static str,
        /// Why the value cannot be used.
        message: String,
    },

    /// A message named a node that never joined.
    #[error(
        "unknown node `{0}`: it never joined; its agent must join before it heartbeats or leaves"
    )]
    UnknownNode(NodeId),

    /// A message came from a node that was declared dead: the node is fenced.
    #[error(
        "node `{id}` is fenced: it was declared dead ({reason}); its agent must stop its workers \
         and join again as a new incarnation"
    )]
    Fenced {
        /// The dead node.
        id: NodeId,
        /// Why it was declared dead.
        reason: String,
    },

    /// A join request could not be accepted.
    #[error("node `{id}` cannot join: {reason}")]
    BadJoin {
        /// The node that tried to join.
        id: NodeId,
        /// Why it was refused.
        reason: String,
    },

    /// A message carried a generation other than the current plan's.
    #[error(
        "message of plan generation {message} refused: the current generation is {current}; \
         the sender must fetch the current plan and restart its step from it"
    )]
    StaleGeneration {
        /// The receiver's current generation.
        current: u64,
        /// The generation the message carried.
        message: u64,
    },
}
