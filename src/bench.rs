//! `seqpipe bench checkpoint`: checkpoint save and load throughput against the raw throughput of the
//! same store measured in the same run, and the training stall that asynchronous checkpoints cause.
//! `seqpipe bench recovery` (one SIGKILLed node per trial, per tier) is here too; `seqpipe bench step`
//! (training step time and memory) lives in [`step`], `seqpipe bench schedule` (the schedules on real
//! pipeline runs) in [`schedule`] (with `--simulated`, the whole schedule family on the cost model,
//! in [`schedule_family`]), `seqpipe bench goodput` (a whole job under random failures) in
//! [`goodput`], `seqpipe bench replicas` (data parallelism's reduction cost and replayed step
//! time) in [`replicas`], `seqpipe bench data` (training data from an object store against a local
//! directory) in [`data`], `seqpipe bench docmask` (document-masked attention per segment) in
//! [`docmask`].

pub mod data;
pub mod docmask;
pub mod goodput;
pub mod overhead;
pub mod replicas;
pub mod schedule;
pub mod schedule_family;
pub mod step;

use std::time::Instant;

use anyhow::{Context, Result};
use checkpoint::{CheckpointStore, Manifest, StoreOptions, TensorData};
use ops::adamw::{AdamW, AdamWConfig, Moments};

use trainer::checkpointing::shard::{snapshot, to_tensor_data};
use trainer::config::Config;
use trainer::metrics::StepMetrics;
use trainer::model::{ModelConfig, Stage, partition_layers};
use trainer::plan::RunPlan;
use trainer::runtime::events::{self, CheckpointCommitted, NodeLost, Record, Recovered, RunEvent};
use trainer::runtime::recovery::Tier;
use trainer::runtime::run::{LaunchOptions, run_training};

/// Every tensor (parameters and AdamW moments) of the newest committed checkpoint at `url`, as raw
/// bytes, with its step: what the benchmarks compare to check that runs computed the same model.
fn final_state(
    url: &str,
    options: &StoreOptions,
) -> Result<(u64, std::collections::BTreeMap<String, Vec<u8>>)> {
    let store = CheckpointStore::open(url, options)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let step = *rt
        .block_on(store.committed_steps())?
        .last()
        .with_context(|| format!("no committed checkpoint at {url}"))?;
    let manifest = rt.block_on(store.read_manifest(step))?;
    let names: Vec<String> = manifest.tensor_names().map(String::from).collect();
    let tensors = rt.block_on(store.read_tensors(&manifest, &names))?;
    Ok((
        step,
        tensors
            .into_iter()
            .map(|(n, d)| (n, d.data.to_vec()))
            .collect(),
    ))
}

/// The model whose state (parameters + AdamW moments) the I/O benchmark writes: ~13.4M parameters,
/// ~160 MB of state.
fn bench_model() -> ModelConfig {
    ModelConfig {
        vocab_size: 8192,
        layers: 4,
        d_model: 384,
        heads: 6,
        max_seq_len: 1024,
        ..ModelConfig::default()
    }
}

/// The state of every stage of a `stages`-stage pipeline of `model`, as raw tensors per stage.
fn pipeline_state(
    model: &ModelConfig,
    stages: usize,
) -> Result<Vec<Vec<(String, candle_core::Tensor)>>> {
    partition_layers(model, 1024, stages)?
        .into_iter()
        .map(|layout| {
            let stage = Stage::new(model, layout, vec![1024], 7)?;
            let mut optimizer = AdamW::new(AdamWConfig::default());
            for (name, t) in stage.params().iter() {
                // Non-zero moments of the right shapes (their values do not matter for I/O).
                optimizer.moments.insert(
                    name.to_string(),
                    Moments {
                        m: t.clone(),
                        v: t.sqr()?,
                    },
                );
            }
            Ok(snapshot(&stage, &optimizer))
        })
        .collect()
}

