//! Virtual stages through recovery (issue 33), in process (see `harness`): a worker holding
//! v = 2 layer chunks of an interleaved schedule (`seq1f1b-i`, `1f1b-i`) is killed at an exact
//! action of step 3, and
//!
//! * with one worker lost, it is replaced mid-step: the replacement rebuilds both chunks' state
//!   by redoing only its own units — exactly those its neighbours prove were done, per
//!   (chunk, unit) — and the survivors send it again what they sent any of its chunks, round the
//!   ring (worker p−1's chunk c feeds worker 0's chunk c+1; with two workers the survivor is on
//!   both sides of the lost one);
//! * with two workers lost, the step is redone from the peer snapshots (each worker's snapshot
//!   the union of its chunks' tensors under their global names);
//! * with a whole node lost, its worker is replaced mid-step on a neighbour's node and the run
//!   shrinks to three stages at the step's boundary (the plain `seq1f1b`: three stages cannot
//!   interleave four micro-batches);
//! * with two replicas, a lost replica's micro-batches are re-routed to the other.
//!
//! Every run ends bit-identical, every named tensor, to the undisturbed run: with two workers
//! the harness's plain 4-stage `seq1f1b` run itself (interleaving does not change the
//! arithmetic), with four workers (8 layers) the undisturbed interleaved run.

mod common;
mod harness;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, OnceLock};

use harness::{Cluster, Outcome, Pos, Rule, STEPS, WorkerId, run};
use trainer::runtime::kill_switch::Verdict;
use trainer::runtime::recovery::Tier;
use trainer::schedule::{Delivered, Op, ScheduleKind, generate_virtual};

/// Two workers of two chunks each (the harness's 4 layers: one per virtual stage).
const TWO_WORKERS: [&str; 3] = [
    "pipeline.schedule=seq1f1b-i",
    "pipeline.stages=2",
    "pipeline.virtual_stages=2",
];

/// Four workers of two chunks each (8 layers: one per virtual stage).
const FOUR_WORKERS: [&str; 4] = [
    "pipeline.schedule=seq1f1b-i",
    "pipeline.stages=4",
    "pipeline.virtual_stages=2",
    "model.layers=8",
];

/// The harness's job's micro-batches (see `harness::base_sets`).
const M: usize = 4;
/// The harness's job's segments per micro-batch.
const K: usize = 2;

/// Kills the worker that reached the point, once the agents hold both copies of the state after
/// `step − 1`.
fn kill_it(step: u64) -> impl FnOnce(&Arc<Cluster>, &WorkerId) -> Verdict + Send + 'static {
    move |c, id| {
        c.wait_held(step - 1, 2);
        c.kill_worker(&id.node, id.stage);
        Verdict::Kill
    }
}

/// The final state of the undisturbed four-worker interleaved run (computed once).
fn four_worker_reference() -> &'static BTreeMap<String, Vec<u8>> {
    static REFERENCE: OnceLock<BTreeMap<String, Vec<u8>>> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let out = run("interleaved-reference", 4, &FOUR_WORKERS, Vec::new());
        assert_eq!(out.result, Ok(STEPS), "the undisturbed run failed");
        assert!(out.recoveries().is_empty(), "{:#?}", out.events);
        let (step, state) = harness::final_state(&out.dir);
        assert_eq!(step, STEPS);
        state
    })
}

/// Asserts that `out` finished every step with a final state equal, tensor by tensor, to
/// `reference`.
fn assert_same_state(name: &str, out: &Outcome, reference: &BTreeMap<String, Vec<u8>>) {
    assert_eq!(out.result, Ok(STEPS), "{name}: {:#?}", out.events);
    let (step, state) = harness::final_state(&out.dir);
    assert_eq!(step, STEPS, "{name}");
    assert!(
        reference.keys().any(|n| n.starts_with("optim.m.")) && reference.contains_key("wte.weight"),
        "{name}: the reference should hold every parameter and the moments"
    );
    let differing: Vec<&String> = reference
        .iter()
        .filter(|(n, b)| state.get(*n) != Some(*b))
        .map(|(n, _)| n)
        .collect();
    assert!(
        differing.is_empty() && state.len() == reference.len(),
        "{name}: the final state differs from the undisturbed run in {differing:?}"
    );
}

