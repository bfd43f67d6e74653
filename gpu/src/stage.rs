//! One pipeline stage on a GPU, driven one Seq1F1B unit (micro-batch, segment) at a time: the
//! blocks `layers` of a GPT-2 style model (learned positions, pre-norm blocks with layer or RMS
//! norm, fused QKV, tanh-GELU MLP), with the embeddings on the first stage and the final norm, the
//! untied LM head and the cross-entropy (in row chunks) on the last — the arithmetic of the CPU
//! stage (`trainer/src/model/stage.rs`), under the same parameter names, so weights move between
//! the two unchanged and the CPU stage is the oracle of its gradients. The stage's program for a
//! unit (embeddings or received input → held blocks → final norm, head and loss or output, and
//! back: [`model::forward_unit`], [`model::backward_unit`]) and the block's order of operations
//! ([`model::block_forward`], [`model::block_backward`]) are the `model` crate's, run by both
//! devices; this stage supplies the kernels and the buffers they write (`unit`, `block`), and
//! keeps its own matters around them: device links, BF16 weight copies, buffer recycling.
//! `seqpipe gpu bench` runs one stage holding the whole model. The unit order rules, the lifecycle
//! of the micro-batches in flight, their document starts, the segment table and the activation
//! peak are the model's ([`model::stage`]); this stage keeps its buffers in them.
//!
//! Each in-flight micro-batch keeps, per held block, the fused QKV rows of its finished segments
//! (a `(B, T, 3C)` cache of whole sequences: a segment attends to the keys and values of every
//! earlier one) and the dK/dV those rows receive from later segments' backwards, which run first
//! (`(B, T, C)` each, added to in backward order by the attention kernel: no atomics). A unit's
//! saved activations live in buffers of its micro-batch, sized at the first forward and reused
//! when the micro-batch is done: a steady-state step allocates nothing.
//!
//! Gradients: each micro-batch accumulates into its own flat buffer (parameters in canonical order,
//! each row-major), which joins the canonical summation tree ([`ops::SumTree`], kept by [`model::StepGradients`]) when its
//! backward completes; the tree adds on the device in a fixed order, so the step's sum does not depend on
//! how the micro-batches were split between data-parallel replicas or in which order they
//! completed. Everything crosses this type's interface on the host (`&[f32]`, `Vec<f32>`), except
//! the boundary tensors of device links to the neighbouring stages (`links`): those are received
//! into, kept in and sent from buffers of the stage.
//!
//! BF16 mode's default path ([`Bf16Path::CachedWeights`]) keeps BF16 copies of the weights of
//! every product ([`Bf16Weights`]), refreshed once after each change of the FP32 master weights
//! (build, update, load), and rounds only the activation operand of a product into BF16 (once where
//! two products share it); the LM head's copy has the vocabulary padded to a multiple of
//! [`VOCAB_PADDING`] rows (zero past the real ones), so its products run on aligned rows. The
//! copies are derived data: the state, snapshots and parameter shapes keep the real vocabulary and
//! never include them. FP32 master weights, gradients and AdamW moments are as in every mode.
//!
//! Document masks (packed documents): [`GpuStage::set_documents`] gives a micro-batch its rows'
//! document starts before its first forward; they are uploaded once as one start per position
//! ([`crate::DocStarts`]) and every block's attention kernels of every segment read them, so a
//! query attends only to its own document's keys through the K/V cache, and the dK/dV left for
//! other documents' keys are zero. With [`GpuStage::set_reset_positions`] the embedding reads
//! them too: positions restart at each document. With [`StagePlan::longest_segment`] a
//! micro-batch may be cut into segments of its own ([`GpuStage::set_segment_lengths`], the
//! document partition): every unit's buffers then hold that longest segment, and each unit
//! covers the positions its micro-batch's lengths give it.
//!
//! Zero-bubble schedules split a unit's backward in two: [`GpuStage::backward_input`] (`I`: the
//! input gradient for the previous stage, sent on at once, and the dK/dV carry) and, later,
//! [`GpuStage::backward_weight`] (`W`: the parameter gradients). The input half keeps the output
//! gradients the weight half reads in the unit's own activation buffers that it has spent by then
//! (`block` lists which), and each norm's parameter gradients in two rows of its own; the weight
//! half runs the kernels of a whole backward's weight products and column sums, in its order, so
//! the gradients are bit-identical to a whole backward's. A whole backward is the same pieces,
//! each weight half at once after its input half.
//!
//! State leaves without stopping the step: [`GpuStage::begin_state_download`] queues a copy of the
//! parameters and moments to pinned host memory behind the compute ([`crate::offload`]) and
//! returns at once; the next update waits for that copy on the device before it overwrites them.

use std::collections::HashMap;
use std::sync::Arc;

use model::params::{ParamKind, ParamSpec, WeightDecay, component_params, names};
use model::stage::{ActivationPeak, InFlight, Mode, Segment, Segments};
use model::{ModelConfig, Norm, Position, StageLayout, StepGradients, Unit};

use crate::device::{Buf, Gpu};
use crate::error::{GpuError, Result, shape};
use crate::kernels::{AttnShape, DocStarts, NormSaved, position_doc_starts};
use crate::offload::{Download, Fence, StagingPool};
use crate::profile::{GRAD_ACCUMULATION, LAYERNORM_BWD, Pass, WEIGHT_REFRESH};
use crate::types::Bf16Path;

#[cfg(all(test, feature = "emulate"))]
mod bf16_tests;
mod block;
mod links;
mod part;
#[cfg(all(test, feature = "emulate"))]
mod split_tests;
mod unit;
pub use links::Side;
use links::{Flow, Links};
use part::Part;
use unit::{Arrival, Bwd, Forwarded, Fwd, GpuUnit};

/// A host tensor `(name, dims, values)`.
pub type NamedTensor = (String, Vec<usize>, Vec<f32>);

/// The part of the model a stage holds and how its sequences are cut.
#[derive(Clone, Debug)]
pub struct StagePlan {
    /// The whole model (the `[model]` section; learned positions only on the GPU).
    pub model: ModelConfig,
    /// The blocks this stage holds, and whether it holds the embeddings (first) and the head (last).
    pub layout: StageLayout,
    /// Lengths of the segments every sequence is cut into, in order (of a micro-batch given no
    /// lengths of its own).
    pub segments: Vec<usize>,
    /// `Some(l)`: micro-batches may be cut into lengths of their own
    /// ([`GpuStage::set_segment_lengths`]: the document partition), no segment longer than `l`,
    /// and every unit's buffers hold `l` positions. `None`: every micro-batch is cut into
    /// `segments`, and each unit's buffers hold its segment's.
    pub longest_segment: Option<usize>,
}

impl StagePlan {
    /// One stage holding the whole model (benchmarks, tests).
    pub fn whole(model: ModelConfig, segments: Vec<usize>) -> StagePlan {
        let layout = StageLayout {
            stage: 0,
            stages: 1,
            layers: 0..model.layers,
        };
        StagePlan {
            model,
            layout,
            segments,
            longest_segment: None,
        }
    }
}

/// One parameter handed to [`GpuStage::new`], in canonical order.
#[derive(Clone, Debug)]
pub struct StageParam {
    /// Global name (`h.3.attn.c_attn.weight`).
    pub name: String,
    /// Dimensions.
    pub dims: Vec<usize>,
    /// Initial values, row-major.
    pub values: Vec<f32>,
}

