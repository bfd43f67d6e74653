//! `scripts/gpu-check.sh run` runs on a lent GPU machine only now and then, for a few 10-minute
//! commands: its first pass must bring back a complete report whatever fails, and must not find
//! its own bugs there. These tests rehearse that pass here, end to end.
//!
//! What is real and what is stood in:
//! - real: the script itself (every step, its time limits, its report, the log archive), the
//!   `seqpipe` binary for everything that can run without a GPU, and the whole pipeline part with
//!   `DEVICE=cpu` (CPU stages: 2 vs 4 stages, stop + resume, a SIGKILLed worker, bf16), whose
//!   comparisons must hold bit for bit;
//! - stood in: `BIN` is a wrapper that records every command line and execs the real binary,
//!   except for three chosen commands: `gpu check --only attention` hangs (sleeps), the FP32
//!   gradient check of preset b exits 1, and the first GPT-2 bf16 determinism run prints a cut-off
//!   JSON line; in pass 2's profile step, `gpu bench --profile` prints a recorded profile (a table
//!   and its JSON line, with the keys `gpu::Profile` serializes, which the gpu crate's tests pin). `compute-sanitizer` is a stand-in on PATH that records its arguments, runs the
//!   program, and reports one memcheck error. PyTorch is made absent (a `torch.py` that raises
//!   ImportError), as on this machine. The other `gpu …` commands reach the real binary and fail
//!   honestly: there is no GPU here.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::fresh_dir;

/// The stand-ins the script runs: `bin/seqpipe` (the wrapper), `bin/compute-sanitizer`, and
/// `py/torch.py`. Both shell stand-ins append their command line to `calls`.
fn stand_ins(dir: &Path) {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(dir.join("py")).unwrap();
    let calls = dir.join("calls");
    let wrapper = format!(
        r#"#!/usr/bin/env bash
echo "${{SEQPIPE_ATTENTION:+SEQPIPE_ATTENTION=$SEQPIPE_ATTENTION }}seqpipe $*" >> '{calls}'
case "$*" in
  "gpu check --json --only attention") exec sleep 100000 ;;
  "gpu bench --preset b --precision fp32 --check --warmup 0 --steps 2")
    echo "stand-in failure of the preset b gradient check" >&2; exit 1 ;;
  "gpu bench --preset gpt2 --precision bf16 --warmup 0 --steps "*)
    if mkdir '{dir}/garbled' 2>/dev/null; then echo '{{"impl": "seqpipe", "losses": [10.9'; exit 0; fi ;;
  "gpu bench --preset gpt2 --precision bf16 --warmup 3 --steps 5 --profile --profile-steps 3"*)
    cat "{dir}/profile${{SEQPIPE_ATTENTION:+-$SEQPIPE_ATTENTION}}.out"; exit 0 ;;
esac
exec '{real}' "$@"
"#,
        calls = calls.display(),
        dir = dir.display(),
        real = env!("CARGO_BIN_EXE_seqpipe"),
    );
    let sanitizer = format!(
        r#"#!/usr/bin/env bash
echo "compute-sanitizer $*" >> '{calls}'
tool=memcheck log=/dev/null code=1
while [ $# -gt 0 ]; do
  case $1 in
    --tool) tool=$2; shift 2 ;;
    --error-exitcode) code=$2; shift 2 ;;
    --log-file) log=$2; shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
"$@"
rc=$?
if [ "$tool" = memcheck ]; then
  printf '========= COMPUTE-SANITIZER\n========= Invalid __global__ read of size 4 bytes\n=========     at attn_forward_d64+0x1a0\n=========\n========= ERROR SUMMARY: 1 error\n' > "$log"
  exit "$code"
fi
printf '========= COMPUTE-SANITIZER\n========= ERROR SUMMARY: 0 errors\n' > "$log"
exit "$rc"
"#,
        calls = calls.display(),
    );
    for (name, text) in [("seqpipe", wrapper), ("compute-sanitizer", sanitizer)] {
        let path = bin.join(name);
        std::fs::write(&path, text).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::write(dir.join("profile.out"), PROFILE_OUT).unwrap();
    std::fs::write(dir.join("profile-v1.out"), PROFILE_OUT).unwrap();
    // The v2 attention kernels' profile: dK/dV twice as fast.
    std::fs::write(
        dir.join("profile-v2.out"),
        PROFILE_OUT
            .replace("6.200", "3.100")
            .replace("6.2}", "3.1}")
            .replace("41.0,", "37.9,"),
    )
    .unwrap();
    std::fs::write(
        dir.join("py/torch.py"),
        "raise ImportError('PyTorch stands absent in this rehearsal')\n",
    )
    .unwrap();
}

