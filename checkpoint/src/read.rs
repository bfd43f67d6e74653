//! Reading: manifests, tensors by byte range, and full verification.

use std::collections::HashMap;
use std::ops::Range;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::ObjectStoreExt;
use serde::{Deserialize, Serialize};

use crate::manifest::parse_dtype;
use crate::{
    CheckpointError, CheckpointStore, Manifest, ShardEntry, TensorData, TensorEntry, manifest_key,
};

/// The largest manifest object read, in bytes (32 MiB).
///
/// A manifest holds about 300 bytes per tensor entry (a name of a few dozen bytes, dtype, shape,
/// offset, length and a 64-hex-digit BLAKE3 hash, in JSON) plus about 200 per shard and the
/// trainer's state (a few KiB: the resolved config, cursors). A GPT stage of `L` layers has 12
/// parameter tensors per layer and each is stored with AdamW's two moments, so a 1000-layer model
/// has about 36 000 entries, ~11 MiB. 32 MiB leaves room for three times that (over 100 000
/// tensors) while bounding what a damaged or hostile object can cost to a few times the bound
/// when parsed (the 2.9 GB manifest of issue 35 cost 8.9 GB of memory per reader).
pub const MAX_MANIFEST_BYTES: u64 = 32 << 20;

/// Shards read or verified concurrently.
const SHARDS_IN_FLIGHT: usize = 4;

/// What [`CheckpointStore::verify`] found.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VerifyReport {
    /// The manifest's step.
    pub step: u64,
    /// Shards read back in full (those that exist).
    pub shards_checked: usize,
    /// Bytes read back and hashed.
    pub bytes_checked: u64,
    /// One line per problem, each naming the shard key (and tensor); empty when all is well.
    pub problems: Vec<String>,
}

impl VerifyReport {
    /// True when no problem was found.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }
}

impl std::fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "step {}: {} shards, {} bytes checked, ",
            self.step, self.shards_checked, self.bytes_checked
        )?;
        if self.is_ok() {
            return write!(f, "OK");
        }
        write!(f, "{} problems:", self.problems.len())?;
        for p in &self.problems {
            write!(f, "\n  {p}")?;
        }
        Ok(())
    }
}

