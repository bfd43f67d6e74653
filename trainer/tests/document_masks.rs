//! Document masks through the pipeline stage (issue 32): pipelined Seq1F1B gradients with masks
//! equal the single-process masked model's for p ∈ {1, 2, 4} stages and k ∈ {1, 2, 4, 8}
//! segments with the uniform, the compute and the document partition (each micro-batch cut from
//! its own documents, the lengths given to every stage), on random document layouts (a fixed set
//! of seeds) and on the edge cases (documents spanning segments, shorter than one, starting on a
//! boundary, one token long); one document per row is today's unmasked model bit for bit; packed
//! documents with positions restarting per document are exactly the documents run one by one (an
//! oracle independent of the masked kernels); and the stage checks the starts it is given.
//!
//! The structure follows `model_gradients.rs`: tiny models whose parameters are name-seeded
//! values of order one (so attention is far from uniform and a mask matters), stages driven by the
//! generated schedule's action lists, and gradients compared by name.

mod common;

use std::collections::HashMap;

use anyhow::{Context, Result, bail, ensure};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use trainer::config::Config;
use trainer::model::{
    Mode, ModelConfig, ModelError, Norm, Position, Stage, StageInput, StageLayout, StageOutput,
    partition_layers,
};
use trainer::schedule::{ScheduleKind, SegmentRule, Unit, generate};

const VOCAB: usize = 32;
const D_MODEL: usize = 16;
const HEADS: usize = 2;
const LAYERS: usize = 4;
const SEQ: usize = 32;
const BATCH: usize = 2;
const MICRO_BATCHES: usize = 2;
const SEED: u64 = 77;
/// The seeds of the random layouts (a fixed set: the test is deterministic).
const LAYOUT_SEEDS: [u64; 4] = [1, 2, 3, 4];

fn config(position: Position) -> ModelConfig {
    ModelConfig {
        vocab_size: VOCAB,
        layers: LAYERS,
        d_model: D_MODEL,
        heads: HEADS,
        ffn_mult: 4,
        max_seq_len: SEQ,
        position,
        norm: Norm::LayerNorm,
        ..ModelConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Data, layouts and parameters
// ---------------------------------------------------------------------------------------------

/// `MICRO_BATCHES` micro-batches of `BATCH` rows of `SEQ + 1` random tokens, and each row's
/// document starts.
struct Batch {
    rows: Vec<Vec<u32>>,
    docs: Vec<Vec<usize>>,
}

impl Batch {
    fn new(seed: u64, docs: Vec<Vec<usize>>) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let rows = (0..MICRO_BATCHES * BATCH)
            .map(|_| {
                (0..=SEQ)
                    .map(|_| rng.random_range(0..VOCAB as u32))
                    .collect()
            })
            .collect();
        assert_eq!(docs.len(), MICRO_BATCHES * BATCH);
        Self { rows, docs }
    }

    /// Rows with random layouts: per row, each position after the first starts a document with
    /// probability `density` (so one-token documents, documents on segment boundaries and
    /// documents spanning segments all occur).
    fn random(seed: u64, density: f64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xd0c5);
        let docs = (0..MICRO_BATCHES * BATCH)
            .map(|_| {
                std::iter::once(0)
                    .chain((1..SEQ).filter(|_| rng.random::<f64>() < density))
                    .collect()
            })
            .collect();
        Self::new(seed, docs)
    }

    fn tokens(&self) -> usize {
        MICRO_BATCHES * BATCH * SEQ
    }

    fn slice(&self, mb: usize, from: usize, len: usize) -> Vec<u32> {
        self.rows[mb * BATCH..(mb + 1) * BATCH]
            .iter()
            .flat_map(|row| row[from..from + len].iter().copied())
            .collect()
    }

    fn inputs(&self, mb: usize, start: usize, len: usize) -> Result<Tensor> {
        Ok(Tensor::from_vec(
            self.slice(mb, start, len),
            (BATCH, len),
            &Device::Cpu,
        )?)
    }

    fn targets(&self, mb: usize, start: usize, len: usize) -> Result<Tensor> {
        Ok(Tensor::from_vec(
            self.slice(mb, start + 1, len),
            BATCH * len,
            &Device::Cpu,
        )?)
    }

    /// The document starts of micro-batch `mb`'s rows.
    fn docs(&self, mb: usize) -> Vec<Vec<usize>> {
        self.docs[mb * BATCH..(mb + 1) * BATCH].to_vec()
    }
}

