//! Writing: streaming shards to unique keys, committing manifests last.

use std::collections::HashSet;
use std::time::Instant;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::{ObjectStoreExt, PutMode, PutOptions, WriteMultipart};

use crate::manifest::expected_len;
use crate::store::MAX_PARTS_IN_FLIGHT;
use crate::{
    CheckpointError, CheckpointStore, Manifest, SHARD_SUFFIX, ShardEntry, TensorData, TensorEntry,
    manifest_key, step_dir,
};

/// Tensors at least this large are hashed on the blocking pool instead of the async worker.
const BLOCKING_HASH_MIN: usize = 256 * 1024;

/// Reserved safetensors header key; not a tensor name.
const METADATA_KEY: &str = "__metadata__";

impl CheckpointStore {
    /// Streams one shard to `step-N/<shard_name>-<16 hex random>.safetensors` and returns the
    /// entry to put in the manifest.
    ///
    /// The object is in safetensors layout: an 8-byte little-endian header length, the JSON
    /// header (dtype, shape and data offsets per tensor, in the given order, padded with spaces
    /// to a multiple of 8 bytes), then the tensors' bytes back to back. It is uploaded with a
    /// multipart upload in parts of `part_size` (up to 4 parts in flight), hashing (BLAKE3) the
    /// object and every tensor as it goes; the upload is aborted on error. The whole shard is
    /// never assembled in memory: parts reference the given tensors' bytes.
    ///
    /// The key is unique per call, so a retried upload never overwrites a previous attempt; the
    /// shard only becomes part of a checkpoint once a manifest listing it is committed.
    /// `shard_name` may use `A-Z a-z 0-9 . _ -` (e.g. `stage0`, `optim.stage1`); tensor names must
    /// be unique and their byte length must match dtype × shape.
    pub async fn write_shard(
        &self,
        step: u64,
        shard_name: &str,
        tensors: Vec<(String, TensorData)>,
    ) -> Result<ShardEntry, CheckpointError> {
        self.writable(&format!("write shard `{shard_name}` of step {step}"))?;
        validate_shard_name(shard_name)?;
        let (header, mut entries) = build_header(shard_name, &tensors)?;
        let key = format!(
            "{}/{shard_name}-{:016x}{SHARD_SUFFIX}",
            step_dir(step),
            rand::random::<u64>()
        );
        let size = header.len() as u64 + entries.iter().map(|e| e.len).sum::<u64>();
        let started = Instant::now();

        let path = self.path(&key)?;
        let upload = self
            .inner
            .put_multipart(&path)
            .await
            .map_err(self.store_err(format!("starting the upload of shard `{key}`")))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, self.part_size);

        let mut hasher = blake3::Hasher::new();
        hasher.update(&header);
        let streamed = async {
            self.feed(&mut writer, Bytes::from(header), &key).await?;
            for ((name, tensor), entry) in tensors.into_iter().zip(entries.iter_mut()) {
                let (h, tensor_hash) = hash_tensor(hasher, tensor.data.clone(), &name).await?;
                hasher = h;
                entry.blake3 = tensor_hash.to_hex().to_string();
                self.feed(&mut writer, tensor.data, &key).await?;
            }
            Ok(hasher)
        }
        .await;
        let hasher = match streamed {
            Ok(h) => h,
            Err(e) => {
                if let Err(abort) = writer.abort().await {
                    tracing::warn!(key, error = %abort, "aborting a failed shard upload failed");
                }
                return Err(e);
            }
        };
        // `finish` aborts the upload itself when completing fails.
        writer
            .finish()
            .await
            .map_err(self.store_err(format!("completing the upload of shard `{key}`")))?;

