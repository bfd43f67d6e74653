//! LayerNorm or RMSNorm, chosen by the config, over named parameters.

use candle_core::Tensor;
use ops::memory::SavedTensors;
use ops::norm::{
    NormCtx, NormGrads, layer_norm_backward, layer_norm_forward, rms_norm_backward,
    rms_norm_forward,
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

    /// `dy (N, C)` → `dx (N, C)`, adding the weight (and bias) gradients to `grads`: the input
    /// half ([`NormLayer::backward_input`]) then the weight half ([`NormLayer::add_grads`]).
    pub fn backward(
        &self,
        params: &Params,
        prefix: &str,
        ctx: &NormLayerCtx,
        dy: &Tensor,
        grads: &mut Gradients,
    ) -> Result<Tensor, ModelError> {
        let (dx, g) = self.backward_input(params, prefix, ctx, dy)?;
        Self::add_grads(prefix, g, grads)?;
        Ok(dx)
    }

    /// The input half of [`NormLayer::backward`]: `dy (N, C)` → `dx (N, C)` and the parameter
    /// gradients, not yet added (the norm's one kernel computes both; they are `(C,)` each, so a
    /// split backward keeps them instead of the norm's input).
    pub fn backward_input(
        &self,
        params: &Params,
        prefix: &str,
        ctx: &NormLayerCtx,
        dy: &Tensor,
    ) -> Result<(Tensor, NormParamGrads), ModelError> {
        let w = params.get(&weight(prefix))?;
        let (dx, g) = match self.kind {
            Norm::LayerNorm => layer_norm_backward(&ctx.0, w, dy, true)?,
            Norm::RmsNorm => rms_norm_backward(&ctx.0, w, dy)?,
        };
        Ok((dx, NormParamGrads(g)))
    }

    /// The weight half of [`NormLayer::backward`]: adds what [`NormLayer::backward_input`]
    /// computed to `grads`.
    pub fn add_grads(
        prefix: &str,
        g: NormParamGrads,
        grads: &mut Gradients,
    ) -> Result<(), ModelError> {
        let NormParamGrads(g) = g;
        grads.add(&weight(prefix), g.dweight)?;
        if let Some(db) = g.dbias {
            grads.add(&bias(prefix), db)?;
        }
        Ok(())
    }
}

/// A norm's parameter gradients between the input half and the weight half of a split backward.
pub struct NormParamGrads(NormGrads);

impl SavedTensors for NormParamGrads {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        f(&self.0.dweight);
        self.0.dbias.for_each_tensor(f);
    }
}
