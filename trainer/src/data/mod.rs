//! Training data: token sources, deterministic micro-batch sampling and dataset preparation.
//!
//! # Determinism
//!
//! The tokens of row `r` of micro-batch `m` at optimizer step `s` depend only on
//! `(split, seed, s, m, r)` and the dataset: each row is drawn from its own ChaCha8 stream whose
//! seed is a stable SplitMix64 hash of those integers (see [`keys`]). The number of pipeline
//! stages, workers, restarts or the micro-batch size never enter the derivation, so any process
//! that asks for a given micro-batch gets exactly the same tokens.
//!
//! # Sources
//!
//! * `source = "synthetic"`: a seeded random n-gram language ([`SyntheticLanguage`]) whose
//!   entropy rate, and hence the best achievable loss, is known exactly. Needs no download.
//! * `source = "<dir>"`: a directory with `train.bin` / `val.bin` in the nanoGPT layout
//!   ([`TokenFiles`]), as written by [`prepare()`] (`seqpipe data prepare`).
//! * `source = "s3://bucket/prefix"` (any object-store URL), or a directory holding an
//!   `index.json`: a sharded dataset ([`shards`]) read by byte range through a verified local
//!   cache ([`ShardedSource`]), as written by `seqpipe data prepare --out URL`. The tokens of a
//!   sample are the same as from the single-file dataset the shards were cut from.

pub mod bin;
pub mod documents;
pub mod keys;
pub mod prepare;
pub mod remote;
pub mod shards;
pub mod synthetic;

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use bin::{DatasetMeta, TokenFiles};
pub use documents::{DocumentLengths, SyntheticDocuments, document_starts};
pub use prepare::{PrepareReport, prepare};
pub use remote::ShardedSource;
pub use synthetic::SyntheticLanguage;

/// The value of [`DataConfig::source`] that selects the built-in synthetic language.
pub const SYNTHETIC_SOURCE: &str = "synthetic";

/// Width of the token ids stored in `.bin` files.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    /// 2-byte little-endian ids (vocabularies up to 65536, e.g. GPT-2's 50257).
    #[default]
    U16,
    /// 4-byte little-endian ids.
    U32,
}

impl TokenDtype {
    /// Bytes per token id.
    pub fn width(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    /// The config spelling: `"u16"` or `"u32"`.
    pub fn as_str(self) -> &'static str {
        match self {
            TokenDtype::U16 => "u16",
            TokenDtype::U32 => "u32",
        }
    }
}