fn mb_per_s(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / 1e6 / seconds
}

/// Measures one store: raw multipart writes of the same bytes, then checkpoint save and load.
fn bench_store(
    url: &str,
    state: &[Vec<(String, candle_core::Tensor)>],
    rounds: usize,
) -> Result<()> {
    let (mut best_raw, mut best_save, mut best_load) = (0.0f64, 0.0f64, 0.0f64);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let store = CheckpointStore::open(url, &StoreOptions::default())?;
    let copy_started = Instant::now();
    let shards: Vec<Vec<(String, TensorData)>> = state
        .iter()
        .map(|s| {
            s.iter()
                .map(|(n, t)| Ok((n.clone(), to_tensor_data(t)?)))
                .collect::<Result<_>>()
        })
        .collect::<Result<_>>()?;
    let copy_s = copy_started.elapsed().as_secs_f64();
    let bytes: u64 = shards
        .iter()
        .flatten()
        .map(|(_, d)| d.data.len() as u64)
        .sum();
    let names: Vec<String> = state.iter().flatten().map(|(n, _)| n.clone()).collect();
    println!(
        "store {url}: {:.1} MB of state in {} shards (copy into host buffers: {copy_s:.3}s)",
        bytes as f64 / 1e6,
        shards.len()
    );
    let base = rt
        .block_on(store.committed_steps())?
        .last()
        .copied()
        .unwrap_or(0)
        + 1_000_000;
    for round in 0..rounds {
        let per_shard: Vec<usize> = shards
            .iter()
            .map(|s| s.iter().map(|(_, d)| d.data.len()).sum())
            .collect();
        let raw_s = rt
            .block_on(futures::future::try_join_all(
                per_shard.iter().map(|&b| store.raw_write_probe(b)),
            ))?
            .into_iter()
            .fold(0.0, f64::max);
        let step = base + round as u64;
        let started = Instant::now();
        let shard_names: Vec<String> = (0..shards.len()).map(|r| format!("stage-{r}")).collect();
        let entries = rt.block_on(futures::future::try_join_all(
            shards
                .iter()
                .zip(&shard_names)
                .map(|(s, name)| store.write_shard(step, name, s.clone())),
        ))?;
        let manifest = Manifest::new(step, entries, serde_json::json!({"bench": true}));
        rt.block_on(store.commit(&manifest))?;
        let save_s = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let loaded = rt.block_on(store.read_tensors(&manifest, &names))?;
        let load_s = started.elapsed().as_secs_f64();
        let loaded_bytes: u64 = loaded.iter().map(|(_, d)| d.data.len() as u64).sum();
        anyhow::ensure!(
            loaded_bytes == bytes,
            "loaded {loaded_bytes} bytes, saved {bytes}"
        );
        println!(
            "  round {}: raw write {:.0} MB/s | checkpoint save {:.0} MB/s ({:.0}% of raw, {save_s:.2}s incl. hashing and manifest) | load {:.0} MB/s (hash-verified, {load_s:.2}s)",
            round + 1,
            mb_per_s(bytes, raw_s),
            mb_per_s(bytes, save_s),
            100.0 * raw_s / save_s,
            mb_per_s(bytes, load_s)
        );
        let _ = rt.block_on(store.retain(1));
        best_raw = best_raw.max(mb_per_s(bytes, raw_s));
        best_save = best_save.max(mb_per_s(bytes, save_s));
        best_load = best_load.max(mb_per_s(bytes, load_s));
    }
    println!(
        "  best of {rounds}: raw write {best_raw:.0} MB/s, checkpoint save {best_save:.0} MB/s = {:.0}% of raw, load {best_load:.0} MB/s",
        100.0 * best_save / best_raw
    );
    let committed = rt.block_on(store.committed_steps())?;
    for step in committed.into_iter().filter(|&s| s >= base) {
        rt.block_on(store.delete_step(step))?;
    }
    Ok(())
}

