//! A fixed summation tree over a step's micro-batches, so that a sum of floating-point values
//! (gradients) is bit-identical however the micro-batches are spread over data-parallel replicas.
//!
//! Floating-point addition is not associative: summing m per-micro-batch gradients left to right
//! gives another result than summing two halves and adding them. To make the reduced gradient
//! independent of the data-parallel degree d, every sum over micro-batches follows ONE canonical
//! binary tree over the global micro-batch indices `[0, m)`; each replica's contiguous chunk of
//! micro-batches is a node (a subtree) of it, and the replicas' partial sums are combined by the
//! upper part of the same tree.
//!
//! The canonical tree: a node `[lo, hi)` with `n = hi − lo > 1` splits at `lo + n/2` when `n` is a
//! power of two, else at `hi − lowbit(n)`. So the root is a left fold of power-of-two blocks,
//! largest first (m = 7: `((B[0,4) + B[4,6)) + B[6,7))`), and power-of-two blocks are balanced.
//! The shape of a node's subtree depends only on its size, so the subtree of a chunk of c
//! micro-batches is the canonical tree over c leaves, shifted.
//!
//! [`SumTree`] evaluates the tree in streaming fashion (nodes pushed in index order, siblings
//! merged as soon as both are known), holding at most `⌊log2 m⌋ + 1` partial sums.

use std::fmt;

/// Where the canonical tree splits the node `[lo, hi)` (which must have at least two leaves).
fn split(lo: usize, hi: usize) -> usize {
    let n = hi - lo;
    debug_assert!(n > 1);
    if n.is_power_of_two() {
        lo + n / 2
    } else {
        hi - (n & n.wrapping_neg())
    }
}

/// Whether `[lo, hi)` is a node of the canonical tree over `leaves` leaves (found by descending
/// from the root `[0, leaves)`). Leaves are the single indices `[i, i + 1)`.
pub fn is_node(leaves: usize, lo: usize, hi: usize) -> bool {
    if lo >= hi || hi > leaves {
        return false;
    }
    let (mut a, mut b) = (0, leaves);
    loop {
        if (a, b) == (lo, hi) {
            return true;
        }
        if b - a <= 1 {
            return false;
        }
        let s = split(a, b);
        if hi <= s {
            b = s;
        } else if lo >= s {
            a = s;
        } else {
            return false;
        }
    }
}

/// Whether `d` data-parallel replicas can share a step of `micro_batches` micro-batches: `d ≥ 1`,
/// `d` divides m, and every replica's chunk `[r·c, (r+1)·c)`, `c = m/d`, is a node of the
/// canonical tree (so each replica's partial sum is a subtree of the one tree).
///
/// Equivalently: d = 1, or c is a power of two dividing m. For m a power of two that is every
/// power-of-two d ≤ m; for m = 6 it is d ∈ {1, 3, 6} (not 2: `[0, 3)` is not a node, the root
/// splits `[0, 6)` into `[0, 4)` and `[4, 6)`); for m = 12, d ∈ {1, 3, 6, 12}.
pub fn valid_replicas(micro_batches: usize, d: usize) -> bool {
    let m = micro_batches;
    if d == 0 || m == 0 || !m.is_multiple_of(d) {
        return false;
    }
    let c = m / d;
    (0..d).all(|r| is_node(m, r * c, (r + 1) * c))
}

/// A push or finish that does not follow the tree.
#[derive(Debug, PartialEq, Eq)]
pub enum SumTreeError<E> {
    /// `[lo, hi)` is not a node of the canonical tree over `leaves` leaves.
    NotANode {
        /// First leaf of the push.
        lo: usize,
        /// One past its last leaf.
        hi: usize,
        /// Leaves of the tree.
        leaves: usize,
    },
    /// A push that does not start where the previous one ended.
    OutOfOrder {
        /// First leaf of the push.
        lo: usize,
        /// The leaf the next push must start at.
        expected: usize,
    },
    /// `finish` before every leaf was pushed (or a tree of no leaves).
    Incomplete {
        /// Leaves pushed so far (`[0, pushed)`).
        pushed: usize,
        /// Leaves of the tree.
        leaves: usize,
    },
    /// More than one partial sum left after every leaf was pushed (a bug in [`SumTree`]).
    Unmerged {
        /// Partial sums left.
        entries: usize,
    },
    /// The caller's addition failed.
    Add(E),
}

