//! `seqpipe bench goodput` end to end on the elastic tests' tiny job: the disturbed run (seeded
//! SIGKILLs of workers and whole nodes, replacement nodes joining) finishes, and the command's JSON
//! line says its final state is bit-identical to the undisturbed run's.

mod common;

use common::{elastic_job_sets, fresh_dir, run_ok, seqpipe};

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
}
