//! One typed config tree, read from TOML (`configs/tiny.toml` is embedded as the default), overridable
//! key by key from the command line (`--set section.key=value`) and validated with reasons.

use std::path::{Path, PathBuf};
use std::time::Duration;

use elastic::{Zero, checked_seconds, clamped_seconds};

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::checkpointing::CheckpointConfig;
use crate::data::DataConfig;
use crate::model::ModelConfig;
use crate::model::config::DeviceKind;
use crate::schedule::{FlopsModel, Partition, ScheduleKind, SegmentRule};

/// The embedded default config (`configs/tiny.toml`).
pub const DEFAULT_CONFIG_TOML: &str = include_str!("../../configs/tiny.toml");

/// Why a config could not be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// A setting that is parsed and validated but not applied by the stage yet: refused rather
    /// than silently ignored.
    #[error("`{key}` = true is not wired into the training stage yet: {what}")]
    NotWired { key: &'static str, what: String },
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// TOML syntax or type error, or an unknown key in a file.
    #[error("invalid config {origin}: {message}")]
    Parse { origin: String, message: String },
    /// `--set` named a key that does not exist.
    #[error("unknown config key `{key}` in --set; {hint}")]
    UnknownKey { key: String, hint: String },
    /// `--set` was not of the form `section.key=value`.
    #[error("--set expects `section.key=value`, got `{0}`")]
    BadOverride(String),
    /// An `[elastic]` value is invalid (the message names the key).
    #[error(transparent)]
    Elastic(#[from] elastic::ElasticError),
    /// A value is out of range or inconsistent with another.
    #[error("invalid value for `{key}`: {message}")]
    Invalid { key: &'static str, message: String },
}

/// `[run]`: where the run writes and how its processes are set up.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Run directory: `metrics.jsonl`, the resolved config and per-stage logs go here.
    pub dir: PathBuf,
    /// Compute threads per worker process; 0 = the machine's cores divided among the stages (at least 1).
    pub threads_per_worker: usize,
    /// Log filter for the launcher and workers (tracing's `RUST_LOG` syntax; `RUST_LOG` wins when set).
    pub log: String,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("runs/latest"),
            threads_per_worker: 0,
            log: "info".into(),
        }
    }
}

/// `[train]`: the optimization.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Optimizer steps to run.
    pub steps: u64,
    /// Seed of weight init and data sampling.
    pub seed: u64,
    /// Sequences per micro-batch.
    pub micro_batch_size: usize,
    /// Tokens per sequence (the model predicts `seq_len` targets per sequence).
    pub seq_len: usize,
    /// Peak learning rate (after warm-up).
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: u64,
    /// Length of the cosine decay in steps (0 = `steps`). Set it when a run will be extended or
    /// stopped early, so that the learning rate of every step stays the same.
    pub decay_steps: u64,
    /// AdamW decoupled weight decay (applied to linear weights; embeddings only with `decay_embeddings`).
    pub weight_decay: f64,
    /// Also decay the embedding tables.
    pub decay_embeddings: bool,
    /// AdamW β1.
    pub beta1: f64,
    /// AdamW β2.
    pub beta2: f64,
    /// AdamW ε.
    pub eps: f64,
    /// Clip the global gradient norm to this value; 0 disables clipping.
    pub grad_clip: f64,
    /// Run the validation loss every this many steps (and after the last step); 0 disables evaluation.
    pub eval_every: u64,
    /// Held-out micro-batches per evaluation.
    pub eval_batches: usize,
    /// Bytes each stage may hold: its parameters, gradients and AdamW moments plus its live
    /// activations (measured after every forward; a stage over it stops the run with an error
    /// that names the stage, the unit and the bytes). With virtual stages it is each worker's:
    /// its chunks' state and live activations together. 0 = no limit.
    pub memory_budget_bytes: u64,
}

impl TrainConfig {
    /// The per-stage memory budget, if one is set.
    pub fn memory_budget(&self) -> Option<usize> {
        (self.memory_budget_bytes > 0).then_some(self.memory_budget_bytes as usize)
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 60,
            seed: 1,
            micro_batch_size: 4,
            seq_len: 128,
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 5,
            decay_steps: 0,
            weight_decay: 0.1,
            decay_embeddings: false,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_clip: 1.0,
            eval_every: 20,
            eval_batches: 4,
            memory_budget_bytes: 0,
        }
    }
}

/// `[pipeline]`: how the model is split and scheduled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PipelineConfig {
    /// Pipeline stages p (one worker process each).
    pub stages: usize,
    /// Data-parallel replicas d of the pipeline (d·p workers). The step's micro-batches are
    /// split among them; the result is bit-identical for every valid d (see
    /// [`ops::sum_tree::valid_replicas`]).
    pub replicas: usize,
    /// Micro-batches m per step.
    pub microbatches: usize,
    /// Sequence segments k per micro-batch (Seq1F1B's splits).
    pub splits: usize,
    /// `seq1f1b`, `1f1b` or `gpipe`; `seq1f1b-i`, `1f1b-i` and `seq1f1b-zb` parse but are
    /// refused by [`Config::validate`] until the runtime can run them.
    pub schedule: ScheduleKind,
    /// Layer chunks per stage (virtual stages) v: 1, or ≥ 2 for the interleaved schedules.
    pub virtual_stages: usize,
    /// Segment lengths: `uniform`, `compute` (equal FLOPs under causal attention) or `documents`
    /// (each micro-batch its own lengths, equal cost under its document masks; needs
    /// `data.document_mask = true` and CPU stages).
    pub partition: Partition,
    /// For `partition = "compute"`: the time of an attention FLOP relative to a dense (matmul)
    /// FLOP, γ. 1 = the paper's pure FLOPs count; `seqpipe bench schedule` measures γ for this
    /// machine's kernels, so that the segments take equal time.
    pub attention_cost: f64,
    /// Seconds to wait for a peer (connection or message) before declaring it failed.
    pub timeout_s: f64,
    /// How boundary tensors cross between neighbouring stages: `tcp` (through the host, over the
    /// data links) or `nccl` (GPU to GPU over NCCL links, with only their headers on TCP; needs
    /// `model.device = "cuda"` and libnccl).
    pub transport: StageTransport,
}

