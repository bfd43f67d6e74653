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
//!
//! With a [`DocumentMask`] (packed documents) query `t` attends only to keys of its own document:
//! `doc_start(P+t)..=P+t`. A block's scores start at the document start of its first query (the
//! earliest among its queries), so keys before it cost nothing — skipped, not masked after the
//! fact — and the dK/dV rows of skipped keys stay zero: what is carried back to earlier segments
//! follows the mask. The unmasked kernels are the masked ones with one document per sequence,
//! bit for bit (the same gemms on the same slices).

use candle_core::Tensor;
use rayon::prelude::*;

use crate::cpu::{
    Float, Mat, Threads, View, contiguous, dispatch_float, lane_max, lane_sum, matmul, tensor,
};
use crate::documents::DocumentMask;
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
    let b = q.dims().first().copied().unwrap_or(0);
    forward_impl(
        q,
        k,
        v,
        scale,
        &DocumentMask::single(b),
        0,
        "causal_prefix_attention_forward",
    )
}

/// Forward of document-masked prefix attention: query `t` of the segment (at position
/// `key_start + P + t` of its sequence) attends to the keys of its own document up to itself.
///
/// `k`/`v` `(B, H, P+s, D)` hold the keys/values of positions `key_start..key_start+P+s`: the
/// K/V prefix may begin at [`DocumentMask::prefix_start`] of the segment's first position (or
/// anywhere before); `key_start = 0` is the whole prefix. `mask` gives each of the `B` sequences'
/// document starts in absolute positions. Returns `out` `(B, H, s, D)` and the context for
/// [`document_prefix_attention_backward`]. Errors on shapes as the unmasked kernel does, when
/// `mask` does not have `B` rows, or when the prefix begins after the document start of a query.
pub fn document_prefix_attention_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: &DocumentMask,
    key_start: usize,
) -> Result<(Tensor, AttentionCtx)> {
    forward_impl(
        q,
        k,
        v,
        scale,
        mask,
        key_start,
        "document_prefix_attention_forward",
    )
}

fn forward_impl(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: &DocumentMask,
    key_start: usize,
    op: &'static str,
) -> Result<(Tensor, AttentionCtx)> {
    let (b, h, s, p, d) = check(q, k, v, op)?;
    let lo = key_lows(mask, b, s, p, key_start, op)?;
    let dtype = q.dtype();
    let (q, k, v) = (
        contiguous(q, dtype, op, "q")?,
        contiguous(k, dtype, op, "k")?,
        contiguous(v, dtype, op, "v")?,
    );
    let shape = Shape { b, h, s, p, d };
    let (out, lse) = dispatch_float!(dtype, op, forward(&q, &k, &v, scale, shape, &lo, op))?;
    Ok((out.clone(), AttentionCtx { q, out, lse }))
}

