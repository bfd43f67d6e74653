//! `seqpipe bench goodput`: what random failures cost a whole job. The same job runs twice in one
//! invocation — undisturbed, then under SIGKILLs of random workers and whole nodes arriving as a
//! seeded Poisson process, with a replacement node joining after each lost one — and the command
//! prints the effective training time ratio (ETTR = undisturbed wall time / disturbed wall time),
//! the recoveries by tier from the disturbed run's events, and whether both runs ended with
//! bit-identical final checkpoints. It also prints the disturbed run's own goodput account
//! ([`trainer::runtime::goodput`]: productive step time over wall time, and the seconds lost by
//! cause), the figures the coordinator exports live as `seqpipe_goodput_*`.
//!
//! The decisions are pure and unit-tested: [`FailureSchedule`] (when, and what kind of thing, to
//! kill), [`choose_target`] (which processes, from the live process tree) and [`summarize`] (the
//! recoveries in metrics lines). [`run`] is the shell: it starts the processes, sleeps, kills and
//! reads the checkpoints.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Args;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::step::median;
use super::{children_of, final_state, free_port, is_alive, sigkill};
use trainer::config::Config;
use trainer::runtime::events::{Record, Recovered, RunEvent, parse_records, steps};
use trainer::runtime::goodput::Goodput;

/// Flags of `seqpipe bench goodput`.
#[derive(Args, Debug)]
pub struct GoodputArgs {
    /// TOML config file of the job (default: the embedded configs/tiny.toml).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override one config key of the job, e.g. `--set model.layers=8` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Mean failures per training step (the Poisson rate, in units of the undisturbed run's mean
    /// step time): 0.05 = one failure per 20 steps.
    #[arg(long)]
    pub failures_per_step: f64,
    /// Seed of the failure arrivals and of the choice of victims.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Seconds after a whole node is killed until a replacement node joins.
    #[arg(long, default_value_t = 2.0)]
    pub rejoin_after_s: f64,
    /// Training steps of both runs (default: the config's train.steps).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Directory for both runs (default: a fresh one under the temp dir, deleted after a success).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Rounds, alternating an undisturbed and a disturbed run (round i uses seed + i): single
    /// runs of the default job vary by about ±10% on a busy 2-core machine, so the ETTR reported
    /// last is over all rounds (their undisturbed wall times summed over their disturbed ones),
    /// with every round printed.
    #[arg(long, default_value_t = 1)]
    pub rounds: u64,
    /// Give up on the disturbed run after this many seconds (default: 120 + 20 x the undisturbed
    /// wall time); failures that arrive faster than the job recovers can keep it from finishing.
    #[arg(long)]
    pub give_up_after_s: Option<f64>,
}

/// What one failure kills.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Victim {
    /// One stage worker; its node's agent lives on and starts a new one.
    Worker,
    /// A whole node: its agent and its workers.
    Node,
}

/// One failure of the schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Failure {
    /// Time since the schedule's start (the disturbed run's first completed step).
    pub at: Duration,
    /// What the failure is meant to kill.
    pub victim: Victim,
    /// A random number that picks among the live candidates when the failure lands.
    pub pick: u64,
}

/// Seeded Poisson failure arrivals: exponential gaps with mean `mean_gap`, each failure a worker or
/// a whole node with equal probability. An endless iterator; the caller stops when the job ends.
pub struct FailureSchedule {
    rng: ChaCha8Rng,
    mean_gap: Duration,
    now: Duration,
}

impl FailureSchedule {
    pub fn new(seed: u64, mean_gap: Duration) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
            mean_gap,
            now: Duration::ZERO,
        }
    }
}

impl Iterator for FailureSchedule {
    type Item = Failure;

    fn next(&mut self) -> Option<Failure> {
        // Inverse CDF of the exponential distribution; 1 - u is in (0, 1], so the log is finite.
        let u: f64 = self.rng.random();
        let gap = -(1.0 - u).ln() * self.mean_gap.as_secs_f64();
        self.now = self
            .now
            .saturating_add(Duration::from_secs_f64(gap.min(1e9)));
        let victim = if self.rng.random_bool(0.5) {
            Victim::Node
        } else {
            Victim::Worker
        };
        Some(Failure {
            at: self.now,
            victim,
            pick: self.rng.random(),
        })
    }
}

/// A live node of the job: its agent's pid and its workers' pids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub agent: u32,
    pub workers: Vec<u32>,
}

/// The processes one failure kills.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// What is killed (a node failure becomes a worker failure when only one node is left, so the
    /// job can still finish).
    pub victim: Victim,
    /// Pids to SIGKILL (a node's workers before its agent).
    pub pids: Vec<u32>,
}

