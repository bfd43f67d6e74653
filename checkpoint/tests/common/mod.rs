//! The core suite, run against every store kind: in-memory, a local directory (plain path and
//! file:// URL) and a real SeaweedFS S3 server.
#![allow(dead_code)] // each test binary uses a subset

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use checkpoint::testing::{delete_object, read_object, write_object};
use checkpoint::{
    CheckpointError, CheckpointStore, Dtype, Manifest, StoreOptions, TensorData, step_dir,
};
use serde_json::json;

/// A kind of store; every call to [`Backend::store`] gives a fresh, empty location. Local
/// directories it created are removed when it is dropped.
pub struct Backend {
    /// For messages.
    pub name: String,
    /// Smallest part size the store accepts (5 MiB on S3).
    pub min_part: usize,
    base: StoreOptions,
    fresh_url: Box<dyn Fn() -> String + Send + Sync>,
    dirs: Arc<Mutex<Vec<PathBuf>>>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        for dir in self.dirs.lock().unwrap().drain(..) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

impl Backend {
    /// A backend whose fresh locations come from `fresh_url`, opened with `base` options.
    pub fn new(
        name: &str,
        min_part: usize,
        base: StoreOptions,
        fresh_url: impl Fn() -> String + Send + Sync + 'static,
    ) -> Self {
        Self {
            name: name.into(),
            min_part,
            base,
            fresh_url: Box::new(fresh_url),
            dirs: Arc::default(),
        }
    }

    /// In-process memory store.
    pub fn memory() -> Self {
        Self::new("memory", 1, StoreOptions::default(), || "memory://".into())
    }

    /// Local directory given as an absolute plain path.
    pub fn dir_path() -> Self {
        let dirs: Arc<Mutex<Vec<PathBuf>>> = Arc::default();
        let created = dirs.clone();
        let mut b = Self::new("dir", 1, StoreOptions::default(), move || {
            let dir = fresh_dir("path");
            created.lock().unwrap().push(dir.clone());
            dir.display().to_string()
        });
        b.dirs = dirs;
        b
    }

    /// Local directory given as a file:// URL.
    pub fn file_url() -> Self {
        let dirs: Arc<Mutex<Vec<PathBuf>>> = Arc::default();
        let created = dirs.clone();
        let mut b = Self::new("file", 1, StoreOptions::default(), move || {
            let dir = fresh_dir("url");
            std::fs::create_dir_all(&dir).unwrap();
            created.lock().unwrap().push(dir.clone());
            url::Url::from_directory_path(&dir).unwrap().to_string()
        });
        b.dirs = dirs;
        b
    }

    /// A fresh empty location with the base options.
    pub fn store(&self) -> CheckpointStore {
        self.store_with(StoreOptions::default())
    }

    /// A fresh empty location with the base options plus the `Some` fields of `extra`.
    pub fn store_with(&self, extra: StoreOptions) -> CheckpointStore {
        let mut o = self.base.clone();
        o.part_size = extra.part_size.or(o.part_size);
        o.max_upload_bytes_per_s = extra.max_upload_bytes_per_s.or(o.max_upload_bytes_per_s);
        let url = (self.fresh_url)();
        CheckpointStore::open(&url, &o)
            .unwrap_or_else(|e| panic!("[{}] opening {url}: {e}", self.name))
    }
}

/// A new directory path (not yet created) under cargo's per-target temp dir.
pub fn fresh_dir(tag: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "checkpoint-tests/{tag}-{}-{:016x}",
        std::process::id(),
        rand::random::<u64>()
    ))
}

