//! Moving activations and gradients between neighbouring stages.
//!
//! [`Transport`] is what the stage runtime sees; [`TcpLink`] implements it over one TCP connection per
//! neighbour pair (activations flow down it, gradients up). A reader thread drains the socket into a
//! queue so that two stages sending to each other at once never deadlock.
//!
//! With device links between the stages (`pipeline.transport = "nccl"`) the values go from device
//! to device and the TCP link carries the rest: the links' ids when they are built, each tensor's
//! header ([`TcpLink::send_header`], with the virtual stage it is for and an activation's
//! document starts, as on a tensor sent over TCP), and — through [`TcpLink::peer_gone`] — the news that the peer
//! is gone, which ends any wait on the device link.

use std::io::{self, BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::auth::{Gate, Purpose};
use super::wire::{Frame, Limits, read_frame, write_frame};
use crate::schedule::Unit;

/// What a tensor message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Payload {
    /// Hidden states flowing forward.
    Activation,
    /// Gradients flowing backward.
    Grad,
}

/// The document starts of each row of a micro-batch, as an activation's header carries them.
pub type DocumentStarts = Vec<Vec<usize>>;

/// The small header in front of every tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorHeader {
    /// Plan generation; messages of another generation are refused.
    pub generation: u64,
    /// Optimizer step (1-based).
    pub step: u64,
    /// Activation or gradient.
    pub payload: Payload,
    /// Which (micro-batch, segment) it belongs to.
    pub unit: Unit,
    /// With virtual stages: the virtual stage the tensor is for (one link carries the tensors of
    /// all the chunks of its two workers). The receiver checks it is the one its schedule
    /// expects. Absent without virtual stages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_stage: Option<usize>,
    /// Tensor shape (f32, row-major).
    pub shape: Vec<usize>,
    /// The values follow on the device link, not in this frame.
    #[serde(default)]
    pub on_device: bool,
    /// With document masks, on activations: the document starts of each row of the unit's
    /// micro-batch (the same for all its segments), which stages past the first cannot read
    /// from tokens. The receiver checks them (untrusted input).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub documents: Option<DocumentStarts>,
}

/// The first frame on a link between stages with device links: the ids of the device link (one
/// per direction), from the earlier stage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct LinkIdsHeader {
    generation: u64,
    ids: usize,
}

/// Transport failures, naming the peer.
/// Connects to `addr`, retrying while the peer refuses or cannot be reached (it is still
/// starting, or a route is coming back after a network partition) until `timeout` has passed.
pub fn connect_retrying(addr: &std::net::SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(addr, left.max(Duration::from_millis(100))) {
            Ok(stream) => return Ok(stream),
            Err(e)
                if Instant::now() < deadline
                    && matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionRefused
                            | io::ErrorKind::HostUnreachable
                            | io::ErrorKind::NetworkUnreachable
                            | io::ErrorKind::TimedOut
                    ) =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e),
        }
    }
}

/// A stage's data port: the previous stage (or a replacement of it) connects here. A [`Gate`]
/// accepts and authenticates connections on threads of their own, so the training thread only
/// ever takes an authenticated stream: idle or hostile connections cannot delay a relink.
pub struct DataPort {
    admitted: Mutex<Receiver<TcpStream>>,
    /// Accepts for as long as the port lives.
    _gate: Gate,
}

impl DataPort {
    /// Starts accepting on `listener` for peers that prove `token` for the data port.
    pub fn open(listener: TcpListener, token: String) -> io::Result<Self> {
        Self::open_for(listener, token, Purpose::Data, "data")
    }

    /// Starts accepting on `listener` for peers that prove `token` for `purpose` (`name` in
    /// logs and thread names).
    pub fn open_for(
        listener: TcpListener,
        token: String,
        purpose: Purpose,
        name: &str,
    ) -> io::Result<Self> {
        let (tx, admitted) = channel();
        let tx = Mutex::new(tx);
        let gate = Gate::start(name, listener, token, purpose, move |stream, _| {
            let _ = tx.lock().unwrap_or_else(|p| p.into_inner()).send(stream);
        })?;
        Ok(Self {
            admitted: Mutex::new(admitted),
            _gate: gate,
        })
    }

