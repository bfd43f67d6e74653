//! Running one step's (or one evaluation's) action list over the transport: receive, compute,
//! send, in the validated schedule's order. With device links (`pipeline.transport = "nccl"`)
//! the values of boundary tensors stay on the stage's device: the TCP links carry their headers
//! and the stage receives, keeps and sends the values ([`crate::model::DeviceLinks`]).
//!
//! With virtual stages every action names its chunk: a compute action runs on that chunk's
//! stage, and a boundary tensor travels between neighbouring virtual stages — over the same link
//! to worker r±1 for every chunk, and from the last worker's chunk c to the first worker's chunk
//! c+1 over the link that closes the ring. Each message names the virtual stage it is for, and
//! the receiver checks it (see [`TcpLink::send_virtual`]). Over device links each chunk has links
//! of its own to the chunks beside it: a tensor a chunk keeps ([`Boundary::Device`] names the
//! chunk) is sent on that chunk's link, and a header's tensor received onto that of the chunk the
//! action names. Document starts travel in the activation's message over TCP, and in its header
//! beside a device link; the receiver checks them either way.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};
use ops::sum_tree::SumTree;

use super::boundary::{Boundary, DocStarts};
use super::chunks::Chunks;
use super::record::{StepRecord, UnitStart};
use super::{Worker, WorkerError};
use crate::config::{ConfigError, StageTransport};
use crate::data::{RowPart, Split, document_starts, micro_batch_part};
use crate::model::{
    DeviceLinks, LinkedInput, LinkedOutput, Mode, ModelError, StageCompute, StageInput,
    StageLayout, StageOutput,
};
use crate::runtime::control::ControlStream;
use crate::runtime::kill_switch::Point;
use crate::runtime::trace::unix_time_us;
use crate::runtime::transport::{DocumentStarts, Payload, TcpLink, TransportError};
use crate::schedule::{
    Action, Op, Schedule, ScheduleError, ScheduleKind, Unit, generate_forward_only, validate,
};

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

/// The tokens of the micro-batches in flight: `rows × span`, where `span` is the part of each
/// `seq_len + 1`-token row this stage reads ([`RowPart`]).
struct MicroBatchTokens {
    tokens: HashMap<usize, Vec<u32>>,
}

/// A boundary tensor's place in the worker: (local chunk, unit).
type Slot = (usize, Unit);

/// The per-call state of [`Worker::execute`].
struct ExecState {
    tokens: MicroBatchTokens,
    /// Received tensors not yet used, by (chunk, unit).
    inbox: HashMap<Slot, Boundary>,
    /// Computed tensors not yet sent, by (chunk, unit).
    outbox: HashMap<Slot, Boundary>,
    /// Last stage: each micro-batch's sum of token losses, over its segments in order.
    losses: Option<BTreeMap<usize, f64>>,
    loss_scale: f64,
    /// With document masks: each micro-batch's document starts, from its tokens (first stage) or
    /// from the activations received for it (the others), sent on with its activations.
    docs: HashMap<usize, DocStarts>,
    /// Each micro-batch's segment lengths: the rule's table, or (document partition) its own,
    /// computed from its document starts as every stage does.
    lengths: HashMap<usize, Arc<Vec<usize>>>,
}

impl Worker {
    /// Executes this stage's actions of one training step; with `trace`, records when each unit ran.
    pub(super) fn run_step(
        &mut self,
        step: u64,
        trace: bool,
        control: &mut ControlStream,
    ) -> Result<Option<f64>, WorkerError> {
        let schedule = self.schedule.clone();
        self.record = StepRecord::new(
            step,
            &schedule.get().actions[self.index()],
            std::mem::take(&mut self.replay_skip),
            trace.then(|| (Instant::now(), unix_time_us())),
        );
        self.stage.take_peak_activation_bytes();
        self.stage.begin_step(schedule.get().microbatches);
        let loss_sum = self.execute(&schedule, Split::Train, step, Mode::Train, Some(control))?;
        self.record.cost.peak_activation_bytes = self.stage.take_peak_activation_bytes() as u64;
        self.record.cost.state_bytes = self.stage.state_bytes() as u64;
        Ok(loss_sum)
    }

