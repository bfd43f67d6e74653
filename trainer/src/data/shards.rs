//! Sharded datasets: the token stream of each split cut into shard objects of bounded size, plus
//! one `index.json` ([`DatasetIndex`]) that names every shard with its token count, byte size,
//! BLAKE3 hash, the BLAKE3 hash of each fixed-size chunk, and where its documents start.
//!
//! A split's tokens are its shards concatenated in index order: exactly the `train.bin` /
//! `val.bin` a single-file dataset would hold, so a window of tokens (and hence every sample, see
//! [`super::TokenSource`]) is the same whichever layout holds the dataset.
//!
//! Version 2 datasets also cut each shard into small blocks (`block_bytes`, 128 by default) and
//! store a 4-byte check of every block ([`block_check`]) in a sidecar object beside the shard
//! (`train/000000.crc`). A reader then fetches only the blocks a window overlaps (one ranged
//! `GET` per shard, plus the matching range of the sidecar) and verifies each block before using
//! it, so the bytes fetched stay within a few percent of the bytes used ([`DatasetIndex::runs`]).
//! Version 1 datasets (no blocks) are read by whole chunks, each checked against its BLAKE3 hash
//! ([`DatasetIndex::pieces`]).
//!
//! The index is written last, with create-only semantics: a dataset exists iff its index exists,
//! and an existing dataset is never overwritten (a running job keeps reading what it started on).
//! This module holds the format, its validation and the pure window → chunk arithmetic; the
//! writer ([`publish`]) is a thin shell over an object store.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};

use super::bin::DatasetMeta;
use super::{DataError, Split, TokenDtype};

/// Name of the index object at the dataset's root.
pub const INDEX_FILE: &str = "index.json";
/// The index's `format` field.
pub const INDEX_FORMAT: &str = "seqpipe-dataset";
/// The index version this build writes when the dataset has block checks (it also reads
/// [`INDEX_VERSION_CHUNKS`]).
pub const INDEX_VERSION: u32 = 2;
/// The index version of datasets without block checks (read by whole chunks).
pub const INDEX_VERSION_CHUNKS: u32 = 1;
/// Largest index a reader accepts (the index is held in memory).
pub const MAX_INDEX_BYTES: u64 = 256 << 20;
/// Default shard size written by `seqpipe data prepare`: 64 MiB.
pub const DEFAULT_SHARD_BYTES: u64 = 64 << 20;
/// Default chunk size (the unit of range reads, caching and verification): 256 KiB.
pub const DEFAULT_CHUNK_BYTES: u64 = 256 << 10;
/// Default block size (the unit of exact range reads and their checks): 128 bytes, so that a
/// window of a few KiB fetches few bytes beyond its own (the rounding out to whole blocks plus
/// 4 check bytes per block: about 1.09 bytes per byte used for a 2 KiB window).
pub const DEFAULT_BLOCK_BYTES: u64 = 128;
/// Bytes of one block's check in a sidecar object.
pub const CHECK_BYTES: u64 = 4;
/// Largest shard: below S3's 5 GiB limit on one `PUT`.
pub const MAX_SHARD_BYTES: u64 = 4 << 30;
/// Most shards a split may have.
pub const MAX_SHARDS: usize = 1_000_000;

/// The `index.json` of a sharded dataset.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DatasetIndex {
    /// Always [`INDEX_FORMAT`].
    pub format: String,
    /// Always [`INDEX_VERSION`].
    pub version: u32,
    /// Tokenizer name (`"gpt2"`).
    pub tokenizer: String,
    /// Vocabulary of the tokenizer (every id is below it).
    pub vocab_size: usize,
    /// Width of the stored token ids.
    pub dtype: TokenDtype,
    /// Bytes per chunk (the last chunk of a shard may be shorter); a multiple of the id width.
    pub chunk_bytes: u64,
    /// Version 2: bytes per block (the last block of a shard may be shorter), a multiple of the
    /// id width dividing `chunk_bytes`; every shard has a sidecar ([`check_key`]) holding
    /// [`CHECK_BYTES`] of [`block_check`] per block. Absent in version 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_bytes: Option<u64>,
    /// The token that ends every document (`<|endoftext|>` = 50256 for GPT-2 BPE), below
    /// `vocab_size`: where `doc_starts` were cut, and what document masks split sequences at.
    /// Absent in indexes written before it was recorded (in either version: it changes no byte a
    /// reader fetches, so it is an optional field rather than a new version); such a dataset
    /// trains without masks and is refused with them ([`super::document_separator`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_of_text: Option<u32>,
    /// The training split.
    pub train: SplitIndex,
    /// The validation split.
    pub val: SplitIndex,
}

