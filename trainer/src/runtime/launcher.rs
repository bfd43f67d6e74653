//! The launcher's view of the pipeline: it starts one worker process per stage on this machine, wires
//! them to their neighbours, and exchanges control messages with them. The training loop that uses
//! it is in [`super::driver`].

use std::collections::HashMap;
use std::collections::VecDeque;
use std::io::BufReader;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{info, warn};

use super::auth;
use super::control::{ControlSender, ToLauncher, ToWorker};
use super::wire::read_frame;
use super::worker::PEER_FAILURE_EXIT_CODE;
use crate::config::Config;
use crate::data::DataError;

/// Why a run failed.
#[derive(Debug, Error)]
pub enum LaunchError {
    /// Local file or socket failure.
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// The dataset is unusable.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A worker reported an error.
    #[error("stage {stage} failed: {error}\n  (log: {log})")]
    WorkerFailed {
        stage: usize,
        error: String,
        log: String,
    },
    /// A worker process ended unexpectedly.
    #[error("stage {stage} worker exited unexpectedly ({status}); last lines of {log}:\n{tail}")]
    WorkerExited {
        stage: usize,
        status: String,
        log: String,
        tail: String,
    },
    /// Something did not happen in time.
    #[error("timed out after {timeout:?} waiting for {what}; see the logs in {logs}")]
    Timeout {
        what: String,
        timeout: Duration,
        logs: String,
    },
    /// A worker broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// Nodes were lost: their workers died. The surviving nodes are healthy and the run can go on
    /// without the lost ones.
    #[error("lost the node(s) of stage(s) {lost:?}: {cause}")]
    NodesLost { lost: Vec<usize>, cause: String },
    /// Nodes announced they are leaving (preemption notice); a checkpoint of `step`, the boundary
    /// they leave at, is committed.
    #[error("the node(s) of stage(s) {stages:?} leave after step {step} (preemption notice)")]
    NodesLeaving { stages: Vec<usize>, step: u64 },
    /// Checkpoint store failure.
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// The run cannot start or continue as asked.
    #[error("{0}")]
    Run(String),
}

enum Event {
    Message(usize, ToLauncher),
    Closed(usize, String),
}

struct WorkerProc {
    child: Child,
    log: PathBuf,
}

/// The running pipeline seen from the launcher.
pub struct Pipeline {
    procs: Vec<WorkerProc>,
    writers: Vec<Option<ControlSender>>,
    /// Messages that arrive whenever they are ready (checkpoint uploads), kept for the driver.
    side: VecDeque<ToLauncher>,
    /// Connection index → stage, learned from each worker's hello.
    stage_of: HashMap<usize, usize>,
    /// Connections in the order their hello arrived.
    hellos: Vec<usize>,
    /// The job's shared secret; every connection must prove it knows it.
    token: String,
    /// Stages a worker found silent past the timeout (hung or cut off).
    suspects: std::collections::BTreeSet<usize>,
    events: Receiver<Event>,
    timeout: Duration,
    logs_dir: PathBuf,
}

