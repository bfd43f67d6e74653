//! An in-process cluster for recovery scenarios (in the spirit of raft-rs's test `Network`): the
//! REAL coordinator and driver (`run_training`) and the REAL stage workers (`run_worker`) run as
//! threads of the test process and talk over loopback TCP; only the node agent is a fake — a
//! thread per node that speaks the agent's control protocol (join, heartbeats, worker exits,
//! `WorkersStopped`, `SnapshotHeld`, `Leaving`), serves a real peer-snapshot store, and starts
//! each worker as a thread with a [`KillSwitch`].
//!
//! Faults are injected at exact points of the workers' execution, never after a sleep: a scenario
//! lists [`Rule`]s ("when stage 2 is about to run its 5th action of step 3, kill its node"), and
//! each rule fires once, on the worker thread that reached the point. What a rule can do:
//! - kill a worker as SIGKILL would (its sockets close; its agent reports `signal: 9`),
//! - kill a node (its workers and its agent's connection and snapshot port),
//! - hang a worker (it stops with its sockets open; its neighbours' timeouts find it),
//! - silence a node (a partition: its agent stops heartbeating, its workers stop talking),
//! - give a node a preemption notice, start a new agent (a join, or a restarted agent),
//! - wait until the agents hold every peer snapshot of a step, so that what the coordinator
//!   knows at the fault does not depend on how fast background copies were.
//!
//! Every control link (an agent's, a worker's) reaches the coordinator through a relay of the
//! harness ([`links`]), so that a scenario can also cut one link, or hold one direction of one
//! link at a chosen message and deliver (or drop) what it held when an event says so — e.g. a
//! worker's `StepDone` held until the coordinator has handled its node's death.
//!
//! A run's outcome carries its `metrics.jsonl` events, its error if it failed (or why it stopped
//! early for preemption notices), and its final checkpoint, which scenarios compare with an
//! undisturbed run's ([`reference_state`]); a stopped run can be resumed from its checkpoint
//! ([`resume`]).

#![allow(dead_code)]

pub mod links;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, Once, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use elastic::preemption::Notice;
use trainer::config::Config;
use trainer::metrics::StepMetrics;
use trainer::plan::RunPlan;
use trainer::runtime::auth::{self, Purpose};
use trainer::runtime::control::{
    ControlSender, ControlStream, FromAgent, PEER_FAILURE_EXIT_CODE, ToAgent, ToWorker,
};
use trainer::runtime::events::{
    CheckpointCommitted, CheckpointFailed, NodeJoined, NodeLeft, NodeLost, PlanAdopted, Record,
    Recovered, RunEvent,
};
use trainer::runtime::kill_switch::{Ending, KillSwitch, Point, Verdict};
use trainer::runtime::peer_snapshots::{PutBounds, SnapshotStore, serve};
use trainer::runtime::recovery::{ResumePoint, Start, Tier};
use trainer::runtime::run::{LaunchOptions, run_training};
use trainer::runtime::worker::{WorkerArgs, WorkerError, run_worker};

use links::{Dir, End, Hold, Holds, Link, Msg};

/// The job token every scenario's coordinator, agents and workers share.
const TOKEN: &str = "in-process-harness-token";

/// How long a scenario may take before the harness gives up on it (a hang is a failure).
const SCENARIO_LIMIT: Duration = Duration::from_secs(60);

/// Sets the process-wide environment once, before any compute: the job token, one compute thread.
fn init_process() {
    static INIT: Once = Once::new();
    INIT.call_once(|| {
        // SAFETY: called once, before this test process starts any thread of its own that reads
        // the environment (the first scenario calls it before starting its cluster).
        unsafe {
            std::env::set_var(auth::TOKEN_ENV, TOKEN);
            std::env::set_var("RAYON_NUM_THREADS", "1");
            std::env::set_var("CANDLE_NUM_THREADS", "1");
        }
    });
}

/// The scenarios' job: a tiny model (4 layers) trained for [`STEPS`] steps on 4 stages,
/// checkpoints every 2 steps, no evaluation.
pub const STEPS: u64 = 6;

/// `section.key=value` settings of the scenarios' job (before each scenario's own).
pub fn base_sets() -> Vec<String> {
    [
        "model.vocab_size=64",
        "model.layers=4",
        "model.d_model=32",
        "model.heads=4",
        "model.max_seq_len=32",
        "train.seq_len=32",
        "train.micro_batch_size=2",
        "train.eval_every=0",
        "train.warmup_steps=2",
        "pipeline.stages=4",
        "pipeline.microbatches=4",
        "pipeline.splits=2",
        "checkpoint.every=2",
        "checkpoint.keep_last=3",
        "elastic.local_agents=false",
        // Every step copied (waiting for a slow copy rather than skipping it): the scenarios
        // fault a step once the copies of the one before are held.
        "elastic.peer_snapshot_max_skips=0",
        "elastic.heartbeat_s=0.2",
        "elastic.dead_after_s=10",
        "elastic.join_timeout_s=10",
        "run.threads_per_worker=1",
        "run.log=warn",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("train.steps={STEPS}")])
    .collect()
}

/// Forward and backward units of one stage in one step: micro-batches × splits × 2.
pub const UNITS_PER_STAGE: u64 = 4 * 2 * 2;

/// A fresh, empty directory for a scenario.
pub fn fresh_dir(name: &str) -> PathBuf {
    super::common::fresh_dir(&format!("scenario-{name}"))
}

// ---------------------------------------------------------------------------------------------
// Rules: what happens where.

/// A worker as the harness knows it.
#[derive(Clone, Debug)]
pub struct WorkerId {
    /// Its node.
    pub node: String,
    /// Its stage in its plan.
    pub stage: usize,
    /// Its plan generation.
    pub generation: u64,
    /// Started as a mid-step replacement (beside the node's running workers).
    pub replacement: bool,
}

