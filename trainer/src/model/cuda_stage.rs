//! A pipeline stage on a GPU ([`gpu::stage::GpuStage`]) behind [`StageCompute`]: converts the
//! host tensors the runtime passes (token ids, hidden states, gradients, named state) to and from
//! the device stage's flat host slices, initializes the weights as the CPU stage does (same names,
//! same values for a seed), and opens the worker's GPU.
//!
//! What the CUDA kernels do not cover is refused when the stage is built, with what to do: RoPE
//! positions and f64 stages. Document masks, positions restarting at each document and
//! micro-batches cut into lengths of their own (the document partition) are the device stage's
//! ([`GpuStage::set_documents`], [`GpuStage::set_reset_positions`],
//! [`GpuStage::set_segment_lengths`]).
//!
//! It also offers [`DeviceLinks`]: NCCL links to the neighbouring stages' GPUs
//! (`pipeline.transport = "nccl"`), with the boundary tensors kept on the device. A unit's
//! backward runs whole, or split into its input and weight halves (`seq1f1b-zb`) with gradients
//! bit-identical to the whole one's, from the host or over the links alike.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use gpu::nccl::{Abort, LinkId};
use gpu::stage::{GpuStage, Side, StageParam, StagePlan, UnitGrad, UnitInput, UnitOutput};
use gpu::{Gpu, GpuError, Precision};
use ops::adamw::AdamWConfig;

use super::compute::{
    CUDA_DEVICE_ENV, DeviceLinks, LinkedInput, LinkedOutput, Neighbour, StageCompute, StageSpec,
    UpdateSettings,
};
use super::config::{DeviceKind, ModelConfig, Position, PrecisionKind};
use super::error::ModelError;
use super::params::{ParamSpec, WeightDecay, component_params, init_param};
use super::partition::StageLayout;
use super::snapshot::StateSnapshot;
use super::stage::{Mode, StageInput, StageOutput};
use crate::schedule::Unit;

/// A stage whose kernels run on a GPU.
pub struct CudaStage {
    stage: GpuStage,
    /// `train.memory_budget_bytes`, applied to the device memory the stage holds.
    memory_budget: Option<usize>,
    layout: StageLayout,
    specs: Vec<ParamSpec>,
    adamw: AdamWConfig,
    d_model: usize,
    /// Positions per sequence (the segments' sum).
    seq_len: usize,
}

/// The model's own refusals (units out of order, no step begun) come back as they are; any
/// other failure is the device's.
fn device_err(e: GpuError) -> ModelError {
    match e {
        GpuError::Model(e) => e,
        e => ModelError::Device(e.to_string()),
    }
}

/// A device link's failure is the neighbour's loss; any other is the device's.
fn link_err(e: GpuError) -> ModelError {
    match e {
        GpuError::LinkAborted { .. } | GpuError::Nccl { .. } => ModelError::Link(e.to_string()),
        e => device_err(e),
    }
}

fn side(n: Neighbour) -> Side {
    match n {
        Neighbour::Prev => Side::Prev,
        Neighbour::Next => Side::Next,
    }
}

/// The device ordinal of this worker: [`CUDA_DEVICE_ENV`] if set, else 0.
fn ordinal() -> Result<usize, ModelError> {
    match std::env::var(CUDA_DEVICE_ENV) {
        Ok(v) => v.trim().parse().map_err(|_| {
            ModelError::Device(format!(
                "{CUDA_DEVICE_ENV}={v:?} is not a device ordinal (a non-negative integer)"
            ))
        }),
        Err(_) => Ok(0),
    }
}

fn precision(p: PrecisionKind) -> Precision {
    match p {
        PrecisionKind::Fp32 => Precision::Fp32,
        PrecisionKind::Tf32 => Precision::Tf32,
        PrecisionKind::Bf16 => Precision::Bf16,
    }
}

