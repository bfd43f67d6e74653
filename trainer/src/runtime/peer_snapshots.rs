//! Tier-1 recovery state: after a step each worker copies its stage's state (parameters and
//! AdamW moments, under their global names) into the memory of two agents — its own node's and its
//! buddy node's — behind the training. When nodes are lost, the new pipeline's workers fetch their
//! layers' state from the surviving agents instead of the object store, and only the steps after
//! the newest copy are redone.
//!
//! A copy must never slow the step it follows (Gemini, SOSP'23, fits checkpoint traffic into the
//! idle time between steps). So each worker has at most one copy in flight: the launcher asks for
//! a step's copy only when every worker reported its previous one finished, and a worker whose
//! copy is still going skips the new one instead of queueing it (so all stages copy the same
//! steps). A copy is serialized into one buffer the sender reuses, and an agent receives into the
//! buffers of the step it evicted, so that a steady run allocates (and page-faults) nothing new.
//!
//! Agents keep the copies of the two newest steps (the newest may be incomplete when a failure
//! strikes during the copy) and report what they hold to the coordinator, which restores from the
//! newest step that the live agents cover completely (older than the last finished step when
//! copies were skipped: the steps after it are replayed, bit-exact since data are a pure function
//! of the step).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufReader, BufWriter, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use checkpoint::{Dtype, TensorData};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use super::auth::{self, Gate, Purpose};
use super::kill_switch::KillSwitch;
use super::wire::{Frame, Limits, read_frame, read_frame_into, write_frame, write_frame_parts};
use crate::checkpointing::shard::to_tensor_data;
use crate::model::StateSnapshot;

/// How many steps an agent keeps.
const KEPT_STEPS: usize = 2;

/// One tensor in a frame's payload.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct TensorMeta {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
}

/// Worker → agent.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Request {
    /// Keep these tensors (the payload) as the state after `step`.
    Put { step: u64, tensors: Vec<TensorMeta> },
    /// Send the tensors of `step` among `names` that you hold.
    Get { step: u64, names: Vec<String> },
}

/// Agent → worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Reply {
    /// The put is stored.
    Stored,
    /// The requested tensors this agent holds (the payload).
    Tensors { tensors: Vec<TensorMeta> },
}

/// What a frame says of `tensors`, whose bytes follow in its payload in this order.
fn metas(tensors: &[(String, TensorData)]) -> Vec<TensorMeta> {
    tensors
        .iter()
        .map(|(name, t)| TensorMeta {
            name: name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            len: t.data.len(),
        })
        .collect()
}

/// The payload of `tensors`, as the parts it is written from (no copy).
fn parts(tensors: &[(String, TensorData)]) -> Vec<&[u8]> {
    tensors.iter().map(|(_, t)| &t.data[..]).collect()
}

/// Writes a frame of `header` whose payload is the bytes of `tensors`.
fn write_tensors(
    w: &mut impl Write,
    header: &impl Serialize,
    tensors: &[(String, TensorData)],
) -> std::io::Result<()> {
    let header = serde_json::to_vec(header).map_err(std::io::Error::other)?;
    write_frame_parts(w, &header, &parts(tensors))
}

/// Where each tensor of `metas` starts in a payload of `payload_len` bytes. Every number in
/// `metas` is the peer's claim: lengths must add up to the payload exactly and match each
/// tensor's shape and dtype, with checked arithmetic.
fn layout(metas: &[TensorMeta], payload_len: usize) -> std::io::Result<Vec<usize>> {
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let mut offset = 0usize;
    let mut offsets = Vec::with_capacity(metas.len().min(1 << 16));
    for m in metas {
        let end = offset
            .checked_add(m.len)
            .filter(|&end| end <= payload_len)
            .ok_or_else(|| {
                bad(format!(
                    "snapshot payload of {payload_len} B too short for tensor `{}` ({} B at offset {offset})",
                    m.name, m.len
                ))
            })?;
        let elements_bytes = m
            .shape
            .iter()
            .try_fold(m.dtype.bitsize(), |acc, &d| acc.checked_mul(d))
            .map(|bits| bits.div_ceil(8));
        if elements_bytes != Some(m.len) {
            return Err(bad(format!(
                "tensor `{}`: shape {:?} of {:?} does not take {} B",
                m.name, m.shape, m.dtype, m.len
            )));
        }
        offsets.push(offset);
        offset = end;
    }
    if offset != payload_len {
        return Err(bad(format!(
            "snapshot payload has {} B beyond its tensors",
            payload_len - offset
        )));
    }
    Ok(offsets)
}

/// Splits a payload into its tensors (checked by [`layout`]).
fn unpack(metas: Vec<TensorMeta>, payload: Vec<u8>) -> std::io::Result<Vec<(String, TensorData)>> {
    let offsets = layout(&metas, payload.len())?;
    let payload = bytes::Bytes::from(payload);
    Ok(metas
        .into_iter()
        .zip(offsets)
        .map(|(m, offset)| {
            let data = payload.slice(offset..offset + m.len);
            (m.name, TensorData::new(m.dtype, m.shape, data))
        })
        .collect())
}

/// What the current plan lets peers store: set from each `StartWorkers` the agent receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutBounds {
    /// The plan's generation.
    pub generation: u64,
    /// The step the plan starts at.
    pub first_step: u64,
    /// The largest payload a Put may carry: the largest stage's parameters and AdamW moments.
    pub max_payload: u64,
}

