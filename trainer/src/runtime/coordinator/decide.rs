//! The coordinator's own decisions, pure (the plans themselves come from [`elastic::decide`] and
//! the state's source from [`super::super::recovery`]): whether enough nodes joined for the first
//! plan, which incarnation of a node a failure lost, the step a new plan resumes from, and which
//! `node_joined` events a plan change keeps. The coordinator's shells gather the facts and carry
//! the answers out; each is tested here.

use elastic::{Decision, NodeId};

use super::super::events::{NodeJoined, NodeLeft, RunEvent};
use super::super::recovery::Start;

/// Where the wait for the first plan's nodes stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gathering {
    /// Enough nodes joined: plan now.
    Ready,
    /// Keep waiting.
    Waiting,
    /// `elastic.join_timeout_s` passed with fewer than `elastic.min_nodes`: the run fails.
    TooFew,
}

/// The first plan waits for `wanted` nodes; once the join timeout passed (`past_deadline`) it
/// plans with the `alive` nodes that joined if they are at least `min_nodes`.
pub(super) fn gathering(
    alive: usize,
    wanted: usize,
    min_nodes: usize,
    past_deadline: bool,
) -> Gathering {
    if alive >= wanted || (past_deadline && alive >= min_nodes) {
        Gathering::Ready
    } else if past_deadline {
        Gathering::TooFew
    } else {
        Gathering::Waiting
    }
}

/// What the membership knows of a lost node: whether its current incarnation is admitted to a
/// plan, and that incarnation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Member {
    pub admitted: bool,
    pub incarnation: u64,
}

/// The incarnation of a node that a failure lost, so that only that one is declared dead: a node
/// that joined again since (declared dead while its agent lived, e.g. after a stall of the whole
/// fleet) stays in as a joiner. A recorded incarnation (`recorded`: fenced, disconnected or
/// replaced during this failure) is the lost one while the current one is not admitted yet — a
/// plan adopted since would have admitted it. A node the membership does not know: 0.
pub(super) fn lost_incarnation(member: Option<Member>, recorded: Option<u64>) -> u64 {
    match member {
        Some(m) if !m.admitted => recorded.unwrap_or(m.incarnation),
        Some(m) => m.incarnation,
        None => 0,
    }
}

/// The step the state of a new plan comes from, for its `plan` event: the peer snapshots' step,
/// the newest committed checkpoint (`latest`) for a resume, nothing for a fresh start.
pub(super) fn resume_from(start: &Start, latest: Option<u64>) -> Option<u64> {
    match start {
        Start::Peers { step, .. } => Some(*step),
        Start::Resume(_) => latest,
        Start::Fresh | Start::InitFrom(_) => None,
    }
}

/// A plan change's events as the adopted plan (`nodes`) made them true: no `node_joined` of
/// joiners it did not take (they stay spares), and no `node_left` of nodes still in it (their
/// notices came too late for this boundary's change, see [`restarts_on_same_nodes`]).
pub(super) fn as_adopted(events: &mut Vec<RunEvent>, nodes: &[NodeId]) {
    events.retain(|e| match e {
        RunEvent::NodeJoined(NodeJoined { node, .. }) => nodes.contains(node),
        RunEvent::NodeLeft(NodeLeft { node, .. }) => !nodes.contains(node),
        _ => true,
    });
}

/// Whether a re-plan restarts the stopped pipeline on the nodes it had instead of adopting the
/// elastic core's `decision`:
/// - `Continue`: the change the pipeline stopped for is no longer wanted (its joiner was lost
///   again);
/// - `Stop`: more preemption notices came after the boundary decided its change (cloud notices
///   reach the nodes seconds apart), and now too few nodes would remain. The boundary's state
///   may exist only in peer snapshots, which a stop cannot commit; the noticed nodes are alive
///   until their grace ends. So the pipeline restarts on them and the run stops at the next
///   boundary with a checkpoint, as it does for notices that come mid-step.
pub(super) fn restarts_on_same_nodes(decision: &Decision) -> bool {
    matches!(decision, Decision::Continue | Decision::Stop { .. })
}

/// Whether an agent's report that the worker of `slot` started by `launch` exited is about the
/// slot's current worker. A stage replaced mid-step on the same node runs again in the same
/// generation: the exit of its lost predecessor, reported after the replacement was asked for,
/// must not count as the replacement's (it would be recovered a second time). A slot no start
/// was recorded for keeps every report.
pub(super) fn exit_is_current(
    launches: &std::collections::BTreeMap<usize, u64>,
    slot: usize,
    launch: u64,
) -> bool {
    launches.get(&slot).is_none_or(|&current| current == launch)
}

#[cfg(test)]
mod tests {
    use super::super::super::recovery::ResumePoint;
    use super::*;

    #[test]
    fn an_exit_counts_only_for_the_slots_current_worker() {
        // Slot 2 was started by launch 1, then replaced mid-step by launch 5.
        let launches = std::collections::BTreeMap::from([(0, 1), (1, 1), (2, 5)]);
        assert!(exit_is_current(&launches, 0, 1));
        assert!(
            exit_is_current(&launches, 2, 5),
            "the replacement's own exit"
        );
        assert!(
            !exit_is_current(&launches, 2, 1),
            "the lost predecessor's late exit"
        );
        assert!(exit_is_current(&launches, 7, 3), "no start recorded: kept");
    }

