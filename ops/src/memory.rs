//! Bytes held by saved tensors: what a layer keeps between its forward and its backward.
//!
//! Contexts share buffers (a K/V prefix is a view of the QKV projection's output; a linear
//! layer's saved input is the previous layer's output), so bytes are counted once per storage,
//! never once per tensor.

use std::collections::HashMap;

use candle_core::{Storage, Tensor};

/// A value that keeps tensors alive (a saved context of a kernel, a cache).
pub trait SavedTensors {
    /// Calls `f` with every activation tensor this value holds (parameters it refers to are
    /// the model's, not the context's, and are left out).
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor));
}

impl SavedTensors for Tensor {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        f(self)
    }
}

impl<T: SavedTensors> SavedTensors for Option<T> {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        if let Some(t) = self {
            t.for_each_tensor(f)
        }
    }
}

impl<T: SavedTensors> SavedTensors for [T] {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.iter().for_each(|t| t.for_each_tensor(f))
    }
}

impl<T: SavedTensors> SavedTensors for Vec<T> {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.as_slice().for_each_tensor(f)
    }
}

/// Counts the bytes of distinct storages seen through [`TensorBytes::add`].
///
/// A storage's size is taken as the furthest element any of its seen views reaches (the whole
/// allocation when some view covers it, which is the case for every buffer the kernels save).
#[derive(Default)]
pub struct TensorBytes {
    extent: HashMap<usize, usize>,
}

impl TensorBytes {
    /// Counts the storages behind every tensor `saved` holds.
    pub fn add(&mut self, saved: &(impl SavedTensors + ?Sized)) {
        saved.for_each_tensor(&mut |t| {
            let (storage, layout) = t.storage_and_layout();
            let key = std::ptr::from_ref::<Storage>(&storage).addr();
            let end = (layout.start_offset() + t.elem_count()) * t.dtype().size_in_bytes();
            let seen = self.extent.entry(key).or_default();
            *seen = (*seen).max(end);
        });
    }

    /// Total bytes of the distinct storages counted so far.
    pub fn total(&self) -> usize {
        self.extent.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;

    #[test]
    fn shared_storage_is_counted_once() -> candle_core::Result<()> {
        let a = Tensor::zeros((4, 8), DType::F32, &Device::Cpu)?;
        let b = Tensor::zeros(16, DType::F64, &Device::Cpu)?;
        let view = a.narrow(0, 2, 2)?; // same storage as `a`
        let mut bytes = TensorBytes::default();
        bytes.add(&vec![a.clone(), view, b]);
        bytes.add(&Some(a));
        assert_eq!(bytes.total(), 4 * 8 * 4 + 16 * 8);
        Ok(())
    }

    #[test]
    fn a_view_alone_counts_up_to_its_end() -> candle_core::Result<()> {
        let a = Tensor::zeros((4, 8), DType::F32, &Device::Cpu)?;
        let mut bytes = TensorBytes::default();
        bytes.add(&a.narrow(0, 0, 1)?);
        assert_eq!(bytes.total(), 8 * 4);
        Ok(())
    }
}
