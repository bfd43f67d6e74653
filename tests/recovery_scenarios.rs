//! Recovery scenarios, in process: the real coordinator, node agents and stage workers run as
//! threads over loopback TCP (see `harness`), and each scenario injects its faults at
//! exact points of a step (an action, a control message, the report of a step). Every scenario
//! asserts the recovery the coordinator chose — the `recovered` events' tier, the completed steps
//! lost, the units redone, the stages before and after, the `node_lost` events — and that the run
//! ends bit-identical to an undisturbed one (or, for the failures that must stop a run, that it
//! stops with the right error and no recovery).
//!
//! The job: a 4-layer model on 4 nodes (one stage each), 6 steps, checkpoints every 2 steps.
//! Under the default Seq1F1B schedule a middle stage's step has 48 actions (16 units, each with
//! its receive and send), an end stage's 32. Buddies: node r's peer snapshot is held by node r
//! and node r+1 (mod 4).

mod common;
mod harness;

use std::sync::Arc;
use std::sync::mpsc::channel;

use elastic::NodeId;
use harness::{Cluster, Outcome, Pos, Rule, STEPS, UNITS_PER_STAGE, WorkerId, fresh_dir, run};
use trainer::runtime::kill_switch::Verdict;
use trainer::runtime::recovery::Tier;

fn node(r: usize) -> String {
    format!("node-{r}")
}

/// An optional node's name.
fn node_name(n: &Option<NodeId>) -> Option<&str> {
    n.as_ref().map(NodeId::as_str)
}

/// Kills the worker that reached the point (its agent reports `signal: 9`), once the agents
/// hold both copies of the state after `step − 1`.
fn kill_it(step: u64) -> impl FnOnce(&Arc<Cluster>, &WorkerId) -> Verdict + Send + 'static {
    move |c, id| {
        c.wait_held(step - 1, 2);
        c.kill_worker(&id.node, id.stage);
        Verdict::Kill
    }
}

/// Kills the whole node of the worker that reached the point, once the agents hold both copies of
/// the state after `step − 1`.
fn kill_its_node(step: u64) -> impl FnOnce(&Arc<Cluster>, &WorkerId) -> Verdict + Send + 'static {
    move |c, id| {
        c.wait_held(step - 1, 2);
        c.kill_node(&id.node);
        Verdict::Kill
    }
}

/// A mid-step worker kill of `stage` at `pos` of step 3: replaced on its own node, nothing else
/// recomputed; returns the `recovered` event's `redone_units`.
fn mid_step_kill(name: &str, stage: usize, pos: Pos) -> (Outcome, u64) {
    let out = run(name, 4, &[], vec![Rule::at(stage, 3, pos, kill_it(3))]);
    let r = out.assert_recovery(Tier::MidStep, 0, (4, 4));
    assert_eq!(
        (r.stage, node_name(&r.node), node_name(&r.host)),
        (
            Some(stage),
            Some(node(stage).as_str()),
            Some(node(stage).as_str())
        ),
        "{r:?}"
    );
    let lost = out.lost();
    assert_eq!(lost.len(), 1, "{:#?}", out.events);
    assert_eq!(lost[0].node.as_str(), node(stage));
    assert_eq!(lost[0].mid_step, Some(true));
    assert!(lost[0].agent_alive, "{:?}", lost[0]);
    // No survivor recomputed anything: the stages computed one step's units in all.
    assert_eq!(out.step_record(3).units as u64, 4 * UNITS_PER_STAGE);
    let redone = r.redone_units.unwrap() as u64;
    eprintln!("{name}: redone {redone}");
    out.assert_bit_identical();
    (out, redone)
}

/// The undisturbed run finishes every step without any recovery (it is also the reference).
#[test]
fn undisturbed_run_recovers_nothing() {
    let out = run("undisturbed", 4, &[], Vec::new());
    assert!(out.recoveries().is_empty(), "{:#?}", out.events);
    assert!(out.lost_nodes().is_empty());
    out.assert_bit_identical();
}

/// Stage 0 (the first) killed in the middle of step 3: its forwards whose activations stage 1
/// already has are redone, nothing else.
#[test]
fn mid_step_kill_of_stage_0() {
    let (_, redone) = mid_step_kill("mid-step-0", 0, Pos::Action(12));
    assert_eq!(redone, 5);
}

/// A middle stage killed in the middle of step 3.
#[test]
fn mid_step_kill_of_stage_1() {
    let (_, redone) = mid_step_kill("mid-step-1", 1, Pos::Action(20));
    assert_eq!(redone, 6);
}

/// The other middle stage killed in the middle of step 3.
#[test]
fn mid_step_kill_of_stage_2() {
    let (_, redone) = mid_step_kill("mid-step-2", 2, Pos::Action(20));
    assert_eq!(redone, 6);
}

