//! The CUDA device of one transformer block for one unit: [`model::BlockDevice`] over the stage's
//! preallocated buffers, so the block's order of operations is the `model` crate's
//! ([`model::block_forward`], [`model::block_backward`]) and only where each result lives is
//! written here.
//!
//! Handles are device addresses. Every kernel writes into the buffer of its site, as llm.c's
//! activation struct: the forward into the unit's [`BlockActs`] (the last product into the block's
//! output, the next block's input), the backward into the stage's [`Scratch`]; the sums of the
//! residuals reuse the branch's (forward) or the incoming gradient's (backward) buffer. Nothing is
//! allocated or synchronized beyond what the kernels themselves do, and nothing copied but what a
//! split backward keeps (below).
//!
//! The backward kernels are the halves ([`model::block_backward_input`],
//! [`model::block_backward_weight`]): a linear layer's `dx` product and its `dW` product with the
//! bias's column sum, a norm's `dx` and its parameters' reductions, the GELU's backward and its
//! bias's column sum. In a whole backward each weight half follows its input half at once and
//! reads the output gradient where the input half saw it (in the scratch; on the BF16 fast path
//! still rounded in the operand buffer), so its kernels are a whole backward's. In a split backward
//! ([`Part::split`]) the scratch is reused before the weight half runs, so the input half keeps each
//! output gradient in an activation of the unit it has spent by then, and the weight half reads it
//! there (rounding it again on the BF16 fast path: the same bits):
//!
//! | weight half of | reads its output gradient from | kept there by |
//! |---|---|---|
//! | `mlp.c_proj` | `x1` (spent once `ln_2`'s input half ran) | the MLP residual's backward |
//! | `mlp.c_fc` and its bias | `u` (spent once the GELU's backward read it) | the GELU's input half |
//! | `attn.c_proj` | `x` (spent once `ln_1`'s input half ran) | the attention residual's backward |
//! | `attn.c_attn` | `qkv` (spent once the attention's backward read it) | the attention's backward |
//!
//! A norm's parameter gradients reduce over its input, which a split backward's input half
//! overwrites (the table), so its input half computes them: into the accumulator in a whole
//! backward, into the norm's own buffer in a split one, which the weight half adds to the
//! accumulator (the same addition). The sums and their
//! order are a whole backward's, so a split backward's gradients are bit-identical to it.

use model::params::{BlockLayer, bias, block_layer, weight};
use model::{BlockDevice, ModelError, Residual};
use ops::DocumentMask;

use super::part::Part;
use super::{BlockActs, GpuStage, NormActs, NormGrads, Scratch, UnitShape, order};
use crate::device::Buf;
use crate::error::{GpuError, Result};
use crate::kernels::DocStarts;
use crate::profile::Pass;

/// What a block's backward adds to and works in.
#[derive(Clone, Copy)]
pub(super) struct BlockGrads<'s> {
    /// Which backward runs (its accumulator, whether it is split).
    pub part: Part<'s>,
    /// The stage's backward scratch.
    pub scratch: &'s Scratch,
    /// The micro-batch's dK/dV accumulators of this block, `(B, T, C)` each.
    pub dk: &'s Buf<f32>,
    pub dv: &'s Buf<f32>,
}

/// Block `layer` of `stage` for one unit of `rows`.
pub(super) struct GpuBlock<'s> {
    pub stage: &'s GpuStage,
    /// The unit's saved activations of this block.
    pub acts: &'s BlockActs,
    /// Where the forward's output goes (the next block's input, or the unit's output).
    pub out: u64,
    /// The micro-batch's QKV cache of this block, `(B, T, 3C)`.
    pub cache: &'s Buf<f32>,
    pub layer: usize,
    pub rows: UnitShape,
    /// The micro-batch's document starts on the device, when its attention is masked.
    pub docs: Option<DocStarts>,
    /// The backward's buffers (none in the forward).
    pub grads: Option<BlockGrads<'s>>,
    /// In a whole backward, the output gradient of the last input half, for the weight half that
    /// follows it.
    pub pending: Option<(Site, u64)>,
}