/// How boundary tensors cross between neighbouring stages (`pipeline.transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StageTransport {
    /// Through the host, over the TCP data links (any device).
    #[default]
    Tcp,
    /// Device to device over NCCL links between CUDA stages; headers over TCP.
    Nccl,
}

impl PipelineConfig {
    /// `timeout_s` as a [`Duration`] (checked by [`Config::validate`]).
    pub fn timeout(&self) -> Duration {
        clamped_seconds(self.timeout_s)
    }
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            stages: 4,
            replicas: 1,
            microbatches: 4,
            splits: 4,
            schedule: ScheduleKind::Seq1F1B,
            virtual_stages: 1,
            partition: Partition::Compute,
            attention_cost: 1.0,
            timeout_s: 60.0,
            transport: StageTransport::Tcp,
        }
    }
}

/// The whole config tree.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `[run]`
    pub run: RunConfig,
    /// `[model]`
    pub model: ModelConfig,
    /// `[train]`
    pub train: TrainConfig,
    /// `[pipeline]`
    pub pipeline: PipelineConfig,
    /// `[data]`
    pub data: DataConfig,
    /// `[checkpoint]`
    pub checkpoint: CheckpointConfig,
    /// `[elastic]`
    pub elastic: elastic::ElasticConfig,
}

