//! `seqpipe bench overhead`: what the runtime costs around the kernels.
//!
//! Two measurements, each run as separate processes of this binary, in alternating rounds:
//! * **One stage**: `seqpipe bench step --preset P` (the whole model's forward, backward and
//!   update in one process, no runtime) next to `seqpipe train` of the same model and batch as a
//!   one-stage pipeline (coordinator, agent, worker, control messages, metrics: everything a real
//!   run does), twice: as configured by default, which copies the whole state (weights and AdamW
//!   moments) to the agents after every step for tier-1 recovery, and with
//!   `elastic.peer_snapshots = false`. Throughput is tokens per second of wall time between step
//!   boundaries (`end_unix_s` of consecutive step records), so nothing the runtime does between
//!   steps is left out; the ratio train / bench step is the runtime's cost (1.0: none).
//! * **Four stages**: the default job (`configs/tiny.toml`, one compute thread per worker). Per
//!   forward or backward unit: the CPU time the worker processes spent outside units (the
//!   update, messages, copies, peer snapshots: `cpu_user_s + cpu_system_s - compute_cpu_s` of
//!   the step records), and the wall time each stage spent outside its units
//!   (`stages × step_time_s - compute_s`: the pipeline bubble, waiting for a core on a machine
//!   with fewer cores than stages, and the runtime).
//!
//! The first step of every run (start-up, first allocations) is not counted.

use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use serde::Serialize;

use super::step::{Preset, median};
use trainer::config::Config;
use trainer::metrics::StepMetrics;
use trainer::runtime::events::{parse_records, steps};