/// The last stage (the loss) killed in the middle of step 3, before its backward of unit 1.1:
/// it had sent the gradients of units 0.1 and 0.0, so those two backwards and their forwards are
/// redone.
#[test]
fn mid_step_kill_of_stage_3() {
    let (_, redone) = mid_step_kill("mid-step-3", 3, Pos::Action(12));
    assert_eq!(redone, 4);
}

/// Killed before its first action of step 3: the replacement redoes nothing.
#[test]
fn mid_step_kill_before_the_first_unit() {
    let (_, redone) = mid_step_kill("mid-step-first", 2, Pos::Action(0));
    assert_eq!(redone, 0);
}

/// Killed before its last action (the last gradient it sends back): every unit but that one's
/// backward was already handed on, and is redone.
#[test]
fn mid_step_kill_before_the_last_backward_send() {
    let (_, redone) = mid_step_kill("mid-step-last", 1, Pos::LastAction);
    assert_eq!(redone, UNITS_PER_STAGE - 1);
}

/// Killed right after reporting its part of step 3 done, while other stages still compute: the
/// stage has nothing to replay, so the step is redone from the peer snapshots of step 2 (the
/// agent reaps the worker late, so the coordinator sees the report before the death).
#[test]
fn kill_after_the_stage_finished_its_part_of_the_step() {
    let (reached_tx, reached) = channel::<()>();
    let (killed_tx, killed) = channel::<()>();
    let out = run(
        "after-finish",
        4,
        &[],
        vec![
            // Stage 3 finishes first; it dies once stage 0 is about to finish the step.
            Rule::at(3, 3, Pos::StepDone, move |c, id| {
                c.wait_held(2, 2);
                reached.recv().unwrap();
                c.kill_worker_reaped_late(&id.node, id.stage);
                killed_tx.send(()).unwrap();
                Verdict::Kill
            }),
            Rule::at(0, 3, Pos::LastAction, move |_, _| {
                reached_tx.send(()).unwrap();
                killed.recv().unwrap();
                Verdict::Go
            }),
        ],
    );
    out.assert_recovery(Tier::Peer, 0, (4, 4));
    out.assert_no_mid_step_attempt();
    assert_eq!(out.lost_nodes(), [node(3)]);
    assert!(out.lost()[0].mid_step.is_none());
    out.assert_bit_identical();
}

/// A whole node (agent and worker) killed mid-step: its stage is replaced on a neighbour's node
/// for the rest of the step, and the pipeline shrinks at the step's boundary (a handover).
#[test]
fn node_kill_mid_step_then_shrink_at_the_boundary() {
    let out = run(
        "node-kill",
        4,
        &[],
        vec![Rule::at(2, 3, Pos::Action(20), kill_its_node(3))],
    );
    let r = out.recoveries();
    assert_eq!(r.len(), 2, "{:#?}", out.events);
    assert_eq!(
        (r[0].tier, node_name(&r[0].host), r[0].stages_after),
        (Tier::MidStep, Some("node-1"), 4),
        "{:#?}",
        out.events
    );
    assert_eq!(
        (
            r[1].tier,
            r[1].lost_steps,
            r[1].stages_before,
            r[1].stages_after
        ),
        (Tier::Handover, 0, 4, 3),
        "{:#?}",
        out.events
    );
    let lost = out.lost();
    assert_eq!(lost.len(), 1);
    assert_eq!(
        (lost[0].node.as_str(), lost[0].agent_alive),
        ("node-2", false)
    );
    assert_eq!(out.step_record(3).units as u64, 4 * UNITS_PER_STAGE);
    out.assert_bit_identical();
}

/// Two workers killed in one step: mid-step recovery needs exactly one lost stage, so the step is
/// redone from the peer snapshots; both nodes' agents live, so the pipeline keeps 4 stages.
#[test]
fn two_workers_killed_in_one_step_use_peer_snapshots() {
    let out = run(
        "two-workers",
        4,
        &[],
        vec![Rule::at(1, 3, Pos::Action(20), |c, id| {
            c.wait_held(2, 2);
            c.kill_worker(&node(2), 2);
            c.kill_worker(&id.node, id.stage);
            Verdict::Kill
        })],
    );
    out.assert_recovery(Tier::Peer, 0, (4, 4));
    out.assert_no_mid_step_attempt();
    let mut lost = out.lost_nodes();
    lost.sort();
    assert_eq!(lost, [node(1), node(2)]);
    out.assert_bit_identical();
}

