//! Document masks end to end with the real binary (issue 32): `seqpipe train` on synthetic packed
//! documents with `data.document_mask = true`, p worker processes over TCP (the first stage reads
//! the documents off its tokens, the activations carry them to the others), dumps its gradients,
//! which equal one in-process stage holding the whole model that runs the whole global batch as a
//! single masked unit (as `pipeline_gradients.rs` does for the unmasked model); the masked run's
//! loss decreases, and a resumed run ends bit-identical to an undisturbed one.

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use common::{ckpt_url, final_state, fresh_dir, losses, run_err, run_ok, seqpipe, tiny_model_args};
use trainer::config::Config;
use trainer::data::{Split, document_separator, document_starts, micro_batch_tokens, open_source};
use trainer::model::{Mode, Stage, StageInput, StageLayout, StageOutput};
use trainer::schedule::Unit;

/// The synthetic packed documents of these tests: log-normal lengths with a median of 8 tokens
/// (several documents per 48-token row, some of one token), masks on.
const DOCUMENTS: [&str; 3] = [
    "data.synthetic_document_median=8",
    "data.synthetic_document_sigma=1.0",
    "data.document_mask=true",
];

/// Loss and gradients of the whole model on the whole global batch in one masked unit, the
/// document starts read off the tokens.
fn reference(cfg: &Config) -> (f64, HashMap<String, Tensor>) {
    let (b, t, m) = (
        cfg.train.micro_batch_size,
        cfg.train.seq_len,
        cfg.pipeline.microbatches,
    );
    let src = open_source(&cfg.data, cfg.model.vocab_size).unwrap();
    let eot = document_separator(&cfg.data, src.as_ref())
        .unwrap()
        .expect("masks are on");
    let mut rows = Vec::new();
    for mb in 0..m {
        rows.extend(
            micro_batch_tokens(
                src.as_ref(),
                Split::Train,
                cfg.train.seed,
                1,
                mb as u64,
                b,
                t,
            )
            .unwrap(),
        );
    }
    let docs: Vec<Vec<usize>> = rows
        .chunks_exact(t + 1)
        .map(|row| document_starts(&row[..t], eot))
        .collect();
    assert!(
        docs.iter().map(Vec::len).sum::<usize>() > 2 * m * b,
        "too few documents for masks to matter: {docs:?}"
    );
    let all = Tensor::from_vec(rows, (m * b, t + 1), &Device::Cpu).unwrap();
    let inputs = all.narrow(1, 0, t).unwrap();
    let targets = all.narrow(1, 1, t).unwrap().flatten_all().unwrap();
    let layout = StageLayout {
        stage: 0,
        stages: 1,
        layers: 0..cfg.model.layers,
    };
    let mut stage = Stage::new(&cfg.model, layout, vec![t], cfg.train.seed).unwrap();
    stage.set_reset_positions(cfg.data.reset_positions).unwrap();
    let unit = Unit::new(0, 0);
    let tokens = (m * b * t) as f64;
    stage.begin_step(1);
    stage.set_documents(0, docs).unwrap();
    let loss_sum = match stage
        .forward(
            unit,
            StageInput::Tokens(inputs),
            Some(&targets),
            1.0 / tokens,
            Mode::Train,
        )
        .unwrap()
    {
        StageOutput::LossSum(l) => l,
        StageOutput::Hidden(_) => unreachable!("a single stage is the last stage"),
    };
    assert!(stage.backward(unit, None).unwrap().is_none());
    stage.finish_gradients().unwrap();
    let grads = stage
        .params()
        .iter()
        .map(|(name, _)| (name.to_string(), stage.grads().get(name).unwrap().clone()))
        .collect();
    (loss_sum / tokens, grads)
}

fn dumped_gradients(dir: &Path, stages: usize) -> HashMap<String, Tensor> {
    let mut all = HashMap::new();
    for r in 0..stages {
        let file = dir.join(format!("step-1-stage-{r}.safetensors"));
        all.extend(
            candle_core::safetensors::load(&file, &Device::Cpu)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display())),
        );
    }
    all
}

fn max_abs(t: &Tensor) -> f64 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_dtype(candle_core::DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

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
    let grads_dir = dir.join("grads");
    run_ok(
        seqpipe()
            .arg("train")
            .arg("-q")
            .args(&sets)
            .arg("--dump-grads")
            .arg(&grads_dir),
    );
    let cfg = Config::load(
        None,
        &sets.chunks(2).map(|c| c[1].clone()).collect::<Vec<_>>(),
    )
    .unwrap();
    let (ref_loss, ref_grads) = reference(&cfg);
    let loss = losses(&dir.join("run"))[0];
    let what = format!("masked p={p} k={k} {partition} {extra:?}");
    assert!(
        ((loss - ref_loss) / ref_loss).abs() <= 1e-5,
        "{what}: loss {loss} vs reference {ref_loss}"
    );
    let got = dumped_gradients(&grads_dir, p);
    assert_eq!(
        got.len(),
        ref_grads.len(),
        "{what}: a gradient for every parameter"
    );
    for (name, g_ref) in &ref_grads {
        let g = got
            .get(name)
            .unwrap_or_else(|| panic!("{what}: no gradient for {name}"));
        let rel = max_abs(&g.sub(g_ref).unwrap()) / max_abs(g_ref);
        assert!(
            rel <= 1e-5,
            "{what}: {name}: ‖g − g_ref‖∞ / ‖g_ref‖∞ = {rel:e}"
        );
    }
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
