//! How the process's memory allocator treats freed memory.
//!
//! A training step allocates and frees the same tensors every step. glibc's malloc, left to its
//! defaults, serves every block above a (self-adjusting) threshold with its own `mmap`, returns it
//! with `munmap` when freed, and gives the top of its heaps back to the kernel once more than
//! 128 KiB is free there: every step then maps the same memory again, one page fault per 4 KiB
//! page. Measured: about 17,000 minor page faults per step on the default job, and 1.1 million per
//! step (half of its CPU time in the kernel) on a 2-stage job with GPT-2's 50,257-token vocabulary,
//! whose embedding-sized tensors are above any threshold glibc allows.
//!
//! Two things keep freed memory for the next step instead:
//! * [`keep_freed_memory`] tunes glibc: blocks up to 32 MiB (the most glibc allows) come from its
//!   heaps, and the heaps are never trimmed;
//! * [`Allocator`], the binary's global allocator, keeps freed blocks above 32 MiB in free lists
//!   by size class (8 classes per power of two, so at most 12.5% is rounded up) and hands them
//!   out again, up to a cap on the bytes it holds ([`CACHE_ENV`], default 1/8 of the machine's
//!   memory); everything else goes to the system allocator as before.
//!
//! The process's resident memory is then its high-water mark, which a training process reaches
//! every step anyway. `SEQPIPE_MALLOC=default` turns both off (for comparisons).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Environment variable: the most bytes of freed large blocks one process keeps.
pub const CACHE_ENV: &str = "SEQPIPE_MALLOC_CACHE_BYTES";

/// Blocks above this many bytes are cached (glibc's heaps serve the ones below).
const LARGE: usize = 32 << 20;
/// Alignment of the cached blocks (whole pages); a layout that asks for more is not cached.
const ALIGN: usize = 4096;
/// Size classes: 8 per power of two from 2^25 to 2^48 bytes.
const SUB: usize = 8;
const MIN_LOG2: u32 = 25;
const MAX_LOG2: u32 = 48;
const CLASSES: usize = ((MAX_LOG2 - MIN_LOG2) as usize) * SUB;

/// The size class of a block of `size` bytes (`size` > [`LARGE`]): its index and the bytes it
/// holds; `None` beyond the largest class.
fn class_of(size: usize) -> Option<(usize, usize)> {
    let log2 = usize::BITS - 1 - size.leading_zeros();
    if !(MIN_LOG2..MAX_LOG2).contains(&log2) {
        return None;
    }
    let step = 1usize << (log2 - 3);
    let steps = size.div_ceil(step);
    // `size` has its top bit at `log2`, so it takes 8 to 16 steps of 2^(log2-3).
    // 16 steps is the next power of two's first class: the same index and bytes.
    Some((
        (log2 - MIN_LOG2) as usize * SUB + (steps - SUB),
        steps * step,
    ))
}

/// The free lists: per class, the head of a list threaded through the free blocks themselves
/// (the first word of a free block is the address of the next one), and the bytes they hold.
struct Lists {
    heads: [usize; CLASSES + 1],
    bytes: usize,
}

/// The global allocator (see the module comment).
pub struct Allocator {
    lists: Mutex<Lists>,
    /// The most bytes the free lists may hold; 0 until [`keep_freed_memory`] sets it.
    cap: AtomicUsize,
}

impl Allocator {
    /// An allocator that caches nothing until its cap is set.
    pub const fn new() -> Self {
        Self {
            lists: Mutex::new(Lists {
                heads: [0; CLASSES + 1],
                bytes: 0,
            }),
            cap: AtomicUsize::new(0),
        }
    }

    /// Starts keeping up to `cap` bytes of freed large blocks.
    pub fn set_cap(&self, cap: usize) {
        self.cap.store(cap, Ordering::Relaxed);
    }

    /// Bytes held in the free lists now.
    #[cfg(test)]
    fn cached_bytes(&self) -> usize {
        self.lists.lock().unwrap_or_else(|p| p.into_inner()).bytes
    }

