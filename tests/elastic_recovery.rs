//! Losing nodes: seeded chaos trials SIGKILL random workers (each local worker is a node) of a real
//! run at random moments; every trial must finish its steps on the survivors, and its final
//! parameters and optimizer state must be bit-for-bit those of an uninterrupted run.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{ckpt_url, final_state, fresh_dir, metrics, run_ok, seqpipe};
use rand::{Rng, SeedableRng};

const STEPS: u64 = 24;

/// A run big enough that steps take tens of milliseconds, so kills land mid-run.
fn job(run_dir: &Path, extra: &[&str]) -> Command {
    let mut cmd = seqpipe();
    cmd.args(["train", "-q"]);
    let sets = [
        "model.vocab_size=128".to_string(),
        "model.layers=4".into(),
        "model.d_model=64".into(),
        "model.heads=4".into(),
        "model.max_seq_len=64".into(),
        "train.seq_len=64".into(),
        "train.micro_batch_size=4".into(),
        "train.eval_every=0".into(),
        format!("train.steps={STEPS}"),
        "checkpoint.every=2".into(),
        "checkpoint.keep_last=2".into(),
        format!("run.dir={}", run_dir.display()),
    ];
    for s in sets.iter().map(String::as_str).chain(extra.iter().copied()) {
        cmd.args(["--set", s]);
    }
    cmd
}

fn workers_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn steps_done(run_dir: &Path) -> usize {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"loss\""))
        .count()
}

