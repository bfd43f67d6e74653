//! How an agent starts, watches and stops its node's stage workers: a [`WorkerLauncher`] starts
//! one for a [`WorkerSpec`] and hands back a [`Worker`] to poll for its exit, pass a preemption
//! notice to, or kill. The `seqpipe agent` binary's launcher ([`ProcessLauncher`]) runs each
//! worker as a `seqpipe worker` child process with its own log; an in-process harness supplies one
//! that runs workers as threads. The bookkeeping over them ([`reap`], [`stop`]) is the same for
//! both.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use thiserror::Error;
use tracing::info;

use super::super::control::FromAgent;
use crate::config::Config;

/// What one worker is started with (the fields of the coordinator's `StartWorkers` that concern
/// it, and the agent's own).
#[derive(Clone, Copy, Debug)]
pub struct WorkerSpec<'a> {
    /// The node's name (`--name` of the agent).
    pub node: &'a str,
    /// The coordinator's control address the worker reports to.
    pub control: &'a str,
    /// The agent's directory (`--dir`): configs and logs go under it.
    pub dir: &'a Path,
    /// The address the worker listens on for its neighbours.
    pub host: &'a str,
    pub generation: u64,
    pub stage: usize,
    /// Its CUDA device ordinal.
    pub device: usize,
    /// The run's config, as TOML.
    pub config: &'a str,
    pub snapshot_to: &'a [String],
    /// The run's session (a directory name under `dir`; empty: `dir` itself).
    pub session: &'a str,
    pub dump_grads: Option<&'a Path>,
    /// Started beside the node's running workers (`keep_running`: a mid-step replacement).
    pub replacement: bool,
}

/// How a worker ended, as its agent reports it (`FromAgent::WorkerExited`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerExit {
    /// Its exit code; none when a signal ended it.
    pub code: Option<i32>,
    /// The exit status in words (`exit status: 1`, `signal: 9 (SIGKILL)`).
    pub status: String,
    /// The end of its log, indented.
    pub log_tail: String,
    /// Where its log is.
    pub log: String,
}

/// A started worker.
pub trait Worker: Send {
    /// How it exited, if it did (never waits).
    fn try_exit(&mut self) -> Option<WorkerExit>;
    /// Passes on the node's preemption notice (SIGTERM to a worker process): it leaves at the
    /// next step boundary.
    fn notify_leaving(&mut self);
    /// Kills it and waits for it to be gone.
    fn kill(&mut self);
}

/// Starts the node's workers.
pub trait WorkerLauncher: Send + Sync {
    /// Starts the worker `spec` describes.
    fn launch(&self, spec: &WorkerSpec<'_>) -> Result<Box<dyn Worker>, StartError>;
}

/// Why a worker could not be started (reported to the coordinator as its exit).
#[derive(Debug, Error)]
pub enum StartError {
    /// A local failure (files, processes).
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// The coordinator sent a config this binary cannot use.
    #[error("the coordinator's config: {0}")]
    Config(#[from] crate::config::ConfigError),
}

/// A worker this agent started.
pub(super) struct RunningWorker {
    pub(super) generation: u64,
    pub(super) stage: usize,
    /// The coordinator's number of the `StartWorkers` that started it.
    pub(super) launch: u64,
    /// Its CUDA device ordinal.
    pub(super) device: usize,
    pub(super) worker: Box<dyn Worker>,
}

/// Workers that exited by themselves since the last call, as reports (and forgets them).
pub(super) fn reap(workers: &mut Vec<RunningWorker>) -> Vec<FromAgent> {
    let mut exits = Vec::new();
    workers.retain_mut(|w| match w.worker.try_exit() {
        Some(exit) => {
            info!(stage = w.stage, status = %exit.status, "worker exited");
            exits.push(FromAgent::WorkerExited {
                generation: w.generation,
                stage: w.stage,
                launch: w.launch,
                code: exit.code,
                status: exit.status,
                log_tail: exit.log_tail,
                log: exit.log,
            });
            false
        }
        None => true,
    });
    exits
}

/// Kills the workers of `stages` (replaced mid-step), and waits for them; their exits are not
/// reported.
pub(super) fn stop_stages(workers: &mut Vec<RunningWorker>, stages: &[usize]) {
    workers.retain_mut(|w| {
        if !stages.contains(&w.stage) {
            return true;
        }
        info!(
            stage = w.stage,
            "stopping the worker a replacement takes over from"
        );
        w.worker.kill();
        false
    });
}

/// Kills the workers of `generation` and older ones, and waits for them.
pub(super) fn stop(workers: &mut Vec<RunningWorker>, generation: u64) {
    workers.retain_mut(|w| {
        if w.generation > generation {
            return true;
        }
        w.worker.kill();
        false
    });
}

/// The `seqpipe agent` binary's launcher: each worker is a `seqpipe worker` child process (this
/// executable), in its own process group, killed when the agent dies, logging to
/// `<dir>/<session>/logs/stage-<stage>.log`.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessLauncher;

/// A worker process and its log.
struct ProcessWorker {
    child: Child,
    log: PathBuf,
}

impl Worker for ProcessWorker {
    fn try_exit(&mut self) -> Option<WorkerExit> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(WorkerExit {
                code: status.code(),
                status: status.to_string(),
                log_tail: log_tail(&self.log, 15),
                log: self.log.display().to_string(),
            }),
            _ => None,
        }
    }

