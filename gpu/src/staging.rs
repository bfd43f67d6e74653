//! The pool of host staging buffers that state copies to the host go through (`offload`: pinned
//! memory; its emulation: plain vectors), kept apart from the copies so that both share one
//! policy and its allocation counter.
//!
//! Allocating page-locked memory (`cuMemHostAlloc`) is slow and, with NCCL links, can stall behind
//! a pending NCCL transfer; so a stage with NCCL links reserves what a step's state copies need
//! when it joins them ([`SetPool::reserve`]), and from then on a step takes its buffers from the
//! pool. [`SetPool::allocations`] counts every buffer ever allocated, for the tests that check this.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::Result;

/// Sets kept for reuse: a checkpoint and a peer snapshot of different steps may be in flight at
/// once; more sets are freed when given back.
pub(crate) const KEPT_SETS: usize = 2;

/// A buffer with a length.
pub(crate) trait Staged {
    /// Elements it holds.
    fn len(&self) -> usize;
}

impl Staged for Vec<f32> {
    fn len(&self) -> usize {
        Vec::len(self)
    }
}

/// Sets of buffers, reused for downloads of the same sizes.
pub(crate) struct SetPool<B> {
    free: Mutex<Vec<Vec<B>>>,
    allocations: AtomicUsize,
}

impl<B> Default for SetPool<B> {
    fn default() -> Self {
        SetPool {
            free: Mutex::new(Vec::new()),
            allocations: AtomicUsize::new(0),
        }
    }
}

/// Whether `set` can stage a download of buffers of `lens` elements: its first `lens.len()`
/// buffers have exactly those lengths (a set reserved for parameters and both moments also
/// serves a download of the parameters alone).
fn serves<B: Staged>(set: &[B], lens: &[usize]) -> bool {
    set.len() >= lens.len() && set.iter().zip(lens).all(|(b, &n)| b.len() == n.max(1))
}

impl<B: Staged> SetPool<B> {
    /// A set for buffers of `lens` elements: a free one (one of exactly that shape first), or one
    /// newly allocated by `alloc` (called with each length, at least 1).
    pub(crate) fn take(
        &self,
        lens: &[usize],
        alloc: impl FnMut(usize) -> Result<B>,
    ) -> Result<Vec<B>> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let exact = free
            .iter()
            .position(|s| s.len() == lens.len() && serves(s, lens));
        if let Some(i) = exact.or_else(|| free.iter().position(|s| serves(s, lens))) {
            return Ok(free.swap_remove(i));
        }
        drop(free);
        self.allocate(lens, alloc)
    }

    fn allocate(
        &self,
        lens: &[usize],
        mut alloc: impl FnMut(usize) -> Result<B>,
    ) -> Result<Vec<B>> {
        lens.iter()
            .map(|&n| {
                self.allocations.fetch_add(1, Ordering::Relaxed);
                alloc(n.max(1))
            })
            .collect()
    }

    /// Returns a set for reuse (at most [`KEPT_SETS`] are kept; more are freed).
    pub(crate) fn give_back(&self, set: Vec<B>) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < KEPT_SETS {
            free.push(set);
        }
    }

    /// Makes sure `sets` (at most [`KEPT_SETS`]) free sets can stage buffers of `lens` elements,
    /// allocating the missing ones now.
    pub(crate) fn reserve(
        &self,
        lens: &[usize],
        sets: usize,
        mut alloc: impl FnMut(usize) -> Result<B>,
    ) -> Result<()> {
        let have = {
            let free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            free.iter().filter(|s| serves(s, lens)).count()
        };
        for _ in have..sets.min(KEPT_SETS) {
            let set = self.allocate(lens, &mut alloc)?;
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            if free.len() >= KEPT_SETS {
                // Full of sets of other shapes: replace one, which no step needs any more.
                free.swap_remove(0);
            }
            free.push(set);
        }
        Ok(())
    }

    /// Buffers allocated so far.
    pub(crate) fn allocations(&self) -> usize {
        self.allocations.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    #[test]
    fn a_reserved_set_serves_later_downloads_without_allocating() {
        let pool = SetPool::<Vec<f32>>::default();
        pool.reserve(&[10, 10, 10], 2, alloc).unwrap();
        assert_eq!(pool.allocations(), 6);
        // Reserving again allocates nothing.
        pool.reserve(&[10, 10, 10], 2, alloc).unwrap();
        assert_eq!(pool.allocations(), 6);
        // Two downloads in flight at once (parameters alone; parameters and moments).
        let a = pool.take(&[10], alloc).unwrap();
        let b = pool.take(&[10, 10, 10], alloc).unwrap();
        assert_eq!(pool.allocations(), 6);
        pool.give_back(a);
        pool.give_back(b);
        let c = pool.take(&[10, 10, 10], alloc).unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(pool.allocations(), 6);
        // Another shape is allocated.
        let d = pool.take(&[7], alloc).unwrap();
        assert_eq!(pool.allocations(), 7);
        pool.give_back(c);
        pool.give_back(d);
    }
}
