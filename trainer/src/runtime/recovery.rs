//! Every recovery decision of the launcher, as pure functions (after torchft's `quorum_compute`):
//! no I/O, no clock, no error text. The coordinator and the pipeline gather what they observed
//! (reports, exits, live agents, peer snapshots held, committed checkpoints), call these, log the
//! reason and carry the result out; the plan itself comes from [`elastic::decide`] and the source
//! of the state from [`elastic::recovery_tier`].
//!
//! The decisions, in the order a failure meets them:
//! 1. [`after_error`]: is an error a lost node (recover), a plan change at a step boundary
//!    (hand over), or the end of the run? And [`after_reports`]: once the reports are in, did a
//!    worker fail in a way that recurs anywhere (a data error)? Then nothing was lost: stop.
//! 2. [`mid_step_stage`]: can the step go on with one replaced stage (exactly one stage proven
//!    dead, and it had not finished the step)?
//! 3. [`step_start_state`]: where that replacement's step-start state comes from.
//! 4. [`classify`]: otherwise, once the workers are stopped, which nodes the failure cost.
//! 5. [`peer_coverage`] and [`next_start`]: where the next pipeline's state comes from.
//! 6. [`recorded_tier`]: how the completed recovery is labelled in `metrics.jsonl`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::PathBuf;

use elastic::NodeId;
use serde::{Deserialize, Serialize};

use super::control::ToWorker;
use super::error::{LaunchError, LossCause, Lost};

/// Which checkpoint a run resumes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResumePoint {
    /// The newest committed checkpoint.
    Latest,
    /// The committed checkpoint of this step.
    Step(u64),
}

/// How a run's state starts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Start {
    /// Fresh weights from the seed.
    #[default]
    Fresh,
    /// From a committed checkpoint in the configured store.
    Resume(ResumePoint),
    /// From the peer snapshots of the state after `step` held by the agents at `sources`.
    Peers {
        /// The step the snapshots are of.
        step: u64,
        /// The agents' snapshot addresses.
        sources: Vec<String>,
    },
    /// Weights from a Hugging Face GPT-2 directory, fresh optimizer.
    InitFrom(PathBuf),
}

/// How a recovery carried the state over, as recorded in the `recovered` event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// One lost stage was replaced in the middle of the step; nothing else restarted.
    MidStep,
    /// Data parallelism: a lost replica's micro-batches were computed by a surviving replica in
    /// the middle of the step; the step completed with the same result.
    Reroute,
    /// From the peer snapshots in the agents' memory.
    Peer,
    /// From the newest committed checkpoint.
    Checkpoint,
    /// From a checkpoint of the step boundary where the plan changed (nodes left or joined).
    Handover,
    /// From the initial weights, after completed steps were lost.
    Restart,
}

impl Tier {
    /// Every tier, cheapest first.
    pub const ALL: [Tier; 6] = [
        Self::MidStep,
        Self::Reroute,
        Self::Peer,
        Self::Checkpoint,
        Self::Handover,
        Self::Restart,
    ];