/// The processes `failure` kills among the live `nodes`, or `None` when nothing can be killed
/// (no node, or no worker running at the moment).
pub fn choose_target(nodes: &[Node], failure: &Failure) -> Option<Target> {
    if failure.victim == Victim::Node && nodes.len() >= 2 {
        let node = &nodes[(failure.pick % nodes.len() as u64) as usize];
        let mut pids = node.workers.clone();
        pids.push(node.agent);
        return Some(Target {
            victim: Victim::Node,
            pids,
        });
    }
    let with_workers: Vec<&Node> = nodes.iter().filter(|n| !n.workers.is_empty()).collect();
    if with_workers.is_empty() {
        return None;
    }
    let n = with_workers.len() as u64;
    let node = with_workers[(failure.pick % n) as usize];
    let worker = node.workers[((failure.pick / n) % node.workers.len() as u64) as usize];
    Some(Target {
        victim: Victim::Worker,
        pids: vec![worker],
    })
}

/// The recoveries a run's metrics lines record.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct RecoverySummary {
    /// Completed training steps (records with a loss, steps redone after a recovery included).
    pub step_records: u64,
    /// `recovered` events per tier (`peer`, `mid_step`, `checkpoint`, ...).
    pub recoveries: BTreeMap<String, u64>,
    /// Completed steps redone, summed over the recoveries.
    pub lost_steps: u64,
    /// Units replayed by mid-step repairs.
    pub redone_units: u64,
    /// Seconds from the detection of each failure to the end of its recovery, summed.
    pub recovery_s: f64,
    /// `node_lost` events.
    pub nodes_lost: u64,
    /// `node_joined` events.
    pub nodes_joined: u64,
}

/// Sums the `recovered`, `node_lost` and `node_joined` events of metrics lines (JSON objects; lines
/// that are not are skipped).
pub fn summarize(lines: &str) -> RecoverySummary {
    let mut s = RecoverySummary::default();
    for record in parse_records(lines) {
        match record {
            Record::Step(_) => s.step_records += 1,
            Record::Event(RunEvent::Recovered(Recovered {
                tier,
                lost_steps,
                redone_units,
                recovery_s,
                ..
            })) => {
                *s.recoveries.entry(tier.to_string()).or_default() += 1;
                s.lost_steps += lost_steps;
                s.redone_units += redone_units.unwrap_or(0) as u64;
                s.recovery_s += recovery_s;
            }
            Record::Event(RunEvent::NodeLost(_)) => s.nodes_lost += 1,
            Record::Event(RunEvent::NodeJoined(_)) => s.nodes_joined += 1,
            _ => {}
        }
    }
    s
}

/// Effective training time ratio: the undisturbed wall time over the disturbed one.
pub fn ettr(undisturbed_s: f64, disturbed_s: f64) -> f64 {
    undisturbed_s / disturbed_s
}

/// The median `step_time_s` of a run's clean steps: not its first step, not a step that a
/// `recovered` event names or follows (those carry a recovery, or a rebuilt pipeline's first
/// allocations), and run on as many stages as the first step (a pipeline shrunk by a loss may be
/// slower: that is the failure's cost, not the machine's speed). How fast the machine ran the
/// job's ordinary steps during that run.
pub fn clean_median_step_s(lines: &str) -> Option<f64> {
    let records = parse_records(lines);
    let touched: std::collections::BTreeSet<u64> = records
        .iter()
        .filter_map(|r| match r {
            Record::Event(RunEvent::Recovered(r)) => Some([r.step, r.step + 1]),
            _ => None,
        })
        .flatten()
        .collect();
    let first = steps(&records).min_by_key(|s| s.step)?;
    let (first, stages) = (first.step, first.peak_activation_bytes.len());
    let times: Vec<f64> = steps(&records)
        .filter(|s| s.step != first && !touched.contains(&s.step))
        .filter(|s| s.peak_activation_bytes.len() == stages)
        .map(|s| s.step_time_s)
        .collect();
    (!times.is_empty()).then(|| median(&times))
}

/// ETTR with the machine's speed drift taken out: the undisturbed wall time rescaled by how fast
/// the disturbed run's clean steps ran compared with the undisturbed run's
/// ([`clean_median_step_s`] of each), over the disturbed wall time. On a shared machine whose
/// speed wanders by ±20% between runs a minute apart, this separates what the failures cost from
/// what the machine did.
pub fn speed_corrected_ettr(
    undisturbed_s: f64,
    disturbed_s: f64,
    undisturbed_step_s: f64,
    disturbed_step_s: f64,
) -> f64 {
    undisturbed_s * (disturbed_step_s / undisturbed_step_s) / disturbed_s
}

/// The mean of the `step_time_s` of a run's step records (the undisturbed seconds per step).
fn mean_step_s(lines: &str) -> Option<f64> {
    let records = parse_records(lines);
    let times: Vec<f64> = steps(&records).map(|s| s.step_time_s).collect();
    (!times.is_empty()).then(|| times.iter().sum::<f64>() / times.len() as f64)
}

