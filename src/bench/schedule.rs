//! `seqpipe bench schedule`: the pipeline schedules (GPipe, 1F1B, Seq1F1B and the interleaved
//! 1F1B-I and Seq1F1B-I, with whatever else the runtime runs) measured on real pipeline runs.
//!
//! Each configuration (schedule, micro-batches, k, partition, sequence length) trains a few steps of the same
//! model and batch through the real runtime (one worker process per stage, one compute thread
//! each, real TCP) with a trace. From the steps after the first it reads each stage's peak bytes
//! of live activations (measured by the stages from their saved contexts and K/V prefixes) and
//! every unit's compute time (the worker's CPU time during the unit), and replays those times through
//! the schedule's dependency graph ([`replay`]): the step time and bubble that `p` dedicated
//! devices would see. The machine's wall-clock step time is printed beside it; with fewer cores
//! than stages the stages share cores, so wall clock is not what a pipeline of devices would do.
//!
//! Split-backward runs (`seq1f1b-zb`) also report the least bubble any split-backward order
//! could replay with their unit times at Seq1F1B's per-stage memory
//! ([`split_backward_bound`]; `seq1f1b-zb` holds up to the job's peak on every stage and goes
//! below it) and the weight halves' share of the backward; every run also
//! reports its order's bubble with every F, I and W taking one time unit (ZB-H1's setting).
//! `--d-model` sets the width (heads of 64): the narrow default spends most of a backward in
//! attention, all of which is input half, so there is little weight half to move.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde::Serialize;
use serde_json::Value;

use trainer::config::Config;
use trainer::plan::RunPlan;
use trainer::runtime::error::LaunchError;
use trainer::runtime::run::{LaunchOptions, run_training};
use trainer::schedule::{
    Action, FlopsModel, MeasuredCosts, Op, Partition, Schedule, ScheduleKind, UnitCosts,
    formula_bubble, replay, segment_flops, simulate, split_backward_bound,
};

/// Flags of `seqpipe bench schedule`.
#[derive(Args, Debug)]
pub struct ScheduleBenchArgs {
    /// Sequence lengths to run (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1024,2048,4096,8192")]
    seq_lens: Vec<usize>,
    /// Schedules to run (comma-separated): gpipe, 1f1b, seq1f1b, 1f1b-i, seq1f1b-i, seq1f1b-zb.
    #[arg(long, value_delimiter = ',', default_value = "gpipe,1f1b,seq1f1b")]
    schedules: Vec<ScheduleKind>,
    /// Micro-batches per step (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "4")]
    microbatches: Vec<usize>,
    /// Layer chunks per worker for the interleaved kinds (1f1b-i, seq1f1b-i); the model needs
    /// at least stages × this many layers.
    #[arg(long, default_value_t = 2)]
    virtual_stages: usize,
    /// Segments per micro-batch of the Seq1F1B kinds (comma-separated; the others run whole
    /// sequences).
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    splits: Vec<usize>,
    /// Segment partitions of the Seq1F1B kinds (comma-separated): uniform, compute.
    #[arg(long, value_delimiter = ',', default_value = "uniform,compute")]
    partitions: Vec<Partition>,
    /// Steps per run; all but the first (the warm-up) are measured.
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Model width of every run, a multiple of 64 (heads of 64: d_model / 64 of them); the
    /// default is the benchmark's narrow 128 with 2 heads.
    #[arg(long)]
    d_model: Option<usize>,
    /// Override a config key of every run (repeatable), after the benchmark's own settings
    /// (4 stages × 2 layers, d_model 128, 2 heads, vocab 512, micro-batches of 1 sequence) and
    /// `--d-model`.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    overrides: Vec<String>,
    /// Also write every run's numbers as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Instead of real runs, compare 1f1b, 1f1b-i, seq1f1b, seq1f1b-i and seq1f1b-zb on the
    /// simulator's FLOPs cost model (p = 4, v = 2, m ∈ {4, 8}, k ∈ {2, 4}, T ∈ {2048, 8192}),
    /// including the kinds the runtime cannot run yet; see [`super::schedule_family`].
    #[arg(long)]
    simulated: bool,
}

