//! The whole-step part of `seqpipe bench docmask` (`--part step`): a real masked Seq1F1B step of a
//! tiny GPT on CPU stages, its unit times replayed on `p` devices.
//!
//! For each sequence length T and split count k, `m` micro-batches of one packed row each (the
//! same synthetic documents as the attention part) run through `p` CPU stages of one layer each,
//! every unit's forward and backward on this one compute thread and timed in its CPU time (so a
//! busy machine matters less). Three variants: document masks with the document-aware partition
//! (each micro-batch its own lengths, `SegmentRule` of the stages' FLOPs model), masks with the
//! document-blind compute partition, and no masks with the compute partition. Each variant's unit
//! times are replayed through Seq1F1B's dependency graph on p dedicated devices with free
//! communication ([`replay`], as `bench schedule` does from a trace): the replayed step time and
//! bubble, the bubble beside the formula `(p−1)/(m·k+p−1)` (and with the stages balanced: each
//! unit given its mean time over the stages, so that the first stage's embeddings and the last's
//! head do not count, only the segments' imbalance), and the masked step's time against the
//! unmasked one. Unmasked units do the same work whatever the documents, so micro-batch 0's
//! unmasked times stand for every micro-batch (an unmasked step at T = 32768 is the slowest part).

use std::collections::HashMap;

use anyhow::{Context, Result, bail};
use candle_core::{Device, Tensor};
use ops::adamw::AdamWConfig;
use serde::Serialize;

use trainer::data::{SampleKey, Split, SyntheticDocuments, TokenSource, document_starts};
use trainer::model::{
    Mode, ModelConfig, StageCompute, StageInput, StageOutput, StageSpec, build_stage,
    partition_layers,
};
use trainer::schedule::{
    Action, FlopsModel, MeasuredCosts, Partition, ScheduleKind, SegmentRule, Unit, generate, replay,
};

use super::{median, min, thread_cpu_s};
use crate::bench::schedule::averaged_over_stages;

/// The step's shape: stages, micro-batches, rounds, head width.
#[derive(Clone, Copy, Debug, Serialize)]
pub(super) struct StepShape {
    pub stages: usize,
    pub microbatches: usize,
    pub rounds: usize,
    pub head_dim: usize,
}

/// One (T, k, variant) row.
#[derive(Debug, Serialize)]
pub(super) struct StepRow {
    seq_len: usize,
    splits: usize,
    /// `aware` (masks, document partition), `blind` (masks, compute partition) or `unmasked`.
    variant: &'static str,
    /// Each micro-batch's segment lengths.
    lengths: Vec<Vec<usize>>,
    /// Per round: the replayed step time (s), its bubble fraction, and the units' summed CPU time.
    step_s: Vec<f64>,
    bubble: Vec<f64>,
    compute_s: Vec<f64>,
    /// Per round: the bubble with every stage given each unit's mean time over the stages (the
    /// stages balanced: what the segments' imbalance alone leaves).
    balanced_bubble: Vec<f64>,
    /// `(p−1)/(m·k+p−1)`.
    formula_bubble: f64,
}

/// A variant of the step: its name, whether masked, each micro-batch's lengths, and the longest
/// segment when micro-batches have their own.
type Variant<'a> = (&'static str, bool, &'a [Vec<usize>], Option<usize>);

/// The tiny GPT of the step: one layer per stage, one head of `head_dim`, FFN 4×, vocabulary 512
/// (the synthetic documents' ids, the last the separator).
fn step_model(shape: &StepShape, seq_len: usize) -> ModelConfig {
    ModelConfig {
        vocab_size: 512,
        layers: shape.stages,
        d_model: shape.head_dim,
        heads: 1,
        ffn_mult: 4,
        max_seq_len: seq_len,
        ..ModelConfig::default()
    }
}

/// The FLOPs model the partitions solve with (the step model's own, attention weight 1).
fn flops(m: &ModelConfig) -> FlopsModel {
    FlopsModel {
        layers: m.layers,
        hidden: m.d_model,
        heads: m.heads,
        head_dim: m.head_dim(),
        ffn: m.ffn(),
        vocab: m.vocab_size,
        attention_cost: 1.0,
    }
}

/// The printed description of the model and the method.
pub(super) fn describe(shape: &StepShape) -> String {
    format!(
        "whole step: p = {} CPU stages of 1 layer (GPT: d_model {}, 1 head, ffn {}, vocab 512, \
         learned positions), m = {} micro-batches x 1 packed row, Seq1F1B; every unit timed in \
         thread CPU time on 1 thread, replayed on p devices (free communication); {} rounds",
        shape.stages,
        shape.head_dim,
        4 * shape.head_dim,
        shape.microbatches,
        shape.rounds
    )
}