/// Per sequence and query of the segment, the index into `k` of its first visible key (its
/// document's start, relative to `key_start`). // (B, s)
fn key_lows(
    mask: &DocumentMask,
    b: usize,
    s: usize,
    p: usize,
    key_start: usize,
    op: &str,
) -> Result<Vec<usize>> {
    if mask.batch() != b {
        return shape_err(format!(
            "{op}: the document mask has {} rows but the batch has {b} sequences",
            mask.batch()
        ));
    }
    let mut lo = Vec::with_capacity(b * s);
    for row in 0..b {
        let first = key_start + p;
        let start = mask.doc_start(row, first);
        if s > 0 && start < key_start {
            return shape_err(format!(
                "{op}: sequence {row}: the K/V prefix begins at position {key_start}, but the \
                 query at position {first} belongs to the document starting at {start}; keep the \
                 keys from DocumentMask::prefix_start ({}) on",
                mask.prefix_start(first)
            ));
        }
        lo.extend((0..s).map(|t| mask.doc_start(row, first + t) - key_start));
    }
    Ok(lo)
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

/// Query block `t0..t1` of a segment with prefix `p`, whose queries' first visible keys are `lo`
/// (non-decreasing): keys `lo[t0]..p + t1` are visible to some query. Returns
/// `(t0, t1, first key, number of keys)`.
fn block(t0: usize, s: usize, p: usize, lo: &[usize]) -> (usize, usize, usize, usize) {
    let t1 = (t0 + Q_BLOCK).min(s);
    let k0 = lo[t0];
    (t0, t1, k0, p + t1 - k0)
}

/// Zeroes the keys of a block's score row `row` (keys `k0..`) that query `t` may not see: those
/// before its document's start `lo_t` and those after itself (`p + t`). Returns the visible part.
fn visible_part<T: Float>(row: &mut [T], k0: usize, lo_t: usize, p: usize, t: usize) -> &mut [T] {
    let (before, rest) = row.split_at_mut(lo_t - k0);
    before.fill(T::zero());
    let (seen, after) = rest.split_at_mut(p + t + 1 - lo_t);
    after.fill(T::zero());
    seen
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
    lo: &[usize],
    op: &str,
) -> Result<(Tensor, Tensor)> {
    let Shape { b, h, s, p, d } = sh;
    let l = sh.l();
    let (qv, kv, vv) = (View::new(q, op)?, View::new(k, op)?, View::new(v, op)?);
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
                let row = bh / h;
                let lo = &lo[row * s..(row + 1) * s];
                out.par_chunks_mut(Q_BLOCK * d)
                    .zip(lse.par_chunks_mut(Q_BLOCK))
                    .enumerate()
                    // One score buffer per task, reused by its blocks: the gemm overwrites
                    // every entry it is given, so it is never cleared.
                    .for_each_init(Vec::new, |scratch, (blk, (out, lse))| {
                        let (t0, t1, k0, lk) = block(blk * Q_BLOCK, s, p, lo);
                        let nb = t1 - t0;
                        let probs = reuse(scratch, nb * lk); // (nb, lk)
                        block_scores(probs, &q[t0 * d..t1 * d], &k[k0 * d..], nb, lk, d);
                        for (i, row) in probs.chunks_mut(lk).enumerate() {
                            let seen = visible_part(row, k0, lo[t0 + i], p, t0 + i);
                            let max = lane_max(seen) * scale;
                            // The exponentials first, then their sum in lanes: both loops
                            // vectorize (a running sum would serialize the exponentials).
                            seen.iter_mut()
                                .for_each(|x| *x = (*x * scale - max).exp_fast());
                            let sum = lane_sum(seen);
                            let inv = T::one() / sum;
                            seen.iter_mut().for_each(|x| *x *= inv);
                            lse[i] = max + sum.ln();
                        }
                        matmul(
                            out,
                            d,
                            false,
                            Mat::rows(probs, nb, lk, lk),
                            Mat::rows(&v[k0 * d..], lk, d, d),
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
    let b = ctx.q.dims().first().copied().unwrap_or(0);
    backward_impl(
        ctx,
        k,
        v,
        d_out,
        scale,
        &DocumentMask::single(b),
        0,
        "causal_prefix_attention_backward",
    )
}

/// Backward of [`document_prefix_attention_forward`], with the same `mask` and `key_start`.
///
/// Returns `(dq (B, H, s, D), dk (B, H, P+s, D), dv (B, H, P+s, D))`; `dk`/`dv` rows `0..P` are the
/// contributions of this segment's queries to the prefix keys/values of their own documents (zero
/// for keys of other documents): the dK/dV to carry back to the earlier segments.
pub fn document_prefix_attention_backward(
    ctx: &AttentionCtx,
    k: &Tensor,
    v: &Tensor,
    d_out: &Tensor,
    scale: f64,
    mask: &DocumentMask,
    key_start: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    backward_impl(
        ctx,
        k,
        v,
        d_out,
        scale,
        mask,
        key_start,
        "document_prefix_attention_backward",
    )
}

#[allow(clippy::too_many_arguments)]
fn backward_impl(
    ctx: &AttentionCtx,
    k: &Tensor,
    v: &Tensor,
    d_out: &Tensor,
    scale: f64,
    mask: &DocumentMask,
    key_start: usize,
    op: &'static str,
) -> Result<(Tensor, Tensor, Tensor)> {
    let q = &ctx.q;
    let (b, h, s, p, d) = check(q, k, v, op)?;
    let lo = key_lows(mask, b, s, p, key_start, op)?;
    let dtype = q.dtype();
    let (q, k, v, d_out) = (
        &contiguous(q, dtype, op, "ctx.q")?,
        &contiguous(k, dtype, op, "k")?,
        &contiguous(v, dtype, op, "v")?,
        &contiguous(d_out, dtype, op, "d_out")?,
    );
    if d_out.dims() != [b, h, s, d] || ctx.out.dims() != [b, h, s, d] {
        return shape_err(format!(
            "{op}: d_out {:?} and ctx.out {:?} must have the shape of q {:?}",
            d_out.dims(),
            ctx.out.dims(),
            q.dims()
        ));
    }
    if ctx.lse.dims() != [b, h, s, 1] {
        return shape_err(format!(
            "{op}: ctx.lse must be ({b}, {h}, {s}, 1), got {:?}",
            ctx.lse.dims()
        ));
    }
    let out = contiguous(&ctx.out, dtype, op, "ctx.out")?;
    let lse = contiguous(&ctx.lse, dtype, op, "ctx.lse")?;
    let shape = Shape { b, h, s, p, d };
    dispatch_float!(
        dtype,
        op,
        backward(q, k, v, &out, &lse, d_out, scale, shape, &lo, op)
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
    /// Per query, the first visible key (its document's start). // (s)
    lo: &'a [usize],
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
    lo: &[usize],
    op: &str,
) -> Result<(Tensor, Tensor, Tensor)> {
    let Shape { b, h, s, d, .. } = sh;
    let l = sh.l();
    let views = [q, k, v, out, lse, d_out]
        .into_iter()
        .map(|t| View::new(t, op))
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
                    lo: &lo[(bh / h) * s..(bh / h + 1) * s],
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
        let (t0, t1, k0, lk) = block(t0, s, p, x.lo);
        let nb = t1 - t0;
        let (q_blk, d_out_blk) = (&x.q[t0 * d..t1 * d], &x.d_out[t0 * d..t1 * d]);
        // The keys the block sees, k0..k0 + lk. // (lk, D)
        let (k_blk, v_blk) = (&x.k[k0 * d..], &x.v[k0 * d..]);
        // probs = exp(scale * q k^T - lse) on the visible keys, 0 elsewhere. // (nb, lk)
        let probs = &mut probs_buf[..nb * lk];
        block_scores(probs, q_blk, k_blk, nb, lk, d);
        for (i, row) in probs.chunks_mut(lk).enumerate() {
            let seen = visible_part(row, k0, x.lo[t0 + i], p, t0 + i);
            let lse = x.lse[t0 + i];
            seen.iter_mut()
                .for_each(|z| *z = (*z * scale - lse).exp_fast());
        }
        // dv += probs^T d_out
        matmul(
            &mut dv[k0 * d..(k0 + lk) * d],
            d,
            true,
            Mat::transposed(probs, lk, nb, lk),
            Mat::rows(d_out_blk, nb, d, d),
            Threads::One,
        );
        // dprobs = d_out v^T, then ds = scale * probs * (dprobs - sum(d_out * out)). // (nb, lk)
        let ds = &mut ds_buf[..nb * lk];
        block_scores(ds, d_out_blk, v_blk, nb, lk, d);
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
            Mat::rows(k_blk, lk, d, d),
            Threads::One,
        );
        matmul(
            &mut dk[k0 * d..(k0 + lk) * d],
            d,
            true,
            Mat::transposed(ds, lk, nb, lk),
            Mat::rows(q_blk, nb, d, d),
            Threads::One,
        );
    }
}