/// The model and batch of every run (before `--set`).
const BASE: [&str; 13] = [
    "model.layers=8",
    "model.d_model=128",
    "model.heads=2",
    "model.vocab_size=512",
    "train.micro_batch_size=1",
    "train.eval_every=0",
    "pipeline.stages=4",
    "elastic.mid_step=false",
    // A busy host may take minutes per step at long sequences; no stage is lost here.
    "pipeline.timeout_s=3600",
    "checkpoint.every=0",
    "elastic.peer_snapshots=false",
    "run.threads_per_worker=1",
    "run.log=warn",
];

/// One configuration's numbers.
#[derive(Clone, Debug, Serialize)]
pub struct ScheduleRun {
    /// Schedule kind.
    pub schedule: ScheduleKind,
    /// Layer chunks per worker (1 but for the interleaved kinds).
    pub virtual_stages: usize,
    /// Micro-batches per step.
    pub microbatches: usize,
    /// Segments per micro-batch.
    pub splits: usize,
    /// Segment partition.
    pub partition: Partition,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Segment lengths used.
    pub segment_lengths: Vec<usize>,
    /// Per worker: peak bytes of live activations in the measured step (all its chunks at once).
    pub peak_activation_bytes: Vec<u64>,
    /// Replayed step time on dedicated devices (seconds).
    pub replayed_step_s: f64,
    /// Replayed bubble fraction.
    pub replayed_bubble: f64,
    /// Replayed bubble fraction with every unit's time averaged over the stages: balanced stages,
    /// as the formula assumes (the first stage's embedding and the last one's head and loss make
    /// the real stages unequal).
    pub balanced_bubble: f64,
    /// Per stage: replayed compute time of the step (seconds).
    pub stage_busy_s: Vec<f64>,
    /// The kind's formula for equal-cost units ([`formula_bubble`]): `(p−1)/(slots + p−1)`.
    pub formula_bubble: f64,
    /// The order's bubble with every F, I and W taking one time unit (a whole backward two).
    pub synthetic_bubble: f64,
    /// Split backwards only: the least bubble any split-backward order could replay with the
    /// measured unit times at Seq1F1B's per-stage memory ([`split_backward_bound`]); the
    /// `seq1f1b-zb` order, holding up to the job's peak on every stage, replays at or below it.
    pub memory_bound_bubble: Option<f64>,
    /// Split backwards only: the weight halves' share of the measured backward time.
    pub weight_share: Option<f64>,
    /// Wall-clock time of the measured step on this machine (seconds).
    pub wall_step_s: f64,
    /// Per segment j: mean forward time of a unit of segment j, summed over the stages.
    pub segment_forward_s: Vec<f64>,
    /// Per segment j: mean backward time of a unit of segment j, summed over the stages.
    pub segment_backward_s: Vec<f64>,
    /// Per segment j: the FLOPs model's dense part (γ = 0) of a micro-batch's segment j.
    pub segment_dense_flops: Vec<f64>,
    /// Per segment j: the FLOPs model's attention part (the terms γ weights).
    pub segment_attention_flops: Vec<f64>,
}

impl ScheduleRun {
    /// Per segment j: mean forward + backward time of a unit of segment j, summed over the stages.
    pub fn segment_unit_s(&self) -> Vec<f64> {
        self.segment_forward_s
            .iter()
            .zip(&self.segment_backward_s)
            .map(|(f, b)| f + b)
            .collect()
    }

    /// The largest worker's peak bytes of live activations.
    pub fn max_peak_bytes(&self) -> u64 {
        self.peak_activation_bytes
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
    }

    /// Slowest over fastest segment time (1 with one segment).
    pub fn segment_imbalance(&self) -> f64 {
        let unit = self.segment_unit_s();
        let max = unit.iter().copied().fold(0.0, f64::max);
        let min = unit.iter().copied().fold(f64::INFINITY, f64::min);
        if min > 0.0 { max / min } else { f64::NAN }
    }
}

