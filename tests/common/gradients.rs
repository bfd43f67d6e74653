//! The pipelined-gradient check of the end-to-end gradient tests: one step of `seqpipe train`
//! with `--dump-grads` against the whole model run as one unit in this process, on the same
//! global batch (with document masks when the config turns them on).

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use trainer::config::Config;
use trainer::data::{Split, document_separator, document_starts, micro_batch_tokens, open_source};
use trainer::model::{Mode, Stage, StageInput, StageLayout, StageOutput};
use trainer::schedule::Unit;

use super::{losses, run_ok, seqpipe};

/// Loss and gradients of the whole model on the whole global batch of step 1 in one unit; with
/// `data.document_mask`, the document starts read off the tokens (and asserted to be several per
/// row, so that the masks matter).
pub fn reference(cfg: &Config) -> (f64, HashMap<String, Tensor>) {
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
    let docs = document_separator(&cfg.data, src.as_ref())
        .unwrap()
        .map(|eot| {
            let docs: Vec<Vec<usize>> = rows
                .chunks_exact(t + 1)
                .map(|row| document_starts(&row[..t], eot))
                .collect();
            assert!(
                docs.iter().map(Vec::len).sum::<usize>() > 2 * m * b,
                "too few documents for masks to matter: {docs:?}"
            );
            docs
        });
    let all = Tensor::from_vec(rows, (m * b, t + 1), &Device::Cpu).unwrap();
    let inputs = all.narrow(1, 0, t).unwrap();
    let targets = all.narrow(1, 1, t).unwrap().flatten_all().unwrap();
    let layout = StageLayout {
        stage: 0,
        stages: 1,
        layers: 0..cfg.model.layers,
    };
    let mut stage = Stage::new(&cfg.model, layout, vec![t], cfg.train.seed).unwrap();
    if cfg.data.reset_positions {
        stage.set_reset_positions(true).unwrap();
    }
    let unit = Unit::new(0, 0);
    let tokens = (m * b * t) as f64;
    stage.begin_step(1);
    if let Some(docs) = docs {
        stage.set_documents(0, docs).unwrap();
    }
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

/// The gradients a `--dump-grads` run of `stages` stages wrote for step 1.
pub fn dumped_gradients(dir: &Path, stages: usize) -> HashMap<String, Tensor> {
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

pub fn max_abs(t: &Tensor) -> f64 {
    t.abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_dtype(candle_core::DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Trains one step of `stages` stages with `sets` (`--set` pairs, `run.dir` under `dir`),
/// dumping its gradients into `dir/grads`, and asserts its loss and every parameter's gradient
/// equal [`reference`]'s within 1e-5 relative; `what` names the case in failures.
pub fn assert_step_equals_reference(sets: &[String], dir: &Path, stages: usize, what: &str) {
    let grads_dir = dir.join("grads");
    run_ok(
        seqpipe()
            .arg("train")
            .arg("-q")
            .args(sets)
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
    assert!(
        ((loss - ref_loss) / ref_loss).abs() <= 1e-5,
        "{what}: loss {loss} vs reference {ref_loss}"
    );
    let got = dumped_gradients(&grads_dir, stages);
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
}
