//! A training step's numbers, as `metrics.jsonl` holds them (one JSON object per line; the run
//! appends them with [`crate::runtime::metrics_log::MetricsLog`], beside its events). A leaf: the
//! events, the live metrics and the plots all read this type.

use serde::{Deserialize, Serialize};

/// One training step's numbers. Read back with [`crate::runtime::events::Record`]; the fields
/// added after the first version default to zero in older files.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Completed optimizer steps (1-based).
    pub step: u64,
    /// Bytes of boundary tensors the stages kept during the step for mid-step recovery.
    #[serde(default)]
    pub retained_bytes: u64,
    /// Per stage: the most bytes of live activations it held during the step.
    #[serde(default)]
    pub peak_activation_bytes: Vec<u64>,
    /// Per stage: bytes of its parameters, gradients and AdamW moments (what
    /// `train.memory_budget_bytes` counts besides the activations).
    #[serde(default)]
    pub state_bytes: Vec<u64>,
    /// Forward and backward units the stages computed (a replacement's replay included).
    #[serde(default)]
    pub units: usize,
    /// Seconds the stages spent computing them, summed.
    #[serde(default)]
    pub compute_s: f64,
    /// CPU seconds the worker processes used during those units, summed (what `cpu_user_s` +
    /// `cpu_system_s` has beyond it went to the runtime around the units).
    #[serde(default)]
    pub compute_cpu_s: f64,
    /// Bytes the workers sent in the gradient reduction between data-parallel replicas, summed
    /// (0 with one replica).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub reduce_bytes: u64,
    /// Seconds of the slowest worker's gradient reduction.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub reduce_s: f64,
    /// The most full-gradient buffers any worker held at once during the step (the fixed
    /// summation tree's memory: up to ⌊log2 c⌋ + 1 for c micro-batches per replica, vs 1 for a
    /// plain running sum). Each is a quarter of that stage's `state_bytes`, which counts one; 0 in
    /// files written before it was recorded.
    #[serde(default, skip_serializing_if = "is_zero_usize")]
    pub gradient_buffers: usize,
    /// Minor page faults of the worker processes since their previous step reports, summed
    /// (the first step counts the workers' start): none in a steady state that reuses its
    /// buffers; 0 in files written before it was recorded.
    #[serde(default)]
    pub page_faults: u64,
    /// CPU seconds of the worker processes in user mode since their previous reports, summed.
    #[serde(default)]
    pub cpu_user_s: f64,
    /// CPU seconds of the worker processes in the kernel since their previous reports, summed.
    #[serde(default)]
    pub cpu_system_s: f64,
    /// The newest step whose peer snapshots the live agents held completely when the step's
    /// record was written: tier-1 recovery restarts from it (the steps after it are redone).
    /// Absent when peer snapshots are off or none is complete yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_snapshot_step: Option<u64>,
    /// 1 when this step's peer snapshot was skipped because the previous one was still being
    /// sent (copies never hold up a step), else 0.
    #[serde(default)]
    pub peer_snapshots_skipped: u64,
    /// When the step ended (Unix seconds).
    #[serde(default)]
    pub end_unix_s: f64,
    /// Mean token loss of the step's global batch.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens in the step's global batch.
    pub tokens: usize,
    /// Wall-clock seconds of the step (forward, backward, update).
    pub step_time_s: f64,
    /// tokens / step_time_s.
    pub tokens_per_s: f64,
    /// Validation loss, on steps where evaluation ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
}

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

fn is_zero_usize(v: &usize) -> bool {
    *v == 0
}

fn is_zero_f64(v: &f64) -> bool {
    *v == 0.0
}
