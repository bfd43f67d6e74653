//! The pure decision: given the clock, the cluster's state and the config, what happens next
//! and why (after torchft's `quorum_compute`). Nothing here reads a clock or does I/O; the
//! caller acts on the decision and records it with [`ClusterState::apply`].

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::config::ElasticConfig;
use crate::membership::{Membership, NodeStatus};
use crate::node::{NodeId, NodeInfo};
use crate::plan::{Plan, ReplicaPolicy, best_layout, plan_layout};

/// Everything [`decide()`] looks at. Plain data: the caller updates it as events arrive
/// (joins, heartbeats, failures, step boundaries) and with [`ClusterState::apply`].
#[derive(Clone, Debug)]
pub struct ClusterState {
    /// Who joined, who is alive, who is admitted.
    pub membership: Membership,
    /// The adopted plan; `None` before the first one.
    pub current: Option<Plan>,
    /// The step being run, or about to start when `at_step_boundary`.
    pub step: u64,
    /// Whether the pipeline is between two steps (the previous step's update is done and the
    /// next has not started): the only moment joiners are admitted and leavers let go.
    pub at_step_boundary: bool,
    /// Most stages a pipeline may have: the model's layer count.
    pub max_stages: usize,
    /// How many data-parallel replicas of the pipeline a plan may run (by default one).
    pub replicas: ReplicaPolicy,
    /// Recoveries from lost nodes so far in this run.
    pub restarts: usize,
    /// When the current shortfall (fewer than `min_nodes` nodes) began; `None` when there is none.
    pub waiting_since: Option<Instant>,
    /// The highest generation a previous coordinator of this job used (0 for a new job): the
    /// first plan continues above it, so its workers' messages stay fenced.
    pub generation_floor: u64,
}

impl ClusterState {
    /// No nodes, no plan, step 0 at a boundary, one replica ([`ReplicaPolicy::default`]).
    pub fn new(max_stages: usize) -> Self {
        Self {
            membership: Membership::new(),
            current: None,
            step: 0,
            at_step_boundary: true,
            max_stages,
            replicas: ReplicaPolicy::default(),
            restarts: 0,
            waiting_since: None,
            generation_floor: 0,
        }
    }

    /// Records that the caller carried out `decision` at `now`.
    ///
    /// A new plan (`Recover`, `Grow`, `Shrink`) is adopted: its nodes become admitted, a leaving
    /// node not in it has left (it becomes dead, so its late messages are refused), the step is
    /// the plan's and at a boundary (the plan starts at the beginning of its step), and a
    /// `Recover` counts as a restart. `Wait` starts the shortfall clock if it is not running;
    /// any other decision but `Fail` stops it.
    pub fn apply(&mut self, decision: &Decision, now: Instant) {
        match decision {
            Decision::Continue => self.waiting_since = None,
            Decision::Wait { .. } => self.waiting_since = Some(self.waiting_since.unwrap_or(now)),
            Decision::Fail { .. } | Decision::Stop { .. } => {}
            Decision::Recover { plan, .. }
            | Decision::Grow { plan, .. }
            | Decision::Shrink { plan, .. } => {
                if matches!(decision, Decision::Recover { .. }) {
                    self.restarts += 1;
                }
                let gone: Vec<NodeId> = self
                    .membership
                    .members()
                    .filter(|m| m.status == NodeStatus::Leaving && !plan.contains(&m.info.id))
                    .map(|m| m.info.id.clone())
                    .collect();
                for id in gone {
                    let reason = format!("left the plan at generation {}", plan.generation);
                    // The id comes from the membership itself, so it is known.
                    let _ = self.membership.report_failure(&id, reason, now);
                }
                self.membership.admit(plan);
                self.step = plan.step;
                self.at_step_boundary = true;
                self.current = Some(plan.clone());
                self.waiting_since = None;
            }
        }
    }
}

