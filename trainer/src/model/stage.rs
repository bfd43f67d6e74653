//! A pipeline stage: a contiguous range of blocks (plus the embeddings on the first stage and the
//! final norm, head and loss on the last), run one (micro-batch, segment) unit at a time.

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Device, Tensor};
use ops::adamw::AdamW;
use ops::embedding::{embedding_backward, embedding_forward};
use ops::lm_head::{LmHeadGrads, lm_head_loss, lm_head_loss_forward_backward};
use ops::memory::{SavedTensors, TensorBytes};
use ops::rope::RopeTable;
use thiserror::Error;

use super::block::{Block, BlockCtx, KvPrefix, SegmentShape};
use super::config::{ModelConfig, Position};
use super::norm::{NormLayer, NormLayerCtx};
use super::params::{Gradients, ParamSpec, Params, component_params, decays, init_param};
use super::partition::{PartitionError, StageLayout};
use crate::schedule::Unit;

/// Rows of the logits that exist at once in the fused LM head + softmax cross-entropy.
const LOSS_CHUNK_ROWS: usize = 256;

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
    /// Units were run in an order the model cannot honour.
    #[error("unit {unit:?}: {reason}")]
    Order { unit: Unit, reason: String },
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
    /// The stage holds more than its memory budget (`train.memory_budget_bytes`).
    #[error(
        "memory budget exceeded: after the forward of micro-batch {} segment {} the stage holds {} (parameters, gradients and AdamW moments {} + live activations {}), over train.memory_budget_bytes = {}; use pipeline.schedule = \"seq1f1b\" with more pipeline.splits, a smaller train.micro_batch_size or more pipeline.stages, or raise the budget",
        unit.micro_batch, unit.segment, mib(*state + *activations), mib(*state), mib(*activations), mib(*budget)
    )]
    OverBudget {
        unit: Unit,
        state: usize,
        activations: usize,
        budget: usize,
    },
}

fn mib(bytes: usize) -> String {
    format!(
        "{bytes} bytes ({:.1} MiB)",
        bytes as f64 / (1u64 << 20) as f64
    )
}

/// What flows into a stage's forward.
pub enum StageInput {
    /// First stage: token ids `(B, s)` U32.
    Tokens(Tensor),
    /// Later stages: the previous stage's hidden states `(B·s, C)`.
    Hidden(Tensor),
}

/// What a stage's forward produces.
pub enum StageOutput {
    /// Hidden states `(B·s, C)` for the next stage.
    Hidden(Tensor),
    /// Last stage: the sum of the segment's token losses (unscaled).
    LossSum(f64),
}

/// Whether a forward keeps what backward needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Keep contexts for backward.
    Train,
    /// Forward only (evaluation): contexts are dropped, the K/V prefix lives until the micro-batch's last segment.
    Eval,
}

struct HeadCtx {
    norm: NormLayerCtx,
    /// Gradients of the head, computed with the loss (already scaled).
    lm_head: LmHeadGrads,
}

impl SavedTensors for HeadCtx {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.norm.for_each_tensor(f);
        self.lm_head.for_each_tensor(f);
    }
}

struct UnitCtx {
    seg: SegmentShape,
    token_ids: Option<Tensor>, // (N,) on the first stage
    blocks: Vec<BlockCtx>,
    head: Option<HeadCtx>,
}

impl SavedTensors for UnitCtx {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.token_ids.for_each_tensor(f);
        self.blocks.for_each_tensor(f);
        self.head.for_each_tensor(f);
    }
}

/// A micro-batch whose units are in flight on this stage.
#[derive(Default)]
struct MicroBatchState {
    kv: Vec<KvPrefix>, // one per held block
    units: BTreeMap<usize, UnitCtx>,
}

impl SavedTensors for MicroBatchState {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.kv.for_each_tensor(f);
        self.units.values().for_each(|u| u.for_each_tensor(f));
    }
}

/// One pipeline stage's parameters, gradients and in-flight units.
pub struct Stage {
    cfg: ModelConfig,
    layout: StageLayout,
    segment_lengths: Vec<usize>,
    segment_starts: Vec<usize>,
    params: Params,
    grads: Gradients,
    rope: Option<RopeTable>,
    in_flight: BTreeMap<usize, MicroBatchState>,
    /// Most bytes of live activations held since [`Stage::take_peak_activation_bytes`].
    peak_activation_bytes: usize,
    /// Bytes the stage may hold in all (see [`Stage::set_memory_budget`]).
    memory_budget: Option<usize>,
}

