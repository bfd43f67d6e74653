//! The typed vocabulary of what `metrics.jsonl` records besides step metrics: one [`RunEvent`]
//! variant per kind of event the runtime writes (membership changes, plans, recoveries,
//! checkpoints), and [`Record`] to read a line back as a step record or an event, so that writers
//! and readers agree on the field names in one place instead of indexing JSON by string.

use super::recovery::Tier;
use std::io;
use std::path::Path;

use elastic::NodeId;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::metrics::StepMetrics;

/// Something that happened to a run, written to `metrics.jsonl` as one JSON object whose `event`
/// field names the kind (`{"event": "node_lost", ...}`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum RunEvent {
    /// The coordinator adopted a plan: the first plan of a recovering run, or a new plan after a
    /// loss, a join or a leave.
    Plan(PlanAdopted),
    /// A node was lost: its agent or its worker died, hung or was cut off.
    NodeLost(NodeLost),
    /// A node left the plan at a step boundary after a preemption notice.
    NodeLeft(NodeLeft),
    /// A waiting node joined the plan at a step boundary.
    NodeJoined(NodeJoined),
    /// This coordinator took the job over from a lost one.
    CoordinatorTakeover(CoordinatorTakeover),
    /// The run resumed from a checkpoint.
    Resumed(Resumed),
    /// The run completed a step again after a failure or a plan change.
    Recovered(Recovered),
    /// A checkpoint was committed.
    Checkpoint(CheckpointCommitted),
    /// Training waited for the previous checkpoint's upload before scheduling the next one.
    CheckpointWait(CheckpointWait),
    /// A checkpoint was abandoned (the previous committed one stays valid).
    CheckpointFailed(CheckpointFailed),
}

/// The coordinator adopted a plan: the first plan of a recovering run, or a new plan after a
/// loss, a join or a leave.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanAdopted {
    /// The plan's generation.
    pub generation: u64,
    /// Number of pipeline stages (of one replica).
    pub stages: usize,
    /// Data-parallel replicas of the pipeline.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub replicas: usize,
    /// `nodes[w]` runs worker slot `w`: stage `w % stages` of replica `w / stages` (with one
    /// replica, `nodes[r]` runs stage `r`).
    pub nodes: Vec<NodeId>,
    /// The step the new pipeline starts from (a new plan only; absent when it starts fresh).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_from: Option<u64>,
    /// Where that state comes from, `peer` or `checkpoint` (a new plan only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<Tier>,
    /// Seconds the coordinator waited for enough nodes before it could adopt this plan (absent
    /// when it did not wait).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waited_for_nodes_s: Option<f64>,
}

impl PlanAdopted {
    /// `plan` as a run starts it: no resume point or tier yet (a caller recovering sets them).
    pub fn of(plan: &elastic::Plan) -> Self {
        Self {
            generation: plan.generation,
            stages: plan.num_stages(),
            replicas: plan.replicas,
            nodes: plan.stages.clone(),
            resume_from: None,
            tier: None,
            waited_for_nodes_s: None,
        }
    }
}

/// A node was lost: its agent or its worker died, hung or was cut off.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeLost {
    /// The lost node.
    pub node: NodeId,
    /// The step that was in progress.
    pub failed_step: u64,
    /// What happened, for people.
    pub reason: String,
    /// When the loss was detected (Unix seconds).
    pub detected_at_unix_s: f64,
    /// Whether the node's agent was still connected (only its worker was lost).
    pub agent_alive: bool,
    /// The lost stage, when it is replaced inside the step (mid-step recovery).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<usize>,
    /// `true` when the stage is replaced inside the step (mid-step recovery).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mid_step: Option<bool>,
}

/// A node left the plan at a step boundary after a preemption notice.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeLeft {
    /// The node that left.
    pub node: NodeId,
    /// The step at whose end it left.
    pub step: u64,
    /// Why it left, for people.
    pub reason: String,
}

/// A waiting node joined the plan at a step boundary.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeJoined {
    /// The node that joined.
    pub node: NodeId,
    /// The step at whose end it joined.
    pub step: u64,
}

