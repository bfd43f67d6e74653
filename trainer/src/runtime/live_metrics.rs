//! The run's numbers as Prometheus metrics: the step records and [`RunEvent`]s that go to
//! `metrics.jsonl` also update these gauges and counters (`MetricsLog` in `metrics_log` feeds
//! both from the one record, after the line is written), so a scrape of `GET /metrics` (served
//! by the `metrics_endpoint` module) and the file cannot disagree. [`LiveMetrics::encode`] writes
//! the text exposition with the official client (`prometheus-client`).
//!
//! The `seqpipe_goodput_*` metrics are the [`Goodput`] account of the same records (the one
//! `seqpipe bench goodput` computes from the file): the effective training time ratio, its wall
//! and productive seconds, and the seconds lost by cause.
//!
//! Counters count what this coordinator process observed since it started (a coordinator that
//! takes over a job starts from zero, as Prometheus expects of a restarted target); gauges say
//! where the run stands.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::{SystemTime, UNIX_EPOCH};

use elastic::{NodeId, Plan};
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use super::events::{CheckpointCommitted, NodeLeft, PlanAdopted, Recovered, RunEvent};
use super::goodput::{Cause, Goodput};
use super::recovery::Tier;
use crate::metrics::StepMetrics;

/// The label set of the recoveries counter: `tier` = a [`Tier`]'s name.
type TierLabel = [(&'static str, &'static str); 1];

/// The label set of the goodput's lost seconds: `cause` = a [`Cause`]'s name.
type CauseLabel = [(&'static str, &'static str); 1];

/// A gauge of a float value.
type FloatGauge = Gauge<f64, AtomicU64>;

/// The metrics of one run (see the module docs). Shared between the training loop, which
/// observes records, and the endpoint's thread, which encodes them.
#[derive(Debug)]
pub struct LiveMetrics {
    registry: Registry,
    /// Only encoded once a checkpoint was committed: before that there is no age to report.
    checkpoint_registry: Registry,
    step: Gauge,
    loss: FloatGauge,
    tokens_per_s: FloatGauge,
    step_time_s: FloatGauge,
    generation: Gauge,
    nodes: Gauge,
    stages: Gauge,
    replicas: Gauge,
    recoveries: Family<TierLabel, Counter>,
    nodes_lost: Counter,
    nodes_left: Counter,
    nodes_joined: Counter,
    checkpoints: Counter,
    checkpoints_failed: Counter,
    checkpoint_step: Gauge,
    checkpoint_age_s: FloatGauge,
    /// When the newest checkpoint was committed (Unix seconds), once one was.
    committed_at_unix_s: Mutex<Option<f64>>,
    /// The goodput account of the records observed, and its gauges.
    goodput: Mutex<Goodput>,
    goodput_ratio: FloatGauge,
    goodput_wall_s: FloatGauge,
    goodput_productive_s: FloatGauge,
    goodput_lost_s: Family<CauseLabel, FloatGauge>,
}

