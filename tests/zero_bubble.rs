//! The zero-bubble Seq1F1B end to end (the real binary, workers over TCP): `seq1f1b-zb` splits
//! every unit's backward into its input half (`I`, sent upstream at once) and its weight half
//! (`W`, deferred into the bubbles), and trains bit-identically to `seq1f1b` with the same
//! (p, m, k) — same losses, validation losses and tensors — because the weight halves add the
//! same gradients, computed by the same operations, in the order of the input halves, which is
//! Seq1F1B's backward order. Its activations live until each unit's `W`; under ZB-H1's memory rule
//! every stage holds at most the job's Seq1F1B peak of live units (its first stage's) and of
//! measured activation bytes (its most loaded stage's), the later stages more than under
//! Seq1F1B. Checkpoints move between the two kinds bit-identically. A worker
//! SIGKILLed in the middle of a step (first, middle or last stage, once or again and again) is
//! replaced mid-step: its replacement redoes its whole list from the step-start state, weight
//! halves in their order, sending only what its neighbours lack; with two replicas a lost
//! replica's micro-batches are re-routed to the other. Every such run ends bit-identical to the
//! undisturbed `seq1f1b` run. With mid-step recovery off a lost worker restarts the step from a
//! peer snapshot or checkpoint, bit-identically; and what is not wired (CUDA stages) is refused
//! before anything starts.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    assert_final_state, assert_same_tensors, children_of, ckpt_url, elastic_job, final_state,
    fresh_dir, metrics, resumable_train, run_err, run_events, run_ok, steps_done, wait_for_steps,
};
use rand::{Rng, SeedableRng};
use trainer::runtime::events::{Recovered, RunEvent, parse_records};
use trainer::runtime::recovery::Tier;

/// Settings every run here shares: an evaluation every 2 steps (the recovery defaults, mid-step
/// recovery on, are the same for the `seq1f1b` runs, so the runs differ in the schedule only).
const COMMON: [&str; 2] = ["train.eval_every=2", "train.eval_batches=2"];

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

/// One compute slice of a `--trace`: its stage thread, step, start (µs) and the first letter of
/// its name (`F`, `B`, `I` or `W`).
struct Slice {
    tid: u64,
    step: u64,
    ts: u64,
    op: char,
}

/// The forward and backward slices of the `--trace` file `trace`.
fn compute_slices(trace: &Path) -> Vec<Slice> {
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(trace).expect("trace written"))
            .expect("the trace is JSON");
    trace["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .iter()
        .filter(|e| matches!(e["cat"].as_str(), Some("forward" | "backward")))
        .map(|e| Slice {
            tid: e["tid"].as_u64().expect("a tid"),
            step: e["args"]["step"].as_u64().expect("a step"),
            ts: e["ts"].as_u64().expect("a ts"),
            op: e["name"]
                .as_str()
                .and_then(|n| n.chars().next())
                .expect("a name"),
        })
        .collect()
}