impl Pipeline {
    /// Starts one worker per stage with the resolved config at `config_path`, and waits until the
    /// pipeline is connected.
    pub fn start(
        cfg: &Config,
        generation: u64,
        config_path: &Path,
        logs_dir: &Path,
        dump_grads: Option<&Path>,
    ) -> Result<Self, LaunchError> {
        let p = cfg.pipeline.stages;
        let io = |what: &str| {
            let what = what.to_string();
            move |source| LaunchError::Io {
                what: what.clone(),
                source,
            }
        };
        let listener =
            TcpListener::bind("127.0.0.1:0").map_err(io("binding the coordinator port"))?;
        let control_addr = listener
            .local_addr()
            .map_err(io("coordinator port"))?
            .to_string();
        let exe = std::env::current_exe().map_err(io("locating the seqpipe executable"))?;
        let threads = cfg.threads_per_worker().to_string();
        let token = auth::job_token();
        let mut procs = Vec::new();
        for stage in 0..p {
            let log = logs_dir.join(format!("stage-{stage}.log"));
            let file =
                std::fs::File::create(&log).map_err(io(&format!("creating {}", log.display())))?;
            let mut cmd = Command::new(&exe);
            cmd.arg("worker")
                .arg("--control")
                .arg(&control_addr)
                .arg("--stage")
                .arg(stage.to_string())
                .arg("--config")
                .arg(config_path);
            if let Some(dir) = dump_grads {
                cmd.arg("--dump-grads").arg(dir);
            }
            cmd.env("RAYON_NUM_THREADS", &threads)
                .env("CANDLE_NUM_THREADS", &threads)
                .env(auth::TOKEN_ENV, &token);
            if std::env::var_os("RUST_LOG").is_none() {
                cmd.env("RUST_LOG", &cfg.run.log);
            }
            let stderr = file.try_clone().map_err(io("log file"))?;
            // Own process group: a Ctrl-C in the terminal reaches only the launcher, which stops the
            // workers after saving a final checkpoint.
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
            cmd.stdin(Stdio::null())
                .stdout(Stdio::from(file))
                .stderr(Stdio::from(stderr));
            let child = cmd
                .spawn()
                .map_err(io(&format!("starting worker {stage} ({})", exe.display())))?;
            procs.push(WorkerProc { child, log });
        }
        let (tx, events) = channel();
        let mut pipeline = Self {
            procs,
            writers: Vec::new(),
            side: VecDeque::new(),
            stage_of: HashMap::new(),
            hellos: Vec::new(),
            token,
            suspects: Default::default(),
            events,
            // Longer than the workers' per-message timeout: a worker that waits on a silent
            // neighbour gives up first and names it.
            timeout: Duration::from_secs_f64(2.0 * cfg.pipeline.timeout_s + 1.0),
            logs_dir: logs_dir.to_path_buf(),
        };
        pipeline.accept_workers(&listener, &tx)?;
        drop(tx);
        // Hello from everyone, then the topology, then ready from everyone.
        let mut data_addrs = vec![String::new(); p];
        let hellos = pipeline.collect(p, "every worker to say hello")?;
        let conns = std::mem::take(&mut pipeline.hellos);
        for (conn, msg) in conns.into_iter().zip(hellos) {
            match msg {
                ToLauncher::Hello {
                    stage, data_addr, ..
                } if stage < p && data_addrs[stage].is_empty() => {
                    pipeline.stage_of.insert(conn, stage);
                    data_addrs[stage] = data_addr;
                }
                other => {
                    return Err(LaunchError::Protocol(format!(
                        "expected hello, got {other:?}"
                    )));
                }
            }
        }
        let mut writers: Vec<Option<ControlSender>> = (0..p).map(|_| None).collect();
        for (conn, w) in pipeline.writers.drain(..).enumerate() {
            writers[pipeline.stage_of[&conn]] = w;
        }
        pipeline.writers = writers;
        for stage in 0..p {
            let prev = (stage > 0).then(|| data_addrs[stage - 1].clone());
            let next = data_addrs.get(stage + 1).cloned();
            pipeline.send(
                stage,
                &ToWorker::Topology {
                    generation,
                    prev,
                    next,
                },
            )?;
        }
        pipeline.collect(p, "the workers to connect to their neighbours")?;
        info!(stages = p, "pipeline connected");
        Ok(pipeline)
    }

