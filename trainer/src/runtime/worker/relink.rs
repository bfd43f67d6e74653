//! Mid-step recovery on the worker's side: when a link to a neighbour breaks, report it and wait
//! for the link to be rebuilt to the neighbour's replacement; then tell the replacement what this
//! stage has of its outputs and send again what this stage sent it. A replacement reads what its
//! neighbours have and skips those sends.
//!
//! With virtual stages the workers form a ring (worker p−1's chunk c feeds worker 0's chunk
//! c+1), so worker 0 and worker p−1 are neighbours too; with two workers the one survivor is on
//! both sides of the lost worker and both of its links are rebuilt together. Outputs are named by
//! (the lost worker's chunk, unit), and the tensors kept for re-sending by (chunk, unit).
//!
//! Before it relinks, a survivor takes off the old links what the lost neighbour had sent it
//! (for receives further down its list: with two workers in a ring the survivor may have stopped
//! on one link while the lost worker's messages wait on the other) and holds them for those
//! receives ([`Worker::take_in_sent`]); it tells the replacement it has them. So the replacement
//! redoes exactly the units whose outputs the lost worker had sent, however far the survivor had
//! got in its own list when it saw the break.
//!
//! What to tell, re-send and skip is the schedule's recovery model
//! ([`crate::schedule::resume_after_loss`]), one stage's part at a time:
//! [`neighbour_relink`] for a survivor, [`crate::schedule::Delivered`] for the replacement.

use tracing::{info, warn};

use std::time::Instant;

use super::execute::{Peer, boundary, link, send_on};
use super::links::join_order;
use super::{Worker, WorkerError, control_error};
use crate::runtime::control::{ControlStream, Side, ToLauncher, ToWorker};
use crate::runtime::transport::{Payload, TransportError};
use crate::schedule::{Action, Delivered, Op, neighbour_relink};

/// How often a survivor waiting on one link looks at its other one (see
/// [`Worker::await_receive`]).
const WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_millis(20);

/// How long a survivor waits for the next message or the end of an old link to a lost worker
/// before it relinks (see [`Worker::take_in_sent`]). The lost worker is dead when the relink is
/// ordered, so its links end at once after what it sent; this only bounds a link whose far end
/// is still open (a node cut off the network), from which nothing more is taken.
const TAKE_IN_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// A `Relink` order: (link generation, side, address to connect to for `Next`).
type RelinkOrder = (u64, Side, Option<String>);

impl Worker {
    /// The link used by `action` (at position `pc` of this stage's list) broke: has it rebuilt to
    /// the neighbour's replacement and returns the position to go on from. A send the stage was
    /// stopped on counts as done: its tensor is kept and goes out again with the re-sends.
    pub(super) fn recover_link(
        &mut self,
        control: &mut ControlStream,
        step: u64,
        action: Action,
        pc: usize,
        error: &str,
    ) -> Result<usize, WorkerError> {
        let done = done_after_break(action, pc);
        self.record.done_actions = done;
        self.await_relink(control, step, broken_side(action), error)?;
        Ok(done)
    }

    /// With virtual stages, before the receive `action` at position `pc` of a training step:
    /// waits for its message while watching the worker's other link. In a ring a survivor next
    /// to a lost worker can wait on a healthy link for a message that depends, round the ring, on
    /// the lost worker's replacement — which cannot start until this survivor has relinked. So a
    /// survivor whose other link breaks while it waits relinks that one at once, with the actions
    /// before `pc` done (as one that finished its part of the step does), and waits on. Without
    /// virtual stages (a line), or without mid-step recovery, it returns at once.
    pub(super) fn await_receive(
        &mut self,
        control: &mut ControlStream,
        step: u64,
        action: Action,
        pc: usize,
    ) -> Result<(), WorkerError> {
        let receives = matches!(action.op(), Op::RecvActivation | Op::RecvGrad);
        if !receives
            || self.record.holds_ahead(action)
            || self.stage.len() < 2
            || !self.cfg.elastic.mid_step
            || self.cfg.pipeline.replicas > 1
        {
            return Ok(());
        }
        let side = broken_side(action);
        let other = match side {
            Side::Prev => Side::Next,
            Side::Next => Side::Prev,
        };
        // With two workers both links go to the same worker: a loss breaks the awaited one too.
        if self.neighbour(side)? == self.neighbour(other)? {
            return Ok(());
        }
        let timeout = self.cfg.pipeline.timeout();
        let mut deadline = Instant::now() + timeout;
        loop {
            let (awaited, watched) = match side {
                Side::Prev => (self.prev.as_mut(), self.next.as_ref()),
                Side::Next => (self.next.as_mut(), self.prev.as_ref()),
            };
            let broke = watched.is_some_and(|l| l.is_gone());
            let Some(awaited) = awaited else {
                return Ok(());
            };
            if broke {
                self.record.done_actions = pc;
                let error = "its connection closed while this stage waited on its other link";
                self.await_relink(control, step, other, error)?;
                deadline = Instant::now() + timeout;
                continue;
            }
            if awaited.wait_ready(WATCH_INTERVAL) {
                return Ok(());
            }
            // As the receive itself would have: the peer is silent (within the launcher's
            // longer timeout, so that this stage gives up first and names it).
            if Instant::now() >= deadline {
                return Err(awaited.timed_out().into());
            }
        }
    }

