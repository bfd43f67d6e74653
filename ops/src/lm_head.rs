//! The language-model head fused with the softmax cross-entropy: `logits = h W^T` is computed a
//! chunk of rows at a time into one reused buffer, turned into its gradient in place, and consumed
//! at once by the head's backward (`dh = dlogits W`, `dW += dlogits^T h`), so the `(N, V)` logits
//! and their gradient never exist in full.

use candle_core::Tensor;

use crate::cpu::{Float, Mat, Threads, View, contiguous, dispatch_float, matmul, tensor};
use crate::cross_entropy::{rows_loss, sum_in_order};
use crate::error::Result;
use crate::memory::SavedTensors;
use crate::util::{check_indices, dims2, expect_float, shape_err};

/// Gradients of [`lm_head_loss_forward_backward`].
#[derive(Clone, Debug)]
pub struct LmHeadGrads {
    /// Gradient of the hidden states. // (N, C)
    pub dh: Tensor,
    /// Gradient of the head's weight. // (V, C)
    pub dw: Tensor,
}

impl SavedTensors for LmHeadGrads {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        f(&self.dh);
        f(&self.dw);
    }
}

fn validate(h: &Tensor, w: &Tensor, targets: &Tensor, op: &str) -> Result<(usize, usize, usize)> {
    let (n, c) = dims2(h, op, "h")?;
    expect_float(h, op, "h")?;
    let (v, wc) = dims2(w, op, "w")?;
    if wc != c {
        return shape_err(format!("{op}: h is (N, {c}) but w is ({v}, {wc})"));
    }
    let nt = check_indices(targets, v, op, "targets")?;
    if nt != n {
        return shape_err(format!(
            "{op}: h has {n} rows but targets have {nt} entries"
        ));
    }
    Ok((n, c, v))
}

/// Loss and gradients of `cross_entropy(h W^T, targets)` for hidden states `h` `(N, C)`, the head's
/// weight `w` `(V, C)` and `targets` `(N,)` (U32, `< V`).
///
/// Returns the sum over rows of `-log softmax(logits)[target]` (f64, in row order: bit-identical
/// to [`crate::cross_entropy_forward_backward`] of the same logits, whatever `chunk_rows`) and the
/// gradients of `grad_scale` times it. `chunk_rows` rows of logits exist at a time (`0`: all).
pub fn lm_head_loss_forward_backward(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    grad_scale: f64,
    chunk_rows: usize,
) -> Result<(f64, LmHeadGrads)> {
    const OP: &str = "lm_head_loss_forward_backward";
    validate(h, w, targets, OP)?;
    let (loss, grads) = dispatch_float!(
        h.dtype(),
        OP,
        run(h, w, targets, Some(grad_scale), chunk_rows)
    )?;
    Ok((loss, grads.expect("asked for the gradients")))
}

/// Forward-only [`lm_head_loss_forward_backward`]: the loss sum, bit-identical to its loss.
pub fn lm_head_loss(h: &Tensor, w: &Tensor, targets: &Tensor, chunk_rows: usize) -> Result<f64> {
    const OP: &str = "lm_head_loss";
    validate(h, w, targets, OP)?;
    dispatch_float!(h.dtype(), OP, run(h, w, targets, None, chunk_rows)).map(|(loss, _)| loss)
}

fn run<T: Float>(
    h: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    grad_scale: Option<f64>,
    chunk_rows: usize,
) -> Result<(f64, Option<LmHeadGrads>)> {
    const OP: &str = "lm_head";
    let (n, c) = h.dims2()?;
    let v = w.dim(0)?;
    let h = contiguous(h, h.dtype(), OP, "h")?;
    let w = contiguous(w, h.dtype(), OP, "w")?;
    let (hv, wv) = (View::new(&h, OP)?, View::new(&w, OP)?);
    let (hs, ws) = (hv.slice::<T>()?, wv.slice::<T>()?);
    let targets = targets.to_vec1::<u32>()?;
    let chunk = if chunk_rows == 0 {
        n.max(1)
    } else {
        chunk_rows
    };
    let mut logits = vec![T::zero(); chunk.min(n) * v]; // (chunk, V)
    let mut losses = Vec::with_capacity(n);
    let mut grads = grad_scale.map(|_| (vec![T::zero(); n * c], vec![T::zero(); v * c]));
    for start in (0..n).step_by(chunk) {
        let rows = chunk.min(n - start);
        let h_chunk = &hs[start * c..(start + rows) * c]; // (rows, C)
        let logits = &mut logits[..rows * v]; // (rows, V)
        matmul(
            logits,
            v,
            false,
            Mat::rows(h_chunk, rows, c, c),
            Mat::transposed(ws, c, v, c),
            Threads::Pool,
        );
        losses.extend(rows_loss(
            logits,
            v,
            &targets[start..start + rows],
            grad_scale.map(T::from_f64),
        ));
        if let Some((dh, dw)) = &mut grads {
            // dh = dlogits · W, dW += dlogits^T · h
            matmul(
                &mut dh[start * c..(start + rows) * c],
                c,
                false,
                Mat::rows(logits, rows, v, v),
                Mat::rows(ws, v, c, c),
                Threads::Pool,
            );
            matmul(
                dw,
                c,
                start > 0,
                Mat::transposed(logits, v, rows, v),
                Mat::rows(h_chunk, rows, c, c),
                Threads::Pool,
            );
        }
    }
    let grads = grads
        .map(|(dh, dw)| {
            Ok::<_, crate::OpsError>(LmHeadGrads {
                dh: tensor(dh, &[n, c])?,
                dw: tensor(dw, &[v, c])?,
            })
        })
        .transpose()?;
    Ok((sum_in_order(&losses), grads))
}
