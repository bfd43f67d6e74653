//! `seqpipe data prepare`: tokenize text into a nanoGPT-layout dataset directory.
//!
//! Inputs are `.txt` files (the whole file is one document) and `.jsonl` files (one JSON object
//! per non-empty line; the document is its string `"text"` field). Documents are tokenized with
//! the GPT-2 BPE (`r50k_base`), each followed by `<|endoftext|>` (id 50256), and written as u16
//! little-endian ids: the last `val_fraction` of the documents (at least one when there are two
//! or more) to `val.bin`, the others to `train.bin`, plus a `meta.json` ([`DatasetMeta`]). A
//! single document (one `.txt` file) is split by tokens instead: its last `val_fraction` of
//! tokens (at least one) go to `val.bin`, like nanoGPT's 90/10 split of one text.
//!
//! Inputs are read twice — once to validate and count documents, once to tokenize — so that
//! nothing is written for invalid input and the token stream is never held in memory. Outputs
//! are written to temporary files and renamed into place at the end.
//!
//! Memory is bounded whatever the input: only regular files are read (a FIFO or device is
//! refused up front), a document is read and tokenized in pieces of about [`PIECE_BYTES`] cut
//! where GPT-2's pre-tokenizer never joins text (so the tokens are those of the whole document),
//! a stretch of more than [`MAX_UNBROKEN_BYTES`] with no such place is refused, and so is a
//! `.jsonl` line over [`MAX_JSONL_LINE_BYTES`]. An input with no text, or a split that would
//! leave `train.bin` or `val.bin` empty, is an error.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::bin::{DatasetMeta, META_FILE};
use super::{DataError, Split, TokenDtype};

/// GPT-2 vocabulary size.
pub const GPT2_VOCAB_SIZE: usize = 50257;
/// GPT-2 `<|endoftext|>` token id, appended after every document.
pub const GPT2_EOT: u32 = 50256;

/// What [`prepare()`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrepareReport {
    /// Documents written to `train.bin`.
    pub train_documents: u64,
    /// Documents written to `val.bin`.
    pub val_documents: u64,
    /// Tokens in `train.bin` (end-of-text tokens included).
    pub train_tokens: u64,
    /// Tokens in `val.bin` (end-of-text tokens included).
    pub val_tokens: u64,
    /// Path of `train.bin`.
    pub train_path: PathBuf,
    /// Path of `val.bin`.
    pub val_path: PathBuf,
    /// Path of `meta.json`.
    pub meta_path: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum InputKind {
    Text,
    Jsonl,
}

fn input_kind(path: &Path) -> Result<InputKind, DataError> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("txt") => Ok(InputKind::Text),
        Some("jsonl") => Ok(InputKind::Jsonl),
        _ => Err(DataError::Input {
            path: path.to_path_buf(),
            message: "unsupported file type; inputs must be .txt (one document per file) or \
                      .jsonl (one {\"text\": ...} object per line)"
                .into(),
        }),
    }
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> DataError + use<> {
    let path = path.to_path_buf();
    move |source| DataError::Io {
        action,
        path,
        source,
    }
}

/// Target size of the pieces a document is read and tokenized in (1 MiB).
pub const PIECE_BYTES: usize = 1 << 20;

/// The longest stretch of a document with no place to cut it into pieces (8 MiB): GPT-2's
/// tokenizer costs memory and time that grow faster than the length of one unbroken word.
pub const MAX_UNBROKEN_BYTES: usize = 8 << 20;

/// The longest `.jsonl` line, i.e. one document as JSON (16 MiB).
pub const MAX_JSONL_LINE_BYTES: usize = 16 << 20;

/// The last place in `bytes` where a document may be cut so that tokenizing both sides apart
/// gives the tokens of the whole: before an ASCII space or line feed between two printable ASCII
/// characters. GPT-2's pre-tokenizer ends a piece at such a character and starts the next one
/// with the whitespace (` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`, or a lone `\n`), and
/// the BPE never merges across pieces.
fn last_cut(bytes: &[u8]) -> Option<usize> {
    (1..bytes.len().saturating_sub(1)).rev().find(|&i| {
        matches!(bytes[i], b' ' | b'\n')
            && bytes[i - 1].is_ascii_graphic()
            && bytes[i + 1].is_ascii_graphic()
    })
}

/// Where a document comes from, for errors: its file and, for `.jsonl`, its line.
#[derive(Clone, Copy)]
struct Origin<'a> {
    path: &'a Path,
    line: Option<u64>,
}

