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
    /// The sending replica.
    from: usize,
    /// Which chunk of the gradient vector.
    chunk: usize,
    /// Elements (f32) in the payload.
    len: usize,
}

/// The first frame on a new link: who connects.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Hello {
    generation: u64,
    replica: usize,
}

/// The links from one stage's worker to the other replicas of its stage.
pub struct ReplicaGroup {
    /// This replica.
    replica: usize,
    /// Replica → its link (`None` for this replica).
    peers: Vec<Option<TcpStream>>,
    generation: u64,
    /// Micro-batches of a step (the summation tree's leaves).
    micro_batches: usize,
}

impl ReplicaGroup {
    /// Connects replica `replica` of a group of `addrs.len()` replicas under plan generation
    /// `generation`: it connects to every lower replica's reduction port (`addrs[r]`) and takes
    /// the connections of the higher ones from its own `port`. Each link is authenticated with the
    /// job token for [`Purpose::Reduce`], and its first frame says which replica is calling.
    pub fn connect(
        port: &DataPort,
        addrs: &[String],
        replica: usize,
        generation: u64,
        micro_batches: usize,
        token: &str,
        timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let d = addrs.len();
        if replica >= d {
            return Err(CollectiveError::Tree(format!(
                "replica {replica} of a group of {d}"
            )));
        }
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
        for _ in replica + 1..d {
            let any = |source| CollectiveError::Io {
                replica: d - 1,
                source,
            };
            let mut stream = port.next(timeout).map_err(any)?;
            stream.set_read_timeout(Some(timeout)).map_err(any)?;
            stream.set_nodelay(true).map_err(any)?;
            let frame = read_frame(&mut stream, HELLO_LIMITS).map_err(any)?;
            let hello: Hello = frame.header().map_err(any)?;
            let from = hello.replica;
            if hello.generation != generation || from <= replica || from >= d {
                return Err(CollectiveError::Protocol {
                    replica: from.min(d - 1),
                    detail: format!(
                        "a link from replica {from} of generation {}; expected one of replicas {}..{d} of generation {generation}",
                        hello.generation,
                        replica + 1
                    ),
                });
            }
            if peers[from].is_some() {
                return Err(CollectiveError::Protocol {
                    replica: from,
                    detail: "a second link from the same replica".into(),
                });
            }
            peers[from] = Some(stream);
        }
        Ok(Self {
            replica,
            peers,
            generation,
            micro_batches,
        })
    }

    /// Number of replicas in the group.
    pub fn replicas(&self) -> usize {
        self.peers.len()
    }