/// Where in a worker's run a rule fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pos {
    /// Before action `index` of the step's action list.
    Action(usize),
    /// Before the last action of the step.
    LastAction,
    /// Having reported its part of the step done.
    StepDone,
    /// About to reduce its gradients with the other replicas of its stage, in this round.
    Reduce(u32),
    /// On receiving this control message (`run_step`, `apply`, `checkpoint`, `restore`,
    /// `restore_peers`, `relink`, `shutdown`) for the step.
    Message(&'static str),
}

/// The kind and step of a control message.
fn message_kind(msg: &ToWorker) -> (&'static str, Option<u64>) {
    match msg {
        ToWorker::Topology { .. } => ("topology", None),
        ToWorker::Relink { .. } => ("relink", None),
        ToWorker::RunStep { step, .. } => ("run_step", Some(*step)),
        ToWorker::Apply { step, .. } => ("apply", Some(*step)),
        ToWorker::Reduce { step, .. } => ("reduce", Some(*step)),
        ToWorker::Eval { .. } => ("eval", None),
        ToWorker::Checkpoint { step } => ("checkpoint", Some(*step)),
        ToWorker::Restore { step } => ("restore", Some(*step)),
        ToWorker::RestorePeers { step, .. } => ("restore_peers", Some(*step)),
        ToWorker::InitFrom { .. } => ("init_from", None),
        ToWorker::Shutdown => ("shutdown", None),
    }
}

