//! The unit a stage computes: one (micro-batch, segment) of a Seq1F1B step. Its text form is read
//! back by the schedule vocabulary (`trainer::schedule`), which owns the parse errors.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One schedulable unit: micro-batch `micro_batch`, sequence segment `segment`.
///
/// Ordering is lexicographic (micro-batch, then segment), which is the forward order. Text form
/// is `"i.j"`, e.g. `"0.1"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Unit {
    /// Micro-batch index within the step, `0..m`.
    pub micro_batch: usize,
    /// Segment index within the micro-batch's sequence, `0..k`.
    pub segment: usize,
}

impl Unit {
    /// The unit (micro-batch `micro_batch`, segment `segment`).
    pub fn new(micro_batch: usize, segment: usize) -> Self {
        Unit {
            micro_batch,
            segment,
        }
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.micro_batch, self.segment)
    }
}
