//! Raw-slice plumbing for the fused CPU kernels: borrowing a contiguous tensor's elements, the
//! float types the kernels are generic over, deterministic parallel loops, and a strided matrix
//! product on the `gemm` crate (the engine candle's own CPU matmul uses).
//!
//! Determinism rule of every kernel built on these helpers: each output element is computed by one
//! thread, with a fixed order of operations that depends only on the shapes — never on the number
//! of threads. Rows are split into parallel tasks of a size fixed by the row width; reductions over
//! rows ([`for_each_row_summing`], [`sum_rows`]) add rows in order within a task and then the
//! tasks' partial sums in task order.

use candle_core::{DType, Device, Storage, StorageRef, Tensor, WithDType};
use rayon::prelude::*;

use crate::error::Result;
use crate::util::shape_err;

/// The element types of the fused kernels (f32 for training, f64 for gradient checks).
pub(crate) trait Float:
    WithDType + num_traits::Float + std::iter::Sum + Send + Sync + 'static
{
    /// `exp(x)`; for f32 [`exp_f32`] (vectorizes), for f64 the exact one (gradient checks).
    fn exp_fast(self) -> Self;

    /// `tanh(x)`; for f32 a branch-free form that the compiler vectorizes (within a few ulps of
    /// `f32::tanh` in absolute terms), for f64 the exact one.
    fn tanh_fast(self) -> Self;
}

impl Float for f32 {
    #[inline(always)]
    fn exp_fast(self) -> f32 {
        exp_f32(self)
    }

    #[inline(always)]
    fn tanh_fast(self) -> f32 {
        // tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both saturations, no cancellation issue for
        // the GELU (which adds the result to 1).
        1.0 - 2.0 / (exp_f32(2.0 * self) + 1.0)
    }
}

impl Float for f64 {
    #[inline(always)]
    fn exp_fast(self) -> f64 {
        self.exp()
    }

    #[inline(always)]
    fn tanh_fast(self) -> f64 {
        self.tanh()
    }
}

/// `exp(x)` for f32 without a libm call (so loops over it vectorize, with SSE2 alone): Cephes'
/// `expf` — `x = n ln2 + r`, `|r| <= ln2 / 2`, a degree-7 polynomial for `exp(r)`, `2^n` from the
/// exponent bits; relative error about 1 ulp. `x` is clamped to `[-87.3, 88.3]` (no infinities,
/// no subnormals).
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer and leaves it in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.3);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e = p * r * r + r + 1.0;
    let n = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    e * f32::from_bits(((n + 127) as u32) << 23)
}

/// Calls `$f::<f32>(args)` or `$f::<f64>(args)` by `$dtype`; other dtypes are a shape error of `$op`.
macro_rules! dispatch_float {
    ($dtype:expr, $op:expr, $f:ident($($arg:expr),* $(,)?)) => {
        match $dtype {
            candle_core::DType::F32 => $f::<f32>($($arg),*),
            candle_core::DType::F64 => $f::<f64>($($arg),*),
            other => $crate::util::shape_err(format!("{}: unsupported dtype {other:?}", $op)),
        }
    };
}
pub(crate) use dispatch_float;

/// The elements of a contiguous CPU tensor, borrowed while the view lives.
pub(crate) struct View<'a> {
    storage: StorageRef<'a>,
    start: usize,
    end: usize,
}

impl<'a> View<'a> {
    /// Borrows `t`'s elements; `t` must be a contiguous CPU tensor (see [`contiguous`]).
    pub(crate) fn new(t: &'a Tensor, op: &str) -> Result<Self> {
        let (storage, layout) = t.storage_and_layout();
        let Some((start, end)) = layout.contiguous_offsets() else {
            return shape_err(format!("{op}: expected a contiguous tensor"));
        };
        if !matches!(&*storage, Storage::Cpu(_)) {
            return shape_err(format!("{op}: the fused kernels run on the CPU only"));
        }
        Ok(Self {
            storage,
            start,
            end,
        })
    }

    /// The elements as `T` (which must be the tensor's dtype).
    pub(crate) fn slice<T: WithDType>(&self) -> Result<&[T]> {
        let Storage::Cpu(cpu) = &*self.storage else {
            unreachable!("checked in View::new")
        };
        Ok(&T::cpu_storage_as_slice(cpu)?[self.start..self.end])
    }
}

/// `t` itself when it is contiguous, otherwise a contiguous copy; checks the dtype is `dtype`.
pub(crate) fn contiguous(t: &Tensor, dtype: DType, op: &str, name: &str) -> Result<Tensor> {
    if t.dtype() != dtype {
        return shape_err(format!(
            "{op}: {name} has dtype {:?}, expected {dtype:?}",
            t.dtype()
        ));
    }
    Ok(t.contiguous()?)
}

