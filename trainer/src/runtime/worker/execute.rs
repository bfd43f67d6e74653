//! Running one step's (or one evaluation's) action list over the transport: receive, compute,
//! send, in the validated schedule's order.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use candle_core::{Device, Tensor};
use ops::sum_tree::SumTree;

use super::record::{StepRecord, UnitStart};
use super::{Worker, WorkerError};
use crate::data::{Split, micro_batch_tokens};
use crate::model::{Mode, StageInput, StageOutput};
use crate::runtime::control::ControlStream;
use crate::runtime::kill_switch::Point;
use crate::runtime::trace::unix_time_us;
use crate::runtime::transport::{Payload, TcpLink, Transport, TransportError};
use crate::schedule::{Action, Schedule, Unit, generate_forward_only, validate};

/// A schedule that passed [`validate`] (complete, in order, deadlock-free): the only kind a worker
/// runs. An invalid one is refused with [`WorkerError::InvalidSchedule`], a permanent failure.
#[derive(Clone, Debug)]
pub(super) struct ValidSchedule(Schedule);

impl ValidSchedule {
    pub(super) fn new(schedule: Schedule) -> Result<Self, WorkerError> {
        validate(&schedule).map_err(WorkerError::InvalidSchedule)?;
        Ok(Self(schedule))
    }

    pub(super) fn get(&self) -> &Schedule {
        &self.0
    }
}

/// The tokens of the micro-batches in flight: `rows × (seq_len + 1)`.
struct MicroBatchTokens {
    tokens: HashMap<usize, Vec<u32>>,
}

/// The per-call state of [`Worker::execute`].
struct ExecState {
    tokens: MicroBatchTokens,
    inbox: HashMap<Unit, Tensor>,
    outbox: HashMap<Unit, Tensor>,
    /// Last stage: each micro-batch's sum of token losses, over its segments in order.
    losses: Option<BTreeMap<usize, f64>>,
    loss_scale: f64,
}

impl Worker {
    /// Executes this stage's actions of one training step; with `trace`, records when each unit ran.
    pub(super) fn run_step(
        &mut self,
        step: u64,
        trace: bool,
        control: &mut ControlStream,
    ) -> Result<Option<f64>, WorkerError> {
        self.record = StepRecord::new(
            step,
            std::mem::take(&mut self.replay_skip),
            trace.then(|| (Instant::now(), unix_time_us())),
        );
        self.stage.take_peak_activation_bytes();
        let schedule = self.schedule.clone();
        self.stage.begin_step(schedule.get().microbatches);
        let loss_sum = self.execute(&schedule, Split::Train, step, Mode::Train, Some(control))?;
        self.record.cost.peak_activation_bytes = self.stage.take_peak_activation_bytes() as u64;
        self.record.cost.state_bytes = self.stage.state_bytes() as u64;
        Ok(loss_sum)
    }

    /// Forward-only pass over `batches` held-out micro-batches (the same ones at every evaluation).
    pub(super) fn run_eval(&mut self, batches: usize) -> Result<Option<f64>, WorkerError> {
        let schedule = ValidSchedule::new(generate_forward_only(
            self.cfg.pipeline.stages,
            batches,
            self.cfg.pipeline.splits,
        )?)?;
        self.execute(&schedule, Split::Val, 0, Mode::Eval, None)
    }

    /// Runs this stage's action list of `schedule`. In training with mid-step recovery on, a link
    /// that breaks is rebuilt to the neighbour's replacement and the list goes on where it stood
    /// (see [`Worker::recover_link`]).
    fn execute(
        &mut self,
        schedule: &ValidSchedule,
        split: Split,
        step: u64,
        mode: Mode,
        mut control: Option<&mut ControlStream>,
    ) -> Result<Option<f64>, WorkerError> {
        let schedule = schedule.get();
        let last = self.stage.layout().is_last();
        let mut state = ExecState {
            tokens: MicroBatchTokens {
                tokens: HashMap::new(),
            },
            inbox: HashMap::new(),
            outbox: HashMap::new(),
            losses: last.then(BTreeMap::new),
            loss_scale: 0.0,
        };
        let train = mode == Mode::Train;
        // The loss is the mean over the step's micro-batches, all replicas' together.
        let micro_batches = if train {
            self.cfg.pipeline.microbatches
        } else {
            schedule.microbatches
        };
        state.loss_scale =
            1.0 / (micro_batches * self.cfg.train.micro_batch_size * self.cfg.train.seq_len) as f64;
        let actions = &schedule.actions[self.index()];
        let mut pc = 0;
        while pc < actions.len() {
            let action = actions[pc];
            if train {
                self.at(Point::Action {
                    step,
                    index: pc,
                    count: actions.len(),
                    action,
                })?;
            }
            match self.run_action(action, &mut state, split, step, mode) {
                Ok(()) => {
                    pc += 1;
                    if train {
                        self.record.done_actions = pc;
                    }
                }
                // A neighbour died mid-step: keep everything, have the link rebuilt to its
                // replacement, and go on where this stage stood.
                Err(WorkerError::Transport(TransportError::Io { peer, source }))
                    if train
                        && self.cfg.elastic.mid_step
                        && self.cfg.pipeline.replicas == 1
                        && control.is_some() =>
                {
                    let control = control.as_deref_mut().expect("checked above");
                    pc =
                        self.recover_link(control, step, action, pc, &format!("{peer}: {source}"))?;
                }
                Err(e) => return Err(e),
            }
        }
        state
            .losses
            .map(|losses| tree_sum(schedule.microbatches, losses))
            .transpose()
    }