        let secs = started.elapsed().as_secs_f64();
        tracing::debug!(
            key,
            bytes = size,
            secs,
            mb_per_s = size as f64 / 1e6 / secs.max(1e-9),
            "shard written"
        );
        Ok(ShardEntry {
            key,
            size,
            blake3: hasher.finalize().to_hex().to_string(),
            tensors: entries,
        })
    }

    /// Hands `data` to the multipart writer in throttled pieces, keeping at most
    /// [`MAX_PARTS_IN_FLIGHT`] parts uploading.
    async fn feed(
        &self,
        writer: &mut WriteMultipart,
        mut data: Bytes,
        key: &str,
    ) -> Result<(), CheckpointError> {
        let chunk = self.feed_chunk();
        while !data.is_empty() {
            let piece = data.split_to(chunk.min(data.len()));
            self.throttle(piece.len()).await;
            writer
                .wait_for_capacity(MAX_PARTS_IN_FLIGHT)
                .await
                .map_err(self.store_err(format!("uploading a part of `{key}`")))?;
            writer.put(piece);
        }
        Ok(())
    }

    /// Writes `step-N/manifest.json` with a conditional create, making the checkpoint exist.
    ///
    /// First checks the manifest's consistency ([`Manifest::validate`]) and that every shard it
    /// lists exists with the recorded size. If the manifest already exists (someone committed
    /// this step first, on any store kind including S3's `If-None-Match: *` → 412) returns
    /// [`CheckpointError::AlreadyCommitted`]. (Should a successful write's response be lost
    /// and the client retry it, the retry also reports `AlreadyCommitted`: to tell "mine" from
    /// "someone else's", compare [`CheckpointStore::read_manifest`] with `manifest`.)
    pub async fn commit(&self, manifest: &Manifest) -> Result<(), CheckpointError> {
        let step = manifest.step;
        self.writable(&format!("commit step {step}"))?;
        manifest
            .validate()
            .map_err(|detail| CheckpointError::InvalidManifest {
                url: self.url.clone(),
                step,
                detail: format!("{detail}; nothing was committed"),
            })?;
        futures::stream::iter(&manifest.shards)
            .map(|shard| async move {
                let meta = self.inner.head(&self.path(&shard.key)?).await;
                match meta {
                    Ok(meta) if meta.size == shard.size => Ok(()),
                    Ok(meta) => Err(self.corrupt(
                        &shard.key,
                        format!(
                            "the object is {} bytes but the manifest records {}; refusing to \
                             commit step {step}: rewrite the shard",
                            meta.size, shard.size
                        ),
                    )),
                    Err(object_store::Error::NotFound { .. }) => Err(self.corrupt(
                        &shard.key,
                        format!(
                            "the shard does not exist; refusing to commit step {step}: write it \
                             with write_shard() first"
                        ),
                    )),
                    Err(e) => Err(self.store_err(format!("checking shard `{}`", shard.key))(e)),
                }
            })
            .buffer_unordered(8)
            .try_collect::<Vec<()>>()
            .await?;

        let key = manifest_key(step);
        let json = serde_json::to_vec_pretty(manifest).map_err(|source| CheckpointError::Json {
            url: self.url.clone(),
            key: key.clone(),
            action: "serializing".into(),
            source,
        })?;
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self
            .inner
            .put_opts(&self.path(&key)?, json.into(), opts)
            .await
        {
            // The caller logs the commit (the trainer with its upload time): logging here too
            // printed every checkpoint twice.
            Ok(_) => Ok(()),
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. },
            ) => Err(CheckpointError::AlreadyCommitted {
                url: self.url.clone(),
                step,
            }),
            Err(e) => Err(self.store_err(format!("writing manifest `{key}`"))(e)),
        }
    }

    /// Raw write throughput probe for benchmarks: writes `bytes` bytes to a scratch key
    /// (`probe-<16 hex>.bin`, outside any step directory) through the same multipart path as
    /// [`CheckpointStore::write_shard`] (same part size, parts in flight and throttle) but with no
    /// hashing or format, deletes it, and returns the seconds the write took (deletion not
    /// counted).
    pub async fn raw_write_probe(&self, bytes: usize) -> Result<f64, CheckpointError> {
        self.writable("write a probe object")?;
        let key = format!("probe-{:016x}.bin", rand::random::<u64>());
        let path = self.path(&key)?;
        // One part's worth of non-constant data, referenced (not copied) by every part.
        let block: Bytes = (0..self.part_size.min(bytes).max(1))
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3])
            .collect::<Vec<u8>>()
            .into();
        let started = Instant::now();
        let upload = self
            .inner
            .put_multipart(&path)
            .await
            .map_err(self.store_err(format!("starting the probe upload `{key}`")))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, self.part_size);
        let streamed = async {
            let mut left = bytes;
            while left > 0 {
                let n = left.min(block.len());
                self.feed(&mut writer, block.slice(..n), &key).await?;
                left -= n;
            }
            Ok(())
        }
        .await;
        if let Err(e) = streamed {
            if let Err(abort) = writer.abort().await {
                tracing::warn!(key, error = %abort, "aborting a failed probe upload failed");
            }
            return Err(e);
        }
        writer
            .finish()
            .await
            .map_err(self.store_err(format!("completing the probe upload `{key}`")))?;
        let secs = started.elapsed().as_secs_f64();
        self.delete_key(&key).await?;
        Ok(secs)
    }
}

/// Hashes `data` into the object hasher and on its own; large tensors on the blocking pool.
async fn hash_tensor(
    mut hasher: blake3::Hasher,
    data: Bytes,
    name: &str,
) -> Result<(blake3::Hasher, blake3::Hash), CheckpointError> {
    if data.len() < BLOCKING_HASH_MIN {
        hasher.update(&data);
        let h = blake3::hash(&data);
        return Ok((hasher, h));
    }
    tokio::task::spawn_blocking(move || {
        hasher.update(&data);
        let h = blake3::hash(&data);
        (hasher, h)
    })
    .await
    .map_err(|source| CheckpointError::Task {
        action: format!("hashing tensor `{name}`"),
        source,
    })
}

