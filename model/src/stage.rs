//! A pipeline stage's bookkeeping, written once for every device: the segment table (which
//! positions a unit covers), the lifecycle of the micro-batches in flight (made at the first
//! forward, the K/V count moved only by a forward that succeeded, a unit pending between its
//! forward and its backward, the micro-batch gone when segment 0's backward ends or evaluation
//! passes its last segment), the document starts of each micro-batch, and the activation peak
//! with its memory budget. The CPU stage (`trainer::model::Stage`) and the CUDA stage
//! (`gpu::GpuStage`) keep their saved tensors in these types and ask them before they compute, so
//! an order rule or its error is spelled here only.
//!
//! The design: the types are plain data generic over what a device saves — `M`, a micro-batch's
//! caches and saved units (named CPU tensors, or preallocated device buffers that are recycled),
//! and `D`, the device's copy of a micro-batch's document starts (none on the CPU, the per-position
//! starts uploaded once on the GPU). As in llm.c the device owns its activation structs; as in
//! burn or candle the model's rules do not depend on the device. A unit's work borrows its
//! micro-batch by value between [`InFlight::start_forward`] (or [`InFlight::start_backward`])
//! and the matching `finish_*`, so a device may call its own `&mut self` methods while it computes,
//! and a failed unit puts the micro-batch back as it was: the counts move only in `finish_*` with
//! the outcome.
//!
//! A zero-bubble schedule splits a unit's backward in two: its input half `I`
//! ([`InFlight::start_backward_input`]) moves the K/V count like a whole backward and leaves the
//! unit waiting for its weight half `W` ([`InFlight::start_backward_weight`]), which needs what
//! the unit saved (its layers' inputs and output gradients). So a unit is alive from its forward
//! until its `W`, and a micro-batch until the last `W` after segment 0's `I`: its activations are
//! counted, and its gradient completes, only then. The lifecycle refuses `W` before `I`, `W` or
//! `I` twice, and a whole backward among split ones ([`SplitOrder`]).

use std::collections::{BTreeMap, BTreeSet};

use ops::DocumentMask;

use crate::error::{ModelError, SplitOrder};
use crate::order::{check_backward, check_forward};
use crate::unit::Unit;

/// The positions `start..start + len` of every sequence of a micro-batch that a unit covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// First position.
    pub start: usize,
    /// Positions.
    pub len: usize,
}

impl Segment {
    /// One past the last position.
    pub fn end(&self) -> usize {
        self.start + self.len
    }
}

/// How a step's sequences are cut into segments. Every lookup goes through
/// [`Segments::segment`], which takes the unit, so that a micro-batch may later get its own
/// lengths without changing its callers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segments {
    lengths: Vec<usize>,
    starts: Vec<usize>,
}

impl Segments {
    /// Segments of `lengths` positions, in order.
    pub fn new(lengths: Vec<usize>) -> Self {
        let starts = lengths
            .iter()
            .scan(0, |acc, len| {
                let start = *acc;
                *acc += len;
                Some(start)
            })
            .collect();
        Segments { lengths, starts }
    }

    /// The lengths, in order.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// Number of segments of a sequence.
    pub fn count(&self) -> usize {
        self.lengths.len()
    }

    /// Positions of a whole sequence.
    pub fn seq_len(&self) -> usize {
        self.lengths.iter().sum()
    }

    /// The longest segment's positions (0 with none).
    pub fn longest(&self) -> usize {
        self.lengths.iter().copied().max().unwrap_or(0)
    }

    /// The positions `unit` covers; an error naming the unit when its segment is out of range.
    pub fn segment(&self, unit: Unit) -> Result<Segment, ModelError> {
        match self.lengths.get(unit.segment) {
            Some(&len) => Ok(Segment {
                start: self.starts[unit.segment],
                len,
            }),
            None => Err(ModelError::Input {
                unit,
                reason: format!(
                    "segment out of range (the step has {} segments)",
                    self.lengths.len()
                ),
            }),
        }
    }

    /// Whether `unit` is its micro-batch's last segment.
    pub fn is_last(&self, unit: Unit) -> bool {
        unit.segment + 1 == self.lengths.len()
    }
}

/// Whether a forward keeps what backward needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Keep the unit's saved activations for its backward.
    Train,
    /// Forward only (evaluation): nothing is saved for a backward, the K/V prefix lives until
    /// the micro-batch's last segment.
    Eval,
}

