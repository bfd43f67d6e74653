//! `seqpipe bench data`: training data read from an object store next to the same data on local
//! disk, side by side in one run.
//!
//! The benchmark writes a token dataset (`--tokens` pseudo-random GPT-2 ids) to a local directory
//! (`train.bin`, the single-file layout) and, sharded, to a fresh folder under `--url` (removed
//! at the end). Reads go to the store through a proxy that adds `--delay-ms` to every request, so
//! a loopback SeaweedFS behaves like a store across a network. Each worker-side read is the one
//! the pipeline's workers make ([`micro_batch_part`] of the stage's [`RowPart`]); the compute of
//! a micro-batch is stood in for by a busy loop of `--compute-ms` (no model runs), so the step
//! times show what the data path adds to a step of that length. Per round:
//!
//! * **First unit**: from opening the source (a node's first read: for the store, its index) to
//!   holding the first micro-batch's inputs, with an empty cache, against the local directory.
//! * **Steady state**: the median step time over steps 2.. (step 0 reads cold, step 1 is not yet
//!   prefetched) of the first stage reading from the store with a cold cache (prefetch on, and
//!   off for contrast) and with a warm one (a second pass over the same steps), as ratios to the
//!   local directory.
//! * **Bytes per token**: bytes fetched from the store over bytes of the tokens the stage used,
//!   over the same steps read cold without prefetch (which reads past the last step), for the
//!   first stage (inputs), the last (targets) and a one-stage pipeline (whole rows), and where
//!   the bytes beyond the tokens come from: the rounding out of each row's part to whole blocks
//!   (or, with `--block-bytes 0`, a version 1 dataset, to whole chunks), the block checks, and
//!   the requests made. Middle stages open no source at all.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use checkpoint::{CheckpointStore, StoreOptions};
use clap::Args;
use object_store::ObjectStoreExt;

use super::step::median;
use trainer::data::shards::{ShardLayout, Target, publish};
use trainer::data::{
    DataConfig, DatasetMeta, RowPart, ShardedSource, Split, TokenDtype, TokenSource,
    micro_batch_part, open_source,
};

/// GPT-2's vocabulary; the generated ids are below it and `<|endoftext|>` is its last id.
const VOCAB: usize = 50257;
const EOT: u32 = 50256;
const SEED: u64 = 1;

/// Flags of `seqpipe bench data`.
#[derive(Args, Debug)]
pub struct DataBenchArgs {
    /// Object-store URL to write the benchmark's dataset under (`s3://bucket/prefix`; endpoint
    /// and credentials from AWS_*): a fresh `seqpipe-bench-data-<pid>-<time>` folder there,
    /// removed at the end.
    #[arg(long)]
    url: String,
    /// Rounds of every measurement.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Steps of each steady-state run (the median is over steps 2..).
    #[arg(long, default_value_t = 12)]
    steps: u64,
    /// Milliseconds added to every request to the store (a proxy in front of AWS_ENDPOINT);
    /// 0 = direct.
    #[arg(long, default_value_t = 20)]
    delay_ms: u64,
    /// Milliseconds of busy compute standing in for a micro-batch's forward and backward.
    #[arg(long, default_value_t = 100)]
    compute_ms: u64,
    /// Tokens of a sample row's inputs.
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    /// Rows per micro-batch.
    #[arg(long, default_value_t = 4)]
    micro_batch_size: usize,
    /// Micro-batches per step.
    #[arg(long, default_value_t = 4)]
    micro_batches: u64,
    /// Training tokens of the dataset.
    #[arg(long, default_value_t = 32 << 20)]
    tokens: u64,
    /// Bytes per shard object.
    #[arg(long, default_value_t = 4 << 20)]
    shard_bytes: u64,
    /// Bytes per chunk (the unit of BLAKE3 hashes in the index; with `--block-bytes 0`, the unit
    /// fetched, cached and verified).
    #[arg(long, default_value_t = 64 << 10)]
    chunk_bytes: u64,
    /// Bytes per checked block (the unit fetched: a row's part rounded out to whole blocks), a
    /// divisor of `--chunk-bytes`; 0 = a version 1 dataset, read by whole chunks.
    #[arg(long, default_value_t = trainer::data::shards::DEFAULT_BLOCK_BYTES)]
    block_bytes: u64,
    /// `data.prefetch_steps` of the store runs.
    #[arg(long, default_value_t = 2)]
    prefetch_steps: u64,
}

