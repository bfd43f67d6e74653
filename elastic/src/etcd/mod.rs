//! The rendezvous in etcd: membership, coordinator leadership, the plan generation and the
//! current plan, kept under leases so that losing the coordinator's node is survivable.
//!
//! **This module is the crate's one I/O part.** Everything else in `elastic` is a pure core
//! that reads no clock and opens no socket; this module talks to a real etcd (3.4 or later)
//! over blocking HTTP/1.1 to its JSON gateway (`POST /v3/kv/...`, `/v3/lease/...`). It needs
//! no async runtime and no gRPC: its HTTP client is `ureq`, one request per connection, each
//! call under a total deadline and with bounded response headers and body.
//!
//! - [`EtcdUrl`]: `etcd://HOST:PORT/PREFIX`, the endpoint and the job's key prefix.
//! - [`EtcdClient`]: the raw client (key-values, leases, transactions).
//! - [`Rendezvous`]: seqpipe's keys and their rules on top of it (see its module for the
//!   layout).
//! - `testing` (cargo feature `test-support`): a real etcd server for tests.
//!
//! ```no_run
//! use std::time::Duration;
//! use elastic::NodeInfo;
//! use elastic::etcd::{EtcdUrl, Rendezvous};
//!
//! # fn main() -> Result<(), elastic::etcd::EtcdError> {
//! let url = EtcdUrl::parse("etcd://10.0.0.5:2379/seqpipe/my-job")?;
//! let rendezvous = Rendezvous::connect(&url, "hash-of-the-job-token")?;
//! let lease = rendezvous.grant(Duration::from_secs(10))?;
//! rendezvous.register(&NodeInfo::new("a", 2, "10.0.0.1:29500"), lease.id)?;
//! if rendezvous.campaign("a", "10.0.0.1:29400", lease.id)? {
//!     // Coordinate: read `nodes()`, decide, `bump_generation`, `publish_plan`.
//! }
//! // Every lease.ttl / 3, from a thread of its own:
//! rendezvous.keep_alive(lease.id)?;
//! # Ok(()) }
//! ```

mod client;
mod error;
mod lease;
mod rendezvous;
#[cfg(feature = "test-support")]
pub mod testing;
mod url;

pub use client::{Compare, DEFAULT_TIMEOUT, EtcdClient, KeyValue, Lease, TxnOp, TxnResponse};
pub use error::EtcdError;
pub use lease::LeaseId;
pub use rendezvous::{Leader, Rendezvous};
pub use url::EtcdUrl;