impl CheckpointStore {
    /// Reads and checks the manifest of `step`.
    ///
    /// [`CheckpointError::NotFound`] if the step has no manifest (it does not exist as a
    /// checkpoint, even if shards were uploaded); [`CheckpointError::Json`] or
    /// [`CheckpointError::InvalidManifest`] if the manifest is unreadable or inconsistent.
    ///
    /// The object's size is checked against [`MAX_MANIFEST_BYTES`] before its body is read
    /// ([`CheckpointError::ManifestTooLarge`] names the key, its size and the bound), and the
    /// body is read only up to the bound, whatever size the store claimed.
    pub async fn read_manifest(&self, step: u64) -> Result<Manifest, CheckpointError> {
        let key = manifest_key(step);
        let too_large = |size: u64| CheckpointError::ManifestTooLarge {
            url: self.url.clone(),
            key: key.clone(),
            size,
            limit: MAX_MANIFEST_BYTES,
        };
        let got = match self.inner.get(&self.path(&key)?).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => {
                return Err(CheckpointError::NotFound {
                    url: self.url.clone(),
                    step,
                });
            }
            Err(e) => return Err(self.store_err(format!("reading manifest `{key}`"))(e)),
        };
        // The GET's own metadata: no second request, so no window for the object to change.
        if got.meta.size > MAX_MANIFEST_BYTES {
            return Err(too_large(got.meta.size));
        }
        let mut bytes = Vec::with_capacity(got.meta.size as usize);
        let mut body = got.into_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(self.store_err(format!("reading manifest `{key}`")))?;
            let size = bytes.len() as u64 + chunk.len() as u64;
            if size > MAX_MANIFEST_BYTES {
                return Err(too_large(size));
            }
            bytes.extend_from_slice(&chunk);
        }
        let manifest: Manifest =
            serde_json::from_slice(&bytes).map_err(|source| CheckpointError::Json {
                url: self.url.clone(),
                key: key.clone(),
                action: "parsing".into(),
                source,
            })?;
        let invalid = |detail: String| CheckpointError::InvalidManifest {
            url: self.url.clone(),
            step,
            detail,
        };
        if manifest.step != step {
            return Err(invalid(format!(
                "`{key}` records step {}; the manifest was moved or damaged: resume from another \
                 committed step",
                manifest.step
            )));
        }
        manifest
            .validate()
            .map_err(|d| invalid(format!("`{key}`: {d}; resume from another committed step")))?;
        Ok(manifest)
    }

    /// Reads the named tensors (in the order asked), each by byte range of its shard, and
    /// checks each tensor's BLAKE3 hash against the manifest.
    ///
    /// [`CheckpointError::MissingTensor`] for a name the manifest lacks;
    /// [`CheckpointError::Corrupt`] naming the shard key and tensor on a hash mismatch, and for
    /// a missing or truncated shard.
    pub async fn read_tensors(
        &self,
        manifest: &Manifest,
        names: &[String],
    ) -> Result<Vec<(String, TensorData)>, CheckpointError> {
        let index: HashMap<&str, (usize, &TensorEntry)> = manifest
            .shards
            .iter()
            .enumerate()
            .flat_map(|(i, s)| s.tensors.iter().map(move |t| (t.name.as_str(), (i, t))))
            .collect();
        // Per shard: positions in the result and the entries to fetch.
        let mut wanted: HashMap<usize, Vec<(usize, &TensorEntry)>> = HashMap::new();
        for (pos, name) in names.iter().enumerate() {
            let &(shard, entry) =
                index
                    .get(name.as_str())
                    .ok_or_else(|| CheckpointError::MissingTensor {
                        url: self.url.clone(),
                        name: name.clone(),
                        step: manifest.step,
                    })?;
            wanted.entry(shard).or_default().push((pos, entry));
        }

        let fetched: Vec<Vec<(usize, TensorData)>> = futures::stream::iter(wanted)
            .map(|(shard, entries)| self.read_from_shard(&manifest.shards[shard], entries))
            .buffer_unordered(SHARDS_IN_FLIGHT)
            .try_collect()
            .await?;
        let mut out: Vec<Option<TensorData>> = vec![None; names.len()];
        for (pos, t) in fetched.into_iter().flatten() {
            out[pos] = Some(t);
        }
        Ok(names
            .iter()
            .cloned()
            .zip(
                out.into_iter()
                    .map(|t| t.expect("every position is fetched")),
            )
            .collect())
    }

    /// Fetches `entries` of `shard` with one ranged read each (coalesced by the store) and
    /// checks their hashes.
    async fn read_from_shard(
        &self,
        shard: &ShardEntry,
        entries: Vec<(usize, &TensorEntry)>,
    ) -> Result<Vec<(usize, TensorData)>, CheckpointError> {
        let path = self.path(&shard.key)?;
        // Empty tensors are not fetched: a zero-length range is not a valid request.
        let ranges: Vec<Range<u64>> = entries
            .iter()
            .filter(|(_, e)| e.len > 0)
            .map(|(_, e)| e.offset..e.offset + e.len)
            .collect();
        let mut fetched = match self.inner.get_ranges(&path, &ranges).await {
            Ok(parts) => parts.into_iter(),
            Err(e) => {
                let names: Vec<&str> = entries.iter().map(|(_, t)| t.name.as_str()).collect();
                return Err(self.explain_read_failure(shard, &names, e).await);
            }
        };
        let mut out = Vec::with_capacity(entries.len());
        let mut to_hash = Vec::with_capacity(entries.len());
        for (pos, entry) in entries {
            let data = if entry.len == 0 {
                Bytes::new()
            } else {
                fetched.next().unwrap_or_default()
            };
            if data.len() as u64 != entry.len {
                return Err(self.corrupt(
                    &shard.key,
                    format!(
                        "tensor `{}` needs bytes {}..{} but the shard ends early (got {} of {} \
                         bytes): the shard is truncated",
                        entry.name,
                        entry.offset,
                        entry.offset + entry.len,
                        data.len(),
                        entry.len
                    ),
                ));
            }
            let dtype = parse_dtype(&entry.dtype).ok_or_else(|| {
                self.corrupt(
                    &shard.key,
                    format!(
                        "tensor `{}` has unknown dtype `{}`",
                        entry.name, entry.dtype
                    ),
                )
            })?;
            to_hash.push((entry.blake3.clone(), data.clone()));
            out.push((
                pos,
                entry,
                TensorData::new(dtype, entry.shape.clone(), data),
            ));
        }
        let total: usize = to_hash.iter().map(|(_, d)| d.len()).sum();
        let check = move || {
            to_hash
                .iter()
                .map(|(want, data)| blake3::hash(data).to_hex().as_str() == want)
                .collect::<Vec<bool>>()
        };
        let ok = if total < 1 << 20 {
            check()
        } else {
            tokio::task::spawn_blocking(check)
                .await
                .map_err(|source| CheckpointError::Task {
                    action: format!("hashing tensors of `{}`", shard.key),
                    source,
                })?
        };
        if let Some(i) = ok.iter().position(|ok| !ok) {
            let e = out[i].1;
            return Err(self.corrupt(
                &shard.key,
                format!(
                    "tensor `{}` (bytes {}..{}) does not match its BLAKE3 hash in the manifest",
                    e.name,
                    e.offset,
                    e.offset + e.len
                ),
            ));
        }
        Ok(out.into_iter().map(|(pos, _, t)| (pos, t)).collect())
    }

    /// Turns a failed ranged read into a [`CheckpointError::Corrupt`] if the shard is missing
    /// or has the wrong size, else a [`CheckpointError::Store`].
    async fn explain_read_failure(
        &self,
        shard: &ShardEntry,
        names: &[&str],
        err: object_store::Error,
    ) -> CheckpointError {
        let path = match self.path(&shard.key) {
            Ok(p) => p,
            Err(e) => return e,
        };
        let reading = format!("reading tensor(s) `{}`", names.join("`, `"));
        match self.inner.head(&path).await {
            Err(object_store::Error::NotFound { .. }) => self.corrupt(
                &shard.key,
                format!("the shard object is missing ({reading})"),
            ),
            Ok(meta) if meta.size != shard.size => self.corrupt(
                &shard.key,
                format!(
                    "the shard is {} bytes but the manifest records {}: it was truncated or                      replaced ({reading})",
                    meta.size, shard.size
                ),
            ),
            _ => self.store_err(format!("{reading} from `{}`", shard.key))(err),
        }
    }

    /// Re-reads every shard in full (streaming) and checks its size, its hash and every
    /// tensor's hash. Returns `Ok(report)` even when problems are found (missing shard, size
    /// mismatch, shard hash mismatch, tensor hash mismatch, truncated tensor); check
    /// [`VerifyReport::is_ok`]. Errors only when the store itself fails.
    pub async fn verify(&self, manifest: &Manifest) -> Result<VerifyReport, CheckpointError> {
        let mut report = VerifyReport {
            step: manifest.step,
            shards_checked: 0,
            bytes_checked: 0,
            problems: Vec::new(),
        };
        if let Err(detail) = manifest.validate() {
            report.problems.push(format!("manifest: {detail}"));
        }
        let results: Vec<(Option<u64>, Vec<String>)> = futures::stream::iter(&manifest.shards)
            .map(|shard| self.verify_shard(shard))
            .buffered(SHARDS_IN_FLIGHT)
            .try_collect()
            .await?;
        for (bytes, problems) in results {
            if let Some(bytes) = bytes {
                report.shards_checked += 1;
                report.bytes_checked += bytes;
            }
            report.problems.extend(problems);
        }
        Ok(report)
    }

    /// Reads one shard in windows of [`VERIFY_WINDOW`] bytes (two in flight), hashing the
    /// object and each tensor on the blocking pool. Returns the bytes read (`None` if the shard
    /// is missing) and the problems found.
    async fn verify_shard(
        &self,
        shard: &ShardEntry,
    ) -> Result<(Option<u64>, Vec<String>), CheckpointError> {
        let key = &shard.key;
        let path = self.path(key)?;
        let mut problems = Vec::new();
        let size = match self.inner.head(&path).await {
            Ok(meta) => meta.size,
            Err(object_store::Error::NotFound { .. }) => {
                problems.push(format!("{key}: shard object is missing"));
                return Ok((None, problems));
            }
            Err(e) => return Err(self.store_err(format!("reading shard `{key}`"))(e)),
        };
        let windows: Vec<Range<u64>> = (0..size)
            .step_by(VERIFY_WINDOW as usize)
            .map(|start| start..(start + VERIFY_WINDOW).min(size))
            .collect();
        let mut reads = futures::stream::iter(windows)
            .map(|range| {
                let path = path.clone();
                async move { (range.start, self.inner.get_range(&path, range).await) }
            })
            .buffered(2);
        let mut state = ShardHasher::new(shard);
        while let Some((start, bytes)) = reads.next().await {
            let bytes = bytes.map_err(self.store_err(format!("reading shard `{key}`")))?;
            state = if bytes.len() < (1 << 20) {
                state.update(start, &bytes);
                state
            } else {
                tokio::task::spawn_blocking(move || {
                    state.update(start, &bytes);
                    state
                })
                .await
                .map_err(|source| CheckpointError::Task {
                    action: format!("hashing shard `{key}`"),
                    source,
                })?
            };
        }
        if size != shard.size {
            problems.push(format!(
                "{key}: size mismatch: the object is {size} bytes, the manifest records {}",
                shard.size
            ));
        }
        problems.extend(state.finish(shard, size));
        Ok((Some(size), problems))
    }
}

