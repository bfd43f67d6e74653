//! The zero-bubble Seq1F1B end to end (the real binary, workers over TCP): `seq1f1b-zb` splits
//! every unit's backward into its input half (`I`, sent upstream at once) and its weight half
//! (`W`, deferred into the bubbles), and trains bit-identically to `seq1f1b` with the same
//! (p, m, k) — same losses, validation losses and tensors — because the weight halves add the
//! same gradients, computed by the same operations, in the order of the input halves, which is
//! Seq1F1B's backward order. Its activations live until each unit's `W`, and its per-stage peak
//! stays at or below Seq1F1B's. Checkpoints move between the two kinds bit-identically; a lost
//! worker (mid-step recovery is not wired for split backwards) restarts the step from a peer
//! snapshot or checkpoint, bit-identically; and what is not wired is refused before anything
//! starts.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use common::{
    assert_final_state, assert_same_tensors, children_of, ckpt_url, elastic_job, final_state,
    fresh_dir, metrics, resumable_train, run_err, run_events, run_ok, wait_for_steps,
};
use trainer::runtime::events::RunEvent;

/// Settings every run here shares: an evaluation every 2 steps and mid-step recovery off (not
/// wired for split backwards; the same for the `seq1f1b` runs, so the runs differ in the
/// schedule only).
const COMMON: [&str; 3] = [
    "train.eval_every=2",
    "train.eval_batches=2",
    "elastic.mid_step=false",
];

/// A pipeline shape: schedule, stages p, micro-batches m, segments k.
#[derive(Clone, Copy, Debug)]
struct Shape {
    kind: &'static str,
    p: usize,
    m: usize,
    k: usize,
}

impl Shape {
    /// Compute actions all workers run in a step: each of the p stages runs each of the m·k
    /// units' forward and its backward, whole (`B`) or as two halves (`I`, `W`).
    fn units(&self) -> u64 {
        let per_unit = if self.kind == "seq1f1b-zb" { 3 } else { 2 };
        (self.p * self.m * self.k * per_unit) as u64
    }

    fn sets(&self) -> Vec<String> {
        vec![
            format!("pipeline.schedule={}", self.kind),
            format!("pipeline.stages={}", self.p),
            format!("pipeline.microbatches={}", self.m),
            format!("pipeline.splits={}", self.k),
        ]
    }
}

/// `seqpipe train` of the tiny model in `shape` for `steps` steps (checkpoints every 3).
fn train(run_dir: &Path, shape: Shape, steps: u64) -> Command {
    let mut sets: Vec<String> = COMMON.iter().map(|s| s.to_string()).collect();
    sets.extend(shape.sets());
    sets.push(format!("train.steps={steps}"));
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    resumable_train(run_dir, &sets)
}

/// One step's record: loss and validation-loss bits, compute actions, per-stage peak
/// activation bytes.
#[derive(Debug)]
struct StepRecord {
    loss: u64,
    val_loss: Option<u64>,
    units: u64,
    peaks: Vec<u64>,
}

fn step_records(run_dir: &Path) -> Vec<StepRecord> {
    metrics(run_dir)
        .iter()
        .filter(|m| m.get("loss").is_some())
        .map(|m| {
            let bits = |key: &str| m.get(key).and_then(|x| x.as_f64()).map(f64::to_bits);
            StepRecord {
                loss: bits("loss").expect("a loss"),
                val_loss: bits("val_loss"),
                units: m.get("units").and_then(|u| u.as_u64()).expect("units"),
                peaks: m
                    .get("peak_activation_bytes")
                    .and_then(|p| p.as_array())
                    .expect("per-stage peak activation bytes")
                    .iter()
                    .map(|b| b.as_u64().expect("bytes"))
                    .collect(),
            }
        })
        .collect()
}