impl fmt::Display for TokenDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `[data]` config section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// `"synthetic"` (built-in, no download), a directory containing `train.bin` and
    /// `val.bin` (nanoGPT layout: flat little-endian token ids, no header), or a sharded dataset
    /// (`seqpipe data prepare --out URL`): an object-store URL (`s3://bucket/prefix`, `gs://`,
    /// `az://`, `file:///abs/dir`; S3 settings from `AWS_ENDPOINT`, `AWS_REGION`, ... as for
    /// checkpoints) or a directory holding its `index.json`. A relative directory is resolved
    /// against the current working directory.
    pub source: String,
    /// Token id width of the `.bin` files: `"u16"` or `"u32"`.
    pub dtype: TokenDtype,
    /// Synthetic language: context order n (the next token depends on the previous n tokens).
    pub synthetic_order: usize,
    /// Synthetic language: number of possible successors of every context (1..=vocab_size).
    pub synthetic_branching: usize,
    /// Seed of the synthetic language's transition table (independent of `train.seed`).
    pub synthetic_seed: u64,
    /// URL sources: local directory of the verified chunk cache, shared by the processes of a
    /// host ("" = `<system temp dir>/seqpipe-data-cache`).
    pub cache_dir: String,
    /// URL sources: most bytes the cache directory holds (least recently used chunks are
    /// evicted); 0 = no cache.
    pub cache_bytes: u64,
    /// URL sources: how many steps ahead each worker fetches its training samples into the cache
    /// in the background (0 = none).
    pub prefetch_steps: u64,
    /// URL sources: attempts per read before a missing, corrupt or unreachable object stops the
    /// run (with exponential backoff from 0.2 s, at most 5 s, between them).
    pub read_attempts: u32,
    /// URL sources: seconds one read attempt may take.
    pub read_timeout_s: f64,
    /// Packed documents: a token attends only to earlier tokens of its own document (documents
    /// end with the dataset's end-of-text token: `end_of_text` in a prepared dataset's
    /// `meta.json`, `vocab_size − 1` for synthetic documents). CPU stages only for now.
    pub document_mask: bool,
    /// With `document_mask`: positions restart at 0 at each document start. Needs
    /// `document_mask = true`.
    pub reset_positions: bool,
    /// Synthetic source: `0` is the plain language; `n > 0` packs documents of log-normal
    /// lengths with median `n` tokens, each ended by the separator `vocab_size − 1`.
    pub synthetic_document_median: usize,
    /// Synthetic documents: σ of the log of their lengths (`0..=4`; 0 = all of the median's length).
    pub synthetic_document_sigma: f64,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            source: SYNTHETIC_SOURCE.to_string(),
            dtype: TokenDtype::U16,
            synthetic_order: 1,
            synthetic_branching: 4,
            synthetic_seed: 1234,
            cache_dir: String::new(),
            cache_bytes: 4 << 30,
            prefetch_steps: 2,
            read_attempts: 4,
            read_timeout_s: 30.0,
            document_mask: false,
            reset_positions: false,
            synthetic_document_median: 0,
            synthetic_document_sigma: 1.0,
        }
    }
}

impl DataConfig {
    /// Whether this config selects the built-in synthetic language.
    pub fn is_synthetic(&self) -> bool {
        self.source == SYNTHETIC_SOURCE
    }
}

/// Which part of the dataset to sample from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Training data (`train.bin`, or the synthetic training stream).
    Train,
    /// Held-out data (`val.bin`, or a synthetic stream disjoint from the training one).
    Val,
}

impl Split {
    /// `"train"` or `"val"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Val => "val",
        }
    }

    /// The token file of this split inside a dataset directory: `train.bin` or `val.bin`.
    pub fn file_name(self) -> &'static str {
        match self {
            Split::Train => "train.bin",
            Split::Val => "val.bin",
        }
    }
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Identifies one sample row: row `row` of micro-batch `micro_batch` at optimizer step `step`,
/// under the run seed `seed`. Together with the [`Split`] it fully determines the row's tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SampleKey {
    /// Run seed (`train.seed`).
    pub seed: u64,
    /// Optimizer step (or evaluation batch index).
    pub step: u64,
    /// Micro-batch index within the step.
    pub micro_batch: u64,
    /// Row index within the micro-batch.
    pub row: u64,
}

