//! What the runtime asks of a pipeline stage, whichever device computes it. The worker, its
//! checkpoint and peer-snapshot copies and the data-parallel reduction are written once against
//! [`StageCompute`]; [`super::build_stage`] picks the implementation from `model.device`.
//!
//! Every tensor crosses this interface on the host (candle CPU tensors): a unit's input and output
//! activations and gradients, which the worker sends to its neighbours over TCP, and the named state
//! of checkpoints and peer snapshots. A device stage copies them in and out, so its link to a
//! neighbour is host-staged, wherever the neighbour runs — unless the stage offers
//! [`DeviceLinks`] and the run asks for them (`pipeline.transport = "nccl"`): then boundary tensors
//! go from device to device and only their headers cross the host.
//!
//! [`CpuStage`] is the CPU implementation: the [`Stage`] kernels of `ops` and AdamW. It is the
//! oracle every other device is checked against.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use ops::adamw::{AdamW, AdamWConfig};

use super::config::{DeviceKind, ModelConfig};
use super::error::ModelError;
use super::partition::StageLayout;
use super::snapshot::StateSnapshot;
use super::stage::{Mode, Stage, StageInput, StageOutput};
use crate::checkpointing::shard;
use crate::schedule::Unit;

/// The settings of one optimizer step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateSettings {
    /// Learning rate of this step.
    pub lr: f64,
    /// Global-norm clipping factor (`min(1, clip / norm)`; values above 1 are taken as 1).
    pub clip_coefficient: f64,
    /// Decoupled weight decay of the decayed parameters.
    pub weight_decay: f64,
    /// Whether the embeddings decay too.
    pub decay_embeddings: bool,
}