/// One split of a [`DatasetIndex`].
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SplitIndex {
    /// Tokens in the split (the sum over its shards).
    pub tokens: u64,
    /// Documents starting in the split (the sum of the shards' `doc_starts` lengths).
    pub documents: u64,
    /// The shards, in token order.
    pub shards: Vec<ShardEntry>,
}

/// One shard object.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    /// Object key relative to the dataset root: `<split>/<6-digit number>.bin`.
    pub key: String,
    /// Tokens in the shard.
    pub tokens: u64,
    /// Bytes in the shard (`tokens * width`).
    pub bytes: u64,
    /// BLAKE3 of the whole shard, lowercase hex.
    pub blake3: String,
    /// BLAKE3 of each chunk (`chunk_bytes` bytes; the last may be shorter), lowercase hex.
    pub chunks: Vec<String>,
    /// Token offsets within the shard where a document starts (strictly increasing).
    pub doc_starts: Vec<u64>,
}

/// The blocks of one shard that a token window overlaps, and where its bytes lie in them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Index of the shard in its split.
    pub shard: usize,
    /// The blocks `[first_block, end_block)` to fetch (one ranged read of the shard and one of
    /// its sidecar).
    pub first_block: u64,
    /// End of the block range.
    pub end_block: u64,
    /// Byte range of the window within the fetched bytes: `[from, to)`.
    pub from: usize,
    /// End of the window's bytes within the fetched bytes.
    pub to: usize,
}

/// One byte range of one chunk that a token window needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the shard in its split.
    pub shard: usize,
    /// Index of the chunk in the shard.
    pub chunk: usize,
    /// Byte range within the chunk: `[from, to)`.
    pub from: usize,
    /// End of the byte range within the chunk.
    pub to: usize,
}

fn is_hex_hash(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The object key of shard `n` of `split`.
pub fn shard_key(split: Split, n: usize) -> String {
    format!("{}/{n:06}.bin", split.as_str())
}

/// The object key of the block checks of shard `n` of `split` (version 2).
pub fn check_key(split: Split, n: usize) -> String {
    format!("{}/{n:06}.crc", split.as_str())
}

/// The check of block `block` of shard `shard` of `split`: CRC-32 over the block's position
/// (split, shard, block) and its bytes. It detects every error burst of up to 32 bits in a block
/// (any one corrupted byte) with certainty, other corruption and a block returned from the wrong
/// position with probability 1 - 2^-32.
pub fn block_check(split: Split, shard: usize, block: u64, bytes: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&[split_tag(split)]);
    h.update(&(shard as u64).to_le_bytes());
    h.update(&block.to_le_bytes());
    h.update(bytes);
    h.finalize()
}

fn split_tag(split: Split) -> u8 {
    match split {
        Split::Train => 0,
        Split::Val => 1,
    }
}

