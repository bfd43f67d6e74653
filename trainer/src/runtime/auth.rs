//! Mutual job-token authentication of every connection (coordinator, stage data and snapshot
//! ports), and the gate that runs it off the critical path.
//!
//! Handshake (both sides prove the token; it never crosses the wire):
//!
//! ```text
//! acceptor  → connector : MAGIC, nonce_a (32 B)
//! connector → acceptor  : nonce_c (32 B), MAC(token; "connector", purpose, nonce_a, nonce_c)
//! acceptor  → connector : MAC(token; "acceptor", purpose, nonce_a, nonce_c)
//! ```
//!
//! The MAC is BLAKE3 keyed by a hash of the token. Each proof is bound to both nonces, to the
//! port's [`Purpose`] and to the prover's role, so a proof taken from one connection (or one port,
//! or reflected back at its sender) is useless on another. Each side gives up after
//! [`HANDSHAKE_TIMEOUT`]. The handshake authenticates the peer; it does not encrypt the stream
//! (run jobs on a private network, as for NCCL or Gloo).
//!
//! [`Gate`] accepts a listener's connections on a thread of its own and authenticates each on a
//! short-lived thread of its own, with at most [`MAX_PENDING`] handshakes in flight (a new connection
//! ends the oldest handshake): silent or hostile connections cost the training thread nothing, and a
//! crowd of them cannot keep an honest peer out.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tracing::{debug, warn};

/// Environment variable holding the job's shared secret.
pub const TOKEN_ENV: &str = "SEQPIPE_JOB_TOKEN";

/// How long either side waits for the other's part of the handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Handshakes a [`Gate`] runs at once; a new connection beyond ends the oldest one.
pub const MAX_PENDING: usize = 64;

const MAGIC: &[u8; 8] = b"SQPAUTH2";

/// What a port is for: a proof made for one purpose is refused by the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// The coordinator's control port (workers and agents connect).
    Control,
    /// A stage's data port (the previous stage connects).
    Data,
    /// An agent's peer-snapshot port (workers connect).
    Snapshot,
    /// A worker's gradient-reduction port (the other data-parallel replicas of its stage
    /// connect).
    Reduce,
}

impl Purpose {
    fn label(self) -> &'static [u8] {
        match self {
            Purpose::Control => b"control",
            Purpose::Data => b"data",
            Purpose::Snapshot => b"snapshot",
            Purpose::Reduce => b"reduce",
        }
    }
}

/// Why the job token in `SEQPIPE_JOB_TOKEN` cannot be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JobTokenError {
    /// Set but empty or blank.
    #[error(
        "{TOKEN_ENV} is set but empty; an empty job secret is refused rather than replaced: set it \
         to the same secret on the coordinator and every agent (e.g. `openssl rand -hex 16`), or \
         unset it for a single-machine `seqpipe train` (a random one is made)"
    )]
    Empty,
    /// Not set where the job's shared secret is required: an agent, a worker, or a coordinator
    /// that waits for remote agents. Only a local `seqpipe train` makes up its own.
    #[error(
        "{TOKEN_ENV} is not set, and {0} needs the job's shared secret: set it to the same secret \
         on the coordinator and every agent (e.g. `export {TOKEN_ENV}=$(openssl rand -hex 16)`); \
         only a single-machine `seqpipe train` (elastic.local_agents = true) makes one up itself"
    )]
    Unset(&'static str),
}

/// The job token set in `SEQPIPE_JOB_TOKEN`: `None` when unset, an error when set but blank.
pub fn token_from_env() -> Result<Option<String>, JobTokenError> {
    checked(std::env::var(TOKEN_ENV).ok())
}

/// The job token of a process that talks to other hosts (`who`: "an agent", "a worker", …):
/// `SEQPIPE_JOB_TOKEN`, which must be set and non-blank. Nothing falls back to a guessable one.
pub fn required_token(who: &'static str) -> Result<String, JobTokenError> {
    required(std::env::var(TOKEN_ENV).ok(), who)
}

/// The coordinator's job token. A coordinator that starts its own agents on this machine
/// (`local_agents`) uses `SEQPIPE_JOB_TOKEN`, or a fresh random one when it is unset and hands it
/// to its agents; one that waits for remote agents needs it set ([`required_token`]): a secret
/// it made up could not be shared, and an empty one would let anyone in.
pub fn coordinator_token(local_agents: bool) -> Result<String, JobTokenError> {
    for_coordinator(std::env::var(TOKEN_ENV).ok(), local_agents)
}

/// The variable's value (`None`: unset) as a token; blank is refused.
fn checked(value: Option<String>) -> Result<Option<String>, JobTokenError> {
    match value {
        Some(t) if t.trim().is_empty() => Err(JobTokenError::Empty),
        other => Ok(other),
    }
}

