//! A worker's kill switch: lets a test harness that runs stage workers as threads of one process
//! (`tests/harness`) end one the way SIGKILL ends a worker process, and stop it at chosen points.
//!
//! A killed process's sockets are closed by the kernel and it computes nothing more. A worker run
//! with a switch registers every socket it opens or accepts (control connection, data port and
//! links, peer-snapshot connections); [`KillSwitch::kill`] shuts them all down, refuses sockets
//! registered later, and makes the worker's next check return an error at once. Before each
//! action of a step and each control message the worker asks the switch's `on_point` callback
//! whether to go on, die there, or hang there (alive, sockets open, silent — as under SIGSTOP).
//! The switch also carries the worker's preemption flag, which a process takes from SIGTERM.
//!
//! A node agent run in process (`agent::AgentHooks::kill_switch`) registers its control
//! connections and its snapshot port with a switch of its own, so that killing it ends it as
//! SIGKILL ends the agent process.
//!
//! The `seqpipe worker` and `seqpipe agent` binaries run without a switch: none of this changes
//! their behaviour.

use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::control::ToWorker;
use crate::schedule::Action;

/// Where a worker is when it consults its switch.
#[derive(Clone, Copy, Debug)]
pub enum Point<'a> {
    /// About to run action `index` (of `count`) of training step `step`.
    Action {
        step: u64,
        index: usize,
        count: usize,
        action: Action,
    },
    /// A control message just arrived and is about to be handled.
    Message(&'a ToWorker),
    /// The worker reported its part of step `step` done (`StepDone` is sent).
    StepDone { step: u64 },
    /// Data parallelism: about to reduce the gradients of step `step` with the other replicas of
    /// its stage, in reduction round `round`.
    Reduce { step: u64, round: u32 },
}

/// What the worker does at a [`Point`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Go on.
    Go,
    /// Die here, as under SIGKILL.
    Kill,
    /// Stop here with every socket open until killed, as under SIGSTOP.
    Hang,
}

/// How a worker run under a switch ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Killed, as by SIGKILL.
    Killed,
    /// Exited with this code.
    Exited(i32),
}

type OnPoint = dyn Fn(Point<'_>) -> Verdict + Send + Sync;

#[derive(Default)]
struct Sockets {
    ended: Option<Ending>,
    streams: Vec<TcpStream>,
    listeners: Vec<TcpListener>,
}

struct Inner {
    sockets: Mutex<Sockets>,
    /// Signalled when the worker ends (wakes a hung worker).
    ended: Condvar,
    leaving: Arc<AtomicBool>,
    on_point: Box<OnPoint>,
}

/// See the module comment. Clones share one switch.
#[derive(Clone)]
pub struct KillSwitch(Arc<Inner>);

impl std::fmt::Debug for KillSwitch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KillSwitch")
            .field("ended", &self.ending())
            .finish_non_exhaustive()
    }
}

impl KillSwitch {
    /// A switch whose worker asks `on_point` at every [`Point`].
    pub fn new(on_point: impl Fn(Point<'_>) -> Verdict + Send + Sync + 'static) -> Self {
        Self(Arc::new(Inner {
            sockets: Mutex::default(),
            ended: Condvar::new(),
            leaving: Arc::default(),
            on_point: Box::new(on_point),
        }))
    }

    fn sockets(&self) -> std::sync::MutexGuard<'_, Sockets> {
        self.0.sockets.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a socket of the worker; a worker already ended gets it shut down and an error.
    pub fn register(&self, stream: &TcpStream) -> io::Result<()> {
        let mut sockets = self.sockets();
        if sockets.ended.is_some() {
            let _ = stream.shutdown(Shutdown::Both);
            return Err(killed());
        }
        sockets.streams.push(stream.try_clone()?);
        Ok(())
    }

    /// Registers a listening socket of the worker (closed to new connections when it ends).
    pub fn register_listener(&self, listener: &TcpListener) -> io::Result<()> {
        let mut sockets = self.sockets();
        if sockets.ended.is_some() {
            shutdown_listener(listener);
            return Err(killed());
        }
        sockets.listeners.push(listener.try_clone()?);
        Ok(())
    }

    /// Kills the worker: as [`KillSwitch::end`] with [`Ending::Killed`].
    pub fn kill(&self) -> Ending {
        self.end(Ending::Killed)
    }

    /// Ends the worker as `how` unless it already ended: its sockets are shut down, later ones
    /// refused, a hung worker wakes. Returns how it ended (the first ending wins).
    pub fn end(&self, how: Ending) -> Ending {
        let mut sockets = self.sockets();
        let ending = *sockets.ended.get_or_insert(how);
        for s in sockets.streams.drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        for l in sockets.listeners.drain(..) {
            shutdown_listener(&l);
        }
        self.0.ended.notify_all();
        ending
    }

    /// How the worker ended, if it did.
    pub fn ending(&self) -> Option<Ending> {
        self.sockets().ended
    }

    /// Whether the worker ended.
    pub fn is_ended(&self) -> bool {
        self.ending().is_some()
    }

    /// The worker's preemption flag (what SIGTERM sets for a worker process).
    pub fn leaving(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.0.leaving)
    }

    /// Gives the worker a preemption notice.
    pub fn notify_leaving(&self) {
        self.0.leaving.store(true, Ordering::SeqCst);
    }

    /// The worker is at `point`: asks the callback, and dies or hangs there as it says. An error
    /// means the worker ended and must return at once.
    pub fn at(&self, point: Point<'_>) -> io::Result<()> {
        if self.is_ended() {
            return Err(killed());
        }
        match (self.0.on_point)(point) {
            Verdict::Go => {}
            Verdict::Kill => {
                self.kill();
            }
            Verdict::Hang => {
                let sockets = self.sockets();
                let _ended = self
                    .0
                    .ended
                    .wait_while(sockets, |s| s.ended.is_none())
                    .unwrap_or_else(|p| p.into_inner());
            }
        }
        if self.is_ended() {
            return Err(killed());
        }
        Ok(())
    }
}

fn killed() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "killed by its kill switch",
    )
}

/// Closes a listening socket to new connections (connecting peers are refused), as the end of
/// its process would.
fn shutdown_listener(listener: &TcpListener) {
    // SAFETY: shutdown(2) on a socket descriptor we own (the listener is borrowed, so open).
    unsafe {
        libc::shutdown(listener.as_raw_fd(), libc::SHUT_RDWR);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kill_shuts_registered_sockets_and_refuses_new_ones() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let a = TcpStream::connect(addr).unwrap();
        let (mut b, _) = listener.accept().unwrap();
        let switch = KillSwitch::new(|_| Verdict::Go);
        switch.register(&a).unwrap();
        switch.register_listener(&listener).unwrap();
        assert_eq!(switch.kill(), Ending::Killed);
        assert_eq!(switch.end(Ending::Exited(0)), Ending::Killed);
        // The peer reads the end of the stream.
        let mut buf = [0u8; 1];
        assert_eq!(io::Read::read(&mut b, &mut buf).unwrap(), 0);
        assert!(switch.register(&b).is_err());
        assert!(TcpStream::connect(addr).is_err());
        assert!(switch.at(Point::StepDone { step: 1 }).is_err());
    }

    #[test]
    fn a_hung_worker_wakes_when_killed() {
        let switch = KillSwitch::new(|_| Verdict::Hang);
        let hung = {
            let switch = switch.clone();
            std::thread::spawn(move || switch.at(Point::StepDone { step: 1 }))
        };
        switch.kill();
        assert!(hung.join().unwrap().is_err());
    }
}
