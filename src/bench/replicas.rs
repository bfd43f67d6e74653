//! `seqpipe bench replicas`: what data parallelism costs and buys, measured on real runs.
//!
//! For each replica count d (same p stages, same global batch of m micro-batches of k segments,
//! same seed) it trains a few steps of the same small model through the real runtime (d·p worker
//! processes, one compute thread each, the gradient all-reduce over real TCP) with a trace, and
//! reads from the steps after the first (the warm-up):
//!
//! - the reduction's bytes per step (all workers, and per worker) and its time: the slowest
//!   worker's as `metrics.jsonl` records it (which includes waiting for the other replicas of
//!   its stage to finish their backward), and the time from the moment the last replica of a
//!   stage joined to the end (the transfer and summation alone), slowest stage;
//! - the overlap of the reduction with the backward: the fraction of the reduction's time that
//!   ran before its replica's last backward unit ended, on any stage (from the trace's `reduce`
//!   and `B…` slices). A worker reduces as soon as its own stage is through the backward, so
//!   the later stages' reductions run while the earlier stages still compute;
//! - the replayed step time: each unit's least CPU time over the measured steps replayed through
//!   ONE replica's schedule (p stages, c = m/d micro-batches; [`replay`]), for every replica with
//!   its own times and the slowest taken, each stage's reduction (from the moment its last replica
//!   joined) starting when that stage's backward ends in the replay — what d·p dedicated devices
//!   would take with an interconnect as fast as this machine's loopback —
//!   and its speedup over d = 1 of the same round. Beside it, one micro-batch's CPU seconds over
//!   all stages, which shows how much the units themselves slow down when more workers share
//!   the cores (memory bandwidth and caches: the CPU time leaves out only the waiting);
//! - the summation tree's memory: the most full-gradient buffers a worker held at once (up to
//!   ⌊log2 c⌋ + 1 partial sums, vs 1 for a plain running sum) and the bytes beyond the one
//!   buffer `state_bytes` counts;
//! - the machine's wall-clock step time, for reference only: this machine runs the d·p workers
//!   on its few cores, so its wall clock is not what d·p devices would see.
//!
//! The d values alternate in rounds (1, 2, 4, 1, 2, 4, …) so that drifts of the shared machine
//! hit every d alike, and every round is printed. Every run's final checkpoint (parameters and
//! AdamW moments) and per-step losses must be bit-identical to the first run's: the benchmark
//! fails otherwise, because a comparison of different math would be worthless.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::Value;

use super::final_state;
use trainer::config::Config;
use trainer::plan::RunPlan;
use trainer::runtime::run::{LaunchOptions, run_training};
use trainer::schedule::{Action, MeasuredCosts, replay};

/// Flags of `seqpipe bench replicas`.
#[derive(Args, Debug)]
pub struct ReplicasBenchArgs {
    /// Replica counts d to compare (comma-separated; each must split the micro-batches validly).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    replicas: Vec<usize>,
    /// Pipeline stages p of every replica.
    #[arg(long, default_value_t = 2)]
    stages: usize,
    /// Micro-batches m of the global batch (the same for every d; each replica runs m/d).
    #[arg(long, default_value_t = 8)]
    microbatches: usize,
    /// Segments k per micro-batch (Seq1F1B).
    #[arg(long, default_value_t = 2)]
    splits: usize,
    /// Steps per run; all but the first (the warm-up) are measured.
    #[arg(long, default_value_t = 6)]
    steps: u64,
    /// Rounds: each round runs every d once, in the order given.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Override a config key of every run (repeatable), after the benchmark's own settings
    /// (4 layers, d_model 384, 6 heads, vocab 4096: 10.3M parameters; sequences of 256 tokens,
    /// 1 per micro-batch).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    overrides: Vec<String>,
}

/// The model and batch of every run (before `--set`).
const BASE: [&str; 16] = [
    "model.layers=4",
    "model.d_model=384",
    "model.heads=6",
    "model.vocab_size=4096",
    "model.max_seq_len=256",
    "train.seq_len=256",
    "train.micro_batch_size=1",
    "train.eval_every=0",
    "pipeline.schedule=seq1f1b",
    "pipeline.partition=uniform",
    "checkpoint.every=0",
    "checkpoint.keep_last=1",
    "elastic.peer_snapshots=false",
    "elastic.mid_step=false",
    "run.threads_per_worker=1",
    "run.log=warn",
];