impl Stage {
    /// Builds the stage with freshly initialized parameters (a function of `(seed, name)` only).
    pub fn new(
        cfg: &ModelConfig,
        layout: StageLayout,
        segment_lengths: Vec<usize>,
        seed: u64,
    ) -> Result<Self, ModelError> {
        Self::with_dtype(cfg, layout, segment_lengths, seed, DType::F32)
    }

    /// As [`Stage::new`] with another dtype (f64 for gradient checks).
    pub fn with_dtype(
        cfg: &ModelConfig,
        layout: StageLayout,
        segment_lengths: Vec<usize>,
        seed: u64,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        let device = Device::Cpu;
        let specs: Vec<ParamSpec> = layout
            .components()
            .into_iter()
            .flat_map(|c| component_params(cfg, c))
            .collect();
        let mut values = HashMap::new();
        for spec in &specs {
            values.insert(spec.name.clone(), init_param(spec, seed, dtype, &device)?);
        }
        let rope = match cfg.position {
            Position::Rope => Some(RopeTable::new(
                cfg.max_seq_len,
                cfg.head_dim(),
                cfg.rope_base,
                dtype,
                &device,
            )?),
            Position::Learned => None,
        };
        let segment_starts = segment_lengths.iter().scan(0, |acc, len| {
            let start = *acc;
            *acc += len;
            Some(start)
        });
        Ok(Self {
            cfg: cfg.clone(),
            layout,
            segment_starts: segment_starts.collect(),
            segment_lengths,
            params: Params::new(specs, values),
            grads: Gradients::default(),
            rope,
            in_flight: BTreeMap::new(),
            peak_activation_bytes: 0,
            memory_budget: None,
        })
    }

    /// Which layers this stage holds.
    pub fn layout(&self) -> &StageLayout {
        &self.layout
    }

    /// The held parameters.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The held parameters, mutably (loading checkpoints).
    pub fn params_mut(&mut self) -> &mut Params {
        &mut self.params
    }

    /// Gradients accumulated so far in this step.
    pub fn grads(&self) -> &Gradients {
        &self.grads
    }

    /// Number of micro-batches with live activations or K/V.
    pub fn in_flight_micro_batches(&self) -> usize {
        self.in_flight.len()
    }

    /// Bytes of the activations held for backward now: every in-flight unit's saved context, the
    /// K/V prefixes and the dK/dV accumulated for them (each buffer counted once).
    pub fn activation_bytes(&self) -> usize {
        let mut bytes = TensorBytes::default();
        self.in_flight.values().for_each(|mb| bytes.add(mb));
        bytes.total()
    }

    /// The most bytes of live activations held (measured after every forward and backward) since
    /// the last call; starts the next measurement from what is held now.
    pub fn take_peak_activation_bytes(&mut self) -> usize {
        let now = self.activation_bytes();
        std::mem::replace(&mut self.peak_activation_bytes, now)
    }

    /// Bytes of the stage's training state: parameters, their gradients and AdamW's two moments
    /// (four copies of the parameters).
    pub fn state_bytes(&self) -> usize {
        4 * self
            .params
            .iter()
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum::<usize>()
    }

    /// Limits what the stage may hold — [`Stage::state_bytes`] plus live activations — to
    /// `bytes`: a forward that ends above it fails with [`ModelError::OverBudget`]. `None` lifts
    /// the limit.
    pub fn set_memory_budget(&mut self, bytes: Option<usize>) {
        self.memory_budget = bytes;
    }

    /// Records the activations held now in the peak; after a forward, enforces the budget.
    fn measure_activations(&mut self, after_forward_of: Option<Unit>) -> Result<(), ModelError> {
        let activations = self.activation_bytes();
        self.peak_activation_bytes = self.peak_activation_bytes.max(activations);
        if let (Some(unit), Some(budget)) = (after_forward_of, self.memory_budget) {
            let state = self.state_bytes();
            if state + activations > budget {
                return Err(ModelError::OverBudget {
                    unit,
                    state,
                    activations,
                    budget,
                });
            }
        }
        Ok(())
    }

    fn segment(&self, unit: Unit, batch: usize) -> Result<SegmentShape, ModelError> {
        let len = *self
            .segment_lengths
            .get(unit.segment)
            .ok_or_else(|| ModelError::Input {
                unit,
                reason: format!(
                    "segment out of range (the step has {} segments)",
                    self.segment_lengths.len()
                ),
            })?;
        Ok(SegmentShape {
            batch,
            start: self.segment_starts[unit.segment],
            len,
        })
    }