impl Default for LiveMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl LiveMetrics {
    /// Every metric registered, at zero (the recoveries counter with one series per tier).
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::with_prefix("seqpipe"),
            checkpoint_registry: Registry::with_prefix("seqpipe"),
            step: Gauge::default(),
            loss: FloatGauge::default(),
            tokens_per_s: FloatGauge::default(),
            step_time_s: FloatGauge::default(),
            generation: Gauge::default(),
            nodes: Gauge::default(),
            stages: Gauge::default(),
            replicas: Gauge::default(),
            recoveries: Family::default(),
            nodes_lost: Counter::default(),
            nodes_left: Counter::default(),
            nodes_joined: Counter::default(),
            checkpoints: Counter::default(),
            checkpoints_failed: Counter::default(),
            checkpoint_step: Gauge::default(),
            checkpoint_age_s: FloatGauge::default(),
            committed_at_unix_s: Mutex::new(None),
            goodput: Mutex::new(Goodput::default()),
            goodput_ratio: FloatGauge::default(),
            goodput_wall_s: FloatGauge::default(),
            goodput_productive_s: FloatGauge::default(),
            goodput_lost_s: Family::default(),
        };
        m.register_progress();
        m.register_plan();
        m.register_event_counters();
        m.register_checkpoint_age();
        m.register_goodput();
        m
    }

    /// The goodput account (see the `goodput` module for the definitions).
    fn register_goodput(&mut self) {
        let r = &mut self.registry;
        r.register(
            "goodput_ratio",
            "Effective training time ratio: productive step time over wall time since the first step started, as of the newest record",
            self.goodput_ratio.clone(),
        );
        r.register_with_unit(
            "goodput_wall",
            "Wall time from the first step's start to the newest record",
            Unit::Seconds,
            self.goodput_wall_s.clone(),
        );
        r.register_with_unit(
            "goodput_productive",
            "Step time of the steps that stand (a step computed again replaces its earlier time)",
            Unit::Seconds,
            self.goodput_productive_s.clone(),
        );
        r.register_with_unit(
            "goodput_lost",
            "Wall time lost, by cause: recovery, restart, checkpoint_stall, waiting_for_nodes",
            Unit::Seconds,
            self.goodput_lost_s.clone(),
        );
        for cause in Cause::ALL {
            let _ = self
                .goodput_lost_s
                .get_or_create(&[("cause", cause.as_str())]);
        }
    }

    /// Feeds the goodput account and sets its gauges.
    fn account(&self, observe: impl FnOnce(&mut Goodput)) {
        // A plain number store: a panic elsewhere cannot leave it half-written.
        let mut g = self.goodput.lock().unwrap_or_else(|p| p.into_inner());
        observe(&mut g);
        let f = g.figures();
        self.goodput_ratio.set(f.ettr);
        self.goodput_wall_s.set(f.wall_s);
        self.goodput_productive_s.set(f.productive_s);
        for (cause, s) in f.lost_s {
            self.goodput_lost_s
                .get_or_create(&[("cause", cause.as_str())])
                .set(s);
        }
    }

    /// The last step's numbers.
    fn register_progress(&mut self) {
        let r = &mut self.registry;
        r.register(
            "step",
            "The last completed optimizer step",
            self.step.clone(),
        );
        r.register(
            "loss",
            "Mean token loss of the last step",
            self.loss.clone(),
        );
        r.register(
            "tokens_per_second",
            "Training throughput of the last step (tokens / step time)",
            self.tokens_per_s.clone(),
        );
        r.register_with_unit(
            "step_time",
            "Wall-clock time of the last step (forward, backward, update)",
            Unit::Seconds,
            self.step_time_s.clone(),
        );
    }

    /// The plan the pipeline runs.
    fn register_plan(&mut self) {
        let r = &mut self.registry;
        r.register(
            "plan_generation",
            "Generation of the plan the pipeline runs",
            self.generation.clone(),
        );
        r.register(
            "plan_nodes",
            "Nodes in the plan the pipeline runs",
            self.nodes.clone(),
        );
        r.register(
            "plan_stages",
            "Pipeline stages (of one replica) in the plan the pipeline runs",
            self.stages.clone(),
        );
        r.register(
            "plan_replicas",
            "Data-parallel replicas in the plan the pipeline runs",
            self.replicas.clone(),
        );
    }

    /// Counters of the run's events.
    fn register_event_counters(&mut self) {
        let r = &mut self.registry;
        r.register(
            "recoveries",
            "Completed recoveries, by how the state was carried over (the `recovered` event's tier)",
            self.recoveries.clone(),
        );
        r.register(
            "nodes_lost",
            "Nodes lost (died, hung or cut off): `node_lost` events",
            self.nodes_lost.clone(),
        );
        r.register(
            "nodes_left",
            "Nodes that left at a step boundary after a preemption notice: `node_left` events",
            self.nodes_left.clone(),
        );
        r.register(
            "nodes_joined",
            "Waiting nodes admitted at a step boundary: `node_joined` events",
            self.nodes_joined.clone(),
        );
        r.register(
            "checkpoints",
            "Checkpoints committed",
            self.checkpoints.clone(),
        );
        r.register(
            "checkpoints_failed",
            "Checkpoints abandoned (the previous committed one stays valid)",
            self.checkpoints_failed.clone(),
        );
        for tier in Tier::ALL {
            let _ = self.recoveries.get_or_create(&[("tier", tier.as_str())]);
        }
    }

    /// The newest checkpoint, encoded only once one was committed.
    fn register_checkpoint_age(&mut self) {
        let r = &mut self.checkpoint_registry;
        r.register(
            "last_checkpoint_step",
            "Step of the newest committed checkpoint",
            self.checkpoint_step.clone(),
        );
        r.register_with_unit(
            "checkpoint_age",
            "Time since the newest checkpoint was committed",
            Unit::Seconds,
            self.checkpoint_age_s.clone(),
        );
    }

    /// A step record, as appended to `metrics.jsonl`.
    pub fn observe_step(&self, record: &StepMetrics) {
        self.step.set(gauge_value(record.step));
        self.loss.set(record.loss);
        self.tokens_per_s.set(record.tokens_per_s);
        self.step_time_s.set(record.step_time_s);
        self.account(|g| g.observe_step(record));
    }

    /// An event, as appended to `metrics.jsonl`; `at_unix_s` is when it was written (the age of
    /// a committed checkpoint counts from there).
    pub fn observe_event(&self, event: &RunEvent, at_unix_s: f64) {
        self.account(|g| g.observe_event(event));
        match event {
            RunEvent::Plan(plan) => self.plan_adopted(plan),
            RunEvent::NodeLost(_) => {
                self.nodes_lost.inc();
            }
            RunEvent::NodeLeft(NodeLeft { .. }) => {
                self.nodes_left.inc();
            }
            RunEvent::NodeJoined(_) => {
                self.nodes_joined.inc();
            }
            RunEvent::Recovered(Recovered { tier, .. }) => {
                self.recoveries
                    .get_or_create(&[("tier", tier.as_str())])
                    .inc();
            }
            RunEvent::Checkpoint(CheckpointCommitted { step, .. }) => {
                self.checkpoints.inc();
                self.checkpoint_step.set(gauge_value(*step));
                *self.committed_at() = Some(at_unix_s);
            }
            RunEvent::CheckpointFailed(_) => {
                self.checkpoints_failed.inc();
            }
            RunEvent::CoordinatorTakeover(_)
            | RunEvent::Resumed(_)
            | RunEvent::CheckpointWait(_) => {}
        }
    }

    /// The plan a pipeline starts under: the first plan of a fresh run has no `plan` event in
    /// `metrics.jsonl` (only new plans after a loss, leave or join are recorded), so the
    /// pipeline reports the plan it runs.
    pub fn plan_running(&self, plan: &Plan) {
        self.plan_adopted(&PlanAdopted::of(plan));
    }

    fn plan_adopted(&self, plan: &PlanAdopted) {
        self.generation.set(gauge_value(plan.generation));
        self.stages.set(gauge_value(plan.stages as u64));
        self.replicas.set(gauge_value(plan.replicas as u64));
        // `nodes` lists the node of each worker slot; a node may run several.
        let distinct: BTreeSet<&NodeId> = plan.nodes.iter().collect();
        self.nodes.set(gauge_value(distinct.len() as u64));
    }

    fn committed_at(&self) -> std::sync::MutexGuard<'_, Option<f64>> {
        // The guarded value is a plain number: a panic elsewhere cannot leave it half-written.
        self.committed_at_unix_s
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The text exposition at `now_unix_s` (which the checkpoint age is measured to).
    pub fn encode_at(&self, now_unix_s: f64) -> String {
        let committed_at = *self.committed_at();
        let mut text = String::new();
        // Writing to a String cannot fail; the encoder's errors only come from its writer.
        let _ = encode_registry(&mut text, &self.registry);
        if let Some(at) = committed_at {
            self.checkpoint_age_s.set((now_unix_s - at).max(0.0));
            let _ = encode_registry(&mut text, &self.checkpoint_registry);
        }
        let _ = encode_eof(&mut text);
        text
    }

    /// The text exposition now.
    pub fn encode(&self) -> String {
        self.encode_at(unix_now_s())
    }
}

