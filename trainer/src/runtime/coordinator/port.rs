//! The coordinator's control port: accepting and authenticating connections (off the training
//! thread), what agents and workers say on them (joins, heartbeats, worker exits, snapshots held,
//! leaves), fencing nodes declared dead, and handing the current pipeline what concerns it
//! ([`Incoming`]). Everything a peer sends is checked here before it reaches the membership.

use std::io::BufReader;
use std::net::{TcpListener, TcpStream};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use elastic::{NodeId, NodeStatus};
use tracing::{info, warn};

use super::super::auth::{self, Gate, Purpose};
use super::super::control::{ControlSender, FromAgent, Opening, ToAgent, ToLauncher};
use super::super::error::{LaunchError, LossCause, Lost};
use super::super::peer_input;
use super::super::recovery;
use super::super::wire::{Limits, read_frame};
use super::{Coordinator, Incoming, decide};

/// What arrived on the control port.
pub(super) enum Event {
    /// A connection passed the job-token check and said who it is.
    Opened(u64, Opening, ControlSender),
    /// A message from an agent.
    Agent(u64, FromAgent),
    /// A message from a worker.
    Worker(u64, ToLauncher),
    /// A connection closed (or sent garbage).
    Closed(u64, String),
}

impl Coordinator {
    pub(super) fn unexpected(&mut self, incoming: Incoming) {
        match incoming {
            Incoming::Hello(conn, msg) | Incoming::Worker(conn, msg) => {
                warn!(
                    conn,
                    ?msg,
                    "refused a message from a worker of no current pipeline"
                );
                self.workers.remove(&conn);
            }
            _ => {}
        }
    }

    /// After the pipeline failed to start: reads what arrives until nothing has for `quiet` (at
    /// most `grace`), so that [`Coordinator::losses`] knows of the agents that died with the
    /// failure and of the worker exits their agents report; returns the nodes reported lost
    /// meanwhile.
    pub(in crate::runtime) fn gather_failure_reports(
        &mut self,
        quiet: Duration,
        grace: Duration,
    ) -> Vec<Lost> {
        let deadline = Instant::now() + grace;
        let mut quiet_since = Instant::now();
        let mut lost = Vec::new();
        while Instant::now() < deadline && quiet_since.elapsed() < quiet {
            match self.poll(Instant::now() + Duration::from_millis(5)) {
                Ok(Some(Incoming::NodeLost(node, reason, cause))) => {
                    quiet_since = Instant::now();
                    lost.push(Lost {
                        node,
                        reason,
                        cause,
                        agent_alive: false,
                    });
                }
                Ok(Some(incoming)) => {
                    quiet_since = Instant::now();
                    self.unexpected(incoming);
                }
                Ok(None) => {}
                Err(_) => break,
            }
        }
        lost
    }

    /// The next event of interest to the pipeline, handling agent bookkeeping (joins, heartbeats,
    /// leaves) on the way; `None` at `deadline`. Heartbeat expiry is checked on every call.
    pub(in crate::runtime) fn poll(
        &mut self,
        deadline: Instant,
    ) -> Result<Option<Incoming>, LaunchError> {
        loop {
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(50));
            match self.events.recv_timeout(wait) {
                Ok(event) => {
                    if let Some(incoming) = self.handle(event) {
                        return Ok(Some(incoming));
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    // Every queued heartbeat is counted by now: silence is real.
                    if let Some(lost) = self.expire_silent_nodes() {
                        return Ok(Some(lost));
                    }
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(LaunchError::Protocol(
                        "the coordinator's listener stopped".into(),
                    ));
                }
            }
        }
    }

    pub(super) fn expire_silent_nodes(&mut self) -> Option<Incoming> {
        let now = Instant::now();
        let checked = self.detector.check(now, &mut self.state.membership);
        if !checked.stalled.is_zero() {
            warn!(
                stalled_s = checked.stalled.as_secs_f64(),
                "the coordinator itself was not running (a stalled process or machine); that time does not count as the nodes' silence"
            );
        }
        let mut first = None;
        for node in checked.dead {
            let reason = self.fence(&node, now);
            warn!(%node, %reason, "node declared dead");
            if first.is_none() && self.in_plan(&node) {
                first = Some(Incoming::NodeLost(node, reason, LossCause::Silent));
            }
        }
        first
    }

