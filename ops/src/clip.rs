//! Global gradient-norm clipping helpers.

use candle_core::{CpuStorage, DType, Storage, Tensor};

use crate::error::Result;

fn sum_sq_f32(xs: &[f32]) -> f64 {
    xs.iter().fold(0.0f64, |acc, &x| {
        let x = x as f64;
        acc + x * x
    })
}

fn sum_sq_f64(xs: &[f64]) -> f64 {
    xs.iter().fold(0.0f64, |acc, &x| acc + x * x)
}

/// Sum of the squares of all elements of `t`, accumulated sequentially in f64 in row-major
/// element order (deterministic, and precise for f32 tensors).
pub fn sum_of_squares(t: &Tensor) -> Result<f64> {
    let t = t.contiguous()?;
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            match cpu {
                CpuStorage::F32(xs) => return Ok(sum_sq_f32(&xs[start..end])),
                CpuStorage::F64(xs) => return Ok(sum_sq_f64(&xs[start..end])),
                _ => {}
            }
        }
    }
    // Other dtypes or devices: go through an f64 copy.
    let xs = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    Ok(sum_sq_f64(&xs))
}

/// Sums per-tensor sums of squares in the order given (callers pass canonical parameter order,
/// so the result does not depend on how parameters are partitioned) and returns the L2 norm.
pub fn global_norm(sums_of_squares: impl IntoIterator<Item = f64>) -> f64 {
    sums_of_squares
        .into_iter()
        .fold(0.0f64, |acc, s| acc + s)
        .sqrt()
}

/// Factor to multiply every gradient by: `min(1, max_norm / (total_norm + 1e-6))`, or `1.0`
/// when `max_norm <= 0` (clipping off). A NaN `total_norm` yields `1.0` (f64::min semantics),
/// so callers should check the norm for finiteness themselves.
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    (max_norm / (total_norm + 1e-6)).min(1.0)
}
