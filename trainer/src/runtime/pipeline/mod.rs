//! The pipeline of one plan, seen from the coordinator: it has the plan's agents start one worker
//! per stage, wires the workers to their neighbours, and exchanges control messages with them. The
//! training loop that uses it is in `driver`.
//!
//! By concern: `failures` (what each report means, gathering them, which stage, replica or nodes
//! were lost), `replace` (a replacement for a stage lost mid-step), `decide` (their pure
//! decisions, tested); this file starts the workers and carries their messages.

mod decide;
mod failures;
mod replace;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use elastic::{Generation, NodeId};
use tracing::{info, warn};

use super::control::{ToLauncher, ToWorker};
use super::coordinator::{Coordinator, Incoming};
pub use super::error::{LaunchError, LossCause, Lost};
use crate::config::Config;
pub(in crate::runtime) use decide::GATHER_QUIET;
use decide::neighbour_slots;

/// The running pipeline of the coordinator's current plan: one worker per stage, started by the
/// agents of the plan's nodes and connected to the coordinator's control port.
pub struct Pipeline<'c> {
    coordinator: &'c mut Coordinator,
    /// Stage → the worker's control connection.
    conns: Vec<u64>,
    /// Messages that arrive whenever they are ready (checkpoint uploads), kept for the driver.
    side: VecDeque<ToLauncher>,
    /// Stages a worker found silent past the timeout (hung or cut off).
    suspects: BTreeSet<usize>,
    /// Nodes declared lost while this pipeline ran.
    lost: Vec<Lost>,
    /// The first failure a worker reported as one that would recur on any node (a data error):
    /// the run's error, whatever its neighbours reported around it.
    permanent: Option<(usize, String)>,
    timeout: Duration,
    /// Stage → the node of its mid-step replacement, where that worker logs.
    hosts: BTreeMap<usize, NodeId>,
    /// Stages replaced mid-step in the current step → the loss each was replaced for: if the
    /// step fails after all, that loss is still one to recover from (see
    /// [`recovery::classify`](super::recovery::classify)).
    replaced: BTreeMap<usize, Lost>,
    /// Stage → its worker's data address.
    data_addrs: Vec<String>,
    /// The workers' config (TOML), for a replacement.
    worker_config: String,
    dump_grads: Option<PathBuf>,
    /// Worker replies that arrived while something else was awaited, with the control connection
    /// each came on: a reply whose worker has since been replaced or retired no longer counts.
    pending: VecDeque<(u64, ToLauncher)>,
    /// What the coordinator heard while a dead worker's last messages were read, in order, for
    /// the next poll.
    deferred: VecDeque<Incoming>,
    /// The generation of links rebuilt mid-step (above the plan's, so a stale worker is refused).
    link_generation: u64,
    /// Data-parallel replicas of the pipeline (`conns` holds replicas × stages workers).
    replicas: usize,
    /// Slot → its worker's gradient-reduction address (with replicas).
    reduce_addrs: Vec<String>,
    /// Slots retired in the middle of a step (a lost replica's workers, whose share of the step
    /// was re-routed): their messages, exits and disconnections are ignored from then on.
    retired: BTreeSet<usize>,
    /// With virtual stages: the stages are linked in a ring (see [`decide::neighbour_slots`]).
    ring: bool,
}

/// What the workers of a starting pipeline said in their hellos, per slot.
struct Hellos {
    /// The worker's control connection.
    conns: Vec<u64>,
    /// Its data address.
    data_addrs: Vec<String>,
    /// Its gradient-reduction address (with replicas; empty otherwise).
    reduce_addrs: Vec<String>,
}

/// A stage replaced in the middle of a step.
#[derive(Clone, Debug)]
pub struct Replacement {
    /// The replaced stage.
    pub stage: usize,
    /// The node that ran it.
    pub lost: Lost,
    /// The node that runs the replacement.
    pub host: NodeId,
}