/// A node and its snapshot buddy killed in step 5: nobody alive holds node 1's state, so the run
/// resumes from the newest committed checkpoint (step 2; step 4's was still uploading) on the two
/// nodes left, redoing steps 3 and 4.
#[test]
fn node_and_its_buddy_killed_fall_back_to_the_checkpoint() {
    let out = run(
        "buddies",
        4,
        &[],
        vec![Rule::at(1, 5, Pos::Action(20), |c, id| {
            c.kill_node(&node(2));
            c.kill_node(&id.node);
            Verdict::Kill
        })],
    );
    out.assert_recovery(Tier::Checkpoint, 2, (4, 2));
    out.assert_no_mid_step_attempt();
    let mut lost = out.lost_nodes();
    lost.sort();
    assert_eq!(lost, [node(1), node(2)]);
    let plan = out.plans();
    assert_eq!(plan[0].resume_from, Some(2), "{plan:?}");
    out.assert_bit_identical();
}

/// A worker killed while the optimizer update of step 3 is applied: the other stages have
/// updated, so the whole pipeline goes back to the peer snapshots of step 2 and redoes step 3.
#[test]
fn kill_in_the_optimizer_update() {
    let out = run(
        "update",
        4,
        &[],
        vec![Rule::at(2, 3, Pos::Message("apply"), kill_it(3))],
    );
    out.assert_recovery(Tier::Peer, 0, (4, 4));
    out.assert_no_mid_step_attempt();
    assert_eq!(out.lost_nodes(), [node(2)]);
    let plan = out.plans();
    assert_eq!(plan[0].resume_from, Some(2), "{plan:?}");
    out.assert_bit_identical();
}

/// A worker that never uploaded its shard of checkpoint 4 (stuck on the request) dies in step 5:
/// its mid-step replacement, restored from the peer snapshots of step 4, uploads the missing shard
/// and checkpoint 4 is committed after all.
#[test]
fn kill_during_a_checkpoint_upload() {
    let out = run(
        "ckpt-upload",
        4,
        &[],
        vec![
            Rule::at(1, 4, Pos::Message("checkpoint"), |_, _| Verdict::Hang),
            // Once step 5 was sent to every stage (stage 3 is sent it last).
            Rule::at(3, 5, Pos::Action(0), |c, _| {
                c.wait_held(4, 2);
                c.kill_worker(&node(1), 1);
                Verdict::Go
            }),
        ],
    );
    let r = out.assert_recovery(Tier::MidStep, 0, (4, 4));
    assert_eq!((r.stage, r.step), (Some(1), 5));
    assert_eq!(r.redone_units, Some(0));
    assert!(
        out.checkpoints().iter().any(|e| e.step == 4),
        "{:#?}",
        out.events
    );
    assert!(out.checkpoint_failures().is_empty());
    out.assert_bit_identical();
}

/// A worker killed while the last step's checkpoint is being taken: every step is done, only that
/// checkpoint is left. The rebuilt pipeline restores the peer snapshots of the last step and
/// commits its checkpoint; the run ends normally (it used to fail with "nothing to train").
#[test]
fn kill_while_the_last_checkpoint_is_written() {
    let out = run(
        "last-ckpt",
        4,
        &[],
        vec![Rule::at(
            1,
            STEPS,
            Pos::Message("checkpoint"),
            kill_it(STEPS + 1),
        )],
    );
    assert_eq!(out.result, Ok(STEPS), "{:#?}", out.events);
    let r = out.assert_recovery(Tier::Peer, 0, (4, 4));
    assert_eq!(r.step, STEPS);
    assert_eq!(out.plans()[0].resume_from, Some(STEPS));
    assert!(
        out.checkpoints().iter().any(|e| e.step == STEPS),
        "{:#?}",
        out.events
    );
    out.assert_bit_identical();
}

/// A worker killed during the evaluation after the last step: every worker has applied step 6's
/// update and the agents hold its peer snapshots, but the run has not recorded step 6 (its loss
/// is summed after the evaluation). Those snapshots must not count: the run redoes step 6 from
/// step 5's and ends normally (it used to restore step 6 and fail with "no record of that step").
#[test]
fn kill_in_the_evaluation_after_the_last_step() {
    let out = run(
        "last-eval",
        4,
        &["train.eval_every=100", "train.eval_batches=1"],
        vec![Rule::at(1, STEPS, Pos::Message("eval"), kill_it(STEPS + 1))],
    );
    assert_eq!(out.result, Ok(STEPS), "{:#?}", out.events);
    let r = out.assert_recovery(Tier::Peer, 0, (4, 4));
    assert_eq!(r.step, STEPS);
    assert_eq!(out.plans()[0].resume_from, Some(STEPS - 1));
    let recorded: Vec<u64> = out
        .records
        .iter()
        .filter_map(|r| r.as_step())
        .map(|r| r.step)
        .collect();
    assert_eq!(recorded, (1..=STEPS).collect::<Vec<_>>());
    out.assert_bit_identical();
}

