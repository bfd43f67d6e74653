//! A node agent (`seqpipe agent --join HOST:PORT`): the one process per node that joins the
//! coordinator, heartbeats, starts and watches the node's stage workers, reports how they exit,
//! and turns a preemption notice (SIGTERM, or the cloud's, see [`super::notice_watch`]) into a
//! graceful leave.
//!
//! An agent outlives its workers' failures: a killed worker is reported and the node stays in the
//! run. When the coordinator declares the node dead (fenced), the agent stops its workers and
//! joins again as a new incarnation; when the coordinator goes away, the agent stops its workers
//! and exits.
//!
//! What ties an agent to its process sits behind [`AgentHooks`]: how workers are started
//! ([`workers::WorkerLauncher`]), how the coordinator is reached, the preemption flag and its
//! signal, the peer-snapshot report, whether to join again when fenced, and a kill switch. The
//! binary runs [`run_agent`] with the process's hooks; the in-process harness (`tests/harness`)
//! runs the same agent with workers as threads and every connection through its relays.

pub mod workers;

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use elastic::NodeInfo;
use elastic::preemption::Notice;
use thiserror::Error;
use tracing::{info, warn};

use super::auth::{self, Gate, Purpose};
use super::control::{ControlSender, ControlStream, FromAgent, ToAgent};
use super::kill_switch::KillSwitch;
use super::notice_watch::{self, WatchConfig};
use super::peer_input;
use super::peer_snapshots::{PutBounds, SnapshotStore, serve};
use crate::config::Config;
use workers::{
    ProcessLauncher, RunningWorker, WorkerLauncher, WorkerSpec, reap, stop, stop_stages,
};
pub(super) use workers::{append_log, die_with_parent};

/// How an agent is started.
#[derive(Clone, Debug)]
pub struct AgentArgs {
    /// The coordinator's control address (`host:port`).
    pub join: String,
    /// The node's name (unique in the run).
    pub name: String,
    /// Stage workers this node runs at most.
    pub slots: usize,
    /// The address its workers listen on for their neighbours; default: the local address of the
    /// connection to the coordinator.
    pub host: Option<String>,
    /// Where worker configs and logs go.
    pub dir: PathBuf,
    /// How long to keep trying to reach the coordinator.
    pub connect_timeout: Duration,
    /// With an etcd rendezvous: the job's config, which this node runs as coordinator if it wins
    /// the leadership (then `join` is found in etcd, not given).
    pub job: Option<Box<Config>>,
    /// The coordinator started this agent on its own machine (`elastic.local_agents`): paths it
    /// sends (gradient dumps, a test feature) are on this machine too and are honoured.
    pub local: bool,
    /// The cloud metadata service to watch for preemption notices, if any.
    pub preemption: Option<WatchConfig>,
}

/// Why an agent stopped.
#[derive(Debug, Error)]
pub enum AgentError {
    /// The coordinator could not be reached, or refused the job token.
    #[error(
        "cannot join the coordinator at {addr}: {source} (is `seqpipe train` running there, and is {} the same on both hosts?)",
        auth::TOKEN_ENV
    )]
    Connect {
        addr: String,
        source: std::io::Error,
    },
    /// The coordinator went away.
    #[error("the coordinator at {addr} went away: {reason}")]
    CoordinatorGone { addr: String, reason: String },
    /// The coordinator refused the join.
    #[error("the coordinator at {addr} refused node {node}: {reason}")]
    Refused {
        addr: String,
        node: String,
        reason: String,
    },
    /// A local failure (files, processes).
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// The coordinator sent a message with a value that cannot be used (a name that is not a plain
    /// file name, a number out of range): it is not trusted further.
    #[error("the coordinator at {addr} sent a bad message: {problem}; leaving it")]
    BadMessage { addr: String, problem: String },
    /// The etcd rendezvous failed.
    #[error("etcd rendezvous {url}: {source}")]
    Etcd {
        url: String,
        source: Box<elastic::etcd::EtcdError>,
    },
    /// `SEQPIPE_JOB_TOKEN` is unset or empty.
    #[error(transparent)]
    Token(#[from] auth::JobTokenError),
    /// This node's coordinator (it led the job) failed.
    #[error("the coordinator this node ran exited ({status}); see {log}")]
    CoordinatorFailed { status: String, log: String },
}

/// The seams between an agent and its process. `AgentHooks::default()` is the `seqpipe agent`
/// binary's: worker processes, plain TCP, SIGTERM, every fence answered by joining again.
pub struct AgentHooks {
    /// Starts the node's workers.
    pub launcher: Box<dyn WorkerLauncher>,
    /// Opens a TCP connection to the coordinator at an address (`host:port`); the agent retries
    /// it until `connect_timeout` and authenticates it.
    pub connect: Box<Connect>,
    /// The node's preemption notice: set by SIGTERM (with `sigterm`), by the cloud's notice (with
    /// `AgentArgs::preemption`), or by whoever holds a clone.
    pub leave: Preempted,
    /// SIGTERM sets `leave` (the binary; an in-process agent leaves the test process's signals
    /// alone).
    pub sigterm: bool,
    /// What the agent tells its host, and asks it.
    pub events: Arc<dyn AgentEvents>,
    /// Ends the agent as SIGKILL ends its process: its control connection and snapshot port are
    /// registered with it (in-process harnesses only; `None` in the binary).
    pub kill_switch: Option<KillSwitch>,
}

