//! The coordinator: the control port that node agents and stage workers connect to, and the elastic
//! core's view of the nodes. It admits agents (job token first), records their heartbeats, leaves
//! and exits, asks [`elastic::decide`] for plans, and tells agents which workers to start. The
//! pipeline of one plan is in `pipeline`; the training loop in `driver`.
//!
//! By concern: `port` (connections and what peers say), `plans` (first plan, recovery, plan
//! changes, the state's source), `local_agents`, and `decide` (its pure decisions, tested);
//! this file holds the state and the messages it sends.

mod decide;
mod local_agents;
mod plans;
mod port;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::TcpListener;
use std::process::Child;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use elastic::etcd::{EtcdError, EtcdUrl, Rendezvous};
use elastic::preemption::Notice;
use elastic::{ClusterState, FailureDetector, Generation, NodeId, NodeStatus, Plan, ReplicaPolicy};
use tracing::{info, warn};

use super::auth::{self, Gate};
use super::control::{ControlSender, FromAgent, PEER_FAILURE_EXIT_CODE, ToAgent, ToLauncher};
use super::error::{LaunchError, LossCause, Lost};
use super::events::{CoordinatorTakeover, RunEvent};
use super::recovery::{self, Observed, ResumePoint, Start, Tier};
use super::store;
use super::trace::unix_time_s;
use crate::config::Config;
use crate::plan::RunPlan;
use port::{Event, accept_loop};

/// What the pipeline of the current plan hears from the coordinator.
pub(super) enum Incoming {
    /// A worker's first message, on connection `conn`.
    Hello(u64, ToLauncher),
    /// Any later worker message.
    Worker(u64, ToLauncher),
    /// A worker connection closed.
    WorkerClosed(u64, String),
    /// An agent reports that a worker of the current generation exited by itself.
    WorkerExited {
        stage: usize,
        status: String,
        log: String,
        log_tail: String,
    },
    /// A node of the current plan is gone (its agent disconnected, restarted or stopped
    /// heartbeating), with why and how.
    NodeLost(NodeId, String, LossCause),
    /// An agent of the current plan refused to start its workers (they would not fit in memory).
    CannotStart {
        node: NodeId,
        stages: Vec<usize>,
        error: String,
    },
}

/// What a step boundary changes (see [`Coordinator::at_step_boundary`]).
pub(super) enum AtBoundary {
    /// The plan changes; `planned`: the new plan is ready now (else the run waits for nodes).
    Change { reason: String, planned: bool },
    /// Nodes with preemption notices leave and too few would remain: the run stops here with a
    /// checkpoint. `left`: their `node_left` events.
    Stop { reason: String, left: Vec<RunEvent> },
}

/// A recovery in progress: reported in `metrics.jsonl` once the rebuilt pipeline completes a step.
pub(super) struct Recovery {
    pub(super) failed_at: Instant,
    pub(super) failed_step: u64,
    pub(super) stages_before: usize,
    /// How the state was carried over: peer snapshots or the newest committed checkpoint after
    /// a loss, or a handover (a checkpoint of the boundary where the plan changed).
    pub(super) tier: Tier,
    /// `node_lost`, `node_left`, `node_joined` and `plan` events, written once the metrics file is
    /// rewritten for the resume.
    pub(super) events: Vec<RunEvent>,
}

