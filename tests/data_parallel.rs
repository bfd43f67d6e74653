//! Data parallelism × pipeline end to end with the real binary: d replicas of a p-stage pipeline
//! (d·p worker processes) train to the bit-identical state for every (d, p) with the same global
//! batch and seed, and a checkpoint written by one layout resumes onto another, bit-exact.

mod common;

use std::path::Path;
use std::process::Command;

use common::{ckpt_url, final_state, fresh_dir, losses, metrics, run_ok, seqpipe, tiny_model_args};

/// `train` with the tiny model, 4 micro-batches of 2 segments, checkpoints every 3 steps and a
/// 6-step LR schedule, on `replicas` × `stages` workers, into `run_dir`.
fn train(run_dir: &Path, replicas: usize, stages: usize, extra: &[&str]) -> Command {
    let mut cmd = seqpipe();
    cmd.args(["train", "-q"])
        .args(tiny_model_args())
        .args([
            "--set",
            "pipeline.microbatches=4",
            "--set",
            "pipeline.splits=2",
            "--set",
            "checkpoint.every=3",
            "--set",
            "train.decay_steps=6",
        ])
        .arg("--set")
        .arg(format!("pipeline.replicas={replicas}"))
        .arg("--set")
        .arg(format!("pipeline.stages={stages}"))
        .arg("--set")
        .arg(format!("run.dir={}", run_dir.display()));
    for s in extra {
        cmd.args(["--set", s]);
    }
    cmd
}

/// Asserts that the newest checkpoints of `a` and `b` hold the same step and bit-identical
/// parameters and AdamW moments.
fn assert_same_state(a: &Path, b: &Path) {
    let (sa, ta) = final_state(&ckpt_url(a));
    let (sb, tb) = final_state(&ckpt_url(b));
    assert_eq!(sa, sb, "final checkpoint steps differ");
    assert_eq!(
        ta.keys().collect::<Vec<_>>(),
        tb.keys().collect::<Vec<_>>(),
        "different tensor sets"
    );
    assert!(
        ta.keys().any(|k| k.starts_with("optim.m.")),
        "optimizer state missing"
    );
    for (name, bytes) in &ta {
        assert!(
            bytes == &tb[name],
            "tensor {name} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

#[test]
fn every_replica_count_trains_to_the_same_bits() {
    let dir = fresh_dir("dp-layouts");
    let reference = dir.join("d1-p2");
    run_ok(&mut train(&reference, 1, 2, &["train.steps=6"]));
    for (d, p) in [(2, 2), (4, 1), (2, 1)] {
        let run = dir.join(format!("d{d}-p{p}"));
        run_ok(&mut train(&run, d, p, &["train.steps=6"]));
        assert_same_state(&reference, &run);
        assert_eq!(
            losses(&reference),
            losses(&run),
            "({d}, {p}): per-step losses differ from (1, 2)"
        );
        // The reduction is recorded per step: every worker sends 2·(d−1)/d of its stage's
        // gradient.
        for m in metrics(&run).iter().filter(|m| m.get("loss").is_some()) {
            let bytes = m["reduce_bytes"].as_u64().unwrap_or(0);
            assert!(bytes > 0, "({d}, {p}): no reduction recorded in {m}");
        }
    }
    for m in metrics(&reference) {
        assert!(
            m.get("reduce_bytes").is_none(),
            "one replica reduces nothing: {m}"
        );
    }
}

#[test]
fn a_two_by_two_checkpoint_resumes_onto_one_by_four_and_four_by_one() {
    let dir = fresh_dir("dp-resume");
    let straight = dir.join("straight");
    run_ok(&mut train(&straight, 2, 2, &["train.steps=6"]));
    for (d, p) in [(1, 4), (4, 1)] {
        let split = dir.join(format!("onto-d{d}-p{p}"));
        run_ok(&mut train(&split, 2, 2, &["train.steps=3"]));
        run_ok(
            seqpipe()
                .args(["resume", "-q"])
                .arg(&split)
                .args(["--set", "train.steps=6"])
                .arg("--set")
                .arg(format!("pipeline.replicas={d}"))
                .arg("--set")
                .arg(format!("pipeline.stages={p}")),
        );
        assert_same_state(&straight, &split);
        assert_eq!(
            losses(&straight),
            losses(&split),
            "({d}, {p}): losses differ"
        );
    }
}

#[test]
fn a_replica_count_that_would_change_the_sum_is_refused() {
    let dir = fresh_dir("dp-invalid");
    let out = train(&dir, 3, 1, &["train.steps=1"]).output().unwrap();
    assert!(!out.status.success(), "3 replicas of 4 micro-batches ran");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("pipeline.replicas") && err.contains("[1, 2, 4]"),
        "{err}"
    );
}
