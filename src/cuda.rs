//! The CUDA side of the command line: `seqpipe gpu check` (every kernel against the CPU oracle),
//! `seqpipe gpu bench` (a whole GPT trained on one GPU, with tokens/s and MFU), `seqpipe gpu gemm`
//! (the step's matrix products timed in each way BF16 mode could feed cuBLAS), `seqpipe gpu ptx`
//! (the kernels compiled ahead of time into the cache, PTX and cubins) and `seqpipe gpu info` (the
//! preflight: device, driver, the library files loaded, NCCL, the kernel image); `seqpipe gpu link` is in `cuda_link`. The check that
//! refuses `model.device = "cuda"` where it cannot run is the library's
//! ([`trainer::cuda::require_runnable_device`]). Without the `cuda` feature every command says how
//! to build with it.

use anyhow::Result;
use clap::{Args, Subcommand};

/// `seqpipe gpu …`.
#[derive(Subcommand, Debug)]
pub enum GpuCommand {
    /// Run every CUDA kernel against its CPU counterpart and print the relative errors.
    Check(CheckArgs),
    /// Train a whole GPT on one GPU: step time, tokens/s, MFU, device memory (one JSON line).
    Bench(GpuBenchArgs),
    /// Time a GPT step's matrix products in FP32, TF32 and BF16 (FP32 operands rounded by cuBLAS,
    /// BF16 operands, BF16 operands rounded first, and the fast path: cached BF16 weights with the
    /// activations rounded per product and the head's vocabulary padded): one JSON object.
    Gemm(GemmArgs),
    /// Check the NCCL link between two GPUs: bit-exact transfers, bandwidth, and an abort
    /// instead of a hang when the peer is killed (one JSON line).
    Link(crate::cuda_link::LinkArgs),
    /// Compile the CUDA kernels (NVRTC only, no GPU needed) into the kernel cache
    /// (`$SEQPIPE_CACHE`, default `~/.cache/seqpipe`): PTX and a cubin per architecture, so that GPU
    /// processes load the cubin of their architecture instead of compiling or JIT-compiling at start.
    Ptx(PtxArgs),
    /// Preflight: device, compute capability, memory, driver version, the CUDA library files
    /// actually loaded, NCCL's version, the kernel image loaded (one JSON line; exit 1 when no GPU
    /// opened, with the reason).
    Info(InfoArgs),
}

/// Flags of `seqpipe gpu info`.
#[derive(Args, Debug)]
pub struct InfoArgs {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
}

/// Flags of `seqpipe gpu ptx`.
#[derive(Args, Debug)]
pub struct PtxArgs {
    /// Target architectures (repeatable): sm_75, sm_80, sm_86, sm_89, sm_90, sm_100, sm_120.
    #[arg(long = "arch", default_values_t = ["sm_80".to_string(), "sm_90".to_string()])]
    archs: Vec<String>,
}

/// Flags of `seqpipe gpu gemm`.
#[derive(Args, Debug)]
pub struct GemmArgs {
    /// Rows of the products (tokens of a micro-batch; GPT-2 124M at 8 x 1024 by default).
    #[arg(long, default_value_t = 8192)]
    rows: usize,
    /// Model width.
    #[arg(long, default_value_t = 768)]
    d_model: usize,
    /// Vocabulary of the LM head.
    #[arg(long, default_value_t = 50257)]
    vocab: usize,
    /// Timed runs of each product (the median is reported).
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
}

/// Flags of `seqpipe gpu check`.
#[derive(Args, Debug)]
pub struct CheckArgs {
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Check only these kernels (`attention`, alias `attn`: what scripts/gpu-check.sh runs under
    /// compute-sanitizer's racecheck, too slow for the whole set).
    #[arg(long, value_enum)]
    only: Option<KernelSet>,
}

/// The kernel sets `seqpipe gpu check --only` can pick.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelSet {
    /// The FP32 and BF16 (tensor-core) attention kernels, forward and backward.
    #[value(alias = "attn")]
    Attention,
}