/// Without peer snapshots a lost stage has no step-start state for a mid-step replacement: the
/// run resumes from the newest committed checkpoint (step 2), redoing steps 3 and 4.
#[test]
fn without_peer_snapshots_the_checkpoint_tier() {
    let out = run(
        "no-peers",
        4,
        &["elastic.peer_snapshots=false"],
        vec![Rule::at(2, 5, Pos::Action(20), |c, id| {
            c.kill_worker(&id.node, id.stage);
            Verdict::Kill
        })],
    );
    out.assert_recovery(Tier::Checkpoint, 2, (4, 4));
    out.assert_no_mid_step_attempt();
    assert_eq!(out.lost_nodes(), [node(2)]);
    out.assert_bit_identical();
}

/// With mid-step recovery off, a lost worker costs the interrupted step: redone from the peer
/// snapshots of the step before.
#[test]
fn without_mid_step_the_peer_tier() {
    let out = run(
        "no-mid-step",
        4,
        &["elastic.mid_step=false"],
        vec![Rule::at(1, 3, Pos::Action(20), kill_it(3))],
    );
    out.assert_recovery(Tier::Peer, 0, (4, 4));
    out.assert_no_mid_step_attempt();
    assert_eq!(out.lost_nodes(), [node(1)]);
    out.assert_bit_identical();
}

/// A kill in step 1 (no snapshot, no checkpoint yet) without mid-step recovery: the run restarts
/// from the seeded initial weights, which is the state before step 1 (recorded as `peer`, nothing
/// lost).
#[test]
fn kill_in_step_1_restarts_from_the_initial_weights() {
    let out = run(
        "step-1",
        4,
        &["elastic.mid_step=false"],
        vec![Rule::at(2, 1, Pos::Action(20), |c, id| {
            c.kill_worker(&id.node, id.stage);
            Verdict::Kill
        })],
    );
    out.assert_recovery(Tier::Peer, 0, (4, 4));
    out.assert_no_mid_step_attempt();
    let plan = out.plans();
    assert!(plan[0].resume_from.is_none(), "{plan:?}");
    out.assert_bit_identical();
}

/// A kill in step 1 with mid-step recovery: the replacement starts from the seeded weights (the
/// step-start state) and only the lost stage's done units are redone.
#[test]
fn mid_step_kill_in_step_1_uses_the_seeded_weights() {
    let out = run(
        "step-1-mid",
        4,
        &[],
        vec![Rule::at(2, 1, Pos::Action(20), |c, id| {
            c.kill_worker(&id.node, id.stage);
            Verdict::Kill
        })],
    );
    let r = out.assert_recovery(Tier::MidStep, 0, (4, 4));
    assert_eq!(r.redone_units, Some(6));
    out.assert_bit_identical();
}

/// A node cut off by a partition (its agent stops heartbeating, its workers stop talking, nothing
/// closes): silence proves no death, so there is no mid-step recovery; the node is declared dead
/// on missed heartbeats and fenced, and the step is redone from the peer snapshots on the three
/// nodes left.
#[test]
fn partitioned_node_is_fenced_and_the_step_redone_from_peers() {
    let out = run(
        "partition",
        4,
        &[
            "elastic.heartbeat_s=0.1",
            "elastic.dead_after_s=0.6",
            "pipeline.timeout_s=20",
        ],
        vec![Rule::at(2, 3, Pos::Action(20), |c, id| {
            c.wait_held(2, 2);
            c.silence(&id.node);
            Verdict::Hang
        })],
    );
    out.assert_recovery(Tier::Peer, 0, (4, 3));
    out.assert_no_mid_step_attempt();
    let lost = out.lost();
    assert_eq!(lost.len(), 1, "{:#?}", out.events);
    assert_eq!(lost[0].node.as_str(), node(2));
    assert!(
        lost[0].reason.contains("missed heartbeats"),
        "{:?}",
        lost[0]
    );
    assert!(lost[0].mid_step.is_none());
    out.assert_bit_identical();
}

/// A hung worker (alive, connections open, silent): its neighbours' timeouts name it; its node is
/// declared lost (its agent lives, so it joins again) and the step is redone from the peers.
/// (Agents reap late, so the neighbour's own timeout report is the failure's first word.)
#[test]
fn hung_worker_is_named_by_its_neighbours_timeouts() {
    let out = harness::run_reaping_late(
        "hung",
        4,
        &["pipeline.timeout_s=1"],
        vec![Rule::at(1, 3, Pos::Action(20), |c, _| {
            c.wait_held(2, 2);
            Verdict::Hang
        })],
    );
    out.assert_recovery(Tier::Peer, 0, (4, 4));
    out.assert_no_mid_step_attempt();
    let lost = out.lost();
    assert_eq!(lost.len(), 1, "{:#?}", out.events);
    assert_eq!(lost[0].node.as_str(), node(1));
    assert!(lost[0].reason.contains("no message"), "{:?}", lost[0]);
    out.assert_bit_identical();
}