    fn notify_leaving(&mut self) {
        signal(&self.child, libc::SIGTERM);
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl WorkerLauncher for ProcessLauncher {
    fn launch(&self, spec: &WorkerSpec<'_>) -> Result<Box<dyn Worker>, StartError> {
        let (child, log) = spawn_worker(spec)?;
        Ok(Box::new(ProcessWorker { child, log }))
    }
}

fn signal(child: &Child, sig: i32) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) on a child's pid has no memory-safety preconditions.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

fn spawn_worker(spec: &WorkerSpec<'_>) -> Result<(Child, PathBuf), StartError> {
    let WorkerSpec {
        node,
        control,
        dir,
        host,
        generation,
        stage,
        device,
        config,
        snapshot_to,
        session,
        dump_grads,
        replacement: _,
    } = *spec;
    let io = |what: String| {
        move |source| StartError::Io {
            what: what.clone(),
            source,
        }
    };
    let cfg = Config::from_toml(config, "the coordinator's config")?;
    let logs = dir.join(session).join("logs");
    std::fs::create_dir_all(&logs).map_err(io(format!("creating {}", logs.display())))?;
    let config_path = logs.join(format!("{node}.config.toml"));
    std::fs::write(&config_path, config)
        .map_err(io(format!("writing {}", config_path.display())))?;
    let log = logs.join(format!("stage-{stage}.log"));
    // Appended to, not truncated: a replacement worker keeps its predecessor's log, which the
    // failure report of that predecessor names.
    let file = append_log(
        &log,
        &format!("worker of stage {stage}, generation {generation}"),
    )
    .map_err(io(format!("opening {}", log.display())))?;
    let exe = std::env::current_exe().map_err(io("locating the seqpipe executable".into()))?;
    let threads = cfg.threads_per_worker().to_string();
    let mut cmd = Command::new(exe);
    cmd.arg("worker")
        .args(["--control", control])
        .args(["--stage", &stage.to_string()])
        .args(["--generation", &generation.to_string()])
        .args(["--bind", host])
        .arg("--config")
        .arg(&config_path);
    if let Some(dir) = dump_grads {
        cmd.arg("--dump-grads").arg(dir);
    }
    for addr in snapshot_to {
        cmd.args(["--snapshot-to", addr]);
    }
    cmd.env("RAYON_NUM_THREADS", &threads)
        .env("CANDLE_NUM_THREADS", &threads)
        .env(crate::model::compute::CUDA_DEVICE_ENV, device.to_string());
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", &cfg.run.log);
    }
    let stderr = file.try_clone().map_err(io("log file".into()))?;
    // Own process group: a SIGTERM to the agent reaches a worker only through the agent, which
    // forwards it as a preemption notice.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    die_with_parent(&mut cmd);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(file))
        .stderr(Stdio::from(stderr));
    let child = cmd
        .spawn()
        .map_err(io(format!("starting the worker of stage {stage}")))?;
    info!(stage, generation, pid = child.id(), "worker started");
    Ok((child, log))
}

