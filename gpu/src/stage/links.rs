//! Device links of a stage: NCCL links to the GPUs of its neighbouring stages, and the boundary
//! tensors that cross them without leaving the device.
//!
//! Each neighbour gets two links, one per direction (activations flow down the first, gradients
//! up the second), each on its own stream: on one, a send waiting for its receiver would hold up
//! a receive of the other direction queued behind it (the 1F1B deadlock). The earlier stage is
//! rank 0 of both.
//!
//! A received tensor waits in a buffer of the stage until its unit's forward or backward copies it
//! in (on the device). A unit's output, or its input's gradient, is copied into a buffer that is
//! *kept* until [`GpuStage::release_boundaries`] (the start of the next step): sends read it, and a
//! link rebuilt to a replacement of a lost neighbour in the middle of the step sends it again from
//! there. So a send never waits for its receiver on the host, and the compute never waits for a
//! transfer: it only reads buffers whose receive has completed and writes none that a send
//! still reads.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::{GpuStage, order};
use crate::device::{Buf, Gpu};
use crate::error::Result;
use crate::nccl::{Abort, LinkId, NcclLink};

/// Which neighbour a device link goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The previous stage (activations come from it, gradients go to it).
    Prev,
    /// The next stage.
    Next,
}

/// Which way a boundary tensor flows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Flow {
    Activation,
    Grad,
}

/// A boundary tensor on the device: `n` values in `buf`.
pub(super) struct Held {
    pub(super) buf: Buf<f32>,
    pub(super) n: usize,
}

/// A unit's boundary tensor of one flow.
type Key = (Flow, (usize, usize));

/// The links to a neighbour: `[activations, gradients]`.
type Pair = [NcclLink; 2];

/// The device links of a stage and their boundary tensors.
#[derive(Default)]
pub(super) struct Links {
    prev: Option<Pair>,
    next: Option<Pair>,
    /// Received, not yet read by their unit.
    inbound: HashMap<Key, Held>,
    /// Outputs kept for sending (again), until the next release.
    outbound: HashMap<Key, Held>,
    /// Buffers free for reuse.
    spare: Vec<Buf<f32>>,
}

impl Links {
    /// Whether a device link to `side` was joined (it may have been aborted since).
    pub(super) fn linked(&self, side: Side) -> bool {
        match side {
            Side::Prev => self.prev.is_some(),
            Side::Next => self.next.is_some(),
        }
    }

    /// Bytes of the boundary buffers held.
    pub(super) fn bytes(&self) -> usize {
        let held = self.inbound.values().chain(self.outbound.values());
        4 * (held.map(|h| h.buf.len()).sum::<usize>()
            + self.spare.iter().map(Buf::len).sum::<usize>())
    }

    /// Values received for `unit`'s `flow`.
    pub(super) fn received_len(
        &self,
        flow: Flow,
        unit: (usize, usize),
        op: &'static str,
    ) -> Result<usize> {
        self.inbound
            .get(&(flow, unit))
            .map(|h| h.n)
            .ok_or_else(|| not_received(flow, unit, op))
    }

    /// Takes what was received for `unit`'s `flow` (give the buffer back once the compute that
    /// reads it is queued).
    pub(super) fn take_received(
        &mut self,
        flow: Flow,
        unit: (usize, usize),
        op: &'static str,
    ) -> Result<Held> {
        self.inbound
            .remove(&(flow, unit))
            .ok_or_else(|| not_received(flow, unit, op))
    }

    /// Returns a buffer for reuse (a later receive into it starts after the compute queued so
    /// far: see [`NcclLink::recv`]).
    pub(super) fn give_back(&mut self, held: Held) {
        self.spare.push(held.buf);
    }

    /// Copies `n` values at `src` (on the compute stream) into a kept buffer for `unit`'s `flow`.
    pub(super) fn keep(
        &mut self,
        gpu: &Gpu,
        flow: Flow,
        unit: (usize, usize),
        src: u64,
        n: usize,
    ) -> Result<()> {
        let buf = self.take_spare(gpu, n)?;
        if let Err(e) = gpu.copy_values(buf.ptr(), src, n) {
            self.spare.push(buf);
            return Err(e);
        }
        if let Some(old) = self.outbound.insert((flow, unit), Held { buf, n }) {
            // Computed again (a replayed unit): the earlier copy's sends were released or never
            // made, so its buffer is free.
            self.spare.push(old.buf);
        }
        Ok(())
    }

    /// A free buffer of at least `n` values.
    fn take_spare(&mut self, gpu: &Gpu, n: usize) -> Result<Buf<f32>> {
        match self.spare.iter().position(|b| b.len() >= n) {
            Some(i) => Ok(self.spare.swap_remove(i)),
            None => gpu.zeros(n),
        }
    }

    fn pair(&mut self, side: Side, op: &'static str) -> Result<&mut Pair> {
        let pair = match side {
            Side::Prev => self.prev.as_mut(),
            Side::Next => self.next.as_mut(),
        };
        pair.ok_or_else(|| {
            order(
                op,
                format!("no device link to the {side:?} stage was joined"),
            )
        })
    }
}

fn not_received(flow: Flow, (mb, seg): (usize, usize), op: &'static str) -> crate::GpuError {
    order(
        op,
        format!("unit ({mb}, {seg}): no {flow:?} was received on the device link for it"),
    )
}

