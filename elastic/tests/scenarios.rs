//! Data-driven scenarios (after raft-rs's datadriven tests): each file under
//! `tests/scenarios/` is a script of commands, each followed by its expected output on lines
//! starting with `> `. The runner replays the commands against a coordinator core with the clock
//! moved by hand, and compares the whole transcript. `REWRITE=1 cargo test -p elastic --test
//! scenarios` rewrites the expected outputs (review the diff before keeping it).
//!
//! Commands:
//! - `config key=value ...`: the `[elastic]` section (parsed by serde, so unknown keys fail);
//! - `stages N`: the model's layer count (`max_stages`);
//! - `at S`: the clock, in seconds since the scenario's start (never goes back);
//! - `join ID SLOTS`, `beat [ID ...]` (no id: every live node), `fail ID REASON...`,
//!   `leave ID`, `expire`: membership events;
//! - `boundary N`: step N is about to start; `midstep`: a step is running;
//! - `decide`: decide, print decision and reason, and apply the decision;
//! - `tier PEER_STEP|none CHECKPOINT_STEP|none`: the recovery tier for the last `Recover` (the
//!   interrupted step it restarts) when live nodes' peer snapshots hold the whole model at
//!   PEER_STEP and the newest committed checkpoint is CHECKPOINT_STEP; printed with the buddies
//!   (who holds whose snapshot) of the plan it replaced.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use elastic::{
    ClusterState, Decision, ElasticConfig, NodeId, NodeInfo, Plan, buddies, decide, recovery_tier,
};

struct Runner {
    t0: Instant,
    now: Duration,
    cfg: ElasticConfig,
    state: ClusterState,
    /// The plan replaced by the last `Recover`, and that decision's lost nodes.
    last_recovery: Option<(Plan, Vec<NodeId>, u64)>,
}

impl Runner {
    fn new() -> Self {
        Self {
            t0: Instant::now(),
            now: Duration::ZERO,
            cfg: ElasticConfig::default(),
            state: ClusterState::new(usize::MAX),
            last_recovery: None,
        }
    }

    fn now(&self) -> Instant {
        self.t0 + self.now
    }

    fn secs(&self, t: Instant) -> String {
        format!("{}", t.duration_since(self.t0).as_secs_f64())
    }

