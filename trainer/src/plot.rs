//! `seqpipe plot`: a run's `metrics.jsonl` as a self-contained SVG picture: the training loss
//! per step (validation losses as dots) above the throughput in tokens per second, with the run's
//! events (nodes lost, recoveries, plan changes, ...) as labelled vertical lines across both.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::runtime::events::{Record, RunEvent};

/// Why a metrics file could not be plotted.
#[derive(Debug, Error)]
pub enum PlotError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A line is not a JSON object.
    #[error("{path}:{line}: not a JSON object: {detail}")]
    Parse {
        path: PathBuf,
        line: usize,
        detail: String,
    },
    /// No line is a step record.
    #[error(
        "{path} has no step records (lines with a step's numbers): is it a seqpipe metrics.jsonl?"
    )]
    NoSteps { path: PathBuf },
}

/// One step record's plotted numbers.
#[derive(Clone, Debug, PartialEq)]
pub struct StepPoint {
    /// The step (1-based).
    pub step: u64,
    /// Training loss.
    pub loss: f64,
    /// Validation loss, on steps where evaluation ran.
    pub val_loss: Option<f64>,
    /// Throughput.
    pub tokens_per_s: Option<f64>,
}

/// An event line, placed at a step.
#[derive(Clone, Debug, PartialEq)]
pub struct EventMark {
    /// Where it is drawn: its step (a lost node's `failed_step`), else the step of the last step
    /// record before it in the file.
    pub step: u64,
    /// The `event` field, e.g. `node_lost`.
    pub name: String,
}

/// What [`render_plot`] draws of a run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunMetrics {
    /// Step records, one per step (the last record of a step wins), in step order.
    pub steps: Vec<StepPoint>,
    /// Events, except routine checkpoint reports (`checkpoint`, `checkpoint_wait`).
    pub events: Vec<EventMark>,
}

/// Reads a `metrics.jsonl`; fails when it has no step record.
pub fn read_metrics(path: &Path) -> Result<RunMetrics, PlotError> {
    let text = std::fs::read_to_string(path).map_err(|source| PlotError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut steps = BTreeMap::new();
    let mut events = Vec::new();
    let mut last_step = 0;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parse_error = |detail: String| PlotError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            detail,
        };
        match Record::parse(line).map_err(|e| parse_error(e.to_string()))? {
            Record::Step(s) => {
                steps.insert(
                    s.step,
                    StepPoint {
                        step: s.step,
                        loss: s.loss,
                        val_loss: s.val_loss,
                        tokens_per_s: Some(s.tokens_per_s),
                    },
                );
                last_step = s.step;
            }
            Record::Event(e) => {
                // Checkpoint reports are too routine to draw.
                if !matches!(e, RunEvent::Checkpoint(_) | RunEvent::CheckpointWait(_)) {
                    events.push(EventMark {
                        step: e.step().unwrap_or(last_step),
                        name: e.kind().to_string(),
                    });
                }
            }
            // An event kind this version does not know is still drawn, after the last step.
            other => {
                if let Some(name) = other.event_name() {
                    events.push(EventMark {
                        step: last_step,
                        name: name.to_string(),
                    });
                }
            }
        }
    }
    if steps.is_empty() {
        return Err(PlotError::NoSteps {
            path: path.to_path_buf(),
        });
    }
    Ok(RunMetrics {
        steps: steps.into_values().collect(),
        events,
    })
}

/// Plot geometry of [`render_plot`], in pixels.
const LEFT: f64 = 80.0;
const TOP: f64 = 48.0;
const PLOT_WIDTH: f64 = 880.0;
const PANEL_HEIGHT: f64 = 240.0;
const PANEL_GAP: f64 = 56.0;
const RIGHT: f64 = 30.0;
const BOTTOM: f64 = 48.0;

const LOSS_COLOR: &str = "hsl(212,70%,45%)";
const VAL_COLOR: &str = "hsl(28,85%,50%)";
const THROUGHPUT_COLOR: &str = "hsl(140,55%,35%)";

/// A value range mapped onto a length in pixels, with its tick marks.
struct Scale {
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
    decimals: usize,
}

