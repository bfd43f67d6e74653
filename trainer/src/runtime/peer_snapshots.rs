//! Tier-1 recovery state: after every step each worker copies its stage's state (parameters and
//! AdamW moments, under their global names) into the memory of two agents — its own node's and its
//! buddy node's — off the critical path. When nodes are lost, the new pipeline's workers fetch their
//! layers' state from the surviving agents instead of the object store, and only the interrupted
//! step is redone.
//!
//! Agents keep the copies of the two newest steps (the newest may be incomplete when a failure
//! strikes during the copy) and report what they hold to the coordinator, which restores from the
//! newest step that the live agents cover completely.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufReader, BufWriter, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use checkpoint::{Dtype, TensorData};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use super::auth::{self, Gate, Purpose};
use super::kill_switch::KillSwitch;
use super::wire::{Frame, Limits, read_frame, write_frame, write_frame_parts};
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

/// Splits a payload into its tensors. Every number in `metas` is the peer's claim: lengths must
/// add up to the payload exactly and match each tensor's shape and dtype, with checked arithmetic.
fn unpack(metas: Vec<TensorMeta>, payload: Vec<u8>) -> std::io::Result<Vec<(String, TensorData)>> {
    let bad = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let payload = bytes::Bytes::from(payload);
    let mut offset = 0usize;
    let mut out = Vec::with_capacity(metas.len().min(1 << 16));
    for m in metas {
        let end = offset
            .checked_add(m.len)
            .filter(|&end| end <= payload.len())
            .ok_or_else(|| {
                bad(format!(
                    "snapshot payload of {} B too short for tensor `{}` ({} B at offset {offset})",
                    payload.len(),
                    m.name,
                    m.len
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
        out.push((
            m.name,
            TensorData::new(m.dtype, m.shape, payload.slice(offset..end)),
        ));
        offset = end;
    }
    if offset != payload.len() {
        return Err(bad(format!(
            "snapshot payload has {} B beyond its tensors",
            payload.len() - offset
        )));
    }
    Ok(out)
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

/// The copies an agent holds: step → name → tensor.
///
/// Every Put is a peer's claim: it is stored only while a plan is known ([`SnapshotStore::plan`]),
/// its payload within the plan's bound, and its step one the plan can reach next (from the
/// step before the plan's first to one past the newest stored), so that a forged far-future
/// step can neither pin the store nor evict the real copies.
#[derive(Default)]
pub struct SnapshotStore {
    steps: BTreeMap<u64, BTreeMap<String, TensorData>>,
    bounds: Option<PutBounds>,
    /// The newest step stored under the current plan.
    newest: Option<u64>,
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
            .saturating_add(1);
        (step < lowest || step > highest).then(|| {
            format!(
                "a peer snapshot of step {step}, outside the steps the plan of generation {} can \
                 store now ({lowest}..={highest})",
                bounds.generation
            )
        })
    }

    fn put(&mut self, step: u64, tensors: Vec<(String, TensorData)>) {
        self.newest = self.newest.max(Some(step));
        self.steps.entry(step).or_default().extend(tensors);
        while self.steps.len() > KEPT_STEPS {
            self.steps.pop_first();
        }
    }

    /// What is held: step → names.
    pub fn held(&self) -> Vec<(u64, Vec<String>)> {
        self.steps
            .iter()
            .map(|(step, tensors)| (*step, tensors.keys().cloned().collect()))
            .collect()
    }

    /// Bytes held, for the log.
    fn bytes(&self) -> usize {
        self.steps
            .values()
            .flat_map(|t| t.values())
            .map(|t| t.data.len())
            .sum()
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
    loop {
        let limits = store.lock().unwrap_or_else(|p| p.into_inner()).limits();
        let frame = read_frame(&mut reader, limits)?;
        match frame.header::<Request>()? {
            Request::Put { step, tensors } => {
                let refusal = store
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .refusal(step);
                if let Some(why) = refusal {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("refused {why}"),
                    ));
                }
                let tensors = unpack(tensors, frame.payload)?;
                let names: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
                let bytes = {
                    let mut store = store.lock().unwrap_or_else(|p| p.into_inner());
                    store.put(step, tensors);
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
                let found: Vec<(String, TensorData)> = {
                    let store = store.lock().unwrap_or_else(|p| p.into_inner());
                    store
                        .steps
                        .get(&step)
                        .map(|held| {
                            names
                                .iter()
                                .filter_map(|n| held.get(n).map(|t| (n.clone(), t.clone())))
                                .collect()
                        })
                        .unwrap_or_default()
                };
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

    /// Sends `request` with the bytes of `tensors` as its payload; the answer.
    fn call(
        &mut self,
        request: &Request,
        tensors: &[(String, TensorData)],
    ) -> std::io::Result<(Reply, Vec<u8>)> {
        write_tensors(&mut self.writer, request, tensors)?;
        let frame = read_frame(&mut self.reader, Limits::SNAPSHOT)?;
        Ok((frame.header()?, frame.payload))
    }
}

/// A copy of a stage's state waiting to be sent.
struct CopyJob {
    step: u64,
    snapshot: StateSnapshot,
}

/// The worker's background sender of peer snapshots.
pub struct PeerCopier {
    jobs: Sender<CopyJob>,
    /// The newest step whose copy was attempted (stored, or given up on with a warning).
    attempted: Arc<(Mutex<u64>, Condvar)>,
    /// The newest step queued here (a replacement worker's first copies come late).
    queued: std::sync::atomic::AtomicU64,
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
        let attempted = Arc::new((Mutex::new(0u64), Condvar::new()));
        let done = Arc::clone(&attempted);
        std::thread::Builder::new()
            .name("peer-copy".into())
            .spawn(move || {
                let mut peers: BTreeMap<String, Peer> = BTreeMap::new();
                for CopyJob { step, snapshot } in queue {
                    let started = Instant::now();
                    let data: Result<Vec<_>, String> = snapshot
                        .tensors()
                        .map_err(|e| e.to_string())
                        .and_then(|tensors| {
                            tensors
                                .iter()
                                .map(|(n, t)| Ok((n.clone(), to_tensor_data(t)?)))
                                .collect::<Result<Vec<_>, candle_core::Error>>()
                                .map_err(|e| e.to_string())
                        });
                    let mark_done = || {
                        let (newest, changed) = &*done;
                        *newest.lock().unwrap_or_else(|p| p.into_inner()) = step;
                        changed.notify_all();
                    };
                    let data = match data {
                        Ok(data) => data,
                        Err(error) => {
                            warn!(step, %error, "cannot read the state for a peer snapshot");
                            mark_done();
                            continue;
                        }
                    };
                    let request = Request::Put {
                        step,
                        tensors: metas(&data),
                    };
                    for addr in &destinations {
                        let result = match peers.remove(addr) {
                            Some(p) => Ok(p),
                            None => Peer::connect(addr, &token, timeout, switch.as_ref()),
                        }
                        .and_then(|mut p| p.call(&request, &data).map(|r| (p, r)));
                        match result {
                            Ok((peer, (Reply::Stored, _))) => {
                                peers.insert(addr.clone(), peer);
                            }
                            Ok((_, (other, _))) => {
                                warn!(%addr, ?other, "unexpected answer to a peer snapshot")
                            }
                            Err(e) => warn!(%addr, step, error = %e, "peer snapshot not stored"),
                        }
                    }
                    debug!(
                        step,
                        bytes = data.iter().map(|(_, t)| t.data.len()).sum::<usize>(),
                        seconds = started.elapsed().as_secs_f64(),
                        "peer snapshots sent"
                    );
                    mark_done();
                }
            })?;
        Ok(Self {
            jobs,
            attempted,
            queued: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Waits (at most `timeout`) until the copy of `step` was attempted. The worker calls it with
    /// the step before last when a step starts: copies lag at most one step behind training, so a
    /// single failure always finds the state of the step before the interrupted one in memory.
    pub fn wait_for(&self, step: u64, timeout: Duration) {
        // Only copies this worker queued: a replacement has none of the steps before it started.
        let step = step.min(self.queued.load(std::sync::atomic::Ordering::SeqCst));
        let (newest, changed) = &*self.attempted;
        let guard = newest.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, result) = changed
            .wait_timeout_while(guard, timeout, |newest| *newest < step)
            .unwrap_or_else(|p| p.into_inner());
        if result.timed_out() {
            warn!(
                step,
                newest = *guard,
                "the peer copy of a step is still in flight; training on"
            );
        }
    }

    /// Queues the state after `step` (the tensors are immutable: nothing is copied here).
    pub fn copy(&self, step: u64, snapshot: StateSnapshot) {
        self.queued
            .fetch_max(step, std::sync::atomic::Ordering::SeqCst);
        if self.jobs.send(CopyJob { step, snapshot }).is_err() {
            warn!(
                step,
                "the peer-copy thread stopped; no peer snapshot of this step"
            );
        }
    }
}

/// Fetches the tensors `names` of `step` from the agents at `sources` (in order, each asked for
/// what is still missing). Errors name what could not be found.
pub fn fetch(
    sources: &[String],
    step: u64,
    names: &[String],
    token: &str,
    timeout: Duration,
) -> Result<Vec<(String, TensorData)>, String> {
    let mut missing: BTreeSet<String> = names.iter().cloned().collect();
    let mut found = Vec::with_capacity(names.len());
    for addr in sources {
        if missing.is_empty() {
            break;
        }
        let request = Request::Get {
            step,
            names: missing.iter().cloned().collect(),
        };
        let reply = Peer::connect(addr, token, timeout, None).and_then(|mut p| {
            let (reply, payload) = p.call(&request, &[])?;
            Ok((p.addr, reply, payload))
        });
        match reply {
            Ok((addr, Reply::Tensors { tensors }, payload)) => {
                let tensors = unpack(tensors, payload).map_err(|e| format!("{addr}: {e}"))?;
                info!(%addr, step, tensors = tensors.len(), "fetched peer snapshot tensors");
                for (name, t) in tensors {
                    if missing.remove(&name) {
                        found.push((name, t));
                    }
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

    /// A replacement worker's copier holds none of the steps before it started: waiting for them
    /// returns at once instead of stalling its first step.
    #[test]
    fn a_fresh_copier_never_waits_for_steps_it_was_not_given() {
        let copier = PeerCopier::start(vec![], "t".into(), Duration::from_secs(1), None).unwrap();
        let started = Instant::now();
        copier.wait_for(18, Duration::from_secs(30));
        assert!(started.elapsed() < Duration::from_secs(1));
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
                    &tensors,
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
        let names = vec!["a".to_string(), "b".to_string()];
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
        peer.call(&request, &tensors).map(|(reply, _)| reply)
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
        for forged in [u64::MAX, u64::MAX - 1, 8, 3] {
            let mut peer = Peer::connect(&addr, "secret", timeout, None).unwrap();
            assert!(
                put(&mut peer, forged, -1.0).is_err(),
                "a Put of step {forged} was stored"
            );
            assert_eq!(held_steps(&store), [5, 6], "after a Put of step {forged}");
        }
        let names = vec!["a".to_string()];
        let got = fetch(std::slice::from_ref(&addr), 6, &names, "secret", timeout).unwrap();
        assert_eq!(got[0].1.data, tensor(&[6.0, 1.0]).data);
        // Training goes on: the next step is stored and evicts the oldest as always.
        let mut peer = Peer::connect(&addr, "secret", timeout, None).unwrap();
        assert!(matches!(put(&mut peer, 7, 7.0).unwrap(), Reply::Stored));
        assert_eq!(held_steps(&store), [6, 7]);
        // A replacement worker of the same plan keeps the window; a new plan starts its own.
        store.lock().unwrap().plan(PutBounds::for_plan(3, 5, 1000));
        assert!(matches!(put(&mut peer, 8, 8.0).unwrap(), Reply::Stored));
        store.lock().unwrap().plan(PutBounds::for_plan(4, 2, 1000));
        assert!(put(&mut peer, 9, 9.0).is_err());
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
}
