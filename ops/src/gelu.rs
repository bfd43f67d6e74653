//! GELU, GPT-2 tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.

use candle_core::Tensor;

use crate::error::Result;
use crate::util::{expect_float, shape_err};

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const COEF: f64 = 0.044715;

/// Saved activations of [`gelu_forward`].
#[derive(Clone, Debug)]
pub struct GeluCtx {
    /// The GELU input (any shape).
    pub x: Tensor,
}

/// Elementwise tanh-approximate GELU of `x` (any shape); returns the output and the context.
pub fn gelu_forward(x: &Tensor) -> Result<(Tensor, GeluCtx)> {
    expect_float(x, "gelu_forward", "x")?;
    // candle's `gelu` is exactly the tanh approximation used by GPT-2.
    let y = x.gelu()?;
    Ok((y, GeluCtx { x: x.clone() }))
}

/// Backward of [`gelu_forward`]: `dx = dy * gelu'(x)` with
/// `gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)`,
/// `t = tanh(sqrt(2/pi) (x + 0.044715 x^3))`.
pub fn gelu_backward(ctx: &GeluCtx, dy: &Tensor) -> Result<Tensor> {
    let x = &ctx.x;
    if dy.dims() != x.dims() {
        return shape_err(format!(
            "gelu_backward: dy has shape {:?} but x has shape {:?}",
            dy.dims(),
            x.dims()
        ));
    }
    let x2 = x.sqr()?;
    // u = sqrt(2/pi) * x * (1 + 0.044715 x^2)
    let u = (x * x2.affine(SQRT_2_OVER_PI * COEF, SQRT_2_OVER_PI)?)?;
    let t = u.tanh()?;
    // du/dx = sqrt(2/pi) * (1 + 3 * 0.044715 x^2)
    let du = x2.affine(3.0 * SQRT_2_OVER_PI * COEF, SQRT_2_OVER_PI)?;
    // 0.5 x (1 - t^2) du
    let sech2 = t.sqr()?.affine(-1.0, 1.0)?;
    let second = ((x * sech2)? * du)?.affine(0.5, 0.0)?;
    let grad = (t.affine(0.5, 0.5)? + second)?;
    Ok((dy * grad)?)
}