/// What the coordinator does next.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Keep running the current plan.
    Continue,
    /// Nodes of the current plan were lost: stop the step now and restart it under `plan`
    /// (generation + 1). The plan has the survivors plus waiting joiners where stages or
    /// `min_nodes` need them: a recovery restarts the interrupted step from its beginning, so
    /// it is a step boundary. A leaving node stays until the next boundary.
    Recover {
        /// The new plan.
        plan: Plan,
        /// Nodes of the old plan that were lost, sorted by id.
        lost: Vec<NodeId>,
        /// Joiners admitted by the recovery, in the order they joined.
        joined: Vec<NodeId>,
    },
    /// Admit joiners at this step boundary (also the first plan of a run, and, with no joiner,
    /// the same nodes again under a new generation: see [`restart_plan`]).
    Grow {
        /// The new plan (generation + 1).
        plan: Plan,
        /// The admitted joiners, in the order they joined.
        joined: Vec<NodeId>,
    },
    /// Let leaving nodes go at this step boundary (joiners may take their place).
    Shrink {
        /// The new plan (generation + 1).
        plan: Plan,
        /// The nodes that leave, sorted by id.
        left: Vec<NodeId>,
        /// Joiners admitted at the same boundary, in the order they joined.
        joined: Vec<NodeId>,
    },
    /// Too few nodes to train: wait for joiners until `until`.
    Wait {
        /// Nodes that a plan could use now.
        alive: usize,
        /// `min_nodes`.
        needed: usize,
        /// When the wait gives up (shortfall start + `join_timeout`).
        until: Instant,
    },
    /// Nodes with a preemption notice leave at this step boundary and too few would remain
    /// (fewer than `min_nodes`, none joining to take their place): commit a checkpoint of this
    /// boundary and stop the run cleanly, to be resumed (`seqpipe resume`) when nodes are back.
    Stop {
        /// The nodes that leave, sorted by id.
        leaving: Vec<NodeId>,
    },
    /// Stop the run; committed checkpoints stay intact for `seqpipe resume`.
    Fail {
        /// Why, for the operator.
        reason: String,
    },
}

impl Decision {
    /// The new plan of a `Recover`, `Grow` or `Shrink`.
    pub fn plan(&self) -> Option<&Plan> {
        match self {
            Self::Recover { plan, .. } | Self::Grow { plan, .. } | Self::Shrink { plan, .. } => {
                Some(plan)
            }
            _ => None,
        }
    }
}

/// The next decision and a human-readable reason.
///
/// The reason depends only on what the decision depends on, never on how time passes while
/// nothing changes (no countdowns), so a caller can log it whenever it differs from the last.
/// Rules, in order:
/// 1. a node of the current plan is dead, restarted, or leaving past its grace mid-step
///    → `Recover` immediately (or `Fail` once `max_restarts` recoveries were made);
/// 2. a new plan would have fewer than `min_nodes` nodes → `Wait` until `join_timeout` after
///    the shortfall began, then `Fail`;
/// 3. at a step boundary, leaving nodes → `Shrink`, or `Stop` when fewer than `min_nodes` would
///    remain (mid-step such nodes stay until the boundary); else joiners that add worker slots to the
///    best layout (or are needed for `min_nodes`), up to `max_nodes` → `Grow`; other joiners
///    stay spares;
/// 4. otherwise `Continue`.
///
/// Every new plan is [`plan_layout`] of its nodes under `state.replicas`: the layout of `d`
/// replicas × `p` stages that uses the most worker slots, then has the most replicas (see
/// [`best_layout`]). Joiners are admitted in join order as long as they raise that worker count
/// (at most `wanted · max_stages`), so a 3-node `1 × 3` job whose 4th node joins grows to
/// `2 × 2` when two replicas are wanted. A node the layout has no worker for (possible only with
/// several replicas, when a loss leaves more nodes than workers) stays a spare.
pub fn decide(now: Instant, state: &ClusterState, cfg: &ElasticConfig) -> (Decision, String) {
    if state.max_stages == 0 {
        return fail("the model has no layers to place (max_stages is 0)".into());
    }
    if cfg.min_nodes > state.max_stages {
        return fail(format!(
            "elastic.min_nodes is {} but the model splits into at most {} stages, and every node \
             of a plan runs a stage; lower elastic.min_nodes",
            cfg.min_nodes, state.max_stages
        ));
    }
    let joiners = state.membership.pending_joiners();
    let Some(plan) = &state.current else {
        return first_plan(now, state, cfg, &joiners);
    };

    let lost = lost_nodes(now, state, plan, cfg);
    if !lost.is_empty() {
        return recover(now, state, cfg, plan, &lost, &joiners);
    }

    let leaving: Vec<NodeId> = plan
        .nodes
        .iter()
        .filter(|id| state.membership.status(id) == Some(&NodeStatus::Leaving))
        .cloned()
        .collect();
    let next = Boundary::of(state, cfg, plan, &leaving, &joiners);
    if !leaving.is_empty() {
        return shrink_or_stop(state, cfg, leaving, next);
    }
    if !next.joined.is_empty() {
        if !state.at_step_boundary {
            let reason = with(waits_note(&next.joined), next.spares);
            return (Decision::Continue, reason);
        }
        let reason = format!("{} joined at step {}", named(&next.joined), state.step);
        let (plan, reason) = next.adopt(reason);
        let joined = next.joined;
        return (Decision::Grow { plan, joined }, reason);
    }

    let reason = format!(
        "plan generation {} unchanged: {} alive",
        plan.generation,
        count(plan.nodes.len(), "node")
    );
    (Decision::Continue, with(reason, next.spares))
}