    /// A link broke mid-step: report it with this stage's progress, and wait for the coordinator
    /// to rebuild it (and, when the lost neighbour is on both sides, the other link too).
    fn await_relink(
        &mut self,
        control: &mut ControlStream,
        step: u64,
        side: Side,
        error: &str,
    ) -> Result<(), WorkerError> {
        let r = self.index();
        let peer = self.neighbour(side)?;
        warn!(step, peer, %error, "link to a neighbour broke mid-step; waiting for its replacement");
        let control_err = control_error("coordinator");
        control
            .send(&ToLauncher::LinkDown {
                stage: r,
                step,
                peer,
                error: error.to_string(),
                done_units: self.record.done_units,
            })
            .map_err(&control_err)?;
        match control.recv::<ToWorker>().map_err(&control_err)? {
            ToWorker::Relink {
                generation,
                side: s,
                addr,
            } if self.sides_to(peer).contains(&s) => self.relink(control, (generation, s, addr)),
            other => Err(WorkerError::Protocol(format!(
                "expected the relink of the {side:?} link, got {other:?}"
            ))),
        }
    }

    /// Rebuilds the links to a replacement of a neighbour, starting from the coordinator's order
    /// `first` (when the lost neighbour is on both sides — two workers in a ring — the order for
    /// the other link comes next on `control`): tells it which of its outputs this stage already
    /// received, then sends again every tensor this stage sent it in the step (both as
    /// [`neighbour_relink`] computes from this stage's progress), in their original order.
    pub(super) fn relink(
        &mut self,
        control: &mut ControlStream,
        first: RelinkOrder,
    ) -> Result<(), WorkerError> {
        let lost = self.neighbour(first.1)?;
        let sides = self.sides_to(lost);
        let mut orders = vec![first];
        while orders.len() < sides.len() {
            match control
                .recv::<ToWorker>()
                .map_err(control_error("coordinator"))?
            {
                ToWorker::Relink {
                    generation,
                    side,
                    addr,
                } if !orders.iter().any(|o| o.1 == side) => orders.push((generation, side, addr)),
                other => {
                    return Err(WorkerError::Protocol(format!(
                        "expected the relink of the other link to stage {lost}, got {other:?}"
                    )));
                }
            }
        }
        let step = self.record.step;
        self.take_in_sent(step, &sides);
        // In the order the start of a run joins them, as the replacement's `connect` does: with
        // two workers and device links, worker 0 accepts first, and the other connects first.
        let order = join_order(self.linked(), self.index());
        orders.sort_by_key(|o| order.iter().position(|&s| s == o.1));
        let timeout = self.cfg.pipeline.timeout();
        for (generation, side, addr) in orders.iter().cloned() {
            match side {
                Side::Prev => self.accept_prev(generation, timeout)?,
                Side::Next => {
                    let addr = addr.ok_or_else(|| {
                        WorkerError::Protocol("a relink of the next link needs an address".into())
                    })?;
                    self.connect_next(&addr, generation, timeout)?;
                }
            }
        }
        let r = self.index();
        let plan = neighbour_relink(
            self.schedule.get(),
            r,
            lost,
            self.record.done_actions,
            &self.record.held_ahead(),
        )?;
        for &(_, side, _) in &orders {
            match side {
                Side::Prev => link(&mut self.prev, "previous")?.send_have(
                    step,
                    Payload::Activation,
                    &plan.activations,
                )?,
                Side::Next => {
                    link(&mut self.next, "next")?.send_have(step, Payload::Grad, &plan.grads)?
                }
            }
        }
        let deadline = Instant::now() + timeout;
        for &action in &plan.resend {
            let (payload, u) = boundary(action).expect("re-sends are sends");
            let c = action.chunk();
            // The virtual stage the tensor is for: the next one for an activation, the previous
            // one for a gradient (named on the wire only with virtual stages).
            let here = self.virtual_stage(c);
            let (side, which, there) = match payload {
                Payload::Activation => (&mut self.next, "next", here + 1),
                Payload::Grad => (&mut self.prev, "previous", here.wrapping_sub(1)),
            };
            let there = (self.stage.len() > 1).then_some(there);
            let to = Peer {
                link: link(side, which)?,
                stage: lost,
            };
            let (kept, docs) = self.record.retained((payload, c, u))?;
            send_on(
                to,
                &mut self.stage,
                (step, payload, u, there),
                (kept, docs.as_deref().map(Vec::as_slice)),
                deadline,
            )?;
        }
        info!(
            step,
            lost,
            links = orders.len(),
            have = plan.activations.len() + plan.grads.len(),
            resent = plan.resend.len(),
            "relinked to a replacement stage"
        );
        Ok(())
    }