/// Opens a TCP connection to an address (`host:port`).
pub type Connect = dyn Fn(&str) -> std::io::Result<TcpStream> + Send + Sync;

impl Default for AgentHooks {
    fn default() -> Self {
        Self {
            launcher: Box::new(ProcessLauncher),
            connect: Box::new(|addr| TcpStream::connect(addr)),
            leave: Preempted::default(),
            sigterm: true,
            events: Arc::new(ProcessEvents),
            kill_switch: None,
        }
    }
}

/// What an agent tells its host at a few moments, and asks it; every method has the binary's
/// behaviour as its default.
pub trait AgentEvents: Send + Sync {
    /// The coordinator welcomed this node as incarnation `incarnation` (its snapshot reports go
    /// to that connection from now on).
    fn joined(&self, _incarnation: u64) {}

    /// The coordinator fenced this node: whether to join again as a new incarnation.
    fn join_again_after_fence(&self) -> bool {
        true
    }

    /// A peer snapshot of `step` holding `names` was stored; `report` tells the coordinator
    /// (false when there is no connection to tell). The worker that sent it hears "stored" once
    /// this returns.
    fn snapshot_stored(&self, _step: u64, _names: &[String], report: &dyn Fn() -> bool) {
        report();
    }

    /// The node's leave was announced (`Leaving` sent) and its workers told.
    fn leave_announced(&self) {}
}

/// The `seqpipe agent` binary's [`AgentEvents`]: every default.
struct ProcessEvents;

impl AgentEvents for ProcessEvents {}

/// How one incarnation ended.
enum Ended {
    /// The coordinator said the run is over.
    Shutdown,
    /// The coordinator fenced this node: join again.
    Fenced,
}

/// The node's peer-snapshot service: the copies its workers and its buddy's workers send after
/// every step, kept across incarnations (they are this process's memory).
struct Snapshots {
    store: Arc<Mutex<SnapshotStore>>,
    /// The address peers reach this node by (`--host`, or the interface that routes to the
    /// coordinator or etcd); the snapshot port listens there.
    host: String,
    port: u16,
    /// Where to report stored copies: the current incarnation's coordinator connection.
    report_to: Arc<Mutex<Option<ControlSender>>>,
    /// Accepts the workers' connections for as long as the agent lives.
    _gate: Gate,
}

/// The `host:port` this agent first talks to: the etcd endpoint or the coordinator.
fn rendezvous_or_join(args: &AgentArgs) -> String {
    args.job
        .as_ref()
        .and_then(|job| elastic::etcd::EtcdUrl::parse(&job.elastic.rendezvous).ok())
        .map(|url| url.endpoint().to_string())
        .unwrap_or_else(|| args.join.clone())
}

/// The local IP of the interface that routes to `target` (`host:port`), found without sending a
/// packet (a UDP socket's connect only picks the route).
fn route_ip(target: &str) -> std::io::Result<std::net::IpAddr> {
    use std::net::ToSocketAddrs;
    let remote = target.to_socket_addrs()?.next().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{target} resolves to nothing"),
        )
    })?;
    let any: std::net::SocketAddr = if remote.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = std::net::UdpSocket::bind(any)?;
    socket.connect(remote)?;
    Ok(socket.local_addr()?.ip())
}

impl Snapshots {
    fn start(args: &AgentArgs, hooks: &AgentHooks) -> Result<Self, AgentError> {
        let io = |what: &str| {
            let what = what.to_string();
            move |source| AgentError::Io {
                what: what.clone(),
                source,
            }
        };
        // The address peers reach this node by: `--host`, or the interface that routes to the
        // coordinator (or etcd). Never every interface: a local run stays on loopback.
        let bind = match &args.host {
            Some(host) => host.clone(),
            None => route_ip(&rendezvous_or_join(args))
                .map_err(io(
                    "finding the interface that reaches the coordinator (name it with --host)",
                ))?
                .to_string(),
        };
        let listener = std::net::TcpListener::bind((bind.as_str(), 0))
            .map_err(io(&format!("binding the snapshot port on {bind}")))?;
        let port = listener.local_addr().map_err(io("snapshot port"))?.port();
        if let Some(switch) = &hooks.kill_switch {
            switch
                .register_listener(&listener)
                .map_err(io("registering the snapshot port"))?;
        }
        let store = Arc::new(Mutex::new(SnapshotStore::default()));
        let report_to: Arc<Mutex<Option<ControlSender>>> = Arc::new(Mutex::new(None));
        let reporter = Arc::clone(&report_to);
        let events = Arc::clone(&hooks.events);
        let token = auth::required_token("an agent")?;
        let gate = serve(listener, token, Arc::clone(&store), move |step, names| {
            let report = || match reporter.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                Some(sender) => {
                    let _ = sender.send(&FromAgent::SnapshotHeld {
                        step,
                        names: names.clone(),
                    });
                    true
                }
                None => false,
            };
            events.snapshot_stored(step, &names, &report);
        })
        .map_err(io("starting the snapshot service"))?;
        Ok(Self {
            store,
            host: bind,
            port,
            report_to,
            _gate: gate,
        })
    }

    /// Reports to `sender` from now on, starting with everything held.
    fn report_to(&self, sender: ControlSender) {
        let held = self.store.lock().unwrap_or_else(|p| p.into_inner()).held();
        for (step, names) in held {
            let _ = sender.send(&FromAgent::SnapshotHeld { step, names });
        }
        *self.report_to.lock().unwrap_or_else(|p| p.into_inner()) = Some(sender);
    }
}