/// A pipeline stage as the runtime drives it: one (micro-batch, segment) unit at a time, then the
/// step's gradients, the update, and the state in and out by name.
///
/// The contract of every method is [`Stage`]'s (same name); an implementation on another device
/// must give the same results as [`CpuStage`] within its precision's error, and the same results bit
/// for bit from run to run on the same device.
pub trait StageCompute: Send {
    /// Which device computes the stage.
    fn device(&self) -> DeviceKind;
    /// Which layers the stage holds.
    fn layout(&self) -> &StageLayout;
    /// The names of the held parameters, in canonical order (the order of
    /// [`StageCompute::gradient_vector`]).
    fn param_names(&self) -> Vec<String>;
    /// Starts a training step of `micro_batches` micro-batches (see [`Stage::begin_step`]).
    fn begin_step(&mut self, micro_batches: usize);
    /// Masks micro-batch `micro_batch`'s attention to each query's own document, from its rows'
    /// document starts (see [`Stage::set_documents`]): every device does.
    fn set_documents(
        &mut self,
        micro_batch: usize,
        rows: Vec<Vec<usize>>,
    ) -> Result<(), ModelError>;
    /// Gives micro-batch `micro_batch` its own segment lengths (the document partition; see
    /// [`Stage::set_segment_lengths`]). A device that sizes its buffers for one table of lengths
    /// refuses it ([`ModelError::Device`]), never ignores it.
    fn set_segment_lengths(
        &mut self,
        micro_batch: usize,
        lengths: Vec<usize>,
    ) -> Result<(), ModelError> {
        Err(ModelError::Device(format!(
            "micro-batch {micro_batch}: the {:?} stage takes one table of segment lengths for \
             every micro-batch, not {lengths:?} of its own (pipeline.partition = \"documents\" \
             needs model.device = \"cpu\")",
            self.device()
        )))
    }
    /// Positions restart at each document (see [`Stage::set_reset_positions`]); a device whose
    /// position embedding cannot refuses it ([`ModelError::ResetPositionsUnsupported`]), never
    /// ignores it.
    fn set_reset_positions(&mut self, reset: bool) -> Result<(), ModelError> {
        if reset {
            return Err(reset_positions_unsupported(self.device()));
        }
        Ok(())
    }
    /// Forward of one unit (see [`Stage::forward`]).
    fn forward(
        &mut self,
        unit: Unit,
        input: StageInput,
        targets: Option<&Tensor>,
        loss_scale: f64,
        mode: Mode,
    ) -> Result<StageOutput, ModelError>;
    /// Backward of one unit (see [`Stage::backward`]).
    fn backward(&mut self, unit: Unit, d_out: Option<Tensor>)
    -> Result<Option<Tensor>, ModelError>;
    /// The input half of one unit's backward, a zero-bubble `I` (see [`Stage::backward_input`]):
    /// the input gradient, no parameter gradient yet.
    fn backward_input(
        &mut self,
        unit: Unit,
        d_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, ModelError>;
    /// The weight half of one unit's backward, a zero-bubble `W` after its `I` (see
    /// [`Stage::backward_weight`]): the unit's parameter gradients, bit-identical to what a whole
    /// backward adds.
    fn backward_weight(&mut self, unit: Unit) -> Result<(), ModelError>;
    /// Sums the step's gradients over its micro-batches, in the fixed tree order.
    fn finish_gradients(&mut self) -> Result<(), ModelError>;
    /// The step's summed gradients as one vector (what the data-parallel collective reduces).
    fn gradient_vector(&self) -> Result<Vec<f32>, ModelError>;
    /// Replaces the step's summed gradients (after the data-parallel reduction).
    fn set_gradient_vector(&mut self, v: &[f32]) -> Result<(), ModelError>;
    /// The step's summed gradients by parameter name, on the host (tests compare them).
    fn gradients(&self) -> Result<Vec<(String, Tensor)>, ModelError>;
    /// Per-parameter sums of squared gradients of the step, in canonical order.
    fn grad_sums_of_squares(&mut self) -> Result<Vec<(String, f64)>, ModelError>;
    /// Clips, applies AdamW and clears the gradients.
    fn apply_update(&mut self, update: UpdateSettings) -> Result<(), ModelError>;
    /// Drops every in-flight unit and gradient (an aborted step).
    fn reset_step(&mut self);
    /// A consistent host copy of the state: the parameters, then AdamW's moments
    /// (`optim.m.<name>`, `optim.v.<name>`) once the optimizer has taken a step.
    fn state(&self) -> Result<Vec<(String, Tensor)>, ModelError>;
    /// The state after the last update for a checkpoint or peer snapshot, taken without waiting
    /// for it to reach the host where the device allows (a GPU copies it behind the next step's
    /// compute; its next update waits for the copy on the device).
    fn snapshot(&mut self) -> Result<StateSnapshot, ModelError> {
        Ok(StateSnapshot::ready(self.state()?))
    }
    /// Replaces the state with `tensors` (every parameter; the moments too when
    /// `optimizer_step > 0`) and drops any step in flight.
    fn load_state(
        &mut self,
        tensors: Vec<(String, Tensor)>,
        optimizer_step: u64,
    ) -> Result<(), ModelError>;
    /// Bytes of the training state (parameters, gradients, moments).
    fn state_bytes(&self) -> usize;
    /// Bytes of live activations held now.
    fn activation_bytes(&self) -> usize;
    /// The most bytes of live activations since the last call.
    fn take_peak_activation_bytes(&mut self) -> usize;
    /// The most full-gradient buffers held at once since the last call.
    fn take_peak_gradient_buffers(&mut self) -> usize;
    /// The stage's device links, if its device has them (a CUDA stage; not the CPU).
    fn device_links(&mut self) -> Option<&mut dyn DeviceLinks> {
        None
    }
}

/// What a device whose position embedding takes contiguous positions only answers when asked to
/// restart them at each document.
fn reset_positions_unsupported(device: DeviceKind) -> ModelError {
    ModelError::ResetPositionsUnsupported {
        device: match device {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        },
        missing: "its position kernels gather and sum rows pos0 + t, contiguous within a segment",
    }
}

/// Which neighbouring stage a device link goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Neighbour {
    /// The previous stage: activations come from it, gradients go to it.
    Prev,
    /// The next stage.
    Next,
}

/// What flows into a unit's forward over device links.
pub enum LinkedInput {
    /// First stage: the segment's token ids `(B, s)`.
    Tokens(Tensor),
    /// The hidden states received for the unit ([`DeviceLinks::receive_activation`]).
    Received,
}

/// What a unit's forward over device links produced.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LinkedOutput {
    /// Hidden states of `rows` rows, kept on the device for [`DeviceLinks::send_activation`].
    Kept { rows: usize },
    /// Last stage: the unit's summed token loss, scaled as [`StageCompute::forward`]'s.
    LossSum(f64),
}

