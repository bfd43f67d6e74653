//! A timing and memory model of a schedule: when each compute action runs, how idle each stage
//! is (the bubble), and how many activations each stage holds at its peak.
//!
//! Model: communication is free; a compute action starts when its stage is free and its
//! cross-stage input exists (`F(u)` on virtual stage s>0 after `F(u)` ends on s−1; a backward
//! `B(u)` or `I(u)` on s < p·v−1 after the backward of u ends on s+1; `W(u)` needs nothing from
//! other stages). Costs for segment j: `F` takes `costs.forward[j] / v`, `B` takes
//! `costs.backward[j] / v`, and the halves `I` and `W` take half of that each (the zero-bubble
//! papers' T_B = T_W: each is one matmul per weight); a chunk holds 1/v of a stage's layers.
//! Unit (i,j) on a chunk holds `costs.tokens[j]` tokens of the chunk's activations from the start
//! of its `F` to the end of its `B` — or of its `W`, which needs the saved inputs and output
//! gradients; in a forward-only schedule until the end of the micro-batch's last segment's
//! forward on that chunk (its K/V prefix is kept for the later segments). With v chunks a
//! token counted here is 1/v of a whole stage's activations per token.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::segments::{FlopsModel, segment_flops};
use super::{Action, Op, Schedule, ScheduleError, ScheduleKind, UnitBytes, validate};

/// Per-segment costs of one unit (a micro-batch's segment j), for [`simulate`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnitCosts {
    /// Forward time of a unit of segment j (any consistent time unit).
    pub forward: Vec<f64>,
    /// Backward time of a unit of segment j.
    pub backward: Vec<f64>,
    /// Activation tokens a unit of segment j keeps alive (`segment_len · micro_batch_size`).
    pub tokens: Vec<usize>,
}

impl UnitCosts {
    /// Equal-cost segments: forward 1, backward 2, `tokens_per_segment` tokens each.
    pub fn uniform(splits: usize, tokens_per_segment: usize) -> Self {
        UnitCosts {
            forward: vec![1.0; splits],
            backward: vec![2.0; splits],
            tokens: vec![tokens_per_segment; splits],
        }
    }

    /// Costs from the FLOPs model: forward of segment j = [`segment_flops`] of its position in
    /// the sequence (scaled so that the mean forward is 1), backward = 2 × forward, tokens =
    /// `segment_lengths[j] · micro_batch_size`.
    pub fn from_flops(segment_lengths: &[usize], micro_batch_size: usize, m: &FlopsModel) -> Self {
        let mut start = 0;
        let flops: Vec<f64> = segment_lengths
            .iter()
            .map(|&len| {
                let f = segment_flops(start, len, m);
                start += len;
                f
            })
            .collect();
        let mean = flops.iter().sum::<f64>() / flops.len().max(1) as f64;
        let scale = if mean > 0.0 { 1.0 / mean } else { 0.0 };
        let forward: Vec<f64> = flops.iter().map(|f| f * scale).collect();
        UnitCosts {
            backward: forward.iter().map(|f| 2.0 * f).collect(),
            forward,
            tokens: segment_lengths
                .iter()
                .map(|&l| l * micro_batch_size)
                .collect(),
        }
    }
}

/// Per-stage results of a simulation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageStats {
    /// Stage index.
    pub stage: usize,
    /// Total compute time of the stage.
    pub busy: f64,
    /// `1 − busy / step_time`: the fraction of the step this stage is idle.
    pub bubble_fraction: f64,
    /// Maximum over time of the summed `tokens[j]` of the units alive on this stage.
    pub peak_activation_tokens: usize,
    /// Maximum over time of the number of units alive on this stage.
    pub peak_inflight_units: usize,
}

/// One compute action placed in time.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slot {
    /// The compute action (`Forward` or `Backward`).
    pub action: Action,
    /// Start time.
    pub start: f64,
    /// End time.
    pub end: f64,
}

