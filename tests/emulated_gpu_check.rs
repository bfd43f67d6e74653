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
    // dQ, dK, dV), the BF16 tensor-core attention's v1 kernels at five and its v2 kernels at six
    // (each v2 shape also run twice, bit-identical: one row); at one shape of each, the K/V
    // cache's rows past the segment checked untouched (exactly: FP32 rows). Document masks: the
    // FP32 and v2 kernels at three more shapes each (one of them in a K/V cache), against
    // ops::document_prefix_attention_*.
    assert!(kernels.len() >= 98 + 2 * 17 + 3, "{report:#}");
    assert_eq!(
        rows("fp32", "attention"),
        9 * 5 + 2 + 2 + 2 + 2 + 2,
        "{report:#}"
    );
    assert_eq!(rows("bf16", "attention"), 5 * 5 + 9 * 5 + 9, "{report:#}");
    let named = |version: &str| {
        kernels
            .iter()
            .filter(|k| k["what"].as_str().is_some_and(|w| w.contains(version)))
            .count()
    };
    assert_eq!(named("tensor cores v1"), 5 * 5 + 2, "{report:#}");
    assert_eq!(named("tensor cores v2"), 9 * 5 + 2 + 2 + 9, "{report:#}");
    assert_eq!(
        named("attention run twice, outputs bit-identical"),
        9,
        "{report:#}"
    );
    // The masked rows: 3 shapes × 5 outputs + 2 untouched-rows checks in FP32, the same with v2
    // plus its 3 bit-identical reruns; none with v1, which takes no document starts.
    assert_eq!(named("document masks"), 17 + 17 + 3, "{report:#}");
    assert_eq!(
        kernels
            .iter()
            .filter(|k| k["what"]
                .as_str()
                .is_some_and(|w| w.contains("document masks") && w.contains("v1")))
            .count(),
        0,
        "{report:#}"
    );
    for k in kernels {
        let (err, bound) = (k["rel_l2"].as_f64(), k["bound"].as_f64());
        assert!(matches!((err, bound), (Some(e), Some(b)) if e <= b), "{k}");
    }
}

/// `seqpipe gpu gemm` (run by gpu-check before the training benchmark) on the emulated GPU at a
/// small width: every product of a block and a head chunk in all six ways, with times (the BF16
/// fast path's head over the vocabulary padded from 96 to 128), and the
/// BF16-operand products within BF16 rounding of the FP32 ones (the emulation's "fast BF16" is
/// FP32; on a GPU both round the operands and agree far closer).
#[test]
fn the_matrix_product_benchmark_times_every_product_every_way() {
    let out = Command::new(env!("CARGO_BIN_EXE_seqpipe"))
        .args([
            "gpu",
            "gemm",
            "--rows",
            "16",
            "--d-model",
            "32",
            "--vocab",
            "96",
        ])
        .args(["--reps", "1"])
        .output()
        .expect("seqpipe runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "seqpipe gpu gemm failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    let times = report["times"].as_array().expect("a list of times");
    // 4 linear layers x 3 products + 3 head products, 6 ways each.
    assert_eq!(times.len(), 15 * 6, "{report:#}");
    for t in times {
        assert!(t["ms"].as_f64().is_some_and(|ms| ms > 0.0), "{t}");
    }
    let qkv = times
        .iter()
        .find(|t| t["what"] == "c_attn forward")
        .expect("the QKV product");
    assert_eq!(qkv["mnk"], serde_json::json!([16, 96, 32]), "{qkv}");
    let head = |how: &str| {
        times
            .iter()
            .find(|t| t["what"] == "lm_head forward (one chunk)" && t["how"] == how)
            .map(|t| t["mnk"].clone())
    };
    assert_eq!(head("bf16 operands"), Some(serde_json::json!([16, 96, 32])));
    assert_eq!(
        head("bf16 cached weights + casts"),
        Some(serde_json::json!([16, 128, 32])),
        "{report:#}"
    );
    let agree = report["bf16_operands_vs_fast_rel_l2"]
        .as_f64()
        .expect("the agreement");
    assert!(agree > 0.0 && agree < 1e-2, "{report:#}");
    assert_eq!(report["totals_ms"].as_array().map(Vec::len), Some(6));
}

/// `seqpipe gpu check --only attention` (what scripts/gpu-check.sh runs under compute-sanitizer's
/// racecheck) checks the attention kernels and nothing else: every FP32 and BF16 attention output
/// of the whole check, no other kernel.
#[test]
fn the_attention_only_kernel_check_runs_exactly_the_attention_kernels() {
    let out = Command::new(env!("CARGO_BIN_EXE_seqpipe"))
        .args(["gpu", "check", "--json", "--only", "attention"])
        .output()
        .expect("seqpipe runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "seqpipe gpu check --only attention failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    assert_eq!(report["failed"], 0, "{report:#}");
    let kernels = report["kernels"]
        .as_array()
        .expect("a list of kernel outputs");
    let count = |precision: &str| {
        kernels
            .iter()
            .filter(|k| k["precision"] == precision)
            .count()
    };
    // The same attention rows as the whole check's (see the first test), and only those.
    assert_eq!(count("fp32"), 9 * 5 + 2 + 2 + 2 + 2 + 2, "{report:#}");
    assert_eq!(count("bf16"), 5 * 5 + 9 * 5 + 9, "{report:#}");
    assert_eq!(kernels.len(), count("fp32") + count("bf16"), "{report:#}");
    for k in kernels {
        assert!(
            k["what"]
                .as_str()
                .is_some_and(|w| w.starts_with("attention")),
            "{k}"
        );
    }
}