/// The units a replacement of worker `lost` killed before action `at` of its list redoes, by the
/// schedule's recovery model: every forward and backward, on any chunk, whose output a neighbour
/// had received. A kill point's sends have all arrived, and each survivor has read all that
/// arrived when it relinks (what it had not reached in its own list it takes off the old links
/// first), so the neighbours have exactly the outputs sent before `at`.
fn expected_redone(kind: ScheduleKind, p: usize, lost: usize, at: usize) -> u64 {
    let s = generate_virtual(kind, p, 2, M, K).unwrap();
    let list = &s.actions[lost];
    assert!(at < list.len(), "action {at} of {}", list.len());
    let sent = |op: Op| -> HashSet<(usize, trainer::schedule::Unit)> {
        list[..at]
            .iter()
            .filter(|a| a.op() == op)
            .map(|a| (a.chunk(), a.unit()))
            .collect()
    };
    let delivered = Delivered {
        activations: sent(Op::SendActivation),
        grads: sent(Op::SendGrad),
    };
    s.compute_actions(lost)
        .filter(|&a| delivered.replays(a))
        .count() as u64
}

/// Worker `worker` of `sets`' `p` workers killed before action `at` of step 3 of `kind`:
/// replaced mid-step on its own node, no survivor recomputes anything, the replacement redoes
/// exactly the units the model says (more than none: the kill lands after outputs of both
/// chunks went out); returns the outcome.
fn mid_step_kill(
    name: &str,
    sets: &[&str],
    kind: ScheduleKind,
    worker: usize,
    at: usize,
) -> Outcome {
    let p: usize = sets
        .iter()
        .find_map(|s| s.strip_prefix("pipeline.stages="))
        .unwrap()
        .parse()
        .unwrap();
    let out = run(
        name,
        p,
        sets,
        vec![Rule::at(worker, 3, Pos::Action(at), kill_it(3))],
    );
    let r = out.assert_recovery(Tier::MidStep, 0, (p, p));
    assert_eq!(r.stage, Some(worker), "{r:?}");
    let lost = out.lost();
    assert_eq!(lost.len(), 1, "{:#?}", out.events);
    assert_eq!(lost[0].mid_step, Some(true));
    // No survivor recomputed anything: the workers computed one step's units in all, each of
    // the p·v virtual stages every unit forward and backward.
    assert_eq!(
        out.step_record(3).units as u64,
        (p * 2 * M * K * 2) as u64,
        "{name}"
    );
    let redone = r.redone_units.unwrap() as u64;
    let expected = expected_redone(kind, p, worker, at);
    eprintln!("{name}: redone {redone} (the model: {expected})");
    assert!(expected > 0, "{name}: a kill point that proves nothing");
    // The model counts every output the lost worker sent before the kill as delivered: a
    // survivor takes in what is still queued on its old links before it relinks (with two
    // workers it may have stopped on one link while the other held the lost worker's last
    // sends), so however far it had got, the replacement redoes exactly those units.
    assert_eq!(
        redone, expected,
        "{name}: redone {redone}, the model {expected}"
    );
    out
}

/// Two workers in a ring: worker 1 (virtual stages 1 and 3, the loss) killed in the middle of
/// step 3. Worker 0 is both its previous and its next worker: both links are rebuilt, and worker
/// 0 tells what it received from each of worker 1's chunks and sends again what it sent them.
#[test]
fn the_second_of_two_workers_killed_mid_step_is_replaced_bit_identically() {
    let out = mid_step_kill(
        "interleaved-mid-step-1-of-2",
        &TWO_WORKERS,
        ScheduleKind::Seq1F1BInterleaved,
        1,
        30,
    );
    out.assert_bit_identical();
}

/// Worker 0 (virtual stages 0 and 2: it reads the tokens) killed in the middle of step 3.
#[test]
fn the_first_of_two_workers_killed_mid_step_is_replaced_bit_identically() {
    let out = mid_step_kill(
        "interleaved-mid-step-0-of-2",
        &TWO_WORKERS,
        ScheduleKind::Seq1F1BInterleaved,
        0,
        30,
    );
    out.assert_bit_identical();
}

/// `1f1b-i` once: worker 1 of two killed in the middle of step 3.
#[test]
fn one_f_one_b_interleaved_recovers_mid_step_bit_identically() {
    let sets = [
        "pipeline.schedule=1f1b-i",
        "pipeline.stages=2",
        "pipeline.virtual_stages=2",
    ];
    let out = mid_step_kill(
        "interleaved-1f1b-mid-step",
        &sets,
        ScheduleKind::OneFOneBInterleaved,
        1,
        24,
    );
    out.assert_bit_identical();
}

