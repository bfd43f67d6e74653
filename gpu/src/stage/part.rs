//! Which backward a GPU unit runs — whole, or the input or the weight half of a split backward
//! (`seq1f1b-zb`) — and what each starts from and adds to; shared by the unit and its blocks.

use super::{Dy, order};
use crate::error::Result;

/// The operation named in the order errors of a backward.
const OP_BWD: &str = "GpuStage::backward";

/// Which backward a unit runs, and what it starts from and adds to.
#[derive(Clone, Copy)]
pub(super) enum Part<'s> {
    /// A whole backward from `d_out`, adding to the micro-batch's flat gradient buffer `acc`.
    Whole { d_out: Dy<'s>, acc: u64 },
    /// The input half of a split backward from `d_out`: no parameter gradient is added; what the
    /// weight half reads is kept in the unit's buffers.
    Input { d_out: Dy<'s> },
    /// The weight half of a split backward, adding to `acc` from what the input half kept.
    Weight { acc: u64 },
}

impl<'s> Part<'s> {
    /// Whether the backward is split (its weight half runs apart from its input half).
    pub(super) fn split(&self) -> bool {
        !matches!(self, Part::Whole { .. })
    }

    /// The micro-batch's flat gradient buffer; refused in an input half, which adds no parameter
    /// gradient.
    pub(super) fn acc(&self) -> Result<u64> {
        match *self {
            Part::Whole { acc, .. } | Part::Weight { acc } => Ok(acc),
            Part::Input { .. } => Err(order(
                OP_BWD,
                "a parameter gradient in the input half of a split backward",
            )),
        }
    }

    /// The gradient the backward starts from; refused in a weight half, which receives none.
    pub(super) fn d_out(&self) -> Result<Dy<'s>> {
        match *self {
            Part::Whole { d_out, .. } | Part::Input { d_out } => Ok(d_out),
            Part::Weight { .. } => Err(order(
                OP_BWD,
                "the weight half of a split backward receives no gradient",
            )),
        }
    }
}
