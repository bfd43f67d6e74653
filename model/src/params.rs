//! Parameter names, shapes and seeded initialization.
//!
//! Names are global and GPT-2 style (`h.7.attn.c_attn.weight`): a parameter keeps its name whichever
//! stage holds it, and its initial value depends only on (seed, name), never on the partition.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::config::{ModelConfig, Norm, Position};
use crate::error::{ModelError, StateMismatch};

/// A part of the model that is placed on exactly one stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Component {
    /// Token (and learned position) embeddings: always on the first stage.
    Embeddings,
    /// Transformer block `i`.
    Block(usize),
    /// Final norm and LM head: always on the last stage.
    Head,
}

/// What role a parameter plays (decides weight decay).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// A linear layer's weight matrix (decayed).
    Weight,
    /// A bias vector (not decayed).
    Bias,
    /// A norm's gain or bias (not decayed).
    Norm,
    /// An embedding table (decayed only when configured).
    Embedding,
}

/// How a parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal(0, std) from the parameter's own seeded stream.
    Normal(f64),
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
}

/// One parameter of the model.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    /// Global name, e.g. `h.0.mlp.c_fc.weight`.
    pub name: String,
    /// Shape; linear weights are `(out, in)`.
    pub shape: Vec<usize>,
    /// Initial distribution.
    pub init: Init,
    /// Role (weight decay policy).
    pub kind: ParamKind,
    /// Which component owns it.
    pub component: Component,
}

/// A layer of a transformer block with parameters: the one place its name is spelled. Block `i`'s
/// layer `l` is `h.{i}.{l.name()}` ([`block_layer`]); its parameters are `{that}.weight` and (all
/// but an RMS norm) `{that}.bias` ([`weight`], [`bias`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockLayer {
    /// The norm before attention.
    Ln1,
    /// The fused Q, K, V projection `(3C, C)`.
    CAttn,
    /// Attention's output projection `(C, C)`.
    AttnProj,
    /// The norm before the MLP.
    Ln2,
    /// The MLP's widening layer `(F, C)`.
    CFc,
    /// The MLP's narrowing layer `(C, F)`.
    MlpProj,
}

impl BlockLayer {
    /// The layer's name inside its block (`attn.c_attn`).
    pub fn name(self) -> &'static str {
        match self {
            BlockLayer::Ln1 => "ln_1",
            BlockLayer::CAttn => "attn.c_attn",
            BlockLayer::AttnProj => "attn.c_proj",
            BlockLayer::Ln2 => "ln_2",
            BlockLayer::CFc => "mlp.c_fc",
            BlockLayer::MlpProj => "mlp.c_proj",
        }
    }

    /// A linear layer's `(in, out)` widths in a model shaped by `cfg`; `None` for a norm.
    pub fn linear_dims(self, cfg: &ModelConfig) -> Option<(usize, usize)> {
        let (c, f) = (cfg.d_model, cfg.ffn());
        match self {
            BlockLayer::Ln1 | BlockLayer::Ln2 => None,
            BlockLayer::CAttn => Some((c, 3 * c)),
            BlockLayer::AttnProj => Some((c, c)),
            BlockLayer::CFc => Some((c, f)),
            BlockLayer::MlpProj => Some((f, c)),
        }
    }
}

/// The name of layer `l` of block `layer`: `h.{layer}.{l.name()}`.
pub fn block_layer(layer: usize, l: BlockLayer) -> String {
    format!("h.{layer}.{}", l.name())
}

/// The embedding tables and the head's layers, by name.
pub mod names {
    /// Token embeddings `(V, C)`.
    pub const WTE: &str = "wte.weight";
    /// Learned position embeddings `(T, C)`.
    pub const WPE: &str = "wpe.weight";
    /// The final norm (a layer prefix: its parameters are `ln_f.weight`, `ln_f.bias`).
    pub const LN_F: &str = "ln_f";
    /// The LM head `(V, C)` (untied).
    pub const LM_HEAD: &str = "lm_head.weight";
}

/// The weight of layer `prefix` (`h.3.ln_1` → `h.3.ln_1.weight`).
pub fn weight(prefix: &str) -> String {
    format!("{prefix}.weight")
}

/// The bias of layer `prefix` (`h.3.ln_1` → `h.3.ln_1.bias`).
pub fn bias(prefix: &str) -> String {
    format!("{prefix}.bias")
}

/// The model's components in canonical order.
pub fn components(cfg: &ModelConfig) -> Vec<Component> {
    let mut all = vec![Component::Embeddings];
    all.extend((0..cfg.layers).map(Component::Block));
    all.push(Component::Head);
    all
}

