//! LayerNorm and RMSNorm over the last dimension of a 2-D `(N, C)` input, forward and backward one
//! pass over the rows each (the backward adds the weight and bias gradients in the same pass).

use candle_core::Tensor;

use crate::cpu::{
    Float, View, contiguous, dispatch_float, for_each_row, for_each_row_summing, tensor,
};
use crate::error::Result;
use crate::memory::SavedTensors;
use crate::util::{dims2, expect_float, expect_shape};

/// Saved activations of a normalization forward pass.
#[derive(Clone, Debug)]
pub struct NormCtx {
    /// The input. // (N, C)
    pub x: Tensor,
    /// Mean of each row (LayerNorm); `None` for RMSNorm, which does not center. // (N,)
    pub mean: Option<Tensor>,
    /// Reciprocal standard deviation (LayerNorm) or reciprocal RMS (RMSNorm) of each row. // (N,)
    pub rstd: Tensor,
}

impl SavedTensors for NormCtx {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        f(&self.x);
        self.mean.for_each_tensor(f);
        f(&self.rstd);
    }
}

/// Parameter gradients of a normalization layer.
#[derive(Clone, Debug)]
pub struct NormGrads {
    /// Gradient of the scale. // (C,)
    pub dweight: Tensor,
    /// Gradient of the shift, `None` when the layer has no bias (always `None` for RMSNorm). // (C,)
    pub dbias: Option<Tensor>,
}

