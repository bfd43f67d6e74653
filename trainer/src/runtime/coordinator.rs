//! The coordinator: the control port that node agents and stage workers connect to, and the elastic
//! core's view of the nodes. It admits agents (job token first), records their heartbeats, leaves
//! and exits, asks [`elastic::decide`] for plans, and tells agents which workers to start. The
//! pipeline of one plan is in `pipeline`; the training loop in `driver`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::BufReader;
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

use elastic::etcd::{EtcdError, EtcdUrl, Rendezvous};
use elastic::preemption::Notice;
use elastic::{
    ClusterState, Decision, FailureDetector, Generation, NodeId, NodeStatus, Plan, ReplicaPolicy,
    decide,
};
use tracing::{info, warn};

use super::auth::{self, Gate, Purpose};
use super::control::{
    ControlSender, FromAgent, Opening, PEER_FAILURE_EXIT_CODE, ToAgent, ToLauncher,
};
use super::error::{LaunchError, LossCause, Lost};
use super::events::{CoordinatorTakeover, NodeJoined, NodeLeft, NodeLost, PlanAdopted, RunEvent};
use super::peer_input;
use super::recovery::{self, Observed, ResumePoint, Start, Tier};
use super::store;
use super::trace::unix_time_s;
use super::wire::{Limits, read_frame};
use crate::config::Config;
use crate::plan::RunPlan;

