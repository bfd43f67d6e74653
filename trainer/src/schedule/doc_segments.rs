//! The document-aware partition: segment lengths of equal modelled cost for one sequence's
//! document layout, when attention is document-masked.
//!
//! With a document mask a query at position x attends to `x − D(x)` earlier keys (D(x): the
//! start of its document) instead of x. The cost model is the paper's FLOPs model of
//! [`super::segments`] — [`FlopsModel`], with the attention terms weighted by γ =
//! `attention_cost` — with the causal triangle replaced by one triangle per document. A segment
//! `[a, b)` costs `C(b) − C(a)` with
//!
//! ```text
//! C(x) = c·x + w·F(x),   F(x) = ∫₀ˣ (u − D(u)) du   (one (x−D)²/2 triangle per document)
//! c    = 4HV + L(8Hhd + 4HF)          (the matrix work per token)
//! w    = γ·L·h·(4d+3)                 (per query-key pair)
//! ```
//!
//! For a single document `C(b) − C(a)` is exactly
//! [`segment_flops`](super::segments::segment_flops)`(a, b − a)`. A micro-batch's cost is the sum
//! of its rows' (they share the segment lengths). C is continuous and non-decreasing, so the
//! boundary of cost `j·C(T)/k` is found by bisection. Boundaries are rounded like the compute partition's (multiples of 8 after
//! the first segment's `T % 8` remainder, when `T ≥ 8k`).
//!
//! [`document_segment_lengths`] is a pure function of (layout, T, k, model): the same on every
//! stage and replica that sees the same tokens.

use super::ScheduleError;
use super::segments::{FlopsModel, Partition, segment_lengths};

/// The cost `C(x)` of the first x tokens of a micro-batch's sequences under a document mask: the
/// sum over its rows (all rows of a micro-batch share the segment lengths).
#[derive(Clone, Debug)]
pub struct MaskedCost {
    /// Matrix work per token, c.
    per_token: f64,
    /// Attention work per visible (query, key) pair, w.
    per_pair: f64,
    rows: Vec<RowLayout>,
    seq_len: usize,
}

/// One sequence's documents.
#[derive(Clone, Debug)]
struct RowLayout {
    /// Document starts within `0..seq_len`, beginning with 0.
    starts: Vec<usize>,
    /// `F(starts[i])`: the attention pairs of all documents before document i.
    before: Vec<f64>,
}

impl RowLayout {
    fn new(starts: &[usize], seq_len: usize) -> Result<Self, ScheduleError> {
        let err = |msg: String| Err(ScheduleError::InvalidPartition(msg));
        if starts.first() != Some(&0) {
            return err(format!(
                "document starts must begin with 0, got {:?}",
                &starts[..starts.len().min(4)]
            ));
        }
        if let Some(w) = starts.windows(2).find(|w| w[0] >= w[1]) {
            return err(format!(
                "document starts must be strictly increasing, got {} then {}",
                w[0], w[1]
            ));
        }
        let starts: Vec<usize> = starts
            .iter()
            .copied()
            .take_while(|&s| s < seq_len)
            .collect();
        let mut before = Vec::with_capacity(starts.len());
        let mut acc = 0.0;
        for (i, &s) in starts.iter().enumerate() {
            if i > 0 {
                acc += tri((s - starts[i - 1]) as f64);
            }
            before.push(acc);
        }
        Ok(Self { starts, before })
    }

    /// `F(x)`: visible (query, key) pairs of the first x positions, one triangle per document.
    fn pairs(&self, x: f64) -> f64 {
        let i = self.starts.partition_point(|&s| s as f64 <= x).max(1) - 1;
        self.before[i] + tri(x - self.starts[i] as f64)
    }
}

impl MaskedCost {
    /// The cost of a sequence of `seq_len` tokens whose documents start at `starts` (sorted,
    /// beginning with 0; starts at or past `seq_len` are ignored). Errors when `starts` is not
    /// sorted, does not begin with 0, or `seq_len` is 0.
    pub fn new(starts: &[usize], seq_len: usize, m: &FlopsModel) -> Result<Self, ScheduleError> {
        Self::batch(&[starts], seq_len, m)
    }

