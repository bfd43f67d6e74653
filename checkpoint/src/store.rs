//! Opening a checkpoint location: URL → object store + prefix, and the shared upload throttle.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::prefix::PrefixStore;
use object_store::{ObjectStore, ObjectStoreExt};
use tokio::time::Instant;

use crate::CheckpointError;

/// Multipart part size used when [`StoreOptions::part_size`] is `None`: 8 MiB.
pub const DEFAULT_PART_SIZE: usize = 8 * 1024 * 1024;

/// Smallest part size S3-compatible stores (and GCS, Azure through object_store) accept for all
/// parts but the last.
const CLOUD_MIN_PART_SIZE: usize = 5 * 1024 * 1024;

/// Options for opening a store beyond what the URL says (from config).
///
/// Environment variables also apply for S3: `AWS_ENDPOINT` / `AWS_ENDPOINT_URL`, `AWS_REGION`,
/// `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ALLOW_HTTP` (and every other `AWS_*` key
/// object_store knows); a value set here wins over the environment. With a custom endpoint and
/// no access key anywhere, requests are sent unsigned (anonymous), which S3-compatible test
/// servers such as SeaweedFS without configured identities accept.
#[derive(Clone, Debug, Default)]
pub struct StoreOptions {
    /// S3 endpoint URL, e.g. `http://127.0.0.1:8333` (for SeaweedFS, MinIO, R2…).
    pub s3_endpoint: Option<String>,
    /// S3 region (object_store's default is `us-east-1`).
    pub s3_region: Option<String>,
    /// Allow plain `http://` endpoints.
    pub allow_http: Option<bool>,
    /// Upload bandwidth limit in bytes/s (None = unlimited): throttles shard uploads; used to
    /// keep checkpoint traffic from starving training, and by tests to make uploads slow. The
    /// limit is shared by all clones of a [`CheckpointStore`] (concurrent uploads split it).
    pub max_upload_bytes_per_s: Option<u64>,
    /// Multipart part size (default 8 MiB, [`DEFAULT_PART_SIZE`]). Cloud stores need at least
    /// 5 MiB; local and in-memory stores accept any size of at least 1 byte.
    pub part_size: Option<usize>,
    /// Open for reading only: a local directory is not created (a missing one is an error), and
    /// every write, commit or delete is refused with [`CheckpointError::ReadOnly`]. Read-only
    /// commands (`eval`, `ckpt list/show/verify/export`) open stores this way.
    pub read_only: bool,
}

/// Upload parts in flight per upload. Parts reference the caller's tensor bytes (no copy), so
/// this costs no memory beyond the part being assembled.
pub(crate) const MAX_PARTS_IN_FLIGHT: usize = 4;

/// A checkpoint location: URL → object store + prefix.
///
/// URLs: `file:///abs/dir`, a plain path (relative or absolute; created if missing),
/// `s3://bucket/prefix`, `memory://` (in-process, for unit tests: every `open` gives a fresh,
/// empty store; clones share it), `gs://bucket/prefix` with the `gcp` feature and
/// `az://container/prefix` / `azure://container/prefix` with the `azure` feature.
///
/// Cheap to clone; clones share the connection pool and the upload throttle. Use it from one
/// long-lived Tokio runtime: pooled HTTP connections belong to the runtime that opened them.
#[derive(Clone)]
pub struct CheckpointStore {
    pub(crate) url: String,
    /// The store, already rooted at the URL's prefix: keys are relative (`step-…/…`).
    pub(crate) inner: Arc<dyn ObjectStore>,
    pub(crate) part_size: usize,
    pub(crate) limiter: Option<Arc<RateLimiter>>,
    pub(crate) read_only: bool,
    /// The absolute directory of a local store (`None` for remote and in-memory stores): the
    /// local backend's staging files are invisible to listing and are found through it.
    pub(crate) local_root: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for CheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointStore")
            .field("url", &self.url)
            .field("part_size", &self.part_size)
            .field(
                "max_upload_bytes_per_s",
                &self.limiter.as_ref().map(|l| l.bytes_per_s),
            )
            .finish()
    }
}