/// One run's numbers (one d in one round).
struct ReplicaRun {
    round: usize,
    d: usize,
    /// Stages per replica.
    p: usize,
    /// Micro-batches per replica.
    c: usize,
    /// Median over the measured steps of the bytes all workers sent in the reduction.
    reduce_bytes: u64,
    /// Median over the measured steps of the slowest worker's reduction seconds (as recorded).
    reduce_s: f64,
    /// Median over the measured steps of the reduction from the moment the last replica of a
    /// stage joined to its end, slowest stage.
    joined_reduce_s: f64,
    /// Fraction of the reduction's time that ran before its replica's last backward unit ended.
    overlap: Option<f64>,
    /// Replay of one replica's schedule with its measured unit times, slowest replica.
    replay_s: f64,
    /// The replayed step: each stage's reduction after its backward in the replay, slowest
    /// replica.
    replayed_s: f64,
    /// Forward + backward CPU seconds of one micro-batch over all stages (slowest replica): how
    /// much the units themselves slow down when more workers share the machine.
    unit_s_per_micro_batch: f64,
    /// Most full-gradient buffers a worker held at once.
    gradient_buffers: usize,
    /// Bytes of the largest stage's parameters (one full-gradient buffer).
    param_bytes: u64,
    /// Median wall-clock step time on this machine.
    wall_s: f64,
}

impl ReplicaRun {
    /// The replayed step: one replica's schedule, each stage's reduction after its backward.
    fn replayed_step_s(&self) -> f64 {
        self.replayed_s
    }

    /// Bytes of the gradient buffers beyond the one `state_bytes` counts (largest stage).
    fn extra_bytes(&self) -> u64 {
        self.gradient_buffers.saturating_sub(1) as u64 * self.param_bytes
    }
}

/// A run's final checkpoint (step, every tensor's raw bytes) and per-step loss bits.
struct Outcome {
    step: u64,
    tensors: BTreeMap<String, Vec<u8>>,
    losses: Vec<u64>,
}

