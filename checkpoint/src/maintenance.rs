//! Listing, retention and clean-up of step directories: committed checkpoints past retention,
//! stale uploads that listing shows, and staging objects of killed uploads that it does not.

use std::collections::{BTreeMap, HashSet};

use futures::{StreamExt, TryStreamExt};
use object_store::ObjectMeta;
use object_store::path::Path;

use crate::{
    CheckpointError, CheckpointStore, MANIFEST_NAME, SHARD_SUFFIX, parse_step_dir, step_dir,
};

/// One step directory found in the store, committed or not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepListing {
    /// The step.
    pub step: u64,
    /// Whether its manifest exists (only then is it a checkpoint).
    pub committed: bool,
    /// Total size of all objects in the directory, manifest included.
    pub bytes: u64,
    /// Number of objects in the directory, manifest included.
    pub objects: usize,
}

impl CheckpointStore {
    /// Every step directory found, committed or not, ascending by step: whether it is committed
    /// (its manifest exists), its total bytes and its object count. Objects outside
    /// `step-<digits>/` directories are ignored.
    pub async fn list(&self) -> Result<Vec<StepListing>, CheckpointError> {
        Ok(self
            .objects_by_step()
            .await?
            .into_iter()
            .map(|(step, objects)| StepListing {
                step,
                committed: objects.iter().any(|o| is_manifest(&o.location)),
                bytes: objects.iter().map(|o| o.size).sum(),
                objects: objects.len(),
            })
            .collect())
    }

    /// Steps with a manifest, ascending.
    pub async fn committed_steps(&self) -> Result<Vec<u64>, CheckpointError> {
        Ok(self
            .list()
            .await?
            .into_iter()
            .filter(|l| l.committed)
            .map(|l| l.step)
            .collect())
    }

    /// Retention: keeps the newest `keep_last` committed checkpoints (0 counts as 1: the newest
    /// committed checkpoint is never deleted) and deletes the older committed ones, each
    /// manifest FIRST and then its directory's other objects, so a half-deleted checkpoint is
    /// never visible as committed (leftovers are uncommitted and go with
    /// [`CheckpointStore::clean_stale`]). Uncommitted directories are not touched. Returns the
    /// deleted steps, ascending.
    pub async fn retain(&self, keep_last: usize) -> Result<Vec<u64>, CheckpointError> {
        self.writable("retire old checkpoints")?;
        let committed = self.committed_steps().await?;
        let keep = keep_last.max(1);
        let doomed = &committed[..committed.len().saturating_sub(keep)];
        for &step in doomed {
            self.delete_step(step).await?;
        }
        Ok(doomed.to_vec())
    }

    /// Deletes the checkpoint of `step`: its manifest FIRST (so it stops existing at once), then
    /// every other object of its directory. Deleting a step that does not exist does nothing.
    pub async fn delete_step(&self, step: u64) -> Result<(), CheckpointError> {
        self.writable(&format!("delete step {step}"))?;
        self.delete_key(&crate::manifest_key(step)).await?;
        let dir = Path::from(step_dir(step));
        let keys: Vec<String> = self
            .inner
            .list(Some(&dir))
            .map_ok(|o| o.location.to_string())
            .try_collect()
            .await
            .map_err(self.store_err(format!("listing `{dir}/`")))?;
        self.delete_keys(&keys).await?;
        tracing::info!(url = %self.url, step, objects = keys.len() + 1, "deleted checkpoint");
        Ok(())
    }