/// Bytes read per request by [`CheckpointStore::verify`].
const VERIFY_WINDOW: u64 = 8 << 20;

/// Incremental hashes of a shard object and of each of its tensors, fed in order.
struct ShardHasher {
    whole: blake3::Hasher,
    /// (offset, end) of each tensor, in manifest order.
    ranges: Vec<(u64, u64)>,
    hashers: Vec<blake3::Hasher>,
    /// Bytes hashed so far.
    pos: u64,
}

impl ShardHasher {
    fn new(shard: &ShardEntry) -> Self {
        Self {
            whole: blake3::Hasher::new(),
            ranges: shard
                .tensors
                .iter()
                .map(|t| (t.offset, t.offset.saturating_add(t.len)))
                .collect(),
            hashers: vec![blake3::Hasher::new(); shard.tensors.len()],
            pos: 0,
        }
    }

    /// Hashes `chunk`, which starts at `start` (== bytes hashed so far).
    fn update(&mut self, start: u64, chunk: &[u8]) {
        debug_assert_eq!(start, self.pos);
        self.whole.update(chunk);
        let end = start + chunk.len() as u64;
        for (&(lo, hi), h) in self.ranges.iter().zip(self.hashers.iter_mut()) {
            let (lo, hi) = (lo.max(start), hi.min(end));
            if lo < hi {
                h.update(&chunk[(lo - start) as usize..(hi - start) as usize]);
            }
        }
        self.pos = end;
    }

    /// Compares the hashes with `shard`'s, for an object of `size` bytes.
    fn finish(self, shard: &ShardEntry, size: u64) -> Vec<String> {
        let key = &shard.key;
        let mut problems = Vec::new();
        if self.whole.finalize().to_hex().as_str() != shard.blake3 {
            problems.push(format!(
                "{key}: shard hash mismatch: the object's BLAKE3 differs from the manifest's"
            ));
        }
        for (t, h) in shard.tensors.iter().zip(self.hashers) {
            let end = t.offset.saturating_add(t.len);
            if end > size {
                problems.push(format!(
                    "{key}: tensor `{}` is truncated: it needs bytes {}..{end} but the object \
                     ends at {size}",
                    t.name, t.offset
                ));
            } else if h.finalize().to_hex().as_str() != t.blake3 {
                problems.push(format!(
                    "{key}: tensor `{}` hash mismatch (bytes {}..{end})",
                    t.name, t.offset
                ));
            }
        }
        problems
    }
}
