//! Activation memory measured by the stages (`peak_activation_bytes` in `metrics.jsonl`) and
//! `train.memory_budget_bytes`, end to end: Seq1F1B with k = 4 keeps at most half of 1F1B's
//! activations on the first stage, and a budget between the two stops a 1F1B run with a clear
//! error (no recovery attempt) while the Seq1F1B run trains. With virtual stages the same holds
//! per worker, over its chunks together: `seq1f1b-i` against `1f1b-i`.

mod common;

use std::path::Path;

use common::{fresh_dir, metrics, run_err, run_ok, seqpipe};
use serde_json::Value;

const STAGES: usize = 4;
const STEPS: u64 = 2;

/// Two workers of two chunks each (`pipeline.virtual_stages = 2`) of the same 4-layer model: one
/// layer per virtual stage.
const WORKERS: usize = 2;

/// `(pipeline.stages, pipeline.virtual_stages)` of the plain runs and of the interleaved ones.
const PLAIN: (usize, usize) = (STAGES, 1);
const INTERLEAVED: (usize, usize) = (WORKERS, 2);

/// A run of a small 4-layer model on 256-token sequences over `(stages, virtual stages)` with
/// `schedule` and `splits`, 4 micro-batches, and a memory budget (0: none).
fn train_args(
    run_dir: &Path,
    (stages, virtual_stages): (usize, usize),
    schedule: &str,
    splits: usize,
    budget: u64,
) -> Vec<String> {
    [
        "model.vocab_size=64".to_string(),
        "model.layers=4".into(),
        "model.d_model=32".into(),
        "model.heads=2".into(),
        "model.max_seq_len=256".into(),
        "train.seq_len=256".into(),
        "train.micro_batch_size=2".into(),
        "train.eval_every=0".into(),
        format!("train.steps={STEPS}"),
        format!("train.memory_budget_bytes={budget}"),
        format!("pipeline.stages={stages}"),
        format!("pipeline.virtual_stages={virtual_stages}"),
        "pipeline.microbatches=4".into(),
        format!("pipeline.schedule={schedule}"),
        format!("pipeline.splits={splits}"),
        "pipeline.partition=uniform".into(),
        format!("run.dir={}", run_dir.display()),
    ]
    .into_iter()
    .flat_map(|s| ["--set".to_string(), s])
    .collect()
}

/// Per stage (per worker, with virtual stages) `(peak activation bytes, state bytes)` of every
/// step record of a run of `stages` workers.
fn memory(run_dir: &Path, stages: usize) -> Vec<Vec<(u64, u64)>> {
    let stage_values = |m: &Value, key: &str| -> Vec<u64> {
        m[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key} in {m}"))
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    metrics(run_dir)
        .iter()
        .filter(|m| m.get("loss").is_some())
        .map(|m| {
            let peaks = stage_values(m, "peak_activation_bytes");
            let state = stage_values(m, "state_bytes");
            assert_eq!(peaks.len(), stages, "{m}");
            assert_eq!(state.len(), stages, "{m}");
            peaks.into_iter().zip(state).collect()
        })
        .collect()
}

/// A schedule and its segments k, e.g. `("1f1b", 1)`.
type Kind<'a> = (&'a str, usize);

/// Per worker, `(peak activation bytes, state bytes)` of one step.
type Memory = Vec<(u64, u64)>;

/// Runs `one` and `seq` over `shape` without a budget, in `dir`, and returns their first steps'
/// per-worker `(peak activation bytes, state bytes)`, having checked that every step measures the
/// same (the same shapes each step) and that both hold the same state.
fn unbudgeted(dir: &Path, shape: (usize, usize), one: Kind, seq: Kind) -> (Memory, Memory) {
    let run = |(schedule, k): Kind| {
        let run_dir = dir.join(schedule);
        run_ok(
            seqpipe()
                .args(["train", "-q"])
                .args(train_args(&run_dir, shape, schedule, k, 0)),
        );
        let m = memory(&run_dir, shape.0);
        assert_eq!(m.len(), STEPS as usize, "{schedule}");
        assert_eq!(m[0], m[1], "{schedule}: every step measures the same");
        m[0].clone()
    };
    let (one, seq) = (run(one), run(seq));
    assert_eq!(
        one.iter().map(|s| s.1).collect::<Vec<_>>(),
        seq.iter().map(|s| s.1).collect::<Vec<_>>(),
        "the same model and partition: the same state on every worker"
    );
    (one, seq)
}

