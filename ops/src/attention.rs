//! Causal attention of a query segment over a key/value prefix (Seq1F1B).
//!
//! The queries `q` `(B, H, s, D)` belong to positions `P..P+s` of a sequence; `k`, `v`
//! `(B, H, P+s, D)` hold the keys/values of all positions `0..P+s` (the cached prefix of the
//! earlier segments followed by this segment's own). Query `t` (0-based within the segment)
//! attends keys `0..=P+t`, i.e. the causal mask is aligned to the bottom-right corner of the
//! `(s, P+s)` score matrix. With `P = 0` this is ordinary causal self-attention.
//!
//! The backward pass recomputes the probabilities from `q`, `k` and the saved log-sum-exp
//! (flash-attention style), so the `(s, P+s)` probability matrix is never stored between passes.

use candle_core::{D, DType, Device, Tensor};

use crate::error::Result;
use crate::util::{dims4, expect_float, shape_err};

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

/// Additive mask: 0 where key `j <= p + t`, `-inf` elsewhere. // (s, P+s)
fn causal_mask(s: usize, p: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let l = p + s;
    let data: Vec<f32> = (0..s)
        .flat_map(|t| (0..l).map(move |j| if j <= p + t { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(data, (s, l), device)?.to_dtype(dtype)?)
}

/// Scaled, masked scores `scale * q k^T + mask`. // (B, H, s, P+s)
fn masked_scores(q: &Tensor, k: &Tensor, s: usize, p: usize, scale: f64) -> Result<Tensor> {
    let scores = q.matmul(&k.t()?)?.affine(scale, 0.0)?; // (B, H, s, P+s)
    if s == 0 {
        return Ok(scores);
    }
    let mask = causal_mask(s, p, q.dtype(), q.device())?; // (s, P+s)
    Ok(scores.broadcast_add(&mask)?)
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
    let (_b, _h, s, p, _d) = check(q, k, v, "causal_prefix_attention_forward")?;
    // Batched matmul needs uniform batch strides; this is a no-op for contiguous inputs.
    let (q, k, v) = (&q.contiguous()?, &k.contiguous()?, &v.contiguous()?);
    let scores = masked_scores(q, k, s, p, scale)?; // (B, H, s, L)
    let max = scores.max_keepdim(D::Minus1)?; // (B, H, s, 1)
    let exp = scores.broadcast_sub(&max)?.exp()?; // (B, H, s, L)
    let sum = exp.sum_keepdim(D::Minus1)?; // (B, H, s, 1)
    let lse = (max + sum.log()?)?; // (B, H, s, 1)
    let probs = exp.broadcast_div(&sum)?; // (B, H, s, L)
    let out = probs.matmul(v)?; // (B, H, s, D)
    Ok((
        out.clone(),
        AttentionCtx {
            q: q.clone(),
            out,
            lse,
        },
    ))
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
    let (k, v, d_out) = (&k.contiguous()?, &v.contiguous()?, &d_out.contiguous()?);
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
    let scores = masked_scores(q, k, s, p, scale)?; // (B, H, s, L)
    let probs = scores.broadcast_sub(&ctx.lse)?.exp()?; // (B, H, s, L)
    let dv = probs.t()?.matmul(d_out)?; // (B, H, L, D)
    let dprobs = d_out.matmul(&v.t()?)?; // (B, H, s, L)
    let delta = (d_out * &ctx.out)?.sum_keepdim(D::Minus1)?; // (B, H, s, 1)
    let ds = (probs * dprobs.broadcast_sub(&delta)?)?; // (B, H, s, L)
    let dq = ds.matmul(k)?.affine(scale, 0.0)?; // (B, H, s, D)
    let dk = ds.t()?.matmul(q)?.affine(scale, 0.0)?; // (B, H, L, D)
    Ok((dq, dk, dv))
}
