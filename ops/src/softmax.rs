//! Numerically stable softmax over the last dimension, with its backward.

use candle_core::{D, Tensor};

use crate::error::Result;
use crate::util::{expect_float, shape_err};

/// Softmax over the last dimension of `x` (any rank >= 1): `exp(x - max) / sum(exp(x - max))`.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    expect_float(x, "softmax_last_dim", "x")?;
    if x.rank() == 0 {
        return shape_err("softmax_last_dim: x must have rank >= 1");
    }
    let max = x.max_keepdim(D::Minus1)?; // (.., 1)
    let e = x.broadcast_sub(&max)?.exp()?; // (.., C)
    let sum = e.sum_keepdim(D::Minus1)?; // (.., 1)
    Ok(e.broadcast_div(&sum)?)
}

/// Backward of [`softmax_last_dim`] given its output `y`: `dx = y * (dy - sum(dy * y))`.
pub fn softmax_last_dim_backward(y: &Tensor, dy: &Tensor) -> Result<Tensor> {
    if y.dims() != dy.dims() {
        return shape_err(format!(
            "softmax_last_dim_backward: y has shape {:?} but dy has shape {:?}",
            y.dims(),
            dy.dims()
        ));
    }
    let dot = (dy * y)?.sum_keepdim(D::Minus1)?; // (.., 1)
    Ok((y * dy.broadcast_sub(&dot)?)?)
}