/// LayerNorm: `y = (x - mean) / sqrt(var + eps) * weight + bias`, statistics over the last dim.
///
/// `x` is `(N, C)` (the variance is the biased one, as in PyTorch), `weight` and `bias` are `(C,)`.
pub fn layer_norm_forward(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<(Tensor, NormCtx)> {
    norm_forward(x, weight, bias, eps, true, "layer_norm_forward")
}

/// Backward of [`layer_norm_forward`].
///
/// `dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))` with `dxhat = dy * weight`;
/// `dweight = sum_rows(dy * xhat)`, `dbias = sum_rows(dy)` (only when `has_bias`).
pub fn layer_norm_backward(
    ctx: &NormCtx,
    weight: &Tensor,
    dy: &Tensor,
    has_bias: bool,
) -> Result<(Tensor, NormGrads)> {
    norm_backward(ctx, weight, dy, has_bias, "layer_norm_backward")
}

/// RMSNorm: `y = x / sqrt(mean(x^2) + eps) * weight`, statistics over the last dim.
///
/// `x` is `(N, C)`, `weight` is `(C,)`.
pub fn rms_norm_forward(x: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, NormCtx)> {
    norm_forward(x, weight, None, eps, false, "rms_norm_forward")
}

/// Backward of [`rms_norm_forward`].
///
/// `dx = rstd * (dxhat - xhat * mean(dxhat * xhat))` with `dxhat = dy * weight`;
/// `dweight = sum_rows(dy * xhat)`; `dbias` is always `None`.
pub fn rms_norm_backward(
    ctx: &NormCtx,
    weight: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, NormGrads)> {
    norm_backward(ctx, weight, dy, false, "rms_norm_backward")
}

fn norm_forward(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
    center: bool,
    op: &str,
) -> Result<(Tensor, NormCtx)> {
    let (_n, c) = dims2(x, op, "x")?;
    expect_float(x, op, "x")?;
    expect_shape(weight, &[c], op, "weight")?;
    if let Some(b) = bias {
        expect_shape(b, &[c], op, "bias")?;
    }
    let dtype = x.dtype();
    let x = contiguous(x, dtype, op, "x")?;
    let w = contiguous(weight, dtype, op, "weight")?;
    let b = bias.map(|b| contiguous(b, dtype, op, "bias")).transpose()?;
    dispatch_float!(dtype, op, forward(x, &w, b.as_ref(), eps, center, op))
}

/// Row statistics `(mean, rstd)`; the mean is 0 without centering.
#[inline(always)]
fn row_stats<T: Float>(row: &[T], eps: T, center: bool) -> (T, T) {
    let c = T::from_f64(row.len() as f64);
    let mean = if center {
        row.iter().copied().sum::<T>() / c
    } else {
        T::zero()
    };
    let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<T>() / c;
    (mean, T::one() / (var + eps).sqrt())
}

fn forward<T: Float>(
    x: Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f64,
    center: bool,
    op: &str,
) -> Result<(Tensor, NormCtx)> {
    let (n, c) = x.dims2()?;
    let (xv, wv) = (View::new(&x, op)?, View::new(w, op)?);
    let (xs, ws) = (xv.slice::<T>()?, wv.slice::<T>()?);
    let bv = b.map(|b| View::new(b, op)).transpose()?;
    let bs = bv.as_ref().map(|b| b.slice::<T>()).transpose()?;
    let eps = T::from_f64(eps);
    // Row r of `stats` is (mean, rstd).
    let mut stats = vec![T::zero(); 2 * n];
    for_each_row(&mut stats, 2, |r, s| {
        (s[0], s[1]) = row_stats(&xs[r * c..(r + 1) * c], eps, center);
    });
    let mut y = vec![T::zero(); n * c]; // (N, C)
    for_each_row(&mut y, c, |r, out| {
        let (mean, rstd) = (stats[2 * r], stats[2 * r + 1]);
        let row = &xs[r * c..(r + 1) * c];
        for (i, o) in out.iter_mut().enumerate() {
            let v = (row[i] - mean) * rstd * ws[i];
            *o = bs.map_or(v, |b| v + b[i]);
        }
    });
    let (mean, rstd): (Vec<T>, Vec<T>) = stats.chunks(2).map(|s| (s[0], s[1])).unzip();
    drop(xv);
    Ok((
        tensor(y, &[n, c])?,
        NormCtx {
            x,
            mean: center.then(|| tensor(mean, &[n])).transpose()?,
            rstd: tensor(rstd, &[n])?,
        },
    ))
}

fn norm_backward(
    ctx: &NormCtx,
    weight: &Tensor,
    dy: &Tensor,
    has_bias: bool,
    op: &str,
) -> Result<(Tensor, NormGrads)> {
    let (n, c) = dims2(&ctx.x, op, "ctx.x")?;
    expect_shape(weight, &[c], op, "weight")?;
    expect_shape(dy, &[n, c], op, "dy")?;
    let dtype = ctx.x.dtype();
    let w = contiguous(weight, dtype, op, "weight")?;
    let dy = contiguous(dy, dtype, op, "dy")?;
    dispatch_float!(dtype, op, backward(ctx, &w, &dy, has_bias, op))
}

fn backward<T: Float>(
    ctx: &NormCtx,
    w: &Tensor,
    dy: &Tensor,
    has_bias: bool,
    op: &str,
) -> Result<(Tensor, NormGrads)> {
    let (n, c) = ctx.x.dims2()?;
    let (xv, wv, dyv, rv) = (
        View::new(&ctx.x, op)?,
        View::new(w, op)?,
        View::new(dy, op)?,
        View::new(&ctx.rstd, op)?,
    );
    let (xs, ws, dys, rstds) = (
        xv.slice::<T>()?,
        wv.slice::<T>()?,
        dyv.slice::<T>()?,
        rv.slice::<T>()?,
    );
    let mv = ctx.mean.as_ref().map(|m| View::new(m, op)).transpose()?;
    let means = mv.as_ref().map(|m| m.slice::<T>()).transpose()?;
    let inv_c = T::one() / T::from_f64(c as f64);
    let mut dx = vec![T::zero(); n * c]; // (N, C)
    // acc = [dweight (C), dbias (C)]
    let sums = for_each_row_summing(&mut dx, c, 2 * c, |r, out, acc| {
        let (x, g) = (&xs[r * c..(r + 1) * c], &dys[r * c..(r + 1) * c]);
        let (mean, rstd) = (means.map_or(T::zero(), |m| m[r]), rstds[r]);
        let (mut sum_dxhat, mut sum_dxhat_xhat) = (T::zero(), T::zero());
        for i in 0..c {
            let xhat = (x[i] - mean) * rstd;
            let dxhat = g[i] * ws[i];
            sum_dxhat += dxhat;
            sum_dxhat_xhat += dxhat * xhat;
            acc[i] += g[i] * xhat;
            acc[c + i] += g[i];
        }
        let mean_dxhat = if means.is_some() {
            sum_dxhat * inv_c
        } else {
            T::zero()
        };
        let mean_dxhat_xhat = sum_dxhat_xhat * inv_c;
        for (i, o) in out.iter_mut().enumerate() {
            let xhat = (x[i] - mean) * rstd;
            *o = rstd * (g[i] * ws[i] - mean_dxhat - xhat * mean_dxhat_xhat);
        }
    });
    let dweight = tensor(sums[..c].to_vec(), &[c])?;
    let dbias = has_bias
        .then(|| tensor(sums[c..].to_vec(), &[c]))
        .transpose()?;
    Ok((tensor(dx, &[n, c])?, NormGrads { dweight, dbias }))
}