impl Origin<'_> {
    fn error(&self, message: String) -> DataError {
        match self.line {
            Some(line) => DataError::InvalidJsonl {
                path: self.path.to_path_buf(),
                line,
                message,
            },
            None => DataError::Input {
                path: self.path.to_path_buf(),
                message,
            },
        }
    }
}

/// Reads one document from `r` and calls `f(piece, last)` on its pieces of about `piece_bytes`
/// (see [`last_cut`]), checking that it is UTF-8; `last` marks the final piece (an empty document
/// is one empty piece).
fn document_pieces(
    origin: Origin<'_>,
    mut r: impl Read,
    piece_bytes: usize,
    f: &mut dyn FnMut(&str, bool) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let mut buf: Vec<u8> = Vec::new();
    // Bytes of the document before `buf`.
    let mut offset = 0usize;
    let utf8 = |bytes: &[u8], offset: usize| {
        std::str::from_utf8(bytes).map(|_| ()).map_err(|e| {
            origin.error(format!(
                "not valid UTF-8 (first bad byte at offset {}); convert it to UTF-8",
                offset + e.valid_up_to()
            ))
        })
    };
    loop {
        let got = (&mut r)
            .take(piece_bytes as u64)
            .read_to_end(&mut buf)
            .map_err(io_err("read", origin.path))?;
        if got < piece_bytes {
            utf8(&buf, offset)?;
            return f(std::str::from_utf8(&buf).expect("checked"), true);
        }
        if let Some(cut) = last_cut(&buf) {
            utf8(&buf[..cut], offset)?;
            f(std::str::from_utf8(&buf[..cut]).expect("checked"), false)?;
            buf.drain(..cut);
            offset += cut;
        } else if buf.len() > MAX_UNBROKEN_BYTES {
            return Err(origin.error(format!(
                "more than {MAX_UNBROKEN_BYTES} bytes from offset {offset} without a space or \
                 line break between ASCII characters; the tokenizer reads documents in pieces \
                 cut at such places: break the text up or remove the long unbroken run"
            )));
        }
    }
}

/// Opens an input after checking that it is a regular file: a FIFO, device or directory could
/// block or never end.
fn open_regular(path: &Path) -> Result<File, DataError> {
    let meta = std::fs::metadata(path).map_err(io_err("read", path))?;
    if !meta.is_file() {
        return Err(DataError::Input {
            path: path.to_path_buf(),
            message: format!(
                "not a regular file (it is a {}); pass .txt or .jsonl files, e.g. copy a stream \
                 to a file first",
                file_type_name(&meta.file_type())
            ),
        });
    }
    File::open(path).map_err(io_err("open", path))
}

fn file_type_name(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_socket() {
        "socket"
    } else if t.is_char_device() || t.is_block_device() {
        "device"
    } else {
        "special file"
    }
}

/// The `"text"` field of one `.jsonl` line.
fn jsonl_text(path: &Path, line_no: u64, line: &str) -> Result<String, DataError> {
    let bad = |message: String| DataError::InvalidJsonl {
        path: path.to_path_buf(),
        line: line_no,
        message,
    };
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| bad(format!("invalid JSON ({e})")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| bad("not a JSON object".into()))?;
    match obj.get("text") {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(bad("field \"text\" is not a string".into())),
        None => Err(bad("no \"text\" field".into())),
    }
}

/// Calls `f(piece, last)` on the pieces of every document of `inputs`, in order (see
/// [`document_pieces`]); `f_input(path, had_text)` after each input.
fn for_each_piece(
    inputs: &[PathBuf],
    piece_bytes: usize,
    f: &mut dyn FnMut(&str, bool) -> Result<(), DataError>,
    f_input: &mut dyn FnMut(&Path, bool) -> Result<(), DataError>,
) -> Result<(), DataError> {
    for path in inputs {
        let mut had_text = false;
        let mut piece = |text: &str, last: bool| {
            had_text |= !text.is_empty();
            f(text, last)
        };
        match input_kind(path)? {
            InputKind::Text => {
                let origin = Origin { path, line: None };
                document_pieces(origin, open_regular(path)?, piece_bytes, &mut piece)?;
            }
            InputKind::Jsonl => {
                let mut reader = BufReader::new(open_regular(path)?);
                let mut line = Vec::new();
                for line_no in 1u64.. {
                    line.clear();
                    let got = (&mut reader)
                        .take(MAX_JSONL_LINE_BYTES as u64 + 1)
                        .read_until(b'\n', &mut line)
                        .map_err(|e| DataError::InvalidJsonl {
                            path: path.clone(),
                            line: line_no,
                            message: format!("cannot read line ({e})"),
                        })?;
                    if got == 0 {
                        break;
                    }
                    let origin = Origin {
                        path,
                        line: Some(line_no),
                    };
                    if line.len() > MAX_JSONL_LINE_BYTES && line.last() != Some(&b'\n') {
                        return Err(origin.error(format!(
                            "the line is longer than {MAX_JSONL_LINE_BYTES} bytes (the most \
                             one document may take); split the document into several lines"
                        )));
                    }
                    let text = std::str::from_utf8(&line).map_err(|e| {
                        origin.error(format!(
                            "cannot read line (not valid UTF-8 at byte {})",
                            e.valid_up_to()
                        ))
                    })?;
                    if text.trim().is_empty() {
                        continue;
                    }
                    let text = jsonl_text(path, line_no, text)?;
                    document_pieces(origin, text.as_bytes(), piece_bytes, &mut piece)?;
                }
            }
        }
        f_input(path, had_text)?;
    }
    Ok(())
}

