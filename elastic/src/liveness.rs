//! The failure detector, including its check of itself: silence is evidence of a node's death
//! only while the detector was running to hear it. If the coordinator itself was stalled (a VM
//! freeze, a noisy neighbour, a GC pause, SIGSTOP), every node looks silent for as long as the
//! stall lasted — and their heartbeats wait in the sockets, unread. Declaring the whole fleet dead
//! on that evidence ends a job that is healthy. So each check measures the gap since the previous
//! check (with the caller's monotonic clock) and excuses from every node's silence the part of the
//! gap beyond the normal check interval; only then are silent nodes expired.
//!
//! Pure, in the manner of torchft's `quorum_compute(now, …)`: the clock is passed in.

use std::time::{Duration, Instant};

use crate::membership::Membership;
use crate::node::NodeId;

/// How long the detector was away beyond `tolerance` between its previous check (`last_check`)
/// and `now`: the gap minus `tolerance`, or zero for a gap within it (or for the first check).
///
/// `tolerance` is the longest gap a running detector may leave between checks (the coordinator
/// uses the heartbeat interval): a detector that is merely slow still sees silence grow by at
/// least `tolerance` per check, so a dead node is still declared dead, only later.
pub fn own_stall(last_check: Option<Instant>, now: Instant, tolerance: Duration) -> Duration {
    last_check.map_or(Duration::ZERO, |last| {
        now.saturating_duration_since(last)
            .saturating_sub(tolerance)
    })
}

/// What one check of the [`FailureDetector`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checked {
    /// How long the detector itself was stalled before this check (excused from every node's
    /// silence); zero when it was running.
    pub stalled: Duration,
    /// The nodes declared dead by this check, sorted by id.
    pub dead: Vec<NodeId>,
}

/// A failure detector that knows when it was not running: [`FailureDetector::check`] excuses its
/// own stalls ([`own_stall`]) before it expires silent nodes ([`Membership::expire`]).
#[derive(Clone, Debug)]
pub struct FailureDetector {
    last_check: Option<Instant>,
    tolerance: Duration,
    dead_after: Duration,
}

impl FailureDetector {
    /// A detector that declares dead a node silent for more than `dead_after` of its own running
    /// time, checking at least every `tolerance` while it runs.
    pub fn new(tolerance: Duration, dead_after: Duration) -> Self {
        Self {
            last_check: None,
            tolerance,
            dead_after,
        }
    }

    /// One check at `now`: excuses the stall since the previous check, then declares dead the
    /// live nodes still silent for more than `dead_after`.
    pub fn check(&mut self, now: Instant, membership: &mut Membership) -> Checked {
        let stalled = own_stall(self.last_check, now, self.tolerance);
        self.last_check = Some(self.last_check.map_or(now, |last| last.max(now)));
        membership.excuse(stalled, now);
        Checked {
            stalled,
            dead: membership.expire(now, self.dead_after),
        }
    }
}