type Matcher = Box<dyn Fn(&WorkerId, &Point<'_>) -> bool + Send + Sync>;
type Act = Box<dyn FnOnce(&Arc<Cluster>, &WorkerId) -> Verdict + Send>;

/// Fires `act` once, on the first worker thread that reaches a point `matcher` accepts.
pub struct Rule {
    matcher: Matcher,
    act: Mutex<Option<Act>>,
}

impl Rule {
    /// A rule for the worker of `stage` (a replacement only if `replacement`) at `pos` of `step`.
    pub fn at(
        stage: usize,
        step: u64,
        pos: Pos,
        act: impl FnOnce(&Arc<Cluster>, &WorkerId) -> Verdict + Send + 'static,
    ) -> Self {
        Self::matching(
            move |id, point| id.stage == stage && !id.replacement && reached(point, step, pos),
            act,
        )
    }

    /// A rule for the mid-step replacement of `stage` at `pos` of `step`.
    pub fn at_replacement(
        stage: usize,
        step: u64,
        pos: Pos,
        act: impl FnOnce(&Arc<Cluster>, &WorkerId) -> Verdict + Send + 'static,
    ) -> Self {
        Self::matching(
            move |id, point| id.stage == stage && id.replacement && reached(point, step, pos),
            act,
        )
    }

    /// A rule with its own matcher.
    pub fn matching(
        matcher: impl Fn(&WorkerId, &Point<'_>) -> bool + Send + Sync + 'static,
        act: impl FnOnce(&Arc<Cluster>, &WorkerId) -> Verdict + Send + 'static,
    ) -> Self {
        Self {
            matcher: Box::new(matcher),
            act: Mutex::new(Some(Box::new(act))),
        }
    }
}

/// Whether `point` is `pos` of `step`.
pub fn reached(point: &Point<'_>, step: u64, pos: Pos) -> bool {
    match (point, pos) {
        (Point::Action { step: s, index, .. }, Pos::Action(i)) => *s == step && *index == i,
        (
            Point::Action {
                step: s,
                index,
                count,
                ..
            },
            Pos::LastAction,
        ) => *s == step && index + 1 == *count,
        (Point::StepDone { step: s }, Pos::StepDone) => *s == step,
        (Point::Reduce { step: s, round }, Pos::Reduce(r)) => *s == step && *round == r,
        (Point::Message(msg), Pos::Message(kind)) => {
            let (k, s) = message_kind(msg);
            k == kind && s.is_none_or(|s| s == step)
        }
        _ => false,
    }
}

// ---------------------------------------------------------------------------------------------
// The cluster.

/// What a fake agent is told.
enum AgentMsg {
    Coordinator(std::io::Result<ToAgent>),
    /// A worker thread returned (or was ended).
    WorkerEnded {
        serial: u64,
        ending: Ending,
    },
    /// Kill the worker of `stage` as SIGKILL would, report it (at once, or `late`: just before
    /// handling the coordinator's next message), then answer.
    KillWorker {
        stage: usize,
        late: bool,
        done: Sender<()>,
    },
    /// The node dies: workers killed, connection and snapshot port closed; then answer.
    Die {
        done: Sender<()>,
    },
    /// A partition: stop sending anything; the node's workers stop at their next point.
    Silence {
        done: Sender<()>,
    },
    /// A preemption notice: SIGTERM's (`notice` none) or the cloud's, as the real agent gets
    /// them; answers (if asked to) once the node's workers know and `Leaving` is sent.
    Leave {
        notice: Option<Notice>,
        done: Option<Sender<()>>,
    },
}

/// A fake agent's handle.
struct AgentHandle {
    tx: Sender<AgentMsg>,
    thread: Option<JoinHandle<()>>,
}

/// A worker a fake agent started.
struct Running {
    serial: u64,
    id: WorkerId,
    switch: KillSwitch,
}

/// The shared state of one scenario's cluster (what rules act on).
pub struct Cluster {
    pub dir: PathBuf,
    cfg: Config,
    addr: String,
    rules: Vec<Rule>,
    /// Current agent incarnation per node name.
    agents: Mutex<BTreeMap<String, AgentHandle>>,
    /// Nodes whose workers must hang at their next point (silenced).
    frozen: Mutex<BTreeSet<String>>,
    /// Peer snapshots reported to the coordinator: (node, step) → names; nodes that died are
    /// removed. Signalled on every change.
    held: Mutex<BTreeMap<(String, u64), BTreeSet<String>>>,
    held_changed: Condvar,
    /// A node whose agent, having stored a peer snapshot of the step, holds back its answer (and
    /// its report) until released: the sending worker's copy stays in flight.
    stalled_puts: Mutex<Option<(String, u64)>>,
    stalled_changed: Condvar,
    /// Every worker started: (id, thread).
    workers: Mutex<Vec<(WorkerId, JoinHandle<()>)>>,
    next_serial: AtomicU64,
    /// Agents fenced by the coordinator (they heard `Refused`). Signalled on every change.
    fenced: Mutex<Vec<String>>,
    fenced_changed: Condvar,
    /// A fenced agent joins again as a new incarnation, as the real agent does
    /// ([`Cluster::rejoin_when_fenced`]).
    rejoin_fenced: AtomicBool,
    /// Earlier incarnations' agents (ended at teardown).
    retired: Mutex<Vec<AgentHandle>>,
    /// Agents report the exit of a worker that ended by itself only just before they handle the
    /// coordinator's next message (see [`run_reaping_late`]).
    reap_late: bool,
    /// The holds armed on the control links ([`Cluster::hold`]).
    holds: Holds,
    /// Every control link relayed so far, in the order the nodes connected.
    links: Arc<Mutex<Vec<Arc<Link>>>>,
    /// Set at teardown: relays stop waiting for their node to connect.
    closing: Arc<AtomicBool>,
}

impl Cluster {
    fn on_point(self: &Arc<Self>, id: &WorkerId, point: Point<'_>) -> Verdict {
        if self
            .frozen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&id.node)
        {
            return Verdict::Hang;
        }
        for rule in &self.rules {
            if (rule.matcher)(id, &point) {
                let act = rule.act.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(act) = act {
                    return act(self, id);
                }
            }
        }
        Verdict::Go
    }

    fn agent_tx(&self, node: &str) -> Sender<AgentMsg> {
        self.agents.lock().unwrap_or_else(|p| p.into_inner())[node]
            .tx
            .clone()
    }

    fn ask(&self, node: &str, msg: impl FnOnce(Sender<()>) -> AgentMsg) {
        let (done, wait) = channel();
        if self.agent_tx(node).send(msg(done)).is_ok() {
            let _ = wait.recv_timeout(SCENARIO_LIMIT);
        }
    }

    /// Kills the worker of `stage` on `node` as SIGKILL would; its agent reports the exit.
    pub fn kill_worker(&self, node: &str, stage: usize) {
        self.ask(node, |done| AgentMsg::KillWorker {
            stage,
            late: false,
            done,
        });
    }

    /// Kills the worker of `stage` on `node` as SIGKILL would; its agent notices late: it reports
    /// the exit just before it handles the coordinator's next message (a busy agent's reaping).
    /// The coordinator then learns of the death from the worker's closed connection first.
    pub fn kill_worker_reaped_late(&self, node: &str, stage: usize) {
        self.ask(node, |done| AgentMsg::KillWorker {
            stage,
            late: true,
            done,
        });
    }

    /// Kills `node`: its workers, its agent's connection and its snapshot port.
    pub fn kill_node(&self, node: &str) {
        self.ask(node, |done| AgentMsg::Die { done });
    }

    /// [`Cluster::kill_node`], then waits until the coordinator has handled the close of the
    /// node's agent connection (it closes its end then): the coordinator knows of the death
    /// before anything a [`Hold`] keeps of the node's workers reaches it.
    pub fn kill_node_seen_first(&self, node: &str) {
        let agent = self.link(|end| matches!(end, End::Agent { node: n } if n == node));
        self.kill_node(node);
        agent.wait_coordinator_closed();
    }

    /// From now on an agent that the coordinator fences joins again at once as a new
    /// incarnation of its node (its workers and peer snapshots gone), as the real agent does.
    pub fn rejoin_when_fenced(&self) {
        self.rejoin_fenced.store(true, Ordering::SeqCst);
    }

    /// Waits until `count` agents have been fenced in all (at most the scenario limit).
    pub fn wait_fenced(&self, count: usize) {
        let fenced = self.fenced.lock().unwrap_or_else(|p| p.into_inner());
        let (fenced, _) = self
            .fenced_changed
            .wait_timeout_while(fenced, SCENARIO_LIMIT, |f| f.len() < count)
            .unwrap_or_else(|p| p.into_inner());
        assert!(
            fenced.len() >= count,
            "only {:?} were fenced, {count} expected",
            *fenced
        );
    }

    /// Arms a hold: the first message `matcher` accepts (on any link, in either direction) stops
    /// that direction of its link until the hold is released or dropped.
    pub fn hold(
        &self,
        matcher: impl Fn(&End, Dir, &Msg) -> bool + Send + Sync + 'static,
    ) -> Arc<Hold> {
        let hold = Arc::new(Hold::new(matcher));
        self.holds
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Arc::clone(&hold));
        hold
    }

    /// The newest control link whose end `pick` accepts (panics if there is none).
    pub fn link(&self, pick: impl Fn(&End) -> bool) -> Arc<Link> {
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        match links.iter().rev().find(|l| pick(&l.end)) {
            Some(link) => Arc::clone(link),
            None => panic!(
                "no such control link among {:?}",
                links.iter().map(|l| &l.end).collect::<Vec<_>>()
            ),
        }
    }

    /// Cuts the control connection of `node`'s current agent: the coordinator sees it close, and
    /// the agent ends as a real one does when its coordinator goes away (its workers with it).
    pub fn cut_agent_link(&self, node: &str) {
        self.link(|end| matches!(end, End::Agent { node: n } if n == node))
            .cut();
    }

    /// Cuts the control connection of the newest worker of `stage` (the worker lives on; its
    /// next control read or write fails).
    pub fn cut_worker_link(&self, stage: usize) {
        self.link(|end| matches!(end, End::Worker(id) if id.stage == stage))
            .cut();
    }

    /// Cuts `node` off: its agent stops heartbeating and reporting, its workers stop at their
    /// next point with their connections open.
    pub fn silence(&self, node: &str) {
        self.frozen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.to_string());
        self.ask(node, |done| AgentMsg::Silence { done });
    }

    /// Gives `node` a preemption notice.
    pub fn preempt(&self, node: &str) {
        let _ = self.agent_tx(node).send(AgentMsg::Leave {
            notice: None,
            done: None,
        });
    }

    /// Gives `node` the cloud's preemption notice `notice` and waits until its agent has acted on
    /// it: its workers' next step reports say they leave, and its `Leaving` (with the notice) is
    /// on its way, ahead of anything the agent sends afterwards (e.g. its answer to a held
    /// `StopWorkers`, once released).
    pub fn preempt_now(&self, node: &str, notice: Notice) {
        self.ask(node, |done| AgentMsg::Leave {
            notice: Some(notice),
            done: Some(done),
        });
    }

    /// Waits until, for every tensor of the model's state after `step`, `copies` live agents
    /// have reported holding it (each worker copies to its own node's agent and its buddy's).
    pub fn wait_held(&self, step: u64, copies: usize) {
        let params: Vec<String> = trainer::model::params::param_specs(&self.cfg.model)
            .into_iter()
            .map(|s| s.name)
            .collect();
        let names = trainer::checkpointing::shard::with_moments(&params, step > 0);
        let started = Instant::now();
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let covered = names.iter().all(|n| {
                held.iter()
                    .filter(|((_, s), h)| *s == step && h.contains(n))
                    .count()
                    >= copies
            });
            if covered {
                return;
            }
            assert!(
                started.elapsed() < SCENARIO_LIMIT,
                "the agents never held {copies} copies of step {step}'s state"
            );
            held = self
                .held_changed
                .wait_timeout(held, Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Starts a fake agent for `node` (a joiner, or a new incarnation of a node) and waits for
    /// the coordinator's welcome.
    pub fn start_agent(self: &Arc<Self>, node: &str) {
        let (tx, rx) = channel();
        let (welcomed, wait) = channel();
        let cluster = Arc::clone(self);
        let name = node.to_string();
        let agent_tx = tx.clone();
        let thread = std::thread::Builder::new()
            .name(format!("agent-{node}"))
            .spawn(move || agent_main(cluster, name, rx, agent_tx, welcomed))
            .unwrap();
        let old = self
            .agents
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                node.to_string(),
                AgentHandle {
                    tx,
                    thread: Some(thread),
                },
            );
        // An agent restarted under the same name: the old one's thread is left to its fate
        // (killed or silenced by the rule that restarted it); teardown ends it.
        if let Some(old) = old {
            self.retired
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(old);
        }
        wait.recv_timeout(SCENARIO_LIMIT)
            .expect("the coordinator did not welcome the agent");
    }

    /// Until [`Cluster::release_puts`], the agent of `node` answers no peer snapshot of `step`
    /// (nor reports it): the copies sent to it stay in flight, as over a slow network.
    pub fn stall_puts(&self, node: &str, step: u64) {
        *self.stalled_puts.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((node.to_string(), step));
    }

    /// Lets the stalled answers of [`Cluster::stall_puts`] go.
    pub fn release_puts(&self) {
        *self.stalled_puts.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.stalled_changed.notify_all();
    }

    /// Holds back the answer to a stored peer snapshot while it is stalled (at most the scenario
    /// limit).
    fn wait_while_stalled(&self, node: &str, step: u64) {
        let stalled = self.stalled_puts.lock().unwrap_or_else(|p| p.into_inner());
        let _ = self
            .stalled_changed
            .wait_timeout_while(stalled, SCENARIO_LIMIT, |s| {
                s.as_ref().is_some_and(|(n, st)| n == node && *st == step)
            })
            .unwrap_or_else(|p| p.into_inner());
    }

    fn record_held(&self, node: &str, step: u64, names: Vec<String>) {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((node.to_string(), step))
            .or_default()
            .extend(names);
        self.held_changed.notify_all();
    }

    fn forget_held(&self, node: &str) {
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(n, _), _| n != node);
        self.held_changed.notify_all();
    }
}