    /// The name used in events and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::MidStep => "mid_step",
            Self::Reroute => "reroute",
            Self::Peer => "peer",
            Self::Checkpoint => "checkpoint",
            Self::Handover => "handover",
            Self::Restart => "restart",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the run does after an error of the pipeline it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterError {
    /// A node may be lost: stop the workers, find the losses ([`classify`]), plan again.
    Recover,
    /// Nodes leave or join at the boundary after `step`: restart under the new plan.
    ChangePlan {
        /// The step whose checkpoint the new plan starts from.
        step: u64,
    },
    /// The run stops with the error (it would recur on any node, or is the user's to fix).
    Stop,
}

/// Decision 1: what an error of the running pipeline means.
pub fn after_error(error: &LaunchError) -> AfterError {
    match error {
        LaunchError::WorkerFailed { .. }
        | LaunchError::WorkerDisconnected { .. }
        | LaunchError::WorkerExited { .. }
        | LaunchError::Timeout { .. }
        | LaunchError::ReductionFailed { .. }
        | LaunchError::NodesLost { .. } => AfterError::Recover,
        LaunchError::PlanChanged { step, .. } => AfterError::ChangePlan { step: *step },
        LaunchError::Io { .. }
        | LaunchError::Data(_)
        | LaunchError::Protocol(_)
        | LaunchError::Checkpoint(_)
        | LaunchError::FinalCheckpointFailed { .. }
        | LaunchError::Run(_)
        | LaunchError::OverBudget { .. }
        | LaunchError::NodeTooSmall { .. }
        | LaunchError::Permanent { .. } => AfterError::Stop,
    }
}

/// Decision 1b: after a failure that looked like a loss (`failure`, described by `cause`), with
/// the reports gathered while the workers stopped. A permanent failure among them (`permanent`: a
/// data error, on any stage) is the run's error: the other reports were its consequences —
/// neighbours whose links closed because that worker exited — not lost nodes, and recovering
/// would only meet it again. Otherwise the losses found are recovered from (none: `failure` ends
/// the run).
pub fn after_reports(
    failure: LaunchError,
    cause: String,
    permanent: Option<LaunchError>,
    lost: Vec<Lost>,
) -> LaunchError {
    match permanent {
        Some(permanent) => permanent,
        None if lost.is_empty() => failure,
        None => LaunchError::NodesLost { cause, lost },
    }
}

/// One thing the pipeline saw go wrong during a step, for [`mid_step_stage`].
#[derive(Clone, Debug)]
pub enum Sign {
    /// The workers of `stages` are gone: `lost` says which node and how.
    Lost {
        /// The stages the loss took out.
        stages: Vec<usize>,
        /// The node and how it was lost.
        lost: Lost,
    },
    /// A failure that does not show which stage died: a worker's own error, a timeout, a
    /// protocol error.
    Unclear,
}

impl Sign {
    /// The sign an error of the pipeline is; `stages_of` maps a node to its stages in the plan,
    /// `lost_worker` makes the [`Lost`] of a stage whose worker is gone.
    pub fn of(
        error: &LaunchError,
        stages_of: impl Fn(&NodeId) -> Vec<usize>,
        lost_worker: impl Fn(usize, LossCause) -> Lost,
    ) -> Vec<Self> {
        match error {
            LaunchError::WorkerExited { stage, .. } => vec![Self::Lost {
                stages: vec![*stage],
                lost: lost_worker(*stage, LossCause::WorkerExited),
            }],
            LaunchError::WorkerDisconnected { stage, .. } => vec![Self::Lost {
                stages: vec![*stage],
                lost: lost_worker(*stage, LossCause::WorkerDisconnected),
            }],
            LaunchError::NodesLost { lost, .. } => lost
                .iter()
                .map(|l| Self::Lost {
                    stages: stages_of(&l.node),
                    lost: l.clone(),
                })
                .collect(),
            _ => vec![Self::Unclear],
        }
    }
}

/// Decision 2: the one stage to replace in the middle of the step, or why the step cannot go on.
///
/// Mid-step recovery needs proof of exactly one dead stage: a process exit or a closed
/// connection. A node that went silent may be alive behind a partition (only fencing it and
/// restarting from snapshots is safe), and a worker's own error or a timeout does not say which
/// stage died. A stage that had already finished the step (`finished`) needs no replay: the step
/// restarts instead. A node-level loss (its agent died) is kept over a worker-level one of the
/// same stage.
pub fn mid_step_stage(signs: &[Sign], finished: &BTreeSet<usize>) -> Result<(usize, Lost), String> {
    let mut dead: BTreeMap<usize, Lost> = BTreeMap::new();
    for sign in signs {
        match sign {
            Sign::Unclear => return Err("a failure that does not show which stage died".into()),
            Sign::Lost { lost, .. } if !lost.cause.proves_death() => {
                return Err(format!(
                    "node {} is {:?}, not proven dead (it may be alive behind a partition)",
                    lost.node, lost.cause
                ));
            }
            Sign::Lost { stages, lost } => {
                for &stage in stages {
                    match dead.get(&stage) {
                        Some(known) if lost.agent_alive || !known.agent_alive => {}
                        _ => {
                            dead.insert(stage, lost.clone());
                        }
                    }
                }
            }
        }
    }
    let mut dead = dead.into_iter();
    match (dead.next(), dead.next()) {
        (None, _) => Err("no stage is known to be lost".into()),
        (Some(_), Some(_)) => Err("more than one stage was lost".into()),
        (Some((stage, _)), None) if finished.contains(&stage) => Err(format!(
            "stage {stage} had already finished the step: nothing to replay"
        )),
        (Some((stage, lost)), None) => Ok((stage, lost)),
    }
}

/// Whether the signs gathered after a failure settle what was lost, so that the launcher can act
/// at once instead of waiting for the reports to stop: nothing is unclear or unproven, and every
/// stage shown lost has a verdict — its agent reported the worker's exit (the node lives), or the
/// node's agent is gone and the worker's own control connection has closed too (it is not in
/// `open`, the stages whose worker connection is still open). A closed worker connection alone
/// is no verdict: whether the node died with it shows a few milliseconds later, when its agent
/// reports the exit or its own connection closes, and a recovery that misses it would place a
/// stage on a dead node; and a close still in flight would later be taken for the replacement's.
pub fn signs_settled(signs: &[Sign], open: &BTreeSet<usize>) -> bool {
    let mut shown: BTreeSet<usize> = BTreeSet::new();
    let mut exited: BTreeSet<usize> = BTreeSet::new();
    let mut node_gone: BTreeSet<usize> = BTreeSet::new();
    for sign in signs {
        let Sign::Lost { stages, lost } = sign else {
            return false;
        };
        match lost.cause {
            LossCause::WorkerExited => exited.extend(stages),
            LossCause::AgentDisconnected
            | LossCause::AgentRestarted
            | LossCause::AgentUnreachable => node_gone.extend(stages),
            LossCause::WorkerDisconnected => {}
            LossCause::WorkerFailed | LossCause::Hung | LossCause::Silent => return false,
        }
        shown.extend(stages);
    }
    !shown.is_empty()
        && shown
            .iter()
            .all(|s| exited.contains(s) || (node_gone.contains(s) && !open.contains(s)))
}

/// The worker slots an error of a data-parallel pipeline shows gone (`slots_of` maps a node to
/// its slots), or `None` when it does not show which: a timeout, a permanent failure, a protocol
/// error. A worker that failed by itself counts as gone (it exits).
pub fn failed_slots(
    error: &LaunchError,
    slots_of: impl Fn(&NodeId) -> Vec<usize>,
) -> Option<Vec<usize>> {
    match error {
        LaunchError::WorkerExited { stage, .. }
        | LaunchError::WorkerDisconnected { stage, .. }
        | LaunchError::WorkerFailed { stage, .. } => Some(vec![*stage]),
        LaunchError::NodesLost { lost, .. } => {
            Some(lost.iter().flat_map(|l| slots_of(&l.node)).collect())
        }
        _ => None,
    }
}

/// Decision 2 with data parallelism: the one replica to take out of the step, its share of the
/// micro-batches re-routed to a surviving replica (`stages` × `replicas` slots; `failed` the slots
/// shown gone, `None` for a failure that does not show which). Every failed slot must belong to
/// that replica, and another replica must remain. `Err` says why the step cannot go on.
pub fn lost_replica(
    failed: &[Option<Vec<usize>>],
    stages: usize,
    replicas: usize,
) -> Result<usize, String> {
    let mut lost = BTreeSet::new();
    for slots in failed {
        let Some(slots) = slots else {
            return Err("a failure that does not show which worker died".into());
        };
        lost.extend(slots.iter().map(|w| w / stages.max(1)));
    }
    let mut lost = lost.into_iter();
    match (lost.next(), lost.next()) {
        (None, _) => Err("no worker is known to be lost".into()),
        (Some(_), Some(_)) => Err("workers of more than one replica were lost".into()),
        (Some(r), None) if r >= replicas => Err(format!("replica {r} does not exist")),
        (Some(_), None) if replicas < 2 => Err("no other replica to take over".into()),
        (Some(r), None) => Ok(r),
    }
}

/// The replica that computes lost replica `lost`'s share: the next surviving one after it
/// (replica indices wrap around), so that the extra work does not always fall on replica 0.
pub fn adopter(lost: usize, replicas: usize) -> usize {
    (lost + 1) % replicas.max(1)
}

/// How the pipeline's state was loaded, for [`step_start_state`].
#[derive(Clone, Debug)]
pub struct Loaded<'a> {
    /// Where it came from.
    pub start: &'a Start,
    /// The step it belongs to (0: before the first step).
    pub step: u64,
}

