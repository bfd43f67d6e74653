//! A stage worker: one OS process per pipeline stage. This module starts it (connects to the
//! launcher, wires it to its neighbours) and runs its serve loop: receive a control message,
//! dispatch it to the module that does the work.
//!
//! * [`chunks`]: the layer chunks the worker holds (one, or v with virtual stages);
//! * [`execute`]: running one step's (or evaluation's) actions over the transport;
//! * [`record`]: what the worker did in the current step (progress, kept tensors, costs);
//! * [`links`]: the data links to the neighbouring stages;
//! * [`relink`]: mid-step recovery: what the worker does when a link breaks and is rebuilt;
//! * [`reduce`]: data parallelism: the gradient reduction with the other replicas of the stage,
//!   and reducing again after a replica was lost;
//! * [`state_io`]: the stage's state in and out: checkpoint uploads, peer-snapshot copies,
//!   restores, gradient dumps.

mod boundary;
mod chunks;
mod execute;
mod links;
mod record;
mod reduce;
mod relink;
mod state_io;

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use checkpoint::CheckpointError;
use ops::adamw::AdamWConfig;
use thiserror::Error;
use tracing::{debug, info, warn};

use super::auth::{self, Purpose};
use super::collective::{CollectiveError, ReplicaGroup};
use super::control::{ControlStream, FailureCause, StepCost, ToLauncher, ToWorker};
use super::kill_switch::{Ending, KillSwitch, Point};
use super::peer_snapshots::PeerCopier;
use super::transport::{DataPort, TcpLink, TransportError, connect_retrying};
use crate::checkpointing::hf;
use crate::config::{Config, ConfigError};
use crate::data::{DataError, TokenSource, document_separator, open_source};
use crate::model::partition::partition_virtual_layers;
use crate::model::{ModelError, StageLayout, StageSpec, UpdateSettings, build_stage};
use crate::schedule::{Delivered, ScheduleError, SegmentRule};
use crate::usage::ProcessUsage;
use chunks::Chunks;
use execute::ValidSchedule;
use record::StepRecord;
use state_io::{Checkpoints, TakenSnapshot};

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
    /// The action lists this worker was about to run failed [`crate::schedule::validate`].
    #[error("refusing to run an invalid schedule: {0}")]
    InvalidSchedule(ScheduleError),
    /// Data could not be read.
    #[error(transparent)]
    Data(#[from] DataError),
    /// `SEQPIPE_JOB_TOKEN` is unset or empty.
    #[error(transparent)]
    Token(#[from] auth::JobTokenError),
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
    /// The gradient reduction with the other replicas of the stage failed.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// A Hugging Face directory could not be used.
    #[error(transparent)]
    Hf(#[from] hf::HfError),
}

impl WorkerError {
    /// Whether this failure would recur on any node: then recovering only repeats it.
    pub fn cause(&self) -> FailureCause {
        match self {
            WorkerError::Model(ModelError::OverBudget { .. }) => FailureCause::OverBudget,
            WorkerError::Config(_)
            | WorkerError::Schedule(_)
            | WorkerError::InvalidSchedule(_)
            | WorkerError::Token(_)
            | WorkerError::Hf(_) => FailureCause::Permanent,
            WorkerError::Data(e) if !matches!(e, DataError::Io { .. }) => FailureCause::Permanent,
            _ => FailureCause::Transient,
        }
    }
}

/// How a worker is started (`seqpipe worker ...`).
#[derive(Clone, Debug)]
pub struct WorkerArgs {
    /// The launcher's control address.
    pub control: String,
    /// This worker's slot: `replica · pipeline.stages + stage` (the stage itself with one
    /// replica).
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
    /// In-process test harnesses only (`None` for the `seqpipe worker` process): ends this
    /// worker as SIGKILL would and stops it at chosen points (see [`KillSwitch`]).
    pub kill_switch: Option<KillSwitch>,
}

/// A running worker.
struct Worker {
    cfg: Config,
    /// The layer chunks it holds: the whole stage, or v chunks with virtual stages.
    stage: Chunks,
    /// On the workers holding the first or the last virtual stage: the data they read tokens of.
    data: Option<Box<dyn TokenSource>>,
    /// With document masks, on the first stage: the token that ends each document of its data.
    end_of_text: Option<u32>,
    schedule: ValidSchedule,
    /// How each micro-batch is cut into segments (one table, or from its documents).
    segments: SegmentRule,
    /// This worker's slot (`replica · stages + stage`): its name in control messages.
    slot: usize,
    /// Its data-parallel replica.
    replica: usize,
    /// The global index of its replica's first micro-batch of a step.
    first_micro_batch: usize,
    /// The index of the first held-out micro-batch of the evaluation chunk running.
    eval_first: usize,
    /// The links to the other replicas of its stage (with `pipeline.replicas` > 1).
    group: Option<ReplicaGroup>,
    /// The shares of the step awaiting its update, kept in case they must be reduced again.
    kept: Option<reduce::KeptShares>,
    /// Where the other replicas of its stage connect (with `pipeline.replicas` > 1).
    reduce_port: Option<DataPort>,
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
    /// The newest state snapshot taken; dropped whenever the state changes.
    snapshot: Option<TakenSnapshot>,
    /// The data port, kept to accept a relink from a replacement of the previous stage.
    data_port: Option<DataPort>,
    /// What this worker did in the current step (mid-step recovery).
    record: StepRecord,
    /// A replacement's neighbours' outputs of the lost stage, for its first step.
    replay_skip: Delivered,
    /// See [`WorkerArgs::kill_switch`].
    kill_switch: Option<KillSwitch>,
    /// The process's resource usage at the previous step report.
    usage: ProcessUsage,
}

/// Runs a worker until the launcher says shut down. Errors are also reported to the launcher.
/// The worker runs inside its compute pool (`RAYON_NUM_THREADS` threads, see [`ops::pool`]), so
/// that its kernels' parallel loops start from there.
pub fn run_worker(args: WorkerArgs) -> Result<(), WorkerError> {
    let name = format!("stage-{}", args.stage);
    ops::pool::run_in_pool(&name, 0, || serve_in_pool(args)).map_err(|source| WorkerError::Io {
        what: "starting the worker's compute threads".into(),
        source,
    })?
}

/// [`run_worker`], on a thread of the compute pool.
fn serve_in_pool(args: WorkerArgs) -> Result<(), WorkerError> {
    let control_err = |source| WorkerError::Control {
        addr: args.control.clone(),
        source,
    };
    let cfg = load_config(&args.config)?;
    let timeout = cfg.pipeline.timeout();
    let token = auth::required_token("a worker")?;
    let addr = resolve(&args.control)?;
    let mut stream = connect_retrying(&addr, timeout).map_err(control_err)?;
    register(args.kill_switch.as_ref(), &stream).map_err(control_err)?;
    auth::connect(&mut stream, &token, Purpose::Control).map_err(control_err)?;
    let mut control = ControlStream::new(stream).map_err(control_err)?;
    let result = start(&args, cfg, token, &mut control).and_then(|mut worker| {
        worker.serve(&mut control).map_err(|e| match e {
            WorkerError::Control { source, .. } => control_err(source),
            e => e,
        })
    });
    if let Err(e) = &result {
        let _ = control.send(&failure_report(args.stage, e));
    }
    result
}

/// Reads and validates the resolved config file.
fn load_config(path: &std::path::Path) -> Result<Config, WorkerError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let cfg = Config::from_toml(&text, &path.display().to_string())?;
    cfg.validate()?;
    Ok(cfg)
}

/// What the launcher is told when the worker stops with `e`.
fn failure_report(stage: usize, e: &WorkerError) -> ToLauncher {
    let suspect = match e {
        WorkerError::Transport(TransportError::Timeout { peer_stage, .. }) => Some(*peer_stage),
        _ => None,
    };
    ToLauncher::Failed {
        stage,
        error: e.to_string(),
        suspect,
        cause: e.cause(),
    }
}

/// Says hello to the launcher, builds the stage, starts its helpers (peer copies, preemption
/// watch, checkpoint uploads), wires it to its neighbours and says it is ready.
fn start(
    args: &WorkerArgs,
    cfg: Config,
    token: String,
    control: &mut ControlStream,
) -> Result<Worker, WorkerError> {
    let control_err = |source| WorkerError::Control {
        addr: args.control.clone(),
        source,
    };
    let timeout = cfg.pipeline.timeout();
    let (data_port, data_addr) =
        open_data_port(&args.bind, &token, Purpose::Data, args.kill_switch.as_ref())?;
    let reduce = (cfg.pipeline.replicas > 1)
        .then(|| {
            open_data_port(
                &args.bind,
                &token,
                Purpose::Reduce,
                args.kill_switch.as_ref(),
            )
        })
        .transpose()?;
    control
        .send(&ToLauncher::Hello {
            stage: args.stage,
            generation: args.generation,
            data_addr,
            reduce_addr: reduce.as_ref().map(|(_, addr)| addr.clone()),
            pid: std::process::id(),
        })
        .map_err(control_err)?;
    let mut worker = Worker::new(cfg, args.stage, args.dump_grads.clone())?;
    worker.reduce_port = reduce.map(|(port, _)| port);
    worker.token = token.clone();
    worker.kill_switch = args.kill_switch.clone();
    if !args.snapshot_to.is_empty() {
        let (to, switch) = (args.snapshot_to.clone(), args.kill_switch.clone());
        worker.peer_copier = Some(
            PeerCopier::start(to, token, timeout, switch)
                .map_err(io_error("starting the peer-snapshot sender".into()))?,
        );
    }
    worker.watch_for_preemption()?;
    worker.checkpoints = Some(Checkpoints::start(
        &worker.cfg,
        worker.index(),
        control.sender(),
    )?);
    let topology = control.recv::<ToWorker>().map_err(control_err)?;
    worker.at(Point::Message(&topology))?;
    match topology {
        ToWorker::Topology {
            generation,
            prev,
            next,
            replacement,
            replicas,
        } => {
            worker.connect(data_port, generation, prev, next, replacement)?;
            worker.connect_replicas(generation, &replicas)?;
        }
        other => {
            return Err(WorkerError::Protocol(format!(
                "expected the topology first, got {other:?}"
            )));
        }
    }
    control
        .send(&ToLauncher::Ready { stage: args.stage })
        .map_err(control_err)?;
    Ok(worker)
}

/// Binds a port of the worker on `bind` (any port) for `purpose` (the stage data port, or the
/// gradient-reduction port): the port and its address. With a kill switch, the port closes when
/// the worker is killed.
fn open_data_port(
    bind: &str,
    token: &str,
    purpose: Purpose,
    switch: Option<&KillSwitch>,
) -> Result<(DataPort, String), WorkerError> {
    let listener = TcpListener::bind((bind, 0))
        .map_err(io_error(format!("binding the stage data port on {bind}")))?;
    if let Some(switch) = switch {
        switch
            .register_listener(&listener)
            .map_err(io_error("stage data port".into()))?;
    }
    let data_addr = listener
        .local_addr()
        .map_err(io_error("stage data port".into()))?
        .to_string();
    let name = match purpose {
        Purpose::Reduce => "reduce",
        _ => "data",
    };
    let data_port = DataPort::open_for(listener, token.to_string(), purpose, name)
        .map_err(io_error("stage data port".into()))?;
    Ok((data_port, data_addr))
}

/// Registers `stream` with the kill switch, if any.
fn register(switch: Option<&KillSwitch>, stream: &std::net::TcpStream) -> std::io::Result<()> {
    switch.map_or(Ok(()), |s| s.register(stream))
}

/// Maps an I/O error to [`WorkerError::Io`] saying what was being done.
fn io_error(what: String) -> impl Fn(std::io::Error) -> WorkerError {
    move |source| WorkerError::Io {
        what: what.clone(),
        source,
    }
}

/// Maps an I/O error on the control connection to [`WorkerError::Control`].
fn control_error(addr: &'static str) -> impl Fn(std::io::Error) -> WorkerError {
    move |source| WorkerError::Control {
        addr: addr.into(),
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

/// The stages of worker `stage_index`'s virtual-stage chunks (one layout each; one chunk without
/// virtual stages), built from `cfg` with the segment rule `segments`.
fn build_chunks(
    cfg: &Config,
    layouts: Vec<StageLayout>,
    stage_index: usize,
    segments: &SegmentRule,
) -> Result<Chunks, WorkerError> {
    let (t, v) = (&cfg.train, cfg.pipeline.virtual_stages);
    let mut chunks = Vec::with_capacity(layouts.len());
    for layout in layouts {
        info!(
            stage = stage_index,
            virtual_stage = layout.stage,
            layers = ?layout.layers,
            %segments,
            "building stage"
        );
        let mut stage = build_stage(
            &cfg.model,
            StageSpec {
                layout,
                segment_lengths: segments.table().to_vec(),
                longest_segment: segments.per_micro_batch().then(|| segments.longest()),
                seed: t.seed,
                adamw: AdamWConfig {
                    beta1: t.beta1,
                    beta2: t.beta2,
                    eps: t.eps,
                },
                // With virtual stages the budget is the worker's, checked over its chunks.
                memory_budget: t.memory_budget().filter(|_| v == 1),
            },
        )?;
        if cfg.data.reset_positions {
            stage.set_reset_positions(true)?;
        }
        chunks.push(stage);
    }
    Ok(Chunks::new(chunks)?)
}

/// The answer to a restore request: `Restored`, or `RestoreFailed` saying whether the checkpoint
/// itself is damaged (a damaged shard or an unreadable or inconsistent manifest: an older
/// checkpoint may still be good).
fn restore_reply(stage: usize, step: u64, result: Result<(), WorkerError>) -> ToLauncher {
    match result {
        Ok(()) => ToLauncher::Restored { stage, step },
        Err(e) => ToLauncher::RestoreFailed {
            stage,
            step,
            corrupt: matches!(&e, WorkerError::Checkpoint(c) if c.is_damaged_checkpoint()),
            error: e.to_string(),
        },
    }
}

impl Worker {
    fn new(cfg: Config, slot: usize, dump_grads: Option<PathBuf>) -> Result<Self, WorkerError> {
        let (p, d, v) = (
            cfg.pipeline.stages,
            cfg.pipeline.replicas,
            cfg.pipeline.virtual_stages,
        );
        let layouts = partition_virtual_layers(&cfg.model, cfg.train.seq_len, p, v)
            .map_err(ModelError::from)?;
        let (replica, stage_index) = (slot / p, slot % p);
        let layouts = layouts
            .into_iter()
            .nth(stage_index)
            .filter(|_| replica < d)
            .ok_or_else(|| {
                WorkerError::Protocol(format!(
                    "worker slot {slot} does not exist in {d} replica(s) of a {p}-stage pipeline"
                ))
            })?;
        // Replica r computes the step's micro-batches [r·c, (r+1)·c).
        let local_micro_batches = cfg.pipeline.microbatches / d;
        let segments = cfg.segment_rule()?;
        let mut stage = build_chunks(&cfg, layouts, stage_index, &segments)?;
        stage.set_memory_budget(cfg.train.memory_budget());
        if v > 1 {
            info!(
                stage = stage_index,
                chunks = stage.len(),
                virtual_stages = ?stage.layouts().iter().map(|l| l.stage).collect::<Vec<_>>(),
                "holding virtual-stage chunks"
            );
        }
        let (first, last) = (stage.holds_first(), stage.holds_last());
        let data = if first || last {
            Some(open_source(&cfg.data, cfg.model.vocab_size)?)
        } else {
            None
        };
        // The first stage reads the documents off its tokens; the others receive them.
        let end_of_text = match (&data, first) {
            (Some(src), true) => document_separator(&cfg.data, src.as_ref())?,
            _ => None,
        };
        // The config's byte model goes in: seq1f1b-zb's order depends on it.
        let schedule =
            ValidSchedule::new(crate::memory::training_schedule(&cfg, local_micro_batches)?)?;
        Ok(Self {
            cfg,
            stage,
            data,
            end_of_text,
            schedule,
            segments,
            slot,
            replica,
            first_micro_batch: replica * local_micro_batches,
            eval_first: 0,
            group: None,
            kept: None,
            reduce_port: None,
            prev: None,
            next: None,
            dump_grads,
            checkpoints: None,
            token: String::new(),
            leaving: Arc::new(AtomicBool::new(false)),
            peer_copier: None,
            snapshot: None,
            data_port: None,
            record: StepRecord::default(),
            replay_skip: Delivered::default(),
            kill_switch: None,
            usage: ProcessUsage::now(),
        })
    }

    /// SIGTERM is a preemption notice: the worker keeps running and reports it with its next step,
    /// so the node leaves at that step's boundary; if that takes longer than `elastic.grace_s`, the
    /// process exits (and the node counts as lost).
    /// With a kill switch, the notice is the switch's flag, and a grace period that runs out ends
    /// the worker through the switch instead of the process.
    fn watch_for_preemption(&mut self) -> Result<(), WorkerError> {
        let io = io_error("installing the SIGTERM handler".into());
        match &self.kill_switch {
            Some(switch) => self.leaving = switch.leaving(),
            None => {
                signal_hook::flag::register(
                    signal_hook::consts::SIGTERM,
                    Arc::clone(&self.leaving),
                )
                .map_err(&io)?;
            }
        }
        let (leaving, grace, stage) = (
            Arc::clone(&self.leaving),
            self.cfg.elastic.grace(),
            self.index(),
        );
        let switch = self.kill_switch.clone();
        std::thread::Builder::new()
            .name("preemption-grace".into())
            .spawn(move || {
                while !leaving.load(Ordering::SeqCst) {
                    if switch.as_ref().is_some_and(KillSwitch::is_ended) {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                warn!(
                    stage,
                    grace_s = grace.as_secs_f64(),
                    "preemption notice: leaving at the next step boundary"
                );
                std::thread::sleep(grace);
                warn!(stage, "grace period over before a step boundary; exiting");
                let code = 128 + signal_hook::consts::SIGTERM;
                match switch {
                    Some(switch) => {
                        switch.end(Ending::Exited(code));
                    }
                    None => std::process::exit(code),
                }
            })
            .map_err(&io)?;
        Ok(())
    }

    fn index(&self) -> usize {
        self.stage.layout().stage
    }

    /// Consults the kill switch, if any, at `point` (see [`KillSwitch::at`]).
    fn at(&self, point: Point<'_>) -> Result<(), WorkerError> {
        match &self.kill_switch {
            Some(switch) => switch.at(point).map_err(io_error("kill switch".into())),
            None => Ok(()),
        }
    }

    /// The serve loop: one control message at a time, each handled to the end before the next.
    fn serve(&mut self, control: &mut ControlStream) -> Result<(), WorkerError> {
        let r = self.slot;
        let control_err = control_error("launcher");
        loop {
            let msg = control.recv::<ToWorker>().map_err(&control_err)?;
            self.at(Point::Message(&msg))?;
            let reply = match msg {
                ToWorker::RunStep { step, trace } => Some(self.step(step, trace, control)?),
                // A neighbour was replaced after this stage had finished its part of the step.
                ToWorker::Relink {
                    generation,
                    side,
                    addr,
                } => {
                    self.relink(control, (generation, side, addr))?;
                    None
                }
                ToWorker::Apply {
                    step,
                    lr,
                    clip_coefficient,
                    snapshot,
                } => {
                    self.apply(lr, clip_coefficient)?;
                    self.release_shares();
                    control
                        .send(&ToLauncher::Updated { stage: r, step })
                        .map_err(&control_err)?;
                    if snapshot {
                        self.copy_to_peers(step)?;
                    }
                    None
                }
                ToWorker::Eval { first, batches } => Some(ToLauncher::EvalDone {
                    stage: r,
                    loss_sum: self.run_eval(first, batches)?,
                }),
                ToWorker::Checkpoint { step } => {
                    self.queue_checkpoint(step)?;
                    None
                }
                ToWorker::Restore { step } => {
                    Some(restore_reply(r, step, self.restore_checkpoint(step)))
                }
                ToWorker::RestorePeers { step, sources } => Some(restore_reply(
                    r,
                    step,
                    self.restore_from_peers(step, &sources),
                )),
                ToWorker::InitFrom { dir } => Some(restore_reply(r, 0, self.init_from(&dir))),
                ToWorker::Shutdown => return Ok(()),
                // A replica was lost during the step: reduce its gradients again.
                msg @ ToWorker::Reduce { .. } => Some(self.reduce_again(msg, control)?),
                other @ ToWorker::Topology { .. } => {
                    return Err(WorkerError::Protocol(format!(
                        "unexpected {other:?} while running"
                    )));
                }
            };
            if let Some(reply) = reply {
                control.send(&reply).map_err(&control_err)?;
                if let ToLauncher::StepDone { step, .. } = reply {
                    self.at(Point::StepDone { step })?;
                }
            }
        }
    }

    /// Runs forward and backward of `step` and returns the report of it: its gradients' sums of
    /// squares, loss, costs, and whether this node is leaving.
    fn step(
        &mut self,
        step: u64,
        trace: bool,
        control: &mut ControlStream,
    ) -> Result<ToLauncher, WorkerError> {
        // Never waits for a peer copy: one still in flight makes the launcher skip the next.
        let started = Instant::now();
        let loss_sum = self.run_step(step, trace, control)?;
        let reply = self.reduce_own_share(step, loss_sum)?;
        debug!(
            step,
            elapsed_s = started.elapsed().as_secs_f64(),
            gradient_buffers = self.record.cost.gradient_buffers,
            "step computed"
        );
        Ok(reply)
    }

    /// The report of `step` once its gradients are final (with replicas: reduced in round
    /// `round`): their sums of squares, the loss sums, costs, and whether this node is leaving.
    /// The units' times go with the first report only (a worker that reduces again after a lost
    /// replica reports again).
    fn step_done(
        &mut self,
        step: u64,
        round: u32,
        loss_sum: Option<f64>,
        adopted_losses: Vec<(usize, f64)>,
    ) -> Result<ToLauncher, WorkerError> {
        let sums_of_squares = self.stage.grad_sums_of_squares()?;
        let gradient_buffers = self.stage.take_peak_gradient_buffers();
        let c = &mut self.record.cost;
        c.gradient_buffers = c.gradient_buffers.max(gradient_buffers);
        let now = ProcessUsage::now();
        let used = now.since(&self.usage);
        self.usage = now;
        c.page_faults += used.minor_faults;
        c.cpu_user_s += used.user.as_secs_f64();
        c.cpu_system_s += used.system.as_secs_f64();
        if let Some(dir) = &self.dump_grads {
            self.dump_gradients(dir, step)?;
        }
        Ok(ToLauncher::StepDone {
            stage: self.slot,
            step,
            sums_of_squares,
            loss_sum,
            leaving: self.leaving.load(Ordering::SeqCst),
            adopted_losses,
            cost: StepCost {
                unit_times: std::mem::take(&mut self.record.cost.unit_times),
                peer_copy_in_flight: self.peer_copier.as_ref().is_some_and(|c| c.busy()),
                ..self.record.cost.clone()
            },
            round,
        })
    }

    /// Clips with `clip_coefficient` and applies AdamW with learning rate `lr`.
    fn apply(&mut self, lr: f64, clip_coefficient: f64) -> Result<(), WorkerError> {
        let t = &self.cfg.train;
        self.snapshot = None;
        self.stage.apply_update(UpdateSettings {
            lr,
            clip_coefficient,
            weight_decay: t.weight_decay,
            decay_embeddings: t.decay_embeddings,
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::ScheduleKind;

    #[test]
    fn an_invalid_schedule_is_a_permanent_failure() {
        let mut s = crate::schedule::generate(ScheduleKind::Seq1F1B, 2, 2, 2).unwrap();
        s.actions[1].pop();
        let e = ValidSchedule::new(s).unwrap_err();
        assert!(matches!(e, WorkerError::InvalidSchedule(_)), "{e:?}");
        assert_eq!(e.cause(), FailureCause::Permanent);
        assert!(
            e.to_string()
                .starts_with("refusing to run an invalid schedule: stage 1")
        );
        match failure_report(1, &e) {
            ToLauncher::Failed { cause, suspect, .. } => {
                assert_eq!(cause, FailureCause::Permanent);
                assert_eq!(suspect, None);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_damaged_checkpoint_is_reported_corrupt_and_other_failures_are_not() {
        let damaged = WorkerError::Checkpoint(CheckpointError::InvalidManifest {
            url: "file:///x".into(),
            step: 4,
            detail: "unreadable".into(),
        });
        match restore_reply(2, 4, Err(damaged)) {
            ToLauncher::RestoreFailed { corrupt, step, .. } => assert!(corrupt && step == 4),
            other => panic!("{other:?}"),
        }
        let other = WorkerError::Protocol("no checkpoint store".into());
        match restore_reply(2, 4, Err(other)) {
            ToLauncher::RestoreFailed { corrupt, .. } => assert!(!corrupt),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            restore_reply(2, 0, Ok(())),
            ToLauncher::Restored { stage: 2, step: 0 }
        ));
    }
}