/// Deterministic pseudo-random bytes.
pub fn bytes(seed: u64, n: usize) -> Bytes {
    let mut x = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (x >> 56) as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

pub fn f32s(shape: &[usize], seed: u64) -> TensorData {
    let n: usize = shape.iter().product();
    let data: Vec<u8> = (0..n)
        .flat_map(|i| ((i as f32) * 0.5 - seed as f32).to_le_bytes())
        .collect();
    TensorData::new(Dtype::F32, shape.to_vec(), data)
}

/// A mix of dtypes and shapes: F32, F64, U32, BF16 (raw bytes), an I64 scalar, and a tensor of
/// 0 elements.
pub fn sample(prefix: &str, seed: u64) -> Vec<(String, TensorData)> {
    let f64s: Vec<u8> = (0..5)
        .flat_map(|i| (i as f64 / 3.0 + seed as f64).to_le_bytes())
        .collect();
    let u32s: Vec<u8> = (0..4u32)
        .flat_map(|i| (i * 1_000_003 + seed as u32).to_le_bytes())
        .collect();
    vec![
        (format!("{prefix}w"), f32s(&[3, 4], seed)),
        (
            format!("{prefix}f64"),
            TensorData::new(Dtype::F64, vec![5], f64s),
        ),
        (
            format!("{prefix}idx"),
            TensorData::new(Dtype::U32, vec![2, 2], u32s),
        ),
        (
            format!("{prefix}bf16"),
            TensorData::new(Dtype::BF16, vec![7], bytes(seed, 14)),
        ),
        (
            format!("{prefix}scalar"),
            TensorData::new(
                Dtype::I64,
                vec![],
                (-7i64 - seed as i64).to_le_bytes().to_vec(),
            ),
        ),
        (
            format!("{prefix}empty"),
            TensorData::new(Dtype::F32, vec![0, 3], Vec::<u8>::new()),
        ),
    ]
}

/// Writes two sample shards and an empty one for `step` and commits them.
pub async fn commit_sample(store: &CheckpointStore, step: u64) -> Manifest {
    let a = store
        .write_shard(step, "stage0", sample("a.", step))
        .await
        .unwrap();
    let b = store
        .write_shard(step, "stage1", sample("b.", step + 100))
        .await
        .unwrap();
    let empty = store.write_shard(step, "empty", vec![]).await.unwrap();
    let m = Manifest::new(
        step,
        vec![a, b, empty],
        json!({"step": step, "cursor": [step, 3]}),
    );
    store.commit(&m).await.unwrap();
    m
}

fn names(tensors: &[(String, TensorData)]) -> Vec<String> {
    tensors.iter().map(|(n, _)| n.clone()).collect()
}

/// Reading `tensor` of `m` from `store` fails as corrupt, naming the shard `key` with `detail_has`
/// in the detail.
pub async fn assert_read_corrupt(
    store: &CheckpointStore,
    m: &Manifest,
    tensor: &str,
    key: &str,
    detail_has: &str,
) {
    let e = store.read_tensors(m, &[tensor.into()]).await.unwrap_err();
    assert!(
        matches!(&e, CheckpointError::Corrupt { key: k, detail, .. } if k == key && detail.contains(detail_has)),
        "reading {tensor} from {}: {e}",
        store.url()
    );
}

/// Finds the problem mentioning all `needles`, or panics listing the problems.
pub fn assert_problem(problems: &[String], needles: &[&str]) {
    assert!(
        problems
            .iter()
            .any(|p| needles.iter().all(|n| p.contains(n))),
        "no problem mentions {needles:?}; problems: {problems:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------------

pub async fn round_trip(b: &Backend) {
    let store = b.store();
    let m = commit_sample(&store, 42).await;
    let read = store.read_manifest(42).await.unwrap();
    assert_eq!(read, m);
    assert_eq!(read.state, json!({"step": 42, "cursor": [42, 3]}));
    assert_eq!(read.shards[2].tensors.len(), 0, "empty shard");
    for shard in &read.shards {
        assert!(shard.key.starts_with("step-00000042/"), "{}", shard.key);
        let file = shard.key.rsplit('/').next().unwrap();
        let (stem, suffix) = file.rsplit_once('-').unwrap();
        assert!(["stage0", "stage1", "empty"].contains(&stem), "{file}");
        assert_eq!(suffix.len(), 16 + ".safetensors".len(), "{file}");
    }

    let mut all = sample("a.", 42);
    all.extend(sample("b.", 142));
    let want = names(&all);
    assert_eq!(read.tensor_names().collect::<Vec<_>>(), want);
    let got = store.read_tensors(&read, &want).await.unwrap();
    assert_eq!(got, all, "[{}] tensors round trip", b.name);
    let (_, e) = read.tensor("a.empty").unwrap();
    assert_eq!(
        (e.len, e.shape.clone(), e.dtype.as_str()),
        (0, vec![0, 3], "F32")
    );
    assert_eq!(read.tensor("b.bf16").unwrap().1.dtype, "BF16");

    let listing = store.list().await.unwrap();
    assert_eq!(listing.len(), 1);
    assert!(listing[0].committed);
    assert_eq!(listing[0].objects, 4);
    assert!(listing[0].bytes > read.total_bytes());
    assert_eq!(store.committed_steps().await.unwrap(), vec![42]);
    let report = store.verify(&read).await.unwrap();
    assert!(report.is_ok(), "{report}");
    assert_eq!(report.shards_checked, 3);
    assert_eq!(report.bytes_checked, read.total_bytes());
}

pub async fn shard_is_valid_safetensors(b: &Backend) {
    let store = b.store();
    let tensors = sample("", 1);
    let entry = store.write_shard(1, "s", tensors.clone()).await.unwrap();
    let raw = read_object(&store, &entry.key).await.unwrap();
    assert_eq!(raw.len() as u64, entry.size);
    assert_eq!(blake3::hash(&raw).to_hex().as_str(), entry.blake3);
    let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
    assert_eq!(st.len(), tensors.len());
    for ((name, t), e) in tensors.iter().zip(&entry.tensors) {
        let view = st.tensor(name).unwrap();
        assert_eq!(view.dtype(), t.dtype, "{name}");
        assert_eq!(view.shape(), t.shape.as_slice(), "{name}");
        assert_eq!(view.data(), &t.data[..], "{name}");
        assert_eq!(
            &raw[e.offset as usize..(e.offset + e.len) as usize],
            &t.data[..]
        );
        assert_eq!(blake3::hash(&t.data).to_hex().as_str(), e.blake3);
    }
    // Header order is the given order.
    let header_len = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&raw[8..8 + header_len]).unwrap();
    let positions: Vec<usize> = tensors
        .iter()
        .map(|(n, _)| header.find(&format!("\"{n}\"")).unwrap())
        .collect();
    assert!(positions.is_sorted(), "{header}");
    // An empty shard is a valid safetensors file too.
    let empty = store.write_shard(1, "e", vec![]).await.unwrap();
    let raw = read_object(&store, &empty.key).await.unwrap();
    assert_eq!(
        safetensors::SafeTensors::deserialize(&raw).unwrap().len(),
        0
    );
}

/// A shard of 2.5 parts plus small tensors around it: at least 3 parts.
pub async fn multipart(b: &Backend) {
    let part = b.min_part.max(4096);
    let store = b.store_with(StoreOptions {
        part_size: Some(part),
        ..Default::default()
    });
    let big = part * 5 / 2 / 4 * 4;
    let mut tensors = sample("pre.", 3);
    tensors.push((
        "big".into(),
        TensorData::new(Dtype::F32, vec![big / 4], bytes(9, big)),
    ));
    tensors.extend(sample("post.", 4));
    let started = Instant::now();
    let entry = store.write_shard(7, "big", tensors.clone()).await.unwrap();
    eprintln!(
        "[{}] multipart shard of {} bytes in parts of {part}: {:.2?}",
        b.name,
        entry.size,
        started.elapsed()
    );
    assert!(entry.size as usize > 2 * part, "needs more than 2 parts");
    let m = Manifest::new(7, vec![entry], json!(null));
    store.commit(&m).await.unwrap();
    let got = store.read_tensors(&m, &names(&tensors)).await.unwrap();
    assert_eq!(got, tensors);
    let report = store.verify(&m).await.unwrap();
    assert!(report.is_ok(), "{report}");
}

/// Many tiny parts (local stores only: S3 needs 5 MiB parts).
pub async fn many_tiny_parts(b: &Backend) {
    let store = b.store_with(StoreOptions {
        part_size: Some(1000),
        ..Default::default()
    });
    let tensors = vec![
        (
            "x".to_string(),
            TensorData::new(Dtype::U8, vec![50_000], bytes(1, 50_000)),
        ),
        ("y".to_string(), f32s(&[100, 7], 2)),
    ];
    let entry = store.write_shard(1, "tiny", tensors.clone()).await.unwrap();
    assert!(entry.size > 50 * 1000);
    let raw = read_object(&store, &entry.key).await.unwrap();
    safetensors::SafeTensors::deserialize(&raw).unwrap();
    let m = Manifest::new(1, vec![entry], json!({}));
    store.commit(&m).await.unwrap();
    assert_eq!(
        store.read_tensors(&m, &names(&tensors)).await.unwrap(),
        tensors
    );
}

pub async fn commit_twice_and_race(b: &Backend) {
    let store = b.store();
    let m = commit_sample(&store, 5).await;
    let e = store.commit(&m).await.unwrap_err();
    assert!(
        matches!(e, CheckpointError::AlreadyCommitted { step: 5, .. }),
        "[{}] {e}",
        b.name
    );
    assert!(e.to_string().contains("step-00000005/manifest.json"), "{e}");

    // Two writers race to commit step 6 with different shards: exactly one wins.
    let x = store.write_shard(6, "x", sample("", 1)).await.unwrap();
    let y = store.write_shard(6, "y", sample("", 2)).await.unwrap();
    let mx = Manifest::new(6, vec![x], json!("x"));
    let my = Manifest::new(6, vec![y], json!("y"));
    let (rx, ry) = tokio::join!(store.commit(&mx), store.commit(&my));
    let winner = match (rx, ry) {
        (Ok(()), Err(CheckpointError::AlreadyCommitted { step: 6, .. })) => mx,
        (Err(CheckpointError::AlreadyCommitted { step: 6, .. }), Ok(())) => my,
        other => panic!("[{}] race: expected one winner, got {other:?}", b.name),
    };
    assert_eq!(store.read_manifest(6).await.unwrap(), winner);
    assert_eq!(store.committed_steps().await.unwrap(), vec![5, 6]);
}

pub async fn uncommitted_is_not_a_checkpoint(b: &Backend) {
    let store = b.store();
    commit_sample(&store, 1).await;
    store.write_shard(2, "stage0", sample("", 2)).await.unwrap();
    let listing = store.list().await.unwrap();
    assert_eq!(listing.len(), 2);
    assert_eq!((listing[0].step, listing[0].committed), (1, true));
    assert_eq!(
        (listing[1].step, listing[1].committed, listing[1].objects),
        (2, false, 1)
    );
    assert!(listing[1].bytes > 0);
    assert_eq!(store.committed_steps().await.unwrap(), vec![1]);
    let e = store.read_manifest(2).await.unwrap_err();
    assert!(
        matches!(e, CheckpointError::NotFound { step: 2, .. }),
        "{e}"
    );
    assert!(e.to_string().contains(store.url()), "{e}");
}

pub async fn read_by_range(b: &Backend) {
    let store = b.store();
    let m = commit_sample(&store, 3).await;
    reads_by_range(&store, &m).await;
}

/// Tensors picked out of `store`'s shards by byte range (repeats, an empty tensor, a scalar) are
/// the ones [`commit_sample`] wrote as `m` (step 3); a name the checkpoint lacks is refused by
/// name.
pub async fn reads_by_range(store: &CheckpointStore, m: &Manifest) {
    let all: std::collections::HashMap<String, TensorData> = sample("a.", 3)
        .into_iter()
        .chain(sample("b.", 103))
        .collect();
    let want: Vec<String> = ["b.idx", "a.empty", "a.w", "b.scalar", "a.w"]
        .map(String::from)
        .to_vec();
    let got = store.read_tensors(m, &want).await.unwrap();
    assert_eq!(names(&got), want);
    for (name, t) in &got {
        assert_eq!(t, &all[name], "{name}");
    }
    assert!(store.read_tensors(m, &[]).await.unwrap().is_empty());
    let e = store
        .read_tensors(m, &["a.w".into(), "nope".into()])
        .await
        .unwrap_err();
    assert!(
        matches!(&e, CheckpointError::MissingTensor { name, step: 3, .. } if name == "nope"),
        "{e}"
    );
}

pub async fn flipped_byte_is_corrupt(b: &Backend) {
    let store = b.store();
    let m = commit_sample(&store, 9).await;
    let (shard, t) = m.tensor("a.f64").unwrap();
    let mut raw = read_object(&store, &shard.key).await.unwrap().to_vec();
    raw[t.offset as usize + 3] ^= 0x10;
    write_object(&store, &shard.key, raw.into()).await.unwrap();

    let e = store.read_tensors(&m, &["a.f64".into()]).await.unwrap_err();
    let CheckpointError::Corrupt { key, detail, .. } = &e else {
        panic!("[{}] expected Corrupt, got {e}", b.name);
    };
    assert_eq!(key, &shard.key);
    assert!(detail.contains("a.f64"), "{detail}");
    assert!(e.to_string().contains(&shard.key), "{e}");
    // Other tensors of the same shard are intact.
    assert_eq!(
        store.read_tensors(&m, &["a.w".into()]).await.unwrap().len(),
        1
    );

    let report = store.verify(&m).await.unwrap();
    assert!(!report.is_ok());
    assert_problem(&report.problems, &[&shard.key, "a.f64", "hash mismatch"]);
    assert_problem(&report.problems, &[&shard.key, "shard hash mismatch"]);
    assert_eq!(report.problems.len(), 2, "{report}");
}

pub async fn truncated_or_missing_shard_is_corrupt(b: &Backend) {
    let store = b.store();
    let m = commit_sample(&store, 11).await;
    // Cut into the middle of the last non-empty tensor of stage0 ("a.scalar", 8 bytes).
    let (shard, t) = m.tensor("a.scalar").unwrap();
    let raw = read_object(&store, &shard.key).await.unwrap();
    write_object(&store, &shard.key, raw.slice(..t.offset as usize + 3))
        .await
        .unwrap();
    assert_read_corrupt(&store, &m, "a.scalar", &shard.key, "a.scalar").await;
    let report = store.verify(&m).await.unwrap();
    assert_problem(&report.problems, &[&shard.key, "size mismatch"]);
    assert_problem(&report.problems, &[&shard.key, "a.scalar", "truncated"]);

    // Cut before the tensor starts: the ranged read itself fails.
    write_object(&store, &shard.key, raw.slice(..t.offset as usize - 1))
        .await
        .unwrap();
    assert_read_corrupt(&store, &m, "a.scalar", &shard.key, "a.scalar").await;

    // A missing shard.
    let other = &m.tensor("b.w").unwrap().0.key;
    delete_object(&store, other).await.unwrap();
    assert_read_corrupt(&store, &m, "b.w", other, "missing").await;
    let report = store.verify(&m).await.unwrap();
    assert_problem(&report.problems, &[other, "missing"]);
    assert_eq!(report.shards_checked, 2, "{report}");
}

pub async fn commit_checks_shards(b: &Backend) {
    let store = b.store();
    let s = store.write_shard(4, "stage0", sample("", 4)).await.unwrap();
    // Wrong size recorded.
    let mut wrong = s.clone();
    wrong.size += 1;
    let e = store
        .commit(&Manifest::new(4, vec![wrong], json!(null)))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, CheckpointError::Corrupt { key, .. } if key == &s.key),
        "{e}"
    );
    // A shard that was never written.
    let mut ghost = s.clone();
    ghost.key = format!("{}/ghost-0000000000000000.safetensors", step_dir(4));
    ghost.tensors.clear();
    let e = store
        .commit(&Manifest::new(
            4,
            vec![s.clone(), ghost.clone()],
            json!(null),
        ))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, CheckpointError::Corrupt { key, .. } if key == &ghost.key),
        "{e}"
    );
    // Shards of another step.
    let e = store
        .commit(&Manifest::new(5, vec![s.clone()], json!(null)))
        .await
        .unwrap_err();
    assert!(
        matches!(e, CheckpointError::InvalidManifest { step: 5, .. }),
        "{e}"
    );
    assert!(store.committed_steps().await.unwrap().is_empty());
    // The good one still commits.
    store
        .commit(&Manifest::new(4, vec![s], json!(null)))
        .await
        .unwrap();
    assert_eq!(store.committed_steps().await.unwrap(), vec![4]);
}

