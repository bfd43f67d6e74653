//! Who is in the cluster: nodes join, heartbeat, leave or die. No clock is read: every call
//! takes `now`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::ElasticError;
use crate::node::{NodeId, NodeInfo};
use crate::plan::Plan;

/// A node's liveness as the coordinator sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeStatus {
    /// Heartbeating; running its stages, or waiting to be admitted.
    Alive,
    /// Announced it will go (preemption notice); still running until the next step boundary.
    Leaving,
    /// Declared dead; its messages are refused until it joins again as a new incarnation.
    Dead {
        /// Why, e.g. `connection broken` or `missed heartbeats for 5.5 s`.
        reason: String,
    },
}

impl NodeStatus {
    /// Whether the node is dead.
    pub fn is_dead(&self) -> bool {
        matches!(self, Self::Dead { .. })
    }
}

/// One node's record: the latest incarnation of its id.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    /// What it announced when it (last) joined.
    pub info: NodeInfo,
    /// Its liveness.
    pub status: NodeStatus,
    /// 1 for the first join of this id, +1 for each re-join. A re-join means the node's agent
    /// restarted: whatever the old incarnation held is gone.
    pub incarnation: u64,
    /// When this incarnation joined; joiners are admitted in this order.
    pub joined_at: Instant,
    /// When it was last heard from.
    pub last_heartbeat: Instant,
    /// When `status` last changed (a leaving node's grace runs from here).
    pub status_since: Instant,
    /// Whether this incarnation is part of the adopted plan (see [`Membership::admit`]).
    pub admitted: bool,
}

/// The coordinator's view of every node that ever joined, keyed by id.
#[derive(Clone, Debug, Default)]
pub struct Membership {
    members: BTreeMap<NodeId, Member>,
}

impl Membership {
    /// No nodes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records a join and returns the node's incarnation.
    ///
    /// Every join starts a new incarnation that is not admitted: a joiner enters a plan only
    /// through a decision (at a step boundary, or in a recovery). A re-join of an id that is
    /// still in the plan means its agent restarted, so the old incarnation counts as lost.
    pub fn join(&mut self, info: NodeInfo, now: Instant) -> Result<u64, ElasticError> {
        if info.id.as_str().is_empty() {
            return Err(ElasticError::BadJoin {
                id: info.id,
                reason: "the node id is empty".into(),
            });
        }
        if info.slots == 0 {
            return Err(ElasticError::BadJoin {
                id: info.id,
                reason: "it offers 0 slots; a node needs at least one stage worker".into(),
            });
        }
        let incarnation = self.members.get(&info.id).map_or(1, |m| m.incarnation + 1);
        self.members.insert(
            info.id.clone(),
            Member {
                info,
                status: NodeStatus::Alive,
                incarnation,
                joined_at: now,
                last_heartbeat: now,
                status_since: now,
                admitted: false,
            },
        );
        Ok(incarnation)
    }

    /// Records a heartbeat. A node that never joined, or that was declared dead (fenced), is
    /// refused: it must join again.
    pub fn heartbeat(&mut self, id: &NodeId, now: Instant) -> Result<(), ElasticError> {
        let member = self.live_member(id)?;
        member.last_heartbeat = member.last_heartbeat.max(now);
        Ok(())
    }

    /// Declares a node dead at once (e.g. a peer saw its connection break). A node already
    /// dead keeps its first reason.
    pub fn report_failure(
        &mut self,
        id: &NodeId,
        reason: impl Into<String>,
        now: Instant,
    ) -> Result<(), ElasticError> {
        let member = self
            .members
            .get_mut(id)
            .ok_or_else(|| ElasticError::UnknownNode(id.clone()))?;
        if !member.status.is_dead() {
            member.status = NodeStatus::Dead {
                reason: reason.into(),
            };
            member.status_since = now;
        }
        Ok(())
    }

    /// Declares incarnation `incarnation` of a node dead, as [`Membership::report_failure`] does,
    /// unless the node has joined again since as a newer incarnation: a loss found out about one
    /// incarnation never fences the next (an agent declared dead that joined again at once is a
    /// healthy joiner). Returns whether that incarnation is (now) dead.
    pub fn report_failure_of(
        &mut self,
        id: &NodeId,
        incarnation: u64,
        reason: impl Into<String>,
        now: Instant,
    ) -> Result<bool, ElasticError> {
        let member = self
            .members
            .get(id)
            .ok_or_else(|| ElasticError::UnknownNode(id.clone()))?;
        if member.incarnation > incarnation {
            return Ok(false);
        }
        self.report_failure(id, reason, now)?;
        Ok(true)
    }

