//! One transformer block (pre-norm attention + MLP) as an explicit forward/backward pair over one
//! sequence segment, with the K/V prefix of the earlier segments of the same micro-batch: the CPU
//! device ([`BlockDevice`] over `ops`, the oracle) of the block the `model` crate writes once.
//! Its backward kernels are the split halves ([`::model::block_backward_input`] and
//! [`::model::block_backward_weight`]); a whole backward is each layer's halves back to back.

use candle_core::Tensor;
use ops::DocumentMask;
use ops::attention::{
    AttentionCtx, causal_prefix_attention_backward, causal_prefix_attention_forward,
    document_prefix_attention_backward, document_prefix_attention_forward,
};
use ops::gelu::{GeluCtx, gelu_backward, gelu_forward};
use ops::linear::{LinearCtx, linear_backward_input, linear_backward_weight, linear_forward};
use ops::memory::SavedTensors;
use ops::rope::RopeTable;

use super::config::ModelConfig;
use super::error::ModelError;
use super::norm::{NormLayer, NormLayerCtx, NormParamGrads};
use super::params::{BlockLayer, Gradients, Params, bias, block_layer, weight};
use ::model::{BlockDevice, Residual};

/// Shape of one segment of one micro-batch.
#[derive(Clone, Copy, Debug)]
pub struct SegmentShape {
    /// Rows of the micro-batch (B).
    pub batch: usize,
    /// First position of the segment in the sequence (P, the prefix length).
    pub start: usize,
    /// Segment length (s).
    pub len: usize,
}

impl SegmentShape {
    /// Tokens in the segment (N = B·s).
    pub fn tokens(&self) -> usize {
        self.batch * self.len
    }
}

/// The K/V of the segments already run for one micro-batch at one layer, and the dK/dV that later
/// segments' backward left for them.
#[derive(Default)]
pub struct KvPrefix {
    /// Keys per segment, `(B, H, s_j, D)` (after RoPE when enabled).
    keys: Vec<Tensor>,
    /// Values per segment, `(B, H, s_j, D)`.
    values: Vec<Tensor>,
    /// Accumulated dK per earlier segment, `(B, H, s_j, D)`.
    d_keys: Vec<Option<Tensor>>,
    /// Accumulated dV per earlier segment.
    d_values: Vec<Option<Tensor>>,
}

impl KvPrefix {
    fn concat(parts: &[Tensor]) -> candle_core::Result<Tensor> {
        if parts.len() == 1 {
            Ok(parts[0].clone())
        } else {
            Tensor::cat(parts, 2)
        }
    }

    /// Number of key positions held.
    pub fn len(&self) -> usize {
        self.keys.iter().map(|k| k.dim(2).unwrap_or(0)).sum()
    }

    /// Whether no segment has been stored.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

impl SavedTensors for KvPrefix {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.keys.for_each_tensor(f);
        self.values.for_each_tensor(f);
        self.d_keys.for_each_tensor(f);
        self.d_values.for_each_tensor(f);
    }
}

/// Activations a block's backward needs for one segment, filled by its forward and taken by its
/// backward (one per kernel of [`::model::block_forward`]). The input half of the backward takes
/// the norms', attention's and GELU's contexts and leaves what the weight half reads: each
/// linear layer's input (its context) and output gradient, the norms' and the MLP bias's
/// gradients.
#[derive(Default)]
pub struct BlockCtx {
    ln_1: Option<NormLayerCtx>,
    c_attn: Option<LinearCtx>,
    attn: Option<AttentionCtx>,
    attn_proj: Option<LinearCtx>,
    ln_2: Option<NormLayerCtx>,
    c_fc: Option<LinearCtx>,
    gelu: Option<GeluCtx>,
    mlp_proj: Option<LinearCtx>,
    /// Between the two halves of the backward.
    weight: WeightHalf,
}

