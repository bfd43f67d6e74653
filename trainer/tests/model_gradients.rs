//! Model-level gradient tests of [`Stage`]: the explicit forward/backward kernels against an
//! independent candle-autograd reference and against finite differences, and the invariants the
//! pipeline relies on (sequence splitting is exact, the partition into stages does not change a
//! single bit, evaluation matches training's forward and leaves nothing behind).
//!
//! Models are tiny (vocab 32, d_model 16, 2 heads, T = 16, B = 2) and their parameters are set to
//! name-seeded random values of order one (norm gains around 1, non-zero biases, weights scaled
//! by 1/sqrt(fan_in)) so that attention is far from uniform and every parameter matters.

mod common;

use std::collections::HashMap;

use anyhow::{Context, Result, ensure};
use candle_core::{D, DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use trainer::model::{
    Mode, ModelConfig, Norm, Position, Stage, StageInput, StageLayout, StageOutput,
    partition_layers,
};
use trainer::schedule::{ScheduleKind, Unit, generate};

const VOCAB: usize = 32;
const D_MODEL: usize = 16;
const HEADS: usize = 2;
const SEQ: usize = 16;
const BATCH: usize = 2;
const SEED: u64 = 1234;

const VARIANTS: [(Position, Norm); 4] = [
    (Position::Learned, Norm::LayerNorm),
    (Position::Learned, Norm::RmsNorm),
    (Position::Rope, Norm::LayerNorm),
    (Position::Rope, Norm::RmsNorm),
];

fn config(position: Position, norm: Norm, layers: usize) -> ModelConfig {
    ModelConfig {
        vocab_size: VOCAB,
        layers,
        d_model: D_MODEL,
        heads: HEADS,
        ffn_mult: 4,
        max_seq_len: SEQ,
        position,
        norm,
        rope_base: 10_000.0,
        norm_eps: 1e-5,
        init_std: 0.02,
        ..ModelConfig::default()
    }
}

fn variant_name(cfg: &ModelConfig) -> String {
    format!("{:?}/{:?}", cfg.position, cfg.norm)
}

// ---------------------------------------------------------------------------------------------
// Data and parameters
// ---------------------------------------------------------------------------------------------

/// `micro_batches` micro-batches of `batch` rows of `SEQ + 1` tokens each.
struct Batch {
    /// Row `mb * batch + b` is row b of micro-batch mb.
    rows: Vec<Vec<u32>>,
    micro_batches: usize,
    /// Rows per micro-batch (B).
    batch: usize,
}

impl Batch {
    fn new(micro_batches: usize, seed: u64) -> Self {
        Self::with_rows(micro_batches, BATCH, seed)
    }

    fn with_rows(micro_batches: usize, batch: usize, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let rows = (0..micro_batches * batch)
            .map(|_| {
                (0..=SEQ)
                    .map(|_| rng.random_range(0..VOCAB as u32))
                    .collect()
            })
            .collect();
        Self {
            rows,
            micro_batches,
            batch,
        }
    }

    /// Tokens in the whole batch (the loss is their mean).
    fn tokens(&self) -> usize {
        self.micro_batches * self.batch * SEQ
    }

    fn slice(&self, mb: usize, from: usize, len: usize) -> Vec<u32> {
        self.rows[mb * self.batch..(mb + 1) * self.batch]
            .iter()
            .flat_map(|row| row[from..from + len].iter().copied())
            .collect()
    }

    /// Inputs of segment `[start, start + len)` of micro-batch `mb`: `(B, len)` U32.
    fn inputs(&self, mb: usize, start: usize, len: usize) -> Result<Tensor> {
        Ok(Tensor::from_vec(
            self.slice(mb, start, len),
            (self.batch, len),
            &Device::Cpu,
        )?)
    }

    /// Targets of that segment: `(B·len,)` U32.
    fn targets(&self, mb: usize, start: usize, len: usize) -> Result<Tensor> {
        Ok(Tensor::from_vec(
            self.slice(mb, start + 1, len),
            self.batch * len,
            &Device::Cpu,
        )?)
    }
}

fn fnv(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn normals(rng: &mut ChaCha8Rng, n: usize) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let u1: f64 = 1.0 - rng.random::<f64>();
            let u2: f64 = rng.random::<f64>();
            (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
        })
        .collect()
}

/// A test value for parameter `name`: a pure function of the name (so every partition of the
/// model gets the same values), of order one.
fn test_value(name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut rng = ChaCha8Rng::seed_from_u64(fnv(name) ^ 0x5eed);
    let z = normals(&mut rng, n);
    let is_norm = name.contains("ln_");
    let values: Vec<f64> = if is_norm && name.ends_with(".weight") {
        z.iter().map(|v| 1.0 + 0.2 * v).collect()
    } else if name.ends_with(".bias") {
        z.iter().map(|v| 0.1 * v).collect()
    } else if name == "wte.weight" || name == "wpe.weight" {
        z.iter().map(|v| 0.5 * v).collect()
    } else {
        // Linear weights `(out, in)`.
        let std = 1.0 / (shape[1] as f64).sqrt();
        z.iter().map(|v| std * v).collect()
    };
    Ok(Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(dtype)?)
}

