//! The manifest: the one object whose existence makes a checkpoint exist.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use crate::{Dtype, SHARD_SUFFIX, step_dir};

/// Value of [`Manifest::format`].
pub const FORMAT: &str = "seqpipe-checkpoint";

/// Value of [`Manifest::version`] written by this crate; readers refuse other versions.
pub const FORMAT_VERSION: u32 = 1;

/// One shard object of a checkpoint, as recorded in the manifest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ShardEntry {
    /// Object key relative to the store prefix, e.g. `step-00000042/stage0-3f9a0c1d2e4b5a69.safetensors`.
    pub key: String,
    /// Size of the whole object in bytes.
    pub size: u64,
    /// BLAKE3 hash (lowercase hex) of the whole object.
    pub blake3: String,
    /// The tensors in the object, in file order.
    pub tensors: Vec<TensorEntry>,
}

/// One tensor inside a shard, as recorded in the manifest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TensorEntry {
    /// Global tensor name, e.g. `h.7.attn.c_attn.weight`.
    pub name: String,
    /// Element type in safetensors' spelling, e.g. `F32`.
    pub dtype: String,
    /// Shape, outermost dimension first.
    pub shape: Vec<usize>,
    /// Absolute byte offset of the tensor's data in the shard object.
    pub offset: u64,
    /// Length of the tensor's data in bytes.
    pub len: u64,
    /// BLAKE3 hash (lowercase hex) of the tensor's data bytes.
    pub blake3: String,
}

impl TensorEntry {
    /// Parses [`TensorEntry::dtype`] back into a [`Dtype`] (`None` if unknown).
    pub fn parse_dtype(&self) -> Option<Dtype> {
        parse_dtype(&self.dtype)
    }
}

/// Parses a safetensors dtype spelling (`"F32"`, `"BF16"`, …).
pub(crate) fn parse_dtype(s: &str) -> Option<Dtype> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).ok()
}

/// A checkpoint's table of contents: its shards with their hashes, and the trainer's state.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// Always [`FORMAT`] (`"seqpipe-checkpoint"`).
    pub format: String,
    /// Format version, [`FORMAT_VERSION`] (1).
    pub version: u32,
    /// The training step this checkpoint holds.
    pub step: u64,
    /// The shard objects, each inside [`step_dir`]`(step)`.
    pub shards: Vec<ShardEntry>,
    /// Free-form trainer state (step, data cursor, LR position, config, topology...).
    pub state: serde_json::Value,
}

impl Manifest {
    /// A version-1 manifest of `step` over `shards` (as returned by
    /// [`crate::CheckpointStore::write_shard`]) with the trainer's `state`.
    pub fn new(step: u64, shards: Vec<ShardEntry>, state: serde_json::Value) -> Self {
        Self {
            format: FORMAT.to_string(),
            version: FORMAT_VERSION,
            step,
            shards,
            state,
        }
    }

    /// The shard holding tensor `name` and the tensor's entry, if the checkpoint has it.
    pub fn tensor(&self, name: &str) -> Option<(&ShardEntry, &TensorEntry)> {
        self.shards
            .iter()
            .find_map(|s| s.tensors.iter().find(|t| t.name == name).map(|t| (s, t)))
    }

