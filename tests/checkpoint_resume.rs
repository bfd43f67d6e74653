//! Checkpoints end to end with the real binary: bit-exact resume (also onto a different number of
//! stages), crash consistency under SIGKILL, corruption detection and fallback, SIGTERM, a real S3
//! server, and the Hugging Face export round trip.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use checkpoint::CheckpointStore;
use checkpoint::testing::SeaweedFs;
use common::resumable_train as train;
use common::{
    ckpt_url, final_state, fresh_dir, losses, metrics, run_err, run_events, run_ok, seqpipe,
    tiny_model_args,
};
use trainer::runtime::events::RunEvent;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn assert_same_state(a: &str, b: &str) {
    let (sa, ta) = final_state(a);
    let (sb, tb) = final_state(b);
    assert_eq!(sa, sb, "final checkpoint steps differ");
    assert_eq!(
        ta.keys().collect::<Vec<_>>(),
        tb.keys().collect::<Vec<_>>(),
        "different tensor sets"
    );
    assert!(
        ta.keys().any(|k| k.starts_with("optim.m."))
            && ta.keys().any(|k| k.starts_with("optim.v.")),
        "optimizer state missing"
    );
    for (name, bytes) in &ta {
        assert!(
            bytes == &tb[name],
            "tensor {name} differs between {a} and {b}"
        );
    }
}

#[test]
fn resume_is_bit_exact_even_onto_other_stage_counts() {
    let dir = fresh_dir("resume");
    let straight = dir.join("straight");
    run_ok(&mut train(&straight, &["train.steps=12"]));

    // 6 steps, stop, resume for 6 more (same pipeline).
    let split = dir.join("split");
    run_ok(&mut train(&split, &["train.steps=6"]));
    run_ok(
        seqpipe()
            .args(["resume", "-q"])
            .arg(&split)
            .args(["--set", "train.steps=12"]),
    );
    assert_eq!(
        losses(&straight),
        losses(&split),
        "per-step losses differ after resume"
    );
    assert_same_state(&ckpt_url(&straight), &ckpt_url(&split));

    // 4 stages -> 3 -> 2, resuming with `train --resume` and `resume --step`.
    let reshard = dir.join("reshard");
    run_ok(&mut train(
        &reshard,
        &["train.steps=4", "pipeline.stages=4", "checkpoint.every=2"],
    ));
    run_ok(
        train(
            &reshard,
            &["train.steps=8", "pipeline.stages=3", "checkpoint.every=2"],
        )
        .args(["--resume", "latest"]),
    );
    run_ok(
        seqpipe()
            .args(["resume", "-q", "--step", "8"])
            .arg(&reshard)
            .args(["--set", "train.steps=12", "--set", "pipeline.stages=2"]),
    );
    assert_eq!(
        losses(&straight),
        losses(&reshard),
        "per-step losses differ after resharding"
    );
    assert_same_state(&ckpt_url(&straight), &ckpt_url(&reshard));
    let resumed: Vec<u64> = run_events(&reshard)
        .iter()
        .filter_map(|e| match e {
            RunEvent::Resumed(r) => Some(r.step),
            _ => None,
        })
        .collect();
    assert_eq!(resumed, vec![4, 8]);
}

