//! Document masks on a sharded dataset in object storage (issues 31 + 32), end to end with the
//! real binary and a real SeaweedFS S3 server: `data prepare --out s3://…` records the tokenizer's
//! end-of-text token in the dataset's `index.json`, the sharded source hands it to the masks, and
//! masked training from the bucket learns and ends bit-identical to masked training from the same
//! corpus prepared as a local single-file dataset (the rows and the document starts the first
//! stage computes from them are those of the single-file dataset, checked through the library),
//! and differs from unmasked training (the masks did act). An index written before the separator
//! was recorded still trains without masks and is refused with them, naming the dataset and what
//! to do.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use checkpoint::testing::{SeaweedFs, read_object, write_object};
use common::*;
use trainer::config::Config;
use trainer::data::shards::DatasetIndex;
use trainer::data::{
    ShardedSource, Split, TokenSource, document_separator, document_starts, micro_batch_tokens,
    open_source,
};

/// `<|endoftext|>` in GPT-2 BPE.
const GPT2_EOT: u32 = 50256;
const STEPS: u64 = 12;

/// A JSONL corpus of 150 short, distinct documents (about 4 to 25 GPT-2 tokens each), so that a
/// 32-token row holds several documents.
fn corpus(dir: &Path) -> PathBuf {
    let path = dir.join("corpus.jsonl");
    let lines: Vec<String> = (0..150)
        .map(|i| {
            let words: String = (0..(1 + i % 9))
                .map(|w| format!(" w{}", (i * 31 + w * 7) % 53))
                .collect();
            format!("{{\"text\": \"Doc {i}{words}.\"}}")
        })
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// The `--set` assignments of the jobs: a small GPT-2-vocabulary model, 2 stages of 2 segments,
/// 2 micro-batches of 2 rows of 32 tokens, checkpoints every 6 steps.
fn sets(run_dir: &Path, source: &str, extra: &[&str]) -> Vec<String> {
    [
        "model.vocab_size=50257",
        "model.layers=2",
        "model.d_model=32",
        "model.heads=2",
        "model.max_seq_len=32",
        "train.seq_len=32",
        "train.micro_batch_size=2",
        "pipeline.stages=2",
        "pipeline.splits=2",
        "pipeline.microbatches=2",
        "train.eval_every=0",
        "checkpoint.every=6",
        "data.read_attempts=2",
        "data.read_timeout_s=10",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("train.steps={STEPS}")])
    .chain(extra.iter().map(|s| s.to_string()))
    .chain([
        format!("data.source={source}"),
        format!("run.dir={}", run_dir.display()),
    ])
    .collect()
}