/// The coordinator of one run.
pub struct Coordinator {
    /// The run's config, as validated: never changed (the layout lives in `layout`).
    pub(super) cfg: Config,
    /// The layout of the adopted plan: the one the config asks for until the elastic core adopts
    /// another.
    pub(super) layout: RunPlan,
    /// Where the next pipeline's state comes from.
    pub(super) start: Start,
    /// Sub-directory of the run directory (and of each agent's directory) for configs and logs.
    session: String,
    /// Set while a pipeline replaces one that lost nodes or changed plan.
    pub(super) recovery: Option<Recovery>,
    state: ClusterState,
    addr: String,
    token: String,
    events: Receiver<Event>,
    /// Agent connections: conn → (node, sender).
    agents: BTreeMap<u64, (NodeId, ControlSender)>,
    /// Worker connections: conn → sender.
    workers: HashMap<u64, ControlSender>,
    /// Worker exits reported for the current generation: stage → exit code (`None`: a signal).
    pub(super) exits: BTreeMap<usize, Option<i32>>,
    /// The `launch` number of the `StartWorkers` that started each slot's current worker: an
    /// exit reported for another (a worker replaced mid-step) is not the slot's.
    pub(super) launches: BTreeMap<usize, u64>,
    /// The last `launch` number given out.
    last_launch: u64,
    /// When the current failure was first seen (Unix seconds), for the `node_lost` events.
    failure_seen_at: Option<f64>,
    /// The step the current failure happened in, when that step still completed (a lost
    /// replica's share re-routed) and so is already in `metrics.jsonl`; for the `node_lost` events.
    failure_step: Option<u64>,
    /// Peer snapshots the agents hold: step → node → tensor names.
    held: BTreeMap<u64, BTreeMap<NodeId, BTreeSet<String>>>,
    /// The clouds' preemption notices of leaving nodes (a node leaving without one got SIGTERM),
    /// for the reason of their `node_left` events.
    notices: BTreeMap<NodeId, Notice>,
    local_agents: Vec<Child>,
    /// The nodes of `local_agents`: their workers log under this run's directory.
    local_names: BTreeSet<NodeId>,
    /// Accepts and authenticates control connections while the coordinator lives.
    _gate: Gate,
    /// The etcd rendezvous (`elastic.rendezvous`), where the generation and plan are published.
    rendezvous: Option<Rendezvous>,
    /// Declares silent nodes dead, excusing the coordinator's own stalls.
    detector: FailureDetector,
    /// The incarnation of each node that the current failure lost (fenced, disconnected or
    /// replaced by a new incarnation): [`Coordinator::recover`] declares that one dead, never a
    /// newer incarnation that joined again meanwhile.
    lost_incarnations: BTreeMap<NodeId, u64>,
}

impl Coordinator {
    /// Binds the control port (`elastic.listen`) and starts accepting connections. With
    /// `elastic.local_agents`, starts one agent per pipeline stage on this machine. Configs and
    /// logs go to `session` under the run directory (and under each agent's directory). The
    /// address it listens on goes to `listening` as soon as it is bound, before any node joins.
    /// `layout` is the run's plan as decided from `cfg` ([`RunPlan::decide`]): as many nodes as
    /// it has workers are waited for.
    pub fn start(
        cfg: Config,
        layout: RunPlan,
        start: Start,
        session: &str,
        listening: Option<&Sender<String>>,
    ) -> Result<Self, LaunchError> {
        let io = |what: &str| {
            let what = what.to_string();
            move |source| LaunchError::Io {
                what: what.clone(),
                source,
            }
        };
        let listen = cfg.elastic.listen.clone();
        let listener = TcpListener::bind(&listen).map_err(io(&format!(
            "binding the coordinator port {listen} (elastic.listen)"
        )))?;
        let local = listener.local_addr().map_err(io("coordinator port"))?;
        let addr = if local.ip().is_unspecified() {
            format!("127.0.0.1:{}", local.port())
        } else {
            local.to_string()
        };
        let token = auth::coordinator_token(cfg.elastic.local_agents)
            .map_err(|e| LaunchError::Run(e.to_string()))?;
        let (tx, events) = channel();
        let gate =
            accept_loop(listener, token.clone(), tx).map_err(io("starting the coordinator"))?;
        info!(%addr, "coordinator listening");
        if let Some(listening) = listening {
            // Nobody waiting for it any more is that program's business, not the run's.
            let _ = listening.send(addr.clone());
        }
        let mut state = ClusterState::new(cfg.model.layers);
        state.replicas = ReplicaPolicy {
            wanted: cfg.pipeline.replicas,
            valid: cfg.valid_replicas(),
        };
        let (cfg_heartbeat, cfg_dead_after) = (cfg.elastic.heartbeat(), cfg.elastic.dead_after());
        let mut coordinator = Self {
            state,
            cfg,
            layout,
            start,
            session: session.to_string(),
            recovery: None,
            addr,
            token,
            events,
            agents: BTreeMap::new(),
            workers: HashMap::new(),
            exits: BTreeMap::new(),
            launches: BTreeMap::new(),
            last_launch: 0,
            held: BTreeMap::new(),
            notices: BTreeMap::new(),
            failure_seen_at: None,
            failure_step: None,
            local_agents: Vec::new(),
            local_names: BTreeSet::new(),
            _gate: gate,
            rendezvous: None,
            detector: FailureDetector::new(cfg_heartbeat, cfg_dead_after),
            lost_incarnations: BTreeMap::new(),
        };
        // One node per worker: replicas × stages.
        let workers = coordinator.layout.workers();
        let mut wanted = workers;
        if !coordinator.cfg.elastic.rendezvous.is_empty() {
            let token = coordinator.token.clone();
            wanted = coordinator.connect_rendezvous(&token)?.unwrap_or(wanted);
        }
        if coordinator.cfg.elastic.local_agents {
            for i in 0..workers {
                coordinator.spawn_local_agent(&format!("local-{i:03}"))?;
            }
        }
        coordinator.first_plan(wanted)?;
        Ok(coordinator)
    }