impl Cluster {
    fn new(dir: PathBuf, cfg: Config, addr: String, rules: Vec<Rule>, reap_late: bool) -> Self {
        Self {
            dir,
            cfg,
            addr,
            rules,
            agents: Mutex::default(),
            frozen: Mutex::default(),
            held: Mutex::default(),
            held_changed: Condvar::new(),
            stalled_puts: Mutex::default(),
            stalled_changed: Condvar::new(),
            workers: Mutex::default(),
            next_serial: AtomicU64::new(0),
            fenced: Mutex::default(),
            fenced_changed: Condvar::new(),
            rejoin_fenced: AtomicBool::new(false),
            retired: Mutex::default(),
            reap_late,
            holds: Arc::default(),
            links: Arc::default(),
            closing: Arc::default(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The fake agent.

/// Connects to the coordinator (retrying while it is not listening yet) and authenticates;
/// returns the stream and a clone of its socket (to close it as a dying host would).
fn connect_control(addr: &str) -> (ControlStream, TcpStream) {
    let deadline = Instant::now() + SCENARIO_LIMIT;
    let mut stream = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                assert!(
                    e.kind() == std::io::ErrorKind::ConnectionRefused,
                    "connecting to {addr}: {e}"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("the coordinator at {addr} never listened: {e}"),
        }
    };
    auth::connect(&mut stream, TOKEN, Purpose::Control).expect("authenticating to the coordinator");
    let raw = stream.try_clone().expect("control socket");
    (ControlStream::new(stream).expect("control stream"), raw)
}

/// How a worker's end is reported (`WorkerExited`), as the real agent words it.
fn exited(w: &Running, ending: Ending) -> FromAgent {
    let (code, status) = match ending {
        Ending::Killed => (None, "signal: 9 (SIGKILL)".to_string()),
        Ending::Exited(c) => (Some(c), format!("exit status: {c}")),
    };
    FromAgent::WorkerExited {
        generation: w.id.generation,
        stage: w.id.stage,
        code,
        status,
        log_tail: String::new(),
        log: format!("(in-process worker of stage {})", w.id.stage),
    }
}

/// One fake agent incarnation: joins, heartbeats, runs workers as threads, reports.
fn agent_main(
    cluster: Arc<Cluster>,
    name: String,
    rx: Receiver<AgentMsg>,
    tx: Sender<AgentMsg>,
    welcomed: Sender<()>,
) {
    // The node's peer-snapshot store, served on its own port as the real agent does.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let snapshot_addr = listener.local_addr().unwrap().to_string();
    let store = Arc::new(Mutex::new(SnapshotStore::default()));
    let report_to: Arc<Mutex<Option<ControlSender>>> = Arc::default();
    let plans = Arc::clone(&store);
    let gate = {
        let (report_to, cluster, name) =
            (Arc::clone(&report_to), Arc::clone(&cluster), name.clone());
        serve(listener, TOKEN.into(), store, move |step, names| {
            cluster.wait_while_stalled(&name, step);
            // Reported to the coordinator first, then recorded for `wait_held`.
            let sender = report_to.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some(sender) = sender {
                let _ = sender.send(&FromAgent::SnapshotHeld {
                    step,
                    names: names.clone(),
                });
                cluster.record_held(&name, step, names);
            }
        })
        .unwrap()
    };
    let relay = links::relay(
        End::Agent { node: name.clone() },
        &cluster.addr,
        &cluster.holds,
        &cluster.links,
        &cluster.closing,
    );
    let (mut control, raw) = connect_control(&relay.addr);
    control
        .send(&FromAgent::Join {
            node: elastic::NodeInfo::new(name.clone(), 1, snapshot_addr),
            pid: std::process::id(),
        })
        .unwrap();
    let heartbeat = match control.recv::<ToAgent>() {
        Ok(ToAgent::Welcome { heartbeat_s, .. }) => Duration::from_secs_f64(heartbeat_s),
        other => panic!("agent {name}: expected a welcome, got {other:?}"),
    };
    let sender = control.sender();
    *report_to.lock().unwrap_or_else(|p| p.into_inner()) = Some(sender.clone());
    let _ = welcomed.send(());
    {
        let tx = tx.clone();
        std::thread::Builder::new()
            .name(format!("agent-{name}-recv"))
            .spawn(move || {
                loop {
                    let msg = control.recv::<ToAgent>();
                    let closed = msg.is_err();
                    if tx.send(AgentMsg::Coordinator(msg)).is_err() || closed {
                        return;
                    }
                }
            })
            .unwrap();
    }
    let mut workers: Vec<Running> = Vec::new();
    let mut late_reports: Vec<FromAgent> = Vec::new();
    let mut silent = false;
    let mut rejoin = false;
    let mut next_heartbeat = Instant::now() + heartbeat;
    let end_all = |workers: &mut Vec<Running>| {
        for w in workers.drain(..) {
            w.switch.kill();
        }
    };
    loop {
        if !silent && Instant::now() >= next_heartbeat {
            next_heartbeat = Instant::now() + heartbeat;
            let _ = sender.send(&FromAgent::Heartbeat);
        }
        let wait = next_heartbeat.saturating_duration_since(Instant::now());
        let msg = match rx.recv_timeout(wait) {
            Ok(msg) => msg,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => break,
        };
        if matches!(msg, AgentMsg::Coordinator(_)) {
            for report in late_reports.drain(..) {
                let _ = sender.send(&report);
            }
        }
        match msg {
            // A node cut off hears nothing from the coordinator any more.
            AgentMsg::Coordinator(_) if silent => {}
            AgentMsg::Coordinator(Ok(ToAgent::StartWorkers {
                generation,
                first_step,
                stages,
                config,
                snapshot_to,
                session,
                dump_grads,
                keep_running,
            })) => {
                // As the real agent: the plan bounds what peers may store.
                plans
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .plan(PutBounds::from_config(generation, first_step, &config));
                if !keep_running {
                    end_all(&mut workers);
                }
                for stage in stages {
                    let id = WorkerId {
                        node: name.clone(),
                        stage,
                        generation,
                        replacement: keep_running,
                    };
                    let spec = WorkerSpec {
                        config: &config,
                        snapshot_to: &snapshot_to,
                        session: &session,
                        dump_grads: dump_grads.clone(),
                    };
                    workers.push(start_worker(&cluster, id, &spec, tx.clone()));
                }
            }
            AgentMsg::Coordinator(Ok(ToAgent::StopWorkers { generation })) => {
                workers.retain(|w| {
                    let stop = w.id.generation <= generation;
                    if stop {
                        w.switch.kill();
                    }
                    !stop
                });
                let _ = sender.send(&FromAgent::WorkersStopped { generation });
            }
            AgentMsg::Coordinator(Ok(ToAgent::Refused { .. })) => {
                cluster
                    .fenced
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(name.clone());
                cluster.fenced_changed.notify_all();
                rejoin = cluster.rejoin_fenced.load(Ordering::SeqCst);
                break;
            }
            AgentMsg::Coordinator(Ok(ToAgent::Shutdown) | Err(_)) => break,
            AgentMsg::Coordinator(Ok(ToAgent::Welcome { .. })) => {}
            AgentMsg::WorkerEnded { serial, ending } => {
                if let Some(i) = workers.iter().position(|w| w.serial == serial) {
                    let w = workers.remove(i);
                    if cluster.reap_late {
                        late_reports.push(exited(&w, ending));
                    } else if !silent {
                        let _ = sender.send(&exited(&w, ending));
                    }
                }
            }
            AgentMsg::KillWorker { stage, late, done } => {
                if let Some(i) = workers.iter().rposition(|w| w.id.stage == stage) {
                    let w = workers.remove(i);
                    let ending = w.switch.kill();
                    if late {
                        late_reports.push(exited(&w, ending));
                    } else {
                        let _ = sender.send(&exited(&w, ending));
                    }
                }
                let _ = done.send(());
            }
            AgentMsg::Die { done } => {
                *report_to.lock().unwrap_or_else(|p| p.into_inner()) = None;
                gate.stop();
                cluster.forget_held(&name);
                let _ = raw.shutdown(Shutdown::Both);
                end_all(&mut workers);
                let _ = done.send(());
                break;
            }
            AgentMsg::Silence { done } => {
                silent = true;
                *report_to.lock().unwrap_or_else(|p| p.into_inner()) = None;
                let _ = done.send(());
            }
            AgentMsg::Leave { notice, done } => {
                for w in &workers {
                    w.switch.notify_leaving();
                }
                let _ = sender.send(&FromAgent::Leaving { notice });
                if let Some(done) = done {
                    let _ = done.send(());
                }
            }
        }
    }
    // Whatever ended this incarnation, its workers end with it (the real agent stops them). A
    // silenced node stays in the loop, its workers hung, until it dies (teardown).
    *report_to.lock().unwrap_or_else(|p| p.into_inner()) = None;
    end_all(&mut workers);
    let _ = raw.shutdown(Shutdown::Both);
    drop(gate);
    if rejoin {
        cluster.start_agent(&name);
    }
}

/// What a worker is started with.
struct WorkerSpec<'a> {
    config: &'a str,
    snapshot_to: &'a [String],
    session: &'a str,
    dump_grads: Option<PathBuf>,
}

/// Starts a worker thread as the real agent starts a worker process (same arguments), with a
/// kill switch whose points go to the cluster's rules.
fn start_worker(
    cluster: &Arc<Cluster>,
    id: WorkerId,
    spec: &WorkerSpec<'_>,
    agent: Sender<AgentMsg>,
) -> Running {
    let serial = cluster.next_serial.fetch_add(1, Ordering::SeqCst);
    let logs = cluster.dir.join("agents").join(&id.node).join(spec.session);
    std::fs::create_dir_all(&logs).unwrap();
    let config = logs.join(format!(
        "stage-{}-gen-{}-{serial}.toml",
        id.stage, id.generation
    ));
    std::fs::write(&config, spec.config).unwrap();
    let switch = {
        let (cluster, id) = (Arc::clone(cluster), id.clone());
        KillSwitch::new(move |point| cluster.on_point(&id, point))
    };
    let relay = links::relay(
        End::Worker(id.clone()),
        &cluster.addr,
        &cluster.holds,
        &cluster.links,
        &cluster.closing,
    );
    let args = WorkerArgs {
        control: relay.addr,
        stage: id.stage,
        generation: id.generation,
        bind: "127.0.0.1".into(),
        config,
        dump_grads: spec.dump_grads.clone(),
        snapshot_to: spec.snapshot_to.to_vec(),
        kill_switch: Some(switch.clone()),
    };
    let thread_switch = switch.clone();
    let thread = std::thread::Builder::new()
        .name(format!("worker-{}-{}", id.node, id.stage))
        .spawn(move || {
            // The exit code `seqpipe worker` would end with (101: a panic).
            let code =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match run_worker(args) {
                    Ok(()) => 0,
                    Err(WorkerError::Transport(_) | WorkerError::Collective(_)) => {
                        i32::from(PEER_FAILURE_EXIT_CODE)
                    }
                    Err(_) => 1,
                }))
                .unwrap_or(101);
            // The process ends: its sockets close.
            let ending = thread_switch.end(Ending::Exited(code));
            let _ = agent.send(AgentMsg::WorkerEnded { serial, ending });
        })
        .unwrap();
    cluster
        .workers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((id.clone(), thread));
    Running { serial, id, switch }
}

