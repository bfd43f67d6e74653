//! Google Cloud Storage (`gs://`) against fake-gcs-server started by the test (never skipped: a
//! missing emulator fails the test with how to install it), reached the way a user reaches an
//! emulator: `GOOGLE_SERVICE_ACCOUNT` naming a service-account file with `gcs_base_url`.
//!
//! The emulator serves the reads, listings and deletes of object_store's GCS client but none of
//! its writes (checkpoint::emulators, docs/checkpoints.md). So checkpoints are written by the
//! same store code into a local directory, put into the bucket object by object through the
//! emulator's own upload API, and read back as `gs://`: listing, manifests, ranged tensor reads,
//! verification, corruption, a damaged newest manifest, retention, stale-shard
//! cleanup and the read-only mode run on the GCS client. The last scenario pins the write gap:
//! when it fails, the emulator has learnt object_store's XML writes and the whole cloud suite
//! (common::cloud_suite_with_env, as tests/azure.rs) should run here instead.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};

use checkpoint::emulators::FakeGcs;
use checkpoint::testing::{delete_object, read_object};
use checkpoint::{CheckpointError, CheckpointStore, Manifest, StoreOptions, step_dir};
use common::{
    assert_problem, assert_read_corrupt, commit_sample, fresh_dir, reads_by_range, run, sample,
};

/// A local store and the same objects as a `gs://` store, at a fresh prefix.
struct Pair {
    local: CheckpointStore,
    root: std::path::PathBuf,
    gcs: CheckpointStore,
}

/// Fresh prefixes for the scenarios.
static NEXT: AtomicUsize = AtomicUsize::new(0);

impl Pair {
    /// A fresh local directory store; fill it, then call [`Pair::upload`].
    fn new(server: &FakeGcs) -> Self {
        Self::with(server, StoreOptions::default())
    }

    fn with(server: &FakeGcs, gcs_options: StoreOptions) -> Self {
        let root = fresh_dir("gcs-local");
        std::fs::create_dir_all(&root).unwrap();
        let local = CheckpointStore::open(&root.display().to_string(), &Default::default())
            .expect("a local store");
        let prefix = format!("suite/{}", NEXT.fetch_add(1, Ordering::Relaxed));
        let gcs = CheckpointStore::open(&server.url(&prefix), &gcs_options)
            .unwrap_or_else(|e| panic!("opening {}: {e}", server.url(&prefix)));
        Pair { local, root, gcs }
    }

    /// Copies every object of the local store into the bucket under the gcs store's prefix.
    fn upload(&self, server: &FakeGcs) -> Vec<String> {
        let prefix = self
            .gcs
            .url()
            .strip_prefix("gs://seqpipe-test/")
            .expect("a gs:// url in the test bucket");
        server.upload_tree(&self.root, prefix)
    }

