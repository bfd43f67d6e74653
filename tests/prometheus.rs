//! A real Prometheus (Debian's `prometheus`, 2.42 when written) scrapes the coordinator's
//! `/metrics` every second through a run that loses a worker and then a whole node; the test asks
//! Prometheus's HTTP API what it stored: the target is up with no scrape error, and the recoveries
//! by tier, nodes lost, last checkpoint step, step counter and goodput ratio agree with
//! `metrics.jsonl`. The values queried are printed.
//!
//! Prometheus is `$SEQPIPE_PROMETHEUS`, else `prometheus` on PATH (scripts/test.sh installs it);
//! a missing one fails the test.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::disturbed::run_disturbed;
use common::{checkpoint_steps, free_port, fresh_dir, records};
use serde_json::Value;
use trainer::runtime::events::{Recovered, RunEvent};
use trainer::runtime::goodput::Goodput;
use trainer::runtime::recovery::Tier;

/// Long enough (about 10 s on a busy 2-core machine) for a 1 s scrape interval to see the run
/// before, between and after its losses there; a fast machine may finish it between two scrapes,
/// so the test waits for scrapes of the lingering endpoint rather than counting on the run's
/// length.
const STEPS: u64 = 150;

/// The Prometheus binary (see the module docs).
fn prometheus_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("SEQPIPE_PROMETHEUS") {
        return PathBuf::from(path);
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("prometheus"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "no prometheus: install the Debian package `prometheus` (scripts/test.sh does) or \
                 set SEQPIPE_PROMETHEUS=/path/to/prometheus"
            )
        })
}

/// A Prometheus server started by the test; killed when dropped.
struct Prometheus {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts Prometheus in `dir` scraping `target` every second, and waits until it is ready.
    fn start(dir: &Path, target: u16) -> Prometheus {
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: seqpipe\n    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
            ),
        )
        .unwrap();
        for _ in 0..5 {
            let port = free_port();
            let log = dir.join(format!("prometheus-{port}.log"));
            let child = Command::new(prometheus_binary())
                .arg(format!("--config.file={}", config.display()))
                .arg(format!(
                    "--storage.tsdb.path={}",
                    dir.join(format!("tsdb-{port}")).display()
                ))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .expect("starting prometheus");
            let mut p = Prometheus { child, port, log };
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(60) {
                if p.child.try_wait().unwrap().is_some() {
                    break;
                }
                if http_get(port, "/-/ready").is_some_and(|(code, _)| code == 200) {
                    return p;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let log = std::fs::read_to_string(&p.log).unwrap_or_default();
            assert!(
                log.contains("address already in use"),
                "prometheus did not become ready:\n{log}"
            );
            drop(p);
        }
        panic!("five free ports were all taken before prometheus could bind them")
    }

    /// `GET /api/v1/...`: the `data` of a successful answer.
    fn api(&self, path_and_query: &str) -> Value {
        let (code, body) = http_get(self.port, path_and_query)
            .unwrap_or_else(|| panic!("prometheus did not answer {path_and_query}"));
        let v: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path_and_query}: {e}: {body}"));
        assert!(
            code == 200 && v["status"] == "success",
            "{path_and_query}: {code} {body}"
        );
        v["data"].clone()
    }

    /// An instant query: each series' labels and value.
    fn query(&self, promql: &str) -> Vec<(Value, f64)> {
        let data = self.api(&format!("/api/v1/query?query={}", encode(promql)));
        data["result"]
            .as_array()
            .unwrap_or_else(|| panic!("{promql}: {data}"))
            .iter()
            .map(|s| {
                let v = s["value"][1].as_str().unwrap().parse().unwrap();
                (s["metric"].clone(), v)
            })
            .collect()
    }

    /// An instant query with exactly one series.
    fn one(&self, promql: &str) -> f64 {
        let r = self.query(promql);
        assert_eq!(r.len(), 1, "{promql}: {r:?}");
        r[0].1
    }
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A plain HTTP/1.1 GET on 127.0.0.1:`port`: status code and body; `None` when nothing answers.
fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).ok()?;
    let answer = String::from_utf8_lossy(&answer).to_string();
    let (head, body) = answer.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    // Prometheus answers small API results in one piece, larger ones chunked.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)?
    } else {
        body.to_string()
    };
    Some((code, body))
}

fn dechunk(mut body: &str) -> Option<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = body.split_once("\r\n")?;
        let size = usize::from_str_radix(size.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(rest.get(..size)?);
        body = rest.get(size + 2..)?;
    }
}

