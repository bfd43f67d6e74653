//! A point-to-point NCCL link between the GPUs of two neighbouring pipeline stages: a two-rank
//! communicator (rank 0 the earlier stage) whose sends and receives run on a stream of its own,
//! device memory to device memory, with no host copy. Each transfer starts after the compute queued
//! before it (an event), so a send reads a finished output and a receive does not overwrite a
//! buffer the compute still reads. A pipeline uses one link per direction between two stages: on
//! one stream a send waiting for its receiver would hold up the receive of the other direction
//! queued behind it (the 1F1B deadlock).
//!
//! NCCL waits forever for a peer that died. This link never does: the communicator is
//! non-blocking (`blocking = 0`), every call and every transfer is awaited by polling with a
//! deadline, and an [`Abort`] handle — which the runtime trips when the peer's TCP link or its
//! heartbeat dies — makes the waiting side call `ncclCommAbort` and return an error, so recovery
//! proceeds. An aborted link is dead; the next plan generation builds a new one from a new
//! [`LinkId`], which the earlier stage creates and hands to the later one over their authenticated
//! TCP link (tensor headers keep going over TCP too).
//!
//! The communicator is owned here, at NCCL's `result`/`sys` level, not through cudarc's `Comm`:
//! dropping a `Comm` calls `ncclCommAbort(..).expect(..)`, so an abort that fails (a communicator
//! NCCL already tore down, a driver in a bad state) would panic in a destructor — during recovery,
//! exactly when the runtime must go on. Here a failed abort is part of the error returned (and a
//! stderr line from `Drop`), never a panic.
//!
//! NCCL refuses two ranks on one GPU ("Duplicate GPU detected") unless NCCL ≥ 2.30 and
//! `NCCL_MULTI_RANK_GPU_ENABLE=1`; stages that share a GPU use the host-staged link.

use std::ffi::CStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::{result, sys};

use crate::device::{Buf, Gpu};
use crate::error::{DriverContext, GpuError, Result, shape};
pub use crate::link::{Abort, LinkId};
use crate::link::{check_alive, check_transfer};

/// Checks that `libnccl` can be loaded (cudarc panics on a missing library at the first call).
pub fn nccl_present() -> Result<()> {
    // SAFETY: only tries to open the library.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuError::MissingLibrary {
            what: "NCCL",
            names: "libnccl.so",
            hint: "install the nvidia-nccl wheel or NCCL package and put the directory holding libnccl.so on LD_LIBRARY_PATH (the wheel ships only libnccl.so.2: add a libnccl.so symlink)",
        })
    }
}

/// The loaded NCCL's version as `(major, minor, patch)`.
pub fn nccl_version() -> Result<(u32, u32, u32)> {
    nccl_present()?;
    let code = result::get_nccl_version().map_err(|e| nccl_error("reading the version", e.0))?;
    let code = code.max(0) as u32;
    // NCCL_VERSION(X, Y, Z) is X*10000 + Y*100 + Z from 2.9 on (X*1000 + Y*100 + Z before).
    Ok(if code >= 20900 {
        (code / 10000, code % 10000 / 100, code % 100)
    } else {
        (code / 1000, code % 1000 / 100, code % 100)
    })
}

/// Whether two ranks may share one GPU with this NCCL (≥ 2.30 with
/// `NCCL_MULTI_RANK_GPU_ENABLE=1`).
pub fn shares_one_gpu(version: (u32, u32, u32)) -> bool {
    (version.0, version.1) >= (2, 30)
        && std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v.trim() == "1")
}

impl LinkId {
    /// A new id (on the earlier stage, which then sends it to the later one).
    pub fn new() -> Result<LinkId> {
        nccl_present()?;
        let id = result::get_uniqueid().map_err(|e| nccl_error("creating a link id", e.0))?;
        Ok(LinkId::from_bytes(id.internal.map(|c| c as u8)))
    }
}

/// One end of a two-rank NCCL link.
pub struct NcclLink {
    comm: sys::ncclComm_t,
    rank: usize,
    /// The link's own stream: its transfers.
    stream: Arc<CudaStream>,
    /// The GPU's compute stream, which each transfer starts after.
    compute: Arc<CudaStream>,
    abort: Abort,
    /// Aborted (by a trip, a timeout or an error): every later call fails.
    dead: bool,
}