/// What the next step boundary would do with the current plan's staying nodes and the joiners
/// (rule 3): the nodes admitted, the plan of them (none when every node leaves and none joins;
/// mid-step it says who will join and who stays spare), who joins, and the notes of who stays
/// spare (mid-step: joiners only; in the plan: with several replicas, staying nodes the new
/// layout has no worker for too).
struct Boundary {
    admitted: usize,
    next: Option<(Plan, String)>,
    joined: Vec<NodeId>,
    spares: String,
    plan_spares: String,
}

impl Boundary {
    fn of(
        state: &ClusterState,
        cfg: &ElasticConfig,
        plan: &Plan,
        leaving: &[NodeId],
        joiners: &[&NodeInfo],
    ) -> Self {
        let staying: Vec<&NodeInfo> = plan
            .nodes
            .iter()
            .filter(|id| !leaving.contains(id))
            .filter_map(|id| state.membership.get(id).map(|m| &m.info))
            .collect();
        let admitted = admit_joiners(staying, joiners, cfg, state);
        let next = (!admitted.is_empty()).then(|| new_plan(&admitted, state, plan.generation + 1));
        let (joined, spares, plan_spares) = match &next {
            None => Default::default(),
            Some((new, _)) => {
                let joined: Vec<NodeId> = placed(&admitted, new)
                    .into_iter()
                    .filter(|id| !plan.contains(id))
                    .collect();
                let spare_joiners = unplaced(joiners, new);
                let all_spares = unique([unplaced(&admitted, new), spare_joiners.clone()].concat());
                let spares = spare_note(&spare_joiners, new, cfg, state);
                (joined, spares, spare_note(&all_spares, new, cfg, state))
            }
        };
        Self {
            admitted: admitted.len(),
            next,
            joined,
            spares,
            plan_spares,
        }
    }

    /// The plan to adopt, and `reason` with its text and the spares' note. Past the
    /// `min_nodes` check, at least one node is admitted, so there is a plan.
    fn adopt(&self, reason: String) -> (Plan, String) {
        let (new, text) = self
            .next
            .clone()
            .expect("at least min_nodes >= 1 nodes have a plan");
        let reason = with(format!("{reason}; plan: {text}"), self.plan_spares.clone());
        (new, reason)
    }
}

/// The first plan of a run: the joiners admitted, once there are `min_nodes` of them.
fn first_plan(
    now: Instant,
    state: &ClusterState,
    cfg: &ElasticConfig,
    joiners: &[&NodeInfo],
) -> (Decision, String) {
    let admitted = admit_joiners(Vec::new(), joiners, cfg, state);
    if admitted.len() < cfg.min_nodes {
        return wait_or_fail(now, state, cfg, admitted.len(), "");
    }
    let (new, text) = new_plan(&admitted, state, state.generation_floor + 1);
    let reason = format!("first plan at step {}: {text}", state.step);
    let reason = with(
        reason,
        spare_note(&unplaced(&admitted, &new), &new, cfg, state),
    );
    let joined = placed(&admitted, &new);
    (Decision::Grow { plan: new, joined }, reason)
}

