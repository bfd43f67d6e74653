//! A pipeline stage: a contiguous range of blocks (plus the embeddings on the first stage and the
//! final norm, head and loss on the last), run one (micro-batch, segment) unit at a time. The CPU
//! device, over `ops`: the oracle of every other device. The order rules, the in-flight
//! micro-batches, their documents, the segment table and the activation peak are the `model`
//! crate's ([`::model::stage`]), and so is a unit's program ([`::model::forward_unit`],
//! [`::model::backward_unit`]), run through the CPU's unit device (`unit`); this file holds the
//! stage's parameters, gradients, in-flight state and update, and checks what a unit is given.

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Device, Tensor};
use ops::adamw::AdamW;
use ops::memory::{SavedTensors, TensorBytes};
use ops::rope::RopeTable;

use super::block::{KvPrefix, SegmentShape};
use super::config::{ModelConfig, Position};
use super::error::ModelError;
use super::grads::StepGradients;
use super::params::{Gradients, ParamSpec, Params, WeightDecay, component_params, init_param};
use super::partition::StageLayout;
use super::unit::{CpuModel, CpuUnit, UnitCtx};
pub use super::unit::{StageInput, StageOutput};
pub use ::model::Mode;
use ::model::Unit;
use ::model::stage::{ActivationPeak, InFlight, Segment, Segments};