/// A stage holding `layout` whose parameters are the test values.
fn make_stage(
    cfg: &ModelConfig,
    layout: StageLayout,
    segments: &[usize],
    dtype: DType,
) -> Result<Stage> {
    let mut stage = Stage::with_dtype(cfg, layout, segments.to_vec(), SEED, dtype)?;
    let shapes: Vec<(String, Vec<usize>)> = stage
        .params()
        .iter()
        .map(|(name, t)| (name.to_string(), t.dims().to_vec()))
        .collect();
    for (name, shape) in shapes {
        let value = test_value(&name, &shape, dtype)?;
        stage.params_mut().set(&name, value)?;
    }
    Ok(stage)
}

fn whole(cfg: &ModelConfig) -> StageLayout {
    StageLayout {
        stage: 0,
        stages: 1,
        layers: 0..cfg.layers,
    }
}

fn layouts(bounds: &[usize]) -> Vec<StageLayout> {
    let stages = bounds.len() - 1;
    (0..stages)
        .map(|r| StageLayout {
            stage: r,
            stages,
            layers: bounds[r]..bounds[r + 1],
        })
        .collect()
}

fn make_stages(
    cfg: &ModelConfig,
    layouts: &[StageLayout],
    segments: &[usize],
    dtype: DType,
) -> Result<Vec<Stage>> {
    layouts
        .iter()
        .map(|l| make_stage(cfg, l.clone(), segments, dtype))
        .collect()
}

fn starts(segments: &[usize]) -> Vec<usize> {
    segments
        .iter()
        .scan(0, |acc, len| {
            let s = *acc;
            *acc += len;
            Some(s)
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Running units through a chain of stages
// ---------------------------------------------------------------------------------------------

/// One unit's forward or backward through every stage of the chain.
#[derive(Clone, Copy, Debug)]
enum Step {
    F(usize, usize),
    B(usize, usize),
}

/// Each micro-batch in turn: its segments forward in order, then backward in reverse.
fn sequential_order(micro_batches: usize, k: usize) -> Vec<Step> {
    (0..micro_batches)
        .flat_map(|i| {
            (0..k)
                .map(move |j| Step::F(i, j))
                .chain((0..k).rev().map(move |j| Step::B(i, j)))
        })
        .collect()
}

/// Parses an order written like a schedule: `"F0.0 F0.1 B0.1 B0.0"`.
fn steps(text: &str) -> Vec<Step> {
    text.split_whitespace()
        .map(|s| {
            let (i, j) = s[1..].split_once('.').expect("unit `i.j`");
            let (i, j) = (i.parse().expect("micro-batch"), j.parse().expect("segment"));
            match &s[..1] {
                "F" => Step::F(i, j),
                "B" => Step::B(i, j),
                other => panic!("unknown step kind {other}"),
            }
        })
        .collect()
}

/// Forward of one unit on stage `r` whose input is `input`.
fn forward_on(
    stage: &mut Stage,
    batch: &Batch,
    segments: &[usize],
    unit: Unit,
    input: StageInput,
    mode: Mode,
) -> Result<StageOutput> {
    let (start, len) = (starts(segments)[unit.segment], segments[unit.segment]);
    let targets = batch.targets(unit.micro_batch, start, len)?;
    let targets = stage.layout().is_last().then_some(&targets);
    let scale = 1.0 / batch.tokens() as f64;
    Ok(stage.forward(unit, input, targets, scale, mode)?)
}

fn first_input(batch: &Batch, segments: &[usize], unit: Unit) -> Result<StageInput> {
    let start = starts(segments)[unit.segment];
    Ok(StageInput::Tokens(batch.inputs(
        unit.micro_batch,
        start,
        segments[unit.segment],
    )?))
}

/// Runs `order` unit by unit through the whole chain; returns the per-unit loss sums in forward order.
fn run_chain(
    stages: &mut [Stage],
    batch: &Batch,
    segments: &[usize],
    order: &[Step],
    mode: Mode,
) -> Result<Vec<f64>> {
    let mut losses = Vec::new();
    for &step in order {
        match step {
            Step::F(i, j) => {
                let unit = Unit::new(i, j);
                let mut input = Some(first_input(batch, segments, unit)?);
                for stage in stages.iter_mut() {
                    let x = input
                        .take()
                        .context("a stage after the one that computed the loss")?;
                    match forward_on(stage, batch, segments, unit, x, mode)? {
                        StageOutput::Hidden(h) => input = Some(StageInput::Hidden(h)),
                        StageOutput::LossSum(l) => losses.push(l),
                    }
                }
                ensure!(input.is_none(), "the last stage returned hidden states");
            }
            Step::B(i, j) => {
                let unit = Unit::new(i, j);
                let mut d = None;
                for stage in stages.iter_mut().rev() {
                    d = stage.backward(unit, d)?;
                }
                ensure!(d.is_none(), "the first stage returned an input gradient");
            }
        }
    }
    Ok(losses)
}

/// Runs the schedule `kind` generates for these stages, each stage following its own action list
/// (a stage waits until its input is available; messages are buffered without bound). Returns the
/// last stage's loss sums in the order it computed them.
fn run_schedule(
    stages: &mut [Stage],
    batch: &Batch,
    segments: &[usize],
    kind: ScheduleKind,
) -> Result<Vec<f64>> {
    let schedule = generate(kind, stages.len(), batch.micro_batches, segments.len())?;
    common::run_in_process(stages, &schedule, |stage, _, unit, hidden| {
        let input = match hidden {
            None => first_input(batch, segments, unit)?,
            Some(h) => StageInput::Hidden(h),
        };
        forward_on(stage, batch, segments, unit, input, Mode::Train)
    })
}

/// Starts a training step of `micro_batches` micro-batches on every stage.
fn begin(stages: &mut [Stage], micro_batches: usize) {
    for stage in stages {
        stage.begin_step(micro_batches);
    }
}

/// The step's summed gradients of every parameter of every stage, by name (each must exist).
fn all_grads(stages: &mut [Stage]) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for stage in stages {
        stage.finish_gradients()?;
        for (name, _) in stage.params().iter() {
            let g = stage
                .grads()
                .get(name)
                .with_context(|| format!("parameter `{name}` got no gradient"))?;
            ensure!(
                out.insert(name.to_string(), g.clone()).is_none(),
                "`{name}` held twice"
            );
        }
    }
    Ok(out)
}

/// Mean loss of the whole batch from an evaluation pass (segments in order, every micro-batch).
fn eval_mean_loss(stage: &mut Stage, batch: &Batch, segments: &[usize]) -> Result<f64> {
    let order: Vec<Step> = (0..batch.micro_batches)
        .flat_map(|i| (0..segments.len()).map(move |j| Step::F(i, j)))
        .collect();
    let losses = run_chain(
        std::slice::from_mut(stage),
        batch,
        segments,
        &order,
        Mode::Eval,
    )?;
    ensure!(
        stage.in_flight_micro_batches() == 0,
        "evaluation left state behind"
    );
    Ok(losses.iter().sum::<f64>() / batch.tokens() as f64)
}

// ---------------------------------------------------------------------------------------------
// Comparisons
// ---------------------------------------------------------------------------------------------

fn max_abs(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()?)
}

/// `max|a - b| / max|b|` (in f64).
fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    ensure!(
        a.dims() == b.dims(),
        "shapes {:?} vs {:?}",
        a.dims(),
        b.dims()
    );
    let diff = a.to_dtype(DType::F64)?.sub(&b.to_dtype(DType::F64)?)?;
    Ok(max_abs(&diff)? / max_abs(b)?.max(f64::MIN_POSITIVE))
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(f64::MIN_POSITIVE)
}