impl DatasetIndex {
    /// The split's part of the index.
    pub fn split(&self, split: Split) -> &SplitIndex {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// Parses and validates an index read from `origin` (a URL, for messages). Every count, size
    /// and hash is checked against the others, so a reader can trust the arithmetic below.
    pub fn parse(bytes: &[u8], origin: &str) -> Result<DatasetIndex, DataError> {
        let bad = |message: String| DataError::Index {
            url: origin.to_string(),
            message,
        };
        if bytes.len() as u64 > MAX_INDEX_BYTES {
            return Err(bad(format!(
                "it is {} bytes, over the {MAX_INDEX_BYTES}-byte limit; prepare the dataset \
                 with larger --chunk-bytes",
                bytes.len()
            )));
        }
        let index: DatasetIndex = serde_json::from_slice(bytes).map_err(|e| {
            bad(format!(
                "not a dataset index ({e}); it should be the {INDEX_FILE} written by `seqpipe \
                 data prepare`"
            ))
        })?;
        index.validate().map_err(bad)?;
        Ok(index)
    }

    /// Checks the index's internal consistency; the error says what is wrong.
    pub fn validate(&self) -> Result<(), String> {
        self.validate_layout()?;
        for split in [Split::Train, Split::Val] {
            let s = self.split(split);
            if s.shards.len() > MAX_SHARDS {
                return Err(format!("{split} has over {MAX_SHARDS} shards"));
            }
            let (mut tokens, mut documents) = (0u64, 0u64);
            for (n, shard) in s.shards.iter().enumerate() {
                self.validate_shard(split, n, shard)?;
                tokens = tokens
                    .checked_add(shard.tokens)
                    .ok_or_else(|| format!("{split}: token count overflows"))?;
                documents += shard.doc_starts.len() as u64;
            }
            if tokens != s.tokens || documents != s.documents {
                return Err(format!(
                    "{split} declares {} tokens and {} documents but its shards hold {tokens} and \
                     {documents}",
                    s.tokens, s.documents
                ));
            }
        }
        Ok(())
    }

    /// The format and version, the vocabulary, and the chunk and block sizes the hashes cover.
    fn validate_layout(&self) -> Result<(), String> {
        if self.format != INDEX_FORMAT
            || !(self.version == INDEX_VERSION || self.version == INDEX_VERSION_CHUNKS)
        {
            return Err(format!(
                "format {:?} version {} is not {INDEX_FORMAT:?} version {INDEX_VERSION_CHUNKS} \
                 or {INDEX_VERSION}; re-prepare the dataset with this seqpipe",
                self.format, self.version
            ));
        }
        if self.vocab_size == 0 {
            return Err("vocab_size is 0".into());
        }
        if let Some(eot) = self.end_of_text
            && eot as usize >= self.vocab_size
        {
            return Err(format!(
                "end_of_text {eot} is not a token of the {}-token vocabulary; re-prepare the \
                 dataset with `seqpipe data prepare`",
                self.vocab_size
            ));
        }
        let width = self.dtype.width() as u64;
        if self.chunk_bytes == 0 || !self.chunk_bytes.is_multiple_of(width) {
            return Err(format!(
                "chunk_bytes {} is not a positive multiple of {width} ({} ids)",
                self.chunk_bytes, self.dtype
            ));
        }
        match (self.version, self.block_bytes) {
            (INDEX_VERSION_CHUNKS, None) => {}
            (INDEX_VERSION_CHUNKS, Some(_)) => {
                return Err(format!(
                    "version {INDEX_VERSION_CHUNKS} has no block_bytes (block checks came with \
                     version {INDEX_VERSION})"
                ));
            }
            (_, None) => {
                return Err(format!(
                    "version {INDEX_VERSION} needs block_bytes (the size of the checked blocks)"
                ));
            }
            (_, Some(b)) => {
                if b == 0 || !b.is_multiple_of(width) || !self.chunk_bytes.is_multiple_of(b) {
                    return Err(format!(
                        "block_bytes {b} is not a positive multiple of {width} ({} ids) dividing \
                         chunk_bytes {}",
                        self.dtype, self.chunk_bytes
                    ));
                }
            }
        }
        Ok(())
    }

    /// Shard `n` of `split`: its key, its size in ids and bytes, its hashes (one per chunk) and
    /// its document starts.
    fn validate_shard(&self, split: Split, n: usize, shard: &ShardEntry) -> Result<(), String> {
        let width = self.dtype.width() as u64;
        let at = format!("{split} shard {n} ({})", shard.key);
        if shard.key != shard_key(split, n) {
            return Err(format!("{at}: the key should be {}", shard_key(split, n)));
        }
        if shard.tokens == 0 || shard.tokens.checked_mul(width) != Some(shard.bytes) {
            return Err(format!(
                "{at}: {} bytes do not hold {} {} ids (or the shard is empty)",
                shard.bytes, shard.tokens, self.dtype
            ));
        }
        if shard.bytes > MAX_SHARD_BYTES {
            return Err(format!("{at}: over {MAX_SHARD_BYTES} bytes"));
        }
        if !is_hex_hash(&shard.blake3) || !shard.chunks.iter().all(|h| is_hex_hash(h)) {
            return Err(format!("{at}: a hash is not 64 lowercase hex digits"));
        }
        if shard.chunks.len() as u64 != shard.bytes.div_ceil(self.chunk_bytes) {
            return Err(format!(
                "{at}: {} chunk hashes for {} bytes in chunks of {}",
                shard.chunks.len(),
                shard.bytes,
                self.chunk_bytes
            ));
        }
        if !shard.doc_starts.windows(2).all(|w| w[0] < w[1])
            || shard.doc_starts.last().is_some_and(|&d| d >= shard.tokens)
        {
            return Err(format!(
                "{at}: doc_starts are not increasing offsets below {}",
                shard.tokens
            ));
        }
        Ok(())
    }

    /// The first token of every shard of `split`, and the total at the end (`shards + 1` values).
    pub fn shard_starts(&self, split: Split) -> Vec<u64> {
        let mut starts = Vec::with_capacity(self.split(split).shards.len() + 1);
        let mut at = 0;
        starts.push(0);
        for shard in &self.split(split).shards {
            at += shard.tokens;
            starts.push(at);
        }
        starts
    }

    /// The chunk byte ranges holding tokens `[start, start + len)` of `split`, in order, given
    /// `starts` = [`DatasetIndex::shard_starts`]. `None` when the window is outside the split.
    pub fn pieces(&self, starts: &[u64], start: u64, len: u64) -> Option<Vec<Piece>> {
        let end = start.checked_add(len)?;
        if end > *starts.last()? {
            return None;
        }
        let width = self.dtype.width() as u64;
        let mut out = Vec::new();
        let mut token = start;
        while token < end {
            // The shard holding `token`: the last start <= token.
            let shard = starts.partition_point(|&s| s <= token) - 1;
            let shard_end = starts[shard + 1];
            let take_to = end.min(shard_end);
            let (mut byte, stop) = (
                (token - starts[shard]) * width,
                (take_to - starts[shard]) * width,
            );
            while byte < stop {
                let chunk = byte / self.chunk_bytes;
                let chunk_start = chunk * self.chunk_bytes;
                let to = stop.min(chunk_start + self.chunk_bytes);
                out.push(Piece {
                    shard,
                    chunk: chunk as usize,
                    from: (byte - chunk_start) as usize,
                    to: (to - chunk_start) as usize,
                });
                byte = to;
            }
            token = take_to;
        }
        Some(out)
    }

    /// The block runs holding tokens `[start, start + len)` of `split` (version 2), one per shard
    /// the window touches, in order, given `starts` = [`DatasetIndex::shard_starts`]. `None` when
    /// the window is outside the split or the dataset has no blocks.
    pub fn runs(&self, starts: &[u64], start: u64, len: u64) -> Option<Vec<Run>> {
        let block = self.block_bytes?;
        let end = start.checked_add(len)?;
        if end > *starts.last()? {
            return None;
        }
        let width = self.dtype.width() as u64;
        let mut out = Vec::new();
        let mut token = start;
        while token < end {
            let shard = starts.partition_point(|&s| s <= token) - 1;
            let take_to = end.min(starts[shard + 1]);
            let (byte, stop) = (
                (token - starts[shard]) * width,
                (take_to - starts[shard]) * width,
            );
            let (first_block, end_block) = (byte / block, stop.div_ceil(block));
            out.push(Run {
                shard,
                first_block,
                end_block,
                from: (byte - first_block * block) as usize,
                to: (stop - first_block * block) as usize,
            });
            token = take_to;
        }
        Some(out)
    }

    /// Byte range of blocks `[first, end)` of a shard of `shard_bytes` bytes (version 2), and of
    /// their checks in its sidecar.
    pub fn block_ranges(
        &self,
        shard_bytes: u64,
        first: u64,
        end: u64,
    ) -> (std::ops::Range<u64>, std::ops::Range<u64>) {
        let block = self.block_bytes.unwrap_or(self.chunk_bytes);
        (
            first * block..(end * block).min(shard_bytes),
            first * CHECK_BYTES..end * CHECK_BYTES,
        )
    }

    /// Byte range of chunk `chunk` of a shard of `shard_bytes` bytes.
    pub fn chunk_range(&self, shard_bytes: u64, chunk: usize) -> std::ops::Range<u64> {
        let from = chunk as u64 * self.chunk_bytes;
        from..(from + self.chunk_bytes).min(shard_bytes)
    }
}

/// Shard and chunk sizes for [`publish`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    /// Bytes per shard (the last shard of a split may be shorter).
    pub shard_bytes: u64,
    /// Bytes per chunk; `shard_bytes` is a multiple of it.
    pub chunk_bytes: u64,
    /// Bytes per checked block (a divisor of `chunk_bytes`); 0 writes a version 1 dataset
    /// without block checks, read by whole chunks.
    pub block_bytes: u64,
}