pub async fn retain_keeps_newest(b: &Backend) {
    let store = b.store();
    for step in [10, 20, 30, 40] {
        commit_sample(&store, step).await;
    }
    assert_eq!(store.retain(2).await.unwrap(), vec![10, 20]);
    assert_eq!(store.committed_steps().await.unwrap(), vec![30, 40]);
    let steps: Vec<u64> = store.list().await.unwrap().iter().map(|l| l.step).collect();
    assert_eq!(steps, vec![30, 40], "no leftovers of deleted steps");
    assert!(store.retain(5).await.unwrap().is_empty());
    // keep_last = 0 still keeps the newest.
    assert_eq!(store.retain(0).await.unwrap(), vec![30]);
    assert_eq!(store.committed_steps().await.unwrap(), vec![40]);
    let m = store.read_manifest(40).await.unwrap();
    assert!(store.verify(&m).await.unwrap().is_ok());
}

pub async fn clean_stale_removes_only_garbage(b: &Backend) {
    let store = b.store();
    // Step 1: committed, plus an orphan from a failed attempt.
    let orphan = store.write_shard(1, "stage0", sample("", 0)).await.unwrap();
    let m1 = commit_sample(&store, 1).await;
    // Step 2: abandoned upload. Step 3: committed. Step 4: upload in flight.
    let abandoned = store.write_shard(2, "stage0", sample("", 2)).await.unwrap();
    commit_sample(&store, 3).await;
    let in_flight = store.write_shard(4, "stage0", sample("", 4)).await.unwrap();

    let deleted = store.clean_stale(4).await.unwrap();
    let mut want = vec![orphan.key.clone(), abandoned.key.clone()];
    want.sort();
    assert_eq!(deleted, want, "[{}]", b.name);
    let listing = store.list().await.unwrap();
    let steps: Vec<(u64, bool)> = listing.iter().map(|l| (l.step, l.committed)).collect();
    assert_eq!(steps, vec![(1, true), (3, true), (4, false)]);
    assert!(read_object(&store, &in_flight.key).await.is_ok());
    let report = store.verify(&m1).await.unwrap();
    assert!(report.is_ok(), "{report}");
    assert!(store.clean_stale(4).await.unwrap().is_empty());
    // Once step 4 is no longer in flight, it goes too.
    assert_eq!(store.clean_stale(5).await.unwrap(), vec![in_flight.key]);
}

