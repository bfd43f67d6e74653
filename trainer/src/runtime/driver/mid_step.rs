//! The middle of a step, as the driver sees it: waiting for every worker's `StepDone`, and the
//! recoveries that keep the step going — a stage lost mid-step replaced from its step-start state
//! (`elastic.mid_step`), or, with data parallelism, a lost replica's share re-routed to a
//! survivor and the reduction regrouped. Which stage or replica is lost is the pipeline's finding
//! (`Pipeline::lost_stage`, `Pipeline::lost_replica`); what to do with it is
//! [`super::decide`] and [`recovery`]; this is the I/O that carries it out.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use tracing::{info, warn};

use super::super::control::{StepCost, ToLauncher, ToWorker};
use super::super::error::LaunchError;
use super::super::events::{NodeLost, Recovered, RunEvent};
use super::super::pipeline::Replacement;
use super::super::recovery::{self, Loaded};
use super::super::trace::unix_time_s;
use super::Driver;
use super::decide::{self, LostShard};
use super::replies::{self, Round, StepReplies};
use crate::checkpointing::shard::with_moments;
use crate::model::partition::partition_virtual_layers;

impl Driver<'_, '_> {
    /// Waits for every stage's `StepDone` of `step`, replacing a stage lost in the middle of the
    /// step (with `elastic.mid_step`); gathers the per-parameter sums of squares (in canonical
    /// order), the loss and the stages' costs.
    pub(super) fn forward_backward(
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
            match replies::round(&self.pipeline.active_slots(), &finished, &failed) {
                Round::Waiting => {}
                Round::Complete => break,
                Round::Failed { slots, error } => {
                    return Err(LaunchError::ReductionFailed { step, slots, error });
                }
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
    /// only ([`Pipeline::lost_replica`](super::super::pipeline::Pipeline::lost_replica)); if so, retires that replica (its share is re-routed to
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
        let members: Vec<_> = (0..p).map(|s| self.pipeline.regroup(s)).collect();
        for (slot, msg) in decide::reductions(step, round, lost, d, p, generation, &members) {
            self.pipeline.send(slot, &msg)?;
        }
        Ok(())
    }

    /// A `recovered` event for every stage replaced in the middle of `step`.
    pub(super) fn record_replacements(
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

    /// Mid-step recovery of one lost stage during step `step`, whose loss was seen at
    /// `detected_at_unix_s` (see [`Pipeline::replace_stage`](super::super::pipeline::Pipeline::replace_stage)).
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
        let checkpoint = match decide::lost_shard(self.checkpoints.missing_shard(stage), step) {
            LostShard::None => None,
            LostShard::Upload(c) => Some(c),
            LostShard::Abandon(c) => {
                // An older checkpoint: the replacement starts from a later state.
                let why = format!("stage {stage} was lost before uploading its shard of step {c}");
                self.checkpoints
                    .abandon(self.metrics.as_mut().expect("metrics"), &why);
                None
            }
        };
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
        // With virtual stages the worker holds v chunks: its state is theirs together.
        let layouts = partition_virtual_layers(
            &cfg.model,
            cfg.train.seq_len,
            cfg.pipeline.stages,
            cfg.pipeline.virtual_stages,
        )
        .ok()?;
        let params: Vec<String> = layouts
            .get(stage)?
            .iter()
            .flat_map(|chunk| chunk.param_names(&cfg.model))
            .collect();
        let names = with_moments(&params, before > 0);
        let peer_sources = self.pipeline.coordinator().peer_sources(before, &names);
        let loaded = Loaded {
            start: &self.loaded,
            step: self.loaded_step,
        };
        recovery::step_start_state(step, peer_sources, loaded)
    }
}