    /// Connects to the etcd rendezvous and continues the job's generations. When a previous
    /// coordinator of the job existed (it was lost), this one takes over: it waits for the nodes
    /// registered in etcd (returned) and resumes from the newest committed checkpoint.
    fn connect_rendezvous(&mut self, token: &str) -> Result<Option<usize>, LaunchError> {
        let etcd = |e: EtcdError| LaunchError::Run(format!("etcd rendezvous: {e}"));
        let url = EtcdUrl::parse(&self.cfg.elastic.rendezvous).map_err(etcd)?;
        let rendezvous = Rendezvous::connect(&url, &auth::fingerprint(token)).map_err(etcd)?;
        let floor = rendezvous.generation().map_err(etcd)?;
        let registered = rendezvous.nodes().map_err(etcd)?.len();
        let previous_plan = rendezvous.plan().map_err(etcd)?;
        self.rendezvous = Some(rendezvous);
        self.state.generation_floor = floor;
        if floor == 0 {
            return Ok(None);
        }
        let latest = store::committed_steps(&self.cfg)?.last().copied();
        warn!(
            generation = floor,
            ?latest,
            "taking over the job from a lost coordinator"
        );
        eprintln!(
            "warning: taking over as coordinator after generation {floor}; resuming from {}",
            latest.map_or("the start".to_string(), |s| format!("checkpoint {s}"))
        );
        if self.start == Start::Fresh && latest.is_some() {
            self.start = Start::Resume(ResumePoint::Latest);
        }
        // The lost coordinator's metrics, when the run directory is shared, say how far it got.
        let failed_step =
            last_metrics_step(&self.cfg.run.dir.join("metrics.jsonl")).max(latest.unwrap_or(0)) + 1;
        self.recovery = Some(Recovery {
            failed_at: Instant::now(),
            failed_step,
            stages_before: previous_plan.map_or(0, |p| p.num_stages()),
            tier: Tier::Checkpoint,
            events: vec![RunEvent::CoordinatorTakeover(CoordinatorTakeover {
                after_generation: floor,
                resume_from: latest,
                at_unix_s: unix_time_s(),
            })],
        });
        Ok(Some(registered.max(self.cfg.elastic.min_nodes)))
    }

    /// Records an adopted plan in etcd (generation first, as a compare-and-swap): a coordinator
    /// that lost the race to another one stops.
    fn publish(&self, plan: &Plan) -> Result<(), LaunchError> {
        let Some(rendezvous) = &self.rendezvous else {
            return Ok(());
        };
        let etcd = |e: EtcdError| {
            LaunchError::Run(format!(
                "etcd rendezvous: {e}; another coordinator took over the job, this one stops"
            ))
        };
        rendezvous
            .bump_generation(plan.generation - 1)
            .map_err(etcd)?;
        rendezvous.publish_plan(plan).map_err(etcd)
    }

    /// The address agents and workers connect to.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Where this session's configs and logs go on the coordinator's machine.
    pub(super) fn session_dir(&self) -> std::path::PathBuf {
        self.cfg.run.dir.join(&self.session)
    }

    /// Where the workers' logs are, for a timeout message: this run's directory for local agents,
    /// and each agent's `--dir` on its node.
    pub(super) fn logs_hint(&self) -> String {
        let logs = self.session_dir().join("logs");
        if self
            .plan()
            .nodes
            .iter()
            .all(|n| self.local_names.contains(n))
        {
            logs.display().to_string()
        } else {
            format!(
                "{} (local agents) and {}/logs under each node agent's --dir",
                logs.display(),
                std::path::Path::new(&self.session).display()
            )
        }
    }

    /// Where the log of `stage`'s worker on `node` is, for failure messages: under this run's
    /// directory for a local agent, else on that node, under its agent's `--dir`.
    pub(super) fn worker_log(&self, node: &NodeId, stage: usize) -> String {
        let relative = std::path::Path::new(&self.session)
            .join("logs")
            .join(format!("stage-{stage}.log"));
        if self.local_names.contains(node) {
            self.cfg.run.dir.join(relative).display().to_string()
        } else {
            format!("{} in the --dir of node {node}'s agent", relative.display())
        }
    }

    /// The adopted plan.
    pub(super) fn plan(&self) -> &Plan {
        self.state
            .current
            .as_ref()
            .expect("a plan is adopted at start")
    }

