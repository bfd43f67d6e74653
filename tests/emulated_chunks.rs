//! Virtual stages on CUDA stages, over TCP and over NCCL device links, and document masks over
//! NCCL device links — rehearsed on the emulated GPU and its emulated NCCL link (a binary built
//! with the `emulate-gpu` feature).
//!
//! * `seq1f1b-i` with v = 2 chunks per worker (p = 2), each chunk a CUDA stage of its own in the
//!   worker's process, trains bit-identically to `seq1f1b` on CUDA stages with the same segments:
//!   the emulated device is deterministic, each layer runs the same kernels in the same order
//!   whichever chunk holds it, and gradients accumulate per parameter in the same tree order. It
//!   also follows the CPU stages' `seq1f1b-i` within the emulated-vs-CPU bounds of
//!   `trainer/tests/emulated_cuda_stage.rs` (the two devices round differently inside kernels).
//! * Over NCCL device links — one per chunk and side, the last worker's chunk c linked to the
//!   first worker's chunk c+1 — the same run is bit-identical to TCP: the links move bytes.
//! * With document masks, the document starts cross in the activations' TCP headers beside the
//!   device links' values: masked training over NCCL is bit-identical to the same over TCP.
//!
//! Run: `cargo test --release -p seqpipe --features emulate-gpu --test emulated_chunks`
//! (scripts/test.sh does).
#![cfg(feature = "emulate-gpu")]

mod common;

use common::emulated::{
    CPU_TCP, CUDA_NCCL, CUDA_TCP, INTERLEAVED, INTERLEAVED_ACTIONS, MASKS, PLAIN, PLAIN_ACTIONS,
    assert_bit_identical, assert_within_cpu_bounds, sets, step_records, train,
};

/// Issue 33 on CUDA stages over TCP: each of a worker's chunks is a CUDA stage of its own.
#[test]
fn interleaved_cuda_stages_over_tcp_match_plain_seq1f1b_bit_for_bit_and_the_cpu_within_bounds() {
    let plain = train("chunks-cuda-plain", &sets(&[&PLAIN, &CUDA_TCP]));
    let interleaved = train("chunks-cuda-tcp", &sets(&[&INTERLEAVED, &CUDA_TCP]));
    // v = 2 chunks did compute: every virtual stage ran every unit forward and backward.
    assert_bit_identical(&plain, &interleaved, (PLAIN_ACTIONS, INTERLEAVED_ACTIONS));
    let units = step_records(&interleaved)[0].2;
    assert_eq!(units, 2 * 2 * 2 * 2 * 2, "p·v·m·k·2 units in a step");

    let cpu = train("chunks-cpu-tcp", &sets(&[&INTERLEAVED, &CPU_TCP]));
    assert_within_cpu_bounds(&cpu, &interleaved);
}

/// Issue 33 over NCCL device links: each chunk's boundary tensors cross its own device links,
/// including the ring's wrap link from the last worker's chunk 0 to the first worker's chunk 1.
#[test]
fn interleaved_cuda_stages_over_nccl_device_links_match_tcp_bit_for_bit() {
    let tcp = train("chunks-tcp", &sets(&[&INTERLEAVED, &CUDA_TCP]));
    let nccl = train("chunks-nccl", &sets(&[&INTERLEAVED, &CUDA_NCCL]));
    assert_bit_identical(&tcp, &nccl, (INTERLEAVED_ACTIONS, INTERLEAVED_ACTIONS));
}

/// Issue 32 over NCCL device links: the document starts go to the next stage in the activation's
/// TCP header (checked there as untrusted input), the values over the device link — with plain
/// `seq1f1b` and with the chunks' ring.
#[test]
fn masked_training_over_nccl_device_links_matches_tcp_bit_for_bit() {
    for (schedule, actions) in [(&PLAIN, PLAIN_ACTIONS), (&INTERLEAVED, INTERLEAVED_ACTIONS)] {
        let tcp = train("masks-tcp", &sets(&[schedule, &CUDA_TCP, &MASKS]));
        let nccl = train("masks-nccl", &sets(&[schedule, &CUDA_NCCL, &MASKS]));
        assert_bit_identical(&tcp, &nccl, (actions, actions));
    }
}
