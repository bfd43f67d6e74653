//! Which tier restores lost state: peer snapshots when they survive, else the checkpoint.

use std::collections::BTreeMap;

use elastic::{NodeId, NodeInfo, Tier, buddies, plan_for, recovery_tier};

fn ids(s: &str) -> Vec<NodeId> {
    s.split_whitespace().map(NodeId::from).collect()
}

/// The buddy ring of a plan with one single-slot node per name.
fn ring(s: &str) -> BTreeMap<NodeId, NodeId> {
    let infos: Vec<NodeInfo> = ids(s)
        .into_iter()
        .map(|n| NodeInfo::new(n, 1, ""))
        .collect();
    buddies(&plan_for(&infos, 64, 1, 0).unwrap())
}

#[test]
fn tier_table() {
    use Tier::{Checkpoint, PeerSnapshot};
    // (plan nodes, lost, alive, snapshot step, interrupted step, tier, reason fragment)
    let cases = [
        (
            "a b c",
            "b",
            "a c",
            Some(9),
            10,
            PeerSnapshot,
            "node b's on node c",
        ),
        (
            "a b c d",
            "b d",
            "a c",
            Some(9),
            10,
            PeerSnapshot,
            "node b's on node c, node d's on node a",
        ),
        (
            "a b c d",
            "b c",
            "a d",
            Some(9),
            10,
            Checkpoint,
            "node b and node c, which held its snapshot, were both lost",
        ),
        ("a b", "a b", "", Some(9), 10, Checkpoint, "were both lost"),
        ("a", "a", "", Some(9), 10, Checkpoint, "node a had no buddy"),
        (
            "a b c",
            "b",
            "a",
            Some(9),
            10,
            Checkpoint,
            "node c, which held node b's snapshot, is not alive",
        ),
        (
            "a b c",
            "b",
            "a c",
            None,
            10,
            Checkpoint,
            "no peer snapshot was taken yet",
        ),
        (
            "a b c",
            "b",
            "a c",
            Some(8),
            10,
            Checkpoint,
            "snapshots are of step 8, but redoing step 10 needs step 9's",
        ),
        ("a b c", "b", "a c", Some(10), 10, Checkpoint, "of step 10"),
        (
            "a b c",
            "b",
            "a c",
            Some(0),
            0,
            Checkpoint,
            "step 0 was interrupted",
        ),
        (
            "a b c",
            "",
            "a b c",
            Some(4),
            5,
            PeerSnapshot,
            "no node lost",
        ),
    ];
    for (plan, lost, alive, snap, interrupted, tier, fragment) in cases {
        let (got, reason) = recovery_tier(&ids(lost), &ring(plan), &ids(alive), snap, interrupted);
        assert_eq!(got, tier, "plan {plan}, lost {lost}: {reason}");
        assert!(reason.contains(fragment), "{reason}");
    }
}

#[test]
fn tier_reasons_are_exact() {
    let (tier, reason) = recovery_tier(&ids("b"), &ring("a b c"), &ids("a c"), Some(41), 42);
    assert_eq!(tier, Tier::PeerSnapshot);
    assert_eq!(
        reason,
        "the snapshots of step 41 survive (node b's on node c); redo step 42 from them"
    );
    let (tier, reason) = recovery_tier(&ids("a"), &ring("a"), &[], Some(41), 42);
    assert_eq!(tier, Tier::Checkpoint);
    assert_eq!(
        reason,
        "node a had no buddy (no other node), so its state was only on itself; restore the last \
         checkpoint"
    );
}
