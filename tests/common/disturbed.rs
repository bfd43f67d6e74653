//! A disturbed run that serves its metrics: the elastic tests' job with its Prometheus endpoint
//! on a free port (lingering after the run), one node's worker SIGKILLed after step 3 (its agent
//! starts a new one) and, once that is recovered, another node lost whole (agent and worker).
//! Shared by tests/goodput.rs (the live goodput against the offline account) and
//! tests/prometheus.rs (a real Prometheus scraping it).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use super::{children_of, elastic_job, free_port, steps_done};

/// One scrape of `/metrics`: sample name (with its labels) → value.
pub type Scrape = BTreeMap<String, f64>;

/// `GET /metrics` on `port` with a plain HTTP/1.1 request (the server closes the connection after
/// the body): the answer's head and body, or `None` while nothing answers in full.
pub fn get_metrics(port: u16) -> Option<(String, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    Some((head.to_string(), body.to_string()))
}

/// `GET /metrics` on `port`; `None` while nothing answers or the exposition is incomplete.
pub fn scrape(port: u16) -> Option<Scrape> {
    let (head, body) = get_metrics(port)?;
    if !head.starts_with("HTTP/1.1 200") || !body.ends_with("# EOF\n") {
        return None;
    }
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect()
}

/// A disturbed run, finished, its endpoint still serving.
pub struct Disturbed {
    pub child: Child,
    pub run: PathBuf,
    pub port: u16,
    pub log_path: PathBuf,
}

impl Disturbed {
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Ends the lingering endpoint (SIGTERM) and checks that the launcher exits cleanly.
    pub fn stop(mut self) {
        Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}; launcher log:\n{}", self.log());
    }
}

/// Waits until `run` records `steps` steps; fails with the log if the launcher exits first.
fn wait_steps(child: &mut Child, run: &Path, steps: usize, log: &Path) {
    let started = Instant::now();
    while steps_done(run) < steps {
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "the job exited ({status}) before step {steps}; log:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "no step {steps} within 10 minutes; log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn sigkill(pid: u32) {
    Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
}

/// Runs the job of `steps` steps in `dir/run` (see the module docs) and returns once a scrape
/// shows its last step and last checkpoint. `ready` is called with the endpoint's port once the
/// first step is done (to point a scraper at it).
pub fn run_disturbed(dir: &Path, steps: u64, ready: impl FnOnce(u16)) -> Disturbed {
    let run = dir.join("run");
    let log_path = dir.join("launcher.log");
    // The port is free when picked, but another test's process may take it before the launcher
    // binds it: the launcher then exits with "Address already in use"; start again elsewhere.
    let (mut child, port) = 'start: {
        for _ in 0..5 {
            let port = free_port();
            let _ = std::fs::remove_dir_all(&run);
            std::fs::create_dir_all(&run).unwrap();
            let mut child = elastic_job(&run, steps)
                .args([
                    "--set",
                    &format!("elastic.metrics_listen=\"127.0.0.1:{port}\""),
                    "--set",
                    "elastic.metrics_linger_s=600",
                ])
                .stderr(std::fs::File::create(&log_path).unwrap())
                .spawn()
                .unwrap();
            let started = Instant::now();
            while steps_done(&run) < 1 && started.elapsed() < Duration::from_secs(120) {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            if steps_done(&run) >= 1 {
                break 'start (child, port);
            }
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            assert!(
                log.contains("Address already in use"),
                "the job did not reach its first step:\n{log}"
            );
        }
        panic!("five free ports were all taken before the launcher could bind them")
    };
    ready(port);

    // A worker of the second node, after step 3.
    wait_steps(&mut child, &run, 3, &log_path);
    let nodes = children_of(child.id());
    assert!(nodes.len() >= 3, "expected a job of 3+ nodes: {nodes:?}");
    let worker = *children_of(nodes[1])
        .first()
        .unwrap_or_else(|| panic!("node {} runs no worker", nodes[1]));
    sigkill(worker);

    // Once recovered (3 more steps recorded), the last node whole: its worker, then its agent.
    let after_first = steps_done(&run) + 3;
    wait_steps(&mut child, &run, after_first, &log_path);
    let nodes = children_of(child.id());
    let last = *nodes.last().expect("nodes");
    for pid in children_of(last) {
        sigkill(pid);
    }
    sigkill(last);

    // The run ends: a scrape shows the last step and its checkpoint (the endpoint lingers).
    let started = Instant::now();
    loop {
        if let Some(s) = scrape(port)
            && s.get("seqpipe_step") == Some(&(steps as f64))
            && s.get("seqpipe_last_checkpoint_step") == Some(&(steps as f64))
        {
            break;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "the run exited ({status}) before a final scrape; log:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "no scrape showed step {steps} with its checkpoint; log:\n{}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Disturbed {
        child,
        run,
        port,
        log_path,
    }
}
