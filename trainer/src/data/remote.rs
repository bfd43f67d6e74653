//! A sharded dataset ([`super::shards`]) read from an object store (`s3://`, `gs://`, `az://`,
//! `file://`, or a local directory holding an `index.json`), as a [`TokenSource`].
//!
//! A sample is drawn exactly as from single-file token files (same offset from the same key, over
//! the same concatenated token stream), then read from the local cache when a verified copy is
//! there, else by byte range from the store:
//!
//! * version 2 datasets (block checks, see [`super::shards`]): the blocks the window overlaps,
//!   one ranged `GET` of the shard and one of its sidecar per shard the window touches (both at
//!   once), every block checked against its sidecar check and every whole chunk among them
//!   against its BLAKE3 hash; the bytes fetched are the window's, rounded out to whole blocks,
//!   plus 4 check bytes a block;
//! * version 1 datasets: the whole chunks the window overlaps, each checked against its BLAKE3
//!   hash.
//!
//! No token is used before its bytes pass their check; a corrupt cache file is discarded and
//! fetched again, a corrupt object is an error naming it.
//!
//! Reads retry with exponential backoff, `read_attempts` times of at most `read_timeout_s` each;
//! an object that stays missing, keeps failing its hash, or a store that stays unreachable is a
//! [`DataError`] naming the object (a permanent failure: the run stops, no node is blamed).
//!
//! The cache ([`Cache`]) is a directory of verified chunk files shared by the processes of a
//! host, bounded by `cache_bytes` (least recently used out, under a file lock). The training
//! samples of the steps after the one being read are fetched into it in the background
//! (`prefetch_steps`), from the rows and micro-batches this process read in its previous step.

use std::collections::BTreeSet;
use std::fs::File;
use std::future::Future;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};

use super::keys::{sample_rng, uniform_below};
use super::shards::{
    CHECK_BYTES, DatasetIndex, INDEX_FILE, MAX_INDEX_BYTES, Run, block_check, check_key,
};
use super::{DataConfig, DataError, SampleKey, Split, TokenDtype, TokenSource, check_span};

/// Byte counters of a [`ShardedSource`] (for tests and logs).
#[derive(Debug, Default)]
pub struct ReadStats {
    /// Bytes received from the store (shard bytes and block checks, retries included; the index
    /// excluded).
    pub fetched_bytes: AtomicU64,
    /// Of `fetched_bytes`, the bytes of block checks (sidecar objects).
    pub check_bytes: AtomicU64,
    /// Ranged reads answered by the store (shards and sidecars, retries excluded).
    pub requests: AtomicU64,
    /// Chunks (or block runs) served from the cache.
    pub cache_hits: AtomicU64,
    /// Cached chunk files found corrupt, discarded and fetched again.
    pub cache_corrupt: AtomicU64,
}

/// Retry policy of store reads.
#[derive(Clone, Copy, Debug)]
struct Retry {
    attempts: u32,
    timeout: Duration,
}

/// Samples the background prefetch reads at once.
const PREFETCH_READS: usize = 8;

/// First backoff between attempts; doubled after each, at most [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What the reader shares with its background tasks.
struct Inner {
    url: String,
    store: Arc<dyn ObjectStore>,
    index: DatasetIndex,
    /// [`DatasetIndex::shard_starts`] of train and val.
    starts: [Vec<u64>; 2],
    vocab_size: usize,
    cache: Option<Cache>,
    retry: Retry,
    stats: ReadStats,
}

/// Which train samples this process reads, to prefetch the next steps' ones.
#[derive(Default)]
struct Prefetch {
    /// The step being read and the (micro-batch, row, len, span) it read so far.
    step: Option<u64>,
    current: BTreeSet<(u64, u64, usize, (usize, usize))>,
    /// The last step whose samples were handed to the background.
    queued_to: Option<u64>,
}

/// A sharded dataset in an object store. See the module docs.
pub struct ShardedSource {
    inner: Arc<Inner>,
    prefetch_steps: u64,
    prefetch: Mutex<Prefetch>,
    /// Runs the store's futures; shut down in the background on drop (dropping a runtime inside
    /// another one's context would panic).
    rt: Option<tokio::runtime::Runtime>,
}

impl Drop for ShardedSource {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

fn split_slot(split: Split) -> usize {
    match split {
        Split::Train => 0,
        Split::Val => 1,
    }
}

/// Whether `source` names an object-store URL rather than a local path.
pub fn is_url(source: &str) -> bool {
    source.contains("://")
}

/// Whether `source` is a sharded dataset: a URL, or a local directory with an `index.json`.
pub fn is_sharded(source: &str) -> bool {
    let source = source.trim();
    !source.is_empty() && (is_url(source) || Path::new(source).join(INDEX_FILE).is_file())
}

/// Opens the object store at a dataset URL or local directory, with the checkpoint store's URL
/// forms and S3 settings (`AWS_ENDPOINT`, `AWS_ALLOW_HTTP`, `AWS_REGION`, credentials).
pub fn open_store(url: &str, read_only: bool) -> Result<Arc<dyn ObjectStore>, DataError> {
    let options = checkpoint::StoreOptions {
        read_only,
        ..Default::default()
    };
    checkpoint::CheckpointStore::open(url, &options)
        .map(|s| s.objects())
        .map_err(|e| DataError::Store {
            url: url.to_string(),
            action: "opening the dataset location".into(),
            detail: e.to_string(),
        })
}

impl ShardedSource {
    /// Opens the dataset at `cfg.source` for a model of `vocab_size` tokens: reads and validates
    /// its index (with the retry policy), checks it against `[data] dtype`, opens the cache.
    pub fn open(cfg: &DataConfig, vocab_size: usize) -> Result<ShardedSource, DataError> {
        let url = cfg.source.trim().trim_end_matches('/');
        let store = open_store(url, true)?;
        ShardedSource::open_with_store(cfg, vocab_size, store)
    }

