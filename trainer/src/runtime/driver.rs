//! The training loop of one pipeline: loads its state, runs the steps through the [`Pipeline`]
//! (global gradient norm in canonical order, clipping, learning rate), replaces a stage lost in
//! the middle of a step, evaluates, writes `metrics.jsonl`, schedules checkpoints (see
//! [`super::checkpoint_writer`]) and stops at a step boundary on a signal or a plan change.
//! `run` starts the pipelines one after another.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use ops::sum_tree::SumTree;
use serde_json::json;
use tracing::{info, warn};

use super::checkpoint_writer::{CheckpointWriter, FinalDeadline};
use super::control::{Regroup, StepCost, ToLauncher, ToWorker};
use super::coordinator::{AtBoundary, Recovery};
use super::error::LaunchError;
use super::events::{self, NodeLost, Recovered, Resumed, RunEvent};
use super::live_metrics::LiveMetrics;
use super::metrics_log::MetricsLog;
use super::pipeline::{Pipeline, Replacement};
use super::recovery::{self, Loaded, ResumePoint, Start};
use super::trace::{TraceLog, unix_time_s, unix_time_us};
use crate::checkpointing::shard::with_moments;
use crate::checkpointing::state::{DataCursor, LrPosition, Topology, TrainerState, WRITER};
use crate::config::Config;
use crate::lr::learning_rate;
use crate::metrics::StepMetrics;
use crate::model::params::param_specs;
use crate::model::partition_layers;

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

/// Whether a step's peer snapshot is taken: always when no worker's previous copy is in flight;
/// otherwise skipped, unless `skipped_in_a_row` already reached `max_skips` (the workers then wait
/// for the copy in flight).
fn peer_copy_due(in_flight: bool, skipped_in_a_row: u64, max_skips: u64) -> bool {
    !in_flight || skipped_in_a_row >= max_skips
}

/// What the stages reported for one step's forward and backward.
struct StepReplies {
    /// Per-parameter sums of squared gradients, in canonical order.
    sums: Vec<Option<f64>>,
    /// Per replica: its last stage's sum of token losses.
    loss_sums: Vec<Option<f64>>,
    retained_bytes: u64,
    reduce_bytes: u64,
    reduce_s: f64,
    /// The most full-gradient buffers any worker held at once.
    gradient_buffers: usize,
    units: usize,
    compute_s: f64,
    compute_cpu_s: f64,
    /// What the worker processes used since their previous reports, summed.
    page_faults: u64,
    cpu_user_s: f64,
    cpu_system_s: f64,
    /// Per stage.
    peak_activation_bytes: Vec<u64>,
    /// Per stage.
    state_bytes: Vec<u64>,
    /// Some worker's previous peer snapshot was still in flight when it reported the step.
    peer_copy_in_flight: bool,
    /// Stages replaced in the middle of the step, with the replacement's cost once it reported.
    replaced: Vec<(Replacement, Option<StepCost>)>,
    /// Data parallelism: the replica lost in the middle of the step, whose share was re-routed,
    /// and the failure that took it out.
    rerouted: Option<(usize, LaunchError)>,
    /// Units computed again because of the re-routing, and their seconds.
    redone: (usize, f64),
}

impl StepReplies {
    fn new(stages: usize, replicas: usize, params: usize) -> Self {
        Self {
            sums: vec![None; params],
            loss_sums: vec![None; replicas],
            retained_bytes: 0,
            reduce_bytes: 0,
            reduce_s: 0.0,
            gradient_buffers: 0,
            units: 0,
            compute_s: 0.0,
            compute_cpu_s: 0.0,
            page_faults: 0,
            cpu_user_s: 0.0,
            cpu_system_s: 0.0,
            peak_activation_bytes: vec![0; stages],
            state_bytes: vec![0; stages],
            peer_copy_in_flight: false,
            replaced: Vec::new(),
            rerouted: None,
            redone: (0, 0.0),
        }
    }

