//! `seqpipe train --trace` (a Chrome trace of every stage's units) and `seqpipe plot` (a run's
//! metrics as an SVG picture), end to end.

mod common;

use std::collections::{BTreeMap, HashMap};

use common::{fresh_dir, records, run_err, run_ok, seqpipe, tiny_model_args};
use serde_json::Value;
use trainer::runtime::events::{PlanAdopted, RunEvent};

const STAGES: usize = 2;
const MICROBATCHES: usize = 3;
const SPLITS: usize = 2;
const STEPS: usize = 3;

/// One `"ph": "X"` slice of the trace.
struct Slice {
    name: String,
    tid: u64,
    ts: i64,
    dur: i64,
    step: u64,
}

#[test]
fn traced_run_has_every_unit_once_per_step_and_plots() {
    let dir = fresh_dir("trace");
    let run_dir = dir.join("run");
    let trace_path = dir.join("trace.json");
    run_ok(
        seqpipe()
            .args(["train", "-q"])
            .args(tiny_model_args())
            .args([
                "--set".to_string(),
                format!("train.steps={STEPS}"),
                "--set".to_string(),
                "train.eval_every=2".to_string(),
                "--set".to_string(),
                format!("pipeline.stages={STAGES}"),
                "--set".to_string(),
                format!("pipeline.microbatches={MICROBATCHES}"),
                "--set".to_string(),
                format!("pipeline.splits={SPLITS}"),
                "--set".to_string(),
                format!("run.dir={}", run_dir.display()),
            ])
            .arg("--trace")
            .arg(&trace_path),
    );

    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(&trace_path).expect("trace written"))
            .expect("the trace is JSON");
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    let thread_names: BTreeMap<u64, &str> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| {
            (
                e["tid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap(),
            )
        })
        .collect();
    let mut expected_names = BTreeMap::from([(0, "coordinator".to_string())]);
    expected_names.extend((0..STAGES).map(|r| (r as u64 + 1, format!("stage {r}"))));
    assert_eq!(
        thread_names,
        expected_names
            .iter()
            .map(|(t, n)| (*t, n.as_str()))
            .collect::<BTreeMap<_, _>>()
    );
    let slices: Vec<Slice> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| Slice {
            name: e["name"].as_str().expect("name").to_string(),
            tid: e["tid"].as_u64().expect("tid"),
            ts: e["ts"].as_i64().expect("ts in µs"),
            dur: e["dur"].as_i64().expect("dur in µs"),
            step: e["args"]["step"].as_u64().expect("args.step"),
        })
        .collect();
    assert!(slices.iter().all(|s| s.dur >= 0 && s.ts > 0));

    let coordinator: Vec<&str> = slices
        .iter()
        .filter(|s| s.tid == 0 && s.name.starts_with("step "))
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(coordinator, ["step 1", "step 2", "step 3"]);

    for r in 0..STAGES {
        let tid = r as u64 + 1;
        let mut mine: Vec<&Slice> = slices.iter().filter(|s| s.tid == tid).collect();
        assert_eq!(
            mine.len(),
            STEPS * MICROBATCHES * SPLITS * 2,
            "stage {r}: one slice per unit, forward and backward, per step"
        );
        for step in 1..=STEPS as u64 {
            let mut names: Vec<&str> = mine
                .iter()
                .filter(|s| s.step == step)
                .map(|s| s.name.as_str())
                .collect();
            names.sort_unstable();
            let mut expected: Vec<String> = ["B", "F"]
                .iter()
                .flat_map(|k| {
                    (0..MICROBATCHES)
                        .flat_map(move |i| (0..SPLITS).map(move |j| format!("{k}{i}.{j}")))
                })
                .collect();
            expected.sort_unstable();
            assert_eq!(names, expected, "stage {r} step {step}");
        }
        // A unit's forward ends before its backward starts.
        let by_unit: HashMap<(u64, &str), &Slice> = mine
            .iter()
            .map(|s| ((s.step, s.name.as_str()), *s))
            .collect();
        for s in mine.iter().filter(|s| s.name.starts_with('B')) {
            let forward = by_unit[&(s.step, &*format!("F{}", &s.name[1..]))];
            assert!(
                forward.ts + forward.dur <= s.ts,
                "stage {r} step {}: {} ends after {} starts",
                s.step,
                forward.name,
                s.name
            );
        }
        // One stage computes one unit at a time.
        mine.sort_by_key(|s| s.ts);
        for pair in mine.windows(2) {
            assert!(
                pair[0].ts + pair[0].dur <= pair[1].ts,
                "stage {r}: {} of step {} overlaps {} of step {}",
                pair[0].name,
                pair[0].step,
                pair[1].name,
                pair[1].step
            );
        }
    }

    let svg_path = dir.join("run.svg");
    let out = run_ok(
        seqpipe()
            .arg("plot")
            .arg(run_dir.join("metrics.jsonl"))
            .arg("--out")
            .arg(&svg_path),
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("3 steps"));
    let svg = std::fs::read_to_string(&svg_path).expect("svg written");
    assert!(svg.starts_with("<svg"), "{svg}");
    assert!(svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<svg").count(), 1);
    assert!(
        svg.contains(&run_dir.display().to_string()),
        "title names the run"
    );
    let steps = records(&run_dir)
        .iter()
        .filter(|r| r.as_step().is_some())
        .count();
    assert_eq!(steps, STEPS);
    for class in ["loss", "tokens_per_s"] {
        let line = svg
            .lines()
            .find(|l| l.starts_with(&format!("<polyline class=\"{class}\"")))
            .unwrap_or_else(|| panic!("no {class} polyline:\n{svg}"));
        let points = line.split("points=\"").nth(1).unwrap();
        let points = &points[..points.find('"').unwrap()];
        assert_eq!(points.split_whitespace().count(), steps, "{line}");
        for point in points.split_whitespace() {
            let (x, y) = point.split_once(',').expect("x,y");
            assert!(x.parse::<f64>().unwrap().is_finite() && y.parse::<f64>().unwrap().is_finite());
        }
    }
    // Evaluations at step 2 and after the last step.
    assert_eq!(svg.matches("<circle class=\"val_loss\"").count(), 2);
}

#[test]
fn plot_fails_clearly_on_a_missing_or_empty_metrics_file() {
    let dir = fresh_dir("plot-errors");
    let missing = dir.join("nope").join("metrics.jsonl");
    let err = run_err(
        seqpipe()
            .arg("plot")
            .arg(&missing)
            .arg("--out")
            .arg(dir.join("x.svg")),
    );
    assert!(
        err.contains("cannot read") && err.contains(&missing.display().to_string()),
        "{err}"
    );
    assert!(!dir.join("x.svg").exists());

    let events_only = dir.join("metrics.jsonl");
    let plan = RunEvent::Plan(PlanAdopted {
        generation: 0,
        stages: 1,
        replicas: 1,
        nodes: vec!["local-001".into()],
        resume_from: None,
        tier: None,
        waited_for_nodes_s: None,
    });
    std::fs::write(
        &events_only,
        format!("{}\n", serde_json::to_string(&plan).unwrap()),
    )
    .unwrap();
    let err = run_err(
        seqpipe()
            .arg("plot")
            .arg(&dir)
            .arg("--out")
            .arg(dir.join("x.svg")),
    );
    assert!(err.contains("no step records"), "{err}");
}