    /// The class a layout is cached in, if it is.
    fn cached_class(layout: Layout) -> Option<(usize, usize)> {
        (layout.size() > LARGE && layout.align() <= ALIGN)
            .then(|| class_of(layout.size()))
            .flatten()
    }

    /// A block of class `(index, bytes)` from the free lists, if one is there.
    fn take(&self, (index, bytes): (usize, usize)) -> Option<*mut u8> {
        let mut lists = self.lists.lock().unwrap_or_else(|p| p.into_inner());
        let head = lists.heads[index];
        if head == 0 {
            return None;
        }
        // SAFETY: `head` is a free block of this class, at least a word long and page-aligned,
        // whose first word was written by `give`.
        lists.heads[index] = unsafe { *(head as *const usize) };
        lists.bytes -= bytes;
        Some(head as *mut u8)
    }

    /// Keeps the free block `ptr` of class `(index, bytes)` if the cap allows; whether it did.
    fn give(&self, ptr: *mut u8, (index, bytes): (usize, usize)) -> bool {
        let cap = self.cap.load(Ordering::Relaxed);
        let mut lists = self.lists.lock().unwrap_or_else(|p| p.into_inner());
        if lists.bytes + bytes > cap {
            return false;
        }
        // SAFETY: `ptr` is a block of `bytes` (> 32 MiB) bytes that its owner just freed.
        unsafe { *(ptr as *mut usize) = lists.heads[index] };
        lists.heads[index] = ptr as usize;
        lists.bytes += bytes;
        true
    }
}

impl Default for Allocator {
    fn default() -> Self {
        Self::new()
    }
}

/// The layout a cached class is allocated with from the system.
fn class_layout(bytes: usize) -> Layout {
    // SAFETY: ALIGN is a power of two and `bytes` a multiple of it far below isize::MAX.
    unsafe { Layout::from_size_align_unchecked(bytes, ALIGN) }
}

