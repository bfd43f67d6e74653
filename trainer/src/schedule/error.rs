//! The one error type of the schedule module.

use super::action::{Action, Unit};

/// `" on chunk c"` for chunks ≥ 1, nothing for chunk 0 (the only one without virtual stages).
fn on_chunk(chunk: usize) -> String {
    if chunk == 0 {
        String::new()
    } else {
        format!(" on chunk {chunk}")
    }
}

/// Everything that can be wrong with a schedule, its parameters, or a partition.
///
/// Positions (`position`) are 0-based indices into the stage's action list and print as `#n`.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ScheduleError {
    /// A parameter is out of range (zero stages, zero micro-batches, zero splits, ...).
    #[error("invalid schedule parameters: {0}")]
    InvalidParameters(String),

    /// Text that does not parse as the named thing.
    #[error("cannot parse {what} from {input:?}: {reason}")]
    Parse {
        /// What was being parsed ("action", "unit", "schedule kind", "partition").
        what: &'static str,
        /// The offending text.
        input: String,
        /// Why it was refused (lists the allowed forms).
        reason: String,
    },

    /// The schedule's action lists do not match its stage count.
    #[error("schedule declares {expected} stages but has {found} action lists")]
    StageCount {
        /// `Schedule::stages`.
        expected: usize,
        /// `Schedule::actions.len()`.
        found: usize,
    },

    /// An action that cannot appear where it is (unit out of range, a receive on stage 0, a
    /// backward in a forward-only schedule, ...).
    #[error("stage {stage}, action #{position} {action}: {reason}")]
    InvalidAction {
        /// Stage index.
        stage: usize,
        /// Index in the stage's action list.
        position: usize,
        /// The action.
        action: Action,
        /// Why it is not allowed there.
        reason: String,
    },

    /// A unit is missing, or present more than once, on a stage.
    #[error(
        "stage {stage}: incomplete schedule: unit {unit}{} has {count} {what} action(s), \
         expected exactly {expected}",
        on_chunk(*.chunk)
    )]
    Incomplete {
        /// Stage index.
        stage: usize,
        /// The unit.
        unit: Unit,
        /// The stage's local chunk (0 without virtual stages).
        chunk: usize,
        /// Which action ("forward (F)", "backward (B)", "receive-activation (RF)", ...).
        what: &'static str,
        /// How many there are.
        count: usize,
        /// How many there should be (0 or 1).
        expected: usize,
    },

    /// A compute action comes before something it depends on, on the same stage.
    #[error(
        "stage {stage}, action #{position} {action}: dependency violated: needs {needs} \
         earlier on the same stage ({why})"
    )]
    Dependency {
        /// Stage index.
        stage: usize,
        /// Index in the stage's action list.
        position: usize,
        /// The action that came too early.
        action: Action,
        /// The action that must come before it.
        needs: Action,
        /// The rule that was broken.
        why: &'static str,
    },

    /// A communication action not paired with its compute action (a send before the compute
    /// that produces the tensor, a compute before the receive of its input).
    #[error(
        "stage {stage}, action #{position} {action}: communication not paired: needs {needs} \
         earlier on the same stage"
    )]
    Unpaired {
        /// Stage index.
        stage: usize,
        /// Index in the stage's action list.
        position: usize,
        /// The action missing its partner.
        action: Action,
        /// The partner that must come before it.
        needs: Action,
    },

    /// A receive found a different unit at the head of the channel from its neighbour: the two
    /// stages disagree on the order of messages.
    #[error(
        "stage {stage}, action #{position} {action}: message order mismatch: expects unit {} but \
         the channel from stage {from} holds {found} at its head (sent by stage {from}'s \
         {found_action})",
        .action.unit()
    )]
    ChannelMismatch {
        /// The receiving stage.
        stage: usize,
        /// Index of the receive in its action list.
        position: usize,
        /// The receive.
        action: Action,
        /// The sending neighbour.
        from: usize,
        /// The unit found at the head of the channel.
        found: Unit,
        /// The send that put it there.
        found_action: Action,
    },

    /// A message still in its channel when every stage has finished: sent, never received.
    #[error("stage {from}'s {action} is never received by stage {to}")]
    Undelivered {
        /// The sending stage.
        from: usize,
        /// The stage the message is for.
        to: usize,
        /// The send that put it in the channel.
        action: Action,
    },

    /// A claimed mid-step progress (how many actions each stage has done) that no execution of
    /// the schedule reaches.
    #[error("progress {done:?} (actions done per stage) is not reachable: {reason}")]
    UnreachableProgress {
        /// The claimed progress, the lost stage's entry replaced by what its neighbours prove.
        done: Vec<usize>,
        /// Which stage cannot have done what it claims, and why.
        reason: String,
    },

    /// No stage can progress and some have actions left.
    #[error("deadlock after {steps} steps: no stage can progress ({blocked})\n{grid}")]
    Deadlock {
        /// Simulation steps completed before the deadlock.
        steps: usize,
        /// Which stages wait for what, in words.
        blocked: String,
        /// A step × stage grid of the actions executed so far, blocked cells marked `*..*`.
        grid: String,
    },

    /// Per-segment costs that do not fit the schedule.
    #[error("invalid unit costs: {0}")]
    InvalidCosts(String),

    /// A sequence partition that cannot be made.
    #[error("invalid partition: {0}")]
    InvalidPartition(String),
}