    /// The bucket key of checkpoint key `key`.
    fn key(&self, key: &str) -> String {
        let prefix = self.gcs.url().strip_prefix("gs://seqpipe-test/").unwrap();
        format!("{prefix}/{key}")
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Three committed checkpoints and an uncommitted shard, read back from GCS: the same listing,
/// manifests, tensors and verification as on local disk.
async fn read_back(server: &FakeGcs) {
    let p = Pair::new(server);
    let mut manifests = Vec::new();
    for step in [1, 2, 3] {
        manifests.push(commit_sample(&p.local, step).await);
    }
    p.local
        .write_shard(4, "stage0", sample("", 4))
        .await
        .unwrap();
    let keys = p.upload(server);
    assert_eq!(keys.len(), 3 * 4 + 1, "{keys:#?}");

    assert_eq!(p.gcs.list().await.unwrap(), p.local.list().await.unwrap());
    assert_eq!(p.gcs.committed_steps().await.unwrap(), vec![1, 2, 3]);
    for m in &manifests {
        assert_eq!(&p.gcs.read_manifest(m.step).await.unwrap(), m);
        let names: Vec<String> = m.tensor_names().map(String::from).collect();
        assert_eq!(
            p.gcs.read_tensors(m, &names).await.unwrap(),
            p.local.read_tensors(m, &names).await.unwrap(),
            "step {}",
            m.step
        );
        let report = p.gcs.verify(m).await.unwrap();
        assert!(report.is_ok(), "{report}");
        assert_eq!(report.bytes_checked, m.total_bytes());
    }
    let e = p.gcs.read_manifest(4).await.unwrap_err();
    assert!(
        matches!(e, CheckpointError::NotFound { step: 4, .. }),
        "{e}"
    );
    assert!(e.to_string().contains(p.gcs.url()), "{e}");
}

/// Tensors picked out of shards by byte range (repeats, an empty tensor, a scalar) are the ones
/// written; a name the checkpoint lacks is refused by name.
async fn read_by_range(server: &FakeGcs) {
    let p = Pair::new(server);
    let m = commit_sample(&p.local, 3).await;
    p.upload(server);
    reads_by_range(&p.gcs, &m).await;
}

/// A flipped byte, a truncated shard and a missing shard on GCS are errors naming the shard, and
/// verify reports each.
async fn corruption_is_named(server: &FakeGcs) {
    let p = Pair::new(server);
    let m = commit_sample(&p.local, 9).await;
    p.upload(server);
    // A flipped byte inside a.f64.
    let (shard, t) = m.tensor("a.f64").unwrap();
    let mut raw = read_object(&p.gcs, &shard.key).await.unwrap().to_vec();
    raw[t.offset as usize + 3] ^= 0x10;
    server.upload(&p.key(&shard.key), &raw);
    assert_read_corrupt(&p.gcs, &m, "a.f64", &shard.key, "a.f64").await;
    assert_eq!(
        p.gcs.read_tensors(&m, &["a.w".into()]).await.unwrap().len(),
        1,
        "the shard's other tensors stay readable"
    );
    let report = p.gcs.verify(&m).await.unwrap();
    assert_problem(&report.problems, &[&shard.key, "a.f64", "hash mismatch"]);

    // Cut into a.scalar: a short ranged read.
    let (shard, t) = m.tensor("a.scalar").unwrap();
    let whole = read_object(&p.local, &shard.key).await.unwrap();
    server.upload(&p.key(&shard.key), &whole[..t.offset as usize + 3]);
    assert_read_corrupt(&p.gcs, &m, "a.scalar", &shard.key, "a.scalar").await;
    let report = p.gcs.verify(&m).await.unwrap();
    assert_problem(&report.problems, &[&shard.key, "size mismatch"]);

    // A missing shard (deleted through the GCS client).
    let other = m.tensor("b.w").unwrap().0.key.clone();
    delete_object(&p.gcs, &other).await.unwrap();
    assert_read_corrupt(&p.gcs, &m, "b.w", &other, "missing").await;
}

/// A damaged newest checkpoint (an unparsable manifest) read from GCS is reported as damage
/// (`is_damaged_checkpoint`, on which resume and eval fall back to the previous committed step:
/// tests/gcs_checkpoints.rs), and the previous one reads and verifies intact.
async fn damaged_newest_is_damage(server: &FakeGcs) {
    let p = Pair::new(server);
    let older = commit_sample(&p.local, 5).await;
    commit_sample(&p.local, 6).await;
    p.upload(server);
    let manifest = format!("{}/manifest.json", step_dir(6));
    server.upload(&p.key(&manifest), b"{ not json");
    assert_eq!(p.gcs.committed_steps().await.unwrap(), vec![5, 6]);
    let e = p.gcs.read_manifest(6).await.unwrap_err();
    assert!(e.is_damaged_checkpoint(), "{e}");
    assert!(e.to_string().contains(&manifest), "{e}");
    assert_eq!(p.gcs.read_manifest(5).await.unwrap(), older);
    assert!(p.gcs.verify(&older).await.unwrap().is_ok());
}

/// Retention and stale-shard cleanup delete through the GCS client, and only what they should.
async fn retain_and_clean(server: &FakeGcs) {
    let p = Pair::new(server);
    let orphan = p
        .local
        .write_shard(10, "stage0", sample("", 0))
        .await
        .unwrap();
    for step in [10, 20, 30, 40] {
        commit_sample(&p.local, step).await;
    }
    let abandoned = p
        .local
        .write_shard(35, "stage0", sample("", 35))
        .await
        .unwrap();
    let in_flight = p
        .local
        .write_shard(50, "stage0", sample("", 50))
        .await
        .unwrap();
    p.upload(server);

    let deleted = p.gcs.clean_stale(50).await.unwrap();
    let mut want = vec![orphan.key.clone(), abandoned.key.clone()];
    want.sort();
    assert_eq!(deleted, want);
    assert!(read_object(&p.gcs, &in_flight.key).await.is_ok());

    assert_eq!(p.gcs.retain(2).await.unwrap(), vec![10, 20]);
    assert_eq!(p.gcs.committed_steps().await.unwrap(), vec![30, 40]);
    let steps: Vec<(u64, bool)> = p
        .gcs
        .list()
        .await
        .unwrap()
        .iter()
        .map(|l| (l.step, l.committed))
        .collect();
    assert_eq!(
        steps,
        vec![(30, true), (40, true), (50, false)],
        "no leftovers"
    );
    assert_eq!(p.gcs.retain(0).await.unwrap(), vec![30]);
    let m = p.gcs.read_manifest(40).await.unwrap();
    assert!(p.gcs.verify(&m).await.unwrap().is_ok());
}

/// A read-only `gs://` store reads everything and refuses to retire, clean or write, leaving the
/// bucket as it was.
async fn read_only_changes_nothing(server: &FakeGcs) {
    let p = Pair::with(
        server,
        StoreOptions {
            read_only: true,
            ..Default::default()
        },
    );
    for step in [1, 2] {
        commit_sample(&p.local, step).await;
    }
    p.local
        .write_shard(3, "stage0", sample("", 3))
        .await
        .unwrap();
    p.upload(server);
    let before = p.gcs.list().await.unwrap();
    let m = p.gcs.read_manifest(2).await.unwrap();
    assert!(p.gcs.verify(&m).await.unwrap().is_ok());
    for e in [
        p.gcs.retain(1).await.unwrap_err(),
        p.gcs.clean_stale(10).await.map(|_| ()).unwrap_err(),
        p.gcs
            .write_shard(4, "stage0", sample("", 4))
            .await
            .map(|_| ())
            .unwrap_err(),
    ] {
        assert!(matches!(e, CheckpointError::ReadOnly { .. }), "{e}");
    }
    assert_eq!(p.gcs.list().await.unwrap(), before);
}

/// The emulator's write gap, pinned: object_store's XML writes (a shard, a create-only manifest)
/// fail loudly with the emulator's 400, and nothing appears in the bucket. When this fails,
/// fake-gcs-server has learnt them: run the whole cloud suite on it instead.
async fn writes_fail_loudly(server: &FakeGcs) {
    let p = Pair::new(server);
    let e = p
        .gcs
        .write_shard(1, "stage0", sample("", 1))
        .await
        .map(|_| ())
        .expect_err(
            "fake-gcs-server accepted an object_store GCS write: it now serves the XML API; \
             run common::cloud_suite_with_env on it (as tests/azure.rs) and drop this scenario",
        );
    let text = format!("{e} {e:?}");
    assert!(text.contains("400"), "{text}");
    let m = Manifest::new(1, vec![], serde_json::json!(null));
    let e = p
        .gcs
        .commit(&m)
        .await
        .expect_err("a manifest PUT was accepted");
    let text = format!("{e} {e:?}");
    assert!(text.contains("400"), "{text}");
    assert!(p.gcs.list().await.unwrap().is_empty());
}

#[test]
fn fake_gcs_reads_verifies_and_retires_checkpoints() {
    let server = FakeGcs::start();
    for (k, v) in server.env() {
        // SAFETY: the only test of this binary; no thread of it has started yet.
        unsafe { std::env::set_var(k, v) };
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            run("read_back", read_back(&server)).await;
            run("read_by_range", read_by_range(&server)).await;
            run("corruption_is_named", corruption_is_named(&server)).await;
            run(
                "damaged_newest_is_damage",
                damaged_newest_is_damage(&server),
            )
            .await;
            run("retain_and_clean", retain_and_clean(&server)).await;
            run(
                "read_only_changes_nothing",
                read_only_changes_nothing(&server),
            )
            .await;
            run("writes_fail_loudly", writes_fail_loudly(&server)).await;
        });
}