impl PutBounds {
    /// Header slack beyond the payload bound: the JSON metadata of every tensor of a stage.
    pub const MAX_HEADER: usize = 16 << 20;

    /// The bounds of a plan of `generation` starting at `first_step` over stages whose largest
    /// holds `largest_stage_params` parameters: each travels as an F32 weight and AdamW's two F32
    /// moments (12 bytes); 16 bytes per parameter leaves room for small extra tensors.
    pub fn for_plan(generation: u64, first_step: u64, largest_stage_params: u64) -> Self {
        Self {
            generation,
            first_step,
            max_payload: largest_stage_params
                .saturating_mul(crate::memory::STATE_BYTES_PER_PARAM)
                .saturating_add(1 << 20),
        }
    }

    /// The bounds of a plan whose workers run `config` (TOML, as `StartWorkers` carries it). A
    /// config that does not parse or split into stages allows no payload: its workers fail on it
    /// anyway.
    pub fn from_config(generation: u64, first_step: u64, config: &str) -> Self {
        let largest = crate::config::Config::from_toml(config, "the coordinator's config")
            .ok()
            .and_then(|cfg| crate::memory::estimate(&cfg))
            .and_then(|stages| stages.iter().map(|s| s.params).max());
        match largest {
            Some(params) => Self::for_plan(generation, first_step, params),
            None => Self {
                generation,
                first_step,
                max_payload: 0,
            },
        }
    }
}

/// One Put as stored: its payload, kept whole so that its buffer can be reused once the step is
/// evicted, and where each tensor lies in it.
struct Parcel {
    payload: Arc<Vec<u8>>,
    /// name → (metadata, offset in `payload`).
    tensors: BTreeMap<String, (TensorMeta, usize)>,
}

/// A payload buffer shared by the tensors served from it.
struct SharedPayload(Arc<Vec<u8>>);

impl AsRef<[u8]> for SharedPayload {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Parcel {
    /// Checks `metas` against `payload` (see [`unpack`]) and indexes the tensors.
    fn new(metas: Vec<TensorMeta>, payload: Vec<u8>) -> std::io::Result<Self> {
        let offsets = layout(&metas, payload.len())?;
        let tensors = metas
            .into_iter()
            .zip(offsets)
            .map(|(m, offset)| (m.name.clone(), (m, offset)))
            .collect();
        Ok(Self {
            payload: Arc::new(payload),
            tensors,
        })
    }

    /// The tensor `name`, sharing the payload (no copy).
    fn get(&self, name: &str) -> Option<TensorData> {
        let (meta, offset) = self.tensors.get(name)?;
        let bytes = bytes::Bytes::from_owner(SharedPayload(Arc::clone(&self.payload)));
        Some(TensorData::new(
            meta.dtype,
            meta.shape.clone(),
            bytes.slice(*offset..offset + meta.len),
        ))
    }
}

/// How far past the newest stored step a Put may be: workers skip the copies of the steps that
/// end while their previous copy is still in flight, so consecutive copies can be many steps
/// apart (a copy of seconds behind steps of milliseconds); a forged far-future step stays out.
const MAX_STEP_GAP: u64 = 1 << 16;

/// How many evicted payload buffers an agent keeps for reuse.
const POOLED_BUFFERS: usize = 8;

/// The copies an agent holds: step → name → tensor.
///
/// Every Put is a peer's claim: it is stored only while a plan is known ([`SnapshotStore::plan`]),
/// its payload within the plan's bound, and its step one the plan can reach next (from the
/// step before the plan's first to [`MAX_STEP_GAP`] past the newest stored), so that a forged
/// far-future step can neither pin the store nor evict the real copies.
///
/// The payloads of an evicted step go to a pool that the next Puts are received into: in a steady
/// run an agent holds its two newest steps plus one step's worth of buffers, and allocates (and
/// page-faults) nothing per step.
#[derive(Default)]
pub struct SnapshotStore {
    /// step → the Puts of that step, in arrival order (a later Put of a name shadows an earlier).
    steps: BTreeMap<u64, Vec<Parcel>>,
    bounds: Option<PutBounds>,
    /// The newest step stored under the current plan.
    newest: Option<u64>,
    /// Buffers of evicted steps, for the next Puts to be received into.
    pool: Vec<Vec<u8>>,
}

impl SnapshotStore {
    /// Adopts the bounds of the plan the agent was just told of (a replacement worker of the
    /// same generation keeps the newest step stored so far).
    pub fn plan(&mut self, bounds: PutBounds) {
        if self
            .bounds
            .is_none_or(|b| b.generation != bounds.generation)
        {
            self.newest = None;
        }
        self.bounds = Some(bounds);
    }

    /// The frame limits a connection reads its next request within: no payload before a plan
    /// is known (Gets carry none).
    fn limits(&self) -> Limits {
        Limits {
            header: PutBounds::MAX_HEADER,
            payload: self.bounds.map_or(0, |b| b.max_payload),
        }
    }

    /// Why a Put of `step` is refused, if it is.
    fn refusal(&self, step: u64) -> Option<String> {
        let Some(bounds) = self.bounds else {
            return Some(format!(
                "a peer snapshot of step {step} before this agent was given a plan"
            ));
        };
        let lowest = bounds.first_step.saturating_sub(1);
        let highest = self
            .newest
            .unwrap_or(lowest)
            .max(bounds.first_step)
            .saturating_add(MAX_STEP_GAP);
        (step < lowest || step > highest).then(|| {
            format!(
                "a peer snapshot of step {step}, outside the steps the plan of generation {} can \
                 store now ({lowest}..={highest})",
                bounds.generation
            )
        })
    }