    /// Runs one command line and returns its output lines.
    fn run(&mut self, line: &str) -> Vec<String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (cmd, args) = words.split_first().expect("non-empty command");
        let now = self.now();
        let m = &mut self.state.membership;
        let result = |r: Result<(), elastic::ElasticError>| match r {
            Ok(()) => vec![],
            Err(e) => vec![format!("error: {e}")],
        };
        match *cmd {
            "config" => {
                let mut map = serde_json::Map::new();
                for kv in args {
                    let (k, v) = kv.split_once('=').expect("config takes key=value");
                    let value = match v.parse::<f64>() {
                        Ok(_) => serde_json::from_str(v).expect("a JSON number"),
                        Err(_) => serde_json::Value::String(v.into()),
                    };
                    map.insert(k.into(), value);
                }
                match serde_json::from_value::<ElasticConfig>(map.into()) {
                    Err(e) => vec![format!("error: {e}")],
                    Ok(cfg) => match cfg.validate() {
                        Err(e) => vec![format!("error: {e}")],
                        Ok(()) => {
                            self.cfg = cfg;
                            vec![]
                        }
                    },
                }
            }
            "stages" => {
                self.state.max_stages = args[0].parse().expect("stages N");
                vec![]
            }
            "at" => {
                let t = Duration::from_secs_f64(args[0].parse().expect("at SECONDS"));
                assert!(t >= self.now, "time goes back at `{line}`");
                self.now = t;
                vec![]
            }
            "join" => {
                let slots = args[1].parse().expect("join ID SLOTS");
                let addr = format!("{}:29500", args[0]);
                match m.join(NodeInfo::new(args[0], slots, addr), now) {
                    Ok(incarnation) => vec![format!("incarnation {incarnation}")],
                    Err(e) => vec![format!("error: {e}")],
                }
            }
            "beat" => {
                let ids: Vec<NodeId> = if args.is_empty() {
                    m.alive().into_iter().map(|n| n.id.clone()).collect()
                } else {
                    args.iter().map(|&a| a.into()).collect()
                };
                ids.iter()
                    .flat_map(|id| result(m.heartbeat(id, now)))
                    .collect()
            }
            "fail" => result(m.report_failure(&args[0].into(), args[1..].join(" "), now)),
            "leave" => result(m.leave(&args[0].into(), now)),
            "expire" => {
                let dead = m.expire(now, self.cfg.dead_after());
                let dead: Vec<String> = dead
                    .iter()
                    .map(|id| format!("{id} ({:?})", m.status(id).unwrap()))
                    .collect();
                vec![format!("dead: {}", list(&dead))]
            }
            "boundary" => {
                self.state.step = args[0].parse().expect("boundary STEP");
                self.state.at_step_boundary = true;
                vec![]
            }
            "midstep" => {
                self.state.at_step_boundary = false;
                vec![]
            }
            "decide" => {
                let (decision, reason) = decide(now, &self.state, &self.cfg);
                let head = match &decision {
                    Decision::Continue => "Continue".to_string(),
                    Decision::Recover { plan, lost, joined } => {
                        let old = self.state.current.clone().expect("recover has a plan");
                        self.last_recovery = Some((old, lost.clone(), plan.step));
                        format!(
                            "Recover {} lost={} joined={}",
                            show(plan),
                            ids(lost),
                            ids(joined)
                        )
                    }
                    Decision::Grow { plan, joined } => {
                        format!("Grow {} joined={}", show(plan), ids(joined))
                    }
                    Decision::Shrink { plan, left, joined } => format!(
                        "Shrink {} left={} joined={}",
                        show(plan),
                        ids(left),
                        ids(joined)
                    ),
                    Decision::Wait {
                        alive,
                        needed,
                        until,
                    } => format!(
                        "Wait alive={alive} needed={needed} until={}",
                        self.secs(*until)
                    ),
                    Decision::Stop { leaving } => format!("Stop leaving={}", ids(leaving)),
                    Decision::Fail { reason: why } => {
                        assert_eq!(why, &reason, "Fail's reason and the returned one agree");
                        "Fail".to_string()
                    }
                };
                self.state.apply(&decision, now);
                vec![head, format!("reason: {reason}")]
            }
            "tier" => {
                let step = |arg: &str| -> Option<u64> {
                    match arg {
                        "none" => None,
                        s => Some(s.parse().expect("tier PEER_STEP|none CHECKPOINT_STEP|none")),
                    }
                };
                let (peer, checkpoint) = (step(args[0]), step(args[1]));
                let (old, _lost, interrupted) =
                    self.last_recovery.clone().expect("tier follows a Recover");
                let buddy_of: BTreeMap<NodeId, NodeId> = buddies(&old);
                let pairs: Vec<String> =
                    buddy_of.iter().map(|(a, b)| format!("{a}->{b}")).collect();
                let (tier, reason) = recovery_tier(peer, checkpoint, interrupted);
                vec![
                    format!("buddies {}", list(&pairs)),
                    format!("{tier:?}: {reason}"),
                ]
            }
            other => panic!("unknown command `{other}` in `{line}`"),
        }
    }
}

fn show(plan: &Plan) -> String {
    format!(
        "generation={} step={} stages={}",
        plan.generation,
        plan.step,
        ids(&plan.stages)
    )
}

fn ids(ids: &[NodeId]) -> String {
    let names: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
    list(&names)
}

fn list(items: &[String]) -> String {
    if items.is_empty() {
        "-".into()
    } else {
        items.join(",")
    }
}

/// Replays `script` (expected outputs stripped) and returns the transcript with fresh outputs.
fn transcript(script: &str) -> String {
    let mut runner = Runner::new();
    let mut out = String::new();
    for line in script.lines() {
        if line.starts_with("> ") || line == ">" {
            continue;
        }
        writeln!(out, "{line}").unwrap();
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        for output in runner.run(trimmed) {
            writeln!(out, "> {output}").unwrap();
        }
    }
    out
}

#[test]
fn scenarios() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/scenarios");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no scenarios in {}", dir.display());
    let rewrite = std::env::var_os("REWRITE").is_some();
    let mut failed = Vec::new();
    for path in &files {
        let expected = std::fs::read_to_string(path).unwrap();
        let actual = transcript(&expected);
        if actual != expected {
            if rewrite {
                std::fs::write(path, &actual).unwrap();
            } else {
                eprintln!(
                    "=== {} differs; actual transcript:\n{actual}",
                    path.display()
                );
                failed.push(path.file_name().unwrap().to_string_lossy().into_owned());
            }
        }
    }
    assert!(failed.is_empty(), "scenarios differ: {failed:?}");
}
