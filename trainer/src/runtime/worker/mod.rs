//! A stage worker: one OS process per pipeline stage. It connects to the launcher, wires itself to its
//! neighbours, then executes its stage's action list for every step it is told to run.

use std::collections::{HashMap, HashSet};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use checkpoint::{CheckpointError, CheckpointStore};
use ops::adamw::{AdamW, AdamWConfig};
use thiserror::Error;
use tracing::{debug, info, warn};

use super::auth::{self, Purpose};
use super::control::{
    ControlSender, ControlStream, FailureCause, Side, StepCost, ToLauncher, ToWorker, UnitTime,
};
use super::peer_snapshots::{self, PeerCopier};
use super::trace::unix_time_us;
use super::transport::{DataPort, Payload, TcpLink, Transport, TransportError, connect_retrying};
use crate::checkpointing::hf;
use crate::checkpointing::shard::{
    from_tensor_data, names_to_restore, restore, snapshot, to_tensor_data,
};
use crate::checkpointing::state::TrainerState;
use crate::config::{Config, ConfigError};
use crate::data::{DataError, Split, TokenSource, micro_batch_tokens, open_source};
use crate::model::{Mode, ModelError, Stage, StageInput, StageOutput, partition_layers};
use crate::schedule::{Action, Schedule, ScheduleError, Unit, generate, generate_forward_only};

/// Exit status of a worker that stopped because a neighbouring stage failed (its own node is fine).
pub const PEER_FAILURE_EXIT_CODE: u8 = 3;

