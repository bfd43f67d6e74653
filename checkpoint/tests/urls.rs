//! Opening locations: URL forms, created directories, and errors that say what to do.

mod common;

use checkpoint::{CheckpointError, CheckpointStore, StoreOptions};

fn open(url: &str) -> Result<CheckpointStore, CheckpointError> {
    CheckpointStore::open(url, &StoreOptions::default())
}

#[test]
fn bad_urls_are_refused_with_the_reason() {
    for (url, needle) in [
        ("", "empty"),
        ("ftp://host/dir", "unsupported scheme `ftp://`"),
        ("s3:///prefix", "no bucket"),
        ("file://relative/dir", "three slashes"),
        ("http://[::1", "bad checkpoint URL"),
    ] {
        let e = open(url).unwrap_err();
        assert!(matches!(e, CheckpointError::BadUrl { .. }), "{url}: {e}");
        let msg = e.to_string();
        assert!(msg.contains(needle), "{url}: {msg}");
        assert!(msg.contains(url), "{url}: {msg}");
    }
}

#[test]
fn cloud_schemes_without_their_feature_name_it() {
    if cfg!(feature = "gcp") || cfg!(feature = "azure") {
        return; // built with the features: covered by `cargo check --features gcp,azure`
    }
    for (url, feature) in [
        ("gs://bucket/p", "gcp"),
        ("az://container/p", "azure"),
        ("azure://container/p", "azure"),
    ] {
        match open(url) {
            Err(CheckpointError::FeatureDisabled { feature: f, .. }) => assert_eq!(f, feature),
            other => panic!("{url}: expected FeatureDisabled, got {other:?}"),
        }
    }
}

#[test]
fn s3_url_opens_without_contacting_the_store() {
    let s = open("s3://some-bucket/run-1/ckpt").unwrap();
    assert_eq!(s.url(), "s3://some-bucket/run-1/ckpt");
}

#[test]
fn a_plain_path_is_created_relative_or_absolute() {
    let root = common::fresh_dir("created");
    let abs = root.join("a/b");
    assert!(!abs.exists());
    open(abs.to_str().unwrap()).unwrap();
    assert!(abs.is_dir());
    std::fs::remove_dir_all(root).unwrap();

    // Relative to the current directory (the package root under `cargo test`).
    let cwd = std::env::current_dir().unwrap().canonicalize().unwrap();
    let target = common::fresh_dir("relative");
    std::fs::create_dir_all(target.parent().unwrap()).unwrap();
    let target_parent = target.parent().unwrap().canonicalize().unwrap();
    let common_len = cwd
        .components()
        .zip(target_parent.components())
        .take_while(|(a, b)| a == b)
        .count();
    let mut rel = std::path::PathBuf::new();
    for _ in common_len..cwd.components().count() {
        rel.push("..");
    }
    for c in target_parent.components().skip(common_len) {
        rel.push(c);
    }
    rel.push(target.file_name().unwrap());
    assert!(rel.is_relative());
    let store = open(rel.to_str().unwrap()).unwrap();
    assert_eq!(store.url(), rel.to_str().unwrap());
    assert!(target.is_dir(), "{} -> {}", rel.display(), target.display());
    std::fs::remove_dir_all(target).unwrap();
}

#[tokio::test]
async fn a_file_url_and_its_plain_path_are_the_same_store() {
    let dir = common::fresh_dir("same");
    let by_path = open(dir.to_str().unwrap()).unwrap();
    common::commit_sample(&by_path, 8).await;
    let url = url::Url::from_directory_path(&dir).unwrap().to_string();
    let by_url = open(&url).unwrap();
    assert_eq!(by_url.committed_steps().await.unwrap(), vec![8]);
    assert!(dir.join("step-00000008/manifest.json").is_file());
    std::fs::remove_dir_all(dir).unwrap();
}