/// The result of [`simulate`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Simulation {
    /// Time from the first start (0) to the last end over all stages.
    pub step_time: f64,
    /// `1 − total busy / (p · step_time)` (0 when the step takes no time).
    pub bubble_fraction: f64,
    /// One entry per stage.
    pub stages: Vec<StageStats>,
    /// `timeline[r]`: stage r's compute slots, in execution order.
    pub timeline: Vec<Vec<Slot>>,
}

/// Measured compute time of every forward and backward of one step, per stage (from a real
/// run), for [`replay`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MeasuredCosts {
    /// `durations[r][action]`: stage r's time for the compute action.
    pub durations: Vec<HashMap<Action, f64>>,
    /// Activation tokens a unit of segment j keeps alive (for the token peaks).
    pub tokens: Vec<usize>,
}

/// Simulates `s` under `costs` (see the module docs for the model).
///
/// Validates the schedule first; errors with [`ScheduleError::InvalidCosts`] when a cost vector's
/// length is not `s.splits` or a cost is negative or not finite.
pub fn simulate(s: &Schedule, costs: &UnitCosts) -> Result<Simulation, ScheduleError> {
    validate(s)?;
    check_costs(costs, s.splits)?;
    let v = s.virtual_stages as f64;
    place(s, &costs.tokens, |_, a| {
        let j = a.unit().segment;
        match a.op() {
            Op::Forward => costs.forward[j] / v,
            Op::Backward => costs.backward[j] / v,
            _ => costs.backward[j] / (2.0 * v),
        }
    })
}

/// Replays `s` with measured per-stage unit times: what the step would take, and how idle each
/// stage would be, on `s.stages` dedicated devices with free communication.
///
/// Errors with [`ScheduleError::InvalidCosts`] when a compute action of the schedule has no
/// measured time, a time is negative or not finite, or `costs` has the wrong number of stages
/// or segments.
pub fn replay(s: &Schedule, costs: &MeasuredCosts) -> Result<Simulation, ScheduleError> {
    validate(s)?;
    let invalid = |why: String| Err(ScheduleError::InvalidCosts(why));
    if costs.durations.len() != s.stages || costs.tokens.len() != s.splits {
        return invalid(format!(
            "measured costs for {} stages and {} segments, the schedule has {} and {}",
            costs.durations.len(),
            costs.tokens.len(),
            s.stages,
            s.splits
        ));
    }
    for r in 0..s.stages {
        for a in s.compute_actions(r) {
            match costs.durations[r].get(&a) {
                Some(t) if t.is_finite() && *t >= 0.0 => {}
                Some(t) => return invalid(format!("stage {r}: {a} took {t}")),
                None => return invalid(format!("stage {r}: no measured time for {a}")),
            }
        }
    }
    place(s, &costs.tokens, |r, a| costs.durations[r][&a])
}