// SAFETY: blocks of cached classes are always allocated with their class's size and page
// alignment (which satisfies every layout mapped to that class) and freed the same way; every
// other layout goes to `System` unchanged.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match Self::cached_class(layout) {
            Some(class) => self
                .take(class)
                // SAFETY: a non-zero size.
                .unwrap_or_else(|| unsafe { System.alloc(class_layout(class.1)) }),
            // SAFETY: the caller's layout, as is.
            None => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match Self::cached_class(layout) {
            Some(class) => match self.take(class) {
                Some(ptr) => {
                    // SAFETY: the block holds at least `layout.size()` bytes.
                    unsafe { ptr.write_bytes(0, layout.size()) };
                    ptr
                }
                // SAFETY: a non-zero size; fresh memory from the system is zeroed for free.
                None => unsafe { System.alloc_zeroed(class_layout(class.1)) },
            },
            // SAFETY: the caller's layout, as is.
            None => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match Self::cached_class(layout) {
            Some(class) => {
                if !self.give(ptr, class) {
                    // SAFETY: allocated by `alloc` with this class's layout.
                    unsafe { System.dealloc(ptr, class_layout(class.1)) }
                }
            }
            // SAFETY: allocated by `System` with this layout.
            None => unsafe { System.dealloc(ptr, layout) },
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `layout.align()` is valid and the caller promises `new_size` does not overflow.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (Self::cached_class(layout), Self::cached_class(new_layout)) {
            // The block already holds the new size.
            (Some(old), Some(new)) if old == new => ptr,
            // SAFETY: both allocated and freed by `System` with these layouts.
            (None, None) => unsafe { System.realloc(ptr, layout, new_size) },
            _ => {
                // SAFETY: as `GlobalAlloc::realloc`'s default: a new block, the common prefix
                // copied, the old block freed.
                unsafe {
                    let new = self.alloc(new_layout);
                    if !new.is_null() {
                        std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                    new
                }
            }
        }
    }
}

/// Tunes glibc's malloc and sets [`Allocator`]'s cap (see the module comment); does nothing when
/// `SEQPIPE_MALLOC=default`. Call first thing in `main`, before the process starts threads.
pub fn keep_freed_memory(allocator: &Allocator) {
    if std::env::var_os("SEQPIPE_MALLOC").is_some_and(|v| v == "default") {
        return;
    }
    let cap = std::env::var(CACHE_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .or_else(|| trainer::memory::total_memory().map(|b| (b / 8) as usize))
        .unwrap_or(1 << 30);
    allocator.set_cap(cap);
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // glibc refuses mmap thresholds above HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit machines.
        const MMAP_THRESHOLD: libc::c_int = 32 << 20;
        // Never give the tops of the heaps back (the largest value mallopt takes).
        const TRIM_THRESHOLD: libc::c_int = libc::c_int::MAX;
        // Grow a heap by 64 MiB more than asked, so that growing is rare.
        const TOP_PAD: libc::c_int = 64 << 20;
        for (param, value) in [
            (libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (libc::M_TOP_PAD, TOP_PAD),
        ] {
            // SAFETY: mallopt only changes malloc's parameters; it returns 0 for a value it
            // refuses, which leaves that parameter as it was (a slower process, never a wrong one).
            unsafe {
                libc::mallopt(param, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_round_up_by_at_most_an_eighth_and_are_ordered() {
        let mut last = (0, 0);
        for size in [
            (32 << 20) + 1,
            36 << 20,
            (36 << 20) + 1,
            40 << 20,
            63 << 20,
            64 << 20,
            1 << 40,
        ] {
            let (index, bytes) = class_of(size).unwrap();
            assert!(bytes >= size && bytes - size <= size / 8, "{size}: {bytes}");
            assert!(index >= last.0 && bytes >= last.1, "{size}");
            assert_eq!(class_of(bytes), Some((index, bytes)), "a class's own size");
            last = (index, bytes);
        }
        assert_eq!(class_of(36 << 20).unwrap().1, 36 << 20);
        assert_eq!(class_of((36 << 20) + 1).unwrap().1, 40 << 20);
        assert!(class_of(1 << 48).is_none());
    }

    #[test]
    fn freed_large_blocks_come_back_up_to_the_cap() {
        let a = Allocator::new();
        let big = Layout::from_size_align(40 << 20, 64).unwrap();
        let small = Layout::from_size_align(1 << 20, 64).unwrap();
        // SAFETY: blocks are used within their layouts and freed once, with them.
        unsafe {
            // No cap yet: nothing is kept.
            let p = a.alloc(big);
            a.dealloc(p, big);
            assert_eq!(a.cached_bytes(), 0);
            a.set_cap(100 << 20);
            let p = a.alloc(big);
            p.write_bytes(7, big.size());
            a.dealloc(p, big);
            assert_eq!(a.cached_bytes(), 40 << 20);
            // The same block comes back, zeroed when asked.
            let q = a.alloc_zeroed(Layout::from_size_align(38 << 20, 8).unwrap());
            assert_eq!(q, p);
            assert_eq!(a.cached_bytes(), 0);
            assert!(
                std::slice::from_raw_parts(q, 38 << 20)
                    .iter()
                    .all(|&b| b == 0)
            );
            // Two fit under the cap, the third is given back.
            let r = a.alloc(big);
            let s = a.alloc(big);
            a.dealloc(q, big);
            a.dealloc(r, big);
            a.dealloc(s, big);
            assert_eq!(a.cached_bytes(), 80 << 20);
            // Small blocks are never cached; a realloc within the class keeps the block.
            let t = a.alloc(small);
            a.dealloc(t, small);
            assert_eq!(a.cached_bytes(), 80 << 20);
            let u = a.alloc(big);
            let v = a.realloc(u, big, 39 << 20);
            assert_eq!(u, v);
            let w = a.realloc(v, Layout::from_size_align(39 << 20, 64).unwrap(), 1 << 20);
            assert_eq!(a.cached_bytes(), 80 << 20);
            a.dealloc(w, small);
        }
    }
}