    /// A buffer to receive a payload of `len` bytes into: the smallest pooled one that holds it
    /// (its pages are already mapped), else a fresh one that grows as the bytes arrive.
    fn buffer_for(&mut self, len: u64) -> Vec<u8> {
        let fits = self
            .pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() as u64 >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        match fits {
            Some(i) => self.pool.swap_remove(i),
            None => Vec::new(),
        }
    }

    /// Gives a buffer back (a Put that was refused or failed to parse).
    fn recycle(&mut self, mut buffer: Vec<u8>) {
        if buffer.capacity() == 0 {
            return;
        }
        buffer.clear();
        self.pool.push(buffer);
        if self.pool.len() > POOLED_BUFFERS {
            let smallest = self
                .pool
                .iter()
                .enumerate()
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i)
                .expect("not empty");
            self.pool.swap_remove(smallest);
        }
    }

    fn put(&mut self, step: u64, parcel: Parcel) {
        self.newest = self.newest.max(Some(step));
        let parcels = self.steps.entry(step).or_default();
        // A name put again (a replacement worker's copy) shadows the earlier one; a parcel
        // left with nothing visible is dropped.
        for old in parcels.iter_mut() {
            old.tensors
                .retain(|name, _| !parcel.tensors.contains_key(name));
        }
        let (kept, shadowed): (Vec<Parcel>, Vec<Parcel>) = std::mem::take(parcels)
            .into_iter()
            .partition(|p| !p.tensors.is_empty());
        *parcels = kept;
        parcels.push(parcel);
        let mut evicted: Vec<Parcel> = shadowed;
        while self.steps.len() > KEPT_STEPS {
            if let Some((_, parcels)) = self.steps.pop_first() {
                evicted.extend(parcels);
            }
        }
        for parcel in evicted {
            // A Get still sending from it keeps it alive: then it is simply freed later.
            if let Ok(buffer) = Arc::try_unwrap(parcel.payload) {
                self.recycle(buffer);
            }
        }
    }

    /// The tensors `names` of `step` that are held.
    fn get(&self, step: u64, names: &[String]) -> Vec<(String, TensorData)> {
        let Some(parcels) = self.steps.get(&step) else {
            return Vec::new();
        };
        names
            .iter()
            .filter_map(|n| {
                parcels
                    .iter()
                    .rev()
                    .find_map(|p| p.get(n))
                    .map(|t| (n.clone(), t))
            })
            .collect()
    }

    /// What is held: step → names.
    pub fn held(&self) -> Vec<(u64, Vec<String>)> {
        self.steps
            .iter()
            .map(|(step, parcels)| {
                let names: BTreeSet<String> = parcels
                    .iter()
                    .flat_map(|p| p.tensors.keys().cloned())
                    .collect();
                (*step, names.into_iter().collect())
            })
            .collect()
    }

    /// Bytes held, for the log.
    fn bytes(&self) -> usize {
        self.steps.values().flatten().map(|p| p.payload.len()).sum()
    }
}

/// Serves an agent's snapshot port: authenticated workers put and get copies. `on_stored` is told
/// the step and names of every completed put (the agent reports them to the coordinator).
pub fn serve(
    listener: TcpListener,
    token: String,
    store: Arc<Mutex<SnapshotStore>>,
    on_stored: impl Fn(u64, Vec<String>) + Send + Sync + 'static,
) -> std::io::Result<Gate> {
    Gate::start(
        "snapshot",
        listener,
        token,
        Purpose::Snapshot,
        move |stream, peer| {
            if let Err(e) = serve_connection(stream, &store, &on_stored) {
                debug!(%peer, error = %e, "snapshot connection ended");
            }
        },
    )
}

fn serve_connection(
    stream: TcpStream,
    store: &Mutex<SnapshotStore>,
    on_stored: &dyn Fn(u64, Vec<String>),
) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = BufWriter::new(stream);
    let lock = || store.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let limits = lock().limits();
        let frame = read_frame_into(&mut reader, limits, |len| lock().buffer_for(len))?;
        match frame.header::<Request>()? {
            Request::Put { step, tensors } => {
                let refusal = lock().refusal(step);
                if let Some(why) = refusal {
                    lock().recycle(frame.payload);
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("refused {why}"),
                    ));
                }
                let parcel = Parcel::new(tensors, frame.payload)?;
                let names: Vec<String> = parcel.tensors.keys().cloned().collect();
                let bytes = {
                    let mut store = lock();
                    store.put(step, parcel);
                    store.bytes()
                };
                debug!(
                    step,
                    tensors = names.len(),
                    held_bytes = bytes,
                    "peer snapshot stored"
                );
                // Reported before the answer: once a worker hears "stored", so does the coordinator.
                on_stored(step, names);
                write_frame(&mut writer, &Frame::new(&Reply::Stored, Vec::new()))?;
            }
            Request::Get { step, names } => {
                let found = lock().get(step, &names);
                let reply = Reply::Tensors {
                    tensors: metas(&found),
                };
                write_tensors(&mut writer, &reply, &found)?;
            }
        }
    }
}

