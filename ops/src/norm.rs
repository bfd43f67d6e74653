//! LayerNorm and RMSNorm over the last dimension of a 2-D `(N, C)` input.

use candle_core::Tensor;

use crate::error::Result;
use crate::util::{dims2, expect_float, expect_shape};

/// Saved activations of a normalization forward pass.
#[derive(Clone, Debug)]
pub struct NormCtx {
    /// The normalized input before the affine transform. // (N, C)
    pub xhat: Tensor,
    /// Reciprocal standard deviation (LayerNorm) or reciprocal RMS (RMSNorm) of each row. // (N, 1)
    pub rstd: Tensor,
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
    const OP: &str = "layer_norm_forward";
    let (_n, c) = dims2(x, OP, "x")?;
    expect_float(x, OP, "x")?;
    expect_shape(weight, &[c], OP, "weight")?;
    let mean = x.mean_keepdim(1)?; // (N, 1)
    let xc = x.broadcast_sub(&mean)?; // (N, C)
    let var = xc.sqr()?.mean_keepdim(1)?; // (N, 1)
    let rstd = var.affine(1.0, eps)?.sqrt()?.recip()?; // (N, 1)
    let xhat = xc.broadcast_mul(&rstd)?; // (N, C)
    let y = xhat.broadcast_mul(weight)?; // (N, C)
    let y = match bias {
        Some(b) => {
            expect_shape(b, &[c], OP, "bias")?;
            y.broadcast_add(b)?
        }
        None => y,
    };
    Ok((y, NormCtx { xhat, rstd }))
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
    const OP: &str = "layer_norm_backward";
    let (n, c) = dims2(&ctx.xhat, OP, "ctx.xhat")?;
    expect_shape(weight, &[c], OP, "weight")?;
    expect_shape(dy, &[n, c], OP, "dy")?;
    let dy_xhat = (dy * &ctx.xhat)?; // (N, C)
    let dweight = dy_xhat.sum(0)?; // (C,)
    let dbias = if has_bias { Some(dy.sum(0)?) } else { None }; // (C,)
    let dxhat = dy.broadcast_mul(weight)?; // (N, C)
    let mean_dxhat = dxhat.mean_keepdim(1)?; // (N, 1)
    let mean_dxhat_xhat = (&dxhat * &ctx.xhat)?.mean_keepdim(1)?; // (N, 1)
    let dx = dxhat
        .broadcast_sub(&mean_dxhat)?
        .sub(&ctx.xhat.broadcast_mul(&mean_dxhat_xhat)?)?
        .broadcast_mul(&ctx.rstd)?; // (N, C)
    Ok((dx, NormGrads { dweight, dbias }))
}

/// RMSNorm: `y = x / sqrt(mean(x^2) + eps) * weight`, statistics over the last dim.
///
/// `x` is `(N, C)`, `weight` is `(C,)`.
pub fn rms_norm_forward(x: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, NormCtx)> {
    const OP: &str = "rms_norm_forward";
    let (_n, c) = dims2(x, OP, "x")?;
    expect_float(x, OP, "x")?;
    expect_shape(weight, &[c], OP, "weight")?;
    let ms = x.sqr()?.mean_keepdim(1)?; // (N, 1)
    let rstd = ms.affine(1.0, eps)?.sqrt()?.recip()?; // (N, 1)
    let xhat = x.broadcast_mul(&rstd)?; // (N, C)
    let y = xhat.broadcast_mul(weight)?; // (N, C)
    Ok((y, NormCtx { xhat, rstd }))
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
    const OP: &str = "rms_norm_backward";
    let (n, c) = dims2(&ctx.xhat, OP, "ctx.xhat")?;
    expect_shape(weight, &[c], OP, "weight")?;
    expect_shape(dy, &[n, c], OP, "dy")?;
    let dweight = (dy * &ctx.xhat)?.sum(0)?; // (C,)
    let dxhat = dy.broadcast_mul(weight)?; // (N, C)
    let mean_dxhat_xhat = (&dxhat * &ctx.xhat)?.mean_keepdim(1)?; // (N, 1)
    let dx = dxhat
        .sub(&ctx.xhat.broadcast_mul(&mean_dxhat_xhat)?)?
        .broadcast_mul(&ctx.rstd)?; // (N, C)
    Ok((
        dx,
        NormGrads {
            dweight,
            dbias: None,
        },
    ))
}
