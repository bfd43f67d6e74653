//! Goodput: how much of a job's wall time went into training steps that count, and where the rest
//! went. One accounting, folded over the records of `metrics.jsonl` in file order: the coordinator
//! feeds it each record as it writes it (the live `seqpipe_goodput_*` metrics, see
//! `live_metrics`), and `seqpipe bench goodput` and the tests fold a finished run's file with
//! [`Goodput::of_records`]. Both see the same records with the same timestamps, so both give the
//! same figures.
//!
//! The definitions:
//! - **Wall time** runs from the start of the first step recorded (its `end_unix_s` minus its
//!   `step_time_s`) to the newest timestamp of a record (a step's end, a recovery's end, a loss's
//!   detection, a takeover). Process start and model build come before the clock starts; between
//!   records the figures stand still.
//! - **Productive time** sums the `step_time_s` of the steps that stand: a step computed again
//!   after a recovery replaces its earlier record (the earlier one's time becomes lost time of
//!   that recovery).
//! - **ETTR** (effective training time ratio) = productive time / wall time.
//! - **Lost time by cause**: `recovery` (peer-snapshot, mid-step, reroute and hand-over tiers),
//!   `restart` (checkpoint and restart tiers: the run starts again from stored weights),
//!   `checkpoint_stall` (training waiting for the previous checkpoint's upload) and
//!   `waiting_for_nodes` (a new plan waiting for enough nodes). A between-steps recovery costs its
//!   `recovery_s` less the first step it completed (productive) and less the wait for nodes
//!   (counted under its own cause), plus the steps it had to compute again; a recovery inside a
//!   step (mid-step, reroute) costs what that step took beyond the step before it, which moves
//!   from productive to lost time.

use std::collections::BTreeMap;

use super::events::{
    CheckpointCommitted, CheckpointWait, CoordinatorTakeover, NodeLost, PlanAdopted, Record,
    Recovered, RunEvent,
};
use super::recovery::Tier;
use crate::metrics::StepMetrics;

/// Where lost time went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Cause {
    /// Recovered from peer snapshots, inside a step (mid-step, reroute), or handed over at a
    /// boundary.
    Recovery,
    /// Started again from a checkpoint or the initial weights.
    Restart,
    /// Training waited for the previous checkpoint's upload.
    CheckpointStall,
    /// A new plan waited for enough nodes.
    WaitingForNodes,
}

impl Cause {
    /// Every cause, in the order of the exposition.
    pub const ALL: [Cause; 4] = [
        Cause::Recovery,
        Cause::Restart,
        Cause::CheckpointStall,
        Cause::WaitingForNodes,
    ];

    /// The name used as the `cause` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Recovery => "recovery",
            Cause::Restart => "restart",
            Cause::CheckpointStall => "checkpoint_stall",
            Cause::WaitingForNodes => "waiting_for_nodes",
        }
    }

    /// The cause a recovery of `tier` is counted under.
    pub fn of_tier(tier: Tier) -> Cause {
        match tier {
            Tier::MidStep | Tier::Reroute | Tier::Peer | Tier::Handover => Cause::Recovery,
            Tier::Checkpoint | Tier::Restart => Cause::Restart,
        }
    }
}

/// The running account (see the module docs). Memory is bounded by the steps since the newest
/// committed checkpoint (only those can be computed again).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Goodput {
    /// When the first recorded step started (Unix seconds).
    start_unix_s: Option<f64>,
    /// The newest timestamp of a record (Unix seconds).
    clock_unix_s: f64,
    /// Productive seconds of the steps up to the newest committed checkpoint.
    settled_s: f64,
    /// `(step, seconds)` of the steps after it, in increasing step order.
    recent: Vec<(u64, f64)>,
    /// Lost seconds, by [`Cause`] (indexed as [`Cause::ALL`]).
    lost_s: [f64; 4],
    /// Seconds of steps replaced by a recomputation whose recovery is not recorded yet.
    redone_s: f64,
    /// Seconds a new plan waited for nodes whose recovery is not recorded yet.
    waited_s: f64,
    /// The seconds of the newest step record, and of the one before it.
    last_step_s: Option<f64>,
    prior_step_s: Option<f64>,
    /// A repair inside this step whose step record has not come yet (a mid-step recovery is
    /// recorded before its step).
    repairing: Option<(u64, Cause)>,
}