/// With `budget`, `one` stops with an error holding each of `wants` and no recovery attempt,
/// and `seq` trains with the same memory `seq_first` (its first step's) as without a budget.
fn budget_stops_one_not_seq(
    dir: &Path,
    shape: (usize, usize),
    (one, seq): (Kind, Kind),
    budget: u64,
    wants: &[&str],
    seq_first: &[(u64, u64)],
) {
    let stderr = run_err(seqpipe().args(["train", "-q"]).args(train_args(
        &dir.join(format!("{}-budget", one.0)),
        shape,
        one.0,
        one.1,
        budget,
    )));
    for want in wants {
        assert!(stderr.contains(want), "missing {want:?} in:\n{stderr}");
    }
    assert!(
        !stderr.contains("recover") && !stderr.contains("lost stage"),
        "an over-budget worker must stop the run, not trigger recovery:\n{stderr}"
    );
    let budget_dir = dir.join(format!("{}-budget", seq.0));
    run_ok(seqpipe().args(["train", "-q"]).args(train_args(
        &budget_dir,
        shape,
        seq.0,
        seq.1,
        budget,
    )));
    assert_eq!(memory(&budget_dir, shape.0)[0], seq_first);
}

#[test]
fn seq1f1b_fits_a_memory_budget_that_1f1b_exceeds() {
    let dir = fresh_dir("memory-budget");
    let kinds = (("1f1b", 1), ("seq1f1b", 4));
    let (one, seq) = unbudgeted(&dir, PLAIN, kinds.0, kinds.1);
    let (one, seq) = (&one, &seq);
    // 1F1B: stage r keeps p − r micro-batches in flight, so the first stage holds about p times
    // what the last one holds (which also keeps its head's gradients per unit).
    assert!(
        one[0].0 > 3 * one[STAGES - 1].0 && one[1].0 > one[2].0,
        "1F1B peaks {one:?}"
    );
    // Seq1F1B, k = 4: (k + p − 1)/k = 1.75 micro-batches instead of p = 4 on the first stage
    // (0.44×; the dK/dV of earlier segments come on top).
    let ratio = seq[0].0 as f64 / one[0].0 as f64;
    assert!(
        (0.40..=0.50).contains(&ratio),
        "stage-0 peak: seq1f1b {} vs 1f1b {} bytes ({ratio:.3})",
        seq[0].0,
        one[0].0
    );

    // A budget halfway between the two first stages' totals.
    let (state, one_total, seq_total) = (one[0].1, one[0].0 + one[0].1, seq[0].0 + seq[0].1);
    let budget = (one_total + seq_total) / 2;
    budget_stops_one_not_seq(
        &dir,
        PLAIN,
        kinds,
        budget,
        &[
            "stage 0: memory budget exceeded",
            &format!("parameters, gradients and AdamW moments {state} bytes"),
            &format!("train.memory_budget_bytes = {budget} bytes"),
            "pipeline.schedule = \"seq1f1b\"",
        ],
        seq,
    );
}