    /// The cost of a micro-batch: one `starts` per sequence (row), as in [`MaskedCost::new`].
    /// Errors also when there are no rows.
    pub fn batch(rows: &[&[usize]], seq_len: usize, m: &FlopsModel) -> Result<Self, ScheduleError> {
        let err = |msg: String| Err(ScheduleError::InvalidPartition(msg));
        if seq_len == 0 {
            return err("seq_len must be at least 1 (got 0)".into());
        }
        if rows.is_empty() {
            return err(
                "a micro-batch needs at least one sequence (got no document layouts)".into(),
            );
        }
        let rows = rows
            .iter()
            .map(|r| RowLayout::new(r, seq_len))
            .collect::<Result<Vec<_>, _>>()?;
        let (l, hid, h, d) = (
            m.layers as f64,
            m.hidden as f64,
            m.heads as f64,
            m.head_dim as f64,
        );
        Ok(Self {
            per_token: 4.0 * hid * m.vocab as f64
                + l * (8.0 * hid * h * d + 4.0 * hid * m.ffn as f64),
            per_pair: m.attention_cost * l * h * (4.0 * d + 3.0),
            rows,
            seq_len,
        })
    }

    /// The cost with measured weights instead of the FLOPs model's: `per_token` per token of
    /// each row and `per_pair` per visible (query, key) pair (both finite, ≥ 0, not both 0), e.g.
    /// fitted to kernel times by `seqpipe bench docmask`.
    pub fn with_weights(
        rows: &[&[usize]],
        seq_len: usize,
        per_token: f64,
        per_pair: f64,
    ) -> Result<Self, ScheduleError> {
        let ok = |w: f64| w.is_finite() && w >= 0.0;
        if !(ok(per_token) && ok(per_pair) && per_token + per_pair > 0.0) {
            return Err(ScheduleError::InvalidPartition(format!(
                "cost weights must be finite and >= 0, not both 0: per token {per_token}, per \
                 pair {per_pair}"
            )));
        }
        let zero = FlopsModel {
            layers: 0,
            hidden: 0,
            heads: 0,
            head_dim: 0,
            ffn: 0,
            vocab: 0,
            attention_cost: 0.0,
        };
        Ok(Self {
            per_token,
            per_pair,
            ..Self::batch(rows, seq_len, &zero)?
        })
    }

    /// Whether every sequence is a single document (within `seq_len`).
    pub fn one_document_each(&self) -> bool {
        self.rows.iter().all(|r| r.starts.len() == 1)
    }

    /// `C(x)` for a real position `0 ≤ x ≤ seq_len`.
    pub fn cumulative(&self, x: f64) -> f64 {
        let pairs: f64 = self.rows.iter().map(|r| r.pairs(x)).sum();
        self.per_token * self.rows.len() as f64 * x + self.per_pair * pairs
    }

    /// The cost of the segment `[start, start + len)`.
    pub fn segment(&self, start: usize, len: usize) -> f64 {
        self.cumulative((start + len) as f64) - self.cumulative(start as f64)
    }

    /// The costs of consecutive segments of `lengths` from position 0.
    pub fn segments(&self, lengths: &[usize]) -> Vec<f64> {
        let mut start = 0;
        lengths
            .iter()
            .map(|&len| {
                start += len;
                self.segment(start - len, len)
            })
            .collect()
    }