/// A count as an `i64` gauge value (saturating: a step count never gets near it).
fn gauge_value(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The time now as Unix seconds.
pub fn unix_now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The content type of [`LiveMetrics::encode`]'s text (OpenMetrics, which Prometheus reads).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::events::{CheckpointFailed, NodeJoined, NodeLost, Resumed};

    fn step(step: u64, loss: f64) -> StepMetrics {
        StepMetrics {
            step,
            retained_bytes: 0,
            peak_activation_bytes: vec![],
            state_bytes: vec![],
            units: 8,
            compute_s: 0.1,
            compute_cpu_s: 0.0,
            reduce_bytes: 0,
            reduce_s: 0.0,
            gradient_buffers: 0,
            page_faults: 0,
            cpu_user_s: 0.0,
            cpu_system_s: 0.0,
            peer_snapshot_step: None,
            peer_snapshots_skipped: 0,
            end_unix_s: 998.0 + step as f64,
            loss,
            lr: 1e-3,
            grad_norm: 1.0,
            tokens: 64,
            step_time_s: 0.25,
            tokens_per_s: 256.0,
            val_loss: None,
        }
    }

    fn recovered(step: u64, tier: Tier) -> RunEvent {
        RunEvent::Recovered(Recovered {
            step,
            recovery_s: 1.0,
            lost_steps: 0,
            tier,
            stages_before: 3,
            stages_after: 2,
            at_unix_s: 1000.0 + step as f64,
            stage: None,
            node: None,
            host: None,
            redone_units: None,
            redone_s: None,
        })
    }

    /// A fixed sequence of records: a fresh 3-node run, a checkpoint, a node lost and recovered
    /// from peer snapshots on 2 nodes, a mid-step recovery, a node leaving, one joining, a failed
    /// checkpoint, a second commit.
    #[test]
    fn exposition_of_a_fixed_sequence_of_records() {
        let m = LiveMetrics::new();
        let nodes = |n: &[&str]| n.iter().map(|s| NodeId::new(*s)).collect::<Vec<_>>();
        let plan = Plan {
            generation: 1,
            step: 1,
            replicas: 1,
            stages: nodes(&["a", "b", "c"]),
            nodes: nodes(&["a", "b", "c"]),
        };
        m.plan_running(&plan);
        m.observe_step(&step(1, 4.5));
        m.observe_step(&step(2, 4.25));
        m.observe_event(
            &RunEvent::Checkpoint(CheckpointCommitted {
                step: 2,
                bytes: 10,
                upload_s: 0.5,
                snapshot_s: 0.1,
            }),
            1000.0,
        );
        m.observe_event(
            &RunEvent::NodeLost(NodeLost {
                node: NodeId::new("c"),
                failed_step: 3,
                reason: "gone".into(),
                detected_at_unix_s: 1001.0,
                agent_alive: false,
                stage: None,
                mid_step: None,
            }),
            1001.0,
        );
        m.observe_event(
            &RunEvent::Plan(PlanAdopted {
                generation: 2,
                stages: 2,
                replicas: 1,
                nodes: nodes(&["a", "b"]),
                resume_from: Some(2),
                tier: Some(Tier::Peer),
                waited_for_nodes_s: None,
            }),
            1002.0,
        );
        m.observe_event(&RunEvent::Resumed(Resumed { step: 2, stages: 2 }), 1002.0);
        m.observe_step(&step(3, 4.0));
        m.observe_event(&recovered(3, Tier::Peer), 1003.0);
        m.observe_event(&recovered(4, Tier::MidStep), 1004.0);
        m.observe_event(
            &RunEvent::NodeLeft(NodeLeft {
                node: NodeId::new("b"),
                step: 4,
                reason: "preemption notice (SIGTERM)".into(),
            }),
            1004.0,
        );
        m.observe_event(
            &RunEvent::NodeJoined(NodeJoined {
                node: NodeId::new("d"),
                step: 4,
            }),
            1004.0,
        );
        m.observe_event(
            &RunEvent::CheckpointFailed(CheckpointFailed {
                step: 4,
                stage: None,
                error: "abandoned".into(),
            }),
            1004.0,
        );
        m.observe_event(&recovered(5, Tier::Peer), 1005.0);
        m.observe_step(&step(5, 3.5));
        m.observe_event(
            &RunEvent::Checkpoint(CheckpointCommitted {
                step: 5,
                bytes: 10,
                upload_s: 0.5,
                snapshot_s: 0.1,
            }),
            1006.0,
        );
        let expected = "\
# HELP seqpipe_step The last completed optimizer step.
# TYPE seqpipe_step gauge
seqpipe_step 5
# HELP seqpipe_loss Mean token loss of the last step.
# TYPE seqpipe_loss gauge
seqpipe_loss 3.5
# HELP seqpipe_tokens_per_second Training throughput of the last step (tokens / step time).
# TYPE seqpipe_tokens_per_second gauge
seqpipe_tokens_per_second 256.0
# HELP seqpipe_step_time_seconds Wall-clock time of the last step (forward, backward, update).
# TYPE seqpipe_step_time_seconds gauge
# UNIT seqpipe_step_time_seconds seconds
seqpipe_step_time_seconds 0.25
# HELP seqpipe_plan_generation Generation of the plan the pipeline runs.
# TYPE seqpipe_plan_generation gauge
seqpipe_plan_generation 2
# HELP seqpipe_plan_nodes Nodes in the plan the pipeline runs.
# TYPE seqpipe_plan_nodes gauge
seqpipe_plan_nodes 2
# HELP seqpipe_plan_stages Pipeline stages (of one replica) in the plan the pipeline runs.
# TYPE seqpipe_plan_stages gauge
seqpipe_plan_stages 2
# HELP seqpipe_plan_replicas Data-parallel replicas in the plan the pipeline runs.
# TYPE seqpipe_plan_replicas gauge
seqpipe_plan_replicas 1
# HELP seqpipe_recoveries Completed recoveries, by how the state was carried over (the `recovered` event's tier).
# TYPE seqpipe_recoveries counter
";
        let text = m.encode_at(1010.5);
        assert!(text.starts_with(expected), "{text}");
        // The family's series come in hash order: compare them as a set.
        let mut recoveries: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("seqpipe_recoveries_total"))
            .collect();
        recoveries.sort();
        assert_eq!(
            recoveries,
            [
                r#"seqpipe_recoveries_total{tier="checkpoint"} 0"#,
                r#"seqpipe_recoveries_total{tier="handover"} 0"#,
                r#"seqpipe_recoveries_total{tier="mid_step"} 1"#,
                r#"seqpipe_recoveries_total{tier="peer"} 2"#,
                r#"seqpipe_recoveries_total{tier="reroute"} 0"#,
                r#"seqpipe_recoveries_total{tier="restart"} 0"#,
            ]
        );
        // The goodput account of the same records (the `goodput` module's arithmetic): steps of
        // 0.25 s ending at 999, 1000, 1001 and 1003 (the first started at 998.75), the newest
        // timestamp 1005 (the second peer recovery): 1 s of 6.25 s; the peer recoveries of 1 s
        // lost 0.75 s (less step 3) and 1 s (step 5 recorded after it); the mid-step one names
        // a step that has no record.
        let mut goodput: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("seqpipe_goodput"))
            .collect();
        goodput.sort();
        assert_eq!(
            goodput,
            [
                r#"seqpipe_goodput_lost_seconds{cause="checkpoint_stall"} 0.0"#,
                r#"seqpipe_goodput_lost_seconds{cause="recovery"} 1.75"#,
                r#"seqpipe_goodput_lost_seconds{cause="restart"} 0.0"#,
                r#"seqpipe_goodput_lost_seconds{cause="waiting_for_nodes"} 0.0"#,
                "seqpipe_goodput_productive_seconds 1.0",
                "seqpipe_goodput_ratio 0.16",
                "seqpipe_goodput_wall_seconds 6.25",
            ]
        );
        let without_goodput: String = text
            .lines()
            .filter(|l| !l.contains("seqpipe_goodput"))
            .map(|l| format!("{l}\n"))
            .collect();
        let rest = without_goodput
            .split_once("seqpipe_nodes_lost Nodes lost")
            .map(|(_, rest)| rest)
            .expect("nodes_lost after the recoveries");
        let expected_rest = " (died, hung or cut off): `node_lost` events.
