//! A stage worker: one OS process per pipeline stage. It connects to the launcher, wires itself to its
//! neighbours, then executes its stage's action list for every step it is told to run.

use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use ops::adamw::{AdamW, AdamWConfig};
use thiserror::Error;
use tracing::{debug, info};

use super::control::{ControlStream, ToLauncher, ToWorker};
use super::transport::{Payload, TcpLink, Transport, TransportError};
use crate::config::{Config, ConfigError};
use crate::data::{DataError, Split, TokenSource, micro_batch_tokens, open_source};
use crate::model::{Mode, ModelError, Stage, StageInput, StageOutput, partition_layers};
use crate::schedule::{Action, Schedule, ScheduleError, Unit, generate, generate_forward_only};

/// Why a worker stopped.
#[derive(Debug, Error)]
pub enum WorkerError {
    /// The config could not be used.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The launcher could not be reached or went away.
    #[error("coordinator connection ({addr}): {source}")]
    Control { addr: String, source: std::io::Error },
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
    /// The launcher sent something out of protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A local I/O failure (sockets, gradient dumps).
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    /// A tensor operation failed.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

/// How a worker is started (`seqpipe worker ...`).
#[derive(Clone, Debug)]
pub struct WorkerArgs {
    /// The launcher's control address.
    pub control: String,
    /// This worker's stage index.
    pub stage: usize,
    /// The resolved config file.
    pub config: PathBuf,
    /// Write each step's accumulated gradients here before the update (debugging and tests).
    pub dump_grads: Option<PathBuf>,
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
}

/// Runs a worker until the launcher says shut down. Errors are also reported to the launcher.
pub fn run_worker(args: WorkerArgs) -> Result<(), WorkerError> {
    let control_err = |source| WorkerError::Control { addr: args.control.clone(), source };
    let cfg = Config::from_toml(&std::fs::read_to_string(&args.config).map_err(|source| ConfigError::Read { path: args.config.clone(), source })?, &args.config.display().to_string())?;
    cfg.validate()?;
    let timeout = Duration::from_secs_f64(cfg.pipeline.timeout_s);
    let addr = resolve(&args.control)?;
    let stream = TcpStream::connect_timeout(&addr, timeout).map_err(control_err)?;
    let mut control = ControlStream::new(stream).map_err(control_err)?;
    let result = (|| {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|source| WorkerError::Io { what: "binding the stage data port".into(), source })?;
        let data_addr = listener.local_addr().map_err(|source| WorkerError::Io { what: "stage data port".into(), source })?.to_string();
        control.send(&ToLauncher::Hello { stage: args.stage, data_addr, pid: std::process::id() }).map_err(control_err)?;
        let mut worker = Worker::new(cfg, args.stage, args.dump_grads.clone())?;
        match control.recv::<ToWorker>().map_err(control_err)? {
            ToWorker::Topology { generation, prev, next } => worker.connect(&listener, generation, prev, next, timeout)?,
            other => return Err(WorkerError::Protocol(format!("expected the topology first, got {other:?}"))),
        }
        control.send(&ToLauncher::Ready { stage: args.stage }).map_err(control_err)?;
        worker.serve(&mut control).map_err(|e| match e {
            WorkerError::Control { source, .. } => control_err(source),
            e => e,
        })
    })();
    if let Err(e) = &result {
        let _ = control.send(&ToLauncher::Failed { stage: args.stage, error: e.to_string() });
    }
    result
}

fn resolve(addr: &str) -> Result<std::net::SocketAddr, WorkerError> {
    use std::net::ToSocketAddrs;
    let io = |source| WorkerError::Control { addr: addr.to_string(), source };
    addr.to_socket_addrs().map_err(io)?.next().ok_or_else(|| io(std::io::Error::new(std::io::ErrorKind::NotFound, "address resolves to nothing")))
}

