//! Data parallelism on the worker's side: the gradient reduction with the other replicas of this
//! stage, and what the worker does when a replica is lost in the middle of a step.
//!
//! A worker starts its stage's reduction as soon as its own share of the step (its replica's
//! micro-batches) is through the backward, without waiting for the rest of the pipeline: the
//! reduction of the later stages overlaps the backward still running on the earlier ones. It
//! keeps its share ([`KeptShares`]) until the step's update. If a replica is lost — before or
//! during the reduction, in this stage or another — the reduction of the current group fails or
//! completes (either way), and the launcher's [`ToWorker::Reduce`] of a later round has the
//! surviving replicas reduce again in a group without the lost one: the adopting replica first
//! computes the lost share through its own pipeline. Every round combines the same tree nodes in
//! the summation tree's order, so the total is the same bits whoever computed which share.

use std::collections::BTreeSet;
use std::time::Instant;

use tracing::{info, warn};

use super::{Worker, WorkerError};
use crate::runtime::collective::{GroupSpec, ReplicaGroup};
use crate::runtime::control::{ControlStream, Regroup, ToLauncher, ToWorker};
use crate::runtime::kill_switch::Point;

/// This worker's shares of the step being reduced, kept until the step's update so that the
/// reduction can be done again after a replica was lost.
pub(super) struct KeptShares {
    step: u64,
    /// The reduction round they were last reduced in (0: the plan's group).
    round: u32,
    /// `(tree node = replica, its gradient sum over that replica's micro-batches)`.
    parts: Vec<(usize, Vec<f32>)>,
    /// Last stage: the own share's loss sum.
    loss_sum: Option<f64>,
    /// Last stage: the adopted shares' loss sums, by replica.
    adopted_losses: Vec<(usize, f64)>,
}

impl Worker {
    /// After this worker's own share of `step` (loss sum `loss_sum`): with replicas, keeps the
    /// share and reduces it with the other replicas' (round 0). Returns the step's reply:
    /// `StepDone`, or `ReduceFailed` when the group's reduction failed.
    pub(super) fn reduce_own_share(
        &mut self,
        step: u64,
        loss_sum: Option<f64>,
    ) -> Result<ToLauncher, WorkerError> {
        if self.group.is_none() {
            return self.step_done(step, 0, loss_sum, Vec::new());
        }
        self.stage.finish_gradients()?;
        self.kept = Some(KeptShares {
            step,
            round: 0,
            parts: vec![(self.replica, self.stage.gradient_vector()?)],
            loss_sum,
            adopted_losses: Vec::new(),
        });
        self.reduce_kept()
    }

    /// [`ToWorker::Reduce`]: a replica was lost during `step`; reduces again as round `round`,
    /// first computing the lost shares in `adopt` (their micro-batches, through this replica's
    /// pipeline) and joining the survivors' group `regroup`.
    pub(super) fn reduce_again(
        &mut self,
        msg: ToWorker,
        control: &mut ControlStream,
    ) -> Result<ToLauncher, WorkerError> {
        let ToWorker::Reduce {
            step,
            round,
            adopt,
            regroup,
        } = msg
        else {
            unreachable!("called with a Reduce");
        };
        let kept = self.kept.as_ref().ok_or_else(|| {
            WorkerError::Protocol(format!(
                "told to reduce step {step} again, but no step's gradients are waiting for an update"
            ))
        })?;
        if kept.step != step || round <= kept.round {
            return Err(WorkerError::Protocol(format!(
                "told to reduce step {step} as round {round}; this worker holds step {}'s \
                 gradients, reduced in round {}",
                kept.step, kept.round
            )));
        }
        let d = self.cfg.pipeline.replicas;
        let mut held: BTreeSet<usize> = kept.parts.iter().map(|(r, _)| *r).collect();
        if let Some(bad) = adopt.iter().find(|&&r| r >= d || !held.insert(r)) {
            return Err(WorkerError::Protocol(format!(
                "told to compute the share of replica {bad} (of {d}), which is not another lost one"
            )));
        }
        self.adopt_shares(step, &adopt, control)?;
        if let Some(regroup) = regroup {
            self.regroup(regroup)?;
        }
        self.kept.as_mut().expect("checked above").round = round;
        self.reduce_kept()
    }

