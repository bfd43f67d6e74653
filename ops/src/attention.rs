//! Causal attention of a query segment over a key/value prefix (Seq1F1B).
//!
//! The queries `q` `(B, H, s, D)` belong to positions `P..P+s` of a sequence; `k`, `v`
//! `(B, H, P+s, D)` hold the keys/values of all positions `0..P+s` (the cached prefix of the
//! earlier segments followed by this segment's own). Query `t` (0-based within the segment)
//! attends keys `0..=P+t`, i.e. the causal mask is aligned to the bottom-right corner of the
//! `(s, P+s)` score matrix. With `P = 0` this is ordinary causal self-attention.
//!
//! Both passes run over blocks of [`Q_BLOCK`] queries: a block's scores against the keys it may see
//! (`0..P+t1` for queries `t0..t1`: the causal triangle's far side is skipped) are computed into a
//! `(Q_BLOCK, P+t1)` buffer with one gemm, softmaxed row by row in place, and multiplied by the
//! values; the `(s, P+s)` score matrix never exists in full. The backward recomputes each block's
//! probabilities from `q`, `k` and the saved log-sum-exp (flash-attention style) and accumulates
//! dK/dV over the query blocks in order. Forward blocks run in parallel; the backward runs the
//! (batch, head) pairs in parallel; either way the arithmetic does not depend on the thread count.

use candle_core::Tensor;
use rayon::prelude::*;

use crate::cpu::{
    Float, Mat, Threads, View, contiguous, dispatch_float, lane_max, lane_sum, matmul, tensor,
};
use crate::error::Result;
use crate::memory::SavedTensors;
use crate::util::{dims4, expect_float, shape_err};

/// Queries per block.
const Q_BLOCK: usize = 64;

/// Saved state of [`causal_prefix_attention_forward`]. `k` and `v` are not stored: the caller
/// keeps them (they are its key/value cache) and passes them to the backward.
#[derive(Clone, Debug)]
pub struct AttentionCtx {
    /// The queries. // (B, H, s, D)
    pub q: Tensor,
    /// The attention output. // (B, H, s, D)
    pub out: Tensor,
    /// Log-sum-exp over keys of the scaled, masked scores of each query. // (B, H, s, 1)
    pub lse: Tensor,
}

impl SavedTensors for AttentionCtx {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        f(&self.q);
        f(&self.out);
        f(&self.lse);
    }
}

/// Checks the shapes and returns `(b, h, s, p, d)`.
fn check(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    op: &str,
) -> Result<(usize, usize, usize, usize, usize)> {
    let (b, h, s, d) = dims4(q, op, "q")?;
    expect_float(q, op, "q")?;
    let (kb, kh, l, kd) = dims4(k, op, "k")?;
    if (kb, kh, kd) != (b, h, d) || l < s {
        return shape_err(format!(
            "{op}: q is {:?} so k must be ({b}, {h}, P+{s}, {d}) with P >= 0, got {:?}",
            q.dims(),
            k.dims()
        ));
    }
    if v.dims() != k.dims() {
        return shape_err(format!(
            "{op}: v must have the shape of k {:?}, got {:?}",
            k.dims(),
            v.dims()
        ));
    }
    Ok((b, h, s, l - s, d))
}

/// Forward of causal prefix attention: `out = softmax(scale * q k^T + mask) v`.
///
/// `q` `(B, H, s, D)`, `k`/`v` `(B, H, P+s, D)`; returns `out` `(B, H, s, D)` and the context.
pub fn causal_prefix_attention_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
) -> Result<(Tensor, AttentionCtx)> {
    const OP: &str = "causal_prefix_attention_forward";
    let (b, h, s, p, d) = check(q, k, v, OP)?;
    let dtype = q.dtype();
    let (q, k, v) = (
        contiguous(q, dtype, OP, "q")?,
        contiguous(k, dtype, OP, "k")?,
        contiguous(v, dtype, OP, "v")?,
    );
    let shape = Shape { b, h, s, p, d };
    let (out, lse) = dispatch_float!(dtype, OP, forward(&q, &k, &v, scale, shape))?;
    Ok((out.clone(), AttentionCtx { q, out, lse }))
}

/// `(B, H, s, P, D)` of one call.
#[derive(Clone, Copy)]
struct Shape {
    b: usize,
    h: usize,
    s: usize,
    p: usize,
    d: usize,
}

impl Shape {
    /// Keys per (batch, head): `P + s`.
    fn l(&self) -> usize {
        self.p + self.s
    }
}

/// Query block `t0..t1` of a segment with prefix `p`: keys `0..p + t1` are visible to some query.
fn block(t0: usize, s: usize, p: usize) -> (usize, usize, usize) {
    let t1 = (t0 + Q_BLOCK).min(s);
    (t0, t1, p + t1)
}

/// The first `len` elements of `scratch`, grown (with zeros) when it is shorter; old contents stay.
fn reuse<T: Float>(scratch: &mut Vec<T>, len: usize) -> &mut [T] {
    if scratch.len() < len {
        scratch.resize(len, T::zero());
    }
    &mut scratch[..len]
}

