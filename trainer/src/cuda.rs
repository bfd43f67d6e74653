//! Whether the configured device can run here: refuses `model.device = "cuda"` where it cannot,
//! before any worker starts. The `seqpipe gpu` commands (kernel checks, the one-GPU benchmark) are
//! the binary's.

use anyhow::Result;

use crate::model::config::{DeviceKind, ModelConfig};

/// Refuses a config whose stages cannot run here: `model.device = "cuda"` needs a binary built
/// with `--features cuda`, the CUDA libraries and a GPU, and learned positions.
pub fn require_runnable_device(model: &ModelConfig) -> Result<()> {
    if model.device == DeviceKind::Cpu {
        return Ok(());
    }
    #[cfg(not(feature = "cuda"))]
    return Err(anyhow::anyhow!(crate::model::compute::NO_CUDA_BUILD));
    #[cfg(feature = "cuda")]
    {
        crate::model::cuda_stage::runnable(model)?;
        Ok(())
    }
}