impl Scale {
    /// Ticks 1, 2 or 5 × 10ⁿ apart, about five of them; `round_out` widens the range to whole
    /// ticks, `integer` keeps ticks at least 1 apart.
    fn new(lo: f64, hi: f64, round_out: bool, integer: bool) -> Self {
        let (mut lo, mut hi) = (lo, hi);
        if hi <= lo {
            let pad = if lo == 0.0 { 1.0 } else { 0.1 * lo.abs() };
            (lo, hi) = (lo - pad, hi + pad);
        }
        let raw = (hi - lo) / 5.0;
        let magnitude = 10f64.powf(raw.log10().floor());
        let mut step = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .map(|f| f * magnitude)
            .find(|s| *s >= raw)
            .unwrap_or(10.0 * magnitude);
        if integer {
            step = step.max(1.0);
        }
        if round_out {
            lo = (lo / step).floor() * step;
            hi = (hi / step).ceil() * step;
        }
        let first = (lo / step - 1e-9).ceil() * step;
        let count = ((hi - first) / step + 1e-9).floor() as usize;
        let ticks = (0..=count).map(|i| first + i as f64 * step).collect();
        let decimals = if step >= 1.0 {
            0
        } else {
            (-step.log10() - 1e-9).ceil() as usize
        };
        Self {
            lo,
            hi,
            ticks,
            decimals,
        }
    }

    /// Where `v` falls on a length of `pixels`, from 0 at `lo` to `pixels` at `hi`.
    fn map(&self, v: f64, pixels: f64) -> f64 {
        (v - self.lo) / (self.hi - self.lo) * pixels
    }

    fn label(&self, v: f64) -> String {
        format!("{v:.*}", self.decimals)
    }
}

/// Escapes text for XML.
fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Colour of an event's line and label.
fn event_color(name: &str) -> &'static str {
    match name {
        "node_lost" | "node_left" | "checkpoint_failed" => "hsl(0,70%,45%)",
        "recovered" | "resumed" | "node_joined" => "hsl(140,55%,32%)",
        "plan" | "coordinator_takeover" => "hsl(280,45%,45%)",
        _ => "hsl(0,0%,40%)",
    }
}

/// A self-contained SVG picture of `m` titled `title`: the loss panel on top (training loss as a
/// line, validation losses as dots), the throughput panel below (one polyline point per step
/// with a `tokens_per_s`), both over the same step axis with tick labels, and each event a dashed
/// vertical line through both panels labelled with its name.
pub fn render_plot(m: &RunMetrics, title: &str) -> String {
    let width = LEFT + PLOT_WIDTH + RIGHT;
    let height = TOP + 2.0 * PANEL_HEIGHT + PANEL_GAP + BOTTOM;
    let frame = Frame::of(m);
    let mut out = String::new();
    crate::svg::open(&mut out, width, height);
    heading(&mut out, m, title);
    for (top, name, scale) in frame.panels() {
        axes(&mut out, top, name, scale, &frame.xs);
    }
    loss_series(&mut out, m, &frame);
    throughput_series(&mut out, m, &frame);
    event_marks(&mut out, m, &frame);
    out.push_str("</svg>\n");
    out
}

/// The scales of a plot: steps across (events included), loss and throughput up.
struct Frame {
    xs: Scale,
    loss: Scale,
    throughput: Scale,
}

/// The top of the throughput panel.
const THROUGHPUT_TOP: f64 = TOP + PANEL_HEIGHT + PANEL_GAP;

impl Frame {
    fn of(m: &RunMetrics) -> Self {
        let first = m.steps.first().map_or(0, |s| s.step);
        let last = m.steps.last().map_or(0, |s| s.step);
        let x_lo = m.events.iter().map(|e| e.step).fold(first, u64::min);
        let x_hi = m.events.iter().map(|e| e.step).fold(last, u64::max);
        let losses = m
            .steps
            .iter()
            .flat_map(|s| std::iter::once(s.loss).chain(s.val_loss));
        let (loss_lo, loss_hi) = losses.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
        let loss = if loss_lo <= loss_hi {
            Scale::new(loss_lo, loss_hi, true, false)
        } else {
            Scale::new(0.0, 1.0, true, false)
        };
        let throughput_hi = m
            .steps
            .iter()
            .filter_map(|s| s.tokens_per_s)
            .fold(0.0, f64::max);
        Self {
            xs: Scale::new(x_lo as f64, x_hi as f64, false, true),
            loss,
            throughput: Scale::new(0.0, throughput_hi, true, false),
        }
    }

