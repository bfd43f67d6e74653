//! A seeded random n-gram language whose entropy rate is known exactly.
//!
//! Every context (the previous `order` tokens) has `branching` distinct successors, chosen
//! pseudo-randomly from a hash of `(synthetic_seed, context, slot)`. Slot `i` is taken with the
//! fixed probability `w_i ∝ 1/(i+1)` (the same vector for every context), so the conditional
//! entropy of the next token given *any* context is exactly `H(w)`, and the entropy rate of the
//! language is `H(w)` whatever its stationary distribution. The first `order` tokens of each
//! sample are uniform over the alphabet. A model that learns the table perfectly reaches
//! [`SyntheticLanguage::loss_lower_bound`], which makes the synthetic source a quantitative
//! convergence check.

use rand::RngCore;

use super::keys::{mix, sample_rng, splitmix64, uniform_below, unit_f64};
use super::{DataError, SampleKey, Split, TokenSource};

/// Domain tag of the transition table ("ngram" in ASCII).
const TAG_TABLE: u64 = 0x006E_6772_616D;

/// A seeded random n-gram Markov source (see the module docs).
#[derive(Clone, Debug)]
pub struct SyntheticLanguage {
    vocab_size: usize,
    order: usize,
    branching: usize,
    seed: u64,
    table_key: u64,
    weights: Vec<f64>,
    cdf: Vec<f64>,
    entropy: f64,
}

