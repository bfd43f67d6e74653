//! Softmax cross-entropy over a vocabulary, one fused pass per row: the row maximum, the
//! exponentials and their sum, the loss, and the gradient written over the row in place.
//! [`crate::lm_head`] runs the same rows on chunks of logits it computes from the hidden states.

use candle_core::Tensor;
use rayon::prelude::*;

use crate::cpu::{
    Float, View, contiguous, dispatch_float, lane_max, lane_sum, lane_sum_by, tensor,
};
use crate::error::Result;
use crate::util::{check_indices, dims2, expect_float, shape_err};

/// The largest logit of a row.
#[inline]
fn row_max<T: Float>(row: &[T]) -> T {
    lane_max(row)
}

/// `-log softmax(row)[target] = log(sum) - (row[target] - max)`.
#[inline]
fn row_loss<T: Float>(target_logit: T, max: T, sum: T) -> T {
    sum.ln() - (target_logit - max)
}

/// Per-row losses of `logits` `(rows, V)` (row-major); with `grad_scale`, overwrites every row with
/// `grad_scale * (softmax(row) - onehot(target))`. The losses are identical with and without the
/// gradient. Rows run in parallel; every row is computed by one thread.
pub(crate) fn rows_loss<T: Float>(
    logits: &mut [T],
    v: usize,
    targets: &[u32],
    grad_scale: Option<T>,
) -> Vec<f64> {
    let mut losses = vec![0.0f64; targets.len()];
    if v == 0 {
        return losses;
    }
    logits
        .par_chunks_mut(v)
        .zip(losses.par_iter_mut())
        .zip(targets.par_iter())
        .for_each(|((row, loss), &target)| {
            let target = target as usize;
            let target_logit = row[target];
            let max = row_max(row);
            let Some(scale) = grad_scale else {
                let sum = lane_sum_by(row, |l| (l - max).exp_fast());
                *loss = row_loss(target_logit, max, sum).to_f64();
                return;
            };
            // The same sum as without the gradient, keeping the exponentials.
            row.iter_mut().for_each(|l| *l = (*l - max).exp_fast());
            let sum = lane_sum(row);
            *loss = row_loss(target_logit, max, sum).to_f64();
            let factor = scale / sum;
            row.iter_mut().for_each(|e| *e *= factor);
            row[target] -= scale;
        });
    losses
}

/// Adds per-row losses in row order, in f64.
pub(crate) fn sum_in_order(losses: &[f64]) -> f64 {
    losses.iter().fold(0.0, |acc, &l| acc + l)
}

fn validate(logits: &Tensor, targets: &Tensor, op: &str) -> Result<(usize, usize)> {
    let (n, v) = dims2(logits, op, "logits")?;
    expect_float(logits, op, "logits")?;
    let nt = check_indices(targets, v, op, "targets")?;
    if nt != n {
        return shape_err(format!(
            "{op}: logits have {n} rows but targets have {nt} entries"
        ));
    }
    Ok((n, v))
}

/// Cross-entropy of `logits` `(N, V)` against `targets` `(N,)` (U32) and its gradient.
///
/// Returns `(sum over rows of -log softmax(logits)[target], dlogits)` where
/// `dlogits = grad_scale * (softmax(logits) - onehot(targets))` has the shape and dtype of
/// `logits`. The loss is accumulated in f64 in row order. Targets must be `< V`.
pub fn cross_entropy_forward_backward(
    logits: &Tensor,
    targets: &Tensor,
    grad_scale: f64,
) -> Result<(f64, Tensor)> {
    const OP: &str = "cross_entropy_forward_backward";
    validate(logits, targets, OP)?;
    dispatch_float!(
        logits.dtype(),
        OP,
        logits_loss(logits, targets, Some(grad_scale))
    )
    .map(|(loss, d)| (loss, d.expect("asked for the gradient")))
}

/// Forward-only cross-entropy: the sum over rows of `-log softmax(logits)[target]`, accumulated in
/// f64 in row order (bit-identical to the loss of [`cross_entropy_forward_backward`]).
pub fn cross_entropy_loss(logits: &Tensor, targets: &Tensor) -> Result<f64> {
    const OP: &str = "cross_entropy_loss";
    validate(logits, targets, OP)?;
    dispatch_float!(logits.dtype(), OP, logits_loss(logits, targets, None)).map(|(loss, _)| loss)
}

fn logits_loss<T: Float>(
    logits: &Tensor,
    targets: &Tensor,
    grad_scale: Option<f64>,
) -> Result<(f64, Option<Tensor>)> {
    const OP: &str = "cross_entropy";
    let (n, v) = logits.dims2()?;
    let logits = contiguous(logits, logits.dtype(), OP, "logits")?;
    let mut rows = View::new(&logits, OP)?.slice::<T>()?.to_vec(); // (N, V)
    let targets = targets.to_vec1::<u32>()?;
    let losses = rows_loss(&mut rows, v, &targets, grad_scale.map(T::from_f64));
    let grad = grad_scale.map(|_| tensor(rows, &[n, v])).transpose()?;
    Ok((sum_in_order(&losses), grad))
}
