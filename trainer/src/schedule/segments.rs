//! Sequence partitions: how a micro-batch's sequence of `seq_len` tokens is cut into `splits`
//! segments.
//!
//! With causal attention a later segment attends to a longer K/V prefix, so equal lengths do not
//! mean equal work. The paper's computation-wise partition equalizes the FLOPs model
//!
//! ```text
//! attn(s, P)  = s·P·(4d+3)·h + 8·s·H·h·d − s²·(4d+3)·h/2
//! flops(s, P) = 4·s·H·V + L·(attn(s, P) + 4·s·H·F)
//! ```
//!
//! for a segment of length s ending at position P (L layers, h heads of dimension d, hidden H,
//! FFN F, vocabulary V). The terms of the attention proper (those with P and s²) can be weighted
//! by γ = [`FlopsModel::attention_cost`], the time of an attention FLOP relative to a dense
//! (matmul) FLOP on the hardware at hand: γ = 1 is the paper's pure FLOPs count;
//! `seqpipe bench schedule` fits γ from measured segment times, so that the compute partition
//! balances time, not FLOPs. The model is additive: `flops(b−a, b) = C(b) − C(a)` with
//! `C(x) = flops(x, x)`, so a partition into k segments of cost `C(T)/k` each exists, with later
//! segments shorter.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::ScheduleError;

/// How to choose segment lengths. Text and JSON forms: `"uniform"`, `"compute"`, `"documents"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum Partition {
    /// Equal lengths; `seq_len` must be divisible by `splits`.
    Uniform,
    /// Equal FLOPs per segment (the paper's computation-wise partition), lengths rounded to
    /// multiples of 8 where possible.
    Compute,
    /// Each micro-batch its own lengths: equal cost per segment under document masks, from its
    /// rows' document starts ([`super::doc_segments::batch_segment_lengths`]; one document per
    /// row gives exactly [`Partition::Compute`]). No single table: see
    /// [`super::SegmentRule`].
    Documents,
}

impl Partition {
    /// Every partition, in the order their names are listed.
    pub const ALL: [Partition; 3] = [Partition::Uniform, Partition::Compute, Partition::Documents];

    /// The canonical name (`"uniform"`, `"compute"`, `"documents"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Partition::Uniform => "uniform",
            Partition::Compute => "compute",
            Partition::Documents => "documents",
        }
    }
}

impl fmt::Display for Partition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Partition {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Partition::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| ScheduleError::Parse {
                what: "partition",
                input: s.to_string(),
                reason: "allowed values are \"uniform\", \"compute\", \"documents\"".to_string(),
            })
    }
}

impl TryFrom<String> for Partition {
    type Error = ScheduleError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Partition> for String {
    fn from(p: Partition) -> String {
        p.as_str().to_string()
    }
}

/// Model dimensions for the FLOPs formula (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct FlopsModel {
    /// Transformer layers L.
    pub layers: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Attention heads h.
    pub heads: usize,
    /// Head dimension d.
    pub head_dim: usize,
    /// FFN inner size F.
    pub ffn: usize,
    /// Vocabulary size V.
    pub vocab: usize,
    /// γ: weight of the attention terms (1 = FLOPs as in the paper).
    pub attention_cost: f64,
}

impl FlopsModel {
    /// `(α, β)` with `flops(s, P) = α(P)·s − β·s²`: α = 4HV + L(γP(4d+3)h + 8Hhd + 4HF),
    /// β = γL(4d+3)h/2.
    fn coefficients(&self, end: f64) -> (f64, f64) {
        let l = self.layers as f64;
        let hid = self.hidden as f64;
        let h = self.heads as f64;
        let d = self.head_dim as f64;
        let ff = self.ffn as f64;
        let v = self.vocab as f64;
        let g = self.attention_cost;
        let alpha = 4.0 * hid * v
            + l * (g * end * (4.0 * d + 3.0) * h + 8.0 * hid * h * d + 4.0 * hid * ff);
        let beta = g * l * (4.0 * d + 3.0) * h / 2.0;
        (alpha, beta)
    }

    /// `flops(s, P)`: the cost of a segment of length `s` ending at position `end`.
    fn flops(&self, s: f64, end: f64) -> f64 {
        let (alpha, beta) = self.coefficients(end);
        alpha * s - beta * s * s
    }
}