/// Whether this node got a preemption notice: SIGTERM sets `flag`; the cloud's notice is stored
/// in `cloud` before it sets `flag`, so that the leave names it. Clones share one flag.
#[derive(Clone, Default)]
pub struct Preempted {
    flag: Arc<AtomicBool>,
    cloud: Arc<Mutex<Option<Notice>>>,
}

impl Preempted {
    fn is_set(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// The cloud's notice, if that is what set the flag (else SIGTERM did).
    fn notice(&self) -> Option<Notice> {
        self.cloud.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The cloud's notice: the node leaves, naming it.
    pub fn set_by_cloud(&self, notice: Notice) {
        *self.cloud.lock().unwrap_or_else(|p| p.into_inner()) = Some(notice);
        self.flag.store(true, Ordering::SeqCst);
    }

    /// A notice without the cloud's words, as SIGTERM gives.
    pub fn set(&self) {
        self.flag.store(true, Ordering::SeqCst);
    }
}

/// Runs the agent until the coordinator shuts the run down (or goes away).
pub fn run_agent(args: &AgentArgs) -> Result<(), AgentError> {
    run_agent_with(args, AgentHooks::default())
}

/// [`run_agent`] with the process's seams replaced by `hooks`.
pub fn run_agent_with(args: &AgentArgs, hooks: AgentHooks) -> Result<(), AgentError> {
    // Before anything listens or connects: no port of this node runs without the job's secret.
    auth::required_token("an agent")?;
    let leaving = hooks.leave.clone();
    if hooks.sigterm {
        signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&leaving.flag))
            .map_err(|source| AgentError::Io {
                what: "installing the SIGTERM handler".into(),
                source,
            })?;
    }
    if let Some(watch) = &args.preemption {
        let leaving = leaving.clone();
        notice_watch::spawn(watch.clone(), move |notice| leaving.set_by_cloud(notice)).map_err(
            |source| AgentError::Io {
                what: "starting the preemption-notice thread".into(),
                source,
            },
        )?;
    }
    let snapshots = Snapshots::start(args, &hooks)?;
    if let Some(job) = &args.job {
        return run_with_etcd(args, &hooks, job, &leaving, &snapshots);
    }
    loop {
        match run_incarnation(args, &hooks, &leaving, &snapshots)? {
            Ended::Shutdown => return Ok(()),
            Ended::Fenced if leaving.is_set() => {
                info!("left the run after a preemption notice");
                return Ok(());
            }
            Ended::Fenced if !hooks.events.join_again_after_fence() => return Ok(()),
            Ended::Fenced => {
                warn!(node = %args.name, "declared dead by the coordinator; joining again");
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
}

/// The agent of an etcd-rendezvous job: registers the node under a lease, follows the leader (the
/// node that runs the coordinator) and, when there is none, campaigns to become it and starts the
/// coordinator itself. When the leader's node is lost its lease expires, another agent wins the
/// next campaign and resumes the job from the newest committed checkpoint.
fn run_with_etcd(
    args: &AgentArgs,
    hooks: &AgentHooks,
    job: &Config,
    leaving: &Preempted,
    snapshots: &Snapshots,
) -> Result<(), AgentError> {
    use elastic::etcd::{EtcdUrl, Rendezvous};
    let url = job.elastic.rendezvous.clone();
    let etcd = |source| AgentError::Etcd {
        url: url.clone(),
        source: Box::new(source),
    };
    let token = auth::required_token("an agent")?;
    let parsed = EtcdUrl::parse(&url).map_err(etcd)?;
    let rendezvous =
        Arc::new(Rendezvous::connect(&parsed, &auth::fingerprint(&token)).map_err(etcd)?);
    let host = snapshots.host.clone();
    let lease = rendezvous.grant(job.elastic.dead_after()).map_err(etcd)?;
    let node = NodeInfo::new(
        args.name.clone(),
        args.slots,
        format!("{host}:{}", snapshots.port),
    );
    rendezvous.register(&node, lease.id).map_err(etcd)?;
    let lease_lost = Arc::new(AtomicBool::new(false));
    {
        let (rendezvous, lost) = (Arc::clone(&rendezvous), Arc::clone(&lease_lost));
        std::thread::spawn(move || {
            while !lost.load(Ordering::SeqCst) {
                std::thread::sleep(lease.ttl / 3);
                if let Err(e) = rendezvous.keep_alive(lease.id) {
                    warn!(error = %e, "lost the etcd lease: this node is out of the job");
                    lost.store(true, Ordering::SeqCst);
                }
            }
        });
    }
    let mut coordinator: Option<(Child, PathBuf)> = None;
    let result = loop {
        if lease_lost.load(Ordering::SeqCst) {
            break Err(AgentError::Refused {
                addr: url.clone(),
                node: args.name.clone(),
                reason: "its etcd lease expired (partitioned from etcd?)".into(),
            });
        }
        if let Some((child, log)) = &mut coordinator
            && let Ok(Some(status)) = child.try_wait()
            && !status.success()
        {
            break Err(AgentError::CoordinatorFailed {
                status: status.to_string(),
                log: log.display().to_string(),
            });
        }
        let leader = match rendezvous.leader().map_err(etcd)? {
            Some(leader) => leader,
            None => {
                let addr = free_address(&host)?;
                if rendezvous
                    .campaign(&args.name, &addr, lease.id)
                    .map_err(etcd)?
                {
                    info!(%addr, "won the leadership: starting the coordinator");
                    coordinator = Some(spawn_coordinator(args, job, &addr)?);
                }
                continue;
            }
        };
        let follow = AgentArgs {
            join: leader.addr.clone(),
            connect_timeout: Duration::from_secs(1),
            ..args.clone()
        };
        match run_incarnation(&follow, hooks, leaving, snapshots) {
            Ok(Ended::Shutdown) => break Ok(()),
            Ok(Ended::Fenced) if leaving.is_set() => break Ok(()),
            Ok(Ended::Fenced) if !hooks.events.join_again_after_fence() => break Ok(()),
            Ok(Ended::Fenced) => {}
            Err(e @ (AgentError::CoordinatorGone { .. } | AgentError::Connect { .. })) => {
                warn!(leader = %leader.candidate, error = %e, "lost the coordinator; following the next leader");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => break Err(e),
        }
    };
    if let Some((mut child, _)) = coordinator {
        // The coordinator ends the run after telling the agents; give it time to exit cleanly.
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    lease_lost.store(true, Ordering::SeqCst);
    let _ = rendezvous.resign(lease.id);
    let _ = rendezvous.revoke(lease.id);
    result
}

/// A free port on `host`, as `host:port`.
fn free_address(host: &str) -> Result<String, AgentError> {
    let listener = std::net::TcpListener::bind((host, 0)).map_err(|source| AgentError::Io {
        what: format!("finding a free port on {host}"),
        source,
    })?;
    let port = listener
        .local_addr()
        .map_err(|source| AgentError::Io {
            what: "finding a free port".into(),
            source,
        })?
        .port();
    Ok(format!("{host}:{port}"))
}

/// Starts the job's coordinator (`seqpipe train`) on this node, listening on `addr`, waiting for
/// agents rather than starting its own. Its log is `<dir>/coordinator.log`.
fn spawn_coordinator(
    args: &AgentArgs,
    job: &Config,
    addr: &str,
) -> Result<(Child, PathBuf), AgentError> {
    let io = |what: String| {
        move |source| AgentError::Io {
            what: what.clone(),
            source,
        }
    };
    std::fs::create_dir_all(&args.dir).map_err(io(format!("creating {}", args.dir.display())))?;
    let config = args.dir.join("job.toml");
    std::fs::write(&config, job.to_toml()).map_err(io(format!("writing {}", config.display())))?;
    let log = args.dir.join("coordinator.log");
    let file = std::fs::File::create(&log).map_err(io(format!("creating {}", log.display())))?;
    let stderr = file.try_clone().map_err(io("coordinator log".into()))?;
    let exe = std::env::current_exe().map_err(io("locating the seqpipe executable".into()))?;
    let mut cmd = Command::new(exe);
    cmd.args(["train", "-q", "--config"])
        .arg(&config)
        .args(["--set", "elastic.local_agents=false"])
        .args(["--set", &format!("elastic.listen={addr}")])
        .stdin(Stdio::null())
        .stdout(Stdio::from(file))
        .stderr(Stdio::from(stderr));
    die_with_parent(&mut cmd);
    let child = cmd.spawn().map_err(io("starting the coordinator".into()))?;
    Ok((child, log))
}

fn connect(args: &AgentArgs, hooks: &AgentHooks) -> Result<ControlStream, AgentError> {
    let err = |source| AgentError::Connect {
        addr: args.join.clone(),
        source,
    };
    let token = auth::required_token("an agent")?;
    let deadline = Instant::now() + args.connect_timeout;
    let mut stream = loop {
        match (hooks.connect)(&args.join) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                warn!(addr = %args.join, error = %e, "coordinator not reachable yet; retrying");
                std::thread::sleep(Duration::from_millis(250));
            }
            Err(e) => return Err(err(e)),
        }
    };
    if let Some(switch) = &hooks.kill_switch {
        switch.register(&stream).map_err(err)?;
    }
    auth::connect(&mut stream, &token, Purpose::Control).map_err(err)?;
    ControlStream::new(stream).map_err(err)
}

/// One incarnation of this node in the run: joins, then follows the coordinator's messages until
/// it shuts the run down, fences the node or goes away. The node's workers are stopped however it
/// ends.
fn run_incarnation(
    args: &AgentArgs,
    hooks: &AgentHooks,
    leaving: &Preempted,
    snapshots: &Snapshots,
) -> Result<Ended, AgentError> {
    let Joined {
        control,
        host,
        heartbeat,
        incarnation,
    } = join(args, hooks, snapshots)?;
    let sender = control.sender();
    snapshots.report_to(sender.clone());
    hooks.events.joined(incarnation);
    let messages = receive_in_background(control);
    let mut node = Incarnation {
        args,
        launcher: hooks.launcher.as_ref(),
        events: hooks.events.as_ref(),
        host,
        sender,
        heartbeat,
        last_heartbeat: Instant::now(),
        announced_leave: false,
        workers: Vec::new(),
        snapshots: Arc::clone(&snapshots.store),
    };
    let result = node.follow(leaving, &messages);
    stop(&mut node.workers, u64::MAX);
    result
}

/// A node that the coordinator let in.
struct Joined {
    control: ControlStream,
    /// The address this node's workers listen on.
    host: String,
    /// How often to heartbeat.
    heartbeat: Duration,
    /// The coordinator's number for this incarnation of the node.
    incarnation: u64,
}

/// Connects, sends `Join` and reads the coordinator's answer.
fn join(args: &AgentArgs, hooks: &AgentHooks, snapshots: &Snapshots) -> Result<Joined, AgentError> {
    let gone = |reason: String| AgentError::CoordinatorGone {
        addr: args.join.clone(),
        reason,
    };
    let mut control = connect(args, hooks)?;
    let host = match &args.host {
        Some(h) => h.clone(),
        None => control
            .local_addr()
            .map_err(|e| gone(e.to_string()))?
            .ip()
            .to_string(),
    };
    let node = NodeInfo::new(
        args.name.clone(),
        args.slots,
        format!("{host}:{}", snapshots.port),
    );
    control
        .send(&FromAgent::Join {
            node,
            pid: std::process::id(),
        })
        .map_err(|e| gone(e.to_string()))?;
    // The coordinator closes a connection whose token proof is wrong without a word.
    let answer = control.recv::<ToAgent>().map_err(|source| {
        if source.kind() == std::io::ErrorKind::InvalidData {
            bad_message(args, peer_input::BadInput(source.to_string()))
        } else {
            AgentError::Connect {
                addr: args.join.clone(),
                source,
            }
        }
    })?;
    let (incarnation, heartbeat) = read_welcome(answer).map_err(|e| match e {
        NotWelcome::Bad(problem) => bad_message(args, problem),
        NotWelcome::Refused(reason) => AgentError::Refused {
            addr: args.join.clone(),
            node: args.name.clone(),
            reason,
        },
        NotWelcome::Unexpected(what) => gone(what),
    })?;
    info!(node = %args.name, incarnation, %host, "joined the run");
    Ok(Joined {
        control,
        host,
        heartbeat,
        incarnation,
    })
}

/// Why the coordinator's answer to a join does not let this node in.
#[derive(Debug, PartialEq)]
enum NotWelcome {
    /// The coordinator refused the node, with its reason.
    Refused(String),
    /// The welcome carries a value that cannot be used.
    Bad(peer_input::BadInput),
    /// Not an answer to a join.
    Unexpected(String),
}

/// The incarnation number and heartbeat interval of a `Welcome`, its `heartbeat_s` checked.
fn read_welcome(answer: ToAgent) -> Result<(u64, Duration), NotWelcome> {
    match answer {
        ToAgent::Welcome {
            incarnation,
            heartbeat_s,
        } => {
            let heartbeat =
                peer_input::seconds("heartbeat_s", heartbeat_s).map_err(NotWelcome::Bad)?;
            Ok((incarnation, heartbeat))
        }
        ToAgent::Refused { reason } => Err(NotWelcome::Refused(reason)),
        other => Err(NotWelcome::Unexpected(format!(
            "expected a welcome, got {other:?}"
        ))),
    }
}

/// The coordinator's messages, read on a thread of their own so that the agent can heartbeat and
/// watch its workers meanwhile. The last one is the error that ended the connection.
fn receive_in_background(mut control: ControlStream) -> Receiver<std::io::Result<ToAgent>> {
    let (tx, messages) = channel();
    std::thread::spawn(move || {
        loop {
            let msg = control.recv::<ToAgent>();
            let closed = msg.is_err();
            if tx.send(msg).is_err() || closed {
                return;
            }
        }
    });
    messages
}

/// A joined node's state: the connection's sending half, the heartbeat clock, the workers.
struct Incarnation<'a> {
    args: &'a AgentArgs,
    launcher: &'a dyn WorkerLauncher,
    events: &'a dyn AgentEvents,
    /// The address this node's workers listen on.
    host: String,
    sender: ControlSender,
    heartbeat: Duration,
    last_heartbeat: Instant,
    /// The coordinator was told this node is leaving (a preemption notice arrived).
    announced_leave: bool,
    workers: Vec<RunningWorker>,
    /// The node's peer snapshots, told of every plan's bounds.
    snapshots: Arc<Mutex<SnapshotStore>>,
}

impl Incarnation<'_> {
    fn gone(&self, reason: String) -> AgentError {
        AgentError::CoordinatorGone {
            addr: self.args.join.clone(),
            reason,
        }
    }

    /// The message loop: between messages, heartbeats, passes on a preemption notice and
    /// reports workers that exited.
    fn follow(
        &mut self,
        leaving: &Preempted,
        messages: &Receiver<std::io::Result<ToAgent>>,
    ) -> Result<Ended, AgentError> {
        loop {
            self.tick(leaving)?;
            let msg = match messages.recv_timeout(Duration::from_millis(20)) {
                Ok(Ok(msg)) => msg,
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::InvalidData => {
                    return Err(bad_message(self.args, peer_input::BadInput(e.to_string())));
                }
                Ok(Err(e)) => return Err(self.gone(e.to_string())),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(self.gone("connection closed".into()));
                }
            };
            // Exits seen by now are reported before the message is acted on: a `StopWorkers`
            // would otherwise stop a worker that had exited by itself without its exit ever
            // being reported.
            self.report_exits();
            if let Some(ended) = self.handle(msg)? {
                return Ok(ended);
            }
        }
    }

