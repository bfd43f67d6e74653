//! Plans (which node runs which pipeline stage) and the generation fence.

use serde::{Deserialize, Serialize};

use crate::error::ElasticError;
use crate::membership::{NodeId, NodeInfo};

/// Who runs which stage, from which step on, under which generation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Bumped by every new plan; every message carries it (see [`Generation`]).
    pub generation: u64,
    /// The step the plan starts at (for a recovery: the interrupted step, redone).
    pub step: u64,
    /// `stages[r]` is the node that runs pipeline stage `r`; a node's stages are consecutive.
    pub stages: Vec<NodeId>,
    /// The plan's nodes, sorted by id; each runs at least one stage.
    pub nodes: Vec<NodeId>,
}

impl Plan {
    /// Number of pipeline stages.
    pub fn num_stages(&self) -> usize {
        self.stages.len()
    }

    /// Whether `id` is one of the plan's nodes.
    pub fn contains(&self, id: &NodeId) -> bool {
        self.nodes.contains(id)
    }

    /// The stages `id` runs, ascending (empty if it is not in the plan).
    pub fn stages_of(&self, id: &NodeId) -> Vec<usize> {
        (0..self.stages.len())
            .filter(|&r| &self.stages[r] == id)
            .collect()
    }

    /// Whether a message of generation `message` may be acted on under this plan.
    pub fn admits(&self, message: u64) -> bool {
        Generation::admits(self.generation, message)
    }
}

/// The deterministic plan for `nodes`, or `None` when there is nothing to place (no node with
/// a slot, or `max_stages == 0`).
///
/// The plan has `min(total slots, max_stages)` stages (`max_stages` is the model's layer count:
/// a stage holds at least one layer). Nodes are taken in id order; stages are dealt out one per
/// node per round, each node taking at most `slots`, so that every node gets a stage before any
/// gets a second. Each node's stages are then laid out consecutively in id order. Nodes left
/// without a stage (more nodes than `max_stages`) are not in the plan. A repeated id counts once.
///
/// `slots = [a:2, b:1, c:3]`, `max_stages = 4` → stages `[a, a, b, c]`.
pub fn plan_for(nodes: &[NodeInfo], max_stages: usize, generation: u64, step: u64) -> Option<Plan> {
    let mut sorted: Vec<&NodeInfo> = nodes.iter().filter(|n| n.slots > 0).collect();
    sorted.sort_by(|a, b| a.id.cmp(&b.id));
    sorted.dedup_by(|a, b| a.id == b.id);
    let total: usize = sorted.iter().map(|n| n.slots).sum();
    let num_stages = total.min(max_stages);
    if num_stages == 0 {
        return None;
    }
    let mut counts = vec![0usize; sorted.len()];
    let mut left = num_stages;
    while left > 0 {
        for (count, node) in counts.iter_mut().zip(&sorted) {
            if left > 0 && *count < node.slots {
                *count += 1;
                left -= 1;
            }
        }
    }
    let mut stages = Vec::with_capacity(num_stages);
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
