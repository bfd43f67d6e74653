//! Virtual stages end to end (the real binary, workers over TCP): the interleaved schedules train
//! bit-identically to their plain counterparts with the same segment count — `seq1f1b-i` to
//! `seq1f1b`, `1f1b-i` to `1f1b` — and checkpoints move between (p, v) and (d, p, v) shapes
//! without changing a bit, because parameter names are global, each chunk runs its layers with
//! the same operations, gradients accumulate per chunk in the same order, and the gradient norm is
//! summed in canonical order whichever worker holds a tensor.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use common::{
    assert_final_state, assert_same_tensors, children_of, ckpt_url, elastic_job, final_state,
    fresh_dir, metrics, resumable_train, run_err, run_events, run_ok, tiny_model_args,
    wait_for_steps,
};
use trainer::runtime::events::RunEvent;
use trainer::runtime::recovery::Tier;

/// Settings every run here shares: 8 layers (so p·v = 4·2 virtual stages each get one), an
/// evaluation every 2 steps (the forward-only pass over the chunks), and mid-step recovery and
/// peer snapshots off (no faults here; the same for the plain runs, so the runs differ in the
/// pipeline only).
const COMMON: [&str; 5] = [
    "model.layers=8",
    "train.eval_every=2",
    "train.eval_batches=2",
    "elastic.mid_step=false",
    "elastic.peer_snapshots=false",
];

/// A pipeline shape: schedule, stages p, chunks per stage v, replicas d, micro-batches m,
/// segments k.
#[derive(Clone, Copy, Debug)]
struct Shape {
    kind: &'static str,
    p: usize,
    v: usize,
    d: usize,
    m: usize,
    k: usize,
}

impl Shape {
    /// Forwards and backwards all workers compute in a step: each of the p·v virtual stages runs
    /// each of the m·k units forward and backward, whatever d.
    fn units(&self) -> u64 {
        (self.p * self.v * self.m * self.k * 2) as u64
    }