    /// The next authenticated connection whose peer is still there, waiting at most `timeout`.
    pub fn next(&self, timeout: Duration) -> io::Result<TcpStream> {
        let deadline = Instant::now() + timeout;
        let admitted = self.admitted.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let stream = admitted.recv_timeout(left).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no authenticated connection within {timeout:?}"),
                )
            })?;
            // A peer that connected and went away since (an earlier incarnation) is skipped.
            if !peer_closed(&stream) {
                return Ok(stream);
            }
        }
    }
}

/// Whether the peer of `stream` has closed it (a zero-byte peek), without consuming anything.
fn peer_closed(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let closed = matches!(stream.peek(&mut [0u8; 1]), Ok(0));
    closed || stream.set_nonblocking(false).is_err()
}

/// The first frame on a link rebuilt in the middle of a step: which units of `payload` the
/// surviving side already received from the stage that is being replaced (it need not send them).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct HaveHeader {
    generation: u64,
    step: u64,
    have: Payload,
    units: Vec<Unit>,
    /// With virtual stages: the replaced stage's chunk of each unit's output, one per unit; absent
    /// (all chunk 0) without them, so the wire format of runs without chunks is unchanged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    chunks: Vec<usize>,
}

#[derive(Debug, Error)]
pub enum TransportError {
    /// The connection broke (the peer died or closed it).
    #[error("connection to {peer} failed: {source}")]
    Io { peer: String, source: io::Error },
    /// Nothing arrived in time.
    #[error("no message from {peer} within {timeout:?} (is it hung or dead?)")]
    Timeout {
        peer: String,
        /// The silent stage: alive (its connection is open) but not sending.
        peer_stage: usize,
        timeout: Duration,
    },
    /// Something other than what the schedule expected arrived.
    #[error("protocol error with {peer}: expected {expected}, got {got}")]
    Unexpected {
        peer: String,
        expected: String,
        got: String,
    },
    /// A tensor could not be (de)serialized.
    #[error("bad tensor from {peer}: {reason}")]
    BadTensor { peer: String, reason: String },
}

/// Sends and receives tensors tagged with their unit to one neighbouring stage.
pub trait Transport: Send {
    /// Sends `tensor` (f32) as the `payload` of `unit` in `step`.
    fn send(
        &mut self,
        step: u64,
        payload: Payload,
        unit: Unit,
        tensor: &Tensor,
    ) -> Result<(), TransportError>;
    /// Receives the next message, which must be the `payload` of `unit` in `step`.
    fn recv(&mut self, step: u64, payload: Payload, unit: Unit) -> Result<Tensor, TransportError>;
}

/// A [`Transport`] over one TCP connection.
pub struct TcpLink {
    peer: String,
    peer_stage: usize,
    generation: u64,
    timeout: Duration,
    writer: BufWriter<TcpStream>,
    incoming: Receiver<io::Result<Frame>>,
    /// A frame (or the link's failure) taken off `incoming` by [`TcpLink::wait_ready`], read
    /// before anything else.
    pending: Option<io::Result<Frame>>,
    /// Set by the reader thread when the connection breaks.
    gone: Arc<AtomicBool>,
    /// The largest boundary tensor a header may announce.
    max_tensor_bytes: u64,
}

/// Bytes of JSON one document start may take in a header (`18446744073709551615,`).
const BYTES_PER_DOCUMENT_START: usize = 21;

/// A dropped link is closed: its reader thread holds a clone of the socket, which would otherwise
/// keep the connection open and the peer waiting.
impl Drop for TcpLink {
    fn drop(&mut self) {
        let _ = self.writer.get_ref().shutdown(std::net::Shutdown::Both);
    }
}