/// Flags of `seqpipe gpu bench`.
#[derive(Args, Debug)]
pub struct GpuBenchArgs {
    /// Model and batch shape (as `bench step`, plus GPT-2 small).
    #[arg(long, value_enum)]
    preset: crate::bench::step::Preset,
    /// Rows per step (default: the preset's).
    #[arg(long)]
    batch: Option<usize>,
    /// `fp32`, `tf32` or `bf16` matrix products.
    #[arg(long, default_value = "bf16")]
    precision: String,
    /// Timed steps.
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Seed of the weights (the CPU stage's init) and of the batch.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Before timing, compare the first step's gradients with the CPU stage's on the same weights
    /// and batch (slow for big presets: the CPU runs the step too).
    #[arg(long)]
    check: bool,
    /// With `--precision bf16`, how the products get BF16 operands: `cached-weights` (BF16 copies
    /// of the weights refreshed after each update, activations rounded per product, the head's
    /// vocabulary padded to a multiple of 64), `operands` (both operands of every product rounded
    /// first) or `fp32-operands` (cuBLAS rounds FP32 operands). Reported in `impl`.
    // A string: without the `cuda` feature the gpu crate, and its `Bf16Path`, is not built.
    #[arg(long, default_value = "cached-weights",
          value_parser = ["cached-weights", "operands", "fp32-operands"])]
    bf16_path: String,
    /// Same as `--bf16-path operands` (kept for older scripts).
    #[arg(long, conflicts_with = "bf16_path")]
    bf16_operands: bool,
    /// Split each step as the pipeline does: this many micro-batches (dividing the batch), each
    /// run as `--segments` units forward, then backward in reverse, their gradients summed in the
    /// tree. 1: the whole batch at once.
    #[arg(long, default_value_t = 1)]
    micro_batches: usize,
    /// Segments per sequence (dividing the sequence length), Seq1F1B's k.
    #[arg(long, default_value_t = 1)]
    segments: usize,
    /// After the timed steps, profile `--profile-steps` more (after one profiled warm-up step):
    /// every kernel, product, copy and sync timed by CUDA events on the stream, summed by
    /// category (a table, then the report's `profile` object). It perturbs the step: each
    /// operation gets two event records more, so compare its wall time with `median_ms`.
    #[arg(long)]
    profile: bool,
    /// Steps profiled with `--profile`.
    #[arg(long, default_value_t = 3)]
    profile_steps: usize,
}

/// Runs a `seqpipe gpu` command.
pub fn run(cmd: GpuCommand) -> Result<()> {
    #[cfg(not(feature = "cuda"))]
    {
        let _ = cmd;
        anyhow::bail!(
            "this seqpipe was built without CUDA support: rebuild with `cargo build --release --features cuda`"
        )
    }
    #[cfg(feature = "cuda")]
    match cmd {
        GpuCommand::Check(args) => enabled::check(&args),
        GpuCommand::Ptx(args) => enabled::ptx(&args),
        GpuCommand::Info(args) => enabled::info(&args),
        GpuCommand::Bench(args) => enabled::bench(&args),
        GpuCommand::Gemm(args) => enabled::gemm(&args),
        #[cfg(not(feature = "emulate-gpu"))]
        GpuCommand::Link(args) => crate::cuda_link::run(&args),
        #[cfg(feature = "emulate-gpu")]
        GpuCommand::Link(_) => {
            anyhow::bail!(
                "this seqpipe runs CUDA stages on an emulated GPU: `gpu link` checks a real NCCL, which it does not load"
            )
        }
    }
}

#[cfg(feature = "cuda")]
mod enabled {
    use std::time::Instant;

    use anyhow::{Context, Result, bail};
    use candle_core::{DType, Tensor};
    use gpu::stage::{GpuStage, StageParam, StagePlan, UnitInput, UnitOutput};
    use gpu::{Gpu, Precision};
    use ops::adamw::AdamWConfig;
    use serde::Serialize;

    use super::{CheckArgs, GemmArgs, GpuBenchArgs, InfoArgs, PtxArgs};
    use crate::bench::step::{gradients, median, random_batch};
    use trainer::model::params::{WeightDecay, param_count};
    use trainer::model::{ModelConfig, Stage, StageLayout};

