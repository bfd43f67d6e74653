//! The training loop of one pipeline: loads its state, runs the steps through the [`Pipeline`]
//! (global gradient norm in canonical order, clipping, learning rate), replaces a stage lost in
//! the middle of a step, evaluates, writes `metrics.jsonl`, schedules checkpoints (see
//! [`super::checkpoint_writer`]) and stops at a step boundary on a signal or a plan change.
//! `run` starts the pipelines one after another.

mod decide;
mod mid_step;
mod replies;
mod restore;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use tracing::{info, warn};

use super::checkpoint_writer::{CheckpointWriter, FinalDeadline};
use super::control::{ToLauncher, ToWorker};
use super::coordinator::{AtBoundary, Recovery};
use super::error::LaunchError;
use super::events::{self, Recovered, Resumed, RunEvent};
use super::live_metrics::LiveMetrics;
use super::metrics_log::MetricsLog;
use super::pipeline::Pipeline;
use super::recovery::{self, Start};
use super::trace::{TraceLog, unix_time_s, unix_time_us};
use crate::config::Config;
use crate::lr::learning_rate;
use crate::metrics::StepMetrics;
use crate::model::params::param_specs;
use decide::{BoundaryFacts, PeerCopies, StartAt, Then};

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// Loss of the last step run (NaN when no step ran).
    pub final_loss: f64,
    /// Last validation loss, if evaluation ran.
    pub val_loss: Option<f64>,
    /// The last completed step.
    pub last_step: u64,
    /// The checkpoint step the run resumed from.
    pub resumed_from: Option<u64>,
    /// The signal that stopped the run early (its final checkpoint, of `last_step`, is
    /// committed: a run whose final checkpoint fails ends in
    /// [`LaunchError::FinalCheckpointFailed`] instead).
    pub interrupted_by: Option<i32>,
    /// Why the run stopped early for preemption notices (too few nodes would remain without
    /// the noticed ones): its final checkpoint, of `last_step`, is committed.
    pub preempted: Option<String>,
    /// Wall-clock seconds.
    pub elapsed_s: f64,
}

/// What the step boundary brings (see [`Driver::end_of_step`]).
enum Boundary {
    /// The next step runs.
    Continue,
    /// A signal asked the run to stop (its final checkpoint is started).
    Stop,
    /// Nodes with preemption notices leave and too few would remain: the run stops (its final
    /// checkpoint is started), for this reason.
    Preempted(String),
    /// The plan changes (the nodes that stay hold this step's peer snapshots, or its checkpoint
    /// is committed): the pipeline restarts.
    PlanChange(String),
}

/// How long a plan change waits for the peer snapshots of its step before it commits a checkpoint
/// instead. A stage's copy is its state, sent over TCP right after the update: it normally lands
/// within milliseconds, and one that takes longer is stuck behind a slow or failing agent.
const PEER_SNAPSHOT_WAIT: Duration = Duration::from_secs(2);

/// Held-out micro-batches per evaluation request: a stop signal waits for at most one such chunk
/// (see [`Driver::evaluate_unless_stopped`]).
const EVAL_CHUNK: usize = 16;

/// The run's progress bar (hidden with `quiet`), at `start_step` of `steps`.
fn progress_bar(quiet: bool, steps: u64, start_step: u64) -> ProgressBar {
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(steps)
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} step {pos}/{len} [{bar:30}] {msg} ({elapsed}<{eta})",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_position(start_step);
    bar
}

/// The training loop of one pipeline (see the module docs).
pub(super) struct Driver<'a, 'c> {
    cfg: &'a Config,
    pipeline: &'a mut Pipeline<'c>,
    checkpoints: CheckpointWriter,
    metrics: Option<MetricsLog>,
    signal: Arc<AtomicUsize>,
    /// Set when this pipeline replaces one that lost nodes or changed plan.
    pub(super) recovery: Option<Recovery>,
    /// How the workers' state was loaded, and the step it belongs to.
    loaded: Start,
    loaded_step: u64,
    /// The run's trace, when `--trace` asked for one.
    pub(super) trace: Option<TraceLog>,
    /// The failure that took a replica out of the last step (its share was re-routed): the
    /// pipeline ends at that step's boundary with it, after a checkpoint of the step.
    rerouted: Option<LaunchError>,
    /// The run's Prometheus metrics, when `elastic.metrics_listen` serves them: fed by every
    /// record written to `metrics.jsonl`.
    pub(super) live: Option<Arc<LiveMetrics>>,
    /// When the driver first saw the stop signal: the final checkpoint's grace period
    /// (`checkpoint.grace_s`) counts from here.
    stop_seen: Option<Instant>,
    /// Steps in a row whose peer snapshot was skipped (a copy was in flight).
    peer_copies: PeerCopies,
}