/// One round's numbers.
#[derive(Debug, Default)]
struct Round {
    first_local_s: f64,
    first_store_s: f64,
    step_local_s: f64,
    step_cold_s: f64,
    step_cold_no_prefetch_s: f64,
    step_warm_s: f64,
    warm_fetched_bytes: u64,
    /// Bytes fetched per byte of tokens used: inputs, targets, whole rows.
    per_token: [f64; 3],
    /// Where those bytes went, per part.
    bytes: [Bytes; 3],
}

/// The bytes of one part's cold read: used, fetched, and of those the block checks; requests.
#[derive(Clone, Copy, Debug, Default)]
struct Bytes {
    used: u64,
    fetched: u64,
    checks: u64,
    requests: u64,
}

impl Bytes {
    fn of(args: &DataBenchArgs, src: &ShardedSource, part: RowPart, width: u64) -> Bytes {
        let stats = src.stats();
        Bytes {
            used: args.steps
                * args.micro_batches
                * args.micro_batch_size as u64
                * part.span(args.seq_len).len() as u64
                * width,
            fetched: stats.fetched_bytes.load(Ordering::Relaxed),
            checks: stats.check_bytes.load(Ordering::Relaxed),
            requests: stats.requests.load(Ordering::Relaxed),
        }
    }

    /// `used U, fetched F = U + R rounding + C checks, N requests` per row.
    fn describe(&self, rows: u64) -> String {
        let data = self.fetched - self.checks;
        format!(
            "{:.0} used + {:.0} rounding + {:.0} checks = {:.0} fetched in {:.2} requests",
            self.used as f64 / rows as f64,
            data as f64 / rows as f64 - self.used as f64 / rows as f64,
            self.checks as f64 / rows as f64,
            self.fetched as f64 / rows as f64,
            self.requests as f64 / rows as f64,
        )
    }
}