    /// Learning rate, weight decay and clipping of the benchmark (as `bench step`'s).
    const LR: f64 = 3e-4;
    const WEIGHT_DECAY: f64 = 0.1;
    const GRAD_CLIP: f64 = 1.0;
    /// Relative L2 error allowed between the GPU's and the CPU's whole-model FP32 gradients.
    const GRAD_BOUND_FP32: f64 = 1e-4;

    pub(super) fn check(args: &CheckArgs) -> Result<()> {
        let mut g = Gpu::open(args.device, Precision::Fp32)?;
        let which = match args.only {
            None => gpu::oracle::Kernels::All,
            Some(super::KernelSet::Attention) => gpu::oracle::Kernels::Attention,
        };
        let results = gpu::oracle::check(&mut g, args.seed, which)?;
        let failed: Vec<_> = results.iter().filter(|c| !c.passed()).collect();
        if args.json {
            println!(
                "{}",
                serde_json::json!({"gpu": g.name(), "arch": g.arch(), "kernels": results, "failed": failed.len()})
            );
        } else {
            let which = if args.only.is_some() {
                "the attention kernels"
            } else {
                "every kernel"
            };
            println!("{} ({}): {which} vs the CPU oracle", g.name(), g.arch());
            println!(
                "{:<55} {:>6} {:>10} {:>10} {:>8}  ok",
                "kernel output", "prec", "rel L2", "rel max", "bound"
            );
            for c in &results {
                println!(
                    "{:<55} {:>6} {:>10.2e} {:>10.2e} {:>8.0e}  {}",
                    c.what,
                    c.precision,
                    c.rel_l2,
                    c.rel_max,
                    c.bound,
                    if c.passed() { "yes" } else { "NO" }
                );
            }
        }
        if !failed.is_empty() {
            bail!("{} kernel outputs exceed their bounds", failed.len());
        }
        Ok(())
    }

    /// Times the products of a step in every way and prints the report as one JSON object.
    pub(super) fn gemm(args: &GemmArgs) -> Result<()> {
        let mut g = Gpu::open(args.device, Precision::Bf16)?;
        let shape = (args.rows, args.d_model, args.vocab, gpu::stage::CHUNK_ROWS);
        let report = gpu::gemm_bench::run(&mut g, shape, args.reps)?;
        let mut json = serde_json::to_value(&report)?;
        json["gpu"] = g.name().into();
        json["arch"] = g.arch().into();
        println!("{json}");
        Ok(())
    }

    /// Prints the preflight report as one JSON line; an error (exit 1) when no GPU opened.
    pub(super) fn info(args: &InfoArgs) -> Result<()> {
        let info = gpu::info::collect(args.device);
        println!("{}", serde_json::to_string(&info)?);
        if !info.opened {
            bail!(
                "no GPU opened: {}",
                info.error.as_deref().unwrap_or("unknown reason")
            );
        }
        Ok(())
    }

    /// Fills the kernel cache (PTX and cubin) for each architecture asked for (compiling what it
    /// lacks or what is damaged).
    pub(super) fn ptx(args: &PtxArgs) -> Result<()> {
        for name in &args.archs {
            let Some(&arch) = gpu::compile::ARCHS.iter().find(|a| **a == name.as_str()) else {
                bail!(
                    "unknown architecture {name}: use one of {}",
                    gpu::compile::ARCHS.join(", ")
                );
            };
            let started = Instant::now();
            let (files, compiled) = gpu::compile::fill_cache(arch)?;
            let how = if compiled {
                format!("compiled in {:.1} s", started.elapsed().as_secs_f64())
            } else {
                "already cached".to_string()
            };
            println!(
                "{arch}: {} and {} ({how})",
                files.cubin.display(),
                files.ptx.display()
            );
        }
        Ok(())
    }

