//! `[elastic]`: how many nodes a run needs and how quickly it gives up on one.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::ElasticError;
use crate::preemption::{self, NoticeSource};
use crate::seconds::{Zero, checked_seconds, clamped_seconds};

/// The `[elastic]` config section, embedded by the trainer's config tree.
///
/// Times are in seconds (`f64`) in the file and [`Duration`]s in code: use the accessors
/// ([`ElasticConfig::heartbeat`], ...) after [`ElasticConfig::validate`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ElasticConfig {
    /// Fewest nodes that may train; with fewer the run waits up to `join_timeout_s`, then fails.
    pub min_nodes: usize,
    /// Most nodes admitted into a plan; 0 = unlimited. Further joiners stay spares.
    pub max_nodes: usize,
    /// Seconds between two heartbeats of a node's agent.
    pub heartbeat_s: f64,
    /// A node silent for more than this many seconds is declared dead; must exceed `heartbeat_s`.
    pub dead_after_s: f64,
    /// Seconds to wait for enough nodes (at start, or after losing some) before failing the run.
    pub join_timeout_s: f64,
    /// Recoveries from lost nodes allowed in one run before it fails (joins and leaves don't count).
    pub max_restarts: usize,
    /// Seconds a node with a preemption notice keeps running; it leaves at the next step boundary,
    /// and is treated as lost if no boundary came within this grace.
    pub grace_s: f64,
    /// Where the coordinator listens for node agents and stage workers (`host:port`; port 0 picks
    /// a free one). For a multi-host run, an address the other hosts reach, e.g. `0.0.0.0:29400`.
    pub listen: String,
    /// Whether `seqpipe train` starts its own agents on this machine (one node per pipeline stage,
    /// the default). `false`: it waits for agents started with `seqpipe agent --join`.
    pub local_agents: bool,
    /// Whether each worker copies its state into the memory of its own and its buddy node's agent
    /// behind the training (tier-1 recovery: only the steps after the newest copy are redone).
    /// Off: recoveries restore from the newest committed checkpoint.
    pub peer_snapshots: bool,
    /// How many steps in a row may go uncopied because the previous peer snapshot is still being
    /// sent (a copy never holds up a step until then); after that many, the next step waits for
    /// the copy in flight and is copied. 0: every step is copied, waiting when needed.
    pub peer_snapshot_max_skips: u64,
    /// Where membership, leadership and the plan generation live: empty for the coordinator's own
    /// memory (the default), or `etcd://HOST:PORT/PREFIX`, so that another node takes over when
    /// the coordinator's node is lost (nodes then run `seqpipe agent --rendezvous URL`).
    pub rendezvous: String,
    /// Mid-step recovery: when one stage is lost in the middle of a step, its replacement rebuilds
    /// the stage from its peer snapshot and the neighbours' kept boundary tensors, and the step
    /// goes on from where every other stage stood (they redo nothing). Off: the step is redone
    /// from the peer snapshots. Only for a stage whose death is certain (its process or its
    /// node's agent is gone); a node that went silent is fenced and the step redone.
    pub mid_step: bool,
    /// Which cloud's instance metadata service each agent watches for a preemption notice
    /// (`aws` spot instance-action, `gcp` preempted, `azure` scheduled Preempt event), or `off`.
    /// A notice makes the node leave at the next step boundary, as SIGTERM does; a metadata
    /// service that cannot be reached is warned about once and otherwise ignored. Local agents
    /// take it from here; `seqpipe agent --preemption-notice` sets it per node.
    pub preemption_notice: NoticeSource,
    /// The metadata service's address (`http://HOST[:PORT]`); empty for the cloud's documented
    /// one (169.254.169.254, metadata.google.internal).
    pub metadata_endpoint: String,
    /// Seconds between two polls of the metadata service (GCP: the longest long poll).
    pub metadata_poll_s: f64,
    /// Where the coordinator serves its Prometheus metrics (`GET /metrics`): empty for off (the
    /// default), or `IP:PORT`, e.g. `127.0.0.1:9100`, or `0.0.0.0:9100` for scrapers on other
    /// hosts.
    pub metrics_listen: String,
    /// Seconds the coordinator keeps serving the final metrics after the run ended, so that a
    /// scraper that comes every few seconds sees the last step (0 = stop at once; SIGTERM ends
    /// the wait).
    pub metrics_linger_s: f64,
}