/// Places every compute action in time (`duration(stage, action)`), then derives the stats.
fn place(
    s: &Schedule,
    tokens: &[usize],
    duration: impl Fn(usize, Action) -> f64,
) -> Result<Simulation, ScheduleError> {
    let (p, k, v) = (s.stages, s.splits, s.virtual_stages);
    let n = s.microbatches * k;
    let idx = |a: Action| a.unit().micro_batch * k + a.unit().segment;
    let virtual_stage = |r: usize, a: Action| a.chunk() * p + r;

    let compute: Vec<Vec<Action>> = (0..p).map(|r| s.compute_actions(r).collect()).collect();
    // End times per virtual stage and unit: forward, and the backward that sends the input
    // gradient on (`B` or `I`).
    let mut fwd_end: Vec<Vec<Option<f64>>> = vec![vec![None; n]; p * v];
    let mut bwd_end: Vec<Vec<Option<f64>>> = vec![vec![None; n]; p * v];
    let mut timeline: Vec<Vec<Slot>> = vec![Vec::new(); p];
    let mut free = vec![0.0f64; p];
    let mut next = vec![0usize; p];
    loop {
        let mut progressed = false;
        for r in 0..p {
            while let Some(&a) = compute[r].get(next[r]) {
                let vs = virtual_stage(r, a);
                let ready = match a.op() {
                    Op::Forward if vs > 0 => fwd_end[vs - 1][idx(a)],
                    Op::Backward | Op::BackwardInput if vs + 1 < p * v => bwd_end[vs + 1][idx(a)],
                    _ => Some(0.0),
                };
                let Some(ready) = ready else { break };
                let start = free[r].max(ready);
                let end = start + duration(r, a);
                match a.op() {
                    Op::Forward => fwd_end[vs][idx(a)] = Some(end),
                    Op::Backward | Op::BackwardInput => bwd_end[vs][idx(a)] = Some(end),
                    _ => {}
                }
                timeline[r].push(Slot {
                    action: a,
                    start,
                    end,
                });
                free[r] = end;
                next[r] += 1;
                progressed = true;
            }
        }
        if (0..p).all(|r| next[r] == compute[r].len()) {
            break;
        }
        if !progressed {
            // `validate` rules this out; keep the simulator total anyway.
            return Err(ScheduleError::Deadlock {
                steps: 0,
                blocked: "timing simulation stalled on a schedule that passed validation".into(),
                grid: String::new(),
            });
        }
    }

    let step_time = timeline
        .iter()
        .flatten()
        .map(|sl| sl.end)
        .fold(0.0f64, f64::max);
    let idle = |busy: f64| {
        if step_time > 0.0 {
            1.0 - busy / step_time
        } else {
            0.0
        }
    };
    let stages: Vec<StageStats> = (0..p)
        .map(|r| {
            let busy: f64 = timeline[r].iter().map(|sl| sl.end - sl.start).sum();
            let (peak_activation_tokens, peak_inflight_units) =
                peak_memory(s, tokens, &timeline[r]);
            StageStats {
                stage: r,
                busy,
                bubble_fraction: idle(busy),
                peak_activation_tokens,
                peak_inflight_units,
            }
        })
        .collect();
    let total_busy: f64 = stages.iter().map(|st| st.busy).sum();
    let bubble_fraction = if step_time > 0.0 {
        1.0 - total_busy / (p as f64 * step_time)
    } else {
        0.0
    };
    Ok(Simulation {
        step_time,
        bubble_fraction,
        stages,
        timeline,
    })
}

/// The bubble fraction each kind's formula predicts for equal-cost units, p stages, v chunks,
/// m micro-batches and k segments: `(p−1)/(n + p−1)` with n the number of pipeline "slots" a
/// stage fills — m for `1f1b`, m·k for `seq1f1b` and `gpipe` (whose units stream), v·m for
/// `1f1b-i`, v·m·k for `seq1f1b-i` — and for `seq1f1b-zb` ZB-H1's `(p−1)·T_F` idle against
/// `m·k·(T_F + T_I + T_W)` busy with T_F = T_I = T_W: `(p−1)/(3·m·k + p−1)`, a third of
/// Seq1F1B's idle (every stage may hold the first stage's Seq1F1B peak; when m·k < p + k − 1
/// the first stage cannot hold that many and the order idles more).
pub fn formula_bubble(kind: ScheduleKind, p: usize, v: usize, m: usize, k: usize) -> f64 {
    let (p, v, m, k) = (p as f64, v as f64, m as f64, k as f64);
    let slots = match kind {
        ScheduleKind::OneFOneB => m,
        ScheduleKind::GPipe | ScheduleKind::Seq1F1B => m * k,
        ScheduleKind::OneFOneBInterleaved => v * m,
        ScheduleKind::Seq1F1BInterleaved => v * m * k,
        ScheduleKind::Seq1F1BZeroBubble => 3.0 * m * k,
    };
    (p - 1.0) / (slots + p - 1.0)
}

fn check_costs(costs: &UnitCosts, splits: usize) -> Result<(), ScheduleError> {
    for (name, len) in [
        ("forward", costs.forward.len()),
        ("backward", costs.backward.len()),
        ("tokens", costs.tokens.len()),
    ] {
        if len != splits {
            return Err(ScheduleError::InvalidCosts(format!(
                "{name} has {len} entries, the schedule has {splits} segments"
            )));
        }
    }
    for (name, v) in [("forward", &costs.forward), ("backward", &costs.backward)] {
        if let Some((j, c)) = v
            .iter()
            .enumerate()
            .find(|(_, c)| !c.is_finite() || **c < 0.0)
        {
            return Err(ScheduleError::InvalidCosts(format!(
                "{name}[{j}] = {c} (costs must be finite and non-negative)"
            )));
        }
    }
    Ok(())
}

