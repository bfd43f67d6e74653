//! The model's errors: what a stage, the layer split and a saved state can refuse. A leaf of the
//! model module: every other model file names its errors here, and this file names none of them.

use candle_core::DType;
use thiserror::Error;

use crate::unit::Unit;

/// What went wrong inside a stage.
#[derive(Debug, Error)]
pub enum ModelError {
    /// A kernel failed.
    #[error(transparent)]
    Ops(#[from] ops::OpsError),
    /// A tensor operation failed.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// The layer split is impossible.
    #[error(transparent)]
    Partition(#[from] PartitionError),
    /// A parameter was asked of a stage that does not hold it.
    #[error("parameter `{0}` is not held by this stage")]
    MissingParam(String),
    /// A parameter got no gradient in a training step (a bug: every parameter must receive one).
    #[error("parameter `{0}` received no gradient this step")]
    NoGradient(String),
    /// A backward, or summing the gradients, with no training step begun.
    #[error(
        "no training step begun: call Stage::begin_step(micro_batches) at the start of every step, before its first backward"
    )]
    NoStep,
    /// The step's gradients were summed before every micro-batch's backward completed.
    #[error(
        "the step's gradients were summed after the backward of {completed} of its {micro_batches} micro-batches completed; run every micro-batch's backward down to segment 0 first (or give Stage::begin_step the step's real micro-batch count)"
    )]
    IncompleteGradients {
        completed: usize,
        micro_batches: usize,
    },
    /// The step's summed gradients were asked for before they were summed.
    #[error(
        "the step's gradients are not summed yet: call Stage::finish_gradients after the step's last backward"
    )]
    GradientsNotFinished,
    /// The summation tree refused a push or finish (a bug in the gradient bookkeeping).
    #[error("gradient summation tree: {0}")]
    GradientTree(String),
    /// The flat gradient vector of the data-parallel collective is f32 only.
    #[error(
        "gradient of `{name}` is {got:?}, the data-parallel gradient vector is F32 only (build the stage with DType::F32)"
    )]
    GradientDType { name: String, got: DType },
    /// A flat gradient vector of the wrong length.
    #[error(
        "gradient vector has {got} values, this stage's parameters have {expected} (their sizes in canonical order, as Stage::gradient_vector returns them)"
    )]
    GradientLength { expected: usize, got: usize },
    /// Units were run in an order the model cannot honour.
    #[error("unit {unit:?}: {reason}")]
    Order { unit: Unit, reason: String },
    /// A split backward's halves asked in an order the unit's lifecycle forbids (see
    /// [`SplitOrder`]).
    #[error("unit {unit:?}: {problem}")]
    SplitOrder { unit: Unit, problem: SplitOrder },
    /// A backward split into its input and weight halves asked of a device that runs whole
    /// backwards only.
    #[error(
        "this device runs {kernel}'s backward whole, not as an input half and a weight half, which pipeline.schedule = \"seq1f1b-zb\" needs (use pipeline.schedule = \"seq1f1b\")"
    )]
    NoSplitBackward { kernel: &'static str },
    /// A backward found nothing saved by its forward (which ran in evaluation mode, or not at all).
    #[error(
        "the backward of {layer} found no activation saved by its forward: run the unit's forward in training mode first"
    )]
    NotSaved { layer: String },
    /// The input does not match the stage.
    #[error("unit {unit:?}: {reason}")]
    Input { unit: Unit, reason: String },
    /// A parameter given to the stage has the wrong shape.
    #[error("parameter `{name}` has shape {got:?}, the model expects {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    /// A saved state (checkpoint or peer snapshot) does not fit the model.
    #[error("the saved state does not fit the model: {0}")]
    State(#[from] StateMismatch),
    /// The configured device cannot run the stage.
    #[error("{0}")]
    Device(String),
    /// Positions restarting at each document asked of a device whose position embedding takes
    /// contiguous positions only.
    #[error(
        "data.reset_positions: the {device} device's position embedding does not restart at documents ({missing}); set model.device = \"cpu\" or data.reset_positions = false"
    )]
    ResetPositionsUnsupported {
        device: &'static str,
        missing: &'static str,
    },
    /// A micro-batch's document starts cannot be used.
    #[error("micro-batch {micro_batch}: {source}")]
    Documents {
        micro_batch: usize,
        source: crate::documents::DocumentError,
    },
    /// A device link to a neighbouring stage failed or was aborted (the neighbour is lost).
    #[error("device link: {0}")]
    Link(String),
    /// Copying the stage's state off its device (for a checkpoint or peer snapshot) failed.
    #[error("copying the stage's state to the host failed: {0}")]
    StateCopy(String),
    /// The stage holds more than its memory budget (`train.memory_budget_bytes`); with virtual
    /// stages the budget is the worker's, and `chunks` (v) of them hold the bytes together.
    #[error(
        "memory budget exceeded: after the forward of micro-batch {} segment {} {} {} (parameters, gradients and AdamW moments {} + live activations {}), over train.memory_budget_bytes = {}; use pipeline.schedule = {} with more pipeline.splits, a smaller train.micro_batch_size or more pipeline.stages, or raise the budget",
        unit.micro_batch, unit.segment, holder(*chunks), mib(*state + *activations), mib(*state), mib(*activations), mib(*budget),
        if *chunks > 1 { "\"seq1f1b-i\"" } else { "\"seq1f1b\"" }
    )]
    OverBudget {
        unit: Unit,
        /// The chunks whose bytes are counted: 1, or the worker's v chunks together.
        chunks: usize,
        state: usize,
        activations: usize,
        budget: usize,
    },
}