/// A preemption notice to a node in step 3: it leaves at the step's boundary with a checkpoint of
/// that boundary (a handover); nothing is lost.
#[test]
fn preemption_notice_hands_over_at_the_boundary() {
    let out = run(
        "preempt",
        4,
        &[],
        vec![Rule::at(2, 3, Pos::Action(0), |c, id| {
            c.preempt(&id.node);
            Verdict::Go
        })],
    );
    out.assert_recovery(Tier::Handover, 0, (4, 3));
    let left = out.left();
    assert_eq!(left.len(), 1, "{:#?}", out.events);
    assert_eq!((left[0].node.as_str(), left[0].step), ("node-2", 3));
    assert!(out.lost_nodes().is_empty());
    out.assert_bit_identical();
}

/// A node joins a 3-stage run during step 2: the pipeline grows to 4 stages at the step's
/// boundary (a handover), still bit-identical to the 4-stage reference.
#[test]
fn joining_node_grows_the_pipeline_at_the_boundary() {
    let out = run(
        "join",
        3,
        &["pipeline.stages=3"],
        vec![Rule::at(0, 2, Pos::Action(0), |c, _| {
            c.start_agent("node-3");
            Verdict::Go
        })],
    );
    out.assert_recovery(Tier::Handover, 0, (3, 4));
    let joined = out.joined();
    assert_eq!(joined.len(), 1, "{:#?}", out.events);
    assert_eq!((joined[0].node.as_str(), joined[0].step), ("node-3", 2));
    out.assert_bit_identical();
}

/// A node joins a 3-stage run during step 2, and is lost while the boundary's checkpoint is
/// written, after the coordinator announced the growth and stopped the pipeline for it: the
/// pipeline restarts on its three nodes (it used to fail with "the plan was to change but the
/// elastic core kept it", found by `bench goodput`).
#[test]
fn a_joiner_lost_before_its_growth_is_adopted_restarts_the_same_nodes() {
    let out = run(
        "join-lost",
        3,
        &["pipeline.stages=3"],
        vec![
            Rule::at(0, 2, Pos::Action(0), |c, _| {
                c.start_agent("node-3");
                Verdict::Go
            }),
            Rule::at(0, 2, Pos::Message("checkpoint"), |c, _| {
                c.kill_node("node-3");
                Verdict::Go
            }),
        ],
    );
    assert_eq!(out.result, Ok(STEPS), "{:#?}", out.events);
    out.assert_recovery(Tier::Handover, 0, (3, 3));
    assert!(out.joined().is_empty(), "{:#?}", out.events);
    let plans = out.plans();
    assert_eq!(plans.len(), 1, "{plans:?}");
    assert_eq!((plans[0].stages, plans[0].resume_from), (3, Some(2)));
    out.assert_bit_identical();
}

/// A node killed in step 2 (no mid-step recovery) shrinks the pipeline to 3 stages from the peer
/// snapshots; a new node joins in step 4 and the pipeline grows back to 4 at that boundary.
#[test]
fn killed_node_then_a_joiner_shrinks_and_grows() {
    let out = run(
        "shrink-grow",
        4,
        &["elastic.mid_step=false"],
        vec![
            Rule::at(2, 2, Pos::Action(20), kill_its_node(2)),
            Rule::matching(
                |id, point| {
                    id.generation > 1 && id.stage == 0 && harness::reached(point, 4, Pos::Action(0))
                },
                |c, _| {
                    c.start_agent("node-4");
                    Verdict::Go
                },
            ),
        ],
    );
    let r = out.recoveries();
    assert_eq!(r.len(), 2, "{:#?}", out.events);
    assert_eq!([r[0].tier, r[1].tier], [Tier::Peer, Tier::Handover]);
    let stages: Vec<usize> = out.plans().iter().map(|p| p.stages).collect();
    assert_eq!(stages, [3, 4], "{:#?}", out.events);
    assert_eq!(out.lost_nodes(), [node(2)]);
    out.assert_bit_identical();
}

/// A node's agent restarts (a new incarnation joins while the old connection still looks open,
/// as after a host reboot) and the old incarnation's worker dies with it: the node-level loss is
/// proven, so its stage is replaced mid-step on the node's new incarnation.
#[test]
fn agent_restart_as_a_new_incarnation() {
    let out = run(
        "restart",
        4,
        &[],
        vec![Rule::at(1, 3, Pos::Action(20), |c, id| {
            c.wait_held(2, 2);
            // The old agent hears `Refused` and stops its worker (this one).
            c.start_agent(&id.node);
            Verdict::Kill
        })],
    );
    // The mid-step repair, then a handover at the boundary: the new incarnation is a joiner
    // until a plan takes it (the same four nodes, generation 2).
    let r = out.recoveries();
    assert_eq!(r.len(), 2, "{:#?}", out.events);
    assert_eq!(
        (r[0].tier, node_name(&r[0].node), node_name(&r[0].host)),
        (Tier::MidStep, Some("node-1"), Some("node-1")),
        "{:#?}",
        out.events
    );
    assert_eq!(
        (r[1].tier, r[1].lost_steps, r[1].stages_after),
        (Tier::Handover, 0, 4),
        "{:#?}",
        out.events
    );
    let joined = out.joined();
    assert_eq!((joined.len(), joined[0].step), (1, 3));
    let lost = out.lost();
    assert_eq!(lost.len(), 1, "{:#?}", out.events);
    assert!(lost[0].reason.contains("incarnation 2"), "{:?}", lost[0]);
    assert_eq!(out.fenced, [node(1)]);
    out.assert_bit_identical();
}