    /// Sums `partial` (this replica's sum over its micro-batches) with the other replicas' in
    /// the summation tree's order and returns the total, the same on every replica, with what
    /// it cost. Every replica must call it for the same step with a vector of the same length.
    pub fn all_reduce(
        &mut self,
        step: u64,
        partial: Vec<f32>,
    ) -> Result<(Vec<f32>, ReduceCost), CollectiveError> {
        let started = Instant::now();
        let d = self.replicas();
        let n = partial.len();
        let me = self.replica;
        let bounds = |q: usize| (q * n / d, (q + 1) * n / d);
        let generation = self.generation;
        let header = |phase, chunk, len| ChunkHeader {
            generation,
            step,
            phase,
            from: me,
            chunk,
            len,
        };
        // Reduce-scatter: chunk q of this replica's partial to replica q.
        let outgoing: Vec<(usize, Frame)> = (0..d)
            .filter(|&q| q != me)
            .map(|q| {
                let (lo, hi) = bounds(q);
                let h = header(Phase::Partial, q, hi - lo);
                (q, Frame::new(&h, to_bytes(&partial[lo..hi])))
            })
            .collect();
        let mut bytes_sent = frame_bytes(&outgoing);
        let (lo, hi) = bounds(me);
        let mut parts: Vec<Vec<f32>> = Vec::with_capacity(d);
        let limits = chunk_limits(n, d);
        let received = self.exchange(outgoing, limits, |peer, frame| {
            let expected = header(Phase::Partial, me, hi - lo);
            check(
                peer,
                frame,
                &ChunkHeader {
                    from: peer,
                    ..expected
                },
            )
        })?;
        let mut received = received.into_iter();
        for r in 0..d {
            parts.push(if r == me {
                partial[lo..hi].to_vec()
            } else {
                received.next().expect("one chunk per peer")
            });
        }
        let reduced = self.combine(parts)?;
        // All-gather: the reduced chunk to everyone.
        let outgoing: Vec<(usize, Frame)> = (0..d)
            .filter(|&q| q != me)
            .map(|q| {
                let h = header(Phase::Reduced, me, reduced.len());
                (q, Frame::new(&h, to_bytes(&reduced)))
            })
            .collect();
        bytes_sent += frame_bytes(&outgoing);
        let gathered = self.exchange(outgoing, limits, |peer, frame| {
            let (plo, phi) = bounds(peer);
            let expected = header(Phase::Reduced, peer, phi - plo);
            check(
                peer,
                frame,
                &ChunkHeader {
                    from: peer,
                    ..expected
                },
            )
        })?;
        let mut total = Vec::with_capacity(n);
        let mut gathered = gathered.into_iter();
        for r in 0..d {
            if r == me {
                total.extend_from_slice(&reduced);
            } else {
                total.extend(gathered.next().expect("one chunk per peer"));
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

    /// Adds the replicas' partial sums of one chunk (`parts[r]` from replica r) in the summation
    /// tree's order: replica r's sum is the tree's node over its micro-batches.
    fn combine(&self, parts: Vec<Vec<f32>>) -> Result<Vec<f32>, CollectiveError> {
        let d = parts.len();
        let c = self.micro_batches / d;
        let mut tree = SumTree::new(self.micro_batches);
        let mut add = |mut a: Vec<f32>, b: Vec<f32>| -> Result<Vec<f32>, CollectiveError> {
            for (x, y) in a.iter_mut().zip(&b) {
                *x += *y;
            }
            Ok(a)
        };
        for (r, part) in parts.into_iter().enumerate() {
            tree.push(r * c, (r + 1) * c, part, &mut add)
                .map_err(|e| CollectiveError::Tree(e.to_string()))?;
        }
        tree.finish::<CollectiveError>()
            .map_err(|e| CollectiveError::Tree(e.to_string()))
    }

    /// Sends each `(peer, frame)` on its own thread (so that no two replicas wait on each other's
    /// full socket buffers) while reading one frame from every peer, in replica order; `accept`
    /// checks each frame and returns its values.
    fn exchange(
        &mut self,
        outgoing: Vec<(usize, Frame)>,
        limits: Limits,
        accept: impl Fn(usize, &Frame) -> Result<Vec<f32>, CollectiveError>,
    ) -> Result<Vec<Vec<f32>>, CollectiveError> {
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
                    Ok(values) => got.push(values),
                    Err(e) => {
                        first_error = Some(e);
                        break;
                    }
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
                Some(e) => Err(e),
                None => Ok(got),
            }
        })
    }
}

/// The largest frame of a reduction of `n` values among `d` replicas: one chunk.
fn chunk_limits(n: usize, d: usize) -> Limits {
    Limits {
        header: 4 << 10,
        payload: ((n / d + 1) * 4) as u64,
    }
}

const HELLO_LIMITS: Limits = Limits {
    header: 1 << 10,
    payload: 0,
};

/// Checks a frame's header against `expected` and its payload's size against the header; returns
/// its values.
fn check(peer: usize, frame: &Frame, expected: &ChunkHeader) -> Result<Vec<f32>, CollectiveError> {
    let bad = |detail: String| CollectiveError::Protocol {
        replica: peer,
        detail,
    };
    let got: ChunkHeader = frame.header().map_err(|e| bad(e.to_string()))?;
    if &got != expected {
        return Err(bad(format!("expected {expected:?}, got {got:?}")));
    }
    if frame.payload.len() != got.len * 4 {
        return Err(bad(format!(
            "{} payload bytes for {} values",
            frame.payload.len(),
            got.len
        )));
    }
    Ok(frame
        .payload
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
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
                                7,
                                m,
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
                    1,
                    2,
                    "secret",
                    Duration::from_secs(10),
                )
                .unwrap();
                group.all_reduce(3, vec![1.0; 10]).unwrap_err()
            });
            let bad = scope.spawn(|| {
                let mut group = ReplicaGroup::connect(
                    &ports[1],
                    &addrs,
                    1,
                    1,
                    2,
                    "secret",
                    Duration::from_secs(10),
                )
                .unwrap();
                // Another step's numbers: replica 0 must refuse them.
                let _ = group.all_reduce(4, vec![1.0; 10]);
            });
            bad.join().unwrap();
            let err = good.join().unwrap();
            assert_eq!(err.replica(), Some(1), "{err}");
            assert!(err.to_string().contains("bad message"), "{err}");
        });
    }

    #[test]
    fn a_link_of_another_generation_is_refused() {
        let (ports, addrs) = ports(2);
        std::thread::scope(|scope| {
            let old = scope.spawn(|| {
                ReplicaGroup::connect(&ports[1], &addrs, 1, 1, 2, "secret", Duration::from_secs(5))
            });
            let err =
                ReplicaGroup::connect(&ports[0], &addrs, 0, 2, 2, "secret", Duration::from_secs(5))
                    .err()
                    .expect("refused");
            assert!(err.to_string().contains("generation"), "{err}");
            let _ = old.join().unwrap();
        });
    }
}