impl CudaStage {
    /// Opens the worker's GPU and builds the stage with the weights the CPU stage would start
    /// from.
    pub fn new(model: &ModelConfig, spec: StageSpec) -> Result<Self, ModelError> {
        let count = runnable(model)?;
        let gpu = Gpu::open(ordinal()? % count, precision(model.precision)).map_err(|e| {
            ModelError::Device(format!(
                "model.device = \"cuda\": {e} (or set model.device = \"cpu\")"
            ))
        })?;
        let specs: Vec<ParamSpec> = spec
            .layout
            .components()
            .into_iter()
            .flat_map(|c| component_params(model, c))
            .collect();
        let mut params = Vec::with_capacity(specs.len());
        for s in &specs {
            let t = init_param(s, spec.seed, DType::F32, &Device::Cpu)?;
            params.push(StageParam {
                name: s.name.clone(),
                dims: s.shape.clone(),
                values: t.flatten_all()?.to_vec1::<f32>()?,
            });
        }
        let plan = StagePlan {
            model: model.clone(),
            layout: spec.layout.clone(),
            segments: spec.segment_lengths.clone(),
            longest_segment: spec.longest_segment,
        };
        let stage = GpuStage::new(gpu, plan, params).map_err(device_err)?;
        Ok(Self {
            stage,
            memory_budget: spec.memory_budget,
            layout: spec.layout,
            specs,
            adamw: spec.adamw,
            d_model: model.d_model,
            seq_len: spec.segment_lengths.iter().sum(),
        })
    }

    /// The device stage's forward of `unit`, then the memory budget's check.
    fn run_forward(
        &mut self,
        unit: Unit,
        input: UnitInput,
        targets: Option<&Tensor>,
        loss_scale: f64,
        mode: Mode,
    ) -> Result<UnitOutput, ModelError> {
        let targets = targets
            .map(|t| t.flatten_all()?.to_vec1::<u32>())
            .transpose()?;
        let out = self
            .stage
            .forward(
                (unit.micro_batch, unit.segment),
                input,
                targets.as_deref(),
                loss_scale,
                mode == Mode::Train,
            )
            .map_err(link_err)?;
        if let Some(budget) = self.memory_budget {
            let (state, activations) = (self.stage.state_bytes(), self.stage.activation_bytes());
            if state + activations > budget {
                return Err(ModelError::OverBudget {
                    unit,
                    chunks: 1,
                    state,
                    activations,
                    budget,
                });
            }
        }
        Ok(out)
    }

    /// A whole backward or an input half (`run`) of `unit` from a host output gradient, the
    /// input gradient back on the host.
    fn host_backward(
        &mut self,
        unit: Unit,
        d_out: Option<Tensor>,
        run: impl FnOnce(&mut GpuStage, (usize, usize), Option<&[f32]>) -> gpu::Result<UnitGrad>,
    ) -> Result<Option<Tensor>, ModelError> {
        let d = d_out.as_ref().map(host_f32).transpose()?;
        let dx = run(
            &mut self.stage,
            (unit.micro_batch, unit.segment),
            d.as_deref(),
        )
        .map_err(device_err)?;
        match dx {
            UnitGrad::None => Ok(None),
            UnitGrad::Hidden(x) => {
                let rows = x.len() / self.d_model;
                Ok(Some(Tensor::from_vec(x, (rows, self.d_model), &Device::Cpu)?))
            }
            UnitGrad::Kept(_) => Err(ModelError::Device(
                "a backward from the host kept its gradient for a device link; drive a linked stage through DeviceLinks".into(),
            )),
        }
    }

    /// A whole backward (`input_half` false) or an input half of `unit` from the gradient received
    /// on the next stage's device link (the last stage: from its loss); the rows of the input
    /// gradient kept for the previous stage's link.
    fn linked_backward(
        &mut self,
        unit: Unit,
        input_half: bool,
    ) -> Result<Option<usize>, ModelError> {
        let at = (unit.micro_batch, unit.segment);
        let s = &mut self.stage;
        let dx = match (self.layout.is_last(), input_half) {
            (true, false) => s.backward(at, None),
            (true, true) => s.backward_input(at, None),
            (false, false) => s.backward_received(at),
            (false, true) => s.backward_input_received(at),
        }
        .map_err(link_err)?;
        match dx {
            UnitGrad::None => Ok(None),
            UnitGrad::Kept(n) => Ok(Some(n / self.d_model)),
            UnitGrad::Hidden(_) => Err(ModelError::Device(
                "a linked backward's gradient went to the host: join the link to the previous stage first"
                    .into(),
            )),
        }
    }

