//! Inputs that once cost unbounded memory or time (issue 35, "Unbounded inputs"), end to end with
//! the real binary: a huge checkpoint manifest is refused by every command that reads one, before
//! it is read; `data prepare` refuses an oversized JSON line with bounded memory. Each child's
//! peak memory is its `ru_maxrss`, read by `wait4` when it exits.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{fresh_dir, seqpipe, tiny_model_args};

/// How a child ended: exit status, stderr, peak resident memory (bytes) and wall time.
struct Ended {
    success: bool,
    stderr: String,
    peak_rss: u64,
    took: Duration,
}

/// Runs `cmd` to its end and measures its peak memory with `wait4`'s resource usage.
// The child is reaped by `wait4`, which `Child::wait` cannot replace (it gives no rusage).
#[allow(clippy::zombie_processes)]
fn run_measured(cmd: &mut Command) -> Ended {
    let started = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("failed to start seqpipe");
    let mut pipe = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    });
    let mut status = 0;
    // SAFETY: `rusage` is plain data that wait4 fills in; the pid is our own child's.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = child.id() as libc::pid_t;
    let waited = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(waited, pid, "wait4: {}", std::io::Error::last_os_error());
    let took = started.elapsed();
    Ended {
        success: libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        stderr: reader.join().unwrap(),
        // Linux reports ru_maxrss in KiB.
        peak_rss: usage.ru_maxrss as u64 * 1024,
        took,
    }
}

const MIB: u64 = 1 << 20;

/// A checkpoint store at `dir` whose step 3 has a 3 GB manifest: a sparse file, so it costs no
/// disk, but a reader that reads it whole holds 3 GB.
fn store_with_a_huge_manifest(dir: &Path) {
    let step_dir = dir.join("step-00000003");
    std::fs::create_dir_all(&step_dir).unwrap();
    let file = std::fs::File::create(step_dir.join("manifest.json")).unwrap();
    file.set_len(3_000_000_000).unwrap();
}

/// Issue 35: a 2.9 GB manifest took `ckpt show`/`verify`/`export` to 8.9 GB of memory each and
/// had every worker of `train --resume latest` parse it. Each command now refuses it from its
/// size, naming the object, its size and the bound, without reading it: quickly and with a peak
/// memory far below the object's size.
#[test]
fn a_huge_manifest_is_refused_before_it_is_read() {
    let dir = fresh_dir("huge-manifest");
    let run = dir.join("run");
    let store = run.join("checkpoints");
    store_with_a_huge_manifest(&store);
    let url = store.display().to_string();
    let out = dir.join("export");
    let mut commands: Vec<(&str, Command)> = Vec::new();
    for (name, args) in [
        ("ckpt show", vec!["ckpt", "show", &url]),
        ("ckpt verify", vec!["ckpt", "verify", &url]),
        (
            "ckpt export",
            vec!["ckpt", "export", &url, "--format", "hf-gpt2", "--out"],
        ),
    ] {
        let mut cmd = seqpipe();
        cmd.args(args);
        if name == "ckpt export" {
            cmd.arg(&out);
        }
        commands.push((name, cmd));
    }
    let mut train = seqpipe();
    train
        .args(["train", "-q"])
        .args(tiny_model_args())
        .args(["--set", "train.steps=4", "--resume", "latest"])
        .arg("--set")
        .arg(format!("run.dir={}", run.display()));
    commands.push(("train --resume latest", train));
    let mut resume = seqpipe();
    resume.args(["resume", &url]);
    commands.push(("resume", resume));
    for (name, mut cmd) in commands {
        let ended = run_measured(&mut cmd);
        let err = &ended.stderr;
        assert!(!ended.success, "{name} accepted a 3 GB manifest:\n{err}");
        assert!(
            err.contains("step-00000003/manifest.json")
                && err.contains("3000000000 bytes")
                && err.contains(&format!("{}-byte bound", checkpoint::MAX_MANIFEST_BYTES)),
            "{name}: the error does not name the object, its size and the bound:\n{err}"
        );
        // The object is 3 GB; a bounded reader holds none of it. Generous for a loaded machine:
        // `train` starts workers (each a fresh process), and none may read the manifest whole.
        assert!(
            ended.peak_rss < 1024 * MIB,
            "{name}: peak memory {} MiB",
            ended.peak_rss / MIB
        );
        assert!(
            ended.took < Duration::from_secs(120),
            "{name} took {:?}",
            ended.took
        );
        eprintln!(
            "{name}: refused in {:?}, peak {} MiB",
            ended.took,
            ended.peak_rss / MIB
        );
    }
}