/// Checks two gradient sets have the same names and agree within `tol` (relative max error).
/// Returns the worst relative error.
fn compare_grads(
    what: &str,
    got: &HashMap<String, Tensor>,
    want: &HashMap<String, Tensor>,
    tol: f64,
) -> Result<f64> {
    ensure!(
        got.len() == want.len(),
        "{what}: {} vs {} gradients",
        got.len(),
        want.len()
    );
    let mut worst = 0.0f64;
    let mut names: Vec<&String> = want.keys().collect();
    names.sort();
    for name in names {
        let g = got
            .get(name)
            .with_context(|| format!("{what}: no gradient for `{name}`"))?;
        let err = rel_err(g, &want[name])?;
        ensure!(
            err <= tol,
            "{what}: `{name}` relative error {err:.3e} > {tol:.0e}"
        );
        worst = worst.max(err);
    }
    Ok(worst)
}

fn f32_bits(t: &Tensor) -> Result<Vec<u32>> {
    ensure!(t.dtype() == DType::F32, "expected f32, got {:?}", t.dtype());
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

/// Checks two f32 gradient sets are bit-identical.
fn assert_bit_identical(
    what: &str,
    got: &HashMap<String, Tensor>,
    want: &HashMap<String, Tensor>,
) -> Result<()> {
    ensure!(
        got.len() == want.len(),
        "{what}: {} vs {} gradients",
        got.len(),
        want.len()
    );
    for (name, w) in want {
        let g = got
            .get(name)
            .with_context(|| format!("{what}: no gradient for `{name}`"))?;
        let (gb, wb) = (f32_bits(g)?, f32_bits(w)?);
        let differing = gb.iter().zip(&wb).filter(|(a, b)| a != b).count();
        ensure!(
            differing == 0,
            "{what}: `{name}` differs in {differing}/{} entries (relative error {:.3e})",
            wb.len(),
            rel_err(g, w)?
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Independent reference: the GPT written with candle's differentiable ops, differentiated by autograd
// ---------------------------------------------------------------------------------------------

struct Reference<'a> {
    cfg: &'a ModelConfig,
    vars: &'a HashMap<String, Var>,
}

impl Reference<'_> {
    fn p(&self, name: &str) -> Result<&Tensor> {
        Ok(self
            .vars
            .get(name)
            .with_context(|| format!("no variable `{name}`"))?
            .as_tensor())
    }

    /// `x (N, in)` → `x W^T (+ b)`.
    fn linear(&self, x: &Tensor, prefix: &str, bias: bool) -> Result<Tensor> {
        let y = x.matmul(&self.p(&format!("{prefix}.weight"))?.t()?)?;
        Ok(if bias {
            y.broadcast_add(self.p(&format!("{prefix}.bias"))?)?
        } else {
            y
        })
    }

    fn norm(&self, x: &Tensor, prefix: &str) -> Result<Tensor> {
        let eps = self.cfg.norm_eps;
        let w = self.p(&format!("{prefix}.weight"))?;
        Ok(match self.cfg.norm {
            Norm::LayerNorm => {
                let mean = x.mean_keepdim(1)?;
                let xc = x.broadcast_sub(&mean)?;
                let var = xc.sqr()?.mean_keepdim(1)?;
                let xhat = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
                xhat.broadcast_mul(w)?
                    .broadcast_add(self.p(&format!("{prefix}.bias"))?)?
            }
            Norm::RmsNorm => {
                let ms = x.sqr()?.mean_keepdim(1)?;
                x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)?
            }
        })
    }

    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    fn gelu(x: &Tensor) -> Result<Tensor> {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let cube = x.sqr()?.mul(x)?;
        let inner = (x + cube.affine(0.044715, 0.0)?)?.affine(c, 0.0)?;
        Ok(x.mul(&(inner.tanh()? + 1.0)?)?.affine(0.5, 0.0)?)
    }

    /// Rotates `x (R, H, T, D)` by position: pairs `(i, i + D/2)`, angle `p · base^(-2i/D)`.
    fn rope(&self, x: &Tensor, t: usize) -> Result<Tensor> {
        let d = self.cfg.head_dim();
        let half = d / 2;
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for pos in 0..t {
            for i in 0..half {
                let theta = pos as f64 * self.cfg.rope_base.powf(-2.0 * i as f64 / d as f64);
                cos.push(theta.cos());
                sin.push(theta.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (t, half), &Device::Cpu)?;
        let sin = Tensor::from_vec(sin, (t, half), &Device::Cpu)?;
        let x1 = x.narrow(3, 0, half)?;
        let x2 = x.narrow(3, half, half)?;
        let out1 = x1.broadcast_mul(&cos)?.sub(&x2.broadcast_mul(&sin)?)?;
        let out2 = x2.broadcast_mul(&cos)?.add(&x1.broadcast_mul(&sin)?)?;
        Ok(Tensor::cat(&[out1, out2], 3)?)
    }

    fn attention(&self, h: &Tensor, layer: usize, rows: usize, t: usize) -> Result<Tensor> {
        let (c, heads) = (self.cfg.d_model, self.cfg.heads);
        let hd = c / heads;
        let qkv = self.linear(h, &format!("h.{layer}.attn.c_attn"), true)?; // (R·T, 3C)
        let split = |i: usize| -> Result<Tensor> {
            Ok(qkv
                .narrow(1, i * c, c)?
                .reshape((rows, t, heads, hd))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (mut q, mut k, v) = (split(0)?, split(1)?, split(2)?);
        if self.cfg.position == Position::Rope {
            q = self.rope(&q, t)?;
            k = self.rope(&k, t)?;
        }
        let mask: Vec<f64> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { -1e30 }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?;
        let scores = q
            .matmul(&k.t()?.contiguous()?)?
            .affine(1.0 / (hd as f64).sqrt(), 0.0)?;
        let scores = scores.broadcast_add(&mask)?; // (R, H, T, T)
        // Softmax; the shift is a constant for autograd (softmax does not depend on it).
        let shift = scores.max_keepdim(D::Minus1)?.detach();
        let e = scores.broadcast_sub(&shift)?.exp()?;
        let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        let y = probs.matmul(&v)?; // (R, H, T, D)
        let y = y.transpose(1, 2)?.contiguous()?.reshape((rows * t, c))?;
        self.linear(&y, &format!("h.{layer}.attn.c_proj"), true)
    }

    /// Mean token cross-entropy of every row of `batch` (all micro-batches at once).
    fn loss(&self, batch: &Batch) -> Result<Tensor> {
        let (rows, t, c) = (batch.rows.len(), SEQ, self.cfg.d_model);
        let inputs: Vec<u32> = batch.rows.iter().flat_map(|r| r[..t].to_vec()).collect();
        let targets: Vec<u32> = batch.rows.iter().flat_map(|r| r[1..].to_vec()).collect();
        let ids = Tensor::from_vec(inputs, rows * t, &Device::Cpu)?;
        let targets = Tensor::from_vec(targets, (rows * t, 1), &Device::Cpu)?;
        let mut x = self.p("wte.weight")?.index_select(&ids, 0)?; // (R·T, C)
        if self.cfg.position == Position::Learned {
            let pos = self.p("wpe.weight")?.narrow(0, 0, t)?; // (T, C)
            x = x
                .reshape((rows, t, c))?
                .broadcast_add(&pos)?
                .reshape((rows * t, c))?;
        }
        for layer in 0..self.cfg.layers {
            let h = self.norm(&x, &format!("h.{layer}.ln_1"))?;
            x = (&x + self.attention(&h, layer, rows, t)?)?;
            let h = self.norm(&x, &format!("h.{layer}.ln_2"))?;
            let f = Self::gelu(&self.linear(&h, &format!("h.{layer}.mlp.c_fc"), true)?)?;
            x = (&x + self.linear(&f, &format!("h.{layer}.mlp.c_proj"), true)?)?;
        }
        let h = self.norm(&x, "ln_f")?;
        let logits = self.linear(&h, "lm_head", false)?; // (R·T, V)
        let shift = logits.max_keepdim(1)?.detach();
        let lse = logits
            .broadcast_sub(&shift)?
            .exp()?
            .sum_keepdim(1)?
            .log()?
            .add(&shift)?;
        let picked = logits.gather(&targets, 1)?;
        Ok((lse - picked)?.mean_all()?)
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Cross-check against candle autograd
// ---------------------------------------------------------------------------------------------

#[test]
fn matches_candle_autograd_reference_f64() -> Result<()> {
    // The four variants with B = 2, and one with B = 18: 288 tokens in the unit, more than the
    // 256-row chunk of the fused cross-entropy.
    let cases = VARIANTS
        .iter()
        .map(|&(position, norm)| (position, norm, BATCH))
        .chain([(Position::Rope, Norm::LayerNorm, 18)]);
    for (position, norm, rows) in cases {
        let cfg = config(position, norm, 2);
        let name = format!("{} B={rows}", variant_name(&cfg));
        let batch = Batch::with_rows(1, rows, 11);
        let segments = [SEQ];
        let mut stage = make_stage(&cfg, whole(&cfg), &segments, DType::F64)?;
        stage.begin_step(1);
        let losses = run_chain(
            std::slice::from_mut(&mut stage),
            &batch,
            &segments,
            &sequential_order(1, 1),
            Mode::Train,
        )?;
        let loss = losses.iter().sum::<f64>() / batch.tokens() as f64;
        let grads = all_grads(std::slice::from_mut(&mut stage))?;

        let mut vars = HashMap::new();
        for (n, t) in stage.params().iter() {
            vars.insert(n.to_string(), Var::from_tensor(t)?);
        }
        let reference = Reference {
            cfg: &cfg,
            vars: &vars,
        };
        let ref_loss = reference.loss(&batch)?;
        let ref_grads = ref_loss.backward()?;
        let ref_loss = ref_loss.to_scalar::<f64>()?;
        let mut want = HashMap::new();
        for (n, v) in &vars {
            let g = ref_grads
                .get(v.as_tensor())
                .with_context(|| format!("{name}: autograd gave `{n}` no gradient"))?;
            want.insert(n.clone(), g.clone());
        }
        let loss_err = rel(loss, ref_loss);
        ensure!(
            loss_err <= 1e-12,
            "{name}: loss {loss} vs reference {ref_loss} (rel {loss_err:.3e})"
        );
        let worst = compare_grads(&format!("{name} vs autograd"), &grads, &want, 1e-9)?;
        println!(
            "{name}: loss {loss:.6} (ref rel err {loss_err:.1e}), worst gradient rel err {worst:.2e}"
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. Every parameter gets a (non-zero, finite) gradient
// ---------------------------------------------------------------------------------------------

#[test]
fn every_parameter_gets_a_nonzero_gradient() -> Result<()> {
    for (position, norm) in VARIANTS {
        for dtype in [DType::F32, DType::F64] {
            let cfg = config(position, norm, 2);
            let name = variant_name(&cfg);
            let batch = Batch::new(1, 12);
            let segments = [7, 5, 4];
            let mut stage = make_stage(&cfg, whole(&cfg), &segments, dtype)?;
            stage.begin_step(1);
            run_chain(
                std::slice::from_mut(&mut stage),
                &batch,
                &segments,
                &sequential_order(1, 3),
                Mode::Train,
            )?;
            ensure!(
                stage.in_flight_micro_batches() == 0,
                "{name}: state left after backward"
            );
            let grads = all_grads(std::slice::from_mut(&mut stage))?;
            let expected = stage.params().specs().len();
            ensure!(
                grads.len() == expected,
                "{name}: {} gradients, {expected} params",
                grads.len()
            );
            for (n, p) in stage.params().iter() {
                let g = &grads[n];
                ensure!(
                    g.dims() == p.dims(),
                    "{name}: `{n}` gradient shape {:?}",
                    g.dims()
                );
                ensure!(
                    g.dtype() == dtype,
                    "{name}: `{n}` gradient dtype {:?}",
                    g.dtype()
                );
                let m = max_abs(g)?;
                ensure!(
                    m.is_finite() && m > 0.0,
                    "{name} {dtype:?}: `{n}` gradient max |g| = {m}"
                );
            }
            let sums = stage.grad_sums_of_squares()?;
            ensure!(
                sums.iter().all(|(_, s)| s.is_finite() && *s > 0.0),
                "{name}: {sums:?}"
            );
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 3. Finite differences on the whole stage
// ---------------------------------------------------------------------------------------------

#[test]
fn gradients_match_central_finite_differences_f64() -> Result<()> {
    const H: f64 = 1e-5;
    for (position, norm) in VARIANTS {
        let cfg = config(position, norm, 2);
        let name = variant_name(&cfg);
        // Two micro-batches of three unequal segments: the gradient comes from the split path.
        let batch = Batch::new(2, 13);
        let segments = [7, 5, 4];
        let mut stage = make_stage(&cfg, whole(&cfg), &segments, DType::F64)?;
        stage.begin_step(2);
        run_chain(
            std::slice::from_mut(&mut stage),
            &batch,
            &segments,
            &sequential_order(2, 3),
            Mode::Train,
        )?;
        let grads = all_grads(std::slice::from_mut(&mut stage))?;
        let params: Vec<(String, Tensor)> = stage
            .params()
            .iter()
            .map(|(n, t)| (n.to_string(), t.clone()))
            .collect();
        let mut rng = ChaCha8Rng::seed_from_u64(fnv(&name));
        let mut worst = 0.0f64;
        let mut checked = 0;
        for (pname, value) in &params {
            let flat = value.flatten_all()?.to_vec1::<f64>()?;
            let g = grads[pname].flatten_all()?.to_vec1::<f64>()?;
            let g_scale = g.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for _ in 0..3 {
                let idx = rng.random_range(0..flat.len());
                let mut loss_at = |delta: f64| -> Result<f64> {
                    let mut v = flat.clone();
                    v[idx] += delta;
                    let t = Tensor::from_vec(v, value.dims(), &Device::Cpu)?;
                    stage.params_mut().set(pname, t)?;
                    eval_mean_loss(&mut stage, &batch, &segments)
                };
                let fd = (loss_at(H)? - loss_at(-H)?) / (2.0 * H);
                stage.params_mut().set(pname, value.clone())?;
                // Error relative to the parameter's largest gradient entry (entries can be ~0).
                let err = (fd - g[idx]).abs() / g_scale.max(1e-12);
                ensure!(
                    err <= 1e-7,
                    "{name}: `{pname}`[{idx}] finite difference {fd:.10e} vs gradient {:.10e} (err {err:.2e})",
                    g[idx]
                );
                worst = worst.max(err);
                checked += 1;
            }
        }
        println!("{name}: {checked} entries, worst finite-difference error {worst:.2e}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 4. Sequence splitting is exact
// ---------------------------------------------------------------------------------------------

/// Loss (mean) and gradients of one stage holding the whole model run in `order`.
fn single_stage_run(
    cfg: &ModelConfig,
    batch: &Batch,
    segments: &[usize],
    order: &[Step],
    dtype: DType,
) -> Result<(f64, HashMap<String, Tensor>)> {
    let mut stages = make_stages(cfg, &[whole(cfg)], segments, dtype)?;
    begin(&mut stages, batch.micro_batches);
    let losses = run_chain(&mut stages, batch, segments, order, Mode::Train)?;
    ensure!(
        stages[0].in_flight_micro_batches() == 0,
        "state left after the step"
    );
    Ok((
        losses.iter().sum::<f64>() / batch.tokens() as f64,
        all_grads(&mut stages)?,
    ))
}

#[test]
fn sequence_splitting_is_exact() -> Result<()> {
    for (position, norm) in VARIANTS {
        for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
            let cfg = config(position, norm, 3);
            let what = format!("{} {dtype:?}", variant_name(&cfg));
            let batch = Batch::new(1, 14);
            let (loss, grads) =
                single_stage_run(&cfg, &batch, &[SEQ], &sequential_order(1, 1), dtype)?;
            for segments in [vec![7, 5, 4], vec![4, 4, 4, 4], vec![3, 1, 7, 5]] {
                let k = segments.len();
                let (l, g) =
                    single_stage_run(&cfg, &batch, &segments, &sequential_order(1, k), dtype)?;
                let case = format!("{what} k={k} {segments:?}");
                ensure!(rel(l, loss) <= tol, "{case}: loss {l} vs {loss}");
                let worst = compare_grads(&case, &g, &grads, tol)?;
                println!(
                    "{case}: loss rel {:.1e}, worst gradient rel {worst:.1e}",
                    rel(l, loss)
                );
            }

            // Two micro-batches: unsplit vs split sequentially vs split in Seq1F1B's interleaving.
            let batch = Batch::new(2, 15);
            let (loss, grads) =
                single_stage_run(&cfg, &batch, &[SEQ], &sequential_order(2, 1), dtype)?;
            let split = [9, 7];
            let (l_seq, g_seq) =
                single_stage_run(&cfg, &batch, &split, &sequential_order(2, 2), dtype)?;
            let (l_int, g_int) = single_stage_run(
                &cfg,
                &batch,
                &split,
                &steps("F0.0 F0.1 F1.0 B0.1 F1.1 B0.0 B1.1 B1.0"),
                dtype,
            )?;
            let case = format!("{what} m=2 k=2 Seq1F1B");
            ensure!(rel(l_int, loss) <= tol, "{case}: loss {l_int} vs {loss}");
            let worst = compare_grads(&case, &g_int, &grads, tol)?;
            println!(
                "{case}: loss rel {:.1e}, worst gradient rel {worst:.1e}",
                rel(l_int, loss)
            );
            // Same backward order per parameter: interleaving the forwards changes nothing at all.
            ensure!(l_int == l_seq, "{case}: loss {l_int} vs sequential {l_seq}");
            if dtype == DType::F32 {
                assert_bit_identical(&format!("{case} vs sequential"), &g_int, &g_seq)?;
            } else {
                compare_grads(&format!("{case} vs sequential"), &g_int, &g_seq, 0.0)?;
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 5. Partition independence is bit-exact (f32)
// ---------------------------------------------------------------------------------------------

#[test]
fn partition_independence_is_bit_exact_f32() -> Result<()> {
    const LAYERS: usize = 4;
    let segments = [7, 5, 4];
    let batch = Batch::new(2, 16);
    // Seq1F1B-like interleaving of 2 micro-batches × 3 segments (backward: micro-batch ascending,
    // segment descending).
    let order = steps("F0.0 F0.1 F0.2 F1.0 B0.2 F1.1 B0.1 F1.2 B0.0 B1.2 B1.1 B1.0");
    for (position, norm) in VARIANTS {
        let cfg = config(position, norm, LAYERS);
        let name = variant_name(&cfg);
        let mut partitions: Vec<Vec<StageLayout>> = vec![vec![whole(&cfg)]];
        partitions.push(partition_layers(&cfg, SEQ, 2)?);
        partitions.push(layouts(&[0, 1, 4]));
        partitions.push(layouts(&[0, 3, 4]));
        partitions.push(partition_layers(&cfg, SEQ, 3)?);
        partitions.push(partition_layers(&cfg, SEQ, 4)?);

        let mut reference: Option<(Vec<f64>, HashMap<String, Tensor>)> = None;
        for layouts in &partitions {
            let bounds: Vec<usize> = layouts.iter().map(|l| l.layers.end).collect();
            let mut runs = Vec::new();
            // Units chained through the stages one at a time.
            let mut stages = make_stages(&cfg, layouts, &segments, DType::F32)?;
            begin(&mut stages, batch.micro_batches);
            let losses = run_chain(&mut stages, &batch, &segments, &order, Mode::Train)?;
            runs.push(("chain".to_string(), losses, all_grads(&mut stages)?));
            // Every stage following its own action list of the generated schedules.
            for kind in [
                ScheduleKind::Seq1F1B,
                ScheduleKind::OneFOneB,
                ScheduleKind::GPipe,
            ] {
                let mut stages = make_stages(&cfg, layouts, &segments, DType::F32)?;
                begin(&mut stages, batch.micro_batches);
                let losses = run_schedule(&mut stages, &batch, &segments, kind)?;
                ensure!(
                    stages.iter().all(|s| s.in_flight_micro_batches() == 0),
                    "state left"
                );
                runs.push((
                    format!("{kind:?} schedule"),
                    losses,
                    all_grads(&mut stages)?,
                ));
            }
            for (how, losses, grads) in runs {
                let what = format!("{name} p={} split {bounds:?} {how}", layouts.len());
                match &reference {
                    None => reference = Some((losses, grads)),
                    Some((ref_losses, ref_grads)) => {
                        let total: f64 = losses.iter().sum();
                        let ref_total: f64 = ref_losses.iter().sum();
                        ensure!(
                            total.to_bits() == ref_total.to_bits(),
                            "{what}: loss sum {total} vs {ref_total}"
                        );
                        let mut sorted = losses.clone();
                        let mut ref_sorted = ref_losses.clone();
                        sorted.sort_by(f64::total_cmp);
                        ref_sorted.sort_by(f64::total_cmp);
                        ensure!(
                            sorted == ref_sorted,
                            "{what}: unit losses {losses:?} vs {ref_losses:?}"
                        );
                        assert_bit_identical(&what, &grads, ref_grads)?;
                    }
                }
            }
        }
        println!(
            "{name}: {} partitions × 4 executions bit-identical",
            partitions.len()
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 6. Evaluation mode
// ---------------------------------------------------------------------------------------------

#[test]
fn eval_matches_train_forward_and_leaves_no_state() -> Result<()> {
    let segments = [7, 5, 4];
    let batch = Batch::new(2, 17);
    let forwards: Vec<Step> = (0..2)
        .flat_map(|i| (0..3).map(move |j| Step::F(i, j)))
        .collect();
    for (position, norm) in VARIANTS {
        for dtype in [DType::F32, DType::F64] {
            let cfg = config(position, norm, 4);
            let name = format!("{} {dtype:?}", variant_name(&cfg));
            for bounds in [vec![0, 4], vec![0, 2, 4]] {
                let what = format!("{name} split {bounds:?}");
                let mut train = make_stages(&cfg, &layouts(&bounds), &segments, dtype)?;
                let train_losses =
                    run_chain(&mut train, &batch, &segments, &forwards, Mode::Train)?;
                ensure!(
                    train.iter().all(|s| s.in_flight_micro_batches() == 2),
                    "{what}: train state"
                );

                let mut eval = make_stages(&cfg, &layouts(&bounds), &segments, dtype)?;
                // One micro-batch at a time: K/V lives until its last segment, then nothing is left.
                let mut eval_losses = Vec::new();
                for i in 0..2 {
                    for j in 0..3 {
                        let step = [Step::F(i, j)];
                        eval_losses.extend(run_chain(
                            &mut eval,
                            &batch,
                            &segments,
                            &step,
                            Mode::Eval,
                        )?);
                        let expect = usize::from(j + 1 < 3);
                        for s in &eval {
                            ensure!(
                                s.in_flight_micro_batches() == expect,
                                "{what}: after eval F{i}.{j}"
                            );
                        }
                    }
                }
                ensure!(
                    eval_losses == train_losses,
                    "{what}: eval {eval_losses:?} vs train {train_losses:?}"
                );
                for s in &eval {
                    ensure!(
                        s.grads().get("h.3.mlp.c_fc.weight").is_none(),
                        "{what}: eval made gradients"
                    );
                }

                // A training step after evaluation is unaffected by it.
                let order = sequential_order(2, 3);
                let mut fresh = make_stages(&cfg, &layouts(&bounds), &segments, dtype)?;
                begin(&mut fresh, batch.micro_batches);
                begin(&mut eval, batch.micro_batches);
                let l_fresh = run_chain(&mut fresh, &batch, &segments, &order, Mode::Train)?;
                let l_after = run_chain(&mut eval, &batch, &segments, &order, Mode::Train)?;
                ensure!(
                    l_fresh == l_after,
                    "{what}: train after eval {l_after:?} vs {l_fresh:?}"
                );
                compare_grads(
                    &format!("{what} train after eval"),
                    &all_grads(&mut eval)?,
                    &all_grads(&mut fresh)?,
                    0.0,
                )?;
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Units in an order the model cannot honour are refused (errors, not panics or wrong gradients)
// ---------------------------------------------------------------------------------------------

#[test]
fn out_of_order_units_are_refused() -> Result<()> {
    let cfg = config(Position::Rope, Norm::LayerNorm, 2);
    let segments = [7, 5, 4];
    let batch = Batch::new(1, 18);
    let fwd = |stage: &mut Stage, j: usize| -> Result<StageOutput> {
        let unit = Unit::new(0, j);
        forward_on(
            stage,
            &batch,
            &segments,
            unit,
            first_input(&batch, &segments, unit)?,
            Mode::Train,
        )
    };

    // A segment's forward needs the K/V of every earlier segment.
    let mut stage = make_stage(&cfg, whole(&cfg), &segments, DType::F32)?;
    ensure!(
        fwd(&mut stage, 1).is_err(),
        "forward of segment 1 before segment 0 was accepted"
    );

    // Backward: before forward, out of reverse segment order, twice.
    let mut stage = make_stage(&cfg, whole(&cfg), &segments, DType::F32)?;
    stage.begin_step(1);
    ensure!(
        stage.backward(Unit::new(0, 0), None).is_err(),
        "backward before forward was accepted"
    );
    fwd(&mut stage, 0)?;
    fwd(&mut stage, 1)?;
    ensure!(
        stage.backward(Unit::new(0, 2), None).is_err(),
        "backward of a segment never run"
    );
    let early = stage.backward(Unit::new(0, 0), None);
    ensure!(
        early.is_err(),
        "backward of segment 0 before segment 1 was accepted"
    );
    stage.backward(Unit::new(0, 1), None)?;
    ensure!(
        stage.backward(Unit::new(0, 1), None).is_err(),
        "a second backward was accepted"
    );

    // The wrong kind of input, and a wrong segment length.
    let mut stage = make_stage(&cfg, whole(&cfg), &segments, DType::F32)?;
    let hidden = Tensor::zeros((BATCH * 7, D_MODEL), DType::F32, &Device::Cpu)?;
    let unit = Unit::new(0, 0);
    let r = forward_on(
        &mut stage,
        &batch,
        &segments,
        unit,
        StageInput::Hidden(hidden),
        Mode::Train,
    );
    ensure!(
        r.is_err(),
        "hidden states given to the first stage were accepted"
    );
    let tokens = StageInput::Tokens(batch.inputs(0, 0, 5)?);
    ensure!(
        stage.forward(unit, tokens, None, 1.0, Mode::Train).is_err(),
        "5 tokens for a 7-token segment"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Activation memory and the memory budget
// ---------------------------------------------------------------------------------------------

#[test]
fn activation_bytes_follow_the_units_in_flight_and_the_budget_is_enforced() -> Result<()> {
    let cfg = config(Position::Learned, Norm::LayerNorm, 2);
    let segments = [SEQ / 2, SEQ / 2];
    let batch = Batch::new(2, 5);
    let mut stage = make_stage(&cfg, whole(&cfg), &segments, DType::F32)?;
    stage.begin_step(2);
    let run = |stage: &mut Stage, order: &str| {
        run_chain(
            std::slice::from_mut(stage),
            &batch,
            &segments,
            &steps(order),
            Mode::Train,
        )
    };
    ensure!(stage.activation_bytes() == 0);
    let mut held = vec![0];
    for step in ["F0.0", "F0.1", "F1.0", "F1.1"] {
        run(&mut stage, step)?;
        held.push(stage.activation_bytes());
    }
    // Every forward adds its context (and K/V); two micro-batches of the same shapes hold
    // exactly twice one.
    ensure!(held.windows(2).all(|w| w[1] > w[0]), "{held:?}");
    ensure!(held[4] == 2 * held[2], "{held:?}");
    // About 17·d floats per token per layer are saved for backward (norm inputs, attention
    // q/out/K/V, the MLP's 4d hidden twice, ...), plus the head's (V, C) gradient per unit.
    let per_token_layer = (held[2] - 2 * VOCAB * D_MODEL * 4) as f64 / (BATCH * SEQ * 2) as f64;
    ensure!(
        (14.0..=20.0).contains(&(per_token_layer / (D_MODEL * 4) as f64)),
        "{per_token_layer} bytes per token and layer"
    );
    for step in ["B0.1", "B0.0", "B1.1", "B1.0"] {
        let before = stage.activation_bytes();
        run(&mut stage, step)?;
        ensure!(stage.activation_bytes() < before, "{step} freed nothing");
    }
    ensure!(
        stage.activation_bytes() == 0,
        "a finished step holds activations"
    );
    ensure!(stage.take_peak_activation_bytes() == held[4]);
    ensure!(stage.take_peak_activation_bytes() == 0);

    // The budget counts the state too: one micro-batch in flight fits, a second does not.
    stage.reset_step();
    stage.set_memory_budget(Some(stage.state_bytes() + held[2]));
    run(&mut stage, "F0.0 F0.1")?;
    let err = run(&mut stage, "F1.0").unwrap_err();
    let msg = format!("{err:#}");
    ensure!(
        msg.contains("memory budget exceeded: after the forward of micro-batch 1 segment 0"),
        "{msg}"
    );
    Ok(())
}
