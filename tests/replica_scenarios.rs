//! Data-parallel recovery scenarios, in process (see `harness`): a 2 × 2 job — two replicas of a
//! 2-stage pipeline on 4 nodes, worker slot w = replica · 2 + stage — loses a worker of replica 1
//! at an exact point of step 3: in the middle of its forward and backward, or just before its
//! gradient reduction (so that the other replica's reduction of that stage fails, or has already
//! completed and must be done again). Every time the step completes with replica 1's
//! micro-batches re-routed to replica 0 (`recovered` tier `reroute`, nothing lost), the pipeline
//! is rebuilt at the boundary from the step's committed state (a second `recovered` event, nothing
//! lost either), the `node_lost` event names step 3, and the run ends bit-identical to the
//! undisturbed one-replica, 4-stage job: the sum over micro-batches is the same tree whoever
//! computed which share.

mod common;
mod harness;

use std::sync::{Arc, Mutex};

use harness::{Outcome, Pos, Rule, run};
use trainer::runtime::kill_switch::Verdict;
use trainer::runtime::recovery::Tier;

/// The scenarios' layout on top of the harness's job (4 micro-batches: 2 per replica).
const TWO_BY_TWO: [&str; 2] = ["pipeline.replicas=2", "pipeline.stages=2"];

/// Kills worker `slot` at `pos` of step 3 (once the agents hold both copies of the state after
/// step 2) and checks the re-route described above.
fn rerouted(name: &str, slot: usize, pos: Pos) -> Outcome {
    let killed: Arc<Mutex<Option<String>>> = Arc::default();
    let record = Arc::clone(&killed);
    let rule = Rule::at(slot, 3, pos, move |c, id| {
        c.wait_held(2, 2);
        *record.lock().unwrap() = Some(id.node.clone());
        c.kill_worker(&id.node, id.stage);
        Verdict::Kill
    });
    let out = run(name, 4, &TWO_BY_TWO, vec![rule]);
    let killed = killed.lock().unwrap().clone().expect("the rule fired");
    let r = out.recoveries();
    assert_eq!(r.len(), 2, "{:#?}", out.events);
    assert_eq!(
        (r[0].tier, r[0].step, r[0].lost_steps),
        (Tier::Reroute, 3, 0),
        "{:#?}",
        out.events
    );
    assert!(
        r[0].redone_units.is_some_and(|u| u > 0),
        "the adopted share's units: {:?}",
        r[0]
    );
    assert_eq!((r[1].step, r[1].lost_steps), (4, 0), "{:#?}", out.events);
    let lost = out.lost();
    assert_eq!(lost.len(), 1, "{:#?}", out.events);
    assert_eq!(lost[0].node.as_str(), killed, "{:?}", lost[0]);
    assert_eq!(lost[0].failed_step, 3, "{:?}", lost[0]);
    out.assert_bit_identical();
    out
}

/// Replica 1's first stage killed in the middle of its share of step 3's units.
#[test]
fn a_replica_lost_in_its_forward_and_backward_is_rerouted() {
    rerouted("dp-in-backward", 2, Pos::Action(12));
}

/// Replica 1's last stage killed just before its reduction: replica 0's last stage fails its
/// reduction (a link to a member that never sends), while replica 1's first stage, which had all
/// its gradients, may complete its reduction with replica 0's — which then reduces again.
#[test]
fn a_replica_lost_at_the_last_stages_reduction_is_rerouted() {
    rerouted("dp-at-reduce-last", 3, Pos::Reduce(0));
}

/// Replica 1's first stage killed just before its reduction: the last stages' reduction has
/// most likely completed with replica 1's share; every survivor reduces again without it.
#[test]
fn a_replica_lost_at_the_first_stages_reduction_is_rerouted() {
    rerouted("dp-at-reduce-first", 2, Pos::Reduce(0));
}

/// Replica 0 — the one that writes the checkpoints — loses its first stage in the middle of the
/// run's last step: replica 1 computes its share, the last step's checkpoint is written and
/// committed by the survivors, and then the lost node is re-planned at the boundary. The rebuilt
/// pipeline restores the last step and finds its checkpoint already committed: the run ends
/// normally (it used to fail with "the final checkpoint of step 6 was not committed: it was
/// abandoned", the new checkpoint writer never having seen that commit).
#[test]
fn the_writing_replica_lost_in_the_last_step_ends_the_run_normally() {
    let rule = Rule::at(0, harness::STEPS, Pos::Action(12), move |c, id| {
        c.wait_held(harness::STEPS - 1, 2);
        c.kill_worker(&id.node, id.stage);
        Verdict::Kill
    });
    let out = run("dp-last-step-writer", 4, &TWO_BY_TWO, vec![rule]);
    assert_eq!(out.result, Ok(harness::STEPS), "{:#?}", out.events);
    out.assert_first_recovery(Tier::Reroute, harness::STEPS, 0);
    assert!(
        out.checkpoints().iter().any(|e| e.step == harness::STEPS),
        "{:#?}",
        out.events
    );
    out.assert_bit_identical();
}
