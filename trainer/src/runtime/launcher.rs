//! The launcher: starts one worker process per stage on this machine, wires the pipeline, drives the
//! steps (global gradient norm in canonical order, clipping, learning rate), evaluates and writes
//! `metrics.jsonl`.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use thiserror::Error;
use tracing::info;

use super::control::{ToLauncher, ToWorker};
use super::wire::{Frame, read_frame, write_frame};
use crate::config::Config;
use crate::data::{DataError, open_source};
use crate::lr::learning_rate;
use crate::metrics::{MetricsLog, StepMetrics};
use crate::model::params::param_specs;

/// Why a run failed.
#[derive(Debug, Error)]
pub enum LaunchError {
    /// Local file or socket failure.
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    /// The dataset is unusable.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A worker reported an error.
    #[error("stage {stage} failed: {error}\n  (log: {log})")]
    WorkerFailed { stage: usize, error: String, log: String },
    /// A worker process ended unexpectedly.
    #[error("stage {stage} worker exited unexpectedly ({status}); last lines of {log}:\n{tail}")]
    WorkerExited { stage: usize, status: String, log: String, tail: String },
    /// Something did not happen in time.
    #[error("timed out after {timeout:?} waiting for {what}; see the logs in {logs}")]
    Timeout { what: String, timeout: Duration, logs: String },
    /// A worker broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
}