    fn named(
        list: Vec<(String, Vec<usize>, Vec<f32>)>,
    ) -> Result<Vec<(String, Tensor)>, ModelError> {
        list.into_iter()
            .map(|(name, dims, values)| {
                Ok((
                    name,
                    Tensor::from_vec(values, dims.as_slice(), &Device::Cpu)?,
                ))
            })
            .collect()
    }
}

/// Whether `model` can run on CUDA stages here: learned positions, and a GPU the driver shows.
/// `Ok` holds the number of GPUs; the error says what to do.
pub fn runnable(model: &ModelConfig) -> Result<usize, ModelError> {
    if model.position == Position::Rope {
        return Err(ModelError::Device(
            "model.device = \"cuda\" supports learned positions only (model.position = \"learned\"); RoPE models run on the CPU (model.device = \"cpu\")".into(),
        ));
    }
    let count = gpu::device_count().and_then(|count| match count {
        0 => Err(GpuError::NoDevice {
            count: 0,
            ordinal: 0,
        }),
        n => Ok(n),
    });
    count.map_err(|e| {
        ModelError::Device(format!(
            "model.device = \"cuda\": {e} (or set model.device = \"cpu\")"
        ))
    })
}

fn host_f32(t: &Tensor) -> Result<Vec<f32>, ModelError> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

impl StageCompute for CudaStage {
    fn device(&self) -> DeviceKind {
        DeviceKind::Cuda
    }

    fn layout(&self) -> &StageLayout {
        &self.layout
    }

    fn param_names(&self) -> Vec<String> {
        self.stage.param_names()
    }

    fn begin_step(&mut self, micro_batches: usize) {
        self.stage.begin_step(micro_batches);
    }

    fn set_documents(
        &mut self,
        micro_batch: usize,
        rows: Vec<Vec<usize>>,
    ) -> Result<(), ModelError> {
        // The CPU stage's checks of untrusted starts (sorted, from 0, below the sequence length).
        let batch = rows.len();
        let mask = ::model::document_mask(rows, batch, self.seq_len).map_err(|source| {
            ModelError::Documents {
                micro_batch,
                source,
            }
        })?;
        self.stage
            .set_documents(micro_batch, mask)
            .map_err(device_err)
    }

    fn set_segment_lengths(
        &mut self,
        micro_batch: usize,
        lengths: Vec<usize>,
    ) -> Result<(), ModelError> {
        self.stage
            .set_segment_lengths(micro_batch, lengths)
            .map_err(device_err)
    }

    fn set_reset_positions(&mut self, reset: bool) -> Result<(), ModelError> {
        self.stage.set_reset_positions(reset).map_err(device_err)
    }

    fn forward(
        &mut self,
        unit: Unit,
        input: StageInput,
        targets: Option<&Tensor>,
        loss_scale: f64,
        mode: Mode,
    ) -> Result<StageOutput, ModelError> {
        let (ids, hidden);
        let input = match input {
            StageInput::Tokens(t) => {
                ids = t.flatten_all()?.to_vec1::<u32>()?;
                UnitInput::Tokens(&ids)
            }
            StageInput::Hidden(x) => {
                hidden = host_f32(&x)?;
                UnitInput::Hidden(&hidden)
            }
        };
        match self.run_forward(unit, input, targets, loss_scale, mode)? {
            UnitOutput::LossSum(l) => Ok(StageOutput::LossSum(l)),
            UnitOutput::Hidden(x) => {
                let rows = x.len() / self.d_model;
                Ok(StageOutput::Hidden(Tensor::from_vec(
                    x,
                    (rows, self.d_model),
                    &Device::Cpu,
                )?))
            }
            UnitOutput::Kept(_) => Err(ModelError::Device(
                "a forward from the host kept its output for a device link; drive a linked stage through DeviceLinks".into(),
            )),
        }
    }