    #[test]
    fn the_first_plan_waits_for_every_node_then_settles_for_the_minimum() {
        use Gathering::*;
        let cases = [
            // (alive, wanted, min_nodes, past_deadline) → gathering
            ((4, 4, 2, false), Ready),
            ((3, 4, 2, false), Waiting),
            ((3, 4, 2, true), Ready),
            ((2, 4, 2, true), Ready),
            ((1, 4, 2, true), TooFew),
            ((0, 0, 0, false), Ready),
        ];
        for ((alive, wanted, min, past), expected) in cases {
            assert_eq!(
                gathering(alive, wanted, min, past),
                expected,
                "{alive} alive of {wanted}, min {min}, past the deadline: {past}"
            );
        }
    }

    #[test]
    fn a_failure_declares_dead_only_the_incarnation_it_lost() {
        let admitted = Member {
            admitted: true,
            incarnation: 3,
        };
        let rejoined = Member {
            admitted: false,
            incarnation: 4,
        };
        assert_eq!(lost_incarnation(Some(admitted), None), 3);
        // An admitted incarnation is the lost one even if an older one was recorded.
        assert_eq!(lost_incarnation(Some(admitted), Some(2)), 3);
        // Joined again during the failure: the recorded (older) incarnation is the lost one.
        assert_eq!(lost_incarnation(Some(rejoined), Some(3)), 3);
        assert_eq!(lost_incarnation(Some(rejoined), None), 4);
        assert_eq!(lost_incarnation(None, Some(3)), 0);
    }

    #[test]
    fn a_plan_event_names_the_step_its_state_comes_from() {
        let peers = Start::Peers {
            step: 7,
            sources: vec![],
        };
        assert_eq!(resume_from(&peers, Some(4)), Some(7));
        assert_eq!(
            resume_from(&Start::Resume(ResumePoint::Latest), Some(4)),
            Some(4)
        );
        assert_eq!(resume_from(&Start::Resume(ResumePoint::Latest), None), None);
        assert_eq!(resume_from(&Start::Fresh, Some(4)), None);
    }

    #[test]
    fn joiners_the_plan_did_not_take_get_no_joined_event() {
        let (a, b, c) = (NodeId::new("a"), NodeId::new("b"), NodeId::new("c"));
        let mut events = vec![
            RunEvent::NodeLeft(NodeLeft {
                node: a.clone(),
                step: 5,
                reason: "preempted".into(),
            }),
            RunEvent::NodeJoined(NodeJoined {
                node: b.clone(),
                step: 5,
            }),
            RunEvent::NodeJoined(NodeJoined {
                node: c.clone(),
                step: 5,
            }),
        ];
        as_adopted(&mut events, std::slice::from_ref(&b));
        assert_eq!(events.len(), 2);
        assert!(matches!(&events[0], RunEvent::NodeLeft(l) if l.node == a));
        assert!(matches!(&events[1], RunEvent::NodeJoined(j) if j.node == b));
    }

    /// Cloud notices reach the nodes seconds apart: three of four nodes announced by the boundary
    /// (a shrink onto the fourth), the fourth before the re-plan. The pipeline restarts on all
    /// four with no `node_left`, and the next boundary stops the run with every node leaving
    /// (before, the re-plan failed the run: exit 1 instead of a checkpoint and exit 75).
    #[test]
    fn a_notice_after_the_boundarys_shrink_restarts_on_the_same_nodes_then_stops() {
        use elastic::{ClusterState, ElasticConfig, NodeInfo, decide, restart_plan};
        use std::time::Instant;
        let now = Instant::now();
        let cfg = ElasticConfig::default();
        let mut state = ClusterState::new(4);
        let names = ["a", "b", "c", "d"];
        for id in names {
            let info = NodeInfo::new(id, 1, format!("{id}:29500"));
            state.membership.join(info, now).unwrap();
        }
        let (first, _) = decide(now, &state, &cfg);
        state.apply(&first, now);
        for id in ["a", "b", "c"] {
            state.membership.leave(&id.into(), now).unwrap();
        }
        state.step = 6;
        state.at_step_boundary = true;
        let (at_boundary, reason) = decide(now, &state, &cfg);
        assert!(matches!(at_boundary, Decision::Shrink { .. }), "{reason}");
        assert!(!restarts_on_same_nodes(&at_boundary));

        // The re-plan, after d's notice too.
        state.membership.leave(&"d".into(), now).unwrap();
        let (replan, reason) = decide(now, &state, &cfg);
        assert!(matches!(replan, Decision::Stop { .. }), "{reason}");
        assert!(restarts_on_same_nodes(&replan));
        let (restart, _) = restart_plan(&state).unwrap();
        let nodes = restart.plan().unwrap().nodes.clone();
        assert_eq!(nodes, names.map(NodeId::new));
        let mut events: Vec<RunEvent> = ["a", "b", "c"]
            .map(|id| {
                RunEvent::NodeLeft(NodeLeft {
                    node: NodeId::new(id),
                    step: 5,
                    reason: "preemption notice (SIGTERM)".into(),
                })
            })
            .into();
        as_adopted(&mut events, &nodes);
        assert!(events.is_empty(), "{events:?}");
        state.apply(&restart, now);

        // The next boundary: every node leaves, the run stops there with a checkpoint.
        state.step = 7;
        let (next, reason) = decide(now, &state, &cfg);
        assert_eq!(
            next,
            Decision::Stop {
                leaving: names.map(NodeId::new).into()
            },
            "{reason}"
        );
    }
}