    /// As [`open`](ShardedSource::open), reading through `store` (rooted at the dataset's
    /// prefix; `cfg.source` names it in messages and decides whether it is cached): e.g. a store
    /// behind an added latency, as `seqpipe bench data` uses.
    pub fn open_with_store(
        cfg: &DataConfig,
        vocab_size: usize,
        store: Arc<dyn ObjectStore>,
    ) -> Result<ShardedSource, DataError> {
        if vocab_size == 0 {
            return Err(DataError::InvalidConfig(
                "model.vocab_size is 0; set it to the dataset's vocab_size (50257 for GPT-2)"
                    .into(),
            ));
        }
        if cfg.read_attempts == 0 || !(cfg.read_timeout_s > 0.0 && cfg.read_timeout_s.is_finite()) {
            return Err(DataError::InvalidConfig(format!(
                "read_attempts = {} and read_timeout_s = {}: both must be positive (e.g. 4 and \
                 30.0)",
                cfg.read_attempts, cfg.read_timeout_s
            )));
        }
        let url = cfg.source.trim().trim_end_matches('/').to_string();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("seqpipe-data")
            .enable_all()
            .build()
            .map_err(|source| DataError::Io {
                action: "start the data reader's runtime for",
                path: PathBuf::from(&url),
                source,
            })?;
        let retry = Retry {
            attempts: cfg.read_attempts,
            timeout: Duration::try_from_secs_f64(cfg.read_timeout_s).map_err(|e| {
                DataError::InvalidConfig(format!(
                    "read_timeout_s = {}: {e} (use seconds, e.g. 30.0)",
                    cfg.read_timeout_s
                ))
            })?,
        };
        let index_bytes = {
            let (store, owned) = (Arc::clone(&store), url.clone());
            block_on(&rt, &url, async move {
                fetch(&*store, &owned, INDEX_FILE, None, retry, |b| {
                    if b.len() as u64 > MAX_INDEX_BYTES {
                        Err(format!("over {MAX_INDEX_BYTES} bytes"))
                    } else {
                        Ok(())
                    }
                })
                .await
            })??
        };
        let index = DatasetIndex::parse(&index_bytes, &format!("{url}/{INDEX_FILE}"))?;
        if index.dtype != cfg.dtype {
            return Err(DataError::Index {
                url: format!("{url}/{INDEX_FILE}"),
                message: format!(
                    "the dataset stores {} token ids but [data] dtype is \"{}\"; set [data] \
                     dtype = \"{}\"",
                    index.dtype, cfg.dtype, index.dtype
                ),
            });
        }
        let cache = if is_url(&url) && cfg.cache_bytes > 0 {
            let root = if cfg.cache_dir.trim().is_empty() {
                std::env::temp_dir().join("seqpipe-data-cache")
            } else {
                PathBuf::from(&cfg.cache_dir)
            };
            // Datasets sharing a cache directory never share files: each has its own folder,
            // named by its index's hash.
            let id = blake3::hash(&index_bytes).to_hex()[..16].to_string();
            Some(Cache::open(&root, &id, cfg.cache_bytes)?)
        } else {
            None
        };
        let starts = [
            index.shard_starts(Split::Train),
            index.shard_starts(Split::Val),
        ];
        Ok(ShardedSource {
            inner: Arc::new(Inner {
                url,
                store,
                index,
                starts,
                vocab_size,
                cache,
                retry,
                stats: ReadStats::default(),
            }),
            prefetch_steps: cfg.prefetch_steps,
            prefetch: Mutex::new(Prefetch::default()),
            rt: Some(rt),
        })
    }

    /// The dataset's index.
    pub fn index(&self) -> &DatasetIndex {
        &self.inner.index
    }

    /// Byte counters so far.
    pub fn stats(&self) -> &ReadStats {
        &self.inner.stats
    }

    /// Tokens in a split.
    pub fn tokens(&self, split: Split) -> u64 {
        self.inner.index.split(split).tokens
    }

    fn rt(&self) -> &tokio::runtime::Runtime {
        self.rt.as_ref().expect("the runtime lives until drop")
    }

    /// Tokens `[start, start + len)` of `split`, each checked against the model's vocabulary.
    pub fn window(&self, split: Split, start: u64, len: usize) -> Result<Vec<u32>, DataError> {
        let inner = Arc::clone(&self.inner);
        block_on(self.rt(), &self.inner.url, async move {
            inner.window(split, start, len).await
        })?
    }

    /// The launcher's start-up check (as [`super::TokenFiles::check`]): the split holds a sample
    /// of `sample_len` tokens and, with `scan`, every id in it fits the vocabulary.
    pub fn check(&self, split: Split, sample_len: usize, scan: bool) -> Result<(), DataError> {
        let tokens = self.tokens(split);
        let needed = (sample_len as u64).max(1);
        if tokens < needed {
            return Err(DataError::TooShort {
                path: PathBuf::from(format!("{} ({split} split)", self.inner.url)),
                tokens,
                needed,
            });
        }
        if scan {
            const CHUNK: u64 = 1 << 20;
            let mut start = 0;
            while start < tokens {
                let len = CHUNK.min(tokens - start);
                self.window(split, start, len as usize)?;
                start += len;
            }
        }
        Ok(())
    }

    /// Notes that train sample `key` is being read; on the first read of a new step, hands the
    /// next `prefetch_steps` steps' samples (same micro-batches and rows) to the background.
    fn note_read(&self, key: SampleKey, len: usize, span: &Range<usize>) {
        if self.prefetch_steps == 0 || self.inner.cache.is_none() {
            return;
        }
        let mut p = self.prefetch.lock().unwrap_or_else(|e| e.into_inner());
        if p.step != Some(key.step) {
            let previous = std::mem::take(&mut p.current);
            p.step = Some(key.step);
            if !previous.is_empty() {
                let from = p.queued_to.map_or(key.step + 1, |q| q.max(key.step) + 1);
                let to = key.step + self.prefetch_steps;
                if from <= to {
                    p.queued_to = Some(to);
                    let inner = Arc::clone(&self.inner);
                    let seed = key.seed;
                    let previous: Vec<_> = previous.into_iter().collect();
                    self.rt().spawn(async move {
                        for step in from..=to {
                            // Up to PREFETCH_READS samples in flight, so that the store's
                            // latency is paid once per group rather than once per sample.
                            for group in previous.chunks(PREFETCH_READS) {
                                let mut reads = tokio::task::JoinSet::new();
                                for &(micro_batch, row, len, (from, to)) in group {
                                    let key = SampleKey {
                                        seed,
                                        step,
                                        micro_batch,
                                        row,
                                    };
                                    let inner = Arc::clone(&inner);
                                    reads.spawn(async move {
                                        inner.sample(Split::Train, key, len, from..to).await
                                    });
                                }
                                while let Some(read) = reads.join_next().await {
                                    if let Ok(Err(e)) = read {
                                        // The foreground read of the same sample reports it.
                                        tracing::debug!(error = %e, "prefetch failed");
                                        return;
                                    }
                                }
                            }
                        }
                    });
                }
            }
        }
        p.current
            .insert((key.micro_batch, key.row, len, (span.start, span.end)));
    }
}

/// Runs `fut` on `rt` from synchronous code (also from inside another runtime's thread, where
/// `block_on` would panic).
fn block_on<T: Send + 'static>(
    rt: &tokio::runtime::Runtime,
    url: &str,
    fut: impl Future<Output = T> + Send + 'static,
) -> Result<T, DataError> {
    let (tx, rx) = std::sync::mpsc::channel();
    rt.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv().map_err(|_| DataError::Store {
        url: url.to_string(),
        action: "reading".into(),
        detail: "the data reader's task stopped without an answer".into(),
    })
}

impl Inner {
    /// Tokens `span` of the `len`-token sample `(split, key)`: only their chunks are read.
    async fn sample(
        &self,
        split: Split,
        key: SampleKey,
        len: usize,
        span: Range<usize>,
    ) -> Result<Vec<u32>, DataError> {
        check_span(len, &span)?;
        let tokens = self.index.split(split).tokens;
        if tokens < len as u64 || tokens == 0 {
            return Err(DataError::TooShort {
                path: PathBuf::from(format!("{} ({split} split)", self.url)),
                tokens,
                needed: (len as u64).max(1),
            });
        }
        let mut rng = sample_rng(split, key);
        let start = uniform_below(&mut rng, tokens - len as u64 + 1);
        self.window(split, start + span.start as u64, span.len())
            .await
    }