/// Runs the step part for every T and k and prints its table.
pub(super) fn run(
    shape: &StepShape,
    docs: &SyntheticDocuments,
    seed: u64,
    seq_lens: &[usize],
    splits: &[usize],
) -> Result<Vec<StepRow>> {
    if shape.stages < 1 || shape.microbatches < 1 || shape.rounds < 1 {
        bail!("--stages, --step-microbatches and --step-rounds must be at least 1");
    }
    println!("{}", describe(shape));
    println!(
        "{:>6} {:>2} {:>9} {:>11} {:>11} {:>13} {:>8} {:>11} {:>11} {:>14} {:>14}",
        "T",
        "k",
        "variant",
        "bubble min",
        "bubble med",
        "balanced med",
        "formula",
        "step min",
        "step med",
        "step/unm min",
        "step/unm med"
    );
    let mut rows = Vec::new();
    for &t in seq_lens {
        let model = step_model(shape, t);
        let batches = micro_batches(docs, seed, t, shape.microbatches)?;
        for &k in splits {
            let at = rows.len();
            rows.extend(split_rows(shape, &model, &batches, seed, k)?);
            print_rows(&rows[at..]);
        }
    }
    Ok(rows)
}

/// Each micro-batch's row at sequence length `seq_len`: T inputs and T targets (the next
/// tokens), and its document starts.
fn micro_batches(
    docs: &SyntheticDocuments,
    seed: u64,
    seq_len: usize,
    microbatches: usize,
) -> Result<Vec<(Vec<u32>, Vec<usize>)>> {
    (0..microbatches)
        .map(|mb| {
            let key = SampleKey {
                seed,
                step: seq_len as u64,
                micro_batch: mb as u64,
                row: 0,
            };
            let tokens = docs.sample(Split::Train, key, seq_len + 1)?;
            let starts = document_starts(&tokens[..seq_len], docs.end_of_text());
            Ok((tokens, starts))
        })
        .collect()
}

/// The rows of the three variants (aware, blind, unmasked) at `k` segments.
fn split_rows(
    shape: &StepShape,
    model: &ModelConfig,
    batches: &[(Vec<u32>, Vec<usize>)],
    seed: u64,
    k: usize,
) -> Result<Vec<StepRow>> {
    let t = model.max_seq_len; // T: the step model is built for it

    let fm = flops(model);
    let rule = SegmentRule::new(Partition::Documents, t, k, &fm)?;
    let blind = SegmentRule::new(Partition::Compute, t, k, &fm)?;
    let aware_cuts = batches
        .iter()
        .map(|(_, starts)| rule.lengths(Some(std::slice::from_ref(starts))))
        .collect::<Result<Vec<_>, _>>()?;
    let blind_cuts = vec![blind.table().to_vec(); shape.microbatches];
    let variants: [Variant; 3] = [
        ("aware", true, &aware_cuts, Some(rule.longest())),
        ("blind", true, &blind_cuts, None),
        ("unmasked", false, &blind_cuts, None),
    ];
    variants
        .into_iter()
        .map(|variant| variant_row(shape, model, batches, seed, k, variant))
        .collect()
}

/// One variant's row: its stages built once, its step measured and replayed `shape.rounds` times.
fn variant_row(
    shape: &StepShape,
    model: &ModelConfig,
    batches: &[(Vec<u32>, Vec<usize>)],
    seed: u64,
    k: usize,
    (variant, masked, cuts, longest): Variant,
) -> Result<StepRow> {
    let t = model.max_seq_len; // T: the step model is built for it
    let schedule = generate(ScheduleKind::Seq1F1B, shape.stages, shape.microbatches, k)?;
    let mut stages = build(model, shape.stages, t, &cuts[0], longest, seed)?;
    let mut row = StepRow {
        seq_len: t,
        splits: k,
        variant,
        lengths: cuts.to_vec(),
        step_s: Vec::new(),
        bubble: Vec::new(),
        compute_s: Vec::new(),
        balanced_bubble: Vec::new(),
        formula_bubble: (shape.stages - 1) as f64
            / (shape.microbatches * k + shape.stages - 1) as f64,
    };
    for _ in 0..shape.rounds {
        let durations = measure(&mut stages, batches, cuts, masked, longest.is_some())
            .with_context(|| format!("T {t}, k {k}, {variant}"))?;
        // Activation tokens of a unit (the token peaks only): the first cut's.
        let balanced = MeasuredCosts {
            durations: vec![averaged_over_stages(&durations); durations.len()],
            tokens: cuts[0].clone(),
        };
        row.balanced_bubble
            .push(replay(&schedule, &balanced)?.bubble_fraction);
        let costs = MeasuredCosts {
            durations,
            tokens: cuts[0].clone(),
        };
        let sim = replay(&schedule, &costs)?;
        row.step_s.push(sim.step_time);
        row.bubble.push(sim.bubble_fraction);
        row.compute_s.push(sim.stages.iter().map(|s| s.busy).sum());
    }
    Ok(row)
}

