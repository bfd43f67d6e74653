//! The launcher's side of checkpointing: shard uploads scheduled on the workers, at most one
//! checkpoint in flight, the manifest committed once every shard is in, retention and cleanup
//! (stale uploads after each commit, staging objects of killed uploads when a run starts).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use checkpoint::{CheckpointStore, Manifest, ShardEntry};
use tracing::{info, warn};

use super::control::{ToLauncher, ToWorker};
use super::error::LaunchError;
use super::events::{CheckpointCommitted, CheckpointFailed, CheckpointWait, RunEvent};
use super::pipeline::Pipeline;
use crate::checkpointing::state::TrainerState;
use crate::config::Config;
use crate::metrics::MetricsLog;

/// The launcher's side of checkpointing: schedules shard uploads (at most one checkpoint in flight),
/// commits the manifest once every shard is in, applies retention and cleans stale uploads.
pub(super) struct CheckpointWriter {
    pub(super) store: CheckpointStore,
    pub(super) runtime: tokio::runtime::Runtime,
    keep_last: usize,
    pending: Option<PendingCheckpoint>,
}

struct PendingCheckpoint {
    state: TrainerState,
    started: Instant,
    shards: BTreeMap<usize, ShardEntry>,
    /// The longest time a worker's training thread spent on its snapshot.
    snapshot_s: f64,
}

impl CheckpointWriter {
    pub(super) fn open(cfg: &Config) -> Result<Self, LaunchError> {
        let (store, runtime) = super::store::open(cfg)?;
        Ok(Self {
            store,
            runtime,
            keep_last: cfg.checkpoint.keep_last,
            pending: None,
        })
    }

    /// Deletes the staging objects that uploads killed in an earlier run left behind (see
    /// [`CheckpointStore::clean_interrupted_uploads`]). Only for the start of a run, before any
    /// worker of it uploads: a staging object of a running upload looks the same. A failure is
    /// only warned about: the leftovers cost space, not correctness.
    pub(super) fn clean_interrupted_uploads(&self) {
        match self
            .runtime
            .block_on(self.store.clean_interrupted_uploads())
        {
            Ok(deleted) if !deleted.is_empty() => info!(
                url = self.store.url(),
                objects = deleted.len(),
                "deleted staging objects of uploads killed in an earlier run"
            ),
            Ok(_) => {}
            Err(e) => warn!(error = %e, "could not delete staging objects of killed uploads"),
        }
    }

    pub(super) fn committed_steps(&self) -> Result<Vec<u64>, LaunchError> {
        Ok(self.runtime.block_on(self.store.committed_steps())?)
    }

    /// Starts the checkpoint of `state.step`: every worker snapshots its state and uploads it in the
    /// background. Waits first if the previous checkpoint is still uploading.
    pub(super) fn begin(
        &mut self,
        pipeline: &mut Pipeline<'_>,
        state: TrainerState,
        metrics: &mut MetricsLog,
    ) -> Result<(), LaunchError> {
        if let Some(prev) = &self.pending {
            let (prev_step, waited) = (prev.state.step, Instant::now());
            info!(
                prev_step,
                next = state.step,
                "checkpoint of step {prev_step} is still uploading; training waits for it before starting the next one"
            );
            self.finish(pipeline, metrics, Duration::from_secs(3600))?;
            let _ = metrics.append_event(&RunEvent::CheckpointWait(CheckpointWait {
                step: state.step,
                waited_s: waited.elapsed().as_secs_f64(),
            }));
        }
        // A stage's shard is written once, by replica 0 (every replica holds the same state).
        pipeline.send_to_first_replica(&ToWorker::Checkpoint { step: state.step })?;
        self.pending = Some(PendingCheckpoint {
            state,
            started: Instant::now(),
            shards: BTreeMap::new(),
            snapshot_s: 0.0,
        });
        Ok(())
    }

    /// Handles upload reports that have arrived, committing when complete.
    pub(super) fn poll(
        &mut self,
        pipeline: &mut Pipeline<'_>,
        metrics: &mut MetricsLog,
    ) -> Result<(), LaunchError> {
        for msg in pipeline.take_side_messages() {
            self.handle(msg, pipeline.stages(), metrics)?;
        }
        Ok(())
    }