/// The parameters of one component, in canonical order.
pub fn component_params(cfg: &ModelConfig, component: Component) -> Vec<ParamSpec> {
    let c = cfg.d_model;
    let std = cfg.init_std;
    let residual_std = std / (2.0 * cfg.layers as f64).sqrt();
    let mut out = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, init: Init, kind: ParamKind| {
        out.push(ParamSpec {
            name,
            shape,
            init,
            kind,
            component,
        });
    };
    let norm = |push: &mut dyn FnMut(String, Vec<usize>, Init, ParamKind), prefix: &str| {
        push(weight(prefix), vec![c], Init::Ones, ParamKind::Norm);
        if cfg.norm == Norm::LayerNorm {
            push(bias(prefix), vec![c], Init::Zeros, ParamKind::Norm);
        }
    };
    match component {
        Component::Embeddings => {
            push(
                names::WTE.into(),
                vec![cfg.vocab_size, c],
                Init::Normal(std),
                ParamKind::Embedding,
            );
            if cfg.position == Position::Learned {
                push(
                    names::WPE.into(),
                    vec![cfg.max_seq_len, c],
                    Init::Normal(std),
                    ParamKind::Embedding,
                );
            }
        }
        Component::Block(i) => {
            let linear = |push: &mut dyn FnMut(String, Vec<usize>, Init, ParamKind),
                          l: BlockLayer,
                          std: f64| {
                let (in_dim, out_dim) = l.linear_dims(cfg).expect("a linear layer");
                let prefix = block_layer(i, l);
                push(
                    weight(&prefix),
                    vec![out_dim, in_dim],
                    Init::Normal(std),
                    ParamKind::Weight,
                );
                push(bias(&prefix), vec![out_dim], Init::Zeros, ParamKind::Bias);
            };
            norm(&mut push, &block_layer(i, BlockLayer::Ln1));
            linear(&mut push, BlockLayer::CAttn, std);
            linear(&mut push, BlockLayer::AttnProj, residual_std);
            norm(&mut push, &block_layer(i, BlockLayer::Ln2));
            linear(&mut push, BlockLayer::CFc, std);
            linear(&mut push, BlockLayer::MlpProj, residual_std);
        }
        Component::Head => {
            norm(&mut push, names::LN_F);
            push(
                names::LM_HEAD.into(),
                vec![cfg.vocab_size, c],
                Init::Normal(std),
                ParamKind::Weight,
            );
        }
    }
    out
}

/// Every parameter of the model, in canonical order (embeddings, blocks, final norm, head).
pub fn param_specs(cfg: &ModelConfig) -> Vec<ParamSpec> {
    components(cfg)
        .into_iter()
        .flat_map(|comp| component_params(cfg, comp))
        .collect()
}

/// Total number of parameters.
pub fn param_count(cfg: &ModelConfig) -> usize {
    param_specs(cfg)
        .iter()
        .map(|s| s.shape.iter().product::<usize>())
        .sum()
}

/// FNV-1a of a name: a hash that is stable across platforms and Rust versions.
fn stable_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The initial value of a parameter: a pure function of (seed, name, shape, init).
pub fn init_param(
    spec: &ParamSpec,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let n: usize = spec.shape.iter().product();
    let values: Vec<f64> = match spec.init {
        Init::Zeros => vec![0.0; n],
        Init::Ones => vec![1.0; n],
        Init::Normal(std) => {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ stable_hash(&spec.name).rotate_left(17));
            let mut values = Vec::with_capacity(n + 1);
            while values.len() < n {
                // Box-Muller: two independent normals from two uniforms in (0, 1].
                let u1: f64 = 1.0 - rng.random::<f64>();
                let u2: f64 = rng.random::<f64>();
                let r = (-2.0 * u1.ln()).sqrt();
                let theta = std::f64::consts::TAU * u2;
                values.push(std * r * theta.cos());
                values.push(std * r * theta.sin());
            }
            values.truncate(n);
            values
        }
    };
    Tensor::from_vec(values, spec.shape.as_slice(), device)?.to_dtype(dtype)
}

/// The tensors a state of `specs` holds, with their shapes: the parameters, then, when `moments`,
/// AdamW's `optim.m.<name>` and `optim.v.<name>` of each (the same shape).
pub fn state_tensors(specs: &[ParamSpec], moments: bool) -> Vec<(String, Vec<usize>)> {
    let mut out: Vec<(String, Vec<usize>)> = specs
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone()))
        .collect();
    if moments {
        for prefix in ["optim.m.", "optim.v."] {
            out.extend(
                specs
                    .iter()
                    .map(|s| (format!("{prefix}{}", s.name), s.shape.clone())),
            );
        }
    }
    out
}