/// Prints one (T, k)'s rows, each step time also over the unmasked one (the last row's).
fn print_rows(rows: &[StepRow]) {
    let unmasked = rows.last().map(|r| r.step_s.clone()).unwrap_or_default();
    for r in rows {
        let ratios: Vec<f64> = r.step_s.iter().zip(&unmasked).map(|(a, b)| a / b).collect();
        println!(
            "{:>6} {:>2} {:>9} {:>10.1}% {:>10.1}% {:>12.1}% {:>7.1}% {:>10.3}s {:>10.3}s {:>14.3} {:>14.3}",
            r.seq_len,
            r.splits,
            r.variant,
            100.0 * min(&r.bubble),
            100.0 * median(&r.bubble),
            100.0 * median(&r.balanced_bubble),
            100.0 * r.formula_bubble,
            min(&r.step_s),
            median(&r.step_s),
            min(&ratios),
            median(&ratios)
        );
    }
}

/// `p` CPU stages of the step model, one layer each, built with `table` (and `longest` when
/// micro-batches get their own lengths).
fn build(
    model: &ModelConfig,
    p: usize,
    seq_len: usize,
    table: &[usize],
    longest: Option<usize>,
    seed: u64,
) -> Result<Vec<Box<dyn StageCompute>>> {
    partition_layers(model, seq_len, p)?
        .into_iter()
        .map(|layout| {
            Ok(build_stage(
                model,
                StageSpec {
                    layout,
                    segment_lengths: table.to_vec(),
                    longest_segment: longest,
                    seed,
                    adamw: AdamWConfig {
                        beta1: 0.9,
                        beta2: 0.95,
                        eps: 1e-8,
                    },
                    memory_budget: None,
                },
            )?)
        })
        .collect()
}

/// One training step's units on `stages`, micro-batch by micro-batch (its forwards through every
/// stage in segment order, then its backwards in reverse), each unit timed in this thread's CPU
/// time: per stage, each `F`/`B` action's seconds. With `masked` each micro-batch's starts go to
/// every stage first, and with `own_lengths` its lengths `cuts[mb]`. Unmasked, only micro-batch 0
/// runs and its times stand for every micro-batch (the same work whatever the documents).
fn measure(
    stages: &mut [Box<dyn StageCompute>],
    batches: &[(Vec<u32>, Vec<usize>)],
    cuts: &[Vec<usize>],
    masked: bool,
    own_lengths: bool,
) -> Result<Vec<HashMap<Action, f64>>> {
    let (m, p) = (batches.len(), stages.len());
    let seq_len = batches[0].0.len() - 1;
    let scale = 1.0 / (m * seq_len) as f64;
    let mut durations = vec![HashMap::new(); p];
    for s in stages.iter_mut() {
        s.begin_step(m);
    }
    let run = if masked { m } else { 1 };
    for (mb, (tokens, starts)) in batches.iter().enumerate().take(run) {
        if masked {
            for s in stages.iter_mut() {
                s.set_documents(mb, vec![starts.clone()])?;
            }
        }
        if own_lengths {
            for s in stages.iter_mut() {
                s.set_segment_lengths(mb, cuts[mb].clone())?;
            }
        }
        let cut = &cuts[mb];
        let mut at = 0;
        for (seg, &len) in cut.iter().enumerate() {
            let unit = Unit::new(mb, seg);
            let ids = Tensor::from_slice(&tokens[at..at + len], (1, len), &Device::Cpu)?;
            let targets = Tensor::from_slice(&tokens[at + 1..at + len + 1], len, &Device::Cpu)?;
            let mut input = StageInput::Tokens(ids);
            for (r, stage) in stages.iter_mut().enumerate() {
                let last = r + 1 == p;
                let t0 = thread_cpu_s();
                let out =
                    stage.forward(unit, input, last.then_some(&targets), scale, Mode::Train)?;
                durations[r].insert(Action::Forward(unit), thread_cpu_s() - t0);
                input = match out {
                    StageOutput::Hidden(h) if !last => StageInput::Hidden(h),
                    StageOutput::LossSum(_) if last => break,
                    _ => bail!("stage {r} of {p} returned the wrong kind of output"),
                };
            }
            at += len;
        }
        for seg in (0..cut.len()).rev() {
            let unit = Unit::new(mb, seg);
            let mut d_out = None;
            for r in (0..p).rev() {
                let t0 = thread_cpu_s();
                d_out = stages[r].backward(unit, d_out)?;
                durations[r].insert(Action::Backward(unit), thread_cpu_s() - t0);
            }
        }
    }
    for stage in durations.iter_mut().take(p) {
        let measured: Vec<(Action, f64)> = stage.iter().map(|(a, t)| (*a, *t)).collect();
        for mb in run..m {
            for (a, t) in &measured {
                let unit = Unit::new(mb, a.unit().segment);
                let copy = match a {
                    Action::Forward(_) => Action::Forward(unit),
                    _ => Action::Backward(unit),
                };
                stage.insert(copy, *t);
            }
        }
    }
    for s in stages.iter_mut() {
        s.reset_step();
    }
    Ok(durations)
}