/// Flags of `seqpipe bench overhead`.
#[derive(Args, Debug)]
pub struct OverheadArgs {
    /// Model and batch of the one-stage comparison.
    #[arg(long, value_enum, default_value = "a")]
    preset: Preset,
    /// Timed steps of each run (after one untimed first step).
    #[arg(long, default_value_t = 8)]
    steps: u64,
    /// Compute threads of the one-stage runs (bench step and the one worker).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Alternating rounds of the three runs.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// One round's numbers.
#[derive(Debug, Serialize)]
struct Round {
    /// `bench step`: tokens per second (median step).
    step_tokens_per_s: f64,
    /// One-stage `train`: tokens per second (median wall time between step boundaries).
    train_tokens_per_s: f64,
    /// train / bench step.
    ratio: f64,
    /// The same without peer snapshots.
    train_no_peers_tokens_per_s: f64,
    /// That / bench step.
    ratio_no_peers: f64,
    /// Default job, per unit: worker CPU milliseconds outside units.
    cpu_outside_units_ms: f64,
    /// Default job, per unit: stage wall milliseconds outside units.
    wall_outside_units_ms: f64,
    /// Default job: units per step, and the median step time.
    units_per_step: usize,
    step_time_s: f64,
}

/// `seqpipe bench overhead`.
pub fn run(args: &OverheadArgs) -> Result<()> {
    ensure!(args.steps >= 2, "--steps must be at least 2");
    ensure!(args.threads >= 1, "--threads must be at least 1");
    ensure!(
        (1..=100).contains(&args.rounds),
        "--rounds must be 1 to 100"
    );
    let exe = std::env::current_exe()?;
    let dir = std::env::temp_dir().join(format!("seqpipe-bench-overhead-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let (_, batch, seq_len) = args.preset.shape();
    println!(
        "one stage: preset {:?} (batch {batch} × seq {seq_len}), {} threads, {} timed steps; four stages: the default job, 1 thread per worker",
        args.preset, args.threads, args.steps
    );
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        let step_tps = bench_step(&exe, args)?;
        let mut one_stage = one_stage_config(args, &dir.join(format!("one-{round}")))?;
        let records = train(&exe, &one_stage, &dir.join(format!("one-{round}.toml")))?;
        let train_tps =
            boundary_tokens_per_s(&records).context("the one-stage run recorded too few steps")?;
        one_stage.elastic.peer_snapshots = false;
        one_stage.run.dir = dir.join(format!("one-no-peers-{round}"));
        let records = train(&exe, &one_stage, &dir.join(format!("one-np-{round}.toml")))?;
        let no_peers_tps =
            boundary_tokens_per_s(&records).context("the one-stage run recorded too few steps")?;
        let four = four_stage_config(args, &dir.join(format!("four-{round}")))?;
        let records = train(&exe, &four, &dir.join(format!("four-{round}.toml")))?;
        let (cpu_ms, wall_ms, units, step_s) = outside_units(&records, four.pipeline.stages)
            .context("the four-stage run recorded too few steps")?;
        let r = Round {
            step_tokens_per_s: step_tps,
            train_tokens_per_s: train_tps,
            ratio: train_tps / step_tps,
            train_no_peers_tokens_per_s: no_peers_tps,
            ratio_no_peers: no_peers_tps / step_tps,
            cpu_outside_units_ms: cpu_ms,
            wall_outside_units_ms: wall_ms,
            units_per_step: units,
            step_time_s: step_s,
        };
        println!(
            "round {round}: bench step {:.0} tok/s, one-stage train {:.0} tok/s ({:.3}x), without peer snapshots {:.0} tok/s ({:.3}x); default job: {} units/step, {:.3} s/step, outside units per unit: {:.2} ms CPU, {:.2} ms wall",
            r.step_tokens_per_s,
            r.train_tokens_per_s,
            r.ratio,
            r.train_no_peers_tokens_per_s,
            r.ratio_no_peers,
            r.units_per_step,
            r.step_time_s,
            r.cpu_outside_units_ms,
            r.wall_outside_units_ms
        );
        rounds.push(r);
    }
    let med = |f: fn(&Round) -> f64| median(&rounds.iter().map(f).collect::<Vec<_>>());
    let summary = serde_json::json!({
        "preset": args.preset,
        "threads": args.threads,
        "steps": args.steps,
        "train_over_bench_step": med(|r| r.ratio),
        "train_no_peer_snapshots_over_bench_step": med(|r| r.ratio_no_peers),
        "cpu_outside_units_ms_per_unit": med(|r| r.cpu_outside_units_ms),
        "wall_outside_units_ms_per_unit": med(|r| r.wall_outside_units_ms),
        "rounds": rounds,
    });
    println!(
        "median over {} rounds: one-stage train / bench step = {:.3} ({:.3} without peer snapshots); default job per unit outside units: {:.2} ms CPU, {:.2} ms wall",
        args.rounds,
        med(|r| r.ratio),
        med(|r| r.ratio_no_peers),
        med(|r| r.cpu_outside_units_ms),
        med(|r| r.wall_outside_units_ms)
    );
    println!("{summary}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// `seqpipe bench step` in its own process: its tokens per second.
fn bench_step(exe: &Path, args: &OverheadArgs) -> Result<f64> {
    let preset = serde_json::to_value(args.preset)?;
    let out = Command::new(exe)
        .args(["bench", "step", "--json", "--preset"])
        .arg(preset.as_str().unwrap_or("a"))
        .args(["--steps", &args.steps.to_string()])
        .args(["--threads", &args.threads.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .context("running seqpipe bench step")?;
    if !out.status.success() {
        bail!("seqpipe bench step failed ({})", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    let report: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("bench step printed {text:?}"))?;
    report["tokens_per_s"]
        .as_f64()
        .context("bench step reported no tokens_per_s")
}

/// The settings every run of this benchmark shares: its own directory and port, one more step
/// than timed, no evaluation or checkpoints (neither is in `bench step`).
fn common(cfg: &mut Config, args: &OverheadArgs, run_dir: &Path) -> Result<()> {
    cfg.run.dir = run_dir.to_path_buf();
    cfg.run.log = "warn".into();
    cfg.train.steps = args.steps + 1;
    cfg.train.eval_every = 0;
    cfg.checkpoint.every = 0;
    cfg.elastic.listen = format!("127.0.0.1:{}", super::free_port()?);
    Ok(())
}

/// A one-stage pipeline of the preset's model and batch.
fn one_stage_config(args: &OverheadArgs, run_dir: &Path) -> Result<Config> {
    let (model, batch, seq_len) = args.preset.shape();
    let mut cfg = Config::load(None, &[])?;
    cfg.model = model;
    cfg.train.seq_len = seq_len;
    cfg.train.micro_batch_size = batch;
    cfg.pipeline.stages = 1;
    cfg.pipeline.microbatches = 1;
    cfg.pipeline.splits = 1;
    cfg.run.threads_per_worker = args.threads;
    common(&mut cfg, args, run_dir)?;
    cfg.validate()?;
    Ok(cfg)
}

/// The default job with one compute thread per worker.
fn four_stage_config(args: &OverheadArgs, run_dir: &Path) -> Result<Config> {
    let mut cfg = Config::load(None, &[])?;
    cfg.run.threads_per_worker = 1;
    common(&mut cfg, args, run_dir)?;
    cfg.validate()?;
    Ok(cfg)
}

/// Runs `seqpipe train` with `cfg` (written to `file`); its step records.
fn train(exe: &Path, cfg: &Config, file: &Path) -> Result<Vec<StepMetrics>> {
    std::fs::write(file, cfg.to_toml())?;
    let out = Command::new(exe)
        .args(["train", "-q", "--config"])
        .arg(file)
        .output()
        .context("running seqpipe train")?;
    if !out.status.success() {
        bail!(
            "seqpipe train --config {} failed ({}):\n{}",
            file.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let path = cfg.run.dir.join("metrics.jsonl");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(steps(&parse_records(&text)).cloned().collect())
}

/// Tokens per second of wall time between consecutive step boundaries, the median over the
/// steps after the first.
fn boundary_tokens_per_s(records: &[StepMetrics]) -> Option<f64> {
    let rates: Vec<f64> = records
        .windows(2)
        .map(|w| w[1].tokens as f64 / (w[1].end_unix_s - w[0].end_unix_s))
        .collect();
    (!rates.is_empty()).then(|| median(&rates))
}

/// Per unit, the medians over the steps after the first: worker CPU ms outside units, stage wall
/// ms outside units; and the units per step and the median step time.
fn outside_units(records: &[StepMetrics], stages: usize) -> Option<(f64, f64, usize, f64)> {
    let timed = records.get(1..).filter(|t| !t.is_empty())?;
    let per_unit = |f: &dyn Fn(&StepMetrics) -> f64| {
        let values: Vec<f64> = timed
            .iter()
            .map(|r| 1e3 * f(r) / r.units.max(1) as f64)
            .collect();
        median(&values)
    };
    let cpu = per_unit(&|r| r.cpu_user_s + r.cpu_system_s - r.compute_cpu_s);
    let wall = per_unit(&|r| stages as f64 * r.step_time_s - r.compute_s);
    let step_s = median(&timed.iter().map(|r| r.step_time_s).collect::<Vec<_>>());
    Some((cpu, wall, timed[0].units, step_s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(step: u64, end: f64) -> StepMetrics {
        let mut r: StepMetrics = serde_json::from_str(&format!(
            r#"{{"step":{step},"end_unix_s":{end},"loss":1.0,"lr":0.1,"grad_norm":1.0,"tokens":100,"step_time_s":0.5,"tokens_per_s":200.0,"units":10,"compute_s":1.5,"compute_cpu_s":1.0,"cpu_user_s":1.1,"cpu_system_s":0.1}}"#
        ))
        .unwrap();
        r.step = step;
        r
    }

    #[test]
    fn throughput_counts_the_time_between_boundaries_and_overhead_what_units_did_not_use() {
        let records = [record(1, 10.0), record(2, 11.0), record(3, 11.5)];
        // 100 tokens in 1.0 s and in 0.5 s: the median of 100 and 200.
        assert_eq!(boundary_tokens_per_s(&records), Some(150.0));
        assert_eq!(boundary_tokens_per_s(&records[..1]), None);
        let (cpu, wall, units, step) = outside_units(&records, 4).unwrap();
        // (1.1 + 0.1 - 1.0) s over 10 units; (4 × 0.5 - 1.5) s over 10 units.
        assert!(
            (cpu - 20.0).abs() < 1e-9 && (wall - 50.0).abs() < 1e-9,
            "{cpu} {wall}"
        );
        assert_eq!((units, step), (10, 0.5));
        assert!(outside_units(&records[..1], 4).is_none());
    }
}
