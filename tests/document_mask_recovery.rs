//! Document masks through mid-step recovery (issue 32), in process (see `harness`): the scenarios'
//! 4-stage job on synthetic packed documents with `data.document_mask` and
//! `data.reset_positions`, a stage killed in the middle of step 3 and replaced on its node. The
//! replacement of the first stage reads the documents off its tokens again; a middle stage's
//! replacement gets them with the activations its neighbour kept and sends again. Either way the
//! run ends bit-identical to the undisturbed masked run, which itself ends elsewhere than the
//! unmasked one (the masks matter). The same with the document partition (each micro-batch cut
//! from its own documents): a replacement recomputes the same lengths from the same starts, and a
//! replica that takes over a lost replica's micro-batches cuts them as it would have.

mod common;
mod harness;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use harness::{Cluster, Pos, Rule, STEPS, WorkerId, final_state, reference_state, run};
use trainer::runtime::kill_switch::Verdict;
use trainer::runtime::recovery::Tier;

/// Packed documents of median 6 tokens (several per 32-token row), masked, positions restarting.
const DOCUMENTS: [&str; 3] = [
    "data.synthetic_document_median=6",
    "data.document_mask=true",
    "data.reset_positions=true",
];

/// The final state of the masked job run undisturbed (computed once).
fn masked_reference() -> &'static BTreeMap<String, Vec<u8>> {
    static REFERENCE: OnceLock<BTreeMap<String, Vec<u8>>> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let out = run("docmask-reference", 4, &DOCUMENTS, Vec::new());
        assert_eq!(out.result, Ok(STEPS), "the undisturbed masked run failed");
        assert!(out.recoveries().is_empty(), "{:#?}", out.events);
        let (step, state) = final_state(&out.dir);
        assert_eq!(step, STEPS);
        state
    })
}

/// Kills the worker that reached the point, once the agents hold both copies of the state after
/// `step − 1`.
fn kill_it(step: u64) -> impl FnOnce(&Arc<Cluster>, &WorkerId) -> Verdict + Send + 'static {
    move |c, id| {
        c.wait_held(step - 1, 2);
        c.kill_worker(&id.node, id.stage);
        Verdict::Kill
    }
}

/// Stage `stage` killed at `pos` of step 3: recovered mid-step, and the run ends bit-identical to
/// the undisturbed masked run.
fn mid_step_kill(name: &str, stage: usize, pos: Pos) {
    let reference = masked_reference();
    let out = run(
        name,
        4,
        &DOCUMENTS,
        vec![Rule::at(stage, 3, pos, kill_it(3))],
    );
    out.assert_recovery(Tier::MidStep, 0, (4, 4));
    assert_eq!(out.result, Ok(STEPS), "{:#?}", out.events);
    let (step, state) = final_state(&out.dir);
    assert_eq!(step, STEPS);
    let differing: Vec<&String> = reference
        .iter()
        .filter(|(n, b)| state.get(*n) != Some(*b))
        .map(|(n, _)| n)
        .collect();
    assert!(
        differing.is_empty() && state.len() == reference.len(),
        "{name}: final state differs from the undisturbed masked run in {differing:?}"
    );
}

#[test]
fn the_masks_change_the_run() {
    let plain = reference_state();
    let masked = masked_reference();
    assert_eq!(plain.len(), masked.len());
    assert!(
        plain.iter().any(|(n, b)| masked.get(n) != Some(b)),
        "the masked run ended where the unmasked one did: the scenarios below would be blind"
    );
}

#[test]
fn a_first_stage_killed_mid_step_rereads_its_documents_and_ends_bit_identical() {
    mid_step_kill("docmask-mid-step-0", 0, Pos::Action(12));
}

#[test]
fn a_middle_stage_killed_mid_step_gets_its_documents_again_and_ends_bit_identical() {
    mid_step_kill("docmask-mid-step-2", 2, Pos::Action(20));
}

/// The document partition on top: each micro-batch cut into 8 segments from its own documents
/// (below 8 tokens per segment the lengths are not rounded to multiples of 8, so they differ
/// from micro-batch to micro-batch).
const DOCUMENT_PARTITION: [&str; 5] = [
    DOCUMENTS[0],
    DOCUMENTS[1],
    DOCUMENTS[2],
    "pipeline.partition=\"documents\"",
    "pipeline.splits=8",
];

/// The final state of the document-partitioned job run undisturbed (computed once).
fn partitioned_reference() -> &'static BTreeMap<String, Vec<u8>> {
    static REFERENCE: OnceLock<BTreeMap<String, Vec<u8>>> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let out = run("docpart-reference", 4, &DOCUMENT_PARTITION, Vec::new());
        assert_eq!(out.result, Ok(STEPS), "the undisturbed run failed");
        assert!(out.recoveries().is_empty(), "{:#?}", out.events);
        let (step, state) = final_state(&out.dir);
        assert_eq!(step, STEPS);
        state
    })
}

/// With the document partition, stage `stage` killed at `pos` of step 3: its replacement cuts
/// each micro-batch from the same documents (read off its tokens again, or from the activations
/// its neighbour sends again), and the run ends bit-identical to the undisturbed one.
fn partitioned_mid_step_kill(name: &str, stage: usize, pos: Pos) {
    let reference = partitioned_reference();
    let out = run(
        name,
        4,
        &DOCUMENT_PARTITION,
        vec![Rule::at(stage, 3, pos, kill_it(3))],
    );
    out.assert_recovery(Tier::MidStep, 0, (4, 4));
    assert_eq!(out.result, Ok(STEPS), "{:#?}", out.events);
    let (step, state) = final_state(&out.dir);
    assert_eq!(step, STEPS);
    assert!(
        state == *reference,
        "{name}: final state differs from the undisturbed document-partitioned run"
    );
}

#[test]
fn a_first_stage_killed_mid_step_recuts_its_micro_batches_and_ends_bit_identical() {
    partitioned_mid_step_kill("docpart-mid-step-0", 0, Pos::Action(40));
}

#[test]
fn a_middle_stage_killed_mid_step_recuts_its_micro_batches_and_ends_bit_identical() {
    partitioned_mid_step_kill("docpart-mid-step-2", 2, Pos::Action(100));
}

/// Two replicas of a 2-stage pipeline with the document partition; replica 1's first stage
/// (worker slot 2) killed in the middle of its share of step 3: replica 0 computes the lost
/// share, cutting those micro-batches from their documents as replica 1 did, and the run ends
/// bit-identical to the undisturbed one-replica, 4-stage run.
#[test]
fn a_replica_lost_mid_step_with_the_document_partition_is_rerouted_bit_identical() {
    let reference = partitioned_reference();
    let sets: Vec<&str> = DOCUMENT_PARTITION
        .iter()
        .copied()
        .chain(["pipeline.replicas=2", "pipeline.stages=2"])
        .collect();
    let out = run(
        "docpart-reroute",
        4,
        &sets,
        vec![Rule::at(2, 3, Pos::Action(40), kill_it(3))],
    );
    out.assert_first_recovery(Tier::Reroute, 3, 0);
    assert_eq!(out.result, Ok(STEPS), "{:#?}", out.events);
    let (step, state) = final_state(&out.dir);
    assert_eq!(step, STEPS);
    assert!(
        state == *reference,
        "the re-routed two-replica run differs from the undisturbed one-replica run"
    );
}