impl<'c> Pipeline<'c> {
    /// Asks the agents of the coordinator's plan to start one worker per stage with `cfg`, and
    /// waits until the pipeline is connected.
    pub fn start(
        coordinator: &'c mut Coordinator,
        cfg: &Config,
        dump_grads: Option<&Path>,
    ) -> Result<Self, LaunchError> {
        let (p, d) = (cfg.pipeline.stages, cfg.pipeline.replicas);
        let cfg_virtual_stages = cfg.pipeline.virtual_stages;
        let workers = p * d;
        let generation = coordinator.plan().generation;
        // Workers may run on other hosts: give them the checkpoint location in full.
        let mut worker_cfg = cfg.clone();
        worker_cfg.checkpoint.url = cfg.checkpoint.resolved_url(&cfg.run.dir);
        let worker_config = worker_cfg.to_toml();
        coordinator.start_workers(&worker_config, dump_grads)?;
        let mut pipeline = Self {
            coordinator,
            conns: Vec::new(),
            side: VecDeque::new(),
            suspects: BTreeSet::new(),
            lost: Vec::new(),
            permanent: None,
            // Longer than the workers' per-message timeout: a worker that waits on a silent
            // neighbour gives up first and names it.
            timeout: 2 * cfg.pipeline.timeout() + Duration::from_secs(1),
            hosts: BTreeMap::new(),
            replaced: BTreeMap::new(),
            data_addrs: Vec::new(),
            worker_config,
            dump_grads: dump_grads.map(Path::to_path_buf),
            pending: VecDeque::new(),
            deferred: VecDeque::new(),
            link_generation: generation,
            replicas: d,
            reduce_addrs: Vec::new(),
            retired: BTreeSet::new(),
            ring: cfg_virtual_stages > 1,
        };
        // Hello from everyone, then the topology, then ready from everyone.
        let Hellos {
            conns,
            data_addrs,
            reduce_addrs,
        } = pipeline.await_hellos(workers, generation)?;
        pipeline.conns = conns;
        let ring = cfg_virtual_stages > 1;
        for slot in 0..workers {
            // Slot r·p + s runs stage s of replica r; its neighbours are in its replica (with
            // virtual stages, a ring: the last stage's chunks feed the first's next chunks).
            let (s, first) = (slot % p, slot - slot % p);
            let (prev, next) = neighbour_slots(s, p, ring);
            let prev = prev.map(|n| data_addrs[first + n].clone());
            let next = next.map(|n| data_addrs[first + n].clone());
            let replicas = if d > 1 {
                (0..d).map(|r| reduce_addrs[r * p + s].clone()).collect()
            } else {
                Vec::new()
            };
            pipeline.send(
                slot,
                &ToWorker::Topology {
                    generation,
                    prev,
                    next,
                    replacement: false,
                    replicas,
                },
            )?;
        }
        pipeline.data_addrs = data_addrs;
        pipeline.reduce_addrs = reduce_addrs;
        pipeline.collect(workers, "the workers to connect to their neighbours")?;
        info!(stages = p, replicas = d, generation, "pipeline connected");
        Ok(pipeline)
    }

    /// Waits for a hello from the worker of every one of `workers` slots of plan `generation`
    /// (refusing workers of other plans); returns each slot's control connection, data address
    /// and (with replicas) reduction address.
    fn await_hellos(&mut self, workers: usize, generation: u64) -> Result<Hellos, LaunchError> {
        let d = self.replicas;
        let mut conns: Vec<Option<u64>> = vec![None; workers];
        let mut data_addrs = vec![String::new(); workers];
        let mut reduce_addrs = vec![String::new(); workers];
        let deadline = Instant::now() + self.timeout;
        while conns.iter().any(Option::is_none) {
            match self.next_incoming(deadline, "every worker to say hello")? {
                Incoming::Hello(
                    conn,
                    ToLauncher::Hello {
                        stage,
                        generation: g,
                        data_addr,
                        reduce_addr,
                        ..
                    },
                ) if Generation::admits(generation, g)
                    && stage < workers
                    && conns[stage].is_none()
                    && (d == 1 || reduce_addr.is_some()) =>
                {
                    conns[stage] = Some(conn);
                    data_addrs[stage] = data_addr;
                    reduce_addrs[stage] = reduce_addr.unwrap_or_default();
                }
                Incoming::Hello(conn, msg) => {
                    warn!(
                        ?msg,
                        generation, "refused a worker that is not of the current plan"
                    );
                    self.coordinator.drop_worker(conn);
                }
                other => self.fail_on(other)?,
            }
        }
        let conns = conns
            .into_iter()
            .map(|c| c.expect("every stage said hello"))
            .collect();
        Ok(Hellos {
            conns,
            data_addrs,
            reduce_addrs,
        })
    }