/// Four workers: worker 0 (virtual stages 0 and 4) killed in the middle of step 3. Its
/// neighbours are worker 1 and, round the ring, worker 3 (whose chunk 0 feeds worker 0's
/// chunk 1).
#[test]
fn the_first_of_four_workers_killed_mid_step_relinks_round_the_ring() {
    let reference = four_worker_reference();
    let name = "interleaved-mid-step-0-of-4";
    let out = mid_step_kill(name, &FOUR_WORKERS, ScheduleKind::Seq1F1BInterleaved, 0, 30);
    assert_same_state(name, &out, reference);
}

/// Four workers: worker 2 (virtual stages 2 and 6) killed in the middle of step 3.
#[test]
fn a_middle_worker_of_four_killed_mid_step_is_replaced_bit_identically() {
    let reference = four_worker_reference();
    let name = "interleaved-mid-step-2-of-4";
    let out = mid_step_kill(name, &FOUR_WORKERS, ScheduleKind::Seq1F1BInterleaved, 2, 40);
    assert_same_state(name, &out, reference);
}

/// Two workers killed in one step: mid-step recovery replaces one lost worker only, so the step
/// is redone from the peer snapshots of step 2 — each worker's snapshot holds both its chunks'
/// tensors — on the same four nodes.
#[test]
fn two_workers_killed_in_one_step_restart_it_from_peer_snapshots() {
    let reference = four_worker_reference();
    let name = "interleaved-peer";
    let out = run(
        name,
        4,
        &FOUR_WORKERS,
        vec![Rule::at(1, 3, Pos::Action(30), |c, id| {
            c.wait_held(2, 2);
            c.kill_worker("node-2", 2);
            c.kill_worker(&id.node, id.stage);
            Verdict::Kill
        })],
    );
    out.assert_recovery(Tier::Peer, 0, (4, 4));
    out.assert_no_mid_step_attempt();
    assert_same_state(name, &out, reference);
}

/// A whole node (agent and worker) killed in the middle of step 3: its worker's two chunks are
/// replaced mid-step on a neighbour's node, and at the step's boundary the pipeline shrinks to
/// the three nodes left, which run the plain `seq1f1b` (three stages cannot interleave four
/// micro-batches) from the state the four workers held, bit-identically.
#[test]
fn a_lost_node_is_replaced_mid_step_then_the_run_shrinks_to_three_stages() {
    let reference = four_worker_reference();
    let name = "interleaved-node";
    let out = run(
        name,
        4,
        &FOUR_WORKERS,
        vec![Rule::at(2, 3, Pos::Action(40), |c, id| {
            c.wait_held(2, 2);
            c.kill_node(&id.node);
            Verdict::Kill
        })],
    );
    let r = out.recoveries();
    assert_eq!(r.len(), 2, "{:#?}", out.events);
    assert_eq!(
        (r[0].tier, r[0].stages_after, r[0].lost_steps),
        (Tier::MidStep, 4, 0),
        "{:#?}",
        out.events
    );
    assert_ne!(
        r[0].host.as_ref().map(|h| h.as_str()),
        Some("node-2"),
        "the replacement runs on a live node"
    );
    assert_eq!(
        (r[1].stages_before, r[1].stages_after, r[1].lost_steps),
        (4, 3, 0),
        "{:#?}",
        out.events
    );
    assert_same_state(name, &out, reference);
}

/// Two replicas of two workers of two chunks: replica 1's first worker (slot 2) killed in the
/// middle of its share of step 3. Replica 0 computes the lost share over its chunks, and the run
/// ends bit-identical to the undisturbed one-replica, 4-stage plain run.
#[test]
fn a_lost_replica_of_an_interleaved_run_is_rerouted_bit_identically() {
    let sets: Vec<&str> = TWO_WORKERS
        .iter()
        .copied()
        .chain(["pipeline.replicas=2"])
        .collect();
    let out = run(
        "interleaved-reroute",
        4,
        &sets,
        vec![Rule::at(2, 3, Pos::Action(20), kill_it(3))],
    );
    out.assert_first_recovery(Tier::Reroute, 3, 0);
    out.assert_bit_identical();
}
