//! The `emulate` feature's stand-in for `offload`: the same API, copying at once (the emulated
//! device is synchronous), so the stage's snapshot path runs unchanged.

use std::sync::Arc;

use crate::device::{Buf, Gpu};
use crate::error::{Result, shape};

/// Nothing to pool: copies are plain vectors.
#[derive(Default)]
pub struct StagingPool;

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
        _pool: &Arc<StagingPool>,
    ) -> Result<(Download, Fence)> {
        if sources.is_empty() {
            return shape("begin_download", "nothing to download");
        }
        let values = sources
            .iter()
            .map(|b| self.download(b))
            .collect::<Result<_>>()?;
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