impl Default for ElasticConfig {
    fn default() -> Self {
        Self {
            min_nodes: 1,
            max_nodes: 0,
            heartbeat_s: 1.0,
            dead_after_s: 5.0,
            join_timeout_s: 30.0,
            max_restarts: 10,
            grace_s: 30.0,
            listen: "127.0.0.1:0".into(),
            local_agents: true,
            peer_snapshots: true,
            peer_snapshot_max_skips: 100,
            rendezvous: String::new(),
            mid_step: true,
            preemption_notice: NoticeSource::Off,
            metadata_endpoint: String::new(),
            metadata_poll_s: 2.0,
            metrics_listen: String::new(),
            metrics_linger_s: 0.0,
        }
    }
}

impl ElasticConfig {
    /// Checks every value and their consistency; the error names the key and the reason.
    pub fn validate(&self) -> Result<(), ElasticError> {
        let invalid =
            |key: &'static str, message: String| Err(ElasticError::InvalidConfig { key, message });
        if self.min_nodes == 0 {
            return invalid(
                "elastic.min_nodes",
                "must be at least 1: a plan needs a node to run on".into(),
            );
        }
        if self.max_nodes != 0 && self.max_nodes < self.min_nodes {
            return invalid(
                "elastic.max_nodes",
                format!(
                    "{} is below elastic.min_nodes {}; use 0 for unlimited or at least {}",
                    self.max_nodes, self.min_nodes, self.min_nodes
                ),
            );
        }
        let seconds = [
            ("elastic.heartbeat_s", self.heartbeat_s, Zero::Refused),
            ("elastic.dead_after_s", self.dead_after_s, Zero::Refused),
            ("elastic.join_timeout_s", self.join_timeout_s, Zero::Allowed),
            ("elastic.grace_s", self.grace_s, Zero::Allowed),
            (
                "elastic.metadata_poll_s",
                self.metadata_poll_s,
                Zero::Refused,
            ),
            (
                "elastic.metrics_linger_s",
                self.metrics_linger_s,
                Zero::Allowed,
            ),
        ];
        for (key, value, zero) in seconds {
            if let Err(e) = checked_seconds(value, zero) {
                return invalid(key, e.to_string());
            }
        }
        if !self.rendezvous.is_empty() {
            crate::etcd::EtcdUrl::parse(&self.rendezvous).map_err(|e| {
                ElasticError::InvalidConfig {
                    key: "elastic.rendezvous",
                    message: e.to_string(),
                }
            })?;
        }
        if !self.metadata_endpoint.is_empty() {
            preemption::client::endpoint(&self.metadata_endpoint).map_err(|message| {
                ElasticError::InvalidConfig {
                    key: "elastic.metadata_endpoint",
                    message,
                }
            })?;
        }
        if !self.metrics_listen.is_empty()
            && self.metrics_listen.parse::<std::net::SocketAddr>().is_err()
        {
            return invalid(
                "elastic.metrics_listen",
                format!(
                    "{:?} is not an IP:PORT address; use e.g. \"127.0.0.1:9100\" (this host \
                     only), \"0.0.0.0:9100\" (every interface), or \"\" to serve no metrics",
                    self.metrics_listen
                ),
            );
        }
        if self.dead_after_s <= self.heartbeat_s {
            return invalid(
                "elastic.dead_after_s",
                format!(
                    "{} s must exceed elastic.heartbeat_s ({} s), or healthy nodes are declared \
                     dead between two heartbeats",
                    self.dead_after_s, self.heartbeat_s
                ),
            );
        }
        Ok(())
    }

    /// `heartbeat_s` as a [`Duration`].
    pub fn heartbeat(&self) -> Duration {
        clamped_seconds(self.heartbeat_s)
    }

    /// `dead_after_s` as a [`Duration`].
    pub fn dead_after(&self) -> Duration {
        clamped_seconds(self.dead_after_s)
    }

    /// `join_timeout_s` as a [`Duration`].
    pub fn join_timeout(&self) -> Duration {
        clamped_seconds(self.join_timeout_s)
    }

    /// `metrics_linger_s` as a [`Duration`].
    pub fn metrics_linger(&self) -> Duration {
        clamped_seconds(self.metrics_linger_s)
    }

    /// `grace_s` as a [`Duration`].
    pub fn grace(&self) -> Duration {
        clamped_seconds(self.grace_s)
    }

    /// `metadata_poll_s` as a [`Duration`].
    pub fn metadata_poll(&self) -> Duration {
        clamped_seconds(self.metadata_poll_s)
    }
}