    /// Deletes stale uploads: every object in step directories without a manifest whose step is
    /// below `below_step` (interrupted or abandoned checkpoints), and `*.safetensors` objects
    /// inside committed steps that their manifest does not reference (failed or duplicate
    /// upload attempts). Pass the step currently being written as `below_step` so its in-flight
    /// shards are kept. A committed step whose manifest cannot be read is left alone. Returns
    /// the deleted keys, sorted.
    ///
    /// Incomplete S3/GCS multipart uploads are not objects and are not listed here; give the
    /// bucket a lifecycle rule that aborts them after a day.
    pub async fn clean_stale(&self, below_step: u64) -> Result<Vec<String>, CheckpointError> {
        self.writable("clean stale uploads")?;
        let mut doomed = Vec::new();
        for (step, objects) in self.objects_by_step().await? {
            let committed = objects.iter().any(|o| is_manifest(&o.location));
            if !committed {
                if step < below_step {
                    doomed.extend(objects.iter().map(|o| o.location.to_string()));
                }
                continue;
            }
            let manifest = match self.read_manifest(step).await {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(step, error = %e, "clean_stale: leaving a step with an unreadable manifest alone");
                    continue;
                }
            };
            let referenced: HashSet<&str> =
                manifest.shards.iter().map(|s| s.key.as_str()).collect();
            doomed.extend(
                objects
                    .iter()
                    .map(|o| o.location.to_string())
                    .filter(|k| k.ends_with(SHARD_SUFFIX) && !referenced.contains(k.as_str())),
            );
        }
        doomed.sort();
        self.delete_keys(&doomed).await?;
        if !doomed.is_empty() {
            tracing::info!(url = %self.url, objects = doomed.len(), "deleted stale checkpoint objects");
        }
        Ok(doomed)
    }

    /// Deletes the staging objects of uploads that were killed before they completed, in every
    /// step directory, committed or not; committed data is never touched. Returns the deleted
    /// keys, sorted.
    ///
    /// Only a local directory store has such objects: its backend writes `<key>#<n>` (`n` a
    /// number) and renames it to `<key>` when the upload completes, and hides these files from
    /// listing, so [`CheckpointStore::clean_stale`] never sees them and a killed upload's bytes
    /// stay forever. In-memory stores write atomically; S3/GCS/Azure multipart uploads are not
    /// objects (give the bucket a lifecycle rule that aborts them after a day); for these this
    /// does nothing.
    ///
    /// A staging object of a running upload looks exactly like a killed one's, and deleting it
    /// fails that upload. Call this only while no upload to this store can be in flight: at the
    /// start of a training run, before any worker writes.
    pub async fn clean_interrupted_uploads(&self) -> Result<Vec<String>, CheckpointError> {
        self.writable("clean staging objects of interrupted uploads")?;
        let Some(root) = self.local_root.clone() else {
            return Ok(Vec::new());
        };
        let doomed = tokio::task::spawn_blocking(move || remove_staging_files(&root))
            .await
            .map_err(|source| CheckpointError::Task {
                action: "cleaning staging objects".into(),
                source,
            })??;
        if !doomed.is_empty() {
            tracing::info!(url = %self.url, objects = doomed.len(), "deleted staging objects of interrupted uploads");
        }
        Ok(doomed)
    }

    /// All objects in `step-<digits>/` directories, grouped by step.
    async fn objects_by_step(&self) -> Result<BTreeMap<u64, Vec<ObjectMeta>>, CheckpointError> {
        let mut by_step: BTreeMap<u64, Vec<ObjectMeta>> = BTreeMap::new();
        let mut listing = self.inner.list(None);
        while let Some(meta) = listing.next().await {
            let meta = meta.map_err(self.store_err("listing the checkpoint objects"))?;
            let step = meta
                .location
                .as_ref()
                .split_once('/')
                .and_then(|(dir, _)| parse_step_dir(dir));
            if let Some(step) = step {
                by_step.entry(step).or_default().push(meta);
            }
        }
        Ok(by_step)
    }

    /// Deletes `keys` (in bulk where the store supports it); already-deleted keys are fine.
    async fn delete_keys(&self, keys: &[String]) -> Result<(), CheckpointError> {
        if keys.is_empty() {
            return Ok(());
        }
        let paths = keys
            .iter()
            .map(|k| self.path(k))
            .collect::<Result<Vec<_>, _>>()?;
        let mut results = self
            .inner
            .delete_stream(futures::stream::iter(paths.into_iter().map(Ok)).boxed());
        while let Some(r) = results.next().await {
            match r {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.store_err("deleting checkpoint objects")(e)),
            }
        }
        Ok(())
    }
}

/// Removes the local backend's staging files ([`is_staging_name`]) from every step directory
/// under `root`, then each step directory left empty; returns the removed keys, sorted.
fn remove_staging_files(root: &std::path::Path) -> Result<Vec<String>, CheckpointError> {
    let io = |path: &std::path::Path, action: &str| {
        let path = path.to_path_buf();
        let action = action.to_string();
        move |source| CheckpointError::Io {
            path,
            action,
            source,
        }
    };
    let mut removed = Vec::new();
    for dir in std::fs::read_dir(root).map_err(io(root, "listing the step directories"))? {
        let dir = dir.map_err(io(root, "listing the step directories"))?;
        let dir_name = dir.file_name().to_string_lossy().into_owned();
        if parse_step_dir(&dir_name).is_none() || !dir.path().is_dir() {
            continue;
        }
        let mut left = 0;
        for file in std::fs::read_dir(dir.path()).map_err(io(&dir.path(), "listing"))? {
            let file = file.map_err(io(&dir.path(), "listing"))?;
            let name = file.file_name().to_string_lossy().into_owned();
            if !is_staging_name(&name) {
                left += 1;
                continue;
            }
            match std::fs::remove_file(file.path()) {
                Ok(()) => removed.push(format!("{dir_name}/{name}")),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io(&file.path(), "deleting a staging file")(e)),
            }
        }
        if left == 0 {
            // Like the backend's automatic cleanup: no empty step directories.
            let _ = std::fs::remove_dir(dir.path());
        }
    }
    removed.sort();
    Ok(removed)
}

/// Whether `file_name` is a staging file of object_store's local backend: `<name>#<digits>`
/// (the same rule by which that backend hides it from listing).
fn is_staging_name(file_name: &str) -> bool {
    match file_name.split_once('#') {
        Some((_, suffix)) => !suffix.is_empty() && suffix.bytes().all(|b| b.is_ascii_digit()),
        None => false,
    }
}

/// Whether `location` is a step directory's manifest (`step-…/manifest.json`).
fn is_manifest(location: &Path) -> bool {
    let mut parts = location.as_ref().split('/');
    matches!(
        (parts.next(), parts.next(), parts.next()),
        (Some(_), Some(MANIFEST_NAME), None)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_names_are_recognized_like_the_local_backend_does() {
        for staging in ["stage0-3f9a.safetensors#1", "manifest.json#12", "x#007"] {
            assert!(is_staging_name(staging), "{staging}");
        }
        for object in [
            "stage0-3f9a.safetensors",
            "manifest.json",
            "a#b",
            "a#1b",
            "a#",
            "",
        ] {
            assert!(!is_staging_name(object), "{object}");
        }
    }
}