impl CheckpointStore {
    /// Opens the checkpoint location `url` (see the type's docs for the URL forms). Does not
    /// contact remote stores; a local directory is created if missing.
    pub fn open(url: &str, options: &StoreOptions) -> Result<Self, CheckpointError> {
        let url = url.trim();
        if url.is_empty() {
            return Err(bad_url(url, "the URL is empty"));
        }
        let mut local_root = None;
        let (inner, cloud): (Arc<dyn ObjectStore>, bool) = if !url.contains("://") {
            let (store, root) = open_local_dir(url, std::path::Path::new(url), options.read_only)?;
            local_root = Some(root);
            (store, false)
        } else {
            let parsed = url::Url::parse(url).map_err(|e| bad_url(url, &e.to_string()))?;
            let prefix = parsed.path().trim_matches('/');
            match parsed.scheme() {
                "file" => {
                    if parsed
                        .host_str()
                        .is_some_and(|h| !h.is_empty() && h != "localhost")
                    {
                        return Err(bad_url(
                            url,
                            "a file URL needs an absolute path with three slashes \
                             (file:///abs/dir); for a relative directory pass the plain path",
                        ));
                    }
                    let dir = parsed
                        .to_file_path()
                        .map_err(|()| bad_url(url, "not a local absolute path"))?;
                    let (store, root) = open_local_dir(url, &dir, options.read_only)?;
                    local_root = Some(root);
                    (store, false)
                }
                "memory" => (with_prefix(url, Arc::new(InMemory::new()), prefix)?, false),
                "s3" | "s3a" => (
                    with_prefix(url, open_s3(url, &parsed, options)?, prefix)?,
                    true,
                ),
                "gs" => (with_prefix(url, open_gcs(url)?, prefix)?, true),
                "az" | "azure" | "abfs" | "abfss" | "adl" => {
                    (with_prefix(url, open_azure(url)?, prefix)?, true)
                }
                other => {
                    return Err(bad_url(url, &format!("unsupported scheme `{other}://`")));
                }
            }
        };

        let part_size = options.part_size.unwrap_or(DEFAULT_PART_SIZE);
        if part_size == 0 || (cloud && part_size < CLOUD_MIN_PART_SIZE) {
            return Err(CheckpointError::BadOption {
                url: url.to_string(),
                option: "part_size".into(),
                reason: format!(
                    "{part_size} bytes is too small: cloud object stores need multipart parts of \
                     at least {CLOUD_MIN_PART_SIZE} bytes (5 MiB), local stores at least 1; \
                     leave it unset for the default of {DEFAULT_PART_SIZE}"
                ),
            });
        }
        let limiter = match options.max_upload_bytes_per_s {
            None => None,
            Some(0) => {
                return Err(CheckpointError::BadOption {
                    url: url.to_string(),
                    option: "max_upload_bytes_per_s".into(),
                    reason: "0 would never upload anything; leave it unset for no limit".into(),
                });
            }
            Some(rate) => Some(Arc::new(RateLimiter::new(rate))),
        };
        Ok(Self {
            url: url.to_string(),
            inner,
            part_size,
            limiter,
            read_only: options.read_only,
            local_root,
        })
    }

    /// Refuses `action` on a read-only store.
    pub(crate) fn writable(&self, action: &str) -> Result<(), CheckpointError> {
        if self.read_only {
            return Err(CheckpointError::ReadOnly {
                url: self.url.clone(),
                action: action.to_string(),
            });
        }
        Ok(())
    }

    /// The URL this store was opened with (as given).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The object store behind this location, rooted at the URL's prefix (keys are relative).
    /// For other readers of the same URL forms and S3 settings, e.g. datasets in a bucket; the
    /// read-only flag and the upload throttle do not apply to it.
    pub fn objects(&self) -> Arc<dyn ObjectStore> {
        Arc::clone(&self.inner)
    }