/// The check a saved state passes before it is loaded — by a resume (each stage, for the tensors it
/// loads) and by `seqpipe ckpt verify`/`show`/`export` (the whole model, `whole`): every tensor of
/// `expected` ([`state_tensors`]) is in `found` (name, safetensors dtype, shape) with its shape and
/// a loadable dtype; with `whole`, nothing else is. Every mismatch, expected tensors in order first.
pub fn check_state<'a>(
    expected: &[(String, Vec<usize>)],
    found: impl IntoIterator<Item = (&'a str, &'a str, &'a [usize])>,
    whole: bool,
) -> Vec<StateMismatch> {
    let wanted: HashMap<&str, &[usize]> = expected
        .iter()
        .map(|(n, s)| (n.as_str(), s.as_slice()))
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut problems = Vec::new();
    let mut unexpected = Vec::new();
    for (name, dtype, shape) in found {
        let Some(&shape_wanted) = wanted.get(name) else {
            if whole {
                unexpected.push(StateMismatch::Unexpected {
                    name: name.to_string(),
                });
            }
            continue;
        };
        seen.insert(name);
        if !matches!(dtype, "F32" | "F64") {
            problems.push(StateMismatch::Dtype {
                name: name.to_string(),
                found: dtype.to_string(),
            });
        }
        if shape != shape_wanted {
            problems.push(StateMismatch::Shape {
                name: name.to_string(),
                expected: shape_wanted.to_vec(),
                found: shape.to_vec(),
            });
        }
    }
    for (name, shape) in expected {
        if !seen.contains(name.as_str()) {
            problems.push(StateMismatch::Missing {
                name: name.clone(),
                expected: shape.clone(),
            });
        }
    }
    problems.extend(unexpected);
    problems
}

/// Whether AdamW's decoupled weight decay applies to this parameter.
pub fn decays(kind: ParamKind, decay_embeddings: bool) -> bool {
    match kind {
        ParamKind::Weight => true,
        ParamKind::Embedding => decay_embeddings,
        ParamKind::Bias | ParamKind::Norm => false,
    }
}

/// AdamW's decoupled weight decay of a run: the rate of the parameters that decay
/// (`train.weight_decay`), and whether the embedding tables do (`train.decay_embeddings`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WeightDecay {
    /// Decay rate of the decayed parameters.
    pub rate: f64,
    /// Whether the embedding tables decay.
    pub embeddings: bool,
}

impl WeightDecay {
    /// The decay rate of a parameter of role `kind`: [`WeightDecay::rate`] where [`decays`] says
    /// so, else 0.
    pub fn rate_of(&self, kind: ParamKind) -> f64 {
        if decays(kind, self.embeddings) {
            self.rate
        } else {
            0.0
        }
    }
}

/// The parameters a stage holds, by global name, with their specs in canonical order.
pub struct Params {
    specs: Vec<ParamSpec>,
    values: HashMap<String, Tensor>,
}

impl Params {
    /// Holds `values`, one per spec.
    pub fn new(specs: Vec<ParamSpec>, values: HashMap<String, Tensor>) -> Self {
        Self { specs, values }
    }

    /// The tensor of `name`.
    pub fn get(&self, name: &str) -> Result<&Tensor, ModelError> {
        self.values
            .get(name)
            .ok_or_else(|| ModelError::MissingParam(name.to_string()))
    }

    /// Replaces the value of `name` (same shape required).
    pub fn set(&mut self, name: &str, value: Tensor) -> Result<(), ModelError> {
        let spec = self
            .specs
            .iter()
            .find(|s| s.name == name)
            .ok_or_else(|| ModelError::MissingParam(name.to_string()))?;
        if value.dims() != spec.shape.as_slice() {
            return Err(ModelError::Shape {
                name: name.to_string(),
                expected: spec.shape.clone(),
                got: value.dims().to_vec(),
            });
        }
        self.values.insert(name.to_string(), value);
        Ok(())
    }

    /// Specs of the held parameters, in canonical order.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// `(name, tensor)` pairs in canonical order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.specs
            .iter()
            .map(|s| (s.name.as_str(), &self.values[&s.name]))
    }
}

/// Parameter gradients by name: one micro-batch's, accumulated over its segments in the order
/// their backward ran, or (see [`crate::grads::StepGradients`]) a whole step's sum.
#[derive(Clone, Debug, Default)]
pub struct Gradients {
    values: HashMap<String, Tensor>,
}

impl Gradients {
    /// `grad[name] += g`.
    pub fn add(&mut self, name: &str, g: Tensor) -> Result<(), ModelError> {
        let next = match self.values.remove(name) {
            Some(acc) => acc.add(&g)?,
            None => g,
        };
        self.values.insert(name.to_string(), next);
        Ok(())
    }

