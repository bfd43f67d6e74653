//! Mid-step recovery over device links between CUDA stages (`pipeline.transport = "nccl"`),
//! rehearsed on the emulated GPU and its emulated NCCL link (a binary built with the
//! `emulate-gpu` feature): boundary tensors are kept on each stage's device and cross device to
//! device, one link per direction (and chunk), with only their headers on the TCP links.
//!
//! A job over device links has one worker SIGKILLed in the middle of its last step: the
//! neighbours' device links to it abort (their TCP links die, which trips them), the worker is
//! replaced mid-step, each neighbour joins new device links to the replacement and sends it again
//! what it had sent, from the buffers it kept on its device. Each run must end with every loss and
//! every parameter and optimizer tensor bit-identical to the same job over TCP links, undisturbed:
//!
//! * `seq1f1b` on three stages, the middle one killed;
//! * `seq1f1b-i` on two workers of two chunks each, worker 1 killed: the survivor relinks both of
//!   its sides (a device link per chunk on each) to the one replacement, and the two must join
//!   them in an order that does not leave each waiting for the other; and on three workers,
//!   worker 0 killed (its replacement joins its previous side first, as worker 0 does at start);
//! * `seq1f1b-zb` on three stages, the middle one killed: the replacement redoes its `F`, `I` and
//!   `W` units, and its neighbours re-send from their devices what an `I` or `F` had sent it.
//!
//! Run: `cargo test --release -p seqpipe --features emulate-gpu --test emulated_nccl_pipeline`
//! (scripts/test.sh does).
#![cfg(feature = "emulate-gpu")]

mod common;

use common::emulated::{
    CUDA_NCCL, CUDA_TCP, MID_STEP, PLAIN, assert_same_training, sets, train, train_killed_mid_step,
};

/// Three stages of a layer each, one sequence per micro-batch: the smallest job with a middle
/// stage (both of whose links are rebuilt).
const THREE_STAGES: [&str; 3] = [
    "pipeline.stages=3",
    "model.layers=3",
    "train.micro_batch_size=1",
];

/// Trains the job `schedule` (settings on top of the common job's) over TCP undisturbed and over
/// NCCL device links with the worker of `stage` SIGKILLed mid-step, and checks the two
/// bit-identical.
fn killed_over_device_links_matches_tcp(name: &str, schedule: &[&str], stage: usize) {
    let tcp = train(
        &format!("{name}-tcp"),
        &sets(&[schedule, &CUDA_TCP, &MID_STEP]),
    );
    let nccl = train_killed_mid_step(
        &format!("{name}-nccl-killed"),
        &sets(&[schedule, &CUDA_NCCL, &MID_STEP]),
        stage,
    );
    assert_same_training(&tcp, &nccl);
}

#[test]
fn a_stage_sigkilled_mid_step_over_device_links_is_replaced_bit_identically() {
    killed_over_device_links_matches_tcp("nccl", &sets(&[&PLAIN, &THREE_STAGES]), 1);
}

/// `seq1f1b-i` with two chunks per worker, one sequence per micro-batch.
const INTERLEAVED: [&str; 3] = [
    "pipeline.schedule=seq1f1b-i",
    "pipeline.virtual_stages=2",
    "train.micro_batch_size=1",
];

/// Two workers in a ring: the survivor (worker 0) is on both sides of the lost worker 1.
#[test]
fn a_worker_of_chunks_sigkilled_mid_step_over_device_links_is_replaced_bit_identically() {
    killed_over_device_links_matches_tcp("nccl-chunks", &INTERLEAVED, 1);
}

/// Three workers in a ring: worker 0's replacement joins its previous side (from the last
/// worker, whose chunk 0 feeds its chunk 1) first, then its next.
#[test]
fn worker_0_of_three_with_chunks_sigkilled_mid_step_over_device_links_is_replaced_bit_identically()
{
    let three = [
        "pipeline.stages=3",
        "model.layers=6",
        "pipeline.microbatches=3",
        "pipeline.splits=1",
    ];
    killed_over_device_links_matches_tcp("nccl-chunks-3", &sets(&[&INTERLEAVED, &three]), 0);
}

#[test]
fn a_zero_bubble_stage_sigkilled_mid_step_over_device_links_is_replaced_bit_identically() {
    let zero_bubble = ["pipeline.schedule=seq1f1b-zb", "pipeline.virtual_stages=1"];
    killed_over_device_links_matches_tcp("nccl-zb", &sets(&[&zero_bubble, &THREE_STAGES]), 1);
}
