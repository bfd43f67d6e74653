//! End-to-end: a run's final checkpoint on a disk that is full. The checkpoints go to a small
//! tmpfs (mounted by the test: the tests run as root, here and in CI) that holds the first two
//! checkpoints and no third; the run must not report success for steps it lost, must name the
//! newest committed step (as `ckpt list` does), and must retry its final checkpoint.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{fresh_dir, seqpipe, tiny_model_args};

/// A tmpfs mounted at a fresh directory, unmounted when dropped.
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `bytes` (a multiple of 4 KiB); fails the test, with the reason, when it
    /// cannot (the tests need root for it).
    fn mount(name: &str, bytes: u64) -> Self {
        let dir = fresh_dir(name);
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&dir)
            .output()
            .expect("running mount");
        assert!(
            out.status.success(),
            "cannot mount a tmpfs at {} (these tests need root): {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Self { dir }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

/// The bytes of one checkpoint of the tests' model (4 stages), measured by a run on a normal disk.
fn checkpoint_bytes() -> u64 {
    let dir = fresh_dir("ckpt-size");
    let run = dir.join("run");
    let out = train(
        &run,
        &dir.join("ckpt").display().to_string(),
        &["train.steps=2"],
    )
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    committed(&dir.join("ckpt").display().to_string());
    let list = ckpt_list(&dir.join("ckpt").display().to_string());
    let bytes: u64 = list
        .lines()
        .find(|l| l.contains("committed"))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|b| b.parse().ok())
        .unwrap_or_else(|| panic!("no size in `ckpt list`:\n{list}"));
    assert!(bytes > 0);
    bytes
}

/// A tmpfs with room for two checkpoints (and their manifests and directories) but not three.
fn disk_for_two_checkpoints(name: &str) -> Tmpfs {
    let per = checkpoint_bytes();
    // Two checkpoints and a half: each file rounds up to 4 KiB pages, the manifests are small.
    let bytes = (per * 5 / 2).div_ceil(4096) * 4096 + 64 * 4096;
    Tmpfs::mount(name, bytes)
}

/// `train` of the tiny model with checkpoints every 2 steps into `url`, all kept.
fn train(run: &Path, url: &str, extra: &[&str]) -> Command {
    let mut cmd = seqpipe();
    cmd.args(["train", "-q"])
        .args(tiny_model_args())
        .args([
            "--set",
            "checkpoint.every=2",
            "--set",
            "checkpoint.keep_last=100",
        ])
        .args(["--set", &format!("checkpoint.url={url}")])
        .arg("--set")
        .arg(format!("run.dir={}", run.display()));
    for s in extra {
        cmd.args(["--set", s]);
    }
    cmd
}

fn ckpt_list(url: &str) -> String {
    let out = seqpipe().args(["ckpt", "list", url]).output().unwrap();
    assert!(out.status.success(), "ckpt list {url} failed");
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// The committed steps at `url`, as `ckpt list` shows them.
fn committed(url: &str) -> Vec<u64> {
    ckpt_list(url)
        .lines()
        .filter(|l| l.ends_with(" committed"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect()
}

/// Waits up to a minute (the machine may be busy) for `ready`.
fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let started = Instant::now();
    while !ready() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asserts that the failed run's stderr names `newest` as the newest committed checkpoint, with
/// the resume hint, and never claims a final checkpoint.
fn assert_names_newest(stderr: &str, newest: u64, run: &Path) {
    assert!(
        stderr.contains(&format!(
            "the newest committed checkpoint is step {newest} "
        )),
        "the message does not name step {newest} as the newest committed checkpoint:\n{stderr}"
    );
    assert!(
        stderr.contains(&format!("seqpipe resume {}", run.display())),
        "no resume hint:\n{stderr}"
    );
    assert!(
        !stderr.contains("with a final checkpoint") && !stderr.contains("done: step"),
        "reported success:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_final_checkpoint_that_does_not_fit_fails_the_run_and_names_the_newest_committed_step() {
    let disk = disk_for_two_checkpoints("full-disk-end");
    let url = disk.dir.join("ckpt").display().to_string();
    let run = fresh_dir("full-disk-end-run");
    let out = train(&run, &url, &["train.steps=10"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(
        out.status.code(),
        Some(1),
        "a run whose final checkpoint failed must fail:\n{stderr}"
    );
    assert_eq!(committed(&url), vec![2, 4], "{stderr}");
    assert!(
        stderr.contains("the final checkpoint of step 10 was not committed (4 attempt(s))"),
        "{stderr}"
    );
    assert_eq!(
        stderr
            .matches("retrying the final checkpoint of step 10")
            .count(),
        3,
        "{stderr}"
    );
    assert_names_newest(&stderr, 4, &run);
}

#[test]
fn sigterm_with_a_final_checkpoint_that_does_not_fit_fails_and_names_the_newest_committed_step() {
    let disk = disk_for_two_checkpoints("full-disk-term");
    let url = disk.dir.join("ckpt").display().to_string();
    let run = fresh_dir("full-disk-term-run");
    let child = train(&run, &url, &["train.steps=100000", "checkpoint.grace_s=3"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Past the first failed checkpoint: the disk is full.
    wait_for("step 7", || common::steps_done(&run) >= 7);
    let signalled = Instant::now();
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        signalled.elapsed() < Duration::from_secs(3 + 20),
        "the stop took {:?}, checkpoint.grace_s is 3",
        signalled.elapsed()
    );
    assert_eq!(committed(&url), vec![2, 4], "{stderr}");
    assert!(stderr.contains("was not committed"), "{stderr}");
    assert_names_newest(&stderr, 4, &run);
}

#[test]
fn a_final_checkpoint_commits_on_retry_when_the_disk_frees_up() {
    // Room for two checkpoints besides a filler of two more, deleted when the retry is announced.
    let per = checkpoint_bytes();
    let filler_bytes = (2 * per).div_ceil(4096) * 4096;
    let bytes = (per * 5 / 2).div_ceil(4096) * 4096 + 64 * 4096 + filler_bytes;
    let disk = Tmpfs::mount("full-disk-retry", bytes);
    let filler = disk.dir.join("filler");
    std::fs::write(&filler, vec![1u8; filler_bytes as usize]).unwrap();
    let url = disk.dir.join("ckpt").display().to_string();
    let run = fresh_dir("full-disk-retry-run");
    let mut child = train(&run, &url, &["train.steps=6"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = String::new();
    for line in BufReader::new(child.stderr.take().unwrap()).lines() {
        let line = line.unwrap();
        if line.contains("retrying the final checkpoint of step 6") && filler.exists() {
            // The next attempt comes a second later: free the disk now.
            std::fs::remove_file(&filler).unwrap();
        }
        stderr.push_str(&line);
        stderr.push('\n');
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "{stderr}");
    assert!(
        !filler.exists(),
        "the final checkpoint was not retried:\n{stderr}"
    );
    assert_eq!(committed(&url), vec![2, 4, 6], "{stderr}");
    assert!(stderr.contains("(newest committed: step 6)"), "{stderr}");
}