/// What the CPU keeps for a micro-batch in flight on this stage (the model's [`InFlight`] keeps
/// its counts and document starts).
struct MicroBatchState {
    kv: Vec<KvPrefix>, // one per held block
    /// Saved contexts of the units whose forward ran in training mode, by segment.
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
    segments: Segments,
    params: Params,
    grads: StepGradients<Gradients>,
    /// No gradients: what [`Stage::grads`] shows before the step is summed.
    no_grads: Gradients,
    rope: Option<RopeTable>,
    in_flight: InFlight<MicroBatchState>,
    /// Most bytes of live activations held since [`Stage::take_peak_activation_bytes`], and the
    /// bytes the stage may hold in all (see [`Stage::set_memory_budget`]).
    peak: ActivationPeak,
    /// Positions restart at each document (`data.reset_positions`, see
    /// [`Stage::set_reset_positions`]).
    reset_positions: bool,
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
        Ok(Self {
            cfg: cfg.clone(),
            layout,
            segments: Segments::new(segment_lengths),
            params: Params::new(specs, values),
            grads: StepGradients::default(),
            no_grads: Gradients::default(),
            rope,
            in_flight: InFlight::default(),
            peak: ActivationPeak::default(),
            reset_positions: false,
        })
    }

    /// Positions restart at 0 at each document start (`data.reset_positions`): the learned
    /// position embedding of position `pos` is that of `pos − doc_start(pos)`. Every micro-batch
    /// then needs its documents ([`Stage::set_documents`]) before its first forward. RoPE models
    /// are refused (the rotary table takes contiguous positions only).
    pub fn set_reset_positions(&mut self, reset: bool) -> Result<(), ModelError> {
        if reset && self.cfg.position == Position::Rope {
            return Err(ModelError::Device(
                "data.reset_positions with model.position = \"rope\": the rotary kernels take \
                 contiguous positions only; use model.position = \"learned\" or \
                 data.reset_positions = false"
                    .into(),
            ));
        }
        self.reset_positions = reset;
        Ok(())
    }

    /// Sets the document starts of micro-batch `micro_batch` (per row, absolute positions; a
    /// pure function of its input tokens, the same on every stage): its attention is then masked
    /// to each query's own document, through every segment's K/V prefix and dK/dV carry. Must
    /// come before the micro-batch's first forward; setting the same starts again is allowed
    /// (every unit's message carries them), other starts are refused, as are starts that are not
    /// sorted, beginning with 0 and below the sequence length (they come from a peer: untrusted).
    pub fn set_documents(
        &mut self,
        micro_batch: usize,
        rows: Vec<Vec<usize>>,
    ) -> Result<(), ModelError> {
        let seq_len = self.segments.seq_len();
        let batch = rows.len();
        let mask = ::model::document_mask(rows, batch, seq_len).map_err(|source| {
            ModelError::Documents {
                micro_batch,
                source,
            }
        })?;
        self.in_flight
            .set_documents(micro_batch, mask, |_| Ok::<_, ModelError>(()))
    }

    /// Gives micro-batch `micro_batch` its own segment lengths instead of the stage's table (the
    /// document partition: a pure function of its documents, the same on every stage). Must come
    /// before the micro-batch's first forward; the same lengths again are allowed, others
    /// refused, as are lengths whose count or sum differ from the table's (k segments of the
    /// sequence) or that hold an empty segment.
    pub fn set_segment_lengths(
        &mut self,
        micro_batch: usize,
        lengths: Vec<usize>,
    ) -> Result<(), ModelError> {
        self.in_flight
            .set_segment_lengths(micro_batch, lengths, &self.segments)
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

    /// The step's summed gradients once [`Stage::finish_gradients`] ran (or
    /// [`Stage::set_gradient_vector`]); empty before.
    pub fn grads(&self) -> &Gradients {
        self.grads.total().unwrap_or(&self.no_grads)
    }

    /// Starts a training step of `micro_batches` micro-batches (this stage's indices 0..m):
    /// forgets the last step's gradients. Each micro-batch's gradient accumulates over its
    /// segments; when its backward completes it joins the step's summation tree
    /// ([`ops::sum_tree`]) as leaf i, so the step's sum is the same bit for bit whichever
    /// data-parallel split of the micro-batches computed it. Required before the step's first
    /// backward.
    pub fn begin_step(&mut self, micro_batches: usize) {
        self.grads.begin(micro_batches);
    }

    /// Sums the step's gradients over its micro-batches in the tree (idempotent): afterwards
    /// [`Stage::grads`], [`Stage::gradient_vector`] and the update see the step's total. Errors
    /// when a micro-batch's backward has not completed or no step was begun.
    pub fn finish_gradients(&mut self) -> Result<(), ModelError> {
        self.grads.finish()
    }

    /// The step's summed gradients flattened into one vector, parameters in canonical order
    /// ([`Params::specs`]), each row-major: what the data-parallel collective reduces. Errors
    /// before [`Stage::finish_gradients`] and for a stage whose dtype is not F32.
    pub fn gradient_vector(&self) -> Result<Vec<f32>, ModelError> {
        if !self.grads.is_finished() {
            return Err(ModelError::GradientsNotFinished);
        }
        let total = self.grads.total().unwrap_or(&self.no_grads);
        let mut out = Vec::with_capacity(self.param_elements());
        for spec in self.params.specs() {
            let g = total
                .get(&spec.name)
                .ok_or_else(|| ModelError::NoGradient(spec.name.clone()))?;
            if g.dtype() != DType::F32 {
                return Err(ModelError::GradientDType {
                    name: spec.name.clone(),
                    got: g.dtype(),
                });
            }
            out.extend(g.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(out)
    }

    /// Replaces the step's summed gradients with `v` (laid out as [`Stage::gradient_vector`]
    /// returns them, e.g. after the data-parallel reduction). Errors before
    /// [`Stage::finish_gradients`], for a stage whose dtype is not F32, and when the length does
    /// not match the parameters.
    pub fn set_gradient_vector(&mut self, v: &[f32]) -> Result<(), ModelError> {
        if !self.grads.is_finished() {
            return Err(ModelError::GradientsNotFinished);
        }
        let expected = self.param_elements();
        if v.len() != expected {
            return Err(ModelError::GradientLength {
                expected,
                got: v.len(),
            });
        }
        let mut total = Gradients::default();
        let mut offset = 0;
        for spec in self.params.specs() {
            let dtype = self.params.get(&spec.name)?.dtype();
            if dtype != DType::F32 {
                return Err(ModelError::GradientDType {
                    name: spec.name.clone(),
                    got: dtype,
                });
            }
            let n: usize = spec.shape.iter().product();
            let g =
                Tensor::from_slice(&v[offset..offset + n], spec.shape.as_slice(), &Device::Cpu)?;
            total.set(&spec.name, g);
            offset += n;
        }
        self.grads.set_total(total);
        Ok(())
    }

    /// Number of parameter values the stage holds.
    fn param_elements(&self) -> usize {
        self.params
            .specs()
            .iter()
            .map(|s| s.shape.iter().product::<usize>())
            .sum()
    }

    /// The most full-gradient buffers (each the size of the parameters, a quarter of
    /// [`Stage::state_bytes`]) held at once since the last call: the micro-batches whose backward
    /// is under way, completed ones waiting for an earlier one, the summation tree's partial sums
    /// (at most ⌊log2 m⌋ + 1 with in-order completion) and the finished sum. [`Stage::state_bytes`]
    /// counts one of them; the rest are the price of the fixed summation order. Starts the next
    /// measurement from what is held now.
    pub fn take_peak_gradient_buffers(&mut self) -> usize {
        self.grads.take_peak_buffers()
    }

    /// Number of micro-batches with live activations or K/V.
    pub fn in_flight_micro_batches(&self) -> usize {
        self.in_flight.len()
    }

    /// Bytes of the activations held for backward now: every in-flight unit's saved context, the
    /// K/V prefixes and the dK/dV accumulated for them (each buffer counted once).
    pub fn activation_bytes(&self) -> usize {
        let mut bytes = TensorBytes::default();
        self.in_flight.states().for_each(|mb| bytes.add(mb));
        bytes.total()
    }

    /// The most bytes of live activations held (measured after every forward and backward) since
    /// the last call; starts the next measurement from what is held now.
    pub fn take_peak_activation_bytes(&mut self) -> usize {
        let now = self.activation_bytes();
        self.peak.take(now)
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
        self.peak.set_budget(bytes);
    }

    /// The rows `unit` covers in a micro-batch of `batch` sequences.
    fn segment(&self, unit: Unit, batch: usize) -> Result<SegmentShape, ModelError> {
        let Segment { start, len } = self.in_flight.segment(unit, &self.segments)?;
        Ok(SegmentShape { batch, start, len })
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
        let docs = self
            .in_flight
            .documents(unit.micro_batch)
            .map(|d| d.mask.clone());
        if self.reset_positions && docs.is_none() {
            return Err(ModelError::Input {
                unit,
                reason: "positions restart at each document (data.reset_positions) but the \
                         micro-batch has no document starts (Stage::set_documents)"
                    .into(),
            });
        }
        let (x, seg) = self.checked_input(unit, input)?;
        let blocks = self.layout.layers.len();
        let segment = Segment {
            start: seg.start,
            len: seg.len,
        };
        let mut work = self.in_flight.start_forward(unit, segment, seg.batch, || {
            Ok::<_, ModelError>(MicroBatchState {
                kv: (0..blocks).map(|_| KvPrefix::default()).collect(),
                units: BTreeMap::new(),
            })
        })?;
        let state = &mut work.micro_batch.state;
        // Evaluation keeps no block's context: each is dropped when the next block starts.
        let kept = if mode == Mode::Train { blocks } else { 0 };
        let mut ctx = UnitCtx::new(seg, kept);
        let mut device = CpuUnit::forward(
            self.model(),
            unit,
            mode,
            (&mut state.kv[..], &mut ctx),
            x,
            (targets, loss_scale),
            docs.as_ref(),
        );
        let result = ::model::forward_unit(&mut device, docs.as_ref());
        if result.is_ok() && mode == Mode::Train {
            state.units.insert(unit.segment, ctx);
        }
        // A micro-batch that leaves (evaluation's last segment) is dropped.
        let _left =
            self.in_flight
                .finish_forward(work, result.is_ok().then_some(mode), &self.segments);
        let output = result?;
        let activations = self.activation_bytes();
        self.peak
            .after_forward(unit, activations, self.state_bytes())?;
        Ok(output)
    }

    /// The stage's fixed parts a unit reads.
    fn model(&self) -> CpuModel<'_> {
        CpuModel {
            cfg: &self.cfg,
            layout: &self.layout,
            params: &self.params,
            rope: self.rope.as_ref(),
            reset_positions: self.reset_positions,
        }
    }

    /// `input` checked against the unit's segment and this stage: the token ids `(N,)` (first
    /// stage) or the hidden states `(N, C)`, and the rows they cover.
    fn checked_input(
        &self,
        unit: Unit,
        input: StageInput,
    ) -> Result<(Tensor, SegmentShape), ModelError> {
        match input {
            StageInput::Tokens(tokens) if self.layout.is_first() => {
                let (batch, len) = tokens.dims2()?;
                let seg = self.segment(unit, batch)?;
                if len != seg.len {
                    return Err(ModelError::Input {
                        unit,
                        reason: format!("got {len} tokens per row, segment has {}", seg.len),
                    });
                }
                Ok((tokens.flatten_all()?, seg)) // (N,)
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
                Ok((x, self.segment(unit, n / len)?))
            }
            _ => Err(ModelError::Input {
                unit,
                reason: "tokens go to the first stage, hidden states to the others".into(),
            }),
        }
    }

    /// Backward of one unit: `d_out (B·s, C)` from the next stage (none on the last stage, which starts
    /// from its loss). Returns the gradient for the previous stage (none on the first stage).
    pub fn backward(
        &mut self,
        unit: Unit,
        d_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, ModelError> {
        let segment = self.in_flight.segment(unit, &self.segments)?;
        let mut work = self.in_flight.start_backward(unit, segment)?;
        let docs = self
            .in_flight
            .documents(unit.micro_batch)
            .map(|d| d.mask.clone());
        let result = self.backward_unit(unit, &mut work.micro_batch.state, d_out, docs.as_ref());
        let done = self
            .in_flight
            .finish_backward(work, result.is_ok())
            .is_some();
        let dx = result?;
        if done {
            // Segment 0's backward completes the micro-batch's gradient.
            self.grads
                .complete(unit, &mut |l: Gradients, r| Ok::<_, ModelError>(l.sum(r)?))?;
        }
        self.peak.record(self.activation_bytes());
        Ok(dx)
    }

    /// [`Stage::backward`]'s computation ([`::model::backward_unit`]) on the micro-batch's saved
    /// state, into the micro-batch's own gradient (its segments accumulate in backward order).
    fn backward_unit(
        &mut self,
        unit: Unit,
        state: &mut MicroBatchState,
        d_out: Option<Tensor>,
        docs: Option<&ops::DocumentMask>,
    ) -> Result<Option<Tensor>, ModelError> {
        let grads = self
            .grads
            .accumulator(unit, || Ok::<_, ModelError>(Gradients::default()))?;
        let mut ctx = state
            .units
            .remove(&unit.segment)
            .ok_or_else(|| ModelError::Order {
                unit,
                reason: "the unit's saved context is gone (its backward failed before)".into(),
            })?;
        let model = CpuModel {
            cfg: &self.cfg,
            layout: &self.layout,
            params: &self.params,
            rope: self.rope.as_ref(),
            reset_positions: self.reset_positions,
        };
        let kv = (&mut state.kv[..], &mut ctx);
        let mut device = CpuUnit::backward(model, unit, kv, d_out, grads, docs);
        ::model::backward_unit(&mut device, docs)
    }

    /// The input half of one unit's backward (a zero-bubble `I`): as [`Stage::backward`], the
    /// gradient for the previous stage from `d_out` (none on the last stage), but no parameter
    /// gradient is added: the unit keeps what [`Stage::backward_weight`] needs (its layers' inputs
    /// and output gradients), so its activations stay counted until then.
    pub fn backward_input(
        &mut self,
        unit: Unit,
        d_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, ModelError> {
        let segment = self.in_flight.segment(unit, &self.segments)?;
        let mut work = self.in_flight.start_backward_input(unit, segment)?;
        let docs = self
            .in_flight
            .documents(unit.micro_batch)
            .map(|d| d.mask.clone());
        let model = CpuModel {
            cfg: &self.cfg,
            layout: &self.layout,
            params: &self.params,
            rope: self.rope.as_ref(),
            reset_positions: self.reset_positions,
        };
        let state = &mut work.micro_batch.state;
        let result = match state.units.get_mut(&unit.segment) {
            Some(ctx) => {
                let kv = (&mut state.kv[..], ctx);
                let mut device = CpuUnit::backward_input(model, unit, kv, d_out, docs.as_ref());
                ::model::backward_unit_input(&mut device, docs.as_ref())
            }
            None => Err(ModelError::Order {
                unit,
                reason: "the unit's saved context is gone (its backward failed before)".into(),
            }),
        };
        self.in_flight.finish_backward_input(work, result.is_ok());
        let dx = result?;
        self.peak.record(self.activation_bytes());
        Ok(dx)
    }

    /// The weight half of one unit's backward (a zero-bubble `W`), after its
    /// [`Stage::backward_input`]: adds the unit's parameter gradients to its micro-batch's (the
    /// same additions [`Stage::backward`] makes) and frees what the unit kept. The micro-batch's
    /// gradient is complete after the last weight half that follows segment 0's input half.
    pub fn backward_weight(&mut self, unit: Unit) -> Result<(), ModelError> {
        let segment = self.in_flight.segment(unit, &self.segments)?;
        let mut work = self.in_flight.start_backward_weight(unit, segment)?;
        // The position embedding's gradient reads the positions (per document with
        // `reset_positions`).
        let docs = self
            .in_flight
            .documents(unit.micro_batch)
            .map(|d| d.mask.clone());
        let result = self.backward_weight_unit(unit, &mut work.micro_batch.state, docs.as_ref());
        let done = self
            .in_flight
            .finish_backward_weight(work, result.is_ok())
            .is_some();
        result?;
        if done {
            self.grads
                .complete(unit, &mut |l: Gradients, r| Ok::<_, ModelError>(l.sum(r)?))?;
        }
        self.peak.record(self.activation_bytes());
        Ok(())
    }

    /// [`Stage::backward_weight`]'s computation ([`::model::backward_unit_weight`]) on the
    /// micro-batch's saved state, into the micro-batch's own gradient.
    fn backward_weight_unit(
        &mut self,
        unit: Unit,
        state: &mut MicroBatchState,
        docs: Option<&ops::DocumentMask>,
    ) -> Result<(), ModelError> {
        let grads = self
            .grads
            .accumulator(unit, || Ok::<_, ModelError>(Gradients::default()))?;
        let mut ctx = state
            .units
            .remove(&unit.segment)
            .ok_or_else(|| ModelError::Order {
                unit,
                reason: "the unit's saved context is gone (its backward failed before)".into(),
            })?;
        let model = CpuModel {
            cfg: &self.cfg,
            layout: &self.layout,
            params: &self.params,
            rope: self.rope.as_ref(),
            reset_positions: self.reset_positions,
        };
        let kv = (&mut state.kv[..], &mut ctx);
        let mut device = CpuUnit::backward_weight(model, unit, kv, grads, docs);
        ::model::backward_unit_weight(&mut device)
    }

    /// Per-parameter sums of squared gradients of the step, in canonical order (sums the
    /// gradients first if [`Stage::finish_gradients`] has not run).
    pub fn grad_sums_of_squares(&mut self) -> Result<Vec<(String, f64)>, ModelError> {
        self.finish_gradients()?;
        let grads = self.grads.total().unwrap_or(&self.no_grads);
        self.params
            .specs()
            .iter()
            .map(|s| {
                let g = grads
                    .get(&s.name)
                    .ok_or_else(|| ModelError::NoGradient(s.name.clone()))?;
                Ok((s.name.clone(), ops::clip::sum_of_squares(g)?))
            })
            .collect()
    }

    /// Clips (multiplies the gradients by `clip_coefficient`), applies AdamW with learning rate `lr`
    /// and clears the gradients (the next step needs [`Stage::begin_step`]). Sums the gradients
    /// first if [`Stage::finish_gradients`] has not run.
    pub fn apply_update(
        &mut self,
        optimizer: &mut AdamW,
        lr: f64,
        clip_coefficient: f64,
        weight_decay: f64,
        decay_embeddings: bool,
    ) -> Result<(), ModelError> {
        self.finish_gradients()?;
        // The model's decay rule, as every device applies it.
        let decay = WeightDecay {
            rate: weight_decay,
            embeddings: decay_embeddings,
        };
        optimizer.begin_step();
        let grads = self.grads.total().unwrap_or(&self.no_grads);
        let mut updates = Vec::with_capacity(self.params.specs().len());
        for spec in self.params.specs() {
            let grad = grads
                .get(&spec.name)
                .ok_or_else(|| ModelError::NoGradient(spec.name.clone()))?;
            let wd = decay.rate_of(spec.kind);
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

    /// Drops every in-flight unit and gradient, summed or not (an aborted step); the next step
    /// needs [`Stage::begin_step`].
    pub fn reset_step(&mut self) {
        self.in_flight.clear();
        self.grads.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use ops::sum_tree::{SumTree, valid_replicas};

    use super::*;
    use crate::model::config::Norm;
    use crate::model::params::param_count;

    const ROWS: usize = 2;
    const SEGMENTS: [usize; 2] = [5, 3];
    const MICRO_BATCHES: usize = 4;

    fn cfg() -> ModelConfig {
        ModelConfig {
            vocab_size: 32,
            layers: 2,
            d_model: 16,
            heads: 2,
            ffn_mult: 4,
            max_seq_len: 8,
            position: Position::Learned,
            norm: Norm::LayerNorm,
            ..ModelConfig::default()
        }
    }

    fn stage() -> Stage {
        let cfg = cfg();
        let layout = StageLayout {
            stage: 0,
            stages: 1,
            layers: 0..cfg.layers,
        };
        Stage::new(&cfg, layout, SEGMENTS.to_vec(), 5).unwrap()
    }

    /// Tokens of global micro-batch `g`: `ROWS × (T + 1)`, a function of `g` only.
    fn tokens(g: usize) -> Vec<u32> {
        let t: usize = SEGMENTS.iter().sum();
        let mut x = 0x2545_F491_4F6C_DD1Du64 ^ (g as u64 + 1).wrapping_mul(0x9E37_79B9);
        (0..ROWS * (t + 1))
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 32) as u32
            })
            .collect()
    }

    /// Forward of local micro-batch `i` (global `g`), every segment.
    fn forward(stage: &mut Stage, i: usize, g: usize) {
        let t: usize = SEGMENTS.iter().sum();
        let all = Tensor::from_vec(tokens(g), (ROWS, t + 1), &Device::Cpu).unwrap();
        let scale = 1.0 / (MICRO_BATCHES * ROWS * t) as f64;
        let mut start = 0;
        for (j, &len) in SEGMENTS.iter().enumerate() {
            let inputs = all.narrow(1, start, len).unwrap();
            let targets = all
                .narrow(1, start + 1, len)
                .unwrap()
                .flatten_all()
                .unwrap();
            let unit = Unit::new(i, j);
            let out = stage
                .forward(
                    unit,
                    StageInput::Tokens(inputs),
                    Some(&targets),
                    scale,
                    Mode::Train,
                )
                .unwrap();
            assert!(matches!(out, StageOutput::LossSum(_)));
            start += len;
        }
    }

    /// Backward of local micro-batch `i`, segments last to first.
    fn backward(stage: &mut Stage, i: usize) {
        for j in (0..SEGMENTS.len()).rev() {
            assert!(stage.backward(Unit::new(i, j), None).unwrap().is_none());
        }
    }

    /// One step over global micro-batches `globals` (local indices 0..), backwards completing in
    /// `completion` order of local indices; returns the summed gradient vector.
    fn step(stage: &mut Stage, globals: &[usize], completion: &[usize]) -> Vec<f32> {
        stage.begin_step(globals.len());
        for (i, &g) in globals.iter().enumerate() {
            forward(stage, i, g);
        }
        for &i in completion {
            backward(stage, i);
        }
        stage.finish_gradients().unwrap();
        stage.gradient_vector().unwrap()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn add(a: Vec<f32>, b: Vec<f32>) -> Result<Vec<f32>, Infallible> {
        Ok(a.iter().zip(&b).map(|(x, y)| x + y).collect())
    }

    #[test]
    fn two_replicas_of_two_micro_batches_sum_to_the_bits_of_one_stage_of_four() {
        assert!(valid_replicas(MICRO_BATCHES, 2));
        let mut single = stage();
        let whole = step(&mut single, &[0, 1, 2, 3], &[0, 1, 2, 3]);
        // In order, the tree holds [0,2), [2,3) and micro-batch 3's gradient at once.
        assert_eq!(single.take_peak_gradient_buffers(), 3);
        assert_eq!(single.take_peak_gradient_buffers(), 1);

        let mut replicas = SumTree::new(MICRO_BATCHES);
        for (r, globals) in [[0, 1], [2, 3]].iter().enumerate() {
            let mut s = stage();
            let part = step(&mut s, globals, &[0, 1]);
            replicas.push(2 * r, 2 * r + 2, part, &mut add).unwrap();
        }
        let combined = replicas.finish::<Infallible>().unwrap();
        assert_eq!(combined.len(), whole.len());
        assert!(
            bits(&combined) == bits(&whole),
            "replicas differ from one stage"
        );

        // The same gradient summed left to right over the micro-batches is (here) other bits: the
        // tree is what makes the split exact.
        let mut per_mb = Vec::new();
        for g in 0..MICRO_BATCHES {
            let mut s = stage();
            s.begin_step(1);
            forward(&mut s, 0, g);
            backward(&mut s, 0);
            s.finish_gradients().unwrap();
            per_mb.push(s.gradient_vector().unwrap());
        }
        let tree = add(
            add(per_mb[0].clone(), per_mb[1].clone()).unwrap(),
            add(per_mb[2].clone(), per_mb[3].clone()).unwrap(),
        )
        .unwrap();
        assert!(bits(&tree) == bits(&whole), "the tree by hand differs");
        let fold = per_mb
            .into_iter()
            .reduce(|a, b| add(a, b).unwrap())
            .unwrap();
        assert!(
            bits(&fold) != bits(&whole),
            "left fold equals the tree: test is blind"
        );
    }

    #[test]
    fn micro_batches_completing_out_of_order_wait_for_their_turn() {
        let mut in_order = stage();
        let want = step(&mut in_order, &[0, 1, 2, 3], &[0, 1, 2, 3]);
        let mut shuffled = stage();
        let got = step(&mut shuffled, &[0, 1, 2, 3], &[1, 3, 0, 2]);
        assert!(bits(&got) == bits(&want));
        // Held: 1 and 3 wait while 0 runs, then [0,2) and 3 while 2 runs.
        assert_eq!(shuffled.take_peak_gradient_buffers(), 3);
    }

    #[test]
    fn gradients_need_a_begun_complete_step_and_vectors_of_the_right_length() {
        let mut s = stage();
        forward(&mut s, 0, 0);
        let e = s.backward(Unit::new(0, 1), None).unwrap_err();
        assert!(matches!(e, ModelError::NoStep), "{e}");
        assert!(e.to_string().contains("Stage::begin_step"), "{e}");

        s.reset_step();
        s.begin_step(2);
        forward(&mut s, 0, 0);
        backward(&mut s, 0);
        assert!(matches!(
            s.gradient_vector(),
            Err(ModelError::GradientsNotFinished)
        ));
        assert!(s.grads().get("wte.weight").is_none());
        let e = s.finish_gradients().unwrap_err();
        assert!(
            matches!(
                e,
                ModelError::IncompleteGradients {
                    completed: 1,
                    micro_batches: 2
                }
            ),
            "{e}"
        );
        // Micro-batch 0 again in the same step, and one past the step's count.
        forward(&mut s, 0, 0);
        assert!(matches!(
            s.backward(Unit::new(0, 1), None),
            Err(ModelError::Order { .. })
        ));
        s.reset_step();
        s.begin_step(2);
        forward(&mut s, 2, 2);
        assert!(matches!(
            s.backward(Unit::new(2, 1), None),
            Err(ModelError::Input { .. })
        ));

        // Round trip through the flat vector; a wrong length is refused, naming both.
        let mut s = stage();
        let v = step(&mut s, &[0], &[0]);
        assert_eq!(v.len(), param_count(&cfg()));
        let doubled: Vec<f32> = v.iter().map(|x| 2.0 * x).collect();
        s.set_gradient_vector(&doubled).unwrap();
        assert!(bits(&s.gradient_vector().unwrap()) == bits(&doubled));
        let e = s.set_gradient_vector(&v[1..]).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("{} values", v.len() - 1)) && msg.contains(&v.len().to_string()),
            "{msg}"
        );
        // The update uses the replaced gradients; afterwards a new step must be begun.
        let mut opt = AdamW::new(ops::AdamWConfig::default());
        s.apply_update(&mut opt, 1e-3, 1.0, 0.0, false).unwrap();
        assert!(matches!(s.finish_gradients(), Err(ModelError::NoStep)));
    }

    /// A deterministic `(rows, cols)` tensor of values in [-1, 1) from `seed`.
    fn noise(rows: usize, cols: usize, seed: u64) -> Tensor {
        let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect();
        Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap()
    }

    /// How a backward is run: whole, or split with each weight half `lag` input halves late.
    #[derive(Clone, Copy, Debug)]
    enum Backward {
        Whole,
        Split { lag: usize },
    }

    /// One training step of stage `layout` of `cfg` over `m` micro-batches cut into `segments`
    /// (with `docs`, document masks), every forward first, then the backwards in Seq1F1B's order
    /// (micro-batches ascending, segments descending) run as `how`. Returns the input gradient of
    /// every unit (in that order, as bits) and the step's summed gradient (bits).
    fn run_step(
        cfg: &ModelConfig,
        layout: StageLayout,
        segments: &[usize],
        m: usize,
        docs: Option<&[Vec<usize>]>,
        how: Backward,
    ) -> (Vec<Vec<u32>>, Vec<u32>) {
        let t: usize = segments.iter().sum();
        let mut s = Stage::new(cfg, layout.clone(), segments.to_vec(), 11).unwrap();
        s.begin_step(m);
        let c = cfg.d_model;
        for i in 0..m {
            if let Some(docs) = docs {
                s.set_documents(i, docs.to_vec()).unwrap();
            }
            let all = Tensor::from_vec(tokens(100 + i), (ROWS, t + 1), &Device::Cpu).unwrap();
            let mut start = 0;
            for (j, &len) in segments.iter().enumerate() {
                let input = if layout.is_first() {
                    StageInput::Tokens(all.narrow(1, start, len).unwrap())
                } else {
                    StageInput::Hidden(noise(ROWS * len, c, (i * 10 + j) as u64))
                };
                let targets = all
                    .narrow(1, start + 1, len)
                    .unwrap()
                    .flatten_all()
                    .unwrap();
                let scale = 1.0 / (m * ROWS * t) as f64;
                s.forward(Unit::new(i, j), input, Some(&targets), scale, Mode::Train)
                    .unwrap();
                start += len;
            }
        }
        let order: Vec<Unit> = (0..m)
            .flat_map(|i| (0..segments.len()).rev().map(move |j| Unit::new(i, j)))
            .collect();
        let d_out = |u: Unit| {
            (!layout.is_last()).then(|| {
                noise(
                    ROWS * segments[u.segment],
                    c,
                    1000 + (u.micro_batch * 10 + u.segment) as u64,
                )
            })
        };
        let mut dx = Vec::new();
        let bits = |t: Option<Tensor>| -> Vec<u32> {
            t.map(|t| {
                t.flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect()
            })
            .unwrap_or_default()
        };
        match how {
            Backward::Whole => {
                for &u in &order {
                    dx.push(bits(s.backward(u, d_out(u)).unwrap()));
                }
            }
            Backward::Split { lag } => {
                let mut waiting = std::collections::VecDeque::new();
                for &u in &order {
                    dx.push(bits(s.backward_input(u, d_out(u)).unwrap()));
                    waiting.push_back(u);
                    if waiting.len() > lag {
                        s.backward_weight(waiting.pop_front().unwrap()).unwrap();
                    }
                }
                if !waiting.is_empty() {
                    // The step's gradient is not complete before every weight half.
                    let e = s.finish_gradients().unwrap_err();
                    assert!(matches!(e, ModelError::IncompleteGradients { .. }), "{e}");
                }
                while let Some(u) = waiting.pop_front() {
                    s.backward_weight(u).unwrap();
                }
            }
        }
        assert_eq!(s.in_flight_micro_batches(), 0);
        s.finish_gradients().unwrap();
        (
            dx,
            bits(Some(
                Tensor::new(s.gradient_vector().unwrap(), &Device::Cpu).unwrap(),
            )),
        )
    }

    /// The split backward, its weight halves deferred past later units' input halves (as
    /// seq1f1b-zb runs them), gives the whole backward's input gradients and parameter gradients
    /// bit for bit: on every kind of stage (first, middle, last, whole model), norm, position
    /// embedding, segment cut and with document masks.
    #[test]
    fn split_backwards_give_the_whole_backwards_gradients_bit_for_bit() {
        let cases: [(Norm, Position, &[usize], bool); 4] = [
            (Norm::LayerNorm, Position::Learned, &[5, 3], false),
            (Norm::RmsNorm, Position::Rope, &[2, 3, 3], false),
            (Norm::LayerNorm, Position::Learned, &[3, 3, 2], true),
            (Norm::RmsNorm, Position::Learned, &[8], false),
        ];
        let docs = [vec![0, 3, 6], vec![0, 5]];
        for (norm, position, segments, masked) in cases {
            let cfg = ModelConfig {
                layers: 3,
                norm,
                position,
                ..cfg()
            };
            for (stage, stages, layers) in [(0, 1, 0..3), (0, 3, 0..1), (1, 3, 1..2), (2, 3, 2..3)]
            {
                let layout = StageLayout {
                    stage,
                    stages,
                    layers,
                };
                let docs = masked.then_some(&docs[..]);
                let whole = run_step(&cfg, layout.clone(), segments, 3, docs, Backward::Whole);
                assert!(
                    whole.1.iter().any(|&b| b != 0),
                    "no gradient: the test is blind"
                );
                for lag in [0, 1, 4] {
                    let split = run_step(
                        &cfg,
                        layout.clone(),
                        segments,
                        3,
                        docs,
                        Backward::Split { lag },
                    );
                    let what = format!(
                        "{norm:?} {position:?} {segments:?} masked {masked} stage {stage}/{stages} lag {lag}"
                    );
                    assert!(split.0 == whole.0, "input gradients differ: {what}");
                    assert!(split.1 == whole.1, "parameter gradients differ: {what}");
                }
            }
        }
    }

    /// A unit that ran its input half holds what its weight half reads (counted in the stage's
    /// activations) until the weight half frees it; W before I, W twice and I twice are refused
    /// with the order error naming the problem.
    #[test]
    fn a_unit_holds_its_activations_until_its_weight_half_and_the_halves_keep_their_order() {
        let mut s = stage();
        s.begin_step(1);
        forward(&mut s, 0, 0);
        let (u0, u1) = (Unit::new(0, 0), Unit::new(0, 1));
        let split = |e: ModelError| match e {
            ModelError::SplitOrder { problem, .. } => problem,
            other => panic!("not a split order error: {other}"),
        };
        assert_eq!(
            split(s.backward_weight(u1).unwrap_err()),
            ::model::SplitOrder::WeightBeforeInput
        );
        let held = s.activation_bytes();
        s.backward_input(u1, None).unwrap();
        s.backward_input(u0, None).unwrap();
        let after_inputs = s.activation_bytes();
        assert!(after_inputs > 0, "the weight halves' inputs are held");
        assert!(
            after_inputs < held,
            "the K/V and the input halves' own contexts are freed"
        );
        assert_eq!(
            split(s.backward_input(u1, None).unwrap_err()),
            ::model::SplitOrder::InputTwice
        );
        s.backward_weight(u1).unwrap();
        assert_eq!(
            split(s.backward_weight(u1).unwrap_err()),
            ::model::SplitOrder::WeightTwice
        );
        assert!(s.activation_bytes() < after_inputs);
        s.backward_weight(u0).unwrap();
        assert_eq!(s.activation_bytes(), 0);
        assert_eq!(s.in_flight_micro_batches(), 0);
        s.finish_gradients().unwrap();
    }

    /// What a block's unit holds, counted in f32 values (C = d_model, F = the MLP width, H
    /// heads, N tokens). After its forward, per token: LayerNorm 1's input, mean and rstd
    /// (C + 2), the QKV projection's input (C), attention's queries and log-sum-exp (C + H), the
    /// segment's keys and values (2C), attention's output, which the output projection keeps as
    /// its input (C, one buffer), LayerNorm 2's (C + 2), the MLP's input (C), GELU's input (F)
    /// and the MLP projection's input (F): 9C + 2F + H + 4. Waiting for its weight half, per
    /// token: the four linear layers' inputs (3C + F) and output gradients (3C + C + F + C),
    /// 8C + 2F, and per unit the norms' and the MLP bias's gradients (4C + F): 16C against
    /// 17C + H + 4 with F = 4C, about 0.94 of the forward's. Counting memory in bytes instead of
    /// live units would let a forward in only where some 17 units wait for their weight halves.
    #[test]
    fn a_unit_waiting_for_its_weight_half_keeps_its_linear_layers_inputs_and_output_gradients() {
        let cfg = ModelConfig { layers: 3, ..cfg() };
        let layout = StageLayout {
            stage: 1,
            stages: 3,
            layers: 1..2,
        };
        let len = 8;
        let mut s = Stage::new(&cfg, layout, vec![len], 3).unwrap();
        s.begin_step(1);
        let u = Unit::new(0, 0);
        let (c, f, h, n) = (
            cfg.d_model,
            cfg.ffn_mult * cfg.d_model,
            cfg.heads,
            ROWS * len,
        );
        let input = StageInput::Hidden(noise(n, c, 1));
        s.forward(u, input, None, 1.0, Mode::Train).unwrap();
        let live = s.activation_bytes();
        assert_eq!(live, 4 * n * (9 * c + 2 * f + h + 4));
        s.backward_input(u, Some(noise(n, c, 2))).unwrap();
        let waiting = s.activation_bytes();
        assert_eq!(waiting, 4 * (n * (8 * c + 2 * f) + 4 * c + f));
        s.backward_weight(u).unwrap();
        assert_eq!(s.activation_bytes(), 0);
    }
}