/// Runs the benchmark and prints every round's numbers, then the bit-identity check.
pub fn run(args: &ReplicasBenchArgs) -> Result<()> {
    if args.steps < 2 {
        bail!("--steps must be at least 2 (the first step is the warm-up)");
    }
    if args.replicas.is_empty() || args.rounds == 0 {
        bail!("--replicas and --rounds must not be empty");
    }
    let dir = std::env::temp_dir().join(format!("seqpipe-bench-replicas-{}", std::process::id()));
    let configs: Vec<Config> = args
        .replicas
        .iter()
        .map(|&d| run_config(args, &dir, d))
        .collect::<Result<_>>()?;
    print_header(&configs[0], args);
    let mut runs: Vec<ReplicaRun> = Vec::new();
    let mut reference: Option<(usize, Outcome)> = None;
    let mut mismatches = Vec::new();
    for round in 1..=args.rounds {
        for cfg in &configs {
            let d = cfg.pipeline.replicas;
            let (run, outcome) =
                measure(cfg, round).with_context(|| format!("round {round}, {d} replica(s)"))?;
            let same = match &reference {
                None => {
                    reference = Some((d, outcome));
                    "reference".to_string()
                }
                Some((d0, r)) => match differs(r, &outcome) {
                    None => format!("bit-identical to d={d0}"),
                    Some(why) => {
                        mismatches.push(format!("round {round} d={d}: {why}"));
                        format!("DIFFERS from d={d0}: {why}")
                    }
                },
            };
            let base = runs
                .iter()
                .find(|r| r.round == round && r.d == 1)
                .map(ReplicaRun::replayed_step_s);
            print_run(&run, base, &same);
            runs.push(run);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    print_summary(&runs);
    if !mismatches.is_empty() {
        bail!(
            "the replica counts did not compute the same model: {}",
            mismatches.join("; ")
        );
    }
    Ok(())
}

fn run_config(args: &ReplicasBenchArgs, dir: &Path, d: usize) -> Result<Config> {
    let mut overrides: Vec<String> = BASE.iter().map(|s| s.to_string()).collect();
    overrides.extend([
        format!("train.steps={}", args.steps),
        format!("pipeline.stages={}", args.stages),
        format!("pipeline.microbatches={}", args.microbatches),
        format!("pipeline.splits={}", args.splits),
        format!("pipeline.replicas={d}"),
        format!("run.dir={}", dir.join(format!("d{d}")).display()),
    ]);
    overrides.extend(args.overrides.iter().cloned());
    let cfg = Config::default()
        .with_overrides(&overrides)
        .with_context(|| {
            format!(
                "{d} replicas (valid for {} micro-batches: {:?})",
                args.microbatches,
                valid_for(args.microbatches)
            )
        })?;
    Ok(cfg)
}

/// The valid replica counts for `m` micro-batches.
fn valid_for(m: usize) -> Vec<usize> {
    let mut cfg = Config::default();
    cfg.pipeline.microbatches = m;
    cfg.valid_replicas()
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

fn print_header(cfg: &Config, args: &ReplicasBenchArgs) {
    let m = &cfg.model;
    println!(
        "model: {} layers, d_model {}, {} heads, vocab {}: {:.2}M parameters; global batch {} micro-batches × {} sequence(s) of {} tokens, {} segments each ({}); {} stages per replica; {} steps per run, the first a warm-up",
        m.layers,
        m.d_model,
        m.heads,
        m.vocab_size,
        trainer::model::params::param_count(m) as f64 / 1e6,
        cfg.pipeline.microbatches,
        cfg.train.micro_batch_size,
        cfg.train.seq_len,
        cfg.pipeline.splits,
        cfg.pipeline.schedule,
        cfg.pipeline.stages,
        args.steps
    );
    println!(
        "replay = each unit's least CPU time replayed through ONE replica's schedule (p = {} stages, c = m/d micro-batches), slowest replica; cpu/mb = one micro-batch's forward+backward CPU time over all stages; replayed step = replay with each stage's reduction (after its last replica joined) starting when that stage's backward ends: what d·p dedicated devices would take with this machine's loopback as interconnect",
        cfg.pipeline.stages
    );
    println!(
        "reduce rec. = slowest worker's reduction as metrics.jsonl records it (includes waiting for the other replicas' backward); overlap = share of the reduction run before its replica's last backward unit (any stage) ended",
    );
    println!(
        "wall = this machine's median wall-clock step: it runs d·p workers on {} cores, so it is NOT what d·p devices would see",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:>5} {:>2} {:>2} | {:>9} {:>10} | {:>10} {:>10} {:>7} | {:>9} {:>8} {:>9} {:>7} | {:>9} {:>9} | {:>7} | check",
        "round",
        "d",
        "c",
        "red MiB",
        "MiB/worker",
        "reduce rec",
        "red joined",
        "overlap",
        "cpu/mb ms",
        "replay s",
        "replayed",
        "speedup",
        "grad bufs",
        "extra MiB",
        "wall s",
    );
}

fn print_run(r: &ReplicaRun, base: Option<f64>, check: &str) {
    let overlap = match r.overlap {
        Some(f) => format!("{:.1}%", 100.0 * f),
        None => "-".into(),
    };
    let speedup = match base {
        Some(b) => format!("{:.2}x", b / r.replayed_step_s()),
        None => "-".into(),
    };
    println!(
        "{:>5} {:>2} {:>2} | {:>9.2} {:>10.2} | {:>10.4} {:>10.4} {:>7} | {:>9.2} {:>8.4} {:>9.4} {:>7} | {:>9} {:>9.2} | {:>7.3} | {check}",
        r.round,
        r.d,
        r.c,
        mib(r.reduce_bytes),
        mib(r.reduce_bytes) / (r.d * r.p) as f64,
        r.reduce_s,
        r.joined_reduce_s,
        overlap,
        1e3 * r.unit_s_per_micro_batch,
        r.replay_s,
        r.replayed_step_s(),
        speedup,
        r.gradient_buffers,
        mib(r.extra_bytes()),
        r.wall_s,
    );
}

/// Per d: the median over the rounds of the replayed step and its speedup over d = 1.
fn print_summary(runs: &[ReplicaRun]) {
    let mut ds: Vec<usize> = runs.iter().map(|r| r.d).collect();
    ds.sort_unstable();
    ds.dedup();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let base = median(
        runs.iter()
            .filter(|r| r.d == 1)
            .map(ReplicaRun::replayed_step_s)
            .collect(),
    );
    for d in ds {
        let of_d: Vec<&ReplicaRun> = runs.iter().filter(|r| r.d == d).collect();
        let replayed = median(of_d.iter().map(|r| r.replayed_step_s()).collect());
        let rounds: Vec<String> = of_d
            .iter()
            .map(|r| format!("{:.4}", r.replayed_step_s()))
            .collect();
        println!(
            "d={d}: replayed step {} s over the rounds (median {replayed:.4} s{}); reduction after the last replica joined median {:.4} s; wall median {:.3} s",
            rounds.join(", "),
            if base.is_finite() {
                format!(", {:.2}x d=1", base / replayed)
            } else {
                String::new()
            },
            median(of_d.iter().map(|r| r.joined_reduce_s).collect()),
            median(of_d.iter().map(|r| r.wall_s).collect()),
        );
    }
}

/// `None` when `b` is bit-identical to `a` (same final step, tensors and per-step losses), else
/// what differs first.
fn differs(a: &Outcome, b: &Outcome) -> Option<String> {
    if a.step != b.step {
        return Some(format!("final checkpoint step {} vs {}", a.step, b.step));
    }
    if a.losses != b.losses {
        return Some("per-step losses differ".into());
    }
    if !a.tensors.keys().eq(b.tensors.keys()) {
        return Some("different tensor sets".into());
    }
    a.tensors
        .iter()
        .find(|(name, bytes)| b.tensors[*name] != **bytes)
        .map(|(name, _)| format!("tensor {name} differs"))
}

/// The trace's numbers of one worker slot in one step.
#[derive(Default)]
struct SlotStep {
    /// End of the last backward unit (µs).
    last_backward_end_us: u64,
    /// The reduction's start and duration (µs).
    reduce: Option<(u64, u64)>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Trains `cfg` with a trace and reads its numbers (see the module documentation).
fn measure(cfg: &Config, round: usize) -> Result<(ReplicaRun, Outcome)> {
    let run_dir = &cfg.run.dir;
    let _ = std::fs::remove_dir_all(run_dir);
    std::fs::create_dir_all(run_dir)?;
    let trace_path = run_dir.join("trace.json");
    run_training(
        cfg,
        &RunPlan::decide(cfg)?,
        &LaunchOptions {
            quiet: true,
            trace: Some(trace_path.clone()),
            ..LaunchOptions::default()
        },
    )?;
    let (p, d) = (cfg.pipeline.stages, cfg.pipeline.replicas);
    let c = cfg.pipeline.microbatches / d;
    let first = 2u64;
    let costs = read_step_costs(
        &std::fs::read_to_string(run_dir.join("metrics.jsonl"))?,
        first,
    )?;
    let trace: Value = serde_json::from_slice(&std::fs::read(&trace_path)?)?;
    let (durations, slots) = read_unit_trace(&trace, p, d, first)?;
    let overlap = overlap(&slots, p, d);
    let (joined_reduce_s, joined_by_stage) = joined_reductions(&slots, p, d)?;
    let replayed = replay_replicas(cfg, durations, &joined_by_stage)?;
    let (step, tensors) = final_state(
        &cfg.checkpoint.resolved_url(run_dir),
        &cfg.checkpoint.store_options(),
    )?;
    Ok((
        ReplicaRun {
            round,
            d,
            p,
            c,
            reduce_bytes: costs.reduce_bytes,
            reduce_s: costs.reduce_s,
            joined_reduce_s,
            overlap,
            replay_s: replayed.replay_s,
            replayed_s: replayed.replayed_s,
            unit_s_per_micro_batch: replayed.unit_s_per_micro_batch,
            gradient_buffers: costs.gradient_buffers,
            param_bytes: costs.param_bytes,
            wall_s: costs.wall_s,
        },
        Outcome {
            step,
            tensors,
            losses: costs.losses,
        },
    ))
}

/// What `metrics.jsonl` says of a run: every step's loss bits, and the medians (or maxima) of the
/// steps from `first` on.
struct StepCosts {
    losses: Vec<u64>,
    reduce_bytes: u64,
    reduce_s: f64,
    wall_s: f64,
    gradient_buffers: usize,
    /// Bytes of the largest stage's parameters (one full-gradient buffer): the largest
    /// `state_bytes` over 4.
    param_bytes: u64,
}

/// Reads a run's `metrics.jsonl` text (see [`StepCosts`]).
fn read_step_costs(metrics: &str, first: u64) -> Result<StepCosts> {
    let steps: Vec<Value> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .collect();
    let losses: Vec<u64> = steps
        .iter()
        .map(|v| v["loss"].as_f64().unwrap_or(f64::NAN).to_bits())
        .collect();
    let measured: Vec<&Value> = steps
        .iter()
        .filter(|v| v["step"].as_u64().is_some_and(|s| s >= first))
        .collect();
    if measured.is_empty() {
        bail!("no metrics record of step {first} or later");
    }
    let field = |v: &Value, key: &str| v[key].as_f64().unwrap_or(0.0);
    let reduce_bytes = median(measured.iter().map(|v| field(v, "reduce_bytes")).collect()) as u64;
    let reduce_s = median(measured.iter().map(|v| field(v, "reduce_s")).collect());
    let wall_s = median(measured.iter().map(|v| field(v, "step_time_s")).collect());
    let gradient_buffers = measured
        .iter()
        .filter_map(|v| v["gradient_buffers"].as_u64())
        .max()
        .unwrap_or(0) as usize;
    let param_bytes = measured
        .iter()
        .flat_map(|v| v["state_bytes"].as_array().cloned().unwrap_or_default())
        .filter_map(|b| b.as_u64())
        .max()
        .unwrap_or(0)
        / 4;
    Ok(StepCosts {
        losses,
        reduce_bytes,
        reduce_s,
        wall_s,
        gradient_buffers,
        param_bytes,
    })
}

/// Per replica and stage, each action's unit CPU time.
type UnitTimes = Vec<Vec<HashMap<Action, f64>>>;

/// Per (step, slot): its last backward's end and its reduction.
type SlotSteps = HashMap<(u64, usize), SlotStep>;

/// Reads a run's trace of `d` replicas of `p` stages, steps from `first` on: unit CPU times per
/// (stage, action), least over steps and replicas; per (step, slot) the last backward's end and
/// the reduction.
fn read_unit_trace(
    trace: &Value,
    p: usize,
    d: usize,
    first: u64,
) -> Result<(UnitTimes, SlotSteps)> {
    let mut durations: UnitTimes = vec![vec![HashMap::new(); p]; d];
    let mut slots: SlotSteps = HashMap::new();
    for e in trace["traceEvents"].as_array().into_iter().flatten() {
        let tid = e["tid"].as_u64().unwrap_or(0) as usize;
        let Some(step) = e["args"]["step"].as_u64() else {
            continue;
        };
        if e["ph"] != "X" || tid == 0 || step < first {
            continue;
        }
        let slot = tid - 1;
        if slot >= d * p {
            bail!("trace track {tid} is not a worker of {d} × {p}");
        }
        let (ts, dur) = (
            e["ts"].as_u64().unwrap_or(0),
            e["dur"].as_u64().unwrap_or(0),
        );
        let at = slots.entry((step, slot)).or_default();
        match e["cat"].as_str() {
            Some("reduce") => at.reduce = Some((ts, dur)),
            Some(cat @ ("forward" | "backward")) => {
                if cat == "backward" {
                    at.last_backward_end_us = at.last_backward_end_us.max(ts + dur);
                }
                let name = e["name"].as_str().unwrap_or_default();
                let action: Action = name.parse()?;
                let cpu_s = e["args"]["cpu_us"]
                    .as_u64()
                    .with_context(|| format!("trace slice {name} has no cpu_us"))?
                    as f64
                    * 1e-6;
                durations[slot / p][slot % p]
                    .entry(action)
                    .and_modify(|t| *t = t.min(cpu_s))
                    .or_insert(cpu_s);
            }
            _ => {}
        }
    }
    Ok((durations, slots))
}

/// The step as each replica's own unit times replay it through its schedule.
struct Replayed {
    /// The slowest replica's replayed step.
    replay_s: f64,
    /// The same with each stage's joined reduction after its last unit.
    replayed_s: f64,
    /// The largest replica's unit CPU seconds per micro-batch.
    unit_s_per_micro_batch: f64,
}

/// Replays `cfg`'s schedule with each replica's unit times (`durations`); each stage reduces
/// (`joined_by_stage` seconds) once its own last unit (a backward) is done; the step waits for
/// the slowest replica.
fn replay_replicas(
    cfg: &Config,
    durations: UnitTimes,
    joined_by_stage: &[f64],
) -> Result<Replayed> {
    let c = cfg.pipeline.microbatches / cfg.pipeline.replicas;
    let schedule = trainer::memory::training_schedule(cfg, c)?;
    let tokens: Vec<usize> = cfg
        .segment_lengths()?
        .iter()
        .map(|l| l * cfg.train.micro_batch_size)
        .collect();
    let (mut replay_s, mut replayed_s, mut unit_s_per_micro_batch) = (0.0f64, 0.0f64, 0.0f64);
    for replica in durations {
        let cpu: f64 = replica.iter().flat_map(|stage| stage.values()).sum();
        unit_s_per_micro_batch = unit_s_per_micro_batch.max(cpu / c as f64);
        let costs = MeasuredCosts {
            durations: replica,
            tokens: tokens.clone(),
        };
        let sim = replay(&schedule, &costs)?;
        replay_s = replay_s.max(sim.step_time);
        for (stage, units) in sim.timeline.iter().enumerate() {
            let done = units.iter().map(|u| u.end).fold(0.0, f64::max);
            let reduce = joined_by_stage.get(stage).copied().unwrap_or(0.0);
            replayed_s = replayed_s.max(done + reduce);
        }
    }
    Ok(Replayed {
        replay_s,
        replayed_s,
        unit_s_per_micro_batch,
    })
}

/// The share of the reductions' time (all workers, all measured steps) that ran before the
/// worker's replica finished its backward on every stage; `None` without replicas.
fn overlap(slots: &HashMap<(u64, usize), SlotStep>, p: usize, d: usize) -> Option<f64> {
    let mut backward_end: HashMap<(u64, usize), u64> = HashMap::new();
    for (&(step, slot), s) in slots {
        let end = backward_end.entry((step, slot / p)).or_default();
        *end = (*end).max(s.last_backward_end_us);
    }
    let (mut overlapped_us, mut reduce_us) = (0u64, 0u64);
    for (&(step, slot), s) in slots {
        if let Some((start, dur)) = s.reduce {
            let end = start + dur;
            let backward = backward_end[&(step, slot / p)];
            overlapped_us += backward.min(end).saturating_sub(start);
            reduce_us += dur;
        }
    }
    (d > 1 && reduce_us > 0).then(|| overlapped_us as f64 / reduce_us as f64)
}

/// The reduction from the moment the last replica of a stage joined to its end: the median over
/// the measured steps of the slowest stage's, and each stage's median (zeros without replicas).
fn joined_reductions(
    slots: &HashMap<(u64, usize), SlotStep>,
    p: usize,
    d: usize,
) -> Result<(f64, Vec<f64>)> {
    let mut joined_per_step: Vec<f64> = Vec::new();
    let mut joined_by_stage: Vec<Vec<f64>> = vec![Vec::new(); p];
    if d > 1 {
        let mut step_ids: Vec<u64> = slots.keys().map(|(s, _)| *s).collect();
        step_ids.sort_unstable();
        step_ids.dedup();
        for step in step_ids {
            let mut slowest = 0.0f64;
            for (stage, joined_of_stage) in joined_by_stage.iter_mut().enumerate() {
                let reds: Vec<(u64, u64)> = (0..d)
                    .filter_map(|r| slots.get(&(step, r * p + stage)).and_then(|s| s.reduce))
                    .collect();
                if reds.len() != d {
                    bail!(
                        "step {step}: stage {stage} has {} reductions traced, not {d}",
                        reds.len()
                    );
                }
                let joined = reds.iter().map(|(s, _)| *s).max().unwrap_or(0);
                let end = reds.iter().map(|(s, l)| s + l).max().unwrap_or(0);
                let joined_s = end.saturating_sub(joined) as f64 * 1e-6;
                joined_of_stage.push(joined_s);
                slowest = slowest.max(joined_s);
            }
            joined_per_step.push(slowest);
        }
    }
    Ok((
        median(joined_per_step),
        joined_by_stage.into_iter().map(median).collect(),
    ))
}