/// Runs the benchmark and prints one line per configuration and the comparisons the schedules
/// are judged by.
pub fn run(args: &ScheduleBenchArgs) -> Result<()> {
    if args.simulated {
        return super::schedule_family::run(args.json.as_deref());
    }
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if let Some(d) = args.d_model
        && (d == 0 || !d.is_multiple_of(64))
    {
        bail!("--d-model {d}: give a positive multiple of 64 (the heads are 64 wide)");
    }
    let dir = std::env::temp_dir().join(format!("seqpipe-bench-schedule-{}", std::process::id()));
    let mut runs = Vec::new();
    let mut header = true;
    let shapes = args.seq_lens.iter().flat_map(|&t| {
        let kinds = args
            .microbatches
            .iter()
            .flat_map(move |&m| args.schedules.iter().map(move |&kind| (t, m, kind)));
        kinds.collect::<Vec<_>>()
    });
    for (seq_len, microbatches, schedule) in shapes {
        let variants: Vec<(usize, Partition)> = if segmented(schedule) {
            args.splits
                .iter()
                .flat_map(|&k| args.partitions.iter().map(move |&p| (k, p)))
                .collect()
        } else {
            vec![(1, Partition::Uniform)]
        };
        for (splits, partition) in variants {
            let shape = Shape {
                seq_len,
                microbatches,
                schedule,
                splits,
                partition,
            };
            let cfg = run_config(args, &dir, &shape)?;
            if header {
                print_header(&cfg);
                header = false;
            }
            match measure(&cfg, &dir) {
                Ok(run) => {
                    print_run(&run);
                    runs.push(run);
                }
                Err(e) => match e.downcast_ref::<LaunchError>() {
                    Some(LaunchError::OverBudget { stage, .. }) => println!(
                        "{:>10} {:>2} {:>2} {:>9} {:>6} | does not fit train.memory_budget_bytes = {} (stage {stage} went over it)",
                        schedule.to_string(),
                        microbatches,
                        splits,
                        partition.to_string(),
                        seq_len,
                        cfg.train.memory_budget_bytes
                    ),
                    _ => {
                        return Err(e.context(format!(
                            "running {schedule} m={microbatches} k={splits} {partition} at sequence length {seq_len}"
                        )));
                    }
                },
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    print_comparisons(&runs);
    print_family_table(&runs);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&runs)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The schedule family's table (BENCHMARKS.md "Schedules"), one markdown row per (T, m, k,
/// partition) of the segmented runs: every kind's replayed bubble (its formula's), the largest
/// worker's peak MiB, and `seq1f1b-i` and `seq1f1b-zb` against `seq1f1b` (bubble · largest
/// worker's peak · replayed step). The kinds without segments (`1f1b`, `1f1b-i`) repeat on
/// every k's row; a kind not run, or over the memory budget, shows "–".
fn print_family_table(runs: &[ScheduleRun]) {
    use ScheduleKind::*;
    const KINDS: [ScheduleKind; 5] = [
        OneFOneB,
        OneFOneBInterleaved,
        Seq1F1B,
        Seq1F1BInterleaved,
        Seq1F1BZeroBubble,
    ];
    let mut rows: Vec<(usize, usize, usize, Partition)> = Vec::new();
    for r in runs.iter().filter(|r| segmented(r.schedule)) {
        let row = (r.seq_len, r.microbatches, r.splits, r.partition);
        if !rows.contains(&row) {
            rows.push(row);
        }
    }
    if rows.is_empty() {
        return;
    }
    println!(
        "| T | m | k | bubble % (formula): 1f1b · 1f1b-i · seq1f1b · seq1f1b-i · seq1f1b-zb | peak MiB, same order | seq1f1b-i / seq1f1b: bubble · peak · step | seq1f1b-zb / seq1f1b: bubble · peak · step |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (t, m, k, part) in rows {
        let find = |kind: ScheduleKind| {
            runs.iter().find(|r| {
                r.schedule == kind
                    && (r.seq_len, r.microbatches) == (t, m)
                    && (!segmented(kind) || (r.splits, r.partition) == (k, part))
            })
        };
        let cells = |cell: &dyn Fn(&ScheduleRun) -> String| {
            KINDS
                .map(|kind| find(kind).map_or_else(|| "–".to_string(), cell))
                .join(" · ")
        };
        let bubbles = cells(&|r| {
            format!(
                "{:.1} ({:.1})",
                100.0 * r.replayed_bubble,
                100.0 * r.formula_bubble
            )
        });
        let peaks = cells(&|r| format!("{:.0}", r.max_peak_bytes() as f64 / (1u64 << 20) as f64));
        let against = |kind| match (find(kind), find(Seq1F1B)) {
            (Some(a), Some(b)) => format!(
                "{:.2} · {:.2} · {:.2}",
                a.replayed_bubble / b.replayed_bubble,
                a.max_peak_bytes() as f64 / b.max_peak_bytes() as f64,
                a.replayed_step_s / b.replayed_step_s
            ),
            _ => "–".into(),
        };
        println!(
            "| {t} | {m} | {k} | {bubbles} | {peaks} | {} | {} |",
            against(Seq1F1BInterleaved),
            against(Seq1F1BZeroBubble)
        );
    }
}

/// Whether `kind` cuts micro-batches into segments (the Seq1F1B family); the others run each
/// micro-batch whole (k = 1).
fn segmented(kind: ScheduleKind) -> bool {
    matches!(
        kind,
        ScheduleKind::Seq1F1B | ScheduleKind::Seq1F1BInterleaved | ScheduleKind::Seq1F1BZeroBubble
    )
}

/// One configuration of the sweep.
struct Shape {
    seq_len: usize,
    microbatches: usize,
    schedule: ScheduleKind,
    splits: usize,
    partition: Partition,
}

fn run_config(args: &ScheduleBenchArgs, dir: &Path, shape: &Shape) -> Result<Config> {
    let Shape {
        seq_len,
        microbatches,
        schedule,
        splits,
        partition,
    } = *shape;
    let virtual_stages = if schedule.is_interleaved() {
        args.virtual_stages
    } else {
        1
    };
    let mut overrides: Vec<String> = BASE.iter().map(|s| s.to_string()).collect();
    if let Some(d) = args.d_model {
        overrides.extend([
            format!("model.d_model={d}"),
            format!("model.heads={}", d / 64),
        ]);
    }
    overrides.extend([
        format!("model.max_seq_len={seq_len}"),
        format!("train.seq_len={seq_len}"),
        format!("train.steps={}", args.steps),
        format!("pipeline.schedule={schedule}"),
        format!("pipeline.microbatches={microbatches}"),
        format!("pipeline.virtual_stages={virtual_stages}"),
        format!("pipeline.splits={splits}"),
        format!("pipeline.partition={partition}"),
        format!("run.dir={}", dir.join("run").display()),
    ]);
    overrides.extend(args.overrides.iter().cloned());
    Ok(Config::default().with_overrides(&overrides)?)
}

fn print_header(cfg: &Config) {
    let m = &cfg.model;
    println!(
        "model: {} layers over {} stages, d_model {}, {} heads, vocab {}; micro-batches of {} sequence(s); one compute thread per stage",
        m.layers, cfg.pipeline.stages, m.d_model, m.heads, m.vocab_size, cfg.train.micro_batch_size
    );
    if let Some(budget) = cfg.train.memory_budget() {
        println!(
            "memory budget: {budget} bytes ({:.1} MiB) per stage (with virtual stages per worker, its chunks together) for parameters, gradients, AdamW moments and live activations",
            budget as f64 / (1u64 << 20) as f64
        );
    }
    println!(
        "replayed = the measured unit times (worker CPU time) replayed through the schedule's dependencies: what {} dedicated devices would take; this machine has {} cores, so its wall clock is not that",
        cfg.pipeline.stages,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:>10} {:>2} {:>2} {:>9} {:>6} | {:>34} | {:>9} {:>8} {:>8} {:>8} | {:>8} | {:>9}",
        "schedule",
        "m",
        "k",
        "partition",
        "seq",
        "peak activations per stage (MiB)",
        "replay s",
        "bubble",
        "balanced",
        "formula",
        "wall s",
        "seg max/min"
    );
}

fn print_run(r: &ScheduleRun) {
    let peaks: Vec<String> = r
        .peak_activation_bytes
        .iter()
        .map(|&b| format!("{:.1}", b as f64 / (1u64 << 20) as f64))
        .collect();
    println!(
        "{:>10} {:>2} {:>2} {:>9} {:>6} | {:>34} | {:>9.3} {:>7.1}% {:>7.1}% {:>7.1}% | {:>8.3} | {:>9.3}",
        r.schedule.to_string(),
        r.microbatches,
        r.splits,
        r.partition.to_string(),
        r.seq_len,
        peaks.join(" "),
        r.replayed_step_s,
        100.0 * r.replayed_bubble,
        100.0 * r.balanced_bubble,
        100.0 * r.formula_bubble,
        r.wall_step_s,
        r.segment_imbalance()
    );
}

/// The comparisons: Seq1F1B k=4 vs 1F1B on stage 0's peak; each interleaved or zero-bubble kind
/// against its plain counterpart (largest worker peak, replayed bubble); replayed vs formula
/// bubble; the compute partition's segment balance.
fn print_comparisons(runs: &[ScheduleRun]) {
    let find = |kind: ScheduleKind, m: usize, k: usize, part: Partition, seq: usize| {
        runs.iter().find(|r| {
            r.schedule == kind
                && r.microbatches == m
                && r.splits == k
                && (!segmented(kind) || r.partition == part)
                && r.seq_len == seq
        })
    };
    let mut shapes: Vec<(usize, usize)> =
        runs.iter().map(|r| (r.seq_len, r.microbatches)).collect();
    shapes.dedup();
    for (seq, m) in shapes {
        let one = find(ScheduleKind::OneFOneB, m, 1, Partition::Uniform, seq);
        for part in [Partition::Compute, Partition::Uniform] {
            if let (Some(one), Some(s4)) = (one, find(ScheduleKind::Seq1F1B, m, 4, part, seq)) {
                println!(
                    "seq {seq} m={m}: stage-0 peak activations, seq1f1b k=4 {part} / 1f1b = {:.3}",
                    s4.peak_activation_bytes[0] as f64 / one.peak_activation_bytes[0] as f64
                );
            }
        }
    }
    for r in runs {
        let plain = match r.schedule {
            ScheduleKind::OneFOneBInterleaved => ScheduleKind::OneFOneB,
            ScheduleKind::Seq1F1BInterleaved | ScheduleKind::Seq1F1BZeroBubble => {
                ScheduleKind::Seq1F1B
            }
            _ => continue,
        };
        if let Some(base) = find(plain, r.microbatches, r.splits, r.partition, r.seq_len) {
            println!(
                "seq {} m={} k={} {}: {} / {plain}: largest worker peak {:.2}, replayed bubble {:.2}, replayed step {:.2}; F = I = W: bubble {:.2}",
                r.seq_len,
                r.microbatches,
                r.splits,
                r.partition,
                r.schedule,
                r.max_peak_bytes() as f64 / base.max_peak_bytes() as f64,
                r.replayed_bubble / base.replayed_bubble,
                r.replayed_step_s / base.replayed_step_s,
                r.synthetic_bubble / base.synthetic_bubble
            );
            if let (Some(least), Some(share)) = (r.memory_bound_bubble, r.weight_share) {
                println!(
                    "    the least any split-backward order could replay at {plain}'s per-stage memory: bubble {:.2} of {plain}'s ({:.1}%); weight halves {:.0}% of the backward",
                    least / base.replayed_bubble,
                    100.0 * least,
                    100.0 * share
                );
            }
        }
    }
    if let Some((gamma, segments)) = fit_attention_cost(runs) {
        println!(
            "attention cost γ fitted over {segments} segments: {gamma:.2} (time of an attention FLOP / a matmul FLOP; set pipeline.attention_cost = {gamma:.2} for a compute partition of equal time)"
        );
    }
    for r in runs {
        println!(
            "{} m={} k={} {} seq {}: replayed bubble {:.1}% ({:+.1} points vs the formula's {:.1}%); with balanced stages {:.1}% ({:+.1} points); slowest/fastest segment {:.3}",
            r.schedule,
            r.microbatches,
            r.splits,
            r.partition,
            r.seq_len,
            100.0 * r.replayed_bubble,
            100.0 * (r.replayed_bubble - r.formula_bubble),
            100.0 * r.formula_bubble,
            100.0 * r.balanced_bubble,
            100.0 * (r.balanced_bubble - r.formula_bubble),
            r.segment_imbalance()
        );
    }
}

/// Fits `time ≈ a·dense + b·attention` over every segment of the runs with more than one
/// segment (least squares on relative errors) and returns `(γ = b/a, segments used)`; `None`
/// when there is nothing to fit or the fit is degenerate.
fn fit_attention_cost(runs: &[ScheduleRun]) -> Option<(f64, usize)> {
    let (mut dd, mut da, mut aa, mut dt, mut at, mut n) = (0.0, 0.0, 0.0, 0.0, 0.0, 0);
    for r in runs.iter().filter(|r| r.splits > 1) {
        for ((&t, &d), &a) in r
            .segment_unit_s()
            .iter()
            .zip(&r.segment_dense_flops)
            .zip(&r.segment_attention_flops)
        {
            if t <= 0.0 {
                continue;
            }
            let (d, a) = (d / t, a / t); // relative: each segment's residual divided by t
            dd += d * d;
            da += d * a;
            aa += a * a;
            dt += d;
            at += a;
            n += 1;
        }
    }
    let det = dd * aa - da * da;
    if n < 2 || det.abs() <= f64::EPSILON * dd * aa {
        return None;
    }
    let a = (dt * aa - at * da) / det;
    let b = (dd * at - da * dt) / det;
    (a > 0.0 && b > 0.0).then_some((b / a, n))
}

/// Trains `cfg` with a trace and reads the numbers of every step after the first (the warm-up):
/// per unit its least compute time over those steps (contention on a shared machine only ever
/// slows a unit down), per stage its largest peak of activations, and the median wall-clock step.
fn measure(cfg: &Config, dir: &Path) -> Result<ScheduleRun> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let trace = dir.join("trace.json");
    run_training(
        cfg,
        &RunPlan::decide(cfg)?,
        &LaunchOptions {
            quiet: true,
            trace: Some(trace.clone()),
            ..LaunchOptions::default()
        },
    )?;
    let first = if cfg.train.steps > 1 { 2 } else { 1 };
    let (peak_activation_bytes, wall_step_s) = recorded_peaks_and_wall(cfg, first)?;

    let (p, k) = (cfg.pipeline.stages, cfg.pipeline.splits);
    let durations = unit_cpu_times(&std::fs::read(&trace)?, first, p)?;
    let segment_lengths = cfg.segment_lengths()?;
    let costs = MeasuredCosts {
        durations,
        tokens: segment_lengths
            .iter()
            .map(|l| l * cfg.train.micro_batch_size)
            .collect(),
    };
    let (v, m) = (cfg.pipeline.virtual_stages, cfg.pipeline.microbatches);
    // The order the run's workers ran (seq1f1b-zb's depends on the config's byte model).
    let schedule = trainer::memory::training_schedule(cfg, m)?;
    let sim = replay(&schedule, &costs)?;
    let balanced = MeasuredCosts {
        durations: vec![averaged_over_stages(&costs.durations); p],
        tokens: costs.tokens.clone(),
    };
    let balanced_bubble = replay(&schedule, &balanced)?.bubble_fraction;
    let synthetic_bubble = simulate(&schedule, &UnitCosts::uniform(k, 1))?.bubble_fraction;
    let split = cfg.pipeline.schedule.splits_backward();
    let memory_bound_bubble = split
        .then(|| memory_bound_bubble(&schedule, &costs))
        .transpose()?;
    let weight_share = split.then(|| weight_share(&costs.durations));
    let (segment_forward_s, segment_backward_s) = per_segment_times(&costs.durations, k, m);
    let (segment_dense_flops, segment_attention_flops) = per_segment_flops(cfg, &segment_lengths);
    Ok(ScheduleRun {
        schedule: cfg.pipeline.schedule,
        virtual_stages: v,
        microbatches: m,
        splits: k,
        partition: cfg.pipeline.partition,
        seq_len: cfg.train.seq_len,
        segment_lengths,
        peak_activation_bytes,
        replayed_step_s: sim.step_time,
        replayed_bubble: sim.bubble_fraction,
        balanced_bubble,
        stage_busy_s: sim.stages.iter().map(|st| st.busy).collect(),
        formula_bubble: formula_bubble(cfg.pipeline.schedule, p, v, m, k),
        synthetic_bubble,
        memory_bound_bubble,
        weight_share,
        wall_step_s,
        segment_forward_s,
        segment_backward_s,
        segment_dense_flops,
        segment_attention_flops,
    })
}

/// From the metrics of the run `cfg` names, of step `first` on: per stage its largest peak of
/// activations, and the median wall-clock step.
fn recorded_peaks_and_wall(cfg: &Config, first: u64) -> Result<(Vec<u64>, f64)> {
    let metrics = std::fs::read_to_string(cfg.run.dir.join("metrics.jsonl"))?;
    let records: Vec<Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("loss").is_some() && v["step"].as_u64().is_some_and(|s| s >= first))
        .collect();
    if records.is_empty() {
        bail!("no metrics record of step {first} or later");
    }
    let mut peak_activation_bytes = vec![0u64; cfg.pipeline.stages];
    for v in &records {
        let peaks: Vec<u64> = serde_json::from_value(v["peak_activation_bytes"].clone())?;
        for (max, peak) in peak_activation_bytes.iter_mut().zip(peaks) {
            *max = (*max).max(peak);
        }
    }
    let mut walls: Vec<f64> = records
        .iter()
        .filter_map(|v| v["step_time_s"].as_f64())
        .collect();
    walls.sort_by(f64::total_cmp);
    let wall_step_s = walls.get(walls.len() / 2).copied().unwrap_or(f64::NAN);
    Ok((peak_activation_bytes, wall_step_s))
}