/// Virtual stages: a worker's chunks share one budget. Two workers of two chunks; `seq1f1b-i`
/// (k = 2) keeps less on the first worker than `1f1b-i`, and a budget between the two workers'
/// totals — the state of both chunks plus the activations they hold at once — stops the
/// `1f1b-i` run with the error naming the worker's chunks, while `seq1f1b-i` trains with the same
/// memory as without a budget. (That one chunk alone would fit where the worker does not is
/// `chunks.rs`'s unit test.)
#[test]
fn with_virtual_stages_a_workers_chunks_share_one_budget() {
    let dir = fresh_dir("memory-budget-chunks");
    let kinds = (("1f1b-i", 1), ("seq1f1b-i", 2));
    let (one, seq) = unbudgeted(&dir, INTERLEAVED, kinds.0, kinds.1);
    let (one, seq) = (&one, &seq);
    let (state, one_total, seq_total) = (one[0].1, one[0].0 + one[0].1, seq[0].0 + seq[0].1);
    assert!(
        seq_total < one_total,
        "worker 0: seq1f1b-i {seq:?} vs 1f1b-i {one:?} (activations, state)"
    );
    let budget = (one_total + seq_total) / 2;
    eprintln!(
        "worker 0, state {state} bytes: 1f1b-i {one_total} bytes, seq1f1b-i {seq_total} bytes in \
         all; budget {budget}"
    );
    budget_stops_one_not_seq(
        &dir,
        INTERLEAVED,
        kinds,
        budget,
        &[
            "stage 0: memory budget exceeded",
            "the worker's 2 virtual-stage chunks hold together",
            &format!("parameters, gradients and AdamW moments {state} bytes"),
            &format!("train.memory_budget_bytes = {budget} bytes"),
            "pipeline.schedule = \"seq1f1b-i\"",
        ],
        seq,
    );
}

