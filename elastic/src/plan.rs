//! Plans (which node runs which worker: a pipeline stage of a data-parallel replica), the
//! layout rule that picks how many replicas and stages a set of nodes runs, and the generation
//! fence.

use serde::{Deserialize, Serialize};

use crate::error::ElasticError;
use crate::node::{NodeId, NodeInfo};

/// Who runs which worker, from which step on, under which generation.
///
/// A plan runs `replicas` data-parallel copies of one `p`-stage pipeline: `replicas · p`
/// workers. Worker slot `w` runs stage `w % p` of replica `w / p` ([`Plan::stage_of`],
/// [`Plan::replica_of`], [`Plan::slot`]). With one replica a slot is its stage, as before
/// replicas existed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "StoredPlan")]
pub struct Plan {
    /// Bumped by every new plan; every message carries it (see [`Generation`]).
    pub generation: u64,
    /// The step the plan starts at (for a recovery: the interrupted step, redone).
    pub step: u64,
    /// Data-parallel replicas of the pipeline; at least 1, and it divides `stages.len()`.
    ///
    /// Left out of the JSON when it is 1, and read as 1 when absent, so a one-replica plan is
    /// stored exactly as before replicas existed and older stored plans still parse.
    #[serde(skip_serializing_if = "is_one")]
    pub replicas: usize,
    /// The worker slots: `stages[w]` is the node that runs slot `w`, i.e. stage `w % p` of
    /// replica `w / p` (`p` = [`Plan::num_stages`]). A node's slots are consecutive, so a
    /// replica's stages on one node are too.
    pub stages: Vec<NodeId>,
    /// The plan's nodes, sorted by id; each runs at least one worker.
    pub nodes: Vec<NodeId>,
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

/// A [`Plan`] as stored (in etcd), checked before it becomes one: `replicas` is at least 1 and
/// divides the number of slots, so the slot arithmetic of [`Plan`] holds.
#[derive(Deserialize)]
struct StoredPlan {
    generation: u64,
    step: u64,
    #[serde(default = "one")]
    replicas: usize,
    stages: Vec<NodeId>,
    nodes: Vec<NodeId>,
}

impl TryFrom<StoredPlan> for Plan {
    type Error = String;

    fn try_from(p: StoredPlan) -> Result<Self, String> {
        if p.replicas == 0 || !p.stages.len().is_multiple_of(p.replicas) {
            return Err(format!(
                "a plan of {} worker slots cannot have {} replicas",
                p.stages.len(),
                p.replicas
            ));
        }
        Ok(Self {
            generation: p.generation,
            step: p.step,
            replicas: p.replicas,
            stages: p.stages,
            nodes: p.nodes,
        })
    }
}

impl Plan {
    /// The pipeline depth `p`: stages per replica (`stages.len() / replicas`).
    pub fn num_stages(&self) -> usize {
        self.stages.len() / self.replicas.max(1)
    }

    /// Worker slots in all: `replicas · num_stages()`.
    pub fn num_workers(&self) -> usize {
        self.stages.len()
    }

    /// The replica that worker slot `w` belongs to. `w` must be a slot of the plan.
    pub fn replica_of(&self, w: usize) -> usize {
        w / self.num_stages()
    }

    /// The pipeline stage that worker slot `w` runs. `w` must be a slot of the plan.
    pub fn stage_of(&self, w: usize) -> usize {
        w % self.num_stages()
    }

    /// The worker slot of stage `s` of replica `r`: `r · p + s`.
    pub fn slot(&self, r: usize, s: usize) -> usize {
        r * self.num_stages() + s
    }

    /// The nodes of replica `r`'s stages, in stage order (empty past the last replica).
    pub fn replica(&self, r: usize) -> &[NodeId] {
        let p = self.num_stages();
        self.stages.get(r * p..(r + 1) * p).unwrap_or_default()
    }

    /// Whether `id` is one of the plan's nodes.
    pub fn contains(&self, id: &NodeId) -> bool {
        self.nodes.contains(id)
    }

    /// The worker slots `id` runs, ascending and consecutive (empty if it is not in the plan).
    /// Map a slot to its stage and replica with [`Plan::stage_of`] and [`Plan::replica_of`].
    pub fn slots_of(&self, id: &NodeId) -> Vec<usize> {
        (0..self.stages.len())
            .filter(|&w| &self.stages[w] == id)
            .collect()
    }

    /// The worker *slots* `id` runs: the same as [`Plan::slots_of`], kept under the name of
    /// the time when a slot was a stage. With one replica they are its stages; with more, a
    /// slot past the first replica is not a stage number ([`Plan::stage_of`] gives it).
    pub fn stages_of(&self, id: &NodeId) -> Vec<usize> {
        self.slots_of(id)
    }

    /// Whether a message of generation `message` may be acted on under this plan.
    pub fn admits(&self, message: u64) -> bool {
        Generation::admits(self.generation, message)
    }
}

/// Which data-parallel replica counts a run may use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaPolicy {
    /// The configured replica count `d`: no plan has more.
    pub wanted: usize,
    /// The replica counts the trainer accepts (e.g. those that divide its micro-batch count),
    /// ascending. 1 is always accepted, listed or not.
    pub valid: Vec<usize>,
}

