//! Explicit forward/backward kernels for the seqpipe GPT model, plus AdamW and global
//! gradient-norm clipping, on candle tensors.
//!
//! Every kernel follows the project convention (see `docs/DESIGN-NOTES.md`):
//! `*_forward(inputs) -> (output, Ctx)` and `*_backward(&Ctx, params, d_output) -> (d_input, Grads)`.
//! Backward functions never accumulate into caller state; they return fresh gradient tensors.
//! No kernel uses candle's autograd: all derivatives are written out by hand, so the kernels are
//! cheap to call and deterministic (same inputs give bit-identical outputs for a fixed thread count).
//! All kernels are generic over the floating-point dtype (F32 for training, F64 in gradient tests).
//! [`sum_tree`] fixes the order in which per-micro-batch gradients are summed, so the sum does not
//! depend on how micro-batches are spread over data-parallel replicas.

#![deny(missing_docs)]

pub mod adamw;
pub mod attention;
#[cfg(test)]
mod attention_frozen;
pub mod clip;
mod cpu;
pub mod cross_entropy;
pub mod documents;
pub mod embedding;
pub mod error;
pub mod gelu;
pub mod linear;
pub mod lm_head;
pub mod memory;
pub mod norm;
pub mod pool;
pub mod rope;
pub mod softmax;
pub mod sum_tree;
mod util;

pub use adamw::{AdamW, AdamWConfig, Moments};
pub use attention::{
    AttentionCtx, causal_prefix_attention_backward, causal_prefix_attention_forward,
    document_prefix_attention_backward, document_prefix_attention_forward,
};
pub use clip::{clip_coefficient, global_norm, sum_of_squares};
pub use cross_entropy::{cross_entropy_forward_backward, cross_entropy_loss};
pub use documents::{DocumentMask, doc_start};
pub use embedding::{embedding_backward, embedding_forward};
pub use error::{OpsError, Result};
pub use gelu::{GeluCtx, gelu_backward, gelu_forward};
pub use linear::{
    LinearCtx, LinearGrads, linear_backward, linear_backward_input, linear_backward_weight,
    linear_forward,
};
pub use lm_head::{LmHeadGrads, lm_head_loss, lm_head_loss_forward_backward};
pub use memory::{SavedTensors, TensorBytes};
pub use norm::{
    NormCtx, NormGrads, layer_norm_backward, layer_norm_forward, rms_norm_backward,
    rms_norm_forward,
};
pub use rope::RopeTable;
pub use softmax::{softmax_last_dim, softmax_last_dim_backward};
pub use sum_tree::{SumTree, SumTreeError, is_node, valid_replicas};