/// Scores of queries `q_blk` `(nb, D)` against keys `k` `(lk, D)` into `scores` `(nb, lk)`.
fn block_scores<T: Float>(scores: &mut [T], q_blk: &[T], k: &[T], nb: usize, lk: usize, d: usize) {
    matmul(
        scores,
        lk,
        false,
        Mat::rows(q_blk, nb, d, d),
        Mat::transposed(k, d, lk, d),
        Threads::One,
    );
}

fn forward<T: Float>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    sh: Shape,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "causal_prefix_attention_forward";
    let Shape { b, h, s, p, d } = sh;
    let l = sh.l();
    let (qv, kv, vv) = (View::new(q, OP)?, View::new(k, OP)?, View::new(v, OP)?);
    let (qs, ks, vs) = (qv.slice::<T>()?, kv.slice::<T>()?, vv.slice::<T>()?);
    let scale = T::from_f64(scale);
    let mut out = vec![T::zero(); b * h * s * d]; // (B, H, s, D)
    let mut lse = vec![T::zero(); b * h * s]; // (B, H, s)
    if s > 0 {
        out.par_chunks_mut(s * d)
            .zip(lse.par_chunks_mut(s))
            .enumerate()
            .for_each(|(bh, (out, lse))| {
                let (q, k, v) = (
                    &qs[bh * s * d..(bh + 1) * s * d],
                    &ks[bh * l * d..(bh + 1) * l * d],
                    &vs[bh * l * d..(bh + 1) * l * d],
                );
                out.par_chunks_mut(Q_BLOCK * d)
                    .zip(lse.par_chunks_mut(Q_BLOCK))
                    .enumerate()
                    // One score buffer per task, reused by its blocks: the gemm overwrites
                    // every entry it is given, so it is never cleared.
                    .for_each_init(Vec::new, |scratch, (blk, (out, lse))| {
                        let (t0, t1, lk) = block(blk * Q_BLOCK, s, p);
                        let nb = t1 - t0;
                        let probs = reuse(scratch, nb * lk); // (nb, lk)
                        block_scores(probs, &q[t0 * d..t1 * d], k, nb, lk, d);
                        for (i, row) in probs.chunks_mut(lk).enumerate() {
                            let visible = p + t0 + i + 1;
                            let (seen, masked) = row.split_at_mut(visible);
                            let max = lane_max(seen) * scale;
                            // The exponentials first, then their sum in lanes: both loops
                            // vectorize (a running sum would serialize the exponentials).
                            seen.iter_mut()
                                .for_each(|x| *x = (*x * scale - max).exp_fast());
                            let sum = lane_sum(seen);
                            let inv = T::one() / sum;
                            seen.iter_mut().for_each(|x| *x *= inv);
                            masked.fill(T::zero());
                            lse[i] = max + sum.ln();
                        }
                        matmul(
                            out,
                            d,
                            false,
                            Mat::rows(probs, nb, lk, lk),
                            Mat::rows(v, lk, d, d),
                            Threads::One,
                        );
                    });
            });
    }
    Ok((tensor(out, &[b, h, s, d])?, tensor(lse, &[b, h, s, 1])?))
}

/// Backward of [`causal_prefix_attention_forward`].
///
/// Recomputes `probs = exp(scores - lse)` exactly, then
/// `dv = probs^T dout`, `dprobs = dout v^T`, `ds = probs * (dprobs - sum(dout * out))`,
/// `dq = scale * ds k`, `dk = scale * ds^T q`.
/// Returns `(dq (B, H, s, D), dk (B, H, P+s, D), dv (B, H, P+s, D))`; `dk`/`dv` rows `0..P` are the
/// contributions of this segment's queries to the prefix keys/values.
pub fn causal_prefix_attention_backward(
    ctx: &AttentionCtx,
    k: &Tensor,
    v: &Tensor,
    d_out: &Tensor,
    scale: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "causal_prefix_attention_backward";
    let q = &ctx.q;
    let (b, h, s, p, d) = check(q, k, v, OP)?;
    let dtype = q.dtype();
    let (q, k, v, d_out) = (
        &contiguous(q, dtype, OP, "ctx.q")?,
        &contiguous(k, dtype, OP, "k")?,
        &contiguous(v, dtype, OP, "v")?,
        &contiguous(d_out, dtype, OP, "d_out")?,
    );
    if d_out.dims() != [b, h, s, d] || ctx.out.dims() != [b, h, s, d] {
        return shape_err(format!(
            "{OP}: d_out {:?} and ctx.out {:?} must have the shape of q {:?}",
            d_out.dims(),
            ctx.out.dims(),
            q.dims()
        ));
    }
    if ctx.lse.dims() != [b, h, s, 1] {
        return shape_err(format!(
            "{OP}: ctx.lse must be ({b}, {h}, {s}, 1), got {:?}",
            ctx.lse.dims()
        ));
    }
    let out = contiguous(&ctx.out, dtype, OP, "ctx.out")?;
    let lse = contiguous(&ctx.lse, dtype, OP, "ctx.lse")?;
    let shape = Shape { b, h, s, p, d };
    dispatch_float!(
        dtype,
        OP,
        backward(q, k, v, &out, &lse, d_out, scale, shape)
    )
}

