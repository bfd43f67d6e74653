//! The data links to the neighbouring stages: connecting to the next stage, accepting the previous
//! one on the data port, at start and again when a link is rebuilt. With device links
//! (`pipeline.transport = "nccl"`) each TCP link is followed by a device link to the same
//! neighbour: the earlier stage creates its ids and sends them as the TCP link's first frame, and
//! both join it; the TCP link's breaking aborts the device link's waits. With virtual stages the
//! links close a ring: the last worker's next link goes to the first worker (its chunk c feeds
//! the first worker's chunk c+1).

use std::time::Duration;

use super::execute::{device_links, link, link_failure};
use super::{Worker, WorkerError, io_error, register, resolve};
use crate::model::Neighbour;
use crate::runtime::auth::{self, Purpose};
use crate::runtime::transport::{DataPort, TcpLink, TransportError, connect_retrying};

impl Worker {
    /// Connects to the next stage and accepts the previous stage's connection (the data port is
    /// kept for a relink). A replacement of a lost stage then reads what its neighbours already have.
    pub(super) fn connect(
        &mut self,
        data_port: DataPort,
        generation: u64,
        prev: Option<String>,
        next: Option<String>,
        replacement: bool,
    ) -> Result<(), WorkerError> {
        let timeout = self.cfg.pipeline.timeout();
        self.data_port = Some(data_port);
        if let Some(next) = next {
            self.connect_next(&next, generation, timeout)?;
        }
        if prev.is_some() {
            self.accept_prev(generation, timeout)?;
        }
        if replacement {
            self.replay_skip = self.receive_delivered()?;
        }
        Ok(())
    }

    pub(super) fn connect_next(
        &mut self,
        next: &str,
        generation: u64,
        timeout: Duration,
    ) -> Result<(), WorkerError> {
        let (_, after) = self.neighbours();
        let addr = resolve(next)?;
        // A neighbour that cannot be reached or authenticated is the neighbour's failure: this
        // worker stops as a healthy one (a transport error), so its node is not counted lost.
        let peer = format!("stage {after} at {next}");
        let link_err = |source| TransportError::Io {
            peer: peer.clone(),
            source,
        };
        let mut stream = connect_retrying(&addr, timeout).map_err(link_err)?;
        register(self.kill_switch.as_ref(), &stream)
            .map_err(io_error(format!("connecting to {peer}")))?;
        auth::connect(&mut stream, &self.token, Purpose::Data).map_err(link_err)?;
        self.next = Some(
            TcpLink::with_documents(
                stream,
                after,
                generation,
                timeout,
                self.max_tensor_bytes(),
                self.max_document_starts(),
            )
            .map_err(io_error("next-stage link".into()))?,
        );
        self.join_device_link(Neighbour::Next, timeout)
    }

    /// Takes the previous stage's connection from the data port (authenticated off this thread,
    /// see [`DataPort`]).
    pub(super) fn accept_prev(
        &mut self,
        generation: u64,
        timeout: Duration,
    ) -> Result<(), WorkerError> {
        let (before, _) = self.neighbours();
        let port = self
            .data_port
            .as_ref()
            .ok_or_else(|| WorkerError::Protocol("the data port is gone; cannot relink".into()))?;
        let stream = port.next(timeout).map_err(|source| TransportError::Io {
            peer: format!("stage {before} (waiting for it to connect)"),
            source,
        })?;
        register(self.kill_switch.as_ref(), &stream)
            .map_err(io_error(format!("waiting for stage {before} to connect")))?;
        self.prev = Some(
            TcpLink::with_documents(
                stream,
                before,
                generation,
                timeout,
                self.max_tensor_bytes(),
                self.max_document_starts(),
            )
            .map_err(io_error("previous-stage link".into()))?,
        );
        self.join_device_link(Neighbour::Prev, timeout)
    }

    /// With device links: joins the one to `side`, whose TCP link was just made (the earlier
    /// stage creates the ids and sends them over it). A link joined earlier to that side (to a
    /// neighbour since lost) is aborted.
    fn join_device_link(&mut self, side: Neighbour, timeout: Duration) -> Result<(), WorkerError> {
        if !self.linked() {
            return Ok(());
        }
        let (before, after) = self.neighbours();
        let (tcp, peer) = match side {
            Neighbour::Next => (link(&mut self.next, "next")?, after),
            Neighbour::Prev => (link(&mut self.prev, "previous")?, before),
        };
        let links = device_links(&mut self.stage)?;
        let ids = match side {
            Neighbour::Next => {
                let ids = links.new_link_ids()?;
                tcp.send_link_ids(&ids)?;
                ids
            }
            Neighbour::Prev => tcp.recv_link_ids()?,
        };
        links
            .join_link(side, ids, timeout, tcp.peer_gone())
            .map_err(|e| link_failure(format!("stage {peer}"), e))
    }

    /// The most document starts an activation's header may carry: one per position of the
    /// micro-batch's rows with document masks, none without.
    fn max_document_starts(&self) -> usize {
        let t = &self.cfg.train;
        if self.cfg.data.document_mask {
            t.micro_batch_size.saturating_mul(t.seq_len)
        } else {
            0
        }
    }

    /// The largest boundary tensor of the run (a micro-batch's hidden states over the whole
    /// sequence): the data links refuse larger frames.
    fn max_tensor_bytes(&self) -> u64 {
        let t = &self.cfg.train;
        [t.micro_batch_size, t.seq_len, self.cfg.model.d_model, 4]
            .iter()
            .try_fold(1u64, |acc, &n| acc.checked_mul(n as u64))
            .unwrap_or(u64::MAX)
    }
}