/// Per segment (of `k`), the compute seconds of its forwards and of its backwards (input and
/// weight halves together) summed over the stages, per micro-batch (of `m`).
fn per_segment_times(
    durations: &[HashMap<Action, f64>],
    k: usize,
    m: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (mut segment_forward_s, mut segment_backward_s) = (vec![0.0; k], vec![0.0; k]);
    for (action, t) in durations.iter().flatten() {
        let sum = if action.op() == Op::Forward {
            &mut segment_forward_s
        } else {
            &mut segment_backward_s
        };
        sum[action.unit().segment] += t / m as f64;
    }
    (segment_forward_s, segment_backward_s)
}

/// Per segment of `segment_lengths`, the FLOPs of a micro-batch's rows (`cfg`'s model): the
/// dense ones (no attention) and the attention's.
fn per_segment_flops(cfg: &Config, segment_lengths: &[usize]) -> (Vec<f64>, Vec<f64>) {
    let flops = |attention_cost: f64| {
        let m = FlopsModel {
            attention_cost,
            ..cfg.flops_model()
        };
        let starts = segment_lengths.iter().scan(0, |at, &len| {
            *at += len;
            Some(*at - len)
        });
        starts
            .zip(segment_lengths)
            .map(|(start, &len)| segment_flops(start, len, &m) * cfg.train.micro_batch_size as f64)
            .collect::<Vec<f64>>()
    };
    let segment_dense_flops = flops(0.0);
    let segment_attention_flops: Vec<f64> = flops(1.0)
        .iter()
        .zip(&segment_dense_flops)
        .map(|(all, dense)| all - dense)
        .collect();
    (segment_dense_flops, segment_attention_flops)
}

