//! Copies of device buffers to the host that run behind the compute: the copy stream starts once
//! the compute queued so far is done, writes into page-locked (pinned) host buffers, and signals an
//! event. The thread that queued the copy returns at once; a consumer on another thread (the
//! checkpoint uploader, the peer-snapshot sender) waits for the event and reads the values.
//!
//! The compute stream may go on reading the copied buffers; before it *writes* one (the next
//! optimizer step, a restore) it must wait for the copy's [`Fence`], on the device, which costs the
//! host nothing. Pinned buffers are reused through a [`StagingPool`]: allocating gigabytes of
//! page-locked memory takes longer than the copy itself (and can stall behind a pending NCCL
//! transfer, so a stage with NCCL links reserves them up front).

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, PinnedHostSlice};

use crate::device::{Buf, Gpu};
use crate::error::{DriverContext, Result, shape};
use crate::staging::{SetPool, Staged};

/// Pinned host buffers kept for the next download of the same sizes (see [`crate::staging`]).
#[derive(Default)]
pub struct StagingPool(SetPool<PinnedHostSlice<f32>>);

impl Staged for PinnedHostSlice<f32> {
    fn len(&self) -> usize {
        PinnedHostSlice::len(self)
    }
}

/// Allocates a pinned buffer of `n` elements.
fn pinned(gpu: &Gpu, n: usize) -> Result<PinnedHostSlice<f32>> {
    // SAFETY: the buffer is written by the copy before anything reads it. No write-combining (the
    // default of `alloc_pinned`): the host reads these buffers, and reads of write-combined memory
    // are uncached and many times slower.
    unsafe { gpu.ctx().alloc_pinned_with_flags::<f32>(n, 0) }
        .during(|| format!("allocating {n} pinned host elements"))
}

impl StagingPool {
    /// A set of pinned buffers of lengths `lens`: a free one, or newly allocated.
    fn take(&self, gpu: &Gpu, lens: &[usize]) -> Result<Vec<PinnedHostSlice<f32>>> {
        self.0.take(lens, |n| pinned(gpu, n))
    }

    /// Returns a set for reuse.
    fn give_back(&self, set: Vec<PinnedHostSlice<f32>>) {
        self.0.give_back(set)
    }

    /// Allocates now `sets` sets of pinned buffers of lengths `lens` (those not already free),
    /// so that later downloads of those sizes allocate nothing.
    pub fn reserve(&self, gpu: &Gpu, lens: &[usize], sets: usize) -> Result<()> {
        gpu.bind()?;
        self.0.reserve(lens, sets, |n| pinned(gpu, n))
    }

    /// Pinned buffers allocated so far.
    pub fn allocations(&self) -> usize {
        self.0.allocations()
    }
}

/// The point on the copy stream after which the copied buffers may be overwritten.
#[derive(Clone)]
pub struct Fence(Arc<CudaEvent>);

/// A download in flight: wait for it, on any thread, with [`Download::wait`].
pub struct Download {
    pinned: Option<Vec<PinnedHostSlice<f32>>>,
    lens: Vec<usize>,
    done: Arc<CudaEvent>,
    pool: Arc<StagingPool>,
}

impl Download {
    /// Blocks (sleeping, not spinning) until the copy is done, then returns the host values, one
    /// vector per source buffer, and gives the pinned buffers back to the pool.
    pub fn wait(mut self) -> Result<Vec<Vec<f32>>> {
        self.done
            .synchronize()
            .during(|| "waiting for a copy to the host".into())?;
        let pinned = self.pinned.take().unwrap_or_default();
        let values = pinned
            .iter()
            .zip(&self.lens)
            .map(|(p, &n)| {
                p.as_slice()
                    .map(|s| s[..n].to_vec())
                    .during(|| "reading a pinned buffer".into())
            })
            .collect::<Result<Vec<_>>>();
        self.pool.give_back(pinned);
        values
    }
}

impl Drop for Download {
    fn drop(&mut self) {
        // Not waited for: the copy may still be writing the pinned buffers, which must not be
        // freed or reused before it is done.
        if let Some(pinned) = self.pinned.take() {
            if self.done.synchronize().is_ok() {
                self.pool.give_back(pinned);
            } else {
                // The copy's fate is unknown: leak the buffers rather than free memory a DMA
                // engine might still write.
                std::mem::forget(pinned);
            }
        }
    }
}

impl Gpu {
    /// Starts copying `sources` (whole) to the host on the copy stream, after all the compute
    /// queued so far. Returns the download and the fence the compute stream must wait for
    /// ([`Gpu::wait_for`]) before it overwrites any of `sources`.
    pub fn begin_download(
        &self,
        sources: &[&Buf<f32>],
        pool: &Arc<StagingPool>,
    ) -> Result<(Download, Fence)> {
        if sources.is_empty() {
            return shape("begin_download", "nothing to download");
        }
        self.bind()?;
        let lens: Vec<usize> = sources.iter().map(|b| b.len()).collect();
        let mut pinned = pool.take(self, &lens)?;
        let done = match self.queue_download(sources, &mut pinned) {
            Ok(done) => Arc::new(done),
            Err(e) => {
                // Copies queued before the failure may still be writing `pinned`, and dropping a
                // pinned buffer does not wait for them (its own event is never recorded with
                // event tracking off): drain the copy stream first, or leak the buffers.
                if self.copy_stream().synchronize().is_ok() {
                    pool.give_back(pinned);
                } else {
                    std::mem::forget(pinned);
                }
                return Err(e);
            }
        };
        Ok((
            Download {
                pinned: Some(pinned),
                lens,
                done: Arc::clone(&done),
                pool: Arc::clone(pool),
            },
            Fence(done),
        ))
    }

    /// Queues the copies of `sources` into `pinned` on the copy stream, after all the compute
    /// queued so far, and returns the event that marks their end.
    fn queue_download(
        &self,
        sources: &[&Buf<f32>],
        pinned: &mut [PinnedHostSlice<f32>],
    ) -> Result<CudaEvent> {
        let copies = self.copy_stream();
        let queued = self
            .stream()
            .record_event(None)
            .during(|| "marking the compute queued so far".into())?;
        copies
            .wait(&queued)
            .during(|| "ordering the copy after the compute".into())?;
        for (src, dst) in sources.iter().zip(pinned.iter_mut()) {
            copies
                .memcpy_dtoh(&src.slice, dst)
                .during(|| format!("queueing a copy of {} elements to the host", src.len()))?;
        }
        // Blocking sync: a consumer waiting for a long copy sleeps instead of spinning a core.
        copies
            .record_event(Some(CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .during(|| "marking the end of a copy".into())
    }

    /// Waits on the host until every copy queued so far is done (when the compute stream cannot
    /// be ordered after them).
    pub fn drain_copies(&self) -> Result<()> {
        self.copy_stream()
            .synchronize()
            .during(|| "waiting for the copies to the host".into())
    }

    /// Makes the compute stream wait (on the device; the host goes on) until `fence` is passed.
    pub fn wait_for(&self, fence: &Fence) -> Result<()> {
        self.bind()?;
        self.stream()
            .wait(&fence.0)
            .during(|| "ordering the compute after a copy to the host".into())
    }
}