/// FLOPs of the segment `[start, start + len)` under the paper's model.
pub fn segment_flops(start: usize, len: usize, m: &FlopsModel) -> f64 {
    m.flops(len as f64, (start + len) as f64)
}

/// The paper's raw solver: segment lengths of (nearly) equal FLOPs.
///
/// Works from the last segment backwards: with the segment ending at P, choose the real length s
/// with `flops(s, P) = C(seq_len)/splits` (closed form of the quadratic), floor it, move P to the
/// segment's start; the first segment takes the remainder. Later segments are shorter; the
/// result is non-increasing and sums to `seq_len`. Each length is kept ≥ 1. A model whose FLOPs
/// are all zero gets equal lengths (remainder to the earliest segments).
///
/// # Panics
/// If `splits == 0` or `splits > seq_len`; [`segment_lengths`] checks both and returns an error.
pub fn solve_compute_partition(seq_len: usize, splits: usize, m: &FlopsModel) -> Vec<usize> {
    assert!(
        splits >= 1 && splits <= seq_len,
        "solve_compute_partition needs 1 <= splits <= seq_len (splits {splits}, seq_len {seq_len})"
    );
    let total = m.flops(seq_len as f64, seq_len as f64);
    if !(total.is_finite() && total > 0.0) {
        return equal_lengths(seq_len, splits);
    }
    let target = total / splits as f64;
    let mut lengths = Vec::with_capacity(splits);
    let mut end = seq_len;
    for earlier in (1..splits).rev() {
        // `earlier` segments remain before this one, each needing at least one token.
        let (alpha, beta) = m.coefficients(end as f64);
        // Smaller root of β s² − α s + target = 0, in the cancellation-free form.
        let disc = (alpha * alpha - 4.0 * beta * target).max(0.0);
        let s = 2.0 * target / (alpha + disc.sqrt());
        // Guard exact integers against rounding just below them.
        let s = (s + 1e-9 * s.max(1.0)).floor() as usize;
        let s = s.clamp(1, end - earlier);
        lengths.push(s);
        end -= s;
    }
    lengths.push(end);
    lengths.reverse();
    lengths
}

/// `splits` lengths summing to `seq_len`, as equal as possible, longer ones first.
fn equal_lengths(seq_len: usize, splits: usize) -> Vec<usize> {
    (0..splits)
        .map(|j| seq_len / splits + usize::from(j < seq_len % splits))
        .collect()
}

/// The segment lengths actually used for `partition`.
///
/// * [`Partition::Uniform`]: `splits` equal lengths; an error unless `seq_len` is divisible by
///   `splits` (a remainder would make one segment's shapes differ from all others silently).
/// * [`Partition::Compute`]: the [`solve_compute_partition`] lengths with their boundaries moved
///   to multiples of 8 (nearest), keeping the sum equal to `seq_len`, every length ≥ 1 and the
///   lengths non-increasing. When `seq_len` is not a multiple of 8 the first segment takes the
///   remainder, all others are multiples of 8. When `seq_len < 8·splits` the raw lengths are used.
///
/// * [`Partition::Documents`]: an error. Its lengths differ per micro-batch (each from its
///   documents): [`super::SegmentRule`] gives them.
///
/// Errors ([`ScheduleError::InvalidPartition`]) when `splits == 0`, `seq_len == 0`,
/// `splits > seq_len`, (compute) the model's FLOPs are zero, or for the document partition.
pub fn segment_lengths(
    partition: Partition,
    seq_len: usize,
    splits: usize,
    m: &FlopsModel,
) -> Result<Vec<usize>, ScheduleError> {
    let err = |msg: String| Err(ScheduleError::InvalidPartition(msg));
    if splits == 0 {
        return err("splits must be at least 1 (got 0)".into());
    }
    if seq_len == 0 {
        return err("seq_len must be at least 1 (got 0)".into());
    }
    if splits > seq_len {
        return err(format!(
            "cannot cut a sequence of {seq_len} tokens into {splits} non-empty segments \
             (splits must be <= seq_len)"
        ));
    }
    match partition {
        Partition::Uniform => {
            if !seq_len.is_multiple_of(splits) {
                return err(format!(
                    "uniform partition needs seq_len divisible by splits, but {seq_len} = \
                     {splits}·{} + {}; choose seq_len a multiple of {splits} or the \"compute\" \
                     partition",
                    seq_len / splits,
                    seq_len % splits
                ));
            }
            Ok(vec![seq_len / splits; splits])
        }
        Partition::Compute => {
            let total = m.flops(seq_len as f64, seq_len as f64);
            if !(total.is_finite() && total > 0.0) {
                return err(format!(
                    "the FLOPs model gives a sequence cost of {total} (are hidden, heads, \
                     head_dim or vocab zero?): {m:?}"
                ));
            }
            let raw = solve_compute_partition(seq_len, splits, m);
            Ok(align_to_8(&raw))
        }
        Partition::Documents => err(
            "the \"documents\" partition has no single table of segment lengths: each \
             micro-batch's come from its own documents (SegmentRule::lengths); use \"compute\" \
             or \"uniform\" where one table for every micro-batch is needed"
                .into(),
        ),
    }
}

