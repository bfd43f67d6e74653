//! The NCCL link of `nccl`, emulated for the tests (the `emulate` feature): the same calls, with a
//! local TCP connection in place of the communicator. It keeps what the runtime relies on:
//!
//! * a send returns once it is queued (a writer thread writes it), a receive returns once the data
//!   is in the buffer, and [`NcclLink::wait`] returns once every queued send was written;
//! * a peer that is gone makes a receive or a wait *hang*, as NCCL does, until the [`Abort`] is
//!   tripped or the deadline passes; then the link is dead and every later call fails.
//!
//! The id holds a port on 127.0.0.1 and a random secret: rank 0 (the process that created the id)
//! listens there and admits only a peer that presents the secret. Emulated links therefore join
//! processes of one machine, which is what the tests run.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rand::RngCore;

use crate::device::{Buf, Gpu};
use crate::error::{GpuError, Result, shape};
pub use crate::link::{Abort, LinkId};
use crate::link::{check_alive, check_transfer};

const MAGIC: &[u8; 8] = b"SPEMULNK";
/// How often a blocked call looks at its abort handle and deadline.
const POLL: Duration = Duration::from_millis(10);

/// The emulation needs no library.
pub fn nccl_present() -> Result<()> {
    Ok(())
}

/// Listeners of the ids this process created, by secret, until rank 0 joins.
fn listeners() -> &'static Mutex<HashMap<[u8; 32], TcpListener>> {
    static LISTENERS: OnceLock<Mutex<HashMap<[u8; 32], TcpListener>>> = OnceLock::new();
    LISTENERS.get_or_init(Default::default)
}

impl LinkId {
    /// A new id: a listening port on 127.0.0.1 and a secret (this process joins it as rank 0).
    pub fn new() -> Result<LinkId> {
        let listener =
            TcpListener::bind("127.0.0.1:0").map_err(|e| emu_error("creating a link id", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| emu_error("creating a link id", e))?
            .port();
        let mut secret = [0u8; 32];
        rand::rng().fill_bytes(&mut secret);
        let mut bytes = [0u8; 128];
        bytes[..8].copy_from_slice(MAGIC);
        bytes[8..10].copy_from_slice(&port.to_le_bytes());
        bytes[10..42].copy_from_slice(&secret);
        listeners()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(secret, listener);
        Ok(LinkId::from_bytes(bytes))
    }
}

/// The port and secret of an emulated id.
fn parse(id: LinkId) -> Result<(u16, [u8; 32])> {
    let bytes = id.to_bytes();
    if &bytes[..8] != MAGIC {
        return shape("NcclLink::connect", "not an emulated link id".to_string());
    }
    let port = u16::from_le_bytes([bytes[8], bytes[9]]);
    let secret: [u8; 32] = bytes[10..42].try_into().expect("32 bytes");
    Ok((port, secret))
}

/// One end of an emulated two-rank link.
pub struct NcclLink {
    rank: usize,
    stream: TcpStream,
    /// Queued sends, written in order by the writer thread.
    writer: Sender<Vec<u8>>,
    /// Sends queued and not yet written.
    pending: Arc<AtomicUsize>,
    abort: Abort,
    dead: bool,
}

impl Drop for NcclLink {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

impl NcclLink {
    /// Joins link `id` as `rank` (0: the earlier stage, which created the id in this process; 1:
    /// the later), waiting at most `timeout` for the peer.
    pub fn connect(
        _gpu: &Gpu,
        id: LinkId,
        rank: usize,
        timeout: Duration,
        abort: Abort,
    ) -> Result<NcclLink> {
        const OP: &str = "joining the link (waiting for the peer)";
        let deadline = Instant::now() + timeout;
        let (port, secret) = parse(id)?;
        let stream = match rank {
            0 => {
                let listener = listeners()
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&secret)
                    .ok_or_else(|| GpuError::Shape {
                        op: "NcclLink::connect",
                        reason: "rank 0 of an emulated link is the process that created its id"
                            .into(),
                    })?;
                accept_peer(&listener, &secret, deadline, &abort)?
            }
            1 => {
                let addr = SocketAddr::from(([127, 0, 0, 1], port));
                let mut stream = loop {
                    match TcpStream::connect_timeout(&addr, POLL) {
                        Ok(s) => break s,
                        Err(_) => abort.check(OP, deadline)?,
                    }
                    std::thread::sleep(POLL);
                };
                stream
                    .write_all(&secret)
                    .map_err(|e| emu_error("presenting the link's secret", e))?;
                stream
            }
            _ => {
                return shape(
                    "NcclLink::connect",
                    format!("rank {rank} of a two-rank link"),
                );
            }
        };
        stream
            .set_nodelay(true)
            .and_then(|()| stream.set_read_timeout(Some(POLL)))
            .map_err(|e| emu_error(OP, e))?;
        let mut out = stream.try_clone().map_err(|e| emu_error(OP, e))?;
        let pending = Arc::new(AtomicUsize::new(0));
        let (writer, queued) = channel::<Vec<u8>>();
        let written = Arc::clone(&pending);
        std::thread::Builder::new()
            .name(format!("emu-link-{rank}"))
            .spawn(move || {
                // A write that fails leaves its send pending: waits hang until the abort, as
                // NCCL's do when the peer is gone.
                for bytes in queued {
                    if out.write_all(&bytes).is_err() {
                        return;
                    }
                    written.fetch_sub(1, Ordering::SeqCst);
                }
            })
            .map_err(|e| emu_error("starting the link's writer", e))?;
        Ok(NcclLink {
            rank,
            stream,
            writer,
            pending,
            abort,
            dead: false,
        })
    }

