//! Cloud preemption notices, end to end: a fake instance metadata service on 127.0.0.1 answers
//! as AWS (IMDSv2), GCP and Azure (Scheduled Events) document it, checking the headers each
//! demands. Mid-run it starts announcing the instance's preemption; the node whose agent watches
//! it (`seqpipe agent --preemption-notice CLOUD --metadata-endpoint URL`) leaves at the next step
//! boundary with no step lost, and the run ends bit-identical to an undisturbed one. A metadata
//! service that cannot be reached changes nothing but one warning per agent.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use common::{
    assert_final_state, ckpt_url, elastic_job, final_state, free_port, fresh_dir, run_events,
    run_ok, seqpipe, wait_for_steps,
};
use trainer::runtime::events::RunEvent;
use trainer::runtime::recovery::Tier;

/// Enough steps that a notice announced after step 3 (the agent polls every 0.2 s) reaches the
/// coordinator long before the end, even on a busy machine: steps slow down with it.
const STEPS: u64 = 64;

/// The AWS session token the fake hands out.
const AWS_TOKEN: &str = "AQAEAFakeTokenForSeqpipeTests==";

/// The Azure VM name of the noticed node.
const AZURE_VM: &str = "seqpipe-vm-2";

/// The elastic tests' job with `extra` settings.
fn job(run_dir: &Path, extra: &[&str]) -> Command {
    let mut cmd = elastic_job(run_dir, STEPS);
    for s in extra {
        cmd.args(["--set", s]);
    }
    cmd
}

/// The final state of an undisturbed run, computed once for the tests of this file.
fn reference() -> &'static BTreeMap<String, Vec<u8>> {
    static REFERENCE: OnceLock<BTreeMap<String, Vec<u8>>> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let dir = fresh_dir("preemption-reference");
        run_ok(&mut job(&dir, &[]));
        final_state(&ckpt_url(&dir)).1
    })
}

/// A fake instance metadata service of one cloud on 127.0.0.1. It answers "no notice" until
/// [`FakeMetadata::announce`], then "notice"; requests without the headers the real service
/// demands are refused (and counted).
struct FakeMetadata {
    addr: String,
    notice: Arc<AtomicBool>,
    /// Requests the real service would refuse (a missing or wrong header).
    refused: Arc<AtomicUsize>,
    /// Notices served.
    served: Arc<AtomicUsize>,
}

impl FakeMetadata {
    fn start(cloud: &'static str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let notice = Arc::new(AtomicBool::new(false));
        let refused = Arc::new(AtomicUsize::new(0));
        let served = Arc::new(AtomicUsize::new(0));
        let (n, r, s) = (notice.clone(), refused.clone(), served.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (n, r, s) = (n.clone(), r.clone(), s.clone());
                std::thread::spawn(move || {
                    let _ = serve(cloud, stream, &n, &r, &s);
                });
            }
        });
        Self {
            addr,
            notice,
            refused,
            served,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn announce(&self) {
        self.notice.store(true, Ordering::SeqCst);
    }
}

/// One request: method, path with query, headers (names lowercase).
struct Request {
    method: String,
    target: String,
    headers: BTreeMap<String, String>,
}

impl Request {
    fn read(stream: &TcpStream) -> std::io::Result<Self> {
        let mut reader = BufReader::new(stream.take(64 << 10));
        let mut line = String::new();
        reader.read_line(&mut line)?;
        let mut parts = line.split_whitespace();
        let method = parts.next().unwrap_or_default().to_string();
        let target = parts.next().unwrap_or_default().to_string();
        let mut headers = BTreeMap::new();
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 || line.trim().is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':') {
                headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_string());
            }
        }
        Ok(Self {
            method,
            target,
            headers,
        })
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or_default()
    }

    fn query(&self, key: &str) -> Option<&str> {
        let query = self.target.split_once('?')?.1;
        query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v)
    }
}