impl<E: fmt::Display> fmt::Display for SumTreeError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotANode { lo, hi, leaves } => write!(
                f,
                "[{lo}, {hi}) is not a node of the summation tree over {leaves} leaves; push single \
                 leaves, or only chunks that `valid_replicas` admits"
            ),
            Self::OutOfOrder { lo, expected } => write!(
                f,
                "push of [{lo}, …) out of order: the next push must start at leaf {expected} \
                 (push nodes in increasing, contiguous order)"
            ),
            Self::Incomplete { pushed, leaves } => write!(
                f,
                "summation tree finished after {pushed} of {leaves} leaves; push every leaf first"
            ),
            Self::Unmerged { entries } => write!(
                f,
                "summation tree left {entries} partial sums after every leaf was pushed (a bug)"
            ),
            Self::Add(e) => write!(f, "adding two partial sums failed: {e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for SumTreeError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Add(e) => Some(e),
            _ => None,
        }
    }
}

/// Streaming evaluation of the canonical summation tree over `leaves` leaves.
///
/// Push nodes (single leaves, or whole subtrees such as a replica's partial sum) in increasing,
/// contiguous index order; whenever the two newest partial sums are siblings they are merged as
/// `add(left, right)`, the left operand always covering the lower indices. The result depends
/// only on the leaf values, never on which nodes they were pushed as.
#[derive(Debug)]
pub struct SumTree<T> {
    leaves: usize,
    /// Partial sums of complete nodes `(lo, hi, value)`, in index order.
    stack: Vec<(usize, usize, T)>,
    /// Leaves `[0, next)` have been pushed.
    next: usize,
    max_depth: usize,
}

impl<T> SumTree<T> {
    /// An empty tree over `leaves` leaves.
    pub fn new(leaves: usize) -> Self {
        Self {
            leaves,
            stack: Vec::new(),
            next: 0,
            max_depth: 0,
        }
    }

    /// Number of leaves of the tree.
    pub fn leaves(&self) -> usize {
        self.leaves
    }

    /// Leaves pushed so far (`[0, pushed)`).
    pub fn pushed(&self) -> usize {
        self.next
    }

    /// Partial sums held now.
    pub fn depth(&self) -> usize {
        self.stack.len()
    }

    /// The most partial sums held at once so far, counting a pushed value before it is merged;
    /// at most `⌊log2 leaves⌋ + 1`.
    pub fn max_depth(&self) -> usize {
        self.max_depth
    }

    /// Pushes the sum `value` of the node `[lo, hi)`, then merges siblings. Errors (and drops
    /// `value`, leaving the tree as it was) when `[lo, hi)` is not a node or does not start where
    /// the previous push ended. After an [`SumTreeError::Add`] the tree has lost the two operands
    /// and must be dropped.
    pub fn push<E>(
        &mut self,
        lo: usize,
        hi: usize,
        value: T,
        add: &mut impl FnMut(T, T) -> Result<T, E>,
    ) -> Result<(), SumTreeError<E>> {
        if !is_node(self.leaves, lo, hi) {
            return Err(SumTreeError::NotANode {
                lo,
                hi,
                leaves: self.leaves,
            });
        }
        if lo != self.next {
            return Err(SumTreeError::OutOfOrder {
                lo,
                expected: self.next,
            });
        }
        self.next = hi;
        self.stack.push((lo, hi, value));
        self.max_depth = self.max_depth.max(self.stack.len());
        while let [.., (l_lo, l_hi, _), (_, r_hi, _)] = self.stack[..] {
            let siblings =
                r_hi - l_lo > 1 && split(l_lo, r_hi) == l_hi && is_node(self.leaves, l_lo, r_hi);
            if !siblings {
                break;
            }
            let (_, _, right) = self.stack.pop().expect("two entries");
            let (lo, _, left) = self.stack.pop().expect("two entries");
            let sum = add(left, right).map_err(SumTreeError::Add)?;
            self.stack.push((lo, r_hi, sum));
        }
        Ok(())
    }