impl TcpLink {
    /// Wraps a connected stream to stage `peer_stage`; a frame whose payload exceeds
    /// `max_tensor_bytes` (the largest boundary tensor of the run) is refused as a broken link.
    pub fn new(
        stream: TcpStream,
        peer_stage: usize,
        generation: u64,
        timeout: Duration,
        max_tensor_bytes: u64,
    ) -> io::Result<Self> {
        Self::with_documents(stream, peer_stage, generation, timeout, max_tensor_bytes, 0)
    }

    /// [`TcpLink::new`] for a run with document masks: a header may also carry up to
    /// `max_document_starts` document starts (a micro-batch's rows × `seq_len`).
    pub fn with_documents(
        stream: TcpStream,
        peer_stage: usize,
        generation: u64,
        timeout: Duration,
        max_tensor_bytes: u64,
        max_document_starts: usize,
    ) -> io::Result<Self> {
        let peer = format!("stage {peer_stage}");
        let mut limits = Limits::data(max_tensor_bytes);
        limits.header = limits
            .header
            .saturating_add(max_document_starts.saturating_mul(BYTES_PER_DOCUMENT_START));
        stream.set_nodelay(true)?;
        let mut reader = BufReader::with_capacity(1 << 20, stream.try_clone()?);
        let (tx, incoming) = channel();
        let gone = Arc::new(AtomicBool::new(false));
        let broke = Arc::clone(&gone);
        std::thread::Builder::new()
            .name(format!("recv-{peer}"))
            .spawn(move || {
                loop {
                    let frame = read_frame(&mut reader, limits);
                    let stop = frame.is_err();
                    if stop {
                        broke.store(true, Ordering::SeqCst);
                    }
                    if tx.send(frame).is_err() || stop {
                        break;
                    }
                }
            })?;
        Ok(Self {
            peer,
            peer_stage,
            generation,
            timeout,
            writer: BufWriter::with_capacity(1 << 20, stream),
            incoming,
            pending: None,
            gone,
            max_tensor_bytes,
        })
    }

    /// Waits at most `wait` for the next frame without consuming it: true once one (or the
    /// link's failure) is there to read.
    pub fn wait_ready(&mut self, wait: Duration) -> bool {
        if self.pending.is_some() {
            return true;
        }
        match self.incoming.recv_timeout(wait) {
            Ok(frame) => {
                self.pending = Some(frame);
                true
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        }
    }

    /// The error of a receive that waited this link's timeout for nothing.
    pub fn timed_out(&self) -> TransportError {
        TransportError::Timeout {
            peer: self.peer.clone(),
            peer_stage: self.peer_stage,
            timeout: self.timeout,
        }
    }

    /// Whether the connection has broken (the peer died or closed it).
    pub fn is_gone(&self) -> bool {
        self.gone.load(Ordering::SeqCst)
    }

    /// A flag set once this link's connection breaks (the peer died or closed it): a device link
    /// to the same peer aborts its waits on it.
    pub fn peer_gone(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.gone)
    }

    /// Sends the ids of the device link to the peer (the later stage).
    pub fn send_link_ids(&mut self, ids: &[[u8; 128]; 2]) -> Result<(), TransportError> {
        let header = LinkIdsHeader {
            generation: self.generation,
            ids: ids.len(),
        };
        write_frame(&mut self.writer, &Frame::new(&header, ids.concat()))
            .map_err(|e| self.io_error(e))
    }

    /// Reads the ids of the device link from the peer (the earlier stage).
    pub fn recv_link_ids(&mut self) -> Result<[[u8; 128]; 2], TransportError> {
        let frame = self.next_frame()?;
        let header: LinkIdsHeader = frame.header().map_err(|e| self.io_error(e))?;
        let expected = LinkIdsHeader {
            generation: self.generation,
            ids: 2,
        };
        if header != expected || frame.payload.len() != 256 {
            return Err(TransportError::Unexpected {
                peer: self.peer.clone(),
                expected: format!("{expected:?} and 256 bytes"),
                got: format!("{header:?} and {} bytes", frame.payload.len()),
            });
        }
        let id = |i: usize| -> [u8; 128] {
            frame.payload[128 * i..128 * (i + 1)]
                .try_into()
                .expect("128 bytes")
        };
        Ok([id(0), id(1)])
    }

