//! A run's checkpoints in Google Cloud Storage (`gs://`, on fake-gcs-server started by the test,
//! reached through `GOOGLE_SERVICE_ACCOUNT` as docs/checkpoints.md tells users): `seqpipe ckpt
//! list|verify` and `seqpipe eval --resume` read them through object_store's GCS client, the
//! state read back is bit-identical to the run's local checkpoints, a damaged newest checkpoint is
//! passed over for the one before, and the read-only commands leave the bucket as it was.
//!
//! (Not train → kill → resume on `gs://`, as tests/cloud_resume.rs does on Azurite:
//! fake-gcs-server answers 400 to every write object_store's GCS client makes — XML PUT,
//! create-only PUT, XML multipart upload — so the run's checkpoints are written to local disk and
//! put into the bucket through the emulator's own upload API; docs/checkpoints.md has the
//! evidence.)

mod common;

use std::path::Path;

use checkpoint::emulators::FakeGcs;
use checkpoint::{CheckpointStore, StepListing, step_dir};
use common::resumable_train as train;
use common::{ckpt_url, final_state, fresh_dir, run_err, run_ok, seqpipe, tiny_model_args};

/// Steps of the run: checkpoints at 3, 6 and 9, all kept (`checkpoint.keep_last=3`).
const STEPS: u64 = 9;

/// What the bucket holds under `url`, by step.
fn listing(url: &str) -> Vec<StepListing> {
    let store = CheckpointStore::open(url, &Default::default()).unwrap();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(store.list())
        .unwrap()
}

/// `seqpipe eval` of the checkpoint at `url` (`--resume latest`): (step, validation loss).
fn eval(run: &Path, url: &str) -> (u64, f64) {
    let out = run_ok(
        seqpipe()
            .args(["eval", "--resume", "latest"])
            .args(tiny_model_args())
            .args(["--set", "train.eval_batches=2"])
            .arg("--set")
            .arg(format!("run.dir={}", run.display()))
            .arg("--set")
            .arg(format!("checkpoint.url={url}")),
    );
    let line: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("eval printed no JSON line ({e}): {out:?}"));
    (
        line["step"].as_u64().unwrap(),
        line["val_loss"].as_f64().unwrap(),
    )
}

/// `seqpipe ckpt list URL`'s stdout.
fn ckpt_list(url: &str) -> String {
    String::from_utf8(run_ok(seqpipe().args(["ckpt", "list", url])).stdout).unwrap()
}

/// The emulator's address goes into this process's environment (the commands inherit it, and
/// `final_state` reads through it), set before any thread of the test starts.
#[test]
fn gcs_checkpoints_are_listed_verified_evaluated_and_read_back_bit_identically() {
    let gcs = FakeGcs::start();
    for (k, v) in gcs.env() {
        // SAFETY: the only test of this binary; no thread of it has started yet.
        unsafe { std::env::set_var(k, v) };
    }
    let dir = fresh_dir("gcs-checkpoints");
    let run = dir.join("local");
    run_ok(&mut train(
        &run,
        &[&format!("train.steps={STEPS}"), "checkpoint.keep_last=3"],
    ));
    let local = ckpt_url(&run);

    let prefix = format!("runs/{}-{:08x}", std::process::id(), rand::random::<u32>());
    let keys = gcs.upload_tree(Path::new(&local), &prefix);
    let url = gcs.url(&prefix);
    println!("{} objects of {local} put into {url}", keys.len());
    let before = listing(&url);
    assert_eq!(
        before,
        listing(&local),
        "the bucket holds the run's checkpoints"
    );
    let committed: Vec<u64> = before
        .iter()
        .filter(|l| l.committed)
        .map(|l| l.step)
        .collect();
    assert_eq!(committed, vec![3, 6, 9]);

    // `ckpt list` prints the same table for both locations; `ckpt verify` passes.
    assert_eq!(ckpt_list(&url), ckpt_list(&local));
    let verified = run_ok(seqpipe().args(["ckpt", "verify", &url]));
    println!("{}", String::from_utf8_lossy(&verified.stdout).trim());

    // The state read through the GCS client is the run's, bit for bit.
    let (step, from_gcs) = final_state(&url);
    let (local_step, from_disk) = final_state(&local);
    assert_eq!((step, local_step), (STEPS, STEPS));
    assert_eq!(
        from_gcs.keys().collect::<Vec<_>>(),
        from_disk.keys().collect::<Vec<_>>()
    );
    for (tensor, bytes) in &from_gcs {
        assert!(bytes == &from_disk[tensor], "tensor {tensor} differs");
    }

    // Evaluation loads the newest checkpoint from GCS: the same loss as from local disk.
    let (at, loss) = eval(&dir.join("eval-gcs"), &url);
    let (local_at, local_loss) = eval(&dir.join("eval-local"), &local);
    println!("eval of step {at} from {url}: val_loss {loss}");
    assert_eq!((at, local_at), (STEPS, STEPS));
    assert_eq!(
        loss.to_bits(),
        local_loss.to_bits(),
        "{loss} vs {local_loss}"
    );

    // A damaged newest manifest: verify names it, eval falls back to step 6.
    let manifest = format!("{}/manifest.json", step_dir(STEPS));
    gcs.upload(&format!("{prefix}/{manifest}"), b"{ not a manifest");
    let err = run_err(seqpipe().args(["ckpt", "verify", &url]));
    assert!(err.contains("manifest.json"), "{err}");
    let (at, fallback_loss) = eval(&dir.join("eval-fallback"), &url);
    assert_eq!(at, 6, "eval did not fall back to the previous checkpoint");
    assert_ne!(fallback_loss.to_bits(), loss.to_bits());
    println!(
        "with step {STEPS}'s manifest damaged, eval fell back to step {at}: val_loss {fallback_loss}"
    );

    // Read-only commands retired, cleaned and wrote nothing.
    let after = listing(&url);
    assert_eq!(
        after
            .iter()
            .map(|l| (l.step, l.objects, l.committed))
            .collect::<Vec<_>>(),
        before
            .iter()
            .map(|l| (l.step, l.objects, l.committed))
            .collect::<Vec<_>>(),
        "the bucket changed"
    );
}