    /// Tells every agent of the plan to start its workers with `config`; logs and config go to the
    /// session's directory under each agent's directory.
    pub(super) fn start_workers(
        &mut self,
        config: &str,
        dump_grads: Option<&std::path::Path>,
    ) -> Result<(), LaunchError> {
        self.exits.clear();
        self.launches.clear();
        let plan = self.plan().clone();
        for node in &plan.nodes {
            let msg = self.start_message(node, plan.slots_of(node), config, dump_grads, false);
            self.send_to_node(node, &msg)?;
        }
        Ok(())
    }

    /// Mid-step recovery: has the agent of `node` start a worker for `stage` beside the ones it
    /// runs.
    pub(super) fn start_replacement(
        &mut self,
        node: &NodeId,
        stage: usize,
        config: &str,
        dump_grads: Option<&std::path::Path>,
    ) -> Result<(), LaunchError> {
        self.exits.remove(&stage);
        // From here on, an exit reported for the lost worker of `stage` is not the replacement's.
        let msg = self.start_message(node, vec![stage], config, dump_grads, true);
        self.send_to_node(node, &msg)
    }

    /// A `StartWorkers` for `stages` on `node`, with a new `launch` number recorded as theirs.
    fn start_message(
        &mut self,
        node: &NodeId,
        stages: Vec<usize>,
        config: &str,
        dump_grads: Option<&std::path::Path>,
        keep_running: bool,
    ) -> ToAgent {
        self.last_launch += 1;
        let launch = self.last_launch;
        for &slot in &stages {
            self.launches.insert(slot, launch);
        }
        let plan = self.plan();
        let snapshot_to: Vec<String> = if self.cfg.elastic.peer_snapshots {
            // The buddy first: its copy survives the loss of this whole node, and a loss early
            // in the next step finds the state there sooner.
            let buddies = elastic::buddies(plan);
            buddies
                .get(node)
                .into_iter()
                .chain(std::iter::once(node))
                .filter_map(|n| self.state.membership.get(n).map(|m| m.info.addr.clone()))
                .collect()
        } else {
            Vec::new()
        };
        ToAgent::StartWorkers {
            generation: plan.generation,
            first_step: plan.step,
            stages,
            config: config.to_string(),
            snapshot_to,
            session: self.session.clone(),
            dump_grads: dump_grads.map(|d| d.to_path_buf()),
            keep_running,
            launch,
        }
    }

    /// The agents holding a peer snapshot of every name in `names` for `step` (live agents only),
    /// or `None` if they do not cover them all.
    pub(super) fn peer_sources(&self, step: u64, names: &[String]) -> Option<Vec<String>> {
        let holders = recovery::peer_holders(&self.held, step, names, |n| self.agent_alive(n))?;
        Some(self.snapshot_addrs(&holders))
    }

    /// The snapshot addresses of `nodes`' agents.
    fn snapshot_addrs(&self, nodes: &[NodeId]) -> Vec<String> {
        nodes
            .iter()
            .filter_map(|n| self.state.membership.get(n).map(|m| m.info.addr.clone()))
            .collect()
    }

    fn send_to_node(&mut self, node: &NodeId, msg: &ToAgent) -> Result<(), LaunchError> {
        let lost = |reason: String| LaunchError::NodesLost {
            lost: vec![Lost {
                node: node.clone(),
                reason: reason.clone(),
                cause: LossCause::AgentUnreachable,
                agent_alive: false,
            }],
            cause: reason,
        };
        let sender = self
            .agents
            .values()
            .find(|(n, _)| n == node)
            .map(|(_, s)| s.clone())
            .ok_or_else(|| lost(format!("node {node} has no agent connection")))?;
        sender
            .send(msg)
            .map_err(|e| lost(format!("sending to the agent of node {node}: {e}")))
    }