/// A micro-batch in flight: the device's state `M` and the model's counts.
#[derive(Debug)]
pub struct MicroBatch<M> {
    /// What the device keeps for the micro-batch (K/V caches, saved units).
    pub state: M,
    /// Positions `0..cached` of every sequence are in the K/V prefix.
    cached: usize,
    /// Segments whose forward ran in training mode and whose backward (or input half) has not.
    pending: BTreeSet<usize>,
    /// Segments whose input half of the backward ran (split backwards).
    split: BTreeSet<usize>,
    /// Segments whose input half ran and whose weight half has not.
    awaiting_weight: BTreeSet<usize>,
}

impl<M> MicroBatch<M> {
    fn new(state: M) -> Self {
        MicroBatch {
            state,
            cached: 0,
            pending: BTreeSet::new(),
            split: BTreeSet::new(),
            awaiting_weight: BTreeSet::new(),
        }
    }

    /// Positions of every sequence in the K/V prefix.
    pub fn cached(&self) -> usize {
        self.cached
    }

    /// Whether any forward of the micro-batch ran (and left K/V or a unit).
    fn began(&self) -> bool {
        self.cached > 0 || !self.pending.is_empty() || !self.awaiting_weight.is_empty()
    }

    /// Segments whose input half ran and whose weight half has not (split backwards).
    pub fn awaiting_weight(&self) -> &BTreeSet<usize> {
        &self.awaiting_weight
    }
}

/// A micro-batch's document starts ([`InFlight::set_documents`]): the mask as given, and the
/// device's copy of it.
#[derive(Debug)]
pub struct Documents<D> {
    /// The rows' document starts.
    pub mask: DocumentMask,
    /// What the device made of them (`()` on the CPU).
    pub device: D,
}

/// A unit's forward under way: its micro-batch taken out of [`InFlight`] until
/// [`InFlight::finish_forward`].
#[derive(Debug)]
pub struct Forward<M> {
    unit: Unit,
    segment: Segment,
    /// The micro-batch (fresh at its first forward).
    pub micro_batch: MicroBatch<M>,
    fresh: bool,
}

/// A unit's backward under way: its micro-batch taken out of [`InFlight`] until
/// [`InFlight::finish_backward`].
#[derive(Debug)]
pub struct Backward<M> {
    unit: Unit,
    segment: Segment,
    /// The micro-batch.
    pub micro_batch: MicroBatch<M>,
}

/// The micro-batches in flight on a stage, their document starts and their own segment lengths.
#[derive(Debug)]
pub struct InFlight<M, D = ()> {
    batches: BTreeMap<usize, MicroBatch<M>>,
    documents: BTreeMap<usize, Documents<D>>,
    /// Micro-batches cut into their own segments ([`InFlight::set_segment_lengths`]: the
    /// document partition); the others use the stage's table.
    lengths: BTreeMap<usize, Segments>,
}

impl<M, D> Default for InFlight<M, D> {
    fn default() -> Self {
        InFlight {
            batches: BTreeMap::new(),
            documents: BTreeMap::new(),
            lengths: BTreeMap::new(),
        }
    }
}

