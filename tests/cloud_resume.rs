//! Train → SIGKILL → resume with checkpoints in Azure Blob Storage (`az://`, on Azurite started by
//! the test and reached through the environment a user sets for the emulator, docs/checkpoints.md):
//! the resumed run ends bit-identical to an uninterrupted run on local disk.
//!
//! (No GCS counterpart: shards are multipart uploads, which object_store's GCS client makes with
//! GCS's XML multipart API, and neither fake-gcs-server nor gcp-storage-emulator implements it —
//! fsouza/fake-gcs-server#852; checkpoint/tests/gcs.rs tests what the emulator can serve.)

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use checkpoint::emulators::Azurite;
use common::resumable_train as train;
use common::{children_of, ckpt_url, final_state, fresh_dir, run_events, run_ok, seqpipe};
use trainer::runtime::events::{RunEvent, parse_records};

/// Steps of the resumed run and of the reference run.
const STEPS: u64 = 30;

/// SIGKILLs `pid` and all its descendants: the tree is listed first, then killed from the top
/// (so no parent restarts a child it saw die).
fn kill_tree(pid: u32) {
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        tree.extend(children_of(tree[i]));
        i += 1;
    }
    for pid in tree {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .stderr(Stdio::null())
            .status();
    }
}

/// The newest committed checkpoint step recorded in `run_dir`'s metrics, if any (none before the
/// file exists).
fn committed(run_dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default();
    parse_records(&text)
        .iter()
        .filter_map(|r| match r.as_event() {
            Some(RunEvent::Checkpoint(c)) => Some(c.step),
            _ => None,
        })
        .max()
}

/// SIGKILLs a launcher's process tree when dropped (a failing test leaves no run behind).
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        kill_tree(self.0.id());
        let _ = self.0.wait();
    }
}

/// Trains into `url` until a checkpoint of step 6 or later is committed, SIGKILLs the launcher
/// and its workers, resumes from `url` to `STEPS`, and compares with `reference`.
fn kill_and_resume(name: &str, url: &str, dir: &Path, reference: &BTreeMap<String, Vec<u8>>) {
    let first = dir.join(format!("{name}-first"));
    let mut child = KillOnDrop(
        train(
            &first,
            &["train.steps=100000", &format!("checkpoint.url={url}")],
        )
        .spawn()
        .unwrap(),
    );
    let started = Instant::now();
    while committed(&first).is_none_or(|s| s < 6) {
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!("[{name}] the first run exited ({status}) before its checkpoint of step 6");
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "[{name}] no checkpoint of step 6 within 5 minutes"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    kill_tree(child.0.id());
    let status = child.0.wait().unwrap();
    assert!(
        !status.success(),
        "[{name}] the first run was not killed: {status}"
    );

    let resumed = dir.join(format!("{name}-resumed"));
    let mut resume = seqpipe();
    resume
        .args([
            "resume",
            "-q",
            url,
            "--set",
            &format!("train.steps={STEPS}"),
        ])
        .arg("--set")
        .arg(format!("run.dir={}", resumed.display()));
    run_ok(&mut resume);
    let from = run_events(&resumed)
        .iter()
        .find_map(|e| match e {
            RunEvent::Resumed(r) => Some(r.step),
            _ => None,
        })
        .unwrap_or_else(|| panic!("[{name}] the resumed run records no `resumed` event"));
    assert!(
        (6..STEPS).contains(&from),
        "[{name}] resumed from step {from}"
    );
    // Read in this process, through the same environment the runs had.
    let (step, state) = final_state(url);
    println!(
        "[{name}] killed after checkpoint {:?}, resumed from {from}, final checkpoint {step} at {url}: {} tensors",
        committed(&first),
        state.len()
    );
    assert_eq!(step, STEPS, "[{name}]");
    assert_eq!(
        state.keys().collect::<Vec<_>>(),
        reference.keys().collect::<Vec<_>>(),
        "[{name}] tensor sets differ"
    );
    for (tensor, bytes) in &state {
        assert!(
            bytes == &reference[tensor],
            "[{name}] tensor {tensor} differs from the uninterrupted local run"
        );
    }
}

/// The emulator's address goes into this process's environment (the runs inherit it, and
/// `final_state` reads through it), set before any thread of the test starts.
#[test]
fn azure_checkpoints_survive_a_sigkill_and_resume_bit_identically() {
    let azurite = Azurite::start();
    for (k, v) in azurite.env() {
        // SAFETY: the only test of this binary; no thread of it has started yet.
        unsafe { std::env::set_var(k, v) };
    }
    let dir = fresh_dir("cloud-resume");
    let local = dir.join("local");
    run_ok(&mut train(&local, &[&format!("train.steps={STEPS}")]));
    let (step, reference) = final_state(&ckpt_url(&local));
    assert_eq!(step, STEPS);

    let run_id = format!("{}-{:08x}", std::process::id(), rand::random::<u32>());
    kill_and_resume(
        "azure",
        &azurite.url(&format!("runs/{run_id}")),
        &dir,
        &reference,
    );
}
