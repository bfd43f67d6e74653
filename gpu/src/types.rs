//! What both device backends (the CUDA one in `device`, and the CPU emulation in `device_emu` with
//! the `emulate` feature) share: the matrix-product precision, BF16 mode's operand path and scratch,
//! and the kernel launch arguments.

use std::cell::RefCell;

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

/// Which tensor-core attention kernels BF16 mode launches (FP32 attention has one version):
/// `v2`, the `attn_tc2_*` kernels (the default: shared tiles in the layout their fragments read,
/// 16-byte loads, two query tiles per warp in the forward; see kernels.cu; 1.71× v1's attention
/// time on a GPT-2 bf16 step on an H200, BENCHMARKS.md § GPU), or `v1`, the `attn_tc_*` ones. Both keep the same contract and are checked against the CPU oracle by
/// `seqpipe gpu check`; `SEQPIPE_ATTENTION` chooses when a `Gpu` is opened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionKernels {
    /// `attn_tc_*`.
    V1,
    /// `attn_tc2_*` (and `attn_tc2_backward_delta`).
    #[default]
    V2,
}

impl AttentionKernels {
    /// The environment variable [`AttentionKernels::from_env`] reads.
    pub const ENV: &'static str = "SEQPIPE_ATTENTION";
    /// Both versions, in the order reports list them.
    pub const ALL: [AttentionKernels; 2] = [AttentionKernels::V1, AttentionKernels::V2];

    /// `v1` or `v2`.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKernels::V1 => "v1",
            AttentionKernels::V2 => "v2",
        }
    }

    /// The version `SEQPIPE_ATTENTION` names (`v2` when unset or empty); any other value is an
    /// error naming the accepted ones.
    pub fn from_env() -> Result<AttentionKernels> {
        match std::env::var(Self::ENV) {
            Err(std::env::VarError::NotPresent) => Ok(AttentionKernels::default()),
            Err(std::env::VarError::NotUnicode(v)) => Err(crate::error::GpuError::Env {
                name: Self::ENV,
                value: v.to_string_lossy().into_owned(),
                reason: "expected v1 or v2".into(),
            }),
            Ok(v) if v.is_empty() => Ok(AttentionKernels::default()),
            Ok(v) => v.parse().map_err(|reason| crate::error::GpuError::Env {
                name: Self::ENV,
                value: v,
                reason,
            }),
        }
    }
}

impl std::str::FromStr for AttentionKernels {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "v1" => Ok(AttentionKernels::V1),
            "v2" => Ok(AttentionKernels::V2),
            _ => Err(format!(
                "unknown attention kernels {s:?}: expected v1 (attn_tc_*) or v2 (attn_tc2_*, the default)"
            )),
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

/// How BF16 mode feeds its matrix products to the tensor cores ([`crate::Gpu::set_bf16_path`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bf16Path {
    /// The stage keeps BF16 copies of its weights, refreshed once after each update, and rounds
    /// only the activation operand of a product into BF16 (once where two products share it);
    /// the LM head's products run over a vocabulary padded to a multiple of
    /// [`crate::stage::VOCAB_PADDING`]. The default.
    #[default]
    CachedWeights,
    /// Both operands of every product rounded into BF16 copies first ([`crate::Gpu::to_bf16`]).
    Operands,
    /// FP32 operands that cuBLAS rounds itself (`CUBLAS_COMPUTE_32F_FAST_16BF`).
    Fp32Operands,
}

impl Bf16Path {
    /// The path's name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Path::CachedWeights => "cached-weights",
            Bf16Path::Operands => "operands",
            Bf16Path::Fp32Operands => "fp32-operands",
        }
    }
}

impl std::str::FromStr for Bf16Path {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        [
            Bf16Path::CachedWeights,
            Bf16Path::Operands,
            Bf16Path::Fp32Operands,
        ]
        .into_iter()
        .find(|p| p.name() == s)
        .ok_or_else(|| {
            format!("unknown BF16 path {s:?}: use cached-weights, operands or fp32-operands")
        })
    }
}

/// BF16 mode's path, and the BF16 copies of a product's two operands for
/// [`Bf16Path::Operands`]: grown to the largest product seen and reused (products run in order
/// on one stream). `B` is the backend's buffer of 16-bit words (`Buf<u16>`): the device holds the
/// scratch, `kernels` uses it, and neither needs the other for its type.
pub(crate) struct OperandScratch<B> {
    pub(crate) path: Bf16Path,
    pub(crate) bufs: RefCell<[Option<B>; 2]>,
}

impl<B> Default for OperandScratch<B> {
    fn default() -> Self {
        Self {
            path: Bf16Path::default(),
            bufs: RefCell::new([None, None]),
        }
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

#[cfg(test)]
mod tests {
    use super::AttentionKernels;

    #[test]
    fn attention_kernel_versions_parse_by_name_and_refuse_others_saying_what_is_accepted() {
        for k in AttentionKernels::ALL {
            assert_eq!(k.name().parse::<AttentionKernels>(), Ok(k));
        }
        assert_eq!(AttentionKernels::default(), AttentionKernels::V2);
        let err = "V2".parse::<AttentionKernels>().unwrap_err();
        assert!(
            err.contains("\"V2\"") && err.contains("v1") && err.contains("v2"),
            "{err}"
        );
    }
}
