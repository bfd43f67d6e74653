//! Checkpoint write/read throughput to a local directory and to a SeaweedFS S3 server started
//! here: `write_shard` (format + hashing + upload) against `raw_write_probe` (upload only).
//!
//! ```text
//! cargo run --release -p checkpoint --example throughput -- [MB] [DIR]
//! ```
//! MB defaults to 100; DIR (the local target) defaults to a fresh directory under the system
//! temp dir. The official numbers come from `seqpipe bench checkpoint`.

use std::time::Instant;

use checkpoint::testing::SeaweedFs;
use checkpoint::{CheckpointStore, Dtype, Manifest, StoreOptions, TensorData};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mb: usize = args
        .get(1)
        .map_or(100, |s| s.parse().expect("MB must be a number"));
    let dir = args.get(2).cloned().unwrap_or_else(|| {
        std::env::temp_dir()
            .join(format!("seqpipe-ckpt-throughput-{}", std::process::id()))
            .display()
            .to_string()
    });

    // 4 MiB f32 tensors adding up to about `mb` MB of pseudo-random data.
    let tensor_bytes = 4 << 20;
    let count = (mb * 1_000_000).div_ceil(tensor_bytes);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let tensors: Vec<(String, TensorData)> = (0..count)
        .map(|i| {
            let data: Vec<u8> = (0..tensor_bytes)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            (
                format!("h.{i}.mlp.c_fc.weight"),
                TensorData::new(Dtype::F32, vec![tensor_bytes / 4], data),
            )
        })
        .collect();
    let total = count * tensor_bytes;
    println!(
        "{count} tensors, {:.1} MB per checkpoint, part size {} MiB",
        total as f64 / 1e6,
        checkpoint::DEFAULT_PART_SIZE >> 20
    );

    bench(
        "local disk",
        &dir,
        &StoreOptions::default(),
        &tensors,
        total,
    )
    .await;
    let _ = std::fs::remove_dir_all(&dir);

    let server = SeaweedFs::start();
    bench(
        "SeaweedFS S3",
        &server.url("bench"),
        &server.store_options(),
        &tensors,
        total,
    )
    .await;
}

async fn bench(
    label: &str,
    url: &str,
    options: &StoreOptions,
    tensors: &[(String, TensorData)],
    total: usize,
) {
    let store = CheckpointStore::open(url, options).expect("opening the store");
    let mbps = |secs: f64| total as f64 / 1e6 / secs;
    // Warm-up (connections, volume allocation), not reported.
    store.raw_write_probe(8 << 20).await.expect("warm-up probe");
    // Rounds alternate which write goes first, so neither always pays for the other's
    // leftovers (page-cache writeback on a local disk).
    for round in 1..=4u64 {
        let mut raw = 0.0;
        if round % 2 == 1 {
            raw = store.raw_write_probe(total).await.expect("raw probe");
        }
        let (cpu0, t) = (cpu_secs(), Instant::now());
        let shard = store
            .write_shard(round, "stage0", tensors.to_vec())
            .await
            .expect("write_shard");
        let write = t.elapsed().as_secs_f64();
        let write_cpu = cpu_secs() - cpu0;
        if round % 2 == 0 {
            raw = store.raw_write_probe(total).await.expect("raw probe");
        }
        let manifest = Manifest::new(round, vec![shard], serde_json::json!({}));
        store.commit(&manifest).await.expect("commit");
        let names: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
        let t = Instant::now();
        store
            .read_tensors(&manifest, &names)
            .await
            .expect("read_tensors");
        let read = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let report = store.verify(&manifest).await.expect("verify");
        assert!(report.is_ok(), "{report}");
        let verify = t.elapsed().as_secs_f64();
        println!(
            "{label:>13} round {round}: raw_write_probe {:7.1} MB/s | write_shard {:7.1} MB/s ({:3.0}% of raw, {write_cpu:.2} s CPU) | read_tensors {:7.1} MB/s | verify {:7.1} MB/s",
            mbps(raw),
            mbps(write),
            100.0 * raw / write,
            mbps(read),
            mbps(verify)
        );
    }
    store.retain(1).await.expect("retain");
}

/// CPU seconds (user + system) this process has used so far (Linux; 0 elsewhere).
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    f.iter().sum::<f64>() / 100.0 // USER_HZ
}
