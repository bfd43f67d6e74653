//! The GPT model (GPT-2 style decoder) split into pipeline stages, with explicit forward/backward per
//! (micro-batch, segment) unit. The device-independent parts (config, parameter names and init, the
//! layer split, errors, the step's gradient bookkeeping) live in the `model` crate and are
//! re-exported here under their old paths; this module holds the CPU stage and the device adapters.

pub mod block;
pub mod build;
pub mod compute;
#[cfg(feature = "cuda")]
pub mod cuda_stage;
pub mod norm;
pub mod snapshot;
pub mod stage;
mod unit;

pub use ::model::{
    ModelConfig, ModelError, Norm, PartitionError, Position, StageLayout, StateMismatch,
    partition_layers,
};
pub use ::model::{config, error, grads, params, partition};
pub use build::build_stage;
pub use compute::{
    CpuStage, DeviceLinks, LinkedInput, LinkedOutput, Neighbour, StageCompute, StageSpec,
    UpdateSettings,
};
pub use snapshot::StateSnapshot;
pub use stage::{Mode, Stage, StageInput, StageOutput};
