//! Checkpoints: named tensors + a JSON state  <->  safetensors shards + a manifest in an object
//! store.
//!
//! The crate knows nothing of training: a tensor is raw little-endian bytes with a
//! [`safetensors::Dtype`] and a shape ([`TensorData`]); the trainer's state (step, data cursor, LR
//! position, config, topology...) is an opaque [`serde_json::Value`] stored in the [`Manifest`].
//!
//! # Layout and the one invariant
//! Step `N` lives under the store's prefix in `step-<N as 8 digits>/` ([`step_dir`]):
//! ```text
//! step-00000042/
//!     stage0-3f9a0c1d2e4b5a69.safetensors   shard objects, one unique key per upload attempt
//!     stage1-0b7e66a1c2d3e4f5.safetensors
//!     manifest.json                          written last, with a conditional create
//! ```
//! **A checkpoint exists iff its manifest exists.** [`CheckpointStore::write_shard`] streams each
//! shard to a fresh key (so a retried or concurrent upload never overwrites anything), then
//! [`CheckpointStore::commit`] writes `manifest.json` with `PutMode::Create`, so exactly one writer
//! wins. Readers only ever start from a manifest, and the manifest records the size and BLAKE3
//! hash of every shard and every tensor, so damage is detected and named instead of loaded.
//!
//! # Example
//! ```
//! # async fn demo() -> Result<(), checkpoint::CheckpointError> {
//! use checkpoint::{CheckpointStore, Dtype, Manifest, StoreOptions, TensorData};
//!
//! let store = CheckpointStore::open("memory://", &StoreOptions::default())?;
//! let w = TensorData::new(Dtype::F32, vec![2], [1.0f32, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
//! let shard = store.write_shard(7, "stage0", vec![("w".to_string(), w.clone())]).await?;
//! store.commit(&Manifest::new(7, vec![shard], serde_json::json!({"step": 7}))).await?;
//!
//! let manifest = store.read_manifest(*store.committed_steps().await?.last().unwrap()).await?;
//! let tensors = store.read_tensors(&manifest, &["w".to_string()]).await?;
//! assert_eq!(tensors[0].1, w);
//! # Ok(()) }
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(demo()).unwrap();
//! ```
//!
//! All async methods must run inside a Tokio runtime (uploads spawn one task per part).

#![warn(missing_docs)]

#[cfg(feature = "test-support")]
pub mod emulators;
mod error;
mod maintenance;
mod manifest;
mod read;
mod store;
#[cfg(feature = "test-support")]
pub mod testing;
mod write;

pub use error::CheckpointError;
pub use maintenance::StepListing;
pub use manifest::{FORMAT, FORMAT_VERSION, Manifest, ShardEntry, TensorEntry};
pub use read::{MAX_MANIFEST_BYTES, VerifyReport};
pub use safetensors::Dtype;
pub use store::{CheckpointStore, DEFAULT_PART_SIZE, StoreOptions};

/// A tensor as raw little-endian bytes.
///
/// `data.len()` must equal the number of elements times the dtype's size (checked by
/// [`CheckpointStore::write_shard`]). Data is reference-counted: cloning is cheap and uploads do
/// not copy it.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorData {
    /// Element type, in safetensors' vocabulary.
    pub dtype: Dtype,
    /// Shape, outermost dimension first (row-major). `[]` is a scalar.
    pub shape: Vec<usize>,
    /// Raw little-endian element bytes, row-major.
    pub data: bytes::Bytes,
}

impl TensorData {
    /// Builds a tensor from its dtype, shape and raw little-endian bytes (not checked here).
    pub fn new(dtype: Dtype, shape: Vec<usize>, data: impl Into<bytes::Bytes>) -> Self {
        Self {
            dtype,
            shape,
            data: data.into(),
        }
    }

    /// Number of elements (the product of the shape; 1 for a scalar).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The directory (key prefix, relative to the store's prefix) of step `step`:
/// `step-` followed by the step zero-padded to 8 digits, e.g. `step-00000042`.
///
/// Steps of 100 000 000 and more get more digits; [`CheckpointStore::list`] parses any number of
/// digits.
pub fn step_dir(step: u64) -> String {
    format!("step-{step:08}")
}

/// Parses a directory name written by [`step_dir`] back into its step.
pub(crate) fn parse_step_dir(dir: &str) -> Option<u64> {
    let digits = dir.strip_prefix("step-")?;
    if digits.len() < 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The key (relative to the store's prefix) of step `step`'s manifest.
pub(crate) fn manifest_key(step: u64) -> String {
    format!("{}/{}", step_dir(step), MANIFEST_NAME)
}

/// File name of a step's manifest inside its step directory.
pub(crate) const MANIFEST_NAME: &str = "manifest.json";

/// File name suffix of shard objects.
pub(crate) const SHARD_SUFFIX: &str = ".safetensors";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_dir_round_trips() {
        assert_eq!(step_dir(42), "step-00000042");
        assert_eq!(step_dir(123_456_789), "step-123456789");
        for step in [0, 1, 42, 99_999_999, 123_456_789, u64::MAX] {
            assert_eq!(parse_step_dir(&step_dir(step)), Some(step));
        }
        assert_eq!(parse_step_dir("step-42"), None);
        assert_eq!(parse_step_dir("step-0000004x"), None);
        assert_eq!(parse_step_dir("probe-00000042"), None);
        assert_eq!(manifest_key(3), "step-00000003/manifest.json");
    }
}