    /// The sum over every leaf. Errors when a leaf was not pushed (or the tree has none). Pushes
    /// merge every pair of siblings as soon as both exist, so nothing is left to add here: after
    /// every leaf one partial sum remains, the root's (anything else is a bug, reported as
    /// [`SumTreeError::Unmerged`]). Generic over `E` only to share the caller's error type.
    pub fn finish<E>(self) -> Result<T, SumTreeError<E>> {
        if self.leaves == 0 || self.next != self.leaves {
            return Err(SumTreeError::Incomplete {
                pushed: self.next,
                leaves: self.leaves,
            });
        }
        let entries = self.stack.len();
        let mut stack = self.stack;
        match (stack.pop(), entries) {
            (Some((_, _, total)), 1) => Ok(total),
            _ => Err(SumTreeError::Unmerged { entries }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;

    fn add(a: f32, b: f32) -> Result<f32, Infallible> {
        Ok(a + b)
    }

    /// Values of wildly different magnitudes, signs and mantissas: the order of additions shows.
    fn values(m: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..m)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let mantissa = 1.0 + (x % 1_000_003) as f32 / 1_000_003.0;
                let exponent = ((x >> 20) % 40) as i32 - 20;
                let sign = if (x >> 40) & 1 == 0 { 1.0 } else { -1.0 };
                sign * mantissa * 2f32.powi(exponent)
            })
            .collect()
    }

    /// The tree over `v`, leaves pushed one by one.
    fn by_leaves(v: &[f32]) -> (f32, usize) {
        let mut t = SumTree::new(v.len());
        for (i, &x) in v.iter().enumerate() {
            t.push(i, i + 1, x, &mut add).unwrap();
        }
        let depth = t.max_depth();
        (t.finish::<Infallible>().unwrap(), depth)
    }

    /// The tree over `v` evaluated as d replicas' chunk sums combined in the tree over m.
    fn by_replicas(v: &[f32], d: usize) -> f32 {
        let m = v.len();
        let c = m / d;
        let mut top = SumTree::new(m);
        for r in 0..d {
            let (chunk, _) = by_leaves(&v[r * c..(r + 1) * c]);
            top.push(r * c, (r + 1) * c, chunk, &mut add).unwrap();
        }
        top.finish::<Infallible>().unwrap()
    }

    /// The tree evaluated recursively from its definition.
    fn recursive(v: &[f32], lo: usize, hi: usize) -> f32 {
        if hi - lo == 1 {
            return v[lo];
        }
        let s = split(lo, hi);
        recursive(v, lo, s) + recursive(v, s, hi)
    }

    #[test]
    fn the_tree_is_a_left_fold_of_power_of_two_blocks() {
        // m = 7: ((B[0,4) + B[4,6)) + B[6,7)).
        for (lo, hi) in [
            (0, 7),
            (0, 6),
            (0, 4),
            (4, 6),
            (6, 7),
            (0, 2),
            (2, 4),
            (4, 5),
        ] {
            assert!(is_node(7, lo, hi), "[{lo}, {hi})");
        }
        for (lo, hi) in [
            (4, 7),
            (0, 3),
            (1, 3),
            (3, 5),
            (0, 5),
            (0, 8),
            (2, 2),
            (3, 2),
        ] {
            assert!(!is_node(7, lo, hi), "[{lo}, {hi})");
        }
        assert_eq!(split(0, 7), 6);
        assert_eq!(split(0, 6), 4);
        assert_eq!(split(0, 8), 4);
        assert!(!is_node(0, 0, 1));
    }

    #[test]
    fn valid_replica_counts() {
        let valid =
            |m: usize| -> Vec<usize> { (0..=m + 1).filter(|&d| valid_replicas(m, d)).collect() };
        assert_eq!(valid(8), [1, 2, 4, 8]);
        assert_eq!(valid(6), [1, 3, 6]);
        assert_eq!(valid(7), [1, 7]);
        assert_eq!(valid(12), [1, 3, 6, 12]);
        assert_eq!(valid(1), [1]);
        assert!(valid(0).is_empty());
        // The characterization in the doc comment.
        for m in 1..=64usize {
            for d in 1..=m {
                let c = m / d;
                let rule = m.is_multiple_of(d) && (d == 1 || c.is_power_of_two());
                assert_eq!(valid_replicas(m, d), rule, "m={m} d={d}");
            }
        }
    }