/// Rules that hold back node 1's answers to the peer copies of step 3 until stage 1 reaches
/// `release_at` in step 5 (then `then` runs there): stages 0 and 1 still send their copies of
/// step 3 when step 4 ends.
fn stall_step_3_copies(
    then: impl FnOnce(&Arc<Cluster>, &WorkerId) -> Verdict + Send + 'static,
    release_at: Pos,
) -> Vec<Rule> {
    vec![
        Rule::at(0, 1, Pos::Action(0), |c, _| {
            c.stall_puts(&node(1), 3);
            Verdict::Go
        }),
        Rule::at(1, 5, release_at, move |c, id| {
            c.release_puts();
            then(c, id)
        }),
    ]
}

/// Peer copies slower than a step (the GPU run of 2026-11-26): while stages 0 and 1 still send
/// their copies of step 3, no stage copies step 4 — skipped, not queued, and no step waits (a
/// wait would hang step 5 behind the stalled copy). The metrics say so: step 4's copy skipped,
/// and tier-1 recovery then at most at step 2 (step 3's copies are incomplete). With at most
/// one skip in a row, step 3 is always copied (step 2's may be skipped behind step 1's, whose
/// first connections are slow). "At most step 2" includes none at all: on a loaded machine the
/// copies of steps 1 and 2 may still be on their way when steps 3 and 4 end; what must never
/// appear is a claim of step 3 or later.
#[test]
fn a_copy_in_flight_skips_the_next_steps_copy_and_says_so() {
    let out = run(
        "skip-in-flight",
        4,
        &["elastic.peer_snapshot_max_skips=1"],
        stall_step_3_copies(|_, _| Verdict::Go, Pos::Action(0)),
    );
    assert!(out.recoveries().is_empty(), "{:#?}", out.events);
    let (s3, s4) = (out.step_record(3), out.step_record(4));
    assert_eq!(
        (s3.peer_snapshots_skipped, s4.peer_snapshots_skipped),
        (0, 1)
    );
    for s in [s3, s4] {
        assert!(
            s.peer_snapshot_step.is_none_or(|c| c <= 2),
            "step {}'s record claims complete copies of step {:?}",
            s.step,
            s.peer_snapshot_step
        );
    }
    out.assert_bit_identical();
}

/// The same skipped copy, then a worker killed in step 5 (mid-step recovery needs the copies of
/// step 4, which do not exist): the newest complete copies are of step 3, older than the last
/// finished step, so the run restarts from them, redoes steps 4 and 5, and ends bit-identical.
/// (No checkpoint but the final one, so that the peer tier is the newest state.)
#[test]
fn a_skipped_snapshot_recovers_from_the_older_copy_and_replays() {
    let out = run(
        "skipped-snapshot",
        4,
        &["checkpoint.every=0", "elastic.peer_snapshot_max_skips=1"],
        stall_step_3_copies(
            |c, id| {
                c.wait_held(3, 2);
                c.kill_worker(&id.node, id.stage);
                Verdict::Kill
            },
            Pos::Action(20),
        ),
    );
    out.assert_recovery(Tier::Peer, 1, (4, 4));
    let plans = out.plans();
    assert_eq!(plans[0].resume_from, Some(3), "{plans:?}");
    out.assert_bit_identical();
}

/// Issue 35: a node's agent restarted (a new process: its memory and the peer snapshots in it
/// are gone) while its snapshot buddy died. The coordinator still counted the copies the old
/// incarnation had reported, chose the peer tier, and the restore asked the new agent for state
/// it never held. Copies of an earlier incarnation are forgotten when the new one joins: no alive
/// agent holds stage 1's state, so the run goes back to a committed checkpoint (or the start) in
/// one recovery and ends bit-identical.
#[test]
fn a_restarted_agents_lost_copies_are_not_counted() {
    let out = run(
        "restart-forgets",
        4,
        &["elastic.mid_step=false"],
        vec![Rule::at(1, 3, Pos::Action(20), |c, id| {
            c.wait_held(2, 2);
            // A new process on node 1 (empty memory); the old agent hears `Refused`.
            c.start_agent(&id.node);
            c.kill_node(&node(2));
            Verdict::Kill
        })],
    );
    let r = out.the_recovery();
    assert!(
        matches!(r.tier, Tier::Checkpoint | Tier::Restart),
        "{:#?}",
        out.events
    );
    let plans = out.plans();
    assert_eq!(plans.len(), 1, "{:#?}", out.events);
    out.assert_bit_identical();
}

