//! Helpers shared by the end-to-end tests: run the real `seqpipe` binary in a fresh directory.

#![allow(dead_code)]

pub mod disturbed;
pub mod emulated;
pub mod gradients;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};

use trainer::runtime::events::{Record, RunEvent};

/// A `seqpipe` command with one compute thread per process and quiet logs.
pub fn seqpipe() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_seqpipe"));
    cmd.env("RAYON_NUM_THREADS", "1")
        .env("CANDLE_NUM_THREADS", "1")
        .env("RUST_LOG", "warn");
    cmd
}

/// A fresh, empty directory under the target dir's tmp folder, unique per test and call.
pub fn fresh_dir(name: &str) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs the command and returns its output; panics with stderr if it failed.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("failed to start seqpipe");
    assert!(
        out.status.success(),
        "command {:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        cmd,
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs the command, which must fail cleanly (exit code 1, an `error:` line, no panic); returns stderr.
pub fn run_err(cmd: &mut Command) -> String {
    let out = cmd.output().expect("failed to start seqpipe");
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success(),
        "command {cmd:?} should have failed; stderr:\n{stderr}"
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected exit code 1 (error), got {:?}; stderr:\n{stderr}",
        out.status
    );
    assert!(
        !stderr.contains("panicked"),
        "the binary panicked:\n{stderr}"
    );
    assert!(stderr.contains("error:"), "no error message:\n{stderr}");
    stderr
}

/// Parses `metrics.jsonl`.
pub fn metrics(run_dir: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| serde_json::from_str(l).expect("valid JSON line"))
        .collect()
}

/// The lines of `metrics.jsonl`, typed; every line must be a step record or an event of
/// [`RunEvent`]'s vocabulary (the runtime writes nothing else).
pub fn records(run_dir: &Path) -> Vec<Record> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .map(|l| match Record::parse(l).expect("valid JSON line") {
            Record::Other(v) => panic!("neither a step record nor a known event: {v}"),
            r => r,
        })
        .collect()
}

/// The events of `metrics.jsonl`, in file order.
pub fn run_events(run_dir: &Path) -> Vec<RunEvent> {
    records(run_dir)
        .into_iter()
        .filter_map(|r| match r {
            Record::Event(e) => Some(e),
            _ => None,
        })
        .collect()
}

/// The steps of the committed checkpoints among `events`, in order.
pub fn checkpoint_steps<E: std::borrow::Borrow<RunEvent>>(events: &[E]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e.borrow() {
            RunEvent::Checkpoint(c) => Some(c.step),
            _ => None,
        })
        .collect()
}

/// The per-step losses of a run.
pub fn losses(run_dir: &Path) -> Vec<f64> {
    metrics(run_dir)
        .iter()
        .filter_map(|m| m.get("loss").and_then(|l| l.as_f64()))
        .collect()
}

/// `--set` arguments for a tiny model that trains in a fraction of a second per step.
pub fn tiny_model_args() -> Vec<String> {
    [
        "model.vocab_size=64",
        "model.layers=4",
        "model.d_model=32",
        "model.heads=4",
        "model.max_seq_len=48",
        "train.seq_len=48",
        "train.micro_batch_size=2",
        "train.eval_every=0",
    ]
    .iter()
    .flat_map(|s| ["--set".to_string(), s.to_string()])
    .collect()
}

/// `train` with the tiny model, eval off, checkpoints every 3 steps and a 12-step LR schedule
/// whatever `train.steps` says (so a run stopped anywhere and extended or resumed to N steps
/// matches one run to N), into `run_dir`; `extra` are more `--set` assignments.
pub fn resumable_train(run_dir: &Path, extra: &[&str]) -> Command {
    let mut cmd = seqpipe();
    cmd.args(["train", "-q"])
        .args(tiny_model_args())
        .args([
            "--set",
            "checkpoint.every=3",
            "--set",
            "train.decay_steps=12",
        ])
        .arg("--set")
        .arg(format!("run.dir={}", run_dir.display()));
    for s in extra {
        cmd.args(["--set", s]);
    }
    cmd
}

/// Every tensor (parameters and optimizer moments) of the newest committed checkpoint at `url`, as
/// raw bytes, with its step.
pub fn final_state(url: &str) -> (u64, BTreeMap<String, Vec<u8>>) {
    let store = checkpoint::CheckpointStore::open(url, &Default::default()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let step = *rt
        .block_on(store.committed_steps())
        .unwrap()
        .last()
        .expect("a committed checkpoint");
    let manifest = rt.block_on(store.read_manifest(step)).unwrap();
    let names: Vec<String> = manifest.tensor_names().map(String::from).collect();
    let tensors = rt.block_on(store.read_tensors(&manifest, &names)).unwrap();
    (
        step,
        tensors
            .into_iter()
            .map(|(n, d)| (n, d.data.to_vec()))
            .collect(),
    )
}

/// The settings (`section.key=value`) of the elastic tests' job: a model big enough that steps take
/// tens of milliseconds (so kills land mid-run), checkpoints every 2 steps, no evaluation.
pub fn elastic_job_sets(run_dir: &Path, steps: u64) -> Vec<String> {
    [
        "model.vocab_size=128",
        "model.layers=4",
        "model.d_model=64",
        "model.heads=4",
        "model.max_seq_len=64",
        "train.seq_len=64",
        "train.micro_batch_size=4",
        "train.eval_every=0",
        "checkpoint.every=2",
        "checkpoint.keep_last=2",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        format!("train.steps={steps}"),
        format!("run.dir={}", run_dir.display()),
    ])
    .collect()
}