    /// This end's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Queues a send of the first `n` elements of `buf` (the emulated compute has finished).
    pub fn send(&mut self, buf: &Buf<f32>, n: usize, _deadline: Instant) -> Result<()> {
        self.check_len("send", buf, n)?;
        let values = &buf.slice()[..n];
        let mut bytes = Vec::with_capacity(8 + 4 * n);
        bytes.extend_from_slice(&(n as u64).to_le_bytes());
        bytes.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        self.pending.fetch_add(1, Ordering::SeqCst);
        if self.writer.send(bytes).is_err() {
            // The writer stopped on a broken connection: the send stays pending.
            return Ok(());
        }
        Ok(())
    }

    /// Receives `n` elements into `buf`, waiting until they are there.
    pub fn recv(&mut self, buf: &mut Buf<f32>, n: usize, deadline: Instant) -> Result<()> {
        const OP: &str = "receiving";
        self.check_len("recv", buf, n)?;
        let mut header = [0u8; 8];
        self.read_exact(&mut header, deadline)?;
        let got = u64::from_le_bytes(header);
        if got != n as u64 {
            self.dead = true;
            return Err(GpuError::Nccl {
                during: OP.into(),
                detail: format!("the peer sent {got} elements where {n} were expected"),
            });
        }
        let mut bytes = vec![0u8; 4 * n];
        self.read_exact(&mut bytes, deadline)?;
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect();
        // SAFETY: `buf` holds at least `n` elements (checked) and does not overlap `values`.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), buf.ptr() as *mut f32, n) };
        Ok(())
    }

    /// Waits until every queued send was written.
    pub fn wait(&mut self, deadline: Instant) -> Result<()> {
        self.alive("waiting for a transfer")?;
        while self.pending.load(Ordering::SeqCst) > 0 {
            self.check("waiting for a transfer", deadline)?;
            std::thread::sleep(POLL);
        }
        Ok(())
    }

    /// Reads exactly `out.len()` bytes; a closed connection is waited on like a silent peer.
    fn read_exact(&mut self, out: &mut [u8], deadline: Instant) -> Result<()> {
        const OP: &str = "receiving";
        self.alive(OP)?;
        let mut at = 0;
        while at < out.len() {
            match self.stream.read(&mut out[at..]) {
                Ok(0) => {
                    self.check(OP, deadline)?;
                    std::thread::sleep(POLL);
                }
                Ok(k) => at += k,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    self.check(OP, deadline)?;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    self.check(OP, deadline)?;
                    std::thread::sleep(POLL);
                }
            }
        }
        Ok(())
    }

    fn check(&mut self, what: &str, deadline: Instant) -> Result<()> {
        self.abort.check(what, deadline).inspect_err(|_| {
            self.dead = true;
            let _ = self.stream.shutdown(Shutdown::Both);
        })
    }

    fn check_len(&self, op: &'static str, buf: &Buf<f32>, n: usize) -> Result<()> {
        check_transfer(op, n, buf.len(), self.dead)
    }