/// The least bubble a split-backward order of `s`'s shape could replay with `costs` at Seq1F1B's
/// per-stage memory: the total busy time against [`split_backward_bound`]'s step on every stage.
fn memory_bound_bubble(s: &Schedule, costs: &MeasuredCosts) -> Result<f64> {
    let time = |r: usize, a: Action| {
        costs.durations[r]
            .get(&a)
            .copied()
            .with_context(|| format!("stage {r}: no measured time for {a}"))
    };
    // Every action's time first, so that the bound's closure needs no error path.
    for r in 0..s.stages {
        for a in s.compute_actions(r) {
            time(r, a)?;
        }
    }
    let bound = split_backward_bound(s.stages, s.microbatches, s.splits, |r, a| {
        costs.durations[r][&a]
    })?;
    let busy: f64 = costs.durations.iter().flat_map(|d| d.values()).sum();
    Ok(1.0 - busy / (s.stages as f64 * bound))
}

/// The weight halves' share of the measured backward time (`W` over `I` + `W`, all stages).
fn weight_share(durations: &[HashMap<Action, f64>]) -> f64 {
    let sum = |op: Op| -> f64 {
        durations
            .iter()
            .flatten()
            .filter(|(a, _)| a.op() == op)
            .map(|(_, t)| t)
            .sum()
    };
    let (i, w) = (sum(Op::BackwardInput), sum(Op::BackwardWeight));
    w / (i + w)
}