/// Links between the devices of neighbouring stages (NCCL between GPUs): the stage receives its
/// units' inputs into, and sends their outputs from, buffers on its device, and the worker moves
/// only the tensor headers over its TCP links. Each link is two, one per direction, so that a send
/// waiting for its receiver never holds up the other direction.
///
/// Outputs stay kept until [`DeviceLinks::release_boundaries`] (the next step), so that they can
/// be sent again to a replacement of a lost neighbour. Every wait ends by the deadline or when the
/// `peer_gone` flag of the link is set (the worker's TCP link to that peer sets it when it dies),
/// with [`ModelError::Link`]: a lost neighbour never hangs the stage.
pub trait DeviceLinks {
    /// The two ids (one per direction) of a new link to the next stage, to hand to it.
    fn new_link_ids(&self) -> Result<[[u8; 128]; 2], ModelError>;
    /// Joins the link to `side` from its ids (created by the earlier stage), waiting at most
    /// `timeout` for the peer; a link joined earlier to that side is aborted first.
    fn join_link(
        &mut self,
        side: Neighbour,
        ids: [[u8; 128]; 2],
        timeout: Duration,
        peer_gone: Arc<AtomicBool>,
    ) -> Result<(), ModelError>;
    /// Receives unit `unit`'s input (`rows` rows) from the previous stage; returns once it is on
    /// the device.
    fn receive_activation(
        &mut self,
        unit: Unit,
        rows: usize,
        deadline: Instant,
    ) -> Result<(), ModelError>;
    /// Receives unit `unit`'s output gradient (`rows` rows) from the next stage.
    fn receive_grad(
        &mut self,
        unit: Unit,
        rows: usize,
        deadline: Instant,
    ) -> Result<(), ModelError>;
    /// Queues the send of unit `unit`'s kept output to the next stage.
    fn send_activation(&mut self, unit: Unit, deadline: Instant) -> Result<(), ModelError>;
    /// Queues the send of unit `unit`'s kept input gradient to the previous stage.
    fn send_grad(&mut self, unit: Unit, deadline: Instant) -> Result<(), ModelError>;
    /// Waits for the queued sends and frees every kept or unread boundary tensor.
    fn release_boundaries(&mut self, deadline: Instant) -> Result<(), ModelError>;
    /// Forward of one unit (see [`StageCompute::forward`]) whose output, unless this is the last
    /// stage, is kept for the next stage's link.
    fn forward_linked(
        &mut self,
        unit: Unit,
        input: LinkedInput,
        targets: Option<&Tensor>,
        loss_scale: f64,
        mode: Mode,
    ) -> Result<LinkedOutput, ModelError>;
    /// Backward of one unit from the gradient received for it (the last stage: from its loss);
    /// the input gradient, unless this is the first stage, is kept for the previous stage's link:
    /// its rows.
    fn backward_linked(&mut self, unit: Unit) -> Result<Option<usize>, ModelError>;
    /// The input half of one unit's backward (see [`StageCompute::backward_input`]) from the
    /// gradient received for it, its input gradient kept as [`DeviceLinks::backward_linked`]
    /// keeps it. The weight half crosses no link: it is [`StageCompute::backward_weight`].
    fn backward_input_linked(&mut self, unit: Unit) -> Result<Option<usize>, ModelError>;
}

/// The environment variable naming a worker's CUDA device ordinal (set by its agent: the worker's
/// slot on its node); a CUDA stage opens it modulo the number of visible devices, so several stages
/// may share one GPU. Unset: device 0.
pub const CUDA_DEVICE_ENV: &str = "SEQPIPE_CUDA_DEVICE";

/// Why a CUDA config cannot run in a binary built without CUDA, and what to do.
pub const NO_CUDA_BUILD: &str = "model.device = \"cuda\": this seqpipe was built without CUDA support; rebuild with `cargo build --release --features cuda`, or set model.device = \"cpu\"";

/// What [`super::build_stage`] needs besides the model.
#[derive(Clone, Debug)]
pub struct StageSpec {
    /// The layers the stage holds.
    pub layout: StageLayout,
    /// The segment lengths of a micro-batch given none of its own
    /// ([`StageCompute::set_segment_lengths`]).
    pub segment_lengths: Vec<usize>,
    /// `Some(l)` when micro-batches may get lengths of their own (the document partition), none
    /// over `l` ([`crate::schedule::SegmentRule::longest`]): a device that preallocates sizes its
    /// units for it. `None`: every micro-batch is cut into `segment_lengths`.
    pub longest_segment: Option<usize>,
    /// Seed of the initial weights (a function of `(seed, name)` only).
    pub seed: u64,
    /// AdamW's betas and epsilon.
    pub adamw: AdamWConfig,
    /// Bytes the stage may hold (`train.memory_budget_bytes`), if limited.
    pub memory_budget: Option<usize>,
}

/// A stage on the CPU: the explicit kernels of [`Stage`] and AdamW's state.
pub struct CpuStage {
    stage: Stage,
    optimizer: AdamW,
}