/// `seqpipe train -q` of the elastic tests' job ([`elastic_job_sets`]).
pub fn elastic_job(run_dir: &Path, steps: u64) -> Command {
    let mut cmd = seqpipe();
    cmd.args(["train", "-q"]);
    for s in elastic_job_sets(run_dir, steps) {
        cmd.args(["--set", &s]);
    }
    cmd
}

/// Steps the run at `run_dir` has recorded so far (0 before its metrics file exists).
pub fn steps_done(run_dir: &Path) -> usize {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"loss\""))
        .count()
}

/// Waits until the run at `run_dir` has completed `steps` steps (at most a minute).
pub fn wait_for_steps(run_dir: &Path, steps: usize) {
    let started = std::time::Instant::now();
    while steps_done(run_dir) < steps {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the job did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// The pids of a process's children.
pub fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Asserts that the run at `run_dir` committed its final step `steps` and that its state (every
/// parameter and optimizer tensor) is bit-identical to `reference`.
pub fn assert_final_state(run_dir: &Path, steps: u64, reference: &BTreeMap<String, Vec<u8>>) {
    let (step, state) = final_state(&ckpt_url(run_dir));
    assert_eq!(step, steps);
    assert!(
        &state == reference,
        "{}: final state differs from the uninterrupted run",
        run_dir.display()
    );
}

/// The default checkpoint location of a run directory.
pub fn ckpt_url(run_dir: &Path) -> String {
    run_dir.join("checkpoints").display().to_string()
}

/// The TCP ports process `pid` listens on (its sockets in LISTEN state, from /proc).
pub fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: std::collections::BTreeSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            let t = target.display().to_string();
            t.strip_prefix("socket:[")
                .and_then(|s| s.strip_suffix(']'))
                .map(String::from)
        })
        .collect();
    let mut ports = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // local_address is HEX_IP:HEX_PORT, st 0A is LISTEN, inode is field 9.
            if fields.len() > 9
                && fields[3] == "0A"
                && inodes.contains(fields[9])
                && let Some(port) = fields[1]
                    .rsplit_once(':')
                    .and_then(|(_, p)| u16::from_str_radix(p, 16).ok())
            {
                ports.push(port);
            }
        }
    }
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// A loopback port that is free now and likely to stay free until a job binds it: picked at
/// random in 3000..10000, below both the kernel's ephemeral range (where the outgoing connections
/// and port-0 listeners of the tests running beside this one land: a port from there, released,
/// was once taken by a neighbour's socket before the job could bind it) and the range the
/// SeaweedFS fixture draws from (10000..32000). Checked by binding it.
pub fn free_port() -> u16 {
    static PICKS: AtomicUsize = AtomicUsize::new(0);
    const LOW: u32 = 3_000;
    const HIGH: u32 = 10_000;
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
        ^ std::process::id().rotate_left(16);
    for attempt in 0..256u32 {
        let pick = PICKS.fetch_add(1, Ordering::Relaxed) as u32;
        // A multiplicative hash spreads consecutive picks over the range.
        let mixed = seed
            .wrapping_add(pick.wrapping_mul(0x9E37_79B9))
            .wrapping_add(attempt)
            .wrapping_mul(0x85EB_CA6B);
        let port = (LOW + (mixed >> 8) % (HIGH - LOW)) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    // Every pick was taken (a crowded range): a port from the ephemeral range after all.
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// This process's effective user id, from /proc/self/status (`"0"` for root).
pub fn effective_uid() -> String {
    let status = std::fs::read_to_string("/proc/self/status").expect("reading /proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        .expect("a Uid line in /proc/self/status")
        .to_string()
}

/// The BLAKE3 hash of every named tensor (parameters and optimizer moments) of the newest committed
/// checkpoint of `run_dir`, and its step: checkpoints compared by tensor, whatever the shards.
pub fn tensor_hashes(run_dir: &Path) -> (u64, BTreeMap<String, String>) {
    let (step, state) = final_state(&ckpt_url(run_dir));
    let hashes = state
        .into_iter()
        .map(|(name, bytes)| {
            let hex = blake3::hash(&bytes).to_hex().to_string();
            (name, hex)
        })
        .collect();
    (step, hashes)
}

/// Asserts that two runs ended at the same step with the same tensors, bit for bit, moments
/// included.
pub fn assert_same_tensors(a: &Path, b: &Path) {
    let (step_a, ta) = tensor_hashes(a);
    let (step_b, tb) = tensor_hashes(b);
    assert_eq!(step_a, step_b, "final checkpoint steps differ");
    assert!(
        ta.keys().any(|n| n.starts_with("optim.m.")) && ta.contains_key("wte.weight"),
        "the state should hold every parameter and the moments: {:?}",
        ta.keys().collect::<Vec<_>>()
    );
    assert_eq!(
        ta.keys().collect::<Vec<_>>(),
        tb.keys().collect::<Vec<_>>(),
        "different tensor sets"
    );
    let differing: Vec<&String> = ta.keys().filter(|n| ta[*n] != tb[*n]).collect();
    assert!(
        differing.is_empty(),
        "{} and {} differ in {differing:?}",
        a.display(),
        b.display()
    );
}