fn respond(
    mut stream: TcpStream,
    status: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<()> {
    let mut text = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (name, value) in headers {
        text.push_str(&format!("{name}: {value}\r\n"));
    }
    text.push_str("\r\n");
    text.push_str(body);
    stream.write_all(text.as_bytes())
}

/// Answers one request as `cloud`'s metadata service does.
fn serve(
    cloud: &str,
    stream: TcpStream,
    notice: &AtomicBool,
    refused: &AtomicUsize,
    served: &AtomicUsize,
) -> std::io::Result<()> {
    let req = Request::read(&stream)?;
    let refuse = |stream, status| {
        refused.fetch_add(1, Ordering::SeqCst);
        respond(stream, status, &[], "")
    };
    match (cloud, req.method.as_str(), req.path()) {
        // IMDSv2: a session token first, then every GET carries it.
        ("aws", "PUT", "/latest/api/token") => {
            let ttl = req.header("x-aws-ec2-metadata-token-ttl-seconds");
            match ttl.and_then(|t| t.parse::<u32>().ok()) {
                Some(1..=21600) => respond(stream, "200 OK", &[], AWS_TOKEN),
                _ => refuse(stream, "400 Bad Request"),
            }
        }
        ("aws", "GET", "/latest/meta-data/spot/instance-action") => {
            if req.header("x-aws-ec2-metadata-token") != Some(AWS_TOKEN) {
                return refuse(stream, "401 Unauthorized");
            }
            if notice.load(Ordering::SeqCst) {
                served.fetch_add(1, Ordering::SeqCst);
                let body = r#"{"action": "terminate", "time": "2026-11-23T08:22:00Z"}"#;
                respond(stream, "200 OK", &[("Content-Type", "text/plain")], body)
            } else {
                respond(stream, "404 Not Found", &[], "<html>404 - Not Found</html>")
            }
        }
        // GCP: `wait_for_change` holds the answer until the value's ETag differs from
        // `last_etag`, or `timeout_sec` passes.
        ("gcp", "GET", "/computeMetadata/v1/instance/preempted") => {
            if req.header("metadata-flavor") != Some("Google") {
                return refuse(stream, "403 Forbidden");
            }
            let etag = |preempted: bool| if preempted { "e7a9" } else { "0f12" };
            if req.query("wait_for_change") == Some("true") {
                let timeout: u64 = req
                    .query("timeout_sec")
                    .and_then(|t| t.parse().ok())
                    .unwrap_or(30);
                let until = Instant::now() + Duration::from_secs(timeout.min(30));
                while req.query("last_etag") == Some(etag(notice.load(Ordering::SeqCst)))
                    && Instant::now() < until
                {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            let preempted = notice.load(Ordering::SeqCst);
            if preempted {
                served.fetch_add(1, Ordering::SeqCst);
            }
            respond(
                stream,
                "200 OK",
                &[("Metadata-Flavor", "Google"), ("ETag", etag(preempted))],
                if preempted { "TRUE" } else { "FALSE" },
            )
        }
        // Azure: `Metadata: true` and an api-version on every request.
        ("azure", "GET", path) => {
            if req.header("metadata") != Some("true") || req.query("api-version").is_none() {
                return refuse(stream, "400 Bad Request");
            }
            match path {
                "/metadata/instance/compute/name" => respond(stream, "200 OK", &[], AZURE_VM),
                "/metadata/scheduledevents" => {
                    // Another VM's reboot is always scheduled: logged, ignored.
                    let mut events = vec![format!(
                        r#"{{"EventId":"B7E1C3A0-0000-4000-8000-000000000001","EventType":"Reboot","ResourceType":"VirtualMachine","Resources":["other-vm"],"EventStatus":"Scheduled","NotBefore":"Mon, 23 Nov 2026 08:30:00 GMT","Description":"","EventSource":"Platform","DurationInSeconds":-1}}"#
                    )];
                    if notice.load(Ordering::SeqCst) {
                        served.fetch_add(1, Ordering::SeqCst);
                        events.push(format!(
                            r#"{{"EventId":"602d9444-d2cd-49c7-8624-8643e7171297","EventType":"Preempt","ResourceType":"VirtualMachine","Resources":["{AZURE_VM}"],"EventStatus":"Scheduled","NotBefore":"Mon, 23 Nov 2026 08:22:30 GMT","Description":"","EventSource":"Platform","DurationInSeconds":-1}}"#
                        ));
                    }
                    let body = format!(
                        r#"{{"DocumentIncarnation":{},"Events":[{}]}}"#,
                        events.len(),
                        events.join(",")
                    );
                    respond(
                        stream,
                        "200 OK",
                        &[("Content-Type", "application/json")],
                        &body,
                    )
                }
                _ => respond(stream, "404 Not Found", &[], ""),
            }
        }
        _ => respond(stream, "404 Not Found", &[], ""),
    }
}

/// A process of the test, killed if the test fails before it exits.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits for `child` to exit (at most `limit`) and returns whether it succeeded.
fn wait_success(child: &mut Child, limit: Duration) -> bool {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.success();
        }
        assert!(
            started.elapsed() < limit,
            "a process did not exit in {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The multi-host way: a coordinator waiting for 4 agents, one of which (`node-2`) watches the
/// fake metadata service of `cloud`; the fake announces the preemption after step 3. Node 2
/// must leave at a step boundary, losing no step, and the run end bit-identical.
fn notice_mid_run(dir: &Path, cloud: &'static str) {
    let fake = FakeMetadata::start(cloud);
    let run = dir.join("run");
    let addr = format!("127.0.0.1:{}", free_port());
    let token = "preemption-test-secret";
    let listen = format!("elastic.listen={addr}");
    let mut coordinator = Proc(
        job(
            &run,
            &[
                &listen,
                "elastic.local_agents=false",
                "elastic.join_timeout_s=120",
            ],
        )
        .env("SEQPIPE_JOB_TOKEN", token)
        .stderr(std::fs::File::create(dir.join("coordinator.log")).unwrap())
        .spawn()
        .unwrap(),
    );
    let log_of = |node: usize| dir.join(format!("agent-node-{node}.log"));
    let mut agents: Vec<Proc> = (0..4)
        .map(|node| {
            let mut cmd = seqpipe();
            cmd.args(["agent", "--join", &addr, "--name", &format!("node-{node}")])
                .args(["--connect-timeout-s", "60", "--dir"])
                .arg(dir.join(format!("node-{node}")))
                .env("SEQPIPE_JOB_TOKEN", token)
                .env("RUST_LOG", "info")
                .stdin(Stdio::null())
                .stderr(std::fs::File::create(log_of(node)).unwrap());
            if node == 2 {
                cmd.args(["--preemption-notice", cloud])
                    .args(["--metadata-endpoint", &fake.url()])
                    .args(["--metadata-poll-s", "0.2"]);
            }
            Proc(cmd.spawn().unwrap())
        })
        .collect();
    wait_for_steps(&run, 3);
    fake.announce();
    let limit = Duration::from_secs(300);
    let logs = || {
        let mut text = std::fs::read_to_string(dir.join("coordinator.log")).unwrap_or_default();
        text.push_str(&std::fs::read_to_string(log_of(2)).unwrap_or_default());
        text
    };
    assert!(
        wait_success(&mut coordinator.0, limit),
        "{cloud}: {}",
        logs()
    );
    for (node, agent) in agents.iter_mut().enumerate() {
        assert!(
            wait_success(&mut agent.0, limit),
            "{cloud}: agent node-{node}"
        );
    }
    assert_final_state(&run, STEPS, reference());

    let events = run_events(&run);
    let left = events
        .iter()
        .find_map(|e| match e {
            RunEvent::NodeLeft(l) => Some(l),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{cloud}: no node left: {events:?}\n{}", logs()));
    assert_eq!(left.node.as_str(), "node-2", "{left:?}");
    let expected = match cloud {
        "aws" => "preemption notice (aws spot instance-action terminate at 2026-11-23T08:22:00Z)",
        "gcp" => "preemption notice (gcp instance preempted)",
        _ => {
            "preemption notice (azure scheduled event Preempt \
             602d9444-d2cd-49c7-8624-8643e7171297 not before Mon, 23 Nov 2026 08:22:30 GMT)"
        }
    };
    assert_eq!(left.reason, expected, "{left:?}");
    let recovered = events
        .iter()
        .find_map(|e| match e {
            RunEvent::Recovered(r) => Some(r),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{events:?}"));
    assert_eq!(recovered.tier, Tier::Handover, "{recovered:?}");
    assert_eq!(recovered.lost_steps, 0, "{recovered:?}");
    assert_eq!(
        (recovered.stages_before, recovered.stages_after),
        (4, 3),
        "{recovered:?}"
    );
    // The agent asked as the cloud demands, and logged the notice's deadline.
    assert_eq!(
        fake.refused.load(Ordering::SeqCst),
        0,
        "{cloud}: refused requests"
    );
    assert!(fake.served.load(Ordering::SeqCst) > 0, "{cloud}");
    let log = std::fs::read_to_string(log_of(2)).unwrap();
    assert!(log.contains("preemption notice from the cloud"), "{log}");
    assert!(log.contains("deadline"), "{log}");
    if cloud == "azure" {
        assert!(log.contains("not a preemption of this VM"), "{log}");
    }
}

/// Each cloud's notice, announced mid-run by its fake metadata service, hands the noticed node
/// over at the next step boundary; every run ends bit-identical to the undisturbed one.
#[test]
fn cloud_preemption_notices_hand_over_at_the_step_boundary() {
    let dir = fresh_dir("cloud-notice");
    for cloud in ["aws", "gcp", "azure"] {
        let cloud_dir = dir.join(cloud);
        std::fs::create_dir_all(&cloud_dir).unwrap();
        notice_mid_run(&cloud_dir, cloud);
    }
}

/// Every agent log under `dir`.
fn agent_logs(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("agent-"))
            {
                found.push(path);
            }
        }
    }
    found
}

/// Local agents told by the config to watch an AWS metadata service on a closed port: the run
/// is undisturbed and bit-identical, and each agent warns exactly once.
#[test]
fn an_unreachable_metadata_service_changes_nothing() {
    let dir = fresh_dir("no-metadata");
    let endpoint = format!("elastic.metadata_endpoint=http://127.0.0.1:{}", free_port());
    run_ok(&mut job(
        &dir,
        &[
            "elastic.preemption_notice=aws",
            &endpoint,
            "elastic.metadata_poll_s=0.1",
        ],
    ));
    assert_final_state(&dir, STEPS, reference());
    let events = run_events(&dir);
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, RunEvent::NodeLeft(_) | RunEvent::Recovered(_))),
        "{events:?}"
    );
    let logs = agent_logs(&dir);
    assert_eq!(logs.len(), 4, "{logs:?}");
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap();
        let warnings = text
            .matches("no preemption notices from the metadata service")
            .count();
        assert_eq!(warnings, 1, "{}:\n{text}", log.display());
    }
}

/// Every node gets a preemption notice (all four agents watch one fake AWS metadata service,
/// which announces after step 3): with no node left to hand over to, the run commits a
/// checkpoint at a step boundary and stops cleanly (exit status 75, the resume hint, a
/// `node_left` event per node and no `node_lost`); `seqpipe resume` then finishes the run
/// bit-identical to an undisturbed one.
#[test]
fn every_node_preempted_stops_at_a_boundary_with_a_checkpoint_and_resumes_bit_exactly() {
    let dir = fresh_dir("all-noticed");
    let fake = FakeMetadata::start("aws");
    let run = dir.join("run");
    let addr = format!("127.0.0.1:{}", free_port());
    let token = "preemption-test-secret";
    let listen = format!("elastic.listen={addr}");
    let mut coordinator = Proc(
        job(
            &run,
            &[
                &listen,
                "elastic.local_agents=false",
                "elastic.join_timeout_s=120",
                // Long enough that the workers never leave before the boundary on a busy machine.
                "elastic.grace_s=120",
            ],
        )
        .env("SEQPIPE_JOB_TOKEN", token)
        .stderr(std::fs::File::create(dir.join("coordinator.log")).unwrap())
        .spawn()
        .unwrap(),
    );
    let log_of = |node: usize| dir.join(format!("agent-node-{node}.log"));
    let mut agents: Vec<Proc> = (0..4)
        .map(|node| {
            let mut cmd = seqpipe();
            cmd.args(["agent", "--join", &addr, "--name", &format!("node-{node}")])
                .args(["--connect-timeout-s", "60", "--dir"])
                .arg(dir.join(format!("node-{node}")))
                .env("SEQPIPE_JOB_TOKEN", token)
                .env("RUST_LOG", "info")
                .stdin(Stdio::null())
                .stderr(std::fs::File::create(log_of(node)).unwrap())
                .args(["--preemption-notice", "aws"])
                .args(["--metadata-endpoint", &fake.url()])
                .args(["--metadata-poll-s", "0.2"]);
            Proc(cmd.spawn().unwrap())
        })
        .collect();
    wait_for_steps(&run, 3);
    fake.announce();
    let limit = Duration::from_secs(300);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = coordinator.0.try_wait().unwrap() {
            break status;
        }
        assert!(started.elapsed() < limit, "the coordinator did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    let log = std::fs::read_to_string(dir.join("coordinator.log")).unwrap();
    assert_eq!(status.code(), Some(75), "exit status:\n{log}");
    assert!(
        log.contains("stopped for preemption after step")
            && log.contains(&format!("continue with: seqpipe resume {}", run.display())),
        "{log}"
    );
    for (node, agent) in agents.iter_mut().enumerate() {
        let started = Instant::now();
        while agent.0.try_wait().unwrap().is_none() {
            assert!(
                started.elapsed() < limit,
                "agent node-{node} did not exit after the run stopped"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    // The run stopped at a boundary before its end, with that boundary's checkpoint committed.
    let (step, _) = final_state(&ckpt_url(&run));
    assert!((3..STEPS).contains(&step), "stopped at step {step}:\n{log}");
    assert_eq!(common::steps_done(&run) as u64, step, "{log}");
    let events = run_events(&run);
    let mut left: Vec<String> = events
        .iter()
        .filter_map(|e| match e {
            RunEvent::NodeLeft(l) => Some(l.node.to_string()),
            _ => None,
        })
        .collect();
    left.sort();
    assert_eq!(left, ["node-0", "node-1", "node-2", "node-3"], "{events:?}");
    assert!(
        !events.iter().any(|e| matches!(e, RunEvent::NodeLost(_))),
        "{events:?}"
    );

    // The run continues on local agents, bit-identical to an undisturbed one.
    run_ok(
        seqpipe()
            .args(["resume", "-q"])
            .arg(&run)
            .args(["--set", "elastic.local_agents=true"])
            .args(["--set", "elastic.listen=127.0.0.1:0"]),
    );
    assert_final_state(&run, STEPS, reference());
}