impl Default for ReplicaPolicy {
    /// One replica: a single pipeline, as before replicas existed.
    fn default() -> Self {
        Self {
            wanted: 1,
            valid: vec![1],
        }
    }
}

/// The layout `(replicas, stages)` that `total_slots` worker slots run, or `None` when nothing
/// can be placed (no slot, or `max_stages == 0`).
///
/// The candidates are every `(d, p)` with `d` accepted by `policy` (1, or in `valid` and at
/// most `wanted`), `1 ≤ p ≤ max_stages` (`max_stages` is the model's layer count: a stage holds
/// at least one layer) and `d · p ≤ total_slots`. The layout uses the most workers `d · p`,
/// then, on a tie, has the most replicas: a shorter pipeline has a smaller bubble, and a
/// replica can take over a lost one's work. With `wanted = 1` it is
/// `(1, min(total_slots, max_stages))`.
///
/// 4 slots, `max_stages = 8`, `wanted = 2` → `(2, 2)`; 3 slots → `(1, 3)`; 5 slots,
/// `max_stages = 4` → `(2, 2)` (the fifth slot stays free: `(1, 4)` also uses only 4).
pub fn best_layout(
    total_slots: usize,
    max_stages: usize,
    policy: &ReplicaPolicy,
) -> Option<(usize, usize)> {
    let accepted = std::iter::once(1)
        .chain(policy.valid.iter().copied())
        .filter(|&d| d >= 1 && (d == 1 || d <= policy.wanted));
    accepted
        .filter_map(|d| {
            let p = max_stages.min(total_slots / d);
            (p >= 1).then_some((d, p))
        })
        .max_by_key(|&(d, p)| (d * p, d))
}

/// [`plan_layout`] with one replica: the single-pipeline plan.
pub fn plan_for(nodes: &[NodeInfo], max_stages: usize, generation: u64, step: u64) -> Option<Plan> {
    plan_layout(
        nodes,
        max_stages,
        &ReplicaPolicy::default(),
        generation,
        step,
    )
}

/// The deterministic plan for `nodes`, or `None` when there is nothing to place (no node with
/// a slot, or `max_stages == 0`).
///
/// The layout `(d, p)` is [`best_layout`] of the nodes' total slots. Nodes are taken in id
/// order; the `d · p` workers are dealt out one per node per round, each node taking at most
/// `slots`, so that every node gets a worker before any gets a second. Each node's workers are
/// then laid out consecutively in id order, and that list is cut into the replicas: slots
/// `0..p` are replica 0, `p..2p` replica 1, and so on. A replica's stages on one node are thus
/// consecutive, and a node may run stages of two neighbouring replicas. Nodes left without a
/// worker (more nodes than workers) are not in the plan. A repeated id counts once.
///
/// `slots = [a:2, b:1, c:3]`, `max_stages = 4`, one replica → stages `[a, a, b, c]`; two
/// replicas wanted, `max_stages = 3` → `(2, 3)`, slots `[a, a, b | c, c, c]`.
pub fn plan_layout(
    nodes: &[NodeInfo],
    max_stages: usize,
    policy: &ReplicaPolicy,
    generation: u64,
    step: u64,
) -> Option<Plan> {
    let mut sorted: Vec<&NodeInfo> = nodes.iter().filter(|n| n.slots > 0).collect();
    sorted.sort_by(|a, b| a.id.cmp(&b.id));
    sorted.dedup_by(|a, b| a.id == b.id);
    let total: usize = sorted.iter().map(|n| n.slots).sum();
    let (replicas, num_stages) = best_layout(total, max_stages, policy)?;
    let workers = replicas * num_stages;
    let mut counts = vec![0usize; sorted.len()];
    let mut left = workers;
    while left > 0 {
        for (count, node) in counts.iter_mut().zip(&sorted) {
            if left > 0 && *count < node.slots {
                *count += 1;
                left -= 1;
            }
        }
    }
    let mut stages = Vec::with_capacity(workers);
    let mut members = Vec::new();
    for (&count, node) in counts.iter().zip(&sorted) {
        if count > 0 {
            stages.extend(std::iter::repeat_n(node.id.clone(), count));
            members.push(node.id.clone());
        }
    }
    Some(Plan {
        generation,
        step,
        replicas,
        stages,
        nodes: members,
    })
}

/// The generation fence.
///
/// Each plan has a generation, one more than the plan it replaces. Every message between
/// workers, agents and the coordinator carries the generation of the plan its sender runs, and
/// a receiver acts only on messages of its own current generation. A node that was declared
/// dead and replaced may still be running (a network partition, a slow process): its messages
/// carry the old generation and are refused, so it can never corrupt the new plan's step. A
/// message from a *newer* generation is refused too: the receiver must first adopt that plan
/// (from the coordinator), then the sender's retry is accepted.
#[derive(Clone, Copy, Debug)]
pub struct Generation;

impl Generation {
    /// Whether a message of generation `message` may be acted on by a receiver at `current`:
    /// only when they are equal.
    pub fn admits(current: u64, message: u64) -> bool {
        current == message
    }

    /// [`Generation::admits`] as a `Result` whose error names both generations.
    pub fn check(current: u64, message: u64) -> Result<(), ElasticError> {
        if Self::admits(current, message) {
            Ok(())
        } else {
            Err(ElasticError::StaleGeneration { current, message })
        }
    }
}
