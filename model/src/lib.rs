//! The GPT model (GPT-2 style decoder) and its pipeline stage, independent of the device that runs
//! the kernels: the `[model]` config, parameter names, shapes and seeded init, the transformer
//! block's forward/backward order over a device trait ([`block`]), the stage's program for a unit
//! (embeddings or received input → blocks → head and loss or output, and back) over a device
//! trait ([`program`]), which layers each stage holds, the errors a stage can refuse with, the
//! unit, the stage's bookkeeping ([`stage`]: the segment table, the in-flight micro-batches'
//! lifecycle and order rules, their document starts, the activation peak and budget), the step's
//! gradient bookkeeping (per-micro-batch accumulators summed in the canonical tree, with peak
//! accounting), and AdamW's decay rules. The CPU stage (`trainer::model`, over `ops`) and the CUDA
//! stage (`gpu`) both build on it, so a parameter name, a layer of the block, the order of a
//! stage's pieces or a bookkeeping rule is written once.

pub mod block;
pub mod config;
pub mod documents;
pub mod error;
pub mod grads;
pub mod order;
pub mod params;
pub mod partition;
pub mod program;
pub mod stage;
pub mod unit;

pub use block::{
    BlockDevice, Residual, block_backward, block_backward_input, block_backward_weight,
    block_forward,
};
pub use config::{DeviceKind, ModelConfig, Norm, Position, PrecisionKind};
pub use documents::{DocumentError, document_mask};
pub use error::{ModelError, PartitionError, SplitOrder, StateMismatch};
pub use grads::StepGradients;
pub use partition::{StageLayout, partition_layers, partition_virtual_layers};
pub use program::{
    StageDevice, backward_unit, backward_unit_input, backward_unit_weight, forward_unit,
};
pub use stage::{ActivationPeak, InFlight, Mode, Segment, Segments};
pub use unit::Unit;