    fn alive(&self, what: &str) -> Result<()> {
        check_alive(what, self.dead)
    }
}

/// Rank 0: the first connection that presents `secret`.
fn accept_peer(
    listener: &TcpListener,
    secret: &[u8; 32],
    deadline: Instant,
    abort: &Abort,
) -> Result<TcpStream> {
    const OP: &str = "joining the link (waiting for the peer)";
    listener
        .set_nonblocking(true)
        .map_err(|e| emu_error(OP, e))?;
    loop {
        match listener.accept() {
            Ok((mut stream, _)) => {
                let mut got = [0u8; 32];
                let presented = stream
                    .set_nonblocking(false)
                    .and_then(|()| stream.set_read_timeout(Some(Duration::from_secs(5))))
                    .and_then(|()| stream.read_exact(&mut got));
                if presented.is_ok() && &got == secret {
                    return Ok(stream);
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                abort.check(OP, deadline)?;
                std::thread::sleep(POLL);
            }
            Err(e) => return Err(emu_error(OP, e)),
        }
    }
}

fn emu_error(what: &str, e: std::io::Error) -> GpuError {
    GpuError::Nccl {
        during: what.into(),
        detail: format!("emulated link: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Precision;

    fn pair(timeout: Duration) -> (NcclLink, NcclLink, Abort, Gpu) {
        let gpu = Gpu::open(0, Precision::Fp32).unwrap();
        let id = LinkId::new().unwrap();
        let abort = Abort::default();
        let joiner = std::thread::spawn(move || {
            let gpu = Gpu::open(0, Precision::Fp32).unwrap();
            NcclLink::connect(&gpu, id, 1, timeout, Abort::default()).unwrap()
        });
        let a = NcclLink::connect(&gpu, id, 0, timeout, abort.clone()).unwrap();
        (a, joiner.join().unwrap(), abort, gpu)
    }

    #[test]
    fn values_cross_bit_exact_and_a_forged_secret_is_not_admitted() {
        let (mut a, mut b, _, gpu) = pair(Duration::from_secs(10));
        let host: Vec<f32> = (0..1000).map(|i| i as f32 * 0.37 - 5.0).collect();
        let sent = gpu.upload(&host).unwrap();
        let mut got: Buf<f32> = gpu.zeros(1200).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        a.send(&sent, 1000, deadline).unwrap();
        a.send(&sent, 10, deadline).unwrap();
        b.recv(&mut got, 1000, deadline).unwrap();
        a.wait(deadline).unwrap();
        assert_eq!(gpu.download_prefix(&got, 1000).unwrap(), host);
        // A size other than the one expected kills the link.
        let err = b.recv(&mut got, 11, deadline).unwrap_err().to_string();
        assert!(err.contains("10 elements where 11"), "{err}");

        let id = LinkId::new().unwrap();
        let mut forged = id.to_bytes();
        forged[20] ^= 1;
        let intruder = std::thread::spawn(move || {
            let gpu = Gpu::open(0, Precision::Fp32).unwrap();
            let short = Duration::from_millis(300);
            NcclLink::connect(&gpu, LinkId::from_bytes(forged), 1, short, Abort::default())
        });
        let err = NcclLink::connect(&gpu, id, 0, Duration::from_secs(1), Abort::default())
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(err.contains("deadline passed"), "{err}");
        let _ = intruder.join();
    }

    /// A receive from a peer that is gone hangs, as NCCL's does, until the abort handle is
    /// tripped; the link is dead afterwards.
    #[test]
    fn a_receive_from_a_lost_peer_ends_only_through_the_abort() {
        let (mut a, b, abort, gpu) = pair(Duration::from_secs(10));
        drop(b);
        let tripper = {
            let abort = abort.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                abort.abort();
            })
        };
        let started = Instant::now();
        let mut buf: Buf<f32> = gpu.zeros(4).unwrap();
        let err = a
            .recv(&mut buf, 4, Instant::now() + Duration::from_secs(30))
            .unwrap_err()
            .to_string();
        assert!(started.elapsed() >= Duration::from_millis(300), "{err}");
        assert!(err.contains("declared lost"), "{err}");
        tripper.join().unwrap();
        let err = a.send(&buf, 4, Instant::now()).unwrap_err().to_string();
        assert!(err.contains("aborted earlier"), "{err}");
    }
}