/// Decision 3: how a replacement of a stage lost in step `step` gets the state that stage had at
/// the start of the step: the peer snapshots of step − 1 that cover the stage (`peer_sources`,
/// the agents holding them), else what the pipeline loaded when that is the step-start state
/// (the checkpoint, the initial weights, a GPT-2 directory); `Some(None)` means the seeded initial
/// weights the replacement starts with; `None` means there is no such state (mid-step recovery
/// is impossible).
pub fn step_start_state(
    step: u64,
    peer_sources: Option<Vec<String>>,
    loaded: Loaded<'_>,
) -> Option<Option<ToWorker>> {
    let before = step.checked_sub(1)?;
    if let Some(sources) = peer_sources {
        return Some(Some(ToWorker::RestorePeers {
            step: before,
            sources,
        }));
    }
    if before != loaded.step {
        return None;
    }
    match loaded.start {
        Start::Fresh => Some(None),
        Start::InitFrom(dir) => Some(Some(ToWorker::InitFrom { dir: dir.clone() })),
        Start::Resume(_) => Some(Some(ToWorker::Restore { step: before })),
        // The snapshots the pipeline loaded were not found again: nothing holds them now.
        Start::Peers { .. } => None,
    }
}

/// What the launcher observed once the workers of a failed pipeline are stopped, for
/// [`classify`].
#[derive(Clone, Copy, Debug)]
pub struct Observed<'a> {
    /// Stage → the node that ran it.
    pub stages: &'a [NodeId],
    /// Nodes whose agent is connected and not fenced.
    pub live_agents: &'a BTreeSet<NodeId>,
    /// Nodes declared lost while the pipeline ran (agent connection closed, silent, restarted).
    pub reported: &'a [Lost],
    /// Stage → exit code of its worker that the agent reported (`None`: ended by a signal).
    pub exits: &'a BTreeMap<usize, Option<i32>>,
    /// Stages a neighbour found silent past the timeout.
    pub suspects: &'a BTreeSet<usize>,
    /// The exit code of a worker that stopped only because a neighbour failed.
    pub peer_failure_exit_code: i32,
    /// Stages replaced mid-step in the step that failed → the loss each was replaced for. A
    /// replacement's exit overwrites its stage's entry in `exits`.
    pub replaced: &'a BTreeMap<usize, Lost>,
}