/// The `--trace` of a zero-bubble run names each stage's slices `F`, `I` and `W`, never a whole
/// `B`: per step, every stage ran every unit's forward and the two halves of its backward.
fn assert_trace_has_split_backwards(trace: &Path, shape: Shape, steps: u64, name: &str) {
    let mut counts: BTreeMap<(u64, char), usize> = BTreeMap::new();
    for slice in compute_slices(trace) {
        *counts.entry((slice.step, slice.op)).or_default() += 1;
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

/// Replays each stage's traced compute order per step (a unit is live from its `F` to its `W`)
/// and checks ZB-H1's memory rule as the workers ran it: no stage held more live units than the
/// job's Seq1F1B peak, `min(p + k − 1, m·k)` (its first stage's), and some stage held that many.
fn assert_trace_live_units_within_the_jobs_peak(trace: &Path, shape: Shape, name: &str) {
    // (stage thread, step) -> (start, op) of every compute slice.
    let mut slices: BTreeMap<(u64, u64), Vec<(u64, char)>> = BTreeMap::new();
    for slice in compute_slices(trace) {
        slices
            .entry((slice.tid, slice.step))
            .or_default()
            .push((slice.ts, slice.op));
    }
    let job = (shape.p + shape.k - 1).min(shape.m * shape.k);
    let mut most = 0;
    for ((stage, step), mut ops) in slices {
        ops.sort();
        let (mut live, mut peak) = (0i64, 0i64);
        for (_, op) in ops {
            live += match op {
                'F' => 1,
                'W' => -1,
                _ => 0,
            };
            peak = peak.max(live);
        }
        assert!(
            peak as usize <= job,
            "{name}: stage thread {stage} step {step} held {peak} live units, the job's \
             seq1f1b peak is {job}"
        );
        most = most.max(peak as usize);
    }
    assert_eq!(
        most, job,
        "{name}: no stage reached the job's peak of live units"
    );
}

#[test]
fn seq1f1b_zb_trains_bit_identically_to_seq1f1b_within_the_jobs_peak_of_units_and_bytes() {
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
        assert_trace_live_units_within_the_jobs_peak(&trace, zb, &name);
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
            // ZB-H1's memory rule in bytes: every worker may hold up to the job's Seq1F1B peak
            // of live units (checked on the trace) and of activation bytes, as the workers
            // measured them. The later stages hold more than under Seq1F1B; their units are
            // not the first stage's size (the last keeps the head's and loss's activations
            // too), which the order's byte model caps. The first stage holds exactly
            // Seq1F1B's units.
            assert_eq!(x.peaks.len(), p, "{name}");
            assert_eq!(y.peaks.len(), p, "{name}");
            assert!(
                x.peaks.iter().chain(&y.peaks).all(|&b| b > 0),
                "{name}: none measured"
            );
            let job = *x.peaks.iter().max().expect("stages");
            for (r, &held) in y.peaks.iter().enumerate() {
                assert!(
                    held <= job,
                    "{name} step {step}: stage {r} held {held} activation bytes, the job's \
                     seq1f1b peak is {job} (per stage {:?})",
                    x.peaks
                );
            }
            assert!(
                y.peaks[0] <= x.peaks[0],
                "{name} step {step}: the first stage held {} activation bytes, seq1f1b {}",
                y.peaks[0],
                x.peaks[0]
            );
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
fn a_zero_bubble_run_with_chunks_is_refused_before_anything_starts() {
    let dir = fresh_dir("zero-bubble-refused");
    let shape = Shape {
        kind: "seq1f1b-zb",
        p: 2,
        m: 4,
        k: 2,
    };
    // Split backwards run on CPU and CUDA stages, over TCP and NCCL device links, with mid-step
    // recovery; chunks are the interleaved kinds'.
    let run = dir.join("virtual-stages-2");
    let err = run_err(train(&run, shape, 2).args(["--set", "pipeline.virtual_stages=2"]));
    assert!(
        err.contains("pipeline.virtual_stages") && err.contains("seq1f1b-zb"),
        "{err}"
    );
    assert!(
        !run.join("metrics.jsonl").exists(),
        "nothing should have run"
    );
}

/// A worker lost mid-run (SIGKILL of its process) with mid-step recovery off: the interrupted
/// step restarts from the last peer snapshot or checkpoint and the run ends bit-identical to the
/// uninterrupted one.
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
            "mid-step recovery is off: {r:?}"
        );
    }
    eprintln!("worker lost: {recovered:?}");
}

/// Steps of the recovery runs below: room for several kills after the first steps.
const RECOVERY_STEPS: u64 = 20;

/// The elastic tests' job (4 stages, m = 4, k = 2; checkpoints every 2 steps) for
/// [`RECOVERY_STEPS`] steps with schedule `kind`, the recovery defaults (mid-step recovery and
/// peer snapshots on, every step's copy waited for) and `extra` settings.
fn recovery_job(run: &Path, kind: &str, extra: &[&str]) -> Command {
    let mut cmd = elastic_job(run, RECOVERY_STEPS);
    let kind = format!("pipeline.schedule={kind}");
    for s in [
        kind.as_str(),
        "pipeline.stages=4",
        "pipeline.microbatches=4",
        "pipeline.splits=2",
        "elastic.peer_snapshot_max_skips=0",
    ]
    .iter()
    .chain(extra)
    {
        cmd.args(["--set", s]);
    }
    cmd
}

/// The final state of the undisturbed `seq1f1b` run of [`recovery_job`], which every disturbed
/// `seq1f1b-zb` run must end on, bit for bit (whatever its replicas and stages).
fn seq1f1b_reference(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let reference = dir.join("seq1f1b-reference");
    run_ok(&mut recovery_job(&reference, "seq1f1b", &[]));
    final_state(&ckpt_url(&reference)).1
}

/// The `recovered` events the running job at `run` has written so far (a line being written is
/// not read yet).
fn recoveries_so_far(run: &Path) -> Vec<Recovered> {
    let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default();
    parse_records(&text)
        .into_iter()
        .filter_map(|r| match r {
            trainer::runtime::events::Record::Event(RunEvent::Recovered(r)) => Some(r),
            _ => None,
        })
        .collect()
}