/// Pids of the direct children of `pid`.
fn children(pid: u32) -> Vec<u32> {
    let text =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    text.split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigkill_during_upload_leaves_no_half_checkpoint() {
    let dir = fresh_dir("crash");
    let run = dir.join("run");
    // Uploads throttled to ~100 KB/s per worker: each ~190 KB shard takes about two seconds.
    let child = train(
        &run,
        &[
            "train.steps=6",
            "checkpoint.max_upload_bytes_per_s=100000",
            // No elastic recovery: this test is about what a crash leaves in the store.
            "elastic.max_restarts=0",
        ],
    )
    .spawn()
    .unwrap();
    let url = ckpt_url(&run);
    let store = CheckpointStore::open(&url, &Default::default()).unwrap();
    let rt = rt();
    wait_for("checkpoint 3 to commit", Duration::from_secs(60), || {
        rt.block_on(store.committed_steps()).unwrap_or_default() == vec![3]
    });
    wait_for("step 6 to finish", Duration::from_secs(60), || {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap_or_default()
            .contains("\"step\":6,")
    });
    // The final checkpoint (step 6) is uploading now: kill one worker in the middle of it.
    let workers = children(child.id());
    assert_eq!(workers.len(), 4, "expected 4 worker processes");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        rt.block_on(store.committed_steps()).unwrap(),
        vec![3],
        "step 6 committed before the kill: upload too fast for this test"
    );
    let status = Command::new("kill")
        .args(["-KILL", &workers[2].to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    assert!(
        !out.status.success(),
        "the run must fail when a worker is killed"
    );
    // No visible half checkpoint: step 6 is not committed, and readers see only step 3.
    let listing = rt.block_on(store.list()).unwrap();
    assert!(
        listing.iter().all(|s| s.step != 6 || !s.committed),
        "{:?}",
        listing
            .iter()
            .map(|s| (s.step, s.committed))
            .collect::<Vec<_>>()
    );
    assert_eq!(rt.block_on(store.committed_steps()).unwrap(), vec![3]);
    // The killed uploads left staging files (`<shard>#<n>`), which listing does not show.
    let staging = |dir: &Path| -> Vec<String> {
        tree(dir)
            .into_keys()
            .filter(|k| {
                k.rsplit_once('#')
                    .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
            .collect()
    };
    let store_dir = run.join("checkpoints");
    assert!(
        !staging(&store_dir).is_empty(),
        "no staging files of the killed uploads: {:?}",
        tree(&store_dir).keys().collect::<Vec<_>>()
    );
    let list = String::from_utf8(run_ok(seqpipe().args(["ckpt", "list", &url])).stdout).unwrap();
    assert!(
        list.contains("committed")
            && !list
                .lines()
                .any(|l| l.contains(" 6 ") && l.ends_with(" committed")),
        "{list}"
    );
    // Resume uses step 3 and reaches the uninterrupted run's exact state.
    let out = run_ok(
        seqpipe()
            .args(["resume", "-q"])
            .arg(&run)
            .args(["--set", "checkpoint.max_upload_bytes_per_s=0"]),
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("resumed from step 3"));
    let straight = dir.join("straight");
    run_ok(&mut train(&straight, &["train.steps=6"]));
    assert_same_state(&ckpt_url(&straight), &url);
    // The staging files of the killed uploads went when the resumed run started, the stale
    // upload of the killed attempt after the next commit.
    assert_eq!(staging(&store_dir), Vec::<String>::new());
    let stale = rt.block_on(store.list()).unwrap();
    assert!(
        stale.iter().all(|s| s.committed),
        "stale uploads left: {:?}",
        stale
            .iter()
            .map(|s| (s.step, s.committed))
            .collect::<Vec<_>>()
    );
}

/// Flips one byte in the middle of the first shard of checkpoint `step`.
fn flip_byte(url: &str, step: u64) -> String {
    let store = CheckpointStore::open(url, &Default::default()).unwrap();
    let manifest = rt().block_on(store.read_manifest(step)).unwrap();
    let shard = &manifest.shards[0];
    let path = Path::new(url).join(&shard.key);
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    shard.key.clone()
}

#[test]
fn corrupt_shard_is_caught_by_verify_and_resume_falls_back() {
    let dir = fresh_dir("corrupt");
    let run = dir.join("run");
    run_ok(&mut train(&run, &["train.steps=6"]));
    let url = ckpt_url(&run);
    run_ok(seqpipe().args(["ckpt", "verify", &url]));
    let key = flip_byte(&url, 6);
    let err = run_err(seqpipe().args(["ckpt", "verify", &url]));
    assert!(
        err.contains(&key),
        "verify must name the corrupt shard {key}:\n{err}"
    );
    // Without fallback: an error naming the shard.
    let err = run_err(seqpipe().args(["resume", "-q"]).arg(&run).args([
        "--set",
        "train.steps=9",
        "--set",
        "checkpoint.fallback=false",
    ]));
    assert!(err.contains(&key) || err.contains("corrupt"), "{err}");
    // With fallback (the default): a warning, and training continues from step 3.
    let out = run_ok(seqpipe().args(["resume", "-q"]).arg(&run).args([
        "--set",
        "train.steps=9",
        "--set",
        "checkpoint.fallback=true",
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning")
            && stderr.contains("corrupt")
            && stderr.contains("resumed from step 3"),
        "{stderr}"
    );
    let steps: Vec<u64> = metrics(&run)
        .iter()
        .filter(|m| m.get("loss").is_some())
        .map(|m| m["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=9).collect::<Vec<_>>());
}

/// The manifest file of checkpoint `step` in the local store at `url`.
fn manifest_path(url: &str, step: u64) -> std::path::PathBuf {
    Path::new(url)
        .join(checkpoint::step_dir(step))
        .join("manifest.json")
}

/// Cuts the manifest of checkpoint `step` in half, as a crash or a full disk would.
fn truncate_manifest(url: &str, step: u64) {
    let path = manifest_path(url, step);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
}

/// A damaged manifest is a fallback case like a corrupt shard: a truncated newest manifest, and
/// one whose step disagrees with its directory, make `resume` fall back to the previous
/// committed checkpoint (with a warning) and finish in the same state as an uninterrupted run;
/// with `checkpoint.fallback = false` the error names the manifest. `resume URL` reads the run's
/// config from the newest readable manifest.
#[test]
fn damaged_manifest_falls_back_to_the_previous_checkpoint() {
    let dir = fresh_dir("manifest");
    let straight = dir.join("straight");
    run_ok(&mut train(&straight, &["train.steps=9"]));
    let resumed_from_3 = |stderr: &str| {
        assert!(
            stderr.contains("warning")
                && stderr.contains("falling back")
                && stderr.contains("resumed from step 3"),
            "{stderr}"
        );
    };

    // A truncated manifest.
    let run = dir.join("truncated");
    run_ok(&mut train(&run, &["train.steps=6"]));
    let url = ckpt_url(&run);
    truncate_manifest(&url, 6);
    let err = run_err(seqpipe().args(["resume", "-q"]).arg(&run).args([
        "--set",
        "train.steps=9",
        "--set",
        "checkpoint.fallback=false",
    ]));
    assert!(err.contains("step-00000006/manifest.json"), "{err}");
    // (The failed resume wrote fallback = false into the run's config.resolved.toml.)
    let out = run_ok(seqpipe().args(["resume", "-q"]).arg(&run).args([
        "--set",
        "train.steps=9",
        "--set",
        "checkpoint.fallback=true",
    ]));
    resumed_from_3(&String::from_utf8_lossy(&out.stderr));
    assert_eq!(losses(&straight), losses(&run));
    assert_same_state(&ckpt_url(&straight), &url);

    // A manifest that records another step than its directory's (step 3's, copied into step 6).
    let run = dir.join("moved");
    run_ok(&mut train(&run, &["train.steps=6"]));
    let url = ckpt_url(&run);
    std::fs::copy(manifest_path(&url, 3), manifest_path(&url, 6)).unwrap();
    let out = run_ok(
        seqpipe()
            .args(["resume", "-q"])
            .arg(&run)
            .args(["--set", "train.steps=9"]),
    );
    resumed_from_3(&String::from_utf8_lossy(&out.stderr));
    assert_same_state(&ckpt_url(&straight), &url);

    // `resume URL` with a truncated newest manifest: the config comes from step 3's.
    let run = dir.join("by-url");
    run_ok(&mut train(&run, &["train.steps=6"]));
    let url = ckpt_url(&run);
    truncate_manifest(&url, 6);
    let out = run_ok(seqpipe().args(["resume", "-q", &url]).args([
        "--set",
        "train.steps=9",
        "--set",
        &format!("run.dir={}", dir.join("by-url-resumed").display()),
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("manifest of checkpoint 6") && stderr.contains("unreadable"),
        "{stderr}"
    );
    resumed_from_3(&stderr);
    assert_same_state(&ckpt_url(&straight), &url);
}

/// `resume URL` takes the model and training keys from the checkpoint's stored config but never
/// its output locations: the run directory recorded there (another run's) is left untouched, the
/// outputs go to the local default, and the command says which stored keys it applied and which
/// it ignored.
#[test]
fn resume_from_a_url_keeps_output_locations_local() {
    let dir = fresh_dir("foreign");
    let origin = dir.join("origin");
    let store = dir.join("store").display().to_string();
    run_ok(&mut train(
        &origin,
        &["train.steps=3", &format!("checkpoint.url={store}")],
    ));
    let before = tree(&origin);
    assert!(before.contains_key("metrics.jsonl"));
    let cwd = dir.join("cwd");
    std::fs::create_dir_all(&cwd).unwrap();
    let out = run_ok(seqpipe().current_dir(&cwd).args([
        "resume",
        "-q",
        &store,
        "--set",
        "train.steps=6",
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("stored keys applied")
            && stderr.contains("model.d_model")
            && stderr.contains("run.dir (stored:"),
        "{stderr}"
    );
    assert!(
        before == tree(&origin),
        "resume wrote into the run directory named by the checkpoint"
    );
    // Steps 4 to 6 (the first three are the origin run's).
    assert_eq!(losses(&cwd.join("runs/latest")).len(), 3);
    assert_eq!(final_state(&store).0, 6);
}

#[test]
fn sigterm_writes_a_final_checkpoint_then_resume_finishes_the_run() {
    let dir = fresh_dir("sigterm");
    let run = dir.join("run");
    let mut child = train(&run, &["train.steps=400", "checkpoint.every=0"])
        .spawn()
        .unwrap();
    wait_for("a few steps", Duration::from_secs(60), || {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap_or_default()
            .lines()
            .count()
            >= 3
    });
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + 15), "SIGTERM exit status");
    let (step, _) = final_state(&ckpt_url(&run));
    assert!((3..400).contains(&step), "final checkpoint at step {step}");
    assert_eq!(
        losses(&run).len() as u64,
        step,
        "metrics end at the checkpointed step"
    );
    run_ok(
        seqpipe()
            .args(["resume", "-q"])
            .arg(&run)
            .args(["--set", &format!("train.steps={}", step + 2)]),
    );
    assert_eq!(losses(&run).len() as u64, step + 2);
}

/// SIGTERM while a long evaluation runs (one that would take minutes): the evaluation is
/// abandoned, the final checkpoint committed and the launcher gone within `checkpoint.grace_s`
/// (3 s) plus a margin for a busy machine, far short of the evaluation; the resumed run ends
/// bit-identical to an undisturbed one.
#[test]
fn sigterm_during_a_long_evaluation_stops_within_the_grace_period() {
    let dir = fresh_dir("sigterm-eval");
    let (run, reference) = (dir.join("run"), dir.join("reference"));
    run_ok(&mut train(&reference, &["train.steps=4"]));
    let mut child = train(
        &run,
        &[
            "train.steps=4",
            "train.eval_every=2",
            "train.eval_batches=200000",
            "checkpoint.grace_s=3",
        ],
    )
    .spawn()
    .unwrap();
    wait_for("step 1", Duration::from_secs(120), || {
        common::steps_done(&run) >= 1
    });
    // Step 2 takes milliseconds; its evaluation minutes.
    std::thread::sleep(Duration::from_secs(3));
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let signalled = Instant::now();
    let bound = Duration::from_secs(3 + 5);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if signalled.elapsed() > bound {
            let _ = child.kill();
            let _ = child.wait();
            panic!("still running {bound:?} after SIGTERM with checkpoint.grace_s = 3");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(128 + 15), "SIGTERM exit status");
    let records = metrics(&run);
    let step2 = records
        .iter()
        .find(|m| m.get("step").and_then(|s| s.as_u64()) == Some(2) && m.get("loss").is_some())
        .unwrap_or_else(|| panic!("no record of step 2: {records:?}"));
    assert!(
        step2.get("val_loss").is_none_or(|v| v.is_null()),
        "the evaluation finished: {step2}"
    );
    assert_eq!(final_state(&ckpt_url(&run)).0, 2, "final checkpoint");
    run_ok(
        seqpipe()
            .args(["resume", "-q"])
            .arg(&run)
            .args(["--set", "train.eval_every=0"]),
    );
    assert_same_state(&ckpt_url(&run), &ckpt_url(&reference));
}

#[test]
fn s3_checkpoints_on_a_real_seaweedfs_server() {
    let s3 = SeaweedFs::start();
    let dir = fresh_dir("s3");
    let url = s3.url("runs/tiny");
    let with_s3 = |cmd: &mut Command| {
        cmd.envs(s3.env());
    };
    let run = dir.join("run");
    let mut first = train(&run, &["train.steps=6", &format!("checkpoint.url={url}")]);
    with_s3(&mut first);
    run_ok(&mut first);
    let mut resume = seqpipe();
    resume.args([
        "resume",
        "-q",
        &url,
        "--set",
        "train.steps=9",
        "--set",
        "pipeline.stages=2",
    ]);
    // Output locations come from the command line, never from the checkpoint's stored config.
    resume
        .arg("--set")
        .arg(format!("run.dir={}", dir.join("resumed").display()));
    with_s3(&mut resume);
    run_ok(&mut resume);
    let mut list = seqpipe();
    list.args(["ckpt", "list", &url]);
    with_s3(&mut list);
    let listing = String::from_utf8(run_ok(&mut list).stdout).unwrap();
    assert!(
        listing.contains("       9 ") && listing.contains("committed"),
        "{listing}"
    );
    let mut verify = seqpipe();
    verify.args(["ckpt", "verify", &url]);
    with_s3(&mut verify);
    run_ok(&mut verify);
    // The same 9 steps on local disk give bit-identical state.
    let local = dir.join("local");
    run_ok(&mut train(&local, &["train.steps=9"]));
    let store_opts = s3.store_options();
    let store = CheckpointStore::open(&url, &store_opts).unwrap();
    let rt = rt();
    let manifest = rt.block_on(store.read_manifest(9)).unwrap();
    let names: Vec<String> = manifest.tensor_names().map(String::from).collect();
    let remote: BTreeMap<String, Vec<u8>> = rt
        .block_on(store.read_tensors(&manifest, &names))
        .unwrap()
        .into_iter()
        .map(|(n, d)| (n, d.data.to_vec()))
        .collect();
    let (_, local_state) = final_state(&ckpt_url(&local));
    assert_eq!(
        remote, local_state,
        "S3-resumed state differs from the local run"
    );
}

#[test]
fn hf_export_round_trips_through_init_from() {
    let dir = fresh_dir("hf");
    let run = dir.join("run");
    run_ok(&mut train(&run, &["train.steps=3"]));
    let url = ckpt_url(&run);
    let out = dir.join("hf");
    run_ok(
        seqpipe()
            .args(["ckpt", "export", &url, "--format", "hf-gpt2", "--out"])
            .arg(&out),
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(config["n_layer"], 4);
    let eval = |extra: &[&str]| -> f64 {
        let out = run_ok(
            seqpipe()
                .args(["eval"])
                .args(tiny_model_args())
                .args(["--set", "train.eval_batches=2"])
                .arg("--set")
                .arg(format!("run.dir={}", run.display()))
                .args(extra),
        );
        let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        line["val_loss"].as_f64().unwrap()
    };
    let from_checkpoint = eval(&["--resume", "latest"]);
    let from_hf = eval(&["--init-from", out.to_str().unwrap()]);
    let fresh = eval(&[]);
    assert_eq!(
        from_checkpoint.to_bits(),
        from_hf.to_bits(),
        "exported weights give another loss: {from_checkpoint} vs {from_hf}"
    );
    assert_ne!(from_checkpoint, fresh);
    // A mismatched model is refused with the field named.
    let err = run_err(
        seqpipe()
            .args(["eval"])
            .args(tiny_model_args())
            .args([
                "--set",
                "model.layers=2",
                "--set",
                "pipeline.stages=2",
                "--init-from",
                out.to_str().unwrap(),
            ])
            .arg("--set")
            .arg(format!("run.dir={}", dir.join("bad").display())),
    );
    assert!(err.contains("n_layer"), "{err}");
}

#[test]
fn ckpt_show_describes_the_checkpoint() {
    let dir = fresh_dir("show");
    let run = dir.join("run");
    run_ok(&mut train(&run, &["train.steps=3", "pipeline.stages=2"]));
    let out = String::from_utf8(run_ok(seqpipe().args(["ckpt", "show", &ckpt_url(&run)])).stdout)
        .unwrap();
    for needle in [
        "step 3",
        "topology: 2 stages",
        "h.3.attn.c_attn.weight",
        "optim.m.wte.weight",
        "stage-1-of-2",
    ] {
        assert!(out.contains(needle), "`{needle}` missing from:\n{out}");
    }
    let err = run_err(seqpipe().args(["ckpt", "show", &ckpt_url(&run), "--step", "2"]));
    assert!(err.contains("step 2") && err.contains("[3]"), "{err}");
}

/// Every file under `dir` (relative path → bytes).
fn tree(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let rel = path.strip_prefix(dir).unwrap().display().to_string();
                out.insert(rel, std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

/// Read-only commands never change a checkpoint store: `eval` with fresh weights, from an older
/// checkpoint and from the newest, and every `ckpt` inspection leave it byte-identical (today's
/// bug: eval ran the training-start cleanup and deleted committed checkpoints); `ckpt verify` of
/// a missing directory is an error that does not create it; `train` refuses a read-only store.
#[test]
fn read_only_commands_leave_the_store_byte_identical() {
    let dir = fresh_dir("readonly");
    let run = dir.join("run");
    run_ok(&mut train(
        &run,
        &["train.steps=9", "checkpoint.keep_last=3"],
    ));
    let url = ckpt_url(&run);
    let store_dir = run.join("checkpoints");
    let before = tree(&store_dir);
    assert!(
        before
            .keys()
            .any(|k| k.starts_with("step-3") || k.contains("00003")),
        "expected checkpoints 3, 6 and 9: {:?}",
        before.keys().collect::<Vec<_>>()
    );
    let eval = |extra: &[&str]| {
        run_ok(
            seqpipe()
                .args(["eval"])
                .args(tiny_model_args())
                .args([
                    "--set",
                    "train.eval_batches=1",
                    "--set",
                    "checkpoint.every=3",
                ])
                .arg("--set")
                .arg(format!("run.dir={}", run.display()))
                .args(extra),
        );
    };
    eval(&[]);
    eval(&["--resume", "3"]);
    eval(&["--resume", "latest"]);
    for args in [
        vec!["list"],
        vec!["show"],
        vec!["verify"],
        vec!["show", "--step", "3"],
    ] {
        run_ok(seqpipe().arg("ckpt").args(&args).arg(&url));
    }
    let after = tree(&store_dir);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>(),
        "a read-only command added or removed objects"
    );
    assert!(before == after, "a read-only command changed an object");
    let missing = dir.join("no-such-store");
    let err = run_err(seqpipe().args(["ckpt", "verify"]).arg(&missing));
    assert!(err.contains("no-such-store"), "{err}");
    assert!(
        !missing.exists(),
        "ckpt verify created {}",
        missing.display()
    );
    let err = run_err(&mut train(&run, &["checkpoint.read_only=true"]));
    assert!(err.contains("checkpoint.read_only"), "{err}");
}

/// A change made to a manifest's JSON.
type ManifestEdit = Box<dyn Fn(&mut serde_json::Value)>;

/// Rewrites the manifest of checkpoint `step` at `url` (a local store) with `edit`.
fn edit_manifest(url: &str, step: u64, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = Path::new(url)
        .join(format!("step-{step:08}"))
        .join("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut manifest);
    std::fs::write(&path, serde_json::to_vec(&manifest).unwrap()).unwrap();
}

/// The manifest's entry of tensor `name`.
fn tensor_entry<'a>(manifest: &'a mut serde_json::Value, name: &str) -> &'a mut serde_json::Value {
    manifest["shards"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .flat_map(|shard| shard["tensors"].as_array_mut().unwrap().iter_mut())
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("no tensor {name} in the manifest"))
}

/// `ckpt verify`, `show` and `export` make the check resume makes: a checkpoint whose `wte` is
/// stored transposed (same bytes, every hash right) or that lacks a tensor is one the model cannot
/// load. `verify` exits 1 naming the tensor with the expected and found shapes, `export` refuses
/// (writing nothing), `show` marks it. They used to pass all three.
#[test]
fn ckpt_verify_show_and_export_refuse_a_checkpoint_the_model_cannot_load() {
    let dir = fresh_dir("modelcheck");
    let run = dir.join("run");
    run_ok(&mut train(&run, &["train.steps=3"]));
    let url = ckpt_url(&run);
    let ok = String::from_utf8(run_ok(seqpipe().args(["ckpt", "verify", &url])).stdout).unwrap();
    assert!(ok.contains("ok: step 3"), "{ok}");
    let pristine = Path::new(&url).join("step-00000003").join("manifest.json");
    let original = std::fs::read(&pristine).unwrap();
    // (vocab_size, d_model) = (64, 32) in the tiny model.
    let cases: [(&str, ManifestEdit, &[&str]); 3] = [
        (
            "transposed wte",
            Box::new(|m| tensor_entry(m, "wte.weight")["shape"] = serde_json::json!([32, 64])),
            &["`wte.weight` has shape [32, 64], the model expects [64, 32]"],
        ),
        (
            "missing tensor",
            Box::new(|m| {
                for shard in m["shards"].as_array_mut().unwrap() {
                    shard["tensors"]
                        .as_array_mut()
                        .unwrap()
                        .retain(|t| t["name"] != "h.2.ln_1.weight");
                }
            }),
            &["`h.2.ln_1.weight` is missing: the model needs it with shape [32]"],
        ),
        (
            "unexpected tensor",
            Box::new(|m| tensor_entry(m, "h.1.ln_2.bias")["name"] = "h.9.ln_2.bias".into()),
            &[
                "`h.9.ln_2.bias` is not a parameter of this model",
                "`h.1.ln_2.bias` is missing",
            ],
        ),
    ];
    for (what, edit, needles) in &cases {
        std::fs::write(&pristine, &original).unwrap();
        edit_manifest(&url, 3, edit);
        let err = run_err(seqpipe().args(["ckpt", "verify", &url]));
        for needle in *needles {
            assert!(
                err.contains(needle),
                "{what}: verify must say {needle:?}:\n{err}"
            );
        }
        assert!(
            err.contains("cannot be loaded by its model"),
            "{what}: {err}"
        );
        let out = dir.join(format!("hf-{}", what.replace(' ', "-")));
        let err = run_err(
            seqpipe()
                .args(["ckpt", "export", &url, "--format", "hf-gpt2", "--out"])
                .arg(&out),
        );
        assert!(
            err.contains("refusing to export step 3") && err.contains(needles[0]),
            "{what}: {err}"
        );
        assert!(
            !out.join("model.safetensors").exists(),
            "{what}: export wrote a model anyway"
        );
        let show = run_ok(seqpipe().args(["ckpt", "show", &url]));
        let stdout = String::from_utf8_lossy(&show.stdout);
        assert!(
            stdout.contains("MODEL CHECK FAILED") && stdout.contains(needles[0]),
            "{what}: show must mark it:\n{stdout}"
        );
    }
}

/// `ckpt export --out DIR` never writes through a symlink planted in DIR: the links are replaced by
/// the exported files, and the files they pointed to keep their content. (It used to overwrite
/// the link's target with the HF config.)
#[test]
fn ckpt_export_replaces_symlinks_instead_of_following_them() {
    let dir = fresh_dir("exportlink");
    let run = dir.join("run");
    run_ok(&mut train(&run, &["train.steps=3"]));
    let outside = dir.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    let out = dir.join("hf");
    std::fs::create_dir_all(&out).unwrap();
    for name in ["config.json", "model.safetensors"] {
        let target = outside.join(format!("precious-{name}"));
        std::fs::write(&target, format!("do not overwrite {name}")).unwrap();
        std::os::unix::fs::symlink(&target, out.join(name)).unwrap();
    }
    run_ok(
        seqpipe()
            .args([
                "ckpt",
                "export",
                &ckpt_url(&run),
                "--format",
                "hf-gpt2",
                "--out",
            ])
            .arg(&out),
    );
    for name in ["config.json", "model.safetensors"] {
        let target = outside.join(format!("precious-{name}"));
        assert_eq!(
            std::fs::read_to_string(&target).unwrap(),
            format!("do not overwrite {name}"),
            "export wrote through the symlink {name}"
        );
        let meta = std::fs::symlink_metadata(out.join(name)).unwrap();
        assert!(meta.file_type().is_file(), "{name} is not a plain file now");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    let leftovers: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}