/// The local directory behind `store`, if it is a local store.
fn local_dir(store: &CheckpointStore) -> Option<PathBuf> {
    let url = store.url();
    if url.starts_with("file://") {
        return Some(url::Url::parse(url).unwrap().to_file_path().unwrap());
    }
    (!url.contains("://")).then(|| PathBuf::from(url))
}

/// Staging objects that killed uploads leave behind (`<key>#<n>` in a local directory: hidden
/// from listing, so clean_stale never saw them) are deleted at training start, in committed and
/// uncommitted step directories alike; committed checkpoints, uncommitted shards and objects
/// that only look similar stay. Other stores have no such objects: nothing is deleted. A
/// read-only store refuses.
pub async fn clean_interrupted_uploads_removes_only_staging(b: &Backend) {
    let store = b.store();
    let m1 = commit_sample(&store, 1).await;
    let uncommitted = store.write_shard(2, "stage0", sample("", 2)).await.unwrap();
    let mut before = store.list().await.unwrap();
    let mut want = Vec::new();
    let mut keep = Vec::new();
    if let Some(root) = local_dir(&store) {
        let put = |key: &str, n: usize| {
            let path = root.join(key);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, bytes(9, n)).unwrap();
        };
        // Killed shard uploads next to committed and uncommitted shards, a killed commit, and a
        // step directory holding nothing but a killed upload.
        for key in [
            format!("{}#1", m1.shards[0].key),
            format!("{}#2", m1.shards[0].key),
            format!("{}/manifest.json#1", step_dir(1)),
            format!("{}#1", uncommitted.key),
            format!("{}/stage3-00ff.safetensors#13", step_dir(7)),
        ] {
            put(&key, 100);
            want.push(key);
        }
        // Not staging files: a `#` followed by other than digits, and files outside step
        // directories.
        for key in [
            format!("{}/notes#draft", step_dir(1)),
            "elsewhere/x.safetensors#1".to_string(),
        ] {
            put(&key, 10);
            keep.push(root.join(key));
        }
        want.sort();
        before = store.list().await.unwrap();
        let read_only = CheckpointStore::open(
            store.url(),
            &StoreOptions {
                read_only: true,
                ..Default::default()
            },
        )
        .unwrap();
        let e = read_only.clean_interrupted_uploads().await.unwrap_err();
        assert!(matches!(e, CheckpointError::ReadOnly { .. }), "{e}");
        assert!(root.join(&want[0]).exists(), "a read-only store deleted");
        let deleted = store.clean_interrupted_uploads().await.unwrap();
        assert_eq!(deleted, want, "[{}]", b.name);
        for key in &want {
            assert!(!root.join(key).exists(), "[{}] {key} left", b.name);
        }
        for path in &keep {
            assert!(path.exists(), "[{}] {} deleted", b.name, path.display());
        }
        assert!(
            !root.join(step_dir(7)).exists(),
            "[{}] an emptied step directory stays",
            b.name
        );
    } else {
        assert!(store.clean_interrupted_uploads().await.unwrap().is_empty());
    }
    assert_eq!(store.list().await.unwrap(), before, "[{}]", b.name);
    let report = store.verify(&m1).await.unwrap();
    assert!(report.is_ok(), "[{}] {report}", b.name);
    assert!(read_object(&store, &uncommitted.key).await.is_ok());
    assert!(store.clean_interrupted_uploads().await.unwrap().is_empty());
}