/// Moves the boundaries of `raw` (non-increasing, sum T) to multiples of 8 after the first
/// segment's `T % 8` remainder, then restores non-increasing order by moving 8-token blocks
/// forward. Returns `raw` unchanged when `T < 8·k`.
fn align_to_8(raw: &[usize]) -> Vec<usize> {
    const A: usize = 8;
    let k = raw.len();
    let t: usize = raw.iter().sum();
    let blocks = t / A;
    let rem = t % A;
    if blocks < k {
        return raw.to_vec();
    }
    // q[j]: the start of segment j, in blocks after the remainder; q[0] = 0, q[k] = blocks.
    let mut q = vec![0usize; k + 1];
    q[k] = blocks;
    let mut start = 0usize;
    for j in 1..k {
        start += raw[j - 1];
        let ideal = ((start as f64 - rem as f64) / A as f64).round().max(0.0) as usize;
        q[j] = ideal.max(q[j - 1] + 1).min(blocks - (k - j));
    }
    let mut len: Vec<usize> = (0..k).map(|j| A * (q[j + 1] - q[j])).collect();
    len[0] += rem;
    // Each move shifts 8 tokens to an earlier segment, so this terminates; every length stays
    // >= 8 because a violating later segment is at least 16.
    while let Some(j) = (0..k - 1).find(|&j| len[j] < len[j + 1]) {
        len[j] += A;
        len[j + 1] -= A;
    }
    len
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The paper's example model (a 7B-class GPT).
    fn paper_model() -> FlopsModel {
        FlopsModel {
            layers: 24,
            hidden: 4096,
            heads: 32,
            head_dim: 128,
            ffn: 16384,
            vocab: 32000,
            attention_cost: 1.0,
        }
    }

    fn tiny_model() -> FlopsModel {
        FlopsModel {
            layers: 2,
            hidden: 64,
            heads: 4,
            head_dim: 16,
            ffn: 256,
            vocab: 256,
            attention_cost: 1.0,
        }
    }

    #[test]
    fn golden_paper_partition() {
        let m = paper_model();
        assert_eq!(
            solve_compute_partition(16384, 4, &m),
            vec![4929, 4238, 3777, 3440]
        );
        let used = segment_lengths(Partition::Compute, 16384, 4, &m).unwrap();
        assert_eq!(used, vec![4928, 4240, 3776, 3440]);
        // Equal work: every segment within 0.5% of the mean.
        let mut start = 0;
        let costs: Vec<f64> = used
            .iter()
            .map(|&l| {
                let c = segment_flops(start, l, &m);
                start += l;
                c
            })
            .collect();
        let mean = costs.iter().sum::<f64>() / 4.0;
        for c in costs {
            assert!((c / mean - 1.0).abs() < 0.005, "{c} vs {mean}");
        }
    }

    #[test]
    fn flops_are_additive() {
        let m = paper_model();
        let whole = segment_flops(0, 1000, &m);
        let parts = segment_flops(0, 300, &m) + segment_flops(300, 700, &m);
        assert!((whole / parts - 1.0).abs() < 1e-12);
    }

    #[test]
    fn compute_lengths_properties() {
        for m in [paper_model(), tiny_model()] {
            for seq_len in [
                1usize, 2, 7, 8, 9, 31, 64, 100, 257, 1000, 1001, 4096, 16384, 16389,
            ] {
                for splits in 1..=8usize.min(seq_len) {
                    let raw = solve_compute_partition(seq_len, splits, &m);
                    let used = segment_lengths(Partition::Compute, seq_len, splits, &m).unwrap();
                    for v in [&raw, &used] {
                        let ctx = format!("T={seq_len} k={splits} {v:?}");
                        assert_eq!(v.len(), splits, "{ctx}");
                        assert_eq!(v.iter().sum::<usize>(), seq_len, "{ctx}");
                        assert!(v.iter().all(|&l| l >= 1), "{ctx}");
                        assert!(v.windows(2).all(|w| w[0] >= w[1]), "{ctx}");
                    }
                    if seq_len >= 8 * splits {
                        assert!(used[1..].iter().all(|l| l % 8 == 0), "{used:?}");
                        assert_eq!(used[0] % 8, seq_len % 8, "{used:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn attention_cost_weights_the_attention_terms() {
        // γ scales exactly the P- and s²-terms: the difference from γ = 1 is linear in γ.
        let base = tiny_model();
        let with = |g: f64| FlopsModel {
            attention_cost: g,
            ..base
        };
        let (dense, all) = (
            segment_flops(96, 32, &with(0.0)),
            segment_flops(96, 32, &with(1.0)),
        );
        assert!(dense > 0.0 && all > dense);
        let three = segment_flops(96, 32, &with(3.0));
        assert!((three - (dense + 3.0 * (all - dense))).abs() < 1e-6 * three);
        // Costlier attention makes later segments (longer prefixes) costlier: the first segment
        // grows, the last shrinks, and the segments still balance under the weighted model.
        let (cheap, costly) = (
            solve_compute_partition(1024, 4, &with(1.0)),
            solve_compute_partition(1024, 4, &with(3.0)),
        );
        assert!(
            costly[0] > cheap[0] && costly[3] < cheap[3],
            "{cheap:?} {costly:?}"
        );
        let mut start = 0;
        let costs: Vec<f64> = costly
            .iter()
            .map(|&len| {
                start += len;
                segment_flops(start - len, len, &with(3.0))
            })
            .collect();
        let (max, min) = (
            costs.iter().copied().fold(0.0, f64::max),
            costs.iter().copied().fold(f64::INFINITY, f64::min),
        );
        assert!(max / min < 1.02, "{costs:?}");
    }

    #[test]
    fn uniform_lengths() {
        let m = tiny_model();
        assert_eq!(
            segment_lengths(Partition::Uniform, 64, 4, &m).unwrap(),
            vec![16; 4]
        );
        let e = segment_lengths(Partition::Uniform, 10, 3, &m)
            .unwrap_err()
            .to_string();
        assert!(e.contains("divisible") && e.contains("10"), "{e}");
    }

    #[test]
    fn bad_partition_parameters() {
        let m = tiny_model();
        for p in [Partition::Uniform, Partition::Compute] {
            let e = segment_lengths(p, 4, 5, &m).unwrap_err().to_string();
            assert!(e.contains("4 tokens into 5"), "{e}");
            assert!(segment_lengths(p, 4, 0, &m).is_err());
            assert!(segment_lengths(p, 0, 1, &m).is_err());
        }
        let zero = FlopsModel {
            hidden: 0,
            heads: 0,
            ..tiny_model()
        };
        let e = segment_lengths(Partition::Compute, 64, 2, &zero)
            .unwrap_err()
            .to_string();
        assert!(e.contains("FLOPs model"), "{e}");
        assert_eq!(solve_compute_partition(10, 3, &zero), vec![4, 3, 3]);
    }

    #[test]
    fn partition_text_round_trip() {
        for p in Partition::ALL {
            assert_eq!(p.to_string().parse::<Partition>().unwrap(), p);
            let json = serde_json::to_string(&p).unwrap();
            assert_eq!(serde_json::from_str::<Partition>(&json).unwrap(), p);
        }
        let e = "flops".parse::<Partition>().unwrap_err().to_string();
        assert!(
            e.contains("uniform") && e.contains("compute") && e.contains("documents"),
            "{e}"
        );
        let e = segment_lengths(Partition::Documents, 64, 2, &tiny_model())
            .unwrap_err()
            .to_string();
        assert!(e.contains("no single table"), "{e}");
    }
}