/// Errors of the data module. Messages say what is wrong, where, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A `[data]` setting (or a value derived from the model config) is unusable.
    #[error("invalid [data] config: {0}")]
    InvalidConfig(String),

    /// Bad arguments to a sampling or preparation call.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The dataset directory named by `[data] source` does not exist or is not a directory.
    #[error(
        "dataset directory {} does not exist or is not a directory; set [data] source to a \
         directory created by `seqpipe data prepare`, or to \"synthetic\"",
        path.display()
    )]
    NotADirectory {
        /// The configured directory.
        path: PathBuf,
    },

    /// `train.bin` or `val.bin` is missing from the dataset directory.
    #[error(
        "{split} token file {} is missing; create the dataset with `seqpipe data prepare` \
         (which writes train.bin, val.bin and meta.json), or set [data] source = \"synthetic\"",
        path.display()
    )]
    MissingFile {
        /// Which split's file.
        split: Split,
        /// The missing file.
        path: PathBuf,
    },

    /// An I/O operation on a file failed.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        /// What was being done ("read", "create", "memory-map", ...).
        action: &'static str,
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A token file's size is not a whole number of token ids.
    #[error(
        "token file {} is {bytes} bytes, not a multiple of {width} (the size of a {dtype} \
         token id): the file is truncated or corrupt, or [data] dtype is wrong; check \
         [data] dtype against the dataset's meta.json or re-run `seqpipe data prepare`",
        path.display()
    )]
    CorruptSize {
        /// The token file.
        path: PathBuf,
        /// Its size in bytes.
        bytes: u64,
        /// Bytes per token id.
        width: usize,
        /// The configured dtype.
        dtype: TokenDtype,
    },

    /// A token file is too short to hold one sample.
    #[error(
        "token file {} holds {tokens} tokens but one sample needs {needed} \
         (seq_len + 1); use a larger dataset or a smaller train.seq_len",
        path.display()
    )]
    TooShort {
        /// The token file.
        path: PathBuf,
        /// Tokens in the file.
        tokens: u64,
        /// Tokens needed for one sample.
        needed: u64,
    },

    /// A token id in a file does not fit the model's vocabulary.
    #[error(
        "token file {} has token id {value} at token index {index} (byte offset {byte_offset}), \
         but the model's vocab_size is {vocab_size}; raise model.vocab_size to at least the \
         dataset's vocab_size (see its meta.json), or check [data] dtype",
        path.display()
    )]
    TokenOutOfRange {
        /// The token file.
        path: PathBuf,
        /// Index of the offending token.
        index: u64,
        /// Byte offset of the offending token.
        byte_offset: u64,
        /// The token id.
        value: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },

    /// A dataset's `meta.json` is unreadable or contradicts the config.
    #[error("dataset metadata {}: {message}", path.display())]
    Meta {
        /// The `meta.json` file.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },

    /// An input of `prepare` is not usable.
    #[error("input {}: {message}", path.display())]
    Input {
        /// The input file.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },

    /// A `.jsonl` input line is not a JSON object with a string `"text"` field.
    #[error(
        "{}:{line}: {message}; every non-empty line of a .jsonl input must be a JSON object \
         with a string \"text\" field",
        path.display()
    )]
    InvalidJsonl {
        /// The input file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What is wrong.
        message: String,
    },

    /// A sharded dataset's `index.json` is unusable.
    #[error(
        "dataset index {url}: {message}; a sharded dataset is written by `seqpipe data prepare \
         --out URL`"
    )]
    Index {
        /// The index's URL.
        url: String,
        /// What is wrong.
        message: String,
    },

    /// An object of a sharded dataset is missing from the store.
    #[error(
        "dataset object {url}/{key} is missing (not found in {attempts} attempts): the dataset \
         is incomplete or was deleted; upload it again with `seqpipe data prepare --out URL` or \
         set [data] source to a complete dataset. This is a data error, not a node failure: the \
         last committed checkpoint is intact, resume from it once the data is back"
    )]
    ObjectMissing {
        /// The dataset URL.
        url: String,
        /// The object's key in it.
        key: String,
        /// Read attempts made.
        attempts: u32,
    },

    /// An object of a sharded dataset does not match the hash its index records.
    #[error(
        "dataset object {url}/{key} is corrupt ({detail}; in {attempts} attempts): the object \
         was changed or damaged after `seqpipe data prepare` wrote it; prepare and upload the \
         dataset again. This is a data error, not a node failure: the last committed checkpoint \
         is intact"
    )]
    ObjectCorrupt {
        /// The dataset URL.
        url: String,
        /// The object's key in it.
        key: String,
        /// Read attempts made.
        attempts: u32,
        /// What did not match.
        detail: String,
    },

    /// The store of a sharded dataset did not answer.
    #[error(
        "cannot read dataset object {url}/{key} in {attempts} attempts ({detail}): the store is \
         unreachable or refuses access; check the URL, AWS_ENDPOINT and credentials, or raise \
         [data] read_attempts / read_timeout_s. This is a data error, not a node failure: the \
         last committed checkpoint is intact"
    )]
    StoreUnreachable {
        /// The dataset URL.
        url: String,
        /// The object's key in it.
        key: String,
        /// Read attempts made.
        attempts: u32,
        /// The last failure.
        detail: String,
    },

    /// An object store operation (opening, writing) failed.
    #[error("dataset location {url}: {action} failed: {detail}")]
    Store {
        /// The dataset URL.
        url: String,
        /// What was being done.
        action: String,
        /// The store's error.
        detail: String,
    },

    /// `data prepare` was pointed at a location that already holds a dataset.
    #[error(
        "{url} already holds a dataset (its index.json exists); datasets are never overwritten \
         (a running job may be reading it): pick another --out, or delete the old one first"
    )]
    DatasetExists {
        /// The dataset URL.
        url: String,
    },

    /// The GPT-2 tokenizer could not be loaded.
    #[error("cannot load the GPT-2 (r50k_base) tokenizer: {0}")]
    Tokenizer(String),
}

