//! The launcher's side of checkpointing: shard uploads scheduled on the workers, at most one
//! checkpoint in flight, the manifest committed once every shard is in, retention and cleanup
//! (stale uploads after each commit, staging objects of killed uploads when a run starts), and
//! the run's final checkpoint, retried until it commits or its deadline passes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use checkpoint::{CheckpointStore, Manifest, ShardEntry};
use tracing::{info, warn};

use super::control::{ToLauncher, ToWorker};
use super::error::LaunchError;
use super::events::{CheckpointCommitted, CheckpointFailed, CheckpointWait, RunEvent};
use super::metrics_log::MetricsLog;
use super::pipeline::Pipeline;
use crate::checkpointing::state::TrainerState;
use crate::config::Config;

/// The launcher's side of checkpointing: schedules shard uploads (at most one checkpoint in flight),
/// commits the manifest once every shard is in, applies retention and cleans stale uploads.
pub(super) struct CheckpointWriter {
    pub(super) store: CheckpointStore,
    pub(super) runtime: tokio::runtime::Runtime,
    keep_last: usize,
    pending: Option<PendingCheckpoint>,
    /// The step of the last checkpoint this writer committed.
    last_committed: Option<u64>,
    /// The last checkpoint that failed (its state, to try it again) and why.
    last_failed: Option<(TrainerState, String)>,
}

struct PendingCheckpoint {
    state: TrainerState,
    started: Instant,
    shards: BTreeMap<usize, ShardEntry>,
    /// The stages whose upload failed, with the error. The checkpoint is given up once every
    /// stage has reported (so that no late report of it is taken for one of a retry).
    failed: BTreeMap<usize, String>,
    /// The longest time a worker's training thread spent on its snapshot.
    snapshot_s: f64,
}

impl PendingCheckpoint {
    fn reported(&self) -> BTreeSet<usize> {
        self.shards
            .keys()
            .chain(self.failed.keys())
            .copied()
            .collect()
    }
}

/// How the run's final checkpoint is retried: at most this many attempts at the normal end of a
/// run (a signal's grace period bounds the attempts instead)...
const FINAL_ATTEMPTS: u32 = 4;
/// ...waiting this long before the second attempt, twice as long before each next one.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);

/// What bounds the attempts at the final checkpoint (see [`CheckpointWriter::commit_final`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FinalDeadline {
    /// The normal end of a run: [`FINAL_ATTEMPTS`] attempts, each waiting up to this long for
    /// its upload.
    Attempts(Duration),
    /// A stop on a signal: attempts until this instant (the grace period's end), no later.
    Until(Instant),
}

impl CheckpointWriter {
    pub(super) fn open(cfg: &Config) -> Result<Self, LaunchError> {
        let (store, runtime) = super::store::open(cfg)?;
        Ok(Self {
            store,
            runtime,
            keep_last: cfg.checkpoint.keep_last,
            pending: None,
            last_committed: None,
            last_failed: None,
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
            failed: BTreeMap::new(),
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

    /// Records that the checkpoint of `state` failed (on `stage`, or `None` for its manifest):
    /// a warning and a `checkpoint_failed` event; the previous committed one stays valid.
    fn failed(
        &mut self,
        state: TrainerState,
        stage: Option<usize>,
        error: String,
        metrics: &mut MetricsLog,
    ) {
        let step = state.step;
        warn!(step, ?stage, %error, "checkpoint failed; this checkpoint is abandoned (the previous committed one stays valid)");
        eprintln!("warning: checkpoint of step {step} not written: {error}");
        let _ = metrics.append_event(&RunEvent::CheckpointFailed(CheckpointFailed {
            step,
            stage,
            error: error.clone(),
        }));
        self.last_failed = Some((state, error));
    }

    /// Makes sure the run's final checkpoint, of `step` (begun at its boundary), is committed:
    /// waits for it, and while it failed, begins it again from the same state after a backoff
    /// (1 s, then twice as long each time), within `deadline`. Fails with
    /// [`LaunchError::FinalCheckpointFailed`] when it is still not committed.
    pub(super) fn commit_final(
        &mut self,
        pipeline: &mut Pipeline<'_>,
        metrics: &mut MetricsLog,
        step: u64,
        deadline: FinalDeadline,
    ) -> Result<(), LaunchError> {
        let mut backoff = FIRST_BACKOFF;
        let mut attempt = 1;
        loop {
            let wait = match deadline {
                FinalDeadline::Attempts(timeout) => timeout,
                FinalDeadline::Until(until) => until.saturating_duration_since(Instant::now()),
            };
            match self.finish(pipeline, metrics, wait) {
                // Out of time with the upload still running: the checkpoint is not committed.
                Err(LaunchError::Timeout { .. }) if matches!(deadline, FinalDeadline::Until(_)) => {
                    let error =
                        format!("its upload did not finish within the grace period ({wait:?})");
                    return Err(final_failed(step, attempt, error));
                }
                other => other?,
            }
            if self.last_committed == Some(step) {
                return Ok(());
            }
            let Some((state, error)) = self.last_failed.clone().filter(|(s, _)| s.step == step)
            else {
                return Err(final_failed(
                    step,
                    attempt,
                    "it was abandoned (a worker was lost)".into(),
                ));
            };
            let next_at = Instant::now() + backoff;
            let more = match deadline {
                FinalDeadline::Attempts(_) => attempt < FINAL_ATTEMPTS,
                FinalDeadline::Until(until) => next_at < until,
            };
            if !more {
                return Err(final_failed(step, attempt, error));
            }
            attempt += 1;
            eprintln!(
                "retrying the final checkpoint of step {step} in {:.0} s (attempt {attempt})",
                backoff.as_secs_f64()
            );
            std::thread::sleep(backoff);
            backoff *= 2;
            self.begin(pipeline, state, metrics)?;
        }
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
                pending.failed.remove(&stage);
                pending.shards.insert(stage, shard);
                pending.snapshot_s = pending.snapshot_s.max(snapshot_s);
            }
            ToLauncher::ShardFailed { stage, step, error } if step == pending.state.step => {
                pending.failed.insert(stage, error);
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
        if pending.reported().len() < stages {
            return Ok(());
        }
        let pending = self.pending.take().expect("pending checkpoint");
        let step = pending.state.step;
        if let Some((&stage, error)) = pending.failed.iter().next() {
            let error = format!("stage {stage}: {error}");
            self.failed(pending.state, Some(stage), error, metrics);
            return Ok(());
        }
        let shards: Vec<ShardEntry> = pending.shards.into_values().collect();
        let manifest = Manifest::new(
            step,
            shards,
            serde_json::to_value(&pending.state).expect("state serializes"),
        );
        if let Err(e) = self.runtime.block_on(self.store.commit(&manifest)) {
            let error = format!("committing its manifest: {e}");
            self.failed(pending.state, None, error, metrics);
            return Ok(());
        }
        self.last_committed = Some(step);
        self.last_failed = None;
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

/// The error of a final checkpoint of `step` that is still not committed after `attempts`.
fn final_failed(step: u64, attempts: u32, error: String) -> LaunchError {
    LaunchError::FinalCheckpointFailed {
        step,
        attempts,
        error,
    }
}