/// What the stand-in `gpu bench --profile` prints: the table, then the report's JSON line (only
/// the keys the script reads, with `gpu::Profile`'s names).
const PROFILE_OUT: &str = "profile of 3 steps (8 x 1024 tokens, 1 micro-batches x 1 segments, median unprofiled step 58.400 ms):
category                                calls     gpu ms  % step    mean us    host ms
gemm mlp.c_fc fwd                          12      3.100    5.0%      258.3      0.060
attention bwd dk dv                        12      6.200   10.0%      516.7      0.040
per step (3 profiled, cuda events): wall 62.000 ms, gpu busy 41.000 ms, host gap 21.000 ms
{\"impl\": \"seqpipe (bf16 cached-weights)\", \"median_ms\": 58.4, \"profile\": {\"wall_ms\": 62.0, \"gpu_busy_ms\": 41.0, \"host_gap_ms\": 21.0, \"launches\": 1510.0, \"unknown_pct\": 0.0, \"categories\": [{\"category\": \"attention bwd dk dv\", \"gpu_ms\": 6.2}, {\"category\": \"gemm mlp.c_fc fwd\", \"gpu_ms\": 3.1}]}}
";

/// `gpu-check.sh run` (pass 1) with the stand-ins; extra environment on top. Returns the exit
/// code, the report, the recorded command lines and the wall time.
fn first_pass(dir: &Path, env: &[(&str, &str)]) -> (Option<i32>, String, String, Duration) {
    stand_ins(dir);
    let path = format!(
        "{}:{}",
        dir.join("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = std::process::Command::new("bash");
    cmd.arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/gpu-check.sh"))
        .arg("run")
        .env("PATH", path)
        .env("PYTHONPATH", dir.join("py"))
        .env("BIN", dir.join("bin/seqpipe"))
        .env("DEVICE", "cpu")
        .env("OUT", dir.join("out"))
        .env("WORK", dir.join("work"))
        .env("RAYON_NUM_THREADS", "1")
        .env("CANDLE_NUM_THREADS", "1")
        .env("RUST_LOG", "warn")
        .env_remove("PASS")
        .env_remove("SEQPIPE_ATTENTION")
        .env_remove("SECTIONS")
        .env_remove("LIMIT");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let status = cmd.status().expect("bash runs");
    let took = started.elapsed();
    let report = std::fs::read_to_string(dir.join("out/report.txt")).expect("a report");
    let calls = std::fs::read_to_string(dir.join("calls")).unwrap_or_default();
    (status.code(), report, calls, took)
}

/// The report's status line of step `name` (`ok`, `FAILED`, … then the name); panics unless there
/// is exactly one.
fn status_of<'a>(report: &'a str, name: &str) -> &'a str {
    let lines: Vec<&str> = report
        .lines()
        .filter(|l| {
            ["ok ", "FAILED ", "TIMED OUT ", "NOT RUN "]
                .iter()
                .any(|s| l.starts_with(s))
                && l.split_whitespace()
                    .find(|w| !["ok", "FAILED", "TIMED", "OUT", "NOT", "RUN"].contains(w))
                    .is_some_and(|w| w == name || w == format!("{name}:"))
        })
        .collect();
    assert_eq!(lines.len(), 1, "one status line for {name}:\n{report}");
    lines[0]
}

/// The steps of pass 1 in order, with DEVICE=cpu.
const PASS1_STEPS: &[&str] = &[
    "nvidia-smi",
    "torch",
    "gpu-info",
    "kernels",
    "kernels-memcheck",
    "kernels-racecheck",
    "grads-fp32-a",
    "grads-fp32-b",
    "grads-fp32-long",
    "grads-fp32-gpt2",
    "determinism-1",
    "determinism-2",
    "train-cpu4",
    "train-cuda4",
    "compare-grads-cuda4-cpu4",
    "compare-losses-cuda4-cpu4",
    "train-cpu4-docs",
    "train-cuda4-docs",
    "compare-grads-docs",
    "compare-losses-docs",
    "train-cpu4-part",
    "train-cuda4-part",
    "compare-grads-part",
    "compare-losses-part",
    "train-cuda2",
    "compare-losses-cuda2",
    "compare-state-cuda2",
    "train-cuda2-k2",
    "train-cuda-chunks",
    "compare-losses-chunks",
    "compare-state-chunks",
    "train-cuda-zb",
    "compare-losses-zb",
    "compare-state-zb",
    "train-cuda-split",
    "resume-cuda-split",
    "compare-losses-resume",
    "compare-state-resume",
    "train-calm",
    "train-chaos",
    "compare-losses-chaos",
    "compare-state-chaos",
    "train-chaos-chunks",
    "compare-losses-chaos-chunks",
    "compare-state-chaos-chunks",
    "train-chaos-zb",
    "compare-losses-chaos-zb",
    "compare-state-chaos-zb",
    "train-bf16",
    "bench-seqpipe-gpt2-r1",
    "torch-eager-gpt2-r1",
];

#[test]
fn the_first_pass_reports_a_failed_a_hung_and_a_garbled_command_and_runs_every_later_step() {
    let dir = fresh_dir("gpu-check");
    // The hung command gets 8 s; the pass's budget is generous for a busy 2-core machine (the
    // watchdog has its own test below).
    let (code, report, calls, _) = first_pass(
        &dir,
        &[("STEP_LIMITS", "kernels-racecheck=8"), ("BUDGET", "1500")],
    );
    // The script finished on its own, reporting failures by its exit code.
    assert_eq!(code, Some(1), "gpu-check.sh run:\n{report}");
    assert!(
        report.contains("== pass 1 done in "),
        "the closing line:\n{report}"
    );

    // The chosen failures, each named with its cause.
    let memcheck = status_of(&report, "kernels-memcheck");
    assert!(
        memcheck.starts_with("FAILED")
            && memcheck.contains("compute-sanitizer found errors")
            && memcheck.contains("Invalid __global__ read of size 4 bytes"),
        "{memcheck}"
    );
    let racecheck = status_of(&report, "kernels-racecheck");
    assert!(
        racecheck.starts_with("TIMED OUT") && racecheck.contains("limit of 8 s"),
        "{racecheck}"
    );
    let preset_b = status_of(&report, "grads-fp32-b");
    assert!(
        preset_b.starts_with("FAILED")
            && preset_b.contains("(exit 1 after")
            && preset_b.contains("stand-in failure of the preset b gradient check"),
        "{preset_b}"
    );
    let garbled = status_of(&report, "determinism-1");
    assert!(
        garbled.starts_with("FAILED") && garbled.contains("no JSON object"),
        "{garbled}"
    );
    let torch = status_of(&report, "torch");
    assert!(
        torch.starts_with("FAILED") && torch.contains("PyTorch not importable"),
        "{torch}"
    );
    assert!(
        status_of(&report, "torch-eager-gpt2-r1").contains("PyTorch not importable"),
        "{report}"
    );

    // Every step has its one status line, in order; the GPU commands fail here (no GPU), every
    // pipeline step passes.
    let mut at = 0;
    for name in PASS1_STEPS {
        let line = status_of(&report, name);
        let pos = report.find(line).unwrap();
        assert!(pos >= at, "{name} out of order:\n{report}");
        at = pos;
        if name.starts_with("train-") || name.starts_with("compare-") || name.starts_with("resume-")
        {
            assert!(line.starts_with("ok "), "{line}\n{report}");
        }
    }
    assert!(
        !report.lines().any(|l| l.starts_with("NOT RUN")) && report.contains(", 0 NOT RUN;"),
        "{report}"
    );

    // The script called the GPU commands with the expected arguments (the sanitizers' included).
    let lines: Vec<&str> = calls.lines().collect();
    let called = |prefix: &str, rest: &str| {
        lines
            .iter()
            .filter(|l| l.starts_with(prefix) && l.ends_with(rest))
            .count()
    };
    assert_eq!(called("seqpipe gpu info", ""), 1, "{calls}");
    // The bare kernel check, and the same under memcheck.
    let whole_check = lines
        .iter()
        .filter(|l| **l == "seqpipe gpu check --json")
        .count();
    assert_eq!(whole_check, 2, "{calls}");
    assert_eq!(
        called(
            "compute-sanitizer --tool memcheck --error-exitcode 86 --log-file ",
            "/bin/seqpipe gpu check --json"
        ),
        1,
        "{calls}"
    );
    assert_eq!(
        called(
            "compute-sanitizer --tool racecheck --error-exitcode 86 --log-file ",
            "/bin/seqpipe gpu check --json --only attention"
        ),
        1,
        "{calls}"
    );
    for preset in ["a", "b", "long", "gpt2 --batch 1"] {
        let line = format!(
            "seqpipe gpu bench --preset {preset} --precision fp32 --check --warmup 0 --steps 2"
        );
        assert_eq!(called(&line, ""), 1, "{line}:\n{calls}");
    }
    let determinism = "seqpipe gpu bench --preset gpt2 --precision bf16 --warmup 0 --steps 10";
    assert_eq!(called(determinism, ""), 2, "{calls}");
    let bench = "seqpipe gpu bench --preset gpt2 --precision bf16 --steps 10";
    assert_eq!(called(bench, ""), 1, "{calls}");
    // cpu4, cuda4, their masked pairs (cpu4-docs, cuda4-docs; cpu4-part, cuda4-part), cuda2,
    // cuda2-k2, cuda-chunks, cuda-zb, cuda-split, calm, chaos, chaos-chunks, chaos-zb, bf16.
    assert_eq!(called("seqpipe train -q ", ""), 16, "{calls}");
    assert_eq!(called("seqpipe resume -q ", ""), 1, "{calls}");

    // Only the report, the benchmark lines and the capped log archive come back in $OUT; the run
    // directories stay in the work dir.
    let mut out: Vec<String> = std::fs::read_dir(dir.join("out"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    out.sort();
    assert_eq!(out, ["logs.tar.gz", "report.txt", "runs.jsonl"]);
    let archive = std::fs::metadata(dir.join("out/logs.tar.gz"))
        .unwrap()
        .len();
    assert!(archive > 0 && archive <= 16_000_000, "{archive} bytes");
    assert!(dir.join("work/train/cuda4/checkpoints").is_dir());

    // The pipeline part, as the GPU will run it, with CPU stages: every comparison bit for bit.
    let start = report.find("== pipeline").expect("the pipeline part ran");
    let end = report[start..]
        .find("== bench")
        .expect("the bench part ran")
        + start;
    let pipeline = &report[start..end];
    for bad in [
        "FAILED",
        "DIFFER",
        "NONE",
        "NO RECOVERY",
        "WORSE THAN ITS BOUND",
        "Traceback",
    ] {
        assert!(!pipeline.contains(bad), "{bad} in the report:\n{pipeline}");
    }
    let identical = pipeline
        .matches("tensors (weights and AdamW moments) bit-identical")
        .count();
    assert_eq!(
        identical, 7,
        "2 vs 4 stages, chunks, zero-bubble, resume, chaos, chaos with chunks, chaos with split \
         backwards:\n{pipeline}"
    );
    assert!(
        pipeline.contains("killed worker pid ")
            && pipeline.contains("recovered at step ")
            && pipeline.contains("bf16: done: step 60/60"),
        "{pipeline}"
    );
    assert!(
        pipeline.contains("step 1, 53 tensors, worst relative L2 0.00e+00"),
        "CPU stages against themselves:\n{pipeline}"
    );
}

#[test]
fn the_watchdog_reports_the_steps_the_pass_has_no_time_for() {
    let dir = fresh_dir("gpu-check-watchdog");
    // 40 s of budget, 25 of them kept for the end: the hung racecheck runs into the pass's
    // deadline, and nothing after it has time left.
    let (code, report, _, took) = first_pass(&dir, &[("BUDGET", "40")]);
    assert_eq!(code, Some(1), "{report}");
    assert!(took < Duration::from_secs(90), "{took:?}:\n{report}");
    assert!(
        status_of(&report, "kernels-racecheck").starts_with("TIMED OUT"),
        "{report}"
    );
    let after = PASS1_STEPS
        .iter()
        .skip_while(|name| **name != "kernels-racecheck")
        .skip(1);
    for name in after {
        let line = status_of(&report, name);
        assert!(
            line.starts_with("NOT RUN") && line.contains("out of time"),
            "{line}\n{report}"
        );
    }
    assert!(report.contains("== pass 1 done in "), "{report}");
    assert!(
        dir.join("out/logs.tar.gz").is_file(),
        "the logs still archived"
    );
}

#[test]
fn the_profile_step_brings_back_each_table_and_its_summary() {
    let dir = fresh_dir("gpu-check-profile");
    let (code, report, calls, _) = first_pass(
        &dir,
        &[
            ("PASS", "2"),
            ("SECTIONS", "profile-gpt2"),
            ("BUDGET", "300"),
        ],
    );
    assert_eq!(code, Some(0), "{report}");
    for name in ["profile-gpt2", "profile-gpt2-pipeline"] {
        assert!(status_of(&report, name).starts_with("ok "), "{report}");
    }
    // Each run's table and its summary, read from the JSON line.
    assert_eq!(
        report.matches("   attention bwd dk dv ").count(),
        2,
        "{report}"
    );
    let summary = "summary: unprofiled median 58.40 ms/step; profiled wall 62.00 ms = gpu busy 41.00 + host gap 21.00 (34%); 1510 launches/step; unknown 0.0%; top: attention bwd dk dv 6.20 ms, gemm mlp.c_fc fwd 3.10 ms";
    assert_eq!(report.matches(summary).count(), 2, "{report}");
    // The whole batch, then the pipeline's shape.
    let profiled: Vec<&str> = calls.lines().filter(|l| l.contains("--profile")).collect();
    assert_eq!(
        profiled,
        [
            "seqpipe gpu bench --preset gpt2 --precision bf16 --warmup 3 --steps 5 --profile --profile-steps 3",
            "seqpipe gpu bench --preset gpt2 --precision bf16 --warmup 3 --steps 5 --profile --profile-steps 3 --batch 32 --micro-batches 8 --segments 4",
        ],
        "{calls}"
    );
}

#[test]
fn the_attention_step_profiles_both_kernel_versions_side_by_side() {
    let dir = fresh_dir("gpu-check-attention-v2");
    let (code, report, calls, _) = first_pass(
        &dir,
        &[
            ("PASS", "2"),
            ("SECTIONS", "attention-v2"),
            ("BUDGET", "300"),
        ],
    );
    assert_eq!(code, Some(0), "{report}");
    for shape in ["gpt2", "pipeline"] {
        for version in ["v1", "v2"] {
            let name = format!("attention-{version}-{shape}");
            assert!(status_of(&report, &name).starts_with("ok "), "{report}");
        }
    }
    // Each shape profiled with v1, then v2, the version passed in SEQPIPE_ATTENTION.
    let profile = "seqpipe gpu bench --preset gpt2 --precision bf16 --warmup 3 --steps 5 --profile --profile-steps 3";
    let pipeline = " --batch 32 --micro-batches 8 --segments 4";
    let profiled: Vec<&str> = calls.lines().filter(|l| l.contains("--profile")).collect();
    assert_eq!(
        profiled,
        [
            format!("SEQPIPE_ATTENTION=v1 {profile}"),
            format!("SEQPIPE_ATTENTION=v2 {profile}"),
            format!("SEQPIPE_ATTENTION=v1 {profile}{pipeline}"),
            format!("SEQPIPE_ATTENTION=v2 {profile}{pipeline}"),
        ],
        "{calls}"
    );
    // The attention categories side by side (the stand-in's v2 profile halves dK/dV), per shape.
    let table_row = |shape: &str, row: &str| {
        report
            .lines()
            .skip_while(|l| !l.contains(&format!("{shape} shape: ")))
            .take(4)
            .any(|l| {
                l.split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
                    .ends_with(row)
            })
    };
    for shape in ["gpt2", "pipeline"] {
        assert!(
            table_row(shape, "attention bwd dk dv 6.20 3.10 2.00x"),
            "{report}"
        );
        assert!(
            table_row(shape, "attention, all 6.20 3.10 2.00x"),
            "{report}"
        );
    }
    assert_eq!(
        report
            .matches("step median (unprofiled): v1 58.40 ms, v2 58.40 ms; profiled gpu busy: v1 41.00 ms, v2 37.90 ms")
            .count(),
        2,
        "{report}"
    );
}