    /// The work between messages: the heartbeat when due, the leave announcement once, and the
    /// reports of workers that exited.
    fn tick(&mut self, leaving: &Preempted) -> Result<(), AgentError> {
        if self.last_heartbeat.elapsed() >= self.heartbeat {
            self.last_heartbeat = Instant::now();
            if let Err(e) = self.sender.send(&FromAgent::Heartbeat) {
                return Err(self.gone(e.to_string()));
            }
        }
        if leaving.is_set() && !self.announced_leave {
            self.announced_leave = true;
            let notice = leaving.notice();
            warn!(
                reason = %elastic::preemption::leave_reason(notice.as_ref()),
                "leaving at the next step boundary"
            );
            // The coordinator hears why before the workers report the leave with their step.
            let _ = self.sender.send(&FromAgent::Leaving { notice });
            for w in &mut self.workers {
                w.worker.notify_leaving();
            }
            self.events.leave_announced();
        }
        self.report_exits();
        Ok(())
    }

    /// Reports the workers that exited since the last call.
    fn report_exits(&mut self) {
        for exit in reap(&mut self.workers) {
            // A failed send shows up as a closed connection in the message loop.
            let _ = self.sender.send(&exit);
        }
    }

    /// Acts on one message; `Some` when it ends the incarnation.
    fn handle(&mut self, msg: ToAgent) -> Result<Option<Ended>, AgentError> {
        match msg {
            ToAgent::StartWorkers {
                generation,
                first_step,
                stages,
                config,
                snapshot_to,
                session,
                dump_grads,
                keep_running,
                launch,
            } => {
                let start = StartRequest {
                    generation,
                    stages,
                    config,
                    snapshot_to,
                    session,
                    dump_grads,
                    keep_running,
                    launch,
                };
                check_start(&start, self.args.slots, self.args.local)
                    .map_err(|e| bad_message(self.args, e))?;
                // Before any worker starts: the copies its stages send are bounded by this plan.
                self.snapshots
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .plan(PutBounds::from_config(
                        generation,
                        first_step,
                        &start.config,
                    ));
                if start.keep_running {
                    // A replacement: a worker of its stage still running here was declared lost
                    // (e.g. its control connection broke) and is stopped without a report, so
                    // that its exit cannot be taken for the replacement's.
                    stop_stages(&mut self.workers, &start.stages);
                } else {
                    stop(&mut self.workers, u64::MAX);
                }
                match self.memory_refusal(&start) {
                    Some(error) => {
                        warn!(stages = ?start.stages, %error, "refusing to start workers that do not fit in this node's memory");
                        let _ = self.sender.send(&FromAgent::CannotStart {
                            generation: start.generation,
                            stages: start.stages,
                            error,
                        });
                    }
                    None => self.start_workers(start),
                }
            }
            ToAgent::StopWorkers { generation } => {
                stop(&mut self.workers, generation);
                let _ = self.sender.send(&FromAgent::WorkersStopped { generation });
            }
            ToAgent::Refused { reason } => {
                warn!(%reason, "the coordinator fenced this node");
                return Ok(Some(Ended::Fenced));
            }
            ToAgent::Shutdown => return Ok(Some(Ended::Shutdown)),
            ToAgent::Welcome { .. } => {}
        }
        Ok(None)
    }