impl<'a, 'c> Driver<'a, 'c> {
    /// A driver of `pipeline`, running `cfg`, stopped early by `signal`.
    pub(super) fn new(
        cfg: &'a Config,
        pipeline: &'a mut Pipeline<'c>,
        checkpoints: CheckpointWriter,
        signal: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            cfg,
            pipeline,
            checkpoints,
            metrics: None,
            signal,
            recovery: None,
            loaded: Start::Fresh,
            loaded_step: 0,
            trace: None,
            rerouted: None,
            live: None,
            stop_seen: None,
            peer_copies: PeerCopies::default(),
        }
    }
}

impl Driver<'_, '_> {
    fn metrics(&mut self) -> &mut MetricsLog {
        self.metrics
            .as_mut()
            .expect("metrics opened before the first step")
    }

    fn append_step(&mut self, record: &StepMetrics) -> Result<(), LaunchError> {
        let log = self.metrics();
        log.append_step(record).map_err(|source| LaunchError::Io {
            what: format!("writing {}", log.path().display()),
            source,
        })
    }

    fn append_event(&mut self, event: &RunEvent) -> Result<(), LaunchError> {
        let log = self.metrics();
        log.append_event(event).map_err(|source| LaunchError::Io {
            what: format!("writing {}", log.path().display()),
            source,
        })
    }

    /// Loads the state as `start` says and trains to `train.steps`; `quiet` hides the progress
    /// bar.
    pub(super) fn run(&mut self, start: &Start, quiet: bool) -> Result<RunSummary, LaunchError> {
        let cfg = self.cfg;
        let t = &cfg.train;
        let start_step = self.load(start)?;
        self.loaded = start.clone();
        self.loaded_step = start_step;
        let resumed_from =
            matches!(start, Start::Resume(_) | Start::Peers { .. }).then_some(start_step);
        match decide::start_at(start_step, t.steps, self.recovery.is_some()) {
            StartAt::Train => {}
            // A node lost while the last step's checkpoint was being written: every step is
            // done, only that checkpoint is left to commit, from the state just restored.
            StartAt::FinishLastCheckpoint => {
                return self.finish_last_checkpoint(start_step, resumed_from);
            }
            StartAt::NothingToTrain(why) => return Err(LaunchError::Run(why)),
        }
        self.open_metrics(start_step, resumed_from)?;
        let canonical: HashMap<String, usize> = param_specs(&cfg.model)
            .into_iter()
            .enumerate()
            .map(|(i, s)| (s.name, i))
            .collect();
        let bar = progress_bar(quiet, t.steps, start_step);
        let mut summary = RunSummary {
            final_loss: f64::NAN,
            val_loss: None,
            last_step: start_step,
            resumed_from,
            interrupted_by: None,
            preempted: None,
            elapsed_s: 0.0,
        };
        for step in start_step + 1..=t.steps {
            let record = self.train_step(step, &canonical)?;
            self.record_recovery(step, start_step, resumed_from.is_some(), &bar)?;
            summary.final_loss = record.loss;
            summary.val_loss = record.val_loss.or(summary.val_loss);
            summary.last_step = step;
            bar.set_message(format!(
                "loss {:.4} | {:.0} tok/s",
                record.loss, record.tokens_per_s
            ));
            bar.inc(1);
            if let Some(v) = record.val_loss {
                bar.suspend(|| info!(step, loss = record.loss, val_loss = v, "evaluation"));
            }
            summary.interrupted_by = self.stop_requested(step, &bar);
            match self.end_of_step(&record, summary.interrupted_by.is_some())? {
                Boundary::Continue => {}
                Boundary::Stop => break,
                Boundary::Preempted(reason) => {
                    bar.suspend(|| warn!(step, %reason, "stopping for preemption notices"));
                    summary.preempted = Some(reason);
                    break;
                }
                Boundary::PlanChange(reason) => {
                    bar.finish_and_clear();
                    return Err(LaunchError::PlanChanged { step, reason });
                }
            }
        }
        // The run's last step is kept only if its checkpoint commits: retried within the signal's
        // grace period, or a few times with a backoff at the normal end.
        // The noticed nodes' workers leave when their preemption grace ends.
        let deadline = decide::final_deadline(
            self.stop_seen,
            summary.interrupted_by.is_some(),
            summary.preempted.is_some(),
            cfg.checkpoint.grace(),
            cfg.elastic.grace(),
            cfg.pipeline.timeout().max(cfg.checkpoint.grace()),
            Instant::now(),
        );
        bar.finish();
        self.checkpoints.commit_final(
            self.pipeline,
            self.metrics.as_mut().expect("metrics"),
            summary.last_step,
            deadline,
        )?;
        Ok(summary)
    }

