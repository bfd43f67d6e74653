//! `scripts/gpu-check.sh` runs on a lent GPU machine only now and then, in one go: its pipeline
//! section (CUDA stages against CPU stages, 2 vs 4 stages, stop + resume, a SIGKILLed worker) must
//! not find its own bugs there. `DEVICE=cpu` rehearses that section here with CPU stages, where
//! every comparison must hold bit for bit.

mod common;

use common::fresh_dir;

#[test]
fn the_gpu_checks_pipeline_section_rehearses_on_cpu() {
    let out = fresh_dir("gpu-check");
    let status = std::process::Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/gpu-check.sh"))
        .arg("run")
        .env("BIN", env!("CARGO_BIN_EXE_seqpipe"))
        .env("DEVICE", "cpu")
        .env("SECTIONS", "4")
        .env("OUT", &out)
        .env("RUST_LOG", "warn")
        .status()
        .expect("bash runs");
    let whole = std::fs::read_to_string(out.join("report.txt")).expect("a report");
    assert!(status.success(), "gpu-check.sh failed:\n{whole}");
    // The machine section before it reports nvidia-smi and PyTorch, absent here.
    let report = &whole[whole.find("== 4.").expect("the pipeline section ran")..];
    for bad in [
        "FAILED",
        "DIFFER",
        "NONE",
        "NO RECOVERY",
        "WORSE THAN ITS BOUND",
        "Traceback",
    ] {
        assert!(!report.contains(bad), "{bad} in the report:\n{report}");
    }
    let identical = report
        .matches("tensors (weights and AdamW moments) bit-identical")
        .count();
    assert_eq!(identical, 3, "2 vs 4 stages, resume, chaos:\n{report}");
    assert!(
        report.contains("killed worker pid ")
            && report.contains("recovered at step ")
            && report.contains("bf16: done: step 60/60"),
        "{report}"
    );
    assert!(
        report.contains("step 1, 53 tensors, worst relative L2 0.00e+00"),
        "CPU stages against themselves:\n{report}"
    );
}
