//! Messages on the coordinator's control port: between the coordinator and the stage workers, and
//! between the coordinator and the node agents.

use std::io::{self, BufReader, BufWriter};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::wire::{Frame, Limits, read_frame, write_frame};

/// Exit status of a worker that stopped because a neighbouring stage failed (its own node is
/// fine): the launcher and the agents tell a healthy node from a failed one by it.
pub const PEER_FAILURE_EXIT_CODE: u8 = 3;

/// Worker → launcher.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToLauncher {
    /// First message: who the worker is and where its stage-data port listens. `stage` here and
    /// in every message below is the worker's slot, `replica · stages + stage` (the stage itself
    /// with one replica).
    Hello {
        stage: usize,
        /// The plan generation the worker was started for.
        generation: u64,
        data_addr: String,
        /// Where the other replicas of its stage connect for the gradient reduction (with
        /// `pipeline.replicas` > 1).
        #[serde(default)]
        reduce_addr: Option<String>,
        pid: u32,
    },
    /// Connected to its neighbours; ready to run steps.
    Ready { stage: usize },
    /// Forward and backward of a step are done.
    StepDone {
        stage: usize,
        step: u64,
        /// Per-parameter sums of squared gradients, in canonical order.
        sums_of_squares: Vec<(String, f64)>,
        /// Last stage: the sum of the step's token losses.
        loss_sum: Option<f64>,
        /// The node got a preemption notice (SIGTERM) and will leave at this step's boundary.
        leaving: bool,
        /// Last stage: the loss sums of lost replicas' shares this worker computed, by replica.
        #[serde(default)]
        adopted_losses: Vec<(usize, f64)>,
        /// What the step cost this stage (compute, retained boundary tensors, work redone).
        #[serde(default)]
        cost: StepCost,
        /// Data parallelism: the reduction round whose total the gradients are (0: the plan's
        /// group; a re-route's [`ToWorker::Reduce`] starts the next). The launcher counts only
        /// the current round's.
        #[serde(default)]
        round: u32,
    },
    /// A link to a neighbouring stage broke in the middle of step `step` (mid-step recovery): the
    /// worker keeps its state and waits for [`ToWorker::Relink`].
    LinkDown {
        stage: usize,
        step: u64,
        /// The neighbour on the broken link.
        peer: usize,
        error: String,
        /// Forward and backward units this stage has completed in the step (its progress record).
        done_units: usize,
    },
    /// Data parallelism: the gradient reduction of round `round` of step `step` failed (a link to
    /// another replica of the stage broke, most likely because that replica lost a node). The
    /// worker keeps its share of the step and waits for [`ToWorker::Reduce`] of a later round.
    ReduceFailed {
        stage: usize,
        step: u64,
        round: u32,
        /// The replica (member of the group) whose link or message failed, if known.
        peer: Option<usize>,
        error: String,
    },
    /// The optimizer update of a step is applied.
    Updated { stage: usize, step: u64 },
    /// An evaluation pass is done.
    EvalDone { stage: usize, loss_sum: Option<f64> },
    /// This stage's shard of the checkpoint of `step` is uploaded.
    ShardWritten {
        stage: usize,
        step: u64,
        shard: checkpoint::ShardEntry,
        /// Seconds the training thread spent taking the snapshot (its only stall).
        snapshot_s: f64,
    },
    /// This stage's shard of the checkpoint of `step` could not be uploaded.
    ShardFailed {
        stage: usize,
        step: u64,
        error: String,
    },
    /// The stage's state was restored (from a checkpoint of `step`, or initial weights when 0).
    Restored { stage: usize, step: u64 },
    /// The stage's state could not be restored; `corrupt` when the checkpoint itself is damaged
    /// (a hash check failed, or its manifest is unreadable or inconsistent): older ones may do.
    RestoreFailed {
        stage: usize,
        step: u64,
        error: String,
        corrupt: bool,
    },
    /// The worker hit an error and is exiting.
    Failed {
        stage: usize,
        error: String,
        /// A neighbouring stage that stayed silent past the timeout (alive but hung, or cut off).
        suspect: Option<usize>,
        /// Whether the failure would recur on any node (then the run stops with it instead of
        /// recovering).
        #[serde(default)]
        cause: FailureCause,
    },
}

/// Whether a worker's failure is worth recovering from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureCause {
    /// It may not happen again elsewhere (a broken link, a dead neighbour, an I/O error): the run
    /// recovers.
    #[default]
    Transient,
    /// The stage went over `train.memory_budget_bytes`.
    OverBudget,
    /// It would happen again on any node (an unusable config, token file or init directory): the
    /// run stops at once with the worker's message.
    Permanent,
}