/// Rule 3 with `leaving` nodes: stop when fewer than `min_nodes` would stay, else shrink at the
/// step boundary (mid-step, the leaving nodes stay until then).
fn shrink_or_stop(
    state: &ClusterState,
    cfg: &ElasticConfig,
    leaving: Vec<NodeId>,
    next: Boundary,
) -> (Decision, String) {
    if next.admitted < cfg.min_nodes {
        // Waiting out the grace would lose the nodes mid-step, and the steps since the last
        // checkpoint with them: the run stops at a boundary with a checkpoint instead.
        let them = if leaving.len() == 1 { "it" } else { "them" };
        let reason = format!(
            "{} leaving, and without {them} only {} would remain, {} needed \
             (elastic.min_nodes)",
            is(&leaving),
            count(next.admitted, "node"),
            cfg.min_nodes,
        );
        if !state.at_step_boundary {
            let reason =
                format!("{reason}; the run stops at the next step boundary with a checkpoint");
            return (Decision::Continue, with(reason, next.spares));
        }
        let reason = format!(
            "{reason}; the run stops with a checkpoint before step {}, to be resumed when \
             nodes are back",
            state.step
        );
        return (Decision::Stop { leaving }, reason);
    }
    if !state.at_step_boundary {
        let reason = format!(
            "{} leaving; it leaves the plan at the next step boundary",
            is(&leaving)
        );
        let reason = with(with(reason, waits_note(&next.joined)), next.spares);
        return (Decision::Continue, reason);
    }
    let mut reason = format!("{} left at step {}", named(&leaving), state.step);
    if !next.joined.is_empty() {
        reason = format!("{reason}; {} joined", named(&next.joined));
    }
    let (plan, reason) = next.adopt(reason);
    let decision = Decision::Shrink {
        plan,
        left: leaving,
        joined: next.joined,
    };
    (decision, reason)
}

/// Rule 1: the current plan lost nodes.
fn recover(
    now: Instant,
    state: &ClusterState,
    cfg: &ElasticConfig,
    plan: &Plan,
    lost: &[(NodeId, String)],
    joiners: &[&NodeInfo],
) -> (Decision, String) {
    let lost_text = lost
        .iter()
        .map(|(id, why)| format!("node {id} lost ({why})"))
        .collect::<Vec<_>>()
        .join(", ");
    if state.restarts >= cfg.max_restarts {
        return fail(format!(
            "{lost_text}, but no recovery is left: the run already recovered {} and \
             elastic.max_restarts is {}; {RESUME_HINT}",
            count(state.restarts, "time"),
            cfg.max_restarts
        ));
    }
    let survivors: Vec<&NodeInfo> = plan
        .nodes
        .iter()
        .filter(|id| !lost.iter().any(|(l, _)| l == *id))
        .filter_map(|id| state.membership.get(id).map(|m| &m.info))
        .collect();
    let num_survivors = survivors.len();
    let admitted = admit_joiners(survivors, joiners, cfg, state);
    if admitted.len() < cfg.min_nodes {
        return wait_or_fail(now, state, cfg, admitted.len(), &format!("{lost_text}; "));
    }
    let (new, text) = new_plan(&admitted, state, plan.generation + 1);
    let joined = placed(&admitted[num_survivors..], &new);
    let mut reason = format!(
        "{lost_text}; {num_survivors} of {} alive",
        count(plan.nodes.len(), "node")
    );
    if !joined.is_empty() {
        reason = format!("{reason}; {} joined", named(&joined));
    }
    let reason = format!("{reason}; plan: {text}");
    let reason = with(
        reason,
        spare_note(&unplaced(&admitted, &new), &new, cfg, state),
    );
    let mut lost: Vec<NodeId> = lost.iter().map(|(id, _)| id.clone()).collect();
    lost.sort();
    (
        Decision::Recover {
            plan: new,
            lost,
            joined,
        },
        reason,
    )
}

/// Rule 2: fewer than `min_nodes` nodes; `prefix` says what caused it.
fn wait_or_fail(
    now: Instant,
    state: &ClusterState,
    cfg: &ElasticConfig,
    alive: usize,
    prefix: &str,
) -> (Decision, String) {
    let needed = cfg.min_nodes;
    let until = later(state.waiting_since.unwrap_or(now), cfg.join_timeout());
    if now >= until {
        return fail(format!(
            "{prefix}only {} alive, {needed} needed (elastic.min_nodes), after waiting {} s \
             (elastic.join_timeout_s); {RESUME_HINT}",
            count(alive, "node"),
            cfg.join_timeout_s
        ));
    }
    let reason = format!(
        "{prefix}{} alive, {needed} needed (elastic.min_nodes); waiting up to {} s \
         (elastic.join_timeout_s) for more to join",
        count(alive, "node"),
        cfg.join_timeout_s
    );
    let decision = Decision::Wait {
        alive,
        needed,
        until,
    };
    (decision, reason)
}