pub async fn throttled_upload_is_slow(b: &Backend) {
    let store = b.store_with(StoreOptions {
        max_upload_bytes_per_s: Some(4_000_000),
        ..Default::default()
    });
    let tensors = vec![(
        "x".to_string(),
        TensorData::new(Dtype::U8, vec![2_000_000], bytes(5, 2_000_000)),
    )];
    let started = Instant::now();
    let e = store.write_shard(1, "slow", tensors).await.unwrap();
    let took = started.elapsed();
    eprintln!("[{}] 2 MB at 4 MB/s took {took:.2?}", b.name);
    assert!(e.size >= 2_000_000);
    assert!(
        took >= Duration::from_millis(400),
        "throttle ignored: {took:?}"
    );
    assert!(
        took < Duration::from_secs(20),
        "throttle far too slow: {took:?}"
    );
    // Clones share the limit: two concurrent 1 MB uploads also take >= ~0.4 s.
    let one = || {
        vec![(
            "y".to_string(),
            TensorData::new(Dtype::U8, vec![1_000_000], bytes(6, 1_000_000)),
        )]
    };
    let other = store.clone();
    let started = Instant::now();
    let (a, c) = tokio::join!(
        store.write_shard(2, "a", one()),
        other.write_shard(2, "b", one())
    );
    a.unwrap();
    c.unwrap();
    assert!(
        started.elapsed() >= Duration::from_millis(400),
        "{:?}",
        started.elapsed()
    );
}