    /// Adds the `StepDone` of worker `slot` (stage `slot % stages` of replica `slot / stages`).
    /// The replicas of a stage hold the same reduced gradients: their sums of squares must agree
    /// bit for bit.
    fn add(
        &mut self,
        slot: usize,
        sums_of_squares: Vec<(String, f64)>,
        loss_sum: Option<f64>,
        cost: StepCost,
        canonical: &HashMap<String, usize>,
    ) -> Result<(), LaunchError> {
        let stages = self.peak_activation_bytes.len();
        let (replica, stage) = (slot / stages, slot % stages);
        for (name, value) in sums_of_squares {
            let index = *canonical
                .get(&name)
                .ok_or_else(|| LaunchError::Protocol(format!("unknown parameter {name}")))?;
            match self.sums[index] {
                Some(seen) if seen.to_bits() != value.to_bits() => {
                    return Err(LaunchError::Protocol(format!(
                        "the replicas of stage {stage} disagree on the gradient of {name} \
                         (sum of squares {seen} vs {value} from replica {replica}): the \
                         reduction is not deterministic"
                    )));
                }
                _ => self.sums[index] = Some(value),
            }
        }
        if let Some(l) = loss_sum {
            self.loss_sums[replica] = Some(l);
        }
        self.retained_bytes += cost.retained_bytes;
        self.reduce_bytes += cost.reduce_bytes;
        self.reduce_s = self.reduce_s.max(cost.reduce_s);
        self.gradient_buffers = self.gradient_buffers.max(cost.gradient_buffers);
        self.units += cost.units;
        self.compute_s += cost.compute_s;
        self.compute_cpu_s += cost.compute_cpu_s;
        self.page_faults += cost.page_faults;
        self.cpu_user_s += cost.cpu_user_s;
        self.cpu_system_s += cost.cpu_system_s;
        self.peer_copy_in_flight |= cost.peer_copy_in_flight;
        self.redone.0 += cost.redone_units;
        self.redone.1 += cost.redone_s;
        if let Some(peak) = self.peak_activation_bytes.get_mut(stage) {
            *peak = (*peak).max(cost.peak_activation_bytes);
            self.state_bytes[stage] = cost.state_bytes;
        }
        if let Some((_, redone)) = self.replaced.iter_mut().find(|(r, _)| r.stage == slot) {
            *redone = Some(cost);
        }
        Ok(())
    }