    /// Why this node cannot run the stages of `start`: by the estimate they need more than its
    /// available memory ([`crate::memory::check_node`]). Local agents share the coordinator's
    /// machine, which checked every stage together before the run started; a config that does not
    /// parse is left to the workers to report.
    fn memory_refusal(&self, start: &StartRequest) -> Option<String> {
        if self.args.local {
            return None;
        }
        let cfg = Config::from_toml(&start.config, "the coordinator's config").ok()?;
        let available = crate::memory::available_memory()?;
        crate::memory::check_node(&cfg, &start.stages, available)
            .err()
            .map(|e| e.to_string())
    }

    /// Starts the workers of a checked `StartWorkers` (the running ones were stopped unless it
    /// keeps them); a worker that cannot start is reported as exited.
    fn start_workers(&mut self, start: StartRequest) {
        let mut used: Vec<usize> = self.workers.iter().map(|w| w.device).collect();
        for &stage in &start.stages {
            let device = cuda_device(self.args.local, stage, &used);
            used.push(device);
            let spec = WorkerSpec {
                node: &self.args.name,
                control: &self.args.join,
                dir: &self.args.dir,
                host: &self.host,
                generation: start.generation,
                stage,
                device,
                config: &start.config,
                snapshot_to: &start.snapshot_to,
                session: &start.session,
                dump_grads: start.dump_grads.as_deref(),
                replacement: start.keep_running,
            };
            match self.launcher.launch(&spec) {
                Ok(worker) => self.workers.push(RunningWorker {
                    generation: start.generation,
                    stage,
                    launch: start.launch,
                    device,
                    worker,
                }),
                Err(e) => {
                    warn!(stage, error = %e, "cannot start a worker");
                    let _ = self.sender.send(&FromAgent::WorkerExited {
                        generation: start.generation,
                        stage,
                        launch: start.launch,
                        code: Some(1),
                        status: "not started".into(),
                        log_tail: e.to_string(),
                        log: String::new(),
                    });
                }
            }
        }
    }
}