    /// The step of the checkpoint in flight if `stage`'s shard of it has not arrived (its worker
    /// was lost: a replacement must upload it).
    pub(super) fn missing_shard(&self, stage: usize) -> Option<u64> {
        self.pending
            .as_ref()
            .filter(|p| !p.shards.contains_key(&stage))
            .map(|p| p.state.step)
    }

    /// Gives up the checkpoint in flight (a lost worker's shard of it cannot be written any more);
    /// the previous committed checkpoint stays valid, the uploaded shards are cleaned later.
    pub(super) fn abandon(&mut self, metrics: &mut MetricsLog, why: &str) {
        if let Some(pending) = self.pending.take() {
            let step = pending.state.step;
            warn!(step, %why, "checkpoint abandoned; the previous committed one stays valid");
            let _ = metrics.append_event(&RunEvent::CheckpointFailed(CheckpointFailed {
                step,
                stage: None,
                error: why.to_string(),
            }));
        }
    }

    /// Waits until the checkpoint in flight (if any) is committed or has failed.
    pub(super) fn finish(
        &mut self,
        pipeline: &mut Pipeline<'_>,
        metrics: &mut MetricsLog,
        timeout: Duration,
    ) -> Result<(), LaunchError> {
        self.poll(pipeline, metrics)?;
        let deadline = Instant::now() + timeout;
        while let Some(pending) = &self.pending {
            let what = format!("the checkpoint of step {} to upload", pending.state.step);
            let msg = pipeline
                .next_side_message(deadline.saturating_duration_since(Instant::now()), &what)?;
            self.handle(msg, pipeline.stages(), metrics)?;
        }
        Ok(())
    }

    fn handle(
        &mut self,
        msg: ToLauncher,
        stages: usize,
        metrics: &mut MetricsLog,
    ) -> Result<(), LaunchError> {
        let Some(pending) = &mut self.pending else {
            // A late report of an abandoned checkpoint.
            info!(?msg, "ignored an upload report: no checkpoint in flight");
            return Ok(());
        };
        match msg {
            ToLauncher::ShardWritten {
                stage,
                step,
                shard,
                snapshot_s,
            } if step == pending.state.step => {
                pending.shards.insert(stage, shard);
                pending.snapshot_s = pending.snapshot_s.max(snapshot_s);
            }
            ToLauncher::ShardFailed { stage, step, error } if step == pending.state.step => {
                self.pending = None;
                warn!(step, stage, %error, "checkpoint upload failed; this checkpoint is abandoned (the previous committed one stays valid)");
                eprintln!("warning: checkpoint of step {step} not written: stage {stage}: {error}");
                let _ = metrics.append_event(&RunEvent::CheckpointFailed(CheckpointFailed {
                    step,
                    stage: Some(stage),
                    error,
                }));
                return Ok(());
            }
            ToLauncher::ShardWritten { step, .. } | ToLauncher::ShardFailed { step, .. }
                if step < pending.state.step =>
            {
                info!(step, "ignored an upload report of an abandoned checkpoint");
                return Ok(());
            }
            other => {
                return Err(LaunchError::Protocol(format!(
                    "unexpected {other:?} while checkpointing step {}",
                    pending.state.step
                )));
            }
        }
        if pending.shards.len() < stages {
            return Ok(());
        }
        let pending = self.pending.take().expect("pending checkpoint");
        let step = pending.state.step;
        let shards: Vec<ShardEntry> = pending.shards.into_values().collect();
        let manifest = Manifest::new(
            step,
            shards,
            serde_json::to_value(&pending.state).expect("state serializes"),
        );
        self.runtime.block_on(self.store.commit(&manifest))?;
        let upload_s = pending.started.elapsed().as_secs_f64();
        info!(
            step,
            bytes = manifest.total_bytes(),
            upload_s,
            url = self.store.url(),
            "checkpoint committed"
        );
        let _ = metrics.append_event(&RunEvent::Checkpoint(CheckpointCommitted {
            step,
            bytes: manifest.total_bytes(),
            upload_s,
            snapshot_s: pending.snapshot_s,
        }));
        let deleted = self.runtime.block_on(self.store.retain(self.keep_last))?;
        let stale = self.runtime.block_on(self.store.clean_stale(step))?;
        if !deleted.is_empty() || !stale.is_empty() {
            info!(?deleted, stale_objects = stale.len(), "retention");
        }
        Ok(())
    }
}