/// SIGKILLs the worker processes of node `node` of the job whose launcher is `launcher` and
/// waits until the run at `run` records its recovery (a job that re-routes a replica records two:
/// the re-route, then the rebuilt pipeline); returns the first new `recovered` event.
fn kill_worker_and_wait(launcher: &mut Child, run: &Path, node: usize) -> Recovered {
    let before = recoveries_so_far(run).len();
    // The launcher's children are the nodes' agents (in node order), theirs the workers.
    let agents = children_of(launcher.id());
    let victims = children_of(agents[node]);
    assert!(!victims.is_empty(), "node {node} runs no worker to kill");
    for pid in &victims {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
    let started = Instant::now();
    loop {
        if let Some(r) = recoveries_so_far(run).into_iter().nth(before) {
            return r;
        }
        if let Some(status) = launcher.try_wait().unwrap() {
            panic!(
                "the job ended ({status}) without recovering node {node}'s worker ({})",
                run.display()
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "node {node}'s worker was not recovered within 5 minutes ({})",
            run.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills node `node`'s worker of the running job again and again, each time a step after the
/// last recovery and a few milliseconds more (a different moment of the step each try), until a
/// recovery is `wanted` (a kill may land outside a step's forward and backward, in the update or
/// a copy: then the step is redone from the peer snapshots); returns every recovery the kills
/// caused, the wanted one last.
fn kill_until(
    launcher: &mut Child,
    run: &Path,
    node: usize,
    wanted: impl Fn(&Recovered) -> bool,
) -> Vec<Recovered> {
    let mut seen: Vec<Recovered> = Vec::new();
    while !seen.last().is_some_and(&wanted) {
        let done = steps_done(run);
        assert!(
            done + 4 < RECOVERY_STEPS as usize,
            "no kill of node {node}'s worker recovered as wanted before the last steps: {seen:?}"
        );
        // A step after the last recovery, so that its peer snapshots are the ones held.
        wait_for_steps(run, done + 1);
        std::thread::sleep(Duration::from_millis((5 + 11 * seen.len() as u64) % 40));
        seen.push(kill_worker_and_wait(launcher, run, node));
    }
    seen
}

/// The step record of `step` (the last one written for it).
fn step_units(run: &Path, step: u64) -> usize {
    common::records(run)
        .iter()
        .rev()
        .filter_map(|r| r.as_step())
        .find(|s| s.step == step)
        .unwrap_or_else(|| panic!("no record of step {step}"))
        .units
}

/// Waits for the job to finish; it must succeed, its final state equal `reference`, and every
/// recovery it recorded lose no completed step when mid-step (`MidStep`, `Reroute`). Returns the
/// recoveries.
fn finish(
    launcher: Child,
    run: &Path,
    reference: &BTreeMap<String, Vec<u8>>,
    name: &str,
) -> Vec<Recovered> {
    let out = launcher.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name}: {:?}\n{stderr}", out.status);
    assert_final_state(run, RECOVERY_STEPS, reference);
    let recovered = recoveries_so_far(run);
    for r in &recovered {
        if matches!(r.tier, Tier::MidStep | Tier::Reroute) {
            assert_eq!(r.lost_steps, 0, "{name}: {r:?}");
        }
    }
    recovered
}

/// Spawns `cmd` with its output piped (read by [`finish`]).
fn spawn(cmd: &mut Command) -> Child {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Compute actions per stage per step of the recovery job: m·k units, each F, I and W.
const ZB_UNITS_PER_STAGE: usize = 4 * 2 * 3;

/// The first, a middle and the last stage's worker SIGKILLed in the middle of a step (each in
/// its own run; again until a kill lands where some of its units were done): replaced mid-step
/// on its own node with no step lost, no survivor recomputing anything (the stages computed one
/// step's units in all, the replacement's replay included), and the run ends bit-identical to
/// the undisturbed `seq1f1b` run.
#[test]
fn a_worker_killed_mid_step_is_replaced_bit_identically() {
    let dir = fresh_dir("zero-bubble-mid-step");
    let reference = seq1f1b_reference(&dir);
    for stage in [0, 2, 3] {
        let name = format!("stage-{stage}");
        let run = dir.join(&name);
        let mut launcher = spawn(&mut recovery_job(&run, "seq1f1b-zb", &[]));
        wait_for_steps(&run, 3);
        // Killed in the middle of the step: some of its units were done, and a neighbour has
        // their outputs.
        let kills = kill_until(&mut launcher, &run, stage, |r| {
            r.tier == Tier::MidStep && r.redone_units.is_some_and(|u| u > 0)
        });
        let recovered = finish(launcher, &run, &reference, &name);
        let r = kills.last().unwrap();
        assert_eq!(
            (r.stage, r.stages_before, r.stages_after),
            (Some(stage), 4, 4),
            "{name}: {r:?}"
        );
        assert_eq!(
            step_units(&run, r.step),
            4 * ZB_UNITS_PER_STAGE,
            "{name}: {r:?}"
        );
        let redone = r
            .redone_units
            .expect("a mid-step recovery counts its redone units");
        assert!(redone <= ZB_UNITS_PER_STAGE, "{name}: {r:?}");
        for r in &recovered {
            assert!(
                matches!(r.tier, Tier::MidStep | Tier::Peer),
                "{name}: {r:?}"
            );
        }
        eprintln!(
            "{name}: {} kill(s), the last redid {redone} units",
            kills.len()
        );
    }
}

/// Chaos: one run, a seeded random stage's worker SIGKILLed again and again at random moments
/// (each after the last recovery and a step more). Every loss is repaired mid-step or, when the
/// kill lands outside a step's forward and backward, from the peer snapshots; at least two are
/// mid-step; the run ends bit-identical to the undisturbed `seq1f1b` run.
#[test]
fn chaos_with_mid_step_recoveries_is_bit_identical() {
    const KILLS: usize = 5;
    let dir = fresh_dir("zero-bubble-chaos");
    let reference = seq1f1b_reference(&dir);
    let run = dir.join("chaos");
    let mut launcher = spawn(&mut recovery_job(&run, "seq1f1b-zb", &[]));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(20261128);
    wait_for_steps(&run, 2);
    let mut kills = Vec::new();
    while kills.len() < KILLS && steps_done(&run) + 4 < RECOVERY_STEPS as usize {
        wait_for_steps(&run, steps_done(&run) + 1);
        std::thread::sleep(Duration::from_millis(rng.random_range(0..50)));
        let stage = rng.random_range(0..4);
        let r = kill_worker_and_wait(&mut launcher, &run, stage);
        kills.push((stage, r));
    }
    let recovered = finish(launcher, &run, &reference, "chaos");
    let mid_step = recovered.iter().filter(|r| r.tier == Tier::MidStep).count();
    for r in &recovered {
        assert!(matches!(r.tier, Tier::MidStep | Tier::Peer), "{r:?}");
    }
    assert!(
        kills.len() >= 3,
        "only {} kills landed: {kills:?}",
        kills.len()
    );
    assert!(
        mid_step >= 2,
        "only {mid_step} of {} losses were repaired mid-step: {recovered:?}",
        kills.len()
    );
    eprintln!(
        "chaos: {} kills (stages {:?}), {mid_step} repaired mid-step",
        kills.len(),
        kills.iter().map(|(s, _)| s).collect::<Vec<_>>()
    );
}

/// Two replicas of two stages: a worker of replica 1 SIGKILLed in the middle of its share of a
/// step (again if a kill lands in the reduction or the update): replica 0 computes the lost
/// micro-batches through its own zero-bubble pipeline, the step completes (tier `reroute`, no
/// step lost), and the run ends bit-identical to the undisturbed one-replica, 4-stage
/// `seq1f1b` run.
#[test]
fn a_lost_replica_is_rerouted_bit_identically() {
    let dir = fresh_dir("zero-bubble-reroute");
    let reference = seq1f1b_reference(&dir);
    let run = dir.join("reroute");
    let replicas = ["pipeline.replicas=2", "pipeline.stages=2"];
    let mut launcher = spawn(&mut recovery_job(&run, "seq1f1b-zb", &replicas));
    wait_for_steps(&run, 3);
    let kills = kill_until(&mut launcher, &run, 2, |r| r.tier == Tier::Reroute);
    let recovered = finish(launcher, &run, &reference, "reroute");
    let r = kills.last().unwrap();
    assert_eq!(r.lost_steps, 0, "{r:?}");
    assert!(
        recovered
            .iter()
            .any(|x| x.step == r.step + 1 && x.lost_steps == 0),
        "the pipeline rebuilt after the re-routed step loses nothing: {recovered:?}"
    );
    eprintln!("reroute: {} kill(s), {recovered:?}", kills.len());
}