    async fn window(&self, split: Split, start: u64, len: usize) -> Result<Vec<u32>, DataError> {
        let starts = &self.starts[split_slot(split)];
        let outside = || {
            DataError::InvalidArgument(format!(
                "window [{start}, {start} + {len}) is outside the {split} split of {} ({} tokens)",
                self.url,
                self.index.split(split).tokens
            ))
        };
        let mut out = Vec::with_capacity(len);
        if self.index.block_bytes.is_some() {
            let runs = self
                .index
                .runs(starts, start, len as u64)
                .ok_or_else(outside)?;
            for run in runs {
                let bytes = self.blocks(split, run).await?;
                let shard = &self.index.split(split).shards[run.shard];
                let at = self
                    .index
                    .block_ranges(shard.bytes, run.first_block, run.end_block);
                self.decode(
                    shard,
                    &bytes[run.from..run.to],
                    at.0.start + run.from as u64,
                    &mut out,
                )?;
            }
            return Ok(out);
        }
        let pieces = self
            .index
            .pieces(starts, start, len as u64)
            .ok_or_else(outside)?;
        for piece in pieces {
            let chunk = self.chunk(split, piece.shard, piece.chunk).await?;
            let shard = &self.index.split(split).shards[piece.shard];
            let chunk_start = self.index.chunk_range(shard.bytes, piece.chunk).start;
            self.decode(
                shard,
                &chunk[piece.from..piece.to],
                chunk_start + piece.from as u64,
                &mut out,
            )?;
        }
        Ok(out)
    }

    /// Appends the token ids in `bytes` (which start at byte `offset` of `shard`) to `out`,
    /// each checked against the model's vocabulary.
    fn decode(
        &self,
        shard: &super::shards::ShardEntry,
        bytes: &[u8],
        offset: u64,
        out: &mut Vec<u32>,
    ) -> Result<(), DataError> {
        let width = self.index.dtype.width();
        for (i, id) in bytes.chunks_exact(width).enumerate() {
            let value = match self.index.dtype {
                TokenDtype::U16 => u32::from(u16::from_le_bytes([id[0], id[1]])),
                TokenDtype::U32 => u32::from_le_bytes([id[0], id[1], id[2], id[3]]),
            };
            if value as usize >= self.vocab_size {
                let byte_offset = offset + (i * width) as u64;
                return Err(DataError::TokenOutOfRange {
                    path: PathBuf::from(format!("{}/{}", self.url, shard.key)),
                    index: byte_offset / width as u64,
                    byte_offset,
                    value,
                    vocab_size: self.vocab_size,
                });
            }
            out.push(value);
        }
        Ok(())
    }

    /// Checks the bytes of blocks `first_block..` of `shard` against `checks` (their sidecar
    /// checks), and every whole chunk among them against its BLAKE3 hash. The error says which
    /// block or chunk failed.
    fn verify_blocks(
        &self,
        split: Split,
        shard: usize,
        first_block: u64,
        data: &[u8],
        checks: &[u8],
    ) -> Result<(), String> {
        let block = self.index.block_bytes.expect("version 2") as usize;
        let blocks = data.len().div_ceil(block);
        if checks.len() != blocks * CHECK_BYTES as usize {
            return Err(format!(
                "{} check bytes for {blocks} blocks of {} bytes",
                checks.len(),
                data.len()
            ));
        }
        let start = first_block * block as u64;
        for (i, (bytes, want)) in data
            .chunks(block)
            .zip(checks.chunks_exact(CHECK_BYTES as usize))
            .enumerate()
        {
            let b = first_block + i as u64;
            let got = block_check(split, shard, b, bytes);
            let want = u32::from_le_bytes([want[0], want[1], want[2], want[3]]);
            if got != want {
                let from = start + (i * block) as u64;
                return Err(format!(
                    "block {b} (bytes {from}..{}) checks to {got:08x}, but {} says {want:08x}",
                    from + bytes.len() as u64,
                    check_key(split, shard)
                ));
            }
        }
        // Whole chunks in the range: their BLAKE3 hashes too.
        let entry = &self.index.split(split).shards[shard];
        let end = start + data.len() as u64;
        let mut chunk = start.div_ceil(self.index.chunk_bytes) as usize;
        loop {
            let range = self.index.chunk_range(entry.bytes, chunk);
            if range.start >= entry.bytes || range.end > end {
                break;
            }
            let bytes = &data[(range.start - start) as usize..(range.end - start) as usize];
            let got = blake3::hash(bytes).to_hex();
            if got.as_str() != entry.chunks[chunk] {
                return Err(format!(
                    "bytes {range:?} hash to {got}, but the index says {}",
                    entry.chunks[chunk]
                ));
            }
            chunk += 1;
        }
        Ok(())
    }

    /// The bytes of the blocks of `run` (version 2), verified: from the cache, else two ranged
    /// reads at once, of the shard and of its sidecar. Cached as the bytes followed by their
    /// checks, so that a cached copy is checked again on every read.
    async fn blocks(&self, split: Split, run: Run) -> Result<Bytes, DataError> {
        let entry = &self.index.split(split).shards[run.shard];
        let (range, check_range) =
            self.index
                .block_ranges(entry.bytes, run.first_block, run.end_block);
        let data_len = (range.end - range.start) as usize;
        let name = format!(
            "{}-{:06}-b{}-{}.bin",
            split.as_str(),
            run.shard,
            run.first_block,
            run.end_block
        );
        let verify = |b: &[u8]| {
            b.len() > data_len
                && self
                    .verify_blocks(
                        split,
                        run.shard,
                        run.first_block,
                        &b[..data_len],
                        &b[data_len..],
                    )
                    .is_ok()
        };
        if let Some(bytes) = self.cached(&name, verify) {
            return Ok(bytes.slice(..data_len));
        }
        let checks_key = check_key(split, run.shard);
        let exact = |want: u64| {
            move |b: &[u8]| {
                if b.len() as u64 == want {
                    Ok(())
                } else {
                    Err(format!(
                        "{} bytes came back for a {want}-byte range",
                        b.len()
                    ))
                }
            }
        };
        let (checks, mut data) = tokio::try_join!(
            fetch(
                &*self.store,
                &self.url,
                &checks_key,
                Some(check_range.clone()),
                self.retry,
                exact(check_range.end - check_range.start),
            ),
            fetch(
                &*self.store,
                &self.url,
                &entry.key,
                Some(range.clone()),
                self.retry,
                exact(range.end - range.start),
            )
        )?;
        self.count(2, data.len() + checks.len(), checks.len());
        if self
            .verify_blocks(split, run.shard, run.first_block, &data, &checks)
            .is_err()
        {
            // Read the shard's bytes again until they pass (a flipped bit in transit), or name
            // the object once the attempts are spent.
            data = fetch(
                &*self.store,
                &self.url,
                &entry.key,
                Some(range.clone()),
                self.retry,
                |b| {
                    exact(range.end - range.start)(b)?;
                    self.verify_blocks(split, run.shard, run.first_block, b, &checks)
                },
            )
            .await?;
            self.count(1, data.len(), 0);
        }
        if let Some(cache) = &self.cache {
            let mut file = Vec::with_capacity(data.len() + checks.len());
            file.extend_from_slice(&data);
            file.extend_from_slice(&checks);
            if let Err(e) = cache.put(&name, &file) {
                tracing::warn!(error = %e, "data cache: cannot store {name}");
            }
        }
        Ok(data)
    }