impl From<ops::SumTreeError<candle_core::Error>> for ModelError {
    fn from(e: ops::SumTreeError<candle_core::Error>) -> Self {
        match e {
            ops::SumTreeError::Add(e) => ModelError::Candle(e),
            other => ModelError::GradientTree(other.to_string()),
        }
    }
}

/// Who holds the bytes of an [`ModelError::OverBudget`]: the stage, or a worker's chunks.
fn holder(chunks: usize) -> String {
    if chunks > 1 {
        format!("the worker's {chunks} virtual-stage chunks hold together")
    } else {
        "the stage holds".to_string()
    }
}

fn mib(bytes: usize) -> String {
    format!(
        "{bytes} bytes ({:.1} MiB)",
        bytes as f64 / (1u64 << 20) as f64
    )
}

/// How a unit's split backward went out of order: its input half (`I`) runs once, after its
/// forward; its weight half (`W`) once, after its `I`; a whole backward (`B`) never meets a
/// micro-batch whose units are split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum SplitOrder {
    /// `W` before the unit's `I` (its forward may have run).
    #[error(
        "weight half of the backward (W) before its input half (I): the weight gradients need the output gradient the input half keeps"
    )]
    WeightBeforeInput,
    /// `W` a second time.
    #[error("weight half of the backward (W) twice: its gradients were already added")]
    WeightTwice,
    /// `I` a second time (its `W` may be pending or done).
    #[error("input half of the backward (I) twice: the unit's input gradient was already computed")]
    InputTwice,
    /// A whole backward (`B`) of a unit of a micro-batch that has units waiting for their `W`.
    #[error(
        "whole backward (B) in a micro-batch whose split backwards still wait for their weight halves (W): a schedule runs one kind of backward"
    )]
    WholeAmongSplit,
}

/// Why a model cannot be split as asked.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PartitionError {
    /// Every stage needs at least one block.
    #[error(
        "cannot split {layers} layers into {stages} pipeline stages: every stage needs at least one layer (lower pipeline.stages or raise model.layers)"
    )]
    TooManyStages { stages: usize, layers: usize },
    /// Zero stages.
    #[error("pipeline.stages must be at least 1")]
    NoStages,
}

/// One way a saved state's tensors differ from what the model loads (see [`crate::params::check_state`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StateMismatch {
    /// A tensor the model needs is absent.
    #[error("tensor `{name}` is missing: the model needs it with shape {expected:?}")]
    Missing { name: String, expected: Vec<usize> },
    /// A tensor has another shape than the model's.
    #[error("tensor `{name}` has shape {found:?}, the model expects {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// A tensor's element type cannot be loaded.
    #[error("tensor `{name}` is {found}, the model loads F32 or F64 tensors only")]
    Dtype { name: String, found: String },
    /// A tensor that is no parameter (or moment) of the model.
    #[error("tensor `{name}` is not a parameter of this model (unexpected)")]
    Unexpected { name: String },
}
