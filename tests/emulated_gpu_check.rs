//! Section 1 of `scripts/gpu-check.sh` — `seqpipe gpu check`, every kernel against the CPU oracle,
//! per precision — rehearsed on the emulated GPU (a binary built with the `emulate-gpu` feature:
//! `kernels.cu` under the CPU shim, tensor-core `mma` included). The oracle's host code (shapes,
//! uploads, poisoned outputs, the K/V-cache layout, the BF16 tensor-core attention rows) then runs
//! in every suite, not for the first time on a lent GPU.
//!
//! Run: `cargo test --release -p seqpipe --features emulate-gpu --test emulated_gpu_check`
//! (scripts/test.sh does).
#![cfg(feature = "emulate-gpu")]

use std::process::Command;

#[test]
fn the_kernel_check_passes_on_the_emulated_gpu_bf16_attention_on_tensor_cores_included() {
    let out = Command::new(env!("CARGO_BIN_EXE_seqpipe"))
        .args(["gpu", "check", "--json"])
        .output()
        .expect("seqpipe runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "seqpipe gpu check failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    assert_eq!(report["failed"], 0, "{report:#}");
    let kernels = report["kernels"]
        .as_array()
        .expect("a list of kernel outputs");
    let rows = |precision: &str, prefix: &str| {
        kernels
            .iter()
            .filter(|k| k["precision"] == precision)
            .filter(|k| k["what"].as_str().is_some_and(|w| w.starts_with(prefix)))
            .count()
    };
    // Linear layers and the LM head in each precision; the FP32 attention at six shapes (y, lse,
    // dQ, dK, dV), the BF16 tensor-core attention at five; at one shape of each, the K/V cache's
    // rows past the segment checked untouched (exactly: FP32 rows).
    assert!(kernels.len() >= 98, "{report:#}");
    assert_eq!(rows("fp32", "attention"), 6 * 5 + 2 + 2, "{report:#}");
    assert_eq!(rows("bf16", "attention"), 5 * 5, "{report:#}");
    for k in kernels {
        let (err, bound) = (k["rel_l2"].as_f64(), k["bound"].as_f64());
        assert!(matches!((err, bound), (Some(e), Some(b)) if e <= b), "{k}");
    }
}