    /// Total size of all shard objects in bytes (the manifest itself not counted).
    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.size).sum()
    }

    /// Names of all tensors, shard by shard in file order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.shards
            .iter()
            .flat_map(|s| s.tensors.iter().map(|t| t.name.as_str()))
    }

    /// Checks the manifest's own consistency (not the objects it points to): format and
    /// version, shard keys inside this step's directory and distinct, tensor names unique
    /// across shards, dtypes known, lengths matching shapes, and tensor ranges inside their
    /// shard without overlapping. Returns the first problem found.
    pub fn validate(&self) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!(
                "format is `{}`, expected `{FORMAT}`: this is not a seqpipe checkpoint manifest",
                self.format
            ));
        }
        if self.version != FORMAT_VERSION {
            return Err(format!(
                "format version is {}, this build reads version {FORMAT_VERSION}: use the seqpipe \
                 version that wrote it",
                self.version
            ));
        }
        let dir = format!("{}/", step_dir(self.step));
        let mut keys = HashSet::new();
        let mut names = HashSet::new();
        for shard in &self.shards {
            let file = shard.key.strip_prefix(&dir).unwrap_or("");
            if file.is_empty() || file.contains('/') || !file.ends_with(SHARD_SUFFIX) {
                return Err(format!(
                    "shard key `{}` is not a `*{SHARD_SUFFIX}` object directly inside `{dir}`: \
                     write shards with write_shard() using the manifest's step",
                    shard.key
                ));
            }
            if !keys.insert(shard.key.as_str()) {
                return Err(format!("shard `{}` is listed twice", shard.key));
            }
            let mut ranges: Vec<(u64, u64, &str)> = Vec::with_capacity(shard.tensors.len());
            for t in &shard.tensors {
                if !names.insert(t.name.as_str()) {
                    return Err(format!(
                        "tensor `{}` appears more than once (again in shard `{}`): tensor names \
                         must be unique across all shards of a checkpoint",
                        t.name, shard.key
                    ));
                }
                let dtype = t.parse_dtype().ok_or_else(|| {
                    format!(
                        "tensor `{}` in shard `{}` has unknown dtype `{}`",
                        t.name, shard.key, t.dtype
                    )
                })?;
                let expected = expected_len(dtype, &t.shape).ok_or_else(|| {
                    format!(
                        "tensor `{}` in shard `{}`: shape {:?} of {} is not a whole number of bytes",
                        t.name, shard.key, t.shape, t.dtype
                    )
                })?;
                if t.len != expected {
                    return Err(format!(
                        "tensor `{}` in shard `{}` records {} bytes but shape {:?} of {} needs {}",
                        t.name, shard.key, t.len, t.shape, t.dtype, expected
                    ));
                }
                let end = t.offset.checked_add(t.len).filter(|&e| e <= shard.size);
                let Some(end) = end else {
                    return Err(format!(
                        "tensor `{}` (bytes {}..+{}) lies outside shard `{}` of {} bytes",
                        t.name, t.offset, t.len, shard.key, shard.size
                    ));
                };
                ranges.push((t.offset, end, t.name.as_str()));
            }
            ranges.sort_unstable();
            for w in ranges.windows(2) {
                if w[0].1 > w[1].0 {
                    return Err(format!(
                        "tensors `{}` and `{}` overlap in shard `{}`",
                        w[0].2, w[1].2, shard.key
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Bytes needed by a tensor of `dtype` and `shape`, or `None` if it is not a whole number of
/// bytes (sub-byte dtypes) or overflows.
pub(crate) fn expected_len(dtype: Dtype, shape: &[usize]) -> Option<u64> {
    let numel = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))?;
    let bits = numel.checked_mul(dtype.bitsize() as u64)?;
    (bits % 8 == 0).then_some(bits / 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, offset: u64, len: u64) -> TensorEntry {
        TensorEntry {
            name: name.into(),
            dtype: "U8".into(),
            shape: vec![len as usize],
            offset,
            len,
            blake3: String::new(),
        }
    }

    fn shard(key: &str, size: u64, tensors: Vec<TensorEntry>) -> ShardEntry {
        ShardEntry {
            key: key.into(),
            size,
            blake3: String::new(),
            tensors,
        }
    }

    #[test]
    fn lookups() {
        let m = Manifest::new(
            3,
            vec![
                shard("step-00000003/a-0.safetensors", 20, vec![entry("x", 8, 4)]),
                shard(
                    "step-00000003/b-0.safetensors",
                    30,
                    vec![entry("y", 8, 2), entry("z", 10, 3)],
                ),
            ],
            serde_json::json!({}),
        );
        assert!(m.validate().is_ok(), "{:?}", m.validate());
        assert_eq!(m.total_bytes(), 50);
        assert_eq!(m.tensor_names().collect::<Vec<_>>(), ["x", "y", "z"]);
        let (s, t) = m.tensor("z").unwrap();
        assert_eq!(
            (s.key.as_str(), t.offset),
            ("step-00000003/b-0.safetensors", 10)
        );
        assert!(m.tensor("w").is_none());
    }

    #[test]
    fn validate_rejects_inconsistencies() {
        let ok = shard("step-00000001/a-0.safetensors", 20, vec![entry("x", 8, 4)]);
        let cases = [
            (
                vec![shard("step-00000002/a-0.safetensors", 20, vec![])],
                "not a",
            ),
            (vec![ok.clone(), ok.clone()], "listed twice"),
            (
                vec![
                    ok.clone(),
                    shard("step-00000001/b-0.safetensors", 20, vec![entry("x", 8, 4)]),
                ],
                "more than once",
            ),
            (
                vec![shard(
                    "step-00000001/a-0.safetensors",
                    10,
                    vec![entry("x", 8, 4)],
                )],
                "outside",
            ),
            (
                vec![shard(
                    "step-00000001/a-0.safetensors",
                    20,
                    vec![entry("x", 8, 4), entry("y", 10, 4)],
                )],
                "overlap",
            ),
        ];
        for (shards, needle) in cases {
            let err = Manifest::new(1, shards, serde_json::Value::Null)
                .validate()
                .unwrap_err();
            assert!(err.contains(needle), "{err} should mention {needle}");
        }
        let mut m = Manifest::new(1, vec![ok], serde_json::Value::Null);
        m.version = 2;
        assert!(m.validate().unwrap_err().contains("version"));
    }

    #[test]
    fn dtype_spelling_round_trips() {
        for d in [
            Dtype::F32,
            Dtype::F64,
            Dtype::BF16,
            Dtype::U32,
            Dtype::F8_E4M3,
        ] {
            assert_eq!(parse_dtype(&d.to_string()), Some(d));
        }
        assert_eq!(parse_dtype("F33"), None);
        assert_eq!(expected_len(Dtype::F32, &[2, 3]), Some(24));
        assert_eq!(expected_len(Dtype::F32, &[]), Some(4));
        assert_eq!(expected_len(Dtype::F64, &[0, 7]), Some(0));
        assert_eq!(expected_len(Dtype::F4, &[3]), None);
    }
}
