//! How a pipeline's workers get their state: fresh (clearing an earlier run's checkpoints at the
//! default location), from initial weights, from peer snapshots, or from a committed checkpoint
//! (falling back to older ones when it is damaged, and retiring newer ones the run rewrites). The
//! choice of checkpoints is [`decide::restore_candidates`]; this is the I/O around it.

use tracing::{info, warn};

use super::super::control::{ToLauncher, ToWorker};
use super::super::error::LaunchError;
use super::super::recovery::{ResumePoint, Start};
use super::{Driver, decide};

impl Driver<'_, '_> {
    /// Loads the workers' state as `start` says; returns the step it belongs to (0 = fresh).
    pub(in crate::runtime) fn load(&mut self, start: &Start) -> Result<u64, LaunchError> {
        match start {
            Start::Fresh => {
                self.clear_previous_run()?;
                Ok(0)
            }
            Start::InitFrom(dir) => {
                self.clear_previous_run()?;
                self.pipeline
                    .broadcast(&ToWorker::InitFrom { dir: dir.clone() })?;
                self.expect_restored(0)?.map_err(|(error, _)| {
                    LaunchError::Run(format!("cannot initialize from {}: {error}", dir.display()))
                })?;
                Ok(0)
            }
            Start::Resume(point) => self.restore(*point),
            Start::Peers { step, sources } => {
                self.pipeline.broadcast(&ToWorker::RestorePeers {
                    step: *step,
                    sources: sources.clone(),
                })?;
                match self.expect_restored(*step)? {
                    Ok(()) => {
                        info!(step, "resumed from peer snapshots");
                        Ok(*step)
                    }
                    Err((error, _)) if self.checkpoints.committed_steps()?.is_empty() => {
                        warn!(step, %error, "peer snapshots unusable and no checkpoint: starting over");
                        Ok(0)
                    }
                    Err((error, _)) => {
                        warn!(step, %error, "peer snapshots unusable: resuming from the newest checkpoint");
                        self.restore(ResumePoint::Latest)
                    }
                }
            }
        }
    }

    /// Waits for every worker's reply to a restore; `Err((error, corrupt))` if any failed.
    fn expect_restored(&mut self, step: u64) -> Result<Result<(), (String, bool)>, LaunchError> {
        let mut failure = None;
        for msg in self.pipeline.collect(
            self.pipeline.workers(),
            &format!("the workers to load checkpoint {step}"),
        )? {
            match msg {
                ToLauncher::Restored { .. } => {}
                ToLauncher::RestoreFailed {
                    stage,
                    error,
                    corrupt,
                    ..
                } => failure = Some((format!("stage {stage}: {error}"), corrupt)),
                other => {
                    return Err(LaunchError::Protocol(format!(
                        "expected a restore reply, got {other:?}"
                    )));
                }
            }
        }
        Ok(failure.map_or(Ok(()), Err))
    }

    /// Loads the chosen committed checkpoint, falling back to older ones when it is damaged (a
    /// corrupt shard, or an unreadable or inconsistent manifest).
    fn restore(&mut self, point: ResumePoint) -> Result<u64, LaunchError> {
        let url = self.checkpoints.store.url().to_string();
        let committed = self.checkpoints.committed_steps()?;
        let candidates =
            decide::restore_candidates(point, &committed, self.cfg.checkpoint.fallback, &url)?;
        let mut last_error = String::new();
        for step in candidates {
            self.pipeline.broadcast(&ToWorker::Restore { step })?;
            match self.expect_restored(step)? {
                Ok(()) => {
                    info!(step, %url, "resumed from checkpoint");
                    self.retire_newer_than(step, &committed)?;
                    return Ok(step);
                }
                Err((error, true)) if self.cfg.checkpoint.fallback => {
                    warn!(step, %error, "checkpoint is corrupt or its manifest unreadable; falling back to the previous committed checkpoint");
                    eprintln!(
                        "warning: checkpoint of step {step} is corrupt or its manifest unreadable ({error}); falling back to the previous committed checkpoint"
                    );
                    last_error = error;
                }
                Err((error, corrupt)) => {
                    let hint = if corrupt {
                        " (checkpoint.fallback = false: not trying older checkpoints)"
                    } else {
                        ""
                    };
                    return Err(LaunchError::Run(format!(
                        "cannot resume from checkpoint {step} at {url}: {error}{hint}"
                    )));
                }
            }
        }
        Err(LaunchError::Run(format!(
            "every committed checkpoint at {url} is unusable; last error: {last_error}"
        )))
    }

    /// A fresh run writes its checkpoints from step 1 on. Committed checkpoints of an earlier run at
    /// the default location (`<run.dir>/checkpoints`) are deleted with a warning, as the rest of the
    /// run directory is replaced; at an explicitly configured `checkpoint.url` they are never deleted
    /// implicitly: the run refuses to start.
    fn clear_previous_run(&mut self) -> Result<(), LaunchError> {
        // A read-only command (eval) reads the store and never changes it.
        if self.cfg.checkpoint.read_only {
            return Ok(());
        }
        let committed = self.checkpoints.committed_steps()?;
        if committed.is_empty() {
            return Ok(());
        }
        let url = self.checkpoints.store.url().to_string();
        if !self.cfg.checkpoint.url.is_empty() {
            return Err(LaunchError::Run(format!(
                "{url} already holds committed checkpoints {committed:?} of another run: continue it with `--resume latest` (or `seqpipe resume {url}`), or set another checkpoint.url"
            )));
        }
        eprintln!(
            "warning: starting a fresh run in {}: deleting its previous checkpoints {committed:?} (use `--resume latest` to continue that run instead)",
            self.cfg.run.dir.display()
        );
        for step in committed {
            self.checkpoints
                .runtime
                .block_on(self.checkpoints.store.delete_step(step))?;
        }
        Ok(())
    }

    /// The run continues from `step`: committed checkpoints of later steps (corrupt ones that were
    /// skipped, or ones the user rewound past) describe a history that is about to be rewritten, and
    /// the rerun will commit those steps again. Each is deleted, manifest first.
    fn retire_newer_than(&mut self, step: u64, committed: &[u64]) -> Result<(), LaunchError> {
        if self.cfg.checkpoint.read_only {
            return Ok(());
        }
        for &newer in committed.iter().filter(|&&s| s > step) {
            warn!(
                newer,
                step,
                "deleting the checkpoint of step {newer}: the run continues from step {step} and will write it again"
            );
            eprintln!(
                "warning: deleting checkpoint of step {newer} (the run continues from step {step} and rewrites it)"
            );
            self.checkpoints
                .runtime
                .block_on(self.checkpoints.store.delete_step(newer))?;
        }
        Ok(())
    }
}
