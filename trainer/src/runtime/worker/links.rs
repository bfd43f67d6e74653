//! The data links to the neighbouring stages: connecting to the next stage, accepting the previous
//! one on the data port, at start and again when a link is rebuilt. With device links
//! (`pipeline.transport = "nccl"`) each TCP link is followed by a device link to the same
//! neighbour: the earlier stage creates its ids and sends them as the TCP link's first frame, and
//! both join it; the TCP link's breaking aborts the device link's waits. With virtual stages the
//! links close a ring: the last worker's next link goes to the first worker (its chunk c feeds
//! the first worker's chunk c+1), and each chunk joins device links of its own to the chunks of
//! the virtual stages beside it, all over the one TCP link to each neighbouring worker.

use std::time::Duration;

use super::execute::{device_links, link, link_failure};
use super::{Worker, WorkerError, io_error, register, resolve};
use crate::model::{Neighbour, StageLayout};
use crate::runtime::auth::{self, Purpose};
use crate::runtime::control::Side;
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
        for side in join_order(self.linked(), self.index()) {
            match (side, &next) {
                (Side::Prev, _) if prev.is_some() => self.accept_prev(generation, timeout)?,
                (Side::Next, Some(next)) => self.connect_next(next, generation, timeout)?,
                _ => {}
            }
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

    /// With device links: joins the ones to `side`, whose TCP link was just made (the earlier
    /// stage creates the ids and sends them over it). A link joined earlier to that side (to a
    /// neighbour since lost) is aborted. Each chunk has its own device links: chunk c's link to
    /// the next virtual stage goes to the next worker's chunk c, or from the last worker to the
    /// first worker's chunk c+1 ([`device_link_chunks`]); both ends join them in chunk order.
    fn join_device_link(&mut self, side: Neighbour, timeout: Duration) -> Result<(), WorkerError> {
        if !self.linked() {
            return Ok(());
        }
        let (before, after) = self.neighbours();
        let peer = match side {
            Neighbour::Next => after,
            Neighbour::Prev => before,
        };
        let layouts = self.stage.layouts();
        for c in device_link_chunks(&layouts, side) {
            let tcp = match side {
                Neighbour::Next => link(&mut self.next, "next")?,
                Neighbour::Prev => link(&mut self.prev, "previous")?,
            };
            let links = device_links(&mut self.stage, c)?;
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
                .map_err(|e| link_failure(format!("stage {peer}"), e))?;
        }
        Ok(())
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

/// The order in which worker `r` joins its sides' links, at the start of a run and at a relink
/// alike (a replacement's start is a relink's other end). Joining a device link waits for the
/// peer to join it too. Every worker but the first joins its next side first; in a ring (virtual
/// stages) the first worker joins its previous side (the last worker's next) first, or each
/// would wait for the next one round the ring — with two workers, worker 0 and worker 1 (or
/// either's replacement) would each wait for the other. Over TCP alone nothing waits, and the
/// next side goes first.
pub(super) fn join_order(linked: bool, r: usize) -> [Side; 2] {
    if linked && r == 0 {
        [Side::Prev, Side::Next]
    } else {
        [Side::Next, Side::Prev]
    }
}

/// The local chunks (of a worker whose chunks have `layouts`, in chunk order) that have a device
/// link to `side`: every chunk but the first virtual stage's has one to the previous virtual
/// stage, every chunk but the last's one to the next. The neighbouring worker's chunks on the
/// other end, in chunk order, are the same number and pair up one by one: worker r's chunk c
/// with worker r+1's chunk c, and the last worker's chunk c with the first worker's chunk c+1.
fn device_link_chunks(layouts: &[StageLayout], side: Neighbour) -> Vec<usize> {
    layouts
        .iter()
        .enumerate()
        .filter(|(_, l)| match side {
            Neighbour::Prev => !l.is_first(),
            Neighbour::Next => !l.is_last(),
        })
        .map(|(c, _)| c)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;
    use crate::model::partition::partition_virtual_layers;

    /// Workers joining device links in `order` (worker → sides, in the order it joins them): a
    /// link completes when both of its ends have it next, as a device link's join waits for the
    /// peer's. Worker r's next link and worker r + 1's previous one (mod p) are one link; with
    /// chunks it carries a device link per chunk pair, joined in chunk order by both ends (see
    /// the test below), so it completes as one. Returns the joins left waiting.
    fn joins_left(p: usize, mut order: Vec<(usize, Vec<Side>)>) -> Vec<(usize, Vec<Side>)> {
        let link = |r: usize, side: Side| match side {
            Side::Next => r,
            Side::Prev => (r + p - 1) % p,
        };
        loop {
            let heads: Vec<(usize, usize)> = order
                .iter()
                .filter_map(|(r, sides)| sides.first().map(|&s| (*r, link(*r, s))))
                .collect();
            let done: Vec<usize> = heads
                .iter()
                .filter(|(r, l)| heads.iter().any(|(q, m)| q != r && m == l))
                .map(|&(r, _)| r)
                .collect();
            if done.is_empty() {
                order.retain(|(_, sides)| !sides.is_empty());
                return order;
            }
            for (r, sides) in &mut order {
                if done.contains(r) {
                    sides.remove(0);
                }
            }
        }
    }

    /// The workers' joins at the start of a ring of `p` over device links, or (`lost`) at a
    /// relink: the lost worker's replacement joins both sides, each neighbour the side to it (the
    /// one neighbour of two workers both), in [`join_order`].
    fn ring_joins(p: usize, lost: Option<usize>) -> Vec<(usize, Vec<Side>)> {
        (0..p)
            .map(|r| {
                let sides = join_order(true, r)
                    .into_iter()
                    .filter(|&s| match (lost, s) {
                        (None, _) => true,
                        (Some(l), _) if l == r => true,
                        (Some(l), Side::Next) => (r + 1) % p == l,
                        (Some(l), Side::Prev) => (l + 1) % p == r,
                    });
                (r, sides.collect())
            })
            .collect()
    }

    /// Over device links every worker's joins complete, at the start of a ring and at the relink
    /// of any lost worker's replacement, two workers (the survivor relinks both sides to one
    /// replacement) included; a ring whose workers all joined the next side first would not
    /// even start.
    #[test]
    fn device_link_joins_complete_at_the_start_and_at_every_relink() {
        for p in 2..=5 {
            assert_eq!(joins_left(p, ring_joins(p, None)), vec![], "start, p={p}");
            for lost in 0..p {
                let left = joins_left(p, ring_joins(p, Some(lost)));
                assert_eq!(left, vec![], "p={p}, worker {lost} replaced");
            }
            let next_first = (0..p).map(|r| (r, vec![Side::Next, Side::Prev])).collect();
            assert_eq!(joins_left(p, next_first).len(), p, "p={p}");
        }
        // Over TCP the order is the line's: the next side first (a connect does not wait).
        assert_eq!(join_order(false, 0), [Side::Next, Side::Prev]);
        assert_eq!(join_order(true, 1), [Side::Next, Side::Prev]);
    }

    /// Each worker's chunks with a link to a side pair up, in chunk order, with the chunks of the
    /// neighbouring worker that have a link back: the virtual stages s and s+1, for every s.
    #[test]
    fn the_chunks_device_links_pair_the_neighbouring_virtual_stages() {
        for (p, v) in [(2, 1), (3, 1), (2, 2), (3, 2), (2, 3), (4, 2)] {
            let model = ModelConfig {
                layers: p * v,
                ..ModelConfig::default()
            };
            let workers = partition_virtual_layers(&model, 16, p, v).unwrap();
            let mut pairs = Vec::new();
            for r in 0..p {
                let next = if v > 1 { (r + 1) % p } else { r + 1 };
                if next >= p {
                    continue;
                }
                let mine = device_link_chunks(&workers[r], Neighbour::Next);
                let theirs = device_link_chunks(&workers[next], Neighbour::Prev);
                assert_eq!(mine.len(), theirs.len(), "p={p} v={v} r={r}");
                for (a, b) in mine.into_iter().zip(theirs) {
                    let (s, t) = (workers[r][a].stage, workers[next][b].stage);
                    assert_eq!(s + 1, t, "p={p} v={v} r={r}: chunk {a} to chunk {b}");
                    pairs.push(s);
                }
            }
            pairs.sort_unstable();
            assert_eq!(pairs, (0..p * v - 1).collect::<Vec<_>>(), "p={p} v={v}");
        }
    }
}