// ---------------------------------------------------------------------------------------------
// Running a scenario.

/// What a scenario's run did.
pub struct Outcome {
    /// The run directory.
    pub dir: PathBuf,
    /// The coordinator's result: the last step (`Err`: its error message).
    pub result: Result<u64, String>,
    /// Why the run stopped early for preemption notices, if it did (at the boundary of its last
    /// step, with that step's checkpoint committed: `seqpipe train` exits 75 then).
    pub preempted: Option<String>,
    /// The events of `metrics.jsonl`, in order.
    pub events: Vec<RunEvent>,
    /// Every line of `metrics.jsonl` (steps and events).
    pub records: Vec<Record>,
    /// Every worker started: node, stage, generation, replacement.
    pub workers: Vec<WorkerId>,
    /// Nodes whose agent was fenced.
    pub fenced: Vec<String>,
    /// Seconds the run took.
    pub seconds: f64,
}

/// Runs the scenario's job (`base_sets` then `sets`) on `nodes` fake agents named `node-0`…,
/// with `rules`, to its end; every worker and agent is gone when it returns.
pub fn run(name: &str, nodes: usize, sets: &[&str], rules: Vec<Rule>) -> Outcome {
    run_cluster(name, nodes, sets, rules, Launch::default())
}

/// Resumes the run of `from` (its run directory, its newest committed checkpoint) as
/// `seqpipe resume` does, with the same job settings (`base_sets` then `sets`) on `nodes` fresh
/// fake agents, to its end. The resumed run appends to the same `metrics.jsonl`: its outcome's
/// events are both runs'.
pub fn resume(name: &str, from: &Outcome, nodes: usize, sets: &[&str]) -> Outcome {
    let launch = Launch {
        run_dir: Some(from.dir.clone()),
        start: Start::Resume(ResumePoint::Latest),
        reap_late: false,
    };
    run_cluster(name, nodes, sets, Vec::new(), launch)
}

