//! The CUDA device of a stage for one unit: [`model::StageDevice`] over the stage's preallocated
//! buffers, so the stage's program (embeddings or received hidden states → blocks → final norm,
//! head and loss or the output, and back) is the `model` crate's ([`model::forward_unit`],
//! [`model::backward_unit`]) and only where each piece reads and writes is written here.
//!
//! Handles are device addresses, as in [`GpuBlock`]: the input lands in the first block's input
//! buffer (or the unit's output buffer on a stage with no blocks), each block writes the next
//! one's input, the last the unit's output; the backward works in the stage's scratch. The head
//! computes its weight gradient and d(ln_f) with the loss in the forward (the logits never exist
//! whole), so its input half only hands d(ln_f) on and its weight half adds nothing. What crosses
//! the device links is the stage's shell's business: a unit's hidden states or input gradient stay
//! where the program left them ([`Forwarded::Hidden`], the `(N, C)` values in `scratch.dx`), and
//! the shell keeps or downloads them.
//!
//! A backward runs whole ([`model::backward_unit`]: each piece's input half, then at once its
//! weight half, which reads the output gradient where the input half left it) or split
//! ([`Part`]): the input half then keeps what the weight halves read in the unit's own buffers —
//! the final norm's parameter gradients in its [`NormActs`](super::NormActs), the embeddings'
//! output gradient in the unit's output buffer (spent after the forward, or after the final norm's
//! input half), each block's in its spent activations ([`GpuBlock`]) — and the weight half, later,
//! reads them there.

use model::params::names;
use model::{ModelError, StageDevice, StageLayout};

use super::block::{BlockGrads, GpuBlock};
use super::part::Part;
use super::{Dy, GpuStage, MicroBatch, NormGrads, Scratch, UnitActs, UnitShape, order};
use crate::device::Buf;
use crate::error::{GpuError, Result, shape};
use crate::kernels::DocStarts;

/// Where a unit's forward input lies.
#[derive(Clone, Copy)]
pub(super) enum Arrival<'a> {
    /// First stage: the segment's token ids, row-major `(B, s)`, on the host.
    Tokens(&'a [u32]),
    /// Later stages: the hidden states `(N, C)` on the host.
    Hidden(&'a [f32]),
    /// Later stages: the hidden states `(N, C)` at this device address (a device link's buffer).
    Device(u64),
}

/// What a unit's forward leaves.
pub(super) enum Forwarded {
    /// Last stage: the sum of the segment's token losses (unscaled), added in row order.
    LossSum(f64),
    /// The hidden states `(N, C)`, in the unit's output buffer.
    Hidden,
}

/// The forward's inputs.
pub(super) struct Fwd<'s> {
    pub input: Arrival<'s>,
    /// Last stage: the segment's targets, checked against the vocabulary.
    pub targets: Option<&'s [u32]>,
    pub loss_scale: f64,
    /// Last stage in training: the head's weight gradient in the micro-batch's accumulator (0:
    /// evaluation, no gradient).
    pub head_dw: u64,
}

/// The backward's buffers.
pub(super) struct Bwd<'s> {
    pub scratch: &'s mut Scratch,
    pub part: Part<'s>,
}

/// One unit of `stage`: its micro-batch's caches and saved activations, and either direction's
/// inputs.
pub(super) struct GpuUnit<'s> {
    pub stage: &'s GpuStage,
    pub mb: &'s mut MicroBatch,
    pub segment: usize,
    pub rows: UnitShape,
    /// The micro-batch's document starts on the device, when its attention is masked.
    pub docs: Option<DocStarts>,
    /// With positions restarting at each document (`data.reset_positions`; first stage): one
    /// past the unit's largest position id. The position rows are then gathered and their
    /// gradient summed by the ids `docs` give.
    pub position_ids: Option<usize>,
    pub fwd: Option<Fwd<'s>>,
    pub bwd: Option<Bwd<'s>>,
    /// A whole backward's embeddings' output gradient, from their input half to their weight
    /// half.
    pub embed_dx: Option<u64>,
}

impl<'s> GpuUnit<'s> {
    const OP_FWD: &'static str = "GpuStage::forward";
    const OP_BWD: &'static str = "GpuStage::backward";

    /// Rows `N = B·s` of the unit.
    fn n(&self) -> usize {
        self.rows.b * self.rows.len
    }

    fn c(&self) -> usize {
        self.stage.plan.model.d_model
    }

    fn unit(&self) -> &UnitActs {
        &self.mb.units[self.segment]
    }

    /// Where the first block reads its input: its input buffer, or the unit's output buffer on a
    /// stage with no blocks (which only adds the head).
    fn input_buffer(&mut self) -> &mut Buf<f32> {
        let unit = &mut self.mb.units[self.segment];
        match unit.blocks.first_mut() {
            Some(a) => &mut a.x,
            None => &mut unit.out,
        }
    }

