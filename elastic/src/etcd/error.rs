//! The etcd module's error type.

use std::io;
use std::time::Duration;

use super::lease::LeaseId;

/// Everything that can go wrong talking to etcd or with what it holds.
///
/// Each message says what failed, at which endpoint and for which key or request, and what to
/// do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// The rendezvous URL cannot be used.
    #[error(
        "invalid etcd URL `{url}`: {reason}; expected `etcd://HOST:PORT/PREFIX`, e.g. \
         `etcd://10.0.0.5:2379/seqpipe/my-job`"
    )]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },

    /// No TCP connection to etcd could be opened.
    #[error(
        "cannot reach etcd at {endpoint} for {request}: {source}; check that etcd is running \
         and that HOST:PORT in the URL is its client address (`--listen-client-urls`)"
    )]
    Unreachable {
        /// `host:port`.
        endpoint: String,
        /// The request, e.g. ``kv/put `/seqpipe/job/nodes/a` ``.
        request: String,
        /// The connect error.
        #[source]
        source: io::Error,
    },

    /// etcd accepted the connection but did not answer in time: the whole call (request and
    /// complete answer) has one deadline, so a server that answers too slowly ends here too.
    #[error(
        "etcd at {endpoint} did not answer {request} completely within {timeout:?} (the deadline \
         of the whole call); it may be overloaded, without a raft leader, or not etcd at all: \
         check its log and `etcdctl endpoint health`, then retry"
    )]
    Timeout {
        /// `host:port`.
        endpoint: String,
        /// The request.
        request: String,
        /// The deadline of the whole call that ran out (see
        /// [`EtcdClient::with_timeout`](super::EtcdClient::with_timeout)).
        timeout: Duration,
    },

    /// The connection broke in the middle of a request.
    #[error("connection to etcd at {endpoint} broke during {request}: {source}; retry it")]
    Io {
        /// `host:port`.
        endpoint: String,
        /// The request.
        request: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },

    /// The answer is not what etcd's JSON gateway sends: not HTTP, not its JSON, or over the
    /// size limits on headers and body.
    #[error(
        "unreadable answer from {endpoint} to {request}: {reason}; is HOST:PORT the client \
         address of an etcd 3.4 or later?"
    )]
    BadResponse {
        /// `host:port`.
        endpoint: String,
        /// The request.
        request: String,
        /// What could not be read.
        reason: String,
    },

    /// etcd answered with an error.
    #[error("etcd at {endpoint} refused {request}: {message} (HTTP {status}, gRPC code {code})")]
    Server {
        /// `host:port`.
        endpoint: String,
        /// The request.
        request: String,
        /// The HTTP status.
        status: u16,
        /// The gRPC status code etcd gives (e.g. 5 = not found, 9 = failed precondition).
        code: i64,
        /// etcd's message, e.g. `etcdserver: requested lease not found`.
        message: String,
    },

    /// A lease expired or was revoked: the keys attached to it are gone.
    #[error(
        "lease {lease} is not alive at etcd {endpoint} ({request}): it expired (no keep-alive \
         within its TTL) or was revoked, and the keys attached to it are gone; grant a new \
         lease, then register and campaign again"
    )]
    LeaseExpired {
        /// `host:port`.
        endpoint: String,
        /// The request that found out.
        request: String,
        /// The lease.
        lease: LeaseId,
    },

    /// The rendezvous prefix is in use by another job (a different job token).
    #[error(
        "the rendezvous `{prefix}` at etcd {endpoint} belongs to another job: `{key}` holds the \
         job token hash `{found}`, ours is `{ours}`; start this node with that job's token, give \
         this job its own prefix in the etcd URL, or, if that job is over, delete its keys \
         (`etcdctl del --prefix {prefix}/`)"
    )]
    WrongJob {
        /// `host:port`.
        endpoint: String,
        /// The rendezvous prefix.
        prefix: String,
        /// The key holding the job token hash.
        key: String,
        /// The hash found there.
        found: String,
        /// The hash of our token.
        ours: String,
    },

    /// A key holds a value this module did not write.
    #[error(
        "`{key}` at etcd {endpoint} holds an unreadable value: {reason}; was it written by \
         another program? Delete it (`etcdctl del {key}`) to reset it"
    )]
    BadValue {
        /// `host:port`.
        endpoint: String,
        /// The key.
        key: String,
        /// Why the value cannot be read.
        reason: String,
    },

    /// A compare-and-swap on the plan generation lost: another coordinator moved it first.
    #[error(
        "generation race lost at etcd {endpoint}: expected `{key}` = {expected} but it is \
         {found}; another coordinator advanced it, so re-read the generation and plan, and step \
         down unless this node still holds the leadership"
    )]
    GenerationRace {
        /// `host:port`.
        endpoint: String,
        /// The generation key.
        key: String,
        /// The generation the caller expected.
        expected: u64,
        /// The generation etcd holds (0 if none).
        found: u64,
    },
}