/// Waits until the run at `run_dir` has completed `steps` steps (at most a minute).
fn wait_for_steps(run_dir: &Path, steps: usize) {
    let started = Instant::now();
    while steps_done(run_dir) < steps {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the job did not start"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Runs the job uninterrupted and again with `signal` sent to worker `worker` after step 5; the
/// second run must finish bit-identical to the first. Returns its events.
fn signal_worker_mid_run(
    name: &str,
    signal: &str,
    worker: usize,
    extra: &[&str],
) -> Vec<serde_json::Value> {
    let dir = fresh_dir(name);
    let reference_dir = dir.join("reference");
    run_ok(&mut job(&reference_dir, &[]));
    let (_, reference) = final_state(&ckpt_url(&reference_dir));
    let run = dir.join("run");
    let child = job(&run, extra).spawn().unwrap();
    wait_for_steps(&run, 5);
    let victim = workers_of(child.id())[worker];
    Command::new("kill")
        .args([signal, &victim.to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    let (step, state) = final_state(&ckpt_url(&run));
    assert_eq!(step, STEPS);
    assert!(
        state == reference,
        "final state differs from the uninterrupted run"
    );
    metrics(&run)
        .into_iter()
        .filter(|m| m.get("event").is_some())
        .collect()
}

/// One trial: start the job, wait `delay` after its first step, SIGKILL `kills` random workers.
/// Returns the run's events.
fn trial(
    dir: &Path,
    rng: &mut impl Rng,
    kills: usize,
    reference: &BTreeMap<String, Vec<u8>>,
) -> Vec<serde_json::Value> {
    let mut child = job(dir, &[]).spawn().unwrap();
    wait_for_steps(dir, 1);
    std::thread::sleep(Duration::from_millis(rng.random_range(0..900)));
    let mut workers = workers_of(child.id());
    let mut victims = Vec::new();
    for _ in 0..kills.min(workers.len()) {
        victims.push(workers.remove(rng.random_range(0..workers.len())));
    }
    for v in &victims {
        let _ = Command::new("kill")
            .args(["-KILL", &v.to_string()])
            .status();
    }
    let status = child.wait().unwrap();
    let log = std::fs::read_to_string(dir.join("logs/stage-0.log")).unwrap_or_default();
    assert!(
        status.success(),
        "trial in {} did not finish after killing {victims:?} ({status}); stage-0 log:\n{log}",
        dir.display()
    );
    let (step, state) = final_state(&ckpt_url(dir));
    assert_eq!(step, STEPS);
    assert_eq!(state.len(), reference.len());
    for (name, bytes) in reference {
        assert!(
            &state[name] == bytes,
            "{}: tensor {name} differs from the uninterrupted run",
            dir.display()
        );
    }
    metrics(dir)
        .into_iter()
        .filter(|m| m.get("event").is_some())
        .collect()
}

#[test]
fn chaos_sigkill_random_workers_bit_exact() {
    let dir = fresh_dir("chaos");
    let reference_dir = dir.join("reference");
    run_ok(&mut job(&reference_dir, &[]));
    let (_, reference) = final_state(&ckpt_url(&reference_dir));
    let trials: usize = std::env::var("SEQPIPE_CHAOS_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(20261122);
    let mut recovered = 0;
    for i in 0..trials {
        // Every fifth trial loses two nodes at once.
        let kills = if i % 5 == 4 { 2 } else { 1 };
        let events = trial(&dir.join(format!("trial-{i}")), &mut rng, kills, &reference);
        let lost = events.iter().filter(|e| e["event"] == "node_lost").count();
        if lost > 0 {
            recovered += 1;
            let r = events
                .iter()
                .find(|e| e["event"] == "recovered")
                .unwrap_or_else(|| panic!("trial {i}: no recovered event in {events:?}"));
            // From the newest committed checkpoint, or from scratch when none was committed yet.
            assert!(r["tier"] == "checkpoint" || r["tier"] == "restart", "{r}");
            assert!(
                r["stages_after"].as_u64().unwrap() < r["stages_before"].as_u64().unwrap(),
                "{r}"
            );
            // Checkpoints every 2 steps with at most one in flight: the one before the newest begun
            // is committed, so at most 2·2 − 1 completed steps are redone.
            assert!(
                r["lost_steps"].as_u64().unwrap() <= 3,
                "checkpoints every 2 steps: {r}"
            );
            assert!(
                events
                    .iter()
                    .any(|e| e["event"] == "plan" && e["generation"].as_u64().unwrap() >= 1)
            );
        }
        let _ = std::fs::remove_dir_all(dir.join(format!("trial-{i}")));
    }
    // Kills land while the job runs (after its first step, within its run time): nearly all recover.
    assert!(
        recovered * 10 >= trials * 8,
        "only {recovered} of {trials} trials lost a node"
    );
}

#[test]
fn too_few_nodes_is_a_clear_error_and_checkpoints_stay_usable() {
    let dir = fresh_dir("minnodes");
    let run = dir.join("run");
    let child = job(&run, &["elastic.min_nodes=4", "elastic.join_timeout_s=1"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_steps(&run, 3);
    let victim = workers_of(child.id())[1];
    Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("elastic.min_nodes") && stderr.contains("seqpipe resume"),
        "{stderr}"
    );
    // The committed checkpoints are intact: resume finishes the run with 4 fresh local workers.
    run_ok(seqpipe().args(["resume", "-q"]).arg(&run));
    assert_eq!(final_state(&ckpt_url(&run)).0, STEPS);
}

/// A preemption notice (SIGTERM to a node's worker): the node leaves at the next step boundary with
/// a checkpoint of that boundary, the run goes on without it, and no work is lost.
#[test]
fn preemption_notice_hands_over_at_the_step_boundary() {
    let events = signal_worker_mid_run("preempt", "-TERM", 2, &[]);
    assert!(
        events.iter().any(|e| e["event"] == "node_left"),
        "{events:?}"
    );
    let r = events
        .iter()
        .find(|e| e["event"] == "recovered")
        .unwrap_or_else(|| panic!("{events:?}"));
    assert_eq!(r["tier"], "handover", "{r}");
    assert_eq!(r["lost_steps"], 0, "{r}");
    assert_eq!(
        (r["stages_before"].as_u64(), r["stages_after"].as_u64()),
        (Some(4), Some(3)),
        "{r}"
    );
}

/// A hung node (alive, connections open, silent — here SIGSTOPped) is detected by its neighbours'
/// timeouts, not waited on forever: it is declared lost and the run recovers bit-exactly.
#[test]
fn hung_worker_is_detected_by_timeouts_and_replaced() {
    let started = Instant::now();
    let events = signal_worker_mid_run("hung", "-STOP", 1, &["pipeline.timeout_s=1.5"]);
    let lost = events
        .iter()
        .find(|e| e["event"] == "node_lost")
        .unwrap_or_else(|| panic!("{events:?}"));
    assert_eq!(lost["node"], "local-001", "{lost}");
    assert!(
        lost["reason"].as_str().unwrap().contains("no message"),
        "{lost}"
    );
    // Detected within a few timeouts, not hung forever.
    assert!(started.elapsed() < Duration::from_secs(60));
}