fn required(value: Option<String>, who: &'static str) -> Result<String, JobTokenError> {
    checked(value)?.ok_or(JobTokenError::Unset(who))
}

fn for_coordinator(value: Option<String>, local_agents: bool) -> Result<String, JobTokenError> {
    match checked(value)? {
        Some(token) => Ok(token),
        None if local_agents => Ok(format!("{:032x}", rand::random::<u128>())),
        None => Err(JobTokenError::Unset(
            "a coordinator waiting for remote agents (elastic.local_agents = false)",
        )),
    }
}

/// A public fingerprint of the job token (BLAKE3 of a domain-separated token): the etcd
/// rendezvous stores it so that nodes of another job are refused, without storing the token.
pub fn fingerprint(token: &str) -> String {
    blake3::keyed_hash(&key(token), b"seqpipe job fingerprint")
        .to_hex()
        .to_string()
}

fn key(token: &str) -> [u8; 32] {
    *blake3::hash(token.as_bytes()).as_bytes()
}

#[derive(Clone, Copy)]
enum Role {
    Acceptor,
    Connector,
}

fn proof(
    token: &str,
    role: Role,
    purpose: Purpose,
    nonce_a: &[u8; 32],
    nonce_c: &[u8; 32],
) -> [u8; 32] {
    let mut mac = blake3::Hasher::new_keyed(&key(token));
    mac.update(b"seqpipe-auth-v2\0");
    mac.update(match role {
        Role::Acceptor => b"acceptor\0",
        Role::Connector => b"connector",
    });
    mac.update(purpose.label());
    mac.update(b"\0");
    mac.update(nonce_a);
    mac.update(nonce_c);
    *mac.finalize().as_bytes()
}

/// Constant-time equality of two proofs.
fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn denied(why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("authentication failed: {why} (does the peer share this job's {TOKEN_ENV}?)"),
    )
}

/// Runs `f` with `HANDSHAKE_TIMEOUT` on reads and writes, restoring the stream's timeouts after.
fn with_deadline<T>(
    stream: &mut TcpStream,
    f: impl FnOnce(&mut TcpStream) -> io::Result<T>,
) -> io::Result<T> {
    let (read, write) = (stream.read_timeout()?, stream.write_timeout()?);
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let result = f(stream);
    stream.set_read_timeout(read)?;
    stream.set_write_timeout(write)?;
    result
}

/// Accepting side: proves the token to the peer and checks the peer's proof. On error the caller
/// drops (closes) the stream.
pub fn accept(stream: &mut TcpStream, token: &str, purpose: Purpose) -> io::Result<()> {
    with_deadline(stream, |stream| {
        let nonce_a: [u8; 32] = rand::random();
        let mut hello = [0u8; 40];
        hello[..8].copy_from_slice(MAGIC);
        hello[8..].copy_from_slice(&nonce_a);
        stream.write_all(&hello)?;
        let mut answer = [0u8; 64];
        stream
            .read_exact(&mut answer)
            .map_err(|e| denied(&format!("no answer to the challenge ({e})")))?;
        let nonce_c: [u8; 32] = answer[..32].try_into().expect("32 bytes");
        let got: [u8; 32] = answer[32..].try_into().expect("32 bytes");
        let expected = proof(token, Role::Connector, purpose, &nonce_a, &nonce_c);
        if !same(&got, &expected) {
            return Err(denied("the connecting peer's proof is wrong"));
        }
        stream.write_all(&proof(token, Role::Acceptor, purpose, &nonce_a, &nonce_c))?;
        stream.flush()
    })
}

/// Connecting side: checks that the acceptor knows the token too, after proving it.
pub fn connect(stream: &mut TcpStream, token: &str, purpose: Purpose) -> io::Result<()> {
    with_deadline(stream, |stream| {
        let mut hello = [0u8; 40];
        stream.read_exact(&mut hello).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("no authentication challenge from the peer: {e}"),
            )
        })?;
        if &hello[..8] != MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the peer is not a seqpipe endpoint of this version (no authentication challenge)",
            ));
        }
        let nonce_a: [u8; 32] = hello[8..].try_into().expect("32 bytes");
        let nonce_c: [u8; 32] = rand::random();
        let mut answer = [0u8; 64];
        answer[..32].copy_from_slice(&nonce_c);
        answer[32..].copy_from_slice(&proof(token, Role::Connector, purpose, &nonce_a, &nonce_c));
        stream.write_all(&answer)?;
        stream.flush()?;
        let mut got = [0u8; 32];
        stream.read_exact(&mut got).map_err(|e| {
            denied(&format!(
                "the accepting peer did not prove the token ({e}); it refused ours, or it is not this job's"
            ))
        })?;
        let expected = proof(token, Role::Acceptor, purpose, &nonce_a, &nonce_c);
        if !same(&got, &expected) {
            return Err(denied("the accepting peer's proof is wrong"));
        }
        Ok(())
    })
}

