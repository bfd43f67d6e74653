//! The coordinator's own decisions, pure (the plans themselves come from [`elastic::decide`] and
//! the state's source from [`super::super::recovery`]): whether enough nodes joined for the first
//! plan, which incarnation of a node a failure lost, the step a new plan resumes from, and which
//! `node_joined` events a plan change keeps. The coordinator's shells gather the facts and carry
//! the answers out; each is tested here.

use elastic::NodeId;

use super::super::events::{NodeJoined, RunEvent};
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

/// A plan change's events without the `node_joined` of joiners the adopted plan (`nodes`) did
/// not take: they stay spares.
pub(super) fn joined_in_plan(events: &mut Vec<RunEvent>, nodes: &[NodeId]) {
    events.retain(|e| match e {
        RunEvent::NodeJoined(NodeJoined { node, .. }) => nodes.contains(node),
        _ => true,
    });
}

#[cfg(test)]
mod tests {
    use super::super::super::events::NodeLeft;
    use super::super::super::recovery::ResumePoint;
    use super::*;

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
        joined_in_plan(&mut events, std::slice::from_ref(&b));
        assert_eq!(events.len(), 2);
        assert!(matches!(&events[0], RunEvent::NodeLeft(l) if l.node == a));
        assert!(matches!(&events[1], RunEvent::NodeJoined(j) if j.node == b));
    }
}
