//! Picks a stage's implementation from `model.device`: the one place that knows every device
//! ([`CpuStage`], and [`super::cuda_stage::CudaStage`] in a binary built with `--features cuda`), so
//! that neither implementation needs the other.

#[cfg(not(feature = "cuda"))]
use super::compute::NO_CUDA_BUILD;
use super::compute::{CpuStage, StageCompute, StageSpec};
use super::config::{DeviceKind, ModelConfig};
#[cfg(feature = "cuda")]
use super::cuda_stage::CudaStage;
use super::error::ModelError;

/// The stage for `model.device`: [`CpuStage`], or (in a binary built with `--features cuda`)
/// [`super::cuda_stage::CudaStage`] on the worker's GPU. A CUDA config that cannot run here is
/// refused before any worker starts ([`crate::cuda::require_runnable_device`]), and here too, with
/// the same advice.
pub fn build_stage(
    model: &ModelConfig,
    spec: StageSpec,
) -> Result<Box<dyn StageCompute>, ModelError> {
    match model.device {
        DeviceKind::Cpu => Ok(Box::new(CpuStage::new(model, spec)?)),
        #[cfg(feature = "cuda")]
        DeviceKind::Cuda => Ok(Box::new(CudaStage::new(model, spec)?)),
        #[cfg(not(feature = "cuda"))]
        DeviceKind::Cuda => Err(ModelError::Device(NO_CUDA_BUILD.into())),
    }
}