/// A token file being written through a temporary name.
struct TokenWriter {
    tmp: PathBuf,
    path: PathBuf,
    out: BufWriter<File>,
    tokens: u64,
}

impl TokenWriter {
    fn create(path: PathBuf) -> Result<TokenWriter, DataError> {
        let mut tmp = path.clone().into_os_string();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let file = File::create(&tmp).map_err(io_err("create", &tmp))?;
        Ok(TokenWriter {
            out: BufWriter::with_capacity(1 << 20, file),
            tmp,
            path,
            tokens: 0,
        })
    }

    fn write(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        for &t in tokens {
            let t = u16::try_from(t).map_err(|_| {
                DataError::Tokenizer(format!(
                    "token id {t} does not fit in u16 (GPT-2 ids are < 50257)"
                ))
            })?;
            self.out
                .write_all(&t.to_le_bytes())
                .map_err(io_err("write", &self.tmp))?;
        }
        self.tokens += tokens.len() as u64;
        Ok(())
    }

    /// Moves the last `n` tokens written here to the end of `other` (streamed, not held).
    fn move_tail_to(&mut self, other: &mut TokenWriter, n: u64) -> Result<(), DataError> {
        let keep = (self.tokens - n) * 2;
        self.out.flush().map_err(io_err("write", &self.tmp))?;
        let mut tail = File::open(&self.tmp).map_err(io_err("read", &self.tmp))?;
        tail.seek(SeekFrom::Start(keep))
            .map_err(io_err("read", &self.tmp))?;
        std::io::copy(&mut tail, &mut other.out).map_err(io_err("write", &other.tmp))?;
        let file = self.out.get_mut();
        file.set_len(keep).map_err(io_err("truncate", &self.tmp))?;
        file.seek(SeekFrom::Start(keep))
            .map_err(io_err("truncate", &self.tmp))?;
        self.tokens -= n;
        other.tokens += n;
        Ok(())
    }

    /// Removes the temporary file (nothing is left behind for input that is refused).
    fn discard(self) {
        drop(self.out);
        let _ = std::fs::remove_file(&self.tmp);
    }

    fn finish(self) -> Result<(PathBuf, u64), DataError> {
        let file = self.out.into_inner().map_err(|e| DataError::Io {
            action: "write",
            path: self.tmp.clone(),
            source: e.into_error(),
        })?;
        file.sync_all().map_err(io_err("sync", &self.tmp))?;
        drop(file);
        std::fs::rename(&self.tmp, &self.path).map_err(io_err("rename into place", &self.path))?;
        Ok((self.path, self.tokens))
    }
}

/// Number of validation documents out of `n`: `round(val_fraction * n)`, clamped so that both
/// splits get at least one document when `n >= 2`.
fn val_documents(n: u64, val_fraction: f64) -> u64 {
    if n < 2 {
        0
    } else {
        ((val_fraction * n as f64).round() as u64).clamp(1, n - 1)
    }
}

/// Tokens held out from the end of the only document of `n` tokens: `round(val_fraction * n)`,
/// clamped so that both splits get at least one token when `n >= 2` (like [`val_documents`]).
fn val_tokens_of_one_document(n: u64, val_fraction: f64) -> u64 {
    val_documents(n, val_fraction)
}