fn train(sets: &[String]) -> Command {
    let mut cmd = seqpipe();
    cmd.args(["train", "-q"]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd
}

/// Every training row of the run `sets` describes, from `src`, and its document starts (the
/// first stage's: `document_starts(row[..seq_len], separator)`).
fn rows_and_starts(cfg: &Config, src: &dyn TokenSource) -> (Vec<Vec<u32>>, Vec<Vec<usize>>) {
    let eot = document_separator(&cfg.data, src)
        .unwrap()
        .expect("masks are on");
    assert_eq!(eot, GPT2_EOT, "{}", src.describe());
    let (b, t) = (cfg.train.micro_batch_size, cfg.train.seq_len);
    let mut rows = Vec::new();
    for step in 1..=STEPS {
        for mb in 0..cfg.pipeline.microbatches {
            let tokens =
                micro_batch_tokens(src, Split::Train, cfg.train.seed, step, mb as u64, b, t)
                    .unwrap();
            rows.extend(tokens.chunks_exact(t + 1).map(<[u32]>::to_vec));
        }
    }
    let starts = rows
        .iter()
        .map(|row| document_starts(&row[..t], eot))
        .collect();
    (rows, starts)
}

#[test]
fn masked_training_from_s3_learns_and_equals_the_local_single_file_dataset() {
    let s3 = SeaweedFs::start();
    let dir = fresh_dir("docmask-s3");
    let input = corpus(&dir);
    let local = dir.join("local");
    run_ok(
        seqpipe()
            .args(["data", "prepare", "--input"])
            .arg(&input)
            .arg("--out")
            .arg(&local),
    );
    // Small shards and blocks, so rows span shards.
    let url = s3.url("datasets/docs");
    run_ok(
        seqpipe()
            .current_dir(&dir)
            .envs(s3.env())
            .args(["data", "prepare", "--input"])
            .arg(&input)
            .args([
                "--out",
                &url,
                "--shard-bytes",
                "1024",
                "--chunk-bytes",
                "256",
            ]),
    );
    let store = checkpoint::CheckpointStore::open(&url, &s3.store_options()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let index_bytes = rt.block_on(read_object(&store, "index.json")).unwrap();
    let index = DatasetIndex::parse(&index_bytes, &url).unwrap();
    assert_eq!(index.end_of_text, Some(GPT2_EOT), "index.json records it");
    assert!(
        index.train.shards.len() >= 3,
        "{}",
        index.train.shards.len()
    );
    assert_eq!(index.train.documents + index.val.documents, 150);

    // The rows and the document starts the first stage computes are those of the local dataset,
    // with several documents in most rows.
    let masks = ["data.document_mask=true"];
    let cfg = |source: &str| Config::load(None, &sets(&dir, source, &masks)).unwrap();
    let local_cfg = cfg(local.to_str().unwrap());
    let local_src = open_source(&local_cfg.data, 50257).unwrap();
    let s3_cfg = cfg(&url);
    let s3_src = ShardedSource::open_with_store(&s3_cfg.data, 50257, store.objects()).unwrap();
    let (local_rows, local_starts) = rows_and_starts(&local_cfg, local_src.as_ref());
    let (s3_rows, s3_starts) = rows_and_starts(&s3_cfg, &s3_src);
    assert_eq!(s3_rows, local_rows);
    assert_eq!(s3_starts, local_starts);
    let documents: usize = s3_starts.iter().map(Vec::len).sum();
    assert!(
        documents >= 3 * s3_starts.len(),
        "too few documents per row for masks to matter: {s3_starts:?}"
    );
    drop(s3_src);

    let local_run = dir.join("run-local");
    run_ok(&mut train(&sets(
        &local_run,
        local.to_str().unwrap(),
        &masks,
    )));
    let (step, reference) = final_state(&ckpt_url(&local_run));
    assert_eq!(step, STEPS);

    let cache = format!("data.cache_dir={}", dir.join("cache").display());
    let s3_run = dir.join("run-s3");
    run_ok(train(&sets(&s3_run, &url, &[masks[0], &cache])).envs(s3.env()));
    assert_final_state(&s3_run, STEPS, &reference);
    let l = losses(&s3_run);
    assert_eq!(l, losses(&local_run));
    assert_eq!(l.len() as u64, STEPS);
    let (head, tail) = (
        l[..3].iter().sum::<f64>() / 3.0,
        l[l.len() - 3..].iter().sum::<f64>() / 3.0,
    );
    assert!(tail < head - 0.1, "masked training did not learn: {l:?}");

    // Without masks the same job computes something else: the masks acted.
    let unmasked = dir.join("run-s3-unmasked");
    run_ok(train(&sets(&unmasked, &url, &[&cache])).envs(s3.env()));
    let (_, plain) = final_state(&ckpt_url(&unmasked));
    assert!(plain != reference, "masks changed nothing");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_index_without_end_of_text_trains_unmasked_and_is_refused_for_masks() {
    let s3 = SeaweedFs::start();
    let dir = fresh_dir("docmask-s3-old");
    let input = corpus(&dir);
    let url = s3.url("datasets/old");
    run_ok(
        seqpipe()
            .current_dir(&dir)
            .envs(s3.env())
            .args(["data", "prepare", "--input"])
            .arg(&input)
            .args(["--out", &url]),
    );
    // The index as `data prepare` wrote it before it recorded the separator.
    let store = checkpoint::CheckpointStore::open(&url, &s3.store_options()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut index: serde_json::Value =
        serde_json::from_slice(&rt.block_on(read_object(&store, "index.json")).unwrap()).unwrap();
    assert_eq!(index["end_of_text"], GPT2_EOT);
    index.as_object_mut().unwrap().remove("end_of_text");
    rt.block_on(write_object(
        &store,
        "index.json",
        serde_json::to_vec_pretty(&index).unwrap().into(),
    ))
    .unwrap();

    let cache = format!("data.cache_dir={}", dir.join("cache").display());
    let masked = dir.join("run-masked");
    let err = run_err(
        train(&sets(
            &masked,
            &url,
            &["data.document_mask=true", &cache, "train.steps=2"],
        ))
        .envs(s3.env()),
    );
    assert!(
        err.contains("data.document_mask = true needs the dataset's end-of-text token")
            && err.contains(&format!("sharded dataset at {url}"))
            && err.contains("index.json was written before `seqpipe data prepare` recorded")
            && err.contains("prepare the corpus again with `seqpipe data prepare --out URL`"),
        "{err}"
    );
    // Refused before any step: no step was recorded.
    let metrics = std::fs::read_to_string(masked.join("metrics.jsonl")).unwrap_or_default();
    assert!(!metrics.contains("\"loss\""), "{metrics}");

    let plain = dir.join("run-plain");
    run_ok(train(&sets(&plain, &url, &[&cache, "train.steps=2"])).envs(s3.env()));
    let l = losses(&plain);
    assert_eq!(l.len(), 2);
    assert!(l.iter().all(|x| x.is_finite()), "{l:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