/// Mean step time (steps after the first) of a short run, and the longest training-thread stall
/// (snapshot) of its checkpoints.
fn measure_run(cfg: &Config) -> Result<(f64, f64)> {
    let _ = std::fs::remove_dir_all(&cfg.run.dir);
    run_training(
        cfg,
        &RunPlan::decide(cfg)?,
        &LaunchOptions {
            quiet: true,
            ..LaunchOptions::default()
        },
    )?;
    let records = events::read_records(&cfg.run.dir.join("metrics.jsonl"))?;
    let times: Vec<f64> = events::steps(&records)
        .map(|s| s.step_time_s)
        .skip(1)
        .collect();
    let snapshot = events::events(&records)
        .filter_map(|e| match e {
            RunEvent::Checkpoint(CheckpointCommitted { snapshot_s, .. }) => Some(*snapshot_s),
            _ => None,
        })
        .fold(0.0, f64::max);
    Ok((
        times.iter().sum::<f64>() / times.len().max(1) as f64,
        snapshot,
    ))
}

/// Runs the checkpoint benchmark on each URL, then the stall measurement on the first.
pub fn checkpoint_bench(
    urls: &[String],
    stages: usize,
    rounds: usize,
    stall_steps: u64,
) -> Result<()> {
    let model = bench_model();
    println!(
        "model: {} layers, d_model {}, vocab {}: {:.1}M parameters; state = parameters + AdamW m and v",
        model.layers,
        model.d_model,
        model.vocab_size,
        trainer::model::params::param_count(&model) as f64 / 1e6
    );
    let state = pipeline_state(&model, stages)?;
    for url in urls {
        bench_store(url, &state, rounds).with_context(|| format!("benchmarking {url}"))?;
    }
    drop(state);
    // Training stall: the same short run with a checkpoint after every step, and with none.
    let dir = std::env::temp_dir().join(format!("seqpipe-bench-stall-{}", std::process::id()));
    let overrides: Vec<String> = [
        "model.vocab_size=8192".to_string(),
        "model.d_model=256".into(),
        "model.heads=4".into(),
        format!("train.steps={stall_steps}"),
        "train.eval_every=0".into(),
        format!("pipeline.stages={stages}"),
        "checkpoint.keep_last=1".into(),
        format!("run.dir={}", dir.display()),
    ]
    .into();
    let mut cfg = Config::default().with_overrides(&overrides)?;
    let mut run = |every: u64| {
        cfg.checkpoint.every = every;
        cfg.checkpoint.url = format!(
            "{}/stall-every-{every}-{}",
            urls[0].trim_end_matches('/'),
            std::process::id()
        );
        measure_run(&cfg)
    };
    let (without, _) = run(0)?;
    let (with, snapshot_s) = run(1)?;
    let state_bytes = 12 * trainer::model::params::param_count(&cfg.model);
    let copy = {
        let state = pipeline_state(&cfg.model, stages)?;
        let started = Instant::now();
        for shard in &state {
            for (_, t) in shard {
                to_tensor_data(t)?;
            }
        }
        started.elapsed().as_secs_f64()
    };
    println!(
        "stall: {:.1} MB state, {stall_steps} steps: the training thread blocks {:.3} ms per checkpoint (snapshot; copying the state into host buffers would take {:.1} ms)",
        state_bytes as f64 / 1e6,
        snapshot_s * 1e3,
        copy * 1e3
    );
    println!(
        "       step time {without:.3}s without checkpoints, {with:.3}s with one after every step ({:+.3}s per checkpoint of background CPU work competing for the cores)",
        with - without
    );
    println!(
        "note: on this machine the background upload (copy, hashing, writes) competes with the training threads for the same CPU cores; the training thread itself only takes a reference-counted snapshot of the immutable tensors"
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A free loopback port for a run's coordinator.
pub(crate) fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The pids of a process's children (a local run: launcher -> agents -> workers).
pub(crate) fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Whether `pid` is a running process (not gone, not a zombie waiting to be reaped).
pub(crate) fn is_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // `pid (comm) STATE ...`: the state follows the last ')'.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X')
    })
}