    /// What `seqpipe gpu bench` prints (the keys of scripts/gpu-torch-bench.py's line).
    #[derive(Serialize)]
    struct Report {
        /// `seqpipe`, or in BF16 mode `seqpipe (bf16 <path>)` (`cached-weights`, `operands`,
        /// `fp32-operands`).
        #[serde(rename = "impl")]
        implementation: String,
        /// How the products ran: the precision, in BF16 mode the path (and the head's padding).
        products: String,
        gpu: String,
        preset: crate::bench::step::Preset,
        precision: &'static str,
        /// Where the attention runs: `tensor cores` (BF16 mode, compute capability ≥ 8.0) or
        /// `cuda cores` (FP32 arithmetic).
        attention: &'static str,
        batch: usize,
        seq_len: usize,
        params: usize,
        flops_per_token: f64,
        warmup: usize,
        steps: usize,
        step_ms: Vec<f64>,
        median_ms: f64,
        tokens_per_s: f64,
        mfu: f64,
        /// Device memory taken by the stage (its BF16 weight copies included).
        peak_mem_mib: f64,
        /// Of which the BF16 weight copies of the fast path (0 otherwise).
        bf16_weight_copies_mib: f64,
        /// Micro-batches per step and segments per sequence (1 and 1: one unit per step).
        micro_batches: usize,
        segments: usize,
        losses: Vec<f64>,
        final_params_blake3: String,
        grad_check: Option<GradCheck>,
        /// With `--profile`: where the profiled steps' time went (gpu::Profile).
        profile: Option<gpu::Profile>,
    }

    /// Unit `(micro_batch, segment)`'s values of a `(batch, seq)` row-major array cut into
    /// `micro_batches` groups of rows and `segments` equal column ranges.
    fn unit_values(
        flat: &[u32],
        (batch, seq): (usize, usize),
        (micro_batches, segments): (usize, usize),
        (mb, segment): (usize, usize),
    ) -> Vec<u32> {
        let (rows, len) = (batch / micro_batches, seq / segments);
        (mb * rows..(mb + 1) * rows)
            .flat_map(|r| &flat[r * seq + segment * len..r * seq + (segment + 1) * len])
            .copied()
            .collect()
    }

    #[derive(Serialize)]
    struct GradCheck {
        worst_rel_l2: f64,
        worst_param: String,
        loss_gpu: f64,
        loss_cpu: f64,
        /// Enforced in FP32 only (`null` otherwise: TF32 and BF16 products round by design).
        bound: Option<f64>,
    }

    impl GradCheck {
        /// Refuses gradients past the bound (a NaN included), naming the worst parameter.
        fn within_bound(&self) -> Result<()> {
            if let Some(bound) = self.bound
                && (self.worst_rel_l2.is_nan() || self.worst_rel_l2 > bound)
            {
                bail!(
                    "GPU gradients differ from the CPU stage's: {} has relative L2 error {:.2e} (bound {bound:.0e})",
                    self.worst_param,
                    self.worst_rel_l2,
                );
            }
            Ok(())
        }
    }

    /// Dense peak FLOP/s of an H100/H200 (SXM) by precision: the MFU denominators
    /// (scripts/gpu-torch-bench.py uses the same).
    fn peak_flops(p: Precision) -> f64 {
        match p {
            Precision::Fp32 => 66.9e12,
            Precision::Tf32 => 494.7e12,
            Precision::Bf16 => 989.4e12,
        }
    }

    /// The CPU stage's initial weights as the GPU stage takes them.
    fn initial_params(stage: &Stage) -> Result<Vec<StageParam>> {
        let mut params = Vec::new();
        for spec in stage.params().specs() {
            let t = stage.params().get(&spec.name)?;
            params.push(StageParam {
                name: spec.name.clone(),
                dims: spec.shape.clone(),
                values: t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            });
        }
        Ok(params)
    }

    /// The GPU gradient furthest from the CPU stage's (relative L2; NaN counts as the worst).
    fn worst_gradient(m: &GpuStage, stage: &Stage) -> Result<(f64, String)> {
        let mut worst = (0.0f64, String::new());
        for (name, _, got) in m.gradients()? {
            let want = stage
                .grads()
                .get(&name)
                .with_context(|| format!("the CPU stage has no gradient for {name}"))?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let (mut num, mut den) = (0f64, 0f64);
            for (a, b) in got.iter().zip(&want) {
                num += (*a as f64 - *b as f64).powi(2);
                den += (*b as f64).powi(2);
            }
            let rel = if den > 0.0 {
                (num / den).sqrt()
            } else {
                num.sqrt()
            };
            if rel.is_nan() || rel > worst.0 {
                worst = (rel, name);
            }
        }
        Ok(worst)
    }