/// Each action's mean time over the stages (a replay of it on every stage shows what the
/// segments' imbalance alone leaves, the stages balanced).
pub(crate) fn averaged_over_stages(durations: &[HashMap<Action, f64>]) -> HashMap<Action, f64> {
    let mut mean: HashMap<Action, f64> = HashMap::new();
    for (action, t) in durations.iter().flatten() {
        *mean.entry(*action).or_default() += t / durations.len() as f64;
    }
    mean
}

/// Per stage, each forward/backward unit's least CPU seconds over the steps from `first` on, from
/// a `--trace` file (see [`trainer::runtime::trace`]).
fn unit_cpu_times(trace: &[u8], first: u64, stages: usize) -> Result<Vec<HashMap<Action, f64>>> {
    let trace: Value = serde_json::from_slice(trace).context("reading the trace")?;
    let mut durations = vec![HashMap::new(); stages];
    for e in trace["traceEvents"].as_array().into_iter().flatten() {
        let tid = e["tid"].as_u64().unwrap_or(0) as usize;
        if e["ph"] != "X"
            || tid == 0
            || !matches!(e["cat"].as_str(), Some("forward" | "backward"))
            || e["args"]["step"].as_u64().is_none_or(|s| s < first)
        {
            continue;
        }
        let name = e["name"].as_str().unwrap_or_default();
        let action: Action = name.parse()?;
        let cpu_us = e["args"]["cpu_us"]
            .as_u64()
            .with_context(|| format!("trace slice {name} has no cpu_us"))?;
        let stage: &mut HashMap<Action, f64> = durations
            .get_mut(tid - 1)
            .with_context(|| format!("trace track {tid} is not a stage of {stages}"))?;
        let seconds = cpu_us as f64 * 1e-6;
        stage
            .entry(action)
            .and_modify(|t| *t = f64::min(*t, seconds))
            .or_insert(seconds);
    }
    Ok(durations)
}

