//! The pipeline with device links between its CUDA stages (`pipeline.transport = "nccl"`),
//! rehearsed on the emulated GPU and its emulated NCCL link (a binary built with the
//! `emulate-gpu` feature): boundary tensors are kept on each stage's device and cross device to
//! device, one link per direction, with only their headers on the TCP links.
//!
//! A three-stage job over device links is SIGKILLed in the middle stage's worker in the middle of
//! a step: both neighbours' device links to it abort (their TCP links die, which trips them), the
//! stage is replaced mid-step, each neighbour joins a new device link to the replacement and sends
//! it again what it had sent from the buffers it kept on its device. The run must end with every
//! parameter and optimizer tensor bit-identical to the same job over TCP links, undisturbed.
//!
//! Run: `cargo test --release -p seqpipe --features emulate-gpu --test emulated_nccl_pipeline`
//! (scripts/test.sh does).
#![cfg(feature = "emulate-gpu")]

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::emulated::TINY;
use common::{assert_final_state, children_of, ckpt_url, final_state, fresh_dir, run_events};
use common::{run_ok, seqpipe, steps_done};
use trainer::runtime::events::RunEvent;
use trainer::runtime::recovery::Tier;

const STEPS: u64 = 2;

/// A three-stage job of CUDA stages on the [`TINY`] model (a step takes tens of seconds on the
/// emulated GPU: each kernel launch runs its blocks' threads on the CPU).
fn job(run_dir: &Path, transport: &str) -> Command {
    let mut cmd = seqpipe();
    cmd.args(["train", "-q"]);
    for s in TINY {
        cmd.args(["--set", s]);
    }
    let sets = [
        "model.device=cuda".to_string(),
        format!("pipeline.transport={transport}"),
        "pipeline.stages=3".into(),
        "model.layers=3".into(),
        "train.micro_batch_size=1".into(),
        "train.eval_every=0".into(),
        "elastic.mid_step=true".into(),
        format!("train.steps={STEPS}"),
        format!("run.dir={}", run_dir.display()),
    ];
    for s in sets {
        cmd.args(["--set", &s]);
    }
    cmd
}

/// The pid of the worker process of `stage` under launcher `launcher` (launcher → agents →
/// workers; a worker's command line names its stage).
fn worker_of(launcher: u32, stage: usize) -> Option<u32> {
    children_of(launcher)
        .into_iter()
        .flat_map(children_of)
        .find(|&pid| {
            let args = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = args.split(|&b| b == 0).collect();
            args.windows(2)
                .any(|w| w[0] == b"--stage" && w[1] == stage.to_string().as_bytes())
        })
}

#[test]
fn device_links_train_bit_identically_to_tcp_and_a_stage_sigkilled_mid_step_is_replaced() {
    let reference_dir = fresh_dir("nccl-reference");
    run_ok(&mut job(&reference_dir, "tcp"));
    let (_, reference) = final_state(&ckpt_url(&reference_dir));

    let dir = fresh_dir("nccl-chaos");
    let mut child = job(&dir, "nccl")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("seqpipe starts");
    let started = Instant::now();
    // The first step is done; the kill lands seconds into the second, whose units take tens of
    // seconds on the emulated GPU (longer on a busy machine, which only widens the window).
    while steps_done(&dir) < 1 {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "the job did not finish its first step"
        );
        assert!(child.try_wait().unwrap().is_none(), "the job ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_secs(3));
    let victim = worker_of(child.id(), 1).expect("stage 1's worker");
    let killed = Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the job failed after its stage 1 was killed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let recovered: Vec<_> = run_events(&dir)
        .into_iter()
        .filter_map(|e| match e {
            RunEvent::Recovered(r) => Some(r),
            _ => None,
        })
        .collect();
    assert!(
        recovered
            .iter()
            .any(|r| r.tier == Tier::MidStep && r.stage == Some(1) && r.lost_steps == 0),
        "expected stage 1 replaced mid-step, got {recovered:?}"
    );
    assert_final_state(&dir, STEPS, &reference);
}