impl Config {
    /// Reads `file` (or the embedded default), applies `--set` overrides and validates.
    pub fn load(file: Option<&Path>, overrides: &[String]) -> Result<Self, ConfigError> {
        let (text, origin) = match file {
            Some(path) => (
                std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                    path: path.to_path_buf(),
                    source,
                })?,
                path.display().to_string(),
            ),
            None => (
                DEFAULT_CONFIG_TOML.to_string(),
                "(embedded configs/tiny.toml)".to_string(),
            ),
        };
        let mut cfg = Self::from_toml(&text, &origin)?;
        if !overrides.is_empty() {
            cfg = cfg.with_overrides(overrides)?;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses TOML text (missing keys take their defaults; unknown keys are errors).
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            origin: origin.to_string(),
            message: e.to_string(),
        })
    }

    /// The config as TOML (written into the run directory).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a Config always serializes")
    }

    /// Applies `section.key=value` overrides. Values are TOML (`3`, `true`, `"x"`); a bare word is a string.
    pub fn with_overrides(&self, overrides: &[String]) -> Result<Self, ConfigError> {
        let mut tree = toml::Table::try_from(self).expect("a Config always serializes");
        for item in overrides {
            let (key, raw) = item
                .split_once('=')
                .ok_or_else(|| ConfigError::BadOverride(item.clone()))?;
            let key = key.trim();
            let (section, field) = key
                .split_once('.')
                .ok_or_else(|| ConfigError::BadOverride(item.clone()))?;
            let sections: Vec<String> = tree.keys().cloned().collect();
            let table = tree
                .get_mut(section)
                .and_then(|v| v.as_table_mut())
                .ok_or_else(|| ConfigError::UnknownKey {
                    key: key.to_string(),
                    hint: format!("sections are: {}", sections.join(", ")),
                })?;
            if !table.contains_key(field) {
                let mut fields: Vec<&String> = table.keys().collect();
                fields.sort();
                let fields: Vec<&str> = fields.into_iter().map(String::as_str).collect();
                return Err(ConfigError::UnknownKey {
                    key: key.to_string(),
                    hint: format!("keys in [{section}] are: {}", fields.join(", ")),
                });
            }
            table.insert(field.to_string(), parse_value(raw.trim()));
        }
        let origin = format!("after --set {}", overrides.join(" --set "));
        toml::Value::Table(tree)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                origin,
                message: e.to_string(),
            })
    }

    /// Tokens in one step's global batch (the loss is the mean over them).
    pub fn tokens_per_step(&self) -> usize {
        self.pipeline.microbatches * self.train.micro_batch_size * self.train.seq_len
    }

    /// Model dimensions for the segment-cost formula.
    pub fn flops_model(&self) -> FlopsModel {
        let m = &self.model;
        FlopsModel {
            layers: m.layers,
            hidden: m.d_model,
            heads: m.heads,
            head_dim: m.head_dim(),
            ffn: m.ffn(),
            vocab: m.vocab_size,
            attention_cost: self.pipeline.attention_cost,
        }
    }

    /// How every micro-batch's sequence is cut into segments (`pipeline.partition`).
    pub fn segment_rule(&self) -> Result<SegmentRule, ConfigError> {
        SegmentRule::new(
            self.pipeline.partition,
            self.train.seq_len,
            self.pipeline.splits,
            &self.flops_model(),
        )
        .map_err(|e| ConfigError::Invalid {
            key: "pipeline.splits",
            message: e.to_string(),
        })
    }

    /// The segment lengths of every micro-batch's sequence, where one table serves them all.
    /// Refused for `pipeline.partition = "documents"` (each micro-batch has its own lengths:
    /// [`Config::segment_rule`]), naming the key.
    pub fn segment_lengths(&self) -> Result<Vec<usize>, ConfigError> {
        match self.segment_rule()? {
            SegmentRule::Fixed(lengths) => Ok(lengths),
            SegmentRule::Documents { .. } => Err(ConfigError::Invalid {
                key: "pipeline.partition",
                message: "\"documents\" gives each micro-batch its own segment lengths, and this \
                          needs one table for every micro-batch: use \"compute\" or \"uniform\""
                    .into(),
            }),
        }
    }

    /// The replica counts `pipeline.replicas` may take with this micro-batch count, ascending.
    pub fn valid_replicas(&self) -> Vec<usize> {
        valid_replica_counts(self.pipeline.microbatches)
    }

    /// Checks every value and their consistency, section by section; the first problem found is
    /// the one reported.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_sizes()?;
        self.validate_shapes()?;
        self.validate_optimizer()?;
        self.validate_costs_and_reads()?;
        self.validate_schedule()?;
        self.elastic.validate()?;
        self.validate_checkpoint()?;
        self.validate_documents()
    }

    /// The sizes: each at least 1, and none so large that products of them (shapes, token
    /// counts, bytes) could overflow.
    fn validate_sizes(&self) -> Result<(), ConfigError> {
        let (m, t, p) = (&self.model, &self.train, &self.pipeline);
        let positive = [
            ("model.vocab_size", m.vocab_size),
            ("model.layers", m.layers),
            ("model.d_model", m.d_model),
            ("model.heads", m.heads),
            ("model.ffn_mult", m.ffn_mult),
            ("model.max_seq_len", m.max_seq_len),
            ("train.micro_batch_size", t.micro_batch_size),
            ("train.seq_len", t.seq_len),
            ("pipeline.stages", p.stages),
            ("pipeline.replicas", p.replicas),
            ("pipeline.microbatches", p.microbatches),
            ("pipeline.splits", p.splits),
        ];
        for (key, value) in positive {
            if value == 0 {
                return invalid(key, "must be at least 1".into());
            }
        }
        if t.steps == 0 {
            return invalid("train.steps", "must be at least 1".into());
        }
        // Far above any real model, far below overflow: sizes are multiplied together (shapes,
        // token counts, bytes), and memory is estimated from them before anything is allocated.
        let at_most = [
            (
                "model.vocab_size",
                m.vocab_size,
                1 << 32,
                "token ids are at most 32 bits",
            ),
            ("model.d_model", m.d_model, 1 << 20, "the hidden width"),
            (
                "model.ffn_mult",
                m.ffn_mult,
                64,
                "the MLP width over d_model",
            ),
            ("model.layers", m.layers, 1 << 16, "transformer blocks"),
            (
                "model.max_seq_len",
                m.max_seq_len,
                1 << 24,
                "tokens per sequence",
            ),
            (
                "train.micro_batch_size",
                t.micro_batch_size,
                1 << 20,
                "sequences per micro-batch",
            ),
            (
                "pipeline.microbatches",
                p.microbatches,
                1 << 20,
                "micro-batches per step",
            ),
        ];
        for (key, value, max, what) in at_most {
            if value > max {
                return invalid(
                    key,
                    format!("{value} is out of range ({what}); use 1 to {max}"),
                );
            }
        }
        Ok(())
    }

    /// How the sizes fit together: heads into the width, the sequence into the model, replicas
    /// into the summation tree, layers into stages, segments into the sequence.
    fn validate_shapes(&self) -> Result<(), ConfigError> {
        let (m, t, p) = (&self.model, &self.train, &self.pipeline);
        if m.d_model % m.heads != 0 {
            return invalid(
                "model.heads",
                format!(
                    "d_model {} is not divisible by {} heads",
                    m.d_model, m.heads
                ),
            );
        }
        if m.position == crate::model::Position::Rope && m.head_dim() % 2 != 0 {
            return invalid(
                "model.position",
                format!("rope needs an even head dimension, got {}", m.head_dim()),
            );
        }
        if t.seq_len > m.max_seq_len {
            return invalid(
                "train.seq_len",
                format!("{} exceeds model.max_seq_len {}", t.seq_len, m.max_seq_len),
            );
        }
        if !ops::sum_tree::valid_replicas(p.microbatches, p.replicas) {
            return invalid(
                "pipeline.replicas",
                format!(
                    "{} replicas cannot split {} micro-batches so that the result is the same for \
                     every replica count: each replica's share must be a node of the summation \
                     tree; use one of {:?}",
                    p.replicas,
                    p.microbatches,
                    valid_replica_counts(p.microbatches)
                ),
            );
        }
        if p.stages > m.layers {
            return invalid(
                "pipeline.stages",
                format!(
                    "{} stages for {} layers: every stage needs at least one layer (at most {} stages)",
                    p.stages, m.layers, m.layers
                ),
            );
        }
        if p.splits > t.seq_len {
            return invalid(
                "pipeline.splits",
                format!(
                    "cannot cut a sequence of {} tokens into {} segments",
                    t.seq_len, p.splits
                ),
            );
        }
        self.segment_rule()?;
        Ok(())
    }

    /// The optimizer's and evaluation's numbers: rates, betas, decay, clipping.
    fn validate_optimizer(&self) -> Result<(), ConfigError> {
        let t = &self.train;
        for (key, value) in [("train.lr", t.lr), ("train.eps", t.eps)] {
            if !(value > 0.0 && value.is_finite()) {
                return invalid(key, format!("must be a positive number, got {value}"));
            }
        }
        if !(0.0..=t.lr).contains(&t.min_lr) {
            return invalid(
                "train.min_lr",
                format!(
                    "must be between 0 and train.lr ({}), got {}",
                    t.lr, t.min_lr
                ),
            );
        }
        for (key, value) in [("train.beta1", t.beta1), ("train.beta2", t.beta2)] {
            if !(0.0..1.0).contains(&value) {
                return invalid(key, format!("must be in [0, 1), got {value}"));
            }
        }
        if t.weight_decay < 0.0 || t.grad_clip < 0.0 {
            return invalid(
                "train.weight_decay",
                "weight_decay and grad_clip must not be negative".into(),
            );
        }
        if t.eval_every > 0 && t.eval_batches == 0 {
            return invalid(
                "train.eval_batches",
                "must be at least 1 when train.eval_every > 0".into(),
            );
        }
        Ok(())
    }

    /// The attention cost weight, the pipeline's timeout and the dataset's read bounds.
    fn validate_costs_and_reads(&self) -> Result<(), ConfigError> {
        let p = &self.pipeline;
        if !(p.attention_cost > 0.0 && p.attention_cost.is_finite()) {
            return invalid(
                "pipeline.attention_cost",
                format!(
                    "must be a positive number (1 = count attention FLOPs like matmul FLOPs), got {}",
                    p.attention_cost
                ),
            );
        }
        seconds("pipeline.timeout_s", p.timeout_s, Zero::Refused)?;
        // A sharded dataset's per-attempt read bound (`Duration::from_secs_f64` would panic on
        // values such as 1e300 that are positive and finite).
        seconds(
            "data.read_timeout_s",
            self.data.read_timeout_s,
            Zero::Refused,
        )?;
        if self.data.read_attempts == 0 {
            return invalid(
                "data.read_attempts",
                "must be at least 1 (each read of a dataset object is tried this many times)"
                    .into(),
            );
        }
        Ok(())
    }

    /// The schedule with its chunks per stage, split backwards and stage links.
    fn validate_schedule(&self) -> Result<(), ConfigError> {
        let p = &self.pipeline;
        if p.schedule.is_interleaved() != (p.virtual_stages > 1) || p.virtual_stages == 0 {
            return invalid(
                "pipeline.virtual_stages",
                format!(
                    "{} with schedule \"{}\": the interleaved schedules (1f1b-i, seq1f1b-i) need \
                     at least 2 chunks per stage, the others exactly 1",
                    p.virtual_stages, p.schedule
                ),
            );
        }
        if p.virtual_stages > 1 {
            self.validate_virtual_stages()?;
        }
        if p.transport == StageTransport::Nccl && self.model.device != DeviceKind::Cuda {
            return invalid(
                "pipeline.transport",
                "\"nccl\" links the GPUs of CUDA stages: set model.device = \"cuda\", or use \"tcp\""
                    .into(),
            );
        }
        Ok(())
    }

    /// Checkpoint retention, the grace period and the byte limits (memory budget, upload rate).
    fn validate_checkpoint(&self) -> Result<(), ConfigError> {
        let c = &self.checkpoint;
        if c.keep_last == 0 {
            return invalid(
                "checkpoint.keep_last",
                "must be at least 1 (the newest committed checkpoint is never deleted)".into(),
            );
        }
        seconds("checkpoint.grace_s", c.grace_s, Zero::Refused)?;
        for (key, value) in [
            ("train.memory_budget_bytes", self.train.memory_budget_bytes),
            (
                "checkpoint.max_upload_bytes_per_s",
                c.max_upload_bytes_per_s,
            ),
        ] {
            if value > MAX_BYTES {
                return invalid(
                    key,
                    format!(
                        "{value} bytes is more than any machine holds; use at most {MAX_BYTES} \
                         (1 PiB), or 0 for no limit"
                    ),
                );
            }
        }
        Ok(())
    }

    /// With virtual stages (`pipeline.virtual_stages` ≥ 2, an interleaved schedule): a layer for
    /// every virtual stage and a schedule that can be generated for each replica's micro-batches.
    /// (CUDA stages and NCCL links hold chunks; mid-step recovery, over TCP and over NCCL device
    /// links, and peer snapshots work with chunks: a replacement rebuilds all of a lost worker's
    /// chunks, and a snapshot is the union of its chunks' state under global names;
    /// `train.memory_budget_bytes` is the worker's, its chunks' together.)
    fn validate_virtual_stages(&self) -> Result<(), ConfigError> {
        let (m, p) = (&self.model, &self.pipeline);
        let v = p.virtual_stages;
        let chunks = p.stages.saturating_mul(v);
        if chunks > m.layers {
            return Err(ConfigError::Invalid {
                key: "pipeline.virtual_stages",
                message: format!(
                    "{} stages × {v} chunks = {chunks} virtual stages, but model.layers = {} \
                     (every virtual stage holds at least one layer); lower \
                     pipeline.virtual_stages or pipeline.stages",
                    p.stages, m.layers
                ),
            });
        }
        crate::schedule::generate_virtual(
            p.schedule,
            p.stages,
            v,
            p.microbatches / p.replicas,
            p.splits,
        )
        .map_err(|e| ConfigError::Invalid {
            key: "pipeline.schedule",
            message: format!(
                "{} with {} stages, {v} virtual stages, {} micro-batches per replica and {} \
                 segments cannot be scheduled: {e}",
                p.schedule,
                p.stages,
                p.microbatches / p.replicas,
                p.splits
            ),
        })?;
        Ok(())
    }

    /// `data.document_mask`, `data.reset_positions` and `pipeline.partition = "documents"`:
    /// consistent, and refused where the stage cannot apply them: positions restarting per
    /// document with RoPE (the rotary table takes contiguous positions only); the document
    /// partition without masks (no documents to balance on); masks over NCCL device links (the
    /// starts ride in the TCP activation header). All three work on CPU and CUDA stages. See
    /// docs/data.md, "Packed documents".
    fn validate_documents(&self) -> Result<(), ConfigError> {
        let d = &self.data;
        if d.reset_positions && !d.document_mask {
            return Err(ConfigError::Invalid {
                key: "data.reset_positions",
                message: "restarts positions at each document start, so it needs \
                          data.document_mask = true"
                    .into(),
            });
        }
        if self.pipeline.partition == Partition::Documents && !d.document_mask {
            return Err(ConfigError::Invalid {
                key: "pipeline.partition",
                message: "\"documents\" balances each micro-batch's segments on its documents, \
                          which exist only with document masks: set data.document_mask = true, \
                          or use \"compute\""
                    .into(),
            });
        }
        if d.reset_positions && self.model.position == crate::model::Position::Rope {
            return Err(ConfigError::Invalid {
                key: "data.reset_positions",
                message: "with model.position = \"rope\": the rotary kernels take contiguous \
                          positions only; use model.position = \"learned\" or \
                          data.reset_positions = false"
                    .into(),
            });
        }
        Ok(())
    }

    /// Steps of the learning-rate schedule (warm-up + cosine decay).
    pub fn lr_schedule_steps(&self) -> u64 {
        if self.train.decay_steps > 0 {
            self.train.decay_steps
        } else {
            self.train.steps
        }
    }

    /// Compute threads each worker should use.
    pub fn threads_per_worker(&self) -> usize {
        match self.run.threads_per_worker {
            0 => (std::thread::available_parallelism().map_or(1, |n| n.get())
                / self.pipeline.stages)
                .max(1),
            n => n,
        }
    }
}