#[cfg(test)]
mod tests {
    use super::*;
    use trainer::schedule::generate_virtual;

    /// Measured times of every compute action of `s`: F takes f, I takes i, W takes w (and a
    /// stage `slow` takes twice as long).
    fn costs(s: &Schedule, (f, i, w): (f64, f64, f64), slow: usize) -> MeasuredCosts {
        let durations = (0..s.stages)
            .map(|r| {
                let scale = if r == slow { 2.0 } else { 1.0 };
                s.compute_actions(r)
                    .map(|a| {
                        let t = match a.op() {
                            Op::Forward => f,
                            Op::BackwardInput => i,
                            _ => w,
                        };
                        (a, scale * t)
                    })
                    .collect()
            })
            .collect();
        MeasuredCosts {
            durations,
            tokens: vec![1; s.splits],
        }
    }

    #[test]
    fn the_zero_bubble_order_replays_below_the_per_stage_memory_bound() {
        let s = generate_virtual(ScheduleKind::Seq1F1BZeroBubble, 4, 1, 8, 2).unwrap();
        let even = costs(&s, (1.0, 1.6, 0.2), usize::MAX);
        let least = memory_bound_bubble(&s, &even).unwrap();
        let reached = replay(&s, &even).unwrap().bubble_fraction;
        // Holding up to the job's peak on every stage, the order idles (p−1)·(F+I−W) = 3·2.4
        // where the per-stage bound idles (p−1)·(F+I) = 3·2.6: below the bound.
        let busy = 16.0 * 2.8;
        let want = 1.0 - busy / (busy + 3.0 * 2.4);
        assert!((reached - want).abs() < 1e-9, "{reached} vs {want}");
        assert!(reached < least, "{reached} vs {least}");
        assert!((weight_share(&even.durations) - 0.2 / 1.8).abs() < 1e-12);
        // A slow stage: the bound is its busy time, the replay no shorter.
        let uneven = costs(&s, (1.0, 1.0, 1.0), 2);
        let least = memory_bound_bubble(&s, &uneven).unwrap();
        assert!(least > 0.0 && least <= replay(&s, &uneven).unwrap().bubble_fraction + 1e-12);
        // A measured time missing is named.
        let mut missing = even;
        missing.durations[1].retain(|a, _| a.op() != Op::BackwardWeight);
        let e = memory_bound_bubble(&s, &missing).unwrap_err().to_string();
        assert!(e.contains("stage 1: no measured time for W"), "{e}");
    }
}