/// An authenticated connection to an agent's snapshot port.
struct Peer {
    addr: String,
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

impl Peer {
    fn connect(
        addr: &str,
        token: &str,
        timeout: Duration,
        switch: Option<&KillSwitch>,
    ) -> std::io::Result<Self> {
        use std::net::ToSocketAddrs;
        let sock = addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| std::io::Error::other(format!("{addr} resolves to nothing")))?;
        let mut stream = TcpStream::connect_timeout(&sock, timeout)?;
        if let Some(switch) = switch {
            switch.register(&stream)?;
        }
        stream.set_read_timeout(Some(timeout))?;
        stream.set_nodelay(true)?;
        auth::connect(&mut stream, token, Purpose::Snapshot)?;
        Ok(Self {
            addr: addr.to_string(),
            reader: BufReader::new(stream.try_clone()?),
            writer: BufWriter::new(stream),
        })
    }

    /// Sends `request` with `payload` (the bytes of the tensors its header describes); the
    /// answer, read within `limits` (what the request can bring back, never more).
    fn call(
        &mut self,
        request: &Request,
        payload: &[&[u8]],
        limits: Limits,
    ) -> std::io::Result<(Reply, Vec<u8>)> {
        let header = serde_json::to_vec(request).map_err(std::io::Error::other)?;
        write_frame_parts(&mut self.writer, &header, payload)?;
        let frame = read_frame(&mut self.reader, limits)?;
        Ok((frame.header()?, frame.payload))
    }
}

/// What an agent may answer to a Put: "stored", no payload.
const PUT_REPLY: Limits = Limits {
    header: 4 << 10,
    payload: 0,
};

/// A stage's state serialized for the agents: the tensors' metadata and their bytes, one after
/// the other, in a buffer reused from copy to copy (its pages stay mapped: no allocation and no
/// page faults per step).
#[derive(Default)]
struct Packed {
    metas: Vec<TensorMeta>,
    bytes: Vec<u8>,
}

impl Packed {
    /// Serializes `tensors` (host tensors: a CPU stage's own, a GPU stage's downloaded copy)
    /// little-endian, reading each contiguous tensor in place.
    fn pack(&mut self, tensors: &[(String, candle_core::Tensor)]) -> Result<(), String> {
        use candle_core::{CpuStorage, DType, Storage};
        self.metas.clear();
        self.bytes.clear();
        let total: usize = tensors
            .iter()
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        self.bytes.reserve(total);
        for (name, t) in tensors {
            let start = self.bytes.len();
            let dtype = match t.dtype() {
                DType::F32 => Dtype::F32,
                DType::F64 => Dtype::F64,
                other => return Err(format!("tensor `{name}`: {other:?} cannot be copied")),
            };
            let in_place = {
                let (storage, layout) = t.storage_and_layout();
                match (&*storage, layout.contiguous_offsets()) {
                    (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => {
                        v[a..b]
                            .iter()
                            .for_each(|x| self.bytes.extend_from_slice(&x.to_le_bytes()));
                        true
                    }
                    (Storage::Cpu(CpuStorage::F64(v)), Some((a, b))) => {
                        v[a..b]
                            .iter()
                            .for_each(|x| self.bytes.extend_from_slice(&x.to_le_bytes()));
                        true
                    }
                    _ => false,
                }
            };
            if !in_place {
                let data = to_tensor_data(t).map_err(|e| format!("tensor `{name}`: {e}"))?;
                self.bytes.extend_from_slice(&data.data);
            }
            self.metas.push(TensorMeta {
                name: name.clone(),
                dtype,
                shape: t.dims().to_vec(),
                len: self.bytes.len() - start,
            });
        }
        Ok(())
    }
}

/// A copy of a stage's state waiting to be sent.
struct CopyJob {
    step: u64,
    snapshot: StateSnapshot,
}

/// The worker's background sender of peer snapshots: at most one copy in flight. A copy asked
/// for while the previous one is still being sent is skipped, not queued, so copies never hold
/// up training nor pile up behind a slow network.
pub struct PeerCopier {
    jobs: Sender<CopyJob>,
    /// Set while a copy is being sent (from [`PeerCopier::copy`] until every destination
    /// answered or failed).
    busy: Arc<AtomicBool>,
    /// Copies skipped because the previous one was still in flight.
    skipped: AtomicU64,
    /// The newest step stored on every destination (0: none yet).
    stored: Arc<AtomicU64>,
}

impl PeerCopier {
    /// Starts the sender thread for `destinations` (agents' snapshot addresses); with a kill
    /// switch (in-process tests), its connections die with the worker.
    pub fn start(
        destinations: Vec<String>,
        token: String,
        timeout: Duration,
        switch: Option<KillSwitch>,
    ) -> std::io::Result<Self> {
        let (jobs, queue) = channel::<CopyJob>();
        let busy = Arc::new(AtomicBool::new(false));
        let stored = Arc::new(AtomicU64::new(0));
        let (in_flight, newest) = (Arc::clone(&busy), Arc::clone(&stored));
        std::thread::Builder::new()
            .name("peer-copy".into())
            .spawn(move || {
                let mut peers: BTreeMap<String, Peer> = BTreeMap::new();
                let mut packed = Packed::default();
                for CopyJob { step, snapshot } in queue {
                    let started = Instant::now();
                    let packing = snapshot
                        .tensors()
                        .map_err(|e| e.to_string())
                        .and_then(|tensors| packed.pack(&tensors));
                    if let Err(error) = packing {
                        warn!(step, %error, "cannot read the state for a peer snapshot");
                        in_flight.store(false, Ordering::SeqCst);
                        continue;
                    }
                    // The snapshot's own copy (a GPU's download) is not needed any more.
                    drop(snapshot);
                    let request = Request::Put {
                        step,
                        tensors: packed.metas.clone(),
                    };
                    let mut everywhere = true;
                    for addr in &destinations {
                        let result = match peers.remove(addr) {
                            Some(p) => Ok(p),
                            None => Peer::connect(addr, &token, timeout, switch.as_ref()),
                        }
                        .and_then(|mut p| {
                            p.call(&request, &[&packed.bytes], PUT_REPLY)
                                .map(|r| (p, r))
                        });
                        match result {
                            Ok((peer, (Reply::Stored, _))) => {
                                peers.insert(addr.clone(), peer);
                            }
                            Ok((_, (other, _))) => {
                                everywhere = false;
                                warn!(%addr, ?other, "unexpected answer to a peer snapshot")
                            }
                            Err(e) => {
                                everywhere = false;
                                warn!(%addr, step, error = %e, "peer snapshot not stored")
                            }
                        }
                    }
                    if everywhere {
                        newest.fetch_max(step, Ordering::SeqCst);
                    }
                    debug!(
                        step,
                        bytes = packed.bytes.len(),
                        seconds = started.elapsed().as_secs_f64(),
                        "peer snapshots sent"
                    );
                    in_flight.store(false, Ordering::SeqCst);
                }
            })?;
        Ok(Self {
            jobs,
            busy,
            skipped: AtomicU64::new(0),
            stored,
        })
    }