    /// Forward of one unit. On the last stage `targets (B·s,)` are required; the loss gradient is
    /// scaled by `loss_scale` (1 / tokens of the global batch, so the step's loss is a mean).
    pub fn forward(
        &mut self,
        unit: Unit,
        input: StageInput,
        targets: Option<&Tensor>,
        loss_scale: f64,
        mode: Mode,
    ) -> Result<StageOutput, ModelError> {
        let (mut x, seg, token_ids) = match input {
            StageInput::Tokens(tokens) if self.layout.is_first() => {
                let (batch, len) = tokens.dims2()?;
                let seg = self.segment(unit, batch)?;
                if len != seg.len {
                    return Err(ModelError::Input {
                        unit,
                        reason: format!("got {len} tokens per row, segment has {}", seg.len),
                    });
                }
                let ids = tokens.flatten_all()?; // (N,)
                let mut x = embedding_forward(&ids, self.params.get("wte.weight")?)?; // (N, C)
                if self.cfg.position == Position::Learned {
                    let pos = position_ids(seg)?;
                    x = x.add(&embedding_forward(&pos, self.params.get("wpe.weight")?)?)?;
                }
                (x, seg, Some(ids))
            }
            StageInput::Hidden(x) if !self.layout.is_first() => {
                let (n, c) = x.dims2()?;
                let len = self.segment(unit, 1)?.len;
                if c != self.cfg.d_model || n % len != 0 {
                    return Err(ModelError::Input {
                        unit,
                        reason: format!(
                            "hidden states of shape ({n}, {c}) do not fit a segment of {len} tokens × d_model {}",
                            self.cfg.d_model
                        ),
                    });
                }
                (x, self.segment(unit, n / len)?, None)
            }
            _ => {
                return Err(ModelError::Input {
                    unit,
                    reason: "tokens go to the first stage, hidden states to the others".into(),
                });
            }
        };
        let layers = self.layout.layers.clone();
        let state = self.in_flight.entry(unit.micro_batch).or_default();
        if state.kv.is_empty() {
            state.kv.resize_with(layers.len(), KvPrefix::default);
        }
        let done = state.kv.first().map_or(0, |kv| kv.len());
        if done != seg.start {
            return Err(ModelError::Order {
                unit,
                reason: format!(
                    "forward needs the K/V of positions 0..{} but {done} are cached (segments must run in order)",
                    seg.start
                ),
            });
        }
        let mut blocks = Vec::new();
        for (slot, layer) in layers.clone().enumerate() {
            let block = Block::new(&self.cfg, layer, self.rope.as_ref());
            let (y, ctx) = block.forward(
                &self.params,
                &x,
                seg,
                &mut state.kv[slot],
                mode == Mode::Train,
            )?;
            x = y;
            blocks.extend(ctx);
        }
        let mut head = None;
        let output = if self.layout.is_last() {
            let targets = targets.ok_or_else(|| ModelError::Input {
                unit,
                reason: "the last stage needs the segment's targets".into(),
            })?;
            let (h, norm_ctx) = NormLayer::of(&self.cfg).forward(&self.params, "ln_f", &x)?; // (N, C)
            let w = self.params.get("lm_head.weight")?; // (V, C)
            let loss_sum = match mode {
                Mode::Train => {
                    let (loss_sum, lm_head) =
                        lm_head_loss_forward_backward(&h, w, targets, loss_scale, LOSS_CHUNK_ROWS)?;
                    head = Some(HeadCtx {
                        norm: norm_ctx,
                        lm_head,
                    });
                    loss_sum
                }
                Mode::Eval => lm_head_loss(&h, w, targets, LOSS_CHUNK_ROWS)?,
            };
            StageOutput::LossSum(loss_sum)
        } else {
            StageOutput::Hidden(x)
        };
        match mode {
            Mode::Train => {
                state.units.insert(
                    unit.segment,
                    UnitCtx {
                        seg,
                        token_ids,
                        blocks,
                        head,
                    },
                );
            }
            Mode::Eval => {
                if unit.segment + 1 == self.segment_lengths.len() {
                    self.in_flight.remove(&unit.micro_batch);
                }
            }
        }
        self.measure_activations(Some(unit))?;
        Ok(output)
    }