/// This coordinator took the job over from a lost one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CoordinatorTakeover {
    /// The newest plan generation the lost coordinator had published.
    pub after_generation: u64,
    /// The newest committed checkpoint the run resumes from (`null` when there is none).
    #[serde(default)]
    pub resume_from: Option<u64>,
    /// When the takeover happened (Unix seconds).
    pub at_unix_s: f64,
}

/// The run resumed from a checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Resumed {
    /// The checkpoint's step.
    pub step: u64,
    /// Number of pipeline stages of the resumed run.
    pub stages: usize,
}

/// The run completed a step again after a failure or a plan change.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recovered {
    /// The first step completed after the recovery.
    pub step: u64,
    /// Seconds from the failure (or plan change) to the end of that step.
    pub recovery_s: f64,
    /// Completed steps that had to be computed again.
    pub lost_steps: u64,
    /// How the state was carried over: `peer`, `checkpoint`, `restart`, `handover` or
    /// `mid_step`.
    pub tier: Tier,
    /// Number of pipeline stages before.
    pub stages_before: usize,
    /// Number of pipeline stages after.
    pub stages_after: usize,
    /// When the recovery ended (Unix seconds).
    pub at_unix_s: f64,
    /// The replaced stage (mid-step recovery only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<usize>,
    /// The node that ran the replaced stage (mid-step recovery only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<NodeId>,
    /// The node that runs the replacement (mid-step recovery only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<NodeId>,
    /// Forward and backward units the replacement computed again (mid-step recovery only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redone_units: Option<usize>,
    /// Seconds of those units (mid-step recovery only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redone_s: Option<f64>,
}

/// A checkpoint was committed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointCommitted {
    /// The checkpoint's step.
    pub step: u64,
    /// Bytes of its shards.
    pub bytes: u64,
    /// Seconds from scheduling the uploads to the commit.
    pub upload_s: f64,
    /// The longest time a stage spent snapshotting its state for it (seconds).
    pub snapshot_s: f64,
}

/// Training waited for the previous checkpoint's upload before scheduling the next one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointWait {
    /// The step of the checkpoint about to be scheduled.
    pub step: u64,
    /// Seconds waited.
    pub waited_s: f64,
}

/// A checkpoint was abandoned (the previous committed one stays valid).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointFailed {
    /// The checkpoint's step.
    pub step: u64,
    /// The stage whose upload failed, when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage: Option<usize>,
    /// Why, for people.
    pub error: String,
}

impl RunEvent {
    /// The kind, as written in the `event` field.
    pub fn kind(&self) -> &'static str {
        match self {
            RunEvent::Plan(_) => "plan",
            RunEvent::NodeLost(_) => "node_lost",
            RunEvent::NodeLeft(_) => "node_left",
            RunEvent::NodeJoined(_) => "node_joined",
            RunEvent::CoordinatorTakeover(_) => "coordinator_takeover",
            RunEvent::Resumed(_) => "resumed",
            RunEvent::Recovered(_) => "recovered",
            RunEvent::Checkpoint(_) => "checkpoint",
            RunEvent::CheckpointWait(_) => "checkpoint_wait",
            RunEvent::CheckpointFailed(_) => "checkpoint_failed",
        }
    }

    /// The step the event belongs to: its `step`, or a lost node's `failed_step`; `None` for
    /// plans and takeovers.
    pub fn step(&self) -> Option<u64> {
        match self {
            RunEvent::Plan(_) | RunEvent::CoordinatorTakeover(_) => None,
            RunEvent::NodeLost(NodeLost { failed_step, .. }) => Some(*failed_step),
            RunEvent::NodeLeft(NodeLeft { step, .. })
            | RunEvent::NodeJoined(NodeJoined { step, .. })
            | RunEvent::Resumed(Resumed { step, .. })
            | RunEvent::Recovered(Recovered { step, .. })
            | RunEvent::Checkpoint(CheckpointCommitted { step, .. })
            | RunEvent::CheckpointWait(CheckpointWait { step, .. })
            | RunEvent::CheckpointFailed(CheckpointFailed { step, .. }) => Some(*step),
        }
    }
}

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    /// A training step's numbers.
    Step(StepMetrics),
    /// An event of this vocabulary.
    Event(RunEvent),
    /// Any other JSON object: an event kind (or shape) this version does not know, from an older
    /// or newer seqpipe, or a line that is neither an event nor a step record. Readers skip it or
    /// look at it through [`Record::event_name`].
    Other(Value),
}