/// A piece of a block whose weight half reads the output gradient its input half saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Site {
    /// A linear layer (its `dy`).
    Linear(BlockLayer),
    /// The MLP's bias, joined with the GELU (the GELU's input gradient).
    FcBias,
}

impl<'s> GpuBlock<'s> {
    fn n(&self) -> usize {
        self.rows.b * self.rows.len
    }

    fn prefix(&self, layer: BlockLayer) -> String {
        block_layer(self.layer, layer)
    }

    fn backward(&self, layer: BlockLayer) -> Result<&BlockGrads<'s>> {
        self.grads.as_ref().ok_or_else(|| {
            GpuError::from(ModelError::NotSaved {
                layer: format!(
                    "{} (a backward with no gradient buffer)",
                    self.prefix(layer)
                ),
            })
        })
    }

    /// `(in, out)` widths of linear `layer`.
    fn dims(&self, layer: BlockLayer) -> Result<(usize, usize)> {
        layer.linear_dims(&self.stage.plan.model).ok_or_else(|| {
            GpuError::from(ModelError::NotSaved {
                layer: format!("{} (a norm, not a linear layer)", self.prefix(layer)),
            })
        })
    }

    /// Norm `layer`'s input and saved activations.
    fn norm_site(&self, layer: BlockLayer) -> Result<(u64, &'s NormActs)> {
        let a = self.acts;
        match layer {
            BlockLayer::Ln1 => Ok((a.x.ptr(), &a.ln1)),
            BlockLayer::Ln2 => Ok((a.x1.ptr(), &a.ln2)),
            _ => Err(GpuError::from(ModelError::NotSaved {
                layer: format!("{} (a linear layer, not a norm)", self.prefix(layer)),
            })),
        }
    }

    /// c_attn's input half with `dqkv` as three `(N, C)` planes: `dx` = d(ln_1) = the sum of the
    /// three `dy_i W_i` (weight rows `[iC, (i+1)C)`), added in plane order. On the BF16 fast path
    /// the planes are rounded at once into the first operand buffer.
    fn c_attn_backward_input(&self, dx: u64, dqkv: u64) -> Result<()> {
        let stage = self.stage;
        let (c, n, gpu) = (stage.plan.model.d_model, self.n(), &stage.gpu);
        let c_attn = self.prefix(BlockLayer::CAttn);
        let w = stage.at(&stage.values, &weight(&c_attn));
        let fast = match &stage.bf16 {
            Some(w16) => {
                let (dy16, _) = w16.operands()?;
                gpu.to_bf16(dy16, dqkv, 3 * n * c)?;
                Some((w16.weight(&weight(&c_attn))?, dy16))
            }
            None => None,
        };
        gpu.label_products(&c_attn, Pass::Dx);
        for i in 0..3 {
            let beta = if i == 0 { 0.0 } else { 1.0 };
            match fast {
                Some((w16, dy16)) => {
                    let (dy16_i, w16_i) =
                        (dy16 + (i * n * c * 2) as u64, w16 + (i * c * c * 2) as u64);
                    let t = (false, false);
                    gpu.gemm_bf16(dx, dy16_i, w16_i, (n, c, c), t, (c, c), beta)?;
                }
                None => {
                    let (dy_i, w_i) = (dqkv + (i * n * c * 4) as u64, w + (i * c * c * 4) as u64);
                    gpu.gemm(dx, dy_i, w_i, (n, c, c), false, false, beta)?;
                }
            }
        }
        Ok(())
    }

    /// c_attn's weight half with `dqkv` as three `(N, C)` planes: weight rows `[iC, (i+1)C)` and
    /// the bias thirds get one product and one column sum each, added to `acc`; `sc` is
    /// column-sum scratch. `rounded`: on the BF16 fast path the planes' rounding is still in the
    /// first operand buffer (the input half just ran); otherwise they are rounded again.
    fn c_attn_backward_weight(
        &self,
        dqkv: u64,
        (acc, sc): (u64, &Buf<f32>),
        rounded: bool,
    ) -> Result<()> {
        let stage = self.stage;
        let (c, n, gpu) = (stage.plan.model.d_model, self.n(), &stage.gpu);
        let c_attn = self.prefix(BlockLayer::CAttn);
        let dw = stage.grad_at(acc, &weight(&c_attn));
        let db = stage.grad_at(acc, &bias(&c_attn));
        let ln1 = self.acts.ln1.out.ptr();
        // The BF16 fast path: ln1 rounded once for the three products.
        let fast = match &stage.bf16 {
            Some(w16) => {
                let (dy16, ln1_16) = w16.operands()?;
                if !rounded {
                    gpu.to_bf16(dy16, dqkv, 3 * n * c)?;
                }
                gpu.to_bf16(ln1_16, ln1, n * c)?;
                Some((dy16, ln1_16))
            }
            None => None,
        };
        gpu.label_products(&c_attn, Pass::Dw);
        for i in 0..3 {
            let (dy_i, dw_i) = (dqkv + (i * n * c * 4) as u64, dw + (i * c * c * 4) as u64);
            match fast {
                Some((dy16, ln1_16)) => {
                    let dy16_i = dy16 + (i * n * c * 2) as u64;
                    let t = (true, false);
                    gpu.gemm_bf16(dw_i, dy16_i, ln1_16, (c, c, n), t, (c, c), 1.0)?;
                }
                None => gpu.gemm(dw_i, dy_i, ln1, (c, c, n), true, false, 1.0)?,
            }
            gpu.column_sum(db + (i * c * 4) as u64, dy_i, n, c, true, sc)?;
        }
        Ok(())
    }

    /// Where the weight half of `site` reads its output gradient, and whether the BF16 fast path's
    /// rounding of it is still in the operand buffer: in a whole backward, what the input half
    /// that just ran saw; in a split one, the unit's activation the input half kept it in (the
    /// module's table).
    fn weight_dy(&mut self, site: Site, part: Part) -> Result<(u64, bool)> {
        let a = self.acts;
        if part.split() {
            let dy = match site {
                Site::Linear(BlockLayer::MlpProj) => a.x1.ptr(),
                Site::Linear(BlockLayer::CFc) | Site::FcBias => a.u.ptr(),
                Site::Linear(BlockLayer::AttnProj) => a.x.ptr(),
                Site::Linear(BlockLayer::CAttn) => a.qkv.ptr(),
                Site::Linear(layer) => {
                    return Err(GpuError::from(ModelError::NotSaved {
                        layer: format!("{} (a norm, not a linear layer)", self.prefix(layer)),
                    }));
                }
            };
            return Ok((dy, false));
        }
        match self.pending.take() {
            Some((seen, dy)) if seen == site => Ok((dy, true)),
            _ => Err(order(
                "GpuStage::backward",
                format!(
                    "h.{}: the weight half of {site:?} without its input half just before it (a \
                     whole backward runs each piece's halves back to back)",
                    self.layer
                ),
            )),
        }
    }

    /// In a split backward's input half: copies `len` values of the output gradient at `src`
    /// into the spent activation `dst`, where the weight half reads them (nothing in a whole
    /// backward).
    fn keep(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        match &self.grads {
            Some(g) if g.part.split() => self.stage.gpu.copy_values(dst, src, len),
            _ => Ok(()),
        }
    }
}