/// [`run`] with agents that reap their workers late: a worker that ends by itself is reported
/// just before its agent handles the coordinator's next message, so the coordinator hears the
/// worker's own last words (its `Failed` report) before its agent's `WorkerExited`. A real agent
/// reaps every 20 ms, which makes that order likely but not certain.
pub fn run_reaping_late(name: &str, nodes: usize, sets: &[&str], rules: Vec<Rule>) -> Outcome {
    let launch = Launch {
        reap_late: true,
        ..Launch::default()
    };
    run_cluster(name, nodes, sets, rules, launch)
}

/// How a scenario's run is launched.
#[derive(Default)]
struct Launch {
    /// The run directory: an earlier run's (to resume it), or a fresh one in the scenario's.
    run_dir: Option<PathBuf>,
    /// Where the state comes from.
    start: Start,
    /// Agents reap their workers late ([`run_reaping_late`]).
    reap_late: bool,
}

fn run_cluster(
    name: &str,
    nodes: usize,
    sets: &[&str],
    rules: Vec<Rule>,
    launch: Launch,
) -> Outcome {
    init_process();
    let started = Instant::now();
    let dir = fresh_dir(name);
    let run_dir = launch.run_dir.unwrap_or_else(|| dir.join("run"));
    let (start, reap_late) = (launch.start, launch.reap_late);
    let mut all: Vec<String> = base_sets();
    all.extend(sets.iter().map(|s| s.to_string()));
    all.push(format!("run.dir={}", run_dir.display()));
    // Port 0: the coordinator binds a free port and says which (a port picked here and bound
    // there could be taken in between by the many sockets of the scenarios running beside it).
    all.push("elastic.listen=127.0.0.1:0".into());
    let cfg = Config::load(None, &all).expect("the scenario's config");
    let (listening, bound) = channel();
    let job = cfg.clone();
    let coordinator = std::thread::Builder::new()
        .name("coordinator".into())
        .spawn(move || {
            let plan = RunPlan::decide(&job).map_err(|e| e.to_string())?;
            run_training(
                &job,
                &plan,
                &LaunchOptions {
                    quiet: true,
                    start,
                    listening: Some(listening),
                    ..LaunchOptions::default()
                },
            )
            .map(|s| (s.last_step, s.preempted))
            .map_err(|e| e.to_string())
        })
        .unwrap();
    let addr = match bound.recv_timeout(SCENARIO_LIMIT) {
        Ok(addr) => addr,
        Err(_) => panic!(
            "scenario {name}: the coordinator never listened: {:?}",
            coordinator.join()
        ),
    };
    let cluster = Arc::new(Cluster::new(
        dir.clone(),
        cfg.clone(),
        addr,
        rules,
        reap_late,
    ));
    for i in 0..nodes {
        cluster.start_agent(&format!("node-{i}"));
    }
    let deadline = Instant::now() + SCENARIO_LIMIT;
    while !coordinator.is_finished() {
        assert!(
            Instant::now() < deadline,
            "scenario {name} did not finish within {SCENARIO_LIMIT:?} ({})",
            run_dir.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let (result, preempted) = match coordinator.join().expect("the coordinator panicked") {
        Ok((last_step, preempted)) => (Ok(last_step), preempted),
        Err(e) => (Err(e), None),
    };
    let workers = cluster
        .workers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(id, _)| id.clone())
        .collect();
    teardown(&cluster);
    let records = metrics_records(&run_dir);
    let events = records
        .iter()
        .filter_map(Record::as_event)
        .cloned()
        .collect();
    let fenced = cluster
        .fenced
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    Outcome {
        dir: run_dir,
        result,
        preempted,
        events,
        records,
        workers,
        fenced,
        seconds: started.elapsed().as_secs_f64(),
    }
}

/// Ends every agent (killing whatever workers are left) and joins every thread of the cluster.
fn teardown(cluster: &Arc<Cluster>) {
    cluster.closing.store(true, Ordering::SeqCst);
    let mut handles: Vec<AgentHandle> =
        std::mem::take(&mut *cluster.agents.lock().unwrap_or_else(|p| p.into_inner()))
            .into_values()
            .collect();
    handles.extend(std::mem::take(
        &mut *cluster.retired.lock().unwrap_or_else(|p| p.into_inner()),
    ));
    for h in &handles {
        let (done, _wait) = channel();
        let _ = h.tx.send(AgentMsg::Die { done });
    }
    for mut h in handles {
        drop(h.tx);
        if let Some(t) = h.thread.take() {
            t.join().expect("an agent thread panicked");
        }
    }
    // A worker thread ends once its switch is ended (its agent ended it) and it notices: at its
    // next point or socket operation — or, waiting for a connection that will never come, at its
    // timeout. Those are left to end on their own: their sockets are closed already.
    let workers = std::mem::take(&mut *cluster.workers.lock().unwrap_or_else(|p| p.into_inner()));
    let deadline = Instant::now() + Duration::from_secs(2);
    for (id, t) in workers {
        while !t.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if t.is_finished() && t.join().is_err() {
            panic!("the worker thread of {id:?} panicked");
        }
    }
}

/// The lines of `metrics.jsonl`, typed (none if the run wrote none); every line must be a step
/// record or an event of [`RunEvent`]'s vocabulary (the runtime writes nothing else).
fn metrics_records(run_dir: &Path) -> Vec<Record> {
    if !run_dir.join("metrics.jsonl").exists() {
        return Vec::new();
    }
    super::common::records(run_dir)
}

/// Every tensor of the newest committed checkpoint under `run_dir`, with its step.
pub fn final_state(run_dir: &Path) -> (u64, BTreeMap<String, Vec<u8>>) {
    super::common::final_state(&super::common::ckpt_url(run_dir))
}

/// The final state of the scenarios' job run undisturbed on 4 nodes (computed once).
pub fn reference_state() -> &'static BTreeMap<String, Vec<u8>> {
    static REFERENCE: OnceLock<BTreeMap<String, Vec<u8>>> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let out = run("reference", 4, &[], Vec::new());
        assert_eq!(out.result, Ok(STEPS), "the undisturbed run failed");
        assert!(
            out.lost().is_empty(),
            "the undisturbed run lost a node: {:?}",
            out.events
        );
        let (step, state) = final_state(&out.dir);
        assert_eq!(step, STEPS);
        state
    })
}

