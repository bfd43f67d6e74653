//! The harness's control links, one at a time: every connection from a node to the coordinator
//! (a node agent's, a stage worker's) goes through a relay that the harness owns, so that a
//! scenario can cut one link, or hold one direction of one link at a chosen message and later
//! deliver what it held (or drop it with the connection) — in the spirit of raft-rs's `Network`
//! (`cut`, `filter`, `recover`), over the real TCP protocol.
//!
//! A relay authenticates both ways with the job token (it is a peer of each end) and forwards
//! whole frames, each typed by its link and direction ([`Msg`]), so that a [`Hold`] can pick the
//! message it stops at ("stage 3's `StepDone` of step 4"). A held direction keeps everything after
//! the held message queued behind it, in order, as a stalled TCP stream would.
//!
//! Ends are mirrored as a dying process's sockets would be: when the node's end closes, the relay
//! closes its half towards the coordinator (after delivering anything held, once released); the
//! coordinator's end closing is recorded, so a scenario can wait until the coordinator has
//! handled a death ([`Link::wait_coordinator_closed`]: it drops its end of the connection once it
//! has read the close) before letting anything else through.
//!
//! Every wait here is for an event (a frame caught, a connection closed) with a generous limit,
//! never a sleep.

use std::collections::VecDeque;
use std::io::BufReader;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use trainer::runtime::auth::{self, Purpose};
use trainer::runtime::control::{FromAgent, ToAgent, ToLauncher, ToWorker};
use trainer::runtime::wire::{Frame, Limits, read_frame, write_frame};

use super::{SCENARIO_LIMIT, TOKEN, WorkerId};

/// Whose connection to the coordinator a link is.
#[derive(Clone, Debug)]
pub enum End {
    /// A node agent's control connection.
    Agent { node: String },
    /// A stage worker's control connection.
    Worker(WorkerId),
}

impl End {
    /// The node this end runs on.
    pub fn node(&self) -> &str {
        match self {
            End::Agent { node } => node,
            End::Worker(id) => &id.node,
        }
    }
}

/// A direction of a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// From the node (agent or worker) to the coordinator.
    ToCoordinator,
    /// From the coordinator to the node.
    FromCoordinator,
}

/// A message on a link, typed by its end and direction.
#[derive(Debug)]
pub enum Msg {
    FromAgent(FromAgent),
    ToAgent(ToAgent),
    FromWorker(ToLauncher),
    ToWorker(ToWorker),
    /// A frame that does not parse as its direction's messages (forwarded as it is).
    Unreadable,
}

impl Msg {
    fn of(end: &End, dir: Dir, frame: &Frame) -> Msg {
        let parsed = match (end, dir) {
            (End::Agent { .. }, Dir::ToCoordinator) => frame.header().map(Msg::FromAgent),
            (End::Agent { .. }, Dir::FromCoordinator) => frame.header().map(Msg::ToAgent),
            (End::Worker(_), Dir::ToCoordinator) => frame.header().map(Msg::FromWorker),
            (End::Worker(_), Dir::FromCoordinator) => frame.header().map(Msg::ToWorker),
        };
        parsed.unwrap_or(Msg::Unreadable)
    }
}

type HoldMatcher = Box<dyn Fn(&End, Dir, &Msg) -> bool + Send + Sync>;

/// Stops one direction of one link at the first message `matcher` accepts (on any link): that
/// message and every later one of the direction stay queued until [`Hold::release`] delivers
/// them, or [`Hold::drop_with_connection`] discards them and cuts the link.
pub struct Hold {
    matcher: HoldMatcher,
    state: Mutex<HoldState>,
    changed: Condvar,
}

#[derive(Default)]
struct HoldState {
    /// The direction it stopped, once it caught a message.
    caught: Option<(Arc<Link>, Dir)>,
    /// Released or dropped: it catches nothing more.
    done: bool,
}