    /// The accumulated gradient of `name`, if any unit produced one.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.values.get(name)
    }

    /// Sets the gradient of `name` (replacing any).
    pub fn set(&mut self, name: &str, g: Tensor) {
        self.values.insert(name.to_string(), g);
    }

    /// Whether no parameter has a gradient.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Forgets all gradients.
    pub fn clear(&mut self) {
        self.values.clear();
    }

    /// `self + right`, parameter by parameter, `self` always the left operand (a parameter only
    /// one side has keeps its gradient).
    pub fn sum(mut self, mut right: Gradients) -> candle_core::Result<Gradients> {
        for (name, l) in self.values.iter_mut() {
            if let Some(r) = right.values.remove(name) {
                *l = l.add(&r)?;
            }
        }
        self.values.extend(right.values);
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check resume and `ckpt verify` share: missing, misshapen, wrongly typed and (for a
    /// whole checkpoint) unexpected tensors are each named; a stage's own check ignores the
    /// tensors of other stages.
    #[test]
    fn check_state_names_every_mismatch() {
        let expected = vec![
            ("wte.weight".to_string(), vec![64, 32]),
            ("ln_f.weight".to_string(), vec![32]),
            ("ln_f.bias".to_string(), vec![32]),
        ];
        let found = [
            ("wte.weight", "F32", &[32usize, 64][..]),
            ("ln_f.weight", "BF16", &[32][..]),
            ("h.9.mlp.c_fc.weight", "F32", &[1][..]),
        ];
        let problems = check_state(&expected, found, true);
        assert_eq!(
            problems,
            vec![
                StateMismatch::Shape {
                    name: "wte.weight".into(),
                    expected: vec![64, 32],
                    found: vec![32, 64],
                },
                StateMismatch::Dtype {
                    name: "ln_f.weight".into(),
                    found: "BF16".into(),
                },
                StateMismatch::Missing {
                    name: "ln_f.bias".into(),
                    expected: vec![32],
                },
                StateMismatch::Unexpected {
                    name: "h.9.mlp.c_fc.weight".into(),
                },
            ]
        );
        assert_eq!(check_state(&expected, found, false).len(), 3);
        let good = [
            ("wte.weight", "F32", &[64usize, 32][..]),
            ("ln_f.weight", "F32", &[32][..]),
            ("ln_f.bias", "F64", &[32][..]),
        ];
        assert!(check_state(&expected, good, true).is_empty());
        let with_moments = state_tensors(&param_specs(&ModelConfig::default()), true);
        let params = param_specs(&ModelConfig::default()).len();
        assert_eq!(with_moments.len(), 3 * params);
        assert!(with_moments[params].0.starts_with("optim.m."));
    }

    #[test]
    fn names_follow_gpt2_and_are_unique() {
        let cfg = ModelConfig {
            layers: 2,
            ..ModelConfig::default()
        };
        let specs = param_specs(&cfg);
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names[0], "wte.weight");
        assert_eq!(names[1], "wpe.weight");
        assert!(names.contains(&"h.1.attn.c_attn.weight"));
        assert!(names.contains(&"h.0.mlp.c_proj.bias"));
        assert_eq!(names[names.len() - 1], "lm_head.weight");
        let unique: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
    }

    #[test]
    fn rmsnorm_and_rope_drop_biases_and_wpe() {
        let cfg = ModelConfig {
            norm: Norm::RmsNorm,
            position: Position::Rope,
            ..ModelConfig::default()
        };
        let names: Vec<String> = param_specs(&cfg).into_iter().map(|s| s.name).collect();
        assert!(
            !names
                .iter()
                .any(|n| n == "wpe.weight" || n.ends_with("ln_1.bias") || n == "ln_f.bias")
        );
    }

    #[test]
    fn init_depends_only_on_seed_and_name() {
        let cfg = ModelConfig::default();
        let specs = param_specs(&cfg);
        let spec = specs
            .iter()
            .find(|s| s.name == "h.0.attn.c_attn.weight")
            .unwrap();
        let a = init_param(spec, 7, DType::F32, &Device::Cpu).unwrap();
        let b = init_param(spec, 7, DType::F32, &Device::Cpu).unwrap();
        let c = init_param(spec, 8, DType::F32, &Device::Cpu).unwrap();
        let diff = |x: &Tensor, y: &Tensor| {
            x.sub(y)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        assert_eq!(diff(&a, &b), 0.0);
        assert!(diff(&a, &c) > 0.0);
        let std = a
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .sqrt();
        assert!((std - 0.02).abs() < 0.002, "std {std}");
    }
}
