//! Stable seed derivation for data sampling.
//!
//! Every random choice made by the data pipeline is drawn from a [`ChaCha8Rng`] whose seed is
//! derived here from plain integers with SplitMix64 mixing. Nothing in this module depends on
//! the Rust version, the platform, the number of pipeline stages or the process that asks:
//! the same integers always give the same stream. (std's `DefaultHasher` is deliberately not
//! used: its output is allowed to change between Rust releases.)
//!
//! Changing any constant or the mixing order here changes every sampled batch, which breaks
//! bit-exact resumption of runs started with an older build; the golden-value tests at the bottom
//! exist to catch that.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{SampleKey, Split};

/// The SplitMix64 increment (2^64 / golden ratio).
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Domain tag of per-row sample streams ("seqpipe" in ASCII).
const TAG_SAMPLE: u64 = 0x0073_6571_7069_7065;
/// Split tag of the training split ("train").
const TAG_TRAIN: u64 = 0x0074_7261_696E;
/// Split tag of the validation split ("val").
const TAG_VAL: u64 = 0x0076_616C;

/// The SplitMix64 output function applied to `state + GOLDEN_GAMMA`: a bijection of `u64`
/// with good avalanche. `splitmix64(0)` is the first output of a SplitMix64 generator seeded
/// with 0 (`0xE220A8397B1DCDAF`).
#[inline]
pub fn splitmix64(state: u64) -> u64 {
    let mut z = state.wrapping_add(GOLDEN_GAMMA);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hashes a sequence of integers into one `u64`.
///
/// `h = splitmix64(h ^ part)` for each part, starting from `splitmix64(len)`. Because each step
/// is a bijection of `h` for a fixed `part` (and of `part` for a fixed `h`), two sequences of the
/// same length that differ in exactly one position never collide.
#[inline]
pub fn mix(parts: &[u64]) -> u64 {
    let mut h = splitmix64(parts.len() as u64);
    for &p in parts {
        h = splitmix64(h ^ p);
    }
    h
}

/// Expands a 64-bit seed into a ChaCha8 generator (32-byte key = 4 successive SplitMix64
/// outputs, little-endian). This avoids `SeedableRng::seed_from_u64`, whose expansion is an
/// implementation detail of `rand_core`.
pub fn rng_from_seed(seed: u64) -> ChaCha8Rng {
    let mut bytes = [0u8; 32];
    let mut state = seed;
    for chunk in bytes.chunks_exact_mut(8) {
        chunk.copy_from_slice(&splitmix64(state).to_le_bytes());
        state = state.wrapping_add(GOLDEN_GAMMA);
    }
    ChaCha8Rng::from_seed(bytes)
}

/// The tag mixed into every stream of a split, so that Train and Val never share a stream.
pub fn split_tag(split: Split) -> u64 {
    match split {
        Split::Train => TAG_TRAIN,
        Split::Val => TAG_VAL,
    }
}

/// The seed of the random stream of one sample row: a hash of
/// `(domain tag, split, seed, step, micro_batch, row)` and nothing else.
pub fn sample_seed(split: Split, key: SampleKey) -> u64 {
    mix(&[
        TAG_SAMPLE,
        split_tag(split),
        key.seed,
        key.step,
        key.micro_batch,
        key.row,
    ])
}

/// The random generator of one sample row (see [`sample_seed`]).
pub fn sample_rng(split: Split, key: SampleKey) -> ChaCha8Rng {
    rng_from_seed(sample_seed(split, key))
}

/// A uniform integer in `[0, n)` (Lemire's multiply-and-reject method, unbiased).
///
/// Implemented here rather than with `rand`'s `random_range` so that the mapping from the
/// generator's output to integers is fixed by this crate, not by a dependency's version.
///
/// # Panics
/// If `n == 0`.
#[inline]
pub fn uniform_below(rng: &mut impl RngCore, n: u64) -> u64 {
    assert!(n > 0, "uniform_below: empty range");
    let threshold = n.wrapping_neg() % n; // (2^64 - n) mod n
    loop {
        let m = u128::from(rng.next_u64()) * u128::from(n);
        if (m as u64) >= threshold {
            return (m >> 64) as u64;
        }
    }
}

/// A uniform `f64` in `[0, 1)` with 53 random bits.
#[inline]
pub fn unit_f64(rng: &mut impl RngCore) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_reference_generator() {
        // Reference SplitMix64 (Steele, Lea, Flood 2014) seeded with 0: first two outputs.
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(GOLDEN_GAMMA), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn mix_is_order_and_length_sensitive() {
        assert_ne!(mix(&[1, 2]), mix(&[2, 1]));
        assert_ne!(mix(&[0]), mix(&[0, 0]));
        assert_ne!(mix(&[]), mix(&[0]));
        assert_eq!(mix(&[7, 8, 9]), mix(&[7, 8, 9]));
    }

    #[test]
    fn uniform_below_stays_in_range_and_covers_it() {
        let mut rng = rng_from_seed(5);
        let mut seen = [false; 7];
        for _ in 0..1000 {
            let x = uniform_below(&mut rng, 7);
            assert!(x < 7);
            seen[x as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(uniform_below(&mut rng, 1), 0);
    }

    #[test]
    fn unit_f64_in_unit_interval() {
        let mut rng = rng_from_seed(9);
        for _ in 0..1000 {
            let u = unit_f64(&mut rng);
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn sample_seed_separates_splits_and_fields() {
        let k = SampleKey {
            seed: 1,
            step: 2,
            micro_batch: 3,
            row: 4,
        };
        let base = sample_seed(Split::Train, k);
        assert_ne!(base, sample_seed(Split::Val, k));
        assert_ne!(base, sample_seed(Split::Train, SampleKey { seed: 2, ..k }));
        assert_ne!(base, sample_seed(Split::Train, SampleKey { step: 3, ..k }));
        assert_ne!(
            base,
            sample_seed(
                Split::Train,
                SampleKey {
                    micro_batch: 4,
                    ..k
                }
            )
        );
        assert_ne!(base, sample_seed(Split::Train, SampleKey { row: 5, ..k }));
        // Fields are not interchangeable.
        let swapped = SampleKey {
            step: 3,
            micro_batch: 2,
            ..k
        };
        assert_ne!(base, sample_seed(Split::Train, swapped));
    }
}
