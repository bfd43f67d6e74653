//! Private helpers: argument validation.

use candle_core::{DType, Tensor};

use crate::error::{OpsError, Result};

/// Returns an [`OpsError::Shape`] built from `msg`.
pub(crate) fn shape_err<T>(msg: impl Into<String>) -> Result<T> {
    Err(OpsError::Shape(msg.into()))
}

/// Checks that `t` has rank 2 and returns its dims.
pub(crate) fn dims2(t: &Tensor, op: &str, name: &str) -> Result<(usize, usize)> {
    match t.dims() {
        &[a, b] => Ok((a, b)),
        d => shape_err(format!("{op}: {name} must be 2-D, got shape {d:?}")),
    }
}

/// Checks that `t` has rank 4 and returns its dims.
pub(crate) fn dims4(t: &Tensor, op: &str, name: &str) -> Result<(usize, usize, usize, usize)> {
    match t.dims() {
        &[a, b, c, d] => Ok((a, b, c, d)),
        d => shape_err(format!("{op}: {name} must be 4-D, got shape {d:?}")),
    }
}

/// Checks that `t` has exactly the shape `expected`.
pub(crate) fn expect_shape(t: &Tensor, expected: &[usize], op: &str, name: &str) -> Result<()> {
    if t.dims() != expected {
        return shape_err(format!(
            "{op}: {name} must have shape {expected:?}, got {:?}",
            t.dims()
        ));
    }
    Ok(())
}

/// Checks that `t` is a floating-point tensor.
pub(crate) fn expect_float(t: &Tensor, op: &str, name: &str) -> Result<()> {
    if !t.dtype().is_float() {
        return shape_err(format!(
            "{op}: {name} must be a floating-point tensor, got {:?}",
            t.dtype()
        ));
    }
    Ok(())
}

/// Checks that `ids` is a 1-D U32 tensor whose values are all `< bound` and returns its length.
pub(crate) fn check_indices(ids: &Tensor, bound: usize, op: &str, name: &str) -> Result<usize> {
    if ids.dtype() != DType::U32 {
        return shape_err(format!(
            "{op}: {name} must have dtype U32, got {:?}",
            ids.dtype()
        ));
    }
    let n = match ids.dims() {
        &[n] => n,
        d => return shape_err(format!("{op}: {name} must be 1-D, got shape {d:?}")),
    };
    let values = ids.to_vec1::<u32>()?;
    if let Some((i, &bad)) = values
        .iter()
        .enumerate()
        .find(|&(_, &v)| v as usize >= bound)
    {
        return shape_err(format!(
            "{op}: {name}[{i}] = {bad} is out of range (must be < {bound})"
        ));
    }
    Ok(n)
}