    /// After a recovery that restored the state of the run's last step (`step`, a loss while its
    /// checkpoint was being written): commits that checkpoint unless it already is, from the
    /// step's record in `metrics.jsonl`, and ends the run.
    fn finish_last_checkpoint(
        &mut self,
        step: u64,
        resumed_from: Option<u64>,
    ) -> Result<RunSummary, LaunchError> {
        self.open_metrics(step, resumed_from)?;
        let path = self.cfg.run.dir.join("metrics.jsonl");
        let records = events::read_records(&path).map_err(|source| LaunchError::Io {
            what: format!("reading {}", path.display()),
            source,
        })?;
        let record = events::steps(&records)
            .find(|r| r.step == step)
            .cloned()
            .ok_or_else(|| {
                LaunchError::Run(format!(
                    "the run lost a node after its last step {step}, and {} has no record of that step to checkpoint it with",
                    path.display()
                ))
            })?;
        self.record_recovery(step, step, resumed_from.is_some(), &ProgressBar::hidden())?;
        // Committed before the loss was handled (e.g. a replica lost in the last step, re-routed,
        // its node re-planned at the boundary after the checkpoint): nothing is left to write.
        // This writer is new and has not seen that commit, so it is not asked to confirm it.
        if !self.checkpoints.committed_steps()?.contains(&step) {
            self.begin_checkpoint(&record)?;
            let timeout = self.cfg.pipeline.timeout().max(self.cfg.checkpoint.grace());
            self.checkpoints.commit_final(
                self.pipeline,
                self.metrics.as_mut().expect("metrics"),
                step,
                FinalDeadline::Attempts(timeout),
            )?;
        }
        Ok(RunSummary {
            final_loss: record.loss,
            val_loss: record.val_loss,
            last_step: step,
            resumed_from,
            interrupted_by: None,
            preempted: None,
            elapsed_s: 0.0,
        })
    }

    /// Rewrites `metrics.jsonl` up to `start_step` and opens it; records the resume and the
    /// events of the recovery this pipeline carries out, if any.
    fn open_metrics(
        &mut self,
        start_step: u64,
        resumed_from: Option<u64>,
    ) -> Result<(), LaunchError> {
        let metrics_path = self.cfg.run.dir.join("metrics.jsonl");
        truncate_metrics(&metrics_path, start_step).map_err(|source| LaunchError::Io {
            what: format!("rewriting {}", metrics_path.display()),
            source,
        })?;
        self.metrics = Some(
            MetricsLog::open(&metrics_path)
                .map_err(|source| LaunchError::Io {
                    what: format!("opening {}", metrics_path.display()),
                    source,
                })?
                .observed_by(self.live.clone()),
        );
        if let Some(live) = &self.live {
            live.plan_running(self.pipeline.coordinator().plan());
        }
        if let Some(step) = resumed_from {
            self.append_event(&RunEvent::Resumed(Resumed {
                step,
                stages: self.cfg.pipeline.stages,
            }))?;
        }
        let recovery_events = self
            .recovery
            .as_mut()
            .map(|r| std::mem::take(&mut r.events))
            .unwrap_or_default();
        for event in &recovery_events {
            self.append_event(event)?;
        }
        Ok(())
    }

    /// After the first step this pipeline completed: the `recovered` event of the recovery it
    /// carried out, if any (its tier from [`recovery::recorded_tier`]).
    fn record_recovery(
        &mut self,
        step: u64,
        start_step: u64,
        resumed: bool,
        bar: &ProgressBar,
    ) -> Result<(), LaunchError> {
        let Some(r) = self.recovery.take() else {
            return Ok(());
        };
        let recovery_s = r.failed_at.elapsed().as_secs_f64();
        let lost_steps = decide::lost_steps(r.failed_step, start_step);
        let tier = recovery::recorded_tier(r.tier, resumed, lost_steps);
        bar.suspend(|| info!(recovery_s, lost_steps, %tier, "recovered"));
        self.append_event(&RunEvent::Recovered(Recovered {
            step,
            recovery_s,
            lost_steps,
            tier,
            stages_before: r.stages_before,
            stages_after: self.cfg.pipeline.stages,
            at_unix_s: unix_time_s(),
            stage: None,
            node: None,
            host: None,
            redone_units: None,
            redone_s: None,
        }))
    }