    pub(super) fn in_plan(&self, node: &NodeId) -> bool {
        self.state
            .current
            .as_ref()
            .is_some_and(|p| p.contains(node))
    }

    /// A dead node's agent connection is closed with a refusal: whatever it still sends is ignored
    /// until it joins again. Returns the reason it was declared dead.
    pub(super) fn fence(&mut self, node: &NodeId, now: Instant) -> String {
        self.record_lost_incarnation(node);
        let reason = match self.state.membership.status(node) {
            Some(NodeStatus::Dead { reason }) => reason.clone(),
            _ => "declared dead".to_string(),
        };
        let _ = self.state.membership.report_failure(node, &reason, now);
        let conns: Vec<u64> = self
            .agents
            .iter()
            .filter(|(_, (n, _))| n == node)
            .map(|(c, _)| *c)
            .collect();
        for conn in conns {
            if let Some((_, sender)) = self.agents.remove(&conn) {
                sender.send_and_close(&ToAgent::Refused {
                    reason: reason.clone(),
                });
            }
        }
        reason
    }

    pub(super) fn handle(&mut self, event: Event) -> Option<Incoming> {
        let now = Instant::now();
        match event {
            Event::Opened(conn, Opening::Agent(FromAgent::Join { node, pid }), sender) => {
                self.join(conn, node, pid, sender, now)
            }
            Event::Opened(conn, Opening::Worker(hello), sender) => {
                self.workers.insert(conn, sender);
                Some(Incoming::Hello(conn, hello))
            }
            Event::Opened(conn, Opening::Agent(other), sender) => {
                warn!(
                    conn,
                    ?other,
                    "refused an agent connection that did not start with a join"
                );
                sender.send_and_close(&ToAgent::Refused {
                    reason: "a connection must start with a join".into(),
                });
                None
            }
            Event::Agent(conn, msg) => self.agent_message(conn, msg, now),
            Event::Worker(conn, msg) => {
                if self.workers.contains_key(&conn) {
                    Some(Incoming::Worker(conn, msg))
                } else {
                    None
                }
            }
            Event::Closed(conn, reason) => self.closed(conn, reason),
        }
    }

    /// An agent asks to join: its node description is checked, an older incarnation's
    /// connection is refused, and the membership records it. A node of the plan that joins again
    /// (its agent restarted) is lost to the running pipeline.
    pub(super) fn join(
        &mut self,
        conn: u64,
        node: elastic::NodeInfo,
        pid: u32,
        sender: ControlSender,
        now: Instant,
    ) -> Option<Incoming> {
        if let Err(e) = check_join(&node) {
            warn!(conn, error = %e, "refused a join with a bad node description");
            sender.send_and_close(&ToAgent::Refused {
                reason: e.to_string(),
            });
            return None;
        }
        let id = node.id.clone();
        self.record_lost_incarnation(&id);
        // A new incarnation replaces the old one's connection.
        let old: Vec<u64> = self
            .agents
            .iter()
            .filter(|(_, (n, _))| *n == id)
            .map(|(c, _)| *c)
            .collect();
        for c in old {
            if let Some((_, sender)) = self.agents.remove(&c) {
                sender.send_and_close(&ToAgent::Refused {
                    reason: "a newer incarnation of this node joined".into(),
                });
            }
        }
        match self.state.membership.join(node, now) {
            Ok(incarnation) => {
                info!(node = %id, incarnation, pid, "node joined");
                // The copies an earlier incarnation reported may be gone with its process:
                // recovery counts only what this one reports (an agent that joins again
                // reports everything it still holds right after its welcome).
                recovery::forget_node(&mut self.held, &id);
                let _ = sender.send(&ToAgent::Welcome {
                    incarnation,
                    heartbeat_s: self.cfg.elastic.heartbeat_s,
                });
                self.agents.insert(conn, (id.clone(), sender));
                if incarnation > 1 && self.in_plan(&id) {
                    return Some(Incoming::NodeLost(
                        id.clone(),
                        format!(
                            "its agent restarted and joined again as incarnation {incarnation}"
                        ),
                        LossCause::AgentRestarted,
                    ));
                }
            }
            Err(e) => {
                warn!(node = %id, error = %e, "refused a join");
                sender.send_and_close(&ToAgent::Refused {
                    reason: e.to_string(),
                });
            }
        }
        None
    }