pub async fn invalid_inputs_are_refused(b: &Backend) {
    let store = b.store();
    let bad = vec![(
        "w".to_string(),
        TensorData::new(Dtype::F32, vec![3], vec![0u8; 4]),
    )];
    let e = store.write_shard(1, "stage0", bad).await.unwrap_err();
    assert!(matches!(e, CheckpointError::InvalidInput { .. }), "{e}");
    assert!(e.to_string().contains("`w`"), "{e}");
    let e = store.write_shard(1, "a/b", vec![]).await.unwrap_err();
    assert!(e.to_string().contains("a/b"), "{e}");
    assert!(store.list().await.unwrap().is_empty(), "nothing uploaded");
}

pub async fn probe_writes_and_cleans_up(b: &Backend) {
    let store = b.store();
    let secs = store.raw_write_probe(3 * 1024 * 1024 + 5).await.unwrap();
    assert!(secs > 0.0);
    assert!(store.list().await.unwrap().is_empty());
}

/// Generates one `#[tokio::test]` per core scenario for a backend constructor.
#[allow(unused_macros)] // not every test binary runs the generated suite
macro_rules! core_suite {
    ($backend:expr) => {
        core_suite!(@tests $backend;
            round_trip, shard_is_valid_safetensors, multipart, many_tiny_parts,
            commit_twice_and_race, uncommitted_is_not_a_checkpoint, read_by_range,
            flipped_byte_is_corrupt, truncated_or_missing_shard_is_corrupt, commit_checks_shards,
            retain_keeps_newest, clean_stale_removes_only_garbage,
            clean_interrupted_uploads_removes_only_staging, throttled_upload_is_slow,
            invalid_inputs_are_refused, probe_writes_and_cleans_up);
    };
    (@tests $backend:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                crate::common::$name(&$backend).await;
            }
        )*
    };
}