/// Extra launcher behaviour, from the command line.
#[derive(Clone, Debug, Default)]
pub struct LaunchOptions {
    /// Workers write each step's gradients here (safetensors, one file per stage and step).
    pub dump_grads: Option<PathBuf>,
    /// Hide the progress bar.
    pub quiet: bool,
}

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct RunSummary {
    /// Loss of the last step.
    pub final_loss: f64,
    /// Last validation loss, if evaluation ran.
    pub val_loss: Option<f64>,
    /// Steps completed.
    pub steps: u64,
    /// Wall-clock seconds.
    pub elapsed_s: f64,
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
struct Pipeline {
    procs: Vec<WorkerProc>,
    writers: Vec<Option<BufWriter<TcpStream>>>,
    /// Connection index → stage, learned from each worker's hello.
    stage_of: HashMap<usize, usize>,
    events: Receiver<Event>,
    timeout: Duration,
    logs_dir: PathBuf,
}

/// Trains `cfg` with one local worker process per stage. Returns when all steps are done.
pub fn run_training(cfg: &Config, opts: &LaunchOptions) -> Result<RunSummary, LaunchError> {
    let started = Instant::now();
    let run_dir = &cfg.run.dir;
    let io = |what: String| move |source| LaunchError::Io { what: what.clone(), source };
    let logs_dir = run_dir.join("logs");
    std::fs::create_dir_all(&logs_dir).map_err(io(format!("creating the run directory {}", run_dir.display())))?;
    let config_path = run_dir.join("config.resolved.toml");
    std::fs::write(&config_path, cfg.to_toml()).map_err(io(format!("writing {}", config_path.display())))?;
    let metrics_path = run_dir.join("metrics.jsonl");
    let _ = std::fs::remove_file(&metrics_path);
    let mut metrics = MetricsLog::open(&metrics_path).map_err(io(format!("opening {}", metrics_path.display())))?;
    // Fail early, in the launcher, on an unusable dataset.
    open_source(&cfg.data, cfg.model.vocab_size)?;

    let mut pipeline = Pipeline::start(cfg, &config_path, &logs_dir, opts)?;
    let result = pipeline.train(cfg, opts, &mut metrics);
    match result {
        Ok((final_loss, val_loss)) => {
            pipeline.shutdown();
            Ok(RunSummary { final_loss, val_loss, steps: cfg.train.steps, elapsed_s: started.elapsed().as_secs_f64() })
        }
        Err(e) => {
            pipeline.kill_all();
            Err(e)
        }
    }
}

impl Pipeline {
    fn start(cfg: &Config, config_path: &Path, logs_dir: &Path, opts: &LaunchOptions) -> Result<Self, LaunchError> {
        let p = cfg.pipeline.stages;
        let io = |what: &str| {
            let what = what.to_string();
            move |source| LaunchError::Io { what: what.clone(), source }
        };
        let listener = TcpListener::bind("127.0.0.1:0").map_err(io("binding the coordinator port"))?;
        let control_addr = listener.local_addr().map_err(io("coordinator port"))?.to_string();
        let exe = std::env::current_exe().map_err(io("locating the seqpipe executable"))?;
        let threads = cfg.threads_per_worker().to_string();
        let mut procs = Vec::new();
        for stage in 0..p {
            let log = logs_dir.join(format!("stage-{stage}.log"));
            let file = std::fs::File::create(&log).map_err(io(&format!("creating {}", log.display())))?;
            let mut cmd = Command::new(&exe);
            cmd.arg("worker").arg("--control").arg(&control_addr).arg("--stage").arg(stage.to_string()).arg("--config").arg(config_path);
            if let Some(dir) = &opts.dump_grads {
                cmd.arg("--dump-grads").arg(dir);
            }
            cmd.env("RAYON_NUM_THREADS", &threads).env("CANDLE_NUM_THREADS", &threads);
            if std::env::var_os("RUST_LOG").is_none() {
                cmd.env("RUST_LOG", &cfg.run.log);
            }
            let stderr = file.try_clone().map_err(io("log file"))?;
            cmd.stdin(Stdio::null()).stdout(Stdio::from(file)).stderr(Stdio::from(stderr));
            let child = cmd.spawn().map_err(io(&format!("starting worker {stage} ({})", exe.display())))?;
            procs.push(WorkerProc { child, log });
        }
        let (tx, events) = channel();
        let mut pipeline = Self { procs, writers: Vec::new(), stage_of: HashMap::new(), events, timeout: Duration::from_secs_f64(cfg.pipeline.timeout_s), logs_dir: logs_dir.to_path_buf() };
        pipeline.accept_workers(&listener, &tx)?;
        drop(tx);
        // Hello from everyone, then the topology, then ready from everyone.
        let mut data_addrs = vec![String::new(); p];
        for (conn, msg) in pipeline.collect(p, "every worker to say hello")? {
            match msg {
                ToLauncher::Hello { stage, data_addr, .. } if stage < p && data_addrs[stage].is_empty() => {
                    pipeline.stage_of.insert(conn, stage);
                    data_addrs[stage] = data_addr;
                }
                other => return Err(LaunchError::Protocol(format!("expected hello, got {other:?}"))),
            }
        }
        let mut writers: Vec<Option<BufWriter<TcpStream>>> = (0..p).map(|_| None).collect();
        for (conn, w) in pipeline.writers.drain(..).enumerate() {
            writers[pipeline.stage_of[&conn]] = w;
        }
        pipeline.writers = writers;
        for stage in 0..p {
            let prev = (stage > 0).then(|| data_addrs[stage - 1].clone());
            let next = data_addrs.get(stage + 1).cloned();
            pipeline.send(stage, &ToWorker::Topology { generation: 0, prev, next })?;
        }
        pipeline.collect(p, "the workers to connect to their neighbours")?;
        info!(stages = p, "pipeline connected");
        Ok(pipeline)
    }

    fn accept_workers(&mut self, listener: &TcpListener, tx: &Sender<Event>) -> Result<(), LaunchError> {
        let io = |source| LaunchError::Io { what: "accepting worker connections".into(), source };
        listener.set_nonblocking(true).map_err(io)?;
        let deadline = Instant::now() + self.timeout;
        while self.writers.len() < self.procs.len() {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).map_err(io)?;
                    stream.set_nodelay(true).map_err(io)?;
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
                    self.writers.push(Some(BufWriter::new(stream)));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.check_children()?;
                    if Instant::now() > deadline {
                        return Err(self.timeout_error("every worker to connect to the coordinator"));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(io(e)),
            }
        }
        Ok(())
    }

    fn timeout_error(&self, what: &str) -> LaunchError {
        LaunchError::Timeout { what: what.to_string(), timeout: self.timeout, logs: self.logs_dir.display().to_string() }
    }

    fn send(&mut self, stage: usize, msg: &ToWorker) -> Result<(), LaunchError> {
        let writer = self.writers[stage].as_mut().ok_or_else(|| LaunchError::Protocol(format!("no connection to stage {stage}")))?;
        write_frame(writer, &Frame::new(msg, Vec::new())).map_err(|source| LaunchError::Io { what: format!("sending to stage {stage}"), source })
    }

    fn broadcast(&mut self, msg: &ToWorker) -> Result<(), LaunchError> {
        (0..self.procs.len()).try_for_each(|stage| self.send(stage, msg))
    }

    /// A worker that exited is an error (with its log's tail).
    fn check_children(&mut self) -> Result<(), LaunchError> {
        for (stage, proc) in self.procs.iter_mut().enumerate() {
            if let Ok(Some(status)) = proc.child.try_wait() {
                return Err(LaunchError::WorkerExited { stage, status: status.to_string(), log: proc.log.display().to_string(), tail: log_tail(&proc.log, 15) });
            }
        }
        Ok(())
    }

    /// Waits for one message from each of `count` connections.
    fn collect(&mut self, count: usize, what: &str) -> Result<Vec<(usize, ToLauncher)>, LaunchError> {
        let deadline = Instant::now() + self.timeout;
        let mut got = Vec::new();
        while got.len() < count {
            match self.events.recv_timeout(Duration::from_millis(50)) {
                Ok(Event::Message(conn, ToLauncher::Failed { stage, error })) => {
                    let _ = conn;
                    let log = self.procs.get(stage).map(|p| p.log.display().to_string()).unwrap_or_default();
                    return Err(LaunchError::WorkerFailed { stage, error, log });
                }
                Ok(Event::Message(conn, msg)) => got.push((conn, msg)),
                Ok(Event::Closed(conn, reason)) => {
                    // Give the process a moment to exit so the error can show its status and log.
                    std::thread::sleep(Duration::from_millis(200));
                    self.check_children()?;
                    let stage = self.stage_of.get(&conn).copied().unwrap_or(conn);
                    return Err(LaunchError::WorkerFailed { stage, error: format!("connection closed: {reason}"), log: self.procs[stage].log.display().to_string() });
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.check_children()?;
                    if Instant::now() > deadline {
                        return Err(self.timeout_error(what));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return Err(LaunchError::Protocol("all worker connections closed".into())),
            }
        }
        Ok(got)
    }

    fn train(&mut self, cfg: &Config, opts: &LaunchOptions, metrics: &mut MetricsLog) -> Result<(f64, Option<f64>), LaunchError> {
        let p = cfg.pipeline.stages;
        let t = &cfg.train;
        let tokens = cfg.tokens_per_step();
        let canonical: HashMap<String, usize> = param_specs(&cfg.model).into_iter().enumerate().map(|(i, s)| (s.name, i)).collect();
        let bar = if opts.quiet { ProgressBar::hidden() } else { ProgressBar::new(t.steps) };
        bar.set_style(ProgressStyle::with_template("{spinner} step {pos}/{len} [{bar:30}] {msg} ({elapsed}<{eta})").expect("valid template").progress_chars("=> "));
        let (mut final_loss, mut val_loss) = (f64::NAN, None);
        for step in 1..=t.steps {
            let step_started = Instant::now();
            let lr = learning_rate(step, t.steps, t.lr, t.min_lr, t.warmup_steps);
            self.broadcast(&ToWorker::RunStep { step })?;
            let mut sums = vec![None; canonical.len()];
            let mut loss_sum = None;
            for (_, msg) in self.collect(p, &format!("step {step}'s forward and backward"))? {
                match msg {
                    ToLauncher::StepDone { step: s, sums_of_squares, loss_sum: l, .. } if s == step => {
                        for (name, value) in sums_of_squares {
                            let index = *canonical.get(&name).ok_or_else(|| LaunchError::Protocol(format!("unknown parameter {name}")))?;
                            sums[index] = Some(value);
                        }
                        loss_sum = loss_sum.or(l);
                    }
                    other => return Err(LaunchError::Protocol(format!("expected step {step} done, got {other:?}"))),
                }
            }
            let sums: Vec<f64> = sums.into_iter().enumerate().map(|(i, s)| s.ok_or_else(|| LaunchError::Protocol(format!("no gradient norm for parameter #{i}")))).collect::<Result<_, _>>()?;
            // Summed in canonical parameter order: the same number whatever the partition.
            let grad_norm = ops::clip::global_norm(sums);
            let clip_coefficient = ops::clip::clip_coefficient(grad_norm, t.grad_clip);
            self.broadcast(&ToWorker::Apply { step, lr, clip_coefficient })?;
            self.collect(p, &format!("step {step}'s optimizer update"))?;
            let loss = loss_sum.ok_or_else(|| LaunchError::Protocol("the last stage reported no loss".into()))? / tokens as f64;
            let step_time_s = step_started.elapsed().as_secs_f64();
            let eval_due = t.eval_every > 0 && (step % t.eval_every == 0 || step == t.steps);
            let this_val = if eval_due { Some(self.evaluate(cfg)?) } else { None };
            let record = StepMetrics { step, loss, lr, grad_norm, tokens, step_time_s, tokens_per_s: tokens as f64 / step_time_s, val_loss: this_val };
            metrics.append(&record).map_err(|source| LaunchError::Io { what: format!("writing {}", metrics.path().display()), source })?;
            bar.set_message(format!("loss {loss:.4} | {:.0} tok/s", record.tokens_per_s));
            bar.inc(1);
            if let Some(v) = this_val {
                bar.suspend(|| info!(step, loss, val_loss = v, "evaluation"));
            }
            final_loss = loss;
            val_loss = this_val.or(val_loss);
        }
        bar.finish();
        Ok((final_loss, val_loss))
    }

    fn evaluate(&mut self, cfg: &Config) -> Result<f64, LaunchError> {
        let batches = cfg.train.eval_batches;
        self.broadcast(&ToWorker::Eval { batches })?;
        let mut loss_sum = None;
        for (_, msg) in self.collect(cfg.pipeline.stages, "evaluation")? {
            match msg {
                ToLauncher::EvalDone { loss_sum: l, .. } => loss_sum = loss_sum.or(l),
                other => return Err(LaunchError::Protocol(format!("expected evaluation results, got {other:?}"))),
            }
        }
        let tokens = batches * cfg.train.micro_batch_size * cfg.train.seq_len;
        Ok(loss_sum.ok_or_else(|| LaunchError::Protocol("the last stage reported no validation loss".into()))? / tokens as f64)
    }

    fn shutdown(&mut self) {
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

    fn kill_all(&mut self) {
        for proc in &mut self.procs {
            let _ = proc.child.kill();
            let _ = proc.child.wait();
        }
    }
}

/// The last `lines` lines of a log file.
fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].iter().map(|l| format!("  | {l}")).collect::<Vec<_>>().join("\n")
}
