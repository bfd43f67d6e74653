//! The trainer state stored in a checkpoint's manifest: everything besides tensors that a resume
//! needs to continue exactly, and a description of the run for `seqpipe ckpt show`.

use serde::{Deserialize, Serialize};

use crate::config::{Config, ConfigError};

/// Version of this crate that wrote the checkpoint.
pub const WRITER: &str = concat!("seqpipe ", env!("CARGO_PKG_VERSION"));

/// Trainer state at the end of a step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed; training resumes at `step + 1`.
    pub step: u64,
    /// AdamW's step counter (bias correction).
    pub optimizer_step: u64,
    /// The data cursor: the next step's tokens are a pure function of (seed, step, micro-batch, row).
    pub data: DataCursor,
    /// The learning-rate schedule's position.
    pub lr: LrPosition,
    /// Loss of the last step.
    pub loss: f64,
    /// How the model was split when this was written (a checkpoint loads into any other split).
    pub topology: Topology,
    /// The resolved config, as TOML.
    pub config: String,
    /// Who wrote it.
    pub writer: String,
}

/// Where the data stream stands.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataCursor {
    /// `train.seed`: the only randomness (sampling is stateless given the seed and the step).
    pub seed: u64,
    /// The next step whose batch will be read.
    pub next_step: u64,
}

/// The learning-rate schedule's position (the rate is a pure function of these).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrPosition {
    /// Step the last rate was computed for.
    pub step: u64,
    /// Total steps of the schedule.
    pub total_steps: u64,
    /// The last rate used.
    pub last_lr: f64,
}

/// The pipeline that wrote the checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// Number of stages.
    pub stages: usize,
    /// Data-parallel replicas that wrote it (informational: a checkpoint loads onto any
    /// replica count).
    #[serde(default = "one")]
    pub replicas: usize,
    /// Layer range `[start, end)` of each stage (with `pipeline.virtual_stages` v > 1, of each
    /// of the p·v virtual stages: worker r's chunk c is entry c·p + r).
    pub layers: Vec<[usize; 2]>,
    /// Schedule kind.
    pub schedule: String,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// Segments per micro-batch.
    pub splits: usize,
}

fn one() -> usize {
    1
}

impl TrainerState {
    /// The config the run had when it wrote this state.
    pub fn config(&self) -> Result<Config, ConfigError> {
        Config::from_toml(
            &self.config,
            &format!("(config stored in the checkpoint of step {})", self.step),
        )
    }
}