# TYPE seqpipe_nodes_lost counter
seqpipe_nodes_lost_total 1
# HELP seqpipe_nodes_left Nodes that left at a step boundary after a preemption notice: `node_left` events.
# TYPE seqpipe_nodes_left counter
seqpipe_nodes_left_total 1
# HELP seqpipe_nodes_joined Waiting nodes admitted at a step boundary: `node_joined` events.
# TYPE seqpipe_nodes_joined counter
seqpipe_nodes_joined_total 1
# HELP seqpipe_checkpoints Checkpoints committed.
# TYPE seqpipe_checkpoints counter
seqpipe_checkpoints_total 2
# HELP seqpipe_checkpoints_failed Checkpoints abandoned (the previous committed one stays valid).
# TYPE seqpipe_checkpoints_failed counter
seqpipe_checkpoints_failed_total 1
# HELP seqpipe_last_checkpoint_step Step of the newest committed checkpoint.
# TYPE seqpipe_last_checkpoint_step gauge
seqpipe_last_checkpoint_step 5
# HELP seqpipe_checkpoint_age_seconds Time since the newest checkpoint was committed.
# TYPE seqpipe_checkpoint_age_seconds gauge
# UNIT seqpipe_checkpoint_age_seconds seconds
seqpipe_checkpoint_age_seconds 4.5
# EOF
";
        assert_eq!(rest, expected_rest, "{text}");
    }

    #[test]
    fn no_checkpoint_age_before_the_first_commit() {
        let m = LiveMetrics::new();
        m.observe_step(&step(1, 4.5));
        let text = m.encode_at(10.0);
        assert!(text.contains("seqpipe_step 1\n"), "{text}");
        assert!(!text.contains("checkpoint_age"), "{text}");
        assert!(!text.contains("last_checkpoint_step"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