/// The figures of a [`Goodput`] at its newest record.
#[derive(Clone, Debug, PartialEq)]
pub struct Figures {
    /// Wall seconds from the first step's start to the newest record.
    pub wall_s: f64,
    /// Seconds of the steps that stand.
    pub productive_s: f64,
    /// `productive_s / wall_s` (0 before the first step).
    pub ettr: f64,
    /// Lost seconds by cause.
    pub lost_s: BTreeMap<Cause, f64>,
}

impl Goodput {
    /// The account of a whole `metrics.jsonl` (its parsed records, in file order).
    pub fn of_records(records: &[Record]) -> Goodput {
        let mut g = Goodput::default();
        for record in records {
            match record {
                Record::Step(s) => g.observe_step(s),
                Record::Event(e) => g.observe_event(e),
                Record::Other(_) => {}
            }
        }
        g
    }

    /// A step record.
    pub fn observe_step(&mut self, record: &StepMetrics) {
        let time = finite(record.step_time_s);
        let start = finite(record.end_unix_s) - time;
        self.start_unix_s = Some(self.start_unix_s.map_or(start, |s| s.min(start)));
        self.tick(record.end_unix_s);
        // Steps from this one on are being computed again: their earlier time was lost.
        while let Some(&(step, s)) = self.recent.last() {
            if step < record.step {
                break;
            }
            self.recent.pop();
            self.redone_s += s;
        }
        self.recent.push((record.step, time));
        self.prior_step_s = self.last_step_s.replace(time);
        // The repair applies to the next step record only if it is the repaired step; any other
        // (the run failed again inside that step) leaves nothing to move.
        if let Some((step, cause)) = self.repairing.take()
            && step == record.step
        {
            self.repaired_last_step(cause);
        }
    }

    /// The newest step record carried a repair: what it took beyond the step before it moves
    /// from productive to lost time.
    fn repaired_last_step(&mut self, cause: Cause) {
        let (Some(before), Some(last)) = (self.prior_step_s, self.recent.last_mut()) else {
            return;
        };
        let excess = (last.1 - before).max(0.0);
        last.1 -= excess;
        self.lose(cause, excess);
    }

    /// An event.
    pub fn observe_event(&mut self, event: &RunEvent) {
        match event {
            RunEvent::Recovered(r) => self.recovered(r),
            RunEvent::NodeLost(NodeLost {
                detected_at_unix_s, ..
            }) => self.tick(*detected_at_unix_s),
            RunEvent::CoordinatorTakeover(CoordinatorTakeover { at_unix_s, .. }) => {
                self.tick(*at_unix_s)
            }
            RunEvent::CheckpointWait(CheckpointWait { waited_s, .. }) => {
                self.lose(Cause::CheckpointStall, *waited_s)
            }
            RunEvent::Plan(PlanAdopted {
                waited_for_nodes_s: Some(waited),
                ..
            }) => {
                let waited = finite(*waited).max(0.0);
                self.lose(Cause::WaitingForNodes, waited);
                self.waited_s += waited;
            }
            RunEvent::Checkpoint(CheckpointCommitted { step, .. }) => {
                // Steps up to a committed checkpoint are never computed again.
                let keep = self.recent.partition_point(|&(s, _)| s <= *step);
                self.settled_s += self.recent.drain(..keep).map(|(_, s)| s).sum::<f64>();
            }
            RunEvent::Plan(_)
            | RunEvent::NodeLeft(_)
            | RunEvent::NodeJoined(_)
            | RunEvent::Resumed(_)
            | RunEvent::CheckpointFailed(_) => {}
        }
    }

    fn recovered(&mut self, r: &Recovered) {
        self.tick(r.at_unix_s);
        let cause = Cause::of_tier(r.tier);
        let recorded = self.recent.last().is_some_and(|&(s, _)| s == r.step);
        match r.tier {
            // The step carried the repair: a reroute is recorded after its step, a mid-step
            // recovery before it (then the step record applies it). Several stages replaced in
            // one step cost the step once.
            Tier::MidStep | Tier::Reroute => {
                if recorded {
                    self.repaired_last_step(cause);
                } else {
                    self.repairing = Some((r.step, cause));
                }
            }
            Tier::Peer | Tier::Checkpoint | Tier::Handover | Tier::Restart => {
                let first_step = if recorded {
                    self.recent.last().map_or(0.0, |&(_, s)| s)
                } else {
                    0.0
                };
                let waited = std::mem::take(&mut self.waited_s);
                let redone = std::mem::take(&mut self.redone_s);
                let outage = (finite(r.recovery_s) - first_step - waited).max(0.0);
                self.lose(cause, outage + redone);
            }
        }
    }

