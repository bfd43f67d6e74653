//! LayerNorm or RMSNorm, chosen by the config, over named parameters.

use candle_core::Tensor;
use ops::memory::SavedTensors;
use ops::norm::{
    NormCtx, layer_norm_backward, layer_norm_forward, rms_norm_backward, rms_norm_forward,
};

use super::config::{ModelConfig, Norm};
use super::error::ModelError;
use super::params::{Gradients, Params, bias, weight};

/// A norm layer's kind and epsilon; its parameters are `{prefix}.weight` (and `{prefix}.bias` for LayerNorm).
#[derive(Clone, Copy, Debug)]
pub struct NormLayer {
    /// Which norm.
    pub kind: Norm,
    /// Epsilon added to the variance.
    pub eps: f64,
}

/// What a norm's backward needs.
pub struct NormLayerCtx(NormCtx);

impl SavedTensors for NormLayerCtx {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.0.for_each_tensor(f)
    }
}

impl NormLayer {
    /// The norm the model config asks for.
    pub fn of(cfg: &ModelConfig) -> Self {
        Self {
            kind: cfg.norm,
            eps: cfg.norm_eps,
        }
    }

    /// `x (N, C)` → normalized `(N, C)`.
    pub fn forward(
        &self,
        params: &Params,
        prefix: &str,
        x: &Tensor,
    ) -> Result<(Tensor, NormLayerCtx), ModelError> {
        let w = params.get(&weight(prefix))?;
        let (y, ctx) = match self.kind {
            Norm::LayerNorm => {
                layer_norm_forward(x, w, Some(params.get(&bias(prefix))?), self.eps)?
            }
            Norm::RmsNorm => rms_norm_forward(x, w, self.eps)?,
        };
        Ok((y, NormLayerCtx(ctx)))
    }

    /// `dy (N, C)` → `dx (N, C)`, adding the weight (and bias) gradients to `grads`.
    pub fn backward(
        &self,
        params: &Params,
        prefix: &str,
        ctx: &NormLayerCtx,
        dy: &Tensor,
        grads: &mut Gradients,
    ) -> Result<Tensor, ModelError> {
        let w_name = weight(prefix);
        let w = params.get(&w_name)?;
        let (dx, g) = match self.kind {
            Norm::LayerNorm => layer_norm_backward(&ctx.0, w, dy, true)?,
            Norm::RmsNorm => rms_norm_backward(&ctx.0, w, dy)?,
        };
        grads.add(&w_name, g.dweight)?;
        if let Some(db) = g.dbias {
            grads.add(&bias(prefix), db)?;
        }
        Ok(dx)
    }
}