/// Every node's agent joins again as a new incarnation before the coordinator recovers from the
/// failure (as after a stall of the whole fleet: all declared dead at once, all joining again;
/// issue 35). The failure is of the old incarnations: the recovery must plan on the new ones, not
/// declare them dead too (it used to, so their heartbeats were refused until the run gave up with
/// "only 0 nodes alive"). The old agents' memory is gone, so the step is redone from the
/// newest checkpoint.
#[test]
fn every_agent_joining_again_at_once_keeps_the_whole_pipeline() {
    let out = run(
        "all-rejoin",
        4,
        &["elastic.mid_step=false", "elastic.peer_snapshots=false"],
        vec![Rule::at(0, 3, Pos::Action(0), |c, _| {
            for r in 0..4 {
                // The old agent hears `Refused` and stops its worker.
                c.start_agent(&node(r));
            }
            Verdict::Kill
        })],
    );
    // The step is redone from the checkpoint of step 2, or from the start if that checkpoint
    // was not committed yet when the agents restarted: either way on all four nodes.
    let r = out.the_recovery();
    assert_eq!(
        (r.stages_before, r.stages_after),
        (4, 4),
        "{:#?}",
        out.events
    );
    assert!(
        matches!(r.tier, Tier::Checkpoint | Tier::Restart),
        "{:#?}",
        out.events
    );
    let plans = out.plans();
    assert_eq!(plans.len(), 1, "{:#?}", out.events);
    let mut nodes: Vec<&str> = plans[0].nodes.iter().map(NodeId::as_str).collect();
    nodes.sort();
    assert_eq!(nodes, [node(0), node(1), node(2), node(3)], "{plans:?}");
    let mut fenced = out.fenced.clone();
    fenced.sort();
    assert_eq!(fenced, [node(0), node(1), node(2), node(3)]);
    out.assert_bit_identical();
}

/// A second loss during the recovery: the mid-step replacement dies while it loads its state, so
/// mid-step recovery gives up and the step is redone from the peer snapshots.
#[test]
fn loss_during_recovery_falls_back_to_peer_snapshots() {
    let out = run(
        "loss-in-recovery",
        4,
        &[],
        vec![
            Rule::at(1, 3, Pos::Action(20), kill_it(3)),
            // Restoring the state after step 2.
            Rule::at_replacement(1, 2, Pos::Message("restore_peers"), |c, id| {
                c.kill_worker(&id.node, id.stage);
                Verdict::Kill
            }),
        ],
    );
    out.assert_recovery(Tier::Peer, 0, (4, 4));
    let lost = out.lost();
    assert_eq!(lost.len(), 2, "{:#?}", out.events);
    assert_eq!(lost[0].mid_step, Some(true));
    assert!(lost[1].mid_step.is_none());
    let replacements = out.workers.iter().filter(|w| w.replacement).count();
    assert_eq!(replacements, 1);
    out.assert_bit_identical();
}

/// Two separate losses in two steps: each repaired mid-step.
#[test]
fn two_losses_in_two_steps_are_each_repaired_mid_step() {
    let out = run(
        "two-losses",
        4,
        &[],
        vec![
            Rule::at(0, 2, Pos::Action(10), kill_it(2)),
            Rule::at(3, 5, Pos::Action(10), kill_it(5)),
        ],
    );
    let r = out.recoveries();
    assert_eq!(r.len(), 2, "{:#?}", out.events);
    for (r, (stage, step)) in r.iter().zip([(0, 2), (3, 5)]) {
        assert_eq!(
            (r.tier, r.stage, r.step),
            (Tier::MidStep, Some(stage), step),
            "{r:?}"
        );
    }
    out.assert_bit_identical();
}

/// A failure that would recur on any node (token ids beyond the vocabulary) stops the run at once
/// with the worker's message: no node is declared lost, nothing is retried. (Agents reap late: if
/// the agent's `WorkerExited` overtakes the worker's own `Failed` report, the coordinator takes
/// the exit for a lost node and restarts once — a race of the coordinator, reported.)
#[test]
fn permanent_worker_failure_stops_the_run() {
    let source = out_of_vocabulary_data("bad-data");
    let out = harness::run_reaping_late("permanent", 4, &[&source], Vec::new());
    let err = out.result.as_ref().unwrap_err();
    assert!(err.contains("vocab_size is 64"), "{err}");
    assert!(!err.contains("lost"), "{err}");
    assert!(out.lost_nodes().is_empty(), "{:#?}", out.events);
    assert!(out.recoveries().is_empty());
    // One pipeline: nobody restarted a worker.
    assert_eq!(out.workers.len(), 4);
}