    fn sets(&self) -> Vec<String> {
        vec![
            format!("pipeline.schedule={}", self.kind),
            format!("pipeline.stages={}", self.p),
            format!("pipeline.virtual_stages={}", self.v),
            format!("pipeline.replicas={}", self.d),
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

/// Per step: (loss, validation loss if evaluated, units computed by all workers), exact.
fn step_records(run_dir: &Path) -> Vec<(u64, Option<u64>, u64)> {
    metrics(run_dir)
        .iter()
        .filter(|m| m.get("loss").is_some())
        .map(|m| {
            let bits = |key: &str| m.get(key).and_then(|x| x.as_f64()).map(f64::to_bits);
            (
                bits("loss").expect("a loss"),
                bits("val_loss"),
                m.get("units").and_then(|u| u.as_u64()).expect("units"),
            )
        })
        .collect()
}

/// The per-step losses (and validation losses) of `interleaved` equal `plain`'s bit for bit,
/// and every step of `interleaved` computed v times the units (each worker ran each unit's
/// forward and backward on each of its v chunks): the equality is not that of one chunk's work.
fn assert_same_training(plain: &Path, interleaved: &Path, v: u64, steps: usize) {
    let (a, b) = (step_records(plain), step_records(interleaved));
    assert_eq!(a.len(), steps, "{}", plain.display());
    assert_eq!(b.len(), steps, "{}", interleaved.display());
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        let step = step + 1;
        assert_eq!(
            (x.0, x.1),
            (y.0, y.1),
            "step {step}: (loss, val_loss) bits differ: {} vs {}",
            plain.display(),
            interleaved.display()
        );
        assert!(x.2 > 0, "step {step} computed no units");
        assert_eq!(
            y.2,
            v * x.2,
            "step {step}: the interleaved run should compute {v}× the plain run's units"
        );
    }
    assert!(
        a.iter().any(|r| r.1.is_some()),
        "the runs should have evaluated"
    );
}

#[test]
fn interleaved_schedules_train_bit_identically_to_their_plain_counterparts() {
    let dir = fresh_dir("interleaved");
    const STEPS: u64 = 4;
    let cases = [
        // (interleaved, plain): same p, m, k; v = 2.
        ("seq1f1b-i", "seq1f1b", 2, 4, 2),
        ("1f1b-i", "1f1b", 2, 2, 3),
        ("seq1f1b-i", "seq1f1b", 4, 4, 4),
        ("1f1b-i", "1f1b", 4, 8, 2),
    ];
    for (interleaved, plain, p, m, k) in cases {
        let name = format!("{interleaved}-p{p}-m{m}-k{k}");
        let shape = |kind, v| Shape {
            kind,
            p,
            v,
            d: 1,
            m,
            k,
        };
        let (a, b) = (dir.join(format!("{name}-plain")), dir.join(&name));
        run_ok(&mut train(&a, shape(plain, 1), STEPS));
        let out = run_ok(&mut train(&b, shape(interleaved, 2), STEPS));
        // The run says what it holds: p stages of two chunks each (`0..1+4..5` on stage 0 of 4).
        let banner = String::from_utf8_lossy(&out.stderr);
        let says = format!("pipeline: {p} stages x 2 virtual stages (layers ");
        let chunks: Vec<&str> = banner
            .split_once(says.as_str())
            .and_then(|(_, rest)| rest.split_once(')'))
            .map(|(ranges, _)| ranges.split(' ').collect())
            .unwrap_or_default();
        assert!(
            chunks.len() == p && chunks.iter().all(|c| c.matches('+').count() == 1),
            "{name}: {banner}"
        );
        assert_same_training(&a, &b, 2, STEPS as usize);
        assert!(
            step_records(&b)
                .iter()
                .all(|r| r.2 == shape(interleaved, 2).units()),
            "{name}: every step runs all p·v·m·k units forward and backward"
        );
        assert_same_tensors(&a, &b);
        eprintln!("{name}: bit-identical to {plain} over {STEPS} steps");
    }
}

#[test]
fn checkpoints_move_between_virtual_stage_shapes_bit_identically() {
    let dir = fresh_dir("interleaved-resume");
    const STEPS: u64 = 6;
    let shape = |kind, p, v, d| Shape {
        kind,
        p,
        v,
        d,
        m: 4,
        k: 2,
    };
    let p4v2 = shape("seq1f1b-i", 4, 2, 1);
    // The uninterrupted run, 4 stages × 2 chunks.
    let straight = dir.join("straight");
    run_ok(&mut train(&straight, p4v2, STEPS));
    // Written with (p = 4, v = 2) at step 3, resumed onto (p = 2, v = 1) and onto
    // (d = 2, p = 2, v = 2); and written with (p = 2, v = 1), resumed onto (p = 4, v = 2).
    for (first, then, name) in [
        (p4v2, shape("seq1f1b", 2, 1, 1), "p4v2-to-p2v1"),
        (p4v2, shape("seq1f1b-i", 2, 2, 2), "p4v2-to-d2p2v2"),
        (shape("seq1f1b", 2, 1, 1), p4v2, "p2v1-to-p4v2"),
    ] {
        let run = dir.join(name);
        run_ok(&mut train(&run, first, STEPS / 2));
        run_ok(train(&run, then, STEPS).args(["--resume", "latest"]));
        let (steps, straight_steps) = (step_records(&run), step_records(&straight));
        assert_eq!(steps.len(), straight_steps.len(), "{name}");
        for (step, (x, y)) in steps.iter().zip(&straight_steps).enumerate() {
            let step = step + 1;
            assert_eq!(
                x.0, y.0,
                "{name}: step {step}'s loss differs from the uninterrupted run"
            );
            let ran = if step as u64 <= STEPS / 2 {
                first
            } else {
                then
            };
            assert_eq!(x.2, ran.units(), "{name}: step {step} should run {ran:?}");
            // The first run also evaluates at its last step (3), which the straight run skips.
            if let (Some(a), Some(b)) = (x.1, y.1) {
                assert_eq!(a, b, "{name}: step {step}'s validation loss differs");
            }
        }
        assert_same_tensors(&straight, &run);
        eprintln!("{name}: bit-identical to the uninterrupted (p = 4, v = 2) run");
    }
}

#[test]
fn fewer_layers_than_virtual_stages_are_refused_before_anything_starts() {
    let dir = fresh_dir("interleaved-refused");
    let shape = Shape {
        kind: "seq1f1b-i",
        p: 2,
        v: 2,
        d: 1,
        m: 4,
        k: 2,
    };
    let run = dir.join("model-layers-3");
    let err = run_err(train(&run, shape, 2).args(["--set", "model.layers=3"]));
    assert!(err.contains("model.layers = 3"), "{err}");
    assert!(
        !run.join("metrics.jsonl").exists(),
        "nothing should have run"
    );
}

/// A worker holding v chunks lost mid-run (SIGKILL of its process, or of its whole node). With
/// mid-step recovery and peer snapshots off the run restarts from its last checkpoint — on the
/// same four nodes when only the worker died, on the three left when its node did (three stages
/// cannot interleave four micro-batches: those steps run the plain `seq1f1b`, bit-identical). With
/// them on (the defaults) the killed worker's two chunks are replaced in the middle of the step
/// (or, when the kill lands outside a step's forward and backward, the step is redone from the
/// peer snapshots), never from the checkpoint. Every run ends bit-identical to the uninterrupted
/// run.
#[test]
fn a_lost_worker_of_an_interleaved_run_recovers_bit_identically() {
    const STEPS: u64 = 16;
    let dir = fresh_dir("interleaved-loss");
    let job = |run: &Path, recovery: &[&str]| {
        let mut cmd = elastic_job(run, STEPS);
        for s in [
            "model.layers=8",
            "pipeline.schedule=seq1f1b-i",
            "pipeline.stages=4",
            "pipeline.virtual_stages=2",
            "pipeline.microbatches=4",
            "pipeline.splits=2",
        ]
        .iter()
        .chain(recovery)
        {
            cmd.args(["--set", s]);
        }
        cmd
    };
    let off = ["elastic.mid_step=false", "elastic.peer_snapshots=false"];
    let on = ["elastic.mid_step=true", "elastic.peer_snapshots=true"];
    let reference_dir = dir.join("reference");
    run_ok(&mut job(&reference_dir, &off));
    let (_, reference) = final_state(&ckpt_url(&reference_dir));
    for (name, whole_node, recovery) in [
        ("worker", false, &off),
        ("node", true, &off),
        ("worker-mid-step", false, &on),
    ] {
        let run = dir.join(name);
        let child = job(&run, recovery)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        wait_for_steps(&run, 5);
        // The launcher's children are the nodes' agents, theirs the workers.
        let agent = children_of(child.id())[1];
        let victims = if whole_node {
            let mut v = children_of(agent);
            v.push(agent);
            v
        } else {
            children_of(agent)
        };
        assert!(!victims.is_empty(), "{name}: no worker to kill");
        for pid in &victims {
            let _ = Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {:?}\n{stderr}", out.status);
        if whole_node {
            assert!(
                stderr.contains("its pipeline runs seq1f1b (bit-identical)"),
                "{name}: three stages should run the plain seq1f1b:\n{stderr}"
            );
        }
        assert_final_state(&run, STEPS, &reference);
        let events = run_events(&run);
        let recovered: Vec<_> = events
            .iter()
            .filter_map(|e| match e {
                RunEvent::Recovered(r) => Some(r),
                _ => None,
            })
            .collect();
        assert!(
            !recovered.is_empty(),
            "{name}: the loss should have been recovered: {events:?}"
        );
        for r in &recovered {
            if recovery == &on {
                assert!(
                    matches!(r.tier, Tier::MidStep | Tier::Peer),
                    "{name}: {r:?}"
                );
                if r.tier == Tier::MidStep {
                    assert_eq!(r.lost_steps, 0, "{name}: {r:?}");
                }
            } else {
                assert_eq!(r.tier, Tier::Checkpoint, "{name}: {r:?}");
            }
        }
        eprintln!("{name} lost: {recovered:?}");
    }
}

/// Document masks over chunks: the first worker's chunk 0 reads each micro-batch's documents off
/// its tokens, and every activation carries them on, round the ring to the first worker's later
/// chunks too. Bit-identical to `seq1f1b` with masks (and positions restarting per document),
/// and the masks are not vacuous: the same run unmasked trains differently.
#[test]
fn document_masks_train_bit_identically_over_chunks() {
    const STEPS: u64 = 3;
    const DOCUMENTS: [&str; 2] = [
        "data.synthetic_document_median=8",
        "data.synthetic_document_sigma=1.0",
    ];
    let dir = fresh_dir("interleaved-masks");
    let run = |name: &str, kind, v, masks: bool| {
        let shape = Shape {
            kind,
            p: 2,
            v,
            d: 1,
            m: 4,
            k: 2,
        };
        let run_dir = dir.join(name);
        let mut cmd = train(&run_dir, shape, STEPS);
        for s in DOCUMENTS {
            cmd.args(["--set", s]);
        }
        // With masks, positions restart at each document too (on virtual stage 0's embeddings).
        cmd.args(["--set", &format!("data.document_mask={masks}")])
            .args(["--set", &format!("data.reset_positions={masks}")]);
        run_ok(&mut cmd);
        run_dir
    };
    let plain = run("plain", "seq1f1b", 1, true);
    let interleaved = run("interleaved", "seq1f1b-i", 2, true);
    assert_same_training(&plain, &interleaved, 2, STEPS as usize);
    assert_same_tensors(&plain, &interleaved);
    let unmasked = run("unmasked", "seq1f1b-i", 2, false);
    assert_ne!(
        step_records(&unmasked)[0].0,
        step_records(&interleaved)[0].0,
        "masks should change the loss"
    );
}

/// The document partition over chunks: every chunk of every worker cuts each micro-batch into
/// the same lengths from its documents (the starts ride round the ring with the activations), so
/// `1f1b-i` with `pipeline.partition = "documents"` is bit-identical to `1f1b` with it. Not
/// vacuous: the trace shows units of the interleaved run cut into lengths other than the compute
/// partition's one table, and micro-batches cut differently from each other.
#[test]
fn the_document_partition_trains_bit_identically_over_chunks() {
    const STEPS: u64 = 2;
    let dir = fresh_dir("interleaved-doc-partition");
    let run = |name: &str, kind, v| {
        let shape = Shape {
            kind,
            p: 2,
            v,
            d: 1,
            m: 2,
            k: 8,
        };
        let run_dir = dir.join(name);
        let trace = dir.join(format!("{name}.json"));
        let mut cmd = train(&run_dir, shape, STEPS);
        for s in [
            "data.synthetic_document_median=8",
            "data.synthetic_document_sigma=1.0",
            "data.document_mask=true",
            "pipeline.partition=\"documents\"",
        ] {
            cmd.args(["--set", s]);
        }
        run_ok(cmd.arg("--trace").arg(&trace));
        (run_dir, trace)
    };
    let (plain, _) = run("plain", "1f1b", 1);
    let (interleaved, trace) = run("interleaved", "1f1b-i", 2);
    assert_same_training(&plain, &interleaved, 2, STEPS as usize);
    assert_same_tensors(&plain, &interleaved);
    // Each (step, micro-batch)'s segment lengths, from every forward on every chunk: one cut
    // per micro-batch whichever worker and chunk computed it.
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let mut cuts: BTreeMap<(u64, usize), BTreeMap<usize, BTreeSet<u64>>> = BTreeMap::new();
    for e in trace["traceEvents"].as_array().unwrap() {
        if e["cat"].as_str() != Some("forward") {
            continue;
        }
        let name = e["name"].as_str().unwrap();
        let unit = name[1..].split('@').next().unwrap();
        let (mb, seg) = unit.split_once('.').unwrap();
        let at = (e["args"]["step"].as_u64().unwrap(), mb.parse().unwrap());
        cuts.entry(at)
            .or_default()
            .entry(seg.parse().unwrap())
            .or_default()
            .insert(e["args"]["len"].as_u64().unwrap());
    }
    assert_eq!(cuts.len(), 2 * STEPS as usize, "{cuts:?}");
    let cuts: Vec<Vec<u64>> = cuts
        .values()
        .map(|segs| {
            assert_eq!(segs.len(), 8, "{segs:?}");
            segs.values()
                .map(|lens| {
                    assert_eq!(
                        lens.len(),
                        1,
                        "one length per unit on every chunk: {segs:?}"
                    );
                    *lens.first().unwrap()
                })
                .collect()
        })
        .collect();
    let mut sets: Vec<String> = tiny_model_args().chunks(2).map(|c| c[1].clone()).collect();
    sets.extend(["model.layers=8", "pipeline.splits=8"].map(String::from));
    let cfg = trainer::config::Config::load(None, &sets).unwrap();
    let table: Vec<u64> = cfg
        .segment_lengths()
        .unwrap()
        .iter()
        .map(|&l| l as u64)
        .collect();
    assert!(
        cuts.iter().any(|c| *c != cuts[0]) && cuts.iter().any(|c| *c != table),
        "every micro-batch cut the same way, or as the compute partition's {table:?}: {cuts:?}"
    );
}
