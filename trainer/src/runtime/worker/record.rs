//! What a worker did in the current training step: how far it got in its action list, the
//! boundary tensors it sent (kept until the step's update, so a replacement of a neighbour can
//! have them again) and what the step cost.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use super::WorkerError;
use super::boundary::{Boundary, DocStarts};
use crate::runtime::control::{StepCost, UnitTime};
use crate::runtime::transport::Payload;
use crate::schedule::{Action, Delivered, Unit};

/// What a worker did in the current training step. A replacement also knows which of its outputs
/// the neighbours already have.
#[derive(Default)]
pub(super) struct StepRecord {
    pub(super) step: u64,
    /// How many actions of the stage's list have completed (a send the stage was stopped on by a
    /// broken link counts: its tensor is kept and goes out again on the rebuilt link).
    pub(super) done_actions: usize,
    /// The boundary tensors sent in the step (on the host, or kept on the stage's device), with
    /// the document starts an activation carried, by (payload, sending chunk, unit).
    retained: HashMap<(Payload, usize, Unit), (Boundary, Option<DocStarts>)>,
    /// Forward and backward units computed in the step.
    pub(super) done_units: usize,
    pub(super) cost: StepCost,
    /// A replacement's first step: what the neighbours already have of its outputs.
    pub(super) delivered: Delivered,
    /// A replacement's first step: the compute actions of its list that the lost worker had done,
    /// as the neighbours prove ([`Delivered::replayed`]): counted as redone.
    replayed: HashSet<Action>,
    /// Messages a lost neighbour had sent this worker on a link that was then rebuilt, taken off
    /// the old link before the relink, ahead of the receive actions that use them (by action),
    /// with the document starts an activation carried (see `relink.rs`).
    ahead: HashMap<Action, (Boundary, Option<DocStarts>)>,
    /// When tracing: the step's start on the monotonic clock and on the wall clock (Unix µs), so
    /// units are placed on the wall clock without ever overlapping.
    pub(super) trace_epoch: Option<(Instant, u64)>,
}

impl StepRecord {
    /// The record of a new step of the action list `list`; `delivered` is what a replacement's
    /// neighbours already have, and `trace_epoch` is set when the step's units are traced.
    pub(super) fn new(
        step: u64,
        list: &[Action],
        delivered: Delivered,
        trace_epoch: Option<(Instant, u64)>,
    ) -> Self {
        Self {
            step,
            replayed: delivered.replayed(list).into_iter().collect(),
            delivered,
            trace_epoch,
            ..Self::default()
        }
    }

    /// Whether the compute action `a` redoes work the lost worker this one replaces had done.
    pub(super) fn redoes(&self, a: Action) -> bool {
        self.replayed.contains(&a)
    }

    /// Keeps a boundary tensor that chunk `c` sent in the step (and the document starts it
    /// carried).
    pub(super) fn retain(
        &mut self,
        (payload, c, u): (Payload, usize, Unit),
        b: &Boundary,
        docs: Option<&DocStarts>,
    ) {
        self.cost.retained_bytes += b.bytes() as u64;
        self.retained
            .insert((payload, c, u), (b.clone(), docs.cloned()));
    }

    /// A boundary tensor kept by [`StepRecord::retain`], and its document starts.
    pub(super) fn retained(
        &self,
        (payload, c, u): (Payload, usize, Unit),
    ) -> Result<&(Boundary, Option<DocStarts>), WorkerError> {
        self.retained.get(&(payload, c, u)).ok_or_else(|| {
            WorkerError::Protocol(format!(
                "no {payload:?} of unit {u} on chunk {c} was kept in step {} to send again",
                self.step
            ))
        })
    }

    /// Keeps the message of the receive `action`, taken off a link before its turn.
    pub(super) fn hold_ahead(&mut self, action: Action, message: (Boundary, Option<DocStarts>)) {
        self.ahead.insert(action, message);
    }

    /// The message of the receive `action` if it was taken in ahead of its turn (it is handed
    /// over once).
    pub(super) fn take_ahead(&mut self, action: Action) -> Option<(Boundary, Option<DocStarts>)> {
        self.ahead.remove(&action)
    }

    /// Whether the message of the receive `action` is held, taken in ahead of its turn.
    pub(super) fn holds_ahead(&self, action: Action) -> bool {
        self.ahead.contains_key(&action)
    }

    /// The receive actions whose messages are held, taken in ahead of their turn.
    pub(super) fn held_ahead(&self) -> Vec<Action> {
        self.ahead.keys().copied().collect()
    }

    /// Counts a forward or backward unit of `len` tokens per row that started at `started` and
    /// just ended.
    pub(super) fn computed(
        &mut self,
        action: Action,
        started: UnitStart,
        redone: bool,
        len: usize,
    ) {
        let elapsed = started.wall.elapsed();
        let seconds = elapsed.as_secs_f64();
        let cpu = process_cpu_time().saturating_sub(started.cpu);
        self.cost.compute_cpu_s += cpu.as_secs_f64();
        if let Some((epoch, epoch_us)) = self.trace_epoch {
            self.cost.unit_times.push(UnitTime {
                action,
                start_us: epoch_us
                    + started.wall.saturating_duration_since(epoch).as_micros() as u64,
                dur_us: elapsed.as_micros() as u64,
                cpu_us: cpu.as_micros() as u64,
                redone,
                len,
            });
        }
        self.done_units += 1;
        self.cost.units += 1;
        self.cost.compute_s += seconds;
        if redone {
            self.cost.redone_units += 1;
            self.cost.redone_s += seconds;
        }
    }
}

/// When a unit started: on the monotonic clock and in the process's CPU time.
#[derive(Clone, Copy)]
pub(super) struct UnitStart {
    wall: Instant,
    cpu: Duration,
}

impl UnitStart {
    pub(super) fn now() -> Self {
        Self {
            wall: Instant::now(),
            cpu: process_cpu_time(),
        }
    }
}

/// CPU time used by this process so far, all threads (`CLOCK_PROCESS_CPUTIME_ID`). A worker
/// computes on one thread (plus its rayon pool), so across a unit it is the unit's compute time
/// without the time the process waited for a core.
fn process_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, exclusively borrowed timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}