    /// The real position x with `C(x) = target` (`0 ≤ target ≤ C(seq_len)`): C is continuous and
    /// non-decreasing, so bisection (a fixed 64 halvings of `[0, seq_len]`: deterministic).
    fn position_of(&self, target: f64) -> f64 {
        let (mut lo, mut hi) = (0.0f64, self.seq_len as f64);
        for _ in 0..64 {
            let mid = 0.5 * (lo + hi);
            if self.cumulative(mid) < target {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        hi
    }
}

/// Pairs of a causal triangle of side y (the continuous count the paper's formula uses).
fn tri(y: f64) -> f64 {
    y * y / 2.0
}

/// `max/min` of the costs (∞ when a cost is 0).
pub fn cost_ratio(costs: &[f64]) -> f64 {
    let max = costs.iter().copied().fold(0.0, f64::max);
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    if min > 0.0 { max / min } else { f64::INFINITY }
}

/// Segment lengths of equal masked cost, solved for the layout only (no comparison, no
/// fallback): boundary j at the position of cost `j·C(T)/k`, rounded to the compute
/// partition's grid and kept strictly increasing.
pub fn solve_document_partition(cost: &MaskedCost, splits: usize) -> Vec<usize> {
    let t = cost.seq_len;
    let (unit, rem) = if t >= 8 * splits { (8, t % 8) } else { (1, 0) };
    let blocks = (t - rem) / unit;
    let total = cost.cumulative(t as f64);
    let mut bounds = Vec::with_capacity(splits + 1);
    bounds.push(0usize);
    let mut prev = 0usize; // in grid units; boundary = rem + unit·n (the first: n ≥ 1)
    for j in 1..splits {
        let x = cost.position_of(total * j as f64 / splits as f64);
        let n = ((x - rem as f64) / unit as f64).round().max(0.0) as usize;
        let n = n.max(prev + 1).min(blocks - (splits - j));
        bounds.push(rem + unit * n);
        prev = n;
    }
    bounds.push(t);
    bounds.windows(2).map(|w| w[1] - w[0]).collect()
}

/// The segment lengths of the document-aware partition for one sequence whose documents start at
/// `starts`: equal masked cost per segment ([`solve_document_partition`]).
///
/// Deterministic and pure. A sequence of one document gets exactly the compute partition
/// ([`segment_lengths`] with [`Partition::Compute`]), so single-document data behave as without
/// masks. Otherwise the solved lengths are returned unless the compute partition's lengths have a
/// smaller max/min masked cost (possible only when rounding to the 8-token grid dominates, i.e.
/// short sequences): the result is never less balanced, under the model, than the
/// document-blind partition. Errors as [`segment_lengths`] does (`splits` 0 or above `seq_len`,
/// a model of zero cost) and on unsorted `starts`.
pub fn document_segment_lengths(
    starts: &[usize],
    seq_len: usize,
    splits: usize,
    m: &FlopsModel,
) -> Result<Vec<usize>, ScheduleError> {
    batch_segment_lengths(&[starts], seq_len, splits, m)
}

/// [`document_segment_lengths`] for a micro-batch of several sequences (one layout per row): the
/// rows share the segment lengths, so their summed cost is balanced.
pub fn batch_segment_lengths(
    rows: &[&[usize]],
    seq_len: usize,
    splits: usize,
    m: &FlopsModel,
) -> Result<Vec<usize>, ScheduleError> {
    let blind = segment_lengths(Partition::Compute, seq_len, splits, m)?;
    let cost = MaskedCost::batch(rows, seq_len, m)?;
    if cost.one_document_each() {
        return Ok(blind);
    }
    let solved = solve_document_partition(&cost, splits);
    if cost_ratio(&cost.segments(&blind)) < cost_ratio(&cost.segments(&solved)) {
        Ok(blind)
    } else {
        Ok(solved)
    }
}

/// An upper bound on any segment the document-aware partition gives a micro-batch of `seq_len`
/// tokens cut into `splits` (whatever its documents): what memory is sized for.
///
/// A segment of s tokens costs at least `c·s` per row (its matrix work), and a row costs at most
/// `c·T + w·T²/2` (one document: the most attention pairs), so a balanced boundary is at most
/// `(T + w·T²/(2c))/k` tokens after the previous one. Rounding to the grid (8 tokens, or 1 when
/// `T < 8k`) moves each boundary by at most half a grid unit, and a boundary forced past its
/// neighbour leaves a segment of one unit: a segment gains at most one unit. The fallback is the
/// compute partition, whose longest segment is included. Capped at `T − (k − 1)`. Errors as
/// [`segment_lengths`] does.
pub fn longest_segment(
    seq_len: usize,
    splits: usize,
    m: &FlopsModel,
) -> Result<usize, ScheduleError> {
    let blind = segment_lengths(Partition::Compute, seq_len, splits, m)?;
    let cost = MaskedCost::new(&[0], seq_len, m)?;
    let blind_longest = blind.iter().copied().max().unwrap_or(seq_len);
    let cap = seq_len - (splits - 1);
    if cost.per_token <= 0.0 {
        return Ok(cap);
    }
    let t = seq_len as f64;
    let unit = if seq_len >= 8 * splits { 8 } else { 1 };
    let balanced = (t + cost.per_pair * t * t / (2.0 * cost.per_token)) / splits as f64;
    let bound = if balanced.is_finite() && balanced < t {
        balanced.ceil() as usize + unit
    } else {
        seq_len
    };
    Ok(bound.max(blind_longest).min(cap))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::segment_flops;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn gpt2_like() -> FlopsModel {
        FlopsModel {
            layers: 12,
            hidden: 768,
            heads: 12,
            head_dim: 64,
            ffn: 3072,
            vocab: 50257,
            attention_cost: 1.0,
        }
    }

    /// The attention kernels alone (what `seqpipe bench docmask` times): no matrix work.
    fn attention_only() -> FlopsModel {
        FlopsModel {
            layers: 1,
            hidden: 0,
            heads: 1,
            head_dim: 16,
            ffn: 0,
            vocab: 0,
            attention_cost: 1.0,
        }
    }

    /// Log-normal document lengths with median `median` and σ = 1, at least 1 token.
    fn lognormal_layout(r: &mut ChaCha8Rng, t: usize, median: f64) -> Vec<usize> {
        let mut starts = vec![0];
        let mut at = 0usize;
        loop {
            // Box–Muller.
            let (u1, u2): (f64, f64) = (r.random_range(1e-12..1.0), r.random_range(0.0..1.0));
            let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            at += ((median * z.exp()).round() as usize).max(1);
            if at >= t {
                return starts;
            }
            starts.push(at);
        }
    }

    #[test]
    fn one_document_costs_are_the_compute_partition_model() {
        for m in [gpt2_like(), attention_only()] {
            let cost = MaskedCost::new(&[0], 4096, &m).unwrap();
            for (a, len) in [(0, 100), (100, 1000), (4000, 96), (0, 4096)] {
                let (got, want) = (cost.segment(a, len), segment_flops(a, len, &m));
                assert!(
                    (got / want - 1.0).abs() < 1e-12,
                    "{a}+{len}: {got} vs {want}"
                );
            }
            assert_eq!(
                document_segment_lengths(&[0], 4096, 4, &m).unwrap(),
                segment_lengths(Partition::Compute, 4096, 4, &m).unwrap()
            );
            // Starts past the end are ignored: still one document.
            assert_eq!(
                document_segment_lengths(&[0, 4096, 5000], 4096, 4, &m).unwrap(),
                segment_lengths(Partition::Compute, 4096, 4, &m).unwrap()
            );
        }
    }

    #[test]
    fn masked_cost_counts_one_triangle_per_document() {
        // Attention only, w = 4·16 + 3 = 67 per pair: documents [0, 10) and [10, 30).
        let m = attention_only();
        let cost = MaskedCost::new(&[0, 10], 30, &m).unwrap();
        let w = 67.0;
        assert!((cost.cumulative(30.0) - w * (50.0 + 200.0)).abs() < 1e-9);
        // Segment [5, 15): the rest of the first triangle (50 − 12.5) plus 5²/2 of the second.
        assert!((cost.segment(5, 10) - w * (37.5 + 12.5)).abs() < 1e-9);
        // The closed-form inverse.
        for x in [0.0, 3.0, 10.0, 17.5, 30.0] {
            let back = cost.position_of(cost.cumulative(x));
            assert!((back - x).abs() < 1e-9, "{x} -> {back}");
        }
    }

    /// Property: on random log-normal layouts the document-aware partition's max/min modelled
    /// cost is ≤ the document-blind (compute) partition's, and near 1 for long sequences; the
    /// solved lengths alone (before the fallback) are near 1 too.
    #[test]
    fn document_aware_balances_better_than_document_blind() {
        let mut r = ChaCha8Rng::seed_from_u64(32);
        // The worst solved ratio for T < 32768 and for T = 32768.
        let mut worst = [1.0f64; 2];
        for m in [gpt2_like(), attention_only()] {
            for t in [8192usize, 16384, 32768] {
                for k in [2usize, 4, 8] {
                    for _ in 0..8 {
                        let starts = lognormal_layout(&mut r, t, 1000.0);
                        let cost = MaskedCost::new(&starts, t, &m).unwrap();
                        let aware = document_segment_lengths(&starts, t, k, &m).unwrap();
                        let blind = segment_lengths(Partition::Compute, t, k, &m).unwrap();
                        let solved = solve_document_partition(&cost, k);
                        assert_eq!(aware.iter().sum::<usize>(), t);
                        assert!(aware.iter().all(|&l| l >= 8 && l % 8 == 0));
                        let longest = longest_segment(t, k, &m).unwrap();
                        assert!(
                            aware.iter().all(|&l| l <= longest),
                            "T={t} k={k}: {aware:?} has a segment over the bound {longest}"
                        );
                        let (ra, rb, rs) = (
                            cost_ratio(&cost.segments(&aware)),
                            cost_ratio(&cost.segments(&blind)),
                            cost_ratio(&cost.segments(&solved)),
                        );
                        let what = format!("T={t} k={k} {aware:?} vs {blind:?}");
                        assert!(ra <= rb, "{what}: aware {ra} > blind {rb}");
                        // 8-token rounding moves each boundary by ≤ 4 tokens, so a segment
                        // gains or loses ≤ 8 tokens' cost (each at most c + w·T) against its
                        // target C(T)/k.
                        let slack = 8.0 * (cost.per_token + cost.per_pair * t as f64)
                            / (cost.cumulative(t as f64) / k as f64);
                        assert!(
                            rs <= (1.0 + slack) / (1.0 - slack),
                            "{what}: solved {rs} slack {slack}"
                        );
                        assert!(rs < 1.05, "{what}: solved {rs}");
                        worst[usize::from(t == 32768)] = worst[usize::from(t == 32768)].max(rs);
                    }
                }
            }
        }
        // Longer sequences, longer segments: rounding matters less.
        assert!(worst[1] < 1.02, "{worst:?}");
    }

    #[test]
    fn blind_partition_is_unbalanced_under_masks() {
        // Why the document-aware partition exists: with ~1k-token documents the compute
        // partition's short late segments cost far less than its long first one.
        let mut r = ChaCha8Rng::seed_from_u64(33);
        let m = attention_only();
        let starts = lognormal_layout(&mut r, 32768, 1000.0);
        let cost = MaskedCost::new(&starts, 32768, &m).unwrap();
        let blind = segment_lengths(Partition::Compute, 32768, 8, &m).unwrap();
        assert!(cost_ratio(&cost.segments(&blind)) > 2.0);
    }

    #[test]
    fn edge_cases() {
        let m = gpt2_like();
        // One-token documents everywhere: uniform cost per token, equal lengths.
        let all: Vec<usize> = (0..64).collect();
        assert_eq!(
            document_segment_lengths(&all, 64, 4, &m).unwrap(),
            vec![16; 4]
        );
        // Short sequences: integer grid, every segment ≥ 1, k = T.
        let l = document_segment_lengths(&[0, 2, 3], 5, 5, &m).unwrap();
        assert_eq!(l, vec![1; 5]);
        let l = document_segment_lengths(&[0, 3], 7, 3, &m).unwrap();
        assert_eq!((l.len(), l.iter().sum::<usize>()), (3, 7));
        assert!(l.iter().all(|&x| x >= 1));
        // T not a multiple of 8: the first segment takes the remainder.
        let l = document_segment_lengths(&[0, 500, 700], 1003, 4, &m).unwrap();
        assert_eq!(l.iter().sum::<usize>(), 1003);
        assert!(l[0] % 8 == 3 && l[1..].iter().all(|x| x % 8 == 0), "{l:?}");
        // k = 1.
        assert_eq!(
            document_segment_lengths(&[0, 9], 40, 1, &m).unwrap(),
            vec![40]
        );
        // A document starting exactly at the balanced boundary keeps it there: two equal
        // documents, two segments.
        assert_eq!(
            document_segment_lengths(&[0, 2048], 4096, 2, &m).unwrap(),
            vec![2048, 2048]
        );
        // Errors.
        for (starts, needle) in [
            (vec![1, 5], "begin with 0"),
            (vec![], "begin with 0"),
            (vec![0, 5, 5], "strictly increasing"),
        ] {
            let e = document_segment_lengths(&starts, 64, 2, &m)
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{e}");
        }
        assert!(document_segment_lengths(&[0], 4, 5, &m).is_err());
        assert!(document_segment_lengths(&[0], 4, 0, &m).is_err());
    }

    #[test]
    fn batch_rows_share_lengths_and_balance_their_sum() {
        let mut r = ChaCha8Rng::seed_from_u64(35);
        let m = attention_only();
        let rows: Vec<Vec<usize>> = (0..4)
            .map(|_| lognormal_layout(&mut r, 16384, 1000.0))
            .collect();
        let refs: Vec<&[usize]> = rows.iter().map(|r| r.as_slice()).collect();
        let cost = MaskedCost::batch(&refs, 16384, &m).unwrap();
        // The batch's cost is the sum of its rows'.
        let single: f64 = rows
            .iter()
            .map(|r| MaskedCost::new(r, 16384, &m).unwrap().segment(1000, 3000))
            .sum();
        assert!((cost.segment(1000, 3000) / single - 1.0).abs() < 1e-12);
        let l = batch_segment_lengths(&refs, 16384, 8, &m).unwrap();
        let blind = segment_lengths(Partition::Compute, 16384, 8, &m).unwrap();
        let (ra, rb) = (
            cost_ratio(&cost.segments(&l)),
            cost_ratio(&cost.segments(&blind)),
        );
        assert!(ra < 1.02 && ra <= rb, "{ra} {rb} {l:?}");
        assert!(MaskedCost::batch(&[], 16, &m).is_err());
        // Explicit weights: the same costs as the model's when they are the model's.
        let w = MaskedCost::with_weights(&refs, 16384, 0.0, 67.0).unwrap();
        assert!((w.segment(100, 5000) / cost.segment(100, 5000) - 1.0).abs() < 1e-12);
        assert!(MaskedCost::with_weights(&refs, 16384, 0.0, 0.0).is_err());
        assert!(MaskedCost::with_weights(&refs, 16384, -1.0, 1.0).is_err());
        // One document in every row: the compute partition.
        let one: [&[usize]; 2] = [&[0], &[0, 20000]];
        assert_eq!(batch_segment_lengths(&one, 16384, 8, &m).unwrap(), blind);
    }

    /// The memory bound holds for every layout, the adversarial ones included: many one-token
    /// documents before one long one (cheap tokens first, so the first segment is long).
    #[test]
    fn no_layout_gets_a_segment_longer_than_the_bound() {
        let mut r = ChaCha8Rng::seed_from_u64(36);
        let small = FlopsModel {
            layers: 4,
            hidden: 16,
            heads: 2,
            head_dim: 8,
            ffn: 64,
            vocab: 32,
            attention_cost: 1.0,
        };
        for m in [gpt2_like(), small, attention_only()] {
            for t in [5usize, 32, 100, 1003, 4096] {
                for k in (1..=8).filter(|&k| k <= t) {
                    let longest = longest_segment(t, k, &m).unwrap();
                    assert!(longest <= t - (k - 1));
                    let mut layouts: Vec<Vec<usize>> = vec![
                        vec![0],
                        (0..t).collect(),
                        (0..t / 2).collect(),
                        (0..t - t / 8).collect(),
                        lognormal_layout(&mut r, t, (t / 16).max(1) as f64),
                    ];
                    for density in [0.02, 0.3] {
                        layouts.push(
                            std::iter::once(0)
                                .chain((1..t).filter(|_| r.random::<f64>() < density))
                                .collect(),
                        );
                    }
                    for starts in &layouts {
                        let l = document_segment_lengths(starts, t, k, &m).unwrap();
                        assert_eq!(l.iter().sum::<usize>(), t);
                        assert!(
                            l.iter().all(|&x| x <= longest),
                            "T={t} k={k} {m:?}: {l:?} over {longest}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn deterministic() {
        let mut r = ChaCha8Rng::seed_from_u64(34);
        let starts = lognormal_layout(&mut r, 16384, 1000.0);
        let a = document_segment_lengths(&starts, 16384, 8, &gpt2_like()).unwrap();
        let b = document_segment_lengths(&starts, 16384, 8, &gpt2_like()).unwrap();
        assert_eq!(a, b);
    }
}
