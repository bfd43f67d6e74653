//! An in-process cluster for recovery scenarios (in the spirit of raft-rs's test `Network`): the
//! REAL coordinator and driver (`run_training`), the REAL node agents (`run_agent_with`) and the
//! REAL stage workers (`run_worker`) run as threads of the test process and talk over loopback
//! TCP. Each agent runs behind hooks of the harness ([`agents`]): its workers are threads with a
//! kill switch (`trainer::runtime::kill_switch`), and the agent itself has one, so that killing a
//! node ends it as SIGKILL ends the agent's process.
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

mod agents;
pub mod links;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Condvar, Mutex, Once, OnceLock};
use std::time::{Duration, Instant};

use elastic::preemption::Notice;
use trainer::config::Config;
use trainer::metrics::StepMetrics;
use trainer::plan::RunPlan;
use trainer::runtime::agent::Preempted;
use trainer::runtime::auth;
use trainer::runtime::control::ToWorker;
use trainer::runtime::events::{
    CheckpointCommitted, CheckpointFailed, NodeJoined, NodeLeft, NodeLost, PlanAdopted, Record,
    Recovered, RunEvent,
};
use trainer::runtime::kill_switch::{Point, Verdict};
use trainer::runtime::recovery::{ResumePoint, Start, Tier};
use trainer::runtime::run::{LaunchOptions, run_training};

use agents::{AgentHandle, WorkerSlot};
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

