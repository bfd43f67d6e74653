//! `seqpipe bench goodput` end to end on the elastic tests' tiny job: the disturbed run (seeded
//! SIGKILLs of workers and whole nodes, replacement nodes joining) finishes, and the command's JSON
//! line says its final state is bit-identical to the undisturbed run's, and its goodput account is
//! the one the coordinator exports live.

mod common;

use common::disturbed::{run_disturbed, scrape};
use common::{elastic_job_sets, fresh_dir, records, run_ok, seqpipe};
use trainer::runtime::goodput::{Cause, Goodput};

#[test]
fn goodput_bench_kills_recovers_and_ends_bit_identical() {
    let dir = fresh_dir("goodput");
    let mut cmd = seqpipe();
    cmd.args(["bench", "goodput"]);
    // (run.dir is replaced per run by the benchmark.)
    for s in elastic_job_sets(&dir.join("unused"), 60) {
        cmd.args(["--set", &s]);
    }
    // One failure per 20 steps (the rate) on a job whose steps take ~50 ms.
    cmd.args(["--failures-per-step", "0.05", "--seed", "1"])
        .args(["--rejoin-after-s", "0.5", "--dir"])
        .arg(&dir);
    let out = run_ok(&mut cmd);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().expect("output");
    let report: serde_json::Value =
        serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(report["bit_identical"], true, "{stdout}");
    assert_eq!(report["final_step"], 60, "{stdout}");
    let ettr = report["ettr"].as_f64().unwrap();
    assert!(ettr > 0.0 && ettr <= 1.5, "{stdout}");
    let kills =
        report["kills"]["worker"].as_u64().unwrap() + report["kills"]["node"].as_u64().unwrap();
    assert!(kills >= 1, "seed 1 kills within the run: {stdout}");
    let recoveries: u64 = report["recoveries"]
        .as_object()
        .unwrap()
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert!(recoveries >= 1, "{stdout}");
    assert!(stdout.contains("ETTR"), "the human table: {stdout}");
    // The disturbed run's own account: it lost time to its recoveries, and what stands plus what
    // was lost fits in its wall time.
    let ratio = report["goodput_ratio"].as_f64().unwrap();
    assert!(ratio > 0.0 && ratio < 1.0, "{stdout}");
    let lost: f64 = report["goodput_lost_s"]
        .as_object()
        .unwrap()
        .values()
        .map(|s| s.as_f64().unwrap())
        .sum();
    assert!(lost > 0.0, "{stdout}");
    let (wall, productive) = (
        report["goodput_wall_s"].as_f64().unwrap(),
        report["goodput_productive_s"].as_f64().unwrap(),
    );
    assert!(productive + lost <= wall * 1.02, "{stdout}");
}

/// The coordinator's live `seqpipe_goodput_*` metrics at the end of a run that loses a worker and
/// then a whole node equal the offline account of its `metrics.jsonl` (within 2 %: the exposition
/// prints floats, the file's timestamps are what both fold).
#[test]
fn live_goodput_ends_at_the_offline_account_of_the_same_disturbed_run() {
    const STEPS: u64 = 24;
    let dir = fresh_dir("goodput-live");
    let run = run_disturbed(&dir, STEPS, |_| {});
    let live = scrape(run.port).expect("the lingering endpoint answers");
    let offline = Goodput::of_records(&records(&run.run)).figures();
    let value = |name: &str| {
        *live
            .get(name)
            .unwrap_or_else(|| panic!("no {name} in the scrape: {live:?}"))
    };
    let ratio = value("seqpipe_goodput_ratio");
    println!(
        "live ETTR {ratio:.4} (productive {:.3} s / wall {:.3} s); offline {:.4} ({:.3} s / {:.3} s); lost {:?}",
        value("seqpipe_goodput_productive_seconds"),
        value("seqpipe_goodput_wall_seconds"),
        offline.ettr,
        offline.productive_s,
        offline.wall_s,
        offline.lost_s
    );
    let near = |a: f64, b: f64| (a - b).abs() <= 0.02 * b.abs().max(1e-9);
    assert!(near(ratio, offline.ettr), "{ratio} vs {offline:?}");
    assert!(
        ratio > 0.0 && ratio < 1.0,
        "{ratio}: the run lost time to its recoveries"
    );
    assert!(near(value("seqpipe_goodput_wall_seconds"), offline.wall_s));
    assert!(near(
        value("seqpipe_goodput_productive_seconds"),
        offline.productive_s
    ));
    for cause in Cause::ALL {
        let name = format!(
            "seqpipe_goodput_lost_seconds{{cause=\"{}\"}}",
            cause.as_str()
        );
        let (l, o) = (value(&name), offline.lost_s[&cause]);
        assert!(
            (l - o).abs() <= 0.02 * o.max(0.05),
            "{name}: live {l}, offline {o}"
        );
    }
    // Two recoveries: the worker (mid-step or peer) and the node.
    let recovered = offline.lost_s[&Cause::Recovery] + offline.lost_s[&Cause::Restart];
    assert!(recovered > 0.0, "{offline:?}");
    run.stop();
}