    /// Wraps an object store error with this store's URL and what was being done.
    pub(crate) fn store_err(
        &self,
        action: impl Into<String>,
    ) -> impl FnOnce(object_store::Error) -> CheckpointError + '_ {
        let action = action.into();
        move |source| CheckpointError::Store {
            url: self.url.clone(),
            action,
            source,
        }
    }

    /// A [`CheckpointError::Corrupt`] for `key` in this store.
    pub(crate) fn corrupt(&self, key: &str, detail: impl Into<String>) -> CheckpointError {
        CheckpointError::Corrupt {
            url: self.url.clone(),
            key: key.to_string(),
            detail: detail.into(),
        }
    }

    /// Parses a key built by this crate (or listed from the store) into an object path.
    pub(crate) fn path(&self, key: &str) -> Result<Path, CheckpointError> {
        Path::parse(key).map_err(|e| CheckpointError::InvalidInput {
            what: format!("object key `{key}` in {}", self.url),
            detail: e.to_string(),
        })
    }

    /// Deletes `key`, treating "already gone" as success.
    pub(crate) async fn delete_key(&self, key: &str) -> Result<(), CheckpointError> {
        match self.inner.delete(&self.path(key)?).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.store_err(format!("deleting `{key}`"))(e)),
        }
    }

    /// Waits until `n` more bytes may be uploaded under the bandwidth limit (no-op without one).
    pub(crate) async fn throttle(&self, n: usize) {
        if let Some(limiter) = &self.limiter {
            limiter.acquire(n).await;
        }
    }

    /// Largest piece handed to the uploader at once: small enough that the throttle paces
    /// smoothly, and never more than a part.
    pub(crate) fn feed_chunk(&self) -> usize {
        match &self.limiter {
            None => self.part_size,
            Some(_) => self.part_size.min(256 * 1024),
        }
    }
}

fn bad_url(url: &str, reason: &str) -> CheckpointError {
    CheckpointError::BadUrl {
        url: url.to_string(),
        reason: reason.to_string(),
    }
}

/// A local directory as a store (created if missing), and its absolute path.
fn open_local_dir(
    url: &str,
    dir: &std::path::Path,
    read_only: bool,
) -> Result<(Arc<dyn ObjectStore>, std::path::PathBuf), CheckpointError> {
    if read_only && !dir.is_dir() {
        return Err(CheckpointError::Io {
            path: dir.to_path_buf(),
            action: "opening the checkpoint directory (read-only: it is not created)".into(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such directory"),
        });
    }
    std::fs::create_dir_all(dir).map_err(|source| CheckpointError::Io {
        path: dir.to_path_buf(),
        action: "creating the checkpoint directory".into(),
        source,
    })?;
    let abs = std::fs::canonicalize(dir).map_err(|source| CheckpointError::Io {
        path: dir.to_path_buf(),
        action: "resolving the checkpoint directory".into(),
        source,
    })?;
    let fs = LocalFileSystem::new_with_prefix(&abs)
        .map_err(|e| bad_url(url, &format!("cannot use `{}`: {e}", abs.display())))?
        // Removes step directories once their last object is deleted.
        .with_automatic_cleanup(true)
        // A completed shard and a committed manifest are on disk, in that order, before the
        // calls return: a machine that dies right after commit() still has the checkpoint.
        .with_fsync(true);
    Ok((Arc::new(fs), abs))
}

fn with_prefix(
    url: &str,
    store: Arc<dyn ObjectStore>,
    prefix: &str,
) -> Result<Arc<dyn ObjectStore>, CheckpointError> {
    if prefix.is_empty() {
        return Ok(store);
    }
    let prefix = Path::parse(prefix)
        .map_err(|e| bad_url(url, &format!("unusable prefix `{prefix}`: {e}")))?;
    Ok(Arc::new(PrefixStore::new(store, prefix)))
}

fn open_s3(
    url: &str,
    parsed: &url::Url,
    options: &StoreOptions,
) -> Result<Arc<dyn ObjectStore>, CheckpointError> {
    let bucket = parsed.host_str().unwrap_or("");
    if bucket.is_empty() {
        return Err(bad_url(url, "no bucket: write s3://bucket/prefix"));
    }
    let mut builder = AmazonS3Builder::from_env()
        .with_url(url)
        .with_bucket_name(bucket);
    if let Some(endpoint) = &options.s3_endpoint {
        builder = builder.with_endpoint(endpoint);
    }
    if let Some(region) = &options.s3_region {
        builder = builder.with_region(region);
    }
    if let Some(allow_http) = options.allow_http {
        builder = builder.with_allow_http(allow_http);
    }
    let has_endpoint = builder
        .get_config_value(&AmazonS3ConfigKey::Endpoint)
        .is_some_and(|e| !e.is_empty());
    let has_key = builder
        .get_config_value(&AmazonS3ConfigKey::AccessKeyId)
        .is_some_and(|k| !k.is_empty());
    if has_endpoint && !has_key {
        tracing::info!(
            url,
            "custom S3 endpoint and no AWS_ACCESS_KEY_ID: sending unsigned (anonymous) requests"
        );
        builder = builder.with_skip_signature(true);
    }
    let store = builder
        .build()
        .map_err(|e| bad_url(url, &format!("cannot configure S3: {e}")))?;
    Ok(Arc::new(store))
}

#[cfg(feature = "gcp")]
fn open_gcs(url: &str) -> Result<Arc<dyn ObjectStore>, CheckpointError> {
    let store = object_store::gcp::GoogleCloudStorageBuilder::from_env()
        .with_url(url)
        .build()
        .map_err(|e| bad_url(url, &format!("cannot configure Google Cloud Storage: {e}")))?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "gcp"))]