    /// The signal (SIGINT/SIGTERM) that asks the run to stop after `step`, if one came.
    fn stop_requested(&mut self, step: u64, bar: &ProgressBar) -> Option<i32> {
        let sig = self.signal.load(Ordering::SeqCst);
        (sig != 0).then(|| {
            self.stop_seen.get_or_insert_with(Instant::now);
            bar.suspend(|| {
                warn!(
                    step,
                    signal = sig,
                    "stopping on signal: writing a final checkpoint"
                )
            });
            sig as i32
        })
    }

    /// The step boundary after `record.step`: nodes with a preemption notice leave, and joiners
    /// are admitted, here (unless the run ends here); a checkpoint is started when one is due,
    /// when the run stops, or before a plan change (which waits for its commit).
    fn end_of_step(
        &mut self,
        record: &StepMetrics,
        interrupted: bool,
    ) -> Result<Boundary, LaunchError> {
        let (cfg, step) = (self.cfg, record.step);
        if let Some(failure) = self.rerouted.take() {
            // A replica was lost during this step: its state is in the other replicas only. It is
            // committed here, and the pipeline is rebuilt on the survivors from it.
            self.begin_checkpoint(record)?;
            let metrics = self.metrics.as_mut().expect("metrics");
            self.checkpoints
                .finish(self.pipeline, metrics, cfg.elastic.grace())?;
            return Err(failure);
        }
        let at_boundary = if decide::boundary_open(step, cfg.train.steps, interrupted) {
            self.pipeline.coordinator().at_step_boundary(step)
        } else {
            None
        };
        let (plan_change, stop) = match at_boundary {
            None => (None, None),
            Some(AtBoundary::Change { reason, planned }) => (Some((reason, planned)), None),
            Some(AtBoundary::Stop { reason, left }) => (None, Some((reason, left))),
        };
        let mut facts = BoundaryFacts {
            interrupted,
            preempted: stop.is_some(),
            plan_change: plan_change.as_ref().map(|(_, planned)| *planned),
            due: cfg.checkpoint.due(step, cfg.train.steps),
            peers_hold: false,
        };
        // The next plan starts from the peer snapshots of this step when the nodes that stay hold
        // them: a handover then needs no checkpoint (whose upload would stall the run).
        if decide::wait_for_peer_snapshots(facts.plan_change, facts.due) {
            facts.peers_hold = self
                .pipeline
                .await_peer_snapshots(step, PEER_SNAPSHOT_WAIT)?;
        }
        let end = decide::step_end(facts);
        if end.checkpoint {
            self.begin_checkpoint(record)?;
        }
        self.checkpoints
            .poll(self.pipeline, self.metrics.as_mut().expect("metrics"))?;
        match (end.then, stop, plan_change) {
            (Then::Continue, ..) => Ok(Boundary::Continue),
            (Then::Stop, ..) => Ok(Boundary::Stop),
            (Then::Preempted, Some((reason, left)), _) => {
                for event in &left {
                    self.append_event(event)?;
                }
                Ok(Boundary::Preempted(reason))
            }
            (Then::ChangePlan, _, Some((reason, _))) => {
                self.checkpoints.finish(
                    self.pipeline,
                    self.metrics.as_mut().expect("metrics"),
                    cfg.elastic.grace(),
                )?;
                Ok(Boundary::PlanChange(reason))
            }
            (then, ..) => unreachable!("step_end chose {then:?} from facts it was not given"),
        }
    }