    /// Each panel's top, name and value scale.
    fn panels(&self) -> [(f64, &'static str, &Scale); 2] {
        [
            (TOP, "loss", &self.loss),
            (THROUGHPUT_TOP, "tokens/s", &self.throughput),
        ]
    }

    /// The x coordinate of `step`.
    fn x(&self, step: u64) -> f64 {
        LEFT + self.xs.map(step as f64, PLOT_WIDTH)
    }

    /// The y coordinate of `v` on `scale` in the panel at `top`.
    fn y(top: f64, scale: &Scale, v: f64) -> f64 {
        top + PANEL_HEIGHT - scale.map(v, PANEL_HEIGHT)
    }
}

/// The title line (with the step count and final loss) and the legend.
fn heading(out: &mut String, m: &RunMetrics, title: &str) {
    let final_loss = m
        .steps
        .last()
        .map_or(String::new(), |s| format!(", final loss {:.4}", s.loss));
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="20" font-size="13">{}: {} steps{final_loss}</text>"#,
        escape(title),
        m.steps.len()
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="20" font-size="11" text-anchor="end"><tspan fill="{LOSS_COLOR}">— loss</tspan> <tspan fill="{VAL_COLOR}">● val_loss</tspan> <tspan fill="{THROUGHPUT_COLOR}">— tokens/s</tspan></text>"#,
        LEFT + PLOT_WIDTH
    );
}

/// The training loss as a line and the validation losses as dots, in the top panel.
fn loss_series(out: &mut String, m: &RunMetrics, f: &Frame) {
    let points: Vec<String> = m
        .steps
        .iter()
        .map(|s| format!("{:.2},{:.2}", f.x(s.step), Frame::y(TOP, &f.loss, s.loss)))
        .collect();
    let _ = writeln!(
        out,
        r#"<polyline class="loss" fill="none" stroke="{LOSS_COLOR}" stroke-width="1.5" points="{}"/>"#,
        points.join(" ")
    );
    for s in &m.steps {
        if let Some(v) = s.val_loss {
            let _ = writeln!(
                out,
                r#"<circle class="val_loss" cx="{:.2}" cy="{:.2}" r="3.5" fill="{VAL_COLOR}"><title>step {}: val_loss {v:.4}</title></circle>"#,
                f.x(s.step),
                Frame::y(TOP, &f.loss, v),
                s.step
            );
        }
    }
}

/// The throughput line (steps with a `tokens_per_s`) in the bottom panel.
fn throughput_series(out: &mut String, m: &RunMetrics, f: &Frame) {
    let points: Vec<String> = m
        .steps
        .iter()
        .filter_map(|s| {
            s.tokens_per_s.map(|v| {
                let y = Frame::y(THROUGHPUT_TOP, &f.throughput, v);
                format!("{:.2},{:.2}", f.x(s.step), y)
            })
        })
        .collect();
    let _ = writeln!(
        out,
        r#"<polyline class="tokens_per_s" fill="none" stroke="{THROUGHPUT_COLOR}" stroke-width="1.5" points="{}"/>"#,
        points.join(" ")
    );
}

/// Each event as a dashed line through both panels with its name; events at the same step get
/// their labels side by side.
fn event_marks(out: &mut String, m: &RunMetrics, f: &Frame) {
    let top = THROUGHPUT_TOP;
    let mut at_step: BTreeMap<u64, usize> = BTreeMap::new();
    for e in &m.events {
        let nth = at_step.entry(e.step).or_default();
        let (ex, color, name) = (f.x(e.step), event_color(&e.name), escape(&e.name));
        let _ = writeln!(
            out,
            r#"<path class="event" d="M{ex:.2} {TOP} V{:.1} M{ex:.2} {top:.1} V{:.1}" stroke="{color}" stroke-dasharray="4 3"><title>{name} at step {}</title></path>"#,
            TOP + PANEL_HEIGHT,
            top + PANEL_HEIGHT,
            e.step
        );
        let lx = ex + 11.0 * (*nth as f64 + 1.0);
        let ly = TOP + 4.0;
        let _ = writeln!(
            out,
            r#"<text x="{lx:.2}" y="{ly:.1}" font-size="10" fill="{color}" text-anchor="end" transform="rotate(-90 {lx:.2} {ly:.1})">{name}</text>"#
        );
        *nth += 1;
    }
}

