//! Schedules for people: a text listing, an SVG timeline, and a JSON report.

use std::fmt::Write as _;

use serde_json::{Value, json};

use super::{Action, Op, Schedule, Simulation};

/// One line per stage with its compute actions in order, e.g.
/// `stage 0: F0.0 F0.1 F1.0 B0.1 …`. Communication actions are left out.
pub fn render_text(s: &Schedule) -> String {
    let mut out = String::new();
    for r in 0..s.actions.len() {
        let line: Vec<String> = s.compute_actions(r).map(|a| a.to_string()).collect();
        let _ = writeln!(out, "stage {r}: {}", line.join(" "));
    }
    out
}

/// Plot geometry of [`render_svg`], in pixels.
const LEFT: f64 = 70.0;
const TOP: f64 = 34.0;
const ROW: f64 = 28.0;
const GAP: f64 = 6.0;
const PLOT_WIDTH: f64 = 1000.0;
const RIGHT: f64 = 20.0;
const BOTTOM: f64 = 34.0;

/// A self-contained SVG timeline of `sim`: one row per stage, one rectangle per compute slot
/// (forwards blue, whole backwards orange, input halves `I` red, weight halves `W` green, shade
/// cycling with the micro-batch; a later chunk's forwards and backwards a little shifted in hue),
/// labelled `F0.1` / `F0.1@1` where the rectangle is wide enough, with a hover title giving start
/// and end times.
pub fn render_svg(s: &Schedule, sim: &Simulation) -> String {
    let p = sim.timeline.len();
    let scale = if sim.step_time > 0.0 {
        PLOT_WIDTH / sim.step_time
    } else {
        0.0
    };
    let width = LEFT + PLOT_WIDTH + RIGHT;
    let height = TOP + p as f64 * (ROW + GAP) + BOTTOM;
    let mut out = String::new();
    crate::svg::open(&mut out, width, height);
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="20" font-size="13">{}{} p={}{} m={} k={}: step time {:.2}, bubble {:.1}%</text>"#,
        s.kind,
        if s.forward_only {
            " (forward only)"
        } else {
            ""
        },
        s.stages,
        if s.virtual_stages > 1 {
            format!(" v={}", s.virtual_stages)
        } else {
            String::new()
        },
        s.microbatches,
        s.splits,
        sim.step_time,
        100.0 * sim.bubble_fraction
    );
    for (r, slots) in sim.timeline.iter().enumerate() {
        let y = TOP + r as f64 * (ROW + GAP);
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="end">stage {r}</text>"#,
            LEFT - 8.0,
            y + ROW / 2.0 + 4.0
        );
        let _ = writeln!(
            out,
            r##"<rect x="{LEFT}" y="{y:.1}" width="{PLOT_WIDTH}" height="{ROW}" fill="#f2f2f2"/>"##
        );
        for sl in slots {
            let x = LEFT + sl.start * scale;
            let w = (sl.end - sl.start) * scale;
            let (fill, text) = colors(sl.action);
            let label = sl.action.to_string();
            let _ = writeln!(
                out,
                r#"<rect x="{x:.2}" y="{y:.1}" width="{w:.2}" height="{ROW}" fill="{fill}" stroke="white" stroke-width="0.5"><title>{label} stage {r}: {:.3} .. {:.3}</title></rect>"#,
                sl.start, sl.end
            );
            // Monospace glyphs are about 0.6 em wide.
            let size = (w / (0.62 * label.len() as f64)).min(11.0);
            if size >= 6.0 {
                let _ = writeln!(
                    out,
                    r#"<text x="{:.2}" y="{:.1}" font-size="{size:.1}" text-anchor="middle" fill="{text}">{label}</text>"#,
                    x + w / 2.0,
                    y + ROW / 2.0 + size * 0.35
                );
            }
        }
    }
    let axis_y = TOP + p as f64 * (ROW + GAP) + 4.0;
    let _ = writeln!(
        out,
        r#"<line x1="{LEFT}" y1="{axis_y:.1}" x2="{:.1}" y2="{axis_y:.1}" stroke="black"/>"#,
        LEFT + PLOT_WIDTH
    );
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="{:.1}" font-size="11">0</text>"#,
        axis_y + 16.0
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" font-size="11" text-anchor="end">{:.2}</text>"#,
        LEFT + PLOT_WIDTH,
        axis_y + 16.0,
        sim.step_time
    );
    out.push_str("</svg>\n");
    out
}

/// Fill and text colour of a slot: forwards blue, backwards orange, four shades cycling with
/// the micro-batch so neighbouring micro-batches are told apart.
fn colors(a: Action) -> (String, &'static str) {
    let base = match a.op() {
        Op::Backward => 28,
        Op::BackwardInput => 0,
        Op::BackwardWeight => 130,
        _ => 212,
    };
    let hue = base + 24 * (a.chunk() % 3);
    let lightness = [38, 50, 62, 74][a.unit().micro_batch % 4];
    let text = if lightness < 56 { "white" } else { "black" };
    (format!("hsl({hue},70%,{lightness}%)"), text)
}