    /// The document starts positions restart at: an error without them.
    fn restarts(&self) -> Result<DocStarts> {
        self.docs.ok_or_else(|| {
            order(
                "GpuStage",
                "positions restart at each document (data.reset_positions) but the micro-batch \
                 has no document starts (GpuStage::set_documents)",
            )
        })
    }

    fn fwd(&self) -> Result<&Fwd<'s>> {
        self.fwd
            .as_ref()
            .ok_or_else(|| order(Self::OP_FWD, "a forward piece run in a backward"))
    }

    fn bwd(&mut self) -> Result<&mut Bwd<'s>> {
        self.bwd
            .as_mut()
            .ok_or_else(|| order(Self::OP_BWD, "a backward piece run in a forward"))
    }
}

impl StageDevice for GpuUnit<'_> {
    type X = u64;
    type Err = GpuError;
    type Block<'b>
        = GpuBlock<'b>
    where
        Self: 'b;
    type Output = Forwarded;
    type InputGrad = Option<usize>;

    fn layout(&self) -> &StageLayout {
        &self.stage.plan.layout
    }

    fn block(&mut self, slot: usize) -> Result<GpuBlock<'_>> {
        let layer = self.stage.plan.layout.layers.start + slot;
        let (mb, unit) = (&*self.mb, &self.mb.units[self.segment]);
        let (Some(acts), Some(cache)) = (unit.blocks.get(slot), mb.qkv.get(slot)) else {
            return Err(GpuError::from(ModelError::NotSaved {
                layer: format!("h.{layer} (no buffers of the unit's block)"),
            }));
        };
        // The forward's output: the next block's input, or the unit's output.
        let out = unit
            .blocks
            .get(slot + 1)
            .map_or(unit.out.ptr(), |next| next.x.ptr());
        let grads = self.bwd.as_ref().map(|b| BlockGrads {
            part: b.part,
            scratch: &*b.scratch,
            dk: &mb.dk[slot],
            dv: &mb.dv[slot],
        });
        Ok(GpuBlock {
            stage: self.stage,
            acts,
            out: if grads.is_some() { 0 } else { out },
            cache,
            layer,
            rows: self.rows,
            docs: self.docs,
            grads,
            pending: None,
        })
    }

    fn embed_forward(&mut self) -> Result<u64> {
        let Arrival::Tokens(ids) = self.fwd()?.input else {
            return Err(order(
                Self::OP_FWD,
                "tokens go to the first stage, hidden states to the others",
            ));
        };
        let (stage, vocab) = (self.stage, self.stage.plan.model.vocab_size);
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return shape(
                Self::OP_FWD,
                format!("token id {bad} is not below the vocabulary size {vocab}"),
            );
        }
        let (n, c, UnitShape { len, start, .. }) = (self.n(), self.c(), self.rows);
        let x0 = self.input_buffer().ptr();
        let restart = self.position_ids.map(|_| self.restarts()).transpose()?;
        let unit = &mut self.mb.units[self.segment];
        stage.gpu.write(&mut unit.ids, ids)?;
        unit.host_ids = ids.to_vec();
        stage.gpu.embed_forward(
            x0,
            unit.ids.ptr(),
            stage.at(&stage.values, names::WTE),
            stage.at(&stage.values, names::WPE),
            n,
            c,
            (len, start),
            restart.map(|docs| (docs, stage.seq)),
        )?;
        Ok(x0)
    }

    fn receive_hidden(&mut self) -> Result<u64> {
        let (stage, n, c) = (self.stage, self.n(), self.c());
        let gpu = &stage.gpu;
        match self.fwd()?.input {
            Arrival::Hidden(x) => {
                let dst = self.input_buffer();
                gpu.write(dst, x)?;
                Ok(dst.ptr())
            }
            Arrival::Device(src) => {
                let dst = self.input_buffer().ptr();
                gpu.copy_values(dst, src, n * c)?;
                Ok(dst)
            }
            Arrival::Tokens(_) => Err(order(
                Self::OP_FWD,
                "tokens go to the first stage, hidden states to the others",
            )),
        }
    }

    fn final_norm_forward(&mut self, x: &u64) -> Result<u64> {
        let lnf = &self.unit().lnf;
        self.stage.norm_forward(lnf, *x, names::LN_F, self.n())?;
        Ok(lnf.out.ptr())
    }

    fn head_loss_forward(&mut self, h: &u64) -> Result<Forwarded> {
        let fwd = self.fwd()?;
        let Some(targets) = fwd.targets else {
            return Err(order(
                Self::OP_FWD,
                "the last stage needs the segment's targets",
            ));
        };
        let (dw, loss_scale, n) = (fwd.head_dw, fwd.loss_scale, self.n());
        let unit = &mut self.mb.units[self.segment];
        let loss = self
            .stage
            .head_forward(unit, *h, targets, dw, n, loss_scale)?;
        Ok(Forwarded::LossSum(loss))
    }

    fn send_hidden(&mut self, x: u64) -> Result<Forwarded> {
        // The shell keeps or downloads the unit's output buffer: the last block wrote there.
        if x != self.unit().out.ptr() {
            return Err(order(
                Self::OP_FWD,
                "the unit's output is not in its output buffer",
            ));
        }
        Ok(Forwarded::Hidden)
    }

    fn head_backward_input(&mut self) -> Result<u64> {
        match self.bwd()?.part.d_out()? {
            // d(ln_f) was computed with the loss, in the forward.
            Dy::Loss => Ok(self.unit().dhead.ptr()),
            _ => Err(order(
                Self::OP_BWD,
                "the last stage starts backward from its loss, the others from the next stage's gradient",
            )),
        }
    }

    fn head_backward_weight(&mut self) -> Result<()> {
        // The head's weight gradient was added with the loss, in the forward.
        self.bwd()?;
        Ok(())
    }

    fn final_norm_backward_input(&mut self, dy: &u64) -> Result<u64> {
        let n = self.n();
        let (stage, unit) = (self.stage, &self.mb.units[self.segment]);
        let b = self
            .bwd
            .as_ref()
            .ok_or_else(|| order(Self::OP_BWD, "a backward piece run in a forward"))?;
        let dx = b.scratch.dx.ptr();
        let (x, lnf) = (unit.out.ptr(), &unit.lnf);
        let to = match b.part.split() {
            true => NormGrads::Keep,
            false => NormGrads::Accumulate(b.part.acc()?),
        };
        let sc = &b.scratch.columns;
        stage.norm_backward_input(dx, *dy, x, lnf, names::LN_F, (n, sc), to)?;
        Ok(dx)
    }

    fn final_norm_backward_weight(&mut self) -> Result<()> {
        let (stage, part) = (self.stage, self.bwd()?.part);
        // A whole backward's input half added the parameter gradients already.
        if part.split() {
            stage.norm_backward_weight(&self.unit().lnf, names::LN_F, part.acc()?)?;
        }
        Ok(())
    }

    fn receive_grad(&mut self) -> Result<u64> {
        let (stage, n, c) = (self.stage, self.n(), self.c());
        let gpu = &stage.gpu;
        let b = self.bwd()?;
        match b.part.d_out()? {
            Dy::Host(dy) if dy.len() == n * c => gpu.write(&mut b.scratch.dx, dy)?,
            Dy::Device(dy, len) if len == n * c => {
                gpu.copy_values(b.scratch.dx.ptr(), dy, n * c)?
            }
            Dy::Host(dy) => {
                return shape(
                    Self::OP_BWD,
                    format!("{} gradient values for {n} positions × {c}", dy.len()),
                );
            }
            Dy::Device(_, len) => {
                return shape(
                    Self::OP_BWD,
                    format!("{len} received gradient values for {n} positions × {c}"),
                );
            }
            Dy::Loss => {
                return Err(order(
                    Self::OP_BWD,
                    "the last stage starts backward from its loss, the others from the next stage's gradient",
                ));
            }
        }
        Ok(b.scratch.dx.ptr())
    }

    fn embed_backward_input(&mut self, dx: &u64) -> Result<Option<usize>> {
        let (stage, n, c) = (self.stage, self.n(), self.c());
        if self.bwd()?.part.split() {
            // The output buffer is spent (sent on, or read by the final norm's input half).
            let out = self.mb.units[self.segment].out.ptr();
            stage.gpu.copy_values(out, *dx, n * c)?;
        } else {
            self.embed_dx = Some(*dx);
        }
        Ok(None)
    }

    fn embed_backward_weight(&mut self) -> Result<()> {
        let (stage, c, UnitShape { b, start, len }) = (self.stage, self.c(), self.rows);
        let part = self.bwd()?.part;
        let acc = part.acc()?;
        let unit = self.unit();
        let dx = match (part.split(), self.embed_dx) {
            (true, _) => unit.out.ptr(),
            (false, Some(dx)) => dx,
            (false, None) => {
                return Err(order(
                    Self::OP_BWD,
                    "the embeddings' weight half before their input half",
                ));
            }
        };
        let gpu = &stage.gpu;
        gpu.embed_backward_tokens(stage.grad_at(acc, names::WTE), dx, &unit.host_ids, c)?;
        let dwpe = stage.grad_at(acc, names::WPE);
        match self.position_ids {
            None => gpu.embed_backward_positions(dwpe, dx, b, len, c, start)?,
            Some(ids) => {
                let (docs, seq) = (self.restarts()?, stage.seq);
                gpu.embed_backward_positions_reset(dwpe, dx, (b, len, c, start), docs, seq, ids)?
            }
        }
        Ok(())
    }

    fn send_grad(&mut self, dx: u64) -> Result<Option<usize>> {
        let (n, c) = (self.n(), self.c());
        // The shell keeps or downloads the scratch's dx: every block's backward ends there.
        if dx != self.bwd()?.scratch.dx.ptr() {
            return Err(order(
                Self::OP_BWD,
                "the input's gradient is not in the backward's dx buffer",
            ));
        }
        Ok(Some(n * c))
    }
}