    /// Before the links on `sides` (to a lost worker) are rebuilt: takes off each, in order, the
    /// messages the lost worker had sent this stage for receives further down its list, and holds
    /// them for those receives ([`StepRecord::hold_ahead`]); [`neighbour_relink`] counts them as
    /// received. Each is read and checked as its receive would read it. Reading a link stops at
    /// its end, at a message that is not the next one expected (the lost worker's messages are
    /// input like any other: that one and the rest are dropped, and the replacement sends them
    /// again), or when nothing comes for [`TAKE_IN_WAIT`]. Over device links the values would
    /// come from the lost worker's device link, so nothing is taken in.
    ///
    /// [`StepRecord::hold_ahead`]: super::record::StepRecord::hold_ahead
    fn take_in_sent(&mut self, step: u64, sides: &[Side]) {
        if self.linked() {
            return;
        }
        for &side in sides {
            let op = match side {
                Side::Prev => Op::RecvActivation,
                Side::Next => Op::RecvGrad,
            };
            let expected: Vec<Action> = self.schedule.get().actions[self.index()]
                [self.record.done_actions..]
                .iter()
                .copied()
                .filter(|&a| a.op() == op && !self.record.holds_ahead(a))
                .collect();
            let mut taken = 0;
            for action in expected {
                let old = match side {
                    Side::Prev => self.prev.as_mut(),
                    Side::Next => self.next.as_mut(),
                };
                if !old.is_some_and(|l| l.wait_ready(TAKE_IN_WAIT)) {
                    break;
                }
                let (u, c) = (action.unit(), action.chunk());
                let message = match op {
                    Op::RecvActivation => self.receive_activation(step, u, c),
                    _ => self.receive_grad(step, u, c).map(|b| (b, None)),
                };
                match message {
                    Ok(m) => {
                        self.record.hold_ahead(action, m);
                        taken += 1;
                    }
                    // The end of the old link: everything the lost worker sent is in.
                    Err(WorkerError::Transport(TransportError::Io { .. })) => break,
                    Err(e) => {
                        let error = e.to_string();
                        warn!(
                            step,
                            %action,
                            %error,
                            "dropping the rest of what a lost neighbour sent (its replacement \
                             sends it again)"
                        );
                        break;
                    }
                }
            }
            if taken > 0 {
                info!(
                    step,
                    ?side,
                    taken,
                    "took in what the lost neighbour had sent before relinking"
                );
            }
        }
    }

    /// A replacement of a lost stage, just linked: reads from each neighbour which of the lost
    /// stage's outputs it already has, as (this worker's chunk, unit).
    pub(super) fn receive_delivered(&mut self) -> Result<Delivered, WorkerError> {
        let mut delivered = Delivered::default();
        let chunks = self.stage.len();
        if let Some(next) = &mut self.next {
            let (_, outputs) = next.recv_have(Payload::Activation, chunks)?;
            delivered.activations.extend(outputs);
        }
        if let Some(prev) = &mut self.prev {
            let (_, outputs) = prev.recv_have(Payload::Grad, chunks)?;
            delivered.grads.extend(outputs);
        }
        info!(
            outputs_the_neighbours_have = delivered.activations.len() + delivered.grads.len(),
            chunks, "replacing a lost stage mid-step"
        );
        Ok(delivered)
    }