/// A panel's frame, grid lines and tick labels (values on the left, steps below) and its name.
fn axes(out: &mut String, top: f64, name: &str, ys: &Scale, xs: &Scale) {
    let bottom = top + PANEL_HEIGHT;
    let _ = writeln!(
        out,
        r##"<rect x="{LEFT}" y="{top:.1}" width="{PLOT_WIDTH}" height="{PANEL_HEIGHT}" fill="#fafafa" stroke="black"/>"##
    );
    for &v in &ys.ticks {
        let ty = bottom - ys.map(v, PANEL_HEIGHT);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{ty:.2}" x2="{:.1}" y2="{ty:.2}" stroke="#e0e0e0"/>"##,
            LEFT + PLOT_WIDTH
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.2}" font-size="11" text-anchor="end">{}</text>"#,
            LEFT - 6.0,
            ty + 4.0,
            ys.label(v)
        );
    }
    for &v in &xs.ticks {
        let tx = LEFT + xs.map(v, PLOT_WIDTH);
        let _ = writeln!(
            out,
            r#"<line x1="{tx:.2}" y1="{bottom:.1}" x2="{tx:.2}" y2="{:.1}" stroke="black"/>"#,
            bottom + 5.0
        );
        let _ = writeln!(
            out,
            r#"<text x="{tx:.2}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
            bottom + 18.0,
            xs.label(v)
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">step</text>"#,
        LEFT + PLOT_WIDTH,
        bottom + 34.0
    );
    let (nx, ny) = (18.0, top + PANEL_HEIGHT / 2.0);
    let _ = writeln!(
        out,
        r#"<text x="{nx}" y="{ny:.1}" font-size="12" text-anchor="middle" transform="rotate(-90 {nx} {ny:.1})">{name}</text>"#
    );
}

#[cfg(test)]
mod tests {
    use elastic::NodeId;

    use super::*;
    use crate::runtime::events::{CheckpointCommitted, NodeLost, PlanAdopted, Recovered};

    fn point(step: u64, loss: f64, val_loss: Option<f64>) -> StepPoint {
        StepPoint {
            step,
            loss,
            val_loss,
            tokens_per_s: Some(1000.0 + step as f64),
        }
    }

    fn event(e: RunEvent) -> String {
        serde_json::to_string(&e).unwrap()
    }

    fn plan(generation: u64, nodes: &[&str]) -> RunEvent {
        RunEvent::Plan(PlanAdopted {
            generation,
            stages: nodes.len(),
            replicas: 1,
            nodes: nodes.iter().map(|&n| NodeId::new(n)).collect(),
            resume_from: None,
            tier: None,
            waited_for_nodes_s: None,
        })
    }

    fn step(step: u64, loss: f64, tokens_per_s: f64, val_loss: Option<f64>) -> String {
        serde_json::to_string(&crate::metrics::StepMetrics {
            step,
            retained_bytes: 0,
            peak_activation_bytes: vec![],
            state_bytes: vec![],
            units: 4,
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
            end_unix_s: step as f64,
            loss,
            lr: 1e-3,
            grad_norm: 1.0,
            tokens: 64,
            step_time_s: 0.2,
            tokens_per_s,
            val_loss,
        })
        .unwrap()
    }