    fn timeout_error(&self, what: &str) -> LaunchError {
        LaunchError::Timeout {
            what: what.to_string(),
            timeout: self.timeout,
            logs: self.coordinator.logs_hint(),
        }
    }

    /// Number of stages (of one replica).
    pub fn stages(&self) -> usize {
        self.conns.len() / self.replicas
    }

    /// Number of data-parallel replicas.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// Number of workers: replicas × stages. Worker slot `r · stages + s` runs stage `s` of
    /// replica `r`; replica 0's slots are its stages.
    pub fn workers(&self) -> usize {
        self.conns.len()
    }

    /// Sends `msg` to the workers of the writer replica (the stages' shards of a checkpoint are
    /// written once, by them).
    pub fn send_to_first_replica(&mut self, msg: &ToWorker) -> Result<(), LaunchError> {
        let p = self.stages();
        let first = self.writer_replica() * p;
        (first..first + p).try_for_each(|slot| self.send(slot, msg))
    }

    /// The replica that writes checkpoints and peer snapshots: the first one none of whose
    /// workers was retired.
    pub fn writer_replica(&self) -> usize {
        let p = self.stages();
        (0..self.replicas)
            .find(|r| (0..p).all(|s| !self.retired.contains(&(r * p + s))))
            .unwrap_or(0)
    }

    /// The slots of workers not retired, ascending.
    pub fn active_slots(&self) -> Vec<usize> {
        (0..self.conns.len())
            .filter(|w| !self.retired.contains(w))
            .collect()
    }

    /// Whether a slot's worker was retired.
    pub fn is_retired(&self, slot: usize) -> bool {
        self.retired.contains(&slot)
    }

    /// Retires the workers of `replica` in the middle of a step (its share was re-routed): from
    /// now on nothing they send counts.
    pub fn retire_replica(&mut self, replica: usize) {
        let p = self.stages();
        // Not told to stop: a worker of the lost replica that waits for its reduction waits until
        // the pipeline is stopped at the step's boundary, like every other (an exit now would
        // look like a failure of its node).
        self.retired.extend(replica * p..(replica + 1) * p);
    }

    /// The slots and reduction addresses of stage `stage`'s workers in the replicas not retired,
    /// in replica order: the group that reduces without the retired replicas.
    pub fn regroup(&self, stage: usize) -> Vec<(usize, String)> {
        let p = self.stages();
        (0..self.replicas)
            .map(|r| r * p + stage)
            .filter(|w| !self.retired.contains(w))
            .map(|w| (w, self.reduce_addrs[w].clone()))
            .collect()
    }

    /// A link generation above every earlier one (of the plan, of links rebuilt mid-step and of
    /// replica groups).
    pub fn next_link_generation(&mut self) -> u64 {
        self.link_generation += 1;
        self.link_generation
    }

    /// The coordinator whose plan this pipeline runs.
    pub(super) fn coordinator(&mut self) -> &mut Coordinator {
        self.coordinator
    }

    /// Sends `msg` to stage `stage`'s worker. A failed send means its connection is gone (the
    /// worker died, e.g. between two steps): the same failure as a closed connection.
    pub fn send(&mut self, stage: usize, msg: &ToWorker) -> Result<(), LaunchError> {
        let sent = self.coordinator.send_to_worker(self.conns[stage], msg);
        sent.map_err(|source| LaunchError::WorkerDisconnected {
            stage,
            reason: format!("sending to the worker failed: {source}"),
            log: self.log_of(stage),
        })
    }