/// Tokenizes `inputs` with the GPT-2 BPE into `out_dir/{train.bin,val.bin,meta.json}` (see the
/// module docs). `val_fraction` (in `[0, 1)`) is the share of documents, taken from the end, that
/// go to `val.bin`.
pub fn prepare(
    inputs: &[PathBuf],
    out_dir: &Path,
    val_fraction: f64,
) -> Result<PrepareReport, DataError> {
    check_inputs(inputs, val_fraction)?;
    // Pass 1: validate every input and count documents before writing anything.
    let n_docs = count_documents(inputs)?;
    let n_val = val_documents(n_docs, val_fraction);
    let n_train = n_docs - n_val;
    // With a single document there is no document to hold out: its last tokens are (see
    // `val_tokens_of_one_document`), so that val.bin is never silently empty.
    let split_one_document = n_docs == 1;

    let bpe = tiktoken_rs::r50k_base().map_err(|e| DataError::Tokenizer(e.to_string()))?;
    std::fs::create_dir_all(out_dir).map_err(io_err("create directory", out_dir))?;
    let mut train = TokenWriter::create(out_dir.join(Split::Train.file_name()))?;
    let mut val = TokenWriter::create(out_dir.join(Split::Val.file_name()))?;

    // Pass 2: tokenize and stream out (a single document all to train.bin, its tail moved after).
    let train_docs = if split_one_document { n_docs } else { n_train };
    let doc = tokenize(inputs, &bpe, train_docs, (&mut train, &mut val))?;
    if doc != n_docs {
        return Err(DataError::InvalidArgument(format!(
            "the inputs changed while being prepared ({n_docs} documents, then {doc}); \
             run again on files that are not being modified"
        )));
    }
    if split_one_document {
        let n_held = val_tokens_of_one_document(train.tokens, val_fraction);
        if n_held == 0 {
            let tokens = train.tokens;
            train.discard();
            val.discard();
            return Err(DataError::Input {
                path: inputs[0].clone(),
                message: format!(
                    "the only document has {tokens} token(s): too few to hold any out for val.bin; \
                     add text or more documents"
                ),
            });
        }
        train.move_tail_to(&mut val, n_held)?;
        tracing::info!(
            val_tokens = n_held,
            "one document: its last {n_held} tokens are held out in val.bin"
        );
    }
    if train.tokens == 0 || val.tokens == 0 {
        let (t, v) = (train.tokens, val.tokens);
        train.discard();
        val.discard();
        return Err(DataError::InvalidArgument(format!(
            "the split leaves {t} tokens in train.bin and {v} in val.bin; both need tokens: add \
             text or documents, or change --val-fraction"
        )));
    }
    let (train_path, train_tokens) = train.finish()?;
    let (val_path, val_tokens) = val.finish()?;
    let meta_path = write_meta(out_dir, train_tokens, val_tokens)?;
    tracing::info!(
        train_documents = n_train,
        val_documents = n_val,
        train_tokens,
        val_tokens,
        dir = %out_dir.display(),
        "dataset prepared"
    );
    Ok(PrepareReport {
        train_documents: n_train,
        val_documents: n_val,
        train_tokens,
        val_tokens,
        train_path,
        val_path,
        meta_path,
    })
}

/// [`prepare`]'s arguments: a fraction in `[0, 1)` and at least one input, each a regular file
/// of a kind it reads.
fn check_inputs(inputs: &[PathBuf], val_fraction: f64) -> Result<(), DataError> {
    if !(0.0..1.0).contains(&val_fraction) {
        return Err(DataError::InvalidArgument(format!(
            "val_fraction is {val_fraction}; it must be in [0, 1), e.g. 0.1"
        )));
    }
    if inputs.is_empty() {
        return Err(DataError::InvalidArgument(
            "no input files; pass one or more .txt or .jsonl files".into(),
        ));
    }
    for path in inputs {
        input_kind(path)?;
        open_regular(path)?;
    }
    Ok(())
}

/// The documents of `inputs` (at least one), every input read and checked to have text.
fn count_documents(inputs: &[PathBuf]) -> Result<u64, DataError> {
    let mut n_docs = 0u64;
    for_each_piece(
        inputs,
        PIECE_BYTES,
        &mut |_, last| {
            n_docs += u64::from(last);
            Ok(())
        },
        &mut |path, had_text| {
            if had_text {
                Ok(())
            } else {
                Err(DataError::Input {
                    path: path.to_path_buf(),
                    message: "it has no text, so no tokens: add text or leave the file out".into(),
                })
            }
        },
    )?;
    if n_docs == 0 {
        return Err(DataError::Input {
            path: inputs[0].clone(),
            message: "the inputs contain no documents (all .jsonl inputs are empty); add text"
                .into(),
        });
    }
    Ok(n_docs)
}