/// The `--trace` of a zero-bubble run names each stage's slices `F`, `I` and `W`, never a whole
/// `B`: per step, every stage ran every unit's forward and the two halves of its backward.
fn assert_trace_has_split_backwards(trace: &Path, shape: Shape, steps: u64, name: &str) {
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(trace).expect("trace written"))
            .expect("the trace is JSON");
    let mut counts: BTreeMap<(u64, char), usize> = BTreeMap::new();
    for e in trace["traceEvents"].as_array().expect("traceEvents") {
        if !matches!(e["cat"].as_str(), Some("forward" | "backward")) {
            continue;
        }
        let op = e["name"]
            .as_str()
            .and_then(|n| n.chars().next())
            .expect("a name");
        let step = e["args"]["step"].as_u64().expect("a step");
        *counts.entry((step, op)).or_default() += 1;
    }
    let per_step = shape.p * shape.m * shape.k;
    for step in 1..=steps {
        for op in ['F', 'I', 'W'] {
            assert_eq!(
                counts.get(&(step, op)).copied().unwrap_or(0),
                per_step,
                "{name}: step {step}'s {op} slices: {counts:?}"
            );
        }
        assert!(!counts.contains_key(&(step, 'B')), "{name}: {counts:?}");
    }
}

#[test]
fn seq1f1b_zb_trains_bit_identically_to_seq1f1b_at_no_more_activation_memory() {
    let dir = fresh_dir("zero-bubble");
    const STEPS: u64 = 4;
    for (p, m, k) in [(2, 4, 2), (3, 2, 3), (4, 4, 2), (4, 8, 4)] {
        let name = format!("p{p}-m{m}-k{k}");
        let (plain, zb) = (
            Shape {
                kind: "seq1f1b",
                p,
                m,
                k,
            },
            Shape {
                kind: "seq1f1b-zb",
                p,
                m,
                k,
            },
        );
        let (a, b) = (dir.join(format!("{name}-seq1f1b")), dir.join(&name));
        run_ok(&mut train(&a, plain, STEPS));
        let trace = dir.join(format!("{name}-trace.json"));
        run_ok(train(&b, zb, STEPS).arg("--trace").arg(&trace));
        assert_trace_has_split_backwards(&trace, zb, STEPS, &name);
        let (x, y) = (step_records(&a), step_records(&b));
        assert_eq!(
            (x.len(), y.len()),
            (STEPS as usize, STEPS as usize),
            "{name}"
        );
        for (step, (x, y)) in x.iter().zip(&y).enumerate() {
            let step = step + 1;
            assert_eq!(
                (x.loss, x.val_loss),
                (y.loss, y.val_loss),
                "{name} step {step}: (loss, val_loss) bits differ"
            );
            // Not a vacuous equality: the zero-bubble run computed every unit's I and W.
            assert_eq!(x.units, plain.units(), "{name} step {step}");
            assert_eq!(
                y.units,
                zb.units(),
                "{name} step {step}: F, I and W of every unit"
            );
            // The generator caps live units at Seq1F1B's peak and a unit's saved state after
            // its I is no bigger than after its F: no stage holds more activations.
            assert_eq!(x.peaks.len(), p, "{name}");
            assert_eq!(y.peaks.len(), p, "{name}");
            for (stage, (&seq, &zero)) in x.peaks.iter().zip(&y.peaks).enumerate() {
                assert!(
                    seq > 0,
                    "{name} step {step} stage {stage}: no activations measured"
                );
                assert!(
                    zero <= seq,
                    "{name} step {step} stage {stage}: seq1f1b-zb held {zero} activation bytes, \
                     seq1f1b {seq}"
                );
            }
        }
        assert!(
            y.iter().any(|r| r.val_loss.is_some()),
            "{name}: the runs should have evaluated"
        );
        assert_same_tensors(&a, &b);
        let peaks: Vec<(u64, u64)> = x[0].peaks.iter().copied().zip(y[0].peaks.clone()).collect();
        eprintln!(
            "{name}: bit-identical to seq1f1b; peak activation bytes (seq1f1b, zb) per stage {peaks:?}"
        );
    }
}

