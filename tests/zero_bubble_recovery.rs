//! The zero-bubble Seq1F1B (`seq1f1b-zb`) through mid-step recovery, in process (see
//! `harness`): a stage of the scenarios' 4-stage job killed at an exact action of step 3, after
//! it had run weight halves (whose accumulated parameter gradients died with it) and input
//! halves whose gradients the stage before already has.
//!
//! Its replacement starts from the step-start state and runs the lost stage's whole list: every
//! forward, input half and weight half again, the weight halves in the list's order (the
//! original accumulation order), sending only what its neighbours lack — an input gradient the
//! stage before already has is not sent again. The survivors recompute nothing and send again
//! what they sent it. With two replicas a lost replica's micro-batches are re-routed to the
//! other. Every run ends bit-identical to the harness's undisturbed `seq1f1b` run (splitting
//! the backward does not change the arithmetic).

mod common;
mod harness;

use std::collections::HashSet;

use harness::{Pos, Rule, kill_it, run};
use trainer::config::Config;
use trainer::runtime::recovery::Tier;
use trainer::schedule::{Action, Delivered, Op, Schedule, ScheduleKind, Unit};

/// The scenarios' job with the zero-bubble schedule.
const ZB: [&str; 1] = ["pipeline.schedule=seq1f1b-zb"];

/// The harness's job's stages, micro-batches and segments (see `harness::base_sets`).
const P: usize = 4;
const M: usize = 4;
const K: usize = 2;

/// Compute actions of one stage in one step: every unit's F, I and W.
const UNITS_PER_STAGE: usize = M * K * 3;

/// The schedule the scenarios' workers run: the job's `seq1f1b-zb`, capped by its config's byte
/// model (which the order depends on).
fn zb_schedule() -> Schedule {
    let mut sets = harness::base_sets();
    sets.extend(ZB.iter().map(|s| s.to_string()));
    let cfg = Config::load(None, &sets).expect("the scenarios' config");
    assert_eq!(cfg.pipeline.schedule, ScheduleKind::Seq1F1BZeroBubble);
    assert_eq!(
        (
            cfg.pipeline.stages,
            cfg.pipeline.microbatches,
            cfg.pipeline.splits
        ),
        (P, M, K)
    );
    trainer::memory::training_schedule(&cfg, M).expect("the job's schedule")
}

/// Where to kill `stage` in its list: just after the first send that follows its second weight
/// half, so that it had done weight halves that a delivered message proves, and had more of
/// everything to do.
fn kill_point(list: &[Action]) -> usize {
    let second_w = list
        .iter()
        .enumerate()
        .filter(|(_, a)| a.op() == Op::BackwardWeight)
        .nth(1)
        .map(|(i, _)| i)
        .expect("two weight halves");
    let send = list[second_w..]
        .iter()
        .position(|a| matches!(a.op(), Op::SendActivation | Op::SendGrad))
        .expect("a send after the second weight half")
        + second_w;
    send + 1
}

/// The compute actions a replacement of `stage` killed before action `at` redoes, by the
/// schedule's recovery model: its neighbours have exactly the outputs it sent before `at` (a
/// kill point's sends have all arrived, and a survivor reads what arrived before it waits on the
/// lost stage).
fn expected_replay(list: &[Action], at: usize) -> Vec<Action> {
    let sent = |op: Op| -> HashSet<(usize, Unit)> {
        list[..at]
            .iter()
            .filter(|a| a.op() == op)
            .map(|a| (a.chunk(), a.unit()))
            .collect()
    };
    Delivered {
        activations: sent(Op::SendActivation),
        grads: sent(Op::SendGrad),
    }
    .replayed(list)
}

/// Stage `stage` killed in the middle of step 3: replaced mid-step on its own node, nothing else
/// recomputed, exactly the model's units redone (weight halves among them), bit-identical.
fn mid_step_kill(stage: usize) {
    let name = format!("zb-mid-step-{stage}");
    let s = zb_schedule();
    let list = &s.actions[stage];
    let at = kill_point(list);
    let replay = expected_replay(list, at);
    let count = |op: Op| replay.iter().filter(|a| a.op() == op).count();
    assert!(
        count(Op::BackwardWeight) >= 2 && count(Op::Forward) > 0,
        "{name}: a kill point that proves too little: {replay:?}"
    );
    let out = run(
        &name,
        P,
        &ZB,
        vec![Rule::at(stage, 3, Pos::Action(at), kill_it(3))],
    );
    let r = out.assert_recovery(Tier::MidStep, 0, (P, P));
    assert_eq!(r.stage, Some(stage), "{r:?}");
    let lost = out.lost();
    assert_eq!(lost.len(), 1, "{:#?}", out.events);
    assert_eq!(lost[0].mid_step, Some(true));
    // No survivor recomputed anything: the stages computed one step's units in all.
    assert_eq!(out.step_record(3).units, P * UNITS_PER_STAGE, "{name}");
    let redone = r.redone_units.unwrap();
    let replay: Vec<String> = replay.iter().map(Action::to_string).collect();
    eprintln!(
        "{name}: killed before action {at} ({}), redone {redone}: {}",
        list[at],
        replay.join(" ")
    );
    assert_eq!(redone, replay.len(), "{name}: the model's {replay:?}");
    out.assert_bit_identical();
}

/// The first stage (it reads the tokens; it sends no input gradients).
#[test]
fn the_first_stage_killed_mid_step_is_replaced_bit_identically() {
    mid_step_kill(0);
}

/// A middle stage: its replacement skips the input gradients stage 0 already has.
#[test]
fn a_middle_stage_killed_mid_step_is_replaced_bit_identically() {
    mid_step_kill(1);
}

/// The last stage (the loss).
#[test]
fn the_last_stage_killed_mid_step_is_replaced_bit_identically() {
    mid_step_kill(3);
}

/// Two replicas of two stages: replica 1's first worker (slot 2) killed in the middle of its
/// share of step 3. Replica 0 computes the lost share through its zero-bubble pipeline and the
/// run ends bit-identical to the undisturbed one-replica, 4-stage `seq1f1b` run.
#[test]
fn a_lost_replica_is_rerouted_bit_identically() {
    let sets = [ZB[0], "pipeline.replicas=2", "pipeline.stages=2"];
    let out = run(
        "zb-reroute",
        4,
        &sets,
        vec![Rule::at(2, 3, Pos::Action(12), kill_it(3))],
    );
    out.assert_first_recovery(Tier::Reroute, 3, 0);
    out.assert_bit_identical();
}