/// A rule's act: kills the worker that reached the point (its agent reports `signal: 9`), once
/// the agents hold both copies of the state after `step − 1`.
pub fn kill_it(step: u64) -> impl FnOnce(&Arc<Cluster>, &WorkerId) -> Verdict + Send + 'static {
    move |c, id| {
        c.wait_held(step - 1, 2);
        c.kill_worker(&id.node, id.stage);
        Verdict::Kill
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

/// The shared state of one scenario's cluster (what rules act on).
pub struct Cluster {
    pub dir: PathBuf,
    cfg: Config,
    addr: String,
    rules: Vec<Rule>,
    /// Current agent per node name.
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
    /// Every worker started, in order.
    workers: Mutex<Vec<Arc<WorkerSlot>>>,
    next_serial: AtomicU64,
    /// Agents fenced by the coordinator (they heard `Refused`). Signalled on every change.
    fenced: Mutex<Vec<String>>,
    fenced_changed: Condvar,
    /// A fenced agent joins again as a new incarnation, as the binary's agent does
    /// ([`Cluster::rejoin_when_fenced`]); otherwise it ends.
    rejoin_fenced: AtomicBool,
    /// Agents replaced by a new one under the same name (ended at teardown).
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

    /// The newest worker of `stage` on `node` that is still running.
    fn running_worker(&self, node: &str, stage: usize) -> Option<Arc<WorkerSlot>> {
        self.workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .rev()
            .find(|w| w.id.node == node && w.id.stage == stage && !w.switch.is_ended())
            .cloned()
    }

    /// Whether `node`'s agent can no longer report: it was killed, or it is cut off.
    fn agent_gone(&self, node: &str) -> bool {
        self.is_frozen(node)
            || self
                .agents
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(node)
                .is_none_or(|a| a.switch.is_ended())
    }

    fn is_frozen(&self, node: &str) -> bool {
        self.frozen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(node)
    }

    /// Kills the worker of `stage` on `node` as SIGKILL would, and waits until its agent has
    /// seen the exit (it reports it then).
    pub fn kill_worker(&self, node: &str, stage: usize) {
        if let Some(worker) = self.running_worker(node, stage) {
            worker.kill();
            worker.wait_reported(|| self.agent_gone(node));
        }
    }

    /// Kills the worker of `stage` on `node` as SIGKILL would; its agent notices late: it reports
    /// the exit just before it handles the coordinator's next message (a busy agent's reaping).
    /// The coordinator then learns of the death from the worker's closed connection first.
    pub fn kill_worker_reaped_late(&self, node: &str, stage: usize) {
        if let Some(worker) = self.running_worker(node, stage) {
            worker.kill_reaped_late();
        }
    }

    /// Kills `node`: its agent (its control connection and snapshot port) and its workers, as
    /// SIGKILL of the whole node would.
    pub fn kill_node(&self, node: &str) {
        if let Some(agent) = self
            .agents
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(node)
        {
            agent.switch.kill();
        }
        let workers = self
            .workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for w in workers.iter().filter(|w| w.id.node == node) {
            w.switch.kill();
        }
        self.forget_held(node);
    }

    /// [`Cluster::kill_node`], then waits until the coordinator has handled the close of the
    /// node's agent connection (it closes its end then): the coordinator knows of the death
    /// before anything a [`Hold`] keeps of the node's workers reaches it.
    pub fn kill_node_seen_first(&self, node: &str) {
        let agent = self.link(|end| matches!(end, End::Agent { node: n } if n == node));
        self.kill_node(node);
        agent.wait_coordinator_closed();
    }

    /// From now on an agent that the coordinator fences joins again as a new incarnation of its
    /// node (its workers stopped, its peer snapshots kept), as the binary's agent does; until
    /// then a fenced agent ends.
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

    /// Cuts `node` off: nothing its agent sends reaches the coordinator any more, nor the other
    /// way (its control link is frozen in both directions, connection open); its workers stop
    /// at their next point with their connections open.
    pub fn silence(&self, node: &str) {
        self.frozen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.to_string());
        self.link(|end| matches!(end, End::Agent { node: n } if n == node))
            .freeze();
    }

    /// Gives `node` a preemption notice, as SIGTERM does, and waits until its agent has acted on
    /// it (it polls its flag between messages): its `Leaving` is sent and its workers know, so
    /// they leave at the boundary of the step they are in.
    pub fn preempt(&self, node: &str) {
        self.notify(node, |leave| leave.set());
    }

    /// Gives `node` the cloud's preemption notice `notice` and waits until its agent has acted on
    /// it: its workers' next step reports say they leave, and its `Leaving` (with the notice) is
    /// on its way, ahead of anything the agent sends afterwards (e.g. its answer to a held
    /// `StopWorkers`, once released).
    pub fn preempt_now(&self, node: &str, notice: Notice) {
        self.notify(node, |leave| leave.set_by_cloud(notice));
    }

    /// Sets `node`'s preemption flag with `set` and waits until its agent has announced the leave.
    fn notify(&self, node: &str, set: impl FnOnce(&Preempted)) {
        let (leave, announced) = {
            let agents = self.agents.lock().unwrap_or_else(|p| p.into_inner());
            (
                agents[node].leave.clone(),
                Arc::clone(&agents[node].announced),
            )
        };
        let seen = announced.get();
        set(&leave);
        announced.wait_past(seen);
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

    /// Starts an agent for `node` (a joiner, or a restarted agent of a node) and waits for the
    /// coordinator's welcome.
    pub fn start_agent(self: &Arc<Self>, node: &str) {
        let (handle, wait) = agents::start_agent(self, node);
        let old = self
            .agents
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.to_string(), handle);
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

/// Runs the scenario's job (`base_sets` then `sets`) on `nodes` agents named `node-0`…,
/// with `rules`, to its end; every worker and agent is gone when it returns.
pub fn run(name: &str, nodes: usize, sets: &[&str], rules: Vec<Rule>) -> Outcome {
    run_cluster(name, nodes, sets, rules, Launch::default())
}

/// Resumes the run of `from` (its run directory, its newest committed checkpoint) as
/// `seqpipe resume` does, with the same job settings (`base_sets` then `sets`) on `nodes` fresh
/// agents, to its end. The resumed run appends to the same `metrics.jsonl`: its outcome's
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
        .map(|w| w.id.clone())
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

/// Ends every agent and worker as SIGKILL would and joins every thread of the cluster.
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
        h.switch.kill();
    }
    let workers = std::mem::take(&mut *cluster.workers.lock().unwrap_or_else(|p| p.into_inner()));
    for w in &workers {
        w.switch.kill();
    }
    // An agent whose connection closed stops its workers and returns.
    for mut h in handles {
        if let Some(t) = h.thread.take() {
            t.join().expect("an agent thread panicked");
        }
    }
    // A worker thread ends once its switch is ended and it notices: at its next point or socket
    // operation — or, waiting for a connection that will never come, at its timeout. Those are
    // left to end on their own: their sockets are closed already.
    let deadline = Instant::now() + Duration::from_secs(2);
    for w in workers {
        let Some(t) = w.thread.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            continue;
        };
        while !t.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if t.is_finished() && t.join().is_err() {
            panic!("the worker thread of {:?} panicked", w.id);
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

    /// Asserts that the run recovered, first with `tier` at `step`, losing `lost_steps` steps.
    pub fn assert_first_recovery(&self, tier: Tier, step: u64, lost_steps: u64) {
        let r = self.recoveries();
        assert!(!r.is_empty(), "no recovery: {:#?}", self.events);
        assert_eq!(
            (r[0].tier, r[0].step, r[0].lost_steps),
            (tier, step, lost_steps),
            "{:#?}",
            self.events
        );
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
