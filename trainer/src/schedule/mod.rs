//! Pipeline schedules as data: GPipe, 1F1B and Seq1F1B (arXiv 2406.03488), the interleaved
//! 1F1B-I and Seq1F1B-I (v layer chunks per worker), and a zero-bubble Seq1F1B whose backwards
//! are split into an input half and a weight half.
//!
//! A step's work is m·k *units* — micro-batch i, sequence segment j. A [`Schedule`] is one
//! ordered [`Action`] list per stage (compute and communication), which can be printed
//! ([`render_text`]), saved and loaded (serde, actions as strings like `"RF0.1"`), dry-run
//! ([`validate`]), timed ([`simulate`], or [`replay`] with measured unit times) and drawn ([`render_svg`], [`report_json`]). When a stage
//! is lost mid-step, [`resume_after_loss`] gives the rest of the step (the recovery protocol as
//! data) and [`validate_resumed`] dry-runs it from the state the loss left.
//!
//! Invariant kept by every generator: on every stage and chunk the backward units run in the same
//! order — micro-batch ascending, segment descending — whatever the kind and the stage count, and
//! a split backward's weight halves run in the order of its input halves, so the order in which
//! parameter gradients accumulate never depends on the pipeline partition or the schedule.
//!
//! The stage runtime runs `gpipe`, `1f1b` and `seq1f1b`, and the interleaved `1f1b-i` and
//! `seq1f1b-i` and the zero-bubble `seq1f1b-zb` ([`ScheduleKind::splits_backward`]) on CPU
//! stages over TCP.
//!
//! How short a split-backward step can be at Seq1F1B's memory per worker, whatever the order,
//! is [`split_backward_bound`]; `seq1f1b-zb` holds up to the job's Seq1F1B peak on every stage,
//! ZB-H1's rule, and goes below it to ZB-H1's step. Given the run's [`UnitBytes`] (what a unit
//! keeps on each stage), [`generate_within`] caps it at Seq1F1B's job peak of activation bytes
//! too, not only of live units.
//!
//! Segment lengths (equal, or equal-FLOPs per the paper) live in [`segments`]; the
//! document-aware partition (equal cost under document masks, per micro-batch) in
//! [`doc_segments`]; which of them a step uses, per micro-batch, is its [`SegmentRule`].
//!
//! ```
//! use trainer::schedule::{ScheduleKind, generate, render_text, validate};
//! let s = generate(ScheduleKind::Seq1F1B, 4, 3, 2).unwrap();
//! validate(&s).unwrap();
//! assert!(render_text(&s).starts_with("stage 0: F0.0 F0.1 F1.0 F1.1 F2.0 B0.1 F2.1 B0.0"));
//! ```
//!
//! The module is pure: no tensors, no IO.

mod action;
mod bound;
pub mod doc_segments;
mod error;
mod generate;
mod parse;
mod render;
mod resume;
mod segment_rule;
pub mod segments;
mod simulate;
mod unit_bytes;
mod validate;

pub use action::{Action, Op, ScheduleKind, Unit};
pub use bound::split_backward_bound;
pub use error::ScheduleError;
pub use generate::{Schedule, generate, generate_forward_only, generate_virtual, generate_within};
pub use render::{render_svg, render_text, report_json};
pub use resume::{
    Delivered, LostOutput, NeighbourRelink, ResumedStep, neighbour_relink, neighbours_of,
    resume_after_loss, validate_resumed,
};
pub use segment_rule::SegmentRule;
pub use segments::{
    FlopsModel, Partition, segment_flops, segment_lengths, solve_compute_partition,
};
pub use simulate::{
    MeasuredCosts, Simulation, Slot, StageStats, UnitCosts, formula_bubble, replay, simulate,
};
pub use unit_bytes::UnitBytes;
pub use validate::validate;
