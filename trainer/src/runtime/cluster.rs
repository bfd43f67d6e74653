//! The nodes of a local run and the elastic core's view of them: when nodes die or leave, ask
//! [`elastic::decide`] for the next plan and point the next pipeline at the right checkpoint.

use std::path::Path;
use std::time::{Duration, Instant};

use elastic::{ClusterState, Decision, NodeId, NodeInfo, Plan, decide};
use serde_json::json;
use tracing::{info, warn};

use super::checkpoints::CheckpointWriter;
use super::driver::{ResumePoint, Start, unix_time_s};
use super::launcher::LaunchError;
use crate::config::Config;

/// The nodes of a local run (one worker process each, `local-000`, `local-001`, …), the elastic
/// core's view of them, and what the next pipeline starts from.
pub(super) struct LocalCluster {
    pub(super) cfg: Config,
    pub(super) start: Start,
    state: ClusterState,
    pub(super) recovery: Option<Recovery>,
}

/// A recovery in progress: reported in `metrics.jsonl` once the rebuilt pipeline completes a step.
pub(super) struct Recovery {
    pub(super) failed_at: Instant,
    pub(super) failed_step: u64,
    pub(super) stages_before: usize,
    /// How the state was carried over: `checkpoint` (newest committed one after a loss) or
    /// `handover` (a checkpoint of the boundary where a node left).
    pub(super) tier: &'static str,
    /// `node_lost` and `plan` events, written once the metrics file is rewritten for the resume.
    pub(super) events: Vec<serde_json::Value>,
}

impl LocalCluster {
    /// Every local node joins; the elastic core makes the first plan.
    pub(super) fn new(cfg: Config, start: Start) -> Result<Self, LaunchError> {
        let now = Instant::now();
        let mut state = ClusterState::new(cfg.model.layers);
        for i in 0..cfg.pipeline.stages {
            state
                .membership
                .join(NodeInfo::new(format!("local-{i:03}"), 1, "127.0.0.1"), now)
                .map_err(|e| LaunchError::Run(e.to_string()))?;
        }
        let (decision, reason) = decide(now, &state, &cfg.elastic);
        if decision.plan().is_none() {
            return Err(LaunchError::Run(format!(
                "cannot plan the pipeline: {reason}"
            )));
        }
        state.apply(&decision, now);
        Ok(Self {
            cfg,
            start,
            state,
            recovery: None,
        })
    }

    fn plan(&self) -> &Plan {
        self.state
            .current
            .as_ref()
            .expect("a plan is adopted at start")
    }

    pub(super) fn generation(&self) -> u64 {
        self.plan().generation
    }

    /// The workers of `lost` stages died: the elastic core plans the pipeline on the survivors
    /// (layers re-partitioned by cost, generation + 1, the old one fenced), and the run resumes from
    /// the newest committed checkpoint — or fails with the core's reason.
    pub(super) fn recover(&mut self, lost: &[usize], cause: &str) -> Result<(), LaunchError> {
        let failed_at = Instant::now();
        let detected_at_unix_s = unix_time_s();
        let failed_step = last_metrics_step(&self.cfg.run.dir.join("metrics.jsonl")) + 1;
        let before = self.plan().clone();
        let lost_nodes: Vec<NodeId> = lost.iter().map(|&s| before.stages[s].clone()).collect();
        warn!(?lost_nodes, failed_step, %cause, "node(s) lost");
        eprintln!(
            "warning: lost node(s) {} during step {failed_step}: {cause}",
            lost_nodes
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        for node in &lost_nodes {
            self.state
                .membership
                .report_failure(node, cause.to_string(), failed_at)
                .map_err(|e| LaunchError::Protocol(e.to_string()))?;
        }
        self.state.step = failed_step;
        self.state.at_step_boundary = false;
        let mut events: Vec<serde_json::Value> = lost_nodes.iter().map(|n| json!({"event": "node_lost", "node": n, "failed_step": failed_step, "reason": cause, "detected_at_unix_s": detected_at_unix_s})).collect();
        self.replan(&mut events)?;
        self.recovery = Some(Recovery {
            failed_at,
            failed_step,
            stages_before: before.stages.len(),
            tier: "checkpoint",
            events,
        });
        Ok(())
    }

    /// Nodes of `stages` got a preemption notice and the launcher committed a checkpoint of `step`,
    /// the step boundary they leave at: plan without them and resume from there (no work lost).
    pub(super) fn release(&mut self, stages: &[usize], step: u64) -> Result<(), LaunchError> {
        let now = Instant::now();
        let before = self.plan().clone();
        let leaving: Vec<NodeId> = stages.iter().map(|&s| before.stages[s].clone()).collect();
        for node in &leaving {
            self.state
                .membership
                .leave(node, now)
                .map_err(|e| LaunchError::Protocol(e.to_string()))?;
        }
        info!(?leaving, step, "node(s) leaving on a preemption notice");
        self.state.step = step + 1;
        self.state.at_step_boundary = true;
        let mut events: Vec<serde_json::Value> = leaving.iter().map(|n| json!({"event": "node_left", "node": n, "step": step, "reason": "preemption notice (SIGTERM)"})).collect();
        self.replan(&mut events)?;
        self.recovery = Some(Recovery {
            failed_at: now,
            failed_step: step + 1,
            stages_before: before.stages.len(),
            tier: "handover",
            events,
        });
        Ok(())
    }

    /// Asks the elastic core for the next plan (waiting while it says wait), adopts it, and points
    /// the next pipeline at the newest committed checkpoint; adds the `plan` event.
    fn replan(&mut self, events: &mut Vec<serde_json::Value>) -> Result<(), LaunchError> {
        let plan = loop {
            let now = Instant::now();
            let (decision, reason) = decide(now, &self.state, &self.cfg.elastic);
            self.state.apply(&decision, now);
            match decision {
                Decision::Recover { plan, .. }
                | Decision::Grow { plan, .. }
                | Decision::Shrink { plan, .. } => {
                    info!(%reason, "new plan");
                    break plan;
                }
                Decision::Wait { until, .. } => {
                    warn!(%reason, "waiting for nodes");
                    std::thread::sleep(
                        until
                            .saturating_duration_since(now)
                            .min(Duration::from_millis(200)),
                    );
                }
                Decision::Fail { reason } => {
                    return Err(LaunchError::Run(format!(
                        "{reason} (run directory {})",
                        self.cfg.run.dir.display()
                    )));
                }
                Decision::Continue => {
                    return Err(LaunchError::Protocol(format!(
                        "nodes went away but the elastic core kept the plan: {reason}"
                    )));
                }
            }
        };
        self.cfg.pipeline.stages = plan.stages.len();
        let committed = CheckpointWriter::open(&self.cfg)?.committed_steps()?;
        self.start = if committed.is_empty() {
            Start::Fresh
        } else {
            Start::Resume(ResumePoint::Latest)
        };
        events.push(json!({"event": "plan", "generation": plan.generation, "stages": plan.stages.len(), "nodes": plan.stages, "resume_from": committed.last()}));
        Ok(())
    }
}

/// The last step recorded in `metrics.jsonl` (0 if none).
fn last_metrics_step(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .filter_map(|v| v.get("step").and_then(|s| s.as_u64()))
        .max()
        .unwrap_or(0)
}