impl Outcome {
    /// Asserts that the run finished every step and its final state is bit-identical to the
    /// undisturbed run's.
    pub fn assert_bit_identical(&self) {
        assert_eq!(
            self.result,
            Ok(STEPS),
            "the run did not finish; events: {:#?}",
            self.events
        );
        let (step, state) = final_state(&self.dir);
        assert_eq!(step, STEPS);
        let reference = reference_state();
        let differing: Vec<&String> = reference
            .iter()
            .filter(|(n, b)| state.get(*n) != Some(*b))
            .map(|(n, _)| n)
            .collect();
        assert!(
            differing.is_empty() && state.len() == reference.len(),
            "{}: final state differs from the undisturbed run in {differing:?}",
            self.dir.display()
        );
    }

    /// The events of the kind `pick` takes, in order.
    pub fn events_of<'a, T>(&'a self, pick: impl Fn(&'a RunEvent) -> Option<&'a T>) -> Vec<&'a T> {
        self.events.iter().filter_map(pick).collect()
    }

    /// The `recovered` events, in order.
    pub fn recoveries(&self) -> Vec<&Recovered> {
        self.events_of(|e| match e {
            RunEvent::Recovered(r) => Some(r),
            _ => None,
        })
    }

    /// The `node_lost` events, in order.
    pub fn lost(&self) -> Vec<&NodeLost> {
        self.events_of(|e| match e {
            RunEvent::NodeLost(l) => Some(l),
            _ => None,
        })
    }

    /// The `plan` events, in order.
    pub fn plans(&self) -> Vec<&PlanAdopted> {
        self.events_of(|e| match e {
            RunEvent::Plan(p) => Some(p),
            _ => None,
        })
    }

    /// The `node_left` events, in order.
    pub fn left(&self) -> Vec<&NodeLeft> {
        self.events_of(|e| match e {
            RunEvent::NodeLeft(l) => Some(l),
            _ => None,
        })
    }

    /// The `node_joined` events, in order.
    pub fn joined(&self) -> Vec<&NodeJoined> {
        self.events_of(|e| match e {
            RunEvent::NodeJoined(j) => Some(j),
            _ => None,
        })
    }

    /// The `checkpoint` events (committed checkpoints), in order.
    pub fn checkpoints(&self) -> Vec<&CheckpointCommitted> {
        self.events_of(|e| match e {
            RunEvent::Checkpoint(c) => Some(c),
            _ => None,
        })
    }

    /// The `checkpoint_failed` events, in order.
    pub fn checkpoint_failures(&self) -> Vec<&CheckpointFailed> {
        self.events_of(|e| match e {
            RunEvent::CheckpointFailed(c) => Some(c),
            _ => None,
        })
    }

    /// The record of step `step` (its loss line; the last one if the step was redone).
    pub fn step_record(&self, step: u64) -> &StepMetrics {
        self.records
            .iter()
            .rev()
            .filter_map(Record::as_step)
            .find(|s| s.step == step)
            .unwrap_or_else(|| panic!("no record of step {step}"))
    }

    /// The one `recovered` event; panics unless there is exactly one.
    pub fn the_recovery(&self) -> &Recovered {
        let r = self.recoveries();
        assert_eq!(r.len(), 1, "expected one recovery, got {:#?}", self.events);
        r[0]
    }

    /// Asserts the one recovery's tier, lost steps and stages before/after.
    pub fn assert_recovery(
        &self,
        tier: Tier,
        lost_steps: u64,
        stages: (usize, usize),
    ) -> &Recovered {
        let r = self.the_recovery();
        assert_eq!(
            (r.tier, r.lost_steps, r.stages_before, r.stages_after),
            (tier, lost_steps, stages.0, stages.1),
            "{:#?}",
            self.events
        );
        r
    }

    /// Asserts that mid-step recovery was not even tried: no replacement worker was started and
    /// no loss was recorded as a mid-step one.
    pub fn assert_no_mid_step_attempt(&self) {
        let replacements: Vec<&WorkerId> = self.workers.iter().filter(|w| w.replacement).collect();
        assert!(
            replacements.is_empty(),
            "mid-step replacements were started: {replacements:?}"
        );
        assert!(
            !self.lost().iter().any(|e| e.mid_step == Some(true)),
            "{:#?}",
            self.events
        );
    }

    /// The `node_lost` events' nodes, in order.
    pub fn lost_nodes(&self) -> Vec<String> {
        self.lost().iter().map(|e| e.node.to_string()).collect()
    }
}