impl Record {
    /// Parses one line: an object with an `event` field is a [`RunEvent`] when it is one of the
    /// vocabulary's, one with a `loss` a [`StepMetrics`] when it has a step record's fields; any
    /// other object is [`Record::Other`]. Fails on a line that is not a JSON object.
    pub fn parse(line: &str) -> Result<Record, serde_json::Error> {
        let value: Value = serde_json::from_str(line)?;
        if !value.is_object() {
            return Err(serde::de::Error::custom(format!(
                "expected a JSON object, found {value}"
            )));
        }
        let record = if value.get("event").is_some() {
            RunEvent::deserialize(&value).map(Record::Event)
        } else if value.get("loss").is_some() {
            StepMetrics::deserialize(&value).map(Record::Step)
        } else {
            return Ok(Record::Other(value));
        };
        Ok(record.unwrap_or(Record::Other(value)))
    }

    /// The step record, if this is one.
    pub fn as_step(&self) -> Option<&StepMetrics> {
        match self {
            Record::Step(s) => Some(s),
            _ => None,
        }
    }

    /// The event, if this is one of the vocabulary's.
    pub fn as_event(&self) -> Option<&RunEvent> {
        match self {
            Record::Event(e) => Some(e),
            _ => None,
        }
    }

    /// The `event` field of an event line, known kind or not.
    pub fn event_name(&self) -> Option<&str> {
        match self {
            Record::Event(e) => Some(e.kind()),
            Record::Other(v) => v.get("event").and_then(Value::as_str),
            Record::Step(_) => None,
        }
    }
}

/// Parses the lines of a `metrics.jsonl` text; lines that are not JSON objects (a line being
/// written, a truncated tail) are skipped.
pub fn parse_records(text: &str) -> Vec<Record> {
    text.lines().filter_map(|l| Record::parse(l).ok()).collect()
}

/// Reads a `metrics.jsonl` (see [`parse_records`]).
pub fn read_records(path: &Path) -> io::Result<Vec<Record>> {
    Ok(parse_records(&std::fs::read_to_string(path)?))
}

/// The step records of `records`, in file order.
pub fn steps(records: &[Record]) -> impl Iterator<Item = &StepMetrics> {
    records.iter().filter_map(Record::as_step)
}

/// The events of `records` that this vocabulary knows, in file order.
pub fn events(records: &[Record]) -> impl Iterator<Item = &RunEvent> {
    records.iter().filter_map(Record::as_event)
}

