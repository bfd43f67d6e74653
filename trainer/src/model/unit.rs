//! The CPU device of a stage for one unit: [`::model::StageDevice`] over `ops` and candle tensors,
//! so the stage's program (embeddings or received hidden states → blocks → final norm, head and
//! loss or the output, and back) is the `model` crate's ([`::model::forward_unit`],
//! [`::model::backward_unit`]) and only what the CPU computes and saves is written here. Handles
//! are tensors; the forward fills the unit's [`UnitCtx`] (kept in training, the oracle's named
//! saved activations), the backward takes from it and adds to the micro-batch's gradients. The
//! backward's kernels are the split halves: the input half ([`CpuUnit::backward_input`], an `I`)
//! takes what only it reads and leaves in the context what the weight half
//! ([`CpuUnit::backward_weight`], a `W`) adds; a whole backward ([`CpuUnit::backward`]) is the
//! halves of each piece back to back.

use candle_core::{Device, Tensor};
use ops::DocumentMask;
use ops::embedding::{embedding_backward, embedding_forward};
use ops::lm_head::{LmHeadGrads, lm_head_loss, lm_head_loss_forward_backward};
use ops::memory::SavedTensors;
use ops::rope::RopeTable;

use super::block::{Block, BlockCtx, CpuBlock, KvPrefix, SegmentShape};
use super::config::{ModelConfig, Position};
use super::error::ModelError;
use super::norm::{NormLayer, NormLayerCtx, NormParamGrads};
use super::params::{Gradients, Params, names};
use super::partition::StageLayout;
use ::model::{Mode, StageDevice, Unit};

/// Rows of the logits that exist at once in the fused LM head + softmax cross-entropy.
const LOSS_CHUNK_ROWS: usize = 256;

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

/// What a unit's backward needs, filled by its forward (in training) and taken by its backward:
/// one entry per piece of the stage's program.
pub(super) struct UnitCtx {
    pub seg: SegmentShape,
    /// First stage: the token ids `(N,)`.
    token_ids: Option<Tensor>,
    /// One per held block.
    blocks: Vec<BlockCtx>,
    /// Last stage: the final norm's context.
    ln_f: Option<NormLayerCtx>,
    /// Last stage: the head's gradients, computed with the loss (already scaled).
    lm_head: Option<LmHeadGrads>,
    /// Between the backward's input half and its weight half (see [`WeightHalf`]).
    weight: WeightHalf,
}

/// What a unit's input half leaves for its weight half, besides the blocks' (in their
/// contexts): the head's weight gradient and the final norm's gradients (last stage), and the
/// gradient of the embeddings' output (first stage).
#[derive(Default)]
struct WeightHalf {
    /// `(V, C)`.
    lm_head_dw: Option<Tensor>,
    ln_f: Option<NormParamGrads>,
    /// `(N, C)`.
    embed_dx: Option<Tensor>,
}

impl UnitCtx {
    /// An empty context for a unit of `seg` on a stage of `blocks` held blocks.
    pub fn new(seg: SegmentShape, blocks: usize) -> Self {
        UnitCtx {
            seg,
            token_ids: None,
            blocks: (0..blocks).map(|_| BlockCtx::default()).collect(),
            ln_f: None,
            lm_head: None,
            weight: WeightHalf::default(),
        }
    }
}

impl SavedTensors for UnitCtx {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.token_ids.for_each_tensor(f);
        self.blocks.for_each_tensor(f);
        self.ln_f.for_each_tensor(f);
        self.lm_head.for_each_tensor(f);
        let w = &self.weight;
        w.lm_head_dw.for_each_tensor(f);
        w.ln_f.for_each_tensor(f);
        w.embed_dx.for_each_tensor(f);
    }
}

/// The stage's fixed parts a unit reads.
#[derive(Clone, Copy)]
pub(super) struct CpuModel<'b> {
    pub cfg: &'b ModelConfig,
    pub layout: &'b StageLayout,
    pub params: &'b Params,
    pub rope: Option<&'b RopeTable>,
    /// Positions restart at each document (`data.reset_positions`).
    pub reset_positions: bool,
}

