//! `seqpipe train --trace FILE`: when every compute unit of every stage ran, as a Chrome trace
//! (`chrome://tracing`, <https://ui.perfetto.dev>).
//!
//! The file is one JSON object `{"traceEvents": [...], "displayTimeUnit": "ms"}`. All events
//! belong to process `pid` 1, named after the run directory. Thread (track) 0 is the coordinator,
//! with one complete slice per step (`step N`: forward, backward and update) and one per
//! evaluation (`eval`); thread `w + 1` is worker slot `w` (stage `w % p` of replica `w / p`; with
//! one replica, stage `w`), with one complete slice per forward or backward unit, named `F0.1` /
//! `B0.1` (micro-batch.segment, the micro-batch counted within the replica; `args.len`: the
//! segment's length in tokens per row, so the trace records each micro-batch's segment lengths,
//! its own with `pipeline.partition = "documents"`), and with replicas one
//! slice `reduce` (category `reduce`, `args.bytes` sent) per step for the gradient all-reduce.
//! Slices are `"ph": "X"` events with
//! `ts` (microseconds since the Unix epoch, so that the stages' processes line up) and `dur`
//! (microseconds), and `args` holding at least the `step` (units also `cpu_us`, the worker
//! process's CPU time during the unit). `"ph": "M"` metadata events name the
//! process and the threads and order the tracks.

use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::control::UnitTime;
use crate::schedule::Op;

/// The trace's only process id.
const PID: u32 = 1;
/// The coordinator's thread id; stage `r` is thread `r + 1`.
const COORDINATOR_TID: usize = 0;

/// Microseconds since the Unix epoch (wall clock).
pub fn unix_time_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Wall-clock time in seconds, for events that outside observers (the recovery benchmark) line
/// up with theirs.
pub fn unix_time_s() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The slices of a run, collected as its steps finish and written once at the end.
#[derive(Debug)]
pub struct TraceLog {
    path: PathBuf,
    title: String,
    stages: BTreeSet<usize>,
    slices: Vec<Value>,
}

impl TraceLog {
    /// An empty trace to be written to `path`, its process named `title`.
    pub fn new(path: PathBuf, title: String) -> Self {
        Self {
            path,
            title,
            stages: BTreeSet::new(),
            slices: Vec::new(),
        }
    }

    /// The file the trace is written to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Adds the units stage `stage` computed in step `step`.
    pub fn units(&mut self, stage: usize, step: u64, times: &[UnitTime]) {
        self.stages.insert(stage);
        for t in times {
            let cat = if t.action.op() == Op::Forward {
                "forward"
            } else {
                "backward"
            };
            let mut args = json!({"step": step, "cpu_us": t.cpu_us, "len": t.len});
            if t.redone {
                args["redone"] = json!(true);
            }
            self.slices.push(json!({
                "name": t.action.to_string(),
                "cat": cat,
                "ph": "X",
                "ts": t.start_us,
                "dur": t.dur_us,
                "pid": PID,
                "tid": stage + 1,
                "args": args,
            }));
        }
    }

    /// Adds worker slot `slot`'s gradient reduction of step `step`: from `start_us` for `dur_us`,
    /// `bytes` sent.
    pub fn reduction(&mut self, slot: usize, step: u64, start_us: u64, dur_us: u64, bytes: u64) {
        self.stages.insert(slot);
        self.slices.push(json!({
            "name": "reduce",
            "cat": "reduce",
            "ph": "X",
            "ts": start_us,
            "dur": dur_us,
            "pid": PID,
            "tid": slot + 1,
            "args": {"step": step, "bytes": bytes},
        }));
    }

    /// Adds a slice of the coordinator's track: `name` from `start_us` for `dur_us`, with `args`
    /// (an object; `step` is added).
    pub fn coordinator(&mut self, name: &str, step: u64, start_us: u64, dur_us: u64, args: Value) {
        let mut args = args;
        args["step"] = json!(step);
        self.slices.push(json!({
            "name": name,
            "cat": "coordinator",
            "ph": "X",
            "ts": start_us,
            "dur": dur_us,
            "pid": PID,
            "tid": COORDINATOR_TID,
            "args": args,
        }));
    }

    /// The trace as one JSON object (see the module documentation).
    pub fn to_json(&self) -> Value {
        let thread = |tid: usize, name: String| {
            [
                json!({"ph": "M", "name": "thread_name", "pid": PID, "tid": tid, "args": {"name": name}}),
                json!({"ph": "M", "name": "thread_sort_index", "pid": PID, "tid": tid, "args": {"sort_index": tid}}),
            ]
        };
        let mut events = vec![
            json!({"ph": "M", "name": "process_name", "pid": PID, "tid": COORDINATOR_TID, "args": {"name": self.title}}),
        ];
        events.extend(thread(COORDINATOR_TID, "coordinator".into()));
        for &r in &self.stages {
            events.extend(thread(r + 1, format!("stage {r}")));
        }
        events.extend(self.slices.iter().cloned());
        json!({"traceEvents": events, "displayTimeUnit": "ms"})
    }

    /// Writes the trace to its file.
    pub fn write(&self) -> io::Result<()> {
        let text = serde_json::to_vec(&self.to_json()).map_err(io::Error::other)?;
        std::fs::write(&self.path, text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::{Action, Unit};

    #[test]
    fn units_become_named_slices_on_their_stage_track() {
        let mut trace = TraceLog::new(PathBuf::from("t.json"), "seqpipe runs/x".into());
        let unit = |mb, seg, op, chunk, start_us, redone| UnitTime {
            action: Action::new(op, Unit::new(mb, seg), chunk),
            start_us,
            dur_us: 5,
            cpu_us: 4,
            redone,
            len: 8 + seg,
        };
        trace.units(
            1,
            3,
            &[
                unit(0, 1, Op::Forward, 0, 100, false),
                unit(0, 1, Op::Backward, 0, 110, true),
                unit(2, 0, Op::BackwardInput, 1, 120, false),
                unit(2, 0, Op::BackwardWeight, 0, 130, false),
            ],
        );
        trace.coordinator("step 3", 3, 90, 40, json!({"loss": 2.5}));
        let v = trace.to_json();
        let events = v["traceEvents"].as_array().unwrap();
        let slices: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(slices.len(), 5);
        assert_eq!(slices[0]["name"], "F0.1");
        assert_eq!(slices[0]["tid"], 2);
        assert_eq!(slices[0]["args"], json!({"step": 3, "cpu_us": 4, "len": 9}));
        assert_eq!(slices[1]["name"], "B0.1");
        assert_eq!(slices[1]["args"]["redone"], true);
        assert_eq!(slices[2]["name"], "I2.0@1");
        assert_eq!(slices[2]["cat"], "backward");
        assert_eq!(slices[3]["name"], "W2.0");
        assert_eq!(slices[3]["cat"], "backward");
        assert_eq!(slices[4]["tid"], 0);
        assert_eq!(slices[4]["args"], json!({"step": 3, "loss": 2.5}));
        let names: Vec<&Value> = events
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .map(|e| &e["args"]["name"])
            .collect();
        assert_eq!(names, [&json!("coordinator"), &json!("stage 1")]);
    }
}
