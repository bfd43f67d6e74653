//! Why a run fails and what a failure cost: [`LaunchError`] (every error of the launcher's side of
//! the runtime), [`Lost`] (a node a failure took out) and [`LossCause`] (how it was lost, typed so
//! that the recovery decisions in `recovery` never read error text).

use std::time::Duration;

use elastic::NodeId;
use thiserror::Error;

use crate::data::DataError;
use crate::plan::PlanError;

/// Why a run failed.
#[derive(Debug, Error)]
pub enum LaunchError {
    /// Local file or socket failure.
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// The dataset is unusable.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A worker reported an error.
    #[error("stage {stage} failed: {error}\n  (log: {log})")]
    WorkerFailed {
        stage: usize,
        error: String,
        log: String,
    },
    /// A worker's control connection closed (or a send to it failed): the worker or its host is
    /// gone.
    #[error("stage {stage} failed: connection closed: {reason}\n  (log: {log})")]
    WorkerDisconnected {
        stage: usize,
        reason: String,
        log: String,
    },
    /// A worker process ended unexpectedly.
    #[error("stage {stage} worker exited unexpectedly ({status}); last lines of {log}:\n{tail}")]
    WorkerExited {
        stage: usize,
        status: String,
        log: String,
        tail: String,
    },
    /// Something did not happen in time.
    #[error("timed out after {timeout:?} waiting for {what}; see the logs in {logs}")]
    Timeout {
        what: String,
        timeout: Duration,
        logs: String,
    },
    /// A worker broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// Data parallelism: the gradient reduction of step `step` failed on these workers although
    /// no worker was lost (a link between replicas broke, or a replica sent something wrong).
    #[error(
        "step {step}'s gradient reduction failed on worker slot(s) {slots:?} with no worker lost: {error}"
    )]
    ReductionFailed {
        step: u64,
        slots: Vec<usize>,
        error: String,
    },
    /// Nodes were lost: their agent or their worker died, or a worker hung. The other nodes are
    /// healthy and the run can go on under a new plan.
    #[error("lost node(s) {}: {cause}", lost.iter().map(|l| l.node.to_string()).collect::<Vec<_>>().join(", "))]
    NodesLost { lost: Vec<Lost>, cause: String },
    /// Nodes leave or join at the boundary after `step` (its checkpoint is committed): the
    /// pipeline restarts under the new plan.
    #[error("the plan changes after step {step}: {reason}")]
    PlanChanged { step: u64, reason: String },
    /// The run's last checkpoint, of `step`, was not committed, even after `attempts` tries: the
    /// steps since the newest committed checkpoint are lost (the run is not a success).
    #[error(
        "the final checkpoint of step {step} was not committed ({attempts} attempt(s)): {error}"
    )]
    FinalCheckpointFailed {
        step: u64,
        attempts: u32,
        error: String,
    },
    /// Checkpoint store failure.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// The run cannot start or continue as asked.
    #[error("{0}")]
    Run(String),
    /// A stage holds more than `train.memory_budget_bytes` (the same would happen on any node,
    /// so the run stops instead of recovering).
    #[error("stage {stage}: {error}")]
    OverBudget { stage: usize, error: String },
    /// A node of the plan cannot run its stages (its agent's memory check refused them).
    #[error("node {node} cannot run worker slot(s) {stages:?}: {error}")]
    NodeTooSmall {
        node: elastic::NodeId,
        stages: Vec<usize>,
        error: String,
    },
    /// A worker failed in a way that would recur on any node (see
    /// [`FailureCause::Permanent`]): the run stops with its message.
    #[error("stage {stage}: {error}")]
    Permanent { stage: usize, error: String },
}

impl From<PlanError> for LaunchError {
    /// A dataset that cannot be used stays a data fault ([`LaunchError::Data`]); a layout that
    /// cannot be made stops the run with its reason.
    fn from(e: PlanError) -> Self {
        match e {
            PlanError::Data(e) => LaunchError::Data(e),
            other => LaunchError::Run(other.to_string()),
        }
    }
}

/// How a node of the plan was lost. `recovery` decides on these, never on messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossCause {
    /// Its worker process ended by itself (killed, crashed, or failed and exited), as its agent
    /// reported.
    WorkerExited,
    /// Its worker's control connection closed.
    WorkerDisconnected,
    /// Its worker failed (reported an error) and the run stopped it.
    WorkerFailed,
    /// A neighbour found its worker silent past `pipeline.timeout_s`: hung, or cut off.
    Hung,
    /// Its agent's connection closed (the agent, or its host, died).
    AgentDisconnected,
    /// Its agent restarted and joined again as a new incarnation.
    AgentRestarted,
    /// The coordinator could not reach its agent (no connection, or a send failed).
    AgentUnreachable,
    /// Its agent stopped heartbeating: it may still be alive behind a network partition.
    Silent,
}

impl LossCause {
    /// Whether the loss proves that the node's worker is gone (a process exit or a closed
    /// connection), as opposed to silence, which a partition can also explain.
    pub fn proves_death(self) -> bool {
        !matches!(self, Self::Silent | Self::Hung | Self::WorkerFailed)
    }
}

/// A node lost in a failure, and whether its agent survived (its worker died or hung): such a node
/// joins again at once as a new incarnation, so the pipeline keeps its size.
#[derive(Clone, Debug, PartialEq)]
pub struct Lost {
    /// The node.
    pub node: NodeId,
    /// What happened, for people.
    pub reason: String,
    /// How it was lost, for the recovery decisions.
    pub cause: LossCause,
    /// Whether the node's agent is still connected (only its worker was lost).
    pub agent_alive: bool,
}