/// A source of token sequences. Implemented by [`SyntheticLanguage`] and [`TokenFiles`].
///
/// Implementations must be pure: `sample` returns the same tokens for the same
/// `(split, key, len)` in every process, whatever else has been sampled before.
pub trait TokenSource: Send + Sync {
    /// The vocabulary the source needs: the synthetic alphabet size (max id + 1), or for token
    /// files the `vocab_size` declared in the dataset's `meta.json` (the model's `vocab_size`
    /// when the dataset has no `meta.json`).
    fn vocab_size(&self) -> usize;

    /// A one-line human-readable description for logs.
    fn describe(&self) -> String;

    /// The token that ends every document of a packed source (`end_of_text` in a prepared
    /// dataset's `meta.json`, `vocab_size − 1` for synthetic documents): documents start right
    /// after it. `None`: the source does not say, and document masks cannot be used with it.
    fn end_of_text(&self) -> Option<u32> {
        None
    }

    /// What to do when [`end_of_text`](TokenSource::end_of_text) is `None` and document masks
    /// are asked for: how this kind of source gets a separator.
    fn end_of_text_missing(&self) -> String {
        "the synthetic source has documents only with data.synthetic_document_median > 0".into()
    }

    /// Returns `len` tokens of sample `(split, key.seed, key.step, key.micro_batch, key.row)`.
    /// Every token is below the model `vocab_size` the source was opened with.
    fn sample(&self, split: Split, key: SampleKey, len: usize) -> Result<Vec<u32>, DataError>;

    /// Tokens `span` of the sample [`sample`](TokenSource::sample) returns for
    /// `(split, key, len)`: the same tokens, but a source that reads by byte range (a sharded
    /// dataset) reads only those. `span` must lie within `0..len`.
    fn sample_span(
        &self,
        split: Split,
        key: SampleKey,
        len: usize,
        span: Range<usize>,
    ) -> Result<Vec<u32>, DataError> {
        check_span(len, &span)?;
        Ok(self.sample(split, key, len)?[span].to_vec())
    }
}

/// Refuses a `span` that does not lie within a sample of `len` tokens.
pub(crate) fn check_span(len: usize, span: &Range<usize>) -> Result<(), DataError> {
    if span.start > span.end || span.end > len {
        return Err(DataError::InvalidArgument(format!(
            "tokens {span:?} of a {len}-token sample: the span must lie within 0..{len}"
        )));
    }
    Ok(())
}

/// The tokens of its sample rows that a pipeline stage uses. A row is `seq_len + 1` tokens: the
/// first stage embeds the inputs `row[..seq_len]`, the last stage scores the targets `row[1..]`,
/// a stage that is both needs the whole row, and a middle stage needs none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowPart {
    /// `row[..seq_len]` (the first stage of a pipeline of two or more).
    Inputs,
    /// `row[1..]` (the last stage of a pipeline of two or more).
    Targets,
    /// The whole row (a one-stage pipeline).
    Both,
}

impl RowPart {
    /// What a stage reads: `None` for a middle stage (it receives activations, no tokens).
    pub fn for_stage(first: bool, last: bool) -> Option<RowPart> {
        match (first, last) {
            (true, true) => Some(RowPart::Both),
            (true, false) => Some(RowPart::Inputs),
            (false, true) => Some(RowPart::Targets),
            (false, false) => None,
        }
    }