    fn accept_workers(
        &mut self,
        listener: &TcpListener,
        tx: &Sender<Event>,
    ) -> Result<(), LaunchError> {
        let io = |source| LaunchError::Io {
            what: "accepting worker connections".into(),
            source,
        };
        listener.set_nonblocking(true).map_err(io)?;
        let deadline = Instant::now() + self.timeout;
        while self.writers.len() < self.procs.len() {
            match listener.accept() {
                Ok((mut stream, peer)) => {
                    stream.set_nonblocking(false).map_err(io)?;
                    stream.set_nodelay(true).map_err(io)?;
                    if let Err(e) = auth::challenge(&mut stream, &self.token, "control") {
                        warn!(%peer, error = %e, "closed an unauthenticated connection to the coordinator port");
                        continue;
                    }
                    let conn = self.writers.len();
                    let mut reader = BufReader::new(stream.try_clone().map_err(io)?);
                    let tx = tx.clone();
                    std::thread::spawn(move || {
                        loop {
                            match read_frame(&mut reader).and_then(|f| f.header::<ToLauncher>()) {
                                Ok(msg) => {
                                    if tx.send(Event::Message(conn, msg)).is_err() {
                                        break;
                                    }
                                }
                                Err(e) => {
                                    let _ = tx.send(Event::Closed(conn, e.to_string()));
                                    break;
                                }
                            }
                        }
                    });
                    self.writers.push(Some(ControlSender::new(stream)));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.check_children()?;
                    if Instant::now() > deadline {
                        return Err(
                            self.timeout_error("every worker to connect to the coordinator")
                        );
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(io(e)),
            }
        }
        Ok(())
    }

    fn timeout_error(&self, what: &str) -> LaunchError {
        LaunchError::Timeout {
            what: what.to_string(),
            timeout: self.timeout,
            logs: self.logs_dir.display().to_string(),
        }
    }

    /// Number of stages.
    pub fn stages(&self) -> usize {
        self.procs.len()
    }

    fn send(&mut self, stage: usize, msg: &ToWorker) -> Result<(), LaunchError> {
        let writer = self.writers[stage]
            .as_ref()
            .ok_or_else(|| LaunchError::Protocol(format!("no connection to stage {stage}")))?;
        writer.send(msg).map_err(|source| LaunchError::Io {
            what: format!("sending to stage {stage}"),
            source,
        })
    }

    /// Sends `msg` to every worker.
    pub fn broadcast(&mut self, msg: &ToWorker) -> Result<(), LaunchError> {
        (0..self.procs.len()).try_for_each(|stage| self.send(stage, msg))
    }

    /// A worker that exited is an error (with its log's tail).
    fn check_children(&mut self) -> Result<(), LaunchError> {
        for (stage, proc) in self.procs.iter_mut().enumerate() {
            if let Ok(Some(status)) = proc.child.try_wait() {
                return Err(LaunchError::WorkerExited {
                    stage,
                    status: status.to_string(),
                    log: proc.log.display().to_string(),
                    tail: log_tail(&proc.log, 15),
                });
            }
        }
        Ok(())
    }

    /// The next message from any worker; errors when a worker fails, exits or disconnects, or when
    /// nothing arrives before `deadline`.
    fn next_message(&mut self, deadline: Instant, what: &str) -> Result<ToLauncher, LaunchError> {
        loop {
            match self.events.recv_timeout(Duration::from_millis(50)) {
                Ok(Event::Message(
                    _,
                    ToLauncher::Failed {
                        stage,
                        error,
                        suspect,
                    },
                )) => {
                    self.suspects.extend(suspect);
                    let log = self
                        .procs
                        .get(stage)
                        .map(|p| p.log.display().to_string())
                        .unwrap_or_default();
                    return Err(LaunchError::WorkerFailed { stage, error, log });
                }
                Ok(Event::Message(conn, msg @ ToLauncher::Hello { .. })) => {
                    self.hellos.push(conn);
                    return Ok(msg);
                }
                Ok(Event::Message(_, msg)) => return Ok(msg),
                Ok(Event::Closed(conn, reason)) => {
                    // Give the process a moment to exit so the error can show its status and log.
                    std::thread::sleep(Duration::from_millis(100));
                    self.check_children()?;
                    let stage = self.stage_of.get(&conn).copied().unwrap_or(conn);
                    return Err(LaunchError::WorkerFailed {
                        stage,
                        error: format!("connection closed: {reason}"),
                        log: self.procs[stage].log.display().to_string(),
                    });
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.check_children()?;
                    if Instant::now() > deadline {
                        return Err(self.timeout_error(what));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(LaunchError::Protocol(
                        "all worker connections closed".into(),
                    ));
                }
            }
        }
    }

    /// Waits for `count` replies, setting checkpoint-upload messages aside for [`Pipeline::next_side_message`].
    pub fn collect(&mut self, count: usize, what: &str) -> Result<Vec<ToLauncher>, LaunchError> {
        let deadline = Instant::now() + self.timeout;
        let mut got = Vec::new();
        while got.len() < count {
            match self.next_message(deadline, what)? {
                msg @ (ToLauncher::ShardWritten { .. } | ToLauncher::ShardFailed { .. }) => {
                    self.side.push_back(msg)
                }
                msg => got.push(msg),
            }
        }
        Ok(got)
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

    /// Asks every worker to exit, then makes sure they have.
    pub fn shutdown(&mut self) {
        let _ = self.broadcast(&ToWorker::Shutdown);
        let deadline = Instant::now() + Duration::from_secs(10);
        for proc in &mut self.procs {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = proc.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        self.kill_all();
    }

    /// After a failure: waits up to `grace` for the workers to stop by themselves, then kills the
    /// rest. Returns the stages whose worker is lost (killed by a signal, or failed by itself), as
    /// opposed to workers that stopped only because a neighbour failed (exit code
    /// [`PEER_FAILURE_EXIT_CODE`]) or were still running: those nodes are healthy.
    pub fn stop_after_failure(&mut self, grace: Duration) -> Vec<usize> {
        // Workers next to a dead one exit at once (broken link); the others wait for the launcher
        // and never exit by themselves. Stop waiting once nothing has changed for a short while.
        const QUIET: Duration = Duration::from_millis(150);
        let deadline = Instant::now() + grace;
        let mut last_change = Instant::now();
        let mut statuses: Vec<Option<std::process::ExitStatus>> = vec![None; self.procs.len()];
        while Instant::now() < deadline
            && last_change.elapsed() < QUIET
            && statuses.iter().any(Option::is_none)
        {
            for (stage, proc) in self.procs.iter_mut().enumerate() {
                if statuses[stage].is_none() {
                    statuses[stage] = proc.child.try_wait().ok().flatten();
                    if statuses[stage].is_some() {
                        last_change = Instant::now();
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        while let Ok(event) = self.events.try_recv() {
            if let Event::Message(_, ToLauncher::Failed { suspect, .. }) = event {
                self.suspects.extend(suspect);
            }
        }
        self.kill_all();
        let peer_failure = i32::from(PEER_FAILURE_EXIT_CODE);
        let died: Vec<usize> = statuses
            .iter()
            .enumerate()
            .filter(|(_, s)| s.is_some_and(|s| s.code() != Some(peer_failure)))
            .map(|(stage, _)| stage)
            .collect();
        if !died.is_empty() {
            return died;
        }
        // Nobody died: the silent stages that were still running are hung (or cut off).
        self.suspects
            .iter()
            .copied()
            .filter(|&s| statuses.get(s).is_some_and(Option::is_none))
            .collect()
    }

    /// Kills every worker (after an error).
    pub fn kill_all(&mut self) {
        for proc in &mut self.procs {
            let _ = proc.child.kill();
            let _ = proc.child.wait();
        }
    }
}

impl Drop for Pipeline {
    /// No worker outlives its pipeline, whatever path dropped it.
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// The last `lines` lines of a log file.
fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|l| format!("  | {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}