/// Decision 4: the nodes a failure (`cause`, for people) cost: those declared lost, those whose
/// agent is gone, and those whose worker died by itself (killed, or failed), as opposed to
/// workers that stopped only because a neighbour failed, whose nodes are healthy. When nothing
/// died, the stages a neighbour found silent are the lost ones (hung or cut off). A node whose
/// agent lives lost only its worker: it joins again at once. A stage replaced mid-step whose
/// replacement exited too costs the node it was replaced for.
pub fn classify(cause: &str, seen: Observed<'_>) -> Vec<Lost> {
    fn add(lost: &mut Vec<Lost>, node: &NodeId, reason: String, cause: LossCause, alive: bool) {
        if !lost.iter().any(|l| l.node == *node) {
            lost.push(Lost {
                node: node.clone(),
                reason,
                cause,
                agent_alive: alive,
            });
        }
    }
    let mut lost: Vec<Lost> = Vec::new();
    // Reported losses are of agents that closed, went silent or restarted: their nodes stay lost.
    for l in seen.reported {
        add(&mut lost, &l.node, l.reason.clone(), l.cause, false);
    }
    for node in seen.stages {
        if !seen.live_agents.contains(node) {
            let reason = format!("the agent of node {node} is gone ({cause})");
            add(&mut lost, node, reason, LossCause::AgentDisconnected, false);
        }
    }
    for (&stage, &code) in seen.exits {
        if code != Some(seen.peer_failure_exit_code)
            && let Some(node) = seen.stages.get(stage)
        {
            let alive = seen.live_agents.contains(node);
            add(
                &mut lost,
                node,
                cause.to_string(),
                LossCause::WorkerExited,
                alive,
            );
        }
    }
    // A stage replaced mid-step whose replacement exited too (say, with a neighbour-failure code
    // after its relink timed out): the first loss still stands, though the replacement's exit
    // code replaced the evidence of it. Without it a failed mid-step recovery with every agent
    // alive would cost no node, and the run would end instead of restarting the step.
    for (stage, l) in seen.replaced {
        if seen.exits.contains_key(stage) {
            add(&mut lost, &l.node, l.reason.clone(), l.cause, l.agent_alive);
        }
    }
    if lost.is_empty() {
        for &stage in seen.suspects {
            if let Some(node) = seen.stages.get(stage)
                && !seen.exits.contains_key(&stage)
            {
                let alive = seen.live_agents.contains(node);
                add(&mut lost, node, cause.to_string(), LossCause::Hung, alive);
            }
        }
    }
    lost
}

