//! Where a rebuilt pipeline's state comes from: the newer of the surviving peer snapshots and the
//! newest committed checkpoint (snapshots on a tie), else the initial weights.

use elastic::{Tier, recovery_tier};

#[test]
fn tier_table() {
    // (peer snapshot step, checkpoint step, interrupted step, tier, reason fragment)
    let cases = [
        (
            Some(9),
            None,
            10,
            Tier::PeerSnapshot { step: 9 },
            "snapshots of step 9 on live nodes hold the whole model; redo step 10",
        ),
        (
            Some(9),
            Some(8),
            10,
            Tier::PeerSnapshot { step: 9 },
            "(newest checkpoint: step 8)",
        ),
        (
            Some(8),
            Some(8),
            10,
            Tier::PeerSnapshot { step: 8 },
            "redo 1 completed step(s) and step 10",
        ),
        (
            Some(7),
            Some(8),
            10,
            Tier::Checkpoint { step: 8 },
            "the peer snapshots (step 7) are older than checkpoint 8",
        ),
        (
            None,
            Some(4),
            10,
            Tier::Checkpoint { step: 4 },
            "no peer snapshot on live nodes holds the whole model; redo 5 completed step(s)",
        ),
        (
            None,
            None,
            1,
            Tier::Restart,
            "redo step 1 from the initial weights",
        ),
        (
            None,
            None,
            3,
            Tier::Restart,
            "redo 2 completed step(s) and step 3 from the initial weights",
        ),
    ];
    for (peer, checkpoint, interrupted, tier, fragment) in cases {
        let (got, reason) = recovery_tier(peer, checkpoint, interrupted);
        assert_eq!(
            got, tier,
            "peer {peer:?}, checkpoint {checkpoint:?}: {reason}"
        );
        assert!(reason.contains(fragment), "{reason}");
        let from = match got {
            Tier::PeerSnapshot { step } | Tier::Checkpoint { step } => step,
            Tier::Restart => 0,
        };
        assert_eq!(from, peer.into_iter().chain(checkpoint).max().unwrap_or(0));
    }
}

#[test]
fn tier_reasons_are_exact() {
    let (tier, reason) = recovery_tier(Some(41), Some(40), 42);
    assert_eq!(tier, Tier::PeerSnapshot { step: 41 });
    assert_eq!(
        reason,
        "the peer snapshots of step 41 on live nodes hold the whole model (newest checkpoint: step 40); redo step 42 from them"
    );
    let (tier, reason) = recovery_tier(None, None, 1);
    assert_eq!(tier, Tier::Restart);
    assert_eq!(
        reason,
        "neither a peer snapshot nor a committed checkpoint holds the model; redo step 1 from the initial weights"
    );
}
