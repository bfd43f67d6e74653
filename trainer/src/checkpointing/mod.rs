//! Checkpointing a training run with the `checkpoint` crate: the `[checkpoint]` config section, what a
//! stage's shard holds (parameters and AdamW moments under global names), and the trainer state that
//! makes a resume bit-exact.

pub mod hf;
pub mod shard;
pub mod state;

use std::path::Path;

use checkpoint::StoreOptions;
use serde::{Deserialize, Serialize};

/// `[checkpoint]`: where and how often checkpoints are written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointConfig {
    /// Where checkpoints go: a path, `file:///dir`, `s3://bucket/prefix`, `gs://bucket/prefix`,
    /// `az://container/prefix` (docs/checkpoints.md). Empty = `<run.dir>/checkpoints`.
    pub url: String,
    /// Write a checkpoint every this many steps (0 = only the final one). A final checkpoint is always
    /// written on normal exit and on SIGINT/SIGTERM.
    pub every: u64,
    /// Committed checkpoints to keep; older ones are deleted once a newer one is committed.
    pub keep_last: usize,
    /// On resume, fall back to the previous committed checkpoint (with a warning) when the chosen one
    /// is corrupt; false = fail instead.
    pub fallback: bool,
    /// S3 endpoint (e.g. `http://127.0.0.1:8333`); empty = from `AWS_ENDPOINT` / `AWS_ENDPOINT_URL`.
    pub s3_endpoint: String,
    /// S3 region; empty = from `AWS_REGION` (default `us-east-1`).
    pub s3_region: String,
    /// Allow plain-HTTP S3 endpoints.
    pub allow_http: bool,
    /// Upload bandwidth limit per worker in bytes/s (0 = unlimited).
    pub max_upload_bytes_per_s: u64,
    /// Seconds allowed, after SIGINT/SIGTERM, to finish the step and commit the final checkpoint.
    pub grace_s: f64,
    /// Open the store read-only: nothing is written, deleted or created in it (`seqpipe eval`
    /// sets this; `train` and `resume` refuse it).
    pub read_only: bool,
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            every: 20,
            keep_last: 2,
            fallback: true,
            s3_endpoint: String::new(),
            s3_region: String::new(),
            allow_http: false,
            max_upload_bytes_per_s: 0,
            grace_s: 30.0,
            read_only: false,
        }
    }
}

impl CheckpointConfig {
    /// The store URL, with the default under the run directory (made absolute so that every
    /// process resolves it alike).
    pub fn resolved_url(&self, run_dir: &Path) -> String {
        if !self.url.is_empty() {
            return self.url.clone();
        }
        let dir = run_dir.join("checkpoints");
        std::path::absolute(&dir)
            .unwrap_or(dir)
            .display()
            .to_string()
    }

    /// Options for [`checkpoint::CheckpointStore::open`].
    pub fn store_options(&self) -> StoreOptions {
        let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_string());
        StoreOptions {
            s3_endpoint: non_empty(&self.s3_endpoint),
            s3_region: non_empty(&self.s3_region),
            allow_http: self.allow_http.then_some(true),
            max_upload_bytes_per_s: (self.max_upload_bytes_per_s > 0)
                .then_some(self.max_upload_bytes_per_s),
            part_size: None,
            read_only: self.read_only,
        }
    }

    /// `grace_s` as a [`Duration`] (checked by [`crate::config::Config::validate`]).
    pub fn grace(&self) -> std::time::Duration {
        elastic::clamped_seconds(self.grace_s)
    }

    /// Whether step `step` (1-based) of `total` ends with a checkpoint.
    pub fn due(&self, step: u64, total: u64) -> bool {
        step == total || (self.every > 0 && step.is_multiple_of(self.every))
    }
}
