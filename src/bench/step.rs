//! `seqpipe bench step`: full training steps of a whole GPT in one process — forward and backward
//! through one [`Stage`] that holds every layer, global-norm clipping and AdamW — timed step by
//! step, with the process's peak resident memory.
//!
//! With `--dump DIR` it also writes what `scripts/bench-vs-torch.py` needs to train the identical
//! model in PyTorch and compare: the initial weights, the batch, the first step's gradients, the
//! final weights and the run's settings.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor};
use clap::{Args, ValueEnum};
use ops::adamw::{AdamW, AdamWConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use trainer::model::params::{decays, param_count};
use trainer::model::{Mode, ModelConfig, Stage, StageInput, StageLayout, StageOutput};
use trainer::schedule::Unit;
use trainer::usage::ProcessUsage;

/// Benchmarked model and batch shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// vocab 4096, d 256, 4 layers, 4 heads, seq 256, batch 8.
    A,
    /// vocab 8192, d 512, 6 layers, 8 heads, seq 512, batch 4.
    B,
    /// Long sequences where attention dominates: vocab 4096, d 128, 2 layers, 2 heads, seq 4096, batch 1.
    Long,
    /// GPT-2 small (124M): vocab 50257, d 768, 12 layers, 12 heads, seq 1024, batch 8.
    Gpt2,
}

impl Preset {
    /// The model and `(batch, seq_len)` of the preset (GPT-2 style: learned positions, LayerNorm).
    pub(crate) fn shape(self) -> (ModelConfig, usize, usize) {
        let (vocab_size, d_model, layers, heads, seq, batch) = match self {
            Preset::A => (4096, 256, 4, 4, 256, 8),
            Preset::B => (8192, 512, 6, 8, 512, 4),
            Preset::Long => (4096, 128, 2, 2, 4096, 1),
            Preset::Gpt2 => (50257, 768, 12, 12, 1024, 8),
        };
        let model = ModelConfig {
            vocab_size,
            layers,
            d_model,
            heads,
            max_seq_len: seq,
            ..ModelConfig::default()
        };
        (model, batch, seq)
    }
}