/// `seqpipe bench data`.
pub fn run(args: &DataBenchArgs) -> Result<()> {
    ensure!(
        (1..=100).contains(&args.rounds),
        "--rounds must be 1 to 100"
    );
    ensure!(args.steps >= 3, "--steps must be at least 3");
    ensure!(
        args.seq_len >= 1 && args.micro_batch_size >= 1 && args.micro_batches >= 1,
        "--seq-len, --micro-batch-size and --micro-batches must be at least 1"
    );
    ensure!(
        args.tokens > 4 * (args.seq_len as u64 + 1),
        "--tokens must be well above --seq-len"
    );
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let name = format!("seqpipe-bench-data-{}-{stamp}", std::process::id());
    let dir = std::env::temp_dir().join(&name);
    std::fs::create_dir_all(&dir)?;
    let local = dir.join("local");
    write_local(
        &local,
        args.tokens,
        (args.tokens / 16).max(args.seq_len as u64 + 1),
    )?;
    let url = format!("{}/{name}", args.url.trim_end_matches('/'));
    let direct = CheckpointStore::open(&url, &StoreOptions::default())
        .with_context(|| format!("opening {url}"))?
        .objects();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let meta = DatasetMeta::read(&local)?.context("the local dataset has no meta.json")?;
    let layout = ShardLayout {
        shard_bytes: args.shard_bytes,
        chunk_bytes: args.chunk_bytes,
        block_bytes: args.block_bytes,
    };
    let target = Target {
        url: url.clone(),
        store: Arc::clone(&direct),
    };
    let index = rt.block_on(publish(&local, &meta, Some(EOT), layout, &target))?;
    let result = measure(args, &dir, &local, &url);
    // The index first: the dataset stops existing before its shards go.
    let mut keys = vec!["index.json".to_string()];
    keys.extend(index.train.shards.iter().map(|s| s.key.clone()));
    keys.extend(index.val.shards.iter().map(|s| s.key.clone()));
    for key in keys {
        let path = object_store::path::Path::from(key.as_str());
        if let Err(e) = rt.block_on(direct.delete(&path)) {
            eprintln!("warning: cannot remove {url}/{key}: {e}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn measure(args: &DataBenchArgs, dir: &Path, local: &Path, url: &str) -> Result<()> {
    let proxy = delay_proxy(args, url)?;
    let store_options = StoreOptions {
        s3_endpoint: proxy.clone(),
        read_only: true,
        ..StoreOptions::default()
    };
    let reads = CheckpointStore::open(url, &store_options)?.objects();
    let cfg = |source: &str, cache: &Path, prefetch_steps: u64| DataConfig {
        source: source.to_string(),
        cache_dir: cache.display().to_string(),
        prefetch_steps,
        ..DataConfig::default()
    };
    let sharded = |cache: &Path, prefetch_steps: u64| -> Result<ShardedSource> {
        Ok(ShardedSource::open_with_store(
            &cfg(url, cache, prefetch_steps),
            VOCAB,
            Arc::clone(&reads),
        )?)
    };
    let local_cfg = cfg(&local.display().to_string(), dir, 0);
    println!(
        "dataset: {} train tokens, {}-byte shards of {}-byte chunks{} at {url}; store latency +{} \
         ms a request{}; steps of {} micro-batches × {} rows × {} tokens, {} ms compute a \
         micro-batch, prefetch {} steps",
        args.tokens,
        args.shard_bytes,
        args.chunk_bytes,
        if args.block_bytes > 0 {
            format!(" and {}-byte checked blocks (version 2)", args.block_bytes)
        } else {
            " read whole (version 1, no blocks)".into()
        },
        args.delay_ms,
        proxy.map_or(String::new(), |p| format!(" (proxy {p})")),
        args.micro_batches,
        args.micro_batch_size,
        args.seq_len,
        args.compute_ms,
        args.prefetch_steps
    );
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        rounds.push(measure_round(args, round, dir, &local_cfg, &sharded)?);
    }
    report(args, &rounds)
}

/// The delaying proxy in front of the S3 server, when `--delay-ms` asks for one (its address).
fn delay_proxy(args: &DataBenchArgs, url: &str) -> Result<Option<String>> {
    Ok(if args.delay_ms > 0 {
        ensure!(
            url.starts_with("s3://"),
            "--delay-ms needs an s3:// --url (the delay is a proxy in front of AWS_ENDPOINT); \
             give --delay-ms 0 for other stores"
        );
        let endpoint = std::env::var("AWS_ENDPOINT")
            .context("--delay-ms needs AWS_ENDPOINT (http://host:port of the S3 server)")?;
        Some(start_proxy(
            &endpoint,
            Duration::from_millis(args.delay_ms),
        )?)
    } else {
        None
    })
}

/// One round of the bench: first units and steps from the local copy and the store, then the
/// bytes each stage's part of a row fetches.
fn measure_round(
    args: &DataBenchArgs,
    round: usize,
    dir: &Path,
    local_cfg: &DataConfig,
    sharded: &dyn Fn(&Path, u64) -> Result<ShardedSource>,
) -> Result<Round> {
    let width = TokenDtype::U16.width() as u64;
    let cache = |tag: &str| dir.join(format!("cache-{round}-{tag}"));
    let mut r = Round::default();
    // Time to the first unit's tokens, from opening the source.
    let started = Instant::now();
    let src = open_source(local_cfg, VOCAB)?;
    first_unit(args, &*src)?;
    r.first_local_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let src = sharded(&cache("first"), args.prefetch_steps)?;
    first_unit(args, &src)?;
    r.first_store_s = started.elapsed().as_secs_f64();
    drop(src);

    r.step_local_s = steady(&steps(
        args,
        &*open_source(local_cfg, VOCAB)?,
        RowPart::Inputs,
    )?);
    let cold = sharded(&cache("steps"), args.prefetch_steps)?;
    r.step_cold_s = steady(&steps(args, &cold, RowPart::Inputs)?);
    drop(cold);
    let warm = sharded(&cache("steps"), args.prefetch_steps)?;
    r.step_warm_s = steady(&steps(args, &warm, RowPart::Inputs)?);
    r.warm_fetched_bytes = warm.stats().fetched_bytes.load(Ordering::Relaxed);
    drop(warm);
    let no_prefetch = sharded(&cache("no-prefetch"), 0)?;
    r.step_cold_no_prefetch_s = steady(&steps(args, &no_prefetch, RowPart::Inputs)?);
    drop(no_prefetch);
    // Bytes only (no compute, no prefetch: it reads past the last step): the first stage's
    // inputs, the last stage's targets, and whole rows.
    let quick = DataBenchArgs {
        compute_ms: 0,
        url: String::new(),
        ..*args
    };
    for (slot, part) in [
        (0, RowPart::Inputs),
        (1, RowPart::Targets),
        (2, RowPart::Both),
    ] {
        let src = sharded(&cache(&format!("{part:?}")), 0)?;
        steps(&quick, &src, part)?;
        r.bytes[slot] = Bytes::of(args, &src, part, width);
        r.per_token[slot] = r.bytes[slot].fetched as f64 / r.bytes[slot].used as f64;
    }
    println!(
        "round {round}: first unit local {:.4} s, store (empty cache) {:.4} s ({:.1}x); step \
         local {:.4} s, store cold {:.4} s ({:.3}x), cold without prefetch {:.4} s ({:.3}x), \
         warm {:.4} s ({:.3}x, {} bytes fetched); fetched bytes per token byte: inputs \
         {:.2}, targets {:.2}, whole rows {:.2}",
        r.first_local_s,
        r.first_store_s,
        r.first_store_s / r.first_local_s,
        r.step_local_s,
        r.step_cold_s,
        r.step_cold_s / r.step_local_s,
        r.step_cold_no_prefetch_s,
        r.step_cold_no_prefetch_s / r.step_local_s,
        r.step_warm_s,
        r.step_warm_s / r.step_local_s,
        r.warm_fetched_bytes,
        r.per_token[0],
        r.per_token[1],
        r.per_token[2],
    );
    let rows = args.steps * args.micro_batches * args.micro_batch_size as u64;
    for (slot, what) in ["inputs", "targets", "whole rows"].iter().enumerate() {
        println!("  bytes per row, {what}: {}", r.bytes[slot].describe(rows));
    }
    Ok(r)
}

/// The min / median over the rounds of every figure, and the bytes per row of the first.
fn report(args: &DataBenchArgs, rounds: &[Round]) -> Result<()> {
    let stat = |f: &dyn Fn(&Round) -> f64| -> String {
        let v: Vec<f64> = rounds.iter().map(f).collect();
        format!(
            "{:.4} / {:.4}",
            v.iter().copied().fold(f64::INFINITY, f64::min),
            median(&v)
        )
    };
    println!("min / median over {} rounds:", rounds.len());
    println!("  first unit, local: {} s", stat(&|r| r.first_local_s));
    println!(
        "  first unit, store with an empty cache: {} s (ratio {}; {} s more)",
        stat(&|r| r.first_store_s),
        stat(&|r| r.first_store_s / r.first_local_s),
        stat(&|r| r.first_store_s - r.first_local_s)
    );
    println!("  step, local: {} s", stat(&|r| r.step_local_s));
    for (what, f) in [
        (
            "store, cold cache",
            &(|r: &Round| r.step_cold_s) as &dyn Fn(&Round) -> f64,
        ),
        ("store, cold cache, no prefetch", &|r: &Round| {
            r.step_cold_no_prefetch_s
        }),
        ("store, warm cache", &|r: &Round| r.step_warm_s),
    ] {
        println!(
            "  step, {what}: {} s (ratio to local {})",
            stat(f),
            stat(&|r| f(r) / r.step_local_s)
        );
    }
    let rows = args.steps * args.micro_batches * args.micro_batch_size as u64;
    println!(
        "  bytes per row read cold ({}: a row's part rounded out to whole {}{}):",
        if args.block_bytes > 0 {
            "version 2"
        } else {
            "version 1"
        },
        if args.block_bytes > 0 {
            "blocks"
        } else {
            "chunks, less the chunks another row had already cached"
        },
        if args.block_bytes > 0 {
            ", plus 4 check bytes a block"
        } else {
            ""
        }
    );
    for (slot, what) in [
        "first stage (inputs)",
        "last stage (targets)",
        "one stage (whole rows)",
    ]
    .iter()
    .enumerate()
    {
        println!("    {what}: {}", rounds[0].bytes[slot].describe(rows));
    }
    println!(
        "  bytes fetched per byte of tokens used (cold): first stage (inputs) {}, last stage \
         (targets) {}, one stage (whole rows) {}; warm cache: {} bytes fetched",
        stat(&|r| r.per_token[0]),
        stat(&|r| r.per_token[1]),
        stat(&|r| r.per_token[2]),
        rounds
            .iter()
            .map(|r| r.warm_fetched_bytes)
            .max()
            .unwrap_or(0)
    );
    Ok(())
}

/// The first stage's first unit: micro-batch 0 of step 0.
fn first_unit(args: &DataBenchArgs, src: &dyn TokenSource) -> Result<()> {
    micro_batch_part(
        src,
        Split::Train,
        SEED,
        0,
        0,
        args.micro_batch_size,
        args.seq_len,
        RowPart::Inputs,
    )?;
    Ok(())
}

/// Runs `args.steps` steps of one stage reading `part`: each micro-batch's tokens, then its
/// compute stand-in. Returns each step's wall time.
fn steps(args: &DataBenchArgs, src: &dyn TokenSource, part: RowPart) -> Result<Vec<f64>> {
    let compute = Duration::from_millis(args.compute_ms);
    let mut times = Vec::new();
    for step in 0..args.steps {
        let started = Instant::now();
        for micro_batch in 0..args.micro_batches {
            let tokens = micro_batch_part(
                src,
                Split::Train,
                SEED,
                step,
                micro_batch,
                args.micro_batch_size,
                args.seq_len,
                part,
            )?;
            std::hint::black_box(tokens);
            let end = Instant::now() + compute;
            while Instant::now() < end {
                std::hint::spin_loop();
            }
        }
        times.push(started.elapsed().as_secs_f64());
    }
    Ok(times)
}

/// The median step time over steps 2.. (step 0 reads cold, step 1 is not prefetched yet).
fn steady(times: &[f64]) -> f64 {
    median(&times[2..])
}

/// A dataset of `train` + `val` pseudo-random GPT-2 ids (documents of 200 to 1200 tokens, each
/// ended by `<|endoftext|>`) in the single-file layout.
fn write_local(dir: &Path, train: u64, val: u64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        // SplitMix64.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    for (file, n) in [("train.bin", train), ("val.bin", val)] {
        let mut bytes = Vec::with_capacity(2 * n as usize);
        let mut left = 0;
        for _ in 0..n {
            let id = if left == 0 {
                left = 200 + next() % 1000;
                EOT
            } else {
                left -= 1;
                (next() % u64::from(EOT)) as u32
            };
            bytes.extend_from_slice(&(id as u16).to_le_bytes());
        }
        std::fs::write(dir.join(file), bytes)?;
    }
    let meta = DatasetMeta {
        vocab_size: VOCAB,
        dtype: TokenDtype::U16,
        tokenizer: "gpt2".into(),
        train_tokens: train,
        val_tokens: val,
        end_of_text: Some(EOT),
    };
    std::fs::write(dir.join("meta.json"), serde_json::to_string(&meta)?)?;
    Ok(())
}

/// A TCP proxy on a free loopback port in front of `endpoint` (`http://host:port`) that holds
/// every piece of a request for `delay` before passing it on (answers flow back undelayed).
/// Returns its `http://127.0.0.1:PORT`. Its threads live until the process ends.
fn start_proxy(endpoint: &str, delay: Duration) -> Result<String> {
    let Some(upstream) = endpoint.strip_prefix("http://") else {
        bail!("AWS_ENDPOINT {endpoint}: the delay proxy speaks plain http:// only");
    };
    let upstream = upstream.trim_end_matches('/').to_string();
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let address = format!("http://{}", listener.local_addr()?);
    std::thread::Builder::new()
        .name("bench-proxy".into())
        .spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let (Ok(client2), Ok(server2)) = (client.try_clone(), server.try_clone()) else {
                    continue;
                };
                std::thread::spawn(move || pipe(client, server, delay));
                std::thread::spawn(move || pipe(server2, client2, Duration::ZERO));
            }
        })?;
    Ok(address)
}

/// Copies `from` to `to`, holding each piece for `delay`, until either side closes.
fn pipe(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                std::thread::sleep(delay);
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
    let _ = from.shutdown(std::net::Shutdown::Both);
}
