//! What the two ends of a device link between neighbouring stages share before the link exists:
//! its rendezvous id ([`LinkId`], created by the earlier stage and handed to the later one over
//! their authenticated TCP link) and the [`Abort`] handle that the runtime trips when the peer's
//! TCP link dies. `nccl` (NCCL on a GPU) and its emulation (tests) build the link itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::error::{GpuError, Result, shape};

/// The rendezvous of one link: NCCL's 128-byte unique id (it holds the creating host's address).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LinkId([u8; 128]);

impl LinkId {
    /// The bytes to send to the peer.
    pub fn to_bytes(self) -> [u8; 128] {
        self.0
    }

    /// The id a peer sent. Any 128 bytes are accepted here; a forged id can only make the
    /// rendezvous fail or time out, which [`NcclLink::connect`] reports.
    pub fn from_bytes(bytes: [u8; 128]) -> LinkId {
        LinkId(bytes)
    }

    /// The id as a hex string (for a command line).
    pub fn to_hex(self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`LinkId::to_hex`]'s form.
    pub fn from_hex(hex: &str) -> Result<LinkId> {
        let bad = || GpuError::Shape {
            op: "LinkId::from_hex",
            reason: format!(
                "{:?} is not a link id (256 hex digits)",
                hex.chars().take(40).collect::<String>()
            ),
        };
        if hex.len() != 256 || !hex.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 128];
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(LinkId(out))
    }
}

impl std::fmt::Debug for LinkId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The id holds a host address and a secret-ish magic: never log it whole.
        write!(f, "LinkId({}…)", &self.to_hex()[..8])
    }
}

/// Trips a link from another thread: its current or next wait aborts the communicator.
#[derive(Clone, Default)]
pub struct Abort(Arc<AtomicBool>);

impl Abort {
    /// Asks the link to abort (the peer is gone).
    pub fn abort(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether [`Abort::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// An abort handle tripped by whoever sets `flag` (the runtime's TCP link to the same peer sets it
/// when that link dies).
impl From<Arc<AtomicBool>> for Abort {
    fn from(flag: Arc<AtomicBool>) -> Self {
        Abort(flag)
    }
}

/// The checks every link makes, whatever carries it.
impl Abort {
    /// Why a wait on a link must end now (the handle was tripped, or `deadline` passed), as the
    /// error that ends it; `Ok` while it may go on.
    pub(crate) fn check(&self, what: &str, deadline: Instant) -> Result<()> {
        let why = if self.is_aborted() {
            "the peer was declared lost"
        } else if Instant::now() >= deadline {
            "the deadline passed with the peer silent"
        } else {
            return Ok(());
        };
        Err(GpuError::LinkAborted {
            during: what.into(),
            why: why.into(),
        })
    }
}

/// A transfer of `n` elements of a buffer of `len` on a link that is `dead` (aborted) or not.
pub(crate) fn check_transfer(op: &'static str, n: usize, len: usize, dead: bool) -> Result<()> {
    if n == 0 || n > len {
        return shape(op, format!("{n} elements of a buffer of {len}"));
    }
    check_alive(op, dead)
}

/// A call on a link that is `dead` (aborted earlier) fails.
pub(crate) fn check_alive(what: &str, dead: bool) -> Result<()> {
    if dead {
        return Err(GpuError::LinkAborted {
            during: what.into(),
            why: "the link was aborted earlier; rebuild it with a new LinkId".into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_ids_round_trip_through_hex_and_bad_ones_are_refused() {
        let id = LinkId::from_bytes(std::array::from_fn(|i| (i * 7) as u8));
        assert_eq!(LinkId::from_hex(&id.to_hex()).unwrap(), id);
        assert_eq!(format!("{id:?}"), "LinkId(00070e15…)");
        for bad in [
            "",
            "zz",
            &"g".repeat(256),
            &"0".repeat(255),
            &"é".repeat(128),
        ] {
            let err = LinkId::from_hex(bad).unwrap_err().to_string();
            assert!(err.contains("is not a link id"), "{err}");
        }
    }

    #[test]
    fn an_abort_handle_trips_every_clone_and_its_flag() {
        let a = Abort::default();
        let b = a.clone();
        assert!(!b.is_aborted());
        a.abort();
        assert!(b.is_aborted());
        let flag = Arc::new(AtomicBool::new(false));
        let c = Abort::from(Arc::clone(&flag));
        flag.store(true, Ordering::SeqCst);
        assert!(c.is_aborted());
    }
}