    /// The verified copy of `name` in the cache, counting a hit or a corrupt copy (which the cache
    /// has removed); none when there is no cache or the store must be read.
    fn cached(&self, name: &str, verify: impl Fn(&[u8]) -> bool) -> Option<Bytes> {
        match self.cache.as_ref()?.get(name, verify) {
            CacheRead::Hit(bytes) => {
                self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
                Some(bytes)
            }
            CacheRead::Corrupt => {
                self.stats.cache_corrupt.fetch_add(1, Ordering::Relaxed);
                None
            }
            CacheRead::Miss => None,
        }
    }

    /// Counts `requests` answered with `bytes`, of which `check_bytes` were block checks.
    fn count(&self, requests: u64, bytes: usize, check_bytes: usize) {
        self.stats.requests.fetch_add(requests, Ordering::Relaxed);
        self.stats
            .fetched_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        self.stats
            .check_bytes
            .fetch_add(check_bytes as u64, Ordering::Relaxed);
    }

    /// Chunk `chunk` of shard `shard` of `split`, verified: from the cache, else the store.
    async fn chunk(&self, split: Split, shard: usize, chunk: usize) -> Result<Bytes, DataError> {
        let entry = &self.index.split(split).shards[shard];
        let want = &entry.chunks[chunk];
        let name = format!("{}-{shard:06}-{chunk:06}.bin", split.as_str());
        if let Some(bytes) = self.cached(&name, |b| blake3::hash(b).to_hex().as_str() == want) {
            return Ok(bytes);
        }
        let range = self.index.chunk_range(entry.bytes, chunk);
        let bytes = fetch(
            &*self.store,
            &self.url,
            &entry.key,
            Some(range.clone()),
            self.retry,
            |b| {
                if b.len() as u64 != range.end - range.start {
                    return Err(format!(
                        "{} bytes came back for the {}-byte range {range:?}",
                        b.len(),
                        range.end - range.start
                    ));
                }
                let got = blake3::hash(b).to_hex();
                if got.as_str() != want {
                    return Err(format!(
                        "bytes {range:?} hash to {got}, but the index says {want}"
                    ));
                }
                Ok(())
            },
        )
        .await?;
        self.count(1, bytes.len(), 0);
        if let Some(cache) = &self.cache
            && let Err(e) = cache.put(&name, &bytes)
        {
            // A cache that cannot be written costs speed, not correctness.
            tracing::warn!(error = %e, "data cache: cannot store {name}");
        }
        Ok(bytes)
    }
}

/// How the last attempt of a read failed.
enum Failure {
    Missing,
    Corrupt(String),
    Unreachable(String),
}