    /// Sends the header of a tensor whose values follow on the device link: for virtual stage
    /// `virtual_stage` (`None` without virtual stages), and on an activation with document masks
    /// the document starts of its micro-batch's rows (the device link carries the values alone).
    pub fn send_header(
        &mut self,
        step: u64,
        payload: Payload,
        unit: Unit,
        virtual_stage: Option<usize>,
        shape: &[usize],
        documents: Option<&[Vec<usize>]>,
    ) -> Result<(), TransportError> {
        let mut header = self.header(step, payload, unit, shape.to_vec(), true);
        header.virtual_stage = virtual_stage;
        header.documents = documents.map(<[Vec<usize>]>::to_vec);
        write_frame(&mut self.writer, &Frame::new(&header, Vec::new()))
            .map_err(|e| self.io_error(e))
    }

    /// Receives the header of the next tensor, which must be the `payload` of `unit` in `step`
    /// for `virtual_stage` (exactly: `None` without virtual stages) with its values on the device
    /// link: its shape, at most the run's largest boundary tensor, and the document starts it
    /// carries, if any (unchecked: the caller checks them against the micro-batch, as
    /// [`TcpLink::recv_virtual`]'s).
    pub fn recv_header(
        &mut self,
        step: u64,
        payload: Payload,
        unit: Unit,
        virtual_stage: Option<usize>,
    ) -> Result<(Vec<usize>, Option<DocumentStarts>), TransportError> {
        let frame = self.next_frame()?;
        let mut header: TensorHeader = frame.header().map_err(|e| self.io_error(e))?;
        let documents = header.documents.take();
        let mut expected = self.header(step, payload, unit, header.shape.clone(), true);
        expected.virtual_stage = virtual_stage;
        if header != expected || !frame.payload.is_empty() {
            return Err(TransportError::Unexpected {
                peer: self.peer.clone(),
                expected: format!("{expected:?} with no values"),
                got: format!("{header:?} with {} bytes", frame.payload.len()),
            });
        }
        let bytes = header
            .shape
            .iter()
            .try_fold(4u64, |acc, &d| acc.checked_mul(d as u64));
        match bytes {
            Some(b) if b <= self.max_tensor_bytes => Ok((header.shape, documents)),
            _ => Err(TransportError::BadTensor {
                peer: self.peer.clone(),
                reason: format!(
                    "shape {:?} is larger than the run's largest boundary tensor ({} bytes)",
                    header.shape, self.max_tensor_bytes
                ),
            }),
        }
    }

    /// The header of the `payload` of `unit` in `step` on this link's generation.
    fn header(
        &self,
        step: u64,
        payload: Payload,
        unit: Unit,
        shape: Vec<usize>,
        on_device: bool,
    ) -> TensorHeader {
        TensorHeader {
            generation: self.generation,
            step,
            payload,
            unit,
            virtual_stage: None,
            shape,
            on_device,
            documents: None,
        }
    }

    /// Sends `tensor` (f32) as the `payload` of `unit` in `step`, with the document starts of
    /// its micro-batch's rows when masks are on.
    pub fn send_documented(
        &mut self,
        step: u64,
        payload: Payload,
        unit: Unit,
        tensor: &Tensor,
        documents: Option<&[Vec<usize>]>,
    ) -> Result<(), TransportError> {
        self.send_virtual(step, payload, unit, None, tensor, documents)
    }