impl Worker {
    fn new(cfg: Config, stage_index: usize, dump_grads: Option<PathBuf>) -> Result<Self, WorkerError> {
        let layouts = partition_layers(&cfg.model, cfg.train.seq_len, cfg.pipeline.stages).map_err(ModelError::from)?;
        let layout = layouts.into_iter().nth(stage_index).ok_or_else(|| WorkerError::Protocol(format!("stage {stage_index} does not exist in a {}-stage pipeline", cfg.pipeline.stages)))?;
        let segment_lengths = cfg.segment_lengths()?;
        let (first, last) = (layout.is_first(), layout.is_last());
        info!(stage = stage_index, layers = ?layout.layers, ?segment_lengths, "building stage");
        let stage = Stage::new(&cfg.model, layout, segment_lengths.clone(), cfg.train.seed)?;
        let data = if first || last { Some(open_source(&cfg.data, cfg.model.vocab_size)?) } else { None };
        let schedule = generate(cfg.pipeline.schedule, cfg.pipeline.stages, cfg.pipeline.microbatches, cfg.pipeline.splits)?;
        let t = &cfg.train;
        let optimizer = AdamW::new(AdamWConfig { beta1: t.beta1, beta2: t.beta2, eps: t.eps });
        Ok(Self { cfg, stage, optimizer, data, schedule, segment_lengths, prev: None, next: None, dump_grads })
    }

    fn index(&self) -> usize {
        self.stage.layout().stage
    }

    /// Accepts the previous stage's connection and connects to the next stage.
    fn connect(&mut self, listener: &TcpListener, generation: u64, prev: Option<String>, next: Option<String>, timeout: Duration) -> Result<(), WorkerError> {
        let r = self.index();
        let io = |what: String| move |source| WorkerError::Io { what: what.clone(), source };
        if let Some(next) = next {
            let addr = resolve(&next)?;
            let stream = TcpStream::connect_timeout(&addr, timeout).map_err(io(format!("connecting to stage {} at {next}", r + 1)))?;
            self.next = Some(TcpLink::new(stream, format!("stage {}", r + 1), generation, timeout).map_err(io("next-stage link".into()))?);
        }
        if prev.is_some() {
            listener.set_nonblocking(true).map_err(io("data port".into()))?;
            let deadline = Instant::now() + timeout;
            let stream = loop {
                match listener.accept() {
                    Ok((stream, _)) => break stream,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                    Err(e) => return Err(io(format!("waiting for stage {} to connect", r - 1))(e)),
                }
            };
            stream.set_nonblocking(false).map_err(io("data port".into()))?;
            self.prev = Some(TcpLink::new(stream, format!("stage {}", r - 1), generation, timeout).map_err(io("previous-stage link".into()))?);
        }
        Ok(())
    }

    fn serve(&mut self, control: &mut ControlStream) -> Result<(), WorkerError> {
        let r = self.index();
        let control_err = |source| WorkerError::Control { addr: "launcher".into(), source };
        loop {
            match control.recv::<ToWorker>().map_err(control_err)? {
                ToWorker::RunStep { step } => {
                    let started = Instant::now();
                    let loss_sum = self.run_step(step)?;
                    let sums_of_squares = self.stage.grad_sums_of_squares()?;
                    if let Some(dir) = &self.dump_grads {
                        self.dump_gradients(dir, step)?;
                    }
                    debug!(step, elapsed_s = started.elapsed().as_secs_f64(), "step computed");
                    control.send(&ToLauncher::StepDone { stage: r, step, sums_of_squares, loss_sum }).map_err(control_err)?;
                }
                ToWorker::Apply { step, lr, clip_coefficient } => {
                    let t = &self.cfg.train;
                    self.stage.apply_update(&mut self.optimizer, lr, clip_coefficient, t.weight_decay, t.decay_embeddings)?;
                    control.send(&ToLauncher::Updated { stage: r, step }).map_err(control_err)?;
                }
                ToWorker::Eval { batches } => {
                    let loss_sum = self.run_eval(batches)?;
                    control.send(&ToLauncher::EvalDone { stage: r, loss_sum }).map_err(control_err)?;
                }
                ToWorker::Shutdown => return Ok(()),
                other @ ToWorker::Topology { .. } => return Err(WorkerError::Protocol(format!("unexpected {other:?} while running"))),
            }
        }
    }

    /// Executes this stage's actions of one training step.
    fn run_step(&mut self, step: u64) -> Result<Option<f64>, WorkerError> {
        let schedule = self.schedule.clone();
        self.execute(&schedule, Split::Train, step, Mode::Train)
    }

    /// Forward-only pass over `batches` held-out micro-batches (the same ones at every evaluation).
    fn run_eval(&mut self, batches: usize) -> Result<Option<f64>, WorkerError> {
        let schedule = generate_forward_only(self.cfg.pipeline.stages, batches, self.cfg.pipeline.splits)?;
        self.execute(&schedule, Split::Val, 0, Mode::Eval)
    }