/// The goodput line printed last: everything measured, as one JSON object.
#[derive(Debug, Serialize)]
struct Report {
    /// The round (0-based); `None` in the summary over all rounds.
    #[serde(skip_serializing_if = "Option::is_none")]
    round: Option<u64>,
    /// How many disturbed runs the numbers below cover (1 for a round).
    runs: u64,
    steps: u64,
    failures_per_step: f64,
    seed: u64,
    rejoin_after_s: f64,
    undisturbed_step_s: f64,
    mean_failure_gap_s: f64,
    undisturbed_s: f64,
    disturbed_s: f64,
    ettr: f64,
    /// Median seconds of the clean steps of each run ([`clean_median_step_s`]).
    undisturbed_clean_step_s: f64,
    disturbed_clean_step_s: f64,
    /// [`speed_corrected_ettr`]; over all rounds, the rescaled undisturbed times summed over the
    /// disturbed ones.
    ettr_speed_corrected: f64,
    /// The disturbed run's goodput account from its `metrics.jsonl` (the live
    /// `seqpipe_goodput_ratio`'s final value): productive step time over wall time since its first
    /// step started; over all rounds, the productive times summed over the wall times.
    goodput_ratio: f64,
    goodput_wall_s: f64,
    goodput_productive_s: f64,
    /// Seconds lost by cause, from the same account.
    goodput_lost_s: BTreeMap<&'static str, f64>,
    kills: BTreeMap<&'static str, u64>,
    replacement_nodes_started: u64,
    recoveries: BTreeMap<String, u64>,
    lost_steps: u64,
    redone_units: u64,
    recovery_s: f64,
    nodes_lost: u64,
    nodes_joined: u64,
    disturbed_step_records: u64,
    final_step: u64,
    tensors: usize,
    bit_identical: bool,
}

/// How both runs are started: the same job, each in its own directory and with its own port.
struct Job {
    exe: PathBuf,
    config: Option<PathBuf>,
    sets: Vec<String>,
    /// The configured checkpoint URL (empty = each run directory's `checkpoints`).
    url: String,
    token: String,
}

/// A started run of the job.
struct Launched {
    child: Child,
    run_dir: PathBuf,
    url: String,
    listen: String,
    started: Instant,
}

impl Job {
    fn launch(&self, run_dir: &Path) -> Result<Launched> {
        let _ = std::fs::remove_dir_all(run_dir);
        std::fs::create_dir_all(run_dir)?;
        let url = if self.url.is_empty() {
            std::path::absolute(run_dir.join("checkpoints"))?
                .display()
                .to_string()
        } else {
            let name = run_dir.file_name().unwrap_or_default().to_string_lossy();
            format!(
                "{}/goodput-{}-{name}",
                self.url.trim_end_matches('/'),
                std::process::id()
            )
        };
        let listen = format!("127.0.0.1:{}", free_port()?);
        let mut cmd = Command::new(&self.exe);
        cmd.args(["train", "-q"]);
        if let Some(file) = &self.config {
            cmd.arg("--config").arg(file);
        }
        let ours = [
            format!("run.dir={}", run_dir.display()),
            format!("checkpoint.url={url}"),
            format!("elastic.listen={listen}"),
        ];
        for s in self.sets.iter().chain(&ours) {
            cmd.args(["--set", s]);
        }
        let log = std::fs::File::create(run_dir.join("launcher.log"))?;
        let child = cmd
            .env("SEQPIPE_JOB_TOKEN", &self.token)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting the job")?;
        Ok(Launched {
            child,
            run_dir: run_dir.to_path_buf(),
            url,
            listen,
            started: Instant::now(),
        })
    }
}

impl Launched {
    fn metrics(&self) -> String {
        std::fs::read_to_string(self.run_dir.join("metrics.jsonl")).unwrap_or_default()
    }

