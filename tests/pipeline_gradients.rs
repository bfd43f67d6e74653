//! Pipelined gradients and loss equal the single-process, unsplit reference: the real `seqpipe`
//! binary runs one step with p worker processes over TCP and dumps its gradients, which are compared
//! with one in-process stage that holds the whole model and runs the whole global batch as a single
//! unit (no micro-batches, no segments).

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use common::{fresh_dir, losses, run_ok, seqpipe, tiny_model_args};
use trainer::config::Config;
use trainer::data::{Split, micro_batch_tokens, open_source};
use trainer::model::{Mode, Stage, StageInput, StageLayout, StageOutput};
use trainer::schedule::Unit;

/// Loss and gradients of the whole model on the whole global batch in one unit.
fn reference(cfg: &Config) -> (f64, HashMap<String, Tensor>) {
    let (b, t, m) = (
        cfg.train.micro_batch_size,
        cfg.train.seq_len,
        cfg.pipeline.microbatches,
    );
    let src = open_source(&cfg.data, cfg.model.vocab_size).unwrap();
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
    let all = Tensor::from_vec(rows, (m * b, t + 1), &Device::Cpu).unwrap();
    let inputs = all.narrow(1, 0, t).unwrap();
    let targets = all.narrow(1, 1, t).unwrap().flatten_all().unwrap();
    let layout = StageLayout {
        stage: 0,
        stages: 1,
        layers: 0..cfg.model.layers,
    };
    let mut stage = Stage::new(&cfg.model, layout, vec![t], cfg.train.seed).unwrap();
    let unit = Unit {
        micro_batch: 0,
        segment: 0,
    };
    let tokens = (m * b * t) as f64;
    stage.begin_step(1);
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
                let what = format!("{kind} p={p} k={k} m={m} {extra:?}");
                assert!(
                    ((loss - ref_loss) / ref_loss).abs() <= 1e-5,
                    "{what}: loss {loss} vs reference {ref_loss}"
                );
                let got = dumped_gradients(&grads_dir, p);
                assert_eq!(
                    got.len(),
                    ref_grads.len(),
                    "{what}: expected a gradient for every parameter"
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
