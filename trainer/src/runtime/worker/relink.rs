//! Mid-step recovery on the worker's side: when a link to a neighbour breaks, report it and wait
//! for the link to be rebuilt to the neighbour's replacement; then tell the replacement what this
//! stage has of its outputs and send again what this stage sent it. A replacement reads what its
//! neighbours have and skips those sends.
//!
//! What to tell, re-send and skip is the schedule's recovery model
//! ([`crate::schedule::resume_after_loss`]), one stage's part at a time:
//! [`neighbour_relink`] for a survivor, [`crate::schedule::Delivered`] for the replacement.

use tracing::{info, warn};

use std::time::Instant;

use super::execute::{Peer, boundary, link, send_on};
use super::{Worker, WorkerError, control_error};
use crate::runtime::control::{ControlStream, Side, ToLauncher, ToWorker};
use crate::runtime::transport::Payload;
use crate::schedule::{Action, Delivered, neighbour_relink};

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

    /// A link broke mid-step: report it with this stage's progress, and wait for the coordinator
    /// to rebuild it.
    fn await_relink(
        &mut self,
        control: &mut ControlStream,
        step: u64,
        side: Side,
        error: &str,
    ) -> Result<(), WorkerError> {
        let r = self.index();
        let peer = neighbour(r, side)?;
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
            } if s == side => self.relink(generation, side, addr),
            other => Err(WorkerError::Protocol(format!(
                "expected the relink of the {side:?} link, got {other:?}"
            ))),
        }
    }

    /// Rebuilds the link on `side` to a replacement stage: tells it which of its outputs this side
    /// already received, then sends again every tensor this side sent on the link in the step
    /// (both as [`neighbour_relink`] computes from this stage's progress).
    pub(super) fn relink(
        &mut self,
        generation: u64,
        side: Side,
        addr: Option<String>,
    ) -> Result<(), WorkerError> {
        let timeout = self.cfg.pipeline.timeout();
        let step = self.record.step;
        let r = self.index();
        let lost = neighbour(r, side)?;
        match side {
            Side::Prev => self.accept_prev(generation, timeout)?,
            Side::Next => {
                let addr = addr.ok_or_else(|| {
                    WorkerError::Protocol("a relink of the next link needs an address".into())
                })?;
                self.connect_next(&addr, generation, timeout)?;
            }
        }
        let plan = neighbour_relink(self.schedule.get(), r, lost, self.record.done_actions)?;
        let (link, received) = match side {
            Side::Prev => (link(&mut self.prev, "previous")?, Payload::Activation),
            Side::Next => (link(&mut self.next, "next")?, Payload::Grad),
        };
        link.send_have(step, received, &plan.have)?;
        let deadline = Instant::now() + timeout;
        for &action in &plan.resend {
            let (payload, u) = boundary(action).expect("re-sends are sends");
            let to = Peer { link, stage: lost };
            let (kept, docs) = self.record.retained(payload, u)?;
            send_on(
                to,
                &mut self.stage,
                // Mid-step recovery runs without virtual stages (one chunk per worker).
                (step, payload, u, None),
                (kept, docs.as_deref().map(Vec::as_slice)),
                deadline,
            )?;
        }
        info!(
            step,
            ?side,
            have = plan.have.len(),
            resent = plan.resend.len(),
            "relinked to a replacement stage"
        );
        Ok(())
    }

    /// A replacement of a lost stage, just linked: reads from each neighbour which of the lost
    /// stage's outputs it already has.
    pub(super) fn receive_delivered(&mut self) -> Result<Delivered, WorkerError> {
        let mut delivered = Delivered::default();
        if let Some(next) = &mut self.next {
            let (_, units) = next.recv_have(Payload::Activation)?;
            delivered.activations.extend(units);
        }
        if let Some(prev) = &mut self.prev {
            let (_, units) = prev.recv_have(Payload::Grad)?;
            delivered.grads.extend(units);
        }
        info!(
            outputs_the_neighbours_have = delivered.activations.len() + delivered.grads.len(),
            "replacing a lost stage mid-step"
        );
        Ok(delivered)
    }
}

/// The link a communication action uses.
fn broken_side(action: Action) -> Side {
    match action {
        Action::RecvActivation(_) | Action::SendGrad(_) => Side::Prev,
        _ => Side::Next,
    }
}

/// The actions done when the link broke on `action` at position `pc`: a send counts as done (its
/// tensor was kept), a receive does not.
fn done_after_break(action: Action, pc: usize) -> usize {
    match action {
        Action::SendActivation(_) | Action::SendGrad(_) => pc + 1,
        _ => pc,
    }
}

/// The stage on `side` of stage `r`.
fn neighbour(r: usize, side: Side) -> Result<usize, WorkerError> {
    match side {
        Side::Prev => r
            .checked_sub(1)
            .ok_or_else(|| WorkerError::Protocol("stage 0 has no previous link".into())),
        Side::Next => Ok(r + 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{ScheduleKind, Unit, generate};

    #[test]
    fn a_broken_link_is_the_side_the_action_talks_to() {
        let u = Unit::new(0, 0);
        assert_eq!(broken_side(Action::RecvActivation(u)), Side::Prev);
        assert_eq!(broken_side(Action::SendGrad(u)), Side::Prev);
        assert_eq!(broken_side(Action::SendActivation(u)), Side::Next);
        assert_eq!(broken_side(Action::RecvGrad(u)), Side::Next);
        assert_eq!(neighbour(2, Side::Prev).unwrap(), 1);
        assert_eq!(neighbour(2, Side::Next).unwrap(), 3);
        assert!(matches!(
            neighbour(0, Side::Prev),
            Err(WorkerError::Protocol(_))
        ));
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
                let lost = neighbour(r, side).unwrap();
                let done = done_after_break(action, pc);
                let plan = neighbour_relink(&s, r, lost, done).unwrap();
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
            activations: [u].into(),
            grads: [v].into(),
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
}
