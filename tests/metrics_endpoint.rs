//! The coordinator's Prometheus endpoint (`elastic.metrics_listen`) during a real multi-process
//! run that loses a worker: scraped over and over with plain HTTP/1.1 GETs, its counters must move
//! as the events in `metrics.jsonl` say, and end equal to what the file records.

mod common;

use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::disturbed::{Scrape, get_metrics};
use common::{
    checkpoint_steps, children_of, elastic_job, free_port, fresh_dir, records, steps_done,
    wait_for_steps,
};
use trainer::runtime::events::{Recovered, RunEvent};
use trainer::runtime::recovery::Tier;

const STEPS: u64 = 16;

/// `GET /metrics` on `port` with a plain HTTP/1.1 request; `None` while nothing answers (the run
/// is starting) or the answer is not a complete exposition.
fn scrape(port: u16) -> Option<Scrape> {
    let (head, body) = get_metrics(port)?;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // The server closes the connection after the body: the whole exposition ends with `# EOF`.
    if !body.ends_with("# EOF\n") {
        return None;
    }
    Some(
        body.lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| {
                let (name, value) = l.rsplit_once(' ').expect("a sample line");
                (name.to_string(), value.parse().expect("a sample value"))
            })
            .collect(),
    )
}

fn value(s: &Scrape, name: &str) -> f64 {
    *s.get(name)
        .unwrap_or_else(|| panic!("no {name} in the scrape: {s:?}"))
}

fn recoveries(s: &Scrape, tier: Tier) -> f64 {
    value(s, &format!("seqpipe_recoveries_total{{tier=\"{tier}\"}}"))
}

/// The counters that only go up during a run.
const COUNTERS: &[&str] = &[
    "seqpipe_nodes_lost_total",
    "seqpipe_nodes_left_total",
    "seqpipe_checkpoints_total",
];

/// What the test kills.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Victim {
    /// One node's stage worker; its agent restarts it (the plan keeps its nodes).
    Worker,
    /// A whole node, agent and worker: the pipeline is planned again on the survivors.
    Node,
}

#[test]
fn counters_follow_the_events_of_a_run_that_loses_a_worker() {
    run_losing(Victim::Worker);
}

#[test]
fn counters_and_plan_follow_the_events_of_a_run_that_loses_a_node() {
    run_losing(Victim::Node);
}

/// Starts the job with its metrics endpoint on a free port and waits for its first step. The port
/// is free when picked, but another test's process may take it before the launcher binds it: the
/// launcher then exits with "Address already in use", and the job starts again on another port.
fn start_serving_metrics(run: &std::path::Path, log_path: &std::path::Path) -> (Child, u16) {
    for _ in 0..5 {
        let port = free_port();
        let _ = std::fs::remove_dir_all(run);
        std::fs::create_dir_all(run).unwrap();
        let mut child = elastic_job(run, STEPS)
            .args([
                "--set",
                &format!("elastic.metrics_listen=\"127.0.0.1:{port}\""),
                // Long enough for any scraper on a busy machine; the test ends it with SIGTERM.
                "--set",
                "elastic.metrics_linger_s=600",
            ])
            .stderr(std::fs::File::create(log_path).unwrap())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while steps_done(run) < 1 {
            if let Some(status) = child.try_wait().unwrap() {
                let log = std::fs::read_to_string(log_path).unwrap_or_default();
                assert!(
                    log.contains("Address already in use"),
                    "the job exited ({status}) before its first step:\n{log}"
                );
                break;
            }
            if started.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the job did not start");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if steps_done(run) >= 1 {
            return (child, port);
        }
        let _ = child.wait();
    }
    panic!("five free ports were all taken before the launcher could bind them")
}

