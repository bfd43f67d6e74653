//! One training step's gradient bookkeeping, whatever holds the gradients (named CPU tensors, or
//! one flat device buffer): each micro-batch's own sum (over its segments, in backward order),
//! combined across micro-batches in the canonical summation tree ([`ops::sum_tree`]) over the
//! step's micro-batches 0..m, so the total is bit-identical whichever data-parallel degree split
//! the micro-batches (a replica's chunk is a subtree of the same tree).
//!
//! Micro-batches whose backward completes out of index order are held until their turn (the
//! generated schedules never do that: every kind backwards micro-batches in ascending order, but
//! an edited schedule that passes validation may). The device supplies only how to make a fresh
//! accumulator and how to add two; the order rules, the errors and the peak accounting are here.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;
use std::fmt;

use ops::sum_tree::{SumTree, SumTreeError};

use crate::error::ModelError;
use crate::unit::Unit;

/// The step's gradients of one stage, each a `G` (a micro-batch's accumulator, a partial sum of
/// the tree, or the step's total).
#[derive(Debug)]
pub struct StepGradients<G> {
    /// The step's micro-batch count; `None` before [`StepGradients::begin`].
    micro_batches: Option<usize>,
    /// Gradients of the micro-batches whose backward is under way.
    accumulating: BTreeMap<usize, G>,
    /// Micro-batches whose backward completed before an earlier one's.
    held: BTreeMap<usize, G>,
    tree: Option<SumTree<G>>,
    /// The step's sum, once finished.
    total: Option<G>,
    /// The most full-gradient buffers held at once since [`StepGradients::take_peak_buffers`].
    peak_buffers: usize,
}

impl<G> Default for StepGradients<G> {
    fn default() -> Self {
        Self {
            micro_batches: None,
            accumulating: BTreeMap::new(),
            held: BTreeMap::new(),
            tree: None,
            total: None,
            peak_buffers: 0,
        }
    }
}

/// A tree failure: the device's own add error as it is, a bookkeeping refusal as a model error.
fn tree_error<E: From<ModelError> + fmt::Display>(e: SumTreeError<E>) -> E {
    match e {
        SumTreeError::Add(e) => e,
        other => ModelError::GradientTree(other.to_string()).into(),
    }
}

impl<G> StepGradients<G> {
    /// Starts a step of `micro_batches` micro-batches, forgetting everything of the last one;
    /// returns the buffers it held (for reuse).
    pub fn begin(&mut self, micro_batches: usize) -> Vec<G> {
        let released = self.clear();
        self.micro_batches = Some(micro_batches);
        self.tree = Some(SumTree::new(micro_batches));
        released
    }

    /// Forgets everything: no step is begun. Returns the accumulators, held gradients and total
    /// (for reuse; the tree's partial sums are dropped). The peak measurement goes on.
    pub fn clear(&mut self) -> Vec<G> {
        self.micro_batches = None;
        self.tree = None;
        let mut released: Vec<G> = std::mem::take(&mut self.accumulating)
            .into_values()
            .collect();
        released.extend(std::mem::take(&mut self.held).into_values());
        released.extend(self.total.take());
        released
    }

    /// The accumulator of `unit`'s micro-batch, for a backward of it (made by `fresh` at the
    /// micro-batch's first backward of the step). Errors when no step is begun, the micro-batch
    /// is not one of the step's, or its gradient was already summed.
    pub fn accumulator<E: From<ModelError>>(
        &mut self,
        unit: Unit,
        fresh: impl FnOnce() -> Result<G, E>,
    ) -> Result<&mut G, E> {
        let (Some(m), Some(tree)) = (self.micro_batches, &self.tree) else {
            return Err(ModelError::NoStep.into());
        };
        let i = unit.micro_batch;
        if i >= m {
            return Err(ModelError::Input {
                unit,
                reason: format!(
                    "micro-batch out of range: the step has {m} micro-batches (Stage::begin_step)"
                ),
            }
            .into());
        }
        if self.total.is_some() || i < tree.pushed() || self.held.contains_key(&i) {
            return Err(ModelError::Order {
                unit,
                reason: "the micro-batch's backward already completed this step (its gradient is summed)"
                    .into(),
            }
            .into());
        }
        if let Entry::Vacant(slot) = self.accumulating.entry(i) {
            slot.insert(fresh()?);
            self.peak_buffers = self.peak_buffers.max(self.buffers());
        }
        Ok(self
            .accumulating
            .get_mut(&i)
            .expect("inserted above when absent"))
    }

    /// The backward of `unit`'s micro-batch is complete (segment 0 ran): its gradient joins the
    /// tree, after every earlier micro-batch's, summed by `add(left, right)`.
    pub fn complete<E: From<ModelError> + fmt::Display>(
        &mut self,
        unit: Unit,
        add: &mut impl FnMut(G, G) -> Result<G, E>,
    ) -> Result<(), E> {
        let i = unit.micro_batch;
        let Some(tree) = self.tree.as_mut() else {
            return Err(ModelError::NoStep.into());
        };
        let g = self
            .accumulating
            .remove(&i)
            .ok_or_else(|| ModelError::Order {
                unit,
                reason: "the micro-batch's backward completed, but none of it ran".into(),
            })?;
        self.held.insert(i, g);
        while let Some(g) = self.held.remove(&tree.pushed()) {
            let next = tree.pushed();
            tree.push(next, next + 1, g, add).map_err(tree_error)?;
        }
        Ok(())
    }