    /// The worker on `side` of this one (a ring with virtual stages).
    fn neighbour(&self, side: Side) -> Result<usize, WorkerError> {
        neighbour(
            self.index(),
            self.cfg.pipeline.stages,
            self.stage.len() > 1,
            side,
        )
    }

    /// The sides of this worker linked to worker `peer`: one, or both for two workers in a ring.
    fn sides_to(&self, peer: usize) -> Vec<Side> {
        [Side::Prev, Side::Next]
            .into_iter()
            .filter(|&s| self.neighbour(s).ok() == Some(peer))
            .collect()
    }
}

/// The link a communication action uses.
fn broken_side(action: Action) -> Side {
    match action.op() {
        Op::RecvActivation | Op::SendGrad => Side::Prev,
        _ => Side::Next,
    }
}

/// The actions done when the link broke on `action` at position `pc`: a send counts as done (its
/// tensor was kept), a receive does not.
fn done_after_break(action: Action, pc: usize) -> usize {
    match action.op() {
        Op::SendActivation | Op::SendGrad => pc + 1,
        _ => pc,
    }
}

/// The worker on `side` of worker `r` of `p`: in a line, or a ring with virtual stages (`ring`).
fn neighbour(r: usize, p: usize, ring: bool, side: Side) -> Result<usize, WorkerError> {
    match (side, ring) {
        (Side::Prev, true) => Ok((r + p - 1) % p),
        (Side::Next, true) => Ok((r + 1) % p),
        (Side::Prev, false) => r
            .checked_sub(1)
            .ok_or_else(|| WorkerError::Protocol("stage 0 has no previous link".into())),
        (Side::Next, false) if r + 1 < p => Ok(r + 1),
        (Side::Next, false) => Err(WorkerError::Protocol(format!(
            "the last stage ({r}) has no next link"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{ScheduleKind, Unit, generate, generate_virtual};

    #[test]
    fn a_broken_link_is_the_side_the_action_talks_to() {
        let u = Unit::new(0, 0);
        assert_eq!(broken_side(Action::RecvActivation(u)), Side::Prev);
        assert_eq!(broken_side(Action::SendGrad(u)), Side::Prev);
        assert_eq!(broken_side(Action::SendActivation(u)), Side::Next);
        assert_eq!(broken_side(Action::RecvGrad(u)), Side::Next);
        assert_eq!(neighbour(2, 4, false, Side::Prev).unwrap(), 1);
        assert_eq!(neighbour(2, 4, false, Side::Next).unwrap(), 3);
        assert!(matches!(
            neighbour(0, 4, false, Side::Prev),
            Err(WorkerError::Protocol(_))
        ));
        assert!(matches!(
            neighbour(3, 4, false, Side::Next),
            Err(WorkerError::Protocol(_))
        ));
        // With virtual stages a ring: worker 0 and worker p − 1 are neighbours.
        assert_eq!(neighbour(0, 4, true, Side::Prev).unwrap(), 3);
        assert_eq!(neighbour(3, 4, true, Side::Next).unwrap(), 0);
        assert_eq!(neighbour(1, 2, true, Side::Prev).unwrap(), 0);
        assert_eq!(neighbour(1, 2, true, Side::Next).unwrap(), 0);
    }

    #[test]
    fn a_send_stopped_by_a_broken_link_counts_as_done_and_a_receive_does_not() {
        let u = Unit::new(1, 0);
        assert_eq!(done_after_break(Action::SendActivation(u), 4), 5);
        assert_eq!(done_after_break(Action::SendGrad(u), 4), 5);
        assert_eq!(done_after_break(Action::RecvActivation(u), 4), 4);
        assert_eq!(done_after_break(Action::RecvGrad(u), 4), 4);
    }

    /// What the worker re-sends after a relink is exactly what it retained on that link, in the
    /// order it sent it: every send to the lost neighbour in its done prefix, counting the send it
    /// was stopped on.
    #[test]
    fn a_survivor_resends_every_tensor_it_sent_the_lost_stage_including_the_one_stopped_on() {
        let s = generate(ScheduleKind::Seq1F1B, 3, 3, 2).unwrap();
        let r = 1;
        for (pc, &action) in s.actions[r].iter().enumerate() {
            for side in [Side::Prev, Side::Next] {
                if boundary(action).is_none() || broken_side(action) != side {
                    continue;
                }
                let lost = neighbour(r, 3, false, side).unwrap();
                let done = done_after_break(action, pc);
                let plan = neighbour_relink(&s, r, lost, done, &[]).unwrap();
                let on_link = |a: &&Action| match side {
                    Side::Prev => matches!(a, Action::SendGrad(_)),
                    Side::Next => matches!(a, Action::SendActivation(_)),
                };
                let sent: Vec<Action> = s.actions[r][..done]
                    .iter()
                    .filter(on_link)
                    .copied()
                    .collect();
                assert_eq!(plan.resend, sent, "broken at #{pc} {action}");
                if matches!(action, Action::SendActivation(_) | Action::SendGrad(_)) {
                    assert_eq!(plan.resend.last(), Some(&action));
                }
            }
        }
    }

    #[test]
    fn a_replacement_skips_what_the_neighbours_have_and_counts_its_redo() {
        let (u, v) = (Unit::new(0, 1), Unit::new(1, 0));
        let delivered = Delivered {
            activations: [(0, u)].into(),
            grads: [(0, v)].into(),
        };
        assert!(delivered.skips(Action::SendActivation(u)));
        assert!(!delivered.skips(Action::SendActivation(v)));
        assert!(delivered.skips(Action::SendGrad(v)));
        assert!(!delivered.skips(Action::SendGrad(u)));
        assert!(delivered.replays(Action::Forward(u)));
        assert!(delivered.replays(Action::Forward(v)));
        assert!(delivered.replays(Action::Backward(v)));
        assert!(!delivered.replays(Action::Backward(u)));
        assert!(!delivered.skips(Action::Forward(u)));
    }

    /// With chunks, what a neighbour has is per (chunk, unit): the same unit's output of another
    /// chunk is still sent and is not counted as redone.
    #[test]
    fn with_chunks_a_replacement_skips_and_replays_per_chunk() {
        let u = Unit::new(1, 1);
        let delivered = Delivered {
            activations: [(1, u)].into(),
            grads: [(0, u)].into(),
        };
        assert!(delivered.skips(Action::new(Op::SendActivation, u, 1)));
        assert!(!delivered.skips(Action::new(Op::SendActivation, u, 0)));
        assert!(delivered.skips(Action::new(Op::SendGrad, u, 0)));
        assert!(!delivered.skips(Action::new(Op::SendGrad, u, 1)));
        assert!(delivered.replays(Action::new(Op::Forward, u, 1)));
        assert!(delivered.replays(Action::new(Op::Backward, u, 0)));
        assert!(!delivered.replays(Action::new(Op::Backward, u, 1)));
    }

    /// Two workers in a ring: the survivor is on both sides of the lost worker, so it tells both
    /// what it received (activations from the lost worker's chunks on its previous link, input
    /// gradients on its next) and re-sends everything it sent on either link, in its own order;
    /// a received tensor is named by the lost worker's chunk that sent it.
    #[test]
    fn two_workers_in_a_ring_relink_both_links_and_name_the_lost_chunks() {
        let s = generate_virtual(ScheduleKind::Seq1F1BInterleaved, 2, 2, 2, 2).unwrap();
        let (r, lost) = (1, 0);
        let list = &s.actions[r];
        let done = list.len();
        let plan = neighbour_relink(&s, r, lost, done, &[]).unwrap();
        // Worker 1's chunk c receives activations from virtual stage 2c (worker 0's chunk c) and
        // gradients from virtual stage 2c + 2 (worker 0's chunk c + 1).
        let received = |op: Op, delta: usize| -> Vec<(usize, Unit)> {
            list.iter()
                .filter(|a| a.op() == op)
                .map(|a| (a.chunk() + delta, a.unit()))
                .collect()
        };
        assert_eq!(plan.activations, received(Op::RecvActivation, 0));
        assert_eq!(plan.grads, received(Op::RecvGrad, 1));
        assert!(!plan.activations.is_empty() && !plan.grads.is_empty());
        let sent: Vec<Action> = list
            .iter()
            .copied()
            .filter(|a| matches!(a.op(), Op::SendActivation | Op::SendGrad))
            .collect();
        assert_eq!(plan.resend, sent);
        // Worker 0 is before worker 1 (its chunk 0 feeds worker 1's chunk 0) and after it (worker
        // 1's chunk 0 feeds worker 0's chunk 1).
        let mut sides = [Side::Prev, Side::Next]
            .into_iter()
            .filter(|&side| neighbour(r, 2, true, side).unwrap() == lost);
        assert_eq!(sides.next(), Some(Side::Prev));
        assert_eq!(sides.next(), Some(Side::Next));
    }
}
