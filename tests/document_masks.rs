//! Document masks end to end with the real binary (issue 32): `seqpipe train` on synthetic packed
//! documents with `data.document_mask = true`, p worker processes over TCP (the first stage reads
//! the documents off its tokens, the activations carry them to the others), dumps its gradients,
//! which equal one in-process stage holding the whole model that runs the whole global batch as a
//! single masked unit (as `pipeline_gradients.rs` does for the unmasked model), with the uniform,
//! compute and document partitions; the masked run's loss decreases, and a resumed run ends
//! bit-identical to an undisturbed one. With the document partition every stage of every replica
//! cuts each micro-batch into the lengths its documents give (read back from the trace), two
//! replicas end bit-identical to one, and a worker SIGKILLed mid-run is recovered and the run
//! ends bit-identical to the undisturbed one.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::gradients::assert_step_equals_reference;
use common::{
    assert_final_state, children_of, ckpt_url, elastic_job, final_state, fresh_dir, losses,
    run_err, run_events, run_ok, seqpipe, tiny_model_args, wait_for_steps,
};
use serde_json::Value;
use trainer::config::Config;
use trainer::data::{Split, document_separator, document_starts, micro_batch_tokens, open_source};
use trainer::runtime::events::RunEvent;

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
    for partition in ["uniform", "compute", "documents"] {
        for p in [1, 2, 4] {
            for k in [1, 2, 4, 8] {
                check(p, k, partition, &[]);
            }
        }
    }
    // Positions restarting per document reach the first stage's position embedding.
    check(2, 4, "compute", &["data.reset_positions=true"]);
    check(2, 8, "documents", &["data.reset_positions=true"]);
}

#[test]
fn masked_training_learns_and_resumes_bit_identically() {
    learns_and_resumes("compute");
}

#[test]
fn document_partitioned_training_learns_and_resumes_bit_identically() {
    learns_and_resumes("documents");
}