impl CpuStage {
    /// Builds the stage with fresh weights and a fresh optimizer.
    pub fn new(model: &ModelConfig, spec: StageSpec) -> Result<Self, ModelError> {
        let mut stage = Stage::new(model, spec.layout, spec.segment_lengths, spec.seed)?;
        stage.set_memory_budget(spec.memory_budget);
        Ok(Self {
            stage,
            optimizer: AdamW::new(spec.adamw),
        })
    }
}

impl StageCompute for CpuStage {
    fn device(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn layout(&self) -> &StageLayout {
        self.stage.layout()
    }

    fn param_names(&self) -> Vec<String> {
        self.stage
            .params()
            .specs()
            .iter()
            .map(|s| s.name.clone())
            .collect()
    }

    fn begin_step(&mut self, micro_batches: usize) {
        self.stage.begin_step(micro_batches);
    }

    fn set_documents(
        &mut self,
        micro_batch: usize,
        rows: Vec<Vec<usize>>,
    ) -> Result<(), ModelError> {
        self.stage.set_documents(micro_batch, rows)
    }

    fn set_segment_lengths(
        &mut self,
        micro_batch: usize,
        lengths: Vec<usize>,
    ) -> Result<(), ModelError> {
        self.stage.set_segment_lengths(micro_batch, lengths)
    }

    fn set_reset_positions(&mut self, reset: bool) -> Result<(), ModelError> {
        self.stage.set_reset_positions(reset)
    }

    fn forward(
        &mut self,
        unit: Unit,
        input: StageInput,
        targets: Option<&Tensor>,
        loss_scale: f64,
        mode: Mode,
    ) -> Result<StageOutput, ModelError> {
        self.stage.forward(unit, input, targets, loss_scale, mode)
    }

    fn backward(
        &mut self,
        unit: Unit,
        d_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, ModelError> {
        self.stage.backward(unit, d_out)
    }

    fn backward_input(
        &mut self,
        unit: Unit,
        d_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, ModelError> {
        self.stage.backward_input(unit, d_out)
    }

    fn backward_weight(&mut self, unit: Unit) -> Result<(), ModelError> {
        self.stage.backward_weight(unit)
    }

    fn finish_gradients(&mut self) -> Result<(), ModelError> {
        self.stage.finish_gradients()
    }

    fn gradient_vector(&self) -> Result<Vec<f32>, ModelError> {
        self.stage.gradient_vector()
    }

    fn set_gradient_vector(&mut self, v: &[f32]) -> Result<(), ModelError> {
        self.stage.set_gradient_vector(v)
    }

    fn gradients(&self) -> Result<Vec<(String, Tensor)>, ModelError> {
        let grads = self.stage.grads();
        self.param_names()
            .into_iter()
            .map(|name| {
                let g = grads
                    .get(&name)
                    .cloned()
                    .ok_or_else(|| ModelError::NoGradient(name.clone()))?;
                Ok((name, g))
            })
            .collect()
    }

    fn grad_sums_of_squares(&mut self) -> Result<Vec<(String, f64)>, ModelError> {
        self.stage.grad_sums_of_squares()
    }

    fn apply_update(&mut self, u: UpdateSettings) -> Result<(), ModelError> {
        self.stage.apply_update(
            &mut self.optimizer,
            u.lr,
            u.clip_coefficient,
            u.weight_decay,
            u.decay_embeddings,
        )
    }

    fn reset_step(&mut self) {
        self.stage.reset_step();
    }

    /// Candle tensors are immutable and every update makes new ones, so this copies no data: the
    /// copy stays valid while training goes on.
    fn state(&self) -> Result<Vec<(String, Tensor)>, ModelError> {
        Ok(shard::snapshot(&self.stage, &self.optimizer))
    }

    fn load_state(
        &mut self,
        tensors: Vec<(String, Tensor)>,
        optimizer_step: u64,
    ) -> Result<(), ModelError> {
        shard::restore(
            &mut self.stage,
            &mut self.optimizer,
            tensors,
            optimizer_step,
        )?;
        self.stage.reset_step();
        Ok(())
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
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::model::{build_stage, partition_layers};

    fn spec(model: &ModelConfig, stages: usize, s: usize, seq: usize) -> StageSpec {
        StageSpec {
            layout: partition_layers(model, seq, stages).unwrap()[s].clone(),
            segment_lengths: vec![seq / 2, seq / 2],
            longest_segment: None,
            seed: 3,
            adamw: AdamWConfig {
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
            },
            memory_budget: None,
        }
    }

    fn tiny() -> ModelConfig {
        ModelConfig {
            vocab_size: 32,
            layers: 2,
            d_model: 16,
            heads: 2,
            max_seq_len: 16,
            ..ModelConfig::default()
        }
    }

    /// One training step of a one-stage model through the trait.
    fn train_step(stage: &mut dyn StageCompute, seq: usize) {
        let tokens: Vec<u32> = (0..seq as u32).map(|i| (i * 7 + 1) % 32).collect();
        let targets: Vec<u32> = (0..seq as u32).map(|i| (i * 5 + 2) % 32).collect();
        stage.begin_step(1);
        let half = seq / 2;
        for seg in 0..2 {
            let ids = Tensor::from_slice(
                &tokens[seg * half..(seg + 1) * half],
                (1, half),
                &Device::Cpu,
            )
            .unwrap();
            let t = Tensor::from_slice(&targets[seg * half..(seg + 1) * half], half, &Device::Cpu)
                .unwrap();
            let out = stage
                .forward(
                    Unit::new(0, seg),
                    StageInput::Tokens(ids),
                    Some(&t),
                    1.0 / seq as f64,
                    Mode::Train,
                )
                .unwrap();
            assert!(matches!(out, StageOutput::LossSum(l) if l.is_finite()));
        }
        for seg in (0..2).rev() {
            assert!(stage.backward(Unit::new(0, seg), None).unwrap().is_none());
        }
        stage.finish_gradients().unwrap();
        stage
            .apply_update(UpdateSettings {
                lr: 1e-2,
                clip_coefficient: 1.0,
                weight_decay: 0.1,
                decay_embeddings: false,
            })
            .unwrap();
    }

    #[test]
    fn the_state_round_trips_bit_for_bit_and_training_goes_on_identically() {
        let model = tiny();
        let mut a = build_stage(&model, spec(&model, 1, 0, 16)).unwrap();
        assert_eq!(a.device(), DeviceKind::Cpu);
        train_step(a.as_mut(), 16);
        let state = a.state().unwrap();
        let names = a.param_names();
        assert_eq!(state.len(), 3 * names.len(), "parameters and both moments");
        // A stage with other weights takes the state over and continues exactly as the original.
        let mut b = build_stage(
            &model,
            StageSpec {
                seed: 99,
                ..spec(&model, 1, 0, 16)
            },
        )
        .unwrap();
        b.load_state(state, 1).unwrap();
        train_step(a.as_mut(), 16);
        train_step(b.as_mut(), 16);
        let (sa, sb) = (a.state().unwrap(), b.state().unwrap());
        for ((na, ta), (nb, tb)) in sa.iter().zip(&sb) {
            assert_eq!(na, nb);
            let (va, vb) = (
                ta.flatten_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
                tb.flatten_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            );
            assert!(
                va.iter().zip(&vb).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{na} differs"
            );
        }
    }

    #[test]
    fn a_state_without_its_moments_is_refused_after_the_first_step() {
        let model = tiny();
        let mut a = build_stage(&model, spec(&model, 1, 0, 16)).unwrap();
        let params_only: Vec<(String, Tensor)> = a.state().unwrap();
        assert_eq!(params_only.len(), a.param_names().len());
        let err = a.load_state(params_only, 3).unwrap_err().to_string();
        assert!(err.contains("optim.m."), "{err}");
    }

    #[test]
    fn gradients_come_by_name_in_canonical_order() {
        let model = tiny();
        let mut a = build_stage(&model, spec(&model, 1, 0, 16)).unwrap();
        let tokens =
            Tensor::from_slice(&[1u32, 2, 3, 4, 5, 6, 7, 8], (1, 8), &Device::Cpu).unwrap();
        let targets = Tensor::from_slice(&[2u32, 3, 4, 5, 6, 7, 8, 9], 8, &Device::Cpu).unwrap();
        a.begin_step(1);
        a.forward(
            Unit::new(0, 0),
            StageInput::Tokens(tokens),
            Some(&targets),
            0.1,
            Mode::Train,
        )
        .unwrap();
        a.backward(Unit::new(0, 0), None).unwrap();
        assert!(
            a.gradients().is_err(),
            "asked for before the gradients were summed"
        );
        a.finish_gradients().unwrap();
        let names: Vec<String> = a.gradients().unwrap().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, a.param_names());
    }

    /// Without the `cuda` feature, or (the test machines) without a driver: the advice either way.
    #[test]
    fn a_cuda_stage_without_a_gpu_is_refused_with_advice() {
        let model = ModelConfig {
            device: DeviceKind::Cuda,
            ..tiny()
        };
        let err = build_stage(&model, spec(&tiny(), 1, 0, 16))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("model.device = \"cpu\""), "{err}");
    }
}
