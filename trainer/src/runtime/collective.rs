//! The gradient reduction between the data-parallel replicas of one stage.
//!
//! Each replica holds the sum of its own micro-batches' gradients (a node of the step's summation
//! tree, see `ops::sum_tree`). [`ReplicaGroup::all_reduce`] is a reduce-scatter followed by an
//! all-gather over direct TCP links between the replicas: the gradient vector is cut into one
//! chunk per replica; replica q receives chunk q of every replica's partial sum, adds them **in
//! the tree's order** (so the result is the bit-identical sum a single replica computing every
//! micro-batch would get), and sends the reduced chunk back to everyone.
//!
//! Every peer is untrusted input: frames are bounded by the exact size the step expects, headers
//! are checked (generation, step, phase, sender, chunk), and anything else is that peer's failure.

use std::io::{self, BufWriter};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use ops::sum_tree::SumTree;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::auth::{self, Purpose};
use super::transport::{DataPort, connect_retrying};
use super::wire::{Frame, Limits, read_frame, write_frame};

/// Why the reduction failed.
#[derive(Debug, Error)]
pub enum CollectiveError {
    /// A link to another replica failed (it died, or the connection broke).
    #[error("gradient reduction with replica {replica}: {source}")]
    Io {
        /// The replica on the other end.
        replica: usize,
        source: io::Error,
    },
    /// Another replica sent something other than what the step expects.
    #[error("gradient reduction: replica {replica} sent a bad message: {detail}")]
    Protocol {
        /// The replica that sent it.
        replica: usize,
        detail: String,
    },
    /// The partial sums could not be combined (a bug: the replica layout is not a tree node).
    #[error("gradient reduction: {0}")]
    Tree(String),
}

impl CollectiveError {
    /// The replica whose link or message failed, if any.
    pub fn replica(&self) -> Option<usize> {
        match self {
            CollectiveError::Io { replica, .. } | CollectiveError::Protocol { replica, .. } => {
                Some(*replica)
            }
            CollectiveError::Tree(_) => None,
        }
    }
}

/// What one reduction cost this replica.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReduceCost {
    /// Bytes this replica sent.
    pub bytes_sent: u64,
    /// Seconds the reduction took.
    pub seconds: f64,
}

/// The two phases of [`ReplicaGroup::all_reduce`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Phase {
    /// A replica's partial sum of the receiver's chunk.
    Partial,
    /// The reduced chunk of the sender.
    Reduced,
}

/// The header of every frame between replicas.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct ChunkHeader {
    generation: u64,
    step: u64,
    phase: Phase,
    /// The sending member of the group.
    from: usize,
    /// Which chunk of the gradient vector.
    chunk: usize,
    /// The summation-tree nodes (replicas' shares of the step) whose slices follow, in order.
    nodes: Vec<usize>,
    /// Elements (f32) of each node's slice.
    len: usize,
}

/// The first frame on a new link: who connects.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Hello {
    generation: u64,
    replica: usize,
}

/// What a group reduces: the step's summation tree and the links' generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    /// Link generation: a link of another generation is refused.
    pub generation: u64,
    /// Micro-batches of a step (the tree's leaves).
    pub micro_batches: usize,
    /// Replicas the step's micro-batches are split among (the tree nodes a reduction combines):
    /// node r covers micro-batches [r·m/nodes, (r+1)·m/nodes). More than the group's members when
    /// a member computed a lost replica's share too.
    pub nodes: usize,
}

/// The links from one stage's worker to the other members of its replica group.
pub struct ReplicaGroup {
    /// This member.
    replica: usize,
    /// Member → its link (`None` for this member).
    peers: Vec<Option<TcpStream>>,
    spec: GroupSpec,
}