    /// BLAKE3 of the parameters (names and values, AdamW moments left out).
    fn params_hash(m: &GpuStage) -> Result<String> {
        let mut hasher = blake3::Hasher::new();
        for (name, _, values) in m
            .state()?
            .into_iter()
            .filter(|(n, _, _)| !n.starts_with("optim."))
        {
            hasher.update(name.as_bytes());
            for v in values {
                hasher.update(&v.to_le_bytes());
            }
        }
        Ok(hasher.finalize().to_hex().to_string())
    }

    /// The shape a bench run trains, checked: the preset's model, `batch` rows of `seq` tokens cut
    /// into `micro_batches` × `segments` units.
    struct BenchShape {
        model: ModelConfig,
        batch: usize,
        seq: usize,
        micro_batches: usize,
        segments: usize,
    }

    impl BenchShape {
        fn from_args(args: &GpuBenchArgs) -> Result<Self> {
            let (model, preset_batch, seq) = args.preset.shape();
            let batch = args.batch.unwrap_or(preset_batch);
            if batch == 0 || args.steps == 0 {
                bail!("--batch and --steps must be at least 1");
            }
            let (mbs, segs) = (args.micro_batches, args.segments);
            if mbs == 0 || segs == 0 || !batch.is_multiple_of(mbs) || !seq.is_multiple_of(segs) {
                bail!(
                    "--micro-batches {mbs} must divide the batch ({batch}) and --segments {segs} the sequence length ({seq}), both at least 1"
                );
            }
            if args.check && (mbs, segs) != (1, 1) {
                bail!(
                    "--check compares one unit per step with the CPU stage: leave out --micro-batches and --segments"
                );
            }
            if args.profile && args.profile_steps == 0 {
                bail!("--profile-steps must be at least 1");
            }
            Ok(Self {
                model,
                batch,
                seq,
                micro_batches: mbs,
                segments: segs,
            })
        }

        /// The loss of a step is a sum over its tokens; this makes it their mean.
        fn loss_scale(&self) -> f64 {
            1.0 / (self.batch * self.seq) as f64
        }
    }

    /// One training step of the whole model on one GPU stage, in the pipeline's order on a
    /// single stage: each micro-batch's segments forward, then backward in reverse (1F1B of one
    /// stage); then the optimizer update as the runtime does it.
    struct BenchStep {
        /// Each unit's tokens and targets, by micro-batch then segment.
        units: Vec<Vec<(Vec<u32>, Vec<u32>)>>,
        loss_scale: f64,
    }

    impl BenchStep {
        fn new(shape: &BenchShape, inputs: &[u32], targets: &[u32]) -> Self {
            let (mbs, segs) = (shape.micro_batches, shape.segments);
            let units = (0..mbs)
                .map(|mb| {
                    (0..segs)
                        .map(|j| {
                            let cut = |flat: &[u32]| {
                                unit_values(flat, (shape.batch, shape.seq), (mbs, segs), (mb, j))
                            };
                            (cut(inputs), cut(targets))
                        })
                        .collect()
                })
                .collect();
            Self {
                units,
                loss_scale: shape.loss_scale(),
            }
        }

        /// Forward and backward of every unit; returns the step's summed loss.
        fn gradients(&self, m: &mut GpuStage) -> Result<f64> {
            m.begin_step(self.units.len());
            let mut loss = 0.0;
            for (mb, unit) in self.units.iter().enumerate() {
                for (j, (inputs, targets)) in unit.iter().enumerate() {
                    let out = m.forward(
                        (mb, j),
                        UnitInput::Tokens(inputs),
                        Some(targets),
                        self.loss_scale,
                        true,
                    )?;
                    let UnitOutput::LossSum(l) = out else {
                        bail!("a stage holding the whole model ends in the loss");
                    };
                    loss += l;
                }
                for j in (0..unit.len()).rev() {
                    m.backward((mb, j), None)?;
                }
            }
            m.finish_gradients()?;
            Ok(loss)
        }