/// The child gets SIGKILL when its parent dies: no worker outlives its agent, no agent its
/// launcher, whatever killed the parent.
pub(in crate::runtime) fn die_with_parent(cmd: &mut Command) {
    // SAFETY: the closure runs between fork and exec and calls only prctl(2) and getppid(2),
    // which are async-signal-safe.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(cmd, || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before prctl: then we were re-parented already.
            if libc::getppid() == 1 {
                return Err(std::io::Error::other("the parent process already exited"));
            }
            Ok(())
        });
    }
}

/// Opens the log at `path` for appending (creating it) and marks where the process `who`
/// starts writing, so that the logs of earlier processes at the same path survive.
pub(in crate::runtime) fn append_log(path: &Path, who: &str) -> std::io::Result<std::fs::File> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let unix_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    writeln!(file, "==== {who} starts (unix time {unix_s}) ====")?;
    Ok(file)
}

/// The last `lines` lines of a log file, indented.
fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|l| format!("  | {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replacement worker's log is appended to its predecessor's, which a failure report names
    /// by path: both processes' lines survive, each after a header.
    #[test]
    fn a_second_process_appends_to_the_log() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("seqpipe-append-log-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("stage-1.log");
        let _ = std::fs::remove_file(&path);
        writeln!(append_log(&path, "first").unwrap(), "predecessor died here").unwrap();
        writeln!(append_log(&path, "second").unwrap(), "replacement line").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[0].contains("first starts"), "{text}");
        assert_eq!(lines[1], "predecessor died here");
        assert!(lines[2].contains("second starts"), "{text}");
        assert_eq!(lines[3], "replacement line");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A worker whose exit is scripted: `None` until `exit_at` polls, then that exit.
    struct Scripted {
        polls: usize,
        exit_at: usize,
        killed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    }

    impl Worker for Scripted {
        fn try_exit(&mut self) -> Option<WorkerExit> {
            self.polls += 1;
            (self.polls >= self.exit_at).then(|| WorkerExit {
                code: Some(3),
                status: "exit status: 3".into(),
                log_tail: String::new(),
                log: "here".into(),
            })
        }
        fn notify_leaving(&mut self) {}
        fn kill(&mut self) {
            self.killed.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn running(
        generation: u64,
        stage: usize,
        exit_at: usize,
    ) -> (RunningWorker, std::sync::Arc<std::sync::atomic::AtomicBool>) {
        let killed = std::sync::Arc::default();
        let worker = Scripted {
            polls: 0,
            exit_at,
            killed: std::sync::Arc::clone(&killed),
        };
        (
            RunningWorker {
                generation,
                stage,
                // Each test worker its own start, numbered after its generation and stage.
                launch: generation * 100 + stage as u64,
                device: 0,
                worker: Box::new(worker),
            },
            killed,
        )
    }

    /// A replacement's start stops the still-running worker of its stage, without an exit
    /// report (its exit would otherwise be taken for the replacement's), and spares the others.
    #[test]
    fn a_replacement_stops_the_worker_of_its_stage_without_a_report() {
        let (a, a_killed) = running(1, 0, usize::MAX);
        let (b, b_killed) = running(1, 1, usize::MAX);
        let mut workers = vec![a, b];
        stop_stages(&mut workers, &[1]);
        assert!(b_killed.load(std::sync::atomic::Ordering::SeqCst));
        assert!(!a_killed.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(workers.len(), 1);
        assert_eq!(workers[0].stage, 0);
        assert!(reap(&mut workers).is_empty());
    }

    /// Reaping reports each exited worker once, with its generation and stage, and keeps the
    /// others; stopping a generation kills it and older ones only.
    #[test]
    fn reaping_reports_each_exit_once_and_stop_spares_newer_generations() {
        let (a, _) = running(1, 0, 1);
        let (b, b_killed) = running(1, 1, usize::MAX);
        let (c, c_killed) = running(2, 2, usize::MAX);
        let mut workers = vec![a, b, c];
        let exits = reap(&mut workers);
        assert_eq!(exits.len(), 1);
        assert!(matches!(
            &exits[0],
            FromAgent::WorkerExited { generation: 1, stage: 0, launch: 100, code: Some(3), status, log, .. }
                if status == "exit status: 3" && log == "here"
        ));
        assert!(reap(&mut workers).is_empty());
        stop(&mut workers, 1);
        assert_eq!(workers.len(), 1);
        assert!(b_killed.load(std::sync::atomic::Ordering::SeqCst));
        assert!(!c_killed.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(workers[0].generation, 2);
    }
}
