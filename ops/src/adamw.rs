//! AdamW optimizer (decoupled weight decay, bias-corrected moments).
//!
//! For a parameter `p` with gradient `g` at step `t` (1-based, see [`AdamW::begin_step`]):
//!
//! ```text
//! p <- p - lr * wd * p                       (decoupled weight decay)
//! m <- beta1 * m + (1 - beta1) * g
//! v <- beta2 * v + (1 - beta2) * g^2
//! m_hat = m / (1 - beta1^t),  v_hat = v / (1 - beta2^t)
//! p <- p - lr * m_hat / (sqrt(v_hat) + eps)
//! ```
//!
//! The moments have the dtype of the parameter.

use std::collections::BTreeMap;

use candle_core::Tensor;

use crate::error::Result;
use crate::util::shape_err;

/// Hyper-parameters of [`AdamW`] that do not change during training (the learning rate and the
/// weight decay are passed to every [`AdamW::update`]).
#[derive(Clone, Debug)]
pub struct AdamWConfig {
    /// Decay rate of the first moment.
    pub beta1: f64,
    /// Decay rate of the second moment.
    pub beta2: f64,
    /// Term added to `sqrt(v_hat)` for numerical stability.
    pub eps: f64,
}

impl Default for AdamWConfig {
    /// `beta1 = 0.9`, `beta2 = 0.95`, `eps = 1e-8` (GPT-2/3 style).
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
        }
    }
}

/// First and second moment estimates of one parameter (same shape and dtype as the parameter).
#[derive(Clone, Debug)]
pub struct Moments {
    /// First moment (running mean of the gradient).
    pub m: Tensor,
    /// Second moment (running mean of the squared gradient).
    pub v: Tensor,
}

/// AdamW optimizer state; all fields are public so that it can be checkpointed and restored.
#[derive(Clone, Debug)]
pub struct AdamW {
    /// Hyper-parameters.
    pub config: AdamWConfig,
    /// Number of optimizer steps begun so far (the `t` of the bias correction).
    pub step: u64,
    /// Moments per parameter name.
    pub moments: BTreeMap<String, Moments>,
}

impl AdamW {
    /// Creates an optimizer at step 0 with no moments.
    pub fn new(config: AdamWConfig) -> Self {
        Self {
            config,
            step: 0,
            moments: BTreeMap::new(),
        }
    }

    /// Starts one optimizer step (increments `step`, used by bias correction of every update that follows).
    pub fn begin_step(&mut self) {
        self.step += 1;
    }

    /// Updates one parameter: creates zero moments on first use; p <- p - lr*wd*p (decoupled) then Adam update with bias correction.
    ///
    /// Returns the new parameter tensor. `weight_decay` is the caller's choice per parameter (0 for norms/biases/embeddings by the caller's policy).
    /// Errors if called before the first [`AdamW::begin_step`], or if the shapes of `param`,
    /// `grad` and the stored moments differ.
    pub fn update(
        &mut self,
        name: &str,
        param: &Tensor,
        grad: &Tensor,
        lr: f64,
        weight_decay: f64,
    ) -> Result<Tensor> {
        if self.step == 0 {
            return shape_err(format!(
                "AdamW::update({name}): called before the first begin_step"
            ));
        }
        if grad.dims() != param.dims() {
            return shape_err(format!(
                "AdamW::update({name}): gradient shape {:?} differs from parameter shape {:?}",
                grad.dims(),
                param.dims()
            ));
        }
        let AdamWConfig { beta1, beta2, eps } = self.config;
        let t = self.step as f64;
        let bc1 = 1.0 - beta1.powf(t);
        let bc2 = 1.0 - beta2.powf(t);

        let (m, v) = match self.moments.get(name) {
            Some(mom) => {
                if mom.m.dims() != param.dims() || mom.v.dims() != param.dims() {
                    return shape_err(format!(
                        "AdamW::update({name}): stored moments {:?}/{:?} do not match parameter shape {:?}",
                        mom.m.dims(),
                        mom.v.dims(),
                        param.dims()
                    ));
                }
                (mom.m.clone(), mom.v.clone())
            }
            None => (param.zeros_like()?, param.zeros_like()?),
        };
        let m = (m.affine(beta1, 0.0)? + grad.affine(1.0 - beta1, 0.0)?)?;
        let v = (v.affine(beta2, 0.0)? + grad.sqr()?.affine(1.0 - beta2, 0.0)?)?;
        // lr * m_hat / (sqrt(v_hat) + eps)
        let denom = v.affine(1.0 / bc2, 0.0)?.sqrt()?.affine(1.0, eps)?;
        let step = m.affine(lr / bc1, 0.0)?.div(&denom)?;
        // p - lr*wd*p - step
        let new_param = (param.affine(1.0 - lr * weight_decay, 0.0)? - step)?;
        self.moments.insert(name.to_string(), Moments { m, v });
        Ok(new_param)
    }
}
