//! The run's checkpoint store as the launcher opens it: the store at `checkpoint.url` (or the run
//! directory's default) with the small runtime its async API runs on. The checkpoint writer
//! uploads through it; the coordinator only asks which steps are committed.

use checkpoint::CheckpointStore;

use super::error::LaunchError;
use crate::config::Config;

/// Opens the run's checkpoint store and a single-threaded runtime to drive it.
pub(super) fn open(
    cfg: &Config,
) -> Result<(CheckpointStore, tokio::runtime::Runtime), LaunchError> {
    let store = CheckpointStore::open(
        &cfg.checkpoint.resolved_url(&cfg.run.dir),
        &cfg.checkpoint.store_options(),
    )?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| LaunchError::Io {
            what: "starting the checkpoint I/O runtime".into(),
            source,
        })?;
    Ok((store, runtime))
}

/// The steps of the run's committed checkpoints, oldest first.
pub(super) fn committed_steps(cfg: &Config) -> Result<Vec<u64>, LaunchError> {
    let (store, runtime) = open(cfg)?;
    Ok(runtime.block_on(store.committed_steps())?)
}
