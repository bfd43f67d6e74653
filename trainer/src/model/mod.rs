//! The GPT model (GPT-2 style decoder) split into pipeline stages, with explicit forward/backward per
//! (micro-batch, segment) unit.

pub mod block;
pub mod build;
pub mod compute;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda_stage;
pub mod error;
pub mod norm;
pub mod params;
pub mod partition;
pub mod snapshot;
pub mod stage;

pub use build::build_stage;
pub use compute::{
    CpuStage, DeviceLinks, LinkedInput, LinkedOutput, Neighbour, StageCompute, StageSpec,
    UpdateSettings,
};
pub use config::{ModelConfig, Norm, Position};
pub use error::{ModelError, PartitionError, StateMismatch};
pub use partition::{StageLayout, partition_layers};
pub use snapshot::StateSnapshot;
pub use stage::{Mode, Stage, StageInput, StageOutput};