impl Hold {
    pub(super) fn new(matcher: impl Fn(&End, Dir, &Msg) -> bool + Send + Sync + 'static) -> Self {
        Self {
            matcher: Box::new(matcher),
            state: Mutex::default(),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HoldState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until it caught its message (at most the scenario limit); returns the link's end.
    pub fn wait_caught(&self) -> End {
        let state = self.lock();
        let (state, _) = self
            .changed
            .wait_timeout_while(state, SCENARIO_LIMIT, |s| s.caught.is_none())
            .unwrap_or_else(|p| p.into_inner());
        match &state.caught {
            Some((link, _)) => link.end.clone(),
            None => panic!("a hold never caught its message within {SCENARIO_LIMIT:?}"),
        }
    }

    /// Delivers what it held, in order, and lets the direction flow again; if the sending end
    /// closed meanwhile, the link's half towards the receiver closes after the held messages.
    pub fn release(&self) {
        let caught = {
            let mut state = self.lock();
            state.done = true;
            state.caught.clone()
        };
        if let Some((link, dir)) = caught {
            link.valve(dir).release();
        }
    }

    /// Discards what it held and cuts the link (both ends see the connection close).
    pub fn drop_with_connection(&self) {
        let caught = {
            let mut state = self.lock();
            state.done = true;
            state.caught.clone()
        };
        if let Some((link, dir)) = caught {
            link.valve(dir).discard();
            link.cut();
        }
    }

    /// Takes `msg` of `link`'s `dir` if it is this hold's message and it caught none yet.
    fn catch(&self, link: &Arc<Link>, dir: Dir, msg: &Msg) -> bool {
        let mut state = self.lock();
        if state.done || state.caught.is_some() || !(self.matcher)(&link.end, dir, msg) {
            return false;
        }
        state.caught = Some((Arc::clone(link), dir));
        self.changed.notify_all();
        true
    }
}

/// The holds armed in a cluster, shared with its links.
pub(super) type Holds = Arc<Mutex<Vec<Arc<Hold>>>>;

/// One direction of a link: its receiving socket and what is held back from it.
struct Valve {
    state: Mutex<ValveState>,
    /// Frames written to the sink so far (counted before each write).
    delivered: AtomicU64,
}

struct ValveState {
    /// Where the direction's frames go.
    sink: TcpStream,
    /// Stopped by a hold: frames queue.
    held: bool,
    queue: VecDeque<Frame>,
    /// The sending end closed while frames were held: close the sink after delivering them.
    source_ended: bool,
}

impl Valve {
    fn new(sink: TcpStream) -> Self {
        Self {
            state: Mutex::new(ValveState {
                sink,
                held: false,
                queue: VecDeque::new(),
                source_ended: false,
            }),
            delivered: AtomicU64::new(0),
        }
    }

    /// Writes `frame` to the sink, counted first (so that the receiver, once it has read it,
    /// sees it counted).
    fn deliver(&self, sink: &mut TcpStream, frame: &Frame) -> std::io::Result<()> {
        self.delivered.fetch_add(1, Ordering::SeqCst);
        write_frame(sink, frame)
    }

    fn lock(&self) -> MutexGuard<'_, ValveState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn release(&self) {
        let mut state = self.lock();
        state.held = false;
        while let Some(frame) = state.queue.pop_front() {
            let _ = self.deliver(&mut state.sink, &frame);
        }
        if state.source_ended {
            let _ = state.sink.shutdown(Shutdown::Write);
        }
    }

    fn discard(&self) {
        let mut state = self.lock();
        state.held = false;
        state.queue.clear();
    }
}

/// A relayed connection between a node and the coordinator.
pub struct Link {
    pub end: End,
    /// The node's socket (the relay's accepted end).
    node: TcpStream,
    /// The coordinator's socket (the relay's connected end).
    coordinator: TcpStream,
    to_coordinator: Valve,
    from_coordinator: Valve,
    /// The coordinator closed its end (it read the node's close, or ended the connection).
    coordinator_closed: Mutex<bool>,
    closed_changed: Condvar,
}

impl Link {
    fn valve(&self, dir: Dir) -> &Valve {
        match dir {
            Dir::ToCoordinator => &self.to_coordinator,
            Dir::FromCoordinator => &self.from_coordinator,
        }
    }

    /// Freezes the link both ways, as a partition would: from now on nothing is delivered in
    /// either direction, and the connection stays open (until the scenario ends).
    pub fn freeze(&self) {
        self.to_coordinator.lock().held = true;
        self.from_coordinator.lock().held = true;
    }

    /// How many frames the coordinator's side has delivered to the node so far.
    pub fn delivered_to_node(&self) -> u64 {
        self.from_coordinator.delivered.load(Ordering::SeqCst)
    }

    /// Cuts the link: both ends see the connection close, nothing held is delivered.
    pub fn cut(&self) {
        self.to_coordinator.discard();
        self.from_coordinator.discard();
        let _ = self.node.shutdown(Shutdown::Both);
        let _ = self.coordinator.shutdown(Shutdown::Both);
    }

    /// Waits until the coordinator has closed its end of the link (at most the scenario limit).
    /// After a node's close, the coordinator drops its end when it handles the close: the death
    /// is known to it then.
    pub fn wait_coordinator_closed(&self) {
        let closed = self
            .coordinator_closed
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (closed, _) = self
            .closed_changed
            .wait_timeout_while(closed, SCENARIO_LIMIT, |c| !*c)
            .unwrap_or_else(|p| p.into_inner());
        assert!(
            *closed,
            "the coordinator never closed its end of {:?}",
            self.end
        );
    }

