//! Nodes, membership, plans and recovery decisions for an elastic pipeline. Knows no tensors.
//!
//! A *node* runs one agent with `slots` stage workers; a *coordinator* holds the
//! [`Membership`] and decides the [`Plan`]: `d` data-parallel replicas of a `p`-stage pipeline
//! (one replica unless the [`ReplicaPolicy`] wants more), laid out by [`plan_layout`]. Every plan
//! has a generation, and anything from another generation is refused ([`Generation`]).
//!
//! The crate is a pure core, in the manner of torchft's `quorum_compute` and raft-rs: no I/O,
//! no async, no clock reads. Time is always passed in as an [`std::time::Instant`], so tests
//! move it by hand. (The I/O parts are the [`etcd`] module, a rendezvous that keeps
//! membership, leadership and the plan generation in etcd, and [`preemption::client`], which
//! asks a cloud's metadata service for a preemption notice; the core uses neither.) The async
//! shell around it (the trainer) feeds events into a [`ClusterState`], calls [`decide()`], acts
//! on the [`Decision`] (publishes the plan, stops the step, restores state from the [`Tier`]
//! that [`recovery_tier`] picks) and records it with [`ClusterState::apply`]:
//!
//! ```
//! use std::time::{Duration, Instant};
//! use elastic::{ClusterState, Decision, ElasticConfig, NodeInfo, decide};
//!
//! let cfg = ElasticConfig { min_nodes: 2, ..ElasticConfig::default() };
//! cfg.validate().unwrap();
//! let t0 = Instant::now();
//! let mut state = ClusterState::new(4); // a 4-layer model: at most 4 stages
//! state.membership.join(NodeInfo::new("a", 2, "10.0.0.1:29500"), t0).unwrap();
//! state.membership.join(NodeInfo::new("b", 2, "10.0.0.2:29500"), t0).unwrap();
//!
//! let (decision, reason) = decide(t0, &state, &cfg);
//! assert!(matches!(decision, Decision::Grow { .. }), "{reason}");
//! state.apply(&decision, t0);
//! assert_eq!(state.current.as_ref().unwrap().generation, 1);
//!
//! // b goes silent: after `dead_after` it is declared dead; a alone is below min_nodes = 2,
//! // so the coordinator waits (up to `join_timeout`) for another node to join.
//! let t = t0 + Duration::from_secs(6);
//! state.membership.heartbeat(&"a".into(), t).unwrap();
//! state.membership.expire(t, cfg.dead_after());
//! let (decision, reason) = decide(t, &state, &cfg);
//! assert!(matches!(decision, Decision::Wait { alive: 1, needed: 2, .. }), "{reason}");
//! ```

#![deny(missing_docs)]

pub mod config;
pub mod decide;
pub mod error;
pub mod etcd;
mod http;
pub mod liveness;
pub mod membership;
pub mod node;
pub mod plan;
pub mod preemption;
pub mod seconds;

pub use config::ElasticConfig;
pub use decide::{ClusterState, Decision, Tier, buddies, decide, recovery_tier, restart_plan};
pub use error::ElasticError;
pub use liveness::{Checked, FailureDetector, own_stall};
pub use membership::{Member, Membership, NodeStatus};
pub use node::{NodeId, NodeInfo};
pub use plan::{Generation, Plan, ReplicaPolicy, best_layout, plan_for, plan_layout};
pub use seconds::{MAX_SECONDS, SecondsError, Zero, checked_seconds, clamped_seconds};