impl SyntheticLanguage {
    /// A language over `vocab_size` tokens in which each context of `order` tokens has
    /// `branching` distinct successors; `seed` selects the transition table.
    ///
    /// Errors if `vocab_size` is 0 or above 2^32, or `branching` is not in `1..=vocab_size`.
    pub fn new(
        vocab_size: usize,
        order: usize,
        branching: usize,
        seed: u64,
    ) -> Result<Self, DataError> {
        if vocab_size == 0 || vocab_size as u64 > u64::from(u32::MAX) + 1 {
            return Err(DataError::InvalidConfig(format!(
                "the synthetic language needs a vocabulary of 1..=2^32 tokens, but \
                 model.vocab_size is {vocab_size}; fix model.vocab_size"
            )));
        }
        if branching == 0 || branching > vocab_size {
            return Err(DataError::InvalidConfig(format!(
                "synthetic_branching = {branching}, but every context needs between 1 and \
                 vocab_size = {vocab_size} distinct successors; set [data] synthetic_branching \
                 in 1..={vocab_size}"
            )));
        }
        let raw: Vec<f64> = (0..branching).map(|i| 1.0 / (i as f64 + 1.0)).collect();
        let total: f64 = raw.iter().sum();
        let weights: Vec<f64> = raw.iter().map(|w| w / total).collect();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w;
                acc
            })
            .collect();
        let entropy = weights
            .iter()
            .filter(|&&w| w > 0.0)
            .map(|&w| -w * w.ln())
            .sum();
        Ok(SyntheticLanguage {
            vocab_size,
            order,
            branching,
            seed,
            table_key: mix(&[TAG_TABLE, seed]),
            weights,
            cdf,
            entropy,
        })
    }

    /// Alphabet size (all tokens are `< vocab_size`).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Context order n.
    pub fn order(&self) -> usize {
        self.order
    }

    /// Successors per context.
    pub fn branching(&self) -> usize {
        self.branching
    }

    /// Seed of the transition table.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The probability of each successor slot, `w_i ∝ 1/(i+1)`, summing to 1.
    pub fn slot_weights(&self) -> &[f64] {
        &self.weights
    }

    /// The entropy rate in nats per token: `H(w) = -Σ w_i ln w_i`, the conditional entropy of
    /// the next token given any full context.
    pub fn entropy_rate_nats(&self) -> f64 {
        self.entropy
    }

    /// The minimum achievable mean cross-entropy (nats) over the `seq_len` targets of a sample
    /// (positions `1..=seq_len`): targets at positions `< order` are uniform (`ln V` each), the
    /// rest cost `H(w)`. Returns NaN for `seq_len == 0` (no targets).
    pub fn loss_lower_bound(&self, seq_len: usize) -> f64 {
        if seq_len == 0 {
            return f64::NAN;
        }
        let uniform_targets = self.order.saturating_sub(1).min(seq_len);
        let ln_v = (self.vocab_size as f64).ln();
        (uniform_targets as f64 * ln_v + (seq_len - uniform_targets) as f64 * self.entropy)
            / seq_len as f64
    }

    /// The `branching` distinct successors of `context` (its last `order` tokens are used), in
    /// slot order: successor `i` follows with probability `slot_weights()[i]`.
    ///
    /// # Panics
    /// If `context` is shorter than `order`.
    pub fn successors(&self, context: &[u32]) -> Vec<u32> {
        assert!(
            context.len() >= self.order,
            "successors: context has {} tokens, order is {}",
            context.len(),
            self.order
        );
        let mut out = Vec::with_capacity(self.branching);
        let ctx = self.context_hash(&context[context.len() - self.order..]);
        self.fill_successors(ctx, self.branching - 1, &mut out);
        out
    }

    fn context_hash(&self, context: &[u32]) -> u64 {
        context
            .iter()
            .fold(self.table_key, |h, &t| splitmix64(h ^ u64::from(t)))
    }

    /// Writes successors `0..=last_slot` of the context with hash `ctx` into `out` (cleared).
    /// Slot `i` is `hash(ctx, i) mod V`, moved to the next unused id (cyclically) if an earlier
    /// slot already took it, so the successors of one context are distinct.
    fn fill_successors(&self, ctx: u64, last_slot: usize, out: &mut Vec<u32>) {
        out.clear();
        let v = self.vocab_size as u64;
        for slot in 0..=last_slot as u64 {
            let h = splitmix64(splitmix64(ctx ^ slot));
            let mut cand = ((u128::from(h) * u128::from(v)) >> 64) as u64;
            while out.contains(&(cand as u32)) {
                cand = (cand + 1) % v;
            }
            out.push(cand as u32);
        }
    }

    fn pick_slot(&self, rng: &mut impl RngCore) -> usize {
        let u = unit_f64(rng);
        self.cdf
            .iter()
            .position(|&c| u < c)
            .unwrap_or(self.branching - 1)
    }

    /// Generates `len` tokens from the random stream `rng`.
    pub(crate) fn generate(&self, rng: &mut impl RngCore, len: usize) -> Vec<u32> {
        let mut out: Vec<u32> = Vec::with_capacity(len);
        let mut succ = Vec::with_capacity(self.branching);
        for pos in 0..len {
            let tok = if pos < self.order {
                uniform_below(rng, self.vocab_size as u64) as u32
            } else {
                let slot = self.pick_slot(rng);
                let ctx = self.context_hash(&out[pos - self.order..pos]);
                self.fill_successors(ctx, slot, &mut succ);
                succ[slot]
            };
            out.push(tok);
        }
        out
    }
}

impl TokenSource for SyntheticLanguage {
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn describe(&self) -> String {
        format!(
            "synthetic {}-gram language (vocab {}, branching {}, seed {}, entropy rate {:.4} nats/token)",
            self.order + 1,
            self.vocab_size,
            self.branching,
            self.seed,
            self.entropy
        )
    }