    /// One training step: forward and backward on every stage (replacing a stage lost in the
    /// middle, when `elastic.mid_step`), the global gradient norm and clipping, the optimizer
    /// update, evaluation when due; the step's record is appended to `metrics.jsonl`.
    fn train_step(
        &mut self,
        step: u64,
        canonical: &HashMap<String, usize>,
    ) -> Result<StepMetrics, LaunchError> {
        let (cfg, t) = (self.cfg, &self.cfg.train);
        let tokens = cfg.tokens_per_step();
        let step_started = Instant::now();
        let step_started_us = unix_time_us();
        let lr = learning_rate(
            step,
            cfg.lr_schedule_steps(),
            t.lr,
            t.min_lr,
            t.warmup_steps,
        );
        self.pipeline.broadcast(&ToWorker::RunStep {
            step,
            trace: self.trace.is_some(),
        })?;
        let mut replies = self.forward_backward(step, canonical)?;
        self.pipeline.step_units_done();
        self.record_replacements(step, &replies.replaced, step_started)?;
        let rerouted = replies.rerouted.take();
        let loss_sum = replies.loss_sum(cfg.pipeline.microbatches);
        // At most one peer copy in flight per worker: while one is, no stage copies this step
        // (skipped, not queued), so that copies never hold up training — up to
        // `elastic.peer_snapshot_max_skips` steps in a row; then the workers wait for it.
        let copy = self.peer_copies.decide(
            cfg.elastic.peer_snapshots,
            replies.peer_copy_in_flight,
            cfg.elastic.peer_snapshot_max_skips,
        );
        let grad_norm = self.update(step, lr, replies.take_sums()?, copy)?;
        let loss = loss_sum
            .ok_or_else(|| LaunchError::Protocol("the last stage reported no loss".into()))?
            / tokens as f64;
        let step_time_s = step_started.elapsed().as_secs_f64();
        let eval_due = decide::eval_due(step, t.eval_every, t.steps);
        let eval_started_us = unix_time_us();
        let val_loss = if eval_due {
            self.evaluate_unless_stopped(true)?
        } else {
            None
        };
        if let Some(trace) = &mut self.trace {
            let per_s = tokens as f64 / step_time_s;
            let args = json!({"loss": loss, "grad_norm": grad_norm, "tokens_per_s": per_s});
            let (name, step_us) = (format!("step {step}"), (step_time_s * 1e6) as u64);
            trace.coordinator(&name, step, step_started_us, step_us, args);
            if let Some(v) = val_loss {
                let eval_us = unix_time_us().saturating_sub(eval_started_us);
                let args = json!({"val_loss": v});
                trace.coordinator("eval", step, eval_started_us, eval_us, args);
            }
        }
        let record = StepMetrics {
            step,
            retained_bytes: replies.retained_bytes,
            reduce_bytes: replies.reduce_bytes,
            reduce_s: replies.reduce_s,
            gradient_buffers: replies.gradient_buffers,
            peak_activation_bytes: replies.peak_activation_bytes,
            state_bytes: replies.state_bytes,
            units: replies.units,
            compute_s: replies.compute_s,
            compute_cpu_s: replies.compute_cpu_s,
            page_faults: replies.page_faults,
            cpu_user_s: replies.cpu_user_s,
            cpu_system_s: replies.cpu_system_s,
            peer_snapshot_step: cfg
                .elastic
                .peer_snapshots
                .then(|| self.pipeline.coordinator().peer_snapshot_step(step))
                .flatten(),
            peer_snapshots_skipped: u64::from(cfg.elastic.peer_snapshots && !copy),
            end_unix_s: unix_time_s(),
            loss,
            lr,
            grad_norm,
            tokens,
            step_time_s,
            tokens_per_s: tokens as f64 / step_time_s,
            val_loss,
        };
        self.append_step(&record)?;
        if let Some(lost) = rerouted {
            self.record_reroute(step, lost, replies.redone, step_started)?;
        }
        Ok(record)
    }

    /// Data parallelism: the `recovered` event of `step`, whose lost replica's share (`lost`:
    /// the replica and the failure that took it out) was re-routed, costing `redone` (units
    /// computed again, their seconds); the failure is kept for the step boundary.
    fn record_reroute(
        &mut self,
        step: u64,
        (replica, failure): (usize, LaunchError),
        redone: (usize, f64),
        step_started: Instant,
    ) -> Result<(), LaunchError> {
        let p = self.pipeline.stages();
        let node = self.pipeline.coordinator().node_of(replica * p);
        self.append_event(&RunEvent::Recovered(Recovered {
            step,
            recovery_s: step_started.elapsed().as_secs_f64(),
            lost_steps: 0,
            tier: recovery::Tier::Reroute,
            stages_before: p,
            stages_after: p,
            at_unix_s: unix_time_s(),
            stage: None,
            node: Some(node),
            host: None,
            redone_units: Some(redone.0),
            redone_s: Some(redone.1),
        }))?;
        self.rerouted = Some(failure);
        Ok(())
    }