/// Issue 35: a 50 MB single-line `.jsonl` took `data prepare` to 2.6 GB. The line is over the
/// bound on one document: refused naming the file and line, having read no more than the bound.
#[test]
fn data_prepare_refuses_an_oversized_line_with_bounded_memory() {
    let dir = fresh_dir("prepare-big-line");
    let input = dir.join("one-line.jsonl");
    let words: String = (0..5_000_000)
        .map(|i| ["lorem ", "ipsum ", "dolor ", "sit "][i % 4])
        .collect();
    std::fs::write(
        &input,
        format!("{{\"text\": \"{words}\"}}\n{{\"text\": \"after\"}}\n"),
    )
    .unwrap();
    assert!(std::fs::metadata(&input).unwrap().len() > 25 * MIB);
    let ended = run_measured(
        seqpipe()
            .args(["data", "prepare", "--input"])
            .arg(&input)
            .arg("--out")
            .arg(dir.join("tok")),
    );
    let err = &ended.stderr;
    assert!(!ended.success, "a 27 MB line was accepted:\n{err}");
    assert!(
        err.contains("one-line.jsonl:1") && err.contains("longer than"),
        "{err}"
    );
    // The bound is 16 MiB of line; the process itself is a few MiB more.
    assert!(
        ended.peak_rss < 200 * MIB,
        "peak memory {} MiB",
        ended.peak_rss / MIB
    );
    eprintln!(
        "refused in {:?}, peak {} MiB",
        ended.took,
        ended.peak_rss / MIB
    );
}

/// `data prepare` of a large `.txt` (one document of about 18 MB) reads and tokenizes it in
/// pieces, and moves its last tenth of tokens to val.bin by streaming: its peak memory stays far
/// below what holding the text, its tokens and the tokenizer's work on the whole would take.
#[test]
fn data_prepare_tokenizes_a_large_text_in_bounded_memory() {
    let dir = fresh_dir("prepare-big-text");
    let input = dir.join("book.txt");
    let text: String = (0..600_000)
        .map(|i| format!("Sentence {i} of the book.\n"))
        .collect();
    std::fs::write(&input, &text).unwrap();
    let ended = run_measured(
        seqpipe()
            .args(["data", "prepare", "--input"])
            .arg(&input)
            .arg("--out")
            .arg(dir.join("tok")),
    );
    assert!(ended.success, "{}", ended.stderr);
    // Every sentence is at least 7 tokens ("Sentence", " N", " of", " the", " book", ".", "\n");
    // that the pieces tokenize like the whole is the unit tests' business.
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tok/meta.json")).unwrap()).unwrap();
    let tokens = meta["train_tokens"].as_u64().unwrap() + meta["val_tokens"].as_u64().unwrap();
    let written = std::fs::metadata(dir.join("tok/train.bin")).unwrap().len()
        + std::fs::metadata(dir.join("tok/val.bin")).unwrap().len();
    assert_eq!(written, 2 * tokens);
    assert!(tokens > 7 * 600_000, "{tokens} tokens");
    assert!(
        ended.peak_rss < 300 * MIB,
        "peak memory {} MiB for a {} MiB text",
        ended.peak_rss / MIB,
        text.len() as u64 / MIB
    );
    eprintln!(
        "prepared in {:?}, peak {} MiB",
        ended.took,
        ended.peak_rss / MIB
    );
}