impl<M, D> InFlight<M, D> {
    /// Number of micro-batches with a forward begun and not done.
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    /// Whether no micro-batch is in flight.
    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Whether `micro_batch` is in flight (its forward began and it is not taken out by a unit
    /// under way).
    pub fn contains(&self, micro_batch: usize) -> bool {
        self.batches.contains_key(&micro_batch)
    }

    /// The device state of every micro-batch in flight (not those taken out by a unit under way).
    pub fn states(&self) -> impl Iterator<Item = &M> {
        self.batches.values().map(|mb| &mb.state)
    }

    /// The document starts of `micro_batch`, if set.
    pub fn documents(&self, micro_batch: usize) -> Option<&Documents<D>> {
        self.documents.get(&micro_batch)
    }

    /// Sets the document starts of `micro_batch`, the device's copy made by `upload`. Must come
    /// before the micro-batch's first forward; the same starts again are accepted (every unit's
    /// message carries them), other starts are refused, as are starts for a micro-batch whose
    /// forward began unmasked.
    pub fn set_documents<E: From<ModelError>>(
        &mut self,
        micro_batch: usize,
        mask: DocumentMask,
        upload: impl FnOnce(&DocumentMask) -> Result<D, E>,
    ) -> Result<(), E> {
        let refuse = |reason: &str| {
            Err(ModelError::Order {
                unit: Unit::new(micro_batch, 0),
                reason: reason.into(),
            }
            .into())
        };
        if let Some(held) = self.documents.get(&micro_batch) {
            return if held.mask == mask {
                Ok(())
            } else {
                refuse("other document starts than the micro-batch's forward used")
            };
        }
        if self
            .batches
            .get(&micro_batch)
            .is_some_and(MicroBatch::began)
        {
            return refuse("document starts after the micro-batch's forward began unmasked");
        }
        let device = upload(&mask)?;
        self.documents
            .insert(micro_batch, Documents { mask, device });
        Ok(())
    }

    /// Gives `micro_batch` its own segment lengths instead of the stage's `table` (the document
    /// partition: a pure function of its documents, the same on every stage). Must come before
    /// the micro-batch's first forward; the same lengths again are accepted (every unit sets
    /// them), other lengths are refused, as are lengths whose count or sum differ from the
    /// table's (k segments of the sequence) or that hold an empty segment.
    pub fn set_segment_lengths(
        &mut self,
        micro_batch: usize,
        lengths: Vec<usize>,
        table: &Segments,
    ) -> Result<(), ModelError> {
        let unit = Unit::new(micro_batch, 0);
        let (k, seq_len) = (table.count(), table.seq_len());
        if lengths.len() != k || lengths.iter().sum::<usize>() != seq_len || lengths.contains(&0) {
            return Err(ModelError::Input {
                unit,
                reason: format!(
                    "segment lengths {lengths:?} do not cut the {seq_len}-token sequence into {k} \
                     non-empty segments"
                ),
            });
        }
        if let Some(held) = self.lengths.get(&micro_batch) {
            return if held.lengths() == lengths.as_slice() {
                Ok(())
            } else {
                Err(ModelError::Order {
                    unit,
                    reason: format!(
                        "segment lengths {lengths:?}, but the micro-batch's forward used {:?}",
                        held.lengths()
                    ),
                })
            };
        }
        if self
            .batches
            .get(&micro_batch)
            .is_some_and(MicroBatch::began)
        {
            return Err(ModelError::Order {
                unit,
                reason: "segment lengths after the micro-batch's forward began with the stage's \
                         table"
                    .into(),
            });
        }
        self.lengths.insert(micro_batch, Segments::new(lengths));
        Ok(())
    }

    /// The positions `unit` covers: from its micro-batch's own lengths if it was given them, else
    /// from the stage's `table`. The one lookup of a unit's segment.
    pub fn segment(&self, unit: Unit, table: &Segments) -> Result<Segment, ModelError> {
        self.lengths
            .get(&unit.micro_batch)
            .unwrap_or(table)
            .segment(unit)
    }

    /// Takes out `unit`'s micro-batch for its forward over `segment`, of `rows` sequences (made by
    /// `fresh` at its first forward). Refuses a forward out of segment order (it needs the K/V of
    /// exactly the segments before it) and rows that do not match the micro-batch's document
    /// starts. Give it back with [`InFlight::finish_forward`], whatever the outcome.
    pub fn start_forward<E: From<ModelError>>(
        &mut self,
        unit: Unit,
        segment: Segment,
        rows: usize,
        fresh: impl FnOnce() -> Result<M, E>,
    ) -> Result<Forward<M>, E> {
        if let Some(d) = self
            .documents
            .get(&unit.micro_batch)
            .filter(|d| d.mask.batch() != rows)
        {
            return Err(ModelError::Input {
                unit,
                reason: format!(
                    "the micro-batch has {rows} rows but its document starts {}",
                    d.mask.batch()
                ),
            }
            .into());
        }
        let cached = self
            .batches
            .get(&unit.micro_batch)
            .map_or(0, |mb| mb.cached);
        check_forward(unit, cached, segment.start)?;
        let (micro_batch, fresh) = match self.batches.remove(&unit.micro_batch) {
            Some(mb) => (mb, false),
            None => (MicroBatch::new(fresh()?), true),
        };
        Ok(Forward {
            unit,
            segment,
            micro_batch,
            fresh,
        })
    }

    /// Gives back a forward's micro-batch. With `Some(mode)` (the forward succeeded) its K/V
    /// count moves past the segment and, in training, the unit is pending its backward; an
    /// evaluation of the last segment ends the micro-batch. With `None` (it failed) nothing
    /// moves, and a micro-batch this forward made is dropped. Returns the state of a micro-batch
    /// that left (for the device to recycle).
    pub fn finish_forward(
        &mut self,
        forward: Forward<M>,
        outcome: Option<Mode>,
        segments: &Segments,
    ) -> Option<M> {
        let Forward {
            unit,
            segment,
            mut micro_batch,
            fresh,
        } = forward;
        match outcome {
            None if fresh => return Some(micro_batch.state),
            None => {}
            Some(mode) => {
                micro_batch.cached = segment.end();
                match mode {
                    Mode::Train => {
                        micro_batch.pending.insert(unit.segment);
                    }
                    Mode::Eval if segments.is_last(unit) => {
                        self.documents.remove(&unit.micro_batch);
                        self.lengths.remove(&unit.micro_batch);
                        return Some(micro_batch.state);
                    }
                    Mode::Eval => {}
                }
            }
        }
        self.batches.insert(unit.micro_batch, micro_batch);
        None
    }

    /// Takes out `unit`'s micro-batch for its backward over `segment`. Refuses a backward before
    /// the unit's forward (or twice) and one before every later segment's backward (whose dK/dV
    /// it needs). Give it back with [`InFlight::finish_backward`], whatever the outcome.
    pub fn start_backward(
        &mut self,
        unit: Unit,
        segment: Segment,
    ) -> Result<Backward<M>, ModelError> {
        self.take_for_backward(unit, segment, |mb| {
            (!mb.split.is_empty()).then_some(SplitOrder::WholeAmongSplit)
        })
    }

    /// Takes out `unit`'s micro-batch for the input half of its backward (`I`) over `segment`.
    /// Refuses what [`InFlight::start_backward`] refuses, and an `I` twice
    /// ([`SplitOrder::InputTwice`]). Give it back with [`InFlight::finish_backward_input`].
    pub fn start_backward_input(
        &mut self,
        unit: Unit,
        segment: Segment,
    ) -> Result<Backward<M>, ModelError> {
        self.take_for_backward(unit, segment, |mb| {
            mb.split
                .contains(&unit.segment)
                .then_some(SplitOrder::InputTwice)
        })
    }

    /// Takes out `unit`'s micro-batch for a backward (whole or input half) over `segment`, after
    /// the checks both share — its forward ran, it is still pending, every later segment's
    /// backward ran — with `split` first: the split-order problem of this kind of backward.
    fn take_for_backward(
        &mut self,
        unit: Unit,
        segment: Segment,
        split: impl FnOnce(&MicroBatch<M>) -> Option<SplitOrder>,
    ) -> Result<Backward<M>, ModelError> {
        let Some(mb) = self.batches.get(&unit.micro_batch) else {
            return Err(ModelError::Order {
                unit,
                reason: "backward before forward".into(),
            });
        };
        if let Some(problem) = split(mb) {
            return Err(ModelError::SplitOrder { unit, problem });
        }
        if !mb.pending.contains(&unit.segment) {
            return Err(ModelError::Order {
                unit,
                reason: "backward before forward, or twice".into(),
            });
        }
        check_backward(unit, mb.cached, segment.start, segment.len)?;
        let micro_batch = self
            .batches
            .remove(&unit.micro_batch)
            .expect("looked up above");
        Ok(Backward {
            unit,
            segment,
            micro_batch,
        })
    }

    /// Gives back an input half's micro-batch. With `done` (it succeeded) the unit's positions
    /// leave the K/V count, as after a whole backward, and the unit waits for its weight half;
    /// the micro-batch stays (its units' saved inputs and output gradients are the weight
    /// halves'). A failed input half moves nothing.
    pub fn finish_backward_input(&mut self, backward: Backward<M>, done: bool) {
        let Backward {
            unit,
            segment,
            mut micro_batch,
        } = backward;
        if done {
            micro_batch.pending.remove(&unit.segment);
            micro_batch.split.insert(unit.segment);
            micro_batch.awaiting_weight.insert(unit.segment);
            micro_batch.cached = segment.start;
        }
        self.batches.insert(unit.micro_batch, micro_batch);
    }

    /// Takes out `unit`'s micro-batch for the weight half of its backward (`W`). Refuses a `W`
    /// before the unit's `I` ([`SplitOrder::WeightBeforeInput`]) and a `W` twice
    /// ([`SplitOrder::WeightTwice`]). Give it back with [`InFlight::finish_backward_weight`].
    pub fn start_backward_weight(
        &mut self,
        unit: Unit,
        segment: Segment,
    ) -> Result<Backward<M>, ModelError> {
        let Some(mb) = self.batches.get(&unit.micro_batch) else {
            return Err(ModelError::Order {
                unit,
                reason: "weight half of the backward (W) of a micro-batch not in flight: its \
                         forward never ran, or the weight halves of all its units already ran"
                    .into(),
            });
        };
        let problem = if !mb.split.contains(&unit.segment) {
            Some(SplitOrder::WeightBeforeInput)
        } else if !mb.awaiting_weight.contains(&unit.segment) {
            Some(SplitOrder::WeightTwice)
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(ModelError::SplitOrder { unit, problem });
        }
        let micro_batch = self
            .batches
            .remove(&unit.micro_batch)
            .expect("looked up above");
        Ok(Backward {
            unit,
            segment,
            micro_batch,
        })
    }

    /// Gives back a weight half's micro-batch. With `done` the unit is no longer alive; the
    /// micro-batch ends (its documents too) when segment 0's input half ran and no unit waits
    /// for its weight half any more, and its state is returned (for the device to recycle; the
    /// micro-batch's gradient is then complete). A failed weight half moves nothing.
    pub fn finish_backward_weight(&mut self, backward: Backward<M>, done: bool) -> Option<M> {
        let Backward {
            unit,
            mut micro_batch,
            ..
        } = backward;
        if done {
            micro_batch.awaiting_weight.remove(&unit.segment);
            if micro_batch.awaiting_weight.is_empty()
                && micro_batch.pending.is_empty()
                && micro_batch.cached == 0
            {
                self.documents.remove(&unit.micro_batch);
                self.lengths.remove(&unit.micro_batch);
                return Some(micro_batch.state);
            }
        }
        self.batches.insert(unit.micro_batch, micro_batch);
        None
    }

    /// Gives back a backward's micro-batch. With `done` (the backward succeeded) the unit is no
    /// longer pending and its positions leave the K/V count; segment 0's ends the micro-batch
    /// (its documents too) and returns its state (for the device to recycle; the micro-batch's
    /// gradient is then complete). A failed backward moves nothing.
    pub fn finish_backward(&mut self, backward: Backward<M>, done: bool) -> Option<M> {
        let Backward {
            unit,
            segment,
            mut micro_batch,
        } = backward;
        if done {
            micro_batch.pending.remove(&unit.segment);
            micro_batch.cached = segment.start;
            if unit.segment == 0 {
                self.documents.remove(&unit.micro_batch);
                self.lengths.remove(&unit.micro_batch);
                return Some(micro_batch.state);
            }
        }
        self.batches.insert(unit.micro_batch, micro_batch);
        None
    }

    /// Drops every micro-batch and document (an aborted step); returns the states (for reuse).
    pub fn clear(&mut self) -> Vec<M> {
        self.documents.clear();
        self.lengths.clear();
        std::mem::take(&mut self.batches)
            .into_values()
            .map(|mb| mb.state)
            .collect()
    }
}

/// The most bytes of live activations a stage held, and the budget a forward may not end above.
#[derive(Clone, Debug, Default)]
pub struct ActivationPeak {
    peak: usize,
    budget: Option<usize>,
}

impl ActivationPeak {
    /// Limits what the stage may hold — its training state plus live activations — to `bytes`
    /// (`None`: no limit).
    pub fn set_budget(&mut self, bytes: Option<usize>) {
        self.budget = bytes;
    }