impl Simulation {
    /// Per stage, the most activation bytes alive at once on its timeline, each unit sized by
    /// `bytes` (alive as for the token peaks, see the module docs); `s` is the schedule this
    /// simulation placed. Errors with [`ScheduleError::InvalidParameters`] when `bytes` does not
    /// size `s`'s stages and segments, or `s` has chunks (the model sizes whole stages).
    pub fn peak_bytes(&self, s: &Schedule, bytes: &UnitBytes) -> Result<Vec<u64>, ScheduleError> {
        bytes.check_shape(s.stages, s.splits)?;
        if s.virtual_stages != 1 {
            return Err(ScheduleError::InvalidParameters(format!(
                "the unit byte model sizes whole stages, the schedule has {} chunks per stage",
                s.virtual_stages
            )));
        }
        Ok(self
            .timeline
            .iter()
            .enumerate()
            .map(|(r, slots)| {
                let size = |a: Action| i128::from(bytes.of(r, a.unit()));
                peak_live(s, slots, size) as u64
            })
            .collect())
    }
}

/// Peak (tokens, units) alive on one stage, from its timeline (see [`peak_live`]).
fn peak_memory(s: &Schedule, tokens: &[usize], slots: &[Slot]) -> (usize, usize) {
    let tokens = peak_live(s, slots, |a| tokens[a.unit().segment] as i128);
    (tokens as usize, peak_live(s, slots, |_| 1) as usize)
}

