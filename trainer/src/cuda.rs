//! Whether the configured device can run here: refuses `model.device = "cuda"` where it cannot,
//! before any worker starts. The `seqpipe gpu` commands (kernel checks, the one-GPU benchmark) are
//! the binary's.

use anyhow::{Result, bail};

use crate::model::config::{DeviceKind, ModelConfig};

/// Refuses a config whose stages cannot run here: `model.device = "cuda"` needs a binary built
/// with `--features cuda`, the CUDA libraries and a GPU, and learned positions.
pub fn require_runnable_device(model: &ModelConfig) -> Result<()> {
    if model.device == DeviceKind::Cpu {
        return Ok(());
    }
    #[cfg(not(feature = "cuda"))]
    bail!(crate::model::compute::NO_CUDA_BUILD);
    #[cfg(feature = "cuda")]
    {
        use crate::model::config::Position;
        if model.position == Position::Rope {
            bail!(
                "model.device = \"cuda\" supports learned positions only (model.position = \"learned\"); RoPE models run on the CPU (model.device = \"cpu\")"
            );
        }
        let count =
            gpu::device_count().map_err(|e| anyhow::anyhow!("model.device = \"cuda\": {e}"))?;
        if count == 0 {
            bail!(
                "model.device = \"cuda\": the NVIDIA driver shows no GPU (check CUDA_VISIBLE_DEVICES), or set model.device = \"cpu\""
            );
        }
        Ok(())
    }
}