/// SIGKILLs `pid` (a process this benchmark's run started); a pid already gone is not an error.
pub(crate) fn sigkill(pid: u32) {
    // SAFETY: kill(2) with a plain pid and signal has no memory-safety preconditions.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
}

/// One recovery trial's numbers.
struct RecoveryTrial {
    detection_s: f64,
    recovery_s: f64,
    lost_steps: u64,
    tier: String,
    /// Compute seconds (all stages) done again because of the failure.
    redone_s: f64,
    /// What a step-start (peer-snapshot) recovery would have redone at the same moment: the
    /// interrupted step's compute up to the failure.
    step_start_redone_s: f64,
}

/// The ways of recovering that `seqpipe bench recovery` compares.
const RECOVERY_TIERS: [(&str, &[&str]); 3] = [
    (
        "tier 2: persistent checkpoint",
        &["elastic.peer_snapshots=false", "elastic.mid_step=false"],
    ),
    (
        "tier 1: peer snapshot (step start)",
        &["elastic.peer_snapshots=true", "elastic.mid_step=false"],
    ),
    (
        "mid-step",
        &["elastic.peer_snapshots=true", "elastic.mid_step=true"],
    ),
];

/// Starts a real run with `extra` settings, SIGKILLs one node (its agent; its worker dies with it)
/// `delay_ms` after its step `kill_after_step` ends, and reads the coordinator's events. Work
/// redone is measured for a mid-step recovery (the replacement's replayed units) and estimated
/// otherwise: the completed steps redone plus the interrupted step's share done before the kill,
/// at the run's median compute per step (all stages).
fn recovery_trial(
    dir: &std::path::Path,
    kill_after_step: usize,
    delay_ms: u64,
    victim: usize,
    every: u64,
    extra: &[&str],
) -> Result<RecoveryTrial> {
    let mut child = start_recovery_run(dir, every, extra)?;
    let metrics = dir.join("metrics.jsonl");
    let killed_at = kill_a_node(&child, &metrics, kill_after_step, delay_ms, victim)?;
    let status = child.wait()?;
    anyhow::ensure!(status.success(), "the run did not recover ({status})");
    read_recovery_trial(&events::read_records(&metrics)?, killed_at, delay_ms)
}

/// Starts the small 30-step run of a recovery trial in `dir` (cleared first), with checkpoints
/// `every` steps and the `extra` settings.
fn start_recovery_run(
    dir: &std::path::Path,
    every: u64,
    extra: &[&str],
) -> Result<std::process::Child> {
    let _ = std::fs::remove_dir_all(dir);
    let exe = std::env::current_exe()?;
    let sets = [
        "model.vocab_size=128",
        "model.d_model=64",
        "model.heads=4",
        "model.max_seq_len=64",
        "train.seq_len=64",
        "train.eval_every=0",
        "train.steps=30",
    ];
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["train", "-q"])
        .arg("--set")
        .arg(format!("run.dir={}", dir.display()))
        .arg("--set")
        .arg(format!("checkpoint.every={every}"));
    for s in sets.iter().chain(extra) {
        cmd.args(["--set", s]);
    }
    Ok(cmd
        .stderr(std::process::Stdio::null())
        .env("RAYON_NUM_THREADS", "1")
        .env("CANDLE_NUM_THREADS", "1")
        .spawn()?)
}

