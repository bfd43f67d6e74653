//! Whether the configured device can run here: refuses `model.device = "cuda"` where it cannot,
//! before any worker starts. The `seqpipe gpu` commands (kernel checks, the one-GPU benchmark) are
//! the binary's.

use anyhow::{Result, bail};

use crate::model::config::{DeviceKind, ModelConfig};

/// Refuses a config whose stages cannot run here: `model.device = "cuda"` needs a binary built
/// with `--features cuda`, the CUDA libraries and a GPU — and the pipeline runtime does not run
/// CUDA stages yet.
pub fn require_runnable_device(model: &ModelConfig) -> Result<()> {
    if model.device == DeviceKind::Cpu {
        return Ok(());
    }
    #[cfg(not(feature = "cuda"))]
    bail!(
        "model.device = \"cuda\": this seqpipe was built without CUDA support; rebuild with `cargo build --release --features cuda`, or set model.device = \"cpu\""
    );
    #[cfg(feature = "cuda")]
    {
        gpu::libraries_present()?;
        bail!(crate::model::compute::NO_CUDA_STAGES)
    }
}