impl Default for ShardLayout {
    fn default() -> Self {
        ShardLayout {
            shard_bytes: DEFAULT_SHARD_BYTES,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            block_bytes: DEFAULT_BLOCK_BYTES,
        }
    }
}

impl ShardLayout {
    /// Shards and chunks of the given sizes, with blocks of [`DEFAULT_BLOCK_BYTES`] or, when that
    /// does not divide the chunk size, of their greatest common divisor.
    pub fn with_default_blocks(shard_bytes: u64, chunk_bytes: u64) -> ShardLayout {
        let (mut a, mut b) = (chunk_bytes, DEFAULT_BLOCK_BYTES);
        while b != 0 {
            (a, b) = (b, a % b);
        }
        ShardLayout {
            shard_bytes,
            chunk_bytes,
            block_bytes: a,
        }
    }

    /// Checks the sizes for ids of `dtype`.
    pub fn validate(&self, dtype: TokenDtype) -> Result<(), DataError> {
        let width = dtype.width() as u64;
        let ok = self.chunk_bytes > 0
            && self.chunk_bytes.is_multiple_of(width)
            && self.shard_bytes >= self.chunk_bytes
            && self.shard_bytes.is_multiple_of(self.chunk_bytes)
            && self.shard_bytes <= MAX_SHARD_BYTES
            && (self.block_bytes == 0
                || (self.block_bytes.is_multiple_of(width)
                    && self.chunk_bytes.is_multiple_of(self.block_bytes)));
        if ok {
            Ok(())
        } else {
            Err(DataError::InvalidArgument(format!(
                "shard size {}, chunk size {} and block size {} bytes: the chunk size must be a \
                 positive multiple of {width} (the {dtype} id width), the shard size a multiple \
                 of the chunk size, at most {MAX_SHARD_BYTES}, and the block size 0 or a \
                 multiple of {width} dividing the chunk size; e.g. --shard-bytes \
                 {DEFAULT_SHARD_BYTES} --chunk-bytes {DEFAULT_CHUNK_BYTES} (block size \
                 {DEFAULT_BLOCK_BYTES})",
                self.shard_bytes, self.chunk_bytes, self.block_bytes
            )))
        }
    }
}