        /// Global-norm clipping as the runtime does it (sums of squares in canonical order), then
        /// AdamW.
        fn update(&self, m: &mut GpuStage) -> Result<()> {
            let adamw = AdamWConfig::default();
            let betas = (adamw.beta1, adamw.beta2, adamw.eps);
            let weight_decay = WeightDecay {
                rate: WEIGHT_DECAY,
                embeddings: false,
            };
            let sums = m.grad_sums_of_squares()?;
            let norm = ops::clip::global_norm(sums.into_iter().map(|(_, s)| s));
            let clip = ops::clip::clip_coefficient(norm, GRAD_CLIP);
            m.apply_update(LR, clip, weight_decay, betas)?;
            Ok(())
        }

        /// A whole step; returns its mean loss.
        fn run(&self, m: &mut GpuStage) -> Result<f64> {
            let loss = self.gradients(m)?;
            self.update(m)?;
            Ok(loss * self.loss_scale)
        }
    }

    /// `--check`: one step's gradients on the GPU against the CPU stage's from the same weights
    /// and tokens (then the GPU step's update, so the timed steps start from the same state as
    /// without it).
    fn check_against_cpu(
        step: &BenchStep,
        m: &mut GpuStage,
        stage: &mut Stage,
        (inputs, targets): (&Tensor, &Tensor),
        precision: Precision,
    ) -> Result<GradCheck> {
        let loss_gpu = step.gradients(m)?;
        let loss_cpu = gradients(stage, inputs, targets, step.loss_scale)?;
        let (worst_rel_l2, worst_param) = worst_gradient(m, stage)?;
        step.update(m)?;
        Ok(GradCheck {
            worst_rel_l2,
            worst_param,
            loss_gpu: loss_gpu * step.loss_scale,
            loss_cpu: loss_cpu * step.loss_scale,
            bound: (precision == Precision::Fp32).then_some(GRAD_BOUND_FP32),
        })
    }