    /// A message from a joined agent: heartbeats, leaves, worker exits and snapshots held update
    /// the membership and the coordinator's records; a worker exit of the current generation is
    /// the pipeline's business.
    pub(super) fn agent_message(
        &mut self,
        conn: u64,
        msg: FromAgent,
        now: Instant,
    ) -> Option<Incoming> {
        let Some((node, _)) = self.agents.get(&conn).cloned() else {
            warn!(conn, ?msg, "refused a message from a fenced agent");
            return None;
        };
        match msg {
            FromAgent::Heartbeat => {
                self.heartbeat(conn, &node, now);
                None
            }
            FromAgent::Leaving { notice } => {
                self.leaving(&node, notice, now);
                None
            }
            FromAgent::WorkerExited {
                generation,
                stage,
                launch,
                code,
                status,
                log_tail,
                log,
            } => {
                if !self
                    .state
                    .current
                    .as_ref()
                    .is_some_and(|p| p.admits(generation))
                {
                    return None;
                }
                if !decide::exit_is_current(&self.launches, stage, launch) {
                    info!(%node, stage, launch, %status, "ignored the exit of a worker since replaced");
                    return None;
                }
                self.exits.insert(stage, code);
                Some(Incoming::WorkerExited {
                    stage,
                    status,
                    log,
                    log_tail,
                })
            }
            FromAgent::WorkersStopped { .. } => None,
            FromAgent::CannotStart {
                generation,
                stages,
                error,
            } => {
                let current = self.state.current.as_ref();
                if !current.is_some_and(|p| p.admits(generation)) {
                    return None;
                }
                warn!(%node, ?stages, %error, "the node cannot run its stages");
                Some(Incoming::CannotStart {
                    node,
                    stages,
                    error,
                })
            }
            FromAgent::SnapshotHeld { step, names } => {
                self.held
                    .entry(step)
                    .or_default()
                    .entry(node)
                    .or_default()
                    .extend(names);
                while self.held.len() > 3 {
                    self.held.pop_first();
                }
                None
            }
            FromAgent::Join { .. } => {
                warn!(%node, "ignored a second join on one connection");
                None
            }
        }
    }

    /// A heartbeat of `node` on connection `conn`; a node the membership refuses (dead) has its
    /// connection closed with the refusal, so that its agent joins again rather than heartbeat
    /// into the void.
    fn heartbeat(&mut self, conn: u64, node: &NodeId, now: Instant) {
        if let Err(e) = self.state.membership.heartbeat(node, now) {
            warn!(%node, error = %e, "refused a heartbeat; fencing the connection");
            if let Some((_, sender)) = self.agents.remove(&conn) {
                sender.send_and_close(&ToAgent::Refused {
                    reason: e.to_string(),
                });
            }
        }
    }

    /// `node` leaves at the next step boundary, with the cloud's preemption notice if it sent a
    /// well-formed one (a malformed one is logged and dropped).
    fn leaving(
        &mut self,
        node: &NodeId,
        notice: Option<elastic::preemption::Notice>,
        now: Instant,
    ) {
        let notice = notice.filter(|n| match n.check() {
            Ok(()) => true,
            Err(e) => {
                warn!(%node, error = %e, "a leaving agent sent a malformed cloud notice");
                false
            }
        });
        let reason = elastic::preemption::leave_reason(notice.as_ref());
        info!(%node, %reason, "the node leaves at the next step boundary");
        if let Some(notice) = notice {
            self.notices.insert(node.clone(), notice);
        }
        let _ = self.state.membership.leave(node, now);
    }

    pub(super) fn closed(&mut self, conn: u64, reason: String) -> Option<Incoming> {
        if self.workers.remove(&conn).is_some() {
            return Some(Incoming::WorkerClosed(conn, reason));
        }
        let (node, _) = self.agents.remove(&conn)?;
        self.record_lost_incarnation(&node);
        let reason = format!("its agent's connection closed ({reason})");
        let _ = self
            .state
            .membership
            .report_failure(&node, &reason, Instant::now());
        warn!(%node, %reason, "node lost");
        self.in_plan(&node).then_some(Incoming::NodeLost(
            node,
            reason,
            LossCause::AgentDisconnected,
        ))
    }