fn open_gcs(_url: &str) -> Result<Arc<dyn ObjectStore>, CheckpointError> {
    Err(CheckpointError::FeatureDisabled {
        scheme: "gs".into(),
        feature: "gcp".into(),
    })
}

#[cfg(feature = "azure")]
fn open_azure(url: &str) -> Result<Arc<dyn ObjectStore>, CheckpointError> {
    let store = object_store::azure::MicrosoftAzureBuilder::from_env()
        .with_url(url)
        .build()
        .map_err(|e| bad_url(url, &format!("cannot configure Azure Blob Storage: {e}")))?;
    Ok(Arc::new(store))
}

#[cfg(not(feature = "azure"))]
fn open_azure(url: &str) -> Result<Arc<dyn ObjectStore>, CheckpointError> {
    let scheme = url.split("://").next().unwrap_or("az");
    Err(CheckpointError::FeatureDisabled {
        scheme: scheme.into(),
        feature: "azure".into(),
    })
}

/// Paces uploads to an average of `bytes_per_s`: each reservation of `n` bytes occupies the
/// next `n / rate` seconds of a shared virtual clock and waits until its slot has passed.
/// Idle time does not accumulate credit, so there are no bursts above the rate.
#[derive(Debug)]
pub(crate) struct RateLimiter {
    bytes_per_s: u64,
    next_free: Mutex<Instant>,
}

impl RateLimiter {
    fn new(bytes_per_s: u64) -> Self {
        Self {
            bytes_per_s,
            next_free: Mutex::new(Instant::now()),
        }
    }

    async fn acquire(&self, n: usize) {
        let deadline = {
            let mut next_free = self.next_free.lock().unwrap_or_else(|p| p.into_inner());
            let start = (*next_free).max(Instant::now());
            let end = start + Duration::from_secs_f64(n as f64 / self.bytes_per_s as f64);
            *next_free = end;
            end
        };
        tokio::time::sleep_until(deadline).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(url: &str) -> CheckpointError {
        CheckpointStore::open(url, &StoreOptions::default()).unwrap_err()
    }

    #[test]
    fn bad_urls_say_why() {
        assert!(matches!(err(""), CheckpointError::BadUrl { .. }));
        assert!(matches!(err("ftp://x/y"), CheckpointError::BadUrl { .. }));
        assert!(matches!(
            err("s3:///nobucket"),
            CheckpointError::BadUrl { .. }
        ));
        assert!(matches!(
            err("file://relative/dir"),
            CheckpointError::BadUrl { .. }
        ));
        let msg = err("ftp://x/y").to_string();
        assert!(
            msg.contains("ftp://x/y") && msg.contains("unsupported scheme"),
            "{msg}"
        );
    }

    #[cfg(not(feature = "gcp"))]
    #[test]
    fn gcs_without_feature_names_it() {
        let msg = err("gs://bucket/ckpt").to_string();
        assert!(msg.contains("`gcp`") && msg.contains("gs://"), "{msg}");
    }

    #[cfg(not(feature = "azure"))]
    #[test]
    fn azure_without_feature_names_it() {
        for url in ["az://container/ckpt", "azure://container/ckpt"] {
            let e = err(url);
            assert!(
                matches!(&e, CheckpointError::FeatureDisabled { feature, .. } if feature == "azure"),
                "{e}"
            );
        }
    }

    #[test]
    fn bad_options_are_refused() {
        let opts = StoreOptions {
            part_size: Some(1024 * 1024),
            ..Default::default()
        };
        let e = CheckpointStore::open("s3://bucket/p", &opts).unwrap_err();
        assert!(matches!(e, CheckpointError::BadOption { .. }), "{e}");
        assert!(CheckpointStore::open("memory://", &opts).is_ok());
        let opts = StoreOptions {
            max_upload_bytes_per_s: Some(0),
            ..Default::default()
        };
        let e = CheckpointStore::open("memory://", &opts).unwrap_err();
        assert!(e.to_string().contains("max_upload_bytes_per_s"), "{e}");
    }
}