    fn execute(&mut self, schedule: &Schedule, split: Split, step: u64, mode: Mode) -> Result<Option<f64>, WorkerError> {
        let r = self.index();
        let (first, last) = (self.stage.layout().is_first(), self.stage.layout().is_last());
        let loss_scale = 1.0 / (schedule.microbatches * self.cfg.train.micro_batch_size * self.cfg.train.seq_len) as f64;
        let mut tokens = MicroBatchTokens { tokens: HashMap::new() };
        let mut inbox: HashMap<Unit, Tensor> = HashMap::new();
        let mut outbox: HashMap<Unit, Tensor> = HashMap::new();
        let mut loss_sum = last.then_some(0.0);
        for action in &schedule.actions[r] {
            match *action {
                Action::RecvActivation(u) => {
                    let t = link(&mut self.prev, "previous")?.recv(step, Payload::Activation, u)?;
                    inbox.insert(u, t);
                }
                Action::Forward(u) => {
                    let input = if first { StageInput::Tokens(self.segment_tokens(&mut tokens, split, step, u, 0)?) } else { StageInput::Hidden(take(&mut inbox, u)?) };
                    let targets = if last { Some(self.segment_tokens(&mut tokens, split, step, u, 1)?.flatten_all()?) } else { None };
                    if u.segment + 1 == self.segment_lengths.len() {
                        tokens.tokens.remove(&u.micro_batch);
                    }
                    match self.stage.forward(u, input, targets.as_ref(), loss_scale, mode)? {
                        StageOutput::Hidden(h) => {
                            outbox.insert(u, h);
                        }
                        StageOutput::LossSum(l) => *loss_sum.as_mut().expect("last stage") += l,
                    }
                }
                Action::SendActivation(u) => link(&mut self.next, "next")?.send(step, Payload::Activation, u, &take(&mut outbox, u)?)?,
                Action::RecvGrad(u) => {
                    let t = link(&mut self.next, "next")?.recv(step, Payload::Grad, u)?;
                    inbox.insert(u, t);
                }
                Action::Backward(u) => {
                    let d_out = if last { None } else { Some(take(&mut inbox, u)?) };
                    if let Some(dx) = self.stage.backward(u, d_out)? {
                        outbox.insert(u, dx);
                    }
                }
                Action::SendGrad(u) => link(&mut self.prev, "previous")?.send(step, Payload::Grad, u, &take(&mut outbox, u)?)?,
            }
        }
        Ok(loss_sum)
    }

    /// Token ids `(B, s)` of unit `u`'s segment, shifted by `shift` (0 = inputs, 1 = targets).
    fn segment_tokens(&self, cache: &mut MicroBatchTokens, split: Split, step: u64, u: Unit, shift: usize) -> Result<Tensor, WorkerError> {
        let (batch, seq_len) = (self.cfg.train.micro_batch_size, self.cfg.train.seq_len);
        let rows = match cache.tokens.entry(u.micro_batch) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let src = self.data.as_deref().expect("first and last stages hold a data source");
                e.insert(micro_batch_tokens(src, split, self.cfg.train.seed, step, u.micro_batch as u64, batch, seq_len)?)
            }
        };
        let start: usize = self.segment_lengths[..u.segment].iter().sum();
        let len = self.segment_lengths[u.segment];
        let ids: Vec<u32> = (0..batch).flat_map(|b| rows[b * (seq_len + 1) + start + shift..][..len].iter().copied()).collect();
        Ok(Tensor::from_vec(ids, (batch, len), &Device::Cpu)?)
    }

    fn dump_gradients(&self, dir: &Path, step: u64) -> Result<(), WorkerError> {
        let io = |source| WorkerError::Io { what: format!("writing gradients to {}", dir.display()), source };
        std::fs::create_dir_all(dir).map_err(io)?;
        let grads: HashMap<String, Tensor> = self.stage.params().specs().iter().filter_map(|s| self.stage.grads().get(&s.name).map(|g| (s.name.clone(), g.clone()))).collect();
        candle_core::safetensors::save(&grads, dir.join(format!("step-{step}-stage-{}.safetensors", self.index())))?;
        Ok(())
    }
}

fn link<'a>(link: &'a mut Option<TcpLink>, which: &str) -> Result<&'a mut TcpLink, WorkerError> {
    link.as_mut().ok_or_else(|| WorkerError::Protocol(format!("the schedule talks to the {which} stage, which this stage does not have")))
}

fn take(map: &mut HashMap<Unit, Tensor>, u: Unit) -> Result<Tensor, WorkerError> {
    map.remove(&u).ok_or_else(|| WorkerError::Protocol(format!("no tensor for unit {u:?} (schedule out of order)")))
}