    /// Records `activations` bytes held now.
    pub fn record(&mut self, activations: usize) {
        self.peak = self.peak.max(activations);
    }

    /// Records `activations` bytes held after the forward of `unit`, and refuses them when with
    /// the `state` bytes they exceed the budget.
    pub fn after_forward(
        &mut self,
        unit: Unit,
        activations: usize,
        state: usize,
    ) -> Result<(), ModelError> {
        self.record(activations);
        match self.budget {
            Some(budget) if state + activations > budget => Err(ModelError::OverBudget {
                unit,
                chunks: 1,
                state,
                activations,
                budget,
            }),
            _ => Ok(()),
        }
    }

    /// The most bytes held since the last call (at least `now`, held now); the next measurement
    /// starts from `now`.
    pub fn take(&mut self, now: usize) -> usize {
        std::mem::replace(&mut self.peak, now).max(now)
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    type Flight = InFlight<&'static str, u32>;

    fn segs() -> Segments {
        Segments::new(vec![3, 5])
    }

    fn fwd(f: &mut Flight, unit: Unit, mode: Mode) -> Result<Option<&'static str>, ModelError> {
        let seg = segs().segment(unit)?;
        let w = f.start_forward(unit, seg, 2, || Ok::<_, ModelError>("fresh"))?;
        Ok(f.finish_forward(w, Some(mode), &segs()))
    }

