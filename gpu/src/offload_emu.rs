//! The `emulate` feature's stand-in for `offload`: the same API, copying at once (the emulated
//! device is synchronous), so the stage's snapshot path runs unchanged. Copies go through host
//! staging buffers from the same pool policy as the pinned ones ([`crate::staging`]), so the
//! tests can count what a step allocates.

use std::sync::Arc;

use crate::device::{Buf, Gpu};
use crate::error::{Result, shape};
use crate::staging::SetPool;

/// Host staging buffers (plain vectors standing for pinned memory).
#[derive(Default)]
pub struct StagingPool(SetPool<Vec<f32>>);

impl StagingPool {
    /// Allocates now `sets` sets of buffers of lengths `lens` (those not already free).
    pub fn reserve(&self, _gpu: &Gpu, lens: &[usize], sets: usize) -> Result<()> {
        self.0.reserve(lens, sets, |n| Ok(vec![0.0; n]))
    }

    /// Staging buffers allocated so far.
    pub fn allocations(&self) -> usize {
        self.0.allocations()
    }
}

/// Always passed.
#[derive(Clone)]
pub struct Fence;

/// A finished download.
pub struct Download {
    values: Vec<Vec<f32>>,
}

impl Download {
    /// The host values, one vector per source buffer.
    pub fn wait(self) -> Result<Vec<Vec<f32>>> {
        Ok(self.values)
    }
}

impl Gpu {
    /// Copies `sources` to the host now.
    pub fn begin_download(
        &self,
        sources: &[&Buf<f32>],
        pool: &Arc<StagingPool>,
    ) -> Result<(Download, Fence)> {
        if sources.is_empty() {
            return shape("begin_download", "nothing to download");
        }
        let lens: Vec<usize> = sources.iter().map(|b| b.len()).collect();
        let mut staged = pool.0.take(&lens, |n| Ok(vec![0.0; n]))?;
        for (src, dst) in sources.iter().zip(staged.iter_mut()) {
            let host = self.download(src)?;
            dst[..host.len()].copy_from_slice(&host);
        }
        let values = staged
            .iter()
            .zip(&lens)
            .map(|(s, &n)| s[..n].to_vec())
            .collect();
        pool.0.give_back(staged);
        Ok((Download { values }, Fence))
    }

    /// Nothing to drain.
    pub fn drain_copies(&self) -> Result<()> {
        Ok(())
    }

    /// Nothing to wait for.
    pub fn wait_for(&self, _fence: &Fence) -> Result<()> {
        Ok(())
    }
}
