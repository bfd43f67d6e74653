//! Network partition: three node agents run in their own network namespaces (`ip netns`), each
//! joined to a bridge in the root namespace by a veth pair, and a coordinator (`seqpipe train` with
//! `elastic.local_agents=false`) listens on the bridge. Mid-run the middle node's link is cut: the
//! node goes silent without dying, so the coordinator must declare it dead on missed heartbeats,
//! fence it and carry on with the two others. When the link comes back, the messages the cut-off
//! agent queued meanwhile reach the coordinator and are refused. The run must still end
//! bit-identical to an uninterrupted one.
//!
//! Needs root (network namespaces, veth pairs, a bridge) and iproute2 (`ip`): CI runs as root
//! and installs it; elsewhere run `sudo -E cargo test --release --test partition`. The test
//! fails (never skips) without them.

mod common;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{ckpt_url, effective_uid, elastic_job_sets, final_state, fresh_dir, seqpipe};
use trainer::runtime::events::{self, Record, RunEvent};

/// Long enough that, after the cut and the recovery, the run goes on for several seconds: the
/// cut-off agent's queued messages arrive (TCP retransmits them with back-off once the link is
/// back) while the coordinator still listens.
const STEPS: u64 = 60;
const JOB_TOKEN: &str = "partition-test-secret";
const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];
/// The node whose link is cut: the middle of the pipeline, so both neighbours lose it.
const CUT: usize = 1;

/// The job's `--set` values, shared by the reference run and the partitioned one.
fn job_sets(run_dir: &Path) -> Vec<String> {
    let mut sets = elastic_job_sets(run_dir, STEPS);
    sets.extend(["pipeline.stages=3", "pipeline.timeout_s=2"].map(String::from));
    sets
}

fn job(run_dir: &Path, extra: &[String]) -> Command {
    let mut cmd = seqpipe();
    cmd.args(["train", "-q"]);
    for s in job_sets(run_dir).iter().chain(extra) {
        cmd.args(["--set", s]);
    }
    cmd
}

/// Panics unless the test runs as root with iproute2 installed.
fn require_root_and_iproute2() {
    let euid = effective_uid();
    assert!(
        euid == "0",
        "tests/partition.rs needs root (it creates network namespaces, veth pairs and a bridge) \
         and iproute2; run it as root, e.g. `sudo -E cargo test --release --test partition` \
         (effective uid is {euid})"
    );
    let ip = Command::new("ip").arg("-V").output();
    assert!(
        ip.as_ref().is_ok_and(|o| o.status.success()),
        "tests/partition.rs needs iproute2 (the `ip` command): apt-get install -y iproute2 ({ip:?})"
    );
}

