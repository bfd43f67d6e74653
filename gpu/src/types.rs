//! What both device backends (the CUDA one in `device`, and the CPU emulation in `device_emu` with
//! the `emulate` feature) share: the matrix-product precision and the kernel launch arguments.

use crate::error::{Result, shape};

/// How matrix products compute. Element-wise kernels are FP32 in every mode; so is attention, except
/// in `Bf16` mode on compute capability 8.0 and later (the emulation included), where its products
/// run on tensor cores with BF16 operands (`attn_tc_*` of kernels.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// FP32 inputs and arithmetic (cuBLAS `COMPUTE_32F`).
    Fp32,
    /// FP32 inputs, TF32 tensor cores (`COMPUTE_32F_FAST_TF32`).
    Tf32,
    /// BF16 operands on the tensor cores with FP32 accumulation, attention included (how the
    /// products get them: `kernels::Bf16Path`, by default BF16 copies of the weights and
    /// activations rounded per product); master weights, gradients and AdamW state stay FP32.
    Bf16,
}

impl Precision {
    /// Every precision, in the order reports list them.
    pub const ALL: [Precision; 3] = [Precision::Fp32, Precision::Tf32, Precision::Bf16];

    /// `fp32`, `tf32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown precision `{s}`: expected fp32, tf32 or bf16"))
    }
}

/// One argument of a kernel launch.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    /// A device address.
    P(u64),
    /// An `int`.
    I(i32),
    /// A `long long`.
    L(i64),
    /// A `float`.
    F(f32),
}

/// `n` as a kernel's `int`, or a shape error naming `what`.
pub(crate) fn int(n: usize, op: &'static str, what: &str) -> Result<i32> {
    i32::try_from(n).or_else(|_| shape(op, format!("{what} = {n} does not fit a 32-bit int")))
}

/// Each argument's bytes in an 8-byte slot (an `int` or `float` in the first four), as a kernel
/// launch passes them by address.
pub(crate) fn pack(args: &[Arg]) -> Vec<[u8; 8]> {
    args.iter()
        .map(|a| {
            let mut b = [0u8; 8];
            match *a {
                Arg::P(p) => b.copy_from_slice(&p.to_ne_bytes()),
                Arg::L(l) => b.copy_from_slice(&l.to_ne_bytes()),
                Arg::I(i) => b[..4].copy_from_slice(&i.to_ne_bytes()),
                Arg::F(x) => b[..4].copy_from_slice(&x.to_ne_bytes()),
            }
            b
        })
        .collect()
}

/// That `n` elements fit a buffer of `len` (`op` moves them `into` or `from` it), or a shape
/// error saying both sizes.
pub(crate) fn fits(op: &'static str, n: usize, preposition: &str, len: usize) -> Result<()> {
    if n > len {
        return shape(op, format!("{n} elements {preposition} a buffer of {len}"));
    }
    Ok(())
}

/// What a matrix product reads: FP32 operands, or BF16 ones (16-bit words, as `to_bf16` writes
/// them). `C` is FP32 either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operands {
    /// FP32; the arithmetic follows the GPU's precision.
    F32,
    /// BF16, multiplied with FP32 accumulation.
    Bf16,
}