/// What one step cost a stage.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepCost {
    /// Forward and backward units computed.
    pub units: usize,
    /// Seconds spent in forward and backward units.
    pub compute_s: f64,
    /// CPU seconds the worker's process used during those units (the rest of
    /// [`StepCost::cpu_user_s`] + [`StepCost::cpu_system_s`] went to the runtime around them:
    /// the update, messages, copies, peer snapshots).
    #[serde(default)]
    pub compute_cpu_s: f64,
    /// Bytes of boundary tensors (activations sent down, gradients sent up) kept for mid-step
    /// recovery until the step's update.
    pub retained_bytes: u64,
    /// Units of a replaced stage computed again (a replacement's replay), and their seconds.
    pub redone_units: usize,
    /// Seconds of those units.
    pub redone_s: f64,
    /// Most bytes of live activations the stage held during the step (see
    /// [`crate::model::Stage::activation_bytes`]).
    #[serde(default)]
    pub peak_activation_bytes: u64,
    /// Bytes of the stage's parameters, gradients and AdamW moments
    /// ([`crate::model::Stage::state_bytes`]).
    #[serde(default)]
    pub state_bytes: u64,
    /// Bytes this worker sent in the gradient reduction with the other replicas of its stage.
    #[serde(default)]
    pub reduce_bytes: u64,
    /// Seconds the gradient reduction took.
    #[serde(default)]
    pub reduce_s: f64,
    /// When the gradient reduction started (Unix µs, on the same clock as
    /// [`UnitTime::start_us`]); only when the step was run with `trace` and there are replicas.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reduce_start_us: u64,
    /// The most full-gradient buffers the stage held at once during the step
    /// ([`crate::model::Stage::take_peak_gradient_buffers`]): 1 for a plain running sum, up to
    /// ⌊log2 c⌋ + 1 for the fixed summation tree over c micro-batches. Each is the size of the
    /// stage's parameters (a quarter of `state_bytes`), which counts one of them.
    #[serde(default)]
    pub gradient_buffers: usize,
    /// Minor page faults of the worker's process since its previous step report (this step's
    /// units, the previous update, peer copies, checkpoint snapshots): none in a steady state
    /// that reuses its buffers.
    #[serde(default)]
    pub page_faults: u64,
    /// CPU seconds of the worker's process in user mode since its previous step report.
    #[serde(default)]
    pub cpu_user_s: f64,
    /// CPU seconds of the worker's process in the kernel since its previous step report.
    #[serde(default)]
    pub cpu_system_s: f64,
    /// When each unit ran (only when the step was run with `trace`), in the order computed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unit_times: Vec<UnitTime>,
    /// The worker's previous peer snapshot was still being sent when it reported the step: the
    /// launcher then asks no stage for a copy of this step (all stages copy the same steps).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub peer_copy_in_flight: bool,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// When one forward or backward unit ran on a stage, for `seqpipe train --trace`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitTime {
    /// The unit computed.
    pub unit: crate::schedule::Unit,
    /// A backward (else a forward).
    pub backward: bool,
    /// Start, in microseconds since the Unix epoch (wall clock, so that stages line up).
    pub start_us: u64,
    /// Duration in microseconds.
    pub dur_us: u64,
    /// CPU time of the worker process during the unit, in microseconds: the unit's compute
    /// time without the time it waited for a core.
    #[serde(default)]
    pub cpu_us: u64,
    /// A replacement's replay of a unit a neighbour already had the output of.
    pub redone: bool,
    /// The unit's segment length (tokens per row): its micro-batch's own with the document
    /// partition, so the trace records each micro-batch's lengths.
    #[serde(default)]
    pub len: usize,
    /// A backward split in two (zero-bubble schedules): which half ran (`None`: a whole backward
    /// or a forward).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub half: Option<BackwardHalf>,
}

/// Which half of a split backward a [`UnitTime`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackwardHalf {
    /// The input gradient (`I`).
    Input,
    /// The weight gradients (`W`).
    Weight,
}

/// A replica group rebuilt from the surviving replicas of a stage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Regroup {
    /// The link generation (above every earlier group's).
    pub generation: u64,
    /// This worker's place among `addrs`.
    pub member: usize,
    /// The reduction ports of the surviving replicas' workers of this stage, in replica order.
    pub addrs: Vec<String>,
}

