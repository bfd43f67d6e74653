//! The emulated-GPU end-to-end tests' tiny job (a `seqpipe` built with the `emulate-gpu` feature,
//! whose CUDA stages run `kernels.cu` on the CPU) and their comparisons: two runs bit-identical in
//! losses, validation losses and final tensors, or CUDA stages against CPU stages within the
//! bounds the two devices' rounding allows.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use trainer::runtime::events::RunEvent;
use trainer::runtime::recovery::Tier;

use super::steps_done;
use super::{children_of, ckpt_url, final_state, fresh_dir, metrics, run_events, run_ok, seqpipe};

/// Steps of every run: an evaluation and a checkpoint at the last.
pub const STEPS: u64 = 2;

/// Loss bound of the emulated CUDA stages against the CPU stages (relative), as in
/// `trainer/tests/emulated_cuda_stage.rs` (measured 6.95e-8 there over 5 steps; with `seq1f1b-i`
/// here, 2026-11-26: 2.7e-9 and 9.9e-9 at steps 1 and 2, 1.8e-9 for the validation loss after the
/// last update).
///
/// The final weights are not bounded element by element: AdamW's first updates move each element
/// by about ±lr whatever its gradient's size, so an element whose tiny gradient rounds to the
/// other sign on the other device lands 2·lr away (measured: 1.87e-4 relative L2 on the
/// zero-initialized `h.0.attn.c_attn.bias`). The losses of each step and the validation loss
/// after the last update, which read every weight, are bounded instead.
pub const LOSS_BOUND: f64 = 5e-7;

/// Plain `seq1f1b`.
pub const PLAIN: [&str; 2] = ["pipeline.schedule=seq1f1b", "pipeline.virtual_stages=1"];
/// `seq1f1b-zb`.
pub const ZERO_BUBBLE: [&str; 2] = ["pipeline.schedule=seq1f1b-zb", "pipeline.virtual_stages=1"];
/// `seq1f1b-i` with 2 chunks per worker.
pub const INTERLEAVED: [&str; 2] = ["pipeline.schedule=seq1f1b-i", "pipeline.virtual_stages=2"];

/// Compute actions per unit and worker of [`PLAIN`]: F and B.
pub const PLAIN_ACTIONS: u64 = 2;
/// Of [`ZERO_BUBBLE`]: F, I and W.
pub const ZB_ACTIONS: u64 = 3;
/// Of [`INTERLEAVED`]: F and B on each of the 2 chunks.
pub const INTERLEAVED_ACTIONS: u64 = 4;

/// The tiny model and its micro-batches, small enough for the emulated GPU (each kernel launch
/// runs its blocks' threads on the CPU): 2 micro-batches of 2 segments of 16 tokens, a 2-head
/// 32-wide model over 64 token ids. The jobs add their stages, layers and rows.
pub const TINY: [&str; 7] = [
    "pipeline.microbatches=2",
    "pipeline.splits=2",
    "model.vocab_size=64",
    "model.d_model=32",
    "model.heads=2",
    "model.max_seq_len=16",
    "train.seq_len=16",
];
/// CUDA stages over TCP, and over NCCL device links.
pub const CUDA_TCP: [&str; 2] = ["model.device=cuda", "pipeline.transport=tcp"];
pub const CUDA_NCCL: [&str; 2] = ["model.device=cuda", "pipeline.transport=nccl"];
/// CPU stages over TCP.
pub const CPU_TCP: [&str; 2] = ["model.device=cpu", "pipeline.transport=tcp"];
/// Packed synthetic documents, masks on.
pub const MASKS: [&str; 3] = [
    "data.synthetic_document_median=4",
    "data.synthetic_document_sigma=1.0",
    "data.document_mask=true",
];

/// The settings of `parts`, in order.
pub fn sets<'a>(parts: &[&[&'a str]]) -> Vec<&'a str> {
    parts.iter().flat_map(|p| p.iter().copied()).collect()
}

/// A tiny two-stage job (a step takes seconds on the emulated GPU: each kernel launch runs its
/// blocks' threads on the CPU): 4 layers (p·v = 2·2 virtual stages hold one each), 2 micro-batches
/// of 2 segments, an evaluation at the last step (the forward-only pass over the stages and their
/// links), a checkpoint at the end, mid-step recovery and peer snapshots off; `sets` on top.
pub fn train(name: &str, sets: &[&str]) -> PathBuf {
    let (dir, mut cmd) = job(name, sets);
    run_ok(&mut cmd);
    dir
}