    /// Records the node's current incarnation as lost, unless an earlier one of the same failure
    /// already is (the first loss is the one the pipeline failed on).
    pub(super) fn record_lost_incarnation(&mut self, node: &NodeId) {
        if let Some(m) = self.state.membership.get(node) {
            self.lost_incarnations
                .entry(node.clone())
                .or_insert(m.incarnation);
        }
    }

    /// Connections of agents whose node is dead (it left, or was declared dead).
    pub(super) fn stale_agents(&self) -> Vec<u64> {
        self.agents
            .iter()
            .filter(|(_, (n, _))| {
                self.state
                    .membership
                    .status(n)
                    .is_none_or(NodeStatus::is_dead)
            })
            .map(|(c, _)| *c)
            .collect()
    }
}

/// Most stage workers one node may offer.
const MAX_SLOTS: usize = 1024;

/// Checks a joining node's description (a peer's claims): its name appears in logs, events and
/// the plan, its address is handed to workers to connect to.
pub(super) fn check_join(node: &elastic::NodeInfo) -> Result<(), peer_input::BadInput> {
    peer_input::path_component("node name", &node.id.0)?;
    peer_input::address("node address", &node.addr)?;
    if node.slots == 0 || node.slots > MAX_SLOTS {
        return Err(peer_input::BadInput(format!(
            "slots = {} is outside 1..={MAX_SLOTS}",
            node.slots
        )));
    }
    Ok(())
}

/// Accepts connections on `listener` while the returned gate lives: each authenticated one gets its own
/// thread, which reads the opening message, then forwards every message as an [`Event`].
pub(super) fn accept_loop(
    listener: TcpListener,
    token: String,
    tx: Sender<Event>,
) -> std::io::Result<Gate> {
    let next_conn = AtomicU64::new(0);
    let tx = Mutex::new(tx);
    Gate::start(
        "coordinator",
        listener,
        token,
        Purpose::Control,
        move |stream, peer| {
            let conn = next_conn.fetch_add(1, Ordering::SeqCst) + 1;
            let tx = tx.lock().unwrap_or_else(|p| p.into_inner()).clone();
            serve_connection(conn, stream, peer, tx);
        },
    )
}

pub(super) fn serve_connection(
    conn: u64,
    stream: TcpStream,
    peer: std::net::SocketAddr,
    tx: Sender<Event>,
) {
    let setup = (|| {
        stream.set_nodelay(true)?;
        // The opening message follows the handshake at once: a connection that stays silent is
        // closed after the handshake timeout.
        stream.set_read_timeout(Some(auth::HANDSHAKE_TIMEOUT))?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let opening: Opening = read_frame(&mut reader, Limits::CONTROL)?.header()?;
        stream.set_read_timeout(None)?;
        Ok::<_, std::io::Error>((reader, opening))
    })();
    let (mut reader, opening) = match setup {
        Ok(ok) => ok,
        Err(e) => {
            warn!(%peer, error = %e, "closed an unauthenticated or malformed connection to the coordinator port");
            return;
        }
    };
    let is_agent = matches!(opening, Opening::Agent(_));
    if tx
        .send(Event::Opened(conn, opening, ControlSender::new(stream)))
        .is_err()
    {
        return;
    }
    loop {
        let event = read_frame(&mut reader, Limits::CONTROL).and_then(|frame| {
            if is_agent {
                frame.header::<FromAgent>().map(|m| Event::Agent(conn, m))
            } else {
                frame.header::<ToLauncher>().map(|m| Event::Worker(conn, m))
            }
        });
        match event {
            Ok(event) => {
                if tx.send(event).is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = tx.send(Event::Closed(conn, e.to_string()));
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_with_bad_names_addresses_or_slots_are_refused() {
        let ok = elastic::NodeInfo::new("node-a", 2, "10.0.0.7:4100");
        assert!(check_join(&ok).is_ok());
        for bad in [
            elastic::NodeInfo::new("../etc", 1, "10.0.0.7:4100"),
            elastic::NodeInfo::new("a/b", 1, "10.0.0.7:4100"),
            elastic::NodeInfo::new("node-a", 0, "10.0.0.7:4100"),
            elastic::NodeInfo::new("node-a", usize::MAX, "10.0.0.7:4100"),
            elastic::NodeInfo::new("node-a", 1, "nowhere"),
        ] {
            assert!(check_join(&bad).is_err(), "{bad:?}");
        }
    }
}