impl BlockDevice for GpuBlock<'_> {
    type X = u64;
    type Err = GpuError;

    fn norm_forward(&mut self, layer: BlockLayer, x: &u64) -> Result<u64> {
        let (_, acts) = self.norm_site(layer)?;
        self.stage
            .norm_forward(acts, *x, &self.prefix(layer), self.n())?;
        Ok(acts.out.ptr())
    }

    fn linear_forward(&mut self, layer: BlockLayer, x: &u64, with_bias: bool) -> Result<u64> {
        let a = self.acts;
        let y = match layer {
            BlockLayer::CAttn => a.qkv.ptr(),
            BlockLayer::AttnProj => a.x1.ptr(),
            BlockLayer::CFc => a.u.ptr(),
            _ => self.out,
        };
        let (d_in, d_out) = self.dims(layer)?;
        let name = self.prefix(layer);
        self.stage
            .linear_forward(y, *x, &name, (self.n(), d_in, d_out), with_bias)?;
        Ok(y)
    }

    fn attention_forward(&mut self, qkv: &u64, docs: Option<&DocumentMask>) -> Result<u64> {
        let doc_starts = self.doc_starts(docs)?;
        let (stage, a, cache) = (self.stage, self.acts, self.cache);
        let UnitShape { b, start, len } = self.rows;
        let c = stage.plan.model.d_model;
        // The segment's QKV rows join the micro-batch's cache of whole sequences first.
        let gpu = &stage.gpu;
        gpu.copy_rows(
            cache.ptr(),
            (stage.seq, start),
            *qkv,
            (len, 0),
            b,
            len,
            3 * c,
        )?;
        let (sh, scale) = (stage.attn_shape(b, start, len), stage.attn_scale());
        let (y, lse) = (a.y.ptr(), a.lse.ptr());
        let (k, v) = (cache.at(c), cache.at(2 * c));
        gpu.attention_forward(y, lse, *qkv, k, v, doc_starts, sh, scale)?;
        Ok(y)
    }

    fn bias_gelu_forward(&mut self, f: &u64) -> Result<u64> {
        let stage = self.stage;
        let width = stage.plan.model.ffn();
        let fc_bias = stage.at(&stage.values, &bias(&self.prefix(BlockLayer::CFc)));
        let g = self.acts.g.ptr();
        stage
            .gpu
            .bias_gelu_forward(g, *f, fc_bias, self.n(), width)?;
        Ok(g)
    }

    fn residual_forward(&mut self, _: Residual, x: &u64, branch: u64) -> Result<u64> {
        let c = self.stage.plan.model.d_model;
        self.stage.gpu.add_assign(branch, *x, self.n() * c)?;
        Ok(branch)
    }

    fn linear_backward_input(&mut self, layer: BlockLayer, dy: &u64, _: bool) -> Result<u64> {
        let s = self.backward(layer)?.scratch;
        let dx = match layer {
            BlockLayer::MlpProj => s.dff.ptr(),
            _ => s.dln.ptr(),
        };
        if layer == BlockLayer::CAttn {
            self.c_attn_backward_input(dx, *dy)?;
        } else {
            let (d_in, d_out) = self.dims(layer)?;
            let dims = (self.n(), d_in, d_out);
            let name = self.prefix(layer);
            self.stage.linear_backward_input(dx, *dy, &name, dims)?;
        }
        self.pending = Some((Site::Linear(layer), *dy));
        Ok(dx)
    }

    fn linear_backward_weight(&mut self, layer: BlockLayer, with_bias: bool) -> Result<()> {
        let g = *self.backward(layer)?;
        let (dy, rounded) = self.weight_dy(Site::Linear(layer), g.part)?;
        let into = (g.part.acc()?, &g.scratch.columns);
        if layer == BlockLayer::CAttn {
            return self.c_attn_backward_weight(dy, into, rounded);
        }
        let a = self.acts;
        let x = match layer {
            BlockLayer::MlpProj => a.g.ptr(),
            BlockLayer::CFc => a.ln2.out.ptr(),
            _ => a.y.ptr(),
        };
        let (d_in, d_out) = self.dims(layer)?;
        let dims = (self.n(), d_in, d_out);
        let name = self.prefix(layer);
        self.stage
            .linear_backward_weight(dy, x, &name, dims, with_bias, into, rounded)
    }

    fn bias_gelu_backward_input(&mut self, dg: &u64) -> Result<u64> {
        let g = *self.backward(BlockLayer::CFc)?;
        let (f, n) = (self.stage.plan.model.ffn(), self.n());
        let (df, u) = (g.scratch.dff.ptr(), self.acts.u.ptr());
        self.stage.gpu.gelu_backward(df, *dg, u, n * f)?;
        // u is spent: the GELU's backward read it.
        self.keep(u, df, n * f)?;
        self.pending = Some((Site::FcBias, df));
        Ok(df)
    }

    fn bias_gelu_backward_weight(&mut self) -> Result<()> {
        let g = *self.backward(BlockLayer::CFc)?;
        let (df, _) = self.weight_dy(Site::FcBias, g.part)?;
        let stage = self.stage;
        let (f, n) = (stage.plan.model.ffn(), self.n());
        let db = stage.grad_at(g.part.acc()?, &bias(&self.prefix(BlockLayer::CFc)));
        stage.gpu.column_sum(db, df, n, f, true, &g.scratch.columns)
    }

    fn attention_backward(&mut self, dy: &u64, docs: Option<&DocumentMask>) -> Result<u64> {
        let doc_starts = self.doc_starts(docs)?;
        let g = self.backward(BlockLayer::CAttn)?;
        let (stage, a, cache) = (self.stage, self.acts, self.cache);
        let UnitShape { b, start, len } = self.rows;
        let (c, n, gpu) = (stage.plan.model.d_model, self.n(), &stage.gpu);
        let dqkv = &g.scratch.dqkv;
        // dQ into the first plane of dqkv; dK/dV added to the accumulators, then this segment's
        // rows of them gathered into the second and third planes.
        let (q, k, v) = (a.qkv.ptr(), cache.at(c), cache.at(2 * c));
        let (sh, scale) = (stage.attn_shape(b, start, len), stage.attn_scale());
        let (y, lse, delta) = (a.y.ptr(), a.lse.ptr(), g.scratch.delta.ptr());
        gpu.attention_backward(
            dqkv.ptr(),
            g.dk.ptr(),
            g.dv.ptr(),
            q,
            k,
            v,
            y,
            *dy,
            lse,
            delta,
            doc_starts,
            sh,
            scale,
            true,
        )?;
        for (plane, acc_kv) in [(1, g.dk), (2, g.dv)] {
            let dst = dqkv.at(plane * n * c);
            gpu.copy_rows(dst, (len, 0), acc_kv.ptr(), (stage.seq, start), b, len, c)?;
        }
        // The unit's QKV rows are spent: the attention's backward read its queries (the keys and
        // values live on in the micro-batch's cache).
        self.keep(a.qkv.ptr(), dqkv.ptr(), 3 * n * c)?;
        Ok(dqkv.ptr())
    }

    fn norm_backward_input(&mut self, layer: BlockLayer, dy: &u64) -> Result<u64> {
        let g = *self.backward(layer)?;
        let (x, acts) = self.norm_site(layer)?;
        let dx = g.scratch.dtmp.ptr();
        let name = self.prefix(layer);
        let to = match g.part.split() {
            true => NormGrads::Keep,
            false => NormGrads::Accumulate(g.part.acc()?),
        };
        let rows = (self.n(), &g.scratch.columns);
        self.stage
            .norm_backward_input(dx, *dy, x, acts, &name, rows, to)?;
        Ok(dx)
    }

    fn norm_backward_weight(&mut self, layer: BlockLayer) -> Result<()> {
        let g = *self.backward(layer)?;
        // A whole backward's input half added the parameter gradients already.
        if g.part.split() {
            let (_, acts) = self.norm_site(layer)?;
            let name = self.prefix(layer);
            self.stage
                .norm_backward_weight(acts, &name, g.part.acc()?)?;
        }
        Ok(())
    }

    fn residual_backward(&mut self, at: Residual, dy: u64, d_branch: u64) -> Result<u64> {
        let (c, a) = (self.stage.plan.model.d_model, self.acts);
        // The sum overwrites the incoming gradient, a linear layer's output gradient: a split
        // backward keeps it first, in the input of the branch's norm (its input half ran).
        let keep_in = match at {
            Residual::Mlp => a.x1.ptr(),
            Residual::Attn => a.x.ptr(),
        };
        self.keep(keep_in, dy, self.n() * c)?;
        self.stage.gpu.add_assign(dy, d_branch, self.n() * c)?;
        Ok(dy)
    }
}

impl GpuBlock<'_> {
    /// The device copy of `docs`, the mask the model hands the attention: the stage uploaded it
    /// with the micro-batch's starts ([`GpuStage::set_documents`]), so the two come together.
    fn doc_starts(&self, docs: Option<&DocumentMask>) -> Result<Option<DocStarts>> {
        match (docs, self.docs) {
            (None, _) => Ok(None),
            (Some(_), Some(d)) => Ok(Some(d)),
            (Some(_), None) => Err(GpuError::from(ModelError::NotSaved {
                layer: format!(
                    "{} (a document mask with no document starts on the device)",
                    self.prefix(BlockLayer::CAttn)
                ),
            })),
        }
    }
}