/// What a block's input half leaves for its weight half.
#[derive(Default)]
struct WeightHalf {
    /// Output gradients of the linear layers: `(N, 3C)`, `(N, C)`, `(N, F)`, `(N, C)`.
    c_attn_dy: Option<Tensor>,
    attn_proj_dy: Option<Tensor>,
    c_fc_dy: Option<Tensor>,
    mlp_proj_dy: Option<Tensor>,
    /// The norms' parameter gradients, `(C,)` each.
    ln_1: Option<NormParamGrads>,
    ln_2: Option<NormParamGrads>,
    /// The MLP bias's gradient `(F,)` (`Some(None)`: the input half ran, and there is none).
    fc_bias: Option<Option<Tensor>>,
}

impl SavedTensors for BlockCtx {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.ln_1.for_each_tensor(f);
        self.c_attn.for_each_tensor(f);
        self.attn.for_each_tensor(f);
        self.attn_proj.for_each_tensor(f);
        self.ln_2.for_each_tensor(f);
        self.c_fc.for_each_tensor(f);
        self.gelu.for_each_tensor(f);
        self.mlp_proj.for_each_tensor(f);
        let w = &self.weight;
        w.c_attn_dy.for_each_tensor(f);
        w.attn_proj_dy.for_each_tensor(f);
        w.c_fc_dy.for_each_tensor(f);
        w.mlp_proj_dy.for_each_tensor(f);
        w.ln_1.for_each_tensor(f);
        w.ln_2.for_each_tensor(f);
        if let Some(b) = &w.fc_bias {
            b.for_each_tensor(f);
        }
    }
}

/// A transformer block's static description: its layer index and the model's shape.
pub struct Block<'a> {
    /// Block index `i` (its parameters are `h.{i}.…`).
    pub layer: usize,
    /// Heads H.
    pub heads: usize,
    /// Head width D.
    pub head_dim: usize,
    /// Norm kind and epsilon.
    pub norm: NormLayer,
    /// RoPE table when the model uses rotary positions.
    pub rope: Option<&'a RopeTable>,
}

impl<'a> Block<'a> {
    /// Block `layer` of a model shaped by `cfg`.
    pub fn new(cfg: &ModelConfig, layer: usize, rope: Option<&'a RopeTable>) -> Self {
        Self {
            layer,
            heads: cfg.heads,
            head_dim: cfg.head_dim(),
            norm: NormLayer::of(cfg),
            rope,
        }
    }

    /// `(N, C)` → `(B, H, s, D)`.
    fn split_heads(&self, x: &Tensor, seg: SegmentShape) -> candle_core::Result<Tensor> {
        x.reshape((seg.batch, seg.len, self.heads, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    }

    /// `(B, H, s, D)` → `(N, C)`.
    fn merge_heads(&self, x: &Tensor, seg: SegmentShape) -> candle_core::Result<Tensor> {
        x.transpose(1, 2)?
            .contiguous()?
            .reshape((seg.tokens(), self.heads * self.head_dim))
    }

    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }
}

/// The CPU device of one block for one unit: the `ops` kernels over candle tensors, saving into
/// the unit's [`BlockCtx`] and the micro-batch's [`KvPrefix`]. Its forward appends the segment's
/// K/V to the prefix; its backward (of the last segment in the prefix whose backward has not run)
/// adds the segment's dK/dV of earlier positions for the earlier segments and removes the
/// segment's K/V (no later segment needs them any more).
pub(super) struct CpuBlock<'b> {
    block: Block<'b>,
    params: &'b Params,
    seg: SegmentShape,
    kv: &'b mut KvPrefix,
    ctx: &'b mut BlockCtx,
    /// Where the backward adds parameter gradients (none in the forward).
    grads: Option<&'b mut Gradients>,
}

impl<'b> CpuBlock<'b> {
    /// `block` for the unit of `seg`, over the micro-batch's `kv` and the unit's `ctx`, adding
    /// gradients to `grads` (the backward's).
    pub fn new(
        block: Block<'b>,
        params: &'b Params,
        seg: SegmentShape,
        kv: &'b mut KvPrefix,
        ctx: &'b mut BlockCtx,
        grads: Option<&'b mut Gradients>,
    ) -> Self {
        CpuBlock {
            block,
            params,
            seg,
            kv,
            ctx,
            grads,
        }
    }