/// Flags of `seqpipe bench step`.
#[derive(Args, Debug)]
pub struct StepBenchArgs {
    /// Model and batch shape.
    #[arg(long, value_enum)]
    preset: Preset,
    /// Timed steps (after one untimed warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Threads for matmuls and kernels (sets RAYON_NUM_THREADS and CANDLE_NUM_THREADS); default:
    /// the environment's setting.
    #[arg(long)]
    threads: Option<usize>,
    /// Seed of the weights and of the batch.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write init/batch/grads/final safetensors and run.json into this directory.
    #[arg(long, value_name = "DIR")]
    dump: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Optimizer settings of the benchmark (constant learning rate, GPT-2 style decay and clipping).
const LR: f64 = 3e-4;
const WEIGHT_DECAY: f64 = 0.1;
const GRAD_CLIP: f64 = 1.0;

/// What `--json` prints and `run.json` records.
#[derive(Serialize)]
struct Report {
    preset: Preset,
    model: ModelConfig,
    batch: usize,
    seq_len: usize,
    params: usize,
    threads: String,
    steps: usize,
    step_ms: Vec<f64>,
    median_ms: f64,
    tokens_per_s: f64,
    peak_rss_mb: f64,
    /// Minor page faults per timed step (the process's, as `getrusage` counts them).
    page_faults_per_step: f64,
    /// The share of the timed steps' CPU time spent in the kernel.
    cpu_system_share: f64,
    losses: Vec<f64>,
    lr: f64,
    weight_decay: f64,
    grad_clip: f64,
    adamw: [f64; 3],
    decayed: Vec<String>,
}

/// Runs `seqpipe bench step`.
pub fn run(args: &StepBenchArgs) -> Result<()> {
    if let Some(t) = args.threads {
        if t == 0 {
            bail!("--threads must be at least 1");
        }
        // SAFETY: called from the CLI's main thread before this process starts any other thread.
        unsafe {
            std::env::set_var("RAYON_NUM_THREADS", t.to_string());
            std::env::set_var("CANDLE_NUM_THREADS", t.to_string());
        }
    }
    // The kernels run inside their pool, as in a stage worker (see `ops::pool`).
    ops::pool::run_in_pool("bench", 0, || measure(args))?
}

/// The timed steps of `seqpipe bench step`, on the calling thread's compute pool.
fn measure(args: &StepBenchArgs) -> Result<()> {
    let (model, batch, seq_len) = args.preset.shape();
    let layout = StageLayout {
        stage: 0,
        stages: 1,
        layers: 0..model.layers,
    };
    let mut stage = Stage::new(&model, layout, vec![seq_len], args.seed)?;
    let (inputs, targets) = random_batch(&model, batch, seq_len, args.seed)?;
    let init = args
        .dump
        .is_some()
        .then(|| named(stage.params().iter()))
        .transpose()?;
    let adamw = AdamWConfig::default();
    let mut optimizer = AdamW::new(adamw.clone());
    let decay_embeddings = false;

    let mut losses = Vec::new();
    let mut step_ms = Vec::new();
    let mut first_grads = None;
    let loss_scale = 1.0 / (batch * seq_len) as f64;
    let mut usage = ProcessUsage::default();
    for step in 0..=args.steps {
        if step == 1 {
            usage = ProcessUsage::now();
        }
        let started = Instant::now();
        let loss_sum = gradients(&mut stage, &inputs, &targets, loss_scale)?;
        if step == 0 && args.dump.is_some() {
            first_grads = Some(named_grads(&stage)?);
        }
        let norm =
            ops::clip::global_norm(stage.grad_sums_of_squares()?.into_iter().map(|(_, ss)| ss));
        let clip = ops::clip::clip_coefficient(norm, GRAD_CLIP);
        stage.apply_update(&mut optimizer, LR, clip, WEIGHT_DECAY, decay_embeddings)?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        losses.push(loss_sum * loss_scale);
        // Step 0 warms up caches and allocators; it is not timed.
        if step > 0 {
            step_ms.push(ms);
        }
    }
    let usage = ProcessUsage::now().since(&usage);
    let cpu_s = (usage.user + usage.system).as_secs_f64();
    let peak_rss_mb = peak_rss_bytes()? as f64 / (1 << 20) as f64;
    let median_ms = median(&step_ms);
    let report = Report {
        preset: args.preset,
        batch,
        seq_len,
        params: param_count(&model),
        threads: std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into()),
        steps: args.steps,
        median_ms,
        tokens_per_s: (batch * seq_len) as f64 / (median_ms / 1e3),
        step_ms,
        peak_rss_mb,
        page_faults_per_step: usage.minor_faults as f64 / args.steps.max(1) as f64,
        cpu_system_share: if cpu_s > 0.0 {
            usage.system.as_secs_f64() / cpu_s
        } else {
            0.0
        },
        losses,
        lr: LR,
        weight_decay: WEIGHT_DECAY,
        grad_clip: GRAD_CLIP,
        adamw: [adamw.beta1, adamw.beta2, adamw.eps],
        decayed: stage
            .params()
            .specs()
            .iter()
            .filter(|s| decays(s.kind, decay_embeddings))
            .map(|s| s.name.clone())
            .collect(),
        model,
    };
    if let (Some(dir), Some(init), Some(grads)) = (&args.dump, init, first_grads) {
        dump(
            dir,
            &report,
            &init,
            &grads,
            &named(stage.params().iter())?,
            &inputs,
            &targets,
        )?;
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

/// One step's gradients on the single stage: the batch's forward to the loss and its backward,
/// the gradients finished. Returns the loss summed over the tokens.
pub(crate) fn gradients(
    stage: &mut Stage,
    inputs: &Tensor,
    targets: &Tensor,
    loss_scale: f64,
) -> Result<f64> {
    let unit = Unit::new(0, 0);
    stage.begin_step(1);
    let out = stage.forward(
        unit,
        StageInput::Tokens(inputs.clone()),
        Some(targets),
        loss_scale,
        Mode::Train,
    )?;
    let StageOutput::LossSum(loss_sum) = out else {
        bail!("a single stage must end in the loss");
    };
    stage.backward(unit, None)?;
    stage.finish_gradients()?;
    Ok(loss_sum)
}

/// The stage's gradients by parameter name.
fn named_grads(stage: &Stage) -> Result<HashMap<String, Tensor>> {
    named(stage.params().specs().iter().map(|s| {
        let g = stage
            .grads()
            .get(&s.name)
            .expect("every parameter has a gradient");
        (s.name.as_str(), g)
    }))
}

/// The report's summary, for a reader.
fn print_report(report: &Report) {
    println!(
        "preset {:?}: {} parameters, batch {} × seq {}, threads {}",
        report.preset, report.params, report.batch, report.seq_len, report.threads
    );
    println!(
        "median {:.1} ms/step over {} steps ({:.0} tokens/s), peak RSS {:.0} MiB, {:.0} page faults/step, {:.1}% of CPU time in the kernel, loss {:.4} -> {:.4}",
        report.median_ms,
        report.steps,
        report.tokens_per_s,
        report.peak_rss_mb,
        report.page_faults_per_step,
        100.0 * report.cpu_system_share,
        report.losses[0],
        report.losses[report.losses.len() - 1]
    );
}

/// Uniform random token rows: inputs `(B, T)` and the next-token targets `(B·T,)`, both U32.
pub(crate) fn random_batch(
    model: &ModelConfig,
    batch: usize,
    seq_len: usize,
    seed: u64,
) -> Result<(Tensor, Tensor)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_ba7c);
    let rows: Vec<Vec<u32>> = (0..batch)
        .map(|_| {
            (0..=seq_len)
                .map(|_| rng.random_range(0..model.vocab_size as u32))
                .collect()
        })
        .collect();
    let inputs: Vec<u32> = rows.iter().flat_map(|r| r[..seq_len].to_vec()).collect();
    let targets: Vec<u32> = rows.iter().flat_map(|r| r[1..].to_vec()).collect();
    Ok((
        Tensor::from_vec(inputs, (batch, seq_len), &Device::Cpu)?,
        Tensor::from_vec(targets, batch * seq_len, &Device::Cpu)?,
    ))
}