/// Accepts and authenticates a listener's connections in the background (see the module comment).
pub struct Gate {
    stop: Arc<AtomicBool>,
}

impl Gate {
    /// Starts accepting on `listener` (named `name` in logs and thread names). Each connection
    /// whose peer passes [`accept`] for `purpose` is handed to `admit` on its handshake thread.
    pub fn start(
        name: &str,
        listener: TcpListener,
        token: String,
        purpose: Purpose,
        admit: impl Fn(TcpStream, SocketAddr) + Send + Sync + 'static,
    ) -> io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let admit = Arc::new(admit);
        let pending: Arc<Waiting> = Arc::default();
        let token: Arc<str> = token.into();
        let (flag, label) = (Arc::clone(&stop), name.to_string());
        listener.set_nonblocking(true)?;
        std::thread::Builder::new()
            .name(format!("{name}-accept"))
            .spawn(move || {
                let (mut next_id, mut evicted) = (0u64, 0u64);
                while !flag.load(Ordering::SeqCst) {
                    let (stream, peer) = match listener.accept() {
                        Ok(accepted) => accepted,
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(5));
                            continue;
                        }
                        Err(e) => {
                            warn!(port = %label, error = %e, "accepting a connection failed");
                            std::thread::sleep(Duration::from_millis(50));
                            continue;
                        }
                    };
                    next_id += 1;
                    let id = next_id;
                    {
                        let mut waiting = pending.lock().unwrap_or_else(|p| p.into_inner());
                        if waiting.len() >= MAX_PENDING {
                            // The oldest handshake has had the longest to finish: end it, so that
                            // a crowd of silent connections never keeps a new peer out.
                            if let Some((_, oldest)) = waiting.pop_front() {
                                let _ = oldest.shutdown(Shutdown::Both);
                            }
                            evicted += 1;
                            if evicted.is_power_of_two() {
                                warn!(port = %label, evicted, "too many connections waiting for authentication: closing the oldest");
                            }
                        }
                        match stream.try_clone() {
                            Ok(clone) => waiting.push_back((id, clone)),
                            Err(_) => continue,
                        }
                    }
                    let (token, admit, waiting, port) = (
                        Arc::clone(&token),
                        Arc::clone(&admit),
                        Arc::clone(&pending),
                        label.clone(),
                    );
                    let spawned = std::thread::Builder::new()
                        .name(format!("{label}-auth"))
                        .spawn(move || {
                            let mut stream = stream;
                            let result = stream
                                .set_nonblocking(false)
                                .and_then(|()| accept(&mut stream, &token, purpose));
                            forget(&waiting, id);
                            match result {
                                Ok(()) => admit(stream, peer),
                                Err(e) => {
                                    debug!(%port, %peer, error = %e, "closed an unauthenticated connection")
                                }
                            }
                        });
                    if spawned.is_err() {
                        forget(&pending, id);
                        warn!(port = %label, "cannot start a handshake thread; connection closed");
                    }
                }
            })?;
        Ok(Self { stop })
    }

    /// Stops accepting (connections already admitted are not affected).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Drop for Gate {
    /// A gate accepts for as long as its owner keeps it.
    fn drop(&mut self) {
        self.stop();
    }
}

/// Connections waiting for their handshake, oldest first (clones, to end them early).
type Waiting = Mutex<VecDeque<(u64, TcpStream)>>;