/// Runs `ip ARGS`, panicking with its stderr if it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "`ip {}` failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `ip ARGS`, ignoring failures (cleanup).
fn ip_quiet(args: &[&str]) {
    let _ = Command::new("ip")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// One node's network namespace.
struct Namespace {
    name: String,
    /// The veth end on the bridge, in the root namespace: down = the node is cut off.
    host_veth: String,
    ip: String,
}

/// A bridge in the root namespace (the coordinator's side) and one namespace per node, each with
/// a veth pair to the bridge. Everything is deleted on drop, also when the test panics.
struct Network {
    bridge: String,
    bridge_ip: String,
    namespaces: Vec<Namespace>,
}

impl Network {
    fn create() -> Self {
        let pid = std::process::id();
        // Unique per test process; interface names have at most 15 characters.
        let tag = pid % 10_000;
        let subnet = format!("10.231.{}", 20 + pid % 200);
        let net = Network {
            bridge: format!("sqb{tag}"),
            bridge_ip: format!("{subnet}.1"),
            namespaces: NODES
                .iter()
                .enumerate()
                .map(|(i, node)| Namespace {
                    name: format!("seqpipe-{pid}-{node}"),
                    host_veth: format!("sqh{tag}{}", (b'a' + i as u8) as char),
                    ip: format!("{subnet}.{}", i + 2),
                })
                .collect(),
        };
        // Leftovers of an earlier process with the same pid that could not clean up.
        net.delete();
        ip(&["link", "add", &net.bridge, "type", "bridge"]);
        ip(&[
            "addr",
            "add",
            &format!("{}/24", net.bridge_ip),
            "dev",
            &net.bridge,
        ]);
        ip(&["link", "set", &net.bridge, "up"]);
        for (i, ns) in net.namespaces.iter().enumerate() {
            let inner = format!("sqn{tag}{}", (b'a' + i as u8) as char);
            ip(&["netns", "add", &ns.name]);
            ip(&[
                "link",
                "add",
                &ns.host_veth,
                "type",
                "veth",
                "peer",
                "name",
                &inner,
            ]);
            ip(&["link", "set", &inner, "netns", &ns.name]);
            let in_ns = |args: &[&str]| {
                let mut all = vec!["-n", ns.name.as_str()];
                all.extend_from_slice(args);
                ip(&all);
            };
            in_ns(&["addr", "add", &format!("{}/24", ns.ip), "dev", &inner]);
            in_ns(&["link", "set", &inner, "up"]);
            in_ns(&["link", "set", "lo", "up"]);
            ip(&["link", "set", &ns.host_veth, "master", &net.bridge]);
            ip(&["link", "set", &ns.host_veth, "up"]);
        }
        net
    }

    /// Cuts (`false`) or restores (`true`) the link of namespace `i`.
    fn set_link(&self, i: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["link", "set", &self.namespaces[i].host_veth, state]);
    }

    /// Checks, before relying on it, that every namespace reaches the coordinator's address and
    /// its pipeline neighbour; panics with the details otherwise.
    fn check_connectivity(&self) {
        let listener = std::net::TcpListener::bind((self.bridge_ip.as_str(), 0))
            .expect("binding a probe port on the bridge");
        let port = listener.local_addr().unwrap().port();
        let probe = |ns: &Namespace, addr: &str, port: u16| {
            Command::new("ip")
                .args(["netns", "exec", &ns.name, "timeout", "5", "bash", "-c"])
                .arg(format!("exec 3<>/dev/tcp/{addr}/{port}"))
                .output()
                .expect("running a probe in a namespace")
        };
        for ns in &self.namespaces {
            let out = probe(ns, &self.bridge_ip, port);
            assert!(
                out.status.success(),
                "namespace {} ({}) cannot reach the bridge at {}:{port}: {}",
                ns.name,
                ns.ip,
                self.bridge_ip,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // Between namespaces (the workers' data links): a closed port answers "refused", which
        // proves the path; "No route to host" or a timeout means the bridge drops the traffic
        // (e.g. br_netfilter with an iptables FORWARD policy of DROP).
        for pair in self.namespaces.windows(2) {
            let out = probe(&pair[0], &pair[1].ip, 9);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success() || stderr.contains("refused"),
                "namespace {} cannot reach {} across the bridge ({}): {stderr} \
                 (is bridged traffic filtered? see /proc/sys/net/bridge/bridge-nf-call-iptables)",
                pair[0].name,
                pair[1].ip,
                out.status
            );
        }
    }

    fn delete(&self) {
        for ns in &self.namespaces {
            // No process may outlive its namespace's test.
            if let Ok(out) = Command::new("ip")
                .args(["netns", "pids", &ns.name])
                .output()
            {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            ip_quiet(&["netns", "del", &ns.name]);
            ip_quiet(&["link", "del", &ns.host_veth]);
        }
        ip_quiet(&["link", "del", &self.bridge]);
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        self.delete();
    }
}

/// Child processes (coordinator, agents), killed on drop.
#[derive(Default)]
struct Processes(Vec<(String, Child)>);

impl Processes {
    fn add(&mut self, name: &str, child: Child) -> usize {
        self.0.push((name.to_string(), child));
        self.0.len() - 1
    }
}

impl Drop for Processes {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A log file's text without ANSI colour codes.
fn log_text(path: &Path) -> String {
    let raw = std::fs::read_to_string(path).unwrap_or_default();
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters final-byte.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The records of `metrics.jsonl` so far; lines being rewritten are skipped.
fn records(run_dir: &Path) -> Vec<Record> {
    events::parse_records(
        &std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default(),
    )
}

/// The events of `metrics.jsonl` so far.
fn run_events(run_dir: &Path) -> Vec<RunEvent> {
    events::events(&records(run_dir)).cloned().collect()
}

/// What the test saw, for failure messages: the coordinator's and agents' logs, the events.
struct Logs {
    coordinator: PathBuf,
    agents: Vec<PathBuf>,
    run: PathBuf,
}

impl Logs {
    fn dump(&self) -> String {
        let tail = |p: &Path| {
            let text = log_text(p);
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(40)..].join("\n")
        };
        let mut s = format!(
            "coordinator log ({}):\n{}\n",
            self.coordinator.display(),
            tail(&self.coordinator)
        );
        for (node, log) in NODES.iter().zip(&self.agents) {
            s += &format!("agent {node} log ({}):\n{}\n", log.display(), tail(log));
        }
        s += &format!("events: {:#?}", run_events(&self.run));
        s
    }
}

/// Waits (at most `limit`) until `done` holds, failing early if the coordinator exits.
fn wait_until(
    what: &str,
    limit: Duration,
    coordinator: &mut Child,
    logs: &Logs,
    mut done: impl FnMut() -> bool,
) {
    let started = Instant::now();
    while !done() {
        if let Ok(Some(status)) = coordinator.try_wait() {
            panic!(
                "the coordinator exited ({status}) while waiting for {what}\n{}",
                logs.dump()
            );
        }
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}\n{}",
            logs.dump()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The scenario: cut the middle node's link mid-run; it is declared dead on missed
/// heartbeats and fenced, the two others go on as a 2-stage pipeline, and once the link is back
/// the stale agent's messages are refused. The run ends bit-identical to an uninterrupted one.
#[test]
fn partitioned_node_is_fenced_and_its_stale_messages_are_refused() {
    require_root_and_iproute2();
    let started = Instant::now();
    let dir = fresh_dir("partition");

    // The reference: the same job, uninterrupted, with local agents.
    let reference_dir = dir.join("reference");
    common::run_ok(&mut job(&reference_dir, &[]));
    let (_, reference) = final_state(&ckpt_url(&reference_dir));

    let net = Network::create();
    net.check_connectivity();
    let mut procs = Processes::default();

    // The coordinator, in the root namespace, listening on the bridge.
    let port = std::net::TcpListener::bind((net.bridge_ip.as_str(), 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("{}:{port}", net.bridge_ip);
    let run = dir.join("run");
    let logs = Logs {
        coordinator: dir.join("coordinator.log"),
        agents: NODES
            .iter()
            .map(|n| dir.join(format!("agent-{n}.log")))
            .collect(),
        run: run.clone(),
    };
    let elastic: Vec<String> = [
        "elastic.local_agents=false".to_string(),
        format!("elastic.listen={addr}"),
        "elastic.min_nodes=2".into(),
        "elastic.heartbeat_s=0.3".into(),
        "elastic.dead_after_s=1.5".into(),
        "elastic.join_timeout_s=30".into(),
    ]
    .into();
    let coordinator = job(&run, &elastic)
        .env("SEQPIPE_JOB_TOKEN", JOB_TOKEN)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(File::create(&logs.coordinator).unwrap())
        .spawn()
        .expect("starting the coordinator");
    let coordinator = procs.add("coordinator", coordinator);

    // One agent per namespace.
    for (i, (node, ns)) in NODES.iter().zip(&net.namespaces).enumerate() {
        let agent = Command::new("ip")
            .args(["netns", "exec", &ns.name, env!("CARGO_BIN_EXE_seqpipe")])
            .args(["agent", "--join", &addr, "--name", node])
            .args(["--connect-timeout-s", "20", "--dir"])
            .arg(dir.join(node))
            .env("RAYON_NUM_THREADS", "1")
            .env("CANDLE_NUM_THREADS", "1")
            .env("RUST_LOG", "info")
            .env("SEQPIPE_JOB_TOKEN", JOB_TOKEN)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&logs.agents[i]).unwrap())
            .spawn()
            .expect("starting an agent in its namespace");
        procs.add(node, agent);
    }

    // A few steps on all three nodes, then cut the middle one off.
    let steps_done = |run: &Path| events::steps(&records(run)).count();
    wait_until(
        "the first 4 steps",
        Duration::from_secs(30),
        &mut procs.0[coordinator].1,
        &logs,
        || steps_done(&run) >= 4,
    );
    // Each namespace runs one stage, in node order: the cut node runs the middle stage.
    for (stage, node) in NODES.iter().enumerate() {
        let log = dir.join(node).join(format!("logs/stage-{stage}.log"));
        assert!(
            log.exists(),
            "{node} should run stage {stage} (no {})\n{}",
            log.display(),
            logs.dump()
        );
    }
    let cut_at = Instant::now();
    net.set_link(CUT, false);
    let cut = NODES[CUT];

    // Declared dead on missed heartbeats, fenced, and the survivors carry on.
    wait_until(
        "node_lost and recovered events after the cut",
        Duration::from_secs(30),
        &mut procs.0[coordinator].1,
        &logs,
        || {
            let ev = run_events(&run);
            ev.iter()
                .any(|e| matches!(e, RunEvent::NodeLost(l) if l.node.as_str() == cut))
                && ev.iter().any(|e| matches!(e, RunEvent::Recovered(_)))
        },
    );
    let recovered_after = cut_at.elapsed();
    net.set_link(CUT, true);
    let healed_at = Instant::now();

    // The stale agent's queued messages reach the coordinator, which refuses them.
    let refused = "refused a message from a fenced agent";
    wait_until(
        "the coordinator to refuse the fenced agent's stale messages",
        Duration::from_secs(30),
        &mut procs.0[coordinator].1,
        &logs,
        || log_text(&logs.coordinator).contains(refused),
    );
    let refused_after = healed_at.elapsed();

    // The run finishes.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = procs.0[coordinator].1.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the run did not finish\n{}",
            logs.dump()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        status.success(),
        "the partitioned run failed ({status})\n{}",
        logs.dump()
    );

    // Bit-identical to the uninterrupted run.
    let (step, state) = final_state(&ckpt_url(&run));
    assert_eq!(step, STEPS, "{}", logs.dump());
    assert_eq!(state.len(), reference.len());
    let differing: Vec<&String> = reference
        .iter()
        .filter(|(name, bytes)| state.get(*name) != Some(*bytes))
        .map(|(name, _)| name)
        .collect();
    assert!(
        differing.is_empty(),
        "tensors differ from the uninterrupted run: {differing:?}"
    );

    // The cut node was lost for missing heartbeats (or, if a neighbour's timeout came first, for
    // being silent), and the next plan runs on the two others.
    let ev = run_events(&run);
    let (lost_at, lost) = ev
        .iter()
        .enumerate()
        .find_map(|(i, e)| match e {
            RunEvent::NodeLost(l) => Some((i, l)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no node_lost event\n{}", logs.dump()));
    assert_eq!(lost.node.as_str(), cut, "{lost:?}");
    let reason = &lost.reason;
    assert!(
        reason.contains("missed heartbeats")
            || reason.contains("no message")
            || reason.contains("timed out"),
        "the cut node should be lost for silence: {lost:?}"
    );
    let plan = ev[lost_at..]
        .iter()
        .find_map(|e| match e {
            RunEvent::Plan(p) => Some(p),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no plan after node_lost: {ev:#?}"));
    let plan_nodes: Vec<&str> = plan.nodes.iter().map(|n| n.as_str()).collect();
    assert_eq!(plan_nodes, ["node-a", "node-c"], "{plan:?}");
    assert_eq!(plan.stages, 2, "{plan:?}");
    assert!(plan.generation >= 2, "{plan:?}");
    let recovered = ev[lost_at..]
        .iter()
        .find_map(|e| match e {
            RunEvent::Recovered(r) => Some(r),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no recovered event after node_lost: {ev:#?}"));
    assert_eq!(
        (recovered.stages_before, recovered.stages_after),
        (3, 2),
        "{recovered:?}"
    );

    // The coordinator declared it dead (fenced it) and refused what its old connection sent.
    let coordinator_log = log_text(&logs.coordinator);
    assert!(
        coordinator_log
            .lines()
            .any(|l| l.contains("node declared dead") && l.contains(&format!("node={cut}"))),
        "the coordinator should declare {cut} dead:\n{coordinator_log}"
    );
    // What the stale connection delivered after the heal: `msg=Heartbeat`, `msg=WorkerExited {..}`.
    let stale: Vec<&str> = coordinator_log
        .lines()
        .filter_map(|l| l.split_once(refused))
        .filter_map(|(_, rest)| rest.split_once("msg=").map(|(_, m)| m))
        .map(|m| m.split(|c: char| !c.is_alphanumeric()).next().unwrap_or(m))
        .collect();
    assert!(!stale.is_empty(), "{coordinator_log}");
    // The fenced node's agent heard the refusal once the link was back.
    let agent_log = log_text(&logs.agents[CUT]);
    assert!(
        agent_log.contains("the coordinator fenced this node"),
        "{cut}'s agent should hear that it was fenced:\n{agent_log}"
    );
    // The survivors were never fenced.
    for i in (0..NODES.len()).filter(|&i| i != CUT) {
        let log = log_text(&logs.agents[i]);
        assert!(!log.contains("fenced"), "{} was fenced:\n{log}", NODES[i]);
    }

    // Whether the healed node came back (a later plan may admit it again): reported, not required.
    let rejoined = ev
        .iter()
        .filter(|e| matches!(e, RunEvent::NodeJoined(_) | RunEvent::Plan(_)))
        .map(|e| serde_json::to_string(e).unwrap())
        .collect::<Vec<_>>();
    let counts: BTreeMap<&str, usize> = ev.iter().fold(BTreeMap::new(), |mut m, e| {
        *m.entry(e.kind()).or_default() += 1;
        m
    });
    eprintln!(
        "partition: recovered {recovered_after:.1?} after the cut; {} stale message(s) refused \
         {refused_after:.1?} after the link came back: {stale:?}\nlost: {lost:?}\nrecovered: \
         {recovered:?}\nplans and joins: {rejoined:?}\nevent counts {counts:?}; test took {:.1?}",
        stale.len(),
        started.elapsed()
    );
    drop(procs);
    drop(net);
}