/// What every `Fail` tells the operator.
const RESUME_HINT: &str = "committed checkpoints are intact: run `seqpipe resume` to continue \
                           from the latest once enough nodes are available";

fn fail(reason: String) -> (Decision, String) {
    (
        Decision::Fail {
            reason: reason.clone(),
        },
        reason,
    )
}

/// The current plan's nodes that are gone, with why, in plan (id) order.
fn lost_nodes(
    now: Instant,
    state: &ClusterState,
    plan: &Plan,
    cfg: &ElasticConfig,
) -> Vec<(NodeId, String)> {
    let mut lost = Vec::new();
    for id in &plan.nodes {
        let why = match state.membership.get(id) {
            None => Some("unknown to the coordinator".to_string()),
            Some(m) => match &m.status {
                NodeStatus::Dead { reason } => Some(reason.clone()),
                _ if !m.admitted => Some(format!(
                    "its agent restarted and joined again as incarnation {}",
                    m.incarnation
                )),
                NodeStatus::Leaving
                    if !state.at_step_boundary
                        && now.saturating_duration_since(m.status_since) >= cfg.grace() =>
                {
                    Some(format!(
                        "its {} s preemption grace ran out before a step boundary",
                        cfg.grace_s
                    ))
                }
                _ => None,
            },
        };
        if let Some(why) = why {
            lost.push((id.clone(), why));
        }
    }
    lost
}

/// `base` plus the shortest prefix of `joiners` (in join order) that reaches `min_nodes` and
/// the most worker slots any prefix can have (see [`best_layout`]), without passing `max_nodes`.
/// The worker count depends only on the total slots and never falls as slots are added, so a
/// joiner is admitted while it, alone or with the next ones, adds workers. With one replica this
/// is: while the plan has fewer than `min_nodes` nodes or fewer slots than `max_stages`.
fn admit_joiners<'a>(
    base: Vec<&'a NodeInfo>,
    joiners: &[&'a NodeInfo],
    cfg: &ElasticConfig,
    state: &ClusterState,
) -> Vec<&'a NodeInfo> {
    let mut nodes = base;
    let room = if cfg.max_nodes == 0 {
        joiners.len()
    } else {
        cfg.max_nodes.saturating_sub(nodes.len()).min(joiners.len())
    };
    let mut totals = vec![nodes.iter().map(|n| n.slots).sum::<usize>()];
    for joiner in &joiners[..room] {
        totals.push(totals[totals.len() - 1] + joiner.slots);
    }
    let workers = |total: usize| {
        best_layout(total, state.max_stages, &state.replicas).map_or(0, |(d, p)| d * p)
    };
    let most = workers(totals[room]);
    let for_workers = (0..=room)
        .find(|&k| workers(totals[k]) == most)
        .unwrap_or(room);
    let for_min_nodes = cfg.min_nodes.saturating_sub(nodes.len()).min(room);
    nodes.extend_from_slice(&joiners[..for_workers.max(for_min_nodes)]);
    nodes
}

/// Says why `spares` (nodes without a worker in `plan`) stay spares (empty when there are none).
fn spare_note(spares: &[NodeId], plan: &Plan, cfg: &ElasticConfig, state: &ClusterState) -> String {
    if spares.is_empty() {
        return String::new();
    }
    let (verb, it) = if spares.len() == 1 {
        ("stays", "it")
    } else {
        ("stay", "them")
    };
    let why = if cfg.max_nodes != 0 && plan.nodes.len() >= cfg.max_nodes {
        format!("elastic.max_nodes = {} reached", cfg.max_nodes)
    } else if state.replicas.wanted <= 1 {
        format!("all {} stages are placed", state.max_stages)
    } else {
        format!(
            "the best layout, {} × {}, has no worker for {it}",
            plan.replicas,
            plan.num_stages()
        )
    };
    format!("{} {verb} spare: {why}", named(spares))
}

fn waits_note(joined: &[NodeId]) -> String {
    if joined.is_empty() {
        return String::new();
    }
    let verb = if joined.len() == 1 { "waits" } else { "wait" };
    format!(
        "{} {verb} for the next step boundary to join",
        named(joined)
    )
}