/// Keys that say where a run writes, what it binds to and whom it contacts. A run resumed from a
/// checkpoint URL takes them from its own command line and defaults, never from the config stored
/// in the checkpoint: whoever could write the store could otherwise point the run's outputs
/// anywhere. (`checkpoint.url` is the URL given on the command line; the S3 options are the ones
/// the store was read with.)
pub const LOCAL_ONLY_KEYS: &[&str] = &[
    "run.dir",
    "checkpoint.url",
    "checkpoint.s3_endpoint",
    "checkpoint.s3_region",
    "checkpoint.allow_http",
    "checkpoint.read_only",
    "data.cache_dir",
    "elastic.listen",
    "elastic.rendezvous",
    "elastic.metrics_listen",
];

/// A checkpoint's stored config applied onto the local one ([`Config::adopt_stored`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Adopted {
    /// The result: the stored config with the [`LOCAL_ONLY_KEYS`] of the local one.
    pub config: Config,
    /// Stored keys whose value differs from the local one and was applied, sorted.
    pub applied: Vec<String>,
    /// [`LOCAL_ONLY_KEYS`] whose stored value differs from the local one and was ignored, with
    /// the stored value, sorted.
    pub ignored: Vec<(String, String)>,
}

impl Config {
    /// The config of a run resumed from a checkpoint: every key of `stored` (the config the
    /// checkpoint records) except the [`LOCAL_ONLY_KEYS`], which keep `local`'s values. Says
    /// which stored keys changed something and which were ignored.
    pub fn adopt_stored(local: &Config, stored: &Config) -> Result<Adopted, ConfigError> {
        let local_tree = toml::Table::try_from(local).expect("a Config always serializes");
        let stored_tree = toml::Table::try_from(stored).expect("a Config always serializes");
        let (local_flat, stored_flat) = (flatten(&local_tree), flatten(&stored_tree));
        let mut tree = stored_tree;
        let mut ignored = Vec::new();
        for &key in LOCAL_ONLY_KEYS {
            let (section, field) = key.split_once('.').expect("dotted key");
            let table = tree
                .get_mut(section)
                .and_then(|v| v.as_table_mut())
                .expect("every config section serializes");
            match local_flat.get(key) {
                Some(v) => table.insert(field.to_string(), v.clone()),
                None => table.remove(field),
            };
            if let Some(v) = stored_flat.get(key)
                && local_flat.get(key) != Some(v)
            {
                ignored.push((key.to_string(), v.to_string()));
            }
        }
        let applied = stored_flat
            .iter()
            .filter(|(k, v)| {
                !LOCAL_ONLY_KEYS.contains(&k.as_str()) && local_flat.get(*k) != Some(v)
            })
            .map(|(k, _)| k.clone())
            .collect();
        let config = toml::Value::Table(tree)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse {
                origin: "(the checkpoint's stored config with the local output locations)".into(),
                message: e.to_string(),
            })?;
        Ok(Adopted {
            config,
            applied,
            ignored,
        })
    }
}