/// The fields of a `StartWorkers` message.
#[derive(Debug, Default)]
struct StartRequest {
    generation: u64,
    stages: Vec<usize>,
    config: String,
    snapshot_to: Vec<String>,
    session: String,
    dump_grads: Option<PathBuf>,
    keep_running: bool,
    launch: u64,
}

/// Most stage workers one `StartWorkers` may ask for, whatever `--slots` says.
const MAX_STAGE_INDEX: usize = 1 << 16;

fn bad_message(args: &AgentArgs, problem: peer_input::BadInput) -> AgentError {
    AgentError::BadMessage {
        addr: args.join.clone(),
        problem: problem.0,
    }
}

/// Checks a `StartWorkers` for a node with `slots` slots before anything is written or started:
/// the session becomes a directory name under `--dir`, stages and addresses go on workers'
/// command lines, and a gradient-dump path is honoured only from the coordinator that started
/// this agent on its own machine (`local`).
fn check_start(
    start: &StartRequest,
    slots: usize,
    local: bool,
) -> Result<(), peer_input::BadInput> {
    // Empty: the agent's directory itself (local runs).
    if !start.session.is_empty() {
        peer_input::path_component("session", &start.session)?;
    }
    if start.stages.len() > slots {
        return Err(peer_input::BadInput(format!(
            "{} stages for a node with {} slot(s)",
            start.stages.len(),
            slots
        )));
    }
    for &stage in &start.stages {
        peer_input::index("stage", stage, MAX_STAGE_INDEX)?;
    }
    for addr in &start.snapshot_to {
        peer_input::address("snapshot_to", addr)?;
    }
    if start.dump_grads.is_some() && !local {
        return Err(peer_input::BadInput(
            "dump_grads: a remote coordinator cannot choose paths on this node".into(),
        ));
    }
    Ok(())
}