#[test]
fn checkpoints_move_between_seq1f1b_zb_and_seq1f1b_bit_identically() {
    let dir = fresh_dir("zero-bubble-resume");
    const STEPS: u64 = 6;
    let shape = |kind| Shape {
        kind,
        p: 4,
        m: 4,
        k: 2,
    };
    let (zb, plain) = (shape("seq1f1b-zb"), shape("seq1f1b"));
    let straight = dir.join("straight");
    run_ok(&mut train(&straight, zb, STEPS));
    for (first, then, name) in [(zb, plain, "zb-to-seq1f1b"), (plain, zb, "seq1f1b-to-zb")] {
        let run = dir.join(name);
        run_ok(&mut train(&run, first, STEPS / 2));
        run_ok(train(&run, then, STEPS).args(["--resume", "latest"]));
        let (steps, straight_steps) = (step_records(&run), step_records(&straight));
        assert_eq!(steps.len(), straight_steps.len(), "{name}");
        for (step, (x, y)) in steps.iter().zip(&straight_steps).enumerate() {
            let step = step + 1;
            assert_eq!(x.loss, y.loss, "{name}: step {step}'s loss differs");
            let ran = if step as u64 <= STEPS / 2 {
                first
            } else {
                then
            };
            assert_eq!(
                x.units,
                ran.units(),
                "{name}: step {step} should run {ran:?}"
            );
            if let (Some(a), Some(b)) = (x.val_loss, y.val_loss) {
                assert_eq!(a, b, "{name}: step {step}'s validation loss differs");
            }
        }
        assert_same_tensors(&straight, &run);
        eprintln!("{name}: bit-identical to the uninterrupted seq1f1b-zb run");
    }
}

#[test]
fn what_split_backwards_do_not_have_is_refused_before_anything_starts() {
    let dir = fresh_dir("zero-bubble-refused");
    let shape = Shape {
        kind: "seq1f1b-zb",
        p: 2,
        m: 4,
        k: 2,
    };
    // CUDA stages and NCCL device links run split backwards (tests/emulated_zero_bubble.rs):
    // mid-step recovery is what is left.
    let (set, says) = ("elastic.mid_step=true", "elastic.mid_step = false");
    let run = dir.join(set.replace(['.', '='], "-"));
    let err = run_err(train(&run, shape, 2).args(["--set", set]));
    assert!(
        err.contains(says) && err.contains("seq1f1b-zb"),
        "{set}: {err}"
    );
    assert!(
        !run.join("metrics.jsonl").exists(),
        "{set}: nothing should have run"
    );
}

/// A worker lost mid-run (SIGKILL of its process): mid-step recovery is off for split
/// backwards, so the interrupted step restarts from the last peer snapshot or checkpoint and
/// the run ends bit-identical to the uninterrupted one.
#[test]
fn a_lost_worker_of_a_zero_bubble_run_restarts_the_step_bit_identically() {
    const STEPS: u64 = 16;
    let dir = fresh_dir("zero-bubble-loss");
    let job = |run: &Path| {
        let mut cmd = elastic_job(run, STEPS);
        for s in [
            "pipeline.schedule=seq1f1b-zb",
            "pipeline.stages=4",
            "pipeline.microbatches=4",
            "pipeline.splits=2",
            "elastic.mid_step=false",
        ] {
            cmd.args(["--set", s]);
        }
        cmd
    };
    let reference_dir = dir.join("reference");
    run_ok(&mut job(&reference_dir));
    let (_, reference) = final_state(&ckpt_url(&reference_dir));
    let run = dir.join("worker");
    let child = job(&run)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_steps(&run, 5);
    // The launcher's children are the nodes' agents, theirs the workers.
    let agent = children_of(child.id())[1];
    let victims = children_of(agent);
    assert!(!victims.is_empty(), "no worker to kill");
    for pid in &victims {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}\n{stderr}", out.status);
    assert_final_state(&run, STEPS, &reference);
    let recovered: Vec<_> = run_events(&run)
        .into_iter()
        .filter_map(|e| match e {
            RunEvent::Recovered(r) => Some(r),
            _ => None,
        })
        .collect();
    assert!(!recovered.is_empty(), "the loss should have been recovered");
    for r in &recovered {
        assert_ne!(
            r.tier,
            trainer::runtime::recovery::Tier::MidStep,
            "mid-step recovery is off for split backwards: {r:?}"
        );
    }
    eprintln!("worker lost: {recovered:?}");
}