/// A CPU tensor owning `data`. // (shape)
pub(crate) fn tensor<T: Float>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// Elements of the rows handed to one parallel task. The split of rows into tasks depends only on
/// the shapes, so per-task partial sums (see [`for_each_row_summing`]) are the same whatever the
/// number of threads.
const TASK_ELEMS: usize = 1 << 16;

/// Rows per parallel task for rows of `cols` elements.
fn rows_per_task(cols: usize) -> usize {
    (TASK_ELEMS / cols.max(1)).max(1)
}

/// `f(r, out_row)` for every `cols`-wide row `r` of `out`, rows in parallel.
pub(crate) fn for_each_row<T: Float>(
    out: &mut [T],
    cols: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if cols == 0 {
        return;
    }
    let per_task = rows_per_task(cols);
    out.par_chunks_mut(per_task * cols)
        .enumerate()
        .for_each(|(task, chunk)| {
            for (i, row) in chunk.chunks_mut(cols).enumerate() {
                f(task * per_task + i, row);
            }
        });
}

/// As [`for_each_row`], and sums per-row contributions over the rows: `f(r, out_row, acc)` adds row
/// `r`'s to `acc` (`acc_len` long). Each task sums its rows in order; the tasks' partial sums are
/// then added in task order. Returns the sums.
pub(crate) fn for_each_row_summing<T: Float>(
    out: &mut [T],
    cols: usize,
    acc_len: usize,
    f: impl Fn(usize, &mut [T], &mut [T]) + Sync,
) -> Vec<T> {
    if cols == 0 {
        return vec![T::zero(); acc_len];
    }
    let per_task = rows_per_task(cols);
    let partials: Vec<Vec<T>> = out
        .par_chunks_mut(per_task * cols)
        .enumerate()
        .map(|(task, chunk)| {
            let mut acc = vec![T::zero(); acc_len];
            for (i, row) in chunk.chunks_mut(cols).enumerate() {
                f(task * per_task + i, row, &mut acc);
            }
            acc
        })
        .collect();
    add_in_order(partials, acc_len)
}

/// `sum over r in 0..rows` of the `acc_len`-long contributions `f(r, acc)` adds, for rows of
/// `cols` elements; the same split and order as [`for_each_row_summing`].
pub(crate) fn sum_rows<T: Float>(
    rows: usize,
    cols: usize,
    acc_len: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) -> Vec<T> {
    let per_task = rows_per_task(cols);
    let partials: Vec<Vec<T>> = (0..rows.div_ceil(per_task))
        .into_par_iter()
        .map(|task| {
            let mut acc = vec![T::zero(); acc_len];
            for r in task * per_task..((task + 1) * per_task).min(rows) {
                f(r, &mut acc);
            }
            acc
        })
        .collect();
    add_in_order(partials, acc_len)
}

fn add_in_order<T: Float>(partials: Vec<Vec<T>>, len: usize) -> Vec<T> {
    let mut total = vec![T::zero(); len];
    for p in partials {
        total.iter_mut().zip(p).for_each(|(t, v)| *t += v);
    }
    total
}

/// Lanes of [`lane_sum`] and [`lane_max`]: one AVX register of f32.
const LANES: usize = 8;

/// The sum of `xs` in a fixed order that vectorizes: lane `j` sums `xs[j]`, `xs[j + 8]`, …, then
/// the lanes are added in order. The order depends only on `xs.len()`, never on the thread count.
#[inline(always)]
pub(crate) fn lane_sum<T: Float>(xs: &[T]) -> T {
    lane_sum_by(xs, |x| x)
}

/// `f` of every element of `xs`, summed in the order of [`lane_sum`] (so that
/// `lane_sum_by(xs, f)` equals `lane_sum` of the mapped values, bit for bit).
#[inline(always)]
pub(crate) fn lane_sum_by<T: Float>(xs: &[T], f: impl Fn(T) -> T) -> T {
    lane_fold(xs, T::zero(), |a, x| a + f(x), |s, a| s + a)
}

/// The largest of `xs` (`-inf` for none; NaNs are ignored, as by `f32::max`), in lanes that
/// vectorize. Exact: the maximum does not depend on the order.
#[inline(always)]
pub(crate) fn lane_max<T: Float>(xs: &[T]) -> T {
    let max = num_traits::Float::max;
    lane_fold(xs, T::neg_infinity(), max, max)
}

/// Folds `xs` in [`LANES`] lanes starting at `init` (lane `j` takes `xs[j]`, `xs[j + 8]`, … in
/// order, through `step`), then combines the lanes in order, from `init`, with `combine`.
#[inline(always)]
fn lane_fold<T: Float>(
    xs: &[T],
    init: T,
    step: impl Fn(T, T) -> T,
    combine: impl Fn(T, T) -> T,
) -> T {
    let mut acc = [init; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = step(*a, x);
        }
    }
    for (a, &x) in acc.iter_mut().zip(rest) {
        *a = step(*a, x);
    }
    acc.into_iter().fold(init, combine)
}