/// A JSON report of a schedule and its simulation.
///
/// Keys: `"schedule"` (kind), `"forward_only"`, `"stages_count"`, `"virtual_stages"`,
/// `"microbatches"`, `"splits"`,
/// `"bubble_fraction"`, `"step_time"`, `"segment_lengths"`, and `"stages"`: one object per stage
/// with `"stage"`, `"actions"` (all actions as strings, in order), `"busy"`,
/// `"bubble_fraction"`, `"peak_activation_tokens"`, `"peak_inflight_units"`.
pub fn report_json(s: &Schedule, sim: &Simulation, segment_lengths: &[usize]) -> Value {
    let stages: Vec<Value> = sim
        .stages
        .iter()
        .map(|st| {
            let actions: Vec<String> = s
                .actions
                .get(st.stage)
                .map(|v| v.iter().map(|a| a.to_string()).collect())
                .unwrap_or_default();
            json!({
                "stage": st.stage,
                "actions": actions,
                "busy": st.busy,
                "bubble_fraction": st.bubble_fraction,
                "peak_activation_tokens": st.peak_activation_tokens,
                "peak_inflight_units": st.peak_inflight_units,
            })
        })
        .collect();
    json!({
        "schedule": s.kind.as_str(),
        "forward_only": s.forward_only,
        "stages_count": s.stages,
        "virtual_stages": s.virtual_stages,
        "microbatches": s.microbatches,
        "splits": s.splits,
        "bubble_fraction": sim.bubble_fraction,
        "step_time": sim.step_time,
        "segment_lengths": segment_lengths,
        "stages": stages,
    })
}

#[cfg(test)]
mod tests {
    use super::super::{ScheduleKind, UnitCosts, generate, simulate};
    use super::*;

    #[test]
    fn text_is_one_line_per_stage() {
        let s = generate(ScheduleKind::Seq1F1B, 4, 3, 2).unwrap();
        let t = render_text(&s);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(
            lines[0],
            "stage 0: F0.0 F0.1 F1.0 F1.1 F2.0 B0.1 F2.1 B0.0 B1.1 B1.0 B2.1 B2.0"
        );
        assert!(!t.contains("RF") && !t.contains("SB"));
    }

    #[test]
    fn svg_has_one_rect_per_slot() {
        let s = generate(ScheduleKind::Seq1F1B, 3, 2, 2).unwrap();
        let sim = simulate(&s, &UnitCosts::uniform(2, 4)).unwrap();
        let svg = render_svg(&s, &sim);
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.trim_end().ends_with("</svg>"));
        let slots = sim.timeline.iter().map(Vec::len).sum::<usize>();
        assert_eq!(svg.matches("<title>").count(), slots);
        assert!(svg.contains(">F0.1</text>") && svg.contains(">B1.0</text>"));
        assert!(svg.contains("hsl(212") && svg.contains("hsl(28"));
    }

    #[test]
    fn svg_draws_chunks_and_split_backwards() {
        let s =
            super::super::generate_virtual(ScheduleKind::Seq1F1BInterleaved, 2, 2, 4, 2).unwrap();
        let sim = simulate(&s, &UnitCosts::uniform(2, 4)).unwrap();
        let svg = render_svg(&s, &sim);
        let slots = sim.timeline.iter().map(Vec::len).sum::<usize>();
        assert_eq!(slots, 2 * 2 * 4 * 2 * 2);
        assert_eq!(svg.matches("<title>").count(), slots);
        assert!(svg.contains("seq1f1b-i p=2 v=2 m=4 k=2"), "{svg}");
        assert!(svg.contains("<title>F0.1@1 stage 0") && svg.contains("<title>B3.0@1 stage 1"));
        let z = generate(ScheduleKind::Seq1F1BZeroBubble, 3, 2, 2).unwrap();
        let sim = simulate(&z, &UnitCosts::uniform(2, 4)).unwrap();
        let svg = render_svg(&z, &sim);
        assert!(svg.contains("<title>I1.0 stage 2") && svg.contains("<title>W1.0 stage 0"));
        // Input halves red, weight halves green.
        assert!(svg.contains("hsl(0,") && svg.contains("hsl(130,"));
    }

    #[test]
    fn report_has_the_documented_keys() {
        let s = generate(ScheduleKind::OneFOneB, 2, 2, 2).unwrap();
        let sim = simulate(&s, &UnitCosts::uniform(2, 4)).unwrap();
        let v = report_json(&s, &sim, &[8, 8]);
        for key in [
            "schedule",
            "stages_count",
            "virtual_stages",
            "microbatches",
            "splits",
            "bubble_fraction",
            "step_time",
            "segment_lengths",
            "stages",
        ] {
            assert!(v.get(key).is_some(), "missing {key}: {v}");
        }
        assert_eq!(v["schedule"], "1f1b");
        assert_eq!(v["segment_lengths"], json!([8, 8]));
        let st = &v["stages"][1];
        assert_eq!(st["stage"], 1);
        let actions: Vec<String> = st["actions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
        assert_eq!(actions.len(), s.actions[1].len());
        assert_eq!(actions[0], "RF0.0");
        for key in [
            "bubble_fraction",
            "peak_activation_tokens",
            "peak_inflight_units",
        ] {
            assert!(st.get(key).is_some(), "missing stages[].{key}");
        }
    }
}