    /// [`TcpLink::send_documented`] for virtual stage `virtual_stage` (`None` without virtual
    /// stages), which the message names.
    pub fn send_virtual(
        &mut self,
        step: u64,
        payload: Payload,
        unit: Unit,
        virtual_stage: Option<usize>,
        tensor: &Tensor,
        documents: Option<&[Vec<usize>]>,
    ) -> Result<(), TransportError> {
        let bad = |e: candle_core::Error| TransportError::BadTensor {
            peer: self.peer.clone(),
            reason: e.to_string(),
        };
        let values = tensor
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(bad)?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut header = self.header(step, payload, unit, tensor.dims().to_vec(), false);
        header.virtual_stage = virtual_stage;
        header.documents = documents.map(<[Vec<usize>]>::to_vec);
        write_frame(&mut self.writer, &Frame::new(&header, bytes)).map_err(|e| self.io_error(e))
    }

    /// Receives the next message, which must be the `payload` of `unit` in `step`: the tensor and
    /// the document starts it carries, if any (unchecked: the caller checks them against the
    /// micro-batch).
    pub fn recv_documented(
        &mut self,
        step: u64,
        payload: Payload,
        unit: Unit,
    ) -> Result<(Tensor, Option<DocumentStarts>), TransportError> {
        self.recv_virtual(step, payload, unit, None)
    }

    /// [`TcpLink::recv_documented`] for virtual stage `virtual_stage`: the message must name
    /// exactly it (`None`: no virtual stage at all), or it is refused as out of protocol.
    pub fn recv_virtual(
        &mut self,
        step: u64,
        payload: Payload,
        unit: Unit,
        virtual_stage: Option<usize>,
    ) -> Result<(Tensor, Option<DocumentStarts>), TransportError> {
        let frame = self.next_frame()?;
        let mut header: TensorHeader = frame.header().map_err(|e| self.io_error(e))?;
        let documents = header.documents.take();
        let mut expected = self.header(step, payload, unit, header.shape.clone(), false);
        expected.virtual_stage = virtual_stage;
        if header != expected {
            return Err(TransportError::Unexpected {
                peer: self.peer.clone(),
                expected: format!("{expected:?}"),
                got: format!("{header:?}"),
            });
        }
        // The shape is the peer's claim: its product is checked, never trusted to fit.
        let bytes = header
            .shape
            .iter()
            .try_fold(4usize, |acc, &d| acc.checked_mul(d));
        if bytes != Some(frame.payload.len()) {
            return Err(TransportError::BadTensor {
                peer: self.peer.clone(),
                reason: format!(
                    "shape {:?} does not match the {}-byte payload",
                    header.shape,
                    frame.payload.len()
                ),
            });
        }
        let values: Vec<f32> = frame
            .payload
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        let tensor = Tensor::from_vec(values, header.shape, &Device::Cpu).map_err(|e| {
            TransportError::BadTensor {
                peer: self.peer.clone(),
                reason: e.to_string(),
            }
        })?;
        Ok((tensor, documents))
    }

    /// This link's peer, as errors name it.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Tells the peer (a replacement stage) which `payload` outputs of `step` this side already
    /// has, as (the replacement's chunk, unit).
    pub fn send_have(
        &mut self,
        step: u64,
        have: Payload,
        outputs: &[(usize, Unit)],
    ) -> Result<(), TransportError> {
        let chunked = outputs.iter().any(|&(c, _)| c > 0);
        let header = HaveHeader {
            generation: self.generation,
            step,
            have,
            units: outputs.iter().map(|&(_, u)| u).collect(),
            chunks: if chunked {
                outputs.iter().map(|&(c, _)| c).collect()
            } else {
                Vec::new()
            },
        };
        write_frame(&mut self.writer, &Frame::new(&header, Vec::new()))
            .map_err(|e| self.io_error(e))
    }