    /// The token indices of a `seq_len + 1`-token row that this part holds.
    pub fn span(self, seq_len: usize) -> Range<usize> {
        match self {
            RowPart::Inputs => 0..seq_len,
            RowPart::Targets => 1..seq_len + 1,
            RowPart::Both => 0..seq_len + 1,
        }
    }
}

/// Opens the configured source.
///
/// `vocab_size` is the model's; every token produced is `< vocab_size`. For token files this is
/// checked when a window is sampled (the error names the file and offset); the synthetic
/// language uses `vocab_size` as its alphabet.
pub fn open_source(cfg: &DataConfig, vocab_size: usize) -> Result<Box<dyn TokenSource>, DataError> {
    if cfg.is_synthetic() && cfg.synthetic_document_median > 0 {
        Ok(Box::new(synthetic_documents(cfg, vocab_size)?))
    } else if cfg.is_synthetic() {
        Ok(Box::new(synthetic_language(cfg, vocab_size)?))
    } else if cfg.source.trim().is_empty() {
        Err(DataError::InvalidConfig(
            "source is empty; set it to \"synthetic\" or to a dataset directory created by \
             `seqpipe data prepare`"
                .into(),
        ))
    } else if remote::is_sharded(&cfg.source) {
        Ok(Box::new(ShardedSource::open(cfg, vocab_size)?))
    } else {
        Ok(Box::new(TokenFiles::open(
            Path::new(&cfg.source),
            cfg.dtype,
            vocab_size,
        )?))
    }
}

/// The launcher's start-up check of the configured source, so that an unusable dataset stops the
/// run with an error naming the file before any worker starts (a data fault is never a lost node):
/// it opens the source ([`open_source`]), and for token files checks that `train.bin` holds a
/// sample of `sample_len` tokens, and that `val.bin` does and every token id in it fits the model's
/// vocabulary (evaluations sample all of `val.bin`, a small file; `train.bin`, which may be large,
/// is checked as it is sampled).
pub fn check_source(
    cfg: &DataConfig,
    vocab_size: usize,
    sample_len: usize,
) -> Result<(), DataError> {
    if cfg.is_synthetic() {
        return open_source(cfg, vocab_size)
            .and_then(|src| document_separator(cfg, src.as_ref()).map(|_| ()));
    }
    if remote::is_sharded(&cfg.source) {
        let sharded = ShardedSource::open(cfg, vocab_size)?;
        document_separator(cfg, &sharded)?;
        sharded.check(Split::Train, sample_len, false)?;
        return sharded.check(Split::Val, sample_len, true);
    }
    open_source(cfg, vocab_size)?;
    let files = TokenFiles::open(Path::new(&cfg.source), cfg.dtype, vocab_size)?;
    document_separator(cfg, &files)?;
    files.check(Split::Train, sample_len, false)?;
    files.check(Split::Val, sample_len, true)
}

/// The separator document masks split `src`'s sequences at, when `cfg.document_mask` is on
/// (`None` when it is off); a source that names none is refused with what to do.
pub fn document_separator(
    cfg: &DataConfig,
    src: &dyn TokenSource,
) -> Result<Option<u32>, DataError> {
    if !cfg.document_mask {
        return Ok(None);
    }
    src.end_of_text().map(Some).ok_or_else(|| {
        DataError::InvalidConfig(format!(
            "data.document_mask = true needs the dataset's end-of-text token, but {} names none \
             ({}); or set data.document_mask = false",
            src.describe(),
            src.end_of_text_missing()
        ))
    })
}

/// The synthetic language of `cfg` in document mode ([`SyntheticDocuments`]): documents of
/// log-normal lengths (`synthetic_document_median`, `synthetic_document_sigma`) over ids
/// `0..vocab_size − 1`, each ended by the separator `vocab_size − 1`.
pub fn synthetic_documents(
    cfg: &DataConfig,
    vocab_size: usize,
) -> Result<SyntheticDocuments, DataError> {
    SyntheticDocuments::new(
        vocab_size,
        cfg.synthetic_order,
        cfg.synthetic_branching,
        cfg.synthetic_seed,
        DocumentLengths::new(cfg.synthetic_document_median, cfg.synthetic_document_sigma)?,
    )
}

