//! Softmax cross-entropy over a vocabulary, processed in row chunks so that the `(rows, V)`
//! temporaries stay small for large vocabularies.

use candle_core::{D, Tensor};

use crate::error::Result;
use crate::util::{check_indices, dims2, expect_float, shape_err};

/// Per-chunk results of the shared forward computation.
struct ChunkStats {
    /// `exp(logits - max)`. // (rows, V)
    exp: Tensor,
    /// `sum(exp(logits - max))`. // (rows, 1)
    sum: Tensor,
    /// `-log softmax(logits)[target]` per row. // (rows, 1)
    row_loss: Tensor,
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

/// Rows per chunk; `0` means "all rows in one chunk".
fn effective_chunk(chunk_rows: usize, n: usize) -> usize {
    if chunk_rows == 0 {
        n.max(1)
    } else {
        chunk_rows
    }
}

fn chunk_stats(logits: &Tensor, targets: &Tensor) -> Result<ChunkStats> {
    let max = logits.max_keepdim(D::Minus1)?; // (rows, 1)
    let shifted = logits.broadcast_sub(&max)?; // (rows, V)
    let exp = shifted.exp()?; // (rows, V)
    let sum = exp.sum_keepdim(D::Minus1)?; // (rows, 1)
    let target_shifted = shifted.gather(&targets.unsqueeze(1)?, 1)?; // (rows, 1)
    // -log softmax[target] = log(sum) - (logit[target] - max)
    let row_loss = (sum.log()? - target_shifted)?; // (rows, 1)
    Ok(ChunkStats { exp, sum, row_loss })
}

/// Adds the per-row losses to `total` in row order, in f64.
fn accumulate_loss(total: &mut f64, row_loss: &Tensor) -> Result<()> {
    for l in row_loss
        .flatten_all()?
        .to_dtype(candle_core::DType::F64)?
        .to_vec1::<f64>()?
    {
        *total += l;
    }
    Ok(())
}

/// Cross-entropy of `logits` `(N, V)` against `targets` `(N,)` (U32) and its gradient.
///
/// Returns `(sum over rows of -log softmax(logits)[target], dlogits)` where
/// `dlogits = grad_scale * (softmax(logits) - onehot(targets))` has the shape and dtype of
/// `logits`. The loss is accumulated in f64 in row order, so it does not depend on
/// `chunk_rows` (`0` means a single chunk). Targets must be `< V`.
pub fn cross_entropy_forward_backward(
    logits: &Tensor,
    targets: &Tensor,
    grad_scale: f64,
    chunk_rows: usize,
) -> Result<(f64, Tensor)> {
    const OP: &str = "cross_entropy_forward_backward";
    let (n, v) = validate(logits, targets, OP)?;
    let chunk = effective_chunk(chunk_rows, n);
    let mut total = 0.0f64;
    // Only allocate a separate (N, V) output when there is more than one chunk.
    let out = if n > chunk {
        Some(Tensor::zeros((n, v), logits.dtype(), logits.device())?)
    } else {
        None
    };
    let mut single = None;
    let mut start = 0;
    while start < n {
        let rows = chunk.min(n - start);
        let lg = logits.narrow(0, start, rows)?; // (rows, V)
        let tg = targets.narrow(0, start, rows)?; // (rows,)
        let stats = chunk_stats(&lg, &tg)?;
        accumulate_loss(&mut total, &stats.row_loss)?;
        // grad_scale * softmax = exp * (grad_scale / sum)
        let factor = stats.sum.recip()?.affine(grad_scale, 0.0)?; // (rows, 1)
        let grad = stats.exp.broadcast_mul(&factor)?; // (rows, V)
        let minus =
            Tensor::full(-grad_scale, (rows, 1), logits.device())?.to_dtype(logits.dtype())?; // (rows, 1)
        grad.scatter_add_set(&tg.unsqueeze(1)?, &minus, 1)?;
        match &out {
            Some(out) => out.slice_set(&grad, 0, start)?,
            None => single = Some(grad),
        }
        start += rows;
    }
    let dlogits = match (out, single) {
        (Some(out), _) => out,
        (None, Some(g)) => g,
        // n == 0: empty gradient of the right shape.
        (None, None) => Tensor::zeros((n, v), logits.dtype(), logits.device())?,
    };
    Ok((total, dlogits))
}

/// Forward-only cross-entropy: the sum over rows of `-log softmax(logits)[target]`
/// (accumulated in f64 in row order, independent of `chunk_rows`; `0` means a single chunk).
pub fn cross_entropy_loss(logits: &Tensor, targets: &Tensor, chunk_rows: usize) -> Result<f64> {
    const OP: &str = "cross_entropy_loss";
    let (n, _v) = validate(logits, targets, OP)?;
    let chunk = effective_chunk(chunk_rows, n);
    let mut total = 0.0f64;
    let mut start = 0;
    while start < n {
        let rows = chunk.min(n - start);
        let stats = chunk_stats(
            &logits.narrow(0, start, rows)?,
            &targets.narrow(0, start, rows)?,
        )?;
        accumulate_loss(&mut total, &stats.row_loss)?;
        start += rows;
    }
    Ok(total)
}