    /// Sends to worker connection `conn`.
    pub(super) fn send_to_worker(
        &self,
        conn: u64,
        msg: &super::control::ToWorker,
    ) -> std::io::Result<()> {
        match self.workers.get(&conn) {
            Some(sender) => sender.send(msg),
            None => Err(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                format!("worker connection {conn} is closed"),
            )),
        }
    }

    /// Whether worker connection `conn` is open.
    pub(super) fn worker_connected(&self, conn: u64) -> bool {
        self.workers.contains_key(&conn)
    }

    /// Closes worker connection `conn` (its worker is refused).
    pub(super) fn drop_worker(&mut self, conn: u64) {
        self.workers.remove(&conn);
    }

    /// Stops the workers of the current plan on every live agent and waits (up to `timeout`) for
    /// the agents to confirm.
    pub(super) fn stop_workers(&mut self, timeout: Duration) {
        let generation = self.plan().generation;
        let mut waiting: Vec<NodeId> = Vec::new();
        let agents: Vec<(NodeId, ControlSender)> = self.agents.values().cloned().collect();
        for (node, sender) in agents {
            if sender.send(&ToAgent::StopWorkers { generation }).is_ok() {
                waiting.push(node);
            }
        }
        let deadline = Instant::now() + timeout;
        while !waiting.is_empty() && Instant::now() < deadline {
            match self.events.recv_timeout(Duration::from_millis(20)) {
                Ok(Event::Agent(conn, FromAgent::WorkersStopped { generation: g }))
                    if Generation::admits(generation, g) =>
                {
                    if let Some((node, _)) = self.agents.get(&conn) {
                        let node = node.clone();
                        waiting.retain(|n| *n != node);
                    }
                }
                Ok(Event::Closed(conn, reason)) => {
                    if let Some((node, _)) = self.agents.get(&conn).cloned() {
                        waiting.retain(|n| *n != node);
                    }
                    self.closed(conn, reason);
                }
                Ok(event) => {
                    if let Some(incoming) = self.handle(event)
                        && let Incoming::Hello(conn, _) | Incoming::Worker(conn, _) = incoming
                    {
                        self.workers.remove(&conn);
                    }
                }
                Err(_) => {}
            }
        }
        self.workers.clear();
        if !waiting.is_empty() {
            warn!(
                ?waiting,
                "agents did not confirm that their workers stopped"
            );
        }
    }

    /// The node that runs `stage` under the current plan.
    pub(super) fn node_of(&self, stage: usize) -> NodeId {
        self.plan().stages[stage].clone()
    }

    /// Whether the agent of `node` is connected and not fenced.
    pub(super) fn agent_alive(&self, node: &NodeId) -> bool {
        self.agents.values().any(|(n, _)| n == node)
            && !self
                .state
                .membership
                .status(node)
                .is_some_and(NodeStatus::is_dead)
    }

    /// Records that a failure was just seen (before its extent is known).
    pub(super) fn failure_seen(&mut self) {
        self.failure_seen_at.get_or_insert_with(unix_time_s);
    }

    /// Records that the current failure happened in `step`, which completes nonetheless (its lost
    /// replica's share re-routed): the `node_lost` events name it, not the step after it.
    pub(super) fn failure_in_completed_step(&mut self, step: u64) {
        self.failure_seen();
        self.failure_step.get_or_insert(step);
    }

    /// After a failure (`cause`) and once the workers are stopped: the nodes lost — those declared
    /// lost (`reported`) or whose agent is gone, and those whose worker died by itself (killed, or
    /// failed) rather than because a neighbour failed (exit code [`PEER_FAILURE_EXIT_CODE`]). When
    /// nothing died, the `suspects` (stages a neighbour found silent) are the lost ones: hung or
    /// cut off. A stage replaced mid-step in the failed step (`replaced`) whose replacement
    /// exited too costs the node it was replaced for.
    pub(super) fn losses(
        &self,
        cause: &str,
        reported: &[Lost],
        suspects: &BTreeSet<usize>,
        replaced: &BTreeMap<usize, Lost>,
    ) -> Vec<Lost> {
        let plan = self.plan();
        let live_agents: BTreeSet<NodeId> = plan
            .nodes
            .iter()
            .filter(|n| self.agent_alive(n))
            .cloned()
            .collect();
        recovery::classify(
            cause,
            Observed {
                stages: &plan.stages,
                live_agents: &live_agents,
                reported,
                exits: &self.exits,
                suspects,
                peer_failure_exit_code: i32::from(PEER_FAILURE_EXIT_CODE),
                replaced,
            },
        )
    }

    /// A worker reported a preemption notice for its node.
    pub(super) fn node_leaving(&mut self, stage: usize) {
        let node = self.node_of(stage);
        let _ = self.state.membership.leave(&node, Instant::now());
    }

    /// Ends the run: every agent stops its workers and exits.
    pub fn shutdown(&mut self) {
        for (_, sender) in self.agents.values() {
            let _ = sender.send(&ToAgent::Shutdown);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        for child in &mut self.local_agents {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        self.kill_local_agents();
    }
}

impl Drop for Coordinator {
    /// No local agent (and so no worker) outlives the coordinator.
    fn drop(&mut self) {
        for (_, sender) in self.agents.values() {
            let _ = sender.send(&ToAgent::Shutdown);
        }
        self.kill_local_agents();
    }
}

/// The last step recorded in `metrics.jsonl` (0 if none).
fn last_metrics_step(path: &std::path::Path) -> u64 {
    super::events::last_step(path)
}