    /// Whether a copy is still being sent (a new one would be skipped).
    pub fn busy(&self) -> bool {
        self.busy.load(Ordering::SeqCst)
    }

    /// Waits until no copy is in flight, at most `timeout`: whether none is.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(100);
        while self.busy() {
            let now = Instant::now();
            if now >= deadline {
                warn!("the previous peer snapshot is still in flight after {timeout:?}");
                return false;
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(20));
        }
        true
    }

    /// Copies skipped so far because the previous one was still in flight.
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::SeqCst)
    }

    /// The newest step this worker's copy reached every agent with (0 before any).
    pub fn stored_step(&self) -> u64 {
        self.stored.load(Ordering::SeqCst)
    }

    /// Counts the copy of `step` as skipped (the previous one is still in flight).
    pub fn skip(&self, step: u64) {
        self.skipped.fetch_add(1, Ordering::SeqCst);
        debug!(
            step,
            "the previous peer snapshot is still in flight; this step's is skipped"
        );
    }

    /// Sends the state after `step` behind the training (the tensors are immutable: nothing is
    /// copied here), unless the previous copy is still in flight: then this one is skipped and
    /// `false` returned.
    pub fn copy(&self, step: u64, snapshot: StateSnapshot) -> bool {
        if self.busy.swap(true, Ordering::SeqCst) {
            self.skip(step);
            return false;
        }
        if self.jobs.send(CopyJob { step, snapshot }).is_err() {
            self.busy.store(false, Ordering::SeqCst);
            warn!(
                step,
                "the peer-copy thread stopped; no peer snapshot of this step"
            );
            return false;
        }
        true
    }
}

/// The bytes a tensor of `shape` takes at most in a snapshot (F32, the state's dtype), or `None`
/// when that overflows.
fn state_tensor_bytes(shape: &[usize]) -> Option<u64> {
    shape
        .iter()
        .try_fold(4u64, |acc, &d| acc.checked_mul(d as u64))
}