/// Builds the synthetic language described by `cfg` over an alphabet of `vocab_size` tokens
/// (whatever `cfg.source` says), e.g. so the CLI can print its loss lower bound.
pub fn synthetic_language(
    cfg: &DataConfig,
    vocab_size: usize,
) -> Result<SyntheticLanguage, DataError> {
    SyntheticLanguage::new(
        vocab_size,
        cfg.synthetic_order,
        cfg.synthetic_branching,
        cfg.synthetic_seed,
    )
}

/// The tokens of one micro-batch: `micro_batch_size` rows of `seq_len + 1` tokens, row-major
/// (`(micro_batch_size, seq_len + 1)`). Inputs are `row[..seq_len]`, targets `row[1..]`.
///
/// Row `r` is `src.sample(split, SampleKey { seed, step, micro_batch, row: r }, seq_len + 1)`,
/// so it does not depend on `micro_batch_size` or on who asks.
pub fn micro_batch_tokens(
    src: &dyn TokenSource,
    split: Split,
    seed: u64,
    step: u64,
    micro_batch: u64,
    micro_batch_size: usize,
    seq_len: usize,
) -> Result<Vec<u32>, DataError> {
    micro_batch_part(
        src,
        split,
        seed,
        step,
        micro_batch,
        micro_batch_size,
        seq_len,
        RowPart::Both,
    )
}