    fn bwd(f: &mut Flight, unit: Unit) -> Result<Option<&'static str>, ModelError> {
        let w = f.start_backward(unit, segs().segment(unit)?)?;
        Ok(f.finish_backward(w, true))
    }

    fn reason(e: ModelError) -> String {
        match e {
            ModelError::Order { reason, .. } | ModelError::Input { reason, .. } => reason,
            other => panic!("not an order or input error: {other}"),
        }
    }

    #[test]
    fn the_segment_table_gives_each_unit_its_positions_and_refuses_others() {
        let s = segs();
        assert_eq!(
            s.segment(Unit::new(7, 1)).unwrap(),
            Segment { start: 3, len: 5 }
        );
        assert_eq!((s.count(), s.seq_len(), s.longest()), (2, 8, 5), "{s:?}");
        assert!(s.is_last(Unit::new(0, 1)) && !s.is_last(Unit::new(0, 0)));
        let e = s.segment(Unit::new(0, 2)).unwrap_err();
        assert!(
            matches!(e, ModelError::Input { unit, .. } if unit == Unit::new(0, 2)),
            "{e}"
        );
        assert!(e.to_string().contains("the step has 2 segments"), "{e}");
    }

    #[test]
    fn a_micro_batch_may_have_its_own_lengths_set_before_its_first_forward_and_kept_to_its_end() {
        let mut f = Flight::default();
        let table = segs();
        let (u0, u1) = (Unit::new(1, 0), Unit::new(1, 1));
        for bad in [vec![8], vec![4, 5], vec![0, 8]] {
            let e = f.set_segment_lengths(1, bad, &table).unwrap_err();
            assert!(reason(e).contains("do not cut the 8-token sequence into 2"));
        }
        f.set_segment_lengths(1, vec![6, 2], &table).unwrap();
        f.set_segment_lengths(1, vec![6, 2], &table).unwrap();
        let e = f.set_segment_lengths(1, vec![2, 6], &table).unwrap_err();
        assert!(reason(e).contains("the micro-batch's forward used [6, 2]"));
        assert_eq!(f.segment(u1, &table).unwrap(), Segment { start: 6, len: 2 });
        assert_eq!(
            f.segment(Unit::new(2, 1), &table).unwrap(),
            Segment { start: 3, len: 5 },
            "the others keep the table"
        );
        // A micro-batch whose forward began with the table cannot switch.
        let seg = f.segment(Unit::new(2, 0), &table).unwrap();
        let w = f
            .start_forward(Unit::new(2, 0), seg, 2, || Ok::<_, ModelError>("b"))
            .unwrap();
        f.finish_forward(w, Some(Mode::Train), &table);
        let e = f.set_segment_lengths(2, vec![6, 2], &table).unwrap_err();
        assert!(reason(e).contains("began with the stage's table"));
        // Its lengths leave with the micro-batch.
        for u in [u0, u1] {
            let w = f
                .start_forward(u, f.segment(u, &table).unwrap(), 2, || {
                    Ok::<_, ModelError>("a")
                })
                .unwrap();
            f.finish_forward(w, Some(Mode::Train), &table);
        }
        for u in [u1, u0] {
            let w = f.start_backward(u, f.segment(u, &table).unwrap()).unwrap();
            f.finish_backward(w, true);
        }
        assert_eq!(f.segment(u1, &table).unwrap(), Segment { start: 3, len: 5 });
    }

