//! Token files in the nanoGPT layout: `<dir>/train.bin` and `<dir>/val.bin`, flat arrays of
//! little-endian token ids with no header, plus an optional `<dir>/meta.json` ([`DatasetMeta`]).
//!
//! The files are memory-mapped; a sample is a window of consecutive tokens at a pseudo-random
//! offset derived from the [`SampleKey`].

use std::fs::File;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use super::keys::{sample_rng, uniform_below};
use super::{DataError, SampleKey, Split, TokenDtype, TokenSource};

/// File name of the dataset metadata written by `seqpipe data prepare`.
pub const META_FILE: &str = "meta.json";

/// The contents of a dataset's `meta.json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct DatasetMeta {
    /// Vocabulary of the tokenizer (every id is below it).
    pub vocab_size: usize,
    /// Width of the token ids in the `.bin` files.
    pub dtype: TokenDtype,
    /// Tokenizer name (`"gpt2"`).
    pub tokenizer: String,
    /// Tokens in `train.bin`.
    pub train_tokens: u64,
    /// Tokens in `val.bin`.
    pub val_tokens: u64,
    /// The token that ends every document (`<|endoftext|>` = 50256 for GPT-2 BPE), from which
    /// document starts are found ([`document_starts`](super::documents::document_starts)).
    /// Absent in datasets prepared before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_of_text: Option<u32>,
}

impl DatasetMeta {
    /// Reads `<dir>/meta.json`; `Ok(None)` when the file does not exist.
    pub fn read(dir: &Path) -> Result<Option<DatasetMeta>, DataError> {
        let path = dir.join(META_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(DataError::Io {
                    action: "read",
                    path,
                    source,
                });
            }
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| DataError::Meta {
                path,
                message: format!(
                    "not valid dataset metadata ({e}); it should be the meta.json written by \
                 `seqpipe data prepare` — re-run it, or delete the file (it is optional)"
                ),
            })
    }
}

/// One memory-mapped token file.
#[derive(Debug)]
struct TokenFile {
    path: PathBuf,
    map: Mmap,
    tokens: u64,
}

impl TokenFile {
    fn open(dir: &Path, split: Split, dtype: TokenDtype) -> Result<TokenFile, DataError> {
        let path = dir.join(split.file_name());
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(DataError::MissingFile { split, path });
            }
            Err(source) => {
                return Err(DataError::Io {
                    action: "open",
                    path,
                    source,
                });
            }
        };
        let bytes = file
            .metadata()
            .map_err(|source| DataError::Io {
                action: "stat",
                path: path.clone(),
                source,
            })?
            .len();
        let width = dtype.width();
        if bytes % width as u64 != 0 {
            return Err(DataError::CorruptSize {
                path,
                bytes,
                width,
                dtype,
            });
        }
        // SAFETY: the map is read-only and only ever read through `&[u8]`. Like every reader of
        // memory-mapped data we rely on the file not being truncated or rewritten while the
        // trainer runs (documented on `TokenFiles`); prepared datasets are written once.
        let map = unsafe { Mmap::map(&file) }.map_err(|source| DataError::Io {
            action: "memory-map",
            path: path.clone(),
            source,
        })?;
        Ok(TokenFile {
            path,
            map,
            tokens: bytes / width as u64,
        })
    }
}

/// The `train.bin` / `val.bin` pair of a dataset directory, memory-mapped.
///
/// The files must not be modified while they are open (they are read through a memory map).
#[derive(Debug)]
pub struct TokenFiles {
    dir: PathBuf,
    dtype: TokenDtype,
    vocab_size: usize,
    meta: Option<DatasetMeta>,
    train: TokenFile,
    val: TokenFile,
}