/// The last step recorded in a `metrics.jsonl` (0 if none, or if it cannot be read).
pub fn last_step(path: &Path) -> u64 {
    read_records(path)
        .unwrap_or_default()
        .iter()
        .filter_map(|r| r.as_step().map(|s| s.step))
        .max()
        .unwrap_or(0)
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str) -> NodeId {
        NodeId::new(id)
    }

    /// One value of every variant, optional fields both set and not.
    fn every_event() -> Vec<RunEvent> {
        vec![
            RunEvent::Plan(PlanAdopted {
                generation: 0,
                stages: 2,
                replicas: 1,
                nodes: vec![node("a"), node("b")],
                resume_from: None,
                tier: None,
                waited_for_nodes_s: None,
            }),
            RunEvent::Plan(PlanAdopted {
                generation: 2,
                stages: 1,
                replicas: 1,
                nodes: vec![node("b")],
                resume_from: Some(4),
                tier: Some(Tier::Checkpoint),
                waited_for_nodes_s: Some(1.5),
            }),
            RunEvent::NodeLost(NodeLost {
                node: node("a"),
                failed_step: 5,
                reason: "gone".into(),
                detected_at_unix_s: 1.5,
                agent_alive: false,
                stage: None,
                mid_step: None,
            }),
            RunEvent::NodeLost(NodeLost {
                node: node("a"),
                failed_step: 5,
                reason: "gone".into(),
                detected_at_unix_s: 1.5,
                agent_alive: true,
                stage: Some(1),
                mid_step: Some(true),
            }),
            RunEvent::NodeLeft(NodeLeft {
                node: node("a"),
                step: 6,
                reason: "preemption notice (SIGTERM)".into(),
            }),
            RunEvent::NodeJoined(NodeJoined {
                node: node("c"),
                step: 4,
            }),
            RunEvent::CoordinatorTakeover(CoordinatorTakeover {
                after_generation: 1,
                resume_from: None,
                at_unix_s: 2.0,
            }),
            RunEvent::CoordinatorTakeover(CoordinatorTakeover {
                after_generation: 1,
                resume_from: Some(4),
                at_unix_s: 2.0,
            }),
            RunEvent::Resumed(Resumed { step: 4, stages: 2 }),
            RunEvent::Recovered(Recovered {
                step: 5,
                recovery_s: 0.5,
                lost_steps: 1,
                tier: Tier::Peer,
                stages_before: 2,
                stages_after: 1,
                at_unix_s: 3.0,
                stage: None,
                node: None,
                host: None,
                redone_units: None,
                redone_s: None,
            }),
            RunEvent::Recovered(Recovered {
                step: 4,
                recovery_s: 0.25,
                lost_steps: 0,
                tier: Tier::MidStep,
                stages_before: 4,
                stages_after: 4,
                at_unix_s: 3.0,
                stage: Some(2),
                node: Some(node("b")),
                host: Some(node("a")),
                redone_units: Some(7),
                redone_s: Some(0.125),
            }),
            RunEvent::Checkpoint(CheckpointCommitted {
                step: 2,
                bytes: 100,
                upload_s: 0.5,
                snapshot_s: 0.25,
            }),
            RunEvent::CheckpointWait(CheckpointWait {
                step: 2,
                waited_s: 0.5,
            }),
            RunEvent::CheckpointFailed(CheckpointFailed {
                step: 2,
                stage: None,
                error: "abandoned".into(),
            }),
            RunEvent::CheckpointFailed(CheckpointFailed {
                step: 2,
                stage: Some(1),
                error: "disk full".into(),
            }),
        ]
    }

    #[test]
    fn every_variant_round_trips_through_json() {
        for event in every_event() {
            let line = serde_json::to_string(&event).unwrap();
            let value: Value = serde_json::from_str(&line).unwrap();
            assert_eq!(value["event"], event.kind(), "{line}");
            assert_eq!(serde_json::from_str::<RunEvent>(&line).unwrap(), event);
            assert_eq!(Record::parse(&line).unwrap(), Record::Event(event));
        }
    }

    #[test]
    fn optional_fields_are_left_out_when_unset() {
        let line = serde_json::to_string(&every_event()[2]).unwrap();
        assert!(
            !line.contains("stage") && !line.contains("mid_step"),
            "{line}"
        );
        // The takeover always says where it resumes from, `null` for nowhere.
        let line = serde_json::to_string(&every_event()[6]).unwrap();
        assert!(line.contains(r#""resume_from":null"#), "{line}");
    }

    /// Lines copied from `metrics.jsonl` files written before the events were typed.
    #[test]
    fn lines_of_older_files_parse_into_their_variants() {
        let lines = [
            r#"{"bytes":2660384,"event":"checkpoint","snapshot_s":0.000019178,"step":2,"upload_s":0.062309372}"#,
            r#"{"event":"checkpoint_wait","step":2,"waited_s":0.00225878}"#,
            r#"{"after_generation":1,"at_unix_s":1795445548.2000155,"event":"coordinator_takeover","resume_from":4}"#,
            r#"{"event":"node_joined","node":"spare-4","step":4}"#,
            r#"{"event":"node_left","node":"local-002","reason":"preemption notice (SIGTERM)","step":6}"#,
            r#"{"agent_alive":true,"detected_at_unix_s":1795442635.8141105,"event":"node_lost","failed_step":5,"mid_step":true,"node":"spare-4","reason":"stage 0 failed: connection closed: failed to fill whole buffer\n  (log: /tmp/goodput-try3-1/disturbed/logs/stage-0.log)","stage":0}"#,
            r#"{"agent_alive":false,"detected_at_unix_s":1795442632.2391026,"event":"node_lost","failed_step":6,"node":"local-001","reason":"its agent's connection closed (failed to fill whole buffer)"}"#,
            r#"{"event":"plan","generation":2,"nodes":["spare-2","spare-3"],"resume_from":4,"stages":2,"tier":"checkpoint"}"#,
            r#"{"event":"plan","generation":1,"nodes":["local-001"],"resume_from":null,"stages":1,"tier":"checkpoint"}"#,
            r#"{"event":"plan","generation":2,"nodes":["node-a","node-c"],"stages":2}"#,
            r#"{"at_unix_s":1795444154.5432048,"event":"recovered","host":"local-001","lost_steps":0,"node":"local-002","recovery_s":0.387494713,"redone_s":0.0,"redone_units":0,"stage":2,"stages_after":4,"stages_before":4,"step":4,"tier":"mid_step"}"#,
            r#"{"at_unix_s":1795442840.2413867,"event":"recovered","lost_steps":0,"recovery_s":60.064026364,"stages_after":2,"stages_before":2,"step":5,"tier":"checkpoint"}"#,
            r#"{"event":"resumed","stages":2,"step":4}"#,
            r#"{"error":"stage 1 was lost","event":"checkpoint_failed","step":3}"#,
        ];
        let kinds: Vec<&str> = lines
            .iter()
            .map(|l| match Record::parse(l).unwrap() {
                Record::Event(e) => e.kind(),
                other => panic!("{l} parsed as {other:?}"),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "checkpoint",
                "checkpoint_wait",
                "coordinator_takeover",
                "node_joined",
                "node_left",
                "node_lost",
                "node_lost",
                "plan",
                "plan",
                "plan",
                "recovered",
                "recovered",
                "resumed",
                "checkpoint_failed"
            ]
        );
        let Record::Event(RunEvent::NodeLost(NodeLost {
            node,
            failed_step: 5,
            stage: Some(0),
            mid_step: Some(true),
            agent_alive: true,
            ..
        })) = Record::parse(lines[5]).unwrap()
        else {
            panic!("{}", lines[5]);
        };
        assert_eq!(node.as_str(), "spare-4");
        let Record::Event(RunEvent::Recovered(Recovered {
            tier,
            redone_units: Some(0),
            host: Some(host),
            ..
        })) = Record::parse(lines[10]).unwrap()
        else {
            panic!("{}", lines[10]);
        };
        assert_eq!((tier, host.as_str()), (Tier::MidStep, "local-001"));
    }

    #[test]
    fn step_records_and_unknown_lines() {
        let step = r#"{"step":3,"retained_bytes":0,"peak_activation_bytes":[10,20],"state_bytes":[1,2],"units":8,"compute_s":0.1,"end_unix_s":5.0,"loss":2.5,"lr":0.001,"grad_norm":1.5,"tokens":64,"step_time_s":0.2,"tokens_per_s":320.0}"#;
        let Record::Step(s) = Record::parse(step).unwrap() else {
            panic!("{step}");
        };
        assert_eq!((s.step, s.loss, s.val_loss), (3, 2.5, None));
        // A step record from before the per-step units, compute and memory were recorded.
        let old = r#"{"step":1,"loss":4.0,"lr":0.001,"grad_norm":1.0,"tokens":64,"step_time_s":0.5,"tokens_per_s":128.0,"val_loss":3.9}"#;
        let Record::Step(s) = Record::parse(old).unwrap() else {
            panic!("{old}");
        };
        assert_eq!((s.step, s.units, s.val_loss), (1, 0, Some(3.9)));
        // Kinds (or shapes) this version does not know are kept, not errors.
        let unknown = Record::parse(r#"{"event":"solar_flare","step":2}"#).unwrap();
        assert!(matches!(unknown, Record::Other(_)));
        assert_eq!(unknown.event_name(), Some("solar_flare"));
        assert!(matches!(
            Record::parse(r#"{"event":"plan","generation":0}"#).unwrap(),
            Record::Other(_)
        ));
        assert!(Record::parse("[1]").is_err() && Record::parse("not json").is_err());
        let records = parse_records(&format!("{step}\n{{\"event\":\"x\"}}\n{{\"step\":4,\"lo"));
        assert_eq!(records.len(), 2);
        assert_eq!(steps(&records).count(), 1);
        assert_eq!(events(&records).count(), 0);
    }
}