/// Runs one scenario, naming it in the output (for suites run in one test).
pub async fn run<F: std::future::Future<Output = ()>>(name: &str, f: F) {
    let started = Instant::now();
    eprintln!("--- {name}");
    f.await;
    eprintln!("--- {name}: ok in {:.2?}", started.elapsed());
}

/// The core suite of a cloud store (parts of at least 5 MiB), run as one test against one
/// server: the scenarios S3 runs on SeaweedFS (tests/s3.rs), for Azure on Azurite.
pub async fn cloud_suite(b: &Backend) {
    run("round_trip", round_trip(b)).await;
    run("shard_is_valid_safetensors", shard_is_valid_safetensors(b)).await;
    run("multipart (3 parts of 5 MiB)", multipart(b)).await;
    run("commit_twice_and_race", commit_twice_and_race(b)).await;
    run(
        "uncommitted_is_not_a_checkpoint",
        uncommitted_is_not_a_checkpoint(b),
    )
    .await;
    run("read_by_range", read_by_range(b)).await;
    run("flipped_byte_is_corrupt", flipped_byte_is_corrupt(b)).await;
    run(
        "truncated_or_missing_shard_is_corrupt",
        truncated_or_missing_shard_is_corrupt(b),
    )
    .await;
    run("commit_checks_shards", commit_checks_shards(b)).await;
    run("retain_keeps_newest", retain_keeps_newest(b)).await;
    run(
        "clean_stale_removes_only_garbage",
        clean_stale_removes_only_garbage(b),
    )
    .await;
    run(
        "clean_interrupted_uploads_removes_only_staging",
        clean_interrupted_uploads_removes_only_staging(b),
    )
    .await;
    run("throttled_upload_is_slow", throttled_upload_is_slow(b)).await;
    run("invalid_inputs_are_refused", invalid_inputs_are_refused(b)).await;
    run("probe_writes_and_cleans_up", probe_writes_and_cleans_up(b)).await;
    // Prefixes isolate locations: the suite's many steps never leaked into a fresh prefix.
    assert!(b.store().list().await.unwrap().is_empty());
}

/// Runs [`cloud_suite`] on a fresh runtime against the store behind `url(prefix)`, after putting
/// `env` (the emulator's address, read by object_store's `from_env` builders) into this
/// process's environment. Call it from the only test of its binary: the environment is the
/// process's.
pub fn cloud_suite_with_env(
    name: &str,
    env: Vec<(String, String)>,
    url: impl Fn(&str) -> String + Send + Sync + 'static,
) {
    for (k, v) in env {
        // SAFETY: the only test of this binary sets these before it starts any thread of its
        // own (the runtime below is built after), and libtest runs no other test beside it.
        unsafe { std::env::set_var(k, v) };
    }
    let counter = std::sync::atomic::AtomicUsize::new(0);
    let b = Backend::new(name, 5 * 1024 * 1024, StoreOptions::default(), move || {
        url(&format!(
            "suite/{}",
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ))
    });
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(cloud_suite(&b));
}