    fn sample(&self, split: Split, key: SampleKey, len: usize) -> Result<Vec<u32>, DataError> {
        let mut rng = sample_rng(split, key);
        Ok(self.generate(&mut rng, len))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::super::keys::rng_from_seed;
    use super::*;

    fn key(step: u64, row: u64) -> SampleKey {
        SampleKey {
            seed: 42,
            step,
            micro_batch: 0,
            row,
        }
    }

    #[test]
    fn tokens_are_below_vocab_and_pure() {
        for (v, order, k) in [(1, 2, 1), (2, 1, 2), (17, 3, 5), (256, 2, 4), (50257, 2, 4)] {
            let lang = SyntheticLanguage::new(v, order, k, 9).unwrap();
            let a = lang.sample(Split::Train, key(1, 2), 500).unwrap();
            assert_eq!(a.len(), 500);
            assert!(a.iter().all(|&t| (t as usize) < v), "vocab {v}");
            assert_eq!(a, lang.sample(Split::Train, key(1, 2), 500).unwrap());
            if v > 1 {
                assert_ne!(a, lang.sample(Split::Train, key(1, 3), 500).unwrap());
                assert_ne!(a, lang.sample(Split::Val, key(1, 2), 500).unwrap());
            }
        }
    }

    #[test]
    fn shorter_sample_is_a_prefix() {
        let lang = SyntheticLanguage::new(64, 2, 4, 1).unwrap();
        let long = lang.sample(Split::Train, key(0, 0), 100).unwrap();
        let short = lang.sample(Split::Train, key(0, 0), 10).unwrap();
        assert_eq!(&long[..10], &short[..]);
    }

    #[test]
    fn golden_sample_is_stable() {
        // Pinned so that an accidental change of the derivation (which would break bit-exact
        // resumption of runs made with an older build) fails loudly.
        let lang = SyntheticLanguage::new(256, 2, 4, 1234).unwrap();
        let got = lang
            .sample(
                Split::Train,
                SampleKey {
                    seed: 1,
                    step: 2,
                    micro_batch: 3,
                    row: 4,
                },
                12,
            )
            .unwrap();
        assert_eq!(got, GOLDEN);
    }
    const GOLDEN: [u32; 12] = [7, 25, 83, 252, 11, 54, 102, 73, 86, 162, 180, 60];

    #[test]
    fn successors_are_distinct_and_follow_the_table() {
        // branching == vocab: every context's successors are a permutation of the alphabet.
        let lang = SyntheticLanguage::new(5, 1, 5, 3).unwrap();
        for t in 0..5u32 {
            let mut s = lang.successors(&[t]);
            s.sort_unstable();
            assert_eq!(s, vec![0, 1, 2, 3, 4]);
        }
        let lang = SyntheticLanguage::new(50, 2, 6, 3).unwrap();
        let sample = lang.sample(Split::Train, key(0, 0), 2000).unwrap();
        for w in sample.windows(3) {
            let s = lang.successors(&w[..2]);
            let mut d = s.clone();
            d.sort_unstable();
            d.dedup();
            assert_eq!(d.len(), 6);
            assert!(s.contains(&w[2]));
        }
        // The table depends on the synthetic seed.
        let other = SyntheticLanguage::new(50, 2, 6, 4).unwrap();
        assert!((0..50u32).any(|t| lang.successors(&[t, t]) != other.successors(&[t, t])));
    }

    #[test]
    fn entropy_rate_formula() {
        let lang = SyntheticLanguage::new(256, 2, 4, 0).unwrap();
        let z = 1.0 + 0.5 + 1.0 / 3.0 + 0.25;
        let h: f64 = (1..=4)
            .map(|i| (1.0 / i as f64) / z)
            .map(|p| -p * p.ln())
            .sum();
        assert!((lang.entropy_rate_nats() - h).abs() < 1e-12);
        assert!((lang.slot_weights().iter().sum::<f64>() - 1.0).abs() < 1e-12);
        let one = SyntheticLanguage::new(10, 2, 1, 0).unwrap();
        assert_eq!(one.entropy_rate_nats(), 0.0);
    }

    #[test]
    fn loss_lower_bound_formula() {
        let lang = SyntheticLanguage::new(256, 2, 4, 0).unwrap();
        let h = lang.entropy_rate_nats();
        let ln_v = 256f64.ln();
        // Targets at positions 1..=8; position 1 < order is uniform.
        let want = (ln_v + 7.0 * h) / 8.0;
        assert!((lang.loss_lower_bound(8) - want).abs() < 1e-12);
        assert!((lang.loss_lower_bound(1) - ln_v).abs() < 1e-12);
        let order1 = SyntheticLanguage::new(256, 1, 4, 0).unwrap();
        assert!((order1.loss_lower_bound(5) - h).abs() < 1e-12);
        let order0 = SyntheticLanguage::new(256, 0, 4, 0).unwrap();
        assert!((order0.loss_lower_bound(5) - h).abs() < 1e-12);
        let order5 = SyntheticLanguage::new(256, 5, 4, 0).unwrap();
        assert!((order5.loss_lower_bound(3) - ln_v).abs() < 1e-12);
        assert!((order5.loss_lower_bound(10) - (4.0 * ln_v + 6.0 * h) / 10.0).abs() < 1e-12);
        assert!(lang.loss_lower_bound(0).is_nan());
    }

    #[test]
    fn true_model_cross_entropy_matches_bound() {
        // The exact model's mean cross-entropy on samples approaches loss_lower_bound.
        let lang = SyntheticLanguage::new(64, 2, 4, 11).unwrap();
        let seq_len = 16;
        let w = lang.slot_weights();
        let (mut total, mut n) = (0.0, 0usize);
        for row in 0..4000 {
            let s = lang.sample(Split::Train, key(0, row), seq_len + 1).unwrap();
            for p in 1..=seq_len {
                total += if p < lang.order() {
                    (lang.vocab_size() as f64).ln()
                } else {
                    let succ = lang.successors(&s[p - 2..p]);
                    let slot = succ.iter().position(|&t| t == s[p]).unwrap();
                    -w[slot].ln()
                };
                n += 1;
            }
        }
        let mean = total / n as f64;
        let bound = lang.loss_lower_bound(seq_len);
        assert!((mean - bound).abs() < 0.02, "mean {mean} vs bound {bound}");
    }

    /// Plug-in estimate of H(next | previous `order` tokens) from one long stream.
    fn empirical_conditional_entropy(tokens: &[u32], order: usize) -> f64 {
        let mut counts: HashMap<&[u32], HashMap<u32, usize>> = HashMap::new();
        for w in tokens.windows(order + 1) {
            *counts
                .entry(&w[..order])
                .or_default()
                .entry(w[order])
                .or_default() += 1;
        }
        let total = (tokens.len() - order) as f64;
        let mut h = 0.0;
        for next in counts.values() {
            let n_ctx: usize = next.values().sum();
            for &c in next.values() {
                let p = c as f64 / n_ctx as f64;
                h -= (n_ctx as f64 / total) * p * p.ln();
            }
        }
        h
    }

    #[test]
    fn empirical_conditional_entropy_matches_entropy_rate() {
        for (v, order, k) in [(32, 1, 4), (16, 2, 4), (48, 1, 7)] {
            let lang = SyntheticLanguage::new(v, order, k, 2024).unwrap();
            let mut rng = rng_from_seed(77);
            let tokens = lang.generate(&mut rng, 400_000);
            let est = empirical_conditional_entropy(&tokens, order);
            let h = lang.entropy_rate_nats();
            assert!(
                (est - h).abs() < 0.01,
                "V={v} order={order} k={k}: empirical {est} vs H(w) {h}"
            );
            // Far below the unconditional entropy of a uniform stream.
            assert!(h < (v as f64).ln() - 1.0);
        }
    }

    #[test]
    fn invalid_parameters_are_rejected() {
        for (v, k) in [(0, 1), (10, 0), (10, 11)] {
            let err = SyntheticLanguage::new(v, 2, k, 0).unwrap_err();
            assert!(matches!(err, DataError::InvalidConfig(_)), "{err}");
        }
        let err = SyntheticLanguage::new(10, 2, 11, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("synthetic_branching"), "{err}");
    }
}
