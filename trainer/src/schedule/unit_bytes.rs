//! The byte model of a step's activations: what one unit keeps alive on each stage, from its
//! forward until its backward (or its weight half) frees it.
//!
//! A stage's activation bytes at any moment are the sum of its live units' sizes, and a unit's
//! size depends on the stage (how many layers it holds; the last stage also keeps the head's
//! logits and their gradient) and on the segment (how many tokens it covers). The model is
//! additive and per segment, not per micro-batch: the schedule must be a pure function of the
//! config, and per-micro-batch segment lengths (the document partition) are data. Where they
//! vary, the config's model sizes every segment at the longest one may get (an upper bound).
//! [`crate::memory::unit_bytes`] derives it from a config; [`super::generate_within`] caps
//! `seq1f1b-zb` by it; [`super::Simulation::peak_bytes`] counts a simulated timeline in it.

use super::{Action, Op, ScheduleError, Unit};

/// Bytes one unit of segment j keeps alive on stage r: `of(r, j)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitBytes {
    /// `per_stage[r][j]`: stage r, segment j.
    per_stage: Vec<Vec<u64>>,
}

impl UnitBytes {
    /// The model with `per_stage[r][j]` bytes for a unit of segment j on stage r. Errors with
    /// [`ScheduleError::InvalidParameters`] when there is no stage, no segment, or the stages
    /// disagree on the number of segments.
    pub fn new(per_stage: Vec<Vec<u64>>) -> Result<Self, ScheduleError> {
        let splits = per_stage.first().map_or(0, Vec::len);
        if splits == 0 {
            return Err(ScheduleError::InvalidParameters(
                "a unit byte model needs at least one stage and one segment (got none)".into(),
            ));
        }
        if let Some((r, row)) = per_stage
            .iter()
            .enumerate()
            .find(|(_, row)| row.len() != splits)
        {
            return Err(ScheduleError::InvalidParameters(format!(
                "unit byte model: stage {r} sizes {} segments, stage 0 {splits}; give every \
                 stage one size per segment",
                row.len()
            )));
        }
        Ok(Self { per_stage })
    }

    /// Every unit on every stage the same `bytes` (`stages` × `splits`).
    pub fn uniform(stages: usize, splits: usize, bytes: u64) -> Result<Self, ScheduleError> {
        Self::new(vec![vec![bytes; splits]; stages])
    }

    /// Stages the model sizes.
    pub fn stages(&self) -> usize {
        self.per_stage.len()
    }

    /// Segments per micro-batch the model sizes.
    pub fn splits(&self) -> usize {
        self.per_stage[0].len()
    }

    /// Bytes unit `u` keeps alive on stage `r`.
    pub fn of(&self, r: usize, u: Unit) -> u64 {
        self.per_stage[r][u.segment]
    }

    /// Errors unless the model sizes `stages` stages and `splits` segments.
    pub(crate) fn check_shape(&self, stages: usize, splits: usize) -> Result<(), ScheduleError> {
        if (self.stages(), self.splits()) == (stages, splits) {
            return Ok(());
        }
        Err(ScheduleError::InvalidParameters(format!(
            "the unit byte model sizes {} stages × {} segments, the schedule has {stages} × \
             {splits}; derive the model from the same config",
            self.stages(),
            self.splits()
        )))
    }

    /// The most bytes stage `r` holds along its own action list `order` (one chunk per stage):
    /// `F` allocates its unit, `B` or `W` frees it. A stage runs one action at a time, so this is
    /// its peak in every execution.
    pub(crate) fn peak_along(&self, r: usize, order: &[Action]) -> u64 {
        let (mut live, mut peak) = (0u64, 0u64);
        for a in order.iter().filter(|a| a.is_compute()) {
            let size = self.of(r, a.unit());
            match a.op() {
                Op::Forward => live = live.saturating_add(size),
                Op::Backward | Op::BackwardWeight => live = live.saturating_sub(size),
                _ => {}
            }
            peak = peak.max(live);
        }
        peak
    }

    /// The job's peak of a schedule whose stages' action lists are `actions`: the most any of
    /// its stages holds.
    pub(crate) fn job_peak(&self, actions: &[Vec<Action>]) -> u64 {
        actions
            .iter()
            .enumerate()
            .map(|(r, order)| self.peak_along(r, order))
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_checked_with_the_reason() {
        let e = UnitBytes::new(vec![]).unwrap_err().to_string();
        assert!(e.contains("at least one stage"), "{e}");
        let e = UnitBytes::new(vec![vec![1, 2], vec![3]])
            .unwrap_err()
            .to_string();
        assert!(e.contains("stage 1 sizes 1 segments"), "{e}");
        let b = UnitBytes::uniform(3, 2, 7).unwrap();
        assert_eq!(
            (b.stages(), b.splits(), b.of(2, Unit::new(5, 1))),
            (3, 2, 7)
        );
        let e = b.check_shape(4, 2).unwrap_err().to_string();
        assert!(e.contains("3 stages × 2 segments"), "{e}");
    }
}
