//! The crate's one error type.

use std::path::PathBuf;

use crate::step_dir;

/// Everything that can go wrong while writing, reading or maintaining checkpoints.
///
/// Each message says what was wrong, where (store URL, object key, tensor name) and what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A write, commit or delete on a store opened read-only.
    #[error(
        "refused to {action} in {url}: the store was opened read-only (read-only commands such as \
         eval and ckpt never change a checkpoint store)"
    )]
    ReadOnly {
        /// The store.
        url: String,
        /// What was refused.
        action: String,
    },
    /// The checkpoint URL could not be understood.
    #[error(
        "bad checkpoint URL `{url}`: {reason}; use file:///abs/dir, a plain directory path, \
         s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or memory://"
    )]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The URL's scheme needs a cargo feature of this crate that was not compiled in.
    #[error(
        "checkpoint URL scheme `{scheme}://` needs the `{feature}` feature of the `checkpoint` \
         crate, which this build lacks; rebuild with `--features checkpoint/{feature}`"
    )]
    FeatureDisabled {
        /// The URL scheme, e.g. `gs`.
        scheme: String,
        /// The cargo feature that enables it, e.g. `gcp`.
        feature: String,
    },

    /// A store option has an unusable value.
    #[error("bad checkpoint store option `{option}` for {url}: {reason}")]
    BadOption {
        /// The store URL.
        url: String,
        /// The option's name, e.g. `part_size`.
        option: String,
        /// What is wrong and what would work.
        reason: String,
    },

    /// The object store failed an operation.
    #[error(
        "checkpoint store {url}: {action} failed: {source}; check that the store is reachable \
         and that the credentials and permissions allow it, then retry"
    )]
    Store {
        /// The store URL.
        url: String,
        /// What was being done, naming the key, e.g. `reading step-00000001/manifest.json`.
        action: String,
        /// The object store's error.
        #[source]
        source: object_store::Error,
    },

    /// There is no committed checkpoint (no manifest) for a step.
    #[error(
        "no checkpoint for step {step} in {url}: `{dir}/manifest.json` does not exist (a \
         checkpoint exists only once its manifest is committed); list the committed steps with \
         committed_steps()",
        dir = step_dir(*step)
    )]
    NotFound {
        /// The store URL.
        url: String,
        /// The step asked for.
        step: u64,
    },

    /// An object of a checkpoint does not match what its manifest records.
    #[error(
        "corrupt checkpoint object `{key}` in {url}: {detail}; do not resume from this \
         checkpoint: resume from an older committed step (and run verify() on it)"
    )]
    Corrupt {
        /// The store URL.
        url: String,
        /// The object's key relative to the store prefix, e.g. `step-00000007/stage0-….safetensors`.
        key: String,
        /// What does not match (names the tensor where one is involved).
        detail: String,
    },

    /// A tensor asked for is not in the manifest.
    #[error(
        "tensor `{name}` is not in the checkpoint of step {step} in {url}; check the name \
         against Manifest::tensor_names() (names are global, e.g. `h.7.attn.c_attn.weight`)"
    )]
    MissingTensor {
        /// The store URL.
        url: String,
        /// The tensor name asked for.
        name: String,
        /// The manifest's step.
        step: u64,
    },

    /// The step's manifest already exists: someone committed this step first.
    #[error(
        "step {step} is already committed in {url} (`{dir}/manifest.json` exists); \
         checkpoints are immutable: write the next step instead, or delete this one first",
        dir = step_dir(*step)
    )]
    AlreadyCommitted {
        /// The store URL.
        url: String,
        /// The step.
        step: u64,
    },

    /// A caller passed something unusable (bad shard name, tensor bytes of the wrong length…).
    #[error("invalid {what}: {detail}")]
    InvalidInput {
        /// What was invalid, naming it, e.g. `tensor \`h.0.ln_1.weight\` of shard \`stage0\``.
        what: String,
        /// What is wrong and what is expected.
        detail: String,
    },

    /// A manifest is malformed or inconsistent (refused by commit, or found when reading).
    #[error("invalid manifest for step {step} in {url}: {detail}")]
    InvalidManifest {
        /// The store URL.
        url: String,
        /// The manifest's step.
        step: u64,
        /// What is wrong and what to do.
        detail: String,
    },

    /// A manifest object is larger than any sane model's manifest: it is refused before it is
    /// read, so that a damaged or hostile object cannot exhaust memory.
    #[error(
        "manifest `{key}` in {url} is {size} bytes, over the {limit}-byte bound on manifests \
         (MAX_MANIFEST_BYTES: a manifest holds about 300 bytes per tensor, so this bound allows \
         over 100 000 tensors); the object is damaged or not a seqpipe manifest: resume from \
         another committed step"
    )]
    ManifestTooLarge {
        /// The store URL.
        url: String,
        /// The manifest's key.
        key: String,
        /// The object's size in bytes (at least this many when the store under-reported it).
        size: u64,
        /// The bound, [`crate::MAX_MANIFEST_BYTES`].
        limit: u64,
    },

    /// A local filesystem operation (creating the checkpoint directory) failed.
    #[error("checkpoint directory `{}`: {action} failed: {source}; check the path and its permissions", path.display())]
    Io {
        /// The local path.
        path: PathBuf,
        /// What was being done.
        action: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A manifest could not be serialized or parsed.
    #[error(
        "manifest `{key}` in {url}: {action} failed: {source}; the manifest is damaged or was \
         not written by seqpipe: resume from another committed step"
    )]
    Json {
        /// The store URL.
        url: String,
        /// The manifest's key.
        key: String,
        /// What was being done (`parsing`, `serializing`).
        action: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },

    /// A background task (hashing) panicked or was cancelled.
    #[error(
        "checkpoint background task for {action} failed: {source}; this is a bug, please report it"
    )]
    Task {
        /// What the task was doing.
        action: String,
        /// The join error.
        #[source]
        source: tokio::task::JoinError,
    },
}

impl CheckpointError {
    /// Whether the error means the checkpoint itself is damaged, so that an older committed
    /// checkpoint should be tried instead: a shard that does not match its manifest
    /// ([`Corrupt`](Self::Corrupt)), or a manifest that cannot be parsed
    /// ([`Json`](Self::Json)) or is inconsistent, e.g. records another step than its directory's
    /// ([`InvalidManifest`](Self::InvalidManifest)) or too large to read
    /// ([`ManifestTooLarge`](Self::ManifestTooLarge)). Store, permission and caller errors are not:
    /// an older checkpoint would fail alike.
    pub fn is_damaged_checkpoint(&self) -> bool {
        matches!(
            self,
            Self::Corrupt { .. }
                | Self::Json { .. }
                | Self::InvalidManifest { .. }
                | Self::ManifestTooLarge { .. }
        )
    }
}