/// A config tree's leaves by dotted key (`section.key`), sorted.
fn flatten(tree: &toml::Table) -> std::collections::BTreeMap<String, toml::Value> {
    let mut out = std::collections::BTreeMap::new();
    for (section, value) in tree {
        match value.as_table() {
            Some(table) => {
                for (key, v) in flatten(table) {
                    out.insert(format!("{section}.{key}"), v);
                }
            }
            None => {
                out.insert(section.clone(), value.clone());
            }
        }
    }
    out
}

/// The largest byte count a size key accepts (1 PiB): far above any machine, far below overflow.
pub const MAX_BYTES: u64 = 1 << 50;

/// A refusal of `key`'s value, saying why.
fn invalid(key: &'static str, message: String) -> Result<(), ConfigError> {
    Err(ConfigError::Invalid { key, message })
}

/// Checks the seconds of `key` with the shared rule ([`elastic::checked_seconds`]).
fn seconds(key: &'static str, value: f64, zero: Zero) -> Result<Duration, ConfigError> {
    checked_seconds(value, zero).map_err(|e| ConfigError::Invalid {
        key,
        message: e.to_string(),
    })
}

/// A `--set` value: TOML if it parses as TOML, otherwise the raw text as a string.
fn parse_value(raw: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()))
}

/// The replica counts that split `micro_batches` into summation-tree nodes, ascending.
fn valid_replica_counts(micro_batches: usize) -> Vec<usize> {
    (1..=micro_batches)
        .filter(|&d| ops::sum_tree::valid_replicas(micro_batches, d))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adopting_a_stored_config_keeps_local_output_locations() {
        let local = Config::default();
        let mut stored = Config::default();
        stored.run.dir = PathBuf::from("/somewhere/else");
        stored.elastic.listen = "0.0.0.0:29400".into();
        stored.checkpoint.s3_endpoint = "http://elsewhere:8333".into();
        stored.model.layers = 2;
        stored.train.steps = 7;
        let adopted = Config::adopt_stored(&local, &stored).unwrap();
        assert_eq!(adopted.config.run.dir, local.run.dir);
        assert_eq!(adopted.config.elastic.listen, local.elastic.listen);
        assert_eq!(adopted.config.checkpoint.s3_endpoint, "");
        assert_eq!(adopted.config.model.layers, 2);
        assert_eq!(adopted.config.train.steps, 7);
        assert_eq!(adopted.applied, vec!["model.layers", "train.steps"]);
        let ignored: Vec<&str> = adopted.ignored.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            ignored,
            vec!["run.dir", "checkpoint.s3_endpoint", "elastic.listen"]
        );
        assert!(adopted.ignored[0].1.contains("/somewhere/else"));
        let same = Config::adopt_stored(&local, &local).unwrap();
        assert!(same.applied.is_empty() && same.ignored.is_empty());
        assert_eq!(same.config, local);
    }

    /// The data cache is where a node writes: a checkpoint's stored config cannot move it.
    #[test]
    fn adopting_a_stored_config_keeps_the_local_data_cache() {
        let local = Config::default();
        let mut stored = Config::default();
        stored.data.cache_dir = "/etc/elsewhere".into();
        stored.data.cache_bytes = 1 << 20;
        let adopted = Config::adopt_stored(&local, &stored).unwrap();
        assert_eq!(adopted.config.data.cache_dir, "");
        assert_eq!(adopted.config.data.cache_bytes, 1 << 20);
        assert_eq!(adopted.ignored[0].0, "data.cache_dir");
    }

    #[test]
    fn embedded_default_equals_code_defaults() {
        let parsed = Config::from_toml(DEFAULT_CONFIG_TOML, "tiny.toml").unwrap();
        assert_eq!(
            parsed,
            Config::default(),
            "configs/tiny.toml and the Default impls disagree"
        );
        parsed.validate().unwrap();
    }

    #[test]
    fn shipped_configs_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let text = std::fs::read_to_string(&path).unwrap();
                let cfg = Config::from_toml(&text, &path.display().to_string())
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                cfg.validate()
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                seen += 1;
            }
        }
        assert!(seen >= 2, "configs/ holds tiny.toml and long-seq.toml");
    }

    #[test]
    fn overrides_apply_with_types() {
        let cfg = Config::default()
            .with_overrides(&[
                "train.steps=7".into(),
                "pipeline.schedule=1f1b".into(),
                "run.dir=/tmp/x".into(),
                "train.lr=0.5".into(),
            ])
            .unwrap();
        assert_eq!(cfg.train.steps, 7);
        assert_eq!(cfg.pipeline.schedule, ScheduleKind::OneFOneB);
        assert_eq!(cfg.run.dir, PathBuf::from("/tmp/x"));
        assert_eq!(cfg.train.lr, 0.5);
    }

    #[test]
    fn nccl_transport_needs_cuda_stages() {
        let tcp = Config::default();
        assert_eq!(tcp.pipeline.transport, StageTransport::Tcp);
        let nccl = tcp
            .with_overrides(&["pipeline.transport=nccl".into()])
            .unwrap();
        assert_eq!(nccl.pipeline.transport, StageTransport::Nccl);
        let err = nccl.validate().unwrap_err().to_string();
        assert!(
            err.contains("pipeline.transport") && err.contains("model.device = \"cuda\""),
            "{err}"
        );
        let cuda = nccl.with_overrides(&["model.device=cuda".into()]).unwrap();
        cuda.validate().unwrap();
    }

    #[test]
    fn unknown_keys_are_named() {
        let err = Config::default()
            .with_overrides(&["train.stpes=3".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("train.stpes") && err.contains("steps"),
            "{err}"
        );
        let err = Config::from_toml("[train]\nstpes = 3\n", "f.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("stpes"), "{err}");
        let err = Config::default()
            .with_overrides(&["pipeline.schedule=zigzag".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("zigzag") || err.contains("schedule"), "{err}");
    }

    /// seq1f1b-zb runs on CPU and CUDA stages over TCP, with mid-step recovery (the default) on
    /// or off and with replicas, and over NCCL device links with mid-step recovery on or off;
    /// chunk counts it cannot take are refused, naming the key.
    #[test]
    fn the_zero_bubble_kind_runs_on_every_device_and_link_with_mid_step_recovery() {
        let zb = |extra: &[&str]| {
            let mut sets = vec!["pipeline.schedule=seq1f1b-zb".to_string()];
            sets.extend(extra.iter().map(|s| s.to_string()));
            Config::default().with_overrides(&sets).unwrap()
        };
        assert_eq!(zb(&[]).pipeline.schedule.as_str(), "seq1f1b-zb");
        assert!(zb(&[]).elastic.mid_step, "mid-step recovery is the default");
        for device in ["model.device=cpu", "model.device=cuda"] {
            for mid_step in ["elastic.mid_step=true", "elastic.mid_step=false"] {
                zb(&[device, mid_step]).validate().unwrap();
                zb(&[
                    device,
                    mid_step,
                    "pipeline.replicas=2",
                    "pipeline.microbatches=4",
                ])
                .validate()
                .unwrap();
            }
        }
        // Over NCCL device links too, mid-step recovery on (the default) or off.
        let nccl = &["model.device=cuda", "pipeline.transport=nccl"][..];
        zb(nccl).validate().unwrap();
        zb(&[&["elastic.mid_step=false"], nccl].concat())
            .validate()
            .unwrap();
        // Chunk counts that do not fit the kind are refused before that, naming the key.
        for (kind, v) in [("seq1f1b-i", 1), ("seq1f1b", 2), ("1f1b", 0)] {
            let err = Config::default()
                .with_overrides(&[
                    format!("pipeline.schedule={kind}"),
                    format!("pipeline.virtual_stages={v}"),
                ])
                .unwrap()
                .validate()
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("pipeline.virtual_stages"),
                "{kind} v={v}: {err}"
            );
        }
    }

    /// The interleaved kinds run on CPU and CUDA stages, over TCP and NCCL device links, with
    /// mid-step recovery and peer snapshots (the defaults) on or off; shapes they cannot take
    /// are refused, naming the key and what to use instead.
    #[test]
    fn interleaved_kinds_run_with_chunks_and_refuse_shapes_they_cannot_take() {
        let base = |extra: &[&str]| {
            let mut sets: Vec<String> = [
                "model.layers=8",
                "pipeline.stages=4",
                "pipeline.microbatches=8",
                "pipeline.splits=2",
                "pipeline.virtual_stages=2",
            ]
            .map(String::from)
            .to_vec();
            sets.extend(extra.iter().map(|s| s.to_string()));
            Config::default().with_overrides(&sets).unwrap()
        };
        for kind in ["seq1f1b-i", "1f1b-i"] {
            let set = format!("pipeline.schedule={kind}");
            let defaults = base(&[&set]);
            assert!(defaults.elastic.mid_step && defaults.elastic.peer_snapshots);
            defaults.validate().unwrap();
            base(&[
                &set,
                "elastic.mid_step=false",
                "elastic.peer_snapshots=false",
            ])
            .validate()
            .unwrap();
            let refused = |extra: &str| base(&[&set, extra]).validate().expect_err(extra);
            // CUDA stages, over TCP or over NCCL device links, hold chunks too, with mid-step
            // recovery on or off.
            base(&[&set, "model.device=cuda"]).validate().unwrap();
            for mid_step in ["elastic.mid_step=true", "elastic.mid_step=false"] {
                base(&[
                    &set,
                    "model.device=cuda",
                    "pipeline.transport=nccl",
                    mid_step,
                ])
                .validate()
                .unwrap();
            }
            // A memory budget is the worker's, over its chunks (tests/memory_budget.rs).
            base(&[&set, "train.memory_budget_bytes=1000000000"])
                .validate()
                .unwrap();
            // A layer per virtual stage.
            let err = refused("pipeline.virtual_stages=3").to_string();
            assert!(
                err.contains("pipeline.virtual_stages") && err.contains("12 virtual stages"),
                "{err}"
            );
            // Shapes the interleaved order cannot take (m per replica not a multiple of p).
            let err = refused("pipeline.microbatches=6").to_string();
            assert!(
                err.contains("pipeline.schedule") && err.contains("multiple"),
                "{err}"
            );
        }
    }

    #[test]
    fn invalid_values_say_why() {
        let err = Config::default()
            .with_overrides(&["pipeline.stages=9".into()])
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("pipeline.stages") && err.contains("at least one layer"),
            "{err}"
        );
        let err = Config::default()
            .with_overrides(&["pipeline.splits=500".into()])
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("pipeline.splits"), "{err}");
        let err = Config::default()
            .with_overrides(&["model.heads=5".into()])
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("model.heads"), "{err}");
        let err = Config::default()
            .with_overrides(&["elastic.metrics_listen=\"localhost\"".into()])
            .unwrap()
            .validate()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("elastic.metrics_listen") && err.contains("127.0.0.1:9100"),
            "{err}"
        );
        Config::default()
            .with_overrides(&["elastic.metrics_listen=\"0.0.0.0:9100\"".into()])
            .unwrap()
            .validate()
            .unwrap();
    }

    #[test]
    fn durations_are_checked_with_key_and_range() {
        let keys = [
            "pipeline.timeout_s",
            "checkpoint.grace_s",
            "elastic.heartbeat_s",
            "elastic.dead_after_s",
            "elastic.join_timeout_s",
            "elastic.grace_s",
            "elastic.metrics_linger_s",
        ];
        for key in keys {
            for value in ["1e300", "1e19", "nan", "inf", "-inf", "-1.0", "2592001.0"] {
                let err = Config::default()
                    .with_overrides(&[format!("{key}={value}")])
                    .unwrap()
                    .validate()
                    .unwrap_err()
                    .to_string();
                assert!(
                    err.contains(key) && err.contains("2592000"),
                    "{key}={value}: {err}"
                );
            }
        }
        // The largest accepted value converts without a panic.
        let cfg = Config::default()
            .with_overrides(&[
                "pipeline.timeout_s=2592000.0".into(),
                "checkpoint.grace_s=2592000.0".into(),
            ])
            .unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.pipeline.timeout(), Duration::from_secs(2_592_000));
        assert_eq!(cfg.checkpoint.grace(), Duration::from_secs(2_592_000));
    }

    #[test]
    fn sizes_have_a_sane_maximum() {
        for (key, value) in [
            ("train.memory_budget_bytes", "1152921504606846976"),
            ("checkpoint.max_upload_bytes_per_s", "1152921504606846976"),
            ("model.vocab_size", "8589934592"),
            ("model.d_model", "1099511627776"),
            ("model.layers", "1000000"),
            ("model.ffn_mult", "1000"),
            ("train.micro_batch_size", "1099511627776"),
        ] {
            let err = Config::default()
                .with_overrides(&[format!("{key}={value}")])
                .unwrap()
                .validate()
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(key) && err.contains(value),
                "{key}={value}: {err}"
            );
        }
    }

    #[test]
    fn the_document_partition_needs_masks_and_cpu_stages() {
        let with = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            Config::default().with_overrides(&sets).unwrap()
        };
        let partition_error = |err: &ConfigError, needle: &str| {
            assert!(
                matches!(
                    err,
                    ConfigError::Invalid {
                        key: "pipeline.partition",
                        ..
                    }
                ) && err.to_string().contains(needle),
                "{err}"
            );
        };
        // Without masks there are no documents to balance on.
        let err = with(&["pipeline.partition=\"documents\""])
            .validate()
            .unwrap_err();
        partition_error(&err, "data.document_mask = true");
        // CUDA stages size their units for the longest segment any micro-batch can get.
        with(&[
            "pipeline.partition=\"documents\"",
            "data.document_mask=true",
            "model.device=\"cuda\"",
        ])
        .validate()
        .unwrap();
        // With masks on CPU stages: accepted, each micro-batch cut from its documents; one table
        // for all is refused, naming the key.
        let cfg = with(&[
            "pipeline.partition=\"documents\"",
            "data.document_mask=true",
        ]);
        cfg.validate().unwrap();
        let rule = cfg.segment_rule().unwrap();
        assert!(rule.per_micro_batch());
        assert_eq!(rule.splits(), cfg.pipeline.splits);
        assert_eq!(rule.seq_len(), cfg.train.seq_len);
        partition_error(&cfg.segment_lengths().unwrap_err(), "one table");
        // The other partitions keep their one table.
        let compute = Config::default();
        assert_eq!(
            compute.segment_rule().unwrap(),
            SegmentRule::Fixed(compute.segment_lengths().unwrap())
        );
        // An unknown name lists the three.
        let err = Config::default()
            .with_overrides(&["pipeline.partition=\"docs\"".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"documents\""), "{err}");
    }

    #[test]
    fn document_keys_parse_validate_and_are_refused_only_where_not_wired() {
        let cfg = Config::default();
        assert!(!cfg.data.document_mask && !cfg.data.reset_positions);
        cfg.validate().unwrap();
        let with = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            Config::default().with_overrides(&sets).unwrap()
        };
        // reset_positions alone is inconsistent.
        let err = with(&["data.reset_positions=true"]).validate().unwrap_err();
        assert!(
            matches!(
                err,
                ConfigError::Invalid {
                    key: "data.reset_positions",
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string().contains("data.document_mask = true"),
            "{err}"
        );
        // On CPU stages the mask (and restarting positions) is accepted.
        for sets in [
            &["data.document_mask=true"][..],
            &["data.document_mask=true", "data.reset_positions=true"][..],
        ] {
            let cfg = with(sets);
            assert!(cfg.data.document_mask);
            cfg.validate().unwrap();
        }
        // On CUDA stages too: the attention kernels take document starts, the embedding kernels
        // restart positions at them.
        for sets in [
            &["data.document_mask=true", "model.device=\"cuda\""][..],
            &[
                "data.document_mask=true",
                "data.reset_positions=true",
                "model.device=\"cuda\"",
            ][..],
        ] {
            with(sets).validate().unwrap();
        }
        // Over NCCL device links the document starts ride in the activations' TCP headers.
        with(&[
            "data.document_mask=true",
            "model.device=\"cuda\"",
            "pipeline.transport=\"nccl\"",
        ])
        .validate()
        .unwrap();
        // Restarting positions needs the learned position table.
        let err = with(&[
            "data.document_mask=true",
            "data.reset_positions=true",
            "model.position=\"rope\"",
        ])
        .validate()
        .unwrap_err();
        assert!(err.to_string().contains("rotary"), "{err}");
        // A file spells them too; a wrong type is a parse error.
        let cfg = Config::from_toml(
            "[data]\ndocument_mask = true\nreset_positions = false\nsynthetic_document_median = 40\nsynthetic_document_sigma = 0.5\n",
            "t",
        )
        .unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.data.synthetic_document_median, 40);
        assert!(Config::from_toml("[data]\ndocument_mask = \"yes\"\n", "t").is_err());
    }
}