/// Tokenizes `inputs` with `bpe`, each document ended by the end-of-text token: the first
/// `train_docs` documents into `train`, the rest into `val`. Returns the documents seen.
fn tokenize(
    inputs: &[PathBuf],
    bpe: &tiktoken_rs::CoreBPE,
    train_docs: u64,
    (train, val): (&mut TokenWriter, &mut TokenWriter),
) -> Result<u64, DataError> {
    let mut doc = 0u64;
    for_each_piece(
        inputs,
        PIECE_BYTES,
        &mut |text, last| {
            let mut tokens = bpe.encode_ordinary(text);
            if last {
                tokens.push(GPT2_EOT);
            }
            let out = if doc < train_docs {
                &mut *train
            } else {
                &mut *val
            };
            out.write(&tokens)?;
            doc += u64::from(last);
            Ok(())
        },
        &mut |_, _| Ok(()),
    )?;
    Ok(doc)
}

/// Writes `out_dir/meta.json` for GPT-2 tokens; returns its path.
fn write_meta(out_dir: &Path, train_tokens: u64, val_tokens: u64) -> Result<PathBuf, DataError> {
    let meta = DatasetMeta {
        vocab_size: GPT2_VOCAB_SIZE,
        dtype: TokenDtype::U16,
        tokenizer: "gpt2".into(),
        train_tokens,
        val_tokens,
        end_of_text: Some(GPT2_EOT),
    };
    let meta_path = out_dir.join(META_FILE);
    let json = serde_json::to_string_pretty(&meta).expect("DatasetMeta serializes");
    std::fs::write(&meta_path, json + "\n").map_err(io_err("write", &meta_path))?;
    Ok(meta_path)
}

/// What [`prepare_sharded`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardedReport {
    /// The dataset's location (its `index.json` is at `<url>/index.json`).
    pub url: String,
    /// What the tokenization produced (paths are those of the staging directory, now removed).
    pub prepared: PrepareReport,
    /// The index written.
    pub index: super::shards::DatasetIndex,
}

/// Whether `out` looks like a URL (`scheme:...`) that is not written `scheme://...`, e.g.
/// `s3:bucket/ds`: a plain path like that would silently create a directory named `s3:`.
pub fn looks_like_mangled_url(out: &str) -> bool {
    match out.split_once(':') {
        Some((scheme, rest)) => {
            !rest.starts_with("//")
                && !scheme.is_empty()
                && scheme
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"+.-".contains(&b))
                && scheme.as_bytes()[0].is_ascii_alphabetic()
        }
        None => false,
    }
}

/// Tokenizes `inputs` like [`prepare()`] into a staging directory under `staging_root`, then
/// writes the result as a sharded dataset ([`super::shards`]) to `out`: an object-store URL
/// (`s3://bucket/prefix`, `gs://`, `az://`, `file:///abs/dir`) or a local directory. The shards
/// go first and the `index.json` last; a location that already holds a dataset is refused. The
/// staging directory is removed in every case.
pub fn prepare_sharded(
    inputs: &[PathBuf],
    out: &str,
    val_fraction: f64,
    layout: super::shards::ShardLayout,
    staging_root: &Path,
) -> Result<ShardedReport, DataError> {
    layout.validate(TokenDtype::U16)?;
    let url = out.trim().trim_end_matches('/').to_string();
    let store = super::remote::open_store(&url, false)?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let staging = staging_root.join(format!("seqpipe-prepare-{}-{nanos}", std::process::id()));
    let result = (|| {
        let prepared = prepare(inputs, &staging, val_fraction)?;
        let meta = DatasetMeta::read(&staging)?.ok_or_else(|| DataError::Meta {
            path: staging.join(META_FILE),
            message: "prepare wrote no meta.json".into(),
        })?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(io_err("start a runtime to write", Path::new(&url)))?;
        let target = super::shards::Target {
            url: url.clone(),
            store,
        };
        let index = rt.block_on(super::shards::publish(
            &staging,
            &meta,
            Some(GPT2_EOT),
            layout,
            &target,
        ))?;
        Ok(ShardedReport {
            url: url.clone(),
            prepared,
            index,
        })
    })();
    let _ = std::fs::remove_dir_all(&staging);
    result
}

#[cfg(test)]
mod tests {
    use super::super::bin::TokenFiles;
    use super::super::bin::tests::TempDir;
    use super::super::{DataConfig, SampleKey, TokenSource, open_source};
    use super::*;

