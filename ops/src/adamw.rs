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
use rayon::prelude::*;

use crate::cpu::{Float, View, contiguous, dispatch_float, tensor};
use crate::error::Result;
use crate::util::shape_err;

/// Elements per parallel task of the update.
const CHUNK: usize = 1 << 14;

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

    /// Updates one parameter with the gradient `grad_scale * grad` (the scale is the clipping
    /// coefficient): creates zero moments on first use; p <- p - lr*wd*p (decoupled) then Adam
    /// update with bias correction, in one pass over the elements that writes new tensors for the
    /// parameter and its moments (the old ones may still be shared, e.g. by a checkpoint snapshot).
    ///
    /// Returns the new parameter tensor. `weight_decay` is the caller's choice per parameter (0 for norms/biases/embeddings by the caller's policy).
    /// Errors if called before the first [`AdamW::begin_step`], or if the shapes of `param`,
    /// `grad` and the stored moments differ.
    pub fn update(
        &mut self,
        name: &str,
        param: &Tensor,
        grad: &Tensor,
        grad_scale: f64,
        lr: f64,
        weight_decay: f64,
    ) -> Result<Tensor> {
        const OP: &str = "AdamW::update";
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
        let prior = match self.moments.get(name) {
            Some(mom) => {
                if mom.m.dims() != param.dims() || mom.v.dims() != param.dims() {
                    return shape_err(format!(
                        "AdamW::update({name}): stored moments {:?}/{:?} do not match parameter shape {:?}",
                        mom.m.dims(),
                        mom.v.dims(),
                        param.dims()
                    ));
                }
                Some((
                    contiguous(&mom.m, param.dtype(), OP, "m")?,
                    contiguous(&mom.v, param.dtype(), OP, "v")?,
                ))
            }
            None => None,
        };
        let step = Step::new(&self.config, self.step, grad_scale, lr, weight_decay);
        let (new_param, m, v) = dispatch_float!(
            param.dtype(),
            OP,
            update(
                &contiguous(param, param.dtype(), OP, "param")?,
                &contiguous(grad, param.dtype(), OP, "grad")?,
                prior.as_ref(),
                &step,
            )
        )?;
        self.moments.insert(name.to_string(), Moments { m, v });
        Ok(new_param)
    }
}

/// The scalars of one update.
struct Step {
    grad_scale: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    /// `1 / (1 - beta2^t)`.
    inv_bc2: f64,
    /// `lr / (1 - beta1^t)`.
    lr_bc1: f64,
    /// `1 - lr * wd`.
    decay: f64,
}

impl Step {
    fn new(config: &AdamWConfig, t: u64, grad_scale: f64, lr: f64, weight_decay: f64) -> Self {
        let AdamWConfig { beta1, beta2, eps } = *config;
        let t = t as f64;
        Self {
            grad_scale,
            beta1,
            beta2,
            eps,
            inv_bc2: 1.0 / (1.0 - beta2.powf(t)),
            lr_bc1: lr / (1.0 - beta1.powf(t)),
            decay: 1.0 - lr * weight_decay,
        }
    }
}

/// One pass: `(new param, m, v)` from the parameter, the gradient and the moments (zeros when
/// `prior` is `None`).
fn update<T: Float>(
    param: &Tensor,
    grad: &Tensor,
    prior: Option<&(Tensor, Tensor)>,
    step: &Step,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "AdamW::update";
    let (pv, gv) = (View::new(param, OP)?, View::new(grad, OP)?);
    let (ps, gs) = (pv.slice::<T>()?, gv.slice::<T>()?);
    let mv = prior
        .map(|(m, v)| Ok::<_, crate::OpsError>((View::new(m, OP)?, View::new(v, OP)?)))
        .transpose()?;
    let moments = mv
        .as_ref()
        .map(|(m, v)| Ok::<_, crate::OpsError>((m.slice::<T>()?, v.slice::<T>()?)))
        .transpose()?;
    let c = |x: f64| T::from_f64(x);
    let (scale, b1, b2, eps) = (
        c(step.grad_scale),
        c(step.beta1),
        c(step.beta2),
        c(step.eps),
    );
    let (one_b1, one_b2) = (c(1.0 - step.beta1), c(1.0 - step.beta2));
    let (inv_bc2, lr_bc1, decay) = (c(step.inv_bc2), c(step.lr_bc1), c(step.decay));
    let n = ps.len();
    let (mut p_new, mut m_new, mut v_new) =
        (vec![T::zero(); n], vec![T::zero(); n], vec![T::zero(); n]);
    p_new
        .par_chunks_mut(CHUNK)
        .zip(m_new.par_chunks_mut(CHUNK))
        .zip(v_new.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(chunk, ((p_out, m_out), v_out))| {
            let start = chunk * CHUNK;
            for i in 0..p_out.len() {
                let j = start + i;
                let g = gs[j] * scale;
                let (m0, v0) = moments.map_or((T::zero(), T::zero()), |(m, v)| (m[j], v[j]));
                let m = b1 * m0 + one_b1 * g;
                let v = b2 * v0 + one_b2 * (g * g);
                // lr * m_hat / (sqrt(v_hat) + eps)
                let update = m * lr_bc1 / ((v * inv_bc2).sqrt() + eps);
                p_out[i] = ps[j] * decay - update;
                m_out[i] = m;
                v_out[i] = v;
            }
        });
    let dims = param.dims();
    Ok((
        tensor(p_new, dims)?,
        tensor(m_new, dims)?,
        tensor(v_new, dims)?,
    ))
}
