//! Whether the configured device can run here: refuses `model.device = "cuda"` where it cannot,
//! before any worker starts. The `seqpipe gpu` commands (kernel checks, the one-GPU benchmark) are
//! the binary's.

use anyhow::Result;

use crate::config::Config;
use crate::model::config::DeviceKind;

/// Refuses a config whose stages cannot run here: `model.device = "cuda"` needs a binary built
/// with `--features cuda`, the CUDA libraries and a GPU, and learned positions;
/// `pipeline.transport = "nccl"` needs libnccl too.
pub fn require_runnable_device(cfg: &Config) -> Result<()> {
    if cfg.model.device == DeviceKind::Cpu {
        return Ok(());
    }
    #[cfg(not(feature = "cuda"))]
    return Err(anyhow::anyhow!(crate::model::compute::NO_CUDA_BUILD));
    #[cfg(feature = "cuda")]
    {
        crate::model::cuda_stage::runnable(&cfg.model)?;
        if cfg.pipeline.transport == crate::config::StageTransport::Nccl {
            gpu::nccl::nccl_present().map_err(|e| {
                anyhow::anyhow!(
                    "pipeline.transport = \"nccl\": {e} (or set pipeline.transport = \"tcp\")"
                )
            })?;
        }
        Ok(())
    }
}
