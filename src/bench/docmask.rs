//! `seqpipe bench docmask`: document-masked attention on packed documents, per Seq1F1B segment.
//!
//! For each sequence length T, a sequence of packed synthetic documents (log-normal lengths, the
//! data layer's document mode) gives the document starts. For each k, the document-blind
//! (compute) partition and the document-aware one cut it into k segments; each segment's
//! document-masked attention forward + backward runs over its K/V prefix, trimmed to the earliest
//! document start its queries need, on one thread, and is timed in that thread's CPU time (so
//! other processes on a busy machine do not inflate it). Per partition it prints the
//! slowest/fastest segment time (min and median over rounds) beside the modelled ratio. The
//! whole sequence's attention with the mask against without it shows how much work the mask
//! skips; the two times also fit the kernels' own weights (time = a·pairs + b·tokens: a per-token
//! overhead the FLOPs model lacks, from the 64-query blocks and the per-row work), and a third,
//! "fitted" document-aware partition is solved with them.
//!
//! Shape: one sequence, one head, head dim `--head-dim` (16), f32. The partitions use the
//! attention terms of the FLOPs model only (hidden, FFN and vocabulary 0), since only the
//! attention kernels are timed here; a stage would use its full model.
//!
//! The whole-step part ([`step`], `--part step`) runs a real masked Seq1F1B step of a tiny GPT on
//! CPU stages and replays its unit times on `p` devices: the bubble against the formula, and the
//! step time with masks against without.

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use clap::Args;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use ops::{
    DocumentMask, causal_prefix_attention_backward, causal_prefix_attention_forward,
    document_prefix_attention_backward, document_prefix_attention_forward,
};
use trainer::data::{
    DocumentLengths, SampleKey, Split, SyntheticDocuments, TokenSource, document_starts,
};
use trainer::schedule::doc_segments::{
    MaskedCost, cost_ratio, document_segment_lengths, solve_document_partition,
};
use trainer::schedule::{FlopsModel, Partition, segment_lengths};

use crate::bench::step::median;

mod step;

/// Which parts `seqpipe bench docmask` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    /// The attention kernels per segment, and the whole sequence masked against unmasked.
    Attention,
    /// A whole masked Seq1F1B step on CPU stages, replayed on `--stages` devices.
    Step,
    /// Both.
    Both,
}

/// Flags of `seqpipe bench docmask`.
#[derive(Args, Debug)]
pub struct DocmaskBenchArgs {
    /// Sequence lengths T (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "8192,16384,32768")]
    seq_lens: Vec<usize>,
    /// Segments k per sequence (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    splits: Vec<usize>,
    /// Median document length in tokens (log-normal).
    #[arg(long, default_value_t = 1000)]
    median: usize,
    /// σ of the log of the document length.
    #[arg(long, default_value_t = 1.0)]
    sigma: f64,
    /// Head dimension (one head, one sequence).
    #[arg(long, default_value_t = 16)]
    head_dim: usize,
    /// Timing rounds; min and median over them are printed.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Seed of the documents and the tensors.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write the numbers as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<std::path::PathBuf>,
    /// Which parts to run.
    #[arg(long, value_enum, default_value_t = Part::Both)]
    part: Part,
    /// Whole step: pipeline stages p (one layer each).
    #[arg(long, default_value_t = 4)]
    stages: usize,
    /// Whole step: micro-batches m (one packed row each).
    #[arg(long, default_value_t = 4)]
    step_microbatches: usize,
    /// Whole step: rounds (the attention part uses `--rounds`).
    #[arg(long, default_value_t = 2)]
    step_rounds: usize,
}

/// One (T, k, partition) row.
#[derive(Debug, Serialize)]
struct PartitionRow {
    seq_len: usize,
    splits: usize,
    partition: &'static str,
    lengths: Vec<usize>,
    modelled_ratio: f64,
    /// Per round: slowest / fastest segment time.
    time_ratios: Vec<f64>,
}

/// One T's whole-sequence comparison.
#[derive(Debug, Serialize)]
struct MaskRow {
    seq_len: usize,
    documents: usize,
    masked_s: Vec<f64>,
    unmasked_s: Vec<f64>,
    /// Visible (query, key) pairs with the mask / without.
    modelled_fraction: f64,
    /// The fitted per-token time in units of the per-pair time.
    per_token_in_pairs: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    median: usize,
    sigma: f64,
    head_dim: usize,
    rounds: usize,
    partitions: Vec<PartitionRow>,
    masks: Vec<MaskRow>,
    step: Option<step::StepShape>,
    steps: Vec<step::StepRow>,
}