impl TokenFiles {
    /// Opens and validates `<dir>/train.bin` and `<dir>/val.bin` holding `dtype` ids, for a
    /// model with `vocab_size` tokens.
    ///
    /// Checks that the directory and both files exist, that each file size is a multiple of the
    /// id width, and — when `<dir>/meta.json` exists — that its dtype and token counts agree.
    /// Token ids are checked against `vocab_size` when windows are sampled.
    pub fn open(dir: &Path, dtype: TokenDtype, vocab_size: usize) -> Result<TokenFiles, DataError> {
        if !dir.is_dir() {
            return Err(DataError::NotADirectory {
                path: dir.to_path_buf(),
            });
        }
        if vocab_size == 0 {
            return Err(DataError::InvalidConfig(
                "model.vocab_size is 0; set it to the dataset's vocab_size (50257 for GPT-2)"
                    .into(),
            ));
        }
        let train = TokenFile::open(dir, Split::Train, dtype)?;
        let val = TokenFile::open(dir, Split::Val, dtype)?;
        let meta = DatasetMeta::read(dir)?;
        if let Some(meta) = &meta {
            let meta_path = dir.join(META_FILE);
            if meta.dtype != dtype {
                return Err(DataError::Meta {
                    path: meta_path,
                    message: format!(
                        "the dataset stores {} token ids but [data] dtype is \"{dtype}\"; set \
                         [data] dtype = \"{}\"",
                        meta.dtype, meta.dtype
                    ),
                });
            }
            for (file, declared) in [(&train, meta.train_tokens), (&val, meta.val_tokens)] {
                if file.tokens != declared {
                    return Err(DataError::Meta {
                        path: meta_path,
                        message: format!(
                            "it declares {declared} tokens for {} but the file holds {}: the \
                             file is truncated or the metadata is stale; re-run `seqpipe data \
                             prepare`",
                            file.path.display(),
                            file.tokens
                        ),
                    });
                }
            }
            if meta.vocab_size > vocab_size {
                tracing::warn!(
                    dataset = %dir.display(),
                    dataset_vocab = meta.vocab_size,
                    model_vocab = vocab_size,
                    "dataset vocabulary is larger than the model's; sampling fails on the first \
                     token id >= model.vocab_size"
                );
            }
        }
        Ok(TokenFiles {
            dir: dir.to_path_buf(),
            dtype,
            vocab_size,
            meta,
            train,
            val,
        })
    }

    /// The dataset directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The dataset's `meta.json`, if it has one.
    pub fn meta(&self) -> Option<&DatasetMeta> {
        self.meta.as_ref()
    }

    /// Number of tokens in the split's file.
    pub fn tokens(&self, split: Split) -> u64 {
        self.file(split).tokens
    }

    /// Path of the split's file.
    pub fn path(&self, split: Split) -> &Path {
        &self.file(split).path
    }

    fn file(&self, split: Split) -> &TokenFile {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// The start-up check of one split: the file holds at least one sample of `sample_len`
    /// tokens, and, with `scan`, every token id in it fits the model's vocabulary (read in chunks,
    /// so a large file costs no memory). The errors name the file, as sampling would later.
    pub fn check(&self, split: Split, sample_len: usize, scan: bool) -> Result<(), DataError> {
        let file = self.file(split);
        let needed = (sample_len as u64).max(1);
        if file.tokens < needed {
            return Err(DataError::TooShort {
                path: file.path.clone(),
                tokens: file.tokens,
                needed,
            });
        }
        if scan {
            const CHUNK: u64 = 1 << 20;
            let mut start = 0;
            while start < file.tokens {
                let len = CHUNK.min(file.tokens - start);
                self.window(split, start, len as usize)?;
                start += len;
            }
        }
        Ok(())
    }

    /// Reads token `index` of `file` (no bounds check beyond slice indexing).
    #[inline]
    fn token_at(&self, file: &TokenFile, index: usize) -> u32 {
        match self.dtype {
            TokenDtype::U16 => {
                let b = &file.map[2 * index..2 * index + 2];
                u32::from(u16::from_le_bytes([b[0], b[1]]))
            }
            TokenDtype::U32 => {
                let b = &file.map[4 * index..4 * index + 4];
                u32::from_le_bytes([b[0], b[1], b[2], b[3]])
            }
        }
    }

    /// Returns `len` tokens of `split` starting at token `start`, checking each id against the
    /// model vocabulary.
    pub fn window(&self, split: Split, start: u64, len: usize) -> Result<Vec<u32>, DataError> {
        let file = self.file(split);
        let end = start.checked_add(len as u64).filter(|&e| e <= file.tokens);
        if end.is_none() {
            return Err(DataError::InvalidArgument(format!(
                "window [{start}, {start} + {len}) is outside {} ({} tokens)",
                file.path.display(),
                file.tokens
            )));
        }
        let start = start as usize;
        let mut out = Vec::with_capacity(len);
        for index in start..start + len {
            let value = self.token_at(file, index);
            if value as usize >= self.vocab_size {
                return Err(DataError::TokenOutOfRange {
                    path: file.path.clone(),
                    index: index as u64,
                    byte_offset: (index * self.dtype.width()) as u64,
                    value,
                    vocab_size: self.vocab_size,
                });
            }
            out.push(value);
        }
        Ok(out)
    }
}

impl TokenSource for TokenFiles {
    fn end_of_text(&self) -> Option<u32> {
        self.meta.as_ref().and_then(|m| m.end_of_text)
    }

