//! The core suite against a real S3 server: SeaweedFS started by the test (never skipped: a
//! missing `weed` binary fails the test with how to install it).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use checkpoint::testing::SeaweedFs;
use common::{Backend, run};

/// One server for the whole suite (starting one takes seconds); each scenario gets its own
/// prefix in the bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seaweedfs_core_suite() {
    let server = Arc::new(SeaweedFs::start());
    let counter = Arc::new(AtomicUsize::new(0));
    let b = {
        let server = server.clone();
        Backend::new("s3", 5 * 1024 * 1024, server.store_options(), move || {
            server.url(&format!(
                "suite/{}",
                counter.fetch_add(1, Ordering::Relaxed)
            ))
        })
    };
    run("round_trip", common::round_trip(&b)).await;
    run(
        "shard_is_valid_safetensors",
        common::shard_is_valid_safetensors(&b),
    )
    .await;
    run("multipart (3 parts of 5 MiB)", common::multipart(&b)).await;
    run(
        "commit_twice_and_race (S3 412)",
        common::commit_twice_and_race(&b),
    )
    .await;
    run(
        "uncommitted_is_not_a_checkpoint",
        common::uncommitted_is_not_a_checkpoint(&b),
    )
    .await;
    run("read_by_range", common::read_by_range(&b)).await;
    run(
        "flipped_byte_is_corrupt",
        common::flipped_byte_is_corrupt(&b),
    )
    .await;
    run(
        "truncated_or_missing_shard_is_corrupt",
        common::truncated_or_missing_shard_is_corrupt(&b),
    )
    .await;
    run("commit_checks_shards", common::commit_checks_shards(&b)).await;
    run("retain_keeps_newest", common::retain_keeps_newest(&b)).await;
    run(
        "clean_stale_removes_only_garbage",
        common::clean_stale_removes_only_garbage(&b),
    )
    .await;
    run(
        "clean_interrupted_uploads_removes_only_staging",
        common::clean_interrupted_uploads_removes_only_staging(&b),
    )
    .await;
    run(
        "throttled_upload_is_slow",
        common::throttled_upload_is_slow(&b),
    )
    .await;
    run(
        "invalid_inputs_are_refused",
        common::invalid_inputs_are_refused(&b),
    )
    .await;
    run(
        "probe_writes_and_cleans_up",
        common::probe_writes_and_cleans_up(&b),
    )
    .await;
    // Prefixes isolate locations: the suite's many steps never leaked into a fresh prefix.
    let fresh = b.store();
    assert!(fresh.list().await.unwrap().is_empty());
}

/// Several writers race to commit the same step on S3: the conditional create (If-None-Match: *
/// → 412) lets exactly one win.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seaweedfs_commit_race_has_one_winner() {
    let server = SeaweedFs::start();
    let store =
        checkpoint::CheckpointStore::open(&server.url("race"), &server.store_options()).unwrap();
    let mut manifests = Vec::new();
    for i in 0..6u64 {
        let shard = store
            .write_shard(1, &format!("w{i}"), common::sample("", i))
            .await
            .unwrap();
        manifests.push(checkpoint::Manifest::new(
            1,
            vec![shard],
            serde_json::json!(i),
        ));
    }
    let results = futures::future::join_all(manifests.iter().map(|m| store.commit(m))).await;
    let winners: Vec<usize> = (0..results.len()).filter(|&i| results[i].is_ok()).collect();
    assert_eq!(winners.len(), 1, "{results:?}");
    for r in &results {
        if let Err(e) = r {
            assert!(
                matches!(
                    e,
                    checkpoint::CheckpointError::AlreadyCommitted { step: 1, .. }
                ),
                "{e}"
            );
        }
    }
    assert_eq!(store.read_manifest(1).await.unwrap(), manifests[winners[0]]);
    // The losers' shards are orphans; clean_stale removes exactly them.
    assert_eq!(store.clean_stale(2).await.unwrap().len(), 5);
}