/// The CUDA device of a new worker of `stage` (a `model.device = "cuda"` stage opens it, modulo the
/// GPUs it sees): the lowest not `used` by this node's running workers, so a node's slots map onto
/// its GPUs; on a local agent (one per stage, all on the launcher's machine) the worker's global
/// slot.
fn cuda_device(local: bool, stage: usize, used: &[usize]) -> usize {
    if local {
        return stage;
    }
    (0..).find(|d| !used.contains(d)).expect("a free ordinal")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `StartWorkers` that every check accepts: two stages for two slots, a plain session name,
    /// snapshot addresses, no gradient dumps.
    fn good_start() -> StartRequest {
        StartRequest {
            generation: 3,
            stages: vec![0, 1],
            config: String::new(),
            snapshot_to: vec!["10.0.0.2:4100".into(), "node-b.example:4100".into()],
            session: "session-1732".into(),
            dump_grads: None,
            keep_running: false,
            launch: 4,
        }
    }

    /// `start` must be refused, with a message that names `field`.
    fn refused(start: &StartRequest, slots: usize, local: bool, field: &str) {
        let err = check_start(start, slots, local).expect_err(field);
        assert!(err.0.contains(field), "{field}: {err}");
    }

    #[test]
    fn good_start_messages_are_accepted() {
        check_start(&good_start(), 2, false).unwrap();
        // Fewer stages than slots, the agent's own directory, no snapshots.
        let local_run = StartRequest {
            stages: vec![5],
            snapshot_to: Vec::new(),
            session: String::new(),
            ..good_start()
        };
        check_start(&local_run, 4, false).unwrap();
        // The coordinator that started this agent on its own machine may ask for gradient dumps.
        let dumps = StartRequest {
            dump_grads: Some(PathBuf::from("/tmp/grads")),
            ..good_start()
        };
        check_start(&dumps, 2, true).unwrap();
    }

    #[test]
    fn a_session_that_is_not_a_plain_name_is_refused() {
        for session in ["..", "../../etc", "a/b", ".hidden", "é"] {
            let start = StartRequest {
                session: session.into(),
                ..good_start()
            };
            refused(&start, 2, false, "session");
        }
    }

    #[test]
    fn each_worker_of_a_node_gets_its_own_gpu() {
        assert_eq!(cuda_device(false, 7, &[]), 0);
        assert_eq!(cuda_device(false, 7, &[0, 2]), 1);
        assert_eq!(cuda_device(false, 7, &[1, 0]), 2);
        // Local agents share the launcher's machine: the global slot picks the GPU.
        assert_eq!(cuda_device(true, 3, &[0, 1, 2]), 3);
    }

    #[test]
    fn more_stages_than_slots_are_refused() {
        refused(&good_start(), 1, false, "stages");
        let huge = StartRequest {
            stages: vec![MAX_STAGE_INDEX],
            ..good_start()
        };
        refused(&huge, 2, false, "stage");
    }

    #[test]
    fn a_snapshot_address_without_host_and_port_is_refused() {
        for addr in ["", "host", "host:0", ":80", "a b:80"] {
            let start = StartRequest {
                snapshot_to: vec!["10.0.0.2:4100".into(), addr.into()],
                ..good_start()
            };
            refused(&start, 2, false, "snapshot_to");
        }
    }

    #[test]
    fn gradient_dumps_only_from_the_local_coordinator() {
        let start = StartRequest {
            dump_grads: Some(PathBuf::from("/etc")),
            ..good_start()
        };
        refused(&start, 2, false, "dump_grads");
    }

    /// A worker that has exited, but whose exit the agent sees only from its second poll on (it
    /// died between the agent's last reaping and the coordinator's next message).
    struct ExitsAfterOnePoll {
        polls: usize,
    }

    impl workers::Worker for ExitsAfterOnePoll {
        fn try_exit(&mut self) -> Option<workers::WorkerExit> {
            self.polls += 1;
            (self.polls > 1).then(|| workers::WorkerExit {
                code: Some(1),
                status: "exit status: 1".into(),
                log_tail: String::new(),
                log: String::new(),
            })
        }
        fn notify_leaving(&mut self) {}
        fn kill(&mut self) {}
    }

    /// A worker's exit that the agent can see when `StopWorkers` arrives is reported before the
    /// workers are stopped (stopping it first dropped the report: the coordinator never heard
    /// how the worker ended).
    #[test]
    fn an_exit_seen_when_stop_workers_arrives_is_reported_before_workers_stopped() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let agent_end = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let mut coordinator = ControlStream::new(listener.accept().unwrap().0).unwrap();
        let agent_end = ControlStream::new(agent_end).unwrap();
        let args = AgentArgs {
            join: "127.0.0.1:1".into(),
            name: "node-0".into(),
            slots: 1,
            host: Some("127.0.0.1".into()),
            dir: PathBuf::new(),
            connect_timeout: Duration::ZERO,
            job: None,
            local: true,
            preemption: None,
        };
        let mut node = Incarnation {
            args: &args,
            launcher: &ProcessLauncher,
            events: &ProcessEvents,
            host: "127.0.0.1".into(),
            sender: agent_end.sender(),
            heartbeat: Duration::from_secs(3600),
            last_heartbeat: Instant::now(),
            announced_leave: false,
            workers: vec![RunningWorker {
                generation: 2,
                stage: 1,
                launch: 1,
                device: 1,
                worker: Box::new(ExitsAfterOnePoll { polls: 0 }),
            }],
            snapshots: Arc::default(),
        };
        let (tx, messages) = channel();
        tx.send(Ok(ToAgent::StopWorkers { generation: 2 })).unwrap();
        tx.send(Ok(ToAgent::Shutdown)).unwrap();
        assert!(matches!(
            node.follow(&Preempted::default(), &messages),
            Ok(Ended::Shutdown)
        ));
        match coordinator.recv::<FromAgent>().unwrap() {
            FromAgent::WorkerExited {
                generation: 2,
                stage: 1,
                code: Some(1),
                ..
            } => {}
            other => panic!("expected the worker's exit first, got {other:?}"),
        }
        assert!(matches!(
            coordinator.recv::<FromAgent>().unwrap(),
            FromAgent::WorkersStopped { generation: 2 }
        ));
    }

    #[test]
    fn a_welcome_needs_a_usable_heartbeat() {
        let welcome = |heartbeat_s| ToAgent::Welcome {
            incarnation: 7,
            heartbeat_s,
        };
        assert_eq!(
            read_welcome(welcome(0.5)),
            Ok((7, Duration::from_millis(500)))
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e300] {
            match read_welcome(welcome(bad)) {
                Err(NotWelcome::Bad(e)) => assert!(e.0.contains("heartbeat_s"), "{e}"),
                other => panic!("heartbeat_s = {bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_refusal_or_another_message_is_not_a_welcome() {
        assert_eq!(
            read_welcome(ToAgent::Refused {
                reason: "node name in use".into()
            }),
            Err(NotWelcome::Refused("node name in use".into()))
        );
        match read_welcome(ToAgent::Shutdown) {
            Err(NotWelcome::Unexpected(what)) => assert!(what.contains("Shutdown"), "{what}"),
            other => panic!("{other:?}"),
        }
    }
}
