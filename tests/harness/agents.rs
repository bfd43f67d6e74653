//! The harness's node agents: the REAL agent (`trainer::runtime::agent::run_agent_with`) on a
//! thread per node, with hooks that
//! - start its workers as threads running the real `run_worker`, each with a [`KillSwitch`] whose
//!   points go to the scenario's rules ([`NodeLauncher`]),
//! - route its control connection, and its workers', through a relay of the harness
//!   ([`super::links`]), one relay per connection,
//! - stall its peer-snapshot reports when a scenario says so and record what it reported (for
//!   `Cluster::wait_held`), and say whether a fenced agent joins again ([`NodeEvents`]),
//! - end it as SIGKILL ends the agent process (its own kill switch: control connection and
//!   snapshot port), and give it preemption notices (its `Preempted` flag).
//!
//! A worker's exit is what its kill switch says; with late reaping its agent sees it only once the
//! coordinator has sent the agent a message after the death, so that the agent reports it just
//! before handling that message (a busy agent's reaping, made deterministic).

use std::net::TcpStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use trainer::runtime::agent::workers::{
    StartError, Worker, WorkerExit, WorkerLauncher, WorkerSpec,
};
use trainer::runtime::agent::{AgentArgs, AgentEvents, AgentHooks, Preempted, run_agent_with};
use trainer::runtime::control::PEER_FAILURE_EXIT_CODE;
use trainer::runtime::kill_switch::{Ending, KillSwitch, Verdict};
use trainer::runtime::worker::{WorkerArgs, WorkerError, run_worker};

use super::links::{self, End, Link};
use super::{Cluster, SCENARIO_LIMIT, WorkerId};

/// A node's agent as the harness holds it.
pub(super) struct AgentHandle {
    pub(super) thread: Option<JoinHandle<()>>,
    /// Ends the agent as SIGKILL ends its process.
    pub(super) switch: KillSwitch,
    /// Its preemption flag (what SIGTERM or the cloud's notice sets).
    pub(super) leave: Preempted,
    /// Counts the leaves it announced.
    pub(super) announced: Arc<Counter>,
}

/// A count that can be waited on.
#[derive(Default)]
pub(super) struct Counter {
    count: Mutex<u64>,
    changed: Condvar,
}

impl Counter {
    pub(super) fn get(&self) -> u64 {
        *self.count.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        *self.count.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.changed.notify_all();
    }

    /// Waits until the count passes `seen` (at most the scenario limit).
    pub(super) fn wait_past(&self, seen: u64) {
        let count = self.count.lock().unwrap_or_else(|p| p.into_inner());
        let (count, _) = self
            .changed
            .wait_timeout_while(count, SCENARIO_LIMIT, |c| *c <= seen)
            .unwrap_or_else(|p| p.into_inner());
        assert!(
            *count > seen,
            "the agent never acted within {SCENARIO_LIMIT:?}"
        );
    }
}

/// Starts the real agent of `node` on a thread; the receiver hears once the coordinator welcomed
/// it.
pub(super) fn start_agent(cluster: &Arc<Cluster>, node: &str) -> (AgentHandle, Receiver<()>) {
    let switch = KillSwitch::new(|_| Verdict::Go);
    let leave = Preempted::default();
    let announced = Arc::new(Counter::default());
    let (welcomed, wait) = channel();
    let connect = {
        let (cluster, node) = (Arc::clone(cluster), node.to_string());
        move |addr: &str| {
            let relay = links::relay(
                End::Agent { node: node.clone() },
                addr,
                &cluster.holds,
                &cluster.links,
                &cluster.closing,
            );
            TcpStream::connect(&relay.addr)
        }
    };
    let hooks = AgentHooks {
        launcher: Box::new(NodeLauncher {
            cluster: Arc::clone(cluster),
        }),
        connect: Box::new(connect),
        leave: leave.clone(),
        sigterm: false,
        events: Arc::new(NodeEvents {
            cluster: Arc::clone(cluster),
            node: node.to_string(),
            switch: switch.clone(),
            announced: Arc::clone(&announced),
            welcomed: Mutex::new(Some(welcomed)),
        }),
        kill_switch: Some(switch.clone()),
    };
    let args = AgentArgs {
        join: cluster.addr.clone(),
        name: node.to_string(),
        slots: 1,
        host: Some("127.0.0.1".into()),
        dir: cluster.dir.join("agents").join(node),
        connect_timeout: SCENARIO_LIMIT,
        job: None,
        // The coordinator's machine: gradient dumps honoured, no memory estimate of its own.
        local: true,
        preemption: None,
    };
    let thread = std::thread::Builder::new()
        .name(format!("agent-{node}"))
        .spawn(move || {
            // How it ended shows in the scenario's events; the error is for a failing test's
            // output.
            if let Err(e) = run_agent_with(&args, hooks) {
                eprintln!("agent {} ended: {e}", args.name);
            }
        })
        .expect("an agent thread");
    let handle = AgentHandle {
        thread: Some(thread),
        switch,
        leave,
        announced,
    };
    (handle, wait)
}

