//! The coordinator's node is lost, with the etcd rendezvous: every node runs `seqpipe agent
//! --rendezvous etcd://…`, one wins the leadership and runs the coordinator; when its node is
//! SIGKILLed (agent, coordinator and worker), its lease expires, another node takes over and the
//! job still ends bit-identical to an uninterrupted run. A real etcd server is started here.

mod common;

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::{
    assert_final_state, children_of, ckpt_url, elastic_job_sets, final_state, fresh_dir,
    run_events, run_ok, seqpipe,
};
use elastic::etcd::testing::EtcdServer;
use trainer::runtime::events::RunEvent;

const STEPS: u64 = 24;

fn job_sets(run_dir: &Path) -> Vec<String> {
    elastic_job_sets(run_dir, STEPS)
        .into_iter()
        .chain(
            [
                "pipeline.stages=3",
                "elastic.min_nodes=2",
                "elastic.heartbeat_s=0.5",
                "elastic.dead_after_s=2",
                "elastic.join_timeout_s=30",
            ]
            .map(String::from),
        )
        .flat_map(|s| ["--set".to_string(), s])
        .collect()
}

fn is_coordinator(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| c.split(|&b| b == 0).any(|arg| arg == b"train"))
        .unwrap_or(false)
}

fn kill(pid: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
}

/// Agents killed at the end, whatever happened.
struct Agents(Vec<Child>);

impl Drop for Agents {
    fn drop(&mut self) {
        for a in &mut self.0 {
            let _ = a.kill();
            let _ = a.wait();
        }
    }
}

#[test]
fn losing_the_coordinators_node_is_survivable_with_etcd() {
    let etcd = EtcdServer::start();
    let dir = fresh_dir("etcd-failover");
    let reference_dir = dir.join("reference");
    run_ok(
        seqpipe()
            .args(["train", "-q"])
            .args(job_sets(&reference_dir)),
    );
    let (_, reference) = final_state(&ckpt_url(&reference_dir));

    let run = dir.join("run");
    let url = format!("etcd://{}/seqpipe/failover-test", etcd.endpoint());
    let mut agents = Agents(Vec::new());
    for name in ["node-a", "node-b", "node-c"] {
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
        agents.0.push(
            seqpipe()
                .args(["agent", "--rendezvous", &url, "--name", name])
                .arg("--dir")
                .arg(dir.join(name))
                .args(job_sets(&run))
                .env("SEQPIPE_JOB_TOKEN", "failover-secret")
                .stderr(log)
                .spawn()
                .unwrap(),
        );
    }
    let steps_done = || {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("\"loss\""))
            .count()
    };
    let started = Instant::now();
    while steps_done() < 5 {
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "the job did not start; see the logs in {}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The leader is the agent whose child is the coordinator (`seqpipe train`).
    let leader = agents
        .0
        .iter()
        .position(|a| children_of(a.id()).into_iter().any(is_coordinator))
        .expect("one agent runs the coordinator");
    let victim = agents.0[leader].id();
    let mut doomed = vec![victim];
    for child in children_of(victim) {
        doomed.extend(children_of(child));
        doomed.push(child);
    }
    for pid in doomed {
        kill(pid);
    }
    let _ = agents.0[leader].wait();
    // The survivors finish the job and exit cleanly.
    for (i, agent) in agents.0.iter_mut().enumerate() {
        if i == leader {
            continue;
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(status) = agent.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "agent {i} did not finish; see the logs in {}",
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(
            status.success(),
            "agent {i} failed ({status}); see {}",
            dir.display()
        );
    }
    assert_final_state(&run, STEPS, &reference);
    let events = run_events(&run);
    let takeover = events
        .iter()
        .find_map(|e| match e {
            RunEvent::CoordinatorTakeover(t) => Some(t),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no coordinator_takeover event: {events:?}"));
    assert!(takeover.after_generation >= 1, "{takeover:?}");
    let plans: Vec<usize> = events
        .iter()
        .filter_map(|e| match e {
            RunEvent::Plan(p) => Some(p.stages),
            _ => None,
        })
        .collect();
    assert_eq!(plans.last(), Some(&2), "{events:?}");
}