/// `acc += row`, elementwise.
pub(crate) fn add_assign<T: Float>(acc: &mut [T], row: &[T]) {
    acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
}

/// A strided read-only matrix: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    data: &'a [T],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// A row-major `(rows, cols)` matrix with row stride `rs` (`>= cols`).
    pub(crate) fn rows(data: &'a [T], rows: usize, cols: usize, rs: usize) -> Self {
        Self::strided(data, rows, cols, rs, 1)
    }

    /// The transpose of the row-major `(cols, rows)` matrix with row stride `rs`.
    pub(crate) fn transposed(data: &'a [T], rows: usize, cols: usize, rs: usize) -> Self {
        Self::strided(data, rows, cols, 1, rs)
    }

    fn strided(data: &'a [T], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        let extent = if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * rs + (cols - 1) * cs + 1
        };
        assert!(
            extent <= data.len(),
            "matrix ({rows}, {cols}) with strides ({rs}, {cs}) needs {extent} elements, slice has {}",
            data.len()
        );
        Self {
            data,
            rows,
            cols,
            rs,
            cs,
        }
    }
}

/// Whether [`matmul`] may use several threads (the caller is not itself a parallel task).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Threads {
    /// Use the rayon pool (`RAYON_NUM_THREADS` threads, as candle's matmul).
    Pool,
    /// Run on the calling thread.
    One,
}

/// `dst = lhs · rhs` (or `dst += lhs · rhs` when `accumulate`), `dst` row-major `(m, n)` with
/// row stride `dst_rs`.
pub(crate) fn matmul<T: Float>(
    dst: &mut [T],
    dst_rs: usize,
    accumulate: bool,
    lhs: Mat<'_, T>,
    rhs: Mat<'_, T>,
    threads: Threads,
) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    assert_eq!(rhs.rows, k, "matmul: inner dimensions differ");
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        (m - 1) * dst_rs + n <= dst.len() && dst_rs >= n,
        "matmul: destination too small"
    );
    if k == 0 {
        if !accumulate {
            for row in dst.chunks_mut(dst_rs).take(m) {
                row[..n].fill(T::zero());
            }
        }
        return;
    }
    let parallelism = match threads {
        Threads::Pool if rayon::current_num_threads() > 1 => {
            gemm::Parallelism::Rayon(rayon::current_num_threads())
        }
        _ => gemm::Parallelism::None,
    };
    // SAFETY: the extents of lhs and rhs were checked by `Mat::strided`, that of dst above; dst is
    // exclusively borrowed and does not alias the shared inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_reductions_are_exact_where_they_must_be_and_fixed_in_order() {
        for n in [0usize, 1, 7, 8, 9, 31, 1000] {
            let xs: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37)
                .collect();
            let seq: f64 = xs.iter().map(|&x| x as f64).sum();
            let lanes = lane_sum(&xs);
            assert!(
                (lanes as f64 - seq).abs() <= 1e-4 * (1.0 + seq.abs()),
                "n={n}: {lanes} vs {seq}"
            );
            // The mapped sum is the sum of the mapped values, bit for bit.
            let mapped: Vec<f32> = xs.iter().map(|&x| exp_f32(x * 0.1)).collect();
            assert_eq!(
                lane_sum_by(&xs, |x| exp_f32(x * 0.1)).to_bits(),
                lane_sum(&mapped).to_bits()
            );
            let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(lane_max(&xs).to_bits(), max.to_bits(), "n={n}");
        }
        // NaNs are ignored, as by f32::max; an all-NaN row has no maximum.
        assert_eq!(lane_max(&[1.0f32, f32::NAN, 3.0, f32::NAN]), 3.0);
        assert_eq!(lane_max::<f32>(&[]), f32::NEG_INFINITY);
    }

    #[test]
    fn exp_f32_is_within_two_ulps() {
        let mut worst = 0.0f64;
        for i in -87_000..88_000 {
            let x = i as f32 * 1e-3 + 1.234e-4;
            let exact = (x as f64).exp();
            let rel = ((exp_f32(x) as f64 - exact) / exact).abs();
            worst = worst.max(rel);
        }
        assert!(
            worst < 2.0 * f32::EPSILON as f64,
            "worst relative error {worst:e}"
        );
        assert_eq!(exp_f32(-1000.0), exp_f32(-87.3));
        assert!(exp_f32(1000.0).is_finite());
    }

    #[test]
    fn tanh_fast_is_close_in_absolute_terms() {
        for i in -20_000..20_000 {
            let x = i as f32 * 1e-3;
            let err = (x.tanh_fast() as f64 - (x as f64).tanh()).abs();
            assert!(err < 4.0 * f32::EPSILON as f64, "tanh({x}): error {err:e}");
        }
        assert_eq!(100.0f32.tanh_fast(), 1.0);
        assert_eq!((-100.0f32).tanh_fast(), -1.0);
    }
}