/// What the harness's agents tell it.
struct NodeEvents {
    cluster: Arc<Cluster>,
    node: String,
    /// The agent's own kill switch: a dead agent's reports are not recorded.
    switch: KillSwitch,
    announced: Arc<Counter>,
    welcomed: Mutex<Option<Sender<()>>>,
}

impl AgentEvents for NodeEvents {
    fn joined(&self, _incarnation: u64) {
        if let Some(welcomed) = self
            .welcomed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = welcomed.send(());
        }
    }

    fn join_again_after_fence(&self) -> bool {
        self.cluster
            .fenced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.node.clone());
        self.cluster.fenced_changed.notify_all();
        self.cluster.rejoin_fenced.load(Ordering::SeqCst)
    }

    fn snapshot_stored(&self, step: u64, names: &[String], report: &dyn Fn() -> bool) {
        self.cluster.wait_while_stalled(&self.node, step);
        // Reported to the coordinator first, then recorded for `wait_held` — unless the node is
        // dead or cut off (its report never arrives).
        if report() && !self.switch.is_ended() && !self.cluster.is_frozen(&self.node) {
            self.cluster.record_held(&self.node, step, names.to_vec());
        }
    }

    fn leave_announced(&self) {
        self.announced.bump();
    }
}

/// Starts an agent's workers as threads.
struct NodeLauncher {
    cluster: Arc<Cluster>,
}

impl WorkerLauncher for NodeLauncher {
    fn launch(&self, spec: &WorkerSpec<'_>) -> Result<Box<dyn Worker>, StartError> {
        let slot = start_worker(&self.cluster, spec)?;
        Ok(Box::new(ThreadWorker(slot)))
    }
}

/// A worker thread as the harness and its agent know it.
pub(super) struct WorkerSlot {
    pub(super) id: WorkerId,
    pub(super) switch: KillSwitch,
    /// The control link of the agent that started it: what the coordinator sent that agent
    /// times a late reaping.
    agent_link: Arc<Link>,
    /// Its agent sees its exit only once the coordinator sent the agent a message after its
    /// death.
    late: AtomicBool,
    /// Messages the agent had been sent when the worker died (set by whoever ended it first).
    died_at: Mutex<Option<u64>>,
    /// Its agent has seen its exit (and reports it).
    reported: Mutex<bool>,
    reported_changed: Condvar,
    pub(super) thread: Mutex<Option<JoinHandle<()>>>,
}

impl WorkerSlot {
    /// Kills it as SIGKILL would; its agent reports the exit as soon as it reaps.
    pub(super) fn kill(&self) {
        self.late.store(false, Ordering::SeqCst);
        self.switch.kill();
    }

    /// Kills it as SIGKILL would; its agent reports the exit just before it handles the
    /// coordinator's next message.
    pub(super) fn kill_reaped_late(&self) {
        self.late.store(true, Ordering::SeqCst);
        self.mark_death();
        self.switch.kill();
    }

    fn mark_death(&self) {
        let delivered = self.agent_link.delivered_to_node();
        self.died_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(delivered);
    }