/// Part `part` of each row of [`micro_batch_tokens`]: `micro_batch_size` rows of
/// `part.span(seq_len).len()` tokens, row-major, read with [`TokenSource::sample_span`] so that
/// a sharded source fetches only those tokens.
#[allow(clippy::too_many_arguments)]
pub fn micro_batch_part(
    src: &dyn TokenSource,
    split: Split,
    seed: u64,
    step: u64,
    micro_batch: u64,
    micro_batch_size: usize,
    seq_len: usize,
    part: RowPart,
) -> Result<Vec<u32>, DataError> {
    if micro_batch_size == 0 || seq_len == 0 {
        return Err(DataError::InvalidArgument(format!(
            "micro_batch_tokens needs micro_batch_size >= 1 and seq_len >= 1 \
             (got {micro_batch_size} and {seq_len}); check the model/train config"
        )));
    }
    let span = part.span(seq_len);
    let mut out = Vec::with_capacity(micro_batch_size * span.len());
    for row in 0..micro_batch_size as u64 {
        let key = SampleKey {
            seed,
            step,
            micro_batch,
            row,
        };
        let tokens = src.sample_span(split, key, seq_len + 1, span.clone())?;
        debug_assert_eq!(tokens.len(), span.len());
        out.extend_from_slice(&tokens);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synth(vocab: usize) -> Box<dyn TokenSource> {
        open_source(&DataConfig::default(), vocab).unwrap()
    }

    #[test]
    fn config_defaults_and_serde() {
        let cfg = DataConfig::default();
        assert_eq!(cfg.source, "synthetic");
        assert_eq!(cfg.dtype, TokenDtype::U16);
        assert_eq!(
            (
                cfg.synthetic_order,
                cfg.synthetic_branching,
                cfg.synthetic_seed
            ),
            (1, 4, 1234)
        );
        let parsed: DataConfig =
            serde_json::from_str(r#"{"source":"/data/owt","dtype":"u32"}"#).unwrap();
        assert_eq!(parsed.source, "/data/owt");
        assert_eq!(parsed.dtype, TokenDtype::U32);
        assert_eq!(parsed.synthetic_branching, 4);
        let round: DataConfig =
            serde_json::from_str(&serde_json::to_string(&cfg).unwrap()).unwrap();
        assert_eq!(round, cfg);
        assert!(serde_json::from_str::<DataConfig>(r#"{"sauce":"x"}"#).is_err());
        assert!(serde_json::from_str::<DataConfig>(r#"{"dtype":"u8"}"#).is_err());
    }

    #[test]
    fn micro_batch_is_pure_and_row_keyed() {
        let src = synth(64);
        let a = micro_batch_tokens(&*src, Split::Train, 7, 3, 1, 4, 16).unwrap();
        let b = micro_batch_tokens(&*src, Split::Train, 7, 3, 1, 4, 16).unwrap();
        assert_eq!(a.len(), 4 * 17);
        assert_eq!(a, b);
        // A freshly opened source (another process / another restart) agrees.
        let again = synth(64);
        assert_eq!(
            a,
            micro_batch_tokens(&*again, Split::Train, 7, 3, 1, 4, 16).unwrap()
        );
        // Rows depend on the row index only, not on the micro-batch size.
        let two = micro_batch_tokens(&*src, Split::Train, 7, 3, 1, 2, 16).unwrap();
        assert_eq!(&a[..2 * 17], &two[..]);
        // Each row equals the source's sample for its key.
        for row in 0..4u64 {
            let key = SampleKey {
                seed: 7,
                step: 3,
                micro_batch: 1,
                row,
            };
            let r = row as usize;
            assert_eq!(
                &a[r * 17..(r + 1) * 17],
                &src.sample(Split::Train, key, 17).unwrap()[..]
            );
        }
        // Different rows, micro-batches, steps, seeds and splits differ.
        assert_ne!(a[..17], a[17..34]);
        for other in [
            micro_batch_tokens(&*src, Split::Train, 7, 3, 2, 4, 16).unwrap(),
            micro_batch_tokens(&*src, Split::Train, 7, 4, 1, 4, 16).unwrap(),
            micro_batch_tokens(&*src, Split::Train, 8, 3, 1, 4, 16).unwrap(),
            micro_batch_tokens(&*src, Split::Val, 7, 3, 1, 4, 16).unwrap(),
        ] {
            assert_ne!(a, other);
        }
    }

    #[test]
    fn row_parts_are_slices_of_the_whole_rows() {
        assert_eq!(RowPart::for_stage(true, false), Some(RowPart::Inputs));
        assert_eq!(RowPart::for_stage(false, true), Some(RowPart::Targets));
        assert_eq!(RowPart::for_stage(true, true), Some(RowPart::Both));
        assert_eq!(RowPart::for_stage(false, false), None);
        let src = synth(64);
        let whole = micro_batch_tokens(&*src, Split::Train, 7, 3, 1, 3, 16).unwrap();
        for part in [RowPart::Inputs, RowPart::Targets, RowPart::Both] {
            let span = part.span(16);
            let got = micro_batch_part(&*src, Split::Train, 7, 3, 1, 3, 16, part).unwrap();
            let want: Vec<u32> = whole
                .chunks_exact(17)
                .flat_map(|row| row[span.clone()].to_vec())
                .collect();
            assert_eq!(got, want, "{part:?}");
        }
        let key = SampleKey {
            seed: 0,
            step: 0,
            micro_batch: 0,
            row: 0,
        };
        assert!(matches!(
            src.sample_span(Split::Train, key, 8, 2..9),
            Err(DataError::InvalidArgument(_))
        ));
    }

    #[test]
    fn micro_batch_rejects_empty_shapes() {
        let src = synth(64);
        assert!(matches!(
            micro_batch_tokens(&*src, Split::Train, 0, 0, 0, 0, 8),
            Err(DataError::InvalidArgument(_))
        ));
        assert!(matches!(
            micro_batch_tokens(&*src, Split::Train, 0, 0, 0, 2, 0),
            Err(DataError::InvalidArgument(_))
        ));
    }

    #[test]
    fn open_source_rejects_empty_source() {
        let cfg = DataConfig {
            source: " ".into(),
            ..DataConfig::default()
        };
        let err = open_source(&cfg, 64).err().unwrap();
        assert!(matches!(err, DataError::InvalidConfig(_)), "{err}");
    }
}