    /// The optimizer update of `step`: the global gradient norm from the stages' sums of squares
    /// (summed in canonical parameter order: the same number whatever the partition), clipping,
    /// and AdamW with learning rate `lr` on every stage, then (with `copy`) a peer snapshot of the
    /// new state. Returns the norm.
    fn update(
        &mut self,
        step: u64,
        lr: f64,
        sums: Vec<f64>,
        copy: bool,
    ) -> Result<f64, LaunchError> {
        let grad_norm = ops::clip::global_norm(sums);
        let clip_coefficient = ops::clip::clip_coefficient(grad_norm, self.cfg.train.grad_clip);
        // One replica per stage copies its state to the peer-snapshot agents (they all hold the
        // same).
        let (p, writer) = (self.pipeline.stages(), self.pipeline.writer_replica());
        let active = self.pipeline.active_slots();
        for &slot in &active {
            self.pipeline.send(
                slot,
                &ToWorker::Apply {
                    step,
                    lr,
                    clip_coefficient,
                    snapshot: copy && slot / p == writer,
                },
            )?;
        }
        let replies = self
            .pipeline
            .collect(active.len(), &format!("step {step}'s optimizer update"))?;
        let mut updated = BTreeSet::new();
        for reply in replies {
            match reply {
                ToLauncher::Updated { stage, step: s } if s == step && updated.insert(stage) => {}
                other => {
                    return Err(LaunchError::Protocol(format!(
                        "expected each worker's update of step {step} once, got {other:?}"
                    )));
                }
            }
        }
        Ok(grad_norm)
    }

    /// Validation loss over `train.eval_batches` held-out micro-batches, forward only.
    pub(super) fn evaluate(&mut self) -> Result<f64, LaunchError> {
        self.evaluate_unless_stopped(false)
            .map(|loss| loss.expect("an evaluation that cannot be stopped ends"))
    }

    /// [`Driver::evaluate`] in chunks of [`EVAL_CHUNK`] micro-batches (their loss sums added in
    /// order: the same number on every run); with `stoppable`, a stop signal abandons it between
    /// two chunks (`None`): an evaluation is not part of the training state, and the signal's
    /// grace period (`checkpoint.grace_s`) is for the final checkpoint.
    fn evaluate_unless_stopped(&mut self, stoppable: bool) -> Result<Option<f64>, LaunchError> {
        let cfg = self.cfg;
        let batches = cfg.train.eval_batches;
        let mut loss_sum = 0.0;
        for (first, chunk) in decide::eval_chunks(batches, EVAL_CHUNK) {
            if stoppable && self.signal.load(Ordering::SeqCst) != 0 {
                self.stop_seen.get_or_insert_with(Instant::now);
                warn!(
                    done = first,
                    batches, "stop signal: abandoning the evaluation for the final checkpoint"
                );
                return Ok(None);
            }
            // Replica 0 evaluates: every replica holds the same weights.
            self.pipeline.send_to_first_replica(&ToWorker::Eval {
                first,
                batches: chunk,
            })?;
            let mut chunk_sum = None;
            for msg in self.pipeline.collect(cfg.pipeline.stages, "evaluation")? {
                match msg {
                    ToLauncher::EvalDone { loss_sum: l, .. } => chunk_sum = chunk_sum.or(l),
                    other => {
                        return Err(LaunchError::Protocol(format!(
                            "expected evaluation results, got {other:?}"
                        )));
                    }
                }
            }
            loss_sum += chunk_sum.ok_or_else(|| {
                LaunchError::Protocol("the last stage reported no validation loss".into())
            })?;
        }
        let tokens = batches * cfg.train.micro_batch_size * cfg.train.seq_len;
        Ok(Some(loss_sum / tokens as f64))
    }

    /// Starts the checkpoint of the step that `record` describes (its learning rate and loss go
    /// into the trainer state).
    fn begin_checkpoint(&mut self, record: &StepMetrics) -> Result<(), LaunchError> {
        let state = decide::trainer_state(self.cfg, record.step, record.lr, record.loss);
        self.checkpoints.begin(
            self.pipeline,
            state,
            self.metrics.as_mut().expect("metrics"),
        )
    }
}

/// Keeps the lines of `metrics.jsonl` up to `step` (a resumed run rewrites what came after).
fn truncate_metrics(path: &Path, step: u64) -> std::io::Result<()> {
    if step == 0 {
        return match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
    }
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    std::fs::write(path, decide::kept_metrics(&text, step))
}