/// Reads `key` (or a byte range of it) with `retry`, accepting the bytes only if `check` passes.
async fn fetch(
    store: &dyn ObjectStore,
    url: &str,
    key: &str,
    range: Option<std::ops::Range<u64>>,
    retry: Retry,
    check: impl Fn(&[u8]) -> Result<(), String>,
) -> Result<Bytes, DataError> {
    let path = ObjectPath::from(key);
    let mut backoff = FIRST_BACKOFF;
    let mut last = Failure::Unreachable("no attempt".into());
    for attempt in 1..=retry.attempts {
        if attempt > 1 {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
        let read = async {
            match &range {
                Some(r) => store.get_range(&path, r.clone()).await,
                None => match store.get(&path).await {
                    Ok(got) => got.bytes().await,
                    Err(e) => Err(e),
                },
            }
        };
        last = match tokio::time::timeout(retry.timeout, read).await {
            Ok(Ok(bytes)) => match check(&bytes) {
                Ok(()) => return Ok(bytes),
                Err(why) => Failure::Corrupt(why),
            },
            Ok(Err(object_store::Error::NotFound { .. })) => Failure::Missing,
            Ok(Err(e)) => Failure::Unreachable(e.to_string()),
            Err(_) => Failure::Unreachable(format!("no answer within {:?}", retry.timeout)),
        };
        tracing::warn!(url, key, attempt, "dataset read failed; retrying");
    }
    let (url, key, attempts) = (url.to_string(), key.to_string(), retry.attempts);
    Err(match last {
        Failure::Missing => DataError::ObjectMissing { url, key, attempts },
        Failure::Corrupt(detail) => DataError::ObjectCorrupt {
            url,
            key,
            attempts,
            detail,
        },
        Failure::Unreachable(detail) => DataError::StoreUnreachable {
            url,
            key,
            attempts,
            detail,
        },
    })
}

impl TokenSource for ShardedSource {
    fn vocab_size(&self) -> usize {
        self.inner.index.vocab_size
    }

    fn describe(&self) -> String {
        format!(
            "sharded dataset at {} ({} ids; {} train / {} val tokens in {} + {} shards)",
            self.inner.url,
            self.inner.index.dtype,
            self.inner.index.train.tokens,
            self.inner.index.val.tokens,
            self.inner.index.train.shards.len(),
            self.inner.index.val.shards.len()
        )
    }

    /// `end_of_text` from the dataset's index (validated below its vocabulary when read).
    fn end_of_text(&self) -> Option<u32> {
        self.inner.index.end_of_text
    }

    fn end_of_text_missing(&self) -> String {
        format!(
            "its {INDEX_FILE} was written before `seqpipe data prepare` recorded \"end_of_text\" \
             there: prepare the corpus again with `seqpipe data prepare --out URL` to a new \
             location (a dataset is never overwritten) and set data.source to it"
        )
    }

    fn sample(&self, split: Split, key: SampleKey, len: usize) -> Result<Vec<u32>, DataError> {
        self.sample_span(split, key, len, 0..len)
    }

    /// Reads only the chunks that overlap `span` of the sample's window.
    fn sample_span(
        &self,
        split: Split,
        key: SampleKey,
        len: usize,
        span: Range<usize>,
    ) -> Result<Vec<u32>, DataError> {
        if split == Split::Train {
            self.note_read(key, len, &span);
        }
        let inner = Arc::clone(&self.inner);
        block_on(self.rt(), &self.inner.url, async move {
            inner.sample(split, key, len, span).await
        })?
    }
}

/// What the cache had for a chunk.
enum CacheRead {
    Hit(Bytes),
    Miss,
    /// A file was there but failed its hash: it has been removed.
    Corrupt,
}

/// A directory of verified chunk files, `<root>/<dataset id>/<name>`, whose total size (all
/// datasets together) stays within `cap` bytes: inserts run under an exclusive lock on
/// `<root>/.lock` and first evict the least recently used files (by modification time, which a
/// hit refreshes). Processes of one host may share it.
pub struct Cache {
    root: PathBuf,
    dir: PathBuf,
    cap: u64,
}

/// Name of the lock file at the cache root.
const LOCK_FILE: &str = ".lock";
/// Suffix of files being written (removed by the next insert if a writer died).
const TMP_SUFFIX: &str = ".tmp";

impl Cache {
    /// Opens (creating) the cache for dataset `id` under `root`, bounded by `cap` bytes.
    pub fn open(root: &Path, id: &str, cap: u64) -> Result<Cache, DataError> {
        let dir = root.join(id);
        std::fs::create_dir_all(&dir).map_err(|source| DataError::Io {
            action: "create the data cache directory",
            path: dir.clone(),
            source,
        })?;
        Ok(Cache {
            root: root.to_path_buf(),
            dir,
            cap,
        })
    }

    /// The file `name` if `verify` accepts its bytes; a file it refuses is removed.
    fn get(&self, name: &str, verify: impl Fn(&[u8]) -> bool) -> CacheRead {
        let path = self.dir.join(name);
        let Ok(bytes) = std::fs::read(&path) else {
            return CacheRead::Miss;
        };
        if !verify(&bytes) {
            tracing::warn!(
                file = %path.display(),
                "data cache: file fails its hash; discarding it and fetching the chunk again"
            );
            let _lock = self.lock();
            let _ = std::fs::remove_file(&path);
            return CacheRead::Corrupt;
        }
        // Most recently used: refresh the time eviction orders by.
        if let Ok(f) = File::options().append(true).open(&path) {
            let _ = f.set_modified(SystemTime::now());
        }
        CacheRead::Hit(Bytes::from(bytes))
    }

    /// An exclusive lock on the cache root (released on drop); `None` if it cannot be taken,
    /// in which case the caller goes on without it.
    fn lock(&self) -> Option<File> {
        let file = File::options()
            .create(true)
            .append(true)
            .open(self.root.join(LOCK_FILE))
            .ok()?;
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a descriptor we own; the lock is released when the file is closed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
        (rc == 0).then_some(file)
    }

    /// Stores `bytes` as `name`, first evicting least recently used files so that the cache stays
    /// within its cap. A chunk larger than the cap is not stored.
    fn put(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        let len = bytes.len() as u64;
        if len > self.cap {
            return Ok(());
        }
        let _lock = self
            .lock()
            .ok_or_else(|| std::io::Error::other("cannot lock the cache"))?;
        let mut files = Vec::new();
        for dataset in std::fs::read_dir(&self.root)? {
            let dataset = dataset?.path();
            if !dataset.is_dir() {
                continue;
            }
            for entry in std::fs::read_dir(&dataset)? {
                let entry = entry?;
                let path = entry.path();
                let Ok(meta) = entry.metadata() else { continue };
                if path.extension().is_some_and(|e| e == &TMP_SUFFIX[1..]) {
                    // Left by a writer that died (writes happen under this lock).
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
                let used = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                files.push((used, meta.len(), path));
            }
        }
        let target = self.dir.join(name);
        if target.is_file() {
            // Stored meanwhile by another reader (e.g. the prefetch); a corrupt copy would have
            // been removed by `get`, and the next `get` checks it again.
            return Ok(());
        }
        let mut total: u64 = files.iter().map(|(_, n, _)| n).sum();
        files.sort();
        for (_, n, path) in files {
            if total + len <= self.cap {
                break;
            }
            std::fs::remove_file(&path)?;
            total -= n;
        }
        let tmp = self.dir.join(format!("{name}{TMP_SUFFIX}"));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &target)
    }

    /// Total bytes of the cache's files (all datasets).
    pub fn total_bytes(root: &Path) -> u64 {
        let mut total = 0;
        for dataset in std::fs::read_dir(root).into_iter().flatten().flatten() {
            for f in std::fs::read_dir(dataset.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                total += f.metadata().map_or(0, |m| m.len());
            }
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::super::bin::tests::TempDir;
    use super::super::bin::{DatasetMeta, META_FILE};
    use super::super::shards::{ShardLayout, Target, publish};
    use super::super::{TokenFiles, open_source};
    use super::*;

    /// A single-file dataset of `n` train tokens (documents of 13 tokens ending in id 99) and
    /// 200 val tokens in `dir`, and the same dataset sharded (64-byte shards of 16-byte chunks,
    /// no block checks: version 1) at `file://<dir>/sharded`, whose URL is returned.
    fn datasets(dir: &Path, n: u64) -> String {
        datasets_with(
            dir,
            n,
            ShardLayout {
                shard_bytes: 64,
                chunk_bytes: 16,
                block_bytes: 0,
            },
        )
    }

    /// As [`datasets`], sharded with `layout`.
    fn datasets_with(dir: &Path, n: u64, layout: ShardLayout) -> String {
        let train: Vec<u8> = (0..n)
            .flat_map(|i| {
                (if i % 13 == 12 {
                    99
                } else {
                    (i * 7 % 97) as u16
                })
                .to_le_bytes()
            })
            .collect();
        let val: Vec<u8> = (0..200u16).flat_map(|i| (i % 50).to_le_bytes()).collect();
        std::fs::write(dir.join("train.bin"), &train).unwrap();
        std::fs::write(dir.join("val.bin"), &val).unwrap();
        let meta = DatasetMeta {
            vocab_size: 100,
            dtype: TokenDtype::U16,
            tokenizer: "test".into(),
            train_tokens: n,
            val_tokens: 200,
            end_of_text: None,
        };
        std::fs::write(dir.join(META_FILE), serde_json::to_string(&meta).unwrap()).unwrap();
        let url = format!("file://{}/sharded", dir.display());
        let target = Target {
            url: url.clone(),
            store: open_store(&url, false).unwrap(),
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let index = rt
            .block_on(publish(dir, &meta, Some(99), layout, &target))
            .unwrap();
        assert_eq!(index.train.tokens, n);
        assert_eq!(
            index.train.shards.len() as u64,
            (2 * n).div_ceil(layout.shard_bytes)
        );
        assert_eq!(index.train.documents, n.div_ceil(13));
        // The same location is never overwritten.
        let again = rt.block_on(publish(dir, &meta, Some(99), layout, &target));
        assert!(
            matches!(again, Err(DataError::DatasetExists { .. })),
            "{again:?}"
        );
        url
    }

    fn cfg(source: &str, cache: &Path, cache_bytes: u64) -> DataConfig {
        DataConfig {
            source: source.into(),
            cache_dir: cache.display().to_string(),
            cache_bytes,
            read_attempts: 2,
            read_timeout_s: 10.0,
            ..DataConfig::default()
        }
    }

    fn key(step: u64, micro_batch: u64, row: u64) -> SampleKey {
        SampleKey {
            seed: 7,
            step,
            micro_batch,
            row,
        }
    }

    /// Each stage of a 3-stage pipeline fetches exactly the chunks that overlap its part of each
    /// row (inputs on the first, targets on the last) and the middle stage nothing; the parts are
    /// the whole rows' tokens, and reading both parts costs more than either.
    #[test]
    fn each_stage_fetches_only_the_chunks_of_its_part_of_the_rows() {
        use super::super::keys::{sample_rng, uniform_below};
        use super::super::{RowPart, micro_batch_part, micro_batch_tokens};
        let tmp = TempDir::new("stage-bytes");
        let n = 1000;
        let url = datasets(&tmp.0, n);
        let (seq_len, batch, micro_batches) = (32, 4, 24);
        // The bytes of the 16-byte chunks that tokens [from, to) overlap (2 bytes a token).
        let chunk_bytes = |from: u64, to: u64| -> u64 {
            let (first, end) = (from * 2 / 16, (to * 2).div_ceil(16));
            (first..end)
                .map(|c| (c * 16 + 16).min(2 * n) - c * 16)
                .sum()
        };
        let mut per_stage = Vec::new();
        for (stage, (first, last)) in [(true, false), (false, false), (false, true)]
            .into_iter()
            .enumerate()
        {
            // No cache: every chunk a stage needs is fetched from the store, once per row.
            let src = ShardedSource::open(&cfg(&url, &tmp.0.join("cache"), 0), 100).unwrap();
            let mut expected = 0;
            if let Some(part) = RowPart::for_stage(first, last) {
                let span = part.span(seq_len);
                for mb in 0..micro_batches {
                    let got = micro_batch_part(&src, Split::Train, 7, 3, mb, batch, seq_len, part)
                        .unwrap();
                    let whole =
                        micro_batch_tokens(&src, Split::Train, 7, 3, mb, batch, seq_len).unwrap();
                    let want: Vec<u32> = whole
                        .chunks_exact(seq_len + 1)
                        .flat_map(|row| row[span.clone()].to_vec())
                        .collect();
                    assert_eq!(got, want, "stage {stage}, micro-batch {mb}");
                    for row in 0..batch as u64 {
                        let mut rng = sample_rng(Split::Train, key(3, mb, row));
                        let start = uniform_below(&mut rng, n - seq_len as u64);
                        expected += chunk_bytes(start + span.start as u64, start + span.end as u64);
                    }
                }
                // The whole rows were read too (for the comparison): subtract them.
                let whole_bytes: u64 = (0..micro_batches)
                    .flat_map(|mb| (0..batch as u64).map(move |row| (mb, row)))
                    .map(|(mb, row)| {
                        let mut rng = sample_rng(Split::Train, key(3, mb, row));
                        let start = uniform_below(&mut rng, n - seq_len as u64);
                        chunk_bytes(start, start + seq_len as u64 + 1)
                    })
                    .sum();
                let fetched = src.stats().fetched_bytes.load(Ordering::Relaxed);
                assert_eq!(fetched - whole_bytes, expected, "stage {stage}");
                assert!(
                    expected < whole_bytes,
                    "stage {stage}: {expected} vs {whole_bytes}"
                );
            } else {
                assert_eq!(src.stats().fetched_bytes.load(Ordering::Relaxed), 0);
            }
            per_stage.push(expected);
        }
        assert_eq!(per_stage[1], 0);
        assert!(per_stage[0] > 0 && per_stage[2] > 0, "{per_stage:?}");
    }

    /// With block checks, each stage of a 3-stage pipeline fetches exactly its part of each row
    /// rounded out to whole blocks, plus 4 check bytes a block, in two requests per shard a row
    /// touches (the middle stage fetches nothing). At the bench's shape (rows of 1024 u16
    /// tokens, 128-byte blocks) that is at most 1.1 bytes fetched per byte used, where whole
    /// 16 KiB chunks fetch several times more.
    #[test]
    fn with_blocks_each_stage_fetches_its_part_rounded_to_blocks_within_a_tenth() {
        use super::super::keys::{sample_rng, uniform_below};
        use super::super::{RowPart, micro_batch_part};
        let tmp = TempDir::new("stage-blocks");
        let n: u64 = 1 << 17;
        let (shard, block) = (64u64 << 10, 128u64);
        let mut urls = Vec::new();
        for block_bytes in [block, 0] {
            let dir = tmp.0.join(format!("b{block_bytes}"));
            std::fs::create_dir_all(&dir).unwrap();
            let layout = ShardLayout {
                shard_bytes: shard,
                chunk_bytes: 16 << 10,
                block_bytes,
            };
            urls.push(datasets_with(&dir, n, layout));
        }
        let (seq_len, batch, micro_batches) = (1024usize, 4, 8);
        // (data bytes, check bytes, requests) of tokens [from, to): per shard, its blocks.
        let cost = |from: u64, to: u64| -> (u64, u64, u64) {
            let (mut byte, stop) = (from * 2, to * 2);
            let mut c = (0, 0, 0);
            while byte < stop {
                let shard_start = byte / shard * shard;
                let end = stop.min(shard_start + shard);
                let (first, last) = (
                    (byte - shard_start) / block,
                    (end - shard_start).div_ceil(block),
                );
                c.0 += (last * block).min(shard) - first * block;
                c.1 += 4 * (last - first);
                c.2 += 2;
                byte = end;
            }
            c
        };
        for (stage, (first, last)) in [(true, false), (false, false), (false, true)]
            .into_iter()
            .enumerate()
        {
            let part = RowPart::for_stage(first, last);
            let mut ratios = Vec::new();
            for url in &urls {
                // No cache: every byte a stage needs comes from the store.
                let src = ShardedSource::open(&cfg(url, &tmp.0.join("cache"), 0), 100).unwrap();
                let Some(part) = part else {
                    assert_eq!(src.stats().fetched_bytes.load(Ordering::Relaxed), 0);
                    continue;
                };
                let span = part.span(seq_len);
                let mut want = (0, 0, 0);
                for mb in 0..micro_batches {
                    micro_batch_part(&src, Split::Train, 7, 3, mb, batch, seq_len, part).unwrap();
                    for row in 0..batch as u64 {
                        let mut rng = sample_rng(Split::Train, key(3, mb, row));
                        let start = uniform_below(&mut rng, n - seq_len as u64);
                        let c = cost(start + span.start as u64, start + span.end as u64);
                        want = (want.0 + c.0, want.1 + c.1, want.2 + c.2);
                    }
                }
                let stats = src.stats();
                let fetched = stats.fetched_bytes.load(Ordering::Relaxed);
                if src.index().block_bytes.is_some() {
                    assert_eq!(
                        (
                            fetched,
                            stats.check_bytes.load(Ordering::Relaxed),
                            stats.requests.load(Ordering::Relaxed)
                        ),
                        (want.0 + want.1, want.1, want.2),
                        "stage {stage}"
                    );
                }
                let used = micro_batches * batch as u64 * span.len() as u64 * 2;
                ratios.push(fetched as f64 / used as f64);
            }
            if part.is_some() {
                assert!(ratios[0] <= 1.1, "stage {stage}: {ratios:?}");
                assert!(ratios[1] > 4.0, "stage {stage}: {ratios:?}");
            }
        }
    }

    /// A byte flipped in a shard's sidecar is a data error naming the shard and the sidecar; a
    /// byte flipped in a cached block run is detected, the run fetched again.
    #[test]
    fn with_blocks_a_corrupt_sidecar_or_cache_file_is_caught() {
        let tmp = TempDir::new("blocks-corrupt");
        let layout = ShardLayout {
            shard_bytes: 64,
            chunk_bytes: 16,
            block_bytes: 4,
        };
        let url = datasets_with(&tmp.0, 1000, layout);
        let files = TokenFiles::open(&tmp.0, TokenDtype::U16, 100).unwrap();
        let cache = tmp.0.join("cache");
        // Cache every run of shard 2, then flip one byte in each cached file.
        let src = ShardedSource::open(&cfg(&url, &cache, 1 << 20), 100).unwrap();
        for start in 32..64 {
            assert_eq!(
                src.window(Split::Train, start, 3).unwrap(),
                files.window(Split::Train, start, 3).unwrap()
            );
        }
        let cached: Vec<PathBuf> = std::fs::read_dir(&src.inner.cache.as_ref().unwrap().dir)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect();
        assert!(!cached.is_empty());
        for (i, f) in cached.iter().enumerate() {
            let mut bytes = std::fs::read(f).unwrap();
            let at = i % bytes.len();
            bytes[at] ^= 0x04;
            std::fs::write(f, bytes).unwrap();
        }
        let again = ShardedSource::open(&cfg(&url, &cache, 1 << 20), 100).unwrap();
        for start in 32..64 {
            assert_eq!(
                again.window(Split::Train, start, 3).unwrap(),
                files.window(Split::Train, start, 3).unwrap()
            );
        }
        assert_eq!(
            again.stats().cache_corrupt.load(Ordering::Relaxed),
            cached.len() as u64
        );
        // The sidecar of shard 3 corrupt in the store: its shard's reads fail, naming both.
        let sidecar = tmp.0.join("sharded/train/000003.crc");
        let mut bytes = std::fs::read(&sidecar).unwrap();
        bytes[9] ^= 0x01;
        std::fs::write(&sidecar, bytes).unwrap();
        let msg = again
            .window(Split::Train, 3 * 32, 8)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains(&format!("{url}/train/000003.bin is corrupt"))
                && msg.contains("block 2 (bytes 8..12)")
                && msg.contains("train/000003.crc"),
            "{msg}"
        );
        // A missing sidecar is a missing object.
        std::fs::remove_file(&sidecar).unwrap();
        let msg = again
            .window(Split::Train, 3 * 32, 8)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains(&format!("{url}/train/000003.crc is missing")),
            "{msg}"
        );
    }

    /// Both layouts: version 1 (whole chunks) and version 2 (blocks of 4 bytes with checks).
    fn layouts() -> [(&'static str, ShardLayout); 2] {
        let layout = |block_bytes| ShardLayout {
            shard_bytes: 64,
            chunk_bytes: 16,
            block_bytes,
        };
        [("chunks", layout(0)), ("blocks", layout(4))]
    }

    /// The same samples from the single files, the shards cold, the shards warm, a cache too small
    /// for the data (its size checked after every sample), and a byte flipped in a cached file,
    /// with either layout.
    #[test]
    fn sharded_samples_equal_single_file_samples_through_the_cache() {
        for (tag, layout) in layouts() {
            samples_through_the_cache(tag, layout);
        }
    }

    fn samples_through_the_cache(tag: &str, layout: ShardLayout) {
        let tmp = TempDir::new(&format!("sharded-{tag}"));
        let url = datasets_with(&tmp.0, 1000, layout);
        let files = TokenFiles::open(&tmp.0, TokenDtype::U16, 100).unwrap();
        let cache = tmp.0.join("cache");
        let keys: Vec<SampleKey> = (0..12)
            .flat_map(|s| (0..2).flat_map(move |m| (0..2).map(move |r| key(s, m, r))))
            .collect();
        let want: Vec<Vec<u32>> = keys
            .iter()
            .map(|&k| files.sample(Split::Train, k, 33).unwrap())
            .collect();
        for pass in ["cold", "warm"] {
            let mut c = cfg(&url, &cache, 1 << 20);
            if pass == "warm" {
                // Its prefetch would read past the last step (new samples, never cached).
                c.prefetch_steps = 0;
            }
            let src = ShardedSource::open(&c, 100).unwrap();
            for (k, w) in keys.iter().zip(&want) {
                assert_eq!(
                    &src.sample(Split::Train, *k, 33).unwrap(),
                    w,
                    "{pass} {k:?}"
                );
            }
            let stats = src.stats();
            if pass == "warm" {
                assert_eq!(
                    stats.fetched_bytes.load(Ordering::Relaxed),
                    0,
                    "warm fetched"
                );
                assert!(stats.cache_hits.load(Ordering::Relaxed) > 0);
            }
        }
        assert_eq!(
            open_source(&cfg(&url, &cache, 1 << 20), 100)
                .unwrap()
                .vocab_size(),
            100
        );
        // A cache of 5 chunks (or a few block runs with their checks), over samples touching far
        // more: never over its cap, yet used.
        let cap = if layout.block_bytes > 0 { 300 } else { 80 };
        let small = tmp.0.join("small");
        let src = ShardedSource::open(&cfg(&url, &small, cap), 100).unwrap();
        for (k, w) in keys.iter().zip(&want) {
            assert_eq!(&src.sample(Split::Train, *k, 33).unwrap(), w);
            let used = Cache::total_bytes(&small);
            assert!(used <= cap, "cache holds {used} bytes, cap {cap}");
        }
        assert!(Cache::total_bytes(&small) > 0);
        assert!(src.stats().fetched_bytes.load(Ordering::Relaxed) > cap * 4);
        // Flip a byte of every cached file: each is detected, discarded and fetched again.
        let dataset_dir = std::fs::read_dir(&cache)
            .unwrap()
            .flatten()
            .find(|e| e.path().is_dir())
            .unwrap()
            .path();
        let mut flipped = 0;
        for f in std::fs::read_dir(&dataset_dir).unwrap().flatten() {
            let mut bytes = std::fs::read(f.path()).unwrap();
            bytes[0] ^= 0x01;
            std::fs::write(f.path(), bytes).unwrap();
            flipped += 1;
        }
        assert!(flipped > 0);
        let src = ShardedSource::open(&cfg(&url, &cache, 1 << 20), 100).unwrap();
        for (k, w) in keys.iter().zip(&want) {
            assert_eq!(&src.sample(Split::Train, *k, 33).unwrap(), w);
        }
        assert!(src.stats().cache_corrupt.load(Ordering::Relaxed) > 0);
        // Val is scanned whole at start-up.
        src.check(Split::Val, 33, true).unwrap();
        assert_eq!(
            src.window(Split::Val, 0, 200).unwrap(),
            files.window(Split::Val, 0, 200).unwrap()
        );
    }

    /// The separator `publish` was given is the sharded source's `end_of_text`, so document masks
    /// find their documents; an index written before it was recorded opens and samples as before
    /// without masks, and is refused with them, naming the dataset and what to do.
    #[test]
    fn the_index_end_of_text_is_the_separator_and_an_old_index_is_refused_for_masks() {
        use super::super::document_separator;
        let tmp = TempDir::new("sharded-eot");
        let url = datasets(&tmp.0, 300);
        let cache = tmp.0.join("cache");
        let masked = DataConfig {
            document_mask: true,
            ..cfg(&url, &cache, 1 << 20)
        };
        let src = ShardedSource::open(&masked, 100).unwrap();
        assert_eq!(src.end_of_text(), Some(99));
        assert_eq!(document_separator(&masked, &src).unwrap(), Some(99));
        let want = src.sample(Split::Train, key(0, 0, 0), 40).unwrap();
        drop(src);

        let index_path = tmp.0.join("sharded").join(INDEX_FILE);
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
        assert_eq!(json["end_of_text"], 99);
        json.as_object_mut().unwrap().remove("end_of_text");
        std::fs::write(&index_path, serde_json::to_vec(&json).unwrap()).unwrap();
        let plain = cfg(&url, &cache, 1 << 20);
        let old = ShardedSource::open(&plain, 100).unwrap();
        assert_eq!(old.end_of_text(), None);
        assert_eq!(document_separator(&plain, &old).unwrap(), None);
        assert_eq!(old.sample(Split::Train, key(0, 0, 0), 40).unwrap(), want);
        let err = document_separator(&masked, &old).unwrap_err().to_string();
        assert!(
            err.contains(&url)
                && err.contains("end_of_text")
                && err.contains(INDEX_FILE)
                && err.contains("seqpipe data prepare"),
            "{err}"
        );
        // The start-up check refuses it too, before any worker starts.
        let err = super::super::check_source(&masked, 100, 17)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&url) && err.contains("seqpipe data prepare"),
            "{err}"
        );
        // An index naming a separator outside its vocabulary is refused when read.
        json["end_of_text"] = 100.into();
        std::fs::write(&index_path, serde_json::to_vec(&json).unwrap()).unwrap();
        let err = ShardedSource::open(&plain, 100).err().unwrap().to_string();
        assert!(err.contains("end_of_text 100 is not a token"), "{err}");
    }

    /// A missing shard and a shard changed in the store are data errors naming the object, after
    /// the configured attempts, with either layout; the cache never serves what the store no
    /// longer agrees with.
    #[test]
    fn missing_and_corrupt_objects_are_data_errors_naming_them() {
        for (tag, layout) in layouts() {
            missing_and_corrupt(tag, layout);
        }
    }

    fn missing_and_corrupt(tag: &str, layout: ShardLayout) {
        let tmp = TempDir::new(&format!("sharded-faults-{tag}"));
        let url = datasets_with(&tmp.0, 1000, layout);
        let shards = tmp.0.join("sharded/train");
        std::fs::remove_file(shards.join("000000.bin")).unwrap();
        let mut bytes = std::fs::read(shards.join("000001.bin")).unwrap();
        bytes[5] ^= 0x10;
        std::fs::write(shards.join("000001.bin"), bytes).unwrap();
        let src = ShardedSource::open(&cfg(&url, &tmp.0.join("c"), 0), 100).unwrap();
        let msg = src.window(Split::Train, 0, 4).unwrap_err().to_string();
        assert!(
            msg.contains(&format!("{url}/train/000000.bin is missing"))
                && msg.contains("2 attempts"),
            "{msg}"
        );
        assert!(msg.contains("not a node failure"), "{msg}");
        let msg = src.window(Split::Train, 32, 4).unwrap_err().to_string();
        assert!(
            msg.contains(&format!("{url}/train/000001.bin is corrupt")),
            "{msg}"
        );
        if layout.block_bytes > 0 {
            // The block holding the flipped byte is named, with the sidecar it failed against.
            assert!(
                msg.contains("block 1 (bytes 4..8)") && msg.contains("train/000001.crc"),
                "{msg}"
            );
        } else {
            assert!(msg.contains("hash"), "{msg}");
        }
        // Other shards still read.
        assert_eq!(src.window(Split::Train, 64, 2).unwrap().len(), 2);
        // A missing index.
        let gone = format!("file://{}/nothing", tmp.0.display());
        std::fs::create_dir_all(tmp.0.join("nothing")).unwrap();
        let msg = ShardedSource::open(&cfg(&gone, &tmp.0.join("c"), 0), 100)
            .err()
            .unwrap()
            .to_string();
        assert!(msg.contains("nothing/index.json is missing"), "{msg}");
    }

    /// A store that does not answer (nothing listens on port 9 of loopback) is a data error
    /// naming the object, within the configured attempts and timeout.
    #[test]
    fn an_unreachable_store_is_a_data_error_within_the_bound() {
        let options = checkpoint::StoreOptions {
            s3_endpoint: Some("http://127.0.0.1:9".into()),
            s3_region: Some("us-east-1".into()),
            allow_http: Some(true),
            read_only: true,
            ..Default::default()
        };
        let store = checkpoint::CheckpointStore::open("s3://bucket/ds", &options)
            .unwrap()
            .objects();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let retry = Retry {
            attempts: 2,
            timeout: Duration::from_secs(3),
        };
        let started = std::time::Instant::now();
        let err = rt
            .block_on(fetch(
                &*store,
                "s3://bucket/ds",
                INDEX_FILE,
                None,
                retry,
                |_| Ok(()),
            ))
            .unwrap_err();
        let took = started.elapsed();
        assert!(
            matches!(&err, DataError::StoreUnreachable { attempts: 2, .. }),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("s3://bucket/ds/index.json") && msg.contains("unreachable"),
            "{msg}"
        );
        // 2 attempts of at most 3 s and one 0.2 s backoff, with slack for a loaded machine.
        assert!(took < Duration::from_secs(20), "took {took:?}");
    }

    /// A worker that read step s prefetches steps s+1..=s+k of the same rows into the cache.
    #[test]
    fn the_next_steps_are_prefetched_into_the_cache() {
        let tmp = TempDir::new("sharded-prefetch");
        let url = datasets(&tmp.0, 4000);
        let cache = tmp.0.join("cache");
        let mut c = cfg(&url, &cache, 1 << 20);
        c.prefetch_steps = 3;
        let src = ShardedSource::open(&c, 100).unwrap();
        for step in 0..2 {
            for row in 0..2 {
                src.sample(Split::Train, key(step, 0, row), 9).unwrap();
            }
        }
        // Steps 2..=4 were handed to the background when step 1 began: wait until every chunk
        // they need is in the cache, then a fresh reader reads them without the store.
        let keys: Vec<SampleKey> = (2..=4)
            .flat_map(|s| (0..2).map(move |r| key(s, 0, r)))
            .collect();
        let inner = &src.inner;
        let names: Vec<String> = keys
            .iter()
            .flat_map(|&k| {
                let start = uniform_below(&mut sample_rng(Split::Train, k), 4000 - 9 + 1);
                inner.index.pieces(&inner.starts[0], start, 9).unwrap()
            })
            .map(|p| format!("train-{:06}-{:06}.bin", p.shard, p.chunk))
            .collect();
        let dir = &inner.cache.as_ref().unwrap().dir;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !names.iter().all(|n| dir.join(n).is_file()) {
            assert!(
                std::time::Instant::now() < deadline,
                "steps 2..=4 never prefetched"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut c = cfg(&url, &cache, 1 << 20);
        c.prefetch_steps = 0;
        let reader = ShardedSource::open(&c, 100).unwrap();
        for &k in &keys {
            reader.sample(Split::Train, k, 9).unwrap();
        }
        assert_eq!(reader.stats().fetched_bytes.load(Ordering::Relaxed), 0);
        // Without prefetch, the same reads leave those chunks out of the cache.
        let mut c = cfg(&url, &tmp.0.join("no-prefetch"), 1 << 20);
        c.prefetch_steps = 0;
        let plain = ShardedSource::open(&c, 100).unwrap();
        for step in 0..2 {
            for row in 0..2 {
                plain.sample(Split::Train, key(step, 0, row), 9).unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        let dir = &plain.inner.cache.as_ref().unwrap().dir;
        assert!(!names.iter().all(|n| dir.join(n).is_file()));
    }
}