#[test]
fn bench_schedule_measures_every_configuration() {
    let dir = fresh_dir("bench-schedule");
    let json = dir.join("runs.json");
    let out = run_ok(
        seqpipe()
            .args(["bench", "schedule", "--seq-lens", "128", "--schedules"])
            .args([
                "1f1b,seq1f1b",
                "--splits",
                "2,4",
                "--partitions",
                "uniform,compute",
            ])
            .args(["--set", "model.d_model=32", "--set", "model.vocab_size=64"])
            .arg("--json")
            .arg(&json),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let runs: Vec<Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("--json written")).unwrap();
    let configs: Vec<(String, u64, String)> = runs
        .iter()
        .map(|r| {
            (
                r["schedule"].as_str().unwrap().to_string(),
                r["splits"].as_u64().unwrap(),
                r["partition"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let want: Vec<(String, u64, String)> = [
        ("1f1b", 1, "uniform"),
        ("seq1f1b", 2, "uniform"),
        ("seq1f1b", 2, "compute"),
        ("seq1f1b", 4, "uniform"),
        ("seq1f1b", 4, "compute"),
    ]
    .iter()
    .map(|(s, k, p)| (s.to_string(), *k, p.to_string()))
    .collect();
    assert_eq!(configs, want);
    for r in &runs {
        let peaks = r["peak_activation_bytes"].as_array().unwrap();
        assert_eq!(peaks.len(), STAGES, "{r}");
        assert!(peaks.iter().all(|b| b.as_u64().unwrap() > 0), "{r}");
        let (bubble, formula) = (
            r["replayed_bubble"].as_f64().unwrap(),
            r["formula_bubble"].as_f64().unwrap(),
        );
        assert!(
            (0.0..1.0).contains(&bubble) && bubble > 0.5 * formula,
            "{r}"
        );
        assert!(r["replayed_step_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    for line in [
        "seq 128 m=4: stage-0 peak activations, seq1f1b k=4 compute / 1f1b = ",
        "attention cost γ fitted over 12 segments",
        "seq1f1b m=4 k=4 uniform seq 128: replayed bubble",
    ] {
        assert!(stdout.contains(line), "missing {line:?} in:\n{stdout}");
    }

    // With a budget that only Seq1F1B's first stage fits into, 1F1B's row says so.
    let one = &runs[0];
    let seq = &runs[3];
    let peak0 = |r: &Value| r["peak_activation_bytes"][0].as_u64().unwrap();
    let out = run_ok(
        seqpipe()
            .args(["bench", "schedule", "--seq-lens", "128", "--schedules"])
            .args(["1f1b,seq1f1b", "--splits", "4", "--partitions", "uniform"])
            .args(["--set", "model.d_model=32", "--set", "model.vocab_size=64"])
            .arg("--set")
            .arg(format!(
                "train.memory_budget_bytes={}",
                // Stage 0's state is far below the gap between the two peaks at this size.
                (peak0(one) + peak0(seq)) / 2 + 400_000
            )),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("1f1b  4  1   uniform    128 | does not fit train.memory_budget_bytes"),
        "{stdout}"
    );
    assert_eq!(
        stdout.matches("does not fit").count(),
        1,
        "only 1F1B is over the budget:\n{stdout}"
    );
}

/// A remote node whose machine cannot hold its stage: its agent estimates the stage's memory
/// against the machine's available memory before starting a worker, refuses, and the run stops at
/// once with the numbers and the node's name (without the check, the worker died in an
/// allocation abort that the coordinator took for a lost node, and recovered into the same abort
/// until `max_restarts` ran out).
#[test]
fn a_remote_node_too_small_for_its_stage_refuses_it_and_the_run_stops_with_the_numbers() {
    let dir = fresh_dir("node-too-small");
    let addr = format!("127.0.0.1:{}", common::free_port());
    let token = "node-memory-test";
    // One stage of about 0.5 TB by the estimate (16-byte state for each of its 3.3e10
    // parameters): more than any test machine has, far below the coordinator's own 1 PiB bound.
    let sets = [
        "model.vocab_size=1000000",
        "model.d_model=16384",
        "model.heads=128",
        "model.layers=1",
        "model.max_seq_len=16",
        "train.seq_len=16",
        "train.micro_batch_size=1",
        "train.eval_every=0",
        "train.steps=1",
        "pipeline.stages=1",
        "pipeline.microbatches=1",
        "pipeline.splits=1",
        "elastic.local_agents=false",
        "elastic.join_timeout_s=60",
    ];
    let mut train = seqpipe();
    train.args(["train", "-q"]);
    for s in sets {
        train.args(["--set", s]);
    }
    let run = dir.join("run");
    let coordinator = train
        .args(["--set", &format!("run.dir={}", run.display())])
        .args(["--set", &format!("elastic.listen={addr}")])
        .env("SEQPIPE_JOB_TOKEN", token)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let agent_dir = dir.join("agent");
    let mut agent = seqpipe()
        .args(["agent", "--join", &addr, "--name", "small-node"])
        .args(["--connect-timeout-s", "30", "--dir"])
        .arg(&agent_dir)
        .env("SEQPIPE_JOB_TOKEN", token)
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let out = coordinator.wait_with_output().unwrap();
    let _ = agent.kill();
    let agent_out = agent.wait_with_output().unwrap();
    let (stderr, agent_log) = (
        String::from_utf8_lossy(&out.stderr).to_string(),
        String::from_utf8_lossy(&agent_out.stderr).to_string(),
    );
    assert_eq!(out.status.code(), Some(1), "{stderr}\nagent:\n{agent_log}");
    for want in [
        "node small-node cannot run worker slot(s) [0]",
        "the model does not fit in memory",
        "this node's available memory (MemAvailable)",
        "model.vocab_size = 1000000",
        "model.d_model = 16384",
    ] {
        assert!(
            stderr.contains(want),
            "missing {want:?} in:\n{stderr}\nagent:\n{agent_log}"
        );
    }
    assert!(
        !stderr.contains("recover") && !stderr.contains("lost"),
        "a node too small must stop the run, not be recovered from:\n{stderr}"
    );
    assert!(
        agent_log.contains("refusing to start workers"),
        "agent:\n{agent_log}"
    );
    assert!(
        !agent_log.contains("worker started"),
        "the agent started a worker:\n{agent_log}"
    );
}