/// What arrived on the control port.
enum Event {
    /// A connection passed the job-token check and said who it is.
    Opened(u64, Opening, ControlSender),
    /// A message from an agent.
    Agent(u64, FromAgent),
    /// A message from a worker.
    Worker(u64, ToLauncher),
    /// A connection closed (or sent garbage).
    Closed(u64, String),
}

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

    fn spawn_local_agent(&mut self, name: &str) -> Result<(), LaunchError> {
        let exe = std::env::current_exe().map_err(|source| LaunchError::Io {
            what: "locating the seqpipe executable".into(),
            source,
        })?;
        let logs = self.cfg.run.dir.join(&self.session).join("logs");
        let io = |what: String| {
            move |source| LaunchError::Io {
                what: what.clone(),
                source,
            }
        };
        std::fs::create_dir_all(&logs).map_err(io(format!("creating {}", logs.display())))?;
        let log = logs.join(format!("agent-{name}.log"));
        // Appended to: an agent started again under the same name keeps its predecessor's log.
        let file = super::agent::append_log(&log, &format!("agent {name}"))
            .map_err(io(format!("opening {}", log.display())))?;
        let stderr = file.try_clone().map_err(io("agent log".into()))?;
        let mut cmd = Command::new(exe);
        cmd.args([
            "agent", "--join", &self.addr, "--name", name, "--slots", "1", "--local",
        ])
        .arg("--dir")
        .arg(&self.cfg.run.dir)
        .args(preemption_args(&self.cfg.elastic))
        .env(auth::TOKEN_ENV, &self.token)
        .stdin(Stdio::null())
        .stdout(Stdio::from(file))
        .stderr(Stdio::from(stderr));
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", &self.cfg.run.log);
        }
        // Own process group (a Ctrl-C reaches only the launcher, which stops the run cleanly), and
        // no agent outlives the launcher.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        super::agent::die_with_parent(&mut cmd);
        let child = cmd.spawn().map_err(|source| LaunchError::Io {
            what: format!("starting local agent {name}"),
            source,
        })?;
        self.local_agents.push(child);
        self.local_names.insert(NodeId::new(name));
        Ok(())
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

    /// Waits for the nodes of the first plan: every local agent, or (multi-host) `pipeline.stages`
    /// agents — fewer once `elastic.join_timeout_s` passes, as long as `elastic.min_nodes` joined.
    fn first_plan(&mut self, wanted: usize) -> Result<(), LaunchError> {
        let deadline = Instant::now() + self.cfg.elastic.join_timeout();
        let mut announced = 0;
        loop {
            let alive = self.state.membership.alive().len();
            if alive >= wanted
                || (Instant::now() >= deadline && alive >= self.cfg.elastic.min_nodes)
            {
                break;
            }
            if Instant::now() >= deadline {
                return Err(LaunchError::Run(format!(
                    "only {alive} node(s) joined the coordinator at {} within {} s (elastic.join_timeout_s), {} needed (elastic.min_nodes); start agents with `seqpipe agent --join {}`",
                    self.addr,
                    self.cfg.elastic.join_timeout_s,
                    self.cfg.elastic.min_nodes,
                    self.addr
                )));
            }
            if !self.cfg.elastic.local_agents && alive != announced {
                announced = alive;
                eprintln!(
                    "{alive} of {wanted} node(s) joined; waiting for more at {}",
                    self.addr
                );
            }
            self.check_local_agents()?;
            if let Some(incoming) = self.poll(Instant::now() + Duration::from_millis(50))? {
                self.unexpected(incoming);
            }
        }
        let now = Instant::now();
        let (decision, reason) = decide(now, &self.state, &self.cfg.elastic);
        let Some(plan) = decision.plan().cloned() else {
            return Err(LaunchError::Run(format!(
                "cannot plan the pipeline: {reason}"
            )));
        };
        self.state.apply(&decision, now);
        self.publish(&plan)?;
        self.layout = self
            .layout
            .with_layout(&self.cfg, plan.num_stages(), plan.replicas)?;
        info!(%reason, "first plan");
        if let Some(r) = &mut self.recovery {
            r.events.push(RunEvent::Plan(PlanAdopted::of(&plan)));
        }
        Ok(())
    }

    /// A local agent that exited before joining is an error with its status.
    fn check_local_agents(&mut self) -> Result<(), LaunchError> {
        for child in &mut self.local_agents {
            if let Ok(Some(status)) = child.try_wait()
                && self.state.current.is_none()
            {
                return Err(LaunchError::Run(format!(
                    "a local agent exited before the run started ({status}); see the logs in {}",
                    self.cfg.run.dir.join("logs").display()
                )));
            }
        }
        Ok(())
    }

    fn unexpected(&mut self, incoming: Incoming) {
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
    pub(super) fn gather_failure_reports(&mut self, quiet: Duration, grace: Duration) -> Vec<Lost> {
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

    /// Tells every agent of the plan to start its workers with `config`; logs and config go to the
    /// session's directory under each agent's directory.
    pub(super) fn start_workers(
        &mut self,
        config: &str,
        dump_grads: Option<&std::path::Path>,
    ) -> Result<(), LaunchError> {
        self.exits.clear();
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
        let msg = self.start_message(node, vec![stage], config, dump_grads, true);
        self.send_to_node(node, &msg)
    }

    fn start_message(
        &self,
        node: &NodeId,
        stages: Vec<usize>,
        config: &str,
        dump_grads: Option<&std::path::Path>,
        keep_running: bool,
    ) -> ToAgent {
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

    /// The next event of interest to the pipeline, handling agent bookkeeping (joins, heartbeats,
    /// leaves) on the way; `None` at `deadline`. Heartbeat expiry is checked on every call.
    pub(super) fn poll(&mut self, deadline: Instant) -> Result<Option<Incoming>, LaunchError> {
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

    fn expire_silent_nodes(&mut self) -> Option<Incoming> {
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

    fn in_plan(&self, node: &NodeId) -> bool {
        self.state
            .current
            .as_ref()
            .is_some_and(|p| p.contains(node))
    }

    /// A dead node's agent connection is closed with a refusal: whatever it still sends is ignored
    /// until it joins again. Returns the reason it was declared dead.
    fn fence(&mut self, node: &NodeId, now: Instant) -> String {
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

    fn handle(&mut self, event: Event) -> Option<Incoming> {
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
    fn join(
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
    fn agent_message(&mut self, conn: u64, msg: FromAgent, now: Instant) -> Option<Incoming> {
        let Some((node, _)) = self.agents.get(&conn).cloned() else {
            warn!(conn, ?msg, "refused a message from a fenced agent");
            return None;
        };
        match msg {
            FromAgent::Heartbeat => {
                if let Err(e) = self.state.membership.heartbeat(&node, now) {
                    // A dead node's connection is closed with the refusal, so that its agent
                    // joins again rather than heartbeat into the void.
                    warn!(%node, error = %e, "refused a heartbeat; fencing the connection");
                    if let Some((_, sender)) = self.agents.remove(&conn) {
                        sender.send_and_close(&ToAgent::Refused {
                            reason: e.to_string(),
                        });
                    }
                }
                None
            }
            FromAgent::Leaving { notice } => {
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
                let _ = self.state.membership.leave(&node, now);
                None
            }
            FromAgent::WorkerExited {
                generation,
                stage,
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

    fn closed(&mut self, conn: u64, reason: String) -> Option<Incoming> {
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
    fn record_lost_incarnation(&mut self, node: &NodeId) {
        if let Some(m) = self.state.membership.get(node) {
            self.lost_incarnations
                .entry(node.clone())
                .or_insert(m.incarnation);
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
    /// cut off.
    pub(super) fn losses(
        &self,
        cause: &str,
        reported: &[Lost],
        suspects: &BTreeSet<usize>,
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
            },
        )
    }

    /// A worker reported a preemption notice for its node.
    pub(super) fn node_leaving(&mut self, stage: usize) {
        let node = self.node_of(stage);
        let _ = self.state.membership.leave(&node, Instant::now());
    }

    /// Nodes were lost during the step after the last one in `metrics.jsonl`: the elastic core plans the pipeline on the
    /// survivors (nodes whose agent survived join again at once), and the run resumes from the
    /// newest committed checkpoint, or fails with the core's reason.
    pub(super) fn recover(&mut self, lost: &[Lost]) -> Result<(), LaunchError> {
        let failed_at = Instant::now();
        let failed_step = last_metrics_step(&self.cfg.run.dir.join("metrics.jsonl")) + 1;
        let detected_at_unix_s = self.failure_seen_at.take().unwrap_or_else(unix_time_s);
        let lost_in_step = self.failure_step.take().unwrap_or(failed_step);
        let stages_before = self.plan().num_stages();
        let mut events = Vec::new();
        for l in lost {
            warn!(node = %l.node, failed_step = lost_in_step, reason = %l.reason, "node lost");
            eprintln!(
                "warning: lost node {} during step {lost_in_step}: {}",
                l.node, l.reason
            );
            events.push(RunEvent::NodeLost(NodeLost {
                node: l.node.clone(),
                failed_step: lost_in_step,
                reason: l.reason.clone(),
                detected_at_unix_s,
                agent_alive: l.agent_alive,
                stage: None,
                mid_step: None,
            }));
            // The incarnation that was lost: a node that joined again since (declared dead while
            // its agent lived, e.g. after a stall of the whole fleet) stays in as a joiner.
            // (A recorded incarnation is of this failure while the current one is not admitted
            // yet: a plan adopted since would have admitted it.)
            let lost_incarnation = match self.state.membership.get(&l.node) {
                Some(m) if !m.admitted => self
                    .lost_incarnations
                    .get(&l.node)
                    .copied()
                    .unwrap_or(m.incarnation),
                Some(m) => m.incarnation,
                None => 0,
            };
            let fenced = self.state.membership.report_failure_of(
                &l.node,
                lost_incarnation,
                l.reason.clone(),
                failed_at,
            );
            if l.agent_alive
                && matches!(fenced, Ok(true))
                && let Some(info) = self.state.membership.get(&l.node).map(|m| m.info.clone())
            {
                // The node itself is fine: it comes back at once with fresh workers.
                let _ = self.state.membership.join(info, failed_at);
            }
        }
        self.lost_incarnations.clear();
        self.state.step = failed_step;
        self.state.at_step_boundary = false;
        let tier = self.replan(&mut events)?;
        self.recovery = Some(Recovery {
            failed_at,
            failed_step,
            stages_before,
            tier,
            events,
        });
        Ok(())
    }

    /// Step `step` is complete and its checkpoint scheduled: nodes leave or join here, if any want
    /// to. Returns what changes: the plan (the caller keeps the state of `step` — peer snapshots
    /// or a checkpoint — and restarts the pipeline under the new plan, ready now or after waiting
    /// for nodes), or the run stops because nodes with preemption notices leave and too few
    /// would remain (with their `node_left` events; the caller commits a checkpoint of `step`).
    pub(super) fn at_step_boundary(&mut self, step: u64) -> Option<AtBoundary> {
        let now = Instant::now();
        self.state.step = step + 1;
        self.state.at_step_boundary = true;
        let (decision, reason) = decide(now, &self.state, &self.cfg.elastic);
        // A node lost mid-step (its stage was replaced for the rest of the step) leaves the plan
        // here too — or, with too few nodes left, the run waits for joiners or stops.
        match decision {
            Decision::Continue => None,
            Decision::Stop { leaving } => {
                let left = leaving
                    .iter()
                    .map(|id| {
                        RunEvent::NodeLeft(NodeLeft {
                            node: id.clone(),
                            step,
                            reason: elastic::preemption::leave_reason(
                                self.notices.remove(id).as_ref(),
                            ),
                        })
                    })
                    .collect();
                Some(AtBoundary::Stop { reason, left })
            }
            decision => Some(AtBoundary::Change {
                reason,
                planned: decision.plan().is_some(),
            }),
        }
    }

    /// Adopts the plan that [`Coordinator::at_step_boundary`] announced, after the checkpoint of
    /// `step` was committed.
    pub(super) fn change_plan_at_boundary(&mut self, step: u64) -> Result<(), LaunchError> {
        let now = Instant::now();
        let stages_before = self.plan().num_stages();
        let before = self.plan().clone();
        let mut events: Vec<RunEvent> = Vec::new();
        for id in &before.nodes {
            if self.state.membership.status(id) == Some(&NodeStatus::Leaving) {
                events.push(RunEvent::NodeLeft(NodeLeft {
                    node: id.clone(),
                    step,
                    reason: elastic::preemption::leave_reason(self.notices.remove(id).as_ref()),
                }));
            }
        }
        for joiner in self.state.membership.pending_joiners() {
            events.push(RunEvent::NodeJoined(NodeJoined {
                node: joiner.id.clone(),
                step,
            }));
        }
        self.replan(&mut events)?;
        // Joiners the plan did not take stay spares: no event for them.
        let plan = self.plan().clone();
        events.retain(|e| match e {
            RunEvent::NodeJoined(NodeJoined { node, .. }) => plan.nodes.contains(node),
            _ => true,
        });
        self.recovery = Some(Recovery {
            failed_at: now,
            failed_step: step + 1,
            stages_before,
            tier: Tier::Handover,
            events,
        });
        Ok(())
    }

    /// Asks the elastic core for the next plan (waiting while it says wait), adopts it, and points
    /// the next pipeline at the newest state: the agents' peer snapshots when they cover the model
    /// and are not older than the newest committed checkpoint, else that checkpoint. Adds the `plan`
    /// event and returns the tier (`peer` or `checkpoint`).
    fn replan(&mut self, events: &mut Vec<RunEvent>) -> Result<Tier, LaunchError> {
        let mut waiting_reason = String::new();
        // When the elastic core first said wait (for the plan event's `waited_for_nodes_s`).
        let mut waiting_since: Option<Instant> = None;
        let plan = loop {
            let now = Instant::now();
            let (decision, reason) = match decide(now, &self.state, &self.cfg.elastic) {
                // The pipeline stopped for a change that is no longer wanted (its joiner was lost
                // again): it restarts on the nodes it had.
                (Decision::Continue, reason) => {
                    elastic::restart_plan(&self.state).ok_or_else(|| {
                        LaunchError::Protocol(format!(
                            "the pipeline stopped for a plan change but there is no plan to restart: {reason}"
                        ))
                    })?
                }
                other => other,
            };
            self.state.apply(&decision, now);
            match decision {
                Decision::Recover { plan, .. }
                | Decision::Grow { plan, .. }
                | Decision::Shrink { plan, .. } => {
                    info!(%reason, "new plan");
                    break plan;
                }
                Decision::Wait { until, .. } => {
                    waiting_since.get_or_insert(now);
                    if reason != waiting_reason {
                        warn!(%reason, "waiting for nodes");
                        waiting_reason = reason;
                    }
                    let deadline = until.min(now + Duration::from_millis(200));
                    if let Some(incoming) = self.poll(deadline)? {
                        self.unexpected(incoming);
                    }
                }
                // Only at a boundary the pipeline reached (see `at_step_boundary`): one whose
                // nodes were lost instead stops like a failed run.
                Decision::Fail { .. } | Decision::Stop { .. } => {
                    return Err(LaunchError::Run(format!(
                        "{reason} (run directory {})",
                        self.cfg.run.dir.display()
                    )));
                }
                Decision::Continue => {
                    return Err(LaunchError::Protocol(format!(
                        "the elastic core kept a plan it was asked to restart: {reason}"
                    )));
                }
            }
        };
        self.publish(&plan)?;
        self.lost_incarnations.clear();
        for stale in self.stale_agents() {
            let reason = format!("left the plan at generation {}", plan.generation);
            if let Some((_, sender)) = self.agents.remove(&stale) {
                sender.send_and_close(&ToAgent::Refused { reason });
            }
        }
        self.layout = self
            .layout
            .with_layout(&self.cfg, plan.num_stages(), plan.replicas)?;
        let latest = store::committed_steps(&self.cfg)?.last().copied();
        let peers = self
            .peer_coverage()
            .map(|(step, nodes)| (step, self.snapshot_addrs(&nodes)));
        let (start, tier, reason) = recovery::next_start(peers, latest, self.state.step);
        info!(%reason, %tier, "state source");
        let resume_from = match &start {
            Start::Peers { step, .. } => Some(*step),
            Start::Resume(_) => latest,
            Start::Fresh | Start::InitFrom(_) => None,
        };
        self.start = start;
        events.push(RunEvent::Plan(PlanAdopted {
            generation: plan.generation,
            stages: plan.num_stages(),
            replicas: plan.replicas,
            nodes: plan.stages.clone(),
            resume_from,
            tier: Some(tier),
            waited_for_nodes_s: waiting_since.map(|t| t.elapsed().as_secs_f64()),
        }));
        Ok(tier)
    }

    /// The newest step before the one to run next (`state.step`) whose peer snapshots, on the
    /// agents still alive, cover the whole model (parameters and AdamW moments), with the agents
    /// that hold it.
    fn peer_coverage(&self) -> Option<(u64, Vec<NodeId>)> {
        self.peer_coverage_before(self.state.step)
    }

    /// The newest step before `next` whose peer snapshots the live agents cover completely, with
    /// the agents that hold it.
    fn peer_coverage_before(&self, next: u64) -> Option<(u64, Vec<NodeId>)> {
        if !self.cfg.elastic.peer_snapshots {
            return None;
        }
        let params = self.param_names();
        recovery::peer_coverage(
            &self.held,
            next,
            |step| crate::checkpointing::shard::with_moments(&params, step > 0),
            |n| self.agent_alive(n),
        )
    }

    /// The newest step up to `step` that tier-1 recovery could restart from now (the live
    /// agents hold its peer snapshots completely), for the step's metrics.
    pub(super) fn peer_snapshot_step(&self, step: u64) -> Option<u64> {
        self.peer_coverage_before(step.saturating_add(1))
            .map(|(step, _)| step)
    }

    /// Whether the peer snapshots of `step` cover the whole model on agents that stay past this
    /// step boundary (alive, and not leaving): the next plan can start from them, with no
    /// checkpoint.
    pub(super) fn peers_hold(&self, step: u64) -> bool {
        if !self.cfg.elastic.peer_snapshots {
            return false;
        }
        let names = crate::checkpointing::shard::with_moments(&self.param_names(), step > 0);
        let staying = |n: &NodeId| {
            self.agent_alive(n) && self.state.membership.status(n) != Some(&NodeStatus::Leaving)
        };
        recovery::peer_holders(&self.held, step, &names, staying).is_some()
    }

    /// The model's parameter names.
    fn param_names(&self) -> Vec<String> {
        crate::model::params::param_specs(&self.cfg.model)
            .into_iter()
            .map(|s| s.name)
            .collect()
    }

    /// Connections of agents whose node is dead (it left, or was declared dead).
    fn stale_agents(&self) -> Vec<u64> {
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

    fn kill_local_agents(&mut self) {
        for child in &mut self.local_agents {
            let _ = child.kill();
            let _ = child.wait();
        }
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

/// Most stage workers one node may offer.
const MAX_SLOTS: usize = 1024;

/// Checks a joining node's description (a peer's claims): its name appears in logs, events and
/// the plan, its address is handed to workers to connect to.
fn check_join(node: &elastic::NodeInfo) -> Result<(), peer_input::BadInput> {
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
fn accept_loop(listener: TcpListener, token: String, tx: Sender<Event>) -> std::io::Result<Gate> {
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

fn serve_connection(conn: u64, stream: TcpStream, peer: std::net::SocketAddr, tx: Sender<Event>) {
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

/// The `seqpipe agent` flags that carry `elastic.preemption_notice`, `metadata_endpoint` and
/// `metadata_poll_s` to a local agent.
fn preemption_args(elastic: &elastic::ElasticConfig) -> Vec<String> {
    let mut args = vec![
        "--preemption-notice".to_string(),
        elastic.preemption_notice.to_string(),
        "--metadata-poll-s".to_string(),
        elastic.metadata_poll_s.to_string(),
    ];
    if !elastic.metadata_endpoint.is_empty() {
        args.extend([
            "--metadata-endpoint".to_string(),
            elastic.metadata_endpoint.clone(),
        ]);
    }
    args
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