/// One unit of a CPU stage, forward or backward.
pub(super) struct CpuUnit<'b> {
    model: CpuModel<'b>,
    unit: Unit,
    mode: Mode,
    /// The micro-batch's K/V prefixes, one per held block.
    kv: &'b mut [KvPrefix],
    ctx: &'b mut UnitCtx,
    /// In evaluation: the block being run's context, dropped when the next block starts.
    scratch: BlockCtx,
    /// What arrives: the token ids `(N,)` or hidden states `(N, C)` of the forward, the gradient
    /// of the output `(N, C)` of the backward (none on the last stage).
    input: Option<Tensor>,
    /// Last stage's forward: the targets `(N,)` and the loss gradient's scale.
    targets: Option<&'b Tensor>,
    loss_scale: f64,
    docs: Option<&'b DocumentMask>,
    /// Where the backward adds parameter gradients (none in the forward).
    grads: Option<&'b mut Gradients>,
}

impl<'b> CpuUnit<'b> {
    /// The forward of `unit` in `mode` from `input` (token ids `(N,)` on the first stage, hidden
    /// states `(N, C)` on the others), filling `ctx`.
    pub fn forward(
        model: CpuModel<'b>,
        unit: Unit,
        mode: Mode,
        (kv, ctx): (&'b mut [KvPrefix], &'b mut UnitCtx),
        input: Tensor,
        (targets, loss_scale): (Option<&'b Tensor>, f64),
        docs: Option<&'b DocumentMask>,
    ) -> Self {
        CpuUnit {
            model,
            unit,
            mode,
            kv,
            ctx,
            scratch: BlockCtx::default(),
            input: Some(input),
            targets,
            loss_scale,
            docs,
            grads: None,
        }
    }

    /// The backward of `unit` from its forward's `ctx` and `d_out` (none on the last stage),
    /// adding to `grads`.
    pub fn backward(
        model: CpuModel<'b>,
        unit: Unit,
        (kv, ctx): (&'b mut [KvPrefix], &'b mut UnitCtx),
        d_out: Option<Tensor>,
        grads: &'b mut Gradients,
        docs: Option<&'b DocumentMask>,
    ) -> Self {
        CpuUnit {
            model,
            unit,
            mode: Mode::Train,
            kv,
            ctx,
            scratch: BlockCtx::default(),
            input: d_out,
            targets: None,
            loss_scale: 0.0,
            docs,
            grads: Some(grads),
        }
    }

    /// The input half of the backward of `unit` (an `I`) from its forward's `ctx` and `d_out`
    /// (none on the last stage): adds no gradient, leaves in `ctx` what the weight half adds.
    pub fn backward_input(
        model: CpuModel<'b>,
        unit: Unit,
        (kv, ctx): (&'b mut [KvPrefix], &'b mut UnitCtx),
        d_out: Option<Tensor>,
        docs: Option<&'b DocumentMask>,
    ) -> Self {
        CpuUnit {
            model,
            unit,
            mode: Mode::Train,
            kv,
            ctx,
            scratch: BlockCtx::default(),
            input: d_out,
            targets: None,
            loss_scale: 0.0,
            docs,
            grads: None,
        }
    }

    /// The weight half of the backward of `unit` (a `W`), after its input half: adds what the
    /// input half left in `ctx` to `grads`.
    pub fn backward_weight(
        model: CpuModel<'b>,
        unit: Unit,
        (kv, ctx): (&'b mut [KvPrefix], &'b mut UnitCtx),
        grads: &'b mut Gradients,
        docs: Option<&'b DocumentMask>,
    ) -> Self {
        CpuUnit {
            model,
            unit,
            mode: Mode::Train,
            kv,
            ctx,
            scratch: BlockCtx::default(),
            input: None,
            targets: None,
            loss_scale: 0.0,
            docs,
            grads: Some(grads),
        }
    }

    fn input_error(&self, reason: &str) -> ModelError {
        ModelError::Input {
            unit: self.unit,
            reason: reason.into(),
        }
    }

    /// Where the backward adds gradients.
    fn grads(&mut self, what: &str) -> Result<&mut Gradients, ModelError> {
        self.grads
            .as_deref_mut()
            .ok_or_else(|| ModelError::NotSaved {
                layer: format!("{what} (a backward without a gradient accumulator)"),
            })
    }

    /// Position ids of the unit's rows, `(N,)` U32 (with `reset_positions`, within each
    /// document).
    fn position_ids(&self) -> candle_core::Result<Tensor> {
        let seg = self.ctx.seg;
        let ids = ::model::documents::position_ids(
            self.docs,
            seg.batch,
            seg.start,
            seg.len,
            self.model.reset_positions,
        );
        Tensor::from_vec(ids, seg.tokens(), &Device::Cpu)
    }

    /// The gradient that starts a non-last stage's backward.
    const FROM_LOSS_OR_NEXT: &'static str =
        "the last stage starts backward from its loss, the others from the next stage's gradient";
}

impl StageDevice for CpuUnit<'_> {
    type X = Tensor;
    type Err = ModelError;
    type Block<'c>
        = CpuBlock<'c>
    where
        Self: 'c;
    type Output = StageOutput;
    type InputGrad = Option<Tensor>;