    /// Reads the peer's [`TcpLink::send_have`]: the step and the outputs it already has, as
    /// (this side's chunk, unit). A chunk list that does not match the units one for one, or a
    /// chunk not below `chunks` (this side's chunk count), is refused.
    pub fn recv_have(
        &mut self,
        have: Payload,
        chunks: usize,
    ) -> Result<(u64, Vec<(usize, Unit)>), TransportError> {
        let frame = self.next_frame()?;
        let header: HaveHeader = frame.header().map_err(|e| self.io_error(e))?;
        if header.generation != self.generation || header.have != have {
            return Err(TransportError::Unexpected {
                peer: self.peer.clone(),
                expected: format!("the {have:?} units it has, generation {}", self.generation),
                got: format!("{header:?}"),
            });
        }
        let outputs: Vec<(usize, Unit)> = if header.chunks.is_empty() {
            header.units.iter().map(|&u| (0, u)).collect()
        } else if header.chunks.len() == header.units.len() {
            header
                .chunks
                .iter()
                .copied()
                .zip(header.units.iter().copied())
                .collect()
        } else {
            return Err(TransportError::BadTensor {
                peer: self.peer.clone(),
                reason: format!(
                    "its list of the {have:?} outputs it has names {} chunks for {} units",
                    header.chunks.len(),
                    header.units.len()
                ),
            });
        };
        if let Some(&(c, u)) = outputs.iter().find(|&&(c, _)| c >= chunks) {
            return Err(TransportError::BadTensor {
                peer: self.peer.clone(),
                reason: format!(
                    "it claims the {have:?} of unit {u} from chunk {c}, but this stage holds \
                     {chunks} chunk(s)"
                ),
            });
        }
        Ok((header.step, outputs))
    }

    fn next_frame(&mut self) -> Result<Frame, TransportError> {
        if let Some(frame) = self.pending.take() {
            return frame.map_err(|e| self.io_error(e));
        }
        match self.incoming.recv_timeout(self.timeout) {
            Ok(frame) => frame.map_err(|e| self.io_error(e)),
            Err(RecvTimeoutError::Timeout) => Err(self.timed_out()),
            Err(RecvTimeoutError::Disconnected) => {
                Err(self.io_error(io::ErrorKind::UnexpectedEof.into()))
            }
        }
    }

    fn io_error(&self, source: io::Error) -> TransportError {
        TransportError::Io {
            peer: self.peer.clone(),
            source,
        }
    }
}

impl Transport for TcpLink {
    fn send(
        &mut self,
        step: u64,
        payload: Payload,
        unit: Unit,
        tensor: &Tensor,
    ) -> Result<(), TransportError> {
        self.send_documented(step, payload, unit, tensor, None)
    }

