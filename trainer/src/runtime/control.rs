//! Messages between the launcher (coordinator) and the stage workers.

use std::io::{self, BufReader, BufWriter};
use std::net::TcpStream;

use serde::{Deserialize, Serialize};
use serde::de::DeserializeOwned;

use super::wire::{Frame, read_frame, write_frame};

/// Worker → launcher.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToLauncher {
    /// First message: who the worker is and where its stage-data port listens.
    Hello { stage: usize, data_addr: String, pid: u32 },
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
    },
    /// The optimizer update of a step is applied.
    Updated { stage: usize, step: u64 },
    /// An evaluation pass is done.
    EvalDone { stage: usize, loss_sum: Option<f64> },
    /// The worker hit an error and is exiting.
    Failed { stage: usize, error: String },
}

/// Launcher → worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToWorker {
    /// The pipeline: plan generation and the neighbours' data addresses.
    Topology { generation: u64, prev: Option<String>, next: Option<String> },
    /// Run forward and backward of step `step` (1-based).
    RunStep { step: u64 },
    /// Clip with `clip_coefficient` and apply AdamW with learning rate `lr`.
    Apply { step: u64, lr: f64, clip_coefficient: f64 },
    /// Compute the validation loss over `batches` held-out micro-batches.
    Eval { batches: usize },
    /// Exit cleanly.
    Shutdown,
}

/// A JSON message stream over TCP.
pub struct ControlStream {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

impl ControlStream {
    /// Wraps a connected stream.
    pub fn new(stream: TcpStream) -> io::Result<Self> {
        stream.set_nodelay(true)?;
        Ok(Self { reader: BufReader::new(stream.try_clone()?), writer: BufWriter::new(stream) })
    }

    /// Sends one message.
    pub fn send(&mut self, msg: &impl Serialize) -> io::Result<()> {
        write_frame(&mut self.writer, &Frame::new(msg, Vec::new()))
    }

    /// Receives one message (blocking).
    pub fn recv<T: DeserializeOwned>(&mut self) -> io::Result<T> {
        read_frame(&mut self.reader)?.header()
    }

}