/// The current plan's nodes again, under the next generation from `state.step`: for a pipeline
/// that stopped at a step boundary to change its plan when [`decide`] no longer changes it (the
/// node that joined there was lost before the new plan was adopted), so that it restarts where
/// it stopped, fenced from the workers it stopped. A `Grow` that admits nobody; `None` without a
/// current plan, or when a node of the plan is no longer a member.
pub fn restart_plan(state: &ClusterState) -> Option<(Decision, String)> {
    let plan = state.current.as_ref()?;
    let nodes: Vec<&NodeInfo> = plan
        .nodes
        .iter()
        .map(|id| state.membership.get(id).map(|m| &m.info))
        .collect::<Option<_>>()?;
    let (new, text) = new_plan(&nodes, state, plan.generation + 1);
    let reason = format!(
        "the plan change at step {} was undone before it was adopted; restarting on the same nodes: {text}",
        state.step
    );
    Some((
        Decision::Grow {
            plan: new,
            joined: Vec::new(),
        },
        reason,
    ))
}

/// The plan of `nodes` under the state's replica policy, and how it reads in a reason.
fn new_plan(nodes: &[&NodeInfo], state: &ClusterState, generation: u64) -> (Plan, String) {
    let infos: Vec<NodeInfo> = nodes.iter().map(|&n| n.clone()).collect();
    // `nodes` is non-empty (min_nodes >= 1) with slots >= 1 each, and max_stages >= 1.
    let plan = plan_layout(
        &infos,
        state.max_stages,
        &state.replicas,
        generation,
        state.step,
    )
    .expect("a non-empty set of nodes with slots always has a plan");
    let total = infos.iter().map(|n| n.slots).sum();
    let text = layout(&plan, total, state);
    (plan, text)
}

/// The ids of `nodes` that run a worker in `plan`, in the order given.
fn placed(nodes: &[&NodeInfo], plan: &Plan) -> Vec<NodeId> {
    nodes
        .iter()
        .filter(|n| plan.contains(&n.id))
        .map(|n| n.id.clone())
        .collect()
}

/// The ids of `nodes` that run no worker in `plan`, in the order given.
fn unplaced(nodes: &[&NodeInfo], plan: &Plan) -> Vec<NodeId> {
    nodes
        .iter()
        .filter(|n| !plan.contains(&n.id))
        .map(|n| n.id.clone())
        .collect()
}

/// `ids` without repeats, first occurrence kept.
fn unique(ids: Vec<NodeId>) -> Vec<NodeId> {
    let mut seen = Vec::with_capacity(ids.len());
    for id in ids {
        if !seen.contains(&id) {
            seen.push(id);
        }
    }
    seen
}