/// The job of [`train`], not started, and its fresh run directory.
fn job(name: &str, sets: &[&str]) -> (PathBuf, Command) {
    let dir = fresh_dir(name);
    let mut cmd = seqpipe();
    cmd.args(["train", "-q"]);
    let common = [
        "pipeline.stages=2".to_string(),
        "model.layers=4".into(),
        "train.micro_batch_size=2".into(),
        format!("train.eval_every={STEPS}"),
        "train.eval_batches=2".into(),
        "elastic.mid_step=false".into(),
        "elastic.peer_snapshots=false".into(),
        format!("train.steps={STEPS}"),
        format!("run.dir={}", dir.display()),
    ];
    for s in TINY
        .into_iter()
        .chain(common.iter().map(String::as_str))
        .chain(sets.iter().copied())
    {
        cmd.args(["--set", s]);
    }
    (dir, cmd)
}

/// Mid-step recovery and the peer snapshots it loads a replacement's step-start state from.
pub const MID_STEP: [&str; 2] = ["elastic.mid_step=true", "elastic.peer_snapshots=true"];

/// Trains the job of [`train`] with `sets` (which turn [`MID_STEP`] on), SIGKILLing the worker
/// of `stage` in the middle of the last step, and asserts that it was replaced mid-step: no step
/// lost, and the units it had done redone. Returns the run directory.
///
/// The kill lands a third of the first step's time into the last step. The steps of the
/// emulated GPU take seconds (longer on a busy machine, which keeps the third inside the
/// step), and the first includes no start-up; by then the step-start snapshot the replacement
/// loads has long been copied.
pub fn train_killed_mid_step(name: &str, sets: &[&str], stage: usize) -> PathBuf {
    let (dir, mut cmd) = job(name, sets);
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("seqpipe starts");
    let started = Instant::now();
    while steps_done(&dir) < STEPS as usize - 1 {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "{name}: the job did not finish its first step"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "{name}: the job ended early"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(step_time(&dir, 1) / 3);
    let victim = worker_of(child.id(), stage).expect("the victim stage's worker");
    let killed = Command::new("kill")
        .args(["-KILL", &victim.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{name}: the job failed after its stage {stage} was killed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let recovered: Vec<_> = run_events(&dir)
        .into_iter()
        .filter_map(|e| match e {
            RunEvent::Recovered(r) => Some(r),
            _ => None,
        })
        .collect();
    eprintln!("{name}: {recovered:?}");
    assert!(
        matches!(
            &recovered[..],
            [r] if r.tier == Tier::MidStep
                && r.stage == Some(stage)
                && r.lost_steps == 0
                && r.step == STEPS
                && r.redone_units.is_some_and(|n| n > 0)
        ),
        "{name}: expected stage {stage} replaced mid-step in step {STEPS} after some of its \
         units, got {recovered:?}"
    );
    dir
}

/// The wall-clock time of step `step` of the run at `run_dir` (its `step_time_s`).
fn step_time(run_dir: &Path, step: u64) -> Duration {
    let record = metrics(run_dir)
        .into_iter()
        .find(|m| m.get("loss").is_some() && m["step"].as_u64() == Some(step))
        .unwrap_or_else(|| panic!("{}: no step {step}", run_dir.display()));
    Duration::from_secs_f64(record["step_time_s"].as_f64().expect("step_time_s"))
}

/// The pid of the worker process of `stage` under launcher `launcher` (launcher → agents →
/// workers; a worker's command line names its stage).
pub fn worker_of(launcher: u32, stage: usize) -> Option<u32> {
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

/// Per step: (loss, validation loss if evaluated, compute actions of all workers).
pub fn step_records(run_dir: &Path) -> Vec<(f64, Option<f64>, u64)> {
    let records: Vec<_> = metrics(run_dir)
        .iter()
        .filter(|m| m.get("loss").is_some())
        .map(|m| {
            (
                m["loss"].as_f64().expect("a loss"),
                m.get("val_loss").and_then(|x| x.as_f64()),
                m.get("units").and_then(|u| u.as_u64()).expect("units"),
            )
        })
        .collect();
    assert_eq!(records.len(), STEPS as usize, "{}", run_dir.display());
    assert!(
        records.last().unwrap().1.is_some(),
        "{}: no evaluation at the last step",
        run_dir.display()
    );
    records
}

/// The two runs' losses, validation losses and final checkpoints (every parameter and both AdamW
/// moments) are bit-identical, and their compute actions per step are in the ratio of `actions`,
/// each run's actions per unit and stage (`seq1f1b`: F and B, 2; `seq1f1b-zb`: F, I and W, 3;
/// `seq1f1b-i` with v = 2: each chunk's F and B, 4).
pub fn assert_bit_identical(a: &Path, b: &Path, actions: (u64, u64)) {
    let (ra, rb) = (step_records(a), step_records(b));
    for (step, (x, y)) in ra.iter().zip(&rb).enumerate() {
        assert_eq!(
            x.2 * actions.1,
            y.2 * actions.0,
            "step {}: actions scaled differ: {x:?} in {}, {y:?} in {}",
            step + 1,
            a.display(),
            b.display()
        );
    }
    assert_same_training(a, b);
}

/// The two runs' losses, validation losses and final checkpoints (every parameter and both AdamW
/// moments) are bit-identical (a run that redid units after a loss computed more actions).
pub fn assert_same_training(a: &Path, b: &Path) {
    let (ra, rb) = (step_records(a), step_records(b));
    for (step, (x, y)) in ra.iter().zip(&rb).enumerate() {
        assert_eq!(
            (x.0.to_bits(), x.1.map(f64::to_bits)),
            (y.0.to_bits(), y.1.map(f64::to_bits)),
            "step {}: (loss, val_loss) differ: {x:?} in {}, {y:?} in {}",
            step + 1,
            a.display(),
            b.display()
        );
    }
    assert_eq!(super::tensor_hashes(a).0, STEPS, "final checkpoint step");
    super::assert_same_tensors(a, b);
}

/// The CUDA stages' run `gpu` follows the CPU stages' run `cpu` of the same job: each step's loss
/// and the last validation loss within [`LOSS_BOUND`], and the final weights not bit-identical
/// (the CUDA stages did compute on their own).
pub fn assert_within_cpu_bounds(cpu: &Path, gpu: &Path) {
    let (rc, rg) = (step_records(cpu), step_records(gpu));
    for (step, (c, g)) in rc.iter().zip(&rg).enumerate() {
        let rel = ((c.0 - g.0) / c.0).abs();
        eprintln!(
            "step {}: loss {} on the CPU, {} on emulated CUDA ({rel:.2e})",
            step + 1,
            c.0,
            g.0
        );
        assert!(
            rel < LOSS_BOUND,
            "step {}: {rel:.2e} apart, over {LOSS_BOUND:.1e}",
            step + 1
        );
    }
    let (c, g) = (rc[rc.len() - 1].1.unwrap(), rg[rg.len() - 1].1.unwrap());
    let rel = ((c - g) / c).abs();
    eprintln!("validation loss {c} on the CPU, {g} on emulated CUDA ({rel:.2e})");
    assert!(rel < LOSS_BOUND, "validation loss {rel:.2e} apart");
    let (_, wc) = final_state(&ckpt_url(cpu));
    let (_, wg) = final_state(&ckpt_url(gpu));
    let (worst, name) = worst_weight(&wc, &wg);
    eprintln!("worst final weight difference {worst:.2e} ({name})");
    assert!(
        worst > 0.0,
        "bit-identical to the CPU: the units did not run on the CUDA stages"
    );
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The worst relative L2 difference among the parameters (not the moments) of two final states,
/// and its tensor.
fn worst_weight(a: &BTreeMap<String, Vec<u8>>, b: &BTreeMap<String, Vec<u8>>) -> (f64, String) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "different tensor sets"
    );
    let mut worst = (0.0f64, String::new());
    for name in a.keys().filter(|n| !n.starts_with("optim.")) {
        let (x, y) = (floats(&a[name]), floats(&b[name]));
        assert_eq!(x.len(), y.len(), "{name}");
        let num: f64 = x
            .iter()
            .zip(&y)
            .map(|(p, q)| (f64::from(*p) - f64::from(*q)).powi(2))
            .sum();
        let den: f64 = x.iter().map(|p| f64::from(*p).powi(2)).sum();
        let rel = (num / den.max(1e-30)).sqrt();
        if rel > worst.0 {
            worst = (rel, name.clone());
        }
    }
    worst
}