    fn recv(&mut self, step: u64, payload: Payload, unit: Unit) -> Result<Tensor, TransportError> {
        match self.recv_documented(step, payload, unit)? {
            (tensor, None) => Ok(tensor),
            (_, Some(_)) => Err(TransportError::Unexpected {
                peer: self.peer.clone(),
                expected: format!("the {payload:?} of unit {unit} without document starts"),
                got: "document starts (data.document_mask differs between the stages?)".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    fn pair(gen_a: u64, gen_b: u64) -> (TcpLink, TcpLink) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        let timeout = Duration::from_secs(5);
        (
            TcpLink::new(a, 1, gen_a, timeout, 1 << 20).unwrap(),
            TcpLink::new(b, 0, gen_b, timeout, 1 << 20).unwrap(),
        )
    }

    #[test]
    fn tensors_round_trip_and_other_generations_are_refused() {
        let unit = Unit {
            micro_batch: 1,
            segment: 2,
        };
        let t = Tensor::arange(0f32, 6.0, &Device::Cpu)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        let (mut a, mut b) = pair(3, 3);
        a.send(7, Payload::Activation, unit, &t).unwrap();
        let got = b.recv(7, Payload::Activation, unit).unwrap();
        assert_eq!(got.to_vec2::<f32>().unwrap(), t.to_vec2::<f32>().unwrap());
        // A unit other than the schedule's next one is a protocol error.
        a.send(7, Payload::Grad, unit, &t).unwrap();
        assert!(matches!(
            b.recv(7, Payload::Activation, unit),
            Err(TransportError::Unexpected { .. })
        ));
        // Fencing: a peer still on an older plan generation is refused.
        let (mut stale, mut current) = pair(2, 3);
        stale.send(7, Payload::Activation, unit, &t).unwrap();
        let err = current.recv(7, Payload::Activation, unit).unwrap_err();
        assert!(err.to_string().contains("generation: 2"), "{err}");
    }

    /// With virtual stages a message names the virtual stage it is for: a receive for another
    /// one, or one that names none where one is expected (and the reverse), is refused; a run
    /// without virtual stages sends headers without the field, as before.
    #[test]
    fn a_message_must_name_the_virtual_stage_the_receiver_expects() {
        let unit = Unit::new(1, 0);
        let t = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let (mut a, mut b) = pair(4, 4);
        a.send_virtual(3, Payload::Activation, unit, Some(5), &t, None)
            .unwrap();
        let (got, docs) = b
            .recv_virtual(3, Payload::Activation, unit, Some(5))
            .unwrap();
        assert_eq!(got.dims(), [2, 3]);
        assert!(docs.is_none());
        for (sent, expected) in [(Some(1), Some(5)), (None, Some(5)), (Some(5), None)] {
            a.send_virtual(3, Payload::Grad, unit, sent, &t, None)
                .unwrap();
            let err = b
                .recv_virtual(3, Payload::Grad, unit, expected)
                .unwrap_err();
            assert!(
                matches!(err, TransportError::Unexpected { .. }),
                "sent {sent:?}, expected {expected:?}: {err}"
            );
        }
        let plain =
            serde_json::to_string(&a.header(1, Payload::Grad, unit, vec![2], false)).unwrap();
        assert!(!plain.contains("virtual_stage"), "{plain}");
    }

    /// Document starts ride in an activation's header, within the link's bound; a plain receive
    /// refuses them, and a link opened without room for them refuses a header that carries many.
    #[test]
    fn document_starts_cross_with_their_activation_within_the_bound() {
        let unit = Unit::new(0, 1);
        let t = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        let timeout = Duration::from_secs(5);
        let seq_len = 16384;
        let mut a = TcpLink::with_documents(a, 1, 1, timeout, 1 << 20, 2 * seq_len).unwrap();
        let mut b = TcpLink::with_documents(b, 0, 1, timeout, 1 << 20, 2 * seq_len).unwrap();
        // The worst case: every position of both rows starts a one-token document.
        let docs = vec![(0..seq_len).collect::<Vec<_>>(), vec![0, 17]];
        a.send_documented(3, Payload::Activation, unit, &t, Some(&docs))
            .unwrap();
        let (got, got_docs) = b.recv_documented(3, Payload::Activation, unit).unwrap();
        assert_eq!(got.dims(), &[2, 3]);
        assert_eq!(got_docs.as_ref(), Some(&docs));
        a.send_documented(3, Payload::Activation, unit, &t, Some(&docs))
            .unwrap();
        let err = b.recv(3, Payload::Activation, unit).unwrap_err();
        assert!(err.to_string().contains("document starts"), "{err}");
        // A link without documents (64 KiB headers) breaks on a header of 16384 starts (~98 KB).
        let (mut plain_a, mut plain_b) = pair(1, 1);
        plain_a
            .send_documented(3, Payload::Activation, unit, &t, Some(&docs))
            .unwrap();
        let err = plain_b.recv(3, Payload::Activation, unit).unwrap_err();
        assert!(err.to_string().contains("frame too large"), "{err}");
    }

    /// With device links the TCP link carries the links' ids and each tensor's header; a header
    /// must name the expected unit and virtual stage, carry no values, and announce at most the
    /// run's largest boundary tensor; an activation's may carry document starts. The reader thread's end sets the peer-gone flag.
    #[test]
    fn device_link_ids_and_headers_cross_and_are_checked() {
        let unit = Unit::new(1, 0);
        let (mut a, mut b) = pair(4, 4);
        let ids = [[7u8; 128], [9u8; 128]];
        a.send_link_ids(&ids).unwrap();
        assert_eq!(b.recv_link_ids().unwrap(), ids);
        a.send_header(2, Payload::Activation, unit, None, &[6, 8], None)
            .unwrap();
        assert_eq!(
            b.recv_header(2, Payload::Activation, unit, None).unwrap(),
            (vec![6, 8], None)
        );
        // Values where a header was expected, or the reverse, are protocol errors.
        let t = Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        a.send(2, Payload::Activation, unit, &t).unwrap();
        let err = b
            .recv_header(2, Payload::Activation, unit, None)
            .unwrap_err();
        assert!(matches!(err, TransportError::Unexpected { .. }), "{err}");
        a.send_header(2, Payload::Grad, unit, None, &[2, 2], None)
            .unwrap();
        let err = b.recv(2, Payload::Grad, unit).unwrap_err();
        assert!(matches!(err, TransportError::Unexpected { .. }), "{err}");
        // 1 MiB is the pair's limit: a header announcing more is refused.
        a.send_header(2, Payload::Grad, unit, None, &[1 << 20, 2], None)
            .unwrap();
        let err = b.recv_header(2, Payload::Grad, unit, None).unwrap_err();
        assert!(err.to_string().contains("largest boundary tensor"), "{err}");
        a.send_header(2, Payload::Grad, unit, None, &[usize::MAX, 3], None)
            .unwrap();
        assert!(b.recv_header(2, Payload::Grad, unit, None).is_err());
        // With virtual stages a header names the virtual stage it is for, exactly.
        a.send_header(2, Payload::Grad, unit, Some(3), &[2, 8], None)
            .unwrap();
        assert_eq!(
            b.recv_header(2, Payload::Grad, unit, Some(3)).unwrap().0,
            vec![2, 8]
        );
        for (sent, expected) in [(Some(1), Some(3)), (None, Some(3)), (Some(3), None)] {
            a.send_header(2, Payload::Grad, unit, sent, &[2, 8], None)
                .unwrap();
            let err = b.recv_header(2, Payload::Grad, unit, expected).unwrap_err();
            assert!(
                matches!(err, TransportError::Unexpected { .. }),
                "sent {sent:?}, expected {expected:?}: {err}"
            );
        }
        // With document masks an activation's header carries its micro-batch's document starts
        // (handed back unchecked: the worker checks them against the micro-batch).
        let docs = vec![vec![0, 5], vec![0]];
        a.send_header(2, Payload::Activation, unit, Some(4), &[2, 8], Some(&docs))
            .unwrap();
        assert_eq!(
            b.recv_header(2, Payload::Activation, unit, Some(4))
                .unwrap(),
            (vec![2, 8], Some(docs))
        );
        let gone = b.peer_gone();
        assert!(!gone.load(Ordering::SeqCst));
        drop(a);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !gone.load(Ordering::SeqCst) {
            assert!(Instant::now() < deadline, "the flag was not set");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// A shape whose product overflows, or that disagrees with the payload, is a bad tensor; a
    /// payload over the link's limit breaks the link. Neither panics.
    #[test]
    fn claimed_shapes_and_sizes_are_checked() {
        let unit = Unit {
            micro_batch: 0,
            segment: 0,
        };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut raw = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        let mut link = TcpLink::new(b, 0, 1, Duration::from_secs(5), 64).unwrap();
        for shape in [vec![usize::MAX, 2, 2], vec![3]] {
            let header = TensorHeader {
                generation: 1,
                step: 1,
                payload: Payload::Activation,
                unit,
                virtual_stage: None,
                shape,
                on_device: false,
                documents: None,
            };
            write_frame(&mut raw, &Frame::new(&header, vec![0u8; 8])).unwrap();
            let err = link.recv(1, Payload::Activation, unit).unwrap_err();
            assert!(matches!(err, TransportError::BadTensor { .. }), "{err}");
        }
        write_frame(&mut raw, &Frame::new(&serde_json::json!({}), vec![0u8; 65])).unwrap();
        let err = link.recv(1, Payload::Activation, unit).unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
    }
}