    fn read_u16(path: &Path) -> Vec<u32> {
        std::fs::read(path)
            .unwrap()
            .chunks_exact(2)
            .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])))
            .collect()
    }

    #[test]
    fn val_split_sizes() {
        assert_eq!(val_documents(1, 0.5), 0);
        assert_eq!(val_documents(2, 0.0), 1);
        assert_eq!(val_documents(2, 0.9), 1);
        assert_eq!(val_documents(10, 0.1), 1);
        assert_eq!(val_documents(100, 0.25), 25);
    }

    #[test]
    fn prepare_txt_files() {
        let tmp = TempDir::new("prep-txt");
        let a = tmp.0.join("a.txt");
        let b = tmp.0.join("b.TXT");
        std::fs::write(&a, "Hello world").unwrap();
        std::fs::write(&b, " world").unwrap();
        let out = tmp.0.join("out");
        let report = prepare(&[a, b], &out, 0.1).unwrap();
        assert_eq!((report.train_documents, report.val_documents), (1, 1));
        assert_eq!((report.train_tokens, report.val_tokens), (3, 2));
        // GPT-2: "Hello" = 15496, " world" = 995.
        assert_eq!(read_u16(&report.train_path), vec![15496, 995, GPT2_EOT]);
        assert_eq!(read_u16(&report.val_path), vec![995, GPT2_EOT]);
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&report.meta_path).unwrap()).unwrap();
        assert_eq!(
            meta,
            serde_json::json!({"vocab_size": 50257, "dtype": "u16", "tokenizer": "gpt2",
                               "train_tokens": 3, "val_tokens": 2, "end_of_text": 50256})
        );
        assert!(!out.join("train.bin.tmp").exists());

        // The result opens as a dataset.
        let cfg = DataConfig {
            source: out.to_str().unwrap().into(),
            ..DataConfig::default()
        };
        let src = open_source(&cfg, GPT2_VOCAB_SIZE).unwrap();
        assert_eq!(src.vocab_size(), GPT2_VOCAB_SIZE);
        let key = SampleKey {
            seed: 0,
            step: 0,
            micro_batch: 0,
            row: 0,
        };
        assert_eq!(
            src.sample(Split::Train, key, 3).unwrap(),
            vec![15496, 995, GPT2_EOT]
        );
        // A model with a smaller vocabulary gets a clear error on sampling.
        let files = TokenFiles::open(&out, TokenDtype::U16, 1000).unwrap();
        let err = files.sample(Split::Train, key, 3).unwrap_err();
        assert!(
            matches!(err, DataError::TokenOutOfRange { value: 15496, .. }),
            "{err}"
        );
    }

    /// One `.txt` file is one document: its last tokens are held out, so val.bin is not empty,
    /// and train.bin + val.bin are exactly the document's tokens, in order, without overlap.
    #[test]
    fn one_document_is_split_by_tokens() {
        let tmp = TempDir::new("prep-one");
        let input = tmp.0.join("book.txt");
        let text: String = (0..200)
            .map(|i| format!("Sentence number {i} of the only book. "))
            .collect();
        std::fs::write(&input, &text).unwrap();
        let out = tmp.0.join("out");
        let report = prepare(std::slice::from_ref(&input), &out, 0.1).unwrap();
        let bpe = tiktoken_rs::r50k_base().unwrap();
        let mut all = bpe.encode_ordinary(&text);
        all.push(GPT2_EOT);
        let total = all.len() as u64;
        assert!(report.val_tokens > 0, "val.bin is empty: {report:?}");
        assert_eq!(report.train_tokens + report.val_tokens, total);
        assert_eq!(report.val_tokens, (total as f64 * 0.1).round() as u64);
        let (train, val) = (read_u16(&report.train_path), read_u16(&report.val_path));
        assert_eq!(
            (train.len() as u64, val.len() as u64),
            (report.train_tokens, report.val_tokens)
        );
        let joined: Vec<u32> = train.iter().chain(&val).copied().collect();
        assert_eq!(
            joined, all,
            "train.bin then val.bin must be the document, no overlap"
        );
        let meta = crate::data::DatasetMeta::read(&out).unwrap().unwrap();
        assert_eq!(
            (meta.train_tokens, meta.val_tokens),
            (report.train_tokens, report.val_tokens)
        );

        // Even a two-token document keeps one token on each side.
        std::fs::write(&input, "Hello").unwrap();
        let report = prepare(std::slice::from_ref(&input), &out, 0.1).unwrap();
        assert_eq!((report.train_tokens, report.val_tokens), (1, 1));
    }

    #[test]
    fn prepare_jsonl() {
        let tmp = TempDir::new("prep-jsonl");
        let input = tmp.0.join("docs.jsonl");
        let lines: Vec<String> = (0..10)
            .map(|i| format!("{{\"id\": {i}, \"text\": \"Hello world\"}}"))
            .collect();
        std::fs::write(&input, lines.join("\n") + "\n\n").unwrap();
        let out = tmp.0.join("out");
        let report = prepare(&[input], &out, 0.2).unwrap();
        assert_eq!((report.train_documents, report.val_documents), (8, 2));
        assert_eq!((report.train_tokens, report.val_tokens), (24, 6));
        assert_eq!(
            read_u16(&report.val_path),
            vec![15496, 995, GPT2_EOT, 15496, 995, GPT2_EOT]
        );
        let meta = crate::data::DatasetMeta::read(&out).unwrap().unwrap();
        assert_eq!((meta.train_tokens, meta.val_tokens), (24, 6));
        // The separator is recorded, and finds the documents of val.bin.
        assert_eq!(meta.end_of_text, Some(50256));
        assert_eq!(
            crate::data::documents::document_starts(&read_u16(&report.val_path), GPT2_EOT),
            vec![0, 3]
        );
    }

    #[test]
    fn prepare_reports_bad_jsonl_line() {
        let tmp = TempDir::new("prep-bad");
        let input = tmp.0.join("docs.jsonl");
        let out = tmp.0.join("out");
        for (body, needle) in [
            ("{\"text\": \"ok\"}\n{\"text\": 5}\n", "not a string"),
            ("{\"text\": \"ok\"}\n{broken\n", "invalid JSON"),
            ("{\"text\": \"ok\"}\n[1, 2]\n", "not a JSON object"),
            (
                "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n",
                "no \"text\" field",
            ),
        ] {
            std::fs::write(&input, body).unwrap();
            let err = prepare(std::slice::from_ref(&input), &out, 0.1).unwrap_err();
            match &err {
                DataError::InvalidJsonl { path, line, .. } => {
                    assert_eq!(path, &input);
                    assert_eq!(*line, 2);
                }
                other => panic!("unexpected {other}"),
            }
            let msg = err.to_string();
            assert!(
                msg.contains("docs.jsonl:2") && msg.contains(needle),
                "{msg}"
            );
            assert!(!out.exists(), "nothing is written for invalid input");
        }
    }

    #[test]
    fn prepare_rejects_bad_arguments() {
        let tmp = TempDir::new("prep-args");
        let out = tmp.0.join("out");
        assert!(matches!(
            prepare(&[], &out, 0.1),
            Err(DataError::InvalidArgument(_))
        ));
        let txt = tmp.0.join("a.txt");
        std::fs::write(&txt, "x").unwrap();
        assert!(matches!(
            prepare(std::slice::from_ref(&txt), &out, 1.0),
            Err(DataError::InvalidArgument(_))
        ));
        let csv = tmp.0.join("a.csv");
        std::fs::write(&csv, "x").unwrap();
        let err = prepare(&[csv], &out, 0.1).unwrap_err();
        assert!(matches!(err, DataError::Input { .. }), "{err}");
        let err = prepare(&[tmp.0.join("absent.txt")], &out, 0.1).unwrap_err();
        assert!(err.to_string().contains("absent.txt"), "{err}");
        let bad = tmp.0.join("bad.txt");
        std::fs::write(&bad, [b'a', 0xFF]).unwrap();
        let err = prepare(&[bad], &out, 0.1).unwrap_err();
        assert!(err.to_string().contains("UTF-8"), "{err}");
        // A single document ("x" and <|endoftext|>) is split by tokens: one each.
        let report = prepare(&[txt], &out, 0.5).unwrap();
        assert_eq!((report.train_documents, report.val_documents), (1, 0));
        assert_eq!((report.train_tokens, report.val_tokens), (1, 1));
    }

    /// Issue 35: an empty `.txt` gave exit 0 and a 0-token val.bin. An input with no text is an
    /// error naming it, alone or beside others, and nothing is written.
    #[test]
    fn an_input_with_no_text_is_refused() {
        let tmp = TempDir::new("prep-empty");
        let out = tmp.0.join("out");
        let empty = tmp.0.join("empty.txt");
        std::fs::write(&empty, "").unwrap();
        let full = tmp.0.join("full.txt");
        std::fs::write(&full, "Hello world").unwrap();
        let blank = tmp.0.join("blank.jsonl");
        std::fs::write(&blank, "{\"text\": \"\"}\n\n").unwrap();
        for inputs in [
            vec![empty.clone()],
            vec![full.clone(), empty.clone()],
            vec![blank.clone(), full.clone()],
        ] {
            let err = prepare(&inputs, &out, 0.1).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("empty.txt") || msg.contains("blank.jsonl"),
                "{msg}"
            );
            assert!(msg.contains("no text"), "{msg}");
            assert!(!out.exists(), "nothing is written for {inputs:?}");
        }
    }

    /// Issue 35: a FIFO input hung `data prepare` for over 120 s. A non-regular file is refused
    /// up front, naming it, without opening it.
    #[test]
    fn a_fifo_input_is_refused_at_once() {
        let tmp = TempDir::new("prep-fifo");
        let fifo = tmp.0.join("stream.txt");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let (tx, rx) = std::sync::mpsc::channel();
        let (input, out) = (fifo.clone(), tmp.0.join("out"));
        std::thread::spawn(move || {
            let _ = tx.send(prepare(&[input], &out, 0.1).map(|_| ()));
        });
        // Generous for a loaded machine: the refusal needs no I/O beyond a stat.
        let err = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("data prepare is blocked on the FIFO")
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("stream.txt") && msg.contains("FIFO"), "{msg}");
        // A directory likewise.
        let dir = tmp.0.join("dir.txt");
        std::fs::create_dir(&dir).unwrap();
        let msg = prepare(&[dir], &tmp.0.join("out"), 0.1)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("dir.txt") && msg.contains("directory"),
            "{msg}"
        );
    }

    /// Tokenizing a document in pieces cut by `last_cut` gives exactly the tokens of the whole
    /// text (spaces, line breaks, runs of whitespace, digits, punctuation, contractions, non-ASCII).
    #[test]
    fn pieces_tokenize_like_the_whole_document() {
        let bpe = tiktoken_rs::r50k_base().unwrap();
        let text: String = (0..300)
            .map(|i| match i % 6 {
                0 => format!("Line {i}:  it's  \n\n"),
                1 => format!("número {i}, naïve café\n"),
                2 => format!("  {i}{i}{i} ... ?!\t\n"),
                3 => format!("'s 've word{i} \n word"),
                4 => "漢字とかな 混じり\n".to_string(),
                _ => format!("{i}-{i}. End\r\n"),
            })
            .collect();
        let whole = bpe.encode_ordinary(&text);
        for piece_bytes in [7, 64, 1000] {
            let mut tokens = Vec::new();
            let mut pieces = 0;
            document_pieces(
                Origin {
                    path: Path::new("t.txt"),
                    line: None,
                },
                text.as_bytes(),
                piece_bytes,
                &mut |piece, _| {
                    pieces += 1;
                    tokens.extend(bpe.encode_ordinary(piece));
                    Ok(())
                },
            )
            .unwrap();
            assert!(pieces > 3, "{piece_bytes}: {pieces} pieces");
            assert_eq!(tokens, whole, "pieces of {piece_bytes} bytes");
        }
    }

    /// Issue 35: a 50 MB single-line `.jsonl` used 2.6 GB. A line over the bound, and a stretch
    /// with nowhere to cut it, are refused naming the file (and line), before they are held.
    #[test]
    fn oversized_documents_are_refused() {
        let tmp = TempDir::new("prep-big");
        let out = tmp.0.join("out");
        let jsonl = tmp.0.join("big.jsonl");
        let mut body = b"{\"text\": \"ok\"}\n{\"text\": \"".to_vec();
        body.extend(std::iter::repeat_n(b'a', MAX_JSONL_LINE_BYTES));
        body.extend_from_slice(b"\"}\n");
        std::fs::write(&jsonl, &body).unwrap();
        let msg = prepare(std::slice::from_ref(&jsonl), &out, 0.1)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("big.jsonl:2") && msg.contains("longer than"),
            "{msg}"
        );
        let txt = tmp.0.join("word.txt");
        let mut word = b"Hello world ".to_vec();
        word.extend(std::iter::repeat_n(b'x', MAX_UNBROKEN_BYTES + PIECE_BYTES));
        std::fs::write(&txt, &word).unwrap();
        let msg = prepare(std::slice::from_ref(&txt), &out, 0.1)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("word.txt") && msg.contains("without a space"),
            "{msg}"
        );
        assert!(!out.exists());
    }
}
