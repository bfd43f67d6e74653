//! Pipelined gradients and loss equal the single-process, unsplit reference: the real `seqpipe`
//! binary runs one step with p worker processes over TCP and dumps its gradients, which are compared
//! with one in-process stage that holds the whole model and runs the whole global batch as a single
//! unit (no micro-batches, no segments).

mod common;

use common::gradients::assert_step_equals_reference;
use common::{fresh_dir, tiny_model_args};

/// Runs every (p, k, m) combination of one schedule kind and compares with the reference.
fn check_schedule(kind: &str, extra: &[&str]) {
    for p in [1, 2, 4] {
        for k in [1, 2, 4] {
            for m in [1, 3] {
                let dir = fresh_dir(&format!("grads-{kind}"));
                let mut sets = tiny_model_args();
                for s in [
                    format!("pipeline.schedule={kind}"),
                    format!("pipeline.stages={p}"),
                    format!("pipeline.splits={k}"),
                    format!("pipeline.microbatches={m}"),
                    "train.steps=1".into(),
                    format!("run.dir={}", dir.join("run").display()),
                ]
                .into_iter()
                .chain(extra.iter().map(|s| s.to_string()))
                {
                    sets.push("--set".into());
                    sets.push(s);
                }
                let what = format!("{kind} p={p} k={k} m={m} {extra:?}");
                assert_step_equals_reference(&sets, &dir, p, &what);
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
}

#[test]
fn seq1f1b_gradients_equal_single_process_reference() {
    check_schedule("seq1f1b", &[]);
}

#[test]
fn one_f_one_b_gradients_equal_single_process_reference() {
    check_schedule("1f1b", &[]);
}

#[test]
fn gpipe_gradients_equal_single_process_reference() {
    check_schedule("gpipe", &[]);
}

#[test]
fn rope_rmsnorm_uniform_segments_gradients_equal_reference() {
    check_schedule(
        "seq1f1b",
        &[
            "model.position=\"rope\"",
            "model.norm=\"rmsnorm\"",
            "pipeline.partition=\"uniform\"",
        ],
    );
}
