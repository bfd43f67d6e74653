//! The `seqpipe` binary end to end: training runs, the schedule report, and clean errors on bad input.

mod common;

use common::{fresh_dir, losses, metrics, run_err, run_events, run_ok, seqpipe, tiny_model_args};

fn schedule_json(kind: &str, splits: usize) -> serde_json::Value {
    let out = run_ok(seqpipe().args([
        "schedule",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--splits",
        &splits.to_string(),
        "--schedule",
        kind,
        "--json",
    ]));
    serde_json::from_slice(&out.stdout).expect("schedule --json prints one JSON object")
}

#[test]
fn schedule_json_reports_seq1f1b_bubble_and_memory() {
    let (p, m, k) = (4.0, 8.0, 4.0);
    let seq = schedule_json("seq1f1b", 4);
    let bubble = seq["bubble_fraction"].as_f64().unwrap();
    let ideal = (p - 1.0) / (m * k + p - 1.0);
    assert!(
        (bubble - ideal).abs() <= 0.01,
        "seq1f1b bubble {bubble} vs (p-1)/(mk+p-1) = {ideal}"
    );
    assert_eq!(seq["segment_lengths"].as_array().unwrap().len(), 4);
    let stages = seq["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 4);
    for (r, st) in stages.iter().enumerate() {
        assert_eq!(st["stage"].as_u64().unwrap() as usize, r);
        assert!(st["bubble_fraction"].as_f64().is_some());
        assert!(!st["actions"].as_array().unwrap().is_empty());
    }
    assert_eq!(stages[0]["actions"][0], "F0.0");
    let one = schedule_json("1f1b", 1);
    let one_bubble = one["bubble_fraction"].as_f64().unwrap();
    assert!(
        (one_bubble - (p - 1.0) / (m + p - 1.0)).abs() <= 0.01,
        "1f1b bubble {one_bubble}"
    );
    let peak = |v: &serde_json::Value| v["stages"][0]["peak_activation_tokens"].as_u64().unwrap();
    assert!(
        peak(&seq) < peak(&one),
        "stage 0 peak activation tokens: seq1f1b {} vs 1f1b {}",
        peak(&seq),
        peak(&one)
    );
}

#[test]
fn schedule_text_and_svg() {
    let dir = fresh_dir("svg");
    let svg = dir.join("timeline.svg");
    let out = run_ok(
        seqpipe()
            .args([
                "schedule",
                "--stages",
                "4",
                "--microbatches",
                "3",
                "--splits",
                "2",
                "--svg",
            ])
            .arg(&svg),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("F0.0 F0.1 F1.0 F1.1 F2.0 B0.1 F2.1 B0.0 B1.1 B1.0 B2.1 B2.0"),
        "{text}"
    );
    assert!(text.contains("bubble"), "{text}");
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(
        picture.starts_with("<svg") || picture.starts_with("<?xml"),
        "not an SVG"
    );
}

/// The interleaved and zero-bubble kinds print, simulate and draw; a shape they cannot take is
/// refused with the reason instead of running something else.
#[test]
fn schedule_family_kinds_print_and_refuse_shapes_they_cannot_take() {
    let dir = fresh_dir("family-svg");
    let svg = dir.join("zb.svg");
    let out = run_ok(seqpipe().args([
        "schedule",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--splits",
        "2",
        "--schedule",
        "seq1f1b-i",
        "--virtual-stages",
        "2",
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("stage 0: F0.0 F0.1 F0.0@1 F0.1@1 F1.0 F1.1 B0.1@1"),
        "{text}"
    );
    assert!(text.contains("seq1f1b-i formula"), "{text}");
    let out = run_ok(
        seqpipe()
            .args([
                "schedule",
                "--stages",
                "3",
                "--microbatches",
                "2",
                "--splits",
                "2",
                "--schedule",
                "seq1f1b-zb",
                "--svg",
            ])
            .arg(&svg),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("I0.1") && text.contains("W0.1"), "{text}");
    assert!(std::fs::read_to_string(&svg).unwrap().contains("W0.1"));
    let err = run_err(seqpipe().args([
        "schedule",
        "--stages",
        "4",
        "--microbatches",
        "6",
        "--schedule",
        "1f1b-i",
    ]));
    assert!(err.contains("multiple of the stages"), "{err}");
}

/// With data parallelism the printed schedule is one replica's, over c = m/d micro-batches, and a
/// replica count that cannot split the micro-batches deterministically is refused with the valid
/// ones.
#[test]
fn schedule_with_replicas_prints_the_dp_dimension_and_refuses_an_invalid_d() {
    let args = |d: &str| {
        let mut cmd = seqpipe();
        cmd.args([
            "schedule",
            "--stages",
            "2",
            "--microbatches",
            "8",
            "--splits",
            "2",
            "--replicas",
            d,
        ]);
        cmd
    };
    let out = run_ok(&mut args("2"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("2 replicas × 2 stages; each replica runs c = m/d = 8/2 = 4 micro-batches"),
        "{text}"
    );
    // One replica's Seq1F1B: (p-1)/(ck+p-1) = 1/(4·2+1).
    assert!(
        text.contains("simulated bubble fraction per replica")
            && text.contains(&format!("(p-1)/(ck+p-1) = {:.4}", 1.0 / 9.0)),
        "{text}"
    );
    // Stage 0 of a replica runs 4 micro-batches, not 8.
    assert!(text.contains("F3.1") && !text.contains("F4.0"), "{text}");
    let err = run_err(&mut args("3"));
    assert!(
        err.contains("3 replicas") && err.contains("valid replica counts: [1, 2, 4, 8]"),
        "{err}"
    );
}

/// Same data, same math: the three schedules produce the same per-step losses.
#[test]
fn schedules_train_to_the_same_losses() {
    let run = |kind: &str, splits: usize| {
        let dir = fresh_dir(&format!("same-{kind}"));
        run_ok(
            seqpipe()
                .args(["train", "-q"])
                .args(tiny_model_args())
                .args([
                    "--set",
                    "train.steps=4",
                    "--set",
                    &format!("pipeline.schedule={kind}"),
                    "--set",
                    &format!("pipeline.splits={splits}"),
                ])
                .arg("--set")
                .arg(format!("run.dir={}", dir.display())),
        );
        losses(&dir)
    };
    let seq = run("seq1f1b", 4);
    let one = run("1f1b", 1);
    let gpipe = run("gpipe", 1);
    assert_eq!(seq.len(), 4);
    for i in 0..4 {
        for (name, other) in [("1f1b", one[i]), ("gpipe", gpipe[i])] {
            let rel = ((other - seq[i]) / seq[i]).abs();
            assert!(
                rel <= 1e-5,
                "step {}: seq1f1b loss {} vs {name} {} (rel {rel:e})",
                i + 1,
                seq[i],
                other
            );
        }
    }
}

/// The default job on its embedded config: the loss falls toward the printed bound, metrics are complete.
#[test]
fn default_training_loss_falls_toward_bound() {
    let dir = fresh_dir("default");
    let out = run_ok(
        seqpipe()
            .args([
                "train",
                "-q",
                "--set",
                "train.steps=30",
                "--set",
                "train.eval_every=15",
            ])
            .arg("--set")
            .arg(format!("run.dir={}", dir.display())),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let bound: f64 = stderr
        .split("loss lower bound ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no bound printed:\n{stderr}"));
    let records: Vec<_> = metrics(&dir)
        .into_iter()
        .filter(|r| r.get("event").is_none())
        .collect();
    assert_eq!(records.len(), 30);
    for key in [
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens",
        "step_time_s",
        "tokens_per_s",
    ] {
        assert!(
            records.iter().all(|r| r.get(key).is_some()),
            "metrics lack `{key}`"
        );
    }
    let first = records[0]["loss"].as_f64().unwrap();
    let last = records[29]["loss"].as_f64().unwrap();
    let val = records[29]["val_loss"]
        .as_f64()
        .expect("val_loss on the last step");
    assert!(
        records[14]["val_loss"].as_f64().is_some(),
        "val_loss at eval_every"
    );
    assert!(first > 5.5, "initial loss {first} should be near ln(vocab)");
    assert!(
        last < first - 2.0 && last > bound,
        "loss should fall toward the bound {bound}: {first} -> {last}"
    );
    assert!(val < first - 2.0 && val > bound, "val loss {val}");
    assert!(dir.join("config.resolved.toml").exists());
}

#[test]
fn config_typos_are_named() {
    let err = run_err(seqpipe().args(["train", "--set", "train.stpes=3"]));
    assert!(
        err.contains("train.stpes") && err.contains("steps"),
        "{err}"
    );
    let err = run_err(seqpipe().args(["train", "--set", "pipeline.schedule=zigzag"]));
    assert!(err.contains("zigzag") && err.contains("seq1f1b"), "{err}");
    let err = run_err(seqpipe().args(["train", "--set", "pipeline.stages=9"]));
    assert!(
        err.contains("pipeline.stages") && err.contains("layer"),
        "{err}"
    );
    let err = run_err(seqpipe().args([
        "train",
        "--set",
        "pipeline.partition=uniform",
        "--set",
        "pipeline.splits=5",
    ]));
    assert!(err.contains("pipeline.splits"), "{err}");
    let dir = fresh_dir("badcfg");
    let file = dir.join("bad.toml");
    std::fs::write(&file, "[train]\nsteps = \"many\"\n").unwrap();
    let err = run_err(seqpipe().arg("train").arg("--config").arg(&file));
    assert!(err.contains("bad.toml") && err.contains("steps"), "{err}");
    let err = run_err(seqpipe().args(["train", "--config", "/nonexistent/x.toml"]));
    assert!(err.contains("/nonexistent/x.toml"), "{err}");
}

#[test]
fn missing_and_corrupt_token_files_are_errors() {
    let dir = fresh_dir("data");
    let err = run_err(
        seqpipe()
            .arg("train")
            .arg("--set")
            .arg(format!("data.source={}", dir.join("nope").display())),
    );
    assert!(
        err.contains("nope") && err.contains("seqpipe data prepare"),
        "{err}"
    );
    // An odd number of bytes cannot be u16 tokens.
    std::fs::write(dir.join("train.bin"), [1u8, 0, 2]).unwrap();
    std::fs::write(dir.join("val.bin"), [1u8, 0, 2, 0]).unwrap();
    let err = run_err(
        seqpipe()
            .arg("train")
            .arg("--set")
            .arg(format!("data.source={}", dir.display())),
    );
    assert!(err.contains("train.bin"), "{err}");
    // Token ids beyond the vocabulary.
    let tokens: Vec<u8> = (0..4000u16)
        .flat_map(|t| (t % 1000).to_le_bytes())
        .collect();
    std::fs::write(dir.join("train.bin"), &tokens).unwrap();
    std::fs::write(dir.join("val.bin"), &tokens).unwrap();
    let err = run_err(
        seqpipe()
            .args([
                "train",
                "--set",
                "train.steps=1",
                "--set",
                "model.vocab_size=64",
            ])
            .arg("--set")
            .arg(format!("data.source={}", dir.display()))
            .arg("--set")
            .arg(format!("run.dir={}", dir.join("run").display())),
    );
    assert!(err.contains("vocab") || err.contains("64"), "{err}");
    // It would recur on any node: the run fails at once with the real cause, not after retrying
    // it as lost nodes until `max_restarts` runs out.
    assert!(err.contains("vocab_size is 64"), "{err}");
    assert!(
        !err.contains("lost") && !err.contains("seqpipe resume"),
        "a permanent data error was treated as a node loss:\n{err}"
    );
    let events = std::fs::read_to_string(dir.join("run/metrics.jsonl")).unwrap_or_default();
    assert!(!events.contains("node_lost"), "{events}");
}

#[test]
fn worker_that_cannot_connect_is_an_error() {
    let dir = fresh_dir("worker");
    let cfg = dir.join("config.toml");
    std::fs::write(&cfg, "[pipeline]\ntimeout_s = 2.0\n").unwrap();
    // Nothing listens on port 9 of loopback (discard); the connection is refused. The token is
    // set: a worker without one is refused before it tries to connect (tested above).
    let err = run_err(
        seqpipe()
            .args([
                "worker",
                "--control",
                "127.0.0.1:9",
                "--stage",
                "0",
                "--config",
            ])
            .arg(&cfg)
            .env("SEQPIPE_JOB_TOKEN", "worker-connect-test-secret"),
    );
    assert!(err.contains("127.0.0.1:9"), "{err}");
}

#[test]
fn data_prepare_then_train_on_it() {
    let dir = fresh_dir("prepare");
    let text: String = (0..400)
        .map(|i| format!("The quick brown fox {i} jumps over the lazy dog. "))
        .collect();
    std::fs::write(dir.join("a.txt"), &text).unwrap();
    std::fs::write(dir.join("b.jsonl"), "{\"text\": \"hello world, this is the first document of the JSONL file\"}\n{\"text\": \"and a second one with a few more words in it, enough for one sample\"}\n").unwrap();
    let out_dir = dir.join("tok");
    run_ok(
        seqpipe()
            .args(["data", "prepare", "--input"])
            .arg(dir.join("b.jsonl"))
            .arg(dir.join("a.txt"))
            .arg("--out")
            .arg(&out_dir)
            .args(["--val-fraction", "0.34"]),
    );
    assert!(out_dir.join("train.bin").exists() && out_dir.join("val.bin").exists());
    let run = dir.join("run");
    run_ok(
        seqpipe()
            .args([
                "train",
                "-q",
                "--set",
                "model.vocab_size=50257",
                "--set",
                "model.layers=2",
                "--set",
                "model.d_model=32",
                "--set",
                "model.heads=2",
                "--set",
                "train.seq_len=16",
                "--set",
                "model.max_seq_len=16",
                "--set",
                "pipeline.stages=2",
                "--set",
                "pipeline.splits=2",
                "--set",
                "train.steps=2",
                "--set",
                "train.eval_batches=1",
            ])
            .arg("--set")
            .arg(format!("data.source={}", out_dir.display()))
            .arg("--set")
            .arg(format!("run.dir={}", run.display())),
    );
    assert_eq!(losses(&run).len(), 2);
}

/// The test plays the coordinator: a real worker must prove the job's token before anything else
/// (and checks the coordinator's proof); with another token it is refused.
#[test]
fn workers_authenticate_with_the_job_token() {
    use std::net::TcpListener;
    for (worker_token, accepted) in [("s3cret", true), ("wrong", false)] {
        let dir = fresh_dir("auth");
        let cfg = dir.join("config.toml");
        std::fs::write(&cfg, "[pipeline]\ntimeout_s = 5.0\n").unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let child = seqpipe()
            .args(["worker", "--control", &addr, "--stage", "0", "--config"])
            .arg(&cfg)
            .env("SEQPIPE_JOB_TOKEN", worker_token)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (mut stream, _) = listener.accept().unwrap();
        let verdict = trainer::runtime::auth::accept(
            &mut stream,
            "s3cret",
            trainer::runtime::auth::Purpose::Control,
        );
        assert_eq!(verdict.is_ok(), accepted, "{worker_token}: {verdict:?}");
        if accepted {
            let hello = trainer::runtime::wire::read_frame(
                &mut stream,
                trainer::runtime::wire::Limits::CONTROL,
            )
            .unwrap();
            let hello: serde_json::Value = hello.header().unwrap();
            assert_eq!(hello["type"], "hello", "{hello}");
        }
        drop(stream);
        let out = child.wait_with_output().unwrap();
        assert!(
            !out.status.success(),
            "the worker must stop once the coordinator is gone"
        );
    }
}

/// `model.device = "cuda"` where it cannot run is a clear error (exit 1, no panic), whether the
/// binary lacks the `cuda` feature or the machine lacks a driver; so are the `gpu` commands.
#[test]
fn cuda_device_without_a_gpu_is_a_clear_error() {
    let err = run_err(seqpipe().args(["train", "--set", "model.device=cuda", "-q"]));
    assert!(
        err.contains("model.device") || err.contains("CUDA"),
        "{err}"
    );
    assert!(
        err.contains("--features cuda") || err.contains("driver library could not be loaded"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let err = run_err(seqpipe().args(["gpu", "check"]));
    assert!(
        err.contains("--features cuda") || err.contains("driver library could not be loaded"),
        "{err}"
    );
    // The NCCL link check looks for libnccl first (cudarc panics on a missing library).
    let err = run_err(seqpipe().args(["gpu", "link"]));
    assert!(
        err.contains("--features cuda") || err.contains("NCCL library could not be loaded"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    // Filling the PTX cache needs no GPU, but a known architecture.
    let err = run_err(seqpipe().args(["gpu", "ptx", "--arch", "sm_91"]));
    assert!(
        err.contains("--features cuda") || (err.contains("sm_91") && err.contains("sm_90")),
        "{err}"
    );
    let err = run_err(seqpipe().args(["train", "--set", "model.precision=fp8"]));
    assert!(err.contains("fp8") && err.contains("bf16"), "{err}");
}

/// `--set` arguments of a one-step tiny run in `dir`.
fn one_step_args(dir: &std::path::Path) -> Vec<String> {
    let mut args = tiny_model_args();
    args.extend(["--set".into(), "train.steps=1".into()]);
    args.extend(["--set".into(), format!("run.dir={}", dir.display())]);
    args
}

/// Every seconds key (all `*_s` keys of the config, found in the embedded default so that a new
/// one is covered too) refuses huge, infinite and NaN values at parse time: exit 1 with the key
/// and the allowed range, never a panic (`Duration::from_secs_f64` and `Instant + Duration` panic
/// on such values).
#[test]
fn every_duration_key_is_range_checked() {
    let table: toml::Table = toml::from_str(trainer::config::DEFAULT_CONFIG_TOML).unwrap();
    let mut keys = Vec::new();
    for (section, fields) in &table {
        for (field, value) in fields.as_table().unwrap() {
            if field.ends_with("_s") && value.is_float() {
                keys.push(format!("{section}.{field}"));
            }
        }
    }
    for expected in [
        "pipeline.timeout_s",
        "checkpoint.grace_s",
        "elastic.heartbeat_s",
        "elastic.dead_after_s",
        "elastic.join_timeout_s",
        "elastic.grace_s",
    ] {
        assert!(
            keys.iter().any(|k| k == expected),
            "{expected} not in {keys:?}"
        );
    }
    let dir = fresh_dir("durations");
    for key in &keys {
        for value in ["1e300", "1e19", "3e6", "nan", "inf", "-inf", "-1.0"] {
            let err = run_err(
                seqpipe()
                    .args(["train", "-q"])
                    .args(one_step_args(&dir))
                    .arg("--set")
                    .arg(format!("{key}={value}")),
            );
            assert!(
                err.contains(key.as_str()) && err.contains("2592000"),
                "{key}={value}: {err}"
            );
        }
    }
    for value in ["1e300", "nan", "inf", "-1"] {
        let err = run_err(
            seqpipe()
                .args(["agent", "--join", "127.0.0.1:9", "--name", "n0"])
                .arg(format!("--connect-timeout-s={value}")),
        );
        assert!(
            err.contains("--connect-timeout-s") && err.contains("2592000"),
            "--connect-timeout-s {value}: {err}"
        );
    }
}

/// Size keys have a sane maximum too, named in the error.
#[test]
fn huge_size_keys_are_refused() {
    let dir = fresh_dir("sizes");
    for (key, value) in [
        ("train.memory_budget_bytes", "1152921504606846976"),
        ("checkpoint.max_upload_bytes_per_s", "1152921504606846976"),
        ("model.d_model", "1099511627776"),
        ("model.vocab_size", "1099511627776"),
        ("model.max_seq_len", "1099511627776"),
        ("pipeline.microbatches", "1099511627776"),
    ] {
        let err = run_err(
            seqpipe()
                .args(["train", "-q"])
                .args(one_step_args(&dir))
                .arg("--set")
                .arg(format!("{key}={value}")),
        );
        assert!(err.contains(key), "{key}={value}: {err}");
    }
}

/// A model that cannot fit in memory is refused before any worker starts, with the estimate and
/// what to change, instead of an allocation abort seen as "connection reset by peer".
#[test]
fn model_too_large_for_memory_is_refused_up_front() {
    let dir = fresh_dir("toolarge");
    let run_dir = dir.join("run");
    let started = std::time::Instant::now();
    let err = run_err(
        seqpipe()
            .args(["train", "-q", "--set", "model.vocab_size=1000000000"])
            .arg("--set")
            .arg(format!("run.dir={}", run_dir.display())),
    );
    assert!(
        err.contains("memory") && err.contains("GiB") && err.contains("1000000000"),
        "{err}"
    );
    assert!(err.contains("parameters"), "{err}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
    let logs = std::fs::read_dir(&run_dir)
        .map(|d| d.filter_map(|e| e.ok()).count())
        .unwrap_or(0);
    assert_eq!(logs, 0, "no worker may start: {run_dir:?} has files");
}

/// Logs written to a pipe carry no colour codes, and each checkpoint is logged as committed once.
#[test]
fn piped_logs_are_plain_and_checkpoints_logged_once() {
    let dir = fresh_dir("plainlogs");
    let out = run_ok(
        seqpipe()
            .env("RUST_LOG", "info")
            .args(["train", "-q"])
            .args(tiny_model_args())
            .args([
                "--set",
                "train.steps=2",
                "--set",
                "checkpoint.every=1",
                "--set",
                "pipeline.stages=2",
            ])
            .arg("--set")
            .arg(format!("run.dir={}", dir.display())),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("INFO"), "no log lines: {stderr}");
    assert!(
        !stderr.contains("\x1b["),
        "ANSI codes in piped logs:\n{stderr}"
    );
    let committed = stderr.matches("checkpoint committed").count();
    assert_eq!(committed, 2, "two checkpoints, one line each:\n{stderr}");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "log") {
            let text = std::fs::read_to_string(&path).unwrap();
            assert!(!text.contains("\x1b["), "ANSI codes in {}", path.display());
        }
    }
}

/// An explicitly set but empty `SEQPIPE_JOB_TOKEN` is refused with a clear error (it used to be
/// replaced by a random one without a word), by the coordinator, an agent and a worker.
#[test]
fn empty_job_token_is_refused() {
    let dir = fresh_dir("emptytoken");
    let cfg = dir.join("config.toml");
    std::fs::write(&cfg, "[pipeline]\ntimeout_s = 2.0\n").unwrap();
    for token in ["", "  "] {
        let train = run_err(
            seqpipe()
                .env("SEQPIPE_JOB_TOKEN", token)
                .args(["train", "-q"])
                .args(one_step_args(&dir.join("run"))),
        );
        let agent = run_err(seqpipe().env("SEQPIPE_JOB_TOKEN", token).args([
            "agent",
            "--join",
            "127.0.0.1:9",
            "--name",
            "n0",
            "--connect-timeout-s",
            "0",
        ]));
        let worker = run_err(
            seqpipe()
                .env("SEQPIPE_JOB_TOKEN", token)
                .args([
                    "worker",
                    "--control",
                    "127.0.0.1:9",
                    "--stage",
                    "0",
                    "--config",
                ])
                .arg(&cfg),
        );
        for err in [train, agent, worker] {
            assert!(
                err.contains("SEQPIPE_JOB_TOKEN") && err.contains("empty"),
                "{token:?}: {err}"
            );
        }
    }
}

/// An unset `SEQPIPE_JOB_TOKEN` is refused like an empty one by an agent, a worker and a
/// coordinator waiting for remote agents (they used to fall back to the empty token, so a node
/// without the secret joined a coordinator that had none either). The agent and the worker are
/// refused before they connect: the coordinator's port sees no connection. Only a local `train`
/// (its own agents) makes a token up.
#[test]
fn unset_job_token_is_refused_by_agents_workers_and_a_remote_coordinator() {
    use std::net::TcpListener;
    let dir = fresh_dir("unsettoken");
    let cfg = dir.join("config.toml");
    std::fs::write(&cfg, "[pipeline]\ntimeout_s = 2.0\n").unwrap();
    let coordinator = TcpListener::bind("127.0.0.1:0").unwrap();
    coordinator.set_nonblocking(true).unwrap();
    let addr = coordinator.local_addr().unwrap().to_string();
    let agent = run_err(seqpipe().env_remove("SEQPIPE_JOB_TOKEN").args([
        "agent",
        "--join",
        &addr,
        "--name",
        "n0",
        "--connect-timeout-s",
        "0",
    ]));
    let worker = run_err(
        seqpipe()
            .env_remove("SEQPIPE_JOB_TOKEN")
            .args(["worker", "--control", &addr, "--stage", "0", "--config"])
            .arg(&cfg),
    );
    for (who, err) in [("an agent", &agent), ("a worker", &worker)] {
        assert!(
            err.contains(&format!("SEQPIPE_JOB_TOKEN is not set, and {who} needs"))
                && err.contains("openssl rand"),
            "{who}: {err}"
        );
    }
    assert!(
        coordinator.accept().is_err(),
        "a node without the job token connected to the coordinator"
    );
    let train = run_err(
        seqpipe()
            .env_remove("SEQPIPE_JOB_TOKEN")
            .args(["train", "-q"])
            .args(one_step_args(&dir.join("run")))
            .args(["--set", "elastic.local_agents=false"])
            .args(["--set", "elastic.listen=127.0.0.1:0"]),
    );
    assert!(
        train.contains("SEQPIPE_JOB_TOKEN is not set, and a coordinator waiting for remote agents"),
        "{train}"
    );
}

/// A `val.bin` the run cannot use (0 bytes, or a token id beyond the vocabulary) stops `train` at
/// start-up with an error naming the file, before any worker starts: it used to surface only when
/// the first evaluation ran, as `node_lost` events blaming the wrong stage and peer recoveries
/// first. A bad token that appears only later in `train.bin` (checked as it is read, on whichever
/// stage reads it) is a data error too, never a lost node.
#[test]
fn bad_data_stops_the_run_naming_the_file_and_no_node_is_lost() {
    let dir = fresh_dir("baddata");
    let good: Vec<u8> = (0..4000u16).flat_map(|t| (t % 64).to_le_bytes()).collect();
    let mut late_bad = good.clone();
    late_bad.extend((0..4000u16).flat_map(|_| 900u16.to_le_bytes()));
    let mut one_bad = good.clone();
    one_bad.extend(64u16.to_le_bytes());
    let cases: [(&str, &[u8], &[u8], String); 3] = [
        (
            "empty val.bin",
            &good,
            &[],
            "val.bin holds 0 tokens but one sample needs 49".into(),
        ),
        (
            "val.bin out of vocabulary",
            &good,
            &one_bad,
            "val.bin has token id 64 at token index 4000 (byte offset 8000), but the model's vocab_size is 64".into(),
        ),
        (
            "train.bin out of vocabulary late",
            &late_bad,
            &good,
            "train.bin has token id 900".into(),
        ),
    ];
    for (i, (what, train, val, needle)) in cases.iter().enumerate() {
        let data = dir.join(format!("data-{i}"));
        std::fs::create_dir_all(&data).unwrap();
        std::fs::write(data.join("train.bin"), train).unwrap();
        std::fs::write(data.join("val.bin"), val).unwrap();
        let run = dir.join(format!("run-{i}"));
        let err = run_err(
            seqpipe()
                .args(["train", "-q"])
                .args(tiny_model_args())
                .args(["--set", "train.steps=4", "--set", "train.eval_every=1"])
                .args(["--set", "pipeline.stages=2"])
                .arg("--set")
                .arg(format!("data.source={}", data.display()))
                .arg("--set")
                .arg(format!("run.dir={}", run.display())),
        );
        assert!(err.contains(needle.as_str()), "{what}: {err}");
        if what.starts_with("val.bin") || what.starts_with("empty") {
            // The launcher's own check, not a worker's report at the first evaluation.
            assert!(
                !err.contains("stage 0:") && !err.contains("stage 1:"),
                "{what}: not caught at start-up:\n{err}"
            );
        }
        assert!(
            !err.contains("lost") && !err.contains("seqpipe resume"),
            "{what}: a data error was treated as a node loss:\n{err}"
        );
        // No metrics.jsonl at all: stopped before the run began.
        let events = if run.join("metrics.jsonl").exists() {
            run_events(&run)
        } else {
            Vec::new()
        };
        assert!(
            events.iter().all(|e| !matches!(
                e,
                trainer::runtime::events::RunEvent::NodeLost(_)
                    | trainer::runtime::events::RunEvent::Recovered(_)
            )),
            "{what}: {events:?}"
        );
    }
}