    /// Sends `msg` to every worker (but retired ones).
    pub fn broadcast(&mut self, msg: &ToWorker) -> Result<(), LaunchError> {
        self.active_slots()
            .into_iter()
            .try_for_each(|slot| self.send(slot, msg))
    }

    /// The slot of a worker's control connection (none for a retired worker's).
    fn stage_of(&self, conn: u64) -> Option<usize> {
        self.conns
            .iter()
            .position(|&c| c == conn)
            .filter(|w| !self.retired.contains(w))
    }

    fn log_of(&self, stage: usize) -> String {
        let node = self
            .hosts
            .get(&stage)
            .cloned()
            .unwrap_or_else(|| self.coordinator.node_of(stage));
        self.coordinator.worker_log(&node, stage)
    }

    /// The next thing the coordinator heard (what was set aside first), or `None` at `deadline`.
    fn poll(&mut self, deadline: Instant) -> Result<Option<Incoming>, LaunchError> {
        match self.deferred.pop_front() {
            Some(incoming) => Ok(Some(incoming)),
            None => self.coordinator.poll(deadline),
        }
    }

    fn next_incoming(&mut self, deadline: Instant, what: &str) -> Result<Incoming, LaunchError> {
        match self.poll(deadline)? {
            Some(incoming) => Ok(incoming),
            None => Err(self.timeout_error(what)),
        }
    }

    /// The next message from a worker of this pipeline; errors when a worker fails, exits or
    /// disconnects, when a node is lost, or when nothing arrives before `deadline`.
    fn next_message(&mut self, deadline: Instant, what: &str) -> Result<ToLauncher, LaunchError> {
        self.next_message_on(deadline, what).map(|(_, msg)| msg)
    }

    /// [`Pipeline::next_message`] with the control connection it came on.
    fn next_message_on(
        &mut self,
        deadline: Instant,
        what: &str,
    ) -> Result<(u64, ToLauncher), LaunchError> {
        loop {
            match self.next_incoming(deadline, what)? {
                Incoming::Worker(conn, msg)
                    if self.stage_of(conn).is_some()
                        && !matches!(msg, ToLauncher::Failed { .. }) =>
                {
                    return Ok((conn, msg));
                }
                other => self.fail_on(other)?,
            }
        }
    }

    /// Waits for `count` replies, setting checkpoint-upload messages aside for [`Pipeline::next_side_message`].
    pub fn collect(&mut self, count: usize, what: &str) -> Result<Vec<ToLauncher>, LaunchError> {
        let deadline = Instant::now() + self.timeout;
        let mut got = Vec::new();
        while got.len() < count {
            match self.next_reply_before(deadline, what)? {
                msg @ (ToLauncher::ShardWritten { .. } | ToLauncher::ShardFailed { .. }) => {
                    self.side.push_back(msg)
                }
                msg => got.push(msg),
            }
        }
        Ok(got)
    }

    /// Every stage finished the current step's units: its mid-step replacements proved
    /// themselves, and a later failure's losses no longer include the losses they replaced.
    pub fn step_units_done(&mut self) {
        self.replaced.clear();
    }

    /// The next worker reply (checkpoint-upload messages are set aside), waiting up to the
    /// pipeline's timeout.
    pub fn next_reply(&mut self, what: &str) -> Result<ToLauncher, LaunchError> {
        self.next_reply_before(Instant::now() + self.timeout, what)
    }

    fn next_reply_before(
        &mut self,
        deadline: Instant,
        what: &str,
    ) -> Result<ToLauncher, LaunchError> {
        // Replies kept from workers replaced (a stage lost mid-step) or retired (a lost
        // replica's) since no longer count: a lost worker's last report, read only after its
        // death was, must not stand in for its replacement's.
        while let Some((conn, msg)) = self.pending.pop_front() {
            if self.stage_of(conn).is_some() {
                return Ok(msg);
            }
            info!(
                ?msg,
                "dropped a reply of a worker replaced or retired since"
            );
        }
        loop {
            match self.next_message(deadline, what)? {
                msg @ (ToLauncher::ShardWritten { .. } | ToLauncher::ShardFailed { .. }) => {
                    self.side.push_back(msg)
                }
                msg => return Ok(msg),
            }
        }
    }