/// Where [`publish`] writes: the object store at a dataset URL (keys relative to it).
pub struct Target {
    /// The URL, for messages.
    pub url: String,
    /// The store, rooted at the URL's prefix.
    pub store: Arc<dyn ObjectStore>,
}

fn store_err(url: &str, action: String) -> impl FnOnce(object_store::Error) -> DataError + '_ {
    move |e| DataError::Store {
        url: url.to_string(),
        action,
        detail: e.to_string(),
    }
}

fn object_path(key: &str) -> ObjectPath {
    // Keys are built by this module (`train/000000.bin`, `index.json`): always valid.
    ObjectPath::from(key)
}

/// Cuts `<dir>/train.bin` and `<dir>/val.bin` (a single-file dataset described by `meta`) into
/// shards of `layout`, uploads them to `target`, then writes the index with create-only
/// semantics. `eot` is the end-of-document token (documents start after it) when the tokenizer
/// has one. Refuses, before uploading anything, a target that already holds a dataset.
pub async fn publish(
    dir: &Path,
    meta: &DatasetMeta,
    eot: Option<u32>,
    layout: ShardLayout,
    target: &Target,
) -> Result<DatasetIndex, DataError> {
    layout.validate(meta.dtype)?;
    let url = target.url.as_str();
    match target.store.head(&object_path(INDEX_FILE)).await {
        Ok(_) => return Err(DataError::DatasetExists { url: url.into() }),
        Err(object_store::Error::NotFound { .. }) => {}
        Err(e) => return Err(store_err(url, format!("checking for {INDEX_FILE}"))(e)),
    }
    let mut splits = Vec::new();
    for split in [Split::Train, Split::Val] {
        splits.push(publish_split(dir, meta.dtype, eot, layout, split, target).await?);
    }
    let val = splits.pop().expect("two splits");
    let train = splits.pop().expect("two splits");
    let block_bytes = (layout.block_bytes > 0).then_some(layout.block_bytes);
    let index = DatasetIndex {
        format: INDEX_FORMAT.into(),
        version: if block_bytes.is_some() {
            INDEX_VERSION
        } else {
            INDEX_VERSION_CHUNKS
        },
        tokenizer: meta.tokenizer.clone(),
        vocab_size: meta.vocab_size,
        dtype: meta.dtype,
        chunk_bytes: layout.chunk_bytes,
        block_bytes,
        end_of_text: eot,
        train,
        val,
    };
    index
        .validate()
        .map_err(|m| DataError::InvalidArgument(format!("the index built is invalid: {m}")))?;
    let json = serde_json::to_vec_pretty(&index).expect("DatasetIndex serializes");
    let opts = PutOptions {
        mode: PutMode::Create,
        ..PutOptions::default()
    };
    match target
        .store
        .put_opts(&object_path(INDEX_FILE), PutPayload::from(json), opts)
        .await
    {
        Ok(_) => Ok(index),
        Err(object_store::Error::AlreadyExists { .. }) => {
            Err(DataError::DatasetExists { url: url.into() })
        }
        Err(e) => Err(store_err(url, format!("writing {INDEX_FILE}"))(e)),
    }
}

