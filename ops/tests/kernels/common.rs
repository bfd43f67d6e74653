//! Shared test helpers: seeded random tensors and central finite differences.

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Finite-difference step.
pub const H: f64 = 1e-5;
/// Relative tolerance of gradient checks.
pub const RTOL: f64 = 1e-6;
/// Absolute tolerance of gradient checks (for entries close to zero).
pub const ATOL: f64 = 1e-8;

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Uniform(-1, 1) f64 tensor of the given shape.
pub fn rand_t(rng: &mut ChaCha8Rng, shape: &[usize]) -> Tensor {
    rand_scaled(rng, shape, 1.0)
}

/// Uniform(-scale, scale) f64 tensor of the given shape.
pub fn rand_scaled(rng: &mut ChaCha8Rng, shape: &[usize], scale: f64) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f64> = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// Random U32 indices in `0..bound`.
pub fn rand_ids(rng: &mut ChaCha8Rng, n: usize, bound: u32) -> Tensor {
    let data: Vec<u32> = (0..n).map(|_| rng.random_range(0..bound)).collect();
    Tensor::from_vec(data, n, &Device::Cpu).unwrap()
}

/// All elements as f64, row-major.
pub fn vals(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// `sum(g * out)` in f64.
pub fn dot(g: &Tensor, out: &Tensor) -> f64 {
    assert_eq!(g.dims(), out.dims(), "dot: shape mismatch");
    vals(g).iter().zip(vals(out)).map(|(a, b)| a * b).sum()
}

/// Central finite-difference gradient of the scalar `f(inputs)` with respect to `inputs[which]`.
pub fn fd_grad(f: &dyn Fn(&[Tensor]) -> f64, inputs: &[Tensor], which: usize) -> Vec<f64> {
    let base = vals(&inputs[which]);
    let shape = inputs[which].dims().to_vec();
    let mut grad = Vec::with_capacity(base.len());
    let mut args = inputs.to_vec();
    for i in 0..base.len() {
        let mut eval = |delta: f64| {
            let mut data = base.clone();
            data[i] += delta;
            args[which] = Tensor::from_vec(data, shape.as_slice(), &Device::Cpu).unwrap();
            f(&args)
        };
        let fp = eval(H);
        let fm = eval(-H);
        grad.push((fp - fm) / (2.0 * H));
    }
    grad
}

/// Element-wise `|a - e| <= rtol * |e| + atol`, with a readable failure message.
pub fn assert_close_vec(actual: &[f64], expected: &[f64], rtol: f64, atol: f64, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length mismatch");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        let err = (a - e).abs();
        let tol = rtol * e.abs() + atol;
        assert!(
            err <= tol,
            "{what}: element {i}: actual {a:e} expected {e:e} (|diff| {err:e} > tol {tol:e})"
        );
    }
}

/// [`assert_close_vec`] for tensors (any dtype), also checking the shape.
pub fn assert_close(actual: &Tensor, expected: &Tensor, rtol: f64, atol: f64, what: &str) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape mismatch");
    assert_close_vec(&vals(actual), &vals(expected), rtol, atol, what);
}

/// Checks an analytic gradient against central finite differences of `f` w.r.t. `inputs[which]`.
pub fn check_grad(
    f: &dyn Fn(&[Tensor]) -> f64,
    inputs: &[Tensor],
    which: usize,
    analytic: &Tensor,
    what: &str,
) {
    assert_eq!(
        analytic.dims(),
        inputs[which].dims(),
        "{what}: gradient shape"
    );
    assert_eq!(analytic.dtype(), DType::F64, "{what}: gradient dtype");
    let numeric = fd_grad(f, inputs, which);
    assert_close_vec(&vals(analytic), &numeric, RTOL, ATOL, what);
}

/// Bit-exact equality of two tensors (same dtype and shape).
pub fn assert_bit_identical(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.dtype(), b.dtype(), "{what}: dtype");
    assert_eq!(a.dims(), b.dims(), "{what}: shape");
    let (va, vb) = (vals(a), vals(b));
    for (i, (x, y)) in va.iter().zip(&vb).enumerate() {
        assert_eq!(
            x.to_bits(),
            y.to_bits(),
            "{what}: element {i}: {x:e} vs {y:e}"
        );
    }
}

/// Converts to F32 (for dtype-coverage tests).
pub fn f32t(t: &Tensor) -> Tensor {
    t.to_dtype(DType::F32).unwrap()
}