    /// Fails with the launcher's log when the run did not succeed.
    fn check(&self, status: std::process::ExitStatus, what: &str) -> Result<()> {
        if !status.success() {
            let log =
                std::fs::read_to_string(self.run_dir.join("launcher.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            bail!(
                "the {what} run failed ({status}); its directory is {}; launcher log (last lines):\n{}",
                self.run_dir.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        Ok(())
    }
}

/// A random job token (so replacement nodes can join and nothing else can).
fn fresh_token() -> String {
    let mut rng = rand::rng();
    (0..16)
        .map(|_| format!("{:02x}", rng.random::<u8>()))
        .collect()
}

/// The live nodes of a local run: the launcher's agents, then the replacement agents we started.
fn live_nodes(launcher: u32, spares: &mut [Child]) -> Vec<Node> {
    let node = |agent: u32| Node {
        agent,
        workers: children_of(agent)
            .into_iter()
            .filter(|&w| is_alive(w))
            .collect(),
    };
    let mut nodes: Vec<Node> = children_of(launcher)
        .into_iter()
        .filter(|&a| is_alive(a))
        .map(node)
        .collect();
    for spare in spares.iter_mut() {
        if matches!(spare.try_wait(), Ok(None)) {
            nodes.push(node(spare.id()));
        }
    }
    nodes
}

/// What the disturbance did to a run.
#[derive(Default)]
struct Disturbance {
    worker_kills: u64,
    node_kills: u64,
    spares_started: u64,
}

/// Runs the launched job to its end while killing what `schedule` says (from its first completed
/// step on) and starting a replacement node `rejoin_after` after each node kill. Returns the wall
/// seconds from launch to exit and what was done.
fn disturb(
    run: &mut Launched,
    job: &Job,
    mut schedule: FailureSchedule,
    rejoin_after: Duration,
    spare_dir: &Path,
    give_up_after: Duration,
) -> Result<(f64, Disturbance)> {
    let mut done = Disturbance::default();
    let mut spares: Vec<Child> = Vec::new();
    let mut joins: Vec<Instant> = Vec::new();
    let mut origin: Option<Instant> = None;
    let mut next = schedule.next().context("an endless schedule")?;
    let launcher = run.child.id();
    let status = loop {
        if let Some(status) = run.child.try_wait()? {
            break status;
        }
        let now = Instant::now();
        if now > run.started + give_up_after {
            // Failures arriving faster than the job recovers can keep it from ever finishing.
            return Err(give_up(run, spares, &done, give_up_after));
        }
        let Some(origin) = origin else {
            if run.metrics().contains("\"loss\"") {
                origin = Some(now);
            }
            std::thread::sleep(Duration::from_millis(5));
            continue;
        };
        while origin + next.at <= now {
            let nodes = live_nodes(launcher, &mut spares);
            if kill(&nodes, &next, &mut done) {
                joins.push(now + rejoin_after);
            }
            next = schedule.next().context("an endless schedule")?;
        }
        let (due, later): (Vec<Instant>, Vec<Instant>) = joins.iter().partition(|&&t| t <= now);
        joins = later;
        for _ in due {
            done.spares_started += 1;
            spares.push(start_spare(run, job, spare_dir, done.spares_started)?);
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let wall_s = run.started.elapsed().as_secs_f64();
    stop_spares(spares);
    run.check(status, "disturbed")?;
    Ok((wall_s, done))
}

/// Carries out `failure` on the live `nodes` (a SIGKILL of its target's processes) and counts it
/// in `done`; whether a node was killed (a replacement node is then due).
fn kill(nodes: &[Node], failure: &Failure, done: &mut Disturbance) -> bool {
    let Some(target) = choose_target(nodes, failure) else {
        return false;
    };
    for &pid in &target.pids {
        sigkill(pid);
    }
    match target.victim {
        Victim::Worker => done.worker_kills += 1,
        Victim::Node => done.node_kills += 1,
    }
    target.victim == Victim::Node
}

/// Starts replacement node number `n` (`spare-N` under `spare_dir`), joining the run.
fn start_spare(run: &Launched, job: &Job, spare_dir: &Path, n: u64) -> Result<Child> {
    let name = format!("spare-{n}");
    let dir = spare_dir.join(&name);
    std::fs::create_dir_all(&dir)?;
    Command::new(&job.exe)
        .args(["agent", "--join", &run.listen, "--name", &name])
        .arg("--dir")
        .arg(&dir)
        .env("SEQPIPE_JOB_TOKEN", &job.token)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("agent.log"))?)
        .spawn()
        .context("starting a replacement node")
}

/// Replacement agents exit with the run; one that never got in is stopped.
fn stop_spares(spares: Vec<Child>) {
    for mut spare in spares {
        let deadline = Instant::now() + Duration::from_secs(5);
        while matches!(spare.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if matches!(spare.try_wait(), Ok(None)) {
            let _ = spare.kill();
            let _ = spare.wait();
        }
    }
}

/// A run that did not finish within `give_up_after`: every process of it is killed, and the
/// error says how far it got and what was done to it.
fn give_up(
    run: &mut Launched,
    mut spares: Vec<Child>,
    done: &Disturbance,
    give_up_after: Duration,
) -> anyhow::Error {
    let mut tree = live_nodes(run.child.id(), &mut spares);
    for node in tree.drain(..) {
        node.workers.iter().for_each(|&w| sigkill(w));
        sigkill(node.agent);
    }
    let _ = run.child.kill();
    let _ = run.child.wait();
    for mut spare in spares {
        let _ = spare.wait();
    }
    let s = summarize(&run.metrics());
    anyhow::anyhow!(
        "the disturbed run did not finish within {:.0}s (failures may arrive faster than it recovers): {} step records, {} worker and {} node kills, {} replacement nodes started ({} joined), {} nodes lost, recoveries {:?} (lost steps {}, recovery_s sum {:.3}); its directory is {}",
        give_up_after.as_secs_f64(),
        s.step_records,
        done.worker_kills,
        done.node_kills,
        done.spares_started,
        s.nodes_joined,
        s.nodes_lost,
        s.recoveries,
        s.lost_steps,
        s.recovery_s,
        run.run_dir.display()
    )
}

/// `seqpipe bench goodput`.
pub fn run(args: &GoodputArgs) -> Result<()> {
    ensure!(
        args.failures_per_step.is_finite() && args.failures_per_step > 0.0,
        "--failures-per-step must be more than 0, got {}",
        args.failures_per_step
    );
    ensure!(
        args.rejoin_after_s.is_finite() && args.rejoin_after_s >= 0.0,
        "--rejoin-after-s must be 0 or more, got {}",
        args.rejoin_after_s
    );
    ensure!(
        (1..=1000).contains(&args.rounds),
        "--rounds must be 1 to 1000, got {}",
        args.rounds
    );
    let mut sets = args.overrides.clone();
    if let Some(steps) = args.steps {
        sets.push(format!("train.steps={steps}"));
    }
    // Recoveries are the point here: the job may make as many as the failures need.
    sets.push("elastic.max_restarts=1000000".into());
    let cfg = Config::load(args.config.as_deref(), &sets)?;
    ensure!(
        cfg.elastic.local_agents,
        "bench goodput kills the nodes of a local run: elastic.local_agents must be true"
    );
    let job = Job {
        exe: std::env::current_exe()?,
        config: args.config.clone(),
        sets,
        url: cfg.checkpoint.url.clone(),
        token: fresh_token(),
    };
    let base = args.dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("seqpipe-bench-goodput-{}", std::process::id()))
    });
    println!(
        "job: {} steps, {} stages ({} layers, d_model {}); failures: {} per step, seeds {}..{}, replacement node {}s after a node kill; {} round(s) of an undisturbed and a disturbed run",
        cfg.train.steps,
        cfg.pipeline.stages,
        cfg.model.layers,
        cfg.model.d_model,
        args.failures_per_step,
        args.seed,
        args.seed + args.rounds - 1,
        args.rejoin_after_s,
        args.rounds,
    );
    let mut reports = Vec::new();
    for round in 0..args.rounds {
        let dir = if args.rounds == 1 {
            base.clone()
        } else {
            base.join(format!("round-{round}"))
        };
        let report = one_round(&job, args, cfg.train.steps, round, &dir)?;
        // With one round the summary below is that round, unless the round fails its check.
        if args.rounds > 1 || !report.bit_identical {
            println!("round {round} (seed {}):", report.seed);
            print_table(&report);
            println!("{}", serde_json::to_string(&report)?);
        }
        let identical = report.bit_identical;
        reports.push(report);
        ensure!(
            identical,
            "round {round}: the disturbed run's final state differs from the undisturbed run's; both runs are kept in {}",
            dir.display()
        );
    }
    let total = summary_of(&reports);
    if args.rounds > 1 {
        let ettrs: Vec<String> = reports
            .iter()
            .map(|r| format!("{:.3} ({:.3})", r.ettr, r.ettr_speed_corrected))
            .collect();
        println!(
            "all {} rounds (ETTR per round, speed-corrected in brackets: {}):",
            args.rounds,
            ettrs.join(" ")
        );
    }
    print_table(&total);
    println!("{}", serde_json::to_string(&total)?);
    if args.dir.is_none() {
        let _ = std::fs::remove_dir_all(&base);
    }
    Ok(())
}

/// One round: the job undisturbed in `dir/undisturbed`, then under the failures of seed
/// `args.seed + round` (at the rate of this round's undisturbed step time) in `dir/disturbed`.
fn one_round(job: &Job, args: &GoodputArgs, steps: u64, round: u64, dir: &Path) -> Result<Report> {
    let seed = args.seed + round;
    let mut quiet = job.launch(&dir.join("undisturbed"))?;
    let status = quiet.child.wait()?;
    let undisturbed_s = quiet.started.elapsed().as_secs_f64();
    quiet.check(status, "undisturbed")?;
    let step_s = mean_step_s(&quiet.metrics()).context("the undisturbed run recorded no steps")?;
    let mean_gap_s = step_s / args.failures_per_step;
    println!(
        "round {round}: undisturbed {undisturbed_s:.3}s, {step_s:.4}s per step; mean time between failures {mean_gap_s:.3}s (seed {seed})"
    );

    let mut noisy = job.launch(&dir.join("disturbed"))?;
    let (disturbed_s, done) = disturb(
        &mut noisy,
        job,
        FailureSchedule::new(seed, Duration::from_secs_f64(mean_gap_s)),
        Duration::from_secs_f64(args.rejoin_after_s),
        &dir.join("replacement-nodes"),
        Duration::from_secs_f64(
            args.give_up_after_s
                .unwrap_or(120.0 + 20.0 * undisturbed_s)
                .clamp(0.0, 1e9),
        ),
    )?;
    let summary = summarize(&noisy.metrics());
    let account = Goodput::of_records(&parse_records(&noisy.metrics())).figures();
    let clean_u = clean_median_step_s(&quiet.metrics()).unwrap_or(step_s);
    let clean_d = clean_median_step_s(&noisy.metrics()).unwrap_or(clean_u);

    let (reference_step, reference) = final_state(&quiet.url, &Default::default())?;
    let (final_step, state) = final_state(&noisy.url, &Default::default())?;
    Ok(Report {
        round: Some(round),
        runs: 1,
        steps,
        failures_per_step: args.failures_per_step,
        seed,
        rejoin_after_s: args.rejoin_after_s,
        undisturbed_step_s: step_s,
        mean_failure_gap_s: mean_gap_s,
        undisturbed_s,
        disturbed_s,
        ettr: ettr(undisturbed_s, disturbed_s),
        undisturbed_clean_step_s: clean_u,
        disturbed_clean_step_s: clean_d,
        ettr_speed_corrected: speed_corrected_ettr(undisturbed_s, disturbed_s, clean_u, clean_d),
        goodput_ratio: account.ettr,
        goodput_wall_s: account.wall_s,
        goodput_productive_s: account.productive_s,
        goodput_lost_s: account
            .lost_s
            .iter()
            .map(|(cause, s)| (cause.as_str(), *s))
            .collect(),
        kills: BTreeMap::from([("worker", done.worker_kills), ("node", done.node_kills)]),
        replacement_nodes_started: done.spares_started,
        recoveries: summary.recoveries.clone(),
        lost_steps: summary.lost_steps,
        redone_units: summary.redone_units,
        recovery_s: summary.recovery_s,
        nodes_lost: summary.nodes_lost,
        nodes_joined: summary.nodes_joined,
        disturbed_step_records: summary.step_records,
        final_step,
        tensors: state.len(),
        bit_identical: reference_step == steps && final_step == steps && state == reference,
    })
}

/// The rounds taken together: wall times, kills, recoveries and work redone summed (so the ETTR
/// is the summed undisturbed time over the summed disturbed time), bit-identical only if every
/// round was; the seed is the first round's.
fn summary_of(rounds: &[Report]) -> Report {
    let first = &rounds[0];
    let sum_f = |f: fn(&Report) -> f64| rounds.iter().map(f).sum::<f64>();
    let sum_u = |f: fn(&Report) -> u64| rounds.iter().map(f).sum::<u64>();
    let mut kills: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut recoveries: BTreeMap<String, u64> = BTreeMap::new();
    let mut goodput_lost_s: BTreeMap<&'static str, f64> = BTreeMap::new();
    for r in rounds {
        for (cause, s) in &r.goodput_lost_s {
            *goodput_lost_s.entry(cause).or_default() += s;
        }
        for (k, n) in &r.kills {
            *kills.entry(k).or_default() += n;
        }
        for (k, n) in &r.recoveries {
            *recoveries.entry(k.clone()).or_default() += n;
        }
    }
    let (undisturbed_s, disturbed_s) = (sum_f(|r| r.undisturbed_s), sum_f(|r| r.disturbed_s));
    let rescaled =
        sum_f(|r| r.undisturbed_s * r.disturbed_clean_step_s / r.undisturbed_clean_step_s);
    Report {
        round: None,
        runs: rounds.len() as u64,
        steps: first.steps,
        failures_per_step: first.failures_per_step,
        seed: first.seed,
        rejoin_after_s: first.rejoin_after_s,
        undisturbed_step_s: sum_f(|r| r.undisturbed_step_s) / rounds.len() as f64,
        mean_failure_gap_s: sum_f(|r| r.mean_failure_gap_s) / rounds.len() as f64,
        undisturbed_s,
        disturbed_s,
        ettr: ettr(undisturbed_s, disturbed_s),
        undisturbed_clean_step_s: sum_f(|r| r.undisturbed_clean_step_s) / rounds.len() as f64,
        disturbed_clean_step_s: sum_f(|r| r.disturbed_clean_step_s) / rounds.len() as f64,
        ettr_speed_corrected: rescaled / disturbed_s,
        goodput_ratio: sum_f(|r| r.goodput_productive_s) / sum_f(|r| r.goodput_wall_s),
        goodput_wall_s: sum_f(|r| r.goodput_wall_s),
        goodput_productive_s: sum_f(|r| r.goodput_productive_s),
        goodput_lost_s,
        kills,
        replacement_nodes_started: sum_u(|r| r.replacement_nodes_started),
        recoveries,
        lost_steps: sum_u(|r| r.lost_steps),
        redone_units: sum_u(|r| r.redone_units),
        recovery_s: sum_f(|r| r.recovery_s),
        nodes_lost: sum_u(|r| r.nodes_lost),
        nodes_joined: sum_u(|r| r.nodes_joined),
        disturbed_step_records: sum_u(|r| r.disturbed_step_records),
        final_step: rounds.iter().map(|r| r.final_step).min().unwrap_or(0),
        tensors: first.tensors,
        bit_identical: rounds.iter().all(|r| r.bit_identical),
    }
}

fn print_table(r: &Report) {
    let tiers = if r.recoveries.is_empty() {
        "none".to_string()
    } else {
        r.recoveries
            .iter()
            .map(|(t, n)| format!("{t} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let rows = [
        ("undisturbed wall time", format!("{:.3} s", r.undisturbed_s)),
        ("disturbed wall time", format!("{:.3} s", r.disturbed_s)),
        ("ETTR", format!("{:.4}", r.ettr)),
        (
            "ETTR, speed-corrected",
            format!(
                "{:.4} (clean steps: undisturbed {:.4} s, disturbed {:.4} s)",
                r.ettr_speed_corrected, r.undisturbed_clean_step_s, r.disturbed_clean_step_s
            ),
        ),
        (
            "goodput (disturbed)",
            format!(
                "{:.4} = {:.3} s productive / {:.3} s wall; lost: {}",
                r.goodput_ratio,
                r.goodput_productive_s,
                r.goodput_wall_s,
                r.goodput_lost_s
                    .iter()
                    .map(|(c, s)| format!("{c} {s:.3} s"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
        (
            "kills",
            format!(
                "{} workers, {} whole nodes ({} replacement nodes started, {} joined)",
                r.kills["worker"], r.kills["node"], r.replacement_nodes_started, r.nodes_joined
            ),
        ),
        ("recoveries by tier", tiers),
        (
            "work redone",
            format!(
                "{} completed steps, {} mid-step units; {} step records for {} steps",
                r.lost_steps,
                r.redone_units,
                r.disturbed_step_records,
                r.steps * r.runs
            ),
        ),
        ("recovery time (sum)", format!("{:.3} s", r.recovery_s)),
        (
            "final state",
            format!(
                "step {}, {} tensors, bit-identical: {}",
                r.final_step, r.tensors, r.bit_identical
            ),
        ),
    ];
    for (k, v) in rows {
        println!("  {k:<24} {v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_is_seeded_increasing_and_has_the_requested_mean_gap() {
        let mean = Duration::from_millis(400);
        let a: Vec<Failure> = FailureSchedule::new(7, mean).take(20_000).collect();
        let b: Vec<Failure> = FailureSchedule::new(7, mean).take(20_000).collect();
        assert_eq!(a, b, "same seed, same failures");
        assert_ne!(
            a[..10],
            FailureSchedule::new(8, mean).take(10).collect::<Vec<_>>()[..]
        );
        assert!(a.windows(2).all(|w| w[0].at <= w[1].at));
        // Mean of 20 000 exponential gaps: standard error = mean / sqrt(n) ≈ 0.7 %; allow 3 %.
        let mean_gap = a.last().unwrap().at.as_secs_f64() / a.len() as f64;
        assert!((mean_gap / 0.4 - 1.0).abs() < 0.03, "mean gap {mean_gap}");
        // Exponential: about e^-1 of the gaps exceed the mean.
        let long = std::iter::once(a[0].at)
            .chain(a.windows(2).map(|w| w[1].at - w[0].at))
            .filter(|g| *g > mean)
            .count() as f64
            / a.len() as f64;
        assert!((long - (-1f64).exp()).abs() < 0.02, "{long}");
        let nodes = a.iter().filter(|f| f.victim == Victim::Node).count() as f64;
        assert!((nodes / a.len() as f64 - 0.5).abs() < 0.02);
    }

    fn nodes() -> Vec<Node> {
        vec![
            Node {
                agent: 10,
                workers: vec![11],
            },
            Node {
                agent: 20,
                workers: vec![],
            },
            Node {
                agent: 30,
                workers: vec![31, 32],
            },
        ]
    }

    fn failure(victim: Victim, pick: u64) -> Failure {
        Failure {
            at: Duration::ZERO,
            victim,
            pick,
        }
    }

    #[test]
    fn a_node_failure_kills_the_workers_then_the_agent() {
        let t = choose_target(&nodes(), &failure(Victim::Node, 5)).unwrap();
        assert_eq!(t.victim, Victim::Node);
        assert_eq!(t.pids, [31, 32, 30]);
    }

    #[test]
    fn a_worker_failure_picks_a_running_worker() {
        // Node 20's worker is being restarted: only 11, 31 and 32 are candidates.
        let picked: std::collections::BTreeSet<u32> = (0..12)
            .map(|pick| choose_target(&nodes(), &failure(Victim::Worker, pick)).unwrap())
            .inspect(|t| assert_eq!(t.victim, Victim::Worker))
            .map(|t| t.pids[0])
            .collect();
        assert_eq!(picked, [11, 31, 32].into());
    }

    #[test]
    fn the_last_node_is_never_killed_whole() {
        let last = &nodes()[2..];
        let t = choose_target(last, &failure(Victim::Node, 3)).unwrap();
        assert_eq!(t.victim, Victim::Worker);
        assert!(choose_target(&nodes()[1..2], &failure(Victim::Node, 0)).is_none());
        assert!(choose_target(&[], &failure(Victim::Worker, 0)).is_none());
    }

    #[test]
    fn summary_counts_recoveries_by_tier() {
        let lines = [
            r#"{"event":"plan","generation":1,"nodes":["local-001","local-002","local-003","local-004"],"stages":4}"#,
            r#"{"step":1,"retained_bytes":0,"units":8,"compute_s":0.4,"end_unix_s":10.0,"loss":4.0,"lr":0.001,"grad_norm":1.0,"tokens":64,"step_time_s":0.5,"tokens_per_s":128.0}"#,
            r#"{"agent_alive":false,"detected_at_unix_s":11.0,"event":"node_lost","failed_step":2,"node":"local-002","reason":"its agent's connection closed"}"#,
            r#"{"at_unix_s":12.0,"event":"recovered","lost_steps":1,"recovery_s":0.75,"stages_after":3,"stages_before":4,"step":2,"tier":"peer"}"#,
            "not json",
            r#"{"at_unix_s":13.0,"event":"recovered","host":"local-001","lost_steps":0,"node":"local-003","recovery_s":0.25,"redone_s":0.1,"redone_units":7,"stage":2,"stages_after":3,"stages_before":3,"step":2,"tier":"mid_step"}"#,
            r#"{"event":"node_joined","node":"spare-1","step":2}"#,
            r#"{"at_unix_s":14.0,"event":"recovered","lost_steps":0,"recovery_s":0.5,"stages_after":4,"stages_before":3,"step":3,"tier":"peer"}"#,
            r#"{"event":"solar_flare","step":3}"#,
            r#"{"step":2,"retained_bytes":0,"units":8,"compute_s":0.2,"end_unix_s":15.0,"loss":3.0,"lr":0.001,"grad_norm":1.0,"tokens":64,"step_time_s":0.25,"tokens_per_s":256.0}"#,
        ]
        .join("\n");
        let s = summarize(&lines);
        assert_eq!(
            s.recoveries,
            BTreeMap::from([("mid_step".into(), 1), ("peer".into(), 2)])
        );
        assert_eq!((s.lost_steps, s.redone_units), (1, 7));
        assert_eq!(s.recovery_s, 1.5);
        assert_eq!((s.nodes_lost, s.nodes_joined, s.step_records), (1, 1, 2));
        assert_eq!(mean_step_s(&lines), Some(0.375));
        assert_eq!(ettr(9.0, 10.0), 0.9);
    }

    #[test]
    fn clean_steps_leave_out_the_first_and_those_a_recovery_touched() {
        let on = |stages: usize, n: u64, t: f64| {
            format!(
                r#"{{"step":{n},"peak_activation_bytes":{:?},"end_unix_s":{n}.0,"loss":1.0,"lr":0.1,"grad_norm":1.0,"tokens":8,"step_time_s":{t},"tokens_per_s":1.0}}"#,
                vec![1; stages]
            )
        };
        let step = |n: u64, t: f64| on(4, n, t);
        let recovered = r#"{"at_unix_s":1.0,"event":"recovered","lost_steps":0,"recovery_s":0.5,"stages_after":4,"stages_before":4,"step":3,"tier":"mid_step"}"#;
        // Step 1 (start), steps 3 and 4 (the recovery and the one after) and step 7 (on 3 stages)
        // are not clean.
        let lines = [
            step(1, 9.0),
            step(2, 0.30),
            recovered.to_string(),
            step(3, 2.0),
            step(4, 0.9),
            step(5, 0.32),
            step(6, 0.34),
            on(3, 7, 0.5),
        ]
        .join("\n");
        assert_eq!(clean_median_step_s(&lines), Some(0.32));
        assert_eq!(clean_median_step_s(&step(1, 0.5)), None);
        // The undisturbed run took 20 s at 0.4 s per clean step; the disturbed one 18 s at 0.3:
        // at its speed the job would have taken 15 s undisturbed.
        let corrected = speed_corrected_ettr(20.0, 18.0, 0.4, 0.3);
        assert!((corrected - 15.0 / 18.0).abs() < 1e-12, "{corrected}");
    }
}