// SAFETY: an NCCL communicator may be used from any one thread at a time (`&mut self` methods);
// `Drop` aborts it, which NCCL allows from any thread.
unsafe impl Send for NcclLink {}

impl Drop for NcclLink {
    fn drop(&mut self) {
        // Abort, not destroy: destroy waits for the peer, which may be gone. A failure has no
        // caller to go to: it is said, not panicked on.
        if let Some(failure) = self.kill() {
            eprintln!(
                "seqpipe: dropping an NCCL link (rank {}): {failure}",
                self.rank
            );
        }
    }
}

/// `err` with the failure of the abort that followed it (if any) added to its description.
pub(crate) fn with_abort_failure(err: GpuError, abort_failure: Option<String>) -> GpuError {
    let Some(failure) = abort_failure else {
        return err;
    };
    match err {
        GpuError::Nccl { during, detail } => GpuError::Nccl {
            during,
            detail: format!("{detail}; then {failure}"),
        },
        GpuError::LinkAborted { during, why } => GpuError::LinkAborted {
            during,
            why: format!("{why}; then {failure}"),
        },
        other => GpuError::Nccl {
            during: "aborting a link after an error".into(),
            detail: format!("{other}; then {failure}"),
        },
    }
}

impl NcclLink {
    /// Joins link `id` as `rank` (0: the earlier stage, 1: the later) on `gpu`'s device, with a
    /// stream of its own, waiting at most `timeout` for the peer.
    pub fn connect(
        gpu: &Gpu,
        id: LinkId,
        rank: usize,
        timeout: Duration,
        abort: Abort,
    ) -> Result<NcclLink> {
        if rank > 1 {
            return shape(
                "NcclLink::connect",
                format!("rank {rank} of a two-rank link"),
            );
        }
        nccl_present()?;
        gpu.bind()?;
        let stream = gpu
            .ctx()
            .new_stream()
            .during(|| "creating a link's stream".into())?;
        let mut config = non_blocking_config();
        let mut comm = std::ptr::null_mut();
        let unique = sys::ncclUniqueId {
            internal: id.to_bytes().map(|b| b as ::core::ffi::c_char),
        };
        // SAFETY: `comm` and `config` outlive the call; the id is 128 plain bytes.
        let status =
            unsafe { sys::ncclCommInitRankConfig(&mut comm, 2, unique, rank as i32, &mut config) };
        let mut link = NcclLink {
            comm,
            rank,
            stream,
            compute: Arc::clone(gpu.stream()),
            abort,
            dead: comm.is_null(),
        };
        match status.result() {
            Ok(_) if !comm.is_null() => {}
            Ok(_) => {
                return Err(nccl_error(
                    "joining a link",
                    sys::ncclResult_t::ncclInternalError,
                ));
            }
            Err(e) => {
                let failure = link.kill();
                return Err(with_abort_failure(
                    nccl_error("joining a link", e.0),
                    failure,
                ));
            }
        }
        link.settle(
            "joining the link (waiting for the peer)",
            Instant::now() + timeout,
        )?;
        Ok(link)
    }

    /// This end's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Queues a send of the first `n` elements of `buf` to the peer on the link's stream, after the
    /// compute queued so far, and waits until NCCL has taken the call (not the transfer: see
    /// [`NcclLink::wait`]). `buf` must not be written until the transfer is done.
    pub fn send(&mut self, buf: &Buf<f32>, n: usize, deadline: Instant) -> Result<()> {
        self.check_len("send", buf, n)?;
        self.after_compute()?;
        let peer = 1 - self.rank as i32;
        // SAFETY: `buf` holds at least `n` elements and lives until the stream passes the send
        // (the caller waits, or orders later writes on the same stream).
        let status = unsafe {
            result::send(
                buf.ptr() as *const _,
                n,
                sys::ncclDataType_t::ncclFloat32,
                peer,
                self.comm,
                self.stream.cu_stream() as _,
            )
        };
        self.after_call("queueing a send", status, deadline)
    }