    /// `h.{i}.{layer}`.
    fn prefix(&self, layer: BlockLayer) -> String {
        block_layer(self.block.layer, layer)
    }

    /// The saved context of linear `layer`.
    fn linear_ctx(&mut self, layer: BlockLayer) -> Result<&mut Option<LinearCtx>, ModelError> {
        match layer {
            BlockLayer::CAttn => Ok(&mut self.ctx.c_attn),
            BlockLayer::AttnProj => Ok(&mut self.ctx.attn_proj),
            BlockLayer::CFc => Ok(&mut self.ctx.c_fc),
            BlockLayer::MlpProj => Ok(&mut self.ctx.mlp_proj),
            BlockLayer::Ln1 | BlockLayer::Ln2 => Err(ModelError::NotSaved {
                layer: format!("{} (a norm, not a linear layer)", self.prefix(layer)),
            }),
        }
    }

    /// Where linear `layer`'s output gradient waits for the weight half.
    fn linear_dy(&mut self, layer: BlockLayer) -> Result<&mut Option<Tensor>, ModelError> {
        match layer {
            BlockLayer::CAttn => Ok(&mut self.ctx.weight.c_attn_dy),
            BlockLayer::AttnProj => Ok(&mut self.ctx.weight.attn_proj_dy),
            BlockLayer::CFc => Ok(&mut self.ctx.weight.c_fc_dy),
            BlockLayer::MlpProj => Ok(&mut self.ctx.weight.mlp_proj_dy),
            BlockLayer::Ln1 | BlockLayer::Ln2 => Err(ModelError::NotSaved {
                layer: format!("{} (a norm, not a linear layer)", self.prefix(layer)),
            }),
        }
    }

    /// Where norm `layer`'s parameter gradients wait for the weight half.
    fn norm_grads(&mut self, layer: BlockLayer) -> Result<&mut Option<NormParamGrads>, ModelError> {
        match layer {
            BlockLayer::Ln1 => Ok(&mut self.ctx.weight.ln_1),
            BlockLayer::Ln2 => Ok(&mut self.ctx.weight.ln_2),
            _ => Err(ModelError::NotSaved {
                layer: format!("{} (a linear layer, not a norm)", self.prefix(layer)),
            }),
        }
    }

    /// The saved context of norm `layer`.
    fn norm_ctx(&mut self, layer: BlockLayer) -> Result<&mut Option<NormLayerCtx>, ModelError> {
        match layer {
            BlockLayer::Ln1 => Ok(&mut self.ctx.ln_1),
            BlockLayer::Ln2 => Ok(&mut self.ctx.ln_2),
            _ => Err(ModelError::NotSaved {
                layer: format!("{} (a linear layer, not a norm)", self.prefix(layer)),
            }),
        }
    }

    /// The gradient accumulator (the backward's).
    fn grads(&mut self, layer: &str) -> Result<&mut Gradients, ModelError> {
        self.grads
            .as_deref_mut()
            .ok_or_else(|| ModelError::NotSaved {
                layer: format!("{layer} (a backward without a gradient accumulator)"),
            })
    }
}

/// What a backward of `layer` needs from `slot`, or the error naming it.
fn saved<T>(slot: &mut Option<T>, layer: impl FnOnce() -> String) -> Result<T, ModelError> {
    slot.take()
        .ok_or_else(|| ModelError::NotSaved { layer: layer() })
}