/// Runs the job, SIGKILLs `victim` of its second node after step 3, scrapes all along, and checks
/// the scrapes against `metrics.jsonl`.
fn run_losing(victim: Victim) {
    let dir = fresh_dir(&format!("metrics-endpoint-{victim:?}"));
    let run = dir.join("run");
    let log_path = dir.join("launcher.log");
    let (mut child, port) = start_serving_metrics(&run, &log_path);
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();

    // Scrape all along the run, from a thread of its own.
    let scrapes: Arc<Mutex<Vec<Scrape>>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let scraper = {
        let (scrapes, done) = (scrapes.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::SeqCst) {
                if let Some(s) = scrape(port) {
                    scrapes.lock().unwrap().push(s);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };

    // SIGKILL one node's worker once the run is under way (its agent lives on), after a scrape
    // of a completed step.
    wait_for_steps(&run, 3);
    let started = Instant::now();
    let before = loop {
        let seen = scrapes
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find(|s| s.get("seqpipe_step").is_some_and(|&step| step >= 1.0))
            .cloned();
        if let Some(s) = seen {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "no scrape showed a step; launcher log:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let nodes = children_of(child.id());
    assert!(nodes.len() >= 2, "expected a multi-node job: {nodes:?}");
    let worker = *children_of(nodes[1])
        .first()
        .unwrap_or_else(|| panic!("node {} runs no worker", nodes[1]));
    let victims = match victim {
        Victim::Worker => vec![worker],
        Victim::Node => vec![worker, nodes[1]],
    };
    for pid in victims {
        Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .unwrap();
    }

    // The run ends (the last step and its checkpoint are recorded); the endpoint lingers.
    let started = Instant::now();
    let finished = |s: &Scrape| {
        s.get("seqpipe_step") == Some(&(STEPS as f64))
            && s.get("seqpipe_last_checkpoint_step") == Some(&(STEPS as f64))
    };
    while !scrapes.lock().unwrap().last().is_some_and(finished) {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "no scrape showed step {STEPS} with its checkpoint; launcher log:\n{}",
            log()
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "the run exited ({status}) before a final scrape; log:\n{}",
                log()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Nothing is recorded after the final checkpoint: the file and a scrape taken after reading
    // it must agree exactly.
    let records = records(&run);
    let last = loop {
        if let Some(s) = scrape(port) {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "no last scrape"
        );
    };
    done.store(true, Ordering::SeqCst);
    scraper.join().unwrap();
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}; launcher log:\n{}", log());

    let events: Vec<&RunEvent> = records.iter().filter_map(|r| r.as_event()).collect();
    let count = |f: &dyn Fn(&RunEvent) -> bool| events.iter().filter(|e| f(e)).count() as f64;
    let steps: Vec<u64> = records
        .iter()
        .filter_map(|r| r.as_step().map(|s| s.step))
        .collect();
    assert_eq!(steps.last(), Some(&STEPS));
    assert_eq!(value(&last, "seqpipe_step"), STEPS as f64);
    let last_loss = records.iter().rev().find_map(|r| r.as_step()).unwrap().loss;
    assert_eq!(value(&last, "seqpipe_loss"), last_loss);
    assert!(value(&last, "seqpipe_tokens_per_second") > 0.0);
    assert!(value(&last, "seqpipe_step_time_seconds") > 0.0);

    // Recoveries by tier, as the `recovered` events say.
    let recovered = count(&|e| matches!(e, RunEvent::Recovered(_)));
    assert!(recovered >= 1.0, "the kill was not recovered: {events:?}");
    for tier in Tier::ALL {
        let in_file =
            count(&|e| matches!(e, RunEvent::Recovered(Recovered { tier: t, .. }) if *t == tier));
        assert_eq!(recoveries(&last, tier), in_file, "tier {tier}: {events:?}");
    }
    assert_eq!(
        value(&last, "seqpipe_nodes_lost_total"),
        count(&|e| matches!(e, RunEvent::NodeLost(_)))
    );
    assert!(
        value(&last, "seqpipe_nodes_lost_total") >= 1.0,
        "{events:?}"
    );
    assert_eq!(
        value(&last, "seqpipe_nodes_left_total"),
        count(&|e| matches!(e, RunEvent::NodeLeft(_)))
    );
    let last_checkpoint = *checkpoint_steps(&events)
        .last()
        .expect("a committed checkpoint");
    assert_eq!(last_checkpoint, STEPS);
    assert_eq!(
        value(&last, "seqpipe_last_checkpoint_step"),
        last_checkpoint as f64
    );
    assert!(value(&last, "seqpipe_checkpoint_age_seconds") >= 0.0);
    // The plan the run ended under: the newest `plan` event's, or the first plan's when a worker
    // was replaced inside the run's first plan (its node stays).
    let plan = events.iter().rev().find_map(|e| match e {
        RunEvent::Plan(p) => Some(p),
        _ => None,
    });
    match (victim, plan) {
        (Victim::Node, Some(plan)) => {
            let nodes: std::collections::BTreeSet<_> = plan.nodes.iter().collect();
            assert_eq!(value(&last, "seqpipe_plan_stages"), plan.stages as f64);
            assert_eq!(value(&last, "seqpipe_plan_replicas"), plan.replicas as f64);
            assert_eq!(value(&last, "seqpipe_plan_nodes"), nodes.len() as f64);
            assert_eq!(
                value(&last, "seqpipe_plan_generation"),
                plan.generation as f64
            );
            assert!(
                value(&last, "seqpipe_plan_nodes") < value(&before, "seqpipe_plan_nodes"),
                "the lost node is still counted: {last:?}"
            );
        }
        (Victim::Node, None) => panic!("no new plan after losing a node: {events:?}"),
        (Victim::Worker, _) => {
            for name in ["seqpipe_plan_stages", "seqpipe_plan_nodes"] {
                assert_eq!(value(&last, name), value(&before, name), "{name}");
            }
            assert!(value(&last, "seqpipe_plan_stages") >= 2.0, "{last:?}");
        }
    }

    // Along the way: counters never went down; the scrape before the kill saw no loss.
    let scrapes = scrapes.lock().unwrap();
    assert!(scrapes.len() >= 2, "only {} scrapes", scrapes.len());
    for pair in scrapes.windows(2) {
        for name in COUNTERS {
            assert!(
                pair[0].get(*name) <= pair[1].get(*name),
                "{name} went down: {:?} then {:?}",
                pair[0].get(*name),
                pair[1].get(*name)
            );
        }
        for tier in Tier::ALL {
            assert!(recoveries(&pair[0], tier) <= recoveries(&pair[1], tier));
        }
    }
    assert!(value(&before, "seqpipe_plan_nodes") >= 2.0, "{before:?}");
    assert!(
        Tier::ALL.iter().all(|&t| recoveries(&before, t) == 0.0),
        "{before:?}"
    );
    assert_eq!(
        value(&before, "seqpipe_nodes_lost_total"),
        0.0,
        "{before:?}"
    );
}