/// Fetches the tensors `wanted` (name, shape) of `step` from the agents at `sources` (in order,
/// each asked for what is still missing). An answer may carry only what was asked for: its
/// payload is bounded by the missing tensors' sizes before it is read, and every tensor must be
/// one asked for, with its shape. Errors name what could not be found.
pub fn fetch(
    sources: &[String],
    step: u64,
    wanted: &[(String, Vec<usize>)],
    token: &str,
    timeout: Duration,
) -> Result<Vec<(String, TensorData)>, String> {
    let shapes: BTreeMap<&str, &[usize]> = wanted
        .iter()
        .map(|(n, s)| (n.as_str(), s.as_slice()))
        .collect();
    let mut missing: BTreeSet<String> = wanted.iter().map(|(n, _)| n.clone()).collect();
    let mut found = Vec::with_capacity(wanted.len());
    for addr in sources {
        if missing.is_empty() {
            break;
        }
        let limits = Limits {
            header: PutBounds::MAX_HEADER,
            payload: missing
                .iter()
                .map(|n| state_tensor_bytes(shapes[n.as_str()]).unwrap_or(u64::MAX))
                .fold(0u64, u64::saturating_add),
        };
        let request = Request::Get {
            step,
            names: missing.iter().cloned().collect(),
        };
        let reply = Peer::connect(addr, token, timeout, None).and_then(|mut p| {
            let (reply, payload) = p.call(&request, &[], limits)?;
            Ok((p.addr, reply, payload))
        });
        match reply {
            Ok((addr, Reply::Tensors { tensors }, payload)) => {
                let tensors = unpack(tensors, payload).map_err(|e| format!("{addr}: {e}"))?;
                info!(%addr, step, tensors = tensors.len(), "fetched peer snapshot tensors");
                for (name, t) in tensors {
                    if !missing.remove(&name) {
                        return Err(format!(
                            "{addr} sent tensor `{name}` of step {step}, which was not asked for \
                             (or twice)"
                        ));
                    }
                    if shapes[name.as_str()] != t.shape.as_slice() {
                        return Err(format!(
                            "{addr} sent tensor `{name}` of step {step} with shape {:?}; the \
                             plan's model has {:?}",
                            t.shape,
                            shapes[name.as_str()]
                        ));
                    }
                    found.push((name, t));
                }
            }
            Ok((addr, other, _)) => warn!(%addr, ?other, "unexpected answer to a snapshot fetch"),
            Err(e) => warn!(%addr, error = %e, "cannot fetch from this agent"),
        }
    }
    if missing.is_empty() {
        Ok(found)
    } else {
        Err(format!(
            "the agents {sources:?} do not hold {} tensor(s) of step {step}, e.g. {}",
            missing.len(),
            missing.iter().next().expect("not empty")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(values: &[f32]) -> TensorData {
        TensorData::new(
            Dtype::F32,
            vec![values.len()],
            values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
    }

    /// Lengths and shapes are a peer's claims: ones that overflow, overlap the end of the payload
    /// or disagree with the dtype are refused, never a panic.
    #[test]
    fn unpack_checks_every_claimed_length_and_shape() {
        let meta = |name: &str, shape: Vec<usize>, len: usize| TensorMeta {
            name: name.into(),
            dtype: Dtype::F32,
            shape,
            len,
        };
        let payload = vec![0u8; 12];
        assert!(unpack(vec![meta("a", vec![3], 12)], payload.clone()).is_ok());
        for metas in [
            // The review's attack: an offset near 2^64 after the first tensor.
            vec![meta("a", vec![1], 4), meta("b", vec![1], usize::MAX - 3)],
            vec![meta("a", vec![4], 16)],
            vec![meta("a", vec![usize::MAX, usize::MAX], 12)],
            vec![meta("a", vec![2], 12)],
            vec![meta("a", vec![2], 8)],
        ] {
            let err = unpack(metas.clone(), payload.clone()).unwrap_err();
            assert_eq!(
                err.kind(),
                std::io::ErrorKind::InvalidData,
                "{metas:?}: {err}"
            );
        }
    }

    /// A snapshot port that accepts connections and never answers: a copy to it stays in flight
    /// until the connection is dropped.
    fn silent_agent() -> (String, std::sync::mpsc::Receiver<TcpStream>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                if tx.send(stream).is_err() {
                    break;
                }
            }
        });
        (addr, rx)
    }

    fn one_tensor_snapshot(value: f32) -> StateSnapshot {
        StateSnapshot::ready(vec![(
            "a".into(),
            candle_core::Tensor::new(&[value, 1.0f32], &candle_core::Device::Cpu).unwrap(),
        )])
    }

    /// The GPU run of 2026-11-26: copies slower than a step queued up and the worker waited for
    /// them (steps 4x slower). At most one copy is in flight: one asked for meanwhile is skipped
    /// (counted), never queued nor waited for, and once the copy in flight ends the next goes.
    #[test]
    fn a_copy_asked_for_while_one_is_in_flight_is_skipped_not_queued() {
        let (addr, accepted) = silent_agent();
        let copier =
            PeerCopier::start(vec![addr], "t".into(), Duration::from_secs(120), None).unwrap();
        assert!(!copier.busy());
        assert!(copier.copy(1, one_tensor_snapshot(1.0)));
        let connection = accepted.recv_timeout(Duration::from_secs(60)).unwrap();
        let started = Instant::now();
        assert!(copier.busy());
        assert!(
            !copier.copy(2, one_tensor_snapshot(2.0)),
            "queued behind the copy in flight"
        );
        assert!(!copier.copy(3, one_tensor_snapshot(3.0)));
        assert_eq!(copier.skipped(), 2);
        assert!(started.elapsed() < Duration::from_secs(30), "copy() waited");
        // The agent goes away: the copy in flight fails (never stored), and the copier is free.
        drop(connection);
        let deadline = Instant::now() + Duration::from_secs(60);
        while copier.busy() {
            assert!(Instant::now() < deadline, "the failed copy never ended");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(copier.stored_step(), 0);
        assert!(copier.copy(4, one_tensor_snapshot(4.0)));
        assert_eq!(copier.skipped(), 2);
    }

    /// The copier serializes into one buffer it reuses, and what it sends is what the agent
    /// serves back.
    #[test]
    fn a_copy_reaches_every_agent_and_reuses_its_buffer() {
        let (a, store_a, _gate_a) = served(Some(PutBounds::for_plan(1, 1, 1000)));
        let (b, store_b, _gate_b) = served(Some(PutBounds::for_plan(1, 1, 1000)));
        let copier = PeerCopier::start(
            vec![a.clone(), b.clone()],
            "secret".into(),
            Duration::from_secs(60),
            None,
        )
        .unwrap();
        for step in 1..=3u64 {
            assert!(copier.copy(step, one_tensor_snapshot(step as f32)));
            let deadline = Instant::now() + Duration::from_secs(60);
            while copier.busy() {
                assert!(
                    Instant::now() < deadline,
                    "the copy of step {step} never ended"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(copier.stored_step(), step);
        }
        assert_eq!(held_steps(&store_a), [2, 3]);
        assert_eq!(held_steps(&store_b), [2, 3]);
        let wanted = vec![("a".to_string(), vec![2])];
        let got = fetch(&[b], 3, &wanted, "secret", Duration::from_secs(60)).unwrap();
        assert_eq!(got[0].1.data, tensor(&[3.0, 1.0]).data);
        // Step 1's buffer was evicted into the pool, and step 4 is received into it.
        let pooled = store_a.lock().unwrap().pool.len();
        assert_eq!(pooled, 1);
        assert!(copier.copy(4, one_tensor_snapshot(4.0)));
        while copier.busy() {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(held_steps(&store_a), [3, 4]);
        assert_eq!(
            store_a.lock().unwrap().pool.len(),
            1,
            "a fresh buffer per step"
        );
    }

    #[test]
    fn agents_keep_the_two_newest_steps_and_serve_what_they_hold() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let store = Arc::new(Mutex::new(SnapshotStore::default()));
        store.lock().unwrap().plan(PutBounds::for_plan(1, 1, 1000));
        let reports = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&reports);
        // The port accepts while the gate lives.
        let _gate = serve(
            listener,
            "secret".into(),
            Arc::clone(&store),
            move |step, names| seen.lock().unwrap().push((step, names.len())),
        )
        .unwrap();
        let timeout = Duration::from_secs(5);
        let mut peer = Peer::connect(&addr, "secret", timeout, None).unwrap();
        for step in 1..=3u64 {
            let tensors = [
                ("a".into(), tensor(&[step as f32, 1.0])),
                ("b".into(), tensor(&[2.0])),
            ];
            let (reply, _) = peer
                .call(
                    &Request::Put {
                        step,
                        tensors: metas(&tensors),
                    },
                    &parts(&tensors),
                    PUT_REPLY,
                )
                .unwrap();
            assert!(matches!(reply, Reply::Stored));
        }
        let held: Vec<u64> = store
            .lock()
            .unwrap()
            .held()
            .iter()
            .map(|(s, _)| *s)
            .collect();
        assert_eq!(held, [2, 3]);
        assert_eq!(*reports.lock().unwrap(), [(1, 2), (2, 2), (3, 2)]);
        let names = vec![("a".to_string(), vec![2]), ("b".to_string(), vec![1])];
        let got = fetch(std::slice::from_ref(&addr), 3, &names, "secret", timeout).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].1.data, tensor(&[3.0, 1.0]).data);
        let err = fetch(std::slice::from_ref(&addr), 1, &names, "secret", timeout).unwrap_err();
        assert!(err.contains("do not hold 2 tensor(s) of step 1"), "{err}");
        // The wrong token gets nothing.
        assert!(fetch(&[addr], 3, &names, "wrong", timeout).is_err());
    }

    /// A store served on a fresh port, with the plan `bounds` (if any).
    fn served(bounds: Option<PutBounds>) -> (String, Arc<Mutex<SnapshotStore>>, Gate) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let store = Arc::new(Mutex::new(SnapshotStore::default()));
        if let Some(bounds) = bounds {
            store.lock().unwrap().plan(bounds);
        }
        let gate = serve(listener, "secret".into(), Arc::clone(&store), |_, _| {}).unwrap();
        (addr, store, gate)
    }

    fn put(peer: &mut Peer, step: u64, value: f32) -> std::io::Result<Reply> {
        let tensors = [("a".to_string(), tensor(&[value, 1.0]))];
        let request = Request::Put {
            step,
            tensors: metas(&tensors),
        };
        peer.call(&request, &parts(&tensors), PUT_REPLY)
            .map(|(reply, _)| reply)
    }

    fn held_steps(store: &Mutex<SnapshotStore>) -> Vec<u64> {
        store
            .lock()
            .unwrap()
            .held()
            .iter()
            .map(|(s, _)| *s)
            .collect()
    }

    /// Issue 35: Puts for steps 2^64-1 and 2^64-2 pinned the store and evicted the real copies.
    /// Only the steps the plan can reach next are stored: forged far-future (and stale) steps are
    /// refused and the real snapshots survive; before any plan nothing is stored.
    #[test]
    fn forged_steps_are_refused_and_real_snapshots_survive() {
        let timeout = Duration::from_secs(30);
        let (addr, store, _gate) = served(None);
        let mut peer = Peer::connect(&addr, "secret", timeout, None).unwrap();
        assert!(put(&mut peer, 5, 5.0).is_err(), "a Put before any plan");
        assert!(held_steps(&store).is_empty());

        store.lock().unwrap().plan(PutBounds::for_plan(3, 5, 1000));
        let mut peer = Peer::connect(&addr, "secret", timeout, None).unwrap();
        for step in [4, 5, 6] {
            assert!(matches!(
                put(&mut peer, step, step as f32).unwrap(),
                Reply::Stored
            ));
        }
        assert_eq!(held_steps(&store), [5, 6]);
        // Copies may skip steps (one in flight at a time), but not beyond the gap.
        for forged in [u64::MAX, u64::MAX - 1, 6 + MAX_STEP_GAP + 1, 3] {
            let mut peer = Peer::connect(&addr, "secret", timeout, None).unwrap();
            assert!(
                put(&mut peer, forged, -1.0).is_err(),
                "a Put of step {forged} was stored"
            );
            assert_eq!(held_steps(&store), [5, 6], "after a Put of step {forged}");
        }
        let names = vec![("a".to_string(), vec![2])];
        let got = fetch(std::slice::from_ref(&addr), 6, &names, "secret", timeout).unwrap();
        assert_eq!(got[0].1.data, tensor(&[6.0, 1.0]).data);
        // Training goes on (skipping copies: step 7's was): the next copy is stored and evicts
        // the oldest as always.
        let mut peer = Peer::connect(&addr, "secret", timeout, None).unwrap();
        assert!(matches!(put(&mut peer, 8, 8.0).unwrap(), Reply::Stored));
        assert_eq!(held_steps(&store), [6, 8]);
        // A replacement worker of the same plan keeps the window; a new plan starts its own.
        store.lock().unwrap().plan(PutBounds::for_plan(3, 5, 1000));
        assert!(matches!(put(&mut peer, 9, 9.0).unwrap(), Reply::Stored));
        store
            .lock()
            .unwrap()
            .plan(PutBounds::for_plan(4, 2, 1 << 20));
        assert!(put(&mut peer, 9 + MAX_STEP_GAP, 9.0).is_err());
    }

    /// Issue 35: a peer with the token claimed a 64 GiB frame and sent 1.5 GiB of it, and the
    /// agent grew by 3.7 GB. A claim over the plan's bound (the largest stage's state) is refused
    /// from the frame's prefix: the agent closes the connection without reading (or allocating
    /// for) the payload, and a claim within the bound that is cut short costs what was sent.
    #[test]
    fn a_frame_over_the_plans_bound_is_refused_before_its_payload() {
        use std::io::Read;
        // A stage of 1000 parameters: 16 KB + 1 MiB of slack.
        let bounds = PutBounds::for_plan(1, 1, 1000);
        assert_eq!(bounds.max_payload, 16_000 + (1 << 20));
        let (addr, store, _gate) = served(Some(bounds));
        for claimed in [64u64 << 30, bounds.max_payload + 1] {
            let mut stream = TcpStream::connect(&addr).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(60)))
                .unwrap();
            auth::connect(&mut stream, "secret", Purpose::Snapshot).unwrap();
            let header = serde_json::to_vec(&Request::Put {
                step: 1,
                tensors: vec![],
            })
            .unwrap();
            let mut prefix = Vec::new();
            prefix.extend_from_slice(b"SQP1");
            prefix.extend_from_slice(&(header.len() as u32).to_le_bytes());
            prefix.extend_from_slice(&claimed.to_le_bytes());
            prefix.extend_from_slice(&header);
            // The first bytes of the payload, then silence: the agent must not wait for more.
            prefix.extend_from_slice(&[0u8; 4096]);
            stream.write_all(&prefix).unwrap();
            let mut answer = Vec::new();
            match stream.read_to_end(&mut answer) {
                Ok(_) => assert!(answer.is_empty(), "the agent answered a {claimed} B claim"),
                Err(e) => assert!(
                    !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ),
                    "the agent is still reading a {claimed} B claim: {e}"
                ),
            }
        }
        assert!(held_steps(&store).is_empty());
        // Before a plan, no payload at all.
        assert_eq!(SnapshotStore::default().limits().payload, 0);
    }

    /// Issue 35: a worker read an agent's answer to a Get within 64 GiB, whatever it asked for. An
    /// answer is bounded by the requested tensors' sizes: a claim over them is refused from the
    /// frame's prefix (nothing read or allocated for it), and a tensor of another shape than the
    /// plan's is refused too.
    #[test]
    fn a_fetch_reads_no_more_than_it_asked_for() {
        use std::io::Read;
        // A forged agent: authenticates, reads the Get, claims a 64 GiB answer and sends 4 KiB.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let _forger = Gate::start(
            "forged-snapshot",
            listener,
            "secret".into(),
            Purpose::Snapshot,
            |mut stream, _| {
                let _ = read_frame(&mut stream, Limits::CONTROL);
                let header = serde_json::to_vec(&Reply::Tensors { tensors: vec![] }).unwrap();
                let mut prefix = Vec::new();
                prefix.extend_from_slice(b"SQP1");
                prefix.extend_from_slice(&(header.len() as u32).to_le_bytes());
                prefix.extend_from_slice(&(64u64 << 30).to_le_bytes());
                prefix.extend_from_slice(&header);
                prefix.extend_from_slice(&[0u8; 4096]);
                let _ = stream.write_all(&prefix);
                // Then silence, the connection open: the worker must not wait for the rest.
                let mut rest = Vec::new();
                let _ = stream.read_to_end(&mut rest);
            },
        )
        .unwrap();
        let wanted = vec![("a".to_string(), vec![2])];
        let started = Instant::now();
        let err = fetch(&[addr], 3, &wanted, "secret", Duration::from_secs(120)).unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the worker waited for a 64 GiB answer"
        );
        assert!(err.contains("do not hold 1 tensor(s) of step 3"), "{err}");

        // A real agent holding a bigger tensor than the plan's: refused, not loaded.
        let (real, _store, _gate) = served(Some(PutBounds::for_plan(1, 1, 1000)));
        let mut peer = Peer::connect(&real, "secret", Duration::from_secs(30), None).unwrap();
        assert!(matches!(put(&mut peer, 1, 1.0).unwrap(), Reply::Stored));
        let smaller = vec![("a".to_string(), vec![1])];
        assert!(
            fetch(
                std::slice::from_ref(&real),
                1,
                &smaller,
                "secret",
                Duration::from_secs(30)
            )
            .is_err()
        );
        let wider = vec![("a".to_string(), vec![1, 2])];
        let err = fetch(&[real], 1, &wider, "secret", Duration::from_secs(30)).unwrap_err();
        assert!(err.contains("with shape [2]"), "{err}");
    }
}
