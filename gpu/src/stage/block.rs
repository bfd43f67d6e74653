//! The CUDA device of one transformer block for one unit: [`model::BlockDevice`] over the stage's
//! preallocated buffers, so the block's order of operations is the `model` crate's
//! ([`model::block_forward`], [`model::block_backward`]) and only where each result lives is
//! written here.
//!
//! Handles are device addresses. Every kernel writes into the buffer of its site, as llm.c's
//! activation struct: the forward into the unit's [`BlockActs`] (the last product into the block's
//! output, the next block's input), the backward into the stage's [`Scratch`]; the sums of the
//! residuals reuse the branch's (forward) or the incoming gradient's (backward) buffer. Nothing is
//! allocated, copied or synchronized beyond what the kernels themselves do.

use model::params::{BlockLayer, bias, block_layer, weight};
use model::{BlockDevice, ModelError, Residual};
use ops::DocumentMask;

use super::{BlockActs, GpuStage, NormActs, Scratch, UnitShape};
use crate::device::Buf;
use crate::error::{GpuError, Result};
use crate::kernels::DocStarts;
use crate::profile::Pass;

/// What a block's backward adds to and works in.
pub(super) struct BlockGrads<'s> {
    /// The micro-batch's flat gradient buffer.
    pub acc: u64,
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

    /// c_attn's backward with `dqkv` as three `(N, C)` planes: weight rows `[iC, (i+1)C)` and the
    /// bias thirds get one product each; `dx` = d(ln_1) = the sum of the three `dy_i W_i`.
    fn c_attn_backward(&self, dx: u64, dqkv: u64, g: &BlockGrads) -> Result<()> {
        let stage = self.stage;
        let (c, n, gpu) = (stage.plan.model.d_model, self.n(), &stage.gpu);
        let (acc, sc) = (g.acc, &g.scratch.columns);
        let c_attn = self.prefix(BlockLayer::CAttn);
        let w = stage.at(&stage.values, &weight(&c_attn));
        let dw = stage.grad_at(acc, &weight(&c_attn));
        let db = stage.grad_at(acc, &bias(&c_attn));
        let ln1 = self.acts.ln1.out.ptr();
        // The BF16 fast path: the weight's copy, and ln1 rounded once for the three products.
        let fast = match &stage.bf16 {
            Some(w16) => {
                let (dy16, ln1_16) = w16.operands()?;
                gpu.to_bf16(ln1_16, ln1, n * c)?;
                Some((w16.weight(&weight(&c_attn))?, dy16, ln1_16))
            }
            None => None,
        };
        for i in 0..3 {
            let dy = dqkv + (i * n * c * 4) as u64;
            let (w_i, dw_i) = (w + (i * c * c * 4) as u64, dw + (i * c * c * 4) as u64);
            let beta = if i == 0 { 0.0 } else { 1.0 };
            match fast {
                Some((w16, dy16, ln1_16)) => {
                    let w16_i = w16 + (i * c * c * 2) as u64;
                    gpu.to_bf16(dy16, dy, n * c)?;
                    let t = (false, false);
                    gpu.label_products(&c_attn, Pass::Dx);
                    gpu.gemm_bf16(dx, dy16, w16_i, (n, c, c), t, (c, c), beta)?;
                    let t = (true, false);
                    gpu.label_pass(Pass::Dw);
                    gpu.gemm_bf16(dw_i, dy16, ln1_16, (c, c, n), t, (c, c), 1.0)?;
                }
                None => {
                    gpu.label_products(&c_attn, Pass::Dx);
                    gpu.gemm(dx, dy, w_i, (n, c, c), false, false, beta)?;
                    gpu.label_pass(Pass::Dw);
                    gpu.gemm(dw_i, dy, ln1, (c, c, n), true, false, 1.0)?;
                }
            }
            gpu.column_sum(db + (i * c * 4) as u64, dy, n, c, true, sc)?;
        }
        Ok(())
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

    fn linear_backward(&mut self, layer: BlockLayer, dy: &u64, with_bias: bool) -> Result<u64> {
        let g = self.backward(layer)?;
        let (a, s) = (self.acts, g.scratch);
        let dx = match layer {
            BlockLayer::MlpProj => s.dff.ptr(),
            _ => s.dln.ptr(),
        };
        if layer == BlockLayer::CAttn {
            self.c_attn_backward(dx, *dy, g)?;
            return Ok(dx);
        }
        let x = match layer {
            BlockLayer::MlpProj => a.g.ptr(),
            BlockLayer::CFc => a.ln2.out.ptr(),
            _ => a.y.ptr(),
        };
        let dims = self.dims(layer)?;
        let name = self.prefix(layer);
        self.stage.linear_backward(
            dx,
            *dy,
            x,
            &name,
            (self.n(), dims.0, dims.1),
            with_bias,
            (g.acc, &s.columns),
        )?;
        Ok(dx)
    }

    fn bias_gelu_backward(&mut self, dg: &u64) -> Result<u64> {
        let g = self.backward(BlockLayer::CFc)?;
        let stage = self.stage;
        let (f, n, gpu) = (stage.plan.model.ffn(), self.n(), &stage.gpu);
        let df = g.scratch.dff.ptr();
        gpu.gelu_backward(df, *dg, self.acts.u.ptr(), n * f)?;
        let db = stage.grad_at(g.acc, &bias(&self.prefix(BlockLayer::CFc)));
        gpu.column_sum(db, df, n, f, true, &g.scratch.columns)?;
        Ok(df)
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
        Ok(dqkv.ptr())
    }

    fn norm_backward(&mut self, layer: BlockLayer, dy: &u64) -> Result<u64> {
        let g = self.backward(layer)?;
        let (x, acts) = self.norm_site(layer)?;
        let dx = g.scratch.dtmp.ptr();
        let name = self.prefix(layer);
        let sc = &g.scratch.columns;
        self.stage
            .norm_backward(dx, *dy, x, acts, &name, (self.n(), g.acc, sc))?;
        Ok(dx)
    }

    fn residual_backward(&mut self, _: Residual, dy: u64, d_branch: u64) -> Result<u64> {
        let c = self.stage.plan.model.d_model;
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