async fn publish_split(
    dir: &Path,
    dtype: TokenDtype,
    eot: Option<u32>,
    layout: ShardLayout,
    split: Split,
    target: &Target,
) -> Result<SplitIndex, DataError> {
    use std::io::Read;
    let path = dir.join(split.file_name());
    let io = |action: &'static str| {
        let path = path.clone();
        move |source| DataError::Io {
            action,
            path,
            source,
        }
    };
    let mut file = std::fs::File::open(&path).map_err(io("open"))?;
    let width = dtype.width();
    let mut shards = Vec::new();
    let mut documents = 0;
    let mut tokens = 0;
    // Whether the next token starts a document (the first does; so does one after `eot`).
    let mut at_doc_start = eot.is_some();
    loop {
        let mut buf = Vec::new();
        (&mut file)
            .take(layout.shard_bytes)
            .read_to_end(&mut buf)
            .map_err(io("read"))?;
        if buf.is_empty() {
            break;
        }
        if buf.len() % width != 0 {
            return Err(DataError::CorruptSize {
                path: path.clone(),
                bytes: tokens * width as u64 + buf.len() as u64,
                width,
                dtype,
            });
        }
        let mut doc_starts = Vec::new();
        if let Some(eot) = eot {
            for (i, id) in buf.chunks_exact(width).enumerate() {
                if at_doc_start {
                    doc_starts.push(i as u64);
                }
                let id = match dtype {
                    TokenDtype::U16 => u32::from(u16::from_le_bytes([id[0], id[1]])),
                    TokenDtype::U32 => u32::from_le_bytes([id[0], id[1], id[2], id[3]]),
                };
                at_doc_start = id == eot;
            }
        }
        let chunks = buf
            .chunks(layout.chunk_bytes as usize)
            .map(|c| blake3::hash(c).to_hex().to_string())
            .collect();
        let key = shard_key(split, shards.len());
        if layout.block_bytes > 0 {
            // The sidecar first: a shard is only ever read through the index, written last.
            let checks: Vec<u8> = buf
                .chunks(layout.block_bytes as usize)
                .enumerate()
                .flat_map(|(b, bytes)| {
                    block_check(split, shards.len(), b as u64, bytes).to_le_bytes()
                })
                .collect();
            let checks_key = check_key(split, shards.len());
            target
                .store
                .put(&object_path(&checks_key), PutPayload::from(checks))
                .await
                .map_err(store_err(&target.url, format!("uploading {checks_key}")))?;
        }
        let entry = ShardEntry {
            key: key.clone(),
            tokens: (buf.len() / width) as u64,
            bytes: buf.len() as u64,
            blake3: blake3::hash(&buf).to_hex().to_string(),
            chunks,
            doc_starts,
        };
        tokens += entry.tokens;
        documents += entry.doc_starts.len() as u64;
        target
            .store
            .put(&object_path(&key), PutPayload::from(Bytes::from(buf)))
            .await
            .map_err(store_err(&target.url, format!("uploading {key}")))?;
        tracing::info!(url = %target.url, key, bytes = entry.bytes, "shard written");
        shards.push(entry);
    }
    Ok(SplitIndex {
        tokens,
        documents,
        shards,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(tokens: &[u64], chunk_bytes: u64) -> DatasetIndex {
        let h = "0".repeat(64);
        let shards = tokens
            .iter()
            .enumerate()
            .map(|(n, &t)| ShardEntry {
                key: shard_key(Split::Train, n),
                tokens: t,
                bytes: 2 * t,
                blake3: h.clone(),
                chunks: vec![h.clone(); (2 * t).div_ceil(chunk_bytes) as usize],
                doc_starts: vec![0],
            })
            .collect::<Vec<_>>();
        DatasetIndex {
            format: INDEX_FORMAT.into(),
            version: INDEX_VERSION_CHUNKS,
            tokenizer: "gpt2".into(),
            vocab_size: 50257,
            dtype: TokenDtype::U16,
            chunk_bytes,
            block_bytes: None,
            end_of_text: Some(50256),
            train: SplitIndex {
                tokens: tokens.iter().sum(),
                documents: tokens.len() as u64,
                shards,
            },
            val: SplitIndex {
                tokens: 0,
                documents: 0,
                shards: vec![],
            },
        }
    }

    /// Every window `start + len` of the train split (whose shards begin at token `starts`, the
    /// last entry its end): `spans(start, len)` names, in order, the shard, the first byte in that
    /// shard of what it read, and the window's bytes within what it read; laid end to end they
    /// must be exactly the window's bytes (2 a token).
    fn for_every_window(
        starts: &[u64],
        mut spans: impl FnMut(u64, u64) -> Vec<(usize, u64, std::ops::Range<usize>)>,
    ) {
        let total = *starts.last().unwrap();
        for start in 0..total {
            for len in 1..=(total - start) {
                let global: Vec<u64> = spans(start, len)
                    .into_iter()
                    .flat_map(|(shard, first, within)| {
                        within.map(move |b| starts[shard] * 2 + first + b as u64)
                    })
                    .collect();
                let want: Vec<u64> = (start * 2..(start + len) * 2).collect();
                assert_eq!(global, want, "window {start}+{len}");
            }
        }
    }

    /// Every window maps to pieces that, laid end to end, cover exactly its bytes, in order,
    /// within chunk and shard bounds.
    #[test]
    fn pieces_cover_windows_exactly() {
        let idx = index(&[10, 7, 1, 12], 6);
        idx.validate().unwrap();
        let starts = idx.shard_starts(Split::Train);
        assert_eq!(starts, vec![0, 10, 17, 18, 30]);
        for_every_window(&starts, |start, len| {
            let pieces = idx.pieces(&starts, start, len).unwrap();
            let mut spans = Vec::new();
            for p in &pieces {
                let shard = &idx.train.shards[p.shard];
                let range = idx.chunk_range(shard.bytes, p.chunk);
                assert!(p.from < p.to && (p.to as u64) <= range.end - range.start);
                spans.push((p.shard, range.start, p.from..p.to));
            }
            spans
        });
        assert_eq!(idx.pieces(&starts, 25, 6), None);
        assert_eq!(idx.pieces(&starts, u64::MAX, 2), None);
    }

    /// Every window maps to one block run per shard it touches whose window bytes, laid end to
    /// end, are exactly its bytes; each run's blocks are the fewest that hold them.
    #[test]
    fn runs_cover_windows_with_the_fewest_blocks() {
        let mut idx = index(&[10, 7, 1, 12], 8);
        assert_eq!(idx.runs(&idx.shard_starts(Split::Train), 0, 1), None);
        idx.version = INDEX_VERSION;
        idx.block_bytes = Some(4);
        idx.validate().unwrap();
        let starts = idx.shard_starts(Split::Train);
        for_every_window(&starts, |start, len| {
            let runs = idx.runs(&starts, start, len).unwrap();
            let mut spans = Vec::new();
            for (i, r) in runs.iter().enumerate() {
                let shard = &idx.train.shards[r.shard];
                let (bytes, checks) = idx.block_ranges(shard.bytes, r.first_block, r.end_block);
                assert_eq!(checks.end - checks.start, 4 * (r.end_block - r.first_block));
                assert!(r.from < r.to && r.to as u64 <= bytes.end - bytes.start);
                // The fewest blocks: the first and the last hold window bytes.
                assert!(r.from < 4 && (bytes.end - bytes.start) - (r.to as u64) < 4);
                if i > 0 {
                    assert_eq!(r.shard, runs[i - 1].shard + 1);
                }
                spans.push((r.shard, bytes.start, r.from..r.to));
            }
            spans
        });
        assert_eq!(idx.runs(&starts, 25, 6), None);
        assert_eq!(idx.runs(&starts, u64::MAX, 2), None);
    }

    /// A block's check depends on its bytes and its position (split, shard, block).
    #[test]
    fn block_checks_bind_bytes_to_their_position() {
        let bytes = [1u8, 2, 3, 4];
        let c = block_check(Split::Train, 3, 5, &bytes);
        assert_ne!(c, block_check(Split::Val, 3, 5, &bytes));
        assert_ne!(c, block_check(Split::Train, 4, 5, &bytes));
        assert_ne!(c, block_check(Split::Train, 3, 6, &bytes));
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut flipped = bytes;
                flipped[i] ^= 1 << bit;
                assert_ne!(c, block_check(Split::Train, 3, 5, &flipped));
            }
        }
    }

    #[test]
    fn inconsistent_indexes_are_refused_saying_why() {
        let good = index(&[10, 7], 6);
        type Edit = Box<dyn Fn(&mut DatasetIndex)>;
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(|i| i.train.tokens = 18), "declares 18 tokens"),
            (Box::new(|i| i.train.shards[1].bytes = 15), "do not hold"),
            (
                Box::new(|i| {
                    i.train.shards[0].chunks.pop();
                }),
                "chunk hashes",
            ),
            (
                Box::new(|i| i.train.shards[1].key = "train/x.bin".into()),
                "the key should be",
            ),
            (
                Box::new(|i| i.train.shards[0].blake3 = "XY".into()),
                "64 lowercase hex",
            ),
            (
                Box::new(|i| i.train.shards[0].doc_starts = vec![3, 3]),
                "doc_starts",
            ),
            (Box::new(|i| i.chunk_bytes = 3), "chunk_bytes 3"),
            (Box::new(|i| i.version = 9), "version 9"),
            (Box::new(|i| i.block_bytes = Some(2)), "no block_bytes"),
            (Box::new(|i| i.version = INDEX_VERSION), "needs block_bytes"),
            (
                Box::new(|i| {
                    i.version = INDEX_VERSION;
                    i.block_bytes = Some(4);
                }),
                "block_bytes 4",
            ),
            (
                Box::new(|i| i.end_of_text = Some(50257)),
                "end_of_text 50257 is not a token",
            ),
        ];
        for (edit, needle) in cases {
            let mut idx = good.clone();
            edit(&mut idx);
            let json = serde_json::to_vec(&idx).unwrap();
            let msg = DatasetIndex::parse(&json, "s3://b/ds/index.json")
                .unwrap_err()
                .to_string();
            assert!(
                msg.contains(needle) && msg.contains("s3://b/ds"),
                "{needle}: {msg}"
            );
        }
        let msg = DatasetIndex::parse(b"{\"format\": 1}", "u")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("not a dataset index"), "{msg}");
    }

    /// `end_of_text` is written when known and read back; an index written before it was
    /// recorded (no such key) still parses, in both versions, and says it has none.
    #[test]
    fn end_of_text_is_recorded_and_optional() {
        let idx = index(&[10, 7], 6);
        let json = serde_json::to_value(&idx).unwrap();
        assert_eq!(json["end_of_text"], 50256);
        let back = DatasetIndex::parse(&serde_json::to_vec(&json).unwrap(), "u").unwrap();
        assert_eq!(back.end_of_text, Some(50256));
        for blocks in [false, true] {
            let mut old = idx.clone();
            if blocks {
                old.version = INDEX_VERSION;
                old.block_bytes = Some(2);
            }
            let mut json = serde_json::to_value(&old).unwrap();
            json.as_object_mut().unwrap().remove("end_of_text");
            let text = serde_json::to_vec(&json).unwrap();
            assert!(!String::from_utf8_lossy(&text).contains("end_of_text"));
            let parsed = DatasetIndex::parse(&text, "u").unwrap();
            assert_eq!(parsed.end_of_text, None);
            assert_eq!(
                DatasetIndex {
                    end_of_text: Some(50256),
                    ..parsed
                },
                old
            );
        }
    }
}