impl ReplicaGroup {
    /// Connects member `replica` of a group of `addrs.len()` members: it connects to every lower
    /// member's reduction port (`addrs[r]`) and takes the connections of the higher ones from its
    /// own `port`. Each link is authenticated with the job token for [`Purpose::Reduce`], and its
    /// first frame says which member is calling under which generation; a connection of another
    /// generation (a member of an earlier group) is dropped.
    pub fn connect(
        port: &DataPort,
        addrs: &[String],
        replica: usize,
        spec: GroupSpec,
        token: &str,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let d = addrs.len();
        if replica >= d || spec.nodes < d || !spec.micro_batches.is_multiple_of(spec.nodes) {
            return Err(CollectiveError::Tree(format!(
                "member {replica} of a group of {d} reducing {} shares of {} micro-batches",
                spec.nodes, spec.micro_batches
            )));
        }
        let generation = spec.generation;
        let mut peers: Vec<Option<TcpStream>> = (0..d).map(|_| None).collect();
        for (r, addr) in addrs.iter().enumerate().take(replica) {
            let io = |source| CollectiveError::Io { replica: r, source };
            let socket = resolve(addr).map_err(io)?;
            let mut stream = connect_retrying(&socket, timeout).map_err(io)?;
            auth::connect(&mut stream, token, Purpose::Reduce).map_err(io)?;
            stream.set_read_timeout(Some(timeout)).map_err(io)?;
            stream.set_nodelay(true).map_err(io)?;
            let hello = Frame::new(
                &Hello {
                    generation,
                    replica,
                },
                Vec::new(),
            );
            write_frame(&mut stream, &hello).map_err(io)?;
            peers[r] = Some(stream);
        }
        let deadline = Instant::now() + timeout;
        while peers.iter().skip(replica + 1).any(Option::is_none) {
            let waiting = peers.iter().rposition(Option::is_none).unwrap_or(d - 1);
            let any = |source| CollectiveError::Io {
                replica: waiting,
                source,
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let mut stream = port.next(left).map_err(any)?;
            stream.set_read_timeout(Some(timeout)).map_err(any)?;
            stream.set_nodelay(true).map_err(any)?;
            let Ok(hello) = read_frame(&mut stream, HELLO_LIMITS).and_then(|f| f.header::<Hello>())
            else {
                continue;
            };
            let from = hello.replica;
            if hello.generation != generation {
                tracing::warn!(
                    from,
                    generation = hello.generation,
                    expected = generation,
                    "dropped a replica link of another generation"
                );
                continue;
            }
            if from <= replica || from >= d {
                return Err(CollectiveError::Protocol {
                    replica: from.min(d - 1),
                    detail: format!(
                        "a link from member {from}; expected one of members {}..{d}",
                        replica + 1
                    ),
                });
            }
            if peers[from].is_some() {
                return Err(CollectiveError::Protocol {
                    replica: from,
                    detail: "a second link from the same member".into(),
                });
            }
            peers[from] = Some(stream);
        }
        Ok(Self {
            replica,
            peers,
            spec,
        })
    }

    /// Number of members of the group.
    pub fn replicas(&self) -> usize {
        self.peers.len()
    }

    /// Sums `partial` (this replica's sum over its micro-batches: tree node `replica`) with the
    /// other members' in the summation tree's order; see [`ReplicaGroup::all_reduce_nodes`].
    pub fn all_reduce(
        &mut self,
        step: u64,
        partial: Vec<f32>,
    ) -> Result<(Vec<f32>, ReduceCost), CollectiveError> {
        let me = self.replica;
        self.all_reduce_nodes(step, &[(me, partial)])
    }

    /// Sums the tree nodes `parts` (`(node, its partial sum)`, each node a replica's share of the
    /// step's micro-batches) with the other members' in the summation tree's order and returns
    /// the total, the same on every member, with what it cost. Between them the members must hold
    /// every node of the tree exactly once, all vectors of the same length. `parts` are only
    /// read: after a failure (a member lost) the caller still holds its shares and can reduce
    /// them again in another group. A failed reduction shuts every link of the group down (no
    /// member stays blocked sending to one that stopped reading); the group is then unusable.
    pub fn all_reduce_nodes(
        &mut self,
        step: u64,
        parts: &[(usize, Vec<f32>)],
    ) -> Result<(Vec<f32>, ReduceCost), CollectiveError> {
        let started = Instant::now();
        let d = self.replicas();
        let n = parts.first().map_or(0, |(_, v)| v.len());
        if parts.is_empty()
            || parts
                .iter()
                .any(|(node, v)| v.len() != n || *node >= self.spec.nodes)
        {
            return Err(CollectiveError::Tree(format!(
                "member {} holds no valid shares to reduce",
                self.replica
            )));
        }
        let me = self.replica;
        let nodes: Vec<usize> = parts.iter().map(|(node, _)| *node).collect();
        let bounds = |q: usize| (q * n / d, (q + 1) * n / d);
        let generation = self.spec.generation;
        let header = |phase, chunk, nodes: Vec<usize>, len| ChunkHeader {
            generation,
            step,
            phase,
            from: me,
            chunk,
            nodes,
            len,
        };
        // Reduce-scatter: chunk q of every node this member holds to member q.
        let outgoing: Vec<(usize, Frame)> = (0..d)
            .filter(|&q| q != me)
            .map(|q| {
                let (lo, hi) = bounds(q);
                let h = header(Phase::Partial, q, nodes.clone(), hi - lo);
                let bytes = parts
                    .iter()
                    .flat_map(|(_, v)| to_bytes(&v[lo..hi]))
                    .collect();
                (q, Frame::new(&h, bytes))
            })
            .collect();
        let mut bytes_sent = frame_bytes(&outgoing);
        let (lo, hi) = bounds(me);
        let limits = chunk_limits(n, d, self.spec.nodes);
        let received = self.exchange(outgoing, limits, |peer, frame| {
            check(peer, frame, generation, step, Phase::Partial, me, hi - lo)
        })?;
        let mut shares: Vec<(usize, Vec<f32>)> = parts
            .iter()
            .map(|(node, v)| (*node, v[lo..hi].to_vec()))
            .collect();
        for (_, got) in received {
            shares.extend(got);
        }
        let reduced = self.combine(shares)?;
        // All-gather: the reduced chunk to everyone.
        let outgoing: Vec<(usize, Frame)> = (0..d)
            .filter(|&q| q != me)
            .map(|q| {
                let h = header(Phase::Reduced, me, Vec::new(), reduced.len());
                (q, Frame::new(&h, to_bytes(&reduced)))
            })
            .collect();
        bytes_sent += frame_bytes(&outgoing);
        let gathered = self.exchange(outgoing, limits, |peer, frame| {
            let (plo, phi) = bounds(peer);
            check(
                peer,
                frame,
                generation,
                step,
                Phase::Reduced,
                peer,
                phi - plo,
            )
        })?;
        let mut total = Vec::with_capacity(n);
        let mut gathered = gathered.into_iter();
        for r in 0..d {
            if r == me {
                total.extend_from_slice(&reduced);
            } else {
                let (_, slices) = gathered.next().expect("one chunk per peer");
                total.extend(slices.into_iter().flat_map(|(_, v)| v));
            }
        }
        Ok((
            total,
            ReduceCost {
                bytes_sent,
                seconds: started.elapsed().as_secs_f64(),
            },
        ))
    }

    /// Adds the shares of one chunk (`(node, values)`, every tree node exactly once) in the
    /// summation tree's order: node r is replica r's share of the step's micro-batches.
    fn combine(&self, mut shares: Vec<(usize, Vec<f32>)>) -> Result<Vec<f32>, CollectiveError> {
        let GroupSpec {
            micro_batches: m,
            nodes,
            ..
        } = self.spec;
        shares.sort_by_key(|(node, _)| *node);
        let held: Vec<usize> = shares.iter().map(|(node, _)| *node).collect();
        if held != (0..nodes).collect::<Vec<_>>() {
            return Err(CollectiveError::Tree(format!(
                "the group holds shares {held:?}; every one of 0..{nodes} exactly once is needed"
            )));
        }
        let c = m / nodes;
        let mut tree = SumTree::new(m);
        let mut add = |mut a: Vec<f32>, b: Vec<f32>| -> Result<Vec<f32>, CollectiveError> {
            for (x, y) in a.iter_mut().zip(&b) {
                *x += *y;
            }
            Ok(a)
        };
        for (r, part) in shares {
            tree.push(r * c, (r + 1) * c, part, &mut add)
                .map_err(|e| CollectiveError::Tree(e.to_string()))?;
        }
        tree.finish::<CollectiveError>()
            .map_err(|e| CollectiveError::Tree(e.to_string()))
    }

    /// Sends each `(peer, frame)` on its own thread (so that no two replicas wait on each other's
    /// full socket buffers) while reading one frame from every peer, in replica order; `accept`
    /// checks each frame and returns its values.
    fn exchange<T>(
        &mut self,
        outgoing: Vec<(usize, Frame)>,
        limits: Limits,
        accept: impl Fn(usize, &Frame) -> Result<T, CollectiveError>,
    ) -> Result<Vec<(usize, T)>, CollectiveError> {
        let writers: Vec<(usize, TcpStream)> = outgoing
            .iter()
            .map(|(q, _)| {
                let stream = self.peers[*q]
                    .as_ref()
                    .expect("a link to every other replica");
                stream
                    .try_clone()
                    .map(|s| (*q, s))
                    .map_err(|source| CollectiveError::Io {
                        replica: *q,
                        source,
                    })
            })
            .collect::<Result<_, _>>()?;
        std::thread::scope(|scope| {
            let sends: Vec<_> = writers
                .into_iter()
                .zip(&outgoing)
                .map(|((q, stream), (_, frame))| {
                    let handle = scope.spawn(move || {
                        let mut w = BufWriter::new(stream);
                        write_frame(&mut w, frame)
                    });
                    (q, handle)
                })
                .collect();
            let mut got = Vec::new();
            let mut first_error = None;
            for (peer, link) in self.peers.iter().enumerate() {
                let Some(stream) = link else { continue };
                // Unbuffered: the peer's next frame may already be arriving behind this one.
                let read = read_frame(&mut &*stream, limits)
                    .map_err(|source| CollectiveError::Io {
                        replica: peer,
                        source,
                    })
                    .and_then(|frame| accept(peer, &frame));
                match read {
                    Ok(values) => got.push((peer, values)),
                    Err(e) => {
                        first_error = Some(e);
                        break;
                    }
                }
            }
            if first_error.is_some() {
                // Unblock this member's sends (a peer that also failed no longer reads) and tell
                // every peer at once, rather than after its read timeout.
                for stream in self.peers.iter().flatten() {
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                }
            }
            for (q, handle) in sends {
                let sent = handle
                    .join()
                    .unwrap_or_else(|_| Err(io::Error::other("the sending thread panicked")));
                if let Err(source) = sent {
                    first_error.get_or_insert(CollectiveError::Io { replica: q, source });
                }
            }
            match first_error {
                Some(e) => {
                    for stream in self.peers.iter().flatten() {
                        let _ = stream.shutdown(std::net::Shutdown::Both);
                    }
                    Err(e)
                }
                None => Ok(got),
            }
        })
    }
}

/// The largest frame of a reduction of `n` values among `d` members reducing `nodes` shares: one
/// chunk of every share.
fn chunk_limits(n: usize, d: usize, nodes: usize) -> Limits {
    Limits {
        header: 4 << 10,
        payload: ((n / d + 1) * 4 * nodes) as u64,
    }
}

const HELLO_LIMITS: Limits = Limits {
    header: 1 << 10,
    payload: 0,
};

/// Checks a frame of member `peer` (generation, step, phase, chunk, sizes) and returns its
/// slices: `(node, values)` per tree node it carries (a reduced chunk carries no node: one slice,
/// node 0).
fn check(
    peer: usize,
    frame: &Frame,
    generation: u64,
    step: u64,
    phase: Phase,
    chunk: usize,
    len: usize,
) -> Result<Vec<(usize, Vec<f32>)>, CollectiveError> {
    let bad = |detail: String| CollectiveError::Protocol {
        replica: peer,
        detail,
    };
    let got: ChunkHeader = frame.header().map_err(|e| bad(e.to_string()))?;
    let expected = (generation, step, phase, peer, chunk, len);
    let seen = (
        got.generation,
        got.step,
        got.phase,
        got.from,
        got.chunk,
        got.len,
    );
    if seen != expected {
        return Err(bad(format!(
            "expected (generation, step, phase, sender, chunk, length) {expected:?}, got {seen:?}"
        )));
    }
    let nodes = match phase {
        Phase::Partial if got.nodes.is_empty() => {
            return Err(bad("a partial sum of no share".into()));
        }
        Phase::Partial => got.nodes,
        Phase::Reduced => vec![0],
    };
    if frame.payload.len() != nodes.len() * len * 4 {
        return Err(bad(format!(
            "{} payload bytes for {} slice(s) of {len} values",
            frame.payload.len(),
            nodes.len()
        )));
    }
    let values: Vec<f32> = frame
        .payload
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect();
    Ok(nodes
        .into_iter()
        .enumerate()
        .map(|(i, node)| (node, values[i * len..(i + 1) * len].to_vec()))
        .collect())
}

fn to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn frame_bytes(frames: &[(usize, Frame)]) -> u64 {
    frames
        .iter()
        .map(|(_, f)| (16 + f.header.len() + f.payload.len()) as u64)
        .sum()
}

fn resolve(addr: &str) -> io::Result<std::net::SocketAddr> {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()?.next().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("{addr} resolves to nothing"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Opens `d` reduction ports on loopback: the ports and their addresses.
    fn ports(d: usize) -> (Vec<DataPort>, Vec<String>) {
        (0..d)
            .map(|_| {
                let listener = TcpListener::bind("127.0.0.1:0").unwrap();
                let addr = listener.local_addr().unwrap().to_string();
                let port = DataPort::open_for(listener, "secret".into(), Purpose::Reduce, "reduce")
                    .unwrap();
                (port, addr)
            })
            .unzip()
    }

    fn spec(generation: u64, micro_batches: usize, nodes: usize) -> GroupSpec {
        GroupSpec {
            generation,
            micro_batches,
            nodes,
        }
    }

    /// Values whose sum depends on the order of additions.
    fn leaf(i: usize, n: usize) -> Vec<f32> {
        (0..n)
            .map(|j| {
                let x = ((i * 7919 + j * 104_729) % 1000) as f32 / 1000.0;
                x * 10f32.powi(((i + j) % 9) as i32 - 4)
            })
            .collect()
    }

    fn add(mut a: Vec<f32>, b: Vec<f32>) -> Result<Vec<f32>, ()> {
        for (x, y) in a.iter_mut().zip(&b) {
            *x += *y;
        }
        Ok(a)
    }

    /// The tree sum of leaves `lo..hi` of a tree over `total` leaves, pushed one by one.
    fn tree_sum(total: usize, leaves: &[Vec<f32>]) -> Vec<f32> {
        let mut tree = SumTree::new(total);
        for (i, v) in leaves.iter().enumerate() {
            tree.push(i, i + 1, v.clone(), &mut add).unwrap();
        }
        tree.finish::<()>().unwrap()
    }

    #[test]
    fn replicas_reduce_to_the_single_replica_tree_sum_bit_for_bit() {
        for (m, d, n) in [(4, 2, 37), (8, 4, 5), (6, 3, 100), (8, 2, 1), (2, 2, 0)] {
            let leaves: Vec<Vec<f32>> = (0..m).map(|i| leaf(i, n)).collect();
            let expected = tree_sum(m, &leaves);
            let c = m / d;
            let (ports, addrs) = ports(d);
            let results: Vec<Vec<f32>> = std::thread::scope(|scope| {
                let handles: Vec<_> = ports
                    .iter()
                    .enumerate()
                    .map(|(r, port)| {
                        let (addrs, leaves) = (&addrs, &leaves);
                        scope.spawn(move || {
                            let mut group = ReplicaGroup::connect(
                                port,
                                addrs,
                                r,
                                spec(7, m, d),
                                "secret",
                                Duration::from_secs(10),
                            )
                            .unwrap();
                            let mut partial = SumTree::new(c);
                            for i in 0..c {
                                partial
                                    .push(i, i + 1, leaves[r * c + i].clone(), &mut add)
                                    .unwrap();
                            }
                            let partial = partial.finish::<()>().unwrap();
                            let mut last = Vec::new();
                            // Two steps over the same links.
                            for step in 1..=2 {
                                let (total, cost) =
                                    group.all_reduce(step, partial.clone()).unwrap();
                                assert!(cost.bytes_sent > 0 || d == 1);
                                last = total;
                            }
                            last
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (r, got) in results.iter().enumerate() {
                let same = got.len() == expected.len()
                    && got
                        .iter()
                        .zip(&expected)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "m={m} d={d} n={n}: replica {r} differs from the tree sum"
                );
            }
            // The order matters for these values: a left-to-right sum differs somewhere.
            if n >= 37 {
                let naive = leaves
                    .iter()
                    .skip(1)
                    .fold(leaves[0].clone(), |a, b| add(a, b.clone()).unwrap());
                assert!(
                    naive
                        .iter()
                        .zip(&expected)
                        .any(|(a, b)| a.to_bits() != b.to_bits()),
                    "m={m} n={n}: the test values do not depend on the order"
                );
            }
        }
    }

    #[test]
    fn a_replica_sending_the_wrong_chunk_is_named() {
        let (ports, addrs) = ports(2);
        std::thread::scope(|scope| {
            let good = scope.spawn(|| {
                let mut group = ReplicaGroup::connect(
                    &ports[0],
                    &addrs,
                    0,
                    spec(1, 2, 2),
                    "secret",
                    Duration::from_secs(10),
                )
                .unwrap();
                group.all_reduce(3, vec![1.0; 10]).unwrap_err()
            });
            let bad = scope.spawn(|| {
                let group = ReplicaGroup::connect(
                    &ports[1],
                    &addrs,
                    1,
                    spec(1, 2, 2),
                    "secret",
                    Duration::from_secs(10),
                )
                .unwrap();
                // Another step's numbers, the chunk a member reducing step 4 sends replica 0:
                // replica 0 must refuse them. Written directly rather than by a reduction of
                // step 4, which would refuse replica 0's chunk in turn and shut the link down,
                // possibly before its own chunk had gone out.
                let wrong_step = ChunkHeader {
                    generation: 1,
                    step: 4,
                    phase: Phase::Partial,
                    from: 1,
                    chunk: 0,
                    nodes: vec![1],
                    len: 5,
                };
                let link = group.peers[0].as_ref().unwrap();
                write_frame(&mut &*link, &Frame::new(&wrong_step, to_bytes(&[1.0; 5]))).unwrap();
                // Kept open until replica 0 has read it.
                group
            });
            let err = good.join().unwrap();
            drop(bad.join().unwrap());
            assert_eq!(err.replica(), Some(1), "{err}");
            assert!(err.to_string().contains("bad message"), "{err}");
        });
    }

    /// A link of an earlier group (another generation) is dropped: the group waits for the
    /// members of its own generation, and says which one never came.
    #[test]
    fn a_link_of_another_generation_is_dropped() {
        let (ports, addrs) = ports(2);
        std::thread::scope(|scope| {
            let old = scope.spawn(|| {
                let timeout = Duration::from_secs(5);
                ReplicaGroup::connect(&ports[1], &addrs, 1, spec(1, 2, 2), "secret", timeout)
            });
            let timeout = Duration::from_millis(1500);
            let err = ReplicaGroup::connect(&ports[0], &addrs, 0, spec(2, 2, 2), "secret", timeout)
                .err()
                .expect("refused");
            assert!(
                matches!(err, CollectiveError::Io { replica: 1, .. }),
                "{err}"
            );
            let _ = old.join().unwrap();
        });
    }

    /// A replica was lost: the two survivors of three reduce its share too (computed by one of
    /// them), and get the same bits as the three would have.
    #[test]
    fn survivors_reduce_a_lost_replicas_share_to_the_same_bits() {
        let (m, n) = (6, 50);
        let leaves: Vec<Vec<f32>> = (0..m).map(|i| leaf(i, n)).collect();
        let expected = tree_sum(m, &leaves);
        let share = |r: usize| {
            let mut t = SumTree::new(2);
            t.push(0, 1, leaves[2 * r].clone(), &mut add).unwrap();
            t.push(1, 2, leaves[2 * r + 1].clone(), &mut add).unwrap();
            t.finish::<()>().unwrap()
        };
        // Replica 1 is lost; member 0 is replica 0 (which adopts 1's share), member 1 replica 2.
        let holdings = [vec![(0, share(0)), (1, share(1))], vec![(2, share(2))]];
        let (ports, addrs) = ports(2);
        let results: Vec<Vec<f32>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ports
                .iter()
                .zip(holdings)
                .enumerate()
                .map(|(member, (port, parts))| {
                    let addrs = &addrs;
                    scope.spawn(move || {
                        let mut group = ReplicaGroup::connect(
                            port,
                            addrs,
                            member,
                            spec(9, m, 3),
                            "secret",
                            Duration::from_secs(10),
                        )
                        .unwrap();
                        group.all_reduce_nodes(4, &parts).unwrap().0
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for got in results {
            assert!(
                got.iter()
                    .zip(&expected)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
            assert_eq!(got.len(), expected.len());
        }
    }

    /// A member lost in the middle of the reduction (its process gone: links closed) fails the
    /// others at once, not after their read timeout; they still hold their shares and reduce them
    /// again in a group of the survivors, one of which computed the lost member's share, to the
    /// same bits. Large vectors, so that the frames do not fit in the sockets' buffers.
    #[test]
    fn a_member_lost_mid_reduction_fails_the_others_at_once_and_they_reduce_again() {
        let (m, d, n) = (4, 4, 1 << 21);
        let leaves: Vec<Vec<f32>> = (0..m).map(|i| leaf(i, n)).collect();
        let expected = tree_sum(m, &leaves);
        let timeout = Duration::from_secs(300);
        let (ports, addrs) = ports(d);
        // (replica, the shares it still holds) of every survivor.
        type Held = (usize, Vec<(usize, Vec<f32>)>);
        let survivors: Vec<Held> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..d)
                .map(|r| {
                    let (ports, addrs, leaves) = (&ports, &addrs, &leaves);
                    scope.spawn(move || {
                        let mut group = ReplicaGroup::connect(
                            &ports[r],
                            addrs,
                            r,
                            spec(1, m, d),
                            "secret",
                            timeout,
                        )
                        .unwrap();
                        if r == 2 {
                            // Lost: the links close without a frame sent.
                            drop(group);
                            return None;
                        }
                        let parts = vec![(r, leaves[r].clone())];
                        let started = Instant::now();
                        let err = group.all_reduce_nodes(5, &parts).unwrap_err();
                        assert!(
                            started.elapsed() < timeout / 10,
                            "member {r} failed only after {:?}: {err}",
                            started.elapsed()
                        );
                        Some((r, parts))
                    })
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|h| h.join().unwrap())
                .collect()
        });
        // Replica 3 (= adopter(2)) computes 2's share too; the survivors regroup.
        let (new_ports, new_addrs) = self::ports(survivors.len());
        let results: Vec<Vec<f32>> = std::thread::scope(|scope| {
            let handles: Vec<_> = survivors
                .into_iter()
                .enumerate()
                .map(|(member, (r, mut parts))| {
                    if r == 3 {
                        parts.push((2, leaves[2].clone()));
                    }
                    let (ports, addrs) = (&new_ports, &new_addrs);
                    scope.spawn(move || {
                        let mut group = ReplicaGroup::connect(
                            &ports[member],
                            addrs,
                            member,
                            spec(2, m, d),
                            "secret",
                            timeout,
                        )
                        .unwrap();
                        group.all_reduce_nodes(5, &parts).unwrap().0
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for got in results {
            assert_eq!(got.len(), n);
            assert!(
                got.iter()
                    .zip(&expected)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
            );
        }
    }
}