    /// Receives `n` elements into `buf` from the peer, on the link's stream after the compute
    /// queued so far, and waits until they are there (see [`NcclLink::wait`]): work queued after
    /// it may read `buf`.
    pub fn recv(&mut self, buf: &mut Buf<f32>, n: usize, deadline: Instant) -> Result<()> {
        self.check_len("recv", buf, n)?;
        self.after_compute()?;
        let peer = 1 - self.rank as i32;
        // SAFETY: as in `send`; the stream orders later reads after the receive.
        let status = unsafe {
            result::recv(
                buf.ptr() as *mut _,
                n,
                sys::ncclDataType_t::ncclFloat32,
                peer,
                self.comm,
                self.stream.cu_stream() as _,
            )
        };
        self.after_call("queueing a receive", status, deadline)?;
        self.wait(deadline)
    }

    /// Makes the link's stream wait for the compute queued so far (on the device).
    fn after_compute(&mut self) -> Result<()> {
        let queued = self
            .compute
            .record_event(None)
            .during(|| "marking the compute a transfer follows".into())?;
        self.stream
            .wait(&queued)
            .during(|| "ordering a transfer after the compute".into())
    }

    /// Waits until every transfer queued on the link so far is done, polling so that a trip of
    /// the [`Abort`], an NCCL error or the deadline ends the wait by aborting the link instead of
    /// hanging.
    pub fn wait(&mut self, deadline: Instant) -> Result<()> {
        self.alive("waiting for a transfer")?;
        let done: CudaEvent = self
            .stream
            .record_event(None)
            .during(|| "marking a transfer's end".into())?;
        let mut pause = Duration::from_micros(20);
        loop {
            if done
                .try_is_complete()
                .during(|| "waiting for a transfer".into())?
            {
                return self.async_error("the transfer");
            }
            self.check_abort("waiting for a transfer", deadline)?;
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    fn check_len(&self, op: &'static str, buf: &Buf<f32>, n: usize) -> Result<()> {
        check_transfer(op, n, buf.len(), self.dead)
    }

    fn alive(&self, what: &str) -> Result<()> {
        check_alive(what, self.dead)
    }

    /// After a non-blocking call: an error kills the link; in progress: wait for it to settle.
    fn after_call(
        &mut self,
        what: &str,
        status: std::result::Result<result::NcclStatus, result::NcclError>,
        deadline: Instant,
    ) -> Result<()> {
        match status {
            Ok(result::NcclStatus::InProgress) => self.settle(what, deadline),
            Ok(_) => Ok(()),
            Err(e) => {
                let err = self.error(what, e.0);
                Err(with_abort_failure(err, self.kill()))
            }
        }
    }

    /// Polls the communicator's state until the last call is no longer in progress.
    fn settle(&mut self, what: &str, deadline: Instant) -> Result<()> {
        let mut pause = Duration::from_micros(20);
        loop {
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: the communicator is live (not dead) and `state` is a valid out pointer.
            let polled = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
            if let Err(e) = polled.result() {
                let err = self.error(what, e.0);
                return Err(with_abort_failure(err, self.kill()));
            }
            match state {
                sys::ncclResult_t::ncclSuccess => return Ok(()),
                sys::ncclResult_t::ncclInProgress => {}
                failed => {
                    let err = self.error(what, failed);
                    return Err(with_abort_failure(err, self.kill()));
                }
            }
            self.check_abort(what, deadline)?;
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// An asynchronous error NCCL recorded (a network failure during a transfer).
    fn async_error(&mut self, what: &str) -> Result<()> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: as in `settle`.
        let _ = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        match state {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
            failed => {
                let err = self.error(what, failed);
                Err(with_abort_failure(err, self.kill()))
            }
        }
    }

    /// Aborts the link if it was tripped or the deadline passed.
    fn check_abort(&mut self, what: &str, deadline: Instant) -> Result<()> {
        self.abort
            .check(what, deadline)
            .map_err(|e| with_abort_failure(e, self.kill()))
    }

    /// Aborts the communicator (once): any kernel still waiting on the peer is torn down.
    /// Returns what went wrong if `ncclCommAbort` failed (the link is dead either way: it is
    /// never used again).
    fn kill(&mut self) -> Option<String> {
        if self.dead {
            return None;
        }
        self.dead = true;
        // SAFETY: the communicator is live and released once.
        match unsafe { result::comm_abort(self.comm) } {
            Ok(_) => None,
            Err(e) => Some(format!(
                "ncclCommAbort failed too ({}); the communicator is abandoned",
                match nccl_error("aborting", e.0) {
                    GpuError::Nccl { detail, .. } => detail,
                    other => other.to_string(),
                }
            )),
        }
    }

    fn error(&self, what: &str, code: sys::ncclResult_t) -> GpuError {
        let mut err = nccl_error(what, code);
        if let GpuError::Nccl { detail, .. } = &mut err {
            // SAFETY: NCCL returns a static NUL-terminated string or null.
            let last = unsafe { sys::ncclGetLastError(self.comm) };
            if !last.is_null() {
                let text = unsafe { CStr::from_ptr(last) }.to_string_lossy();
                if !text.is_empty() {
                    detail.push_str(&format!(" ({text})"));
                }
            }
        }
        err
    }
}

/// A non-blocking communicator's config: `NCCL_CONFIG_INITIALIZER` of the 2.30 headers cudarc
/// binds, with `blocking = 0`. NCCL copies at most `size` bytes and keeps its defaults for the
/// rest, so an older library reads the fields it knows.
fn non_blocking_config() -> sys::ncclConfig_t {
    const UNDEF_INT: i32 = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 23000,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

fn nccl_error(what: &str, code: sys::ncclResult_t) -> GpuError {
    // SAFETY: NCCL returns a static NUL-terminated string for every result code.
    let text = unsafe { sys::ncclGetErrorString(code) };
    let detail = if text.is_null() {
        format!("{code:?}")
    } else {
        format!(
            "{code:?}: {}",
            unsafe { CStr::from_ptr(text) }.to_string_lossy()
        )
    };
    GpuError::Nccl {
        during: what.into(),
        detail,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_abort_is_added_to_the_error_not_panicked_on() {
        let failure = Some("ncclCommAbort failed too (invalid argument)".to_string());
        let err = with_abort_failure(
            GpuError::LinkAborted {
                during: "receiving".into(),
                why: "the peer is gone".into(),
            },
            failure.clone(),
        );
        let msg = err.to_string();
        assert!(
            msg.contains("the peer is gone") && msg.contains("ncclCommAbort failed too"),
            "{msg}"
        );
        assert!(matches!(err, GpuError::LinkAborted { .. }));
        let err = with_abort_failure(
            GpuError::Nccl {
                during: "sending".into(),
                detail: "remote process exited".into(),
            },
            failure,
        );
        assert!(
            err.to_string()
                .contains("remote process exited; then ncclCommAbort failed too")
        );
        let untouched = with_abort_failure(
            GpuError::Nccl {
                during: "sending".into(),
                detail: "x".into(),
            },
            None,
        );
        assert_eq!(untouched.to_string(), "NCCL failed during sending: x");
    }

    #[test]
    fn the_config_asks_for_a_non_blocking_communicator() {
        let c = non_blocking_config();
        assert_eq!((c.magic, c.blocking, c.version), (0xcafe_beef, 0, 23000));
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
    }

    #[test]
    fn sharing_a_gpu_needs_nccl_2_30() {
        assert!(!shares_one_gpu((2, 28, 3)));
    }

    /// Without NCCL (CI, this machine) the presence check turns cudarc's panic into a clear
    /// error; with it, the version reads.
    #[test]
    fn without_libnccl_every_entry_point_is_an_error_not_a_panic() {
        match nccl_present() {
            Ok(()) => assert!(nccl_version().unwrap().0 >= 2),
            Err(_) => {
                for err in [
                    nccl_version().map(|_| ()).unwrap_err(),
                    LinkId::new().map(|_| ()).unwrap_err(),
                ] {
                    let text = err.to_string();
                    assert!(
                        text.contains("libnccl.so") && text.contains("LD_LIBRARY_PATH"),
                        "{text}"
                    );
                }
            }
        }
    }
}
