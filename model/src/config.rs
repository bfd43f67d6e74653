//! The `[model]` config section: the GPT's shape.

use serde::{Deserialize, Serialize};

/// How token positions enter the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Position {
    /// GPT-2's learned absolute position embeddings (`wpe.weight`).
    Learned,
    /// Rotary embeddings applied to queries and keys (long-context configs).
    Rope,
}

/// Which normalization the blocks and the final norm use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Norm {
    /// LayerNorm with weight and bias (GPT-2).
    LayerNorm,
    /// RMSNorm with weight only.
    RmsNorm,
}

/// Where a stage's kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The CPU kernels of `ops` (the oracle).
    Cpu,
    /// The CUDA kernels of the `gpu` crate (a worker's GPU is its slot on the node); needs a
    /// binary built with `--features cuda`.
    Cuda,
}

/// How a CUDA stage's matrix products compute (the CPU is always FP32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionKind {
    /// FP32 throughout.
    Fp32,
    /// TF32 tensor cores for matrix products.
    Tf32,
    /// BF16 tensor cores for matrix products; FP32 master weights, gradients and AdamW state.
    Bf16,
}

/// `[model]`: a GPT-2 style decoder (pre-LN blocks, fused QKV, GELU MLP, untied LM head).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Vocabulary size (token ids must be below it).
    pub vocab_size: usize,
    /// Number of transformer blocks.
    pub layers: usize,
    /// Hidden width C.
    pub d_model: usize,
    /// Attention heads; `d_model` must be divisible by it.
    pub heads: usize,
    /// MLP width as a multiple of `d_model`.
    pub ffn_mult: usize,
    /// Longest sequence the model supports (size of the position table).
    pub max_seq_len: usize,
    /// `learned` or `rope`.
    pub position: Position,
    /// `layernorm` or `rmsnorm`.
    pub norm: Norm,
    /// RoPE base frequency.
    pub rope_base: f64,
    /// Epsilon of the norms.
    pub norm_eps: f64,
    /// Standard deviation of the normal weight init (residual projections are scaled by 1/sqrt(2·layers)).
    pub init_std: f64,
    /// `cpu` or `cuda`.
    pub device: DeviceKind,
    /// `fp32`, `tf32` or `bf16` (CUDA only).
    pub precision: PrecisionKind,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            vocab_size: 512,
            layers: 4,
            d_model: 192,
            heads: 6,
            ffn_mult: 4,
            max_seq_len: 128,
            position: Position::Learned,
            norm: Norm::LayerNorm,
            rope_base: 10_000.0,
            norm_eps: 1e-5,
            init_std: 0.02,
            device: DeviceKind::Cpu,
            precision: PrecisionKind::Fp32,
        }
    }
}

impl ModelConfig {
    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads
    }

    /// Width of the MLP's hidden layer.
    pub fn ffn(&self) -> usize {
        self.d_model * self.ffn_mult
    }
}
