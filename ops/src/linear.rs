//! Fully connected layer `y = x W^T + b` with weights stored `(out, in)`.

use candle_core::Tensor;

use crate::cpu::{
    Float, Mat, Threads, View, add_assign, contiguous, dispatch_float, matmul, sum_rows, tensor,
};
use crate::error::Result;
use crate::memory::SavedTensors;
use crate::util::{dims2, expect_shape, shape_err};

/// Saved activations of [`linear_forward`] needed by [`linear_backward`].
#[derive(Clone, Debug)]
pub struct LinearCtx {
    /// The layer input. // (N, in)
    pub x: Tensor,
}

impl SavedTensors for LinearCtx {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        f(&self.x);
    }
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
    if let Some(b) = b {
        expect_shape(b, &[d_out], OP, "b")?;
    }
    let x = contiguous(x, x.dtype(), OP, "x")?;
    let w = contiguous(w, x.dtype(), OP, "w")?;
    let b = b.map(|b| contiguous(b, x.dtype(), OP, "b")).transpose()?;
    let y = dispatch_float!(x.dtype(), OP, forward(&x, &w, b.as_ref()))?; // (N, out)
    Ok((y, LinearCtx { x }))
}

/// `x (N, in) · w^T (in, out) + b` in one gemm whose destination starts as the broadcast bias.
fn forward<T: Float>(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "linear_forward";
    let (n, d_in) = x.dims2()?;
    let d_out = w.dim(0)?;
    let (xv, wv) = (View::new(x, OP)?, View::new(w, OP)?);
    let mut y = match b {
        Some(b) => View::new(b, OP)?.slice::<T>()?.repeat(n),
        None => vec![T::zero(); n * d_out],
    };
    matmul(
        &mut y,
        d_out,
        b.is_some(),
        Mat::rows(xv.slice::<T>()?, n, d_in, d_in),
        Mat::transposed(wv.slice::<T>()?, d_in, d_out, d_in),
        Threads::Pool,
    );
    tensor(y, &[n, d_out])
}

/// Backward of [`linear_forward`]: [`linear_backward_input`] then [`linear_backward_weight`]
/// (the same gemms either way, so a backward split into its two halves gives the same bits).
///
/// `dy` is the gradient of the output `(N, out)`; returns `dx` `(N, in)` and the parameter
/// gradients (`db` only when `has_bias`).
pub fn linear_backward(
    ctx: &LinearCtx,
    w: &Tensor,
    dy: &Tensor,
    has_bias: bool,
) -> Result<(Tensor, LinearGrads)> {
    let dx = linear_backward_input(ctx, w, dy)?;
    let grads = linear_backward_weight(ctx, dy, has_bias)?;
    Ok((dx, grads))
}

/// The input half of [`linear_backward`]: `dx = dy · w` `(N, in)` from `dy` `(N, out)`; the
/// weight half ([`linear_backward_weight`]) needs `ctx` and `dy` afterwards.
pub fn linear_backward_input(ctx: &LinearCtx, w: &Tensor, dy: &Tensor) -> Result<Tensor> {
    const OP: &str = "linear_backward_input";
    let (n, d_in) = dims2(&ctx.x, OP, "ctx.x")?;
    let (d_out, _) = dims2(w, OP, "w")?;
    expect_shape(w, &[d_out, d_in], OP, "w")?;
    expect_shape(dy, &[n, d_out], OP, "dy")?;
    let dtype = ctx.x.dtype();
    let w = contiguous(w, dtype, OP, "w")?;
    let dy = contiguous(dy, dtype, OP, "dy")?;
    dispatch_float!(dtype, OP, backward_input(&w, &dy))
}

/// The weight half of [`linear_backward`]: `dw = dy^T · x` `(out, in)` and, when `has_bias`,
/// `db` = the column sums of `dy` `(out,)`.
pub fn linear_backward_weight(ctx: &LinearCtx, dy: &Tensor, has_bias: bool) -> Result<LinearGrads> {
    const OP: &str = "linear_backward_weight";
    let (n, _) = dims2(&ctx.x, OP, "ctx.x")?;
    let (dy_n, _) = dims2(dy, OP, "dy")?;
    if dy_n != n {
        return shape_err(format!("{OP}: ctx.x has {n} rows but dy has {dy_n}"));
    }
    let dtype = ctx.x.dtype();
    let dy = contiguous(dy, dtype, OP, "dy")?;
    dispatch_float!(dtype, OP, backward_weight(&ctx.x, &dy, has_bias))
}

/// `dx = dy · w` (one gemm).
fn backward_input<T: Float>(w: &Tensor, dy: &Tensor) -> Result<Tensor> {
    const OP: &str = "linear_backward_input";
    let (d_out, d_in) = w.dims2()?;
    let n = dy.dim(0)?;
    let (wv, dyv) = (View::new(w, OP)?, View::new(dy, OP)?);
    let (ws, dys) = (wv.slice::<T>()?, dyv.slice::<T>()?);
    let mut dx = vec![T::zero(); n * d_in]; // (N, in)
    matmul(
        &mut dx,
        d_in,
        false,
        Mat::rows(dys, n, d_out, d_out),
        Mat::rows(ws, d_out, d_in, d_in),
        Threads::Pool,
    );
    tensor(dx, &[n, d_in])
}

/// `dw = dy^T · x` (one gemm), `db` = column sums of `dy`.
fn backward_weight<T: Float>(x: &Tensor, dy: &Tensor, has_bias: bool) -> Result<LinearGrads> {
    const OP: &str = "linear_backward_weight";
    let (n, d_in) = x.dims2()?;
    let d_out = dy.dim(1)?;
    let (xv, dyv) = (View::new(x, OP)?, View::new(dy, OP)?);
    let (xs, dys) = (xv.slice::<T>()?, dyv.slice::<T>()?);
    let mut dw = vec![T::zero(); d_out * d_in]; // (out, in)
    matmul(
        &mut dw,
        d_in,
        false,
        Mat::transposed(dys, d_out, n, d_out),
        Mat::rows(xs, n, d_in, d_in),
        Threads::Pool,
    );
    let db = has_bias
        .then(|| {
            let sums = sum_rows(n, d_out, d_out, |r, acc: &mut [T]| {
                add_assign(acc, &dys[r * d_out..(r + 1) * d_out]);
            });
            tensor(sums, &[d_out]) // (out,)
        })
        .transpose()?;
    Ok(LinearGrads {
        dw: tensor(dw, &[d_out, d_in])?,
        db,
    })
}