    #[test]
    fn a_chunk_subtree_is_the_canonical_tree_over_its_size() {
        for m in 1..=33 {
            for d in (1..=m).filter(|&d| valid_replicas(m, d)) {
                let c = m / d;
                for r in 0..d {
                    let base = r * c;
                    for lo in 0..c {
                        for hi in lo + 1..=c {
                            assert_eq!(
                                is_node(m, base + lo, base + hi),
                                is_node(c, lo, hi),
                                "m={m} d={d} r={r} [{lo}, {hi})"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn any_valid_replica_count_gives_bit_identical_sums() {
        let mut checked = 0;
        for m in 1..=33 {
            for seed in 0..5 {
                let v = values(m, seed + 100 * m as u64);
                let (whole, depth) = by_leaves(&v);
                assert_eq!(whole.to_bits(), recursive(&v, 0, m).to_bits(), "m={m}");
                assert!(depth <= m.ilog2() as usize + 1, "m={m}: depth {depth}");
                for d in (1..=m).filter(|&d| valid_replicas(m, d)) {
                    let split = by_replicas(&v, d);
                    assert_eq!(
                        split.to_bits(),
                        whole.to_bits(),
                        "m={m} d={d}: {split} vs {whole}"
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked > 300, "{checked}");
    }

    #[test]
    fn the_depth_bound_is_reached() {
        for k in 0..6 {
            let m = 1usize << k;
            let (_, depth) = by_leaves(&values(m, 3));
            assert_eq!(depth, k + 1, "m={m}");
        }
    }

    #[test]
    fn a_left_to_right_sum_differs_so_the_order_is_tested() {
        let differs = (1..=33).any(|m| {
            (0..5).any(|seed| {
                let v = values(m, seed + 100 * m as u64);
                let naive = v.iter().fold(0.0f32, |a, &x| a + x);
                naive.to_bits() != by_leaves(&v).0.to_bits()
            })
        });
        assert!(differs);
        // A small case by hand: the tree adds the pairs first and loses both 1s, the left fold
        // keeps the last one.
        let v = [1e8f32, 1.0, -1e8, 1.0];
        assert_eq!(by_leaves(&v).0, 0.0);
        assert_eq!(v.iter().fold(0.0f32, |a, &x| a + x), 1.0);
    }

    #[test]
    fn bad_pushes_are_errors_and_leave_the_tree_as_it_was() {
        let mut t = SumTree::new(6);
        assert_eq!(
            t.push(0, 3, 1.0, &mut add),
            Err(SumTreeError::NotANode {
                lo: 0,
                hi: 3,
                leaves: 6
            })
        );
        assert_eq!(
            t.push(0, 7, 1.0, &mut add),
            Err(SumTreeError::NotANode {
                lo: 0,
                hi: 7,
                leaves: 6
            })
        );
        assert_eq!(
            t.push(2, 4, 1.0, &mut add),
            Err(SumTreeError::OutOfOrder { lo: 2, expected: 0 })
        );
        t.push(0, 2, 1.0, &mut add).unwrap();
        assert_eq!(
            t.push(0, 2, 1.0, &mut add),
            Err(SumTreeError::OutOfOrder { lo: 0, expected: 2 })
        );
        assert_eq!(
            t.push(3, 4, 1.0, &mut add),
            Err(SumTreeError::OutOfOrder { lo: 3, expected: 2 })
        );
        t.push(2, 3, 2.0, &mut add).unwrap();
        t.push(3, 4, 3.0, &mut add).unwrap();
        assert_eq!(t.depth(), 1);
        let mut partial = SumTree::new(6);
        partial.push(0, 4, 6.0, &mut add).unwrap();
        assert_eq!(
            partial.finish::<Infallible>(),
            Err(SumTreeError::Incomplete {
                pushed: 4,
                leaves: 6
            })
        );
        t.push(4, 6, 4.0, &mut add).unwrap();
        assert_eq!(t.finish::<Infallible>(), Ok(10.0));
        assert!(SumTree::<f32>::new(0).finish::<Infallible>().is_err());
        // A failing addition is reported as such.
        let mut t = SumTree::new(2);
        let mut fail = |_: f32, _: f32| Err("no");
        t.push(0, 1, 1.0, &mut fail).unwrap();
        assert_eq!(t.push(1, 2, 1.0, &mut fail), Err(SumTreeError::Add("no")));
        let msg = SumTreeError::<Infallible>::NotANode {
            lo: 0,
            hi: 3,
            leaves: 6,
        }
        .to_string();
        assert!(msg.contains("[0, 3) is not a node"), "{msg}");
    }
}