    fn run_action(
        &mut self,
        action: Action,
        state: &mut ExecState,
        split: Split,
        step: u64,
        mode: Mode,
    ) -> Result<(), WorkerError> {
        let train = mode == Mode::Train;
        match action {
            Action::RecvActivation(u) => {
                let t = link(&mut self.prev, "previous")?.recv(step, Payload::Activation, u)?;
                state.inbox.insert(u, t);
            }
            Action::Forward(u) => self.forward(u, state, split, step, mode)?,
            Action::SendActivation(u) => {
                let t = take(&mut state.outbox, u)?;
                self.send_boundary(train, step, action, t)?;
            }
            Action::RecvGrad(u) => {
                let t = link(&mut self.next, "next")?.recv(step, Payload::Grad, u)?;
                state.inbox.insert(u, t);
            }
            Action::Backward(u) => {
                let started = UnitStart::now();
                let d_out = if self.stage.layout().is_last() {
                    None
                } else {
                    Some(take(&mut state.inbox, u)?)
                };
                if let Some(dx) = self.stage.backward(u, d_out)? {
                    state.outbox.insert(u, dx);
                }
                let redone = self.record.delivered.replays(action);
                self.record.computed(action, started, redone);
            }
            Action::SendGrad(u) => {
                let t = take(&mut state.outbox, u)?;
                self.send_boundary(train, step, action, t)?;
            }
        }
        Ok(())
    }

    /// The forward of unit `u`: from the tokens (first stage) or the received activation; the
    /// last stage adds the unit's loss to the step's.
    fn forward(
        &mut self,
        u: Unit,
        state: &mut ExecState,
        split: Split,
        step: u64,
        mode: Mode,
    ) -> Result<(), WorkerError> {
        let layout = self.stage.layout();
        let (first, last) = (layout.is_first(), layout.is_last());
        let started = UnitStart::now();
        let input = if first {
            StageInput::Tokens(self.segment_tokens(&mut state.tokens, split, step, u, 0)?)
        } else {
            StageInput::Hidden(take(&mut state.inbox, u)?)
        };
        let targets = if last {
            Some(
                self.segment_tokens(&mut state.tokens, split, step, u, 1)?
                    .flatten_all()?,
            )
        } else {
            None
        };
        if u.segment + 1 == self.segment_lengths.len() {
            state.tokens.tokens.remove(&u.micro_batch);
        }
        match self
            .stage
            .forward(u, input, targets.as_ref(), state.loss_scale, mode)?
        {
            StageOutput::Hidden(h) => {
                state.outbox.insert(u, h);
            }
            StageOutput::LossSum(l) => {
                *state
                    .losses
                    .as_mut()
                    .expect("last stage")
                    .entry(u.micro_batch)
                    .or_default() += l;
            }
        }
        if mode == Mode::Train {
            // Proven redone: a neighbour has this unit's output (or its backward's).
            let redone = self.record.delivered.replays(Action::Forward(u));
            self.record.computed(Action::Forward(u), started, redone);
        }
        Ok(())
    }

    /// Sends a boundary tensor (the send `action`) to its neighbour; in training it is kept until
    /// the step's update (first, so that a send that fails is still in the record), and a
    /// replacement does not send what the neighbour already has.
    fn send_boundary(
        &mut self,
        train: bool,
        step: u64,
        action: Action,
        t: Tensor,
    ) -> Result<(), WorkerError> {
        let (payload, u) = boundary(action).expect("a send action");
        if train {
            self.record.retain(payload, u, &t);
            if self.record.delivered.skips(action) {
                return Ok(());
            }
        }
        let (side, which) = match payload {
            Payload::Activation => (&mut self.next, "next"),
            Payload::Grad => (&mut self.prev, "previous"),
        };
        link(side, which)?.send(step, payload, u, &t)?;
        Ok(())
    }