/// Tensors the backward reads, as slices of one (batch, head).
struct HeadInputs<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    out: &'a [T],
    lse: &'a [T],
    d_out: &'a [T],
}

#[allow(clippy::too_many_arguments)]
fn backward<T: Float>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    d_out: &Tensor,
    scale: f64,
    sh: Shape,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "causal_prefix_attention_backward";
    let Shape { b, h, s, d, .. } = sh;
    let l = sh.l();
    let views = [q, k, v, out, lse, d_out]
        .into_iter()
        .map(|t| View::new(t, OP))
        .collect::<Result<Vec<_>>>()?;
    let [qs, ks, vs, outs, lses, d_outs] = [0, 1, 2, 3, 4, 5].map(|i| views[i].slice::<T>());
    let (qs, ks, vs, outs, lses, d_outs) = (qs?, ks?, vs?, outs?, lses?, d_outs?);
    let mut dq = vec![T::zero(); b * h * s * d]; // (B, H, s, D)
    let mut dk = vec![T::zero(); b * h * l * d]; // (B, H, L, D)
    let mut dv = vec![T::zero(); b * h * l * d]; // (B, H, L, D)
    if s > 0 {
        dq.par_chunks_mut(s * d)
            .zip(dk.par_chunks_mut(l * d))
            .zip(dv.par_chunks_mut(l * d))
            .enumerate()
            .for_each(|(bh, ((dq, dk), dv))| {
                let (sd, ld) = (bh * s * d..(bh + 1) * s * d, bh * l * d..(bh + 1) * l * d);
                let inputs = HeadInputs {
                    q: &qs[sd.clone()],
                    k: &ks[ld.clone()],
                    v: &vs[ld],
                    out: &outs[sd.clone()],
                    lse: &lses[bh * s..(bh + 1) * s],
                    d_out: &d_outs[sd],
                };
                head_backward(&inputs, dq, dk, dv, T::from_f64(scale), sh);
            });
    }
    Ok((
        tensor(dq, &[b, h, s, d])?,
        tensor(dk, &[b, h, l, d])?,
        tensor(dv, &[b, h, l, d])?,
    ))
}

/// Backward of one (batch, head), query blocks in order, accumulating `dk` and `dv`.
fn head_backward<T: Float>(
    x: &HeadInputs<'_, T>,
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    scale: T,
    sh: Shape,
) {
    let Shape { s, p, d, .. } = sh;
    // Score buffers for the largest block, reused by every block: the gemms overwrite every entry
    // they are given, so they are never cleared.
    let most = Q_BLOCK.min(s) * sh.l();
    let (mut probs_buf, mut ds_buf) = (vec![T::zero(); most], vec![T::zero(); most]);
    for t0 in (0..s).step_by(Q_BLOCK) {
        let (t0, t1, lk) = block(t0, s, p);
        let nb = t1 - t0;
        let (q_blk, d_out_blk) = (&x.q[t0 * d..t1 * d], &x.d_out[t0 * d..t1 * d]);
        // probs = exp(scale * q k^T - lse) on the visible keys, 0 elsewhere. // (nb, lk)
        let probs = &mut probs_buf[..nb * lk];
        block_scores(probs, q_blk, x.k, nb, lk, d);
        for (i, row) in probs.chunks_mut(lk).enumerate() {
            let (seen, masked) = row.split_at_mut(p + t0 + i + 1);
            let lse = x.lse[t0 + i];
            seen.iter_mut()
                .for_each(|z| *z = (*z * scale - lse).exp_fast());
            masked.fill(T::zero());
        }
        // dv += probs^T d_out
        matmul(
            &mut dv[..lk * d],
            d,
            true,
            Mat::transposed(probs, lk, nb, lk),
            Mat::rows(d_out_blk, nb, d, d),
            Threads::One,
        );
        // dprobs = d_out v^T, then ds = scale * probs * (dprobs - sum(d_out * out)). // (nb, lk)
        let ds = &mut ds_buf[..nb * lk];
        block_scores(ds, d_out_blk, x.v, nb, lk, d);
        for (i, (ds, probs)) in ds.chunks_mut(lk).zip(probs.chunks(lk)).enumerate() {
            let t = t0 + i;
            let delta: T = d_out_blk[i * d..(i + 1) * d]
                .iter()
                .zip(&x.out[t * d..(t + 1) * d])
                .map(|(&a, &b)| a * b)
                .sum();
            ds.iter_mut()
                .zip(probs)
                .for_each(|(g, &pr)| *g = scale * pr * (*g - delta));
        }
        // dq = ds k, dk += ds^T q
        matmul(
            &mut dq[t0 * d..t1 * d],
            d,
            false,
            Mat::rows(ds, nb, lk, lk),
            Mat::rows(x.k, lk, d, d),
            Threads::One,
        );
        matmul(
            &mut dk[..lk * d],
            d,
            true,
            Mat::transposed(ds, lk, nb, lk),
            Mat::rows(q_blk, nb, d, d),
            Threads::One,
        );
    }
}