fn forget(waiting: &Waiting, id: u64) {
    waiting
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|(other, _)| *other != id);
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;
    use std::time::Instant;

    use super::*;

    /// Runs `client` against an acceptor holding `server_token`; the acceptor's result.
    fn handshake(
        server_token: &'static str,
        client: impl FnOnce(&mut TcpStream) + Send + 'static,
    ) -> io::Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            client(&mut s);
        });
        let (mut stream, _) = listener.accept().unwrap();
        let result = accept(&mut stream, server_token, Purpose::Control);
        drop(stream);
        t.join().unwrap();
        result
    }

    /// Unset is refused everywhere but by a local launcher, which makes a random token; blank is
    /// refused everywhere.
    #[test]
    fn an_unset_token_is_refused_except_by_a_local_launcher() {
        let err = required(None, "an agent").unwrap_err();
        assert_eq!(err, JobTokenError::Unset("an agent"));
        let text = err.to_string();
        assert!(
            text.contains("SEQPIPE_JOB_TOKEN is not set, and an agent needs")
                && text.contains("openssl rand"),
            "{text}"
        );
        assert!(matches!(
            for_coordinator(None, false),
            Err(JobTokenError::Unset(_))
        ));
        let (a, b) = (
            for_coordinator(None, true).unwrap(),
            for_coordinator(None, true).unwrap(),
        );
        assert!(a.len() == 32 && a != b, "{a} {b}");
        for blank in ["", " \t"] {
            let blank = Some(blank.to_string());
            assert_eq!(
                required(blank.clone(), "a worker"),
                Err(JobTokenError::Empty)
            );
            assert_eq!(for_coordinator(blank, true), Err(JobTokenError::Empty));
        }
        let set = Some("s3cret".to_string());
        assert_eq!(required(set.clone(), "a worker").unwrap(), "s3cret");
        assert_eq!(for_coordinator(set, false).unwrap(), "s3cret");
    }

    #[test]
    fn right_token_passes_wrong_token_wrong_purpose_and_silence_fail() {
        assert!(
            handshake("secret", |s| connect(s, "secret", Purpose::Control)
                .unwrap())
            .is_ok()
        );
        let err = handshake("secret", |s| {
            let _ = connect(s, "guess", Purpose::Control);
        })
        .unwrap_err();
        assert!(err.to_string().contains("proof is wrong"), "{err}");
        // Right token, wrong purpose: a proof for another port does not replay here.
        assert!(
            handshake("secret", |s| {
                let _ = connect(s, "secret", Purpose::Data);
            })
            .is_err()
        );
        // A client that sends something else and hangs up.
        assert!(
            handshake("secret", |s| s
                .write_all(b"GET / HTTP/1.1\r\n\r\n")
                .unwrap())
            .is_err()
        );
    }

    /// An acceptor that does not know the token is refused by the connecting side: it cannot
    /// produce the acceptor's proof, whatever it sends.
    #[test]
    fn a_connector_refuses_an_acceptor_without_the_token() {
        for server in [
            |s: &mut TcpStream| {
                let _ = accept(s, "not-the-token", Purpose::Control);
            },
            |s: &mut TcpStream| {
                // Speaks the protocol, then echoes the connector's own proof back (reflection).
                let mut hello = [0u8; 40];
                hello[..8].copy_from_slice(MAGIC);
                s.write_all(&hello).unwrap();
                let mut answer = [0u8; 64];
                s.read_exact(&mut answer).unwrap();
                s.write_all(&answer[32..]).unwrap();
            },
        ] {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let t = std::thread::spawn(move || {
                let (mut s, _) = listener.accept().unwrap();
                server(&mut s);
            });
            let mut s = TcpStream::connect(addr).unwrap();
            let err = connect(&mut s, "secret", Purpose::Control).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
            t.join().unwrap();
        }
    }

    /// A challenge relayed from another port (an oracle attack: the stranger forwards a real
    /// acceptor's nonce to a job member's acceptor hoping for a usable proof) gets a proof bound to
    /// the other purpose and role, which the real acceptor refuses.
    #[test]
    fn proofs_are_bound_to_role_purpose_and_both_nonces() {
        let (a, c) = ([1u8; 32], [2u8; 32]);
        let base = proof("t", Role::Connector, Purpose::Control, &a, &c);
        assert_ne!(base, proof("t", Role::Acceptor, Purpose::Control, &a, &c));
        assert_ne!(base, proof("t", Role::Connector, Purpose::Data, &a, &c));
        assert_ne!(base, proof("t", Role::Connector, Purpose::Control, &c, &a));
        assert_ne!(base, proof("u", Role::Connector, Purpose::Control, &a, &c));
    }

    /// Silent connections neither block nor delay an honest one behind them.
    #[test]
    fn a_gate_admits_an_honest_peer_past_a_crowd_of_silent_ones() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = channel();
        let tx = std::sync::Mutex::new(tx);
        let gate = Gate::start(
            "test",
            listener,
            "secret".into(),
            Purpose::Data,
            move |s, _| {
                let _ = tx.lock().unwrap().send(s);
            },
        )
        .unwrap();
        let silent: Vec<TcpStream> = (0..200)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let started = Instant::now();
        let mut honest = TcpStream::connect(addr).unwrap();
        connect(&mut honest, "secret", Purpose::Data).unwrap();
        rx.recv_timeout(Duration::from_secs(10)).unwrap();
        // Far below the 5 s handshake timeout that each silent connection costs its own thread.
        assert!(
            started.elapsed() < HANDSHAKE_TIMEOUT,
            "{:?}",
            started.elapsed()
        );
        gate.stop();
        drop(silent);
    }
}
