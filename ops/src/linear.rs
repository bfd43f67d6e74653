//! Fully connected layer `y = x W^T + b` with weights stored `(out, in)`.

use candle_core::Tensor;

use crate::error::Result;
use crate::util::{dims2, expect_shape, shape_err};

/// Saved activations of [`linear_forward`] needed by [`linear_backward`].
#[derive(Clone, Debug)]
pub struct LinearCtx {
    /// The layer input. // (N, in)
    pub x: Tensor,
}

/// Parameter gradients returned by [`linear_backward`].
#[derive(Clone, Debug)]
pub struct LinearGrads {
    /// Gradient of the weight. // (out, in)
    pub dw: Tensor,
    /// Gradient of the bias, `None` when the layer has no bias. // (out,)
    pub db: Option<Tensor>,
}

/// Computes `y = x W^T + b`.
///
/// `x` is `(N, in)`, `w` is `(out, in)`, `b` is `(out,)`; returns `y` `(N, out)` and the context
/// for the backward pass.
pub fn linear_forward(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<(Tensor, LinearCtx)> {
    const OP: &str = "linear_forward";
    let (_n, d_in) = dims2(x, OP, "x")?;
    let (d_out, w_in) = dims2(w, OP, "w")?;
    if w_in != d_in {
        return shape_err(format!("{OP}: x is (N, {d_in}) but w is ({d_out}, {w_in})"));
    }
    let y = x.matmul(&w.t()?)?; // (N, out)
    let y = match b {
        Some(b) => {
            expect_shape(b, &[d_out], OP, "b")?;
            y.broadcast_add(b)? // (N, out)
        }
        None => y,
    };
    Ok((y, LinearCtx { x: x.clone() }))
}

/// Backward of [`linear_forward`].
///
/// `dy` is the gradient of the output `(N, out)`; returns `dx` `(N, in)` and the parameter
/// gradients (`db` only when `has_bias`).
pub fn linear_backward(
    ctx: &LinearCtx,
    w: &Tensor,
    dy: &Tensor,
    has_bias: bool,
) -> Result<(Tensor, LinearGrads)> {
    const OP: &str = "linear_backward";
    let (n, d_in) = dims2(&ctx.x, OP, "ctx.x")?;
    let (d_out, _) = dims2(w, OP, "w")?;
    expect_shape(w, &[d_out, d_in], OP, "w")?;
    expect_shape(dy, &[n, d_out], OP, "dy")?;
    let dx = dy.matmul(w)?; // (N, in)
    let dw = dy.t()?.matmul(&ctx.x)?; // (out, in)
    let db = if has_bias {
        Some(dy.sum(0)?) // (out,)
    } else {
        None
    };
    Ok((dx, LinearGrads { dw, db }))
}