fn validate_shard_name(name: &str) -> Result<(), CheckpointError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(CheckpointError::InvalidInput {
            what: format!("shard name `{name}`"),
            detail: "use 1 to 128 characters from A-Z a-z 0-9 . _ - not starting with `.` \
                     (e.g. `stage0`)"
                .into(),
        })
    }
}

/// The safetensors header (length prefix included) and the manifest entries (hashes not yet
/// filled in) for `tensors`, checking names and byte lengths.
fn build_header(
    shard_name: &str,
    tensors: &[(String, TensorData)],
) -> Result<(Vec<u8>, Vec<TensorEntry>), CheckpointError> {
    let invalid = |name: &str, detail: String| CheckpointError::InvalidInput {
        what: format!("tensor `{name}` of shard `{shard_name}`"),
        detail,
    };
    let mut seen = HashSet::new();
    let mut json = String::from("{");
    let mut relative = Vec::with_capacity(tensors.len());
    let mut offset = 0u64;
    for (i, (name, t)) in tensors.iter().enumerate() {
        if name.is_empty() || name == METADATA_KEY {
            return Err(invalid(
                name,
                format!("tensor names must be non-empty and not `{METADATA_KEY}`"),
            ));
        }
        if !seen.insert(name.as_str()) {
            return Err(invalid(name, "the name is given twice".into()));
        }
        let len = expected_len(t.dtype, &t.shape).ok_or_else(|| {
            invalid(
                name,
                format!(
                    "shape {:?} of {} is not a whole number of bytes",
                    t.shape, t.dtype
                ),
            )
        })?;
        if t.data.len() as u64 != len {
            return Err(invalid(
                name,
                format!(
                    "{} data bytes but shape {:?} of {} needs {len}",
                    t.data.len(),
                    t.shape,
                    t.dtype
                ),
            ));
        }
        if i > 0 {
            json.push(',');
        }
        let quoted = serde_json::to_string(name).expect("a string always serializes");
        json.push_str(&format!(
            "{quoted}:{{\"dtype\":\"{}\",\"shape\":{:?},\"data_offsets\":[{offset},{}]}}",
            t.dtype,
            t.shape,
            offset + len
        ));
        relative.push((offset, len));
        offset += len;
    }
    json.push('}');
    // Pad so that the data starts 8-byte aligned, as safetensors itself does.
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let data_start = 8 + json.len() as u64;
    let mut header = Vec::with_capacity(data_start as usize);
    header.extend_from_slice(&(json.len() as u64).to_le_bytes());
    header.extend_from_slice(json.as_bytes());
    let entries = tensors
        .iter()
        .zip(relative)
        .map(|((name, t), (offset, len))| TensorEntry {
            name: name.clone(),
            dtype: t.dtype.to_string(),
            shape: t.shape.clone(),
            offset: data_start + offset,
            len,
            blake3: String::new(),
        })
        .collect();
    Ok((header, entries))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dtype;

    #[test]
    fn header_is_valid_safetensors() {
        let tensors = vec![
            (
                "b\"q".to_string(),
                TensorData::new(Dtype::F32, vec![2], vec![0u8; 8]),
            ),
            ("a".to_string(), TensorData::new(Dtype::U8, vec![0], vec![])),
            (
                "s".to_string(),
                TensorData::new(Dtype::F64, vec![], vec![1u8; 8]),
            ),
        ];
        let (mut bytes, entries) = build_header("x", &tensors).unwrap();
        assert_eq!(bytes.len() % 8, 0);
        for (_, t) in &tensors {
            bytes.extend_from_slice(&t.data);
        }
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.len(), 3);
        assert_eq!(st.tensor("b\"q").unwrap().shape(), [2]);
        assert_eq!(entries[2].offset, bytes.len() as u64 - 8);
        assert_eq!(entries[1].len, 0);
    }

    #[test]
    fn bad_inputs_name_the_tensor() {
        let bad_len = vec![(
            "w".to_string(),
            TensorData::new(Dtype::F32, vec![3], vec![0u8; 8]),
        )];
        let msg = build_header("stage0", &bad_len).unwrap_err().to_string();
        assert!(
            msg.contains("`w`") && msg.contains("stage0") && msg.contains("12"),
            "{msg}"
        );
        let t = TensorData::new(Dtype::U8, vec![1], vec![0u8]);
        let dup = vec![("w".to_string(), t.clone()), ("w".to_string(), t)];
        assert!(
            build_header("s", &dup)
                .unwrap_err()
                .to_string()
                .contains("twice")
        );
        for name in ["", "a/b", ".x", "a b"] {
            assert!(validate_shard_name(name).is_err(), "{name}");
        }
        assert!(validate_shard_name("optim.stage-1_x").is_ok());
    }
}