    fn layout(&self) -> &StageLayout {
        self.model.layout
    }

    fn block(&mut self, slot: usize) -> Result<CpuBlock<'_>, ModelError> {
        let m = self.model;
        let layer = m.layout.layers.start + slot;
        let missing = || ModelError::NotSaved {
            layer: format!("h.{layer} (no saved context or K/V prefix of the unit)"),
        };
        let ctx = match self.mode {
            Mode::Train => self.ctx.blocks.get_mut(slot).ok_or_else(missing)?,
            Mode::Eval => {
                self.scratch = BlockCtx::default();
                &mut self.scratch
            }
        };
        let kv = self.kv.get_mut(slot).ok_or_else(missing)?;
        let block = Block::new(m.cfg, layer, m.rope);
        Ok(CpuBlock::new(
            block,
            m.params,
            self.ctx.seg,
            kv,
            ctx,
            self.grads.as_deref_mut(),
        ))
    }

    fn embed_forward(&mut self) -> Result<Tensor, ModelError> {
        let ids = self
            .input
            .take()
            .ok_or_else(|| self.input_error("the first stage needs the segment's tokens"))?; // (N,)
        let m = self.model;
        let mut x = embedding_forward(&ids, m.params.get(names::WTE)?)?; // (N, C)
        if m.cfg.position == Position::Learned {
            let pos = self.position_ids()?;
            x = x.add(&embedding_forward(&pos, m.params.get(names::WPE)?)?)?;
        }
        self.ctx.token_ids = Some(ids);
        Ok(x)
    }

    fn receive_hidden(&mut self) -> Result<Tensor, ModelError> {
        self.input.take().ok_or_else(|| {
            self.input_error("a later stage needs the previous stage's hidden states")
        })
    }

    fn final_norm_forward(&mut self, x: &Tensor) -> Result<Tensor, ModelError> {
        let m = self.model;
        let (h, ctx) = NormLayer::of(m.cfg).forward(m.params, names::LN_F, x)?; // (N, C)
        self.ctx.ln_f = Some(ctx);
        Ok(h)
    }

    fn head_loss_forward(&mut self, h: &Tensor) -> Result<StageOutput, ModelError> {
        let targets = self
            .targets
            .ok_or_else(|| self.input_error("the last stage needs the segment's targets"))?;
        let w = self.model.params.get(names::LM_HEAD)?; // (V, C)
        let loss_sum = match self.mode {
            Mode::Train => {
                let (loss_sum, lm_head) =
                    lm_head_loss_forward_backward(h, w, targets, self.loss_scale, LOSS_CHUNK_ROWS)?;
                self.ctx.lm_head = Some(lm_head);
                loss_sum
            }
            Mode::Eval => lm_head_loss(h, w, targets, LOSS_CHUNK_ROWS)?,
        };
        Ok(StageOutput::LossSum(loss_sum))
    }

    fn send_hidden(&mut self, x: Tensor) -> Result<StageOutput, ModelError> {
        Ok(StageOutput::Hidden(x))
    }

    fn head_backward_input(&mut self) -> Result<Tensor, ModelError> {
        let saved = self.ctx.lm_head.take();
        let (None, Some(LmHeadGrads { dh, dw })) = (&self.input, saved) else {
            return Err(self.input_error(Self::FROM_LOSS_OR_NEXT));
        };
        self.ctx.weight.lm_head_dw = Some(dw);
        Ok(dh)
    }

    fn head_backward_weight(&mut self) -> Result<(), ModelError> {
        let dw = self
            .ctx
            .weight
            .lm_head_dw
            .take()
            .ok_or_else(|| ModelError::NotSaved {
                layer: format!(
                    "{} (its gradient: the input half of the backward has not run)",
                    names::LM_HEAD
                ),
            })?;
        self.grads(names::LM_HEAD)?.add(names::LM_HEAD, dw)
    }

    fn final_norm_backward_input(&mut self, dy: &Tensor) -> Result<Tensor, ModelError> {
        let ctx = self.ctx.ln_f.take().ok_or_else(|| ModelError::NotSaved {
            layer: names::LN_F.into(),
        })?;
        let m = self.model;
        let (dx, g) = NormLayer::of(m.cfg).backward_input(m.params, names::LN_F, &ctx, dy)?;
        self.ctx.weight.ln_f = Some(g);
        Ok(dx)
    }

    fn final_norm_backward_weight(&mut self) -> Result<(), ModelError> {
        let g = self
            .ctx
            .weight
            .ln_f
            .take()
            .ok_or_else(|| ModelError::NotSaved {
                layer: format!(
                    "{} (its gradients: the input half of the backward has not run)",
                    names::LN_F
                ),
            })?;
        NormLayer::add_grads(names::LN_F, g, self.grads(names::LN_F)?)
    }

    fn receive_grad(&mut self) -> Result<Tensor, ModelError> {
        self.input
            .take()
            .ok_or_else(|| self.input_error(Self::FROM_LOSS_OR_NEXT))
    }

    fn embed_backward_input(&mut self, dx: &Tensor) -> Result<Option<Tensor>, ModelError> {
        self.ctx.weight.embed_dx = Some(dx.clone());
        Ok(None)
    }

    fn embed_backward_weight(&mut self) -> Result<(), ModelError> {
        let ids = self
            .ctx
            .token_ids
            .take()
            .ok_or_else(|| ModelError::NotSaved {
                layer: format!("{} (the unit's token ids)", names::WTE),
            })?;
        let dx = self
            .ctx
            .weight
            .embed_dx
            .take()
            .ok_or_else(|| ModelError::NotSaved {
                layer: format!(
                    "{} (the gradient of its output: the input half of the backward has not run)",
                    names::WTE
                ),
            })?;
        let m = self.model;
        let d_wte = embedding_backward(&ids, &dx, m.cfg.vocab_size)?;
        self.grads(names::WTE)?.add(names::WTE, d_wte)?;
        if m.cfg.position == Position::Learned {
            let d_wpe = embedding_backward(&self.position_ids()?, &dx, m.cfg.max_seq_len)?;
            self.grads(names::WPE)?.add(names::WPE, d_wpe)?;
        }
        Ok(())
    }

    fn send_grad(&mut self, dx: Tensor) -> Result<Option<Tensor>, ModelError> {
        Ok(Some(dx))
    }
}