fn yes() -> bool {
    true
}

/// Which neighbour link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    /// The link to stage r−1 (this stage accepts it).
    Prev,
    /// The link to stage r+1 (this stage connects to it).
    Next,
}

/// Launcher → worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToWorker {
    /// The pipeline: plan generation and the neighbours' data addresses.
    Topology {
        generation: u64,
        prev: Option<String>,
        next: Option<String>,
        /// This worker replaces a lost stage in the middle of a step: its neighbours first say
        /// which of its outputs they already have.
        #[serde(default)]
        replacement: bool,
        /// The reduction ports of its stage's replicas, by replica (empty with one replica).
        #[serde(default)]
        replicas: Vec<String>,
    },
    /// Mid-step recovery: rebuild the broken link on `side` (to a replacement of the lost
    /// neighbour, under link generation `generation`): accept it (`Prev`) or connect to `addr`
    /// (`Next`), tell it what this side already received, and send it again every tensor this
    /// side sent on that link during the step.
    Relink {
        generation: u64,
        side: Side,
        addr: Option<String>,
    },
    /// Run forward and backward of step `step` (1-based); with `trace`, report when each unit
    /// ran ([`StepCost::unit_times`]).
    RunStep {
        step: u64,
        #[serde(default)]
        trace: bool,
    },
    /// Clip with `clip_coefficient` and apply AdamW with learning rate `lr`.
    Apply {
        step: u64,
        lr: f64,
        clip_coefficient: f64,
        /// Copy the new state to the peer-snapshot agents (one replica per stage does, and only
        /// when no stage's previous copy is still in flight).
        #[serde(default = "yes")]
        snapshot: bool,
    },
    /// Data parallelism, after a replica was lost in step `step`: reduce this stage's gradients
    /// again, as round `round`, whatever the earlier round's outcome (the worker kept its share).
    /// First compute the shares of the lost replicas in `adopt` (their micro-batches, re-routed
    /// to this worker's replica); with `regroup`, reduce in a new group of the surviving
    /// replicas instead of the current one.
    Reduce {
        step: u64,
        round: u32,
        #[serde(default)]
        adopt: Vec<usize>,
        #[serde(default)]
        regroup: Option<Regroup>,
    },
    /// Compute the validation loss over the `batches` held-out micro-batches from the `first`
    /// (an evaluation runs in chunks, so that a stop signal can abandon it between two).
    Eval {
        #[serde(default)]
        first: usize,
        batches: usize,
    },
    /// Snapshot the state after step `step` and upload it in the background.
    Checkpoint { step: u64 },
    /// Load parameters and optimizer state from the committed checkpoint of `step`.
    Restore { step: u64 },
    /// Load the state after `step` from the peer snapshots held by the agents at `sources`.
    RestorePeers { step: u64, sources: Vec<String> },
    /// Load parameters from a Hugging Face GPT-2 directory (`seqpipe ckpt export` output).
    InitFrom { dir: std::path::PathBuf },
    /// Exit cleanly.
    Shutdown,
}

/// Agent → coordinator.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromAgent {
    /// First message: the node and what it offers (`node.addr` is the host its workers bind to).
    Join { node: elastic::NodeInfo, pid: u32 },
    /// The node is alive (every `elastic.heartbeat_s`).
    Heartbeat,
    /// A worker this agent started exited by itself.
    WorkerExited {
        generation: u64,
        stage: usize,
        /// The `launch` of the `StartWorkers` that started it: a stage replaced mid-step runs
        /// again in the same generation, and this says whether the exit is the replacement's or
        /// its predecessor's.
        #[serde(default)]
        launch: u64,
        /// Exit code, or `None` when a signal ended it.
        code: Option<i32>,
        /// How it ended, for people (`exit status: 1`, `signal: 9 (SIGKILL)`).
        status: String,
        /// The last lines of its log.
        log_tail: String,
        /// Where its log is, on the agent's host.
        log: String,
    },
    /// The workers of `generation` are stopped (answer to [`ToAgent::StopWorkers`]).
    WorkersStopped { generation: u64 },
    /// The node cannot run the worker slots `stages` of `generation` (answer to
    /// [`ToAgent::StartWorkers`]): by the estimate they need more memory than the node has
    /// (`error` says how much); none was started.
    CannotStart {
        generation: u64,
        stages: Vec<usize>,
        error: String,
    },
    /// The node got a preemption notice: it leaves at the next step boundary.
    Leaving {
        /// The cloud's notice; `None` for SIGTERM.
        #[serde(default)]
        notice: Option<elastic::preemption::Notice>,
    },
    /// The agent holds a peer snapshot of these tensors of the state after `step`.
    SnapshotHeld { step: u64, names: Vec<String> },
}