/// Why a worker stopped.
#[derive(Debug, Error)]
pub enum WorkerError {
    /// The config could not be used.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The launcher could not be reached or went away.
    #[error("coordinator connection ({addr}): {source}")]
    Control {
        addr: String,
        source: std::io::Error,
    },
    /// A neighbouring stage could not be reached or misbehaved.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The schedule is invalid.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// Data could not be read.
    #[error(transparent)]
    Data(#[from] DataError),
    /// `SEQPIPE_JOB_TOKEN` is set but empty.
    #[error(transparent)]
    Token(#[from] auth::EmptyJobToken),
    /// The launcher sent something out of protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A local I/O failure (sockets, gradient dumps).
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// A tensor operation failed.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// The checkpoint store failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A Hugging Face directory could not be used.
    #[error(transparent)]
    Hf(#[from] hf::HfError),
}

/// How a worker is started (`seqpipe worker ...`).
#[derive(Clone, Debug)]
pub struct WorkerArgs {
    /// The launcher's control address.
    pub control: String,
    /// This worker's stage index.
    pub stage: usize,
    /// The plan generation it runs under.
    pub generation: u64,
    /// The address its data port listens on (its neighbours connect there).
    pub bind: String,
    /// The resolved config file.
    pub config: PathBuf,
    /// Write each step's accumulated gradients here before the update (debugging and tests).
    pub dump_grads: Option<PathBuf>,
    /// Agents' snapshot addresses to copy the state to after every step.
    pub snapshot_to: Vec<String>,
}

/// The tokens of the micro-batches in flight: `rows × (seq_len + 1)`.
struct MicroBatchTokens {
    tokens: HashMap<usize, Vec<u32>>,
}

/// A running worker.
struct Worker {
    cfg: Config,
    stage: Stage,
    optimizer: AdamW,
    data: Option<Box<dyn TokenSource>>,
    schedule: Schedule,
    segment_lengths: Vec<usize>,
    prev: Option<TcpLink>,
    next: Option<TcpLink>,
    dump_grads: Option<PathBuf>,
    checkpoints: Option<Checkpoints>,
    /// The job's shared secret (from the launcher).
    token: String,
    /// Set by SIGTERM: a preemption notice for this node.
    leaving: Arc<AtomicBool>,
    /// Sends the state after every step to the agents' memory (tier-1 recovery).
    peer_copier: Option<PeerCopier>,
    /// The data port, kept to accept a relink from a replacement of the previous stage.
    data_port: Option<DataPort>,
    /// What this worker did in the current step (mid-step recovery).
    record: StepRecord,
    /// A replacement's neighbours' outputs of the lost stage, for its first step.
    replay_skip: HashSet<(Payload, Unit)>,
}

/// What a worker did in the current training step: the boundary tensors it sent (kept until the
/// step's update, so a replacement of a neighbour can have them again), what it received, and
/// its costs. A replacement also knows which of its outputs the neighbours already have.
#[derive(Default)]
struct StepRecord {
    step: u64,
    sent: Vec<(Payload, Unit, Tensor)>,
    received: Vec<(Payload, Unit)>,
    done_units: usize,
    cost: StepCost,
    skip: HashSet<(Payload, Unit)>,
    /// When tracing: the step's start on the monotonic clock and on the wall clock (Unix µs), so
    /// units are placed on the wall clock without ever overlapping.
    trace_epoch: Option<(Instant, u64)>,
}

impl StepRecord {
    fn retain(&mut self, payload: Payload, u: Unit, t: &Tensor) {
        self.cost.retained_bytes += (t.elem_count() * t.dtype().size_in_bytes()) as u64;
        self.sent.push((payload, u, t.clone()));
    }

    /// Counts a forward or backward unit that started at `started` and just ended.
    fn computed(&mut self, action: Action, started: UnitStart, redone: bool) {
        let elapsed = started.wall.elapsed();
        let seconds = elapsed.as_secs_f64();
        if let Some((epoch, epoch_us)) = self.trace_epoch {
            self.cost.unit_times.push(UnitTime {
                unit: action.unit(),
                backward: matches!(action, Action::Backward(_)),
                start_us: epoch_us
                    + started.wall.saturating_duration_since(epoch).as_micros() as u64,
                dur_us: elapsed.as_micros() as u64,
                cpu_us: process_cpu_time().saturating_sub(started.cpu).as_micros() as u64,
                redone,
            });
        }
        self.done_units += 1;
        self.cost.units += 1;
        self.cost.compute_s += seconds;
        if redone {
            self.cost.redone_units += 1;
            self.cost.redone_s += seconds;
        }
    }
}

/// When a unit started: on the monotonic clock and in the process's CPU time.
#[derive(Clone, Copy)]
struct UnitStart {
    wall: Instant,
    cpu: Duration,
}

impl UnitStart {
    fn now() -> Self {
        Self {
            wall: Instant::now(),
            cpu: process_cpu_time(),
        }
    }
}

/// CPU time used by this process so far, all threads (`CLOCK_PROCESS_CPUTIME_ID`). A worker
/// computes on one thread (plus its rayon pool), so across a unit it is the unit's compute time
/// without the time the process waited for a core.
fn process_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, exclusively borrowed timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The per-call state of [`Worker::execute`].
struct ExecState {
    tokens: MicroBatchTokens,
    inbox: HashMap<Unit, Tensor>,
    outbox: HashMap<Unit, Tensor>,
    loss_sum: Option<f64>,
    loss_scale: f64,
}

/// A snapshot waiting for the uploader.
struct UploadJob {
    step: u64,
    tensors: Vec<(String, Tensor)>,
    snapshot_s: f64,
}

/// The worker's checkpoint store and its background uploader.
struct Checkpoints {
    store: CheckpointStore,
    /// One runtime for all of the worker's store I/O (restores on the main thread, uploads on the
    /// uploader thread): pooled HTTP connections belong to the runtime that opened them, and a
    /// multi-threaded runtime keeps driving them between calls.
    runtime: Arc<tokio::runtime::Runtime>,
    uploads: std::sync::mpsc::Sender<UploadJob>,
}

impl Checkpoints {
    /// Opens the store and starts the uploader thread, which reports each shard to the launcher.
    fn start(cfg: &Config, stage: usize, control: ControlSender) -> Result<Self, WorkerError> {
        let store = CheckpointStore::open(
            &cfg.checkpoint.resolved_url(&cfg.run.dir),
            &cfg.checkpoint.store_options(),
        )?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("checkpoint-io")
            .enable_all()
            .build()
            .map_err(|source| WorkerError::Io {
                what: "starting the checkpoint I/O runtime".into(),
                source,
            })?;
        let runtime = Arc::new(runtime);
        let (uploads, jobs) = std::sync::mpsc::channel::<UploadJob>();
        let shard_name = format!("stage-{stage}-of-{}", cfg.pipeline.stages);
        let (uploader_store, uploader_runtime) = (store.clone(), Arc::clone(&runtime));
        std::thread::Builder::new()
            .name("checkpoint-upload".into())
            .spawn(move || {
                for UploadJob {
                    step,
                    tensors,
                    snapshot_s,
                } in jobs
                {
                    let started = Instant::now();
                    let result = tensors
                        .iter()
                        .map(|(n, t)| Ok((n.clone(), to_tensor_data(t)?)))
                        .collect::<Result<Vec<_>, candle_core::Error>>()
                        .map_err(|e| e.to_string())
                        .and_then(|data| {
                            uploader_runtime
                                .block_on(uploader_store.write_shard(step, &shard_name, data))
                                .map_err(|e| e.to_string())
                        });
                    let msg = match result {
                        Ok(shard) => {
                            info!(
                                step,
                                bytes = shard.size,
                                seconds = started.elapsed().as_secs_f64(),
                                "checkpoint shard uploaded"
                            );
                            ToLauncher::ShardWritten {
                                stage,
                                step,
                                shard,
                                snapshot_s,
                            }
                        }
                        Err(error) => ToLauncher::ShardFailed { stage, step, error },
                    };
                    if control.send(&msg).is_err() {
                        break;
                    }
                }
            })
            .map_err(|source| WorkerError::Io {
                what: "starting the checkpoint uploader".into(),
                source,
            })?;
        Ok(Self {
            store,
            runtime,
            uploads,
        })
    }
}

/// Runs a worker until the launcher says shut down. Errors are also reported to the launcher.
pub fn run_worker(args: WorkerArgs) -> Result<(), WorkerError> {
    let control_err = |source| WorkerError::Control {
        addr: args.control.clone(),
        source,
    };
    let cfg = Config::from_toml(
        &std::fs::read_to_string(&args.config).map_err(|source| ConfigError::Read {
            path: args.config.clone(),
            source,
        })?,
        &args.config.display().to_string(),
    )?;
    cfg.validate()?;
    let timeout = cfg.pipeline.timeout();
    let token = auth::token_from_env()?.unwrap_or_default();
    let addr = resolve(&args.control)?;
    let mut stream = connect_retrying(&addr, timeout).map_err(control_err)?;
    auth::connect(&mut stream, &token, Purpose::Control).map_err(control_err)?;
    let mut control = ControlStream::new(stream).map_err(control_err)?;
    let result = (|| {
        let listener =
            TcpListener::bind((args.bind.as_str(), 0)).map_err(|source| WorkerError::Io {
                what: format!("binding the stage data port on {}", args.bind),
                source,
            })?;
        let data_addr = listener
            .local_addr()
            .map_err(|source| WorkerError::Io {
                what: "stage data port".into(),
                source,
            })?
            .to_string();
        let data_port =
            DataPort::open(listener, token.clone()).map_err(|source| WorkerError::Io {
                what: "stage data port".into(),
                source,
            })?;
        control
            .send(&ToLauncher::Hello {
                stage: args.stage,
                generation: args.generation,
                data_addr,
                pid: std::process::id(),
            })
            .map_err(control_err)?;
        let mut worker = Worker::new(cfg, args.stage, args.dump_grads.clone())?;
        worker.token = token.clone();
        if !args.snapshot_to.is_empty() {
            worker.peer_copier = Some(
                PeerCopier::start(args.snapshot_to.clone(), token.clone(), timeout).map_err(
                    |source| WorkerError::Io {
                        what: "starting the peer-snapshot sender".into(),
                        source,
                    },
                )?,
            );
        }
        worker.watch_for_preemption()?;
        worker.checkpoints = Some(Checkpoints::start(
            &worker.cfg,
            args.stage,
            control.sender(),
        )?);
        match control.recv::<ToWorker>().map_err(control_err)? {
            ToWorker::Topology {
                generation,
                prev,
                next,
                replacement,
            } => worker.connect(data_port, generation, prev, next, replacement)?,
            other => {
                return Err(WorkerError::Protocol(format!(
                    "expected the topology first, got {other:?}"
                )));
            }
        }
        control
            .send(&ToLauncher::Ready { stage: args.stage })
            .map_err(control_err)?;
        worker.serve(&mut control).map_err(|e| match e {
            WorkerError::Control { source, .. } => control_err(source),
            e => e,
        })
    })();
    if let Err(e) = &result {
        let suspect = match e {
            WorkerError::Transport(TransportError::Timeout { peer_stage, .. }) => Some(*peer_stage),
            _ => None,
        };
        let _ = control.send(&ToLauncher::Failed {
            stage: args.stage,
            error: e.to_string(),
            suspect,
            cause: e.cause(),
        });
    }
    result
}

impl WorkerError {
    /// Whether this failure would recur on any node: then recovering only repeats it.
    pub fn cause(&self) -> FailureCause {
        match self {
            WorkerError::Model(ModelError::OverBudget { .. }) => FailureCause::OverBudget,
            WorkerError::Config(_)
            | WorkerError::Schedule(_)
            | WorkerError::Token(_)
            | WorkerError::Hf(_) => FailureCause::Permanent,
            WorkerError::Data(e) if !matches!(e, DataError::Io { .. }) => FailureCause::Permanent,
            _ => FailureCause::Transient,
        }
    }
}

/// Maps an I/O error to [`WorkerError::Io`] saying what was being done.
fn io_error(what: String) -> impl Fn(std::io::Error) -> WorkerError {
    move |source| WorkerError::Io {
        what: what.clone(),
        source,
    }
}

fn resolve(addr: &str) -> Result<std::net::SocketAddr, WorkerError> {
    use std::net::ToSocketAddrs;
    let io = |source| WorkerError::Control {
        addr: addr.to_string(),
        source,
    };
    addr.to_socket_addrs().map_err(io)?.next().ok_or_else(|| {
        io(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "address resolves to nothing",
        ))
    })
}

impl Worker {
    fn new(
        cfg: Config,
        stage_index: usize,
        dump_grads: Option<PathBuf>,
    ) -> Result<Self, WorkerError> {
        let layouts = partition_layers(&cfg.model, cfg.train.seq_len, cfg.pipeline.stages)
            .map_err(ModelError::from)?;
        let layout = layouts.into_iter().nth(stage_index).ok_or_else(|| {
            WorkerError::Protocol(format!(
                "stage {stage_index} does not exist in a {}-stage pipeline",
                cfg.pipeline.stages
            ))
        })?;
        let segment_lengths = cfg.segment_lengths()?;
        let (first, last) = (layout.is_first(), layout.is_last());
        info!(stage = stage_index, layers = ?layout.layers, ?segment_lengths, "building stage");
        let mut stage = Stage::new(&cfg.model, layout, segment_lengths.clone(), cfg.train.seed)?;
        stage.set_memory_budget(cfg.train.memory_budget());
        let data = if first || last {
            Some(open_source(&cfg.data, cfg.model.vocab_size)?)
        } else {
            None
        };
        let schedule = generate(
            cfg.pipeline.schedule,
            cfg.pipeline.stages,
            cfg.pipeline.microbatches,
            cfg.pipeline.splits,
        )?;
        let t = &cfg.train;
        let optimizer = AdamW::new(AdamWConfig {
            beta1: t.beta1,
            beta2: t.beta2,
            eps: t.eps,
        });
        Ok(Self {
            cfg,
            stage,
            optimizer,
            data,
            schedule,
            segment_lengths,
            prev: None,
            next: None,
            dump_grads,
            checkpoints: None,
            token: String::new(),
            leaving: Arc::new(AtomicBool::new(false)),
            peer_copier: None,
            data_port: None,
            record: StepRecord::default(),
            replay_skip: HashSet::new(),
        })
    }

    /// SIGTERM is a preemption notice: the worker keeps running and reports it with its next step,
    /// so the node leaves at that step's boundary; if that takes longer than `elastic.grace_s`, the
    /// process exits (and the node counts as lost).
    fn watch_for_preemption(&self) -> Result<(), WorkerError> {
        let io = |source| WorkerError::Io {
            what: "installing the SIGTERM handler".into(),
            source,
        };
        signal_hook::flag::register(signal_hook::consts::SIGTERM, Arc::clone(&self.leaving))
            .map_err(io)?;
        let (leaving, grace, stage) = (
            Arc::clone(&self.leaving),
            self.cfg.elastic.grace(),
            self.index(),
        );
        std::thread::Builder::new()
            .name("preemption-grace".into())
            .spawn(move || {
                while !leaving.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                warn!(
                    stage,
                    grace_s = grace.as_secs_f64(),
                    "preemption notice: leaving at the next step boundary"
                );
                std::thread::sleep(grace);
                warn!(stage, "grace period over before a step boundary; exiting");
                std::process::exit(128 + signal_hook::consts::SIGTERM);
            })
            .map_err(io)?;
        Ok(())
    }

    fn index(&self) -> usize {
        self.stage.layout().stage
    }

    /// Connects to the next stage and accepts the previous stage's connection (the data port is
    /// kept for a relink). A replacement of a lost stage then reads what its neighbours already have.
    fn connect(
        &mut self,
        data_port: DataPort,
        generation: u64,
        prev: Option<String>,
        next: Option<String>,
        replacement: bool,
    ) -> Result<(), WorkerError> {
        let timeout = self.cfg.pipeline.timeout();
        self.data_port = Some(data_port);
        if let Some(next) = next {
            self.connect_next(&next, generation, timeout)?;
        }
        if prev.is_some() {
            self.accept_prev(generation, timeout)?;
        }
        if replacement {
            let mut skip = HashSet::new();
            if let Some(next) = &mut self.next {
                let (_, units) = next.recv_have(Payload::Activation)?;
                skip.extend(units.into_iter().map(|u| (Payload::Activation, u)));
            }
            if let Some(prev) = &mut self.prev {
                let (_, units) = prev.recv_have(Payload::Grad)?;
                skip.extend(units.into_iter().map(|u| (Payload::Grad, u)));
            }
            info!(
                outputs_the_neighbours_have = skip.len(),
                "replacing a lost stage mid-step"
            );
            self.replay_skip = skip;
        }
        Ok(())
    }

    fn connect_next(
        &mut self,
        next: &str,
        generation: u64,
        timeout: Duration,
    ) -> Result<(), WorkerError> {
        let r = self.index();
        let io = io_error;
        let addr = resolve(next)?;
        let mut stream = connect_retrying(&addr, timeout)
            .map_err(io(format!("connecting to stage {} at {next}", r + 1)))?;
        auth::connect(&mut stream, &self.token, Purpose::Data)
            .map_err(io(format!("authenticating to stage {} at {next}", r + 1)))?;
        self.next = Some(
            TcpLink::new(stream, r + 1, generation, timeout, self.max_tensor_bytes())
                .map_err(io("next-stage link".into()))?,
        );
        Ok(())
    }

    /// Takes the previous stage's connection from the data port (authenticated off this thread,
    /// see [`DataPort`]).
    fn accept_prev(&mut self, generation: u64, timeout: Duration) -> Result<(), WorkerError> {
        let r = self.index();
        let port = self
            .data_port
            .as_ref()
            .ok_or_else(|| WorkerError::Protocol("the data port is gone; cannot relink".into()))?;
        let stream = port
            .next(timeout)
            .map_err(io_error(format!("waiting for stage {} to connect", r - 1)))?;
        self.prev = Some(
            TcpLink::new(stream, r - 1, generation, timeout, self.max_tensor_bytes())
                .map_err(io_error("previous-stage link".into()))?,
        );
        Ok(())
    }

    /// The largest boundary tensor of the run (a micro-batch's hidden states over the whole
    /// sequence): the data links refuse larger frames.
    fn max_tensor_bytes(&self) -> u64 {
        let t = &self.cfg.train;
        [t.micro_batch_size, t.seq_len, self.cfg.model.d_model, 4]
            .iter()
            .try_fold(1u64, |acc, &n| acc.checked_mul(n as u64))
            .unwrap_or(u64::MAX)
    }

    fn serve(&mut self, control: &mut ControlStream) -> Result<(), WorkerError> {
        let r = self.index();
        let control_err = |source| WorkerError::Control {
            addr: "launcher".into(),
            source,
        };
        loop {
            match control.recv::<ToWorker>().map_err(control_err)? {
                ToWorker::RunStep { step, trace } => {
                    if let Some(copier) = &self.peer_copier {
                        copier.wait_for(step.saturating_sub(2), self.cfg.pipeline.timeout());
                    }
                    let started = Instant::now();
                    let loss_sum = self.run_step(step, trace, control)?;
                    let sums_of_squares = self.stage.grad_sums_of_squares()?;
                    if let Some(dir) = &self.dump_grads {
                        self.dump_gradients(dir, step)?;
                    }
                    debug!(
                        step,
                        elapsed_s = started.elapsed().as_secs_f64(),
                        "step computed"
                    );
                    control
                        .send(&ToLauncher::StepDone {
                            stage: r,
                            step,
                            sums_of_squares,
                            loss_sum,
                            leaving: self.leaving.load(Ordering::SeqCst),
                            cost: self.record.cost.clone(),
                        })
                        .map_err(control_err)?;
                }
                // A neighbour was replaced after this stage had finished its part of the step.
                ToWorker::Relink {
                    generation,
                    side,
                    addr,
                } => self.relink(generation, side, addr)?,
                ToWorker::Abort => {}
                ToWorker::Apply {
                    step,
                    lr,
                    clip_coefficient,
                } => {
                    let t = &self.cfg.train;
                    self.stage.apply_update(
                        &mut self.optimizer,
                        lr,
                        clip_coefficient,
                        t.weight_decay,
                        t.decay_embeddings,
                    )?;
                    control
                        .send(&ToLauncher::Updated { stage: r, step })
                        .map_err(control_err)?;
                    if let Some(copier) = &self.peer_copier {
                        copier.copy(step, snapshot(&self.stage, &self.optimizer));
                    }
                }
                ToWorker::Eval { batches } => {
                    let loss_sum = self.run_eval(batches)?;
                    control
                        .send(&ToLauncher::EvalDone { stage: r, loss_sum })
                        .map_err(control_err)?;
                }
                ToWorker::Checkpoint { step } => {
                    let started = Instant::now();
                    let tensors = snapshot(&self.stage, &self.optimizer);
                    let snapshot_s = started.elapsed().as_secs_f64();
                    let checkpoints = self
                        .checkpoints
                        .as_ref()
                        .ok_or_else(|| WorkerError::Protocol("no checkpoint store".into()))?;
                    checkpoints
                        .uploads
                        .send(UploadJob {
                            step,
                            tensors,
                            snapshot_s,
                        })
                        .map_err(|_| {
                            WorkerError::Protocol("the checkpoint uploader stopped".into())
                        })?;
                }
                ToWorker::Restore { step } => {
                    let reply = match self.restore_checkpoint(step) {
                        Ok(()) => ToLauncher::Restored { stage: r, step },
                        Err(e) => ToLauncher::RestoreFailed {
                            stage: r,
                            step,
                            // A damaged shard or an unreadable or inconsistent manifest: an
                            // older checkpoint may still be good.
                            corrupt: matches!(
                                &e,
                                WorkerError::Checkpoint(c) if c.is_damaged_checkpoint()
                            ),
                            error: e.to_string(),
                        },
                    };
                    control.send(&reply).map_err(control_err)?;
                }
                ToWorker::RestorePeers { step, sources } => {
                    let reply = match self.restore_from_peers(step, &sources) {
                        Ok(()) => ToLauncher::Restored { stage: r, step },
                        Err(e) => ToLauncher::RestoreFailed {
                            stage: r,
                            step,
                            corrupt: false,
                            error: e.to_string(),
                        },
                    };
                    control.send(&reply).map_err(control_err)?;
                }
                ToWorker::InitFrom { dir } => {
                    let reply = match self.init_from(&dir) {
                        Ok(()) => ToLauncher::Restored { stage: r, step: 0 },
                        Err(e) => ToLauncher::RestoreFailed {
                            stage: r,
                            step: 0,
                            corrupt: false,
                            error: e.to_string(),
                        },
                    };
                    control.send(&reply).map_err(control_err)?;
                }
                ToWorker::Shutdown => return Ok(()),
                other @ ToWorker::Topology { .. } => {
                    return Err(WorkerError::Protocol(format!(
                        "unexpected {other:?} while running"
                    )));
                }
            }
        }
    }

    /// Loads this stage's tensors (by name, whatever the partition that wrote them) from the
    /// committed checkpoint of `step`.
    fn restore_checkpoint(&mut self, step: u64) -> Result<(), WorkerError> {
        let ckpt = self
            .checkpoints
            .as_ref()
            .ok_or_else(|| WorkerError::Protocol("no checkpoint store".into()))?;
        let manifest = ckpt.runtime.block_on(ckpt.store.read_manifest(step))?;
        // A manifest whose trainer state does not parse is as damaged as one that does not.
        let state: TrainerState = serde_json::from_value(manifest.state.clone()).map_err(|e| {
            CheckpointError::InvalidManifest {
                url: ckpt.store.url().to_string(),
                step,
                detail: format!(
                    "its trainer state is unreadable ({e}); resume from another committed step"
                ),
            }
        })?;
        let names = names_to_restore(&self.stage, state.optimizer_step > 0);
        let tensors = ckpt
            .runtime
            .block_on(ckpt.store.read_tensors(&manifest, &names))?;
        let tensors = tensors
            .iter()
            .map(|(n, d)| Ok((n.clone(), from_tensor_data(d)?)))
            .collect::<Result<Vec<_>, candle_core::Error>>()?;
        restore(
            &mut self.stage,
            &mut self.optimizer,
            tensors,
            state.optimizer_step,
        )?;
        self.stage.reset_step();
        info!(step, tensors = names.len(), "restored from checkpoint");
        Ok(())
    }

    /// Loads this stage's tensors of the state after `step` from the agents' peer snapshots.
    fn restore_from_peers(&mut self, step: u64, sources: &[String]) -> Result<(), WorkerError> {
        let names = names_to_restore(&self.stage, step > 0);
        let timeout = self.cfg.pipeline.timeout();
        let tensors = peer_snapshots::fetch(sources, step, &names, &self.token, timeout)
            .map_err(WorkerError::Protocol)?;
        let tensors = tensors
            .iter()
            .map(|(n, d)| Ok((n.clone(), from_tensor_data(d)?)))
            .collect::<Result<Vec<_>, candle_core::Error>>()?;
        restore(&mut self.stage, &mut self.optimizer, tensors, step)?;
        self.stage.reset_step();
        info!(step, tensors = names.len(), "restored from peer snapshots");
        Ok(())
    }

    /// Loads initial parameters from a Hugging Face GPT-2 directory (fresh optimizer).
    fn init_from(&mut self, dir: &Path) -> Result<(), WorkerError> {
        let names = names_to_restore(&self.stage, false);
        let tensors = hf::import(&self.cfg.model, dir, &names)?;
        restore(&mut self.stage, &mut self.optimizer, tensors, 0)?;
        info!(dir = %dir.display(), "initialized from a Hugging Face directory");
        Ok(())
    }

    /// Executes this stage's actions of one training step; with `trace`, records when each unit ran.
    fn run_step(
        &mut self,
        step: u64,
        trace: bool,
        control: &mut ControlStream,
    ) -> Result<Option<f64>, WorkerError> {
        self.record = StepRecord {
            step,
            skip: std::mem::take(&mut self.replay_skip),
            trace_epoch: trace.then(|| (Instant::now(), unix_time_us())),
            ..StepRecord::default()
        };
        self.stage.take_peak_activation_bytes();
        let schedule = self.schedule.clone();
        let loss_sum = self.execute(&schedule, Split::Train, step, Mode::Train, Some(control))?;
        self.record.cost.peak_activation_bytes = self.stage.take_peak_activation_bytes() as u64;
        self.record.cost.state_bytes = self.stage.state_bytes() as u64;
        Ok(loss_sum)
    }

    /// Forward-only pass over `batches` held-out micro-batches (the same ones at every evaluation).
    fn run_eval(&mut self, batches: usize) -> Result<Option<f64>, WorkerError> {
        let schedule =
            generate_forward_only(self.cfg.pipeline.stages, batches, self.cfg.pipeline.splits)?;
        self.execute(&schedule, Split::Val, 0, Mode::Eval, None)
    }

    fn execute(
        &mut self,
        schedule: &Schedule,
        split: Split,
        step: u64,
        mode: Mode,
        mut control: Option<&mut ControlStream>,
    ) -> Result<Option<f64>, WorkerError> {
        let r = self.index();
        let last = self.stage.layout().is_last();
        let mut state = ExecState {
            tokens: MicroBatchTokens {
                tokens: HashMap::new(),
            },
            inbox: HashMap::new(),
            outbox: HashMap::new(),
            loss_sum: last.then_some(0.0),
            loss_scale: 1.0
                / (schedule.microbatches * self.cfg.train.micro_batch_size * self.cfg.train.seq_len)
                    as f64,
        };
        let actions = &schedule.actions[r];
        let mut pc = 0;
        while pc < actions.len() {
            let action = actions[pc];
            match self.run_action(action, &mut state, split, step, mode) {
                Ok(()) => pc += 1,
                // A neighbour died mid-step: keep everything, have the link rebuilt to its
                // replacement, and go on where this stage stood.
                Err(WorkerError::Transport(TransportError::Io { peer, source }))
                    if mode == Mode::Train && self.cfg.elastic.mid_step && control.is_some() =>
                {
                    let side = match action {
                        Action::RecvActivation(_) | Action::SendGrad(_) => Side::Prev,
                        _ => Side::Next,
                    };
                    let control = control.as_deref_mut().expect("checked above");
                    self.await_relink(control, step, side, &format!("{peer}: {source}"))?;
                    // A send that failed is in the record and went out again with the catch-up.
                    if matches!(action, Action::SendActivation(_) | Action::SendGrad(_)) {
                        pc += 1;
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(state.loss_sum)
    }

    fn run_action(
        &mut self,
        action: Action,
        state: &mut ExecState,
        split: Split,
        step: u64,
        mode: Mode,
    ) -> Result<(), WorkerError> {
        let (first, last) = (
            self.stage.layout().is_first(),
            self.stage.layout().is_last(),
        );
        let train = mode == Mode::Train;
        match action {
            Action::RecvActivation(u) => {
                let t = link(&mut self.prev, "previous")?.recv(step, Payload::Activation, u)?;
                state.inbox.insert(u, t);
                if train {
                    self.record.received.push((Payload::Activation, u));
                }
            }
            Action::Forward(u) => {
                let started = UnitStart::now();
                let input = if first {
                    StageInput::Tokens(self.segment_tokens(&mut state.tokens, split, step, u, 0)?)
                } else {
                    StageInput::Hidden(take(&mut state.inbox, u)?)
                };
                let targets = if last {
                    Some(
                        self.segment_tokens(&mut state.tokens, split, step, u, 1)?
                            .flatten_all()?,
                    )
                } else {
                    None
                };
                if u.segment + 1 == self.segment_lengths.len() {
                    state.tokens.tokens.remove(&u.micro_batch);
                }
                match self
                    .stage
                    .forward(u, input, targets.as_ref(), state.loss_scale, mode)?
                {
                    StageOutput::Hidden(h) => {
                        state.outbox.insert(u, h);
                    }
                    StageOutput::LossSum(l) => *state.loss_sum.as_mut().expect("last stage") += l,
                }
                if train {
                    // Proven redone: a neighbour has this unit's output (or its backward's).
                    let redone = self.record.skip.contains(&(Payload::Activation, u))
                        || self.record.skip.contains(&(Payload::Grad, u));
                    self.record.computed(action, started, redone);
                }
            }
            Action::SendActivation(u) => {
                let t = take(&mut state.outbox, u)?;
                self.send_boundary(train, step, Payload::Activation, u, t)?;
            }
            Action::RecvGrad(u) => {
                let t = link(&mut self.next, "next")?.recv(step, Payload::Grad, u)?;
                state.inbox.insert(u, t);
                if train {
                    self.record.received.push((Payload::Grad, u));
                }
            }
            Action::Backward(u) => {
                let started = UnitStart::now();
                let d_out = if last {
                    None
                } else {
                    Some(take(&mut state.inbox, u)?)
                };
                if let Some(dx) = self.stage.backward(u, d_out)? {
                    state.outbox.insert(u, dx);
                }
                let redone = self.record.skip.contains(&(Payload::Grad, u));
                self.record.computed(action, started, redone);
            }
            Action::SendGrad(u) => {
                let t = take(&mut state.outbox, u)?;
                self.send_boundary(train, step, Payload::Grad, u, t)?;
            }
        }
        Ok(())
    }

    /// Sends a boundary tensor to its neighbour; in training it is kept until the step's update
    /// (first, so that a send that fails is still in the record), and a replacement does not send
    /// what the neighbour already has.
    fn send_boundary(
        &mut self,
        train: bool,
        step: u64,
        payload: Payload,
        u: Unit,
        t: Tensor,
    ) -> Result<(), WorkerError> {
        if train {
            self.record.retain(payload, u, &t);
            if self.record.skip.contains(&(payload, u)) {
                return Ok(());
            }
        }
        let (side, which) = match payload {
            Payload::Activation => (&mut self.next, "next"),
            Payload::Grad => (&mut self.prev, "previous"),
        };
        link(side, which)?.send(step, payload, u, &t)?;
        Ok(())
    }

    /// A link broke mid-step: report it with this stage's progress, and wait for the coordinator
    /// to rebuild it (or to give up on mid-step recovery).
    fn await_relink(
        &mut self,
        control: &mut ControlStream,
        step: u64,
        side: Side,
        error: &str,
    ) -> Result<(), WorkerError> {
        let r = self.index();
        let peer = match side {
            Side::Prev => r - 1,
            Side::Next => r + 1,
        };
        warn!(step, peer, %error, "link to a neighbour broke mid-step; waiting for its replacement");
        let control_err = |source| WorkerError::Control {
            addr: "coordinator".into(),
            source,
        };
        control
            .send(&ToLauncher::LinkDown {
                stage: r,
                step,
                peer,
                error: error.to_string(),
                done_units: self.record.done_units,
            })
            .map_err(control_err)?;
        match control.recv::<ToWorker>().map_err(control_err)? {
            ToWorker::Relink {
                generation,
                side: s,
                addr,
            } if s == side => self.relink(generation, side, addr),
            ToWorker::Abort => Err(WorkerError::Transport(TransportError::Io {
                peer: format!("stage {peer}"),
                source: std::io::Error::other(format!(
                    "{error}; mid-step recovery abandoned by the coordinator"
                )),
            })),
            other => Err(WorkerError::Protocol(format!(
                "expected the relink of the {side:?} link, got {other:?}"
            ))),
        }
    }

    /// Rebuilds the link on `side` to a replacement stage: tells it which of its outputs this side
    /// already received, then sends again every tensor this side sent on the link in the step.
    fn relink(
        &mut self,
        generation: u64,
        side: Side,
        addr: Option<String>,
    ) -> Result<(), WorkerError> {
        let timeout = self.cfg.pipeline.timeout();
        let step = self.record.step;
        match side {
            Side::Prev => self.accept_prev(generation, timeout)?,
            Side::Next => {
                let addr = addr.ok_or_else(|| {
                    WorkerError::Protocol("a relink of the next link needs an address".into())
                })?;
                self.connect_next(&addr, generation, timeout)?;
            }
        }
        let (received, resend) = match side {
            Side::Prev => (Payload::Activation, Payload::Grad),
            Side::Next => (Payload::Grad, Payload::Activation),
        };
        let have: Vec<Unit> = self
            .record
            .received
            .iter()
            .filter(|(p, _)| *p == received)
            .map(|(_, u)| *u)
            .collect();
        let link = match side {
            Side::Prev => link(&mut self.prev, "previous")?,
            Side::Next => link(&mut self.next, "next")?,
        };
        link.send_have(step, received, &have)?;
        let mut resent = 0;
        for (payload, u, t) in self.record.sent.iter().filter(|(p, ..)| *p == resend) {
            link.send(step, *payload, *u, t)?;
            resent += 1;
        }
        info!(
            step,
            ?side,
            have = have.len(),
            resent,
            "relinked to a replacement stage"
        );
        Ok(())
    }

    /// Token ids `(B, s)` of unit `u`'s segment, shifted by `shift` (0 = inputs, 1 = targets).
    fn segment_tokens(
        &self,
        cache: &mut MicroBatchTokens,
        split: Split,
        step: u64,
        u: Unit,
        shift: usize,
    ) -> Result<Tensor, WorkerError> {
        let (batch, seq_len) = (self.cfg.train.micro_batch_size, self.cfg.train.seq_len);
        let rows = match cache.tokens.entry(u.micro_batch) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let src = self
                    .data
                    .as_deref()
                    .expect("first and last stages hold a data source");
                e.insert(micro_batch_tokens(
                    src,
                    split,
                    self.cfg.train.seed,
                    step,
                    u.micro_batch as u64,
                    batch,
                    seq_len,
                )?)
            }
        };
        let start: usize = self.segment_lengths[..u.segment].iter().sum();
        let len = self.segment_lengths[u.segment];
        let ids: Vec<u32> = (0..batch)
            .flat_map(|b| {
                rows[b * (seq_len + 1) + start + shift..][..len]
                    .iter()
                    .copied()
            })
            .collect();
        Ok(Tensor::from_vec(ids, (batch, len), &Device::Cpu)?)
    }

    fn dump_gradients(&self, dir: &Path, step: u64) -> Result<(), WorkerError> {
        let io = |source| WorkerError::Io {
            what: format!("writing gradients to {}", dir.display()),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let grads: HashMap<String, Tensor> = self
            .stage
            .params()
            .specs()
            .iter()
            .filter_map(|s| {
                self.stage
                    .grads()
                    .get(&s.name)
                    .map(|g| (s.name.clone(), g.clone()))
            })
            .collect();
        candle_core::safetensors::save(
            &grads,
            dir.join(format!("step-{step}-stage-{}.safetensors", self.index())),
        )?;
        Ok(())
    }
}

fn link<'a>(link: &'a mut Option<TcpLink>, which: &str) -> Result<&'a mut TcpLink, WorkerError> {
    link.as_mut().ok_or_else(|| {
        WorkerError::Protocol(format!(
            "the schedule talks to the {which} stage, which this stage does not have"
        ))
    })
}

fn take(map: &mut HashMap<Unit, Tensor>, u: Unit) -> Result<Tensor, WorkerError> {
    map.remove(&u).ok_or_else(|| {
        WorkerError::Protocol(format!("no tensor for unit {u:?} (schedule out of order)"))
    })
}