    /// Excuses `stalled` of every live node's silence: the failure detector was not running for
    /// that long (see [`crate::liveness`]), so the silence it did not witness is no evidence. A
    /// node's last heartbeat moves forward by `stalled`, never past `now`.
    pub fn excuse(&mut self, stalled: Duration, now: Instant) {
        if stalled.is_zero() {
            return;
        }
        for member in self.members.values_mut() {
            if !member.status.is_dead() {
                member.last_heartbeat = member
                    .last_heartbeat
                    .checked_add(stalled)
                    .map_or(now, |t| t.min(now))
                    .max(member.last_heartbeat);
            }
        }
    }

    /// Records a graceful leave (preemption notice). A node of the plan becomes
    /// [`NodeStatus::Leaving`] and leaves at the next step boundary; a node not yet admitted
    /// simply goes (it becomes dead, so later messages of it are refused).
    pub fn leave(&mut self, id: &NodeId, now: Instant) -> Result<(), ElasticError> {
        let member = self.live_member(id)?;
        if member.status == NodeStatus::Leaving {
            return Ok(());
        }
        member.status = if member.admitted {
            NodeStatus::Leaving
        } else {
            NodeStatus::Dead {
                reason: "left before being admitted to a plan".into(),
            }
        };
        member.status_since = now;
        Ok(())
    }

    /// Declares dead every live node silent for more than `dead_after` (reason
    /// `missed heartbeats for N s`) and returns them, sorted by id.
    pub fn expire(&mut self, now: Instant, dead_after: Duration) -> Vec<NodeId> {
        let mut newly_dead = Vec::new();
        for (id, member) in &mut self.members {
            let silent = now.saturating_duration_since(member.last_heartbeat);
            if !member.status.is_dead() && silent > dead_after {
                member.status = NodeStatus::Dead {
                    reason: format!("missed heartbeats for {} s", tenths(silent)),
                };
                member.status_since = now;
                newly_dead.push(id.clone());
            }
        }
        newly_dead
    }

    /// Marks exactly the live nodes of `plan` as admitted (call it when a plan is adopted);
    /// other live nodes become (or stay) joiners waiting for a plan.
    pub fn admit(&mut self, plan: &Plan) {
        for (id, member) in &mut self.members {
            if !member.status.is_dead() {
                member.admitted = plan.contains(id);
            }
        }
    }

    /// Nodes not dead (alive or leaving), sorted by id.
    pub fn alive(&self) -> Vec<&NodeInfo> {
        self.members
            .values()
            .filter(|m| !m.status.is_dead())
            .map(|m| &m.info)
            .collect()
    }

    /// Alive nodes not (yet) in the adopted plan, in the order they joined (ties by id).
    pub fn pending_joiners(&self) -> Vec<&NodeInfo> {
        let mut joiners: Vec<&Member> = self
            .members
            .values()
            .filter(|m| m.status == NodeStatus::Alive && !m.admitted)
            .collect();
        joiners.sort_by(|a, b| (a.joined_at, &a.info.id).cmp(&(b.joined_at, &b.info.id)));
        joiners.into_iter().map(|m| &m.info).collect()
    }

    /// The record of one node, if it ever joined.
    pub fn get(&self, id: &NodeId) -> Option<&Member> {
        self.members.get(id)
    }

    /// A node's status, if it ever joined.
    pub fn status(&self, id: &NodeId) -> Option<&NodeStatus> {
        self.members.get(id).map(|m| &m.status)
    }

    /// Every node that ever joined (its latest incarnation), sorted by id.
    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    /// The member of a live node, or why its messages are refused.
    fn live_member(&mut self, id: &NodeId) -> Result<&mut Member, ElasticError> {
        let member = self
            .members
            .get_mut(id)
            .ok_or_else(|| ElasticError::UnknownNode(id.clone()))?;
        if let NodeStatus::Dead { reason } = &member.status {
            return Err(ElasticError::Fenced {
                id: id.clone(),
                reason: reason.clone(),
            });
        }
        Ok(member)
    }
}

/// A duration in seconds rounded to tenths, printed without a trailing `.0` (`5.5`, `6`).
fn tenths(d: Duration) -> f64 {
    (d.as_secs_f64() * 10.0).round() / 10.0
}