/// Coordinator → agent.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToAgent {
    /// The join is recorded; heartbeat every `heartbeat_s`.
    Welcome { incarnation: u64, heartbeat_s: f64 },
    /// Start one worker per stage of `stages` for plan `generation`.
    StartWorkers {
        generation: u64,
        /// The step the plan starts at: the agent stores peer snapshots of the plan's steps only.
        #[serde(default)]
        first_step: u64,
        stages: Vec<usize>,
        /// The resolved config (TOML) the workers run.
        config: String,
        /// Agents' snapshot addresses the workers copy their state to after every step (their own
        /// node's and its buddy's); empty when peer snapshots are off.
        snapshot_to: Vec<String>,
        /// Sub-directory of the agent's directory for this pipeline's config and logs.
        session: String,
        /// Workers dump each step's gradients here (tests).
        dump_grads: Option<std::path::PathBuf>,
        /// Keep the node's running workers (a replacement stage added mid-step); otherwise they
        /// are stopped first.
        #[serde(default)]
        keep_running: bool,
        /// The coordinator's number for this start (every `StartWorkers` it sends has its own):
        /// the workers' exits are reported with it.
        #[serde(default)]
        launch: u64,
    },
    /// Stop (kill) the workers of `generation` and every older one; answer with `WorkersStopped`.
    StopWorkers { generation: u64 },
    /// The coordinator declared this node dead (fenced): its workers are stopped and it must
    /// join again as a new incarnation.
    Refused { reason: String },
    /// The run is over: stop the workers and exit.
    Shutdown,
}

/// The first message on a control connection says who is connecting.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Opening {
    /// A stage worker (its `Hello`).
    Worker(ToLauncher),
    /// A node agent (its `Join`).
    Agent(FromAgent),
}

/// A JSON message stream over TCP (the worker's end of its control connection).
pub struct ControlStream {
    reader: BufReader<TcpStream>,
    sender: ControlSender,
}

impl ControlStream {
    /// Wraps a connected stream.
    pub fn new(stream: TcpStream) -> io::Result<Self> {
        stream.set_nodelay(true)?;
        Ok(Self {
            reader: BufReader::new(stream.try_clone()?),
            sender: ControlSender::new(stream),
        })
    }

    /// Sends one message.
    pub fn send(&self, msg: &impl Serialize) -> io::Result<()> {
        self.sender.send(msg)
    }

    /// Receives one message (blocking).
    pub fn recv<T: DeserializeOwned>(&mut self) -> io::Result<T> {
        read_frame(&mut self.reader, Limits::CONTROL)?.header()
    }

    /// This end's address (the interface that reaches the peer).
    pub fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.reader.get_ref().local_addr()
    }

    /// A handle that other threads (the checkpoint uploader) can send with.
    pub fn sender(&self) -> ControlSender {
        self.sender.clone()
    }
}

/// How long a connection closed by [`ControlSender::send_and_close`] is still read from while the
/// peer stays silent.
pub const CLOSE_LINGER: std::time::Duration = std::time::Duration::from_secs(10);

/// The sending half of a control connection, shareable between threads.
#[derive(Clone)]
pub struct ControlSender(Arc<Mutex<BufWriter<TcpStream>>>);

impl ControlSender {
    /// Wraps the stream for sending.
    pub fn new(stream: TcpStream) -> Self {
        Self(Arc::new(Mutex::new(BufWriter::new(stream))))
    }

    /// Sends one message; messages from different threads never interleave.
    pub fn send(&self, msg: &impl Serialize) -> io::Result<()> {
        let mut writer = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        write_frame(&mut *writer, &Frame::new(msg, Vec::new()))
    }

    /// Sends `msg` (best effort) and closes the connection: the peer reads the message, then the
    /// end of the stream. Whatever it still sends is read (and refused by the receiver) until it
    /// closes its side or stays silent for [`CLOSE_LINGER`]; closing the read side at once would
    /// answer the peer's late data with a reset that can destroy the message before it is read.
    pub fn send_and_close(&self, msg: &impl Serialize) {
        let mut writer = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let _ = write_frame(&mut *writer, &Frame::new(msg, Vec::new()));
        let stream = writer.get_ref();
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let _ = stream.set_read_timeout(Some(CLOSE_LINGER));
    }
}
