//! Datasets in object storage (issue 31), end to end with the real binary and a real SeaweedFS S3
//! server: `data prepare --out s3://…` writes a sharded dataset (never a local directory named
//! `s3:`), and training from it — cold cache, warm cache, a cache smaller than the data, a cache
//! with a flipped byte, stopped and resumed on another stage count with an empty cache — ends
//! bit-identical to training from the local single-file dataset. A shard deleted from the bucket,
//! before a resumed run or while a run goes on, stops the run with a data error naming it, no node
//! is lost, and the previous checkpoint stays loadable. Each stage fetches from the bucket at most
//! 1.1 bytes per byte of the tokens it uses.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use checkpoint::testing::{SeaweedFs, delete_object, read_object};
use common::*;
use trainer::runtime::events::RunEvent;

/// A JSONL corpus of 80 short, distinct documents (~ 5k GPT-2 tokens).
fn corpus(dir: &Path) -> PathBuf {
    let path = dir.join("corpus.jsonl");
    let lines: Vec<String> = (0..80)
        .map(|i| {
            let words: String = (0..(20 + i % 17))
                .map(|w| format!("word{} ", (i * 31 + w * 7) % 113))
                .collect();
            format!("{{\"text\": \"Document {i} says {words}and ends here.\"}}")
        })
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// `train` on `source` with a small GPT-2-vocabulary model, 2 stages, 6 steps, checkpoints every
/// 3 steps into `run_dir`.
fn job(run_dir: &Path, source: &str, extra: &[&str]) -> Command {
    let mut cmd = seqpipe();
    cmd.args(["train", "-q"]);
    for s in [
        "model.vocab_size=50257",
        "model.layers=2",
        "model.d_model=32",
        "model.heads=2",
        "model.max_seq_len=16",
        "train.seq_len=16",
        "train.micro_batch_size=2",
        "pipeline.stages=2",
        "pipeline.splits=2",
        "train.steps=6",
        "train.eval_every=0",
        "checkpoint.every=3",
        "data.read_attempts=2",
        "data.read_timeout_s=10",
    ]
    .iter()
    .chain(extra)
    {
        cmd.args(["--set", s]);
    }
    cmd.arg("--set")
        .arg(format!("data.source={source}"))
        .arg("--set")
        .arg(format!("run.dir={}", run_dir.display()));
    cmd
}

/// A dataset `seqpipe data prepare` wrote into the bucket, and what the tests read it back with.
struct Prepared {
    /// What `data prepare` printed (and its status).
    out: std::process::Output,
    store: checkpoint::CheckpointStore,
    rt: tokio::runtime::Runtime,
    /// `index.json` as read back from the bucket.
    index: trainer::data::shards::DatasetIndex,
}

/// `seqpipe data prepare` of `inputs` into `url` on `s3` (run in `dir`) with the given shard and
/// chunk sizes, then its `index.json` read back from the bucket.
fn prepare_in_bucket(
    s3: &SeaweedFs,
    dir: &Path,
    inputs: &[PathBuf],
    url: &str,
    shard_bytes: u64,
    chunk_bytes: u64,
) -> Prepared {
    let out = run_ok(
        seqpipe()
            .current_dir(dir)
            .envs(s3.env())
            .args(["data", "prepare", "--input"])
            .args(inputs)
            .args(["--out", url])
            .arg("--shard-bytes")
            .arg(shard_bytes.to_string())
            .arg("--chunk-bytes")
            .arg(chunk_bytes.to_string()),
    );
    let store = checkpoint::CheckpointStore::open(url, &s3.store_options()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let index_bytes = rt.block_on(read_object(&store, "index.json")).unwrap();
    let index = trainer::data::shards::DatasetIndex::parse(&index_bytes, url).unwrap();
    Prepared {
        out,
        store,
        rt,
        index,
    }
}

fn cache_files(cache: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(cache)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|d| d.path().is_dir())
        .flat_map(|d| std::fs::read_dir(d.path()).unwrap().flatten())
        .map(|f| f.path())
        .collect();
    files.sort();
    files
}

fn cache_bytes(cache: &Path) -> u64 {
    cache_files(cache)
        .iter()
        // A file evicted between the listing and the stat counts 0.
        .map(|f| f.metadata().map_or(0, |m| m.len()))
        .sum()
}

/// Today's bug: `--out s3:bucket/ds` (a URL missing its `//`) made a local directory `s3:`.
#[test]
fn prepare_refuses_a_mangled_url_and_writes_nothing() {
    let dir = fresh_dir("ds-mangled");
    let input = corpus(&dir);
    let err = run_err(
        seqpipe()
            .current_dir(&dir)
            .args(["data", "prepare", "--input"])
            .arg(&input)
            .args(["--out", "s3:bucket/ds"]),
    );
    assert!(
        err.contains("s3:bucket/ds") && err.contains("s3://"),
        "{err}"
    );
    assert!(!dir.join("s3:bucket").exists() && !dir.join("s3:").exists());
}

#[test]
fn s3_dataset_trains_bit_identical_to_local_through_cold_warm_small_and_corrupt_caches() {
    let s3 = SeaweedFs::start();
    let dir = fresh_dir("ds-s3");
    let input = corpus(&dir);
    let local = dir.join("local");
    run_ok(
        seqpipe()
            .args(["data", "prepare", "--input"])
            .arg(&input)
            .arg("--out")
            .arg(&local),
    );
    // Small shards and chunks, so a run reads many objects and ranges.
    let url = s3.url("datasets/corpus");
    let Prepared {
        out,
        store,
        rt,
        index,
    } = prepare_in_bucket(&s3, &dir, std::slice::from_ref(&input), &url, 2048, 256);
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        printed.contains(&format!("wrote {url}/index.json")),
        "{printed}"
    );
    assert!(printed.contains(&format!("data.source={url}")), "{printed}");
    // Nothing local named after the scheme: the data went to the bucket.
    assert!(!dir.join("s3:").exists());
    assert!(
        index.train.shards.len() >= 3,
        "{:?}",
        index.train.shards.len()
    );
    assert_eq!(index.train.documents + index.val.documents, 80);
    // A second prepare to the same place is refused: a dataset is never overwritten.
    let err = run_err(
        seqpipe()
            .envs(s3.env())
            .args(["data", "prepare", "--input"])
            .arg(&input)
            .args(["--out", &url]),
    );
    assert!(err.contains("already holds a dataset"), "{err}");

    let local_run = dir.join("run-local");
    run_ok(&mut job(&local_run, local.to_str().unwrap(), &[]));
    let (step, reference) = final_state(&ckpt_url(&local_run));
    assert_eq!(step, 6);

    let cache = dir.join("cache");
    let cache_set = format!("data.cache_dir={}", cache.display());
    for pass in ["cold", "warm"] {
        let run = dir.join(format!("run-{pass}"));
        let mut cmd = job(&run, &url, &[&cache_set]);
        run_ok(cmd.envs(s3.env()));
        assert_final_state(&run, 6, &reference);
        assert!(!cache_files(&cache).is_empty(), "{pass}: nothing cached");
    }
    // Stopped after 3 steps and resumed from the checkpoint on one stage instead of two, each
    // half with an empty cache of its own: still bit-identical to the local run.
    let run = dir.join("run-resumed");
    let half = |n: &str| {
        format!(
            "data.cache_dir={}",
            dir.join(format!("cache-{n}")).display()
        )
    };
    run_ok(job(&run, &url, &[&half("a"), "train.steps=3"]).envs(s3.env()));
    run_ok(
        job(&run, &url, &[&half("b"), "pipeline.stages=1"])
            .args(["--resume", "latest"])
            .envs(s3.env()),
    );
    assert_final_state(&run, 6, &reference);
    assert!(
        run_events(&run)
            .iter()
            .any(|e| matches!(e, RunEvent::Resumed(r) if r.step == 3)),
        "the second half did not resume from step 3"
    );

    // Flip a byte in every cached chunk: each is detected, discarded and fetched again; the run
    // is still bit-identical and the cache holds the right bytes again.
    let files = cache_files(&cache);
    let originals: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    for f in &files {
        let mut bytes = std::fs::read(f).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x20;
        std::fs::write(f, bytes).unwrap();
    }
    let run = dir.join("run-flipped");
    run_ok(job(&run, &url, &[&cache_set]).envs(s3.env()));
    assert_final_state(&run, 6, &reference);
    let repaired = files
        .iter()
        .zip(&originals)
        .filter(|(f, o)| std::fs::read(f).ok().as_ref() == Some(o))
        .count();
    assert!(repaired > 0, "no flipped chunk was fetched again");
    for f in cache_files(&cache) {
        let b = std::fs::read(&f).unwrap();
        assert!(
            originals.contains(&b) || !files.contains(&f),
            "{} still corrupt",
            f.display()
        );
    }

    // A cache of 4 chunks (the run touches far more): never over the bound, same result.
    let small = dir.join("small-cache");
    let run = dir.join("run-small");
    let mut child = job(
        &run,
        &url,
        &[
            &format!("data.cache_dir={}", small.display()),
            "data.cache_bytes=1024",
        ],
    )
    .envs(s3.env())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let mut peak = 0;
    let status = loop {
        peak = peak.max(cache_bytes(&small));
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(status.success(), "small-cache run failed");
    assert!(
        peak <= 1024 && cache_bytes(&small) <= 1024,
        "cache peaked at {peak} bytes"
    );
    assert!(cache_bytes(&small) > 0);
    assert_final_state(&run, 6, &reference);

    // A train shard deleted from the bucket (and no cache to hide it): the resumed run stops
    // with a data error naming the object, no node is lost, and step 6 stays loadable.
    for shard in &index.train.shards {
        rt.block_on(delete_object(&store, &shard.key)).unwrap();
    }
    let run = dir.join("run-deleted");
    let resume_from = ckpt_url(&dir.join("run-cold"));
    let err = run_err(
        job(
            &run,
            &url,
            &[
                "data.cache_bytes=0",
                "train.steps=9",
                &format!("checkpoint.url={resume_from}"),
            ],
        )
        .args(["--resume", "latest"])
        .envs(s3.env()),
    );
    assert!(
        err.contains(&format!("dataset object {url}/train/")) && err.contains("is missing"),
        "{err}"
    );
    assert!(err.contains("not a node failure"), "{err}");
    // Stopped on the data error (the CLI's closing hint names the checkpoint to resume from),
    // not retried as lost nodes.
    assert!(!err.contains("lost"), "{err}");
    assert!(
        err.contains("newest committed checkpoint is step 6"),
        "{err}"
    );
    let events = if run.join("metrics.jsonl").exists() {
        run_events(&run)
    } else {
        Vec::new()
    };
    assert!(
        events
            .iter()
            .all(|e| !matches!(e, RunEvent::NodeLost(_) | RunEvent::Recovered(_))),
        "{events:?}"
    );
    let (step, state) = final_state(&resume_from);
    assert_eq!(step, 6);
    assert_eq!(state, reference);
}

/// A real multi-document corpus shipped by a Debian package (base-files' license texts, ~73k GPT-2
/// tokens), prepared straight into the bucket and trained on for a few steps.
#[test]
fn a_real_corpus_prepared_into_s3_trains() {
    let licenses = Path::new("/usr/share/common-licenses");
    assert!(
        licenses.is_dir(),
        "{} is missing: install Debian's base-files package (it ships the corpus)",
        licenses.display()
    );
    let dir = fresh_dir("ds-licenses");
    let mut inputs = Vec::new();
    for entry in std::fs::read_dir(licenses).unwrap().flatten() {
        // Symlinks (GPL -> GPL-3, ...) would repeat a text.
        if entry.file_type().unwrap().is_file() {
            let copy = dir.join(format!("{}.txt", entry.file_name().to_string_lossy()));
            std::fs::copy(entry.path(), &copy).unwrap();
            inputs.push(copy);
        }
    }
    inputs.sort();
    assert!(inputs.len() >= 10, "{inputs:?}");
    let s3 = SeaweedFs::start();
    let url = s3.url("datasets/common-licenses");
    let index = prepare_in_bucket(&s3, &dir, &inputs, &url, 65536, 4096).index;
    assert_eq!(
        index.train.documents + index.val.documents,
        inputs.len() as u64
    );
    assert!(index.train.tokens > 50_000, "{}", index.train.tokens);
    let run = dir.join("run");
    let cache = format!("data.cache_dir={}", dir.join("cache").display());
    run_ok(job(&run, &url, &[&cache, "train.steps=3"]).envs(s3.env()));
    let losses = losses(&run);
    assert_eq!(losses.len(), 3);
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
}

/// A 2 × 2 elastic job reading from S3: a whole node (agent and workers) is SIGKILLed mid-run and
/// the cache directory emptied at the same moment, so the re-planned workers start with no cached
/// data; the run still ends bit-identical to the same job on the local single-file dataset.
#[test]
fn a_node_killed_mid_run_with_its_cache_emptied_stays_bit_identical() {
    const STEPS: u64 = 24;
    let s3 = SeaweedFs::start();
    let dir = fresh_dir("ds-kill");
    let local = dir.join("local");
    std::fs::create_dir_all(&local).unwrap();
    let ids = |n: u64, salt: u64| -> Vec<u8> {
        (0..n)
            .flat_map(|i| ((((i * 2654435761) ^ salt) >> 7) as u16 % 128).to_le_bytes())
            .collect()
    };
    std::fs::write(local.join("train.bin"), ids(40_000, 1)).unwrap();
    std::fs::write(local.join("val.bin"), ids(2_000, 2)).unwrap();
    let meta = trainer::data::DatasetMeta {
        vocab_size: 128,
        dtype: trainer::data::TokenDtype::U16,
        tokenizer: "test".into(),
        train_tokens: 40_000,
        val_tokens: 2_000,
        end_of_text: None,
    };
    std::fs::write(
        local.join("meta.json"),
        serde_json::to_string(&meta).unwrap(),
    )
    .unwrap();
    let url = s3.url("datasets/kill");
    let target = trainer::data::shards::Target {
        url: url.clone(),
        store: checkpoint::CheckpointStore::open(&url, &s3.store_options())
            .unwrap()
            .objects(),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let layout = trainer::data::shards::ShardLayout::with_default_blocks(8192, 1024);
    rt.block_on(trainer::data::shards::publish(
        &local, &meta, None, layout, &target,
    ))
    .unwrap();

    let two_by_two = ["--set", "pipeline.replicas=2", "--set", "pipeline.stages=2"];
    let reference_dir = dir.join("reference");
    run_ok(
        elastic_job(&reference_dir, STEPS)
            .args(two_by_two)
            .arg("--set")
            .arg(format!("data.source={}", local.display())),
    );
    let (_, reference) = final_state(&ckpt_url(&reference_dir));

    let run = dir.join("run");
    let cache = dir.join("cache");
    let mut child = elastic_job(&run, STEPS)
        .args(two_by_two)
        .arg("--set")
        .arg(format!("data.source={url}"))
        .arg("--set")
        .arg(format!("data.cache_dir={}", cache.display()))
        .envs(s3.env())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for_steps(&run, 3);
    let nodes = children_of(child.id());
    let agent = nodes[0];
    let mut victims = children_of(agent);
    victims.push(agent);
    let _ = std::fs::remove_dir_all(&cache);
    for pid in &victims {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "the run did not recover: {status}");
    assert!(
        run_events(&run)
            .iter()
            .any(|e| matches!(e, RunEvent::NodeLost(_))),
        "the kill landed after the run ended"
    );
    assert_final_state(&run, STEPS, &reference);
}

/// A train shard deleted from the bucket while the job is running (no cache to hide it): the job
/// stops within the read bound with a data error naming the object, no node is lost and no
/// recovery runs, and the checkpoint committed before the deletion stays loadable.
#[test]
fn a_shard_deleted_mid_run_stops_the_run_with_a_data_error_and_no_node_lost() {
    let s3 = SeaweedFs::start();
    let dir = fresh_dir("ds-deleted-mid-run");
    let input = corpus(&dir);
    let url = s3.url("datasets/mid-run");
    let Prepared {
        store, rt, index, ..
    } = prepare_in_bucket(&s3, &dir, &[input], &url, 2048, 256);
    let run = dir.join("run");
    // Far more steps than the deletion leaves time for; a checkpoint every 2 steps.
    let child = job(
        &run,
        &url,
        &[
            "data.cache_bytes=0",
            "train.steps=100000",
            "checkpoint.every=2",
        ],
    )
    .envs(s3.env())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    wait_for_steps(&run, 4);
    let deleted = std::time::Instant::now();
    for shard in &index.train.shards {
        rt.block_on(delete_object(&store, &shard.key)).unwrap();
    }
    let output = child.wait_with_output().unwrap();
    let took = deleted.elapsed();
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the run went on: {err}");
    // The job's bound: read_attempts (2) × read_timeout_s (10) plus 0.2 s of backoff, and the
    // shutdown; the store answers "not found" at once, so this is far from tight.
    assert!(
        took < std::time::Duration::from_secs(60),
        "the data error took {took:?}"
    );
    assert!(
        err.contains(&format!("dataset object {url}/train/")) && err.contains("is missing"),
        "{err}"
    );
    assert!(err.contains("not a node failure"), "{err}");
    let events = run_events(&run);
    assert!(
        events
            .iter()
            .all(|e| !matches!(e, RunEvent::NodeLost(_) | RunEvent::Recovered(_))),
        "{events:?}"
    );
    // The run was mid-way: it had trained steps, and the checkpoint it committed before the
    // deletion is whole (every tensor read back against its manifest's hash).
    assert!(steps_done(&run) >= 4);
    let (step, state) = final_state(&ckpt_url(&run));
    assert!(step >= 2 && step % 2 == 0, "{step}");
    assert!(!state.is_empty());
    assert!(
        err.contains(&format!("newest committed checkpoint is step {step}")),
        "{err}"
    );
}

/// Issue 31's last goal: a stage fetches from the store at most 1.1 bytes per byte of the tokens
/// it uses, with a cold cache, at the shape of `seqpipe bench data` (rows of 1024 u16 tokens,
/// micro-batches of 4 rows) on a dataset `publish`ed with the default layout to SeaweedFS: the
/// first stage (inputs), the last (targets), and a one-stage pipeline (whole rows); a middle
/// stage reads nothing. The tokens are the local dataset's.
#[test]
fn each_stage_fetches_at_most_a_tenth_more_bytes_than_it_uses() {
    use std::sync::atomic::Ordering;
    use trainer::data::{
        DataConfig, RowPart, ShardedSource, Split, TokenDtype, TokenFiles, micro_batch_part,
    };
    let s3 = SeaweedFs::start();
    let dir = fresh_dir("ds-bytes");
    let local = dir.join("local");
    std::fs::create_dir_all(&local).unwrap();
    // 1 Mi pseudo-random ids (2 MiB), so that rows rarely share bytes.
    let tokens: u64 = 1 << 20;
    let mut state = 1u64;
    let ids: Vec<u8> = (0..tokens + 4096)
        .flat_map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((state >> 33) % 50000) as u16).to_le_bytes()
        })
        .collect();
    let (train, val) = ids.split_at(2 * tokens as usize);
    std::fs::write(local.join("train.bin"), train).unwrap();
    std::fs::write(local.join("val.bin"), val).unwrap();
    let meta = trainer::data::DatasetMeta {
        vocab_size: 50257,
        dtype: TokenDtype::U16,
        tokenizer: "test".into(),
        train_tokens: tokens,
        val_tokens: 4096,
        end_of_text: None,
    };
    let url = s3.url("datasets/bytes");
    let store = checkpoint::CheckpointStore::open(&url, &s3.store_options())
        .unwrap()
        .objects();
    let target = trainer::data::shards::Target {
        url: url.clone(),
        store: store.clone(),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(trainer::data::shards::publish(
        &local,
        &meta,
        None,
        trainer::data::shards::ShardLayout::default(),
        &target,
    ))
    .unwrap();
    let files = TokenFiles::open(&local, TokenDtype::U16, 50257).unwrap();
    let (seq_len, rows, micro_batches, steps) = (1024, 4, 4, 3);
    for (first, last) in [(true, false), (false, false), (false, true), (true, true)] {
        let cfg = DataConfig {
            source: url.clone(),
            cache_dir: dir.join("cache").display().to_string(),
            // No cache: every byte a stage uses comes from the store.
            cache_bytes: 0,
            prefetch_steps: 0,
            read_attempts: 2,
            read_timeout_s: 30.0,
            ..DataConfig::default()
        };
        let src = ShardedSource::open_with_store(&cfg, 50257, store.clone()).unwrap();
        let Some(part) = RowPart::for_stage(first, last) else {
            // A middle stage opens no source; nothing was fetched by opening one.
            assert_eq!(src.stats().fetched_bytes.load(Ordering::Relaxed), 0);
            continue;
        };
        let mut used = 0;
        for step in 0..steps {
            for mb in 0..micro_batches {
                let got =
                    micro_batch_part(&src, Split::Train, 5, step, mb, rows, seq_len, part).unwrap();
                let want = micro_batch_part(&files, Split::Train, 5, step, mb, rows, seq_len, part)
                    .unwrap();
                assert_eq!(got, want, "{part:?}: step {step}, micro-batch {mb}");
                used += 2 * got.len() as u64;
            }
        }
        let fetched = src.stats().fetched_bytes.load(Ordering::Relaxed);
        let ratio = fetched as f64 / used as f64;
        eprintln!("{part:?}: {fetched} bytes fetched for {used} used ({ratio:.4})");
        assert!(
            ratio <= 1.1,
            "{part:?}: {fetched} bytes fetched for {used} bytes of tokens used ({ratio:.3} > 1.1)"
        );
        assert!(ratio >= 1.0, "{part:?}: {ratio}");
    }
}