/// Waits until the run of `child` recorded `kill_after_step` steps in `metrics`, then `delay_ms`
/// more, and SIGKILLs the agent of node `victim` (modulo the nodes); returns when (Unix seconds).
fn kill_a_node(
    child: &std::process::Child,
    metrics: &std::path::Path,
    kill_after_step: usize,
    delay_ms: u64,
    victim: usize,
) -> Result<f64> {
    let steps = || {
        std::fs::read_to_string(metrics)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"loss\""))
            .count()
    };
    let started = Instant::now();
    while steps() < kill_after_step {
        anyhow::ensure!(
            started.elapsed().as_secs() < 120,
            "the run did not reach step {kill_after_step}"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    std::thread::sleep(std::time::Duration::from_millis(delay_ms));
    let agents = children_of(child.id());
    let pid = agents
        .get(victim % agents.len().max(1))
        .context("no node to kill")?;
    let killed_at = trainer::runtime::trace::unix_time_s();
    sigkill(*pid);
    Ok(killed_at)
}

/// A recovery trial's numbers from its run's `records`, for a kill at `killed_at` (Unix seconds)
/// `delay_ms` into a step.
fn read_recovery_trial(records: &[Record], killed_at: f64, delay_ms: u64) -> Result<RecoveryTrial> {
    let median_of = |key: fn(&StepMetrics) -> f64| {
        let mut v: Vec<f64> = events::steps(records).map(key).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let (step_compute_s, step_time_s) = (median_of(|s| s.compute_s), median_of(|s| s.step_time_s));
    // The share of the interrupted step done when the kill landed.
    let done_share = (delay_ms as f64 / 1000.0 / step_time_s.max(1e-9)).min(1.0);
    let step_start_redone_s = done_share * step_compute_s;
    let detected_at_unix_s = events::events(records)
        .find_map(|e| match e {
            RunEvent::NodeLost(NodeLost {
                detected_at_unix_s, ..
            }) => Some(*detected_at_unix_s),
            _ => None,
        })
        .context("no node_lost event")?;
    let recovered = events::events(records)
        .find(|e| matches!(e, RunEvent::Recovered(_)))
        .context("no recovered event")?;
    let RunEvent::Recovered(Recovered {
        lost_steps,
        tier,
        redone_s,
        at_unix_s,
        ..
    }) = recovered.clone()
    else {
        unreachable!("found a recovered event")
    };
    let redone_s = if tier == Tier::MidStep {
        redone_s.with_context(|| format!("event without redone_s: {recovered:?}"))?
    } else {
        lost_steps as f64 * step_compute_s + step_start_redone_s
    };
    Ok(RecoveryTrial {
        detection_s: detected_at_unix_s - killed_at,
        recovery_s: at_unix_s - killed_at,
        lost_steps,
        tier: tier.to_string(),
        redone_s,
        step_start_redone_s,
    })
}

/// `seqpipe bench recovery`: for each way of recovering (persistent checkpoint, peer snapshot,
/// mid-step), kills a node of a real 4-stage run `trials` times and prints the detection time, the
/// time from SIGKILL to the first completed step after recovery, the steps of work lost and the
/// compute redone, for checkpoints every `every` steps.
pub fn recovery_bench(trials: usize, every: u64) -> Result<()> {
    let base = std::env::temp_dir().join(format!("seqpipe-bench-recovery-{}", std::process::id()));
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "4 stages, 4 micro-batches x 4 segments, checkpoint every {every} steps; each trial kills one node"
    );
    for (t, (label, extra)) in RECOVERY_TIERS.iter().enumerate() {
        println!("{label} ({}):", extra.join(", "));
        let mut results = Vec::new();
        for i in 0..trials {
            let r = recovery_trial(
                &base.join(format!("tier-{t}-trial-{i}")),
                4 + i % 5,
                (i as u64 * 37) % 200,
                i,
                every,
                extra,
            )?;
            println!(
                "  trial {}: detection {:.3}s, SIGKILL -> first step after recovery {:.3}s, lost {} steps, compute redone {:.3}s (step-start recovery would redo {:.3}s), tier {}",
                i + 1,
                r.detection_s,
                r.recovery_s,
                r.lost_steps,
                r.redone_s,
                r.step_start_redone_s,
                r.tier
            );
            results.push(r);
        }
        let redone = median(results.iter().map(|r| r.redone_s).collect());
        let step_start = median(results.iter().map(|r| r.step_start_redone_s).collect());
        println!(
            "  median over {trials} trials: detection {:.3}s, recovery {:.3}s, lost steps {} (max {}), compute redone {redone:.3}s = {:.2} x a step-start recovery's at the same moments; tiers used: {:?}",
            median(results.iter().map(|r| r.detection_s).collect()),
            median(results.iter().map(|r| r.recovery_s).collect()),
            median(results.iter().map(|r| r.lost_steps as f64).collect()),
            results.iter().map(|r| r.lost_steps).max().unwrap_or(0),
            redone / step_start.max(1e-9),
            results
                .iter()
                .map(|r| r.tier.as_str())
                .collect::<std::collections::BTreeSet<_>>()
        );
    }
    println!(
        "(compute redone: measured for mid-step, estimated for the others as the redone steps plus the share of the interrupted step done before the kill)"
    );
    let _ = std::fs::remove_dir_all(&base);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use elastic::NodeId;

    fn step(step: u64, compute_s: f64, step_time_s: f64) -> Record {
        let line = serde_json::json!({
            "step": step, "compute_s": compute_s, "step_time_s": step_time_s,
            "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64, "tokens_per_s": 1.0,
        });
        events::parse_records(&line.to_string()).remove(0)
    }

    fn lost(detected_at_unix_s: f64) -> Record {
        Record::Event(RunEvent::NodeLost(NodeLost {
            node: NodeId::new("local-001"),
            failed_step: 4,
            reason: "killed".into(),
            detected_at_unix_s,
            agent_alive: false,
            stage: None,
            mid_step: None,
        }))
    }

    fn recovered(tier: Tier, lost_steps: u64, redone_s: Option<f64>) -> Record {
        Record::Event(RunEvent::Recovered(Recovered {
            step: 5,
            recovery_s: 1.0,
            lost_steps,
            tier,
            stages_before: 4,
            stages_after: 4,
            at_unix_s: 102.5,
            stage: None,
            node: None,
            host: None,
            redone_units: None,
            redone_s,
        }))
    }

    /// A checkpoint recovery's redone work is estimated (two completed steps plus a quarter of
    /// the interrupted one, at the median step's compute); a mid-step one is the event's own.
    #[test]
    fn a_recovery_trial_reads_detection_recovery_and_redone_work_from_the_events() {
        let steps = || vec![step(1, 0.8, 0.4), step(2, 0.4, 0.4), step(3, 0.4, 0.5)];
        let mut records = steps();
        records.extend([lost(100.25), recovered(Tier::Checkpoint, 2, None)]);
        let t = read_recovery_trial(&records, 100.0, 100).unwrap();
        assert_eq!((t.detection_s, t.recovery_s, t.lost_steps), (0.25, 2.5, 2));
        assert_eq!(t.tier, Tier::Checkpoint.to_string());
        assert!(
            (t.step_start_redone_s - 0.1).abs() < 1e-12,
            "{}",
            t.step_start_redone_s
        );
        assert!((t.redone_s - 0.9).abs() < 1e-12, "{}", t.redone_s);
        let mut records = steps();
        records.extend([lost(100.25), recovered(Tier::MidStep, 0, Some(0.05))]);
        assert_eq!(
            read_recovery_trial(&records, 100.0, 100).unwrap().redone_s,
            0.05
        );
        let mut records = steps();
        records.push(recovered(Tier::MidStep, 0, None));
        let Err(e) = read_recovery_trial(&records, 100.0, 100) else {
            panic!("a run with no node_lost event has no detection time");
        };
        assert!(e.to_string().contains("no node_lost event"), "{e}");
    }
}