/// The peer snapshots the agents reported holding: step → node → tensor names.
pub type Held = BTreeMap<u64, BTreeMap<NodeId, BTreeSet<String>>>;

/// Decision 5a: the live nodes holding a snapshot of every name in `names` for `step`, or `None`
/// when the live ones do not cover them all.
pub fn peer_holders(
    held: &Held,
    step: u64,
    names: &[String],
    live: impl Fn(&NodeId) -> bool,
) -> Option<Vec<NodeId>> {
    let alive: Vec<(&NodeId, &BTreeSet<String>)> = held
        .get(&step)?
        .iter()
        .filter(|(node, _)| live(node))
        .collect();
    names
        .iter()
        .all(|n| alive.iter().any(|(_, h)| h.contains(n)))
        .then(|| alive.iter().map(|(n, _)| (*n).clone()).collect())
}

/// Forgets every peer snapshot `node` was reported to hold (a new incarnation of it joined: the
/// old one's memory may be gone), and the steps no node holds any more.
pub fn forget_node(held: &mut Held, node: &NodeId) {
    for holders in held.values_mut() {
        holders.remove(node);
    }
    held.retain(|_, holders| !holders.is_empty());
}

/// Decision 5b: the newest step before `interrupted_step` whose peer snapshots on live nodes cover
/// the whole model (`names_at(step)`: its parameters, with AdamW moments after step 0), with the
/// nodes holding it. The interrupted step's own snapshots do not count: a loss during its update
/// can leave them complete while the run never recorded the step (its loss, its learning rate),
/// so the step is redone from the one before.
pub fn peer_coverage(
    held: &Held,
    interrupted_step: u64,
    names_at: impl Fn(u64) -> Vec<String>,
    live: impl Fn(&NodeId) -> bool,
) -> Option<(u64, Vec<NodeId>)> {
    held.range(..interrupted_step).rev().find_map(|(&step, _)| {
        peer_holders(held, step, &names_at(step), &live).map(|nodes| (step, nodes))
    })
}

/// Decision 5c: where the next pipeline's state comes from after `interrupted_step` could not
/// complete, given the newest covering peer snapshot (`peer`: its step and the snapshot
/// addresses of its holders) and the newest committed checkpoint; the tier comes from
/// [`elastic::recovery_tier`]. Returns the start, its tier and the reason.
pub fn next_start(
    peer: Option<(u64, Vec<String>)>,
    latest_checkpoint: Option<u64>,
    interrupted_step: u64,
) -> (Start, Tier, String) {
    let (tier, reason) = elastic::recovery_tier(
        peer.as_ref().map(|(step, _)| *step),
        latest_checkpoint,
        interrupted_step,
    );
    match tier {
        elastic::Tier::PeerSnapshot { step } => {
            let sources = peer.map(|(_, s)| s).unwrap_or_default();
            (Start::Peers { step, sources }, Tier::Peer, reason)
        }
        elastic::Tier::Checkpoint { .. } => {
            (Start::Resume(ResumePoint::Latest), Tier::Checkpoint, reason)
        }
        elastic::Tier::Restart => (Start::Fresh, Tier::Checkpoint, reason),
    }
}