/// Runs the benchmark on one compute thread and prints its tables.
pub fn run(args: &DocmaskBenchArgs) -> Result<()> {
    anyhow::ensure!(args.rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(args.head_dim >= 1, "--head-dim must be at least 1");
    ops::pool::run_in_pool("bench", 1, || run_on_this_thread(args))
        .context("starting the benchmark's compute thread")?
}

fn run_on_this_thread(args: &DocmaskBenchArgs) -> Result<()> {
    let lengths = DocumentLengths::new(args.median, args.sigma)?;
    let docs = SyntheticDocuments::new(512, 1, 4, args.seed, lengths)?;
    let model = FlopsModel {
        layers: 1,
        hidden: 0,
        heads: 1,
        head_dim: args.head_dim,
        ffn: 0,
        vocab: 0,
        attention_cost: 1.0,
    };
    let mut report = Report {
        median: args.median,
        sigma: args.sigma,
        head_dim: args.head_dim,
        rounds: args.rounds,
        partitions: Vec::new(),
        masks: Vec::new(),
        step: None,
        steps: Vec::new(),
    };
    if args.part != Part::Step {
        attention(args, &docs, &model, &mut report)?;
    }
    if args.part != Part::Attention {
        let shape = step::StepShape {
            stages: args.stages,
            microbatches: args.step_microbatches,
            rounds: args.step_rounds,
            head_dim: args.head_dim,
        };
        if args.part == Part::Both {
            println!();
        }
        report.steps = step::run(&shape, &docs, args.seed, &args.seq_lens, &args.splits)?;
        report.step = Some(shape);
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The attention part: per (T, k) the segments' time ratio under each partition, and per T the
/// whole sequence's attention with the mask against without.
fn attention(
    args: &DocmaskBenchArgs,
    docs: &SyntheticDocuments,
    model: &FlopsModel,
    report: &mut Report,
) -> Result<()> {
    println!(
        "document-masked attention, 1 sequence x 1 head x head dim {}, f32, 1 thread; documents \
         log-normal (median {}, sigma {}); forward + backward per segment over its trimmed K/V \
         prefix; {} rounds",
        args.head_dim, args.median, args.sigma, args.rounds
    );
    println!(
        "{:>6} {:>2} {:>9} {:>9} {:>12} {:>12}  lengths",
        "T", "k", "partition", "modelled", "time min", "time median"
    );
    for &t in &args.seq_lens {
        let key = SampleKey {
            seed: args.seed,
            step: t as u64,
            micro_batch: 0,
            row: 0,
        };
        let tokens = docs.sample(Split::Train, key, t)?;
        let starts = document_starts(&tokens, docs.end_of_text());
        let mask = DocumentMask::new(vec![starts.clone()])?;
        let cost = MaskedCost::new(&starts, t, model)?;
        let operands = Operands::random(args.seed ^ t as u64, t, args.head_dim)?;
        // The whole sequence with the mask and without, first: their times also fit the
        // kernels' own weights (time = a·pairs + b·tokens) for the "fitted" partition.
        let (masked_s, unmasked_s) = whole_sequence_times(&operands, &mask, args.rounds)?;
        let (row, fitted) = fit_mask_row(&starts, t, masked_s, unmasked_s)?;
        report.masks.push(row);
        for &splits in &args.splits {
            let blind = segment_lengths(Partition::Compute, t, splits, model)?;
            let aware = document_segment_lengths(&starts, t, splits, model)?;
            let fit = solve_document_partition(&fitted, splits);
            for (name, lengths) in [("blind", blind), ("aware", aware), ("fitted", fit)] {
                let mut time_ratios = Vec::with_capacity(args.rounds);
                for _ in 0..args.rounds {
                    let times = segment_times(&operands, &mask, &lengths)?;
                    time_ratios.push(cost_ratio(&times));
                }
                let row = PartitionRow {
                    seq_len: t,
                    splits,
                    partition: name,
                    modelled_ratio: cost_ratio(&cost.segments(&lengths)),
                    time_ratios,
                    lengths,
                };
                println!(
                    "{:>6} {:>2} {:>9} {:>9.3} {:>12.3} {:>12.3}  {:?}",
                    t,
                    splits,
                    name,
                    row.modelled_ratio,
                    min(&row.time_ratios),
                    median(&row.time_ratios),
                    row.lengths
                );
                report.partitions.push(row);
            }
        }
    }
    println!();
    print_masks(&report.masks);
    Ok(())
}

/// One head's attention operands over a sequence, (1, 1, T, head_dim) each, uniform in [-1, 1):
/// queries, keys, values and the output gradient, with the softmax scale.
struct Operands {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: f64,
}

impl Operands {
    /// Draws q, k, v and g in that order from a generator seeded with `seed`.
    fn random(seed: u64, seq_len: usize, head_dim: usize) -> Result<Self> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut rand = || -> Result<Tensor> {
            let data: Vec<f32> = (0..seq_len * head_dim)
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect();
            Ok(Tensor::from_vec(
                data,
                (1, 1, seq_len, head_dim),
                &Device::Cpu,
            )?)
        };
        let (q, k, v, g) = (rand()?, rand()?, rand()?, rand()?);
        Ok(Operands {
            q,
            k,
            v,
            g,
            scale: 1.0 / (head_dim as f64).sqrt(),
        })
    }
}

/// Per round, the seconds of the whole sequence's attention forward + backward with the mask,
/// and without it (causal only).
fn whole_sequence_times(
    o: &Operands,
    mask: &DocumentMask,
    rounds: usize,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let (mut masked_s, mut unmasked_s) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let start = thread_cpu_s();
        let (_, ctx) = document_prefix_attention_forward(&o.q, &o.k, &o.v, o.scale, mask, 0)?;
        document_prefix_attention_backward(&ctx, &o.k, &o.v, &o.g, o.scale, mask, 0)?;
        masked_s.push(thread_cpu_s() - start);
        let start = thread_cpu_s();
        let (_, ctx) = causal_prefix_attention_forward(&o.q, &o.k, &o.v, o.scale)?;
        causal_prefix_attention_backward(&ctx, &o.k, &o.v, &o.g, o.scale)?;
        unmasked_s.push(thread_cpu_s() - start);
    }
    Ok((masked_s, unmasked_s))
}

/// The sequence's mask row, and the cost model with the kernels' own weights fitted from the
/// fastest masked and unmasked times (time = a·pairs + b·tokens: the pairs the mask hides cost
/// the difference).
fn fit_mask_row(
    starts: &[usize],
    t: usize,
    masked_s: Vec<f64>,
    unmasked_s: Vec<f64>,
) -> Result<(MaskRow, MaskedCost)> {
    let pairs = |x: f64| x * (x + 1.0) / 2.0;
    let visible: f64 = starts
        .iter()
        .zip(starts.iter().skip(1).chain([&t]))
        .map(|(a, b)| pairs((b - a) as f64))
        .sum();
    let (tm, tu, all) = (min(&masked_s), min(&unmasked_s), pairs(t as f64));
    let per_pair = ((tu - tm) / (all - visible)).max(0.0);
    let per_token = ((tm - per_pair * visible) / t as f64).max(0.0);
    let fitted = MaskedCost::with_weights(&[starts], t, per_token, per_pair)?;
    let row = MaskRow {
        seq_len: t,
        documents: starts.len(),
        masked_s,
        unmasked_s,
        modelled_fraction: visible / all,
        per_token_in_pairs: per_token / per_pair,
    };
    Ok((row, fitted))
}

/// Prints the table of the whole sequences' masked against unmasked times.
fn print_masks(masks: &[MaskRow]) {
    println!(
        "{:>6} {:>5} {:>12} {:>12} {:>14} {:>14} {:>14} {:>15}",
        "T",
        "docs",
        "masked min",
        "unmasked min",
        "masked/unm min",
        "masked/unm med",
        "visible pairs",
        "fit tok/pair"
    );
    for m in masks {
        let ratios: Vec<f64> = m
            .masked_s
            .iter()
            .zip(&m.unmasked_s)
            .map(|(a, b)| a / b)
            .collect();
        println!(
            "{:>6} {:>5} {:>11.3}s {:>11.3}s {:>14.4} {:>14.4} {:>14.4} {:>15.1}",
            m.seq_len,
            m.documents,
            min(&m.masked_s),
            min(&m.unmasked_s),
            min(&ratios),
            median(&ratios),
            m.modelled_fraction,
            m.per_token_in_pairs
        );
    }
}

/// Seconds of each segment's masked attention forward + backward, over the K/V prefix from the
/// earliest document start its queries need.
fn segment_times(o: &Operands, mask: &DocumentMask, lengths: &[usize]) -> Result<Vec<f64>> {
    let (q, k, v, g, scale) = (&o.q, &o.k, &o.v, &o.g, o.scale);
    let mut times = Vec::with_capacity(lengths.len());
    let mut start = 0;
    for &len in lengths {
        let key_start = mask.prefix_start(start);
        let keys = start + len - key_start;
        let (qs, gs) = (q.narrow(2, start, len)?, g.narrow(2, start, len)?);
        let (ks, vs) = (
            k.narrow(2, key_start, keys)?.contiguous()?,
            v.narrow(2, key_start, keys)?.contiguous()?,
        );
        let (qs, gs) = (qs.contiguous()?, gs.contiguous()?);
        let t0 = thread_cpu_s();
        let (_, ctx) = document_prefix_attention_forward(&qs, &ks, &vs, scale, mask, key_start)?;
        document_prefix_attention_backward(&ctx, &ks, &vs, &gs, scale, mask, key_start)?;
        times.push(thread_cpu_s() - t0);
        start += len;
    }
    Ok(times)
}

/// CPU seconds of the calling thread (`CLOCK_THREAD_CPUTIME_ID`): the kernels run on this thread
/// alone (a one-thread pool), and time other processes take on the cores is not counted.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn min(xs: &[f64]) -> f64 {
    xs.iter().copied().fold(f64::INFINITY, f64::min)
}