    /// Token ids `(B, s)` of unit `u`'s segment, shifted by `shift` (0 = inputs, 1 = targets).
    fn segment_tokens(
        &self,
        cache: &mut MicroBatchTokens,
        split: Split,
        step: u64,
        u: Unit,
        shift: usize,
    ) -> Result<Tensor, WorkerError> {
        let (batch, seq_len) = (self.cfg.train.micro_batch_size, self.cfg.train.seq_len);
        // A replica's micro-batch i of a training step is the step's micro-batch
        // `first_micro_batch + i`: the data does not depend on the replica count.
        let offset = match split {
            Split::Train => self.first_micro_batch,
            Split::Val => 0,
        };
        let rows = match cache.tokens.entry(u.micro_batch) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let src = self
                    .data
                    .as_deref()
                    .expect("first and last stages hold a data source");
                e.insert(micro_batch_tokens(
                    src,
                    split,
                    self.cfg.train.seed,
                    step,
                    (offset + u.micro_batch) as u64,
                    batch,
                    seq_len,
                )?)
            }
        };
        let start: usize = self.segment_lengths[..u.segment].iter().sum();
        let len = self.segment_lengths[u.segment];
        let ids: Vec<u32> = (0..batch)
            .flat_map(|b| {
                rows[b * (seq_len + 1) + start + shift..][..len]
                    .iter()
                    .copied()
            })
            .collect();
        Ok(Tensor::from_vec(ids, (batch, len), &Device::Cpu)?)
    }
}

/// The sum of the micro-batches' losses (`losses[i]` of micro-batch i of `micro_batches`) in the
/// summation tree's order, so that replicas' sums add up to the same number whatever the replica
/// count (see `ops::sum_tree`).
fn tree_sum(micro_batches: usize, losses: BTreeMap<usize, f64>) -> Result<f64, WorkerError> {
    tracing::debug!(?losses, "micro-batch losses");
    let mut tree = SumTree::new(micro_batches);
    let mut add = |a: f64, b: f64| Ok::<f64, std::convert::Infallible>(a + b);
    let bad = |e: String| WorkerError::Protocol(format!("the step's losses: {e}"));
    for i in 0..micro_batches {
        let l = losses.get(&i).copied().unwrap_or(0.0);
        tree.push(i, i + 1, l, &mut add)
            .map_err(|e| bad(e.to_string()))?;
    }
    tree.finish::<std::convert::Infallible>()
        .map_err(|e| bad(e.to_string()))
}

/// The boundary tensor a communication action moves: its payload and unit (`None` for compute).
pub(super) fn boundary(action: Action) -> Option<(Payload, Unit)> {
    match action {
        Action::RecvActivation(u) | Action::SendActivation(u) => Some((Payload::Activation, u)),
        Action::RecvGrad(u) | Action::SendGrad(u) => Some((Payload::Grad, u)),
        Action::Forward(_) | Action::Backward(_) => None,
    }
}

/// The link `which` ("previous" or "next"), or a protocol error when this stage has none there.
pub(super) fn link<'a>(
    link: &'a mut Option<TcpLink>,
    which: &str,
) -> Result<&'a mut TcpLink, WorkerError> {
    link.as_mut().ok_or_else(|| {
        WorkerError::Protocol(format!(
            "the schedule talks to the {which} stage, which this stage does not have"
        ))
    })
}

fn take(map: &mut HashMap<Unit, Tensor>, u: Unit) -> Result<Tensor, WorkerError> {
    map.remove(&u).ok_or_else(|| {
        WorkerError::Protocol(format!("no tensor for unit {u:?} (schedule out of order)"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::ScheduleKind;

    #[test]
    fn generated_schedules_are_valid_and_edited_ones_are_refused() {
        let s = crate::schedule::generate(ScheduleKind::OneFOneB, 3, 4, 2).unwrap();
        assert_eq!(ValidSchedule::new(s.clone()).unwrap().get(), &s);
        let mut swapped = s;
        // Backward before its forward on stage 0.
        let b = swapped.actions[0]
            .iter()
            .position(|a| matches!(a, Action::Backward(_)))
            .unwrap();
        swapped.actions[0].swap(0, b);
        let e = ValidSchedule::new(swapped).unwrap_err();
        assert!(
            matches!(&e, WorkerError::InvalidSchedule(_)),
            "expected an invalid-schedule error, got {e:?}"
        );
    }

    #[test]
    fn communication_actions_name_their_boundary_tensor() {
        let u = Unit::new(2, 1);
        assert_eq!(
            boundary(Action::SendActivation(u)),
            Some((Payload::Activation, u))
        );
        assert_eq!(
            boundary(Action::RecvActivation(u)),
            Some((Payload::Activation, u))
        );
        assert_eq!(boundary(Action::SendGrad(u)), Some((Payload::Grad, u)));
        assert_eq!(boundary(Action::RecvGrad(u)), Some((Payload::Grad, u)));
        assert_eq!(boundary(Action::Forward(u)), None);
        assert_eq!(boundary(Action::Backward(u)), None);
    }
}