/// 12 masked steps with `partition` learn, and 6 + 6 with a resume end bit-identical.
fn learns_and_resumes(partition: &str) {
    let dir = fresh_dir(&format!("docmask-train-{partition}"));
    let train = |run: &Path, steps: u64| {
        let mut cmd = common::resumable_train(run, &DOCUMENTS);
        cmd.args(["--set", &format!("train.steps={steps}")])
            .args(["--set", "pipeline.stages=2", "--set", "pipeline.splits=4"])
            .args(["--set", &format!("pipeline.partition=\"{partition}\"")]);
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
    assert!(
        tail < head - 0.1,
        "masked training ({partition}) did not learn: {l:?}"
    );

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
    assert!(
        ta == tb,
        "the resumed run's final state differs ({partition})"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The segment lengths of every unit a traced run computed: (step, stage, global micro-batch,
/// forward?) → lengths by segment, from the trace's `args.len` (tracks are worker slots:
/// replica · stages + stage; unit names count micro-batches within the replica).
fn traced_lengths(
    trace: &Path,
    stages: usize,
    per_replica: usize,
) -> BTreeMap<(u64, usize, usize, bool), BTreeMap<usize, usize>> {
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(trace).expect("trace written")).unwrap();
    let mut out: BTreeMap<_, BTreeMap<usize, usize>> = BTreeMap::new();
    for e in trace["traceEvents"].as_array().unwrap() {
        let (Some(name), Some(slot)) = (e["name"].as_str(), e["tid"].as_u64()) else {
            continue;
        };
        let forward = match e["cat"].as_str() {
            Some("forward") => true,
            Some("backward") => false,
            _ => continue,
        };
        let (mb, seg) = name[1..].split_once('.').unwrap();
        let (mb, seg): (usize, usize) = (mb.parse().unwrap(), seg.parse().unwrap());
        let slot = slot as usize - 1;
        let (replica, stage) = (slot / stages, slot % stages);
        let step = e["args"]["step"].as_u64().unwrap();
        let len = e["args"]["len"].as_u64().unwrap() as usize;
        let at = (step, stage, replica * per_replica + mb, forward);
        assert!(
            out.entry(at).or_default().insert(seg, len).is_none(),
            "unit {name} twice at {at:?}"
        );
    }
    out
}

/// The lengths the document partition gives global micro-batch `mb` of `step`: from its rows'
/// document starts, read off the same data in this process.
fn expected_lengths(cfg: &Config, step: u64, mb: usize) -> Vec<usize> {
    let (b, t) = (cfg.train.micro_batch_size, cfg.train.seq_len);
    let src = open_source(&cfg.data, cfg.model.vocab_size).unwrap();
    let eot = document_separator(&cfg.data, src.as_ref())
        .unwrap()
        .unwrap();
    let rows = micro_batch_tokens(
        src.as_ref(),
        Split::Train,
        cfg.train.seed,
        step,
        mb as u64,
        b,
        t,
    )
    .unwrap();
    let docs: Vec<Vec<usize>> = rows
        .chunks_exact(t + 1)
        .map(|row| document_starts(&row[..t], eot))
        .collect();
    cfg.segment_rule().unwrap().lengths(Some(&docs)).unwrap()
}

#[test]
fn every_stage_and_replica_cuts_each_micro_batch_from_its_documents() {
    const STEPS: u64 = 2;
    let (stages, splits, microbatches) = (2usize, 8usize, 4usize);
    let dir = fresh_dir("docmask-doc-partition");
    let sets = |run: &Path, replicas: usize| {
        let mut sets = tiny_model_args();
        for s in [
            format!("pipeline.stages={stages}"),
            format!("pipeline.replicas={replicas}"),
            format!("pipeline.splits={splits}"),
            format!("pipeline.microbatches={microbatches}"),
            "pipeline.partition=\"documents\"".into(),
            format!("train.steps={STEPS}"),
            "checkpoint.every=1".into(),
            // Evaluation cuts its held-out micro-batches from their documents too.
            format!("train.eval_every={STEPS}"),
            "train.eval_batches=2".into(),
            format!("run.dir={}", run.display()),
        ]
        .into_iter()
        .chain(DOCUMENTS.iter().map(|s| s.to_string()))
        {
            sets.push("--set".into());
            sets.push(s);
        }
        sets
    };
    let cfg = Config::load(
        None,
        &sets(&dir, 1)
            .chunks(2)
            .map(|c| c[1].clone())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let table = cfg.segment_rule().unwrap().table().to_vec();
    let mut runs = Vec::new();
    for replicas in [1usize, 2] {
        let run = dir.join(format!("d{replicas}"));
        let trace = dir.join(format!("trace-d{replicas}.json"));
        run_ok(
            seqpipe()
                .args(["train", "-q"])
                .args(sets(&run, replicas))
                .arg("--trace")
                .arg(&trace),
        );
        let traced = traced_lengths(&trace, stages, microbatches / replicas);
        assert_eq!(
            traced.len(),
            STEPS as usize * stages * microbatches * 2,
            "d={replicas}: every unit traced once: {traced:?}"
        );
        let mut differ = (false, false);
        for step in 1..=STEPS {
            let want: Vec<Vec<usize>> = (0..microbatches)
                .map(|mb| expected_lengths(&cfg, step, mb))
                .collect();
            differ.0 |= want.iter().any(|l| *l != want[0]);
            differ.1 |= want.iter().any(|l| *l != table);
            for ((s, stage, mb, forward), got) in traced.range((step, 0, 0, false)..) {
                if *s != step {
                    break;
                }
                let got: Vec<usize> = got.values().copied().collect();
                assert_eq!(
                    got, want[*mb],
                    "d={replicas} step {step} stage {stage} micro-batch {mb} (forward {forward})"
                );
            }
        }
        assert!(
            differ.0 && differ.1,
            "the documents gave every micro-batch the same lengths, or the compute \
             partition's {table:?}: the test is blind"
        );
        let evaluated: Vec<f64> = common::records(&run)
            .iter()
            .filter_map(|r| r.as_step().and_then(|s| s.val_loss))
            .collect();
        assert!(
            evaluated.len() == 1 && evaluated[0].is_finite(),
            "d={replicas}: one evaluation at step {STEPS}: {evaluated:?}"
        );
        runs.push(final_state(&ckpt_url(&run)));
    }
    // Micro-batches cut by their own documents reduce to the same bits over two replicas.
    assert_eq!(runs[0].0, STEPS);
    assert!(
        runs[0] == runs[1],
        "two replicas end elsewhere than one with the document partition"
    );
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

/// Chaos with masks and the document partition: the elastic tests' 4-node job (one agent and
/// worker process per node) on packed documents cut into 12 segments per micro-batch from their
/// documents; stage 2's worker is SIGKILLed after step 3. Its agent starts a replacement, which
/// cuts the micro-batches again from the same starts, and the run ends bit-identical to the
/// undisturbed one.
#[test]
fn a_worker_sigkilled_with_the_document_partition_ends_bit_identical() {
    // Steps of ~0.1 s on a quiet machine: the kill after step 3 lands well before the end.
    const STEPS: u64 = 16;
    let dir = fresh_dir("docmask-chaos");
    let job = |run: &Path| {
        let mut cmd = elastic_job(run, STEPS);
        for s in DOCUMENTS.iter().chain(&[
            "pipeline.partition=\"documents\"",
            "pipeline.splits=12",
            "elastic.mid_step=true",
            "elastic.peer_snapshot_max_skips=0",
        ]) {
            cmd.args(["--set", s]);
        }
        cmd
    };
    let reference_dir = dir.join("reference");
    run_ok(&mut job(&reference_dir));
    let (_, reference) = final_state(&ckpt_url(&reference_dir));

    let run = dir.join("run");
    let child = job(&run).spawn().unwrap();
    wait_for_steps(&run, 3);
    // The launcher's children are the nodes' agents, in start order; an agent's child, its worker.
    let agents = children_of(child.id());
    assert_eq!(agents.len(), 4, "four local nodes");
    let worker = *children_of(agents[2])
        .first()
        .expect("node 2 runs a worker");
    std::process::Command::new("kill")
        .args(["-KILL", &worker.to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    let events = run_events(&run);
    assert!(
        events.iter().any(|e| matches!(e, RunEvent::Recovered(_))),
        "the kill was not recovered: {events:?}"
    );
    assert_final_state(&run, STEPS, &reference);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_document_partition_is_refused_without_masks() {
    let dir = fresh_dir("docmask-partition-refused");
    let refused = |extra: &[&str]| {
        let mut cmd = seqpipe();
        cmd.args(["train", "-q"])
            .args(tiny_model_args())
            .args([
                "--set",
                "pipeline.partition=\"documents\"",
                "--set",
                "train.steps=1",
            ])
            .arg("--set")
            .arg(format!("run.dir={}", dir.join("run").display()));
        for s in extra {
            cmd.args(["--set", s]);
        }
        run_err(&mut cmd)
    };
    let err = refused(&[]);
    assert!(
        err.contains("pipeline.partition") && err.contains("data.document_mask = true"),
        "{err}"
    );
    assert!(
        !dir.join("run").join("metrics.jsonl").exists(),
        "a refused run trained"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