    /// `warmup + steps` synchronised steps; returns the times of the last `steps`, in ms.
    fn timed_steps(
        step: &BenchStep,
        m: &mut GpuStage,
        (warmup, steps): (usize, usize),
        losses: &mut Vec<f64>,
    ) -> Result<Vec<f64>> {
        let mut step_ms = Vec::new();
        for i in 0..warmup + steps {
            m.gpu().sync()?;
            let started = Instant::now();
            losses.push(step.run(m)?);
            m.gpu().sync()?;
            if i >= warmup {
                step_ms.push(started.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok(step_ms)
    }

    /// `--profile`: `steps` profiled steps after one that creates the timing events they reuse.
    fn profiled_steps(
        step: &BenchStep,
        m: &mut GpuStage,
        steps: usize,
        losses: &mut Vec<f64>,
    ) -> Result<gpu::Profile> {
        m.gpu().profile_begin()?;
        losses.push(step.run(m)?);
        m.gpu().profile_end(1)?;
        m.gpu().profile_begin()?;
        for _ in 0..steps {
            losses.push(step.run(m)?);
        }
        Ok(m.gpu().profile_end(steps)?)
    }

    /// The GPU of `--device` in `precision`, with the BF16 path the flags ask for.
    fn open_gpu(args: &GpuBenchArgs, precision: Precision) -> Result<Gpu> {
        let mut g = Gpu::open(args.device, precision)?;
        g.set_bf16_path(if args.bf16_operands {
            gpu::Bf16Path::Operands
        } else {
            args.bf16_path.parse().map_err(anyhow::Error::msg)?
        });
        Ok(g)
    }

    pub(super) fn bench(args: &GpuBenchArgs) -> Result<()> {
        let precision: Precision = args.precision.parse().map_err(anyhow::Error::msg)?;
        let shape = BenchShape::from_args(args)?;
        let (model, batch, seq) = (&shape.model, shape.batch, shape.seq);
        let (mbs, segs) = (shape.micro_batches, shape.segments);
        let g = open_gpu(args, precision)?;
        let layout = StageLayout {
            stage: 0,
            stages: 1,
            layers: 0..model.layers,
        };
        // The CPU stage gives the initial weights (same seed, same names) and, with --check, the
        // reference gradients.
        let mut stage = Stage::new(model, layout, vec![seq], args.seed)?;
        let params = initial_params(&stage)?;
        let (inputs, targets) = random_batch(model, batch, seq, args.seed)?;
        let step = BenchStep::new(
            &shape,
            &inputs.flatten_all()?.to_vec1::<u32>()?,
            &targets.to_vec1::<u32>()?,
        );
        let plan = StagePlan::whole(model.clone(), vec![seq / segs; segs]);
        let free_before = g.memory()?.0;
        // The pipeline's CUDA stage, holding the whole model: one micro-batch of one segment.
        let mut m = GpuStage::new(g, plan, params).context("building the model on the GPU")?;
        let mut losses = Vec::new();
        let grad_check = if args.check {
            let check =
                check_against_cpu(&step, &mut m, &mut stage, (&inputs, &targets), precision)?;
            losses.push(check.loss_gpu);
            Some(check)
        } else {
            None
        };
        let step_ms = timed_steps(&step, &mut m, (args.warmup, args.steps), &mut losses)?;
        let profile = if args.profile {
            let p = profiled_steps(&step, &mut m, args.profile_steps, &mut losses)?;
            println!(
                "profile of {} steps ({batch} x {seq} tokens, {mbs} micro-batches x {segs} segments, median unprofiled step {:.3} ms):",
                args.profile_steps,
                median(&step_ms)
            );
            print!("{}", p.table());
            Some(p)
        } else {
            None
        };
        let g = m.gpu();
        let free_after = g.memory()?.0;
        let params = param_count(model);
        let flops_per_token =
            6.0 * params as f64 + 12.0 * (model.layers * model.d_model * seq) as f64;
        let median_ms = median(&step_ms);
        let tokens_per_s = (batch * seq) as f64 / (median_ms / 1e3);
        let report = Report {
            implementation: match g.precision() {
                Precision::Bf16 => format!("seqpipe (bf16 {})", g.bf16_path().name()),
                _ => "seqpipe".to_string(),
            },
            products: m.products(),
            gpu: g.name().to_string(),
            preset: args.preset,
            precision: precision.name(),
            attention: if g.attention_on_tensor_cores() {
                "tensor cores"
            } else {
                "cuda cores"
            },
            batch,
            seq_len: seq,
            params,
            flops_per_token,
            warmup: args.warmup,
            steps: args.steps,
            median_ms,
            tokens_per_s,
            mfu: flops_per_token * tokens_per_s / peak_flops(precision),
            peak_mem_mib: free_before.saturating_sub(free_after) as f64 / (1u64 << 20) as f64,
            bf16_weight_copies_mib: m.bf16_weight_bytes() as f64 / (1u64 << 20) as f64,
            micro_batches: mbs,
            segments: segs,
            profile,
            step_ms,
            losses,
            final_params_blake3: params_hash(&m)?,
            grad_check,
        };
        println!("{}", serde_json::to_string(&report)?);
        report
            .grad_check
            .as_ref()
            .map_or(Ok(()), GradCheck::within_bound)
    }

    #[cfg(test)]
    mod tests {
        use super::unit_values;

        #[test]
        fn units_cut_rows_into_micro_batches_and_columns_into_segments() {
            // (batch 4, seq 6): value = 10 * row + column.
            let flat: Vec<u32> = (0..4)
                .flat_map(|r| (0..6).map(move |c| 10 * r + c))
                .collect();
            let shape = (4, 6);
            assert_eq!(unit_values(&flat, shape, (1, 1), (0, 0)), flat);
            assert_eq!(
                unit_values(&flat, shape, (2, 3), (1, 2)),
                vec![24, 25, 34, 35]
            );
            assert_eq!(unit_values(&flat, shape, (4, 2), (0, 1)), vec![3, 4, 5]);
            // Every unit once: the whole array, each value once.
            let mut all: Vec<u32> = (0..2)
                .flat_map(|mb| (0..3).map(move |j| (mb, j)))
                .flat_map(|u| unit_values(&flat, shape, (2, 3), u))
                .collect();
            all.sort();
            assert_eq!(all, flat);
        }
    }
}
