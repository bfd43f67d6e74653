//! `metrics.jsonl`: one JSON object per line — step records ([`StepMetrics`]) and events
//! ([`RunEvent`]) — appended and flushed as the run goes. The same records update the live
//! Prometheus metrics, when the run serves them.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use super::events::RunEvent;
use super::live_metrics::{LiveMetrics, unix_now_s};
use crate::metrics::StepMetrics;

/// Appends step records and events to a file, one JSON line each; every line written also
/// updates the [`LiveMetrics`] attached with [`MetricsLog::observed_by`], so the two cannot
/// disagree.
pub struct MetricsLog {
    path: PathBuf,
    file: File,
    live: Option<Arc<LiveMetrics>>,
}

impl MetricsLog {
    /// Opens (creating or appending to) `path`.
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            live: None,
        })
    }

    /// Feeds every record written from now on to `live` as well.
    pub fn observed_by(mut self, live: Option<Arc<LiveMetrics>>) -> Self {
        self.live = live;
        self
    }

    /// Appends a step's record and flushes it; then updates the live metrics.
    pub fn append_step(&mut self, record: &StepMetrics) -> io::Result<()> {
        self.write_line(record)?;
        if let Some(live) = &self.live {
            live.observe_step(record);
        }
        Ok(())
    }

    /// Appends an event and flushes it; then updates the live metrics.
    pub fn append_event(&mut self, event: &RunEvent) -> io::Result<()> {
        self.write_line(event)?;
        if let Some(live) = &self.live {
            live.observe_event(event, unix_now_s());
        }
        Ok(())
    }

    fn write_line(&mut self, record: &impl Serialize) -> io::Result<()> {
        let mut line = serde_json::to_vec(record).map_err(io::Error::other)?;
        line.push(b'\n');
        self.file.write_all(&line)?;
        self.file.flush()
    }

    /// The file written to.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