    /// The sum of the step's token losses: the replicas' sums added in the summation tree's
    /// order over the step's micro-batches, the same number whatever the replica count and the
    /// order the replicas reported in; `None` until every replica's last stage reported.
    fn loss_sum(&self, micro_batches: usize) -> Option<f64> {
        let d = self.loss_sums.len();
        let c = micro_batches / d;
        let mut tree = SumTree::new(micro_batches);
        let mut add = |a: f64, b: f64| Ok::<f64, std::convert::Infallible>(a + b);
        for (r, l) in self.loss_sums.iter().enumerate() {
            tree.push(r * c, (r + 1) * c, (*l)?, &mut add).ok()?;
        }
        tree.finish::<std::convert::Infallible>().ok()
    }
}

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
    peer_copies_skipped: u64,
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
            peer_copies_skipped: 0,
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

    /// Loads the workers' state as `start` says; returns the step it belongs to (0 = fresh).
    pub(super) fn load(&mut self, start: &Start) -> Result<u64, LaunchError> {
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
        if start_step >= t.steps {
            // A node lost while the last step's checkpoint was being written: every step is
            // done, only that checkpoint is left to commit, from the state just restored.
            if self.recovery.is_some() && start_step == t.steps {
                return self.finish_last_checkpoint(start_step, resumed_from);
            }
            return Err(LaunchError::Run(format!(
                "the checkpoint is at step {start_step} and train.steps is {}: nothing to train; raise it, e.g. --set train.steps={}",
                t.steps,
                start_step + t.steps.max(1)
            )));
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
        let deadline = match self.stop_seen {
            Some(seen) if summary.interrupted_by.is_some() => {
                FinalDeadline::Until(seen + cfg.checkpoint.grace())
            }
            // The noticed nodes' workers leave when their preemption grace ends.
            _ if summary.preempted.is_some() => {
                FinalDeadline::Until(Instant::now() + cfg.elastic.grace())
            }
            _ => FinalDeadline::Attempts(cfg.pipeline.timeout().max(cfg.checkpoint.grace())),
        };
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
        if !self.checkpoints.committed_steps()?.contains(&step) {
            let state = self.trainer_state(step, record.lr, record.loss);
            self.checkpoints.begin(
                self.pipeline,
                state,
                self.metrics.as_mut().expect("metrics"),
            )?;
        }
        let timeout = self.cfg.pipeline.timeout().max(self.cfg.checkpoint.grace());
        self.checkpoints.commit_final(
            self.pipeline,
            self.metrics.as_mut().expect("metrics"),
            step,
            FinalDeadline::Attempts(timeout),
        )?;
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
        let lost_steps = r.failed_step.saturating_sub(1).saturating_sub(start_step);
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
            let state = self.trainer_state(step, record.lr, record.loss);
            let metrics = self.metrics.as_mut().expect("metrics");
            self.checkpoints.begin(self.pipeline, state, metrics)?;
            self.checkpoints
                .finish(self.pipeline, metrics, cfg.elastic.grace())?;
            return Err(failure);
        }
        let at_boundary = if step < cfg.train.steps && !interrupted {
            self.pipeline.coordinator().at_step_boundary(step)
        } else {
            None
        };
        let (plan_change, stop) = match at_boundary {
            None => (None, None),
            Some(AtBoundary::Change { reason, planned }) => (Some((reason, planned)), None),
            Some(AtBoundary::Stop { reason, left }) => (None, Some((reason, left))),
        };
        let due = cfg.checkpoint.due(step, cfg.train.steps);
        // The next plan starts from the peer snapshots of this step when the nodes that stay hold
        // them: a handover then needs no checkpoint (whose upload would stall the run). A run
        // that must wait for nodes, or stops, keeps the step in a committed checkpoint.
        let by_peers = plan_change.as_ref().is_some_and(|(_, planned)| *planned)
            && !due
            && self
                .pipeline
                .await_peer_snapshots(step, PEER_SNAPSHOT_WAIT)?;
        if interrupted || stop.is_some() || due || (plan_change.is_some() && !by_peers) {
            let state = self.trainer_state(step, record.lr, record.loss);
            self.checkpoints.begin(
                self.pipeline,
                state,
                self.metrics.as_mut().expect("metrics"),
            )?;
        }
        self.checkpoints
            .poll(self.pipeline, self.metrics.as_mut().expect("metrics"))?;
        if interrupted {
            return Ok(Boundary::Stop);
        }
        if let Some((reason, left)) = stop {
            for event in &left {
                self.append_event(event)?;
            }
            return Ok(Boundary::Preempted(reason));
        }
        let Some((reason, _)) = plan_change else {
            return Ok(Boundary::Continue);
        };
        self.checkpoints.finish(
            self.pipeline,
            self.metrics.as_mut().expect("metrics"),
            cfg.elastic.grace(),
        )?;
        Ok(Boundary::PlanChange(reason))
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
        self.record_replacements(step, &replies.replaced, step_started)?;
        let rerouted = replies.rerouted.take();
        let loss_sum = replies.loss_sum(cfg.pipeline.microbatches);
        // At most one peer copy in flight per worker: while one is, no stage copies this step
        // (skipped, not queued), so that copies never hold up training — up to
        // `elastic.peer_snapshot_max_skips` steps in a row; then the workers wait for it.
        let copy = cfg.elastic.peer_snapshots
            && peer_copy_due(
                replies.peer_copy_in_flight,
                self.peer_copies_skipped,
                cfg.elastic.peer_snapshot_max_skips,
            );
        self.peer_copies_skipped = if copy || !cfg.elastic.peer_snapshots {
            0
        } else {
            self.peer_copies_skipped + 1
        };
        let grad_norm = self.update(step, lr, std::mem::take(&mut replies.sums), copy)?;
        let loss = loss_sum
            .ok_or_else(|| LaunchError::Protocol("the last stage reported no loss".into()))?
            / tokens as f64;
        let step_time_s = step_started.elapsed().as_secs_f64();
        let eval_due = t.eval_every > 0 && (step.is_multiple_of(t.eval_every) || step == t.steps);
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
        if let Some((replica, failure)) = rerouted {
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
                redone_units: Some(replies.redone.0),
                redone_s: Some(replies.redone.1),
            }))?;
            self.rerouted = Some(failure);
        }
        Ok(record)
    }

    /// Waits for every stage's `StepDone` of `step`, replacing a stage lost in the middle of the
    /// step (with `elastic.mid_step`); gathers the per-parameter sums of squares (in canonical
    /// order), the loss and the stages' costs.
    fn forward_backward(
        &mut self,
        step: u64,
        canonical: &HashMap<String, usize>,
    ) -> Result<StepReplies, LaunchError> {
        let (p, d) = (self.pipeline.stages(), self.pipeline.replicas());
        if d > 1 {
            return self.forward_backward_replicas(step, canonical);
        }
        let mut replies = StepReplies::new(p, d, canonical.len());
        let mut finished = BTreeSet::new();
        while finished.len() < p * d {
            let msg = match self
                .pipeline
                .next_reply(&format!("step {step}'s forward and backward"))
            {
                Ok(msg) => msg,
                Err(e) if self.cfg.elastic.mid_step => {
                    let replaced = self.replace_lost_stage(step, e, &finished, unix_time_s())?;
                    replies.replaced.push(replaced);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let msg = match self.take_step_done(step, msg, &mut replies, canonical)? {
                Ok(slot) => {
                    finished.insert(slot);
                    continue;
                }
                Err(msg) => msg,
            };
            match msg {
                ToLauncher::LinkDown {
                    stage,
                    peer,
                    done_units,
                    ..
                } => {
                    info!(
                        step,
                        stage, peer, done_units, "a stage lost its link to a neighbour mid-step"
                    );
                }
                other => {
                    return Err(LaunchError::Protocol(format!(
                        "expected step {step} done, got {other:?}"
                    )));
                }
            }
        }
        Ok(replies)
    }

    /// Data parallelism: waits for every worker's `StepDone` of the current reduction round.
    /// Each worker reduces its stage's gradients with the other replicas' as soon as its own
    /// share of the step is through the backward (no barrier: the later stages' reductions
    /// overlap the earlier stages' backward). A failure that takes out workers of one replica
    /// only — before or during the reduction — re-routes that replica's share to a surviving
    /// replica ([`recovery::lost_replica`], [`recovery::adopter`]) and has every survivor reduce
    /// again without it (the next round, whatever the first round's outcome on each stage): the
    /// step completes with the same result, bit for bit, and the pipeline is rebuilt at its
    /// boundary.
    fn forward_backward_replicas(
        &mut self,
        step: u64,
        canonical: &HashMap<String, usize>,
    ) -> Result<StepReplies, LaunchError> {
        let (p, d) = (self.pipeline.stages(), self.pipeline.replicas());
        let mut replies = StepReplies::new(p, d, canonical.len());
        let mut round = 0;
        let mut finished = BTreeSet::new();
        // Workers whose reduction of the current round failed: they wait for another round.
        let mut failed: BTreeMap<usize, String> = BTreeMap::new();
        let mut lost: Option<(usize, LaunchError)> = None;
        let what = format!("step {step}'s forward, backward and gradient reduction");
        loop {
            let active = self.pipeline.active_slots();
            if active
                .iter()
                .all(|w| finished.contains(w) || failed.contains_key(w))
            {
                let Some(error) = failed.values().next().cloned() else {
                    break;
                };
                return Err(LaunchError::ReductionFailed {
                    step,
                    slots: failed.into_keys().collect(),
                    error,
                });
            }
            match self.pipeline.next_reply(&what) {
                Ok(ToLauncher::ReduceFailed {
                    stage,
                    step: s,
                    round: r,
                    error,
                    ..
                }) if s == step => {
                    // One of an earlier round is moot: that worker has been told to reduce again.
                    if r == round {
                        failed.insert(stage, error);
                    }
                }
                Ok(ToLauncher::StepDone {
                    step: s, round: r, ..
                }) if s == step && r != round => {}
                Ok(msg) => match self.take_step_done(step, msg, &mut replies, canonical)? {
                    Ok(slot) => {
                        finished.insert(slot);
                    }
                    Err(other) => {
                        return Err(LaunchError::Protocol(format!(
                            "expected step {step} done, got {other:?}"
                        )));
                    }
                },
                Err(e) if lost.is_none() && self.cfg.elastic.mid_step => {
                    let Some(replica) = self.reroute(step, &e)? else {
                        return Err(e);
                    };
                    round += 1;
                    self.send_reductions(step, round, replica)?;
                    replies = StepReplies::new(p, d, canonical.len());
                    finished.clear();
                    failed.clear();
                    lost = Some((replica, e));
                }
                Err(e) => return Err(e),
            }
        }
        replies.rerouted = lost;
        Ok(replies)
    }

    /// Adds `msg` to `replies` if it is a worker's `StepDone` of `step` (its slot), noting a
    /// leaving node, the trace's units and reduction, and adopted shares' losses; any other
    /// message is handed back.
    fn take_step_done(
        &mut self,
        step: u64,
        msg: ToLauncher,
        replies: &mut StepReplies,
        canonical: &HashMap<String, usize>,
    ) -> Result<Result<usize, ToLauncher>, LaunchError> {
        if !matches!(&msg, ToLauncher::StepDone { step: s, .. } if *s == step) {
            return Ok(Err(msg));
        }
        let ToLauncher::StepDone {
            stage,
            sums_of_squares,
            loss_sum,
            leaving,
            adopted_losses,
            cost,
            ..
        } = msg
        else {
            unreachable!("checked above");
        };
        if leaving {
            self.pipeline.coordinator().node_leaving(stage);
        }
        if let Some(trace) = &mut self.trace {
            trace.units(stage, step, &cost.unit_times);
            if cost.reduce_start_us > 0 {
                trace.reduction(
                    stage,
                    step,
                    cost.reduce_start_us,
                    (cost.reduce_s * 1e6) as u64,
                    cost.reduce_bytes,
                );
            }
        }
        replies.add(stage, sums_of_squares, loss_sum, cost, canonical)?;
        for (replica, l) in adopted_losses {
            if let Some(slot) = replies.loss_sums.get_mut(replica) {
                *slot = Some(l);
            }
        }
        Ok(Ok(stage))
    }

    /// Data parallelism: after `failure` in `step`, whether it took out workers of one replica
    /// only ([`Pipeline::lost_replica`]); if so, retires that replica (its share is re-routed to
    /// [`recovery::adopter`]) and returns it. `None`: the step cannot go on (the reason is logged).
    fn reroute(&mut self, step: u64, failure: &LaunchError) -> Result<Option<usize>, LaunchError> {
        let d = self.pipeline.replicas();
        let replica = match self.pipeline.lost_replica(failure) {
            Ok(r) => r,
            Err(why) => {
                warn!(step, %why, "no re-routing: the step is redone");
                return Ok(None);
            }
        };
        let adopter = recovery::adopter(replica, d);
        warn!(step, replica, adopter, error = %failure, "a replica was lost mid-step; its micro-batches are re-routed");
        eprintln!(
            "warning: lost replica {replica} during step {step} ({failure}); replica {adopter} \
             computes its micro-batches"
        );
        self.pipeline.coordinator().failure_in_completed_step(step);
        let writer = self.pipeline.writer_replica();
        self.pipeline.retire_replica(replica);
        if writer == replica {
            self.abandon_checkpoint_of_lost_writer(replica)?;
        }
        Ok(Some(replica))
    }

    /// The lost `replica` was writing the checkpoint in flight: the shards it had not uploaded
    /// will never come, so the checkpoint is given up (the previous committed one stays valid).
    fn abandon_checkpoint_of_lost_writer(&mut self, replica: usize) -> Result<(), LaunchError> {
        let metrics = self.metrics.as_mut().expect("metrics");
        self.checkpoints.poll(self.pipeline, metrics)?;
        if (0..self.pipeline.stages()).any(|s| self.checkpoints.missing_shard(s).is_some()) {
            let why = format!("replica {replica}, which was writing it, was lost");
            self.checkpoints.abandon(metrics, &why);
        }
        Ok(())
    }

    /// Data parallelism: after replica `lost` was retired in `step`, tells every surviving worker
    /// to reduce its stage's gradients again as round `round`, in a group of the survivors (a new
    /// link generation), the adopter computing the lost share first.
    fn send_reductions(&mut self, step: u64, round: u32, lost: usize) -> Result<(), LaunchError> {
        let (p, d) = (self.pipeline.stages(), self.pipeline.replicas());
        let generation = self.pipeline.next_link_generation();
        for s in 0..p {
            let members = self.pipeline.regroup(s);
            let addrs: Vec<String> = members.iter().map(|(_, a)| a.clone()).collect();
            for (member, (slot, _)) in members.iter().enumerate() {
                let adopts = recovery::adopter(lost, d) == slot / p;
                let adopt = if adopts { vec![lost] } else { Vec::new() };
                let regroup = Some(Regroup {
                    generation,
                    member,
                    addrs: addrs.clone(),
                });
                self.pipeline.send(
                    *slot,
                    &ToWorker::Reduce {
                        step,
                        round,
                        adopt,
                        regroup,
                    },
                )?;
            }
        }
        Ok(())
    }

    /// A `recovered` event for every stage replaced in the middle of `step`.
    fn record_replacements(
        &mut self,
        step: u64,
        replaced: &[(Replacement, Option<StepCost>)],
        step_started: Instant,
    ) -> Result<(), LaunchError> {
        let p = self.pipeline.stages();
        for (r, cost) in replaced {
            let cost = cost.clone().unwrap_or_default();
            self.append_event(&RunEvent::Recovered(Recovered {
                step,
                recovery_s: step_started.elapsed().as_secs_f64(),
                lost_steps: 0,
                tier: recovery::Tier::MidStep,
                stages_before: p,
                stages_after: p,
                at_unix_s: unix_time_s(),
                stage: Some(r.stage),
                node: Some(r.lost.node.clone()),
                host: Some(r.host.clone()),
                redone_units: Some(cost.redone_units),
                redone_s: Some(cost.redone_s),
            }))?;
        }
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
        sums: Vec<Option<f64>>,
        copy: bool,
    ) -> Result<f64, LaunchError> {
        let sums: Vec<f64> = sums
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                s.ok_or_else(|| {
                    LaunchError::Protocol(format!("no gradient norm for parameter #{i}"))
                })
            })
            .collect::<Result<_, _>>()?;
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

    /// Mid-step recovery of one lost stage during step `step`, whose loss was seen at
    /// `detected_at_unix_s` (see [`Pipeline::replace_stage`]).
    /// Fails with `failure` when it cannot help; the run then recovers from snapshots.
    fn replace_lost_stage(
        &mut self,
        step: u64,
        failure: LaunchError,
        finished: &BTreeSet<usize>,
        detected_at_unix_s: f64,
    ) -> Result<(Replacement, Option<StepCost>), LaunchError> {
        let (stage, lost) = match self.pipeline.lost_stage(&failure, finished) {
            Ok(found) => found,
            Err(why) => {
                info!(step, %why, "no mid-step recovery: the pipeline restarts");
                return Err(failure);
            }
        };
        let Some(restore) = self.step_start_state(step, stage) else {
            warn!(
                step,
                stage, "no step-start state for the lost stage: recovering from snapshots"
            );
            return Err(failure);
        };
        self.append_event(&RunEvent::NodeLost(NodeLost {
            node: lost.node.clone(),
            failed_step: step,
            reason: lost.reason.clone(),
            detected_at_unix_s,
            agent_alive: lost.agent_alive,
            stage: Some(stage),
            mid_step: Some(true),
        }))?;
        eprintln!(
            "warning: lost stage {stage} (node {}) during step {step}: replacing it mid-step",
            lost.node
        );
        // The lost worker's shard of the checkpoint in flight, if it is of step − 1, is the
        // replacement's to upload, from the same restored state.
        self.checkpoints
            .poll(self.pipeline, self.metrics.as_mut().expect("metrics"))?;
        let mut checkpoint = self.checkpoints.missing_shard(stage);
        if let Some(c) = checkpoint.filter(|&c| c + 1 != step) {
            // An older checkpoint: the replacement starts from a later state.
            let why = format!("stage {stage} was lost before uploading its shard of step {c}");
            self.checkpoints
                .abandon(self.metrics.as_mut().expect("metrics"), &why);
            checkpoint = None;
        }
        match self.pipeline.replace_stage(
            stage,
            lost,
            step,
            restore,
            checkpoint,
            self.trace.is_some(),
        ) {
            Ok(replacement) => Ok((replacement, None)),
            Err(e) => {
                warn!(step, stage, error = %e, "mid-step recovery failed; recovering from snapshots");
                Err(failure)
            }
        }
    }

    /// How a replacement of `stage` gets the state it had at the start of `step`: from the peer
    /// snapshots of step − 1, from the checkpoint or initial weights the pipeline started from,
    /// or not at all (`None`).
    fn step_start_state(&mut self, step: u64, stage: usize) -> Option<Option<ToWorker>> {
        let cfg = self.cfg;
        let before = step.checked_sub(1)?;
        let layouts = partition_layers(&cfg.model, cfg.train.seq_len, cfg.pipeline.stages).ok()?;
        let params = layouts.get(stage)?.param_names(&cfg.model);
        let names = with_moments(&params, before > 0);
        let peer_sources = self.pipeline.coordinator().peer_sources(before, &names);
        let loaded = Loaded {
            start: &self.loaded,
            step: self.loaded_step,
        };
        recovery::step_start_state(step, peer_sources, loaded)
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
        for first in (0..batches).step_by(EVAL_CHUNK) {
            if stoppable && self.signal.load(Ordering::SeqCst) != 0 {
                self.stop_seen.get_or_insert_with(Instant::now);
                warn!(
                    done = first,
                    batches, "stop signal: abandoning the evaluation for the final checkpoint"
                );
                return Ok(None);
            }
            let chunk = EVAL_CHUNK.min(batches - first);
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

    fn trainer_state(&self, step: u64, lr: f64, loss: f64) -> TrainerState {
        let cfg = self.cfg;
        let layers = partition_layers(&cfg.model, cfg.train.seq_len, cfg.pipeline.stages)
            .map(|ls| ls.iter().map(|l| [l.layers.start, l.layers.end]).collect())
            .unwrap_or_default();
        TrainerState {
            step,
            optimizer_step: step,
            data: DataCursor {
                seed: cfg.train.seed,
                next_step: step + 1,
            },
            lr: LrPosition {
                step,
                total_steps: cfg.lr_schedule_steps(),
                last_lr: lr,
            },
            loss,
            topology: Topology {
                stages: cfg.pipeline.stages,
                replicas: cfg.pipeline.replicas,
                layers,
                schedule: cfg.pipeline.schedule.to_string(),
                microbatches: cfg.pipeline.microbatches,
                splits: cfg.pipeline.splits,
            },
            config: cfg.to_toml(),
            writer: WRITER.to_string(),
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
        let mut candidates: Vec<u64> = committed
            .iter()
            .rev()
            .copied()
            .filter(|&s| match point {
                ResumePoint::Latest => true,
                ResumePoint::Step(n) => s <= n,
            })
            .collect();
        match (point, candidates.first()) {
            (_, None) => {
                return Err(LaunchError::Run(format!(
                    "no committed checkpoint at {url}{}; committed steps: {committed:?}",
                    if let ResumePoint::Step(n) = point {
                        format!(" at or before step {n}")
                    } else {
                        String::new()
                    }
                )));
            }
            (ResumePoint::Step(n), Some(&first)) if first != n => {
                return Err(LaunchError::Run(format!(
                    "no committed checkpoint of step {n} at {url}; committed steps: {committed:?}"
                )));
            }
            _ => {}
        }
        if !self.cfg.checkpoint.fallback {
            candidates.truncate(1);
        }
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
}

impl Driver<'_, '_> {
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
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_u64()))
                .is_none_or(|s| s <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(path, kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step is copied when no copy is in flight; while one is, up to `max_skips` steps in a
    /// row are skipped, then the next waits for it (0: never skip).
    #[test]
    fn peer_copies_are_skipped_while_one_is_in_flight_up_to_the_limit() {
        assert!(peer_copy_due(false, 0, 3));
        assert!(peer_copy_due(false, 7, 3));
        assert!(!peer_copy_due(true, 0, 3));
        assert!(!peer_copy_due(true, 2, 3));
        assert!(peer_copy_due(true, 3, 3));
        assert!(peer_copy_due(true, 0, 0));
    }
}