impl GpuStage {
    /// Joins the device link to `side` from its two ids (`[activations, gradients]`, created by
    /// the earlier stage), waiting at most `timeout` for the peer; an earlier link to that side is
    /// aborted first. `abort` ends any wait on the link (trip it when the peer is lost).
    pub fn join_link(
        &mut self,
        side: Side,
        ids: [LinkId; 2],
        timeout: Duration,
        abort: Abort,
    ) -> Result<()> {
        self.gpu.bind()?;
        self.leave_link(side);
        let rank = match side {
            Side::Next => 0,
            Side::Prev => 1,
        };
        let deadline = Instant::now() + timeout;
        let join = |id| {
            let left = deadline.saturating_duration_since(Instant::now());
            NcclLink::connect(&self.gpu, id, rank, left, abort.clone())
        };
        let pair = [join(ids[0])?, join(ids[1])?];
        match side {
            Side::Prev => self.links.prev = Some(pair),
            Side::Next => self.links.next = Some(pair),
        }
        self.reserve_state_staging()
    }

    /// Allocates now the pinned host buffers the state copies of a step need (the parameters and
    /// both AdamW moments, for a checkpoint and a peer snapshot in flight at once): allocating
    /// pinned memory during a step could stall behind a pending NCCL transfer.
    fn reserve_state_staging(&self) -> Result<()> {
        let state = [self.numel; 3];
        self.staging.reserve(&self.gpu, &state, 2)
    }

    /// Host staging buffers allocated so far for state copies (pre-allocated by
    /// [`GpuStage::join_link`]; a step with device links allocates none).
    pub fn staging_allocations(&self) -> usize {
        self.staging.allocations()
    }

    /// Aborts and drops the device link to `side` (if any).
    pub fn leave_link(&mut self, side: Side) {
        let _ = self.gpu.bind();
        match side {
            Side::Prev => self.links.prev = None,
            Side::Next => self.links.next = None,
        }
    }

    /// Whether a device link to `side` was joined.
    pub fn linked(&self, side: Side) -> bool {
        self.links.linked(side)
    }

    /// Receives unit `(micro_batch, segment)`'s `n` input values from the previous stage, waiting
    /// until they are on the device; its forward then takes [`super::UnitInput::Received`].
    pub fn receive_activation(
        &mut self,
        unit: (usize, usize),
        n: usize,
        deadline: Instant,
    ) -> Result<()> {
        self.receive(Side::Prev, Flow::Activation, unit, n, deadline)
    }

    /// Receives unit `(micro_batch, segment)`'s `n` output-gradient values from the next stage;
    /// its backward then is [`GpuStage::backward_received`].
    pub fn receive_grad(
        &mut self,
        unit: (usize, usize),
        n: usize,
        deadline: Instant,
    ) -> Result<()> {
        self.receive(Side::Next, Flow::Grad, unit, n, deadline)
    }

    /// Queues the send of unit `(micro_batch, segment)`'s kept output to the next stage.
    pub fn send_activation(&mut self, unit: (usize, usize), deadline: Instant) -> Result<()> {
        self.send(Side::Next, Flow::Activation, unit, deadline)
    }

    /// Queues the send of unit `(micro_batch, segment)`'s kept input gradient to the previous
    /// stage.
    pub fn send_grad(&mut self, unit: (usize, usize), deadline: Instant) -> Result<()> {
        self.send(Side::Prev, Flow::Grad, unit, deadline)
    }

    /// Waits for every send queued on the device links, then frees the kept boundary tensors and
    /// anything received and never read (the start of a step or an evaluation).
    pub fn release_boundaries(&mut self, deadline: Instant) -> Result<()> {
        self.gpu.bind()?;
        // A send runs on the link of its direction: activations to the next stage, gradients to
        // the previous one.
        if let Some(pair) = self.links.next.as_mut() {
            pair[0].wait(deadline)?;
        }
        if let Some(pair) = self.links.prev.as_mut() {
            pair[1].wait(deadline)?;
        }
        let links = &mut self.links;
        let held = links.outbound.drain().chain(links.inbound.drain());
        links.spare.extend(held.map(|(_, h)| h.buf));
        Ok(())
    }

    fn receive(
        &mut self,
        side: Side,
        flow: Flow,
        unit: (usize, usize),
        n: usize,
        deadline: Instant,
    ) -> Result<()> {
        const OP: &str = "GpuStage::receive";
        self.gpu.bind()?;
        let mut buf = self.links.take_spare(&self.gpu, n)?;
        let received = self.links.pair(side, OP).and_then(|pair| {
            let link = &mut pair[flow as usize];
            link.recv(&mut buf, n, deadline)
        });
        match received {
            Ok(()) => {
                if let Some(old) = self.links.inbound.insert((flow, unit), Held { buf, n }) {
                    self.links.spare.push(old.buf);
                }
                Ok(())
            }
            Err(e) => {
                self.links.spare.push(buf);
                Err(e)
            }
        }
    }

    fn send(
        &mut self,
        side: Side,
        flow: Flow,
        unit: (usize, usize),
        deadline: Instant,
    ) -> Result<()> {
        const OP: &str = "GpuStage::send";
        self.gpu.bind()?;
        let links = &mut self.links;
        let held = links.outbound.get(&(flow, unit)).ok_or_else(|| {
            order(
                OP,
                format!("unit {unit:?}: no {flow:?} is kept to send (forward or backward first)"),
            )
        })?;
        let pair = match side {
            Side::Prev => links.prev.as_mut(),
            Side::Next => links.next.as_mut(),
        }
        .ok_or_else(|| {
            order(
                OP,
                format!("no device link to the {side:?} stage was joined"),
            )
        })?;
        pair[flow as usize].send(&held.buf, held.n, deadline)
    }
}