    /// Keeps a reply that arrived while something else was awaited: upload reports for the
    /// checkpoint writer, the rest for [`Pipeline::next_reply`].
    fn keep(&mut self, conn: u64, msg: ToLauncher) {
        match msg {
            ToLauncher::ShardWritten { .. } | ToLauncher::ShardFailed { .. } => {
                self.side.push_back(msg)
            }
            msg => self.pending.push_back((conn, msg)),
        }
    }

    /// Waits for the reply of `stage` that `wanted` accepts, keeping other replies for later.
    fn await_reply_of(
        &mut self,
        stage: usize,
        what: &str,
        wanted: impl Fn(&ToLauncher) -> bool,
    ) -> Result<ToLauncher, LaunchError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let (conn, msg) = self.next_message_on(deadline, what)?;
            if wanted(&msg) && reply_stage(&msg) == Some(stage) {
                return Ok(msg);
            }
            self.keep(conn, msg);
        }
    }

    /// Checkpoint-upload messages that have arrived so far, without waiting.
    pub fn take_side_messages(&mut self) -> Vec<ToLauncher> {
        self.side.drain(..).collect()
    }

    /// The next checkpoint-upload message, waiting up to `timeout`.
    pub fn next_side_message(
        &mut self,
        timeout: Duration,
        what: &str,
    ) -> Result<ToLauncher, LaunchError> {
        if let Some(msg) = self.side.pop_front() {
            return Ok(msg);
        }
        match self.next_message(Instant::now() + timeout, what)? {
            msg @ (ToLauncher::ShardWritten { .. } | ToLauncher::ShardFailed { .. }) => Ok(msg),
            other => Err(LaunchError::Protocol(format!(
                "unexpected {other:?} while waiting for {what}"
            ))),
        }
    }

    /// Waits up to `timeout` until the agents' peer snapshots of `step` cover the model on nodes
    /// that stay past this step boundary ([`Coordinator::peers_hold`]): whether they do. The
    /// workers' other messages are kept for later; a failure is the error.
    pub fn await_peer_snapshots(
        &mut self,
        step: u64,
        timeout: Duration,
    ) -> Result<bool, LaunchError> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.coordinator.peers_hold(step) {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            match self.poll(Instant::now() + Duration::from_millis(5))? {
                Some(Incoming::Worker(conn, msg))
                    if self.stage_of(conn).is_some()
                        && !matches!(msg, ToLauncher::Failed { .. }) =>
                {
                    self.keep(conn, msg)
                }
                Some(other) => self.fail_on(other)?,
                None => {}
            }
        }
    }

    /// Asks every worker to exit, then has the agents make sure they have.
    pub fn shutdown(&mut self) {
        let _ = self.broadcast(&ToWorker::Shutdown);
        self.coordinator.stop_workers(Duration::from_secs(10));
    }
}

/// The stage a reply comes from.
fn reply_stage(msg: &ToLauncher) -> Option<usize> {
    match msg {
        ToLauncher::Hello { stage, .. }
        | ToLauncher::Ready { stage }
        | ToLauncher::StepDone { stage, .. }
        | ToLauncher::ReduceFailed { stage, .. }
        | ToLauncher::LinkDown { stage, .. }
        | ToLauncher::Updated { stage, .. }
        | ToLauncher::EvalDone { stage, .. }
        | ToLauncher::ShardWritten { stage, .. }
        | ToLauncher::ShardFailed { stage, .. }
        | ToLauncher::Restored { stage, .. }
        | ToLauncher::RestoreFailed { stage, .. }
        | ToLauncher::Failed { stage, .. } => Some(*stage),
    }
}
