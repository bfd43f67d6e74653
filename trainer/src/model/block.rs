//! One transformer block (pre-norm attention + MLP) as an explicit forward/backward pair over one
//! sequence segment, with the K/V prefix of the earlier segments of the same micro-batch.

use candle_core::Tensor;
use ops::attention::{
    AttentionCtx, causal_prefix_attention_backward, causal_prefix_attention_forward,
};
use ops::gelu::{GeluCtx, gelu_backward, gelu_forward};
use ops::linear::{LinearCtx, linear_backward, linear_forward};
use ops::memory::SavedTensors;
use ops::rope::RopeTable;

use super::config::ModelConfig;
use super::error::ModelError;
use super::norm::{NormLayer, NormLayerCtx};
use super::params::{Gradients, Params};

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

/// Activations a block's backward needs for one segment.
pub struct BlockCtx {
    ln_1: NormLayerCtx,
    c_attn: LinearCtx,
    attn: AttentionCtx,
    attn_proj: LinearCtx,
    ln_2: NormLayerCtx,
    c_fc: LinearCtx,
    gelu: GeluCtx,
    mlp_proj: LinearCtx,
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
    }
}

/// A transformer block's static description: its name prefix and the model's shape.
pub struct Block<'a> {
    /// `h.{i}`.
    pub prefix: String,
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
            prefix: format!("h.{layer}"),
            heads: cfg.heads,
            head_dim: cfg.head_dim(),
            norm: NormLayer::of(cfg),
            rope,
        }
    }

    fn name(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.prefix)
    }

    /// `x W^T`, plus the layer's bias when `with_bias` (the MLP's first layer leaves its bias to
    /// the fused bias + GELU).
    fn linear_fwd(
        &self,
        params: &Params,
        layer: &str,
        x: &Tensor,
        with_bias: bool,
    ) -> Result<(Tensor, LinearCtx), ModelError> {
        let w = params.get(&self.name(&format!("{layer}.weight")))?;
        let b = with_bias
            .then(|| params.get(&self.name(&format!("{layer}.bias"))))
            .transpose()?;
        Ok(linear_forward(x, w, b)?)
    }

    /// Backward of [`Block::linear_fwd`] with the same `with_bias`.
    fn linear_bwd(
        &self,
        params: &Params,
        layer: &str,
        ctx: &LinearCtx,
        dy: &Tensor,
        with_bias: bool,
        grads: &mut Gradients,
    ) -> Result<Tensor, ModelError> {
        let w_name = self.name(&format!("{layer}.weight"));
        let (dx, g) = linear_backward(ctx, params.get(&w_name)?, dy, with_bias)?;
        grads.add(&w_name, g.dw)?;
        if let Some(db) = g.db {
            grads.add(&self.name(&format!("{layer}.bias")), db)?;
        }
        Ok(dx)
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

    /// Forward of one segment: `x (N, C)` → `(N, C)`. Appends this segment's K/V to `kv`.
    /// Returns the saved context when `keep_ctx` (training), none for evaluation.
    pub fn forward(
        &self,
        params: &Params,
        x: &Tensor,
        seg: SegmentShape,
        kv: &mut KvPrefix,
        keep_ctx: bool,
    ) -> Result<(Tensor, Option<BlockCtx>), ModelError> {
        let c = self.heads * self.head_dim;
        let (h1, ln_1) = self.norm.forward(params, &self.name("ln_1"), x)?; // (N, C)
        let (qkv, c_attn) = self.linear_fwd(params, "attn.c_attn", &h1, true)?; // (N, 3C)
        let mut q = self.split_heads(&qkv.narrow(1, 0, c)?, seg)?; // (B, H, s, D)
        let mut k = self.split_heads(&qkv.narrow(1, c, c)?, seg)?;
        let v = self.split_heads(&qkv.narrow(1, 2 * c, c)?, seg)?;
        if let Some(rope) = self.rope {
            q = rope.forward(&q, seg.start)?;
            k = rope.forward(&k, seg.start)?;
        }
        kv.keys.push(k);
        kv.values.push(v);
        let k_all = KvPrefix::concat(&kv.keys)?; // (B, H, P+s, D)
        let v_all = KvPrefix::concat(&kv.values)?;
        let (y, attn) = causal_prefix_attention_forward(&q, &k_all, &v_all, self.scale())?; // (B, H, s, D)
        let y = self.merge_heads(&y, seg)?; // (N, C)
        let (a, attn_proj) = self.linear_fwd(params, "attn.c_proj", &y, true)?;
        let x1 = x.add(&a)?;
        let (h2, ln_2) = self.norm.forward(params, &self.name("ln_2"), &x1)?;
        let (f, c_fc) = self.linear_fwd(params, "mlp.c_fc", &h2, false)?; // (N, 4C)
        let (g, gelu) = gelu_forward(&f, Some(params.get(&self.name("mlp.c_fc.bias"))?))?;
        let (m, mlp_proj) = self.linear_fwd(params, "mlp.c_proj", &g, true)?;
        let out = x1.add(&m)?;
        let ctx = keep_ctx.then_some(BlockCtx {
            ln_1,
            c_attn,
            attn,
            attn_proj,
            ln_2,
            c_fc,
            gelu,
            mlp_proj,
        });
        Ok((out, ctx))
    }

    /// Backward of segment `j` (the last segment in `kv` whose backward has not run): `dy (N, C)` → `dx (N, C)`.
    /// Adds this segment's dK/dV of earlier positions to `kv` for the earlier segments, and removes
    /// segment `j`'s K/V (no later segment needs them any more).
    pub fn backward(
        &self,
        params: &Params,
        ctx: BlockCtx,
        dy: &Tensor,
        seg: SegmentShape,
        kv: &mut KvPrefix,
        grads: &mut Gradients,
    ) -> Result<Tensor, ModelError> {
        let j = kv.keys.len() - 1;
        // MLP branch.
        let dg = self.linear_bwd(params, "mlp.c_proj", &ctx.mlp_proj, dy, true, grads)?;
        let (df, d_fc_bias) = gelu_backward(&ctx.gelu, &dg)?;
        if let Some(db) = d_fc_bias {
            grads.add(&self.name("mlp.c_fc.bias"), db)?;
        }
        let dh2 = self.linear_bwd(params, "mlp.c_fc", &ctx.c_fc, &df, false, grads)?;
        let dx1 =
            dy.add(
                &self
                    .norm
                    .backward(params, &self.name("ln_2"), &ctx.ln_2, &dh2, grads)?,
            )?;
        // Attention branch.
        let d_y = self.linear_bwd(params, "attn.c_proj", &ctx.attn_proj, &dx1, true, grads)?;
        let d_y = self.split_heads(&d_y, seg)?; // (B, H, s, D)
        let k_all = KvPrefix::concat(&kv.keys)?;
        let v_all = KvPrefix::concat(&kv.values)?;
        let (mut dq, dk_all, dv_all) =
            causal_prefix_attention_backward(&ctx.attn, &k_all, &v_all, &d_y, self.scale())?;
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
        if let Some(rope) = self.rope {
            dq = rope.backward(&dq, seg.start)?;
            dk = rope.backward(&dk, seg.start)?;
        }
        let dqkv = Tensor::cat(
            &[
                self.merge_heads(&dq, seg)?,
                self.merge_heads(&dk, seg)?,
                self.merge_heads(&dv, seg)?,
            ],
            1,
        )?; // (N, 3C)
        let dh1 = self.linear_bwd(params, "attn.c_attn", &ctx.c_attn, &dqkv, true, grads)?;
        Ok(dx1.add(
            &self
                .norm
                .backward(params, &self.name("ln_1"), &ctx.ln_1, &dh1, grads)?,
        )?)
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
