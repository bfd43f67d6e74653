//! The zero-bubble Seq1F1B (`seq1f1b-zb`) on CUDA stages, over TCP and over NCCL device links —
//! rehearsed on the emulated GPU and its emulated NCCL link (a binary built with the
//! `emulate-gpu` feature).
//!
//! * On CUDA stages over TCP, `seq1f1b-zb` trains bit-identically to `seq1f1b` on CUDA stages:
//!   each weight half runs the weight-gradient kernels of a whole backward, in the order of the
//!   input halves (Seq1F1B's backward order), from output gradients its input half kept, and the
//!   emulated device is deterministic. It also follows the CPU stages' `seq1f1b-zb` within the
//!   emulated-vs-CPU bounds of `trainer/tests/emulated_cuda_stage.rs`.
//! * Over NCCL device links an input half's gradient leaves on the link as a whole backward's
//!   does, and a weight half sends nothing: the same run, with document masks too, is
//!   bit-identical to TCP.
//!
//! Run: `cargo test --release -p seqpipe --features emulate-gpu --test emulated_zero_bubble`
//! (scripts/test.sh does).
#![cfg(feature = "emulate-gpu")]

mod common;

use common::emulated::{
    CPU_TCP, CUDA_NCCL, CUDA_TCP, MASKS, PLAIN, PLAIN_ACTIONS, ZB_ACTIONS, ZERO_BUBBLE,
    assert_bit_identical, assert_within_cpu_bounds, sets, step_records, train,
};

#[test]
fn seq1f1b_zb_on_cuda_stages_over_tcp_matches_seq1f1b_bit_for_bit_and_the_cpu_within_bounds() {
    let plain = train("zb-cuda-plain", &sets(&[&PLAIN, &CUDA_TCP]));
    let zb = train("zb-cuda-tcp", &sets(&[&ZERO_BUBBLE, &CUDA_TCP]));
    // Not a vacuous equality: every unit's backward ran as an I and a W.
    assert_bit_identical(&plain, &zb, (PLAIN_ACTIONS, ZB_ACTIONS));
    assert_eq!(
        step_records(&zb)[0].2,
        2 * 2 * 2 * 3,
        "p·m·k·3 actions in a step"
    );

    let cpu = train("zb-cpu-tcp", &sets(&[&ZERO_BUBBLE, &CPU_TCP]));
    assert_within_cpu_bounds(&cpu, &zb);
}

/// Over NCCL device links, plain and with document masks (their starts cross in the activations'
/// TCP headers, the values over the links).
#[test]
fn seq1f1b_zb_over_nccl_device_links_matches_tcp_bit_for_bit() {
    for (name, masks) in [("zb", &[][..]), ("zb-masks", &MASKS[..])] {
        let tcp = train(
            &format!("{name}-tcp"),
            &sets(&[&ZERO_BUBBLE, &CUDA_TCP, masks]),
        );
        let nccl = train(
            &format!("{name}-nccl"),
            &sets(&[&ZERO_BUBBLE, &CUDA_NCCL, masks]),
        );
        assert_bit_identical(&tcp, &nccl, (ZB_ACTIONS, ZB_ACTIONS));
    }
}