    /// Forward-only pass over `batches` held-out micro-batches from the `first` (the same ones at
    /// every evaluation).
    pub(super) fn run_eval(
        &mut self,
        first: usize,
        batches: usize,
    ) -> Result<Option<f64>, WorkerError> {
        if first.checked_add(batches).is_none() {
            return Err(WorkerError::Protocol(format!(
                "evaluation chunk of {batches} micro-batches from {first} overflows"
            )));
        }
        self.eval_first = first;
        let (p, k) = (self.cfg.pipeline.stages, self.cfg.pipeline.splits);
        let schedule = ValidSchedule::new(match self.stage.len() {
            1 => generate_forward_only(p, batches, k)?,
            v => forward_only_virtual(p, v, batches, k)?,
        })?;
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
        let last = self.stage.holds_last();
        if self.linked() {
            // What the last step (or evaluation) kept for its links is no longer needed.
            let deadline = Instant::now() + self.cfg.pipeline.timeout();
            for c in 0..self.stage.len() {
                device_links(&mut self.stage, c)?
                    .release_boundaries(deadline)
                    .map_err(|e| link_failure("a neighbouring stage".into(), e))?;
            }
        }
        let mut state = ExecState {
            tokens: MicroBatchTokens {
                tokens: HashMap::new(),
            },
            inbox: HashMap::new(),
            outbox: HashMap::new(),
            losses: last.then(BTreeMap::new),
            loss_scale: 0.0,
            docs: HashMap::new(),
            lengths: HashMap::new(),
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
                // Virtual stages: a survivor relinks a broken link while it waits on the other.
                if let Some(control) = control.as_deref_mut() {
                    self.await_receive(control, step, action, pc)?;
                }
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
        let (u, c) = (action.unit(), action.chunk());
        match action.op() {
            // A message taken off a link to a lost neighbour before the relink is not received
            // again (the neighbour's replacement does not send it).
            Op::RecvActivation => {
                let (b, docs) = match train.then(|| self.record.take_ahead(action)).flatten() {
                    Some(held) => held,
                    None => self.receive_activation(step, u, c)?,
                };
                if let Some(docs) = docs {
                    state.docs.insert(u.micro_batch, docs);
                }
                state.inbox.insert((c, u), b);
            }
            Op::Forward => self.forward(u, c, state, split, step, mode)?,
            Op::SendActivation => {
                let t = take(&mut state.outbox, (c, u))?;
                let docs = state.docs.get(&u.micro_batch).cloned();
                self.send_boundary(train, step, action, t, docs)?;
            }
            Op::RecvGrad => {
                let b = match train.then(|| self.record.take_ahead(action)).flatten() {
                    Some((held, _)) => held,
                    None => self.receive_grad(step, u, c)?,
                };
                state.inbox.insert((c, u), b);
            }
            // A whole backward, or (zero-bubble) its input half: the gradient for the previous
            // stage either way, sent on by the SendGrad that follows.
            Op::Backward | Op::BackwardInput => {
                let started = UnitStart::now();
                let half = action.op() == Op::BackwardInput;
                let d_out = if self.chunk_layout(c)?.is_last() {
                    None
                } else {
                    Some(take(&mut state.inbox, (c, u))?)
                };
                let width = self.cfg.model.d_model;
                let dx = match d_out {
                    // Over device links the gradient waits on this chunk's device (the last
                    // stage starts from its loss).
                    Some(Boundary::Device { chunk, .. }) if chunk != c => {
                        return Err(elsewhere(chunk, c));
                    }
                    Some(Boundary::Device { .. }) | None if self.linked() => {
                        let links = device_links(&mut self.stage, c)?;
                        let rows = match half {
                            true => links.backward_input_linked(u)?,
                            false => links.backward_linked(u)?,
                        };
                        rows.map(|rows| Boundary::Device {
                            rows,
                            width,
                            chunk: c,
                        })
                    }
                    Some(Boundary::Host(t)) if half => chunk_mut(&mut self.stage, c)?
                        .backward_input(u, Some(t))?
                        .map(Boundary::Host),
                    Some(Boundary::Host(t)) => chunk_mut(&mut self.stage, c)?
                        .backward(u, Some(t))?
                        .map(Boundary::Host),
                    None if half => chunk_mut(&mut self.stage, c)?
                        .backward_input(u, None)?
                        .map(Boundary::Host),
                    None => chunk_mut(&mut self.stage, c)?
                        .backward(u, None)?
                        .map(Boundary::Host),
                    Some(Boundary::Device { .. }) => return Err(not_linked()),
                };
                if let Some(dx) = dx {
                    state.outbox.insert((c, u), dx);
                }
                let redone = self.record.redoes(action);
                let len = unit_len(state, u);
                self.record.computed(action, started, redone, len);
                self.stage.computed(c);
            }
            // Zero-bubble: the weight half of a backward whose input half ran; nothing moves (over
            // device links neither).
            Op::BackwardWeight => {
                let started = UnitStart::now();
                chunk_mut(&mut self.stage, c)?.backward_weight(u)?;
                let redone = self.record.redoes(action);
                let len = unit_len(state, u);
                self.record.computed(action, started, redone, len);
                self.stage.computed(c);
            }
            Op::SendGrad => {
                let t = take(&mut state.outbox, (c, u))?;
                self.send_boundary(train, step, action, t, None)?;
            }
        }
        Ok(())
    }

    /// The layout of local chunk `c` (the schedule's chunks were validated against v, so a
    /// chunk the worker lacks is a bug, reported, not a panic).
    fn chunk_layout(&self, c: usize) -> Result<&StageLayout, WorkerError> {
        self.stage
            .chunk(c)
            .map(|s| s.layout())
            .ok_or_else(|| no_chunk(c, self.stage.len()))
    }

    /// The virtual stage of local chunk `c` (`c·p + r`).
    pub(super) fn virtual_stage(&self, c: usize) -> usize {
        c * self.cfg.pipeline.stages + self.index()
    }

    /// What messages name as their virtual stage: `Some` with virtual stages, `None` without
    /// (the wire format of runs without them is unchanged).
    fn message_stage(&self, virtual_stage: usize) -> Option<usize> {
        (self.stage.len() > 1).then_some(virtual_stage)
    }

    /// The forward of unit `u`: from the tokens (first stage) or the received activation; the
    /// last stage adds the unit's loss to the step's.
    fn forward(
        &mut self,
        u: Unit,
        c: usize,
        state: &mut ExecState,
        split: Split,
        step: u64,
        mode: Mode,
    ) -> Result<(), WorkerError> {
        let layout = self.chunk_layout(c)?;
        let (first, last) = (layout.is_first(), layout.is_last());
        let started = UnitStart::now();
        if first || last {
            self.read_rows(&mut state.tokens, split, step, u.micro_batch)?;
        }
        // The documents before the lengths: the document partition cuts the micro-batch from
        // them, and the tokens are sliced by its lengths.
        if self.cfg.data.document_mask {
            self.set_documents(state, u, c)?;
        }
        let lengths = self.set_segment_lengths(state, u, c)?;
        let input = if first {
            Input::Tokens(self.segment_tokens(&state.tokens, &lengths, u, 0)?)
        } else {
            Input::Boundary(take(&mut state.inbox, (c, u))?)
        };
        let targets = if last {
            Some(
                self.segment_tokens(&state.tokens, &lengths, u, 1)?
                    .flatten_all()?,
            )
        } else {
            None
        };
        if u.segment + 1 == lengths.len() {
            state.tokens.tokens.remove(&u.micro_batch);
        }
        let loss_scale = state.loss_scale;
        let output = if self.linked() {
            let input = match input {
                Input::Tokens(t) => LinkedInput::Tokens(t),
                Input::Boundary(Boundary::Device { chunk, .. }) if chunk == c => {
                    LinkedInput::Received
                }
                Input::Boundary(Boundary::Device { chunk, .. }) => {
                    return Err(elsewhere(chunk, c));
                }
                Input::Boundary(Boundary::Host(_)) => return Err(not_linked()),
            };
            let width = self.cfg.model.d_model;
            match device_links(&mut self.stage, c)?.forward_linked(
                u,
                input,
                targets.as_ref(),
                loss_scale,
                mode,
            )? {
                LinkedOutput::Kept { rows } => Output::Boundary(Boundary::Device {
                    rows,
                    width,
                    chunk: c,
                }),
                LinkedOutput::LossSum(l) => Output::LossSum(l),
            }
        } else {
            let input = match input {
                Input::Tokens(t) => StageInput::Tokens(t),
                Input::Boundary(Boundary::Host(t)) => StageInput::Hidden(t),
                Input::Boundary(Boundary::Device { .. }) => return Err(not_linked()),
            };
            match chunk_mut(&mut self.stage, c)?.forward(
                u,
                input,
                targets.as_ref(),
                loss_scale,
                mode,
            )? {
                StageOutput::Hidden(h) => Output::Boundary(Boundary::Host(h)),
                StageOutput::LossSum(l) => Output::LossSum(l),
            }
        };
        match output {
            Output::Boundary(b) => {
                state.outbox.insert((c, u), b);
            }
            Output::LossSum(l) => {
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
            let action = Action::new(Op::Forward, u, c);
            let redone = self.record.redoes(action);
            self.record
                .computed(action, started, redone, lengths[u.segment]);
        }
        self.stage.computed(c);
        self.stage.check_budget(u)?;
        Ok(())
    }

    /// Gives the stage unit `u`'s micro-batch's document starts (document masks on): on the
    /// first stage from the input tokens of its rows (read for this unit just before), on the
    /// others from the activations received for it. Kept in `state.docs` for the activations
    /// this stage sends on.
    fn set_documents(
        &mut self,
        state: &mut ExecState,
        u: Unit,
        c: usize,
    ) -> Result<(), WorkerError> {
        let docs = match state.docs.get(&u.micro_batch) {
            Some(docs) => docs.clone(),
            None if self.chunk_layout(c)?.is_first() => {
                let eot = self.end_of_text.ok_or_else(|| {
                    WorkerError::Protocol(
                        "document masks on, but the first stage knows no end-of-text token".into(),
                    )
                })?;
                let rows =
                    state.tokens.tokens.get(&u.micro_batch).ok_or_else(|| {
                        WorkerError::Protocol(format!("no tokens read for unit {u}"))
                    })?;
                let seq_len = self.cfg.train.seq_len;
                // The first stage's part of a row starts at the row's first token (inputs, or
                // the whole row on a one-stage pipeline): the inputs are its first seq_len.
                let span = rows.len() / self.cfg.train.micro_batch_size;
                let docs: Vec<Vec<usize>> = rows
                    .chunks_exact(span)
                    .map(|row| document_starts(&row[..seq_len], eot))
                    .collect();
                let docs = DocStarts::new(docs);
                state.docs.insert(u.micro_batch, docs.clone());
                docs
            }
            None => {
                return Err(WorkerError::Protocol(format!(
                    "the activation of unit {u} came without its micro-batch's document starts \
                     (data.document_mask differs between the stages?)"
                )));
            }
        };
        chunk_mut(&mut self.stage, c)?.set_documents(u.micro_batch, docs.as_ref().clone())?;
        Ok(())
    }

    /// Unit `u`'s micro-batch's segment lengths: the rule's table, or with the document
    /// partition its own from its document starts (set just before; the same on every stage and
    /// replica, and on a replacement, which gets the same starts), which the stage is given too.
    fn set_segment_lengths(
        &mut self,
        state: &mut ExecState,
        u: Unit,
        c: usize,
    ) -> Result<Arc<Vec<usize>>, WorkerError> {
        let lengths = match state.lengths.get(&u.micro_batch) {
            Some(lengths) => lengths.clone(),
            None => {
                let docs = state.docs.get(&u.micro_batch).map(|d| d.as_slice());
                let lengths = Arc::new(self.segments.lengths(docs)?);
                state.lengths.insert(u.micro_batch, lengths.clone());
                lengths
            }
        };
        if self.segments.per_micro_batch() {
            chunk_mut(&mut self.stage, c)?.set_segment_lengths(u.micro_batch, lengths.to_vec())?;
        }
        Ok(lengths)
    }

    /// Receives unit `u`'s activation from the previous stage, and the document starts it
    /// carries (in its TCP message, or with device links in its header): refused unless they are
    /// there exactly when document masks are on, and fit the micro-batch (sorted, from 0, below
    /// `seq_len`; a peer's message is untrusted input).
    pub(super) fn receive_activation(
        &mut self,
        step: u64,
        u: Unit,
        c: usize,
    ) -> Result<(Boundary, Option<DocStarts>), WorkerError> {
        let (batch, seq_len) = (self.cfg.train.micro_batch_size, self.cfg.train.seq_len);
        let masks = self.cfg.data.document_mask;
        let (b, docs) = self.receive_boundary(step, Payload::Activation, u, c)?;
        let docs = received_documents(docs, masks, batch, seq_len).map_err(|reason| {
            TransportError::BadTensor {
                peer: format!("stage {}", self.neighbours().0),
                reason: format!("unit {u}: {reason}"),
            }
        })?;
        Ok((b, docs))
    }

    /// Receives unit `u`'s output gradient from the next stage (which carries no document
    /// starts).
    pub(super) fn receive_grad(
        &mut self,
        step: u64,
        u: Unit,
        c: usize,
    ) -> Result<Boundary, WorkerError> {
        match self.receive_boundary(step, Payload::Grad, u, c)? {
            (b, None) => Ok(b),
            (_, Some(_)) => Err(TransportError::Unexpected {
                peer: format!("stage {}", self.neighbours().1),
                expected: format!("the gradient of unit {u} without document starts"),
                got: "document starts".into(),
            }
            .into()),
        }
    }

    /// Sends a boundary tensor (the send `action`) to its neighbour, an activation with its
    /// micro-batch's document starts `docs` (with document masks); in training it is kept until
    /// the step's update (first, so that a send that fails is still in the record), and a
    /// replacement does not send what the neighbour already has.
    fn send_boundary(
        &mut self,
        train: bool,
        step: u64,
        action: Action,
        b: Boundary,
        docs: Option<DocStarts>,
    ) -> Result<(), WorkerError> {
        let (payload, u) = boundary(action).expect("a send action");
        if train {
            self.record
                .retain((payload, action.chunk(), u), &b, docs.as_ref());
            if self.record.delivered.skips(action) {
                return Ok(());
            }
        }
        let (prev, next) = self.neighbours();
        // The virtual stage the tensor is for: the next one for an activation, the previous one
        // for a gradient.
        let here = self.virtual_stage(action.chunk());
        let (side, which, peer, there) = match payload {
            Payload::Activation => (&mut self.next, "next", next, here + 1),
            Payload::Grad => (&mut self.prev, "previous", prev, here.wrapping_sub(1)),
        };
        let there = (self.stage.len() > 1).then_some(there);
        let deadline = Instant::now() + self.cfg.pipeline.timeout();
        let to = Peer {
            link: link(side, which)?,
            stage: peer,
        };
        let docs = docs.as_deref().map(Vec::as_slice);
        send_on(
            to,
            &mut self.stage,
            (step, payload, u, there),
            (&b, docs),
            deadline,
        )
    }

    /// The worker indices of the previous and the next worker (r − 1 and r + 1; with virtual
    /// stages mod p, the ring the chunks' boundary tensors go round).
    pub(super) fn neighbours(&self) -> (usize, usize) {
        let (r, p) = (self.index(), self.cfg.pipeline.stages);
        if self.stage.len() > 1 {
            ((r + p - 1) % p, (r + 1) % p)
        } else {
            (r.wrapping_sub(1), r + 1)
        }
    }

    /// Whether boundary tensors cross device links (`pipeline.transport = "nccl"`).
    pub(super) fn linked(&self) -> bool {
        self.cfg.pipeline.transport == StageTransport::Nccl
    }

    /// Receives the next boundary tensor from its neighbour, which must be the `payload` of unit
    /// `u` for local chunk `c`: over the TCP link, or (with device links) its header over TCP and
    /// its values onto chunk `c`'s device; with the document starts the message carries, if any
    /// (unchecked: see [`Worker::receive_activation`]).
    fn receive_boundary(
        &mut self,
        step: u64,
        payload: Payload,
        u: Unit,
        c: usize,
    ) -> Result<(Boundary, Option<DocumentStarts>), WorkerError> {
        let (prev, next) = self.neighbours();
        let to = self.message_stage(self.virtual_stage(c));
        let (side, which, peer) = match payload {
            Payload::Activation => (&mut self.prev, "previous", prev),
            Payload::Grad => (&mut self.next, "next", next),
        };
        let tcp = link(side, which)?;
        if self.cfg.pipeline.transport == StageTransport::Tcp {
            let (t, docs) = tcp.recv_virtual(step, payload, u, to)?;
            return Ok((Boundary::Host(t), docs));
        }
        let (shape, docs) = tcp.recv_header(step, payload, u, to)?;
        let width = self.cfg.model.d_model;
        let rows = match shape[..] {
            [rows, w] if w == width && rows > 0 => rows,
            _ => {
                return Err(TransportError::BadTensor {
                    peer: format!("stage {peer}"),
                    reason: format!("shape {shape:?} is not (rows, d_model = {width})"),
                }
                .into());
            }
        };
        let deadline = Instant::now() + self.cfg.pipeline.timeout();
        let links = device_links(&mut self.stage, c)?;
        match payload {
            Payload::Activation => links.receive_activation(u, rows, deadline),
            Payload::Grad => links.receive_grad(u, rows, deadline),
        }
        .map_err(|e| link_failure(format!("stage {peer}"), e))?;
        Ok((
            Boundary::Device {
                rows,
                width,
                chunk: c,
            },
            docs,
        ))
    }

    /// The part of each row this worker reads: the inputs where it holds the first (virtual)
    /// stage, the targets where it holds the last, both where it holds both (with virtual stages
    /// in different chunks: one cache entry serves every chunk).
    fn row_part(&self) -> Result<RowPart, WorkerError> {
        RowPart::for_stage(self.stage.holds_first(), self.stage.holds_last()).ok_or_else(|| {
            WorkerError::Protocol(
                "tokens needed, but this worker holds neither the first nor the last virtual stage"
                    .into(),
            )
        })
    }

    /// Reads this stage's part of local micro-batch `micro_batch`'s rows into `cache`, unless
    /// they are there.
    fn read_rows(
        &self,
        cache: &mut MicroBatchTokens,
        split: Split,
        step: u64,
        micro_batch: usize,
    ) -> Result<(), WorkerError> {
        let (batch, seq_len) = (self.cfg.train.micro_batch_size, self.cfg.train.seq_len);
        // A replica's micro-batch i of a training step is the step's micro-batch
        // `first_micro_batch + i`: the data does not depend on the replica count.
        let offset = match split {
            Split::Train => self.first_micro_batch,
            Split::Val => self.eval_first,
        };
        // This stage reads only its part of each row: inputs on the first stage, targets on
        // the last (a sharded dataset then fetches only their byte ranges).
        let part = self.row_part()?;
        if let std::collections::hash_map::Entry::Vacant(e) = cache.tokens.entry(micro_batch) {
            let src = self
                .data
                .as_deref()
                .expect("first and last stages hold a data source");
            e.insert(micro_batch_part(
                src,
                split,
                self.cfg.train.seed,
                step,
                (offset + micro_batch) as u64,
                batch,
                seq_len,
                part,
            )?);
        }
        Ok(())
    }

    /// Token ids `(B, s)` of unit `u`'s segment of its micro-batch's `lengths`, shifted by
    /// `shift` (0 = inputs, 1 = targets), from the rows [`Worker::read_rows`] read.
    fn segment_tokens(
        &self,
        cache: &MicroBatchTokens,
        lengths: &[usize],
        u: Unit,
        shift: usize,
    ) -> Result<Tensor, WorkerError> {
        let (batch, seq_len) = (self.cfg.train.micro_batch_size, self.cfg.train.seq_len);
        let span = self.row_part()?.span(seq_len);
        let rows = cache
            .tokens
            .get(&u.micro_batch)
            .ok_or_else(|| WorkerError::Protocol(format!("no tokens read for unit {u}")))?;
        let start: usize = lengths[..u.segment].iter().sum();
        let len = lengths[u.segment];
        let ids: Vec<u32> = (0..batch)
            .flat_map(|b| {
                rows[b * span.len() + start + shift - span.start..][..len]
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

/// The document starts an activation brought (a peer's claim): there exactly when document
/// masks are on (`masks`), and then fitting a micro-batch of `batch` rows of `seq_len`
/// positions (sorted, from 0, below `seq_len`); the reason otherwise.
fn received_documents(
    docs: Option<Vec<Vec<usize>>>,
    masks: bool,
    batch: usize,
    seq_len: usize,
) -> Result<Option<DocStarts>, String> {
    match (docs, masks) {
        (None, false) => Ok(None),
        (Some(docs), true) => {
            ::model::documents::check_starts(&docs, batch, seq_len).map_err(|e| e.to_string())?;
            Ok(Some(DocStarts::new(docs)))
        }
        (None, true) => Err("no document starts, but data.document_mask is on".into()),
        (Some(_), false) => Err("document starts, but data.document_mask is off".into()),
    }
}

/// Unit `u`'s segment length (tokens per row) as its micro-batch was cut (0 if unknown).
fn unit_len(state: &ExecState, u: Unit) -> usize {
    state
        .lengths
        .get(&u.micro_batch)
        .and_then(|l| l.get(u.segment).copied())
        .unwrap_or(0)
}

/// The boundary tensor a communication action moves, on any chunk: its payload and unit (`None`
/// for compute actions).
pub(super) fn boundary(action: Action) -> Option<(Payload, Unit)> {
    match action.op() {
        Op::RecvActivation | Op::SendActivation => Some((Payload::Activation, action.unit())),
        Op::RecvGrad | Op::SendGrad => Some((Payload::Grad, action.unit())),
        Op::Forward | Op::Backward | Op::BackwardInput | Op::BackwardWeight => None,
    }
}

/// The evaluation schedule of a worker of `stages` holding `virtual_stages` chunks: every
/// chunk forwards all units in order, chunk after chunk, receiving from the virtual stage before
/// and sending to the one after (sends never wait, so no worker waits on a chunk its neighbour
/// has not reached).
fn forward_only_virtual(
    stages: usize,
    virtual_stages: usize,
    microbatches: usize,
    splits: usize,
) -> Result<Schedule, ScheduleError> {
    let flat = generate_forward_only(stages, microbatches, splits)?;
    let units: Vec<Unit> = flat.compute_actions(0).map(|a| a.unit()).collect();
    let last = stages * virtual_stages - 1;
    let actions = (0..stages)
        .map(|r| {
            let mut list = Vec::new();
            for c in 0..virtual_stages {
                let here = c * stages + r;
                for &u in &units {
                    if here > 0 {
                        list.push(Action::new(Op::RecvActivation, u, c));
                    }
                    list.push(Action::new(Op::Forward, u, c));
                    if here < last {
                        list.push(Action::new(Op::SendActivation, u, c));
                    }
                }
            }
            list
        })
        .collect();
    Ok(Schedule {
        kind: ScheduleKind::GPipe,
        virtual_stages,
        actions,
        ..flat
    })
}

/// The input of a unit's forward as the worker holds it.
enum Input {
    Tokens(Tensor),
    Boundary(Boundary),
}

/// The output of a unit's forward as the worker holds it.
enum Output {
    Boundary(Boundary),
    LossSum(f64),
}

/// A neighbour's TCP link and its stage index.
pub(super) struct Peer<'a> {
    pub(super) link: &'a mut TcpLink,
    pub(super) stage: usize,
}

/// Sends boundary tensor `b`, the `payload` of unit `u` in `step`, to a neighbour (for its
/// virtual stage `virtual_stage`, `None` without virtual stages), with its micro-batch's document
/// starts `docs` (an activation with document masks): its values over the TCP link, or its header
/// over TCP and its values (kept on its chunk's device) over that chunk's device link.
pub(super) fn send_on(
    to: Peer,
    stage: &mut Chunks,
    (step, payload, u, virtual_stage): (u64, Payload, Unit, Option<usize>),
    (b, docs): (&Boundary, Option<&[Vec<usize>]>),
    deadline: Instant,
) -> Result<(), WorkerError> {
    match b {
        Boundary::Host(t) => Ok(to
            .link
            .send_virtual(step, payload, u, virtual_stage, t, docs)?),
        Boundary::Device { rows, width, chunk } => {
            to.link
                .send_header(step, payload, u, virtual_stage, &[*rows, *width], docs)?;
            let links = device_links(stage, *chunk)?;
            match payload {
                Payload::Activation => links.send_activation(u, deadline),
                Payload::Grad => links.send_grad(u, deadline),
            }
            .map_err(|e| link_failure(format!("stage {}", to.stage), e))
        }
    }
}

/// The device links of local chunk `c` (`pipeline.transport = "nccl"`).
pub(super) fn device_links(
    stage: &mut Chunks,
    c: usize,
) -> Result<&mut dyn DeviceLinks, WorkerError> {
    let v = stage.len();
    if c >= v {
        return Err(no_chunk(c, v));
    }
    stage.device_links(c).ok_or_else(no_device_links)
}

/// Local chunk `c` of the worker's chunks to compute on.
fn chunk_mut(stage: &mut Chunks, c: usize) -> Result<&mut dyn StageCompute, WorkerError> {
    let v = stage.len();
    stage.chunk_mut(c).ok_or_else(|| no_chunk(c, v))
}

/// An action on a chunk the worker does not hold (a bug: schedules are validated against v).
fn no_chunk(c: usize, v: usize) -> WorkerError {
    WorkerError::Protocol(format!(
        "an action on chunk {c}, but this worker holds {v} chunk(s)"
    ))
}

fn no_device_links() -> WorkerError {
    WorkerError::Config(ConfigError::Invalid {
        key: "pipeline.transport",
        message: "\"nccl\" needs stages with device links (model.device = \"cuda\")".into(),
    })
}

/// A boundary tensor held on chunk `held`'s device where chunk `c` needs it (a bug: each chunk
/// receives and keeps its own).
fn elsewhere(held: usize, c: usize) -> WorkerError {
    WorkerError::Protocol(format!(
        "a boundary tensor on chunk {held}'s device where chunk {c} needs it (schedule out of \
         order)"
    ))
}

/// A tensor of one transport where the run uses the other (a bug: both sides follow the config).
fn not_linked() -> WorkerError {
    WorkerError::Protocol(
        "a boundary tensor on the host where pipeline.transport says device links, or the reverse"
            .into(),
    )
}

/// A device link's failure is the neighbour's, like a broken TCP link (so mid-step recovery
/// rebuilds it); any other failure is the stage's.
pub(super) fn link_failure(peer: String, e: ModelError) -> WorkerError {
    match e {
        ModelError::Link(why) => WorkerError::Transport(TransportError::Io {
            peer,
            source: std::io::Error::other(why),
        }),
        e => WorkerError::Model(e),
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

fn take(map: &mut HashMap<Slot, Boundary>, (c, u): Slot) -> Result<Boundary, WorkerError> {
    map.remove(&(c, u)).ok_or_else(|| {
        WorkerError::Protocol(format!(
            "no tensor for unit {u} on chunk {c} (schedule out of order)"
        ))
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
    fn received_document_starts_are_checked_against_the_run_and_the_micro_batch() {
        let good = vec![vec![0, 5], vec![0]];
        assert_eq!(received_documents(None, false, 2, 8), Ok(None));
        assert_eq!(
            received_documents(Some(good.clone()), true, 2, 8)
                .unwrap()
                .as_deref(),
            Some(&good)
        );
        let refused = |docs: Option<Vec<Vec<usize>>>, masks: bool| {
            received_documents(docs, masks, 2, 8).unwrap_err()
        };
        assert!(refused(None, true).contains("document_mask is on"));
        assert!(refused(Some(good.clone()), false).contains("document_mask is off"));
        assert!(refused(Some(vec![vec![0]]), true).contains("for 1 rows"));
        assert!(refused(Some(vec![vec![0, 8], vec![0]]), true).contains("past the sequence"));
        assert!(refused(Some(vec![vec![0, 3, 2], vec![0]]), true).contains("3 is followed by 2"));
        assert!(refused(Some(vec![vec![2], vec![0]]), true).contains("first start"));
    }

    #[test]
    fn the_evaluation_order_over_chunks_is_valid_and_forwards_every_unit_on_every_chunk() {
        for (p, v, m, k) in [(2, 2, 1, 1), (2, 3, 2, 2), (4, 2, 3, 4), (3, 2, 5, 1)] {
            let s = forward_only_virtual(p, v, m, k).unwrap();
            assert!(s.forward_only && s.virtual_stages == v);
            let s = ValidSchedule::new(s).unwrap_or_else(|e| panic!("p={p} v={v}: {e:?}"));
            for r in 0..p {
                let forwards: Vec<(usize, Unit)> = s
                    .get()
                    .compute_actions(r)
                    .map(|a| (a.chunk(), a.unit()))
                    .collect();
                assert_eq!(forwards.len(), v * m * k, "p={p} v={v} m={m} k={k}");
            }
        }
    }

    #[test]
    fn chunk_actions_name_their_boundary_tensor_too() {
        let u = Unit::new(1, 0);
        assert_eq!(
            boundary(Action::new(Op::SendActivation, u, 1)),
            Some((Payload::Activation, u))
        );
        assert_eq!(
            boundary(Action::new(Op::RecvGrad, u, 2)),
            Some((Payload::Grad, u))
        );
        assert_eq!(boundary(Action::new(Op::Forward, u, 1)), None);
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