    fn end_of_text_missing(&self) -> String {
        "a prepared directory records it as \"end_of_text\" in meta.json: prepare it again with \
         `seqpipe data prepare --out DIR`"
            .into()
    }

    fn vocab_size(&self) -> usize {
        self.meta
            .as_ref()
            .map_or(self.vocab_size, |meta| meta.vocab_size)
    }

    fn describe(&self) -> String {
        format!(
            "token files in {} ({} ids; {} train / {} val tokens)",
            self.dir.display(),
            self.dtype,
            self.train.tokens,
            self.val.tokens
        )
    }

    /// A window of `len` consecutive tokens at an offset in `[0, tokens - len]` drawn from the
    /// key's stream.
    fn sample(&self, split: Split, key: SampleKey, len: usize) -> Result<Vec<u32>, DataError> {
        let file = self.file(split);
        if file.tokens < len as u64 || file.tokens == 0 {
            return Err(DataError::TooShort {
                path: file.path.clone(),
                tokens: file.tokens,
                needed: (len as u64).max(1),
            });
        }
        let mut rng = sample_rng(split, key);
        let start = uniform_below(&mut rng, file.tokens - len as u64 + 1);
        self.window(split, start, len)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::super::{DataConfig, open_source};
    use super::*;

    /// A fresh, unique, empty directory under the system temp dir (removed on drop).
    pub(crate) struct TempDir(pub PathBuf);

    impl TempDir {
        pub(crate) fn new(tag: &str) -> TempDir {
            static COUNTER: AtomicU64 = AtomicU64::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let path = std::env::temp_dir().join(format!(
                "seqpipe-data-{tag}-{}-{nanos}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&path).unwrap();
            TempDir(path)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn write_u16(path: &Path, tokens: &[u16]) {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(path, bytes).unwrap();
    }

    fn write_u32(path: &Path, tokens: &[u32]) {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(path, bytes).unwrap();
    }

    fn cfg(dir: &Path, dtype: TokenDtype) -> DataConfig {
        DataConfig {
            source: dir.to_str().unwrap().to_string(),
            dtype,
            ..DataConfig::default()
        }
    }

    fn key(step: u64, row: u64) -> SampleKey {
        SampleKey {
            seed: 3,
            step,
            micro_batch: 1,
            row,
        }
    }

    #[test]
    fn u16_round_trip_windows() {
        let tmp = TempDir::new("u16");
        let train: Vec<u16> = (0..1000).map(|i| (i * 7 % 300) as u16).collect();
        let val: Vec<u16> = (0..50).map(|i| 299 - i as u16).collect();
        write_u16(&tmp.0.join("train.bin"), &train);
        write_u16(&tmp.0.join("val.bin"), &val);
        let files = TokenFiles::open(&tmp.0, TokenDtype::U16, 300).unwrap();
        assert_eq!(files.tokens(Split::Train), 1000);
        assert_eq!(files.tokens(Split::Val), 50);
        assert_eq!(
            files.window(Split::Train, 10, 5).unwrap(),
            train[10..15]
                .iter()
                .map(|&t| u32::from(t))
                .collect::<Vec<_>>()
        );
        let src = open_source(&cfg(&tmp.0, TokenDtype::U16), 300).unwrap();
        assert_eq!(src.vocab_size(), 300);
        let mut starts = std::collections::HashSet::new();
        for row in 0..20 {
            let s = src.sample(Split::Train, key(0, row), 17).unwrap();
            assert_eq!(s, src.sample(Split::Train, key(0, row), 17).unwrap());
            // The window is a contiguous slice of train.bin.
            let pos = train
                .windows(17)
                .position(|w| w.iter().zip(&s).all(|(&a, &b)| u32::from(a) == b))
                .expect("sample is a window of train.bin");
            starts.insert(pos);
            let v = src.sample(Split::Val, key(0, row), 17).unwrap();
            assert!(v.iter().all(|&t| t >= 250), "val samples come from val.bin");
        }
        assert!(starts.len() > 10, "offsets vary with the key");
        // Whole-file window: the only possible offset is 0.
        let whole = src.sample(Split::Val, key(5, 5), 50).unwrap();
        assert_eq!(whole.len(), 50);
        assert_eq!(whole[0], 299);
    }

    #[test]
    fn u32_round_trip_and_meta() {
        let tmp = TempDir::new("u32");
        let train: Vec<u32> = (0..100).map(|i| 70_000 + i).collect();
        write_u32(&tmp.0.join("train.bin"), &train);
        write_u32(&tmp.0.join("val.bin"), &train[..20]);
        let meta = DatasetMeta {
            vocab_size: 70_100,
            dtype: TokenDtype::U32,
            tokenizer: "test".into(),
            train_tokens: 100,
            val_tokens: 20,
            end_of_text: None,
        };
        std::fs::write(tmp.0.join(META_FILE), serde_json::to_string(&meta).unwrap()).unwrap();
        let files = TokenFiles::open(&tmp.0, TokenDtype::U32, 70_100).unwrap();
        assert_eq!(files.meta(), Some(&meta));
        assert_eq!(files.window(Split::Train, 99, 1).unwrap(), vec![70_099]);
        let s = files.sample(Split::Train, key(1, 1), 10).unwrap();
        assert_eq!(s[9], s[0] + 9);

        // meta.json disagreeing with the config dtype is reported.
        let err = TokenFiles::open(&tmp.0, TokenDtype::U16, 70_100).unwrap_err();
        assert!(matches!(err, DataError::Meta { .. }), "{err}");
        assert!(err.to_string().contains("dtype = \"u32\""), "{err}");
        // ... and so is a stale token count.
        let stale = DatasetMeta {
            train_tokens: 99,
            ..meta
        };
        std::fs::write(
            tmp.0.join(META_FILE),
            serde_json::to_string(&stale).unwrap(),
        )
        .unwrap();
        let err = TokenFiles::open(&tmp.0, TokenDtype::U32, 70_100).unwrap_err();
        assert!(err.to_string().contains("truncated"), "{err}");
        std::fs::write(tmp.0.join(META_FILE), "{not json").unwrap();
        let err = TokenFiles::open(&tmp.0, TokenDtype::U32, 70_100).unwrap_err();
        assert!(matches!(err, DataError::Meta { .. }), "{err}");
    }

    #[test]
    fn missing_directory_and_files() {
        let tmp = TempDir::new("missing");
        let err = TokenFiles::open(&tmp.0.join("nope"), TokenDtype::U16, 10).unwrap_err();
        assert!(matches!(err, DataError::NotADirectory { .. }), "{err}");

        let err = open_source(&cfg(&tmp.0, TokenDtype::U16), 10)
            .err()
            .unwrap();
        match &err {
            DataError::MissingFile { split, path } => {
                assert_eq!(*split, Split::Train);
                assert_eq!(path, &tmp.0.join("train.bin"));
            }
            other => panic!("unexpected {other}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains("train.bin") && msg.contains("seqpipe data prepare"),
            "{msg}"
        );

        write_u16(&tmp.0.join("train.bin"), &[1, 2, 3]);
        let err = TokenFiles::open(&tmp.0, TokenDtype::U16, 10).unwrap_err();
        assert!(
            matches!(
                err,
                DataError::MissingFile {
                    split: Split::Val,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("val.bin"));
    }

    #[test]
    fn odd_size_is_corrupt() {
        let tmp = TempDir::new("odd");
        std::fs::write(tmp.0.join("train.bin"), [1u8, 0, 2, 0, 3]).unwrap();
        write_u16(&tmp.0.join("val.bin"), &[1, 2]);
        let err = TokenFiles::open(&tmp.0, TokenDtype::U16, 10).unwrap_err();
        match &err {
            DataError::CorruptSize {
                path, bytes, width, ..
            } => {
                assert_eq!(path, &tmp.0.join("train.bin"));
                assert_eq!((*bytes, *width), (5, 2));
            }
            other => panic!("unexpected {other}"),
        }
        assert!(err.to_string().contains("not a multiple of 2"), "{err}");
        // 6 bytes are fine as u16 but not as u32.
        std::fs::write(tmp.0.join("train.bin"), [1u8, 0, 2, 0, 3, 0]).unwrap();
        assert!(TokenFiles::open(&tmp.0, TokenDtype::U16, 10).is_ok());
        let err = TokenFiles::open(&tmp.0, TokenDtype::U32, 10).unwrap_err();
        assert!(
            matches!(err, DataError::CorruptSize { width: 4, .. }),
            "{err}"
        );
    }

    #[test]
    fn too_short_for_a_sample() {
        let tmp = TempDir::new("short");
        write_u16(&tmp.0.join("train.bin"), &[1, 2, 3, 4]);
        write_u16(&tmp.0.join("val.bin"), &[]);
        let files = TokenFiles::open(&tmp.0, TokenDtype::U16, 10).unwrap();
        assert_eq!(
            files.sample(Split::Train, key(0, 0), 4).unwrap(),
            vec![1, 2, 3, 4]
        );
        let err = files.sample(Split::Train, key(0, 0), 5).unwrap_err();
        match &err {
            DataError::TooShort {
                path,
                tokens,
                needed,
            } => {
                assert_eq!(path, &tmp.0.join("train.bin"));
                assert_eq!((*tokens, *needed), (4, 5));
            }
            other => panic!("unexpected {other}"),
        }
        let err = files.sample(Split::Val, key(0, 0), 2).unwrap_err();
        assert!(
            matches!(err, DataError::TooShort { tokens: 0, .. }),
            "{err}"
        );
    }

    #[test]
    fn token_out_of_range_names_file_offset_value_and_vocab() {
        let tmp = TempDir::new("range");
        let mut train = vec![5u16; 20];
        train[13] = 300;
        write_u16(&tmp.0.join("train.bin"), &train);
        write_u16(&tmp.0.join("val.bin"), &[1, 2, 3]);
        let files = TokenFiles::open(&tmp.0, TokenDtype::U16, 256).unwrap();
        assert!(files.window(Split::Train, 0, 13).is_ok());
        let err = files.sample(Split::Train, key(0, 0), 20).unwrap_err();
        match &err {
            DataError::TokenOutOfRange {
                path,
                index,
                byte_offset,
                value,
                vocab_size,
            } => {
                assert_eq!(path, &tmp.0.join("train.bin"));
                assert_eq!(
                    (*index, *byte_offset, *value, *vocab_size),
                    (13, 26, 300, 256)
                );
            }
            other => panic!("unexpected {other}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains("train.bin") && msg.contains("300") && msg.contains("256"),
            "{msg}"
        );
    }
}
