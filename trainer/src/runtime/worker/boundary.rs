//! A boundary tensor as the worker holds it between a link and the stage: on the host, or (with
//! device links) only its shape, the values staying on the stage's device. Shared by the step's
//! execution and its record of what was sent.

use std::sync::Arc;

use candle_core::Tensor;

/// The document starts of each row of a micro-batch (with document masks), shared by the
/// messages of its units: activations carry them to the stages that read no tokens.
pub(super) type DocStarts = Arc<Vec<Vec<usize>>>;

/// A boundary tensor between a link and the stage.
#[derive(Clone, Debug)]
pub(super) enum Boundary {
    /// On the host (the TCP link carries its values).
    Host(Tensor),
    /// On the device of local chunk `chunk` (received on, or kept for, one of that chunk's
    /// device links): `rows × width` values.
    Device {
        rows: usize,
        width: usize,
        chunk: usize,
    },
}

impl Boundary {
    /// Bytes of its values.
    pub(super) fn bytes(&self) -> usize {
        match self {
            Boundary::Host(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Boundary::Device { rows, width, .. } => rows * width * 4,
        }
    }
}