#[test]
fn prometheus_stores_what_metrics_jsonl_records_through_a_worker_and_a_node_loss() {
    let dir = fresh_dir("prometheus");
    let prom_dir = dir.join("prometheus");
    std::fs::create_dir_all(&prom_dir).unwrap();
    let mut prometheus = None;
    let run = run_disturbed(&dir, STEPS, |port| {
        prometheus = Some(Prometheus::start(&prom_dir, port));
    });
    let prom = prometheus.expect("started");

    // Wait until Prometheus has stored a scrape of the final state and at least 3 scrapes in all.
    // The endpoint lingers, so both come however fast the run was: a fast machine may finish
    // the run between two scrapes (CI's did, in under 2 s), a busy one is scraped all through it.
    let started = Instant::now();
    loop {
        let done = |q: &str| prom.query(q).first().map(|s| s.1) == Some(STEPS as f64);
        let scrapes = prom
            .query("count_over_time(up{job=\"seqpipe\"}[1h])")
            .first()
            .map_or(0.0, |s| s.1);
        if done("seqpipe_step") && done("seqpipe_last_checkpoint_step") && scrapes >= 3.0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "prometheus stored no scrape of step {STEPS}, or fewer than 3 scrapes ({scrapes}); \
             its log:\n{}",
            std::fs::read_to_string(&prom.log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(500));
    }

    // The target: up, every scrape of the run succeeded, no error on the last.
    let targets = prom.api("/api/v1/targets?state=active");
    let active = targets["activeTargets"].as_array().unwrap();
    assert_eq!(active.len(), 1, "{targets}");
    println!(
        "target {}: health {}, last error {:?}, last scrape took {} s",
        active[0]["scrapeUrl"],
        active[0]["health"],
        active[0]["lastError"],
        active[0]["lastScrapeDuration"]
    );
    assert_eq!(active[0]["health"], "up", "{targets}");
    assert_eq!(active[0]["lastError"], "", "{targets}");
    let up = prom.one("up{job=\"seqpipe\"}");
    let up_min = prom.one("min_over_time(up{job=\"seqpipe\"}[1h])");
    let scrapes = prom.one("count_over_time(up{job=\"seqpipe\"}[1h])");
    // How many scrapes saw the run before its last step: a matter of the machine's speed,
    // printed, not asserted (every scrape, during the run or after, must have succeeded).
    let during = prom
        .query(&format!("count_over_time((seqpipe_step < {STEPS})[1h:1s])"))
        .first()
        .map_or(0.0, |s| s.1);
    println!(
        "up {up}, lowest up over the run {up_min}, {scrapes} scrapes ({during} seconds sampled \
         before step {STEPS})"
    );
    assert_eq!((up, up_min), (1.0, 1.0), "a scrape failed");
    assert!(scrapes >= 3.0, "{scrapes} scrapes");

    // What Prometheus stored against what the run wrote.
    let records = records(&run.run);
    let events: Vec<&RunEvent> = records.iter().filter_map(|r| r.as_event()).collect();
    let last_step = records.iter().rev().find_map(|r| r.as_step()).unwrap().step;
    let step = prom.one("seqpipe_step");
    let max_step = prom.one("max_over_time(seqpipe_step[1h])");
    println!(
        "seqpipe_step {step} (highest stored {max_step}); metrics.jsonl's last step {last_step}"
    );
    assert_eq!((step, max_step), (last_step as f64, STEPS as f64));

    let stored: Vec<(String, f64)> = prom
        .query("seqpipe_recoveries_total")
        .into_iter()
        .map(|(labels, v)| (labels["tier"].as_str().unwrap().to_string(), v))
        .collect();
    println!("seqpipe_recoveries_total by tier: {stored:?}");
    assert_eq!(stored.len(), Tier::ALL.len(), "{stored:?}");
    let mut recovered = 0.0;
    for (tier, v) in &stored {
        let in_file = events
            .iter()
            .filter(|e| matches!(e, RunEvent::Recovered(Recovered { tier: t, .. }) if t.as_str() == tier))
            .count() as f64;
        assert_eq!(*v, in_file, "tier {tier}: {events:?}");
        recovered += v;
    }
    assert!(recovered >= 2.0, "both losses recovered: {stored:?}");

    let lost = prom.one("seqpipe_nodes_lost_total");
    let lost_in_file = events
        .iter()
        .filter(|e| matches!(e, RunEvent::NodeLost(_)))
        .count() as f64;
    println!("seqpipe_nodes_lost_total {lost}; node_lost events {lost_in_file}");
    assert_eq!(lost, lost_in_file);
    assert!(lost >= 2.0, "a worker and a node were lost: {events:?}");

    let checkpoint = prom.one("seqpipe_last_checkpoint_step");
    let checkpoint_in_file = *checkpoint_steps(&events)
        .last()
        .expect("a committed checkpoint");
    println!(
        "seqpipe_last_checkpoint_step {checkpoint}; newest checkpoint event {checkpoint_in_file}"
    );
    assert_eq!(checkpoint, checkpoint_in_file as f64);

    let ratio = prom.one("seqpipe_goodput_ratio");
    let offline = Goodput::of_records(&records).figures();
    let lost_by_cause = prom.query("seqpipe_goodput_lost_seconds");
    println!(
        "seqpipe_goodput_ratio {ratio:.4}; offline account of metrics.jsonl {:.4} ({:.3} s of {:.3} s); lost by cause {:?}",
        offline.ettr,
        offline.productive_s,
        offline.wall_s,
        lost_by_cause
            .iter()
            .map(|(l, v)| format!("{} {v:.3}", l["cause"].as_str().unwrap_or("?")))
            .collect::<Vec<_>>()
    );
    assert!(
        (ratio - offline.ettr).abs() <= 0.02 * offline.ettr,
        "{ratio} vs {offline:?}"
    );
    assert_eq!(lost_by_cause.len(), 4, "{lost_by_cause:?}");

    drop(prom);
    run.stop();
}
