//! GELU, GPT-2 tanh approximation: `0.5 u (1 + tanh(sqrt(2/pi) (u + 0.044715 u^3)))`, optionally of
//! `u = x + bias` (the bias of the preceding linear layer), forward and backward one pass each.

use std::borrow::Cow;

use candle_core::Tensor;

use crate::cpu::{
    Float, View, add_assign, contiguous, dispatch_float, for_each_row, for_each_row_summing, tensor,
};
use crate::error::Result;
use crate::memory::SavedTensors;
use crate::util::{expect_float, expect_shape, shape_err};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const COEF: f64 = 0.044715;

/// Saved activations of [`gelu_forward`].
#[derive(Clone, Debug)]
pub struct GeluCtx {
    /// The GELU input before the bias (any shape; `(.., C)` with a bias).
    pub x: Tensor,
    /// The bias added to `x`. // (C,)
    pub bias: Option<Tensor>,
}

impl SavedTensors for GeluCtx {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        f(&self.x); // not the bias: a parameter, not an activation
    }
}

/// `tanh(sqrt(2/pi) (u + 0.044715 u^3))`.
#[inline(always)]
fn inner_tanh<T: Float>(u: T) -> T {
    let k0 = T::from_f64(SQRT_2_OVER_PI);
    let k1 = T::from_f64(SQRT_2_OVER_PI * COEF);
    (u * (k0 + k1 * u * u)).tanh_fast()
}

/// Elementwise tanh-approximate GELU of `x + bias` (`bias` `(C,)` broadcast over the rows of
/// `x` `(.., C)`; without a bias `x` may have any shape). Returns the output and the context.
pub fn gelu_forward(x: &Tensor, bias: Option<&Tensor>) -> Result<(Tensor, GeluCtx)> {
    const OP: &str = "gelu_forward";
    expect_float(x, OP, "x")?;
    let x = contiguous(x, x.dtype(), OP, "x")?;
    let bias = bias
        .map(|b| {
            expect_shape(b, &[last_dim(&x, OP)?], OP, "bias")?;
            contiguous(b, x.dtype(), OP, "bias")
        })
        .transpose()?;
    let y = dispatch_float!(x.dtype(), OP, forward(&x, bias.as_ref()))?;
    Ok((y, GeluCtx { x, bias }))
}

fn last_dim(x: &Tensor, op: &str) -> Result<usize> {
    match x.dims().last() {
        Some(&c) => Ok(c),
        None => shape_err(format!("{op}: x must have rank >= 1 when there is a bias")),
    }
}

/// Row width of the elementwise loops: the last dimension (that of the bias).
fn row_width(x: &Tensor) -> usize {
    x.dims().last().copied().unwrap_or(1)
}

/// The bias's elements, or `c` zeros without a bias.
fn bias_or_zeros<'a, T: Float>(bias: Option<&'a View<'_>>, c: usize) -> Result<Cow<'a, [T]>> {
    Ok(match bias {
        Some(b) => Cow::Borrowed(b.slice::<T>()?),
        None => Cow::Owned(vec![T::zero(); c]),
    })
}

fn forward<T: Float>(x: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "gelu_forward";
    let xv = View::new(x, OP)?;
    let xs = xv.slice::<T>()?;
    let c = row_width(x);
    let bv = bias.map(|b| View::new(b, OP)).transpose()?;
    let bs = bias_or_zeros::<T>(bv.as_ref(), c)?;
    let half = T::from_f64(0.5);
    let mut y = vec![T::zero(); xs.len()];
    for_each_row(&mut y, c, |r, out| {
        let row = &xs[r * c..(r + 1) * c];
        for ((o, &v), &b) in out.iter_mut().zip(row).zip(bs.iter()) {
            let u = v + b;
            *o = half * u * (T::one() + inner_tanh(u));
        }
    });
    tensor(y, x.dims())
}

/// Backward of [`gelu_forward`]: `dx = dy * gelu'(u)` with
/// `gelu'(u) = 0.5 (1 + t) + 0.5 u (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 u^2)`,
/// `t = tanh(sqrt(2/pi) (u + 0.044715 u^3))`, `u = x + bias`; and, with a bias, `dbias` = the sum of
/// `dx` over the rows (computed in the same pass). Returns `(dx, dbias)`.
pub fn gelu_backward(ctx: &GeluCtx, dy: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
    const OP: &str = "gelu_backward";
    if dy.dims() != ctx.x.dims() {
        return shape_err(format!(
            "{OP}: dy has shape {:?} but x has shape {:?}",
            dy.dims(),
            ctx.x.dims()
        ));
    }
    let dy = contiguous(dy, ctx.x.dtype(), OP, "dy")?;
    dispatch_float!(ctx.x.dtype(), OP, backward(ctx, &dy))
}

fn backward<T: Float>(ctx: &GeluCtx, dy: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
    const OP: &str = "gelu_backward";
    let (xv, dyv) = (View::new(&ctx.x, OP)?, View::new(dy, OP)?);
    let (xs, dys) = (xv.slice::<T>()?, dyv.slice::<T>()?);
    let c = row_width(&ctx.x);
    let bv = ctx.bias.as_ref().map(|b| View::new(b, OP)).transpose()?;
    let bs = bias_or_zeros::<T>(bv.as_ref(), c)?;
    let half = T::from_f64(0.5);
    let k0 = T::from_f64(SQRT_2_OVER_PI);
    let k1 = T::from_f64(3.0 * SQRT_2_OVER_PI * COEF);
    let row = |r: usize, out: &mut [T]| {
        let (x, g) = (&xs[r * c..(r + 1) * c], &dys[r * c..(r + 1) * c]);
        for (((o, &x), &g), &b) in out.iter_mut().zip(x).zip(g).zip(bs.iter()) {
            let u = x + b;
            let t = inner_tanh(u);
            let du = k0 + k1 * u * u;
            *o = g * (half * (T::one() + t) + half * u * (T::one() - t * t) * du);
        }
    };
    let mut dx = vec![T::zero(); xs.len()];
    let dbias = match bv {
        Some(_) => {
            let sums = for_each_row_summing(&mut dx, c, c, |r, out, acc| {
                row(r, out);
                add_assign(acc, out);
            });
            Some(tensor(sums, &[c])?)
        }
        None => {
            for_each_row(&mut dx, c, row);
            None
        }
    };
    Ok((tensor(dx, ctx.x.dims())?, dbias))
}
