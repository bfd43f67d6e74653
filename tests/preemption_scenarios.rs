//! Preemption notices that reach the coordinator in an order the cloud does not promise, made
//! deterministic with the in-process harness (`harness`): notices are given at exact points of
//! the workers' execution, and a message the coordinator sends is held on its link (see
//! `harness::links`) until a notice is on its way, so that the coordinator hears it between two
//! of its own decisions. Each run must stop at a step boundary with that boundary's checkpoint
//! committed, and resume from it bit-identical to an undisturbed run.

mod common;
mod harness;

use std::sync::Arc;

use elastic::preemption::Notice;
use harness::links::{Dir, End, Msg};
use harness::{Pos, Rule};
use trainer::runtime::control::ToAgent;
use trainer::runtime::kill_switch::Verdict;
use trainer::runtime::recovery::Tier;

/// The step during which the notices come.
const NOTICED: u64 = 3;

/// The notice every node gets (GCP's: it has no fields a typo could spoil).
const NOTICE: Notice = Notice::Gcp;

/// The scenario's settings: a preemption grace far longer than the scenario itself, so that the
/// noticed nodes are alive (within their grace) however slowly a busy machine runs it.
const SETS: &[&str] = &["elastic.grace_s=600"];

/// Cloud notices reach the nodes seconds apart (CI failure of `tests/preemption.rs` under load,
/// issue 35; fixed by commit 8972037): three of four nodes announce leaving during step 3, so at
/// the step's boundary the coordinator decides to shrink the pipeline onto the fourth. The
/// fourth node's notice reaches it after that decision and before the re-plan: its agent's
/// answer to `StopWorkers` — which the coordinator waits for after stopping the pipeline for the
/// change, before it re-plans — is held until the node's `Leaving` is sent on the same link,
/// ahead of the answer. The re-plan then finds every node leaving: the pipeline restarts on the
/// four nodes it had and the next boundary stops the run with a checkpoint, every node leaving
/// once, with its notice's reason (it used to fail the run: "without them only 0 nodes would
/// remain", exit 1 instead of 75).
#[test]
fn a_notice_that_comes_after_the_boundarys_shrink_stops_the_run_at_the_next_boundary() {
    let out = harness::run(
        "late-notice",
        4,
        SETS,
        vec![Rule::at(0, NOTICED, Pos::Action(0), |c, _| {
            // Armed before the step's boundary: the first `StopWorkers` of the run is the one
            // that stops the pipeline for the boundary's plan change.
            let stop = c.hold(|end, dir, msg| {
                matches!(end, End::Agent { node } if node == "node-3")
                    && dir == Dir::FromCoordinator
                    && matches!(msg, Msg::ToAgent(ToAgent::StopWorkers { .. }))
            });
            // Before any stage reports the step: each of the three nodes' workers says it
            // leaves in its report of the step, so the boundary knows of all three.
            for node in ["node-0", "node-1", "node-2"] {
                c.preempt_now(node, NOTICE);
            }
            let c = Arc::clone(c);
            std::thread::Builder::new()
                .name("late-notice".into())
                .spawn(move || {
                    stop.wait_caught();
                    // The pipeline stopped for the shrink onto node-3: its notice comes now,
                    // and its `Leaving` precedes its `WorkersStopped`, which the coordinator
                    // waits for before it re-plans.
                    c.preempt_now("node-3", NOTICE);
                    stop.release();
                })
                .expect("a thread for the late notice");
            Verdict::Go
        })],
    );
    let next = NOTICED + 1;
    assert_eq!(
        out.result,
        Ok(next),
        "the run did not stop at the next boundary; events: {:#?}",
        out.events
    );
    let preempted = out.preempted.as_deref().unwrap_or_else(|| {
        panic!(
            "the run ended without a preemption stop; events: {:#?}",
            out.events
        )
    });
    for node in ["node-0", "node-1", "node-2", "node-3"] {
        assert!(
            preempted.contains(node),
            "{node} is not among the leavers: {preempted}"
        );
    }
    assert!(out.lost().is_empty(), "{:#?}", out.events);

    // The shrink was undone: the pipeline restarted on its four nodes from the state of the
    // noticed step, and nothing was lost.
    out.assert_recovery(Tier::Handover, 0, (4, 4));
    let plans = out.plans();
    assert_eq!(plans.len(), 1, "{:#?}", out.events);
    let mut nodes: Vec<&str> = plans[0].nodes.iter().map(|n| n.as_str()).collect();
    nodes.sort();
    assert_eq!(nodes, ["node-0", "node-1", "node-2", "node-3"], "{plans:?}");
    assert_eq!(plans[0].resume_from, Some(NOTICED), "{plans:?}");

    // Every node left once, at the boundary where the run stopped, with its notice's reason.
    let left = out.left();
    let mut leavers: Vec<(&str, u64, &str)> = left
        .iter()
        .map(|l| (l.node.as_str(), l.step, l.reason.as_str()))
        .collect();
    leavers.sort();
    let reason = elastic::preemption::leave_reason(Some(&NOTICE));
    assert_eq!(
        leavers,
        ["node-0", "node-1", "node-2", "node-3"].map(|n| (n, next, reason.as_str())),
        "{:#?}",
        out.events
    );
    // The stop's checkpoint, of the boundary's step, is committed and the newest.
    let committed = out.checkpoints();
    assert_eq!(
        committed.last().map(|c| c.step),
        Some(next),
        "{:#?}",
        out.events
    );
    assert!(out.checkpoint_failures().is_empty(), "{:#?}", out.events);
    assert_eq!(harness::final_state(&out.dir).0, next);

    // Resumed from that checkpoint, the run ends as if nothing had happened.
    let resumed = harness::resume("late-notice-resumed", &out, 4, SETS);
    assert_eq!(resumed.preempted, None);
    resumed.assert_bit_identical();
}