/// What flows into a unit's forward.
pub enum UnitInput<'a> {
    /// First stage: the segment's token ids, `B·s` of them (row-major `(B, s)`).
    Tokens(&'a [u32]),
    /// Later stages: the previous stage's hidden states `(B·s, C)`.
    Hidden(&'a [f32]),
    /// Later stages: the hidden states received for this unit on the previous stage's device link
    /// ([`GpuStage::receive_activation`]).
    Received,
}

/// What a unit's forward produces.
pub enum UnitOutput {
    /// Hidden states `(B·s, C)` for the next stage.
    Hidden(Vec<f32>),
    /// Hidden states kept on the device for the next stage's device link (this many values;
    /// [`GpuStage::send_activation`] sends them).
    Kept(usize),
    /// Last stage: the sum of the segment's token losses (unscaled), added in row order.
    LossSum(f64),
}

/// What a unit's backward produces for the previous stage.
#[derive(Debug, PartialEq)]
pub enum UnitGrad {
    /// First stage: nothing leaves.
    None,
    /// The gradient of the unit's input `(B·s, C)`.
    Hidden(Vec<f32>),
    /// The gradient kept on the device for the previous stage's device link (this many values;
    /// [`GpuStage::send_grad`] sends it).
    Kept(usize),
}

/// Where a unit's backward starts.
#[derive(Clone, Copy)]
enum GradIn<'a> {
    /// The last stage: from its loss.
    Loss,
    /// The next stage's gradient, from the host.
    Host(&'a [f32]),
    /// The next stage's gradient, received on its device link.
    Received,
}

/// Where a parameter lives in the flat buffers.
struct Slot {
    name: String,
    dims: Vec<usize>,
    /// Its role in the model (which products get BF16 copies, which parameters AdamW decays).
    kind: ParamKind,
    offset: usize,
    len: usize,
}

/// A norm layer's output `(N, C)` and per-row statistics for one unit, and its parameters'
/// gradients between the two halves of a split backward.
struct NormActs {
    out: Buf<f32>,
    mean: Buf<f32>,
    rstd: Buf<f32>,
    /// `(2C)`: the weight's gradient, then the bias's, computed by the input half of a split
    /// backward (it overwrites the norm's input) and added to the accumulator by the weight half.
    grads: Buf<f32>,
}

/// Saved activations of one block for one unit (rows N = B·s). Between the two halves of a split
/// backward, four of them hold output gradients the weight half reads instead (their activations
/// are spent by then): `x` d(attention residual), `x1` the block's output gradient, `qkv` d(QKV),
/// `u` d(c_fc output) ([`block`]).
struct BlockActs {
    x: Buf<f32>, // (N, C) block input
    ln1: NormActs,
    qkv: Buf<f32>, // (N, 3C) this segment's QKV
    y: Buf<f32>,   // (N, C) attention output
    lse: Buf<f32>, // (B, H, s)
    x1: Buf<f32>,
    ln2: NormActs,
    u: Buf<f32>, // (N, F)
    g: Buf<f32>, // (N, F)
}

/// Saved activations of one unit.
struct UnitActs {
    blocks: Vec<BlockActs>,
    /// `(N, C)` the last block's output; on the first stage, between the two halves of a split
    /// backward, the embeddings' output gradient.
    out: Buf<f32>,
    // First stage.
    ids: Buf<u32>,
    host_ids: Vec<u32>,
    // Last stage.
    lnf: NormActs,
    dhead: Buf<f32>, // (N, C) d(lnf) computed with the loss
    targets: Buf<u32>,
    losses: Buf<f32>,
}

/// The K/V caches and saved units of one micro-batch (the model's [`InFlight`] keeps which
/// positions are cached and which units are pending).
struct MicroBatch {
    qkv: Vec<Buf<f32>>, // per held block: (B, T, 3C)
    dk: Vec<Buf<f32>>,  // per held block: (B, T, C)
    dv: Vec<Buf<f32>>,
    units: Vec<UnitActs>, // per segment
}

/// A micro-batch's document starts on the device, one per position of each row (uploaded by
/// [`GpuStage::set_documents`]), as the attention kernels take them.
fn doc_starts(docs: &model::stage::Documents<Buf<u32>>) -> DocStarts {
    DocStarts {
        ptr: docs.device.ptr(),
        len: docs.device.len(),
    }
}

/// The rows a unit covers: `b` sequences, positions `start..start + len` of each.
#[derive(Clone, Copy)]
struct UnitShape {
    b: usize,
    start: usize,
    len: usize,
}

/// Backward scratch shared by every unit (sized for the longest segment).
struct Scratch {
    dx: Buf<f32>,
    dtmp: Buf<f32>,
    dln: Buf<f32>,
    dqkv: Buf<f32>, // three (N, C) planes
    dff: Buf<f32>,
    delta: Buf<f32>,
    columns: Buf<f32>,
    logits: Buf<f32>, // (chunk, V)
}

/// Rows of the LM head's logits that exist at once (the logits of a whole batch never do).
pub const CHUNK_ROWS: usize = 4096;

/// The BF16 fast path pads the LM head's vocabulary to a multiple of this many rows (as llm.c
/// pads 50257 to 50304), unless [`GpuStage::set_vocab_padding`] says otherwise.
pub const VOCAB_PADDING: usize = 64;

/// BF16 copies of the weights of a stage's matrix products (BF16 mode, [`Bf16Path::CachedWeights`]):
/// derived from the FP32 master weights by [`GpuStage::refresh_bf16_weights`] after every change of
/// them, never part of the state. The LM head's copy has `head_rows` rows (the vocabulary padded;
/// the rows past the vocabulary are zero and stay so).
struct Bf16Weights {
    /// Every copy, one after another.
    words: Buf<u16>,
    /// `(slot, offset of its copy in words)` of each copied weight.
    copies: Vec<(usize, usize)>,
    /// The offset of each copied weight's copy, by name.
    at: HashMap<String, usize>,
    /// Rows of the LM head's copy and row width of its logits: the vocabulary padded.
    head_rows: usize,
    /// What the vocabulary was padded to a multiple of.
    padding: usize,
    /// Two BF16 activation operands of a product (each rounded per product), sized by
    /// `fix_batch`: the first for `dy` or the logits' gradient, the second for `x`.
    operands: Option<[Buf<u16>; 2]>,
}

impl Bf16Weights {
    /// Room for a copy of every linear weight of `slots` (not the embedding tables, which are
    /// gathered, not multiplied), the head's padded to a multiple of `padding` rows.
    fn new(gpu: &Gpu, slots: &[Slot], vocab: usize, padding: usize) -> Result<Bf16Weights> {
        if padding == 0 {
            return shape(
                "GpuStage::set_vocab_padding",
                "a padding to a multiple of 0",
            );
        }
        let head_rows = vocab.div_ceil(padding) * padding;
        let (mut copies, mut at, mut len) = (Vec::new(), HashMap::new(), 0);
        for (i, s) in slots.iter().enumerate() {
            // The weights of matrix products (not the embedding tables, which are gathered).
            if s.kind != ParamKind::Weight {
                continue;
            }
            copies.push((i, len));
            at.insert(s.name.clone(), len);
            len += if s.name == names::LM_HEAD {
                head_rows * s.dims[1]
            } else {
                s.len
            };
        }
        Ok(Bf16Weights {
            words: gpu.zeros(len.max(1))?,
            copies,
            at,
            head_rows,
            padding,
            operands: None,
        })
    }

    /// Device address of weight `name`'s BF16 copy.
    fn weight(&self, name: &str) -> Result<u64> {
        match self.at.get(name) {
            Some(&off) => Ok(self.words.at(off)),
            None => shape("GpuStage", format!("no BF16 copy of {name}")),
        }
    }

    /// The two activation operand buffers `(dy or x, x)`.
    fn operands(&self) -> Result<(u64, u64)> {
        match &self.operands {
            Some([a, b]) => Ok((a.ptr(), b.ptr())),
            None => Err(order("GpuStage", "a product before the first forward")),
        }
    }
}

/// A pipeline stage on one GPU.
pub struct GpuStage {
    gpu: Gpu,
    plan: StagePlan,
    /// The plan's segments (the positions of a micro-batch's units unless it has its own lengths:
    /// [`GpuStage::set_segment_lengths`]).
    segments: Segments,
    /// Positions each segment's unit buffers hold: the plan's lengths, or its longest segment for
    /// every unit when micro-batches may have their own.
    unit_rows: Vec<usize>,
    seq: usize,
    slots: Arc<[Slot]>,
    index: HashMap<String, usize>,
    numel: usize,
    values: Buf<f32>,
    m: Buf<f32>,
    v: Buf<f32>,
    adam_step: u64,
    /// Pinned host buffers of state downloads.
    staging: Arc<StagingPool>,
    /// The newest state download still in flight: wait for it before writing values, m or v.
    copy_fence: Option<Fence>,
    /// Rows per micro-batch, fixed by the first forward (every buffer is sized from it).
    batch: Option<usize>,
    scratch: Option<Scratch>,
    /// The micro-batches in flight and their document starts ([`GpuStage::set_documents`]).
    in_flight: InFlight<MicroBatch, Buf<u32>>,
    spare_micro_batches: Vec<MicroBatch>,
    spare_grads: Vec<Buf<f32>>,
    /// The step's gradients, one flat buffer per micro-batch (the model's bookkeeping).
    grads: StepGradients<Buf<f32>>,
    peak: ActivationPeak,
    /// Device links to the neighbouring stages and their boundary tensors.
    links: Links,
    /// BF16 copies of the weights, in BF16 mode with [`Bf16Path::CachedWeights`].
    bf16: Option<Bf16Weights>,
    /// Positions restart at each document ([`GpuStage::set_reset_positions`]).
    reset_positions: bool,
}

// SAFETY: a `Gpu` holds a raw cuBLAS handle, which makes it `!Send`. The stage owns its `Gpu`
// outright, is driven by one thread at a time (`&mut self` or `&self`, never shared: not `Sync`),
// and makes the context current on the calling thread at the start of every method that touches the
// device ([`Gpu::bind`]); cuBLAS handles may be used from any thread that does not use them
// concurrently.
unsafe impl Send for GpuStage {}

impl Drop for GpuStage {
    fn drop(&mut self) {
        // The buffers are freed after this, on whichever thread drops the stage: the context must
        // be current there, and a state download still reading them must come first.
        if self.await_downloads().is_err() {
            // The compute stream could not be ordered after the copy: wait for it on the host.
            let _ = self.gpu.drain_copies();
        }
        let _ = self.gpu.bind();
    }
}

/// The state after an update on its way to the host ([`GpuStage::begin_state_download`]); resolve
/// it, on any thread, with [`PendingState::wait`].
pub struct PendingState {
    download: Download,
    slots: Arc<[Slot]>,
}

impl PendingState {
    /// Waits for the copy and returns the state as [`GpuStage::state`] does.
    pub fn wait(self) -> Result<Vec<NamedTensor>> {
        let mut flat = self.download.wait()?.into_iter();
        let values = flat.next().unwrap_or_default();
        let mut out = split(&self.slots, &values, "");
        if let (Some(m), Some(v)) = (flat.next(), flat.next()) {
            let m = split(&self.slots, &m, "optim.m.");
            let v = split(&self.slots, &v, "optim.v.");
            for (m, v) in m.into_iter().zip(v) {
                out.push(m);
                out.push(v);
            }
        }
        Ok(out)
    }
}

/// The parameters laid out flat in their given (canonical) order.
struct Flat {
    slots: Vec<Slot>,
    /// The slot of each name.
    index: HashMap<String, usize>,
    values: Vec<f32>,
}

/// `params` laid out flat; each must be one of `specs` (the stage's parameters in the model) with
/// its shape, and every spec must be given.
fn flatten(params: Vec<StageParam>, specs: &[ParamSpec]) -> Result<Flat> {
    const OP: &str = "GpuStage::new";
    let by_name: HashMap<&str, &ParamSpec> = specs.iter().map(|s| (s.name.as_str(), s)).collect();
    let mut slots = Vec::new();
    let mut index = HashMap::new();
    let mut host = Vec::new();
    for p in params {
        let Some(spec) = by_name.get(p.name.as_str()) else {
            return shape(
                OP,
                format!("parameter {} is not one of this stage's", p.name),
            );
        };
        if p.dims != spec.shape {
            return shape(
                OP,
                format!(
                    "parameter {} has dims {:?}, the model needs {:?}",
                    p.name, p.dims, spec.shape
                ),
            );
        }
        let len: usize = p.dims.iter().product();
        if p.values.len() != len {
            return shape(
                OP,
                format!(
                    "{}: {} values for dims {:?}",
                    p.name,
                    p.values.len(),
                    p.dims
                ),
            );
        }
        index.insert(p.name.clone(), slots.len());
        slots.push(Slot {
            name: p.name,
            dims: p.dims,
            kind: spec.kind,
            offset: host.len(),
            len,
        });
        host.extend(p.values);
    }
    if let Some(missing) = specs.iter().find(|s| !index.contains_key(&s.name)) {
        return shape(OP, format!("parameter {} is missing", missing.name));
    }
    Ok(Flat {
        slots,
        index,
        values: host,
    })
}

/// The parameters `plan`'s stage holds, in canonical order: the model's own list for its
/// components.
fn stage_specs(plan: &StagePlan) -> Vec<ParamSpec> {
    plan.layout
        .components()
        .into_iter()
        .flat_map(|c| component_params(&plan.model, c))
        .collect()
}

/// `host` (flat, canonical order) cut into named tensors, each name prefixed with `prefix`.
fn split(slots: &[Slot], host: &[f32], prefix: &str) -> Vec<NamedTensor> {
    slots
        .iter()
        .map(|s| {
            (
                format!("{prefix}{}", s.name),
                s.dims.clone(),
                host[s.offset..s.offset + s.len].to_vec(),
            )
        })
        .collect()
}

fn order(op: &'static str, reason: impl Into<String>) -> GpuError {
    GpuError::Shape {
        op,
        reason: reason.into(),
    }
}

impl GpuStage {
    /// Uploads `params` (every parameter the plan's layers need, in canonical order) onto `gpu`.
    pub fn new(gpu: Gpu, plan: StagePlan, params: Vec<StageParam>) -> Result<GpuStage> {
        const OP: &str = "GpuStage::new";
        gpu.bind()?;
        if plan.model.position != Position::Learned {
            return shape(
                OP,
                "CUDA stages support learned positions only (model.position = \"learned\")",
            );
        }
        let (c, h) = (plan.model.d_model, plan.model.heads);
        if h == 0 || !c.is_multiple_of(h) {
            return shape(OP, format!("d_model {c} is not a multiple of heads {h}"));
        }
        if !crate::compile::HEAD_DIMS.contains(&(c / h)) {
            return shape(
                OP,
                format!(
                    "head width {} has no attention kernel (have {:?})",
                    c / h,
                    crate::compile::HEAD_DIMS
                ),
            );
        }
        let seq: usize = plan.segments.iter().sum();
        if plan.segments.is_empty() || plan.segments.contains(&0) || seq > plan.model.max_seq_len {
            return shape(
                OP,
                format!(
                    "segments {:?} do not cut a sequence of at most {} positions",
                    plan.segments, plan.model.max_seq_len
                ),
            );
        }
        let widest = plan.segments.iter().copied().max().unwrap_or(0);
        let unit_rows = match plan.longest_segment {
            None => plan.segments.clone(),
            Some(l) if (widest..=seq).contains(&l) => vec![l; plan.segments.len()],
            Some(l) => {
                return shape(
                    OP,
                    format!(
                        "a longest segment of {l} positions for segments {:?} (it must be at \
                         least their longest, {widest}, and at most the sequence, {seq})",
                        plan.segments
                    ),
                );
            }
        };
        let Flat {
            slots,
            index,
            values: host,
        } = flatten(params, &stage_specs(&plan))?;
        let numel = host.len();
        let stage = GpuStage {
            values: gpu.upload(&host)?,
            m: gpu.zeros(numel)?,
            v: gpu.zeros(numel)?,
            gpu,
            segments: Segments::new(plan.segments.clone()),
            unit_rows,
            seq,
            slots: slots.into(),
            index,
            numel,
            staging: Arc::default(),
            copy_fence: None,
            adam_step: 0,
            batch: None,
            scratch: None,
            in_flight: InFlight::default(),
            spare_micro_batches: Vec::new(),
            spare_grads: Vec::new(),
            grads: StepGradients::default(),
            peak: ActivationPeak::default(),
            links: Links::default(),
            bf16: None,
            reset_positions: false,
            plan,
        };
        let mut stage = stage;
        if stage.gpu.bf16_weight_copies() {
            stage.set_bf16_weights(VOCAB_PADDING)?;
        }
        Ok(stage)
    }

    /// Builds the BF16 weight copies with the head's vocabulary padded to a multiple of `padding`
    /// and fills them from the master weights.
    fn set_bf16_weights(&mut self, padding: usize) -> Result<()> {
        let vocab = self.plan.model.vocab_size;
        self.bf16 = Some(Bf16Weights::new(&self.gpu, &self.slots, vocab, padding)?);
        self.refresh_bf16_weights()
    }

    /// Rewrites the BF16 weight copies (if any) from the FP32 master weights: after every change
    /// of them. The head copy's padded rows are never written (zero since allocation).
    fn refresh_bf16_weights(&self) -> Result<()> {
        let Some(w16) = &self.bf16 else {
            return Ok(());
        };
        let _scope = self.gpu.profile_scope(WEIGHT_REFRESH);
        for &(slot, off) in &w16.copies {
            let s = &self.slots[slot];
            self.gpu
                .to_bf16(w16.words.at(off), self.values.at(s.offset), s.len)?;
        }
        Ok(())
    }

    /// Pads the LM head's vocabulary (BF16 fast path only) to a multiple of `multiple` instead of
    /// [`VOCAB_PADDING`]; 1 means no padding. Before the first forward (the logits buffers are
    /// sized by it).
    pub fn set_vocab_padding(&mut self, multiple: usize) -> Result<()> {
        const OP: &str = "GpuStage::set_vocab_padding";
        if multiple == 0 {
            return shape(OP, "a padding to a multiple of 0 (1 means no padding)");
        }
        if self.batch.is_some() {
            return Err(order(
                OP,
                "the vocabulary's padding is set before the first forward",
            ));
        }
        self.gpu.bind()?;
        if self.bf16.is_some() {
            self.set_bf16_weights(multiple)?;
        }
        Ok(())
    }

    /// Row width of the LM head's logits: the vocabulary, padded on the BF16 fast path.
    pub fn head_rows(&self) -> usize {
        self.bf16
            .as_ref()
            .map_or(self.plan.model.vocab_size, |w| w.head_rows)
    }

    /// Which way the stage's products run: `fp32`/`tf32`, or BF16 mode's [`Bf16Path`] (with the
    /// padding of the head's vocabulary on the fast path).
    pub fn products(&self) -> String {
        match (&self.bf16, self.gpu.precision()) {
            (Some(w), _) => format!(
                "bf16 {} (vocabulary padded to a multiple of {})",
                Bf16Path::CachedWeights.name(),
                w.padding
            ),
            (None, crate::Precision::Bf16) => format!("bf16 {}", self.gpu.bf16_path().name()),
            (None, p) => p.name().to_string(),
        }
    }

    /// Bytes of the BF16 weight copies (0 off the BF16 fast path).
    pub fn bf16_weight_bytes(&self) -> usize {
        self.bf16.as_ref().map_or(0, |w| 2 * w.words.len())
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The parameters' names, in canonical order.
    pub fn param_names(&self) -> Vec<String> {
        self.slots.iter().map(|s| s.name.clone()).collect()
    }

    /// Parameter values held (the length of [`GpuStage::gradient_vector`]).
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Bytes of the training state: parameters, one gradient buffer, two moments, and the BF16
    /// weight copies of the fast path.
    pub fn state_bytes(&self) -> usize {
        4 * 4 * self.numel + self.bf16_weight_bytes()
    }

    /// Address of parameter `name` in `buf` (values, or a gradient buffer); 0 when the stage has
    /// no such parameter (the norm biases of an RMS-norm model).
    fn at(&self, buf: &Buf<f32>, name: &str) -> u64 {
        self.index
            .get(name)
            .map_or(0, |&i| buf.at(self.slots[i].offset))
    }

    /// Address of parameter `name`'s gradient in the flat gradient buffer at `acc`; 0 when the
    /// stage has no such parameter.
    fn grad_at(&self, acc: u64, name: &str) -> u64 {
        self.index
            .get(name)
            .map_or(0, |&i| acc + (self.slots[i].offset * 4) as u64)
    }

    /// Linear layer `name` (`h.3.mlp.c_fc`): `y (n, out) = x (n, in) W^T`, plus its bias when
    /// `bias`.
    fn linear_forward(
        &self,
        y: u64,
        x: u64,
        name: &str,
        (n, d_in, d_out): (usize, usize, usize),
        bias: bool,
    ) -> Result<()> {
        let b = if bias {
            self.at(&self.values, &format!("{name}.bias"))
        } else {
            0
        };
        self.gpu.label_products(name, Pass::Fwd);
        let Some(w16) = &self.bf16 else {
            let w = self.at(&self.values, &format!("{name}.weight"));
            return self.gpu.linear_forward(y, x, w, b, n, d_in, d_out);
        };
        let (_, x16) = w16.operands()?;
        let w = w16.weight(&format!("{name}.weight"))?;
        self.gpu.to_bf16(x16, x, n * d_in)?;
        let lds = (d_in, d_in);
        self.gpu
            .gemm_bf16(y, x16, w, (n, d_out, d_in), (false, true), lds, 0.0)?;
        if b != 0 {
            self.gpu.add_bias(y, b, n, d_out)?;
        }
        Ok(())
    }

    /// The input half of [`GpuStage::linear_forward`]'s backward: `dx = dy W` (`dx` 0: none). On
    /// the BF16 fast path `dy` is rounded into the first operand buffer, where the weight half
    /// finds it when it follows at once ([`GpuStage::linear_backward_weight`]).
    fn linear_backward_input(
        &self,
        dx: u64,
        dy: u64,
        name: &str,
        (n, d_in, d_out): (usize, usize, usize),
    ) -> Result<()> {
        let weight = format!("{name}.weight");
        self.gpu.label_products(name, Pass::Dx);
        let Some(w16) = &self.bf16 else {
            let w = self.at(&self.values, &weight);
            return self.gpu.linear_backward_input(dx, dy, w, (n, d_in, d_out));
        };
        let (dy16, _) = w16.operands()?;
        self.gpu.to_bf16(dy16, dy, n * d_out)?;
        if dx != 0 {
            let w = w16.weight(&weight)?;
            let lds = (d_out, d_in);
            self.gpu
                .gemm_bf16(dx, dy16, w, (n, d_in, d_out), (false, false), lds, 0.0)?;
        }
        Ok(())
    }

    /// The weight half of [`GpuStage::linear_forward`]'s backward: `dW += dy^T x` (and with
    /// `bias` the bias's gradient) added to the gradient buffer at `acc`; `sc` is column-sum
    /// scratch. `rounded`: the input half ran just before with this `dy`, so on the BF16 fast path
    /// its rounding is still in the first operand buffer; otherwise it is rounded again (the
    /// same bits).
    #[allow(clippy::too_many_arguments)]
    fn linear_backward_weight(
        &self,
        dy: u64,
        x: u64,
        name: &str,
        (n, d_in, d_out): (usize, usize, usize),
        bias: bool,
        (acc, sc): (u64, &Buf<f32>),
        rounded: bool,
    ) -> Result<()> {
        let weight = format!("{name}.weight");
        let db = if bias {
            self.grad_at(acc, &format!("{name}.bias"))
        } else {
            0
        };
        let dw = self.grad_at(acc, &weight);
        self.gpu.label_products(name, Pass::Dw);
        let Some(w16) = &self.bf16 else {
            return self
                .gpu
                .linear_backward_weight((dw, db), dy, x, (n, d_in, d_out), sc);
        };
        let gpu = &self.gpu;
        let (dy16, x16) = w16.operands()?;
        if !rounded {
            gpu.to_bf16(dy16, dy, n * d_out)?;
        }
        gpu.to_bf16(x16, x, n * d_in)?;
        let lds = (d_out, d_in);
        gpu.gemm_bf16(dw, dy16, x16, (d_out, d_in, n), (true, false), lds, 1.0)?;
        if db != 0 {
            gpu.column_sum(db, dy, n, d_out, true, sc)?;
        }
        Ok(())
    }

    /// The attention of a segment `start..start + len` of `b` sequences: queries in the unit's
    /// `(N, 3C)` QKV rows, keys and values in the micro-batch's cache of whole sequences.
    fn attn_shape(&self, b: usize, start: usize, len: usize) -> AttnShape {
        let (c, h) = (self.plan.model.d_model, self.plan.model.heads);
        AttnShape {
            b,
            h,
            d: c / h,
            s: len,
            p: start,
            q_stride: 3 * c,
            kv_stride: 3 * c,
            kv_rows: self.seq,
        }
    }

    /// `1 / sqrt(head width)`.
    fn attn_scale(&self) -> f32 {
        let m = &self.plan.model;
        1.0 / ((m.d_model / m.heads) as f32).sqrt()
    }

    /// Buffers of a norm layer over `rows` rows (`grads`: room for its parameters' gradients).
    fn norm_acts(&self, rows: usize, grads: bool) -> Result<NormActs> {
        let c = self.plan.model.d_model;
        Ok(NormActs {
            out: self.gpu.zeros(rows * c)?,
            mean: self.gpu.zeros(rows)?,
            rstd: self.gpu.zeros(rows)?,
            grads: self.gpu.zeros(if grads { 2 * c } else { 1 })?,
        })
    }

    /// Norm layer `name` (`h.3.ln_1`, `ln_f`) over `n` rows of `x` into `acts`.
    fn norm_forward(&self, acts: &NormActs, x: u64, name: &str, n: usize) -> Result<()> {
        let params = (
            self.at(&self.values, &format!("{name}.weight")),
            self.at(&self.values, &format!("{name}.bias")),
        );
        let saved = self.norm_saved(acts, x, n);
        let eps = self.plan.model.norm_eps as f32;
        self.gpu.norm_forward(acts.out.ptr(), params, &saved, eps)
    }

    /// The norm's input `x` over `n` rows with the statistics in `acts`.
    fn norm_saved(&self, acts: &NormActs, x: u64, n: usize) -> NormSaved {
        let m = &self.plan.model;
        NormSaved {
            x,
            mean: acts.mean.ptr(),
            rstd: acts.rstd.ptr(),
            n,
            c: m.d_model,
            rms: m.norm == Norm::RmsNorm,
        }
    }

    /// The input half of [`GpuStage::norm_forward`]'s backward: `dx` = d(input) from `dy` over
    /// `n` rows; then its parameters' gradients from the same rows ([`NormGrads`] says where they
    /// go), since they reduce over the norm's input, which a split backward's input half
    /// overwrites later; `sc` is column-sum scratch.
    #[allow(clippy::too_many_arguments)]
    fn norm_backward_input(
        &self,
        dx: u64,
        dy: u64,
        x: u64,
        acts: &NormActs,
        name: &str,
        (n, sc): (usize, &Buf<f32>),
        to: NormGrads,
    ) -> Result<()> {
        let c = self.plan.model.d_model;
        let saved = self.norm_saved(acts, x, n);
        let weight = format!("{name}.weight");
        let w = self.at(&self.values, &weight);
        let gpu = &self.gpu;
        gpu.norm_backward_input(dx, dy, w, &saved)?;
        let (grads, accumulate) = match to {
            NormGrads::Accumulate(acc) => {
                let bias = self.grad_at(acc, &format!("{name}.bias"));
                ((self.grad_at(acc, &weight), bias), true)
            }
            NormGrads::Keep => ((acts.grads.ptr(), acts.grads.at(c)), false),
        };
        gpu.norm_backward_params(grads, dy, &saved, (sc, accumulate))
    }

    /// The weight half of a split backward's norm `name`: the parameter gradients its input half
    /// kept in `acts` ([`NormGrads::Keep`]) are added to the gradient buffer at `acc` — the
    /// addition [`NormGrads::Accumulate`] makes in a whole backward, so the sums are the same.
    fn norm_backward_weight(&self, acts: &NormActs, name: &str, acc: u64) -> Result<()> {
        let c = self.plan.model.d_model;
        let _scope = self.gpu.profile_scope(LAYERNORM_BWD);
        for (i, part) in ["weight", "bias"].into_iter().enumerate() {
            let dst = self.grad_at(acc, &format!("{name}.{part}"));
            if dst != 0 {
                self.gpu.add_assign(dst, acts.grads.at(i * c), c)?;
            }
        }
        Ok(())
    }

    /// Starts a step of `micro_batches` micro-batches: forgets the last step's gradients.
    pub fn begin_step(&mut self, micro_batches: usize) {
        // Buffers freed or kept below need the context current on this thread.
        let _ = self.gpu.bind();
        let released = self.grads.begin(micro_batches);
        self.spare_grads.extend(released);
    }

    fn clear_grads(&mut self) {
        // Buffers freed below need the context current on this thread.
        let _ = self.gpu.bind();
        let released = self.grads.clear();
        self.spare_grads.extend(released);
    }

    /// Masks micro-batch `micro_batch`'s attention to each query's own document: `mask` holds
    /// its rows' document starts (absolute positions). Must come before the micro-batch's first
    /// forward; the same starts again are accepted, other starts for a micro-batch under way are
    /// refused. Kept until the micro-batch's backward (or evaluation) is done.
    pub fn set_documents(&mut self, micro_batch: usize, mask: ops::DocumentMask) -> Result<()> {
        const OP: &str = "GpuStage::set_documents";
        if let Some(b) = self.batch.filter(|&b| b != mask.batch()) {
            return shape(
                OP,
                format!(
                    "{} rows of document starts for micro-batches of {b} rows",
                    mask.batch()
                ),
            );
        }
        if self.seq > i32::MAX as usize {
            return shape(
                OP,
                format!("{} positions do not fit the kernels' ints", self.seq),
            );
        }
        self.gpu.bind()?;
        let (gpu, seq) = (&self.gpu, self.seq);
        self.in_flight.set_documents(micro_batch, mask, |mask| {
            gpu.upload(&position_doc_starts(mask, seq))
        })
    }

    /// Cuts micro-batch `micro_batch` into segments of `lengths` instead of the plan's (the
    /// document partition). Must come before the micro-batch's first forward; the same lengths
    /// again are accepted, other lengths for a micro-batch under way are refused, as are lengths
    /// that do not cut the sequence into the plan's number of non-empty segments (the model's
    /// rules, [`InFlight::set_segment_lengths`]) and any segment longer than its unit's buffers
    /// hold ([`StagePlan::longest_segment`]).
    pub fn set_segment_lengths(&mut self, micro_batch: usize, lengths: Vec<usize>) -> Result<()> {
        const OP: &str = "GpuStage::set_segment_lengths";
        if let Some((j, (&len, &room))) = lengths
            .iter()
            .zip(&self.unit_rows)
            .enumerate()
            .find(|(_, (len, room))| len > room)
        {
            return shape(
                OP,
                format!(
                    "micro-batch {micro_batch}: segment {j} of {lengths:?} has {len} positions, its \
                     unit's buffers hold {room} (the stage plan's longest segment: {})",
                    match self.plan.longest_segment {
                        Some(l) => format!("{l}"),
                        None => "none, every micro-batch is cut as the plan's table".into(),
                    }
                ),
            );
        }
        Ok(self
            .in_flight
            .set_segment_lengths(micro_batch, lengths, &self.segments)?)
    }

    /// Positions restart at 0 at each document start (`data.reset_positions`): the position
    /// embedding of position `pos` is that of `pos − doc_start(pos)`, forward and gradient (the
    /// CPU stage's rule). Every micro-batch then needs its document starts
    /// ([`GpuStage::set_documents`]) before its first forward; a forward without them is refused.
    /// Not while a micro-batch is in flight.
    pub fn set_reset_positions(&mut self, reset: bool) -> Result<()> {
        if reset != self.reset_positions && !self.in_flight.is_empty() {
            return Err(order(
                "GpuStage::set_reset_positions",
                "positions cannot start or stop restarting while micro-batches are in flight",
            ));
        }
        self.reset_positions = reset;
        Ok(())
    }

    /// With positions restarting at each document, on the first stage: one past the largest
    /// position id of the positions `start..start + len` of the rows of `docs` (`None`
    /// otherwise, or without starts: the unit refuses to embed then).
    fn position_ids(
        &self,
        docs: Option<&model::stage::Documents<Buf<u32>>>,
        (b, start, len): (usize, usize, usize),
    ) -> Option<usize> {
        if !self.reset_positions || !self.plan.layout.is_first() {
            return None;
        }
        Some(docs.map_or(1, |d| {
            let ids = model::documents::position_ids(Some(&d.mask), b, start, len, true);
            ids.into_iter().max().map_or(0, |q| q as usize + 1)
        }))
    }

    /// Drops every in-flight unit and gradient (an aborted step).
    pub fn reset_step(&mut self) {
        for mb in self.in_flight.clear() {
            self.recycle(mb);
        }
        self.clear_grads();
    }

    /// Keeps a micro-batch's buffers for the next one, forgetting what they held.
    fn recycle(&mut self, mb: MicroBatch) {
        self.spare_micro_batches.push(mb);
    }

    /// The accumulator of `unit`'s micro-batch (created zeroed on first use in a step); the
    /// model's bookkeeping refuses units out of order.
    fn accumulator(&mut self, unit: Unit) -> Result<u64> {
        let (gpu, numel, spare) = (&self.gpu, self.numel, &mut self.spare_grads);
        let fresh = || match spare.pop() {
            Some(mut b) => {
                gpu.clear(&mut b)?;
                Ok(b)
            }
            None => gpu.zeros(numel),
        };
        Ok(self.grads.accumulator(unit, fresh)?.ptr())
    }

    /// `unit`'s micro-batch's backward is complete: its gradient joins the tree.
    fn complete(&mut self, unit: Unit) -> Result<()> {
        let (gpu, numel, spare) = (&self.gpu, self.numel, &mut self.spare_grads);
        let mut add = |left: Buf<f32>, right: Buf<f32>| -> Result<Buf<f32>> {
            let _scope = gpu.profile_scope(GRAD_ACCUMULATION);
            gpu.add_assign(left.ptr(), right.ptr(), numel)?;
            spare.push(right);
            Ok(left)
        };
        self.grads.complete(unit, &mut add)
    }

    /// Sums the step's gradients in the tree (idempotent).
    pub fn finish_gradients(&mut self) -> Result<()> {
        Ok(self.grads.finish()?)
    }

    fn total(&self) -> Result<&Buf<f32>> {
        Ok(self
            .grads
            .total()
            .ok_or(model::ModelError::GradientsNotFinished)?)
    }

    /// The step's summed gradients, flat in canonical order.
    pub fn gradient_vector(&self) -> Result<Vec<f32>> {
        self.gpu.bind()?;
        let total = self.total()?;
        self.gpu.download(total)
    }

    /// Replaces the step's summed gradients (after the data-parallel reduction).
    pub fn set_gradient_vector(&mut self, v: &[f32]) -> Result<()> {
        const OP: &str = "GpuStage::set_gradient_vector";
        self.gpu.bind()?;
        if v.len() != self.numel {
            return shape(
                OP,
                format!("{} values for {} parameters", v.len(), self.numel),
            );
        }
        let total = self.grads.total_mut()?;
        self.gpu.write(total, v)
    }

    /// Per-parameter sums of squares of the summed gradients, in canonical order.
    pub fn grad_sums_of_squares(&mut self) -> Result<Vec<(String, f64)>> {
        self.gpu.bind()?;
        self.finish_gradients()?;
        let total = self.total()?;
        let list: Vec<(u64, usize)> = self
            .slots
            .iter()
            .map(|s| (total.at(s.offset), s.len))
            .collect();
        let sums = self.gpu.sums_of_squares(&list)?;
        Ok(self.param_names().into_iter().zip(sums).collect())
    }

    /// Scales the gradients by `clip` (at most 1), applies AdamW (`lr`, the model's decay rule
    /// `decay` for each parameter's kind, `betas = (beta1, beta2, eps)`) and clears the gradients.
    pub fn apply_update(
        &mut self,
        lr: f64,
        clip: f64,
        decay: WeightDecay,
        (b1, b2, eps): (f64, f64, f64),
    ) -> Result<()> {
        self.gpu.bind()?;
        self.finish_gradients()?;
        self.await_downloads()?;
        self.adam_step += 1;
        let t = self.adam_step as f64;
        let inv_bc2 = 1.0 / (1.0 - b2.powf(t));
        let lr_bc1 = lr / (1.0 - b1.powf(t));
        let total = self.total()?;
        for s in self.slots.iter() {
            let wd = decay.rate_of(s.kind);
            self.gpu.adamw(
                self.values.at(s.offset),
                self.m.at(s.offset),
                self.v.at(s.offset),
                total.at(s.offset),
                s.len,
                clip.min(1.0) as f32,
                (b1, b2, eps),
                (inv_bc2 as f32, lr_bc1 as f32, (1.0 - lr * wd) as f32),
            )?;
        }
        self.refresh_bf16_weights()?;
        self.clear_grads();
        Ok(())
    }

    /// Host copies `(name, dims, values)` of the parameters, then (once the optimizer has
    /// stepped) of the moments as `optim.m.<name>` and `optim.v.<name>` in the same order.
    pub fn state(&self) -> Result<Vec<NamedTensor>> {
        // Waited for before returning, so nothing is left for the next update to wait for.
        self.download_state()
            .and_then(|(pending, _)| pending.wait())
    }

    /// Starts copying the state (as [`GpuStage::state`] returns it) to the host behind the queued
    /// compute and returns without waiting: the step goes on while the copy runs, and the next
    /// update or restore waits for it on the device.
    pub fn begin_state_download(&mut self) -> Result<PendingState> {
        let (pending, fence) = self.download_state()?;
        self.copy_fence = Some(fence);
        Ok(pending)
    }

    fn download_state(&self) -> Result<(PendingState, Fence)> {
        let mut sources = vec![&self.values];
        if self.adam_step > 0 {
            sources.extend([&self.m, &self.v]);
        }
        let (download, fence) = self.gpu.begin_download(&sources, &self.staging)?;
        let pending = PendingState {
            download,
            slots: Arc::clone(&self.slots),
        };
        Ok((pending, fence))
    }

    /// Orders the compute after every state download queued so far (before writing the state).
    /// The fence is kept when the wait cannot be queued, so a later write (or the drop) tries again.
    fn await_downloads(&mut self) -> Result<()> {
        if let Some(fence) = &self.copy_fence {
            self.gpu.wait_for(fence)?;
        }
        self.copy_fence = None;
        Ok(())
    }

    /// The step's summed gradients by parameter `(name, dims, values)`.
    pub fn gradients(&self) -> Result<Vec<NamedTensor>> {
        Ok(split(&self.slots, &self.gradient_vector()?, ""))
    }

    /// Replaces the state: the parameters' `values` and, when the optimizer has taken
    /// `optimizer_step > 0` steps, AdamW's `moments` (m, v), each flat in canonical order
    /// ([`GpuStage::gradient_vector`]'s layout; no moments: zeros). Drops any step in flight.
    pub fn load_state(
        &mut self,
        values: &[f32],
        moments: Option<(&[f32], &[f32])>,
        optimizer_step: u64,
    ) -> Result<()> {
        const OP: &str = "GpuStage::load_state";
        self.gpu.bind()?;
        let lens = [
            Some(values.len()),
            moments.map(|m| m.0.len()),
            moments.map(|m| m.1.len()),
        ];
        if let Some(bad) = lens.into_iter().flatten().find(|&l| l != self.numel) {
            return shape(OP, format!("{bad} values for {} parameters", self.numel));
        }
        self.reset_step();
        self.await_downloads()?;
        self.gpu.write(&mut self.values, values)?;
        match moments {
            Some((m, v)) => {
                self.gpu.write(&mut self.m, m)?;
                self.gpu.write(&mut self.v, v)?;
            }
            None => {
                self.gpu.clear(&mut self.m)?;
                self.gpu.clear(&mut self.v)?;
            }
        }
        self.adam_step = optimizer_step;
        self.refresh_bf16_weights()
    }

    /// The most bytes of live activations since the last call.
    pub fn take_peak_activation_bytes(&mut self) -> usize {
        let now = self.activation_bytes();
        self.peak.take(now)
    }

    /// The most full-gradient buffers held at once since the last call.
    pub fn take_peak_gradient_buffers(&mut self) -> usize {
        self.grads.take_peak_buffers()
    }

    /// Bytes of one micro-batch's caches and saved units (what [`GpuStage::new_micro_batch`]
    /// allocates).
    fn micro_batch_bytes(&self) -> usize {
        let Some(b) = self.batch else { return 0 };
        let (c, f, h) = (
            self.plan.model.d_model,
            self.plan.model.ffn(),
            self.plan.model.heads,
        );
        let layers = self.plan.layout.layers.len();
        // Rows of the whole sequences (the caches) and of the units' buffers.
        let (cached, n) = (b * self.seq, b * self.unit_rows.iter().sum::<usize>());
        // Per held block: the QKV cache and dK/dV (5C a position), the saved activations (x, ln1,
        // y, x1, ln2: C each; qkv 3C; u, g: F each; four norm statistics), the log-sum-exps, and
        // the two norms' parameter gradients between a split backward's halves (2C each).
        let blocks = layers * (cached * 5 * c + n * (8 * c + 2 * f + 4 + h) + 4 * c);
        let first = if self.plan.layout.is_first() { n } else { 0 };
        let last = if self.plan.layout.is_last() {
            n * (2 * c + 4) + 2 * c
        } else {
            0
        };
        4 * (blocks + n * c + first + last)
    }

    /// Bytes of the activations held now (in-flight micro-batches, and the boundary tensors of
    /// device links).
    pub fn activation_bytes(&self) -> usize {
        self.in_flight.len() * self.micro_batch_bytes() + self.links.bytes()
    }

    /// Sizes every buffer for micro-batches of `b` rows (once).
    fn fix_batch(&mut self, b: usize, op: &'static str) -> Result<()> {
        match self.batch {
            Some(have) if have == b => return Ok(()),
            Some(have) => {
                return shape(
                    op,
                    format!("micro-batches of {b} rows, the stage runs {have}"),
                );
            }
            None => {}
        }
        if b == 0 {
            return shape(op, "a micro-batch of no rows");
        }
        let m = &self.plan.model;
        let (c, f, h, v) = (m.d_model, m.ffn(), m.heads, m.vocab_size);
        let longest = self.unit_rows.iter().copied().max().unwrap_or(0);
        let n = b * longest;
        let chunk = CHUNK_ROWS.min(n);
        let widest = f.max(3 * c).max(v);
        let head = self.head_rows();
        if self.bf16.is_some() {
            // dy (or the logits' gradient: the head's only on the last stage; c_attn's three
            // planes at once) and x of one product.
            let (dy, x) = (n * f.max(3 * c), n * f.max(c));
            let logits = if self.plan.layout.is_last() {
                chunk * head
            } else {
                0
            };
            let operands = [self.gpu.zeros(dy.max(logits))?, self.gpu.zeros(x)?];
            if let Some(w16) = self.bf16.as_mut() {
                w16.operands = Some(operands);
            }
        }
        let z = |len: usize| self.gpu.zeros::<f32>(len);
        self.scratch = Some(Scratch {
            dx: z(n * c)?,
            dtmp: z(n * c)?,
            dln: z(n * c)?,
            dqkv: z(3 * n * c)?,
            dff: z(n * f)?,
            delta: z(b * h * longest)?,
            columns: z(2 * Gpu::column_scratch_len(n.max(chunk), widest))?,
            logits: if self.plan.layout.is_last() {
                z(chunk * head)?
            } else {
                z(1)?
            },
        });
        self.batch = Some(b);
        Ok(())
    }

    fn new_micro_batch(&self) -> Result<MicroBatch> {
        let b = self.batch.expect("fixed before");
        let m = &self.plan.model;
        let (c, f, h) = (m.d_model, m.ffn(), m.heads);
        let z = |len: usize| self.gpu.zeros::<f32>(len);
        let layers = self.plan.layout.layers.len();
        let mut units = Vec::new();
        for &s in &self.unit_rows {
            let n = b * s;
            let mut blocks = Vec::new();
            for _ in 0..layers {
                blocks.push(BlockActs {
                    x: z(n * c)?,
                    ln1: self.norm_acts(n, true)?,
                    qkv: z(n * 3 * c)?,
                    y: z(n * c)?,
                    lse: z(b * h * s)?,
                    x1: z(n * c)?,
                    ln2: self.norm_acts(n, true)?,
                    u: z(n * f)?,
                    g: z(n * f)?,
                });
            }
            let last = self.plan.layout.is_last();
            let rows = |k: usize| if last { k } else { 1 };
            units.push(UnitActs {
                blocks,
                out: z(n * c)?,
                ids: self
                    .gpu
                    .zeros(if self.plan.layout.is_first() { n } else { 1 })?,
                host_ids: Vec::new(),
                lnf: self.norm_acts(rows(n), last)?,
                dhead: z(rows(n * c))?,
                targets: self.gpu.zeros(rows(n))?,
                losses: z(rows(n))?,
            });
        }
        let t = self.seq;
        let mut mb = MicroBatch {
            qkv: Vec::new(),
            dk: Vec::new(),
            dv: Vec::new(),
            units,
        };
        for _ in 0..layers {
            mb.qkv.push(z(b * t * 3 * c)?);
            mb.dk.push(z(b * t * c)?);
            mb.dv.push(z(b * t * c)?);
        }
        Ok(mb)
    }

    /// Forward of unit `(micro_batch, segment)`. On the last stage `targets` (`B·s` ids) are
    /// required; in training mode the loss gradient (scaled by `loss_scale`) is computed with the
    /// loss and the head's weight gradient accumulated. `train = false` (evaluation) keeps only
    /// the K/V caches, until the micro-batch's last segment.
    pub fn forward(
        &mut self,
        (micro_batch, segment): (usize, usize),
        input: UnitInput,
        targets: Option<&[u32]>,
        loss_scale: f64,
        train: bool,
    ) -> Result<UnitOutput> {
        const OP: &str = "GpuStage::forward";
        self.gpu.bind()?;
        let unit = Unit::new(micro_batch, segment);
        if self.reset_positions && self.in_flight.documents(micro_batch).is_none() {
            return Err(GpuError::from(model::ModelError::Input {
                unit,
                reason: "positions restart at each document (data.reset_positions) but the \
                         micro-batch has no document starts (GpuStage::set_documents)"
                    .into(),
            }));
        }
        let seg = self.in_flight.segment(unit, &self.segments)?;
        let b = self.input_batch(unit, &input, seg.len)?;
        self.fix_batch(b, OP)?;
        if self.plan.layout.is_last() {
            self.check_targets(targets, b * seg.len)?;
        }
        // The buffers of a micro-batch not in flight: a spare one, or new.
        let mut fresh = match self.in_flight.contains(micro_batch) {
            true => None,
            false => Some(match self.spare_micro_batches.pop() {
                Some(mb) => mb,
                None => self.new_micro_batch()?,
            }),
        };
        let started = self.in_flight.start_forward(unit, seg, b, || {
            fresh.take().ok_or_else(|| {
                GpuError::from(model::ModelError::Order {
                    unit,
                    reason: "the micro-batch's buffers were taken twice".into(),
                })
            })
        });
        if let Some(unused) = fresh {
            self.recycle(unused);
        }
        let mut work = started?;
        let mode = if train { Mode::Train } else { Mode::Eval };
        let result = self.forward_in(
            &mut work.micro_batch.state,
            (unit, seg),
            input,
            targets,
            loss_scale,
            train,
        );
        // A failed forward changes nothing it was given: the K/V count and the pending units move
        // only when it succeeds.
        let outcome = result.is_ok().then_some(mode);
        if let Some(done) = self.in_flight.finish_forward(work, outcome, &self.segments) {
            self.recycle(done);
        }
        let now = self.activation_bytes();
        self.peak.record(now);
        result
    }

    /// The batch size of `input` for a segment of `len` positions: token ids on the first stage,
    /// `d_model`-wide hidden states (given or received over the device link) on the others.
    fn input_batch(&self, unit: Unit, input: &UnitInput, len: usize) -> Result<usize> {
        const OP: &str = "GpuStage::forward";
        let c = self.plan.model.d_model;
        let in_len = match input {
            UnitInput::Tokens(ids) => ids.len(),
            UnitInput::Hidden(x) => x.len(),
            UnitInput::Received => {
                self.links
                    .received_len(Flow::Activation, (unit.micro_batch, unit.segment), OP)?
            }
        };
        let rows = match (input, self.plan.layout.is_first()) {
            (UnitInput::Tokens(ids), true) => ids.len(),
            (UnitInput::Hidden(_) | UnitInput::Received, false) => in_len / c,
            _ => {
                return Err(order(
                    OP,
                    "tokens go to the first stage, hidden states to the others",
                ));
            }
        };
        let width = if self.plan.layout.is_first() { 1 } else { c };
        if rows == 0 || !rows.is_multiple_of(len) || rows * width != in_len {
            return shape(
                OP,
                format!("{in_len} input values do not fit a segment of {len} positions"),
            );
        }
        Ok(rows / len)
    }

    /// The last stage's targets: given, one per position (`n`), each below the vocabulary size.
    fn check_targets(&self, targets: Option<&[u32]>, n: usize) -> Result<()> {
        const OP: &str = "GpuStage::forward";
        let vocab = self.plan.model.vocab_size;
        match targets {
            Some(t) if t.len() == n => {
                // The cross-entropy kernel reads the logit at the target unchecked: an id past
                // the vocabulary reads another row (or past the buffer), a silently wrong loss.
                if let Some(bad) = t.iter().find(|&&id| id as usize >= vocab) {
                    return shape(
                        OP,
                        format!("target id {bad} is not below the vocabulary size {vocab}"),
                    );
                }
                Ok(())
            }
            Some(t) => shape(OP, format!("{} targets for {n} positions", t.len())),
            None => Err(order(OP, "the last stage needs the segment's targets")),
        }
    }

    /// [`GpuStage::forward`]'s computation ([`model::forward_unit`]) on the micro-batch's buffers;
    /// the hidden states leave here (kept for the device link or downloaded).
    fn forward_in(
        &mut self,
        mb: &mut MicroBatch,
        (unit, Segment { start, len }): (Unit, Segment),
        input: UnitInput,
        targets: Option<&[u32]>,
        loss_scale: f64,
        train: bool,
    ) -> Result<UnitOutput> {
        const OP: &str = "GpuStage::forward";
        let (micro_batch, segment) = (unit.micro_batch, unit.segment);
        // The head's weight gradient is computed with the loss (the logits never exist whole), so
        // on the last stage it goes into the micro-batch's accumulator in the forward, in forward
        // order: a micro-batch holds its gradient buffer from its first forward there (counted in
        // the peak). Taken first, so that a step not begun (or a micro-batch out of its range)
        // fails before any work.
        let head_acc = if train && self.plan.layout.is_last() {
            Some(self.accumulator(Unit::new(micro_batch, segment))?)
        } else {
            None
        };
        if segment == 0 {
            // A fresh micro-batch: later segments' backwards add into these.
            for buf in mb.dk.iter_mut().chain(mb.dv.iter_mut()) {
                self.gpu.clear(buf)?;
            }
        }
        let b = self.batch.expect("fixed");
        let n = b * len * self.plan.model.d_model;
        // Hidden states received on the device link are read from the link's buffer, which goes
        // back to the link once the unit is done with it.
        let (arrival, received) = match input {
            UnitInput::Tokens(ids) => (Arrival::Tokens(ids), None),
            UnitInput::Hidden(x) => (Arrival::Hidden(x), None),
            UnitInput::Received => {
                let unit = (micro_batch, segment);
                let held = self.links.take_received(Flow::Activation, unit, OP)?;
                (Arrival::Device(held.buf.ptr()), Some(held))
            }
        };
        let docs = self.in_flight.documents(micro_batch);
        let mut device = GpuUnit {
            stage: self,
            mb: &mut *mb,
            segment,
            rows: UnitShape { b, start, len },
            docs: docs.map(doc_starts),
            position_ids: self.position_ids(docs, (b, start, len)),
            fwd: Some(Fwd {
                input: arrival,
                targets,
                loss_scale,
                head_dw: head_acc.map_or(0, |acc| self.grad_at(acc, names::LM_HEAD)),
            }),
            bwd: None,
            embed_dx: None,
        };
        let result = model::forward_unit(&mut device, docs.map(|d| &d.mask));
        if let Some(held) = received {
            self.links.give_back(held);
        }
        let out = &mb.units[segment].out;
        match result? {
            Forwarded::LossSum(loss) => Ok(UnitOutput::LossSum(loss)),
            Forwarded::Hidden if self.links.linked(Side::Next) => {
                let unit = (micro_batch, segment);
                self.links
                    .keep(&self.gpu, Flow::Activation, unit, out.ptr(), n)?;
                Ok(UnitOutput::Kept(n))
            }
            Forwarded::Hidden => Ok(UnitOutput::Hidden(self.gpu.download_prefix(out, n)?)),
        }
    }

    /// The LM head and cross-entropy of a unit's `n` rows of `h` (the final norm's output) in
    /// row chunks: the summed loss; with `dw` non-zero (training) d(ln_f) into `unit.dhead` and
    /// the head's weight gradient added at `dw`.
    fn head_forward(
        &self,
        unit: &mut UnitActs,
        h: u64,
        targets: &[u32],
        dw: u64,
        n: usize,
        loss_scale: f64,
    ) -> Result<f64> {
        let (c, v) = (self.plan.model.d_model, self.plan.model.vocab_size);
        let train = dw != 0;
        self.gpu.write(&mut unit.targets, targets)?;
        let scratch = self.scratch.as_ref().expect("sized by fix_batch");
        let (w, logits) = (self.at(&self.values, names::LM_HEAD), scratch.logits.ptr());
        let chunk = CHUNK_ROWS.min(n);
        for r0 in (0..n).step_by(chunk) {
            let rows = chunk.min(n - r0);
            let hh = h + (r0 * c * 4) as u64; // row r0 of (n, C) f32
            let (losses, targets) = (unit.losses.at(r0), unit.targets.at(r0));
            let grad_scale = loss_scale as f32;
            let gpu = &self.gpu;
            if let Some(w16) = &self.bf16 {
                self.head_chunk_bf16(w16, (logits, hh, dw), (losses, targets), rows, grad_scale)?;
                if train {
                    let dh = unit.dhead.at(r0 * c);
                    let (dlogits16, _) = w16.operands()?;
                    let (w, vp) = (w16.weight(names::LM_HEAD)?, w16.head_rows);
                    gpu.label_products("lm_head", Pass::Dx);
                    gpu.gemm_bf16(
                        dh,
                        dlogits16,
                        w,
                        (rows, c, vp),
                        (false, false),
                        (vp, c),
                        0.0,
                    )?;
                }
                continue;
            }
            gpu.label_products("lm_head", Pass::Fwd);
            gpu.gemm(logits, hh, w, (rows, v, c), false, true, 0.0)?;
            gpu.softmax_cross_entropy(logits, losses, targets, rows, v, grad_scale, train)?;
            if train {
                // d(lnf) = dlogits W (rows, C); dW += dlogits^T lnf.
                let dh = unit.dhead.at(r0 * c);
                gpu.label_pass(Pass::Dx);
                gpu.gemm(dh, logits, w, (rows, c, v), false, false, 0.0)?;
                gpu.label_pass(Pass::Dw);
                gpu.gemm(dw, logits, hh, (v, c, rows), true, false, 1.0)?;
            }
        }
        let losses = self.gpu.download_prefix(&unit.losses, n)?;
        Ok(losses.iter().map(|&x| x as f64).sum())
    }

    /// One chunk of `rows` rows of the head on the BF16 fast path: `logits (rows, Vp) = hh W^T`
    /// from the BF16 head copy (`Vp` its padded rows), the loss over the real `V` columns and
    /// (with `dw` non-zero) their gradient, the padded columns zeroed, rounded into the first
    /// operand buffer, and `dW (V, C) += dlogits[:, ..V]^T hh`: the real rows only, read from rows
    /// `Vp` wide. The caller multiplies the rounded gradient by the copy for d(hh): the padded
    /// columns meet the copy's zero rows, adding exact zeros.
    fn head_chunk_bf16(
        &self,
        w16: &Bf16Weights,
        (logits, hh, dw): (u64, u64, u64),
        (losses, targets): (u64, u64),
        rows: usize,
        grad_scale: f32,
    ) -> Result<()> {
        let (c, v) = (self.plan.model.d_model, self.plan.model.vocab_size);
        let (vp, gpu, train) = (w16.head_rows, &self.gpu, dw != 0);
        let (dlogits16, hh16) = w16.operands()?;
        let w = w16.weight(names::LM_HEAD)?;
        // hh rounded once for the logits and the weight gradient.
        gpu.to_bf16(hh16, hh, rows * c)?;
        gpu.label_products("lm_head", Pass::Fwd);
        gpu.gemm_bf16(logits, hh16, w, (rows, vp, c), (false, true), (c, c), 0.0)?;
        gpu.softmax_cross_entropy_rows(logits, losses, targets, rows, (v, vp), grad_scale, train)?;
        if train {
            gpu.to_bf16(dlogits16, logits, rows * vp)?;
            gpu.label_pass(Pass::Dw);
            gpu.gemm_bf16(
                dw,
                dlogits16,
                hh16,
                (v, c, rows),
                (true, false),
                (vp, c),
                1.0,
            )?;
        }
        Ok(())
    }

    /// Backward of unit `(micro_batch, segment)`: `d_out (B·s, C)` from the next stage (none on
    /// the last stage, which starts from its loss). Returns the gradient for the previous stage
    /// (none on the first stage), kept on the device when a device link to the previous stage
    /// was joined.
    pub fn backward(&mut self, unit: (usize, usize), d_out: Option<&[f32]>) -> Result<UnitGrad> {
        self.backward_from(unit, grad_in(d_out), Half::Whole)
    }

    /// [`GpuStage::backward`] of a unit whose output gradient was received on the next stage's
    /// device link ([`GpuStage::receive_grad`]).
    pub fn backward_received(&mut self, unit: (usize, usize)) -> Result<UnitGrad> {
        self.backward_from(unit, GradIn::Received, Half::Whole)
    }

    /// The input half of unit `(micro_batch, segment)`'s backward (a zero-bubble `I`): the
    /// gradient for the previous stage as [`GpuStage::backward`] returns it, and the dK/dV left
    /// for earlier segments, but no parameter gradient: the unit keeps what its weight half
    /// ([`GpuStage::backward_weight`]) reads, in its own buffers, until then.
    pub fn backward_input(
        &mut self,
        unit: (usize, usize),
        d_out: Option<&[f32]>,
    ) -> Result<UnitGrad> {
        self.backward_from(unit, grad_in(d_out), Half::Input)
    }

    /// [`GpuStage::backward_input`] of a unit whose output gradient was received on the next
    /// stage's device link ([`GpuStage::receive_grad`]).
    pub fn backward_input_received(&mut self, unit: (usize, usize)) -> Result<UnitGrad> {
        self.backward_from(unit, GradIn::Received, Half::Input)
    }

    /// The weight half of unit `(micro_batch, segment)`'s backward (a zero-bubble `W`), after its
    /// input half: adds the unit's parameter gradients to its micro-batch's, with the kernels and
    /// in the order of a whole backward, and frees the unit. Nothing crosses a link. The
    /// micro-batch's gradient is complete after the last weight half that follows segment 0's
    /// input half.
    pub fn backward_weight(&mut self, (micro_batch, segment): (usize, usize)) -> Result<()> {
        const OP: &str = "GpuStage::backward_weight";
        self.gpu.bind()?;
        let unit = Unit::new(micro_batch, segment);
        let seg = self.in_flight.segment(unit, &self.segments)?;
        let mut work = self.in_flight.start_backward_weight(unit, seg)?;
        let result = self.accumulator(unit).and_then(|acc| {
            let mut scratch = self
                .scratch
                .take()
                .ok_or_else(|| order(OP, "backward before any forward"))?;
            let mb = &mut work.micro_batch.state;
            let result = self.backward_units(mb, unit, &mut scratch, Part::Weight { acc });
            self.scratch = Some(scratch);
            result
        });
        // A failed weight half moves nothing; the last one of a micro-batch ends it and completes
        // its gradient.
        if let Some(done) = self.in_flight.finish_backward_weight(work, result.is_ok()) {
            self.recycle(done);
            self.complete(unit)?;
        }
        result.map(|_| ())
    }

    /// A whole backward or an input half, from `d_out`.
    fn backward_from(
        &mut self,
        (micro_batch, segment): (usize, usize),
        d_out: GradIn,
        half: Half,
    ) -> Result<UnitGrad> {
        self.gpu.bind()?;
        let unit = Unit::new(micro_batch, segment);
        let seg = self.in_flight.segment(unit, &self.segments)?;
        let mut work = match half {
            Half::Whole => self.in_flight.start_backward(unit, seg)?,
            Half::Input => self.in_flight.start_backward_input(unit, seg)?,
        };
        let result = self.backward_in(&mut work.micro_batch.state, unit, d_out, half);
        // A failed backward moves nothing; segment 0's whole backward ends the micro-batch and
        // completes its gradient (after a split one, the last weight half does).
        match half {
            Half::Whole => {
                if let Some(done) = self.in_flight.finish_backward(work, result.is_ok()) {
                    self.recycle(done);
                    self.complete(unit)?;
                }
            }
            Half::Input => self.in_flight.finish_backward_input(work, result.is_ok()),
        }
        result
    }

    fn backward_in(
        &mut self,
        mb: &mut MicroBatch,
        unit: Unit,
        d_out: GradIn,
        half: Half,
    ) -> Result<UnitGrad> {
        const OP: &str = "GpuStage::backward";
        let key = (unit.micro_batch, unit.segment);
        // An input half adds no parameter gradient: it takes no accumulator.
        let acc = match half {
            Half::Whole => Some(self.accumulator(unit)?),
            Half::Input => None,
        };
        let received = match d_out {
            GradIn::Received => Some(self.links.take_received(Flow::Grad, key, OP)?),
            _ => None,
        };
        let Some(mut scratch) = self.scratch.take() else {
            if let Some(held) = received {
                self.links.give_back(held);
            }
            return Err(order(OP, "backward before any forward"));
        };
        let dy = match (&received, d_out) {
            (Some(held), _) => Dy::Device(held.buf.ptr(), held.n),
            (None, GradIn::Host(d)) => Dy::Host(d),
            (None, _) => Dy::Loss,
        };
        let part = match acc {
            Some(acc) => Part::Whole { d_out: dy, acc },
            None => Part::Input { d_out: dy },
        };
        let result = self.backward_units(mb, unit, &mut scratch, part);
        if let Some(held) = received {
            self.links.give_back(held);
        }
        let dx = scratch.dx.ptr();
        let result = result.and_then(|values| match values {
            None => Ok(UnitGrad::None),
            Some(n) if self.links.linked(Side::Prev) => {
                self.links.keep(&self.gpu, Flow::Grad, key, dx, n)?;
                Ok(UnitGrad::Kept(n))
            }
            Some(n) => Ok(UnitGrad::Hidden(self.gpu.download_prefix(&scratch.dx, n)?)),
        });
        self.scratch = Some(scratch);
        result
    }

    /// The computation of a whole backward, an input half or a weight half
    /// ([`model::backward_unit`], [`model::backward_unit_input`], [`model::backward_unit_weight`])
    /// with the scratch taken out (and always put back by the caller): the values of the input's
    /// gradient left in `scratch.dx` (none on the first stage, and in a weight half).
    fn backward_units(
        &self,
        mb: &mut MicroBatch,
        unit: Unit,
        scratch: &mut Scratch,
        part: Part,
    ) -> Result<Option<usize>> {
        let Segment { start, len } = self.in_flight.segment(unit, &self.segments)?;
        let b = self.batch.expect("fixed by the forward");
        let docs = self.in_flight.documents(unit.micro_batch);
        let masks = docs.map(|d| &d.mask);
        let mut device = GpuUnit {
            stage: self,
            mb,
            segment: unit.segment,
            rows: UnitShape { b, start, len },
            docs: docs.map(doc_starts),
            position_ids: self.position_ids(docs, (b, start, len)),
            fwd: None,
            bwd: Some(Bwd { scratch, part }),
            embed_dx: None,
        };
        match part {
            Part::Whole { .. } => model::backward_unit(&mut device, masks),
            Part::Input { .. } => model::backward_unit_input(&mut device, masks),
            Part::Weight { .. } => model::backward_unit_weight(&mut device).map(|()| None),
        }
    }
}

/// Where a unit's backward starts, given its output gradient from the host (none: the loss).
fn grad_in(d_out: Option<&[f32]>) -> GradIn<'_> {
    match d_out {
        Some(d) => GradIn::Host(d),
        None => GradIn::Loss,
    }
}

/// A backward that starts from an output gradient: whole, or the input half of a split one (a
/// zero-bubble `I`; its `W` is [`GpuStage::backward_weight`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Half {
    Whole,
    Input,
}

/// Where a norm's input half puts its parameters' gradients.
#[derive(Clone, Copy)]
enum NormGrads {
    /// Added to the gradient buffer at this address (a whole backward).
    Accumulate(u64),
    /// Written into the norm's [`NormActs::grads`], for the weight half (a split backward).
    Keep,
}

/// The output gradient a unit's backward starts from, where it lies.
#[derive(Clone, Copy)]
enum Dy<'a> {
    Loss,
    Host(&'a [f32]),
    /// A device buffer's address and length.
    Device(u64, usize),
}