/// Decision 6: the tier a completed recovery is recorded with. A pipeline that did not resume
/// from anything (`resumed` false) restarted from the seeded initial weights: when no completed
/// step was lost, that is the state every worker held before the interrupted step (as good as a
/// peer snapshot); otherwise completed steps were lost (a restart).
pub fn recorded_tier(tier: Tier, resumed: bool, lost_steps: u64) -> Tier {
    match (resumed, lost_steps) {
        (true, _) => tier,
        (false, 0) => Tier::Peer,
        (false, _) => Tier::Restart,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sign(stages: &[usize], cause: LossCause) -> Sign {
        Sign::Lost {
            stages: stages.to_vec(),
            lost: Lost {
                node: NodeId::new("n"),
                reason: "test".into(),
                cause,
                agent_alive: matches!(cause, LossCause::WorkerExited),
            },
        }
    }

    #[test]
    fn a_closed_worker_connection_settles_nothing_until_its_node_has_a_verdict() {
        use LossCause::*;
        let none = BTreeSet::new();
        assert!(!signs_settled(&[], &none));
        assert!(!signs_settled(&[sign(&[1], WorkerDisconnected)], &none));
        // A worker kill: its agent reports the exit.
        assert!(signs_settled(
            &[sign(&[1], WorkerDisconnected), sign(&[1], WorkerExited)],
            &none
        ));
        // A node kill: its agent's connection closes, and the worker's (before or after).
        let stage_1_open = BTreeSet::from([1]);
        assert!(!signs_settled(
            &[sign(&[1], AgentDisconnected)],
            &stage_1_open
        ));
        assert!(signs_settled(
            &[
                sign(&[1], AgentDisconnected),
                sign(&[1], WorkerDisconnected)
            ],
            &none
        ));
        assert!(signs_settled(&[sign(&[3], AgentRestarted)], &none));
        // Two stages lost, one still without a verdict.
        assert!(!signs_settled(
            &[sign(&[1], WorkerExited), sign(&[2], WorkerDisconnected)],
            &none
        ));
    }

    #[test]
    fn unclear_or_unproven_signs_never_settle() {
        use LossCause::*;
        let none = BTreeSet::new();
        for cause in [WorkerFailed, Hung, Silent] {
            let signs = [sign(&[1], WorkerExited), sign(&[2], cause)];
            assert!(!signs_settled(&signs, &none));
        }
        assert!(!signs_settled(
            &[sign(&[1], WorkerExited), Sign::Unclear],
            &none
        ));
    }

    fn lost(node: &str, cause: LossCause, agent_alive: bool) -> Lost {
        Lost {
            node: NodeId::new(node),
            reason: format!("{node} {cause:?}"),
            cause,
            agent_alive,
        }
    }

    /// A data error on stage 0 makes stage 1's link close ("connection to stage 0 failed") and
    /// stage 0's worker exit: whichever report came first, the run stops with the data error and
    /// no node is lost; without a permanent report the losses are recovered from.
    #[test]
    fn a_permanent_report_stops_the_run_whatever_its_neighbours_reported() {
        let data = || LaunchError::Permanent {
            stage: 0,
            error: "token file /d/val.bin holds 0 tokens".into(),
        };
        let neighbour = || LaunchError::WorkerFailed {
            stage: 1,
            error: "connection to stage 0 failed".into(),
            log: "stage-1.log".into(),
        };
        let losses = || {
            vec![
                lost("b", LossCause::WorkerFailed, true),
                lost("a", LossCause::WorkerExited, true),
            ]
        };
        let cause = || "stage 1 failed".to_string();
        // (first failure, permanent report, losses found) → the run's error.
        match after_reports(neighbour(), cause(), Some(data()), losses()) {
            LaunchError::Permanent { stage: 0, error } => assert!(error.contains("val.bin")),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            after_error(&after_reports(
                neighbour(),
                cause(),
                Some(data()),
                Vec::new()
            )),
            AfterError::Stop
        );
        match after_reports(neighbour(), cause(), None, losses()) {
            LaunchError::NodesLost { lost, .. } => assert_eq!(lost.len(), 2),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            after_reports(neighbour(), cause(), None, Vec::new()),
            LaunchError::WorkerFailed { stage: 1, .. }
        ));
    }

    #[test]
    fn mid_step_needs_exactly_one_proven_dead_unfinished_stage() {
        let none = BTreeSet::new();
        let exited = Sign::Lost {
            stages: vec![2],
            lost: lost("c", LossCause::WorkerExited, true),
        };
        assert_eq!(
            mid_step_stage(std::slice::from_ref(&exited), &none)
                .unwrap()
                .0,
            2
        );
        // The same stage seen twice (exit, then its connection closing) is one loss; the
        // node-level loss (agent gone) wins over the worker-level one.
        let agent = Sign::Lost {
            stages: vec![2],
            lost: lost("c", LossCause::AgentDisconnected, false),
        };
        let (stage, l) = mid_step_stage(&[exited.clone(), agent.clone()], &none).unwrap();
        assert_eq!(
            (stage, l.cause, l.agent_alive),
            (2, LossCause::AgentDisconnected, false)
        );
        let (_, l) = mid_step_stage(&[agent, exited.clone()], &none).unwrap();
        assert_eq!(l.cause, LossCause::AgentDisconnected);
        // Two stages, a silent node, an unclear failure, a finished stage: no.
        let other = Sign::Lost {
            stages: vec![1],
            lost: lost("b", LossCause::WorkerDisconnected, true),
        };
        assert!(mid_step_stage(&[exited.clone(), other], &none).is_err());
        let silent = Sign::Lost {
            stages: vec![2],
            lost: lost("c", LossCause::Silent, false),
        };
        assert!(mid_step_stage(&[silent], &none).is_err());
        assert!(mid_step_stage(&[exited.clone(), Sign::Unclear], &none).is_err());
        assert!(mid_step_stage(&[exited], &BTreeSet::from([2])).is_err());
        assert!(mid_step_stage(&[], &none).is_err());
    }

    #[test]
    fn classify_separates_dead_workers_from_their_stopped_neighbours() {
        let stages: Vec<NodeId> = ["a", "b", "c"].map(NodeId::new).to_vec();
        let live: BTreeSet<NodeId> = stages.iter().cloned().collect();
        // Stage 1 was killed (signal); stages 0 and 2 exited because their neighbour failed.
        let exits = BTreeMap::from([(0, Some(3)), (1, None), (2, Some(3))]);
        let seen = Observed {
            stages: &stages,
            live_agents: &live,
            reported: &[],
            exits: &exits,
            suspects: &BTreeSet::from([2]),
            peer_failure_exit_code: 3,
            replaced: &BTreeMap::new(),
        };
        let got = classify("boom", seen);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].node, NodeId::new("b"));
        assert_eq!(got[0].cause, LossCause::WorkerExited);
        assert!(got[0].agent_alive);
        // Nothing died: the suspect is the lost one.
        let quiet = BTreeMap::new();
        let got = classify(
            "timeout",
            Observed {
                exits: &quiet,
                ..seen
            },
        );
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].node.as_str(), got[0].cause), ("c", LossCause::Hung));
        // An agent gone takes its node, whatever its worker did.
        let fewer: BTreeSet<NodeId> = [NodeId::new("a"), NodeId::new("c")].into();
        let got = classify(
            "boom",
            Observed {
                live_agents: &fewer,
                exits: &quiet,
                ..seen
            },
        );
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].cause, LossCause::AgentDisconnected);
        assert!(!got[0].agent_alive);
    }

    /// A mid-step replacement that exited with the neighbour-failure code (its relink timed out,
    /// and its neighbour's too): nothing died this time, but the node it replaced was lost, and
    /// that loss is what the run recovers from (restarting the step), not a reason to end it.
    #[test]
    fn a_failed_mid_step_replacement_still_costs_the_node_it_replaced() {
        let stages: Vec<NodeId> = ["a", "b"].map(NodeId::new).to_vec();
        let live: BTreeSet<NodeId> = stages.iter().cloned().collect();
        let killed = Lost {
            node: NodeId::new("b"),
            reason: "the worker of stage 1 was killed".into(),
            cause: LossCause::WorkerExited,
            agent_alive: true,
        };
        let replaced = BTreeMap::from([(1, killed.clone())]);
        let both_stopped = BTreeMap::from([(0, Some(3)), (1, Some(3))]);
        let seen = Observed {
            stages: &stages,
            live_agents: &live,
            reported: &[],
            exits: &both_stopped,
            suspects: &BTreeSet::from([0]),
            peer_failure_exit_code: 3,
            replaced: &replaced,
        };
        assert_eq!(classify("relink timed out", seen), vec![killed]);
        // Without the replacement's record the same exits cost nothing: the run would end.
        let none = BTreeMap::new();
        let without = Observed {
            replaced: &none,
            ..seen
        };
        assert_eq!(classify("relink timed out", without), vec![]);
        // A replacement that has not exited (it still runs, or the step it was made in is over):
        // the loss it stood in for is not counted again.
        let only_0 = BTreeMap::from([(0, Some(3))]);
        let running = Observed {
            exits: &only_0,
            ..seen
        };
        assert_eq!(classify("relink timed out", running), vec![]);
    }

    #[test]
    fn snapshots_of_the_interrupted_step_do_not_count() {
        let names = |_: u64| vec!["w".to_string()];
        let held: Held = (5..=8)
            .map(|step| {
                let nodes = BTreeMap::from([(NodeId::new("a"), BTreeSet::from(["w".to_string()]))]);
                (step, nodes)
            })
            .collect();
        // Step 8's update finished on every worker (its snapshots are complete), but the run lost
        // a node before it recorded step 8: it redoes step 8 from step 7.
        let (step, nodes) = peer_coverage(&held, 8, names, |_| true).unwrap();
        assert_eq!((step, nodes), (7, vec![NodeId::new("a")]));
        assert_eq!(peer_coverage(&held, 9, names, |_| true).unwrap().0, 8);
        assert_eq!(peer_coverage(&held, 5, names, |_| true), None);
    }

    /// Issue 35: the copies a node's earlier incarnation reported are forgotten when a new one
    /// joins (its process, and the memory holding them, may be gone): coverage that needed them
    /// is gone too, and other nodes' copies stay.
    #[test]
    fn a_new_incarnation_forgets_the_copies_of_the_old_one() {
        let names = |v: &[&str]| {
            v.iter()
                .map(|s| s.to_string())
                .collect::<BTreeSet<String>>()
        };
        let (a, b) = (NodeId::from("a"), NodeId::from("b"));
        let mut held: Held = BTreeMap::new();
        held.entry(4)
            .or_default()
            .insert(a.clone(), names(&["x", "y"]));
        held.entry(4).or_default().insert(b.clone(), names(&["y"]));
        held.entry(3).or_default().insert(a.clone(), names(&["x"]));
        let wanted = |_| vec!["x".to_string(), "y".to_string()];
        assert_eq!(
            peer_coverage(&held, 5, wanted, |_| true).map(|c| c.0),
            Some(4)
        );
        forget_node(&mut held, &a);
        assert_eq!(peer_coverage(&held, 5, wanted, |_| true), None);
        assert_eq!(held.keys().copied().collect::<Vec<_>>(), [4]);
        assert_eq!(held[&4].keys().collect::<Vec<_>>(), [&b]);
    }

    #[test]
    fn next_start_takes_the_newer_of_snapshots_and_checkpoint() {
        let peers = Some((7, vec!["x:1".to_string()]));
        let (start, tier, _) = next_start(peers.clone(), Some(6), 8);
        assert_eq!(
            (start, tier),
            (
                Start::Peers {
                    step: 7,
                    sources: vec!["x:1".into()]
                },
                Tier::Peer
            )
        );
        let (start, tier, _) = next_start(peers, Some(8), 9);
        assert_eq!(
            (start, tier),
            (Start::Resume(ResumePoint::Latest), Tier::Checkpoint)
        );
        let (start, tier, _) = next_start(None, None, 3);
        assert_eq!((start, tier), (Start::Fresh, Tier::Checkpoint));
        assert_eq!(recorded_tier(Tier::Checkpoint, false, 0), Tier::Peer);
        assert_eq!(recorded_tier(Tier::Checkpoint, false, 2), Tier::Restart);
        assert_eq!(recorded_tier(Tier::Handover, true, 0), Tier::Handover);
    }

    #[test]
    fn a_lost_replica_is_taken_out_only_when_every_failure_is_in_it() {
        // 2 replicas × 2 stages: slots 0, 1 are replica 0; 2, 3 replica 1.
        assert_eq!(lost_replica(&[Some(vec![3])], 2, 2), Ok(1));
        assert_eq!(lost_replica(&[Some(vec![2]), Some(vec![3])], 2, 2), Ok(1));
        assert!(lost_replica(&[Some(vec![1]), Some(vec![2])], 2, 2).is_err());
        assert!(lost_replica(&[Some(vec![0]), None], 2, 2).is_err());
        assert!(lost_replica(&[], 2, 2).is_err());
        assert!(lost_replica(&[Some(vec![0])], 2, 1).is_err());
        assert_eq!(adopter(1, 2), 0);
        assert_eq!(adopter(0, 4), 1);
        assert_eq!(adopter(3, 4), 0);
    }
}
