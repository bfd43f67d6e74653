//! Document masks end to end with the real binary (issue 32): `seqpipe train` on synthetic packed
//! documents with `data.document_mask = true`, p worker processes over TCP (the first stage reads
//! the documents off its tokens, the activations carry them to the others), dumps its gradients,
//! which equal one in-process stage holding the whole model that runs the whole global batch as a
//! single masked unit (as `pipeline_gradients.rs` does for the unmasked model); the masked run's
//! loss decreases, and a resumed run ends bit-identical to an undisturbed one.

mod common;

use std::path::Path;

use common::gradients::assert_step_equals_reference;
use common::{ckpt_url, final_state, fresh_dir, losses, run_err, run_ok, seqpipe, tiny_model_args};

/// The synthetic packed documents of these tests: log-normal lengths with a median of 8 tokens
/// (several documents per 48-token row, some of one token), masks on.
const DOCUMENTS: [&str; 3] = [
    "data.synthetic_document_median=8",
    "data.synthetic_document_sigma=1.0",
    "data.document_mask=true",
];

/// One step of the binary with p stages and k segments of `partition`, compared with the
/// reference; `extra` are more settings.
fn check(p: usize, k: usize, partition: &str, extra: &[&str]) {
    let dir = fresh_dir("docmask-grads");
    let mut sets = tiny_model_args();
    for s in [
        format!("pipeline.stages={p}"),
        format!("pipeline.splits={k}"),
        format!("pipeline.partition=\"{partition}\""),
        "pipeline.microbatches=2".into(),
        "train.steps=1".into(),
        format!("run.dir={}", dir.join("run").display()),
    ]
    .into_iter()
    .chain(DOCUMENTS.iter().chain(extra).map(|s| s.to_string()))
    {
        sets.push("--set".into());
        sets.push(s);
    }
    let what = format!("masked p={p} k={k} {partition} {extra:?}");
    assert_step_equals_reference(&sets, &dir, p, &what);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn masked_pipelined_gradients_over_tcp_equal_the_single_process_masked_model() {
    for partition in ["uniform", "compute"] {
        for p in [1, 2, 4] {
            for k in [1, 2, 4, 8] {
                check(p, k, partition, &[]);
            }
        }
    }
    // Positions restarting per document reach the first stage's position embedding.
    check(2, 4, "compute", &["data.reset_positions=true"]);
}

#[test]
fn masked_training_learns_and_resumes_bit_identically() {
    let dir = fresh_dir("docmask-train");
    let train = |run: &Path, steps: u64| {
        let mut cmd = common::resumable_train(run, &DOCUMENTS);
        cmd.args(["--set", &format!("train.steps={steps}")]).args([
            "--set",
            "pipeline.stages=2",
            "--set",
            "pipeline.splits=4",
        ]);
        cmd
    };
    let straight = dir.join("straight");
    run_ok(&mut train(&straight, 12));
    let l = losses(&straight);
    assert_eq!(l.len(), 12);
    let (head, tail) = (
        l[..3].iter().sum::<f64>() / 3.0,
        l[9..].iter().sum::<f64>() / 3.0,
    );
    assert!(tail < head - 0.1, "masked training did not learn: {l:?}");

    // 6 steps, stop, resume for 6 more.
    let split = dir.join("split");
    run_ok(&mut train(&split, 6));
    run_ok(
        seqpipe()
            .args(["resume", "-q"])
            .arg(&split)
            .args(["--set", "train.steps=12"]),
    );
    assert_eq!(
        losses(&straight),
        losses(&split),
        "per-step losses differ after resume"
    );
    let (sa, ta) = final_state(&ckpt_url(&straight));
    let (sb, tb) = final_state(&ckpt_url(&split));
    assert_eq!((sa, ta.len()), (sb, tb.len()));
    assert!(ta == tb, "the resumed run's final state differs");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn masks_without_an_end_of_text_token_are_refused_before_training() {
    let dir = fresh_dir("docmask-no-eot");
    // The plain synthetic language has no documents.
    let err = run_err(
        seqpipe()
            .args(["train", "-q"])
            .args(tiny_model_args())
            .args(["--set", "data.document_mask=true", "--set", "train.steps=1"])
            .arg("--set")
            .arg(format!("run.dir={}", dir.join("run").display())),
    );
    assert!(
        err.contains("end-of-text token") && err.contains("synthetic_document_median"),
        "{err}"
    );
    // Nor does a prepared dataset whose meta.json names none.
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let tokens: Vec<u8> = (0..400u16).flat_map(|i| (i % 60).to_le_bytes()).collect();
    std::fs::write(data.join("train.bin"), &tokens).unwrap();
    std::fs::write(data.join("val.bin"), &tokens).unwrap();
    let err = run_err(
        seqpipe()
            .args(["train", "-q"])
            .args(tiny_model_args())
            .args(["--set", "data.document_mask=true", "--set", "train.steps=1"])
            .arg("--set")
            .arg(format!("data.source={}", data.display()))
            .arg("--set")
            .arg(format!("run.dir={}", dir.join("run2").display())),
    );
    assert!(
        err.contains("end-of-text token") && err.contains("meta.json"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