/// The same permanent failure with agents that report exits at once: the agent's `WorkerExited`
/// and the worker's own `Failed` race on two connections, and the worker's report decides
/// whichever arrives first (the coordinator reads a dead worker's connection to its end).
#[test]
fn permanent_worker_failure_stops_the_run_whoever_reports_first() {
    let source = out_of_vocabulary_data("bad-data-prompt");
    let out = run("permanent-prompt", 4, &[&source], Vec::new());
    let err = out.result.as_ref().unwrap_err();
    assert!(err.contains("vocab_size is 64"), "{err}");
    assert!(out.lost_nodes().is_empty(), "{:#?}", out.events);
    assert!(out.recoveries().is_empty());
    assert_eq!(out.workers.len(), 4);
}

/// A `data.source` setting naming a corpus whose tokens reach 999, beyond the scenarios'
/// `model.vocab_size` (64): a failure every node would hit.
fn out_of_vocabulary_data(name: &str) -> String {
    let data = fresh_dir(name);
    let tokens: Vec<u8> = (0..4000u16)
        .flat_map(|t| (t % 1000).to_le_bytes())
        .collect();
    std::fs::write(data.join("train.bin"), &tokens).unwrap();
    // The launcher checks every token of val.bin before any worker starts (and would stop the run
    // there); train.bin is checked by the stage that reads it, which is the failure tested here.
    let val: Vec<u8> = (0..4000u16).flat_map(|t| (t % 64).to_le_bytes()).collect();
    std::fs::write(data.join("val.bin"), &val).unwrap();
    format!("data.source={}", data.display())
}

/// A stage over `train.memory_budget_bytes` would be over it on any node: the run stops with the
/// budget error instead of recovering.
#[test]
fn over_budget_stops_the_run() {
    let out =
        harness::run_reaping_late("budget", 4, &["train.memory_budget_bytes=1000"], Vec::new());
    let err = out.result.as_ref().unwrap_err();
    assert!(err.contains("memory_budget"), "{err}");
    assert!(out.lost_nodes().is_empty(), "{:#?}", out.events);
    assert_eq!(out.workers.len(), 4);
}

/// Too few nodes left: with `elastic.min_nodes = 4`, a node killed in step 3 is replaced mid-step,
/// but at the boundary the run waits `join_timeout_s` for a fourth node and then stops with a
/// clear error; the checkpoint of that boundary is committed.
#[test]
fn too_few_nodes_is_a_clear_failure() {
    let out = run(
        "min-nodes",
        4,
        &["elastic.min_nodes=4", "elastic.join_timeout_s=0.5"],
        vec![Rule::at(1, 3, Pos::Action(20), kill_its_node(3))],
    );
    let err = out.result.as_ref().unwrap_err();
    assert!(err.contains("min_nodes"), "{err}");
    assert_eq!(out.lost_nodes(), [node(1)]);
    let r = out.recoveries();
    assert_eq!(r.len(), 1, "{:#?}", out.events);
    assert_eq!(r[0].tier, Tier::MidStep);
    let (step, _) = harness::final_state(&out.dir);
    assert_eq!(
        step, 3,
        "the run ({STEPS} steps) stopped at step 3's boundary"
    );
}

/// A node killed while a rebuilt pipeline starts: stage 2's node dies in step 3 (repaired
/// mid-step), and the 3-stage pipeline of the next boundary loses the node of its stage 1 as it
/// connects. That node is lost and the run goes on with two stages, bit-identical; its healthy
/// neighbour, whose connection to it failed, is not counted lost (it was, when a failed connect
/// at start-up ended the worker as an error of its own rather than a neighbour's).
#[test]
fn a_node_killed_while_a_rebuilt_pipeline_starts_is_recovered() {
    let in_start = |id: &WorkerId, point: &trainer::runtime::kill_switch::Point<'_>| {
        id.generation == 2
            && id.stage == 1
            && matches!(
                point,
                trainer::runtime::kill_switch::Point::Message(
                    trainer::runtime::control::ToWorker::Topology { .. }
                )
            )
    };
    let out = run(
        "start-kill",
        4,
        &[],
        vec![
            Rule::at(2, 3, Pos::Action(20), kill_its_node(3)),
            Rule::matching(in_start, |c, id| {
                c.kill_node(&id.node);
                Verdict::Kill
            }),
        ],
    );
    assert!(out.result.is_ok(), "{:?}\n{:#?}", out.result, out.events);
    let mut lost = out.lost_nodes();
    lost.sort();
    lost.dedup();
    assert_eq!(lost, [node(1), node(2)], "{:#?}", out.events);
    let plans = out.plans();
    assert_eq!(plans.last().map(|p| p.stages), Some(2), "{plans:#?}");
    out.assert_bit_identical();
}