    #[test]
    fn reads_steps_and_places_events() {
        let dir = std::env::temp_dir().join(format!("seqpipe-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("metrics.jsonl");
        std::fs::write(
            &path,
            [
                event(plan(0, &["a", "b"])),
                step(1, 4.0, 10.0, None),
                event(RunEvent::Checkpoint(CheckpointCommitted {
                    step: 1,
                    bytes: 10,
                    upload_s: 0.5,
                    snapshot_s: 0.25,
                })),
                step(2, 3.0, 12.0, Some(3.5)),
                event(RunEvent::NodeLost(NodeLost {
                    node: NodeId::new("b"),
                    failed_step: 3,
                    reason: "gone".into(),
                    detected_at_unix_s: 5.0,
                    agent_alive: false,
                    stage: None,
                    mid_step: None,
                })),
                event(plan(1, &["a"])),
                step(3, 2.5, 9.0, None),
                event(RunEvent::Recovered(Recovered {
                    step: 3,
                    recovery_s: 1.0,
                    lost_steps: 0,
                    tier: crate::runtime::recovery::Tier::Checkpoint,
                    stages_before: 2,
                    stages_after: 1,
                    at_unix_s: 6.0,
                    stage: None,
                    node: None,
                    host: None,
                    redone_units: None,
                    redone_s: None,
                })),
                r#"{"event":"solar_flare","step":3}"#.into(),
                String::new(),
            ]
            .join("\n"),
        )
        .unwrap();
        let m = read_metrics(&path).unwrap();
        assert_eq!(m.steps.len(), 3);
        assert_eq!(m.steps[1].val_loss, Some(3.5));
        let events: Vec<(u64, &str)> = m.events.iter().map(|e| (e.step, &*e.name)).collect();
        assert_eq!(
            events,
            [
                (0, "plan"),
                (3, "node_lost"),
                (2, "plan"),
                (3, "recovered"),
                (3, "solar_flare")
            ]
        );
        std::fs::write(&path, "{\"event\":\"plan\"}\n").unwrap();
        assert!(matches!(
            read_metrics(&path),
            Err(PlotError::NoSteps { .. })
        ));
        std::fs::write(&path, "{\"step\":1,\"loss\":1.0}\nnot json\n").unwrap();
        let e = read_metrics(&path).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl:2"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn svg_has_both_curves_ticks_and_labelled_events() {
        let m = RunMetrics {
            steps: (1..=7)
                .map(|s| point(s, 5.0 - s as f64 * 0.3, (s == 4).then_some(4.0)))
                .collect(),
            events: vec![
                EventMark {
                    step: 4,
                    name: "node_lost".into(),
                },
                EventMark {
                    step: 4,
                    name: "recovered".into(),
                },
            ],
        };
        let svg = render_plot(&m, "seqpipe runs/<a&b>");
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("seqpipe runs/&lt;a&amp;b&gt;: 7 steps"));
        for class in ["loss", "tokens_per_s"] {
            let line = svg
                .lines()
                .find(|l| l.starts_with(&format!("<polyline class=\"{class}\"")))
                .unwrap();
            let points = line.split("points=\"").nth(1).unwrap();
            assert_eq!(points.split_whitespace().count(), 7, "{line}");
        }
        assert_eq!(svg.matches("<circle class=\"val_loss\"").count(), 1);
        assert_eq!(svg.matches("<path class=\"event\"").count(), 2);
        assert!(svg.contains(">node_lost</text>") && svg.contains(">recovered</text>"));
        assert!(svg.contains(">tokens/s</text>") && svg.contains(">step</text>"));
    }

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        let s = Scale::new(2.37, 4.91, true, false);
        assert_eq!((s.lo, s.hi), (2.0, 5.0));
        assert_eq!(s.ticks, [2.0, 3.0, 4.0, 5.0]);
        let fine = Scale::new(0.12, 0.31, true, false);
        let labels: Vec<String> = fine.ticks.iter().map(|&v| fine.label(v)).collect();
        assert_eq!(labels, ["0.10", "0.15", "0.20", "0.25", "0.30", "0.35"]);
        let steps = Scale::new(1.0, 3.0, false, true);
        assert_eq!(steps.ticks, [1.0, 2.0, 3.0]);
        assert_eq!(steps.label(2.0), "2");
        let flat = Scale::new(7.0, 7.0, true, false);
        assert!(flat.lo < 7.0 && flat.hi > 7.0);
    }
}