    /// Computes the lost replicas' shares in `adopt` of `step` and keeps them with this worker's.
    /// Their units count as work redone because of the loss.
    fn adopt_shares(
        &mut self,
        step: u64,
        adopt: &[usize],
        control: &mut ControlStream,
    ) -> Result<(), WorkerError> {
        let own_record = std::mem::take(&mut self.record);
        let mut adopted = Vec::new();
        for &replica in adopt {
            let (share, loss) = self.compute_share(step, replica, control)?;
            adopted.push((replica, share, loss));
        }
        let adopted_cost = std::mem::replace(&mut self.record, own_record).cost;
        if !adopt.is_empty() {
            let c = &mut self.record.cost;
            c.redone_units += adopted_cost.units;
            c.redone_s += adopted_cost.compute_s;
            c.units += adopted_cost.units;
            c.compute_s += adopted_cost.compute_s;
        }
        let kept = self.kept.as_mut().expect("checked by the caller");
        for (replica, share, loss) in adopted {
            kept.parts.push((replica, share));
            kept.adopted_losses.extend(loss.map(|l| (replica, l)));
        }
        Ok(())
    }

    /// Reduces the kept shares in the current group: the step's `StepDone` with the total in the
    /// stage's gradients, or `ReduceFailed` (the shares stay kept for another round).
    fn reduce_kept(&mut self) -> Result<ToLauncher, WorkerError> {
        if let Some((epoch, epoch_us)) = self.record.trace_epoch {
            self.record.cost.reduce_start_us =
                epoch_us + Instant::now().saturating_duration_since(epoch).as_micros() as u64;
        }
        let kept = self.kept.as_ref().expect("shares kept before reducing");
        let (step, round) = (kept.step, kept.round);
        self.at(Point::Reduce { step, round })?;
        let kept = self.kept.as_ref().expect("shares kept before reducing");
        let group = self.group.as_mut().expect("a replica group");
        match group.all_reduce_nodes(step, &kept.parts) {
            Ok((total, cost)) => {
                self.stage.set_gradient_vector(&total)?;
                self.record.cost.reduce_bytes += cost.bytes_sent;
                self.record.cost.reduce_s += cost.seconds;
                let (loss_sum, adopted) = (kept.loss_sum, kept.adopted_losses.clone());
                self.step_done(step, round, loss_sum, adopted)
            }
            Err(e) => {
                warn!(step, round, error = %e, "the gradient reduction failed; waiting for the launcher");
                // The group's links are shut down: a later round needs a new group.
                self.group = None;
                Ok(ToLauncher::ReduceFailed {
                    stage: self.slot,
                    step,
                    round,
                    peer: e.replica(),
                    error: e.to_string(),
                })
            }
        }
    }

    /// Runs this stage's part of the lost `replica`'s share of `step` (its micro-batches, through
    /// this replica's pipeline): the share's gradient sum and, on the last stage, its loss sum.
    fn compute_share(
        &mut self,
        step: u64,
        replica: usize,
        control: &mut ControlStream,
    ) -> Result<(Vec<f32>, Option<f64>), WorkerError> {
        let own = self.first_micro_batch;
        let c = self.cfg.pipeline.microbatches / self.cfg.pipeline.replicas;
        self.first_micro_batch = replica * c;
        info!(
            step,
            replica, "computing a lost replica's share of the step"
        );
        let result = self.run_step(step, false, control);
        self.first_micro_batch = own;
        let loss = result?;
        self.stage.finish_gradients()?;
        Ok((self.stage.gradient_vector()?, loss))
    }

    /// The step's update is applied: the kept shares are no longer needed.
    pub(super) fn release_shares(&mut self) {
        self.kept = None;
    }

    /// Replaces the replica group by one of the surviving replicas of this stage.
    fn regroup(&mut self, regroup: Regroup) -> Result<(), WorkerError> {
        info!(
            generation = regroup.generation,
            members = regroup.addrs.len(),
            "rebuilding the replica group without the lost replicas"
        );
        self.join_group(regroup.member, &regroup.addrs, regroup.generation)
    }

    /// Connects to the other replicas of this stage (`addrs`: their reduction ports, by replica),
    /// when there are any.
    pub(super) fn connect_replicas(
        &mut self,
        generation: u64,
        addrs: &[String],
    ) -> Result<(), WorkerError> {
        if addrs.len() <= 1 {
            return Ok(());
        }
        self.join_group(self.replica, addrs, generation)
    }

    /// Joins the replica group of the reduction ports `addrs` as member `member`, under link
    /// generation `generation`; the group reduces the shares of all `pipeline.replicas`.
    fn join_group(
        &mut self,
        member: usize,
        addrs: &[String],
        generation: u64,
    ) -> Result<(), WorkerError> {
        // The old group's links close first: its members see this one gone.
        self.group = None;
        let port = self.reduce_port.as_ref().ok_or_else(|| {
            WorkerError::Protocol("replica links, but this worker has no reduction port".into())
        })?;
        self.group = Some(ReplicaGroup::connect(
            port,
            addrs,
            member,
            GroupSpec {
                generation,
                micro_batches: self.cfg.pipeline.microbatches,
                nodes: self.cfg.pipeline.replicas,
            },
            &self.token,
            self.cfg.pipeline.timeout(),
        )?);
        Ok(())
    }
}