    /// Backward of one unit: `d_out (B·s, C)` from the next stage (none on the last stage, which starts
    /// from its loss). Returns the gradient for the previous stage (none on the first stage).
    pub fn backward(
        &mut self,
        unit: Unit,
        d_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, ModelError> {
        let state = self
            .in_flight
            .get_mut(&unit.micro_batch)
            .ok_or_else(|| ModelError::Order {
                unit,
                reason: "backward before forward".into(),
            })?;
        let last_cached = state.kv.first().map_or(0, |kv| kv.len());
        let seg = state
            .units
            .get(&unit.segment)
            .ok_or_else(|| ModelError::Order {
                unit,
                reason: "backward before forward, or twice".into(),
            })?
            .seg;
        if last_cached != seg.start + seg.len {
            return Err(ModelError::Order {
                unit,
                reason:
                    "backward must run after the backward of every later segment of the micro-batch"
                        .into(),
            });
        }
        let ctx = state.units.remove(&unit.segment).expect("checked above");
        let UnitCtx {
            seg,
            token_ids,
            blocks,
            head,
        } = ctx;
        let mut dx = match (head, d_out) {
            (Some(head), None) => {
                self.grads.add("lm_head.weight", head.lm_head.dw)?;
                NormLayer::of(&self.cfg).backward(&self.params, "ln_f", &head.norm, &head.lm_head.dh, &mut self.grads)?
            }
            (None, Some(d)) => d,
            _ => return Err(ModelError::Input { unit, reason: "the last stage starts backward from its loss, the others from the next stage's gradient".into() }),
        };
        let layers: Vec<usize> = self.layout.layers.clone().collect();
        for (slot, ctx) in blocks.into_iter().enumerate().rev() {
            let block = Block::new(&self.cfg, layers[slot], self.rope.as_ref());
            dx = block.backward(
                &self.params,
                ctx,
                &dx,
                seg,
                &mut state.kv[slot],
                &mut self.grads,
            )?;
        }
        if unit.segment == 0 {
            self.in_flight.remove(&unit.micro_batch);
        }
        self.measure_activations(None)?;
        match token_ids {
            Some(ids) => {
                self.grads.add(
                    "wte.weight",
                    embedding_backward(&ids, &dx, self.cfg.vocab_size)?,
                )?;
                if self.cfg.position == Position::Learned {
                    self.grads.add(
                        "wpe.weight",
                        embedding_backward(&position_ids(seg)?, &dx, self.cfg.max_seq_len)?,
                    )?;
                }
                Ok(None)
            }
            None => Ok(Some(dx)),
        }
    }

    /// Per-parameter sums of squared gradients, in canonical order.
    pub fn grad_sums_of_squares(&self) -> Result<Vec<(String, f64)>, ModelError> {
        self.params
            .specs()
            .iter()
            .map(|s| {
                let g = self
                    .grads
                    .get(&s.name)
                    .ok_or_else(|| ModelError::NoGradient(s.name.clone()))?;
                Ok((s.name.clone(), ops::clip::sum_of_squares(g)?))
            })
            .collect()
    }

    /// Clips (multiplies the gradients by `clip_coefficient`), applies AdamW with learning rate `lr`
    /// and clears the gradients.
    pub fn apply_update(
        &mut self,
        optimizer: &mut AdamW,
        lr: f64,
        clip_coefficient: f64,
        weight_decay: f64,
        decay_embeddings: bool,
    ) -> Result<(), ModelError> {
        optimizer.begin_step();
        let mut updates = Vec::with_capacity(self.params.specs().len());
        for spec in self.params.specs() {
            let grad = self
                .grads
                .get(&spec.name)
                .ok_or_else(|| ModelError::NoGradient(spec.name.clone()))?;
            let wd = if decays(spec.kind, decay_embeddings) {
                weight_decay
            } else {
                0.0
            };
            let updated = optimizer.update(
                &spec.name,
                self.params.get(&spec.name)?,
                grad,
                clip_coefficient.min(1.0),
                lr,
                wd,
            )?;
            updates.push((spec.name.clone(), updated));
        }
        for (name, value) in updates {
            self.params.set(&name, value)?;
        }
        self.grads.clear();
        Ok(())
    }

    /// Drops every in-flight unit and gradient (an aborted step).
    pub fn reset_step(&mut self) {
        self.in_flight.clear();
        self.grads.clear();
    }
}

/// Position ids of a segment for every row: `(B·s,)` U32.
fn position_ids(seg: SegmentShape) -> candle_core::Result<Tensor> {
    let ids: Vec<u32> = (0..seg.batch)
        .flat_map(|_| (seg.start..seg.start + seg.len).map(|p| p as u32))
        .collect();
    Tensor::from_vec(ids, seg.tokens(), &Device::Cpu)
}