fn fnv(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A value of order one for parameter `name`, a function of the name only (every partition of
/// the model gets the same values).
fn test_value(name: &str, shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut rng = ChaCha8Rng::seed_from_u64(fnv(name) ^ 0x5eed);
    let z: Vec<f64> = (0..n)
        .map(|_| {
            let u1: f64 = 1.0 - rng.random::<f64>();
            let u2: f64 = rng.random::<f64>();
            (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
        })
        .collect();
    let values: Vec<f32> = if name.contains("ln_") && name.ends_with(".weight") {
        z.iter().map(|v| (1.0 + 0.2 * v) as f32).collect()
    } else if name.ends_with(".bias") {
        z.iter().map(|v| (0.1 * v) as f32).collect()
    } else if name == "wte.weight" || name == "wpe.weight" {
        z.iter().map(|v| (0.5 * v) as f32).collect()
    } else {
        let std = 1.0 / (shape[1] as f64).sqrt();
        z.iter().map(|v| (std * v) as f32).collect()
    };
    Ok(Tensor::from_vec(values, shape, &Device::Cpu)?)
}

fn make_stage(cfg: &ModelConfig, layout: StageLayout, segments: &[usize]) -> Result<Stage> {
    let mut stage = Stage::with_dtype(cfg, layout, segments.to_vec(), SEED, DType::F32)?;
    let shapes: Vec<(String, Vec<usize>)> = stage
        .params()
        .iter()
        .map(|(name, t)| (name.to_string(), t.dims().to_vec()))
        .collect();
    for (name, shape) in shapes {
        stage.params_mut().set(&name, test_value(&name, &shape)?)?;
    }
    Ok(stage)
}

fn make_stages(cfg: &ModelConfig, p: usize, segments: &[usize]) -> Result<Vec<Stage>> {
    partition_layers(cfg, SEQ, p)?
        .into_iter()
        .map(|l| make_stage(cfg, l, segments))
        .collect()
}

fn starts(segments: &[usize]) -> Vec<usize> {
    segments
        .iter()
        .scan(0, |acc, len| {
            let s = *acc;
            *acc += len;
            Some(s)
        })
        .collect()
}

/// The segment rule of `partition` ("uniform", "compute" or "documents") for k splits of this
/// model, as the trainer computes it from its config.
fn rule(kind: &str, k: usize) -> Result<SegmentRule> {
    let sets: Vec<String> = [
        format!("model.vocab_size={VOCAB}"),
        format!("model.layers={LAYERS}"),
        format!("model.d_model={D_MODEL}"),
        format!("model.heads={HEADS}"),
        format!("model.max_seq_len={SEQ}"),
        format!("train.seq_len={SEQ}"),
        format!("pipeline.splits={k}"),
        format!("pipeline.partition=\"{kind}\""),
        "data.document_mask=true".into(),
    ]
    .into();
    let cfg = Config::default().with_overrides(&sets)?;
    cfg.validate()?;
    Ok(cfg.segment_rule()?)
}

/// The segment lengths of a partition with one table ("uniform" or "compute").
fn partition(kind: &str, k: usize) -> Result<Vec<usize>> {
    match rule(kind, k)? {
        SegmentRule::Fixed(lengths) => Ok(lengths),
        other => bail!("{kind} has no single table: {other}"),
    }
}

/// How a step cuts its micro-batches into segments.
struct Cut {
    /// The lengths each stage is built with (its table).
    table: Vec<usize>,
    /// Each micro-batch's lengths.
    lengths: Vec<Vec<usize>>,
    /// Whether the stages are given each micro-batch's lengths (the document partition), as the
    /// worker does, or use their table.
    own: bool,
}

impl Cut {
    /// Every micro-batch cut by `table`.
    fn table(table: &[usize]) -> Self {
        Self {
            table: table.to_vec(),
            lengths: vec![table.to_vec(); MICRO_BATCHES],
            own: false,
        }
    }

    /// The cut `rule` gives `batch`: for the document rule, each micro-batch's own lengths from
    /// its rows' document starts, as every stage of the trainer computes them.
    fn of(rule: &SegmentRule, batch: &Batch) -> Result<Self> {
        Ok(Self {
            table: rule.table().to_vec(),
            lengths: (0..MICRO_BATCHES)
                .map(|mb| rule.lengths(Some(&batch.docs(mb))))
                .collect::<Result<_, _>>()?,
            own: rule.per_micro_batch(),
        })
    }

    fn splits(&self) -> usize {
        self.table.len()
    }
}

// ---------------------------------------------------------------------------------------------
// Running a step
// ---------------------------------------------------------------------------------------------

/// How a step gives the stages their documents.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Masks {
    /// No document starts: today's plain causal attention.
    Off,
    /// Every stage gets its micro-batch's starts before the micro-batch's first forward.
    On,
}

/// One training step of `batch` through `stages` in the order of `kind`'s schedule (each stage
/// follows its own action list; messages are buffered); returns the loss (the mean over the
/// batch's tokens) and every parameter's gradient by name.
fn run_step(
    stages: &mut [Stage],
    batch: &Batch,
    cut: &Cut,
    kind: ScheduleKind,
    masks: Masks,
) -> Result<(f64, HashMap<String, Tensor>)> {
    let p = stages.len();
    for stage in stages.iter_mut() {
        stage.begin_step(MICRO_BATCHES);
    }
    let schedule = generate(kind, p, MICRO_BATCHES, cut.splits())?;
    let scale = 1.0 / batch.tokens() as f64;
    let losses = common::run_in_process(stages, &schedule, |stage, r, u, hidden| {
        let lengths = &cut.lengths[u.micro_batch];
        let (start, len) = (starts(lengths)[u.segment], lengths[u.segment]);
        let input = match hidden {
            None => StageInput::Tokens(batch.inputs(u.micro_batch, start, len)?),
            Some(h) => StageInput::Hidden(h),
        };
        if masks == Masks::On {
            // As the worker does: every unit's message carries the starts.
            stage.set_documents(u.micro_batch, batch.docs(u.micro_batch))?;
        }
        if cut.own {
            // As the worker does: every stage computes them from the starts.
            stage.set_segment_lengths(u.micro_batch, lengths.clone())?;
        }
        let targets = batch.targets(u.micro_batch, start, len)?;
        let targets = (r + 1 == p).then_some(&targets);
        Ok(stage.forward(u, input, targets, scale, Mode::Train)?)
    })?;
    // Summed in the order the last stage computed them, from 0.
    let loss = losses.iter().fold(0.0, |sum, l| sum + l);
    let mut grads = HashMap::new();
    for stage in stages.iter_mut() {
        stage.finish_gradients()?;
        ensure!(stage.in_flight_micro_batches() == 0, "state left behind");
        for (name, _) in stage.params().iter() {
            let g = stage
                .grads()
                .get(name)
                .with_context(|| format!("`{name}` got no gradient"))?;
            grads.insert(name.to_string(), g.clone());
        }
    }
    Ok((loss * scale, grads))
}

/// The single-process masked model: the whole model on one stage, each micro-batch's sequence as
/// one segment.
fn reference(cfg: &ModelConfig, batch: &Batch) -> Result<(f64, HashMap<String, Tensor>)> {
    let mut stages = make_stages(cfg, 1, &[SEQ])?;
    run_step(
        &mut stages,
        batch,
        &Cut::table(&[SEQ]),
        ScheduleKind::Seq1F1B,
        Masks::On,
    )
}

fn max_abs(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()?)
}

/// The worst `‖g − g_ref‖∞ / ‖g_ref‖∞` over the parameters (same names required).
fn worst_rel(got: &HashMap<String, Tensor>, want: &HashMap<String, Tensor>) -> Result<f64> {
    ensure!(
        got.len() == want.len(),
        "{} vs {} gradients",
        got.len(),
        want.len()
    );
    let mut worst = 0.0f64;
    for (name, w) in want {
        let g = got
            .get(name)
            .with_context(|| format!("no gradient for `{name}`"))?;
        let diff = g.to_dtype(DType::F64)?.sub(&w.to_dtype(DType::F64)?)?;
        worst = worst.max(max_abs(&diff)? / max_abs(w)?.max(f64::MIN_POSITIVE));
    }
    Ok(worst)
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}

/// What the document partition did in [`check_pipelined`]: whether it cut two micro-batches of
/// a step differently, and a micro-batch otherwise than the compute partition (else the checks
/// of it prove nothing beyond the compute partition's).
#[derive(Default)]
struct DocumentCuts {
    between_micro_batches: bool,
    from_compute: bool,
}

/// Checks the pipelined step against the reference for every p, k and partition.
fn check_pipelined(cfg: &ModelConfig, batch: &Batch, what: &str) -> Result<DocumentCuts> {
    let (ref_loss, ref_grads) = reference(cfg, batch)?;
    let mut non_uniform = false;
    let mut cuts = DocumentCuts::default();
    for kind in ["uniform", "compute", "documents"] {
        for k in [1, 2, 4, 8] {
            let cut = Cut::of(&rule(kind, k)?, batch)?;
            non_uniform |= cut.table.iter().any(|&s| s != SEQ / k);
            if cut.own {
                cuts.between_micro_batches |= cut.lengths.iter().any(|l| *l != cut.lengths[0]);
                cuts.from_compute |= cut.lengths.iter().any(|l| *l != cut.table);
            }
            for p in [1, 2, 4] {
                let mut stages = make_stages(cfg, p, &cut.table)?;
                let (loss, grads) =
                    run_step(&mut stages, batch, &cut, ScheduleKind::Seq1F1B, Masks::On)?;
                let at = format!("{what}: {kind} k={k} {:?} p={p}", cut.lengths);
                let rel_loss = (loss - ref_loss).abs() / ref_loss.abs();
                ensure!(
                    rel_loss <= 1e-5,
                    "{at}: loss {loss} vs reference {ref_loss}"
                );
                let rel = worst_rel(&grads, &ref_grads)?;
                ensure!(rel <= 1e-5, "{at}: gradients differ by {rel:e} (relative)");
            }
        }
    }
    ensure!(
        non_uniform,
        "the compute partition was uniform: the test is blind to it"
    );
    Ok(cuts)
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[test]
fn pipelined_masked_gradients_equal_the_single_process_masked_model_on_random_layouts() -> Result<()>
{
    let cfg = config(Position::Learned);
    let mut cuts = DocumentCuts::default();
    for seed in LAYOUT_SEEDS {
        // Sparse (documents spanning segments) and dense (many one-token documents) layouts.
        let density = if seed % 2 == 0 { 0.08 } else { 0.4 };
        let batch = Batch::random(seed, density);
        // The mask matters here: the unmasked model's gradients are far from the masked ones.
        let mut plain = make_stages(&cfg, 1, &[SEQ])?;
        let (_, plain_grads) = run_step(
            &mut plain,
            &batch,
            &Cut::table(&[SEQ]),
            ScheduleKind::Seq1F1B,
            Masks::Off,
        )?;
        let (_, masked) = reference(&cfg, &batch)?;
        let apart = worst_rel(&plain_grads, &masked)?;
        ensure!(
            apart > 1e-2,
            "seed {seed}: masks change the gradients by only {apart:e}"
        );
        let c = check_pipelined(&cfg, &batch, &format!("seed {seed} density {density}"))?;
        cuts.between_micro_batches |= c.between_micro_batches;
        cuts.from_compute |= c.from_compute;
    }
    ensure!(
        cuts.between_micro_batches && cuts.from_compute,
        "the document partition cut every micro-batch alike, or as the compute partition: the \
         test is blind to per-micro-batch lengths"
    );
    Ok(())
}

#[test]
fn pipelined_masked_gradients_equal_the_reference_on_the_edge_cases() -> Result<()> {
    // Uniform boundaries at k = 4 fall on 8, 16, 24; at k = 8 on every 4th position.
    let docs = vec![
        // Documents starting exactly on segment boundaries, one spanning three segments.
        vec![0, 8, 16],
        // One-token documents at the start, around a boundary and at the very end.
        vec![0, 1, 2, 7, 8, 9, 30, 31],
        // Documents shorter than a segment inside one, and one long document from position 3.
        vec![0, 3],
        // Every position its own document.
        (0..SEQ).collect(),
    ];
    let batch = Batch::new(5, docs);
    // (Here both micro-batches happen to get the same lengths at k = 8; the random layouts
    // above are cut differently from micro-batch to micro-batch.)
    let cuts = check_pipelined(&config(Position::Learned), &batch, "edge cases")?;
    ensure!(
        cuts.from_compute,
        "the document partition cut the edge cases as the compute partition"
    );
    // RoPE reaches the masked kernels through the same path.
    check_pipelined(&config(Position::Rope), &batch, "edge cases, rope")?;
    Ok(())
}

#[test]
fn one_document_per_row_is_the_unmasked_model_bit_for_bit() -> Result<()> {
    let cfg = config(Position::Learned);
    let single = vec![vec![0]; MICRO_BATCHES * BATCH];
    let batch = Batch::new(9, single);
    for (p, k, partition_kind) in [
        (1, 1, "compute"),
        (2, 2, "compute"),
        (4, 4, "compute"),
        (2, 4, "documents"),
        (4, 8, "documents"),
    ] {
        // The document partition on one document per row is the compute partition.
        let segments = partition("compute", k)?;
        let cut = Cut::of(&rule(partition_kind, k)?, &batch)?;
        ensure!(
            cut.lengths.iter().all(|l| *l == segments),
            "{partition_kind} k={k}: {:?} on one document per row, not the compute partition's \
             {segments:?}",
            cut.lengths
        );
        let mut masked = make_stages(&cfg, p, &segments)?;
        let mut plain = make_stages(&cfg, p, &segments)?;
        let (l1, g1) = run_step(&mut masked, &batch, &cut, ScheduleKind::Seq1F1B, Masks::On)?;
        let (l0, g0) = run_step(
            &mut plain,
            &batch,
            &Cut::table(&segments),
            ScheduleKind::Seq1F1B,
            Masks::Off,
        )?;
        ensure!(
            l1.to_bits() == l0.to_bits(),
            "p={p} k={k}: loss {l1} vs {l0}"
        );
        for (name, g) in &g0 {
            ensure!(
                bits(&g1[name])? == bits(g)?,
                "p={p} k={k}: `{name}` differs"
            );
        }
    }
    Ok(())
}

/// An oracle that does not use the masked kernels: with positions restarting per document, a
/// row of packed documents is the documents run as separate sequences, token for token. The
/// packed step's loss sum and gradients equal the sum over the documents run one by one (each a
/// one-document sequence of its own length, unmasked).
#[test]
fn packed_documents_with_restarting_positions_are_the_documents_run_alone() -> Result<()> {
    let cfg = config(Position::Learned);
    let docs = vec![vec![0, 5, 6, 19], vec![0, 11], vec![0, 16, 17], vec![0]];
    let batch = Batch::new(3, docs.clone());
    for (p, cut) in [
        (1, Cut::table(&[SEQ])),
        (2, Cut::table(&partition("compute", 4)?)),
        (4, Cut::table(&partition("uniform", 8)?)),
        (2, Cut::of(&rule("documents", 4)?, &batch)?),
        (4, Cut::of(&rule("documents", 8)?, &batch)?),
    ] {
        let segments = &cut.lengths;
        let mut packed = make_stages(&cfg, p, &cut.table)?;
        for stage in &mut packed {
            stage.set_reset_positions(true)?;
        }
        let (loss, grads) = run_step(&mut packed, &batch, &cut, ScheduleKind::Seq1F1B, Masks::On)?;
        // The same tokens, document by document, as one-row one-micro-batch sequences.
        let mut want_loss = 0.0;
        let mut want: HashMap<String, Tensor> = HashMap::new();
        for (r, starts) in docs.iter().enumerate() {
            let ends = starts.iter().skip(1).copied().chain([SEQ]);
            for (&s, e) in starts.iter().zip(ends) {
                let len = e - s;
                let mut alone =
                    make_stage(&cfg, partition_layers(&cfg, SEQ, 1)?.remove(0), &[len])?;
                alone.begin_step(1);
                let row = &batch.rows[r];
                let inputs = Tensor::from_slice(&row[s..e], (1, len), &Device::Cpu)?;
                let targets = Tensor::from_slice(&row[s + 1..e + 1], len, &Device::Cpu)?;
                let u = Unit::new(0, 0);
                let scale = 1.0 / batch.tokens() as f64;
                match alone.forward(
                    u,
                    StageInput::Tokens(inputs),
                    Some(&targets),
                    scale,
                    Mode::Train,
                )? {
                    StageOutput::LossSum(l) => want_loss += l * scale,
                    StageOutput::Hidden(_) => bail!("one stage computes the loss"),
                }
                alone.backward(u, None)?;
                alone.finish_gradients()?;
                for (name, _) in alone.params().iter() {
                    let g = alone.grads().get(name).context("gradient")?.clone();
                    let sum = match want.remove(name) {
                        Some(acc) => acc.add(&g)?,
                        None => g,
                    };
                    want.insert(name.to_string(), sum);
                }
            }
        }
        let rel_loss = (loss - want_loss).abs() / want_loss.abs();
        ensure!(
            rel_loss <= 1e-5,
            "p={p}: loss {loss} vs documents alone {want_loss}"
        );
        let rel = worst_rel(&grads, &want)?;
        ensure!(
            rel <= 1e-5,
            "p={p} {segments:?}: gradients differ by {rel:e}"
        );
    }
    Ok(())
}

/// The error of a call that must fail.
fn refused<T>(r: Result<T, ModelError>) -> Result<ModelError> {
    match r {
        Ok(_) => bail!("accepted"),
        Err(e) => Ok(e),
    }
}

#[test]
fn the_stage_checks_the_document_starts_it_is_given() -> Result<()> {
    let cfg = config(Position::Learned);
    let segments = vec![16, 16];
    let mut stage = make_stages(&cfg, 1, &segments)?.remove(0);
    let documents = |e: ModelError| matches!(e, ModelError::Documents { .. });
    // Malformed starts (a peer's message is untrusted input).
    for bad in [
        vec![vec![1], vec![0]],
        vec![vec![0, 4, 4], vec![0]],
        vec![vec![0, 32], vec![0]],
        vec![vec![], vec![0]],
    ] {
        let e = stage.set_documents(0, bad.clone()).unwrap_err();
        ensure!(documents(e), "{bad:?} accepted");
    }
    let batch = Batch::new(1, vec![vec![0, 3]; MICRO_BATCHES * BATCH]);
    stage.begin_step(1);
    stage.set_documents(0, batch.docs(0))?;
    let u0 = Unit::new(0, 0);
    let targets = batch.targets(0, 0, 16)?;
    stage.forward(
        u0,
        StageInput::Tokens(batch.inputs(0, 0, 16)?),
        Some(&targets),
        1.0,
        Mode::Train,
    )?;
    // The same starts again are fine; others for a micro-batch under way are refused.
    stage.set_documents(0, batch.docs(0))?;
    let e = stage
        .set_documents(0, vec![vec![0, 4], vec![0, 3]])
        .unwrap_err();
    ensure!(e.to_string().contains("other document starts"), "{e}");
    // Starts for another number of rows than the unit's are refused at its forward.
    stage.set_documents(1, vec![vec![0]])?;
    let e = refused(stage.forward(
        Unit::new(1, 0),
        StageInput::Tokens(batch.inputs(1, 0, 16)?),
        Some(&targets),
        1.0,
        Mode::Train,
    ))?;
    ensure!(e.to_string().contains("document starts 1"), "{e}");
    // Starts after a micro-batch began unmasked are refused.
    stage.reset_step();
    stage.begin_step(1);
    stage.forward(
        u0,
        StageInput::Tokens(batch.inputs(0, 0, 16)?),
        Some(&targets),
        1.0,
        Mode::Train,
    )?;
    let e = stage.set_documents(0, batch.docs(0)).unwrap_err();
    ensure!(e.to_string().contains("began unmasked"), "{e}");
    // Restarting positions needs the starts, and the learned position table.
    stage.reset_step();
    stage.set_reset_positions(true)?;
    stage.begin_step(1);
    let e = refused(stage.forward(
        u0,
        StageInput::Tokens(batch.inputs(0, 0, 16)?),
        Some(&targets),
        1.0,
        Mode::Train,
    ))?;
    ensure!(e.to_string().contains("no document starts"), "{e}");
    let mut rope = make_stages(&config(Position::Rope), 1, &segments)?.remove(0);
    ensure!(
        rope.set_reset_positions(true).is_err(),
        "RoPE with restarting positions accepted"
    );
    Ok(())
}

#[test]
fn the_stage_checks_the_segment_lengths_it_is_given() -> Result<()> {
    let cfg = config(Position::Learned);
    let mut stage = make_stages(&cfg, 1, &[16, 16])?.remove(0);
    // Another count, another sum, an empty segment: refused (they follow from a peer's starts).
    for bad in [vec![32], vec![16, 8], vec![32, 0], vec![8, 8, 16]] {
        let e = refused(stage.set_segment_lengths(0, bad.clone()))?;
        ensure!(e.to_string().contains("do not cut"), "{bad:?}: {e}");
    }
    let batch = Batch::new(1, vec![vec![0]; MICRO_BATCHES * BATCH]);
    let u0 = Unit::new(0, 0);
    let forward = |stage: &mut Stage, len: usize| {
        let targets = batch.targets(0, 0, len)?;
        Ok::<_, anyhow::Error>(stage.forward(
            u0,
            StageInput::Tokens(batch.inputs(0, 0, len)?),
            Some(&targets),
            1.0,
            Mode::Train,
        ))
    };
    stage.begin_step(1);
    stage.set_segment_lengths(0, vec![24, 8])?;
    // The micro-batch's own first segment is 24 tokens, not the table's 16.
    let e = refused(forward(&mut stage, 16)?)?;
    ensure!(e.to_string().contains("segment has 24"), "{e}");
    forward(&mut stage, 24)??;
    // The same lengths again are fine; others for a micro-batch under way are refused.
    stage.set_segment_lengths(0, vec![24, 8])?;
    let e = refused(stage.set_segment_lengths(0, vec![16, 16]))?;
    ensure!(e.to_string().contains("forward used [24, 8]"), "{e}");
    // Lengths after a micro-batch began with the table are refused.
    stage.reset_step();
    stage.begin_step(1);
    forward(&mut stage, 16)??;
    let e = refused(stage.set_segment_lengths(0, vec![24, 8]))?;
    ensure!(
        e.to_string().contains("began with the stage's table"),
        "{e}"
    );
    Ok(())
}