    /// Waits until its agent has seen its exit, or `gone()` says the agent never will (at most
    /// the scenario limit).
    pub(super) fn wait_reported(&self, gone: impl Fn() -> bool) {
        let started = Instant::now();
        let mut reported = self.reported.lock().unwrap_or_else(|p| p.into_inner());
        while !*reported && !gone() {
            assert!(
                started.elapsed() < SCENARIO_LIMIT,
                "the agent never reported the exit of {:?}",
                self.id
            );
            reported = self
                .reported_changed
                .wait_timeout(reported, Duration::from_millis(10))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// The agent's view of a worker thread.
struct ThreadWorker(Arc<WorkerSlot>);

impl Worker for ThreadWorker {
    fn try_exit(&mut self) -> Option<WorkerExit> {
        let slot = &self.0;
        let ending = slot.switch.ending()?;
        if slot.late.load(Ordering::SeqCst) {
            let died_at = (*slot.died_at.lock().unwrap_or_else(|p| p.into_inner()))?;
            if slot.agent_link.delivered_to_node() <= died_at {
                return None;
            }
        }
        *slot.reported.lock().unwrap_or_else(|p| p.into_inner()) = true;
        slot.reported_changed.notify_all();
        // As the agent words a process's exit.
        let (code, status) = match ending {
            Ending::Killed => (None, "signal: 9 (SIGKILL)".to_string()),
            Ending::Exited(c) => (Some(c), format!("exit status: {c}")),
        };
        Some(WorkerExit {
            code,
            status,
            log_tail: String::new(),
            log: format!("(in-process worker of stage {})", slot.id.stage),
        })
    }

    fn notify_leaving(&mut self) {
        self.0.switch.notify_leaving();
    }

    fn kill(&mut self) {
        self.0.switch.kill();
    }
}

/// Starts a worker thread as the real agent starts a worker process (same arguments, its control
/// connection through a relay), with a kill switch whose points go to the cluster's rules.
fn start_worker(
    cluster: &Arc<Cluster>,
    spec: &WorkerSpec<'_>,
) -> Result<Arc<WorkerSlot>, StartError> {
    let id = WorkerId {
        node: spec.node.to_string(),
        stage: spec.stage,
        generation: spec.generation,
        replacement: spec.replacement,
    };
    let serial = cluster.next_serial.fetch_add(1, Ordering::SeqCst);
    let io = |what: String| move |source| StartError::Io { what, source };
    let logs = spec.dir.join(spec.session);
    std::fs::create_dir_all(&logs).map_err(io(format!("creating {}", logs.display())))?;
    let config = logs.join(format!(
        "stage-{}-gen-{}-{serial}.toml",
        id.stage, id.generation
    ));
    std::fs::write(&config, spec.config).map_err(io(format!("writing {}", config.display())))?;
    // The switch does not keep the cluster alive (the cluster keeps the switch).
    let switch = {
        let (cluster, id) = (Arc::downgrade(cluster), id.clone());
        KillSwitch::new(move |point| match Weak::upgrade(&cluster) {
            Some(cluster) => cluster.on_point(&id, point),
            None => Verdict::Go,
        })
    };
    let relay = links::relay(
        End::Worker(id.clone()),
        spec.control,
        &cluster.holds,
        &cluster.links,
        &cluster.closing,
    );
    let args = WorkerArgs {
        control: relay.addr,
        stage: id.stage,
        generation: id.generation,
        bind: spec.host.to_string(),
        config,
        dump_grads: spec.dump_grads.map(Path::to_path_buf),
        snapshot_to: spec.snapshot_to.to_vec(),
        kill_switch: Some(switch.clone()),
    };
    let agent_link = cluster.link(|end| matches!(end, End::Agent { node } if *node == id.node));
    let slot = Arc::new(WorkerSlot {
        id: id.clone(),
        switch,
        agent_link,
        late: AtomicBool::new(cluster.reap_late),
        died_at: Mutex::default(),
        reported: Mutex::new(false),
        reported_changed: Condvar::new(),
        thread: Mutex::new(None),
    });
    let ending = Arc::clone(&slot);
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
            ending.mark_death();
            ending.switch.end(Ending::Exited(code));
        })
        .map_err(io(format!(
            "starting the worker thread of stage {}",
            id.stage
        )))?;
    *slot.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
    cluster
        .workers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Arc::clone(&slot));
    Ok(slot)
}