/// The most of `size` alive at once on one stage, from its timeline: a unit on a chunk is alive
/// from the start of its `F` to the end of its `B` or `W` (see the module docs).
fn peak_live(s: &Schedule, slots: &[Slot], size: impl Fn(Action) -> i128) -> i128 {
    let (k, m) = (s.splits, s.microbatches);
    // (time, release-before-allocate at equal times, sequence, delta)
    let mut events: Vec<(f64, u8, usize, i128)> = Vec::new();
    let mut last_fwd_end = vec![0.0f64; m * s.virtual_stages];
    let mb = |a: Action| a.chunk() * m + a.unit().micro_batch;
    for sl in slots {
        if sl.action.op() == Op::Forward && sl.action.unit().segment + 1 == k {
            last_fwd_end[mb(sl.action)] = sl.end;
        }
    }
    for (seq, sl) in slots.iter().enumerate() {
        let n = size(sl.action);
        match sl.action.op() {
            Op::Forward => {
                events.push((sl.start, 1, seq, n));
                if s.forward_only {
                    events.push((last_fwd_end[mb(sl.action)], 0, seq, -n));
                }
            }
            Op::Backward | Op::BackwardWeight => events.push((sl.end, 0, seq, -n)),
            _ => {}
        }
    }
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let (mut live, mut peak) = (0i128, 0i128);
    for (_, _, _, delta) in events {
        live += delta;
        peak = peak.max(live);
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::super::{ScheduleKind, Unit, generate, generate_forward_only};
    use super::*;

    fn bubble(kind: ScheduleKind, p: usize, m: usize, k: usize) -> f64 {
        let s = generate(kind, p, m, k).unwrap();
        simulate(&s, &UnitCosts::uniform(k, 1))
            .unwrap()
            .bubble_fraction
    }

    #[test]
    fn bubble_matches_the_paper_formulas() {
        let (p, m, k) = (4usize, 8usize, 4usize);
        let seq = bubble(ScheduleKind::Seq1F1B, p, m, k);
        let want = (p - 1) as f64 / (m * k + p - 1) as f64;
        assert!((seq - want).abs() < 0.01, "seq1f1b {seq} vs {want}");
        let one = bubble(ScheduleKind::OneFOneB, p, m, 1);
        let want1 = (p - 1) as f64 / (m + p - 1) as f64;
        assert!((one - want1).abs() < 0.01, "1f1b {one} vs {want1}");
        assert!(seq < one);
        // GPipe has the same bubble as 1F1B at equal unit counts; memory is what differs.
        let g = bubble(ScheduleKind::GPipe, p, m, 1);
        assert!((g - want1).abs() < 0.01, "gpipe {g} vs {want1}");
        // A single stage never idles.
        assert_eq!(bubble(ScheduleKind::Seq1F1B, 1, 3, 3), 0.0);
    }

    #[test]
    fn bubble_formula_over_many_shapes() {
        for p in 1..=6 {
            for m in p..=8 {
                for k in 1..=4 {
                    let got = bubble(ScheduleKind::Seq1F1B, p, m, k);
                    let want = (p - 1) as f64 / (m * k + p - 1) as f64;
                    assert!(
                        (got - want).abs() < 1e-9,
                        "p={p} m={m} k={k}: {got} vs {want}"
                    );
                    let zb = ScheduleKind::Seq1F1BZeroBubble;
                    let (got, want) = (bubble(zb, p, m, k), formula_bubble(zb, p, 1, m, k));
                    assert!(
                        (got - want).abs() < 1e-9,
                        "zb p={p} m={m} k={k}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn seq1f1b_first_stage_holds_fewer_activations() {
        let (p, m, k, tokens_per_mb) = (4, 8, 4, 1024);
        let seq = generate(ScheduleKind::Seq1F1B, p, m, k).unwrap();
        let seq_sim = simulate(&seq, &UnitCosts::uniform(k, tokens_per_mb / k)).unwrap();
        let one = generate(ScheduleKind::OneFOneB, p, m, 1).unwrap();
        let one_sim = simulate(&one, &UnitCosts::uniform(1, tokens_per_mb)).unwrap();
        let s0 = seq_sim.stages[0].peak_activation_tokens;
        let o0 = one_sim.stages[0].peak_activation_tokens;
        assert!(s0 < o0, "seq1f1b {s0} vs 1f1b {o0}");
        // Paper: p micro-batches for 1F1B, (k+p-1)/k micro-batches for Seq1F1B.
        assert_eq!(o0, p * tokens_per_mb);
        assert_eq!(s0, (k + p - 1) * tokens_per_mb / k);
        assert_eq!(seq_sim.stages[0].peak_inflight_units, k + p - 1);
        assert_eq!(one_sim.stages[0].peak_inflight_units, p);
        // GPipe keeps everything.
        let g = generate(ScheduleKind::GPipe, p, m, k).unwrap();
        let g_sim = simulate(&g, &UnitCosts::uniform(k, tokens_per_mb / k)).unwrap();
        assert_eq!(g_sim.stages[0].peak_activation_tokens, m * tokens_per_mb);
    }

    #[test]
    fn forward_only_keeps_one_microbatch_prefix() {
        let s = generate_forward_only(3, 4, 4).unwrap();
        let sim = simulate(&s, &UnitCosts::uniform(4, 10)).unwrap();
        for st in &sim.stages {
            assert_eq!(st.peak_inflight_units, 4, "{st:?}");
            assert_eq!(st.peak_activation_tokens, 40, "{st:?}");
        }
        // Forward only: 16 units of cost 1, pipelined over 3 stages.
        assert!((sim.step_time - 18.0).abs() < 1e-12);
    }

    #[test]
    fn timeline_respects_dependencies_and_order() {
        let s = generate(ScheduleKind::Seq1F1B, 4, 3, 2).unwrap();
        let costs = UnitCosts {
            forward: vec![1.0, 1.5],
            backward: vec![2.0, 3.0],
            tokens: vec![8, 8],
        };
        let sim = simulate(&s, &costs).unwrap();
        for r in 0..4 {
            let tl = &sim.timeline[r];
            assert_eq!(tl.len(), 12);
            for w in tl.windows(2) {
                assert!(w[0].end <= w[1].start + 1e-12);
            }
            for sl in tl {
                let dep = match sl.action {
                    Action::Forward(_) if r > 0 => Some(r - 1),
                    Action::Backward(_) if r < 3 => Some(r + 1),
                    _ => None,
                };
                if let Some(q) = dep {
                    let other = sim.timeline[q]
                        .iter()
                        .find(|o| o.action == sl.action)
                        .unwrap();
                    assert!(other.end <= sl.start + 1e-12, "{} on {r}", sl.action);
                }
            }
            let busy = sim.stages[r].busy;
            assert!((busy - 3.0 * (1.0 + 1.5 + 2.0 + 3.0)).abs() < 1e-12);
        }
        let max_end = sim
            .timeline
            .iter()
            .flatten()
            .map(|s| s.end)
            .fold(0.0, f64::max);
        assert_eq!(sim.step_time, max_end);
    }

    #[test]
    fn bad_costs_are_rejected() {
        let s = generate(ScheduleKind::Seq1F1B, 2, 2, 2).unwrap();
        let e = simulate(&s, &UnitCosts::uniform(3, 1)).unwrap_err();
        assert!(e.to_string().contains("3 entries"), "{e}");
        let mut c = UnitCosts::uniform(2, 1);
        c.backward[1] = f64::NAN;
        let e = simulate(&s, &c).unwrap_err();
        assert!(e.to_string().contains("backward[1]"), "{e}");
    }

    #[test]
    fn replay_of_uniform_times_is_the_simulation() {
        let s = generate(ScheduleKind::Seq1F1B, 4, 4, 2).unwrap();
        let costs = UnitCosts {
            forward: vec![1.0, 1.5],
            backward: vec![2.0, 3.0],
            tokens: vec![8, 8],
        };
        let durations = (0..4)
            .map(|r| {
                s.compute_actions(r)
                    .map(|a| match a {
                        Action::Forward(u) => (a, costs.forward[u.segment]),
                        _ => (a, costs.backward[a.unit().segment]),
                    })
                    .collect()
            })
            .collect();
        let measured = MeasuredCosts {
            durations,
            tokens: costs.tokens.clone(),
        };
        assert_eq!(
            replay(&s, &measured).unwrap(),
            simulate(&s, &costs).unwrap()
        );
    }

    #[test]
    fn replay_follows_the_slowest_stage() {
        // Stage 1 takes twice as long for everything: the step is bound by it and the other
        // stages idle; every measured action must be present.
        let s = generate(ScheduleKind::OneFOneB, 3, 6, 1).unwrap();
        let mut measured = MeasuredCosts {
            durations: (0..3)
                .map(|r| {
                    let scale = if r == 1 { 2.0 } else { 1.0 };
                    s.compute_actions(r)
                        .map(|a| (a, scale * if a.is_backward_pass() { 2.0 } else { 1.0 }))
                        .collect()
                })
                .collect(),
            tokens: vec![4],
        };
        let sim = replay(&s, &measured).unwrap();
        assert!(sim.step_time >= 6.0 * 6.0, "{}", sim.step_time);
        assert!(sim.stages[1].bubble_fraction < sim.stages[0].bubble_fraction);
        measured.durations[2].remove(&Action::Backward(Unit::new(5, 0)));
        let e = replay(&s, &measured).unwrap_err();
        assert!(
            e.to_string().contains("stage 2: no measured time for B5.0"),
            "{e}"
        );
    }

    #[test]
    fn flops_costs_are_normalised() {
        let m = FlopsModel {
            layers: 2,
            hidden: 64,
            heads: 4,
            head_dim: 16,
            ffn: 256,
            vocab: 100,
            attention_cost: 1.0,
        };
        let c = UnitCosts::from_flops(&[64, 64], 2, &m);
        assert!((c.forward.iter().sum::<f64>() - 2.0).abs() < 1e-12);
        assert!(
            c.forward[1] > c.forward[0],
            "later segments attend to more keys"
        );
        assert_eq!(c.tokens, vec![128, 128]);
        assert_eq!(c.backward[0], 2.0 * c.forward[0]);
    }
}