/// Deep copies of `(name, tensor)` pairs (later steps must not change what was taken).
fn named<'a>(
    tensors: impl Iterator<Item = (&'a str, &'a Tensor)>,
) -> Result<HashMap<String, Tensor>> {
    tensors
        .map(|(n, t)| Ok((n.to_string(), t.copy()?)))
        .collect()
}

/// Writes `init`, `batch` (inputs and targets as I64 `(B, T)`), `grads` (first step) and `final`
/// safetensors files and `run.json` into `dir`.
fn dump(
    dir: &Path,
    report: &Report,
    init: &HashMap<String, Tensor>,
    grads: &HashMap<String, Tensor>,
    last: &HashMap<String, Tensor>,
    inputs: &Tensor,
    targets: &Tensor,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let save = |name: &str, tensors: &HashMap<String, Tensor>| -> Result<()> {
        let path = dir.join(name);
        candle_core::safetensors::save(tensors, &path)
            .with_context(|| format!("writing {}", path.display()))
    };
    save("init.safetensors", init)?;
    save("grads.safetensors", grads)?;
    save("final.safetensors", last)?;
    let batch = HashMap::from([
        ("inputs".to_string(), inputs.to_dtype(DType::I64)?),
        (
            "targets".to_string(),
            targets.reshape(inputs.dims())?.to_dtype(DType::I64)?,
        ),
    ]);
    save("batch.safetensors", &batch)?;
    let path = dir.join("run.json");
    std::fs::write(&path, serde_json::to_string_pretty(report)?)
        .with_context(|| format!("writing {}", path.display()))
}

pub(crate) fn median(xs: &[f64]) -> f64 {
    let mut sorted = xs.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The process's peak resident set size (`VmHWM` of `/proc/self/status`), in bytes.
fn peak_rss_bytes() -> Result<u64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .context("no VmHWM in /proc/self/status")?;
    Ok(kb * 1024)
}