    #[test]
    fn a_micro_batch_lives_from_its_first_forward_to_segment_zeros_backward() {
        let mut f = Flight::default();
        let (u0, u1) = (Unit::new(4, 0), Unit::new(4, 1));
        assert_eq!(fwd(&mut f, u0, Mode::Train).unwrap(), None);
        assert_eq!(f.len(), 1);
        assert_eq!(fwd(&mut f, u1, Mode::Train).unwrap(), None);
        assert_eq!(f.states().collect::<Vec<_>>(), [&"fresh"]);
        let e = bwd(&mut f, u0).unwrap_err();
        assert!(reason(e).contains("after the backward of every later segment"));
        assert_eq!(bwd(&mut f, u1).unwrap(), None);
        let e = bwd(&mut f, u1).unwrap_err();
        assert_eq!(reason(e), "backward before forward, or twice");
        assert_eq!(bwd(&mut f, u0).unwrap(), Some("fresh"), "segment 0 ends it");
        assert!(f.is_empty());
        let e = bwd(&mut f, u0).unwrap_err();
        assert_eq!(reason(e), "backward before forward");
    }

    fn input(f: &mut Flight, unit: Unit) -> Result<(), ModelError> {
        let w = f.start_backward_input(unit, segs().segment(unit)?)?;
        f.finish_backward_input(w, true);
        Ok(())
    }