/// `node a` or `nodes a, b`.
fn named(ids: &[NodeId]) -> String {
    let list = ids
        .iter()
        .map(NodeId::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if ids.len() == 1 {
        format!("node {list}")
    } else {
        format!("nodes {list}")
    }
}

/// `node a is` or `nodes a, b are`.
fn is(ids: &[NodeId]) -> String {
    let verb = if ids.len() == 1 { "is" } else { "are" };
    format!("{} {verb}", named(ids))
}

/// `1 node`, `3 nodes`.
fn count(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// `4 stages on a, b (generation 3)` with one replica wanted. With more: the data-parallel
/// dimension and why this layout, out of `total_slots` slots:
/// `2 replicas × 2 stages on a, b, c, d (generation 5), using all 4 slots`, or
/// `1 replica × 3 stages on a, b, c (generation 2), using all 3 slots (2 replicas would use fewer)`.
fn layout(plan: &Plan, total_slots: usize, state: &ClusterState) -> String {
    let nodes = plan.nodes.iter().map(NodeId::as_str).collect::<Vec<_>>();
    let on = format!("on {} (generation {})", nodes.join(", "), plan.generation);
    let policy = &state.replicas;
    if policy.wanted <= 1 {
        return format!("{} {on}", count(plan.num_stages(), "stage"));
    }
    let (d, workers) = (plan.replicas, plan.num_workers());
    let used = if workers == total_slots {
        format!("using all {}", count(total_slots, "slot"))
    } else {
        format!("using {workers} of {total_slots} slots, the most any layout can")
    };
    // Ties go to more replicas, so any larger accepted count places fewer workers.
    let more = policy
        .valid
        .iter()
        .copied()
        .filter(|&m| m > d && m <= policy.wanted)
        .max()
        .map_or(String::new(), |m| {
            format!(" ({m} replicas would use fewer)")
        });
    format!(
        "{} × {} {on}, {used}{more}",
        count(d, "replica"),
        count(plan.num_stages(), "stage")
    )
}

/// `a; b`, dropping empty parts.
fn with(reason: String, note: String) -> String {
    if note.is_empty() {
        reason
    } else {
        format!("{reason}; {note}")
    }
}

/// `t + d`, or as far as an `Instant` reaches when that overflows.
fn later(t: Instant, d: Duration) -> Instant {
    let mut d = d;
    loop {
        if let Some(u) = t.checked_add(d) {
            return u;
        }
        d /= 2;
    }
}

/// Where the state of a rebuilt pipeline comes from after a failure or a plan change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// From the in-memory snapshots of the state after `step` that live nodes hold (each node of
    /// replica 0 copies its state to itself and to its buddy, see [`buddies`]).
    PeerSnapshot {
        /// The step the snapshots are of.
        step: u64,
    },
    /// From the committed checkpoint of `step` in the object store.
    Checkpoint {
        /// The checkpoint's step.
        step: u64,
    },
    /// Nothing survives: from the seed's initial weights.
    Restart,
}

/// Where the rebuilt pipeline's state comes from when `interrupted_step` could not complete.
///
/// `peer_snapshot` is the newest step whose peer snapshots, on nodes still alive, hold the whole
/// model's state (parameters and AdamW moments; with several replicas, replica 0's snapshots
/// are the ones taken, see [`buddies`]); `checkpoint` the newest committed checkpoint. The tier
/// does not depend on the plan's layout.
/// The newer of the two wins, the snapshots on a tie (memory is faster than the object store);
/// with neither, the run restarts from the initial weights. The reason says what decided it and
/// how many completed steps are redone.
pub fn recovery_tier(
    peer_snapshot: Option<u64>,
    checkpoint: Option<u64>,
    interrupted_step: u64,
) -> (Tier, String) {
    let redo = |from: u64| match interrupted_step.saturating_sub(from + 1) {
        0 => format!("redo step {interrupted_step}"),
        lost => format!("redo {lost} completed step(s) and step {interrupted_step}"),
    };
    match (peer_snapshot, checkpoint) {
        (Some(p), c) if c.is_none_or(|c| c <= p) => (
            Tier::PeerSnapshot { step: p },
            format!(
                "the peer snapshots of step {p} on live nodes hold the whole model{}; {} from them",
                c.map_or(String::new(), |c| format!(" (newest checkpoint: step {c})")),
                redo(p)
            ),
        ),
        (p, Some(c)) => (
            Tier::Checkpoint { step: c },
            format!(
                "{}; {} from the checkpoint of step {c}",
                match p {
                    Some(p) =>
                        format!("the peer snapshots (step {p}) are older than checkpoint {c}"),
                    None => "no peer snapshot on live nodes holds the whole model".to_string(),
                },
                redo(c)
            ),
        ),
        (_, None) => (
            Tier::Restart,
            format!(
                "neither a peer snapshot nor a committed checkpoint holds the model; {} from the initial weights",
                redo(0)
            ),
        ),
    }
}

/// Who holds whose peer snapshot: each node's state is copied to the node of the next stage
/// after its last one that is on a different node, wrapping around (`a → b → c → a` for stages
/// `[a, a, b, c]`). A pipeline on a single node has no buddies.
///
/// Only replica 0 takes peer snapshots (every replica holds the same state after a step), so
/// the buddies are those of replica 0's pipeline, slots `0..p`: with several replicas, a node
/// that runs no stage of replica 0 has no buddy and is nobody's. With one replica that is the
/// whole plan.
pub fn buddies(plan: &Plan) -> BTreeMap<NodeId, NodeId> {
    let stages = plan.replica(0);
    let n = stages.len();
    let mut last_stage: BTreeMap<&NodeId, usize> = BTreeMap::new();
    for (r, id) in stages.iter().enumerate() {
        last_stage.insert(id, r);
    }
    let mut buddy_of = BTreeMap::new();
    for (id, last) in last_stage {
        let next = (1..n)
            .map(|k| &stages[(last + k) % n])
            .find(|other| *other != id);
        if let Some(other) = next {
            buddy_of.insert(id.clone(), other.clone());
        }
    }
    buddy_of
}