    /// Whether the step's sum is known (finished, or set).
    pub fn is_finished(&self) -> bool {
        self.total.is_some()
    }

    /// Sums the tree (idempotent). Errors when no step is begun or a micro-batch's backward has
    /// not completed.
    pub fn finish(&mut self) -> Result<(), ModelError> {
        if self.total.is_some() {
            return Ok(());
        }
        let (Some(m), Some(tree)) = (self.micro_batches, self.tree.take()) else {
            return Err(ModelError::NoStep);
        };
        if tree.pushed() != m || !self.accumulating.is_empty() {
            let completed = tree.pushed() + self.held.len();
            self.tree = Some(tree);
            return Err(ModelError::IncompleteGradients {
                completed,
                micro_batches: m,
            });
        }
        self.total = Some(tree.finish().map_err(tree_error::<ModelError>)?);
        Ok(())
    }

    /// Replaces the step's sum (e.g. with the data-parallel reduction of it).
    pub fn set_total(&mut self, total: G) {
        self.total = Some(total);
    }

    /// The step's sum once finished.
    pub fn total(&self) -> Option<&G> {
        self.total.as_ref()
    }

    /// The step's sum once finished, to be written in place (e.g. by the data-parallel
    /// reduction); [`ModelError::GradientsNotFinished`] before.
    pub fn total_mut(&mut self) -> Result<&mut G, ModelError> {
        self.total.as_mut().ok_or(ModelError::GradientsNotFinished)
    }

    /// Full-gradient buffers held now: the micro-batches under way, those held for their turn,
    /// the tree's partial sums, the finished sum.
    pub fn buffers(&self) -> usize {
        self.accumulating.len()
            + self.held.len()
            + self.tree.as_ref().map_or(0, SumTree::depth)
            + usize::from(self.total.is_some())
    }

    /// The most full-gradient buffers held at once since the last call (measured whenever a
    /// micro-batch's accumulator is created); starts the next measurement from what is held now.
    pub fn take_peak_buffers(&mut self) -> usize {
        let now = self.buffers();
        std::mem::replace(&mut self.peak_buffers, now).max(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gradients as expressions: the sum's text shows the order it was added in.
    fn add(l: String, r: String) -> Result<String, ModelError> {
        Ok(format!("({l}+{r})"))
    }

    /// Runs micro-batch `i`'s backward: its accumulator gets its name, then it completes.
    fn backward(g: &mut StepGradients<String>, i: usize) -> Result<(), ModelError> {
        let unit = Unit::new(i, 0);
        g.accumulator(unit, || Ok::<_, ModelError>(String::new()))?
            .push_str(&format!("g{i}"));
        g.complete(unit, &mut add)
    }

    /// The step's sum is the canonical tree's, whichever order the micro-batches completed in.
    #[test]
    fn the_sum_follows_the_tree_whatever_the_completion_order() {
        let mut in_order = StepGradients::default();
        in_order.begin(4);
        for i in 0..4 {
            backward(&mut in_order, i).unwrap();
        }
        in_order.finish().unwrap();
        let mut shuffled = StepGradients::default();
        shuffled.begin(4);
        for i in [2, 0, 3, 1] {
            backward(&mut shuffled, i).unwrap();
        }
        shuffled.finish().unwrap();
        assert_eq!(in_order.total().unwrap(), "((g0+g1)+(g2+g3))");
        assert_eq!(shuffled.total(), in_order.total());
        // At 1's first backward: 1 accumulating, 2 and 3 held for their turn, 0 in the tree.
        assert_eq!(shuffled.take_peak_buffers(), 4);
        assert_eq!(
            in_order.take_peak_buffers(),
            3,
            "3 accumulating beside (g0+g1) and g2"
        );
        assert_eq!(shuffled.take_peak_buffers(), 1, "the finished sum alone");
    }

    /// Every misuse is a typed refusal naming the unit, never a panic.
    #[test]
    fn out_of_order_units_are_refused() {
        let mut g = StepGradients::<String>::default();
        assert!(matches!(backward(&mut g, 0), Err(ModelError::NoStep)));
        assert!(matches!(g.finish(), Err(ModelError::NoStep)));
        g.begin(2);
        assert!(matches!(
            backward(&mut g, 2),
            Err(ModelError::Input { unit, .. }) if unit == Unit::new(2, 0)
        ));
        backward(&mut g, 0).unwrap();
        assert!(matches!(
            backward(&mut g, 0),
            Err(ModelError::Order { unit, .. }) if unit == Unit::new(0, 0)
        ));
        assert!(matches!(
            g.complete(Unit::new(1, 0), &mut add),
            Err(ModelError::Order { .. })
        ));
        assert!(matches!(
            g.finish(),
            Err(ModelError::IncompleteGradients {
                completed: 1,
                micro_batches: 2
            })
        ));
        assert!(matches!(
            g.total_mut(),
            Err(ModelError::GradientsNotFinished)
        ));
        backward(&mut g, 1).unwrap();
        g.finish().unwrap();
        g.finish().unwrap();
        *g.total_mut().unwrap() = "reduced".into();
        assert_eq!(g.total().unwrap(), "reduced");
        // A new step hands back what the last one held (the total) and starts empty.
        assert_eq!(g.begin(1), vec!["reduced".to_string()]);
        assert!(!g.is_finished());
        assert_eq!(g.buffers(), 0);
    }
}