    fn weight(f: &mut Flight, unit: Unit) -> Result<Option<&'static str>, ModelError> {
        let w = f.start_backward_weight(unit, segs().segment(unit)?)?;
        Ok(f.finish_backward_weight(w, true))
    }

    fn split(e: ModelError) -> SplitOrder {
        match e {
            ModelError::SplitOrder { problem, .. } => problem,
            other => panic!("not a split-backward order error: {other}"),
        }
    }

    #[test]
    fn a_split_backward_keeps_its_unit_alive_until_the_weight_half_and_refuses_other_orders() {
        let mut f = Flight::default();
        let (u0, u1) = (Unit::new(2, 0), Unit::new(2, 1));
        fwd(&mut f, u0, Mode::Train).unwrap();
        fwd(&mut f, u1, Mode::Train).unwrap();
        let e = weight(&mut f, u1).unwrap_err();
        assert!(
            e.to_string().contains("(W) before its input half (I)"),
            "{e}"
        );
        assert_eq!(split(e), SplitOrder::WeightBeforeInput);
        // The K/V rule holds for the input halves as for whole backwards.
        assert!(
            reason(input(&mut f, u0).unwrap_err())
                .contains("after the backward of every later segment")
        );
        // A failed input half moves nothing.
        let w = f
            .start_backward_input(u1, segs().segment(u1).unwrap())
            .unwrap();
        f.finish_backward_input(w, false);
        assert_eq!(
            split(weight(&mut f, u1).unwrap_err()),
            SplitOrder::WeightBeforeInput
        );
        input(&mut f, u1).unwrap();
        assert_eq!(
            split(input(&mut f, u1).unwrap_err()),
            SplitOrder::InputTwice
        );
        assert_eq!(
            split(bwd(&mut f, u0).unwrap_err()),
            SplitOrder::WholeAmongSplit
        );
        // Segment 0's input half may run before segment 1's weight half: its K/V count moved.
        input(&mut f, u0).unwrap();
        assert_eq!(f.len(), 1, "the micro-batch lives until its weight halves");
        assert_eq!(weight(&mut f, u1).unwrap(), None);
        assert_eq!(
            split(weight(&mut f, u1).unwrap_err()),
            SplitOrder::WeightTwice
        );
        assert_eq!(
            split(input(&mut f, u1).unwrap_err()),
            SplitOrder::InputTwice
        );
        // A failed weight half moves nothing; the last one ends the micro-batch.
        let w = f
            .start_backward_weight(u0, segs().segment(u0).unwrap())
            .unwrap();
        assert_eq!(f.finish_backward_weight(w, false), None);
        assert_eq!(weight(&mut f, u0).unwrap(), Some("fresh"));
        assert!(f.is_empty());
        assert!(matches!(
            weight(&mut f, u0).unwrap_err(),
            ModelError::Order { .. }
        ));
    }

    #[test]
    fn forwards_run_in_segment_order_and_only_a_success_moves_the_counts() {
        let mut f = Flight::default();
        let (u0, u1) = (Unit::new(0, 0), Unit::new(0, 1));
        assert!(
            reason(fwd(&mut f, u1, Mode::Train).unwrap_err())
                .contains("segments must run in order")
        );
        assert!(f.is_empty(), "a refused forward makes no micro-batch");
        // A failed first forward drops what it made; a failed later one keeps the micro-batch as it was.
        let w = f
            .start_forward(u0, segs().segment(u0).unwrap(), 2, || {
                Ok::<_, ModelError>("a")
            })
            .unwrap();
        assert_eq!(f.finish_forward(w, None, &segs()), Some("a"));
        assert!(f.is_empty());
        fwd(&mut f, u0, Mode::Train).unwrap();
        let w = f
            .start_forward(u1, segs().segment(u1).unwrap(), 2, || {
                Ok::<_, ModelError>("b")
            })
            .unwrap();
        assert_eq!(w.micro_batch.cached(), 3);
        assert_eq!(f.finish_forward(w, None, &segs()), None);
        assert!(
            bwd(&mut f, u1).is_err(),
            "the failed forward left no pending unit"
        );
        assert!(fwd(&mut f, u0, Mode::Train).is_err(), "segment 0 twice");
        fwd(&mut f, u1, Mode::Train).unwrap();
        // A failed backward moves nothing either.
        let w = f.start_backward(u1, segs().segment(u1).unwrap()).unwrap();
        assert_eq!(f.finish_backward(w, false), None);
        assert_eq!(bwd(&mut f, u1).unwrap(), None);
    }

    #[test]
    fn evaluation_keeps_no_unit_and_ends_after_the_last_segment() {
        let mut f = Flight::default();
        let (u0, u1) = (Unit::new(1, 0), Unit::new(1, 1));
        f.set_documents(
            1,
            DocumentMask::new(vec![vec![0], vec![0, 2]]).unwrap(),
            |_| Ok::<_, ModelError>(9),
        )
        .unwrap();
        assert_eq!(fwd(&mut f, u0, Mode::Eval).unwrap(), None);
        assert_eq!(
            reason(bwd(&mut f, u0).unwrap_err()),
            "backward before forward, or twice"
        );
        assert_eq!(fwd(&mut f, u1, Mode::Eval).unwrap(), Some("fresh"));
        assert!(f.is_empty() && f.documents(1).is_none());
    }

    #[test]
    fn documents_come_before_the_first_forward_once_and_fit_its_rows() {
        let mask = |rows: Vec<Vec<usize>>| DocumentMask::new(rows).unwrap();
        let mut f = Flight::default();
        let up = |_: &DocumentMask| Ok::<_, ModelError>(7);
        f.set_documents(0, mask(vec![vec![0, 4], vec![0]]), up)
            .unwrap();
        f.set_documents(
            0,
            mask(vec![vec![0, 4], vec![0]]),
            |_| -> Result<u32, ModelError> { panic!("the same starts are not uploaded again") },
        )
        .unwrap();
        assert_eq!(f.documents(0).unwrap().device, 7);
        let e = f
            .set_documents(0, mask(vec![vec![0, 5], vec![0]]), up)
            .unwrap_err();
        assert!(reason(e).contains("other document starts"));
        // Rows other than the starts' are refused at the forward.
        f.set_documents(3, mask(vec![vec![0]]), up).unwrap();
        let u = Unit::new(3, 0);
        let e = f
            .start_forward(u, segs().segment(u).unwrap(), 2, || {
                Ok::<_, ModelError>("x")
            })
            .unwrap_err();
        assert!(reason(e).contains("has 2 rows but its document starts 1"));
        // Starts after an unmasked forward began are refused.
        fwd(&mut f, Unit::new(2, 0), Mode::Eval).unwrap();
        let e = f
            .set_documents(2, mask(vec![vec![0], vec![0]]), up)
            .unwrap_err();
        assert!(reason(e).contains("began unmasked"));
        // Segment 0's backward forgets them; clearing forgets everything.
        fwd(&mut f, Unit::new(0, 0), Mode::Train).unwrap();
        bwd(&mut f, Unit::new(0, 0)).unwrap();
        assert!(f.documents(0).is_none());
        assert_eq!(f.clear(), vec!["fresh"]);
        assert!(f.documents(3).is_none() && f.is_empty());
    }

    #[test]
    fn the_peak_is_the_most_held_and_a_forward_over_budget_is_refused() {
        let mut p = ActivationPeak::default();
        p.record(10);
        p.record(4);
        assert_eq!(p.take(4), 10);
        assert_eq!(p.take(6), 6, "at least what is held now");
        p.set_budget(Some(100));
        p.after_forward(Unit::new(0, 0), 60, 40).unwrap();
        let e = p.after_forward(Unit::new(0, 1), 61, 40).unwrap_err();
        assert!(
            matches!(
                e,
                ModelError::OverBudget {
                    activations: 61,
                    state: 40,
                    budget: 100,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(p.take(0), 61, "the refused forward is in the peak");
    }
}