    /// Forwards the frames of `dir` from `source` until it ends, through the holds.
    fn forward(self: &Arc<Self>, dir: Dir, source: TcpStream, holds: &Holds) {
        let mut reader = BufReader::new(source);
        while let Ok(frame) = read_frame(&mut reader, Limits::CONTROL) {
            let valve = self.valve(dir);
            let mut state = valve.lock();
            if !state.held {
                let msg = Msg::of(&self.end, dir, &frame);
                let armed: Vec<Arc<Hold>> = holds.lock().unwrap_or_else(|p| p.into_inner()).clone();
                state.held = armed.iter().any(|h| h.catch(self, dir, &msg));
            }
            if state.held {
                state.queue.push_back(frame);
            } else if valve.deliver(&mut state.sink, &frame).is_err() && dir == Dir::ToCoordinator {
                // The coordinator's end is gone: nothing more to deliver that way.
                break;
            }
            // A write to a dead node fails; the coordinator's messages are still read, so that
            // its own close is seen.
        }
        let mut state = self.valve(dir).lock();
        if state.held {
            state.source_ended = true;
        } else {
            let _ = state.sink.shutdown(Shutdown::Write);
        }
        drop(state);
        if dir == Dir::FromCoordinator {
            *self
                .coordinator_closed
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = true;
            self.closed_changed.notify_all();
        }
    }
}

/// A relay listening for one node's connection: [`Relay::addr`] is where the node connects
/// instead of the coordinator.
pub struct Relay {
    pub addr: String,
}

/// Starts a relay for `end` towards the coordinator at `coordinator`; the link, once the node
/// connected, is pushed to `links`. Gives up waiting for the node when `closing` is set or after
/// the scenario limit (a worker killed before it connected never comes).
pub(super) fn relay(
    end: End,
    coordinator: &str,
    holds: &Holds,
    links: &Arc<Mutex<Vec<Arc<Link>>>>,
    closing: &Arc<AtomicBool>,
) -> Relay {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binding a relay");
    let addr = listener.local_addr().expect("relay address").to_string();
    let (coordinator, holds, links, closing) = (
        coordinator.to_string(),
        Arc::clone(holds),
        Arc::clone(links),
        Arc::clone(closing),
    );
    std::thread::Builder::new()
        .name(format!("relay-{}", end.node()))
        .spawn(move || {
            let Some(node) = accept_one(&listener, &closing) else {
                return;
            };
            let Some(link) = connect_link(end, node, &coordinator) else {
                return;
            };
            links
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Arc::clone(&link));
            let up_source = link.node.try_clone().expect("relay socket");
            let down_source = link.coordinator.try_clone().expect("relay socket");
            let (up, up_holds) = (Arc::clone(&link), Arc::clone(&holds));
            std::thread::Builder::new()
                .name("relay-up".into())
                .spawn(move || up.forward(Dir::ToCoordinator, up_source, &up_holds))
                .expect("relay thread");
            link.forward(Dir::FromCoordinator, down_source, &holds);
        })
        .expect("relay thread");
    Relay { addr }
}

/// The node's connection to the relay, authenticated as the coordinator would.
fn accept_one(listener: &TcpListener, closing: &AtomicBool) -> Option<TcpStream> {
    listener.set_nonblocking(true).ok()?;
    let deadline = Instant::now() + SCENARIO_LIMIT;
    let mut node = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if closing.load(Ordering::SeqCst) || Instant::now() >= deadline {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(_) => return None,
        }
    };
    node.set_nonblocking(false).ok()?;
    auth::accept(&mut node, TOKEN, Purpose::Control).ok()?;
    Some(node)
}

/// Connects the relay to the coordinator (authenticated as the node would); `None` (the node's
/// connection closed) if the coordinator cannot be reached.
fn connect_link(end: End, node: TcpStream, coordinator: &str) -> Option<Arc<Link>> {
    let mut upstream = match TcpStream::connect(coordinator) {
        Ok(s) => s,
        Err(_) => {
            let _ = node.shutdown(Shutdown::Both);
            return None;
        }
    };
    if auth::connect(&mut upstream, TOKEN, Purpose::Control).is_err() {
        let _ = node.shutdown(Shutdown::Both);
        return None;
    }
    let _ = node.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let to_coordinator = Valve::new(upstream.try_clone().ok()?);
    let from_coordinator = Valve::new(node.try_clone().ok()?);
    Some(Arc::new(Link {
        end,
        node,
        coordinator: upstream,
        to_coordinator,
        from_coordinator,
        coordinator_closed: Mutex::new(false),
        closed_changed: Condvar::new(),
    }))
}