impl BlockDevice for CpuBlock<'_> {
    type X = Tensor;
    type Err = ModelError;

    fn norm_forward(&mut self, layer: BlockLayer, x: &Tensor) -> Result<Tensor, ModelError> {
        let (y, ctx) = self
            .block
            .norm
            .forward(self.params, &self.prefix(layer), x)?;
        *self.norm_ctx(layer)? = Some(ctx);
        Ok(y)
    }

    fn linear_forward(
        &mut self,
        layer: BlockLayer,
        x: &Tensor,
        with_bias: bool,
    ) -> Result<Tensor, ModelError> {
        let prefix = self.prefix(layer);
        let w = self.params.get(&weight(&prefix))?;
        let b = with_bias
            .then(|| self.params.get(&bias(&prefix)))
            .transpose()?;
        let (y, ctx) = linear_forward(x, w, b)?;
        *self.linear_ctx(layer)? = Some(ctx);
        Ok(y)
    }

    fn attention_forward(
        &mut self,
        qkv: &Tensor,
        docs: Option<&DocumentMask>,
    ) -> Result<Tensor, ModelError> {
        let (block, seg) = (&self.block, self.seg);
        let c = block.heads * block.head_dim;
        let mut q = block.split_heads(&qkv.narrow(1, 0, c)?, seg)?; // (B, H, s, D)
        let mut k = block.split_heads(&qkv.narrow(1, c, c)?, seg)?;
        let v = block.split_heads(&qkv.narrow(1, 2 * c, c)?, seg)?;
        if let Some(rope) = block.rope {
            q = rope.forward(&q, seg.start)?;
            k = rope.forward(&k, seg.start)?;
        }
        self.kv.keys.push(k);
        self.kv.values.push(v);
        let k_all = KvPrefix::concat(&self.kv.keys)?; // (B, H, P+s, D)
        let v_all = KvPrefix::concat(&self.kv.values)?;
        let (y, attn) = match docs {
            // The whole prefix is kept (key_start 0): the kernel skips, per block of queries, the
            // keys before its first query's document.
            Some(docs) => {
                document_prefix_attention_forward(&q, &k_all, &v_all, block.scale(), docs, 0)?
            }
            None => causal_prefix_attention_forward(&q, &k_all, &v_all, block.scale())?,
        }; // (B, H, s, D)
        self.ctx.attn = Some(attn);
        Ok(block.merge_heads(&y, seg)?) // (N, C)
    }

    fn bias_gelu_forward(&mut self, f: &Tensor) -> Result<Tensor, ModelError> {
        let b = self.params.get(&bias(&self.prefix(BlockLayer::CFc)))?;
        let (g, ctx) = gelu_forward(f, Some(b))?;
        self.ctx.gelu = Some(ctx);
        Ok(g)
    }

    fn residual_forward(
        &mut self,
        _: Residual,
        x: &Tensor,
        branch: Tensor,
    ) -> Result<Tensor, ModelError> {
        Ok(x.add(&branch)?)
    }

    fn linear_backward_input(
        &mut self,
        layer: BlockLayer,
        dy: &Tensor,
        _with_bias: bool,
    ) -> Result<Tensor, ModelError> {
        let prefix = self.prefix(layer);
        let params = self.params;
        let w = params.get(&weight(&prefix))?;
        let ctx = self
            .linear_ctx(layer)?
            .as_ref()
            .ok_or_else(|| ModelError::NotSaved {
                layer: prefix.clone(),
            })?;
        let dx = linear_backward_input(ctx, w, dy)?;
        *self.linear_dy(layer)? = Some(dy.clone());
        Ok(dx)
    }

    fn linear_backward_weight(
        &mut self,
        layer: BlockLayer,
        with_bias: bool,
    ) -> Result<(), ModelError> {
        let prefix = self.prefix(layer);
        let ctx = saved(self.linear_ctx(layer)?, || prefix.clone())?;
        let dy = saved(self.linear_dy(layer)?, || {
            format!("{prefix} (its output gradient: the input half of the backward has not run)")
        })?;
        let g = linear_backward_weight(&ctx, &dy, with_bias)?;
        let grads = self.grads(&prefix)?;
        grads.add(&weight(&prefix), g.dw)?;
        if let Some(db) = g.db {
            grads.add(&bias(&prefix), db)?;
        }
        Ok(())
    }

    fn bias_gelu_backward_input(&mut self, dg: &Tensor) -> Result<Tensor, ModelError> {
        let prefix = self.prefix(BlockLayer::CFc);
        let ctx = saved(&mut self.ctx.gelu, || format!("{prefix} (GELU)"))?;
        let (df, d_fc_bias) = gelu_backward(&ctx, dg)?;
        self.ctx.weight.fc_bias = Some(d_fc_bias);
        Ok(df)
    }

    fn bias_gelu_backward_weight(&mut self) -> Result<(), ModelError> {
        let prefix = self.prefix(BlockLayer::CFc);
        let d_fc_bias = saved(&mut self.ctx.weight.fc_bias, || {
            format!("{prefix} (its bias gradient: the input half of the backward has not run)")
        })?;
        if let Some(db) = d_fc_bias {
            self.grads(&prefix)?.add(&bias(&prefix), db)?;
        }
        Ok(())
    }

    fn attention_backward(
        &mut self,
        dy: &Tensor,
        docs: Option<&DocumentMask>,
    ) -> Result<Tensor, ModelError> {
        let (block, seg) = (&self.block, self.seg);
        let ctx = saved(&mut self.ctx.attn, || {
            format!("h.{} attention", block.layer)
        })?;
        let kv = &mut *self.kv;
        let j = kv.keys.len() - 1;
        let d_y = block.split_heads(dy, seg)?; // (B, H, s, D)
        let k_all = KvPrefix::concat(&kv.keys)?;
        let v_all = KvPrefix::concat(&kv.values)?;
        let (mut dq, dk_all, dv_all) = match docs {
            Some(docs) => document_prefix_attention_backward(
                &ctx,
                &k_all,
                &v_all,
                &d_y,
                block.scale(),
                docs,
                0,
            )?,
            None => causal_prefix_attention_backward(&ctx, &k_all, &v_all, &d_y, block.scale())?,
        };
        drop((k_all, v_all));
        kv.d_keys.resize(j + 1, None);
        kv.d_values.resize(j + 1, None);
        let mut offset = 0;
        for i in 0..j {
            let len = kv.keys[i].dim(2)?;
            accumulate(&mut kv.d_keys[i], dk_all.narrow(2, offset, len)?)?;
            accumulate(&mut kv.d_values[i], dv_all.narrow(2, offset, len)?)?;
            offset += len;
        }
        let own = |acc: Option<Tensor>, all: &Tensor| -> candle_core::Result<Tensor> {
            let mine = all.narrow(2, offset, seg.len)?;
            match acc {
                Some(acc) => mine.add(&acc),
                None => mine.contiguous(),
            }
        };
        let mut dk = own(kv.d_keys.pop().flatten(), &dk_all)?;
        let dv = own(kv.d_values.pop().flatten(), &dv_all)?;
        kv.keys.pop();
        kv.values.pop();
        if let Some(rope) = block.rope {
            dq = rope.backward(&dq, seg.start)?;
            dk = rope.backward(&dk, seg.start)?;
        }
        Ok(Tensor::cat(
            &[
                block.merge_heads(&dq, seg)?,
                block.merge_heads(&dk, seg)?,
                block.merge_heads(&dv, seg)?,
            ],
            1,
        )?) // (N, 3C)
    }

    fn norm_backward_input(
        &mut self,
        layer: BlockLayer,
        dy: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let prefix = self.prefix(layer);
        let ctx = saved(self.norm_ctx(layer)?, || prefix.clone())?;
        let (dx, g) = self
            .block
            .norm
            .backward_input(self.params, &prefix, &ctx, dy)?;
        *self.norm_grads(layer)? = Some(g);
        Ok(dx)
    }

    fn norm_backward_weight(&mut self, layer: BlockLayer) -> Result<(), ModelError> {
        let prefix = self.prefix(layer);
        let g = saved(self.norm_grads(layer)?, || {
            format!("{prefix} (its gradients: the input half of the backward has not run)")
        })?;
        NormLayer::add_grads(&prefix, g, self.grads(&prefix)?)
    }

    fn residual_backward(
        &mut self,
        _: Residual,
        dy: Tensor,
        d_branch: Tensor,
    ) -> Result<Tensor, ModelError> {
        Ok(dy.add(&d_branch)?)
    }
}

/// `slot += g` (or `slot = g` the first time).
fn accumulate(slot: &mut Option<Tensor>, g: Tensor) -> candle_core::Result<()> {
    *slot = Some(match slot.take() {
        Some(acc) => acc.add(&g)?,
        None => g.contiguous()?,
    });
    Ok(())
}