    fn lose(&mut self, cause: Cause, seconds: f64) {
        let i = Cause::ALL.iter().position(|c| *c == cause).unwrap_or(0);
        self.lost_s[i] += finite(seconds).max(0.0);
    }

    fn tick(&mut self, at_unix_s: f64) {
        if at_unix_s.is_finite() {
            self.clock_unix_s = self.clock_unix_s.max(at_unix_s);
        }
    }

    /// The figures now.
    pub fn figures(&self) -> Figures {
        let wall_s = self
            .start_unix_s
            .map_or(0.0, |start| (self.clock_unix_s - start).max(0.0));
        let productive_s = self.settled_s + self.recent.iter().map(|(_, s)| s).sum::<f64>();
        Figures {
            wall_s,
            productive_s,
            ettr: if wall_s > 0.0 {
                productive_s / wall_s
            } else {
                0.0
            },
            lost_s: Cause::ALL.iter().copied().zip(self.lost_s).collect(),
        }
    }
}

/// A peer-written number as a finite one (NaN and infinities count as 0).
fn finite(x: f64) -> f64 {
    if x.is_finite() { x } else { 0.0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::events::parse_records;

    fn step(n: u64, end: f64, time: f64) -> String {
        format!(
            r#"{{"step":{n},"end_unix_s":{end},"loss":1.0,"lr":0.1,"grad_norm":1.0,"tokens":8,"step_time_s":{time},"tokens_per_s":1.0}}"#
        )
    }

    fn account(lines: &[String]) -> Figures {
        Goodput::of_records(&parse_records(&lines.join("\n"))).figures()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn an_undisturbed_run_counts_its_steps_over_the_time_since_the_first_started() {
        // Steps of 1 s ending at 101, 102.5, 104: 3 s of 4 s (half a second between steps).
        let f = account(&[
            step(1, 101.0, 1.0),
            step(2, 102.5, 1.0),
            step(3, 104.0, 1.0),
        ]);
        assert!(close(f.wall_s, 4.0) && close(f.productive_s, 3.0), "{f:?}");
        assert!(close(f.ettr, 0.75));
        assert!(f.lost_s.values().all(|&s| s == 0.0));
        assert_eq!(account(&[]).ettr, 0.0, "no step, no ratio");
    }

    #[test]
    fn a_peer_recovery_loses_its_outage_and_the_steps_it_computed_again() {
        let lines = [
            step(1, 101.0, 1.0),
            step(2, 102.0, 1.0),
            step(3, 103.0, 1.0),
            r#"{"event":"node_lost","node":"n2","failed_step":4,"reason":"x","detected_at_unix_s":103.5,"agent_alive":false}"#.into(),
            r#"{"event":"plan","generation":2,"stages":2,"nodes":["a","b"],"resume_from":2,"tier":"peer","waited_for_nodes_s":1.5}"#.into(),
            // Step 3 again (its first record's second is lost), then a recovery of 4 s ending with
            // it: 4 - 1 (the step) - 1.5 (waiting) = 1.5 s outage, + 1 s redone.
            step(3, 107.5, 1.0),
            r#"{"event":"recovered","step":3,"recovery_s":4.0,"lost_steps":1,"tier":"peer","stages_before":2,"stages_after":2,"at_unix_s":107.6}"#.into(),
            r#"{"event":"checkpoint_wait","step":4,"waited_s":0.25}"#.into(),
            step(4, 108.6, 1.0),
        ];
        let f = account(&lines);
        assert!(close(f.wall_s, 8.6), "{f:?}");
        assert!(close(f.productive_s, 4.0), "{f:?}");
        assert!(close(f.ettr, 4.0 / 8.6));
        assert!(close(f.lost_s[&Cause::Recovery], 2.5), "{f:?}");
        assert!(close(f.lost_s[&Cause::WaitingForNodes], 1.5));
        assert!(close(f.lost_s[&Cause::CheckpointStall], 0.25));
        assert_eq!(f.lost_s[&Cause::Restart], 0.0);
    }

    #[test]
    fn a_repair_inside_a_step_loses_what_the_step_took_beyond_the_one_before() {
        // Mid-step recoveries are recorded before their step (here two stages of step 2), a
        // reroute after its step (step 4); a checkpoint in between does not hide step 3's time.
        let mid = |stage: u32| {
            format!(
                r#"{{"event":"recovered","step":2,"recovery_s":2.4,"lost_steps":0,"tier":"mid_step","stages_before":2,"stages_after":2,"at_unix_s":103.4,"stage":{stage}}}"#
            )
        };
        let lines = [
            step(1, 101.0, 1.0),
            mid(0),
            mid(1),
            step(2, 103.5, 2.5),
            step(3, 104.5, 1.0),
            r#"{"event":"checkpoint","step":3,"bytes":1,"upload_s":0.1,"snapshot_s":0.0}"#.into(),
            step(4, 106.25, 1.75),
            r#"{"event":"recovered","step":4,"recovery_s":1.7,"lost_steps":0,"tier":"reroute","stages_before":2,"stages_after":2,"at_unix_s":106.3}"#.into(),
        ];
        let f = account(&lines);
        assert!(close(f.productive_s, 4.0) && close(f.wall_s, 6.3), "{f:?}");
        assert!(close(f.lost_s[&Cause::Recovery], 1.5 + 0.75), "{f:?}");
        // A mid-step recovery whose step never completed moves nothing.
        let lines = [step(1, 101.0, 1.0), mid(0), step(1, 110.0, 1.0)];
        let f = account(&lines);
        assert!(close(f.productive_s, 1.0), "{f:?}");
        assert_eq!(f.lost_s[&Cause::Recovery], 0.0);
    }

    #[test]
    fn a_restart_from_a_checkpoint_keeps_the_committed_steps() {
        let lines = [
            step(1, 101.0, 1.0),
            step(2, 102.0, 1.0),
            r#"{"event":"checkpoint","step":2,"bytes":1,"upload_s":0.1,"snapshot_s":0.0}"#.into(),
            step(3, 103.0, 1.0),
            step(4, 104.0, 1.0),
            // Both nodes lost: back to checkpoint 2, steps 3 and 4 again.
            step(3, 110.0, 1.0),
            r#"{"event":"recovered","step":3,"recovery_s":6.0,"lost_steps":2,"tier":"checkpoint","stages_before":2,"stages_after":2,"at_unix_s":110.0}"#.into(),
            step(4, 111.0, 1.0),
        ];
        let f = account(&lines);
        assert!(close(f.productive_s, 4.0) && close(f.wall_s, 11.0), "{f:?}");
        // 6 - 1 (step 3 again) outage, + steps 3 and 4 computed twice.
        assert!(close(f.lost_s[&Cause::Restart], 7.0), "{f:?}");
        assert_eq!(f.lost_s[&Cause::Recovery], 0.0);
    }

    #[test]
    fn feeding_records_one_by_one_equals_folding_the_file() {
        let lines = [
            step(1, 101.0, 1.0),
            step(2, 102.0, 1.0),
            step(2, 105.0, 1.0),
            r#"{"event":"recovered","step":2,"recovery_s":3.5,"lost_steps":1,"tier":"restart","stages_before":2,"stages_after":1,"at_unix_s":105.1}"#.into(),
            "not json".into(),
            r#"{"event":"solar_flare"}"#.into(),
            r#"{"step":3,"end_unix_s":"NaN","loss":1.0,"lr":0.1,"grad_norm":1.0,"tokens":8,"step_time_s":1e308,"tokens_per_s":1.0}"#.into(),
        ];
        let records = parse_records(&lines.join("\n"));
        let mut live = Goodput::default();
        for r in &records {
            match r {
                Record::Step(s) => live.observe_step(s),
                Record::Event(e) => live.observe_event(e),
                Record::Other(_) => {}
            }
        }
        assert_eq!(live, Goodput::of_records(&records));
        assert!(live.figures().ettr.is_finite());
    }
}