    fn backward(
        &mut self,
        unit: Unit,
        d_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, ModelError> {
        self.host_backward(unit, d_out, GpuStage::backward)
    }

    fn backward_input(
        &mut self,
        unit: Unit,
        d_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, ModelError> {
        self.host_backward(unit, d_out, GpuStage::backward_input)
    }

    fn backward_weight(&mut self, unit: Unit) -> Result<(), ModelError> {
        self.stage
            .backward_weight((unit.micro_batch, unit.segment))
            .map_err(device_err)
    }

    fn finish_gradients(&mut self) -> Result<(), ModelError> {
        self.stage.finish_gradients().map_err(device_err)
    }

    fn gradient_vector(&self) -> Result<Vec<f32>, ModelError> {
        self.stage.gradient_vector().map_err(device_err)
    }

    fn set_gradient_vector(&mut self, v: &[f32]) -> Result<(), ModelError> {
        if v.len() != self.stage.numel() {
            return Err(ModelError::GradientLength {
                expected: self.stage.numel(),
                got: v.len(),
            });
        }
        self.stage.set_gradient_vector(v).map_err(device_err)
    }

    fn gradients(&self) -> Result<Vec<(String, Tensor)>, ModelError> {
        Self::named(self.stage.gradients().map_err(device_err)?)
    }

    fn grad_sums_of_squares(&mut self) -> Result<Vec<(String, f64)>, ModelError> {
        self.stage.grad_sums_of_squares().map_err(device_err)
    }

    fn apply_update(&mut self, u: UpdateSettings) -> Result<(), ModelError> {
        let decay = WeightDecay {
            rate: u.weight_decay,
            embeddings: u.decay_embeddings,
        };
        let a = &self.adamw;
        self.stage
            .apply_update(u.lr, u.clip_coefficient, decay, (a.beta1, a.beta2, a.eps))
            .map_err(device_err)
    }

    fn reset_step(&mut self) {
        self.stage.reset_step();
    }

    /// Copies the device state to the host (synchronously: the copy is consistent with the step
    /// that just ended).
    fn state(&self) -> Result<Vec<(String, Tensor)>, ModelError> {
        Self::named(self.stage.state().map_err(device_err)?)
    }

    fn snapshot(&mut self) -> Result<StateSnapshot, ModelError> {
        let pending = self.stage.begin_state_download().map_err(device_err)?;
        Ok(StateSnapshot::pending(move || {
            Self::named(pending.wait().map_err(device_err)?)
        }))
    }

    fn load_state(
        &mut self,
        tensors: Vec<(String, Tensor)>,
        optimizer_step: u64,
    ) -> Result<(), ModelError> {
        let mut by_name: std::collections::HashMap<String, Tensor> = tensors.into_iter().collect();
        // Every parameter (prefixed with `prefix`) in canonical order, flat, with the CPU stage's
        // errors for a missing or misshapen one.
        let mut gather = |prefix: &str| -> Result<Vec<f32>, ModelError> {
            let mut flat = Vec::with_capacity(self.stage.numel());
            for spec in &self.specs {
                let name = format!("{prefix}{}", spec.name);
                let t = by_name
                    .remove(&name)
                    .ok_or_else(|| ModelError::MissingParam(name.clone()))?;
                if t.dims() != spec.shape.as_slice() {
                    return Err(ModelError::Shape {
                        name,
                        expected: spec.shape.clone(),
                        got: t.dims().to_vec(),
                    });
                }
                flat.extend(host_f32(&t)?);
            }
            Ok(flat)
        };
        let values = gather("")?;
        let moments = if optimizer_step > 0 {
            Some((gather("optim.m.")?, gather("optim.v.")?))
        } else {
            None
        };
        let moments = moments.as_ref().map(|(m, v)| (m.as_slice(), v.as_slice()));
        self.stage
            .load_state(&values, moments, optimizer_step)
            .map_err(device_err)
    }

    fn state_bytes(&self) -> usize {
        self.stage.state_bytes()
    }

    fn activation_bytes(&self) -> usize {
        self.stage.activation_bytes()
    }

    fn take_peak_activation_bytes(&mut self) -> usize {
        self.stage.take_peak_activation_bytes()
    }

    fn take_peak_gradient_buffers(&mut self) -> usize {
        self.stage.take_peak_gradient_buffers()
    }

    fn device_links(&mut self) -> Option<&mut dyn DeviceLinks> {
        Some(self)
    }
}

impl DeviceLinks for CudaStage {
    fn new_link_ids(&self) -> Result<[[u8; 128]; 2], ModelError> {
        Ok([
            LinkId::new().map_err(device_err)?.to_bytes(),
            LinkId::new().map_err(device_err)?.to_bytes(),
        ])
    }

    fn join_link(
        &mut self,
        n: Neighbour,
        ids: [[u8; 128]; 2],
        timeout: Duration,
        peer_gone: Arc<AtomicBool>,
    ) -> Result<(), ModelError> {
        let ids = ids.map(LinkId::from_bytes);
        self.stage
            .join_link(side(n), ids, timeout, Abort::from(peer_gone))
            .map_err(link_err)
    }

    fn receive_activation(
        &mut self,
        unit: Unit,
        rows: usize,
        deadline: Instant,
    ) -> Result<(), ModelError> {
        let n = rows * self.d_model;
        self.stage
            .receive_activation((unit.micro_batch, unit.segment), n, deadline)
            .map_err(link_err)
    }

    fn receive_grad(
        &mut self,
        unit: Unit,
        rows: usize,
        deadline: Instant,
    ) -> Result<(), ModelError> {
        let n = rows * self.d_model;
        self.stage
            .receive_grad((unit.micro_batch, unit.segment), n, deadline)
            .map_err(link_err)
    }

    fn send_activation(&mut self, unit: Unit, deadline: Instant) -> Result<(), ModelError> {
        self.stage
            .send_activation((unit.micro_batch, unit.segment), deadline)
            .map_err(link_err)
    }

    fn send_grad(&mut self, unit: Unit, deadline: Instant) -> Result<(), ModelError> {
        self.stage
            .send_grad((unit.micro_batch, unit.segment), deadline)
            .map_err(link_err)
    }

    fn release_boundaries(&mut self, deadline: Instant) -> Result<(), ModelError> {
        self.stage.release_boundaries(deadline).map_err(link_err)
    }

    fn forward_linked(
        &mut self,
        unit: Unit,
        input: LinkedInput,
        targets: Option<&Tensor>,
        loss_scale: f64,
        mode: Mode,
    ) -> Result<LinkedOutput, ModelError> {
        let ids;
        let input = match input {
            LinkedInput::Tokens(t) => {
                ids = t.flatten_all()?.to_vec1::<u32>()?;
                UnitInput::Tokens(&ids)
            }
            LinkedInput::Received => UnitInput::Received,
        };
        match self.run_forward(unit, input, targets, loss_scale, mode)? {
            UnitOutput::LossSum(l) => Ok(LinkedOutput::LossSum(l)),
            UnitOutput::Kept(n) => Ok(LinkedOutput::Kept {
                rows: n / self.d_model,
            }),
            UnitOutput::Hidden(_) => Err(ModelError::Device(
                "a linked forward's output went to the host: join the link to the next stage first"
                    .into(),
            )),
        }
    }

    fn backward_linked(&mut self, unit: Unit) -> Result<Option<usize>, ModelError> {
        self.linked_backward(unit, false)
    }

    fn backward_input_linked(&mut self, unit: Unit) -> Result<Option<usize>, ModelError> {
        self.linked_backward(unit, true)
    }
}
